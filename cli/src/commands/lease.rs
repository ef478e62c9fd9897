//! `rgpu lease`: take a lease and print it, with the environment that runs
//! a program on it.

use anyhow::Result;

use crate::pool::{self, BrokerArgs, LeaseArgs};

/// Lease GPUs (or a fraction of one) from the pool broker.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    broker: BrokerArgs,
    #[command(flatten)]
    lease: LeaseArgs,
    /// Print the lease as JSON on stdout.
    #[arg(long)]
    json: bool,
}

pub fn exec(a: Args) -> Result<i32> {
    let b = a.broker.connect()?;
    let key = a.lease.client_key()?;
    let l = b.lease(&a.lease.bound_spec(10 * 60 * 1000, key.as_ref()))?;
    if a.json {
        pool::json(&l)?;
    } else {
        pool::print_lease(&l);
        eprintln!("To run programs on it, export (and `rgpu release {}` when done):", l.id);
        for (k, v) in pool::lease_env(&l) {
            println!("export {k}={v}");
        }
        if let Some(k) = &key {
            // A path, not a secret: the token is of use only where it is.
            println!("export {}={}", rgpu_control_client::client_key::ENV, k.path.display());
        }
    }
    Ok(0)
}
