//! The TCP transport: one connection per pair of nodes, a fixed set of reader threads (epoll)
//! that read payloads straight into the registered arena, `writev` for header + payload, and
//! heartbeats that bound how long a dead peer goes unnoticed.
//!
//! - `config`: [`TcpConfig`];
//! - `setup`: dial, the acceptor's hello, installing a link;
//! - `conn`: a connection and its sending side (frames, non-blocking control, the flusher);
//! - `reader`: the reader threads and the reading of a connection's frames;
//! - `heartbeat`: the heartbeat thread;
//! - here: [`TcpTransport`] and its [`Transport`] implementation.

mod config;
mod conn;
mod heartbeat;
mod idle;
mod reader;
mod setup;

pub use config::TcpConfig;

use crate::auth::Channel;
use crate::frame::{FrameHeader, FrameKind};
use crate::{
    check_ctrl_len, Arena, GrantTable, KeepAlive, Link, LinkTable, NodeId, RemoteRegion, StreamId,
    Transport, TransportError,
};
use conn::Conn;
use crossbeam_channel::Sender;
use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

struct Inner {
    id: NodeId,
    cfg: TcpConfig,
    arena: OnceLock<Arc<Arena>>,
    /// Which peer may write where: every data frame is checked here before it lands.
    grants: GrantTable,
    links: Arc<LinkTable<Conn>>,
    /// Connections whose writer has a tail for the flusher thread to send.
    flush_tx: Sender<Arc<Conn>>,
    /// Where installed connections are read.
    readers: OnceLock<reader::Readers>,
    /// The peers whose links may not close for being idle (see `idle`).
    idle_guard: OnceLock<crate::IdleGuard>,
    /// The peers this node watches (see `Transport::set_watch`); unset: every link.
    watch: OnceLock<crate::Watch>,
    /// Links this node closed for being idle, still read until the peer closes them, with
    /// when they were closed (see `idle`).
    draining: Mutex<Vec<(Arc<Conn>, std::time::Instant)>>,
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
        let (flush_tx, flush_rx) = crossbeam_channel::unbounded();
        let links = LinkTable::new(id, listen_addr, "link").with_auth(
            cfg.auth.clone(),
            Channel::Tcp,
            cfg.heartbeat_timeout,
        );
        let inner = Arc::new(Inner {
            id,
            cfg,
            arena: OnceLock::new(),
            grants: GrantTable::new(),
            links: Arc::new(links),
            flush_tx,
            readers: OnceLock::new(),
            idle_guard: OnceLock::new(),
            watch: OnceLock::new(),
            draining: Mutex::new(Vec::new()),
            threads: Mutex::new(Vec::new()),
        });
        // A reader of a link's own waits in a blocking `recv`, which cannot poll: with
        // `poll_spin`, the epoll readers read every link.
        let dedicated = match inner.cfg.poll_spin.is_zero() {
            true => inner.cfg.dedicated_readers,
            false => 0,
        };
        let readers = reader::Readers::start(&inner, inner.cfg.readers, dedicated)?;
        let _ = inner.readers.set(readers);
        let acc = inner.clone();
        let t = crate::threads::spawn(id, "accept", move || {
            let links = acc.links.clone();
            let failed = "cannot install connection";
            links.accept_loop(listener, "hello", failed, move |s, peer| {
                acc.handshake(s, peer)
            })
        })?;
        let hb = inner.clone();
        let h = crate::threads::spawn(id, "hb", move || hb.heartbeat_loop())?;
        let fl = inner.clone();
        let f = crate::threads::spawn(id, "flush", move || fl.flush_loop(flush_rx))?;
        inner.threads.lock().unwrap().extend([t, h, f]);
        Ok(TcpTransport { inner })
    }

    crate::connect_methods!(inner);
}

impl Inner {
    /// Sends one frame to `peer` on its current link (made now if links are made on
    /// demand); a link closed for being idle under the sender is replaced by the next one.
    fn send_on_link(
        &self,
        peer: NodeId,
        h: &FrameHeader,
        payload: &[u8],
    ) -> Result<(), TransportError> {
        loop {
            let conn = self.links.link(peer)?;
            match self.send_frame(&conn, h, payload) {
                Err(_) if conn.is_retiring() => continue,
                r => return r,
            }
        }
    }

