//! The cuda backend: the host's real GPUs, through NVIDIA's driver API
//! (cudarc's `driver::sys`, loaded at run time).
//!
//! - Every device of the host is exported with the driver's own name, UUID,
//!   PCI ids and attribute values.
//! - Each session gets its own context on each device it touches (created on
//!   first use, destroyed with the session), so sessions are isolated as two
//!   processes are. Streams and events are the session's handle tables over
//!   raw `CUstream`/`CUevent`s; the default stream is the context's legacy
//!   stream.
//! - Memory is counted per session and, for a session admitted by a lease,
//!   against the lease's budget shared by all its sessions on this server;
//!   an allocation past it fails with `CUDA_ERROR_OUT_OF_MEMORY`, and
//!   `cuMemGetInfo` then reports the lease's remainder and limit. Memory a
//!   session frees, or leaves behind, is zeroed before it goes back to the
//!   driver; if that cannot be done (a context
//!   broken by a faulting kernel), every later allocation on that device is
//!   zeroed before it is handed out.
//! - Modules are context-independent libraries shared through
//!   [`library::LibraryCache`]; parameter layouts come from
//!   `cuFuncGetParamInfo`.
//! - Host-to-device and device-to-host copies go through two pinned staging
//!   buffers per session (taken from a server-wide pool, allocated once):
//!   while the copy engine moves one chunk, the connection fills or drains
//!   the other.
//!
//! - Every kernel is timed by a pair of events ([`watch`]): metering counts
//!   its device time, and the kernels of fractional leases sharing a device
//!   take turns by that time ([`share`]).
//!
//! Every driver call goes through [`driver::cu`], which turns its `CUresult`
//! into a [`CuResult`]; the driver library is checked by
//! [`driver::preflight`] before cudarc's first call, so cudarc never panics.

pub mod driver;
pub mod health;
pub mod telemetry;
pub mod library;
mod peek;
pub mod placed;
pub(crate) mod share;
pub mod vmm;
pub(crate) mod watch;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{c_void, CString};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use cudarc::driver::sys;
use tracing::{debug, info, warn};

use self::driver::{cu, CudaInitError, DriverLibrary};
use self::library::{Library, LibraryCache};
use self::share::Who;
use self::watch::{DeviceWatch, Entry, Pair, Spare};
use super::{
    Backend, BackendSession, DeviceInfo, EventToken, GlobalInfo, LaunchDims, LoadedModule, MemoryAccount,
    KernelTimer, MemoryBudget, MemsetOp,
    ModuleToken, PhysicalToken, StreamRef, StreamToken, TransferError,
};
use rgpu_cuda_types::{CuError, CuResult};
use crate::module::ModuleImage;

/// Bytes of one pinned staging buffer; a session uses two.
pub const STAGING_CHUNK: usize = 4 << 20;

/// `CU_MEMHOSTALLOC_PORTABLE`: pinned for every context, not only the one
/// that allocated it.
const MEMHOSTALLOC_PORTABLE: u32 = 0x1;
/// `CU_EVENT_DISABLE_TIMING`.
const EVENT_DISABLE_TIMING: u32 = 0x2;

/// A raw driver handle or pinned pointer, usable from any thread (the
/// driver's handles are; who may use an object is the session's business).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Raw<T>(pub(crate) T);
// SAFETY: see the type's comment; nothing here is dereferenced except pinned
// buffers, which only their owning session touches.
unsafe impl<T> Send for Raw<T> {}
unsafe impl<T> Sync for Raw<T> {}

/// One pinned host buffer of [`STAGING_CHUNK`] bytes.
struct Pinned(Raw<*mut u8>);

struct Shared {
    driver: DriverLibrary,
    devices: Vec<DeviceInfo>,
    handles: Vec<sys::CUdevice>,
    /// Device 0's primary context, retained for the server's lifetime:
    /// the staging buffers are allocated in it.
    staging_ctx: Raw<sys::CUcontext>,
    staging_pool: Mutex<Vec<Pinned>>,
    libraries: Mutex<LibraryCache>,
    /// Per device: zero every allocation before handing it out, because
    /// memory left by a session could not be zeroed.
    scrub_on_alloc: Vec<AtomicBool>,
    /// The devices' health, as NVML reports it.
    health: health::NvmlHealth,
    /// The devices' utilization, temperature and power, as NVML reads them.
    telemetry: telemetry::NvmlTelemetry,
    /// Per device: its kernels in flight and its sharing groups' turns.
    watch: Vec<Arc<DeviceWatch>>,
    /// Client memory is placed ([`placed`]), so sessions can move.
    movable: bool,
}

impl Shared {
    fn take_staging(&self) -> CuResult<Pinned> {
        if let Some(p) = self.staging_pool.lock().unwrap_or_else(|e| e.into_inner()).pop() {
            return Ok(p);
        }
        cu!(sys::cuCtxSetCurrent(self.staging_ctx.0))?;
        let mut p: *mut c_void = std::ptr::null_mut();
        cu!(sys::cuMemHostAlloc(&mut p, STAGING_CHUNK, MEMHOSTALLOC_PORTABLE))?;
        if p.is_null() {
            return Err(CuError::OUT_OF_MEMORY);
        }
        debug!(bytes = STAGING_CHUNK, "pinned staging buffer allocated");
        Ok(Pinned(Raw(p as *mut u8)))
    }

    fn give_staging(&self, p: Pinned) {
        self.staging_pool.lock().unwrap_or_else(|e| e.into_inner()).push(p);
    }

    fn libraries(&self) -> std::sync::MutexGuard<'_, LibraryCache> {
        self.libraries.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.libraries().clear();
        for p in self.staging_pool.get_mut().unwrap_or_else(|e| e.into_inner()).drain(..) {
            let _ = cu!(sys::cuMemFreeHost(p.0 .0 as *mut c_void));
        }
        if let Some(&dev) = self.handles.first() {
            let _ = cu!(sys::cuDevicePrimaryCtxRelease_v2(dev));
        }
    }
}

pub struct CudaBackend {
    shared: Arc<Shared>,
}

