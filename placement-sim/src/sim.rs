//! The cluster and the two replays. Every GPU pod is a lease request placed
//! by the broker's own `placement::place_in` with a broker `Policy`; the
//! simulator only applies the slots it returns (as the broker's state
//! machine does) and keeps host CPU and memory, which the broker does not
//! track. CPU-only pods are not GPU leases: the simulator places them on the
//! node the same policy scores best for a host-only request.

use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::cmp::Reverse;

use rgpu_pool_broker::inventory::{GpuSpec, Server, ServerSpec};
use rgpu_pool_broker::placement::{place_in, Context, Demand, Host, NoPlace, Policy, Scope, Slot, Unit};
use rgpu_pool_broker::policies::{BestFit, Fgd, RandomFit, Shape, TieRules, Workload};

use crate::trace::{Node, Pod};

/// Synthetic topology: this many GPU nodes per leaf switch, in trace order.
pub const NODES_PER_LEAF: usize = 8;
/// Every simulated GPU has this much memory, so a fraction's memory share
/// (`gpu_milli` of it) is exactly its compute share: the trace gives no
/// per-GPU memory, and the paper's model is compute shares only.
pub const GPU_MEMORY: u64 = 1000 << 20;

/// The policies compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Random,
    BestFit,
    Fgd,
    Ours,
    /// rgpu's packing with the CPU-capped fragment (`Fgd::packing_cpu_capped`;
    /// not in the default run).
    OursCpu,
}

impl Kind {
    pub const ALL: [Kind; 4] = [Kind::Random, Kind::BestFit, Kind::Fgd, Kind::Ours];

    pub fn label(self) -> &'static str {
        match self {
            Kind::Random => "random",
            Kind::BestFit => "best-fit",
            Kind::Fgd => "fgd",
            Kind::Ours => "rgpu (fgd-pack)",
            Kind::OursCpu => "rgpu, CPU-capped (fgd-pack-cpu)",
        }
    }

    pub fn parse(s: &str) -> Option<Kind> {
        Some(match s {
            "random" => Kind::Random,
            "best-fit" | "bestfit" => Kind::BestFit,
            "fgd" => Kind::Fgd,
            "ours" | "rgpu" | "fgd-pack" => Kind::Ours,
            "ours-cpu" | "fgd-pack-cpu" => Kind::OursCpu,
            _ => return None,
        })
    }

    /// A fresh policy for one run; `mix` is the trace file's distribution
    /// of requests (FGD's measure weighs by it).
    pub fn policy(self, mix: &Mix, seed: u64) -> Box<dyn Policy> {
        self.policy_with(mix, seed, TieRules::ALL)
    }

    /// [`Kind::policy`], rgpu's with only `rules` of its tie rules (the
    /// other kinds have none).
    pub fn policy_with(self, mix: &Mix, seed: u64, rules: TieRules) -> Box<dyn Policy> {
        let typical = mix.typical.clone();
        match self {
            Kind::Random => Box::new(RandomFit::new(seed)),
            Kind::BestFit => Box::new(BestFit::new()),
            Kind::Fgd => Box::new(Fgd::new(typical, seed)),
            Kind::Ours => Box::new(Fgd::packing_seen(typical, &mix.seen, seed).with_rules(rules)),
            Kind::OursCpu => Box::new(Fgd::packing_cpu_capped(typical, seed)),
        }
    }
}

/// A pod list's request shapes.
pub struct Mix {
    /// The typical ones, as the paper's simulator takes them (CPU-only pods
    /// included, top shapes covering 95% of pods).
    pub typical: Workload,
    /// All of them, by popularity (rgpu's tie rule by demand weighs them).
    pub seen: Workload,
}

pub fn workload_of(pods: &[Pod]) -> Mix {
    Mix { typical: Workload::typical(pods.iter().map(shape_of), 0.95), seen: Workload::typical(pods.iter().map(shape_of), 1.0) }
}

fn shape_of(p: &Pod) -> Shape {
    Shape {
        cpu_milli: p.cpu_milli,
        gpu_milli: p.gpu_milli,
        gpus: p.num_gpu,
        models: p.models.clone(),
    }
}

