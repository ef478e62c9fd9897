//! Graph memory: what `cuMemAllocAsync` on a capturing stream allocates.
//!
//! In CUDA a graph's allocation has one address for the graph's whole life, backed while a
//! launch has it allocated. rgpu allocates it when it is captured and keeps it backed until no
//! graph, clone or exec refers to it any more; the allocation and free nodes do nothing when
//! the graph runs. What CUDA checks still holds: an allocation the graph does not free itself
//! belongs to the program after a launch, which frees it (`cuMemFree`/`cuMemFreeAsync`, which
//! here only hand it back) before the next launch, or that launch fails; and since the
//! memory is shared by everything made from one capture, only one exec may hold it at a time.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, Weak};

use rgpu_cuda_types::*;

use super::objects;

pub struct GraphMem {
    pub ptr: u64,
    pub size: u64,
    pub device: CUdevice,
    /// Execs holding it (at most one).
    execs: AtomicUsize,
    /// A launch left it allocated and the program has not freed it yet.
    outstanding: AtomicBool,
}

static LIVE: LazyLock<Mutex<HashMap<u64, Weak<GraphMem>>>> = LazyLock::new(Mutex::default);

fn live() -> std::sync::MutexGuard<'static, HashMap<u64, Weak<GraphMem>>> {
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Takes over the allocation at `ptr` (recorded with no context, so `cuMemFree` does not free
/// it and a context's teardown leaves it alone).
pub fn adopt(ptr: u64, size: u64, device: CUdevice) -> Arc<GraphMem> {
    let m = Arc::new(GraphMem { ptr, size, device, execs: AtomicUsize::new(0), outstanding: AtomicBool::new(false) });
    live().insert(ptr, Arc::downgrade(&m));
    m
}

/// The graph allocation starting at `ptr`, if there is one.
pub fn find(ptr: u64) -> Option<Arc<GraphMem>> {
    live().get(&ptr).and_then(Weak::upgrade)
}

/// The program frees a graph allocation a launch left allocated. Freeing one no launch left
/// allocated is CUDA_ERROR_INVALID_VALUE.
pub fn free(m: &GraphMem) -> CuResult<()> {
    if m.outstanding.swap(false, Ordering::AcqRel) {
        Ok(())
    } else {
        Err(CuError::INVALID_VALUE)
    }
}

impl GraphMem {
    /// An exec takes the allocation; a second one at the same time is refused.
    pub fn attach(&self) -> CuResult<()> {
        if self.execs.compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire).is_err() {
            tracing::warn!("a graph with memory nodes instantiated twice at once is not supported by rgpu");
            return Err(CuError::NOT_SUPPORTED);
        }
        Ok(())
    }

    pub fn detach(&self) {
        self.execs.store(0, Ordering::Release);
    }

    /// Whether a launch left it with the program, unfreed.
    pub fn is_outstanding(&self) -> bool {
        self.outstanding.load(Ordering::Acquire)
    }

    /// A launch that does not free it hands it to the program.
    pub fn hand_out(&self) {
        self.outstanding.store(true, Ordering::Release);
    }
}

impl Drop for GraphMem {
    fn drop(&mut self) {
        let mut l = live();
        if l.get(&self.ptr).is_some_and(|w| w.strong_count() == 0) {
            l.remove(&self.ptr);
        }
        drop(l);
        if self.is_outstanding() {
            // A launch left it with the program, which CUDA lets keep it past the graph: it
            // becomes an ordinary allocation (of the current context, if that is on its
            // device; else it stays until the session ends). Never freed under the program.
            if let Ok((ctx, c)) = super::context::current() {
                if c.device == self.device {
                    if let Some(a) = objects().memory.allocs.lock().unwrap_or_else(|e| e.into_inner()).get_mut(&self.ptr) {
                        a.ctx = ctx;
                    }
                }
            }
            return;
        }
        let a = objects().memory.allocs.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.ptr);
        if let (Some(a), Ok(rt)) = (a, crate::runtime::get()) {
            if let Err(e) = super::memory::release(rt, self.ptr, &a) {
                tracing::debug!("freeing graph memory: {e}");
            }
        }
    }
}
