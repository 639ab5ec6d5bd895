//! The link bookkeeping every transport shares: a table of one live link per peer
//! ([`LinkTable`]), the event outlet ([`EventSink`]), the counters ([`Counters`]), and the
//! out-of-band TCP plumbing around them (dial with backoff, the accept loop, forming the
//! mesh).
//!
//! A transport plugs its connection type in through [`Link`]; what happens on the wire (the
//! hello, frames or verbs) stays with the transport, passed in as closures where the shared
//! code needs it. The methods every transport handle answers the same way from its table
//! are written once, as the macros [`crate::transport_link_methods`] and
//! [`crate::connect_methods`].

mod counters;
mod delegate;
mod demand;
mod events;
mod idle;
mod mesh;
mod net;
mod redial;
#[cfg(test)]
mod tests;

pub use counters::Counters;
pub use demand::DIAL_TIMEOUT;
pub use events::{EventReceiver, EventSink};
pub use idle::IdleKeep;
pub use redial::DialFn;

use crate::auth::{AuthConfig, Channel};
use crate::{Event, NodeId, TransportError, PEER_LEFT};
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// What every link holds whatever its transport: the peer at the other end and the failed
/// flag, which starts false and, once set, is never cleared (a link does not come back; a
/// new one replaces it).
#[derive(Debug)]
pub struct LinkState {
    peer: NodeId,
    failed: AtomicBool,
    /// Closed for being idle (see `demand`): nothing more is sent on it, and its end is no
    /// failure.
    retiring: AtomicBool,
}

impl LinkState {
    /// The state of a new, live link to `peer`.
    pub fn new(peer: NodeId) -> LinkState {
        LinkState {
            peer,
            failed: AtomicBool::new(false),
            retiring: AtomicBool::new(false),
        }
    }
}

/// A transport's connection to one peer, as the [`LinkTable`] handles it.
///
/// Contract: [`Link::stop`] and [`Link::wake`] must be idempotent and must not block on the
/// network.
pub trait Link: Send + Sync + 'static {
    /// The link's [`LinkState`].
    fn state(&self) -> &LinkState;

    /// Stops the link's I/O at once, so that its threads and pending operations end
    /// (shut the socket down, move the queue pair to error).
    fn stop(&self);

    /// Wakes the threads waiting on the link so they see it failed. Default: nothing.
    fn wake(&self) {}

    /// The node at the other end.
    fn peer(&self) -> NodeId {
        self.state().peer
    }

    /// Whether the link is flagged failed.
    fn is_failed(&self) -> bool {
        self.state().failed.load(Ordering::Acquire)
    }

    /// Whether the link is being closed for being idle: nothing may be sent on it any more
    /// (a sender takes the next link of its peer instead).
    fn is_retiring(&self) -> bool {
        self.state().retiring.load(Ordering::Acquire)
    }

    /// Flags the link failed; true if this call did it (it was alive until now).
    fn mark_failed(&self) -> bool {
        !self.state().failed.swap(true, Ordering::AcqRel)
    }

    /// Ends the link without any event: flags it failed, stops it and wakes its waiters.
    fn shut(&self) {
        self.mark_failed();
        self.stop();
        self.wake();
    }
}

/// Longest a new link's `PeerUp` waits for the `PeerDown` of the link it replaces.
const DOWN_TOLD_WAIT: Duration = Duration::from_millis(500);

