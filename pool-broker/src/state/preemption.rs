//! Preemption by checkpoint (docs/migration.md "Preemption"): a queued
//! request that has waited `preempt_after_ms` short of capacity makes room
//! by suspending leases of lower priority on one server. The server writes
//! each of their sessions to its checkpoint directory and ends them there;
//! their programs wait. A suspended lease keeps its GPUs' identities (a
//! snapshot keeps device ordinals and lives on that server's disk) and its
//! tenant's quota, but not the GPUs: it resumes on them once they are free
//! again and nothing of higher priority waits.
//!
//! A lease's suspension rides on its record (so the store keeps it) through
//! three phases: `Suspending` (ordered; the lease still holds its GPUs until
//! the server reports its sessions on disk), `Suspended` (GPUs free) and
//! `Resuming` (GPUs taken again; the server is restoring). One suspension is
//! ordered at a time across the pool, so a burst of urgent requests does not
//! checkpoint more than the first of them needs.

use std::cmp::Reverse;

use serde::{Deserialize, Serialize};

use super::{EndReason, Lease, LeaseRequest, LeaseState, State};
use crate::inventory::Millis;
use crate::moves::{self, MOVE_TIMEOUT_MS};
use crate::placement;

/// A lease whose suspension failed is not chosen again for this long.
pub const PREEMPT_RETRY_MS: u64 = 60_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    /// Ordered: its server is writing its sessions; it still holds its GPUs.
    Suspending,
    /// On its server's disk; its GPUs are free for others.
    Suspended,
    /// Its GPUs are its own again and its server is restoring it.
    Resuming,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Suspending => "suspending",
            Phase::Suspended => "suspended",
            Phase::Resuming => "resuming",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Suspension {
    pub phase: Phase,
    /// When it entered its phase.
    pub since: Millis,
    /// Whom it made room for: the waiting request's tenant and priority.
    pub for_tenant: String,
    pub for_priority: i32,
    /// Asked by its owner (`rgpu suspend`): it stays suspended, however
    /// free its GPUs, until its owner resumes it.
    #[serde(default)]
    pub held: bool,
}

/// What a heartbeat reply orders a server to do with a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OrderKind {
    /// Live-migrate its sessions to the target.
    Migrate,
    Suspend,
    Resume,
}

/// One order of a heartbeat reply: the lease, its generation (at the
/// target for a migration), the target (migrations only) and what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Order {
    pub lease: u64,
    pub generation: u64,
    pub target: String,
    pub kind: OrderKind,
}

impl Lease {
    /// Its suspension's phase, if it is suspended or on the way.
    pub fn phase(&self) -> Option<Phase> {
        self.suspension.as_ref().map(|s| s.phase)
    }

    /// Its state as the broker shows it: `active`, `lost`, or the phase of
    /// its preemption.
    pub fn state_name(&self) -> &'static str {
        match (self.state, self.phase()) {
            (LeaseState::Lost, _) => "lost",
            (LeaseState::Active, Some(p)) => p.name(),
            (LeaseState::Active, None) => "active",
        }
    }

    /// Whether it holds its GPUs now (a suspended lease does not).
    pub fn holds_gpus(&self) -> bool {
        self.phase() != Some(Phase::Suspended)
    }

    /// The one server all its GPUs are on.
    fn only_server(&self) -> Option<&str> {
        let first = self.gpus.first()?.server.as_str();
        self.gpus.iter().all(|g| g.server == first).then_some(first)
    }
}

impl State {
    /// Leases suspended or on the way, for what follows. Kept in the state
    /// so the hot paths (every release runs the queue) need not scan all
    /// leases.
    pub(super) fn note_suspension(&mut self, id: u64) {
        if self.leases.get(&id).is_some_and(|l| l.suspension.is_some()) {
            self.suspended.insert(id);
        } else {
            self.suspended.remove(&id);
        }
    }

