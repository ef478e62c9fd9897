//! rgpu's `libnvidia-ml.so.1`: NVML for client hosts, showing the remote GPUs this process may
//! use (`RGPU_SERVERS`, narrowed to its lease's GPUs by `RGPU_TOKEN`, in the order the shim
//! numbers them as CUDA devices), so that pynvml, monitoring agents and job launchers that
//! count GPUs through NVML see what CUDA will see.
//!
//! Memory info, processes, utilization, temperature and power ask the device's server each
//! time (`deviceStatus` on its control plane): with a lease token the lease's limit is the total
//! and its own sessions' allocations are used; utilization and sensors are the whole device's.
//! What the server does not report (a GPU without the sensor; the sim's memory utilization) is
//! `NVML_ERROR_NOT_SUPPORTED`; the sim's temperature and power are constants it reports as
//! simulated (its device name says "sim"). What rgpu does not know about a device is
//! `NVML_ERROR_NOT_SUPPORTED`, never a made-up value: serial numbers, NVLink and fabric state. Some clients resolve a fixed list of functions
//! at once and stop at the first one missing (PyTorch's c10 asserts on each of its seven), so
//! every query they name is exported, answering `NVML_ERROR_NOT_SUPPORTED` where rgpu has no
//! answer. Other functions NVML has and this library lacks are not exported.

use std::ffi::{c_char, c_int, c_uint, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

use rgpu_control_client::{parse_pci_bus_id, uuid_text, Reading, RemoteDevice, Telemetry};
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
    /// Each device's server, by the same index.
    servers: Vec<String>,
}

static STATE: Mutex<State> = Mutex::new(State { refs: 0, devices: Vec::new(), servers: Vec::new() });

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

/// The devices of every server in `RGPU_SERVERS`, as the shim would number them, with the
/// server of each.
fn discover() -> Result<(Vec<RemoteDevice>, Vec<String>), NvmlReturn> {
    let list = std::env::var("RGPU_SERVERS").unwrap_or_default();
    let addrs: Vec<&str> = list.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    if addrs.is_empty() {
        eprintln!("rgpu NVML: no GPU server configured: set RGPU_SERVERS or run under `rgpu run`");
        return Err(NVML_ERROR_DRIVER_NOT_LOADED);
    }
    let security = security().map_err(|e| {
        eprintln!("rgpu NVML: {e}");
        NVML_ERROR_DRIVER_NOT_LOADED
    })?;
    let (mut devices, mut servers) = (Vec::new(), Vec::new());
    for addr in addrs {
        match rgpu_control_client::inventory(addr, &client_name(), &security) {
            Ok(inv) => {
                servers.extend(inv.devices.iter().map(|_| addr.to_string()));
                devices.extend(inv.devices);
            }
            Err(e) => {
                eprintln!("rgpu NVML: {e}");
                return Err(NVML_ERROR_DRIVER_NOT_LOADED);
            }
        }
    }
    Ok((devices, servers))
}

fn client_name() -> String {
    format!("nvml (pid {})", std::process::id())
}

/// The shim's rule (RGPU_TLS_CA / RGPU_PLAINTEXT), so both see the same servers.
fn security() -> Result<rgpu_control_client::ClientSecurity, String> {
    rgpu_control_client::ClientSecurity::from_env().map_err(|e| e.to_string())
}

fn with_device<R>(dev: NvmlDevice, f: impl FnOnce(usize, &RemoteDevice) -> Result<R, NvmlReturn>) -> Result<R, NvmlReturn> {
    with_state_device(&state(), dev, f)
}

