//! Closing links that stay idle (links made on demand only): a link that carried no control
//! or data frame, either way, for `TcpConfig::idle_timeout` and through which the peer holds
//! no grant of ours is closed without a failure, and its peer's next use makes a new one.
//!
//! The side that closes holds the writer (nothing half-sent), checks that nothing is queued
//! (under the overflow lock, which a non-blocking sender takes to queue: a frame is queued
//! before the check or not at all), takes the link out of the table, flags it retiring (a
//! sender that still holds it takes the next link instead) and sends an `Idle` frame. It
//! keeps reading the link until the peer closes it, and admits or dials no new link to that
//! peer until then, so the peer's frames keep their order. The peer, reading `Idle`, sends
//! what it had queued, takes the link out of its table and shuts the socket down. Neither
//! side reports the other down; a peer that dies meanwhile is noticed by the heartbeat
//! silence of the closing link, and reported on its next use. A link the node above depends
//! on (its idle guard names the peer: a request waits for that peer's answer, a stream runs
//! with it, a directory entry lists its copies) stays, and so does a link that proves a peer
//! alive (watched from either side, `Transport::set_watch`); without a watch every link's
//! heartbeats prove its peer alive, with one only the watched links' do, and deaths reach
//! the other links' ends from the watchers (`phalanx::node::gossip`).

use super::conn::Conn;
use super::Inner;
use crate::frame::{FrameHeader, FrameKind};
use crate::link::IdleKeep;
use crate::Link;
use std::io::Write;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tracing::debug;

impl Inner {
    /// Closes `conn` if it has been idle long enough and nothing depends on it (see the
    /// module). `kept`: the guard's answer, asked at most once per heartbeat pass.
    pub(super) fn close_if_idle(&self, conn: &Arc<Conn>, keep: &mut IdleKeep<'_>) {
        let idle = self.cfg.idle_timeout.as_nanos() as u64;
        if idle == 0 || !self.links.is_on_demand() || conn.is_failed() || conn.is_retiring() {
            return;
        }
        let quiet = |c: &Conn| {
            self.links
                .now_ns()
                .saturating_sub(c.last_used.load(Ordering::Relaxed))
                >= idle
        };
        let peer = conn.peer();
        if !quiet(conn) {
            return;
        }
        let watched = self.watched_by_peer(conn, self.links.now_ns()) || self.watches(peer);
        let watching = self.watch.get().is_some();
        if keep.keeps(peer, self.grants.has(peer), watching, watched) {
            return;
        }
        let Ok(mut w) = conn.writer.try_lock() else {
            return; // someone is writing: not idle
        };
        if !w.tail.is_empty() {
            return;
        }
        {
            let overflow = conn.overflow.lock().unwrap();
            if !overflow.is_empty() || !quiet(conn) || !self.links.retire(conn, true) {
                return;
            }
        }
        let bye = FrameHeader::control(FrameKind::Idle, 0).encode();
        match (&*w.stream).write_all(&bye) {
            Ok(()) => {
                w.written += bye.len() as u64;
                debug!(node = self.id, peer, "idle link closed");
                let mut draining = self.draining.lock().unwrap();
                draining.push((conn.clone(), std::time::Instant::now()));
            }
            // The reader sees the end and the link drains; the peer sees a broken link.
            Err(_) => conn.stop(),
        }
    }

    /// Ends the drain of links the peer has not closed within the heartbeat timeout of our
    /// `Idle` (gone, or not playing along): the link is shut, so its peer can link again.
    pub(super) fn end_stale_drains(&self) {
        let mut draining = self.draining.lock().unwrap();
        draining.retain(|(c, since)| {
            if c.is_failed() {
                return false;
            }
            if since.elapsed() > self.cfg.heartbeat_timeout {
                c.stop(); // the reader sees the end; the table ends the drain
                return false;
            }
            true
        });
    }

    /// The peer closes `conn` for being idle: the link leaves the table at once (nothing
    /// more is queued on it: flagged under the overflow lock), and the flusher sends what was
    /// queued before, then shuts the socket (the peer reads until then). Never blocks: it
    /// runs on a reader thread.
    pub(super) fn closed_by_peer_for_idle(&self, conn: &Arc<Conn>) {
        if !conn.is_retiring() {
            let _overflow = conn.overflow.lock().unwrap();
            if !self.links.retire(conn, false) {
                drop(_overflow);
                // Failed meanwhile: its failure was handled; this ends its reading.
                self.links.fail(conn, crate::PEER_LEFT.into());
                return;
            }
        }
        conn.close_when_flushed.store(true, Ordering::Release);
        let _ = self.flush_tx.send(conn.clone());
    }
}
