//! One verbs connection: its QP, its private registered buffer (a link with a ring of its
//! own) and the layout of that buffer, the sender and receiver state, and the primitives
//! every send path uses (waiting on the link, the send lock, posting an RDMA write).

use super::{Inner, WR_APP};
use crate::verbs::{MemoryRegion, QueuePair};
use phalanx_transport::{Link, LinkState, TransportError};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Where the peer wants our blocks and credits.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct RemoteRing {
    pub(super) ring_addr: u64,
    pub(super) ring_rkey: u32,
    pub(super) notify_addr: u64,
    pub(super) notify_rkey: u32,
}

/// Offsets inside a connection's private registered buffer.
#[derive(Debug, Clone, Copy)]
pub(super) struct Layout {
    pub(super) n: usize,
    pub(super) bsize: usize,
    pub(super) ring: u64,
    pub(super) staging: u64,
    pub(super) notify_in: u64,
    pub(super) notify_out: u64,
    pub(super) total: usize,
}

impl Layout {
    pub(super) fn new(n: usize, bsize: usize) -> Layout {
        let ring_bytes = (n * bsize) as u64;
        let notify_in = 2 * ring_bytes;
        let total = (notify_in as usize + 128).next_multiple_of(4096);
        Layout {
            n,
            bsize,
            ring: 0,
            staging: ring_bytes,
            notify_in,
            notify_out: notify_in + 64,
            total,
        }
    }
}

/// Sender side state, under the connection's send lock.
pub(super) struct TxState {
    /// Blocks written so far (the next block's sequence number).
    pub(super) next_seq: u64,
    /// Application work requests posted so far (the next one's number).
    pub(super) next_op: u64,
    /// Shared-pool links: staging blocks taken ahead for the message being sent
    /// (`try_send_ctrl` takes every block it needs before sending, or sends nothing).
    pub(super) reserved: Vec<u32>,
}

/// Receiver side state, touched by the progress thread (and setup).
#[derive(Default)]
pub(super) struct RxState {
    /// Blocks consumed so far (the next expected block's sequence number).
    pub(super) next_seq: u64,
    /// Block write-with-immediate completions seen: blocks below this have fully landed.
    pub(super) imm_seen: u64,
    /// Consumed count last written to the peer's notification buffer.
    pub(super) returned: u64,
    pub(super) credit_in_flight: bool,
    /// A control message being reassembled from fragments.
    pub(super) partial: Option<(usize, Vec<u8>)>,
    /// Shared-pool links: received blocks not consumed yet (block, length, immediate), in
    /// order, while consuming is paused (test hook) or until the progress thread gets to them.
    pub(super) held: std::collections::VecDeque<(u32, u32, u32)>,
}

pub(super) struct Conn {
    pub(super) link: LinkState,
    /// Declared first: dropped (destroyed) before the buffers below, and it keeps every MR
    /// it posted from alive until then anyway.
    pub(super) qp: QueuePair,
    /// The private ring, staging copy and notification buffers of a link in the ring pool;
    /// `None` on a shared-pool link, whose blocks go through the node's SRQ and staging pool.
    pub(super) ring: Option<super::shared::PrivateRing>,
    /// Staging blocks of the shared pool held by sends in flight (after `qp`: given back
    /// once it is destroyed).
    pub(super) staged: super::shared::Staged,
    pub(super) lay: Layout,
    pub(super) remote: RemoteRing,
    pub(super) sq_depth: u64,
    pub(super) tx: Mutex<TxState>,
    pub(super) rx: Mutex<RxState>,
    /// Blocks of ours the peer has consumed (from its notifications).
    pub(super) peer_consumed: AtomicU64,
    /// Blocks of ours posted (incremented before posting).
    pub(super) sent: AtomicU64,
    /// Send work requests posted and not completed yet.
    pub(super) sq_inflight: AtomicU64,
    /// Application work requests completed (they complete in order on one QP).
    pub(super) ops_done: AtomicU64,
    /// Wakes senders waiting for credits, send-queue room or completions.
    pub(super) sig: Mutex<()>,
    pub(super) cv: Condvar,
    pub(super) last_recv: AtomicU64,
    pub(super) last_send: AtomicU64,
    /// ... of the last control message or data block sent or delivered (what idle means).
    pub(super) last_used: AtomicU64,
    /// ... of the last heartbeat received that asked for an answer (the peer watches this
    /// node; 0: never).
    pub(super) peer_watches: AtomicU64,
    /// ... of when this node began watching the peer (0: not watching): silence counts from
    /// then at the earliest.
    pub(super) watching_since: AtomicU64,
    pub(super) installed: AtomicBool,
    /// Test hook: the progress thread leaves this connection's ring alone (a peer that keeps
    /// its link alive but consumes nothing).
    pub(super) consuming_paused: AtomicBool,
    /// The peer closed the link for being idle: our `Bye` is due (queued once, whatever
    /// number of `Idle` blocks it sends).
    pub(super) bye_due: AtomicBool,
}

