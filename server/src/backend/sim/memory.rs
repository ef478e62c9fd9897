//! Simulated device memory: one anonymous mapping per device, carved up by a
//! first-fit allocator with 512-byte granularity.
//!
//! The mapping is `MAP_NORESERVE`, so a 16 GiB device costs only the pages
//! actually written. Device addresses are `base + offset`, with a per-device
//! base that looks like a GPU virtual address and never overlaps another
//! device's. Freed ranges are zeroed at once (whole pages are given back to
//! the kernel with `MADV_DONTNEED`), so reused memory is always zero.
//!
//! This type is the one door to the bytes: [`DeviceMemory::with_slice`] and
//! [`DeviceMemory::with_slice_mut`] check that a range lies inside one live
//! allocation before handing out a slice. The PTX interpreter instead takes
//! each of its session's allocations once per launch ([`DeviceMemory::region`])
//! and bounds-checks every access against them itself.

use std::collections::BTreeMap;
use std::io;
use std::ptr::NonNull;
use std::sync::Mutex;

use rgpu_cuda_types::{CuError, CuResult};

/// Allocation granularity (and alignment) in bytes.
pub const GRANULE: u64 = 512;
/// Device VA of device 0's first byte; device `n` starts `n << 40` above.
pub const VA_BASE: u64 = 0x7f00_0000_0000;
/// Each device's address window; sizes above it are refused.
pub const VA_STRIDE: u64 = 1 << 40;

pub struct DeviceMemory {
    base: u64,
    map: NonNull<u8>,
    size: u64,
    page: u64,
    state: Mutex<Allocator>,
}

// SAFETY: the mapping is plain memory owned by this value, and every access
// is bounds-checked under `state` against live allocations. An allocation is
// one session's, except one shared through IPC: then two sessions' threads
// may write it at once, as two processes may race on a GPU, which tears
// bytes of that allocation and touches nothing else.
unsafe impl Send for DeviceMemory {}
unsafe impl Sync for DeviceMemory {}

#[derive(Default)]
struct Allocator {
    /// Free ranges by offset -> length; never adjacent (coalesced).
    free: BTreeMap<u64, u64>,
    /// Live allocations by offset -> length (rounded to GRANULE).
    live: BTreeMap<u64, u64>,
    used: u64,
}

