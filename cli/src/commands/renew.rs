//! `rgpu renew LEASE [--ttl D]`

use anyhow::{Context, Result};
use rgpu_broker_client::parse_lease_id;
use rgpu_broker_client::duration::parse_duration_ms;

use crate::pool::{self, BrokerArgs};

/// Extend a lease's deadline.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    broker: BrokerArgs,
    /// The lease id (16 hex digits).
    lease: String,
    /// New time to live from now [default: the lease's own].
    #[arg(long, value_parser = parse_duration_ms)]
    ttl: Option<u64>,
    /// Print the result as JSON on stdout.
    #[arg(long)]
    json: bool,
}

pub fn exec(a: Args) -> Result<i32> {
    let id = parse_lease_id(&a.lease).with_context(|| format!("invalid lease id {:?}", a.lease))?;
    let l = a.broker.connect()?.renew(id, a.ttl.unwrap_or(0))?;
    if a.json {
        pool::json(&l)?;
    } else {
        eprintln!("Renewed lease {}: expires {}", l.id, pool::relative(l.deadline_ms));
    }
    Ok(0)
}