/// The links of one node, one per peer, with the node's event sink and counters.
///
/// Contract:
/// - [`LinkTable::install`] makes a link the current one of its peer; a link it replaces is
///   shut without an event (the transport decides whether to report it).
/// - [`LinkTable::fail`] acts once per link: the first call shuts it, removes it if it is
///   still current and, unless the node is leaving, counts and emits exactly one
///   `PeerDown`; later calls, and calls for a replaced link, emit nothing.
/// - Lookups ([`LinkTable::get`]) see only current links: a failed link is gone from the
///   table by the time its `PeerDown` is emitted; once the table is closed every lookup
///   fails with [`TransportError::Shutdown`].
/// - Waiters on [`LinkTable::connect_mesh`] are woken by every change.
/// - Link setup (see `net`): every stream [`LinkTable::dial_stream`] returns and every
///   stream the accept loop hands to the transport has passed the [`crate::auth`]
///   handshake under the table's [`AuthConfig`], from a member; the acceptor admits a peer
///   that has a live link only once that link is detected dead (within twice the heartbeat
///   timeout), and one handshake per peer at a time.
pub struct LinkTable<C> {
    node: NodeId,
    /// Names the links in log lines ("link", "verbs link").
    label: &'static str,
    listen_addr: SocketAddr,
    epoch: Instant,
    links: Mutex<HashMap<NodeId, Arc<C>>>,
    changed: Condvar,
    /// Peers whose failed link was removed and whose `PeerDown` is not emitted yet: a new
    /// link to such a peer waits for it (`down_told`), so that its `PeerUp` comes after.
    downs_pending: Mutex<HashSet<NodeId>>,
    down_told: Condvar,
    /// Set when shutdown starts: failures seen from then on are ours, not reported.
    leaving: AtomicBool,
    /// Set once the links are torn down: lookups fail, the transport's threads stop.
    closing: AtomicBool,
    /// The node went silent (test hook, see `Transport::freeze`): nothing is delivered.
    frozen: AtomicBool,
    /// Where the transport's events go (the table emits `PeerDown` there itself).
    pub events: EventSink,
    /// The transport's counters (the table counts `peers_down`, malformed and refused
    /// hellos).
    pub counters: Counters,
    /// Who may link to this node, and the handshake's bound.
    auth: AuthConfig,
    channel: Channel,
    /// How long the acceptor waits for a peer's live link to be detected dead before it
    /// refuses a new link from that peer.
    dead_wait: Duration,
    /// Links being set up (admitted, dialled) and peers held off after a failure.
    setups: Mutex<demand::Setups>,
    /// The most links open at once.
    links_peak: AtomicUsize,
    /// Woken when `setups` or the links change.
    setup_cv: Condvar,
    /// Links made on first use instead of as a full mesh at start (see `demand`).
    on_demand: demand::OnDemand,
    /// Lost peers to dial again (see `redial`).
    redial: redial::Redial,
}

impl<C: Link> LinkTable<C> {
    /// An empty table for node `node`, whose out-of-band listener is bound to `listen_addr`.
    pub fn new(node: NodeId, listen_addr: SocketAddr, label: &'static str) -> LinkTable<C> {
        LinkTable {
            node,
            label,
            listen_addr,
            epoch: Instant::now(),
            links: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
            downs_pending: Mutex::new(HashSet::new()),
            down_told: Condvar::new(),
            leaving: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            frozen: AtomicBool::new(false),
            events: EventSink::default(),
            counters: Counters::default(),
            auth: AuthConfig::default(),
            channel: Channel::Tcp,
            dead_wait: Duration::from_secs(2),
            setups: Mutex::new(demand::Setups::default()),
            setup_cv: Condvar::new(),
            links_peak: AtomicUsize::new(0),
            on_demand: demand::OnDemand::default(),
            redial: redial::Redial::default(),
        }
    }

    /// Sets who may link (`auth`), the channel the handshakes are bound to, and the
    /// transport's heartbeat timeout (a live link is proven dead within twice that).
    pub fn with_auth(
        mut self,
        auth: AuthConfig,
        channel: Channel,
        heartbeat_timeout: Duration,
    ) -> LinkTable<C> {
        if auth.secret.is_none() {
            warn!(
                node = self.node,
                "no cluster secret: {} peers are not authenticated", self.label
            );
        }
        self.auth = auth;
        self.channel = channel;
        self.dead_wait = heartbeat_timeout.saturating_mul(2) + Duration::from_millis(100);
        self
    }

    /// This node's id.
    pub fn node(&self) -> NodeId {
        self.node
    }

    /// The address of the node's listener.
    pub fn listen_addr(&self) -> SocketAddr {
        self.listen_addr
    }

    /// Nanoseconds since the table was made: the clock of heartbeats and silence.
    pub fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Emits `ev` through the table's [`EventSink`].
    pub fn emit(&self, ev: Event) {
        if !self.is_frozen() {
            self.events.emit(ev);
        }
    }

    /// Test hook: the node goes silent (see `Transport::freeze`).
    pub fn freeze(&self) {
        self.frozen.store(true, Ordering::Release);
    }

    /// Whether the node went silent: its transport sends nothing and delivers nothing.
    pub fn is_frozen(&self) -> bool {
        self.frozen.load(Ordering::Relaxed)
    }

