//! The directory as the rest of the node uses it: every request goes to the shard that owns
//! the entry now (placement follows membership), and a dead shard is waited out or tolerated
//! where the operation allows it.

use super::held::{Held, Standing};
use super::promises::{Promises, Sent};
use super::NO_REPLY;
use crate::config::INLINE_LIMIT;
use crate::hop::hop;
use crate::membership::Membership;
use crate::protocol::{DirMsg, Located, Msg, ObjectInfo, Reply, Rid, StoreMsg};
use crate::rpc::{unexpected_reply, FollowUp, Rpc, Work};
use crate::store::{CopyStatus, Store};
use crate::{Error, ObjectId, Result};
use crossbeam_channel::Sender;
use phalanx_transport::NodeId;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::warn;

/// A locate for a partial copy that needs a new source.
#[derive(Debug, Clone, Copy)]
pub struct Resume {
    /// The epoch of the copy's bytes (`Located::Source::epoch`), if known (a pull started on
    /// a claim does not know it).
    pub epoch: Option<u64>,
}

pub(crate) struct DirClient {
    id: NodeId,
    rpc: Arc<Rpc>,
    members: Arc<Membership>,
    store: Arc<Store>,
    /// This node's promises to produce objects, sent once due.
    promises: Promises,
    /// This node's complete copies of objects whose entries it owns, told to the entries'
    /// next owners once due.
    held: Held,
    /// `Membership::changes` when the tick last placed the promises and held copies (their
    /// destinations are recomputed only when it moved).
    placed_under: AtomicU64,
    /// When the dispatcher wakes next: a promise or copy due sooner wakes it (`nudge`).
    dispatcher_wakes: Mutex<Instant>,
}

impl DirClient {
    pub fn new(rpc: Arc<Rpc>, members: Arc<Membership>, store: Arc<Store>) -> DirClient {
        DirClient {
            id: rpc.id(),
            rpc,
            members,
            store,
            promises: Promises::default(),
            held: Held::default(),
            placed_under: AtomicU64::new(u64::MAX),
            dispatcher_wakes: Mutex::new(Instant::now()),
        }
    }

    /// The node holding the directory entry of `id` now.
    pub fn shard_of(&self, id: &ObjectId) -> NodeId {
        self.members.shard_of(id)
    }

    /// A dead shard is not fatal to a producer: the copy is here, and this node republishes
    /// it to the entry's next owner (or to the shard when it rejoins).
    pub fn tolerate_shard_down(&self, id: &ObjectId, r: Result<()>) -> Result<()> {
        match r {
            Err(Error::PeerDown(p)) => {
                warn!(node = self.id, %id, shard = p, "directory shard down; the entry is republished when ownership settles");
                Ok(())
            }
            r => r,
        }
    }

    /// Announces a local copy (partial or complete) to the object's directory shard.
    pub fn publish(&self, id: &ObjectId, size: u64, complete: bool) -> Result<()> {
        hop!(self.id, "publish", complete = complete);
        let shard = self.shard_of(id);
        self.note_held(id, shard, complete);
        let r = self.rpc.send(shard, self.publish_msg(id, size, complete));
        self.tolerate_shard_down(id, r)
    }

    /// [`DirClient::publish`], returning once the shard has it: a reader anywhere then finds
    /// the entry, also where a delete left a tombstone that would have it told "not found"
    /// until the publish lands (this node's messages to the shard arrive in order, so the
    /// answer to a query sent after it proves it landed). One round trip.
    pub fn publish_confirmed(&self, id: &ObjectId, size: u64, complete: bool) -> Result<()> {
        self.publish(id, size, complete)?;
        let r = self.query_at(self.shard_of(id), id).map(|_| ());
        self.tolerate_shard_down(id, r)
    }

