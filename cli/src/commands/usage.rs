//! `rgpu usage [--tenant T] [--since DURATION] [--json]`

use anyhow::Result;
use rgpu_broker_client::duration::parse_duration_ms;

use crate::pool::{self, BrokerArgs};

/// Accounting: what leases used (device time, kernels, bytes each way,
/// memory high-water mark), ended ones from the broker's durable records,
/// then live ones so far. A user sees its own tenant's; an admin any.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    broker: BrokerArgs,
    /// Only this tenant's leases (operators and admins; a user sees its own only).
    #[arg(long)]
    tenant: Option<String>,
    /// Only leases that ended this long ago or later (e.g. 24h, 7d; live
    /// leases are always shown) [default: all records].
    #[arg(long, value_name = "DURATION", value_parser = parse_duration_ms)]
    since: Option<u64>,
    /// At most this many records, the newest [default: 1000].
    #[arg(long, default_value_t = 1000)]
    limit: u32,
    /// Print JSON on stdout instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn exec(a: Args) -> Result<i32> {
    let since = a.since.map_or(0, |d| pool::now_ms().saturating_sub(d));
    let records = a.broker.connect()?.usage(a.tenant.as_deref().unwrap_or(""), since, a.limit)?;
    if a.json {
        pool::json(&records)?;
    } else {
        pool::usage_table(&records);
    }
    Ok(0)
}