    /// Whether the table is closed (see [`LinkTable::close`]).
    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// Starts leaving: from now on link failures are not reported. True on the first call.
    pub fn leave(&self) -> bool {
        !self.leaving.swap(true, Ordering::AcqRel)
    }

    /// Closes the table (leaving it first): lookups fail from now on. The first call takes
    /// every link out and returns them for the transport to shut; later calls return None.
    pub fn close(&self) -> Option<Vec<Arc<C>>> {
        self.leaving.store(true, Ordering::Release);
        if self.closing.swap(true, Ordering::AcqRel) {
            return None;
        }
        self.redial.close();
        let links: Vec<Arc<C>> = self.links.lock().unwrap().drain().map(|(_, c)| c).collect();
        self.changed.notify_all();
        Some(links)
    }

    /// The current link to `peer`. Errors: [`TransportError::Shutdown`] once closed,
    /// [`TransportError::PeerUnavailable`] if there is none (never linked, or failed).
    pub fn get(&self, peer: NodeId) -> Result<Arc<C>, TransportError> {
        if self.is_closing() {
            return Err(TransportError::Shutdown);
        }
        self.links
            .lock()
            .unwrap()
            .get(&peer)
            .cloned()
            .ok_or(TransportError::PeerUnavailable(peer))
    }

    /// Whether a current link to `peer` exists.
    pub fn contains(&self, peer: NodeId) -> bool {
        self.links.lock().unwrap().contains_key(&peer)
    }

    /// The current links, for loops that visit each (heartbeats).
    pub fn snapshot(&self) -> Vec<Arc<C>> {
        self.links.lock().unwrap().values().cloned().collect()
    }

    /// Makes `link` the current link of its peer and wakes the mesh waiters. A link it
    /// replaces (the peer restarted and dialled again) is shut, with no event, and returned.
    pub fn install(&self, link: Arc<C>) -> Option<Arc<C>> {
        let peer = link.peer();
        let old = {
            let mut links = self.links.lock().unwrap();
            let old = links.insert(peer, link);
            self.links_peak.fetch_max(links.len(), Ordering::Relaxed);
            self.changed.notify_all();
            old
        };
        self.linked(peer);
        if let Some(old) = &old {
            old.shut();
        }
        // The old link failed just before (its `PeerDown` on its way on another thread):
        // the caller's `PeerUp` must come after it. Bounded, should that thread be the one
        // that waits (a handler that links the peer again as it hears of its death).
        let deadline = Instant::now() + DOWN_TOLD_WAIT;
        let mut pending = self.downs_pending.lock().unwrap();
        while pending.contains(&peer) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            pending = self.down_told.wait_timeout(pending, left).unwrap().0;
        }
        old
    }

    /// Fails `link` once (see the type's contract): shuts it, removes it if current and
    /// reports `PeerDown { reason }` unless leaving. True if this call failed it.
    pub fn fail(&self, link: &Arc<C>, reason: String) -> bool {
        if !link.mark_failed() {
            return false;
        }
        link.stop();
        let peer = link.peer();
        let reported = !self.leaving.load(Ordering::Acquire);
        let current = {
            let mut links = self.links.lock().unwrap();
            let current = links.get(&peer).is_some_and(|c| Arc::ptr_eq(c, link));
            if current {
                links.remove(&peer);
                self.changed.notify_all();
                if reported {
                    // Before the links are unlocked: a new link installed from now on
                    // waits for this `PeerDown`.
                    self.downs_pending.lock().unwrap().insert(peer);
                }
            }
            current
        };
        link.wake();
        if link.is_retiring() {
            self.drained(peer);
        } else if current {
            self.unlinked(peer);
        }
        if current && reported {
            let (node, label) = (self.node, self.label);
            if reason == PEER_LEFT {
                info!(node, peer, "{label} closed: {reason}");
            } else {
                warn!(node, peer, "{label} down: {reason}");
                // The side that dialled it when the mesh formed dials it again (with links on
                // demand, the next use does).
                if peer < node && !self.on_demand.enabled() {
                    self.redial.schedule(peer);
                }
            }
            self.report_down(peer, reason);
            self.downs_pending.lock().unwrap().remove(&peer);
            self.down_told.notify_all();
        }
        true
    }

    /// Counts a lost peer and emits its `PeerDown`.
    pub fn report_down(&self, peer: NodeId, reason: String) {
        self.counters.peers_down.fetch_add(1, Ordering::Relaxed);
        self.emit(Event::PeerDown { peer, reason });
    }
}
