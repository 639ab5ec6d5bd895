//! Who is alive, as this node believes, and where directory entries live: on the name's home
//! node when it has one ([`ObjectId::homed`]) and that node is alive, else by highest-random-
//! weight hashing over the live nodes, so that when a shard's node dies its entries move to
//! one deterministic other node (and move back when it rejoins).
//!
//! With links made on demand a node also *watches* its ring neighbours: the
//! [`WATCH_EACH_SIDE`] live ids after it and before it (mod the cluster size). Only those
//! links carry heartbeats; the watchers of a dead node spread the news (`node::gossip`).

use crate::ObjectId;
use crossbeam_channel::{Receiver, Sender};
use phalanx_transport::NodeId;
use std::collections::HashSet;
use std::sync::Mutex;

/// Ring neighbours a node watches on each side.
pub const WATCH_EACH_SIDE: usize = 2;

pub(crate) struct Membership {
    id: NodeId,
    nodes: u32,
    /// Peers seen down and not back yet.
    down: Mutex<HashSet<NodeId>>,
    /// The ring neighbours this node watches, kept up to date with `down`; None: no ring
    /// (every link watched by the transport).
    ring: Mutex<Option<Vec<NodeId>>>,
    /// Incarnations (see `node::gossip`).
    incarnations: Mutex<Incarnations>,
    /// Watchers (reduce coordinators) told of every peer that goes down.
    watchers: Mutex<Vec<Sender<NodeId>>>,
    /// How many times `down` changed.
    changes: std::sync::atomic::AtomicU64,
}

impl Membership {
    /// `down` lists the peers not reachable at start (a rejoining node treats them as down
    /// until they link up).
    pub fn new(id: NodeId, nodes: u32, down: impl IntoIterator<Item = NodeId>) -> Membership {
        Membership {
            id,
            nodes,
            down: Mutex::new(down.into_iter().collect()),
            ring: Mutex::new(None),
            incarnations: Mutex::new(Incarnations {
                mine: start_incarnation(),
                ..Default::default()
            }),
            watchers: Mutex::new(Vec::new()),
            changes: Default::default(),
        }
    }

    /// How many times the set of nodes believed down changed: equal counts, equal directory
    /// placement.
    pub fn changes(&self) -> u64 {
        self.changes.load(std::sync::atomic::Ordering::Acquire)
    }

    /// From now on this node watches its ring neighbours (see the module).
    pub fn watch_ring(&self) {
        let down = self.down.lock().unwrap();
        *self.ring.lock().unwrap() = Some(ring_of(self.id, self.nodes, &down));
    }

    /// Whether this node watches a ring (see [`Membership::watch_ring`]).
    pub fn watching(&self) -> bool {
        self.ring.lock().unwrap().is_some()
    }

    /// The ring neighbours this node watches (empty without a ring).
    pub fn ring(&self) -> Vec<NodeId> {
        self.ring.lock().unwrap().clone().unwrap_or_default()
    }

    /// Whether this node watches `peer` (one of its ring neighbours).
    pub fn watches(&self, peer: NodeId) -> bool {
        self.ring
            .lock()
            .unwrap()
            .as_ref()
            .is_some_and(|r| r.contains(&peer))
    }

    /// The highest incarnation of `peer` heard of (0: none).
    pub fn incarnation_of(&self, peer: NodeId) -> u64 {
        let i = self.incarnations.lock().unwrap();
        if peer == self.id {
            return i.mine;
        }
        i.alive.get(&peer).copied().unwrap_or(0)
    }

    /// Records that `peer` lives at incarnation `inc`; true if that outranks all news of it
    /// heard so far: a later incarnation than any heard alive, and than the one it was
    /// believed dead at (news of a death beats news of life of the same incarnation).
    pub fn heard_alive(&self, peer: NodeId, inc: u64) -> bool {
        let mut i = self.incarnations.lock().unwrap();
        let dead = i.dead.get(&peer).copied();
        let known = i.alive.entry(peer).or_insert(0);
        if inc > *known && dead.is_none_or(|d| inc > d) {
            *known = inc;
            return true;
        }
        false
    }

    /// This node was said to be dead at incarnation `inc`: its incarnation rises above it,
    /// and the new one is returned (for the refutation).
    pub fn refute(&self, inc: u64) -> u64 {
        let mut i = self.incarnations.lock().unwrap();
        i.mine = i.mine.max(inc.saturating_add(1));
        i.mine
    }

