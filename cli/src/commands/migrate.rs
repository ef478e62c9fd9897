//! `rgpu migrate SESSION --server ADDR --to TARGET --key-file FILE`

use std::time::Duration;

use anyhow::Result;

use crate::operator::parse_session;

/// Move a running session to another GPU server while its program runs
/// (docs/migration.md, live migration).
///
/// The session is held still (its queued work finished first), its state
/// goes from server to server, and its program carries on at the target:
/// its calls wait, none fails. Both servers need the same --admin-key-file;
/// on any failure the session goes on where it was.
#[derive(clap::Args)]
pub struct Args {
    /// The session's id, as the server logs it at attach (`session{id=0x...}`).
    session: String,
    /// The server holding the session (host:port).
    #[arg(long)]
    server: String,
    /// The server to move it to (host:port, as its clients reach it).
    #[arg(long)]
    to: String,
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
    let (key, security) = a.operator.open()?;
    let r = rgpu_control_client::operator::migrate(
        &a.server,
        &security,
        &key,
        session,
        &a.to,
        Duration::from_millis(a.quiesce_ms as u64),
        Duration::from_secs(a.timeout),
    )?;
    let secs = r.took.as_secs_f64();
    eprintln!(
        "Migrated session {session:#x} from {} to {}: {} bytes of device memory in {:.3} s; {} sent while it ran, {} while the program was held {:.1} ms",
        a.server,
        a.to,
        r.memory_bytes,
        secs,
        r.precopied,
        r.sent_held,
        r.paused.as_secs_f64() * 1e3,
    );
    Ok(0)
}
