//! Memory regions over an [`Arena`] (the node's arena or a transport's private buffers).

use super::sys::{self, ibv_mr};
use super::{ProtectionDomain, VerbsError};
use phalanx_transport::Arena;
use std::sync::Arc;

/// What peers may do with a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Write anywhere in it, with its rkey.
    RemoteWrite,
    /// Nothing through its own rkey; write into what a bound [`super::MemoryWindow`]
    /// exposes, through that window's QP only.
    WindowsOnly,
    /// Nothing at all (the local NIC still reads and writes it).
    LocalOnly,
}

/// A registration of an [`Arena`], whole or a range of it. It keeps the arena mapped and the
/// protection domain alive for as long as it exists, and deregisters before either goes away.
pub struct MemoryRegion {
    mr: *mut ibv_mr,
    lkey: u32,
    rkey: u32,
    /// The registered range of `mem`.
    offset: u64,
    len: usize,
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
    /// Registers all of `mem` for local write and remote write (a connection's ring and
    /// notification buffers, which only its peer learns the key of). Never for remote read:
    /// Phalanx only writes into peers, so no peer may read a node's memory.
    pub fn register(
        pd: &Arc<ProtectionDomain>,
        mem: Arc<Arena>,
    ) -> Result<MemoryRegion, VerbsError> {
        Self::register_with(pd, mem, Access::RemoteWrite)
    }

    /// Registers all of `mem` with `access`.
    pub fn register_with(
        pd: &Arc<ProtectionDomain>,
        mem: Arc<Arena>,
        access: Access,
    ) -> Result<MemoryRegion, VerbsError> {
        let len = mem.len();
        Self::register_range(pd, mem, 0, len, access)
    }

    /// Registers `[offset, offset + len)` of `mem` with `access`: the NIC refuses any access
    /// through this region outside that range.
    pub fn register_range(
        pd: &Arc<ProtectionDomain>,
        mem: Arc<Arena>,
        offset: u64,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion, VerbsError> {
        mem.check(offset, len as u64)
            .map_err(|e| VerbsError::Invalid(e.to_string()))?;
        let access = match access {
            Access::RemoteWrite => sys::IBV_ACCESS_LOCAL_WRITE | sys::IBV_ACCESS_REMOTE_WRITE,
            Access::WindowsOnly => sys::IBV_ACCESS_LOCAL_WRITE | sys::IBV_ACCESS_MW_BIND,
            Access::LocalOnly => sys::IBV_ACCESS_LOCAL_WRITE,
        };
        let lib = pd.context().lib;
        // SAFETY: the range lies inside the arena (checked above), a live mapping that we keep
        // alive (Arc) for as long as the registration exists.
        let mr = unsafe {
            let start = mem.as_ptr().add(offset as usize);
            (lib.reg_mr)(pd.pd, start.cast(), len.max(1), access as i32)
        };
        if mr.is_null() {
            return Err(VerbsError::errno("ibv_reg_mr"));
        }
        // SAFETY: mr is a valid ibv_mr returned just above.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok(MemoryRegion {
            mr,
            lkey,
            rkey,
            offset,
            len,
            mem,
            _pd: pd.clone(),
        })
    }

    pub(crate) fn raw(&self) -> *mut ibv_mr {
        self.mr
    }

    pub fn lkey(&self) -> u32 {
        self.lkey
    }

    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// Address of the first registered byte.
    pub fn addr(&self) -> u64 {
        self.mem.as_ptr() as u64 + self.offset
    }

    /// Bytes registered.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The arena this region registers (all of it, or the range `addr()..+len()`).
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
