//! What the broker subcommands share: the broker address and the
//! credential to log in with, `--json`, the lease request flags, and
//! human-readable tables (stdout), status lines (stderr).

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use rgpu_broker_client::duration::parse_duration_ms;
use rgpu_broker_client::{
    AuditView, BrokerClient, ClientError, Credential, LeaseSpec, LeaseView, Role, Scope, ServerView, UsageRecordView,
    UsageView,
};

pub const DEFAULT_BROKER: &str = "127.0.0.1:7770";

#[derive(clap::Args, Debug, Clone)]
pub struct BrokerArgs {
    /// The pool broker, host:port (replicated brokers: all their addresses,
    /// comma-separated; the one that leads is found).
    #[arg(long, env = "RGPU_BROKER", default_value = DEFAULT_BROKER, value_name = "ADDR")]
    pub broker: String,
    /// Your credential for the broker (from your operator: `rgpu credential
    /// issue`) [default: ~/.config/rgpu/credential when it exists].
    #[arg(long, env = "RGPU_CREDENTIAL", value_name = "FILE")]
    pub credential: Option<PathBuf>,
    /// The broker's admin key file (or its token key file, if it has no
    /// admin key): without --credential, act as admin with it.
    #[arg(long, env = "RGPU_ADMIN_KEY_FILE", value_name = "FILE")]
    pub admin_key_file: Option<PathBuf>,
    #[command(flatten)]
    pub tls: crate::tls::TlsArgs,
}

/// Reads a key file as the broker writes them.
pub fn read_key(p: &Path) -> Result<Vec<u8>> {
    let bytes = std::fs::read(p).with_context(|| format!("cannot read key file {}", p.display()))?;
    rgpu_protocol::token::parse_key(&bytes).with_context(|| format!("key file {}", p.display()))
}

impl BrokerArgs {
    /// Who to log in as: --credential, else an admin credential made from
    /// --admin-key-file, else the default credential file.
    pub fn credential(&self) -> Result<Credential> {
        if let Some(p) = &self.credential {
            return Ok(Credential::load(p)?);
        }
        if let Some(p) = &self.admin_key_file {
            return Ok(Credential::issue(&read_key(p)?, ADMIN_TENANT, Role::Admin, now_ms())?);
        }
        match rgpu_broker_client::credential::default_path().filter(|p| p.exists()) {
            Some(p) => Ok(Credential::load(&p)?),
            None => bail!(
                "the broker needs a credential: ask your operator for one (`rgpu credential issue --tenant NAME --out FILE`) \
                 and pass --credential FILE (or RGPU_CREDENTIAL, or put it at ~/.config/rgpu/credential); \
                 operators may pass --admin-key-file instead"
            ),
        }
    }

    pub fn connect(&self) -> Result<BrokerClient> {
        let cred = self.credential()?;
        BrokerClient::connect(&self.broker, &cred, &self.tls.security()?).map_err(|e| match e {
            ClientError::Unreachable { .. } => anyhow::anyhow!(
                "{e}\n  help: is rgpu-broker running there? Point --broker ADDR (or RGPU_BROKER) at the pool's broker"
            ),
            e => e.into(),
        })
    }
}

/// The tenant an admin key file acts as.
pub const ADMIN_TENANT: &str = "admin";

