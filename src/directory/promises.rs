//! This node's promises to produce objects (`DirMsg::Promise`), from the start of each
//! operation to its end.
//!
//! A coordinator promises a reduce's target so that the target's readers are told it is
//! lost if the coordinator dies before any copy of it exists. Most reduces of small objects
//! end within a millisecond, and one message more on the way of each was measurable in the
//! 64 KiB allreduce (5-7 % in three rounds of four on the 8 emulated hosts), so the promise
//! of a small operation whose inputs are here is sent only once it has run for
//! [`PROMISE_AFTER`] (the dispatcher's tick, every 50 ms, sends the due ones): an operation
//! that ends sooner costs nothing, and a coordinator that dies within that time leaves its
//! readers waiting as for an object never made. Sent promises are made again to an entry's
//! next owner when directory ownership moves ([`Promises::standing`]), and taken back when
//! their operation fails. A node that owns the entry of its target itself sends the promise
//! to the entry's next owner instead (`DirMsg::Backup`), and takes it back there when
//! the operation ends.

use crate::ObjectId;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long an operation runs before its promise is sent.
pub const PROMISE_AFTER: Duration = Duration::from_millis(10);

/// Most promises kept at once (operations under way on this node); more are sent at once
/// and not kept.
const PENDING_MAX: usize = 4096;

#[derive(Debug)]
struct Pending {
    token: u64,
    id: ObjectId,
    since: Instant,
    sent: bool,
}

/// What to tell the shards about this node's promises: `(object, promised)`.
pub type Tell = Vec<(ObjectId, bool)>;

/// The promises of one node, not yet sent or not yet ended.
#[derive(Debug, Default)]
pub struct Promises {
    state: Mutex<(u64, Vec<Pending>)>,
}

impl Promises {
    /// Notes a promise to produce `id` from `now`, ended by [`Promises::end`] with the token
    /// returned; `now_due`: sent at once (an operation that will take long, or whose length
    /// is unknown). Returns what to send now (also a promise when too many are pending: it
    /// is then not kept, nor ever taken back).
    pub fn make(&self, id: &ObjectId, now_due: bool, now: Instant) -> (u64, Tell) {
        let mut s = self.state.lock().unwrap();
        s.0 += 1;
        let token = s.0;
        if s.1.len() >= PENDING_MAX {
            return (token, vec![(id.clone(), true)]);
        }
        s.1.push(Pending {
            token,
            id: id.clone(),
            since: now,
            sent: now_due,
        });
        let tell = match now_due {
            true => vec![(id.clone(), true)],
            false => Vec::new(),
        };
        (token, tell)
    }

    /// The promises due at `now`, now marked sent.
    pub fn due(&self, now: Instant) -> Tell {
        let mut s = self.state.lock().unwrap();
        let mut tell = Vec::new();
        for p in s.1.iter_mut() {
            if !p.sent && now.saturating_duration_since(p.since) >= PROMISE_AFTER {
                p.sent = true;
                tell.push((p.id.clone(), true));
            }
        }
        tell
    }

    /// The objects whose promises were sent and are not ended yet (to be made again to an
    /// entry's next owner when directory ownership moves).
    pub fn standing(&self) -> Vec<ObjectId> {
        let s = self.state.lock().unwrap();
        s.1.iter()
            .filter(|p| p.sent)
            .map(|p| p.id.clone())
            .collect()
    }

    /// The operation of promise `token` ended (`ok`: it made its object). Returns the
    /// object if its promise was sent, for the caller to take back where it must be: at the
    /// shard if the operation failed (a complete copy ends it there otherwise), and at the
    /// entry's next owner, which keeps the promises of a shard's own operations, either way.
    pub fn end(&self, token: u64) -> Option<ObjectId> {
        let mut s = self.state.lock().unwrap();
        let i = s.1.iter().position(|p| p.token == token)?;
        let p = s.1.swap_remove(i);
        p.sent.then_some(p.id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_promise_is_sent_once_due_and_ended_only_if_sent() {
        let ps = Promises::default();
        let t0 = Instant::now();
        let x: ObjectId = "x".into();
        let (quick, now) = ps.make(&x, false, t0);
        assert!(now.is_empty());
        assert!(ps.due(t0 + PROMISE_AFTER / 2).is_empty(), "not due yet");
        // Ended before it was due: nothing was ever sent, nothing to take back.
        assert_eq!(ps.end(quick), None);
        assert!(ps.due(t0 + PROMISE_AFTER * 2).is_empty());
        // Due: sent once; failed afterwards: taken back.
        let (slow, _) = ps.make(&x, false, t0);
        assert_eq!(ps.due(t0 + PROMISE_AFTER), vec![(x.clone(), true)]);
        assert!(ps.due(t0 + PROMISE_AFTER * 3).is_empty(), "sent once");
        assert_eq!(ps.end(slow), Some(x.clone()));
        assert_eq!(ps.end(slow), None, "ended once");
        // Standing while sent and not ended.
        let (a, _) = ps.make(&x, true, t0);
        let (y, _) = ps.make(&"y".into(), false, t0);
        assert_eq!(ps.standing(), vec![x.clone()], "y is not sent yet");
        assert_eq!(ps.end(a), Some(x.clone()));
        assert_eq!(ps.end(y), None, "never sent");
        assert!(ps.standing().is_empty());
        // Due at once: sent now, and taken back if its operation fails.
        let (long, now) = ps.make(&x, true, t0);
        assert_eq!(now, vec![(x.clone(), true)]);
        assert!(ps.due(t0 + PROMISE_AFTER).is_empty(), "sent once");
        assert_eq!(ps.end(long), Some(x.clone()));
        assert!(ps.state.lock().unwrap().1.is_empty());
    }

    #[test]
    fn too_many_pending_promises_are_sent_at_once() {
        let ps = Promises::default();
        let t0 = Instant::now();
        for k in 0..PENDING_MAX {
            assert!(ps.make(&format!("o{k}").into(), false, t0).1.is_empty());
        }
        let (_, now) = ps.make(&"one-more".into(), false, t0);
        assert_eq!(now, vec![("one-more".into(), true)]);
    }
}
