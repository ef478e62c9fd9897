//! Loaded module images, shared by every session: an image is loaded once
//! with `cuLibraryLoadData` (a context-independent library) and found again
//! by its content, so a second client, or a program loading the same module
//! again, does not make the driver load (and JIT) it again. Each context
//! still gets its own copy of the library's globals.
//!
//! Parameter layouts (`cuFuncGetParamInfo`) and function attributes are
//! cached with the library, per device.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::ffi::CString;
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use tracing::{debug, warn};

use super::driver::cu;
use crate::backend::FunctionInfo;
use rgpu_cuda_types::{CuError, CuResult};

/// Libraries no session uses that are kept for a later load.
const MAX_IDLE: usize = 32;

/// `CUlibrary`/`CUkernel` are plain handles the driver lets any thread use.
#[derive(Debug, Clone, Copy)]
struct Handle<T>(T);
// SAFETY: driver handles are opaque tokens, valid from any thread.
unsafe impl<T> Send for Handle<T> {}
unsafe impl<T> Sync for Handle<T> {}

pub struct Library {
    pub id: u64,
    lib: Handle<sys::CUlibrary>,
    image: Vec<u8>,
    kernels: Mutex<HashMap<String, Handle<sys::CUkernel>>>,
    /// (device, kernel name) -> what `ModuleLoaded` reports for it.
    infos: Mutex<HashMap<(u32, String), FunctionInfo>>,
    /// Not in the cache (a second load of one image by one session):
    /// unloaded as soon as it is released.
    private: bool,
}

impl Library {
    pub fn raw(&self) -> sys::CUlibrary {
        self.lib.0
    }

    /// The library's kernel `name` (context-independent).
    pub fn kernel(&self, name: &str) -> CuResult<sys::CUkernel> {
        let mut ks = self.kernels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = ks.get(name) {
            return Ok(k.0);
        }
        let c = CString::new(name).map_err(|_| CuError::NOT_FOUND)?;
        let mut k: sys::CUkernel = std::ptr::null_mut();
        cu!(sys::cuLibraryGetKernel(&mut k, self.lib.0, c.as_ptr()))?;
        ks.insert(name.to_string(), Handle(k));
        Ok(k)
    }

    /// Parameter layout and attributes of `name` on `device`, asked of the
    /// driver once (through `func`, the kernel's function in the current
    /// context) and cached.
    pub(crate) fn function_info(&self, device: u32, name: &str, func: sys::CUfunction) -> CuResult<FunctionInfo> {
        let key = (device, name.to_string());
        if let Some(i) = self.infos.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(i.clone());
        }
        let mut params = Vec::new();
        loop {
            let (mut off, mut size) = (0usize, 0usize);
            match cu!(sys::cuFuncGetParamInfo(func, params.len(), &mut off, &mut size)) {
                Ok(()) => {
                    let o = u32::try_from(off).map_err(|_| CuError::INVALID_IMAGE)?;
                    let s = u32::try_from(size).map_err(|_| CuError::INVALID_IMAGE)?;
                    params.push((o, s));
                }
                // Past the last parameter.
                Err(e) if e == CuError::INVALID_VALUE => break,
                Err(e) => return Err(e),
            }
            if params.len() > 4096 {
                return Err(CuError::INVALID_IMAGE);
            }
        }
        use sys::CUfunction_attribute as A;
        let attr = |a: A| -> CuResult<i32> {
            let mut v = 0;
            cu!(sys::cuFuncGetAttribute(&mut v, a, func))?;
            Ok(v)
        };
        let info = FunctionInfo {
            name: name.to_string(),
            params,
            max_threads_per_block: attr(A::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
            shared_size_bytes: attr(A::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)?,
            const_size_bytes: attr(A::CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES)?,
            local_size_bytes: attr(A::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)?,
            num_regs: attr(A::CU_FUNC_ATTRIBUTE_NUM_REGS)?,
            ptx_version: attr(A::CU_FUNC_ATTRIBUTE_PTX_VERSION)?,
            binary_version: attr(A::CU_FUNC_ATTRIBUTE_BINARY_VERSION)?,
            launch_note: String::new(),
        };
        self.infos.lock().unwrap_or_else(|e| e.into_inner()).insert(key, info.clone());
        Ok(info)
    }
}

struct Slot {
    hash: u64,
    lib: Arc<Library>,
    refs: usize,
    last_used: u64,
}

