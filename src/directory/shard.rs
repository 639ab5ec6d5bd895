//! One shard of the object directory: per object its size, inline bytes for small objects,
//! and its locations with a partial/complete flag. The shard hands each receiver one free
//! source and withholds that source until the receiver reports back, so broadcast receivers
//! arrange themselves into a tree. It is a plain state machine: messages in, messages out.

use super::kept::Kept;
use super::queued::{self, FromNode, Queued};
use crate::config::INLINE_LIMIT;
use crate::protocol::{DirMsg, Located, LocationInfo, Msg, ObjectInfo, Reply, Rid};
use crate::ObjectId;
use phalanx_transport::NodeId;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};
use tracing::warn;

/// The request id of a message whose sender waits for no answer (request ids start at 1).
pub const NO_REPLY: Rid = 0;

/// How many deleted ids the shard remembers, to fail later lookups at once.
const TOMBSTONES: usize = 1 << 16;
/// How many reset objects the shard remembers the epoch of.
const EPOCHS: usize = 1 << 16;
/// How many source assignments the shard remembers for inspection.
const LOG_LIMIT: usize = 1 << 16;

#[derive(Debug, Clone, Copy)]
struct Loc {
    complete: bool,
    serving: Option<NodeId>,
    /// The assignment the copy is serving (see `Located::Source::token`).
    token: u64,
    /// The source a partial copy fills from and the assignment (or claim) it fills under: a
    /// transfer report under another one is about an earlier copy of the node's.
    fills_from: Option<(NodeId, u64)>,
}

impl Loc {
    /// The node this copy fills from, if it fills from another copy.
    fn depends_on(&self) -> Option<NodeId> {
        self.fills_from.map(|(n, _)| n)
    }
}

#[derive(Debug)]
struct Entry {
    size: u64,
    inline: Option<Vec<u8>>,
    /// The node whose put the inline bytes came with (they count against its
    /// [`INLINE_HELD_PER_NODE`]).
    inline_by: NodeId,
    locs: BTreeMap<NodeId, Loc>,
    /// Bytes of this small object sent inline to readers so far (see [`INLINE_FANOUT`]).
    inline_sent: u64,
    /// Every copy died and nothing reset or published it for `lost_after` ([`Shard::tick`]):
    /// locates are answered [`Located::Lost`] until a copy is published again.
    lost: bool,
}

/// How many bytes of one small object a shard sends inline to its readers before it sends
/// further readers to a copy instead. Every inline answer leaves through the shard's one
/// uplink: seven readers of a 16 KiB object took 0.86-0.88 ms on 8 hosts at 1 Gbit/s (Open
/// MPI's binomial broadcast 0.29), of 32 KiB 1.84-1.86, of 48 KiB 2.81; with this budget (the
/// first four readers of 16 KiB inline, the others sent to copies: a tree that grows as they
/// come, each new copy a source) 0.40-0.47, 0.57-0.66 and 0.70-0.80 (README, "Small objects
/// read by many"). A reader alone, or a few of a tiny object, still get the bytes with the
/// answer.
pub const INLINE_FANOUT: u64 = 64 << 10;

/// Bytes of small objects one node's puts may keep inline at one shard. Beyond, the shard
/// lists such an object at its putter only (which keeps a copy in its store, as for every
/// put), and readers pull it from there: a member that puts small objects without end, or
/// forges puts it keeps no copy of, cannot grow a shard's memory past this (the node's
/// arena bounds an honest node's small objects long before, spread over every shard).
pub const INLINE_HELD_PER_NODE: u64 = if cfg!(test) { 1 << 20 } else { 256 << 20 };

#[derive(Debug)]
struct Waiter {
    node: NodeId,
    rid: Rid,
    resume: bool,
    exclude: Vec<NodeId>,
    /// The epoch of the requester's partial bytes (`resume` only), if it knows it.
    epoch: Option<u64>,
}

impl FromNode for Waiter {
    fn node(&self) -> NodeId {
        self.node
    }
}

/// `bytes` inline of `node`'s no longer held.
fn forget_inline(held: &mut HashMap<NodeId, u64>, node: NodeId, bytes: u64) {
    if let Some(h) = held.get_mut(&node) {
        *h = h.saturating_sub(bytes);
        if *h == 0 {
            held.remove(&node);
        }
    }
}

/// The answer to a wait or subscription refused because its node has
/// [`queued::MAX_PER_NODE`] waiting here already.
fn too_many(node: NodeId) -> Reply {
    Reply::Error(format!(
        "node {node} has {} requests waiting at this shard already",
        queued::MAX_PER_NODE
    ))
}

impl Waiter {
    /// A resumed pull whose bytes belong to an epoch before `now` (the object was reset
    /// since it began). A pull that does not know its epoch (begun on a claim: reduce
    /// intermediates, which are never reset) is taken for stale once the object was reset.
    fn stale(&self, now: u64) -> bool {
        self.resume && self.epoch.map_or(now > 0, |e| e != now)
    }
}

/// One decision of the shard: `receiver` was sent to pull `id` from `source`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    pub id: ObjectId,
    pub source: NodeId,
    pub receiver: NodeId,
    pub source_complete: bool,
}

#[derive(Debug, Default)]
pub struct Shard {
    /// The cluster's size when known (`Shard::for_cluster`): a run's listing names members
    /// only.
    nodes: Option<u32>,
    entries: HashMap<ObjectId, Entry>,
    /// Reads waiting for a copy, and subscriptions, by object: at most
    /// [`queued::MAX_PER_NODE`] of each per requesting node.
    waiting: Queued<Waiter>,
    subscribers: Queued<(NodeId, Rid)>,
    tombstones: HashSet<ObjectId>,
    tombstone_order: VecDeque<ObjectId>,
    log: VecDeque<Assignment>,
    /// Claims on sources not listed yet, applied when the source publishes: by object,
    /// (source, receiver, token, done). `done`: the receiver's pull already ended well (its
    /// `TransferDone` overtook the source's `Publish`), so its copy is listed complete then.
    /// At most `PENDING_CLAIMS` in all, oldest dropped.
    pending_claims: HashMap<ObjectId, Vec<(NodeId, NodeId, u64, bool)>>,
    pending_order: VecDeque<ObjectId>,
    /// How many times each object was reset (`DirMsg::Reset`), for the objects reset at
    /// least once and not deleted since: the epoch of its bytes (`Located::Source::epoch`).
    epochs: HashMap<ObjectId, u64>,
    /// Objects left by a death with no copy that can complete (none complete, no producer's
    /// partial one), since when: lost unless reset or published meanwhile ([`Shard::tick`]).
    orphans: HashMap<ObjectId, Instant>,
    /// Nodes that said they will produce an object (`DirMsg::Promise`: the coordinators of
    /// the reduces into it), until a complete copy is listed or they die, take it back or the
    /// object is deleted. Like a producer's copy, a promise keeps an object from being lost.
    promises: HashMap<ObjectId, Vec<NodeId>>,
    /// Inline bytes held, by the node that put them (see [`INLINE_HELD_PER_NODE`]).
    inline_held: HashMap<NodeId, u64>,
    /// Objects given up by a rank of a run whose coordinator died (`DirMsg::GiveUp`), by
    /// that coordinator, until this shard sees it down too (at most `GIVE_UPS`, oldest
    /// dropped).
    give_ups: HashMap<ObjectId, NodeId>,
    give_up_order: VecDeque<ObjectId>,
    /// Nodes this shard has seen die.
    seen_down: HashSet<NodeId>,
    /// Promises and complete copies of nodes that own their objects' entries themselves,
    /// kept here as the entries' next owner (`DirMsg::Backup`): by object and kind (copy or
    /// not), the node, until it takes it back or dies (then the object is an orphan here). At
    /// most `BACKUPS`, oldest dropped.
    backups: Kept<(ObjectId, bool), BACKUPS>,
    /// Objects deleted at the nodes that own their entries, kept here as the entries' next
    /// owner (`DirMsg::Tombstone`): by object, the owner, until taken back or that owner dies
    /// (then the object is deleted here too). At most `TOMBSTONES`, oldest dropped.
    backup_tombstones: Kept<ObjectId, TOMBSTONES>,
}

/// Promises and copies a shard keeps for the entries it would own if their owners died.
const BACKUPS: usize = 1 << 12;

/// Give-ups a shard keeps for coordinators it has not seen die yet.
const GIVE_UPS: usize = 1 << 12;

/// Most nodes one object's promises name: more are ignored (each coordinator of a reduce
/// into the same target promises it; a reduce is redone at most a few times).
const PROMISERS: usize = 16;

/// Most copies one `DirMsg::PublishRun` names (the most ranks a halving run takes).
const MAX_RUN_COPIES: usize = crate::reduce::MAX_HALVING_RANKS;

/// Claims the shard keeps for sources it has not heard of yet.
const PENDING_CLAIMS: usize = 1 << 12;

/// Messages a shard wants sent: (destination, message).
pub type Out = Vec<(NodeId, Msg)>;

fn reply(out: &mut Out, to: NodeId, rid: Rid, reply: Reply) {
    out.push((to, Msg::Reply { rid, reply }));
}

impl Entry {
    /// An entry of an object of `size` bytes with no copy listed yet.
    fn new(size: u64) -> Entry {
        Entry {
            size,
            inline: None,
            inline_by: 0,
            locs: BTreeMap::new(),
            inline_sent: 0,
            lost: false,
        }
    }

    /// Whether some listed copy is or will be complete: a complete one, or a producer's
    /// partial one (a put or a reduce's output, filled from no other copy). Partial copies
    /// filling from other copies complete only through those.
    fn can_complete(&self) -> bool {
        self.inline.is_some()
            || self
                .locs
                .values()
                .any(|l| l.complete || l.fills_from.is_none())
    }

    /// What a subscriber is told once the object has a location: the entry, with the bytes
    /// of a small object (they travel with the news).
    fn ready(&self) -> Reply {
        match &self.inline {
            Some(data) => Reply::InfoInline(self.info(), data.clone()),
            None => Reply::Info(Some(self.info())),
        }
    }

    fn info(&self) -> ObjectInfo {
        ObjectInfo {
            size: self.size,
            inline: self.inline.is_some(),
            locations: self
                .locs
                .iter()
                .map(|(&node, l)| LocationInfo {
                    node,
                    complete: l.complete,
                    serving: l.serving,
                    depends_on: l.depends_on(),
                })
                .collect(),
            lost: self.lost,
        }
    }

    /// Whether `requester` is on the chain of sources that `node`'s copy is filled from.
    fn depends_on(&self, node: NodeId, requester: NodeId) -> bool {
        let mut cur = node;
        for _ in 0..=self.locs.len() {
            match self.locs.get(&cur).and_then(Loc::depends_on) {
                Some(d) if d == requester => return true,
                Some(d) => cur = d,
                None => return false,
            }
        }
        true // a cycle that does not pass through the requester: avoid it as well
    }

    /// A free source for `requester`: complete copies first, then partial ones; never the
    /// requester itself, an excluded node, or a copy that depends on the requester.
    fn pick(&self, requester: NodeId, exclude: &[NodeId]) -> Option<NodeId> {
        self.locs
            .iter()
            .filter(|(&n, l)| {
                n != requester
                    && l.serving.is_none()
                    && !exclude.contains(&n)
                    && !self.depends_on(n, requester)
            })
            .min_by_key(|(&n, l)| (!l.complete, n))
            .map(|(&n, _)| n)
    }
}

impl Shard {
    pub fn new() -> Shard {
        Shard::default()
    }

    /// The shard of a node of a cluster of `nodes` members.
    pub fn for_cluster(nodes: u32) -> Shard {
        Shard {
            nodes: Some(nodes),
            ..Shard::default()
        }
    }

    /// Recent source assignments, oldest first.
    pub fn assignments(&self) -> Vec<Assignment> {
        self.log.iter().cloned().collect()
    }

    pub fn info(&self, id: &ObjectId) -> Option<ObjectInfo> {
        self.entries.get(id).map(Entry::info)
    }

