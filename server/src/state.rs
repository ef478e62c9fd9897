//! One session's objects, by the handles and pointers the client knows them
//! by. Every pointer or handle a request names is looked up here first, so a
//! session can only ever touch what it created itself.
//!
//! It sits below [`crate::command`] (whose handlers read and change it) and
//! above [`crate::backend`]; the connection loop in [`crate::session`] owns
//! one and hands it to each command, so commands never depend on the
//! connection loop that runs them.

use std::collections::{BTreeMap, HashMap};

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use crate::backend::launch_limits::{KernelNeeds, LaunchLimits};
use crate::backend::{BackendSession, DeviceInfo, EventToken, LaunchDims, ModuleToken, StreamRef, StreamToken};
use crate::limits::SessionInput;
use crate::metering::SessionMeter;
use crate::quota::Charge;
use rgpu_cuda_types::{CuError, CuResult};

/// Who owns an allocation: the client (freed by memFree), a module (a
/// global, freed with the module), or another session that exported it and
/// this one opened (closed by ipcClose, [`crate::ipc`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    Client,
    Module(u64),
    Imported,
}

#[derive(Debug, Clone, Copy)]
pub struct Alloc {
    pub device: u32,
    /// Bytes the client asked for: accesses beyond it are refused even
    /// where the backend rounded the allocation up.
    pub size: u64,
    pub owner: Owner,
}

#[derive(Debug, Clone, Copy)]
pub struct Stream {
    pub token: StreamToken,
    pub device: u32,
    /// As created (cuStreamCreateWithPriority): a checkpoint keeps them.
    pub flags: u32,
    pub priority: i32,
}

#[derive(Debug, Clone, Copy)]
pub struct Event {
    pub token: EventToken,
    pub device: u32,
    /// As created: a checkpoint keeps them.
    pub flags: u32,
}

#[derive(Debug, Clone)]
pub struct Module {
    pub token: ModuleToken,
    pub device: u32,
    /// Parameter buffer length of each function, by index.
    pub param_lens: Vec<u64>,
    /// What each function's launches need (`.maxntid`, static shared memory), by index.
    pub needs: Vec<KernelNeeds>,
    /// Device pointers of its globals (entries of `allocs`).
    pub globals: Vec<u64>,
    /// Its image's bytes, held against the lease's module quota while it is loaded.
    pub image: Option<Arc<Charge>>,
    /// The image as loaded (linked, if it was a bundle): what a checkpoint
    /// carries to load it again elsewhere. Its bytes are those `image` holds.
    pub source: Arc<Vec<u8>>,
}

/// Whether `e` leaves the device unusable for the rest of the session, as
/// a GPU's context is left after a kernel ran past the watchdog or faulted
/// (CUDA: "any further CUDA work will return the same error"; the process
/// must start again, here the session). A device assert is the one a fresh
/// context recovers from ([`SessionState::holds_nothing`], `ctxReset`).
pub fn is_sticky(e: CuError) -> bool {
    [
        CuError::LAUNCH_TIMEOUT,
        CuError::ILLEGAL_ADDRESS,
        CuError::MISALIGNED_ADDRESS,
        CuError::ILLEGAL_INSTRUCTION,
        CuError::ASSERT,
        CuError::LAUNCH_FAILED,
    ]
    .contains(&e)
}

pub struct SessionState {
    pub backend: Box<dyn BackendSession>,
    pub device_count: u32,
    /// With a lease: the only ordinals this session may name (the token's
    /// GPUs); None: every device of the server.
    pub allowed: Option<Vec<u32>>,
    pub allocs: BTreeMap<u64, Alloc>,
    pub streams: HashMap<u64, Stream>,
    pub events: HashMap<u64, Event>,
    pub modules: HashMap<u64, Module>,
    /// Reservations, physical allocations and maps (cuMemCreate, cuMemMap, ...).
    pub vmm: crate::vmm::Vmm,
    /// What the session exported to other sessions and opened of theirs.
    pub ipc: crate::ipc::IpcScope,
    /// What the session may make the server buffer and keep.
    pub input: SessionInput,
    /// Instantiated graphs (segments between host nodes), by the client's handle.
    pub graph_execs: HashMap<u64, crate::backend::graph::GraphExec>,
    /// What the session uses, counted as it serves.
    pub meter: Arc<SessionMeter>,
    /// The backend reports each kernel to `meter` as it ends (with its run
    /// time), so launches are not counted when they are queued.
    pub backend_times_kernels: bool,
    /// Each device's launch limits, by ordinal.
    pub launch_limits: Vec<LaunchLimits>,
    /// Each device's memory size, by ordinal (a snapshot says what it needs).
    pub device_memory: Vec<u64>,
    /// Raised when the session ends (connection closed or dropped, server
    /// stopping): the backend stops the session's running work, and the
    /// session loop takes no further request.
    pub ended: Arc<AtomicBool>,
    /// The error that has left the session's device unusable, as a GPU's
    /// context is after a kernel timeout: every later request but those
    /// that release objects fails with it.
    pub sticky: Option<CuError>,
}

impl SessionState {
    pub fn new(mut backend: Box<dyn BackendSession>, device_count: u32) -> Self {
        let ended = Arc::new(AtomicBool::new(false));
        backend.set_cancel(ended.clone());
        SessionState {
            backend,
            device_count,
            allowed: None,
            allocs: BTreeMap::new(),
            streams: HashMap::new(),
            events: HashMap::new(),
            modules: HashMap::new(),
            vmm: crate::vmm::Vmm::default(),
            ipc: crate::ipc::IpcScope::default(),
            input: SessionInput::default(),
            graph_execs: HashMap::new(),
            meter: Arc::new(SessionMeter::detached(device_count as usize)),
            backend_times_kernels: false,

            launch_limits: vec![LaunchLimits::default(); device_count as usize],
            device_memory: Vec::new(),
            ended,
            sticky: None,
        }
    }

