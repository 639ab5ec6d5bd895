//! Control messages between nodes (bincode over the transport's control channel).

use crate::ops::{DType, ReduceOp};
use crate::ObjectId;
use phalanx_transport::{NodeId, RemoteRegion, StreamId};
use serde::{Deserialize, Serialize};

/// A request id, unique per calling node; replies echo it.
pub type Rid = u64;

/// Where a location query sent the requester.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Located {
    /// A small object, served by the directory itself.
    Inline(Vec<u8>),
    /// Pull `size` bytes from `node`; the requester is now listed as a partial copy. `token`
    /// names this assignment: the matching `TransferDone` releases the source, a stale one
    /// does not.
    Source { node: NodeId, size: u64, token: u64 },
    /// The requester itself holds a copy (a local producer, or a concurrent local get).
    Local,
    /// Deleted, or the requester asked not to wait and nothing is there.
    NotFound,
}

/// One location of an object, as the directory sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocationInfo {
    pub node: NodeId,
    pub complete: bool,
    /// The receiver this copy is serving now, if any.
    pub serving: Option<NodeId>,
    /// The source this (partial) copy is filled from, if any.
    pub depends_on: Option<NodeId>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectInfo {
    pub size: u64,
    pub inline: bool,
    pub locations: Vec<LocationInfo>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    Ack,
    Located(Located),
    Info(Option<ObjectInfo>),
    /// Nodes that held a copy of a deleted object.
    Deleted(Vec<NodeId>),
    Error(String),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Msg {
    // ---- directory (sent to the shard owner of the object) ----
    /// A copy of `id` exists on `node` (partial, or complete).
    Publish {
        id: ObjectId,
        size: u64,
        node: NodeId,
        complete: bool,
    },
    /// Stores a small object in the directory.
    PutInline {
        rid: Rid,
        id: ObjectId,
        node: NodeId,
        data: Vec<u8>,
    },
    /// Hands the requester one source (reserving it) or the inline bytes; with `wait`, held
    /// until the object exists and a source is free. `exclude` lists sources that failed;
    /// `resume` is set when the requester's own partial copy needs a new source.
    Locate {
        rid: Rid,
        id: ObjectId,
        wait: bool,
        resume: bool,
        exclude: Vec<NodeId>,
    },
    /// The receiver finished (or abandoned) its pull from `source`; the source is free again.
    TransferDone {
        id: ObjectId,
        source: NodeId,
        receiver: NodeId,
        token: u64,
        ok: bool,
    },
    /// `node` no longer holds `id` (evicted, or its transfer failed).
    Withdraw {
        id: ObjectId,
        node: NodeId,
    },
    /// Synchronous query: the entry as it stands.
    Query {
        rid: Rid,
        id: ObjectId,
    },
    /// Asynchronous query: answered with `Reply::Info` once the object has a location (at once
    /// if it has one), or `Info(None)` if it is deleted first.
    Subscribe {
        rid: Rid,
        id: ObjectId,
    },
    /// Removes the entry; the reply lists the nodes to evict from.
    Delete {
        rid: Rid,
        id: ObjectId,
    },
    /// Forgets every copy of an object that will be produced again with other bytes (a
    /// reduce target recomputed after a failure): like `Delete`, but readers and subscribers
    /// keep waiting for the new copy instead of being told it is gone.
    Reset {
        rid: Rid,
        id: ObjectId,
    },

    // ---- data plane ----
    /// Please write bytes `[from, size)` of `id` into `dst`, tagged `stream`.
    Pull {
        id: ObjectId,
        stream: StreamId,
        dst: RemoteRegion,
        from: u64,
    },
    /// The receiver gives up on `stream`; the sender stops and answers `PullEnd`.
    CancelPull {
        stream: StreamId,
    },
    /// The sender will write no more for `stream` (all sent when `ok`).
    PullEnd {
        stream: StreamId,
        ok: bool,
    },
    /// Drop the local copy of `id` (a delete).
    Evict {
        rid: Rid,
        id: ObjectId,
    },

    /// Compute one position of a reduce tree: `out = own ⊕ children...`, streamed.
    ReduceTask {
        rid: Rid,
        task: ReduceTask,
    },
    /// Stop the reduce task producing `out` (its result is discarded).
    CancelReduce {
        out: ObjectId,
    },

    Reply {
        rid: Rid,
        reply: Reply,
    },
}

/// The work of one tree position of a reduce.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReduceTask {
    /// The object this position produces (the reduce target at the root).
    pub out: ObjectId,
    /// The input held by this node.
    pub own: ObjectId,
    /// Objects produced by the children, combined in this order.
    pub children: Vec<ObjectId>,
    pub size: u64,
    pub op: ReduceOp,
    pub dtype: DType,
    /// Bytes combined per step (a multiple of the element size).
    pub chunk: u64,
}

impl Msg {
    /// Whether the directory shard handles this message.
    pub fn is_directory(&self) -> bool {
        matches!(
            self,
            Msg::Publish { .. }
                | Msg::PutInline { .. }
                | Msg::Locate { .. }
                | Msg::TransferDone { .. }
                | Msg::Withdraw { .. }
                | Msg::Query { .. }
                | Msg::Subscribe { .. }
                | Msg::Delete { .. }
                | Msg::Reset { .. }
        )
    }

    pub fn encode(&self) -> Vec<u8> {
        bincode::serialize(self).expect("messages always serialise")
    }

    /// Decodes a message, bounding allocations by the frame length.
    pub fn decode(b: &[u8]) -> Result<Msg, String> {
        use bincode::Options;
        bincode::DefaultOptions::new()
            .with_fixint_encoding()
            .allow_trailing_bytes()
            .with_limit(b.len() as u64 + 64)
            .deserialize(b)
            .map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_garbage() {
        let m = Msg::Locate {
            rid: 7,
            id: "x".into(),
            wait: true,
            resume: false,
            exclude: vec![1, 2],
        };
        assert_eq!(Msg::decode(&m.encode()).unwrap(), m);
        assert!(Msg::decode(&[0xff; 3]).is_err());
        // A length prefix claiming 2^60 bytes must not allocate.
        let mut evil = Msg::PutInline {
            rid: 1,
            id: "y".into(),
            node: 0,
            data: vec![],
        }
        .encode();
        let n = evil.len();
        evil[n - 8..].copy_from_slice(&(1u64 << 60).to_le_bytes());
        assert!(Msg::decode(&evil).is_err());
    }
}
