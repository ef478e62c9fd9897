//! Checkpoint and restore of live sessions: what the control plane's
//! operator calls do with the registry, the leases and the snapshot
//! directory ([`crate::checkpoint`] knows only a session's state and bytes).
//!
//! A checkpoint is a visit ([`crate::session::registry::Visit`]): the
//! session's connection is cut, its thread writes the snapshot between
//! requests, and the client's shim, which sees a broken connection, keeps
//! trying to resume. Without `leave` the session then goes on here (its
//! resume is served); with it, it is served no more (resumes are turned away
//! unanswered, so the shim keeps trying) until it is restored, here after a
//! restart or on a server at the same address, within the shim's
//! RGPU_RECONNECT_TIMEOUT.
//!
//! A restore rebuilds the session on a thread of its own (the control
//! plane's task set must not wait on a disk), registers it by its old id
//! and key, and starts its session thread waiting for the client's resume.
//! Snapshots are written to `NAME.partial`, synced, then renamed: a file
//! named NAME is always whole.

use std::fs::File;
use std::io::{BufReader, BufWriter};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{error, info, info_span, warn};

use crate::checkpoint::{self, Captured, SessionMeta, SnapshotError};
use crate::service::Service;
use crate::session::{After, Parts};
use crate::state::SessionState;

/// Bytes buffered between the session and the file.
const IO_BUFFER: usize = 8 << 20;
/// How long a restore waits for a lingering session of the same id here (its
/// state left in the snapshot) to end.
pub(crate) const REPLACE_WAIT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum OpError {
    #[error("this server has no --checkpoint-dir: checkpoint and restore are off")]
    NoDirectory,
    #[error("snapshot names are 1-128 of A-Za-z0-9._- and do not start with a dot")]
    BadName,
    #[error("no session {0:#x} is being served here")]
    NoSession(u64),
    #[error("session {0:#x} ended before it could be checkpointed")]
    Ended(u64),
    #[error("a snapshot named {0:?} exists already")]
    Exists(String),
    #[error("session {0:#x} is already served here")]
    Taken(u64),
    #[error("this server keeps no session across a broken connection (--reconnect-grace 0): a restored session could never be resumed")]
    NoGrace,
    #[error("snapshot file: {0}")]
    File(#[from] std::io::Error),
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("session {0:#x} is still served here: only a session whose state left in a checkpoint (without --continue) can be forwarded")]
    NotLeft(u64),
    #[error("too many sessions are suspended on this server already")]
    TooManySuspended,
    #[error("{0:?} is not a host:port of at most 255 bytes")]
    BadTarget(String),
    #[error("no snapshot named {0:?} here")]
    NoSnapshot(String),
    #[error("snapshot pieces come in order: this upload of {name:?} is at byte {at}, not {offset}")]
    OutOfOrder { name: String, at: u64, offset: u64 },
    #[error("a snapshot of more than {0} bytes is more than this server's devices could hold")]
    TooLarge(u64),
    #[error("a piece of a snapshot is at most {0} bytes")]
    PieceTooLarge(u32),
}

/// What a checkpoint or restore did.
#[derive(Debug, Clone, Copy)]
pub struct Done {
    pub session: u64,
    pub bytes: u64,
    pub memory_bytes: u64,
    pub took: Duration,
}

pub(crate) fn path_of(service: &Service, name: &str) -> Result<PathBuf, OpError> {
    let dir = service.checkpoint_dir.as_ref().ok_or(OpError::NoDirectory)?;
    if !rgpu_protocol::auth::valid_snapshot_name(name) {
        return Err(OpError::BadName);
    }
    Ok(dir.join(name))
}