/// What to lease.
#[derive(clap::Args, Debug, Clone)]
pub struct LeaseArgs {
    /// Whole GPUs. With --memory or --compute: a fraction of one GPU instead.
    #[arg(long, value_name = "N")]
    pub gpus: Option<u32>,
    /// A fraction of one GPU: this much of its memory (e.g. 20GiB).
    #[arg(long, value_name = "SIZE", value_parser = parse_memory)]
    pub memory: Option<u64>,
    /// A fraction of one GPU: this share of its compute, in thousandths (1..1000).
    #[arg(long, value_name = "MILLI")]
    pub compute: Option<u32>,
    /// Allowed GPU model (repeatable; case-insensitive).
    #[arg(long = "model", value_name = "MODEL")]
    pub models: Vec<String>,
    /// Keep the GPUs within one node, leaf switch or spine.
    #[arg(long, value_name = "node|leaf|spine", value_parser = parse_scope)]
    pub same: Option<Scope>,
    /// Fail rather than spread wider than --same.
    #[arg(long, requires = "same")]
    pub strict: bool,
    /// Queue priority: when GPUs are short, higher priorities are granted
    /// first (negative values allowed).
    #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
    pub priority: i32,
    /// Lease time to live; renewals extend it (e.g. 90s, 10m).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration_ms)]
    pub ttl: Option<u64>,
    /// Wait this long in the queue if nothing is free now (e.g. 30s).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration_ms)]
    pub wait: Option<u64>,
    /// Idempotency key: retrying with the same key returns the same lease.
    #[arg(long, value_name = "KEY")]
    pub key: Option<String>,
    /// Network bandwidth each way on each server of the lease, e.g. 10Gb/s,
    /// 400Mb/s or 1.25GB/s (b: bits, B: bytes): granted only where the
    /// server's links have that much not granted to others.
    #[arg(long, value_name = "RATE", value_parser = parse_lease_bandwidth)]
    pub bandwidth: Option<u64>,
    /// The key the lease's tokens are bound to: a session opens only where
    /// this file is, so a copied token is of no use elsewhere. Made on first
    /// use [default: ~/.config/rgpu/client.key].
    #[arg(long, env = "RGPU_CLIENT_KEY", value_name = "FILE")]
    pub client_key: Option<PathBuf>,
    /// Ask for a bearer token, bound to no key: anyone holding it can use the
    /// lease until it ends (servers started with --require-bound-tokens
    /// refuse it).
    #[arg(long, conflicts_with = "client_key")]
    pub bearer_token: bool,
}

/// A lease's client key: where its file is and its public half.
pub struct BoundKey {
    pub path: PathBuf,
    pub public: [u8; 32],
}

/// `--bandwidth`: a rate with a unit, more than zero.
fn parse_lease_bandwidth(s: &str) -> Result<u64, String> {
    match rgpu_config::parse_bandwidth(s) {
        Ok(0) => Err("a bandwidth must be more than 0 (leave --bandwidth out to ask for none)".into()),
        Ok(n) => Ok(n),
        Err(_) => Err("expected a rate such as 10Gb/s, 400Mb/s or 1.25GB/s (b: bits, B: bytes)".into()),
    }
}

/// `--memory`: a size with a unit, more than zero.
fn parse_memory(s: &str) -> Result<u64, String> {
    const UNITS: &str = "B, KiB, MiB, GiB, TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000)";
    match rgpu_config::parse_size(s) {
        Ok(0) => Err("a memory share must be more than 0 bytes (e.g. 20GiB); for whole GPUs use --gpus N alone".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("expected a size such as 20GiB, 512MiB or 1.5GB; units: {UNITS}")),
    }
}

fn parse_scope(s: &str) -> Result<Scope, String> {
    Scope::parse(s).ok_or_else(|| "expected node, leaf, spine or any".to_string())
}

impl LeaseArgs {
    /// The key to bind the lease to (made if there is none); None with
    /// --bearer-token.
    pub fn client_key(&self) -> Result<Option<BoundKey>> {
        if self.bearer_token {
            return Ok(None);
        }
        let path = match &self.client_key {
            Some(p) => p.clone(),
            None => rgpu_control_client::client_key::path()?,
        };
        let key = rgpu_control_client::client_key::load_or_create(&path)?;
        Ok(Some(BoundKey { path, public: key.public() }))
    }

    /// The request, bound to `key`'s holder when there is one.
    pub fn bound_spec(&self, default_ttl_ms: u64, key: Option<&BoundKey>) -> LeaseSpec {
        LeaseSpec { client_key: key.map(|k| k.public), ..self.spec(default_ttl_ms) }
    }

