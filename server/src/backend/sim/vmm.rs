//! The sim's virtual memory management: physical allocations are ordinary allocations of a
//! device's [`DeviceMemory`] (never reachable at their own address: they are not in the
//! session's allocation list), and a map makes `[offset, offset + size)` of one appear at a
//! reserved address. The mapped address translates to the allocation's own bytes, so a second
//! map of the same allocation is an alias (a write through one is read through the other),
//! and a range over two adjacent maps is the pieces of two allocations, in order.
//!
//! Reservations are taken from a window of device addresses no device's own allocations use
//! ([`VA_WINDOW`]); each session has its own, as each process has its own address space.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use rgpu_ptx::Region;

use super::memory::DeviceMemory;
use rgpu_cuda_types::{CuError, CuResult};

/// Reserved ranges come from here: above the PTX interpreter's shared, local and parameter
/// windows (`rgpu_ptx` puts them below 0x4000_0000_0000) and below the first device's memory
/// ([`super::memory::VA_BASE`]).
pub const VA_WINDOW: Range<u64> = 0x5000_0000_0000..super::memory::VA_BASE;

struct Physical {
    device: u32,
    /// The allocation's address in its device's memory.
    ptr: u64,
    size: u64,
    maps: u32,
}

#[derive(Clone, Copy)]
struct Mapping {
    len: u64,
    /// Host address of the mapped range's first byte, inside the allocation.
    host: *mut u8,
    phys: u64,
    accessible: bool,
}

/// One session's reservations, physical allocations and maps.
#[derive(Default)]
pub struct SimVmm {
    physical: HashMap<u64, Physical>,
    reservations: BTreeMap<u64, u64>,
    mappings: BTreeMap<u64, Mapping>,
    next: u64,
}

// SAFETY: the host pointers point into the devices' mappings, which the session keeps alive
// (it holds the backend's `Shared`), inside physical allocations that are not freed while a
// map uses them (`release` refuses). The session is used by one thread at a time.
unsafe impl Send for SimVmm {}

/// A piece of a mapped range: host address and length.
pub type Piece = (*mut u8, usize);

impl SimVmm {
    /// Whether `ptr` is in the reservation window (so not a device's own allocation).
    pub fn owns(ptr: u64) -> bool {
        VA_WINDOW.contains(&ptr)
    }

    pub fn create(&mut self, devices: &[DeviceMemory], device: u32, size: u64) -> CuResult<u64> {
        let mem = devices.get(device as usize).ok_or(CuError::INVALID_DEVICE)?;
        let ptr = mem.alloc_top(size)?;
        self.next += 1;
        self.physical.insert(self.next, Physical { device, ptr, size, maps: 0 });
        Ok(self.next)
    }

    /// Physical allocation `phys`: its device, its address in that device's memory, its size.
    pub fn physical(&self, phys: u64) -> Option<(u32, u64, u64)> {
        self.physical.get(&phys).map(|p| (p.device, p.ptr, p.size))
    }

    /// Frees an allocation no map uses; returns its size.
    pub fn release(&mut self, devices: &[DeviceMemory], phys: u64) -> CuResult<u64> {
        let p = self.physical.get(&phys).ok_or(CuError::INVALID_VALUE)?;
        if p.maps > 0 {
            return Err(CuError::INVALID_VALUE);
        }
        let mem = devices.get(p.device as usize).ok_or(CuError::INVALID_DEVICE)?;
        mem.free(p.ptr)?;
        let size = p.size;
        self.physical.remove(&phys);
        Ok(size)
    }

    /// Frees every allocation (the session ends; its maps go first).
    pub fn release_all(&mut self, devices: &[DeviceMemory]) {
        self.mappings.clear();
        for (_, p) in self.physical.drain() {
            if let Some(m) = devices.get(p.device as usize) {
                let _ = m.free(p.ptr);
            }
        }
    }

    /// The first free `alignment`-aligned range of `size` bytes in the window, or `hint` if it
    /// is one.
    pub fn reserve(&mut self, size: u64, alignment: u64, hint: u64) -> CuResult<u64> {
        // The reservation overlapping `[at, at + size)`, if any.
        let blocking = |s: &Self, at: u64, end: u64| s.reservations.range(..end).next_back().map(|(&r, &l)| r + l).filter(|&e| e > at);
        let fits = |at: u64| at >= VA_WINDOW.start && at.checked_add(size).is_some_and(|e| e <= VA_WINDOW.end);
        let at = if hint != 0 && hint % alignment == 0 && fits(hint) && blocking(self, hint, hint + size).is_none() {
            hint
        } else {
            let mut at = VA_WINDOW.start;
            loop {
                at = at.checked_next_multiple_of(alignment).ok_or(CuError::OUT_OF_MEMORY)?;
                if !fits(at) {
                    return Err(CuError::OUT_OF_MEMORY);
                }
                // Each step moves past one reservation, so this ends.
                match blocking(self, at, at + size) {
                    None => break at,
                    Some(past) => at = past,
                }
            }
        };
        self.reservations.insert(at, size);
        Ok(at)
    }

