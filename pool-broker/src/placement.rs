//! Placement: where a lease goes. Pure: the servers and a demand in, slots
//! (server index, GPU index) out; nothing is changed. The same functions
//! serve the running broker and any offline driver (a trace simulator).
//!
//! Scoring is pluggable ([`Policy`]); the first policy, [`FragmentationAware`],
//! packs fractional leases onto GPUs that are already shared (so whole GPUs
//! stay free) and keeps a multi-GPU lease within the smallest topology unit
//! (node, then leaf, then spine) that can hold it, choosing among units the
//! tightest fit so large free units stay whole.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::inventory::{Gpu, Server, WHOLE_MILLI};

// A [`Demand`] names one; re-exported so placement's callers (the
// simulator) find it beside the demand.
pub use crate::inventory::Scope;

/// The unit sizes tried, smallest first, for a constraint.
fn levels(scope: Scope, required: bool) -> &'static [Scope] {
    const ALL: &[Scope] = &[Scope::Node, Scope::Leaf, Scope::Spine, Scope::Any];
    match (scope, required) {
        (Scope::Node, true) => &ALL[..1],
        (Scope::Leaf, true) => &ALL[..2],
        (Scope::Spine, true) => &ALL[..3],
        _ => ALL,
    }
}

/// What a lease asks of the pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Demand {
    /// Whole GPUs; 0 means a fraction of one GPU (`memory`, `compute_milli`).
    pub gpus: u32,
    pub memory: u64,
    pub compute_milli: u32,
    /// Allowed models (case-insensitive); empty: any.
    pub models: Vec<String>,
    pub scope: Scope,
    pub scope_required: bool,
}

impl Demand {
    pub fn is_fraction(&self) -> bool {
        self.gpus == 0
    }

    /// Memory and compute one GPU of this demand takes from `gpu`.
    pub fn take_from(&self, gpu: &Gpu) -> (u64, u32) {
        if self.is_fraction() {
            (self.memory, self.compute_milli)
        } else {
            (gpu.spec.memory, WHOLE_MILLI)
        }
    }
}

/// (server index, GPU index within the server).
pub type Slot = (usize, usize);

/// A topology unit considered for a whole-GPU demand.
#[derive(Debug, Clone, Copy)]
pub struct Unit {
    pub scope: Scope,
    /// Eligible free whole GPUs in the unit.
    pub free_whole: u32,
    /// Eligible GPUs in the unit, free or not.
    pub gpus: u32,
    pub servers: u32,
}

/// A placement policy scores candidates; higher is better, ties go to the
/// earlier candidate (server order), so placement is deterministic.
pub trait Policy: Send + Sync {
    fn name(&self) -> &'static str;
    /// A GPU that can hold the fractional `demand`.
    fn score_gpu(&self, server: &Server, gpu: &Gpu, demand: &Demand) -> i64;
    /// A unit with at least `demand.gpus` free whole GPUs.
    fn score_unit(&self, unit: &Unit, demand: &Demand) -> i64;

    /// Called once per [`place_in`] before any scoring: a policy that learns
    /// the distribution of requests (as fragmentation measures need) does it
    /// here. Default: nothing.
    fn observe(&self, _demand: &Demand, _cx: &Context) {}
    /// [`Policy::score_gpu`] with the caller's context and indices (GPU `gi`
    /// of `servers`' `si`). Default: `score_gpu`.
    fn score_gpu_in(&self, _cx: &Context, _si: usize, server: &Server, gi: usize, demand: &Demand) -> i64 {
        self.score_gpu(server, &server.gpus[gi], demand)
    }
    /// [`Policy::score_unit`] with the caller's context and the unit's
    /// servers (`members`, indices into `servers`). Default: `score_unit`.
    fn score_unit_in(&self, _cx: &Context, _servers: &[Server], _members: &[usize], unit: &Unit, demand: &Demand) -> i64 {
        self.score_unit(unit, demand)
    }
    /// True when two GPUs of one server in the same state (free compute and
    /// memory, model, health) always score the same, so [`place_in`] may
    /// score the first of them only. Default: false (a policy may tell
    /// equal GPUs apart, e.g. at random).
    fn equal_gpus_score_equal(&self) -> bool {
        false
    }
}