/// Up to `max` bytes of snapshot `name` from `offset`, and the snapshot's size.
pub async fn read_snapshot(service: &Arc<Service>, name: &str, offset: u64, max: u32) -> Result<(Vec<u8>, u64), OpError> {
    let path = path_of(service, name)?;
    if max > rgpu_protocol::auth::SNAPSHOT_READ_MAX {
        return Err(OpError::PieceTooLarge(rgpu_protocol::auth::SNAPSHOT_READ_MAX));
    }
    let name = name.to_string();
    // Off the control plane's thread: it must not wait on a disk.
    tokio::task::spawn_blocking(move || read_piece(&path, &name, offset, max))
        .await
        .map_err(|_| OpError::ShuttingDown)?
}

fn read_piece(path: &Path, name: &str, offset: u64, max: u32) -> Result<(Vec<u8>, u64), OpError> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => OpError::NoSnapshot(name.to_string()),
        _ => OpError::File(e),
    })?;
    let size = f.metadata()?.len();
    let want = size.saturating_sub(offset).min(max as u64) as usize;
    let mut data = vec![0u8; want];
    f.seek(SeekFrom::Start(offset.min(size)))?;
    f.read_exact(&mut data)?;
    Ok((data, size))
}

/// The largest snapshot this server takes in: all its devices' memory, a
/// lease's modules, and room for the tables (a snapshot of one of its own
/// sessions is smaller).
pub(crate) fn snapshot_bound(service: &Service) -> u64 {
    let memory: u64 = service.backend.devices().iter().map(|d| d.total_mem).sum();
    memory.saturating_add(service.limits.max_module_bytes_per_lease).saturating_add(64 << 20)
}

/// Writes a piece of snapshot `name`: offset 0 starts `.NAME.upload-TAG`
/// afresh, each next piece must start where that file ends, and `last` syncs
/// it and puts it in place as NAME (refused if NAME exists: a file named
/// NAME is always a whole snapshot, as a checkpoint leaves it).
///
/// `tag` names the partial file (`.NAME.upload-TAG`): one per connection,
/// so that two uploads of one name never interleave their pieces in one
/// file (a snapshot has no checksum: a mixture could rebuild with the wrong
/// bytes). Returns the partial file while the upload is unfinished.
pub async fn write_snapshot(
    service: &Arc<Service>,
    name: &str,
    tag: u64,
    offset: u64,
    data: Vec<u8>,
    last: bool,
) -> Result<Option<PathBuf>, OpError> {
    let path = path_of(service, name)?;
    let bound = snapshot_bound(service);
    let name = name.to_string();
    tokio::task::spawn_blocking(move || write_piece(&path, &name, tag, offset, &data, last, bound))
        .await
        .map_err(|_| OpError::ShuttingDown)?
}

fn write_piece(path: &Path, name: &str, tag: u64, offset: u64, data: &[u8], last: bool, bound: u64) -> Result<Option<PathBuf>, OpError> {
    use std::io::Write;
    if data.len() > rgpu_protocol::auth::SNAPSHOT_WRITE_MAX as usize {
        return Err(OpError::PieceTooLarge(rgpu_protocol::auth::SNAPSHOT_WRITE_MAX));
    }
    if offset.saturating_add(data.len() as u64) > bound {
        return Err(OpError::TooLarge(bound));
    }
    let partial = path.with_file_name(format!(".{name}.upload-{tag:016x}"));
    let mut f = if offset == 0 {
        File::create(&partial)?
    } else {
        let f = std::fs::OpenOptions::new().append(true).open(&partial).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => OpError::OutOfOrder { name: name.to_string(), at: 0, offset },
            _ => OpError::File(e),
        })?;
        let at = f.metadata()?.len();
        if at != offset {
            return Err(OpError::OutOfOrder { name: name.to_string(), at, offset });
        }
        f
    };
    f.write_all(data)?;
    if last {
        f.sync_all()?;
        drop(f);
        put_in_place(&partial, path, name)?;
        info!(snapshot = %name, bytes = offset + data.len() as u64, "snapshot uploaded");
        return Ok(None);
    }
    Ok(Some(partial))
}

