//! Preemption on a GPU server (docs/migration.md "Preemption"): what the
//! broker's suspend and resume orders do here.
//!
//! Suspending a lease marks it suspended (no new session of it is
//! admitted), then writes each of its sessions to `preempt-LEASE-SESSION`
//! in the checkpoint directory and ends it, freeing its device memory. The
//! registry keeps each session's key, so its client's resumes are told to
//! wait (`RESUME_SUSPENDED`) instead of refused; the program waits in the
//! call it was in. Resuming restores those files (the client's next try
//! finds its session, every handle and pointer as they were) and deletes
//! them. A suspension that fails part way restores what it wrote, so the
//! lease runs on as before. A lease the broker stops listing while
//! suspended (released, expired) has its files and notes dropped.
//!
//! The files outlive the process: at start, those a suspension left are
//! noted again ([`recover_at_start`]), so a restart loses no suspended lease.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use crate::relocate::{self, OpError};
use crate::service::Service;

/// How long a suspended session may take to come to rest between requests.
const QUIESCE: Duration = Duration::from_secs(10);
/// Passes over a lease's sessions: one opened while the others were
/// written is written on the next.
const PASSES: usize = 3;
/// How long the suspended sessions' threads may take to free what they held
/// before the broker is told the GPUs are free.
const FREE_WAIT: Duration = Duration::from_secs(10);
const PREFIX: &str = "preempt-";

/// The snapshot a suspension writes for `session` of `lease`.
pub fn file_name(lease: u64, session: u64) -> String {
    format!("{PREFIX}{lease:016x}-{session:016x}")
}

