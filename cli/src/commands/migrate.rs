//! `rgpu migrate SESSION --server ADDR --to TARGET --key-file FILE`, and
//! `rgpu migrate LEASE [--to SERVER]` through the broker.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use rgpu_broker_client::duration::parse_duration_ms;
use rgpu_broker_client::parse_lease_id;

use crate::moves;
use crate::operator::parse_session;
use crate::pool::{self, BrokerArgs};

/// Move a running session, or a lease with all its sessions, to another GPU
/// server while its programs run (docs/migration.md, live migration).
///
/// A session: `rgpu migrate SESSION --server FROM --to TO --key-file K`.
/// The session is held still (its queued work finished first), its state
/// goes from server to server, and its program carries on at the target:
/// its calls wait, none fails. Both servers need the same --admin-key-file;
/// on any failure the session goes on where it was.
///
/// A lease: `rgpu migrate LEASE [--to SERVER]` (an operator of the broker).
/// The broker moves the lease to SERVER, or to the first server that can
/// take it, as `rgpu drain --migrate` moves one, updates the lease and
/// fences its old placement; this waits for the move to end.
#[derive(clap::Args)]
pub struct Args {
    /// A session id (with --server) or a lease id (without it).
    id: String,
    /// The server holding the session (host:port). Without it, ID is a
    /// lease, moved through the broker.
    #[arg(long)]
    server: Option<String>,
    /// The server to move to (host:port, as its clients reach it; for a
    /// lease, as `rgpu servers` lists it). A lease without it goes to the
    /// first server that can take it.
    #[arg(long)]
    to: Option<String>,
    /// How long to wait for the session's queued work to finish, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    quiesce_ms: u32,
    /// How long the whole call may take, in seconds (a session).
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    /// How long to wait for a lease's move to end.
    #[arg(long, value_parser = parse_duration_ms, default_value = "150s")]
    wait: u64,
    /// The server's admin key file (its --admin-key-file), for a session
    /// [default: --admin-key-file].
    #[arg(long, value_name = "FILE")]
    key_file: Option<PathBuf>,
    /// Print a lease's move as JSON on stdout.
    #[arg(long)]
    json: bool,
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
    let Some(to) = &a.to else { bail!("moving a session needs --to: the server to move it to") };
    let key = crate::operator::server_key(a.key_file.as_deref(), &a.broker)?;
    let r = rgpu_control_client::operator::migrate(
        server,
        &a.broker.tls.security()?,
        &key,
        session,
        to,
        Duration::from_millis(a.quiesce_ms as u64),
        Duration::from_secs(a.timeout),
    )?;
    let secs = r.took.as_secs_f64();
    eprintln!(
        "Migrated session {session:#x} from {server} to {to}: {} bytes of device memory in {:.3} s; {} sent while it ran, {} while the program was held {:.1} ms",
        r.memory_bytes,
        secs,
        r.precopied,
        r.sent_held,
        r.paused.as_secs_f64() * 1e3,
    );
    Ok(0)
}

fn lease(a: &Args) -> Result<i32> {
    let id = parse_lease_id(&a.id).with_context(|| format!("{:?} is not a lease id; a session needs --server", a.id))?;
    let client = a.broker.connect()?;
    let l = client.move_lease(id, a.to.as_deref().unwrap_or(""))?;
    let from = l.gpus.first().map(|g| g.server.clone()).unwrap_or_default();
    if !a.json {
        eprintln!("Moving lease {} from {from} to {}", l.id, l.moving_to);
    }
    let out = moves::wait(&client, vec![(l.id.clone(), from, l.moving_to.clone())], a.wait, a.json)?;
    if a.json {
        pool::json(&out)?;
    } else {
        moves::print_failures(&out);
    }
    Ok(if out.iter().all(|o| o.moved) { 0 } else { 1 })
}
