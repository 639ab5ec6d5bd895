//! Links made on demand: with [`LinkTable::enable_on_demand`], a node forms no mesh at start;
//! the first operation towards a peer ([`LinkTable::link`]) dials it, and a node that never
//! talks to a peer keeps no link, no reader and no heartbeat for it.
//!
//! - **One dial per peer at a time.** Callers that find a dial (or an admission from that
//!   peer) in progress wait for its outcome instead of dialling again; dials to different
//!   peers run concurrently, each on the thread that needed the link, at most
//!   [`MAX_DIALS`] at once per node.
//! - **Crossed dials end in one link.** When two nodes dial each other at the same time, the
//!   dial of the lower id wins: its acceptor refuses the higher id's hello as busy while its
//!   own dial to that peer is in progress, and the higher id admits the lower id's hello
//!   whatever it is doing. The loser's dial sees the link its acceptor installed and stops.
//! - **A peer that cannot be reached is reported down once** (`PeerDown`, as for a failed
//!   link) and held off: lookups fail at once for a backoff (100 ms doubling to 5 s) before
//!   the next use dials again. A link installed from either side clears it.
//! - **Deadlines.** A dial gets [`DIAL_TIMEOUT`] (a peer already reported down, one
//!   attempt). Processes started one by one (a configured cluster) are given a start-up
//!   grace: until then a dial keeps trying (its peer may not listen yet). A peer that dies
//!   within the grace is noticed only when it ends.

use super::{Link, LinkTable};
use crate::{NodeId, TransportError};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::warn;

/// How long a dial keeps trying after the start-up grace: a refused connection on a network
/// that works means nobody listens there.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(2);

/// Most dials one node runs at once; further callers wait for a slot.
pub const MAX_DIALS: usize = 16;
/// First hold-off after a peer could not be reached; doubles up to [`MAX_HOLDOFF`].
pub const FIRST_HOLDOFF: Duration = Duration::from_millis(100);
pub const MAX_HOLDOFF: Duration = Duration::from_secs(5);

/// A peer reported down: no dial before `until`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Holdoff {
    until: Instant,
    backoff: Duration,
}

/// Link setups in progress and peers held off, under one lock so that admission and dialling
/// see each other.
#[derive(Default)]
pub(super) struct Setups {
    /// Peers between admission and install on the accepting side.
    pub(super) admitting: HashSet<NodeId>,
    /// Peers this node is dialling on demand.
    dialing: HashSet<NodeId>,
    /// Peers reported down and not linked since.
    down: HashMap<NodeId, Holdoff>,
    /// Peers whose link is closing for being idle and may still bring frames: no new link
    /// until it ends, so that the peer's frames keep their order.
    draining: HashSet<NodeId>,
}

/// Whether links are made on demand, and the dials' deadlines.
#[derive(Default)]
pub(super) struct OnDemand {
    enabled: AtomicBool,
    cfg: Mutex<Option<Deadlines>>,
}

#[derive(Clone, Copy)]
struct Deadlines {
    /// Until then a dial tries until then (peers may still be starting).
    startup: Instant,
    /// A dial's bound afterwards.
    dial: Duration,
}

impl OnDemand {
    pub(super) fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Acquire)
    }
}

impl<C: Link> LinkTable<C> {
    /// Makes links on demand from now on (see the module): until `startup_grace` from now,
    /// dials keep trying until then (the cluster is starting); afterwards a dial is bounded
    /// by `dial_timeout`. Needs the peers' addresses and the dial function, given by
    /// [`LinkTable::enable_redial`].
    pub fn enable_on_demand(&self, startup_grace: Duration, dial_timeout: Duration) {
        *self.on_demand.cfg.lock().unwrap() = Some(Deadlines {
            startup: Instant::now() + startup_grace,
            dial: dial_timeout,
        });
        self.on_demand.enabled.store(true, Ordering::Release);
    }

    /// Whether links are made on demand.
    pub fn is_on_demand(&self) -> bool {
        self.on_demand.enabled()
    }

