//! Connection setup: a connection's QP and buffers, the hello exchange of the dialler and
//! the acceptor, installing the link, and taking connections down.

use super::conn::{Conn, Layout, RemoteRing, RxState, TxState};
use super::hello::{Hello, HELLO_LEN, READY_BYTE};
use super::shared::{PrivateRing, Staged};
use super::{setup_err, Inner};
use crate::verbs::{MemoryRegion, QpEndpoint, QueuePair};
use phalanx_transport::{Arena, Event, Link, LinkState, NodeId, TransportError};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use tracing::info;

impl Inner {
    fn next_psn(&self) -> u32 {
        let x = self
            .psn_seed
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
        let x = (x ^ (x >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        ((x ^ (x >> 32)) & 0xff_ffff) as u32
    }

    /// Our hello: with a private ring, where the peer writes our blocks and credits; without
    /// one (addresses and keys 0), the peer sends its blocks to our shared receive queue.
    fn local_hello(&self, conn: &Conn, psn: u32) -> Hello {
        let (ring_addr, ring_rkey, notify_addr, notify_rkey) = match conn.bufs() {
            Some(b) => (
                b.addr() + conn.lay.ring,
                b.rkey(),
                b.addr() + conn.lay.notify_in,
                b.rkey(),
            ),
            None => (0, 0, 0, 0),
        };
        Hello {
            node: self.id,
            ep: QpEndpoint {
                qpn: conn.qp.qpn(),
                psn,
                lid: self.port.lid,
                gid: self.gid.gid,
                mtu: self.port.active_mtu,
            },
            ring_addr,
            ring_rkey,
            ring_blocks: conn.lay.n as u32,
            block_size: conn.lay.bsize as u32,
            notify_addr,
            notify_rkey,
        }
    }

    /// Creates a connection's QP (its receives from the shared receive queue) and, with
    /// `want_ring` and a place free in the ring pool, its private ring buffers; moves the QP
    /// to INIT.
    fn new_conn(&self, peer: NodeId, want_ring: bool) -> Result<Conn, TransportError> {
        let lay = Layout::new(self.cfg.ring_blocks, self.cfg.block_size);
        let ticket = if want_ring {
            self.pool.take_ring(lay.total as u64)
        } else {
            None
        };
        let ring = match ticket {
            Some(place) => {
                let mem = Arc::new(Arena::new(lay.total, false)?);
                self.place(&mem, "connection buffers");
                let mr = Arc::new(MemoryRegion::register(&self.pd, mem)?);
                let counters = &self.links.counters;
                counters.registrations.fetch_add(1, Ordering::Relaxed);
                Some(PrivateRing { mr, _place: place })
            }
            None => None,
        };
        let max_wr = self.ctx.max_qp_wr().max(16) as u64;
        let sq_depth = ((lay.n + self.cfg.write_window + 8) as u64).min(max_wr);
        let qp = QueuePair::new(&self.pd, &self.cq, sq_depth as u32, &self.pool.srq)?;
        qp.to_init(&self.rc)?;
        let now = self.links.now_ns();
        let conn = Conn {
            link: LinkState::new(peer),
            qp,
            ring,
            staged: Staged {
                pool: self.pool.clone(),
                held: Mutex::new(Default::default()),
            },
            lay,
            remote: RemoteRing::default(),
            sq_depth,
            tx: Mutex::new(TxState {
                next_seq: 0,
                next_op: 0,
                reserved: Vec::new(),
            }),
            rx: Mutex::new(RxState::default()),
            peer_consumed: AtomicU64::new(0),
            sent: AtomicU64::new(0),
            sq_inflight: AtomicU64::new(0),
            ops_done: AtomicU64::new(0),
            sig: Mutex::new(()),
            cv: Condvar::new(),
            last_recv: AtomicU64::new(now),
            last_send: AtomicU64::new(now),
            last_used: AtomicU64::new(now),
            peer_watches: AtomicU64::new(0),
            watching_since: AtomicU64::new(0),
            installed: AtomicBool::new(false),
            consuming_paused: AtomicBool::new(false),
            bye_due: AtomicBool::new(false),
        };
        Ok(conn)
    }

    /// Fills in the peer's ring descriptors (a link has rings both ways or none: without the
    /// peer's, ours is given back to the pool) and brings the QP to RTS.
    fn finish_conn(
        &self,
        mut conn: Conn,
        remote: &Hello,
        psn: u32,
    ) -> Result<Arc<Conn>, TransportError> {
        if remote.ring_blocks as usize != conn.lay.n || remote.block_size as usize != conn.lay.bsize
        {
            return Err(setup_err(format!(
                "ring geometry mismatch with peer {}: ours {}x{} bytes, theirs {}x{}",
                remote.node, conn.lay.n, conn.lay.bsize, remote.ring_blocks, remote.block_size
            )));
        }
        if !remote.offers_ring() {
            conn.ring = None;
        }
        conn.remote = RemoteRing {
            ring_addr: remote.ring_addr,
            ring_rkey: remote.ring_rkey,
            notify_addr: remote.notify_addr,
            notify_rkey: remote.notify_rkey,
        };
        conn.qp.to_rtr(&self.rc, self.port.active_mtu, &remote.ep)?;
        conn.qp.to_rts(&self.rc, psn)?;
        let conn = Arc::new(conn);
        self.by_qpn
            .lock()
            .unwrap()
            .insert(conn.qp.qpn(), conn.clone());
        Ok(conn)
    }

    /// Links `peer` at `addr`: connects and authenticates (retrying until `deadline`; see
    /// `phalanx_transport::auth`), exchanges hellos, goes RTR+RTS, sends the ready byte and
    /// installs.
    pub(super) fn dial(
        self: &Arc<Self>,
        peer: NodeId,
        addr: SocketAddr,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let mut s = self.links.dial_stream(peer, addr, deadline)?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(self.cfg.connect_timeout))?;
        s.set_write_timeout(Some(self.cfg.connect_timeout))?;
        let psn = self.next_psn();
        let conn = self.new_conn(peer, true)?;
        s.write_all(&self.local_hello(&conn, psn).encode())?;
        let mut b = [0u8; HELLO_LEN];
        s.read_exact(&mut b)?;
        let remote = Hello::decode(&b)?;
        if remote.node != peer {
            return Err(setup_err(format!(
                "dialed node {peer} at {addr} but node {} answered",
                remote.node
            )));
        }
        let conn = self.finish_conn(conn, &remote, psn)?;
        // We are RTR now, so the acceptor may start sending once it reads this.
        if let Err(e) = s.write_all(&[READY_BYTE]) {
            self.retire(&conn);
            return Err(e.into());
        }
        self.install(conn);
        let _ = s.shutdown(Shutdown::Both);
        Ok(())
    }

    /// The acceptor's side of the hello exchange, for a stream the link table has admitted
    /// from `peer` (authenticated, a member, no live link); errors go to the accept loop.
    /// Each read is bounded by the handshake timeout (at least 5 s: the dialler moves its QP
    /// to RTR and RTS in between, slow on an emulated device).
    pub(super) fn handshake(&self, mut s: TcpStream, peer: NodeId) -> Result<(), TransportError> {
        s.set_nodelay(true)?;
        let bound = self.cfg.auth.handshake_timeout.max(Duration::from_secs(5));
        s.set_read_timeout(Some(bound))?;
        s.set_write_timeout(Some(bound))?;
        let mut b = [0u8; HELLO_LEN];
        s.read_exact(&mut b)?;
        let remote = Hello::decode(&b)?;
        if remote.node != peer {
            return Err(TransportError::Malformed(format!(
                "node {peer} authenticated, but its hello says node {}",
                remote.node
            )));
        }
        let psn = self.next_psn();
        let conn = self.new_conn(peer, remote.offers_ring())?;
        let hello = self.local_hello(&conn, psn);
        let conn = self.finish_conn(conn, &remote, psn)?;
        // RTS before answering: the dialer may send as soon as it has our answer.
        let r = (|| -> Result<(), TransportError> {
            s.write_all(&hello.encode())?;
            let mut ready = [0u8; 1];
            s.read_exact(&mut ready)?;
            if ready[0] != READY_BYTE {
                return Err(TransportError::Malformed("bad ready byte".into()));
            }
            Ok(())
        })();
        match r {
            Ok(()) => {
                self.install(conn);
                Ok(())
            }
            Err(e) => {
                self.retire(&conn);
                Err(e)
            }
        }
    }

    /// Makes a connected QP the link to its peer (replacing an older one) and tells the node.
    fn install(&self, conn: Arc<Conn>) {
        let peer = conn.peer();
        let now = self.links.now_ns();
        conn.last_recv.store(now, Ordering::Relaxed);
        conn.last_send.store(now, Ordering::Relaxed);
        if let Some(old) = self.links.install(conn.clone()) {
            // A restarted peer replaces its old link: the old incarnation is dead even if we
            // had not noticed yet, and is reported down before the new link is reported up.
            self.forget(&old);
            self.links.report_down(peer, "peer restarted".into());
        }
        info!(node = self.id, peer, qpn = conn.qp.qpn(), "verbs link up");
        self.links.emit(Event::PeerUp { peer });
        // Only now may the progress thread deliver this link's messages (after PeerUp).
        conn.installed.store(true, Ordering::Release);
        self.wake_progress();
    }

    /// Forgets a connection's QP number: the progress thread ignores its work from now on.
    /// Its held receive blocks go back to the shared receive queue.
    fn forget(&self, conn: &Conn) {
        self.by_qpn.lock().unwrap().remove(&conn.qp.qpn());
        let held = std::mem::take(&mut conn.rx.lock().unwrap().held);
        for (b, _, _) in held {
            self.repost_block(b);
        }
    }

    /// Stops a connection without any event: QP to error, forgotten by the progress thread.
    fn retire(&self, conn: &Arc<Conn>) {
        self.forget(conn);
        conn.shut();
    }

    /// Drops a link after a failure and reports `PeerDown` once (if it was the current one).
    pub(super) fn fail_conn(&self, conn: &Arc<Conn>, reason: String) {
        self.forget(conn);
        self.links.fail(conn, reason);
    }
}
