//! rgpu's `libnvidia-ml.so.1`: NVML for client hosts, showing the remote GPUs this process may
//! use (`RGPU_SERVERS`, narrowed to its lease's GPUs by `RGPU_TOKEN`, in the order the shim
//! numbers them as CUDA devices), so that pynvml, monitoring agents and job launchers that
//! count GPUs through NVML see what CUDA will see.
//!
//! What rgpu does not know about a device is `NVML_ERROR_NOT_SUPPORTED`, never a made-up
//! value: utilization, temperature, power, serial numbers, processes, and memory use (a
//! device's free and used bytes need a session on its server; the total alone is not an
//! `nvmlMemory_t`), NVLink and fabric state. Some clients resolve a fixed list of functions
//! at once and stop at the first one missing (PyTorch's c10 asserts on each of its seven), so
//! every query they name is exported, answering `NVML_ERROR_NOT_SUPPORTED` where rgpu has no
//! answer. Other functions NVML has and this library lacks are not exported.

use std::ffi::{c_char, c_int, c_uint, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

use rgpu_control_client::{parse_pci_bus_id, uuid_text, RemoteDevice};
use rgpu_cuda_types::CUdevice_attribute as A;

/// `nvmlReturn_t`.
pub type NvmlReturn = c_uint;
pub const NVML_SUCCESS: NvmlReturn = 0;
pub const NVML_ERROR_UNINITIALIZED: NvmlReturn = 1;
pub const NVML_ERROR_INVALID_ARGUMENT: NvmlReturn = 2;
pub const NVML_ERROR_NOT_SUPPORTED: NvmlReturn = 3;
pub const NVML_ERROR_NOT_FOUND: NvmlReturn = 6;
pub const NVML_ERROR_INSUFFICIENT_SIZE: NvmlReturn = 7;
pub const NVML_ERROR_DRIVER_NOT_LOADED: NvmlReturn = 9;
pub const NVML_ERROR_UNKNOWN: NvmlReturn = 999;

/// `nvmlDevice_t`: an opaque pointer; ours is a tagged index, never dereferenced.
pub type NvmlDevice = *mut std::ffi::c_void;
const HANDLE_TAG: usize = 0x4e56 << 32;

/// `nvmlPciInfo_t` (NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE = 32, the legacy id 16).
#[repr(C)]
pub struct NvmlPciInfo {
    pub bus_id_legacy: [c_char; 16],
    pub domain: c_uint,
    pub bus: c_uint,
    pub device: c_uint,
    pub pci_device_id: c_uint,
    pub pci_sub_system_id: c_uint,
    pub bus_id: [c_char; 32],
}

/// The CUDA driver version rgpu's shim reports.
const CUDA_DRIVER_VERSION: c_int = 13050;
/// What `nvmlSystemGetDriverVersion` says: the version of NVIDIA's driver behind the shim is a
/// server's, so this names rgpu instead of pretending to be one.
const DRIVER_VERSION: &str = concat!("rgpu-", env!("CARGO_PKG_VERSION"));
const NVML_VERSION: &str = concat!("13.rgpu-", env!("CARGO_PKG_VERSION"));

struct State {
    /// nvmlInit calls not yet matched by nvmlShutdown.
    refs: u32,
    devices: Vec<RemoteDevice>,
}

static STATE: Mutex<State> = Mutex::new(State { refs: 0, devices: Vec::new() });

fn state() -> std::sync::MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs an entry point: its error as the return code, a panic as NVML_ERROR_UNKNOWN (no Rust
/// panic may unwind into a C caller).
fn entry(f: impl FnOnce() -> Result<(), NvmlReturn>) -> NvmlReturn {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => NVML_SUCCESS,
        Ok(Err(e)) => e,
        Err(_) => NVML_ERROR_UNKNOWN,
    }
}

/// The devices of every server in `RGPU_SERVERS`, as the shim would number them.
fn discover() -> Result<Vec<RemoteDevice>, NvmlReturn> {
    let list = std::env::var("RGPU_SERVERS").unwrap_or_default();
    let addrs: Vec<&str> = list.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    if addrs.is_empty() {
        eprintln!("rgpu NVML: no GPU server configured: set RGPU_SERVERS or run under `rgpu run`");
        return Err(NVML_ERROR_DRIVER_NOT_LOADED);
    }
    let name = format!("nvml (pid {})", std::process::id());
    // The shim's rule (RGPU_TLS_CA / RGPU_PLAINTEXT), so both see the same servers.
    let security = match rgpu_control_client::ClientSecurity::from_env() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("rgpu NVML: {e}");
            return Err(NVML_ERROR_DRIVER_NOT_LOADED);
        }
    };
    let mut devices = Vec::new();
    for addr in addrs {
        match rgpu_control_client::inventory(addr, &name, &security) {
            Ok(inv) => devices.extend(inv.devices),
            Err(e) => {
                eprintln!("rgpu NVML: {e}");
                return Err(NVML_ERROR_DRIVER_NOT_LOADED);
            }
        }
    }
    Ok(devices)
}

