//! Server settings: command-line flags, `RGPU_SERVER_*` environment
//! variables, an optional TOML file (`--config`, same keys as the long
//! flags), then defaults, in that order of precedence.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Parser, ValueEnum};
use serde::Deserialize;

use crate::backend::sim::SimConfig;

pub const DEFAULT_LISTEN: &str = "127.0.0.1:7767";
pub const DEFAULT_SIM_MEMORY: u64 = 16 << 30;
pub const DEFAULT_ATTACH_TIMEOUT_MS: u32 = 30_000;
pub const DEFAULT_DRAIN_TIMEOUT_S: u64 = 30;
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// Simulated devices in this process (no GPU needed).
    Sim,
    /// Real GPUs through the CUDA driver (libcuda.so.1, found at run time).
    Cuda,
    /// The real-GPU backend when a driver and a device are found, else sim.
    Auto,
}

/// rgpu GPU server: exports this host's GPUs (or simulated ones) to rgpu clients.
#[derive(Debug, Parser, Default)]
#[command(name = "rgpu-server", version)]
pub struct Args {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, env = "RGPU_SERVER_LISTEN", value_name = "ADDR")]
    pub listen: Option<String>,
    /// Which backend serves the devices [default: auto].
    #[arg(long, env = "RGPU_SERVER_BACKEND", value_enum)]
    pub backend: Option<BackendKind>,
    /// Number of simulated devices [default: 1].
    #[arg(long, env = "RGPU_SERVER_SIM_DEVICES", value_name = "N")]
    pub sim_devices: Option<u32>,
    /// Memory per simulated device, e.g. 512MiB or 16GiB [default: 16GiB].
    #[arg(long, env = "RGPU_SERVER_SIM_MEMORY", value_name = "BYTES", value_parser = parse_size)]
    pub sim_memory: Option<u64>,
    /// Compute capability of the simulated devices [default: 9.0].
    #[arg(long, env = "RGPU_SERVER_SIM_COMPUTE_CAPABILITY", value_name = "MAJOR.MINOR",
          value_parser = parse_cc)]
    pub sim_compute_capability: Option<(u32, u32)>,
    /// Mixed with the host name and ordinal into the simulated devices' UUIDs
    /// [default: the listening address, so a server on a fixed address keeps
    /// its UUIDs and two servers on one host never share one].
    #[arg(long, env = "RGPU_SERVER_SIM_SEED")]
    pub sim_seed: Option<String>,
    /// How long an opened session waits for its data connection [default: 30000].
    #[arg(long, env = "RGPU_SERVER_ATTACH_TIMEOUT_MS", value_name = "MS")]
    pub attach_timeout_ms: Option<u32>,
    /// Most connections served at once [default: 256].
    #[arg(long, env = "RGPU_SERVER_MAX_CONNECTIONS", value_name = "N")]
    pub max_connections: Option<usize>,
    /// Data-plane transport: tcp, rdma (requires the verbs plugin and a
    /// device) or auto (RDMA for clients that ask, when available) [default: auto].
    #[arg(long, env = "RGPU_SERVER_TRANSPORT", value_name = "tcp|rdma|auto")]
    pub transport: Option<rgpu_transport::select::Mode>,
    /// RDMA: send bulk replies zero-copy (the client RDMA-READs them from
    /// this server's buffers, registered once and cached) instead of
    /// through the staging ring. Opt-in.
    #[arg(long, env = "RGPU_SERVER_RDMA_ZERO_COPY", value_parser = clap::builder::BoolishValueParser::new())]
    pub rdma_zero_copy: bool,
    /// RDMA: receive-ring slots (8 KiB each) per connection, 4..=4096 [default: 64].
    #[arg(long, env = "RGPU_SERVER_RDMA_RING_SLOTS", value_name = "N")]
    pub rdma_ring_slots: Option<u16>,
    /// Pool broker to register with and heartbeat (host:port).
    #[arg(long, env = "RGPU_SERVER_BROKER", value_name = "ADDR")]
    pub broker: Option<String>,
    /// The broker's key file: with it, sessions need a lease token the
    /// broker signed; without it, anyone may open a session.
    #[arg(long, env = "RGPU_SERVER_BROKER_KEY_FILE", value_name = "FILE")]
    pub broker_key_file: Option<PathBuf>,
    /// Address clients reach this server on, as registered with the broker
    /// [default: the listening address].
    #[arg(long, env = "RGPU_SERVER_ADVERTISE", value_name = "ADDR")]
    pub advertise: Option<String>,
    /// Topology: this server's node [default: the advertised address].
    #[arg(long, env = "RGPU_SERVER_NODE")]
    pub node: Option<String>,
    /// Topology: the leaf switch above the node [default: "leaf0"].
    #[arg(long, env = "RGPU_SERVER_LEAF")]
    pub leaf: Option<String>,
    /// Topology: the spine above the leaf [default: "spine0"].
    #[arg(long, env = "RGPU_SERVER_SPINE")]
    pub spine: Option<String>,
    /// On SIGTERM with a broker: drain first (no new leases here) and wait
    /// up to this many seconds for the leases on this server to end; 0
    /// stops at once [default: 30]. A second signal stops at once.
    #[arg(long, env = "RGPU_SERVER_DRAIN_TIMEOUT", value_name = "SECS")]
    pub drain_timeout: Option<u64>,
    /// Partitions (tenant pools) this server serves, comma-separated [default: default].
    #[arg(long, env = "RGPU_SERVER_PARTITIONS", value_delimiter = ',')]
    pub partitions: Option<Vec<String>>,
    /// TOML file with any of the settings above (keys as the long flags,
    /// e.g. `sim-memory = "8GiB"`).
    #[arg(long, env = "RGPU_SERVER_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct FileConfig {
    listen: Option<String>,
    backend: Option<BackendKind>,
    sim_devices: Option<u32>,
    sim_memory: Option<SizeValue>,
    sim_compute_capability: Option<CcValue>,
    sim_seed: Option<String>,
    attach_timeout_ms: Option<u32>,
    max_connections: Option<usize>,
    broker: Option<String>,
    broker_key_file: Option<PathBuf>,
    advertise: Option<String>,
    node: Option<String>,
    leaf: Option<String>,
    spine: Option<String>,
    partitions: Option<Vec<String>>,
    drain_timeout: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum SizeValue {
    Bytes(u64),
    Text(String),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum CcValue {
    Text(String),
    Number(f64),
}

/// The effective settings.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: String,
    pub backend: BackendKind,
    pub sim: SimConfig,
    pub attach_timeout: Duration,
    pub max_connections: usize,
    /// The pool broker, if any.
    pub pool: PoolConfig,
}

