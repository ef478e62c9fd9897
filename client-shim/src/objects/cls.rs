//! Context-local storage: cudart keeps its per-context state here, keyed by (context, key),
//! with a destructor the driver must run when the context is destroyed or a primary context
//! reset, or cudart keeps stale state after cudaDeviceReset. The export table that serves it
//! is `dark_api::cls`; the store is here so that context teardown runs the destructors.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use rgpu_cuda_types::*;

use super::context;

pub type Dtor = Option<unsafe extern "C" fn(CUcontext, *mut c_void, *mut c_void)>;

struct Entry {
    value: usize,
    dtor: Dtor,
}

#[derive(Default)]
pub struct Store {
    map: Mutex<HashMap<(u64, usize), Entry>>,
}

impl Store {
    pub fn put(&self, ctx: u64, key: usize, value: usize, dtor: Dtor) {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).insert((ctx, key), Entry { value, dtor });
    }

    pub fn delete(&self, ctx: u64, key: usize) {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).remove(&(ctx, key));
    }

    pub fn get(&self, ctx: u64, key: usize) -> Option<usize> {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).get(&(ctx, key)).map(|e| e.value)
    }

    /// Runs and drops every destructor registered on context `h`.
    pub fn run_destructors(&self, h: u64) {
        let entries: Vec<((u64, usize), Entry)> = {
            let mut m = self.map.lock().unwrap_or_else(|e| e.into_inner());
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
}
