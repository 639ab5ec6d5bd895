//! The progress thread: sleeps on the completion channel (or spins with `busy_poll`),
//! handles work completions and scans the rings of installed connections.

use super::conn::Conn;
use super::{Inner, IMM_CREDIT, IMM_MASK, WR_CREDIT, WR_TAG};
use crate::block;
use crate::verbs::{sys, WorkCompletion};
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
                    if c.is_shared() {
                        self.consume_shared(c);
                    } else {
                        self.scan_ring(c);
                    }
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

    /// Gives receive block `b` back to the shared receive queue. A block that cannot be
    /// reposted is lost to the queue (logged): the SRQ only fails that way when it is gone.
    pub(super) fn repost_block(&self, b: u32) {
        if let Err(e) = self.pool.repost(b) {
            error!(
                node = self.id,
                block = b,
                "cannot repost a shared receive: {e}"
            );
        }
    }

    fn handle_wc(&self, wc: &WorkCompletion) {
        let conn = self.by_qpn.lock().unwrap().get(&wc.qp_num).cloned();
        if wc.is_recv() {
            // Every receive is a block of the shared receive queue (its index is the wr_id).
            let b = wc.wr_id as u32;
            match conn {
                Some(c) => self.handle_recv(&c, wc, b),
                None => self.repost_block(b), // a retired QP's
            }
            return;
        }
        let Some(conn) = conn else {
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
        conn.sq_inflight.fetch_sub(1, Ordering::AcqRel);
        match wc.wr_id & WR_TAG {
            WR_CREDIT => {
                conn.rx.lock().unwrap().credit_in_flight = false;
                self.return_credit(&conn);
            }
            _ => {
                let op = wc.wr_id & !WR_TAG;
                conn.ops_done.fetch_max(op + 1, Ordering::AcqRel);
                conn.staged.completed(op + 1);
            }
        }
        conn.notify();
    }

    /// A receive completed on `conn` into shared block `b`. On a link with a private ring it
    /// only carries an immediate (a block landed in the ring, or a credit); on a shared-pool
    /// link it is the block itself, or a credit.
    fn handle_recv(&self, conn: &Arc<Conn>, wc: &WorkCompletion, b: u32) {
        let fail = |b: Option<u32>, why: String| {
            if let Some(b) = b {
                self.repost_block(b);
            }
            if !conn.is_failed() {
                self.links
                    .counters
                    .malformed_frames
                    .fetch_add(1, Ordering::Relaxed);
                self.fail_conn(conn, why);
            }
        };
        if !wc.is_ok() {
            self.repost_block(b);
            if !conn.is_failed() {
                let why = format!(
                    "receive completion error: {} (status {})",
                    wc.status_str(),
                    wc.status
                );
                self.fail_conn(conn, why);
            }
            return;
        }
        conn.last_recv.store(self.links.now_ns(), Ordering::Relaxed);
        let Some(imm) = wc.imm else {
            return fail(Some(b), "a receive without immediate data".into());
        };
        if conn.is_shared() {
            if wc.opcode != sys::IBV_WC_RECV {
                return fail(Some(b), "an RDMA write to a link without a ring".into());
            }
            if imm & IMM_CREDIT != 0 {
                self.repost_block(b);
                self.take_credit(conn, imm & IMM_MASK);
                return;
            }
            let mut rx = conn.rx.lock().unwrap();
            rx.held.push_back((b, wc.byte_len, imm));
            let first = rx.held.len() == 1;
            drop(rx);
            if first
                && conn.installed.load(Ordering::Acquire)
                && !conn.consuming_paused.load(Ordering::Relaxed)
            {
                self.consume_shared(conn);
            }
            return;
        }
        self.repost_block(b);
        if wc.opcode != sys::IBV_WC_RECV_RDMA_WITH_IMM {
            return fail(None, "a send to a link with a ring".into());
        }
        if imm & IMM_CREDIT != 0 {
            self.take_credit(conn, imm & IMM_MASK);
        } else {
            let mut rx = conn.rx.lock().unwrap();
            let seen = block::extend31(rx.imm_seen, imm);
            if seen != rx.imm_seen {
                drop(rx);
                return fail(None, format!("block immediate {imm} out of order"));
            }
            rx.imm_seen += 1;
        }
    }
}