impl CudaBackend {
    /// Finds the driver, initialises it and lists the devices; fails (never
    /// panics) when there is no usable driver or no device. With `movable`,
    /// client memory is placed so that sessions can be checkpointed and
    /// migrated ([`placed`]).
    pub fn new(movable: bool) -> Result<CudaBackend, CudaInitError> {
        let driver = driver::preflight()?;
        let (devices, handles) = driver::init_and_list(&driver)?;
        let path = driver.path.clone();
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        cu!(sys::cuDevicePrimaryCtxRetain(&mut ctx, handles[0])).map_err(|err| CudaInitError::Query {
            what: "cuDevicePrimaryCtxRetain",
            err,
            path: path.clone(),
        })?;
        info!(driver = %path, devices = devices.len(), movable, "cuda backend ready");
        let n = devices.len();
        let uuids: Vec<[u8; 16]> = devices.iter().map(|d| d.uuid).collect();
        Ok(CudaBackend {
            shared: Arc::new(Shared {
                driver,
                devices,
                handles,
                staging_ctx: Raw(ctx),
                staging_pool: Mutex::new(Vec::new()),
                libraries: Mutex::new(LibraryCache::default()),
                scrub_on_alloc: (0..n).map(|_| AtomicBool::new(false)).collect(),
                health: health::NvmlHealth::open(&uuids),
                telemetry: telemetry::NvmlTelemetry::new(&uuids),
                watch: (0..n as u32).map(DeviceWatch::new).collect(),
                movable,
            }),
        })
    }

    /// The driver library in use (its resolved path).
    pub fn driver_path(&self) -> &str {
        &self.shared.driver.path
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn devices(&self) -> &[DeviceInfo] {
        &self.shared.devices
    }

    fn health(&self) -> Vec<crate::health::DeviceHealth> {
        self.shared.health.health()
    }

    fn kernel_times_known(&self) -> bool {
        true
    }

    fn telemetry(&self) -> Vec<crate::telemetry::DeviceTelemetry> {
        self.shared.telemetry.read()
    }

    fn open_session(&self, budget: Option<Arc<MemoryBudget>>) -> CuResult<Box<dyn BackendSession>> {
        // Nothing touches the driver here: contexts are created on the
        // session's own thread, on first use of each device.
        static SESSIONS: AtomicU64 = AtomicU64::new(1);
        let n = self.shared.devices.len();
        Ok(Box::new(CudaSession {
            id: SESSIONS.fetch_add(1, Ordering::Relaxed),
            shared: self.shared.clone(),
            account: MemoryAccount::new(budget),
            ctxs: (0..n).map(|_| None).collect(),
            current: None,
            bound_on: 0,
            allocs: BTreeMap::new(),
            streams: HashMap::new(),
            events: HashMap::new(),
            marks: HashMap::new(),
            probes: HashMap::new(),
            placed: placed::Arena::default(),
            peekable: Arc::new(RwLock::new(peek::Peekable::new(n))),
            modules: HashMap::new(),
            seen_libraries: HashSet::new(),
            staging: Vec::new(),
            next_token: 1,
            vmm: vmm::CudaVmm::default(),
            gate: None,
            timer: None,
            in_flight: Arc::new(AtomicUsize::new(0)),
        }))
    }
}

/// The session's context on one device, with the events that mark when
/// each staging buffer is free again.
struct DevCtx {
    ctx: sys::CUcontext,
    staging_events: [sys::CUevent; 2],
    /// Timing events of kernels that have ended, for the next launches.
    spare: Spare,
}

struct Staging {
    buf: Pinned,
    /// The device whose staging event marks the buffer's last copy.
    pending: Option<u32>,
}

struct ModuleEntry {
    device: u32,
    library: Arc<Library>,
    /// Per function (in the order reported): the function in this
    /// session's context and its parameter offsets.
    functions: Vec<(sys::CUfunction, Vec<u32>)>,
    /// (pointer, size) of each global, charged to the session's account.
    globals: Vec<(u64, u64)>,
}

/// An event as a checkpoint sees it. A restored event is recorded again when it is rebuilt,
/// later than its record before: `shift_ms` is how much later, taken off its times until it
/// is recorded anew.
#[derive(Debug, Clone, Copy)]
struct EventMark {
    timed: bool,
    recorded: bool,
    /// Restored and not recorded since.
    restored: bool,
    shift_ms: f64,
}

struct CudaSession {
    /// Names the session's kernels in the devices' watches.
    id: u64,
    shared: Arc<Shared>,
    /// Bytes the client allocated and has not freed, and its modules'
    /// globals, counted against its lease (if any); given back to the lease
    /// after the session's `Drop` has freed them.
    account: MemoryAccount,
    ctxs: Vec<Option<DevCtx>>,
    /// The device whose context is current on this thread, if known.
    current: Option<u32>,
    /// The thread `current` is current on ([`this_thread`]).
    bound_on: u64,
    /// ptr -> (device, size) of the client's allocations.
    allocs: BTreeMap<u64, (u32, u64)>,
    streams: HashMap<u64, (u32, sys::CUstream)>,
    events: HashMap<u64, (u32, sys::CUevent)>,
    /// What a checkpoint needs of each event beyond the driver's handle.
    marks: HashMap<u64, EventMark>,
    /// Per device, the event a checkpoint times the session's events against: one instant
    /// for all of them, so that their times apart travel exactly. Taken afresh by each
    /// capture (which starts with [`BackendSession::quiesce`]).
    probes: HashMap<u32, sys::CUevent>,
    /// The regions of movable memory and the client allocations in them.
    placed: placed::Arena,
    /// What other threads may read of it while the session runs (a migration's pre-copy).
    peekable: Arc<RwLock<peek::Peekable>>,
    modules: HashMap<u64, ModuleEntry>,
    /// (library, device) pairs whose globals this session's context has had:
    /// loading one again re-initialises them.
    seen_libraries: HashSet<(u64, u32)>,
    staging: Vec<Staging>,
    next_token: u64,
    /// Reservations, physical allocations and maps (cuMemCreate, cuMemMap, ...).
    vmm: vmm::CudaVmm,
    /// The sharing group its kernels take turns in: a fractional lease's.
    /// Whole leases own their GPU and sessions without a lease share as
    /// processes do, so neither waits for a turn.
    gate: Option<Who>,
    timer: Option<KernelTimer>,
    /// Its kernels launched and not yet seen to end.
    in_flight: Arc<AtomicUsize>,
}

// SAFETY: the raw handles are driver objects usable from any thread; the
// session is used by one thread at a time (`&mut self`).
unsafe impl Send for CudaSession {}

impl CudaSession {
    fn token(&mut self) -> u64 {
        let t = self.next_token;
        self.next_token += 1;
        t
    }

