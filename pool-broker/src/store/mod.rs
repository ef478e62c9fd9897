//! Durability: what the broker must not lose, behind one [`Store`] trait
//! with two implementations.
//!
//! - [`redb`]: one redb file in the data directory, for a single broker
//!   (the default: nothing else to run);
//! - `etcd` (cargo feature `etcd`): an etcd cluster shared by several
//!   brokers, one of which leads (see that module for the election and
//!   the fencing).
//!
//! What is stored: each server's registration and drain (operator policy),
//! each live lease (a grant the client was told about must survive), the
//! generation counter, each tenant's credential revocation (the lowest
//! credential serial still accepted), and each ended lease's accounting
//! record. Not stored: reachability and heartbeat times, the queue (a
//! queued client that loses the broker retries), quota use (derived from
//! the leases), live leases' metered use (servers report it again),
//! request rates.
//!
//! One writer thread group-commits: it takes every job waiting, writes them
//! with one [`Store::apply`], and only then runs each job's continuation,
//! which answers the client. Jobs are queued while the state lock is held,
//! so the store sees changes in the order the state made them.

pub mod redb;

#[cfg(feature = "etcd")]
pub mod etcd;

use std::collections::HashMap;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use thiserror::Error;

use crate::inventory::{Drain, ServerSpec};
use crate::state::{Change, Lease};

#[derive(Debug, Error, Clone)]
#[error("broker store {path}: {reason}")]
pub struct StoreError {
    pub path: String,
    pub reason: String,
}

/// How a replicated store words a write it refused because its term no
/// longer leads (see [`StoreError::deposed`]).
pub const NOT_LEADING: &str = "not written: this broker does not lead";

impl StoreError {
    /// The write was refused for want of leadership, not failed: nothing
    /// was written, and the client may send it to the leader.
    pub fn deposed(&self) -> bool {
        self.reason.starts_with(NOT_LEADING)
    }
}

pub struct Loaded {
    pub servers: Vec<(ServerSpec, Option<Drain>)>,
    pub leases: Vec<Lease>,
    pub generation: u64,
    /// Tenant -> the lowest credential serial still accepted.
    pub revoked: HashMap<String, u64>,
    /// Ended leases' accounting records.
    pub usage: Vec<crate::usage::Record>,
}

/// The leadership a write was decided under: the etcd revision at which
/// this broker was elected. A store shared by replicas writes a change only
/// while its term is still the leader's, so a deposed leader's writes fail;
/// 0 is a store with no other writer (redb).
pub type Term = u64;

pub trait Store: Send + 'static {
    fn load(&self) -> Result<Loaded, StoreError>;
    /// Writes `changes` durably, in order, and only if `term` still leads.
    fn apply(&self, changes: &[Change], term: Term) -> Result<(), StoreError>;
}

/// Until when this broker may act as the leader without word from the
/// store: a leader's etcd lease lives at least its TTL past the renewal
/// etcd last confirmed. Fencing stops a deposed leader's writes, but not
/// its answers that write nothing: a leader paused (SIGSTOP, a stalled VM)
/// past its lease wakes with a view another broker has replaced, and would
/// refuse a grant as "no capacity" from it. Past its tenure it refuses
/// everything as not leading until the store says where it stands.
#[derive(Debug, Clone)]
pub struct Tenure(Arc<Mutex<Option<Instant>>>);

impl Tenure {
    /// A store with no other writer (redb): leads as long as it runs.
    pub fn unbounded() -> Self {
        Tenure(Arc::new(Mutex::new(None)))
    }

    /// Valid until `t` (a monotonic clock: a paused process sees the pause).
    pub fn until(t: Instant) -> Self {
        Tenure(Arc::new(Mutex::new(Some(t))))
    }

    /// The store confirmed leadership until `t` (never moved back).
    pub fn extend(&self, t: Instant) {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(u) = g.as_mut() {
            *u = (*u).max(t);
        }
    }

    pub fn holds(&self) -> bool {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).is_none_or(|u| Instant::now() < u)
    }
}

