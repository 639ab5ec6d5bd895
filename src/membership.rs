//! Who is alive, as this node believes, and where directory entries live: on the name's home
//! node when it has one ([`ObjectId::homed`]) and that node is alive, else by highest-random-
//! weight hashing over the live nodes, so that when a shard's node dies its entries move to
//! one deterministic other node (and move back when it rejoins).

use crate::ObjectId;
use crossbeam_channel::{Receiver, Sender};
use phalanx_transport::NodeId;
use std::collections::HashSet;
use std::sync::Mutex;

pub(crate) struct Membership {
    id: NodeId,
    nodes: u32,
    /// Peers seen down and not back yet.
    down: Mutex<HashSet<NodeId>>,
    /// Watchers (reduce coordinators) told of every peer that goes down.
    watchers: Mutex<Vec<Sender<NodeId>>>,
}

impl Membership {
    /// `down` lists the peers not reachable at start (a rejoining node treats them as down
    /// until they link up).
    pub fn new(id: NodeId, nodes: u32, down: impl IntoIterator<Item = NodeId>) -> Membership {
        Membership {
            id,
            nodes,
            down: Mutex::new(down.into_iter().collect()),
            watchers: Mutex::new(Vec::new()),
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

    /// The node holding the entry of `id` while every node is alive.
    pub fn home_shard(&self, id: &ObjectId) -> NodeId {
        entry_owner(id, self.nodes, |_| true)
    }

    /// Records `peer` as down; true if it was up until now.
    pub fn mark_down(&self, peer: NodeId) -> bool {
        self.down.lock().unwrap().insert(peer)
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
        self.down.lock().unwrap().remove(&peer)
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
