//! Words a shard keeps for nodes that own entries it would own if they died (their promises
//! and copies, `DirMsg::Backup`; their deletes, `DirMsg::Tombstone`): by key, the node that
//! said it, until that node takes it back or dies. At most `CAP`, the oldest dropped.

use phalanx_transport::NodeId;
use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

#[derive(Debug)]
pub(super) struct Kept<K, const CAP: usize> {
    /// By key: the node that said it, and the number it came under.
    words: HashMap<K, (NodeId, u64)>,
    /// The words in the order they came, each with its number (a key told again after a
    /// take-back comes again: its older place is skipped).
    order: VecDeque<(K, u64)>,
    made: u64,
}

impl<K, const CAP: usize> Default for Kept<K, CAP> {
    fn default() -> Self {
        Kept {
            words: HashMap::new(),
            order: VecDeque::new(),
            made: 0,
        }
    }
}

impl<K: Clone + Eq + Hash, const CAP: usize> Kept<K, CAP> {
    /// `node` says `key`. Told again, it keeps its place in the order (the node is the last
    /// to have said it); a new word beyond `CAP` pushes the oldest out.
    pub(super) fn keep(&mut self, key: K, node: NodeId) {
        if self.order.len() >= 2 * CAP {
            // Take-backs leave their places in the order: drop them now and then.
            let words = &self.words;
            self.order
                .retain(|(k, made)| words.get(k).is_some_and(|&(_, m)| m == *made));
        }
        if let Some((n, _)) = self.words.get_mut(&key) {
            *n = node;
            return;
        }
        if self.words.len() >= CAP {
            // The oldest goes; a place taken back or come again is skipped over.
            while let Some((old, made)) = self.order.pop_front() {
                if self.words.get(&old).is_some_and(|&(_, m)| m == made) {
                    self.words.remove(&old);
                    break;
                }
            }
        }
        self.made += 1;
        self.words.insert(key.clone(), (node, self.made));
        self.order.push_back((key, self.made));
    }

    /// `node` takes `key` back (a word another node said stays).
    pub(super) fn take_back(&mut self, key: &K, node: NodeId) {
        if self.words.get(key).is_some_and(|&(n, _)| n == node) {
            self.words.remove(key);
        }
    }

    /// The keys `node` said.
    pub(super) fn of(&self, node: NodeId) -> impl Iterator<Item = &K> {
        self.words
            .iter()
            .filter(move |&(_, &(n, _))| n == node)
            .map(|(k, _)| k)
    }

    pub(super) fn remove(&mut self, key: &K) {
        self.words.remove(key);
    }

    #[cfg(test)]
    pub(super) fn contains(&self, key: &K) -> bool {
        self.words.contains_key(key)
    }

    pub(super) fn len(&self) -> usize {
        self.words.len()
    }

    /// Places in the order, taken back ones included (bounded by `2 * CAP`).
    #[cfg(test)]
    pub(super) fn order_len(&self) -> usize {
        self.order.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_word_goes_and_take_backs_leave_nothing_behind() {
        let mut k: Kept<u32, 4> = Kept::default();
        for w in 0..20 {
            k.keep(w, 1);
            k.take_back(&w, 1);
        }
        assert_eq!(k.len(), 0);
        assert!(k.order_len() <= 8);
        // Another node's take-back changes nothing; told again, a word keeps its place.
        k.keep(1, 7);
        k.take_back(&1, 8);
        k.keep(2, 7);
        k.keep(1, 9);
        k.keep(3, 7);
        k.keep(4, 7);
        k.keep(5, 7);
        assert!(!k.contains(&1), "the oldest");
        assert!(k.contains(&2) && k.contains(&5));
        assert_eq!(k.len(), 4);
        let mut of7: Vec<u32> = k.of(7).copied().collect();
        of7.sort_unstable();
        assert_eq!(of7, vec![2, 3, 4, 5]);
        k.remove(&2);
        assert_eq!(k.of(7).count(), 3);
    }
}
