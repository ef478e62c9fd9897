//! What the cuda backend reports of its GPUs' activity and sensors
//! (`deviceStatus`), read through NVML (`libnvidia-ml.so.1`, opened at run
//! time on the first request; the server builds and runs without it), per
//! device found by its UUID:
//!
//! - `nvmlDeviceGetUtilizationRates`: GPU and memory utilization;
//! - `nvmlDeviceGetTemperature` (`NVML_TEMPERATURE_GPU`): the die, in C;
//! - `nvmlDeviceGetPowerUsage`, `nvmlDeviceGetEnforcedPowerLimit`: mW.
//!
//! Each query is optional: one NVML lacks, or the GPU answers with an
//! error (`NVML_ERROR_NOT_SUPPORTED` on parts without the sensor), is not
//! reported. On a server chained to another rgpu server (its
//! `libnvidia-ml.so.1` is rgpu's own), NVML's plain queries would hide
//! whether the upstream value was measured or simulated, so rgpu's
//! `rgpuNvmlDeviceGetTelemetry` is asked instead, which keeps each
//! reading's source.

use std::ffi::{c_char, c_uint, c_void, CString};
use std::sync::OnceLock;

use tracing::{debug, info};

use super::health::uuid_text;
use crate::telemetry::{DeviceTelemetry, Reading};

type Ret = c_uint;
const NVML_SUCCESS: Ret = 0;
const NVML_ERROR_NOT_SUPPORTED: Ret = 3;
type Device = *mut c_void;
/// `NVML_TEMPERATURE_GPU`.
const TEMPERATURE_GPU: c_uint = 0;

/// `nvmlUtilization_t`.
#[repr(C)]
#[derive(Default)]
struct Utilization {
    gpu: c_uint,
    memory: c_uint,
}

/// `rgpuTelemetry_t` of rgpu's NVML (nvml/src/lib.rs): per reading, its
/// source (0 none, 1 measured, 2 simulated) and value.
#[repr(C)]
#[derive(Default)]
struct RgpuTelemetry {
    readings: [[c_uint; 2]; 5],
}

struct Api {
    utilization: Option<unsafe extern "C" fn(Device, *mut Utilization) -> Ret>,
    temperature: Option<unsafe extern "C" fn(Device, c_uint, *mut c_uint) -> Ret>,
    power_usage: Option<unsafe extern "C" fn(Device, *mut c_uint) -> Ret>,
    power_limit: Option<unsafe extern "C" fn(Device, *mut c_uint) -> Ret>,
    rgpu: Option<unsafe extern "C" fn(Device, *mut RgpuTelemetry) -> Ret>,
}

struct Opened {
    // Kept loaded while the function pointers in `api` live.
    _lib: libloading::Library,
    api: Api,
    /// NVML's handle of each CUDA device, by ordinal (None: unknown to it).
    devices: Vec<Option<usize>>,
}

/// NVML's readings of the backend's devices, opened on first use.
pub struct NvmlTelemetry {
    uuids: Vec<[u8; 16]>,
    opened: OnceLock<Option<Opened>>,
}

// The handles are NVML's opaque device pointers, valid for the process's
// life after nvmlInit and usable from any thread (NVML is thread-safe).
unsafe impl Send for NvmlTelemetry {}
unsafe impl Sync for NvmlTelemetry {}

impl NvmlTelemetry {
    pub fn new(uuids: &[[u8; 16]]) -> NvmlTelemetry {
        NvmlTelemetry { uuids: uuids.to_vec(), opened: OnceLock::new() }
    }

    /// Every device's readings now, by ordinal; all not reported without NVML.
    pub fn read(&self) -> Vec<DeviceTelemetry> {
        let Some(o) = self.opened.get_or_init(|| open(&self.uuids)) else {
            return vec![DeviceTelemetry::default(); self.uuids.len()];
        };
        o.devices
            .iter()
            .map(|d| d.map_or_else(DeviceTelemetry::default, |d| of(&o.api, d as Device)))
            .collect()
    }
}

