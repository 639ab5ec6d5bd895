//! The out-of-band TCP side of link setup: dialling with backoff, the accept loop, and the
//! admission of a peer (the [`crate::auth`] handshake, membership, one live link per peer).

use super::{Link, LinkTable};
use crate::auth::{self, Acceptor, AuthError};
use crate::{NodeId, TransportError};
use crossbeam_channel::{Receiver, Sender};
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{debug, error, warn};

/// Most handshakes an acceptor holds at once (all on its accept thread, each bounded by the
/// handshake timeout); connections beyond it are closed at once and counted refused.
pub const MAX_HANDSHAKES: usize = 256;

/// Most threads that admit and install authenticated peers at once (they end when idle).
pub const HELLO_THREADS: usize = 2;

/// How long an idle admission thread waits for work before it ends.
const HELLO_IDLE: Duration = Duration::from_millis(100);

/// The transport's part of setting up an admitted link.
type Handshake = Arc<dyn Fn(TcpStream, NodeId) -> Result<(), TransportError> + Send + Sync>;

/// A handshake in progress on the accept thread.
struct Pending {
    s: TcpStream,
    from: Option<SocketAddr>,
    auth: Acceptor,
}

/// An authenticated dialler waiting for admission.
type Job = (TcpStream, Option<SocketAddr>, auth::Admitted);

/// The threads that admit authenticated diallers and run the transport's setup: started
/// when work comes and none is idle, at most [`HELLO_THREADS`], ended when idle.
struct HelloPool<C: Link> {
    table: Arc<LinkTable<C>>,
    role: String,
    failed: &'static str,
    handshake: Handshake,
    tx: Sender<Job>,
    rx: Receiver<Job>,
    alive: Arc<AtomicUsize>,
}

impl<C: Link> HelloPool<C> {
    fn new(
        table: Arc<LinkTable<C>>,
        role: &str,
        failed: &'static str,
        handshake: Handshake,
    ) -> HelloPool<C> {
        let (tx, rx) = crossbeam_channel::unbounded();
        HelloPool {
            table,
            role: role.to_string(),
            failed,
            handshake,
            tx,
            rx,
            alive: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Queues an admitted dialler and makes sure a thread will take it.
    fn run(&self, s: TcpStream, from: Option<SocketAddr>, admitted: auth::Admitted) {
        if let Err(e) = s.set_nonblocking(false) {
            self.table.refused(from, AuthError::Io(e));
            return;
        }
        let _ = self.tx.send((s, from, admitted));
        // Pairs with the fence of a thread giving up: either it sees this job or we see it
        // gone and start another.
        std::sync::atomic::fence(Ordering::SeqCst);
        let claimed = self
            .alive
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < HELLO_THREADS).then_some(n + 1)
            })
            .is_ok();
        if !claimed {
            return; // every thread is running; they take the queue in turn
        }
        let (table, rx, alive) = (self.table.clone(), self.rx.clone(), self.alive.clone());
        let (failed, handshake) = (self.failed, self.handshake.clone());
        let spawned = crate::threads::spawn(table.node, &self.role, move || loop {
            match rx.recv_timeout(HELLO_IDLE) {
                Ok((s, from, admitted)) => {
                    table.admit_and_set_up(s, from, admitted, failed, &handshake)
                }
                Err(_) => {
                    alive.fetch_sub(1, Ordering::AcqRel);
                    std::sync::atomic::fence(Ordering::SeqCst);
                    // Work that came as we gave up is still taken (by us, if no one else).
                    let retake = !rx.is_empty()
                        && alive
                            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                                (n < HELLO_THREADS).then_some(n + 1)
                            })
                            .is_ok();
                    if !retake {
                        return;
                    }
                }
            }
        });
        if let Err(e) = spawned {
            self.alive.fetch_sub(1, Ordering::AcqRel);
            warn!(
                node = self.table.node,
                "cannot start an admission thread: {e}"
            );
        }
    }
}

