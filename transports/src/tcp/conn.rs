//! One TCP connection and its sending side: whole frames under the writer lock, and the
//! non-blocking control path whose leftovers the flusher thread sends.

use super::Inner;
use crate::frame::{FrameHeader, FrameKind};
use crate::{Link, LinkState, TransportError};
use crossbeam_channel::Receiver;
use std::io::{ErrorKind, IoSlice, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub(super) struct Conn {
    pub(super) link: LinkState,
    pub(super) socket: TcpStream,
    pub(super) writer: Mutex<Writer>,
    /// Nanoseconds since the transport's epoch of the last frame sent.
    pub(super) last_send: AtomicU64,
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
    pub(super) stream: TcpStream,
    pub(super) tail: Vec<u8>,
}

impl Writer {
    pub(super) fn flush_tail(&mut self) -> std::io::Result<()> {
        if !self.tail.is_empty() {
            self.stream.write_all(&self.tail)?;
            self.tail.clear();
        }
        Ok(())
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

    /// Writes one frame under the connection's writer lock, header and payload in one writev.
    pub(super) fn send_frame(
        &self,
        conn: &Arc<Conn>,
        h: &FrameHeader,
        payload: &[u8],
    ) -> Result<(), TransportError> {
        let head = h.encode();
        let res = {
            let mut w = conn.writer.lock().unwrap();
            if conn.is_failed() {
                return Err(TransportError::PeerUnavailable(conn.peer()));
            }
            w.flush_tail()
                .and_then(|_| write_all_vectored(&mut w.stream, &head, payload))
        };
        conn.last_send.store(self.links.now_ns(), Ordering::Relaxed);
        res.map_err(|e| self.send_failed(conn, format!("send failed: {e}")))
    }

    /// Sends the tails left by non-blocking sends; blocking here is harmless, this thread
    /// does nothing else.
    pub(super) fn flush_loop(self: Arc<Self>, rx: Receiver<Arc<Conn>>) {
        while !self.links.is_closing() {
            let Ok(c) = rx.recv_timeout(Duration::from_millis(200)) else {
                continue;
            };
            let r = c.writer.lock().unwrap().flush_tail();
            if let Err(e) = r {
                self.links.fail(&c, format!("send failed: {e}"));
            }
        }
    }

    /// Queues a control frame without ever blocking: written at once if the socket takes it,
    /// else (the rest) left as the writer's tail for the flusher. False if the writer is busy.
    pub(super) fn send_nonblocking(
        &self,
        conn: &Arc<Conn>,
        msg: &[u8],
    ) -> Result<bool, TransportError> {
        let head = FrameHeader::control(FrameKind::Ctrl, msg.len() as u64);
        self.frame_nonblocking(conn, &head, msg)
    }

    /// Queues one frame (control or data) without ever blocking; see `send_nonblocking`.
    pub(super) fn frame_nonblocking(
        &self,
        conn: &Arc<Conn>,
        h: &FrameHeader,
        msg: &[u8],
    ) -> Result<bool, TransportError> {
        let Ok(mut w) = conn.writer.try_lock() else {
            return Ok(false);
        };
        if conn.is_failed() {
            return Err(TransportError::PeerUnavailable(conn.peer()));
        }
        let head = h.encode();
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
        let queued = !w.tail.is_empty();
        drop(w);
        conn.last_send.store(self.links.now_ns(), Ordering::Relaxed);
        if queued {
            let _ = self.flush_tx.send(conn.clone());
        }
        Ok(true)
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
