//! `rgpu servers [--json]`

use anyhow::Result;

use crate::pool::{self, BrokerArgs};

/// List the pool's GPU servers: state, use, drain progress.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    broker: BrokerArgs,
    /// Print JSON on stdout instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn exec(a: Args) -> Result<i32> {
    let servers = a.broker.connect()?.servers()?;
    if a.json {
        pool::json(&servers)?;
    } else {
        pool::server_table(&servers);
    }
    Ok(0)
}
