//! One TCP connection and its sending side: whole frames under the writer lock, and the
//! non-blocking path whose leftovers the flusher thread sends.
//!
//! No thread of the transport or of its user ever waits on a slow peer outside its own
//! blocking `send`/`write` call: a non-blocking frame that finds the writer busy (another
//! thread is in the middle of a frame to that peer) goes to the connection's overflow queue,
//! which the next holder of the writer lock sends first; the flusher only ever writes with
//! `MSG_DONTWAIT`. What waits for one peer (its unsent tail and its overflow together) is
//! bounded by [`MAX_QUEUED`]: a peer that lets more pile up is not reading and its link is
//! failed, as is one whose socket takes nothing for twice the heartbeat timeout (the socket's
//! send timeout).

use super::Inner;
use crate::frame::{FrameHeader, FrameKind};
use crate::{Link, LinkState, TransportError};
use crossbeam_channel::Receiver;
use std::io::{ErrorKind, IoSlice, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Most bytes that may wait for one peer, in its unsent tail and its overflow queue together,
/// before its link is failed.
pub(super) const MAX_QUEUED: usize = 64 << 20;

/// Most bytes a control frame may find waiting (with itself) in the overflow and the tail of
/// a connection whose writer is busy and still be queued there rather than wait for the
/// writer (see `Inner::queue_behind_writer`).
const PRIORITY_QUEUED: usize = 256 << 10;

pub(super) struct Conn {
    pub(super) link: LinkState,
    /// The connection's one socket, shared by its writer and its reader.
    pub(super) socket: Arc<TcpStream>,
    pub(super) writer: Mutex<Writer>,
    /// Nanoseconds since the transport's epoch of the last frame sent.
    pub(super) last_send: AtomicU64,
    /// ... of the last control or data frame sent or received (heartbeats do not count): how
    /// long the link has been idle.
    pub(super) last_used: AtomicU64,
    /// ... of the last heartbeat received that asked for an answer (the peer watches this
    /// node; 0: never): heartbeats go back while it is recent (see `heartbeat`).
    pub(super) peer_watches: AtomicU64,
    /// ... of the first flagged heartbeat this node sent since it began watching the peer
    /// (0: not watching it): a link that was quiet while nobody watched it is given a full
    /// heartbeat timeout from then before its silence counts.
    pub(super) watching_since: AtomicU64,
    /// The peer closed the link for being idle: the flusher shuts it once nothing is queued.
    pub(super) close_when_flushed: std::sync::atomic::AtomicBool,
    /// Whole frames queued while another thread held the writer; sent, in order, by the next
    /// holder of the writer lock before anything else.
    pub(super) overflow: Mutex<Vec<u8>>,
    /// Bytes in the writer's tail as its last holder left it: what the overflow queues behind,
    /// counted against [`MAX_QUEUED`] without waiting for the writer lock.
    pub(super) tail_len: std::sync::atomic::AtomicUsize,
    /// The writer's holder is writing a data frame (which may wait for the peer's share of a
    /// busy link): a control frame then queues behind it (`Inner::queue_behind_writer`)
    /// rather than wait for the lock.
    pub(super) writing_data: std::sync::atomic::AtomicBool,
}

impl Link for Conn {
    fn state(&self) -> &LinkState {
        &self.link
    }

    /// Shuts the socket down: the reader sees EOF or an error and exits.
    fn stop(&self) {
        let _ = self.socket.shutdown(Shutdown::Both);
    }
}

/// The sending side of a connection. `tail` holds the unsent rest of frames queued by
/// [`crate::Transport::send_nonblocking`]; every writer sends it first, so frames stay whole
/// and in order.
pub(super) struct Writer {
    pub(super) stream: Arc<TcpStream>,
    pub(super) tail: Vec<u8>,
    /// Bytes handed to the socket so far (the flusher's measure of progress).
    pub(super) written: u64,
}

impl Writer {
    /// Moves the connection's overflow behind the tail (the caller holds the writer lock).
    pub(super) fn absorb(&mut self, conn: &Conn) {
        let mut o = conn.overflow.lock().unwrap();
        if !o.is_empty() {
            if self.tail.is_empty() {
                std::mem::swap(&mut self.tail, &mut o);
            } else {
                self.tail.extend_from_slice(&o);
                o.clear();
            }
        }
    }

    /// Sends the tail (and the overflow), blocking (bounded by the socket's send timeout).
    pub(super) fn flush_tail(&mut self, conn: &Conn) -> std::io::Result<()> {
        self.absorb(conn);
        if !self.tail.is_empty() {
            (&*self.stream).write_all(&self.tail)?;
            self.written += self.tail.len() as u64;
            self.tail.clear();
            conn.tail_len.store(0, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Sends as much of the tail (and the overflow) as the socket takes without blocking;
    /// returns whether anything is left.
    pub(super) fn flush_some(&mut self, conn: &Conn) -> std::io::Result<bool> {
        self.absorb(conn);
        while !self.tail.is_empty() {
            match send_dontwait(&self.stream, &[IoSlice::new(&self.tail)]) {
                Ok(0) => break,
                Ok(n) => {
                    self.tail.drain(..n);
                    self.written += n as u64;
                }
                Err(e) => return Err(e),
            }
        }
        conn.tail_len.store(self.tail.len(), Ordering::Relaxed);
        Ok(!self.tail.is_empty())
    }
}

/// Waits until one of `sockets` can take bytes, or `timeout`.
fn wait_writable(sockets: &[Arc<TcpStream>], timeout: Duration) {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::AsFd;
    let mut fds: Vec<PollFd<'_>> = sockets
        .iter()
        .map(|s| PollFd::new(s.as_fd(), PollFlags::POLLOUT))
        .collect();
    let ms = PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX);
    // An error (EINTR) is one more look a moment early.
    let _ = poll(&mut fds, ms);
}

/// One `sendmsg` with `MSG_DONTWAIT`: the bytes the socket took (0 when it is full).
fn send_dontwait(stream: &TcpStream, iov: &[IoSlice<'_>]) -> std::io::Result<usize> {
    use nix::sys::socket::{sendmsg, MsgFlags};
    let fd = std::os::fd::AsRawFd::as_raw_fd(stream);
    match sendmsg::<nix::sys::socket::SockaddrStorage>(
        fd,
        iov,
        &[],
        MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL,
        None,
    ) {
        Ok(n) => Ok(n),
        Err(nix::errno::Errno::EAGAIN) => Ok(0),
        Err(e) => Err(std::io::Error::from(e)),
    }
}

impl Inner {
    /// Fails the link after a send error and returns the error for the caller.
    fn send_failed(&self, conn: &Arc<Conn>, reason: String) -> TransportError {
        self.links.fail(conn, reason.clone());
        TransportError::PeerFailed {
            peer: conn.peer(),
            reason,
        }
    }

    /// A frame (not a heartbeat) goes to `conn`'s peer: with polling readers, the one that
    /// reads that peer polls for the answer (`Readers::sent_to`).
    fn sent(&self, conn: &Conn) {
        let polling = !self.cfg.poll_spin.is_zero();
        if polling && self.readers.get().is_some_and(|r| r.sent_to(conn.peer())) {
            let woken = &self.links.counters.readers_woken;
            woken.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Writes one frame under the connection's writer lock, header and payload in one writev.
    pub(super) fn send_frame(
        &self,
        conn: &Arc<Conn>,
        h: &FrameHeader,
        payload: &[u8],
    ) -> Result<(), TransportError> {
        if self.links.is_frozen() {
            return Ok(()); // a hung host: nothing goes out
        }
        let head = h.encode();
        if h.kind == FrameKind::Ctrl && self.queue_behind_writer(conn, &head, payload)? {
            let now = self.links.now_ns();
            conn.last_send.store(now, Ordering::Relaxed);
            conn.last_used.store(now, Ordering::Relaxed);
            self.sent(conn);
            return Ok(());
        }
        let res = {
            let mut w = conn.writer.lock().unwrap();
            if conn.is_failed() || conn.is_retiring() {
                return Err(TransportError::PeerUnavailable(conn.peer()));
            }
            let data = h.kind == FrameKind::Data;
            if data {
                conn.writing_data.store(true, Ordering::Release);
            }
            let r = w
                .flush_tail(conn)
                .and_then(|_| write_all_vectored(&w.stream, &head, payload));
            if r.is_ok() {
                w.written += (head.len() + payload.len()) as u64;
            }
            // Control frames queued behind this one go out now, not at the next frame (there
            // may be none) or the flusher's wake-up.
            let r = match data {
                true => r.and_then(|_| w.flush_tail(conn)),
                false => r,
            };
            if data {
                conn.writing_data.store(false, Ordering::Release);
            }
            r
        };
        let now = self.links.now_ns();
        conn.last_send.store(now, Ordering::Relaxed);
        if h.kind != FrameKind::Heartbeat {
            conn.last_used.store(now, Ordering::Relaxed);
            self.sent(conn);
        }
        res.map_err(|e| self.send_failed(conn, format!("send failed: {e}")))
    }

    /// Queues a control frame behind the writer another thread holds to write a data frame
    /// (a stream of them to a peer whose link is busy, each write waiting for the socket): that writer
    /// sends the overflow before its next frame, or the flusher as the socket takes it. So
    /// a request or an answer waits for one frame ahead of it, not for a whole stream to go
    /// out. Only while at most [`PRIORITY_QUEUED`] bytes wait: a sender of many control
    /// frames to a peer that reads slowly still waits for it, as before. A frame queued is
    /// sent or lost with the link, like one in the socket: should the writer's frame fail,
    /// the link is failed and the peer reported down, and the frame is not sent. Ok(false): not
    /// queued (the writer is free or writes a control frame, too much waits, or the link is
    /// closing): the caller writes it.
    fn queue_behind_writer(
        &self,
        conn: &Arc<Conn>,
        head: &[u8],
        payload: &[u8],
    ) -> Result<bool, TransportError> {
        // A holder writing a control frame lets go in microseconds: waiting for it is
        // cheaper than the flusher's wake-up, should it let go before sending the queue.
        if head.len() + payload.len() > PRIORITY_QUEUED
            || !conn.writing_data.load(Ordering::Acquire)
        {
            return Ok(false);
        }
        match conn.writer.try_lock() {
            Err(std::sync::TryLockError::WouldBlock) => {}
            Ok(_) | Err(std::sync::TryLockError::Poisoned(_)) => return Ok(false),
        }
        {
            let mut o = conn.overflow.lock().unwrap();
            // Checked under the overflow lock, as `frame_nonblocking` does: a closing link
            // makes sure nothing is queued while it holds that lock.
            let waiting = o.len() + conn.tail_len.load(Ordering::Relaxed);
            if conn.is_retiring() || waiting + head.len() + payload.len() > PRIORITY_QUEUED {
                return Ok(false);
            }
            o.extend_from_slice(head);
            o.extend_from_slice(payload);
        }
        // The writer may have let go meanwhile (after its own look at the queue): send it
        // now if so, else leave it to the writer or, should it be gone, the flusher.
        match conn.writer.try_lock() {
            Ok(mut w) => {
                if let Err(e) = w.flush_tail(conn) {
                    drop(w);
                    return Err(self.send_failed(conn, format!("send failed: {e}")));
                }
            }
            Err(_) => {
                let _ = self.flush_tx.send(conn.clone());
            }
        }
        Ok(true)
    }

    /// Sends what non-blocking sends left queued, never blocking on a peer: each connection
    /// with something queued is offered the bytes its socket takes now, and looked at again as
    /// soon as its socket has room (`poll` for `POLLOUT`), or a millisecond later when its
    /// writer was busy, while anything is left. A connection whose queue does not move for
    /// twice the heartbeat timeout is failed (its peer is not reading).
    pub(super) fn flush_loop(self: Arc<Self>, rx: Receiver<Arc<Conn>>) {
        // Connections with something queued, when bytes last went out to them, and how many
        // had gone out then.
        let mut waiting: Vec<(Arc<Conn>, std::time::Instant, u64)> = Vec::new();
        // Of those, the ones whose socket was full at the last look: woken by its room.
        let mut full: Vec<Arc<TcpStream>> = Vec::new();
        let stall = self.cfg.heartbeat_timeout * 2;
        while !self.links.is_closing() {
            let first = if waiting.is_empty() {
                rx.recv_timeout(Duration::from_millis(200)).ok()
            } else if !full.is_empty() && full.len() == waiting.len() {
                // Every queue waits for its socket: sleep until one has room (at most a
                // millisecond, so new connections are not kept waiting).
                wait_writable(&full, Duration::from_millis(1));
                None
            } else {
                rx.recv_timeout(Duration::from_millis(1)).ok()
            };
            full.clear();
            for c in first.into_iter().chain(rx.try_iter()) {
                if !waiting.iter().any(|(w, ..)| Arc::ptr_eq(w, &c)) {
                    waiting.push((c, std::time::Instant::now(), u64::MAX));
                }
            }
            waiting.retain_mut(|(c, moved, out)| {
                if c.is_failed() {
                    return false;
                }
                // A busy writer sends the queue itself before its own frame.
                let Ok(mut w) = c.writer.try_lock() else {
                    return true;
                };
                match w.flush_some(c) {
                    Ok(false) => {
                        if c.close_when_flushed.load(Ordering::Acquire) {
                            drop(w);
                            // Retired: no event; ends this side's drain if it had one.
                            self.links.fail(c, crate::PEER_LEFT.into());
                        }
                        false
                    }
                    Ok(true) => {
                        let (now_left, written) = (w.tail.len(), w.written);
                        drop(w);
                        if written != *out {
                            (*moved, *out) = (std::time::Instant::now(), written);
                        } else if moved.elapsed() > stall {
                            self.links.fail(
                                c,
                                format!("peer not reading: {now_left} bytes unsent for {stall:?}"),
                            );
                            return false;
                        }
                        full.push(c.socket.clone());
                        true
                    }
                    Err(e) => {
                        drop(w);
                        self.links.fail(c, format!("send failed: {e}"));
                        false
                    }
                }
            });
        }
    }

    /// Queues a control frame without ever blocking (see `frame_nonblocking`).
    pub(super) fn send_nonblocking(
        &self,
        conn: &Arc<Conn>,
        msg: &[u8],
    ) -> Result<bool, TransportError> {
        let head = FrameHeader::control(FrameKind::Ctrl, msg.len() as u64);
        self.frame_nonblocking(conn, &head, msg)
    }

    /// Queues one frame (control or data) without ever blocking: written at once if the
    /// socket takes it, else (the rest) left queued for the flusher; when another thread holds
    /// the writer the frame joins the overflow queue. Fails the link when the peer has more
    /// than [`MAX_QUEUED`] bytes waiting. Ok(false) is never returned for a live link.
    pub(super) fn frame_nonblocking(
        &self,
        conn: &Arc<Conn>,
        h: &FrameHeader,
        msg: &[u8],
    ) -> Result<bool, TransportError> {
        if conn.is_failed() {
            return Err(TransportError::PeerUnavailable(conn.peer()));
        }
        if conn.is_retiring() {
            return Ok(false); // the next link of the peer takes it
        }
        if self.links.is_frozen() {
            return Ok(true); // a hung host: nothing goes out
        }
        if h.kind != FrameKind::Heartbeat {
            conn.last_used.store(self.links.now_ns(), Ordering::Relaxed);
            self.sent(conn);
        }
        let head = h.encode();
        let Ok(mut w) = conn.writer.try_lock() else {
            // Someone is writing to this peer: queue behind them, never wait.
            let queued = {
                let mut o = conn.overflow.lock().unwrap();
                // Checked under the overflow lock, which the closing side holds while it
                // makes sure nothing is queued: a frame is queued before or not at all.
                if conn.is_retiring() {
                    return Ok(false);
                }
                o.extend_from_slice(&head);
                o.extend_from_slice(msg);
                o.len() + conn.tail_len.load(Ordering::Relaxed)
            };
            let _ = self.flush_tx.send(conn.clone());
            return self.check_queued(conn, queued);
        };
        if conn.is_retiring() {
            return Ok(false);
        }
        w.absorb(conn);
        if w.tail.is_empty() {
            let iov = [IoSlice::new(&head), IoSlice::new(msg)];
            let sent = match send_dontwait(&w.stream, &iov) {
                Ok(n) => {
                    w.written += n as u64;
                    n
                }
                Err(e) => {
                    drop(w);
                    return Err(self.send_failed(conn, format!("send failed: {e}")));
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
        let queued = w.tail.len();
        conn.tail_len.store(queued, Ordering::Relaxed);
        drop(w);
        conn.last_send.store(self.links.now_ns(), Ordering::Relaxed);
        if queued > 0 {
            let _ = self.flush_tx.send(conn.clone());
        }
        self.check_queued(conn, queued)
    }

    /// Fails the link of a peer with more than [`MAX_QUEUED`] bytes waiting for it.
    fn check_queued(&self, conn: &Arc<Conn>, queued: usize) -> Result<bool, TransportError> {
        if queued > MAX_QUEUED {
            let why = format!("peer not reading: {queued} bytes queued (bound {MAX_QUEUED})");
            return Err(self.send_failed(conn, why));
        }
        Ok(true)
    }
}

/// `write_all` for a header and a payload with as few `writev` calls as the kernel allows.
fn write_all_vectored(w: &TcpStream, head: &[u8], payload: &[u8]) -> std::io::Result<()> {
    let mut w = w;
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