fn with_state_device<R>(
    st: &State,
    dev: NvmlDevice,
    f: impl FnOnce(usize, &RemoteDevice) -> Result<R, NvmlReturn>,
) -> Result<R, NvmlReturn> {
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
            (st.devices, st.servers) = discover()?;
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
            st.servers.clear();
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
        NVML_ERROR_ARGUMENT_VERSION_MISMATCH => c"Argument Version Mismatch",
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

/// `nvmlClockType_t`.
pub const NVML_CLOCK_GRAPHICS: c_uint = 0;
pub const NVML_CLOCK_SM: c_uint = 1;
pub const NVML_CLOCK_MEM: c_uint = 2;
pub const NVML_CLOCK_VIDEO: c_uint = 3;

/// The device's peak clocks in MHz, from the clock rates CUDA reports of it (the server's
/// device attributes); the current clocks are not known to rgpu (`nvmlDeviceGetClockInfo`
/// is NOT_SUPPORTED), nor is the video clock.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMaxClockInfo(dev: NvmlDevice, kind: c_uint, clock: *mut c_uint) -> NvmlReturn {
    entry(|| {
        let clock = out(clock)?;
        *clock = with_device(dev, |_, d| {
            max_clock_mhz(kind, attribute(d, A::CU_DEVICE_ATTRIBUTE_CLOCK_RATE), attribute(d, A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE))
        })?;
        Ok(())
    })
}

/// Clock `kind`'s peak in MHz from the SM and memory clock rates in kHz (CUDA's attributes).
fn max_clock_mhz(kind: c_uint, sm_khz: Option<i32>, mem_khz: Option<i32>) -> Result<c_uint, NvmlReturn> {
    let khz = match kind {
        NVML_CLOCK_GRAPHICS | NVML_CLOCK_SM => sm_khz,
        NVML_CLOCK_MEM => mem_khz,
        NVML_CLOCK_VIDEO => None,
        _ => return Err(NVML_ERROR_INVALID_ARGUMENT),
    };
    khz.filter(|k| *k > 0).map(|k| (k / 1000) as c_uint).ok_or(NVML_ERROR_NOT_SUPPORTED)
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

/// `nvmlMemory_t`.
#[repr(C)]
pub struct NvmlMemory {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlMemory_v2_t`.
#[repr(C)]
pub struct NvmlMemoryV2 {
    pub version: c_uint,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlMemory_v2` (NVML_STRUCT_VERSION(Memory, 2)).
pub const NVML_MEMORY_V2: c_uint = std::mem::size_of::<NvmlMemoryV2>() as c_uint | (2 << 24);
pub const NVML_ERROR_ARGUMENT_VERSION_MISMATCH: NvmlReturn = 25;

/// What device `dev`'s server says of it now (memory, processes). The lock is not held while
/// the server is asked.
fn status_now(dev: NvmlDevice) -> Result<rgpu_control_client::DeviceStatus, NvmlReturn> {
    let (addr, ordinal) = {
        let st = state();
        with_state_device(&st, dev, |i, d| Ok((st.servers.get(i).cloned().ok_or(NVML_ERROR_UNKNOWN)?, d.ordinal)))?
    };
    let security = security().map_err(|_| NVML_ERROR_DRIVER_NOT_LOADED)?;
    let status = rgpu_control_client::device_status(&addr, &client_name(), &security).map_err(|e| {
        eprintln!("rgpu NVML: device status: {e}");
        NVML_ERROR_UNKNOWN
    })?;
    status.into_iter().find(|s| s.ordinal == ordinal).ok_or(NVML_ERROR_NOT_SUPPORTED)
}

/// (total, used) of device `dev` now.
fn memory_now(dev: NvmlDevice) -> Result<(u64, u64), NvmlReturn> {
    let s = status_now(dev)?;
    Ok((s.total_mem, s.used_mem.min(s.total_mem)))
}

/// `nvmlProcessInfo_v1_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NvmlProcessInfoV1 {
    pub pid: c_uint,
    pub used_gpu_memory: u64,
}

/// `nvmlProcessInfo_t` (v2, and v3's functions take it too).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NvmlProcessInfo {
    pub pid: c_uint,
    pub used_gpu_memory: u64,
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
}

/// A GPU instance or compute instance id where MIG is off (NVML's `0xFFFFFFFF`).
const NO_INSTANCE: c_uint = c_uint::MAX;