    /// Whether `peer` is believed down.
    pub fn is_down(&self, peer: NodeId) -> bool {
        self.down.lock().unwrap().contains(&peer)
    }

    /// The peers believed down now, in one look.
    pub fn down_now(&self) -> HashSet<NodeId> {
        self.down.lock().unwrap().clone()
    }

    /// Recomputes the ring after `down` changed.
    fn update_ring(&self, down: &HashSet<NodeId>) {
        let mut ring = self.ring.lock().unwrap();
        if ring.is_some() {
            *ring = Some(ring_of(self.id, self.nodes, down));
        }
    }

    pub fn nodes(&self) -> u32 {
        self.nodes
    }

    /// The node holding the directory entry of `id` among the nodes believed alive.
    pub fn shard_of(&self, id: &ObjectId) -> NodeId {
        let down = self.down.lock().unwrap();
        entry_owner(id, self.nodes, |n| n == self.id || !down.contains(&n))
    }

    /// The node that would own the entry of `id` if this node died (`None`: no other node is
    /// up).
    pub fn next_shard_of(&self, id: &ObjectId) -> Option<NodeId> {
        let down = self.down.lock().unwrap();
        let alive = |n: NodeId| n != self.id && !down.contains(&n);
        let n = entry_owner(id, self.nodes, alive);
        alive(n).then_some(n)
    }

    /// The node holding the entry of `id` while every node is alive.
    pub fn home_shard(&self, id: &ObjectId) -> NodeId {
        entry_owner(id, self.nodes, |_| true)
    }

    /// Records `peer` as down on news of its death in incarnation `inc`, unless news of it
    /// alive in a later one came first; true if it was up until now.
    pub fn mark_down_at(&self, peer: NodeId, inc: u64) -> bool {
        let mut i = self.incarnations.lock().unwrap();
        self.down_at(&mut i, peer, inc)
    }

    /// Records `peer` as down (in the incarnation last heard of); true if it was up until
    /// now.
    pub fn mark_down(&self, peer: NodeId) -> bool {
        let mut i = self.incarnations.lock().unwrap();
        let known = i.alive.get(&peer).copied().unwrap_or(0);
        self.down_at(&mut i, peer, known)
    }

    /// Records `peer` as down in incarnation `inc` unless it was heard alive in a later one,
    /// under the incarnations' lock `i` (an `Up` cannot slip in between).
    fn down_at(&self, i: &mut Incarnations, peer: NodeId, inc: u64) -> bool {
        if inc < i.alive.get(&peer).copied().unwrap_or(0) {
            return false;
        }
        let d = i.dead.entry(peer).or_insert(0);
        *d = (*d).max(inc);
        let mut down = self.down.lock().unwrap();
        let newly = down.insert(peer);
        if newly {
            self.changes
                .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            self.update_ring(&down);
        }
        newly
    }

    /// Tells the watchers that `peer` went down.
    pub fn notify_down(&self, peer: NodeId) {
        self.watchers
            .lock()
            .unwrap()
            .retain(|w| w.send(peer).is_ok());
    }

    /// Records `peer` as up again; true if it was down.
    pub fn mark_up(&self, peer: NodeId) -> bool {
        let mut down = self.down.lock().unwrap();
        let was = down.remove(&peer);
        if was {
            self.changes
                .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            self.update_ring(&down);
        }
        was
    }

    /// Whether the entry of `id` belonged to `peer` just before `peer` died, given the nodes
    /// believed down now.
    pub fn owned_by_before_death(&self, id: &ObjectId, peer: NodeId) -> bool {
        let down = self.down.lock().unwrap();
        entry_owner(id, self.nodes, |n| {
            n == self.id || n == peer || !down.contains(&n)
        }) == peer
    }

    /// A channel that receives the id of every peer that goes down from now on.
    pub fn watch_peer_down(&self) -> Receiver<NodeId> {
        let (tx, rx) = crossbeam_channel::unbounded();
        self.watchers.lock().unwrap().push(tx);
        rx
    }
}

