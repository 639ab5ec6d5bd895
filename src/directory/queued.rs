//! Requests a shard holds until their object shows up (reads that wait for a copy,
//! subscriptions), by object, counted per requesting node: a node that floods a shard with
//! waits for objects that never come is refused past [`MAX_PER_NODE`] of them, instead of
//! growing the shard's memory without end (every other node's waits are still taken).

use crate::ObjectId;
use phalanx_transport::NodeId;
use std::collections::{HashMap, VecDeque};

/// Most requests one node may have waiting at one shard. A reduce of many inputs subscribes
/// to each, every pull of an object not made yet waits: far below this in any honest run.
pub const MAX_PER_NODE: usize = 1 << 16;

/// A request held for its requesting node.
pub(super) trait FromNode {
    fn node(&self) -> NodeId;
}

impl<R> FromNode for (NodeId, R) {
    fn node(&self) -> NodeId {
        self.0
    }
}

#[derive(Debug)]
pub(super) struct Queued<T> {
    by_id: HashMap<ObjectId, VecDeque<T>>,
    per_node: HashMap<NodeId, usize>,
}

impl<T> Default for Queued<T> {
    fn default() -> Self {
        Queued {
            by_id: HashMap::new(),
            per_node: HashMap::new(),
        }
    }
}

impl<T: FromNode> Queued<T> {
    /// Queues `t` for `id`, unless its node has [`MAX_PER_NODE`] requests here already:
    /// then it is handed back.
    pub fn push(&mut self, id: ObjectId, t: T) -> Result<(), T> {
        let n = self.per_node.entry(t.node()).or_default();
        if *n >= MAX_PER_NODE {
            return Err(t);
        }
        *n += 1;
        self.by_id.entry(id).or_default().push_back(t);
        Ok(())
    }

    /// Takes every request queued for `id`, in the order they came.
    pub fn take(&mut self, id: &ObjectId) -> VecDeque<T> {
        let q = self.by_id.remove(id).unwrap_or_default();
        for t in &q {
            self.forget(t.node());
        }
        q
    }

    /// Queues again requests [`Queued::take`] took for `id` (at their place: before any
    /// that came since). They were counted before: none is refused.
    pub fn put_back(&mut self, id: ObjectId, mut q: VecDeque<T>) {
        if q.is_empty() {
            return;
        }
        for t in &q {
            *self.per_node.entry(t.node()).or_default() += 1;
        }
        let e = self.by_id.entry(id).or_default();
        q.append(e);
        *e = q;
    }

    /// Keeps the requests for `id` that `keep` says to keep.
    pub fn retain_of(&mut self, id: &ObjectId, mut keep: impl FnMut(&T) -> bool) {
        let Some(q) = self.by_id.get_mut(id) else {
            return;
        };
        let per_node = &mut self.per_node;
        q.retain(|t| {
            let k = keep(t);
            if !k {
                Self::forget_in(per_node, t.node());
            }
            k
        });
        if q.is_empty() {
            self.by_id.remove(id);
        }
    }

    /// Keeps the requests, for every object, that `keep` says to keep.
    pub fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        let per_node = &mut self.per_node;
        self.by_id.retain(|_, q| {
            q.retain(|t| {
                let k = keep(t);
                if !k {
                    Self::forget_in(per_node, t.node());
                }
                k
            });
            !q.is_empty()
        });
    }

    /// Every request held, for every object.
    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.by_id.values().flatten()
    }

    /// Requests of `node` held here.
    #[cfg(test)]
    pub fn of(&self, node: NodeId) -> usize {
        self.per_node.get(&node).copied().unwrap_or(0)
    }

    fn forget(&mut self, node: NodeId) {
        Self::forget_in(&mut self.per_node, node);
    }

    fn forget_in(per_node: &mut HashMap<NodeId, usize>, node: NodeId) {
        if let Some(n) = per_node.get_mut(&node) {
            *n -= 1;
            if *n == 0 {
                per_node.remove(&node);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(k: u32) -> ObjectId {
        ObjectId::new(format!("o{k}"))
    }

    #[test]
    fn one_nodes_flood_is_refused_past_its_bound_and_counts_follow_every_removal() {
        let mut q: Queued<(NodeId, u64)> = Queued::default();
        for k in 0..MAX_PER_NODE as u32 {
            q.push(id(k % 100), (7, k as u64)).unwrap();
        }
        // Node 7 is at its bound; node 8 is not held back by it.
        assert_eq!(q.push(id(5), (7, 1)), Err((7, 1)));
        q.push(id(5), (8, 1)).unwrap();
        assert_eq!((q.of(7), q.of(8)), (MAX_PER_NODE, 1));
        // Taken: counted off, and room again.
        let taken = q.take(&id(3));
        assert_eq!(
            taken.len(),
            MAX_PER_NODE / 100 + usize::from(3 < MAX_PER_NODE % 100)
        );
        assert_eq!(q.of(7), MAX_PER_NODE - taken.len());
        q.push(id(3), (7, 99)).unwrap();
        // Put back in front of what came since, counted again.
        q.put_back(id(3), taken);
        assert_eq!(q.take(&id(3)).back(), Some(&(7, 99)));
        // Retained: per object and over all.
        q.retain_of(&id(5), |t| t.0 != 8);
        assert_eq!(q.of(8), 0);
        q.retain(|t| t.1 % 2 == 0);
        let left = q.iter().count();
        assert_eq!(q.of(7), left);
        q.retain(|_| false);
        assert_eq!((q.of(7), q.iter().count()), (0, 0));
        assert!(q.by_id.is_empty() && q.per_node.is_empty());
    }
}