/// Settings for the pool broker; the default is no broker (sessions open
/// to anyone, nothing registered).
#[derive(Debug, Clone, Default)]
pub struct PoolConfig {
    pub broker: Option<String>,
    /// The key read from the broker key file.
    pub broker_key: Option<Vec<u8>>,
    pub advertise: Option<String>,
    pub labels: crate::broker::Labels,
    /// How long a stopping server waits for its leases to end (zero: it
    /// stops at once, as without a broker).
    pub drain_timeout: Duration,
}

impl Config {
    /// Merges flags/env (already in `args`), the TOML file and defaults.
    pub fn load(args: Args) -> anyhow::Result<Config> {
        let file = match &args.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read config file {}", path.display()))?;
                toml::from_str::<FileConfig>(&text)
                    .with_context(|| format!("invalid config file {}", path.display()))?
            }
            None => FileConfig::default(),
        };
        let sim_memory = match (args.sim_memory, file.sim_memory) {
            (Some(v), _) => v,
            (None, Some(SizeValue::Bytes(v))) => v,
            (None, Some(SizeValue::Text(t))) => {
                parse_size(&t).map_err(anyhow::Error::msg).context("config key sim-memory")?
            }
            (None, None) => DEFAULT_SIM_MEMORY,
        };
        let cc = match (args.sim_compute_capability, file.sim_compute_capability) {
            (Some(v), _) => v,
            (None, Some(CcValue::Text(t))) => {
                parse_cc(&t).map_err(anyhow::Error::msg).context("config key sim-compute-capability")?
            }
            (None, Some(CcValue::Number(n))) => parse_cc(&format!("{n:.1}"))
                .map_err(anyhow::Error::msg)
                .context("config key sim-compute-capability")?,
            (None, None) => (9, 0),
        };
        let cfg = Config {
            listen: args.listen.or(file.listen).unwrap_or_else(|| DEFAULT_LISTEN.to_string()),
            backend: args.backend.or(file.backend).unwrap_or(BackendKind::Auto),
            sim: SimConfig {
                devices: args.sim_devices.or(file.sim_devices).unwrap_or(1),
                memory: sim_memory,
                compute_capability: cc,
                seed: args.sim_seed.or(file.sim_seed),
            },
            attach_timeout: Duration::from_millis(
                args.attach_timeout_ms.or(file.attach_timeout_ms).unwrap_or(DEFAULT_ATTACH_TIMEOUT_MS)
                    as u64,
            ),
            max_connections: args
                .max_connections
                .or(file.max_connections)
                .unwrap_or(DEFAULT_MAX_CONNECTIONS),
            pool: PoolConfig {
            broker: args.broker.or(file.broker),
            broker_key: match args.broker_key_file.or(file.broker_key_file) {
                Some(p) => {
                    let bytes = std::fs::read(&p)
                        .with_context(|| format!("cannot read broker key file {}", p.display()))?;
                    Some(
                        rgpu_protocol::token::parse_key(&bytes)
                            .with_context(|| format!("broker key file {}", p.display()))?,
                    )
                }
                None => None,
            },
            advertise: args.advertise.or(file.advertise),
            labels: crate::broker::Labels {
                node: args.node.or(file.node).unwrap_or_default(),
                leaf: args.leaf.or(file.leaf).unwrap_or_else(|| "leaf0".into()),
                spine: args.spine.or(file.spine).unwrap_or_else(|| "spine0".into()),
                partitions: args.partitions.or(file.partitions).unwrap_or_default(),
            },
            drain_timeout: Duration::from_secs(
                args.drain_timeout.or(file.drain_timeout).unwrap_or(DEFAULT_DRAIN_TIMEOUT_S),
            ),
            },
        };
        if cfg.sim.devices == 0 {
            bail!("sim-devices must be at least 1");
        }
        if cfg.max_connections == 0 {
            bail!("max-connections must be at least 1");
        }
        Ok(cfg)
    }
}

