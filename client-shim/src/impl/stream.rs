//! Streams. Handles are minted here and announced to the server without
//! waiting: creating a stream costs no round trip.

use std::sync::LazyLock;

use crate::client::connection::Sink;
use crate::cuda::types::*;
use crate::handles::{tag, Table};
use crate::runtime::{self, cu_err, Runtime};

use super::context;

pub struct Stream {
    pub ctx: u64,
    pub device: CUdevice,
    pub flags: u32,
    pub priority: i32,
}

pub static STREAMS: LazyLock<Table<Stream>> = LazyLock::new(|| Table::new(tag::STREAM));

/// The special handles CUDA gives the default streams.
const LEGACY: u64 = 0x1;
const PER_THREAD: u64 = 0x2;

/// The server-side handle for a stream argument: 0 for the default streams.
pub fn remote(s: CUstream) -> CuResult<u64> {
    let h = s as usize as u64;
    if h == 0 || h == LEGACY || h == PER_THREAD {
        return Ok(0);
    }
    STREAMS.get(h).map(|_| h).ok_or(CuError::INVALID_HANDLE)
}

/// The device a stream argument runs on: the stream's own for a created
/// stream, the current context's for the default streams.
pub fn device_of(s: CUstream) -> CuResult<(u64, CUdevice)> {
    let h = remote(s)?;
    if h == 0 {
        return Ok((0, context::current_device()?));
    }
    let st = STREAMS.get(h).ok_or(CuError::INVALID_HANDLE)?;
    Ok((h, st.device))
}

pub(crate) unsafe fn create(ph: *mut CUstream, flags: u32) -> CuResult<()> {
    create_with_priority(ph, flags, 0)
}

pub(crate) unsafe fn create_with_priority(ph: *mut CUstream, flags: u32, priority: i32) -> CuResult<()> {
    let ph = ph.as_mut().ok_or(CuError::INVALID_VALUE)?;
    let rt = runtime::get()?;
    let (ctx, c) = context::current()?;
    let dev = c.device;
    // Priorities outside the device's range are clamped, as CUDA does.
    let priority = priority.clamp(-5, 0);
    let (h, _) = STREAMS.insert(Stream { ctx, device: dev, flags, priority });
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
        STREAMS.remove(h);
        return Err(cu_err(e));
    }
    *ph = h as usize as CUstream;
    Ok(())
}

pub(crate) unsafe fn destroy_v2(s: CUstream) -> CuResult<()> {
    let rt = runtime::get()?;
    let h = s as usize as u64;
    let st = STREAMS.remove(h).ok_or(CuError::INVALID_HANDLE)?;
    // Work already queued on the stream still completes, as in CUDA.
    rt.conn(st.device)?.post(|r| r.init_stream_destroy().set_handle(h), &[]).map_err(cu_err)
}

/// Destroys the streams of a context being torn down.
pub fn destroy_context(rt: &Runtime, ctx: u64) {
    for h in STREAMS.select(|s| s.ctx == ctx) {
        if let Some(st) = STREAMS.remove(h) {
            if let Ok(conn) = rt.conn(st.device) {
                let _ = conn.post(|r| r.init_stream_destroy().set_handle(h), &[]);
            }
        }
    }
}

pub(crate) unsafe fn synchronize(s: CUstream) -> CuResult<()> {
    let rt = runtime::get()?;
    let (h, dev) = device_of(s)?;
    rt.conn(dev)?
        .call(|r| r.init_stream_synchronize().set_handle(h), &[], Sink::None, |_| Ok(()))
        .map_err(cu_err)
}

pub(crate) unsafe fn query(s: CUstream) -> CuResult<()> {
    let rt = runtime::get()?;
    let (h, dev) = device_of(s)?;
    rt.conn(dev)?
        .call(|r| r.init_stream_query().set_handle(h), &[], Sink::None, |_| Ok(()))
        .map_err(cu_err)
}

pub(crate) unsafe fn wait_event(s: CUstream, e: CUevent, flags: u32) -> CuResult<()> {
    let rt = runtime::get()?;
    let (h, dev) = device_of(s)?;
    let ev = super::event::EVENTS.get(e as usize as u64).ok_or(CuError::INVALID_HANDLE)?;
    if rt.device(ev.device)?.server != rt.device(dev)?.server {
        // An event of another server: wait for it here, then go on.
        super::event::synchronize(e)?;
        return Ok(());
    }
    rt.conn(dev)?
        .post(
            |r| {
                let mut m = r.init_stream_wait_event();
                m.set_stream(h);
                m.set_event(e as usize as u64);
                m.set_flags(flags);
            },
            &[],
        )
        .map_err(cu_err)
}

pub(crate) unsafe fn get_flags(s: CUstream, flags: *mut u32) -> CuResult<()> {
    let flags = flags.as_mut().ok_or(CuError::INVALID_VALUE)?;
    let h = remote(s)?;
    *flags = if h == 0 { 0 } else { STREAMS.get(h).ok_or(CuError::INVALID_HANDLE)?.flags };
    Ok(())
}

pub(crate) unsafe fn get_priority(s: CUstream, priority: *mut i32) -> CuResult<()> {
    let priority = priority.as_mut().ok_or(CuError::INVALID_VALUE)?;
    let h = remote(s)?;
    *priority = if h == 0 { 0 } else { STREAMS.get(h).ok_or(CuError::INVALID_HANDLE)?.priority };
    Ok(())
}

pub(crate) unsafe fn get_ctx(s: CUstream, pctx: *mut CUcontext) -> CuResult<()> {
    let pctx = pctx.as_mut().ok_or(CuError::INVALID_VALUE)?;
    let h = remote(s)?;
    *pctx = if h == 0 {
        context::from_handle(context::current()?.0)
    } else {
        context::from_handle(STREAMS.get(h).ok_or(CuError::INVALID_HANDLE)?.ctx)
    };
    Ok(())
}

pub(crate) unsafe fn get_id(s: CUstream, id: *mut u64) -> CuResult<()> {
    let id = id.as_mut().ok_or(CuError::INVALID_VALUE)?;
    *id = remote(s)? & ((1 << 48) - 1);
    Ok(())
}

pub(crate) unsafe fn synchronize_ptsz(s: CUstream) -> CuResult<()> {
    synchronize(s)
}
pub(crate) unsafe fn query_ptsz(s: CUstream) -> CuResult<()> {
    query(s)
}
pub(crate) unsafe fn wait_event_ptsz(s: CUstream, e: CUevent, flags: u32) -> CuResult<()> {
    wait_event(s, e, flags)
}
pub(crate) unsafe fn get_flags_ptsz(s: CUstream, flags: *mut u32) -> CuResult<()> {
    get_flags(s, flags)
}
pub(crate) unsafe fn get_priority_ptsz(s: CUstream, p: *mut i32) -> CuResult<()> {
    get_priority(s, p)
}

pub(crate) unsafe fn get_device(s: CUstream, device: *mut CUdevice) -> CuResult<()> {
    let device = device.as_mut().ok_or(CuError::INVALID_VALUE)?;
    *device = device_of(s)?.1;
    Ok(())
}
