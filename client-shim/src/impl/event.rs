//! Events, minted here like streams. Recording is asynchronous; the server
//! timestamps an event when it reaches it in order.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::LazyLock;

use crate::client::connection::Sink;
use crate::cuda::types::*;
use crate::handles::{tag, Table};
use crate::runtime::{self, cu_err, Runtime};

use super::{context, stream};

pub struct Event {
    pub ctx: u64,
    pub device: CUdevice,
    pub flags: u32,
    pub recorded: AtomicBool,
}

pub static EVENTS: LazyLock<Table<Event>> = LazyLock::new(|| Table::new(tag::EVENT));

fn get(e: CUevent) -> CuResult<(u64, std::sync::Arc<Event>)> {
    let h = e as usize as u64;
    Ok((h, EVENTS.get(h).ok_or(CuError::INVALID_HANDLE)?))
}

pub(crate) unsafe fn create(ph: *mut CUevent, flags: u32) -> CuResult<()> {
    let ph = ph.as_mut().ok_or(CuError::INVALID_VALUE)?;
    let rt = runtime::get()?;
    let (ctx, c) = context::current()?;
    let (h, _) = EVENTS.insert(Event { ctx, device: c.device, flags, recorded: AtomicBool::new(false) });
    let remote_dev = rt.device(c.device)?.remote.ordinal;
    let sent = rt.conn(c.device)?.post(
        |r| {
            let mut m = r.init_event_create();
            m.set_handle(h);
            m.set_device(remote_dev);
            m.set_flags(flags);
        },
        &[],
    );
    if let Err(e) = sent {
        EVENTS.remove(h);
        return Err(cu_err(e));
    }
    *ph = h as usize as CUevent;
    Ok(())
}

pub(crate) unsafe fn destroy_v2(e: CUevent) -> CuResult<()> {
    let rt = runtime::get()?;
    let h = e as usize as u64;
    let ev = EVENTS.remove(h).ok_or(CuError::INVALID_HANDLE)?;
    rt.conn(ev.device)?.post(|r| r.init_event_destroy().set_handle(h), &[]).map_err(cu_err)
}

pub fn destroy_context(rt: &Runtime, ctx: u64) {
    for h in EVENTS.select(|e| e.ctx == ctx) {
        if let Some(ev) = EVENTS.remove(h) {
            if let Ok(conn) = rt.conn(ev.device) {
                let _ = conn.post(|r| r.init_event_destroy().set_handle(h), &[]);
            }
        }
    }
}

pub(crate) unsafe fn record(e: CUevent, s: CUstream) -> CuResult<()> {
    let rt = runtime::get()?;
    let (h, ev) = get(e)?;
    let (sh, dev) = stream::device_of(s)?;
    if dev != ev.device {
        return Err(CuError::INVALID_HANDLE);
    }
    rt.conn(dev)?
        .post(
            |r| {
                let mut m = r.init_event_record();
                m.set_event(h);
                m.set_stream(sh);
            },
            &[],
        )
        .map_err(cu_err)?;
    ev.recorded.store(true, Ordering::Release);
    Ok(())
}

pub(crate) unsafe fn record_with_flags(e: CUevent, s: CUstream, _flags: u32) -> CuResult<()> {
    // The only flag, CU_EVENT_RECORD_EXTERNAL, matters for graph capture,
    // which rgpu does not offer.
    record(e, s)
}

pub(crate) unsafe fn synchronize(e: CUevent) -> CuResult<()> {
    let rt = runtime::get()?;
    let (h, ev) = get(e)?;
    rt.conn(ev.device)?
        .call(|r| r.init_event_synchronize().set_handle(h), &[], Sink::None, |_| Ok(()))
        .map_err(cu_err)
}

pub(crate) unsafe fn query(e: CUevent) -> CuResult<()> {
    let rt = runtime::get()?;
    let (h, ev) = get(e)?;
    rt.conn(ev.device)?
        .call(|r| r.init_event_query().set_handle(h), &[], Sink::None, |_| Ok(()))
        .map_err(cu_err)
}

pub(crate) unsafe fn elapsed_time(ms: *mut f32, start: CUevent, end: CUevent) -> CuResult<()> {
    let ms = ms.as_mut().ok_or(CuError::INVALID_VALUE)?;
    let rt = runtime::get()?;
    let (hs, s) = get(start)?;
    let (he, e) = get(end)?;
    if s.device != e.device {
        return Err(CuError::INVALID_HANDLE);
    }
    *ms = rt
        .conn(s.device)?
        .call(
            |r| {
                let mut m = r.init_event_elapsed_time();
                m.set_start(hs);
                m.set_end(he);
            },
            &[],
            Sink::None,
            |reply| match reply.which() {
                Ok(rgpu_protocol::data_capnp::reply::EventElapsedTime(t)) => Ok(t),
                _ => Err(crate::client::ClientError::Cuda(CuError::UNKNOWN.0.get())),
            },
        )
        .map_err(cu_err)?;
    Ok(())
}

pub(crate) unsafe fn elapsed_time_v2(ms: *mut f32, start: CUevent, end: CUevent) -> CuResult<()> {
    elapsed_time(ms, start, end)
}

pub(crate) unsafe fn record_ptsz(e: CUevent, s: CUstream) -> CuResult<()> {
    record(e, s)
}
pub(crate) unsafe fn record_with_flags_ptsz(e: CUevent, s: CUstream, flags: u32) -> CuResult<()> {
    record_with_flags(e, s, flags)
}
