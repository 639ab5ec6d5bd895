//! This node's promises to produce objects (`DirMsg::Promise`), from the start of each
//! operation to its end.
//!
//! A coordinator promises a reduce's target so that the target's readers are told it is
//! lost if the coordinator dies before any copy of it exists. Most reduces of small objects
//! end within a millisecond, and one message more on the way of each was measurable in the
//! 64 KiB allreduce (5-7 % in three rounds of four on the 8 emulated hosts), so the promise
//! of a small operation whose inputs are here is sent only once it has run for
//! [`PROMISE_AFTER`] (the dispatcher wakes then and sends the due ones): an operation
//! that ends sooner costs nothing, and a coordinator that dies within that time leaves its
//! readers waiting as for an object never made. Sent promises are made again to an entry's
//! next owner when directory ownership moves ([`Promises::standing`]), and taken back when
//! their operation fails. A node that owns the entry of its target itself sends the promise
//! to the entry's next owner instead (`DirMsg::Backup`), and takes it back there when the
//! operation ends. Each promise remembers where it went: it is taken back there, and moved
//! (taken back there, made where it now belongs) when membership changes where it belongs.

use crate::ObjectId;
use phalanx_transport::NodeId;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long an operation runs before its promise is sent.
pub const PROMISE_AFTER: Duration = Duration::from_millis(10);

/// Most promises kept at once (operations under way on this node); more are not kept.
const PENDING_MAX: usize = 4096;

/// Where a promise went: to the entry's owner, or (`backup`) to its next owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sent {
    pub to: NodeId,
    pub backup: bool,
}

#[derive(Debug)]
struct Pending {
    token: u64,
    id: ObjectId,
    /// Deferred: due at this instant (`None`: sent, or being sent, at once).
    due: Option<Instant>,
    /// Where it went, once sent (`None` also when there was nobody to send it to).
    sent: Option<Sent>,
    /// Where it went may have lost it (restarted, or its link dropped): sent again.
    resend: bool,
}

/// The promises of one node, not yet sent or not yet ended.
#[derive(Debug, Default)]
pub struct Promises {
    state: Mutex<(u64, Vec<Pending>)>,
}

impl Promises {
    /// Notes a promise to produce `id` from `now`, sent at once by the caller if `now_due`
    /// (an operation that will take long, or whose length is unknown), else once due.
    /// Returns its token, for [`Promises::sent`] and [`Promises::end`]; `None`: too many are
    /// pending, so it is not kept.
    pub fn make(&self, id: &ObjectId, now_due: bool, now: Instant) -> Option<u64> {
        let mut s = self.state.lock().unwrap();
        if s.1.len() >= PENDING_MAX {
            return None;
        }
        s.0 += 1;
        let token = s.0;
        s.1.push(Pending {
            token,
            id: id.clone(),
            due: (!now_due).then_some(now + PROMISE_AFTER),
            sent: None,
            resend: false,
        });
        Some(token)
    }

    /// The promises due at `now`, no longer deferred: the caller sends them and says where
    /// ([`Promises::sent`]).
    pub fn due(&self, now: Instant) -> Vec<(u64, ObjectId)> {
        let mut s = self.state.lock().unwrap();
        let mut due = Vec::new();
        for p in s.1.iter_mut() {
            if p.due.is_some_and(|d| now >= d) {
                p.due = None;
                due.push((p.token, p.id.clone()));
            }
        }
        due
    }

    /// When the next deferred promise is due (the dispatcher wakes then: a promise goes out
    /// `PROMISE_AFTER` after its operation began, not at the next tick).
    pub fn next_due(&self) -> Option<Instant> {
        let s = self.state.lock().unwrap();
        s.1.iter().filter_map(|p| p.due).min()
    }

    /// Promise `token` went to `sent`. False: it is not kept (its operation ended
    /// meanwhile), so the caller takes back what it just sent.
    pub fn sent(&self, token: u64, sent: Option<Sent>) -> bool {
        let mut s = self.state.lock().unwrap();
        match s.1.iter_mut().find(|p| p.token == token) {
            Some(p) => {
                p.sent = sent;
                p.resend = false;
                true
            }
            None => false,
        }
    }

    /// The promises sent to `peer`, which may have lost them (it restarted, or its link
    /// dropped), are to be sent again ([`Promises::standing`] says so); until then they are
    /// still taken back there.
    pub fn resend_to(&self, peer: NodeId) {
        let mut s = self.state.lock().unwrap();
        for p in s.1.iter_mut() {
            if p.sent.is_some_and(|to| to.to == peer) {
                p.resend = true;
            }
        }
    }

