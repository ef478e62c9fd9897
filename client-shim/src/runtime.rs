//! Process-wide state of the shim below the object layer: the servers and their devices, set up
//! once by `cuInit`, and the mapping between the program's device addresses and each server's.
//! (The objects the program creates, allocations included, are in `objects`.)

use std::collections::HashMap;
use std::sync::OnceLock;

use crate::client::connection::Connection;
use crate::client::control::{self, RemoteDevice};
use crate::client::ClientError;
use crate::cuda::types::*;

/// Reported by cuDriverGetVersion. cudart 13 refuses anything below 13000,
/// and the integrity check hashes this exact value.
pub const DRIVER_VERSION: i32 = 13050;

/// Device pointers of server `i` are shown to the program with `i` in bits
/// 48..56, so that two servers' allocations never share an address in the
/// program's unified address space. Server 0's pointers are unchanged.
const SERVER_SHIFT: u32 = 48;

pub struct Runtime {
    pub servers: Vec<Server>,
    pub devices: Vec<Device>,
}

pub struct Server {
    pub conn: Connection,
}

pub struct Device {
    pub server: usize,
    pub remote: RemoteDevice,
    pub attributes: HashMap<u32, i32>,
    /// Launch limits, looked up once: every launch checks them.
    pub limits: Limits,
}

#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_block: [u32; 3],
    pub max_grid: [u32; 3],
}

/// Device features the shim does not offer a program, whatever the server's device has: their
/// attributes read 0, so that a program that tests an attribute before using a feature takes the
/// path that works instead of one whose calls return CUDA_ERROR_NOT_SUPPORTED. Remove an entry
/// in the change that implements its feature.
const NOT_PROVIDED: &[(CUdevice_attribute, &str)] = {
    type A = CUdevice_attribute;
    &[
        (A::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY, "mapped host memory (cuMemHostGetDevicePointer)"),
        // objects::managed keeps host and device coherent at synchronisations only.
        (A::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS, "concurrent managed access (host and device at once)"),
        (A::CU_DEVICE_ATTRIBUTE_DIRECT_MANAGED_MEM_ACCESS_FROM_HOST, "direct host access to device-resident managed memory"),
        (A::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS, "device access to pageable host memory"),
        (A::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES, "device access to pageable host memory"),
        (A::CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED, "device access to host memory"),
        (A::CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, "mapped host memory"),
        (A::CU_DEVICE_ATTRIBUTE_COOPERATIVE_MULTI_DEVICE_LAUNCH, "multi-device cooperative launch (cuLaunchCooperativeKernelMultiDevice)"),
        (A::CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH, "launch attributes (clusters) in cuLaunchKernelEx"),
        (A::CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1, "stream memory operations (cuStreamWaitValue*)"),
        (A::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS_V1, "stream memory operations"),
        (A::CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR_V1, "stream memory operations"),
        (A::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, "stream memory operations"),
        (A::CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR, "stream memory operations"),
        (A::CU_DEVICE_ATTRIBUTE_GENERIC_COMPRESSION_SUPPORTED, "compressible memory (cuMemCreate)"),
        (A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, "exportable allocations"),
        (A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_WIN32_HANDLE_SUPPORTED, "exportable allocations"),
        (A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_WIN32_KMT_HANDLE_SUPPORTED, "exportable allocations"),
        (A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, "exportable allocations"),
        (A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, "virtual memory management"),
        (A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED, "GPUDirect RDMA to the program's host"),
        (A::CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES, "exportable memory pools"),
        (A::CU_DEVICE_ATTRIBUTE_SPARSE_CUDA_ARRAY_SUPPORTED, "CUDA arrays"),
        (A::CU_DEVICE_ATTRIBUTE_DEFERRED_MAPPING_CUDA_ARRAY_SUPPORTED, "CUDA arrays"),
        (A::CU_DEVICE_ATTRIBUTE_TIMELINE_SEMAPHORE_INTEROP_SUPPORTED, "external semaphores"),
        (A::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, "dma-buf export"),
        (A::CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, "multicast objects"),
        (A::CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, "virtual memory management"),
        (A::CU_DEVICE_ATTRIBUTE_HOST_NUMA_MEMORY_POOLS_SUPPORTED, "memory pools in host memory"),
        (A::CU_DEVICE_ATTRIBUTE_HOST_MEMORY_POOLS_SUPPORTED, "memory pools in host memory"),
        (A::CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, "virtual memory management"),
    ]
};

/// Features the shim provides itself on every backend, whatever the server reports.
const PROVIDED: &[(CUdevice_attribute, i32)] = &[
    // objects::pool: the stream-ordered allocator over ordinary allocations.
    (CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, 1),
];

