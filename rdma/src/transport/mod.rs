//! The verbs transport: RC queue pairs set up over an out-of-band TCP exchange, an eager
//! ring of bottom-filled blocks per connection with credits returned through notification
//! buffers (for at most `ring_pool` links; the others share one receive queue and one staging
//! pool), and rendezvous RDMA writes straight between the registered arenas.
//!
//! Per connection and direction, on a link with rings (see `README.md` for a picture):
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
//!   that RC ordering delivers after the chunk's bytes: no copy, no registration. That key
//!   is a type 2 memory window the receiver bound over the granted range on this
//!   connection's QP (`window`): the arena itself accepts no remote access.
//!
//! A link made when the ring pool is taken (on either side) has no ring: its blocks, of the
//! same format and under the same credits, are composed in a block of the node's shared
//! staging pool and *sent* (send-with-immediate, immediate = `seq`) into the peer's shared
//! receive queue, and credits go back as an immediate alone. Every QP takes its receives from
//! that queue, so eager memory per node is fixed by the configuration, not by the number of
//! peers (`shared`).
//!
//! Files, one job each:
//! - `config`: [`RdmaConfig`];
//! - `hello`: the out-of-band hello and ready byte; `setup`: QP and buffers of a
//!   connection, the dialler's and the acceptor's side of the exchange, install, teardown;
//! - `conn`: a connection, its buffer layout, its send and receive state, and the
//!   primitives of every send path (wait, send lock, posting a write);
//! - `eager`: sending blocks (control messages and small writes); `ring`: consuming them;
//!   `credit`: the credits that pace the sender; `shared`: the shared receive queue, the
//!   staging pool and the ring pool;
//! - `rendezvous`: the zero-copy path of large writes; `window`: the memory window a grant
//!   binds for them;
//! - `progress`, `heartbeat`: the two threads; `idle`: closing links that stay idle;
//! - here: [`RdmaTransport`] and its [`Transport`] implementation.

mod config;
mod conn;
mod credit;
mod eager;
mod heartbeat;
mod hello;
mod idle;
mod progress;
mod rendezvous;
mod ring;
mod setup;
mod shared;
mod window;

pub use config::{RdmaConfig, DEFAULT_RENDEZVOUS_THRESHOLD, ON_DEMAND_IDLE_TIMEOUT};

use crate::block::{self, Header, Kind};
use crate::topology::{self, Placement};
use crate::verbs::{
    Access, CompletionQueue, Context, GidInfo, MemoryRegion, MemoryWindow, PortInfo,
    ProtectionDomain, RcParams, LINK_LAYER_ETHERNET,
};
use conn::Conn;
use phalanx_transport::auth::Channel;
use phalanx_transport::{
    check_ctrl_len, Arena, Link, LinkTable, NodeId, RemoteRegion, StreamId, Transport,
    TransportError,
};
use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tracing::info;

/// Immediate values with this bit are credit notifications; others carry a block seq.
const IMM_CREDIT: u32 = 1 << 31;
const IMM_MASK: u32 = IMM_CREDIT - 1;
/// wr_id tags of send work requests.
const WR_APP: u64 = 1 << 62;
const WR_CREDIT: u64 = 2 << 62;
const WR_TAG: u64 = 3 << 62;

struct Inner {
    id: NodeId,
    cfg: RdmaConfig,
    // Verbs objects. Connections hold Arcs of what they use, so the order here is free.
    ctx: Arc<Context>,
    pd: Arc<ProtectionDomain>,
    cq: Arc<CompletionQueue>,
    /// The shared receive queue, the staging pool and the ring pool (`shared`).
    pool: Arc<shared::SharedPool>,
    port: PortInfo,
    gid: GidInfo,
    rc: RcParams,
    /// NIC-local placement of registered memory and of the busy-polling progress thread.
    placement: Placement,
    /// The cores the progress thread may run on, as it found them once started.
    progress_cpus: std::sync::OnceLock<Vec<usize>>,
    arena: Mutex<Option<Arc<MemoryRegion>>>,
    arena_registered: AtomicBool,
    /// Which peer may write where: an eager write is checked before it is copied in, and a
    /// rendezvous write's `DataDone` before it is reported; the NIC lands a rendezvous
    /// write's bytes only inside the window its grant bound.
    grants: phalanx_transport::GrantTable,
    /// The registrations and windows of rendezvous-size grants, by grant id.
    windows: Mutex<HashMap<u32, window::GrantWindow>>,
    /// Whether the device has type 2 memory windows (found when the arena is registered).
    windows_ok: AtomicBool,
    /// Installed connections by peer, with the event sink and the counters.
    links: Arc<LinkTable<Conn>>,
    /// Every connection whose QP exists (installed or still in setup), by QP number.
    by_qpn: Mutex<HashMap<u32, Arc<Conn>>>,
    wake: OwnedFd,
    threads: Mutex<Vec<JoinHandle<()>>>,
    psn_seed: AtomicU64,
    rendezvous_threshold: AtomicU64,
    /// The peers this node watches (see `Transport::set_watch`); unset: every link.
    watch: std::sync::OnceLock<phalanx_transport::Watch>,
    /// The peers the node above keeps links to (see `Transport::set_idle_guard`).
    idle_guard: std::sync::OnceLock<phalanx_transport::IdleGuard>,
    /// Links this node closed for being idle, until the peer's goodbye (`idle`).
    draining: Mutex<Vec<(Arc<Conn>, Instant)>>,
    /// Links the peer closed for being idle, whose goodbye is still to be sent.
    byes_due: Mutex<Vec<Arc<Conn>>>,
}

