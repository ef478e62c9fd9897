//! What the server needs from a GPU, behind one trait pair.
//!
//! [`Backend`] is the server-wide part: device inventory and the factory of
//! per-session views. [`BackendSession`] is one session's view: every object
//! it creates (allocations, streams, events, modules) belongs to it, and
//! dropping it releases all of them. That shape fits both backends:
//!
//! - `sim` (today): device memory is an mmap'd region per device, work runs
//!   inline in arrival order, streams and events are bookkeeping.
//! - `cuda` (on cudarc, see [`cuda`]): a session owns a context per device it
//!   touches; a [`StreamToken`]/[`EventToken`]/[`ModuleToken`] carries the raw
//!   `CUstream`/`CUevent`/`CUmodule`; `memcpy_htod`/`memcpy_dtoh` go through a
//!   pinned staging buffer chunk by chunk, which is why they take callbacks
//!   instead of handing out a slice of device memory.
//!
//! Each [`BackendSession`] method is named after the data-plane message whose
//! handler calls it (`eventElapsedTime` → `command::event::EventElapsedTime`
//! → [`BackendSession::event_elapsed_time`]), so the three read as one chain.
//!
//! The handlers above check every client handle and pointer against the
//! session's own tables ([`crate::state`]) before calling in here, so a
//! backend may assume the ranges it gets were allocated by this session; it
//! must still never touch memory outside its devices (the sim bounds-checks
//! again).

pub mod cuda;
pub mod fair;
pub mod graph;
pub mod launch_limits;
pub mod sim;

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use rgpu_cuda_types::CuResult;
use crate::module::ModuleImage;

/// Static description of one device, as `listDevices` reports it.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub ordinal: u32,
    pub name: String,
    pub uuid: [u8; 16],
    pub total_mem: u64,
    pub pci_domain: i32,
    pub pci_bus: i32,
    pub pci_device: i32,
    /// `(CUdevice_attribute, value)` for every attribute the device answers.
    pub attributes: Vec<(u32, i32)>,
}

/// A backend object the session created, opaque to everything above the
/// backend (the sim's own counter; later a raw CUDA handle).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StreamToken(pub u64);
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EventToken(pub u64);
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ModuleToken(pub u64);
/// A physical allocation of the virtual memory management API (cuMemCreate): the sim's own
/// counter, or the driver's `CUmemGenericAllocationHandle`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PhysicalToken(pub u64);

/// Where work is ordered: a device's default stream, or one the session created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamRef {
    Default { device: u32 },
    Created(StreamToken),
}

/// `cuMemsetD{8,16,32}` and their 2-D forms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemsetOp {
    pub dst: u64,
    /// The pattern, in its low `element_size` bytes.
    pub value: u32,
    /// 1, 2 or 4.
    pub element_size: u8,
    /// Elements per row.
    pub count: u64,
    /// Bytes from one row's start to the next; ignored when `rows` is 1.
    pub pitch: u64,
    /// 1 for a 1-D memset.
    pub rows: u64,
}

impl MemsetOp {
    /// The byte range the memset touches, `[dst, dst + span)`; `None` if it
    /// overflows or the shape is invalid.
    pub fn span(&self) -> Option<u64> {
        if !matches!(self.element_size, 1 | 2 | 4) || self.rows == 0 {
            return None;
        }
        let row_bytes = self.count.checked_mul(self.element_size as u64)?;
        if self.rows == 1 {
            return Some(row_bytes);
        }
        if self.pitch < row_bytes {
            return None;
        }
        self.pitch.checked_mul(self.rows - 1)?.checked_add(row_bytes)
    }
}

/// What a loaded module offers, as `ModuleLoaded` reports it.
#[derive(Debug, Clone, Default)]
pub struct LoadedModule {
    pub functions: Vec<FunctionInfo>,
    pub globals: Vec<GlobalInfo>,
    /// Empty when the kernels can run on this backend; else why not.
    pub launch_note: String,
}

#[derive(Debug, Clone, Default)]
pub struct FunctionInfo {
    pub name: String,
    /// `(offset, size)` of each parameter in the packed kernelParams buffer.
    pub params: Vec<(u32, u32)>,
    pub max_threads_per_block: i32,
    pub shared_size_bytes: i32,
    pub const_size_bytes: i32,
    pub local_size_bytes: i32,
    pub num_regs: i32,
    pub ptx_version: i32,
    pub binary_version: i32,
    /// Why this kernel cannot be launched here; empty when it can.
    pub launch_note: String,
}

