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
            let attributes = d.attributes.iter().copied().collect();
            let limits = Limits::from(&attributes);
            devices.push(Device { server: i, remote: d, attributes, limits });
        }
        servers.push(Server { conn });
    }
    if devices.is_empty() {
        eprintln!("rgpu: the configured servers ({list}) export no device");
        return Err(CuError::NO_DEVICE);
    }
    Ok(Runtime { servers, devices })
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
    }
}

/// A CUresult the server sent, as an error (0 cannot be an error; treat a
/// confused peer as an unknown failure).
pub fn error_from_code(code: u32) -> CuError {
    std::num::NonZeroU32::new(code).map(CuError).unwrap_or(CuError::UNKNOWN)
}