/// The partial file of an upload, synced, becomes snapshot `name` at
/// `path`, unless a snapshot of that name exists (then it is removed).
pub(crate) fn put_in_place(partial: &Path, path: &Path, name: &str) -> Result<(), OpError> {
    // A link fails where the name exists, and puts the whole file there at
    // once where it does not: never a clobbered snapshot.
    match std::fs::hard_link(partial, path) {
        Ok(()) => std::fs::remove_file(partial)?,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let _ = std::fs::remove_file(partial);
            return Err(OpError::Exists(name.to_string()));
        }
        // A file system without links (some network ones): check, then
        // rename, as a checkpoint does.
        Err(_) if !path.exists() => std::fs::rename(partial, path)?,
        Err(_) => {
            let _ = std::fs::remove_file(partial);
            return Err(OpError::Exists(name.to_string()));
        }
    }
    Ok(())
}

/// Forwards session `id`, whose state left here in a checkpoint, to
/// `target`, where it was restored: its client's resumes here are
/// redirected there (the note a live migration leaves), and it ends here.
pub async fn forward(service: &Arc<Service>, id: u64, target: &str) -> Result<(), OpError> {
    if target.is_empty() || target.len() > 255 || !target.contains(':') || target.chars().any(char::is_whitespace) {
        return Err(OpError::BadTarget(target.to_string()));
    }
    let (key, _) = service.sessions.identity(id).ok_or(OpError::NoSession(id))?;
    let (tx, rx) = tokio::sync::oneshot::channel::<Result<(), OpError>>();
    let (svc, to) = (service.clone(), target.to_string());
    let visit = Box::new(move |p: Parts<'_>| -> After {
        if !p.left {
            let _ = tx.send(Err(OpError::NotLeft(id)));
            return After::Serve;
        }
        // Written before the session's thread ends, so that no resume
        // finds it neither here nor forwarded.
        svc.sessions.forward(id, key, &to);
        let _ = tx.send(Ok(()));
        After::Gone
    });
    if !service.sessions.visit(id, visit) {
        return Err(OpError::NoSession(id));
    }
    rx.await.map_err(|_| OpError::Ended(id))??;
    info!(session = format_args!("{id:#x}"), %target, "session forwarded to where it was restored");
    Ok(())
}

/// Writes session `id` to `name` in the checkpoint directory; with `leave`
/// it is no longer served here once written.
pub async fn checkpoint(service: &Arc<Service>, id: u64, name: &str, quiesce: Duration, leave: bool) -> Result<Done, OpError> {
    checkpoint_then(service, id, name, quiesce, if leave { Then::Leave } else { Then::Serve }).await
}

/// Writes session `id`, of preempted `lease`, to `name` and ends it here:
/// its device memory is freed, and its client's resumes are told to wait
/// (the registry's suspension note) until it is restored.
pub async fn suspend(service: &Arc<Service>, id: u64, lease: u64, name: &str, quiesce: Duration) -> Result<Done, OpError> {
    checkpoint_then(service, id, name, quiesce, Then::Suspend(lease)).await
}

/// What becomes of a session once its snapshot is written.
#[derive(Debug, Clone, Copy)]
enum Then {
    Serve,
    Leave,
    Suspend(u64),
}