/// NVML's sizing protocol for lists: `*count` in is the room in `infos` (which may be null
/// when it is 0); out, how many there are. Too little room: `NVML_ERROR_INSUFFICIENT_SIZE`.
unsafe fn fill_list<T>(procs: &[(u32, u64)], count: *mut c_uint, infos: *mut T, make: impl Fn(u32, u64) -> T) -> Result<(), NvmlReturn> {
    let count = out(count)?;
    let room = *count as usize;
    *count = procs.len() as c_uint;
    if procs.len() > room {
        return Err(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    if procs.is_empty() {
        return Ok(());
    }
    if infos.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    for (i, &(pid, used)) in procs.iter().enumerate() {
        infos.add(i).write(make(pid, used));
    }
    Ok(())
}

/// The client processes holding memory on the device (of this process's lease, where it has one),
/// as its server counts them.
fn compute_processes(dev: NvmlDevice) -> Result<Vec<(u32, u64)>, NvmlReturn> {
    Ok(status_now(dev)?.processes)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(dev: NvmlDevice, count: *mut c_uint, infos: *mut NvmlProcessInfo) -> NvmlReturn {
    entry(|| {
        let procs = compute_processes(dev)?;
        fill_list(&procs, count, infos, |pid, used| NvmlProcessInfo {
            pid,
            used_gpu_memory: used,
            gpu_instance_id: NO_INSTANCE,
            compute_instance_id: NO_INSTANCE,
        })
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v2(dev: NvmlDevice, count: *mut c_uint, infos: *mut NvmlProcessInfo) -> NvmlReturn {
    nvmlDeviceGetComputeRunningProcesses_v3(dev, count, infos)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses(dev: NvmlDevice, count: *mut c_uint, infos: *mut NvmlProcessInfoV1) -> NvmlReturn {
    entry(|| {
        let procs = compute_processes(dev)?;
        fill_list(&procs, count, infos, |pid, used| NvmlProcessInfoV1 { pid, used_gpu_memory: used })
    })
}

/// No graphics work reaches a device through rgpu, nor MPS clients: their lists are empty
/// (`*count` 0, whatever room there was).
macro_rules! no_processes {
    ($($name:ident;)*) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name(dev: NvmlDevice, count: *mut c_uint, _infos: *mut u8) -> NvmlReturn {
            entry(|| with_device(dev, |_, _| {
                *out(count)? = 0;
                Ok(())
            }))
        }
    )*};
}

no_processes! {
    nvmlDeviceGetGraphicsRunningProcesses;
    nvmlDeviceGetGraphicsRunningProcesses_v2;
    nvmlDeviceGetGraphicsRunningProcesses_v3;
    nvmlDeviceGetMPSComputeRunningProcesses;
    nvmlDeviceGetMPSComputeRunningProcesses_v2;
    nvmlDeviceGetMPSComputeRunningProcesses_v3;
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(dev: NvmlDevice, memory: *mut NvmlMemory) -> NvmlReturn {
    entry(|| {
        let m = out(memory)?;
        let (total, used) = memory_now(dev)?;
        *m = NvmlMemory { total, free: total - used, used };
        Ok(())
    })
}

/// rgpu reserves none of a device's memory for itself (`reserved` 0).
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(dev: NvmlDevice, memory: *mut NvmlMemoryV2) -> NvmlReturn {
    entry(|| {
        let m = out(memory)?;
        if m.version != NVML_MEMORY_V2 {
            return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        let (total, used) = memory_now(dev)?;
        (m.total, m.reserved, m.free, m.used) = (total, 0, total - used, used);
        Ok(())
    })
}

// ---- activity and sensors ---------------------------------------------------------------------
//
// Whole-device readings, as the device's server reports them (`deviceStatus`): measured where
// it measures them (NVML on a real GPU; kernel time on the sim), constants where the sim stands
// in for a sensor it lacks (its device name says "sim"). What the server does not report is
// NVML_ERROR_NOT_SUPPORTED, as on a GPU without that sensor.

/// `nvmlUtilization_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NvmlUtilization {
    pub gpu: c_uint,
    pub memory: c_uint,
}

/// `nvmlTemperature_t` (nvmlTemperature_v1).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NvmlTemperature {
    pub version: c_uint,
    pub sensor_type: c_uint,
    pub temperature: c_int,
}

/// `nvmlTemperature_v1` (NVML_STRUCT_VERSION(Temperature, 1)).
pub const NVML_TEMPERATURE_V1: c_uint = std::mem::size_of::<NvmlTemperature>() as c_uint | (1 << 24);
/// `NVML_TEMPERATURE_GPU`, the only sensor of `nvmlTemperatureSensors_t` (`NVML_TEMPERATURE_COUNT` is 1).
pub const NVML_TEMPERATURE_GPU: c_uint = 0;

/// `rgpuTelemetry_t`: rgpu's own query, for an rgpu server whose GPUs are another rgpu server's
/// (its cuda backend reads them through this library). NVML's queries answer a value alone; this
/// keeps each reading's source, so that a simulated value upstream is not passed on as measured.
/// Per reading (GPU utilization %, memory utilization %, temperature C, power mW, enforced power
/// limit mW): [source, value], source 0 not reported, 1 measured, 2 simulated.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RgpuTelemetry {
    pub readings: [[c_uint; 2]; 5],
}

fn telemetry_now(dev: NvmlDevice) -> Result<Telemetry, NvmlReturn> {
    Ok(status_now(dev)?.telemetry)
}

fn reported(r: Reading) -> Result<c_uint, NvmlReturn> {
    r.value().ok_or(NVML_ERROR_NOT_SUPPORTED)
}

/// NVML's utilization from a server's report: not supported without GPU utilization. A server
/// that measures GPU but not memory utilization (the sim) leaves `memory` 0, as
/// `nvmlUtilization_t` has no way to say "unknown" of one field alone (`rgpu smi` shows N/A).
fn utilization_of(t: &Telemetry) -> Result<NvmlUtilization, NvmlReturn> {
    Ok(NvmlUtilization { gpu: reported(t.gpu_utilization)?, memory: t.memory_utilization.value().unwrap_or(0) })
}

fn readings_of(t: &Telemetry) -> RgpuTelemetry {
    let r = |r: Reading| match r {
        Reading::NotReported => [0, 0],
        Reading::Measured(v) => [1, v],
        Reading::Simulated(v) => [2, v],
    };
    RgpuTelemetry {
        readings: [r(t.gpu_utilization), r(t.memory_utilization), r(t.temperature), r(t.power_usage), r(t.power_limit)],
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(dev: NvmlDevice, utilization: *mut NvmlUtilization) -> NvmlReturn {
    entry(|| {
        let u = out(utilization)?;
        *u = utilization_of(&telemetry_now(dev)?)?;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetTemperature(dev: NvmlDevice, sensor: c_uint, temp: *mut c_uint) -> NvmlReturn {
    entry(|| {
        let t = out(temp)?;
        if sensor != NVML_TEMPERATURE_GPU {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        *t = reported(telemetry_now(dev)?.temperature)?;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetTemperatureV(dev: NvmlDevice, temperature: *mut NvmlTemperature) -> NvmlReturn {
    entry(|| {
        let t = out(temperature)?;
        if t.version != NVML_TEMPERATURE_V1 {
            return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        if t.sensor_type != NVML_TEMPERATURE_GPU {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        t.temperature = reported(telemetry_now(dev)?.temperature)? as c_int;
        Ok(())
    })
}

/// Milliwatts the board draws.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPowerUsage(dev: NvmlDevice, power: *mut c_uint) -> NvmlReturn {
    entry(|| {
        let p = out(power)?;
        *p = reported(telemetry_now(dev)?.power_usage)?;
        Ok(())
    })
}

/// Milliwatts, the limit the board enforces.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetEnforcedPowerLimit(dev: NvmlDevice, limit: *mut c_uint) -> NvmlReturn {
    entry(|| {
        let l = out(limit)?;
        *l = reported(telemetry_now(dev)?.power_limit)?;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn rgpuNvmlDeviceGetTelemetry(dev: NvmlDevice, telemetry: *mut RgpuTelemetry) -> NvmlReturn {
    entry(|| {
        let t = out(telemetry)?;
        *t = readings_of(&telemetry_now(dev)?);
        Ok(())
    })
}

not_supported! {
    nvmlDeviceGetSerial(serial: *mut c_char, length: c_uint);
    // What the device is doing now, and its board's settings: the client has no view of them
    // (a tool asks, and shows "N/A", where a missing function would stop it or, linked
    // directly, kill the process at the call).
    nvmlDeviceGetClockInfo(kind: c_uint, clock: *mut c_uint);
    nvmlDeviceGetClock(kind: c_uint, id: c_uint, mhz: *mut c_uint);
    nvmlDeviceGetApplicationsClock(kind: c_uint, mhz: *mut c_uint);
    nvmlDeviceGetDefaultApplicationsClock(kind: c_uint, mhz: *mut c_uint);
    nvmlDeviceGetCurrentClocksThrottleReasons(reasons: *mut u64);
    nvmlDeviceGetCurrentClocksEventReasons(reasons: *mut u64);
    nvmlDeviceGetFanSpeed(speed: *mut c_uint);
    nvmlDeviceGetFanSpeed_v2(fan: c_uint, speed: *mut c_uint);
    nvmlDeviceGetNumFans(count: *mut c_uint);
    nvmlDeviceGetPerformanceState(state: *mut c_uint);
    nvmlDeviceGetPowerState(state: *mut c_uint);
    nvmlDeviceGetPowerManagementMode(mode: *mut c_uint);
    nvmlDeviceGetPowerManagementLimit(milliwatts: *mut c_uint);
    nvmlDeviceGetPowerManagementDefaultLimit(milliwatts: *mut c_uint);
    nvmlDeviceGetPowerManagementLimitConstraints(min: *mut c_uint, max: *mut c_uint);
    nvmlDeviceGetTotalEnergyConsumption(millijoules: *mut u64);
    nvmlDeviceGetEncoderUtilization(util: *mut c_uint, period_us: *mut c_uint);
    nvmlDeviceGetDecoderUtilization(util: *mut c_uint, period_us: *mut c_uint);
    nvmlDeviceGetPersistenceMode(mode: *mut c_uint);
    nvmlDeviceGetDisplayMode(mode: *mut c_uint);
    nvmlDeviceGetDisplayActive(active: *mut c_uint);
    nvmlDeviceGetEccMode(current: *mut c_uint, pending: *mut c_uint);
    nvmlDeviceGetTotalEccErrors(kind: c_uint, counter: c_uint, count: *mut u64);
    nvmlDeviceGetBAR1MemoryInfo(info: *mut u8);
    nvmlDeviceGetPcieThroughput(counter: c_uint, value: *mut c_uint);
    nvmlDeviceGetCurrPcieLinkGeneration(generation: *mut c_uint);
    nvmlDeviceGetCurrPcieLinkWidth(width: *mut c_uint);
    nvmlDeviceGetMaxPcieLinkGeneration(generation: *mut c_uint);
    nvmlDeviceGetMaxPcieLinkWidth(width: *mut c_uint);
    nvmlDeviceGetMinorNumber(minor: *mut c_uint);
    nvmlDeviceGetBoardPartNumber(part: *mut c_char, length: c_uint);
    nvmlDeviceGetVbiosVersion(version: *mut c_char, length: c_uint);
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

    /// Arguments are checked before the server is asked: a null out-pointer or a sensor other
    /// than the GPU's is an invalid argument, an unknown struct version a version mismatch;
    /// valid arguments before nvmlInit are uninitialized.
    #[test]
    fn sensor_queries_check_their_arguments() {
        let dev = handle(0);
        let mut v: c_uint = 7;
        assert_eq!(unsafe { nvmlDeviceGetTemperature(dev, 1, &mut v) }, NVML_ERROR_INVALID_ARGUMENT);
        assert_eq!(unsafe { nvmlDeviceGetTemperature(dev, NVML_TEMPERATURE_GPU, std::ptr::null_mut()) }, NVML_ERROR_INVALID_ARGUMENT);
        assert_eq!(unsafe { nvmlDeviceGetTemperature(dev, NVML_TEMPERATURE_GPU, &mut v) }, NVML_ERROR_UNINITIALIZED);
        assert_eq!(unsafe { nvmlDeviceGetPowerUsage(dev, std::ptr::null_mut()) }, NVML_ERROR_INVALID_ARGUMENT);
        assert_eq!(unsafe { nvmlDeviceGetPowerUsage(dev, &mut v) }, NVML_ERROR_UNINITIALIZED);
        assert_eq!(unsafe { nvmlDeviceGetEnforcedPowerLimit(dev, std::ptr::null_mut()) }, NVML_ERROR_INVALID_ARGUMENT);
        assert_eq!(unsafe { nvmlDeviceGetUtilizationRates(dev, std::ptr::null_mut()) }, NVML_ERROR_INVALID_ARGUMENT);
        let mut u = NvmlUtilization::default();
        assert_eq!(unsafe { nvmlDeviceGetUtilizationRates(dev, &mut u) }, NVML_ERROR_UNINITIALIZED);
        assert_eq!(unsafe { rgpuNvmlDeviceGetTelemetry(dev, std::ptr::null_mut()) }, NVML_ERROR_INVALID_ARGUMENT);
        let mut t = NvmlTemperature { version: NVML_TEMPERATURE_V1, sensor_type: 2, temperature: 0 };
        assert_eq!(unsafe { nvmlDeviceGetTemperatureV(dev, &mut t) }, NVML_ERROR_INVALID_ARGUMENT);
        t = NvmlTemperature { version: 1 << 24, sensor_type: NVML_TEMPERATURE_GPU, temperature: 0 };
        assert_eq!(unsafe { nvmlDeviceGetTemperatureV(dev, &mut t) }, NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        t.version = NVML_TEMPERATURE_V1;
        assert_eq!(unsafe { nvmlDeviceGetTemperatureV(dev, &mut t) }, NVML_ERROR_UNINITIALIZED);
        // nvml.h: `nvmlTemperature_v1` is NVML_STRUCT_VERSION(Temperature, 1) over a 12-byte struct.
        assert_eq!(NVML_TEMPERATURE_V1, 12 | 1 << 24);
    }

    /// What the server reports is answered; what it does not is NOT_SUPPORTED, as on a GPU
    /// without the sensor.
    #[test]
    fn readings_answer_what_the_server_reports() {
        let sim = Telemetry {
            gpu_utilization: Reading::Measured(73),
            memory_utilization: Reading::NotReported,
            temperature: Reading::Simulated(40),
            power_usage: Reading::Simulated(60_000),
            power_limit: Reading::NotReported,
        };
        assert_eq!(utilization_of(&sim), Ok(NvmlUtilization { gpu: 73, memory: 0 }));
        assert_eq!(reported(sim.temperature), Ok(40));
        assert_eq!(reported(sim.power_usage), Ok(60_000));
        assert_eq!(reported(sim.power_limit), Err(NVML_ERROR_NOT_SUPPORTED));
        let gpu = Telemetry { memory_utilization: Reading::Measured(12), ..sim };
        assert_eq!(utilization_of(&gpu), Ok(NvmlUtilization { gpu: 73, memory: 12 }));
        let old = Telemetry::default();
        assert_eq!(utilization_of(&old), Err(NVML_ERROR_NOT_SUPPORTED), "a server reporting nothing");
        assert_eq!(reported(old.temperature), Err(NVML_ERROR_NOT_SUPPORTED));
        assert_eq!(readings_of(&sim).readings, [[1, 73], [0, 0], [2, 40], [2, 60_000], [0, 0]]);
    }

    /// Peak clocks come from CUDA's clock rates (kHz); a kind NVML has but the device does not
    /// report is NOT_SUPPORTED, one NVML does not have an invalid argument.
    #[test]
    fn peak_clocks_are_cudas_clock_rates_in_mhz() {
        let (sm, mem) = (Some(1_980_000), Some(2_619_000));
        assert_eq!(max_clock_mhz(NVML_CLOCK_SM, sm, mem), Ok(1980));
        assert_eq!(max_clock_mhz(NVML_CLOCK_GRAPHICS, sm, mem), Ok(1980));
        assert_eq!(max_clock_mhz(NVML_CLOCK_MEM, sm, mem), Ok(2619));
        assert_eq!(max_clock_mhz(NVML_CLOCK_VIDEO, sm, mem), Err(NVML_ERROR_NOT_SUPPORTED));
        assert_eq!(max_clock_mhz(4, sm, mem), Err(NVML_ERROR_INVALID_ARGUMENT));
        assert_eq!(max_clock_mhz(NVML_CLOCK_SM, Some(0), mem), Err(NVML_ERROR_NOT_SUPPORTED));
        assert_eq!(max_clock_mhz(NVML_CLOCK_MEM, sm, None), Err(NVML_ERROR_NOT_SUPPORTED));
        let mut v: c_uint = 7;
        assert_eq!(unsafe { nvmlDeviceGetMaxClockInfo(handle(0), NVML_CLOCK_SM, std::ptr::null_mut()) }, NVML_ERROR_INVALID_ARGUMENT);
        assert_eq!(unsafe { nvmlDeviceGetMaxClockInfo(handle(0), NVML_CLOCK_SM, &mut v) }, NVML_ERROR_UNINITIALIZED);
        assert_eq!(unsafe { nvmlDeviceGetClockInfo(handle(0), NVML_CLOCK_SM, &mut v) }, NVML_ERROR_UNINITIALIZED);
    }

    /// NVML's list protocol: ask with no room, get the count and INSUFFICIENT_SIZE; ask with
    /// room, get the entries and the count; nothing to list is success at once.
    #[test]
    fn process_lists_follow_nvmls_sizing_protocol() {
        let procs = [(11, 100), (12, 200)];
        let v1 = |pid, used| NvmlProcessInfoV1 { pid, used_gpu_memory: used };
        let mut n = 0;
        let r = unsafe { fill_list(&procs, &mut n, std::ptr::null_mut(), v1) };
        assert_eq!((r, n), (Err(NVML_ERROR_INSUFFICIENT_SIZE), 2));
        let mut room = [NvmlProcessInfoV1 { pid: 0, used_gpu_memory: 0 }; 5];
        let mut n = 5;
        let r = unsafe { fill_list(&procs, &mut n, room.as_mut_ptr(), v1) };
        assert_eq!((r, n), (Ok(()), 2));
        assert_eq!(room[..2], [v1(11, 100), v1(12, 200)]);
        assert_eq!(room[2], v1(0, 0), "nothing written past the count");
        let mut n = 0;
        assert_eq!(unsafe { fill_list(&[], &mut n, std::ptr::null_mut(), v1) }, Ok(()));
        assert_eq!(n, 0);
        let mut n = 1;
        assert_eq!(unsafe { fill_list(&procs[..1], &mut n, std::ptr::null_mut(), v1) }, Err(NVML_ERROR_INVALID_ARGUMENT));
        assert_eq!(unsafe { fill_list(&procs, std::ptr::null_mut(), room.as_mut_ptr(), v1) }, Err(NVML_ERROR_INVALID_ARGUMENT));
    }
}
