//! `rgpu checkpoint SESSION --server ADDR --to NAME --key-file FILE`

use std::time::Duration;

use anyhow::{bail, Result};

use crate::operator::parse_session;

/// Write a running session's state to a snapshot on its server (docs/migration.md).
///
/// The session is held still (its queued work finished first) while it is
/// written; its program waits, its calls do not fail. By default the session
/// then leaves the server: its program keeps trying to resume until the
/// snapshot is restored (`rgpu restore`), within its RGPU_RECONNECT_TIMEOUT.
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
    Ok(0)
}
