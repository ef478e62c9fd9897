//! `rgpu audit [--tenant T] [--limit N] [--json]`

use anyhow::Result;

use crate::pool::{self, BrokerArgs};

/// The broker's audit log: who leased, renewed, released, drained,
/// registered or logged in, from where (operators).
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    broker: BrokerArgs,
    /// Only what this tenant did (or what was done to it).
    #[arg(long)]
    tenant: Option<String>,
    /// The newest this many records.
    #[arg(long, default_value_t = 50)]
    limit: u32,
    /// Print JSON on stdout instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn exec(a: Args) -> Result<i32> {
    let records = a.broker.connect()?.audit(a.tenant.as_deref().unwrap_or(""), a.limit)?;
    if a.json {
        pool::json(&records)?;
    } else {
        pool::audit_table(&records);
    }
    Ok(0)
}
