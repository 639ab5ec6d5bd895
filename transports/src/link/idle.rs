//! What keeps a quiet link open, the same for every transport that closes idle links (each
//! decides for itself when a link is quiet and how it closes it).

use crate::{IdleGuard, NodeId};
use std::collections::HashSet;

/// The rules of one pass over a node's links (see [`IdleKeep::keeps`]); the node above is
/// asked which peers it keeps at most once per pass, and only if a link gets that far.
pub struct IdleKeep<'a> {
    guard: Option<&'a IdleGuard>,
    kept: Option<HashSet<NodeId>>,
}

impl<'a> IdleKeep<'a> {
    /// `guard`: the node's idle guard (`Transport::set_idle_guard`), if it set one.
    pub fn new(guard: Option<&'a IdleGuard>) -> IdleKeep<'a> {
        IdleKeep { guard, kept: None }
    }

    /// Whether a quiet link to `peer` stays: the peer holds a grant of ours (`granted`), the
    /// link proves a peer alive (with a watch set, `watching`: watched from either side,
    /// `watched`; without one every link's heartbeats are flagged and none is watched in
    /// particular), or the node above keeps it (its guard names the peer).
    pub fn keeps(&mut self, peer: NodeId, granted: bool, watching: bool, watched: bool) -> bool {
        if granted || (watching && watched) {
            return true;
        }
        let guard = self.guard;
        self.kept
            .get_or_insert_with(|| guard.map_or_else(HashSet::new, |g| g()))
            .contains(&peer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    #[test]
    fn grants_watches_and_the_guard_keep_a_link_and_the_guard_is_asked_once() {
        let asked = Arc::new(AtomicU32::new(0));
        let a = asked.clone();
        let guard: IdleGuard = Arc::new(move || {
            a.fetch_add(1, Ordering::Relaxed);
            HashSet::from([7])
        });
        let mut k = IdleKeep::new(Some(&guard));
        assert!(k.keeps(1, true, false, false), "a grant");
        assert!(k.keeps(1, false, true, true), "watched, with a watch");
        assert_eq!(asked.load(Ordering::Relaxed), 0, "not asked yet");
        assert!(
            !k.keeps(1, false, false, true),
            "no watch set: watched means nothing"
        );
        assert!(k.keeps(7, false, false, false), "the guard keeps 7");
        assert!(!k.keeps(2, false, true, false));
        assert_eq!(asked.load(Ordering::Relaxed), 1, "asked once per pass");
        assert!(
            !IdleKeep::new(None).keeps(7, false, false, false),
            "no guard"
        );
    }
}
