//! The broker's state machine: inventory, leases, the queue, quotas and
//! drains. Pure: every call takes `now`, changes memory only, and leaves
//! behind the [`Change`]s to persist and the [`Event`]s to deliver, which
//! the service takes with [`State::take_output`]. No I/O, no clock, no keys.
//!
//! Fencing: every grant takes the next value of one monotonic generation
//! counter (persisted). GPU servers learn the live leases and the current
//! counter (the "floor") with each heartbeat: a token whose lease is not
//! live and whose generation is at or below the floor is stale.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::evacuation::{self, Evacuation};
use crate::fabric::{self, Fabric};
use crate::inventory::{Drain, Millis, Server, ServerSpec};
use crate::moves::{self, Move};
use crate::placement::{self, Demand, NoPlace, Policy};

mod preemption;
pub use preemption::{Order, OrderKind, Phase, Suspension, PREEMPT_RETRY_MS};

/// Every error names its kind in brackets first, so that clients (and
/// tests) can tell kinds apart in a capnp error's text.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum BrokerError {
    #[error("[invalid] {0}")]
    Invalid(String),
    #[error("[quota] {0}")]
    Quota(String),
    #[error("[unavailable] {0}")]
    Unavailable(String),
    #[error("[timeout] no capacity within {0} ms (request was queued and withdrawn)")]
    QueueTimeout(u64),
    #[error("[not-found] lease {id:#x} {why}")]
    NotFound { id: u64, why: String },
    #[error("[lost] lease {id:#x}: server {server} stopped answering heartbeats; its sessions are gone")]
    Lost { id: u64, server: String },
    #[error("[unknown-server] no server {0} is registered")]
    UnknownServer(String),
    #[error("[auth] {0}")]
    Auth(String),
    #[error("[rate] {0}")]
    Rate(String),
    #[error("[store] {0}")]
    Store(String),
    /// A replica that does not lead: the text names the leader's address
    /// after "the leader is at " when it is known (clients go there).
    #[error("[not-leader] {0}")]
    NotLeader(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LeaseState {
    Active,
    /// Its server stopped heartbeating: the sessions are gone; the lease
    /// holds its GPUs until released or expired, and renew says why.
    Lost,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeasedGpu {
    pub server: String,
    pub uuid: [u8; 16],
    pub ordinal: u32,
    pub model: String,
    pub memory: u64,
    /// What this lease takes from the GPU.
    pub take_memory: u64,
    pub take_milli: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub id: u64,
    pub key: String,
    pub tenant: String,
    pub generation: u64,
    pub gpus: Vec<LeasedGpu>,
    /// Bytes per GPU a session may allocate; 0: whole GPUs.
    pub memory_limit: u64,
    pub compute_milli: u32,
    pub priority: i32,
    pub granted: Millis,
    pub ttl_ms: u64,
    pub deadline: Millis,
    pub state: LeaseState,
    /// Bytes/s each way granted on each of its servers' links (0: none
    /// asked; see `fabric`).
    #[serde(default)]
    pub bandwidth: u64,
    /// A drain's live migration of it to another server, in flight.
    #[serde(default)]
    pub moving: Option<Move>,
    /// Why its last move failed (empty: none did).
    #[serde(default)]
    pub move_error: String,
    /// The client key its tokens are bound to (None: bearer tokens); every
    /// token signed for it, after a renewal or a move too, carries it.
    #[serde(default)]
    pub client_key: Option<[u8; 32]>,
    /// Its preemption (see `preemption`), while it is suspended or on the way.
    #[serde(default)]
    pub suspension: Option<Suspension>,
    /// Not preempted before this (a suspension of it failed).
    #[serde(default)]
    pub unpreemptible_until: Millis,
}

impl Lease {
    /// Milli-GPUs counted against the tenant's GPU quota.
    pub fn gpu_milli(&self) -> u64 {
        self.gpus.iter().map(|g| share_milli(g.take_memory, g.memory, g.take_milli)).sum()
    }
    pub fn memory(&self) -> u64 {
        self.gpus.iter().map(|g| g.take_memory).sum()
    }

    /// The device-time share a server gives the lease's sessions on its
    /// GPU when they compete, in thousandths: what placement counts the
    /// fraction as (its larger share of memory or compute, so the shares on
    /// one GPU never add up past it); 0 for whole GPUs, which compete for
    /// nothing.
    pub fn compute_share(&self) -> u16 {
        match self.gpus.as_slice() {
            [g] if g.take_milli < 1000 || g.take_memory < g.memory => {
                share_milli(g.take_memory, g.memory, g.take_milli).clamp(1, 1000) as u16
            }
            _ => 0,
        }
    }
}

fn share_milli(take_memory: u64, memory: u64, milli: u32) -> u64 {
    let by_mem = if memory == 0 { 0 } else { (take_memory as u128 * 1000).div_ceil(memory as u128) as u64 };
    by_mem.max(milli as u64).min(1000)
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct LeaseRequest {
    pub tenant: String,
    pub demand: Demand,
    pub priority: i32,
    pub ttl_ms: u64,
    pub wait_ms: u64,
    pub key: String,
    /// Bytes/s each way on each server the lease lands on; 0: none.
    #[serde(default)]
    pub bandwidth: u64,
    /// The client's Ed25519 public key: the lease's tokens are bound to it
    /// (`rgpu_protocol::binding`). None: bearer tokens.
    #[serde(default)]
    pub client_key: Option<[u8; 32]>,
}

/// Operator policy per tenant (from the broker's configuration). A quota
/// left out (None) is the broker's default for leases, GPUs and the request
/// rate ([`Limits`]), and no limit for memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct TenantPolicy {
    pub partitions: Vec<String>,
    /// Whole GPUs (fractions count by their larger share of memory or compute).
    pub max_gpus: Option<u32>,
    pub max_memory: Option<u64>,
    /// Leases held at once (queued requests count too).
    #[serde(default)]
    pub max_leases: Option<u32>,
    /// Requests per second to the broker, sustained (bursts of twice that).
    #[serde(default)]
    pub max_rate: Option<u32>,
    /// The tenant's InfiniBand partition key (`pkey = 0x8001`): its lease
    /// tokens carry it, and RDMA data planes for its sessions run in that
    /// partition. Not the placement `partitions` above.
    #[serde(default)]
    pub pkey: Option<u16>,
}

#[derive(Debug, Clone)]
pub struct Limits {
    pub heartbeat_ms: u64,
    pub missed_heartbeats: u32,
    pub default_ttl_ms: u64,
    pub max_ttl_ms: u64,
    pub max_wait_ms: u64,
    /// A queued request that has waited this long for capacity reserves
    /// it: see [`State::reservation`].
    pub reserve_after_ms: u64,
    /// Quotas of tenants whose policy does not name them (or who have no
    /// policy): one client alone must not take the whole pool.
    pub default_max_leases: u32,
    pub default_max_gpus: u32,
    pub default_max_rate: u32,
    /// Move leases off GPUs their servers report unhealthy (see
    /// `evacuation`); off, they stay until released or drained.
    pub evacuate_unhealthy: bool,
    /// A queued request that waited this long short of capacity preempts
    /// leases of lower priority by suspending them (see `preemption`);
    /// None: never.
    pub preempt_after_ms: Option<u64>,
}

/// A tenant's quotas in effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    pub max_gpus: u32,
    pub max_memory: Option<u64>,
    pub max_leases: u32,
    pub max_rate: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            heartbeat_ms: 1000,
            missed_heartbeats: 3,
            default_ttl_ms: 60_000,
            max_ttl_ms: 24 * 3600 * 1000,
            max_wait_ms: 3600 * 1000,
            reserve_after_ms: 2_000,
            default_max_leases: 32,
            default_max_gpus: 8,
            default_max_rate: 50,
            evacuate_unhealthy: true,
            preempt_after_ms: None,
        }
    }
}

/// A heartbeat's answer: the leases live on the server as (id,
/// generation, deadline), the generation floor, and the moves, suspensions
/// and resumes it is asked to make.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Heartbeat {
    pub live: Vec<(u64, u64, u64)>,
    pub floor: u64,
    pub orders: Vec<Order>,
}

/// What to persist, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    Server { spec: ServerSpec, drain: Option<Drain> },
    Lease(Lease),
    LeaseGone(u64),
    Generation(u64),
    /// Credentials of `tenant` with a serial below `before` are refused
    /// (made by the service, not the state machine: see `identity`).
    Revocation { tenant: String, before: u64 },
    /// An ended lease's accounting record (made by the service, which
    /// holds the servers' usage reports: see `usage`).
    Usage(crate::usage::Record),
}

