//! The node's registered arena and descriptors of remote memory.

use crate::{NodeId, TransportError};
use nix::sys::mman::{mmap_anonymous, munmap, MapFlags, ProtFlags};
use std::num::NonZeroUsize;
use std::ptr::NonNull;

/// One page-aligned, fixed-address block of memory that holds a node's objects.
///
/// It is allocated once and never moves, so a transport may register it once (verbs) and
/// peers may write into it at any time. Access goes through raw ranges: the object store
/// guarantees that a range being written by a transfer is not read or written by anyone else
/// and is not handed out again while the transfer is in flight.
pub struct Arena {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the arena is plain memory; concurrent access to disjoint ranges is coordinated by
// the object store (see the type's documentation).
unsafe impl Send for Arena {}
// SAFETY: as above; shared references only hand out raw ranges through unsafe accessors.
unsafe impl Sync for Arena {}

impl Arena {
    /// Maps `len` bytes of zeroed anonymous memory, backed lazily by the kernel.
    /// With `huge_pages`, tries 2 MiB pages first and falls back to normal pages.
    pub fn new(len: usize, huge_pages: bool) -> Result<Arena, TransportError> {
        let size = NonZeroUsize::new(len.max(1)).expect("non-zero");
        let prot = ProtFlags::PROT_READ | ProtFlags::PROT_WRITE;
        let base = MapFlags::MAP_PRIVATE | MapFlags::MAP_NORESERVE;
        if huge_pages {
            // SAFETY: an anonymous private mapping aliases no existing memory.
            if let Ok(p) = unsafe { mmap_anonymous(None, size, prot, base | MapFlags::MAP_HUGETLB) }
            {
                return Ok(Arena { ptr: p.cast(), len });
            }
        }
        // SAFETY: an anonymous private mapping aliases no existing memory.
        let p = unsafe { mmap_anonymous(None, size, prot, base) }
            .map_err(|e| TransportError::Io(std::io::Error::from(e)))?;
        Ok(Arena { ptr: p.cast(), len })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Base address, for registration with a NIC.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Checks that `[offset, offset + len)` lies inside the arena.
    pub fn check(&self, offset: u64, len: u64) -> Result<(), TransportError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len as u64 => Ok(()),
            _ => Err(TransportError::OutOfBounds {
                offset,
                len,
                region_len: self.len as u64,
            }),
        }
    }

    /// A shared view of a range.
    ///
    /// # Safety
    /// The range is inside the arena and nobody writes it while the slice lives.
    pub unsafe fn slice(&self, offset: u64, len: u64) -> &[u8] {
        debug_assert!(self.check(offset, len).is_ok());
        std::slice::from_raw_parts(self.ptr.as_ptr().add(offset as usize), len as usize)
    }

    /// An exclusive view of a range.
    ///
    /// # Safety
    /// The range is inside the arena and nobody else reads or writes it while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, offset: u64, len: u64) -> &mut [u8] {
        debug_assert!(self.check(offset, len).is_ok());
        std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset as usize), len as usize)
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: ptr/len come from our own mmap; the Arc owning us is gone, so no transport
        // holds the registration any more (transports keep an Arc while registered).
        unsafe {
            let _ = munmap(self.ptr.cast(), self.len.max(1));
        }
    }
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

/// Names `[offset, offset + len)` of `node`'s registered arena, which a peer may write into.
/// `addr` and `rkey` are the verbs handles (zero for TCP); `grant` names the grant that lets
/// the peer write there (see [`crate::grant`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RemoteRegion {
    pub node: NodeId,
    pub offset: u64,
    pub len: u64,
    pub addr: u64,
    pub rkey: u32,
    pub grant: u32,
}

impl RemoteRegion {
    /// Checks that `[at, at + len)` lies inside this region.
    pub fn check(&self, at: u64, len: u64) -> Result<(), TransportError> {
        match at.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(TransportError::OutOfBounds {
                offset: at,
                len,
                region_len: self.len,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arena_is_zeroed_aligned_and_bounds_checked() {
        let a = Arena::new(1 << 20, false).unwrap();
        assert_eq!(a.as_ptr() as usize % 4096, 0);
        // SAFETY: the range is inside the arena and nothing else touches it.
        let s = unsafe { a.slice_mut(4096, 16) };
        assert!(s.iter().all(|&b| b == 0));
        s.copy_from_slice(&[7u8; 16]);
        // SAFETY: the writer above is gone.
        assert_eq!(unsafe { a.slice(4096, 16) }, &[7u8; 16]);
        assert!(a.check((1 << 20) - 1, 1).is_ok());
        assert!(a.check(1 << 20, 1).is_err());
        assert!(a.check(u64::MAX, 2).is_err());
    }

    #[test]
    fn remote_region_bounds() {
        let r = RemoteRegion {
            node: 1,
            offset: 100,
            len: 10,
            addr: 0,
            rkey: 0,
            grant: 0,
        };
        assert!(r.check(0, 10).is_ok());
        assert!(r.check(5, 6).is_err());
    }
}