    /// Handles one directory message from `from`, appending the messages to send.
    pub fn handle(&mut self, from: NodeId, msg: DirMsg, out: &mut Out) {
        // A node speaks only for itself: a copy it publishes, withdraws or fills is its own.
        let speaks_for = match &msg {
            DirMsg::Publish { node, .. }
            | DirMsg::PublishRun { node, .. }
            | DirMsg::PutInline { node, .. }
            | DirMsg::Withdraw { node, .. }
            | DirMsg::Promise { node, .. }
            | DirMsg::Backup { node, .. }
            | DirMsg::Tombstone { node, .. }
            | DirMsg::GiveUp { node, .. } => Some(*node),
            DirMsg::Claim { receiver, .. } | DirMsg::TransferDone { receiver, .. } => {
                Some(*receiver)
            }
            _ => None,
        };
        if let Some(node) = speaks_for.filter(|&n| n != from) {
            warn!(
                from,
                node, "directory message on behalf of another node: ignored"
            );
            return;
        }
        match msg {
            DirMsg::Publish {
                id,
                size,
                node,
                complete,
            } => {
                self.add_copy(&id, size, node, complete);
                self.notify(&id, out);
                self.serve_waiters(&id, out);
            }
            DirMsg::PublishRun {
                id,
                size,
                node: _,
                mut copies,
            } => {
                copies.sort_unstable();
                copies.dedup();
                if copies.len() > MAX_RUN_COPIES {
                    warn!(from, %id, "a run's copies name {} nodes: ignored", copies.len());
                    return;
                }
                // Members only, and none this shard has seen die (it holds no copy).
                let nodes = self.nodes.unwrap_or(NodeId::MAX);
                copies.retain(|n| *n < nodes && !self.seen_down.contains(n));
                for n in copies {
                    self.add_copy(&id, size, n, true);
                }
                self.notify(&id, out);
                self.serve_waiters(&id, out);
            }
            DirMsg::CancelLocate { id, rid } => {
                self.waiting
                    .retain_of(&id, |w| !(w.node == from && w.rid == rid));
                // Answered already: the assignment made under that number is released and the
                // requester's partial copy (it never pulled) leaves the entry.
                if let Some(e) = self.entries.get_mut(&id) {
                    let mut released = false;
                    for l in e.locs.values_mut() {
                        if l.serving == Some(from) && l.token == rid {
                            l.serving = None;
                            released = true;
                        }
                    }
                    if released && e.locs.get(&from).is_some_and(|l| !l.complete) {
                        e.locs.remove(&from);
                    }
                }
                self.serve_waiters(&id, out);
            }
            DirMsg::Claim {
                id,
                source,
                receiver,
                token,
            } => {
                if !self.claim(&id, source, receiver, token) {
                    if self.pending_order.len() >= PENDING_CLAIMS {
                        if let Some(old) = self.pending_order.pop_front() {
                            self.pending_claims.remove(&old);
                        }
                    }
                    self.pending_claims
                        .entry(id.clone())
                        .or_default()
                        .push((source, receiver, token, false));
                    self.pending_order.push_back(id);
                }
            }
            DirMsg::PutInline {
                rid,
                id,
                node,
                data,
                then_subscribe,
            } => {
                if data.len() as u64 >= INLINE_LIMIT {
                    // Only small objects live in the directory; a larger one is a forgery or a
                    // bug of the sender, never stored.
                    warn!(from, %id, len = data.len(), "inline object over the limit refused");
                    if rid != NO_REPLY {
                        let e = format!(
                            "inline object of {} bytes (limit {INLINE_LIMIT})",
                            data.len()
                        );
                        reply(out, from, rid, Reply::Error(e));
                    }
                    return;
                }
                self.forget_tombstone(&id);
                let size = data.len() as u64;
                // Other copies of the same object stay listed (their holders must still be
                // found by a delete); an entry of another size is another object.
                let e = self
                    .entries
                    .entry(id.clone())
                    .or_insert_with(|| Entry::new(size));
                if e.size != size {
                    e.size = size;
                    e.locs.clear();
                }
                if let Some(old) = e.inline.take() {
                    forget_inline(&mut self.inline_held, e.inline_by, old.len() as u64);
                }
                let held = self.inline_held.entry(node).or_default();
                if *held + size <= INLINE_HELD_PER_NODE {
                    *held += size;
                    e.inline = Some(data);
                    e.inline_by = node;
                } else {
                    warn!(from, %id, "inline bytes of this node over the shard's bound: listed at the node only");
                }
                e.lost = false;
                self.orphans.remove(&id);
                self.promises.remove(&id);
                e.locs.insert(
                    node,
                    Loc {
                        complete: true,
                        serving: None,
                        token: 0,
                        fills_from: None,
                    },
                );
                let subscribe = then_subscribe.filter(|_| rid != NO_REPLY);
                if rid != NO_REPLY && subscribe.is_none() {
                    reply(out, from, rid, Reply::Ack);
                }
                self.notify(&id, out);
                self.serve_waiters(&id, out);
                // The sender's subscription to another object (an allreduce's result, which
                // this input may complete), answered on the put's request id.
                if let Some(target) = subscribe {
                    self.handle(from, DirMsg::Subscribe { rid, id: target }, out);
                }
            }
            DirMsg::Locate {
                rid,
                id,
                wait,
                resume,
                exclude,
                epoch,
            } => {
                let w = Waiter {
                    node: from,
                    rid,
                    resume,
                    exclude,
                    epoch,
                };
                if let Some(w) = self.try_locate(&id, w, out) {
                    let unknown = !self.entries.contains_key(&id) && !self.tombstones.contains(&id);
                    if w.resume && w.epoch.is_some() && unknown {
                        // A pull under way, of a source a shard assigned, of an object this
                        // shard never heard of: its entry died with the shard that owned it
                        // before, and so did its last copy unless a holder republishes it here
                        // within the grace. (A pull begun on a claim, a reduce intermediate,
                        // knows no epoch: its source may publish later.)
                        self.orphans.entry(id.clone()).or_insert_with(Instant::now);
                    }
                    if wait && !self.tombstones.contains(&id) {
                        if let Err(w) = self.waiting.push(id, w) {
                            reply(out, from, w.rid, too_many(from));
                        }
                    } else {
                        reply(out, from, w.rid, Reply::Located(Located::NotFound));
                    }
                }
            }
            DirMsg::TransferDone {
                id,
                source,
                receiver,
                token,
                ok,
            } => {
                self.end_pending_claim(&id, (source, receiver, token), ok);
                if let Some(e) = self.entries.get_mut(&id) {
                    // The receiver's copy is complete whatever the source does now; unless
                    // the report is of an earlier copy of the receiver's (deleted since, and
                    // filling again under another assignment: listed complete, it would be
                    // handed out as a source it is not, and readers could wait on each other
                    // in a circle).
                    if ok {
                        if let Some(r) = e.locs.get_mut(&receiver) {
                            let earlier = r.fills_from.is_some_and(|f| f != (source, token));
                            if !earlier {
                                r.complete = true;
                                r.fills_from = None;
                            }
                        }
                    }
                    let current = e
                        .locs
                        .get(&source)
                        .is_some_and(|s| s.serving == Some(receiver) && s.token == token);
                    if !current {
                        // A stale report: the source serves a newer assignment (or never
                        // served this receiver on our books: a claim on a busy source).
                        return;
                    }
                    if let Some(s) = e.locs.get_mut(&source) {
                        s.serving = None;
                    }
                }
                self.serve_waiters(&id, out);
            }
            DirMsg::Withdraw { id, node } => {
                // Its claims that wait for their source to publish are void with its copy.
                self.drop_pending_claims_of(&id, node);
                self.remove_copy(&id, node, Instant::now());
                self.serve_waiters(&id, out);
            }
            DirMsg::Query { rid, id } => {
                reply(out, from, rid, Reply::Info(self.info(&id)));
            }
            DirMsg::Subscribe { rid, id } => match self.entries.get(&id) {
                Some(e) if e.inline.is_some() || !e.locs.is_empty() => {
                    reply(out, from, rid, e.ready());
                }
                _ if self.tombstones.contains(&id) => reply(out, from, rid, Reply::Info(None)),
                _ => {
                    if self.subscribers.push(id, (from, rid)).is_err() {
                        reply(out, from, rid, too_many(from));
                    }
                }
            },
            DirMsg::Delete { rid, id } => {
                let nodes = self.remove_entry(&id);
                self.pending_claims.remove(&id);
                self.epochs.remove(&id);
                self.promises.remove(&id);
                self.deleted(id, out);
                reply(out, from, rid, Reply::Deleted(nodes));
            }
            DirMsg::Reset { rid, id } => {
                // Its producer computes it again: not lost, whatever died.
                self.pending_claims.remove(&id);
                self.orphans.remove(&id);
                let nodes = self.remove_entry(&id);
                if self.epochs.len() >= EPOCHS && !self.epochs.contains_key(&id) {
                    // Bounded: an object forgotten here starts again at epoch 0, and a pull
                    // that knows a later one restarts once (never resumes stale bytes).
                    if let Some(old) = self.epochs.keys().next().cloned() {
                        self.epochs.remove(&old);
                    }
                }
                let epoch = self.epochs.entry(id.clone()).or_insert(0);
                *epoch += 1;
                let now = *epoch;
                // Partial copies waiting for a new source hold the old bytes: they start
                // over; plain readers wait for the new copy.
                self.waiting.retain_of(&id, |w| {
                    let stale = w.stale(now);
                    if stale {
                        reply(out, w.node, w.rid, Reply::Located(Located::Reset));
                    }
                    !stale
                });
                reply(out, from, rid, Reply::Deleted(nodes));
            }
            DirMsg::Promise { id, node, promised } => {
                if !promised {
                    // Taken back (its reduce failed): if it was the last producer, the object
                    // is lost after the grace unless a copy or a new promise comes.
                    let could = self.producible(&id);
                    self.unpromise(&id, node);
                    if could && !self.producible(&id) {
                        self.orphans.entry(id).or_insert_with(Instant::now);
                    }
                    return;
                }
                if self.complete(&id) || self.tombstones.contains(&id) {
                    // Nothing left to promise; or deleted (a late promise of a reduce whose
                    // target was deleted as it ended): it stays deleted.
                    return;
                }
                let p = self.promises.entry(id.clone()).or_default();
                if !p.contains(&node) {
                    if p.len() >= PROMISERS {
                        return;
                    }
                    p.push(node);
                }
                // A producer will make it (again): not lost.
                self.orphans.remove(&id);
                if let Some(e) = self.entries.get_mut(&id) {
                    e.lost = false;
                }
            }
            DirMsg::Backup {
                id,
                node,
                copy,
                kept,
            } => match kept {
                true => self.backups.keep((id, copy), node),
                false => self.backups.take_back(&(id, copy), node),
            },
            DirMsg::Tombstone { id, node, kept } => match kept {
                true => self.backup_tombstones.keep(id, node),
                false => self.backup_tombstones.take_back(&id, node),
            },
            DirMsg::GiveUp {
                id, coordinator, ..
            } => {
                if self.seen_down.contains(&coordinator) {
                    self.orphan_given_up(id, Instant::now());
                    return;
                }
                if self.give_up_order.len() >= GIVE_UPS {
                    if let Some(old) = self.give_up_order.pop_front() {
                        self.give_ups.remove(&old);
                    }
                }
                if self.give_ups.insert(id.clone(), coordinator).is_none() {
                    self.give_up_order.push_back(id);
                }
            }
        }
    }

    /// An object given up by a rank of a run whose coordinator this shard has seen die: an
    /// orphan, unless it is complete somewhere, something else can produce it, or it was
    /// deleted (its readers are told "not found").
    fn orphan_given_up(&mut self, id: ObjectId, now: Instant) {
        if !self.complete(&id) && !self.producible(&id) && !self.tombstones.contains(&id) {
            self.orphans.entry(id).or_insert(now);
        }
    }

    /// How many words this shard keeps for entries it would own if their owners died.
    pub fn backups_kept(&self) -> usize {
        self.backups.len()
    }

    /// Whether no node but `node` is listed with a complete copy of `id` (an entry this shard
    /// does not have: false): what would die with `node` if it is this shard's.
    pub fn only_copy_on(&self, id: &ObjectId, node: NodeId) -> bool {
        self.entries
            .get(id)
            .is_some_and(|e| e.locs.iter().all(|(&n, l)| n == node || !l.complete))
    }

    /// Whether `id` is complete somewhere (or inline here).
    fn complete(&self, id: &ObjectId) -> bool {
        self.entries
            .get(id)
            .is_some_and(|e| e.inline.is_some() || e.locs.values().any(|l| l.complete))
    }

    /// Whether some copy listed for `id` is or will be complete, or a live node promised to
    /// produce it.
    fn producible(&self, id: &ObjectId) -> bool {
        self.entries.get(id).is_some_and(Entry::can_complete)
            || self.promises.get(id).is_some_and(|p| !p.is_empty())
    }

    /// Forgets every location of a dead node and frees the copies it was receiving from.
    /// Adds to `peers` every node this shard depends on: holders of the copies it lists, and
    /// nodes waiting on, subscribed to or claiming its entries (their links stay open, so a
    /// death among them is noticed: by heartbeat, or from its watchers with links made on
    /// demand).
    pub fn peers_depended_on(&self, peers: &mut std::collections::HashSet<NodeId>) {
        for e in self.entries.values() {
            peers.extend(e.locs.keys().copied());
        }
        peers.extend(self.waiting.iter().map(|w| w.node));
        peers.extend(self.subscribers.iter().map(|(n, _)| *n));
        for c in self.pending_claims.values() {
            peers.extend(c.iter().flat_map(|&(src, receiver, _, _)| [src, receiver]));
        }
        for p in self.promises.values() {
            peers.extend(p.iter().copied());
        }
    }

