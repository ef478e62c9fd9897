//! One session's virtual memory management objects (cuMemCreate, cuMemAddressReserve,
//! cuMemMap, cuMemSetAccess, ...), by the handles and addresses the client knows them by.
//!
//! This is where every VMM request is checked before the backend sees it: sizes, offsets and
//! addresses on the granularity, a map inside one reservation and over no other map, an unmap
//! or an access change over whole maps, a physical allocation kept alive (and charged) until it
//! is both released and unmapped. The backend gets only requests that passed, so a sim mapping
//! never points at freed memory whatever the client sends. Copies and memsets over mapped
//! ranges are checked here too ([`Vmm::check_range`]): they may span adjacent maps of different
//! allocations, as PyTorch's expandable segments make them, but only where the device was
//! given access.

use std::collections::{BTreeMap, HashMap};

use tracing::warn;

use crate::backend::{BackendSession, PhysicalToken};
use rgpu_cuda_types::{CuError, CuResult};

/// The granularity of sizes, offsets and addresses: 2 MiB, what NVIDIA GPUs report as both
/// the minimum and the recommended granularity of device memory.
pub const GRANULARITY: u64 = 2 << 20;

/// Most reservations one session may hold; they cost the server memory but no device memory,
/// so they are bounded here.
pub const MAX_RESERVATIONS: usize = 1 << 16;
/// Most maps one session may hold: aliases of one allocation cost no device memory, so the
/// server's bookkeeping is bounded here (2^18 maps of 2 MiB are 512 GiB of addresses).
pub const MAX_MAPPINGS: usize = 1 << 18;

/// `CUmemAccess_flags`.
pub const ACCESS_NONE: u32 = 0;
pub const ACCESS_READ: u32 = 1;
pub const ACCESS_READWRITE: u32 = 3;

#[derive(Debug)]
struct Physical {
    device: u32,
    size: u64,
    token: PhysicalToken,
    /// cuMemRelease was called; the memory lives on while it is mapped.
    released: bool,
    maps: u32,
}

#[derive(Debug, Clone, Copy)]
struct Mapping {
    size: u64,
    handle: u64,
    /// Where in the allocation the map starts.
    offset: u64,
    /// The access flags of the allocation's own device (`ACCESS_*`).
    access: u32,
    device: u32,
}

#[derive(Debug, Default)]
pub struct Vmm {
    physical: HashMap<u64, Physical>,
    /// start -> size.
    reservations: BTreeMap<u64, u64>,
    /// start -> map.
    mappings: BTreeMap<u64, Mapping>,
}

/// A physical allocation as a snapshot carries it (its contents go beside it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PhysicalImage {
    pub handle: u64,
    pub device: u32,
    pub size: u64,
    /// cuMemRelease was called: it lives on while mapped.
    pub released: bool,
}

/// A map as a snapshot carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapImage {
    pub ptr: u64,
    pub size: u64,
    pub handle: u64,
    pub offset: u64,
    /// The access of the allocation's own device (`ACCESS_*`).
    pub access: u32,
    pub device: u32,
}

/// A session's VMM objects as a snapshot carries them.
#[derive(Debug, Default)]
pub struct Image {
    pub physical: Vec<PhysicalImage>,
    pub reservations: Vec<(u64, u64)>,
    pub mappings: Vec<MapImage>,
}

fn granular(v: u64) -> bool {
    v % GRANULARITY == 0
}

impl Vmm {
    /// Whether the session holds no reservation, physical allocation or map.
    pub fn is_empty(&self) -> bool {
        self.physical.is_empty() && self.reservations.is_empty() && self.mappings.is_empty()
    }

    /// cuMemCreate: `handle` is the client's, `size` a non-zero multiple of the granularity.
    pub fn create(&mut self, b: &mut dyn BackendSession, handle: u64, device: u32, size: u64) -> CuResult {
        if handle == 0 || self.physical.contains_key(&handle) {
            return Err(CuError::INVALID_VALUE);
        }
        if size == 0 || !granular(size) {
            return Err(CuError::INVALID_VALUE);
        }
        let token = b.mem_create(device, size)?;
        self.physical.insert(handle, Physical { device, size, token, released: false, maps: 0 });
        Ok(())
    }

    /// cuMemRelease: the memory goes back when its last map is gone too.
    pub fn release(&mut self, b: &mut dyn BackendSession, handle: u64) -> CuResult {
        let p = self.physical.get_mut(&handle).filter(|p| !p.released).ok_or(CuError::INVALID_VALUE)?;
        p.released = true;
        self.collect(b, handle)
    }

