//! The verbs transport: RC queue pairs set up over an out-of-band TCP exchange, an eager
//! ring of bottom-filled blocks per connection with credits returned through notification
//! buffers, and rendezvous RDMA writes straight between the registered arenas.
//!
//! Per connection and direction (see `README.md` for a picture):
//! - the receiver owns a ring of `ring_blocks` blocks of `block_size` bytes; the sender
//!   keeps a staging copy of the same geometry in its own registered buffer, composes
//!   message `seq` in staging slot `seq % n` and RDMA-writes it, bottom-filled, into the
//!   receiver's block `seq % n` with write-with-immediate (immediate = `seq`), so the
//!   receiver's completion channel wakes it up; it then validates the block by its counter
//!   bytes (header and trailer) and checksum ([`crate::block`]);
//! - the receiver RDMA-writes its running count of consumed blocks (16 bytes: count and its
//!   complement) into the sender's notification buffer, again with an immediate (flagged)
//!   as a wake-up; the sender writes block `seq` only once `seq - consumed < n`;
//! - data writes below `rendezvous_threshold` ride the blocks (copy in, copy out); above
//!   it they go as a window of RDMA writes of `chunk_size` bytes from the local arena to the
//!   receiver's `RemoteRegion` addr/rkey, each followed on the same QP by a `DataDone` block
//!   that RC ordering delivers after the chunk's bytes: no copy, no registration.

use crate::block::{self, BlockState, Header, Kind, FLAG_FIRST, FLAG_LAST};
use crate::verbs::{
    CompletionQueue, Context, GidInfo, MemoryRegion, PortInfo, ProtectionDomain, QpEndpoint,
    QueuePair, RcParams, WorkCompletion, LINK_LAYER_ETHERNET,
};
use crossbeam_channel::{Receiver, Sender};
use phalanx_transport::{
    Arena, Event, EventHandler, NodeId, RemoteRegion, StreamId, Transport, TransportError,
    TransportStats, MAX_CTRL_LEN, PEER_LEFT,
};
use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tracing::{debug, error, info, warn};

/// Settings of the verbs transport.
#[derive(Debug, Clone)]
pub struct RdmaConfig {
    /// RDMA device name (e.g. "rxe0", "mlx5_0"); `None` takes the first device.
    pub device: Option<String>,
    /// Port number on the device (1-based).
    pub port: u8,
    /// GID table index; `None` picks an IPv4-mapped GID (RoCE v2 preferred), or index 0 on
    /// InfiniBand.
    pub gid_index: Option<u8>,
    /// Bytes per eager block (header 48 + trailer 5 included). Both peers must agree.
    pub block_size: usize,
    /// Blocks per ring (per connection and direction). Both peers must agree.
    pub ring_blocks: usize,
    /// Data writes of at least this many bytes go by rendezvous (zero copy); smaller ones
    /// ride the eager blocks.
    pub rendezvous_threshold: u64,
    /// Bytes per RDMA write of the rendezvous path.
    pub chunk_size: usize,
    /// Rendezvous chunk writes in flight per `write` call.
    pub write_window: usize,
    /// A peer silent for this long is reported down; heartbeats go out at a quarter of it.
    pub heartbeat_timeout: Duration,
    /// How long `connect` waits for the whole mesh to come up.
    pub connect_timeout: Duration,
    /// Spin on the CQ and the rings instead of sleeping on the completion channel.
    pub busy_poll: bool,
    /// Completion queue entries (shared by all connections).
    pub cq_entries: usize,
    /// Local ACK timeout exponent of the QPs (4.096 µs × 2^x).
    pub qp_timeout: u8,
    /// Transport retries before a QP goes to error.
    pub retry_cnt: u8,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            device: None,
            port: 1,
            gid_index: None,
            block_size: 8192,
            ring_blocks: 64,
            rendezvous_threshold: DEFAULT_RENDEZVOUS_THRESHOLD,
            chunk_size: 1 << 20,
            write_window: 8,
            heartbeat_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(30),
            busy_poll: false,
            cq_entries: 16384,
            qp_timeout: 14,
            retry_cnt: 7,
        }
    }
}

/// Default eager/rendezvous boundary (see README: measured on rxe in the test VM).
pub const DEFAULT_RENDEZVOUS_THRESHOLD: u64 = 8 << 10;

/// Immediate values with this bit are credit notifications; others carry a block seq.
const IMM_CREDIT: u32 = 1 << 31;
const IMM_MASK: u32 = IMM_CREDIT - 1;
/// wr_id tags of send work requests.
const WR_APP: u64 = 1 << 62;
const WR_CREDIT: u64 = 2 << 62;
const WR_TAG: u64 = 3 << 62;

const HELLO_MAGIC: u32 = 0x3152_5850; // "PXR1"
const HELLO_LEN: usize = 80;
const READY_BYTE: u8 = 0xA5;

#[derive(Default)]
struct Counters {
    ctrl_sent: AtomicU64,
    ctrl_received: AtomicU64,
    data_bytes_sent: AtomicU64,
    data_bytes_received: AtomicU64,
    payload_bytes_copied: AtomicU64,
    registrations: AtomicU64,
    peers_down: AtomicU64,
    malformed_frames: AtomicU64,
}

/// What one side sends the other over TCP to set up a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Hello {
    node: NodeId,
    ep: QpEndpoint,
    ring_addr: u64,
    ring_rkey: u32,
    ring_blocks: u32,
    block_size: u32,
    notify_addr: u64,
    notify_rkey: u32,
}