    /// Counts what the session uses into `meter`; a backend that runs kernels
    /// behind the session's back (the sim's executor) times each one itself.
    pub fn with_meter(mut self, meter: Arc<SessionMeter>) -> Self {
        let m = meter.clone();
        self.backend_times_kernels = self.backend.time_kernels(Arc::new(move |device, took| m.kernel(device, took)));
        self.meter = meter;
        self
    }

    /// Takes each device's launch limits from its attributes.
    pub fn with_devices(mut self, devices: &[DeviceInfo]) -> Self {
        self.launch_limits = devices.iter().map(LaunchLimits::of).collect();
        self.device_memory = devices.iter().map(|d| d.total_mem).collect();
        self
    }

    /// Checks a launch of `function` of module `handle` with a parameter
    /// buffer of `param_bytes` against the kernel's layout and the device's
    /// limits, before the backend builds anything for it; returns the
    /// module's backend token and device.
    pub fn check_launch(&self, handle: u64, function: u32, dims: &LaunchDims, param_bytes: u64) -> CuResult<(ModuleToken, u32)> {
        let m = self.module(handle)?;
        let want = *m.param_lens.get(function as usize).ok_or(CuError::INVALID_HANDLE)?;
        if param_bytes != want {
            return Err(CuError::INVALID_VALUE);
        }
        let needs = m.needs.get(function as usize).copied().unwrap_or_default();
        let limits = self.launch_limits.get(m.device as usize).copied().unwrap_or_default();
        limits.check(dims, &needs, want)?;
        Ok((m.token, m.device))
    }

    /// Bounds what the session may make the server buffer and keep.
    pub fn with_input(mut self, input: SessionInput) -> Self {
        self.input = input;
        self
    }

    /// Gives the session's kernels lease `lease`'s share of device time
    /// (`milli` thousandths of a GPU; 0: a whole one); a backend that
    /// cannot enforce it says so once.
    pub fn with_compute_share(mut self, lease: u64, milli: u16) -> Self {
        if !self.backend.share_compute(lease, milli) && milli > 0 {
            static ONCE: std::sync::Once = std::sync::Once::new();
            ONCE.call_once(|| {
                tracing::warn!("this backend does not enforce compute shares: fractional leases get whatever device time they take")
            });
        }
        self
    }

    /// Lets the session share memory with the other sessions of `lease` on
    /// this server (None: a server without leases) through `exports`.
    pub fn with_ipc(mut self, exports: std::sync::Arc<crate::ipc::Exports>, lease: Option<u64>) -> Self {
        self.ipc = crate::ipc::IpcScope::new(exports, lease);
        self
    }

    /// Restricts the session to `devices` (a lease token's GPUs).
    pub fn restrict(mut self, devices: Vec<u32>) -> Self {
        self.allowed = Some(devices);
        self
    }

    /// Every request that names a device comes through here; pointers,
    /// streams, events and modules can only have been created on a device
    /// that passed it, so they need no second check.
    pub fn check_device(&self, device: u32) -> CuResult {
        let leased = match &self.allowed {
            Some(a) => a.contains(&device),
            None => true,
        };
        if device < self.device_count && leased {
            Ok(())
        } else {
            Err(CuError::INVALID_DEVICE)
        }
    }

    /// Checks that `[ptr, ptr + len)` lies inside one live allocation of this
    /// session, or in adjacent maps the device may access ([`crate::vmm::Vmm::check_range`]),
    /// and returns its device. A zero-length range still has to start inside one.
    pub fn check_range(&self, ptr: u64, len: u64) -> CuResult<u32> {
        self.check_alloc_range(ptr, len).or_else(|e| self.vmm.check_range(ptr, len).map_err(|_| e))
    }

    fn check_alloc_range(&self, ptr: u64, len: u64) -> CuResult<u32> {
        let (&start, a) = self.allocs.range(..=ptr).next_back().ok_or(CuError::INVALID_VALUE)?;
        let off = ptr - start;
        let end = off.checked_add(len).ok_or(CuError::INVALID_VALUE)?;
        if off >= a.size.max(1) || end > a.size {
            return Err(CuError::INVALID_VALUE);
        }
        Ok(a.device)
    }

    /// Whether the session holds no object at all: after a client has
    /// destroyed its contexts' objects, the session is as a fresh context.
    pub fn holds_nothing(&self) -> bool {
        self.allocs.is_empty()
            && self.streams.is_empty()
            && self.events.is_empty()
            && self.modules.is_empty()
            && self.graph_execs.is_empty()
            && self.vmm.is_empty()
    }

    /// The stream a request names; 0 is `device`'s default stream.
    pub fn stream(&self, handle: u64, device: u32) -> CuResult<StreamRef> {
        if handle == 0 {
            return Ok(StreamRef::Default { device });
        }
        let s = self.streams.get(&handle).ok_or(CuError::INVALID_HANDLE)?;
        Ok(StreamRef::Created(s.token))
    }

    pub fn event(&self, handle: u64) -> CuResult<Event> {
        self.events.get(&handle).copied().ok_or(CuError::INVALID_HANDLE)
    }

    pub fn module(&self, handle: u64) -> CuResult<&Module> {
        self.modules.get(&handle).ok_or(CuError::INVALID_HANDLE)
    }
}