/// Parses a byte count: a number with an optional unit. `KiB`/`MiB`/`GiB`/
/// `TiB` (and `K`/`M`/`G`/`T`) are powers of 1024, `KB`/`MB`/`GB`/`TB`
/// powers of 1000, `B` or nothing is bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit() && c != '_').unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.replace('_', "").parse().map_err(|_| format!("invalid size {s:?}: expected e.g. 512MiB or 16GiB"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        u => return Err(format!("invalid size {s:?}: unknown unit {u:?} (use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)")),
    };
    n.checked_mul(mult).ok_or_else(|| format!("size {s:?} is too large"))
}

/// Parses a compute capability such as `9.0` or `8.6`.
pub fn parse_cc(s: &str) -> Result<(u32, u32), String> {
    let err = || format!("invalid compute capability {s:?}: expected MAJOR.MINOR, e.g. 9.0");
    let (a, b) = s.trim().split_once('.').ok_or_else(err)?;
    let major: u32 = a.parse().map_err(|_| err())?;
    let minor: u32 = b.parse().map_err(|_| err())?;
    if major == 0 || major > 99 || minor > 9 {
        return Err(err());
    }
    Ok((major, minor))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("16GiB"), Ok(16 << 30));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        assert_eq!(parse_size("1GB"), Ok(1_000_000_000));
        assert!(parse_size("12XB").is_err());
        assert!(parse_size("GiB").is_err());
        assert!(parse_size("99999999999TiB").is_err());
    }

    #[test]
    fn rdma_knobs_are_flags() {
        let a = Args::try_parse_from(["rgpu-server", "--rdma-zero-copy", "--rdma-ring-slots", "128"]).unwrap();
        assert_eq!((a.rdma_zero_copy, a.rdma_ring_slots), (true, Some(128)));
        let a = Args::try_parse_from(["rgpu-server"]).unwrap();
        assert_eq!((a.rdma_zero_copy, a.rdma_ring_slots), (false, None));
        assert!(Args::try_parse_from(["rgpu-server", "--rdma-ring-slots", "70000"]).is_err());
    }

    #[test]
    fn compute_capability() {
        assert_eq!(parse_cc("9.0"), Ok((9, 0)));
        assert_eq!(parse_cc("8.6"), Ok((8, 6)));
        assert!(parse_cc("9").is_err());
        assert!(parse_cc("x.y").is_err());
    }

    #[test]
    fn precedence_flags_over_file_over_defaults() {
        let dir = std::env::temp_dir().join(format!("rgpu-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("server.toml");
        std::fs::write(
            &path,
            "listen = \"0.0.0.0:1\"\nsim-devices = 3\nsim-memory = \"1GiB\"\nsim-compute-capability = 8.6\n",
        )
        .unwrap();
        let args = Args {
            listen: Some("127.0.0.1:0".into()),
            config: Some(path.clone()),
            ..Args::default()
        };
        let c = Config::load(args).unwrap();
        assert_eq!(c.listen, "127.0.0.1:0");
        assert_eq!(c.sim.devices, 3);
        assert_eq!(c.sim.memory, 1 << 30);
        assert_eq!(c.sim.compute_capability, (8, 6));
        assert_eq!(c.backend, BackendKind::Auto);
        std::fs::write(&path, "bogus = 1\n").unwrap();
        let args = Args { config: Some(path), ..Args::default() };
        assert!(Config::load(args).is_err());
        let _ = std::fs::remove_dir_all(dir);
    }
}
