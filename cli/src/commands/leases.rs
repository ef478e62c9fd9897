//! `rgpu leases [--tenant T] [--json]`

use anyhow::Result;

use crate::pool::{self, BrokerArgs};

/// List live leases.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    broker: BrokerArgs,
    /// Only this tenant's leases (operators; a user sees its own only).
    #[arg(long)]
    tenant: Option<String>,
    /// Print JSON on stdout instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn exec(a: Args) -> Result<i32> {
    let leases = a.broker.connect()?.leases(a.tenant.as_deref().unwrap_or(""))?;
    if a.json {
        pool::json(&leases)?;
    } else {
        pool::lease_table(&leases);
    }
    Ok(0)
}