/// Host resources (CPU, memory) beside the GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Host {
    pub cpu_milli: u64,
    /// Bytes.
    pub memory: u64,
}

impl Host {
    pub fn holds(&self, need: &Host) -> bool {
        need.cpu_milli <= self.cpu_milli && need.memory <= self.memory
    }
}

/// What a caller knows beyond the servers and the demand. The broker does not
/// track host resources and passes the default (empty); an offline driver
/// (the trace simulator) does, and placement then also requires them to fit.
#[derive(Debug, Clone, Copy, Default)]
pub struct Context<'a> {
    /// Free host resources per server, same indices as `servers`; empty: not tracked.
    pub hosts: &'a [Host],
    /// Host resources the demand needs on the server it lands on.
    pub need: Host,
}

impl Context<'_> {
    /// Can server `si`'s host take the demand's host needs?
    pub fn host_fits(&self, si: usize) -> bool {
        self.hosts.get(si).is_none_or(|h| h.holds(&self.need))
    }
}

/// Packs fractions onto shared GPUs (best fit by memory left), then onto the
/// server with the fewest free whole GPUs; whole GPUs go to the unit where
/// the fewest free GPUs remain.
#[derive(Debug, Default, Clone, Copy)]
pub struct FragmentationAware;

impl Policy for FragmentationAware {
    fn name(&self) -> &'static str {
        "fragmentation-aware"
    }

    fn score_gpu(&self, server: &Server, gpu: &Gpu, demand: &Demand) -> i64 {
        let left = (gpu.free_memory().saturating_sub(demand.memory) >> 20) as i64;
        if !gpu.is_free() {
            // Already shared: always better than breaking a whole GPU.
            (1i64 << 50) - left
        } else {
            -(server.free_whole as i64) * (1 << 30) - left
        }
    }

    fn score_unit(&self, unit: &Unit, demand: &Demand) -> i64 {
        -((unit.free_whole - demand.gpus) as i64)
    }
}

/// Why nothing could be placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoPlace {
    /// Not now; it could fit once leases end.
    Busy,
    /// Never: too few eligible GPUs exist at all (or none big enough).
    Impossible(String),
}

/// Places `demand` on `servers` where `eligible` allows, by `policy`.
pub fn place(
    servers: &[Server],
    demand: &Demand,
    eligible: &dyn Fn(&Server) -> bool,
    policy: &dyn Policy,
) -> Result<Vec<Slot>, NoPlace> {
    place_in(servers, demand, eligible, policy, &Context::default())
}

/// [`place`] with the caller's [`Context`]: servers whose host cannot take
/// `cx.need` are busy.
pub fn place_in(
    servers: &[Server],
    demand: &Demand,
    eligible: &dyn Fn(&Server) -> bool,
    policy: &dyn Policy,
    cx: &Context,
) -> Result<Vec<Slot>, NoPlace> {
    policy.observe(demand, cx);
    if demand.is_fraction() {
        place_fraction(servers, demand, eligible, policy, cx)
    } else {
        place_whole(servers, demand, eligible, policy, cx)
    }
}

fn gpu_ok(g: &Gpu, d: &Demand) -> bool {
    g.spec.healthy && g.model_allowed(&d.models)
}

