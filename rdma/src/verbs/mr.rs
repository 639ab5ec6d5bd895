//! Memory regions over an [`Arena`] (the node's arena or a transport's private buffers).

use super::sys::{self, ibv_mr};
use super::{ProtectionDomain, VerbsError};
use phalanx_transport::Arena;
use std::sync::Arc;

/// A registration of a whole [`Arena`]. It keeps the arena mapped and the protection domain
/// alive for as long as it exists, and deregisters before either goes away.
pub struct MemoryRegion {
    mr: *mut ibv_mr,
    lkey: u32,
    rkey: u32,
    // Field order matters only for readability: Drop::drop deregisters before the fields
    // (the memory and the PD) are released.
    mem: Arc<Arena>,
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: the MR handle is only passed to thread-safe verbs; the memory is an Arena (Sync).
unsafe impl Send for MemoryRegion {}
// SAFETY: as above.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// Registers all of `mem` for local write and remote write. Never for remote read:
    /// Phalanx only writes into peers, so no peer may read a node's memory.
    pub fn register(
        pd: &Arc<ProtectionDomain>,
        mem: Arc<Arena>,
    ) -> Result<MemoryRegion, VerbsError> {
        let access = sys::IBV_ACCESS_LOCAL_WRITE | sys::IBV_ACCESS_REMOTE_WRITE;
        let lib = pd.context().lib;
        // SAFETY: the arena is a live mapping of mem.len() bytes that we keep alive (Arc) for
        // as long as the registration exists.
        let mr =
            unsafe { (lib.reg_mr)(pd.pd, mem.as_ptr().cast(), mem.len().max(1), access as i32) };
        if mr.is_null() {
            return Err(VerbsError::errno("ibv_reg_mr"));
        }
        // SAFETY: mr is a valid ibv_mr returned just above.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok(MemoryRegion {
            mr,
            lkey,
            rkey,
            mem,
            _pd: pd.clone(),
        })
    }

    pub fn lkey(&self) -> u32 {
        self.lkey
    }

    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// Address of the first registered byte.
    pub fn addr(&self) -> u64 {
        self.mem.as_ptr() as u64
    }

    pub fn len(&self) -> usize {
        self.mem.len()
    }

    pub fn is_empty(&self) -> bool {
        self.mem.is_empty()
    }

    pub fn arena(&self) -> &Arc<Arena> {
        &self.mem
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: users keep an Arc<MemoryRegion> in every connection whose QP may access it
        // and the QP is destroyed first, so the NIC no longer touches this memory.
        unsafe { (self._pd.context().lib.dereg_mr)(self.mr) };
    }
}
