//! Waiting for lease moves the broker has started (a drain with
//! `--migrate`, or `rgpu migrate LEASE`) to end, and what each came to.

use std::time::{Duration, Instant};

use anyhow::Result;
use rgpu_broker_client::BrokerClient;

/// One lease's move, as seen when it ended.
#[derive(serde::Serialize)]
pub struct Outcome {
    pub lease: String,
    pub from: String,
    pub to: String,
    pub moved: bool,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub reason: String,
}

/// A move started: (lease, from, to).
pub type Started = (String, String, String);

/// Waits until every move in `waiting` has ended, or `wait_ms` has passed
/// (those are reported not moved, still moving); prints each lease moved as
/// it is seen unless `quiet`.
pub fn wait(client: &BrokerClient, mut waiting: Vec<Started>, wait_ms: u64, quiet: bool) -> Result<Vec<Outcome>> {
    let mut out = Vec::new();
    let until = Instant::now() + Duration::from_millis(wait_ms);
    while !waiting.is_empty() {
        settle(client, &mut waiting, &mut out, quiet)?;
        if waiting.is_empty() {
            break;
        }
        if Instant::now() >= until {
            for (lease, from, to) in waiting.drain(..) {
                let reason = format!("still moving after {wait_ms} ms");
                out.push(Outcome { lease, from, to, moved: false, reason });
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(out)
}

/// Moves the leases whose move ended from `waiting` to `out`.
fn settle(client: &BrokerClient, waiting: &mut Vec<Started>, out: &mut Vec<Outcome>, quiet: bool) -> Result<()> {
    let leases = client.leases("")?;
    waiting.retain(|(lease, from, to)| {
        let Some(l) = leases.iter().find(|l| &l.id == lease) else {
            let reason = "the lease ended during its move".to_string();
            out.push(Outcome { lease: lease.clone(), from: from.clone(), to: to.clone(), moved: false, reason });
            return false;
        };
        if !l.moving_to.is_empty() {
            return true;
        }
        let moved = !l.gpus.is_empty() && l.gpus.iter().all(|g| &g.server == to);
        if moved && !quiet {
            println!("moved {lease}  {from} -> {to}");
        }
        let reason = if moved { String::new() } else { l.move_error.clone() };
        out.push(Outcome { lease: lease.clone(), from: from.clone(), to: to.clone(), moved, reason });
        false
    });
    Ok(())
}

/// Prints the moves that failed, one line each.
pub fn print_failures(out: &[Outcome]) {
    for o in out.iter().filter(|o| !o.moved) {
        println!("not moved {}  {} -> {}: {}", o.lease, o.from, if o.to.is_empty() { "-" } else { &o.to }, o.reason);
    }
}
