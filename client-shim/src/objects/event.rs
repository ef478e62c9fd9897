//! Events, minted by the shim like streams; the server timestamps an event when its stream
//! reaches it.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use rgpu_cuda_types::*;

use super::objects;
use crate::client::connection::Sink;
use crate::runtime::{cu_err, Runtime};

pub struct Event {
    pub ctx: u64,
    pub device: CUdevice,
    pub recorded: AtomicBool,
    /// CU_EVENT_INTERPROCESS (created so, or opened from another process's handle): other
    /// processes see its records, so each record reaches the server before it returns.
    pub interprocess: bool,
}

pub fn get(e: CUevent) -> CuResult<(u64, Arc<Event>)> {
    let h = e as usize as u64;
    Ok((h, objects().events.get(h).ok_or(CuError::INVALID_HANDLE)?))
}

/// Waits on the event's server until the event has completed.
pub fn synchronize(rt: &Runtime, h: u64, ev: &Event) -> CuResult<()> {
    rt.conn(ev.device)?
        .call(|r| r.init_event_synchronize().set_handle(h), &[], Sink::None, |_| Ok(()))
        .map_err(cu_err)?;
    super::managed::sync_point(rt)
}

/// Tells the event's server it is gone. The caller has removed it from the table.
pub fn release(rt: &Runtime, h: u64, ev: &Event) -> CuResult<()> {
    rt.conn(ev.device)?.post(|r| r.init_event_destroy().set_handle(h), &[]).map_err(cu_err)
}
