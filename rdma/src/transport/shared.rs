//! The node's shared eager memory, the same whatever the number of peers:
//! - a **shared receive queue** of `srq_blocks` blocks, from which every queue pair takes its
//!   receives: the blocks of links without a ring of their own land there (sent, not
//!   written), and the immediates of every link's notifications consume its entries;
//! - a **staging pool** of `staging_blocks` blocks, from which those links compose what
//!   they send (a block is taken until its send completes, not for the life of the link);
//! - the **ring pool**: at most `ring_pool` links have a private ring (and staging copy and
//!   notification buffers) of their own, the fast path of `ring`; the others share the two
//!   pools above. A ticket of the pool is held as long as the link's buffers exist.

use crate::verbs::{MemoryRegion, ProtectionDomain, SharedReceiveQueue, VerbsError};
use phalanx_transport::Arena;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The shared pools of one node.
pub(super) struct SharedPool {
    pub(super) srq: Arc<SharedReceiveQueue>,
    /// The SRQ's receive blocks, block `i` at `i * bsize`.
    pub(super) rx: Arc<MemoryRegion>,
    /// The staging blocks.
    pub(super) tx: Arc<MemoryRegion>,
    pub(super) bsize: usize,
    rx_blocks: usize,
    free_tx: Mutex<Vec<u32>>,
    tx_freed: Condvar,
    rings_free: Mutex<usize>,
    /// Bytes of eager memory registered now (pools and private rings), and the most so far.
    bytes: AtomicU64,
    peak: AtomicU64,
}

/// A link's place in the ring pool: given back when dropped.
pub(super) struct RingTicket {
    pool: Arc<SharedPool>,
    bytes: u64,
}

/// The private ring, staging copy and notification buffers of a link in the ring pool, with
/// its place in the pool (given back when the link is dropped).
pub(super) struct PrivateRing {
    pub(super) mr: Arc<MemoryRegion>,
    pub(super) _place: RingTicket,
}

