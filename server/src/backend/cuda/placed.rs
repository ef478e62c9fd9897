//! Movable memory (`--cuda-movable-memory`): the client's allocations live in ranges this
//! server reserved and mapped through the driver's virtual memory management API, instead of
//! wherever `cuMemAlloc` puts them. A session whose memory sits in such ranges can be rebuilt
//! on another server at the same addresses (reserve the same range there, map new physical
//! memory into it), which a `cuMemAlloc` pointer cannot: the driver offers no way to ask for
//! one at a given address.
//!
//! Small allocations (up to half a region) share 2 MiB regions, as `cuMemAlloc` shares pages,
//! so a program of many small buffers does not hold 2 MiB for each; a larger one gets a
//! region of its own, rounded up to 2 MiB. Which kind an allocation is follows from its size
//! alone, so a restore finds, from a snapshot's (address, size), the region to rebuild.
//!
//! [`Arena`] is the bookkeeping (no driver calls; tested on its own); the driver calls are the
//! `impl CudaSession` below.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use cudarc::driver::sys;
use tracing::warn;

use super::driver::cu;
use super::CudaSession;
use crate::vmm::GRANULARITY;
use rgpu_cuda_types::{CuError, CuResult};

/// Bytes of a shared region.
pub const SLAB: u64 = GRANULARITY;
/// Allocations of at most this many bytes share regions.
pub const SMALL_MAX: u64 = SLAB / 2;
/// Alignment of an allocation in a shared region (what `cuMemAlloc` guarantees, and more).
pub const ALIGN: u64 = 512;

/// One reserved, mapped range and the physical memory behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    pub device: u32,
    pub len: u64,
    /// The driver's `CUmemGenericAllocationHandle`.
    pub phys: u64,
}

#[derive(Debug)]
struct Slab {
    region: Region,
    /// Start -> rounded length of each allocation in it.
    used: BTreeMap<u64, u64>,
    free: u64,
}

/// Where an allocation goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fit {
    /// At this address, in a shared region that exists.
    At(u64),
    /// A shared region is needed first (anywhere; then fit again).
    NewSlab,
    /// A region of its own of this many bytes.
    Own(u64),
}

/// What must exist before `[ptr, ptr + size)` can be taken again (a restore).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NeedAt {
    /// The shared region it lies in exists, and the range in it is free.
    Nothing,
    /// The shared region at this base, on the device.
    Slab(u64),
    /// A region of its own: at `ptr`, of this many bytes.
    Own(u64),
}

/// The regions of one session and the allocations in them.
#[derive(Debug, Default)]
pub struct Arena {
    slabs: BTreeMap<u64, Slab>,
    /// Base -> region of one allocation (its address is the base).
    own: BTreeMap<u64, Region>,
}

fn round(size: u64) -> Option<u64> {
    size.checked_next_multiple_of(ALIGN)
}

impl Arena {
    pub fn is_empty(&self) -> bool {
        self.slabs.is_empty() && self.own.is_empty()
    }

    /// Whether `ptr` is an allocation made here.
    pub fn holds(&self, ptr: u64) -> bool {
        self.own.contains_key(&ptr) || self.slab_of(ptr).is_some_and(|(_, s)| s.used.contains_key(&ptr))
    }

    fn slab_of(&self, ptr: u64) -> Option<(u64, &Slab)> {
        let base = ptr - ptr % SLAB;
        self.slabs.get(&base).map(|s| (base, s))
    }

    pub fn fit(&self, device: u32, size: u64) -> CuResult<Fit> {
        if size == 0 {
            return Err(CuError::INVALID_VALUE);
        }
        if size > SMALL_MAX {
            return size.checked_next_multiple_of(SLAB).map(Fit::Own).ok_or(CuError::OUT_OF_MEMORY);
        }
        let len = round(size).ok_or(CuError::OUT_OF_MEMORY)?;
        for (&base, s) in &self.slabs {
            if s.region.device != device || s.free < len {
                continue;
            }
            // First fit between the allocations.
            let mut at = base;
            for (&p, &l) in &s.used {
                if p - at >= len {
                    break;
                }
                at = p + l;
            }
            if base + SLAB - at >= len {
                return Ok(Fit::At(at));
            }
        }
        Ok(Fit::NewSlab)
    }