    /// Orders room made for the first queued request that has waited
    /// `preempt_after_ms` short of capacity, when suspending leases of
    /// lower priority on one server would let it be placed: on the server
    /// where that takes the fewest leases, the lowest priorities and then
    /// the most recently granted first. Nothing while a suspension is
    /// being written.
    pub(super) fn preempt(&mut self, now: Millis) {
        let Some(after) = self.limits.preempt_after_ms else { return };
        if self.queue.is_empty() || self.suspended.iter().any(|id| self.leases.get(id).and_then(Lease::phase) == Some(Phase::Suspending)) {
            return;
        }
        let Some(req) = self
            .queue
            .values()
            .find(|w| w.short_of_capacity && now.saturating_sub(w.since) >= after)
            .map(|w| w.req.clone())
        else {
            return;
        };
        let Some((server, victims)) = self.choose_victims(&req, now) else { return };
        for id in &victims {
            let Some(l) = self.leases.get_mut(id) else { continue };
            l.suspension = Some(Suspension {
                phase: Phase::Suspending,
                since: now,
                for_tenant: req.tenant.clone(),
                for_priority: req.priority,
                held: false,
            });
            tracing::info!(lease = format_args!("{id:#x}"), %server, priority = l.priority, for_tenant = %req.tenant,
                for_priority = req.priority, "preempting a lease: its server suspends it to disk");
            let l = l.clone();
            self.changes.push(super::Change::Lease(l));
            self.note_suspension(*id);
        }
    }

    /// The server and the leases on it to suspend so that `req` fits, or
    /// None where no set of preemptible leases on one server does.
    fn choose_victims(&mut self, req: &LeaseRequest, now: Millis) -> Option<(String, Vec<u64>)> {
        let parts = self.partitions_of(&req.tenant);
        let mut by_server: std::collections::BTreeMap<usize, Vec<(i32, Reverse<Millis>, u64)>> = Default::default();
        for l in self.leases.values() {
            let preemptible = l.state == LeaseState::Active
                && l.priority < req.priority
                && l.moving.is_none()
                && l.suspension.is_none()
                && l.unpreemptible_until <= now;
            if !preemptible {
                continue;
            }
            let Some(&si) = l.only_server().and_then(|s| self.index.get(s)) else { continue };
            let s = &self.servers[si];
            if s.schedulable() && s.serves_any(&parts) {
                by_server.entry(si).or_default().push((l.priority, Reverse(l.granted), l.id));
            }
        }
        let mut best: Option<(usize, Vec<u64>)> = None;
        for (si, mut candidates) in by_server {
            candidates.sort_unstable();
            let mut taken = Vec::new();
            let mut fits = false;
            for (_, _, id) in candidates {
                if best.as_ref().is_some_and(|(_, b)| taken.len() + 1 >= b.len()) {
                    break;
                }
                let l = self.leases[&id].clone();
                self.vacate_gpus(&l);
                taken.push(l);
                let sid = self.servers[si].spec.id.clone();
                let here = |s: &crate::inventory::Server| s.spec.id == sid && s.serves_any(&parts);
                if placement::place(&self.servers, &req.demand, &here, self.policy.as_ref()).is_ok() {
                    fits = true;
                    break;
                }
            }
            for l in &taken {
                self.occupy_gpus(l);
            }
            if fits {
                best = Some((si, taken.iter().map(|l| l.id).collect()));
            }
        }
        best.map(|(si, v)| (self.servers[si].spec.id.clone(), v))
    }

    /// Takes their GPUs back for suspended leases that fit on them again,
    /// highest priority and longest suspended first, while no request of a
    /// higher priority waits short of capacity (it would only preempt them
    /// again); each then waits for its server to restore it.
    pub(super) fn resume_suspended(&mut self, now: Millis) {
        if self.suspended.is_empty() {
            return;
        }
        let above = self.queue.values().filter(|w| w.short_of_capacity).map(|w| w.req.priority).max();
        let mut ready: Vec<(Reverse<i32>, Millis, u64)> = self
            .suspended
            .iter()
            .filter_map(|id| self.leases.get(id))
            .filter(|l| l.state == LeaseState::Active && l.phase() == Some(Phase::Suspended))
            .filter(|l| !l.suspension.as_ref().is_some_and(|s| s.held))
            .filter(|l| above.is_none_or(|p| p <= l.priority))
            .map(|l| (Reverse(l.priority), l.suspension.as_ref().map_or(0, |s| s.since), l.id))
            .collect();
        ready.sort_unstable();
        for (_, _, id) in ready {
            if !self.fits_again(&self.leases[&id]) {
                continue;
            }
            let l = self.leases.get_mut(&id).expect("listed above");
            if let Some(s) = l.suspension.as_mut() {
                s.phase = Phase::Resuming;
                s.since = now;
            }
            let l = l.clone();
            self.occupy_gpus(&l);
            tracing::info!(lease = format_args!("{id:#x}"), "resuming a preempted lease on its GPUs");
            self.changes.push(super::Change::Lease(l));
        }
    }