/// The server's loaded libraries, by content.
pub struct LibraryCache {
    slots: Vec<Slot>,
    hasher: RandomState,
    next_id: u64,
    tick: u64,
}

impl Default for LibraryCache {
    fn default() -> Self {
        LibraryCache { slots: Vec::new(), hasher: RandomState::new(), next_id: 1, tick: 0 }
    }
}

/// The bytes to hand the driver: PTX text must end with a NUL, which a
/// client may not have sent.
fn driver_image(image: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    let binary = image.starts_with(b"\x7fELF")
        || image.starts_with(&0xBA55ED50u32.to_le_bytes())
        || image.starts_with(&0x466243B1u32.to_le_bytes());
    if binary || image.last() == Some(&0) {
        std::borrow::Cow::Borrowed(image)
    } else {
        let mut v = image.to_vec();
        v.push(0);
        std::borrow::Cow::Owned(v)
    }
}

fn load(image: &[u8], id: u64, private: bool) -> CuResult<Library> {
    let bytes = driver_image(image);
    let mut lib: sys::CUlibrary = std::ptr::null_mut();
    cu!(sys::cuLibraryLoadData(
        &mut lib,
        bytes.as_ptr() as *const std::ffi::c_void,
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        0,
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        0,
    ))?;
    debug!(library = id, len = image.len(), private, "library loaded by the driver");
    Ok(Library {
        id,
        lib: Handle(lib),
        image: image.to_vec(),
        kernels: Mutex::new(HashMap::new()),
        infos: Mutex::new(HashMap::new()),
        private,
    })
}

fn unload(lib: &Library) {
    if let Err(e) = cu!(sys::cuLibraryUnload(lib.lib.0)) {
        warn!(library = lib.id, "cuLibraryUnload failed: {e}");
    }
}

impl LibraryCache {
    /// The library of `image`: the cached one when the same bytes were
    /// loaded before, else a fresh load. `exclude` are libraries the caller
    /// already holds: one of those is not handed out again, a private copy
    /// is loaded instead (each load has its own globals).
    pub fn acquire(&mut self, image: &[u8], exclude: &[u64]) -> CuResult<Arc<Library>> {
        self.tick += 1;
        let hash = self.hasher.hash_one(image);
        if let Some(s) = self.slots.iter_mut().find(|s| s.hash == hash && s.lib.image == image) {
            if !exclude.contains(&s.lib.id) {
                s.refs += 1;
                s.last_used = self.tick;
                debug!(library = s.lib.id, "library cache hit");
                return Ok(s.lib.clone());
            }
            let id = self.next_id;
            self.next_id += 1;
            return load(image, id, true).map(Arc::new);
        }
        let id = self.next_id;
        self.next_id += 1;
        let lib = Arc::new(load(image, id, false)?);
        self.slots.push(Slot { hash, lib: lib.clone(), refs: 1, last_used: self.tick });
        self.evict();
        Ok(lib)
    }

    /// Gives back one reference taken by [`acquire`](Self::acquire).
    pub fn release(&mut self, lib: &Arc<Library>) {
        self.tick += 1;
        if lib.private {
            unload(lib);
            return;
        }
        if let Some(s) = self.slots.iter_mut().find(|s| Arc::ptr_eq(&s.lib, lib)) {
            s.refs = s.refs.saturating_sub(1);
            s.last_used = self.tick;
        }
        self.evict();
    }

    /// Unloads the least recently used idle libraries beyond [`MAX_IDLE`].
    fn evict(&mut self) {
        loop {
            let idle = self.slots.iter().filter(|s| s.refs == 0).count();
            if idle <= MAX_IDLE {
                return;
            }
            let Some(i) = (0..self.slots.len())
                .filter(|&i| self.slots[i].refs == 0)
                .min_by_key(|&i| self.slots[i].last_used)
            else {
                return;
            };
            let s = self.slots.swap_remove(i);
            unload(&s.lib);
        }
    }

    /// Unloads everything (server shutdown).
    pub fn clear(&mut self) {
        for s in self.slots.drain(..) {
            unload(&s.lib);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.slots.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_gets_a_terminator_binaries_do_not() {
        assert_eq!(&*driver_image(b".version 9.5"), b".version 9.5\0");
        assert_eq!(&*driver_image(b".version 9.5\0"), b".version 9.5\0");
        assert_eq!(&*driver_image(b"\x7fELF\x02"), b"\x7fELF\x02");
        assert_eq!(LibraryCache::default().len(), 0);
    }
}