fn demand_of(p: &Pod) -> Demand {
    if p.num_gpu == 0 {
        // Host-only (see `policies::host_only`).
        return Demand::default();
    }
    if p.num_gpu == 1 && p.gpu_milli < 1000 {
        Demand {
            gpus: 0,
            memory: p.gpu_milli as u64 * (GPU_MEMORY / 1000),
            compute_milli: p.gpu_milli,
            models: p.models.clone(),
            scope: Scope::Node,
            scope_required: true,
        }
    } else {
        Demand { gpus: p.num_gpu, models: p.models.clone(), scope: Scope::Node, scope_required: true, ..Demand::default() }
    }
}

fn need_of(p: &Pod) -> Host {
    Host { cpu_milli: p.cpu_milli, memory: p.memory_mib << 20 }
}

/// Where a pod went: its node and, for GPU pods, its slots.
#[derive(Debug, Clone)]
pub struct Placed {
    pub server: usize,
    pub slots: Vec<Slot>,
}

/// Where a pod's parts may run (the pooling experiment, `docs/placement.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// As the trace ran: a GPU pod's GPUs and its CPU part on one GPU node
    /// (CPU-only pods on any node).
    Node,
    /// The CPU part on any node with CPU and memory, CPU-only nodes
    /// included; the GPUs still all on one GPU node (which needs no CPU).
    HostAnywhere,
    /// rgpu: the CPU part on any node; GPUs leased from any GPU nodes (a
    /// multi-GPU pod preferably within one node, else one leaf, else any).
    Pooled,
}

impl Pooling {
    pub const ALL: [Pooling; 3] = [Pooling::Node, Pooling::HostAnywhere, Pooling::Pooled];

    pub fn label(self) -> &'static str {
        match self {
            Pooling::Node => "as the trace ran (GPUs on the pod's node)",
            Pooling::HostAnywhere => "CPU part on any node, GPUs on one node",
            Pooling::Pooled => "rgpu: CPU part on any node, GPUs from any node",
        }
    }
}

/// Servers (one per GPU node) and their free host resources: `hosts[i]`
/// for `servers[i]`, then the CPU-only nodes.
pub struct Cluster {
    pub servers: Vec<Server>,
    pub hosts: Vec<Host>,
    pub capacity_milli: u64,
    pub used_milli: u64,
    pub pooling: Pooling,
    /// Each node's host resources when empty.
    empty: Vec<Host>,
}

impl Cluster {
    /// GPU nodes only, as the paper's experiment runs.
    pub fn new(nodes: &[Node]) -> Cluster {
        Cluster::with(nodes, &[], Pooling::Node)
    }

