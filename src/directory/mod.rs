//! The object directory: each node runs one shard (a state machine over the entries it owns)
//! and every subsystem reaches the shards through the client.

mod client;
mod held;
mod kept;
mod promises;
mod queued;
mod shard;

pub(crate) use client::{DirClient, Resume};
pub use shard::{Assignment, Out, Shard, INLINE_FANOUT, NO_REPLY};
