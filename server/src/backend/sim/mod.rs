//! The sim backend: devices that exist only in this process.
//!
//! Memory is real (see [`memory`]). Kernels run on the PTX interpreter
//! (`rgpu-ptx`, see [`kernels`]) over this session's allocations in
//! [`memory::DeviceMemory`]; modules are decoded at load time. Launches,
//! event records and stream waits are queued on the session's
//! [`executor`], which runs them off the session thread in CUDA's stream
//! order; every other operation waits for the executor to be idle first, so
//! memory is never copied, freed or remapped under a running kernel.

pub mod attributes;
pub mod cooperative;
pub mod executor;
pub mod kernels;
pub mod memory;
pub mod share;
pub mod vmm;

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use self::attributes::SimDeviceParams;
use self::memory::DeviceMemory;
use self::vmm::SimVmm;
use super::{
    Backend, BackendSession, DeviceInfo, EventToken, FunctionInfo, GlobalInfo, LaunchDims,
    LoadedModule, MemoryAccount, MemoryBudget, MemsetOp, ModuleToken, PhysicalToken, StreamRef, StreamToken, TransferError,
};
use rgpu_cuda_types::{CuError, CuResult};
use crate::module::{GlobalSpace, ModuleImage};

/// `CU_STREAM_NON_BLOCKING`: the stream does not synchronise with the legacy default stream.
pub const STREAM_NON_BLOCKING: u32 = 0x1;

/// `CU_EVENT_DISABLE_TIMING`.
pub const EVENT_DISABLE_TIMING: u32 = 0x2;
/// `CU_EVENT_INTERPROCESS`.
pub const EVENT_INTERPROCESS: u32 = 0x4;

/// What the sim reports for the sensors it does not have (as simulated,
/// never as measured): an idle data-centre GPU's die temperature, its draw
/// and its board's power limit, in NVML's units (degrees C, milliwatts).
pub const SIM_TEMPERATURE_C: u32 = 40;
pub const SIM_POWER_MW: u32 = 60_000;
pub const SIM_POWER_LIMIT_MW: u32 = 400_000;

/// How to build the sim's devices.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub devices: u32,
    /// Bytes of memory per device.
    pub memory: u64,
    pub compute_capability: (u32, u32),
    /// Mixed into the device UUIDs, so two servers on one host can differ.
    pub seed: Option<String>,
    /// Wall-clock limit of one kernel launch.
    pub kernel_time_limit: Duration,
    /// Kernels run on the PTX crate's compiled tier (else on its interpreter alone).
    pub compiled_tier: bool,
}

pub struct SimBackend {
    shared: Arc<Shared>,
}

struct Shared {
    info: Vec<DeviceInfo>,
    memory: Vec<DeviceMemory>,
    kernel_time_limit: Duration,
    compiled_tier: bool,
    /// The devices' architecture (compute capability X.Y as XY): the newest PTX it may run.
    arch: u32,
    /// The host's cores, which every session's blocks share by compute share.
    cores: Arc<share::Cores>,
    /// Names the groups of sessions without a lease.
    next_session: AtomicU64,
    /// Faults an operator injected: the devices' health.
    faults: crate::health::Faults,
    /// Per device: when its kernels run, all sessions together (its utilization).
    busy: Vec<Arc<crate::telemetry::BusyMeter>>,
}

impl Shared {
    fn device(&self, ordinal: u32) -> CuResult<&DeviceMemory> {
        self.memory.get(ordinal as usize).ok_or(CuError::INVALID_DEVICE)
    }

    /// The device whose address window holds `ptr`.
    fn device_of(&self, ptr: u64) -> CuResult<&DeviceMemory> {
        self.memory.iter().find(|m| m.contains(ptr)).ok_or(CuError::INVALID_VALUE)
    }
}

impl SimBackend {
    pub fn new(cfg: &SimConfig) -> io::Result<Self> {
        if cfg.devices == 0 || cfg.devices > 64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("--sim-devices must be between 1 and 64, got {}", cfg.devices),
            ));
        }
        let host = hostname();
        let (major, minor) = cfg.compute_capability;
        let mut info = Vec::new();
        let mut memory = Vec::new();
        let first = device_uuid(&host, 0, cfg.seed.as_deref());
        let domain = u16::from_le_bytes([first[0], first[1]]) as i32;
        for ordinal in 0..cfg.devices {
            let mem = DeviceMemory::new(ordinal, cfg.memory)?;
            let uuid = device_uuid(&host, ordinal, cfg.seed.as_deref());
            let params = SimDeviceParams {
                ordinal: ordinal as i32,
                cc_major: major as i32,
                cc_minor: minor as i32,
                // Distinct per server, like the devices of different hosts;
                // the bus tells a server's devices apart.
                pci_domain: domain,
                pci_bus: 0x10 + ordinal as i32,
                pci_device: 0,
            };
            info.push(DeviceInfo {
                ordinal,
                name: format!("rgpu sim GPU (compute capability {major}.{minor})"),
                uuid,
                total_mem: mem.total(),
                pci_domain: params.pci_domain,
                pci_bus: params.pci_bus,
                pci_device: params.pci_device,
                attributes: attributes::all_values(&params),
            });
            memory.push(mem);
        }
        Ok(SimBackend {
            shared: Arc::new(Shared {
                info,
                memory,
                kernel_time_limit: cfg.kernel_time_limit,
                compiled_tier: cfg.compiled_tier,
                arch: major * 10 + minor,
                cores: share::Cores::host(),
                next_session: AtomicU64::new(1),
                faults: crate::health::Faults::new(cfg.devices),
                busy: (0..cfg.devices).map(|_| crate::telemetry::BusyMeter::new()).collect(),
            }),
        })
    }
}

impl Backend for SimBackend {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn devices(&self) -> &[DeviceInfo] {
        &self.shared.info
    }

    fn kernel_times_known(&self) -> bool {
        // The executor times every kernel it runs (`time_kernels`).
        true
    }