    /// `nodes` with GPUs (servers) and `cpu_nodes` without, under `pooling`.
    pub fn with(nodes: &[Node], cpu_nodes: &[Node], pooling: Pooling) -> Cluster {
        let servers: Vec<Server> = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let spec = ServerSpec {
                    id: n.name.clone(),
                    node: n.name.clone(),
                    leaf: format!("leaf-{:04}", i / NODES_PER_LEAF),
                    spine: "spine-0".into(),
                    partitions: vec!["default".into()],
                    gpus: (0..n.gpus)
                        .map(|g| {
                            let mut uuid = [0u8; 16];
                            uuid[..8].copy_from_slice(&(i as u64).to_le_bytes());
                            uuid[8..12].copy_from_slice(&g.to_le_bytes());
                            GpuSpec { uuid, ordinal: g, model: n.model.clone(), memory: GPU_MEMORY, sms: 0, healthy: true, health_reason: String::new() }
                        })
                        .collect(),
                    transports: Vec::new(),
                };
                Server::new(spec, 0)
            })
            .collect();
        let hosts: Vec<Host> = nodes.iter().chain(cpu_nodes).map(|n| Host { cpu_milli: n.cpu_milli, memory: n.memory_mib << 20 }).collect();
        let capacity_milli = nodes.iter().map(|n| n.gpus as u64 * 1000).sum();
        Cluster { servers, empty: hosts.clone(), hosts, capacity_milli, used_milli: 0, pooling }
    }

    /// The node left with the least CPU (then memory) that holds `need`,
    /// among `range` of `hosts`; the first of equals.
    fn best_host(&self, need: &Host, range: std::ops::Range<usize>) -> Option<usize> {
        let mut best: Option<((u64, u64), usize)> = None;
        for i in range {
            let h = &self.hosts[i];
            if !h.holds(need) {
                continue;
            }
            let left = (h.cpu_milli - need.cpu_milli, h.memory - need.memory);
            if best.is_none_or(|(b, _)| left < b) {
                best = Some((left, i));
            }
        }
        best.map(|(_, i)| i)
    }

    pub fn allocation_ratio(&self) -> f64 {
        if self.capacity_milli == 0 {
            0.0
        } else {
            self.used_milli as f64 / self.capacity_milli as f64
        }
    }

    /// Places `pod` with `policy`; None when it does not fit now (or ever).
    pub fn place(&mut self, pod: &Pod, id: u64, policy: &dyn Policy) -> Result<Placed, NoPlace> {
        let need = need_of(pod);
        let d = demand_of(pod);
        let n = self.servers.len();
        let placed = match self.pooling {
            Pooling::Node => {
                let cx = Context { hosts: &self.hosts, need };
                if pod.num_gpu == 0 {
                    // A CPU-only node strands no GPU: first choice.
                    match self.best_host(&need, n..self.hosts.len()) {
                        Some(h) => Placed { server: h, slots: Vec::new() },
                        None => place_host_only(&self.servers, &d, policy, &cx)?,
                    }
                } else {
                    let slots = place_in(&self.servers, &d, &|_| true, policy, &cx)?;
                    let server = slots.first().map(|s| s.0).ok_or(NoPlace::Busy)?;
                    Placed { server, slots }
                }
            }
            Pooling::HostAnywhere | Pooling::Pooled => {
                let host = self.best_host(&need, 0..self.hosts.len()).ok_or(NoPlace::Busy)?;
                let slots = if pod.num_gpu == 0 {
                    Vec::new()
                } else {
                    let mut d = d.clone();
                    if self.pooling == Pooling::Pooled && !d.is_fraction() {
                        // One node preferred, else one leaf, else anywhere.
                        d.scope_required = false;
                    }
                    // The broker's view: GPUs only, no host beside them.
                    let cx = Context { hosts: &[], need };
                    place_in(&self.servers, &d, &|_| true, policy, &cx)?
                };
                Placed { server: host, slots }
            }
        };
        self.apply(pod, id, &placed, &d, true);
        Ok(placed)
    }

    /// Takes (or with `take` false, returns) what `pod` holds at `placed`.
    pub fn apply(&mut self, pod: &Pod, id: u64, placed: &Placed, d: &Demand, take: bool) {
        let need = need_of(pod);
        let h = &mut self.hosts[placed.server];
        if take {
            h.cpu_milli -= need.cpu_milli;
            h.memory -= need.memory;
        } else {
            h.cpu_milli += need.cpu_milli;
            h.memory += need.memory;
        }
        for &(si, gi) in &placed.slots {
            let g = &mut self.servers[si].gpus[gi];
            let (m, c) = d.take_from(g);
            if take {
                g.used_memory += m;
                g.used_milli += c;
                g.holders.push(id);
                self.used_milli += c as u64;
            } else {
                g.used_memory -= m;
                g.used_milli -= c;
                g.holders.retain(|&x| x != id);
                self.used_milli -= c as u64;
            }
            self.servers[si].recount();
        }
    }

    pub fn release(&mut self, pod: &Pod, id: u64, placed: &Placed) {
        self.apply(pod, id, placed, &demand_of(pod), false);
    }

    /// Could `pod` fit now, given that `freed` was just released? A cheap
    /// necessary test before a real placement (the dynamic replay's
    /// backfill).
    pub fn may_fit_after(&self, pod: &Pod, freed: &Placed) -> bool {
        let need = need_of(pod);
        if self.pooling == Pooling::Node {
            return self.fits_on(pod, freed.server);
        }
        if pod.num_gpu == 0 {
            return self.hosts[freed.server].holds(&need);
        }
        let gpu_freed = freed.slots.iter().any(|&(si, _)| self.gpus_fit(pod, si));
        let whole = pod.num_gpu > 1 && self.pooling == Pooling::Pooled;
        let gpu_ok = if whole {
            // GPUs were freed, or CPU (it may have waited for that).
            (!freed.slots.is_empty() || self.hosts[freed.server].holds(&need))
                && self.servers.iter().map(|s| s.gpus.iter().filter(|g| g.model_allowed(&pod.models) && g.is_free()).count()).sum::<usize>()
                    >= pod.num_gpu as usize
        } else if gpu_freed {
            true
        } else {
            // It may have waited for CPU: only then look at every server.
            self.hosts[freed.server].holds(&need) && (0..self.servers.len()).any(|si| self.gpus_fit(pod, si))
        };
        gpu_ok && self.hosts.iter().any(|h| h.holds(&need))
    }

    /// Could `pod` fit in the empty cluster?
    pub fn could_ever(&self, pod: &Pod) -> bool {
        let need = need_of(pod);
        let n = self.servers.len();
        let ok = |g: &rgpu_pool_broker::inventory::Gpu| g.model_allowed(&pod.models);
        let on_one = |si: usize| self.servers[si].gpus.iter().filter(|g| ok(g)).count() as u32 >= pod.num_gpu.max(1);
        match self.pooling {
            Pooling::Node => (0..self.empty.len()).any(|i| {
                self.empty[i].holds(&need) && (pod.num_gpu == 0 || (i < n && on_one(i)))
            }),
            _ => {
                let gpus = match (pod.num_gpu, self.pooling) {
                    (0, _) => true,
                    (k, Pooling::Pooled) if k > 1 => {
                        self.servers.iter().map(|s| s.gpus.iter().filter(|g| ok(g)).count() as u32).sum::<u32>() >= k
                    }
                    _ => (0..n).any(on_one),
                };
                gpus && self.empty.iter().any(|h| h.holds(&need))
            }
        }
    }

    /// Why `pod` (a GPU pod that does not fit now, nodes as the trace ran)
    /// is kept out, with the free GPU share in all and on nodes whose host
    /// holds its CPU part.
    pub fn blocked(&self, pod: &Pod) -> (Blocked, u64, u64) {
        let need = need_of(pod);
        let (mut cpu, mut mem) = (false, false);
        let (mut free, mut free_ok) = (0u64, 0u64);
        for (si, s) in self.servers.iter().enumerate() {
            let f: u64 = s.gpus.iter().filter(|g| g.model_allowed(&pod.models)).map(|g| g.free_milli() as u64).sum();
            free += f;
            let h = &self.hosts[si];
            let (c_ok, m_ok) = (h.cpu_milli >= need.cpu_milli, h.memory >= need.memory);
            if c_ok && m_ok {
                free_ok += f;
            }
            if self.gpus_fit(pod, si) {
                if !c_ok {
                    cpu = true;
                } else if !m_ok {
                    mem = true;
                }
            }
        }
        let b = if cpu {
            Blocked::Cpu
        } else if mem {
            Blocked::Memory
        } else if free_ok >= pod.gpu_demand() {
            Blocked::Fragmented
        } else {
            Blocked::Full
        };
        (b, free, free_ok)
    }

    /// Could `pod`'s GPUs (all of them) come from server `si` now?
    fn gpus_fit(&self, pod: &Pod, si: usize) -> bool {
        let s = &self.servers[si];
        let ok = |g: &rgpu_pool_broker::inventory::Gpu| g.model_allowed(&pod.models);
        match pod.num_gpu {
            0 => true,
            1 if pod.gpu_milli < 1000 => s.gpus.iter().any(|g| ok(g) && g.free_milli() >= pod.gpu_milli),
            n => s.gpus.iter().filter(|g| ok(g) && g.is_free()).count() as u32 >= n,
        }
    }

    /// Could `pod` fit on node `si` now (host and GPUs)?
    pub fn fits_on(&self, pod: &Pod, si: usize) -> bool {
        if !self.hosts[si].holds(&need_of(pod)) {
            return false;
        }
        if si >= self.servers.len() {
            // A CPU-only node.
            return pod.num_gpu == 0;
        }
        self.gpus_fit(pod, si)
    }
}

