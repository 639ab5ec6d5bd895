//! Replies to requests of every family.

use crate::protocol::{Located, ObjectInfo};
use phalanx_transport::NodeId;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    Ack,
    Located(Located),
    Info(Option<ObjectInfo>),
    /// A subscription's answer for a small object: the entry and the object's bytes.
    InfoInline(ObjectInfo, #[serde(with = "serde_bytes")] Vec<u8>),
    /// Nodes that held a copy of a deleted object.
    Deleted(Vec<NodeId>),
    Error(String),
}
