//! The eager path, receiving side: the progress thread consumes the valid blocks at the
//! head of a connection's ring in order (or, on a link without a ring, the blocks it received
//! in the shared receive queue, in order) and acts on each.

use super::conn::{Conn, RxState};
use super::Inner;
use crate::block::{self, BlockState, Header, Kind, FLAG_FIRST, FLAG_LAST};
use phalanx_transport::{Event, Link, TransportError, MAX_CTRL_LEN, PEER_LEFT};
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

impl Inner {
    /// Consumes every valid block at the head of a connection's ring.
    pub(super) fn scan_ring(&self, conn: &Arc<Conn>) {
        let n = conn.lay.n;
        let bsize = conn.lay.bsize as u64;
        let mut consumed_any = false;
        loop {
            let mut rx = conn.rx.lock().unwrap();
            let seq = rx.next_seq;
            let off = conn.ring_block(seq);
            let Some(bufs) = conn.bufs() else {
                return; // a link without a ring: `consume_shared`
            };
            let last = (bufs.addr() + off + bsize - 1) as *const u8;
            // SAFETY: the block lies inside our registered buffer; the counter byte is read
            // volatile because the NIC writes it.
            let lap = unsafe { std::ptr::read_volatile(last) };
            if lap != block::lap_of(seq, n) && seq >= rx.imm_seen {
                break; // nothing new: the usual exit
            }
            fence(Ordering::Acquire);
            // SAFETY: the peer writes block `seq % n` only for message `seq` (its previous
            // content was consumed and credited), and writes nothing else there until we
            // return credit for `seq`, so the bytes are stable once they validate.
            let blk = unsafe { bufs.arena().slice(off, bsize) };
            match block::decode(blk, n, seq) {
                BlockState::Ready(h, payload) => {
                    let res = self.deliver(conn, &mut rx, &h, payload);
                    rx.next_seq += 1;
                    drop(rx);
                    consumed_any = true;
                    conn.last_recv.store(self.links.now_ns(), Ordering::Relaxed);
                    if !self.consumed(conn, res) {
                        return;
                    }
                }
                BlockState::Stale | BlockState::Torn(_) if seq >= rx.imm_seen => break,
                other => {
                    drop(rx);
                    self.links
                        .counters
                        .malformed_frames
                        .fetch_add(1, Ordering::Relaxed);
                    self.fail_conn(
                        conn,
                        format!("block {seq} invalid after its completion: {other:?}"),
                    );
                    return;
                }
            }
        }
        if consumed_any {
            self.return_credit(conn);
        }
    }

    /// Consumes the blocks a shared-pool link received, in order, each checked against the
    /// sequence number and the credit the sender had, then given back to the shared receive
    /// queue.
    pub(super) fn consume_shared(&self, conn: &Arc<Conn>) {
        let n = conn.lay.n as u64;
        let mut consumed_any = false;
        loop {
            let mut rx = conn.rx.lock().unwrap();
            let Some(&(b, len, imm)) = rx.held.front() else {
                break;
            };
            rx.held.pop_front();
            let seq = rx.next_seq;
            let res = if block::extend31(seq, imm) != seq {
                Err(TransportError::Malformed(format!(
                    "block immediate {imm} out of order (expected {seq})"
                )))
            } else if seq >= rx.returned + n {
                Err(TransportError::Malformed(format!(
                    "block {seq} sent beyond the credit given ({} consumed, {n} in flight)",
                    rx.returned
                )))
            } else if (len as usize) < block::HEADER_LEN + block::TRAILER_LEN
                || len as usize > conn.lay.bsize
            {
                Err(TransportError::Malformed(format!("a block of {len} bytes")))
            } else {
                // SAFETY: block `b`'s receive completed and it is reposted only below, after
                // the last use of this slice (`deliver` copies what it keeps).
                let blk = unsafe { self.pool.received(b, len as usize) };
                match block::decode(blk, conn.lay.n, seq) {
                    BlockState::Ready(h, payload) => self.deliver(conn, &mut rx, &h, payload),
                    other => Err(TransportError::Malformed(format!(
                        "block {seq} invalid: {other:?}"
                    ))),
                }
            };
            rx.next_seq += 1;
            drop(rx);
            self.repost_block(b);
            if !self.consumed(conn, res) {
                return;
            }
            consumed_any = true;
            if conn.consuming_paused.load(Ordering::Relaxed) {
                break;
            }
        }
        if consumed_any {
            conn.last_recv.store(self.links.now_ns(), Ordering::Relaxed);
            self.return_credit(conn);
        }
    }

