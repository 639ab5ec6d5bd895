//! Shared receive queue: one queue of receive buffers every queue pair attached to it takes
//! its receives from, so receive memory does not grow with the number of connections.

use super::sys::{self, ibv_recv_wr, ibv_sge, ibv_srq, ibv_srq_init_attr, Lib};
use super::{MemoryRegion, ProtectionDomain, VerbsError};
use std::sync::{Arc, Mutex};

/// A shared receive queue. It keeps its PD and every memory region it ever posted from alive
/// until it is destroyed; the queue pairs attached to it keep it alive (they are destroyed
/// first, as the verbs API requires).
pub struct SharedReceiveQueue {
    srq: *mut ibv_srq,
    lib: &'static Lib,
    max_wr: u32,
    // Dropped after the SRQ is destroyed in Drop::drop.
    in_use: Mutex<Vec<Arc<MemoryRegion>>>,
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: posting to an SRQ is a thread-safe verb; our own state is behind a Mutex.
unsafe impl Send for SharedReceiveQueue {}
// SAFETY: as above.
unsafe impl Sync for SharedReceiveQueue {}

impl SharedReceiveQueue {
    /// Creates an SRQ of `max_wr` single-buffer receives.
    pub fn new(pd: &Arc<ProtectionDomain>, max_wr: u32) -> Result<Arc<Self>, VerbsError> {
        // SAFETY: ibv_srq_init_attr is plain old data; zero is valid.
        let mut a: ibv_srq_init_attr = unsafe { std::mem::zeroed() };
        a.attr.max_wr = max_wr;
        a.attr.max_sge = 1;
        let lib = pd.context().lib;
        // SAFETY: the PD is alive (we keep an Arc); `a` is fully initialised.
        let srq = unsafe { (lib.create_srq)(pd.pd, &mut a) };
        if srq.is_null() {
            return Err(VerbsError::errno("ibv_create_srq"));
        }
        Ok(Arc::new(SharedReceiveQueue {
            srq,
            lib,
            max_wr,
            in_use: Mutex::new(Vec::new()),
            _pd: pd.clone(),
        }))
    }

    /// Receives the queue holds at most.
    pub fn max_wr(&self) -> u32 {
        self.max_wr
    }

    pub(crate) fn raw(&self) -> *mut ibv_srq {
        self.srq
    }

    /// Posts one receive into `[offset, offset + len)` of `mr`. The SRQ keeps `mr` alive
    /// until it is destroyed; the caller must not read the range until the receive's
    /// completion, nor post it again before then.
    pub fn post_recv(
        &self,
        wr_id: u64,
        mr: &Arc<MemoryRegion>,
        offset: u64,
        len: u32,
    ) -> Result<(), VerbsError> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= mr.len() as u64 => {}
            _ => {
                return Err(VerbsError::Invalid(format!(
                    "receive buffer {offset}+{len} outside a region of {}",
                    mr.len()
                )))
            }
        }
        {
            let mut v = self.in_use.lock().unwrap();
            if !v.iter().any(|m| Arc::ptr_eq(m, mr)) {
                v.push(mr.clone());
            }
        }
        let mut sge = ibv_sge {
            addr: mr.addr() + offset,
            length: len,
            lkey: mr.lkey(),
        };
        // SAFETY: ibv_recv_wr is plain old data; zero is valid.
        let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.num_sge = 1;
        wr.sg_list = &mut sge;
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: the SRQ is alive; `wr` and `sge` live across the call; the range is inside
        // `mr` (checked above), which the SRQ keeps registered until it is destroyed.
        let rc = unsafe { sys::post_srq_recv(self.srq, &mut wr, &mut bad) };
        if rc != 0 {
            return Err(VerbsError::code("ibv_post_srq_recv", rc));
        }
        Ok(())
    }
}

impl Drop for SharedReceiveQueue {
    fn drop(&mut self) {
        // SAFETY: no QP is attached any more (each holds an Arc of us), so nothing else uses
        // the SRQ; after destroy the NIC no longer writes its buffers, which `in_use` keeps
        // registered until then.
        unsafe { (self.lib.destroy_srq)(self.srq) };
    }
}