    /// Announces the complete copies of `id` a halving run coordinated here made on `copies`
    /// (its ranks' nodes; this one among them when its own rank committed the run), in one
    /// message to the shard (`DirMsg::PublishRun`), from a thread that must not block. Each
    /// rank that stores its copy says [`DirClient::listed`]; one that cannot withdraws it.
    pub fn publish_run_without_blocking(&self, id: &ObjectId, size: u64, copies: Vec<NodeId>) {
        hop!(self.id, "publish run", copies = copies.len() as u64);
        let shard = self.shard_of(id);
        let msg = Msg::Dir(DirMsg::PublishRun {
            id: id.clone(),
            size,
            node: self.id,
            copies,
        });
        self.rpc.send_without_blocking(shard, msg);
    }

    /// A complete copy of `id` stored here that another node listed (a rank's copy of a
    /// halving run, listed by its coordinator): no message, but where the entry is here its
    /// next owner is told of the copy, as of one this node published.
    pub fn listed(&self, id: &ObjectId) {
        self.note_held(id, self.shard_of(id), true);
    }

    /// A complete copy of an object whose entry is here (`shard`: the entry's owner) is told
    /// to the entry's next owner once it has been here a while (`held.rs`).
    fn note_held(&self, id: &ObjectId, shard: NodeId, complete: bool) {
        if complete && shard == self.id {
            if let Some(due) = self.held.note(id, Instant::now()) {
                self.nudge(due);
            }
        }
    }

    /// A word is due at `due`: wakes the dispatcher if it sleeps past that (one message to
    /// its queue; most words are due after its planned wake and cost nothing).
    fn nudge(&self, due: Instant) {
        let mut wakes = self.dispatcher_wakes.lock().unwrap();
        if due < *wakes {
            *wakes = due;
            drop(wakes);
            self.rpc.enqueue(Work::Run(Box::new(|| {})));
        }
    }

    /// When the next deferred promise, or copy to tell an entry's next owner of, is due; the
    /// dispatcher says it sleeps until `wake` (at most that), and runs
    /// [`DirClient::promise_tick`] once the word is due.
    pub fn next_word(&self, wake: Instant) -> Instant {
        let due = [self.held.next_due(), self.promises.next_due()]
            .into_iter()
            .flatten()
            .fold(wake, Instant::min);
        *self.dispatcher_wakes.lock().unwrap() = due;
        due
    }

    fn publish_msg(&self, id: &ObjectId, size: u64, complete: bool) -> Msg {
        Msg::Dir(DirMsg::Publish {
            id: id.clone(),
            size,
            node: self.id,
            complete,
        })
    }

    /// Stores a small object's bytes in its directory entry. Returns once the message is on
    /// its way, like [`DirClient::publish`]: a put costs no round trip. Every later message
    /// of this node to the shard (a delete, a reset) is ordered after it, since messages of
    /// one node to another arrive in order and messages to ourselves are handled at once; a
    /// reader anywhere waits for the entry; a dead shard gets it again by republishing.
    pub fn put_inline(&self, id: &ObjectId, data: &[u8]) -> Result<()> {
        debug_assert!((data.len() as u64) < INLINE_LIMIT);
        hop!(self.id, "put inline", len = data.len() as u64);
        let shard = self.shard_of(id);
        self.note_held(id, shard, true);
        let r = self
            .rpc
            .send(shard, self.put_inline_msg(NO_REPLY, id, data, None));
        self.tolerate_shard_down(id, r)
    }

    /// A `PutInline` of this node's `id`.
    fn put_inline_msg(
        &self,
        rid: Rid,
        id: &ObjectId,
        data: &[u8],
        then: Option<&ObjectId>,
    ) -> DirMsg {
        DirMsg::PutInline {
            rid,
            id: id.clone(),
            node: self.id,
            data: data.to_vec(),
            then_subscribe: then.cloned(),
        }
    }

