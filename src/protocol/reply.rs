//! Replies to requests of every family.

use crate::protocol::{Located, ObjectInfo};
use phalanx_transport::NodeId;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    Ack,
    Located(Located),
    Info(Option<ObjectInfo>),
    /// Nodes that held a copy of a deleted object.
    Deleted(Vec<NodeId>),
    Error(String),
}