    pub fn spec(&self, default_ttl_ms: u64) -> LeaseSpec {
        let fraction = self.memory.is_some() || self.compute.is_some();
        let gpus = match (self.gpus, fraction) {
            (Some(1), true) | (None, true) => 0,
            (Some(n), _) => n,
            (None, false) => 1,
        };
        LeaseSpec {
            // The broker takes the tenant from the credential.
            tenant: String::new(),
            gpus,
            memory: self.memory.unwrap_or(0),
            compute_milli: self.compute.unwrap_or(0),
            models: self.models.clone(),
            scope: self.same.unwrap_or_default(),
            scope_required: self.strict,
            priority: self.priority,
            ttl_ms: self.ttl.unwrap_or(default_ttl_ms),
            wait_ms: self.wait.unwrap_or(0),
            key: self.key.clone().unwrap_or_default(),
            bandwidth: self.bandwidth.unwrap_or(0),
            client_key: None,
        }
    }
}

pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// "in 59s", "3s ago".
pub fn relative(ms: u64) -> String {
    let now = now_ms();
    let (d, future) = if ms >= now { (ms - now, true) } else { (now - ms, false) };
    let s = d / 1000;
    let t = if s >= 3600 { format!("{}h{:02}m", s / 3600, s % 3600 / 60) } else if s >= 60 { format!("{}m{:02}s", s / 60, s % 60) } else { format!("{s}s") };
    if future { format!("in {t}") } else { format!("{t} ago") }
}

pub fn gib(b: u64) -> String {
    format!("{:.1}GiB", b as f64 / (1u64 << 30) as f64)
}

pub fn json<T: serde::Serialize>(v: &T) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

pub fn print_lease(l: &LeaseView) {
    println!("lease     {}", l.id);
    println!("tenant    {}   generation {}   state {}", l.tenant, l.generation, l.state);
    println!("expires   {} (renew with `rgpu renew {}`)", relative(l.deadline_ms), l.id);
    if l.memory_limit > 0 {
        println!("share     {} of memory, compute {}/1000 of one GPU", gib(l.memory_limit), l.compute_milli);
    }
    if l.bandwidth > 0 {
        println!("bandwidth {} each way on each of its servers", rgpu_config::format_bandwidth(l.bandwidth));
    }
    for g in &l.gpus {
        println!("gpu       {} #{} {} ({}) uuid {}", g.server, g.ordinal, g.model, gib(g.memory), g.uuid);
    }
}

/// The environment that points the shim at a lease.
pub fn lease_env(l: &LeaseView) -> Vec<(String, String)> {
    let mut v = vec![("RGPU_SERVERS".to_string(), l.servers().join(","))];
    if !l.token.is_empty() {
        v.push(("RGPU_TOKEN".to_string(), l.token.clone()));
    }
    v
}

pub fn lease_table(leases: &[LeaseView]) {
    println!(
        "{:<16}  {:<10}  {:>4}  {:<8}  {:>9}  {:>9}  {:<10}  {:>10}  {:>8}  {:>9}  {:>9}  SERVERS",
        "LEASE", "TENANT", "GPUS", "STATE", "MEMORY", "BANDWIDTH", "EXPIRES", "DEVICE", "KERNELS", "IN", "OUT"
    );
    for l in leases {
        let mem = if l.memory_limit > 0 { gib(l.memory_limit) } else { "whole".into() };
        let u = UseCells::of(l.usage.as_ref());
        println!(
            "{:<16}  {:<10}  {:>4}  {:<8}  {:>9}  {:>9}  {:<10}  {:>10}  {:>8}  {:>9}  {:>9}  {}",
            l.id,
            l.tenant,
            l.gpus.len(),
            l.state,
            mem,
            if l.bandwidth > 0 { rgpu_config::format_bandwidth(l.bandwidth) } else { "-".into() },
            relative(l.deadline_ms),
            u.device,
            u.kernels,
            u.bytes_in,
            u.bytes_out,
            l.servers().join(",")
        );
        if !l.moving_to.is_empty() {
            println!("  moving to {}", l.moving_to);
        } else if !l.move_error.is_empty() {
            println!("  not moved: {}", l.move_error);
        }
    }
}

