//! The heartbeat thread: a frame on every link that sent nothing for a quarter of the
//! heartbeat timeout, so the peer's reader (read timeout = heartbeat timeout) hears from us.

use super::Inner;
use crate::frame::{FrameHeader, FrameKind};
use crate::Link;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tracing::warn;

impl Inner {
    pub(super) fn heartbeat_loop(self: Arc<Self>) {
        let period = self.cfg.heartbeat_timeout / 4;
        let hb_header = FrameHeader::control(FrameKind::Heartbeat, 0);
        while !self.links.is_closing() {
            std::thread::sleep(period);
            let conns = self.links.snapshot();
            let now = self.links.now_ns();
            self.end_stale_drains();
            let mut kept = None;
            for c in conns {
                self.close_if_idle(&c, &mut kept);
                if now.saturating_sub(c.last_send.load(Ordering::Relaxed))
                    < period.as_nanos() as u64
                {
                    continue;
                }
                // A held writer lock means a frame is on its way, which is proof of life; so
                // are bytes queued for the flusher. The heartbeat itself never waits on a peer
                // (a peer that reads nothing must not hold up the others' heartbeats).
                if c.is_failed() {
                    continue;
                }
                match self.frame_nonblocking(&c, &hb_header, &[]) {
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
}
