//! Memory pools of the stream-ordered allocator (cuMemPool*, cuMemAllocAsync). A pool here is
//! bookkeeping over ordinary device allocations: each stream-ordered allocation is made when
//! its call is made (so it is ready for the stream's later work, as CUDA requires) and freed
//! in the session's order, which is at least the stream's. The pool tracks what it has out,
//! for the attributes programs read, and each device's default and current pool.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rgpu_cuda_types::*;

use super::objects;

pub struct MemPool {
    pub device: CUdevice,
    pub state: Mutex<PoolState>,
}

#[derive(Default)]
pub struct PoolState {
    pub release_threshold: u64,
    /// REUSE_FOLLOW_EVENT_DEPENDENCIES, REUSE_ALLOW_OPPORTUNISTIC, REUSE_ALLOW_INTERNAL_DEPENDENCIES.
    pub reuse: [bool; 3],
    /// Bytes of the pool's allocations not yet freed, and their peak.
    pub used: u64,
    pub used_high: u64,
}

impl MemPool {
    pub fn new(device: CUdevice) -> MemPool {
        // A new pool reuses memory as CUDA's do by default.
        MemPool { device, state: Mutex::new(PoolState { reuse: [true; 3], ..PoolState::default() }) }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn took(&self, size: u64) {
        let mut s = self.state();
        s.used += size;
        s.used_high = s.used_high.max(s.used);
    }

    pub fn gave_back(&self, size: u64) {
        let mut s = self.state();
        s.used = s.used.saturating_sub(size);
    }

    pub fn with<R>(&self, f: impl FnOnce(&mut PoolState) -> R) -> R {
        f(&mut self.state())
    }
}

/// Each device's default pool (made on first use) and current pool.
#[derive(Default)]
pub struct DevicePools {
    default: Mutex<HashMap<CUdevice, u64>>,
    current: Mutex<HashMap<CUdevice, u64>>,
}

impl DevicePools {
    pub fn default_pool(&self, dev: CUdevice) -> u64 {
        *self.default.lock().unwrap_or_else(|e| e.into_inner()).entry(dev).or_insert_with(|| objects().pools.insert(MemPool::new(dev)).0)
    }

    /// The pool cuMemAllocAsync takes from on `dev`: the one set by cuDeviceSetMemPool, else
    /// the default.
    pub fn current(&self, dev: CUdevice) -> u64 {
        let set = self.current.lock().unwrap_or_else(|e| e.into_inner()).get(&dev).copied();
        match set.filter(|&h| objects().pools.get(h).is_some()) {
            Some(h) => h,
            None => self.default_pool(dev),
        }
    }

    pub fn set_current(&self, dev: CUdevice, pool: u64) {
        self.current.lock().unwrap_or_else(|e| e.into_inner()).insert(dev, pool);
    }

    pub fn is_default(&self, pool: u64) -> bool {
        self.default.lock().unwrap_or_else(|e| e.into_inner()).values().any(|&h| h == pool)
    }
}

pub fn get(pool: CUmemoryPool) -> CuResult<(u64, Arc<MemPool>)> {
    let h = pool as usize as u64;
    Ok((h, objects().pools.get(h).ok_or(CuError::INVALID_VALUE)?))
}