    /// `node` died. `moved_here(id)`: the entry of `id` was `node`'s and is this shard's
    /// now.
    pub fn node_down(
        &mut self,
        node: NodeId,
        now: Instant,
        moved_here: &dyn Fn(&ObjectId) -> bool,
        out: &mut Out,
    ) {
        self.seen_down.insert(node);
        // The objects `node` promised, or held, while it owned their entries: if this shard
        // owns them now, it knows of them only from that. (Told by a node that did not own
        // the entry, or kept here when this shard is not the next owner: nothing.) The words
        // stay until taken back or crowded out: a node believed dead that was not (its link
        // dropped, a false suspicion) does not know to tell them again.
        let backed: Vec<ObjectId> = self
            .backups
            .of(node)
            .filter(|k| moved_here(&k.0))
            .map(|k| k.0.clone())
            .collect();
        for id in backed {
            self.orphan_given_up(id, now);
        }
        // An entry found lost here while this shard owned it before, and owned by `node`
        // since: what this shard knows of it is old, so its holders get the grace again
        // to republish it.
        let stale: Vec<ObjectId> = self
            .entries
            .iter()
            .filter(|(id, e)| e.lost && moved_here(id))
            .map(|(id, _)| id.clone())
            .collect();
        for id in stale {
            if let Some(e) = self.entries.get_mut(&id) {
                e.lost = false;
            }
            self.orphans.entry(id).or_insert(now);
        }
        let given_up: Vec<ObjectId> = self
            .give_ups
            .iter()
            .filter(|&(_, &c)| c == node)
            .map(|(id, _)| id.clone())
            .collect();
        for id in given_up {
            self.give_ups.remove(&id);
            self.orphan_given_up(id, now);
        }
        // Objects `node` deleted while it owned their entries: deleted here too, unless a
        // copy was published here since (the object was put again), and their readers and
        // subscribers are told so.
        let deleted: Vec<ObjectId> = self
            .backup_tombstones
            .of(node)
            .filter(|id| moved_here(id))
            .cloned()
            .collect();
        for id in deleted {
            self.backup_tombstones.remove(&id);
            if !self.entries.contains_key(&id) && !self.producible(&id) {
                self.deleted(id, out);
            }
        }
        let mut ids: Vec<ObjectId> = self.entries.keys().cloned().collect();
        ids.extend(
            self.promises
                .iter()
                .filter(|(id, p)| p.contains(&node) && !self.entries.contains_key(*id))
                .map(|(id, _)| id.clone()),
        );
        for id in &ids {
            self.remove_copy(id, node, now);
        }
        self.waiting.retain(|w| w.node != node);
        for c in self.pending_claims.values_mut() {
            c.retain(|&(src, receiver, _, _)| src != node && receiver != node);
        }
        self.pending_claims.retain(|_, c| !c.is_empty());
        self.subscribers.retain(|(n, _)| *n != node);
        for id in &ids {
            self.serve_waiters(id, out);
        }
    }

    /// `node`'s copy of `id` is gone (it died, or withdrew it): the copies it was serving are
    /// free again, and if it was the last copy that could complete, the object is noted an
    /// orphan `now`: lost unless published again or reset ([`Shard::tick`]).
    fn remove_copy(&mut self, id: &ObjectId, node: NodeId, now: Instant) {
        let could = self.producible(id);
        self.unpromise(id, node);
        if let Some(e) = self.entries.get_mut(id) {
            e.locs.remove(&node);
            for l in e.locs.values_mut() {
                if l.serving == Some(node) {
                    l.serving = None;
                }
            }
        }
        if could && !self.producible(id) {
            self.orphans.entry(id.clone()).or_insert(now);
        }
    }

    /// `node` no longer promises to produce `id`.
    fn unpromise(&mut self, id: &ObjectId, node: NodeId) {
        if let Some(p) = self.promises.get_mut(id) {
            p.retain(|&n| n != node);
            if p.is_empty() {
                self.promises.remove(id);
            }
        }
    }

    /// Declares lost the objects a death left with no copy that can complete `after` ago,
    /// unless a copy was published or the object reset since (a producer recomputing it):
    /// their waiting readers are told [`Located::Lost`], and so is every later locate until
    /// a copy is published again. Subscribers keep waiting (a reduce waits for an input to
    /// be put again). Called periodically.
    pub fn tick(&mut self, now: Instant, after: Duration, out: &mut Out) {
        if self.orphans.is_empty() {
            return;
        }
        let due: Vec<ObjectId> = self
            .orphans
            .iter()
            .filter(|(_, &since)| now.saturating_duration_since(since) >= after)
            .map(|(id, _)| id.clone())
            .collect();
        for id in due {
            self.orphans.remove(&id);
            if self.producible(&id) {
                continue;
            }
            // Only promised, never listed: an entry (of no known size) records the loss.
            let e = self
                .entries
                .entry(id.clone())
                .or_insert_with(|| Entry::new(0));
            warn!(
                id = id.as_str(),
                "object lost: every copy died with its node"
            );
            e.lost = true;
            for w in self.waiting.take(&id) {
                reply(out, w.node, w.rid, Reply::Located(Located::Lost));
            }
        }
    }

    /// Accounts for a pull the receiver started on its own from a source it knew; false if
    /// the source is not listed (yet).
    fn claim(&mut self, id: &ObjectId, source: NodeId, receiver: NodeId, token: u64) -> bool {
        let Some(e) = self.entries.get_mut(id) else {
            return false;
        };
        if source == receiver || e.inline.is_some() {
            return true; // nothing to account for
        }
        let Some(s) = e.locs.get_mut(&source) else {
            return false;
        };
        let source_complete = s.complete;
        if s.serving.is_none() {
            s.serving = Some(receiver);
            s.token = token;
        }
        let r = e.locs.entry(receiver).or_insert(Loc {
            complete: false,
            serving: None,
            token: 0,
            fills_from: None,
        });
        if !r.complete {
            r.fills_from = Some((source, token));
        }
        if self.log.len() == LOG_LIMIT {
            self.log.pop_front();
        }
        self.log.push_back(Assignment {
            id: id.clone(),
            source,
            receiver,
            source_complete,
        });
        true
    }

    /// A copy of `id` (of `size` bytes) on `node`, partial or `complete` (`DirMsg::Publish`).
    fn add_copy(&mut self, id: &ObjectId, size: u64, node: NodeId, complete: bool) {
        self.forget_tombstone(id);
        let e = self
            .entries
            .entry(id.clone())
            .or_insert_with(|| Entry::new(size));
        if e.locs.is_empty() && e.inline.is_none() {
            // An entry left with no copy (lost) knows no size: this copy's is it.
            e.size = size;
        }
        let l = e.locs.entry(node).or_insert(Loc {
            complete,
            serving: None,
            token: 0,
            fills_from: None,
        });
        l.complete |= complete;
        if l.complete {
            l.fills_from = None;
            self.promises.remove(id);
        }
        e.lost = false;
        self.orphans.remove(id);
        self.apply_pending_claims(id, node);
    }

    /// `source` published `id`: the claims that waited for it take effect.
    fn apply_pending_claims(&mut self, id: &ObjectId, source: NodeId) {
        let Some(mut claims) = self.pending_claims.remove(id) else {
            return;
        };
        let mine: Vec<_> = claims.iter().filter(|c| c.0 == source).copied().collect();
        claims.retain(|c| c.0 != source);
        for (src, receiver, token, done) in mine {
            if !done {
                self.claim(id, src, receiver, token);
            } else if let Some(e) = self.entries.get_mut(id) {
                // That pull is over: the receiver holds a complete copy and the source
                // serves nobody for it.
                e.locs.insert(
                    receiver,
                    Loc {
                        complete: true,
                        serving: None,
                        token: 0,
                        fills_from: None,
                    },
                );
            }
        }
        if !claims.is_empty() {
            self.pending_claims.insert(id.clone(), claims);
        }
    }

    /// `receiver`'s claims on `id` that wait for their source to publish are void: its copy
    /// is gone, or the directory gave it a source. Applied later, a stale claim would say
    /// the copy fills from that source while it fills from another, and the cycle check of
    /// `Entry::pick` would miss a real cycle (two partial copies each waiting on the other:
    /// seen after a partition's reset in `tests/allreduce.rs`).
    fn drop_pending_claims_of(&mut self, id: &ObjectId, receiver: NodeId) {
        if let Some(c) = self.pending_claims.get_mut(id) {
            c.retain(|x| x.1 != receiver || x.3);
            if c.is_empty() {
                self.pending_claims.remove(id);
            }
        }
    }

    /// A pull ended before its source published: a failed one's claim is void; a complete
    /// one's receiver is listed when the source publishes (else a delete would miss it).
    fn end_pending_claim(&mut self, id: &ObjectId, claim: (NodeId, NodeId, u64), ok: bool) {
        let (source, receiver, token) = claim;
        if let Some(c) = self.pending_claims.get_mut(id) {
            let same =
                |x: &(NodeId, NodeId, u64, bool)| (x.0, x.1, x.2) == (source, receiver, token);
            if ok {
                c.iter_mut().filter(|x| same(x)).for_each(|x| x.3 = true);
            } else {
                c.retain(|x| !same(x));
            }
            if c.is_empty() {
                self.pending_claims.remove(id);
            }
        }
    }

    /// Answers `w` if possible; gives it back otherwise.
    fn try_locate(&mut self, id: &ObjectId, w: Waiter, out: &mut Out) -> Option<Waiter> {
        let epoch = self.epochs.get(id).copied().unwrap_or(0);
        if w.stale(epoch) {
            reply(out, w.node, w.rid, Reply::Located(Located::Reset));
            return None;
        }
        let Some(e) = self.entries.get_mut(id) else {
            return Some(w);
        };
        if let Some(data) = &e.inline {
            // Inline while within the fan-out budget, or when no copy can serve this reader
            // now (the bytes here outlive every copy); else a copy, as for a large object.
            let within =
                e.inline_sent == 0 || e.inline_sent.saturating_add(e.size) <= INLINE_FANOUT;
            let local = e.locs.contains_key(&w.node);
            if within || w.resume || local || e.pick(w.node, &w.exclude).is_none() {
                e.inline_sent = e.inline_sent.saturating_add(e.size);
                reply(
                    out,
                    w.node,
                    w.rid,
                    Reply::Located(Located::Inline(data.clone())),
                );
                return None;
            }
        }
        if e.lost {
            reply(out, w.node, w.rid, Reply::Located(Located::Lost));
            return None;
        }
        // A copy listed here is the requester's to read; a complete one even for a resumed
        // pull (a stale pull on a node that has since produced the object, a reduce's root):
        // made its source's receiver, the complete copy would be listed as a partial one
        // filling from another node, and readers could wait on each other in a circle.
        let listed = e.locs.get(&w.node);
        if listed.is_some_and(|l| !w.resume || l.complete) {
            reply(out, w.node, w.rid, Reply::Located(Located::Local));
            return None;
        }
        let Some(source) = e.pick(w.node, &w.exclude) else {
            tracing::debug!(
                id = id.as_str(),
                requester = w.node,
                exclude = ?w.exclude,
                locations = ?e.locs.iter().map(|(n, l)| (*n, l.complete, l.serving, l.depends_on())).collect::<Vec<_>>(),
                "locate waits: no free source"
            );
            return Some(w);
        };
        tracing::debug!(
            id = id.as_str(),
            source,
            receiver = w.node,
            "source assigned"
        );
        let source_complete = {
            let s = e.locs.get_mut(&source).expect("picked");
            s.serving = Some(w.node);
            s.token = w.rid;
            s.complete
        };
        let r = e.locs.entry(w.node).or_insert(Loc {
            complete: false,
            serving: None,
            token: 0,
            fills_from: None,
        });
        r.fills_from = Some((source, w.rid));
        r.complete = false;
        let size = e.size;
        self.drop_pending_claims_of(id, w.node);
        if self.log.len() == LOG_LIMIT {
            self.log.pop_front();
        }
        self.log.push_back(Assignment {
            id: id.clone(),
            source,
            receiver: w.node,
            source_complete,
        });
        reply(
            out,
            w.node,
            w.rid,
            Reply::Located(Located::Source {
                node: source,
                size,
                token: w.rid,
                epoch,
            }),
        );
        None
    }

    fn serve_waiters(&mut self, id: &ObjectId, out: &mut Out) {
        let mut q = self.waiting.take(id);
        let mut left = VecDeque::new();
        while let Some(w) = q.pop_front() {
            if let Some(w) = self.try_locate(id, w, out) {
                left.push_back(w);
            }
        }
        self.waiting.put_back(id.clone(), left);
    }