    /// [`DirClient::put_inline`] with a subscription to `then` carried in the same message,
    /// whose answer (or the put's refusal) goes to `on_reply` (see `DirMsg::PutInline`).
    /// `InvalidArgument` unless both entries live on one shard; an error means nothing was
    /// sent (or the link to the shard failed), and the caller puts the plain way.
    pub fn put_inline_then_subscribe(
        &self,
        id: &ObjectId,
        data: &[u8],
        then: &ObjectId,
        on_reply: crate::rpc::OnReply,
    ) -> Result<()> {
        debug_assert!((data.len() as u64) < INLINE_LIMIT);
        let shard = self.shard_of(id);
        if self.shard_of(then) != shard {
            return Err(Error::InvalidArgument(format!(
                "{id} and {then} have their entries on different shards"
            )));
        }
        hop!(
            self.id,
            "put inline, then subscribe",
            len = data.len() as u64
        );
        self.note_held(id, shard, true);
        let make = |rid| Msg::Dir(self.put_inline_msg(rid, id, data, Some(then)));
        self.rpc.call_then(shard, make, on_reply)
    }

    /// Promises that this node will produce `id` (it coordinates the reduce into it): if
    /// it dies before any copy of `id` can complete, the readers of `id` are told it is lost
    /// (`Error::ObjectLost`) after the node's `lost_after`. Sent at once if `now_due`, else
    /// once the operation has run for `PROMISE_AFTER` (`promises.rs`); the caller ends it
    /// with [`DirClient::end_promise`] and the token returned (`None`: too many promises
    /// pending, this one is sent at once to the shard if that is another node, and not kept).
    pub fn promise(&self, id: &ObjectId, now_due: bool) -> Option<u64> {
        let now = Instant::now();
        let token = self.promises.make(id, now_due, now);
        if token.is_some() && !now_due {
            self.nudge(now + super::promises::PROMISE_AFTER);
        }
        // Made at once: written by this (caller's) thread before the operation starts, so
        // that a coordinator that dies right after it has still made it. Anything sent about
        // it later (a take-back, through the dispatcher's queue) comes after.
        match token {
            Some(t) if now_due => {
                let sent = self.promise_dest(id);
                if let Some(to) = sent {
                    let _ = self.rpc.send(to.to, self.promise_msg(id.clone(), to, true));
                }
                self.promises.sent(t, sent);
            }
            Some(_) => {}
            // Not kept, so never taken back: only where a complete copy ends it.
            None => {
                if let Some(to) = self.promise_dest(id).filter(|d| !d.backup) {
                    let _ = self.rpc.send(to.to, self.promise_msg(id.clone(), to, true));
                }
            }
        }
        token
    }

    /// Where a promise of `id` belongs now: the entry's owner; or, if that is this node (the
    /// promise would die with it), the entry's next owner, which keeps it aside
    /// (`DirMsg::Backup`). `None`: nobody to tell.
    fn promise_dest(&self, id: &ObjectId) -> Option<Sent> {
        let shard = self.shard_of(id);
        if shard != self.id {
            return Some(Sent {
                to: shard,
                backup: false,
            });
        }
        let next = self.members.next_shard_of(id)?;
        Some(Sent {
            to: next,
            backup: true,
        })
    }

    /// The message that makes (`kept`) or takes back a promise of `id` at `to`.
    fn promise_msg(&self, id: ObjectId, to: Sent, kept: bool) -> Msg {
        let node = self.id;
        Msg::Dir(match to.backup {
            false => DirMsg::Promise {
                id,
                node,
                promised: kept,
            },
            true => DirMsg::Backup {
                id,
                node,
                copy: false,
                kept,
            },
        })
    }