    /// After one block was acted on: false once the link has ended (a goodbye, or a block
    /// that did not decode or broke a rule: counted as malformed).
    fn consumed(&self, conn: &Arc<Conn>, res: Result<bool, TransportError>) -> bool {
        match res {
            Ok(true) => true,
            Ok(false) => {
                self.fail_conn(conn, PEER_LEFT.into());
                false
            }
            Err(e) => {
                let counters = &self.links.counters;
                counters.malformed_frames.fetch_add(1, Ordering::Relaxed);
                self.fail_conn(conn, format!("malformed block: {e}"));
                false
            }
        }
    }

    /// Acts on one block message. `Ok(false)` on a goodbye.
    fn deliver(
        &self,
        conn: &Arc<Conn>,
        rx: &mut RxState,
        h: &Header,
        payload: &[u8],
    ) -> Result<bool, TransportError> {
        let peer = conn.peer();
        match h.kind {
            Kind::Heartbeat => {
                if h.a == super::heartbeat::HB_WATCHING {
                    let now = self.links.now_ns();
                    conn.peer_watches.store(now, Ordering::Relaxed);
                }
            }
            Kind::Bye => return Ok(false),
            Kind::Idle => self.closed_by_peer_for_idle(conn),
            Kind::Ctrl => {
                if h.flags & FLAG_FIRST != 0 {
                    if rx.partial.is_some() {
                        return Err(TransportError::Malformed(
                            "control message restarted".into(),
                        ));
                    }
                    let total = h.a as usize;
                    if total > MAX_CTRL_LEN {
                        return Err(TransportError::MessageTooLarge {
                            len: total,
                            max: MAX_CTRL_LEN,
                        });
                    }
                    rx.partial = Some((total, Vec::with_capacity(total)));
                }
                let Some((total, buf)) = rx.partial.as_mut() else {
                    return Err(TransportError::Malformed(
                        "control fragment without a start".into(),
                    ));
                };
                if buf.len() + payload.len() > *total {
                    return Err(TransportError::Malformed(
                        "control message longer than announced".into(),
                    ));
                }
                buf.extend_from_slice(payload);
                if h.flags & FLAG_LAST != 0 {
                    let (total, msg) = rx.partial.take().expect("partial");
                    if msg.len() != total {
                        return Err(TransportError::Malformed(
                            "control message shorter than announced".into(),
                        ));
                    }
                    self.links
                        .counters
                        .ctrl_received
                        .fetch_add(1, Ordering::Relaxed);
                    conn.last_used.store(self.links.now_ns(), Ordering::Relaxed);
                    self.links.emit(Event::Ctrl { peer, msg });
                }
            }
            Kind::Data | Kind::DataDone => {
                let arena = self.arena_mr()?;
                let len = if h.kind == Kind::Data {
                    payload.len() as u64
                } else {
                    h.d
                };
                arena.arena().check(h.c, len)?;
                // Only into a range granted to this peer; `held` keeps it allocated meanwhile.
                let held = self.grants.admit(peer, h.c, h.b, len)?;
                if h.kind == Kind::Data {
                    // SAFETY: inside the arena and inside a range granted to `peer` for one
                    // pull, kept allocated by `held`; nothing else writes a granted range and
                    // readers only look below the watermark, which the Data event moves.
                    unsafe { arena.arena().slice_mut(h.c, len) }.copy_from_slice(payload);
                    self.links
                        .counters
                        .payload_bytes_copied
                        .fetch_add(len, Ordering::Relaxed);
                }
                self.links
                    .counters
                    .data_bytes_received
                    .fetch_add(len, Ordering::Relaxed);
                drop(held);
                conn.last_used.store(self.links.now_ns(), Ordering::Relaxed);
                self.links.emit(Event::Data {
                    peer,
                    stream: h.a,
                    offset: h.b,
                    len,
                });
            }
        }
        Ok(true)
    }
}
