//! Dialling a lost peer again. A link that fails while both nodes stay up (a dropped
//! connection, a link closed after a refused frame or a stalled reader) is dialled again by
//! the node that dials it when the mesh forms (the higher id), with exponential backoff from
//! [`FIRST_BACKOFF`] to [`MAX_BACKOFF`], until the link is back (whoever made it), the table
//! closes, or [`GIVE_UP_AFTER`] has passed (a node that is really gone dials its peers
//! itself when it comes back). One thread per table does every attempt, one at a time,
//! each bounded by [`ATTEMPT_TIMEOUT`].

use super::{Link, LinkTable};
use crate::{NodeId, TransportError};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};
use tracing::{debug, info, warn};

pub const FIRST_BACKOFF: Duration = Duration::from_millis(100);
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);
pub const GIVE_UP_AFTER: Duration = Duration::from_secs(300);
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);

/// Links one peer (the transport's dial and handshake), giving up at the deadline.
pub type DialFn =
    Arc<dyn Fn(NodeId, SocketAddr, Instant) -> Result<(), TransportError> + Send + Sync>;

struct Attempt {
    at: Instant,
    backoff: Duration,
    until: Instant,
    tries: u32,
}

#[derive(Default)]
struct Queue {
    /// Where each peer listens and how to dial it; `None` until the mesh was formed.
    dial: Option<(HashMap<NodeId, SocketAddr>, DialFn)>,
    due: HashMap<NodeId, Attempt>,
    closed: bool,
}

/// The table's redial queue, shared with its thread.
#[derive(Default)]
pub(super) struct Redial {
    q: Mutex<Queue>,
    cv: Condvar,
}

impl Redial {
    /// Queues `peer` for a first attempt after [`FIRST_BACKOFF`] (if redial is enabled and
    /// it is not queued yet). True if queued.
    pub(super) fn schedule(&self, peer: NodeId) -> bool {
        let mut q = self.q.lock().unwrap();
        let known = q.dial.as_ref().is_some_and(|(a, _)| a.contains_key(&peer));
        if q.closed || !known || q.due.contains_key(&peer) {
            return false;
        }
        let now = Instant::now();
        q.due.insert(
            peer,
            Attempt {
                at: now + FIRST_BACKOFF,
                backoff: FIRST_BACKOFF,
                until: now + GIVE_UP_AFTER,
                tries: 0,
            },
        );
        self.cv.notify_all();
        true
    }

    /// Where `peer` listens and how to dial it, once known.
    pub(super) fn dialer(&self, peer: NodeId) -> Option<(SocketAddr, DialFn)> {
        let q = self.q.lock().unwrap();
        let (addrs, dial) = q.dial.as_ref()?;
        Some((*addrs.get(&peer)?, dial.clone()))
    }

    pub(super) fn close(&self) {
        let mut q = self.q.lock().unwrap();
        q.closed = true;
        q.due.clear();
        self.cv.notify_all();
    }
}

impl<C: Link> LinkTable<C> {
    /// Enables redial (see the module): remembers where `peers` listen and how to dial one,
    /// and starts the table's redial thread (once; none when links are made on demand, which
    /// must then be enabled first).
    pub fn enable_redial(
        self: &Arc<Self>,
        peers: &[(NodeId, SocketAddr)],
        dial: DialFn,
    ) -> Result<(), TransportError> {
        let addrs: HashMap<NodeId, SocketAddr> =
            peers.iter().filter(|p| p.0 != self.node).copied().collect();
        let first = {
            let mut q = self.redial.q.lock().unwrap();
            let first = q.dial.is_none();
            q.dial = Some((addrs, dial));
            first
        };
        // With links on demand a lost link is made again by its next use: no thread here.
        if first && !self.is_on_demand() {
            let table = Arc::downgrade(self);
            crate::threads::spawn(self.node, "redial", move || redial_loop(table))?;
        }
        Ok(())
    }
}

/// The redial thread: waits for the next due attempt, makes it, reschedules or forgets the
/// peer. Ends when the table closes or is gone.
fn redial_loop<C: Link>(table: Weak<LinkTable<C>>) {
    loop {
        let Some(t) = table.upgrade() else { return };
        let redial = &t.redial;
        let mut q = redial.q.lock().unwrap();
        if q.closed {
            return;
        }
        let now = Instant::now();
        let next = q
            .due
            .iter()
            .min_by_key(|(_, a)| a.at)
            .map(|(p, a)| (*p, a.at));
        let peer = match next {
            Some((p, at)) if at <= now => p,
            other => {
                // Wait for the next due attempt or news, at most a second (so that a table
                // dropped without being closed is let go of soon).
                let wait = other.map_or(Duration::from_secs(1), |(_, at)| at - now);
                let _ = redial.cv.wait_timeout(q, wait.min(Duration::from_secs(1)));
                continue;
            }
        };
        // A hung node (the test hook of `Transport::freeze`) dials no one.
        if t.contains(peer) || t.is_closing() || t.is_frozen() {
            q.due.remove(&peer);
            continue;
        }
        let Some((addrs, dial)) = q.dial.as_ref() else {
            q.due.remove(&peer);
            continue;
        };
        let (addr, dial) = (addrs[&peer], dial.clone());
        drop(q);
        let result = dial(peer, addr, Instant::now() + ATTEMPT_TIMEOUT);
        let mut q = redial.q.lock().unwrap();
        let node = t.node;
        let Some(a) = q.due.get_mut(&peer) else {
            continue;
        };
        a.tries += 1;
        match result {
            Ok(()) => {
                info!(node, peer, tries = a.tries, "{} dialled again", t.label);
                q.due.remove(&peer);
            }
            Err(_) if t.contains(peer) => {
                q.due.remove(&peer);
            }
            Err(e) if Instant::now() >= a.until => {
                warn!(
                    node,
                    peer,
                    tries = a.tries,
                    "{} not dialled again, giving up: {e}",
                    t.label
                );
                q.due.remove(&peer);
            }
            Err(e) => {
                debug!(node, peer, tries = a.tries, "redial failed: {e}");
                a.backoff = (a.backoff * 2).min(MAX_BACKOFF);
                a.at = Instant::now() + a.backoff;
            }
        }
    }
}