    /// Makes the session's context on `device` current, creating it first.
    fn bind(&mut self, device: u32) -> CuResult {
        let slot = self.ctxs.get(device as usize).ok_or(CuError::INVALID_DEVICE)?;
        if slot.is_none() {
            let dev = self.shared.handles[device as usize];
            let mut ctx: sys::CUcontext = std::ptr::null_mut();
            cu!(sys::cuCtxCreate_v2(&mut ctx, 0, dev))?;
            let mut evs = [std::ptr::null_mut(); 2];
            for e in &mut evs {
                if let Err(err) = cu!(sys::cuEventCreate(e, EVENT_DISABLE_TIMING)) {
                    let _ = cu!(sys::cuCtxDestroy_v2(ctx));
                    self.current = None;
                    return Err(err);
                }
            }
            debug!(device, "session context created");
            self.ctxs[device as usize] = Some(DevCtx { ctx, staging_events: evs, spare: Spare::default() });
            self.peek_tables().ctxs[device as usize] = Some(Raw(ctx));
            self.current = Some(device);
            self.bound_on = this_thread();
            return Ok(());
        }
        // A session rebuilt from a snapshot is served by another thread than the one that
        // rebuilt it, and a context is current per thread.
        let here = this_thread();
        if self.current != Some(device) || self.bound_on != here {
            let ctx = self.ctxs[device as usize].as_ref().map_or(std::ptr::null_mut(), |c| c.ctx);
            cu!(sys::cuCtxSetCurrent(ctx))?;
            self.current = Some(device);
            self.bound_on = here;
        }
        Ok(())
    }

    fn has_ctx(&self, device: u32) -> CuResult<bool> {
        self.ctxs.get(device as usize).map(Option::is_some).ok_or(CuError::INVALID_DEVICE)
    }

    /// The device and raw stream of `s`, with its context made current.
    fn stream(&mut self, s: StreamRef) -> CuResult<sys::CUstream> {
        let (device, raw) = match s {
            StreamRef::Default { device } => (device, std::ptr::null_mut()),
            StreamRef::Created(t) => *self.streams.get(&t.0).ok_or(CuError::INVALID_HANDLE)?,
        };
        self.bind(device)?;
        Ok(raw)
    }

    fn event(&self, e: EventToken) -> CuResult<(u32, sys::CUevent)> {
        self.events.get(&e.0).copied().ok_or(CuError::INVALID_HANDLE)
    }

    /// Takes the session's two staging buffers from the pool (once).
    fn ensure_staging(&mut self) -> CuResult {
        while self.staging.len() < 2 {
            let buf = self.shared.take_staging();
            // take_staging may have switched contexts.
            self.current = None;
            self.staging.push(Staging { buf: buf?, pending: None });
        }
        Ok(())
    }

    /// Waits until staging buffer `i` is no longer read or written by a copy.
    fn wait_staging(&mut self, i: usize) -> CuResult {
        if let Some(d) = self.staging[i].pending {
            let ev = self.ctxs[d as usize].as_ref().ok_or(CuError::INVALID_CONTEXT)?.staging_events[i];
            cu!(sys::cuEventSynchronize(ev))?;
            self.staging[i].pending = None;
        }
        Ok(())
    }

    /// Marks staging buffer `i` busy until the work queued on `stream` so far is done.
    fn mark_staging(&mut self, i: usize, device: u32, stream: sys::CUstream) -> CuResult {
        let ev = self.ctxs[device as usize].as_ref().ok_or(CuError::INVALID_CONTEXT)?.staging_events[i];
        cu!(sys::cuEventRecord(ev, stream))?;
        self.staging[i].pending = Some(device);
        Ok(())
    }

    fn stream_device(&self, s: StreamRef) -> CuResult<u32> {
        match s {
            StreamRef::Default { device } => Ok(device),
            StreamRef::Created(t) => self.streams.get(&t.0).map(|s| s.0).ok_or(CuError::INVALID_HANDLE),
        }
    }

    /// Zeroes `[ptr, ptr + len)` in stream order on the context's legacy
    /// stream (after all earlier work of the context's blocking streams).
    fn zero(&mut self, device: u32, ptr: u64, len: u64) -> CuResult {
        self.bind(device)?;
        cu!(sys::cuMemsetD8_v2(ptr, 0, len as usize))
    }

    /// Writes a module global's initial bytes (zeros where it has none).
    fn init_global(&mut self, device: u32, ptr: u64, size: u64, init: Option<&[u8]>) -> CuResult {
        self.bind(device)?;
        let n = init.map_or(0, |i| (i.len() as u64).min(size));
        if n > 0 {
            let bytes = &init.unwrap_or(&[])[..n as usize];
            cu!(sys::cuMemcpyHtoD_v2(ptr, bytes.as_ptr() as *const c_void, n as usize))?;
        }
        if size > n {
            cu!(sys::cuMemsetD8_v2(ptr + n, 0, (size - n) as usize))?;
        }
        Ok(())
    }

    /// `cuMemAlloc` on `device`, zeroed first when the device needs it.
    fn alloc_device(&mut self, device: u32, bytes: usize) -> CuResult<u64> {
        self.bind(device)?;
        let mut p: sys::CUdeviceptr = 0;
        cu!(sys::cuMemAlloc_v2(&mut p, bytes))?;
        if self.shared.scrub_on_alloc[device as usize].load(Ordering::Relaxed) {
            // Completed before the client can queue work on any stream.
            let r = cu!(sys::cuMemsetD8_v2(p, 0, bytes))
                .and_then(|()| cu!(sys::cuStreamSynchronize(std::ptr::null_mut())));
            if let Err(e) = r {
                let _ = cu!(sys::cuMemFree_v2(p));
                return Err(e);
            }
        }
        Ok(p)
    }

