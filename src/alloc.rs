//! First-fit range allocator over the arena, with coalescing of free neighbours.

use std::collections::BTreeMap;

/// Allocation granularity: cache-line aligned so reduce kernels can use aligned vector loads.
pub const ALIGN: u64 = 64;

#[derive(Debug)]
pub struct RangeAllocator {
    capacity: u64,
    /// Free ranges, offset -> length; never adjacent (always coalesced).
    free: BTreeMap<u64, u64>,
    free_bytes: u64,
}

impl RangeAllocator {
    pub fn new(capacity: u64) -> Self {
        let capacity = capacity / ALIGN * ALIGN;
        let mut free = BTreeMap::new();
        if capacity > 0 {
            free.insert(0, capacity);
        }
        RangeAllocator {
            capacity,
            free,
            free_bytes: capacity,
        }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// `len` rounded up to the granularity (a length too close to `u64::MAX` has none).
    fn rounded(len: u64) -> Option<u64> {
        len.max(1).checked_next_multiple_of(ALIGN)
    }

    /// Returns the offset of a range of at least `len` bytes, or None when no hole fits.
    pub fn alloc(&mut self, len: u64) -> Option<u64> {
        let need = Self::rounded(len)?;
        let (&off, &hole) = self.free.iter().find(|(_, &l)| l >= need)?;
        self.free.remove(&off);
        if hole > need {
            self.free.insert(off + need, hole - need);
        }
        self.free_bytes -= need;
        Some(off)
    }

    /// Returns a range obtained from `alloc(len)`.
    pub fn free(&mut self, off: u64, len: u64) {
        let rounded = Self::rounded(len).expect("a length alloc accepted");
        let mut start = off;
        let mut size = rounded;
        self.free_bytes += size;
        if let Some((&p, &pl)) = self.free.range(..off).next_back() {
            debug_assert!(p + pl <= off, "double free");
            if p + pl == off {
                self.free.remove(&p);
                start = p;
                size += pl;
            }
        }
        if let Some(&nl) = self.free.get(&(off + rounded)) {
            self.free.remove(&(off + rounded));
            size += nl;
        }
        self.free.insert(start, size);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_free_coalesce() {
        let mut a = RangeAllocator::new(1024);
        let x = a.alloc(100).unwrap();
        let y = a.alloc(64).unwrap();
        let z = a.alloc(1).unwrap();
        assert_eq!((x, y, z), (0, 128, 192));
        assert_eq!(a.free_bytes(), 1024 - 256);
        assert!(a.alloc(1024).is_none());
        a.free(y, 64);
        assert_eq!(a.alloc(64), Some(128));
        a.free(128, 64);
        a.free(x, 100);
        a.free(z, 1);
        assert_eq!(a.free_bytes(), 1024);
        assert_eq!(a.alloc(1024), Some(0));
    }

    #[test]
    fn lengths_near_the_top_of_u64_are_refused() {
        let mut a = RangeAllocator::new(1 << 20);
        for len in [u64::MAX, u64::MAX - 1, u64::MAX - 63, 1 << 40] {
            assert_eq!(a.alloc(len), None, "{len}");
        }
        assert_eq!(a.free_bytes(), 1 << 20, "nothing taken");
        assert_eq!(a.alloc(64), Some(0));
    }

    #[test]
    fn zero_length_takes_one_granule() {
        let mut a = RangeAllocator::new(128);
        assert_eq!(a.alloc(0), Some(0));
        assert_eq!(a.alloc(0), Some(64));
        assert_eq!(a.alloc(0), None);
    }
}