fn with_device<R>(dev: NvmlDevice, f: impl FnOnce(usize, &RemoteDevice) -> Result<R, NvmlReturn>) -> Result<R, NvmlReturn> {
    let st = state();
    if st.refs == 0 {
        return Err(NVML_ERROR_UNINITIALIZED);
    }
    let h = dev as usize;
    if h & !0xffff_ffff != HANDLE_TAG || h & 0xffff_ffff == 0 {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    let i = (h & 0xffff_ffff) - 1;
    let d = st.devices.get(i).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    f(i, d)
}

fn handle(i: usize) -> NvmlDevice {
    (HANDLE_TAG | (i + 1)) as NvmlDevice
}

/// Writes `s` NUL-terminated into `buf` of `len` bytes.
unsafe fn write_str(buf: *mut c_char, len: c_uint, s: &str) -> Result<(), NvmlReturn> {
    if buf.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    if s.len() + 1 > len as usize {
        return Err(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    std::ptr::copy_nonoverlapping(s.as_ptr() as *const c_char, buf, s.len());
    *buf.add(s.len()) = 0;
    Ok(())
}

unsafe fn out<'a, T>(p: *mut T) -> Result<&'a mut T, NvmlReturn> {
    p.as_mut().ok_or(NVML_ERROR_INVALID_ARGUMENT)
}


fn bus_id(d: &RemoteDevice) -> String {
    format!("{:08X}:{:02X}:{:02X}.0", d.pci.0, d.pci.1, d.pci.2)
}

fn attribute(d: &RemoteDevice, a: A) -> Option<i32> {
    d.attributes.iter().find(|(id, _)| *id == a.0).map(|&(_, v)| v)
}

// ---- initialisation ---------------------------------------------------------------------------

#[no_mangle]
pub extern "C" fn nvmlInit_v2() -> NvmlReturn {
    entry(|| {
        let mut st = state();
        if st.refs == 0 {
            st.devices = discover()?;
        }
        st.refs += 1;
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn nvmlInit() -> NvmlReturn {
    nvmlInit_v2()
}

#[no_mangle]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> NvmlReturn {
    // The flags (no GPUs, no attach) ask for less than this library does at init.
    nvmlInit_v2()
}

#[no_mangle]
pub extern "C" fn nvmlShutdown() -> NvmlReturn {
    entry(|| {
        let mut st = state();
        if st.refs == 0 {
            return Err(NVML_ERROR_UNINITIALIZED);
        }
        st.refs -= 1;
        if st.refs == 0 {
            st.devices.clear();
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn nvmlErrorString(result: NvmlReturn) -> *const c_char {
    let s: &'static CStr = match result {
        NVML_SUCCESS => c"Success",
        NVML_ERROR_UNINITIALIZED => c"Uninitialized",
        NVML_ERROR_INVALID_ARGUMENT => c"Invalid Argument",
        NVML_ERROR_NOT_SUPPORTED => c"Not Supported",
        NVML_ERROR_NOT_FOUND => c"Not Found",
        NVML_ERROR_INSUFFICIENT_SIZE => c"Insufficient Size",
        NVML_ERROR_DRIVER_NOT_LOADED => c"Driver Not Loaded",
        _ => c"Unknown Error",
    };
    s.as_ptr()
}

// ---- system -----------------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint) -> NvmlReturn {
    entry(|| write_str(version, length, DRIVER_VERSION))
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(version: *mut c_char, length: c_uint) -> NvmlReturn {
    entry(|| write_str(version, length, NVML_VERSION))
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(v: *mut c_int) -> NvmlReturn {
    entry(|| {
        *out(v)? = CUDA_DRIVER_VERSION;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(v: *mut c_int) -> NvmlReturn {
    nvmlSystemGetCudaDriverVersion(v)
}

// ---- devices ----------------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> NvmlReturn {
    entry(|| {
        let st = state();
        if st.refs == 0 {
            return Err(NVML_ERROR_UNINITIALIZED);
        }
        *out(count)? = st.devices.len() as c_uint;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCount(count: *mut c_uint) -> NvmlReturn {
    nvmlDeviceGetCount_v2(count)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(index: c_uint, dev: *mut NvmlDevice) -> NvmlReturn {
    entry(|| {
        let st = state();
        if st.refs == 0 {
            return Err(NVML_ERROR_UNINITIALIZED);
        }
        if index as usize >= st.devices.len() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        *out(dev)? = handle(index as usize);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex(index: c_uint, dev: *mut NvmlDevice) -> NvmlReturn {
    nvmlDeviceGetHandleByIndex_v2(index, dev)
}

/// Finds a device by a text key (UUID or PCI bus id).
unsafe fn handle_by(key: *const c_char, dev: *mut NvmlDevice, matches: impl Fn(&RemoteDevice, &str) -> bool) -> NvmlReturn {
    entry(|| {
        if key.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let key = CStr::from_ptr(key).to_str().map_err(|_| NVML_ERROR_INVALID_ARGUMENT)?;
        let st = state();
        if st.refs == 0 {
            return Err(NVML_ERROR_UNINITIALIZED);
        }
        let i = st.devices.iter().position(|d| matches(d, key)).ok_or(NVML_ERROR_NOT_FOUND)?;
        *out(dev)? = handle(i);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(uuid: *const c_char, dev: *mut NvmlDevice) -> NvmlReturn {
    handle_by(uuid, dev, |d, k| uuid_text(&d.uuid).eq_ignore_ascii_case(k))
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId_v2(id: *const c_char, dev: *mut NvmlDevice) -> NvmlReturn {
    // Ids come with an 8- or 4-digit domain; compare the numbers.
    handle_by(id, dev, |d, k| parse_pci_bus_id(k) == Some(d.pci))
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId(id: *const c_char, dev: *mut NvmlDevice) -> NvmlReturn {
    nvmlDeviceGetHandleByPciBusId_v2(id, dev)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetIndex(dev: NvmlDevice, index: *mut c_uint) -> NvmlReturn {
    entry(|| with_device(dev, |i, _| {
        *out(index)? = i as c_uint;
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetName(dev: NvmlDevice, name: *mut c_char, length: c_uint) -> NvmlReturn {
    entry(|| with_device(dev, |_, d| write_str(name, length, &d.name)))
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUUID(dev: NvmlDevice, uuid: *mut c_char, length: c_uint) -> NvmlReturn {
    entry(|| with_device(dev, |_, d| write_str(uuid, length, &uuid_text(&d.uuid))))
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(dev: NvmlDevice, pci: *mut NvmlPciInfo) -> NvmlReturn {
    entry(|| with_device(dev, |_, d| {
        let p = out(pci)?;
        let id = bus_id(d);
        let legacy = format!("{:04X}:{:02X}:{:02X}.0", d.pci.0 & 0xffff, d.pci.1, d.pci.2);
        p.bus_id = [0; 32];
        p.bus_id_legacy = [0; 16];
        write_str(p.bus_id.as_mut_ptr(), 32, &id)?;
        write_str(p.bus_id_legacy.as_mut_ptr(), 16, &legacy)?;
        (p.domain, p.bus, p.device) = (d.pci.0 as c_uint, d.pci.1 as c_uint, d.pci.2 as c_uint);
        p.pci_device_id = attribute(d, A::CU_DEVICE_ATTRIBUTE_GPU_PCI_DEVICE_ID).unwrap_or(0) as c_uint;
        p.pci_sub_system_id = attribute(d, A::CU_DEVICE_ATTRIBUTE_GPU_PCI_SUBSYSTEM_ID).unwrap_or(0) as c_uint;
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v2(dev: NvmlDevice, pci: *mut NvmlPciInfo) -> NvmlReturn {
    nvmlDeviceGetPciInfo_v3(dev, pci)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCudaComputeCapability(dev: NvmlDevice, major: *mut c_int, minor: *mut c_int) -> NvmlReturn {
    entry(|| with_device(dev, |_, d| {
        let (ma, mi) = (
            attribute(d, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            attribute(d, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        );
        let (Some(ma), Some(mi)) = (ma, mi) else { return Err(NVML_ERROR_NOT_SUPPORTED) };
        (*out(major)?, *out(minor)?) = (ma, mi);
        Ok(())
    }))
}

/// NVML_COMPUTEMODE_DEFAULT: rgpu servers share a device between sessions.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeMode(dev: NvmlDevice, mode: *mut c_uint) -> NvmlReturn {
    entry(|| with_device(dev, |_, _| {
        *out(mode)? = 0;
        Ok(())
    }))
}

/// MIG is off: rgpu exports whole devices (fractions are leases, not MIG instances).
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(dev: NvmlDevice, current: *mut c_uint, pending: *mut c_uint) -> NvmlReturn {
    entry(|| with_device(dev, |_, _| {
        (*out(current)?, *out(pending)?) = (0, 0);
        Ok(())
    }))
}

macro_rules! not_supported {
    ($($name:ident($($arg:ident: $ty:ty),*);)*) => {$(
        /// rgpu does not know this of a remote device: NVML's answer for an unsupported query.
        #[no_mangle]
        #[allow(unused_variables)]
        pub unsafe extern "C" fn $name(dev: NvmlDevice, $($arg: $ty),*) -> NvmlReturn {
            entry(|| with_device(dev, |_, _| Err(NVML_ERROR_NOT_SUPPORTED)))
        }
    )*};
}

not_supported! {
    nvmlDeviceGetMemoryInfo(memory: *mut u64);
    nvmlDeviceGetMemoryInfo_v2(memory: *mut u64);
    nvmlDeviceGetUtilizationRates(utilization: *mut u32);
    nvmlDeviceGetTemperature(sensor: c_uint, temp: *mut c_uint);
    nvmlDeviceGetPowerUsage(power: *mut c_uint);
    nvmlDeviceGetSerial(serial: *mut c_char, length: c_uint);
    nvmlDeviceGetComputeRunningProcesses(count: *mut c_uint, infos: *mut u8);
    nvmlDeviceGetComputeRunningProcesses_v2(count: *mut c_uint, infos: *mut u8);
    nvmlDeviceGetComputeRunningProcesses_v3(count: *mut c_uint, infos: *mut u8);
    // No NVLink or NVSwitch fabric joins the devices of a lease as the client sees them (their
    // memory is reached through rgpu, not peer to peer): what NVML says of a GPU without links.
    nvmlDeviceGetNvLinkState(link: c_uint, active: *mut c_uint);
    nvmlDeviceGetNvLinkRemoteDeviceType(link: c_uint, kind: *mut c_uint);
    nvmlDeviceGetNvLinkRemotePciInfo_v2(link: c_uint, pci: *mut NvmlPciInfo);
    nvmlDeviceGetGpuFabricInfo(info: *mut u8);
    nvmlDeviceGetGpuFabricInfoV(info: *mut u8);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn before_init_every_query_is_uninitialized() {
        let mut n = 7;
        assert_eq!(unsafe { nvmlDeviceGetCount_v2(&mut n) }, NVML_ERROR_UNINITIALIZED);
        assert_eq!(nvmlShutdown(), NVML_ERROR_UNINITIALIZED);
        let mut name = [0 as c_char; 64];
        assert_eq!(unsafe { nvmlDeviceGetName(handle(0), name.as_mut_ptr(), 64) }, NVML_ERROR_UNINITIALIZED);
        assert_eq!(unsafe { CStr::from_ptr(nvmlErrorString(NVML_ERROR_NOT_SUPPORTED)) }.to_str().unwrap(), "Not Supported");
    }
}
