//! The out-of-band TCP side of link setup: dialling with backoff, the accept loop, and the
//! admission of a peer (the [`crate::auth`] handshake, membership, one live link per peer).

use super::{Link, LinkTable};
use crate::auth::{self, AuthError};
use crate::{NodeId, TransportError};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{debug, error, warn};

/// Most handshakes an acceptor runs at once (each on its own short-lived thread, each bounded
/// by the handshake timeout); connections beyond it are closed at once and counted refused.
pub const MAX_HANDSHAKES: usize = 128;

/// Takes a peer out of the acceptor's admitting set when its setup ends, however it ends.
struct Admitting<'a, C: Link> {
    table: &'a LinkTable<C>,
    peer: NodeId,
}

impl<C: Link> Drop for Admitting<'_, C> {
    fn drop(&mut self) {
        self.table.admitting.lock().unwrap().remove(&self.peer);
    }
}

/// Counts a handshake in progress until dropped.
struct InFlight<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl<C: Link> LinkTable<C> {
    /// Opens a TCP stream to `peer` at `addr` and runs the dialler's side of the
    /// [`crate::auth`] handshake on it, retrying refused or timed-out connects (1 s each) and
    /// transient handshake failures (the peer busy or overloaded, the connection broken) with
    /// a backoff from 5 ms doubling up to 200 ms until `deadline`. The stream returned is
    /// authenticated and accepted by the peer. Errors: [`TransportError::Shutdown`] once the
    /// table is closed, [`TransportError::Setup`] when the deadline passes,
    /// [`TransportError::Auth`] when the peer refuses for good or cannot prove the secret.
    pub fn dial_stream(
        &self,
        peer: NodeId,
        addr: SocketAddr,
        deadline: Instant,
    ) -> Result<TcpStream, TransportError> {
        let mut backoff = Duration::from_millis(5);
        let extra_wait = self.dead_wait + Duration::from_millis(500);
        loop {
            if self.is_closing() {
                return Err(TransportError::Shutdown);
            }
            let e = match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                Ok(mut s) => {
                    match auth::dial(
                        &mut s,
                        &self.auth,
                        self.channel,
                        self.node,
                        peer,
                        extra_wait,
                    ) {
                        Ok(()) => return Ok(s),
                        Err(e) if e.is_transient() => TransportError::Auth(e),
                        Err(e) => {
                            return Err(TransportError::Auth(e));
                        }
                    }
                }
                Err(e) => e.into(),
            };
            if Instant::now() >= deadline {
                return Err(TransportError::Setup(format!(
                    "node {}: cannot reach peer {peer} at {addr}: {e}",
                    self.node
                )));
            }
            debug!(node = self.node, peer, %addr, "dial failed, retrying: {e}");
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_millis(200));
        }
    }

    /// Accepts peers on `listener` until the table is closed (then one more connection,
    /// see [`LinkTable::wake_accept_loop`], ends the loop). Each accepted stream is admitted
    /// on its own thread, named `{hello_thread}-{node}`, so a silent client cannot stall
    /// accepts: the [`crate::auth`] handshake (bounded by the handshake timeout), membership,
    /// and no live link for that peer (an old one gets twice the heartbeat timeout to be
    /// detected dead); then `handshake` gets the stream and the authenticated peer id. At most
    /// [`MAX_HANDSHAKES`] run at once. A refused peer is counted in `hellos_refused` (and in
    /// `malformed_frames` if it sent garbage) and its connection closed. A `handshake` error
    /// counts as a malformed frame if the peer sent garbage, and is logged as
    /// `{failed}: {error}` unless the table is closed.
    pub fn accept_loop<F>(
        self: &Arc<Self>,
        listener: TcpListener,
        hello_thread: &str,
        failed: &'static str,
        handshake: F,
    ) where
        F: Fn(TcpStream, NodeId) -> Result<(), TransportError> + Send + Sync + 'static,
    {
        let handshake = Arc::new(handshake);
        for s in listener.incoming() {
            if self.is_closing() {
                break;
            }
            let s = match s {
                Ok(s) => s,
                Err(e) => {
                    warn!(node = self.node, "accept failed: {e}");
                    continue;
                }
            };
            if self.handshakes.fetch_add(1, Ordering::AcqRel) >= MAX_HANDSHAKES {
                self.handshakes.fetch_sub(1, Ordering::AcqRel);
                self.refused(s.peer_addr().ok(), AuthError::Overloaded);
                continue;
            }
            let (me, handshake) = (self.clone(), handshake.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("{hello_thread}-{}", self.node))
                .spawn(move || {
                    let in_flight = InFlight(&me.handshakes);
                    let mut s = s;
                    let from = s.peer_addr().ok();
                    // Held until the failure is counted, so the peer sees the connection close
                    // only after that.
                    let hold = s.try_clone();
                    match me.admit(&mut s) {
                        Ok(admitting) => {
                            let peer = admitting.peer;
                            if let Err(e) = handshake(s, peer) {
                                me.setup_failed(from, failed, e);
                            }
                            drop(admitting);
                        }
                        Err(e) => me.refused(from, e),
                    }
                    drop(hold);
                    drop(in_flight);
                });
            if let Err(e) = spawned {
                // The closure (and its InFlight guard) never ran.
                self.handshakes.fetch_sub(1, Ordering::AcqRel);
                warn!(node = self.node, "cannot start a handshake thread: {e}");
            }
        }
    }

    /// The acceptor's admission of one stream: the handshake, one setup per peer at a time,
    /// and no live link for that peer (waiting up to `dead_wait` for it to be detected dead).
    fn admit(&self, s: &mut TcpStream) -> Result<Admitting<'_, C>, AuthError> {
        let a = auth::accept(s, &self.auth, self.channel, self.node)?;
        let peer = a.peer;
        if !self.admitting.lock().unwrap().insert(peer) {
            return Err(a.refuse(s, AuthError::Busy(peer)));
        }
        let admitting = Admitting { table: self, peer };
        if !self.wait_vacant(peer, Instant::now() + self.dead_wait) {
            return Err(a.refuse(s, AuthError::Busy(peer)));
        }
        a.accept(s)?;
        Ok(admitting)
    }

    /// Waits until `peer` has no live link or `deadline` passes; true if it has none.
    fn wait_vacant(&self, peer: NodeId, deadline: Instant) -> bool {
        let mut links = self.links.lock().unwrap();
        while links.get(&peer).is_some_and(|c| !c.is_failed()) {
            let now = Instant::now();
            if self.is_closing() || now >= deadline {
                return false;
            }
            links = self.changed.wait_timeout(links, deadline - now).unwrap().0;
        }
        true
    }

    fn refused(&self, from: Option<SocketAddr>, e: AuthError) {
        let n = self.counters.hellos_refused.fetch_add(1, Ordering::Relaxed) + 1;
        if matches!(e, AuthError::Malformed(_)) {
            self.counters
                .malformed_frames
                .fetch_add(1, Ordering::Relaxed);
        }
        // A flood of refusals logs the 1st, 2nd, 4th, 8th...: a bounded number of lines.
        if !self.is_closing() && n.is_power_of_two() {
            warn!(node = self.node, ?from, refused = n, "link refused: {e}");
        }
    }

    fn setup_failed(&self, from: Option<SocketAddr>, failed: &str, e: TransportError) {
        if matches!(
            e,
            TransportError::Malformed(_) | TransportError::MessageTooLarge { .. }
        ) {
            self.counters
                .malformed_frames
                .fetch_add(1, Ordering::Relaxed);
        }
        if !self.is_closing() {
            error!(node = self.node, ?from, "{failed}: {e}");
        }
    }

    /// Wakes the accept loop with a connection to ourselves so it sees the table closed.
    pub fn wake_accept_loop(&self) {
        let _ = TcpStream::connect_timeout(&self.listen_addr, Duration::from_millis(200));
    }
}
