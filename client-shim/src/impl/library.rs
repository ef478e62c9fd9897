//! Libraries (cuLibrary*): context-independent images. A library is loaded
//! on a device's server the first time something of it is used there; the
//! load on the current device happens at once, so a bad image fails
//! cuLibraryLoadData as it does on a real driver.

use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr};
use std::sync::{Arc, LazyLock, Mutex};

use crate::cuda::types::*;
use crate::handles::{tag, Table};
use crate::runtime;

use super::{context, kernel, module};

pub struct Library {
    pub image: Vec<u8>,
    /// context -> (its device, module handle): each context has its own
    /// copy of the library (and of its globals), as on a real driver.
    pub modules: Mutex<HashMap<u64, (CUdevice, u64)>>,
    /// kernel name -> kernel handle
    pub kernels: Mutex<HashMap<String, u64>>,
}

pub static LIBRARIES: LazyLock<Table<Library>> = LazyLock::new(|| Table::new(tag::LIBRARY));

pub fn get(h: CUlibrary) -> CuResult<(u64, Arc<Library>)> {
    let h = h as usize as u64;
    Ok((h, LIBRARIES.get(h).ok_or(CuError::INVALID_HANDLE)?))
}

/// The library's module on `dev` in the current context (the device's
/// primary context when the current one is on another device, or none is
/// current), loading it there on first use.
pub fn module_on(lib: &Library, dev: CUdevice) -> CuResult<u64> {
    let ctx = match context::current() {
        Ok((h, c)) if c.device == dev => h,
        _ => super::primary_context::handle(dev)?,
    };
    let mut mods = lib.modules.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&(_, m)) = mods.get(&ctx) {
        if module::MODULES.get(m).is_some() {
            return Ok(m);
        }
    }
    let rt = runtime::get()?;
    let m = module::load_image(rt, dev, ctx, &lib.image)?;
    mods.insert(ctx, (dev, m));
    Ok(m)
}

/// The module of the library on the current context's device.
pub fn current_module(lib: &Library) -> CuResult<Arc<module::Module>> {
    let dev = context::current_device()?;
    let m = module_on(lib, dev)?;
    module::MODULES.get(m).ok_or(CuError::INVALID_HANDLE)
}

/// Forgets the modules of a context that was torn down (they were unloaded
/// with it); the next use loads them again.
pub fn forget_context(ctx: u64) {
    for h in LIBRARIES.select(|_| true) {
        if let Some(lib) = LIBRARIES.get(h) {
            lib.modules.lock().unwrap_or_else(|e| e.into_inner()).retain(|c, _| *c != ctx);
        }
    }
}

#[allow(clippy::too_many_arguments)] // the driver API's signature
pub(crate) unsafe fn load_data(
    library: *mut CUlibrary,
    code: *const c_void,
    _jit_options: *mut CUjit_option,
    _jit_values: *mut *mut c_void,
    _num_jit: u32,
    _lib_options: *mut CUlibraryOption,
    _lib_values: *mut *mut c_void,
    _num_lib: u32,
) -> CuResult<()> {
    let library = library.as_mut().ok_or(CuError::INVALID_VALUE)?;
    let rt = runtime::get()?;
    let image = module::image_bytes(code)?.to_vec();
    let lib = Library { image, modules: Mutex::new(HashMap::new()), kernels: Mutex::new(HashMap::new()) };
    // Load where the program runs now (device 0 with no current context).
    let dev = context::current_device().unwrap_or(0);
    rt.device(dev)?;
    module_on(&lib, dev)?;
    let (h, _) = LIBRARIES.insert(lib);
    *library = h as usize as CUlibrary;
    Ok(())
}

