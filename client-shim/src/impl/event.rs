//! Events (cuEvent*), minted here like streams. Recording is asynchronous; the server
//! timestamps an event when it reaches it in order.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::client::connection::Sink;
use crate::client::ClientError;
use crate::cuda::types::*;
use crate::objects::event::{self as events, Event};
use crate::objects::{capture, context, objects, stream};
use crate::runtime::{self, cu_err};

pub(crate) unsafe fn create(ph: &mut CUevent, flags: u32) -> CuResult<()> {
    let rt = runtime::get()?;
    let (interprocess, no_timing) = (CUevent_flags::CU_EVENT_INTERPROCESS.0, CUevent_flags::CU_EVENT_DISABLE_TIMING.0);
    // As the driver: an interprocess event must not be timed.
    if flags & interprocess != 0 && flags & no_timing == 0 {
        return Err(CuError::INVALID_VALUE);
    }
    let (ctx, c) = context::current()?;
    let ev = Event { ctx, device: c.device, recorded: AtomicBool::new(false), interprocess: flags & interprocess != 0 };
    let (h, _) = objects().events.insert(ev);
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
        objects().events.remove(h);
        return Err(cu_err(e));
    }
    *ph = h as usize as CUevent;
    Ok(())
}

pub(crate) unsafe fn destroy_v2(e: CUevent) -> CuResult<()> {
    let rt = runtime::get()?;
    let h = e as usize as u64;
    let ev = objects().events.remove(h).ok_or(CuError::INVALID_HANDLE)?;
    events::release(rt, h, &ev)
}

pub(crate) unsafe fn record(e: CUevent, s: CUstream) -> CuResult<()> {
    record_as(e, s, false)
}

/// `external`: CU_EVENT_RECORD_EXTERNAL, which during capture makes an event-record node
/// (else a recorded event stands for the capture's nodes so far, for other streams to wait on).
unsafe fn record_as(e: CUevent, s: CUstream, external: bool) -> CuResult<()> {
    let rt = runtime::get()?;
    let (h, ev) = events::get(e)?;
    let (sh, dev) = stream::device_of(s)?;
    if dev != ev.device {
        return Err(CuError::INVALID_HANDLE);
    }
    if capture::record_event(sh, h, dev, external)? {
        return Ok(());
    }
    let record = |r: rgpu_protocol::data_capnp::request::Builder<'_>| {
        let mut m = r.init_event_record();
        m.set_event(h);
        m.set_stream(sh);
    };
    if ev.interprocess {
        // Another process may wait on this record as soon as this one tells it (a pipe, shared
        // memory): on a GPU the record is in the device's queue when the call returns, so here
        // it must be in the server's before this returns, not still on the wire.
        rt.conn(dev)?.call(record, &[], Sink::None, |_| Ok(())).map_err(cu_err)?;
    } else {
        rt.conn(dev)?.post(record, &[]).map_err(cu_err)?;
    }
    ev.recorded.store(true, Ordering::Release);
    Ok(())
}

pub(crate) unsafe fn record_with_flags(e: CUevent, s: CUstream, flags: u32) -> CuResult<()> {
    let external = CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL.0;
    if flags & !external != 0 {
        return Err(CuError::INVALID_VALUE);
    }
    record_as(e, s, flags & external != 0)
}

pub(crate) unsafe fn synchronize(e: CUevent) -> CuResult<()> {
    let (h, ev) = events::get(e)?;
    capture::check_event_wait(h)?;
    events::synchronize(runtime::get()?, h, &ev)
}

pub(crate) unsafe fn query(e: CUevent) -> CuResult<()> {
    let rt = runtime::get()?;
    let (h, ev) = events::get(e)?;
    capture::check_event_wait(h)?;
    rt.conn(ev.device)?
        .call(|r| r.init_event_query().set_handle(h), &[], Sink::None, |_| Ok(()))
        .map_err(cu_err)?;
    crate::objects::managed::sync_point(rt)
}

pub(crate) unsafe fn elapsed_time(ms: &mut f32, start: CUevent, end: CUevent) -> CuResult<()> {
    let rt = runtime::get()?;
    let (hs, s) = events::get(start)?;
    let (he, e) = events::get(end)?;
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
                _ => Err(ClientError::Cuda(CuError::UNKNOWN.code())),
            },
        )
        .map_err(cu_err)?;
    Ok(())
}