    fn release_module(&mut self, m: ModuleEntry) {
        self.account.give(m.globals.iter().fold(0u64, |n, &(_, size)| n.saturating_add(size)));
        for &(p, size) in &m.globals {
            if let Err(e) = self.zero(m.device, p, size) {
                warn!(device = m.device, "cannot zero a module global at unload: {e}");
                self.shared.scrub_on_alloc[m.device as usize].store(true, Ordering::Relaxed);
            }
        }
        self.shared.libraries().release(&m.library);
    }
}

impl BackendSession for CudaSession {
    fn mem_alloc(&mut self, device: u32, size: u64) -> CuResult<u64> {
        let bytes = usize::try_from(size).map_err(|_| CuError::OUT_OF_MEMORY)?;
        self.account.take(size)?;
        let made = if self.shared.movable { self.placed_alloc(device, size) } else { self.alloc_device(device, bytes) };
        match made {
            Ok(p) => {
                self.allocs.insert(p, (device, size));
                Ok(p)
            }
            Err(e) => {
                self.account.give(size);
                Err(e)
            }
        }
    }

    fn mem_free(&mut self, ptr: u64) -> CuResult {
        let &(device, size) = self.allocs.get(&ptr).ok_or(CuError::INVALID_VALUE)?;
        if self.placed.holds(ptr) {
            self.placed_free_zeroed(device, ptr, size);
        } else {
            // Zeroed after every earlier use (cuMemFree waits for the device),
            // so the next owner of these bytes never sees them.
            if let Err(e) = self.zero(device, ptr, size) {
                warn!(device, "cannot zero freed memory: {e}; later allocations on the device are zeroed instead");
                self.shared.scrub_on_alloc[device as usize].store(true, Ordering::Relaxed);
            }
            cu!(sys::cuMemFree_v2(ptr))?;
        }
        self.allocs.remove(&ptr);
        self.account.give(size);
        Ok(())
    }

    fn mem_get_info(&mut self, device: u32) -> CuResult<(u64, u64)> {
        self.bind(device)?;
        let (mut free, mut total) = (0usize, 0usize);
        cu!(sys::cuMemGetInfo_v2(&mut free, &mut total))?;
        let (free, total) = (free as u64, total as u64);
        Ok(self.account.info(free, total))
    }

    fn memcpy_htod(
        &mut self,
        stream: StreamRef,
        dst: u64,
        len: u64,
        fill: &mut dyn FnMut(&mut [u8]) -> io::Result<()>,
    ) -> Result<(), TransferError> {
        let device = self.stream_device(stream)?;
        self.ensure_staging()?;
        let s = self.stream(stream)?;
        let mut off = 0u64;
        let mut i = 0usize;
        while off < len {
            let n = (len - off).min(STAGING_CHUNK as u64) as usize;
            self.wait_staging(i)?;
            let p = self.staging[i].buf.0 .0;
            // SAFETY: the buffer is STAGING_CHUNK bytes, owned by this
            // session, and no copy uses it (waited for above).
            let chunk = unsafe { std::slice::from_raw_parts_mut(p, n) };
            fill(chunk).map_err(TransferError::Io)?;
            cu!(sys::cuMemcpyHtoDAsync_v2(dst + off, p as *const c_void, n, s))?;
            self.mark_staging(i, device, s)?;
            off += n as u64;
            i ^= 1;
        }
        Ok(())
    }

    fn memcpy_dtoh(
        &mut self,
        stream: StreamRef,
        src: u64,
        len: u64,
        sink: &mut dyn FnMut(&[u8]) -> io::Result<()>,
    ) -> Result<(), TransferError> {
        let device = self.stream_device(stream)?;
        self.ensure_staging()?;
        let s = self.stream(stream)?;
        let chunk = STAGING_CHUNK as u64;
        let chunks = len.div_ceil(chunk);
        let size_of = |k: u64| (len - k * chunk).min(chunk) as usize;
        // Chunk k goes through buffer k % 2; two are in flight at a time.
        let issue = |this: &mut Self, k: u64| -> CuResult {
            let i = (k % 2) as usize;
            this.wait_staging(i)?;
            let p = this.staging[i].buf.0 .0;
            cu!(sys::cuMemcpyDtoHAsync_v2(p as *mut c_void, src + k * chunk, size_of(k), s))?;
            this.mark_staging(i, device, s)
        };
        for k in 0..chunks.min(2) {
            issue(self, k)?;
        }
        for k in 0..chunks {
            let i = (k % 2) as usize;
            self.wait_staging(i)?;
            let p = self.staging[i].buf.0 .0;
            // SAFETY: the copy into the buffer is complete (waited for).
            let bytes = unsafe { std::slice::from_raw_parts(p as *const u8, size_of(k)) };
            sink(bytes).map_err(TransferError::Io)?;
            if k + 2 < chunks {
                issue(self, k + 2)?;
            }
        }
        Ok(())
    }

    fn memcpy_dtod(&mut self, stream: StreamRef, dst: u64, src: u64, len: u64) -> CuResult {
        let s = self.stream(stream)?;
        cu!(sys::cuMemcpyDtoDAsync_v2(dst, src, len as usize, s))
    }

    fn memset(&mut self, stream: StreamRef, op: &MemsetOp) -> CuResult {
        op.span().ok_or(CuError::INVALID_VALUE)?;
        let s = self.stream(stream)?;
        let (n, pitch, rows) = (op.count as usize, op.pitch as usize, op.rows as usize);
        match (op.element_size, op.rows) {
            (1, 1) => cu!(sys::cuMemsetD8Async(op.dst, op.value as u8, n, s)),
            (2, 1) => cu!(sys::cuMemsetD16Async(op.dst, op.value as u16, n, s)),
            (4, 1) => cu!(sys::cuMemsetD32Async(op.dst, op.value, n, s)),
            (1, _) => cu!(sys::cuMemsetD2D8Async(op.dst, pitch, op.value as u8, n, rows, s)),
            (2, _) => cu!(sys::cuMemsetD2D16Async(op.dst, pitch, op.value as u16, n, rows, s)),
            (4, _) => cu!(sys::cuMemsetD2D32Async(op.dst, pitch, op.value, n, rows, s)),
            _ => Err(CuError::INVALID_VALUE),
        }
    }

    fn mem_create(&mut self, device: u32, size: u64) -> CuResult<PhysicalToken> {
        self.vmm_create(device, size)
    }

    fn mem_release(&mut self, phys: PhysicalToken) -> CuResult {
        self.vmm_release(phys)
    }

