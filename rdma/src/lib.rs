pub mod verbs;
pub mod block;
mod transport;
pub use transport::{RdmaConfig, RdmaTransport, DEFAULT_RENDEZVOUS_THRESHOLD};
