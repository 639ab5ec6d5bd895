//! Where this node fetches the partitions of a partitioned allreduce from: each partition's
//! coordinator says so once the partition's chain is placed (`ReduceMsg::Gather`), and the
//! hint waits here for the node's assembly of the result (`Node::assemble`), which asks once
//! per partition.
//!
//! The hints live with the transfers because a source consults them too: a node named as
//! the source of a partition it does not hold serves it once its own pull has begun. A hint
//! left unclaimed for [`UNCLAIMED`] says no assembly here asks for that partition (the node
//! holds an input but does not read the result): the source then refuses at once, and the
//! receiver asks the directory, instead of waiting out the source's wait for a copy.

use crate::protocol::GatherFrom;
use crate::ObjectId;
use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// Hints kept at most this long unclaimed (a node whose assembly never asks, or asked
/// before the hint came and went its own way).
const KEEP: Duration = Duration::from_secs(60);

/// Hints kept at most (the oldest go first): a coordinator cannot grow the table for ever.
const MAX_HINTS: usize = 4096;

/// A hint unclaimed this long says no assembly on this node asks for its partition. An
/// assembly takes its hints as they come: it starts with the plan, which the coordinator
/// announces before any partition is placed.
pub(crate) const UNCLAIMED: Duration = Duration::from_millis(50);

/// The hints of this node's tasks, by partition, until taken.
#[derive(Default)]
pub(crate) struct GatherHints {
    hints: Mutex<HashMap<ObjectId, (GatherFrom, Instant)>>,
    added: Condvar,
}

impl GatherHints {
    /// This node is told where to fetch `target` from.
    pub fn record(&self, target: &ObjectId, from: GatherFrom) {
        let mut h = self.hints.lock().unwrap();
        h.retain(|_, (_, at)| at.elapsed() < KEEP);
        if h.len() >= MAX_HINTS {
            let oldest = h
                .iter()
                .min_by_key(|(_, (_, at))| *at)
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                h.remove(&k);
            }
        }
        h.insert(target.clone(), (from, Instant::now()));
        drop(h);
        self.added.notify_all();
    }

    /// Whether a hint for `target` came here `UNCLAIMED` ago or more and nothing took it: no
    /// assembly on this node asks for that partition.
    pub fn unclaimed(&self, target: &ObjectId) -> bool {
        let h = self.hints.lock().unwrap();
        h.get(target)
            .is_some_and(|(_, at)| at.elapsed() >= UNCLAIMED)
    }

    /// Where to fetch `target` from, waiting up to `wait` for the hint; `None` if none came
    /// (the directory chooses then).
    pub fn take(&self, target: &ObjectId, wait: Duration) -> Option<GatherFrom> {
        let deadline = Instant::now() + wait;
        let mut h = self.hints.lock().unwrap();
        loop {
            if let Some((from, _)) = h.remove(target) {
                return Some(from);
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            h = self.added.wait_timeout(h, deadline - now).unwrap().0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hint_is_taken_once_and_waited_for() {
        let g = std::sync::Arc::new(GatherHints::default());
        let t = ObjectId::new("x#part1of4");
        assert_eq!(g.take(&t, Duration::from_millis(10)), None);
        let g2 = g.clone();
        let t2 = t.clone();
        let h = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            g2.record(&t2, GatherFrom::Node(3));
        });
        assert_eq!(
            g.take(&t, Duration::from_secs(5)),
            Some(GatherFrom::Node(3)),
            "waited for"
        );
        h.join().unwrap();
        assert_eq!(g.take(&t, Duration::ZERO), None, "taken once");
        g.record(&t, GatherFrom::Here);
        assert_eq!(g.take(&t, Duration::ZERO), Some(GatherFrom::Here));
    }

    #[test]
    fn a_hint_nothing_takes_is_unclaimed_after_a_while() {
        let g = GatherHints::default();
        let t = ObjectId::new("x#part0of4");
        assert!(!g.unclaimed(&t), "no hint");
        g.record(&t, GatherFrom::Node(2));
        assert!(!g.unclaimed(&t), "just came");
        std::thread::sleep(UNCLAIMED + Duration::from_millis(5));
        assert!(g.unclaimed(&t), "nothing took it");
        assert_eq!(g.take(&t, Duration::ZERO), Some(GatherFrom::Node(2)));
        assert!(!g.unclaimed(&t), "taken");
    }

    #[test]
    fn the_table_is_bounded() {
        let g = GatherHints::default();
        for k in 0..MAX_HINTS + 10 {
            g.record(&ObjectId::new(format!("t{k}")), GatherFrom::Node(1));
        }
        assert_eq!(g.hints.lock().unwrap().len(), MAX_HINTS);
        let last = ObjectId::new(format!("t{}", MAX_HINTS + 9));
        assert_eq!(g.take(&last, Duration::ZERO), Some(GatherFrom::Node(1)));
    }
}