    /// Frees `handle`'s memory if it is released and unmapped.
    fn collect(&mut self, b: &mut dyn BackendSession, handle: u64) -> CuResult {
        let Some(p) = self.physical.get(&handle) else { return Ok(()) };
        if p.released && p.maps == 0 {
            let token = p.token;
            self.physical.remove(&handle);
            b.mem_release(token)?;
        }
        Ok(())
    }

    /// cuMemAddressReserve: `alignment` 0 means the granularity; `hint` is only a hint.
    pub fn reserve(&mut self, b: &mut dyn BackendSession, size: u64, alignment: u64, hint: u64) -> CuResult<u64> {
        if size == 0 || !granular(size) {
            return Err(CuError::INVALID_VALUE);
        }
        if alignment != 0 && !alignment.is_power_of_two() {
            return Err(CuError::INVALID_VALUE);
        }
        if self.reservations.len() >= MAX_RESERVATIONS {
            return Err(CuError::OUT_OF_MEMORY);
        }
        let alignment = alignment.max(GRANULARITY);
        let hint = if hint % alignment == 0 { hint } else { 0 };
        let va = b.mem_address_reserve(size, alignment, hint)?;
        let end = va.checked_add(size).ok_or(CuError::UNKNOWN)?;
        let clash = self.reservations.range(..end).next_back().is_some_and(|(&s, &l)| s + l > va);
        if clash || va == 0 || va % alignment != 0 {
            // The backend broke its contract; give the range back rather than alias two.
            warn!(va, size, "backend returned an unusable reservation");
            let _ = b.mem_address_free(va, size);
            return Err(CuError::UNKNOWN);
        }
        self.reservations.insert(va, size);
        Ok(va)
    }

    /// cuMemAddressFree: a whole reservation, with nothing mapped in it any more.
    pub fn address_free(&mut self, b: &mut dyn BackendSession, ptr: u64, size: u64) -> CuResult {
        if self.reservations.get(&ptr) != Some(&size) {
            return Err(CuError::INVALID_VALUE);
        }
        if self.mappings.range(ptr..ptr + size).next().is_some() {
            return Err(CuError::INVALID_VALUE);
        }
        b.mem_address_free(ptr, size)?;
        self.reservations.remove(&ptr);
        Ok(())
    }

    /// cuMemMap: `[ptr, ptr + size)` inside one reservation and over no other map, backed by
    /// `[offset, offset + size)` of an allocation not yet released.
    pub fn map(&mut self, b: &mut dyn BackendSession, ptr: u64, size: u64, offset: u64, handle: u64) -> CuResult {
        if size == 0 || !granular(ptr) || !granular(size) || !granular(offset) {
            return Err(CuError::INVALID_VALUE);
        }
        let end = ptr.checked_add(size).ok_or(CuError::INVALID_VALUE)?;
        let inside = self.reservations.range(..=ptr).next_back().is_some_and(|(&s, &l)| end <= s + l);
        if !inside {
            return Err(CuError::INVALID_VALUE);
        }
        let overlaps = self.mappings.range(..end).next_back().is_some_and(|(&s, m)| s + m.size > ptr);
        if overlaps {
            return Err(CuError::INVALID_VALUE);
        }
        let p = self.physical.get_mut(&handle).filter(|p| !p.released).ok_or(CuError::INVALID_VALUE)?;
        if offset.checked_add(size).is_none_or(|e| e > p.size) {
            return Err(CuError::INVALID_VALUE);
        }
        if self.mappings.len() >= MAX_MAPPINGS {
            return Err(CuError::OUT_OF_MEMORY);
        }
        b.mem_map(ptr, size, offset, p.token)?;
        p.maps += 1;
        let device = p.device;
        self.mappings.insert(ptr, Mapping { size, handle, offset, access: ACCESS_NONE, device });
        Ok(())
    }

    /// The maps that tile `[ptr, ptr + size)` exactly, in order; `None` if the range starts or
    /// ends inside a map or has a hole.
    fn tiling(&self, ptr: u64, size: u64) -> Option<Vec<(u64, Mapping)>> {
        let end = ptr.checked_add(size)?;
        let mut out = Vec::new();
        let mut at = ptr;
        for (&s, m) in self.mappings.range(ptr..end) {
            if s != at {
                return None;
            }
            out.push((s, *m));
            at = s + m.size;
        }
        (size > 0 && at == end).then_some(out)
    }

