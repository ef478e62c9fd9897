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

    /// Checks that [ptr, ptr+len) lies in one allocation; returns its device.
    pub fn check_range(&self, ptr: u64, len: u64) -> CuResult<i32> {
        let (start, a) = self.find_alloc(ptr).ok_or(CuError::INVALID_VALUE)?;
        let end = ptr.checked_add(len).ok_or(CuError::INVALID_VALUE)?;
        if end > start + a.size {
            return Err(CuError::INVALID_VALUE);
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
    if let Some(p) = (a.pool != 0).then(|| super::objects().pools.get(a.pool)).flatten() {
        p.gave_back(a.size);
    }
    rt.conn(a.device)?.post(|r| r.init_mem_free().set_ptr(Runtime::to_remote(ptr)), &[]).map_err(cu_err)
}
