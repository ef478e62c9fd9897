//! Contexts (cuCtx*): creation and destruction, the current-context stack, and the
//! context-scoped state (limits, cache config) a program can query. The objects and the stack
//! are in `objects::context`; destroying a context tears down what it owns in one walk
//! (`Objects::teardown_context`).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::client::connection::Sink;
use crate::cuda::types::*;
use crate::objects::context::{self as ctx, Context};
use crate::objects::objects;
use crate::runtime::{self, cu_err};

pub(crate) unsafe fn create_v2(pctx: &mut CUcontext, flags: u32, dev: CUdevice) -> CuResult<()> {
    runtime::get()?.device(dev)?;
    let (h, _) = objects().contexts.insert(Context::new(dev, false, flags));
    ctx::push(h)?;
    *pctx = ctx::from_handle(h);
    Ok(())
}

pub(crate) unsafe fn create_v3(
    pctx: &mut CUcontext,
    params: *mut CUexecAffinityParam,
    num_params: i32,
    flags: u32,
    dev: CUdevice,
) -> CuResult<()> {
    if !params.is_null() && num_params > 0 {
        // Execution affinity (SM partitioning) is not offered by rgpu yet.
        return Err(CuError::UNSUPPORTED_EXEC_AFFINITY);
    }
    create_v2(pctx, flags, dev)
}

pub(crate) unsafe fn create_v4(pctx: &mut CUcontext, params: Option<&mut CUctxCreateParams>, flags: u32, dev: CUdevice) -> CuResult<()> {
    if let Some(p) = params {
        if p.numExecAffinityParams > 0 || !p.cigParams.is_null() {
            return Err(CuError::NOT_SUPPORTED);
        }
    }
    create_v2(pctx, flags, dev)
}

pub(crate) unsafe fn destroy_v2(c: CUcontext) -> CuResult<()> {
    let h = ctx::to_handle(c);
    let o = objects();
    let context = o.contexts.get(h).ok_or(CuError::INVALID_CONTEXT)?;
    if context.primary {
        return Err(CuError::INVALID_CONTEXT);
    }
    let dev = context.device;
    o.teardown_context(h);
    o.contexts.remove(h);
    // Destroying a context that is current on this thread pops it.
    ctx::unstack(h);
    reset_remote(dev);
    Ok(())
}

/// Tells `dev`'s server that a context there was destroyed or reset, after
/// its objects were released: a session holding nothing more starts afresh,
/// as a new context does after a device assert. What it answers is not the
/// caller's: errors of the old context's work go with the context.
pub(crate) fn reset_remote(dev: CUdevice) {
    let Ok(rt) = runtime::get() else { return };
    let (Ok(d), Ok(conn)) = (rt.device(dev), rt.conn(dev)) else { return };
    let remote = d.remote.ordinal;
    if let Err(e) = conn.call(|r| r.init_ctx_reset().set_device(remote), &[], Sink::None, |_| Ok(())) {
        tracing::debug!(dev, "context reset on the server: {e}");
    }
}

pub(crate) unsafe fn get_current(pctx: &mut CUcontext) -> CuResult<()> {
    *pctx = ctx::top().map(ctx::from_handle).unwrap_or(std::ptr::null_mut());
    Ok(())
}

pub(crate) unsafe fn set_current(c: CUcontext) -> CuResult<()> {
    if c.is_null() {
        ctx::set_top(None);
        return Ok(());
    }
    let h = ctx::to_handle(c);
    objects().contexts.get(h).ok_or(CuError::INVALID_CONTEXT)?;
    ctx::set_top(Some(h));
    Ok(())
}

pub(crate) unsafe fn push_current_v2(c: CUcontext) -> CuResult<()> {
    let h = ctx::to_handle(c);
    objects().contexts.get(h).ok_or(CuError::INVALID_CONTEXT)?;
    ctx::push(h)
}

pub(crate) unsafe fn pop_current_v2(pctx: Option<&mut CUcontext>) -> CuResult<()> {
    let h = ctx::pop().ok_or(CuError::INVALID_CONTEXT)?;
    if let Some(p) = pctx {
        *p = ctx::from_handle(h);
    }
    Ok(())
}

pub(crate) unsafe fn get_device(dev: &mut CUdevice) -> CuResult<()> {
    *dev = ctx::current_device()?;
    Ok(())
}

pub(crate) unsafe fn get_device_v2(dev: &mut CUdevice, c: CUcontext) -> CuResult<()> {
    *dev = ctx::resolve(c)?.1.device;
    Ok(())
}

pub(crate) unsafe fn synchronize_v2(c: CUcontext) -> CuResult<()> {
    sync_device(ctx::resolve(c)?.1.device)
}

pub(crate) unsafe fn synchronize() -> CuResult<()> {
    sync_device(ctx::current_device()?)
}

/// Waits for all work of `dev`'s server session; collects deferred errors.
fn sync_device(dev: CUdevice) -> CuResult<()> {
    crate::objects::capture::check_unsafe_call()?;
    let rt = runtime::get()?;
    let remote = rt.device(dev)?.remote.ordinal;
    rt.conn(dev)?
        .call(|r| r.init_ctx_synchronize().set_device(remote), &[], Sink::None, |_| Ok(()))
        .map_err(cu_err)?;
    crate::objects::managed::sync_point(rt)
}