/// A CPU-only pod: the node whose host fits, scored by the policy as a
/// host-only request (ties: the earlier node).
fn place_host_only(servers: &[Server], d: &Demand, policy: &dyn Policy, cx: &Context) -> Result<Placed, NoPlace> {
    policy.observe(d, cx);
    let mut best: Option<(i64, usize)> = None;
    let mut could_ever = false;
    for (si, s) in servers.iter().enumerate() {
        could_ever = true;
        if !cx.host_fits(si) {
            continue;
        }
        let u = Unit { scope: Scope::Node, free_whole: s.free_whole, gpus: s.gpus.len() as u32, servers: 1 };
        let score = policy.score_unit_in(cx, servers, &[si], &u, d);
        if best.is_none_or(|(b, _)| score > b) {
            best = Some((score, si));
        }
    }
    match best {
        Some((_, si)) => Ok(Placed { server: si, slots: Vec::new() }),
        None if could_ever => Err(NoPlace::Busy),
        None => Err(NoPlace::Impossible("no nodes".into())),
    }
}

/// A small seeded generator (splitmix64); the runs must not depend on a
/// crate's algorithm changing.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64 * n as f64) as usize
    }
}

/// The published workload, as the paper's simulator builds it
/// (`SortClusterPods` with `--shuffle-pod=true`, then
/// `TunePodsByNodeTotalResource`): every pod of the trace once, in a seeded
/// random order; then, while the GPU demand is below `ratio` x the cluster's
/// GPUs, pods drawn with replacement are appended, stopping before the one
/// that would pass the target; when the whole trace already asks for more,
/// random pods are dropped until it does not. Returns indices into `pods`
/// in arrival order.
pub fn sample(pods: &[Pod], capacity_milli: u64, ratio: f64, seed: u64) -> Vec<usize> {
    let want = capacity_milli as f64 * ratio;
    let mut rng = Rng::new(seed);
    if pods.is_empty() || pods.iter().all(|p| p.gpu_demand() == 0) {
        return Vec::new();
    }
    let mut order: Vec<usize> = (0..pods.len()).collect();
    for i in (1..order.len()).rev() {
        let j = rng.below(i + 1);
        order.swap(i, j);
    }
    let mut total: u64 = pods.iter().map(Pod::gpu_demand).sum();
    if total as f64 > want {
        while total as f64 > want && !order.is_empty() {
            let k = rng.below(order.len());
            total -= pods[order.remove(k)].gpu_demand();
        }
        return order;
    }
    loop {
        let i = rng.below(pods.len());
        if (total + pods[i].gpu_demand()) as f64 > want {
            break;
        }
        total += pods[i].gpu_demand();
        order.push(i);
    }
    order
}