impl FunctionInfo {
    /// Bytes of the packed parameter buffer: the end of the last parameter.
    pub fn param_buffer_len(&self) -> u64 {
        self.params.iter().map(|&(o, s)| o as u64 + s as u64).max().unwrap_or(0)
    }
}

/// A module global: device memory owned by the module, freed with it.
#[derive(Debug, Clone)]
pub struct GlobalInfo {
    pub name: String,
    pub ptr: u64,
    pub size: u64,
    /// A `__managed__` variable (`module::GlobalInfo::managed`).
    pub managed: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchDims {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_mem_bytes: u32,
    /// `cuLaunchCooperativeKernel`: every block resident at once (grid-wide sync).
    pub cooperative: bool,
}

/// A device-memory transfer failed either on the device side (a CUDA error
/// for the request) or on the host side (the callback's I/O error, which
/// means the connection is gone).
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error(transparent)]
    Device(#[from] rgpu_cuda_types::CuError),
    #[error("connection failed during a device transfer: {0}")]
    Io(io::Error),
}

/// The device memory one lease may hold on this server, over all of its
/// sessions: a limit and what its sessions hold now.
#[derive(Debug)]
pub struct MemoryBudget {
    limit: u64,
    used: AtomicU64,
}

impl MemoryBudget {
    pub fn new(limit: u64) -> Self {
        MemoryBudget { limit, used: AtomicU64::new(0) }
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes the lease's sessions hold now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    /// Bytes the lease may still allocate.
    pub fn remaining(&self) -> u64 {
        self.limit.saturating_sub(self.used())
    }

    /// Takes `size` bytes, or nothing when that would pass the limit.
    fn take(&self, size: u64) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| u.checked_add(size).filter(|&n| n <= self.limit))
            .is_ok()
    }

    fn give(&self, size: u64) {
        let _ = self.used.fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| Some(u.saturating_sub(size)));
    }
}

/// One session's share of its lease's [`MemoryBudget`] (or no limit at
/// all): the backend takes bytes before it allocates and gives them back
/// after it frees. Whatever the session still holds goes back to the lease
/// when this is dropped, so a backend session keeps it as a field (fields
/// drop after the session's own `Drop`, i.e. after its memory is freed).
#[derive(Debug, Default)]
pub struct MemoryAccount {
    budget: Option<Arc<MemoryBudget>>,
    /// Bytes this session holds.
    held: u64,
}

impl MemoryAccount {
    pub fn new(budget: Option<Arc<MemoryBudget>>) -> Self {
        MemoryAccount { budget, held: 0 }
    }

    /// Reserves `size` bytes for an allocation about to be made;
    /// `OUT_OF_MEMORY` when the lease has not that much left.
    pub fn take(&mut self, size: u64) -> CuResult {
        if let Some(b) = &self.budget {
            if !b.take(size) {
                return Err(rgpu_cuda_types::CuError::OUT_OF_MEMORY);
            }
        }
        self.held = self.held.saturating_add(size);
        Ok(())
    }

    /// Moves `size` of the bytes this session holds into a new account on the
    /// same budget: they stay charged to the lease, now held by whatever keeps
    /// the new account (memory another session may use after this one lets go).
    pub fn split(&mut self, size: u64) -> MemoryAccount {
        let size = size.min(self.held);
        self.held -= size;
        MemoryAccount { budget: self.budget.clone(), held: size }
    }

    /// Returns `size` bytes (freed, or an allocation that failed after `take`).
    pub fn give(&mut self, size: u64) {
        let size = size.min(self.held);
        self.held -= size;
        if let Some(b) = &self.budget {
            b.give(size);
        }
    }

    /// `(free, total)` as the session sees them: the device's, capped by the
    /// lease's remainder and limit.
    pub fn info(&self, free: u64, total: u64) -> (u64, u64) {
        match &self.budget {
            Some(b) => (free.min(b.remaining()), total.min(b.limit())),
            None => (free, total),
        }
    }
}

impl Drop for MemoryAccount {
    fn drop(&mut self) {
        let held = self.held;
        self.give(held);
    }
}

