//! `rgpu checkpoint SESSION --server ADDR --to NAME [--save FILE] --key-file FILE`,
//! and `rgpu checkpoint LEASE --to FILE` through the broker.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use rgpu_broker_client::duration::parse_duration_ms;
use rgpu_broker_client::{parse_lease_id, BrokerClient};

use crate::lease_file;
use crate::operator::{parse_session, server_key};
use crate::pool::BrokerArgs;

/// Write a running session, or a broker lease with all its sessions, to a
/// snapshot (docs/migration.md).
///
/// A session: `rgpu checkpoint SESSION --server ADDR --to NAME`. The
/// session is held still (its queued work finished first) while it is
/// written; its program waits, its calls do not fail. By default the session
/// then leaves the server, and its program waits until the snapshot is
/// restored (`rgpu restore`), within its RGPU_HOLD_TIMEOUT (an hour by
/// default).
///
/// A lease: `rgpu checkpoint LEASE --to FILE` (an operator of the broker
/// and of its server). The lease is suspended (its sessions written to its
/// server's disk, its GPUs freed, its programs waiting), and its snapshots
/// are copied into FILE; `rgpu restore FILE` puts back what its server no
/// longer has and resumes it. With --continue it resumes at once.
#[derive(clap::Args)]
pub struct Args {
    /// A session id (with --server) or a lease id (without it).
    id: String,
    /// The server holding the session (host:port). Without it, ID is a
    /// lease, suspended through the broker.
    #[arg(long)]
    server: Option<String>,
    /// A session: the snapshot's name in the server's --checkpoint-dir (a
    /// file name, not a path). A lease: the file to keep it in (a new file).
    #[arg(long)]
    to: String,
    /// Also copy the snapshot off the server into FILE (a new file), so that
    /// it outlives the server's disk: `rgpu restore NAME --load FILE` puts
    /// it on any server again.
    #[arg(long, value_name = "FILE", requires = "server")]
    save: Option<std::path::PathBuf>,
    /// Copy with --save in control-plane calls, one piece each, as servers
    /// before the one-stream copy took it (slower; chosen by itself for
    /// such a server).
    #[arg(long, requires = "save")]
    copy_in_calls: bool,
    /// Keep serving the session on this server after it is written (a
    /// lease: resume it once it is copied).
    #[arg(long = "continue")]
    keep_running: bool,
    /// How long to wait for the session's queued work to finish, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    quiesce_ms: u32,
    /// How long the whole call may take, in seconds (each copy, for a lease).
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    /// A lease: how long to wait for its server to have written it.
    #[arg(long, value_parser = parse_duration_ms, default_value = "120s")]
    wait: u64,
    /// The server's admin key file (its --admin-key-file) [default: --admin-key-file].
    #[arg(long, value_name = "FILE")]
    key_file: Option<PathBuf>,
    #[command(flatten)]
    broker: BrokerArgs,
}

pub fn exec(a: Args) -> Result<i32> {
    match &a.server {
        Some(server) => session(&a, server),
        None => lease(&a),
    }
}

fn session(a: &Args, server: &str) -> Result<i32> {
    let session = parse_session(&a.id)?;
    if !rgpu_protocol::auth::valid_snapshot_name(&a.to) {
        bail!("--to {:?}: a snapshot name is 1-128 of A-Za-z0-9._- not starting with a dot", a.to);
    }
    if let Some(f) = &a.save {
        if f.exists() {
            bail!("--save {}: the file exists; name a new one", f.display());
        }
    }
    let key = server_key(a.key_file.as_deref(), &a.broker)?;
    let security = a.broker.tls.security()?;
    let r = rgpu_control_client::operator::checkpoint(
        server,
        &security,
        &key,
        session,
        &a.to,
        Duration::from_millis(a.quiesce_ms as u64),
        !a.keep_running,
        Duration::from_secs(a.timeout),
    )?;
    let secs = r.took.as_secs_f64();
    eprintln!(
        "Checkpointed session {session:#x} on {server} as {}: {} bytes ({} of device memory) in {:.3} s, {:.0} MiB/s{}",
        a.to,
        r.bytes,
        r.memory_bytes,
        secs,
        r.bytes as f64 / (1 << 20) as f64 / secs.max(1e-9),
        if a.keep_running { "" } else { "; the session left the server until it is restored" }
    );
    if let Some(file) = &a.save {
        save(server, &security, &key, &a.to, file, a.copy_in_calls, Duration::from_secs(a.timeout))?;
    }
    Ok(0)
}

