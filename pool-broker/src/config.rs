//! Broker settings: flags, then `RGPU_BROKER_*` environment variables, then
//! the TOML file (`--config`: the same keys as the long flags, plus
//! `[tenants.NAME]` tables: `partitions`, `max-gpus`, `max-memory`, and
//! `pkey`, the tenant's InfiniBand partition key, e.g. `pkey = 0x8001`), then
//! defaults.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Parser;
use serde::Deserialize;

use crate::state::{Limits, TenantPolicy};

pub const DEFAULT_LISTEN: &str = "127.0.0.1:7770";

/// rgpu GPU pool broker: leases GPUs of registered rgpu-servers.
#[derive(Debug, Parser, Default)]
#[command(name = "rgpu-broker", version)]
pub struct Args {
    /// Address to listen on [default: 127.0.0.1:7770].
    #[arg(long, env = "RGPU_BROKER_LISTEN", value_name = "ADDR")]
    pub listen: Option<String>,
    /// Directory of the broker's durable state [default: ./rgpu-broker-data].
    #[arg(long, env = "RGPU_BROKER_DATA_DIR", value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// File with the key that signs lease tokens (GPU servers get the same
    /// file). Without one, tokens are empty and servers admit anyone.
    #[arg(long, env = "RGPU_BROKER_KEY_FILE", value_name = "FILE")]
    pub key_file: Option<PathBuf>,
    /// Create the key file (and the admin key file) with a fresh random key
    /// if it does not exist.
    #[arg(long)]
    pub create_key: bool,
    /// File with the operators' key: `drain` and `undrain` must carry a
    /// proof made with it (`rgpu drain --admin-key-file`), or with the
    /// token key. Without either key, anyone may drain.
    #[arg(long, env = "RGPU_BROKER_ADMIN_KEY_FILE", value_name = "FILE")]
    pub admin_key_file: Option<PathBuf>,
    /// Heartbeat interval servers are told to keep, in ms [default: 1000];
    /// a server missing 3 is unreachable.
    #[arg(long, env = "RGPU_BROKER_HEARTBEAT_MS", value_name = "MS")]
    pub heartbeat_ms: Option<u64>,
    /// TTL of a lease that names none, in ms [default: 60000].
    #[arg(long, env = "RGPU_BROKER_DEFAULT_TTL_MS", value_name = "MS")]
    pub default_ttl_ms: Option<u64>,
    /// A queued request that waited this long for capacity reserves it:
    /// smaller requests of its priority or lower in its partitions wait
    /// behind it, in ms [default: 2000].
    #[arg(long, env = "RGPU_BROKER_RESERVE_AFTER_MS", value_name = "MS")]
    pub reserve_after_ms: Option<u64>,
    /// Threads serving RPC connections [default: 2].
    #[arg(long, env = "RGPU_BROKER_THREADS", value_name = "N")]
    pub threads: Option<usize>,
    /// Placement policy: `fgd-pack` (fragmentation gradient descent with
    /// packing ties, learning the request mix; see docs/placement.md), `fgd`
    /// (the paper's FGD, first server among equals: fewer requests left
    /// waiting when leases come and go fast) or `simple` (best fit by
    /// memory, fewest free whole GPUs; the fastest) [default: fgd-pack].
    #[arg(long, env = "RGPU_BROKER_PLACEMENT", value_name = "POLICY")]
    pub placement: Option<String>,
    /// TOML file with any of the settings above and tenant policies.
    #[arg(long, env = "RGPU_BROKER_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
}

/// The broker's placement policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// [`crate::policies::Fgd::learning`].
    FgdPack,
    /// [`crate::policies::Fgd::learning_first`].
    Fgd,
    /// [`crate::placement::FragmentationAware`].
    Simple,
}

impl Placement {
    pub fn parse(s: &str) -> anyhow::Result<Placement> {
        match s {
            "fgd-pack" => Ok(Placement::FgdPack),
            "fgd" => Ok(Placement::Fgd),
            "simple" => Ok(Placement::Simple),
            _ => bail!("unknown placement policy {s:?}: expected fgd-pack, fgd or simple"),
        }
    }

