//! Closing links that stay idle (links made on demand only), as over TCP: a link that
//! carried no control message or data either way for `RdmaConfig::idle_timeout`, through
//! which the peer holds no grant of ours, that no side watches and that the node above does
//! not keep (its idle guard), is closed without a failure; the next use makes a new one.
//!
//! The side that closes holds the send lock (nothing half-sent) with no work request in
//! flight, takes the link out of the table (flagged retiring: a sender that still holds it
//! takes the next link) and sends an `Idle` block. It keeps consuming the link, and admits
//! or dials no new link to that peer, until the peer's `Bye` ends it (or the heartbeat
//! timeout does), so the peer's messages keep their order. The peer, consuming `Idle`, takes
//! the link out of its table and sends `Bye` after whatever it was sending (from the
//! heartbeat thread: the progress thread never waits); once the `Bye` has completed it
//! drops the link. Neither side reports the other down. The QP is destroyed and its ring
//! goes back to the pool.

use super::conn::Conn;
use super::Inner;
use crate::block::{Header, Kind};
use phalanx_transport::link::IdleKeep;
use phalanx_transport::{Link, PEER_LEFT};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::debug;

impl Inner {
    /// Closes `conn` if it has been idle long enough and nothing depends on it (see the
    /// module). `kept`: the idle guard's answer, asked at most once per heartbeat pass.
    pub(super) fn close_if_idle(&self, conn: &Arc<Conn>, keep: &mut IdleKeep<'_>) {
        let idle = self.cfg.idle_timeout.as_nanos() as u64;
        if idle == 0 || !self.links.is_on_demand() || conn.is_failed() || conn.is_retiring() {
            return;
        }
        let now = self.links.now_ns();
        let quiet = |c: &Conn| now.saturating_sub(c.last_used.load(Ordering::Relaxed)) >= idle;
        let peer = conn.peer();
        if !quiet(conn) {
            return;
        }
        let timeout = self.cfg.heartbeat_timeout.as_nanos() as u64;
        let watched = conn.watched_by_peer(now, timeout) || self.watches(peer);
        let watching = self.watch.get().is_some();
        if keep.keeps(peer, self.grants.has(peer), watching, watched) {
            return;
        }
        let Ok(mut tx) = conn.tx.try_lock() else {
            return; // someone is sending: not idle
        };
        let busy = conn.sq_inflight.load(Ordering::Acquire) != 0
            || conn.rx.lock().unwrap().partial.is_some()
            || conn.staged.oldest().is_some();
        if busy || !quiet(conn) || !self.links.retire(conn, true) {
            return;
        }
        let deadline = Some(Instant::now() + self.cfg.heartbeat_timeout);
        match self.send_block(conn, &mut tx, &Header::new(Kind::Idle), &[], deadline) {
            Ok(true) => {
                debug!(node = self.id, peer, "idle verbs link closed");
                self.draining
                    .lock()
                    .unwrap()
                    .push((conn.clone(), Instant::now()));
            }
            // Not sent: the link ends here (the peer sees a broken link, or its heartbeat
            // silence, and reports nothing: it is no longer our current link... nor, once
            // it notices, its).
            _ => {
                drop(tx);
                self.fail_conn(conn, "closing an idle link failed".into());
            }
        }
    }

    /// The peer closes `conn` for being idle (its `Idle` was consumed): the link leaves the
    /// table at once and the heartbeat thread sends the `Bye` that ends it. Never blocks: it
    /// runs on the progress thread.
    pub(super) fn closed_by_peer_for_idle(&self, conn: &Arc<Conn>) {
        if !conn.is_retiring() && !self.links.retire(conn, false) {
            return; // no longer the current link (failed, or replaced): nothing to close
        }
        if !conn.bye_due.swap(true, Ordering::AcqRel) {
            self.byes_due.lock().unwrap().push(conn.clone());
        }
    }

    /// Heartbeat thread: sends the `Bye` of each link the peer closed for being idle, waits
    /// for it to complete, and drops the link; ends the drains that the peer did not end
    /// within the heartbeat timeout.
    pub(super) fn finish_idle_closes(&self) {
        let due: Vec<Arc<Conn>> = std::mem::take(&mut *self.byes_due.lock().unwrap());
        let bound = self.cfg.heartbeat_timeout;
        for c in due {
            let deadline = Instant::now() + bound;
            let mut tx = c.tx.lock().unwrap();
            let sent = !c.is_failed()
                && matches!(
                    self.send_block(&c, &mut tx, &Header::new(Kind::Bye), &[], Some(deadline)),
                    Ok(true)
                );
            let last = tx.next_op;
            drop(tx);
            if sent {
                let _ = self.wait_for(&c, Some(deadline), || {
                    c.ops_done.load(Ordering::Acquire) >= last
                });
            }
            // Not current: no event; retiring: its drain (none on this side) ends.
            self.fail_conn(&c, PEER_LEFT.into());
        }
        let mut draining = self.draining.lock().unwrap();
        draining.retain(|(c, since)| {
            if c.is_failed() {
                return false;
            }
            if since.elapsed() > bound.max(Duration::from_millis(1)) {
                self.fail_conn(c, "no goodbye after an idle close".into());
                return false;
            }
            true
        });
    }
}