fn is_of(name: &str, lease: u64) -> bool {
    name.strip_prefix(PREFIX)
        .and_then(|r| r.strip_prefix(&format!("{lease:016x}-")))
        .is_some_and(|session| session.len() == 16 && session.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// The whole snapshots of `lease` in `dir`, by name.
fn files_of(dir: &Path, lease: u64) -> std::io::Result<Vec<String>> {
    let mut names: Vec<String> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| is_of(n, lease))
        .collect();
    names.sort();
    Ok(names)
}

/// Most names [`suspended_files`] lists.
pub const MAX_LISTED: usize = 4096;

/// The snapshots a suspension of `lease` wrote here and left (not yet
/// resumed), by name, at most [`MAX_LISTED`]: what an operator copies off
/// to keep the suspended lease elsewhere. None: no checkpoint directory.
pub fn suspended_files(service: &Service, lease: u64) -> Option<std::io::Result<Vec<String>>> {
    let dir = service.checkpoint_dir.as_ref()?;
    Some(files_of(dir, lease).map(|mut names| {
        names.truncate(MAX_LISTED);
        names
    }))
}

/// Suspends every session of `lease` here; how many were written.
pub async fn suspend_lease(service: &Arc<Service>, lease: u64) -> Result<usize, String> {
    let Some(dir) = service.checkpoint_dir.clone() else {
        return Err("this server has no --checkpoint-dir: it cannot suspend leases".into());
    };
    if service.limits.reconnect_grace.is_zero() {
        return Err(OpError::NoGrace.to_string());
    }
    if !service.leases.suspend(lease) {
        return Err("too many leases are suspended on this server already".into());
    }
    match write_sessions(service, lease).await {
        Ok(n) => {
            // The lease may have ended meanwhile (the heartbeat forgot it):
            // nothing will resume what was written.
            if !service.leases.is_suspended(lease) {
                forget(service, vec![lease]);
                return Err("the lease ended while it was being suspended".into());
            }
            wait_freed(service, lease).await;
            info!(lease = format_args!("{lease:#x}"), sessions = n, dir = %dir.display(), "lease suspended: its sessions are on disk and their GPUs free");
            Ok(n)
        }
        Err(why) => {
            warn!(lease = format_args!("{lease:#x}"), "suspension failed ({why}); restoring what was written");
            match resume_lease(service, lease).await {
                Ok(_) => Err(why),
                Err(e) => Err(format!("{why}; restoring what was written failed too: {e}")),
            }
        }
    }
}

async fn write_sessions(service: &Arc<Service>, lease: u64) -> Result<usize, String> {
    let mut done = HashSet::new();
    let mut written = 0;
    for _ in 0..PASSES {
        let sessions: Vec<u64> = service.leases.sessions_of(lease).into_iter().filter(|s| !done.contains(s)).collect();
        if sessions.is_empty() {
            return Ok(written);
        }
        for s in sessions {
            match relocate::suspend(service, s, lease, &file_name(lease, s), QUIESCE).await {
                Ok(_) => written += 1,
                // Not served: it ended meanwhile, or it is opened and not
                // yet attached (nothing of it to keep). Closed, so that it
                // cannot attach later and run on GPUs handed to another.
                Err(OpError::NoSession(_) | OpError::Ended(_)) => {
                    if service.sessions.close(s) {
                        info!(session = format_args!("{s:#x}"), "a session of the lease being suspended was still opening: dropped");
                    }
                    service.leases.unbind(s);
                }
                Err(e) => return Err(format!("session {s:#x}: {e}")),
            }
            done.insert(s);
        }
    }
    match service.leases.sessions_of(lease).into_iter().filter(|s| !done.contains(s)).count() {
        0 => Ok(written),
        n => Err(format!("{n} session(s) of the lease were still being opened")),
    }
}

/// Waits (bounded) for the suspended sessions' threads to end, so that the
/// GPUs the broker hands on hold none of their memory.
async fn wait_freed(service: &Service, lease: u64) {
    let until = Instant::now() + FREE_WAIT;
    while !service.leases.sessions_of(lease).is_empty() {
        if Instant::now() >= until {
            warn!(lease = format_args!("{lease:#x}"), "suspended sessions still ending after {FREE_WAIT:?}");
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Restores every session of `lease` a suspension wrote here, and deletes
/// their files; how many were restored.
pub async fn resume_lease(service: &Arc<Service>, lease: u64) -> Result<usize, String> {
    let Some(dir) = service.checkpoint_dir.clone() else {
        return Err("this server has no --checkpoint-dir".into());
    };
    let names = match files_of(&dir, lease) {
        Ok(n) => n,
        Err(e) => {
            forget(service, vec![lease]);
            return Err(format!("{}: {e}", dir.display()));
        }
    };
    let mut restored = 0;
    for name in names {
        match relocate::restore(service, &name).await {
            Ok(_) => restored += 1,
            // Restored by an earlier try whose report was lost.
            Err(OpError::Taken(_)) => {}
            Err(e) => {
                // What is left cannot come back: its clients are refused
                // from now on (they would wait for ever), and its files go.
                forget(service, vec![lease]);
                return Err(format!("{name}: {e}"));
            }
        }
        if let Err(e) = std::fs::remove_file(dir.join(&name)) {
            warn!(file = %name, "cannot delete a resumed lease's snapshot: {e}");
        }
    }
    service.leases.unsuspend(lease);
    info!(lease = format_args!("{lease:#x}"), sessions = restored, "lease resumed: its sessions wait for their clients");
    Ok(restored)
}

/// Drops what suspended `leases` left here (they ended, or cannot be
/// restored): their clients' resumes are refused from now on, and their
/// files are deleted.
pub fn forget(service: &Arc<Service>, leases: Vec<u64>) {
    for &l in &leases {
        service.leases.unsuspend(l);
        let sessions = service.sessions.unsuspend_lease(l);
        info!(lease = format_args!("{l:#x}"), sessions = sessions.len(), "a suspended lease ended (or cannot resume): its snapshots are dropped");
    }
    let Some(dir) = service.checkpoint_dir.clone() else { return };
    // Off the agent's task: a disk may be slow.
    let spawned = std::thread::Builder::new().name("rgpu-forget".into()).spawn(move || {
        for l in leases {
            for name in files_of(&dir, l).unwrap_or_default() {
                if let Err(e) = std::fs::remove_file(dir.join(&name)) {
                    warn!(file = %name, "cannot delete an ended lease's snapshot: {e}");
                }
            }
        }
    });
    if let Err(e) = spawned {
        warn!("cannot start deleting ended leases' snapshots: {e}");
    }
}

/// Notes again the suspended sessions whose files are in the checkpoint
/// directory (the server restarted while their leases were suspended), and
/// deletes unfinished ones. Called before connections are taken.
pub fn recover_at_start(service: &Service) {
    let Some(dir) = service.checkpoint_dir.as_ref() else { return };
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for name in entries.filter_map(|e| e.ok()?.file_name().into_string().ok()).filter(|n| n.starts_with(PREFIX)) {
        let path = dir.join(&name);
        if name.ends_with(".partial") {
            let _ = std::fs::remove_file(&path);
            continue;
        }
        let meta = std::fs::File::open(&path)
            .map_err(crate::checkpoint::SnapshotError::from)
            .and_then(|f| crate::checkpoint::open(&mut std::io::BufReader::new(f)).map(|o| o.meta));
        match meta {
            Ok(m) => match m.admission {
                Some(a) if is_of(&name, a.lease) => {
                    service.leases.suspend(a.lease);
                    service.sessions.suspend(m.id, m.key, a.lease);
                    info!(lease = format_args!("{:#x}", a.lease), session = format_args!("{:#x}", m.id), "a suspended session is on disk here: it waits for its lease to resume");
                }
                _ => warn!(file = %name, "a snapshot named as a suspension's is not one of a lease's sessions; left alone"),
            },
            Err(e) => warn!(file = %name, "cannot read a suspended session's snapshot: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::sim::{SimBackend, SimConfig};
    use crate::lease::Admission;

    fn service(dir: &Path) -> Arc<Service> {
        let cfg = SimConfig {
            devices: 1,
            memory: 16 << 20,
            compute_capability: (9, 0),
            seed: None,
            kernel_time_limit: Duration::from_secs(5),
            compiled_tier: true,
        };
        let checkpoint = crate::config::CheckpointConfig { dir: Some(dir.to_path_buf()), ..Default::default() };
        Arc::new(Service::new(Arc::new(SimBackend::new(&cfg).unwrap()), Duration::from_secs(5)).with_checkpoint(&checkpoint))
    }

    /// A session opened and not yet attached when its lease is suspended
    /// has nothing to write; it used to be left pending, free to attach
    /// later and run on GPUs the broker had handed to another lease.
    #[test]
    fn a_session_still_opening_when_its_lease_is_suspended_is_dropped() {
        let dir = std::env::temp_dir().join(format!("rgpu-preemption-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let service = service(&dir);
        let (id, _key) = service.sessions.open("c").unwrap();
        let a = Admission { lease: 9, generation: 1, memory_limit: None, deadline_ms: u64::MAX, devices: vec![0], pkey: None, compute_milli: 0 };
        service.leases.bind(id, a);
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let started = Instant::now();
        assert_eq!(rt.block_on(suspend_lease(&service, 9)), Ok(0), "nothing to write");
        assert!(started.elapsed() < FREE_WAIT, "waited {:?} for a session that was never served", started.elapsed());
        assert!(service.leases.sessions_of(9).is_empty());
        assert_eq!(service.sessions.counts(), (0, 0), "the opening session was dropped");
        assert!(service.leases.is_suspended(9));
        assert_eq!(rt.block_on(resume_lease(&service, 9)), Ok(0));
        assert!(!service.leases.is_suspended(9));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn only_a_leases_own_snapshots_are_its() {
        let n = file_name(0xab, 0x1234);
        assert_eq!(n, "preempt-00000000000000ab-0000000000001234");
        assert!(rgpu_protocol::auth::valid_snapshot_name(&n));
        assert!(is_of(&n, 0xab));
        assert!(!is_of(&n, 0xac));
        assert!(!is_of(&format!("{n}.partial"), 0xab), "unfinished");
        assert!(!is_of("preempt-00000000000000ab-", 0xab));
        assert!(!is_of("checkpoint-00000000000000ab-0000000000001234", 0xab));
    }
}
