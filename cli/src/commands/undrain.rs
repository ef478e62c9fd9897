//! `rgpu undrain SERVER`

use anyhow::Result;

use crate::pool::{self, BrokerArgs};

/// Put a drained server back in service.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    broker: BrokerArgs,
    server: String,
    /// Print the result as JSON on stdout.
    #[arg(long)]
    json: bool,
}

pub fn exec(a: Args) -> Result<i32> {
    let s = a.broker.connect()?.undrain(&a.server)?;
    if a.json {
        pool::json(&s)?;
    } else {
        eprintln!("{} is back in service ({} of {} GPUs free)", s.id, s.gpus_free, s.gpus);
    }
    Ok(0)
}
