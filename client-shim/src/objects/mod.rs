//! The shim's object layer: every CUDA object the shim mints, in one place.
//!
//! It owns every handle table, the per-thread context stack, the primary contexts, the tables of
//! device and page-locked host allocations, context-local storage, and the ownership tree:
//!
//! ```text
//! context ─┬─ streams, events          (each records its context)
//!          ├─ graph execs              (instantiated in it; their steps live on its server)
//!          ├─ modules ── functions     (a module lists its functions; globals are allocations)
//!          ├─ allocations              (cuMemAlloc; module globals belong to their module;
//!          │                            stream-ordered ones also count in their pool)
//!          └─ context-local storage    (cudart's per-context state, with destructors)
//! vmm ─────┬─ physical allocations     (cuMemCreate; by handle, with references and maps)
//!          └─ reservations ── maps     (each map is also an entry of the allocation table)
//! managed                              (cuMemAllocManaged: host and device copies, and which
//!                                       is newer; also in the allocation table)
//! library ─┬─ one module per context that used it
//!          └─ kernels                  (resolve to that module's function by name)
//! graph ──── nodes                     (a node handle names its graph; captures build graphs)
//! ```
//!
//! Destroying a context or resetting a primary context is one walk of that tree,
//! [`Objects::teardown_context`], and each kind of object is released on its server by one
//! function in its own file here. `r#impl` (the driver API's semantics, one file per API group)
//! builds on this layer and on the wire client; its files never import each other.
//!
//! Below this layer: `runtime` (the servers and their devices, set up by `cuInit`) and `client`
//! (the wire). Nothing here knows the C ABI beyond the handle types.

pub mod capture;
pub mod cls;
pub mod context;
pub mod device_runtime;
pub mod event;
pub mod graph;
pub mod graph_exec;
pub mod graph_mem;
pub mod kernel_args;
pub mod library;
pub mod link;
pub mod logs;
pub mod managed;
pub mod memory;
pub mod module;
pub mod pool;
pub mod stream;
pub mod table;
pub mod vmm;
pub mod user_object;

use std::sync::LazyLock;

use crate::runtime;
use rgpu_cuda_types::tag;
use table::Table;

/// Every object table of the process.
pub struct Objects {
    pub contexts: Table<context::Context>,
    pub primaries: context::Primaries,
    pub streams: Table<stream::Stream>,
    pub events: Table<event::Event>,
    pub modules: Table<module::Module>,
    pub functions: Table<module::Function>,
    pub libraries: Table<library::Library>,
    pub kernels: Table<library::Kernel>,
    pub memory: memory::Memory,
    pub pools: Table<pool::MemPool>,
    pub device_pools: pool::DevicePools,
    pub cls: cls::Store,
    pub logs: logs::Callbacks,
    pub links: Table<link::LinkState>,
    pub vmm: vmm::Vmm,
    pub managed: managed::ManagedTable,
    pub graphs: Table<graph::Graph>,
    /// Each node handle's graph.
    pub graph_nodes: Table<u64>,
    pub graph_execs: Table<graph_exec::Exec>,
    pub user_objects: Table<user_object::UserObject>,
}

static OBJECTS: LazyLock<Objects> = LazyLock::new(|| Objects {
    contexts: Table::new(tag::CONTEXT),
    primaries: context::Primaries::default(),
    streams: Table::new(tag::STREAM),
    events: Table::new(tag::EVENT),
    modules: Table::new(tag::MODULE),
    functions: Table::new(tag::FUNCTION),
    libraries: Table::new(tag::LIBRARY),
    kernels: Table::new(tag::KERNEL),
    memory: memory::Memory::default(),
    pools: Table::new(tag::MEMPOOL),
    device_pools: pool::DevicePools::default(),
    cls: cls::Store::default(),
    logs: logs::Callbacks::default(),
    links: Table::new(tag::LINK),
    vmm: vmm::Vmm::default(),
    managed: managed::ManagedTable::default(),
    graphs: Table::new(tag::GRAPH),
    graph_nodes: Table::new(tag::GRAPH_NODE),
    graph_execs: Table::new(tag::GRAPH_EXEC),
    user_objects: Table::new(tag::USER_OBJECT),
});

/// The process's objects.
pub fn objects() -> &'static Objects {
    &OBJECTS
}

impl Objects {
    /// Frees everything context `h` owns, on its servers and here, after running the destructors
    /// cudart registered on it. The context object itself stays (a primary context is reused
    /// after a reset; the caller removes a destroyed user context).
    pub fn teardown_context(&self, h: u64) {
        self.cls.run_destructors(h);
        let Ok(rt) = runtime::get() else { return };
        for m in self.modules.select(|m| m.ctx == h) {
            let _ = module::unload(rt, m);
        }
        library::forget_context(h);
        for s in self.streams.select(|s| s.ctx == h) {
            if let Some(st) = self.streams.remove(s) {
                let _ = stream::release(rt, s, &st);
            }
        }
        for e in self.events.select(|e| e.ctx == h) {
            if let Some(ev) = self.events.remove(e) {
                let _ = event::release(rt, e, &ev);
            }
        }
        for g in self.graph_execs.select(|g| g.ctx == h) {
            if let Some(exec) = self.graph_execs.remove(g) {
                exec.release(rt);
            }
        }
        self.memory.free_context(rt, h);
    }
}