    fn health(&self) -> Vec<crate::health::DeviceHealth> {
        self.shared.faults.health()
    }

    // A fault changes what the device reports, not what it computes: the
    // sessions on it keep running while the broker moves them off, as on
    // a GPU whose pages are pending retirement.
    fn set_fault(&self, device: u32, fault: Option<crate::health::Fault>) -> Result<crate::health::DeviceHealth, crate::health::HealthError> {
        self.shared.faults.set(device, fault)
    }

    /// GPU utilization is measured: the share of the last second during
    /// which one or more kernels ran on the device (NVML's definition).
    /// Memory utilization is not reported: the interpreter's loads and
    /// stores are not timed apart from its arithmetic, and a copy's time is
    /// the network's, so no figure here would be device memory's own.
    /// Temperature and power are constants standing in for sensors the sim
    /// has none of, reported as simulated.
    fn telemetry(&self) -> Vec<crate::telemetry::DeviceTelemetry> {
        use crate::telemetry::{DeviceTelemetry, Reading};
        self.shared
            .busy
            .iter()
            .map(|b| DeviceTelemetry {
                gpu_utilization: Reading::Measured(b.percent()),
                memory_utilization: Reading::NotReported,
                temperature: Reading::Simulated(SIM_TEMPERATURE_C),
                power_usage: Reading::Simulated(SIM_POWER_MW),
                power_limit: Reading::Simulated(SIM_POWER_LIMIT_MW),
            })
            .collect()
    }

    fn open_session(&self, budget: Option<Arc<MemoryBudget>>) -> CuResult<Box<dyn BackendSession>> {
        let cancel = Arc::new(AtomicBool::new(false));
        let own = share::Who::Session(self.shared.next_session.fetch_add(1, Ordering::Relaxed));
        Ok(Box::new(SimSession {
            share: Arc::new(self.shared.cores.join(own, share::WHOLE)),
            shared: self.shared.clone(),
            account: MemoryAccount::new(budget),
            client_bytes: HashMap::new(),
            allocs: BTreeMap::new(),
            launch_memory: None,
            streams: HashMap::new(),
            events: HashMap::new(),
            modules: HashMap::new(),
            next_token: 1,
            output: Vec::new(),
            vmm: SimVmm::default(),
            cancel: cancel.clone(),
            exec: executor::Executor::new(cancel),
            timer: None,
            capture_at: None,
            restore_at: None,
        }))
    }
}

struct SimEvent {
    flags: u32,
    /// When the stream reached the event's last record; set by the
    /// executor when the record was queued behind work.
    recorded: Arc<Mutex<Option<Instant>>>,
    /// The executor item of a record still queued.
    item: Option<u64>,
    /// For an interprocess event (exported, or opened from another
    /// session's export): the last record of all its holders.
    shared: Option<Arc<IpcRecord>>,
}

/// An interprocess event's last record, whichever session made it: that
/// session's executor and the record's item there.
#[derive(Default)]
struct IpcRecord {
    last: Mutex<Option<(executor::ItemWatch, u64)>>,
}