    /// Removes the entry of `id` (its inline bytes counted off their putter): the nodes
    /// that held a copy.
    fn remove_entry(&mut self, id: &ObjectId) -> Vec<NodeId> {
        let Some(e) = self.entries.remove(id) else {
            return Vec::new();
        };
        if let Some(data) = &e.inline {
            forget_inline(&mut self.inline_held, e.inline_by, data.len() as u64);
        }
        e.locs.keys().copied().collect()
    }

    fn notify(&mut self, id: &ObjectId, out: &mut Out) {
        let subs = self.subscribers.take(id);
        if !subs.is_empty() {
            let ready = self.entries.get(id).map_or(Reply::Info(None), Entry::ready);
            for (n, rid) in subs {
                reply(out, n, rid, ready.clone());
            }
        }
    }

    /// `id` is deleted here: later lookups fail at once, and the reads and subscriptions
    /// waiting for it are told so.
    fn deleted(&mut self, id: ObjectId, out: &mut Out) {
        self.orphans.remove(&id);
        for w in self.waiting.take(&id) {
            reply(out, w.node, w.rid, Reply::Located(Located::NotFound));
        }
        for (n, r) in self.subscribers.take(&id) {
            reply(out, n, r, Reply::Info(None));
        }
        self.remember_tombstone(id);
    }

    /// Whether `id` was deleted here (and not published again since).
    pub fn has_tombstone(&self, id: &ObjectId) -> bool {
        self.tombstones.contains(id)
    }

    fn remember_tombstone(&mut self, id: ObjectId) {
        if self.tombstones.insert(id.clone()) {
            self.tombstone_order.push_back(id);
            if self.tombstone_order.len() > TOMBSTONES {
                if let Some(old) = self.tombstone_order.pop_front() {
                    self.tombstones.remove(&old);
                }
            }
        }
    }