/// Suspends the lease, then copies what its server wrote into the file.
fn lease(a: &Args) -> Result<i32> {
    let id = parse_lease_id(&a.id).with_context(|| format!("{:?} is not a lease id; a session needs --server", a.id))?;
    let file = PathBuf::from(&a.to);
    if file.exists() {
        bail!("--to {}: the file exists; name a new one", file.display());
    }
    let key = server_key(a.key_file.as_deref(), &a.broker)?;
    let security = a.broker.tls.security()?;
    let b = a.broker.connect()?;
    let limit = Duration::from_secs(a.timeout);
    // Asked of the server before the lease is suspended: a key it refuses,
    // or a server that keeps no snapshots, leaves the lease running.
    let lease_id = rgpu_broker_client::format_lease_id(id);
    let Some(on) = b.leases("")?.into_iter().find(|l| l.id == lease_id).and_then(|l| l.gpus.first().map(|g| g.server.clone())) else {
        bail!("no live lease {lease_id} with a GPU");
    };
    rgpu_control_client::operator::list_suspended(&on, &security, &key, id, limit)
        .with_context(|| format!("lease {lease_id} was not suspended: its server {on} would not list its snapshots"))?;
    let l = super::suspend::settle(&b, b.suspend(id)?, a.wait, |s| s != "suspending")?;
    match l.state.as_str() {
        "suspended" => {}
        "active" if !l.move_error.is_empty() => bail!("lease {} was not suspended: {}; it runs on", l.id, l.move_error),
        s => bail!("lease {} is {s}, not suspended, after {} ms: nothing was copied", l.id, a.wait),
    }
    let Some(server) = l.gpus.first().map(|g| g.server.clone()) else { bail!("lease {} holds no GPU", l.id) };
    let started = std::time::Instant::now();
    let copied = (|| -> Result<(usize, u64)> {
        let names = rgpu_control_client::operator::list_suspended(&server, &security, &key, id, limit)?;
        let mut partial = file.as_os_str().to_owned();
        partial.push(".partial");
        let partial = PathBuf::from(partial);
        let out = std::fs::File::create_new(&partial).with_context(|| format!("cannot create {}", partial.display()))?;
        let written = (|| -> Result<u64> {
            let mut w = lease_file::Writer::new(out, id, &server)?;
            let mut bytes = 0u64;
            for n in &names {
                bytes += w.add(n, |f| -> Result<u64> {
                    Ok(rgpu_control_client::operator::read_snapshot(&server, &security, &key, n, f, limit)?)
                })?;
            }
            w.finish()?.sync_all()?;
            Ok(bytes)
        })();
        let bytes = match written {
            Ok(b) => b,
            Err(e) => {
                let _ = std::fs::remove_file(&partial);
                return Err(e);
            }
        };
        std::fs::hard_link(&partial, &file)
            .with_context(|| format!("cannot put the lease at {} (it is whole at {})", file.display(), partial.display()))?;
        let _ = std::fs::remove_file(&partial);
        Ok((names.len(), bytes))
    })();
    let (sessions, bytes) = match copied {
        Ok(c) => c,
        Err(e) => bail!(
            "lease {} is suspended (its sessions on {server}'s disk), but copying them to {} failed: {e:#}; `rgpu resume {}` lets it run on",
            l.id,
            file.display(),
            l.id
        ),
    };
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "Checkpointed lease {} from {server} to {}: {sessions} session(s), {bytes} bytes in {secs:.3} s, {:.0} MiB/s",
        l.id,
        file.display(),
        bytes as f64 / (1 << 20) as f64 / secs.max(1e-9)
    );
    if a.keep_running {
        resume(&b, id, a.wait)?;
    } else {
        eprintln!("Its programs wait: `rgpu restore {}` (or `rgpu resume {}`) lets them run on", file.display(), l.id);
    }
    Ok(0)
}

/// Resumes a suspended lease and waits until it runs (or waits for its GPUs).
pub(crate) fn resume(b: &BrokerClient, id: u64, wait: u64) -> Result<()> {
    let l = super::suspend::settle(b, b.resume(id)?, wait, |s| s != "resuming" && s != "suspending")?;
    match l.state.as_str() {
        "active" => eprintln!("Resumed lease {}: its programs carry on", l.id),
        "suspended" => eprintln!("Lease {} waits for its GPUs, in use by others: it takes them back once they are free", l.id),
        "resuming" | "suspending" => eprintln!("Lease {} is {}", l.id, l.state),
        s => bail!("lease {} is {s}", l.id),
    }
    Ok(())
}

/// Copies snapshot `name` off `server` into `file`, through `FILE.partial`
/// renamed when whole, so that a file of that name is always a whole snapshot.
fn save(
    server: &str,
    security: &rgpu_tls::ClientSecurity,
    key: &[u8],
    name: &str,
    file: &std::path::Path,
    in_calls: bool,
    limit: Duration,
) -> Result<()> {
    let started = std::time::Instant::now();
    let mut partial = file.as_os_str().to_owned();
    partial.push(".partial");
    let partial = std::path::PathBuf::from(partial);
    let mut out = std::fs::File::create(&partial).with_context(|| format!("cannot create {}", partial.display()))?;
    let read = if in_calls {
        rgpu_control_client::operator::read_snapshot_in_calls
    } else {
        rgpu_control_client::operator::read_snapshot
    };
    let copied = read(server, security, key, name, &mut out, limit)
        .and_then(|n| out.sync_all().map(|()| n).map_err(|e| rgpu_control_client::ControlError::Local { reason: e.to_string() }));
    let bytes = match copied {
        Ok(n) => n,
        Err(e) => {
            let _ = std::fs::remove_file(&partial);
            bail!("the snapshot {name} is on {server}, but copying it to {} failed: {e}", file.display());
        }
    };
    std::fs::hard_link(&partial, file)
        .with_context(|| format!("cannot put the snapshot at {} (it is whole at {})", file.display(), partial.display()))?;
    let _ = std::fs::remove_file(&partial);
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "Saved {name} from {server} to {}: {bytes} bytes in {secs:.3} s, {:.0} MiB/s",
        file.display(),
        bytes as f64 / (1 << 20) as f64 / secs.max(1e-9)
    );
    Ok(())
}
