//! The eager path, sending side: messages composed in the staging copy of the peer's ring
//! and RDMA-written, bottom-filled, into its block `seq % n` once a credit allows it.
//! Control messages always go this way, data writes below the rendezvous threshold too.

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
        let slot = conn.staging_block(seq);
        // SAFETY: staging slot `seq % n` was last used by block `seq - n`, which the peer has
        // consumed (credit check above), so the NIC finished reading it; only the holder of
        // the send lock (us) writes staging slots.
        let blk = unsafe { conn.bufs.arena().slice_mut(slot, conn.lay.bsize as u64) };
        let start = block::encode(blk, conn.lay.n, seq, h, payload);
        conn.sent.fetch_add(1, Ordering::AcqRel);
        let len = (conn.lay.bsize - start) as u32;
        let raddr = conn.remote.ring_addr + (seq % n) * conn.lay.bsize as u64 + start as u64;
        let bufs = conn.bufs.clone();
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
        self.send_ctrl(conn, &mut tx, msg)?;
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
        Ok(())
    }
}