impl IpcRecord {
    fn get(&self) -> Option<(executor::ItemWatch, u64)> {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// How long a session waits in cuEventSynchronize for another session's
/// record before it looks whether its own session ended (it then waits on).
const REMOTE_WAIT_SLICE: Duration = Duration::from_millis(100);

/// How a session holds an allocation.
enum Held {
    /// Alone: freeing it frees the device memory.
    Own,
    /// Its own, exported: other sessions may hold it too.
    Exported(Arc<SimShared>),
    /// Another session's export, opened (held for its drop alone).
    Imported(#[allow(dead_code)] Arc<SimShared>),
}

/// A client allocation that other sessions may have opened (IPC): its device
/// memory and its charge to the exporter's lease live as long as some
/// session holds this.
struct SimShared {
    shared: Arc<Shared>,
    ptr: u64,
    /// The bytes moved out of the exporter's account (dropped after the memory is freed).
    _charge: MemoryAccount,
}

impl Drop for SimShared {
    fn drop(&mut self) {
        if let Ok(m) = self.shared.device_of(self.ptr) {
            let _ = m.free(self.ptr);
        }
    }
}

struct SimModule {
    /// Device pointers of the module's globals, freed at unload.
    globals: Vec<u64>,
    /// What the globals are charged to the session's account.
    global_bytes: u64,
    /// Per kernel: its decoded program, or why it cannot run here.
    programs: Vec<Result<Arc<rgpu_ptx::Program>, String>>,
    /// Per kernel: what its occupancy counts (cooperative grids are held to it).
    resources: Vec<cooperative::Resources>,
}

/// Reads sessions' memory from a migration's pre-copy thread.
struct SimPeek(Arc<Shared>);

impl crate::backend::MemoryPeek for SimPeek {
    fn peek(&self, device: u32, alloc: u64, size: u64, at: u64, buf: &mut [u8]) -> bool {
        self.0.device(device).is_ok_and(|m| m.peek(alloc, size, at, buf))
    }

    fn with_held(&self, device: u32, at: u64, len: u64, f: &mut dyn FnMut(&[u8])) -> bool {
        self.0.device(device).is_ok_and(|m| m.with_slice(at, len, |s| f(s)).is_ok())
    }
}

struct SimSession {
    shared: Arc<Shared>,
    /// The client's own allocations and its modules' globals, counted
    /// against its lease (if any).
    account: MemoryAccount,
    /// Size of each of the client's own allocations (not module globals).
    client_bytes: HashMap<u64, u64>,
    /// Every allocation this session made (its own and its modules' globals)
    /// or opened of another's.
    allocs: BTreeMap<u64, Held>,
    /// What kernels may touch: `allocs` as memory regions, rebuilt after an
    /// allocation or a free rather than at every launch.
    launch_memory: Option<Arc<kernels::SessionMemory>>,
    /// Each created stream's device and whether it is blocking.
    streams: HashMap<u64, (u32, bool)>,
    events: HashMap<u64, SimEvent>,
    modules: HashMap<u64, SimModule>,
    next_token: u64,
    /// Device printf output not yet sent to the client.
    output: Vec<u8>,
    /// Reservations, physical allocations and maps (cuMemCreate, cuMemMap, ...).
    vmm: SimVmm,
    /// Raised when the session ends: its running launch stops.
    cancel: Arc<AtomicBool>,
    /// Runs the session's kernels and event records off its thread.
    exec: executor::Executor,
    /// The session's place among those sharing the host's cores.
    share: Arc<share::Share>,
    /// Told each kernel's device and run time as it ends (metering).
    timer: Option<crate::backend::KernelTimer>,
    /// The one "now" every event of a capture is timed against (set by the
    /// first, cleared at the capture's quiesce), and of a rebuild: each
    /// event read against a clock of its own would shift the times between
    /// events by the time between the reads.
    capture_at: Option<Instant>,
    restore_at: Option<Instant>,
}

impl SimSession {
    fn token(&mut self) -> u64 {
        let t = self.next_token;
        self.next_token += 1;
        t
    }

    fn check_stream(&self, s: StreamRef) -> CuResult {
        match s {
            StreamRef::Default { device } => self.shared.device(device).map(|_| ()),
            StreamRef::Created(t) => {
                self.streams.get(&t.0).map(|_| ()).ok_or(CuError::INVALID_HANDLE)
            }
        }
    }

    /// The executor's view of a stream.
    fn lane(&self, s: StreamRef) -> CuResult<executor::Lane> {
        self.check_stream(s)?;
        Ok(match s {
            StreamRef::Default { device } => executor::Lane::Default(device),
            StreamRef::Created(t) => {
                let &(device, blocking) = self.streams.get(&t.0).ok_or(CuError::INVALID_HANDLE)?;
                executor::Lane::Created { token: t.0, device, blocking }
            }
        })
    }

    fn event(&mut self, e: EventToken) -> CuResult<&mut SimEvent> {
        self.events.get_mut(&e.0).ok_or(CuError::INVALID_HANDLE)
    }

    /// The event's last record: the executor that holds it (this session's,
    /// or for an interprocess event maybe another's) and its item.
    fn last_record(&self, e: EventToken) -> CuResult<Option<(executor::ItemWatch, u64)>> {
        let ev = self.events.get(&e.0).ok_or(CuError::INVALID_HANDLE)?;
        Ok(match &ev.shared {
            Some(r) => r.get(),
            None => ev.item.map(|id| (self.exec.watch(), id)),
        })
    }

    fn alloc_owned(&mut self, device: u32, size: u64) -> CuResult<u64> {
        let p = self.shared.device(device)?.alloc(size)?;
        self.allocs.insert(p, Held::Own);
        self.launch_memory = None;
        Ok(p)
    }

    /// A device-to-device copy where either side is mapped (virtual memory management): in
    /// chunks through a buffer, as the two sides may be pieces of several allocations, or
    /// aliases of one.
    fn copy_mapped(&mut self, dst: u64, src: u64, len: u64) -> CuResult {
        const CHUNK: u64 = 4 << 20;
        let mut buf = vec![0u8; CHUNK.min(len) as usize];
        let mut done = 0;
        while done < len {
            let n = CHUNK.min(len - done);
            let b = &mut buf[..n as usize];
            self.read_any(src + done, b)?;
            self.write_any(dst + done, b)?;
            done += n;
        }
        Ok(())
    }

    fn read_any(&self, src: u64, out: &mut [u8]) -> CuResult {
        if SimVmm::owns(src) {
            let mut at = 0;
            for (p, n) in self.vmm.pieces(src, out.len() as u64)? {
                // SAFETY: a piece lies in a live, mapped allocation of this session.
                out[at..at + n].copy_from_slice(unsafe { std::slice::from_raw_parts(p, n) });
                at += n;
            }
            return Ok(());
        }
        self.shared.device_of(src)?.with_slice(src, out.len() as u64, |s| out.copy_from_slice(s))
    }

    fn write_any(&self, dst: u64, data: &[u8]) -> CuResult {
        if SimVmm::owns(dst) {
            let mut at = 0;
            for (p, n) in self.vmm.pieces(dst, data.len() as u64)? {
                // SAFETY: as in read_any.
                unsafe { std::slice::from_raw_parts_mut(p, n) }.copy_from_slice(&data[at..at + n]);
                at += n;
            }
            return Ok(());
        }
        self.shared.device_of(dst)?.with_slice_mut(dst, data.len() as u64, |s| s.copy_from_slice(data))
    }

    /// A memset over mapped memory, row by row, each row piece by piece with the pattern
    /// continued across pieces.
    fn memset_mapped(&mut self, op: &MemsetOp, span: u64) -> CuResult {
        let es = op.element_size as u64;
        let pattern = op.value.to_le_bytes();
        let row_bytes = op.count * es;
        let pitch = if op.rows == 1 { row_bytes } else { op.pitch };
        // The whole span first, so a memset that fails writes nothing.
        self.vmm.pieces(op.dst, span)?;
        for r in 0..op.rows {
            let mut off = 0u64;
            for (p, n) in self.vmm.pieces(op.dst + r * pitch, row_bytes)? {
                // SAFETY: a piece lies in a live, mapped allocation of this session.
                let s = unsafe { std::slice::from_raw_parts_mut(p, n) };
                // The pattern from this piece's phase, repeated over a block every element
                // size divides, copied block by block (as `memset` does).
                let mut block = [0u8; 256];
                for (i, b) in block.iter_mut().enumerate() {
                    *b = pattern[((off + i as u64) % es) as usize];
                }
                let mut blocks = s.chunks_exact_mut(block.len());
                for c in &mut blocks {
                    c.copy_from_slice(&block);
                }
                let rest = blocks.into_remainder();
                let k = rest.len();
                rest.copy_from_slice(&block[..k]);
                off += n as u64;
            }
        }
        Ok(())
    }

    /// Loads a module's globals (at `place` if given: a restored session's
    /// addresses) and decodes its kernels.
    fn load_module(&mut self, device: u32, parsed: &ModuleImage, place: Option<&[u64]>) -> CuResult<(ModuleToken, LoadedModule)> {
        self.shared.device(device)?;
        // Module globals are device memory the session holds, charged to its
        // lease as cuMemAlloc is (a zero-sized global still takes an address).
        let global_bytes = parsed.globals.iter().fold(0u64, |n, g| n.saturating_add(g.size.max(1)));
        self.account.take(global_bytes)?;
        let mut globals = Vec::with_capacity(parsed.globals.len());
        let mut ptrs = Vec::with_capacity(parsed.globals.len());
        let result = (|| -> CuResult {
            for g in &parsed.globals {
                let p = match place {
                    Some(at) => {
                        let p = *at.get(ptrs.len()).ok_or(CuError::INVALID_VALUE)?;
                        self.shared.device(device)?.alloc_at(p, g.size.max(1))?;
                        self.allocs.insert(p, Held::Own);
                        self.launch_memory = None;
                        p
                    }
                    None => self.alloc_owned(device, g.size.max(1))?,
                };
                ptrs.push(p);
                if let Some(init) = &g.init {
                    let n = (init.len() as u64).min(g.size);
                    let m = self.shared.device(device)?;
                    m.with_slice_mut(p, n, |s| s.copy_from_slice(&init[..n as usize]))?;
                }
                globals.push(GlobalInfo { name: g.name.clone(), ptr: p, size: g.size, managed: g.managed });
            }
            Ok(())
        })();
        let programs = result.and_then(|()| kernels::decode(parsed, &globals));
        let programs = match programs {
            Ok(p) => p,
            Err(e) => {
                for p in ptrs {
                    let _ = self.free_owned(p);
                }
                self.account.give(global_bytes);
                return Err(e);
            }
        };
        let const_bytes: u64 = parsed
            .globals
            .iter()
            .filter(|g| g.space == GlobalSpace::Const)
            .map(|g| g.size)
            .sum();
        let arch = self.shared.arch;
        let launch_note = if parsed.ptx.is_some() {
            String::new()
        } else if let Some(newer) = parsed.newer_ptx {
            let archs: Vec<String> = parsed.sass_archs.iter().map(|a| format!("sm_{a}")).collect();
            format!(
                "the image's PTX is for compute_{newer}, newer than this device (compute capability {}.{}), \
                 and a driver never runs newer PTX on an older device; the rgpu sim backend cannot run its \
                 SASS ({}): start the server with --sim-compute-capability {}.{} to run it",
                arch / 10,
                arch % 10,
                archs.join(", "),
                newer / 10,
                newer % 10
            )
        } else {
            let archs: Vec<String> = parsed.sass_archs.iter().map(|a| format!("sm_{a}")).collect();
            format!(
                "the image has no PTX (only SASS for {}); the rgpu sim backend executes PTX only: \
                 build with -gencode arch=compute_XX,code=compute_XX (e.g. compute_90) to embed it",
                if archs.is_empty() { "no architecture".to_string() } else { archs.join(", ") }
            )
        };
        let clamp = |v: u64| i32::try_from(v).unwrap_or(i32::MAX);
        let functions = parsed
            .kernels
            .iter()
            .enumerate()
            .map(|(i, k)| FunctionInfo {
                name: k.name.clone(),
                params: k.params.iter().map(|p| (p.offset, p.size)).collect(),
                max_threads_per_block: k
                    .max_threads_per_block
                    .map_or(1024, |n| n.min(1024) as i32),
                shared_size_bytes: clamp(k.shared_static_bytes),
                // Per-function constant usage is not known without SASS; the
                // module's __constant__ bytes are an upper bound.
                const_size_bytes: clamp(const_bytes),
                local_size_bytes: clamp(k.local_bytes),
                num_regs: k.num_regs.map_or(32, |n| n as i32),
                // The PTX the kernel was built from, JIT-compiled for this device.
                ptx_version: parsed.ptx_arch.map_or(arch as i32, |a| a as i32),
                binary_version: arch as i32,
                // Said at load time so the client refuses a launch at once,
                // where the program sees the error, rather than at the next
                // synchronisation.
                launch_note: match programs.get(i) {
                    _ if parsed.ptx.is_none() => launch_note.clone(),
                    Some(Err(why)) => why.clone(),
                    _ => String::new(),
                },
            })
            .collect::<Vec<_>>();
        let t = self.token();
        let resources = functions.iter().map(cooperative::Resources::of).collect();
        self.modules.insert(
            t,
            SimModule { globals: ptrs, global_bytes, programs, resources },
        );
        debug!(module = t, kernels = functions.len(), globals = globals.len(), "sim module loaded");
        // The module-level note explains the module as a whole; empty when
        // every kernel can be launched.
        let launch_note = match functions.iter().find(|f| !f.launch_note.is_empty()) {
            Some(f) if launch_note.is_empty() => format!("kernel {}: {}", f.name, f.launch_note),
            _ => launch_note,
        };
        Ok((ModuleToken(t), LoadedModule { functions, globals, launch_note }))
    }

    fn free_owned(&mut self, ptr: u64) -> CuResult {
        let held = self.allocs.remove(&ptr).ok_or(CuError::INVALID_VALUE)?;
        self.launch_memory = None;
        match held {
            Held::Own => self.shared.device_of(ptr)?.free(ptr),
            // Freed with its last holder.
            Held::Exported(_) | Held::Imported(_) => Ok(()),
        }
    }
}

impl BackendSession for SimSession {
    fn module_arch(&self, _device: u32) -> u32 {
        self.shared.arch
    }

    fn mem_alloc(&mut self, device: u32, size: u64) -> CuResult<u64> {
        self.account.take(size)?;
        let p = match self.alloc_owned(device, size) {
            Ok(p) => p,
            Err(e) => {
                self.account.give(size);
                return Err(e);
            }
        };
        self.client_bytes.insert(p, size);
        Ok(p)
    }

    fn mem_free(&mut self, ptr: u64) -> CuResult {
        self.exec.wait_idle();
        self.free_owned(ptr)?;
        if let Some(size) = self.client_bytes.remove(&ptr) {
            self.account.give(size);
        }
        Ok(())
    }

    fn ipc_export(&mut self, ptr: u64) -> CuResult<crate::ipc::SharedMemory> {
        match self.allocs.get(&ptr) {
            Some(Held::Exported(held)) => return Ok(held.clone()),
            Some(Held::Own) if self.client_bytes.contains_key(&ptr) => {}
            _ => return Err(CuError::INVALID_VALUE),
        }
        let size = self.client_bytes.remove(&ptr).unwrap_or(0);
        let held = Arc::new(SimShared { shared: self.shared.clone(), ptr, _charge: self.account.split(size) });
        self.allocs.insert(ptr, Held::Exported(held.clone()));
        Ok(held)
    }

    fn ipc_import(&mut self, memory: &crate::ipc::SharedMemory) -> CuResult<u64> {
        let held = memory.clone().downcast::<SimShared>().map_err(|_| CuError::INVALID_VALUE)?;
        if !Arc::ptr_eq(&held.shared, &self.shared) || self.allocs.contains_key(&held.ptr) {
            return Err(CuError::INVALID_VALUE);
        }
        // Device addresses are the server's, so the memory is at the same address here.
        let ptr = held.ptr;
        self.allocs.insert(ptr, Held::Imported(held));
        self.launch_memory = None;
        Ok(ptr)
    }

    fn ipc_export_event(&mut self, event: EventToken) -> CuResult<crate::ipc::SharedEvent> {
        let watch = self.exec.watch();
        let ev = self.event(event)?;
        let r = ev.shared.get_or_insert_with(|| {
            let r = IpcRecord::default();
            *r.last.lock().unwrap_or_else(|p| p.into_inner()) = ev.item.map(|id| (watch, id));
            Arc::new(r)
        });
        Ok(r.clone())
    }

    fn ipc_import_event(&mut self, device: u32, shared: &crate::ipc::SharedEvent) -> CuResult<EventToken> {
        self.shared.device(device)?;
        let r = shared.clone().downcast::<IpcRecord>().map_err(|_| CuError::INVALID_VALUE)?;
        let t = self.token();
        let ev = SimEvent { flags: EVENT_DISABLE_TIMING | EVENT_INTERPROCESS, recorded: Arc::new(Mutex::new(None)), item: None, shared: Some(r) };
        self.events.insert(t, ev);
        Ok(EventToken(t))
    }

    fn ipc_close(&mut self, ptr: u64) -> CuResult {
        if !matches!(self.allocs.get(&ptr), Some(Held::Imported(_))) {
            return Err(CuError::INVALID_VALUE);
        }
        // The session's kernels queued before the close may still use it.
        self.exec.wait_idle();
        self.free_owned(ptr)
    }

    fn mem_get_info(&mut self, device: u32) -> CuResult<(u64, u64)> {
        let m = self.shared.device(device)?;
        let (free, total) = (m.free_bytes(), m.total());
        Ok(self.account.info(free, total))
    }

    fn memcpy_htod(
        &mut self,
        stream: StreamRef,
        dst: u64,
        len: u64,
        fill: &mut dyn FnMut(&mut [u8]) -> io::Result<()>,
    ) -> Result<(), TransferError> {
        self.exec.wait_idle();
        self.check_stream(stream)?;
        if SimVmm::owns(dst) {
            for (p, n) in self.vmm.pieces(dst, len)? {
                // SAFETY: a piece lies in a live, mapped allocation of this session.
                fill(unsafe { std::slice::from_raw_parts_mut(p, n) }).map_err(TransferError::Io)?;
            }
            return Ok(());
        }
        let m = self.shared.device_of(dst)?;
        m.with_slice_mut(dst, len, |s| fill(s))?.map_err(TransferError::Io)
    }

    fn memcpy_dtoh(
        &mut self,
        stream: StreamRef,
        src: u64,
        len: u64,
        sink: &mut dyn FnMut(&[u8]) -> io::Result<()>,
    ) -> Result<(), TransferError> {
        self.exec.wait_idle();
        self.check_stream(stream)?;
        if SimVmm::owns(src) {
            for (p, n) in self.vmm.pieces(src, len)? {
                // SAFETY: as in memcpy_htod.
                sink(unsafe { std::slice::from_raw_parts(p, n) }).map_err(TransferError::Io)?;
            }
            return Ok(());
        }
        let m = self.shared.device_of(src)?;
        m.with_slice(src, len, |s| sink(s))?.map_err(TransferError::Io)
    }

    fn memcpy_dtod(&mut self, stream: StreamRef, dst: u64, src: u64, len: u64) -> CuResult {
        self.exec.wait_idle();
        self.check_stream(stream)?;
        if len == 0 {
            return Ok(());
        }
        if SimVmm::owns(src) || SimVmm::owns(dst) {
            return self.copy_mapped(dst, src, len);
        }
        let sm = self.shared.device_of(src)?;
        let dm = self.shared.device_of(dst)?;
        if std::ptr::eq(sm, dm) {
            return sm.copy_within(dst, src, len);
        }
        // Peer copy between two sim devices: distinct mappings, no overlap.
        sm.with_slice(src, len, |s| dm.with_slice_mut(dst, len, |d| d.copy_from_slice(s)))?
    }

    fn memset(&mut self, stream: StreamRef, op: &MemsetOp) -> CuResult {
        self.exec.wait_idle();
        self.check_stream(stream)?;
        let span = op.span().ok_or(CuError::INVALID_VALUE)?;
        if SimVmm::owns(op.dst) {
            return self.memset_mapped(op, span);
        }
        let m = self.shared.device_of(op.dst)?;
        let es = op.element_size as usize;
        let pattern = op.value.to_le_bytes();
        let row_bytes = (op.count * es as u64) as usize;
        let pitch = if op.rows == 1 { row_bytes } else { op.pitch as usize };
        // The pattern repeated over a block whose size every element size
        // divides, copied block by block: fixed-size copies the compiler
        // vectorises, where an element-by-element loop is many times slower.
        let mut block = [0u8; 256];
        for c in block.chunks_exact_mut(es) {
            c.copy_from_slice(&pattern[..es]);
        }
        m.with_slice_mut(op.dst, span, |s| {
            for r in 0..op.rows as usize {
                let row = &mut s[r * pitch..r * pitch + row_bytes];
                let mut blocks = row.chunks_exact_mut(block.len());
                for c in &mut blocks {
                    c.copy_from_slice(&block);
                }
                let rest = blocks.into_remainder();
                let n = rest.len();
                rest.copy_from_slice(&block[..n]);
            }
        })
    }

    fn mem_create(&mut self, device: u32, size: u64) -> CuResult<PhysicalToken> {
        self.account.take(size)?;
        match self.vmm.create(&self.shared.memory, device, size) {
            Ok(t) => Ok(PhysicalToken(t)),
            Err(e) => {
                self.account.give(size);
                Err(e)
            }
        }
    }

    fn mem_release(&mut self, phys: PhysicalToken) -> CuResult {
        self.exec.wait_idle();
        let size = self.vmm.release(&self.shared.memory, phys.0)?;
        self.account.give(size);
        Ok(())
    }

    fn mem_physical_read(&mut self, phys: PhysicalToken, sink: &mut dyn FnMut(&[u8]) -> io::Result<()>) -> Result<(), TransferError> {
        self.exec.wait_idle();
        let (device, ptr, size) = self.vmm.physical(phys.0).ok_or(CuError::INVALID_VALUE)?;
        let m = self.shared.device(device)?;
        m.with_slice(ptr, size, |s| sink(s))?.map_err(TransferError::Io)
    }

    fn mem_physical_write(&mut self, phys: PhysicalToken, fill: &mut dyn FnMut(&mut [u8]) -> io::Result<()>) -> Result<(), TransferError> {
        self.exec.wait_idle();
        let (device, ptr, size) = self.vmm.physical(phys.0).ok_or(CuError::INVALID_VALUE)?;
        let m = self.shared.device(device)?;
        m.with_slice_mut(ptr, size, |s| fill(s))?.map_err(TransferError::Io)
    }

    fn mem_address_reserve(&mut self, size: u64, alignment: u64, hint: u64) -> CuResult<u64> {
        self.vmm.reserve(size, alignment, hint)
    }

    fn mem_address_free(&mut self, ptr: u64, size: u64) -> CuResult {
        self.exec.wait_idle();
        self.vmm.address_free(ptr, size)
    }

    fn mem_map(&mut self, ptr: u64, size: u64, offset: u64, phys: PhysicalToken) -> CuResult {
        self.exec.wait_idle();
        self.vmm.map(&self.shared.memory, ptr, size, offset, phys.0)
    }

    fn mem_unmap(&mut self, ptr: u64, size: u64) -> CuResult {
        self.exec.wait_idle();
        self.launch_memory = None;
        self.vmm.unmap(ptr, size)
    }

    fn mem_set_access(&mut self, ptr: u64, size: u64, device: u32, flags: u32) -> CuResult {
        self.exec.wait_idle();
        self.shared.device(device)?;
        let accessible = match flags {
            crate::vmm::ACCESS_NONE => false,
            crate::vmm::ACCESS_READWRITE => true,
            _ => {
                // The interpreter's memory has no read-only regions to fault writes in.
                warn_once_read_only();
                return Err(CuError::NOT_SUPPORTED);
            }
        };
        self.launch_memory = None;
        self.vmm.set_access(ptr, size, accessible)
    }

    fn stream_create(&mut self, device: u32, flags: u32, _priority: i32) -> CuResult<StreamToken> {
        self.shared.device(device)?;
        let t = self.token();
        self.streams.insert(t, (device, flags & STREAM_NON_BLOCKING == 0));
        Ok(StreamToken(t))
    }

    fn stream_destroy(&mut self, stream: StreamToken) -> CuResult {
        let lane = self.lane(StreamRef::Created(stream))?;
        // Work already queued on it still runs, as in CUDA.
        self.exec.forget(lane);
        self.streams.remove(&stream.0).map(|_| ()).ok_or(CuError::INVALID_HANDLE)
    }

    fn stream_synchronize(&mut self, stream: StreamRef) -> CuResult {
        match self.lane(stream)? {
            // Its last item follows every earlier item of the stream.
            lane @ executor::Lane::Created { .. } => {
                if let Some(id) = self.exec.last_live(lane) {
                    self.exec.wait_for(id);
                }
            }
            // Programs sync the legacy stream to mean "all my work"; waiting
            // for all of it is never less than CUDA waits.
            executor::Lane::Default(_) => self.exec.wait_idle(),
        }
        Ok(())
    }

    fn stream_query(&mut self, stream: StreamRef) -> CuResult {
        let lane = self.lane(stream)?;
        if self.exec.lane_busy(lane) {
            return Err(CuError::NOT_READY);
        }
        Ok(())
    }

    fn stream_wait_event(&mut self, stream: StreamRef, event: EventToken, _flags: u32) -> CuResult {
        let lane = self.lane(stream)?;
        match self.last_record(event)? {
            Some((w, id)) if w.watches(&self.exec) && self.exec.pending(id) => {
                self.exec.enqueue(lane, Some(id), executor::Work::Wait)?;
            }
            // Recorded by another session (an interprocess event).
            Some((w, id)) if w.pending(id) => {
                self.exec.enqueue(lane, None, executor::Work::Remote(w, id))?;
            }
            _ => {}
        }
        Ok(())
    }

    fn event_create(&mut self, device: u32, flags: u32) -> CuResult<EventToken> {
        self.shared.device(device)?;
        let t = self.token();
        self.events.insert(t, SimEvent { flags, recorded: Arc::new(Mutex::new(None)), item: None, shared: None });
        Ok(EventToken(t))
    }

    fn event_destroy(&mut self, event: EventToken) -> CuResult {
        self.events.remove(&event.0).map(|_| ()).ok_or(CuError::INVALID_HANDLE)
    }

    fn event_record(&mut self, event: EventToken, stream: StreamRef) -> CuResult {
        let lane = self.lane(stream)?;
        self.event(event)?;
        // A fresh stamp per record: a query of the event asks about its last record only.
        let stamp = Arc::new(Mutex::new(None));
        // Queued even on an idle stream: what it must follow depends on the
        // other streams too (the legacy default stream's rules).
        let item = Some(self.exec.enqueue(lane, None, executor::Work::Record(stamp.clone()))?);
        let watch = self.exec.watch();
        let ev = self.event(event)?;
        ev.recorded = stamp;
        ev.item = item;
        if let (Some(r), Some(id)) = (&ev.shared, item) {
            *r.last.lock().unwrap_or_else(|p| p.into_inner()) = Some((watch, id));
        }
        Ok(())
    }

    fn event_synchronize(&mut self, event: EventToken) -> CuResult {
        match self.last_record(event)? {
            Some((w, id)) if !w.watches(&self.exec) => {
                // Another session's record: wait for it, however long it
                // takes (as on a GPU), but not past this session's end.
                while !self.exec.wait_remote(&w, id, REMOTE_WAIT_SLICE) {
                    if self.cancel.load(std::sync::atomic::Ordering::Relaxed) {
                        return Err(CuError::LAUNCH_FAILED);
                    }
                }
            }
            // This session's record: it is done once the stream reached it,
            // whatever was queued after it.
            Some((_, id)) => self.exec.wait_for(id),
            // Never recorded: nothing to wait for.
            None => {}
        }
        Ok(())
    }

    fn event_query(&mut self, event: EventToken) -> CuResult {
        if self.last_record(event)?.is_some_and(|(w, id)| w.pending(id)) {
            return Err(CuError::NOT_READY);
        }
        Ok(())
    }

    fn event_elapsed_time(&mut self, start: EventToken, end: EventToken) -> CuResult<f32> {
        let stamp = |s: &Self, e: EventToken| -> CuResult<Instant> {
            let ev = s.events.get(&e.0).ok_or(CuError::INVALID_HANDLE)?;
            if ev.flags & EVENT_DISABLE_TIMING != 0 {
                return Err(CuError::INVALID_HANDLE);
            }
            if ev.item.is_some_and(|id| s.exec.pending(id)) {
                return Err(CuError::NOT_READY);
            }
            let at = *ev.recorded.lock().unwrap_or_else(|p| p.into_inner());
            at.ok_or(CuError::INVALID_HANDLE)
        };
        let (a, b) = (stamp(self, start)?, stamp(self, end)?);
        // CUDA reports a negative time when `end` was recorded before `start`.
        let ms = if b >= a {
            b.duration_since(a).as_secs_f64() * 1e3
        } else {
            -(a.duration_since(b).as_secs_f64() * 1e3)
        };
        Ok(ms as f32)
    }

    fn ctx_synchronize(&mut self, device: u32) -> CuResult {
        self.exec.wait_idle();
        self.shared.device(device).map(|_| ())
    }

    fn reset_context(&mut self, device: u32) -> CuResult<Option<CuError>> {
        self.shared.device(device)?;
        // A sim context is nothing beyond the session's objects, all gone
        // by now: once its queued work has ended it is as new.
        self.exec.wait_idle();
        Ok(self.exec.take_error())
    }

    fn module_load(
        &mut self,
        device: u32,
        _image: &[u8],
        parsed: &ModuleImage,
    ) -> CuResult<(ModuleToken, LoadedModule)> {
        self.load_module(device, parsed, None)
    }

    fn module_load_at(
        &mut self,
        device: u32,
        _image: &[u8],
        parsed: &ModuleImage,
        globals: &[u64],
    ) -> CuResult<(ModuleToken, LoadedModule)> {
        if globals.len() != parsed.globals.len() {
            return Err(CuError::INVALID_VALUE);
        }
        self.load_module(device, parsed, Some(globals))
    }

    fn relocatable(&self) -> bool {
        true
    }

    fn memory_peek(&self) -> Option<Arc<dyn crate::backend::MemoryPeek>> {
        Some(Arc::new(SimPeek(self.shared.clone())))
    }

    fn quiesce(&mut self, timeout: Duration) -> CuResult {
        self.capture_at = None;
        if self.exec.wait_idle_for(timeout) {
            Ok(())
        } else {
            Err(CuError::NOT_READY)
        }
    }

    fn mem_alloc_at(&mut self, device: u32, ptr: u64, size: u64) -> CuResult {
        self.account.take(size)?;
        if let Err(e) = self.shared.device(device).and_then(|m| m.alloc_at(ptr, size)) {
            self.account.give(size);
            return Err(e);
        }
        self.allocs.insert(ptr, Held::Own);
        self.launch_memory = None;
        self.client_bytes.insert(ptr, size);
        Ok(())
    }

    fn event_recorded_ago(&mut self, event: EventToken) -> CuResult<Option<Duration>> {
        let ev = self.events.get(&event.0).ok_or(CuError::INVALID_HANDLE)?;
        if ev.item.is_some_and(|id| self.exec.pending(id)) {
            return Err(CuError::NOT_READY);
        }
        let at = *ev.recorded.lock().unwrap_or_else(|p| p.into_inner());
        let now = *self.capture_at.get_or_insert_with(Instant::now);
        Ok(at.map(|at| now.saturating_duration_since(at)))
    }

    fn event_restore(&mut self, device: u32, flags: u32, recorded_ago: Option<Duration>) -> CuResult<EventToken> {
        self.shared.device(device)?;
        let now = *self.restore_at.get_or_insert_with(Instant::now);
        // An Instant cannot go back past the host's boot: such an old record
        // becomes one at the earliest time this host can say.
        let at = recorded_ago.map(|ago| now.checked_sub(ago).unwrap_or(now));
        let t = self.token();
        self.events.insert(t, SimEvent { flags, recorded: Arc::new(Mutex::new(at)), item: None, shared: None });
        Ok(EventToken(t))
    }


    fn module_unload(&mut self, module: ModuleToken) -> CuResult {
        self.exec.wait_idle();
        let m = self.modules.remove(&module.0).ok_or(CuError::INVALID_HANDLE)?;
        for p in m.globals {
            let _ = self.free_owned(p);
        }
        self.account.give(m.global_bytes);
        Ok(())
    }

    fn module_host_bytes(&self, module: ModuleToken) -> u64 {
        self.modules.get(&module.0).map_or(0, |m| {
            m.programs.iter().filter_map(|p| p.as_ref().ok()).map(|p| rgpu_ptx::Module::program_bytes(p) as u64).sum()
        })
    }

    fn set_cancel(&mut self, cancel: Arc<AtomicBool>) {
        self.exec = executor::Executor::new(cancel.clone());
        self.cancel = cancel;
    }

    fn launch_kernel(
        &mut self,
        module: ModuleToken,
        function: u32,
        dims: &LaunchDims,
        stream: StreamRef,
        params: &[u8],
    ) -> CuResult {
        self.check_stream(stream)?;
        let m = self.modules.get(&module.0).ok_or(CuError::INVALID_HANDLE)?;
        let prog = match m.programs.get(function as usize).ok_or(CuError::INVALID_HANDLE)? {
            Ok(p) => p.clone(),
            Err(why) => {
                warn!("launch refused: {why}");
                return Err(CuError::NOT_SUPPORTED);
            }
        };
        if dims.cooperative {
            let r = m.resources.get(function as usize).ok_or(CuError::INVALID_HANDLE)?;
            cooperative::check(&prog.name, r, dims, kernels::block_state_bytes(&prog, dims))?;
        }
        if prog.does_nothing() {
            // Parameters and dimensions were checked; there is nothing to run.
            return Ok(());
        }
        let regions = match &self.launch_memory {
            Some(r) => r.clone(),
            None => {
                let r = Arc::new(kernels::SessionMemory::new(
                    &self.shared.memory,
                    self.allocs.keys().copied(),
                    self.vmm.regions(),
                ));
                self.launch_memory = Some(r.clone());
                r
            }
        };
        let lane = self.lane(stream)?;
        let (dims, params, limit, cancel) = (*dims, params.to_vec(), self.shared.kernel_time_limit, self.cancel.clone());
        let compiled = self.shared.compiled_tier;
        let (timer, device, share) = (self.timer.clone(), lane.device(), self.share.clone());
        let busy = self.shared.busy.get(device as usize).cloned();
        let run = move |out: &mut Vec<u8>| {
            let _busy = busy.as_ref().map(|b| b.enter());
            let started = Instant::now();
            let r = kernels::run(&prog, &dims, &params, &regions, out, limit, compiled, &cancel, &share);
            if let Some(t) = timer {
                t(device, started.elapsed());
            }
            r
        };
        self.exec.enqueue(lane, None, executor::Work::Kernel(Box::new(run)))?;
        Ok(())
    }

    fn take_async_error(&mut self) -> Option<CuError> {
        self.exec.take_error()
    }

    fn time_kernels(&mut self, timer: crate::backend::KernelTimer) -> bool {
        self.timer = Some(timer);
        true
    }

    fn share_compute(&mut self, lease: u64, milli: u16) -> bool {
        // Kernels already queued keep the old place; they are the session's own either way.
        self.share = Arc::new(self.shared.cores.join(share::Who::Lease(lease), milli));
        true
    }

    fn take_output(&mut self) -> Vec<u8> {
        let mut out = std::mem::take(&mut self.output);
        out.extend_from_slice(&self.exec.take_output());
        out
    }
}

impl Drop for SimSession {
    fn drop(&mut self) {
        // Stops and joins the executor before the memory its kernels use is freed.
        self.exec = executor::Executor::new(Arc::new(AtomicBool::new(true)));
        self.vmm.release_all(&self.shared.memory);
        let ptrs: Vec<u64> = self.allocs.keys().copied().collect();
        for p in ptrs {
            let _ = self.free_owned(p);
        }
    }
}

fn warn_once_read_only() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        warn!("cuMemSetAccess with CU_MEM_ACCESS_FLAGS_PROT_READ is not supported by the rgpu sim (read-write or none only)")
    });
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates
    // when the name fits (we leave room and cut at the first NUL anyway).
    let r = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len() - 1) };
    if r != 0 {
        return String::new();
    }
    let n = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// A UUID stable across restarts: FNV-1a (128-bit) of host, ordinal and seed,
/// stamped as an RFC 4122 version-8 (custom) UUID.
fn device_uuid(host: &str, ordinal: u32, seed: Option<&str>) -> [u8; 16] {
    const OFFSET: u128 = 0x6c62272e07bb014262b821756295c58d;
    const PRIME: u128 = 0x0000000001000000000000000000013B;
    let mut h = OFFSET;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= b as u128;
            h = h.wrapping_mul(PRIME);
        }
    };
    eat(b"rgpu-sim\0");
    eat(host.as_bytes());
    eat(&[0]);
    eat(&ordinal.to_le_bytes());
    if let Some(s) = seed {
        eat(&[1]);
        eat(s.as_bytes());
    }
    let mut u = h.to_be_bytes();
    u[6] = (u[6] & 0x0f) | 0x80;
    u[8] = (u[8] & 0x3f) | 0x80;
    u
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_are_stable_and_distinct() {
        assert_eq!(device_uuid("h", 0, None), device_uuid("h", 0, None));
        assert_ne!(device_uuid("h", 0, None), device_uuid("h", 1, None));
        assert_ne!(device_uuid("h", 0, None), device_uuid("h", 0, Some("x")));
    }
}
