//! Virtual memory management objects (cuMemCreate, cuMemAddressReserve, cuMemMap): the
//! physical allocations by handle, the reserved ranges and the maps, as the program made them.
//!
//! A physical allocation lives on its server until it is both released by every handle
//! reference (cuMemRelease; cuMemRetainAllocationHandle adds one) and unmapped everywhere; the
//! shim sends the server's `memRelease` only then, so a handle retained from a mapped address
//! after its last release is still the same allocation. Each map is also an entry in the
//! device allocation table ([`super::memory`], marked `mapped`), so copies, memsets, pointer
//! attributes and cuMemGetAddressRange see mapped ranges as CUDA does, and a copy may run on
//! across maps laid end to end.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use rgpu_cuda_types::*;

use super::table::Table;

pub struct Physical {
    pub device: CUdevice,
    pub size: u64,
    /// The properties it was created with (cuMemGetAllocationPropertiesFromHandle).
    pub prop: CUmemAllocationProp,
    /// Handle references and maps; the server frees it when both are 0.
    pub refs: Mutex<(u32, u32)>,
}

// SAFETY: `prop.win32HandleMetaData` is a pointer the program passed and is never
// dereferenced (it is required to be null off Windows); the rest is plain data.
unsafe impl Send for Physical {}
unsafe impl Sync for Physical {}

impl Physical {
    pub fn refs(&self) -> MutexGuard<'_, (u32, u32)> {
        self.refs.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Reservation {
    pub size: u64,
    /// A device of the server the range was reserved on: its maps must be of that server's
    /// memory.
    pub device: CUdevice,
}

#[derive(Clone)]
pub struct Mapping {
    pub size: u64,
    pub handle: u64,
    pub phys: Arc<Physical>,
    /// Access flags by device (cuMemSetAccess); absent is no access.
    pub access: HashMap<CUdevice, u64>,
}

pub struct Vmm {
    pub handles: Table<Physical>,
    state: Mutex<Ranges>,
}

#[derive(Default)]
pub struct Ranges {
    pub reservations: BTreeMap<u64, Reservation>,
    pub mappings: BTreeMap<u64, Mapping>,
}

impl Ranges {
    pub fn reservation_of(&self, ptr: u64) -> Option<(u64, Reservation)> {
        let (&s, r) = self.reservations.range(..=ptr).next_back()?;
        (ptr - s < r.size).then_some((s, *r))
    }

    pub fn mapping_of(&self, ptr: u64) -> Option<(u64, &Mapping)> {
        let (&s, m) = self.mappings.range(..=ptr).next_back()?;
        (ptr - s < m.size).then_some((s, m))
    }

    /// The starts of the maps that tile `[ptr, ptr + size)` exactly; `None` if it starts or
    /// ends inside a map or has a hole.
    pub fn tiling(&self, ptr: u64, size: u64) -> Option<Vec<u64>> {
        let end = ptr.checked_add(size)?;
        let mut at = ptr;
        let mut out = Vec::new();
        for (&s, m) in self.mappings.range(ptr..end) {
            if s != at {
                return None;
            }
            out.push(s);
            at = s + m.size;
        }
        (size > 0 && at == end).then_some(out)
    }
}

impl Default for Vmm {
    fn default() -> Self {
        Vmm { handles: Table::new(tag::MEM_HANDLE), state: Mutex::new(Ranges::default()) }
    }
}

impl Vmm {
    pub fn ranges(&self) -> MutexGuard<'_, Ranges> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}