async fn checkpoint_then(service: &Arc<Service>, id: u64, name: &str, quiesce: Duration, then: Then) -> Result<Done, OpError> {
    let path = path_of(service, name)?;
    if path.exists() {
        return Err(OpError::Exists(name.to_string()));
    }
    let (key, client_name) = service.sessions.identity(id).ok_or(OpError::NoSession(id))?;
    let admission = service.leases.admission(id);
    let lease = admission.as_ref().map(|a| a.lease);
    let partial = path.with_file_name(format!("{name}.partial"));
    let file = File::create(&partial)?;
    let (tx, rx) = tokio::sync::oneshot::channel::<Result<Done, OpError>>();
    let started = Instant::now();
    let (partial2, path2) = (partial.clone(), path.clone());
    let svc = service.clone();
    let visit = Box::new(move |p: Parts<'_>| -> After {
        if tx.is_closed() {
            // The caller gave up: the session goes on untouched.
            return After::Serve;
        }
        let meta = SessionMeta { id, key, client_name, executed: p.executed, deferred: p.deferred, admission };
        let mut w = BufWriter::with_capacity(IO_BUFFER, file);
        let written = checkpoint::capture(p.state, &meta, p.window, quiesce, &mut w, None)
            .map_err(OpError::from)
            .and_then(|c: Captured| {
                let f = w.into_inner().map_err(|e| e.into_error())?;
                f.sync_all()?;
                std::fs::rename(&partial2, &path2)?;
                Ok(c)
            });
        // Noted before the session's thread ends, so that no resume finds
        // it neither here nor suspended.
        let written = match (written, then) {
            (Ok(_), Then::Suspend(lease)) if !svc.sessions.suspend(id, key, lease) => {
                let _ = std::fs::remove_file(&path2);
                Err(OpError::TooManySuspended)
            }
            (Ok(c), Then::Leave) => {
                // The program waits for the restore, however late it comes.
                svc.sessions.park(id, key, lease);
                Ok(c)
            }
            (w, _) => w,
        };
        let after = match (&written, then) {
            (Ok(_), Then::Leave) => After::Leave,
            (Ok(_), Then::Suspend(_)) => After::Suspended,
            _ => After::Serve,
        };
        let r = written.map(|c| Done { session: id, bytes: c.bytes, memory_bytes: c.memory_bytes, took: started.elapsed() });
        if r.is_err() {
            let _ = std::fs::remove_file(&partial2);
        }
        let _ = tx.send(r);
        after
    });
    if !service.sessions.visit(id, visit) {
        let _ = std::fs::remove_file(&partial);
        return Err(OpError::NoSession(id));
    }
    let r = rx.await.map_err(|_| OpError::Ended(id));
    if r.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    let done = r??;
    info!(session = format_args!("{id:#x}"), bytes = done.bytes, memory = done.memory_bytes,
        ms = done.took.as_millis() as u64, then = ?then, file = %path.display(), "session checkpointed");
    Ok(done)
}