impl Drop for RingTicket {
    fn drop(&mut self) {
        *self.pool.rings_free.lock().unwrap() += 1;
        self.pool.bytes.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

impl SharedPool {
    /// Registers both pools and posts every receive block to a new SRQ.
    pub(super) fn new(
        pd: &Arc<ProtectionDomain>,
        bsize: usize,
        rx_blocks: usize,
        tx_blocks: usize,
        rings: usize,
        place: impl Fn(&Arena),
    ) -> Result<Arc<SharedPool>, VerbsError> {
        let region = |blocks: usize| -> Result<Arc<MemoryRegion>, VerbsError> {
            let bytes = (blocks.max(1) * bsize).next_multiple_of(4096);
            let mem =
                Arc::new(Arena::new(bytes, false).map_err(|e| {
                    VerbsError::Invalid(format!("eager pool of {bytes} bytes: {e}"))
                })?);
            place(&mem);
            Ok(Arc::new(MemoryRegion::register(pd, mem)?))
        };
        let rx = region(rx_blocks)?;
        let tx = region(tx_blocks)?;
        let srq = SharedReceiveQueue::new(pd, rx_blocks as u32)?;
        let bytes = (rx.len() + tx.len()) as u64;
        let pool = Arc::new(SharedPool {
            srq,
            rx,
            tx,
            bsize,
            rx_blocks,
            free_tx: Mutex::new((0..tx_blocks as u32).rev().collect()),
            tx_freed: Condvar::new(),
            rings_free: Mutex::new(rings),
            bytes: AtomicU64::new(bytes),
            peak: AtomicU64::new(bytes),
        });
        for i in 0..rx_blocks as u32 {
            pool.repost(i)?;
        }
        Ok(pool)
    }

    /// Hands receive block `i` back to the SRQ.
    pub(super) fn repost(&self, i: u32) -> Result<(), VerbsError> {
        if i as usize >= self.rx_blocks {
            return Err(VerbsError::Invalid(format!("no receive block {i}")));
        }
        let off = i as u64 * self.bsize as u64;
        self.srq
            .post_recv(i as u64, &self.rx, off, self.bsize as u32)
    }

    /// The first `len` bytes of receive block `i`.
    ///
    /// # Safety
    /// The block's receive has completed and the block is not posted again until the slice
    /// is dropped (the NIC writes a block only while it is posted).
    pub(super) unsafe fn received(&self, i: u32, len: usize) -> &[u8] {
        let off = i as u64 * self.bsize as u64;
        // SAFETY: inside the region (i < rx_blocks, len <= bsize checked by the caller);
        // stable per the contract.
        unsafe { self.rx.arena().slice(off, len.min(self.bsize) as u64) }
    }

    /// Takes a staging block, waiting until `deadline` (none: for ever, a block comes free
    /// at every completion of a shared-pool send). `None` if the deadline passed.
    pub(super) fn take_staging(&self, deadline: Option<Instant>) -> Option<u32> {
        let mut free = self.free_tx.lock().unwrap();
        loop {
            if let Some(s) = free.pop() {
                return Some(s);
            }
            let mut wait = Duration::from_millis(50);
            if let Some(d) = deadline {
                let now = Instant::now();
                if now >= d {
                    return None;
                }
                wait = wait.min(d - now);
            }
            free = self.tx_freed.wait_timeout(free, wait).unwrap().0;
        }
    }

    /// Takes `n` staging blocks at once if they are free right now.
    pub(super) fn try_take_staging(&self, n: usize) -> Option<Vec<u32>> {
        let mut free = self.free_tx.lock().unwrap();
        if free.len() < n {
            return None;
        }
        let at = free.len() - n;
        Some(free.split_off(at))
    }

    pub(super) fn release_staging(&self, slots: impl IntoIterator<Item = u32>) {
        let mut free = self.free_tx.lock().unwrap();
        let before = free.len();
        free.extend(slots);
        if free.len() != before {
            self.tx_freed.notify_all();
        }
    }

    /// A place in the ring pool for a link whose private buffers take `bytes`, if one is free.
    pub(super) fn take_ring(self: &Arc<Self>, bytes: u64) -> Option<RingTicket> {
        let mut free = self.rings_free.lock().unwrap();
        if *free == 0 {
            return None;
        }
        *free -= 1;
        let now = self.bytes.fetch_add(bytes, Ordering::AcqRel) + bytes;
        self.peak.fetch_max(now, Ordering::AcqRel);
        Some(RingTicket {
            pool: self.clone(),
            bytes,
        })
    }

    /// Eager memory registered now and at most so far, in bytes.
    pub(super) fn bytes(&self) -> (u64, u64) {
        (
            self.bytes.load(Ordering::Acquire),
            self.peak.load(Ordering::Acquire),
        )
    }
}

/// The staging blocks a shared-pool link's sends hold until their completions: block `slot`
/// until application op `op`, posted at `when`, has completed. Given back when the link is
/// dropped, after its QP (declared before this in `Conn`) is destroyed and the NIC reads them
/// no more.
pub(super) struct Staged {
    pub(super) pool: Arc<SharedPool>,
    pub(super) held: Mutex<VecDeque<(u64, u32, Instant)>>,
}

impl Staged {
    /// Gives back the blocks of every op below `done`.
    pub(super) fn completed(&self, done: u64) {
        let mut held = self.held.lock().unwrap();
        let mut freed = Vec::new();
        while let Some(&(op, slot, _)) = held.front() {
            if op >= done {
                break;
            }
            held.pop_front();
            freed.push(slot);
        }
        drop(held);
        if !freed.is_empty() {
            self.pool.release_staging(freed);
        }
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        let held = std::mem::take(&mut *self.held.lock().unwrap());
        self.pool
            .release_staging(held.into_iter().map(|(_, s, _)| s));
    }
}

impl Staged {
    /// When the oldest send still holding a staging block was posted.
    pub(super) fn oldest(&self) -> Option<Instant> {
        self.held.lock().unwrap().front().map(|&(_, _, t)| t)
    }
}