    /// The operation of promise `token` ended (`ok`: it made its object); a promise sent
    /// for an operation that failed is taken back where it went, and one kept by the
    /// entry's next owner is taken back either way. An operation that failed before its
    /// promise went out makes it and takes it back at the entry's owner (this node's own
    /// shard too): readers waiting there are told the object is lost after the grace, as
    /// for a promise that went out, rather than wait out their op timeout.
    pub fn end_promise(&self, token: Option<u64>, ok: bool) {
        let Some((id, sent)) = token.and_then(|t| self.promises.end(t)) else {
            return;
        };
        if let Some(sent) = sent.filter(|s| !ok || s.backup) {
            self.send_queued(sent.to, self.promise_msg(id.clone(), sent, false));
        }
        // Failed, and no promise at the entry's owner to take back (none went out, or it
        // went to the entry's next owner, this node owning the entry): made and taken back
        // there, so that the readers waiting there hear of the failure.
        if !ok && sent.is_none_or(|s| s.backup) {
            let owner = Sent {
                to: self.shard_of(&id),
                backup: false,
            };
            self.send_queued(owner.to, self.promise_msg(id.clone(), owner, true));
            self.send_queued(owner.to, self.promise_msg(id, owner, false));
        }
    }

    /// Tells the shard of `id` that this node will not produce it after all: it was a rank
    /// of a run into `id` whose `coordinator` died (`DirMsg::GiveUp`). With no other
    /// producer and no complete copy, `id` is lost after the grace.
    pub fn give_up(&self, id: &ObjectId, coordinator: NodeId) {
        let msg = Msg::Dir(DirMsg::GiveUp {
            id: id.clone(),
            node: self.id,
            coordinator,
        });
        self.rpc.enqueue(Work::Send(self.shard_of(id), msg));
    }

    /// From the dispatcher's tick: sends the promises now due, and moves the ones standing
    /// whose place membership changed (taken back where they went, unless that node is
    /// down, and made where they belong now); tells the entries' next owners of the copies
    /// held long enough, and takes back, or moves, what was told (`held.rs`).
    /// `only_here(id)`: this node's shard lists no other complete copy of `id`.
    pub fn promise_tick(&self, only_here: impl Fn(&ObjectId) -> bool) {
        // Placement is recomputed only when membership changed since the last tick: a word
        // sent under the same membership still belongs where it went.
        let changes = self.members.changes();
        let placed = self.placed_under.swap(changes, Ordering::AcqRel) == changes;
        for (token, id) in self.promises.due(Instant::now()) {
            let sent = self.promise_dest(&id);
            if let Some(to) = sent {
                self.send_queued(to.to, self.promise_msg(id.clone(), to, true));
            }
            self.recorded(token, id, sent);
        }
        for (token, id, was, resend) in self.promises.standing() {
            if placed && !resend {
                continue;
            }
            let now = self.promise_dest(&id);
            if now == Some(was) {
                if resend {
                    self.send_queued(was.to, self.promise_msg(id.clone(), was, true));
                    self.recorded(token, id, now);
                }
                continue;
            }
            self.send_queued(was.to, self.promise_msg(id.clone(), was, false));
            if let Some(to) = now {
                self.send_queued(to.to, self.promise_msg(id.clone(), to, true));
            }
            self.recorded(token, id, now);
        }
        let look = |id: &ObjectId, told: Option<NodeId>| {
            let known = told.filter(|_| placed);
            let here = (known.is_some() || self.shard_of(id) == self.id)
                && self
                    .store
                    .info(id)
                    .is_some_and(|i| i.status == CopyStatus::Complete);
            match (here, here && only_here(id)) {
                (false, _) => Standing::Gone,
                (true, false) => Standing::Shared,
                (true, true) => Standing::Only(known.or_else(|| self.members.next_shard_of(id))),
            }
        };
        for (id, to, kept) in self.held.tick(Instant::now(), look) {
            let (node, copy) = (self.id, true);
            let msg = Msg::Dir(DirMsg::Backup {
                id,
                node,
                copy,
                kept,
            });
            self.send_queued(to, msg);
        }
    }

