use crate::NodeId;

/// Errors of the transport layer.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("peer {0} is not connected")]
    PeerUnavailable(NodeId),
    #[error("peer {peer} failed: {reason}")]
    PeerFailed { peer: NodeId, reason: String },
    #[error("control message of {len} bytes exceeds the limit of {max}")]
    MessageTooLarge { len: usize, max: usize },
    #[error("range {offset}+{len} outside a region of {region_len} bytes")]
    OutOfBounds {
        offset: u64,
        len: u64,
        region_len: u64,
    },
    #[error("no arena registered")]
    NoArena,
    #[error("arena already registered")]
    ArenaAlreadyRegistered,
    #[error("malformed frame: {0}")]
    Malformed(String),
    #[error("transport is shut down")]
    Shutdown,
    #[error("connection setup failed: {0}")]
    Setup(String),
    #[error("link authentication failed: {0}")]
    Auth(#[from] crate::auth::AuthError),
    #[error("write refused: {0}")]
    Forbidden(String),
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
}