/// Metered use as table cells: "-" where nothing was reported, or the
/// backend cannot time kernels.
pub struct UseCells {
    pub device: String,
    pub kernels: String,
    pub bytes_in: String,
    pub bytes_out: String,
    pub peak: String,
}

impl UseCells {
    pub fn of(u: Option<&UsageView>) -> UseCells {
        let dash = || "-".to_string();
        match u {
            None => UseCells { device: dash(), kernels: dash(), bytes_in: dash(), bytes_out: dash(), peak: dash() },
            Some(u) => UseCells {
                device: u.kernel_ns.map_or_else(dash, seconds),
                kernels: u.kernels.to_string(),
                bytes_in: bytes(u.bytes_in),
                bytes_out: bytes(u.bytes_out),
                peak: bytes(u.memory_peak),
            },
        }
    }
}

/// Nanoseconds as "1.234s", "12m03s".
pub fn seconds(ns: u64) -> String {
    let s = ns as f64 / 1e9;
    if s < 60.0 {
        format!("{s:.3}s")
    } else {
        let s = s as u64;
        if s >= 3600 { format!("{}h{:02}m", s / 3600, s % 3600 / 60) } else { format!("{}m{:02}s", s / 60, s % 60) }
    }
}

/// Bytes with a binary unit: "512B", "3.0MiB".
pub fn bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if b < 1024 {
        return format!("{b}B");
    }
    let mut v = b as f64 / 1024.0;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    format!("{v:.1}{}", UNITS[i])
}

pub fn usage_table(records: &[UsageRecordView]) {
    println!(
        "{:<16}  {:<10}  {:>4}  {:<8}  {:<10}  {:>9}  {:>10}  {:>8}  {:>9}  {:>9}  {:>9}  SERVERS",
        "LEASE", "TENANT", "GPUS", "STATE", "ENDED", "HELD", "DEVICE", "KERNELS", "IN", "OUT", "MEM PEAK"
    );
    for r in records {
        let u = UseCells::of(r.usage.as_ref());
        let (ended, until) = if r.ended_ms == 0 { ("-".to_string(), now_ms()) } else { (relative(r.ended_ms), r.ended_ms) };
        println!(
            "{:<16}  {:<10}  {:>4}  {:<8}  {:<10}  {:>9}  {:>10}  {:>8}  {:>9}  {:>9}  {:>9}  {}",
            r.lease,
            r.tenant,
            r.gpus,
            r.why,
            ended,
            seconds(until.saturating_sub(r.granted_ms).saturating_mul(1_000_000)),
            u.device,
            u.kernels,
            u.bytes_in,
            u.bytes_out,
            u.peak,
            r.servers.join(",")
        );
    }
}

/// "granted of capacity" of a server's links; capacity "-" where it did not say (unbounded).
pub fn link_cell(s: &ServerView) -> String {
    let cap = s.link_bandwidth.map_or_else(|| "-".to_string(), rgpu_config::format_bandwidth);
    format!("{} of {cap}", rgpu_config::format_bandwidth(s.bandwidth_granted))
}

