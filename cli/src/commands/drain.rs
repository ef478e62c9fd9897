//! `rgpu drain SERVER [--deadline D]`

use anyhow::Result;
use rgpu_broker_client::duration::parse_duration_ms;

use crate::pool::{self, BrokerArgs};

/// Stop new grants on a server; with --deadline, revoke what is left then.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    broker: BrokerArgs,
    /// The server, as `rgpu servers` lists it (host:port).
    server: String,
    /// Revoke the leases still there after this long (e.g. 10m).
    #[arg(long, value_parser = parse_duration_ms)]
    deadline: Option<u64>,
    /// Print the result as JSON on stdout.
    #[arg(long)]
    json: bool,
}

pub fn exec(a: Args) -> Result<i32> {
    let deadline = a.deadline.map_or(0, |d| pool::now_ms() + d);
    let s = a.broker.connect()?.drain(&a.server, deadline)?;
    if a.json {
        pool::json(&s)?;
    } else {
        let when = if deadline == 0 { "when they end".to_string() } else { pool::relative(deadline) };
        eprintln!("Draining {}: no new leases; {} lease(s) left, revoked {when}", s.id, s.leases);
    }
    Ok(0)
}
