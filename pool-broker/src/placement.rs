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
use std::hash::{BuildHasherDefault, Hasher};

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
    /// `Some(e)`: while this stays `e`, a server's scores are a function of
    /// the server's state, the demand and the context only, so a
    /// [`ScoreCache`] may keep them until the server changes. `None` (the
    /// default): scores may change between calls (a random policy), nothing
    /// is kept. Read after [`Policy::observe`].
    fn score_epoch(&self) -> Option<u64> {
        None
    }
    /// The pool's servers after one registered, changed its GPUs or was
    /// restored: a policy that weighs the pool as a whole (how many GPUs of
    /// each model) counts it here, not on every placement. Default:
    /// nothing.
    fn pool_changed(&self, _servers: &[Server]) {}
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

    fn score_epoch(&self) -> Option<u64> {
        Some(0)
    }
}

/// Servers' scores kept between placements, for [`place_cached`]: a server
/// is scored again only when it changed ([`Server::version`]) or its
/// policy's scores did ([`Policy::score_epoch`]), so a grant rescores the
/// one or two servers the last grants and releases touched instead of all
/// of them (FGD's measure costs a pass over the workload's shapes per GPU
/// state). One cache serves one policy and one list of servers. Not used
/// when the context tracks hosts (their CPU changes without a version).
#[derive(Debug, Default)]
pub struct ScoreCache {
    epoch: Option<u64>,
    by_demand: HashMap<CacheKey, Vec<Cached>>,
    /// Multi-server units (gangs): score by [`members_print`].
    by_unit: HashMap<CacheKey, HashMap<u64, i64>>,
}

/// Unit scores kept per demand; past this (units that changed leave stale
/// entries behind) that demand's start over.
const CACHE_UNITS: usize = 1 << 14;

/// Distinct demands kept at once (each holds one entry per server); a
/// tenant may send any demand, so past this the cache starts over.
const CACHE_DEMANDS: usize = 32;

/// What a server's score depends on beyond the server: the demand (its host
/// needs are not tracked here) and, for whole GPUs, the unit level.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct CacheKey {
    gpus: u32,
    memory: u64,
    compute_milli: u32,
    models: Vec<String>,
    scope: u8,
    scope_required: bool,
    level: u8,
}

#[derive(Debug, Clone, Copy, Default)]
struct Cached {
    /// The server's version when scored; 0: nothing kept.
    version: u64,
    score: i64,
    /// Fractions: the best GPU; `NO_GPU` when none fits now.
    gi: usize,
    /// Fractions: some GPU of the server could ever hold the demand.
    could_ever: bool,
}

const NO_GPU: usize = usize::MAX;

impl ScoreCache {
    pub fn new() -> ScoreCache {
        ScoreCache::default()
    }

    /// Empties the cache when the policy's scores changed; false when they
    /// may not be kept at all.
    fn current(&mut self, policy: &dyn Policy) -> bool {
        let Some(epoch) = policy.score_epoch() else { return false };
        if self.epoch != Some(epoch) {
            self.by_demand.clear();
            self.by_unit.clear();
            self.epoch = Some(epoch);
        }
        true
    }

    /// Unit scores for `d` at `level`.
    fn units(&mut self, policy: &dyn Policy, d: &Demand, level: u8) -> Option<&mut HashMap<u64, i64>> {
        if !self.current(policy) {
            return None;
        }
        let key = CacheKey::of(d, level);
        if !self.by_unit.contains_key(&key) && self.by_unit.len() >= CACHE_DEMANDS {
            self.by_unit.clear();
        }
        let m = self.by_unit.entry(key).or_default();
        if m.len() >= CACHE_UNITS {
            m.clear();
        }
        Some(m)
    }

    /// The entries for `d` at `level`, sized for `n` servers; None when the
    /// policy's scores may not be kept.
    fn entries(&mut self, policy: &dyn Policy, d: &Demand, level: u8, n: usize) -> Option<&mut Vec<Cached>> {
        if !self.current(policy) {
            return None;
        }
        let key = CacheKey::of(d, level);
        if !self.by_demand.contains_key(&key) && self.by_demand.len() >= CACHE_DEMANDS {
            self.by_demand.clear();
        }
        let v = self.by_demand.entry(key).or_default();
        if v.len() < n {
            v.resize(n, Cached::default());
        }
        Some(v)
    }
}