pub trait Backend: Send + Sync + 'static {
    /// Reported by `hello`: "sim" or "cuda".
    fn name(&self) -> &'static str;
    fn devices(&self) -> &[DeviceInfo];
    /// A fresh, empty view of the devices for one session. With a `budget`
    /// (a lease's, shared by all its sessions on this server), the client
    /// allocations of all those sessions together may not exceed its limit
    /// (past it, `CUDA_ERROR_OUT_OF_MEMORY`), and `mem_get_info` reports
    /// the budget's remainder and limit.
    fn open_session(&self, budget: Option<Arc<MemoryBudget>>) -> CuResult<Box<dyn BackendSession>>;
    /// Whether its sessions report each kernel's execution time
    /// ([`BackendSession::time_kernels`]: what [`crate::metering`] counts as
    /// device time). A backend that cannot must answer false (the default):
    /// its kernel times are then reported as unknown, never as the time a
    /// launch took to queue.
    fn kernel_times_known(&self) -> bool {
        false
    }
    /// Each device's health now, by ordinal: what the broker agent reports
    /// ([`crate::health`]). A backend reports only what it observes; what
    /// it cannot observe counts as healthy.
    fn health(&self) -> Vec<crate::health::DeviceHealth>;
    /// Sets (`Some`) or clears device `device`'s injected fault (an
    /// operator's `injectFault`); its health after. Only a backend whose
    /// devices are simulated takes one.
    fn set_fault(&self, _device: u32, _fault: Option<crate::health::Fault>) -> Result<crate::health::DeviceHealth, crate::health::HealthError> {
        Err(crate::health::HealthError::NotInjectable(self.name()))
    }
    /// Each device's activity and sensors now, by ordinal: what
    /// `deviceStatus` reports ([`crate::telemetry`]). A backend reports only
    /// what it reads or measures; the rest is [`Reading::NotReported`]
    /// (the default, for all of it). May block for a while (NVML queries,
    /// which on a chained server cross the network): callers keep it off
    /// the async threads.
    ///
    /// [`Reading::NotReported`]: crate::telemetry::Reading::NotReported
    fn telemetry(&self) -> Vec<crate::telemetry::DeviceTelemetry> {
        vec![crate::telemetry::DeviceTelemetry::default(); self.devices().len()]
    }
}

/// One session's objects. Methods take `&mut self`: a session is served by
/// one thread, in arrival order. Dropping it frees everything it still holds.
/// Called with (device, execution time) as each kernel of a session ends.
pub type KernelTimer = Arc<dyn Fn(u32, std::time::Duration) + Send + Sync>;

/// Reads a session's device memory from another thread while the session
/// runs: the pre-copy of a live migration (`crate::migration`).
pub trait MemoryPeek: Send + Sync {
    /// Copies `buf.len()` bytes at `at` into `buf` if `[alloc, alloc + size)`
    /// is still one live allocation of `device` and the bytes lie in it;
    /// false otherwise (nothing copied). Bytes the session's kernels write
    /// meanwhile may come out torn: callers keep a digest of what they got
    /// and compare it once the session is held still.
    fn peek(&self, device: u32, alloc: u64, size: u64, at: u64, buf: &mut [u8]) -> bool;
    /// Hands `f` the `len` bytes at `at` in place, if they lie in one live
    /// allocation of `device`. Only while the session is held still (nothing
    /// writes them): a held migration digests its memory this way, on
    /// several threads, without copying it.
    fn with_held(&self, device: u32, at: u64, len: u64, f: &mut dyn FnMut(&[u8])) -> bool;
}

pub trait BackendSession: Send {
    // --- memory -----------------------------------------------------------
    fn mem_alloc(&mut self, device: u32, size: u64) -> CuResult<u64>;
    fn mem_free(&mut self, ptr: u64) -> CuResult;
    /// `(free, total)` bytes of `device`.
    fn mem_get_info(&mut self, device: u32) -> CuResult<(u64, u64)>;
    /// Writes `len` bytes at `dst`, produced by `fill`: it is called with
    /// device-visible buffers (the destination itself, or staging chunks) in
    /// order, and must fill each completely.
    fn memcpy_htod(
        &mut self,
        stream: StreamRef,
        dst: u64,
        len: u64,
        fill: &mut dyn FnMut(&mut [u8]) -> io::Result<()>,
    ) -> Result<(), TransferError>;
    /// Reads `len` bytes at `src`, handing them to `sink` in order, in one or
    /// more pieces.
    fn memcpy_dtoh(
        &mut self,
        stream: StreamRef,
        src: u64,
        len: u64,
        sink: &mut dyn FnMut(&[u8]) -> io::Result<()>,
    ) -> Result<(), TransferError>;
    fn memcpy_dtod(&mut self, stream: StreamRef, dst: u64, src: u64, len: u64) -> CuResult;
    fn memset(&mut self, stream: StreamRef, op: &MemsetOp) -> CuResult;