fn place_fraction(
    servers: &[Server],
    d: &Demand,
    eligible: &dyn Fn(&Server) -> bool,
    policy: &dyn Policy,
    cx: &Context,
) -> Result<Vec<Slot>, NoPlace> {
    let mut best: Option<(i64, Slot)> = None;
    let mut could_ever = false;
    for (si, s) in servers.iter().enumerate() {
        if !eligible(s) {
            continue;
        }
        let dedupe = policy.equal_gpus_score_equal();
        for (gi, g) in s.gpus.iter().enumerate() {
            if !gpu_ok(g, d) || g.spec.memory < d.memory {
                continue;
            }
            could_ever = true;
            if !s.schedulable() || !g.fits_fraction(d.memory, d.compute_milli) || !cx.host_fits(si) {
                continue;
            }
            // An earlier GPU of this server in the same state scored the
            // same and wins ties: skip (FGD's measure costs a pass per GPU).
            if dedupe && s.gpus[..gi].iter().any(|h| same_state(g, h) && gpu_ok(h, d)) {
                continue;
            }
            let score = policy.score_gpu_in(cx, si, s, gi, d);
            if best.is_none_or(|(b, _)| score > b) {
                best = Some((score, (si, gi)));
            }
        }
    }
    match best {
        Some((_, slot)) => Ok(vec![slot]),
        None if could_ever => Err(NoPlace::Busy),
        None => Err(NoPlace::Impossible(format!(
            "no GPU in the tenant's partitions{} has {} MiB of memory",
            models_note(d),
            d.memory >> 20
        ))),
    }
}

fn same_state(a: &Gpu, b: &Gpu) -> bool {
    a.free_milli() == b.free_milli()
        && a.free_memory() == b.free_memory()
        && a.spec.memory == b.spec.memory
        && a.spec.healthy == b.spec.healthy
        && a.spec.model == b.spec.model
}

fn models_note(d: &Demand) -> String {
    if d.models.is_empty() {
        String::new()
    } else {
        format!(" of model {}", d.models.join("|"))
    }
}

/// Eligible free whole GPUs of a server and its eligible GPUs.
fn counts(s: &Server, d: &Demand) -> (u32, u32) {
    if d.models.is_empty() {
        let healthy = s.gpus.iter().filter(|g| g.spec.healthy).count() as u32;
        return (if s.schedulable() { s.free_whole } else { 0 }, healthy);
    }
    let mut free = 0;
    let mut all = 0;
    for g in &s.gpus {
        if gpu_ok(g, d) {
            all += 1;
            if g.is_free() && s.schedulable() {
                free += 1;
            }
        }
    }
    (free, all)
}

fn place_whole(
    servers: &[Server],
    d: &Demand,
    eligible: &dyn Fn(&Server) -> bool,
    policy: &dyn Policy,
    cx: &Context,
) -> Result<Vec<Slot>, NoPlace> {
    let n = d.gpus;
    // Per eligible server: (index, free, all).
    let mut cand: Vec<(usize, u32, u32)> = Vec::new();
    let mut total = 0u32;
    let mut biggest = HashMap::<(Scope, &str), u32>::new();
    for (si, s) in servers.iter().enumerate() {
        if !eligible(s) {
            continue;
        }
        let (free, all) = counts(s, d);
        total += all;
        if d.scope_required && d.scope != Scope::Any {
            *biggest.entry((d.scope, s.unit_key(d.scope))).or_default() += all;
        }
        if free > 0 && cx.host_fits(si) {
            cand.push((si, free, all));
        }
    }
    let max_unit = if d.scope_required && d.scope != Scope::Any {
        biggest.values().copied().max().unwrap_or(0)
    } else {
        total
    };
    if max_unit < n {
        return Err(NoPlace::Impossible(format!(
            "{n} GPU(s){} requested{}, but the largest eligible {} has {max_unit}",
            models_note(d),
            if d.scope_required { format!(" within one {}", d.scope.name()) } else { String::new() },
            if d.scope_required && d.scope != Scope::Any { d.scope.name() } else { "pool" },
        )));
    }
    for &level in levels(d.scope, d.scope_required) {
        let chosen: Option<Vec<usize>> = if n == 1 || (level == Scope::Node && single_server_nodes(servers, &cand)) {
            // Each server is its own unit.
            let mut best: Option<(i64, usize)> = None;
            for &(si, free, all) in &cand {
                if free < n {
                    continue;
                }
                let u = Unit { scope: level, free_whole: free, gpus: all, servers: 1 };
                let score = policy.score_unit_in(cx, servers, &[si], &u, d);
                if best.is_none_or(|(b, _)| score > b) {
                    best = Some((score, si));
                }
            }
            best.map(|(_, si)| vec![si])
        } else {
            let mut units: Vec<(&str, Unit, Vec<usize>)> = Vec::new();
            let mut at: HashMap<&str, usize> = HashMap::new();
            for &(si, free, all) in &cand {
                let key = servers[si].unit_key(level);
                let i = *at.entry(key).or_insert_with(|| {
                    units.push((key, Unit { scope: level, free_whole: 0, gpus: 0, servers: 0 }, Vec::new()));
                    units.len() - 1
                });
                let u = &mut units[i];
                u.1.free_whole += free;
                u.1.gpus += all;
                u.1.servers += 1;
                u.2.push(si);
            }
            let mut best: Option<(i64, usize)> = None;
            for (i, (_, u, members)) in units.iter().enumerate() {
                if u.free_whole < n {
                    continue;
                }
                let score = policy.score_unit_in(cx, servers, members, u, d);
                if best.is_none_or(|(b, _)| score > b) {
                    best = Some((score, i));
                }
            }
            best.map(|(_, i)| std::mem::take(&mut units[i].2))
        };
        if let Some(mut members) = chosen {
            // Fewest servers: the fullest-free first.
            let free_of = |si: usize| cand.iter().find(|c| c.0 == si).map_or(0, |c| c.1);
            members.sort_by_key(|&si| (std::cmp::Reverse(free_of(si)), si));
            let mut slots = Vec::with_capacity(n as usize);
            'outer: for si in members {
                for (gi, g) in servers[si].gpus.iter().enumerate() {
                    if gpu_ok(g, d) && g.is_free() {
                        slots.push((si, gi));
                        if slots.len() == n as usize {
                            break 'outer;
                        }
                    }
                }
            }
            if slots.len() == n as usize {
                return Ok(slots);
            }
        }
    }
    Err(NoPlace::Busy)
}

