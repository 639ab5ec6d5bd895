//! Credits: the receiver writes its running count of consumed blocks (with its complement)
//! into the sender's notification buffer (on a link without rings: sends the count's low 31
//! bits as an immediate, no payload); the sender writes block `seq` only once
//! `seq - consumed < n`.

use super::conn::Conn;
use super::{Inner, IMM_CREDIT, IMM_MASK, WR_CREDIT};
use crate::block;
use phalanx_transport::Link;
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl Inner {
    /// A credit notification arrived: read the notification buffer (count and complement),
    /// falling back to the 31 bits of the immediate if the buffer reads inconsistent.
    pub(super) fn take_credit(&self, conn: &Conn, low31: u32) {
        let (a, b) = match conn.bufs() {
            Some(bufs) => {
                let p = (bufs.addr() + conn.lay.notify_in) as *const u64;
                // SAFETY: notify_in is 16 bytes inside our registered buffer, 64-byte
                // aligned; the peer writes it by DMA, hence volatile reads.
                unsafe {
                    (
                        std::ptr::read_volatile(p),
                        std::ptr::read_volatile(p.add(1)),
                    )
                }
            }
            None => (1, 1), // no buffer: never consistent, the immediate counts
        };
        let known = conn.peer_consumed.load(Ordering::Acquire);
        let sent = conn.sent.load(Ordering::Acquire);
        let c = if a == !b && a >= known && a <= sent {
            a
        } else {
            block::extend31(known, low31)
        };
        if c > known && c <= sent {
            conn.peer_consumed.store(c, Ordering::Release);
            conn.notify();
        }
    }

    /// Tells the peer how many of its blocks we consumed (one notification write in flight
    /// at a time, so the source slot is stable while the NIC reads it).
    pub(super) fn return_credit(&self, conn: &Arc<Conn>) {
        let mut rx = conn.rx.lock().unwrap();
        if rx.credit_in_flight || rx.next_seq == rx.returned || conn.is_failed() {
            return;
        }
        let count = rx.next_seq;
        if let Some(bufs) = conn.bufs() {
            let p = (bufs.addr() + conn.lay.notify_out) as *mut u64;
            // SAFETY: notify_out is 16 bytes inside our buffer; no notification write is in
            // flight (checked above), so the NIC is not reading it.
            unsafe {
                std::ptr::write_volatile(p, count);
                std::ptr::write_volatile(p.add(1), !count);
            }
        }
        rx.credit_in_flight = true;
        rx.returned = count;
        drop(rx);
        conn.sq_inflight.fetch_add(1, Ordering::AcqRel);
        let imm = IMM_CREDIT | (count as u32 & IMM_MASK);
        let posted = match conn.bufs() {
            Some(bufs) => conn.qp.post_write(
                WR_CREDIT,
                bufs,
                conn.lay.notify_out,
                16,
                conn.remote.notify_addr,
                conn.remote.notify_rkey,
                Some(imm),
            ),
            None => conn.qp.post_send_imm(WR_CREDIT, &self.pool.tx, 0, 0, imm),
        };
        if let Err(e) = posted {
            conn.sq_inflight.fetch_sub(1, Ordering::AcqRel);
            self.fail_conn(conn, format!("cannot post credit: {e}"));
        }
    }
}
