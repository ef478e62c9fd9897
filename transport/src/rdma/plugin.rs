//! The verbs plugin: its C ABI, and loading it at run time.
//!
//! The plugin (`rdma-plugin/`, `librgpu_rdma_plugin.so`) links libibverbs;
//! nothing else in rgpu does. It exports one symbol, [`ENTRY_SYMBOL`], a
//! function returning a pointer to a static [`VerbsVtable`]. The table
//! starts with its ABI version and size, so a server and a plugin from
//! different builds refuse each other instead of calling through a
//! mismatched table. A host without rdma-core fails at `dlopen` (the plugin
//! cannot find libibverbs.so.1); a host without a device reports zero
//! devices; either way the caller falls back to TCP.
//!
//! Every function returns 0 or a negative errno; endpoints are opaque
//! pointers owned by the plugin until `close`.

use std::ffi::{c_char, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::verbs::*;

/// 2: `pkey_index` and `set_pkey_index` (P_Keys per tenant).
pub const ABI_VERSION: u32 = 2;
pub const ENTRY_SYMBOL: &str = "rgpu_rdma_plugin_v1";
/// File name of the plugin library.
pub const LIBRARY_NAME: &str = "librgpu_rdma_plugin.so";

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct RawEndpointInfo {
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    pub _pad: u16,
    pub mtu: u32,
    pub gid: [u8; 16],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct RawSge {
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
}

pub const OP_SEND: u32 = 0;
pub const OP_WRITE_IMM: u32 = 1;
pub const OP_READ: u32 = 2;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct RawWr {
    pub opcode: u32,
    pub imm: u32,
    pub local: RawSge,
    pub remote_addr: u64,
    pub rkey: u32,
    pub _pad: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct RawMr {
    pub addr: u64,
    pub len: u64,
    pub lkey: u32,
    pub rkey: u32,
    pub handle: u64,
}

/// Completion statuses on the ABI (the plugin maps `ibv_wc_status` here).
pub const ST_SUCCESS: u32 = 0;
pub const ST_LOC_PROT: u32 = 1;
pub const ST_LOC_LEN: u32 = 2;
pub const ST_REM_ACCESS: u32 = 3;
pub const ST_REM_INV_REQ: u32 = 4;
pub const ST_RETRY_EXC: u32 = 5;
pub const ST_RNR_RETRY_EXC: u32 = 6;
pub const ST_FLUSH: u32 = 7;
/// Other statuses: `ST_OTHER_BASE + ibv_wc_status`.
pub const ST_OTHER_BASE: u32 = 1000;

pub const WC_SEND: u32 = 0;
pub const WC_WRITE: u32 = 1;
pub const WC_READ: u32 = 2;
pub const WC_RECV: u32 = 3;
pub const WC_RECV_IMM: u32 = 4;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct RawCompletion {
    pub wr_id: u64,
    pub status: u32,
    pub opcode: u32,
    pub byte_len: u32,
    pub imm: u32,
    pub has_imm: u32,
    pub vendor_err: u32,
}

/// Options for opening an endpoint.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct RawOpenOptions {
    /// NUL-terminated device name, or null for the first device.
    pub device: *const c_char,
    pub port: u8,
    pub gid_index: i32,
    /// Queue depths.
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
}

pub type Ep = *mut c_void;

/// The table the plugin hands back. Append-only: a new entry means a new
/// `ABI_VERSION`.
#[repr(C)]
pub struct VerbsVtable {
    pub abi_version: u32,
    pub size: u32,
    /// Devices present (>= 0) or -errno.
    pub device_count: unsafe extern "C" fn() -> i32,
    /// Writes a description of the device that `open` would use.
    pub describe: unsafe extern "C" fn(opts: *const RawOpenOptions, buf: *mut c_char, len: usize) -> i32,
    pub open: unsafe extern "C" fn(opts: *const RawOpenOptions, out: *mut Ep) -> i32,
    pub close: unsafe extern "C" fn(ep: Ep),
    pub local_info: unsafe extern "C" fn(ep: Ep, out: *mut RawEndpointInfo) -> i32,
    pub connect: unsafe extern "C" fn(ep: Ep, remote: *const RawEndpointInfo) -> i32,
    pub reg_mr: unsafe extern "C" fn(ep: Ep, addr: *mut u8, len: usize, access: u32, out: *mut RawMr) -> i32,
    pub dereg_mr: unsafe extern "C" fn(ep: Ep, mr: *const RawMr) -> i32,
    pub post_recv: unsafe extern "C" fn(ep: Ep, wr_id: u64, sge: *const RawSge) -> i32,
    pub post_send: unsafe extern "C" fn(ep: Ep, wr_id: u64, wr: *const RawWr) -> i32,
    /// Completions written (>= 0) or -errno.
    pub poll_cq: unsafe extern "C" fn(ep: Ep, out: *mut RawCompletion, n: u32) -> i32,
    pub arm_cq: unsafe extern "C" fn(ep: Ep) -> i32,
    /// 1: event, 0: timeout, or -errno.
    pub wait_cq: unsafe extern "C" fn(ep: Ep, timeout_ms: u32) -> i32,
    pub disconnect: unsafe extern "C" fn(ep: Ep),
    /// Writes the index of `pkey` in the port's P_Key table to `out`;
    /// -ENOENT if the port is not in that partition.
    pub pkey_index: unsafe extern "C" fn(ep: Ep, pkey: u16, out: *mut u16) -> i32,
    /// INIT -> INIT with that P_Key index (before `connect`).
    pub set_pkey_index: unsafe extern "C" fn(ep: Ep, index: u16) -> i32,
}

pub type EntryFn = unsafe extern "C" fn() -> *const VerbsVtable;

fn errno_msg(rc: i32) -> String {
    std::io::Error::from_raw_os_error(-rc).to_string()
}

fn check(op: &'static str, rc: i32) -> Result<i32, VerbsError> {
    if rc < 0 {
        Err(VerbsError::op(op, errno_msg(rc)))
    } else {
        Ok(rc)
    }
}

pub fn status_from_raw(s: u32) -> WcStatus {
    match s {
        ST_SUCCESS => WcStatus::Success,
        ST_LOC_PROT => WcStatus::LocalProtection,
        ST_LOC_LEN => WcStatus::LocalLength,
        ST_REM_ACCESS => WcStatus::RemoteAccess,
        ST_REM_INV_REQ => WcStatus::RemoteInvalidRequest,
        ST_RETRY_EXC => WcStatus::RetryExceeded,
        ST_RNR_RETRY_EXC => WcStatus::RnrRetryExceeded,
        ST_FLUSH => WcStatus::Flushed,
        o => WcStatus::Other(o.saturating_sub(ST_OTHER_BASE)),
    }
}

fn opcode_from_raw(o: u32) -> WcOpcode {
    match o {
        WC_SEND => WcOpcode::Send,
        WC_WRITE => WcOpcode::Write,
        WC_READ => WcOpcode::Read,
        WC_RECV_IMM => WcOpcode::RecvImm,
        _ => WcOpcode::Recv,
    }
}

/// A loaded plugin. Kept alive by every endpoint opened from it.
pub struct Plugin {
    vt: &'static VerbsVtable,
    path: PathBuf,
    // Declared last: unloaded after everything that calls into it.
    _lib: libloading::Library,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Plugin({})", self.path.display())
    }
}

impl Plugin {
    /// Loads the plugin at `path` and checks its ABI.
    pub fn load(path: &Path) -> Result<Plugin, VerbsError> {
        // SAFETY: loading runs the library's initialisers; ours has none
        // beyond libibverbs' own.
        let lib = unsafe { libloading::Library::new(path) }
            .map_err(|e| VerbsError::NotAvailable(format!("cannot load {}: {e}", path.display())))?;
        // SAFETY: the symbol has this type in every plugin of ABI 1; the
        // version check below catches any other.
        let vt = unsafe {
            let entry: libloading::Symbol<'_, EntryFn> = lib
                .get(ENTRY_SYMBOL.as_bytes())
                .map_err(|e| VerbsError::NotAvailable(format!("{} is not an rgpu verbs plugin: {e}", path.display())))?;
            entry()
        };
        if vt.is_null() {
            return Err(VerbsError::NotAvailable(format!("{} returned no table", path.display())));
        }
        // SAFETY: non-null, and the plugin's table is static.
        let vt: &'static VerbsVtable = unsafe { &*vt };
        if vt.abi_version != ABI_VERSION || (vt.size as usize) < std::mem::size_of::<VerbsVtable>() {
            return Err(VerbsError::NotAvailable(format!(
                "{} has ABI {} (size {}), we need {ABI_VERSION} (size {})",
                path.display(),
                vt.abi_version,
                vt.size,
                std::mem::size_of::<VerbsVtable>()
            )));
        }
        Ok(Plugin { vt, path: path.to_path_buf(), _lib: lib })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn device_count(&self) -> Result<usize, VerbsError> {
        // SAFETY: table checked at load.
        check("ibv_get_device_list", unsafe { (self.vt.device_count)() }).map(|n| n as usize)
    }
}

/// Where to look for the plugin: `$RGPU_RDMA_PLUGIN` if set, else next to
/// the running executable, next to the library this code is linked into
/// (the shim), then the dynamic linker's own search.
pub fn candidates() -> Vec<PathBuf> {
    if let Some(p) = std::env::var_os("RGPU_RDMA_PLUGIN") {
        return vec![PathBuf::from(p)];
    }
    let mut v = Vec::new();
    if let Some(d) = std::env::current_exe().ok().and_then(|p| p.parent().map(Path::to_path_buf)) {
        v.push(d.join(LIBRARY_NAME));
        // Test binaries live in target/<profile>/deps.
        if d.ends_with("deps") {
            if let Some(up) = d.parent() {
                v.push(up.join(LIBRARY_NAME));
            }
        }
    }
    if let Some(d) = own_library_dir() {
        let p = d.join(LIBRARY_NAME);
        if !v.contains(&p) {
            v.push(p);
        }
    }
    v.push(PathBuf::from(LIBRARY_NAME));
    v
}

/// The directory of the shared object holding this function, through
/// symbolic links (the shim is reached as `rgpu-driver/libcuda.so.1`).
fn own_library_dir() -> Option<PathBuf> {
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the address and fills `info`.
    let ok = unsafe { libc::dladdr(own_library_dir as *const c_void, &mut info) };
    if ok == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr returns a NUL-terminated path owned by the loader.
    let name = unsafe { CStr::from_ptr(info.dli_fname) }.to_str().ok()?;
    let p = std::fs::canonicalize(name).ok()?;
    p.parent().map(Path::to_path_buf)
}

/// Finds and loads the plugin and checks that a device is present.
pub fn discover() -> Result<Arc<PluginProvider>, VerbsError> {
    let mut last = VerbsError::NotAvailable("no plugin candidates".into());
    for c in candidates() {
        if c.is_absolute() && !c.exists() {
            last = VerbsError::NotAvailable(format!("{} not found", c.display()));
            continue;
        }
        match Plugin::load(&c) {
            Ok(p) => {
                let n = p.device_count()?;
                if n == 0 {
                    return Err(VerbsError::NoDevice);
                }
                return Ok(Arc::new(PluginProvider::new(Arc::new(p), std::env::var("RGPU_RDMA_DEVICE").ok())));
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Opens endpoints through a loaded plugin.
pub struct PluginProvider {
    plugin: Arc<Plugin>,
    device: Option<CString>,
    port: u8,
    gid_index: i32,
}

impl PluginProvider {
    /// `device`: "mlx5_0" or "mlx5_0:1" (port), or None for the first.
    pub fn new(plugin: Arc<Plugin>, device: Option<String>) -> PluginProvider {
        let (name, port) = match device.as_deref().and_then(|d| d.split_once(':')) {
            Some((n, p)) => (Some(n.to_string()), p.parse().unwrap_or(1)),
            None => (device, 1),
        };
        let gid_index = std::env::var("RGPU_RDMA_GID_INDEX").ok().and_then(|v| v.parse().ok()).unwrap_or(-1);
        PluginProvider { plugin, device: name.and_then(|n| CString::new(n).ok()), port, gid_index }
    }

    fn opts(&self) -> RawOpenOptions {
        RawOpenOptions {
            device: self.device.as_ref().map(|c| c.as_ptr()).unwrap_or(std::ptr::null()),
            port: self.port,
            gid_index: self.gid_index,
            max_send_wr: 512,
            max_recv_wr: 512,
        }
    }
}

impl VerbsProvider for PluginProvider {
    fn describe(&self) -> String {
        let mut buf = [0 as c_char; 256];
        let o = self.opts();
        // SAFETY: table checked at load; buf is writable for its length.
        let rc = unsafe { (self.plugin.vt.describe)(&o, buf.as_mut_ptr(), buf.len()) };
        let what = if rc >= 0 {
            // SAFETY: the plugin NUL-terminates within `len`.
            unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()
        } else {
            "device ?".into()
        };
        format!("{what} via {}", self.plugin.path.display())
    }

    fn open(&self) -> Result<Box<dyn Verbs>, VerbsError> {
        let mut ep: Ep = std::ptr::null_mut();
        let o = self.opts();
        // SAFETY: table checked at load; `ep` is written on success.
        check("open", unsafe { (self.plugin.vt.open)(&o, &mut ep) })?;
        if ep.is_null() {
            return Err(VerbsError::op("open", "plugin returned no endpoint"));
        }
        let mut info = RawEndpointInfo::default();
        // SAFETY: ep is live.
        if let Err(e) = check("query", unsafe { (self.plugin.vt.local_info)(ep, &mut info) }) {
            unsafe { (self.plugin.vt.close)(ep) };
            return Err(e);
        }
        Ok(Box::new(PluginVerbs { plugin: self.plugin.clone(), ep, info, port: self.port.max(1) }))
    }
}

/// One endpoint of the plugin.
pub struct PluginVerbs {
    plugin: Arc<Plugin>,
    ep: Ep,
    info: RawEndpointInfo,
    port: u8,
}

// SAFETY: an endpoint is used by one thread at a time (&mut self), and the
// plugin's endpoint holds no thread-affine state.
unsafe impl Send for PluginVerbs {}

impl Drop for PluginVerbs {
    fn drop(&mut self) {
        // SAFETY: ep is live until here.
        unsafe { (self.plugin.vt.close)(self.ep) };
    }
}

impl Verbs for PluginVerbs {
    fn local_info(&self) -> EndpointInfo {
        EndpointInfo { qpn: self.info.qpn, psn: self.info.psn, lid: self.info.lid, gid: self.info.gid, mtu: self.info.mtu }
    }

    fn pkey_index(&self, pkey: u16) -> Result<u16, VerbsError> {
        let mut out = 0u16;
        // SAFETY: ep is live; out is writable.
        let rc = unsafe { (self.plugin.vt.pkey_index)(self.ep, pkey, &mut out) };
        if rc == -libc::ENOENT {
            return Err(VerbsError::NoPkey { pkey, port: self.port });
        }
        check("ibv_query_pkey", rc).map(|_| out)
    }

    fn set_pkey_index(&mut self, index: u16) -> Result<(), VerbsError> {
        // SAFETY: ep is live.
        check("modify_qp(INIT)", unsafe { (self.plugin.vt.set_pkey_index)(self.ep, index) }).map(drop)
    }

    fn connect(&mut self, r: &EndpointInfo) -> Result<(), VerbsError> {
        let raw = RawEndpointInfo { qpn: r.qpn, psn: r.psn, lid: r.lid, _pad: 0, mtu: r.mtu, gid: r.gid };
        // SAFETY: ep is live.
        check("modify_qp", unsafe { (self.plugin.vt.connect)(self.ep, &raw) }).map(drop)
    }

    unsafe fn reg_mr(&mut self, addr: *mut u8, len: usize, access: Access) -> Result<MemoryRegion, VerbsError> {
        let mut out = RawMr::default();
        // SAFETY: forwarded to our caller (reg_mr's contract).
        check("ibv_reg_mr", unsafe { (self.plugin.vt.reg_mr)(self.ep, addr, len, access.0, &mut out) })?;
        Ok(MemoryRegion { addr: out.addr, len: out.len as usize, lkey: out.lkey, rkey: out.rkey, handle: out.handle })
    }

    fn dereg_mr(&mut self, mr: &MemoryRegion) -> Result<(), VerbsError> {
        let raw = RawMr { addr: mr.addr, len: mr.len as u64, lkey: mr.lkey, rkey: mr.rkey, handle: mr.handle };
        // SAFETY: ep is live; the plugin checks the handle is its own.
        check("ibv_dereg_mr", unsafe { (self.plugin.vt.dereg_mr)(self.ep, &raw) }).map(drop)
    }

    fn post_recv(&mut self, wr_id: u64, s: Sge) -> Result<(), VerbsError> {
        let sge = RawSge { addr: s.addr, len: s.len, lkey: s.lkey };
        // SAFETY: ep is live.
        check("ibv_post_recv", unsafe { (self.plugin.vt.post_recv)(self.ep, wr_id, &sge) }).map(drop)
    }

    fn post_send(&mut self, wr_id: u64, wr: &WorkRequest) -> Result<(), VerbsError> {
        let s = |l: &Sge| RawSge { addr: l.addr, len: l.len, lkey: l.lkey };
        let raw = match wr {
            WorkRequest::Send { local } => RawWr { opcode: OP_SEND, local: s(local), ..Default::default() },
            WorkRequest::WriteImm { local, remote_addr, rkey, imm } => RawWr {
                opcode: OP_WRITE_IMM,
                imm: *imm,
                local: s(local),
                remote_addr: *remote_addr,
                rkey: *rkey,
                _pad: 0,
            },
            WorkRequest::Read { local, remote_addr, rkey } => {
                RawWr { opcode: OP_READ, local: s(local), remote_addr: *remote_addr, rkey: *rkey, ..Default::default() }
            }
        };
        // SAFETY: ep is live.
        check("ibv_post_send", unsafe { (self.plugin.vt.post_send)(self.ep, wr_id, &raw) }).map(drop)
    }

    fn poll_cq(&mut self, out: &mut [Completion]) -> Result<usize, VerbsError> {
        let mut raw = [RawCompletion::default(); 16];
        let n = out.len().min(raw.len());
        // SAFETY: ep is live; raw has room for n.
        let got = check("ibv_poll_cq", unsafe { (self.plugin.vt.poll_cq)(self.ep, raw.as_mut_ptr(), n as u32) })?
            as usize;
        for (o, r) in out.iter_mut().zip(&raw[..got.min(n)]) {
            *o = Completion {
                wr_id: r.wr_id,
                status: status_from_raw(r.status),
                opcode: opcode_from_raw(r.opcode),
                byte_len: r.byte_len,
                imm: (r.has_imm != 0).then_some(r.imm),
            };
        }
        Ok(got.min(n))
    }

    fn arm_cq(&mut self) -> Result<(), VerbsError> {
        // SAFETY: ep is live.
        check("ibv_req_notify_cq", unsafe { (self.plugin.vt.arm_cq)(self.ep) }).map(drop)
    }

    fn wait_cq(&mut self, timeout: Duration) -> Result<bool, VerbsError> {
        let ms = timeout.as_millis().min(u32::MAX as u128) as u32;
        // SAFETY: ep is live.
        check("ibv_get_cq_event", unsafe { (self.plugin.vt.wait_cq)(self.ep, ms) }).map(|r| r == 1)
    }

    fn disconnect(&mut self) {
        // SAFETY: ep is live.
        unsafe { (self.plugin.vt.disconnect)(self.ep) }
    }
}
