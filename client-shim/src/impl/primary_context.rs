//! Primary contexts (cuDevicePrimaryCtx*): one per device, reference-counted, the context the
//! CUDA runtime uses (records in `objects::context::Primaries`).

use std::sync::atomic::Ordering;

use crate::cuda::types::*;
use crate::objects::context as ctx;
use crate::objects::objects;
use crate::runtime;

pub(crate) unsafe fn retain(pctx: &mut CUcontext, dev: CUdevice) -> CuResult<()> {
    let o = objects();
    let h = o.primaries.handle(dev)?;
    o.primaries.with(dev, |p| p.refcount += 1);
    *pctx = ctx::from_handle(h);
    Ok(())
}

pub(crate) unsafe fn release_v2(dev: CUdevice) -> CuResult<()> {
    runtime::get()?.device(dev)?;
    let released = objects().primaries.with(dev, |p| {
        if p.refcount == 0 {
            return false;
        }
        p.refcount -= 1;
        true
    });
    if released == Some(true) {
        Ok(())
    } else {
        Err(CuError::INVALID_CONTEXT)
    }
}

pub(crate) unsafe fn reset_v2(dev: CUdevice) -> CuResult<()> {
    runtime::get()?.device(dev)?;
    let o = objects();
    let Some(h) = o.primaries.with(dev, |p| {
        p.refcount = 0;
        p.flags = 0;
        p.handle
    }) else {
        return Ok(());
    };
    if let Some(c) = o.contexts.get(h) {
        o.teardown_context(h);
        c.live.store(false, Ordering::Release);
        c.flags.store(0, Ordering::Relaxed);
        super::context::reset_remote(dev);
    }
    Ok(())
}

pub(crate) unsafe fn get_state(dev: CUdevice, flags: &mut u32, active: &mut i32) -> CuResult<()> {
    runtime::get()?.device(dev)?;
    let (f, a) = objects().primaries.with(dev, |p| (p.flags, (p.refcount > 0) as i32)).unwrap_or((0, 0));
    *flags = f;
    *active = a;
    Ok(())
}

pub(crate) unsafe fn set_flags_v2(dev: CUdevice, flags: u32) -> CuResult<()> {
    let o = objects();
    let h = o.primaries.handle(dev)?;
    o.primaries.with(dev, |p| p.flags = flags);
    if let Some(c) = o.contexts.get(h) {
        c.flags.store(flags, Ordering::Relaxed);
    }
    Ok(())
}