/// One static run: allocation ratio (0..1) at each whole percent of arrived
/// demand, 0..=`max_pct`.
#[derive(Debug, Clone)]
pub struct StaticRun {
    pub ratio_at: Vec<f64>,
    pub placed: usize,
    pub failed: usize,
}

pub fn run_static(nodes: &[Node], pods: &[Pod], policy: &dyn Policy, seed: u64, max_pct: u32) -> StaticRun {
    run_static_in(Cluster::new(nodes), pods, policy, seed, max_pct)
}

/// [`run_static`] on a given cluster (the pooling experiment's).
pub fn run_static_in(mut c: Cluster, pods: &[Pod], policy: &dyn Policy, seed: u64, max_pct: u32) -> StaticRun {
    // As the broker tells it when servers register.
    policy.pool_changed(&c.servers);
    let order = sample(pods, c.capacity_milli, max_pct as f64 / 100.0, seed);
    let mut ratio_at = vec![0.0; max_pct as usize + 1];
    let mut next_pct = 1usize;
    let mut arrived = 0u64;
    let (mut placed, mut failed) = (0, 0);
    for (id, &i) in order.iter().enumerate() {
        let p = &pods[i];
        match c.place(p, id as u64, policy) {
            Ok(_) => placed += 1,
            Err(_) => failed += 1,
        }
        arrived += p.gpu_demand();
        while next_pct <= max_pct as usize && arrived * 100 >= c.capacity_milli * next_pct as u64 {
            ratio_at[next_pct] = c.allocation_ratio();
            next_pct += 1;
        }
    }
    for r in ratio_at.iter_mut().skip(next_pct) {
        *r = c.allocation_ratio();
    }
    StaticRun { ratio_at, placed, failed }
}

/// The dynamic replay's results.
#[derive(Debug, Clone, Default)]
pub struct DynamicRun {
    /// (time in seconds from the first creation, allocation ratio).
    pub timeline: Vec<(u64, f64)>,
    /// Time-weighted mean allocation ratio over the trace (from the first
    /// arrival to the last event, which a pod that started late moves).
    pub mean_ratio: f64,
    /// GPU time served, GPU-hours: what the mean ratio is not when the
    /// policies' last events differ.
    pub served_gpu_h: f64,
    pub gpu_pods: usize,
    pub started: usize,
    /// Queueing delay (start - creation), seconds, of GPU pods that started.
    pub delay_p50: u64,
    pub delay_p99: u64,
    /// The same over the pods that waited at all.
    pub waited_p50: u64,
    pub waited_p99: u64,
    pub delayed: usize,
    /// Could never fit (larger than any node).
    pub rejected: usize,
    /// GPU pods still queued when their trace deletion time passed (gave up).
    pub abandoned: usize,
    /// Their GPU demand, milli-GPUs.
    pub abandoned_gpu_milli: u64,
    /// CPU-only pods that gave up the same way.
    pub abandoned_cpu_only: usize,
    /// Time-weighted mean allocation while the offered demand (what would
    /// run if nothing waited) was at least the cluster's capacity; 0 if it
    /// never was.
    pub mean_ratio_overloaded: f64,
    /// Seconds the offered demand was at least the capacity.
    pub overloaded_s: u64,
    /// Why GPU pods that gave up could not start when they arrived, by size.
    pub why: Why,
}

