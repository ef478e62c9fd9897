//! Reading a cuda session's movable memory from other threads while the session runs: the
//! pre-copy of a live migration ([`crate::checkpoint::precopy`]), and the digest of what
//! changed once it is held still.
//!
//! The session keeps [`Peekable`] up to date: its placed allocations and its contexts. A
//! read takes the read lock, so the session cannot free what is being read (a freed region
//! could go back to the driver and to another session), nor destroy the context it is read
//! through, until the read is over.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, RwLock};

use cudarc::driver::sys;

use super::driver::cu;
use super::Raw;
use crate::backend::MemoryPeek;

/// `CU_STREAM_NON_BLOCKING`: the pre-copy's reads do not wait for, nor hold up, the
/// program's work on the legacy stream.
const STREAM_NON_BLOCKING: u32 = 0x1;

#[derive(Default)]
pub(super) struct Peekable {
    /// Placed client allocations: start -> (device, size).
    pub allocs: BTreeMap<u64, (u32, u64)>,
    /// The session's context on each device, while it has one.
    pub ctxs: Vec<Option<Raw<sys::CUcontext>>>,
    /// Per device, the stream the reads go on (made on first use, destroyed with the
    /// context, under the write lock).
    pub streams: Vec<Mutex<Option<Raw<sys::CUstream>>>>,
}

impl Peekable {
    pub fn new(devices: usize) -> Self {
        Peekable { allocs: BTreeMap::new(), ctxs: vec![None; devices], streams: (0..devices).map(|_| Mutex::new(None)).collect() }
    }

    /// Destroys the read stream of `device` (its context current, the write lock held).
    pub fn drop_stream(&mut self, device: u32) {
        if let Some(slot) = self.streams.get_mut(device as usize) {
            if let Some(s) = slot.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
                let _ = cu!(sys::cuStreamDestroy_v2(s.0));
            }
        }
    }
}

pub(super) struct CudaPeek(pub Arc<RwLock<Peekable>>);

impl CudaPeek {
    /// Copies `[at, at + buf.len())` of `device` into `buf`, if it lies in one live
    /// allocation (`alloc`: exactly that one, when given).
    fn read(&self, device: u32, alloc: Option<(u64, u64)>, at: u64, buf: &mut [u8]) -> bool {
        let p = self.0.read().unwrap_or_else(|e| e.into_inner());
        let len = buf.len() as u64;
        let inside = match alloc {
            Some((start, size)) => p.allocs.get(&start) == Some(&(device, size)) && at >= start && at.checked_add(len).is_some_and(|e| e <= start + size),
            None => p.allocs.range(..=at).next_back().is_some_and(|(&s, &(d, size))| d == device && at.checked_add(len).is_some_and(|e| e <= s + size)),
        };
        let Some(Some(ctx)) = p.ctxs.get(device as usize).copied() else { return false };
        if !inside || cu!(sys::cuCtxSetCurrent(ctx.0)).is_err() {
            return false;
        }
        let Some(slot) = p.streams.get(device as usize) else { return false };
        let mut stream = slot.lock().unwrap_or_else(|e| e.into_inner());
        if stream.is_none() {
            let mut s: sys::CUstream = std::ptr::null_mut();
            if cu!(sys::cuStreamCreateWithPriority(&mut s, STREAM_NON_BLOCKING, 0)).is_err() {
                return false;
            }
            *stream = Some(Raw(s));
        }
        let Some(s) = *stream else { return false };
        drop(stream);
        cu!(sys::cuMemcpyDtoHAsync_v2(buf.as_mut_ptr() as *mut c_void, at, buf.len(), s.0))
            .and_then(|()| cu!(sys::cuStreamSynchronize(s.0)))
            .is_ok()
    }
}

impl MemoryPeek for CudaPeek {
    fn peek(&self, device: u32, alloc: u64, size: u64, at: u64, buf: &mut [u8]) -> bool {
        self.read(device, Some((alloc, size)), at, buf)
    }

    fn with_held(&self, device: u32, at: u64, len: u64, f: &mut dyn FnMut(&[u8])) -> bool {
        let Ok(n) = usize::try_from(len) else { return false };
        let mut buf = vec![0u8; n];
        if !self.read(device, None, at, &mut buf) {
            return false;
        }
        f(&buf);
        true
    }
}
