//! The embedded store: the broker's state in one redb file in the data
//! directory, for a broker that is the only writer of its state (the
//! default; see the parent module for what is stored).

use std::path::{Path, PathBuf};

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};

use super::{Loaded, Store, StoreError, Term};
use crate::inventory::{Drain, ServerSpec};
use crate::state::Change;

const SERVERS: TableDefinition<&str, &[u8]> = TableDefinition::new("servers");
const LEASES: TableDefinition<u64, &[u8]> = TableDefinition::new("leases");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const REVOKED: TableDefinition<&str, u64> = TableDefinition::new("revoked");
/// Ended leases' accounting records, by lease id.
const USAGE: TableDefinition<u64, &[u8]> = TableDefinition::new("usage");
const GENERATION: &str = "generation";

#[derive(Serialize, Deserialize)]
struct StoredServer {
    spec: ServerSpec,
    drain: Option<Drain>,
}

pub struct RedbStore {
    db: Database,
    path: PathBuf,
}

impl RedbStore {
    pub fn open(dir: &Path) -> Result<RedbStore, StoreError> {
        let path = dir.join("broker.redb");
        let err = |e: &dyn std::fmt::Display| StoreError { path: path.display().to_string(), reason: e.to_string() };
        std::fs::create_dir_all(dir).map_err(|e| err(&e))?;
        let db = Database::create(&path).map_err(|e| err(&e))?;
        let store = RedbStore { db, path: path.clone() };
        // Create the tables so that the first read finds them.
        store.apply(&[], 0)?;
        Ok(store)
    }

    fn err(&self, e: impl std::fmt::Display) -> StoreError {
        StoreError { path: self.path.display().to_string(), reason: e.to_string() }
    }
}

impl Store for RedbStore {
    fn load(&self) -> Result<Loaded, StoreError> {
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

    /// Writes `changes` in one durable transaction (`term`: this file has
    /// one writer, the broker that opened it).
    fn apply(&self, changes: &[Change], _term: Term) -> Result<(), StoreError> {
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