/// What to tell waiting clients once the changes before it are durable.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Granted { ticket: u64, lease: Lease },
    Failed { ticket: u64, error: BrokerError },
    /// `lease` as it was when it ended (for its accounting record).
    Ended { id: u64, why: EndReason, lease: Box<Lease> },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndReason {
    Released,
    Expired,
    Revoked,
    /// Preempted, and its state could not be brought back (or its
    /// suspension was not reported in time).
    Unresumed,
}

impl EndReason {
    pub fn name(self) -> &'static str {
        match self {
            EndReason::Released => "released",
            EndReason::Expired => "expired",
            EndReason::Revoked => "revoked",
            EndReason::Unresumed => "unresumed",
        }
    }

    fn text(self) -> &'static str {
        match self {
            EndReason::Released => "was released",
            EndReason::Expired => "expired (not renewed before its deadline)",
            EndReason::Revoked => "was revoked (its server's drain deadline passed)",
            EndReason::Unresumed => "was preempted by a higher-priority lease and could not be resumed",
        }
    }
}

pub enum Outcome {
    Granted(Lease),
    /// Waiting in the queue; an [`Event`] with this ticket ends the wait.
    Queued(u64),
}

struct Waiting {
    ticket: u64,
    req: LeaseRequest,
    id: u64,
    until: Millis,
    /// When it was queued.
    since: Millis,
    /// Its last try failed for want of capacity (not its tenant's quota):
    /// only such a request can hold a reservation.
    short_of_capacity: bool,
}

#[derive(Debug, Default, Clone, Copy)]
struct Usage {
    milli: u64,
    memory: u64,
    leases: u32,
}

pub struct State {
    pub limits: Limits,
    pub servers: Vec<Server>,
    index: HashMap<String, usize>,
    leases: HashMap<u64, Lease>,
    keys: HashMap<(String, String), u64>,
    generation: u64,
    queue: BTreeMap<(Reverse<i32>, u64), Waiting>,
    next_ticket: u64,
    tenants: HashMap<String, TenantPolicy>,
    usage: HashMap<String, Usage>,
    ended: VecDeque<(u64, EndReason)>,
    changes: Vec<Change>,
    events: Vec<Event>,
    policy: Box<dyn Policy>,
    /// Servers' placement scores between grants (see `ScoreCache`).
    scores: placement::ScoreCache,
    /// Link capacities, grants and traffic, by server index.
    fabric: Fabric,
    /// Leases being moved off unhealthy GPUs: their tries.
    evacuation: Evacuation,
    /// Leases with a suspension (see `preemption`).
    suspended: BTreeSet<u64>,
}

/// A GPU whose health a server reported changed: (ordinal, healthy, reason).
pub type HealthChange = (u32, bool, String);

const DEFAULT_PARTITION: &str = "default";
const ENDED_KEPT: usize = 4096;

impl State {
    pub fn new(limits: Limits, tenants: HashMap<String, TenantPolicy>, policy: Box<dyn Policy>) -> Self {
        State {
            limits,
            servers: Vec::new(),
            index: HashMap::new(),
            leases: HashMap::new(),
            keys: HashMap::new(),
            generation: 0,
            queue: BTreeMap::new(),
            next_ticket: 1,
            tenants,
            usage: HashMap::new(),
            ended: VecDeque::new(),
            changes: Vec::new(),
            events: Vec::new(),
            policy,
            scores: placement::ScoreCache::new(),
            fabric: Fabric::default(),
            evacuation: Evacuation::default(),
            suspended: BTreeSet::new(),
        }
    }

    /// Rebuilds the state from what was persisted. Every server counts as
    /// heard from `now`, so none is declared unreachable before it has had
    /// its chance to heartbeat the new broker.
    pub fn restore(
        &mut self,
        servers: Vec<(ServerSpec, Option<Drain>)>,
        leases: Vec<Lease>,
        generation: u64,
        now: Millis,
    ) {
        for (spec, drain) in servers {
            let i = self.servers.len();
            self.index.insert(spec.id.clone(), i);
            // Its capacity is unknown until it registers again.
            self.fabric.place_server(i, &spec.leaf, None, false);
            let mut s = Server::new(spec, now);
            s.drain = drain;
            self.servers.push(s);
        }
        self.policy.pool_changed(&self.servers);
        self.generation = generation;
        for l in leases {
            self.generation = self.generation.max(l.generation);
            // Its tenant's quota stays held while it is suspended.
            if l.holds_gpus() {
                self.occupy_gpus(&l);
            }
            self.occupy_usage(&l);
            if l.suspension.is_some() {
                self.suspended.insert(l.id);
            }
            if let Some(m) = &l.moving {
                self.generation = self.generation.max(m.generation);
                self.reserve(l.id, &m.gpus);
            }
            if !l.key.is_empty() {
                self.keys.insert((l.tenant.clone(), l.key.clone()), l.id);
            }
            self.leases.insert(l.id, l);
        }
        self.changes.clear();
    }

    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    pub fn leases(&self) -> impl Iterator<Item = &Lease> {
        self.leases.values()
    }

    pub fn lease(&self, id: u64) -> Option<&Lease> {
        self.leases.get(&id)
    }

    pub fn server(&self, id: &str) -> Option<&Server> {
        self.index.get(id).map(|&i| &self.servers[i])
    }

    /// Server `id`'s links (capacity, granted bandwidth, traffic).
    pub fn link(&self, id: &str) -> Option<&fabric::Link> {
        self.index.get(id).and_then(|&i| self.fabric.link(i))
    }

    /// Changes to persist and events to deliver after them, since last taken.
    pub fn take_output(&mut self) -> (Vec<Change>, Vec<Event>) {
        (std::mem::take(&mut self.changes), std::mem::take(&mut self.events))
    }

    /// The tenant's InfiniBand P_Key, if its policy names one.
    pub fn pkey_of(&self, tenant: &str) -> Option<u16> {
        self.tenants.get(tenant).and_then(|p| p.pkey)
    }

    /// The quotas `tenant` is held to: its policy's, else the defaults.
    pub fn quota_of(&self, tenant: &str) -> Quota {
        let p = self.tenants.get(tenant);
        Quota {
            max_gpus: p.and_then(|p| p.max_gpus).unwrap_or(self.limits.default_max_gpus),
            max_memory: p.and_then(|p| p.max_memory),
            max_leases: p.and_then(|p| p.max_leases).unwrap_or(self.limits.default_max_leases),
            max_rate: p.and_then(|p| p.max_rate).unwrap_or(self.limits.default_max_rate),
        }
    }

    fn partitions_of(&self, tenant: &str) -> Vec<String> {
        match self.tenants.get(tenant) {
            Some(p) => p.partitions.clone(),
            None => vec![DEFAULT_PARTITION.to_string()],
        }
    }

    // ---- servers ----

    pub fn register(&mut self, spec: ServerSpec, now: Millis) {
        self.register_linked(spec, None, now)
    }

    /// [`State::register`] with the server's link capacity (bytes/s each
    /// way; None: it did not say, unbounded).
    pub fn register_linked(&mut self, mut spec: ServerSpec, link: Option<u64>, now: Millis) {
        if spec.partitions.is_empty() {
            spec.partitions.push(DEFAULT_PARTITION.to_string());
        }
        let unhealthy_here = spec.gpus.iter().any(|g| !g.healthy);
        match self.index.get(&spec.id) {
            Some(&i) => {
                let s = &mut self.servers[i];
                s.reachable = true;
                s.last_heartbeat = now;
                // Back from the stop it drained itself for.
                let restarted = s.drain.is_some_and(|d| d.for_shutdown);
                if restarted {
                    s.drain = None;
                }
                self.fabric.place_server(i, &spec.leaf, link, true);
                if s.spec != spec || restarted {
                    // Keep what is leased of GPUs that are still there.
                    let old: HashMap<[u8; 16], crate::inventory::Gpu> =
                        s.gpus.drain(..).map(|g| (g.spec.uuid, g)).collect();
                    s.gpus = spec
                        .gpus
                        .iter()
                        .cloned()
                        .map(|g| match old.get(&g.uuid) {
                            Some(o) => crate::inventory::Gpu { spec: g, ..o.clone() },
                            None => crate::inventory::Gpu::new(g),
                        })
                        .collect();
                    s.spec = spec.clone();
                    s.recount();
                    let drain = s.drain;
                    self.changes.push(Change::Server { spec, drain });
                    self.policy.pool_changed(&self.servers);
                }
            }
            None => {
                self.index.insert(spec.id.clone(), self.servers.len());
                self.fabric.place_server(self.servers.len(), &spec.leaf, link, true);
                self.servers.push(Server::new(spec.clone(), now));
                self.changes.push(Change::Server { spec, drain: None });
                self.policy.pool_changed(&self.servers);
            }
        }
        // A GPU may come back unhealthy, or a new server be the target an
        // evacuation waited for.
        if unhealthy_here || self.evacuation.pending() {
            self.evacuation.capacity_appeared();
            self.evacuate(now);
        }
        self.try_queue(now);
    }

