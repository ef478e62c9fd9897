//! Context-local storage: cudart keeps its per-context state here, keyed by
//! (context, key), with a destructor the driver must run when the context is
//! destroyed or a primary context reset, or cudart keeps stale state after
//! cudaDeviceReset.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{LazyLock, Mutex};

use crate::cuda::types::*;
use crate::r#impl::context;

type Dtor = Option<unsafe extern "C" fn(CUcontext, *mut c_void, *mut c_void)>;

struct Entry {
    value: usize,
    dtor: Dtor,
}

static STORE: LazyLock<Mutex<HashMap<(u64, usize), Entry>>> = LazyLock::new(|| Mutex::new(HashMap::new()));

fn ctx_handle(ctx: CUcontext) -> CuResult<u64> {
    Ok(context::resolve(ctx)?.0)
}

pub(super) unsafe extern "C" fn put(ctx: CUcontext, key: *mut c_void, value: *mut c_void, dtor: Dtor) -> CUresult {
    crate::entry::call("CONTEXT_LOCAL_STORAGE[0]", || {
        let h = ctx_handle(ctx)?;
        STORE
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((h, key as usize), Entry { value: value as usize, dtor });
        Ok(())
    })
}

pub(super) unsafe extern "C" fn delete(ctx: CUcontext, key: *mut c_void) -> CUresult {
    crate::entry::call("CONTEXT_LOCAL_STORAGE[1]", || {
        let h = ctx_handle(ctx)?;
        STORE.lock().unwrap_or_else(|e| e.into_inner()).remove(&(h, key as usize));
        Ok(())
    })
}

pub(super) unsafe extern "C" fn get(value: *mut *mut c_void, ctx: CUcontext, key: *mut c_void) -> CUresult {
    crate::entry::call("CONTEXT_LOCAL_STORAGE[2]", || {
        let value = value.as_mut().ok_or(CuError::INVALID_VALUE)?;
        let h = ctx_handle(ctx)?;
        let m = STORE.lock().unwrap_or_else(|e| e.into_inner());
        let e = m.get(&(h, key as usize)).ok_or(CuError::INVALID_HANDLE)?;
        *value = e.value as *mut c_void;
        Ok(())
    })
}

/// Runs and drops every destructor registered on context `h`.
pub fn run_destructors(h: u64) {
    let entries: Vec<((u64, usize), Entry)> = {
        let mut m = STORE.lock().unwrap_or_else(|e| e.into_inner());
        let keys: Vec<(u64, usize)> = m.keys().filter(|(c, _)| *c == h).copied().collect();
        keys.into_iter().filter_map(|k| m.remove(&k).map(|e| (k, e))).collect()
    };
    // Outside the lock: a destructor may call back into the store.
    for ((_, key), e) in entries {
        if let Some(d) = e.dtor {
            unsafe { d(context::from_handle(h), key as *mut c_void, e.value as *mut c_void) };
        }
    }
}