/// Rebuilds the session saved as `name` and serves it, waiting for its
/// client's resume.
pub async fn restore(service: &Arc<Service>, name: &str) -> Result<Done, OpError> {
    let path = path_of(service, name)?;
    if service.limits.reconnect_grace.is_zero() {
        return Err(OpError::NoGrace);
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    let svc = service.clone();
    std::thread::Builder::new()
        .name("rgpu-restore".into())
        .spawn(move || {
            let _ = tx.send(restore_from(&svc, path));
        })?;
    rx.await.map_err(|_| OpError::ShuttingDown)?
}

/// As [`restore`], on the calling thread (at start, before connections are taken).
pub fn restore_now(service: &Arc<Service>, name: &str) -> Result<Done, OpError> {
    let path = path_of(service, name)?;
    if service.limits.reconnect_grace.is_zero() {
        return Err(OpError::NoGrace);
    }
    restore_from(service, path)
}

fn restore_from(service: &Arc<Service>, path: PathBuf) -> Result<Done, OpError> {
    let started = Instant::now();
    let file = File::open(&path)?;
    let bytes = file.metadata()?.len();
    let mut r = BufReader::with_capacity(IO_BUFFER, file);
    let (id, memory_bytes, span) = serve_rebuilt(service, &mut r, true, None)?;
    let took = started.elapsed();
    span.in_scope(|| {
        info!(bytes, memory = memory_bytes, ms = took.as_millis() as u64, file = %path.display(),
            "session restored; waiting for its client to resume")
    });
    Ok(Done { session: id, bytes, memory_bytes, took })
}

/// Reads a snapshot from `r`, rebuilds its session, registers it by its old
/// id and key and starts its thread waiting for the client's resume.
/// `replace`: a session of that id still here is closed first (its state
/// is the one being restored). `staged`: a live migration's pre-copied
/// ranges, in the backend session the rebuild then uses. Returns the id,
/// the device memory rebuilt and the session's span.
pub(crate) fn serve_rebuilt(
    service: &Arc<Service>,
    r: &mut dyn std::io::Read,
    replace: bool,
    staged: Option<checkpoint::precopy::Staged>,
) -> Result<(u64, u64, tracing::Span), OpError> {
    let mut opened = checkpoint::open(r)?;
    let meta = opened.meta.clone();
    let id = meta.id;
    let backend = match staged {
        Some(s) => {
            s.check_lease(meta.admission.as_ref())?;
            opened = opened.with_staged(s.ranges);
            s.backend
        }
        None => {
            let budget = meta.admission.as_ref().and_then(|a| service.leases.budget(a));
            service.backend.open_session(budget).map_err(|e| SnapshotError::Device(e, "opening a session"))?
        }
    };
    opened.check_fits(service.backend.devices(), backend.module_arch(0))?;
    // Registered before it is rebuilt: a client that comes back meanwhile
    // waits in the session's channel instead of being told it is unknown.
    let rx = match service.sessions.adopt(id, meta.key, &meta.client_name, replace, REPLACE_WAIT) {
        Ok(rx) => rx,
        Err(crate::session::registry::AttachError::ShuttingDown) => return Err(OpError::ShuttingDown),
        Err(_) => return Err(OpError::Taken(id)),
    };
    let input = service.session_input(meta.admission.as_ref());
    let meter = service.meter(id, meta.admission.as_ref().map(|a| a.lease));
    let forget = || {
        service.sessions.detach(id);
        service.meters.remove(id);
    };
    let mut state = SessionState::new(backend, service.backend.devices().len() as u32)
        .with_devices(service.backend.devices())
        .with_input(input)
        .with_meter(meter)
        .with_ipc(service.ipc.clone(), meta.admission.as_ref().map(|a| a.lease));
    if let Some(a) = &meta.admission {
        state = state.with_compute_share(a.lease, a.compute_milli).restrict(a.devices.clone());
    }
    let rebuilt = match opened.rebuild(&mut state) {
        Ok(r) => r,
        Err(e) => {
            forget();
            return Err(e.into());
        }
    };
    if let Some(a) = meta.admission.clone() {
        service.leases.bind(id, a);
    }
    let ended = state.ended.clone();
    service.sessions.bind_ended(id, ended.clone());
    let grace = service.limits.reconnect_grace;
    let watch = match crate::session::hangup::Watch::detached(ended, grace) {
        Ok(w) => w,
        Err(e) => {
            service.leases.unbind(id);
            forget();
            return Err(e.into());
        }
    };
    let resumer = crate::session::Resumer { rx, link: watch.link(), spin: service.data_plane.tcp_spin() };
    let span = info_span!("session", id = %format_args!("{id:#x}"), client = %meta.client_name, transport = "tcp");
    let memory_bytes = rebuilt.memory_bytes;
    let session = crate::session::Session::<rgpu_transport::select::DataTransport>::restored(
        state,
        meta.executed,
        meta.deferred,
        rebuilt.window,
        resumer,
    );
    let svc = service.clone();
    let thread_span = span.clone();
    let spawned = std::thread::Builder::new().name(format!("rgpu-session-{id:x}")).spawn(move || {
        let _in = thread_span.enter();
        let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let end = session.run();
            info!("restored session: {end}");
        }));
        drop(watch);
        if served.is_err() {
            error!("session thread panicked; the session is closed and its resources freed");
        }
        svc.session_ended(id);
    });
    if let Err(e) = spawned {
        span.in_scope(|| warn!("cannot start the restored session's thread: {e}"));
        service.leases.unbind(id);
        forget();
        return Err(e.into());
    }
    Ok((id, memory_bytes, span))
}

