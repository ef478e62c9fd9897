//! Modules (cuModule*): loading images on the current context's device, and finding their
//! functions and globals. The objects, the image reader and the load itself are in
//! `objects::module`.

use std::ffi::{c_char, c_void, CStr};

use crate::cuda::types::*;
use crate::objects::module::{self as modules, image_bytes, load_image};
use crate::objects::context;
use crate::runtime;

unsafe fn load_bytes(module: &mut CUmodule, bytes: &[u8]) -> CuResult<()> {
    let rt = runtime::get()?;
    let (ctx, c) = context::current()?;
    *module = load_image(rt, c.device, ctx, bytes)? as usize as CUmodule;
    Ok(())
}

pub(crate) unsafe fn load_data(module: &mut CUmodule, image: *const c_void) -> CuResult<()> {
    let bytes = image_bytes(image)?;
    load_bytes(module, bytes)
}

pub(crate) unsafe fn load_data_ex(
    module: &mut CUmodule,
    image: *const c_void,
    _num_options: u32,
    _options: *mut CUjit_option,
    _values: *mut *mut c_void,
) -> CuResult<()> {
    // JIT options tune or report on compilation, which happens on the server.
    load_data(module, image)
}

pub(crate) unsafe fn load(module: &mut CUmodule, fname: *const c_char) -> CuResult<()> {
    if fname.is_null() {
        return Err(CuError::INVALID_VALUE);
    }
    let path = CStr::from_ptr(fname).to_str().map_err(|_| CuError::INVALID_VALUE)?;
    let bytes = std::fs::read(path).map_err(|_| CuError::FILE_NOT_FOUND)?;
    load_bytes(module, &bytes)
}

pub(crate) unsafe fn unload(m: CUmodule) -> CuResult<()> {
    modules::unload(runtime::get()?, m as usize as u64)
}

pub(crate) unsafe fn get_function(hfunc: &mut CUfunction, hmod: CUmodule, name: *const c_char) -> CuResult<()> {
    if name.is_null() {
        return Err(CuError::INVALID_VALUE);
    }
    let m = modules::get(hmod)?;
    let name = CStr::from_ptr(name).to_str().map_err(|_| CuError::NOT_FOUND)?;
    *hfunc = *m.by_name.get(name).ok_or(CuError::NOT_FOUND)? as usize as CUfunction;
    Ok(())
}

pub(crate) unsafe fn get_function_count(count: &mut u32, hmod: CUmodule) -> CuResult<()> {
    *count = modules::get(hmod)?.functions.len() as u32;
    Ok(())
}

pub(crate) unsafe fn enumerate_functions(out: *mut CUfunction, n: u32, hmod: CUmodule) -> CuResult<()> {
    let m = modules::get(hmod)?;
    if out.is_null() || (n as usize) < m.functions.len() {
        return Err(CuError::INVALID_VALUE);
    }
    for (i, f) in m.functions.iter().enumerate() {
        *out.add(i) = *f as usize as CUfunction;
    }
    Ok(())
}

pub(crate) unsafe fn get_global_v2(
    dptr: Option<&mut CUdeviceptr>,
    bytes: Option<&mut usize>,
    hmod: CUmodule,
    name: *const c_char,
) -> CuResult<()> {
    // cudart 12 finds a `__managed__` variable's address here, and host code uses it.
    let (ptr, size) = modules::get(hmod)?.global_for_host(runtime::get()?, name)?;
    if let Some(d) = dptr {
        *d = ptr;
    }
    if let Some(b) = bytes {
        *b = size as usize;
    }
    Ok(())
}

pub(crate) unsafe fn get_loading_mode(mode: &mut CUmoduleLoadingMode) -> CuResult<()> {
    // Lazy, as current drivers default to: cudart then loads each module on
    // the first use of one of its kernels or symbols.
    *mode = CUmoduleLoadingMode::CU_MODULE_LAZY_LOADING;
    Ok(())
}
