//! `rgpu top [--interval 2s]`

use std::time::Duration;

use anyhow::{bail, Result};
use rgpu_broker_client::duration::parse_duration_ms;

use crate::pool::BrokerArgs;

/// A live view of the pool: servers with GPU, memory and device-time bars,
/// leases and their tenants, traffic. Keys: q quit, s sort servers, l sort
/// leases, r refresh. With stdout not a terminal, one plain snapshot.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    broker: BrokerArgs,
    /// Time between refreshes (e.g. 500ms, 2s) [default: 2s].
    #[arg(long, value_name = "DURATION", value_parser = parse_duration_ms, default_value = "2s")]
    interval: u64,
}

pub fn exec(a: Args) -> Result<i32> {
    if a.interval < 100 {
        bail!("--interval must be at least 100ms");
    }
    let client = a.broker.connect()?;
    crate::top::run(&client, Duration::from_millis(a.interval))
}
