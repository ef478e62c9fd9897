//! What `rgpu top` shows, computed from two listings of the pool: rows of
//! servers and leases with rates (device utilisation and traffic since the
//! last refresh), and their sort orders. No terminal code here, so the
//! plain snapshot and the live view show the same numbers.

use std::collections::HashMap;
use std::time::Instant;

use rgpu_broker_client::{BrokerClient, ClientError, LeaseView, ServerView, StatusView, UsageView};

use crate::pool::{bytes, gib, relative};

/// One listing of the pool.
pub struct Listing {
    pub at: Instant,
    pub status: StatusView,
    pub servers: Vec<ServerView>,
    pub leases: Vec<LeaseView>,
}

impl Listing {
    pub fn fetch(c: &BrokerClient) -> Result<Listing, ClientError> {
        Ok(Listing { at: Instant::now(), status: c.status()?, servers: c.servers()?, leases: c.leases("")? })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerSort {
    Name,
    Busy,
    Traffic,
    Free,
}

impl ServerSort {
    pub fn next(self) -> Self {
        match self {
            ServerSort::Name => ServerSort::Busy,
            ServerSort::Busy => ServerSort::Traffic,
            ServerSort::Traffic => ServerSort::Free,
            ServerSort::Free => ServerSort::Name,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            ServerSort::Name => "name",
            ServerSort::Busy => "busy",
            ServerSort::Traffic => "traffic",
            ServerSort::Free => "free GPUs",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseSort {
    Tenant,
    Device,
    Traffic,
    Age,
}

impl LeaseSort {
    pub fn next(self) -> Self {
        match self {
            LeaseSort::Tenant => LeaseSort::Device,
            LeaseSort::Device => LeaseSort::Traffic,
            LeaseSort::Traffic => LeaseSort::Age,
            LeaseSort::Age => LeaseSort::Tenant,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            LeaseSort::Tenant => "tenant",
            LeaseSort::Device => "device time",
            LeaseSort::Traffic => "traffic",
            LeaseSort::Age => "age",
        }
    }
}

/// A server's row.
pub struct ServerRow {
    pub id: String,
    pub state: String,
    pub gpus: u32,
    pub gpus_free: u32,
    pub memory: u64,
    pub memory_used: u64,
    pub leases: u32,
    /// Share of its GPUs' time running kernels since the last listing
    /// (0..=1); None: not known (first listing, or a backend that cannot time kernels).
    pub busy: Option<f64>,
    /// Bytes per second each way since the last listing.
    pub rate_in: Option<f64>,
    pub rate_out: Option<f64>,
    /// Share of its link in use each way (granted, or carried if more, as
    /// placement counts it); None: the link's capacity is not known.
    pub link: Option<f64>,
}

/// Share of a server's link in use: what placement counts (bandwidth
/// granted, or the traffic it reported if that is more) over its capacity.
fn link_share(s: &rgpu_broker_client::ServerView) -> Option<f64> {
    let capacity = s.link_bandwidth?;
    let carried = s.load.map_or(0, |l| l.bytes_in.max(l.bytes_out));
    Some(s.bandwidth_granted.max(carried) as f64 / capacity.max(1) as f64)
}

/// "[####      ] 40%", or "-" for a link of unknown capacity.
pub fn link_cell(x: Option<f64>, width: usize) -> String {
    x.map_or_else(|| "-".into(), |x| format!("{} {}", bar(x, width), percent(Some(x))))
}

/// A lease's row.
pub struct LeaseRow {
    pub id: String,
    pub tenant: String,
    pub gpus: usize,
    pub share: String,
    pub state: String,
    pub expires: String,
    pub granted_ms: u64,
    pub usage: Option<UsageView>,
    pub rate: Option<f64>,
    pub servers: String,
}

pub struct Model {
    pub status: StatusView,
    pub servers: Vec<ServerRow>,
    pub leases: Vec<LeaseRow>,
    pub server_sort: ServerSort,
    pub lease_sort: LeaseSort,
}

fn rate(now: u64, then: u64, secs: f64) -> Option<f64> {
    (secs > 0.0).then(|| now.saturating_sub(then) as f64 / secs)
}

impl Model {
    /// Rows of `now`, with rates against `before` (the previous listing).
    pub fn new(now: &Listing, before: Option<&Listing>, server_sort: ServerSort, lease_sort: LeaseSort) -> Model {
        let secs = before.map_or(0.0, |b| now.at.duration_since(b.at).as_secs_f64());
        let prev_servers: HashMap<&str, UsageView> = before
            .map(|b| b.servers.iter().filter_map(|s| Some((s.id.as_str(), s.usage?))).collect())
            .unwrap_or_default();
        let prev_leases: HashMap<&str, UsageView> = before
            .map(|b| b.leases.iter().filter_map(|l| Some((l.id.as_str(), l.usage?))).collect())
            .unwrap_or_default();
        let mut servers: Vec<ServerRow> = now
            .servers
            .iter()
            .map(|s| {
                let (u, p) = (s.usage, prev_servers.get(s.id.as_str()));
                let pair = u.zip(p.copied());
                let busy = pair.and_then(|(u, p)| {
                    let (a, b) = (u.kernel_ns?, p.kernel_ns?);
                    let gpus = s.gpus.max(1) as f64;
                    rate(a, b, secs).map(|ns_per_s| (ns_per_s / 1e9 / gpus).clamp(0.0, 1.0))
                });
                ServerRow {
                    id: s.id.clone(),
                    state: if s.draining { "draining".into() } else { s.state.clone() },
                    gpus: s.gpus,
                    gpus_free: s.gpus_free,
                    memory: s.memory,
                    memory_used: s.memory_used,
                    leases: s.leases,
                    busy,
                    rate_in: pair.and_then(|(u, p)| rate(u.bytes_in, p.bytes_in, secs)),
                    rate_out: pair.and_then(|(u, p)| rate(u.bytes_out, p.bytes_out, secs)),
                    link: link_share(s),
                }
            })
            .collect();
        let mut leases: Vec<LeaseRow> = now
            .leases
            .iter()
            .map(|l| {
                let p = prev_leases.get(l.id.as_str());
                let r = l.usage.zip(p.copied()).and_then(|(u, p)| rate(u.bytes_in + u.bytes_out, p.bytes_in + p.bytes_out, secs));
                LeaseRow {
                    id: l.id.clone(),
                    tenant: l.tenant.clone(),
                    gpus: l.gpus.len(),
                    share: if l.memory_limit > 0 { gib(l.memory_limit) } else { "whole".into() },
                    state: l.state.clone(),
                    expires: relative(l.deadline_ms),
                    granted_ms: l.granted_ms,
                    usage: l.usage,
                    rate: r,
                    servers: l.servers().join(","),
                }
            })
            .collect();
        let key = |x: Option<f64>| std::cmp::Reverse((x.unwrap_or(-1.0) * 1e6) as i64);
        match server_sort {
            ServerSort::Name => servers.sort_by(|a, b| a.id.cmp(&b.id)),
            ServerSort::Busy => servers.sort_by_key(|s| key(s.busy)),
            ServerSort::Traffic => servers.sort_by_key(|s| key(s.rate_in.zip(s.rate_out).map(|(a, b)| a + b))),
            ServerSort::Free => servers.sort_by_key(|s| std::cmp::Reverse(s.gpus_free)),
        }
        match lease_sort {
            LeaseSort::Tenant => leases.sort_by(|a, b| (&a.tenant, &a.id).cmp(&(&b.tenant, &b.id))),
            LeaseSort::Device => {
                leases.sort_by_key(|l| std::cmp::Reverse(l.usage.and_then(|u| u.kernel_ns).unwrap_or(0)))
            }
            LeaseSort::Traffic => leases.sort_by_key(|l| key(l.rate)),
            LeaseSort::Age => leases.sort_by_key(|l| l.granted_ms),
        }
        Model { status: now.status.clone(), servers, leases, server_sort, lease_sort }
    }

    pub fn header(&self) -> String {
        let s = &self.status;
        format!(
            "rgpu top  servers {}/{} up  GPUs {} free of {}  leases {}  queued {}  policy {}",
            s.servers_up, s.servers, s.gpus_free, s.gpus, s.leases, s.queued, s.policy
        )
    }
}

/// "12.3MiB/s", or "-".
pub fn per_second(r: Option<f64>) -> String {
    r.map_or_else(|| "-".into(), |r| format!("{}/s", bytes(r as u64)))
}

/// "37%", or "-".
pub fn percent(x: Option<f64>) -> String {
    x.map_or_else(|| "-".into(), |x| format!("{:.0}%", x * 100.0))
}

/// A text bar of `width` cells for a share 0..=1: `[####      ]`.
pub fn bar(x: f64, width: usize) -> String {
    let n = ((x.clamp(0.0, 1.0) * width as f64).round() as usize).min(width);
    format!("[{}{}]", "#".repeat(n), " ".repeat(width - n))
}

/// The plain snapshot (stdout not a terminal): the same rows as text.
pub fn plain(m: &Model) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(o, "{}", m.header());
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "{:<22}  {:<11}  {:>9}  {:<14}  {:<14}  {:>6}  {:>6}  {:>11}  {:>11}  LINK",
        "SERVER", "STATE", "GPUS FREE", "GPUS LEASED", "MEMORY", "BUSY", "LEASES", "IN", "OUT"
    );
    for s in &m.servers {
        let leased = (s.gpus - s.gpus_free.min(s.gpus)) as f64 / s.gpus.max(1) as f64;
        let mem = s.memory_used as f64 / s.memory.max(1) as f64;
        let _ = writeln!(
            o,
            "{:<22}  {:<11}  {:>4}/{:<4}  {:<14}  {:<14}  {:>6}  {:>6}  {:>11}  {:>11}  {}",
            s.id,
            s.state,
            s.gpus_free,
            s.gpus,
            bar(leased, 12),
            bar(mem, 12),
            percent(s.busy),
            s.leases,
            per_second(s.rate_in),
            per_second(s.rate_out),
            link_cell(s.link, 12)
        );
    }
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "{:<16}  {:<10}  {:>4}  {:>8}  {:<7}  {:>10}  {:>8}  {:>9}  {:>9}  {:<10}  SERVERS",
        "LEASE", "TENANT", "GPUS", "SHARE", "STATE", "DEVICE", "KERNELS", "IN", "OUT", "EXPIRES"
    );
    for l in &m.leases {
        let u = crate::pool::UseCells::of(l.usage.as_ref());
        let _ = writeln!(
            o,
            "{:<16}  {:<10}  {:>4}  {:>8}  {:<7}  {:>10}  {:>8}  {:>9}  {:>9}  {:<10}  {}",
            l.id, l.tenant, l.gpus, l.share, l.state, u.device, u.kernels, u.bytes_in, u.bytes_out, l.expires, l.servers
        );
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_and_rates() {
        assert_eq!(bar(0.5, 4), "[##  ]");
        assert_eq!(bar(2.0, 3), "[###]");
        assert_eq!(bar(f64::NAN, 2), "[  ]");
        assert_eq!(percent(Some(0.374)), "37%");
        assert_eq!(per_second(None), "-");
        assert_eq!(rate(300, 100, 2.0), Some(100.0));
        assert_eq!(rate(100, 300, 2.0), Some(0.0), "a restarted server's counters went down");
        assert_eq!(rate(1, 0, 0.0), None);
        assert_eq!(link_cell(Some(0.4), 5), "[##   ] 40%");
        assert_eq!(link_cell(None, 5), "-");
    }

    #[test]
    fn a_links_use_is_what_placement_counts() {
        let mut s = rgpu_broker_client::ServerView { link_bandwidth: Some(1000), bandwidth_granted: 250, ..Default::default() };
        assert_eq!(link_share(&s), Some(0.25), "granted, nothing carried");
        s.load = Some(rgpu_broker_client::LoadView { bytes_in: 100, bytes_out: 600 });
        assert_eq!(link_share(&s), Some(0.6), "carried more than granted");
        s.link_bandwidth = None;
        assert_eq!(link_share(&s), None, "an unbounded link has no share");
    }
}
