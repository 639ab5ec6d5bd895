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
                    self.on_msg(from, msg)
                }
                Work::Event(Event::PeerDown { peer, reason }) => {
                    let newly = self.members.mark_down(peer);
                    self.on_peer_down(peer, &reason);
                    if newly {
                        self.dir.republish_after_death(peer);
                    }
                }
                Work::Event(Event::PeerUp { peer }) => {
                    if self.members.mark_up(peer) {
                        self.dir.republish_after_rejoin(peer);
                    }
                }
                Work::Event(_) => {}
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

    /// Runs on transport threads: must not block on the network.
    pub(super) fn on_transport_event(&self, ev: Event) {
        match ev {
            Event::Ctrl { peer, msg } => match Msg::decode(&msg).inspect(|m| {
                hop!(
                    self.id,
                    "in on the transport thread",
                    from = peer,
                    kind = m.kind()
                );
            }) {
                Ok(Msg::Reply { rid, reply }) => self.rpc.complete(rid, reply),
                // The directory answers on the transport thread when the reply can go out
                // without blocking: one thread hand-off less per lookup.
                Ok(Msg::Dir(m)) => {
                    let mut out = Vec::new();
                    self.shard.lock().unwrap().handle(peer, m, &mut out);
                    for (to, reply) in out {
                        self.rpc.send_from_transport_thread(to, reply);
                    }
                }
                Ok(m) => self.rpc.enqueue(Work::Msg(peer, m)),
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
            ev => self.rpc.enqueue(Work::Event(ev)),
        }
    }

    fn on_peer_down(&self, peer: NodeId, reason: &str) {
        if reason == phalanx_transport::PEER_LEFT {
            debug!(node = self.id, peer, "peer left");
        } else {
            warn!(node = self.id, peer, "peer down: {reason}");
        }
        let mut out = Vec::new();
        self.shard.lock().unwrap().node_down(peer, &mut out);
        self.send_all(out);
        self.members.notify_down(peer);
        self.rpc.fail_peer(peer);
        self.transfers.on_peer_down(peer, reason);
    }

    fn send_all(&self, out: Vec<(NodeId, Msg)>) {
        for (to, m) in out {
            if let Err(e) = self.rpc.send(to, m) {
                debug!(node = self.id, to, "directory reply not delivered: {e}");
            }
        }
    }

    /// A message on the dispatcher thread, to the subsystem of its family.
    fn on_msg(&self, from: NodeId, msg: Msg) {
        match msg {
            Msg::Reply { rid, reply } => self.rpc.complete(rid, reply),
            Msg::Dir(m) => {
                let mut out = Vec::new();
                self.shard.lock().unwrap().handle(from, m, &mut out);
                self.send_all(out);
            }
            Msg::Pull(m) => self.transfers.handle(from, m),
            Msg::Reduce(m) => self.reducer.handle(from, m),
            Msg::Store(StoreMsg::Evict { rid, id }) => {
                self.store.delete(&id);
                let reply = Reply::Ack;
                let _ = self.rpc.send(from, Msg::Reply { rid, reply });
            }
        }
    }
}
