//! `rgpu release LEASE...`

use anyhow::{Context, Result};
use rgpu_broker_client::parse_lease_id;

use crate::pool::BrokerArgs;

/// Release leases (releasing one that already ended is not an error).
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    broker: BrokerArgs,
    /// Lease ids.
    #[arg(required = true)]
    leases: Vec<String>,
}

pub fn exec(a: Args) -> Result<i32> {
    let b = a.broker.connect()?;
    for s in &a.leases {
        let id = parse_lease_id(s).with_context(|| format!("invalid lease id {s:?}"))?;
        if b.release(id)? {
            eprintln!("Released lease {s}");
        } else {
            eprintln!("Lease {s} had already ended");
        }
    }
    Ok(0)
}
