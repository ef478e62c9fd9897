//! `rgpu status [--json]`

use anyhow::Result;

use crate::pool::{self, BrokerArgs};

/// The pool at a glance.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    broker: BrokerArgs,
    /// Print JSON on stdout instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn exec(a: Args) -> Result<i32> {
    let s = a.broker.connect()?.status()?;
    if a.json {
        pool::json(&s)?;
    } else {
        println!("broker     {} (up {}s, data {})", a.broker.broker, s.uptime_ms / 1000, s.data_dir);
        println!("servers    {} ({} up)", s.servers, s.servers_up);
        println!("gpus       {} ({} free)", s.gpus, s.gpus_free);
        println!("leases     {} ({} queued)", s.leases, s.queued);
        println!("generation {}   policy {}", s.generation, s.policy);
    }
    Ok(0)
}