pub(crate) unsafe fn get_api_version(c: CUcontext, version: &mut u32) -> CuResult<()> {
    ctx::resolve(c)?;
    // The context API version of every CUDA release since 4.0.
    *version = 3020;
    Ok(())
}

pub(crate) unsafe fn get_flags(flags: &mut u32) -> CuResult<()> {
    *flags = ctx::current()?.1.flags.load(Ordering::Relaxed);
    Ok(())
}

pub(crate) unsafe fn set_flags(flags: u32) -> CuResult<()> {
    ctx::current()?.1.flags.store(flags, Ordering::Relaxed);
    Ok(())
}

pub(crate) unsafe fn get_limit(value: &mut usize, limit: CUlimit) -> CuResult<()> {
    let (_, c) = ctx::current()?;
    let limits = c.limits.lock().unwrap_or_else(|e| e.into_inner());
    *value = *limits.get(&limit.0).ok_or(CuError::UNSUPPORTED_LIMIT)?;
    Ok(())
}

pub(crate) unsafe fn set_limit(limit: CUlimit, value: usize) -> CuResult<()> {
    let (_, c) = ctx::current()?;
    let mut limits = c.limits.lock().unwrap_or_else(|e| e.into_inner());
    let slot = limits.get_mut(&limit.0).ok_or(CuError::UNSUPPORTED_LIMIT)?;
    *slot = value;
    Ok(())
}

pub(crate) unsafe fn get_cache_config(config: &mut CUfunc_cache) -> CuResult<()> {
    *config = CUfunc_cache(ctx::current()?.1.cache_config.load(Ordering::Relaxed));
    Ok(())
}

pub(crate) unsafe fn set_cache_config(config: CUfunc_cache) -> CuResult<()> {
    // A preference only; the real driver may ignore it too.
    let config = super::function::checked_cache_config(config)?;
    ctx::current()?.1.cache_config.store(config as _, Ordering::Relaxed);
    Ok(())
}

pub(crate) unsafe fn get_stream_priority_range(least: Option<&mut i32>, greatest: Option<&mut i32>) -> CuResult<()> {
    ctx::current()?;
    // What an sm_90 device reports.
    if let Some(l) = least {
        *l = 0;
    }
    if let Some(g) = greatest {
        *g = -5;
    }
    Ok(())
}

pub(crate) unsafe fn get_id(c: CUcontext, id: &mut u64) -> CuResult<()> {
    let (h, _) = ctx::resolve(c)?;
    *id = h & ((1 << 48) - 1);
    Ok(())
}

// ---- peer access and preferences rgpu answers without a server -------------------------

/// The context a peer-access call names: a real one (NULL is no context here).
fn peer(c: CUcontext) -> CuResult<Arc<Context>> {
    if c.is_null() {
        return Err(CuError::INVALID_CONTEXT);
    }
    Ok(ctx::resolve(c)?.1)
}

/// cuCtxEnablePeerAccess: no device can access another's memory in rgpu
/// (`cuDeviceCanAccessPeer` answers 0: it would need device memory mapped across
/// servers), so once the arguments are checked the answer is the one a driver gives two
/// devices without peer access, which programs test for; copies between them still work.
pub(crate) unsafe fn enable_peer_access(peer_ctx: CUcontext, flags: u32) -> CuResult<()> {
    ctx::current()?;
    peer(peer_ctx)?;
    if flags != 0 {
        return Err(CuError::INVALID_VALUE);
    }
    Err(CuError::PEER_ACCESS_UNSUPPORTED)
}

/// cuCtxDisablePeerAccess: never enabled (see [`enable_peer_access`]).
pub(crate) unsafe fn disable_peer_access(peer_ctx: CUcontext) -> CuResult<()> {
    ctx::current()?;
    peer(peer_ctx)?;
    Err(CuError::PEER_ACCESS_NOT_ENABLED)
}

/// cuCtxGetSharedMemConfig: four-byte banks, what devices since Maxwell have and cannot
/// change.
pub(crate) unsafe fn get_shared_mem_config(config: &mut CUsharedconfig) -> CuResult<()> {
    ctx::current()?;
    *config = CUsharedconfig::CU_SHARED_MEM_CONFIG_FOUR_BYTE_BANK_SIZE;
    Ok(())
}

/// cuCtxSetSharedMemConfig: a known bank size is accepted and changes nothing, as on any
/// device without configurable banks (the driver says so); another value is refused.
pub(crate) unsafe fn set_shared_mem_config(config: CUsharedconfig) -> CuResult<()> {
    ctx::current()?;
    super::function::checked_shared_mem_config(config).map(|_| ())
}

/// cuCtxResetPersistingL2Cache: rgpu keeps no L2 lines persisting (an access policy window
/// is taken as a hint and not applied), so there is nothing to reset.
pub(crate) unsafe fn reset_persisting_l2_cache() -> CuResult<()> {
    ctx::current()?;
    Ok(())
}
