//! The heartbeat thread: a frame on every link that sent nothing for a quarter of the
//! heartbeat timeout, so the peer's reader (read timeout = heartbeat timeout) hears from us.

use super::Inner;
use crate::frame::{FrameHeader, FrameKind};
use crate::Link;
use std::io::Write;
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl Inner {
    pub(super) fn heartbeat_loop(self: Arc<Self>) {
        let period = self.cfg.heartbeat_timeout / 4;
        let hb = FrameHeader::control(FrameKind::Heartbeat, 0).encode();
        while !self.links.is_closing() {
            std::thread::sleep(period);
            let conns = self.links.snapshot();
            let now = self.links.now_ns();
            for c in conns {
                if now.saturating_sub(c.last_send.load(Ordering::Relaxed))
                    < period.as_nanos() as u64
                {
                    continue;
                }
                // A held writer lock means a frame is on its way, which is proof of life.
                if let Ok(mut w) = c.writer.try_lock() {
                    if c.is_failed() {
                        continue;
                    }
                    let r = w.flush_tail().and_then(|_| w.stream.write_all(&hb));
                    drop(w);
                    c.last_send.store(self.links.now_ns(), Ordering::Relaxed);
                    if let Err(e) = r {
                        self.links.fail(&c, format!("heartbeat failed: {e}"));
                    }
                }
            }
        }
    }
}