    /// Can suspended `l` have its own GPUs again now?
    fn fits_again(&self, l: &Lease) -> bool {
        let whole = l.memory_limit == 0;
        l.gpus.iter().all(|g| {
            let Some(&si) = self.index.get(&g.server) else { return false };
            let s = &self.servers[si];
            s.reachable
                && s.gpus.iter().any(|x| {
                    x.spec.uuid == g.uuid
                        && x.spec.healthy
                        && if whole { x.is_free() } else { x.fits_fraction(g.take_memory, g.take_milli) }
                })
        })
    }

    fn live_lease(&self, id: u64) -> Result<Lease, super::BrokerError> {
        let l = self.leases.get(&id).filter(|l| l.state == LeaseState::Active);
        l.cloned().ok_or_else(|| super::BrokerError::NotFound { id, why: "is not live".into() })
    }

    /// Its owner asks lease `id` suspended (`rgpu suspend`): its server
    /// writes its sessions to disk and frees its GPUs, as for a preemption,
    /// and it stays suspended until [`State::unhold`]. A lease suspended by
    /// a preemption already is held from now on.
    pub fn hold(&mut self, id: u64, now: Millis) -> Result<Lease, super::BrokerError> {
        use super::BrokerError;
        let mut l = self.live_lease(id)?;
        match l.suspension.as_mut() {
            Some(s) if s.held => return Ok(l),
            Some(s) => s.held = true,
            None => {
                if l.moving.is_some() {
                    return Err(BrokerError::Invalid(format!("lease {id:#x} is being moved to another server; suspend it once it has moved")));
                }
                if l.only_server().is_none() {
                    return Err(BrokerError::Invalid(format!("lease {id:#x} spans several servers: only a lease on one server can be suspended")));
                }
                l.suspension = Some(Suspension {
                    phase: Phase::Suspending,
                    since: now,
                    for_tenant: l.tenant.clone(),
                    for_priority: l.priority,
                    held: true,
                });
                l.move_error.clear();
                tracing::info!(lease = format_args!("{id:#x}"), "suspending a lease as its owner asks");
            }
        }
        self.leases.insert(id, l.clone());
        self.note_suspension(id);
        self.changes.push(super::Change::Lease(l.clone()));
        Ok(l)
    }

    /// Its owner lets lease `id`, suspended by [`State::hold`], resume: it
    /// takes its own GPUs back once they are free and nothing of a higher
    /// priority waits for them (at once, if so).
    pub fn unhold(&mut self, id: u64, now: Millis) -> Result<Lease, super::BrokerError> {
        use super::BrokerError;
        let mut l = self.live_lease(id)?;
        match l.suspension.as_mut() {
            Some(s) if s.held => s.held = false,
            _ => return Err(BrokerError::Invalid(format!("lease {id:#x} is not suspended by its owner"))),
        }
        self.leases.insert(id, l.clone());
        self.changes.push(super::Change::Lease(l));
        self.try_queue(now);
        Ok(self.leases[&id].clone())
    }

