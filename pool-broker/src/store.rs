//! Durability: the broker's state in one redb file in the data directory.
//!
//! What is stored: each server's registration and drain (operator policy),
//! each live lease (a grant the client was told about must survive), and
//! the generation counter, and each tenant's credential revocation (the
//! lowest credential serial still accepted), and each ended lease's
//! accounting record. Not stored: reachability, heartbeat times, the
//! queue (a queued client that loses the broker retries), quota use
//! (derived), live leases' metered use (servers report it again).
//!
//! One writer thread group-commits: it takes every job waiting, writes them
//! in one transaction, commits (fsync), and only then runs each job's
//! continuation, which answers the client. Jobs are queued while the state
//! lock is held, so the file sees changes in the order the state made them.

use std::path::{Path, PathBuf};
use std::sync::mpsc;

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::inventory::{Drain, ServerSpec};
use crate::state::{Change, Lease};

const SERVERS: TableDefinition<&str, &[u8]> = TableDefinition::new("servers");
const LEASES: TableDefinition<u64, &[u8]> = TableDefinition::new("leases");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const REVOKED: TableDefinition<&str, u64> = TableDefinition::new("revoked");
/// Ended leases' accounting records, by lease id.
const USAGE: TableDefinition<u64, &[u8]> = TableDefinition::new("usage");
const GENERATION: &str = "generation";

#[derive(Debug, Error, Clone)]
#[error("broker store {path}: {reason}")]
pub struct StoreError {
    pub path: String,
    pub reason: String,
}

#[derive(Serialize, Deserialize)]
struct StoredServer {
    spec: ServerSpec,
    drain: Option<Drain>,
}

pub struct Loaded {
    pub servers: Vec<(ServerSpec, Option<Drain>)>,
    pub leases: Vec<Lease>,
    pub generation: u64,
    /// Tenant -> the lowest credential serial still accepted.
    pub revoked: std::collections::HashMap<String, u64>,
    /// Ended leases' accounting records, by lease id.
    pub usage: Vec<crate::usage::Record>,
}

pub struct Store {
    db: Database,
    path: PathBuf,
}

impl Store {
    pub fn open(dir: &Path) -> Result<Store, StoreError> {
        let path = dir.join("broker.redb");
        let err = |e: &dyn std::fmt::Display| StoreError { path: path.display().to_string(), reason: e.to_string() };
        std::fs::create_dir_all(dir).map_err(|e| err(&e))?;
        let db = Database::create(&path).map_err(|e| err(&e))?;
        let store = Store { db, path: path.clone() };
        // Create the tables so that the first read finds them.
        store.apply(&[])?;
        Ok(store)
    }

    fn err(&self, e: impl std::fmt::Display) -> StoreError {
        StoreError { path: self.path.display().to_string(), reason: e.to_string() }
    }

    pub fn load(&self) -> Result<Loaded, StoreError> {
        let txn = self.db.begin_read().map_err(|e| self.err(e))?;
        let mut out = Loaded { servers: Vec::new(), leases: Vec::new(), generation: 0, revoked: Default::default(), usage: Vec::new() };
        let t = txn.open_table(SERVERS).map_err(|e| self.err(e))?;
        for row in t.iter().map_err(|e| self.err(e))? {
            let (_, v) = row.map_err(|e| self.err(e))?;
            let s: StoredServer = serde_json::from_slice(v.value()).map_err(|e| self.err(e))?;
            out.servers.push((s.spec, s.drain));
        }
        let t = txn.open_table(LEASES).map_err(|e| self.err(e))?;
        for row in t.iter().map_err(|e| self.err(e))? {
            let (_, v) = row.map_err(|e| self.err(e))?;
            out.leases.push(serde_json::from_slice(v.value()).map_err(|e| self.err(e))?);
        }
        let t = txn.open_table(META).map_err(|e| self.err(e))?;
        if let Some(g) = t.get(GENERATION).map_err(|e| self.err(e))? {
            out.generation = g.value();
        }
        let t = txn.open_table(REVOKED).map_err(|e| self.err(e))?;
        for row in t.iter().map_err(|e| self.err(e))? {
            let (k, v) = row.map_err(|e| self.err(e))?;
            out.revoked.insert(k.value().to_string(), v.value());
        }
        let t = txn.open_table(USAGE).map_err(|e| self.err(e))?;
        for row in t.iter().map_err(|e| self.err(e))? {
            let (_, v) = row.map_err(|e| self.err(e))?;
            out.usage.push(serde_json::from_slice(v.value()).map_err(|e| self.err(e))?);
        }
        Ok(out)
    }

    /// Writes `changes` in one durable transaction.
    pub fn apply(&self, changes: &[Change]) -> Result<(), StoreError> {
        let txn = self.db.begin_write().map_err(|e| self.err(e))?;
        {
            let mut servers = txn.open_table(SERVERS).map_err(|e| self.err(e))?;
            let mut leases = txn.open_table(LEASES).map_err(|e| self.err(e))?;
            let mut meta = txn.open_table(META).map_err(|e| self.err(e))?;
            let mut revoked = txn.open_table(REVOKED).map_err(|e| self.err(e))?;
            let mut usage = txn.open_table(USAGE).map_err(|e| self.err(e))?;
            for c in changes {
                match c {
                    Change::Server { spec, drain } => {
                        let v = serde_json::to_vec(&StoredServer { spec: spec.clone(), drain: *drain })
                            .map_err(|e| self.err(e))?;
                        servers.insert(spec.id.as_str(), v.as_slice()).map_err(|e| self.err(e))?;
                    }
                    Change::Lease(l) => {
                        let v = serde_json::to_vec(l).map_err(|e| self.err(e))?;
                        leases.insert(l.id, v.as_slice()).map_err(|e| self.err(e))?;
                    }
                    Change::LeaseGone(id) => {
                        leases.remove(*id).map_err(|e| self.err(e))?;
                    }
                    Change::Generation(g) => {
                        meta.insert(GENERATION, *g).map_err(|e| self.err(e))?;
                    }
                    Change::Revocation { tenant, before } => {
                        revoked.insert(tenant.as_str(), *before).map_err(|e| self.err(e))?;
                    }
                    Change::Usage(r) => {
                        let v = serde_json::to_vec(r).map_err(|e| self.err(e))?;
                        usage.insert(r.lease, v.as_slice()).map_err(|e| self.err(e))?;
                    }
                }
            }
        }
        txn.commit().map_err(|e| self.err(e))
    }
}

/// Runs after its changes are durable (or failed to be).
pub type Then = Box<dyn FnOnce(Result<(), StoreError>) + Send>;

pub struct Job {
    pub changes: Vec<Change>,
    pub then: Then,
}

/// Starts the writer thread; jobs sent to the returned sender are
/// committed in order, many per transaction under load.
pub fn spawn_writer(store: Store) -> std::io::Result<mpsc::Sender<Job>> {
    let (tx, rx) = mpsc::channel::<Job>();
    std::thread::Builder::new().name("rgpu-broker-store".into()).spawn(move || {
        while let Ok(first) = rx.recv() {
            let mut batch = vec![first];
            while batch.len() < 4096 {
                match rx.try_recv() {
                    Ok(j) => batch.push(j),
                    Err(_) => break,
                }
            }
            let changes: Vec<Change> = batch.iter_mut().flat_map(|j| std::mem::take(&mut j.changes)).collect();
            let result = if changes.is_empty() { Ok(()) } else { store.apply(&changes) };
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