    /// Whether `peer` is believed reachable: a live link, or (links on demand) none and no
    /// failure reported since it was last linked.
    pub fn is_up(&self, peer: NodeId) -> bool {
        if self.contains(peer) {
            return true;
        }
        self.on_demand.enabled() && !self.setups.lock().unwrap().down.contains_key(&peer)
    }

    /// Links open now and so far.
    pub fn link_counts(&self) -> crate::LinkCounts {
        let open = self.links.lock().unwrap().len();
        crate::LinkCounts {
            open,
            peak: self.links_peak.load(Ordering::Relaxed).max(open),
            idle_closed: self.counters.links_idle_closed.load(Ordering::Relaxed),
            heartbeats_sent: self.counters.heartbeats_sent.load(Ordering::Relaxed),
            readers_woken: self.counters.readers_woken.load(Ordering::Relaxed),
        }
    }

    /// The link to `peer`, dialled now if there is none and links are made on demand (waiting
    /// for a dial or admission of that peer already in progress). Errors as
    /// [`LinkTable::get`]; a peer that cannot be reached is reported down (once) and
    /// [`TransportError::PeerUnavailable`] returned, at once while it is held off.
    pub fn link(&self, peer: NodeId) -> Result<Arc<C>, TransportError> {
        match self.get(peer) {
            Err(TransportError::PeerUnavailable(_))
                if self.on_demand.enabled() && peer != self.node =>
            {
                self.dial_on_demand(peer)
            }
            r => r,
        }
    }

    /// [`LinkTable::link`] for threads that must not wait on the network: the link if there
    /// is one; Ok(None) if there is none but a blocking [`LinkTable::link`] could make one.
    pub fn link_nonblocking(&self, peer: NodeId) -> Result<Option<Arc<C>>, TransportError> {
        match self.get(peer) {
            Ok(c) => Ok(Some(c)),
            Err(TransportError::PeerUnavailable(_))
                if self.on_demand.enabled() && peer != self.node =>
            {
                let held = self
                    .setups
                    .lock()
                    .unwrap()
                    .down
                    .get(&peer)
                    .is_some_and(|h| h.until > Instant::now());
                if held {
                    Err(TransportError::PeerUnavailable(peer))
                } else {
                    Ok(None)
                }
            }
            Err(e) => Err(e),
        }
    }

    fn dial_on_demand(&self, peer: NodeId) -> Result<Arc<C>, TransportError> {
        let Some((addr, dial)) = self.redial.dialer(peer) else {
            return Err(TransportError::PeerUnavailable(peer));
        };
        let Some(d) = *self.on_demand.cfg.lock().unwrap() else {
            return Err(TransportError::PeerUnavailable(peer));
        };
        // How long to wait for a setup of someone else's (a dial, an admission, a drain).
        let give_up = (Instant::now() + d.dial * 2).max(d.startup) + self.dead_wait;
        let mut setups = self.setups.lock().unwrap();
        let reported = loop {
            if self.is_closing() {
                return Err(TransportError::Shutdown);
            }
            if Instant::now() >= give_up {
                return Err(TransportError::PeerUnavailable(peer));
            }
            if let Some(c) = self.links.lock().unwrap().get(&peer) {
                return Ok(c.clone());
            }
            let now = Instant::now();
            let held = setups.down.get(&peer).copied();
            if held.is_some_and(|h| h.until > now) {
                return Err(TransportError::PeerUnavailable(peer));
            }
            let busy = setups.dialing.contains(&peer)
                || setups.admitting.contains(&peer)
                || setups.draining.contains(&peer);
            if !busy && setups.dialing.len() < MAX_DIALS {
                setups.dialing.insert(peer);
                break held.is_some();
            }
            // Someone is linking this peer (or every dial slot is taken): wait for news. The
            // timeout is a backstop; every change notifies.
            setups = self
                .setup_cv
                .wait_timeout(setups, Duration::from_millis(50))
                .unwrap()
                .0;
        };
        drop(setups);
        let now = Instant::now();
        let deadline = if reported {
            now + Duration::from_secs(1)
        } else {
            (now + d.dial).max(d.startup)
        };
        let result = dial(peer, addr, deadline);
        let mut setups = self.setups.lock().unwrap();
        setups.dialing.remove(&peer);
        self.setup_cv.notify_all();
        if let Some(c) = self.links.lock().unwrap().get(&peer) {
            return Ok(c.clone());
        }
        let e = match result {
            Err(TransportError::Shutdown) => return Err(TransportError::Shutdown),
            Err(e) => e,
            // Linked, then lost already: its failure was reported.
            Ok(()) => return Err(TransportError::PeerUnavailable(peer)),
        };
        let first = !setups.down.contains_key(&peer);
        hold_off(&mut setups.down, peer);
        drop(setups);
        if first && !self.leaving.load(Ordering::Acquire) {
            warn!(node = self.node, peer, "{} not made: {e}", self.label);
            self.report_down(peer, format!("unreachable: {e}"));
        }
        Err(TransportError::PeerUnavailable(peer))
    }