    /// cuMemUnmap: one or more whole maps, adjacent.
    pub fn unmap(&mut self, b: &mut dyn BackendSession, ptr: u64, size: u64) -> CuResult {
        let maps = self.tiling(ptr, size).ok_or(CuError::INVALID_VALUE)?;
        for (s, m) in maps {
            b.mem_unmap(s, m.size)?;
            self.mappings.remove(&s);
            if let Some(p) = self.physical.get_mut(&m.handle) {
                p.maps -= 1;
            }
            self.collect(b, m.handle)?;
        }
        Ok(())
    }

    /// cuMemSetAccess for one location: whole maps only.
    pub fn set_access(&mut self, b: &mut dyn BackendSession, ptr: u64, size: u64, device: u32, flags: u32) -> CuResult {
        if !matches!(flags, ACCESS_NONE | ACCESS_READ | ACCESS_READWRITE) {
            return Err(CuError::INVALID_VALUE);
        }
        let Some(maps) = self.tiling(ptr, size) else {
            // Inside mapped memory but cutting a map: CUDA allows it; rgpu keeps one access
            // setting per map.
            if self.covered(ptr, size) {
                warn!(ptr, size, "cuMemSetAccess on part of a mapping is not supported by rgpu");
                return Err(CuError::NOT_SUPPORTED);
            }
            return Err(CuError::INVALID_VALUE);
        };
        b.mem_set_access(ptr, size, device, flags)?;
        for (s, m) in maps {
            if m.device == device {
                if let Some(e) = self.mappings.get_mut(&s) {
                    e.access = flags;
                }
            }
        }
        Ok(())
    }

    /// Whether every byte of `[ptr, ptr + size)` is mapped.
    fn covered(&self, ptr: u64, size: u64) -> bool {
        let Some(end) = ptr.checked_add(size) else { return false };
        let mut at = ptr;
        while at < end {
            match self.mappings.range(..=at).next_back() {
                Some((&s, m)) if at < s + m.size => at = s + m.size,
                _ => return false,
            }
        }
        size > 0
    }

    /// cuMemAddressReserve of exactly `[ptr, ptr + size)` (a rebuilt session's reservation,
    /// where the program's pointers into it still point).
    pub fn reserve_at(&mut self, b: &mut dyn BackendSession, ptr: u64, size: u64) -> CuResult {
        if ptr == 0 || !granular(ptr) {
            return Err(CuError::INVALID_VALUE);
        }
        let got = self.reserve(b, size, GRANULARITY, ptr)?;
        if got != ptr {
            let _ = self.address_free(b, got, size);
            return Err(CuError::INVALID_VALUE);
        }
        Ok(())
    }

    /// The device of physical allocation `handle`.
    pub fn device_of(&self, handle: u64) -> Option<u32> {
        self.physical.get(&handle).map(|p| p.device)
    }

    /// The backend's token of physical allocation `handle`.
    pub fn token(&self, handle: u64) -> Option<PhysicalToken> {
        self.physical.get(&handle).map(|p| p.token)
    }

    /// What a snapshot carries: the physical allocations (handle, device, size, released),
    /// the reservations (start, size) and the maps, each in address or handle order.
    pub fn image(&self) -> Image {
        let mut physical: Vec<PhysicalImage> = self
            .physical
            .iter()
            .map(|(&handle, p)| PhysicalImage { handle, device: p.device, size: p.size, released: p.released })
            .collect();
        physical.sort_by_key(|p| p.handle);
        Image {
            physical,
            reservations: self.reservations.iter().map(|(&s, &l)| (s, l)).collect(),
            mappings: self
                .mappings
                .iter()
                .map(|(&ptr, m)| MapImage { ptr, size: m.size, handle: m.handle, offset: m.offset, access: m.access, device: m.device })
                .collect(),
        }
    }

