//! The audit log: who leased, renewed, released, drained, registered,
//! logged in (or failed to), from which address. Each record goes to the
//! tracing target `audit` and is appended, one JSON object a line, to
//! `audit.log` in the data directory; the newest records are kept in
//! memory for `rgpu audit` (read back from the file's tail at start, so a
//! restart loses none of them).

use std::collections::VecDeque;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::inventory::Millis;
use crate::store::StoreError;

/// Records kept in memory for queries (and the most one query returns).
pub const KEPT: usize = 10_000;
/// How much of the file's end is read back at start.
const TAIL_BYTES: u64 = 4 << 20;
/// Longest field: names and reasons come from clients.
const FIELD_MAX: usize = 256;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub time_ms: Millis,
    /// "tenant/role", "server:ID", or "-" before any proof.
    pub actor: String,
    pub peer: String,
    pub op: String,
    pub target: String,
    pub ok: bool,
    pub detail: String,
}

impl Record {
    /// The tenant whose record this is, if a tenant acted.
    pub fn tenant(&self) -> Option<&str> {
        self.actor.split_once('/').map(|(t, _)| t)
    }
}

fn bounded(s: &str) -> String {
    if s.len() <= FIELD_MAX {
        return s.to_string();
    }
    let mut end = FIELD_MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

pub struct Audit {
    file: Mutex<Option<std::fs::File>>,
    recent: Mutex<VecDeque<Record>>,
    path: PathBuf,
}

impl Audit {
    /// Opens (creates) `dir/audit.log` and reads its newest records back.
    pub fn open(dir: &Path) -> Result<Audit, StoreError> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = dir.join("audit.log");
        let err = |e: std::io::Error| StoreError { path: path.display().to_string(), reason: e.to_string() };
        std::fs::create_dir_all(dir).map_err(err)?;
        let mut f = std::fs::OpenOptions::new().read(true).append(true).create(true).mode(0o600).open(&path).map_err(err)?;
        let len = f.metadata().map_err(err)?.len();
        let start = len.saturating_sub(TAIL_BYTES);
        f.seek(SeekFrom::Start(start)).map_err(err)?;
        let mut tail = Vec::new();
        (&mut f).take(TAIL_BYTES).read_to_end(&mut tail).map_err(err)?;
        let text = String::from_utf8_lossy(&tail);
        let mut lines = text.lines();
        if start > 0 {
            // The first line read may be cut.
            lines.next();
        }
        let mut recent = VecDeque::new();
        for line in lines {
            if let Ok(r) = serde_json::from_str::<Record>(line) {
                if recent.len() == KEPT {
                    recent.pop_front();
                }
                recent.push_back(r);
            }
        }
        Ok(Audit { file: Mutex::new(Some(f)), recent: Mutex::new(recent), path })
    }

    /// An audit log kept in memory only (unit tests).
    pub fn in_memory() -> Audit {
        Audit { file: Mutex::new(None), recent: Mutex::default(), path: PathBuf::new() }
    }

    pub fn record(&self, mut r: Record) {
        for f in [&mut r.actor, &mut r.peer, &mut r.op, &mut r.target, &mut r.detail] {
            *f = bounded(f);
        }
        tracing::info!(target: "audit", actor = %r.actor, peer = %r.peer, op = %r.op, target = %r.target, ok = r.ok, detail = %r.detail);
        if let Some(f) = self.file.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            let mut line = serde_json::to_vec(&r).unwrap_or_default();
            line.push(b'\n');
            // One write per record: O_APPEND keeps lines whole.
            if let Err(e) = f.write_all(&line) {
                tracing::error!("cannot append to the audit log {}: {e}", self.path.display());
            }
        }
        let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        if recent.len() == KEPT {
            recent.pop_front();
        }
        recent.push_back(r);
    }

    /// The newest `limit` records (of `tenant`, if given), oldest first.
    pub fn query(&self, tenant: Option<&str>, limit: usize) -> Vec<Record> {
        let recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<Record> = recent
            .iter()
            .rev()
            .filter(|r| tenant.is_none_or(|t| r.tenant() == Some(t) || r.target == t))
            .take(limit.min(KEPT))
            .cloned()
            .collect();
        out.reverse();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(actor: &str, op: &str) -> Record {
        Record {
            time_ms: 1,
            actor: actor.into(),
            peer: "127.0.0.1:1".into(),
            op: op.into(),
            target: "x".into(),
            ok: true,
            detail: "d\nnewline".into(),
        }
    }

    #[test]
    fn records_survive_a_reopen_and_queries_filter_by_tenant() {
        let dir = std::env::temp_dir().join(format!("rgpu-audit-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let a = Audit::open(&dir).unwrap();
        a.record(rec("alice/user", "lease"));
        a.record(rec("bob/user", "renew"));
        a.record(rec(&"m".repeat(1000), "login"));
        drop(a);
        let a = Audit::open(&dir).unwrap();
        let all = a.query(None, 100);
        assert_eq!(all.iter().map(|r| r.op.as_str()).collect::<Vec<_>>(), ["lease", "renew", "login"]);
        assert!(all[2].actor.len() < 300, "fields are bounded");
        assert_eq!(all[0].detail, "d\nnewline");
        assert_eq!(a.query(Some("bob"), 100).len(), 1);
        assert_eq!(a.query(None, 1)[0].op, "login", "the newest");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