/// One data write as [`Transport::write`] takes it, its bounds already checked; what the
/// eager and the rendezvous path are given.
struct WriteReq<'a> {
    stream: StreamId,
    src_offset: u64,
    dst: &'a RemoteRegion,
    dst_offset: u64,
    len: u64,
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
        if cfg.block_size < block::MIN_BLOCK
            || cfg.ring_blocks < 1
            || cfg.srq_blocks < 1
            || cfg.staging_blocks < 1
        {
            return Err(setup_err(format!(
                "block_size must be at least {}, and ring_blocks, srq_blocks and \
                 staging_blocks at least 1",
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
        let placement = Placement::plan(ctx.name(), id, &cfg);
        let pool = shared::SharedPool::new(
            &pd,
            cfg.block_size,
            cfg.srq_blocks,
            cfg.staging_blocks,
            cfg.ring_pool,
            |mem| {
                if let Some(node) = placement.memory_node {
                    let _ = topology::bind_memory(mem.as_ptr(), mem.len(), node);
                }
            },
        )?;
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
        info!(
            node = id,
            device = ctx.name(),
            numa_node = ?placement.topology.numa_node,
            cores_near = %topology::format_cpulist(&placement.topology.local_cpus),
            "NIC-local placement: {}",
            placement.describe(cfg.busy_poll)
        );
        let cfg_threshold = cfg.rendezvous_threshold;
        let seed = (std::process::id() as u64) << 32
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
            ^ (id as u64) << 16;
        let links = LinkTable::new(id, listen_addr, "verbs link").with_auth(
            cfg.auth.clone(),
            Channel::Verbs,
            cfg.heartbeat_timeout,
        );
        let inner = Arc::new(Inner {
            id,
            cfg,
            ctx,
            pd,
            cq,
            pool,
            port,
            gid,
            rc,
            placement,
            progress_cpus: std::sync::OnceLock::new(),
            arena: Mutex::new(None),
            arena_registered: AtomicBool::new(false),
            grants: phalanx_transport::GrantTable::new(),
            windows: Mutex::new(HashMap::new()),
            windows_ok: AtomicBool::new(false),
            links: Arc::new(links),
            by_qpn: Mutex::new(HashMap::new()),
            wake,
            threads: Mutex::new(Vec::new()),
            watch: std::sync::OnceLock::new(),
            idle_guard: std::sync::OnceLock::new(),
            draining: Mutex::new(Vec::new()),
            byes_due: Mutex::new(Vec::new()),
            psn_seed: AtomicU64::new(seed),
            rendezvous_threshold: AtomicU64::new(cfg_threshold),
        });
        let p = inner.clone();
        let progress = phalanx_transport::threads::spawn(id, "verbs", move || {
            if let Some(core) = p.placement.progress_core {
                match topology::pin_current_thread(core) {
                    Ok(()) => info!(node = p.id, core, "verbs progress thread pinned"),
                    Err(e) => tracing::warn!(node = p.id, core, "cannot pin: {e}"),
                }
            }
            let _ = p.progress_cpus.set(topology::allowed_cpus());
            p.progress_loop()
        })?;
        let h = inner.clone();
        let hb = phalanx_transport::threads::spawn(id, "vhb", move || h.heartbeat_loop())?;
        let a = inner.clone();
        let acc = phalanx_transport::threads::spawn(id, "vaccept", move || {
            let links = a.links.clone();
            let failed = "verbs connection setup failed";
            links.accept_loop(listener, "vhello", failed, move |s, peer| {
                a.handshake(s, peer)
            })
        })?;
        inner.threads.lock().unwrap().extend([progress, hb, acc]);
        Ok(RdmaTransport { inner })
    }

    pub fn listen_addr(&self) -> SocketAddr {
        self.inner.links.listen_addr()
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

    /// Test hook: one raw RDMA write (`read` false) or read of `len` bytes between
    /// `local_offset` of this node's arena and `remote_addr`/`rkey` at `peer`, as a hostile
    /// member could post it; waits for its completion. A refused operation fails the link.
    #[doc(hidden)]
    pub fn raw_rdma(
        &self,
        peer: NodeId,
        read: bool,
        local_offset: u64,
        len: u32,
        remote_addr: u64,
        rkey: u32,
    ) -> Result<(), TransportError> {
        let inner = &self.inner;
        let mr = inner.arena_mr()?;
        let conn = inner.links.get(peer)?;
        let mut tx = inner.lock_tx(&conn)?;
        let op = inner.post_app(&conn, &mut tx, |wr_id| {
            if read {
                conn.qp
                    .post_read(wr_id, &mr, local_offset, len, remote_addr, rkey)
            } else {
                conn.qp
                    .post_write(wr_id, &mr, local_offset, len, remote_addr, rkey, None)
            }
        })?;
        drop(tx);
        inner.wait_for(&conn, None, || conn.ops_done.load(Ordering::Acquire) > op)?;
        Ok(())
    }

    /// Test hook: stop (or resume) consuming what `peer` sends, as a peer that keeps its
    /// link alive but reads nothing would.
    #[doc(hidden)]
    pub fn pause_consuming(&self, peer: NodeId, paused: bool) -> Result<(), TransportError> {
        let conn = self.inner.links.get(peer)?;
        conn.consuming_paused.store(paused, Ordering::Relaxed);
        self.inner.wake_progress();
        Ok(())
    }

    /// Name of the opened device.
    pub fn device_name(&self) -> &str {
        self.inner.ctx.name()
    }

    /// Index of the GID in use.
    pub fn gid_index(&self) -> u8 {
        self.inner.gid.index
    }

    /// Where registered memory and the progress thread are placed.
    pub fn placement(&self) -> &Placement {
        &self.inner.placement
    }

    /// The cores the progress thread may run on (its affinity once it started and pinned
    /// itself, if it does); `None` until it has started.
    pub fn progress_thread_cpus(&self) -> Option<Vec<usize>> {
        self.inner.progress_cpus.get().cloned()
    }

    phalanx_transport::connect_methods!(inner);
}

impl Inner {
    /// Binds memory about to be registered to the device's NUMA node (if known). Failure
    /// only costs locality, so it is logged, not returned.
    fn place(&self, arena: &Arena, what: &str) {
        let Some(node) = self.placement.memory_node else {
            return;
        };
        match topology::bind_memory(arena.as_ptr(), arena.len(), node) {
            Ok(()) if what == "arena" => info!(
                node = self.id,
                numa_node = node,
                bytes = arena.len(),
                "{what} bound to the NIC's NUMA node"
            ),
            Ok(()) => tracing::debug!(node = self.id, numa_node = node, "{what} bound"),
            Err(e) => tracing::warn!(node = self.id, numa_node = node, "{what}: mbind: {e}"),
        }
    }

    /// The registered arena. Errors: [`TransportError::NoArena`] before registration and
    /// after shutdown.
    fn arena_mr(&self) -> Result<Arc<MemoryRegion>, TransportError> {
        self.arena
            .lock()
            .unwrap()
            .clone()
            .ok_or(TransportError::NoArena)
    }

    fn close_all(&self, goodbye: bool) {
        let first = self.links.leave();
        // Grants go first: their windows are deallocated while the QPs they were bound on
        // still exist (each holds its connection until then).
        let grants: Vec<window::GrantWindow> = self
            .windows
            .lock()
            .unwrap()
            .drain()
            .map(|(_, w)| w)
            .collect();
        if goodbye && first {
            for c in self.links.snapshot() {
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
        let Some(conns) = self.links.close() else {
            return;
        };
        let all: Vec<Arc<Conn>> = self
            .by_qpn
            .lock()
            .unwrap()
            .drain()
            .map(|(_, c)| c)
            .collect();
        for c in conns.iter().chain(all.iter()) {
            c.shut();
        }
        self.wake_progress();
        self.links.wake_accept_loop();
        let me = std::thread::current().id();
        let threads: Vec<JoinHandle<()>> = self.threads.lock().unwrap().drain(..).collect();
        for t in threads {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
        // The arena stays registered until here; connections still referenced by callers
        // keep its MR (and their QP destroys first) until they let go.
        drop(grants);
        self.arena.lock().unwrap().take();
    }
}

impl Transport for RdmaTransport {
    phalanx_transport::transport_link_methods!(inner);

    fn set_watch(&self, watch: phalanx_transport::Watch) -> bool {
        let _ = self.inner.watch.set(watch);
        true
    }

    fn set_idle_guard(&self, guard: phalanx_transport::IdleGuard) {
        let _ = self.inner.idle_guard.set(guard);
    }

    fn name(&self) -> &'static str {
        "rdma"
    }

    fn eager_memory(&self) -> Option<(u64, u64)> {
        Some(self.inner.pool.bytes())
    }

    fn register_arena(&self, arena: Arc<Arena>) -> Result<(), TransportError> {
        if self.inner.arena_registered.swap(true, Ordering::AcqRel) {
            return Err(TransportError::ArenaAlreadyRegistered);
        }
        self.inner.place(&arena, "arena");
        // No peer may access the arena through its own key: rendezvous writes land through
        // what each grant registers and binds (see `window`).
        let windows = MemoryWindow::alloc(&self.inner.pd).is_ok();
        if !windows {
            tracing::warn!(
                node = self.inner.id,
                "{} has no memory windows: a grant's registration is not tied to its grantee's QP",
                self.inner.ctx.name()
            );
        }
        match MemoryRegion::register_with(&self.inner.pd, arena, Access::LocalOnly) {
            Ok(mr) => {
                self.inner.windows_ok.store(windows, Ordering::Relaxed);
                let counters = &self.inner.links.counters;
                counters.registrations.fetch_add(1, Ordering::Relaxed);
                *self.inner.arena.lock().unwrap() = Some(Arc::new(mr));
                Ok(())
            }
            Err(e) => {
                self.inner.arena_registered.store(false, Ordering::Release);
                Err(e.into())
            }
        }
    }

    fn grant(
        &self,
        peer: NodeId,
        offset: u64,
        len: u64,
        keep: phalanx_transport::KeepAlive,
    ) -> Result<RemoteRegion, TransportError> {
        let inner = &self.inner;
        let mr = inner.arena_mr()?;
        mr.arena().check(offset, len)?;
        // Only a grant the grantee may write by rendezvous needs a window.
        let bound = if len >= inner.rendezvous_threshold.load(Ordering::Relaxed) {
            inner.bind_window(peer, &mr, offset, len, &keep)?
        } else {
            None
        };
        let grant = inner.grants.grant(peer, offset, len, keep);
        let (addr, rkey) = match bound {
            Some(w) => {
                let key = (w.addr(), w.rkey);
                inner.windows.lock().unwrap().insert(grant, w);
                key
            }
            None => (0, 0),
        };
        Ok(RemoteRegion {
            node: inner.id,
            offset,
            len,
            addr,
            rkey,
            grant,
        })
    }

    /// Deallocating the window and the registration makes the NIC refuse the grantee's
    /// writes from here on.
    fn revoke(&self, peer: NodeId, region: &RemoteRegion) {
        let mut windows = self.inner.windows.lock().unwrap();
        let mine = windows.get(&region.grant).is_some_and(|w| w.peer == peer);
        let w = if mine {
            windows.remove(&region.grant)
        } else {
            None
        };
        drop(windows);
        drop(w);
        self.inner.grants.revoke(peer, region.grant);
    }

    fn send(&self, peer: NodeId, msg: &[u8]) -> Result<(), TransportError> {
        check_ctrl_len(msg)?;
        let inner = &self.inner;
        loop {
            let conn = inner.links.link(peer)?;
            let mut tx = match inner.lock_tx(&conn) {
                Ok(tx) => tx,
                // Closed for being idle under us: nothing went; the next link takes it.
                Err(_) if conn.is_retiring() => continue,
                Err(e) => return Err(e),
            };
            return inner.send_ctrl(&conn, &mut tx, msg);
        }
    }

    /// Small writes (below the rendezvous threshold, or to a region without addr/rkey) take
    /// the eager path, large ones the rendezvous path.
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
        let mr = inner.arena_mr()?;
        mr.arena().check(src_offset, len)?;
        dst.check(dst_offset, len)?;
        if len == 0 {
            inner.links.link(peer)?;
            return Ok(());
        }
        let w = WriteReq {
            stream,
            src_offset,
            dst,
            dst_offset,
            len,
        };
        let rendezvous = len >= inner.rendezvous_threshold.load(Ordering::Relaxed)
            && dst.rkey != 0
            && dst.addr != 0;
        loop {
            let conn = inner.links.link(peer)?;
            let r = if rendezvous {
                inner.write_rendezvous(&conn, &mr, &w)
            } else {
                inner.write_eager(&conn, &mr, &w)
            };
            match r {
                // Closed for being idle before anything went (both paths refuse a retiring
                // link at their first send lock, and fail otherwise): the next link.
                Err(TransportError::PeerUnavailable(_)) if conn.is_retiring() => continue,
                r => return r,
            }
        }
    }

    fn send_nonblocking(&self, peer: NodeId, msg: &[u8]) -> Result<bool, TransportError> {
        check_ctrl_len(msg)?;
        let Some(conn) = self.inner.links.link_nonblocking(peer)? else {
            return Ok(false);
        };
        self.inner.try_send_ctrl(&conn, msg)
    }
}