    // --- virtual memory management ------------------------------------------
    // [`crate::vmm`] checks every request against the session's reservations, maps and
    // allocations before it comes here: a backend gets granular sizes, maps inside a
    // reservation over no other map, unmaps and access changes of whole maps, and releases of
    // allocations no longer mapped. A backend without VMM refuses it as a driver would.

    /// cuMemCreate: `size` bytes of `device` memory (charged like `mem_alloc`), zeroed.
    fn mem_create(&mut self, _device: u32, _size: u64) -> CuResult<PhysicalToken> {
        Err(rgpu_cuda_types::CuError::NOT_SUPPORTED)
    }
    /// cuMemRelease of an allocation no longer mapped anywhere.
    fn mem_release(&mut self, _phys: PhysicalToken) -> CuResult {
        Err(rgpu_cuda_types::CuError::NOT_SUPPORTED)
    }
    /// cuMemAddressReserve: `alignment` is a power of two, at least the granularity; `hint`
    /// (0 for none) is taken if it is free and usable.
    fn mem_address_reserve(&mut self, _size: u64, _alignment: u64, _hint: u64) -> CuResult<u64> {
        Err(rgpu_cuda_types::CuError::NOT_SUPPORTED)
    }
    fn mem_address_free(&mut self, _ptr: u64, _size: u64) -> CuResult {
        Err(rgpu_cuda_types::CuError::NOT_SUPPORTED)
    }
    /// cuMemMap of `[offset, offset + size)` of `phys` at `ptr`; no access yet.
    fn mem_map(&mut self, _ptr: u64, _size: u64, _offset: u64, _phys: PhysicalToken) -> CuResult {
        Err(rgpu_cuda_types::CuError::NOT_SUPPORTED)
    }
    /// cuMemUnmap of exactly one map.
    fn mem_unmap(&mut self, _ptr: u64, _size: u64) -> CuResult {
        Err(rgpu_cuda_types::CuError::NOT_SUPPORTED)
    }
    /// cuMemSetAccess of whole maps for one device.
    fn mem_set_access(&mut self, _ptr: u64, _size: u64, _device: u32, _flags: u32) -> CuResult {
        Err(rgpu_cuda_types::CuError::NOT_SUPPORTED)
    }
    /// A snapshot reads the whole of physical allocation `phys` (mapped or not), handing it
    /// to `sink` in order, in one or more pieces. Only a backend that can place memory
    /// (`relocatable`) needs it.
    fn mem_physical_read(&mut self, _phys: PhysicalToken, _sink: &mut dyn FnMut(&[u8]) -> io::Result<()>) -> Result<(), TransferError> {
        Err(TransferError::Device(rgpu_cuda_types::CuError::NOT_SUPPORTED))
    }
    /// A rebuild fills the whole of physical allocation `phys` from `fill`.
    fn mem_physical_write(&mut self, _phys: PhysicalToken, _fill: &mut dyn FnMut(&mut [u8]) -> io::Result<()>) -> Result<(), TransferError> {
        Err(TransferError::Device(rgpu_cuda_types::CuError::NOT_SUPPORTED))
    }

    // --- IPC ([`crate::ipc`]) ------------------------------------------------
    // The handlers check that `ptr` is the start of one of the session's own client allocations
    // (export) or of an allocation it opened (close), and that the session may open the export.

    /// Makes the client allocation at `ptr` shareable: the returned hold keeps its device memory
    /// (and its charge to the lease) alive until the session has freed it and every other
    /// holder has let go.
    fn ipc_export(&mut self, _ptr: u64) -> CuResult<crate::ipc::SharedMemory> {
        Err(rgpu_cuda_types::CuError::NOT_SUPPORTED)
    }
    /// Maps another session's export into this one; returns the address the session uses.
    fn ipc_import(&mut self, _memory: &crate::ipc::SharedMemory) -> CuResult<u64> {
        Err(rgpu_cuda_types::CuError::NOT_SUPPORTED)
    }
    /// Unmaps what `ipc_import` mapped at `ptr`, after the session's work queued before.
    fn ipc_close(&mut self, _ptr: u64) -> CuResult {
        Err(rgpu_cuda_types::CuError::NOT_SUPPORTED)
    }
    /// Shares the event's record with other sessions (an interprocess event):
    /// the returned hold is what [`Self::ipc_import_event`] opens.
    fn ipc_export_event(&mut self, _event: EventToken) -> CuResult<crate::ipc::SharedEvent> {
        Err(rgpu_cuda_types::CuError::NOT_SUPPORTED)
    }
    /// An event of this session on `device` that is another session's
    /// exported event: a record in either is the event's last record in both.
    fn ipc_import_event(&mut self, _device: u32, _shared: &crate::ipc::SharedEvent) -> CuResult<EventToken> {
        Err(rgpu_cuda_types::CuError::NOT_SUPPORTED)
    }