    fn mem_address_reserve(&mut self, size: u64, alignment: u64, hint: u64) -> CuResult<u64> {
        self.vmm_reserve(size, alignment, hint)
    }

    fn mem_address_free(&mut self, ptr: u64, size: u64) -> CuResult {
        self.vmm_address_free(ptr, size)
    }

    fn mem_map(&mut self, ptr: u64, size: u64, offset: u64, phys: PhysicalToken) -> CuResult {
        self.vmm_map(ptr, size, offset, phys)
    }

    fn mem_unmap(&mut self, ptr: u64, size: u64) -> CuResult {
        self.vmm_unmap(ptr, size)
    }

    fn mem_set_access(&mut self, ptr: u64, size: u64, device: u32, flags: u32) -> CuResult {
        self.vmm_set_access(ptr, size, device, flags)
    }

    fn stream_create(&mut self, device: u32, flags: u32, priority: i32) -> CuResult<StreamToken> {
        self.bind(device)?;
        let mut s: sys::CUstream = std::ptr::null_mut();
        cu!(sys::cuStreamCreateWithPriority(&mut s, flags, priority))?;
        let t = self.token();
        self.streams.insert(t, (device, s));
        Ok(StreamToken(t))
    }

    fn stream_destroy(&mut self, stream: StreamToken) -> CuResult {
        let (device, s) = *self.streams.get(&stream.0).ok_or(CuError::INVALID_HANDLE)?;
        self.bind(device)?;
        cu!(sys::cuStreamDestroy_v2(s))?;
        self.streams.remove(&stream.0);
        Ok(())
    }

    fn stream_synchronize(&mut self, stream: StreamRef) -> CuResult {
        if let StreamRef::Default { device } = stream {
            if !self.has_ctx(device)? {
                return Ok(());
            }
        }
        let s = self.stream(stream)?;
        cu!(sys::cuStreamSynchronize(s))
    }

    fn stream_query(&mut self, stream: StreamRef) -> CuResult {
        if let StreamRef::Default { device } = stream {
            if !self.has_ctx(device)? {
                return Ok(());
            }
        }
        let s = self.stream(stream)?;
        cu!(sys::cuStreamQuery(s))
    }

    fn stream_wait_event(&mut self, stream: StreamRef, event: EventToken, flags: u32) -> CuResult {
        let (_, e) = self.event(event)?;
        let s = self.stream(stream)?;
        cu!(sys::cuStreamWaitEvent(s, e, flags))
    }

    fn event_create(&mut self, device: u32, flags: u32) -> CuResult<EventToken> {
        self.bind(device)?;
        let mut e: sys::CUevent = std::ptr::null_mut();
        cu!(sys::cuEventCreate(&mut e, flags))?;
        let t = self.token();
        self.events.insert(t, (device, e));
        self.marks.insert(t, EventMark { timed: flags & EVENT_DISABLE_TIMING == 0, recorded: false, restored: false, shift_ms: 0.0 });
        Ok(EventToken(t))
    }

    fn event_destroy(&mut self, event: EventToken) -> CuResult {
        let (device, e) = self.event(event)?;
        self.bind(device)?;
        cu!(sys::cuEventDestroy_v2(e))?;
        self.events.remove(&event.0);
        self.marks.remove(&event.0);
        Ok(())
    }

    fn event_record(&mut self, event: EventToken, stream: StreamRef) -> CuResult {
        let (_, e) = self.event(event)?;
        let s = self.stream(stream)?;
        cu!(sys::cuEventRecord(e, s))?;
        if let Some(m) = self.marks.get_mut(&event.0) {
            *m = EventMark { recorded: true, restored: false, shift_ms: 0.0, ..*m };
        }
        Ok(())
    }

    fn event_synchronize(&mut self, event: EventToken) -> CuResult {
        let (device, e) = self.event(event)?;
        self.bind(device)?;
        cu!(sys::cuEventSynchronize(e))
    }

    fn event_query(&mut self, event: EventToken) -> CuResult {
        let (device, e) = self.event(event)?;
        self.bind(device)?;
        cu!(sys::cuEventQuery(e))
    }

    fn event_elapsed_time(&mut self, start: EventToken, end: EventToken) -> CuResult<f32> {
        let (device, a) = self.event(start)?;
        let (_, b) = self.event(end)?;
        self.bind(device)?;
        let mut ms = 0f32;
        cu!(sys::cuEventElapsedTime(&mut ms, a, b))?;
        let (a, b) = (self.marks.get(&start.0).copied(), self.marks.get(&end.0).copied());
        let shift = |m: Option<EventMark>| m.map_or(0.0, |m| m.shift_ms);
        // Two events restored together were recorded again moments apart: their time
        // apart is the one measured before, exactly.
        if a.is_some_and(|m| m.restored) && b.is_some_and(|m| m.restored) {
            return Ok((shift(a) - shift(b)) as f32);
        }
        Ok((ms as f64 + shift(a) - shift(b)) as f32)
    }

    fn ctx_synchronize(&mut self, device: u32) -> CuResult {
        if !self.has_ctx(device)? {
            return Ok(());
        }
        self.bind(device)?;
        cu!(sys::cuCtxSynchronize())
    }

    fn reset_context(&mut self, device: u32) -> CuResult<Option<CuError>> {
        if !self.has_ctx(device)? {
            return Ok(None);
        }
        self.bind(device)?;
        let late = cu!(sys::cuCtxSynchronize()).err();
        if late.is_some() {
            // What this context freed may not have been zeroed.
            self.shared.scrub_on_alloc[device as usize].store(true, Ordering::Relaxed);
        }
        self.unwatch(Some(device));
        // The session holds nothing: what is left of its movable memory on the device is
        // spare regions, given back with the context.
        self.placed_teardown_device(device);
        self.forget_peek_context(device);
        let Some(old) = self.ctxs[device as usize].take() else { return Ok(late) };
        self.current = None;
        for s in &mut self.staging {
            if s.pending == Some(device) {
                s.pending = None;
            }
        }
        // A fresh context has none of the libraries' globals yet.
        self.seen_libraries.retain(|&(_, d)| d != device);
        for e in old.staging_events {
            let _ = cu!(sys::cuEventDestroy_v2(e));
        }
        // The next call on `device` creates the session's context anew (`bind`).
        cu!(sys::cuCtxDestroy_v2(old.ctx))?;
        Ok(late)
    }