/// What kept a GPU pod out when it arrived (the cluster's state then).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blocked {
    /// Some node had room for its GPUs but too little free CPU.
    Cpu,
    /// Some node had room for its GPUs and CPU, too little memory.
    Memory,
    /// No node had room for its GPUs, yet the free share of the models it
    /// may use, summed over nodes with room for its CPU and memory, was at
    /// least its demand (GPU fragmentation).
    Fragmented,
    /// Less GPU share free than it asks, where its CPU part fits: full.
    Full,
}

/// Size classes of GPU pods.
pub const SIZES: [&str; 4] = ["< 0.5 GPU", "0.5-0.99 GPU", "1 GPU", "2+ GPUs"];

fn size_class(p: &Pod) -> usize {
    match (p.num_gpu, p.gpu_milli) {
        (1, m) if m < 500 => 0,
        (1, m) if m < 1000 => 1,
        (1, _) => 2,
        _ => 3,
    }
}

/// Counts of GPU pods that gave up, by size class and [`Blocked`] reason,
/// with their summed traced durations (seconds).
#[derive(Debug, Clone, Default)]
pub struct Why {
    /// [size][reason: cpu, memory, fragmented, full]
    pub gave_up: [[u64; 4]; 4],
    /// Summed durations of those that gave up, per size.
    pub gave_up_dur_s: [u64; 4],
    /// GPU pods that started and those that gave up, per size.
    pub started: [u64; 4],
    /// Free GPU share (milli) summed over the arrivals that were blocked
    /// and later gave up, on all nodes and on nodes with room for the CPU part.
    pub free_milli_sum: u64,
    pub free_on_host_ok_sum: u64,
}

impl Why {
    fn reason_index(b: Blocked) -> usize {
        match b {
            Blocked::Cpu => 0,
            Blocked::Memory => 1,
            Blocked::Fragmented => 2,
            Blocked::Full => 3,
        }
    }
}

impl DynamicRun {
    fn give_up(&mut self, p: &Pod, why: Option<(Blocked, u64, u64)>, dur: u64) {
        if p.num_gpu == 0 {
            self.abandoned_cpu_only += 1;
        } else {
            self.abandoned += 1;
            self.abandoned_gpu_milli += p.gpu_demand();
            let k = size_class(p);
            if let Some((b, free, free_ok)) = why {
                self.why.gave_up[k][Why::reason_index(b)] += 1;
                self.why.free_milli_sum += free;
                self.why.free_on_host_ok_sum += free_ok;
            }
            self.why.gave_up_dur_s[k] += dur;
        }
    }
}

#[derive(PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Ev {
    // Ends before arrivals at the same second.
    End(usize),
    Arrive(usize),
}

/// Replays `pods` with their creation and deletion times: a pod that does not
/// fit waits (FIFO, any waiting pod that fits starts: backfill) and runs for
/// its traced duration once started; one that waits past its traced deletion
/// time gives up. `points` timeline samples.
pub fn run_dynamic(nodes: &[Node], pods: &[Pod], policy: &dyn Policy, points: usize) -> DynamicRun {
    run_dynamic_in(Cluster::new(nodes), pods, policy, points)
}

