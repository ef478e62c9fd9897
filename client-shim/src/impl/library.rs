//! Libraries (cuLibrary*): context-independent images. A library is loaded on a device's
//! server the first time something of it is used there; the load on the current device happens
//! at once, so a bad image fails cuLibraryLoadData as it does on a real driver. The objects
//! (libraries, their per-context modules, their kernels) are in `objects::library`.

use std::ffi::{c_char, c_void, CStr};

use crate::cuda::types::*;
use crate::objects::library::{self as libraries, current_module, mint_kernel, module_on, Library};
use crate::objects::module::{self as modules, image_bytes};
use crate::objects::{context, objects};
use crate::runtime;

#[allow(clippy::too_many_arguments)] // the driver API's signature
pub(crate) unsafe fn load_data(
    library: &mut CUlibrary,
    code: *const c_void,
    _jit_options: *mut CUjit_option,
    _jit_values: *mut *mut c_void,
    _num_jit: u32,
    _lib_options: *mut CUlibraryOption,
    _lib_values: *mut *mut c_void,
    _num_lib: u32,
) -> CuResult<()> {
    let rt = runtime::get()?;
    let lib = Library::new(image_bytes(code)?.to_vec());
    // Load where the program runs now (device 0 with no current context).
    let dev = context::current_device().unwrap_or(0);
    rt.device(dev)?;
    module_on(&lib, dev)?;
    let (h, _) = objects().libraries.insert(lib);
    *library = h as usize as CUlibrary;
    Ok(())
}

#[allow(clippy::too_many_arguments)] // the driver API's signature
pub(crate) unsafe fn load_from_file(
    library: &mut CUlibrary,
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
    libraries::unload(library as usize as u64)
}

pub(crate) unsafe fn get_kernel(out: &mut CUkernel, library: CUlibrary, name: *const c_char) -> CuResult<()> {
    if name.is_null() {
        return Err(CuError::INVALID_VALUE);
    }
    let (lh, lib) = libraries::get(library)?;
    let name = CStr::from_ptr(name).to_str().map_err(|_| CuError::NOT_FOUND)?;
    let mut kernels = lib.kernels.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&k) = kernels.get(name) {
        *out = k as usize as CUkernel;
        return Ok(());
    }
    let dev = context::current_device().unwrap_or(0);
    let m = objects().modules.get(module_on(&lib, dev)?).ok_or(CuError::INVALID_HANDLE)?;
    if !m.by_name.contains_key(name) {
        return Err(CuError::NOT_FOUND);
    }
    let k = mint_kernel(lh, name);
    kernels.insert(name.to_string(), k);
    *out = k as usize as CUkernel;
    Ok(())
}

pub(crate) unsafe fn get_kernel_count(count: &mut u32, library: CUlibrary) -> CuResult<()> {
    let (_, lib) = libraries::get(library)?;
    *count = current_module(&lib)?.functions.len() as u32;
    Ok(())
}

pub(crate) unsafe fn enumerate_kernels(out: *mut CUkernel, n: u32, library: CUlibrary) -> CuResult<()> {
    let (lh, lib) = libraries::get(library)?;
    let m = current_module(&lib)?;
    if out.is_null() || (n as usize) < m.functions.len() {
        return Err(CuError::INVALID_VALUE);
    }
    let mut kernels = lib.kernels.lock().unwrap_or_else(|e| e.into_inner());
    for (i, fh) in m.functions.iter().enumerate() {
        let f = objects().functions.get(*fh).ok_or(CuError::INVALID_HANDLE)?;
        let name = f.name.to_string_lossy().into_owned();
        let k = *kernels.entry(name.clone()).or_insert_with(|| mint_kernel(lh, &name));
        *out.add(i) = k as usize as CUkernel;
    }
    Ok(())
}

pub(crate) unsafe fn get_module(out: &mut CUmodule, library: CUlibrary) -> CuResult<()> {
    let (_, lib) = libraries::get(library)?;
    let dev = context::current_device()?;
    *out = module_on(&lib, dev)? as usize as CUmodule;
    Ok(())
}

/// A `__managed__` variable of the library: the module's storage for it, made managed memory
/// (`objects::managed::adopt_global`), so that host code and kernels share it at one address
/// under the managed-memory rules. cudart asks for each such variable when it loads the
/// library, and host code reaches the variable through the pointer answered here.
pub(crate) unsafe fn get_managed(dptr: Option<&mut CUdeviceptr>, bytes: Option<&mut usize>, library: CUlibrary, name: *const c_char) -> CuResult<()> {
    let rt = runtime::get()?;
    let (_, lib) = libraries::get(library)?;
    let (_, m) = libraries::managed_module(&lib)?;
    let module = modules::get(m as usize as CUmodule)?;
    let (ptr, size) = module.global_for_host(rt, name)?;
    if !module.managed.contains(CStr::from_ptr(name).to_str().map_err(|_| CuError::NOT_FOUND)?) {
        // A global that is not `__managed__`: cuLibraryGetGlobal's.
        return Err(CuError::NOT_FOUND);
    }
    if let Some(d) = dptr {
        *d = ptr;
    }
    if let Some(b) = bytes {
        *b = size as usize;
    }
    Ok(())
}

pub(crate) unsafe fn get_global(
    dptr: Option<&mut CUdeviceptr>,
    bytes: Option<&mut usize>,
    library: CUlibrary,
    name: *const c_char,
) -> CuResult<()> {
    let (_, lib) = libraries::get(library)?;
    let dev = context::current_device()?;
    let (ptr, size) = modules::get(module_on(&lib, dev)? as usize as CUmodule)?.global(name)?;
    if let Some(d) = dptr {
        *d = ptr;
    }
    if let Some(b) = bytes {
        *b = size as usize;
    }
    Ok(())
}