    /// Server `from` reports the suspension (`resumed` false) or the resume
    /// of `lease` done or failed. A failed suspension leaves the lease
    /// running where it is (not chosen again for [`PREEMPT_RETRY_MS`]); a
    /// failed resume ends it: its state cannot come back.
    pub fn suspension_reported(
        &mut self,
        from: &str,
        lease: u64,
        resumed: bool,
        result: Result<(), String>,
        now: Millis,
    ) -> Result<(), super::BrokerError> {
        let want = if resumed { Phase::Resuming } else { Phase::Suspending };
        let wrong = || super::BrokerError::Invalid(format!("lease {lease:#x} is not {} on {from}", want.name()));
        let l = self.leases.get(&lease).ok_or_else(wrong)?;
        if l.phase() != Some(want) || l.only_server() != Some(from) {
            return Err(wrong());
        }
        let mut l = l.clone();
        match (want, result) {
            (Phase::Suspending, Ok(())) => {
                self.vacate_gpus(&l);
                if let Some(s) = l.suspension.as_mut() {
                    s.phase = Phase::Suspended;
                    s.since = now;
                }
                tracing::info!(lease = format_args!("{lease:#x}"), server = %from, "lease suspended: its GPUs are free");
            }
            (Phase::Suspending, Err(why)) => {
                l.suspension = None;
                l.unpreemptible_until = now.saturating_add(PREEMPT_RETRY_MS);
                l.move_error = moves::cut_reason(format!("not suspended: {why}"));
                tracing::warn!(lease = format_args!("{lease:#x}"), server = %from, "lease not suspended: {why}");
            }
            (_, Ok(())) => {
                l.suspension = None;
                l.move_error.clear();
                tracing::info!(lease = format_args!("{lease:#x}"), server = %from, "preempted lease resumed");
            }
            (_, Err(why)) => {
                tracing::warn!(lease = format_args!("{lease:#x}"), server = %from, "preempted lease not resumed, ending it: {why}");
                self.end(lease, EndReason::Unresumed);
                self.try_queue(now);
                return Ok(());
            }
        }
        self.leases.insert(lease, l.clone());
        self.note_suspension(lease);
        self.changes.push(super::Change::Lease(l));
        self.try_queue(now);
        Ok(())
    }