/// [`run_dynamic`] on a given cluster (the pooling experiment's).
pub fn run_dynamic_in(mut c: Cluster, pods: &[Pod], policy: &dyn Policy, points: usize) -> DynamicRun {
    policy.pool_changed(&c.servers);
    let t0 = pods.iter().map(|p| p.creation).min().unwrap_or(0);
    let t_end = pods.iter().map(|p| p.deletion.unwrap_or(p.creation)).max().unwrap_or(t0);
    let mut heap: BinaryHeap<Reverse<(u64, Ev)>> = pods.iter().enumerate().map(|(i, p)| Reverse((p.creation, Ev::Arrive(i)))).collect();
    let dur = |p: &Pod| p.deletion.unwrap_or(t_end).saturating_sub(p.scheduled.unwrap_or(p.creation).max(p.creation));
    let over = overloaded(pods, c.capacity_milli, |p| dur(p));
    let mut over_at = 0usize;
    let mut over_area = 0.0;
    let mut placed: HashMap<usize, Placed> = HashMap::new();
    let mut queue: VecDeque<usize> = VecDeque::new();
    let mut why_of: HashMap<usize, (Blocked, u64, u64)> = HashMap::new();
    let mut r = DynamicRun { gpu_pods: pods.iter().filter(|p| p.num_gpu > 0).count(), ..DynamicRun::default() };
    let mut delays: Vec<u64> = Vec::new();
    let step = ((t_end - t0) / points.max(1) as u64).max(1);
    let mut next_sample = t0;
    let (mut last_t, mut area) = (t0, 0.0);
    let start = |c: &mut Cluster, i: usize, now: u64, heap: &mut BinaryHeap<Reverse<(u64, Ev)>>, placed: &mut HashMap<usize, Placed>| -> Result<(), NoPlace> {
        let pl = c.place(&pods[i], i as u64, policy)?;
        placed.insert(i, pl);
        heap.push(Reverse((now + dur(&pods[i]), Ev::End(i))));
        Ok(())
    };
    while let Some(Reverse((now, ev))) = heap.pop() {
        area += c.allocation_ratio() * (now - last_t) as f64;
        over_area += c.allocation_ratio() * overlap(&over, &mut over_at, last_t, now) as f64;
        last_t = now;
        while next_sample <= now {
            r.timeline.push((next_sample - t0, c.allocation_ratio()));
            next_sample += step;
        }
        match ev {
            Ev::Arrive(i) => match start(&mut c, i, now, &mut heap, &mut placed) {
                Ok(()) => {
                    if pods[i].num_gpu > 0 {
                        r.started += 1;
                        r.why.started[size_class(&pods[i])] += 1;
                        delays.push(0);
                    }
                }
                Err(NoPlace::Impossible(_)) => r.rejected += 1,
                Err(NoPlace::Busy) => {
                    if c.could_ever(&pods[i]) {
                        if pods[i].num_gpu > 0 && c.pooling == Pooling::Node {
                            why_of.insert(i, c.blocked(&pods[i]));
                        }
                        queue.push_back(i);
                    } else {
                        r.rejected += 1;
                    }
                }
            },
            Ev::End(i) => {
                let Some(pl) = placed.remove(&i) else { continue };
                c.release(&pods[i], i as u64, &pl);
                // Only what was freed can let a waiting pod in now.
                let mut k = 0;
                while k < queue.len() {
                    let q = queue[k];
                    if pods[q].deletion.is_some_and(|d| d < now) {
                        queue.remove(k);
                        r.give_up(&pods[q], why_of.remove(&q), dur(&pods[q]));
                        continue;
                    }
                    if c.may_fit_after(&pods[q], &pl) && start(&mut c, q, now, &mut heap, &mut placed).is_ok() {
                        queue.remove(k);
                        why_of.remove(&q);
                        if pods[q].num_gpu > 0 {
                            r.started += 1;
                            r.why.started[size_class(&pods[q])] += 1;
                            delays.push(now - pods[q].creation);
                        }
                        continue;
                    }
                    k += 1;
                }
            }
        }
    }
    for &q in &queue {
        r.give_up(&pods[q], why_of.remove(&q), dur(&pods[q]));
    }
    r.served_gpu_h = area * c.capacity_milli as f64 / 1000.0 / 3600.0;
    r.mean_ratio = if last_t > t0 { area / (last_t - t0) as f64 } else { c.allocation_ratio() };
    r.overloaded_s = over.iter().map(|(a, b)| b - a).sum();
    r.mean_ratio_overloaded = if r.overloaded_s > 0 { over_area / r.overloaded_s as f64 } else { 0.0 };
    r.delayed = delays.iter().filter(|&&d| d > 0).count();
    delays.sort_unstable();
    let pct = |q: f64| if delays.is_empty() { 0 } else { delays[((delays.len() - 1) as f64 * q).round() as usize] };
    r.delay_p50 = pct(0.50);
    r.delay_p99 = pct(0.99);
    let waited: Vec<u64> = delays.iter().copied().filter(|&d| d > 0).collect();
    let wpct = |q: f64| if waited.is_empty() { 0 } else { waited[((waited.len() - 1) as f64 * q).round() as usize] };
    r.waited_p50 = wpct(0.50);
    r.waited_p99 = wpct(0.99);
    r
}

