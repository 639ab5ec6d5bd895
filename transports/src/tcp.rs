//! The TCP transport: one connection per pair of nodes, a reader thread per connection that
//! reads payloads straight into the registered arena, `writev` for header + payload, and
//! heartbeats that bound how long a dead peer goes unnoticed.

use crate::frame::{FrameHeader, FrameKind, FRAME_HEADER_LEN};
use crate::{
    Arena, Event, EventHandler, NodeId, RemoteRegion, StreamId, Transport, TransportError,
    TransportStats,
};
use crossbeam_channel::{Receiver, Sender};
use std::collections::HashMap;
use std::io::{BufReader, ErrorKind, IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tracing::{debug, error, info, warn};

/// Settings of the TCP transport.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// A peer silent for this long is reported down. Heartbeats go out at a quarter of it.
    pub heartbeat_timeout: Duration,
    /// How long `connect` waits for the whole mesh to come up.
    pub connect_timeout: Duration,
    /// SO_SNDBUF / SO_RCVBUF in bytes; 0 keeps the kernel's autotuning.
    pub socket_buffer: usize,
    /// Largest data frame; larger writes are split so control messages can interleave.
    pub max_frame: usize,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            heartbeat_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(30),
            socket_buffer: 0,
            max_frame: 1 << 20,
        }
    }
}

#[derive(Default)]
struct Counters {
    ctrl_sent: AtomicU64,
    ctrl_received: AtomicU64,
    data_bytes_sent: AtomicU64,
    data_bytes_received: AtomicU64,
    peers_down: AtomicU64,
    malformed_frames: AtomicU64,
}

struct Conn {
    peer: NodeId,
    socket: TcpStream,
    writer: Mutex<Writer>,
    /// Nanoseconds since the transport's epoch of the last frame sent.
    last_send: AtomicU64,
    dead: AtomicBool,
}

/// The sending side of a connection. `tail` holds the unsent rest of frames queued by
/// [`Transport::send_nonblocking`]; every writer sends it first, so frames stay whole and in
/// order.
struct Writer {
    stream: TcpStream,
    tail: Vec<u8>,
}

impl Writer {
    fn flush_tail(&mut self) -> std::io::Result<()> {
        if !self.tail.is_empty() {
            self.stream.write_all(&self.tail)?;
            self.tail.clear();
        }
        Ok(())
    }
}

struct Inner {
    id: NodeId,
    cfg: TcpConfig,
    listen_addr: SocketAddr,
    epoch: Instant,
    arena: OnceLock<Arc<Arena>>,
    conns: Mutex<HashMap<NodeId, Arc<Conn>>>,
    conns_changed: Condvar,
    events_tx: Sender<Event>,
    events_rx: Receiver<Event>,
    handler: OnceLock<EventHandler>,
    /// Connections whose writer has a tail for the flusher thread to send.
    flush_tx: Sender<Arc<Conn>>,
    counters: Counters,
    closing: AtomicBool,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// TCP implementation of [`Transport`].
#[derive(Clone)]
pub struct TcpTransport {
    inner: Arc<Inner>,
}

impl TcpTransport {
    /// Binds the listener of node `id` and starts accepting peers. Port 0 picks a free port;
    /// [`TcpTransport::listen_addr`] tells which.
    pub fn bind(
        id: NodeId,
        addr: SocketAddr,
        cfg: TcpConfig,
    ) -> Result<TcpTransport, TransportError> {
        let listener = TcpListener::bind(addr)
            .map_err(|e| TransportError::Setup(format!("node {id}: bind {addr}: {e}")))?;
        let listen_addr = listener.local_addr()?;
        let (events_tx, events_rx) = crossbeam_channel::unbounded();
        let (flush_tx, flush_rx) = crossbeam_channel::unbounded();
        let inner = Arc::new(Inner {
            id,
            cfg,
            listen_addr,
            epoch: Instant::now(),
            arena: OnceLock::new(),
            conns: Mutex::new(HashMap::new()),
            conns_changed: Condvar::new(),
            events_tx,
            events_rx,
            handler: OnceLock::new(),
            flush_tx,
            counters: Counters::default(),
            closing: AtomicBool::new(false),
            threads: Mutex::new(Vec::new()),
        });
        let acc = inner.clone();
        let t = std::thread::Builder::new()
            .name(format!("phx-accept-{id}"))
            .spawn(move || acc.accept_loop(listener))?;
        let hb = inner.clone();
        let h = std::thread::Builder::new()
            .name(format!("phx-heartbeat-{id}"))
            .spawn(move || hb.heartbeat_loop())?;
        let fl = inner.clone();
        let f = std::thread::Builder::new()
            .name(format!("phx-flush-{id}"))
            .spawn(move || fl.flush_loop(flush_rx))?;
        inner.threads.lock().unwrap().extend([t, h, f]);
        Ok(TcpTransport { inner })
    }

