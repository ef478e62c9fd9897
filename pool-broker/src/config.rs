//! Broker settings. Each is declared once, in [`Settings`]: its flag, its
//! `RGPU_BROKER_*` environment variable and its key in the TOML file
//! `--config` names (the long flag), in that order of precedence, then its
//! default. The file also holds the tenant policies, `[tenants.NAME]`
//! tables: `partitions`, the quotas `max-gpus`, `max-memory`, `max-leases`
//! and `max-rate` (requests per second; a quota left out is the broker's
//! `--default-max-*`, none for memory), and `pkey`, the tenant's
//! InfiniBand partition key (e.g. `pkey = 0x8001`).

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{bail, Context};
use rgpu_config::FromText;
use serde::Deserialize;

use crate::state::{Limits, TenantPolicy};

pub const DEFAULT_LISTEN: &str = "127.0.0.1:7770";

rgpu_config::settings! {
    /// rgpu GPU pool broker: leases GPUs of registered rgpu-servers.
    #[settings(name = "rgpu-broker", config_env = "RGPU_BROKER_CONFIG",
               config_help = "TOML file with any of the settings above (keys as the long flags) and tenant policies ([tenants.NAME]).",
               file_tables = ["tenants"])]
    pub struct Settings {
        /// Address to listen on [default: 127.0.0.1:7770].
        #[setting(flag = "listen", env = "RGPU_BROKER_LISTEN", value_name = "ADDR")]
        listen: String = DEFAULT_LISTEN.to_string(),
        /// Directory of the broker's durable state [default: ./rgpu-broker-data].
        #[setting(flag = "data-dir", env = "RGPU_BROKER_DATA_DIR", value_name = "DIR")]
        data_dir: PathBuf = PathBuf::from("rgpu-broker-data"),
        /// File with the key that signs lease tokens and that GPU servers prove
        /// their registrations with (they get the same file). Required.
        #[setting(flag = "key-file", env = "RGPU_BROKER_KEY_FILE", value_name = "FILE")]
        key_file: Option<PathBuf> = None,
        /// Create the key file (and the admin key file) with a fresh random key
        /// if it does not exist.
        #[setting(flag = "create-key", env = "RGPU_BROKER_CREATE_KEY")]
        create_key: bool = false,
        /// File with the operators' key: tenants' credentials are issued with
        /// it (`rgpu credential issue`), and whoever holds it acts as admin
        /// (`rgpu --admin-key-file`). Without it, the token key does both.
        #[setting(flag = "admin-key-file", env = "RGPU_BROKER_ADMIN_KEY_FILE", value_name = "FILE")]
        admin_key_file: Option<PathBuf> = None,
        /// Heartbeat interval servers are told to keep, in ms [default: 1000];
        /// a server missing 3 is unreachable.
        #[setting(flag = "heartbeat-ms", env = "RGPU_BROKER_HEARTBEAT_MS", value_name = "MS")]
        heartbeat_ms: u64 = Limits::default().heartbeat_ms,
        /// TTL of a lease that names none, in ms [default: 60000].
        #[setting(flag = "default-ttl-ms", env = "RGPU_BROKER_DEFAULT_TTL_MS", value_name = "MS")]
        default_ttl_ms: u64 = Limits::default().default_ttl_ms,
        /// A queued request that waited this long for capacity reserves it:
        /// smaller requests of its priority or lower in its partitions wait
        /// behind it, in ms [default: 2000].
        #[setting(flag = "reserve-after-ms", env = "RGPU_BROKER_RESERVE_AFTER_MS", value_name = "MS")]
        reserve_after_ms: u64 = Limits::default().reserve_after_ms,
        /// Leases (held and queued) of a tenant whose policy names no
        /// `max-leases` [default: 32].
        #[setting(flag = "default-max-leases", env = "RGPU_BROKER_DEFAULT_MAX_LEASES", value_name = "N")]
        default_max_leases: u32 = Limits::default().default_max_leases,
        /// Whole GPUs of a tenant whose policy names no `max-gpus` [default: 8].
        #[setting(flag = "default-max-gpus", env = "RGPU_BROKER_DEFAULT_MAX_GPUS", value_name = "N")]
        default_max_gpus: u32 = Limits::default().default_max_gpus,
        /// Requests per second (bursts of twice that) of a tenant whose policy
        /// names no `max-rate` [default: 50].
        #[setting(flag = "default-max-rate", env = "RGPU_BROKER_DEFAULT_MAX_RATE", value_name = "N")]
        default_max_rate: u32 = Limits::default().default_max_rate,
        /// Move the leases on a GPU its server reports unhealthy (an
        /// uncorrectable ECC error, an Xid, an injected fault) to other
        /// servers by live migration, as `rgpu drain --migrate` does
        /// (docs/migration.md "Evacuation of unhealthy devices"). Off
        /// (`--evacuate-unhealthy=false`), they stay until released; an
        /// unhealthy GPU takes no new lease either way [default: true].
        #[setting(flag = "evacuate-unhealthy", env = "RGPU_BROKER_EVACUATE_UNHEALTHY")]
        evacuate_unhealthy: bool = Limits::default().evacuate_unhealthy,
        /// Preempt by checkpoint: a queued request that waited this long, in
        /// ms, short of capacity suspends leases of lower priority on one
        /// server to make room (their sessions are written to that server's
        /// --checkpoint-dir and their programs wait), and they resume on
        /// their GPUs once those are free again (docs/migration.md
        /// "Preemption"). Unset: no lease is ever preempted [default: unset].
        #[setting(flag = "preempt-after-ms", env = "RGPU_BROKER_PREEMPT_AFTER_MS", value_name = "MS")]
        preempt_after_ms: Option<u64> = None,
        /// Threads serving RPC connections [default: 2].
        #[setting(flag = "threads", env = "RGPU_BROKER_THREADS", value_name = "N")]
        threads: usize = 2,
        /// Placement policy: `fgd-pack` (fragmentation gradient descent with
        /// packing ties, learning the request mix; see docs/placement.md), `fgd`
        /// (the paper's FGD, first server among equals: fewer requests left
        /// waiting when leases come and go fast) or `simple` (best fit by
        /// memory, fewest free whole GPUs; the fastest) [default: fgd-pack].
        #[setting(flag = "placement", env = "RGPU_BROKER_PLACEMENT", value_name = "POLICY")]
        placement: Placement = Placement::FgdPack,
        /// Where the durable state lives: `redb` (a file in --data-dir, for one
        /// broker), or `etcd://HOST:PORT,HOST:PORT/PREFIX` for several brokers
        /// over one etcd cluster, one of which leads (the others send clients
        /// to it and take over when its etcd lease lapses; the audit log stays
        /// in each broker's --data-dir) [default: redb].
        #[setting(flag = "store", env = "RGPU_BROKER_STORE", value_name = "STORE")]
        store: StoreUrl = StoreUrl::Redb,
        /// With an etcd store: the address other brokers send clients to when
        /// this one leads [default: --listen].
        #[setting(flag = "advertise", env = "RGPU_BROKER_ADVERTISE", value_name = "ADDR")]
        advertise: Option<String> = None,
        /// With an etcd store: TTL in seconds of the etcd lease the leader
        /// holds; a leader that stops renewing it is replaced this long
        /// after its last renewal [default: 2].
        #[setting(flag = "leader-ttl", env = "RGPU_BROKER_LEADER_TTL", value_name = "SECONDS")]
        leader_ttl: u64 = 2,
        /// Serve Prometheus metrics over HTTP at http://ADDR/metrics
        /// (docs/metrics.md); off unless set.
        #[setting(flag = "metrics", env = "RGPU_BROKER_METRICS", value_name = "ADDR")]
        metrics: Option<String> = None,
        /// TLS: the broker's certificate chain (PEM, leaf first; it must name
        /// the host clients and GPU servers dial). With --tls-key the broker
        /// serves TLS; without them it needs --plaintext.
        #[setting(flag = "tls-cert", env = "RGPU_BROKER_TLS_CERT", value_name = "FILE")]
        tls_cert: Option<PathBuf> = None,
        /// TLS: the private key of --tls-cert (PEM).
        #[setting(flag = "tls-key", env = "RGPU_BROKER_TLS_KEY", value_name = "FILE")]
        tls_key: Option<PathBuf> = None,
        /// Serve in clear: only on a network where nobody untrusted can read
        /// or inject traffic (lease tokens cross it as they are).
        #[setting(flag = "plaintext", env = "RGPU_BROKER_PLAINTEXT")]
        plaintext: bool = false,
    }
}