/// A server's attribute list as the program sees it: the features in [`NOT_PROVIDED`] read 0,
/// those in [`PROVIDED`] their value. Logged once per attribute the server had set. Managed
/// memory (`objects::managed`) is built on the server's virtual memory management and a host
/// address equal to the device address, which only the first server's pointers (tag 0) have.
fn as_provided(server: &[(u32, i32)], index: usize) -> HashMap<u32, i32> {
    let mut attrs: HashMap<u32, i32> = server.iter().copied().collect();
    for (a, v) in PROVIDED {
        attrs.insert(a.0, *v);
    }
    type A = CUdevice_attribute;
    let vmm = attrs.get(&A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED.0).copied().unwrap_or(0);
    if let Some(v) = attrs.get_mut(&A::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY.0) {
        *v = i32::from(index == 0 && vmm == 1);
    }
    for (a, feature) in NOT_PROVIDED {
        if let Some(v) = attrs.get_mut(&a.0) {
            if *v != 0 {
                tracing::debug!("device attribute {} reads 0: rgpu does not offer {feature} yet", a.0);
                *v = 0;
            }
        }
    }
    attrs
}

impl Device {
    /// The value of one attribute, from the server's list.
    pub fn attribute(&self, attrib: CUdevice_attribute) -> CuResult<i32> {
        self.attributes.get(&attrib.0).copied().ok_or(CuError::INVALID_VALUE)
    }
}

impl Limits {
    fn from(attrs: &HashMap<u32, i32>) -> Limits {
        type A = CUdevice_attribute;
        let get = |a: CUdevice_attribute| attrs.get(&a.0).copied().unwrap_or(0).max(0) as u32;
        Limits {
            max_block: [
                get(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X),
                get(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y),
                get(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z),
            ],
            max_grid: [
                get(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X),
                get(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y),
                get(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z),
            ],
        }
    }
}

static RUNTIME: OnceLock<Result<Runtime, CuError>> = OnceLock::new();

/// `cuInit`: connects to every server in RGPU_SERVERS. Idempotent; a failure
/// is remembered and returned again, as the real driver does.
pub fn init() -> CuResult<&'static Runtime> {
    match RUNTIME.get_or_init(connect_all) {
        Ok(rt) => Ok(rt),
        Err(e) => Err(*e),
    }
}

/// The runtime, or CUDA_ERROR_NOT_INITIALIZED before a successful cuInit.
pub fn get() -> CuResult<&'static Runtime> {
    match RUNTIME.get() {
        Some(Ok(rt)) => Ok(rt),
        Some(Err(e)) => Err(*e),
        None => Err(CuError::NOT_INITIALIZED),
    }
}

/// The runtime if cuInit succeeded, without failing otherwise (for the
/// integrity check, which runs before the program can have devices).
pub fn try_get() -> Option<&'static Runtime> {
    RUNTIME.get().and_then(|r| r.as_ref().ok())
}

fn connect_all() -> Result<Runtime, CuError> {
    crate::logging::init();
    let list = std::env::var("RGPU_SERVERS").unwrap_or_default();
    let addrs: Vec<String> = list.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect();
    if addrs.is_empty() {
        eprintln!(
            "rgpu: no GPU server configured: set RGPU_SERVERS=host:port[,host:port...] \
             or run the program with `rgpu run --server HOST:PORT -- PROGRAM`"
        );
        return Err(CuError::NO_DEVICE);
    }
    let client_name = client_name();
    let mut servers = Vec::new();
    let mut devices = Vec::new();
    for (i, addr) in addrs.iter().enumerate() {
        let opened = control::open(addr, &client_name)
            .and_then(|h| Connection::attach(addr, h.session_id, &h.key).map(|c| (h, c)));
        let (hello, conn) = match opened {
            Ok(x) => x,
            Err(e) => {
                eprintln!("rgpu: {e}");
                tracing::error!("{e}");
                return Err(match e {
                    ClientError::VersionMismatch { .. } => CuError::SYSTEM_DRIVER_MISMATCH,
                    _ => CuError::NO_DEVICE,
                });
            }
        };
        tracing::info!(
            "server {addr} ({}, backend {}): {} device(s)",
            hello.server_name,
            hello.backend,
            hello.devices.len()
        );
        for d in hello.devices {
            let attributes = as_provided(&d.attributes, i);
            let limits = Limits::from(&attributes);
            devices.push(Device { server: i, remote: d, attributes, limits });
        }
        servers.push(Server { conn });
    }
    if devices.is_empty() {
        eprintln!("rgpu: the configured servers ({list}) export no device");
        return Err(CuError::NO_DEVICE);
    }
    // A program that exits closes its sessions in order, so the servers free
    // them at once instead of holding them for a reconnection.
    // SAFETY: registers a plain function with no arguments.
    unsafe { libc::atexit(close_at_exit) };
    Ok(Runtime { servers, devices })
}

