//! The rendezvous path of a data write: a window of RDMA writes of `chunk_size` bytes
//! straight from the local arena into the receiver's `RemoteRegion` (no copy, no
//! registration), each followed on the same QP by a `DataDone` block that RC ordering
//! delivers after the chunk's bytes.

use super::conn::Conn;
use super::{Inner, WriteReq};
use crate::block::{Header, Kind};
use crate::verbs::MemoryRegion;
use phalanx_transport::TransportError;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl Inner {
    /// Writes `w` by rendezvous; returns once the last chunk write has completed, so the
    /// source range may be reused. The arena `mr` stays registered meanwhile (the QP holds
    /// it for every write posted from it).
    pub(super) fn write_rendezvous(
        &self,
        conn: &Conn,
        mr: &Arc<MemoryRegion>,
        w: &WriteReq,
    ) -> Result<(), TransportError> {
        let chunk = self.cfg.chunk_size.clamp(4096, 1 << 30) as u64;
        let window = self.cfg.write_window.max(1);
        let mut in_flight: VecDeque<u64> = VecDeque::new();
        let mut last_op = 0;
        let mut done = 0;
        while done < w.len {
            while in_flight.len() >= window {
                let op = in_flight.pop_front().expect("non-empty");
                self.wait_for(conn, None, || conn.ops_done.load(Ordering::Acquire) > op)?;
            }
            let n = (w.len - done).min(chunk);
            let mut tx = match self.lock_tx(conn) {
                Ok(tx) => tx,
                // Closed for being idle after some chunks went: the write cannot move to the
                // next link (its grant's window is bound to this QP).
                Err(TransportError::PeerUnavailable(peer)) if done > 0 => {
                    return Err(TransportError::PeerFailed {
                        peer,
                        reason: "link closed for being idle during a write".into(),
                    })
                }
                Err(e) => return Err(e),
            };
            let op = self.post_app_write(
                conn,
                &mut tx,
                mr,
                w.src_offset + done,
                n as u32,
                w.dst.addr + w.dst_offset + done,
                w.dst.rkey,
                None,
            )?;
            let h = Header {
                kind: Kind::DataDone,
                flags: 0,
                a: w.stream,
                b: w.dst_offset + done,
                c: w.dst.offset + w.dst_offset + done,
                d: n,
            };
            self.send_block_bounded(conn, &mut tx, &h, &[])?;
            drop(tx);
            in_flight.push_back(op);
            last_op = op;
            let counters = &self.links.counters;
            counters.data_bytes_sent.fetch_add(n, Ordering::Relaxed);
            conn.last_used.store(self.links.now_ns(), Ordering::Relaxed);
            done += n;
        }
        // The source may be reused once the last chunk write has completed.
        self.wait_for(conn, None, || {
            conn.ops_done.load(Ordering::Acquire) > last_op
        })?;
        Ok(())
    }
}
