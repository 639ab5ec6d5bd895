//! This node's complete copies of objects whose directory entries it owns itself, told to
//! the entries' next owners (`DirMsg::Backup` with `copy`).
//!
//! An entry lives on one node. When that node also held the object's only copy and dies,
//! the entry's next owner never heard of the object, and its readers would wait for their op
//! timeout. So a node tells the next owner of each entry it owns that it holds a complete
//! copy; if it dies, the object is an orphan there, lost after the grace unless another
//! holder republishes a copy. Most objects of a task system live for milliseconds (the
//! inputs and intermediates of a collective), so a copy is told only once it has been here
//! for [`HELD_AFTER`] (the dispatcher's tick, every 50 ms, sends the due ones): a copy
//! dropped sooner costs nothing, and a node that dies that soon after making it leaves its
//! readers waiting as before. Only a copy that is the only complete one the entry lists is
//! told (another holder republishes its own when this node dies): the same tick takes back
//! what was told of a copy that is gone (deleted, evicted), whose entry moved elsewhere, or
//! that another node now holds too.

use crate::ObjectId;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a copy is here before its next owner is told.
pub const HELD_AFTER: Duration = Duration::from_millis(10);

/// Most copies tracked at once; more are not told (their objects are covered as before).
const HELD_MAX: usize = 4096;

#[derive(Debug)]
struct Since {
    at: Instant,
    told: bool,
}

/// Where a copy noted here stands, for [`Held::tick`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    /// Dropped, or its entry is no longer this node's.
    Gone,
    /// Another node's complete copy is listed too.
    Shared,
    /// The only complete copy the entry lists.
    Only,
}

/// What the tick must send: `(object, kept)`: told (`true`) or taken back.
pub type Tell = Vec<(ObjectId, bool)>;

#[derive(Debug, Default)]
pub struct Held {
    copies: Mutex<HashMap<ObjectId, Since>>,
}

impl Held {
    /// This node published a complete copy of `id`, whose entry it owns, at `now`.
    pub fn note(&self, id: &ObjectId, now: Instant) {
        let mut c = self.copies.lock().unwrap();
        if c.len() < HELD_MAX && !c.contains_key(id) {
            c.insert(
                id.clone(),
                Since {
                    at: now,
                    told: false,
                },
            );
        }
    }

    /// At `now`: the copies due to be told, and the ones told that need not be any more,
    /// taken back. `look(id)` says where each stands: gone (dropped, or its entry is no
    /// longer this node's: forgotten), shared (another node's complete copy is listed too:
    /// its word is not needed, nor sent, but the copy is still tracked) or the only one.
    pub fn tick(&self, now: Instant, look: impl Fn(&ObjectId) -> Standing) -> Tell {
        // Looked at with no lock of ours held (`look` asks the store, the membership and
        // the shard).
        let ids: Vec<ObjectId> = self.copies.lock().unwrap().keys().cloned().collect();
        let looks: HashMap<ObjectId, Standing> = ids
            .into_iter()
            .map(|id| {
                let s = look(&id);
                (id, s)
            })
            .collect();
        let mut c = self.copies.lock().unwrap();
        let mut tell = Vec::new();
        c.retain(|id, s| {
            let standing = looks.get(id).copied().unwrap_or(Standing::Only);
            if standing != Standing::Only {
                if s.told {
                    s.told = false;
                    tell.push((id.clone(), false));
                }
                return standing == Standing::Shared;
            }
            if !s.told && now.saturating_duration_since(s.at) >= HELD_AFTER {
                s.told = true;
                tell.push((id.clone(), true));
            }
            true
        });
        tell
    }

    /// The copies told (to be told again to an entry's new next owner when the one that
    /// had them dies).
    pub fn told(&self) -> Vec<ObjectId> {
        let c = self.copies.lock().unwrap();
        c.iter()
            .filter(|(_, s)| s.told)
            .map(|(id, _)| id.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_is_told_once_due_while_it_is_the_only_one_and_taken_back_once_not() {
        use Standing::*;
        let h = Held::default();
        let t0 = Instant::now();
        let (x, y): (ObjectId, ObjectId) = ("x".into(), "y".into());
        h.note(&x, t0);
        h.note(&y, t0);
        h.note(&x, t0 + HELD_AFTER); // noted once
        assert!(h.tick(t0 + HELD_AFTER / 2, |_| Only).is_empty(), "not due");
        // y is gone before it was due: never told, nothing to take back, forgotten.
        let look = |id: &ObjectId| if *id == y { Gone } else { Only };
        assert_eq!(h.tick(t0 + HELD_AFTER, look), vec![(x.clone(), true)]);
        assert!(
            h.tick(t0 + HELD_AFTER * 3, |_| Only).is_empty(),
            "told once"
        );
        assert_eq!(h.told(), vec![x.clone()]);
        // Another node holds x too: taken back, still tracked, told again once it is the
        // only one again.
        assert_eq!(
            h.tick(t0 + HELD_AFTER * 4, |_| Shared),
            vec![(x.clone(), false)]
        );
        assert!(h.tick(t0 + HELD_AFTER * 5, |_| Shared).is_empty());
        assert!(h.told().is_empty());
        assert_eq!(
            h.tick(t0 + HELD_AFTER * 6, |_| Only),
            vec![(x.clone(), true)]
        );
        // x gone (or its entry moved): taken back once, then forgotten.
        assert_eq!(h.tick(t0 + HELD_AFTER * 7, |_| Gone), vec![(x, false)]);
        assert!(h.tick(t0 + HELD_AFTER * 8, |_| Only).is_empty());
        assert!(h.copies.lock().unwrap().is_empty());
        // Bounded.
        for k in 0..HELD_MAX + 5 {
            h.note(&format!("o{k}").into(), t0);
        }
        assert_eq!(h.copies.lock().unwrap().len(), HELD_MAX);
    }
}
