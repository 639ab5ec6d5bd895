//! The eager path, sending side: messages composed in the staging copy of the peer's ring
//! and RDMA-written, bottom-filled, into its block `seq % n` once a credit allows it; on a
//! link without rings, composed in a block of the shared staging pool and sent into the
//! peer's shared receive queue, under the same credits. Control messages always go this
//! way, data writes below the rendezvous threshold too.

use super::conn::{Conn, TxState};
use super::{Inner, WriteReq, IMM_MASK};
use crate::block::{self, Header, Kind, FLAG_FIRST, FLAG_LAST};
use crate::verbs::MemoryRegion;
use phalanx_transport::{Link, TransportError};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

impl Inner {
    /// Writes one block message. Waits for a credit unless `deadline` passes first
    /// (then `Ok(false)`, nothing sent). `fill` copies the payload into the staging block.
    pub(super) fn send_block(
        &self,
        conn: &Conn,
        tx: &mut TxState,
        h: &Header,
        payload: &[u8],
        deadline: Option<Instant>,
    ) -> Result<bool, TransportError> {
        let seq = tx.next_seq;
        let n = conn.lay.n as u64;
        if !self.wait_for(conn, deadline, || {
            seq - conn.peer_consumed.load(Ordering::Acquire) < n
        })? {
            return Ok(false);
        }
        let Some(bufs) = conn.bufs().cloned() else {
            return self.send_shared(conn, tx, h, payload, deadline);
        };
        let slot = conn.staging_block(seq);
        // SAFETY: staging slot `seq % n` was last used by block `seq - n`, which the peer has
        // consumed (credit check above), so the NIC finished reading it; only the holder of
        // the send lock (us) writes staging slots.
        let blk = unsafe { bufs.arena().slice_mut(slot, conn.lay.bsize as u64) };
        let start = block::encode(blk, conn.lay.n, seq, h, payload);
        conn.sent.fetch_add(1, Ordering::AcqRel);
        let len = (conn.lay.bsize - start) as u32;
        let raddr = conn.remote.ring_addr + (seq % n) * conn.lay.bsize as u64 + start as u64;
        match self.post_app_write(
            conn,
            tx,
            &bufs,
            slot + start as u64,
            len,
            raddr,
            conn.remote.ring_rkey,
            Some(seq as u32 & IMM_MASK),
        ) {
            Ok(_) => {
                tx.next_seq += 1;
                Ok(true)
            }
            Err(e) => {
                conn.sent.fetch_sub(1, Ordering::AcqRel);
                Err(e)
            }
        }
    }

    /// `send_block` on a link without rings (the credit is there): the block is composed in a
    /// staging block of the shared pool, held until the send completes, and sent with its
    /// sequence number as the immediate.
    fn send_shared(
        &self,
        conn: &Conn,
        tx: &mut TxState,
        h: &Header,
        payload: &[u8],
        deadline: Option<Instant>,
    ) -> Result<bool, TransportError> {
        let seq = tx.next_seq;
        let pool = &self.pool;
        let slot = match tx.reserved.pop() {
            Some(s) => s,
            None => match self.take_staging(conn, deadline) {
                Some(s) => s,
                None if conn.is_failed() => return Err(self.peer_failed(conn)),
                None => return Ok(false),
            },
        };
        let bsize = conn.lay.bsize;
        let off = slot as u64 * bsize as u64;
        // SAFETY: a staging block taken from the pool is ours alone until its send completes
        // (then `Staged::completed` gives it back); the NIC reads it only after the post.
        let blk = unsafe { pool.tx.arena().slice_mut(off, bsize as u64) };
        let start = block::encode(blk, conn.lay.n, seq, h, payload);
        let len = (bsize - start) as u32;
        // Held before posting, so that its completion finds it; op is post_app's number.
        let now = Instant::now();
        conn.staged
            .held
            .lock()
            .unwrap()
            .push_back((tx.next_op, slot, now));
        conn.sent.fetch_add(1, Ordering::AcqRel);
        let imm = seq as u32 & IMM_MASK;
        let res = self.post_app(conn, tx, |wr_id| {
            conn.qp
                .post_send_imm(wr_id, &pool.tx, off + start as u64, len, imm)
        });
        match res {
            Ok(_) => {
                tx.next_seq += 1;
                Ok(true)
            }
            Err(e) => {
                conn.sent.fetch_sub(1, Ordering::AcqRel);
                let mut held = conn.staged.held.lock().unwrap();
                if held.back().is_some_and(|&(_, s, _)| s == slot) {
                    held.pop_back();
                    drop(held);
                    pool.release_staging([slot]);
                }
                Err(e)
            }
        }
    }

    /// A block of the shared staging pool, waiting until `deadline` (none: for ever). While
    /// it waits, links whose sends have not completed for the heartbeat timeout are failed:
    /// their peer's NIC takes nothing (its receive queue stays empty) and they must not hold
    /// the pool every other link sends from (their blocks come back when they are dropped).
    /// `None` also once `conn` has failed meanwhile.
    fn take_staging(&self, conn: &Conn, deadline: Option<Instant>) -> Option<u32> {
        let step = (self.cfg.heartbeat_timeout / 4).max(std::time::Duration::from_millis(1));
        loop {
            let now = Instant::now();
            let until = deadline.map_or(now + step, |d| d.min(now + step));
            if let Some(s) = self.pool.take_staging(Some(until)) {
                return Some(s);
            }
            let stuck: Vec<Arc<Conn>> = self
                .by_qpn
                .lock()
                .unwrap()
                .values()
                .filter(|c| {
                    c.staged
                        .oldest()
                        .is_some_and(|t| t.elapsed() > self.cfg.heartbeat_timeout)
                })
                .cloned()
                .collect();
            for c in stuck {
                self.fail_conn(&c, "sends not completing: the peer takes nothing".into());
            }
            if conn.is_failed() || deadline.is_some_and(|d| Instant::now() >= d) {
                return None;
            }
        }
    }