#[allow(clippy::too_many_arguments)] // the driver API's signature
pub(crate) unsafe fn load_from_file(
    library: *mut CUlibrary,
    file: *const c_char,
    jit_options: *mut CUjit_option,
    jit_values: *mut *mut c_void,
    num_jit: u32,
    lib_options: *mut CUlibraryOption,
    lib_values: *mut *mut c_void,
    num_lib: u32,
) -> CuResult<()> {
    if file.is_null() {
        return Err(CuError::INVALID_VALUE);
    }
    let path = CStr::from_ptr(file).to_str().map_err(|_| CuError::INVALID_VALUE)?;
    let mut bytes = std::fs::read(path).map_err(|_| CuError::FILE_NOT_FOUND)?;
    // PTX files are text without a terminator; image_bytes reads to NUL.
    bytes.push(0);
    load_data(library, bytes.as_ptr() as *const c_void, jit_options, jit_values, num_jit, lib_options, lib_values, num_lib)
}

pub(crate) unsafe fn unload(library: CUlibrary) -> CuResult<()> {
    let rt = runtime::get()?;
    let h = library as usize as u64;
    let lib = LIBRARIES.remove(h).ok_or(CuError::INVALID_HANDLE)?;
    for (_, (_, m)) in lib.modules.lock().unwrap_or_else(|e| e.into_inner()).drain() {
        // A module already gone with its context is not an error here.
        let _ = module::unload_handle(rt, m);
    }
    kernel::forget_library(h);
    Ok(())
}

pub(crate) unsafe fn get_kernel(out: *mut CUkernel, library: CUlibrary, name: *const c_char) -> CuResult<()> {
    let out = out.as_mut().ok_or(CuError::INVALID_VALUE)?;
    if name.is_null() {
        return Err(CuError::INVALID_VALUE);
    }
    let (lh, lib) = get(library)?;
    let name = CStr::from_ptr(name).to_str().map_err(|_| CuError::NOT_FOUND)?;
    let mut kernels = lib.kernels.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&k) = kernels.get(name) {
        *out = k as usize as CUkernel;
        return Ok(());
    }
    let dev = context::current_device().unwrap_or(0);
    let m = module::MODULES.get(module_on(&lib, dev)?).ok_or(CuError::INVALID_HANDLE)?;
    if !m.by_name.contains_key(name) {
        return Err(CuError::NOT_FOUND);
    }
    let k = kernel::mint(lh, name);
    kernels.insert(name.to_string(), k);
    *out = k as usize as CUkernel;
    Ok(())
}

pub(crate) unsafe fn get_kernel_count(count: *mut u32, library: CUlibrary) -> CuResult<()> {
    let count = count.as_mut().ok_or(CuError::INVALID_VALUE)?;
    let (_, lib) = get(library)?;
    *count = current_module(&lib)?.functions.len() as u32;
    Ok(())
}

pub(crate) unsafe fn enumerate_kernels(out: *mut CUkernel, n: u32, library: CUlibrary) -> CuResult<()> {
    let (lh, lib) = get(library)?;
    let m = current_module(&lib)?;
    if out.is_null() || (n as usize) < m.functions.len() {
        return Err(CuError::INVALID_VALUE);
    }
    let mut kernels = lib.kernels.lock().unwrap_or_else(|e| e.into_inner());
    for (i, fh) in m.functions.iter().enumerate() {
        let f = module::FUNCTIONS.get(*fh).ok_or(CuError::INVALID_HANDLE)?;
        let name = f.name.to_string_lossy().into_owned();
        let k = *kernels.entry(name.clone()).or_insert_with(|| kernel::mint(lh, &name));
        *out.add(i) = k as usize as CUkernel;
    }
    Ok(())
}

pub(crate) unsafe fn get_module(out: *mut CUmodule, library: CUlibrary) -> CuResult<()> {
    let out = out.as_mut().ok_or(CuError::INVALID_VALUE)?;
    let (_, lib) = get(library)?;
    let dev = context::current_device()?;
    *out = module_on(&lib, dev)? as usize as CUmodule;
    Ok(())
}

pub(crate) unsafe fn get_global(dptr: *mut CUdeviceptr, bytes: *mut usize, library: CUlibrary, name: *const c_char) -> CuResult<()> {
    let (_, lib) = get(library)?;
    let dev = context::current_device()?;
    let m = module_on(&lib, dev)?;
    module::get_global_v2(dptr, bytes, m as usize as CUmodule, name)
}
