//! `rgpu checkpoint SESSION --server ADDR --to NAME [--save FILE] --key-file FILE`

use std::time::Duration;

use anyhow::{bail, Result};

use crate::operator::parse_session;

/// Write a running session's state to a snapshot on its server (docs/migration.md).
///
/// The session is held still (its queued work finished first) while it is
/// written; its program waits, its calls do not fail. By default the session
/// then leaves the server, and its program waits until the snapshot is
/// restored (`rgpu restore`), within its RGPU_HOLD_TIMEOUT (an hour by
/// default).
#[derive(clap::Args)]
pub struct Args {
    /// The session's id, as the server logs it at attach (`session{id=0x...}`).
    session: String,
    /// The server holding the session (host:port).
    #[arg(long)]
    server: String,
    /// The snapshot's name in the server's --checkpoint-dir (a file name, not a path).
    #[arg(long)]
    to: String,
    /// Also copy the snapshot off the server into FILE (a new file), so that
    /// it outlives the server's disk: `rgpu restore NAME --load FILE` puts
    /// it on any server again.
    #[arg(long, value_name = "FILE")]
    save: Option<std::path::PathBuf>,
    /// Copy with --save in control-plane calls, one piece each, as servers
    /// before the one-stream copy took it (slower; chosen by itself for
    /// such a server).
    #[arg(long, requires = "save")]
    copy_in_calls: bool,
    /// Keep serving the session on this server after it is written.
    #[arg(long = "continue")]
    keep_running: bool,
    /// How long to wait for the session's queued work to finish, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    quiesce_ms: u32,
    /// How long the whole call may take, in seconds.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    #[command(flatten)]
    operator: crate::operator::OperatorArgs,
}

pub fn exec(a: Args) -> Result<i32> {
    let session = parse_session(&a.session)?;
    if !rgpu_protocol::auth::valid_snapshot_name(&a.to) {
        bail!("--to {:?}: a snapshot name is 1-128 of A-Za-z0-9._- not starting with a dot", a.to);
    }
    if let Some(f) = &a.save {
        if f.exists() {
            bail!("--save {}: the file exists; name a new one", f.display());
        }
    }
    let (key, security) = a.operator.open()?;
    let r = rgpu_control_client::operator::checkpoint(
        &a.server,
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
        "Checkpointed session {session:#x} on {} as {}: {} bytes ({} of device memory) in {:.3} s, {:.0} MiB/s{}",
        a.server,
        a.to,
        r.bytes,
        r.memory_bytes,
        secs,
        r.bytes as f64 / (1 << 20) as f64 / secs.max(1e-9),
        if a.keep_running { "" } else { "; the session left the server until it is restored" }
    );
    if let Some(file) = &a.save {
        save(&a.server, &security, &key, &a.to, file, a.copy_in_calls, Duration::from_secs(a.timeout))?;
    }
    Ok(0)
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
    use anyhow::Context as _;
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