    /// Suspensions and resumes not reported within [`MOVE_TIMEOUT_MS`], or
    /// whose server stopped answering: the lease ends (a suspension that
    /// may have half happened cannot be trusted to run on, nor its GPUs be
    /// given away while it might).
    pub(super) fn stuck_suspensions(&mut self, gone: &[String], now: Millis) {
        let stuck: Vec<u64> = self
            .suspended
            .iter()
            .filter_map(|id| self.leases.get(id))
            .filter(|l| match l.suspension.as_ref() {
                Some(s) if s.phase != Phase::Suspended => {
                    now.saturating_sub(s.since) > MOVE_TIMEOUT_MS || l.gpus.iter().any(|g| gone.contains(&g.server))
                }
                _ => false,
            })
            .map(|l| l.id)
            .collect();
        let freed = !stuck.is_empty();
        for id in stuck {
            tracing::warn!(lease = format_args!("{id:#x}"), "preemption abandoned (not reported in time): ending the lease");
            self.end(id, EndReason::Unresumed);
        }
        if freed {
            self.try_queue(now);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::inventory::{GpuSpec, ServerSpec};
    use crate::placement::{Demand, FragmentationAware};
    use crate::state::{Event, Limits, Outcome};

    fn server(id: &str, gpus: u32) -> ServerSpec {
        ServerSpec {
            id: id.into(),
            node: id.into(),
            leaf: "l1".into(),
            spine: "s1".into(),
            partitions: Vec::new(),
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

    fn pool(preempt_after_ms: Option<u64>, gpus: u32) -> State {
        let limits = Limits { preempt_after_ms, ..Limits::default() };
        let mut s = State::new(limits, HashMap::new(), Box::new(FragmentationAware));
        s.register(server("x", gpus), 0);
        s
    }

    fn ask(tenant: &str, gpus: u32, priority: i32) -> LeaseRequest {
        LeaseRequest {
            tenant: tenant.into(),
            demand: Demand { gpus, ..Demand::default() },
            priority,
            ttl_ms: 3_600_000,
            wait_ms: 3_600_000,
            ..LeaseRequest::default()
        }
    }

    fn grant(s: &mut State, r: LeaseRequest, id: u64, now: Millis) -> Lease {
        match s.request(r, id, now) {
            Ok(Outcome::Granted(l)) => l,
            _ => panic!("not granted at once"),
        }
    }

    fn queue(s: &mut State, r: LeaseRequest, id: u64, now: Millis) -> u64 {
        match s.request(r, id, now) {
            Ok(Outcome::Queued(t)) => t,
            _ => panic!("not queued"),
        }
    }

    fn granted_tickets(s: &mut State) -> Vec<u64> {
        let (_, ev) = s.take_output();
        ev.iter()
            .filter_map(|e| match e {
                Event::Granted { ticket, .. } => Some(*ticket),
                _ => None,
            })
            .collect()
    }

    fn orders(s: &mut State) -> Vec<(u64, OrderKind)> {
        s.heartbeat("x", 0).unwrap().orders.into_iter().map(|o| (o.lease, o.kind)).collect()
    }

    #[test]
    fn a_waiting_higher_priority_suspends_a_lower_lease_which_resumes_on_its_gpu_after() {
        let mut s = pool(Some(100), 1);
        let low = grant(&mut s, ask("bob", 1, 0), 7, 0);
        let t = queue(&mut s, ask("carol", 1, 5), 9, 10);
        s.tick(50);
        assert_eq!(s.lease(low.id).unwrap().phase(), None, "not before preempt_after_ms");
        assert!(orders(&mut s).is_empty());
        s.tick(200);
        assert_eq!(s.lease(low.id).unwrap().state_name(), "suspending");
        assert_eq!(orders(&mut s), vec![(low.id, OrderKind::Suspend)]);
        // Still on its GPU until the server says its sessions are on disk.
        assert!(granted_tickets(&mut s).is_empty());
        assert!(s.suspension_reported("x", low.id, true, Ok(()), 250).is_err(), "a resume report for a suspension");
        assert!(s.suspension_reported("y", low.id, false, Ok(()), 250).is_err(), "a report from another server");
        s.suspension_reported("x", low.id, false, Ok(()), 300).unwrap();
        assert_eq!(granted_tickets(&mut s), vec![t], "the GPU went to the waiting request");
        let l = s.lease(low.id).unwrap().clone();
        assert_eq!(l.state_name(), "suspended");
        let hb = s.heartbeat("x", 0).unwrap();
        assert!(hb.live.iter().any(|&(id, g, _)| id == low.id && g == low.generation), "still listed: {hb:?}");
        assert!(hb.orders.is_empty());

        // What the store keeps brings the suspension back: the GPU is not
        // the suspended lease's.
        let mut again = pool(Some(100), 1);
        again.restore(vec![(server("x", 1), None)], vec![l.clone()], l.generation, 400);
        assert!(again.server("x").unwrap().gpus[0].is_free());
        assert_eq!(again.lease(low.id).unwrap().phase(), Some(Phase::Suspended));

        let high = s.leases().find(|x| x.tenant == "carol").unwrap().id;
        s.release(high, 500);
        assert_eq!(s.lease(low.id).unwrap().state_name(), "resuming");
        assert_eq!(orders(&mut s), vec![(low.id, OrderKind::Resume)]);
        assert!(!s.server("x").unwrap().gpus[0].is_free(), "its GPU is taken back before the restore");
        s.suspension_reported("x", low.id, true, Ok(()), 600).unwrap();
        assert_eq!(s.lease(low.id).unwrap().state_name(), "active");
        assert!(orders(&mut s).is_empty());
    }

    #[test]
    fn an_owners_suspension_frees_the_gpus_and_holds_until_the_owner_resumes() {
        // No preemption configured: the owner's ask alone suspends.
        let mut s = pool(None, 1);
        let l = grant(&mut s, ask("bob", 1, 0), 7, 0);
        assert!(s.unhold(l.id, 5).is_err(), "not suspended: nothing to resume");
        assert_eq!(s.hold(l.id, 10).unwrap().state_name(), "suspending");
        assert_eq!(orders(&mut s), vec![(l.id, OrderKind::Suspend)]);
        assert_eq!(s.hold(l.id, 11).unwrap().state_name(), "suspending", "asked twice: one suspension");
        s.suspension_reported("x", l.id, false, Ok(()), 20).unwrap();
        assert!(s.server("x").unwrap().gpus[0].is_free(), "its GPU is free while it is held");
        // Its GPU free and nothing waiting: held all the same.
        s.tick(1_000);
        assert_eq!(s.lease(l.id).unwrap().state_name(), "suspended");
        assert!(orders(&mut s).is_empty());
        // Someone else uses the GPU meanwhile; the owner's resume waits
        // for it, then takes it back.
        let other = grant(&mut s, ask("carol", 1, 0), 9, 1_100);
        assert_eq!(s.unhold(l.id, 1_200).unwrap().state_name(), "suspended", "its GPU is taken");
        assert!(s.unhold(l.id, 1_201).is_err(), "no longer held");
        s.release(other.id, 1_300);
        assert_eq!(s.lease(l.id).unwrap().state_name(), "resuming");
        assert_eq!(orders(&mut s), vec![(l.id, OrderKind::Resume)]);
        s.suspension_reported("x", l.id, true, Ok(()), 1_400).unwrap();
        assert_eq!(s.lease(l.id).unwrap().state_name(), "active");
        assert!(s.hold(12345, 1_500).is_err(), "an unknown lease");
    }

    #[test]
    fn the_lowest_and_newest_lease_is_chosen_and_equal_priorities_never_preempt() {
        let mut s = pool(Some(0), 2);
        let older = grant(&mut s, ask("bob", 1, 0), 3, 0);
        let newer = grant(&mut s, ask("bob", 1, 0), 5, 10);
        queue(&mut s, ask("dan", 1, 0), 11, 20);
        s.tick(30);
        assert!(s.leases().all(|l| l.suspension.is_none()), "the same priority does not preempt");
        queue(&mut s, ask("carol", 1, 2), 13, 40);
        s.tick(50);
        assert_eq!(s.lease(newer.id).unwrap().phase(), Some(Phase::Suspending));
        assert_eq!(s.lease(older.id).unwrap().phase(), None, "one lease is enough room");
        // One suspension at a time: the next waiting request waits for it.
        queue(&mut s, ask("erin", 1, 3), 15, 60);
        s.tick(70);
        assert_eq!(s.lease(older.id).unwrap().phase(), None);

        let mut off = pool(None, 1);
        grant(&mut off, ask("bob", 1, 0), 3, 0);
        queue(&mut off, ask("carol", 1, 9), 5, 10);
        off.tick(10_000);
        assert!(off.leases().all(|l| l.suspension.is_none()), "preemption is off by default");
    }

    #[test]
    fn a_failed_suspension_runs_on_and_a_failed_or_silent_resume_ends_the_lease() {
        let mut s = pool(Some(0), 1);
        let low = grant(&mut s, ask("bob", 1, 0), 7, 0);
        queue(&mut s, ask("carol", 1, 5), 9, 10);
        s.tick(20);
        s.suspension_reported("x", low.id, false, Err("this server has no --checkpoint-dir".into()), 30).unwrap();
        let l = s.lease(low.id).unwrap();
        assert_eq!(l.state_name(), "active");
        assert!(l.move_error.contains("no --checkpoint-dir"), "{}", l.move_error);
        assert!(!s.server("x").unwrap().gpus[0].is_free());
        s.tick(40);
        assert_eq!(s.lease(low.id).unwrap().phase(), None, "not tried again at once");
        s.heartbeat("x", 30 + PREEMPT_RETRY_MS + 1);
        s.tick(30 + PREEMPT_RETRY_MS + 1);
        assert_eq!(s.lease(low.id).unwrap().phase(), Some(Phase::Suspending), "tried again later");
        let now = 30 + PREEMPT_RETRY_MS + 10;
        s.suspension_reported("x", low.id, false, Ok(()), now).unwrap();
        let high = s.leases().find(|x| x.tenant == "carol").unwrap().id;
        s.take_output();
        s.release(high, now + 1);
        s.suspension_reported("x", low.id, true, Err("snapshot gone".into()), now + 2).unwrap();
        assert!(s.lease(low.id).is_none(), "a lease that cannot resume ends");
        let (_, ev) = s.take_output();
        assert!(ev.iter().any(|e| matches!(e, Event::Ended { id, why: EndReason::Unresumed, .. } if *id == low.id)), "{ev:?}");
        assert!(s.server("x").unwrap().gpus[0].is_free());

        // A suspension never reported: the lease ends, and the GPU is given.
        let mut s = pool(Some(0), 1);
        let low = grant(&mut s, ask("bob", 1, 0), 7, 0);
        let t = queue(&mut s, ask("carol", 1, 5), 9, 10);
        s.tick(20);
        s.take_output();
        for now in [20 + MOVE_TIMEOUT_MS / 2, 21 + MOVE_TIMEOUT_MS] {
            s.heartbeat("x", now);
            s.tick(now);
        }
        assert!(s.lease(low.id).is_none());
        assert_eq!(granted_tickets(&mut s), vec![t]);
    }
}
