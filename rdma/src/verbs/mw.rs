//! Memory windows (type 2): remote access to a sub-range of a memory region, granted to the
//! peer of one QP by a bind work request ([`super::QueuePair::post_bind`]) and withdrawn by
//! deallocating the window.

use super::sys::{self, ibv_mw};
use super::{MemoryRegion, ProtectionDomain, VerbsError};
use std::sync::Arc;

/// A type 2 memory window. Until it is bound it grants nothing; once bound, only the QP it
/// was bound on may access its range, with the access it was bound with. Dropping it
/// invalidates it (and any binding) before the region it covers may be released.
pub struct MemoryWindow {
    mw: *mut ibv_mw,
    /// The region a binding may expose: kept registered while the window exists (a region
    /// with bound windows cannot be deregistered).
    mr: Option<Arc<MemoryRegion>>,
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: the window handle is only passed to thread-safe verbs (post_send, dealloc).
unsafe impl Send for MemoryWindow {}
// SAFETY: as above; the handle is never written through after allocation.
unsafe impl Sync for MemoryWindow {}

impl MemoryWindow {
    /// Allocates an unbound type 2 window. Fails with `EOPNOTSUPP` on a device without
    /// memory windows.
    pub fn alloc(pd: &Arc<ProtectionDomain>) -> Result<MemoryWindow, VerbsError> {
        // SAFETY: the PD is alive (we keep an Arc) and its context's ops table was filled in
        // by the provider when the device was opened.
        let alloc = unsafe { (*(*pd.pd).context).ops.alloc_mw };
        let Some(alloc) = alloc else {
            return Err(VerbsError::Call {
                call: "ibv_alloc_mw",
                source: std::io::Error::from_raw_os_error(libc::EOPNOTSUPP),
            });
        };
        // SAFETY: as above; the provider returns a window of this PD or NULL with errno.
        let mw = unsafe { alloc(pd.pd, sys::IBV_MW_TYPE_2) };
        if mw.is_null() {
            return Err(VerbsError::errno("ibv_alloc_mw"));
        }
        Ok(MemoryWindow {
            mw,
            mr: None,
            _pd: pd.clone(),
        })
    }

    /// The key the window has now (before its first bind: not usable remotely).
    pub fn rkey(&self) -> u32 {
        // SAFETY: mw is a live window; its rkey field is read-only for us.
        unsafe { (*self.mw).rkey }
    }

    /// The key a bind should give the window next: the same index, the next 8-bit key
    /// (`ibv_inc_rkey`), so that a key from an earlier binding no longer matches.
    pub fn next_rkey(&self) -> u32 {
        let k = self.rkey();
        (k & 0xffff_ff00) | (k.wrapping_add(1) & 0xff)
    }

    pub(crate) fn raw(&self) -> *mut ibv_mw {
        self.mw
    }

    /// Keeps `mr` registered for as long as this window exists.
    pub(crate) fn hold(&mut self, mr: &Arc<MemoryRegion>) {
        self.mr = Some(mr.clone());
    }
}

impl Drop for MemoryWindow {
    fn drop(&mut self) {
        // SAFETY: we own the window; dealloc invalidates any binding, after which no peer can
        // access the range through it; the region (`mr`) is released only after, by the
        // field drops.
        unsafe {
            if let Some(dealloc) = (*(*self.mw).context).ops.dealloc_mw {
                dealloc(self.mw);
            }
        }
    }
}
