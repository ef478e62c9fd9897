//! `rgpu drain SERVER [--deadline D] [--migrate]`

use anyhow::Result;
use rgpu_broker_client::duration::parse_duration_ms;

use crate::moves::{self, Outcome};
use crate::pool::{self, BrokerArgs};

/// Stop new grants on a server; with --deadline, revoke what is left then;
/// with --migrate, move it elsewhere live.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    broker: BrokerArgs,
    /// The server, as `rgpu servers` lists it (host:port).
    server: String,
    /// Revoke the leases still there after this long (e.g. 10m).
    #[arg(long, value_parser = parse_duration_ms)]
    deadline: Option<u64>,
    /// Move each lease to a server that can take it (same GPU model and
    /// count, free GPUs at the same ordinals), its programs running on;
    /// waits and prints each lease moved and each that could not move.
    #[arg(long)]
    migrate: bool,
    /// With --migrate: stop waiting for the moves after this long.
    #[arg(long, value_parser = parse_duration_ms, default_value = "150s")]
    wait: u64,
    /// Print the result as JSON on stdout.
    #[arg(long)]
    json: bool,
}

pub fn exec(a: Args) -> Result<i32> {
    let deadline = a.deadline.map_or(0, |d| pool::now_ms() + d);
    let client = a.broker.connect()?;
    if !a.migrate {
        let s = client.drain(&a.server, deadline)?;
        if a.json {
            pool::json(&s)?;
        } else {
            let when = if deadline == 0 { "when they end".to_string() } else { pool::relative(deadline) };
            eprintln!("Draining {}: no new leases; {} lease(s) left, revoked {when}", s.id, s.leases);
        }
        return Ok(0);
    }
    let (s, plan) = client.drain_migrate(&a.server, deadline)?;
    if !a.json {
        eprintln!("Draining {}: no new leases; moving {} lease(s)", s.id, plan.iter().filter(|p| !p.target.is_empty()).count());
    }
    let mut out = Vec::new();
    let mut waiting = Vec::new();
    for p in plan {
        if p.target.is_empty() {
            out.push(Outcome { lease: p.lease, from: s.id.clone(), to: String::new(), moved: false, reason: p.reason });
        } else {
            waiting.push((p.lease, s.id.clone(), p.target));
        }
    }
    out.extend(moves::wait(&client, waiting, a.wait, a.json)?);
    let failed = out.iter().filter(|o| !o.moved).count();
    if a.json {
        pool::json(&out)?;
    } else {
        moves::print_failures(&out);
        let when = if deadline == 0 { "when they end".to_string() } else { pool::relative(deadline) };
        eprintln!("{} lease(s) moved, {failed} not (those stay on {}, revoked {when})", out.len() - failed, s.id);
    }
    Ok(if failed == 0 { 0 } else { 1 })
}