/// Where the broker's state is kept (`--store`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// `broker.redb` in the data directory.
    Redb,
    /// An etcd cluster: its client endpoints and the key prefix of this pool.
    Etcd { endpoints: Vec<String>, prefix: String },
}

impl FromText for StoreUrl {
    fn from_text(s: &str) -> Result<StoreUrl, String> {
        let s = s.trim();
        if s == "redb" {
            return Ok(StoreUrl::Redb);
        }
        let Some(rest) = s.strip_prefix("etcd://") else {
            return Err(format!("unknown store {s:?}: expected redb or etcd://HOST:PORT[,HOST:PORT...][/PREFIX]"));
        };
        let (hosts, prefix) = match rest.split_once('/') {
            Some((h, p)) => (h, format!("/{}", p.trim_end_matches('/'))),
            None => (rest, "/rgpu-broker".to_string()),
        };
        if prefix == "/" {
            return Err("an etcd store's prefix must not be empty (etcd://HOST:PORT/PREFIX)".into());
        }
        let endpoints: Vec<String> = hosts.split(',').map(str::trim).filter(|h| !h.is_empty()).map(String::from).collect();
        if endpoints.is_empty() || endpoints.iter().any(|h| !h.contains(':')) {
            return Err(format!("etcd endpoints must be HOST:PORT, comma-separated: {hosts:?}"));
        }
        Ok(StoreUrl::Etcd { endpoints, prefix })
    }
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
        Placement::from_text(s).map_err(anyhow::Error::msg)
    }

    pub fn policy(self) -> Box<dyn crate::placement::Policy> {
        match self {
            Placement::FgdPack => Box::new(crate::policies::Fgd::learning()),
            Placement::Fgd => Box::new(crate::policies::Fgd::learning_first()),
            Placement::Simple => Box::new(crate::placement::FragmentationAware),
        }
    }
}

