//! This node's complete copies of objects whose directory entries it owns itself, told to
//! the entries' next owners (`DirMsg::Backup` with `copy`).
//!
//! An entry lives on one node. When that node also held the object's only copy and dies,
//! the entry's next owner never heard of the object, and its readers would wait for their op
//! timeout. So a node tells the next owner of each entry it owns that it holds a complete
//! copy; if it dies, the object is an orphan there, lost after the grace unless another
//! holder republishes a copy. Most objects of a task system live for milliseconds (the
//! inputs and intermediates of a collective), so a copy is told only once it has been here
//! for [`HELD_AFTER`] (the dispatcher wakes then and sends the due ones): a copy
//! dropped sooner costs nothing, and a node that dies that soon after making it leaves its
//! readers waiting as before. Only a copy that is the only complete one the entry lists is
//! told (another holder republishes its own when this node dies): the same tick takes back
//! what was told of a copy that is gone (deleted, evicted), whose entry moved elsewhere, or
//! that another node now holds too; and it moves what was told when membership changes the
//! entry's next owner (taken back where it went, told to the new one).

use crate::ObjectId;
use phalanx_transport::NodeId;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a copy is here before its next owner is told.
pub const HELD_AFTER: Duration = Duration::from_millis(10);

/// Most copies tracked at once (see [`Held::note`]).
const HELD_MAX: usize = 4096;

#[derive(Debug)]
struct Since {
    at: Instant,
    /// The node told of it, if any.
    told: Option<NodeId>,
    /// That node may have lost the word (restarted, or its link dropped): told again.
    resend: bool,
}

/// Where a copy noted here stands, for [`Held::tick`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    /// Dropped, or its entry is no longer this node's.
    Gone,
    /// Another node's complete copy is listed too.
    Shared,
    /// The only complete copy the entry lists; the entry's next owner now (`None`: no
    /// other node is up).
    Only(Option<NodeId>),
}

/// What the tick must send: `(object, node, kept)`: `node` told of the copy (`true`) or
/// told to forget it.
pub type Tell = Vec<(ObjectId, NodeId, bool)>;

#[derive(Debug, Default)]
pub struct Held {
    copies: Mutex<HashMap<ObjectId, Since>>,
    /// The earliest instant a copy noted since the last tick becomes due (`None`: none is
    /// waiting to be looked at), so that the dispatcher looks then and not at its next
    /// tick. Locked after `copies`.
    next_due: Mutex<Option<Instant>>,
}

impl Held {
    /// This node has a complete copy of `id`, whose entry it owns, from `now` (it published
    /// it, or pulled it). Past `HELD_MAX`, up to twice that are noted and the tick drops the
    /// oldest copies not told (noting runs on transport threads: no scan here); with the
    /// table full of told copies, a new one is not tracked.
    /// Returns when it is due if no copy noted before is due sooner (the dispatcher may
    /// have to be woken for it).
    pub fn note(&self, id: &ObjectId, now: Instant) -> Option<Instant> {
        let mut c = self.copies.lock().unwrap();
        if c.len() >= 2 * HELD_MAX || c.contains_key(id) {
            return None;
        }
        let told = None;
        c.insert(
            id.clone(),
            Since {
                at: now,
                told,
                resend: false,
            },
        );
        let mut next = self.next_due.lock().unwrap();
        let due = now + HELD_AFTER;
        if next.is_some_and(|n| n <= due) {
            return None;
        }
        *next = Some(due);
        Some(due)
    }

    /// When the next copy noted since the last tick becomes due (a tick should look then).
    pub fn next_due(&self) -> Option<Instant> {
        *self.next_due.lock().unwrap()
    }

    /// The copies told to `peer`, which may have lost the word (it restarted, or its link
    /// dropped): told again at the next tick, wherever they belong then.
    pub fn resend_to(&self, peer: NodeId) {
        let mut c = self.copies.lock().unwrap();
        for s in c.values_mut() {
            if s.told == Some(peer) {
                s.resend = true;
            }
        }
    }