    /// What must be made for an allocation of `size` at exactly `ptr` on `device`;
    /// `INVALID_VALUE` if no allocation of this arena could have been there, or the range
    /// is taken.
    pub fn need_at(&self, device: u32, ptr: u64, size: u64) -> CuResult<NeedAt> {
        if size == 0 || ptr == 0 {
            return Err(CuError::INVALID_VALUE);
        }
        if size > SMALL_MAX {
            let len = size.checked_next_multiple_of(SLAB).ok_or(CuError::OUT_OF_MEMORY)?;
            if ptr % SLAB != 0 || ptr.checked_add(len).is_none() || self.overlaps(ptr, len) {
                return Err(CuError::INVALID_VALUE);
            }
            return Ok(NeedAt::Own(len));
        }
        let len = round(size).ok_or(CuError::OUT_OF_MEMORY)?;
        let base = ptr - ptr % SLAB;
        if ptr % ALIGN != 0 || ptr - base + len > SLAB {
            return Err(CuError::INVALID_VALUE);
        }
        match self.slabs.get(&base) {
            Some(s) if s.region.device != device => Err(CuError::INVALID_VALUE),
            Some(s) => {
                let before = s.used.range(..=ptr).next_back().is_some_and(|(&p, &l)| p + l > ptr);
                let after = s.used.range(ptr..).next().is_some_and(|(&p, _)| p < ptr + len);
                if before || after {
                    Err(CuError::INVALID_VALUE)
                } else {
                    Ok(NeedAt::Nothing)
                }
            }
            None if self.overlaps(base, SLAB) => Err(CuError::INVALID_VALUE),
            None => Ok(NeedAt::Slab(base)),
        }
    }

    /// Whether `[at, at + len)` meets a region (regions never overlap, so the last one
    /// starting before its end is the only one to look at of each kind).
    fn overlaps(&self, at: u64, len: u64) -> bool {
        let end = at.saturating_add(len);
        let slab = self.slabs.range(..end).next_back().is_some_and(|(&b, _)| b + SLAB > at);
        let own = self.own.range(..end).next_back().is_some_and(|(&b, r)| b + r.len > at);
        slab || own
    }

    pub fn add_slab(&mut self, base: u64, region: Region) {
        self.slabs.insert(base, Slab { region, used: BTreeMap::new(), free: SLAB });
    }

    /// Takes `[ptr, ptr + size)` in the shared region it lies in (found by [`Self::fit`] or
    /// [`Self::need_at`]).
    pub fn take(&mut self, ptr: u64, size: u64) {
        let len = round(size).unwrap_or(SLAB);
        if let Some(s) = self.slabs.get_mut(&(ptr - ptr % SLAB)) {
            s.used.insert(ptr, len);
            s.free -= len;
        }
    }

    pub fn add_own(&mut self, ptr: u64, region: Region) {
        self.own.insert(ptr, region);
    }

    /// Forgets allocation `ptr`; returns the region to give back to the driver, if its last
    /// allocation went (none is kept empty: a program that frees everything sees the
    /// device's memory free again, as after cuMemFree).
    pub fn free(&mut self, ptr: u64) -> Option<(u64, Region)> {
        if let Some(r) = self.own.remove(&ptr) {
            return Some((ptr, r));
        }
        let base = ptr - ptr % SLAB;
        let s = self.slabs.get_mut(&base)?;
        let len = s.used.remove(&ptr)?;
        s.free += len;
        if s.used.is_empty() {
            self.slabs.remove(&base).map(|s| (base, s.region))
        } else {
            None
        }
    }

    /// Every region of `device`, for a context's reset.
    pub fn drain_device(&mut self, device: u32) -> Vec<(u64, Region)> {
        let mut out = Vec::new();
        self.slabs.retain(|&b, s| {
            let mine = s.region.device == device;
            if mine {
                out.push((b, s.region));
            }
            !mine
        });
        self.own.retain(|&b, r| {
            let mine = r.device == device;
            if mine {
                out.push((b, *r));
            }
            !mine
        });
        out
    }

    /// Every region, for the session's end.
    pub fn drain(&mut self) -> Vec<(u64, Region)> {
        let mut all: Vec<(u64, Region)> = std::mem::take(&mut self.slabs).into_iter().map(|(b, s)| (b, s.region)).collect();
        all.extend(std::mem::take(&mut self.own));
        all
    }
}

