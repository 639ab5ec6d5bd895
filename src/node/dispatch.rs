//! Where everything that reaches a node goes: transport events are handled on the transport's
//! threads when that cannot block (replies, data, directory requests answered without
//! blocking), everything else on the dispatcher thread; messages go to the subsystem of their
//! family.

use super::Inner;
use crate::hop::hop;
use crate::protocol::{DirMsg, Msg, Reply, StoreMsg};
use crate::rpc::Work;
use crossbeam_channel::{Receiver, RecvTimeoutError};
use phalanx_transport::{Event, NodeId};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{debug, error, warn};

/// How often the dispatcher looks at the pulls no thread drives and the serves with no worker.
const TICK: Duration = Duration::from_millis(50);

impl Inner {
    /// Stops the node: links closed (abruptly: no goodbye, as if the process died), the
    /// dispatcher stopped, and every waiting operation failed.
    pub(super) fn close(&self, abrupt: bool) {
        if !self.rpc.mark_closed() {
            return;
        }
        if abrupt {
            self.transport.kill();
        } else {
            self.transport.shutdown();
        }
        self.rpc.stop();
        self.transfers.close();
    }

    /// The dispatcher thread: runs until the node closes.
    pub(super) fn dispatch(self: Arc<Self>, queue: Receiver<Work>) {
        // Messages held for peers a worker is linking (links made on demand): the dispatcher
        // never waits for a dial, and a peer's messages keep their order.
        let mut held: HashMap<NodeId, VecDeque<Msg>> = HashMap::new();
        // Pulls that no thread drives, and serves with no worker, are looked at every
        // `TICK` (`Transfers::tick`: a stalled one, or one whose copy went, gets a thread).
        // The dispatcher wakes that often when idle rather than be told of each such pull.
        // It also wakes when a word to a directory shard is due (a promise, or a copy told
        // to an entry's next owner, each 10 ms after it was made; `DirClient::next_word`), so
        // that a node that dies after that has told its shard's next owner.
        let mut next_tick = Instant::now() + TICK;
        loop {
            let word = self.dir.next_word(next_tick);
            let w = match queue.recv_timeout(word.saturating_duration_since(Instant::now())) {
                Ok(w) => Some(w),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => break,
            };
            let now = Instant::now();
            if now >= word && now < next_tick {
                let me = self.id;
                self.dir
                    .promise_tick(|id| self.shard.lock().unwrap().only_copy_on(id, me));
            }
            if now >= next_tick {
                if self.transfers.has_lazy_work() {
                    self.transfers.tick();
                }
                self.reducer.halving_tick();
                self.shard_tick();
                let me = self.id;
                self.dir
                    .promise_tick(|id| self.shard.lock().unwrap().only_copy_on(id, me));
                next_tick = Instant::now() + TICK;
            }
            let Some(w) = w else { continue };
            match w {
                Work::Msg(from, msg) => {
                    hop!(self.id, "dispatcher has it", from = from, kind = msg.kind());
                    self.on_msg(from, msg, Thread::MayBlock)
                }
                Work::Run(job) => job(),
                Work::Send(to, msg) => self.send_or_hold(to, msg, &mut held),
                Work::Linked(to) => {
                    for msg in held.remove(&to).unwrap_or_default() {
                        if let Err(e) = self.rpc.send(to, msg) {
                            debug!(node = self.id, to, "reply not delivered: {e}");
                        }
                    }
                }
                Work::Stop => break,
            }
        }
        debug!(node = self.id, "dispatcher stopped");
    }

    /// Sends `msg` to `to` from the dispatcher, unless that would wait for a link to be made:
    /// then a worker makes it by sending the message, and the peer's next messages wait in
    /// `held` until it is done.
    fn send_or_hold(&self, to: NodeId, msg: Msg, held: &mut HashMap<NodeId, VecDeque<Msg>>) {
        if let Some(q) = held.get_mut(&to) {
            q.push_back(msg);
            return;
        }
        if to == self.id || !self.transport.dials_on_use() || self.transport.is_connected(to) {
            if let Err(e) = self.rpc.send(to, msg) {
                debug!(node = self.id, to, "reply not delivered: {e}");
            }
            return;
        }
        held.insert(to, VecDeque::new());
        let (rpc, id) = (self.rpc.clone(), self.id);
        let job = move || {
            if let Err(e) = rpc.send(to, msg) {
                debug!(node = id, to, "reply not delivered: {e}");
            }
            rpc.enqueue(Work::Linked(to));
        };
        if let Err(e) = self.workers.spawn(job) {
            warn!(
                node = self.id,
                to, "cannot start a worker to link a peer: {e}"
            );
            held.remove(&to);
        }
    }

    /// Runs on transport threads: must not block on the network. Every message is handled
    /// here (what may block is handed to a worker by its subsystem); replies that cannot go
    /// out at once are left to the dispatcher.
    pub(super) fn on_transport_event(self: &Arc<Self>, ev: Event) {
        match ev {
            Event::Ctrl { peer, msg } => match Msg::decode(&msg) {
                Ok(m) => {
                    hop!(
                        self.id,
                        "in on the transport thread",
                        from = peer,
                        kind = m.kind()
                    );
                    self.on_msg(peer, m, Thread::Transport);
                }
                Err(e) => error!(
                    node = self.id,
                    peer, "undecodable control message dropped: {e}"
                ),
            },
            Event::Data {
                peer,
                stream,
                offset,
                len,
            } => self.transfers.on_data(peer, stream, offset, len),
            // Handled here, in the order the transport reports them, so a restarted peer's
            // new messages never come before the news of its old incarnation's death.
            Event::PeerDown { peer, reason } => {
                let watched = self.members.watches(peer);
                let newly = self.members.mark_down(peer);
                self.on_peer_down(peer, &reason);
                if newly {
                    self.after_death(peer);
                    // Seen by one of its watchers: every node is told.
                    if watched {
                        self.announce_death(peer);
                    }
                }
            }
            Event::PeerUp { peer } => {
                if self.members.mark_up(peer) {
                    self.after_rejoin(peer);
                }
            }
        }
    }