impl Hello {
    fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&self.node.to_le_bytes());
        b[8..12].copy_from_slice(&self.ep.qpn.to_le_bytes());
        b[12..16].copy_from_slice(&self.ep.psn.to_le_bytes());
        b[16..18].copy_from_slice(&self.ep.lid.to_le_bytes());
        b[18] = self.ep.mtu as u8;
        b[20..36].copy_from_slice(&self.ep.gid);
        b[36..44].copy_from_slice(&self.ring_addr.to_le_bytes());
        b[44..48].copy_from_slice(&self.ring_rkey.to_le_bytes());
        b[48..52].copy_from_slice(&self.ring_blocks.to_le_bytes());
        b[52..56].copy_from_slice(&self.block_size.to_le_bytes());
        b[56..64].copy_from_slice(&self.notify_addr.to_le_bytes());
        b[64..68].copy_from_slice(&self.notify_rkey.to_le_bytes());
        b
    }

    fn decode(b: &[u8; HELLO_LEN]) -> Result<Hello, TransportError> {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8"));
        if u32_at(0) != HELLO_MAGIC {
            return Err(TransportError::Malformed("bad hello magic".into()));
        }
        Ok(Hello {
            node: u32_at(4),
            ep: QpEndpoint {
                qpn: u32_at(8),
                psn: u32_at(12),
                lid: u16::from_le_bytes([b[16], b[17]]),
                mtu: b[18] as u32,
                gid: b[20..36].try_into().expect("16"),
            },
            ring_addr: u64_at(36),
            ring_rkey: u32_at(44),
            ring_blocks: u32_at(48),
            block_size: u32_at(52),
            notify_addr: u64_at(56),
            notify_rkey: u32_at(64),
        })
    }
}

/// Where the peer wants our blocks and credits.
#[derive(Debug, Clone, Copy, Default)]
struct RemoteRing {
    ring_addr: u64,
    ring_rkey: u32,
    notify_addr: u64,
    notify_rkey: u32,
}

/// Offsets inside a connection's private registered buffer.
#[derive(Debug, Clone, Copy)]
struct Layout {
    n: usize,
    bsize: usize,
    ring: u64,
    staging: u64,
    notify_in: u64,
    notify_out: u64,
    total: usize,
}

