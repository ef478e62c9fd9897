//! The broker's picture of the pool: servers, their GPUs, their place in
//! the fabric (node, leaf switch, spine), the partitions they serve, and how
//! much of each GPU is leased. Pure data; the state machine keeps it current.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

/// Where a server sits in the fabric is named per [`Scope`]; placement
/// reads it from here ([`Server::unit_key`]).
pub use rgpu_protocol::scope::Scope;

/// Unix time in milliseconds. Every pure function takes `now` as one.
pub type Millis = u64;

/// One GPU as its server registered it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuSpec {
    pub uuid: [u8; 16],
    pub ordinal: u32,
    pub model: String,
    /// Bytes.
    pub memory: u64,
    pub sms: u32,
    /// As its server last reported: an unhealthy GPU takes no new lease
    /// and its leases are moved off (see `evacuation`).
    pub healthy: bool,
    /// Why it is unhealthy, as its server said (empty when healthy).
    #[serde(default)]
    pub health_reason: String,
}

/// A GPU server as it registered: its address is its id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerSpec {
    pub id: String,
    pub node: String,
    pub leaf: String,
    pub spine: String,
    /// Partitions (tenants' pools) this server serves; never empty once
    /// registered (`["default"]` when the server names none).
    pub partitions: Vec<String>,
    pub gpus: Vec<GpuSpec>,
    /// Data-plane transports the server offers ("tcp", "rdma"); empty
    /// from a server that does not say (TCP only).
    #[serde(default)]
    pub transports: Vec<String>,
}

/// Compute shares are in thousandths of a GPU.
pub const WHOLE_MILLI: u32 = 1000;

/// A GPU and what is leased of it.
#[derive(Debug, Clone)]
pub struct Gpu {
    pub spec: GpuSpec,
    pub used_memory: u64,
    pub used_milli: u32,
    /// Leases holding (part of) this GPU.
    pub holders: Vec<u64>,
}

impl Gpu {
    pub fn new(spec: GpuSpec) -> Self {
        Gpu { spec, used_memory: 0, used_milli: 0, holders: Vec::new() }
    }

    /// Nothing leased on it.
    pub fn is_free(&self) -> bool {
        self.holders.is_empty()
    }

    pub fn free_memory(&self) -> u64 {
        self.spec.memory.saturating_sub(self.used_memory)
    }

    pub fn free_milli(&self) -> u32 {
        WHOLE_MILLI.saturating_sub(self.used_milli)
    }

    pub fn fits_fraction(&self, memory: u64, milli: u32) -> bool {
        self.spec.healthy && memory <= self.free_memory() && milli <= self.free_milli()
    }

    pub fn model_allowed(&self, models: &[String]) -> bool {
        models.is_empty() || models.iter().any(|m| m.eq_ignore_ascii_case(&self.spec.model))
    }
}

/// Operator's drain of a server: no new grants; leases left at the deadline
/// (if any) are revoked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Drain {
    pub since: Millis,
    pub deadline: Option<Millis>,
    /// The server drained itself to stop (SIGTERM): its next registration,
    /// when it is back, ends the drain. An operator's drain outlives
    /// restarts.
    #[serde(default)]
    pub for_shutdown: bool,
}

#[derive(Debug, Clone)]
pub struct Server {
    pub spec: ServerSpec,
    pub gpus: Vec<Gpu>,
    pub reachable: bool,
    pub last_heartbeat: Millis,
    pub drain: Option<Drain>,
    /// Healthy GPUs with nothing leased on them (kept current).
    pub free_whole: u32,
    /// Healthy GPUs (kept current).
    pub healthy: u32,
    /// Changes whenever [`Server::recount`] runs, unique across all servers
    /// of the process: placement keeps a server's score while its version
    /// stays the same ([`crate::placement::ScoreCache`]). Whoever changes a
    /// GPU (its lease, health, model) calls `recount` after, as for
    /// `free_whole`.
    pub version: u64,
}

/// Source of [`Server::version`]s; 0 is never one.
static VERSIONS: AtomicU64 = AtomicU64::new(1);

impl Server {
    pub fn new(spec: ServerSpec, now: Millis) -> Self {
        let gpus: Vec<Gpu> = spec.gpus.iter().cloned().map(Gpu::new).collect();
        let mut s =
            Server { spec, gpus, reachable: true, last_heartbeat: now, drain: None, free_whole: 0, healthy: 0, version: 0 };
        s.recount();
        s
    }

    pub fn recount(&mut self) {
        self.free_whole = self.gpus.iter().filter(|g| g.spec.healthy && g.is_free()).count() as u32;
        self.healthy = self.gpus.iter().filter(|g| g.spec.healthy).count() as u32;
        self.version = VERSIONS.fetch_add(1, Ordering::Relaxed);
    }

    /// May new leases land here?
    pub fn schedulable(&self) -> bool {
        self.reachable && self.drain.is_none()
    }

    pub fn serves_any(&self, partitions: &[String]) -> bool {
        self.spec.partitions.iter().any(|p| partitions.iter().any(|q| q == p))
    }

    /// The label of this server's unit at `scope`.
    pub fn unit_key(&self, scope: Scope) -> &str {
        match scope {
            Scope::Node => &self.spec.node,
            Scope::Leaf => &self.spec.leaf,
            Scope::Spine => &self.spec.spine,
            Scope::Any => "",
        }
    }
}