    pub fn policy(self) -> Box<dyn crate::placement::Policy> {
        match self {
            Placement::FgdPack => Box::new(crate::policies::Fgd::learning()),
            Placement::Fgd => Box::new(crate::policies::Fgd::learning_first()),
            Placement::Simple => Box::new(crate::placement::FragmentationAware),
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct FileConfig {
    listen: Option<String>,
    data_dir: Option<PathBuf>,
    key_file: Option<PathBuf>,
    admin_key_file: Option<PathBuf>,
    heartbeat_ms: Option<u64>,
    default_ttl_ms: Option<u64>,
    reserve_after_ms: Option<u64>,
    threads: Option<usize>,
    placement: Option<String>,
    #[serde(default)]
    tenants: HashMap<String, FileTenant>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct FileTenant {
    #[serde(default)]
    partitions: Vec<String>,
    max_gpus: Option<u32>,
    max_memory: Option<String>,
    pkey: Option<u16>,
}

#[derive(Debug, Clone)]
pub struct Config {
    pub listen: String,
    pub data_dir: PathBuf,
    pub key_file: Option<PathBuf>,
    pub create_key: bool,
    pub admin_key_file: Option<PathBuf>,
    pub limits: Limits,
    pub threads: usize,
    pub placement: Placement,
    pub tenants: HashMap<String, TenantPolicy>,
}

impl Config {
    pub fn load(args: Args) -> anyhow::Result<Config> {
        let file = match &args.config {
            Some(p) => {
                let t = std::fs::read_to_string(p).with_context(|| format!("cannot read config file {}", p.display()))?;
                toml::from_str::<FileConfig>(&t).with_context(|| format!("invalid config file {}", p.display()))?
            }
            None => FileConfig::default(),
        };
        let mut tenants = HashMap::new();
        for (name, t) in file.tenants {
            let max_memory = match t.max_memory {
                Some(m) => Some(parse_size(&m).map_err(anyhow::Error::msg).with_context(|| format!("tenant {name}: max-memory"))?),
                None => None,
            };
            if let Some(k) = t.pkey {
                // 0x0000 and 0x8000 are not partition keys.
                if k & 0x7fff == 0 {
                    bail!("tenant {name}: pkey {k:#06x} is not a valid InfiniBand partition key");
                }
            }
            let partitions = if t.partitions.is_empty() { vec![name.clone()] } else { t.partitions };
            tenants.insert(name, TenantPolicy { partitions, max_gpus: t.max_gpus, max_memory, pkey: t.pkey });
        }
        let mut limits = Limits::default();
        if let Some(h) = args.heartbeat_ms.or(file.heartbeat_ms) {
            if h == 0 {
                bail!("heartbeat-ms must be at least 1");
            }
            limits.heartbeat_ms = h;
        }
        if let Some(t) = args.default_ttl_ms.or(file.default_ttl_ms) {
            limits.default_ttl_ms = t.max(1);
        }
        if let Some(r) = args.reserve_after_ms.or(file.reserve_after_ms) {
            limits.reserve_after_ms = r;
        }
        Ok(Config {
            listen: args.listen.or(file.listen).unwrap_or_else(|| DEFAULT_LISTEN.into()),
            data_dir: args.data_dir.or(file.data_dir).unwrap_or_else(|| PathBuf::from("rgpu-broker-data")),
            key_file: args.key_file.or(file.key_file),
            create_key: args.create_key,
            admin_key_file: args.admin_key_file.or(file.admin_key_file),
            limits,
            threads: args.threads.or(file.threads).unwrap_or(2).max(1),
            placement: Placement::parse(args.placement.or(file.placement).as_deref().unwrap_or("fgd-pack"))?,
            tenants,
        })
    }
}

/// Reads (or with `create`, first writes) a key file.
pub fn load_key(path: &std::path::Path, create: bool) -> anyhow::Result<Vec<u8>> {
    if create && !path.exists() {
        let mut k = [0u8; 32];
        getrandom::fill(&mut k).map_err(|e| anyhow::anyhow!("no randomness: {e}"))?;
        write_private(path, format!("{}\n", rgpu_protocol::token::to_hex(&k)).as_bytes())
            .with_context(|| format!("cannot write key file {}", path.display()))?;
    }
    let bytes = std::fs::read(path).with_context(|| format!("cannot read key file {}", path.display()))?;
    rgpu_protocol::token::parse_key(&bytes).with_context(|| format!("key file {}", path.display()))
}

fn write_private(path: &std::path::Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    if let Some(d) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(d)?;
    }
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    f.write_all(data)
}

/// A byte count: `20GiB`, `512MiB`, `1GB`, `4096`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("invalid size {s:?}: expected e.g. 20GiB or 512MiB"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tib" => 1024.0f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        u => return Err(format!("invalid size {s:?}: unknown unit {u:?}")),
    };
    let v = n * mult;
    if !(0.0..1.8e19).contains(&v) {
        return Err(format!("size {s:?} is out of range"));
    }
    Ok(v as u64)
}

/// A duration: `30s`, `5m`, `2h`, `500ms`, or plain seconds.
pub fn parse_duration_ms(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("invalid duration {s:?}: expected e.g. 30s, 5m or 2h"))?;
    let mult = match unit.trim() {
        "ms" => 1.0,
        "" | "s" => 1e3,
        "m" | "min" => 60e3,
        "h" => 3600e3,
        "d" => 86400e3,
        u => return Err(format!("invalid duration {s:?}: unknown unit {u:?} (ms, s, m, h, d)")),
    };
    Ok((n * mult) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_durations_and_tenants() {
        assert_eq!(parse_size("20GiB"), Ok(20 << 30));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert!(parse_size("x").is_err());
        assert_eq!(parse_duration_ms("90s"), Ok(90_000));
        assert_eq!(parse_duration_ms("2m"), Ok(120_000));
        assert_eq!(parse_duration_ms("250ms"), Ok(250));
        assert!(parse_duration_ms("5 fortnights").is_err());
        let dir = std::env::temp_dir().join(format!("rgpu-broker-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("b.toml");
        std::fs::write(&p, "listen = \"127.0.0.1:1\"\n[tenants.alice]\nmax-gpus = 2\nmax-memory = \"32GiB\"\npkey = 0x8001\n[tenants.bob]\n").unwrap();
        let c = Config::load(Args { config: Some(p.clone()), listen: Some("127.0.0.1:2".into()), ..Args::default() }).unwrap();
        assert_eq!(c.listen, "127.0.0.1:2", "flags win over the file");
        let a = &c.tenants["alice"];
        assert_eq!((a.partitions.clone(), a.max_gpus, a.max_memory), (vec!["alice".to_string()], Some(2), Some(32 << 30)));
        assert_eq!((a.pkey, c.tenants["bob"].pkey), (Some(0x8001), None));
        std::fs::write(&p, "[tenants.alice]\npkey = 0x8000\n").unwrap();
        let e = Config::load(Args { config: Some(p.clone()), ..Args::default() }).unwrap_err();
        assert!(format!("{e:#}").contains("pkey"), "{e:#}");
        std::fs::write(&p, "[tenants.alice]\npkey = 0x18001\n").unwrap();
        assert!(Config::load(Args { config: Some(p.clone()), ..Args::default() }).is_err(), "wider than 16 bits");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn placement_defaults_to_fgd_pack_and_the_flag_wins() {
        let dir = std::env::temp_dir().join(format!("rgpu-broker-place-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("b.toml");
        assert_eq!(Config::load(Args::default()).unwrap().placement, Placement::FgdPack);
        std::fs::write(&p, "placement = \"simple\"\n").unwrap();
        assert_eq!(Config::load(Args { config: Some(p.clone()), ..Args::default() }).unwrap().placement, Placement::Simple);
        let c = Config::load(Args { config: Some(p.clone()), placement: Some("fgd-pack".into()), ..Args::default() }).unwrap();
        assert_eq!(c.placement, Placement::FgdPack, "flags win over the file");
        std::fs::write(&p, "placement = \"tetris\"\n").unwrap();
        let e = Config::load(Args { config: Some(p.clone()), ..Args::default() }).unwrap_err();
        assert!(format!("{e:#}").contains("tetris"), "{e:#}");
        assert_eq!(Placement::FgdPack.policy().name(), "fgd-pack");
        assert_eq!(Placement::parse("fgd").unwrap().policy().name(), "fgd");
        let _ = std::fs::remove_dir_all(dir);
    }
}
