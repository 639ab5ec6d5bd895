//! The heartbeat thread. Without a watch (the default) every link that sent nothing for a
//! quarter of the heartbeat timeout gets a heartbeat, so the peer's reader (which fails a
//! link silent for the timeout) hears from us; it is flagged [`HB_WATCHING`], as every link
//! is watched here, so that a peer with a watch answers. With a watch (`Transport::set_watch`), only
//! watched links prove their peer alive: each gets a heartbeat flagged [`HB_WATCHING`] every
//! quarter of the heartbeat timeout whatever else it carries, the peer answers with plain heartbeats while
//! such flags keep coming, and links no side watches carry none: a node's heartbeats per
//! period are as many as the peers it watches and is watched by, whatever the cluster size.

use super::conn::Conn;
use super::Inner;
use crate::frame::{FrameHeader, FrameKind};
use crate::link::IdleKeep;
use crate::{Link, NodeId};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tracing::warn;

/// The `stream` field of a heartbeat whose sender watches the receiver: answer in kind.
pub(super) const HB_WATCHING: u64 = 1;

impl Inner {
    /// Whether this node fails the link to `peer` when it is silent: every link without a
    /// watch, the watched ones with.
    pub(super) fn watches(&self, peer: NodeId) -> bool {
        self.watch.get().is_none_or(|w| w(peer))
    }

    /// Whether `c`, silent since `last_rx` (ns), is to be failed: silent for the heartbeat
    /// timeout, watched, and (with a watch) watched for the timeout at least.
    pub(super) fn silent_too_long(&self, c: &Conn, quiet_for: std::time::Duration) -> bool {
        let timeout = self.cfg.heartbeat_timeout;
        if quiet_for < timeout {
            return false;
        }
        if self.watch.get().is_none() {
            return true;
        }
        let since = c.watching_since.load(Ordering::Relaxed);
        self.watches(c.peer())
            && since != 0
            && self.links.now_ns().saturating_sub(since) >= timeout.as_nanos() as u64
    }

    pub(super) fn heartbeat_loop(self: Arc<Self>) {
        let period = self.cfg.heartbeat_timeout / 4;
        let plain = FrameHeader::control(FrameKind::Heartbeat, 0);
        let watching = FrameHeader {
            stream: HB_WATCHING,
            ..plain
        };
        while !self.links.is_closing() {
            std::thread::sleep(period);
            let conns = self.links.snapshot();
            let now = self.links.now_ns();
            self.end_stale_drains();
            let mut keep = IdleKeep::new(self.idle_guard.get());
            for c in conns {
                self.close_if_idle(&c, &mut keep);
                let Some(h) = self.heartbeat_for(&c, now, period.as_nanos() as u64) else {
                    continue;
                };
                let header = if h { &watching } else { &plain };
                // A held writer lock means a frame is on its way, which is proof of life; so
                // are bytes queued for the flusher. The heartbeat itself never waits on a peer
                // (a peer that reads nothing must not hold up the others' heartbeats).
                if c.is_failed() {
                    continue;
                }
                match self.frame_nonblocking(&c, header, &[]) {
                    Ok(true) => {
                        let n = &self.links.counters.heartbeats_sent;
                        n.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(false) => {}
                    Err(e) => warn!(node = self.id, peer = c.peer(), "heartbeat not sent: {e}"),
                }
            }
        }
    }

    /// The heartbeat `c` needs now, if any: `Some(true)` flagged watching, `Some(false)`
    /// plain.
    fn heartbeat_for(&self, c: &Conn, now: u64, period: u64) -> Option<bool> {
        let idle = now.saturating_sub(c.last_send.load(Ordering::Relaxed)) >= period;
        // Without a watch every link is watched here: its heartbeats ask for answers too (a
        // peer with a watch answers only those; this node may get its watch later, or never).
        let Some(watch) = self.watch.get() else {
            return idle.then_some(true);
        };
        if watch(c.peer()) {
            if c.watching_since.load(Ordering::Relaxed) == 0 {
                c.watching_since.store(now.max(1), Ordering::Relaxed);
            }
            return Some(true);
        }
        c.watching_since.store(0, Ordering::Relaxed);
        (idle && self.watched_by_peer(c, now)).then_some(false)
    }

    /// Whether the peer of `c` watches this node: a flagged heartbeat came from it within
    /// the heartbeat timeout before `now`.
    pub(super) fn watched_by_peer(&self, c: &Conn, now: u64) -> bool {
        let asked = c.peer_watches.load(Ordering::Relaxed);
        asked != 0 && now.saturating_sub(asked) < self.cfg.heartbeat_timeout.as_nanos() as u64
    }
}
