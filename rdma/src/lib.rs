//! Phalanx verbs transport: a small safe layer over libibverbs, loaded at run time
//! ([`verbs`], [`verbs::sys`]), the eager block
//! codec ([`block`]) and [`RdmaTransport`], the InfiniBand/RoCE implementation of
//! [`phalanx_transport::Transport`]. See `README.md` for the design and the ring layout.

pub mod block;
pub mod info;
pub mod topology;
mod transport;
pub mod verbs;

pub use transport::{
    RdmaConfig, RdmaTransport, DEFAULT_RENDEZVOUS_THRESHOLD, ON_DEMAND_IDLE_TIMEOUT,
};

/// Whether this host has any RDMA device (tests skip without one).
pub fn rdma_available() -> bool {
    !verbs::device_names().is_empty()
}