    /// Records where promise `token` of `id` went; if its operation ended meanwhile (its
    /// caller found nothing to take back), takes it back there at once, after it.
    fn recorded(&self, token: u64, id: ObjectId, sent: Option<Sent>) {
        if !self.promises.sent(token, sent) {
            if let Some(to) = sent {
                self.send_queued(to.to, self.promise_msg(id, to, false));
            }
        }
    }

    /// Sends through the dispatcher's queue (so that what this node says about one object
    /// reaches a node in the order it was said), except to a node believed down.
    fn send_queued(&self, to: NodeId, msg: Msg) {
        if to == self.id || !self.members.is_down(to) {
            self.rpc.enqueue(Work::Send(to, msg));
        }
    }

    /// Tells the directory that these copies are gone (evicted, or a pull given up).
    pub fn withdraw(&self, ids: &[ObjectId]) {
        for id in ids {
            self.withdraw_at(self.shard_of(id), id);
        }
    }

    /// [`DirClient::withdraw`] of one copy from a thread that must not block.
    pub fn withdraw_without_blocking(&self, id: &ObjectId) {
        let msg = self.withdraw_msg(id);
        self.rpc.send_without_blocking(self.shard_of(id), msg);
    }

    /// [`DirClient::withdraw`] at a shard the caller already knows.
    pub fn withdraw_at(&self, shard: NodeId, id: &ObjectId) {
        let _ = self.rpc.send(shard, self.withdraw_msg(id));
    }

    fn withdraw_msg(&self, id: &ObjectId) -> Msg {
        Msg::Dir(DirMsg::Withdraw {
            id: id.clone(),
            node: self.id,
        })
    }

