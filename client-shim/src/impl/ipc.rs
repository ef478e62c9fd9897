//! CUDA IPC of device memory (cuIpcGetMemHandle, cuIpcOpenMemHandle, cuIpcCloseMemHandle):
//! one process exports an allocation as a 64-byte handle, hands it to another process of this
//! host (a pipe, a file, multiprocessing), which opens it. Both reach the allocation's server
//! through rgpu, each with its own session, and the server lets the opener in only if it holds
//! the same lease (`rgpu-server`'s `ipc.rs`).
//!
//! The handle carries no address: a tag, the device's UUID (so the opener finds the device
//! among its own, whatever its ordinal there), and the server's export id and 128-bit secret.
//!
//! Event handles (cuIpcGetEventHandle, cuIpcOpenEventHandle) are made the same way, with their
//! own tag: the opener gets an event of its own that the server keeps as the same event, so a
//! record in either process is what the other's query, synchronize and stream wait see. Where
//! the server's backend cannot share events (the cuda backend), the device says so
//! (`CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED` 0) and the export fails.

use std::sync::atomic::AtomicBool;

use crate::client::connection::Sink;
use crate::client::ClientError;
use crate::cuda::types::*;
use crate::objects::memory::Alloc;
use crate::objects::event::{self as events, Event};
use crate::objects::{context, graph_mem, objects};
use crate::runtime::{self, cu_err, Runtime};
use rgpu_protocol::data_capnp::reply;

const TAG: &[u8; 8] = b"rgpuIPC1";
const EVENT_TAG: &[u8; 8] = b"rgpuIPE1";

/// What a handle holds, in its 64 bytes: tag, device UUID, export id, secret, zeros.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Handle {
    uuid: [u8; 16],
    id: u64,
    secret: [u8; 16],
}

impl Handle {
    fn write(&self, out: &mut CUipcMemHandle) {
        self.write_tagged(TAG, &mut out.reserved)
    }

    fn write_tagged(&self, tag: &[u8; 8], out: &mut [std::os::raw::c_char; 64]) {
        let mut b = [0u8; 64];
        b[..8].copy_from_slice(tag);
        b[8..24].copy_from_slice(&self.uuid);
        b[24..32].copy_from_slice(&self.id.to_le_bytes());
        b[32..48].copy_from_slice(&self.secret);
        for (dst, src) in out.iter_mut().zip(b) {
            *dst = src as std::os::raw::c_char;
        }
    }

    /// None for bytes that are no rgpu handle (garbage, or a real driver's).
    fn read(h: &CUipcMemHandle) -> Option<Handle> {
        Self::read_tagged(TAG, &h.reserved)
    }

    fn read_tagged(tag: &[u8; 8], raw: &[std::os::raw::c_char; 64]) -> Option<Handle> {
        let b: Vec<u8> = raw.iter().map(|&c| c as u8).collect();
        if &b[..8] != tag || b[48..].iter().any(|&x| x != 0) {
            return None;
        }
        Some(Handle {
            uuid: b[8..24].try_into().ok()?,
            id: u64::from_le_bytes(b[24..32].try_into().ok()?),
            secret: b[32..48].try_into().ok()?,
        })
    }
}

pub(crate) unsafe fn get_mem_handle(handle: &mut CUipcMemHandle, dptr: CUdeviceptr) -> CuResult<()> {
    let rt = runtime::get()?;
    let (start, a) = objects().memory.find_alloc(dptr).ok_or(CuError::INVALID_VALUE)?;
    // cuMemAlloc's memory only: not a module global or managed memory (context 0), not a map,
    // not the stream-ordered allocator's or a graph's (CUDA exports those through pools), not
    // memory opened from another process.
    if a.ctx == 0 || a.mapped || a.pool != 0 || a.ipc > 0 || graph_mem::find(start).is_some() {
        return Err(CuError::INVALID_VALUE);
    }
    let (id, secret) = rt
        .conn(a.device)?
        .call(
            |r| r.init_ipc_export().set_ptr(Runtime::to_remote(start)),
            &[],
            Sink::None,
            export_reply,
        )
        .map_err(cu_err)?;
    Handle { uuid: rt.device(a.device)?.remote.uuid, id, secret }.write(handle);
    Ok(())
}

/// An export's id and secret, from its reply.
fn export_reply(r: reply::Reader<'_>) -> Result<(u64, [u8; 16]), ClientError> {
    match r.which() {
        Ok(reply::IpcHandle(Ok(h))) => {
            let secret: [u8; 16] = h.get_secret().ok().and_then(|s| s.try_into().ok()).ok_or(bad_reply())?;
            Ok((h.get_id(), secret))
        }
        _ => Err(bad_reply()),
    }
}

fn bad_reply() -> ClientError {
    ClientError::Cuda(CuError::UNKNOWN.code())
}

/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, the one flag there is.
const LAZY_ENABLE_PEER_ACCESS: u32 = 1;

