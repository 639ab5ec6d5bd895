//! The reader thread of a connection: frames in order, payloads straight into the arena.

use super::conn::Conn;
use super::Inner;
use crate::frame::{FrameHeader, FrameKind, FRAME_HEADER_LEN};
use crate::{Event, Link, NodeId, TransportError, PEER_LEFT};
use std::io::{BufReader, ErrorKind, Read};
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tracing::error;

impl Inner {
    /// Reads frames until a goodbye or an error, then fails the link with the reason.
    pub(super) fn read_loop(self: Arc<Self>, conn: Arc<Conn>, s: TcpStream) {
        let peer = conn.peer();
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
            None => PEER_LEFT.to_string(),
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
                | TransportError::OutOfBounds { .. }
                | TransportError::Forbidden(_)),
            ) => {
                self.links
                    .counters
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
        self.links.fail(&conn, reason);
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
        let counters = &self.links.counters;
        match h.kind {
            FrameKind::Heartbeat => Ok(true),
            FrameKind::Bye => Ok(false),
            FrameKind::Hello => Err(TransportError::Malformed("hello on a live link".into())),
            FrameKind::Ctrl => {
                let mut msg = vec![0u8; h.len as usize];
                s.read_exact(&mut msg)?;
                counters.ctrl_received.fetch_add(1, Ordering::Relaxed);
                self.links.emit(Event::Ctrl { peer, msg });
                Ok(true)
            }
            FrameKind::Data => {
                let arena = self.arena.get().ok_or(TransportError::NoArena)?;
                arena.check(h.dst, h.len)?;
                // Nothing lands outside a range this node granted to this peer; `held` keeps
                // the range allocated until the bytes are in, even if the grant is revoked.
                let held = self.grants.admit(peer, h.dst, h.rel, h.len)?;
                // SAFETY: inside the arena (checked) and inside a range granted to `peer` for
                // one pull, whose copy `held` keeps allocated; nothing else writes a range
                // while it is granted, and readers only look below the watermark, which moves
                // past these bytes after the Data event below.
                let dst = unsafe { arena.slice_mut(h.dst, h.len) };
                s.read_exact(dst)?;
                drop(held);
                counters
                    .data_bytes_received
                    .fetch_add(h.len, Ordering::Relaxed);
                self.links.emit(Event::Data {
                    peer,
                    stream: h.stream,
                    offset: h.rel,
                    len: h.len,
                });
                Ok(true)
            }
        }
    }
}
