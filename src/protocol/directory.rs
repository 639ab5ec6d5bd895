//! The directory family: requests to the shard that owns an object's entry, and what the
//! shard answers with.

use crate::protocol::Rid;
use crate::ObjectId;
use phalanx_transport::NodeId;
use serde::{Deserialize, Serialize};

/// Where a location query sent the requester.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Located {
    /// A small object, served by the directory itself.
    Inline(#[serde(with = "serde_bytes")] Vec<u8>),
    /// Pull `size` bytes from `node`; the requester is now listed as a partial copy. `token`
    /// names this assignment: the matching `TransferDone` releases the source, a stale one
    /// does not. `epoch` counts the resets of the object at the shard (`DirMsg::Reset`): the
    /// requester's bytes belong to that computation of it.
    Source {
        node: NodeId,
        size: u64,
        token: u64,
        epoch: u64,
    },
    /// [`Located::Source`] answered by the source itself: the shard's node holds a complete
    /// copy of a medium object and sends its bytes with the answer (no pull round trip).
    /// The assignment is the same: the requester is a partial copy until its `TransferDone`
    /// under `token`, which also frees the source; the requester sends it where the answer
    /// lands, as soon as its caller has it, and withdraws a copy that cannot keep the bytes.
    SourceData {
        node: NodeId,
        size: u64,
        token: u64,
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
    },
    /// The requester itself holds a copy (a local producer, or a concurrent local get).
    Local,
    /// Deleted, or the requester asked not to wait and nothing is there.
    NotFound,
    /// The object was reset (it is being computed again) since the requester's partial copy
    /// began: those bytes belong to the old computation, so the copy is dropped and the
    /// object fetched again (answers a `resume` locate only).
    Reset,
    /// Every copy died with its node, and nothing reset or published the object since
    /// (`Shard::tick`): it is gone until it is put again.
    Lost,
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
    /// Every copy died and none was published or reset since (`Error::ObjectLost`): the
    /// locations left, if any, are partial copies that cannot complete.
    pub lost: bool,
}