pub(crate) unsafe fn open_mem_handle_v2(dptr: &mut CUdeviceptr, handle: CUipcMemHandle, flags: u32) -> CuResult<()> {
    let rt = runtime::get()?;
    if flags & !LAZY_ENABLE_PEER_ACCESS != 0 {
        return Err(CuError::INVALID_VALUE);
    }
    let (ctx, _) = context::current()?;
    let h = Handle::read(&handle).ok_or(CuError::INVALID_VALUE)?;
    let dev = (0..rt.devices.len() as CUdevice)
        .find(|&d| rt.device(d).is_ok_and(|x| x.remote.uuid == h.uuid))
        .ok_or(CuError::INVALID_DEVICE)?;
    let (remote, size) = rt
        .conn(dev)?
        .call(
            |r| {
                let mut o = r.init_ipc_open();
                o.set_id(h.id);
                o.set_secret(&h.secret);
            },
            &[],
            Sink::None,
            |r| match r.which() {
                Ok(reply::IpcOpened(Ok(m))) => Ok((m.get_ptr(), m.get_size())),
                _ => Err(bad_reply()),
            },
        )
        .map_err(cu_err)?;
    let ptr = rt.to_client(dev, remote);
    let mut m = objects().memory.allocs.lock().unwrap_or_else(|e| e.into_inner());
    match m.get_mut(&ptr) {
        // Opened before: the same pointer, one more open to close (the server counted it too).
        Some(a) if a.ipc > 0 => a.ipc += 1,
        _ => {
            m.insert(ptr, Alloc { size, device: dev, ctx, pool: 0, mapped: false, ipc: 1 });
        }
    }
    *dptr = ptr;
    Ok(())
}

pub(crate) unsafe fn close_mem_handle(dptr: CUdeviceptr) -> CuResult<()> {
    let rt = runtime::get()?;
    let a = {
        let mut m = objects().memory.allocs.lock().unwrap_or_else(|e| e.into_inner());
        let a = match m.get_mut(&dptr) {
            Some(a) if a.ipc > 0 => a,
            _ => return Err(CuError::INVALID_VALUE),
        };
        a.ipc -= 1;
        let a = *a;
        if a.ipc == 0 {
            m.remove(&dptr);
        }
        a
    };
    // Ordered after the work queued before it, as the server runs the session's requests in order.
    rt.conn(a.device)?.post(|r| r.init_ipc_close().set_ptr(Runtime::to_remote(dptr)), &[]).map_err(cu_err)
}

pub(crate) unsafe fn get_event_handle(handle: &mut CUipcEventHandle, e: CUevent) -> CuResult<()> {
    let rt = runtime::get()?;
    let (h, ev) = events::get(e)?;
    let (id, secret) = rt
        .conn(ev.device)?
        .call(
            |r| r.init_ipc_event_export().set_handle(h),
            &[],
            Sink::None,
            export_reply,
        )
        .map_err(cu_err)?;
    Handle { uuid: rt.device(ev.device)?.remote.uuid, id, secret }.write_tagged(EVENT_TAG, &mut handle.reserved);
    Ok(())
}

pub(crate) unsafe fn open_event_handle(ph: &mut CUevent, handle: CUipcEventHandle) -> CuResult<()> {
    let rt = runtime::get()?;
    let (ctx, _) = context::current()?;
    let x = Handle::read_tagged(EVENT_TAG, &handle.reserved).ok_or(CuError::INVALID_VALUE)?;
    let dev = (0..rt.devices.len() as CUdevice)
        .find(|&d| rt.device(d).is_ok_and(|v| v.remote.uuid == x.uuid))
        .ok_or(CuError::INVALID_DEVICE)?;
    let (h, _) = objects().events.insert(Event { ctx, device: dev, recorded: AtomicBool::new(false), interprocess: true });
    // Answered at once: a handle that opens nothing must fail here, not at the event's first use.
    let opened = rt.conn(dev)?.call(
        |r| {
            let mut o = r.init_ipc_event_open();
            o.set_handle(h);
            o.set_id(x.id);
            o.set_secret(&x.secret);
        },
        &[],
        Sink::None,
        |_| Ok(()),
    );
    if let Err(e) = opened {
        objects().events.remove(h);
        return Err(cu_err(e));
    }
    *ph = h as usize as CUevent;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_foreign_bytes_are_refused() {
        let h = Handle { uuid: [7; 16], id: 0x0102_0304_0506_0708, secret: [9; 16] };
        let mut raw = CUipcMemHandle { reserved: [0; 64] };
        h.write(&mut raw);
        assert_eq!(Handle::read(&raw), Some(h));
        let mut other = raw;
        other.reserved[0] = b'x' as _;
        assert_eq!(Handle::read(&other), None, "no rgpu tag");
        let mut tail = raw;
        tail.reserved[63] = 1;
        assert_eq!(Handle::read(&tail), None, "bytes past the secret");
        assert_eq!(Handle::read(&CUipcMemHandle { reserved: [0; 64] }), None);
        let mut ev = CUipcEventHandle { reserved: [0; 64] };
        h.write_tagged(EVENT_TAG, &mut ev.reserved);
        assert_eq!(Handle::read_tagged(EVENT_TAG, &ev.reserved), Some(h));
        assert_eq!(Handle::read_tagged(EVENT_TAG, &raw.reserved), None, "a memory handle is no event handle");
        assert_eq!(Handle::read(&CUipcMemHandle { reserved: ev.reserved }), None, "nor the reverse");
    }
}