/// The time intervals (sorted, disjoint) during which the pods' offered
/// demand, each from its creation for `dur`, is at least `capacity_milli`.
fn overloaded(pods: &[Pod], capacity_milli: u64, dur: impl Fn(&Pod) -> u64) -> Vec<(u64, u64)> {
    let (mut out, mut start) = (Vec::new(), None);
    for (t, level) in demand_steps(pods, |p| p.creation + dur(p)) {
        match (start, level >= capacity_milli as i64) {
            (None, true) => start = Some(t),
            (Some(s), false) => {
                out.push((s, t));
                start = None;
            }
            _ => {}
        }
    }
    out
}

/// The GPU demand (milli) of `pods` running from creation to `end`, as
/// (time, demand from then on) at every time it changes.
fn demand_steps(pods: &[Pod], end: impl Fn(&Pod) -> u64) -> Vec<(u64, i64)> {
    let mut ev: Vec<(u64, i64)> = Vec::with_capacity(2 * pods.len());
    for p in pods {
        let g = p.gpu_demand() as i64;
        if g > 0 {
            ev.push((p.creation, g));
            ev.push((end(p).max(p.creation), -g));
        }
    }
    ev.sort_unstable();
    let mut steps: Vec<(u64, i64)> = Vec::new();
    let mut cur = 0i64;
    for (t, g) in ev {
        cur += g;
        match steps.last_mut() {
            Some(last) if last.0 == t => last.1 = cur,
            _ => steps.push((t, cur)),
        }
    }
    steps
}

/// Seconds of [a, b) inside `intervals`; `at` advances (calls go forward in time).
fn overlap(intervals: &[(u64, u64)], at: &mut usize, a: u64, b: u64) -> u64 {
    while *at < intervals.len() && intervals[*at].1 <= a {
        *at += 1;
    }
    let mut sum = 0;
    let mut k = *at;
    while k < intervals.len() && intervals[k].0 < b {
        sum += intervals[k].1.min(b).saturating_sub(intervals[k].0.max(a));
        k += 1;
    }
    sum
}

/// `copies` of the pod list laid over each other, copy `j` shifted later
/// by a seeded offset under one day so copies do not arrive in lockstep:
/// the openb file is a sample (8,152 pods, at most 66 GPUs' demand at once
/// on a 6,212-GPU cluster), and only a load like several tenants running it
/// together makes the replay tell policies apart.
pub fn overlay(pods: &[Pod], copies: usize, seed: u64) -> Vec<Pod> {
    let mut rng = Rng::new(seed ^ 0x0ff5_e7);
    let mut out = Vec::with_capacity(pods.len() * copies);
    for j in 0..copies {
        let shift = if j == 0 { 0 } else { rng.next() % 86_400 };
        for p in pods {
            let mut q = p.clone();
            q.name = format!("{}#{j}", p.name);
            q.creation += shift;
            q.deletion = p.deletion.map(|d| d + shift);
            q.scheduled = p.scheduled.map(|s| s + shift);
            out.push(q);
        }
    }
    out
}

/// The largest GPU demand (milli) of `pods` running at once at their
/// traced times.
pub fn peak_demand(pods: &[Pod]) -> u64 {
    let t_end = pods.iter().map(|p| p.deletion.unwrap_or(p.creation)).max().unwrap_or(0);
    demand_steps(pods, |p| p.deletion.unwrap_or(t_end)).iter().map(|s| s.1).max().unwrap_or(0).max(0) as u64
}

/// Would `pod` fit on `node` with nothing else on it?
pub fn fits_empty(node: &Node, pod: &Pod) -> bool {
    let model_ok = pod.models.is_empty() || pod.models.iter().any(|m| m.eq_ignore_ascii_case(&node.model));
    pod.cpu_milli <= node.cpu_milli
        && pod.memory_mib <= node.memory_mib
        && (pod.num_gpu == 0 || (model_ok && pod.num_gpu <= node.gpus))
}
