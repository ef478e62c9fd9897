//! Streams. Handles are minted by the shim and announced to the server without waiting.

use std::sync::Arc;

use rgpu_cuda_types::*;

use super::{context, objects};
use crate::runtime::{cu_err, Runtime};

pub struct Stream {
    pub ctx: u64,
    pub device: CUdevice,
    pub flags: u32,
    pub priority: i32,
}

/// The special handles CUDA gives the default streams.
const LEGACY: u64 = 0x1;
const PER_THREAD: u64 = 0x2;

/// The server-side handle for a stream argument: 0 for the default streams.
pub fn remote(s: CUstream) -> CuResult<u64> {
    let h = s as usize as u64;
    if h == 0 || h == LEGACY || h == PER_THREAD {
        return Ok(0);
    }
    objects().streams.get(h).map(|_| h).ok_or(CuError::INVALID_HANDLE)
}

/// A created stream (not a default one).
pub fn get(h: u64) -> CuResult<Arc<Stream>> {
    objects().streams.get(h).ok_or(CuError::INVALID_HANDLE)
}

/// The device a stream argument runs on: the stream's own for a created stream, the current
/// context's for the default streams.
pub fn device_of(s: CUstream) -> CuResult<(u64, CUdevice)> {
    let h = remote(s)?;
    if h == 0 {
        return Ok((0, context::current_device()?));
    }
    Ok((h, get(h)?.device))
}

/// Waits until the work queued on stream argument `s` so far is done; its error, if any of it
/// failed, is returned (cuStreamSynchronize, and what runs after a stream's work on the host).
pub fn synchronize(s: CUstream) -> CuResult<()> {
    let rt = crate::runtime::get()?;
    let (h, dev) = device_of(s)?;
    rt.conn(dev)?
        .call(|r| r.init_stream_synchronize().set_handle(h), &[], crate::client::connection::Sink::None, |_| Ok(()))
        .map_err(cu_err)?;
    super::managed::sync_point(rt)
}

/// Tells the stream's server it is gone (work already queued on it still completes, as in
/// CUDA). The caller has removed it from the table.
pub fn release(rt: &Runtime, h: u64, st: &Stream) -> CuResult<()> {
    rt.conn(st.device)?.post(|r| r.init_stream_destroy().set_handle(h), &[]).map_err(cu_err)
}