/// What a node knows of incarnations: its own (the wall clock in ms at start, raised each
/// time it refutes news of its death), the highest heard alive of each peer, and the one
/// each peer was last believed dead at.
#[derive(Default)]
struct Incarnations {
    mine: u64,
    alive: std::collections::HashMap<NodeId, u64>,
    dead: std::collections::HashMap<NodeId, u64>,
}

/// The latest incarnation news may name: a day past this node's clock (a node's
/// incarnation is its start time in ms, raised by one per refutation).
pub fn max_incarnation() -> u64 {
    start_incarnation().saturating_add(24 * 3600 * 1000)
}

/// A node's first incarnation: the wall clock in ms, so a restarted node's is higher than
/// any its previous life reached by refuting (at most a few per second).
fn start_incarnation() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_millis() as u64)
}

/// The [`WATCH_EACH_SIDE`] live ids after `id` and before it on the ring of `nodes` ids
/// (fewer in a small cluster; never `id`).
fn ring_of(id: NodeId, nodes: u32, down: &HashSet<NodeId>) -> Vec<NodeId> {
    let live = |p: &NodeId| *p != id && !down.contains(p);
    let after = (1..nodes).map(|k| (id + k) % nodes).filter(live);
    let before = (1..nodes).map(|k| (id + nodes - k) % nodes).filter(live);
    let mut ring: Vec<NodeId> = after.take(WATCH_EACH_SIDE).collect();
    for p in before.take(WATCH_EACH_SIDE) {
        if !ring.contains(&p) {
            ring.push(p);
        }
    }
    ring
}

/// The node holding the entry of `id` among the nodes for which `alive` holds: the name's
/// home if it is one of them, else the highest-random-weight owner.
fn entry_owner(id: &ObjectId, nodes: u32, alive: impl Fn(NodeId) -> bool) -> NodeId {
    match id.home() {
        Some(h) if h < nodes && alive(h) => h,
        _ => hrw_owner(id, nodes, alive),
    }
}

