//! Control messages between nodes (bincode over the transport's control channel), split by
//! the subsystem that handles them: the node dispatches on the family, and each subsystem
//! matches its own family exhaustively, so a message routed to the wrong handler does not
//! compile.

mod directory;
mod member;
mod pull;
mod reduce;
mod reply;

pub use directory::{DirMsg, Located, LocationInfo, ObjectInfo};
pub use member::MemberMsg;
pub use pull::PullMsg;
pub use reduce::{GatherFrom, HalvingPlan, ReduceMsg, ReduceTask};
pub use reply::Reply;

use crate::ObjectId;
use serde::{Deserialize, Serialize};

/// A request id, unique per calling node; replies echo it.
pub type Rid = u64;

/// Requests to the node that holds a copy, about that copy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StoreMsg {
    /// Drop the local copy of `id` (a delete).
    Evict { rid: Rid, id: ObjectId },
}

/// Every control message, by family.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Msg {
    /// To the directory shard that owns the object.
    Dir(DirMsg),
    /// Between a receiver and the source it pulls from.
    Pull(PullMsg),
    /// From a reduce coordinator to the node of a tree position.
    Reduce(ReduceMsg),
    /// To a holder of a copy.
    Store(StoreMsg),
    /// About who is alive.
    Member(MemberMsg),
    /// The answer to a request that carried `rid`.
    Reply { rid: Rid, reply: Reply },
}

impl From<DirMsg> for Msg {
    fn from(m: DirMsg) -> Msg {
        Msg::Dir(m)
    }
}

impl From<PullMsg> for Msg {
    fn from(m: PullMsg) -> Msg {
        Msg::Pull(m)
    }
}

impl From<ReduceMsg> for Msg {
    fn from(m: ReduceMsg) -> Msg {
        Msg::Reduce(m)
    }
}

impl From<MemberMsg> for Msg {
    fn from(m: MemberMsg) -> Msg {
        Msg::Member(m)
    }
}

impl From<StoreMsg> for Msg {
    fn from(m: StoreMsg) -> Msg {
        Msg::Store(m)
    }
}

impl Msg {
    /// The message's kind, for traces.
    pub fn kind(&self) -> &'static str {
        match self {
            Msg::Dir(m) => match m {
                DirMsg::Publish { .. } => "Publish",
                DirMsg::PublishRun { .. } => "PublishRun",
                DirMsg::PutInline { .. } => "PutInline",
                DirMsg::Locate { .. } => "Locate",
                DirMsg::Claim { .. } => "Claim",
                DirMsg::CancelLocate { .. } => "CancelLocate",
                DirMsg::TransferDone { .. } => "TransferDone",
                DirMsg::Withdraw { .. } => "Withdraw",
                DirMsg::Query { .. } => "Query",
                DirMsg::Subscribe { .. } => "Subscribe",
                DirMsg::Delete { .. } => "Delete",
                DirMsg::Reset { .. } => "Reset",
                DirMsg::Promise { .. } => "Promise",
                DirMsg::GiveUp { .. } => "GiveUp",
                DirMsg::Backup { .. } => "Backup",
                DirMsg::Tombstone { .. } => "Tombstone",
            },
            Msg::Pull(m) => match m {
                PullMsg::Pull { .. } => "Pull",
                PullMsg::CancelPull { .. } => "CancelPull",
                PullMsg::PullEnd { .. } => "PullEnd",
            },
            Msg::Reduce(ReduceMsg::Task { .. }) => "ReduceTask",
            Msg::Reduce(ReduceMsg::Cancel { .. }) => "CancelReduce",
            Msg::Reduce(ReduceMsg::Gather { .. }) => "GatherHint",
            Msg::Reduce(ReduceMsg::HalvingTask { .. }) => "HalvingTask",
            Msg::Reduce(ReduceMsg::HalvingBlock { .. }) => "HalvingBlock",
            Msg::Reduce(ReduceMsg::HalvingEnd { .. }) => "HalvingEnd",
            Msg::Reduce(ReduceMsg::HalvingFailed { .. }) => "HalvingFailed",
            Msg::Reduce(ReduceMsg::HalvingDone { .. }) => "HalvingDone",
            Msg::Store(StoreMsg::Evict { .. }) => "Evict",
            Msg::Member(MemberMsg::Down { .. }) => "MemberDown",
            Msg::Member(MemberMsg::Up { .. }) => "MemberUp",
            Msg::Member(MemberMsg::Ping { .. }) => "Ping",
            Msg::Member(MemberMsg::Watch) => "Watch",
            Msg::Reply { .. } => "Reply",
        }
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
        let m = Msg::Dir(DirMsg::Locate {
            rid: 7,
            id: "x".into(),
            wait: true,
            resume: false,
            exclude: vec![1, 2],
            epoch: Some(3),
        });
        assert_eq!(Msg::decode(&m.encode()).unwrap(), m);
        assert!(Msg::decode(&[0xff; 3]).is_err());
        // A length prefix claiming 2^60 bytes must not allocate.
        let mut evil = Msg::Dir(DirMsg::PutInline {
            rid: 1,
            id: "y".into(),
            node: 0,
            data: vec![],
            then_subscribe: None,
        })
        .encode();
        let n = evil.len();
        evil[n - 8..].copy_from_slice(&(1u64 << 60).to_le_bytes());
        assert!(Msg::decode(&evil).is_err());
    }

    #[test]
    fn every_family_roundtrips() {
        let msgs = [
            Msg::Pull(PullMsg::PullEnd {
                stream: 3,
                ok: true,
            }),
            Msg::Reduce(ReduceMsg::Cancel {
                out: "o".into(),
                attempt: 9,
            }),
            Msg::Reduce(ReduceMsg::Gather {
                part: "p".into(),
                from: GatherFrom::Node(3),
            }),
            Msg::Reduce(ReduceMsg::HalvingBlock {
                target: "t".into(),
                run: 7,
                step: 2,
                data: vec![1, 2, 3],
            }),
            Msg::Reduce(ReduceMsg::HalvingTask {
                plan: HalvingPlan {
                    target: "t".into(),
                    run: 7,
                    coordinator: 1,
                    ranks: vec![(1, "a".into()), (4, "b".into())],
                    size: 64,
                    op: crate::ops::ReduceOp::Max,
                    dtype: crate::ops::DType::I64,
                    reduce: true,
                },
            }),
            Msg::Store(StoreMsg::Evict {
                rid: 9,
                id: "e".into(),
            }),
            Msg::Reply {
                rid: 4,
                reply: Reply::Deleted(vec![1, 2]),
            },
        ];
        for m in msgs {
            assert_eq!(Msg::decode(&m.encode()).unwrap(), m);
        }
    }
}