    /// Server `id` reports the health of some of its GPUs, as (ordinal,
    /// healthy, reason). Returns the GPUs whose health changed, after
    /// which an unhealthy GPU takes no new lease and (with
    /// `evacuate_unhealthy`) its leases start moving; and the moves
    /// started, as [`State::evacuate`].
    pub fn report_health(&mut self, id: &str, reports: &[HealthChange], now: Millis) -> (Vec<HealthChange>, Vec<(u64, Result<String, String>)>) {
        let Some(&i) = self.index.get(id) else { return (Vec::new(), Vec::new()) };
        let s = &mut self.servers[i];
        let mut changed = Vec::new();
        for (ordinal, healthy, reason) in reports {
            let Some(g) = s.gpus.iter_mut().find(|g| g.spec.ordinal == *ordinal) else { continue };
            let reason = if *healthy { String::new() } else { evacuation::clip(reason.clone(), evacuation::MAX_HEALTH_REASON) };
            if g.spec.healthy == *healthy && g.spec.health_reason == reason {
                continue;
            }
            g.spec.healthy = *healthy;
            g.spec.health_reason = reason.clone();
            if let Some(sg) = s.spec.gpus.iter_mut().find(|x| x.uuid == g.spec.uuid) {
                sg.healthy = *healthy;
                sg.health_reason = reason.clone();
            }
            changed.push((*ordinal, *healthy, reason));
        }
        if changed.is_empty() {
            return (changed, Vec::new());
        }
        s.recount();
        self.changes.push(Change::Server { spec: s.spec.clone(), drain: s.drain });
        let started = self.evacuate(now);
        // A GPU healthy again may take what waits.
        self.try_queue(now);
        (changed, started)
    }

    /// Starts moving the leases on unhealthy GPUs whose try is due (see
    /// `evacuation`): per lease, the target or why none takes it (then
    /// kept as its `move_error`, and tried again later). Nothing with
    /// `evacuate_unhealthy` off.
    pub fn evacuate(&mut self, now: Millis) -> Vec<(u64, Result<String, String>)> {
        if !self.limits.evacuate_unhealthy {
            return Vec::new();
        }
        let due = self.evacuation.due(&self.servers, self.leases.values(), now, moves::MAX_PLANNED);
        let mut out = Vec::with_capacity(due.now.len());
        let bad = evacuation::unhealthy_uuids(&self.servers);
        for (lid, from) in due.now {
            let r = self.start_move(lid, &from, None, now);
            let last = self.evacuation.tried(lid, now);
            if let Err(why) = &r {
                let (on, ordinal, reason) = self
                    .leases
                    .get(&lid)
                    .and_then(|l| evacuation::unhealthy_gpu(&self.servers, &bad, l))
                    .map_or((from.clone(), 0, String::new()), |(s, o, r)| (s.to_string(), o, r.to_string()));
                let tries = self.evacuation.tries(lid);
                let error = if last {
                    format!("cannot leave unhealthy GPU {ordinal} of {on} ({reason}); given up after {tries} tries: {why}")
                } else {
                    format!("cannot leave unhealthy GPU {ordinal} of {on} ({reason}) yet: {why}")
                };
                if tries == 1 || last {
                    tracing::warn!(lease = format_args!("{lid:#x}"), server = %on, gpu = ordinal, tries, "{error}");
                }
                if let Some(l) = self.leases.get_mut(&lid) {
                    if l.move_error != error {
                        l.move_error = error;
                        self.changes.push(Change::Lease(l.clone()));
                    }
                }
            } else if let Ok(to) = &r {
                tracing::info!(lease = format_args!("{lid:#x}"), %from, %to, "evacuating a lease off an unhealthy GPU");
            }
            out.push((lid, r));
        }
        out
    }

    /// A heartbeat: the live leases on the server and the generation floor,
    /// or None if the server is not registered (it should register).
    pub fn heartbeat(&mut self, id: &str, now: Millis) -> Option<Heartbeat> {
        let &i = self.index.get(id)?;
        let s = &mut self.servers[i];
        s.last_heartbeat = now;
        let back = !s.reachable;
        s.reachable = true;
        if back {
            self.try_queue(now);
        }
        let mut hb = Heartbeat { live: Vec::new(), floor: self.generation, orders: Vec::new() };
        for l in self.leases.values().filter(|l| l.state == LeaseState::Active) {
            let here = l.gpus.iter().any(|g| g.server == id);
            let room = hb.orders.len() < moves::MAX_ORDERS;
            let order = |kind, generation, target: &str| Order { lease: l.id, generation, target: target.to_string(), kind };
            match (&l.moving, l.phase()) {
                // In flight: listed at both ends, so that neither ends it.
                (Some(m), _) if m.to == id => hb.live.push((l.id, m.generation, l.deadline)),
                (Some(m), _) if here => {
                    hb.live.push((l.id, l.generation, l.deadline));
                    if room {
                        hb.orders.push(order(OrderKind::Migrate, m.generation, &m.to));
                    }
                }
                // A suspended lease stays listed: its server keeps its
                // snapshot (and refuses it new sessions) until it resumes,
                // and drops the snapshot once it is no longer listed.
                (None, Some(phase)) if here => {
                    hb.live.push((l.id, l.generation, l.deadline));
                    let kind = match phase {
                        Phase::Suspending => Some(OrderKind::Suspend),
                        Phase::Resuming => Some(OrderKind::Resume),
                        Phase::Suspended => None,
                    };
                    if let Some(kind) = kind.filter(|_| room) {
                        hb.orders.push(order(kind, l.generation, ""));
                    }
                }
                _ if here => hb.live.push((l.id, l.generation, l.deadline)),
                _ => {}
            }
        }
        Some(hb)
    }

    /// Drains `id` (as [`State::drain`]) and starts moving each of its
    /// leases to a server that can take it: per lease, the target chosen
    /// or why none fits. A lease already moving keeps its move.
    pub fn drain_migrate(&mut self, id: &str, deadline: Option<Millis>, now: Millis) -> Result<Vec<(u64, Result<String, String>)>, BrokerError> {
        self.drain(id, deadline, false, now)?;
        let mut ids: Vec<u64> = self
            .leases
            .values()
            .filter(|l| l.state == LeaseState::Active && l.suspension.is_none() && l.gpus.iter().any(|g| g.server == id))
            .map(|l| l.id)
            .collect();
        ids.sort_unstable();
        ids.truncate(moves::MAX_PLANNED);
        let mut plan = Vec::with_capacity(ids.len());
        for lid in ids {
            let l = &self.leases[&lid];
            if let Some(m) = &l.moving {
                plan.push((lid, Ok(m.to.clone())));
                continue;
            }
            plan.push((lid, self.start_move(lid, id, None, now)));
        }
        Ok(plan)
    }

    /// An operator's move of lease `lid` by live migration, to server `to`
    /// or (None) the first that can take it, as a drain with `migrate`
    /// moves one; the source server is left as it is. Returns the lease,
    /// its move in flight. Refused for a lease that is not active, is
    /// suspended or on the way, is already moving, spans several servers,
    /// or that no server (or not `to`) can take, saying why.
    pub fn move_lease(&mut self, lid: u64, to: Option<&str>, now: Millis) -> Result<Lease, BrokerError> {
        let l = self.leases.get(&lid).ok_or_else(|| BrokerError::NotFound { id: lid, why: "is not live".into() })?;
        if l.state != LeaseState::Active {
            return Err(BrokerError::Invalid(format!("lease {lid:#x} lost its server: there is nothing to move")));
        }
        if l.suspension.is_some() {
            return Err(BrokerError::Invalid(format!("lease {lid:#x} is suspended (or on the way): resume it first")));
        }
        if let Some(m) = &l.moving {
            return Err(BrokerError::Invalid(format!("lease {lid:#x} is already moving to {}", m.to)));
        }
        let Some(from) = l.gpus.first().map(|g| g.server.clone()) else {
            return Err(BrokerError::Invalid(format!("lease {lid:#x} holds no GPU")));
        };
        self.start_move(lid, &from, to, now).map_err(|why| BrokerError::Invalid(format!("lease {lid:#x} cannot move: {why}")))?;
        Ok(self.leases[&lid].clone())
    }