    /// Connects to `peers`: dials those with a lower id (all of them with `dial_all`, as a
    /// restarted node does to rejoin) and waits until every peer is linked, up to the connect
    /// timeout.
    pub fn connect(
        &self,
        peers: &[(NodeId, SocketAddr)],
        dial_all: bool,
    ) -> Result<(), TransportError> {
        let inner = &self.inner;
        crate::mesh::connect_mesh(
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

    fn emit(&self, ev: Event) -> Result<(), ()> {
        match self.handler.get() {
            Some(h) => {
                h(ev);
                Ok(())
            }
            None => self.events_tx.send(ev).map_err(|_| ()),
        }
    }

    fn tune(&self, s: &TcpStream) -> std::io::Result<()> {
        s.set_nodelay(true)?;
        if self.cfg.socket_buffer > 0 {
            use nix::sys::socket::{setsockopt, sockopt};
            let n = self.cfg.socket_buffer;
            setsockopt(&s.as_fd(), sockopt::SndBuf, &n).map_err(std::io::Error::from)?;
            setsockopt(&s.as_fd(), sockopt::RcvBuf, &n).map_err(std::io::Error::from)?;
        }
        Ok(())
    }

    fn dial(
        self: &Arc<Self>,
        peer: NodeId,
        addr: SocketAddr,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let mut backoff = Duration::from_millis(5);
        let s = loop {
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
                    return Err(TransportError::Setup(format!(
                        "node {}: cannot reach peer {peer} at {addr}: {e}",
                        self.id
                    )))
                }
            }
        };
        self.tune(&s)?;
        let hello = FrameHeader {
            kind: FrameKind::Hello,
            len: 0,
            stream: self.id as u64,
            dst: 0,
            rel: 0,
        };
        (&s).write_all(&hello.encode())?;
        self.install(peer, s)
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
            // The handshake runs on its own thread so a silent client cannot stall accepts.
            let _ = std::thread::Builder::new()
                .name(format!("phx-hello-{}", self.id))
                .spawn(move || me.handshake(s));
        }
    }

    fn handshake(self: Arc<Self>, s: TcpStream) {
        let from = s.peer_addr().ok();
        let res = (|| -> Result<NodeId, TransportError> {
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            let mut b = [0u8; FRAME_HEADER_LEN];
            (&s).read_exact(&mut b)?;
            let h = FrameHeader::decode(&b)?;
            if h.kind != FrameKind::Hello || h.stream > NodeId::MAX as u64 {
                return Err(TransportError::Malformed(format!(
                    "expected hello, got {:?}",
                    h.kind
                )));
            }
            Ok(h.stream as NodeId)
        })();
        match res {
            Ok(peer) => {
                if let Err(e) = self
                    .tune(&s)
                    .map_err(TransportError::from)
                    .and_then(|_| self.install(peer, s))
                {
                    warn!(node = self.id, peer, "cannot install connection: {e}");
                }
            }
            Err(e) => {
                if matches!(
                    e,
                    TransportError::Malformed(_) | TransportError::MessageTooLarge { .. }
                ) {
                    self.counters
                        .malformed_frames
                        .fetch_add(1, Ordering::Relaxed);
                }
                if !self.closing.load(Ordering::Acquire) {
                    error!(
                        node = self.id,
                        ?from,
                        "dropping connection before hello: {e}"
                    );
                }
            }
        }
    }

