//! The shim's tables of device allocations and page-locked host memory. They route generic
//! copies (unified addresses), answer pointer queries, and let out-of-range copies be refused
//! before anything is sent; the server checks every range again against its own allocations.

use std::collections::BTreeMap;
use std::sync::Mutex;

use rgpu_cuda_types::*;

use crate::runtime::{cu_err, Runtime};

#[derive(Clone, Copy, Debug)]
pub struct Alloc {
    pub size: u64,
    pub device: i32,
    /// The context that allocated it (0 for module globals, which belong to their module).
    pub ctx: u64,
    /// The memory pool of a stream-ordered allocation (0 for others).
    pub pool: u64,
    /// A map of a physical allocation (cuMemMap, `objects::vmm`), not an allocation itself.
    pub mapped: bool,
    /// Another process's allocation this one opened (cuIpcOpenMemHandle): how many opens are
    /// not closed yet (0 for the process's own memory). Closed by cuIpcCloseMemHandle, never
    /// freed by cuMemFree.
    pub ipc: u32,
}

#[derive(Clone, Copy, Debug)]
pub struct HostAlloc {
    pub size: usize,
    pub flags: u32,
    /// Allocated by us (cuMemHostAlloc) rather than registered by the program.
    pub owned: bool,
}

#[derive(Default)]
pub struct Memory {
    /// Live device allocations by (client-visible) start address.
    pub allocs: Mutex<BTreeMap<u64, Alloc>>,
    /// Page-locked host allocations (cuMemHostAlloc, cuMemHostRegister), by start address.
    pub host: Mutex<BTreeMap<usize, HostAlloc>>,
}

impl Memory {
    pub fn record(&self, ptr: u64, a: Alloc) {
        self.allocs.lock().unwrap_or_else(|e| e.into_inner()).insert(ptr, a);
    }

    /// The live allocation containing `ptr`, as (start, info).
    pub fn find_alloc(&self, ptr: u64) -> Option<(u64, Alloc)> {
        let m = self.allocs.lock().unwrap_or_else(|e| e.into_inner());
        let (&start, a) = m.range(..=ptr).next_back()?;
        (ptr < start + a.size.max(1)).then_some((start, *a))
    }

    /// Checks that [ptr, ptr+len) lies in one allocation, or in maps of one device laid end to
    /// end (one reserved range, as PyTorch's expandable segments grow); returns its device.
    pub fn check_range(&self, ptr: u64, len: u64) -> CuResult<i32> {
        let m = self.allocs.lock().unwrap_or_else(|e| e.into_inner());
        let (&start, a) = m.range(..=ptr).next_back().ok_or(CuError::INVALID_VALUE)?;
        if ptr >= start + a.size.max(1) {
            return Err(CuError::INVALID_VALUE);
        }
        let end = ptr.checked_add(len).ok_or(CuError::INVALID_VALUE)?;
        let mut reach = start + a.size;
        while end > reach {
            match m.get(&reach) {
                Some(next) if a.mapped && next.mapped && next.device == a.device => reach += next.size,
                _ => return Err(CuError::INVALID_VALUE),
            }
        }
        Ok(a.device)
    }

    pub fn find_host(&self, ptr: usize) -> Option<(usize, HostAlloc)> {
        let m = self.host.lock().unwrap_or_else(|e| e.into_inner());
        let (&start, a) = m.range(..=ptr).next_back()?;
        (ptr < start + a.size.max(1)).then_some((start, *a))
    }

    /// Frees every allocation a context made (context destroy, primary reset).
    pub fn free_context(&self, rt: &Runtime, ctx: u64) {
        let victims: Vec<(u64, Alloc)> = {
            let mut m = self.allocs.lock().unwrap_or_else(|e| e.into_inner());
            let keys: Vec<u64> = m.iter().filter(|(_, a)| a.ctx == ctx).map(|(k, _)| *k).collect();
            keys.into_iter().filter_map(|k| m.remove(&k).map(|a| (k, a))).collect()
        };
        for (ptr, a) in victims {
            let _ = release(rt, ptr, &a);
        }
    }
}

/// Frees an allocation (taken out of the table) on its server, and gives it back to its pool.
/// cuMemFree orders after earlier work on the device; the server executes in order, so the
/// free is sent without waiting.
pub fn release(rt: &Runtime, ptr: u64, a: &Alloc) -> CuResult<()> {
    if a.ipc > 0 {
        // Opened from another process: each open is closed (the server counts them too).
        let conn = rt.conn(a.device)?;
        for _ in 0..a.ipc {
            conn.post(|r| r.init_ipc_close().set_ptr(Runtime::to_remote(ptr)), &[]).map_err(cu_err)?;
        }
        return Ok(());
    }
    if let Some(p) = (a.pool != 0).then(|| super::objects().pools.get(a.pool)).flatten() {
        p.gave_back(a.size);
    }
    rt.conn(a.device)?.post(|r| r.init_mem_free().set_ptr(Runtime::to_remote(ptr)), &[]).map_err(cu_err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(size: u64, device: i32, mapped: bool) -> Alloc {
        Alloc { size, device, ctx: 0, pool: 0, mapped, ipc: 0 }
    }

    /// A range may run on across maps laid end to end (one reserved range), never across two
    /// ordinary allocations that happen to be adjacent, nor maps of two devices.
    #[test]
    fn ranges_span_adjacent_maps_only() {
        let m = Memory::default();
        m.record(0x1000, a(0x1000, 0, false));
        m.record(0x2000, a(0x1000, 0, false));
        assert_eq!(m.check_range(0x1800, 0x800), Ok(0));
        assert_eq!(m.check_range(0x1800, 0x801), Err(CuError::INVALID_VALUE), "two allocations");
        m.record(0x10000, a(0x1000, 0, true));
        m.record(0x11000, a(0x1000, 0, true));
        m.record(0x12000, a(0x1000, 1, true));
        assert_eq!(m.check_range(0x10800, 0x1000), Ok(0), "two maps");
        assert_eq!(m.check_range(0x10000, 0x2000), Ok(0));
        assert_eq!(m.check_range(0x10000, 0x2001), Err(CuError::INVALID_VALUE), "into another device's map");
        assert_eq!(m.check_range(0x12800, 0x801), Err(CuError::INVALID_VALUE), "past the last map");
        assert_eq!(m.check_range(0x13000, 0), Err(CuError::INVALID_VALUE), "outside every map");
    }
}