    /// At `now`: what to tell and to take back, from where each copy stands (`look`, given
    /// the node told so far): a
    /// copy gone is taken back where it was told and forgotten; one shared is taken back
    /// but still tracked; the only one, once due, is told to the entry's next owner, and
    /// moved there (taken back from the node told before) when that changed.
    pub fn tick(&self, now: Instant, look: impl Fn(&ObjectId, Option<NodeId>) -> Standing) -> Tell {
        // Looked at with no lock of ours held (`look` asks the store, the membership and
        // the shard), with the node told so far.
        let ids: Vec<(ObjectId, Option<NodeId>)> = {
            let c = self.copies.lock().unwrap();
            c.iter().map(|(id, s)| (id.clone(), s.told)).collect()
        };
        let looks: HashMap<ObjectId, Standing> = ids
            .into_iter()
            .map(|(id, told)| {
                let s = look(&id, told);
                (id, s)
            })
            .collect();
        let mut c = self.copies.lock().unwrap();
        let mut tell = Vec::new();
        c.retain(|id, s| {
            // Noted since the look: looked at next time.
            let Some(&standing) = looks.get(id) else {
                return true;
            };
            let want = match standing {
                Standing::Only(next) if now.saturating_duration_since(s.at) >= HELD_AFTER => next,
                Standing::Only(_) => return true,
                Standing::Gone | Standing::Shared => None,
            };
            if s.told != want {
                if let Some(old) = s.told {
                    tell.push((id.clone(), old, false));
                }
                if let Some(new) = want {
                    tell.push((id.clone(), new, true));
                }
                s.told = want;
            } else if s.resend {
                if let Some(to) = want {
                    tell.push((id.clone(), to, true));
                }
            }
            s.resend = false;
            standing != Standing::Gone
        });
        // The next copy to look at once due: one not told that is not due yet (those due
        // were looked at just now; a shared one is looked at again at every tick).
        *self.next_due.lock().unwrap() = c
            .values()
            .filter(|s| s.told.is_none())
            .map(|s| s.at + HELD_AFTER)
            .filter(|&d| d > now)
            .min();
        // Over the bound: the oldest copies not told go (the told ones are needed to take
        // their words back).
        if c.len() > HELD_MAX {
            let mut untold: Vec<(Instant, ObjectId)> = c
                .iter()
                .filter(|(_, s)| s.told.is_none())
                .map(|(id, s)| (s.at, id.clone()))
                .collect();
            untold.sort();
            let over = c.len() - HELD_MAX;
            for (_, id) in untold.into_iter().take(over) {
                c.remove(&id);
            }
        }
        tell
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_is_told_once_due_while_it_is_the_only_one_and_moved_or_taken_back() {
        use Standing::*;
        let h = Held::default();
        let t0 = Instant::now();
        let (x, y): (ObjectId, ObjectId) = ("x".into(), "y".into());
        assert_eq!(h.note(&x, t0), Some(t0 + HELD_AFTER), "the first to be due");
        assert_eq!(h.note(&y, t0), None, "due no sooner");
        assert_eq!(h.note(&x, t0 + HELD_AFTER), None, "noted once");
        assert_eq!(
            h.next_due(),
            Some(t0 + HELD_AFTER),
            "the dispatcher looks then"
        );
        assert!(
            h.tick(t0 + HELD_AFTER / 2, |_, _| Only(Some(3))).is_empty(),
            "not due"
        );
        assert_eq!(h.next_due(), Some(t0 + HELD_AFTER), "still to look at");
        // y is gone before it was due: never told, nothing to take back, forgotten.
        let look = |id: &ObjectId, _| if *id == y { Gone } else { Only(Some(3)) };
        assert_eq!(h.tick(t0 + HELD_AFTER, look), vec![(x.clone(), 3, true)]);
        assert_eq!(h.next_due(), None, "nothing new to look at");
        assert!(
            h.tick(t0 + HELD_AFTER * 3, |_, _| Only(Some(3))).is_empty(),
            "told once"
        );
        // The next owner changed: taken back there, told to the new one.
        assert_eq!(
            h.tick(t0 + HELD_AFTER * 4, |_, _| Only(Some(5))),
            vec![(x.clone(), 3, false), (x.clone(), 5, true)]
        );
        // Another node holds x too: taken back, still tracked, told again once it is the
        // only one again.
        assert_eq!(
            h.tick(t0 + HELD_AFTER * 5, |_, _| Shared),
            vec![(x.clone(), 5, false)]
        );
        assert!(h.tick(t0 + HELD_AFTER * 6, |_, _| Shared).is_empty());
        assert_eq!(
            h.tick(t0 + HELD_AFTER * 7, |_, _| Only(Some(5))),
            vec![(x.clone(), 5, true)]
        );
        // Nobody else up: taken back, nothing told.
        assert_eq!(
            h.tick(t0 + HELD_AFTER * 8, |_, _| Only(None)),
            vec![(x.clone(), 5, false)]
        );
        assert_eq!(
            h.tick(t0 + HELD_AFTER * 9, |_, _| Only(Some(5))),
            vec![(x.clone(), 5, true)]
        );
        // Node 5 restarted (or its link dropped): told again.
        h.resend_to(5);
        assert_eq!(
            h.tick(t0 + HELD_AFTER * 9, |_, _| Only(Some(5))),
            vec![(x.clone(), 5, true)]
        );
        // x gone (or its entry moved): taken back once, then forgotten.
        assert_eq!(
            h.tick(t0 + HELD_AFTER * 10, |_, _| Gone),
            vec![(x, 5, false)]
        );
        assert!(h
            .tick(t0 + HELD_AFTER * 11, |_, _| Only(Some(5)))
            .is_empty());
        assert!(h.copies.lock().unwrap().is_empty());
        // Bounded: past the bound the tick drops the oldest copies not told; told ones stay.
        for k in 0..HELD_MAX + 10 {
            h.note(&format!("o{k}").into(), t0 + Duration::from_nanos(k as u64));
        }
        assert_eq!(
            h.copies.lock().unwrap().len(),
            HELD_MAX + 10,
            "noted, trimmed later"
        );
        let told = |id: &ObjectId, _| match id.as_str() {
            "o0" | "o1" => Only(Some(2)),
            _ => Shared,
        };
        assert_eq!(h.tick(t0 + HELD_AFTER * 2, told).len(), 2);
        let c = h.copies.lock().unwrap();
        assert_eq!(c.len(), HELD_MAX);
        assert!(c.contains_key(&ObjectId::from("o0")) && c.contains_key(&ObjectId::from("o1")));
        assert!(
            !c.contains_key(&ObjectId::from("o2")),
            "the oldest not told went"
        );
        assert!(c.contains_key(&ObjectId::from(format!("o{}", HELD_MAX + 9))));
        drop(c);
        for k in 0..3 * HELD_MAX {
            h.note(&format!("p{k}").into(), t0);
        }
        assert_eq!(
            h.copies.lock().unwrap().len(),
            2 * HELD_MAX,
            "noting is bounded too"
        );
    }
}
