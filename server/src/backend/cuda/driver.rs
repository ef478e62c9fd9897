//! Finding and starting NVIDIA's driver library, and what it says about the
//! host's devices.
//!
//! cudarc (with `dynamic-loading`) opens the driver on its first call and
//! panics when the library or one of the symbols it looks up is missing.
//! [`preflight`] therefore opens the library cudarc will pick, the same way,
//! and checks every symbol this backend calls before cudarc is touched: a
//! host without a driver (or with one too old) gets an error, never a panic.

use std::ffi::{c_char, c_int, c_void, CStr};

use cudarc::driver::sys;
use thiserror::Error;

use crate::backend::DeviceInfo;
use rgpu_cuda_types::{CuError, CuResult};

/// Every driver function the cuda backend calls. All exist in drivers of
/// CUDA 12.4 and later (cuFuncGetParamInfo is the newest).
pub const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetUuid_v2",
    "cuDeviceTotalMem_v2",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxCreate_v2",
    "cuCtxDestroy_v2",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemGetInfo_v2",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemcpyHtoD_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemsetD8_v2",
    "cuMemsetD8Async",
    "cuMemsetD16Async",
    "cuMemsetD32Async",
    "cuMemsetD2D8Async",
    "cuMemsetD2D16Async",
    "cuMemsetD2D32Async",
    "cuStreamCreateWithPriority",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamQuery",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuEventQuery",
    "cuEventElapsedTime",
    "cuLibraryLoadData",
    "cuLibraryUnload",
    "cuLibraryGetKernel",
    "cuLibraryGetGlobal",
    "cuKernelGetFunction",
    "cuFuncGetParamInfo",
    "cuFuncGetAttribute",
    "cuLaunchKernel",
    "cuLaunchCooperativeKernel",
];

