//! Moving a lease off a draining server by live migration
//! (docs/migration.md "Migration with a broker"). A drain with `migrate`
//! (or an operator's `moveLease`, to a server it names or to any) picks,
//! for each lease on the server, a target that can rebuild its
//! sessions: a snapshot keeps device ordinals and needs a matching server,
//! so the target must have the same number of GPUs, and at each ordinal the
//! lease holds, a healthy GPU of the same model, at least as large, with
//! room for what the lease takes. The move rides on the lease record (so
//! the store keeps it with no table of its own) until the source reports
//! it done or failed, or it has been in flight for [`MOVE_TIMEOUT_MS`].

use serde::{Deserialize, Serialize};

use crate::inventory::{Millis, Server};
use crate::state::{Lease, LeasedGpu};

/// A move not reported within this long is abandoned (the lease stays on
/// its source). Above the server's own bounds on one migration (a minute
/// of silence from the target).
pub const MOVE_TIMEOUT_MS: u64 = 120_000;
/// Move orders sent in one heartbeat reply, and results read from one
/// heartbeat.
pub const MAX_ORDERS: usize = 16;
/// Leases one drain plans moves for.
pub const MAX_PLANNED: usize = 256;
/// Longest failure reason kept from a server.
pub const MAX_REASON: usize = 1024;

/// `why` cut to at most [`MAX_REASON`] bytes (a server's text is not trusted
/// to be short).
pub fn cut_reason(mut why: String) -> String {
    if why.len() > MAX_REASON {
        let mut cut = MAX_REASON;
        while !why.is_char_boundary(cut) {
            cut -= 1;
        }
        why.truncate(cut);
    }
    why
}

/// A lease on its way to another server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Move {
    /// The target server's id.
    pub to: String,
    /// The lease's generation at the target, and once the move is done.
    pub generation: u64,
    /// Its placement there, reserved while the move is in flight.
    pub gpus: Vec<LeasedGpu>,
    pub since: Millis,
}

/// The first server (index) that can take `lease` off `from`, with the
/// lease's GPUs there, or why none can. `partitions`: the tenant's.
/// `only`: the operator's choice of target (None: any).
pub fn choose_target(
    servers: &[Server],
    lease: &Lease,
    from: &str,
    partitions: &[String],
    only: Option<&str>,
) -> Result<(usize, Vec<LeasedGpu>), String> {
    if lease.gpus.is_empty() || lease.gpus.iter().any(|g| g.server != from) {
        return Err("the lease spans several servers: moving part of it is not supported".into());
    }
    let Some(source) = servers.iter().find(|s| s.spec.id == from) else {
        return Err(format!("no server {from} is registered"));
    };
    let whole = lease.memory_limit == 0;
    let mut why = match only {
        Some(to) if to == from => return Err(format!("the lease is on {from} already")),
        Some(to) => match servers.iter().find(|s| s.spec.id == to) {
            None => return Err(format!("no server {to} is registered")),
            Some(s) if !s.schedulable() => return Err(format!("{to} takes no new leases (drained, or not answering)")),
            Some(s) if !s.serves_any(partitions) => {
                return Err(format!("{to} does not serve the tenant's partition(s) {}", partitions.join(",")))
            }
            Some(_) => String::new(),
        },
        None => format!("no other server is up, undrained and serves the tenant's partition(s) {}", partitions.join(",")),
    };
    for (i, s) in servers.iter().enumerate() {
        if s.spec.id == from || !s.schedulable() || !s.serves_any(partitions) || only.is_some_and(|to| to != s.spec.id) {
            continue;
        }
        if s.gpus.len() != source.gpus.len() {
            why = format!("{} has {} GPU(s), {from} has {}: a snapshot keeps device ordinals", s.spec.id, s.gpus.len(), source.gpus.len());
            continue;
        }
        let mut placed = Vec::with_capacity(lease.gpus.len());
        for g in &lease.gpus {
            let Some(t) = s.gpus.iter().find(|t| t.spec.ordinal == g.ordinal) else {
                why = format!("{} has no GPU at ordinal {}", s.spec.id, g.ordinal);
                break;
            };
            let (take_memory, take_milli) = if whole { (t.spec.memory, g.take_milli) } else { (g.take_memory, g.take_milli) };
            let fits = t.spec.healthy
                && t.spec.model.eq_ignore_ascii_case(&g.model)
                && t.spec.memory >= g.memory
                && if whole { t.is_free() } else { t.fits_fraction(take_memory, take_milli) };
            if !fits {
                why = format!(
                    "{}'s GPU {} ({}, {} MiB) is not a free, healthy {} of at least {} MiB",
                    s.spec.id,
                    g.ordinal,
                    t.spec.model,
                    t.spec.memory >> 20,
                    g.model,
                    g.memory >> 20
                );
                break;
            }
            placed.push(LeasedGpu {
                server: s.spec.id.clone(),
                uuid: t.spec.uuid,
                ordinal: t.spec.ordinal,
                model: t.spec.model.clone(),
                memory: t.spec.memory,
                take_memory,
                take_milli,
            });
        }
        if placed.len() == lease.gpus.len() {
            return Ok((i, placed));
        }
    }
    Err(why)
}
