//! News of deaths, for clusters whose links are made on demand: each node watches only its
//! ring neighbours (`Membership::watch_ring`; their links carry the heartbeats), so a node
//! that holds no link to a dead peer hears of the death from the peer's watchers. A watcher
//! that sees a neighbour die tells every other node over a tree cut out of the ring of ids
//! (recursive halving): it sends the news to the node halfway round the range it covers,
//! which covers the upper half, keeps the lower half, and so on. Each node hears the news
//! once per watcher, after at most ⌈log2 n⌉ hops, and sends at most that many messages; a
//! node in the tree that is dead or cannot be reached has its range covered by its sender.

use super::Inner;
use crate::protocol::{MemberMsg, Msg, Reply};
use crate::rpc::Work;
use phalanx_transport::NodeId;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{debug, warn};

/// How long a node told of a death waits for the peer's answer when it still has a link to
/// it (the peer may have restarted, or be wrongly suspected).
pub(crate) const PROBE_TIMEOUT: Duration = Duration::from_millis(200);

/// The ids strictly between `lo` and `hi` going up the ring of `n` ids (all others than `lo`
/// when `lo == hi`).
fn gap(lo: NodeId, hi: NodeId, n: u32) -> u32 {
    if lo == hi {
        n.saturating_sub(1)
    } else {
        (hi + n - lo - 1) % n
    }
}

impl Inner {
    /// Whether this node spreads deaths (it watches a ring).
    fn gossips(&self) -> bool {
        !self.members.ring().is_empty()
    }

    /// This node saw `peer` die (a transport event; `watched`: `peer` was one of its ring
    /// neighbours): every node is told, and the ring's new neighbours are linked.
    pub(super) fn after_local_death(self: &Arc<Self>, peer: NodeId, watched: bool) {
        if watched {
            self.spread_down(peer, self.id);
        }
        self.link_ring();
    }

    /// Links this node's ring neighbours that it has no link to (on a worker: a dial may
    /// wait).
    pub(super) fn link_ring(self: &Arc<Self>) {
        let unlinked: Vec<NodeId> = self
            .members
            .ring()
            .into_iter()
            .filter(|&p| !self.transport.is_connected(p))
            .collect();
        if unlinked.is_empty() {
            return;
        }
        let rpc = self.rpc.clone();
        let id = self.id;
        let job = move || {
            for p in unlinked {
                if let Err(e) = rpc.send(p, MemberMsg::Watch) {
                    debug!(node = id, peer = p, "ring neighbour not linked: {e}");
                }
            }
        };
        if let Err(e) = self.workers.spawn(job) {
            warn!(
                node = self.id,
                "cannot start a worker to link the ring: {e}"
            );
        }
    }

    /// Passes the death of `dead` on to the ids after this node up to `until` (excluded),
    /// on a worker (a send may dial).
    fn spread_down(self: &Arc<Self>, dead: NodeId, until: NodeId) {
        let me = self.clone();
        let job = move || me.cover(dead, me.id, until);
        if let Err(e) = self.workers.spawn(job) {
            warn!(
                node = self.id,
                dead, "cannot start a worker to spread a death: {e}"
            );
        }
    }

    /// Tells the ids strictly between `from` and `until` that `dead` died.
    fn cover(&self, dead: NodeId, from: NodeId, until: NodeId) {
        let n = self.members.nodes();
        let mut hi = until;
        loop {
            let len = gap(from, hi, n);
            if len == 0 || self.rpc.is_closed() {
                return;
            }
            let mid = (from + 1 + len / 2) % n;
            let skip = mid == dead || mid == self.id || self.members.is_down(mid);
            let msg = MemberMsg::Down {
                node: dead,
                until: hi,
            };
            if skip || self.rpc.send(mid, msg).is_err() {
                self.cover(dead, mid, hi);
            }
            hi = mid;
        }
    }

    /// `from` says `dead` died; this node passes it on to `until`, then believes it (after
    /// asking `dead` itself if it still has a link to it).
    pub(super) fn on_member_msg(self: &Arc<Self>, from: NodeId, msg: MemberMsg) {
        match msg {
            MemberMsg::Watch => {}
            MemberMsg::Ping { rid } => {
                let reply = Msg::Reply {
                    rid,
                    reply: Reply::Ack,
                };
                self.rpc.enqueue(Work::Send(from, reply));
            }
            MemberMsg::Down { node, until } => {
                let n = self.members.nodes();
                if node >= n || until >= n {
                    warn!(node = self.id, from, "malformed death notice ignored");
                    return;
                }
                self.spread_down(node, until);
                if node == self.id {
                    warn!(node = self.id, from, "reported dead while alive");
                    return;
                }
                if self.members.is_down(node) {
                    return;
                }
                let me = self.clone();
                let job = move || {
                    if me.transport.is_connected(node) && me.answers(node) {
                        debug!(
                            node = me.id,
                            peer = node,
                            from,
                            "reported dead, but answers"
                        );
                        return;
                    }
                    let reason = format!("reported dead by node {from}");
                    me.believe_dead(node, &reason);
                };
                if let Err(e) = self.workers.spawn(job) {
                    warn!(
                        node = self.id,
                        "cannot start a worker for a death notice: {e}"
                    );
                }
            }
        }
    }

    /// Whether `peer` answers a ping within [`PROBE_TIMEOUT`].
    fn answers(&self, peer: NodeId) -> bool {
        let deadline = Instant::now() + PROBE_TIMEOUT;
        let ping = |rid| Msg::Member(MemberMsg::Ping { rid });
        matches!(
            self.rpc
                .call_or_cancel_until(peer, ping, |_| None, deadline),
            Ok(Reply::Ack)
        )
    }

    /// Handles the death of `peer` learnt from others as if its link had failed here.
    fn believe_dead(self: &Arc<Self>, peer: NodeId, reason: &str) {
        if !self.members.mark_down(peer) {
            return;
        }
        self.on_peer_down(peer, reason);
        let dir = self.dir.clone();
        let job = move || dir.republish_after_death(peer);
        self.rpc.enqueue(Work::Run(Box::new(job)));
        if self.gossips() {
            self.link_ring();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::gap;

    #[test]
    fn gaps_count_the_ids_strictly_between() {
        assert_eq!(gap(3, 3, 8), 7, "the whole ring but the sender");
        assert_eq!(gap(3, 4, 8), 0);
        assert_eq!(gap(3, 6, 8), 2);
        assert_eq!(gap(6, 2, 8), 3, "wrapping: 7, 0, 1");
        assert_eq!(gap(0, 0, 1), 0);
    }
}