    // --- streams and events -------------------------------------------------
    fn stream_create(&mut self, device: u32, flags: u32, priority: i32) -> CuResult<StreamToken>;
    fn stream_destroy(&mut self, stream: StreamToken) -> CuResult;
    fn stream_synchronize(&mut self, stream: StreamRef) -> CuResult;
    /// `Ok` when all work is done, `Err(NOT_READY)` while some is pending.
    fn stream_query(&mut self, stream: StreamRef) -> CuResult;
    fn stream_wait_event(&mut self, stream: StreamRef, event: EventToken, flags: u32) -> CuResult;
    fn event_create(&mut self, device: u32, flags: u32) -> CuResult<EventToken>;
    fn event_destroy(&mut self, event: EventToken) -> CuResult;
    fn event_record(&mut self, event: EventToken, stream: StreamRef) -> CuResult;
    fn event_synchronize(&mut self, event: EventToken) -> CuResult;
    fn event_query(&mut self, event: EventToken) -> CuResult;
    /// Milliseconds from `start` to `end`.
    fn event_elapsed_time(&mut self, start: EventToken, end: EventToken) -> CuResult<f32>;
    fn ctx_synchronize(&mut self, device: u32) -> CuResult;
    /// Waits for the session's work on `device`, then starts its context
    /// there afresh, as cuDevicePrimaryCtxReset does; called only when the
    /// session holds nothing. Returns the error of asynchronous work that
    /// failed since the last call (its context is gone, the caller decides
    /// whether the device is). A backend that cannot start a context
    /// afresh says `NOT_SUPPORTED`, and the session keeps its state.
    fn reset_context(&mut self, _device: u32) -> CuResult<Option<rgpu_cuda_types::CuError>> {
        Err(rgpu_cuda_types::CuError::NOT_SUPPORTED)
    }

    // --- modules and launches ---------------------------------------------
    /// The architecture (compute capability X.Y as XY) whose code the backend picks from
    /// `device`'s module images itself: the image reader then chooses PTX as a driver would
    /// for it. `u32::MAX` (the default) for a backend whose driver chooses.
    fn module_arch(&self, _device: u32) -> u32 {
        u32::MAX
    }
    /// Loads `image` (whose parse is `parsed`) on `device`, globals included.
    fn module_load(
        &mut self,
        device: u32,
        image: &[u8],
        parsed: &ModuleImage,
    ) -> CuResult<(ModuleToken, LoadedModule)>;
    fn module_unload(&mut self, module: ModuleToken) -> CuResult;
    /// Host memory the backend keeps for a loaded module beyond its image
    /// (the sim's decoded kernels), counted with the image against the
    /// lease's module quota.
    fn module_host_bytes(&self, _module: ModuleToken) -> u64 {
        0
    }
    /// The flag raised when the session ends (its connection closed or
    /// dropped, or the server stopping): work running for the session stops
    /// soon after. The default ignores it (a real GPU's kernels cannot be
    /// stopped; its context goes with the session).
    fn set_cancel(&mut self, _cancel: Arc<AtomicBool>) {}

    /// Launches function `function` of `module`; `params` is the packed
    /// kernelParams buffer, already checked against the function's layout.
    fn launch_kernel(
        &mut self,
        module: ModuleToken,
        function: u32,
        dims: &LaunchDims,
        stream: StreamRef,
        params: &[u8],
    ) -> CuResult;

    /// The first error of asynchronous work (a kernel) that failed since
    /// the last call, for the next reply to carry as its deferred error.
    fn take_async_error(&mut self) -> Option<rgpu_cuda_types::CuError> {
        None
    }

