//! The reduce family: a coordinator and the nodes that compute tree positions.

use crate::ops::{DType, ReduceOp};
use crate::protocol::Rid;
use crate::ObjectId;
use phalanx_transport::NodeId;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReduceMsg {
    /// Compute one position of a reduce tree: `out = own ⊕ children...`, streamed; the reply
    /// (`Ack` or `Error`) comes when it is done.
    Task { rid: Rid, task: ReduceTask },
    /// Stop the reduce task producing `out` that was dispatched as `attempt` (its result is
    /// discarded, no reply). A later dispatch under the same output name (the root's, after
    /// a repair) has another attempt and is not stopped by it.
    Cancel { out: ObjectId, attempt: u64 },
    /// Where this node fetches partition `part` of a partitioned allreduce from for its copy
    /// of the result (sent by the partition's coordinator once its chain is placed; see
    /// `crate::reduce::Run::gather_hints`). Advice: a stale or forged one costs a fallback
    /// to the directory, never a wrong byte.
    Gather { part: ObjectId, from: GatherFrom },
    /// Run your rank of a halving-doubling allreduce, or of a halving reduce
    /// (`crate::reduce::halving`): sent by the run's coordinator to every other rank.
    HalvingTask { plan: HalvingPlan },
    /// Bytes of step `step` of run `run` of the halving-doubling allreduce into `target`,
    /// pushed by the sender's rank to its partner.
    HalvingBlock {
        target: ObjectId,
        run: u64,
        step: u32,
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
    },
    /// The coordinator's word on run `run`: `commit` (its own rank has the result: every
    /// rank with the result stores and announces `target`), or not (the run is abandoned and
    /// `target` comes from a tree instead; ranks drop what they computed).
    HalvingEnd {
        target: ObjectId,
        run: u64,
        commit: bool,
        /// `HalvingPlan::digest` of the coordinator's plan: a rank commits only the plan it
        /// runs if that is the one (a plan another node forged in the coordinator's name
        /// never commits).
        plan: [u8; 16],
    },
    /// A rank to the coordinator: its part of run `run` failed (a partner died, a block never
    /// came or was malformed, its input was gone).
    HalvingFailed { target: ObjectId, run: u64 },
    /// A rank to the coordinator of an allreduce run: it has had the whole result of the
    /// plan of digest `plan` (so every block was reduced from every input) for a while, and
    /// no word. The coordinator's own rank completing, or the first such word, commits the
    /// run.
    HalvingDone {
        target: ObjectId,
        run: u64,
        plan: [u8; 16],
    },
}

/// A halving-doubling allreduce as its coordinator planned it: rank `k` is the node
/// `ranks[k].0` holding input `ranks[k].1`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HalvingPlan {
    pub target: ObjectId,
    /// Tells this run's messages from another's (a run abandoned and begun again).
    pub run: u64,
    pub coordinator: NodeId,
    pub ranks: Vec<(NodeId, ObjectId)>,
    pub size: u64,
    pub op: ReduceOp,
    pub dtype: DType,
    /// A reduce, not an allreduce: the result ends at the coordinator alone (a main rank of
    /// the schedule), to which every other main rank sends its reduced block instead of the
    /// allgather; nothing is committed at the other ranks.
    pub reduce: bool,
}

impl HalvingPlan {
    /// The first 16 bytes of the SHA-256 of the plan's encoding: names this very plan.
    pub fn digest(&self) -> [u8; 16] {
        use sha2::{Digest, Sha256};
        let enc = bincode::serialize(self).expect("plans always serialise");
        let h = Sha256::digest(&enc);
        let mut d = [0u8; 16];
        d.copy_from_slice(&h[..16]);
        d
    }
}

/// Where a participant of a partitioned allreduce fetches one partition from: along the
/// partition's own chain, so that every link carries the partitions of the allgather once,
/// as a ring does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GatherFrom {
    /// This node produces the partition (it roots the chain).
    Here,
    /// From this node, which holds or fetches it before this one does.
    Node(NodeId),
}

/// The work of one tree position of a reduce.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReduceTask {
    /// The object this position produces (the reduce target at the root).
    pub out: ObjectId,
    /// This dispatch of the position (a token fresh for each one): what a `Cancel` names.
    pub attempt: u64,
    /// The input held by this node.
    pub own: ObjectId,
    /// Where this position's bytes start in `own` (a partition of it; 0: all of it).
    pub own_offset: u64,
    /// Objects produced by the children, combined in this order.
    pub children: Vec<ObjectId>,
    /// The node each child runs on (it holds or produces that child's object): the task
    /// pulls from it at once instead of asking the directory first. The task's own node
    /// stands for a child not placed yet when the task was sent (a by-arrival tree's root
    /// starts before its last input comes): the task asks the directory for it, and waits
    /// until it is there.
    pub children_at: Vec<NodeId>,
    pub size: u64,
    pub op: ReduceOp,
    pub dtype: DType,
    /// Bytes combined per step (a multiple of the element size).
    pub chunk: u64,
    /// `out` is the reduce's result (the root): the task answers only once the directory
    /// has its completion, so a reader anywhere finds it as soon as the reduce returns
    /// (the shard may be a third node, and the name may have been deleted just before).
    pub result: bool,
}