    /// Asks for a source of `id`, waiting until there is one or until `deadline`; a shard that
    /// dies meanwhile is asked again at the entry's next owner (the holders republish there).
    /// With `resume`, for the caller's own partial copy (which may be answered
    /// `Located::Reset`).
    pub fn locate_until(
        &self,
        id: &ObjectId,
        resume: Option<Resume>,
        exclude: &[NodeId],
        deadline: Instant,
    ) -> Result<Located> {
        loop {
            // Recomputed each time: a dead shard's entries move to another node.
            let shard = self.shard_of(id);
            let locate = |rid| {
                Msg::Dir(DirMsg::Locate {
                    rid,
                    id: id.clone(),
                    wait: true,
                    resume: resume.is_some(),
                    exclude: exclude.to_vec(),
                    epoch: resume.and_then(|r| r.epoch),
                })
            };
            // A locate given up leaves no waiter behind at the shard, nor a source held for it.
            let cancel = |rid| {
                Some(Msg::Dir(DirMsg::CancelLocate {
                    id: id.clone(),
                    rid,
                }))
            };
            let r = self.rpc.call_or_cancel_then_tell(
                shard,
                locate,
                cancel,
                deadline,
                Some(self.report_bytes_with_location(id)),
            );
            match r {
                Ok(Reply::Located(l)) => return Ok(l),
                Ok(r) => return Err(self.rpc.unexpected(r)),
                // The shard died under us: its entries reappear at the next owner once the
                // holders republish them.
                Err(Error::PeerDown(_)) if Instant::now() < deadline && !self.rpc.is_closed() => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                // Says which object: a timeout alone names only the shard and the request.
                Err(Error::Timeout(d, what)) => {
                    return Err(Error::Timeout(d, format!("{what} (locating {id})")))
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Tells the shard that this node pulls `id` from `source` under `token` without having
    /// asked (see `DirMsg::Claim`).
    pub fn claim(&self, id: &ObjectId, source: NodeId, token: u64) {
        let _ = self.rpc.send(
            self.shard_of(id),
            DirMsg::Claim {
                id: id.clone(),
                source,
                receiver: self.id,
                token,
            },
        );
    }

    /// Releases the source of an assignment (and, if `ok`, marks our copy complete).
    pub fn transfer_done(&self, shard: NodeId, id: &ObjectId, src: NodeId, token: u64, ok: bool) {
        self.note_held(id, shard, ok);
        let _ = self
            .rpc
            .send(shard, self.transfer_done_msg(id, src, token, ok));
    }

    /// The `TransferDone` of bytes that came with their location (`Located::SourceData`),
    /// sent where the answer lands as soon as the caller has it: the bytes are here, and the
    /// source is free for its next receiver one message after they crossed the link, as after
    /// a pull (which is what makes receivers form a tree). It is not on the caller's path: it
    /// goes out while the caller stores the bytes. A caller that cannot keep them withdraws
    /// its copy after that (`Transfers::abandon_pull`): the report never outlives the copy.
    fn report_bytes_with_location(&self, id: &ObjectId) -> FollowUp {
        let (id, me) = (id.clone(), self.id);
        Box::new(move |r: &Reply| match r {
            Reply::Located(Located::SourceData { node, token, .. }) => {
                Some(Msg::Dir(DirMsg::TransferDone {
                    id,
                    source: *node,
                    receiver: me,
                    token: *token,
                    ok: true,
                }))
            }
            _ => None,
        })
    }

    /// Bytes came with their location and are kept: a complete copy, noted as a pull's is
    /// (the report went out where the answer landed: `report_bytes_with_location`).
    pub fn took_bytes_with_location(&self, shard: NodeId, id: &ObjectId) {
        self.note_held(id, shard, true);
    }

    /// [`DirClient::transfer_done`] from a thread that must not block (where a pull's last
    /// bytes landed); it keeps its place before this node's later messages to the shard.
    pub fn transfer_done_without_blocking(
        &self,
        shard: NodeId,
        id: &ObjectId,
        src: NodeId,
        token: u64,
        ok: bool,
    ) {
        self.note_held(id, shard, ok);
        let msg = self.transfer_done_msg(id, src, token, ok);
        self.rpc.send_without_blocking(shard, msg);
    }

    fn transfer_done_msg(&self, id: &ObjectId, src: NodeId, token: u64, ok: bool) -> Msg {
        Msg::Dir(DirMsg::TransferDone {
            id: id.clone(),
            source: src,
            receiver: self.id,
            token,
            ok,
        })
    }

    /// Synchronous query at `shard`: the entry as it stands now.
    pub fn query_at(&self, shard: NodeId, id: &ObjectId) -> Result<Option<ObjectInfo>> {
        self.query_until(shard, id, Instant::now() + self.rpc.op_timeout())
    }

    /// [`DirClient::query_at`] given up at `deadline`.
    pub fn query_until(
        &self,
        shard: NodeId,
        id: &ObjectId,
        deadline: Instant,
    ) -> Result<Option<ObjectInfo>> {
        let query = |rid| {
            Msg::Dir(DirMsg::Query {
                rid,
                id: id.clone(),
            })
        };
        match self
            .rpc
            .call_or_cancel_until(shard, query, |_| None, deadline)?
        {
            Reply::Info(i) => Ok(i),
            r => Err(self.rpc.unexpected(r)),
        }
    }

    /// Asynchronous location query: `on_reply` hears the entry once `id` has a location
    /// (`Info(None)`: deleted first), where the answer lands (a transport thread, or this
    /// thread when the shard is here and the object has a location already).
    pub fn subscribe_then(&self, id: &ObjectId, on_reply: crate::rpc::OnReply) -> Result<()> {
        self.rpc
            .call_then(self.shard_of(id), |rid| subscribe_msg(rid, id), on_reply)
    }

    /// Like [`DirClient::subscribe_then`], the entry (`None`: deleted first) or the error delivered
    /// into `out`, with no thread waiting for it.
    pub fn subscribe_into(
        &self,
        id: &ObjectId,
        out: Sender<Result<Option<ObjectInfo>>>,
    ) -> Result<()> {
        let me = self.id;
        let shard = self.shard_of(id);
        let on_reply = Box::new(move |r: Result<Reply>| {
            let r = match r {
                Ok(Reply::Info(i)) => Ok(i),
                Ok(Reply::InfoInline(i, _)) => Ok(Some(i)),
                // Refused (this node has too many requests waiting there).
                Ok(Reply::Error(what)) => Err(Error::Protocol { peer: shard, what }),
                Ok(r) => Err(unexpected_reply(me, r)),
                Err(e) => Err(e),
            };
            let _ = out.try_send(r);
        });
        self.subscribe_then(id, on_reply)
    }

    /// Removes every copy of `id` and its entry.
    pub fn delete(&self, id: &ObjectId) -> Result<()> {
        self.remove_copies(id, false)
    }

    /// Drops every copy of `id` but keeps its readers waiting for a new one (see
    /// `DirMsg::Reset`).
    pub fn reset(&self, id: &ObjectId) -> Result<()> {
        self.remove_copies(id, true)
    }

    fn remove_copies(&self, id: &ObjectId, reset: bool) -> Result<()> {
        let nodes = match self.rpc.call(self.shard_of(id), |rid| {
            let id = id.clone();
            Msg::Dir(match reset {
                false => DirMsg::Delete { rid, id },
                true => DirMsg::Reset { rid, id },
            })
        })? {
            Reply::Deleted(n) => n,
            r => return Err(self.rpc.unexpected(r)),
        };
        self.store.delete(id);
        for n in nodes.into_iter().filter(|&n| n != self.id) {
            match self.rpc.call(n, |rid| {
                Msg::Store(StoreMsg::Evict {
                    rid,
                    id: id.clone(),
                })
            }) {
                Ok(_) | Err(Error::PeerDown(_)) | Err(Error::Transport(_)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Directory ownership changed (a peer died, or rejoined): give the new owner of every
    /// affected entry our copies again. `moved(id)` says whether the entry moved.
    pub fn republish(&self, moved: impl Fn(&ObjectId) -> bool) {
        for (id, size, complete, pinned) in self.store.summary() {
            if !moved(&id) {
                continue;
            }
            // A pull still filling (unpinned) is no producer: published partial, the new
            // owner would take it for one (a copy that completes by itself) and never find
            // the object lost when its real source dies. Its pull lists it again when it asks
            // that shard for a source; until then it serves no one.
            if !complete && !pinned {
                continue;
            }
            let small = size < INLINE_LIMIT && complete;
            let msg = match self.store.lookup(&id) {
                Some(c) if small => DirMsg::PutInline {
                    rid: NO_REPLY,
                    id: id.clone(),
                    node: self.id,
                    data: c.filled(0, size).to_vec(),
                    then_subscribe: None,
                },
                _ => DirMsg::Publish {
                    id: id.clone(),
                    size,
                    node: self.id,
                    complete,
                },
            };
            let shard = self.shard_of(&id);
            let _ = self.rpc.send(shard, msg);
            // An entry that came here: its next owner is told of this copy in turn.
            self.note_held(&id, shard, complete);
        }
        // The promises of operations still under way follow at the next tick
        // (`promise_tick`), as do the copies told to entries' next owners.
    }

    /// `peer` died: entries it owned move to the next node by HRW order.
    pub fn republish_after_death(&self, peer: NodeId) {
        self.republish(|id| self.members.owned_by_before_death(id, peer));
    }

    /// `peer` rejoined: entries it owns come back to it.
    pub fn republish_after_rejoin(&self, peer: NodeId) {
        self.republish(|id| self.shard_of(id) == peer);
        // What `peer` was told, it may have lost (restarted, or dropped with the link): told
        // again at the next tick, wherever it belongs then.
        self.promises.resend_to(peer);
        self.held.resend_to(peer);
    }
}

fn subscribe_msg(rid: u64, id: &ObjectId) -> Msg {
    Msg::Dir(DirMsg::Subscribe {
        rid,
        id: id.clone(),
    })
}