    fn close_all(&self, goodbye: bool) {
        let Some(conns) = self.links.close() else {
            return;
        };
        let bye = FrameHeader::control(FrameKind::Bye, 0).encode();
        for c in conns {
            if goodbye {
                if let Ok(mut w) = c.writer.lock() {
                    let _ = w.flush_tail(&c).and_then(|_| (&*w.stream).write_all(&bye));
                }
            }
            c.shut();
        }
        self.links.wake_accept_loop();
    }
}

impl Transport for TcpTransport {
    crate::transport_link_methods!(inner);

    fn name(&self) -> &'static str {
        "tcp"
    }

    fn set_idle_guard(&self, guard: crate::IdleGuard) {
        let _ = self.inner.idle_guard.set(guard);
    }

    fn set_watch(&self, watch: crate::Watch) -> bool {
        let _ = self.inner.watch.set(watch);
        true
    }

    fn freeze(&self) -> bool {
        self.inner.links.freeze();
        true
    }

    fn register_arena(&self, arena: Arc<Arena>) -> Result<(), TransportError> {
        self.inner
            .arena
            .set(arena)
            .map_err(|_| TransportError::ArenaAlreadyRegistered)?;
        let counters = &self.inner.links.counters;
        counters.registrations.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn grant(
        &self,
        peer: NodeId,
        offset: u64,
        len: u64,
        keep: KeepAlive,
    ) -> Result<RemoteRegion, TransportError> {
        let arena = self.inner.arena.get().ok_or(TransportError::NoArena)?;
        arena.check(offset, len)?;
        let grant = self.inner.grants.grant(peer, offset, len, keep);
        Ok(RemoteRegion {
            node: self.inner.id,
            offset,
            len,
            addr: 0,
            rkey: 0,
            grant,
        })
    }

    fn revoke(&self, peer: NodeId, region: &RemoteRegion) {
        self.inner.grants.revoke(peer, region.grant);
    }

    fn send(&self, peer: NodeId, msg: &[u8]) -> Result<(), TransportError> {
        check_ctrl_len(msg)?;
        let h = FrameHeader::control(FrameKind::Ctrl, msg.len() as u64);
        self.inner.send_on_link(peer, &h, msg)?;
        let counters = &self.inner.links.counters;
        counters.ctrl_sent.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn send_nonblocking(&self, peer: NodeId, msg: &[u8]) -> Result<bool, TransportError> {
        check_ctrl_len(msg)?;
        let Some(conn) = self.inner.links.link_nonblocking(peer)? else {
            return Ok(false);
        };
        let sent = self.inner.send_nonblocking(&conn, msg)?;
        if sent {
            let counters = &self.inner.links.counters;
            counters.ctrl_sent.fetch_add(1, Ordering::Relaxed);
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
        let max = self.inner.cfg.max_frame.max(4096) as u64;
        let counters = &self.inner.links.counters;
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
            self.inner.send_on_link(peer, &h, src)?;
            counters.data_bytes_sent.fetch_add(n, Ordering::Relaxed);
            done += n;
        }
        Ok(())
    }

    fn write_nonblocking(
        &self,
        peer: NodeId,
        stream: StreamId,
        src_offset: u64,
        dst: &RemoteRegion,
        dst_offset: u64,
        len: u64,
    ) -> Result<bool, TransportError> {
        let arena = self.inner.arena.get().ok_or(TransportError::NoArena)?;
        arena.check(src_offset, len)?;
        dst.check(dst_offset, len)?;
        if len > self.inner.cfg.max_frame as u64 {
            return Ok(false); // one frame or nothing
        }
        let Some(conn) = self.inner.links.link_nonblocking(peer)? else {
            return Ok(false);
        };
        let h = FrameHeader {
            kind: FrameKind::Data,
            len,
            stream,
            dst: dst.offset + dst_offset,
            rel: dst_offset,
        };
        // SAFETY: bounds checked above; the caller keeps the source range allocated and
        // unchanged until this call returns, and what the socket does not take is copied.
        let src = unsafe { arena.slice(src_offset, len) };
        let sent = self.inner.frame_nonblocking(&conn, &h, src)?;
        if sent {
            let counters = &self.inner.links.counters;
            counters.data_bytes_sent.fetch_add(len, Ordering::Relaxed);
        }
        Ok(sent)
    }
}
