//! A small safe layer over libibverbs, loaded at run time ([`sys`]): one module per verbs
//! object.
//!
//! Ownership encodes the teardown order the verbs API requires. Every child object holds an
//! `Arc` of its parent, so a parent outlives its children whatever order the user drops them
//! in: a [`QueuePair`] keeps its [`ProtectionDomain`] and [`CompletionQueue`] alive, a
//! [`MemoryRegion`] keeps its protection domain and the memory it covers alive, and all of
//! them keep the [`Context`] (the open device) alive. Raw handles never leave this module.
//!
//! All verbs objects are thread safe in libibverbs (providers serialise internally), so the
//! wrappers are `Send + Sync`.

mod cq;
mod device;
mod mr;
mod mw;
mod pd;
mod qp;
mod srq;
pub mod sys;

pub use cq::{CompletionChannel, CompletionQueue, WorkCompletion};
pub use device::{
    device_names, list_devices, Context, GidInfo, PortInfo, LINK_LAYER_ETHERNET,
    LINK_LAYER_INFINIBAND,
};
pub use mr::{Access, MemoryRegion};
pub use mw::MemoryWindow;
pub use pd::ProtectionDomain;
pub use qp::{QpEndpoint, QpState, QueuePair, RcParams};
pub use srq::SharedReceiveQueue;

use std::io;

/// Errors of the verbs layer.
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// libibverbs could not be loaded (not installed, or too old).
    #[error("{0}")]
    Library(#[from] sys::LoadError),
    #[error("no RDMA device found")]
    NoDevice,
    #[error("RDMA device {0:?} not found")]
    DeviceNotFound(String),
    #[error("{call} failed: {source}")]
    Call {
        call: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{0}")]
    Invalid(String),
}

impl VerbsError {
    /// The error of a verbs call that reports failure through `errno` (NULL/-1 returns).
    pub(crate) fn errno(call: &'static str) -> VerbsError {
        VerbsError::Call {
            call,
            source: io::Error::last_os_error(),
        }
    }

    /// The error of a verbs call that returns the error number itself (0 on success).
    pub(crate) fn code(call: &'static str, rc: i32) -> VerbsError {
        let rc = if rc < 0 { -rc } else { rc };
        VerbsError::Call {
            call,
            source: io::Error::from_raw_os_error(rc),
        }
    }
}

impl From<VerbsError> for phalanx_transport::TransportError {
    fn from(e: VerbsError) -> Self {
        phalanx_transport::TransportError::Setup(e.to_string())
    }
}
