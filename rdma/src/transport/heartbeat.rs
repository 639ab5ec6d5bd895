//! The heartbeat thread: reports a peer silent for the heartbeat timeout, and sends a
//! heartbeat block on every link that sent nothing for a quarter of it.

use super::Inner;
use crate::block::{Header, Kind};
use phalanx_transport::Link;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::debug;

impl Inner {
    pub(super) fn heartbeat_loop(self: Arc<Self>) {
        let timeout = self.cfg.heartbeat_timeout;
        let period = (timeout / 4).max(Duration::from_millis(1));
        // Silence is checked twice per heartbeat period, so a dead peer is reported at most
        // timeout + period/2 after the last thing it sent.
        let tick = (period / 2).max(Duration::from_millis(1));
        while !self.links.is_closing() {
            std::thread::sleep(tick);
            let conns = self.links.snapshot();
            for c in conns {
                let now = self.links.now_ns();
                let silent = now.saturating_sub(c.last_recv.load(Ordering::Relaxed));
                if silent > timeout.as_nanos() as u64 {
                    self.fail_conn(&c, format!("no heartbeat for {timeout:?}"));
                    continue;
                }
                if now.saturating_sub(c.last_send.load(Ordering::Relaxed))
                    < period.as_nanos() as u64
                {
                    continue;
                }
                // A held send lock means a message is on its way, which is proof of life.
                let Ok(mut tx) = c.tx.try_lock() else {
                    continue;
                };
                if c.is_failed() {
                    continue;
                }
                let h = Header::new(Kind::Heartbeat);
                match self.send_block(&c, &mut tx, &h, &[], Some(Instant::now())) {
                    Ok(_) => {
                        let n = &self.links.counters.heartbeats_sent;
                        n.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => debug!(node = self.id, peer = c.peer(), "heartbeat failed: {e}"),
                }
            }
        }
    }
}
