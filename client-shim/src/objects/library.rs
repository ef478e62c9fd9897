//! Libraries (cuLibrary*) and their kernels (CUkernel): context-independent images. A library
//! is loaded on a device's server the first time something of it is used in a context there;
//! a kernel resolves to the CUfunction of its library's module on the device in use.

use std::collections::HashMap;
use std::ffi::CString;
use std::sync::{Arc, Mutex};

use rgpu_cuda_types::*;

use super::module::{self, Function, Module};
use super::{context, objects};
use crate::runtime;

pub struct Library {
    pub image: Vec<u8>,
    /// context -> (its device, module handle): each context has its own copy of the library
    /// (and of its globals), as on a real driver.
    pub modules: Mutex<HashMap<u64, (CUdevice, u64)>>,
    /// kernel name -> kernel handle
    pub kernels: Mutex<HashMap<String, u64>>,
    /// The context whose copy holds the library's `__managed__` variables, once one was asked
    /// for: CUDA has one copy of such a variable for every device, rgpu the module's copy in
    /// one context, so the library is not loaded into another (a second copy of the variable
    /// would silently differ from the first).
    pub managed_in: Mutex<Option<u64>>,
}

impl Library {
    pub fn new(image: Vec<u8>) -> Library {
        Library { image, modules: Mutex::new(HashMap::new()), kernels: Mutex::new(HashMap::new()), managed_in: Mutex::new(None) }
    }
}

pub struct Kernel {
    pub library: u64,
    pub name: CString,
}

pub fn get(h: CUlibrary) -> CuResult<(u64, Arc<Library>)> {
    let h = h as usize as u64;
    Ok((h, objects().libraries.get(h).ok_or(CuError::INVALID_HANDLE)?))
}

pub fn kernel(h: CUkernel) -> CuResult<Arc<Kernel>> {
    objects().kernels.get(h as usize as u64).ok_or(CuError::INVALID_HANDLE)
}

/// The library's module on `dev` in the current context (the device's primary context when the
/// current one is on another device, or none is current), loading it there on first use.
pub fn module_on(lib: &Library, dev: CUdevice) -> CuResult<u64> {
    let ctx = match context::current() {
        Ok((h, c)) if c.device == dev => h,
        _ => objects().primaries.handle(dev)?,
    };
    let mut mods = lib.modules.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&(_, m)) = mods.get(&ctx) {
        if objects().modules.get(m).is_some() {
            return Ok(m);
        }
    }
    if lib.managed_in.lock().unwrap_or_else(|e| e.into_inner()).is_some_and(|c| c != ctx) {
        tracing::warn!("a library with __managed__ variables is used in a second context or on a second device, which rgpu does not support");
        return Err(CuError::NOT_SUPPORTED);
    }
    let rt = runtime::get()?;
    let m = module::load_image(rt, dev, ctx, &lib.image)?;
    mods.insert(ctx, (dev, m));
    Ok(m)
}

/// The context and module that hold `lib`'s `__managed__` variables: the current context's,
/// or device 0's primary context when there is none (cudart asks for them when it loads the
/// library, before it has made a context).
pub fn managed_module(lib: &Library) -> CuResult<(CUdevice, u64)> {
    let dev = context::current_device().unwrap_or(0);
    let ctx = match context::current() {
        Ok((h, c)) if c.device == dev => h,
        _ => objects().primaries.handle(dev)?,
    };
    let mut held = lib.managed_in.lock().unwrap_or_else(|e| e.into_inner());
    if held.is_some_and(|c| c != ctx) {
        tracing::warn!("a library's __managed__ variables asked for in a second context, which rgpu does not support");
        return Err(CuError::NOT_SUPPORTED);
    }
    let m = module_on(lib, dev)?;
    *held = Some(ctx);
    Ok((dev, m))
}

/// The module of the library on the current context's device.
pub fn current_module(lib: &Library) -> CuResult<Arc<Module>> {
    let dev = context::current_device()?;
    let m = module_on(lib, dev)?;
    objects().modules.get(m).ok_or(CuError::INVALID_HANDLE)
}

/// Forgets the modules of a context that was torn down (they were unloaded with it); the next
/// use loads them again.
pub fn forget_context(ctx: u64) {
    let o = objects();
    for h in o.libraries.select(|_| true) {
        if let Some(lib) = o.libraries.get(h) {
            lib.modules.lock().unwrap_or_else(|e| e.into_inner()).retain(|c, _| *c != ctx);
        }
    }
}

/// Unloads a library: its modules in every context, and its kernels.
pub fn unload(h: u64) -> CuResult<()> {
    let rt = runtime::get()?;
    let o = objects();
    let lib = o.libraries.remove(h).ok_or(CuError::INVALID_HANDLE)?;
    for (_, (_, m)) in lib.modules.lock().unwrap_or_else(|e| e.into_inner()).drain() {
        // A module already gone with its context is not an error here.
        let _ = module::unload(rt, m);
    }
    for k in o.kernels.select(|k| k.library == h) {
        o.kernels.remove(k);
    }
    Ok(())
}

/// A new kernel handle of library `library`.
pub fn mint_kernel(library: u64, name: &str) -> u64 {
    objects().kernels.insert(Kernel { library, name: CString::new(name).unwrap_or_default() }).0
}

/// The function a kernel handle stands for on `dev`.
pub fn function_on(h: u64, dev: CUdevice) -> CuResult<u64> {
    let o = objects();
    let k = o.kernels.get(h).ok_or(CuError::INVALID_HANDLE)?;
    let lib = o.libraries.get(k.library).ok_or(CuError::INVALID_HANDLE)?;
    let m = o.modules.get(module_on(&lib, dev)?).ok_or(CuError::INVALID_HANDLE)?;
    let name = k.name.to_str().map_err(|_| CuError::NOT_FOUND)?;
    m.by_name.get(name).copied().ok_or(CuError::NOT_FOUND)
}

/// Resolves a CUfunction argument that may also be a CUkernel (cudart launches kernels through
/// cuLaunchKernel with the CUkernel cast).
pub fn resolve_function(f: CUfunction) -> CuResult<Arc<Function>> {
    let o = objects();
    let h = f as usize as u64;
    if let Some(func) = o.functions.get(h) {
        return Ok(func);
    }
    if o.kernels.get(h).is_some() {
        let dev = context::current_device()?;
        return o.functions.get(function_on(h, dev)?).ok_or(CuError::INVALID_HANDLE);
    }
    Err(CuError::INVALID_HANDLE)
}