    fn install(self: &Arc<Self>, peer: NodeId, s: TcpStream) -> Result<(), TransportError> {
        s.set_read_timeout(Some(self.cfg.heartbeat_timeout))?;
        s.set_write_timeout(Some(self.cfg.heartbeat_timeout * 2))?;
        let conn = Arc::new(Conn {
            peer,
            writer: Mutex::new(Writer {
                stream: s.try_clone()?,
                tail: Vec::new(),
            }),
            socket: s,
            last_send: AtomicU64::new(self.now_ns()),
            dead: AtomicBool::new(false),
        });
        let reader = conn.socket.try_clone()?;
        let replaced = {
            let mut conns = self.conns.lock().unwrap();
            let old = conns.insert(peer, conn.clone());
            self.conns_changed.notify_all();
            old
        };
        if let Some(old) = replaced {
            // A restarted peer replaces its old link: the old incarnation is dead even if we
            // had not noticed yet. Its reader exits silently; we report the death here.
            old.dead.store(true, Ordering::Release);
            let _ = old.socket.shutdown(Shutdown::Both);
            self.counters.peers_down.fetch_add(1, Ordering::Relaxed);
            let _ = self.emit(Event::PeerDown {
                peer,
                reason: "peer restarted".into(),
            });
        }
        info!(node = self.id, peer, "link up");
        let _ = self.emit(Event::PeerUp { peer });
        let me = self.clone();
        let h = std::thread::Builder::new()
            .name(format!("phx-rx-{}-{peer}", self.id))
            .spawn(move || me.read_loop(conn, reader))?;
        let mut threads = self.threads.lock().unwrap();
        threads.retain(|t| !t.is_finished());
        threads.push(h);
        Ok(())
    }