impl CudaSession {
    /// A new region of `len` bytes on `device`, readable and writable there; at exactly
    /// `hint` unless it is 0 (`INVALID_VALUE` when the driver puts it elsewhere: the range is
    /// taken in this process).
    fn region_new(&mut self, device: u32, len: u64, hint: u64) -> CuResult<(u64, Region)> {
        let bytes = usize::try_from(len).map_err(|_| CuError::OUT_OF_MEMORY)?;
        let dev = self.raw_device(device)?;
        self.bind(device)?;
        let mut va: sys::CUdeviceptr = 0;
        cu!(sys::cuMemAddressReserve(&mut va, bytes, GRANULARITY as usize, hint, 0))?;
        if hint != 0 && va != hint {
            let _ = cu!(sys::cuMemAddressFree(va, bytes));
            warn!(device, at = format_args!("{hint:#x}"), len, "the address range a restored allocation needs is taken in this server");
            return Err(CuError::INVALID_VALUE);
        }
        let made = (|| {
            let h = self.physical_new(dev, bytes)?;
            let mapped = cu!(sys::cuMemMap(va, bytes, 0, h, 0)).and_then(|()| {
                let desc = super::vmm::access(dev, crate::vmm::ACCESS_READWRITE);
                let r = cu!(sys::cuMemSetAccess(va, bytes, &desc, 1));
                if r.is_err() {
                    let _ = cu!(sys::cuMemUnmap(va, bytes));
                }
                r
            });
            if let Err(e) = mapped {
                let _ = cu!(sys::cuMemRelease(h));
                return Err(e);
            }
            Ok(h)
        })();
        let h = match made {
            Ok(h) => h,
            Err(e) => {
                let _ = cu!(sys::cuMemAddressFree(va, bytes));
                return Err(e);
            }
        };
        if self.shared.scrub_on_alloc[device as usize].load(Ordering::Relaxed) {
            // Completed before the client can queue work on any stream.
            let r = cu!(sys::cuMemsetD8_v2(va, 0, bytes)).and_then(|()| cu!(sys::cuStreamSynchronize(std::ptr::null_mut())));
            if let Err(e) = r {
                self.region_release(va, Region { device, len, phys: h });
                return Err(e);
            }
        }
        Ok((va, Region { device, len, phys: h }))
    }

    /// Zeroes, unmaps and releases a region. Its allocations were zeroed as
    /// they were freed, but a kernel may have written past one into the
    /// region's free parts: the whole region is the session's, and the
    /// driver hands released memory to this process's next `cuMemCreate`
    /// (another tenant's) as it is.
    fn region_release(&mut self, va: u64, r: Region) {
        let bytes = r.len as usize;
        if self.bind(r.device).is_err() {
            self.shared.scrub_on_alloc[r.device as usize].store(true, Ordering::Relaxed);
            return;
        }
        let zeroed = cu!(sys::cuMemsetD8_v2(va, 0, bytes)).and_then(|()| cu!(sys::cuCtxSynchronize()));
        if let Err(e) = zeroed {
            if !self.shared.scrub_on_alloc[r.device as usize].swap(true, Ordering::Relaxed) {
                warn!(device = r.device, "cannot zero a released movable-memory region: {e}; later allocations on the device are zeroed instead");
            }
        }
        if let Err(e) = cu!(sys::cuMemUnmap(va, bytes)) {
            warn!(device = r.device, "cuMemUnmap of a movable-memory region failed: {e}");
        }
        let _ = cu!(sys::cuMemRelease(r.phys));
        let _ = cu!(sys::cuMemAddressFree(va, bytes));
    }

    /// `cuMemAlloc` for a session with movable memory.
    pub(super) fn placed_alloc(&mut self, device: u32, size: u64) -> CuResult<u64> {
        let p = self.placed_place(device, size)?;
        if self.shared.scrub_on_alloc[device as usize].load(Ordering::Relaxed) {
            // Completed before the client can queue work on any stream.
            let r = self
                .bind(device)
                .and_then(|()| cu!(sys::cuMemsetD8_v2(p, 0, size as usize)))
                .and_then(|()| cu!(sys::cuStreamSynchronize(std::ptr::null_mut())));
            if let Err(e) = r {
                self.placed_free(p);
                return Err(e);
            }
        }
        self.peek_tables().allocs.insert(p, (device, size));
        Ok(p)
    }