    /// Has the session report each kernel it runs, with its device and
    /// execution time, through `timer` when the kernel ends; false where it
    /// cannot time its kernels (the caller then counts launches itself).
    fn time_kernels(&mut self, _timer: KernelTimer) -> bool {
        false
    }

    /// Has the session's kernels share the device with the other sessions
    /// of lease `lease` (together), getting device time in proportion to
    /// `milli` thousandths of it against other leases when they compete;
    /// false where the backend cannot enforce shares.
    fn share_compute(&mut self, _lease: u64, _milli: u16) -> bool {
        false
    }

    /// Text kernels printed (device `printf`) since the last call, for the
    /// next reply to carry to the client.
    fn take_output(&mut self) -> Vec<u8> {
        Vec::new()
    }

    // --- checkpoint and restore ([`crate::checkpoint`]) ----------------------
    // A session can leave the server only where the backend can place memory at the
    // addresses the program holds; a backend that cannot keeps the defaults, and a
    // checkpoint of its sessions is refused with NOT_SUPPORTED before anything is written.

    /// Whether this backend can rebuild a session with every device pointer it held.
    fn relocatable(&self) -> bool {
        false
    }
    /// A reader of this session's memory for other threads (pre-copy); None:
    /// the backend has none, and a migration copies everything while the
    /// session is held still.
    fn memory_peek(&self) -> Option<Arc<dyn MemoryPeek>> {
        None
    }
    /// Waits at most `timeout` for every queued stream operation of the session to
    /// finish: `Err(NOT_READY)` if some is still running then.
    fn quiesce(&mut self, _timeout: std::time::Duration) -> CuResult {
        Err(rgpu_cuda_types::CuError::NOT_SUPPORTED)
    }
    /// As `mem_alloc`, at exactly `ptr` (which must be free on `device`).
    fn mem_alloc_at(&mut self, _device: u32, _ptr: u64, _size: u64) -> CuResult {
        Err(rgpu_cuda_types::CuError::NOT_SUPPORTED)
    }
    /// As `module_load`, with the module's globals at `globals` (one pointer per global
    /// of `parsed`, in order) instead of wherever the allocator puts them.
    fn module_load_at(
        &mut self,
        _device: u32,
        _image: &[u8],
        _parsed: &ModuleImage,
        _globals: &[u64],
    ) -> CuResult<(ModuleToken, LoadedModule)> {
        Err(rgpu_cuda_types::CuError::NOT_SUPPORTED)
    }
    /// How long ago `event`'s last record completed; None if it was never recorded.
    /// Asked only of a quiesced session (no record pending).
    fn event_recorded_ago(&mut self, _event: EventToken) -> CuResult<Option<std::time::Duration>> {
        Err(rgpu_cuda_types::CuError::NOT_SUPPORTED)
    }
    /// An event as `event_create` makes it, already recorded `recorded_ago` before now
    /// (so elapsed times between restored events are the ones measured before).
    fn event_restore(
        &mut self,
        _device: u32,
        _flags: u32,
        _recorded_ago: Option<std::time::Duration>,
    ) -> CuResult<EventToken> {
        Err(rgpu_cuda_types::CuError::NOT_SUPPORTED)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accounts_share_a_budget_and_give_back_on_drop() {
        let b = Arc::new(MemoryBudget::new(100));
        let mut s1 = MemoryAccount::new(Some(b.clone()));
        let mut s2 = MemoryAccount::new(Some(b.clone()));
        assert!(s1.take(60).is_ok());
        assert_eq!(s2.take(50), Err(rgpu_cuda_types::CuError::OUT_OF_MEMORY), "60 + 50 > 100");
        assert!(s2.take(40).is_ok());
        assert_eq!(s1.info(1000, 1000), (0, 100));
        s2.give(40);
        assert_eq!(s2.info(1000, 1000), (40, 100));
        assert_eq!(s2.info(10, 50), (10, 50), "the device's own numbers when smaller");
        drop(s1);
        assert_eq!(b.used(), 0, "a session's end gives its bytes back");
        let mut s3 = MemoryAccount::new(Some(b.clone()));
        assert!(s3.take(30).is_ok());
        let moved = s3.split(20);
        drop(s3);
        assert_eq!(b.used(), 20, "what was split off stays charged");
        drop(moved);
        assert_eq!(b.used(), 0);
        let mut free = MemoryAccount::new(None);
        assert!(free.take(u64::MAX).is_ok(), "no budget, no limit");
        assert_eq!(free.info(7, 9), (7, 9));
    }
}