/// Why the cuda backend cannot start.
#[derive(Debug, Error)]
pub enum CudaInitError {
    #[error("no CUDA driver library found (tried {tried}); is the NVIDIA driver installed?")]
    NoLibrary { tried: String },
    #[error("the CUDA driver library {path} lacks {missing} (it needs a driver for CUDA 12.4 or later)")]
    MissingSymbols { path: String, missing: String },
    #[error("cuInit failed with {0} (driver library {1})")]
    Init(CuError, String),
    #[error("{what} failed with {err} (driver library {path})")]
    Query { what: &'static str, err: CuError, path: String },
    #[error("the CUDA driver ({path}) reports no devices")]
    NoDevice { path: String },
}

/// `CUresult` as a Rust result.
pub fn check(r: sys::CUresult) -> CuResult {
    let code = r as u32;
    match CuError::from_code(code) {
        None => Ok(()),
        Some(e) => Err(e),
    }
}

/// Runs a driver call (an `unsafe` expression returning `CUresult`) and
/// turns its result into a [`CuResult`].
macro_rules! cu {
    ($e:expr) => {
        $crate::backend::cuda::driver::check(
            // SAFETY: the caller passes valid pointers/handles of its own
            // objects; the symbol was checked to exist by `preflight`.
            #[allow(unused_unsafe)]
            unsafe {
                $e
            },
        )
    };
}
pub(crate) use cu;

/// The driver library cudarc is going to use, found and checked.
#[derive(Debug, Clone)]
pub struct DriverLibrary {
    /// The file the dynamic loader resolved it to.
    pub path: String,
}

/// Opens the library cudarc would open (its own candidate list, in its own
/// order) and checks that every [`REQUIRED_SYMBOLS`] entry is there.
pub fn preflight() -> Result<DriverLibrary, CudaInitError> {
    let candidates = cudarc::get_lib_name_candidates("cuda");
    for name in &candidates {
        // SAFETY: loading the driver runs its initialisers, exactly what
        // cudarc does on its first call anyway.
        let lib = match unsafe { libloading::Library::new(name) } {
            Ok(l) => l,
            Err(_) => continue,
        };
        let mut missing = Vec::new();
        let mut path = name.clone();
        for sym in REQUIRED_SYMBOLS {
            // SAFETY: only the address is read, never called through this type.
            match unsafe { lib.get::<*const c_void>(sym.as_bytes()) } {
                Ok(p) => {
                    if *sym == "cuInit" {
                        if let Some(p) = file_of(*p) {
                            path = p;
                        }
                    }
                }
                Err(_) => missing.push(*sym),
            }
        }
        if !missing.is_empty() {
            return Err(CudaInitError::MissingSymbols { path, missing: missing.join(", ") });
        }
        // Stays loaded for the life of the process (cudarc opens it again,
        // which only takes another reference).
        std::mem::forget(lib);
        return Ok(DriverLibrary { path });
    }
    Err(CudaInitError::NoLibrary { tried: candidates.join(", ") })
}

/// The file a loaded symbol lives in.
fn file_of(addr: *const c_void) -> Option<String> {
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the address and fills `info`.
    if unsafe { libc::dladdr(addr, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated string owned by the loader.
    Some(unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy().into_owned())
}

/// Highest `CUdevice_attribute` value asked for (CUDA 13.x defines fewer
/// than 160; unknown ones answer CUDA_ERROR_INVALID_VALUE and are skipped).
const MAX_ATTRIBUTE: u32 = 255;

/// `cuDeviceGetAttribute` with a plain integer attribute: cudarc types the
/// attribute as a Rust enum, which cannot hold values outside its list.
type GetAttributeFn = unsafe extern "C" fn(*mut c_int, u32, sys::CUdevice) -> u32;

/// Initialises the driver and describes every device. Called after
/// [`preflight`] succeeded.
pub fn init_and_list(lib: &DriverLibrary) -> Result<(Vec<DeviceInfo>, Vec<sys::CUdevice>), CudaInitError> {
    let path = lib.path.clone();
    let q = |what: &'static str, path: &str| {
        let path = path.to_string();
        move |err: CuError| CudaInitError::Query { what, err, path }
    };
    cu!(sys::cuInit(0)).map_err(|e| CudaInitError::Init(e, path.clone()))?;
    let mut version = 0;
    cu!(sys::cuDriverGetVersion(&mut version)).map_err(q("cuDriverGetVersion", &path))?;
    let mut count = 0;
    cu!(sys::cuDeviceGetCount(&mut count)).map_err(q("cuDeviceGetCount", &path))?;
    if count <= 0 {
        return Err(CudaInitError::NoDevice { path });
    }
    // SAFETY: preflight checked the symbol; the signature is cuda.h's with
    // the enum as its underlying integer.
    let get_attribute: GetAttributeFn = unsafe {
        *sys::culib()
            .get::<GetAttributeFn>(b"cuDeviceGetAttribute")
            .map_err(|_| CudaInitError::MissingSymbols { path: path.clone(), missing: "cuDeviceGetAttribute".into() })?
    };
    let mut infos = Vec::new();
    let mut handles = Vec::new();
    for ordinal in 0..count {
        let mut dev: sys::CUdevice = 0;
        cu!(sys::cuDeviceGet(&mut dev, ordinal)).map_err(q("cuDeviceGet", &path))?;
        let mut name = [0 as c_char; 256];
        cu!(sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int - 1, dev))
            .map_err(q("cuDeviceGetName", &path))?;
        // SAFETY: the buffer is NUL-terminated (zeroed, one byte held back).
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
        let mut uuid: sys::CUuuid = unsafe { std::mem::zeroed() };
        cu!(sys::cuDeviceGetUuid_v2(&mut uuid, dev)).map_err(q("cuDeviceGetUuid_v2", &path))?;
        let mut total: usize = 0;
        cu!(sys::cuDeviceTotalMem_v2(&mut total, dev)).map_err(q("cuDeviceTotalMem_v2", &path))?;
        let mut attributes = Vec::new();
        for a in 1..=MAX_ATTRIBUTE {
            let mut v: c_int = 0;
            // SAFETY: valid out-pointer; unknown attributes just fail.
            if unsafe { get_attribute(&mut v, a, dev) } == 0 {
                attributes.push((a, v));
            }
        }
        // This backend's sessions cannot share an event with each other
        // (BackendSession::ipc_export_event): say so, whatever the driver can.
        const IPC_EVENT_SUPPORTED: u32 = 125;
        for (a, v) in attributes.iter_mut() {
            if *a == IPC_EVENT_SUPPORTED {
                *v = 0;
            }
        }
        let attr = |id: u32| attributes.iter().find(|&&(a, _)| a == id).map_or(0, |&(_, v)| v);
        let info = DeviceInfo {
            ordinal: ordinal as u32,
            name,
            uuid: uuid.bytes.map(|b| b as u8),
            total_mem: total as u64,
            pci_domain: attr(ATTR_PCI_DOMAIN_ID),
            pci_bus: attr(ATTR_PCI_BUS_ID),
            pci_device: attr(ATTR_PCI_DEVICE_ID),
            attributes,
        };
        tracing::debug!(ordinal, name = %info.name, attributes = info.attributes.len(), driver = version, "cuda device");
        infos.push(info);
        handles.push(dev);
    }
    Ok((infos, handles))
}

const ATTR_PCI_BUS_ID: u32 = 33;
const ATTR_PCI_DEVICE_ID: u32 = 34;
const ATTR_PCI_DOMAIN_ID: u32 = 50;

#[cfg(test)]
mod tests {
    use super::REQUIRED_SYMBOLS;

    /// cudarc panics at the first call of a function the driver lacks: each one the backend
    /// calls must be checked by `preflight` first.
    #[test]
    fn every_driver_function_the_backend_calls_is_checked_at_start() {
        // Every file of the backend, so that a new one is covered too.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/backend/cuda");
        let sources: Vec<(String, String)> = std::fs::read_dir(&dir)
            .expect("the cuda backend's sources")
            .map(|e| e.expect("a directory entry").path())
            .filter(|p| p.extension().is_some_and(|x| x == "rs"))
            .map(|p| (p.display().to_string(), std::fs::read_to_string(&p).expect("a source file")))
            .collect();
        let mut seen = 0;
        for (file, src) in &sources {
            for (i, _) in src.match_indices("sys::cu") {
                let name: String = src[i + "sys::".len()..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                let called = src[i + "sys::".len() + name.len()..].starts_with('(');
                if !called || name == "culib" {
                    continue;
                }
                seen += 1;
                assert!(REQUIRED_SYMBOLS.contains(&name.as_str()), "{file} calls {name}, which preflight does not check");
            }
        }
        assert!(seen > 50, "found only {seen} driver calls: the scan is broken");
    }
}