/// Highest-random-weight owner of `id` among the nodes for which `alive` holds.
fn hrw_owner(id: &ObjectId, nodes: u32, alive: impl Fn(NodeId) -> bool) -> NodeId {
    let h = id.stable_hash();
    let weight = |n: NodeId| {
        let x = (h ^ (n as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^ (x >> 29)
    };
    (0..nodes)
        .filter(|&n| alive(n))
        .max_by_key(|&n| weight(n))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_owner_moves_its_entries_to_one_node_and_back() {
        let m = Membership::new(0, 5, []);
        let ids: Vec<ObjectId> = (0..200).map(|i| ObjectId::new(format!("o{i}"))).collect();
        let before: Vec<NodeId> = ids.iter().map(|i| m.shard_of(i)).collect();
        assert!(before.iter().all(|&n| n < 5));
        let watch = m.watch_peer_down();
        assert!(m.mark_down(3));
        assert!(!m.mark_down(3), "already down");
        m.notify_down(3);
        assert_eq!(watch.try_recv(), Ok(3));
        for (id, &b) in ids.iter().zip(&before) {
            let now = m.shard_of(id);
            if b == 3 {
                assert_ne!(now, 3);
                assert!(m.owned_by_before_death(id, 3));
            } else {
                assert_eq!(now, b, "entries of live nodes stay");
                assert!(!m.owned_by_before_death(id, 3));
            }
            assert_eq!(m.home_shard(id), b);
        }
        assert!(m.mark_up(3));
        let after: Vec<NodeId> = ids.iter().map(|i| m.shard_of(i)).collect();
        assert_eq!(after, before);
    }

    #[test]
    fn the_next_owner_of_an_entry_is_who_owns_it_once_its_owner_died() {
        let ids: Vec<ObjectId> = (0..200)
            .map(|i| ObjectId::new(format!("o{i}")))
            .chain([ObjectId::homed(2, "h"), ObjectId::homed(4, "h")])
            .collect();
        let me = 2;
        let m = Membership::new(me, 5, []);
        m.mark_down(4);
        let mut own = 0;
        for id in &ids {
            let next = m.next_shard_of(id).expect("others are up");
            assert!(next != me && next != 4, "{id}: {next}");
            if m.shard_of(id) != me {
                continue;
            }
            own += 1;
            // What every other node computes once this one is down too.
            let other = Membership::new(0, 5, []);
            other.mark_down(4);
            other.mark_down(me);
            assert_eq!(other.shard_of(id), next, "{id}");
        }
        assert!(own > 10, "node {me} owns {own} of {}", ids.len());
        // Node 1 dies: where it was the next owner, another takes over; elsewhere none changes.
        let next: Vec<Option<NodeId>> = ids.iter().map(|id| m.next_shard_of(id)).collect();
        m.mark_down(1);
        for (id, &n) in ids.iter().zip(&next) {
            let now = m.next_shard_of(id).unwrap();
            assert!(now != 1 && (n == Some(1) || Some(now) == n), "{id}: {now}");
        }
        // Alone: no next owner.
        let m = Membership::new(1, 2, []);
        assert!(m.next_shard_of(&ids[0]).is_some());
        m.mark_down(0);
        assert_eq!(m.next_shard_of(&ids[0]), None);
    }

    #[test]
    fn the_ring_watches_the_live_neighbours_on_both_sides() {
        let m = Membership::new(5, 256, []);
        assert!(m.ring().is_empty() && !m.watches(6), "no ring until asked");
        m.watch_ring();
        let mut r = m.ring();
        r.sort();
        assert_eq!(r, vec![3, 4, 6, 7]);
        m.mark_down(6);
        m.mark_down(3);
        let mut r = m.ring();
        r.sort();
        assert_eq!(r, vec![2, 4, 7, 8], "the next live ones take over");
        m.mark_up(6);
        assert!(m.watches(6) && !m.watches(8));
        // Wrapping around, and small clusters.
        let m = Membership::new(0, 256, []);
        m.watch_ring();
        let mut r = m.ring();
        r.sort();
        assert_eq!(r, vec![1, 2, 254, 255]);
        let m = Membership::new(1, 3, []);
        m.watch_ring();
        let mut r = m.ring();
        r.sort();
        assert_eq!(r, vec![0, 2]);
        let m = Membership::new(0, 1, []);
        m.watch_ring();
        assert!(m.ring().is_empty());
    }

    /// News of a death beats news of life of the same incarnation; a later incarnation (a
    /// refutation, a restart) beats both; news older than what is known is ignored.
    #[test]
    fn incarnations_order_the_news() {
        let m = Membership::new(0, 8, []);
        assert!(m.heard_alive(3, 5));
        assert!(!m.heard_alive(3, 5), "nothing new");
        assert!(!m.mark_down_at(3, 4), "older than known alive");
        assert!(!m.is_down(3));
        assert!(m.mark_down_at(3, 5));
        assert!(
            !m.heard_alive(3, 5),
            "a late Up of the incarnation it died in"
        );
        assert!(m.is_down(3));
        assert!(m.heard_alive(3, 6), "refuted");
        // A death seen on a link counts for the incarnation known then.
        m.mark_up(3);
        assert!(m.mark_down(3));
        assert!(!m.heard_alive(3, 6));
        assert!(m.heard_alive(3, 7));
        // This node's own: above whatever it is said to have died in.
        let mine = m.incarnation_of(0);
        assert_eq!(m.refute(mine + 10), mine + 11);
        assert!(mine <= max_incarnation());
    }

    #[test]
    fn a_homed_entry_lives_on_its_home_while_it_is_alive() {
        let m = Membership::new(0, 5, []);
        let ids: Vec<ObjectId> = (0..50)
            .map(|i| ObjectId::homed(3, format!("o{i}")))
            .collect();
        assert!(ids
            .iter()
            .all(|i| m.shard_of(i) == 3 && m.home_shard(i) == 3));
        // A home outside the cluster: placed by hashing, like the plain name would be spread.
        let far = ObjectId::homed(9, "x");
        assert!(m.shard_of(&far) < 5);
        m.mark_down(3);
        for id in &ids {
            let now = m.shard_of(id);
            assert_ne!(now, 3, "a dead home hands its entries on");
            assert!(m.owned_by_before_death(id, 3));
            assert_eq!(m.home_shard(id), 3);
        }
        // Spread over the live nodes, not piled on one.
        let spread: HashSet<NodeId> = ids.iter().map(|i| m.shard_of(i)).collect();
        assert!(spread.len() > 1, "{spread:?}");
        m.mark_up(3);
        assert!(
            ids.iter().all(|i| m.shard_of(i) == 3),
            "back home after a rejoin"
        );
    }
}