    /// The acceptor's check before it admits `peer` (one setup per peer; crossed dials:
    /// the lower id's wins). True if admitted; the caller removes it from `admitting` when
    /// its setup ends.
    pub(super) fn may_admit(&self, peer: NodeId) -> bool {
        let mut setups = self.setups.lock().unwrap();
        if setups.admitting.contains(&peer) || setups.draining.contains(&peer) {
            return false;
        }
        if self.node < peer && setups.dialing.contains(&peer) {
            return false;
        }
        setups.admitting.insert(peer);
        true
    }

    /// Closes `link` for being idle, without an event: it leaves the table (the next use of
    /// its peer makes a new one), and is flagged retiring so nothing more is sent on it.
    /// `drain`: frames from the peer may still come on it (we asked to close it), so no new
    /// link to that peer is made or admitted until it ends. False if it was no longer current.
    pub fn retire(&self, link: &Arc<C>, drain: bool) -> bool {
        let peer = link.peer();
        let mut setups = self.setups.lock().unwrap();
        {
            let mut links = self.links.lock().unwrap();
            let current = links.get(&peer).is_some_and(|c| Arc::ptr_eq(c, link));
            if !current || link.is_failed() {
                return false;
            }
            links.remove(&peer);
            // Flagged before the table lets go: a failure racing with this sees it either
            // current (and reports it) or retiring (and ends its draining).
            link.state().retiring.store(true, Ordering::Release);
            self.changed.notify_all();
        }
        if drain {
            setups.draining.insert(peer);
        }
        self.counters
            .links_idle_closed
            .fetch_add(1, Ordering::Relaxed);
        drop(setups);
        self.setup_cv.notify_all();
        true
    }

    /// A retiring link to `peer` has ended.
    pub(super) fn drained(&self, peer: NodeId) {
        self.setups.lock().unwrap().draining.remove(&peer);
        self.setup_cv.notify_all();
    }

    /// A link to `peer` was installed: it is no longer held off.
    pub(super) fn linked(&self, peer: NodeId) {
        self.setups.lock().unwrap().down.remove(&peer);
        self.setup_cv.notify_all();
    }

    /// The current link to `peer` failed: with links on demand, the next use waits out a
    /// hold-off before it dials.
    pub(super) fn unlinked(&self, peer: NodeId) {
        let mut setups = self.setups.lock().unwrap();
        if self.on_demand.enabled() {
            hold_off(&mut setups.down, peer);
        }
        drop(setups);
        self.setup_cv.notify_all();
    }
}

fn hold_off(down: &mut HashMap<NodeId, Holdoff>, peer: NodeId) {
    let backoff = down
        .get(&peer)
        .map_or(FIRST_HOLDOFF, |h| (h.backoff * 2).min(MAX_HOLDOFF));
    down.insert(
        peer,
        Holdoff {
            until: Instant::now() + backoff,
            backoff,
        },
    );
}