    fn placed_place(&mut self, device: u32, size: u64) -> CuResult<u64> {
        match self.placed.fit(device, size)? {
            Fit::At(p) => {
                self.placed.take(p, size);
                Ok(p)
            }
            Fit::NewSlab => {
                let (base, r) = self.region_new(device, SLAB, 0)?;
                self.placed.add_slab(base, r);
                self.placed.take(base, size);
                Ok(base)
            }
            Fit::Own(len) => {
                let (base, r) = self.region_new(device, len, 0)?;
                self.placed.add_own(base, r);
                Ok(base)
            }
        }
    }

    /// An allocation of `size` at exactly `ptr`: a restored session's.
    pub(super) fn placed_alloc_at(&mut self, device: u32, ptr: u64, size: u64) -> CuResult {
        match self.placed.need_at(device, ptr, size)? {
            NeedAt::Nothing => self.placed.take(ptr, size),
            NeedAt::Slab(base) => {
                let (_, r) = self.region_new(device, SLAB, base)?;
                self.placed.add_slab(base, r);
                self.placed.take(ptr, size);
            }
            NeedAt::Own(len) => {
                let (_, r) = self.region_new(device, len, ptr)?;
                self.placed.add_own(ptr, r);
            }
        }
        self.peek_tables().allocs.insert(ptr, (device, size));
        Ok(())
    }

    /// cuMemFree of a placed allocation: zeroed after every earlier use, as cuMemFree waits
    /// for the device, then forgotten. A context a kernel broke does no more work (and a
    /// memset queued there would only fail later): its memory goes back as it is, and the
    /// device zeroes what it hands out from then on.
    pub(super) fn placed_free_zeroed(&mut self, device: u32, ptr: u64, size: u64) {
        // Once no other thread reads it (a pre-copy's read ends first).
        self.peek_tables().allocs.remove(&ptr);
        let sync = |this: &mut Self| this.bind(device).and_then(|()| cu!(sys::cuCtxSynchronize()));
        let zeroed = sync(self).and_then(|()| cu!(sys::cuMemsetD8_v2(ptr, 0, size as usize))).and_then(|()| sync(self));
        if let Err(e) = zeroed {
            if !self.shared.scrub_on_alloc[device as usize].swap(true, Ordering::Relaxed) {
                warn!(device, "cannot zero freed memory: {e}; later allocations on the device are zeroed instead");
            }
        }
        self.placed_free(ptr);
    }

    /// Forgets an allocation (already zeroed) and gives back its region if it emptied.
    pub(super) fn placed_free(&mut self, ptr: u64) {
        if let Some((base, r)) = self.placed.free(ptr) {
            self.region_release(base, r);
        }
    }

    /// The session's end: every region back to the driver (its allocations were zeroed).
    pub(super) fn placed_teardown(&mut self) {
        for (base, r) in self.placed.drain() {
            self.region_release(base, r);
        }
    }