    fn module_load(
        &mut self,
        device: u32,
        image: &[u8],
        parsed: &ModuleImage,
    ) -> CuResult<(ModuleToken, LoadedModule)> {
        self.bind(device)?;
        let held: Vec<u64> = self
            .modules
            .values()
            .filter(|m| m.device == device)
            .map(|m| m.library.id)
            .collect();
        let library = self.shared.libraries().acquire(image, &held)?;
        // The globals are device memory the session holds: charged to its
        // lease as cuMemAlloc is, and given back at unload.
        let setup = self.module_setup(device, &library, parsed).and_then(|(functions, loaded)| {
            let bytes = loaded.globals.iter().fold(0u64, |n, g| n.saturating_add(g.size));
            self.account.take(bytes).map(|()| (functions, loaded))
        });
        match setup {
            Ok((functions, loaded)) => {
                let t = self.token();
                self.seen_libraries.insert((library.id, device));
                let globals = loaded.globals.iter().map(|g| (g.ptr, g.size)).collect();
                debug!(module = t, library = library.id, kernels = functions.len(), "cuda module loaded");
                self.modules.insert(t, ModuleEntry { device, library, functions, globals });
                Ok((ModuleToken(t), loaded))
            }
            Err(e) => {
                self.shared.libraries().release(&library);
                Err(e)
            }
        }
    }

    fn module_unload(&mut self, module: ModuleToken) -> CuResult {
        let m = self.modules.remove(&module.0).ok_or(CuError::INVALID_HANDLE)?;
        self.release_module(m);
        Ok(())
    }

    fn launch_kernel(
        &mut self,
        module: ModuleToken,
        function: u32,
        dims: &LaunchDims,
        stream: StreamRef,
        params: &[u8],
    ) -> CuResult {
        let m = self.modules.get(&module.0).ok_or(CuError::INVALID_HANDLE)?;
        let (func, offsets) = m.functions.get(function as usize).ok_or(CuError::INVALID_HANDLE)?;
        let func = *func;
        let mut ptrs: Vec<*mut c_void> = Vec::with_capacity(offsets.len());
        for &o in offsets {
            if o as usize > params.len() {
                return Err(CuError::INVALID_VALUE);
            }
            // SAFETY: in bounds of `params` (checked); the driver only reads.
            ptrs.push(unsafe { params.as_ptr().add(o as usize) } as *mut c_void);
        }
        let device = self.stream_device(stream)?;
        let s = self.stream(stream)?;
        let watch = self.shared.watch[device as usize].clone();
        watch.wait_room(&self.in_flight);
        let pair = self.timing_pair(device);
        if let Some(who) = self.gate {
            watch.take_turn(who);
        }
        let kp = if ptrs.is_empty() { std::ptr::null_mut() } else { ptrs.as_mut_ptr() };
        let [gx, gy, gz] = dims.grid;
        let [bx, by, bz] = dims.block;
        let launched = pair.map_or(Ok(()), |p| cu!(sys::cuEventRecord(p[0].0, s))).and_then(|()| {
            if dims.cooperative {
                // The driver checks the grid against the device's occupancy
                // (CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE) and provides the grid barrier.
                cu!(sys::cuLaunchCooperativeKernel(func, gx, gy, gz, bx, by, bz, dims.shared_mem_bytes, s, kp))
            } else {
                cu!(sys::cuLaunchKernel(func, gx, gy, gz, bx, by, bz, dims.shared_mem_bytes, s, kp, std::ptr::null_mut()))
            }
        });
        let watched = launched.and_then(|()| pair.ok_or(CuError::UNKNOWN)).and_then(|p| cu!(sys::cuEventRecord(p[1].0, s)));
        let dc = self.ctxs[device as usize].as_ref().ok_or(CuError::INVALID_CONTEXT)?;
        match (launched, watched, pair) {
            (Ok(()), Ok(()), Some(events)) => {
                watch.push(Entry {
                    owner: self.id,
                    who: self.gate,
                    ctx: Raw(dc.ctx),
                    stream: Raw(s),
                    events,
                    timer: self.timer.clone(),
                    spare: dc.spare.clone(),
                    in_flight: self.in_flight.clone(),
                });
                Ok(())
            }
            (result, _, pair) => {
                // Not launched, or launched with no end to watch: the turn
                // goes back, and a kernel that runs is counted untimed.
                if let Some(p) = pair {
                    lock(&dc.spare).push(p);
                }
                if let Some(who) = self.gate {
                    watch.release_turn(who);
                }
                if let (Ok(()), Some(timer)) = (result, &self.timer) {
                    timer(device, std::time::Duration::ZERO);
                }
                result
            }
        }
    }

    fn time_kernels(&mut self, timer: KernelTimer) -> bool {
        self.timer = Some(timer);
        true
    }

    fn mem_physical_read(&mut self, phys: PhysicalToken, sink: &mut dyn FnMut(&[u8]) -> io::Result<()>) -> Result<(), TransferError> {
        self.physical_transfer(phys, vmm::PhysicalIo::Read(sink))
    }

    fn mem_physical_write(&mut self, phys: PhysicalToken, fill: &mut dyn FnMut(&mut [u8]) -> io::Result<()>) -> Result<(), TransferError> {
        self.physical_transfer(phys, vmm::PhysicalIo::Write(fill))
    }

    // --- checkpoint and restore: only with movable memory, where every client
    // allocation can be placed again at its address ([`placed`]).

    fn relocatable(&self) -> bool {
        self.shared.movable
    }

    fn memory_peek(&self) -> Option<Arc<dyn super::MemoryPeek>> {
        self.shared.movable.then(|| Arc::new(peek::CudaPeek(self.peekable.clone())) as Arc<dyn super::MemoryPeek>)
    }