impl Conn {
    /// Whether the peer watches this node through this link: its last heartbeat that asked
    /// for an answer came less than `timeout` (ns) before `now`.
    pub(super) fn watched_by_peer(&self, now: u64, timeout: u64) -> bool {
        let asked = self.peer_watches.load(Ordering::Relaxed);
        asked != 0 && now.saturating_sub(asked) < timeout
    }

    /// The registration of the link's private ring buffers, if it has one.
    pub(super) fn bufs(&self) -> Option<&Arc<MemoryRegion>> {
        self.ring.as_ref().map(|r| &r.mr)
    }

    /// Whether the link's blocks go through the shared pools (no private ring).
    pub(super) fn is_shared(&self) -> bool {
        self.ring.is_none()
    }

    pub(super) fn notify(&self) {
        drop(self.sig.lock().unwrap());
        self.cv.notify_all();
    }

    pub(super) fn ring_block(&self, seq: u64) -> u64 {
        self.lay.ring + (seq % self.lay.n as u64) * self.lay.bsize as u64
    }

    pub(super) fn staging_block(&self, seq: u64) -> u64 {
        self.lay.staging + (seq % self.lay.n as u64) * self.lay.bsize as u64
    }
}

impl Link for Conn {
    fn state(&self) -> &LinkState {
        &self.link
    }

    /// Moves the QP to error: posted work flushes and nothing more is sent or received.
    fn stop(&self) {
        let _ = self.qp.to_error();
    }

    /// Wakes the senders waiting on the connection, so they see it failed.
    fn wake(&self) {
        self.notify();
    }
}

impl Inner {
    pub(super) fn peer_failed(&self, conn: &Conn) -> TransportError {
        if self.links.is_closing() {
            TransportError::Shutdown
        } else {
            TransportError::PeerFailed {
                peer: conn.peer(),
                reason: "link went down".into(),
            }
        }
    }

    /// Waits until `ready()` holds, the link dies, or `deadline` passes (then `Ok(false)`).
    pub(super) fn wait_for(
        &self,
        conn: &Conn,
        deadline: Option<Instant>,
        ready: impl Fn() -> bool,
    ) -> Result<bool, TransportError> {
        let mut g = conn.sig.lock().unwrap();
        loop {
            if conn.is_failed() {
                return Err(self.peer_failed(conn));
            }
            if ready() {
                return Ok(true);
            }
            let mut wait = Duration::from_millis(50);
            if let Some(d) = deadline {
                let now = Instant::now();
                if now >= d {
                    return Ok(false);
                }
                wait = wait.min(d - now);
            }
            g = conn.cv.wait_timeout(g, wait).unwrap().0;
        }
    }

    /// Takes the connection's send lock; fails if the link is down, or closing for being
    /// idle (`PeerUnavailable`: the caller takes the peer's next link).
    pub(super) fn lock_tx<'a>(
        &self,
        conn: &'a Conn,
    ) -> Result<MutexGuard<'a, TxState>, TransportError> {
        let g = conn.tx.lock().unwrap();
        if conn.is_failed() {
            return Err(self.peer_failed(conn));
        }
        if conn.is_retiring() {
            return Err(TransportError::PeerUnavailable(conn.peer()));
        }
        Ok(g)
    }

    /// Waits for send-queue room and posts one application work request with `post`
    /// (given its wr_id). Returns its op number; the op has completed once `ops_done`
    /// passes it.
    pub(super) fn post_app(
        &self,
        conn: &Conn,
        tx: &mut TxState,
        post: impl FnOnce(u64) -> Result<(), crate::verbs::VerbsError>,
    ) -> Result<u64, TransportError> {
        // One slot stays free for the progress thread's credit write.
        let limit = conn.sq_depth.saturating_sub(1).max(1);
        self.wait_for(conn, None, || {
            conn.sq_inflight.load(Ordering::Acquire) < limit
        })?;
        let op = tx.next_op;
        conn.sq_inflight.fetch_add(1, Ordering::AcqRel);
        if let Err(e) = post(WR_APP | op) {
            conn.sq_inflight.fetch_sub(1, Ordering::AcqRel);
            return Err(TransportError::PeerFailed {
                peer: conn.peer(),
                reason: e.to_string(),
            });
        }
        tx.next_op += 1;
        conn.last_send.store(self.links.now_ns(), Ordering::Relaxed);
        Ok(op)
    }

    /// Posts one application RDMA write, waiting for send-queue room. Returns its op number.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn post_app_write(
        &self,
        conn: &Conn,
        tx: &mut TxState,
        mr: &Arc<MemoryRegion>,
        offset: u64,
        len: u32,
        raddr: u64,
        rkey: u32,
        imm: Option<u32>,
    ) -> Result<u64, TransportError> {
        self.post_app(conn, tx, |wr_id| {
            conn.qp.post_write(wr_id, mr, offset, len, raddr, rkey, imm)
        })
    }
}