    /// A context's reset: the device's regions back to the driver.
    pub(super) fn placed_teardown_device(&mut self, device: u32) {
        for (base, r) in self.placed.drain_device(device) {
            self.region_release(base, r);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: u64 = 0x7000_0000_0000;

    fn region(device: u32, len: u64) -> Region {
        Region { device, len, phys: 1 }
    }

    #[test]
    fn small_allocations_share_a_region_and_large_ones_get_their_own() {
        let mut a = Arena::default();
        assert_eq!(a.fit(0, 0), Err(CuError::INVALID_VALUE));
        assert_eq!(a.fit(0, 100), Ok(Fit::NewSlab));
        a.add_slab(BASE, region(0, SLAB));
        assert_eq!(a.fit(0, 100), Ok(Fit::At(BASE)));
        a.take(BASE, 100);
        assert_eq!(a.fit(0, 1000), Ok(Fit::At(BASE + ALIGN)), "after the first, aligned");
        a.take(BASE + ALIGN, 1000);
        assert_eq!(a.fit(1, 100), Ok(Fit::NewSlab), "another device's region is not shared");
        assert_eq!(a.fit(0, SMALL_MAX + 1), Ok(Fit::Own(SLAB)));
        assert_eq!(a.fit(0, 5 * SLAB + 1), Ok(Fit::Own(6 * SLAB)));
        assert_eq!(a.fit(0, u64::MAX), Err(CuError::OUT_OF_MEMORY));
        // A gap left by a free is used again; a full region is passed over.
        assert_eq!(a.free(BASE), None, "the region still holds an allocation");
        assert_eq!(a.fit(0, ALIGN), Ok(Fit::At(BASE)));
        assert_eq!(a.fit(0, ALIGN + 1), Ok(Fit::At(BASE + ALIGN + 1024)));
        a.take(BASE + ALIGN + 1024, SMALL_MAX);
        assert_eq!(a.fit(0, SMALL_MAX), Ok(Fit::NewSlab));
        assert!(a.holds(BASE + ALIGN) && !a.holds(BASE) && !a.holds(BASE + 1));
    }

    #[test]
    fn a_region_goes_back_with_its_last_allocation() {
        let mut a = Arena::default();
        a.add_slab(BASE, region(0, SLAB));
        a.add_slab(BASE + SLAB, region(0, SLAB));
        a.take(BASE, 10);
        a.take(BASE + ALIGN, 10);
        a.take(BASE + SLAB, 10);
        assert_eq!(a.free(BASE), None, "one allocation is left in it");
        assert_eq!(a.free(BASE + SLAB), Some((BASE + SLAB, region(0, SLAB))));
        assert_eq!(a.free(BASE + SLAB), None, "not an allocation any more");
        a.add_own(BASE + 8 * SLAB, region(0, 4 * SLAB));
        assert_eq!(a.free(BASE + 8 * SLAB), Some((BASE + 8 * SLAB, region(0, 4 * SLAB))));
        a.add_slab(BASE + 16 * SLAB, region(1, SLAB));
        assert_eq!(a.drain_device(1), vec![(BASE + 16 * SLAB, region(1, SLAB))]);
        assert_eq!(a.drain(), vec![(BASE, region(0, SLAB))], "the one still holding an allocation");
        assert!(a.is_empty());
    }

    #[test]
    fn a_restore_rebuilds_the_region_an_address_and_size_name_or_refuses() {
        let mut a = Arena::default();
        // Small: the shared region around it.
        assert_eq!(a.need_at(0, BASE + 3 * ALIGN, 100), Ok(NeedAt::Slab(BASE)));
        a.add_slab(BASE, region(0, SLAB));
        a.take(BASE + 3 * ALIGN, 100);
        assert_eq!(a.need_at(0, BASE, 3 * ALIGN), Ok(NeedAt::Nothing), "beside it, in the same region");
        assert_eq!(a.need_at(0, BASE, 3 * ALIGN + 1), Err(CuError::INVALID_VALUE), "runs into it");
        assert_eq!(a.need_at(0, BASE + 3 * ALIGN, 1), Err(CuError::INVALID_VALUE), "taken");
        assert_eq!(a.need_at(1, BASE, 10), Err(CuError::INVALID_VALUE), "the region is another device's");
        assert_eq!(a.need_at(0, BASE + 100, 10), Err(CuError::INVALID_VALUE), "misaligned");
        assert_eq!(a.need_at(0, BASE + SLAB - ALIGN, 2 * ALIGN), Err(CuError::INVALID_VALUE), "crosses its region's end");
        // Large: a region of its own at the address, which must be a region's start.
        assert_eq!(a.need_at(0, BASE + 2 * SLAB, SLAB + 1), Ok(NeedAt::Own(2 * SLAB)));
        assert_eq!(a.need_at(0, BASE + 2 * SLAB + ALIGN, SLAB), Err(CuError::INVALID_VALUE));
        assert_eq!(a.need_at(0, BASE, SLAB), Err(CuError::INVALID_VALUE), "over a shared region");
        a.add_own(BASE + 2 * SLAB, region(0, 2 * SLAB));
        assert_eq!(a.need_at(0, BASE + 3 * SLAB, 10), Err(CuError::INVALID_VALUE), "inside a large one");
        assert_eq!(a.need_at(0, BASE + 4 * SLAB, SLAB), Ok(NeedAt::Own(SLAB)), "just after it");
        assert_eq!(a.need_at(0, 0, 10), Err(CuError::INVALID_VALUE));
        assert_eq!(a.need_at(0, BASE, 0), Err(CuError::INVALID_VALUE));
        assert_eq!(a.need_at(0, u64::MAX - SLAB + 1, SLAB * 2), Err(CuError::INVALID_VALUE));
    }
}