    fn forget_tombstone(&mut self, id: &ObjectId) {
        if self.tombstones.remove(id) {
            self.tombstone_order.retain(|t| t != id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A source assignment, with the token blanked for comparison.
    fn src(node: NodeId) -> Located {
        src_at(node, 0)
    }

    /// A source assignment of the bytes of epoch `epoch`.
    fn src_at(node: NodeId, epoch: u64) -> Located {
        Located::Source {
            node,
            size: 100,
            token: 0,
            epoch,
        }
    }

    fn located(out: &Out, to: NodeId) -> Located {
        out.iter()
            .find_map(|(n, m)| match m {
                Msg::Reply {
                    reply: Reply::Located(l),
                    ..
                } if *n == to => Some(match l.clone() {
                    Located::Source {
                        node, size, epoch, ..
                    } => Located::Source {
                        node,
                        size,
                        token: 0,
                        epoch,
                    },
                    l => l,
                }),
                _ => None,
            })
            .expect("a Located reply")
    }

    fn locate(s: &mut Shard, from: NodeId, exclude: Vec<NodeId>) -> Out {
        locate_as(s, from, false, exclude)
    }

    fn locate_as(s: &mut Shard, from: NodeId, resume: bool, exclude: Vec<NodeId>) -> Out {
        locate_epoch(s, from, resume, exclude, None)
    }

    fn locate_epoch(
        s: &mut Shard,
        from: NodeId,
        resume: bool,
        exclude: Vec<NodeId>,
        epoch: Option<u64>,
    ) -> Out {
        let mut out = Vec::new();
        s.handle(
            from,
            DirMsg::Locate {
                rid: from as u64,
                id: "x".into(),
                wait: true,
                resume,
                exclude,
                epoch,
            },
            &mut out,
        );
        out
    }

    /// `node` subscribes to `id` under `rid`: what the shard answers at once.
    fn subscribe(s: &mut Shard, node: NodeId, rid: Rid, id: &str) -> Out {
        let mut out = Vec::new();
        s.handle(node, DirMsg::Subscribe { rid, id: id.into() }, &mut out);
        out
    }

    fn publish(s: &mut Shard, node: NodeId, complete: bool) -> Out {
        let mut out = Vec::new();
        s.handle(
            node,
            DirMsg::Publish {
                id: "x".into(),
                size: 100,
                node,
                complete,
            },
            &mut out,
        );
        out
    }

    fn claim(s: &mut Shard, source: NodeId, receiver: NodeId, token: u64) {
        let mut out = Vec::new();
        let id = "x".into();
        s.handle(
            receiver,
            DirMsg::Claim {
                id,
                source,
                receiver,
                token,
            },
            &mut out,
        );
        assert!(out.is_empty(), "a claim is not answered");
    }

    fn done(s: &mut Shard, source: NodeId, receiver: NodeId, token: u64, ok: bool) -> Out {
        let mut out = Vec::new();
        let msg = DirMsg::TransferDone {
            id: "x".into(),
            source,
            receiver,
            token,
            ok,
        };
        s.handle(receiver, msg, &mut out);
        out
    }

    fn loc(s: &Shard, node: NodeId) -> Option<LocationInfo> {
        s.info(&"x".into())?
            .locations
            .into_iter()
            .find(|l| l.node == node)
    }

    #[test]
    fn a_cancelled_locate_leaves_no_waiter_and_holds_no_source() {
        let mut s = Shard::new();
        let cancel = |s: &mut Shard, node: NodeId| {
            let msg = DirMsg::CancelLocate {
                id: "x".into(),
                rid: node as u64,
            };
            let mut out = Vec::new();
            s.handle(node, msg, &mut out);
            out
        };
        // 1 waits, then gives up: the copy that appears goes to 2, who asked later.
        assert!(locate(&mut s, 1, vec![]).is_empty());
        assert!(cancel(&mut s, 1).is_empty());
        assert!(locate(&mut s, 2, vec![]).is_empty());
        let out = publish(&mut s, 0, true);
        assert_eq!(out.len(), 1, "only 2 is answered: {out:?}");
        assert_eq!(located(&out, 2), src(0));
        // 3 is sent to 2's partial copy and gives up after the answer: 2 is free again and
        // 3 is not listed.
        assert_eq!(located(&locate(&mut s, 3, vec![]), 3), src(2));
        cancel(&mut s, 3);
        assert!(loc(&s, 3).is_none());
        assert_eq!(loc(&s, 2).unwrap().serving, None);
        assert_eq!(located(&locate(&mut s, 4, vec![]), 4), src(2));
    }

    /// One node's inline bytes at a shard are bounded: past the bound its small objects are
    /// listed at the node alone (a reader is sent there to pull), another node's stay
    /// inline, and deleting the first node's objects makes room again.
    #[test]
    fn a_nodes_inline_bytes_are_bounded_and_further_puts_listed_at_the_node() {
        let mut s = Shard::new();
        let len = 60_000usize;
        let fits = (INLINE_HELD_PER_NODE / len as u64) as usize;
        let put = |s: &mut Shard, node: NodeId, id: &str| {
            let mut out = Vec::new();
            let (id, data) = (ObjectId::new(id), vec![node as u8; len]);
            s.handle(
                node,
                DirMsg::PutInline {
                    rid: NO_REPLY,
                    id,
                    node,
                    data,
                    then_subscribe: None,
                },
                &mut out,
            );
        };
        let read = |s: &mut Shard, id: &str| {
            let mut out = Vec::new();
            let msg = DirMsg::Locate {
                rid: 1,
                id: id.into(),
                wait: false,
                resume: false,
                exclude: Vec::new(),
                epoch: None,
            };
            s.handle(5, msg, &mut out);
            match out.pop() {
                Some((
                    5,
                    Msg::Reply {
                        reply: Reply::Located(l),
                        ..
                    },
                )) => l,
                o => panic!("{o:?}"),
            }
        };
        for k in 0..fits + 2 {
            put(&mut s, 2, &format!("a{k}"));
        }
        put(&mut s, 3, "b");
        assert!(matches!(read(&mut s, "a0"), Located::Inline(d) if d.len() == len));
        let last = format!("a{}", fits - 1);
        assert!(matches!(read(&mut s, &last), Located::Inline(_)));
        // Over the bound: listed at node 2 (complete), and read from there.
        let over = format!("a{fits}");
        let i = s.info(&over.as_str().into()).unwrap();
        assert!(i.locations.iter().any(|l| l.node == 2 && l.complete));
        assert!(matches!(
            read(&mut s, &over),
            Located::Source { node: 2, .. }
        ));
        // Another node's stays inline.
        assert!(matches!(read(&mut s, "b"), Located::Inline(d) if d[0] == 3));
        // Deleted: room again for node 2.
        let mut out = Vec::new();
        s.handle(
            2,
            DirMsg::Delete {
                rid: 9,
                id: "a0".into(),
            },
            &mut out,
        );
        put(&mut s, 2, "again");
        assert!(matches!(read(&mut s, "again"), Located::Inline(_)));
    }

    #[test]
    fn an_inline_object_over_the_limit_is_refused() {
        let mut s = Shard::new();
        let mut out = Vec::new();
        let msg = DirMsg::PutInline {
            rid: 4,
            id: "x".into(),
            node: 2,
            data: vec![0; INLINE_LIMIT as usize],
            then_subscribe: None,
        };
        s.handle(2, msg, &mut out);
        assert!(s.info(&"x".into()).is_none(), "nothing stored");
        assert!(matches!(
            &out[..],
            [(
                2,
                Msg::Reply {
                    rid: 4,
                    reply: Reply::Error(_)
                }
            )]
        ));
    }

    #[test]
    fn a_claimed_source_is_accounted_for_like_an_assigned_one() {
        let mut s = Shard::new();
        // A claim that arrives before the source publishes waits for it.
        claim(&mut s, 0, 1, 77);
        assert!(s.info(&"x".into()).is_none());
        publish(&mut s, 0, true);
        let l0 = loc(&s, 0).unwrap();
        assert_eq!(l0.serving, Some(1), "the source serves the claimant");
        assert_eq!(loc(&s, 1).unwrap().depends_on, Some(0));
        // So the next receiver is sent to the claimant's partial copy, not to the busy source.
        assert_eq!(located(&locate(&mut s, 2, vec![]), 2), src(1));
        // A claim on a busy source keeps its current receiver.
        claim(&mut s, 0, 3, 5);
        assert_eq!(loc(&s, 0).unwrap().serving, Some(1));
        assert_eq!(loc(&s, 3).unwrap().depends_on, Some(0));
        // Both finish: each copy is complete; the source is free after its own receiver.
        done(&mut s, 0, 3, 5, true);
        assert!(loc(&s, 3).unwrap().complete);
        assert_eq!(
            loc(&s, 0).unwrap().serving,
            Some(1),
            "not the busy source's receiver"
        );
        done(&mut s, 0, 1, 77, true);
        assert!(loc(&s, 1).unwrap().complete);
        assert_eq!(loc(&s, 0).unwrap().serving, None);
        // A pending claim dies with its source, and with a delete.
        let mut other = Shard::new();
        claim(&mut other, 4, 1, 9);
        other.node_down(4, Instant::now(), &|_| true, &mut Vec::new());
        publish(&mut other, 4, true);
        assert_eq!(
            other.info(&"x".into()).unwrap().locations[0].serving,
            None,
            "the dead source's claim was dropped"
        );
    }

    #[test]
    fn a_pull_that_ends_before_its_source_publishes_still_lists_its_copy() {
        // The receiver's claim and its TransferDone both overtake the source's Publish
        // (they travel on another link): its complete copy must still be known, or a delete
        // would leave it behind.
        let mut s = Shard::new();
        claim(&mut s, 0, 1, 7);
        done(&mut s, 0, 1, 7, true);
        // A failed one leaves nothing.
        claim(&mut s, 0, 2, 8);
        done(&mut s, 0, 2, 8, false);
        publish(&mut s, 0, false);
        let l1 = loc(&s, 1).expect("the early receiver is listed");
        assert!(l1.complete && l1.depends_on.is_none(), "{l1:?}");
        assert!(loc(&s, 2).is_none(), "a failed pull is not a copy");
        assert_eq!(
            loc(&s, 0).unwrap().serving,
            None,
            "the source serves nobody"
        );
        let mut out = Vec::new();
        s.handle(
            0,
            DirMsg::Delete {
                rid: 3,
                id: "x".into(),
            },
            &mut out,
        );
        assert!(
            out.iter().any(|(_, m)| matches!(m, Msg::Reply { reply: Reply::Deleted(n), .. } if n.contains(&0) && n.contains(&1))),
            "the delete evicts both copies: {out:?}"
        );
    }

    #[test]
    fn sources_serve_one_receiver_at_a_time_and_form_a_tree() {
        let mut s = Shard::new();
        // Receiver 1 arrives before the put: it waits.
        assert!(locate(&mut s, 1, vec![]).is_empty());
        let out = publish(&mut s, 0, false);
        assert_eq!(located(&out, 1), src(0));
        // 0 is busy serving 1; 2 is sent to the partial copy at 1.
        let out = locate(&mut s, 2, vec![]);
        assert_eq!(located(&out, 2), src(1));
        // 0 and 1 busy, 2 free: 3 pulls from 2.
        assert_eq!(located(&locate(&mut s, 3, vec![]), 3), src(2));
        // 0 completes its put and 1 finishes: both are free; 4 gets a complete copy first.
        publish(&mut s, 0, true);
        let mut out = Vec::new();
        s.handle(
            1,
            DirMsg::TransferDone {
                id: "x".into(),
                source: 0,
                receiver: 1,
                token: 99, // stale: not this assignment's token
                ok: true,
            },
            &mut out,
        );
        assert_eq!(
            located(&locate(&mut s, 4, vec![]), 4),
            src(3),
            "0 is still serving 1"
        );
        s.handle(
            1,
            DirMsg::TransferDone {
                id: "x".into(),
                source: 0,
                receiver: 1,
                token: 1, // the Locate's rid
                ok: true,
            },
            &mut out,
        );
        assert_eq!(located(&locate(&mut s, 6, vec![]), 6), src(0));
        // 1 is complete but still serving 2, 3 serves 4: the lowest free partial copy is 4.
        assert_eq!(located(&locate(&mut s, 5, vec![]), 5), src(4));
        let log = s.assignments();
        assert_eq!(log.len(), 6);
        assert!(log[4].source_complete && !log[1].source_complete && !log[3].source_complete);
    }

    #[test]
    fn never_hands_a_source_that_depends_on_the_requester() {
        let mut s = Shard::new();
        publish(&mut s, 0, false);
        locate(&mut s, 1, vec![]); // 1 <- 0
        locate(&mut s, 2, vec![]); // 2 <- 1
                                   // 0 dies: 1 must not be sent to 2, whose bytes come from 1.
        let mut out = Vec::new();
        s.node_down(0, Instant::now(), &|_| true, &mut out);
        assert!(out.is_empty());
        // A fresh get from a listed node is told to use its local copy...
        assert_eq!(located(&locate(&mut s, 1, vec![]), 1), Located::Local);
        // ...but a resuming one needs a source, and waits rather than loop through 2.
        assert!(
            locate_as(&mut s, 1, true, vec![]).is_empty(),
            "1 waits rather than loop through 2"
        );
        // A fresh complete copy appears at 3: 1 is served from it.
        let out = publish(&mut s, 3, true);
        assert_eq!(located(&out, 1), src(3));
    }

    /// A small object's bytes go inline to its readers up to `INLINE_FANOUT` bytes; the next
    /// readers are sent to free copies (the putter's, then each new one, partial or not),
    /// and get the bytes inline again when no copy is free, on a resumed pull, and at a node
    /// that has a copy.
    #[test]
    fn a_small_object_read_by_many_sends_the_later_readers_to_copies() {
        let mut s = Shard::new();
        let size = 16 << 10;
        let mut out = Vec::new();
        let put = DirMsg::PutInline {
            rid: 1,
            id: "x".into(),
            node: 0,
            data: vec![7u8; size as usize],
            then_subscribe: None,
        };
        s.handle(0, put, &mut out);
        let inline = |out: &Out, r: NodeId| match located(out, r) {
            Located::Inline(d) => d.len() as u64 == size && d.iter().all(|&b| b == 7),
            _ => false,
        };
        let source = |out: &Out, r: NodeId| match located(out, r) {
            Located::Source { node, .. } => Some(node),
            _ => None,
        };
        let first = (INLINE_FANOUT / size) as NodeId;
        for r in 1..=first {
            assert!(inline(&locate(&mut s, r, vec![]), r), "reader {r}");
        }
        // Over the budget: the putter's copy serves the next reader, whose copy (filling)
        // serves the one after, and so on (a tree grows as they come).
        let (a, b, c, d) = (first + 1, first + 2, first + 3, first + 4);
        assert_eq!(source(&locate(&mut s, a, vec![]), a), Some(0));
        assert_eq!(source(&locate(&mut s, b, vec![]), b), Some(a));
        assert_eq!(source(&locate(&mut s, c, vec![]), c), Some(b));
        // No copy it may use (the free one excluded, the others busy): inline again rather
        // than a wait.
        assert!(inline(&locate(&mut s, d, vec![c]), d));
        // A resumed pull, and a node with a copy of its own, get the bytes inline.
        assert!(inline(&locate_as(&mut s, a, true, vec![]), a));
        assert!(inline(&locate(&mut s, 0, vec![]), 0));
    }

    #[test]
    fn a_deleted_objects_tombstone_outlives_its_owner_at_the_next_owner() {
        let tomb = |s: &mut Shard, from: NodeId, node: NodeId, kept: bool| {
            let id = "x".into();
            s.handle(from, DirMsg::Tombstone { id, node, kept }, &mut Vec::new());
        };
        let t0 = Instant::now();
        // Kept aside: while its owner lives a reader here waits (not this shard's entry).
        let mut s = Shard::new();
        tomb(&mut s, 7, 7, true);
        assert!(locate(&mut s, 3, vec![]).is_empty(), "waits");
        // The owner dies and the entry moves here: the reader waiting, and later ones, are
        // told it is not found.
        let mut out = Vec::new();
        s.node_down(7, t0, &|_| true, &mut out);
        assert_eq!(located(&out, 3), Located::NotFound);
        assert_eq!(located(&locate(&mut s, 4, vec![]), 4), Located::NotFound);
        // Taken back (the object was put again): a reader waits for its holders to
        // republish, and is sent to one.
        let mut s = Shard::new();
        tomb(&mut s, 7, 7, true);
        tomb(&mut s, 7, 7, false);
        s.node_down(7, t0, &|_| true, &mut Vec::new());
        assert!(locate(&mut s, 3, vec![]).is_empty());
        assert_eq!(located(&publish(&mut s, 5, true), 3), src(5));
        // Said by another node than the owner (forged), or the entry did not move here:
        // nothing.
        for (from, moved) in [(2, true), (7, false)] {
            let mut s = Shard::new();
            tomb(&mut s, from, 7, true);
            s.node_down(7, t0, &|_| moved, &mut Vec::new());
            assert!(locate(&mut s, 3, vec![]).is_empty(), "{from} {moved}");
        }
        // A copy published here since (put again, republished by its holder): it stands.
        let mut s = Shard::new();
        tomb(&mut s, 7, 7, true);
        publish(&mut s, 5, true);
        s.node_down(7, t0, &|_| true, &mut Vec::new());
        assert_eq!(located(&locate(&mut s, 3, vec![]), 3), src(5));
        // Bounded: the oldest are dropped.
        let mut s = Shard::new();
        for k in 0..TOMBSTONES + 10 {
            let (id, node) = (ObjectId::new(format!("t{k}")), 7);
            s.handle(
                node,
                DirMsg::Tombstone {
                    id,
                    node,
                    kept: true,
                },
                &mut Vec::new(),
            );
        }
        assert_eq!(s.backup_tombstones.len(), TOMBSTONES);
        assert!(!s.backup_tombstones.contains(&ObjectId::new("t0")));
        assert!(s.backup_tombstones.order_len() <= 2 * TOMBSTONES);
    }

    #[test]
    fn inline_delete_and_tombstones() {
        let mut s = Shard::new();
        let mut out = Vec::new();
        s.handle(
            0,
            DirMsg::PutInline {
                rid: 1,
                id: "x".into(),
                node: 0,
                data: vec![1, 2],
                then_subscribe: None,
            },
            &mut out,
        );
        assert_eq!(
            located(&locate(&mut s, 3, vec![]), 3),
            Located::Inline(vec![1, 2])
        );
        let mut out = Vec::new();
        s.handle(
            2,
            DirMsg::Delete {
                rid: 9,
                id: "x".into(),
            },
            &mut out,
        );
        assert_eq!(
            out,
            vec![(
                2,
                Msg::Reply {
                    rid: 9,
                    reply: Reply::Deleted(vec![0])
                }
            )]
        );
        assert_eq!(located(&locate(&mut s, 3, vec![]), 3), Located::NotFound);
        // Subscribers of a deleted id are answered with None.
        let mut out = Vec::new();
        s.handle(
            4,
            DirMsg::Subscribe {
                rid: 5,
                id: "x".into(),
            },
            &mut out,
        );
        assert_eq!(
            out,
            vec![(
                4,
                Msg::Reply {
                    rid: 5,
                    reply: Reply::Info(None)
                }
            )]
        );
    }

    #[test]
    fn reset_drops_copies_but_keeps_readers_waiting() {
        let mut s = Shard::new();
        publish(&mut s, 0, false);
        assert_eq!(located(&locate(&mut s, 1, vec![]), 1), src(0));
        let mut out = Vec::new();
        s.handle(
            4,
            DirMsg::Reset {
                rid: 7,
                id: "x".into(),
            },
            &mut out,
        );
        match &out[..] {
            [(
                4,
                Msg::Reply {
                    rid: 7,
                    reply: Reply::Deleted(nodes),
                },
            )] => {
                assert_eq!(nodes, &vec![0, 1], "both copies are to be evicted")
            }
            o => panic!("{o:?}"),
        }
        // No tombstone: a reader and a subscriber wait for the recomputed copy.
        assert!(locate(&mut s, 2, vec![]).is_empty(), "2 waits");
        let mut out = Vec::new();
        s.handle(
            3,
            DirMsg::Subscribe {
                rid: 8,
                id: "x".into(),
            },
            &mut out,
        );
        assert!(out.is_empty(), "3 waits");
        let out = publish(&mut s, 5, false);
        assert_eq!(
            located(&out, 2),
            src_at(5, 1),
            "the new bytes are of epoch 1"
        );
        assert!(out.iter().any(|(n, m)| *n == 3
            && matches!(
                m,
                Msg::Reply {
                    rid: 8,
                    reply: Reply::Info(Some(_))
                }
            )));
    }

    /// A node that floods the shard with waits for objects that never come is refused past
    /// its bound, with an error; another node's wait is still taken and answered, and the
    /// flooder's waits count off as they are answered (room again).
    #[test]
    fn a_flood_of_waits_is_refused_past_its_bound_and_others_still_wait() {
        let mut s = Shard::new();
        let mut out = Vec::new();
        let bound = queued::MAX_PER_NODE as u64;
        // Subscriptions, then reads that wait: each kind bounded on its own.
        for k in 0..2 * (bound + 3) {
            let (id, rid) = (ObjectId::new(format!("never{}", k % 1000)), k + 1);
            match k < bound + 3 {
                true => s.handle(9, DirMsg::Subscribe { rid, id }, &mut out),
                false => s.handle(
                    9,
                    DirMsg::Locate {
                        rid,
                        id,
                        wait: true,
                        resume: false,
                        exclude: Vec::new(),
                        epoch: None,
                    },
                    &mut out,
                ),
            }
        }
        // The last three of each kind are refused, with an error.
        let refused: Vec<Rid> = out
            .iter()
            .filter_map(|(n, m)| match m {
                Msg::Reply {
                    rid,
                    reply: Reply::Error(e),
                } if *n == 9 && e.contains("waiting") => Some(*rid),
                _ => None,
            })
            .collect();
        let last = 2 * (bound + 3);
        let want = [bound + 1, bound + 2, bound + 3, last - 2, last - 1, last];
        assert_eq!(refused, want);
        assert_eq!(out.len(), 6, "nothing else answered");
        out.clear();
        // Another node still waits, and is answered when the object comes.
        assert!(subscribe(&mut s, 4, 1, "x").is_empty());
        let out = publish(&mut s, 2, false);
        assert!(matches!(
            &out[..],
            [(
                4,
                Msg::Reply {
                    rid: 1,
                    reply: Reply::Info(Some(_))
                }
            )]
        ));
        // The flooder's waits on one object answered (it is made): that many fit again.
        let mut out = Vec::new();
        s.handle(
            2,
            DirMsg::Publish {
                id: "never7".into(),
                size: 100,
                node: 2,
                complete: true,
            },
            &mut out,
        );
        // (Its subscriptions to it: those count against the subscriptions' bound.)
        let answered = out
            .iter()
            .filter(|(n, m)| {
                *n == 9
                    && matches!(
                        m,
                        Msg::Reply {
                            reply: Reply::Info(_),
                            ..
                        }
                    )
            })
            .count();
        assert!(answered > 0);
        for k in 0..answered as u64 {
            let out = subscribe(&mut s, 9, 900_000 + k, "later");
            assert!(out.is_empty(), "room for as many as were answered");
        }
        assert_eq!(subscribe(&mut s, 9, 1, "later").len(), 1, "and no more");
    }

    #[test]
    fn subscribe_pushes_on_first_location() {
        let mut s = Shard::new();
        assert!(subscribe(&mut s, 4, 5, "x").is_empty());
        let out = publish(&mut s, 2, false);
        match &out[..] {
            [(
                4,
                Msg::Reply {
                    rid: 5,
                    reply: Reply::Info(Some(i)),
                },
            )] => {
                assert_eq!(i.locations[0].node, 2);
                assert!(!i.locations[0].complete);
            }
            o => panic!("{o:?}"),
        }
    }

    /// `node` puts `id` inline (one byte per `len`), asking for `then` on `rid`.
    fn put_then(s: &mut Shard, node: NodeId, rid: Rid, id: &str, then: &str, len: usize) -> Out {
        let mut out = Vec::new();
        let put = DirMsg::PutInline {
            rid,
            id: id.into(),
            node,
            data: vec![node as u8; len],
            then_subscribe: Some(then.into()),
        };
        s.handle(node, put, &mut out);
        out
    }

    #[test]
    fn a_put_that_asks_for_another_object_is_answered_with_it() {
        let mut s = Shard::new();
        // The result is not there: the put is stored, and nothing is answered yet (no Ack).
        assert!(put_then(&mut s, 2, 7, "in2", "out", 8).is_empty());
        assert!(s.info(&"in2".into()).is_some(), "the input is listed");
        // A second participant, and a put that asks for nothing.
        assert!(put_then(&mut s, 3, 8, "in3", "out", 8).is_empty());
        assert!(put_then(&mut s, 4, NO_REPLY, "in4", "out", 8).is_empty());
        // The result comes: both askers get its bytes on their put's request id.
        let mut out = Vec::new();
        let result = DirMsg::PutInline {
            rid: NO_REPLY,
            id: "out".into(),
            node: 1,
            data: vec![9; 8],
            then_subscribe: None,
        };
        s.handle(1, result, &mut out);
        out.sort_by_key(|(to, _)| *to);
        match &out[..] {
            [(
                2,
                Msg::Reply {
                    rid: 7,
                    reply: Reply::InfoInline(_, a),
                },
            ), (
                3,
                Msg::Reply {
                    rid: 8,
                    reply: Reply::InfoInline(_, b),
                },
            )] => assert!(a == &vec![9; 8] && b == &vec![9; 8]),
            o => panic!("{o:?}"),
        }
        // Once the result is there, such a put is answered at once.
        match &put_then(&mut s, 5, 9, "in5", "out", 8)[..] {
            [(
                5,
                Msg::Reply {
                    rid: 9,
                    reply: Reply::InfoInline(..),
                },
            )] => {}
            o => panic!("{o:?}"),
        }
        // An object too large to be inline is refused with an error, and nothing is asked.
        match &put_then(&mut s, 6, 10, "in6", "later", INLINE_LIMIT as usize)[..] {
            [(
                6,
                Msg::Reply {
                    rid: 10,
                    reply: Reply::Error(_),
                },
            )] => {}
            o => panic!("{o:?}"),
        }
        assert!(s.info(&"in6".into()).is_none(), "not stored");
        let mut out = Vec::new();
        let later = DirMsg::PutInline {
            rid: NO_REPLY,
            id: "later".into(),
            node: 1,
            data: vec![1],
            then_subscribe: None,
        };
        s.handle(1, later, &mut out);
        assert!(
            out.is_empty(),
            "the refused put subscribed to nothing: {out:?}"
        );
    }

    #[test]
    fn a_node_cannot_speak_for_another() {
        let mut s = Shard::new();
        publish(&mut s, 1, true);
        let mut out = Vec::new();
        // Node 3 claims a copy on node 2, withdraws node 1's, and fills a copy as node 2.
        for m in [
            DirMsg::Publish {
                id: "x".into(),
                size: 100,
                node: 2,
                complete: true,
            },
            DirMsg::Withdraw {
                id: "x".into(),
                node: 1,
            },
            DirMsg::PutInline {
                rid: NO_REPLY,
                id: "y".into(),
                node: 2,
                data: vec![1],
                then_subscribe: None,
            },
            DirMsg::Claim {
                id: "x".into(),
                source: 1,
                receiver: 2,
                token: 9,
            },
        ] {
            s.handle(3, m, &mut out);
        }
        assert!(out.is_empty(), "{out:?}");
        let info = s.info(&"x".into()).expect("entry");
        let holders: Vec<NodeId> = info.locations.iter().map(|l| l.node).collect();
        assert_eq!(holders, vec![1], "only the real copy is listed");
        assert!(
            s.info(&"y".into()).is_none(),
            "no inline object on behalf of node 2"
        );
        assert!(s.assignments().is_empty(), "no claim on behalf of node 2");
    }

    /// A halving run's coordinator lists its ranks' copies in one message: each is a
    /// complete copy a waiting reader is sent to, the run's promise ends, and a message
    /// that names more nodes than a run has, or comes from another node than the one it
    /// names as the coordinator, changes nothing.
    #[test]
    fn a_runs_coordinator_lists_its_ranks_copies_in_one_message() {
        let mut s = Shard::for_cluster(8);
        let mut out = Vec::new();
        let promise = DirMsg::Promise {
            id: "x".into(),
            node: 0,
            promised: true,
        };
        s.handle(0, promise, &mut out);
        let run = |node, copies: Vec<NodeId>| DirMsg::PublishRun {
            id: "x".into(),
            size: 100,
            node,
            copies,
        };
        // Forged: sent by node 3 in node 0's name; too many copies.
        s.handle(3, run(0, vec![1, 2]), &mut out);
        let many = (0..=MAX_RUN_COPIES as NodeId).collect();
        s.handle(0, run(0, many), &mut out);
        assert!(out.is_empty(), "{out:?}");
        assert!(s.info(&"x".into()).is_none_or(|i| i.locations.is_empty()));
        // A reader waits; the coordinator lists ranks 1, 2 and 5 (5 twice), a rank this
        // shard saw die (6), and nodes that are no members (the cluster has 8).
        let _ = locate(&mut s, 7, vec![]);
        s.node_down(6, Instant::now(), &|_| false, &mut out);
        s.handle(0, run(0, vec![5, 1, 2, 5, 6, 8, 4000]), &mut out);
        let info = s.info(&"x".into()).expect("entry");
        let mut holders: Vec<NodeId> = info.locations.iter().map(|l| l.node).collect();
        holders.sort_unstable();
        assert_eq!(
            holders,
            vec![1, 2, 5, 7],
            "the ranks, and the reader's partial copy"
        );
        assert!(info.locations.iter().all(|l| l.complete == (l.node != 7)));
        assert!(!s.promises.contains_key(&"x".into()), "the promise ends");
        match &out[..] {
            [(
                7,
                Msg::Reply {
                    reply: Reply::Located(Located::Source { node, .. }),
                    ..
                },
            )] => {
                assert!([1, 2, 5].contains(node))
            }
            o => panic!("the waiting reader is sent to a rank: {o:?}"),
        }
        // A rank that could not store its copy withdraws it.
        out.clear();
        s.handle(
            2,
            DirMsg::Withdraw {
                id: "x".into(),
                node: 2,
            },
            &mut out,
        );
        let info = s.info(&"x".into()).expect("entry");
        assert!(info.locations.iter().all(|l| l.node != 2));
    }

    /// A claim on a source not listed yet waits for it to publish; if the claimant's copy
    /// is withdrawn, or the directory gives it a source meanwhile, the claim is void when the
    /// source publishes: applied, it said the copy filled from the claimed source, so a
    /// partial copy that really fills from the requester was handed to it (each of two
    /// partial copies then waits on the other until the op timeout).
    #[test]
    fn a_stale_pending_claim_never_hides_a_cycle() {
        let mut s = Shard::new();
        // 3 claims 4 before 4 is listed (its pull will fail); 0 holds a partial copy.
        claim(&mut s, 4, 3, 11);
        publish(&mut s, 0, false);
        // 3 asks the directory instead and fills from 0.
        assert_eq!(located(&locate(&mut s, 3, vec![4]), 3), src(0));
        // 4 publishes: 3's old claim must not count.
        publish(&mut s, 4, false);
        assert_eq!(loc(&s, 3).unwrap().depends_on, Some(0));
        // 0 asks for a source (excluding 4, say its pull from 4 failed): 3 depends on 0 and
        // must not be given, so 0 waits.
        let out = locate_epoch(&mut s, 0, true, vec![4], Some(0));
        assert!(out.is_empty(), "no cycle 0 <- 3 <- 0: {out:?}");
        // Withdrawn copies void their waiting claims too.
        let mut t = Shard::new();
        claim(&mut t, 4, 3, 12);
        let mut out = Vec::new();
        let w = DirMsg::Withdraw {
            id: "x".into(),
            node: 3,
        };
        t.handle(3, w, &mut out);
        publish(&mut t, 4, true);
        assert!(loc(&t, 3).is_none(), "the void claim lists no copy on 3");
        assert_eq!(loc(&t, 4).unwrap().serving, None, "and 4 serves nobody");
    }

    /// A receiver's pull ends well, its copy is deleted before the report reaches the shard,
    /// and it fills again under another assignment: the late report is of the earlier copy
    /// and must not list the new one complete (seed 95616 of the broadcast soak: listed
    /// complete with no source, it was handed out as a source, and readers waited on each
    /// other in a circle until the op timeout).
    #[test]
    fn a_late_report_of_an_earlier_copy_does_not_list_the_new_one_complete() {
        let mut s = Shard::new();
        publish(&mut s, 4, true);
        publish(&mut s, 1, false);
        assert_eq!(located(&locate(&mut s, 8, vec![]), 8), src(4));
        // 8's copy is deleted; it asks again and is sent to the partial copy on 1.
        let mut out = Vec::new();
        let w = DirMsg::Withdraw {
            id: "x".into(),
            node: 8,
        };
        s.handle(8, w, &mut out);
        assert_eq!(located(&locate(&mut s, 8, vec![4]), 8), src(1));
        // The first pull's report comes now.
        done(&mut s, 4, 8, 8, true);
        let l = loc(&s, 8).unwrap();
        assert!(!l.complete && l.depends_on == Some(1), "{l:?}");
        // So 1, asking for another source, is not sent to 8 (which fills from 1).
        assert!(locate_epoch(&mut s, 1, true, vec![4], Some(0)).is_empty());
        // The same source under a later assignment: only that assignment's report counts.
        let mut t = Shard::new();
        publish(&mut t, 4, true);
        assert_eq!(located(&locate(&mut t, 8, vec![]), 8), src(4));
        done(&mut t, 4, 8, 8, false);
        let mut out = Vec::new();
        let again = DirMsg::Locate {
            rid: 99,
            id: "x".into(),
            wait: true,
            resume: true,
            exclude: vec![],
            epoch: Some(0),
        };
        t.handle(8, again, &mut out);
        assert_eq!(located(&out, 8), src(4));
        done(&mut t, 4, 8, 8, true);
        assert!(
            !loc(&t, 8).unwrap().complete,
            "a report of the earlier assignment"
        );
        done(&mut t, 4, 8, 99, true);
        let l = loc(&t, 8).unwrap();
        assert!(l.complete && l.depends_on.is_none(), "{l:?}");
        // A receiver whose source is not known here (listed by its own publish) is still
        // listed complete by a good report.
        publish(&mut t, 5, false);
        done(&mut t, 4, 5, 7, true);
        assert!(loc(&t, 5).unwrap().complete);
    }

    /// A node listed with a complete copy that asks to resume a pull (a stale pull on a node
    /// that has since produced the object) is told to read its own copy: it is never made
    /// a receiver, which listed the complete copy as partial and filling from another node.
    #[test]
    fn a_complete_copy_is_never_made_a_receiver() {
        let mut s = Shard::new();
        publish(&mut s, 2, false);
        publish(&mut s, 4, true);
        let out = locate_epoch(&mut s, 4, true, vec![], Some(0));
        assert_eq!(located(&out, 4), Located::Local);
        let l = loc(&s, 4).unwrap();
        assert!(l.complete && l.depends_on.is_none());
        assert_eq!(loc(&s, 2).unwrap().serving, None);
        // A partial copy that resumes still gets a source.
        let out = locate_epoch(&mut s, 2, true, vec![], Some(0));
        assert_eq!(located(&out, 2), src(4));
    }

    fn reset(s: &mut Shard) -> Out {
        let mut out = Vec::new();
        let id = "x".into();
        s.handle(4, DirMsg::Reset { rid: 7, id }, &mut out);
        out
    }

    /// A partial copy begun before a reset holds bytes of the old computation: waiting for a
    /// new source then, or asking for one after, it is told to start over, and never becomes
    /// a source of the new bytes. Plain readers, and pulls of the new epoch, are served.
    #[test]
    fn pulls_begun_before_a_reset_start_over() {
        let mut s = Shard::new();
        publish(&mut s, 0, false);
        assert_eq!(located(&locate(&mut s, 1, vec![]), 1), src_at(0, 0));
        // 1's source failed: it waits for another, excluding 0.
        assert!(locate_epoch(&mut s, 1, true, vec![0], Some(0)).is_empty());
        // 2 started on a claim (epoch unknown) and waits too.
        assert!(locate_epoch(&mut s, 2, true, vec![0, 1], None).is_empty());
        let plain = locate(&mut s, 3, vec![0, 1, 2]);
        assert!(plain.is_empty(), "3 is a plain reader");
        let out = reset(&mut s);
        assert_eq!(located(&out, 1), Located::Reset);
        assert_eq!(located(&out, 2), Located::Reset);
        assert!(!out.iter().any(|(n, _)| *n == 3), "3 keeps waiting");
        // A resumed locate that was on its way during the reset.
        let late = locate_epoch(&mut s, 6, true, vec![], Some(0));
        assert_eq!(located(&late, 6), Located::Reset);
        // ... and one of a pull begun on a claim (its epoch unknown).
        let late = locate_epoch(&mut s, 7, true, vec![], None);
        assert_eq!(located(&late, 7), Located::Reset);
        // The new bytes: epoch 1 for the reader, and a resumed pull of epoch 1 is served.
        let out = publish(&mut s, 5, false);
        assert_eq!(located(&out, 3), src_at(5, 1));
        assert!(s
            .info(&"x".into())
            .unwrap()
            .locations
            .iter()
            .all(|l| l.node != 6));
        done(&mut s, 5, 3, 3, false);
        let out = locate_epoch(&mut s, 3, true, vec![], Some(1));
        assert_eq!(located(&out, 3), src_at(5, 1));
        // Another reset, then a delete: the epoch is forgotten with the object.
        reset(&mut s);
        let mut out = Vec::new();
        s.handle(
            4,
            DirMsg::Delete {
                rid: 9,
                id: "x".into(),
            },
            &mut out,
        );
        assert!(s.epochs.is_empty());
    }

    fn down(s: &mut Shard, node: NodeId, at: Instant) -> Out {
        let mut out = Vec::new();
        s.node_down(node, at, &|_| true, &mut out);
        out
    }

    fn tick(s: &mut Shard, at: Instant) -> Out {
        let mut out = Vec::new();
        s.tick(at, Duration::from_secs(5), &mut out);
        out
    }

    /// The only complete copy dies, with a reader pulling from it and another waiting: both
    /// are told the object is lost once `lost_after` passed with nothing published, and so
    /// is a later reader at once; a subscriber keeps waiting, and a copy put again is found.
    #[test]
    fn an_object_whose_every_copy_died_is_lost_after_the_grace() {
        let mut s = Shard::new();
        let t0 = Instant::now();
        publish(&mut s, 1, true);
        assert_eq!(located(&locate(&mut s, 2, vec![]), 2), src(1));
        assert!(
            locate(&mut s, 3, vec![2]).is_empty(),
            "the source is busy, 2 excluded"
        );
        let mut out = Vec::new();
        s.handle(
            6,
            DirMsg::Subscribe {
                rid: 9,
                id: "y".into(),
            },
            &mut out,
        );
        assert!(down(&mut s, 1, t0).is_empty());
        // 2 lost its source mid-pull and asks again, resuming.
        assert!(locate_as(&mut s, 2, true, vec![1]).is_empty());
        assert!(
            tick(&mut s, t0 + Duration::from_secs(4)).is_empty(),
            "not yet"
        );
        let out = tick(&mut s, t0 + Duration::from_secs(5));
        assert_eq!(located(&out, 2), Located::Lost);
        assert_eq!(located(&out, 3), Located::Lost);
        assert_eq!(out.len(), 2, "{out:?}");
        assert_eq!(located(&locate(&mut s, 4, vec![]), 4), Located::Lost);
        assert!(tick(&mut s, t0 + Duration::from_secs(60)).is_empty());
        // Put again: found as any object.
        publish(&mut s, 5, true);
        assert_eq!(located(&locate(&mut s, 4, vec![]), 4), src(5));
    }

    /// What a death does not make lost: an object with another complete copy, or a
    /// producer's partial one (a put under way, a reduce's output), or one its producer
    /// resets (it computes it again), or one published again within the grace, or an inline
    /// one (its bytes live here).
    #[test]
    fn what_is_not_lost() {
        let t0 = Instant::now();
        let late = t0 + Duration::from_secs(10);
        // Another complete copy.
        let mut s = Shard::new();
        publish(&mut s, 1, true);
        publish(&mut s, 2, true);
        down(&mut s, 1, t0);
        assert!(tick(&mut s, late).is_empty());
        assert_eq!(located(&locate(&mut s, 3, vec![]), 3), src(2));
        // A producer's partial copy.
        let mut s = Shard::new();
        publish(&mut s, 1, true);
        publish(&mut s, 2, false);
        down(&mut s, 1, t0);
        assert!(tick(&mut s, late).is_empty());
        assert_eq!(located(&locate(&mut s, 3, vec![]), 3), src(2));
        // Reset by its producer after the death: readers wait for the new copy.
        let mut s = Shard::new();
        publish(&mut s, 1, false);
        assert!(locate(&mut s, 3, vec![1]).is_empty());
        down(&mut s, 1, t0);
        reset(&mut s);
        assert!(tick(&mut s, late).is_empty());
        let out = publish(&mut s, 2, false);
        assert_eq!(located(&out, 3), src_at(2, 1));
        // Published again within the grace.
        let mut s = Shard::new();
        publish(&mut s, 1, true);
        assert_eq!(located(&locate(&mut s, 3, vec![]), 3), src(1));
        down(&mut s, 1, t0);
        publish(&mut s, 2, true);
        assert!(tick(&mut s, late).is_empty());
        assert_eq!(located(&locate_as(&mut s, 3, true, vec![1]), 3), src(2));
        // Inline: the bytes are here.
        let mut s = Shard::new();
        let mut out = Vec::new();
        s.handle(
            1,
            DirMsg::PutInline {
                rid: NO_REPLY,
                id: "x".into(),
                node: 1,
                data: vec![7; 10],
                then_subscribe: None,
            },
            &mut out,
        );
        down(&mut s, 1, t0);
        assert!(tick(&mut s, late).is_empty());
        assert_eq!(
            located(&locate(&mut s, 3, vec![]), 3),
            Located::Inline(vec![7; 10])
        );
    }

    /// A reader's partial copy left when the copy it filled from died cannot complete: the
    /// object is lost though a location is still listed.
    #[test]
    fn partial_copies_filled_from_the_dead_do_not_keep_an_object() {
        let t0 = Instant::now();
        let mut s = Shard::new();
        publish(&mut s, 1, true);
        assert_eq!(located(&locate(&mut s, 2, vec![]), 2), src(1));
        // 3 reads from 2's partial copy (1 is busy serving 2).
        assert_eq!(located(&locate(&mut s, 3, vec![]), 3), src(2));
        down(&mut s, 1, t0);
        assert!(locate_as(&mut s, 2, true, vec![1]).is_empty());
        let out = tick(&mut s, t0 + Duration::from_secs(5));
        assert_eq!(located(&out, 2), Located::Lost);
        assert!(loc(&s, 3).is_some(), "3's partial copy is still listed");
    }

    /// A producer that stops for good withdraws its unfinished copy (a reduce task whose
    /// coordinator died): with no other copy that can complete, the object is lost after the
    /// grace; a withdraw that leaves a complete copy loses nothing.
    #[test]
    fn a_withdrawn_last_producer_makes_the_object_lost() {
        let withdraw = |s: &mut Shard, node: NodeId| {
            let id = "x".into();
            s.handle(node, DirMsg::Withdraw { id, node }, &mut Vec::new());
        };
        let mut s = Shard::new();
        publish(&mut s, 1, false);
        assert!(locate(&mut s, 3, vec![1]).is_empty());
        withdraw(&mut s, 1);
        let out = tick(&mut s, Instant::now() + Duration::from_secs(10));
        assert_eq!(located(&out, 3), Located::Lost);
        // Another object, withdrawn from one of two complete copies.
        let mut s = Shard::new();
        publish(&mut s, 1, true);
        publish(&mut s, 2, true);
        withdraw(&mut s, 1);
        assert!(tick(&mut s, Instant::now() + Duration::from_secs(10)).is_empty());
        assert_eq!(located(&locate(&mut s, 3, vec![]), 3), src(2));
    }

    fn promise(s: &mut Shard, node: NodeId, promised: bool) {
        let id = "x".into();
        let msg = DirMsg::Promise { id, node, promised };
        s.handle(node, msg, &mut Vec::new());
    }

    /// The coordinator of a reduce promised its target and died before any copy of it was
    /// listed: the readers waiting for it are told it is lost after the grace, as a later
    /// one at once; a copy published later is found, with its own size. A promise taken
    /// back (the reduce failed) does the same.
    #[test]
    fn a_promise_whose_maker_dies_before_any_copy_makes_the_object_lost() {
        let t0 = Instant::now();
        for died in [true, false] {
            let mut s = Shard::new();
            promise(&mut s, 1, true);
            assert!(locate(&mut s, 3, vec![]).is_empty(), "nothing to read yet");
            let mut peers = std::collections::HashSet::new();
            s.peers_depended_on(&mut peers);
            assert!(peers.contains(&1), "the promising node is watched");
            match died {
                true => assert!(down(&mut s, 1, t0).is_empty()),
                false => promise(&mut s, 1, false),
            }
            let at = match died {
                true => t0,
                false => Instant::now(),
            };
            assert!(
                tick(&mut s, at + Duration::from_secs(4)).is_empty(),
                "not yet"
            );
            let out = tick(&mut s, at + Duration::from_secs(5));
            assert_eq!(located(&out, 3), Located::Lost, "died: {died}");
            assert_eq!(located(&locate(&mut s, 4, vec![]), 4), Located::Lost);
            assert!(s.info(&"x".into()).is_some_and(|i| i.lost));
            publish(&mut s, 5, true);
            assert_eq!(located(&locate(&mut s, 4, vec![]), 4), src(5));
            assert_eq!(s.info(&"x".into()).map(|i| i.size), Some(100));
        }
    }

    /// What a promise keeps, and what it does not: another live promiser or a producer's
    /// copy keeps the object; a complete copy ends the promise (its maker's death then loses
    /// nothing); a new promise after the loss makes the object awaited again; a delete
    /// forgets it.
    #[test]
    fn what_a_promise_keeps() {
        let t0 = Instant::now();
        let late = t0 + Duration::from_secs(10);
        // Two coordinators promised it (a redo): one dies.
        let mut s = Shard::new();
        promise(&mut s, 1, true);
        promise(&mut s, 2, true);
        assert!(locate(&mut s, 3, vec![]).is_empty());
        down(&mut s, 1, t0);
        assert!(tick(&mut s, late).is_empty());
        // The survivor's output is listed: the waiting reader is sent to it.
        let out = publish(&mut s, 2, false);
        assert_eq!(located(&out, 3), src(2));
        // Complete: the promise ends, and a death of its maker after that loses nothing.
        let mut s = Shard::new();
        promise(&mut s, 1, true);
        publish(&mut s, 2, true);
        assert!(s.promises.is_empty(), "a complete copy ends the promise");
        down(&mut s, 1, t0);
        assert!(tick(&mut s, late).is_empty());
        assert_eq!(located(&locate(&mut s, 3, vec![]), 3), src(2));
        // Lost, then promised again by a survivor: waited for again.
        let mut s = Shard::new();
        promise(&mut s, 1, true);
        down(&mut s, 1, t0);
        assert!(locate(&mut s, 3, vec![]).is_empty());
        assert_eq!(located(&tick(&mut s, late), 3), Located::Lost);
        promise(&mut s, 2, true);
        assert!(locate(&mut s, 4, vec![]).is_empty(), "awaited again");
        assert!(tick(&mut s, late + Duration::from_secs(10)).is_empty());
        // ... until the survivor dies too.
        down(&mut s, 2, late);
        let out = tick(&mut s, late + Duration::from_secs(10));
        assert_eq!(located(&out, 4), Located::Lost);
        // Deleted: the promise is forgotten with the entry.
        let mut s = Shard::new();
        promise(&mut s, 1, true);
        let del = DirMsg::Delete {
            rid: 1,
            id: "x".into(),
        };
        s.handle(1, del, &mut Vec::new());
        assert!(s.promises.is_empty());
        // A node cannot promise for another, and the promisers of one object are bounded.
        let mut s = Shard::new();
        let msg = DirMsg::Promise {
            id: "x".into(),
            node: 2,
            promised: true,
        };
        s.handle(1, msg, &mut Vec::new());
        assert!(s.promises.is_empty());
        for n in 0..100 {
            promise(&mut s, n, true);
        }
        assert_eq!(s.promises[&ObjectId::from("x")].len(), PROMISERS);
        // A promise of a deleted object is ignored: it stays deleted.
        let mut s = Shard::new();
        let del = DirMsg::Delete {
            rid: 1,
            id: "x".into(),
        };
        s.handle(1, del, &mut Vec::new());
        promise(&mut s, 1, true);
        assert!(s.promises.is_empty());
    }

    /// The shard that owned an object died with its only copy: a pull resumed here (its
    /// source gone) of an object this shard never heard of makes it an orphan, lost after
    /// the grace unless a holder republishes it meanwhile; a plain locate does not (the
    /// object may be put later).
    #[test]
    fn a_resumed_pull_of_an_unknown_object_is_lost_unless_republished() {
        let late = Instant::now() + Duration::from_secs(10);
        let mut s = Shard::new();
        assert!(locate(&mut s, 2, vec![]).is_empty());
        assert!(tick(&mut s, late).is_empty(), "a plain reader waits");
        // Nor does a pull begun on a claim (no epoch: a reduce intermediate whose source
        // may publish later).
        assert!(locate_as(&mut s, 5, true, vec![1]).is_empty());
        assert!(tick(&mut s, late).is_empty(), "a claimed pull waits");
        assert!(locate_epoch(&mut s, 3, true, vec![1], Some(0)).is_empty());
        let out = tick(&mut s, late);
        assert_eq!(located(&out, 2), Located::Lost);
        assert_eq!(located(&out, 3), Located::Lost);
        // Republished within the grace: found.
        let mut s = Shard::new();
        assert!(locate_epoch(&mut s, 3, true, vec![1], Some(0)).is_empty());
        let out = publish(&mut s, 4, true);
        assert_eq!(located(&out, 3), src(4));
        assert!(tick(&mut s, late).is_empty());
    }

    /// A node that owns an object's entry keeps its promise to produce it, or its word that
    /// it holds a copy, at the entry's next owner: if it dies before taking it back, the
    /// object is an orphan there, lost after the grace unless a complete copy is
    /// republished; taken back, or deleted, it is not.
    #[test]
    fn what_the_next_owner_of_an_entry_keeps_loses_the_object_when_its_owner_dies() {
        let t0 = Instant::now();
        let late = t0 + Duration::from_secs(10);
        let backup = |s: &mut Shard, node: NodeId, id: &str, kept: bool| {
            let id = id.into();
            let copy = false;
            let msg = DirMsg::Backup {
                id,
                node,
                copy,
                kept,
            };
            s.handle(node, msg, &mut Vec::new());
        };
        // The promiser dies; its readers come here, before or after the death.
        let mut s = Shard::new();
        backup(&mut s, 7, "x", true);
        assert!(
            locate(&mut s, 3, vec![]).is_empty(),
            "waits: nothing is lost yet"
        );
        assert!(tick(&mut s, late).is_empty());
        down(&mut s, 7, t0);
        assert!(tick(&mut s, t0).is_empty(), "within the grace");
        let out = tick(&mut s, late);
        assert_eq!(located(&out, 3), Located::Lost);
        assert_eq!(located(&locate(&mut s, 4, vec![]), 4), Located::Lost);
        // A complete copy republished within the grace: found, not lost.
        let mut s = Shard::new();
        backup(&mut s, 7, "x", true);
        assert!(locate(&mut s, 3, vec![]).is_empty());
        down(&mut s, 7, t0);
        assert_eq!(located(&publish(&mut s, 4, true), 3), src(4));
        assert!(tick(&mut s, late).is_empty());
        // What a reader waiting at `s` hears once node 7 died and the grace passed.
        let heard = |mut s: Shard| -> Option<Located> {
            assert!(locate(&mut s, 3, vec![]).is_empty());
            down(&mut s, 7, t0);
            let out = tick(&mut s, late);
            out.iter().any(|(n, _)| *n == 3).then(|| located(&out, 3))
        };
        // Taken back (the operation ended): the promiser's death loses nothing.
        let mut s = Shard::new();
        backup(&mut s, 7, "x", true);
        backup(&mut s, 7, "x", false);
        assert_eq!(heard(s), None);
        // Only the promiser takes its promise back; a forgery on its behalf is ignored.
        let mut s = Shard::new();
        backup(&mut s, 7, "x", true);
        backup(&mut s, 6, "x", false);
        let forged = DirMsg::Backup {
            id: "x".into(),
            node: 7,
            copy: false,
            kept: false,
        };
        s.handle(5, forged, &mut Vec::new());
        assert!(locate(&mut s, 3, vec![]).is_empty());
        down(&mut s, 7, t0);
        assert_eq!(located(&tick(&mut s, late), 3), Located::Lost);
        // Another node's death loses nothing; a deleted object stays deleted.
        let mut s = Shard::new();
        backup(&mut s, 7, "x", true);
        backup(&mut s, 7, "y", true);
        down(&mut s, 6, t0);
        assert!(locate(&mut s, 3, vec![]).is_empty());
        assert!(tick(&mut s, late).is_empty());
        let del = DirMsg::Delete {
            rid: 1,
            id: "x".into(),
        };
        s.handle(1, del, &mut Vec::new());
        down(&mut s, 7, t0);
        let out = tick(&mut s, late);
        assert!(out.iter().all(|(to, _)| *to != 3), "x was deleted: {out:?}");
        assert!(s.entries.get(&ObjectId::from("y")).is_some_and(|e| e.lost));
        // What the owner asks before it tells: is its copy the only complete one listed?
        let mut s = Shard::new();
        assert!(
            !s.only_copy_on(&"x".into(), 1),
            "an entry this shard does not have"
        );
        publish(&mut s, 1, true);
        assert!(s.only_copy_on(&"x".into(), 1));
        publish(&mut s, 2, false);
        assert!(
            s.only_copy_on(&"x".into(), 1),
            "a partial copy dies with its source"
        );
        publish(&mut s, 2, true);
        assert!(!s.only_copy_on(&"x".into(), 1));
        // A copy told and a promise are kept apart: taking the promise back (its operation
        // ended well, making the copy) leaves the copy's word, and the object is lost with
        // its holder.
        let mut s = Shard::new();
        backup(&mut s, 7, "x", true);
        let copy = |kept| DirMsg::Backup {
            id: "x".into(),
            node: 7,
            copy: true,
            kept,
        };
        s.handle(7, copy(true), &mut Vec::new());
        backup(&mut s, 7, "x", false);
        assert_eq!(heard(s), Some(Located::Lost));
        // ... and taking both back loses nothing.
        let mut s = Shard::new();
        backup(&mut s, 7, "x", true);
        s.handle(7, copy(true), &mut Vec::new());
        s.handle(7, copy(false), &mut Vec::new());
        backup(&mut s, 7, "x", false);
        assert_eq!(heard(s), None);
        // Kept here though the entry did not move here (told by a node that did not own it,
        // or this shard is not the next owner any more): nothing lost.
        let mut s = Shard::new();
        backup(&mut s, 7, "x", true);
        assert!(locate(&mut s, 3, vec![]).is_empty());
        s.node_down(7, t0, &|_| false, &mut Vec::new());
        assert!(tick(&mut s, late).is_empty());
        // The words outlive a death that was not one (a dropped link, a false suspicion):
        // when the node dies for real later, they still count.
        let mut s = Shard::new();
        backup(&mut s, 7, "x", true);
        down(&mut s, 7, t0);
        let out = tick(&mut s, late);
        assert!(out.is_empty(), "nobody waited");
        assert_eq!(s.backups.len(), 1);
        publish(&mut s, 7, true); // it was alive after all, and its copy is listed again
        let del = DirMsg::Withdraw {
            id: "x".into(),
            node: 7,
        };
        s.handle(7, del, &mut Vec::new());
        assert!(locate(&mut s, 3, vec![]).is_empty());
        let later = late + Duration::from_secs(1);
        s.node_down(7, later, &|_| true, &mut Vec::new());
        let out = tick(&mut s, later + Duration::from_secs(10));
        assert_eq!(located(&out, 3), Located::Lost);
        // A lost entry left here from when this shard owned it before: when the entry moves
        // here again, its holders get the grace again (a republish finds it), and only then
        // is it lost again.
        let mut s = Shard::new();
        backup(&mut s, 7, "x", true);
        down(&mut s, 7, t0);
        tick(&mut s, late);
        assert_eq!(located(&locate(&mut s, 3, vec![]), 3), Located::Lost);
        let later = late + Duration::from_secs(1);
        s.node_down(6, later, &|id| id.as_str() == "x", &mut Vec::new());
        assert!(
            locate(&mut s, 4, vec![]).is_empty(),
            "waits: the grace again"
        );
        assert!(tick(&mut s, later).is_empty());
        assert_eq!(located(&publish(&mut s, 5, true), 4), src(5));
        let mut s2 = Shard::new();
        backup(&mut s2, 7, "x", true);
        down(&mut s2, 7, t0);
        tick(&mut s2, late);
        s2.node_down(6, later, &|_| true, &mut Vec::new());
        assert!(locate(&mut s2, 4, vec![]).is_empty());
        let out = tick(&mut s2, later + Duration::from_secs(10));
        assert_eq!(located(&out, 4), Located::Lost, "nobody republished it");
        // Bounded: the oldest are dropped, and take-backs leave nothing behind.
        let mut s = Shard::new();
        for k in 0..3 * BACKUPS {
            backup(&mut s, 7, &format!("t{k}"), true);
            backup(&mut s, 7, &format!("t{k}"), false);
        }
        assert!(s.backups.len() == 0 && s.backups.order_len() <= 2 * BACKUPS);
        // Told, taken back and told again: one place in the order, the newest.
        let mut s = Shard::new();
        backup(&mut s, 7, "a", true);
        backup(&mut s, 7, "a", false);
        backup(&mut s, 7, "b", true);
        backup(&mut s, 7, "a", true);
        backup(&mut s, 7, "a", true);
        for k in 0..BACKUPS - 2 {
            backup(&mut s, 7, &format!("f{k}"), true);
        }
        backup(&mut s, 7, "last", true);
        assert!(
            !s.backups.contains(&("b".into(), false)),
            "b was the oldest"
        );
        assert!(s.backups.contains(&("a".into(), false)));
        assert_eq!(s.backups.len(), BACKUPS);
        for k in 0..BACKUPS + 10 {
            backup(&mut s, 7, &format!("o{k}"), true);
        }
        assert_eq!(s.backups.len(), BACKUPS);
        assert!(!s.backups.contains(&("o0".into(), false)));
        let newest = (ObjectId::from(format!("o{}", BACKUPS + 9)), false);
        assert!(s.backups.contains(&newest));
    }

    /// A rank of a run whose coordinator died gives the target up: lost after the grace once
    /// the shard has seen the coordinator die too (before or after the give-up), if nothing
    /// else can produce it; a give-up naming a live node, another node's promise or a
    /// complete copy keeps it.
    #[test]
    fn a_give_up_loses_only_what_nothing_else_can_produce() {
        let t0 = Instant::now();
        let late = t0 + Duration::from_secs(10);
        let give_up = |s: &mut Shard, node: NodeId, coordinator: NodeId| {
            let id = "x".into();
            let msg = DirMsg::GiveUp {
                id,
                node,
                coordinator,
            };
            s.handle(node, msg, &mut Vec::new());
        };
        for seen_first in [true, false] {
            let mut s = Shard::new();
            assert!(locate(&mut s, 3, vec![]).is_empty());
            if seen_first {
                down(&mut s, 7, t0);
            }
            give_up(&mut s, 2, 7);
            if !seen_first {
                assert!(tick(&mut s, late).is_empty(), "7 is not known dead yet");
                down(&mut s, 7, t0);
            }
            assert_eq!(
                located(&tick(&mut s, late), 3),
                Located::Lost,
                "{seen_first}"
            );
        }
        // Naming a live node: nothing (a forged give-up cannot lose an awaited object).
        let mut s = Shard::new();
        assert!(locate(&mut s, 3, vec![]).is_empty());
        give_up(&mut s, 2, 1);
        assert!(tick(&mut s, late).is_empty());
        // Another node promised it.
        let mut s = Shard::new();
        promise(&mut s, 1, true);
        assert!(locate(&mut s, 3, vec![]).is_empty());
        down(&mut s, 7, t0);
        give_up(&mut s, 2, 7);
        assert!(tick(&mut s, late).is_empty());
        // A complete copy (a rank that committed before the coordinator died).
        let mut s = Shard::new();
        publish(&mut s, 1, true);
        down(&mut s, 7, t0);
        give_up(&mut s, 2, 7);
        assert!(tick(&mut s, late).is_empty());
        assert_eq!(located(&locate(&mut s, 3, vec![]), 3), src(1));
        // Bounded: the oldest give-ups waiting for their coordinator are dropped.
        let mut s = Shard::new();
        for k in 0..GIVE_UPS + 10 {
            let msg = DirMsg::GiveUp {
                id: format!("o{k}").into(),
                node: 2,
                coordinator: 7,
            };
            s.handle(2, msg, &mut Vec::new());
        }
        assert_eq!(s.give_ups.len(), GIVE_UPS);
        assert_eq!(s.give_up_order.len(), GIVE_UPS);
    }
}
