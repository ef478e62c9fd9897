//! Streams (cuStream*). Handles are minted here and announced to the server without waiting:
//! creating a stream costs no round trip.

use crate::client::connection::Sink;
use crate::cuda::types::*;
use crate::objects::stream::{self as streams, Stream};
use crate::objects::{context, event, objects};
use crate::runtime::{self, cu_err};

pub(crate) unsafe fn create(ph: &mut CUstream, flags: u32) -> CuResult<()> {
    create_with_priority(ph, flags, 0)
}

pub(crate) unsafe fn create_with_priority(ph: &mut CUstream, flags: u32, priority: i32) -> CuResult<()> {
    let rt = runtime::get()?;
    let (ctx, c) = context::current()?;
    let dev = c.device;
    // Priorities outside the device's range are clamped, as CUDA does.
    let priority = priority.clamp(-5, 0);
    let (h, _) = objects().streams.insert(Stream { ctx, device: dev, flags, priority });
    let remote_dev = rt.device(dev)?.remote.ordinal;
    let sent = rt.conn(dev)?.post(
        |r| {
            let mut m = r.init_stream_create();
            m.set_handle(h);
            m.set_device(remote_dev);
            m.set_flags(flags);
            m.set_priority(priority);
        },
        &[],
    );
    if let Err(e) = sent {
        objects().streams.remove(h);
        return Err(cu_err(e));
    }
    *ph = h as usize as CUstream;
    Ok(())
}

pub(crate) unsafe fn destroy_v2(s: CUstream) -> CuResult<()> {
    let rt = runtime::get()?;
    let h = s as usize as u64;
    let st = objects().streams.remove(h).ok_or(CuError::INVALID_HANDLE)?;
    streams::release(rt, h, &st)
}

pub(crate) unsafe fn synchronize(s: CUstream) -> CuResult<()> {
    streams::synchronize(s)
}

pub(crate) unsafe fn query(s: CUstream) -> CuResult<()> {
    let rt = runtime::get()?;
    let (h, dev) = streams::device_of(s)?;
    rt.conn(dev)?
        .call(|r| r.init_stream_query().set_handle(h), &[], Sink::None, |_| Ok(()))
        .map_err(cu_err)?;
    crate::objects::managed::sync_point(rt)
}

pub(crate) unsafe fn wait_event(s: CUstream, e: CUevent, flags: u32) -> CuResult<()> {
    let rt = runtime::get()?;
    let (h, dev) = streams::device_of(s)?;
    let (eh, ev) = event::get(e)?;
    if rt.device(ev.device)?.server != rt.device(dev)?.server {
        // An event of another server: wait for it here, then go on.
        return event::synchronize(rt, eh, &ev);
    }
    rt.conn(dev)?
        .post(
            |r| {
                let mut m = r.init_stream_wait_event();
                m.set_stream(h);
                m.set_event(eh);
                m.set_flags(flags);
            },
            &[],
        )
        .map_err(cu_err)
}

pub(crate) unsafe fn get_flags(s: CUstream, flags: &mut u32) -> CuResult<()> {
    let h = streams::remote(s)?;
    *flags = if h == 0 { 0 } else { streams::get(h)?.flags };
    Ok(())
}

pub(crate) unsafe fn get_priority(s: CUstream, priority: &mut i32) -> CuResult<()> {
    let h = streams::remote(s)?;
    *priority = if h == 0 { 0 } else { streams::get(h)?.priority };
    Ok(())
}

pub(crate) unsafe fn get_ctx(s: CUstream, pctx: &mut CUcontext) -> CuResult<()> {
    let h = streams::remote(s)?;
    let ctx = if h == 0 { context::current()?.0 } else { streams::get(h)?.ctx };
    *pctx = context::from_handle(ctx);
    Ok(())
}

pub(crate) unsafe fn get_id(s: CUstream, id: &mut u64) -> CuResult<()> {
    *id = streams::remote(s)? & ((1 << 48) - 1);
    Ok(())
}

pub(crate) unsafe fn get_device(s: CUstream, device: &mut CUdevice) -> CuResult<()> {
    *device = streams::device_of(s)?.1;
    Ok(())
}

// ---- capture ---------------------------------------------------------------------------------
// rgpu does not capture streams into graphs yet: cuStreamBeginCapture answers
// CUDA_ERROR_NOT_SUPPORTED, so no stream is ever capturing, and these answer that truthfully.
// Libraries ask before every allocation and launch (CuPy's and PyTorch's allocators).

pub(crate) unsafe fn is_capturing(s: CUstream, status: &mut CUstreamCaptureStatus) -> CuResult<()> {
    streams::device_of(s)?;
    *status = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    Ok(())
}

pub(crate) unsafe fn get_capture_info(s: CUstream, status: &mut CUstreamCaptureStatus, id: Option<&mut u64>) -> CuResult<()> {
    is_capturing(s, status)?;
    if let Some(id) = id {
        *id = 0;
    }
    Ok(())
}

pub(crate) unsafe fn get_capture_info_v2(
    s: CUstream,
    status: &mut CUstreamCaptureStatus,
    id: Option<&mut u64>,
    graph: Option<&mut CUgraph>,
    dependencies: Option<&mut *const CUgraphNode>,
    count: Option<&mut usize>,
) -> CuResult<()> {
    get_capture_info_v3(s, status, id, graph, dependencies, None, count)
}

pub(crate) unsafe fn get_capture_info_v3(
    s: CUstream,
    status: &mut CUstreamCaptureStatus,
    id: Option<&mut u64>,
    graph: Option<&mut CUgraph>,
    dependencies: Option<&mut *const CUgraphNode>,
    edges: Option<&mut *const CUgraphEdgeData>,
    count: Option<&mut usize>,
) -> CuResult<()> {
    get_capture_info(s, status, id)?;
    if let Some(g) = graph {
        *g = std::ptr::null_mut();
    }
    if let Some(d) = dependencies {
        *d = std::ptr::null();
    }
    if let Some(e) = edges {
        *e = std::ptr::null();
    }
    if let Some(n) = count {
        *n = 0;
    }
    Ok(())
}

/// Runs `callback` once the work queued on `s` is done, with that work's status (see
/// `launch::host_func` for why on the calling thread). An error is also returned, so that it
/// is not lost to the program's next synchronising call.
pub(crate) unsafe fn add_callback(s: CUstream, callback: CUstreamCallback, user_data: *mut std::ffi::c_void, flags: u32) -> CuResult<()> {
    let callback = callback.ok_or(CuError::INVALID_VALUE)?;
    if flags != 0 {
        return Err(CuError::INVALID_VALUE);
    }
    let done = synchronize(s);
    callback(s, cu_result(done), user_data);
    done
}

/// Green contexts (SM partitions) are not offered: no stream belongs to one.
pub(crate) unsafe fn get_green_ctx(s: CUstream, green: &mut CUgreenCtx) -> CuResult<()> {
    streams::device_of(s)?;
    *green = std::ptr::null_mut();
    Ok(())
}