pub fn server_table(servers: &[ServerView]) {
    println!(
        "{:<22}  {:<12}  {:<8}  {:<8}  {:<11}  {:>9}  {:>6}  {:>15}  {:<10}  {:<10}  {:>10}  {:>9}  {:>9}  {:>19}  {:>9}  DRAIN",
        "SERVER", "NODE", "LEAF", "SPINE", "STATE", "GPUS FREE", "LEASES", "MEMORY USED", "PARTITIONS", "TRANSPORTS",
        "DEVICE", "IN", "OUT", "LINK GRANTED", "LOAD"
    );
    for s in servers {
        let drain = if !s.draining {
            "-".to_string()
        } else if s.drain_deadline_ms == 0 {
            format!("draining, {} lease(s) left", s.leases)
        } else {
            format!("draining, {} lease(s) left, deadline {}", s.leases, relative(s.drain_deadline_ms))
        };
        let u = UseCells::of(s.usage.as_ref());
        println!(
            "{:<22}  {:<12}  {:<8}  {:<8}  {:<11}  {:>4}/{:<4}  {:>6}  {:>15}  {:<10}  {:<10}  {:>10}  {:>9}  {:>9}  {:>19}  {:>9}  {}",
            s.id,
            s.node,
            s.leaf,
            s.spine,
            s.state,
            s.gpus_free,
            s.gpus,
            s.leases,
            format!("{}/{}", gib(s.memory_used), gib(s.memory)),
            s.partitions.join(","),
            // A server that does not say serves TCP only.
            if s.transports.is_empty() { "tcp".to_string() } else { s.transports.join(",") },
            u.device,
            u.bytes_in,
            u.bytes_out,
            link_cell(s),
            s.load.map_or_else(|| "-".to_string(), |l| rgpu_config::format_bandwidth(l.bytes_in.max(l.bytes_out))),
            drain
        );
        for g in &s.unhealthy {
            println!("  GPU {} unhealthy: {}", g.ordinal, g.reason);
        }
    }
}

pub fn audit_table(records: &[AuditView]) {
    println!("{:<10}  {:<20}  {:<21}  {:<18}  {:<22}  {:<3}  DETAIL", "WHEN", "ACTOR", "PEER", "OP", "TARGET", "OK");
    for r in records {
        println!(
            "{:<10}  {:<20}  {:<21}  {:<18}  {:<22}  {:<3}  {}",
            relative(r.time_ms),
            r.actor,
            r.peer,
            r.op,
            r.target,
            if r.ok { "ok" } else { "no" },
            r.detail
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Lease {
        #[command(flatten)]
        lease: LeaseArgs,
    }

    fn spec(args: &[&str]) -> Result<LeaseSpec, clap::Error> {
        Lease::try_parse_from(std::iter::once("lease").chain(args.iter().copied())).map(|l| l.lease.spec(60_000))
    }

    #[test]
    fn bandwidth_is_asked_in_bits_or_bytes_per_second() {
        assert_eq!(spec(&["--gpus", "1", "--bandwidth", "10Gb/s"]).unwrap().bandwidth, 1_250_000_000);
        assert_eq!(spec(&["--memory", "2GiB", "--bandwidth", "400Mb/s"]).unwrap().bandwidth, 50_000_000);
        assert_eq!(spec(&["--bandwidth", "2GB/s"]).unwrap().bandwidth, 2_000_000_000);
        assert_eq!(spec(&[]).unwrap().bandwidth, 0, "none asked unless given");
        for bad in ["10Gb", "0Gb/s", "fast", "-1Gb/s"] {
            assert!(spec(&["--bandwidth", bad]).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_server_s_link_cell_says_granted_of_capacity() {
        let mut s = ServerView {
            id: "s".into(),
            node: String::new(),
            leaf: String::new(),
            spine: String::new(),
            partitions: Vec::new(),
            models: Vec::new(),
            transports: Vec::new(),
            state: "up".into(),
            draining: false,
            drain_deadline_ms: 0,
            gpus: 1,
            gpus_free: 1,
            memory: 0,
            memory_used: 0,
            leases: 0,
            last_heartbeat_ms: 0,
            usage: None,
            link_bandwidth: Some(12_500_000_000),
            bandwidth_granted: 1_250_000_000,
            load: None,
            unhealthy: Vec::new(),
        };
        assert_eq!(link_cell(&s), "10Gb/s of 100Gb/s");
        s.link_bandwidth = None;
        assert_eq!(link_cell(&s), "10Gb/s of -");
    }
}