    /// The promises sent and not ended, where each went, and whether it is to be sent again
    /// (to be moved when membership changes where it belongs, or sent again).
    pub fn standing(&self) -> Vec<(u64, ObjectId, Sent, bool)> {
        let s = self.state.lock().unwrap();
        s.1.iter()
            .filter_map(|p| Some((p.token, p.id.clone(), p.sent?, p.resend)))
            .collect()
    }

    /// The operation of promise `token` ended: the object, and where its promise went if it
    /// was sent, for the caller to take it back there (a failed operation's at its shard;
    /// one kept by an entry's next owner either way: a complete copy ends a promise only at
    /// the shard). `None` if it had ended already.
    pub fn end(&self, token: u64) -> Option<(ObjectId, Option<Sent>)> {
        let mut s = self.state.lock().unwrap();
        let i = s.1.iter().position(|p| p.token == token)?;
        let p = s.1.swap_remove(i);
        Some((p.id, p.sent))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_promise_is_sent_once_due_and_remembers_where_it_went() {
        let ps = Promises::default();
        let t0 = Instant::now();
        let x: ObjectId = "x".into();
        let at = |to| Some(Sent { to, backup: false });
        let quick = ps.make(&x, false, t0).unwrap();
        assert!(ps.due(t0 + PROMISE_AFTER / 2).is_empty(), "not due yet");
        assert_eq!(
            ps.next_due(),
            Some(t0 + PROMISE_AFTER),
            "the dispatcher looks then"
        );
        // Ended before it was due: nothing was ever sent.
        assert_eq!(ps.end(quick), Some((x.clone(), None)));
        assert!(ps.due(t0 + PROMISE_AFTER * 2).is_empty());
        // Due: handed out once; ended: where it went.
        let slow = ps.make(&x, false, t0).unwrap();
        assert_eq!(ps.due(t0 + PROMISE_AFTER), vec![(slow, x.clone())]);
        assert!(ps.due(t0 + PROMISE_AFTER * 3).is_empty(), "handed out once");
        ps.sent(slow, at(3));
        assert_eq!(
            ps.standing(),
            vec![(slow, x.clone(), at(3).unwrap(), false)]
        );
        // Moved: remembered where it went last.
        ps.sent(slow, at(4));
        assert_eq!(ps.end(slow), Some((x.clone(), at(4))));
        assert_eq!(ps.end(slow), None, "ended once");
        // At once: never handed out by `due`; standing once sent.
        let long = ps.make(&x, true, t0).unwrap();
        let y = ps.make(&"y".into(), false, t0).unwrap();
        assert!(ps.due(t0).is_empty());
        assert!(ps.standing().is_empty(), "nothing sent yet");
        let backup = Sent {
            to: 5,
            backup: true,
        };
        ps.sent(long, Some(backup));
        assert_eq!(ps.standing(), vec![(long, x.clone(), backup, false)]);
        assert_eq!(ps.end(long), Some((x.clone(), Some(backup))));
        // Nobody to send it to: nothing sent.
        assert!(ps.sent(y, None));
        assert_eq!(ps.end(y), Some(("y".into(), None)));
        // Sent after its operation ended (the tick raced the end): not kept, so the sender
        // takes it back.
        let raced = ps.make(&x, false, t0).unwrap();
        assert_eq!(ps.due(t0 + PROMISE_AFTER), vec![(raced, x.clone())]);
        assert_eq!(ps.end(raced), Some((x.clone(), None)));
        assert!(!ps.sent(raced, at(3)));
        // The node it went to restarted: due again, and sent wherever it belongs then.
        let again = ps.make(&x, true, t0).unwrap();
        let other = ps.make(&"z".into(), true, t0).unwrap();
        assert!(ps.sent(again, at(3)) && ps.sent(other, at(4)));
        ps.resend_to(3);
        let mut st = ps.standing();
        st.sort_by_key(|s| s.0);
        let z: ObjectId = "z".into();
        assert_eq!(
            st,
            vec![
                (again, x.clone(), at(3).unwrap(), true),
                (other, z.clone(), at(4).unwrap(), false)
            ]
        );
        // Until sent again, it is still taken back where it went; once sent, no more resend.
        assert!(ps.sent(again, at(3)));
        assert!(ps.standing().iter().all(|s| !s.3));
        assert_eq!(ps.end(again), Some((x.clone(), at(3))));
        ps.end(other);
        assert!(ps.state.lock().unwrap().1.is_empty());
    }

    #[test]
    fn too_many_pending_promises_are_not_kept() {
        let ps = Promises::default();
        let t0 = Instant::now();
        for k in 0..PENDING_MAX {
            assert!(ps.make(&format!("o{k}").into(), false, t0).is_some());
        }
        assert_eq!(ps.make(&"one-more".into(), true, t0), None);
    }
}
