//! The progress thread: sleeps on the completion channel (or spins with `busy_poll`),
//! handles work completions and scans the rings of installed connections.

use super::conn::Conn;
use super::{Inner, IMM_CREDIT, IMM_MASK, WR_CREDIT, WR_TAG};
use crate::block;
use crate::verbs::WorkCompletion;
use phalanx_transport::Link;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tracing::error;

thread_local! {
    static ON_PROGRESS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the caller is a progress thread (which must never wait for a completion).
pub(super) fn on_progress_thread() -> bool {
    ON_PROGRESS.with(|f| f.get())
}

impl Inner {
    pub(super) fn wake_progress(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our own eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    pub(super) fn progress_loop(self: Arc<Self>) {
        ON_PROGRESS.with(|f| f.set(true));
        let mut wcs: Vec<WorkCompletion> = Vec::with_capacity(256);
        let fd = self.wake.as_raw_fd();
        let mut idle: u32 = 0;
        while !self.links.is_closing() {
            if !self.cfg.busy_poll {
                // SAFETY: the eventfd lives as long as `self`.
                let bfd = unsafe { BorrowedFd::borrow_raw(fd) };
                match self.cq.wait(Some(bfd), Duration::from_millis(100)) {
                    Ok((_, woken)) => {
                        if woken {
                            let mut v = 0u64;
                            // SAFETY: reads 8 bytes into a live u64 from our own eventfd.
                            unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
                        }
                    }
                    Err(e) => {
                        error!(node = self.id, "completion channel failed: {e}");
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
            }
            wcs.clear();
            if let Err(e) = self.cq.poll(&mut wcs, 4096) {
                error!(node = self.id, "ibv_poll_cq failed: {e}");
            }
            for wc in &wcs {
                self.handle_wc(wc);
            }
            let conns: Vec<Arc<Conn>> = self.by_qpn.lock().unwrap().values().cloned().collect();
            for c in &conns {
                if c.installed.load(Ordering::Acquire)
                    && !c.is_failed()
                    && !c.consuming_paused.load(Ordering::Relaxed)
                {
                    self.scan_ring(c);
                }
            }
            if self.cfg.busy_poll {
                // Spin, but let other threads of a shared core run now and then.
                idle = if wcs.is_empty() {
                    idle.wrapping_add(1)
                } else {
                    0
                };
                if idle % 256 == 255 {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        }
    }

    fn handle_wc(&self, wc: &WorkCompletion) {
        let Some(conn) = self.by_qpn.lock().unwrap().get(&wc.qp_num).cloned() else {
            return; // a retired QP's flushed work
        };
        if !wc.is_ok() {
            if !conn.is_failed() {
                self.fail_conn(
                    &conn,
                    format!(
                        "work completion error: {} (status {})",
                        wc.status_str(),
                        wc.status
                    ),
                );
            }
            return;
        }
        if wc.is_recv() {
            if let Err(e) = conn.qp.post_recv(0) {
                self.fail_conn(&conn, format!("cannot repost receive: {e}"));
                return;
            }
            conn.last_recv.store(self.links.now_ns(), Ordering::Relaxed);
            let imm = wc.imm.unwrap_or(0);
            if imm & IMM_CREDIT != 0 {
                self.take_credit(&conn, imm & IMM_MASK);
            } else {
                let mut rx = conn.rx.lock().unwrap();
                let seen = block::extend31(rx.imm_seen, imm);
                if seen != rx.imm_seen {
                    drop(rx);
                    self.fail_conn(&conn, format!("block immediate {imm} out of order"));
                    return;
                }
                rx.imm_seen += 1;
            }
        } else {
            conn.sq_inflight.fetch_sub(1, Ordering::AcqRel);
            match wc.wr_id & WR_TAG {
                WR_CREDIT => {
                    conn.rx.lock().unwrap().credit_in_flight = false;
                    self.return_credit(&conn);
                }
                _ => {
                    let op = wc.wr_id & !WR_TAG;
                    conn.ops_done.fetch_max(op + 1, Ordering::AcqRel);
                }
            }
            conn.notify();
        }
    }
}
