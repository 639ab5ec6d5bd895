//! News of deaths, for clusters whose links are made on demand: each node watches only its
//! ring neighbours (`Membership::watch_ring`; their links carry the heartbeats), so a node
//! that holds no link to a dead peer hears of the death from the peer's watchers. A watcher
//! that sees a neighbour die tells every other node over a tree cut out of the ring of ids
//! (recursive halving): it sends the news to the node halfway round the range it covers,
//! which covers the upper half, keeps the lower half, and so on. Each node hears the news
//! once per watcher, after at most ⌈log2 n⌉ hops, and sends about that many messages; a
//! node in the tree that is dead or cannot be reached has its range covered by its sender
//! (which then sends more).
//!
//! Wrong news is undone as in SWIM: every node has an incarnation (`Membership`), a death is
//! announced for the incarnation its watcher knew, and a node that hears of its own death
//! (a false suspicion on a loaded host, a late wave after a restart) raises its incarnation
//! and spreads `Up` the same way, which outranks every `Down` of an older incarnation.

use super::Inner;
use crate::membership::max_incarnation;
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
    /// A restarted node tells every other that it is alive, in an incarnation above its old
    /// life's (nodes that buried it take it back, and its entries come home).
    pub(super) fn announce_alive(self: &Arc<Self>) {
        if self.members.watching() {
            let inc = self.members.incarnation_of(self.id);
            self.spread(News::Up(self.id, inc), self.id);
        }
    }

    /// Tells every node that `peer` died, as its watcher (also a test hook, through
    /// `Node::announce_death`, whatever the truth).
    pub(super) fn announce_death(self: &Arc<Self>, peer: NodeId) {
        let inc = self.members.incarnation_of(peer);
        self.spread(News::Down(peer, inc), self.id);
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

    /// Passes `news` on to the ids after this node up to `until` (excluded), on a worker (a
    /// send may dial).
    fn spread(self: &Arc<Self>, news: News, until: NodeId) {
        let me = self.clone();
        let job = move || me.cover(news, me.id, until);
        if let Err(e) = self.workers.spawn(job) {
            warn!(
                node = self.id,
                "cannot start a worker to spread {news:?}: {e}"
            );
        }
    }

    /// Tells the ids strictly between `from` and `until` the news. The subject of a death
    /// never forwards it (it may be dead, or silent): its range is covered here, and it is
    /// told last, alone, so that a live one can refute it.
    fn cover(&self, news: News, from: NodeId, until: NodeId) {
        let n = self.members.nodes();
        let mut hi = until;
        let mut subject = None;
        loop {
            let len = gap(from, hi, n);
            if len == 0 || self.rpc.is_closed() {
                break;
            }
            let mid = (from + 1 + len / 2) % n;
            let dead = matches!(news, News::Down(d, _) if d == mid);
            if dead {
                subject = Some(mid);
            }
            let skip = dead || mid == self.id || self.members.is_down(mid);
            if skip || self.rpc.send(mid, news.message(hi)).is_err() {
                self.cover(news, mid, hi);
            }
            hi = mid;
        }
        if let Some(s) = subject {
            // An empty range: nothing to pass on.
            let _ = self.rpc.send(s, news.message((s + 1) % n));
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
            MemberMsg::Up { node, inc, until } => {
                if !self.well_formed(node, inc, until) {
                    warn!(node = self.id, from, "malformed news ignored");
                    return;
                }
                self.spread(News::Up(node, inc), until);
                if node != self.id && self.members.heard_alive(node, inc) {
                    self.believe_alive(node);
                }
            }
            MemberMsg::Down { node, inc, until } => {
                if !self.well_formed(node, inc, until) {
                    warn!(node = self.id, from, "malformed death notice ignored");
                    return;
                }
                self.spread(News::Down(node, inc), until);
                if node == self.id {
                    let mine = self.members.refute(inc);
                    warn!(
                        node = self.id,
                        from,
                        inc = mine,
                        "reported dead while alive: refuted"
                    );
                    self.spread(News::Up(self.id, mine), self.id);
                    return;
                }
                if inc < self.members.incarnation_of(node) || self.members.is_down(node) {
                    return; // outranked by news of it alive, or known
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
                        // It is told, so that it refutes the news everywhere (its watcher
                        // may not reach it to tell it).
                        let n = me.members.nodes();
                        let tell = News::Down(node, inc).message((node + 1) % n);
                        let _ = me.rpc.send(node, tell);
                        return;
                    }
                    let reason = format!("reported dead by node {from}");
                    me.believe_dead(node, inc, &reason);
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

    /// Whether news from a peer is possible: ids in the cluster, an incarnation at most a day
    /// ahead, and a range that does not come back to this node (a range always ends before
    /// its receiver; `until == self` would make it pass the news to the whole ring).
    fn well_formed(&self, node: NodeId, inc: u64, until: NodeId) -> bool {
        let n = self.members.nodes();
        node < n && until < n && until != self.id && inc <= max_incarnation()
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

    /// `peer` refuted news of its death: it is up again here, as after a rejoin.
    fn believe_alive(self: &Arc<Self>, peer: NodeId) {
        if !self.members.mark_up(peer) {
            return;
        }
        debug!(node = self.id, peer, "alive again, by its own word");
        self.after_rejoin(peer);
    }

    /// Handles the death of `peer` (in incarnation `inc`) learnt from others as if its link
    /// had failed here.
    fn believe_dead(self: &Arc<Self>, peer: NodeId, inc: u64, reason: &str) {
        if !self.members.mark_down_at(peer, inc) {
            return;
        }
        self.on_peer_down(peer, reason);
        self.after_death(peer);
    }
}

/// What a node spreads over the ring: (node, incarnation).
#[derive(Debug, Clone, Copy)]
enum News {
    Down(NodeId, u64),
    Up(NodeId, u64),
}

impl News {
    /// The message that hands the news on, for the ids up to `until`.
    fn message(self, until: NodeId) -> MemberMsg {
        match self {
            News::Down(node, inc) => MemberMsg::Down { node, inc, until },
            News::Up(node, inc) => MemberMsg::Up { node, inc, until },
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
