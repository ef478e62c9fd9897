//! Primary contexts: one per device, reference-counted, the context the
//! CUDA runtime uses. Its handle is stable for the life of the process, so
//! a reset followed by a retain gives cudart the same context back.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{LazyLock, Mutex};

use super::context::{self, Context, CONTEXTS};
use crate::cuda::types::*;
use crate::runtime;

struct Primary {
    handle: u64,
    refcount: u32,
    flags: u32,
}

static PRIMARY: LazyLock<Mutex<HashMap<CUdevice, Primary>>> = LazyLock::new(|| Mutex::new(HashMap::new()));

/// The device's primary context handle, created (inactive) on first use.
pub fn handle(dev: CUdevice) -> CuResult<u64> {
    runtime::get()?.device(dev)?;
    let mut m = PRIMARY.lock().unwrap_or_else(|e| e.into_inner());
    let p = m.entry(dev).or_insert_with(|| {
        let (handle, _) = CONTEXTS.insert(Context::new(dev, true, 0));
        Primary { handle, refcount: 0, flags: 0 }
    });
    // Using a primary context makes it live again after a reset.
    if let Some(c) = CONTEXTS.get(p.handle) {
        c.live.store(true, Ordering::Release);
    }
    Ok(p.handle)
}

pub(crate) unsafe fn retain(pctx: *mut CUcontext, dev: CUdevice) -> CuResult<()> {
    let pctx = pctx.as_mut().ok_or(CuError::INVALID_VALUE)?;
    let h = handle(dev)?;
    let mut m = PRIMARY.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = m.get_mut(&dev) {
        p.refcount += 1;
    }
    *pctx = context::from_handle(h);
    Ok(())
}

pub(crate) unsafe fn release_v2(dev: CUdevice) -> CuResult<()> {
    runtime::get()?.device(dev)?;
    let mut m = PRIMARY.lock().unwrap_or_else(|e| e.into_inner());
    let p = m.get_mut(&dev).filter(|p| p.refcount > 0).ok_or(CuError::INVALID_CONTEXT)?;
    p.refcount -= 1;
    Ok(())
}

pub(crate) unsafe fn reset_v2(dev: CUdevice) -> CuResult<()> {
    runtime::get()?.device(dev)?;
    let h = {
        let mut m = PRIMARY.lock().unwrap_or_else(|e| e.into_inner());
        match m.get_mut(&dev) {
            Some(p) => {
                p.refcount = 0;
                p.flags = 0;
                p.handle
            }
            None => return Ok(()),
        }
    };
    if let Some(c) = CONTEXTS.get(h) {
        context::teardown(h, &c);
        c.live.store(false, Ordering::Release);
        c.flags.store(0, Ordering::Relaxed);
    }
    Ok(())
}

pub(crate) unsafe fn get_state(dev: CUdevice, flags: *mut u32, active: *mut i32) -> CuResult<()> {
    runtime::get()?.device(dev)?;
    let (flags, active) = (flags.as_mut().ok_or(CuError::INVALID_VALUE)?, active.as_mut().ok_or(CuError::INVALID_VALUE)?);
    let m = PRIMARY.lock().unwrap_or_else(|e| e.into_inner());
    match m.get(&dev) {
        Some(p) => {
            *flags = p.flags;
            *active = (p.refcount > 0) as i32;
        }
        None => {
            *flags = 0;
            *active = 0;
        }
    }
    Ok(())
}

pub(crate) unsafe fn set_flags_v2(dev: CUdevice, flags: u32) -> CuResult<()> {
    let h = handle(dev)?;
    let mut m = PRIMARY.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = m.get_mut(&dev) {
        p.flags = flags;
    }
    if let Some(c) = CONTEXTS.get(h) {
        c.flags.store(flags, Ordering::Relaxed);
    }
    Ok(())
}

// The pre-CUDA-11 names, which cudart still calls at exit.
pub(crate) unsafe fn release(dev: CUdevice) -> CuResult<()> {
    release_v2(dev)
}
pub(crate) unsafe fn reset(dev: CUdevice) -> CuResult<()> {
    reset_v2(dev)
}
pub(crate) unsafe fn set_flags(dev: CUdevice, flags: u32) -> CuResult<()> {
    set_flags_v2(dev, flags)
}