impl From<OpError> for capnp::Error {
    fn from(e: OpError) -> Self {
        capnp::Error::failed(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("rgpu-upload-{}-{:?}", std::process::id(), std::thread::current().id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn snapshot_pieces_go_in_order_and_land_whole_or_not_at_all() {
        let d = dir();
        let path = d.join("job.snap");
        let bytes: Vec<u8> = (0..150_000u32).map(|i| (i * 31 + 7) as u8).collect();
        let piece = rgpu_protocol::auth::SNAPSHOT_WRITE_MAX as usize;
        let bound = 1 << 20;
        // Out of order: nothing started, or a gap.
        assert!(matches!(write_piece(&path, "job.snap", 1, 10, &bytes[..10], false, bound), Err(OpError::OutOfOrder { at: 0, .. })));
        write_piece(&path, "job.snap", 1, 0, &bytes[..piece], false, bound).unwrap();
        let gap = (piece + 1) as u64;
        assert!(matches!(write_piece(&path, "job.snap", 1, gap, &bytes[..10], false, bound), Err(OpError::OutOfOrder { .. })));
        assert!(!path.exists(), "no snapshot before the last piece");
        assert!(matches!(read_piece(&path, "job.snap", 0, 10), Err(OpError::NoSnapshot(_))));
        write_piece(&path, "job.snap", 1, piece as u64, &bytes[piece..2 * piece], false, bound).unwrap();
        write_piece(&path, "job.snap", 1, 2 * piece as u64, &bytes[2 * piece..], true, bound).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), bytes, "the pieces, in order");
        assert!(!d.join(".job.snap.upload-0000000000000001").exists());
        // Read back in pieces, past the end included.
        let (a, size) = read_piece(&path, "job.snap", 0, 100_000).unwrap();
        let (b, _) = read_piece(&path, "job.snap", 100_000, 100_000).unwrap();
        let (c, _) = read_piece(&path, "job.snap", 1 << 30, 100).unwrap();
        assert_eq!(size, bytes.len() as u64);
        assert_eq!([a, b].concat(), bytes);
        assert!(c.is_empty());
        // A second upload of the name is refused at its end; the first stays.
        write_piece(&path, "job.snap", 1, 0, b"other", false, bound).unwrap();
        assert!(matches!(write_piece(&path, "job.snap", 1, 5, b"!", true, bound), Err(OpError::Exists(_))));
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
        assert!(!d.join(".job.snap.upload-0000000000000001").exists(), "a refused upload leaves nothing");
        // Two uploads of one name at once (two connections' tags) keep their
        // pieces apart: each file is its own pieces, in order.
        let two = d.join("two.snap");
        write_piece(&two, "two.snap", 7, 0, b"AAAA", false, bound).unwrap();
        write_piece(&two, "two.snap", 8, 0, b"BB", false, bound).unwrap();
        write_piece(&two, "two.snap", 7, 4, b"aaaa", false, bound).unwrap();
        assert!(matches!(write_piece(&two, "two.snap", 8, 4, b"bb", false, bound), Err(OpError::OutOfOrder { at: 2, .. })));
        write_piece(&two, "two.snap", 8, 2, b"bb", true, bound).unwrap();
        assert_eq!(std::fs::read(&two).unwrap(), b"BBbb");
        assert!(matches!(write_piece(&two, "two.snap", 7, 8, b"!", true, bound), Err(OpError::Exists(_))));
        assert_eq!(std::fs::read(&two).unwrap(), b"BBbb", "the later upload never mixes into the first");
        // Bounds: a piece too large, a snapshot past what the server holds.
        let big = vec![0u8; piece + 1];
        assert!(matches!(write_piece(&d.join("b.snap"), "b.snap", 1, 0, &big, false, bound), Err(OpError::PieceTooLarge(_))));
        assert!(matches!(write_piece(&d.join("b.snap"), "b.snap", 1, bound - 5, &bytes[..10], false, bound), Err(OpError::TooLarge(_))));
        let _ = std::fs::remove_dir_all(&d);
    }
}