    /// Starts moving lease `lid` off server `from` to `to` (None: the first
    /// server that can take it): its target, or why none can. The move rides on
    /// the lease (with a fresh generation, its target GPUs reserved) until
    /// the source reports it.
    fn start_move(&mut self, lid: u64, from: &str, to: Option<&str>, now: Millis) -> Result<String, String> {
        let l = self.leases.get(&lid).ok_or_else(|| format!("lease {lid:#x} ended"))?;
        let parts = self.partitions_of(&l.tenant);
        let (_, gpus) = moves::choose_target(&self.servers, l, from, &parts, to)?;
        self.generation += 1;
        let m = Move { to: gpus[0].server.clone(), generation: self.generation, gpus, since: now };
        self.reserve(lid, &m.gpus);
        let to = m.to.clone();
        let l = self.leases.get_mut(&lid).expect("looked up above");
        l.moving = Some(m);
        l.move_error.clear();
        let l = l.clone();
        self.changes.push(Change::Generation(self.generation));
        self.changes.push(Change::Lease(l));
        Ok(to)
    }

    /// Server `from` reports the move of `lease` done (`Ok`) or failed. On
    /// success the lease is placed on the target, at the move's
    /// generation: its old placement is fenced (not listed to `from`, and
    /// its generation is at or below the floor). Returns the move's target.
    pub fn move_reported(&mut self, from: &str, lease: u64, result: Result<(), String>, now: Millis) -> Result<String, BrokerError> {
        let not_moving = || BrokerError::Invalid(format!("lease {lease:#x} is not being moved off {from}"));
        let l = self.leases.get(&lease).ok_or_else(not_moving)?;
        let Some(m) = l.moving.clone() else { return Err(not_moving()) };
        if !l.gpus.iter().any(|g| g.server == from) {
            return Err(not_moving());
        }
        self.unreserve(lease, &m.gpus);
        let mut l = self.leases.remove(&lease).expect("looked up above");
        l.moving = None;
        match result {
            Ok(()) => {
                self.vacate(&l);
                l.gpus = m.gpus;
                l.generation = m.generation;
                l.move_error.clear();
                self.occupy(&l);
            }
            Err(why) => {
                let why = moves::cut_reason(why);
                l.move_error = if why.is_empty() { "the server gave no reason".into() } else { why };
            }
        }
        self.changes.push(Change::Lease(l.clone()));
        self.leases.insert(lease, l);
        self.try_queue(now);
        Ok(m.to)
    }

    /// Holds the target GPUs of a move in flight, so no grant takes them.
    fn reserve(&mut self, lease: u64, gpus: &[LeasedGpu]) {
        for g in gpus {
            if let Some(&si) = self.index.get(&g.server) {
                let s = &mut self.servers[si];
                if let Some(gpu) = s.gpus.iter_mut().find(|x| x.spec.uuid == g.uuid) {
                    gpu.used_memory += g.take_memory;
                    gpu.used_milli += g.take_milli;
                    gpu.holders.push(lease);
                }
                s.recount();
            }
        }
    }

    fn unreserve(&mut self, lease: u64, gpus: &[LeasedGpu]) {
        for g in gpus {
            if let Some(&si) = self.index.get(&g.server) {
                let s = &mut self.servers[si];
                if let Some(gpu) = s.gpus.iter_mut().find(|x| x.spec.uuid == g.uuid) {
                    gpu.used_memory = gpu.used_memory.saturating_sub(g.take_memory);
                    gpu.used_milli = gpu.used_milli.saturating_sub(g.take_milli);
                    if let Some(p) = gpu.holders.iter().position(|&h| h == lease) {
                        gpu.holders.remove(p);
                    }
                }
                s.recount();
            }
        }
    }

    /// Server `id`'s data-plane traffic, from its heartbeat.
    pub fn report_load(&mut self, id: &str, load: fabric::Load) {
        if let Some(&i) = self.index.get(id) {
            self.fabric.report(i, load);
        }
    }

    /// Stops new grants on `id`; `for_shutdown`: the server asked, to stop
    /// (an operator's drain already in place stays an operator's).
    pub fn drain(&mut self, id: &str, deadline: Option<Millis>, for_shutdown: bool, now: Millis) -> Result<(), BrokerError> {
        let &i = self.index.get(id).ok_or_else(|| BrokerError::UnknownServer(id.into()))?;
        let s = &mut self.servers[i];
        let since = s.drain.map_or(now, |d| d.since);
        let for_shutdown = for_shutdown && s.drain.is_none_or(|d| d.for_shutdown);
        s.drain = Some(Drain { since, deadline, for_shutdown });
        self.changes.push(Change::Server { spec: s.spec.clone(), drain: s.drain });
        self.tick(now);
        Ok(())
    }

    pub fn undrain(&mut self, id: &str, now: Millis) -> Result<(), BrokerError> {
        let &i = self.index.get(id).ok_or_else(|| BrokerError::UnknownServer(id.into()))?;
        let s = &mut self.servers[i];
        if s.drain.take().is_some() {
            self.changes.push(Change::Server { spec: s.spec.clone(), drain: None });
        }
        self.try_queue(now);
        Ok(())
    }

    // ---- leases ----

    /// A lease request with a fresh random `id` (used if it is granted).
    pub fn request(&mut self, mut req: LeaseRequest, id: u64, now: Millis) -> Result<Outcome, BrokerError> {
        self.validate(&mut req)?;
        if !req.key.is_empty() {
            if let Some(l) = self.keys.get(&(req.tenant.clone(), req.key.clone())).and_then(|i| self.leases.get(i)) {
                return Ok(Outcome::Granted(l.clone()));
            }
        }
        self.check_quota_ever(&req)?;
        let queued = self.queue.values().filter(|w| w.req.tenant == req.tenant).count() as u64;
        let held = self.usage.get(&req.tenant).map_or(0, |u| u.leases) as u64;
        let max = self.quota_of(&req.tenant).max_leases as u64;
        if held + queued >= max {
            return Err(BrokerError::Quota(format!(
                "tenant {} holds {held} lease(s) and has {queued} queued, its quota is {max} leases",
                req.tenant
            )));
        }
        let granted = match self.reservation(&req, None, now) {
            Some(held) => Err(BrokerError::Unavailable(held)),
            None => self.try_grant(&req, id, now),
        };
        match granted {
            Ok(l) => Ok(Outcome::Granted(l)),
            Err(e @ (BrokerError::Quota(_) | BrokerError::Unavailable(_))) if req.wait_ms > 0 => {
                let short_of_capacity = matches!(e, BrokerError::Unavailable(_));
                let ticket = self.next_ticket;
                self.next_ticket += 1;
                let until = now.saturating_add(req.wait_ms);
                let w = Waiting { ticket, req, id, until, since: now, short_of_capacity };
                self.queue.insert((Reverse(w.req.priority), ticket), w);
                Ok(Outcome::Queued(ticket))
            }
            Err(e) => Err(e),
        }
    }

    /// Aging against starvation: a queued request that has waited
    /// `reserve_after_ms` for capacity holds a reservation, so that smaller
    /// requests cannot keep taking what is freed while it waits. Until it
    /// is granted or leaves the queue, no request of its priority or lower
    /// whose tenant shares a partition with it is granted, queued (behind
    /// it: `before`, its queue key) or new (None). Higher priorities and
    /// other partitions go ahead. Returns why `req` must wait.
    fn reservation(&self, req: &LeaseRequest, before: Option<(Reverse<i32>, u64)>, now: Millis) -> Option<String> {
        if self.queue.is_empty() {
            return None;
        }
        let mine = self.partitions_of(&req.tenant);
        let w = self.queue.iter().filter(|(k, _)| before.is_none_or(|b| **k < b)).map(|(_, w)| w).find(|w| {
            w.short_of_capacity
                && w.req.priority >= req.priority
                && now.saturating_sub(w.since) >= self.limits.reserve_after_ms
                && self.partitions_of(&w.req.tenant).iter().any(|p| mine.contains(p))
        })?;
        let d = &w.req.demand;
        let what = if d.gpus > 0 { format!("{} GPU(s)", d.gpus) } else { "a GPU share".to_string() };
        Some(format!(
            "capacity is reserved for an earlier request ({what} for tenant {}, priority {}, queued {} ms ago)",
            w.req.tenant,
            w.req.priority,
            now.saturating_sub(w.since)
        ))
    }

    /// Withdraws a queued request (its client went away).
    pub fn withdraw(&mut self, ticket: u64) {
        self.queue.retain(|_, w| w.ticket != ticket);
    }

