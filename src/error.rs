use crate::ObjectId;
use phalanx_transport::{NodeId, TransportError};

/// Errors of the object store API.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("object {0} not found")]
    NotFound(ObjectId),
    /// Every copy of the object was on nodes that died (none complete and none being
    /// produced is left), and no producer reset it or put it again within
    /// `NodeConfig::lost_after`: it exists no more until it is put again.
    #[error("object {0} lost: every copy was on nodes that died")]
    ObjectLost(ObjectId),
    #[error("object {0} already exists on this node")]
    AlreadyExists(ObjectId),
    #[error("object of {requested} bytes does not fit in the arena ({free} of {capacity} bytes free after evicting every unpinned copy)")]
    OutOfMemory {
        requested: u64,
        free: u64,
        capacity: u64,
    },
    #[error("timed out after {0:?} waiting for {1}")]
    Timeout(std::time::Duration, String),
    #[error("peer {0} is down")]
    PeerDown(NodeId),
    #[error("protocol error from node {peer}: {what}")]
    Protocol { peer: NodeId, what: String },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A collective this node reads failed at its coordinator (bad inputs, a timeout): what
    /// the coordinator said.
    #[error("{0} failed at its coordinator: {1}")]
    CoordinatorFailed(ObjectId, String),
    #[error("node is shut down")]
    Shutdown,
    #[error("configuration: {0}")]
    Config(String),
    #[error("transport: {0}")]
    Transport(#[from] TransportError),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
