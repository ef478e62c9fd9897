//! rgpu's `libnvidia-ml.so.1` as NVML clients load it: some resolve a fixed list of functions
//! with dlsym and stop at the first one missing, so each such list must be exported in full.

use std::ffi::CString;

use rgpu_integration::binaries;

/// What PyTorch's c10 (2.x, `c10/cuda/driver_api.cpp`) resolves before it will use the
/// expandable-segments allocator or report per-process memory on out-of-memory.
const PYTORCH_C10: &[&str] = &[
    "nvmlInit_v2",
    "nvmlDeviceGetHandleByPciBusId_v2",
    "nvmlDeviceGetNvLinkRemoteDeviceType",
    "nvmlDeviceGetNvLinkRemotePciInfo_v2",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlSystemGetCudaDriverVersion_v2",
    "nvmlDeviceGetGpuFabricInfoV",
];

/// What pynvml's common queries and NCCL's topology probe look up.
const PYNVML_NCCL: &[&str] = &[
    "nvmlInit", "nvmlInitWithFlags", "nvmlShutdown", "nvmlErrorString", "nvmlDeviceGetCount_v2",
    "nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetIndex",
    "nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMigMode",
    "nvmlDeviceGetNvLinkState", "nvmlSystemGetDriverVersion", "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetTemperature", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetEnforcedPowerLimit",
];

/// What monitoring tools (gpustat, nvitop, nvidia-smi-like scripts) ask beyond those; what
/// rgpu cannot know answers NOT_SUPPORTED, but a missing one stops a tool that resolves it, or
/// kills a program linked to it at its first call.
const MONITORS: &[&str] = &[
    "nvmlDeviceGetMaxClockInfo", "nvmlDeviceGetClockInfo", "nvmlDeviceGetFanSpeed", "nvmlDeviceGetPerformanceState",
    "nvmlDeviceGetPowerManagementLimit", "nvmlDeviceGetEncoderUtilization", "nvmlDeviceGetDecoderUtilization",
    "nvmlDeviceGetPersistenceMode", "nvmlDeviceGetEccMode", "nvmlDeviceGetBAR1MemoryInfo",
    "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkWidth", "nvmlDeviceGetPcieThroughput",
    "nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetGraphicsRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v3",
];

#[test]
fn every_function_a_known_client_resolves_is_exported() {
    let path = binaries().libcuda.with_file_name("libnvidia_ml.so");
    let cpath = CString::new(path.to_str().unwrap()).unwrap();
    let lib = unsafe { libc::dlopen(cpath.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!lib.is_null(), "dlopen {}", path.display());
    let missing: Vec<&str> = PYTORCH_C10
        .iter()
        .chain(PYNVML_NCCL)
        .chain(MONITORS)
        .copied()
        .filter(|name| {
            let c = CString::new(*name).unwrap();
            unsafe { libc::dlsym(lib, c.as_ptr()) }.is_null()
        })
        .collect();
    assert!(missing.is_empty(), "{} does not export {missing:?}", path.display());
}