/// Messages to the directory shard that owns the object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DirMsg {
    /// A copy of `id` exists on `node` (partial, or complete).
    Publish {
        id: ObjectId,
        size: u64,
        node: NodeId,
        complete: bool,
    },
    /// Stores a small object in the directory. With a `rid` (not `NO_REPLY`) the put is
    /// answered: `Ack`, or, with `then_subscribe`, the answer a `Subscribe` of that object
    /// (on the same shard) would get, as soon as it has one: a participant of an allreduce
    /// hands in its input and asks for the result in one message (`Node::allreduce_join`).
    /// A put refused is answered with the error either way.
    PutInline {
        rid: Rid,
        id: ObjectId,
        node: NodeId,
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
        then_subscribe: Option<ObjectId>,
    },
    /// Hands the requester one source (reserving it) or the inline bytes; with `wait`, held
    /// until the object exists and a source is free. `exclude` lists sources that failed;
    /// `resume` is set when the requester's own partial copy needs a new source, with the
    /// `epoch` of its bytes when it knows it (from its `Located::Source`): a copy begun
    /// before a reset is answered `Located::Reset`, never handed a source of the new bytes.
    Locate {
        rid: Rid,
        id: ObjectId,
        wait: bool,
        resume: bool,
        exclude: Vec<NodeId>,
        epoch: Option<u64>,
    },
    /// `receiver` pulls `id` from `source`, which it already knew (a reduce task told where
    /// its child's input lives), without asking: the shard accounts for it as for an
    /// assignment it made (the source serves `receiver` under `token`, the receiver is listed
    /// as a partial copy filled from it). A source busy with another receiver keeps that one;
    /// a claim on a source the shard has not heard of yet waits for its `Publish`.
    Claim {
        id: ObjectId,
        source: NodeId,
        receiver: NodeId,
        token: u64,
    },
    /// The requester gave up waiting on its `Locate` number `rid` (its call timed out): the
    /// shard forgets the waiter, or releases the source it was already assigned.
    CancelLocate { id: ObjectId, rid: Rid },
    /// The receiver finished (or abandoned) its pull from `source`; the source is free again.
    TransferDone {
        id: ObjectId,
        source: NodeId,
        receiver: NodeId,
        token: u64,
        ok: bool,
    },
    /// `node` no longer holds `id` (evicted, or its transfer failed).
    Withdraw { id: ObjectId, node: NodeId },
    /// Synchronous query: the entry as it stands.
    Query { rid: Rid, id: ObjectId },
    /// Asynchronous query: answered with `Reply::Info` once the object has a location (at once
    /// if it has one), or `Info(None)` if it is deleted first.
    Subscribe { rid: Rid, id: ObjectId },
    /// Removes the entry; the reply lists the nodes to evict from.
    Delete { rid: Rid, id: ObjectId },
    /// Forgets every copy of an object that will be produced again with other bytes (a
    /// reduce target recomputed after a failure): like `Delete`, but readers and subscribers
    /// keep waiting for the new copy instead of being told it is gone.
    Reset { rid: Rid, id: ObjectId },
    /// `node` will produce `id` (it coordinates the reduce whose target it is), or with
    /// `promised` false no longer will (the reduce failed): an object whose only producer
    /// dies, or takes its promise back, before any copy of it can complete is lost
    /// (`Located::Lost`) instead of awaited for ever, as one whose last copy died is. Not a
    /// copy: locates still wait for one.
    Promise {
        id: ObjectId,
        node: NodeId,
        promised: bool,
    },
    /// `node` was to produce `id` in a run coordinated by `coordinator`, which died (a rank
    /// of a halving run): once the shard has seen `coordinator` down too, `id` is lost unless
    /// something else can produce it. A give-up naming a live node changes nothing.
    GiveUp {
        id: ObjectId,
        node: NodeId,
        coordinator: NodeId,
    },
    /// What a node that owns the entry of `id` itself tells the entry's next owner, since the
    /// entry dies with it: that it will produce `id` (a [`DirMsg::Promise`]), or with `copy`
    /// that it holds a complete copy of it. The next owner keeps it aside; if `node` dies
    /// before taking it back, `id` is an orphan there, lost after the grace unless a holder
    /// republishes a complete copy. `kept` false: taken back (the operation ended, well or
    /// not; the copy is gone, or the entry moved).
    Backup {
        id: ObjectId,
        node: NodeId,
        copy: bool,
        kept: bool,
    },
    /// The complete copies of `id` a halving-doubling allreduce coordinated by `node` made:
    /// `copies` are its ranks' nodes (the coordinator's among them when its own rank
    /// committed the run; committed by another rank's word, it announces its copy as it
    /// stores it). Sent once, by the coordinator, when the run commits, so that its ranks store their
    /// copies without a message each to the directory at the moment the others finish. The one
    /// exception to "a node speaks only for itself", and a bounded one: a node named that has
    /// no copy (it never heard the commit, or could not store the result) withdraws its
    /// location when it fails to store, or when a reader comes for it, within the wait a
    /// source gives a copy the directory lists before it is made (`serve::COPY_WAIT`).
    PublishRun {
        id: ObjectId,
        size: u64,
        node: NodeId,
        copies: Vec<NodeId>,
    },
    /// What the owner of `id`'s entry tells the entry's next owner when `id` is deleted
    /// (`kept`), or published again after that (`kept` false): the next owner keeps the
    /// tombstone aside and takes it up if `node` dies while owning the entry, so that a reader
    /// of the deleted object is told it is not found rather than wait as for one never put.
    Tombstone {
        id: ObjectId,
        node: NodeId,
        kept: bool,
    },
}

impl DirMsg {
    /// The object the message is about (every directory message is about one).
    pub fn id(&self) -> &ObjectId {
        match self {
            DirMsg::Publish { id, .. }
            | DirMsg::PutInline { id, .. }
            | DirMsg::Locate { id, .. }
            | DirMsg::Claim { id, .. }
            | DirMsg::CancelLocate { id, .. }
            | DirMsg::TransferDone { id, .. }
            | DirMsg::Withdraw { id, .. }
            | DirMsg::Query { id, .. }
            | DirMsg::Subscribe { id, .. }
            | DirMsg::Delete { id, .. }
            | DirMsg::Reset { id, .. }
            | DirMsg::Promise { id, .. }
            | DirMsg::GiveUp { id, .. }
            | DirMsg::Backup { id, .. }
            | DirMsg::PublishRun { id, .. }
            | DirMsg::Tombstone { id, .. } => id,
        }
    }
}
