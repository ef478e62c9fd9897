//! User objects (cuUserObject*): reference-counted program objects whose destructor runs when
//! the last reference goes, references that graphs can own (cuGraphRetainUserObject), so
//! resources a graph uses live as long as the graph, its clones and its execs.

use std::sync::atomic::{AtomicU64, Ordering};

use rgpu_cuda_types::*;

use super::objects;

pub struct UserObject {
    refs: AtomicU64,
    /// The program's pointer and destructor (a CUhostFn), kept as addresses.
    ptr: usize,
    destroy: usize,
}

/// A new object with `initial` references.
pub fn create(ptr: usize, destroy: usize, initial: u32) -> CuResult<u64> {
    if initial == 0 || destroy == 0 {
        return Err(CuError::INVALID_VALUE);
    }
    let (h, _) = objects().user_objects.insert(UserObject { refs: AtomicU64::new(initial as u64), ptr, destroy });
    Ok(h)
}

pub fn retain(h: u64, n: u32) -> CuResult<()> {
    let o = objects().user_objects.get(h).ok_or(CuError::INVALID_HANDLE)?;
    if n == 0 {
        return Err(CuError::INVALID_VALUE);
    }
    o.refs.fetch_add(n as u64, Ordering::AcqRel);
    Ok(())
}

/// Drops `n` references; the last one runs the destructor (on this thread, with no lock held).
pub fn release(h: u64, n: u32) -> CuResult<()> {
    let o = objects().user_objects.get(h).ok_or(CuError::INVALID_HANDLE)?;
    if n == 0 {
        return Err(CuError::INVALID_VALUE);
    }
    let n = n as u64;
    let mut cur = o.refs.load(Ordering::Acquire);
    loop {
        if cur < n {
            // More released than held: the program's mistake, refused rather than run twice.
            return Err(CuError::INVALID_VALUE);
        }
        match o.refs.compare_exchange(cur, cur - n, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => break,
            Err(c) => cur = c,
        }
    }
    if cur == n {
        objects().user_objects.remove(h);
        // SAFETY: `destroy` is the CUhostFn the program gave for this object.
        let f: unsafe extern "C" fn(*mut std::ffi::c_void) = unsafe { std::mem::transmute(o.destroy) };
        unsafe { f(o.ptr as *mut std::ffi::c_void) };
    }
    Ok(())
}

/// References a graph (or its copy in a clone or an exec) owns: a copy owns as many again,
/// and dropping it releases them.
pub struct Held {
    pub handle: u64,
    pub count: u32,
}

impl Clone for Held {
    fn clone(&self) -> Self {
        if let Err(e) = retain(self.handle, self.count) {
            tracing::debug!("user object {:#x}: {e}", self.handle);
        }
        Held { handle: self.handle, count: self.count }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Err(e) = release(self.handle, self.count) {
            tracing::debug!("user object {:#x}: {e}", self.handle);
        }
    }
}
