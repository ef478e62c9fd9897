//! Contexts: the per-thread current-context stack, user-created contexts,
//! and the context-scoped state (limits, cache config) a program can query.
//!
//! A context lives only in the shim; the server knows devices, not
//! contexts. Everything a context owns (allocations, streams, events,
//! modules) is recorded with its handle, so destroying or resetting it frees
//! exactly that on the server.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

use crate::cuda::types::*;
use crate::handles::{tag, Table};
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

pub static CONTEXTS: LazyLock<Table<Context>> = LazyLock::new(|| Table::new(tag::CONTEXT));

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
    let c = CONTEXTS.get(h).ok_or(CuError::INVALID_CONTEXT)?;
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
    let c = CONTEXTS.get(h).ok_or(CuError::INVALID_CONTEXT)?;
    Ok((h, c))
}

/// The top of this thread's stack. At thread or process exit the stack may
/// already be destroyed: then no context is current.
fn top() -> Option<u64> {
    STACK.try_with(|s| s.borrow().last().copied()).ok().flatten()
}

fn set_top(h: Option<u64>) {
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

pub(crate) unsafe fn create_v2(pctx: *mut CUcontext, flags: u32, dev: CUdevice) -> CuResult<()> {
    let rt = runtime::get()?;
    rt.device(dev)?;
    let pctx = pctx.as_mut().ok_or(CuError::INVALID_VALUE)?;
    let (h, _) = CONTEXTS.insert(Context::new(dev, false, flags));
    let _ = STACK.try_with(|s| s.borrow_mut().push(h));
    *pctx = from_handle(h);
    Ok(())
}

pub(crate) unsafe fn create_v3(
    pctx: *mut CUcontext,
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

pub(crate) unsafe fn create_v4(pctx: *mut CUcontext, params: *mut CUctxCreateParams, flags: u32, dev: CUdevice) -> CuResult<()> {
    if let Some(p) = params.as_ref() {
        if p.numExecAffinityParams > 0 || !p.cigParams.is_null() {
            return Err(CuError::NOT_SUPPORTED);
        }
    }
    create_v2(pctx, flags, dev)
}

pub(crate) unsafe fn destroy_v2(ctx: CUcontext) -> CuResult<()> {
    let h = to_handle(ctx);
    let c = CONTEXTS.get(h).ok_or(CuError::INVALID_CONTEXT)?;
    if c.primary {
        return Err(CuError::INVALID_CONTEXT);
    }
    teardown(h, &c);
    CONTEXTS.remove(h);
    // Destroying a context that is current on this thread pops it.
    let _ = STACK.try_with(|s| s.borrow_mut().retain(|&x| x != h));
    Ok(())
}

/// Frees everything the context owns, on the server and here, and runs the
/// destructors cudart registered on it.
pub fn teardown(h: u64, c: &Context) {
    crate::dark_api::cls::run_destructors(h);
    if let Ok(rt) = runtime::get() {
        super::module::unload_context(rt, h);
        super::stream::destroy_context(rt, h);
        super::event::destroy_context(rt, h);
        super::memory::free_context(rt, h, c.device);
    }
}

pub(crate) unsafe fn get_current(pctx: *mut CUcontext) -> CuResult<()> {
    let pctx = pctx.as_mut().ok_or(CuError::INVALID_VALUE)?;
    *pctx = top().map(from_handle).unwrap_or(std::ptr::null_mut());
    Ok(())
}

pub(crate) unsafe fn set_current(ctx: CUcontext) -> CuResult<()> {
    if ctx.is_null() {
        set_top(None);
        return Ok(());
    }
    let h = to_handle(ctx);
    CONTEXTS.get(h).ok_or(CuError::INVALID_CONTEXT)?;
    set_top(Some(h));
    Ok(())
}

pub(crate) unsafe fn push_current_v2(ctx: CUcontext) -> CuResult<()> {
    let h = to_handle(ctx);
    CONTEXTS.get(h).ok_or(CuError::INVALID_CONTEXT)?;
    STACK.try_with(|s| s.borrow_mut().push(h)).map_err(|_| CuError::DEINITIALIZED)?;
    Ok(())
}

pub(crate) unsafe fn pop_current_v2(pctx: *mut CUcontext) -> CuResult<()> {
    let h = STACK.try_with(|s| s.borrow_mut().pop()).ok().flatten().ok_or(CuError::INVALID_CONTEXT)?;
    if let Some(p) = pctx.as_mut() {
        *p = from_handle(h);
    }
    Ok(())
}

pub(crate) unsafe fn get_device(dev: *mut CUdevice) -> CuResult<()> {
    let dev = dev.as_mut().ok_or(CuError::INVALID_VALUE)?;
    *dev = current_device()?;
    Ok(())
}

pub(crate) unsafe fn get_device_v2(dev: *mut CUdevice, ctx: CUcontext) -> CuResult<()> {
    let dev = dev.as_mut().ok_or(CuError::INVALID_VALUE)?;
    *dev = resolve(ctx)?.1.device;
    Ok(())
}

pub(crate) unsafe fn synchronize_v2(ctx: CUcontext) -> CuResult<()> {
    sync_device(resolve(ctx)?.1.device)
}

pub(crate) unsafe fn synchronize() -> CuResult<()> {
    let dev = current_device()?;
    sync_device(dev)
}

/// Waits for all work of `dev`'s server session; collects deferred errors.
pub fn sync_device(dev: CUdevice) -> CuResult<()> {
    let rt = runtime::get()?;
    let conn = rt.conn(dev)?;
    let remote = rt.device(dev)?.remote.ordinal;
    conn.call(
        |r| r.init_ctx_synchronize().set_device(remote),
        &[],
        crate::client::connection::Sink::None,
        |_| Ok(()),
    )
    .map_err(runtime::cu_err)
}

pub(crate) unsafe fn get_api_version(ctx: CUcontext, version: *mut u32) -> CuResult<()> {
    let version = version.as_mut().ok_or(CuError::INVALID_VALUE)?;
    resolve(ctx)?;
    // The context API version of every CUDA release since 4.0.
    *version = 3020;
    Ok(())
}

pub(crate) unsafe fn get_flags(flags: *mut u32) -> CuResult<()> {
    let flags = flags.as_mut().ok_or(CuError::INVALID_VALUE)?;
    *flags = current()?.1.flags.load(Ordering::Relaxed);
    Ok(())
}

pub(crate) unsafe fn set_flags(flags: u32) -> CuResult<()> {
    current()?.1.flags.store(flags, Ordering::Relaxed);
    Ok(())
}

pub(crate) unsafe fn get_limit(value: *mut usize, limit: CUlimit) -> CuResult<()> {
    let value = value.as_mut().ok_or(CuError::INVALID_VALUE)?;
    let (_, c) = current()?;
    let limits = c.limits.lock().unwrap_or_else(|e| e.into_inner());
    *value = *limits.get(&limit.0).ok_or(CuError::UNSUPPORTED_LIMIT)?;
    Ok(())
}

pub(crate) unsafe fn set_limit(limit: CUlimit, value: usize) -> CuResult<()> {
    let (_, c) = current()?;
    let mut limits = c.limits.lock().unwrap_or_else(|e| e.into_inner());
    let slot = limits.get_mut(&limit.0).ok_or(CuError::UNSUPPORTED_LIMIT)?;
    *slot = value;
    Ok(())
}

pub(crate) unsafe fn get_cache_config(config: *mut CUfunc_cache) -> CuResult<()> {
    let config = config.as_mut().ok_or(CuError::INVALID_VALUE)?;
    *config = CUfunc_cache(current()?.1.cache_config.load(Ordering::Relaxed));
    Ok(())
}

pub(crate) unsafe fn set_cache_config(config: CUfunc_cache) -> CuResult<()> {
    // A preference only; the real driver may ignore it too.
    current()?.1.cache_config.store(config.0, Ordering::Relaxed);
    Ok(())
}

pub(crate) unsafe fn get_stream_priority_range(least: *mut i32, greatest: *mut i32) -> CuResult<()> {
    current()?;
    // What an sm_90 device reports.
    if let Some(l) = least.as_mut() {
        *l = 0;
    }
    if let Some(g) = greatest.as_mut() {
        *g = -5;
    }
    Ok(())
}

pub(crate) unsafe fn get_id(ctx: CUcontext, id: *mut u64) -> CuResult<()> {
    let id = id.as_mut().ok_or(CuError::INVALID_VALUE)?;
    let (h, _) = resolve(ctx)?;
    *id = h & ((1 << 48) - 1);
    Ok(())
}
