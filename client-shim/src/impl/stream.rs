//! Streams (cuStream*). Handles are minted here and announced to the server without waiting:
//! creating a stream costs no round trip.

use crate::client::connection::Sink;
use crate::cuda::types::*;
use crate::objects::stream::{self as streams, Stream};
use crate::objects::{capture, context, event, graph, objects};
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
    capture::forget_stream(h);
    crate::objects::managed::forget_stream(h);
    streams::release(rt, h, &st)
}

pub(crate) unsafe fn synchronize(s: CUstream) -> CuResult<()> {
    capture::refuse_sync(streams::remote(s)?)?;
    streams::synchronize(s)
}

pub(crate) unsafe fn query(s: CUstream) -> CuResult<()> {
    let rt = runtime::get()?;
    let (h, dev) = streams::device_of(s)?;
    capture::refuse_sync(h)?;
    rt.conn(dev)?
        .call(|r| r.init_stream_query().set_handle(h), &[], Sink::None, |_| Ok(()))
        .map_err(cu_err)?;
    crate::objects::managed::sync_point(rt)
}

pub(crate) unsafe fn wait_event(s: CUstream, e: CUevent, flags: u32) -> CuResult<()> {
    let rt = runtime::get()?;
    let (h, dev) = streams::device_of(s)?;
    let (eh, ev) = event::get(e)?;
    let external = flags & CUevent_wait_flags::CU_EVENT_WAIT_EXTERNAL.0 != 0;
    if capture::wait_event(h, dev, eh, ev.device, external)? {
        return Ok(());
    }
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

/// cuStreamAttachMemAsync: a managed allocation's (or `__managed__` variable's) stream
/// association; see [`managed::Attach`] for what it changes. It takes effect at once rather
/// than after the stream's earlier work: memory already on the device stays there until the
/// next synchronisation either way.
pub(crate) unsafe fn attach_mem_async(s: CUstream, dptr: CUdeviceptr, length: usize, flags: u32) -> CuResult<()> {
    use crate::objects::managed::{self, Attach};
    runtime::get()?;
    let (h, _) = streams::device_of(s)?;
    let to = match CUmemAttach_flags(flags) {
        CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL => Attach::Global,
        CUmemAttach_flags::CU_MEM_ATTACH_HOST => Attach::Host,
        // CUDA refuses the NULL stream, a virtual global stream; the wire does not tell the
        // per-thread default stream from it, so that is refused too.
        CUmemAttach_flags::CU_MEM_ATTACH_SINGLE if h == 0 => return Err(CuError::INVALID_VALUE),
        CUmemAttach_flags::CU_MEM_ATTACH_SINGLE => Attach::Single(h),
        _ => return Err(CuError::INVALID_VALUE),
    };
    capture::refuse(h, CuError::STREAM_CAPTURE_UNSUPPORTED, "cuStreamAttachMemAsync")?;
    managed::attach(dptr, length as u64, to)
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

// ---- capture (objects::capture) -------------------------------------------------------------

/// The created stream a capture call names: the legacy stream cannot capture, as in CUDA; the
/// per-thread default stream could, but rgpu does not tell it from the legacy one on the wire.
fn capturable(s: CUstream) -> CuResult<(u64, CUdevice)> {
    let (h, dev) = streams::device_of(s)?;
    if h == 0 {
        if s as usize == 0x2 {
            tracing::warn!("stream capture on the per-thread default stream is not supported by rgpu");
            return Err(CuError::NOT_SUPPORTED);
        }
        return Err(CuError::STREAM_CAPTURE_UNSUPPORTED);
    }
    Ok((h, dev))
}

pub(crate) unsafe fn begin_capture(s: CUstream) -> CuResult<()> {
    begin_capture_v2(s, CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
}

pub(crate) unsafe fn begin_capture_v2(s: CUstream, mode: CUstreamCaptureMode) -> CuResult<()> {
    let (h, dev) = capturable(s)?;
    capture::begin(h, dev, mode)
}

/// Captures into the program's graph `g`, after its nodes `deps` (default edges only).
pub(crate) unsafe fn begin_capture_to_graph(
    s: CUstream,
    g: CUgraph,
    deps: *const CUgraphNode,
    edges: *const CUgraphEdgeData,
    n: usize,
    mode: CUstreamCaptureMode,
) -> CuResult<()> {
    let (h, dev) = capturable(s)?;
    let gh = g as usize as u64;
    if objects().graphs.get(gh).is_none() {
        return Err(CuError::INVALID_VALUE);
    }
    if !edges.is_null() && n > 0 && std::slice::from_raw_parts(edges, n).iter().any(|e| *e != CUgraphEdgeData::default()) {
        tracing::warn!("cuStreamBeginCaptureToGraph: only default edges are supported by rgpu");
        return Err(CuError::NOT_SUPPORTED);
    }
    capture::begin_into(h, dev, mode, Some(gh), graph::node_list(deps, n)?)
}

pub(crate) unsafe fn end_capture(s: CUstream, graph: &mut CUgraph) -> CuResult<()> {
    let h = streams::remote(s)?;
    *graph = std::ptr::null_mut();
    let g = capture::end(h)?;
    *graph = g as usize as CUgraph;
    Ok(())
}

pub(crate) unsafe fn is_capturing(s: CUstream, status: &mut CUstreamCaptureStatus) -> CuResult<()> {
    let (h, _) = streams::device_of(s)?;
    *status = capture::info(h).status;
    Ok(())
}

pub(crate) unsafe fn get_capture_info(s: CUstream, status: &mut CUstreamCaptureStatus, id: Option<&mut u64>) -> CuResult<()> {
    get_capture_info_v3(s, status, id, None, None, None, None)
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

/// The edge data handed out are all default edges (the only kind rgpu captures).
pub(crate) unsafe fn get_capture_info_v3(
    s: CUstream,
    status: &mut CUstreamCaptureStatus,
    id: Option<&mut u64>,
    graph: Option<&mut CUgraph>,
    dependencies: Option<&mut *const CUgraphNode>,
    edges: Option<&mut *const CUgraphEdgeData>,
    count: Option<&mut usize>,
) -> CuResult<()> {
    let (h, _) = streams::device_of(s)?;
    let i = capture::info(h);
    *status = i.status;
    if let Some(out) = id {
        *out = i.id;
    }
    if let Some(g) = graph {
        *g = i.graph as usize as CUgraph;
    }
    if let Some(d) = dependencies {
        *d = i.deps;
    }
    if let Some(e) = edges {
        *e = i.edges;
    }
    if let Some(n) = count {
        *n = i.count;
    }
    Ok(())
}

pub(crate) unsafe fn update_capture_dependencies(s: CUstream, deps: *mut CUgraphNode, n: usize, flags: u32) -> CuResult<()> {
    update_capture_dependencies_v2(s, deps, std::ptr::null(), n, flags)
}

pub(crate) unsafe fn update_capture_dependencies_v2(
    s: CUstream,
    deps: *mut CUgraphNode,
    edges: *const CUgraphEdgeData,
    n: usize,
    flags: u32,
) -> CuResult<()> {
    type F = CUstreamUpdateCaptureDependencies_flags;
    let set = match flags {
        f if f == F::CU_STREAM_ADD_CAPTURE_DEPENDENCIES.0 => false,
        f if f == F::CU_STREAM_SET_CAPTURE_DEPENDENCIES.0 => true,
        _ => return Err(CuError::INVALID_VALUE),
    };
    let h = streams::remote(s)?;
    let nodes = graph::node_list(deps, n)?;
    if !edges.is_null() && n > 0 && std::slice::from_raw_parts(edges, n).iter().any(|e| *e != CUgraphEdgeData::default()) {
        tracing::warn!("cuStreamUpdateCaptureDependencies_v2: only default edges are supported by rgpu");
        return Err(CuError::NOT_SUPPORTED);
    }
    capture::update_dependencies(h, &nodes, set)
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