/// Takes a peer out of the acceptor's admitting set when its setup ends, however it ends.
struct Admitting<'a, C: Link> {
    table: &'a LinkTable<C>,
    peer: NodeId,
}

impl<C: Link> Drop for Admitting<'_, C> {
    fn drop(&mut self) {
        self.table
            .setups
            .lock()
            .unwrap()
            .admitting
            .remove(&self.peer);
        self.table.setup_cv.notify_all();
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
                        // Crossed dials: the peer's link to us won (see `demand`).
                        Err(_) if self.on_demand.enabled() && self.contains(peer) => {
                            return Err(TransportError::PeerUnavailable(peer));
                        }
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
    /// see [`LinkTable::wake_accept_loop`], ends the loop). The [`crate::auth`] handshake of
    /// every accepted stream runs on this thread, event-driven (epoll), so a silent or
    /// trickling client costs no thread and stalls nobody: each handshake is bounded by the
    /// handshake timeout and at most [`MAX_HANDSHAKES`] are pending at once (beyond, a
    /// connection is closed at once and counted refused). A dialler that proved the secret
    /// is admitted (one setup per peer, and no live link for it: an old one gets twice the
    /// heartbeat timeout to be detected dead) and handed, with its id, to `handshake` on one
    /// of at most [`HELLO_THREADS`] threads named `phx-{hello_thread}-{node}`, which end when
    /// idle. A refused peer is counted in `hellos_refused` (and in `malformed_frames` if it
    /// sent garbage) and its connection closed. A `handshake` error counts as a malformed
    /// frame if the peer sent garbage, and is logged as `{failed}: {error}` unless the table
    /// is closed.
    pub fn accept_loop<F>(
        self: &Arc<Self>,
        listener: TcpListener,
        hello_thread: &str,
        failed: &'static str,
        handshake: F,
    ) where
        F: Fn(TcpStream, NodeId) -> Result<(), TransportError> + Send + Sync + 'static,
    {
        let handshake: Handshake = Arc::new(handshake);
        let pool = HelloPool::new(self.clone(), hello_thread, failed, handshake);
        if let Err(e) = self.handshakes_loop(listener, &pool) {
            if !self.is_closing() {
                error!(node = self.node, "accept loop ended: {e}");
            }
        }
    }

    fn handshakes_loop(
        self: &Arc<Self>,
        listener: TcpListener,
        pool: &HelloPool<C>,
    ) -> std::io::Result<()> {
        const LISTENER: u64 = u64::MAX;
        listener.set_nonblocking(true)?;
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
        epoll.add(&listener, EpollEvent::new(EpollFlags::EPOLLIN, LISTENER))?;
        let mut pending: HashMap<u64, Pending> = HashMap::new();
        let mut next_token = 0u64;
        let mut events = vec![EpollEvent::empty(); 64];
        while !self.is_closing() {
            let now = Instant::now();
            let wait = pending
                .values()
                .map(|p| p.auth.deadline.saturating_duration_since(now))
                .min()
                .unwrap_or(Duration::from_secs(1))
                .min(Duration::from_secs(1));
            let timeout =
                EpollTimeout::try_from(wait.as_millis() as u32 + 1).unwrap_or(EpollTimeout::NONE);
            let n = match epoll.wait(&mut events, timeout) {
                Ok(n) => n,
                Err(nix::errno::Errno::EINTR) => 0,
                Err(e) => return Err(e.into()),
            };
            for ev in &events[..n] {
                let token = ev.data();
                if token == LISTENER {
                    self.accept_pending(&listener, &epoll, &mut pending, &mut next_token);
                    continue;
                }
                let Some(p) = pending.get_mut(&token) else {
                    continue;
                };
                let outcome = p.auth.advance(&mut p.s);
                match outcome {
                    Ok(None) => {}
                    Ok(Some(admitted)) => {
                        let p = pending.remove(&token).expect("present");
                        let _ = epoll.delete(&p.s);
                        pool.run(p.s, p.from, admitted);
                    }
                    Err(e) => {
                        let p = pending.remove(&token).expect("present");
                        let _ = epoll.delete(&p.s);
                        self.refused(p.from, e);
                    }
                }
            }
            // Handshakes past their bound are refused.
            let now = Instant::now();
            let late: Vec<u64> = pending
                .iter()
                .filter(|(_, p)| p.auth.deadline <= now)
                .map(|(t, _)| *t)
                .collect();
            for t in late {
                let p = pending.remove(&t).expect("present");
                let _ = epoll.delete(&p.s);
                self.refused(p.from, AuthError::Timeout);
            }
        }
        Ok(())
    }

    /// Takes every connection the listener has and starts its handshake.
    fn accept_pending(
        &self,
        listener: &TcpListener,
        epoll: &Epoll,
        pending: &mut HashMap<u64, Pending>,
        next_token: &mut u64,
    ) {
        loop {
            let (s, from) = match listener.accept() {
                Ok(c) => c,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Out of descriptors, say: the connection stays queued; try again later.
                    warn!(node = self.node, "accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    return;
                }
            };
            if self.is_closing() {
                return;
            }
            if self.is_frozen() {
                // A hung node answers no handshake (the test hook of `Transport::freeze`):
                // the dialler's setup fails, and the node stays down for its peers.
                continue;
            }
            if pending.len() >= MAX_HANDSHAKES {
                self.refused(Some(from), AuthError::Overloaded);
                continue;
            }
            let token = *next_token;
            *next_token += 1;
            let added = s.set_nonblocking(true).and_then(|_| {
                epoll
                    .add(&s, EpollEvent::new(EpollFlags::EPOLLIN, token))
                    .map_err(std::io::Error::from)
            });
            if let Err(e) = added {
                warn!(
                    node = self.node,
                    ?from,
                    "cannot watch a new connection: {e}"
                );
                continue;
            }
            let auth = Acceptor::new(&self.auth, self.channel, self.node);
            pending.insert(
                token,
                Pending {
                    s,
                    from: Some(from),
                    auth,
                },
            );
        }
    }

    /// The acceptor's admission of one stream: the handshake, one setup per peer at a time,
    /// and no live link for that peer (waiting up to `dead_wait` for it to be detected dead).
    fn admit(&self, s: &mut TcpStream, a: auth::Admitted) -> Result<Admitting<'_, C>, AuthError> {
        let peer = a.peer;
        if !self.may_admit(peer) {
            return Err(a.refuse(s, AuthError::Busy(peer)));
        }
        let admitting = Admitting { table: self, peer };
        // With links on demand a dialler whose link exists is one that crossed ours (refused
        // at once: its dial sees our link and stops) or a restarted peer (it dials again
        // until its old link is detected dead, within its dial's bound).
        let wait = if self.on_demand.enabled() {
            Duration::ZERO
        } else {
            self.dead_wait
        };
        if !self.wait_vacant(peer, Instant::now() + wait) {
            return Err(a.refuse(s, AuthError::Busy(peer)));
        }
        a.accept(s)?;
        Ok(admitting)
    }

    /// Admits an authenticated dialler and runs the transport's setup on its stream.
    fn admit_and_set_up(
        &self,
        mut s: TcpStream,
        from: Option<SocketAddr>,
        admitted: auth::Admitted,
        failed: &str,
        handshake: &Handshake,
    ) {
        // Held until a failure is counted, so the peer sees the connection close only after.
        let hold = s.try_clone();
        match self.admit(&mut s, admitted) {
            Ok(admitting) => {
                let peer = admitting.peer;
                if let Err(e) = handshake(s, peer) {
                    self.setup_failed(from, failed, e);
                }
                drop(admitting);
            }
            Err(e) => self.refused(from, e),
        }
        drop(hold);
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