    /// Writes one block message, waiting for a credit at most twice the heartbeat timeout: a
    /// peer that keeps its link alive but consumes nothing is failed then, not waited on for
    /// ever (the verbs side of "no peer can stall a node").
    pub(super) fn send_block_bounded(
        &self,
        conn: &Conn,
        tx: &mut TxState,
        h: &Header,
        payload: &[u8],
    ) -> Result<(), TransportError> {
        let bound = self.cfg.heartbeat_timeout * 2;
        if self.send_block(conn, tx, h, payload, Some(Instant::now() + bound))? {
            return Ok(());
        }
        let current = self.by_qpn.lock().unwrap().get(&conn.qp.qpn()).cloned();
        if let Some(c) = current {
            self.fail_conn(&c, format!("peer not consuming: no credit for {bound:?}"));
        }
        Err(self.peer_failed(conn))
    }

    /// Sends a control message as consecutive fragments (under the caller's send lock).
    pub(super) fn send_ctrl(
        &self,
        conn: &Conn,
        tx: &mut TxState,
        msg: &[u8],
    ) -> Result<(), TransportError> {
        let max = block::max_payload(conn.lay.bsize);
        let mut done = 0;
        loop {
            let n = (msg.len() - done).min(max);
            let mut h = Header::new(Kind::Ctrl);
            if done == 0 {
                h.flags |= FLAG_FIRST;
                h.a = msg.len() as u64;
            }
            if done + n == msg.len() {
                h.flags |= FLAG_LAST;
            }
            self.send_block_bounded(conn, tx, &h, &msg[done..done + n])?;
            done += n;
            if done == msg.len() {
                break;
            }
        }
        let counters = &self.links.counters;
        counters.ctrl_sent.fetch_add(1, Ordering::Relaxed);
        conn.last_used.store(self.links.now_ns(), Ordering::Relaxed);
        Ok(())
    }

    /// Sends a control message only if that needs no waiting: the send lock is free and
    /// every fragment has a credit and a send-queue slot right now. `Ok(false)`: not sent.
    pub(super) fn try_send_ctrl(&self, conn: &Conn, msg: &[u8]) -> Result<bool, TransportError> {
        let Ok(mut tx) = conn.tx.try_lock() else {
            return Ok(false);
        };
        if conn.is_failed() {
            return Err(TransportError::PeerUnavailable(conn.peer()));
        }
        if conn.is_retiring() {
            return Ok(false); // closing for being idle: the blocking send takes the next link
        }
        // Only if every fragment has a credit and a send-queue slot right now.
        let max = block::max_payload(conn.lay.bsize);
        let blocks = msg.len().div_ceil(max).max(1) as u64;
        let free_blocks =
            conn.lay.n as u64 - (tx.next_seq - conn.peer_consumed.load(Ordering::Acquire));
        let limit = conn.sq_depth.saturating_sub(1).max(1);
        let free_sq = limit.saturating_sub(conn.sq_inflight.load(Ordering::Acquire));
        if blocks > free_blocks || blocks > free_sq {
            return Ok(false);
        }
        if conn.is_shared() {
            // Every staging block it needs, now, or nothing is sent.
            let Some(slots) = self.pool.try_take_staging(blocks as usize) else {
                return Ok(false);
            };
            tx.reserved = slots;
        }
        let res = self.send_ctrl(conn, &mut tx, msg);
        let left = std::mem::take(&mut tx.reserved);
        self.pool.release_staging(left);
        res?;
        Ok(true)
    }

    /// The eager path of a data write: the payload rides `Data` blocks, copied into staging
    /// (one copy here, one at the receiver). Returns once every block is posted; the source
    /// range is free again then, as its bytes were copied.
    pub(super) fn write_eager(
        &self,
        conn: &Conn,
        mr: &Arc<MemoryRegion>,
        w: &WriteReq,
    ) -> Result<(), TransportError> {
        let max = block::max_payload(conn.lay.bsize) as u64;
        let counters = &self.links.counters;
        let mut tx = self.lock_tx(conn)?;
        let mut done = 0;
        while done < w.len {
            let n = (w.len - done).min(max);
            let h = Header {
                kind: Kind::Data,
                flags: 0,
                a: w.stream,
                b: w.dst_offset + done,
                c: w.dst.offset + w.dst_offset + done,
                d: 0,
            };
            // SAFETY: `write` checked the bounds; the caller keeps the source range allocated
            // and unchanged until that call returns (trait contract).
            let src = unsafe { mr.arena().slice(w.src_offset + done, n) };
            self.send_block_bounded(conn, &mut tx, &h, src)?;
            counters
                .payload_bytes_copied
                .fetch_add(n, Ordering::Relaxed);
            counters.data_bytes_sent.fetch_add(n, Ordering::Relaxed);
            done += n;
        }
        conn.last_used.store(self.links.now_ns(), Ordering::Relaxed);
        Ok(())
    }
}