    fn validate(&self, req: &mut LeaseRequest) -> Result<(), BrokerError> {
        let d = &mut req.demand;
        if req.tenant.is_empty() {
            return Err(BrokerError::Invalid("a lease needs a tenant".into()));
        }
        if d.gpus == 0 && d.memory == 0 && d.compute_milli == 0 {
            return Err(BrokerError::Invalid("ask for GPUs, or memory and/or a compute share of one".into()));
        }
        if d.gpus > 0 && (d.memory > 0 || d.compute_milli > 0) {
            return Err(BrokerError::Invalid(
                "memory and compute shares are for a fraction of one GPU; leave out --gpus or set it to 1".into(),
            ));
        }
        if d.compute_milli > 1000 {
            return Err(BrokerError::Invalid("a compute share is at most 1000 (one whole GPU)".into()));
        }
        if req.ttl_ms == 0 {
            req.ttl_ms = self.limits.default_ttl_ms;
        }
        if req.ttl_ms > self.limits.max_ttl_ms {
            return Err(BrokerError::Invalid(format!("ttl is at most {} ms", self.limits.max_ttl_ms)));
        }
        req.wait_ms = req.wait_ms.min(self.limits.max_wait_ms);
        Ok(())
    }

    fn demand_share(&self, req: &LeaseRequest) -> Usage {
        let d = &req.demand;
        if d.is_fraction() {
            // Memory counts as asked; the GPU share is not known before
            // placement: count the compute share (memory share checked after).
            Usage { milli: d.compute_milli as u64, memory: d.memory, leases: 0 }
        } else {
            Usage { milli: d.gpus as u64 * 1000, memory: 0, leases: 0 }
        }
    }

    /// Refuses at once a request larger than the tenant's whole quota.
    fn check_quota_ever(&self, req: &LeaseRequest) -> Result<(), BrokerError> {
        let p = self.quota_of(&req.tenant);
        let want = self.demand_share(req);
        {
            let g = p.max_gpus;
            if want.milli > g as u64 * 1000 {
                return Err(BrokerError::Quota(format!(
                    "tenant {} asks for {} GPU(s), its quota is {g}",
                    req.tenant,
                    want.milli as f64 / 1000.0
                )));
            }
        }
        if let Some(m) = p.max_memory {
            if want.memory > m {
                return Err(BrokerError::Quota(format!(
                    "tenant {} asks for {} MiB, its memory quota is {} MiB",
                    req.tenant,
                    want.memory >> 20,
                    m >> 20
                )));
            }
        }
        Ok(())
    }

    fn check_quota_now(&self, tenant: &str, add: Usage) -> Result<(), BrokerError> {
        let p = self.quota_of(tenant);
        let u = self.usage.get(tenant).copied().unwrap_or_default();
        if u.leases >= p.max_leases {
            return Err(BrokerError::Quota(format!("tenant {tenant} holds {} lease(s), its quota is {}", u.leases, p.max_leases)));
        }
        {
            let g = p.max_gpus;
            if u.milli + add.milli > g as u64 * 1000 {
                return Err(BrokerError::Quota(format!(
                    "tenant {tenant} would hold {:.3} GPU(s), its quota is {g}",
                    (u.milli + add.milli) as f64 / 1000.0
                )));
            }
        }
        if let Some(m) = p.max_memory {
            if u.memory + add.memory > m {
                return Err(BrokerError::Quota(format!(
                    "tenant {tenant} would hold {} MiB of GPU memory, its quota is {} MiB",
                    (u.memory + add.memory) >> 20,
                    m >> 20
                )));
            }
        }
        Ok(())
    }

    fn try_grant(&mut self, req: &LeaseRequest, id: u64, now: Millis) -> Result<Lease, BrokerError> {
        self.check_quota_now(&req.tenant, self.demand_share(req))?;
        let parts = self.partitions_of(&req.tenant);
        let eligible = |s: &Server| s.serves_any(&parts);
        if let Some(why) = self.fabric.never(req.bandwidth, &self.servers, &eligible) {
            return Err(BrokerError::Invalid(why));
        }
        let slots = match placement::place_cached_on(
            &self.servers,
            &req.demand,
            &eligible,
            self.policy.as_ref(),
            &mut self.scores,
            &self.fabric.view(req.bandwidth),
        ) {
            Ok(s) => s,
            Err(NoPlace::Busy) => {
                return Err(BrokerError::Unavailable(format!(
                    "no capacity free now in partition(s) {} for this request",
                    parts.join(",")
                )))
            }
            Err(NoPlace::Impossible(why)) => return Err(BrokerError::Invalid(why)),
        };
        let gpus: Vec<LeasedGpu> = slots
            .iter()
            .map(|&(si, gi)| {
                let s = &self.servers[si];
                let g = &s.gpus[gi];
                let (take_memory, take_milli) = req.demand.take_from(g);
                LeasedGpu {
                    server: s.spec.id.clone(),
                    uuid: g.spec.uuid,
                    ordinal: g.spec.ordinal,
                    model: g.spec.model.clone(),
                    memory: g.spec.memory,
                    take_memory,
                    take_milli,
                }
            })
            .collect();
        let add = Usage {
            milli: gpus.iter().map(|g| share_milli(g.take_memory, g.memory, g.take_milli)).sum(),
            memory: gpus.iter().map(|g| g.take_memory).sum(),
            leases: 0,
        };
        self.check_quota_now(&req.tenant, add)?;
        let id = if id == 0 || self.leases.contains_key(&id) { self.fresh_id(id) } else { id };
        self.generation += 1;
        let lease = Lease {
            id,
            key: req.key.clone(),
            tenant: req.tenant.clone(),
            generation: self.generation,
            gpus,
            memory_limit: if req.demand.is_fraction() { req.demand.memory } else { 0 },
            compute_milli: if req.demand.is_fraction() { req.demand.compute_milli } else { 1000 },
            priority: req.priority,
            granted: now,
            ttl_ms: req.ttl_ms,
            deadline: now.saturating_add(req.ttl_ms),
            state: LeaseState::Active,
            bandwidth: req.bandwidth,
            moving: None,
            move_error: String::new(),
            client_key: req.client_key,
            suspension: None,
            unpreemptible_until: 0,
        };
        self.occupy(&lease);
        if !lease.key.is_empty() {
            self.keys.insert((lease.tenant.clone(), lease.key.clone()), id);
        }
        self.leases.insert(id, lease.clone());
        self.changes.push(Change::Generation(self.generation));
        self.changes.push(Change::Lease(lease.clone()));
        Ok(lease)
    }

