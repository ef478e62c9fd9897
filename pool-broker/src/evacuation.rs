//! Moving leases off GPUs their servers report unhealthy (docs/migration.md
//! "Evacuation of unhealthy devices"). A GPU reported unhealthy takes no
//! new lease (placement skips it); each lease on it is moved to another
//! server as a drain with `--migrate` moves one (the same target choice,
//! [`crate::moves::choose_target`], and the same move on the lease record).
//! This module holds what is evacuation's own: which leases must leave,
//! and when one that could not leave (no target, or its move failed) is
//! tried again, until [`MAX_TRIES`] have failed.

use std::collections::{HashMap, HashSet};

use crate::inventory::{Millis, Server};
use crate::state::{Lease, LeaseState};

/// GPU health reports read from one heartbeat.
pub const MAX_GPUS_REPORTED: usize = 256;
/// Longest health reason kept from a server.
pub const MAX_HEALTH_REASON: usize = 256;
/// A lease that could not leave an unhealthy GPU is tried again this long
/// after, so a server that registers or frees a GPU meanwhile takes it.
pub const RETRY_MS: u64 = 1_000;
/// Tries per lease before it is left where it is (about 5 minutes at
/// [`RETRY_MS`]); the count starts over when its GPU is healthy again or
/// the broker restarts.
pub const MAX_TRIES: u32 = 300;

/// `why` cut to at most `max` bytes on a character boundary.
pub fn clip(mut why: String, max: usize) -> String {
    if why.len() > max {
        let mut cut = max;
        while !why.is_char_boundary(cut) {
            cut -= 1;
        }
        why.truncate(cut);
    }
    why
}

/// The GPU of `lease` that is unhealthy, as (server, ordinal, reason).
pub fn unhealthy_gpu<'a>(servers: &'a [Server], bad: &HashSet<[u8; 16]>, lease: &Lease) -> Option<(&'a str, u32, &'a str)> {
    let g = lease.gpus.iter().find(|g| bad.contains(&g.uuid))?;
    let s = servers.iter().find(|s| s.spec.id == g.server)?;
    let gpu = s.gpus.iter().find(|x| x.spec.uuid == g.uuid)?;
    Some((&s.spec.id, gpu.spec.ordinal, &gpu.spec.health_reason))
}

/// The UUIDs of every GPU reported unhealthy.
pub fn unhealthy_uuids(servers: &[Server]) -> HashSet<[u8; 16]> {
    servers.iter().flat_map(|s| s.gpus.iter()).filter(|g| !g.spec.healthy).map(|g| g.spec.uuid).collect()
}

/// Tries per lease; in memory only.
#[derive(Debug, Default)]
pub struct Evacuation {
    tries: HashMap<u64, Tries>,
}

#[derive(Debug, Clone, Copy)]
struct Tries {
    count: u32,
    next: Millis,
}

/// What [`Evacuation::due`] found.
#[derive(Debug, Default)]
pub struct Due {
    /// (lease, its server) to try moving now.
    pub now: Vec<(u64, String)>,
    /// Leases on an unhealthy GPU left where they are: every try failed.
    pub given_up: usize,
}

impl Evacuation {
    /// The active leases on an unhealthy GPU with no move in flight whose
    /// try is due at `now`, at most `max`. Forgets the leases that left
    /// (moved, ended, or their GPU is healthy again).
    pub fn due<'a>(&mut self, servers: &[Server], leases: impl Iterator<Item = &'a Lease>, now: Millis, max: usize) -> Due {
        let bad = unhealthy_uuids(servers);
        let mut due = Due::default();
        if bad.is_empty() {
            self.tries.clear();
            return due;
        }
        let mut still = HashSet::new();
        for l in leases {
            if l.state != LeaseState::Active || !l.gpus.iter().any(|g| bad.contains(&g.uuid)) {
                continue;
            }
            still.insert(l.id);
            // A suspended lease is not running: it resumes on its own GPUs
            // only once they are healthy (`preemption`).
            if l.moving.is_some() || l.suspension.is_some() {
                continue;
            }
            match self.tries.get(&l.id) {
                Some(t) if t.count >= MAX_TRIES => due.given_up += 1,
                Some(t) if t.next > now => {}
                _ if due.now.len() < max => {
                    if let Some(g) = l.gpus.first() {
                        due.now.push((l.id, g.server.clone()));
                    }
                }
                _ => {}
            }
        }
        self.tries.retain(|id, _| still.contains(id));
        due.now.sort_unstable();
        due
    }

    /// A try for `lease` was made at `now` (a move started, or none could):
    /// the next is due [`RETRY_MS`] after, if its move does not take it away
    /// first. True when that was its last.
    pub fn tried(&mut self, lease: u64, now: Millis) -> bool {
        let t = self.tries.entry(lease).or_insert(Tries { count: 0, next: now });
        t.count += 1;
        t.next = now + RETRY_MS;
        t.count >= MAX_TRIES
    }

    /// A server registered (a new target, perhaps): every lease waiting
    /// for its next try is due now.
    pub fn capacity_appeared(&mut self) {
        for t in self.tries.values_mut() {
            t.next = 0;
        }
    }

    /// Some lease on an unhealthy GPU has been tried (and may be due
    /// again): ticks and registrations look again only then.
    pub fn pending(&self) -> bool {
        !self.tries.is_empty()
    }

    /// Tries made for `lease` so far.
    pub fn tries(&self, lease: u64) -> u32 {
        self.tries.get(&lease).map_or(0, |t| t.count)
    }
}
