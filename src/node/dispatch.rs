//! Where everything that reaches a node goes: transport events are handled on the transport's
//! threads when that cannot block (replies, data, directory requests answered without
//! blocking), everything else on the dispatcher thread; messages go to the subsystem of their
//! family.

use super::Inner;
use crate::hop::hop;
use crate::protocol::{Msg, Reply, StoreMsg};
use crate::rpc::Work;
use crossbeam_channel::Receiver;
use phalanx_transport::{Event, NodeId};
use std::sync::Arc;
use tracing::{debug, error, warn};

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
        for w in queue {
            match w {
                Work::Msg(from, msg) => {
                    hop!(self.id, "dispatcher has it", from = from, kind = msg.kind());
                    self.on_msg(from, msg, Thread::MayBlock)
                }
                Work::Run(job) => job(),
                Work::Send(to, msg) => {
                    if let Err(e) = self.rpc.send(to, msg) {
                        debug!(node = self.id, to, "reply not delivered: {e}");
                    }
                }
                Work::Stop => break,
            }
        }
        debug!(node = self.id, "dispatcher stopped");
    }

    /// Runs on transport threads: must not block on the network. Every message is handled
    /// here (what may block is handed to a worker by its subsystem); replies that cannot go
    /// out at once are left to the dispatcher.
    pub(super) fn on_transport_event(&self, ev: Event) {
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
                let newly = self.members.mark_down(peer);
                self.on_peer_down(peer, &reason);
                if newly {
                    let dir = self.dir.clone();
                    let job = move || dir.republish_after_death(peer);
                    self.rpc.enqueue(Work::Run(Box::new(job)));
                }
            }
            Event::PeerUp { peer } => {
                if self.members.mark_up(peer) {
                    let dir = self.dir.clone();
                    let job = move || dir.republish_after_rejoin(peer);
                    self.rpc.enqueue(Work::Run(Box::new(job)));
                }
            }
        }
    }

    /// A message this node sent itself, handled on the sender's thread (which may block).
    pub(super) fn on_loopback(&self, msg: Msg) {
        self.on_msg(self.id, msg, Thread::MayBlock);
    }

    /// Runs on the transport thread that reports the death: touches only local state; what
    /// must be sent goes through the dispatcher.
    fn on_peer_down(&self, peer: NodeId, reason: &str) {
        if reason == phalanx_transport::PEER_LEFT {
            debug!(node = self.id, peer, "peer left");
        } else {
            warn!(node = self.id, peer, "peer down: {reason}");
        }
        let mut out = Vec::new();
        self.shard.lock().unwrap().node_down(peer, &mut out);
        for (to, m) in out {
            self.rpc.enqueue(Work::Send(to, m));
        }
        self.members.notify_down(peer);
        self.rpc.fail_peer(peer);
        self.transfers.on_peer_down(peer, reason);
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
    fn on_msg(&self, from: NodeId, msg: Msg, thread: Thread) {
        match msg {
            Msg::Reply { rid, reply } => self.rpc.complete_from(from, rid, reply),
            Msg::Dir(m) => {
                let id = m.id().clone();
                let mut out = Vec::new();
                self.shard.lock().unwrap().handle(from, m, &mut out);
                for (to, m) in out {
                    // Every location answer of this message is about `id`.
                    let m = self.transfers.with_local_bytes(&id, to, m);
                    self.deliver(to, m, thread);
                }
            }
            Msg::Pull(m) => self.transfers.handle(from, m),
            Msg::Reduce(m) => self.reducer.handle(from, m),
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