extern "C" fn close_at_exit() {
    // A panic must not unwind into libc.
    let _ = std::panic::catch_unwind(|| {
        if let Some(rt) = try_get() {
            for s in &rt.servers {
                s.conn.close();
            }
        }
    });
}

fn client_name() -> String {
    let exe = std::env::current_exe().ok().and_then(|p| p.file_name().map(|f| f.to_string_lossy().into_owned()));
    format!("{} (pid {})", exe.unwrap_or_else(|| "?".into()), std::process::id())
}

impl Runtime {
    pub fn device(&self, dev: CUdevice) -> CuResult<&Device> {
        usize::try_from(dev).ok().and_then(|d| self.devices.get(d)).ok_or(CuError::INVALID_DEVICE)
    }

    pub fn conn(&self, dev: CUdevice) -> CuResult<&Connection> {
        Ok(&self.servers[self.device(dev)?.server].conn)
    }

    /// Client-visible address of a pointer the server returned for `dev`.
    pub fn to_client(&self, dev: CUdevice, remote: u64) -> u64 {
        let server = self.devices[dev as usize].server as u64;
        remote | (server << SERVER_SHIFT)
    }

    /// The server-side address of a client-visible device pointer.
    pub fn to_remote(ptr: u64) -> u64 {
        ptr & ((1u64 << SERVER_SHIFT) - 1) | (ptr & !((1u64 << 56) - 1))
    }
}

/// Maps a client-side failure to the CUresult a CUDA program sees.
pub fn cu_err(e: ClientError) -> CuError {
    match e {
        ClientError::Cuda(code) => error_from_code(code),
        // A lost server is a device that went away under the program.
        ClientError::Lost { .. } | ClientError::Unreachable { .. } => CuError::DEVICE_UNAVAILABLE,
        ClientError::Protocol { .. } | ClientError::VersionMismatch { .. } => CuError::UNKNOWN,
        ClientError::NotPermitted { .. } => CuError::NOT_PERMITTED,
    }
}

/// A CUresult the server sent, as an error (0 cannot be an error; treat a
/// confused peer as an unknown failure).
pub fn error_from_code(code: u32) -> CuError {
    std::num::NonZeroU32::new(code).map(CuError).unwrap_or(CuError::UNKNOWN)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that reports managed memory and multi-device cooperative launch (a real GPU
    /// does) is shown to the program without them; everything else passes through.
    #[test]
    fn features_rgpu_does_not_offer_read_zero() {
        type A = CUdevice_attribute;
        let server = [
            (A::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY.0, 1),
            (A::CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH.0, 1),
            (A::CU_DEVICE_ATTRIBUTE_COOPERATIVE_MULTI_DEVICE_LAUNCH.0, 1),
            (A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED.0, 0),
            (A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT.0, 132),
            (A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING.0, 1),
        ];
        let a = as_provided(&server, 0);
        assert_eq!(a[&A::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY.0], 0, "no virtual memory management on the server");
        assert_eq!(a[&A::CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH.0], 1, "cooperative launch is forwarded");
        assert_eq!(a[&A::CU_DEVICE_ATTRIBUTE_COOPERATIVE_MULTI_DEVICE_LAUNCH.0], 0);
        assert_eq!(a[&A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED.0], 1, "the shim provides pools itself");
        assert_eq!(a[&A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT.0], 132);
        assert_eq!(a[&A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING.0], 1);
        assert_eq!(a.len(), server.len(), "no attribute is added or dropped");
        let vmm = [
            (A::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY.0, 0),
            (A::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS.0, 1),
            (A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED.0, 1),
        ];
        let first = as_provided(&vmm, 0);
        assert_eq!(first[&A::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY.0], 1, "managed memory over the first server's VMM");
        assert_eq!(first[&A::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS.0], 0, "coherent at synchronisations only");
        assert_eq!(as_provided(&vmm, 1)[&A::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY.0], 0, "a second server's pointers are tagged");
    }

    /// Every feature listed as not provided is in fact not implemented: its entry point
    /// answers CUDA_ERROR_NOT_SUPPORTED (a check that the list is kept in step with lib.rs).
    #[test]
    fn the_features_turned_off_are_not_implemented() {
        for name in [
            "cuMemHostGetDevicePointer_v2",
            "cuLaunchCooperativeKernelMultiDevice",
            "cuStreamWaitValue32_v2",
            "cuMemExportToShareableHandle",
        ] {
            let addr = crate::symbol_address(name).unwrap_or_else(|| panic!("{name} is exported"));
            // SAFETY: an unimplemented entry point reads none of its arguments; calling it with
            // none is how the macro's unsupported stub is reached without a real signature.
            let f: unsafe extern "C" fn() -> CUresult = unsafe { std::mem::transmute(addr) };
            assert_eq!(unsafe { f() }, CUresult::CUDA_ERROR_NOT_SUPPORTED, "{name} is implemented now: update NOT_PROVIDED");
        }
    }
}