    /// What follows `peer` newly believed dead (its link failed, or its watchers said so):
    /// its directory entries are republished at their new owners, and the ring's new
    /// neighbours linked.
    pub(super) fn after_death(self: &Arc<Self>, peer: NodeId) {
        let dir = self.dir.clone();
        let job = move || dir.republish_after_death(peer);
        self.rpc.enqueue(Work::Run(Box::new(job)));
        self.link_ring();
    }

    /// What follows `peer` newly believed alive again (it linked, or refuted its death).
    pub(super) fn after_rejoin(self: &Arc<Self>, peer: NodeId) {
        let dir = self.dir.clone();
        let job = move || dir.republish_after_rejoin(peer);
        self.rpc.enqueue(Work::Run(Box::new(job)));
        self.link_ring();
    }

    /// A message this node sent itself, handled on the sender's thread (which may block).
    pub(super) fn on_loopback(self: &Arc<Self>, msg: Msg) {
        self.on_msg(self.id, msg, Thread::MayBlock);
    }

    /// A message this node sent itself from a thread that must not block (an answer's landing
    /// thread), handled there as a transport thread handles a peer's.
    pub(super) fn on_loopback_nonblocking(self: &Arc<Self>, msg: Msg) {
        hop!(self.id, "to itself where it landed", kind = msg.kind());
        self.on_msg(self.id, msg, Thread::Transport);
    }

    /// The shard's periodic work: objects that deaths left without a copy are declared lost
    /// once `lost_after` passed (`Shard::tick`); their readers are told from here.
    fn shard_tick(&self) {
        let mut out = Vec::new();
        self.shard
            .lock()
            .unwrap()
            .tick(Instant::now(), self.cfg.lost_after, &mut out);
        for (to, m) in out {
            self.rpc.enqueue(Work::Send(to, m));
        }
    }

    /// Runs on the transport thread that reports the death: touches only local state; what
    /// must be sent goes through the dispatcher.
    pub(super) fn on_peer_down(&self, peer: NodeId, reason: &str) {
        if reason == phalanx_transport::PEER_LEFT {
            debug!(node = self.id, peer, "peer left");
        } else {
            warn!(node = self.id, peer, "peer down: {reason}");
        }
        let mut out = Vec::new();
        // `peer` is marked down already: its entries' owners are recomputed without it.
        let (me, members) = (self.id, &self.members);
        let moved_here = |id: &crate::ObjectId| {
            members.owned_by_before_death(id, peer) && members.shard_of(id) == me
        };
        self.shard
            .lock()
            .unwrap()
            .node_down(peer, Instant::now(), &moved_here, &mut out);
        for (to, m) in out {
            self.rpc.enqueue(Work::Send(to, m));
        }
        self.members.notify_down(peer);
        self.rpc.fail_peer(peer);
        self.transfers.on_peer_down(peer, reason);
        self.reducer.coordinator_down(peer);
    }

    /// Sends a message a handler produced, as the thread it runs on allows.
    fn deliver(&self, to: NodeId, msg: Msg, thread: Thread) {
        match thread {
            Thread::Transport => self.rpc.send_from_transport_thread(to, msg),
            Thread::MayBlock => {
                if let Err(e) = self.rpc.send(to, msg) {
                    debug!(node = self.id, to, "reply not delivered: {e}");
                }
            }
        }
    }

    /// A message, to the subsystem of its family.
    fn on_msg(self: &Arc<Self>, from: NodeId, msg: Msg, thread: Thread) {
        match msg {
            Msg::Reply { rid, reply } => self.rpc.complete_from(from, rid, reply),
            Msg::Dir(m) => {
                let id = m.id().clone();
                let mut out = Vec::new();
                let (had, has) = {
                    let mut shard = self.shard.lock().unwrap();
                    let had = shard.has_tombstone(&id);
                    shard.handle(from, m, &mut out);
                    (had, shard.has_tombstone(&id))
                };
                if had != has && self.members.shard_of(&id) == self.id {
                    // Deleted here (or put again since): the entry's next owner keeps the
                    // tombstone aside, for readers that come to it if this node dies.
                    if let Some(next) = self.members.next_shard_of(&id) {
                        let (node, kept) = (self.id, has);
                        let t = Msg::Dir(DirMsg::Tombstone {
                            id: id.clone(),
                            node,
                            kept,
                        });
                        self.deliver(next, t, thread);
                    }
                }
                for (to, m) in out {
                    // Every location answer of this message is about `id`.
                    let m = self.transfers.with_local_bytes(&id, to, m);
                    self.deliver(to, m, thread);
                }
            }
            Msg::Pull(m) => self.transfers.handle(from, m),
            Msg::Reduce(m) => self.reducer.handle(from, m),
            Msg::Member(m) => self.on_member_msg(from, m),
            Msg::Store(StoreMsg::Evict { rid, id }) => {
                self.store.delete(&id);
                let reply = Reply::Ack;
                self.deliver(from, Msg::Reply { rid, reply }, thread);
            }
        }
    }
}

/// What the thread handling a message may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Thread {
    /// A transport thread: never wait on the network.
    Transport,
    /// The dispatcher, or a caller sending to itself.
    MayBlock,
}
