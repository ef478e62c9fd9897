//! `rgpu restore NAME --server ADDR [--load FILE] --key-file FILE`, and
//! `rgpu restore FILE` of a lease `rgpu checkpoint LEASE --to FILE` kept.

use std::io::{Read, Seek};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::lease_file;
use crate::operator::server_key;
use crate::pool::BrokerArgs;

/// Rebuild a session from a snapshot, or a suspended lease from its file;
/// the programs resume by themselves (docs/migration.md).
///
/// A session: `rgpu restore NAME --server ADDR`, from the snapshot NAME in
/// the server's --checkpoint-dir.
///
/// A lease: `rgpu restore FILE` (an operator of the broker and of the
/// lease's server), FILE from `rgpu checkpoint LEASE --to FILE`. The lease
/// must still be suspended; each snapshot its server no longer has (its
/// disk lost or wiped) is copied back onto it, then the lease resumes there.
#[derive(clap::Args)]
pub struct Args {
    /// The snapshot's name in the server's --checkpoint-dir (with
    /// --server), or a lease's file (without it).
    name: String,
    /// The server to rebuild the session on (host:port): the address its
    /// program reconnects to, the one the session was served at. Without
    /// it, NAME is a lease's file.
    #[arg(long)]
    server: Option<String>,
    /// The server the session was checkpointed on, when that is not
    /// --server: once restored, the session is forwarded from there, and
    /// its program's next resume there is redirected here.
    #[arg(long, value_name = "ADDR", requires = "server")]
    forward_from: Option<String>,
    /// First copy the snapshot from FILE (one `rgpu checkpoint --save`
    /// wrote) onto the server as NAME: a checkpoint restored on a server
    /// other than the one that wrote it, or after that server's disk is gone.
    #[arg(long, value_name = "FILE", requires = "server")]
    load: Option<std::path::PathBuf>,
    /// Copy with --load in control-plane calls, one piece each, as servers
    /// before the one-stream copy took it (slower; chosen by itself for
    /// such a server).
    #[arg(long, requires = "load")]
    copy_in_calls: bool,
    /// How long the whole call may take, in seconds (each copy, for a lease).
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    /// A lease: how long to wait for it to run again.
    #[arg(long, value_parser = rgpu_broker_client::duration::parse_duration_ms, default_value = "120s")]
    wait: u64,
    /// The server's admin key file (its --admin-key-file) [default: --admin-key-file].
    #[arg(long, value_name = "FILE")]
    key_file: Option<PathBuf>,
    #[command(flatten)]
    broker: BrokerArgs,
}

/// Copies back onto the lease's server what it no longer has of the
/// lease's file, then resumes the lease.
fn lease(a: &Args) -> Result<i32> {
    let path = PathBuf::from(&a.name);
    let mut f = std::fs::File::open(&path).with_context(|| format!("cannot open {}", path.display()))?;
    let len = f.metadata().with_context(|| format!("cannot read {}", path.display()))?.len();
    let mut r = std::io::BufReader::new(&mut f);
    let h = lease_file::read_header(&mut r).with_context(|| path.display().to_string())?;
    let lease_id = rgpu_broker_client::format_lease_id(h.lease);
    let key = server_key(a.key_file.as_deref(), &a.broker)?;
    let security = a.broker.tls.security()?;
    let b = a.broker.connect()?;
    let Some(l) = b.leases("")?.into_iter().find(|l| l.id == lease_id) else {
        bail!("lease {lease_id} has ended: there is nothing to restore it into (its programs were told)");
    };
    if l.state != "suspended" {
        bail!("lease {lease_id} is {}, not suspended: restoring its file would take its programs back in time", l.state);
    }
    let Some(server) = l.gpus.first().map(|g| g.server.clone()) else { bail!("lease {lease_id} holds no GPU") };
    let limit = Duration::from_secs(a.timeout);
    let there = rgpu_control_client::operator::list_suspended(&server, &security, &key, h.lease, limit)?;
    let started = std::time::Instant::now();
    let (mut copied, mut bytes) = (0usize, 0u64);
    for _ in 0..h.count {
        let at = r.stream_position()?;
        let (name, size) = lease_file::read_entry(&mut r, len.saturating_sub(at)).with_context(|| path.display().to_string())?;
        if !name.starts_with(&format!("preempt-{:016x}-", h.lease)) {
            bail!("{}: {name} is not a snapshot of lease {lease_id}'s suspension", path.display());
        }
        if there.contains(&name) {
            // The server kept it: the copy it holds is the one to resume.
            std::io::copy(&mut (&mut r).take(size), &mut std::io::sink())?;
            continue;
        }
        let mut body = (&mut r).take(size);
        rgpu_control_client::operator::write_snapshot(&server, &security, &key, &name, &mut body, size, limit)
            .with_context(|| format!("copying {name} onto {server}"))?;
        copied += 1;
        bytes += size;
    }
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "Lease {lease_id}: {copied} of {} snapshot(s) copied back onto {server} ({bytes} bytes in {secs:.3} s); {} were still there",
        h.count,
        h.count as usize - copied
    );
    super::checkpoint::resume(&b, h.lease, a.wait)?;
    Ok(0)
}

pub fn exec(a: Args) -> Result<i32> {
    let Some(server) = a.server.clone() else { return lease(&a) };
    if !rgpu_protocol::auth::valid_snapshot_name(&a.name) {
        bail!("{:?}: a snapshot name is 1-128 of A-Za-z0-9._- not starting with a dot", a.name);
    }
    let key = server_key(a.key_file.as_deref(), &a.broker)?;
    let security = a.broker.tls.security()?;
    if let Some(file) = &a.load {
        let started = std::time::Instant::now();
        let mut f = std::fs::File::open(file).with_context(|| format!("cannot open {}", file.display()))?;
        let size = f.metadata().with_context(|| format!("cannot read {}", file.display()))?.len();
        let write = if a.copy_in_calls {
            rgpu_control_client::operator::write_snapshot_in_calls
        } else {
            rgpu_control_client::operator::write_snapshot
        };
        write(&server, &security, &key, &a.name, &mut f, size, Duration::from_secs(a.timeout))?;
        let secs = started.elapsed().as_secs_f64();
        eprintln!(
            "Copied {} onto {} as {}: {size} bytes in {secs:.3} s, {:.0} MiB/s",
            file.display(),
            server,
            a.name,
            size as f64 / (1 << 20) as f64 / secs.max(1e-9)
        );
    }
    let r = rgpu_control_client::operator::restore(&server, &security, &key, &a.name, Duration::from_secs(a.timeout))?;
    let secs = r.took.as_secs_f64();
    eprintln!(
        "Restored session {:#x} on {} from {}: {} bytes ({} of device memory) in {:.3} s, {:.0} MiB/s; waiting for its program to resume",
        r.session,
        server,
        a.name,
        r.bytes,
        r.memory_bytes,
        secs,
        r.bytes as f64 / (1 << 20) as f64 / secs.max(1e-9)
    );
    if let Some(from) = a.forward_from.as_deref().filter(|f| *f != server) {
        let limit = Duration::from_secs(a.timeout);
        if let Err(e) = rgpu_control_client::operator::forward(from, &security, &key, r.session, &server, limit) {
            bail!(
                "the session is restored on {}, but {from} did not forward it: {e}
                   its program keeps trying {from} until its RGPU_RECONNECT_TIMEOUT; retry with                  `rgpu restore` of a new checkpoint, or restart its program",
                server
            );
        }
        eprintln!("Session {:#x} forwarded from {from}: its program's next resume there is sent here", r.session);
    }
    Ok(0)
}