    fn read_loop(self: Arc<Self>, conn: Arc<Conn>, s: TcpStream) {
        let peer = conn.peer;
        // Small frames come out of the buffer (one read syscall for many of them); payloads
        // larger than the buffer bypass it and land straight in the arena.
        let mut s = BufReader::with_capacity(64 << 10, s);
        let reason = loop {
            match self.read_frame(peer, &mut s) {
                Ok(true) => continue,
                Ok(false) => break None,
                Err(e) => break Some(e),
            }
        };
        let reason = match reason {
            None => crate::PEER_LEFT.to_string(),
            Some(TransportError::Io(e))
                if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) =>
            {
                format!("no heartbeat for {:?}", self.cfg.heartbeat_timeout)
            }
            Some(TransportError::Io(e)) if e.kind() == ErrorKind::UnexpectedEof => {
                "connection closed without goodbye".to_string()
            }
            Some(
                e @ (TransportError::Malformed(_)
                | TransportError::MessageTooLarge { .. }
                | TransportError::OutOfBounds { .. }),
            ) => {
                self.counters
                    .malformed_frames
                    .fetch_add(1, Ordering::Relaxed);
                error!(
                    node = self.id,
                    peer, "dropping link after malformed frame: {e}"
                );
                format!("malformed frame: {e}")
            }
            Some(e) => e.to_string(),
        };
        self.drop_conn(&conn, reason);
    }

    /// Reads one frame; `Ok(false)` on a goodbye.
    fn read_frame(
        &self,
        peer: NodeId,
        s: &mut BufReader<TcpStream>,
    ) -> Result<bool, TransportError> {
        let mut b = [0u8; FRAME_HEADER_LEN];
        s.read_exact(&mut b)?;
        let h = FrameHeader::decode(&b)?;
        match h.kind {
            FrameKind::Heartbeat => Ok(true),
            FrameKind::Bye => Ok(false),
            FrameKind::Hello => Err(TransportError::Malformed("hello on a live link".into())),
            FrameKind::Ctrl => {
                let mut msg = vec![0u8; h.len as usize];
                s.read_exact(&mut msg)?;
                self.counters.ctrl_received.fetch_add(1, Ordering::Relaxed);
                let _ = self.emit(Event::Ctrl { peer, msg });
                Ok(true)
            }
            FrameKind::Data => {
                let arena = self.arena.get().ok_or(TransportError::NoArena)?;
                arena.check(h.dst, h.len)?;
                // SAFETY: bounds checked above; the store reserved this range for the stream
                // and nobody else reads or writes it until the Data event below is handled.
                let dst = unsafe { arena.slice_mut(h.dst, h.len) };
                s.read_exact(dst)?;
                self.counters
                    .data_bytes_received
                    .fetch_add(h.len, Ordering::Relaxed);
                let _ = self.emit(Event::Data {
                    peer,
                    stream: h.stream,
                    offset: h.rel,
                    len: h.len,
                });
                Ok(true)
            }
        }
    }

    fn drop_conn(&self, conn: &Arc<Conn>, reason: String) {
        let _ = conn.socket.shutdown(Shutdown::Both);
        let was_dead = conn.dead.swap(true, Ordering::AcqRel);
        let mut conns = self.conns.lock().unwrap();
        let current = conns.get(&conn.peer).is_some_and(|c| Arc::ptr_eq(c, conn));
        if current {
            conns.remove(&conn.peer);
            self.conns_changed.notify_all();
        }
        drop(conns);
        if current && !self.closing.load(Ordering::Acquire) {
            if reason == crate::PEER_LEFT {
                info!(node = self.id, peer = conn.peer, "link closed: {reason}");
            } else if !was_dead {
                warn!(node = self.id, peer = conn.peer, "link down: {reason}");
            }
            self.counters.peers_down.fetch_add(1, Ordering::Relaxed);
            let _ = self.emit(Event::PeerDown {
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

    /// Writes one frame under the connection's writer lock, header and payload in one writev.
    fn send_frame(
        &self,
        conn: &Arc<Conn>,
        h: &FrameHeader,
        payload: &[u8],
    ) -> Result<(), TransportError> {
        let head = h.encode();
        let res = {
            let mut w = conn.writer.lock().unwrap();
            if conn.dead.load(Ordering::Acquire) {
                return Err(TransportError::PeerUnavailable(conn.peer));
            }
            w.flush_tail()
                .and_then(|_| write_all_vectored(&mut w.stream, &head, payload))
        };
        conn.last_send.store(self.now_ns(), Ordering::Relaxed);
        res.map_err(|e| {
            let reason = format!("send failed: {e}");
            self.drop_conn(conn, reason.clone());
            TransportError::PeerFailed {
                peer: conn.peer,
                reason,
            }
        })
    }

    /// Sends the tails left by non-blocking sends; blocking here is harmless, this thread
    /// does nothing else.
    fn flush_loop(self: Arc<Self>, rx: Receiver<Arc<Conn>>) {
        while !self.closing.load(Ordering::Acquire) {
            let Ok(c) = rx.recv_timeout(Duration::from_millis(200)) else {
                continue;
            };
            let r = c.writer.lock().unwrap().flush_tail();
            if let Err(e) = r {
                self.drop_conn(&c, format!("send failed: {e}"));
            }
        }
    }

    /// Queues a control frame without ever blocking: written at once if the socket takes it,
    /// else (the rest) left as the writer's tail for the flusher. False if the writer is busy.
    fn send_nonblocking(&self, conn: &Arc<Conn>, msg: &[u8]) -> Result<bool, TransportError> {
        let Ok(mut w) = conn.writer.try_lock() else {
            return Ok(false);
        };
        if conn.dead.load(Ordering::Acquire) {
            return Err(TransportError::PeerUnavailable(conn.peer));
        }
        let head = FrameHeader::control(FrameKind::Ctrl, msg.len() as u64).encode();
        if w.tail.is_empty() {
            use nix::sys::socket::{sendmsg, MsgFlags};
            let iov = [IoSlice::new(&head), IoSlice::new(msg)];
            let fd = std::os::fd::AsRawFd::as_raw_fd(&w.stream);
            let sent = match sendmsg::<nix::sys::socket::SockaddrStorage>(
                fd,
                &iov,
                &[],
                MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL,
                None,
            ) {
                Ok(n) => n,
                Err(nix::errno::Errno::EAGAIN) => 0,
                Err(e) => {
                    drop(w);
                    let reason = format!("send failed: {e}");
                    self.drop_conn(conn, reason.clone());
                    return Err(TransportError::PeerFailed {
                        peer: conn.peer,
                        reason,
                    });
                }
            };
            if sent < head.len() {
                w.tail.extend_from_slice(&head[sent..]);
                w.tail.extend_from_slice(msg);
            } else {
                w.tail.extend_from_slice(&msg[sent - head.len()..]);
            }
        } else {
            w.tail.extend_from_slice(&head);
            w.tail.extend_from_slice(msg);
        }
        let queued = !w.tail.is_empty();
        drop(w);
        conn.last_send.store(self.now_ns(), Ordering::Relaxed);
        if queued {
            let _ = self.flush_tx.send(conn.clone());
        }
        Ok(true)
    }

    fn heartbeat_loop(self: Arc<Self>) {
        let period = self.cfg.heartbeat_timeout / 4;
        let hb = FrameHeader::control(FrameKind::Heartbeat, 0).encode();
        while !self.closing.load(Ordering::Acquire) {
            std::thread::sleep(period);
            let conns: Vec<Arc<Conn>> = self.conns.lock().unwrap().values().cloned().collect();
            let now = self.now_ns();
            for c in conns {
                if now.saturating_sub(c.last_send.load(Ordering::Relaxed))
                    < period.as_nanos() as u64
                {
                    continue;
                }
                // A held writer lock means a frame is on its way, which is proof of life.
                if let Ok(mut w) = c.writer.try_lock() {
                    if c.dead.load(Ordering::Acquire) {
                        continue;
                    }
                    let r = w.flush_tail().and_then(|_| w.stream.write_all(&hb));
                    drop(w);
                    c.last_send.store(self.now_ns(), Ordering::Relaxed);
                    if let Err(e) = r {
                        self.drop_conn(&c, format!("heartbeat failed: {e}"));
                    }
                }
            }
        }
    }

    fn close_all(&self, goodbye: bool) {
        if self.closing.swap(true, Ordering::AcqRel) {
            return;
        }
        let conns: Vec<Arc<Conn>> = self.conns.lock().unwrap().drain().map(|(_, c)| c).collect();
        let bye = FrameHeader::control(FrameKind::Bye, 0).encode();
        for c in conns {
            if goodbye {
                if let Ok(mut w) = c.writer.lock() {
                    let _ = w.flush_tail().and_then(|_| w.stream.write_all(&bye));
                }
            }
            c.dead.store(true, Ordering::Release);
            let _ = c.socket.shutdown(Shutdown::Both);
        }
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect_timeout(&self.listen_addr, Duration::from_millis(200));
    }
}

/// `write_all` for a header and a payload with as few `writev` calls as the kernel allows.
fn write_all_vectored(w: &mut TcpStream, head: &[u8], payload: &[u8]) -> std::io::Result<()> {
    let mut bufs = [IoSlice::new(head), IoSlice::new(payload)];
    let mut bufs: &mut [IoSlice<'_>] = &mut bufs;
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn local_id(&self) -> NodeId {
        self.inner.id
    }

    fn register_arena(&self, arena: Arc<Arena>) -> Result<(), TransportError> {
        self.inner
            .arena
            .set(arena)
            .map_err(|_| TransportError::ArenaAlreadyRegistered)
    }

    fn remote_region(&self, offset: u64, len: u64) -> Result<RemoteRegion, TransportError> {
        let arena = self.inner.arena.get().ok_or(TransportError::NoArena)?;
        arena.check(offset, len)?;
        Ok(RemoteRegion {
            node: self.inner.id,
            offset,
            len,
            addr: 0,
            rkey: 0,
        })
    }

    fn send(&self, peer: NodeId, msg: &[u8]) -> Result<(), TransportError> {
        if msg.len() > crate::MAX_CTRL_LEN {
            return Err(TransportError::MessageTooLarge {
                len: msg.len(),
                max: crate::MAX_CTRL_LEN,
            });
        }
        let conn = self.inner.conn(peer)?;
        let h = FrameHeader::control(FrameKind::Ctrl, msg.len() as u64);
        self.inner.send_frame(&conn, &h, msg)?;
        self.inner
            .counters
            .ctrl_sent
            .fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn send_nonblocking(&self, peer: NodeId, msg: &[u8]) -> Result<bool, TransportError> {
        if msg.len() > crate::MAX_CTRL_LEN {
            return Err(TransportError::MessageTooLarge {
                len: msg.len(),
                max: crate::MAX_CTRL_LEN,
            });
        }
        let conn = self.inner.conn(peer)?;
        let sent = self.inner.send_nonblocking(&conn, msg)?;
        if sent {
            self.inner
                .counters
                .ctrl_sent
                .fetch_add(1, Ordering::Relaxed);
        }
        Ok(sent)
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
        let arena = self.inner.arena.get().ok_or(TransportError::NoArena)?;
        arena.check(src_offset, len)?;
        dst.check(dst_offset, len)?;
        let conn = self.inner.conn(peer)?;
        let max = self.inner.cfg.max_frame.max(4096) as u64;
        let mut done = 0;
        while done < len {
            let n = (len - done).min(max);
            let h = FrameHeader {
                kind: FrameKind::Data,
                len: n,
                stream,
                dst: dst.offset + dst_offset + done,
                rel: dst_offset + done,
            };
            // SAFETY: bounds checked above; the caller keeps the source range allocated and
            // unchanged until this call returns (trait contract).
            let src = unsafe { arena.slice(src_offset + done, n) };
            self.inner.send_frame(&conn, &h, src)?;
            self.inner
                .counters
                .data_bytes_sent
                .fetch_add(n, Ordering::Relaxed);
            done += n;
        }
        Ok(())
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
            payload_bytes_copied: 0,
            registrations: self.inner.arena.get().is_some() as u64,
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