/// What a replicated store tells the service about who serves.
pub enum Leadership {
    /// This broker leads from `term` on, from the state `loaded` (read after
    /// its election, so it holds every write an earlier leader acknowledged),
    /// for as long as `tenure` holds.
    Leader { term: Term, loaded: Loaded, tenure: Tenure },
    /// Another broker leads (at this address, when known), or none does yet.
    Follower { leader: Option<String> },
}

/// Runs after its changes are durable (or failed to be).
pub type Then = Box<dyn FnOnce(Result<(), StoreError>) + Send>;

pub struct Job {
    pub changes: Vec<Change>,
    /// The term the state made these changes under.
    pub term: Term,
    pub then: Then,
}

/// Jobs in one commit at most.
const BATCH: usize = 4096;

/// Starts the writer thread; jobs sent to the returned sender are
/// committed in order, many per [`Store::apply`] under load (never jobs of
/// two terms together: the older term's must fail on their own).
pub fn spawn_writer(store: Box<dyn Store>) -> std::io::Result<mpsc::Sender<Job>> {
    let (tx, rx) = mpsc::channel::<Job>();
    std::thread::Builder::new().name("rgpu-broker-store".into()).spawn(move || {
        let mut next: Option<Job> = None;
        loop {
            let first = match next.take() {
                Some(j) => j,
                None => match rx.recv() {
                    Ok(j) => j,
                    Err(_) => return,
                },
            };
            let term = first.term;
            let mut batch = vec![first];
            while batch.len() < BATCH {
                match rx.try_recv() {
                    Ok(j) if j.term == term => batch.push(j),
                    Ok(j) => {
                        next = Some(j);
                        break;
                    }
                    Err(_) => break,
                }
            }
            let changes: Vec<Change> = batch.iter_mut().flat_map(|j| std::mem::take(&mut j.changes)).collect();
            let result = if changes.is_empty() { Ok(()) } else { store.apply(&changes, term) };
            if let Err(e) = &result {
                tracing::error!("cannot persist broker state: {e}");
            }
            for j in batch {
                (j.then)(result.clone());
            }
        }
    })?;
    Ok(tx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// Records each apply's (number of changes, term); blocks the first
    /// until released, so that the jobs behind it queue up.
    struct Recorder {
        applied: Arc<Mutex<Vec<(usize, Term)>>>,
        gate: Mutex<Option<mpsc::Receiver<()>>>,
    }

    impl Store for Recorder {
        fn load(&self) -> Result<Loaded, StoreError> {
            unreachable!()
        }
        fn apply(&self, changes: &[Change], term: Term) -> Result<(), StoreError> {
            if let Some(g) = self.gate.lock().unwrap().take() {
                let _ = g.recv();
            }
            self.applied.lock().unwrap().push((changes.len(), term));
            Ok(())
        }
    }

    #[test]
    fn jobs_group_commit_but_never_across_terms() {
        let applied = Arc::new(Mutex::new(Vec::new()));
        let (open, gate) = mpsc::channel();
        let tx = spawn_writer(Box::new(Recorder { applied: applied.clone(), gate: Mutex::new(Some(gate)) })).unwrap();
        let (done_tx, done) = mpsc::channel();
        let job = |term: Term| {
            let d = done_tx.clone();
            Job { changes: vec![Change::Generation(term)], term, then: Box::new(move |r| d.send(r.is_ok()).unwrap()) }
        };
        tx.send(job(1)).unwrap();
        // The writer is in the first apply; these wait behind it.
        std::thread::sleep(std::time::Duration::from_millis(50));
        for t in [1, 1, 2, 2, 1] {
            tx.send(job(t)).unwrap();
        }
        open.send(()).unwrap();
        for _ in 0..6 {
            assert!(done.recv_timeout(std::time::Duration::from_secs(5)).unwrap());
        }
        assert_eq!(*applied.lock().unwrap(), vec![(1, 1), (2, 1), (2, 2), (1, 1)]);
    }
}