impl Layout {
    fn new(n: usize, bsize: usize) -> Layout {
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
struct TxState {
    /// Blocks written so far (the next block's sequence number).
    next_seq: u64,
    /// Application work requests posted so far (the next one's number).
    next_op: u64,
}

/// Receiver side state, touched by the progress thread (and setup).
#[derive(Default)]
struct RxState {
    /// Blocks consumed so far (the next expected block's sequence number).
    next_seq: u64,
    /// Block write-with-immediate completions seen: blocks below this have fully landed.
    imm_seen: u64,
    /// Consumed count last written to the peer's notification buffer.
    returned: u64,
    credit_in_flight: bool,
    /// A control message being reassembled from fragments.
    partial: Option<(usize, Vec<u8>)>,
}

struct Conn {
    peer: NodeId,
    /// Declared first: dropped (destroyed) before the buffers below, and it keeps every MR
    /// it posted from alive until then anyway.
    qp: QueuePair,
    bufs: Arc<MemoryRegion>,
    lay: Layout,
    remote: RemoteRing,
    sq_depth: u64,
    tx: Mutex<TxState>,
    rx: Mutex<RxState>,
    /// Blocks of ours the peer has consumed (from its notifications).
    peer_consumed: AtomicU64,
    /// Blocks of ours posted (incremented before posting).
    sent: AtomicU64,
    /// Send work requests posted and not completed yet.
    sq_inflight: AtomicU64,
    /// Application work requests completed (they complete in order on one QP).
    ops_done: AtomicU64,
    /// Wakes senders waiting for credits, send-queue room or completions.
    sig: Mutex<()>,
    cv: Condvar,
    last_recv: AtomicU64,
    last_send: AtomicU64,
    installed: AtomicBool,
    dead: AtomicBool,
}

impl Conn {
    fn notify(&self) {
        drop(self.sig.lock().unwrap());
        self.cv.notify_all();
    }

    fn ring_block(&self, seq: u64) -> u64 {
        self.lay.ring + (seq % self.lay.n as u64) * self.lay.bsize as u64
    }

    fn staging_block(&self, seq: u64) -> u64 {
        self.lay.staging + (seq % self.lay.n as u64) * self.lay.bsize as u64
    }
}

struct Inner {
    id: NodeId,
    cfg: RdmaConfig,
    listen_addr: SocketAddr,
    epoch: Instant,
    // Verbs objects. Connections hold Arcs of what they use, so the order here is free.
    ctx: Arc<Context>,
    pd: Arc<ProtectionDomain>,
    cq: Arc<CompletionQueue>,
    port: PortInfo,
    gid: GidInfo,
    rc: RcParams,
    arena: Mutex<Option<Arc<MemoryRegion>>>,
    arena_registered: AtomicBool,
    /// Installed connections by peer.
    conns: Mutex<HashMap<NodeId, Arc<Conn>>>,
    conns_changed: Condvar,
    /// Every connection whose QP exists (installed or still in setup), by QP number.
    by_qpn: Mutex<HashMap<u32, Arc<Conn>>>,
    events_tx: Sender<Event>,
    events_rx: Receiver<Event>,
    handler: OnceLock<EventHandler>,
    counters: Counters,
    closing: AtomicBool,
    /// Set when shutdown starts (before the goodbyes): failures seen from then on are ours.
    leaving: AtomicBool,
    wake: OwnedFd,
    threads: Mutex<Vec<JoinHandle<()>>>,
    psn_seed: AtomicU64,
    rendezvous_threshold: AtomicU64,
}

/// Verbs implementation of [`Transport`].
#[derive(Clone)]
pub struct RdmaTransport {
    inner: Arc<Inner>,
}

fn setup_err(e: impl std::fmt::Display) -> TransportError {
    TransportError::Setup(e.to_string())
}

impl RdmaTransport {
    /// Opens the RDMA device, binds the out-of-band TCP listener of node `id` and starts the
    /// progress, heartbeat and accept threads. Port 0 picks a free port;
    /// [`RdmaTransport::listen_addr`] tells which.
    pub fn bind(
        id: NodeId,
        addr: SocketAddr,
        cfg: RdmaConfig,
    ) -> Result<RdmaTransport, TransportError> {
        if cfg.block_size < block::MIN_BLOCK || cfg.ring_blocks < 1 {
            return Err(setup_err(format!(
                "block_size must be at least {} and ring_blocks at least 1",
                block::MIN_BLOCK
            )));
        }
        let ctx = Context::open(cfg.device.as_deref())?;
        let port = ctx.query_port(cfg.port)?;
        if !port.active {
            return Err(setup_err(format!(
                "{} port {} is not ACTIVE",
                ctx.name(),
                cfg.port
            )));
        }
        let gid = ctx.select_gid(cfg.port, cfg.gid_index)?;
        let rc = RcParams {
            port: cfg.port,
            gid_index: gid.index,
            use_grh: port.link_layer == LINK_LAYER_ETHERNET || cfg.gid_index.is_some(),
            timeout: cfg.qp_timeout,
            retry_cnt: cfg.retry_cnt,
            rnr_retry: 7,
            min_rnr_timer: 12,
        };
        let pd = ProtectionDomain::new(&ctx)?;
        let cq = CompletionQueue::new(&ctx, cfg.cq_entries)?;
        let listener = TcpListener::bind(addr)
            .map_err(|e| setup_err(format!("node {id}: bind {addr}: {e}")))?;
        let listen_addr = listener.local_addr()?;
        // SAFETY: eventfd has no memory-safety preconditions; the result is checked.
        let efd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if efd < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        // SAFETY: efd is a fresh descriptor that nothing else owns.
        let wake = unsafe { OwnedFd::from_raw_fd(efd) };
        info!(
            node = id,
            device = ctx.name(),
            gid_index = gid.index,
            lid = port.lid,
            "verbs transport up"
        );
        let (events_tx, events_rx) = crossbeam_channel::unbounded();
        let cfg_threshold = cfg.rendezvous_threshold;
        let seed = (std::process::id() as u64) << 32
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
            ^ (id as u64) << 16;
        let inner = Arc::new(Inner {
            id,
            cfg,
            listen_addr,
            epoch: Instant::now(),
            ctx,
            pd,
            cq,
            port,
            gid,
            rc,
            arena: Mutex::new(None),
            arena_registered: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            conns_changed: Condvar::new(),
            by_qpn: Mutex::new(HashMap::new()),
            events_tx,
            events_rx,
            handler: OnceLock::new(),
            counters: Counters::default(),
            closing: AtomicBool::new(false),
            leaving: AtomicBool::new(false),
            wake,
            threads: Mutex::new(Vec::new()),
            psn_seed: AtomicU64::new(seed),
            rendezvous_threshold: AtomicU64::new(cfg_threshold),
        });
        let p = inner.clone();
        let progress = std::thread::Builder::new()
            .name(format!("phx-verbs-{id}"))
            .spawn(move || p.progress_loop())?;
        let h = inner.clone();
        let hb = std::thread::Builder::new()
            .name(format!("phx-vheartbeat-{id}"))
            .spawn(move || h.heartbeat_loop())?;
        let a = inner.clone();
        let acc = std::thread::Builder::new()
            .name(format!("phx-vaccept-{id}"))
            .spawn(move || a.accept_loop(listener))?;
        inner.threads.lock().unwrap().extend([progress, hb, acc]);
        Ok(RdmaTransport { inner })
    }

    pub fn listen_addr(&self) -> SocketAddr {
        self.inner.listen_addr
    }

    /// Changes the eager/rendezvous boundary at run time (for measurements).
    pub fn set_rendezvous_threshold(&self, bytes: u64) {
        self.inner
            .rendezvous_threshold
            .store(bytes, Ordering::Relaxed);
    }

    pub fn rendezvous_threshold(&self) -> u64 {
        self.inner.rendezvous_threshold.load(Ordering::Relaxed)
    }

    /// Name of the opened device.
    pub fn device_name(&self) -> &str {
        self.inner.ctx.name()
    }

    /// Index of the GID in use.
    pub fn gid_index(&self) -> u8 {
        self.inner.gid.index
    }

    /// Connects to `peers`: dials those with a lower id (all of them with `dial_all`, as a
    /// restarted node does to rejoin) and waits until every peer is linked, up to the
    /// connect timeout. Same contract as `TcpTransport::connect`.
    pub fn connect(
        &self,
        peers: &[(NodeId, SocketAddr)],
        dial_all: bool,
    ) -> Result<(), TransportError> {
        let inner = &self.inner;
        phalanx_transport::mesh::connect_mesh(
            inner.id,
            peers,
            dial_all,
            inner.cfg.connect_timeout,
            |peer, addr, deadline| inner.dial(peer, addr, deadline),
            &inner.conns,
            &inner.conns_changed,
        )
    }

    /// Dials one peer now (for a peer that restarted and listens again).
    pub fn dial(
        &self,
        peer: NodeId,
        addr: SocketAddr,
        timeout: Duration,
    ) -> Result<(), TransportError> {
        self.inner.dial(peer, addr, Instant::now() + timeout)
    }
}

impl Inner {
    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Hands an event to the handler if one is set, else to the channel.
    fn emit(&self, ev: Event) {
        match self.handler.get() {
            Some(h) => h(ev),
            None => {
                let _ = self.events_tx.send(ev);
            }
        }
    }

    fn wake_progress(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our own eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    fn next_psn(&self) -> u32 {
        let x = self
            .psn_seed
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
        let x = (x ^ (x >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        ((x ^ (x >> 32)) & 0xff_ffff) as u32
    }

    fn local_hello(&self, conn: &Conn, psn: u32) -> Hello {
        Hello {
            node: self.id,
            ep: QpEndpoint {
                qpn: conn.qp.qpn(),
                psn,
                lid: self.port.lid,
                gid: self.gid.gid,
                mtu: self.port.active_mtu,
            },
            ring_addr: conn.bufs.addr() + conn.lay.ring,
            ring_rkey: conn.bufs.rkey(),
            ring_blocks: conn.lay.n as u32,
            block_size: conn.lay.bsize as u32,
            notify_addr: conn.bufs.addr() + conn.lay.notify_in,
            notify_rkey: conn.bufs.rkey(),
        }
    }

    /// Creates a connection's QP and buffers, moves the QP to INIT and posts its receives.
    /// The connection is known to the progress thread (by QP number) from here on.
    fn new_conn(&self, peer: NodeId) -> Result<Conn, TransportError> {
        let lay = Layout::new(self.cfg.ring_blocks, self.cfg.block_size);
        let mem = Arc::new(Arena::new(lay.total, false)?);
        let bufs = Arc::new(MemoryRegion::register(&self.pd, mem)?);
        self.counters.registrations.fetch_add(1, Ordering::Relaxed);
        let max_wr = self.ctx.max_qp_wr().max(16) as u64;
        let sq_depth = ((lay.n + self.cfg.write_window + 8) as u64).min(max_wr);
        // Receives absorb block writes (at most n unconsumed) and credit notifications.
        let rq_depth = ((2 * lay.n + 16) as u64).min(max_wr);
        let qp = QueuePair::new(&self.pd, &self.cq, sq_depth as u32, rq_depth as u32)?;
        qp.to_init(&self.rc)?;
        for _ in 0..rq_depth {
            qp.post_recv(0)?;
        }
        let now = self.now_ns();
        let conn = Conn {
            peer,
            qp,
            bufs,
            lay,
            remote: RemoteRing::default(),
            sq_depth,
            tx: Mutex::new(TxState {
                next_seq: 0,
                next_op: 0,
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
            installed: AtomicBool::new(false),
            dead: AtomicBool::new(false),
        };
        Ok(conn)
    }

    /// Fills in the peer's ring descriptors and brings the QP to RTS.
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

    fn dial(
        self: &Arc<Self>,
        peer: NodeId,
        addr: SocketAddr,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let mut backoff = Duration::from_millis(5);
        let mut s = loop {
            if self.closing.load(Ordering::Acquire) {
                return Err(TransportError::Shutdown);
            }
            match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline => {
                    debug!(node = self.id, peer, %addr, "dial failed, retrying: {e}");
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_millis(200));
                }
                Err(e) => {
                    return Err(setup_err(format!(
                        "node {}: cannot reach peer {peer} at {addr}: {e}",
                        self.id
                    )))
                }
            }
        };
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(self.cfg.connect_timeout))?;
        let psn = self.next_psn();
        let conn = self.new_conn(peer)?;
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

    fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        for s in listener.incoming() {
            if self.closing.load(Ordering::Acquire) {
                break;
            }
            let s = match s {
                Ok(s) => s,
                Err(e) => {
                    warn!(node = self.id, "accept failed: {e}");
                    continue;
                }
            };
            let me = self.clone();
            let _ = std::thread::Builder::new()
                .name(format!("phx-vhello-{}", self.id))
                .spawn(move || me.handshake(s));
        }
    }

    fn handshake(self: Arc<Self>, mut s: TcpStream) {
        let from = s.peer_addr().ok();
        let res = (|| -> Result<(), TransportError> {
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            let mut b = [0u8; HELLO_LEN];
            s.read_exact(&mut b)?;
            let remote = Hello::decode(&b)?;
            let psn = self.next_psn();
            let conn = self.new_conn(remote.node)?;
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
        })();
        if let Err(e) = res {
            if matches!(e, TransportError::Malformed(_)) {
                self.counters
                    .malformed_frames
                    .fetch_add(1, Ordering::Relaxed);
            }
            if !self.closing.load(Ordering::Acquire) {
                error!(node = self.id, ?from, "verbs connection setup failed: {e}");
            }
        }
    }

    /// Makes a connected QP the link to its peer (replacing an older one) and tells the node.
    fn install(&self, conn: Arc<Conn>) {
        let peer = conn.peer;
        let now = self.now_ns();
        conn.last_recv.store(now, Ordering::Relaxed);
        conn.last_send.store(now, Ordering::Relaxed);
        let old = {
            let mut conns = self.conns.lock().unwrap();
            let old = conns.insert(peer, conn.clone());
            self.conns_changed.notify_all();
            old
        };
        if let Some(old) = old {
            // A restarted peer replaces its old link silently.
            self.retire(&old);
        }
        info!(node = self.id, peer, qpn = conn.qp.qpn(), "verbs link up");
        self.emit(Event::PeerUp { peer });
        // Only now may the progress thread deliver this link's messages (after PeerUp).
        conn.installed.store(true, Ordering::Release);
        self.wake_progress();
    }

    /// Stops a connection without any event: QP to error, forgotten by the progress thread.
    fn retire(&self, conn: &Arc<Conn>) {
        conn.dead.store(true, Ordering::Release);
        let _ = conn.qp.to_error();
        self.by_qpn.lock().unwrap().remove(&conn.qp.qpn());
        conn.notify();
    }

    /// Drops a link after a failure and reports `PeerDown` once (if it was the current one).
    fn fail_conn(&self, conn: &Arc<Conn>, reason: String) {
        if conn.dead.swap(true, Ordering::AcqRel) {
            return;
        }
        let _ = conn.qp.to_error();
        self.by_qpn.lock().unwrap().remove(&conn.qp.qpn());
        let current = {
            let mut conns = self.conns.lock().unwrap();
            let current = conns.get(&conn.peer).is_some_and(|c| Arc::ptr_eq(c, conn));
            if current {
                conns.remove(&conn.peer);
                self.conns_changed.notify_all();
            }
            current
        };
        conn.notify();
        if current && !self.leaving.load(Ordering::Acquire) {
            if reason == PEER_LEFT {
                info!(
                    node = self.id,
                    peer = conn.peer,
                    "verbs link closed: {reason}"
                );
            } else {
                warn!(
                    node = self.id,
                    peer = conn.peer,
                    "verbs link down: {reason}"
                );
            }
            self.counters.peers_down.fetch_add(1, Ordering::Relaxed);
            self.emit(Event::PeerDown {
                peer: conn.peer,
                reason,
            });
        }
    }

    fn conn(&self, peer: NodeId) -> Result<Arc<Conn>, TransportError> {
        if self.closing.load(Ordering::Acquire) {
            return Err(TransportError::Shutdown);
        }
        self.conns
            .lock()
            .unwrap()
            .get(&peer)
            .cloned()
            .ok_or(TransportError::PeerUnavailable(peer))
    }

    fn peer_failed(&self, conn: &Conn) -> TransportError {
        if self.closing.load(Ordering::Acquire) {
            TransportError::Shutdown
        } else {
            TransportError::PeerFailed {
                peer: conn.peer,
                reason: "link went down".into(),
            }
        }
    }

    /// Waits until `ready()` holds, the link dies, or `deadline` passes (then `Ok(false)`).
    fn wait_for(
        &self,
        conn: &Conn,
        deadline: Option<Instant>,
        ready: impl Fn() -> bool,
    ) -> Result<bool, TransportError> {
        let mut g = conn.sig.lock().unwrap();
        loop {
            if conn.dead.load(Ordering::Acquire) {
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

    /// Posts one application RDMA write, waiting for send-queue room. Returns its op number.
    #[allow(clippy::too_many_arguments)]
    fn post_app_write(
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
        // One slot stays free for the progress thread's credit write.
        let limit = conn.sq_depth.saturating_sub(1).max(1);
        self.wait_for(conn, None, || {
            conn.sq_inflight.load(Ordering::Acquire) < limit
        })?;
        let op = tx.next_op;
        conn.sq_inflight.fetch_add(1, Ordering::AcqRel);
        if let Err(e) = conn
            .qp
            .post_write(WR_APP | op, mr, offset, len, raddr, rkey, imm)
        {
            conn.sq_inflight.fetch_sub(1, Ordering::AcqRel);
            return Err(TransportError::PeerFailed {
                peer: conn.peer,
                reason: e.to_string(),
            });
        }
        tx.next_op += 1;
        conn.last_send.store(self.now_ns(), Ordering::Relaxed);
        Ok(op)
    }

    /// Writes one block message. Waits for a credit unless `deadline` passes first
    /// (then `Ok(false)`, nothing sent). `fill` copies the payload into the staging block.
    fn send_block(
        &self,
        conn: &Conn,
        tx: &mut TxState,
        h: &Header,
        payload: &[u8],
        deadline: Option<Instant>,
    ) -> Result<bool, TransportError> {
        let seq = tx.next_seq;
        let n = conn.lay.n as u64;
        if !self.wait_for(conn, deadline, || {
            seq - conn.peer_consumed.load(Ordering::Acquire) < n
        })? {
            return Ok(false);
        }
        let slot = conn.staging_block(seq);
        // SAFETY: staging slot `seq % n` was last used by block `seq - n`, which the peer has
        // consumed (credit check above), so the NIC finished reading it; only the holder of
        // the send lock (us) writes staging slots.
        let blk = unsafe { conn.bufs.arena().slice_mut(slot, conn.lay.bsize as u64) };
        let start = block::encode(blk, conn.lay.n, seq, h, payload);
        conn.sent.fetch_add(1, Ordering::AcqRel);
        let len = (conn.lay.bsize - start) as u32;
        let raddr = conn.remote.ring_addr + (seq % n) * conn.lay.bsize as u64 + start as u64;
        let bufs = conn.bufs.clone();
        match self.post_app_write(
            conn,
            tx,
            &bufs,
            slot + start as u64,
            len,
            raddr,
            conn.remote.ring_rkey,
            Some(seq as u32 & IMM_MASK),
        ) {
            Ok(_) => {
                tx.next_seq += 1;
                Ok(true)
            }
            Err(e) => {
                conn.sent.fetch_sub(1, Ordering::AcqRel);
                Err(e)
            }
        }
    }

    /// Sends a control message as consecutive fragments (under the caller's send lock).
    fn send_ctrl(&self, conn: &Conn, tx: &mut TxState, msg: &[u8]) -> Result<(), TransportError> {
        let max = block::max_payload(conn.lay.bsize);
        let mut done = 0;
        loop {
            let n = (msg.len() - done).min(max);
            let mut h = Header::new(Kind::Ctrl);
            if done == 0 {
                h.flags |= FLAG_FIRST;
                h.a = msg.len() as u64;
            }
            if done + n == msg.len() {
                h.flags |= FLAG_LAST;
            }
            self.send_block(conn, tx, &h, &msg[done..done + n], None)?;
            done += n;
            if done == msg.len() {
                break;
            }
        }
        self.counters.ctrl_sent.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn lock_tx<'a>(&self, conn: &'a Conn) -> Result<MutexGuard<'a, TxState>, TransportError> {
        let g = conn.tx.lock().unwrap();
        if conn.dead.load(Ordering::Acquire) {
            return Err(self.peer_failed(conn));
        }
        Ok(g)
    }

    // ---------------------------------------------------------------- progress thread

    fn progress_loop(self: Arc<Self>) {
        let mut wcs: Vec<WorkCompletion> = Vec::with_capacity(256);
        let fd = self.wake.as_raw_fd();
        let mut idle: u32 = 0;
        while !self.closing.load(Ordering::Acquire) {
            if !self.cfg.busy_poll {
                // SAFETY: the eventfd lives as long as `self`.
                let bfd = unsafe { BorrowedFd::borrow_raw(fd) };
                match self.cq.wait(Some(bfd), Duration::from_millis(100)) {
                    Ok((_, woken)) => {
                        if woken {
                            let mut v = 0u64;
                            // SAFETY: reads 8 bytes into a live u64 from our own eventfd.
                            unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
                        }
                    }
                    Err(e) => {
                        error!(node = self.id, "completion channel failed: {e}");
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
            }
            wcs.clear();
            if let Err(e) = self.cq.poll(&mut wcs, 4096) {
                error!(node = self.id, "ibv_poll_cq failed: {e}");
            }
            for wc in &wcs {
                self.handle_wc(wc);
            }
            let conns: Vec<Arc<Conn>> = self.by_qpn.lock().unwrap().values().cloned().collect();
            for c in &conns {
                if c.installed.load(Ordering::Acquire) && !c.dead.load(Ordering::Acquire) {
                    self.scan_ring(c);
                }
            }
            if self.cfg.busy_poll {
                // Spin, but let other threads of a shared core run now and then.
                idle = if wcs.is_empty() {
                    idle.wrapping_add(1)
                } else {
                    0
                };
                if idle % 256 == 255 {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        }
    }

    fn handle_wc(&self, wc: &WorkCompletion) {
        let Some(conn) = self.by_qpn.lock().unwrap().get(&wc.qp_num).cloned() else {
            return; // a retired QP's flushed work
        };
        if !wc.is_ok() {
            if !conn.dead.load(Ordering::Acquire) {
                self.fail_conn(
                    &conn,
                    format!(
                        "work completion error: {} (status {})",
                        wc.status_str(),
                        wc.status
                    ),
                );
            }
            return;
        }
        if wc.is_recv() {
            if let Err(e) = conn.qp.post_recv(0) {
                self.fail_conn(&conn, format!("cannot repost receive: {e}"));
                return;
            }
            conn.last_recv.store(self.now_ns(), Ordering::Relaxed);
            let imm = wc.imm.unwrap_or(0);
            if imm & IMM_CREDIT != 0 {
                self.take_credit(&conn, imm & IMM_MASK);
            } else {
                let mut rx = conn.rx.lock().unwrap();
                let seen = block::extend31(rx.imm_seen, imm);
                if seen != rx.imm_seen {
                    drop(rx);
                    self.fail_conn(&conn, format!("block immediate {imm} out of order"));
                    return;
                }
                rx.imm_seen += 1;
            }
        } else {
            conn.sq_inflight.fetch_sub(1, Ordering::AcqRel);
            match wc.wr_id & WR_TAG {
                WR_CREDIT => {
                    conn.rx.lock().unwrap().credit_in_flight = false;
                    self.return_credit(&conn);
                }
                _ => {
                    let op = wc.wr_id & !WR_TAG;
                    conn.ops_done.fetch_max(op + 1, Ordering::AcqRel);
                }
            }
            conn.notify();
        }
    }

    /// A credit notification arrived: read the notification buffer (count and complement),
    /// falling back to the 31 bits of the immediate if the buffer reads inconsistent.
    fn take_credit(&self, conn: &Conn, low31: u32) {
        let p = (conn.bufs.addr() + conn.lay.notify_in) as *const u64;
        // SAFETY: notify_in is 16 bytes inside our registered buffer, 64-byte aligned; the
        // peer writes it by DMA, hence volatile reads.
        let (a, b) = unsafe {
            (
                std::ptr::read_volatile(p),
                std::ptr::read_volatile(p.add(1)),
            )
        };
        let known = conn.peer_consumed.load(Ordering::Acquire);
        let sent = conn.sent.load(Ordering::Acquire);
        let c = if a == !b && a >= known && a <= sent {
            a
        } else {
            block::extend31(known, low31)
        };
        if c > known && c <= sent {
            conn.peer_consumed.store(c, Ordering::Release);
            conn.notify();
        }
    }

    /// Tells the peer how many of its blocks we consumed (one notification write in flight
    /// at a time, so the source slot is stable while the NIC reads it).
    fn return_credit(&self, conn: &Arc<Conn>) {
        let mut rx = conn.rx.lock().unwrap();
        if rx.credit_in_flight || rx.next_seq == rx.returned || conn.dead.load(Ordering::Acquire) {
            return;
        }
        let count = rx.next_seq;
        let p = (conn.bufs.addr() + conn.lay.notify_out) as *mut u64;
        // SAFETY: notify_out is 16 bytes inside our buffer; no notification write is in
        // flight (checked above), so the NIC is not reading it.
        unsafe {
            std::ptr::write_volatile(p, count);
            std::ptr::write_volatile(p.add(1), !count);
        }
        rx.credit_in_flight = true;
        rx.returned = count;
        drop(rx);
        conn.sq_inflight.fetch_add(1, Ordering::AcqRel);
        let imm = IMM_CREDIT | (count as u32 & IMM_MASK);
        if let Err(e) = conn.qp.post_write(
            WR_CREDIT,
            &conn.bufs,
            conn.lay.notify_out,
            16,
            conn.remote.notify_addr,
            conn.remote.notify_rkey,
            Some(imm),
        ) {
            conn.sq_inflight.fetch_sub(1, Ordering::AcqRel);
            self.fail_conn(conn, format!("cannot post credit: {e}"));
        }
    }

    /// Consumes every valid block at the head of a connection's ring.
    fn scan_ring(&self, conn: &Arc<Conn>) {
        let n = conn.lay.n;
        let bsize = conn.lay.bsize as u64;
        let mut consumed_any = false;
        loop {
            let mut rx = conn.rx.lock().unwrap();
            let seq = rx.next_seq;
            let off = conn.ring_block(seq);
            let last = (conn.bufs.addr() + off + bsize - 1) as *const u8;
            // SAFETY: the block lies inside our registered buffer; the counter byte is read
            // volatile because the NIC writes it.
            let lap = unsafe { std::ptr::read_volatile(last) };
            if lap != block::lap_of(seq, n) && seq >= rx.imm_seen {
                break; // nothing new: the usual exit
            }
            fence(Ordering::Acquire);
            // SAFETY: the peer writes block `seq % n` only for message `seq` (its previous
            // content was consumed and credited), and writes nothing else there until we
            // return credit for `seq`, so the bytes are stable once they validate.
            let blk = unsafe { conn.bufs.arena().slice(off, bsize) };
            match block::decode(blk, n, seq) {
                BlockState::Ready(h, payload) => {
                    let res = self.deliver(conn, &mut rx, &h, payload);
                    rx.next_seq += 1;
                    drop(rx);
                    consumed_any = true;
                    conn.last_recv.store(self.now_ns(), Ordering::Relaxed);
                    match res {
                        Ok(true) => {}
                        Ok(false) => {
                            self.fail_conn(conn, PEER_LEFT.into());
                            return;
                        }
                        Err(e) => {
                            self.counters
                                .malformed_frames
                                .fetch_add(1, Ordering::Relaxed);
                            self.fail_conn(conn, format!("malformed block: {e}"));
                            return;
                        }
                    }
                }
                BlockState::Stale | BlockState::Torn(_) if seq >= rx.imm_seen => break,
                other => {
                    drop(rx);
                    self.counters
                        .malformed_frames
                        .fetch_add(1, Ordering::Relaxed);
                    self.fail_conn(
                        conn,
                        format!("block {seq} invalid after its completion: {other:?}"),
                    );
                    return;
                }
            }
        }
        if consumed_any {
            self.return_credit(conn);
        }
    }

    /// Acts on one block message. `Ok(false)` on a goodbye.
    fn deliver(
        &self,
        conn: &Conn,
        rx: &mut RxState,
        h: &Header,
        payload: &[u8],
    ) -> Result<bool, TransportError> {
        let peer = conn.peer;
        match h.kind {
            Kind::Heartbeat => {}
            Kind::Bye => return Ok(false),
            Kind::Ctrl => {
                if h.flags & FLAG_FIRST != 0 {
                    if rx.partial.is_some() {
                        return Err(TransportError::Malformed(
                            "control message restarted".into(),
                        ));
                    }
                    let total = h.a as usize;
                    if total > MAX_CTRL_LEN {
                        return Err(TransportError::MessageTooLarge {
                            len: total,
                            max: MAX_CTRL_LEN,
                        });
                    }
                    rx.partial = Some((total, Vec::with_capacity(total)));
                }
                let Some((total, buf)) = rx.partial.as_mut() else {
                    return Err(TransportError::Malformed(
                        "control fragment without a start".into(),
                    ));
                };
                if buf.len() + payload.len() > *total {
                    return Err(TransportError::Malformed(
                        "control message longer than announced".into(),
                    ));
                }
                buf.extend_from_slice(payload);
                if h.flags & FLAG_LAST != 0 {
                    let (total, msg) = rx.partial.take().expect("partial");
                    if msg.len() != total {
                        return Err(TransportError::Malformed(
                            "control message shorter than announced".into(),
                        ));
                    }
                    self.counters.ctrl_received.fetch_add(1, Ordering::Relaxed);
                    self.emit(Event::Ctrl { peer, msg });
                }
            }
            Kind::Data | Kind::DataDone => {
                let arena = self
                    .arena
                    .lock()
                    .unwrap()
                    .clone()
                    .ok_or(TransportError::NoArena)?;
                let len = if h.kind == Kind::Data {
                    payload.len() as u64
                } else {
                    h.d
                };
                arena.arena().check(h.c, len)?;
                if h.kind == Kind::Data {
                    // SAFETY: bounds checked; the store reserved this range for the stream and
                    // nobody else reads or writes it until the Data event is handled.
                    unsafe { arena.arena().slice_mut(h.c, len) }.copy_from_slice(payload);
                    self.counters
                        .payload_bytes_copied
                        .fetch_add(len, Ordering::Relaxed);
                }
                self.counters
                    .data_bytes_received
                    .fetch_add(len, Ordering::Relaxed);
                self.emit(Event::Data {
                    peer,
                    stream: h.a,
                    offset: h.b,
                    len,
                });
            }
        }
        Ok(true)
    }

    // --------------------------------------------------------------- heartbeats, close

    fn heartbeat_loop(self: Arc<Self>) {
        let timeout = self.cfg.heartbeat_timeout;
        let period = (timeout / 4).max(Duration::from_millis(1));
        // Silence is checked twice per heartbeat period, so a dead peer is reported at most
        // timeout + period/2 after the last thing it sent.
        let tick = (period / 2).max(Duration::from_millis(1));
        while !self.closing.load(Ordering::Acquire) {
            std::thread::sleep(tick);
            let conns: Vec<Arc<Conn>> = self.conns.lock().unwrap().values().cloned().collect();
            for c in conns {
                let now = self.now_ns();
                let silent = now.saturating_sub(c.last_recv.load(Ordering::Relaxed));
                if silent > timeout.as_nanos() as u64 {
                    self.fail_conn(&c, format!("no heartbeat for {timeout:?}"));
                    continue;
                }
                if now.saturating_sub(c.last_send.load(Ordering::Relaxed))
                    < period.as_nanos() as u64
                {
                    continue;
                }
                // A held send lock means a message is on its way, which is proof of life.
                let Ok(mut tx) = c.tx.try_lock() else {
                    continue;
                };
                if c.dead.load(Ordering::Acquire) {
                    continue;
                }
                let h = Header::new(Kind::Heartbeat);
                if let Err(e) = self.send_block(&c, &mut tx, &h, &[], Some(Instant::now())) {
                    debug!(node = self.id, peer = c.peer, "heartbeat failed: {e}");
                }
            }
        }
    }

    fn close_all(&self, goodbye: bool) {
        let first = !self.leaving.swap(true, Ordering::AcqRel);
        if goodbye && first {
            let conns: Vec<Arc<Conn>> = self.conns.lock().unwrap().values().cloned().collect();
            for c in conns {
                let Ok(mut tx) = self.lock_tx(&c) else {
                    continue;
                };
                let deadline = Instant::now() + Duration::from_millis(500);
                if let Ok(true) =
                    self.send_block(&c, &mut tx, &Header::new(Kind::Bye), &[], Some(deadline))
                {
                    let last = tx.next_op;
                    drop(tx);
                    // Wait for the goodbye to reach the peer before tearing the QP down.
                    let _ = self.wait_for(&c, Some(deadline), || {
                        c.ops_done.load(Ordering::Acquire) >= last
                    });
                }
            }
        }
        if self.closing.swap(true, Ordering::AcqRel) {
            return;
        }
        let conns: Vec<Arc<Conn>> = self.conns.lock().unwrap().drain().map(|(_, c)| c).collect();
        self.conns_changed.notify_all();
        let all: Vec<Arc<Conn>> = self
            .by_qpn
            .lock()
            .unwrap()
            .drain()
            .map(|(_, c)| c)
            .collect();
        for c in conns.iter().chain(all.iter()) {
            c.dead.store(true, Ordering::Release);
            let _ = c.qp.to_error();
            c.notify();
        }
        self.wake_progress();
        let _ = TcpStream::connect_timeout(&self.listen_addr, Duration::from_millis(200));
        let me = std::thread::current().id();
        let threads: Vec<JoinHandle<()>> = self.threads.lock().unwrap().drain(..).collect();
        for t in threads {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
        // The arena stays registered until here; connections still referenced by callers
        // keep its MR (and their QP destroys first) until they let go.
        self.arena.lock().unwrap().take();
    }
}

/// A control message must fit one eager block.
fn check_ctrl_len(msg: &[u8]) -> Result<(), TransportError> {
    if msg.len() > MAX_CTRL_LEN {
        return Err(TransportError::MessageTooLarge {
            len: msg.len(),
            max: MAX_CTRL_LEN,
        });
    }
    Ok(())
}

impl Transport for RdmaTransport {
    fn name(&self) -> &'static str {
        "rdma"
    }

    fn local_id(&self) -> NodeId {
        self.inner.id
    }

    fn register_arena(&self, arena: Arc<Arena>) -> Result<(), TransportError> {
        if self.inner.arena_registered.swap(true, Ordering::AcqRel) {
            return Err(TransportError::ArenaAlreadyRegistered);
        }
        match MemoryRegion::register(&self.inner.pd, arena) {
            Ok(mr) => {
                self.inner
                    .counters
                    .registrations
                    .fetch_add(1, Ordering::Relaxed);
                *self.inner.arena.lock().unwrap() = Some(Arc::new(mr));
                Ok(())
            }
            Err(e) => {
                self.inner.arena_registered.store(false, Ordering::Release);
                Err(e.into())
            }
        }
    }

    fn remote_region(&self, offset: u64, len: u64) -> Result<RemoteRegion, TransportError> {
        let mr = self
            .inner
            .arena
            .lock()
            .unwrap()
            .clone()
            .ok_or(TransportError::NoArena)?;
        mr.arena().check(offset, len)?;
        Ok(RemoteRegion {
            node: self.inner.id,
            offset,
            len,
            addr: mr.addr() + offset,
            rkey: mr.rkey(),
        })
    }

    fn send(&self, peer: NodeId, msg: &[u8]) -> Result<(), TransportError> {
        check_ctrl_len(msg)?;
        let inner = &self.inner;
        let conn = inner.conn(peer)?;
        let mut tx = inner.lock_tx(&conn)?;
        inner.send_ctrl(&conn, &mut tx, msg)
    }

    fn write(
        &self,
        peer: NodeId,
        stream: StreamId,
        src_offset: u64,
        dst: &RemoteRegion,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), TransportError> {
        let inner = &self.inner;
        let mr = inner
            .arena
            .lock()
            .unwrap()
            .clone()
            .ok_or(TransportError::NoArena)?;
        mr.arena().check(src_offset, len)?;
        dst.check(dst_offset, len)?;
        let conn = inner.conn(peer)?;
        if len == 0 {
            return Ok(());
        }
        let rendezvous = len >= inner.rendezvous_threshold.load(Ordering::Relaxed)
            && dst.rkey != 0
            && dst.addr != 0;
        if !rendezvous {
            let max = block::max_payload(conn.lay.bsize) as u64;
            let mut tx = inner.lock_tx(&conn)?;
            let mut done = 0;
            while done < len {
                let n = (len - done).min(max);
                let h = Header {
                    kind: Kind::Data,
                    flags: 0,
                    a: stream,
                    b: dst_offset + done,
                    c: dst.offset + dst_offset + done,
                    d: 0,
                };
                // SAFETY: bounds checked above; the caller keeps the source range allocated
                // and unchanged until this call returns (trait contract).
                let src = unsafe { mr.arena().slice(src_offset + done, n) };
                inner.send_block(&conn, &mut tx, &h, src, None)?;
                inner
                    .counters
                    .payload_bytes_copied
                    .fetch_add(n, Ordering::Relaxed);
                inner
                    .counters
                    .data_bytes_sent
                    .fetch_add(n, Ordering::Relaxed);
                done += n;
            }
            return Ok(());
        }
        // Rendezvous: a window of chunk writes straight from the arena, each followed by a
        // DataDone block on the same QP (RC ordering: it lands after the chunk's bytes).
        let chunk = inner.cfg.chunk_size.clamp(4096, 1 << 30) as u64;
        let window = inner.cfg.write_window.max(1);
        let mut in_flight: VecDeque<u64> = VecDeque::new();
        let mut last_op = 0;
        let mut done = 0;
        while done < len {
            while in_flight.len() >= window {
                let op = in_flight.pop_front().expect("non-empty");
                inner.wait_for(&conn, None, || conn.ops_done.load(Ordering::Acquire) > op)?;
            }
            let n = (len - done).min(chunk);
            let mut tx = inner.lock_tx(&conn)?;
            let op = inner.post_app_write(
                &conn,
                &mut tx,
                &mr,
                src_offset + done,
                n as u32,
                dst.addr + dst_offset + done,
                dst.rkey,
                None,
            )?;
            let h = Header {
                kind: Kind::DataDone,
                flags: 0,
                a: stream,
                b: dst_offset + done,
                c: dst.offset + dst_offset + done,
                d: n,
            };
            inner.send_block(&conn, &mut tx, &h, &[], None)?;
            drop(tx);
            in_flight.push_back(op);
            last_op = op;
            inner
                .counters
                .data_bytes_sent
                .fetch_add(n, Ordering::Relaxed);
            done += n;
        }
        // The source may be reused once the last chunk write has completed.
        inner.wait_for(&conn, None, || {
            conn.ops_done.load(Ordering::Acquire) > last_op
        })?;
        Ok(())
    }

    fn send_nonblocking(&self, peer: NodeId, msg: &[u8]) -> Result<bool, TransportError> {
        check_ctrl_len(msg)?;
        let inner = &self.inner;
        let conn = inner.conn(peer)?;
        let Ok(mut tx) = conn.tx.try_lock() else {
            return Ok(false);
        };
        if conn.dead.load(Ordering::Acquire) {
            return Err(TransportError::PeerUnavailable(peer));
        }
        // Only if every fragment has a credit and a send-queue slot right now.
        let max = block::max_payload(conn.lay.bsize);
        let blocks = msg.len().div_ceil(max).max(1) as u64;
        let free_blocks =
            conn.lay.n as u64 - (tx.next_seq - conn.peer_consumed.load(Ordering::Acquire));
        let limit = conn.sq_depth.saturating_sub(1).max(1);
        let free_sq = limit.saturating_sub(conn.sq_inflight.load(Ordering::Acquire));
        if blocks > free_blocks || blocks > free_sq {
            return Ok(false);
        }
        inner.send_ctrl(&conn, &mut tx, msg)?;
        Ok(true)
    }

    fn events(&self) -> Receiver<Event> {
        self.inner.events_rx.clone()
    }

    fn set_event_handler(&self, handler: EventHandler) -> bool {
        // Events already queued (links that came up before) go to the handler first.
        let ok = self.inner.handler.set(handler).is_ok();
        if ok {
            let h = self.inner.handler.get().expect("just set");
            while let Ok(ev) = self.inner.events_rx.try_recv() {
                h(ev);
            }
        }
        ok
    }

    fn listen_addr(&self) -> Option<SocketAddr> {
        Some(self.inner.listen_addr)
    }

    fn is_connected(&self, peer: NodeId) -> bool {
        self.inner.conns.lock().unwrap().contains_key(&peer)
    }

    fn stats(&self) -> TransportStats {
        let c = &self.inner.counters;
        TransportStats {
            ctrl_sent: c.ctrl_sent.load(Ordering::Relaxed),
            ctrl_received: c.ctrl_received.load(Ordering::Relaxed),
            data_bytes_sent: c.data_bytes_sent.load(Ordering::Relaxed),
            data_bytes_received: c.data_bytes_received.load(Ordering::Relaxed),
            payload_bytes_copied: c.payload_bytes_copied.load(Ordering::Relaxed),
            registrations: c.registrations.load(Ordering::Relaxed),
            peers_down: c.peers_down.load(Ordering::Relaxed),
            malformed_frames: c.malformed_frames.load(Ordering::Relaxed),
        }
    }

    fn shutdown(&self) {
        self.inner.close_all(true);
    }

    fn kill(&self) {
        self.inner.close_all(false);
    }
}