    fn quiesce(&mut self, timeout: std::time::Duration) -> CuResult {
        self.drop_probes();
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let mut queues: Vec<(u32, sys::CUstream)> =
                (0..self.ctxs.len() as u32).filter(|&d| self.ctxs[d as usize].is_some()).map(|d| (d, std::ptr::null_mut())).collect();
            queues.extend(self.streams.values().copied());
            let mut busy = false;
            for (d, s) in queues {
                self.bind(d)?;
                match cu!(sys::cuStreamQuery(s)) {
                    Ok(()) => {}
                    Err(e) if e == CuError::NOT_READY => busy = true,
                    Err(e) => return Err(e),
                }
            }
            if !busy {
                return Ok(());
            }
            if std::time::Instant::now() >= deadline {
                return Err(CuError::NOT_READY);
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    fn mem_alloc_at(&mut self, device: u32, ptr: u64, size: u64) -> CuResult {
        if !self.shared.movable {
            return Err(CuError::NOT_SUPPORTED);
        }
        self.account.take(size)?;
        match self.placed_alloc_at(device, ptr, size) {
            Ok(()) => {
                self.allocs.insert(ptr, (device, size));
                Ok(())
            }
            Err(e) => {
                self.account.give(size);
                Err(e)
            }
        }
    }

    fn module_load_at(
        &mut self,
        device: u32,
        image: &[u8],
        parsed: &ModuleImage,
        globals: &[u64],
    ) -> CuResult<(ModuleToken, LoadedModule)> {
        // The driver places a module's globals itself and takes no address for them: a
        // restore can only check that they landed where the program knows them to be.
        let (token, loaded) = self.module_load(device, image, parsed)?;
        let got: Vec<u64> = loaded.globals.iter().map(|g| g.ptr).collect();
        if got != globals {
            warn!(
                device,
                want = ?globals.iter().map(|p| format!("{p:#x}")).collect::<Vec<_>>(),
                got = ?got.iter().map(|p| format!("{p:#x}")).collect::<Vec<_>>(),
                "a restored module's globals landed elsewhere than the program knows them: the session cannot be rebuilt here"
            );
            let _ = self.module_unload(token);
            return Err(CuError::NOT_SUPPORTED);
        }
        Ok((token, loaded))
    }

    fn event_recorded_ago(&mut self, event: EventToken) -> CuResult<Option<std::time::Duration>> {
        let (device, e) = self.event(event)?;
        let mark = self.marks.get(&event.0).copied().ok_or(CuError::INVALID_HANDLE)?;
        if !mark.recorded {
            return Ok(None);
        }
        self.bind(device)?;
        cu!(sys::cuEventQuery(e))?;
        if !mark.timed {
            // No time can be asked of it: that it was recorded is all that travels.
            return Ok(Some(std::time::Duration::ZERO));
        }
        let now = match self.probes.get(&device) {
            Some(&p) => p,
            None => {
                let mut p: sys::CUevent = std::ptr::null_mut();
                cu!(sys::cuEventCreate(&mut p, 0))?;
                let r = cu!(sys::cuEventRecord(p, std::ptr::null_mut())).and_then(|()| cu!(sys::cuEventSynchronize(p)));
                if let Err(err) = r {
                    let _ = cu!(sys::cuEventDestroy_v2(p));
                    return Err(err);
                }
                self.probes.insert(device, p);
                p
            }
        };
        let mut ms = 0f32;
        cu!(sys::cuEventElapsedTime(&mut ms, e, now))?;
        let ago = (ms as f64 + mark.shift_ms).max(0.0);
        Ok(Some(std::time::Duration::from_secs_f64(ago / 1e3)))
    }

    fn event_restore(&mut self, device: u32, flags: u32, recorded_ago: Option<std::time::Duration>) -> CuResult<EventToken> {
        let t = self.event_create(device, flags)?;
        if let Some(ago) = recorded_ago {
            let (_, e) = self.event(t)?;
            if let Err(err) = cu!(sys::cuEventRecord(e, std::ptr::null_mut())) {
                let _ = self.event_destroy(t);
                return Err(err);
            }
            if let Some(m) = self.marks.get_mut(&t.0) {
                *m = EventMark { recorded: true, restored: true, shift_ms: ago.as_secs_f64() * 1e3, ..*m };
            }
        }
        Ok(t)
    }

    fn share_compute(&mut self, lease: u64, milli: u16) -> bool {
        if let Some(old) = self.gate.take() {
            for w in &self.shared.watch {
                w.leave(old);
            }
        }
        if milli > 0 && milli < share::WHOLE {
            let who = Who::Lease(lease);
            for w in &self.shared.watch {
                w.join(who, milli);
            }
            self.gate = Some(who);
        }
        true
    }
}

impl CudaSession {
    /// The tables other threads read through (written only by the session's thread).
    fn peek_tables(&self) -> std::sync::RwLockWriteGuard<'_, peek::Peekable> {
        self.peekable.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Before `device`'s context goes: no read goes through it any more, and its read
    /// stream goes first (made in it).
    fn forget_peek_context(&mut self, device: u32) {
        if self.ctxs.get(device as usize).is_some_and(Option::is_some) && self.bind(device).is_ok() {
            self.peek_tables().drop_stream(device);
        }
        if let Some(c) = self.peek_tables().ctxs.get_mut(device as usize) {
            *c = None;
        }
    }

    fn drop_probes(&mut self) {
        for (d, p) in std::mem::take(&mut self.probes) {
            if self.bind(d).is_ok() {
                let _ = cu!(sys::cuEventDestroy_v2(p));
            }
        }
    }
}

/// A number naming the calling thread, never 0.
fn this_thread() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local!(static TAG: u64 = NEXT.fetch_add(1, Ordering::Relaxed));
    TAG.with(|t| *t)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl CudaSession {
    /// A start and end event for timing a kernel on `device` (its context
    /// current): a spare pair, else a new one; None if the driver has no
    /// more events to give (the kernel then runs untimed).
    fn timing_pair(&mut self, device: u32) -> Option<Pair> {
        let dc = self.ctxs.get(device as usize)?.as_ref()?;
        if let Some(p) = lock(&dc.spare).pop() {
            return Some(p);
        }
        let mut evs: [sys::CUevent; 2] = [std::ptr::null_mut(); 2];
        for i in 0..2 {
            if let Err(e) = cu!(sys::cuEventCreate(&mut evs[i], 0)) {
                static ONCE: std::sync::Once = std::sync::Once::new();
                ONCE.call_once(|| warn!(device, "cannot create timing events ({e}): kernels run untimed while it lasts"));
                for &made in &evs[..i] {
                    let _ = cu!(sys::cuEventDestroy_v2(made));
                }
                return None;
            }
        }
        Some([Raw(evs[0]), Raw(evs[1])])
    }

    /// Takes the session's kernels on `device` (every device: None) out of
    /// the watch, charged, and destroys their timing events: called with
    /// the device idle, before its context goes.
    fn unwatch(&mut self, device: Option<u32>) {
        for d in 0..self.ctxs.len() {
            if device.is_some_and(|x| x as usize != d) {
                continue;
            }
            let Some(dc) = self.ctxs[d].as_ref() else { continue };
            self.shared.watch[d].purge(self.id, Some(Raw(dc.ctx)));
            // The purge may have made another context current.
            self.current = None;
            for p in std::mem::take(&mut *lock(&dc.spare)) {
                for e in p {
                    let _ = cu!(sys::cuEventDestroy_v2(e.0));
                }
            }
        }
    }

    /// The session-side half of a load: functions in this context, their
    /// layouts, the globals (re-initialised when this context had them before).
    #[allow(clippy::type_complexity)]
    fn module_setup(
        &mut self,
        device: u32,
        library: &Library,
        parsed: &ModuleImage,
    ) -> CuResult<(Vec<(sys::CUfunction, Vec<u32>)>, LoadedModule)> {
        let mut functions = Vec::with_capacity(parsed.kernels.len());
        let mut infos = Vec::with_capacity(parsed.kernels.len());
        for k in &parsed.kernels {
            let kernel = library.kernel(&k.name)?;
            let mut f: sys::CUfunction = std::ptr::null_mut();
            cu!(sys::cuKernelGetFunction(&mut f, kernel))?;
            let info = library.function_info(device, &k.name, f)?;
            functions.push((f, info.params.iter().map(|&(o, _)| o).collect()));
            infos.push(info);
        }
        let again = self.seen_libraries.contains(&(library.id, device));
        let mut globals = Vec::with_capacity(parsed.globals.len());
        for g in &parsed.globals {
            let Ok(name) = CString::new(g.name.as_str()) else { continue };
            let (mut p, mut size): (sys::CUdeviceptr, usize) = (0, 0);
            match cu!(sys::cuLibraryGetGlobal(&mut p, &mut size, library.raw(), name.as_ptr())) {
                Ok(()) => {}
                // Declared in the PTX but not kept by the compiler.
                Err(e) if e == CuError::NOT_FOUND => continue,
                Err(e) => return Err(e),
            }
            if again {
                self.init_global(device, p, size as u64, g.init.as_deref())?;
            }
            globals.push(GlobalInfo { name: g.name.clone(), ptr: p, size: size as u64, managed: g.managed });
        }
        Ok((functions, LoadedModule { functions: infos, globals, launch_note: String::new() }))
    }
}

impl Drop for CudaSession {
    fn drop(&mut self) {
        // No other thread reads its memory from here on (a read under way ends first).
        self.peek_tables().allocs.clear();
        // Let queued work finish, zero what the session leaves behind, and
        // free it; a device whose context cannot do that any more (a kernel
        // faulted) zeroes allocations from now on instead.
        let devices: Vec<u32> =
            (0..self.ctxs.len() as u32).filter(|&d| self.ctxs[d as usize].is_some()).collect();
        for &d in &devices {
            let ok = self.bind(d).and_then(|()| cu!(sys::cuCtxSynchronize()));
            if ok.is_err() {
                self.shared.scrub_on_alloc[d as usize].store(true, Ordering::Relaxed);
            }
        }
        // Its kernels are over: charged, and their events gone with them.
        self.unwatch(None);
        self.drop_probes();
        if let Some(who) = self.gate.take() {
            for w in &self.shared.watch {
                w.leave(who);
            }
        }
        let allocs: Vec<(u64, (u32, u64))> = self.allocs.iter().map(|(&p, &a)| (p, a)).collect();
        for (p, (d, size)) in allocs {
            if self.zero(d, p, size).is_err() {
                self.shared.scrub_on_alloc[d as usize].store(true, Ordering::Relaxed);
            }
        }
        let modules: Vec<ModuleEntry> = self.modules.drain().map(|(_, m)| m).collect();
        let mut libraries = Vec::new();
        for m in modules {
            for &(p, size) in &m.globals {
                if self.zero(m.device, p, size).is_err() {
                    self.shared.scrub_on_alloc[m.device as usize].store(true, Ordering::Relaxed);
                }
            }
            libraries.push(m.library);
        }
        for &d in &devices {
            let ok = self.bind(d).and_then(|()| cu!(sys::cuCtxSynchronize()));
            if ok.is_err() && !self.shared.scrub_on_alloc[d as usize].swap(true, Ordering::Relaxed) {
                warn!(device = d, "memory a session left behind could not be zeroed; zeroing allocations instead");
            }
        }
        // The devices are idle (synchronised above): unmapped, zeroed and released.
        self.vmm_teardown();
        for (p, (d, _)) in std::mem::take(&mut self.allocs) {
            if !self.placed.holds(p) && self.bind(d).is_ok() {
                let _ = cu!(sys::cuMemFree_v2(p));
            }
        }
        self.placed_teardown();
        for (_, (d, s)) in std::mem::take(&mut self.streams) {
            if self.bind(d).is_ok() {
                let _ = cu!(sys::cuStreamDestroy_v2(s));
            }
        }
        for (_, (d, e)) in std::mem::take(&mut self.events) {
            if self.bind(d).is_ok() {
                let _ = cu!(sys::cuEventDestroy_v2(e));
            }
        }
        for i in 0..self.staging.len() {
            let _ = self.wait_staging(i);
        }
        for &d in &devices {
            self.forget_peek_context(d);
        }
        for d in devices {
            if let Some(c) = self.ctxs[d as usize].take() {
                for e in c.staging_events {
                    let _ = cu!(sys::cuEventDestroy_v2(e));
                }
                if let Err(e) = cu!(sys::cuCtxDestroy_v2(c.ctx)) {
                    warn!(device = d, "cuCtxDestroy failed: {e}");
                }
            }
        }
        self.current = None;
        // No copy can use the buffers once the contexts are gone.
        for s in self.staging.drain(..) {
            self.shared.give_staging(s.buf);
        }
        let mut cache = self.shared.libraries();
        for l in libraries {
            cache.release(&l);
        }
    }
}
