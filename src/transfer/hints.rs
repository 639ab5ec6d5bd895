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
    hints: Mutex<Table>,
    added: Condvar,
}

#[derive(Default)]
struct Table {
    /// By partition: the hint, and when it came.
    by_part: HashMap<ObjectId, (GatherFrom, Instant)>,
    /// How often a wait was cut short ([`GatherHints::kick`]).
    kicks: u64,
}

impl GatherHints {
    /// This node is told where to fetch `target` from.
    pub fn record(&self, target: &ObjectId, from: GatherFrom) {
        let mut t = self.hints.lock().unwrap();
        let h = &mut t.by_part;
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
        drop(t);
        self.added.notify_all();
    }

    /// Cuts every wait in [`GatherHints::take`] short: something its caller also waits for
    /// happened (the trees of an allreduce whose hints come late are all placed: what hints
    /// there are have come, `Node::late_hint`).
    pub fn kick(&self) {
        self.hints.lock().unwrap().kicks += 1;
        self.added.notify_all();
    }

    /// Whether a hint for `target` came here `UNCLAIMED` ago or more and nothing took it: no
    /// assembly on this node asks for that partition.
    pub fn unclaimed(&self, target: &ObjectId) -> bool {
        let h = self.hints.lock().unwrap();
        h.by_part
            .get(target)
            .is_some_and(|(_, at)| at.elapsed() >= UNCLAIMED)
    }

    /// Where to fetch `target` from, waiting up to `wait` for the hint, or until a
    /// [`GatherHints::kick`]; `None` if none came (the directory chooses then).
    pub fn take(&self, target: &ObjectId, wait: Duration) -> Option<GatherFrom> {
        self.take_unless_kicked(target, wait, self.kicks())
    }

    /// How many kicks there were so far.
    pub fn kicks(&self) -> u64 {
        self.hints.lock().unwrap().kicks
    }

    /// [`GatherHints::take`], cut short by any kick after the first `kicks` (none waited for
    /// if there were more already): a caller that looks at what a kick tells of before it
    /// waits misses none.
    pub fn take_unless_kicked(
        &self,
        target: &ObjectId,
        wait: Duration,
        kicks: u64,
    ) -> Option<GatherFrom> {
        let deadline = Instant::now() + wait;
        let mut h = self.hints.lock().unwrap();
        loop {
            if let Some((from, _)) = h.by_part.remove(target) {
                return Some(from);
            }
            let now = Instant::now();
            if now >= deadline || h.kicks != kicks {
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
    fn a_kick_ends_every_wait_and_keeps_the_hints() {
        let g = std::sync::Arc::new(GatherHints::default());
        let (t, other) = (ObjectId::new("x#part0of2"), ObjectId::new("x#part1of2"));
        let waiter = {
            let (g, t) = (g.clone(), t.clone());
            std::thread::spawn(move || {
                let start = Instant::now();
                (g.take(&t, Duration::from_secs(30)), start.elapsed())
            })
        };
        g.record(&other, GatherFrom::Node(1));
        // Kicked until it ends (a kick before its wait began would not end it).
        let start = Instant::now();
        while !waiter.is_finished() && start.elapsed() < Duration::from_secs(20) {
            g.kick();
            std::thread::sleep(Duration::from_millis(5));
        }
        let (got, took) = waiter.join().unwrap();
        assert_eq!(got, None, "no hint for its partition");
        assert!(took < Duration::from_secs(20), "cut short: {took:?}");
        assert_eq!(g.take(&other, Duration::ZERO), Some(GatherFrom::Node(1)));
        // A kick before a wait does not end it, unless the wait counts from before it.
        g.record(&t, GatherFrom::Here);
        assert_eq!(g.take(&t, Duration::from_secs(1)), Some(GatherFrom::Here));
        assert_eq!(g.take(&t, Duration::from_millis(10)), None);
        let seen = g.kicks();
        g.kick();
        let start = Instant::now();
        assert_eq!(
            g.take_unless_kicked(&t, Duration::from_secs(30), seen),
            None
        );
        assert!(start.elapsed() < Duration::from_secs(20), "not waited for");
    }

    #[test]
    fn the_table_is_bounded() {
        let g = GatherHints::default();
        for k in 0..MAX_HINTS + 10 {
            g.record(&ObjectId::new(format!("t{k}")), GatherFrom::Node(1));
        }
        assert_eq!(g.hints.lock().unwrap().by_part.len(), MAX_HINTS);
        let last = ObjectId::new(format!("t{}", MAX_HINTS + 9));
        assert_eq!(g.take(&last, Duration::ZERO), Some(GatherFrom::Node(1)));
    }
}
