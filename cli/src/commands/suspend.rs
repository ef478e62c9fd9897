//! `rgpu suspend LEASE [--wait D]` and `rgpu resume LEASE [--wait D]`

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rgpu_broker_client::duration::parse_duration_ms;
use rgpu_broker_client::{parse_lease_id, BrokerClient, LeaseView};

use crate::pool::{self, BrokerArgs};

/// Park a lease on its server's disk, its GPUs freed, until `rgpu resume`
///
/// Its server writes its programs' sessions to disk and ends them; the
/// programs wait, their calls do not fail (docs/migration.md "Preemption").
#[derive(clap::Args)]
pub struct SuspendArgs {
    #[command(flatten)]
    on: LeaseArgs,
}

/// Let a suspended lease run again where it was
///
/// It takes its own GPUs back once they are free (and nothing of higher
/// priority waits for them), and its programs carry on where they were.
#[derive(clap::Args)]
pub struct ResumeArgs {
    #[command(flatten)]
    on: LeaseArgs,
}

#[derive(clap::Args)]
struct LeaseArgs {
    #[command(flatten)]
    broker: BrokerArgs,
    /// The lease id (16 hex digits).
    lease: String,
    /// How long to wait for the server to have written the lease (suspend)
    /// or restored it (resume); 0: return once asked.
    #[arg(long, value_parser = parse_duration_ms, default_value = "120s")]
    wait: u64,
    /// Print the lease as JSON on stdout.
    #[arg(long)]
    json: bool,
}

impl LeaseArgs {
    /// Asks `op` of the broker for the lease, then waits until `done(state)`.
    fn run(&self, op: impl Fn(&BrokerClient, u64) -> Result<LeaseView, rgpu_broker_client::ClientError>, done: impl Fn(&str) -> bool) -> Result<LeaseView> {
        let id = parse_lease_id(&self.lease).with_context(|| format!("invalid lease id {:?}", self.lease))?;
        let b = self.broker.connect()?;
        let l = settle(&b, op(&b, id)?, self.wait, done)?;
        if self.json {
            pool::json(&l)?;
        }
        Ok(l)
    }
}

pub fn suspend(a: SuspendArgs) -> Result<i32> {
    let l = a.on.run(BrokerClient::suspend, |s| s != "suspending")?;
    match l.state.as_str() {
        "suspended" => eprintln!("Suspended lease {}: its sessions are on its server's disk and its GPUs free; `rgpu resume {}` brings it back", l.id, l.id),
        "suspending" => eprintln!("Lease {} is being suspended (its server is writing its sessions)", l.id),
        "active" if !l.move_error.is_empty() => bail!("lease {} was not suspended: {}; it runs on", l.id, l.move_error),
        s => eprintln!("Lease {} is {s}", l.id),
    }
    Ok(0)
}

pub fn resume(a: ResumeArgs) -> Result<i32> {
    // Waits while it is on the way back; a lease whose GPUs are taken
    // stays `suspended`, and waiting would not help.
    let l = a.on.run(BrokerClient::resume, |s| s != "resuming" && s != "suspending")?;
    match l.state.as_str() {
        "active" => eprintln!("Resumed lease {}: its programs carry on", l.id),
        "resuming" => eprintln!("Lease {} is resuming (its server is restoring its sessions)", l.id),
        "suspended" => eprintln!("Lease {} waits for its GPUs, in use by others: it takes them back once they are free", l.id),
        s => eprintln!("Lease {} is {s}", l.id),
    }
    Ok(0)
}

/// Polls the lease until `done(state)` or `wait_ms` have passed; a lease
/// that ended meanwhile is an error.
pub(crate) fn settle(b: &BrokerClient, mut l: LeaseView, wait_ms: u64, done: impl Fn(&str) -> bool) -> Result<LeaseView> {
    let until = Instant::now() + Duration::from_millis(wait_ms);
    while !done(&l.state) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(100));
        l = match b.leases("")?.into_iter().find(|x| x.id == l.id) {
            Some(x) => x,
            None => bail!("lease {} ended", l.id),
        };
    }
    Ok(l)
}