impl FromText for Placement {
    fn from_text(s: &str) -> Result<Placement, String> {
        match s.trim() {
            "fgd-pack" => Ok(Placement::FgdPack),
            "fgd" => Ok(Placement::Fgd),
            "simple" => Ok(Placement::Simple),
            _ => Err(format!("unknown placement policy {s:?}: expected fgd-pack, fgd or simple")),
        }
    }
}

/// The file's tables besides the settings.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct FileTables {
    #[serde(default)]
    tenants: HashMap<String, FileTenant>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct FileTenant {
    #[serde(default)]
    partitions: Vec<String>,
    max_gpus: Option<u32>,
    /// A size as `--sim-memory` takes it: `"160GiB"`, or a number of bytes.
    max_memory: Option<toml::Value>,
    pkey: Option<u16>,
    max_leases: Option<u32>,
    max_rate: Option<u32>,
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
    pub store: StoreUrl,
    /// Where clients reach this broker (the leader's address followers name).
    pub advertise: String,
    pub leader_ttl_s: u64,
    /// Where to serve Prometheus metrics, if anywhere.
    pub metrics: Option<String>,
    /// TLS on the listening port, or plaintext (`--plaintext`).
    pub security: rgpu_tls::ServerSecurity,
}

impl Config {
    /// The settings and the config file's tables, as [`rgpu_config`] loaded them.
    pub fn load(loaded: rgpu_config::Loaded<Settings>) -> anyhow::Result<Config> {
        let what = || match &loaded.file {
            Some(p) => format!("config file {}", p.display()),
            None => "config".to_string(),
        };
        let tables: FileTables = toml::Value::Table(loaded.tables.clone()).try_into().with_context(what)?;
        Config::new(loaded.settings, tables.tenants).with_context(what)
    }

    /// The settings alone, with no tenant policies.
    pub fn from_settings(s: Settings) -> anyhow::Result<Config> {
        Config::new(s, HashMap::new())
    }