/// True when no two candidate servers share a node label (the common case:
/// one rgpu-server per host), so node units need no grouping.
fn single_server_nodes(servers: &[Server], cand: &[(usize, u32, u32)]) -> bool {
    if cand.len() > 64 {
        // Grouping is cheap relative to the check at this size; group.
        return false;
    }
    let mut seen = std::collections::HashSet::new();
    cand.iter().all(|&(si, _, _)| seen.insert(servers[si].spec.node.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::{GpuSpec, ServerSpec};

    pub(crate) fn server(id: &str, node: &str, leaf: &str, gpus: u32) -> Server {
        let spec = ServerSpec {
            id: id.into(),
            node: node.into(),
            leaf: leaf.into(),
            spine: "s0".into(),
            partitions: vec!["default".into()],
            gpus: (0..gpus)
                .map(|i| GpuSpec {
                    uuid: [id.len() as u8, i as u8, id.as_bytes()[id.len() - 1], 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
                    ordinal: i,
                    model: "H100".into(),
                    memory: 80 << 30,
                    sms: 132,
                    healthy: true,
                })
                .collect(),
            transports: Vec::new(),
        };
        Server::new(spec, 0)
    }

    fn take(s: &mut [Server], slots: &[Slot], d: &Demand, id: u64) {
        for &(si, gi) in slots {
            let g = &mut s[si].gpus[gi];
            let (m, c) = d.take_from(g);
            g.used_memory += m;
            g.used_milli += c;
            g.holders.push(id);
            s[si].recount();
        }
    }

    fn all(_: &Server) -> bool {
        true
    }

    #[test]
    fn fractions_pack_onto_shared_gpus() {
        let mut s = vec![server("a", "n1", "l1", 2), server("b", "n2", "l1", 1)];
        let d = Demand { memory: 20 << 30, ..Demand::default() };
        let p = place(&s, &d, &all, &FragmentationAware).unwrap();
        // The server with fewest free GPUs first: b.
        assert_eq!(p, vec![(1, 0)]);
        take(&mut s, &p, &d, 1);
        for id in 2..=4 {
            let p = place(&s, &d, &all, &FragmentationAware).unwrap();
            assert_eq!(p, vec![(1, 0)], "fraction {id} joins the shared GPU");
            take(&mut s, &p, &d, id);
        }
        // b's GPU is full (4 x 20 GiB); the next breaks one of a's.
        let p = place(&s, &d, &all, &FragmentationAware).unwrap();
        assert_eq!(p[0].0, 0);
        let huge = Demand { memory: 81 << 30, ..Demand::default() };
        assert!(matches!(place(&s, &huge, &all, &FragmentationAware), Err(NoPlace::Impossible(_))));
    }

    #[test]
    fn multi_gpu_stays_in_smallest_unit() {
        let mut s = vec![
            server("a", "n1", "l1", 4),
            server("b", "n2", "l1", 2),
            server("c", "n3", "l2", 2),
            server("d", "n4", "l2", 1),
        ];
        // 2 GPUs: a node with exactly 2 free (tightest) rather than the 4-GPU one.
        let d2 = Demand { gpus: 2, ..Demand::default() };
        let p = place(&s, &d2, &all, &FragmentationAware).unwrap();
        assert!(p.iter().all(|&(si, _)| si == 1), "{p:?}");
        take(&mut s, &p, &d2, 1);
        // 3 GPUs: node a has 4.
        let d3 = Demand { gpus: 3, ..Demand::default() };
        let p = place(&s, &d3, &all, &FragmentationAware).unwrap();
        assert!(p.iter().all(|&(si, _)| si == 0));
        take(&mut s, &p, &d3, 2);
        // 3 more: no node has 3, leaf l2 has c(2)+d(1).
        let p = place(&s, &d3, &all, &FragmentationAware).unwrap();
        assert!(p.iter().all(|&(si, _)| si == 2 || si == 3), "{p:?}");
        take(&mut s, &p, &d3, 3);
        // 1 left on a; 2 within one node required: impossible now, not ever.
        let node2 = Demand { gpus: 2, scope: Scope::Node, scope_required: true, ..Demand::default() };
        assert_eq!(place(&s, &node2, &all, &FragmentationAware), Err(NoPlace::Busy));
        let node5 = Demand { gpus: 5, scope: Scope::Node, scope_required: true, ..Demand::default() };
        assert!(matches!(place(&s, &node5, &all, &FragmentationAware), Err(NoPlace::Impossible(_))));
    }

    #[test]
    fn host_context_makes_servers_busy() {
        let s = vec![server("a", "n1", "l1", 2), server("b", "n2", "l1", 2)];
        let hosts = [Host { cpu_milli: 1000, memory: 1 << 30 }, Host { cpu_milli: 8000, memory: 8 << 30 }];
        let cx = Context { hosts: &hosts, need: Host { cpu_milli: 4000, memory: 2 << 30 } };
        let frac = Demand { memory: 1 << 30, ..Demand::default() };
        assert_eq!(place_in(&s, &frac, &all, &FragmentationAware, &cx), Ok(vec![(1, 0)]));
        let whole = Demand { gpus: 2, ..Demand::default() };
        assert_eq!(place_in(&s, &whole, &all, &FragmentationAware, &cx), Ok(vec![(1, 0), (1, 1)]));
        let none = [Host::default(), Host::default()];
        let cx = Context { hosts: &none, ..cx };
        assert_eq!(place_in(&s, &frac, &all, &FragmentationAware, &cx), Err(NoPlace::Busy));
        assert_eq!(place_in(&s, &whole, &all, &FragmentationAware, &cx), Err(NoPlace::Busy));
    }

    #[test]
    fn models_drain_and_eligibility() {
        let mut s = vec![server("a", "n1", "l1", 2), server("b", "n2", "l1", 2)];
        s[0].gpus[0].spec.model = "A100".into();
        s[0].recount();
        let d = Demand { gpus: 1, models: vec!["a100".into()], ..Demand::default() };
        assert_eq!(place(&s, &d, &all, &FragmentationAware), Ok(vec![(0, 0)]));
        s[0].drain = Some(crate::inventory::Drain { since: 0, deadline: None, for_shutdown: false });
        assert_eq!(place(&s, &d, &all, &FragmentationAware), Err(NoPlace::Busy));
        let only_b = |x: &Server| x.spec.id == "b";
        assert!(matches!(place(&s, &d, &only_b, &FragmentationAware), Err(NoPlace::Impossible(_))));
    }
}