fn open(uuids: &[[u8; 16]]) -> Option<Opened> {
    let none = |why: String| {
        info!("device telemetry: {why}; utilization, temperature and power are not reported");
        None
    };
    // SAFETY: loading NVIDIA's NVML runs its constructors, as any program
    // using NVML does.
    let lib = match unsafe { libloading::Library::new("libnvidia-ml.so.1") } {
        Ok(l) => l,
        Err(e) => return none(format!("no NVML ({e})")),
    };
    // SAFETY: the signatures are NVML's (nvml.h) and rgpu's own.
    let (init, by_uuid, api) = unsafe {
        let init: unsafe extern "C" fn() -> Ret = match lib.get(b"nvmlInit_v2\0") {
            Ok(f) => *f,
            Err(e) => return none(format!("NVML lacks nvmlInit_v2 ({e})")),
        };
        let by_uuid: unsafe extern "C" fn(*const c_char, *mut Device) -> Ret = match lib.get(b"nvmlDeviceGetHandleByUUID\0") {
            Ok(f) => *f,
            Err(e) => return none(format!("NVML lacks nvmlDeviceGetHandleByUUID ({e})")),
        };
        let api = Api {
            utilization: lib.get(b"nvmlDeviceGetUtilizationRates\0").ok().map(|f| *f),
            temperature: lib.get(b"nvmlDeviceGetTemperature\0").ok().map(|f| *f),
            power_usage: lib.get(b"nvmlDeviceGetPowerUsage\0").ok().map(|f| *f),
            power_limit: lib.get(b"nvmlDeviceGetEnforcedPowerLimit\0").ok().map(|f| *f),
            rgpu: lib.get(b"rgpuNvmlDeviceGetTelemetry\0").ok().map(|f| *f),
        };
        (init, by_uuid, api)
    };
    // SAFETY: NVML's init, reference counted (health may have called it too).
    match unsafe { init() } {
        NVML_SUCCESS => {}
        r => return none(format!("nvmlInit_v2 returned {r}")),
    }
    let devices: Vec<Option<usize>> = uuids
        .iter()
        .map(|u| {
            let name = CString::new(uuid_text(u)).ok()?;
            let mut d: Device = std::ptr::null_mut();
            // SAFETY: a NUL-terminated name and an out-pointer.
            (unsafe { by_uuid(name.as_ptr(), &mut d) } == NVML_SUCCESS && !d.is_null()).then_some(d as usize)
        })
        .collect();
    let found = devices.iter().filter(|d| d.is_some()).count();
    let from = if api.rgpu.is_some() { "an upstream rgpu server, through rgpu's NVML" } else { "NVML" };
    info!(devices = uuids.len(), found, "device telemetry from {from} (utilization, temperature, power)");
    Some(Opened { _lib: lib, api, devices })
}

/// One NVML answer: the value, or not reported.
fn answer(r: Ret, v: c_uint, what: &str) -> Reading {
    match r {
        NVML_SUCCESS => Reading::Measured(v),
        NVML_ERROR_NOT_SUPPORTED => Reading::NotReported,
        r => {
            debug!(ret = r, "NVML {what} query failed");
            Reading::NotReported
        }
    }
}

/// A reading of rgpu's NVML, with the source its server gave.
fn relayed([source, value]: [c_uint; 2]) -> Reading {
    match source {
        1 => Reading::Measured(value),
        2 => Reading::Simulated(value),
        _ => Reading::NotReported,
    }
}

fn of(api: &Api, d: Device) -> DeviceTelemetry {
    if let Some(f) = api.rgpu {
        let mut t = RgpuTelemetry::default();
        // SAFETY: a handle rgpu's NVML gave and an out-pointer of its struct.
        let r = unsafe { f(d, &mut t) };
        if r != NVML_SUCCESS {
            debug!(ret = r, "rgpu NVML telemetry query failed");
            return DeviceTelemetry::default();
        }
        let [g, m, temp, p, l] = t.readings;
        return DeviceTelemetry {
            gpu_utilization: relayed(g),
            memory_utilization: relayed(m),
            temperature: relayed(temp),
            power_usage: relayed(p),
            power_limit: relayed(l),
        };
    }
    let mut t = DeviceTelemetry::default();
    if let Some(f) = api.utilization {
        let mut u = Utilization::default();
        // SAFETY: a handle NVML gave and an out-pointer, as nvml.h declares.
        let r = unsafe { f(d, &mut u) };
        t.gpu_utilization = answer(r, u.gpu, "utilization");
        t.memory_utilization = answer(r, u.memory, "utilization");
    }
    let mut v: c_uint = 0;
    if let Some(f) = api.temperature {
        // SAFETY: as above.
        t.temperature = answer(unsafe { f(d, TEMPERATURE_GPU, &mut v) }, v, "temperature");
    }
    if let Some(f) = api.power_usage {
        // SAFETY: as above.
        t.power_usage = answer(unsafe { f(d, &mut v) }, v, "power usage");
    }
    if let Some(f) = api.power_limit {
        // SAFETY: as above.
        t.power_limit = answer(unsafe { f(d, &mut v) }, v, "power limit");
    }
    t
}