    fn new(s: Settings, file_tenants: HashMap<String, FileTenant>) -> anyhow::Result<Config> {
        let mut tenants = HashMap::new();
        for (name, t) in file_tenants {
            let max_memory = match &t.max_memory {
                Some(m) => Some(
                    rgpu_config::toml_text(m)
                        .and_then(|m| rgpu_config::parse_size(&m))
                        .map_err(anyhow::Error::msg)
                        .with_context(|| format!("tenant {name}: max-memory"))?,
                ),
                None => None,
            };
            if let Some(k) = t.pkey {
                // 0x0000 and 0x8000 are not partition keys.
                if k & 0x7fff == 0 {
                    bail!("tenant {name}: pkey {k:#06x} is not a valid InfiniBand partition key");
                }
            }
            let partitions = if t.partitions.is_empty() { vec![name.clone()] } else { t.partitions };
            tenants.insert(name, TenantPolicy {
                partitions,
                max_gpus: t.max_gpus,
                max_memory,
                max_leases: t.max_leases,
                max_rate: t.max_rate,
                pkey: t.pkey,
            });
        }
        if matches!(s.store, StoreUrl::Etcd { .. }) && s.advertise.is_none() {
            let ip = s.listen.rsplit_once(':').map_or("", |(h, _)| h).trim_matches(['[', ']']);
            if ip.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_unspecified()) {
                bail!("--listen {} is every address: with an etcd store, say which one other brokers send clients to (--advertise HOST:PORT)", s.listen);
            }
        }
        if s.heartbeat_ms == 0 {
            bail!("heartbeat-ms must be at least 1");
        }
        let limits = Limits {
            heartbeat_ms: s.heartbeat_ms,
            default_ttl_ms: s.default_ttl_ms.max(1),
            reserve_after_ms: s.reserve_after_ms,
            default_max_leases: s.default_max_leases,
            default_max_gpus: s.default_max_gpus,
            default_max_rate: s.default_max_rate.max(1),
            evacuate_unhealthy: s.evacuate_unhealthy,
            preempt_after_ms: s.preempt_after_ms,
            ..Limits::default()
        };
        let security = rgpu_tls::ServerSecurity::new(s.tls_cert.as_deref(), s.tls_key.as_deref(), s.plaintext)?;
        Ok(Config {
            security,
            data_dir: s.data_dir,
            key_file: s.key_file,
            create_key: s.create_key,
            admin_key_file: s.admin_key_file,
            limits,
            threads: s.threads.max(1),
            placement: s.placement,
            tenants,
            advertise: s.advertise.unwrap_or_else(|| s.listen.clone()),
            listen: s.listen,
            store: s.store,
            leader_ttl_s: s.leader_ttl.max(1),
            metrics: s.metrics,
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

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use rgpu_config::Settings as _;

    use super::*;

    const SAMPLES: &[(&str, [&str; 2])] = &[
        ("listen", ["0.0.0.0:1", "127.0.0.1:2"]),
        ("data-dir", ["/d1", "/d2"]),
        ("key-file", ["/k1", "/k2"]),
        ("create-key", ["true", "false"]),
        ("admin-key-file", ["/a1", "/a2"]),
        ("heartbeat-ms", ["10", "20"]),
        ("default-ttl-ms", ["10", "20"]),
        ("reserve-after-ms", ["10", "20"]),
        ("default-max-leases", ["10", "20"]),
        ("default-max-gpus", ["10", "20"]),
        ("default-max-rate", ["10", "20"]),
        ("evacuate-unhealthy", ["false", "true"]),
        ("preempt-after-ms", ["10", "20"]),
        ("threads", ["3", "4"]),
        ("placement", ["simple", "fgd"]),
        ("store", ["etcd://a:1/p", "etcd://b:2,c:3"]),
        ("advertise", ["a:1", "b:2"]),
        ("leader-ttl", ["3", "4"]),
        ("metrics", ["127.0.0.1:9100", "[::1]:9101"]),
        ("tls-cert", ["/c1", "/c2"]),
        ("tls-key", ["/k1", "/k2"]),
        ("plaintext", ["true", "false"]),
    ];

    #[test]
    fn every_flag_is_a_file_key_and_flag_beats_env_beats_file_beats_default() {
        rgpu_config::testing::check_every_setting::<Settings>(SAMPLES);
    }

    /// Scripts, tests and docs use these names: renaming one breaks them.
    #[test]
    fn flag_and_environment_names_are_stable() {
        let want: Vec<(&str, String)> =
            SAMPLES.iter().map(|(k, _)| (*k, format!("RGPU_BROKER_{}", k.to_ascii_uppercase().replace('-', "_")))).collect();
        let got: Vec<(&str, String)> = Settings::keys().iter().map(|(k, e)| (*k, e.to_string())).collect();
        assert_eq!(got, want);
        assert_eq!(Settings::CONFIG_ENV, "RGPU_BROKER_CONFIG");
    }

    /// Plaintext unless the arguments name a certificate: the tests below
    /// that are not about TLS.
    fn load(args: &[&str]) -> anyhow::Result<Config> {
        let env = if args.iter().any(|a| a.starts_with("--tls")) {
            HashMap::new()
        } else {
            HashMap::from([("RGPU_BROKER_PLAINTEXT".to_string(), "1".to_string())])
        };
        let argv = std::iter::once("rgpu-broker").chain(args.iter().copied());
        Config::load(Settings::load_from(argv, &env)?)
    }

    #[test]
    fn tls_or_plaintext_is_chosen_explicitly() {
        let argv = ["rgpu-broker"];
        let e = format!("{:#}", Config::load(Settings::load_from(argv, &HashMap::new()).unwrap()).unwrap_err());
        assert!(e.contains("--tls-cert") && e.contains("--plaintext"), "{e}");
        let dir = std::env::temp_dir().join(format!("rgpu-broker-tls-cfg-{}", std::process::id()));
        let f = rgpu_tls::pki::write_throwaway(&dir, &["localhost"]).unwrap();
        let c = load(&["--tls-cert", f.cert.to_str().unwrap(), "--tls-key", f.key.to_str().unwrap()]).unwrap();
        assert!(c.security.is_tls());
        assert!(!load(&[]).unwrap().security.is_tls());
        let both = ["--tls-cert", f.cert.to_str().unwrap(), "--tls-key", f.key.to_str().unwrap(), "--plaintext"];
        assert!(load(&both).is_err());
        let _ = std::fs::remove_dir_all(dir);
    }

    fn temp_file(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("rgpu-broker-cfg-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("b.toml");
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn defaults() {
        let c = load(&[]).unwrap();
        assert_eq!((c.listen.as_str(), c.data_dir.as_path()), (DEFAULT_LISTEN, std::path::Path::new("rgpu-broker-data")));
        assert_eq!((c.threads, c.placement, c.create_key), (2, Placement::FgdPack, false));
        let d = Limits::default();
        assert_eq!((c.limits.heartbeat_ms, c.limits.default_ttl_ms, c.limits.reserve_after_ms), (d.heartbeat_ms, d.default_ttl_ms, d.reserve_after_ms));
        assert!(c.tenants.is_empty() && c.key_file.is_none());
        assert!(c.limits.evacuate_unhealthy, "evacuation is on unless turned off");
        assert!(!load(&["--evacuate-unhealthy=false"]).unwrap().limits.evacuate_unhealthy);
    }

    #[test]
    fn tenants() {
        let p = temp_file(
            "tenants",
            "listen = \"127.0.0.1:1\"\n[tenants.alice]\nmax-gpus = 2\nmax-memory = \"32GiB\"\npkey = 0x8001\n\
             [tenants.bob]\nmax-memory = 1073741824\npartitions = [\"a\", \"b\"]\nmax-leases = 3\nmax-rate = 7\n",
        );
        let path = p.to_str().unwrap();
        let c = load(&["--config", path, "--listen", "127.0.0.1:2"]).unwrap();
        assert_eq!(c.listen, "127.0.0.1:2", "flags win over the file");
        let a = &c.tenants["alice"];
        assert_eq!((a.partitions.clone(), a.max_gpus, a.max_memory), (vec!["alice".to_string()], Some(2), Some(32 << 30)));
        let b = &c.tenants["bob"];
        assert_eq!((b.partitions.clone(), b.max_memory, b.pkey), (vec!["a".to_string(), "b".into()], Some(1 << 30), None));
        assert_eq!(a.pkey, Some(0x8001));
        assert_eq!((b.max_leases, b.max_rate, a.max_leases), (Some(3), Some(7), None));
        std::fs::write(&p, "[tenants.alice]\npkey = 0x8000\n").unwrap();
        let e = load(&["--config", path]).unwrap_err();
        assert!(format!("{e:#}").contains("pkey"), "{e:#}");
        std::fs::write(&p, "[tenants.alice]\npkey = 0x18001\n").unwrap();
        assert!(load(&["--config", path]).is_err(), "wider than 16 bits");
        std::fs::write(&p, "[tenants.alice]\nmax-memroy = \"1GiB\"\n").unwrap();
        let e = load(&["--config", path]).unwrap_err();
        assert!(format!("{e:#}").contains("max-memroy"), "{e:#}");
        std::fs::write(&p, "[tenants.alice]\nmax-memory = \"lots\"\n").unwrap();
        let e = load(&["--config", path]).unwrap_err();
        assert!(format!("{e:#}").contains("max-memory"), "{e:#}");
        std::fs::write(&p, "[tennants.alice]\n").unwrap();
        let e = load(&["--config", path]).unwrap_err();
        assert!(format!("{e:#}").contains("unknown key `tennants`"), "{e:#}");
        let _ = std::fs::remove_dir_all(p.parent().unwrap());
    }

    #[test]
    fn checks_that_need_more_than_a_parser() {
        assert!(load(&["--heartbeat-ms", "0"]).is_err());
        let c = load(&["--default-ttl-ms", "0", "--threads", "0"]).unwrap();
        assert_eq!((c.limits.default_ttl_ms, c.threads), (1, 1));
    }

    #[test]
    fn store_urls() {
        assert_eq!(load(&[]).unwrap().store, StoreUrl::Redb);
        let c = load(&["--store", "etcd://e1:2379, e2:2379/pools/a/", "--listen", "0.0.0.0:7770", "--advertise", "b1:7770"]).unwrap();
        let want = StoreUrl::Etcd { endpoints: vec!["e1:2379".into(), "e2:2379".into()], prefix: "/pools/a".into() };
        assert_eq!((c.store, c.advertise.as_str()), (want, "b1:7770"));
        let c = load(&["--store", "etcd://e1:2379", "--listen", "127.0.0.1:9"]).unwrap();
        assert_eq!(c.store, StoreUrl::Etcd { endpoints: vec!["e1:2379".into()], prefix: "/rgpu-broker".into() });
        assert_eq!(c.advertise, "127.0.0.1:9", "the listen address by default");
        let e = load(&["--store", "etcd://e1:2379", "--listen", "0.0.0.0:7770"]).unwrap_err();
        assert!(format!("{e:#}").contains("--advertise"), "{e:#}");
        assert_eq!(load(&["--listen", "0.0.0.0:7770"]).unwrap().advertise, "0.0.0.0:7770", "redb: no one is sent there");
        for bad in ["etcd://", "etcd://e1", "etcd://e1:1/", "zookeeper://z:1", "redb2"] {
            assert!(load(&["--store", bad]).is_err(), "{bad}");
        }
    }

    #[test]
    fn placement_defaults_to_fgd_pack_and_the_flag_wins() {
        let p = temp_file("place", "placement = \"simple\"\n");
        let path = p.to_str().unwrap();
        assert_eq!(load(&["--config", path]).unwrap().placement, Placement::Simple);
        assert_eq!(load(&["--config", path, "--placement", "fgd-pack"]).unwrap().placement, Placement::FgdPack);
        std::fs::write(&p, "placement = \"tetris\"\n").unwrap();
        let e = load(&["--config", path]).unwrap_err();
        assert!(format!("{e:#}").contains("tetris"), "{e:#}");
        assert_eq!(Placement::FgdPack.policy().name(), "fgd-pack");
        assert_eq!(Placement::parse("fgd").unwrap().policy().name(), "fgd");
        let _ = std::fs::remove_dir_all(p.parent().unwrap());
    }
}