impl DeviceMemory {
    /// Maps `size` bytes (rounded down to GRANULE) for device `ordinal`.
    pub fn new(ordinal: u32, size: u64) -> io::Result<Self> {
        let size = size / GRANULE * GRANULE;
        if size == 0 || size > VA_STRIDE {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("sim device memory must be between {GRANULE} bytes and 1 TiB, got {size}"),
            ));
        }
        let len = usize::try_from(size).map_err(|_| io::Error::other("device memory too large"))?;
        // SAFETY: a fresh anonymous private mapping; no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let map = NonNull::new(p as *mut u8).ok_or_else(|| io::Error::other("mmap returned null"))?;
        // SAFETY: sysconf has no preconditions.
        let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
            n if n > 0 => n as u64,
            _ => 4096,
        };
        let mut state = Allocator::default();
        state.free.insert(0, size);
        Ok(DeviceMemory {
            base: VA_BASE + ordinal as u64 * VA_STRIDE,
            map,
            size,
            page,
            state: Mutex::new(state),
        })
    }

    pub fn total(&self) -> u64 {
        self.size
    }

    pub fn free_bytes(&self) -> u64 {
        self.size - self.lock().used
    }

    /// Whether `ptr` falls in this device's address window.
    pub fn contains(&self, ptr: u64) -> bool {
        ptr >= self.base && ptr - self.base < self.size
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Allocator> {
        // A panic while holding the lock cannot leave the maps half-updated
        // in a way that matters more than refusing service would.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Allocates `size` bytes; best fit over the free ranges.
    pub fn alloc(&self, size: u64) -> CuResult<u64> {
        if size == 0 {
            return Err(CuError::INVALID_VALUE);
        }
        let len = size.checked_next_multiple_of(GRANULE).ok_or(CuError::OUT_OF_MEMORY)?;
        let mut st = self.lock();
        let (off, flen) = st
            .free
            .iter()
            .filter(|&(_, &l)| l >= len)
            .min_by_key(|&(&o, &l)| (l, o))
            .map(|(&o, &l)| (o, l))
            .ok_or(CuError::OUT_OF_MEMORY)?;
        st.free.remove(&off);
        if flen > len {
            st.free.insert(off + len, flen - len);
        }
        st.live.insert(off, len);
        st.used += len;
        Ok(self.base + off)
    }

    /// Allocates `size` bytes from the top of the highest free range that
    /// fits: memory that takes no address of its own (a physical allocation
    /// of the virtual memory API), kept away from where [`Self::alloc`]
    /// places, so that it does not move the addresses later allocations get
    /// (on a GPU, cuMemCreate takes no virtual address).
    pub fn alloc_top(&self, size: u64) -> CuResult<u64> {
        if size == 0 {
            return Err(CuError::INVALID_VALUE);
        }
        let len = size.checked_next_multiple_of(GRANULE).ok_or(CuError::OUT_OF_MEMORY)?;
        let mut st = self.lock();
        let (fo, fl) = st.free.iter().rev().find(|&(_, &l)| l >= len).map(|(&o, &l)| (o, l)).ok_or(CuError::OUT_OF_MEMORY)?;
        let off = fo + fl - len;
        st.free.remove(&fo);
        if fl > len {
            st.free.insert(fo, fl - len);
        }
        st.live.insert(off, len);
        st.used += len;
        Ok(self.base + off)
    }

    /// Allocates `size` bytes at exactly `ptr` (a restored session's
    /// allocation, which the program knows by that address): the range must
    /// be granule-aligned and wholly free.
    pub fn alloc_at(&self, ptr: u64, size: u64) -> CuResult {
        if size == 0 {
            return Err(CuError::INVALID_VALUE);
        }
        let off = self.offset(ptr)?;
        if off % GRANULE != 0 {
            return Err(CuError::INVALID_VALUE);
        }
        let len = size.checked_next_multiple_of(GRANULE).ok_or(CuError::OUT_OF_MEMORY)?;
        let end = off.checked_add(len).filter(|&e| e <= self.size).ok_or(CuError::OUT_OF_MEMORY)?;
        let mut st = self.lock();
        let (fo, fl) = st.free.range(..=off).next_back().map(|(&o, &l)| (o, l)).ok_or(CuError::OUT_OF_MEMORY)?;
        if fo + fl < end {
            // Part of the range is taken (another allocation is there).
            return Err(CuError::OUT_OF_MEMORY);
        }
        st.free.remove(&fo);
        if off > fo {
            st.free.insert(fo, off - fo);
        }
        if fo + fl > end {
            st.free.insert(end, fo + fl - end);
        }
        st.live.insert(off, len);
        st.used += len;
        Ok(())
    }

    /// Frees the allocation starting exactly at `ptr`, zeroing it.
    pub fn free(&self, ptr: u64) -> CuResult {
        let off = self.offset(ptr)?;
        let mut st = self.lock();
        let len = st.live.remove(&off).ok_or(CuError::INVALID_VALUE)?;
        st.used -= len;
        self.zero(off, len);
        let (mut start, mut end) = (off, off + len);
        if let Some((&po, &pl)) = st.free.range(..off).next_back() {
            if po + pl == start {
                st.free.remove(&po);
                start = po;
            }
        }
        if let Some(&nl) = st.free.get(&end) {
            st.free.remove(&end);
            end += nl;
        }
        st.free.insert(start, end - start);
        Ok(())
    }

    /// The live allocation `[start, start + len)` containing `ptr`, if any.
    pub fn allocation_of(&self, ptr: u64) -> Option<(u64, u64)> {
        let off = self.offset(ptr).ok()?;
        let st = self.lock();
        let (&o, &l) = st.live.range(..=off).next_back()?;
        (off < o + l).then_some((self.base + o, l))
    }

    /// The live allocation `[start, start + len)` containing `ptr`, with the
    /// host address of its first byte (for the PTX interpreter, which
    /// accesses it atomically while its session's thread waits).
    pub fn region(&self, ptr: u64) -> Option<(u64, u64, *mut u8)> {
        let (start, len) = self.allocation_of(ptr)?;
        // SAFETY: the allocation lies inside the mapping.
        Some((start, len, unsafe { self.map.as_ptr().add((start - self.base) as usize) }))
    }

    /// Copies `buf.len()` bytes at `at` into `buf` if `[alloc, alloc + size)`
    /// is still a live allocation starting at `alloc` and the bytes lie in it.
    /// Safe while the owning session's kernels run: the allocator's lock is
    /// held (the range cannot be freed and handed to another session
    /// meanwhile), and the bytes are read with atomic loads, as kernels
    /// store them.
    pub fn peek(&self, alloc: u64, size: u64, at: u64, buf: &mut [u8]) -> bool {
        let Ok(off) = self.offset(alloc) else { return false };
        let len = buf.len() as u64;
        let inside = at >= alloc && at.checked_add(len).is_some_and(|e| e <= alloc.saturating_add(size));
        let st = self.lock();
        if !inside || st.live.get(&off).is_none_or(|&l| l < size) {
            return false;
        }
        // SAFETY: [at, at + len) lies in a live allocation inside the
        // mapping (checked above, under the lock that frees take).
        let p = unsafe { self.map.as_ptr().add((at - self.base) as usize) };
        // Unaligned edges byte by byte, the rest a word at a time.
        let head = p.align_offset(8).min(buf.len());
        let words = (buf.len() - head) / 8;
        let load8 = |i: usize| -> u8 {
            // SAFETY: i < buf.len(): in bounds; atomic loads pair with the kernels' atomic stores.
            unsafe { (*(p.add(i) as *const std::sync::atomic::AtomicU8)).load(std::sync::atomic::Ordering::Relaxed) }
        };
        for (i, b) in buf[..head].iter_mut().enumerate() {
            *b = load8(i);
        }
        // SAFETY: `words` aligned u64s from p + head lie in bounds.
        let body = unsafe { std::slice::from_raw_parts(p.add(head) as *const std::sync::atomic::AtomicU64, words) };
        for (dst, w) in buf[head..head + words * 8].chunks_exact_mut(8).zip(body) {
            dst.copy_from_slice(&w.load(std::sync::atomic::Ordering::Relaxed).to_ne_bytes());
        }
        for i in head + words * 8..buf.len() {
            buf[i] = load8(i);
        }
        true
    }

    fn offset(&self, ptr: u64) -> CuResult<u64> {
        if self.contains(ptr) {
            Ok(ptr - self.base)
        } else {
            Err(CuError::INVALID_VALUE)
        }
    }

    /// Checks that `[ptr, ptr + len)` lies in one live allocation and returns
    /// the host address of `ptr`.
    fn translate(&self, ptr: u64, len: u64) -> CuResult<*mut u8> {
        let off = self.offset(ptr)?;
        let end = off.checked_add(len).ok_or(CuError::INVALID_VALUE)?;
        let st = self.lock();
        let (&o, &l) = st.live.range(..=off).next_back().ok_or(CuError::INVALID_VALUE)?;
        if end > o + l || off >= o + l {
            return Err(CuError::INVALID_VALUE);
        }
        // SAFETY: off < size, so the result stays inside the mapping.
        Ok(unsafe { self.map.as_ptr().add(off as usize) })
    }

    /// Runs `f` on the bytes of `[ptr, ptr + len)`, which must lie in one
    /// live allocation.
    pub fn with_slice<R>(&self, ptr: u64, len: u64, f: impl FnOnce(&[u8]) -> R) -> CuResult<R> {
        if len == 0 {
            return Ok(f(&[]));
        }
        let p = self.translate(ptr, len)?;
        // SAFETY: in bounds (checked above); the allocation is owned by the
        // calling session, whose single thread is the only one accessing it.
        Ok(f(unsafe { std::slice::from_raw_parts(p, len as usize) }))
    }

    /// As [`DeviceMemory::with_slice`], writable.
    pub fn with_slice_mut<R>(&self, ptr: u64, len: u64, f: impl FnOnce(&mut [u8]) -> R) -> CuResult<R> {
        if len == 0 {
            return Ok(f(&mut []));
        }
        let p = self.translate(ptr, len)?;
        // SAFETY: as in `with_slice`.
        Ok(f(unsafe { std::slice::from_raw_parts_mut(p, len as usize) }))
    }

    /// Copies `len` bytes from `src` to `dst` (both on this device; the
    /// ranges may overlap).
    pub fn copy_within(&self, dst: u64, src: u64, len: u64) -> CuResult {
        if len == 0 {
            return Ok(());
        }
        let s = self.translate(src, len)?;
        let d = self.translate(dst, len)?;
        // SAFETY: both ranges are checked; `copy` allows overlap.
        unsafe { std::ptr::copy(s, d, len as usize) };
        Ok(())
    }

    /// Zeroes `[off, off + len)` of the mapping: whole pages are decommitted,
    /// the partial pages at either edge are cleared by hand.
    fn zero(&self, off: u64, len: u64) {
        let end = off + len;
        let pstart = off.next_multiple_of(self.page);
        let pend = end / self.page * self.page;
        let base = self.map.as_ptr();
        // SAFETY: all ranges below lie within [off, end), inside the mapping,
        // in an allocation that was just removed from the live set.
        unsafe {
            if pstart < pend {
                let r = libc::madvise(
                    base.add(pstart as usize) as *mut libc::c_void,
                    (pend - pstart) as usize,
                    libc::MADV_DONTNEED,
                );
                if r != 0 {
                    std::ptr::write_bytes(base.add(pstart as usize), 0, (pend - pstart) as usize);
                }
                std::ptr::write_bytes(base.add(off as usize), 0, (pstart - off) as usize);
                std::ptr::write_bytes(base.add(pend as usize), 0, (end - pend) as usize);
            } else {
                std::ptr::write_bytes(base.add(off as usize), 0, len as usize);
            }
        }
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        // SAFETY: unmapping the region mapped in `new`; no slices outlive `self`.
        unsafe { libc::munmap(self.map.as_ptr() as *mut libc::c_void, self.size as usize) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_free_coalesce_and_zero() {
        let m = DeviceMemory::new(1, 1 << 20).unwrap();
        assert_eq!(m.total(), 1 << 20);
        let a = m.alloc(100).unwrap();
        assert_eq!(a, VA_BASE + VA_STRIDE);
        let b = m.alloc(10_000).unwrap();
        assert_eq!(b - a, 512);
        assert_eq!(m.free_bytes(), (1 << 20) - 512 - 10_240);
        m.with_slice_mut(b, 10_000, |s| s.fill(0xab)).unwrap();
        m.free(b).unwrap();
        assert_eq!(m.free(b), Err(CuError::INVALID_VALUE));
        let c = m.alloc(10_000).unwrap();
        assert_eq!(c, b);
        m.with_slice(c, 10_000, |s| assert!(s.iter().all(|&x| x == 0))).unwrap();
        m.free(a).unwrap();
        m.free(c).unwrap();
        assert_eq!(m.free_bytes(), 1 << 20);
        assert_eq!(m.lock().free.len(), 1, "coalesced back to one range");
    }

    #[test]
    fn alloc_at_takes_exactly_the_range_asked_or_nothing() {
        let m = DeviceMemory::new(0, 1 << 20).unwrap();
        let at = VA_BASE + 8 * GRANULE;
        m.alloc_at(at, 1000).unwrap();
        assert_eq!(m.allocation_of(at + 5), Some((at, 1024)));
        assert_eq!(m.free_bytes(), (1 << 20) - 1024);
        // Overlapping, misaligned, outside, or running past the end: refused, nothing taken.
        assert_eq!(m.alloc_at(at + GRANULE, 10), Err(CuError::OUT_OF_MEMORY));
        assert_eq!(m.alloc_at(at - GRANULE, 2 * GRANULE), Err(CuError::OUT_OF_MEMORY));
        assert_eq!(m.alloc_at(at + 3000, 10), Err(CuError::INVALID_VALUE));
        assert_eq!(m.alloc_at(VA_BASE + (1 << 20), 10), Err(CuError::INVALID_VALUE));
        assert_eq!(m.alloc_at(VA_BASE + (1 << 20) - GRANULE, 2 * GRANULE), Err(CuError::OUT_OF_MEMORY));
        assert_eq!(m.alloc_at(VA_BASE, u64::MAX), Err(CuError::OUT_OF_MEMORY));
        assert_eq!(m.free_bytes(), (1 << 20) - 1024);
        // The ranges on either side are still free and usable.
        m.alloc_at(VA_BASE, 8 * GRANULE).unwrap();
        let next = m.alloc(GRANULE).unwrap();
        assert_eq!(next, at + 1024);
        m.free(at).unwrap();
        m.free(VA_BASE).unwrap();
        m.free(next).unwrap();
        assert_eq!(m.lock().free.len(), 1, "coalesced back to one range");
    }

    #[test]
    fn top_allocations_leave_the_bottom_where_it_was() {
        let m = DeviceMemory::new(0, 1 << 20).unwrap();
        let top = m.alloc_top(1000).unwrap();
        assert_eq!(top, VA_BASE + (1 << 20) - 1024);
        assert_eq!(m.alloc(GRANULE).unwrap(), VA_BASE, "the first allocation where it would have been");
        assert_eq!(m.alloc_top(GRANULE).unwrap(), top - GRANULE);
        assert_eq!(m.alloc_top(1 << 20), Err(CuError::OUT_OF_MEMORY));
        assert_eq!(m.free_bytes(), (1 << 20) - 1024 - 2 * GRANULE);
        m.free(top).unwrap();
        assert_eq!(m.alloc_top(1024).unwrap(), top, "its place is free again");
    }

    #[test]
    fn bounds_and_errors() {
        let m = DeviceMemory::new(0, 1 << 20).unwrap();
        assert_eq!(m.alloc(0), Err(CuError::INVALID_VALUE));
        assert_eq!(m.alloc(2 << 20), Err(CuError::OUT_OF_MEMORY));
        assert_eq!(m.alloc(u64::MAX), Err(CuError::OUT_OF_MEMORY));
        let a = m.alloc(1000).unwrap();
        assert!(m.with_slice(a, 1000, |_| ()).is_ok());
        // Rounded-up slack is inside the allocation, the next granule is not.
        assert!(m.with_slice(a, 1024, |_| ()).is_ok());
        assert_eq!(m.with_slice(a, 1025, |_| ()), Err(CuError::INVALID_VALUE));
        assert_eq!(m.with_slice(a + 1024, 1, |_| ()), Err(CuError::INVALID_VALUE));
        assert_eq!(m.with_slice(a + 10, u64::MAX, |_| ()), Err(CuError::INVALID_VALUE));
        assert_eq!(m.free(a + 512), Err(CuError::INVALID_VALUE));
        assert_eq!(m.free(0), Err(CuError::INVALID_VALUE));
        assert_eq!(m.allocation_of(a + 5), Some((a, 1024)));
    }
}
