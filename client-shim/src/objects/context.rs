//! Contexts: the per-thread current-context stack, user-created contexts and the primary
//! contexts (one per device, reference-counted, with a handle stable for the life of the
//! process, so a reset followed by a retain gives cudart the same context back).
//!
//! A context lives only in the shim; the server knows devices, not contexts. What a context
//! owns records its handle (see the tree in `objects`).

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use rgpu_cuda_types::*;

use super::objects;
use crate::runtime;

pub struct Context {
    pub device: CUdevice,
    pub primary: bool,
    pub flags: AtomicU32,
    /// False once destroyed (user contexts) or reset (primary contexts).
    pub live: AtomicBool,
    pub limits: Mutex<HashMap<u32, usize>>,
    pub cache_config: AtomicU32,
}

impl Context {
    pub fn new(device: CUdevice, primary: bool, flags: u32) -> Self {
        Context {
            device,
            primary,
            flags: AtomicU32::new(flags),
            live: AtomicBool::new(true),
            limits: Mutex::new(default_limits()),
            cache_config: AtomicU32::new(0),
        }
    }
}

fn default_limits() -> HashMap<u32, usize> {
    // The defaults a CUDA 12/13 driver reports for a fresh context.
    HashMap::from([
        (CUlimit::CU_LIMIT_STACK_SIZE.0, 1024),
        (CUlimit::CU_LIMIT_PRINTF_FIFO_SIZE.0, 1 << 20),
        (CUlimit::CU_LIMIT_MALLOC_HEAP_SIZE.0, 8 << 20),
        (CUlimit::CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH.0, 2),
        (CUlimit::CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT.0, 2048),
        (CUlimit::CU_LIMIT_MAX_L2_FETCH_GRANULARITY.0, 128),
        (CUlimit::CU_LIMIT_PERSISTING_L2_CACHE_SIZE.0, 0),
    ])
}

thread_local! {
    static STACK: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

pub fn to_handle(ctx: CUcontext) -> u64 {
    ctx as usize as u64
}

pub fn from_handle(h: u64) -> CUcontext {
    h as usize as CUcontext
}

/// The calling thread's current context, if any and still alive.
pub fn current() -> CuResult<(u64, Arc<Context>)> {
    let h = top().ok_or(CuError::INVALID_CONTEXT)?;
    let c = objects().contexts.get(h).ok_or(CuError::INVALID_CONTEXT)?;
    if !c.live.load(Ordering::Acquire) {
        return Err(CuError::CONTEXT_IS_DESTROYED);
    }
    Ok((h, c))
}

/// The device of the current context.
pub fn current_device() -> CuResult<CUdevice> {
    Ok(current()?.1.device)
}

/// Looks up a context handle; null means the current context.
pub fn resolve(ctx: CUcontext) -> CuResult<(u64, Arc<Context>)> {
    if ctx.is_null() {
        return current();
    }
    let h = to_handle(ctx);
    let c = objects().contexts.get(h).ok_or(CuError::INVALID_CONTEXT)?;
    Ok((h, c))
}

// ---- the calling thread's stack ------------------------------------------------------------
// At thread or process exit the stack may already be destroyed: then no context is current,
// and changes to it are dropped.

/// The top of this thread's stack.
pub fn top() -> Option<u64> {
    STACK.try_with(|s| s.borrow().last().copied()).ok().flatten()
}

/// Replaces the top of the stack (`None` pops it), as cuCtxSetCurrent does.
pub fn set_top(h: Option<u64>) {
    let _ = STACK.try_with(|s| {
        let mut s = s.borrow_mut();
        match (s.last_mut(), h) {
            (Some(top), Some(h)) => *top = h,
            (Some(_), None) => {
                s.pop();
            }
            (None, Some(h)) => s.push(h),
            (None, None) => {}
        }
    });
}

pub fn push(h: u64) -> CuResult<()> {
    STACK.try_with(|s| s.borrow_mut().push(h)).map_err(|_| CuError::DEINITIALIZED)
}

pub fn pop() -> Option<u64> {
    STACK.try_with(|s| s.borrow_mut().pop()).ok().flatten()
}

/// Takes a destroyed context off this thread's stack.
pub fn unstack(h: u64) {
    let _ = STACK.try_with(|s| s.borrow_mut().retain(|&x| x != h));
}

// ---- primary contexts ----------------------------------------------------------------------

pub struct Primary {
    pub handle: u64,
    pub refcount: u32,
    pub flags: u32,
}

#[derive(Default)]
pub struct Primaries {
    map: Mutex<HashMap<CUdevice, Primary>>,
}

impl Primaries {
    /// The device's primary context handle, created (inactive) on first use. Using a primary
    /// context makes it live again after a reset.
    pub fn handle(&self, dev: CUdevice) -> CuResult<u64> {
        runtime::get()?.device(dev)?;
        let mut m = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let p = m.entry(dev).or_insert_with(|| {
            let (handle, _) = objects().contexts.insert(Context::new(dev, true, 0));
            Primary { handle, refcount: 0, flags: 0 }
        });
        if let Some(c) = objects().contexts.get(p.handle) {
            c.live.store(true, Ordering::Release);
        }
        Ok(p.handle)
    }

    /// Runs `f` on the device's primary context record, if it was ever created.
    pub fn with<R>(&self, dev: CUdevice, f: impl FnOnce(&mut Primary) -> R) -> Option<R> {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).get_mut(&dev).map(f)
    }
}