    pub fn address_free(&mut self, ptr: u64, size: u64) -> CuResult {
        if self.reservations.get(&ptr) != Some(&size) {
            return Err(CuError::INVALID_VALUE);
        }
        self.reservations.remove(&ptr);
        Ok(())
    }

    pub fn map(&mut self, devices: &[DeviceMemory], ptr: u64, size: u64, offset: u64, phys: u64) -> CuResult {
        let end = ptr.checked_add(size).ok_or(CuError::INVALID_VALUE)?;
        let inside = self.reservations.range(..=ptr).next_back().is_some_and(|(&s, &l)| end <= s + l);
        let overlaps = self.mappings.range(..end).next_back().is_some_and(|(&s, m)| s + m.len > ptr);
        if !inside || overlaps {
            return Err(CuError::INVALID_VALUE);
        }
        let p = self.physical.get_mut(&phys).ok_or(CuError::INVALID_VALUE)?;
        if offset.checked_add(size).is_none_or(|e| e > p.size) {
            return Err(CuError::INVALID_VALUE);
        }
        let mem = devices.get(p.device as usize).ok_or(CuError::INVALID_DEVICE)?;
        let (start, _, host) = mem.region(p.ptr).ok_or(CuError::INVALID_VALUE)?;
        if start != p.ptr {
            return Err(CuError::INVALID_VALUE);
        }
        // SAFETY: offset + size <= the allocation's size, so the result stays inside it.
        let host = unsafe { host.add(offset as usize) };
        p.maps += 1;
        self.mappings.insert(ptr, Mapping { len: size, host, phys, accessible: false });
        Ok(())
    }

    pub fn unmap(&mut self, ptr: u64, size: u64) -> CuResult {
        match self.mappings.get(&ptr) {
            Some(m) if m.len == size => {}
            _ => return Err(CuError::INVALID_VALUE),
        }
        if let Some(m) = self.mappings.remove(&ptr) {
            if let Some(p) = self.physical.get_mut(&m.phys) {
                p.maps -= 1;
            }
        }
        Ok(())
    }

    /// Gives (or takes away) access to the whole maps of `[ptr, ptr + size)`.
    pub fn set_access(&mut self, ptr: u64, size: u64, accessible: bool) -> CuResult {
        let end = ptr.checked_add(size).ok_or(CuError::INVALID_VALUE)?;
        let mut at = ptr;
        let starts: Vec<u64> = self.mappings.range(ptr..end).map(|(&s, _)| s).collect();
        for s in &starts {
            let len = self.mappings[s].len;
            if *s != at {
                return Err(CuError::INVALID_VALUE);
            }
            at = s + len;
        }
        if at != end || starts.is_empty() {
            return Err(CuError::INVALID_VALUE);
        }
        for s in starts {
            if let Some(m) = self.mappings.get_mut(&s) {
                m.accessible = accessible;
            }
        }
        Ok(())
    }

    /// The host pieces of `[ptr, ptr + len)`, which must lie in adjacent accessible maps.
    pub fn pieces(&self, ptr: u64, len: u64) -> CuResult<Vec<Piece>> {
        let end = ptr.checked_add(len).ok_or(CuError::INVALID_VALUE)?;
        let (&s, _) = self.mappings.range(..=ptr).next_back().ok_or(CuError::INVALID_VALUE)?;
        let mut out = Vec::new();
        let mut at = ptr;
        for (&ms, m) in self.mappings.range(s..) {
            if at >= end {
                break;
            }
            if at < ms || at >= ms + m.len || !m.accessible {
                return Err(CuError::INVALID_VALUE);
            }
            let n = (ms + m.len).min(end) - at;
            // SAFETY: at - ms < m.len, inside the mapped part of the allocation.
            out.push((unsafe { m.host.add((at - ms) as usize) }, n as usize));
            at += n;
        }
        if at < end {
            return Err(CuError::INVALID_VALUE);
        }
        Ok(out)
    }

    /// Every accessible map as a region for the PTX interpreter.
    pub fn regions(&self) -> impl Iterator<Item = Region> + '_ {
        self.mappings.iter().filter(|(_, m)| m.accessible).map(|(&start, m)| Region { start, len: m.len, host: m.host })
    }
}