impl CacheKey {
    fn of(d: &Demand, level: u8) -> CacheKey {
        CacheKey {
            gpus: d.gpus,
            memory: d.memory,
            compute_milli: d.compute_milli,
            models: d.models.clone(),
            scope: level_code(d.scope),
            scope_required: d.scope_required,
            level,
        }
    }
}

/// Grouping servers into units by label runs over every server on each
/// multi-server placement (a gang): a cheap hash instead of SipHash, whose
/// flood resistance buys nothing for labels registered servers chose
/// (a label is bounded and a collision costs time, never a wrong answer).
type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<Fnv>>;

#[derive(Default)]
struct Fnv(u64);

impl Hasher for Fnv {
    fn finish(&self) -> u64 {
        mix64(self.0)
    }
    fn write(&mut self, bytes: &[u8]) {
        let mut h = self.0 ^ 0xcbf2_9ce4_8422_2325;
        for &b in bytes {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
        self.0 = h;
    }
}

/// A unit's members as a cache key: their indices and versions (a version
/// is unique across servers, so two states never share one).
fn members_print(servers: &[Server], members: &[usize]) -> u64 {
    let mut h = 0x6a09_e667_f3bc_c908u64 ^ members.len() as u64;
    for &si in members {
        h = mix64(h ^ servers[si].version);
        h = mix64(h ^ si as u64);
    }
    h
}

fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn level_code(level: Scope) -> u8 {
    match level {
        Scope::Node => 0,
        Scope::Leaf => 1,
        Scope::Spine => 2,
        Scope::Any => 3,
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
    place_with(servers, demand, eligible, policy, cx, None, None)
}

/// [`place`] keeping servers' scores in `cache` between calls: the same
/// answer as `place`, computed only for servers that changed since (see
/// [`ScoreCache`]). The broker's path.
pub fn place_cached(
    servers: &[Server],
    demand: &Demand,
    eligible: &dyn Fn(&Server) -> bool,
    policy: &dyn Policy,
    cache: &mut ScoreCache,
) -> Result<Vec<Slot>, NoPlace> {
    place_with(servers, demand, eligible, policy, &Context::default(), Some(cache), None)
}

/// What the fabric adds to placement (`crate::fabric`): whether a server's
/// links can carry the demand now, and, only between candidates the policy
/// scores the same, which is freer. Scores are never changed by it, so the
/// policy's choice stays as good by its own measure.
pub trait Links {
    /// Can server `si` take the demand's bandwidth now? (A server that
    /// cannot is busy, as one whose host is full.)
    fn fits(&self, si: usize) -> bool;
    /// Free bandwidth of the unit of servers `members`: among equal scores
    /// the higher wins (then the earlier, as without it).
    fn headroom(&self, members: &[usize]) -> u128;
}

/// [`place_cached`] with the fabric's say ([`Links`]): the broker's path.
pub fn place_cached_on(
    servers: &[Server],
    demand: &Demand,
    eligible: &dyn Fn(&Server) -> bool,
    policy: &dyn Policy,
    cache: &mut ScoreCache,
    links: &dyn Links,
) -> Result<Vec<Slot>, NoPlace> {
    place_with(servers, demand, eligible, policy, &Context::default(), Some(cache), Some(links))
}

fn links_fit(links: Option<&dyn Links>, si: usize) -> bool {
    links.is_none_or(|l| l.fits(si))
}

/// Whether `a` wins a tie of scores against `b` (the earlier candidate).
fn freer(links: Option<&dyn Links>, a: &[usize], b: &[usize]) -> bool {
    links.is_some_and(|l| l.headroom(a) > l.headroom(b))
}

fn place_with(
    servers: &[Server],
    demand: &Demand,
    eligible: &dyn Fn(&Server) -> bool,
    policy: &dyn Policy,
    cx: &Context,
    cache: Option<&mut ScoreCache>,
    links: Option<&dyn Links>,
) -> Result<Vec<Slot>, NoPlace> {
    policy.observe(demand, cx);
    // Host resources change without a server version: keep nothing.
    let cache = if cx.hosts.is_empty() { cache } else { None };
    if demand.is_fraction() {
        place_fraction(servers, demand, eligible, policy, cx, cache, links)
    } else {
        place_whole(servers, demand, eligible, policy, cx, cache, links)
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
    cache: Option<&mut ScoreCache>,
    links: Option<&dyn Links>,
) -> Result<Vec<Slot>, NoPlace> {
    let mut entries = cache.and_then(|c| c.entries(policy, d, u8::MAX, servers.len()));
    let mut best: Option<(i64, Slot)> = None;
    let mut could_ever = false;
    for (si, s) in servers.iter().enumerate() {
        if !eligible(s) {
            continue;
        }
        let e = match entries.as_deref_mut() {
            Some(v) if v[si].version == s.version => v[si],
            Some(v) => {
                v[si] = best_gpu(si, s, d, policy, cx);
                v[si]
            }
            None => best_gpu(si, s, d, policy, cx),
        };
        could_ever |= e.could_ever;
        // Whether new leases may land (reachable, drained) and host room are
        // not part of the server's version: checked every time.
        if e.gi == NO_GPU || !s.schedulable() || !cx.host_fits(si) || !links_fit(links, si) {
            continue;
        }
        if best.is_none_or(|(b, (bs, _))| e.score > b || (e.score == b && freer(links, &[si], &[bs]))) {
            best = Some((e.score, (si, e.gi)));
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

/// The best GPU of server `si` for the fraction `d` (the first of equals),
/// whatever the server's schedulability and host room.
fn best_gpu(si: usize, s: &Server, d: &Demand, policy: &dyn Policy, cx: &Context) -> Cached {
    let mut out = Cached { version: s.version, score: i64::MIN, gi: NO_GPU, could_ever: false };
    let dedupe = policy.equal_gpus_score_equal();
    for (gi, g) in s.gpus.iter().enumerate() {
        if !gpu_ok(g, d) || g.spec.memory < d.memory {
            continue;
        }
        out.could_ever = true;
        if !g.fits_fraction(d.memory, d.compute_milli) {
            continue;
        }
        // An earlier GPU of this server in the same state scored the
        // same and wins ties: skip (FGD's measure costs a pass per GPU).
        if dedupe && s.gpus[..gi].iter().any(|h| same_state(g, h) && gpu_ok(h, d)) {
            continue;
        }
        let score = policy.score_gpu_in(cx, si, s, gi, d);
        if out.gi == NO_GPU || score > out.score {
            out.score = score;
            out.gi = gi;
        }
    }
    out
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
        return (if s.schedulable() { s.free_whole } else { 0 }, s.healthy);
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
    mut cache: Option<&mut ScoreCache>,
    links: Option<&dyn Links>,
) -> Result<Vec<Slot>, NoPlace> {
    let n = d.gpus;
    // Per eligible server: (index, free, all).
    let mut cand: Vec<(usize, u32, u32)> = Vec::new();
    let mut total = 0u32;
    let mut biggest = FastMap::<(Scope, &str), u32>::default();
    for (si, s) in servers.iter().enumerate() {
        if !eligible(s) {
            continue;
        }
        let (free, all) = counts(s, d);
        total += all;
        if d.scope_required && d.scope != Scope::Any {
            *biggest.entry((d.scope, s.unit_key(d.scope))).or_default() += all;
        }
        if free > 0 && cx.host_fits(si) && links_fit(links, si) {
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
            // Each server is its own unit; its score depends on the server
            // alone (a candidate is schedulable, so `free` is its state's).
            let mut entries =
                cache.as_deref_mut().and_then(|c| c.entries(policy, d, level_code(level), servers.len()));
            let mut best: Option<(i64, usize)> = None;
            for &(si, free, all) in &cand {
                if free < n {
                    continue;
                }
                let u = Unit { scope: level, free_whole: free, gpus: all, servers: 1 };
                let version = servers[si].version;
                let score = match entries.as_deref_mut() {
                    Some(v) if v[si].version == version => v[si].score,
                    Some(v) => {
                        let score = policy.score_unit_in(cx, servers, &[si], &u, d);
                        v[si] = Cached { version, score, gi: NO_GPU, could_ever: true };
                        score
                    }
                    None => policy.score_unit_in(cx, servers, &[si], &u, d),
                };
                if best.is_none_or(|(b, bs)| score > b || (score == b && freer(links, &[si], &[bs]))) {
                    best = Some((score, si));
                }
            }
            best.map(|(_, si)| vec![si])
        } else {
            let mut units: Vec<(&str, Unit, Vec<usize>)> = Vec::new();
            let mut at: FastMap<&str, usize> = FastMap::default();
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
            // A unit's score depends on its candidate members' states: kept
            // under their (index, version) list (a gang rescored only when
            // one of its unit's servers changed).
            let mut kept = cache.as_deref_mut().and_then(|c| c.units(policy, d, level_code(level)));
            let mut best: Option<(i64, usize)> = None;
            for (i, (_, u, members)) in units.iter().enumerate() {
                if u.free_whole < n {
                    continue;
                }
                let score = match kept.as_deref_mut() {
                    Some(m) => {
                        let print = members_print(servers, members);
                        match m.get(&print) {
                            Some(&score) => score,
                            None => {
                                let score = policy.score_unit_in(cx, servers, members, u, d);
                                m.insert(print, score);
                                score
                            }
                        }
                    }
                    None => policy.score_unit_in(cx, servers, members, u, d),
                };
                if best.is_none_or(|(b, bi)| score > b || (score == b && freer(links, members, &units[bi].2))) {
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
                    health_reason: String::new(),
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

    /// Counts scoring calls (to see what the cache spares).
    struct Counting<P>(P, std::sync::atomic::AtomicUsize);

    impl<P: Policy> Policy for Counting<P> {
        fn name(&self) -> &'static str {
            self.0.name()
        }
        fn score_gpu(&self, server: &Server, gpu: &Gpu, demand: &Demand) -> i64 {
            self.0.score_gpu(server, gpu, demand)
        }
        fn score_unit(&self, unit: &Unit, demand: &Demand) -> i64 {
            self.0.score_unit(unit, demand)
        }
        fn observe(&self, demand: &Demand, cx: &Context) {
            self.0.observe(demand, cx)
        }
        fn score_gpu_in(&self, cx: &Context, si: usize, server: &Server, gi: usize, demand: &Demand) -> i64 {
            self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.0.score_gpu_in(cx, si, server, gi, demand)
        }
        fn score_unit_in(&self, cx: &Context, servers: &[Server], members: &[usize], unit: &Unit, demand: &Demand) -> i64 {
            self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.0.score_unit_in(cx, servers, members, unit, demand)
        }
        fn equal_gpus_score_equal(&self) -> bool {
            self.0.equal_gpus_score_equal()
        }
        fn score_epoch(&self) -> Option<u64> {
            self.0.score_epoch()
        }
    }

    fn release(s: &mut [Server], slots: &[Slot], d: &Demand, id: u64) {
        for &(si, gi) in slots {
            let g = &mut s[si].gpus[gi];
            let (m, c) = d.take_from(g);
            g.used_memory -= m;
            g.used_milli -= c;
            g.holders.retain(|&h| h != id);
            s[si].recount();
        }
    }

    fn rng(x: &mut u64) -> u64 {
        *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Cached and uncached placement agree step for step over a random mix
    /// of fractions, whole GPUs, model limits, drains and releases, for every
    /// policy that allows caching (the learning ones change their workload,
    /// and so their scores, as they go).
    #[test]
    fn cached_placement_is_the_same_placement() {
        use crate::policies::{BestFit, Fgd};
        let make: [fn() -> Box<dyn Policy>; 4] = [
            || Box::new(Fgd::learning()),
            || Box::new(Fgd::learning_first()),
            || Box::new(BestFit::new()),
            || Box::new(FragmentationAware),
        ];
        for (pi, mk) in make.iter().enumerate() {
            let (plain, cached) = (mk(), mk());
            let mut s: Vec<Server> =
                // Over 64 servers: node units are grouped too (see
                // `single_server_nodes`).
                (0..72).map(|i| server(&format!("s{i}"), &format!("n{i}"), &format!("l{}", i / 4), 2 + i % 7)).collect();
            for (i, x) in s.iter_mut().enumerate() {
                if i % 5 == 0 {
                    for g in &mut x.gpus {
                        g.spec.model = "A100".into();
                    }
                    x.recount();
                }
            }
            let mut cache = ScoreCache::new();
            let mut live: Vec<(Vec<Slot>, Demand, u64)> = Vec::new();
            let mut seed = 42 + pi as u64;
            let (mut granted, mut busy) = (0, 0);
            for step in 0..4000u64 {
                let r = rng(&mut seed);
                if r % 3 == 0 && !live.is_empty() {
                    let (slots, d, id) = live.swap_remove((r / 3) as usize % live.len());
                    release(&mut s, &slots, &d, id);
                    continue;
                }
                if r % 97 == 1 {
                    let i = (r / 97) as usize % s.len();
                    s[i].drain = if s[i].drain.is_some() {
                        None
                    } else {
                        Some(crate::inventory::Drain { since: 0, deadline: None, for_shutdown: false })
                    };
                }
                let kind = (r >> 8) % 11;
                let d = match kind {
                    0..=4 => {
                        let gb = [8u64, 20, 40, 60][(r >> 16) as usize % 4];
                        Demand { memory: gb << 30, compute_milli: (gb * 12) as u32, ..Demand::default() }
                    }
                    5..=7 => Demand { gpus: 1, ..Demand::default() },
                    8 => Demand { gpus: 2 + (r >> 20) as u32 % 3, scope: Scope::Node, scope_required: true, ..Demand::default() },
                    // A gang across the servers of one leaf.
                    9 => Demand { gpus: 6 + (r >> 20) as u32 % 8, scope: Scope::Leaf, scope_required: true, ..Demand::default() },
                    _ => Demand { gpus: 1, models: vec!["a100".into()], ..Demand::default() },
                };
                let want = place(&s, &d, &all, plain.as_ref());
                let got = place_cached(&s, &d, &all, cached.as_ref(), &mut cache);
                assert_eq!(got, want, "policy {} step {step}, {d:?}", plain.name());
                if let Ok(slots) = want {
                    take(&mut s, &slots, &d, step + 1);
                    live.push((slots, d, step + 1));
                    granted += 1;
                } else {
                    busy += 1;
                }
            }
            // The mix kept the pool full enough to be refused at times.
            assert!(granted > 500 && busy > 50, "{granted} granted, {busy} refused");
        }
    }

    /// After the first grant, a grant scores only the servers that changed.
    #[test]
    fn a_grant_rescores_only_the_servers_that_changed() {
        let p = Counting(crate::policies::Fgd::learning(), std::sync::atomic::AtomicUsize::new(0));
        let calls = || p.1.swap(0, std::sync::atomic::Ordering::Relaxed);
        let mut s: Vec<Server> = (0..100).map(|i| server(&format!("s{i}"), &format!("n{i}"), "l", 8)).collect();
        let mut cache = ScoreCache::new();
        let d = Demand { gpus: 1, ..Demand::default() };
        let a = place_cached(&s, &d, &all, &p, &mut cache).unwrap();
        assert_eq!(calls(), 100, "every server scored once");
        take(&mut s, &a, &d, 1);
        let b = place_cached(&s, &d, &all, &p, &mut cache).unwrap();
        assert_eq!(calls(), 1, "only the server the grant changed");
        take(&mut s, &b, &d, 2);
        release(&mut s, &a, &d, 1);
        place_cached(&s, &d, &all, &p, &mut cache).unwrap();
        assert!(calls() <= 2, "the granted and the released server");
        // Fractions: per server, its distinct GPU states.
        let f = Demand { memory: 10 << 30, compute_milli: 100, ..Demand::default() };
        place_cached(&s, &f, &all, &p, &mut cache).unwrap();
        let first = calls();
        assert!((100..=110).contains(&first), "{first}");
        place_cached(&s, &f, &all, &p, &mut cache).unwrap();
        assert_eq!(calls(), 0, "nothing changed, nothing scored");
        // Uncached: everything, every time.
        place(&s, &f, &all, &p).unwrap();
        assert!(calls() >= 100);
    }
}
