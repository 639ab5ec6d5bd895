//! The heartbeat thread: reports a peer silent for the heartbeat timeout, and sends a
//! heartbeat block on every link that sent nothing for a quarter of it. With a watch
//! (`Transport::set_watch`) only watched links are failed when silent; they get a heartbeat
//! flagged [`HB_WATCHING`] every quarter of the heartbeat timeout, which the peer answers with plain ones
//! while the flags keep coming, and links no side watches get none (as over TCP).

use super::Inner;
use crate::block::{Header, Kind};
use phalanx_transport::link::IdleKeep;
use phalanx_transport::{Link, NodeId};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::debug;

/// The `a` field of a heartbeat whose sender watches the receiver: answer in kind.
pub(super) const HB_WATCHING: u64 = 1;

impl Inner {
    /// Whether this node fails the link to `peer` when silent (all links without a watch).
    pub(super) fn watches(&self, peer: NodeId) -> bool {
        self.watch.get().is_none_or(|w| w(peer))
    }

    pub(super) fn heartbeat_loop(self: Arc<Self>) {
        let timeout = self.cfg.heartbeat_timeout;
        let period = (timeout / 4).max(Duration::from_millis(1));
        // Silence is checked twice per heartbeat period, so a dead peer is reported at most
        // timeout + period/2 after the last thing it sent.
        let tick = (period / 2).max(Duration::from_millis(1));
        // When each watched peer last got a flagged heartbeat (one per period).
        let mut flagged_at: std::collections::HashMap<NodeId, Instant> = Default::default();
        while !self.links.is_closing() {
            std::thread::sleep(tick);
            self.finish_idle_closes();
            let conns = self.links.snapshot();
            let mut keep = IdleKeep::new(self.idle_guard.get());
            for c in conns {
                let now = self.links.now_ns();
                let silent = now.saturating_sub(c.last_recv.load(Ordering::Relaxed));
                let watched = self.watches(c.peer());
                // With a watch, silence counts from when the watch began at the earliest
                // (the link may have been quiet, unwatched, before).
                let since = c.watching_since.load(Ordering::Relaxed);
                if self.watch.get().is_some() {
                    match (watched, since) {
                        (true, 0) => c.watching_since.store(now.max(1), Ordering::Relaxed),
                        (false, _) => c.watching_since.store(0, Ordering::Relaxed),
                        _ => {}
                    }
                }
                let watched_long = self.watch.get().is_none()
                    || (since != 0 && now.saturating_sub(since) > timeout.as_nanos() as u64);
                if silent > timeout.as_nanos() as u64 && watched && watched_long {
                    self.fail_conn(&c, format!("no heartbeat for {timeout:?}"));
                    continue;
                }
                self.close_if_idle(&c, &mut keep);
                if c.is_retiring() {
                    continue;
                }
                let idle = now.saturating_sub(c.last_send.load(Ordering::Relaxed))
                    >= period.as_nanos() as u64;
                let answer = c.watched_by_peer(now, timeout.as_nanos() as u64);
                // Without a watch every link is watched here, and its heartbeats ask for answers.
                let flagged = self.watch.get().is_none()
                    || watched
                        && flagged_at
                            .get(&c.peer())
                            .is_none_or(|t| t.elapsed() >= period);
                // Watched links every period (the peer must keep answering); others when
                // idle, and with a watch only while the peer asks.
                let due = match self.watch.get() {
                    None => idle,
                    Some(_) => flagged || (idle && answer),
                };
                if !due {
                    continue;
                }
                // A held send lock means a message is on its way, which is proof of life.
                let Ok(mut tx) = c.tx.try_lock() else {
                    continue;
                };
                if c.is_failed() {
                    continue;
                }
                let mut h = Header::new(Kind::Heartbeat);
                if flagged {
                    h.a = HB_WATCHING;
                }
                match self.send_block(&c, &mut tx, &h, &[], Some(Instant::now())) {
                    Ok(_) => {
                        if flagged {
                            flagged_at.insert(c.peer(), Instant::now());
                        }
                        let n = &self.links.counters.heartbeats_sent;
                        n.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => debug!(node = self.id, peer = c.peer(), "heartbeat failed: {e}"),
                }
            }
        }
    }
}