    fn fresh_id(&self, mut id: u64) -> u64 {
        loop {
            id = id.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407) | 1;
            if !self.leases.contains_key(&id) {
                return id;
            }
        }
    }

    fn occupy(&mut self, l: &Lease) {
        self.occupy_gpus(l);
        self.occupy_usage(l);
    }

    /// Counts `l` in its tenant's quota.
    fn occupy_usage(&mut self, l: &Lease) {
        let u = self.usage.entry(l.tenant.clone()).or_default();
        u.milli += l.gpu_milli();
        u.memory += l.memory();
        u.leases += 1;
    }

    /// Takes `l`'s GPUs and links (not its tenant's quota: see `occupy`).
    fn occupy_gpus(&mut self, l: &Lease) {
        for g in &l.gpus {
            if let Some(&si) = self.index.get(&g.server) {
                let s = &mut self.servers[si];
                if let Some(gpu) = s.gpus.iter_mut().find(|x| x.spec.uuid == g.uuid) {
                    gpu.used_memory += g.take_memory;
                    gpu.used_milli += g.take_milli;
                    gpu.holders.push(l.id);
                }
                s.recount();
            }
        }
        let on = self.servers_of(l);
        self.fabric.occupy(&on, l.bandwidth);
    }

    /// The distinct servers (indices) `l` is on.
    fn servers_of(&self, l: &Lease) -> Vec<usize> {
        let mut v: Vec<usize> = l.gpus.iter().filter_map(|g| self.index.get(&g.server).copied()).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    fn vacate(&mut self, l: &Lease) {
        self.vacate_gpus(l);
        self.vacate_usage(l);
    }

    fn vacate_usage(&mut self, l: &Lease) {
        if let Some(u) = self.usage.get_mut(&l.tenant) {
            u.milli = u.milli.saturating_sub(l.gpu_milli());
            u.memory = u.memory.saturating_sub(l.memory());
            u.leases = u.leases.saturating_sub(1);
        }
    }

    /// Frees `l`'s GPUs and links (not its tenant's quota: see `vacate`).
    fn vacate_gpus(&mut self, l: &Lease) {
        for g in &l.gpus {
            if let Some(&si) = self.index.get(&g.server) {
                let s = &mut self.servers[si];
                if let Some(gpu) = s.gpus.iter_mut().find(|x| x.spec.uuid == g.uuid) {
                    gpu.used_memory = gpu.used_memory.saturating_sub(g.take_memory);
                    gpu.used_milli = gpu.used_milli.saturating_sub(g.take_milli);
                    gpu.holders.retain(|&h| h != l.id);
                }
                s.recount();
            }
        }
        let on = self.servers_of(l);
        self.fabric.vacate(&on, l.bandwidth);
    }

    fn end(&mut self, id: u64, why: EndReason) {
        if let Some(l) = self.leases.remove(&id) {
            if l.holds_gpus() {
                self.vacate(&l);
            } else {
                self.vacate_usage(&l);
            }
            self.suspended.remove(&id);
            if let Some(m) = &l.moving {
                self.unreserve(id, &m.gpus);
            }
            if !l.key.is_empty() {
                self.keys.remove(&(l.tenant.clone(), l.key.clone()));
            }
            self.changes.push(Change::LeaseGone(id));
            self.events.push(Event::Ended { id, why, lease: Box::new(l) });
            if self.ended.len() >= ENDED_KEPT {
                self.ended.pop_front();
            }
            self.ended.push_back((id, why));
        }
    }

    fn not_found(&self, id: u64) -> BrokerError {
        let why = self
            .ended
            .iter()
            .rev()
            .find(|(e, _)| *e == id)
            .map_or("is not known to this broker", |(_, w)| w.text());
        BrokerError::NotFound { id, why: why.to_string() }
    }

    /// Extends a lease to `now + ttl` (its own TTL when `ttl_ms` is 0).
    /// The deadline never moves backwards.
    pub fn renew(&mut self, id: u64, ttl_ms: u64, now: Millis) -> Result<Lease, BrokerError> {
        let max = self.limits.max_ttl_ms;
        let not_found = self.not_found(id);
        let l = self.leases.get_mut(&id).ok_or(not_found)?;
        if l.deadline <= now {
            // Due to expire at the next tick: it is over.
            self.end(id, EndReason::Expired);
            return Err(self.not_found(id));
        }
        if l.state == LeaseState::Lost {
            let server = l.gpus.iter().map(|g| g.server.as_str()).find(|s| {
                self.index.get(*s).is_some_and(|&i| !self.servers[i].reachable)
            });
            let server = server.unwrap_or(l.gpus[0].server.as_str()).to_string();
            return Err(BrokerError::Lost { id, server });
        }
        let ttl = if ttl_ms == 0 { l.ttl_ms } else { ttl_ms.min(max) };
        l.deadline = l.deadline.max(now.saturating_add(ttl));
        let l = l.clone();
        self.changes.push(Change::Lease(l.clone()));
        Ok(l)
    }

    /// Ends a lease. Idempotent: releasing one that already ended is fine
    /// (false).
    pub fn release(&mut self, id: u64, now: Millis) -> bool {
        let had = self.leases.contains_key(&id);
        self.end(id, EndReason::Released);
        if had {
            self.try_queue(now);
        }
        had
    }

    /// The broker itself did not run for `missed` ms up to `now` (paused,
    /// starved): it heard no server in that time, so none is blamed for
    /// it; each server's silence resumes where it stood. Lease deadlines
    /// are not moved: they are written in the tokens the servers enforce.
    pub fn stalled(&mut self, missed: Millis, now: Millis) {
        for s in &mut self.servers {
            s.last_heartbeat = s.last_heartbeat.saturating_add(missed).min(now);
        }
    }

    /// Time passes: servers that missed heartbeats lose their leases,
    /// leases past their deadline expire, drain deadlines revoke, queued
    /// requests time out or are granted.
    pub fn tick(&mut self, now: Millis) {
        let silence = self.limits.heartbeat_ms * self.limits.missed_heartbeats as u64;
        let mut gone: Vec<String> = Vec::new();
        let mut revoke_on: Vec<String> = Vec::new();
        for s in &mut self.servers {
            if s.reachable && now.saturating_sub(s.last_heartbeat) > silence {
                s.reachable = false;
                gone.push(s.spec.id.clone());
            }
            if let Some(Drain { deadline: Some(d), .. }) = s.drain {
                if d <= now && s.gpus.iter().any(|g| !g.holders.is_empty()) {
                    revoke_on.push(s.spec.id.clone());
                }
            }
        }
        if !gone.is_empty() {
            for l in self.leases.values_mut() {
                if l.state == LeaseState::Active && l.gpus.iter().any(|g| gone.contains(&g.server)) {
                    l.state = LeaseState::Lost;
                    self.changes.push(Change::Lease(l.clone()));
                }
            }
            for id in &gone {
                tracing::warn!(server = %id, "server missed {} heartbeats: unreachable; its leases are lost",
                    self.limits.missed_heartbeats);
            }
        }
        let mut ending: Vec<(u64, EndReason)> = Vec::new();
        for l in self.leases.values() {
            // Never early: a lease lives through its whole deadline.
            if l.deadline < now {
                ending.push((l.id, EndReason::Expired));
            } else if l.gpus.iter().any(|g| revoke_on.contains(&g.server)) {
                ending.push((l.id, EndReason::Revoked));
            }
        }
        let freed = !ending.is_empty();
        for (id, why) in ending {
            self.end(id, why);
        }
        let stuck: Vec<(u64, String, String)> = self
            .leases
            .values()
            .filter_map(|l| {
                let m = l.moving.as_ref()?;
                let from = l.gpus.first()?.server.clone();
                let why = if now.saturating_sub(m.since) > moves::MOVE_TIMEOUT_MS {
                    format!("not reported within {} ms", moves::MOVE_TIMEOUT_MS)
                } else if gone.contains(&from) || gone.contains(&m.to) || l.state != LeaseState::Active {
                    "a server of the move stopped answering heartbeats".to_string()
                } else {
                    return None;
                };
                Some((l.id, from, why))
            })
            .collect();
        for (id, from, why) in stuck {
            tracing::warn!(lease = format_args!("{id:#x}"), %from, "move abandoned: {why}");
            let _ = self.move_reported(&from, id, Err(format!("abandoned: {why}")), now);
        }
        if !self.suspended.is_empty() {
            self.stuck_suspensions(&gone, now);
        }
        let expired: Vec<(Reverse<i32>, u64)> =
            self.queue.iter().filter(|(_, w)| w.until <= now).map(|(k, _)| *k).collect();
        for k in expired {
            if let Some(w) = self.queue.remove(&k) {
                self.events.push(Event::Failed { ticket: w.ticket, error: BrokerError::QueueTimeout(w.req.wait_ms) });
            }
        }
        if freed {
            self.try_queue(now);
        } else {
            // A request may have waited long enough to preempt by now.
            self.preempt(now);
        }
        // Leases that could not leave an unhealthy GPU, tried again.
        if self.evacuation.pending() {
            self.evacuate(now);
        }
    }

    /// Grants what waits, in priority order and first come first served
    /// within a priority; a request that does not fit yet does not stop
    /// smaller ones behind it, until it has waited long enough to hold a
    /// reservation ([`State::reservation`]).
    fn try_queue(&mut self, now: Millis) {
        self.resume_suspended(now);
        self.grant_queued(now);
        self.preempt(now);
    }

    fn grant_queued(&mut self, now: Millis) {
        if self.queue.is_empty() {
            return;
        }
        let keys: Vec<(Reverse<i32>, u64)> = self.queue.keys().copied().collect();
        for k in keys {
            let Some(w) = self.queue.get(&k) else { continue };
            let (req, id, ticket) = (w.req.clone(), w.id, w.ticket);
            if self.reservation(&req, Some(k), now).is_some() {
                continue;
            }
            match self.try_grant(&req, id, now) {
                Ok(lease) => {
                    self.queue.remove(&k);
                    self.events.push(Event::Granted { ticket, lease });
                }
                Err(e) => {
                    if let Some(w) = self.queue.get_mut(&k) {
                        w.short_of_capacity = matches!(e, BrokerError::Unavailable(_));
                    }
                }
            }
        }
    }

    /// Per-server counts: (GPUs, whole GPUs free, memory, memory used, leases).
    pub fn server_use(&self, s: &Server) -> (u32, u32, u64, u64, u32) {
        let mut leases = std::collections::HashSet::new();
        let (mut mem, mut used) = (0, 0);
        for g in &s.gpus {
            mem += g.spec.memory;
            used += g.used_memory;
            leases.extend(g.holders.iter().copied());
        }
        (s.gpus.len() as u32, s.free_whole, mem, used, leases.len() as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::GpuSpec;
    use crate::placement::{FragmentationAware, Scope};

    fn spec(id: &str, gpus: u32, parts: &[&str]) -> ServerSpec {
        ServerSpec {
            id: id.into(),
            node: id.into(),
            leaf: "l1".into(),
            spine: "s1".into(),
            partitions: parts.iter().map(|s| s.to_string()).collect(),
            gpus: (0..gpus)
                .map(|i| GpuSpec {
                    uuid: [id.as_bytes()[0], i as u8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                    ordinal: i,
                    model: "sim".into(),
                    memory: 16 << 30,
                    sms: 132,
                    healthy: true,
                    health_reason: String::new(),
                })
                .collect(),
            transports: Vec::new(),
        }
    }

    fn state() -> State {
        let mut tenants = HashMap::new();
        tenants.insert(
            "alice".to_string(),
            TenantPolicy { partitions: vec!["a".into()], max_gpus: Some(2), ..TenantPolicy::default() },
        );
        let mut s = State::new(Limits::default(), tenants, Box::new(FragmentationAware));
        s.register(spec("x", 2, &[]), 0);
        s.register(spec("y", 2, &["a"]), 0);
        s
    }

    fn req(tenant: &str, gpus: u32) -> LeaseRequest {
        LeaseRequest {
            tenant: tenant.into(),
            demand: Demand { gpus, ..Demand::default() },
            ttl_ms: 1000,
            ..LeaseRequest::default()
        }
    }

    fn granted(o: Result<Outcome, BrokerError>) -> Lease {
        match o {
            Ok(Outcome::Granted(l)) => l,
            Ok(Outcome::Queued(t)) => panic!("queued as {t}"),
            Err(e) => panic!("{e}"),
        }
    }

    /// Records the pool it is told of, as GPUs in all.
    struct PoolSeen(std::sync::Arc<std::sync::Mutex<Vec<usize>>>);

    impl Policy for PoolSeen {
        fn name(&self) -> &'static str {
            "pool-seen"
        }
        fn score_gpu(&self, _: &Server, _: &crate::inventory::Gpu, _: &Demand) -> i64 {
            0
        }
        fn score_unit(&self, _: &crate::placement::Unit, _: &Demand) -> i64 {
            0
        }
        fn pool_changed(&self, servers: &[Server]) {
            self.0.lock().unwrap().push(servers.iter().map(|s| s.gpus.len()).sum());
        }
    }

    /// The model rule weighs the pool's GPUs by model: the policy must be
    /// told when servers join or change, and not on every registration.
    #[test]
    fn the_policy_is_told_the_pool_when_servers_join_change_or_are_restored() {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut s = State::new(Limits::default(), HashMap::new(), Box::new(PoolSeen(seen.clone())));
        s.register(spec("a", 4, &[]), 0);
        s.register(spec("b", 2, &[]), 0);
        s.register(spec("a", 4, &[]), 1);
        s.register(spec("b", 3, &[]), 2);
        assert_eq!(*seen.lock().unwrap(), vec![4, 6, 7], "joined, joined, (unchanged), changed");
        let restored = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut r = State::new(Limits::default(), HashMap::new(), Box::new(PoolSeen(restored.clone())));
        r.restore(vec![(spec("a", 4, &[]), None), (spec("b", 2, &[]), None)], Vec::new(), 1, 0);
        assert_eq!(*restored.lock().unwrap(), vec![6]);
    }

    /// A gang (GPUs across the servers of one leaf) with the broker's
    /// default policy and its score cache: granted whole within one leaf,
    /// or refused with nothing taken; a release lets the next one in.
    #[test]
    fn gangs_within_a_leaf_are_granted_whole_or_not_at_all() {
        let mut limits = Limits::default();
        limits.default_max_gpus = 64;
        let mut s = State::new(limits, HashMap::new(), Box::new(crate::policies::Fgd::learning()));
        for (id, leaf) in [("a", "l1"), ("b", "l1"), ("c", "l2"), ("d", "l2")] {
            let mut sp = spec(id, 4, &[]);
            sp.leaf = leaf.into();
            s.register(sp, 0);
        }
        let gang = |n| LeaseRequest {
            demand: Demand { gpus: n, scope: Scope::Leaf, scope_required: true, ..Demand::default() },
            ..req("bob", n)
        };
        let leaf_of = |l: &Lease, s: &State| {
            let leaves: std::collections::HashSet<String> =
                l.gpus.iter().map(|g| s.server(&g.server).unwrap().spec.leaf.clone()).collect();
            assert_eq!(leaves.len(), 1, "one leaf: {l:?}");
            leaves.into_iter().next().unwrap()
        };
        let g1 = granted(s.request(gang(6), 1, 0));
        assert_eq!(g1.gpus.len(), 6);
        let servers: std::collections::HashSet<&str> = g1.gpus.iter().map(|g| g.server.as_str()).collect();
        assert_eq!(servers.len(), 2, "across two servers");
        let g2 = granted(s.request(gang(6), 2, 0));
        assert_ne!(leaf_of(&g1, &s), leaf_of(&g2, &s));
        // 2 + 2 GPUs free, one leaf each: a gang of 3 cannot be had now,
        // and nothing of it is taken.
        let free = |s: &State| s.servers.iter().map(|x| x.free_whole).sum::<u32>();
        assert_eq!(free(&s), 4);
        assert!(matches!(s.request(gang(3), 3, 0), Err(BrokerError::Unavailable(_))));
        assert_eq!(free(&s), 4);
        assert!(matches!(s.request(gang(9), 4, 0), Err(BrokerError::Invalid(_))), "larger than any leaf");
        assert!(s.release(g1.id, 1));
        let g3 = granted(s.request(gang(3), 5, 1));
        assert_eq!(leaf_of(&g3, &s), leaf_of(&g1, &s));
    }

    #[test]
    fn grant_renew_release_expire_and_generations() {
        let mut s = state();
        let a = granted(s.request(req("bob", 1), 11, 0));
        assert_eq!(a.gpus[0].server, "x", "bob sees the default partition only");
        let b = granted(s.request(req("bob", 1), 12, 0));
        assert!(b.generation > a.generation);
        let (changes, _) = s.take_output();
        assert!(changes.contains(&Change::Generation(b.generation)));
        // x is full for bob.
        assert!(matches!(s.request(req("bob", 1), 13, 0), Err(BrokerError::Unavailable(_))));
        // Renew moves the deadline, never backwards.
        let r = s.renew(a.id, 5000, 500).unwrap();
        assert_eq!(r.deadline, 5500);
        assert_eq!(s.renew(a.id, 10, 600).unwrap().deadline, 5500);
        // b expires after its deadline, not at it.
        s.tick(1000);
        assert!(s.lease(b.id).is_some());
        s.tick(1001);
        assert!(s.lease(b.id).is_none());
        assert!(matches!(s.renew(b.id, 0, 1001), Err(BrokerError::NotFound { why, .. }) if why.contains("expired")));
        assert!(s.release(a.id, 1001));
        assert!(!s.release(a.id, 1001), "release is idempotent");
        let (changes, _) = s.take_output();
        assert!(changes.contains(&Change::LeaseGone(a.id)));
        assert_eq!(s.server("x").unwrap().free_whole, 2);
    }

    #[test]
    fn idempotent_requests_quotas_and_partitions() {
        let mut s = state();
        let mut r = req("alice", 1);
        r.key = "job-1".into();
        let a = granted(s.request(r.clone(), 1, 0));
        assert_eq!(a.gpus[0].server, "y", "alice sees partition a only");
        assert_eq!(granted(s.request(r, 2, 0)).id, a.id, "same key, same lease");
        assert!(matches!(s.request(req("alice", 3), 3, 0), Err(BrokerError::Quota(_))));
        granted(s.request(req("alice", 1), 4, 0));
        assert!(matches!(s.request(req("alice", 1), 5, 0), Err(BrokerError::Quota(_))));
        // A fraction counts by its memory share: 8 of 16 GiB = 0.5 GPU.
        let mut f = req("bob", 0);
        f.demand.memory = 8 << 30;
        let l = granted(s.request(f.clone(), 6, 0));
        assert_eq!(l.memory_limit, 8 << 30);
        assert_eq!(l.gpu_milli(), 500);
        let l2 = granted(s.request(f, 7, 0));
        assert_eq!(l2.gpus[0].uuid, l.gpus[0].uuid, "fractions share one GPU");
        assert!(matches!(s.request(req("nobody", 5), 8, 0), Err(BrokerError::Invalid(_))));
    }

    /// Finding: one client took 5,250 leases in under 3 s; a tenant with no
    /// policy had no quota at all.
    #[test]
    fn tenants_without_a_policy_are_held_to_the_default_quotas() {
        let limits = Limits { default_max_leases: 3, default_max_gpus: 2, ..Limits::default() };
        let mut s = State::new(limits, HashMap::new(), Box::new(FragmentationAware));
        s.register(spec("x", 4, &[]), 0);
        assert!(matches!(s.request(req("bob", 3), 1, 0), Err(BrokerError::Quota(_))), "more GPUs than the default");
        let mut f = req("bob", 0);
        f.demand.memory = 1 << 30;
        for i in 0..3 {
            granted(s.request(f.clone(), 10 + i, 0));
        }
        assert!(matches!(s.request(f.clone(), 20, 0), Err(BrokerError::Quota(_))), "a 4th lease");
        let mut queued = f.clone();
        queued.wait_ms = 1000;
        assert!(matches!(s.request(queued, 21, 0), Err(BrokerError::Quota(_))), "nor queued");
        f.tenant = "carol".into();
        granted(s.request(f, 30, 0));
    }

    #[test]
    fn queue_priority_fifo_and_timeout() {
        let mut s = state();
        let a = granted(s.request(req("bob", 2), 1, 0));
        let mut low = req("bob", 1);
        low.wait_ms = 10_000;
        let mut high = low.clone();
        high.priority = 5;
        let Ok(Outcome::Queued(t_low)) = s.request(low.clone(), 2, 0) else { panic!() };
        let Ok(Outcome::Queued(t_high)) = s.request(high, 3, 1) else { panic!() };
        let Ok(Outcome::Queued(t_low2)) = s.request(low, 4, 2) else { panic!() };
        s.take_output();
        s.release(a.id, 5);
        let (_, ev) = s.take_output();
        let granted: Vec<u64> = ev
            .iter()
            .filter_map(|e| match e {
                Event::Granted { ticket, .. } => Some(*ticket),
                _ => None,
            })
            .collect();
        assert_eq!(granted, vec![t_high, t_low], "priority first, then FIFO");
        s.tick(10_002);
        let (_, ev) = s.take_output();
        assert!(ev.contains(&Event::Failed { ticket: t_low2, error: BrokerError::QueueTimeout(10_000) }));
    }

    #[test]
    fn a_large_request_that_waited_long_enough_is_not_starved_by_small_ones() {
        // x: 2 GPUs for bob (default partition); y: 2 GPUs for alice ("a").
        let mut s = state();
        let small = |n: u64| {
            let mut r = req("bob", 1);
            r.ttl_ms = 60_000;
            r.key = format!("small{n}");
            r
        };
        let s1 = granted(s.request(small(1), 1, 0));
        let mut big = req("bob", 2);
        big.wait_ms = 60_000;
        big.ttl_ms = 60_000;
        let Ok(Outcome::Queued(t_big)) = s.request(big, 2, 0) else { panic!("big should wait") };
        // Before it has aged, small requests go ahead (backfill).
        let s2 = granted(s.request(small(2), 3, 100));
        // One small lease ends; the big one still does not fit.
        assert!(s.release(s1.id, 200));
        assert!(s.take_output().1.iter().all(|e| !matches!(e, Event::Granted { .. })));
        // Aged: the GPU that is free stays free for it.
        let t = 200 + s.limits.reserve_after_ms;
        let r = s.request(small(3), 4, t);
        assert!(
            matches!(&r, Err(BrokerError::Unavailable(why)) if why.contains("reserved")),
            "a small request must not take the reserved GPU: {:?}",
            r.map(|_| "granted or queued")
        );
        let mut queued_small = small(4);
        queued_small.wait_ms = 60_000;
        let Ok(Outcome::Queued(t_small)) = s.request(queued_small, 5, t) else { panic!("queues behind it") };
        // Other partitions and higher priorities are not held up.
        granted(s.request(req("alice", 1), 6, t));
        let mut urgent = small(5);
        urgent.priority = 9;
        let u = granted(s.request(urgent, 7, t));
        s.release(u.id, t + 1);
        // The last small lease ends: the big request gets both GPUs first.
        s.take_output();
        assert!(s.release(s2.id, t + 2));
        let granted_now: Vec<u64> = s
            .take_output()
            .1
            .iter()
            .filter_map(|e| match e {
                Event::Granted { ticket, .. } => Some(*ticket),
                _ => None,
            })
            .collect();
        assert_eq!(granted_now, vec![t_big], "the large request first; the small one waits on");
        assert!(s.queue.values().any(|w| w.ticket == t_small));
    }

    #[test]
    fn drain_heartbeats_and_restore() {
        let mut s = state();
        let a = granted(s.request(req("bob", 1), 1, 0));
        s.drain("x", Some(500), false, 10).unwrap();
        assert!(matches!(s.request(req("bob", 1), 2, 10), Err(BrokerError::Unavailable(_))));
        s.tick(400);
        assert!(s.lease(a.id).is_some(), "runs until the drain deadline");
        let hb = s.heartbeat("x", 400).unwrap();
        assert_eq!(hb.live.len(), 1);
        assert_eq!(hb.floor, a.generation);
        s.heartbeat("y", 400);
        s.tick(500);
        assert!(s.lease(a.id).is_none(), "revoked at the deadline");
        s.undrain("x", 600).unwrap();
        let mut long = req("bob", 1);
        long.ttl_ms = 60_000;
        let b = granted(s.request(long, 3, 600));
        // y keeps heartbeating, x falls silent.
        s.heartbeat("y", 3500);
        s.tick(3601);
        assert!(matches!(s.renew(b.id, 0, 3601), Err(BrokerError::Lost { .. })));
        // Restore from the persisted pieces: same leases, same generation.
        let servers = s.servers.iter().map(|x| (x.spec.clone(), x.drain)).collect();
        let leases: Vec<Lease> = s.leases().cloned().collect();
        let mut t = State::new(Limits::default(), HashMap::new(), Box::new(FragmentationAware));
        t.restore(servers, leases, s.generation(), 4000);
        assert_eq!(t.generation(), s.generation());
        assert_eq!(t.lease(b.id), s.lease(b.id));
        assert_eq!(t.server("x").unwrap().free_whole, 1);
        assert!(s.heartbeat("nope", 0).is_none());
        let _ = Scope::Any;
    }

    /// Finding: a broker paused for longer than the heartbeat silence (a
    /// leader frozen with SIGSTOP in the replica test) woke, ticked, and
    /// declared every server unreachable and every lease lost: its own
    /// silence, blamed on the servers.
    #[test]
    fn a_stall_of_the_broker_is_not_the_servers_silence() {
        let run = |stall: bool| {
            let mut s = state();
            let mut r = req("bob", 1);
            r.ttl_ms = 60_000;
            let a = granted(s.request(r, 1, 0));
            assert_eq!(a.gpus[0].server, "x", "bob's partition is x's");
            s.heartbeat("x", 400);
            s.tick(500);
            // Nothing ran from 500 to 5,500.
            if stall {
                s.stalled(5_000, 5_500);
            }
            s.tick(5_500);
            let held = s.lease(a.id).is_some_and(|l| l.state == LeaseState::Active);
            let grants = s.request(req("bob", 1), 2, 5_500).is_ok();
            (s, a, held, grants)
        };
        let (_, _, held, grants) = run(false);
        assert!(!held && !grants, "without the stall credited, the servers' silence counts it");
        let (mut s, a, held, grants) = run(true);
        assert!(held, "the lease outlives the broker's own stall");
        assert!(grants, "and x takes grants");
        // x's silence resumes where it stood (100 ms at the stall): 3 s
        // more of it, and x is unreachable after all.
        s.tick(8_350);
        assert!(s.lease(a.id).is_some_and(|l| l.state == LeaseState::Active), "2.95 s of silence is not 3");
        s.tick(8_450);
        assert!(s.server("x").is_some_and(|x| !x.reachable));
        assert!(matches!(s.renew(a.id, 0, 8_450), Err(BrokerError::Lost { .. })));
    }

    #[test]
    fn a_drain_for_shutdown_ends_when_the_server_registers_again() {
        let mut s = state();
        s.drain("x", Some(5_000), true, 10).unwrap();
        assert!(matches!(s.request(req("bob", 1), 1, 10), Err(BrokerError::Unavailable(_))));
        // The server restarted (same id, same GPUs): it takes grants again.
        s.register(spec("x", 2, &[]), 20);
        assert!(s.server("x").unwrap().drain.is_none());
        granted(s.request(req("bob", 1), 2, 20));
        // An operator's drain survives the server's restart, and a server
        // stopping under it does not turn it into its own.
        s.drain("x", None, false, 30).unwrap();
        s.drain("x", Some(5_000), true, 40).unwrap();
        s.register(spec("x", 2, &[]), 50);
        assert!(s.server("x").unwrap().drain.is_some_and(|d| !d.for_shutdown));
    }
}
