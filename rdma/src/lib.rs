pub mod verbs;
pub mod block;