    /// Checks that `[ptr, ptr + len)` lies in maps of one device, adjacent, each readable by
    /// it, and returns the device. A zero-length range still has to start inside one.
    pub fn check_range(&self, ptr: u64, len: u64) -> CuResult<u32> {
        let end = ptr.checked_add(len.max(1)).ok_or(CuError::INVALID_VALUE)?;
        let (&s, first) = self.mappings.range(..=ptr).next_back().ok_or(CuError::INVALID_VALUE)?;
        if ptr >= s + first.size {
            return Err(CuError::INVALID_VALUE);
        }
        let device = first.device;
        let mut at = s;
        for (&ms, m) in self.mappings.range(s..) {
            if at >= end {
                break;
            }
            if ms != at || m.device != device || m.access == ACCESS_NONE {
                return Err(CuError::INVALID_VALUE);
            }
            at = ms + m.size;
        }
        if at < end {
            return Err(CuError::INVALID_VALUE);
        }
        Ok(device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::sim::{SimBackend, SimConfig};
    use crate::backend::{Backend, MemoryBudget, StreamRef};
    use std::sync::Arc;

    const G: u64 = GRANULARITY;

    fn sim(budget: Option<u64>) -> Box<dyn BackendSession> {
        let cfg = SimConfig {
            devices: 2,
            memory: 64 << 20,
            compute_capability: (9, 0),
            seed: None,
            kernel_time_limit: std::time::Duration::from_secs(5),
            compiled_tier: true,
        };
        let b = SimBackend::new(&cfg).unwrap();
        b.open_session(budget.map(|l| Arc::new(MemoryBudget::new(l)))).unwrap()
    }

    fn write(b: &mut dyn BackendSession, ptr: u64, bytes: &[u8]) -> CuResult {
        let mut src = bytes;
        b.memcpy_htod(StreamRef::Default { device: 0 }, ptr, bytes.len() as u64, &mut |buf| {
            let (a, rest) = src.split_at(buf.len());
            buf.copy_from_slice(a);
            src = rest;
            Ok(())
        })
        .map_err(|e| match e {
            crate::backend::TransferError::Device(e) => e,
            crate::backend::TransferError::Io(_) => CuError::UNKNOWN,
        })
    }

    fn read(b: &mut dyn BackendSession, ptr: u64, len: u64) -> CuResult<Vec<u8>> {
        let mut out = Vec::new();
        b.memcpy_dtoh(StreamRef::Default { device: 0 }, ptr, len, &mut |s| {
            out.extend_from_slice(s);
            Ok(())
        })
        .map_err(|_| CuError::INVALID_VALUE)?;
        Ok(out)
    }

    #[test]
    fn two_handles_mapped_back_to_back_make_one_range() {
        let mut b = sim(None);
        let mut v = Vmm::default();
        let va = v.reserve(&mut *b, 4 * G, 0, 0).unwrap();
        v.create(&mut *b, 1, 0, G).unwrap();
        v.create(&mut *b, 2, 0, G).unwrap();
        v.map(&mut *b, va, G, 0, 1).unwrap();
        v.map(&mut *b, va + G, G, 0, 2).unwrap();
        assert_eq!(v.check_range(va + G - 8, 16), Err(CuError::INVALID_VALUE), "no access yet");
        v.set_access(&mut *b, va, 2 * G, 0, ACCESS_READWRITE).unwrap();
        assert_eq!(v.check_range(va + G - 8, 16), Ok(0));
        assert_eq!(v.check_range(va, 2 * G), Ok(0));
        assert_eq!(v.check_range(va, 2 * G + 1), Err(CuError::INVALID_VALUE), "past the last map");
        // A copy across the boundary lands in both allocations.
        let bytes: Vec<u8> = (0..16u8).collect();
        write(&mut *b, va + G - 8, &bytes).unwrap();
        assert_eq!(read(&mut *b, va + G - 8, 16).unwrap(), bytes);
        // Handle 2 seen on its own, elsewhere: its first bytes are the copy's second half.
        v.map(&mut *b, va + 3 * G, G, 0, 2).unwrap();
        v.set_access(&mut *b, va + 3 * G, G, 0, ACCESS_READWRITE).unwrap();
        assert_eq!(read(&mut *b, va + 3 * G, 8).unwrap(), bytes[8..]);
    }

    #[test]
    fn aliases_see_each_others_writes() {
        let mut b = sim(None);
        let mut v = Vmm::default();
        let va = v.reserve(&mut *b, 4 * G, 0, 0).unwrap();
        v.create(&mut *b, 7, 0, 2 * G).unwrap();
        v.map(&mut *b, va, 2 * G, 0, 7).unwrap();
        v.map(&mut *b, va + 2 * G, G, G, 7).unwrap();
        v.set_access(&mut *b, va, 3 * G, 0, ACCESS_READWRITE).unwrap();
        write(&mut *b, va + 2 * G + 100, b"alias").unwrap();
        assert_eq!(read(&mut *b, va + G + 100, 5).unwrap(), b"alias", "offset G of the handle, through the first map");
        b.memset(
            StreamRef::Default { device: 0 },
            &crate::backend::MemsetOp { dst: va + G + 100, value: 0x41, element_size: 1, count: 2, pitch: 0, rows: 1 },
        )
        .unwrap();
        assert_eq!(read(&mut *b, va + 2 * G + 100, 5).unwrap(), b"AAias");
    }

    #[test]
    fn maps_must_fit_and_not_overlap() {
        let mut b = sim(None);
        let mut v = Vmm::default();
        let va = v.reserve(&mut *b, 2 * G, 0, 0).unwrap();
        v.create(&mut *b, 1, 0, 2 * G).unwrap();
        assert_eq!(v.map(&mut *b, va + 1, G, 0, 1), Err(CuError::INVALID_VALUE), "unaligned");
        assert_eq!(v.map(&mut *b, va, 3 * G, 0, 1), Err(CuError::INVALID_VALUE), "past the reservation");
        assert_eq!(v.map(&mut *b, va, 2 * G, G, 1), Err(CuError::INVALID_VALUE), "past the allocation");
        assert_eq!(v.map(&mut *b, va, G, 0, 99), Err(CuError::INVALID_VALUE), "no such handle");
        v.map(&mut *b, va, 2 * G, 0, 1).unwrap();
        assert_eq!(v.map(&mut *b, va + G, G, 0, 1), Err(CuError::INVALID_VALUE), "overlap");
        assert_eq!(v.unmap(&mut *b, va, G), Err(CuError::INVALID_VALUE), "part of a map");
        assert_eq!(v.set_access(&mut *b, va, G, 0, ACCESS_READWRITE), Err(CuError::NOT_SUPPORTED));
        assert_eq!(v.set_access(&mut *b, va, 2 * G, 0, 2), Err(CuError::INVALID_VALUE), "write-only is no flag");
        assert_eq!(v.address_free(&mut *b, va, 2 * G), Err(CuError::INVALID_VALUE), "still mapped");
        v.unmap(&mut *b, va, 2 * G).unwrap();
        v.address_free(&mut *b, va, 2 * G).unwrap();
        assert_eq!(v.reserve(&mut *b, G + 1, 0, 0), Err(CuError::INVALID_VALUE));
        assert_eq!(v.reserve(&mut *b, G, 3 * G, 0), Err(CuError::INVALID_VALUE), "alignment not a power of two");
    }

    #[test]
    fn memory_lives_until_released_and_unmapped_and_is_charged() {
        let mut b = sim(Some(3 * G));
        let mut v = Vmm::default();
        let va = v.reserve(&mut *b, 2 * G, 0, 0).unwrap();
        v.create(&mut *b, 1, 0, 2 * G).unwrap();
        assert_eq!(v.create(&mut *b, 2, 0, 2 * G), Err(CuError::OUT_OF_MEMORY), "over the lease's budget");
        v.map(&mut *b, va, 2 * G, 0, 1).unwrap();
        v.set_access(&mut *b, va, 2 * G, 0, ACCESS_READWRITE).unwrap();
        write(&mut *b, va, b"kept").unwrap();
        v.release(&mut *b, 1).unwrap();
        assert_eq!(v.release(&mut *b, 1), Err(CuError::INVALID_VALUE), "released twice");
        assert_eq!(read(&mut *b, va, 4).unwrap(), b"kept", "still mapped, still there");
        assert_eq!(b.mem_get_info(0).unwrap().0, G, "still charged");
        v.unmap(&mut *b, va, 2 * G).unwrap();
        assert_eq!(b.mem_get_info(0).unwrap().0, 3 * G, "unmapped and released: given back");
        assert_eq!(v.check_range(va, 4), Err(CuError::INVALID_VALUE));
        v.create(&mut *b, 2, 0, 2 * G).unwrap();
        v.map(&mut *b, va, 2 * G, 0, 2).unwrap();
        v.set_access(&mut *b, va, 2 * G, 0, ACCESS_READWRITE).unwrap();
        assert_eq!(read(&mut *b, va, 4).unwrap(), [0; 4], "fresh memory is zero");
    }

    #[test]
    fn maps_of_two_devices_do_not_make_one_range() {
        let mut b = sim(None);
        let mut v = Vmm::default();
        let va = v.reserve(&mut *b, 2 * G, 0, 0).unwrap();
        v.create(&mut *b, 1, 0, G).unwrap();
        v.create(&mut *b, 2, 1, G).unwrap();
        v.map(&mut *b, va, G, 0, 1).unwrap();
        v.map(&mut *b, va + G, G, 0, 2).unwrap();
        v.set_access(&mut *b, va, G, 0, ACCESS_READWRITE).unwrap();
        v.set_access(&mut *b, va + G, G, 1, ACCESS_READWRITE).unwrap();
        assert_eq!(v.check_range(va + G - 4, 8), Err(CuError::INVALID_VALUE));
        assert_eq!(v.check_range(va + G, 8), Ok(1));
    }
}
