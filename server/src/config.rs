//! Server settings. Each is declared once, in [`Settings`]: its flag, its
//! environment variable (`RGPU_SERVER_*`, and the shim's `RGPU_SPIN_US`),
//! and its key in the TOML file `--config` names (the long flag), in that
//! order of precedence, then its default. [`Config`] is what the server
//! runs with, checked and derived from the settings.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use rgpu_config::FromText;
use rgpu_transport::rdma::RdmaConfig;
use rgpu_transport::select::Mode;

use crate::backend::sim::kernels::DEFAULT_TIME_LIMIT;
use crate::backend::sim::SimConfig;
use crate::limits::{self, Limits};

pub const DEFAULT_LISTEN: &str = "127.0.0.1:7767";
pub const DEFAULT_SIM_MEMORY: u64 = 16 << 30;
pub const DEFAULT_ATTACH_TIMEOUT_MS: u32 = 30_000;
pub const DEFAULT_DRAIN_TIMEOUT_S: u64 = 30;
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// Simulated devices in this process (no GPU needed).
    Sim,
    /// Real GPUs through the CUDA driver (libcuda.so.1, found at run time).
    Cuda,
    /// The real-GPU backend when a driver and a device are found, else sim.
    Auto,
}

impl FromText for BackendKind {
    fn from_text(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "sim" => Ok(BackendKind::Sim),
            "cuda" => Ok(BackendKind::Cuda),
            "auto" => Ok(BackendKind::Auto),
            _ => Err(format!("unknown backend {s:?} (sim, cuda or auto)")),
        }
    }
}

rgpu_config::settings! {
    /// rgpu GPU server: exports this host's GPUs (or simulated ones) to rgpu clients.
    #[settings(name = "rgpu-server", config_env = "RGPU_SERVER_CONFIG",
               config_help = "TOML file with any of the settings above (keys as the long flags, e.g. `sim-memory = \"8GiB\"`).")]
    pub struct Settings {
        /// Address to listen on (port 0 picks a free port) [default: 127.0.0.1:7767].
        #[setting(flag = "listen", env = "RGPU_SERVER_LISTEN", value_name = "ADDR")]
        listen: String = DEFAULT_LISTEN.to_string(),
        /// Which backend serves the devices: sim (simulated devices in this
        /// process, no GPU needed), cuda (real GPUs through the CUDA driver,
        /// found at run time) or auto (cuda when a driver and a device are
        /// found, else sim) [default: auto].
        #[setting(flag = "backend", env = "RGPU_SERVER_BACKEND", value_name = "sim|cuda|auto")]
        backend: BackendKind = BackendKind::Auto,
        /// cuda backend: place client memory through the driver's virtual
        /// memory management API, in ranges this server reserves, so that
        /// sessions can be checkpointed and migrated (docs/migration.md);
        /// without it, plain cuMemAlloc, and checkpoints of cuda sessions are
        /// refused [default: false].
        #[setting(flag = "cuda-movable-memory", env = "RGPU_SERVER_CUDA_MOVABLE_MEMORY")]
        cuda_movable_memory: bool = false,
        /// Number of simulated devices [default: 1].
        #[setting(flag = "sim-devices", env = "RGPU_SERVER_SIM_DEVICES", value_name = "N")]
        sim_devices: u32 = 1,
        /// Memory per simulated device, e.g. 512MiB, 1.5GiB or 16GiB [default: 16GiB].
        #[setting(flag = "sim-memory", env = "RGPU_SERVER_SIM_MEMORY", value_name = "BYTES",
                  parse = rgpu_config::parse_size)]
        sim_memory: u64 = DEFAULT_SIM_MEMORY,
        /// Compute capability of the simulated devices [default: 9.0].
        #[setting(flag = "sim-compute-capability", env = "RGPU_SERVER_SIM_COMPUTE_CAPABILITY",
                  value_name = "MAJOR.MINOR", parse = parse_cc)]
        sim_compute_capability: (u32, u32) = (9, 0),
        /// Mixed with the host name and ordinal into the simulated devices' UUIDs
        /// [default: the listening address, so a server on a fixed address keeps
        /// its UUIDs and two servers on one host never share one].
        #[setting(flag = "sim-seed", env = "RGPU_SERVER_SIM_SEED", value_name = "SIM_SEED")]
        sim_seed: Option<String> = None,
        /// Wall-clock limit of one kernel launch on the sim, in seconds
        /// (decimals allowed); a launch past it fails with
        /// CUDA_ERROR_LAUNCH_TIMEOUT [default: 30].
        #[setting(flag = "sim-kernel-timeout", env = "RGPU_SERVER_SIM_KERNEL_TIMEOUT", value_name = "SECS",
                  parse = parse_seconds)]
        sim_kernel_timeout: Duration = DEFAULT_TIME_LIMIT,
        /// Run the sim's kernels on its compiled tier (straight-line code as specialised
        /// lane kernels, the rest on the interpreter); off (`false`) runs every instruction on
        /// the interpreter, the reference the tier is tested against [default: true].
        #[setting(flag = "sim-compiled-tier", env = "RGPU_SERVER_SIM_COMPILED_TIER", value_name = "BOOL")]
        sim_compiled_tier: bool = true,
        /// How long an opened session waits for its data connection [default: 30000].
        #[setting(flag = "attach-timeout-ms", env = "RGPU_SERVER_ATTACH_TIMEOUT_MS", value_name = "MS")]
        attach_timeout_ms: u32 = DEFAULT_ATTACH_TIMEOUT_MS,
        /// Most connections served at once [default: 256].
        #[setting(flag = "max-connections", env = "RGPU_SERVER_MAX_CONNECTIONS", value_name = "N")]
        max_connections: usize = DEFAULT_MAX_CONNECTIONS,
        /// Most connections from one IP address, of max-connections, so one
        /// address cannot take them all [default: 64].
        #[setting(flag = "max-connections-per-address", env = "RGPU_SERVER_MAX_CONNECTIONS_PER_ADDRESS", value_name = "N")]
        max_connections_per_address: usize = limits::DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
        /// Seconds a new connection has to say what it is: the preamble and
        /// a data connection's session credentials, or a control
        /// connection's hello; then it is closed [default: 10].
        #[setting(flag = "handshake-timeout", env = "RGPU_SERVER_HANDSHAKE_TIMEOUT", value_name = "SECS",
                  parse = parse_seconds)]
        handshake_timeout: Duration = limits::DEFAULT_HANDSHAKE_TIMEOUT,
        /// Seconds a control connection may go without a call before it is
        /// closed (clients use the control plane for a few calls at start-up)
        /// [default: 30].
        #[setting(flag = "control-idle-timeout", env = "RGPU_SERVER_CONTROL_IDLE_TIMEOUT", value_name = "SECS",
                  parse = parse_seconds)]
        control_idle_timeout: Duration = limits::DEFAULT_CONTROL_IDLE_TIMEOUT,
        /// Largest module image one load may send; a larger one is refused
        /// with CUDA_ERROR_OUT_OF_MEMORY without being buffered [default: 256MiB].
        #[setting(flag = "max-module-image", env = "RGPU_SERVER_MAX_MODULE_IMAGE", value_name = "BYTES",
                  parse = rgpu_config::parse_size)]
        max_module_image: u64 = limits::DEFAULT_MAX_MODULE_IMAGE,
        /// Module image bytes the sessions of one lease (or one session
        /// without a lease) may keep loaded on this server at once; past it a
        /// load fails with CUDA_ERROR_OUT_OF_MEMORY [default: 1GiB].
        #[setting(flag = "max-module-bytes-per-lease", env = "RGPU_SERVER_MAX_MODULE_BYTES_PER_LEASE", value_name = "BYTES",
                  parse = rgpu_config::parse_size)]
        max_module_bytes_per_lease: u64 = limits::DEFAULT_MAX_MODULE_BYTES_PER_LEASE,
        /// Client input the server buffers at once, all connections together
        /// (module images being read, request messages over 64 KiB); a load
        /// past it fails with CUDA_ERROR_OUT_OF_MEMORY [default: 1GiB].
        #[setting(flag = "max-buffered-input", env = "RGPU_SERVER_MAX_BUFFERED_INPUT", value_name = "BYTES",
                  parse = rgpu_config::parse_size)]
        max_buffered_input: u64 = limits::DEFAULT_MAX_BUFFERED_INPUT,
        /// Seconds a session whose data connection broke without the
        /// client's orderly close keeps its device memory, objects and
        /// queued work while the client reconnects and resumes; then it is
        /// freed. 0 frees it at once (decimals allowed) [default: 30].
        #[setting(flag = "reconnect-grace", env = "RGPU_SERVER_RECONNECT_GRACE", value_name = "SECS",
                  parse = parse_seconds_or_zero)]
        reconnect_grace: Duration = limits::DEFAULT_RECONNECT_GRACE,
        /// Seconds a data connection may go without a frame from the client
        /// (the shim pings every 10 s when idle), or without taking what
        /// the server sends, before it counts as broken: a stopped client's
        /// session is freed after this plus the reconnect grace [default: 60].
        #[setting(flag = "client-timeout", env = "RGPU_SERVER_CLIENT_TIMEOUT", value_name = "SECS",
                  parse = parse_seconds)]
        client_timeout: Duration = limits::DEFAULT_CLIENT_TIMEOUT,
        /// Data-plane transport: tcp, rdma (requires the verbs plugin and a
        /// device) or auto (RDMA for clients that ask, when available) [default: auto].
        #[setting(flag = "transport", env = "RGPU_SERVER_TRANSPORT", value_name = "tcp|rdma|auto",
                  parse = rgpu_config::via_from_str)]
        transport: Mode = Mode::Auto,
        /// RDMA: send bulk replies zero-copy (the client RDMA-READs them from
        /// this server's buffers, registered once and cached) instead of
        /// through the staging ring. Opt-in.
        #[setting(flag = "rdma-zero-copy", env = "RGPU_SERVER_RDMA_ZERO_COPY")]
        rdma_zero_copy: bool = false,
        /// RDMA: receive-ring slots (8 KiB each) per connection, 4..=4096 [default: 64].
        #[setting(flag = "rdma-ring-slots", env = "RGPU_SERVER_RDMA_RING_SLOTS", value_name = "N")]
        rdma_ring_slots: Option<u16> = None,
        /// TCP data connections: how long a read polls before it sleeps in
        /// the kernel, in microseconds; polling trades CPU for latency, 0
        /// turns it off. The same variable sets the shim's [default: 50].
        #[setting(flag = "spin-us", env = "RGPU_SPIN_US", value_name = "US")]
        spin_us: u64 = rgpu_transport::tcp::DEFAULT_SPIN.as_micros() as u64,
        /// Pool broker to register with and heartbeat (host:port; replicated
        /// brokers: all their addresses, comma-separated, and the server
        /// finds the leader); needs --broker-key-file.
        #[setting(flag = "broker", env = "RGPU_SERVER_BROKER", value_name = "ADDR")]
        broker: Option<String> = None,
        /// The broker's key file: with it, sessions need a lease token the
        /// broker signed; without it, anyone may open a session.
        #[setting(flag = "broker-key-file", env = "RGPU_SERVER_BROKER_KEY_FILE", value_name = "FILE")]
        broker_key_file: Option<PathBuf> = None,
        /// Admit only lease tokens bound to a client key (the holder's proof
        /// at every session; docs/security.md): refuses bearer tokens, which
        /// clients that do not bind still ask for.
        #[setting(flag = "require-bound-tokens", env = "RGPU_SERVER_REQUIRE_BOUND_TOKENS")]
        require_bound_tokens: bool = false,
        /// Address clients reach this server on, as registered with the broker
        /// [default: the listening address].
        #[setting(flag = "advertise", env = "RGPU_SERVER_ADVERTISE", value_name = "ADDR")]
        advertise: Option<String> = None,
        /// Topology: this server's node [default: the advertised address].
        #[setting(flag = "node", env = "RGPU_SERVER_NODE", value_name = "NODE")]
        node: Option<String> = None,
        /// Topology: the leaf switch above the node [default: "leaf0"].
        #[setting(flag = "leaf", env = "RGPU_SERVER_LEAF", value_name = "LEAF")]
        leaf: String = "leaf0".to_string(),
        /// Topology: the spine above the leaf [default: "spine0"].
        #[setting(flag = "spine", env = "RGPU_SERVER_SPINE", value_name = "SPINE")]
        spine: String = "spine0".to_string(),
        /// On SIGTERM with a broker: drain first (no new leases here) and wait
        /// up to this many seconds for the leases on this server to end; 0
        /// stops at once [default: 30]. A second signal stops at once.
        #[setting(flag = "drain-timeout", env = "RGPU_SERVER_DRAIN_TIMEOUT", value_name = "SECS")]
        drain_timeout: u64 = DEFAULT_DRAIN_TIMEOUT_S,
        /// Topology: what this server's network links carry each way, e.g.
        /// 100Gb/s, 400Mb/s or 12.5GB/s (b: bits, B: bytes), registered with
        /// the broker, which grants leases' bandwidth (`rgpu lease
        /// --bandwidth`) here up to it and prefers servers with more free
        /// [default: not said: unbounded].
        #[setting(flag = "link-bandwidth", env = "RGPU_SERVER_LINK_BANDWIDTH", value_name = "RATE",
                  parse = parse_link_bandwidth)]
        link_bandwidth: Option<u64> = None,
        /// Partitions (tenant pools) this server serves, comma-separated (in
        /// the file, a string or an array) [default: default].
        #[setting(flag = "partitions", env = "RGPU_SERVER_PARTITIONS", value_name = "PARTITIONS")]
        partitions: Vec<String> = Vec::new(),
        /// Serve Prometheus metrics over HTTP at http://ADDR/metrics
        /// (docs/metrics.md); off unless set.
        #[setting(flag = "metrics", env = "RGPU_SERVER_METRICS", value_name = "ADDR")]
        metrics: Option<String> = None,
        /// TLS: this server's certificate chain (PEM, leaf first; it must
        /// name the host clients dial). With --tls-key, both planes are
        /// served under TLS; without them the server needs --plaintext.
        #[setting(flag = "tls-cert", env = "RGPU_SERVER_TLS_CERT", value_name = "FILE")]
        tls_cert: Option<PathBuf> = None,
        /// TLS: the private key of --tls-cert (PEM).
        #[setting(flag = "tls-key", env = "RGPU_SERVER_TLS_KEY", value_name = "FILE")]
        tls_key: Option<PathBuf> = None,
        /// TLS: the CA file the broker's certificate, and the certificates
        /// of other GPU servers this one migrates sessions to, are checked
        /// against (with --broker, unless --plaintext).
        #[setting(flag = "tls-ca", env = "RGPU_SERVER_TLS_CA", value_name = "FILE")]
        tls_ca: Option<PathBuf> = None,
        /// Serve both planes, and talk to the broker, in clear: only on a
        /// network where nobody untrusted can read or inject traffic
        /// (lease tokens, session keys and CUDA data cross it as they are).
        #[setting(flag = "plaintext", env = "RGPU_SERVER_PLAINTEXT")]
        plaintext: bool = false,
        /// Operator key file (the format of the broker key file): `rgpu
        /// checkpoint` and `rgpu restore` prove they hold it; without it both
        /// are refused (docs/migration.md).
        #[setting(flag = "admin-key-file", env = "RGPU_SERVER_ADMIN_KEY_FILE", value_name = "FILE")]
        admin_key_file: Option<PathBuf> = None,
        /// Directory session snapshots are written to and restored from
        /// (by name; no paths); without it checkpoint and restore are refused.
        #[setting(flag = "checkpoint-dir", env = "RGPU_SERVER_CHECKPOINT_DIR", value_name = "DIR")]
        checkpoint_dir: Option<PathBuf> = None,
        /// Snapshots in --checkpoint-dir to restore before taking any
        /// connection (comma-separated names): a server started at a stopped
        /// one's address takes its sessions back before their clients resume.
        #[setting(flag = "restore", env = "RGPU_SERVER_RESTORE", value_name = "NAMES")]
        restore: Vec<String> = Vec::new(),
        /// Live migration out of this server pre-copies a session's memory
        /// while its program runs, then sends only what changed while it is
        /// held (docs/migration.md); `--migrate-precopy=false`: everything while it is held.
        #[setting(flag = "migrate-precopy", env = "RGPU_SERVER_MIGRATE_PRECOPY")]
        migrate_precopy: bool = true,
    }
}

/// The effective settings.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: String,
    pub backend: BackendKind,
    /// The cuda backend places client memory so that sessions can move.
    pub cuda_movable_memory: bool,
    pub sim: SimConfig,
    pub attach_timeout: Duration,
    pub max_connections: usize,
    /// Connection, handshake and input bounds.
    pub limits: Limits,
    /// The data plane's transport.
    pub transport: TransportConfig,
    /// The pool broker, if any.
    pub pool: PoolConfig,
    /// Where to serve Prometheus metrics, if anywhere.
    pub metrics: Option<String>,
    /// TLS on the listening port, or plaintext (`--plaintext`).
    pub security: rgpu_tls::ServerSecurity,
    /// Checkpoint and restore: the operator key and the snapshot directory.
    pub checkpoint: CheckpointConfig,
}

/// How data connections are carried (see [`crate::transport_select`]).
#[derive(Debug, Clone)]
pub struct TransportConfig {
    pub mode: Mode,
    /// `--rdma-zero-copy`, `--rdma-ring-slots`.
    pub rdma: RdmaConfig,
    /// How long a read on a TCP data connection polls before it sleeps.
    pub tcp_spin: Duration,
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig { mode: Mode::Auto, rdma: RdmaConfig::default(), tcp_spin: rgpu_transport::tcp::DEFAULT_SPIN }
    }
}

/// Topology and partitions this server announces to the broker.
#[derive(Debug, Clone, Default)]
pub struct Labels {
    pub node: String,
    pub leaf: String,
    pub spine: String,
    pub partitions: Vec<String>,
    /// Bytes/s the server's links carry each way; None: not said.
    pub link_bandwidth: Option<u64>,
}

/// Checkpoint and restore (docs/migration.md): both need the key and the directory.
#[derive(Debug, Clone, Default)]
pub struct CheckpointConfig {
    pub admin_key: Option<Vec<u8>>,
    pub dir: Option<PathBuf>,
    /// Snapshots restored at start.
    pub restore: Vec<String>,
    /// Whether migrations out pre-copy memory while the program runs.
    pub precopy: bool,
    /// How a live migration's target is spoken to; None: TLS is wanted but
    /// no `--tls-ca` says whom to trust, so migrations out are refused.
    pub peer_security: Option<rgpu_tls::ClientSecurity>,
}

/// Settings for the pool broker; the default is no broker (sessions open
/// to anyone, nothing registered).
#[derive(Debug, Clone)]
pub struct PoolConfig {
    pub broker: Option<String>,
    /// The key read from the broker key file.
    pub broker_key: Option<Vec<u8>>,
    /// Refuse lease tokens not bound to a client key.
    pub require_bound_tokens: bool,
    pub advertise: Option<String>,
    pub labels: Labels,
    /// How long a stopping server waits for its leases to end (zero: it
    /// stops at once, as without a broker).
    pub drain_timeout: Duration,
    /// How the broker is spoken to: TLS checked against `--tls-ca`, or
    /// plaintext with `--plaintext`.
    pub broker_security: rgpu_tls::ClientSecurity,
}

impl Default for PoolConfig {
    /// No broker. (A broker named in code rather than settings, as tests
    /// do, is spoken to in plaintext: set `broker_security` for TLS.)
    fn default() -> Self {
        PoolConfig {
            broker: None,
            broker_key: None,
            require_bound_tokens: false,
            advertise: None,
            labels: Labels::default(),
            drain_timeout: Duration::ZERO,
            broker_security: rgpu_tls::ClientSecurity::Plaintext,
        }
    }
}

impl Config {
    /// Checks the settings and reads the files they name.
    pub fn from_settings(s: Settings) -> anyhow::Result<Config> {
        if s.sim_devices == 0 {
            bail!("sim-devices must be at least 1");
        }
        if s.max_connections == 0 {
            bail!("max-connections must be at least 1");
        }
        if s.max_connections_per_address == 0 {
            bail!("max-connections-per-address must be at least 1");
        }
        let rdma = RdmaConfig::with_knobs(s.rdma_zero_copy, s.rdma_ring_slots)
            .map_err(anyhow::Error::msg)
            .context("rdma-ring-slots")?;
        let broker_key = match &s.broker_key_file {
            Some(p) => {
                let bytes =
                    std::fs::read(p).with_context(|| format!("cannot read broker key file {}", p.display()))?;
                Some(rgpu_protocol::token::parse_key(&bytes).with_context(|| format!("broker key file {}", p.display()))?)
            }
            None => None,
        };
        let admin_key = match &s.admin_key_file {
            Some(p) => {
                let bytes = std::fs::read(p).with_context(|| format!("cannot read admin key file {}", p.display()))?;
                Some(rgpu_protocol::token::parse_key(&bytes).with_context(|| format!("admin key file {}", p.display()))?)
            }
            None => None,
        };
        if s.broker.is_some() && broker_key.is_none() {
            // The broker takes registrations only with a proof under its key.
            bail!("--broker needs --broker-key-file: a server registers by proving it holds the broker's key");
        }
        let security = rgpu_tls::ServerSecurity::new(s.tls_cert.as_deref(), s.tls_key.as_deref(), s.plaintext)?;
        let broker_security = match (&s.broker, s.plaintext) {
            (_, true) => rgpu_tls::ClientSecurity::Plaintext,
            (Some(_), false) => rgpu_tls::ClientSecurity::new(s.tls_ca.as_deref(), None, false)
                .context("--broker under TLS needs --tls-ca, the CA that signed the broker's certificate")?,
            // No broker to speak to.
            (None, false) => rgpu_tls::ClientSecurity::Plaintext,
        };
        let peer_security = match (&s.tls_ca, s.plaintext) {
            (_, true) => Some(rgpu_tls::ClientSecurity::Plaintext),
            (Some(ca), false) => Some(
                rgpu_tls::ClientSecurity::new(Some(ca), None, false).context("--tls-ca, to check the servers sessions migrate to")?,
            ),
            (None, false) => None,
        };
        Ok(Config {
            security,
            listen: s.listen,
            backend: s.backend,
            cuda_movable_memory: s.cuda_movable_memory,
            sim: SimConfig {
                devices: s.sim_devices,
                memory: s.sim_memory,
                compute_capability: s.sim_compute_capability,
                seed: s.sim_seed,
                kernel_time_limit: s.sim_kernel_timeout,
                compiled_tier: s.sim_compiled_tier,
            },
            attach_timeout: Duration::from_millis(s.attach_timeout_ms as u64),
            max_connections: s.max_connections,
            limits: Limits {
                max_connections_per_address: s.max_connections_per_address,
                handshake_timeout: s.handshake_timeout,
                control_idle_timeout: s.control_idle_timeout,
                max_module_image: s.max_module_image,
                max_module_bytes_per_lease: s.max_module_bytes_per_lease,
                max_buffered_input: s.max_buffered_input,
                reconnect_grace: s.reconnect_grace,
                client_timeout: s.client_timeout,
            },
            transport: TransportConfig { mode: s.transport, rdma, tcp_spin: Duration::from_micros(s.spin_us) },
            pool: PoolConfig {
                broker: s.broker,
                broker_key,
                require_bound_tokens: s.require_bound_tokens,
                advertise: s.advertise,
                labels: Labels {
                    node: s.node.unwrap_or_default(),
                    leaf: s.leaf,
                    spine: s.spine,
                    partitions: s.partitions,
                    link_bandwidth: s.link_bandwidth,
                },
                drain_timeout: Duration::from_secs(s.drain_timeout),
                broker_security,
            },
            metrics: s.metrics,
            checkpoint: CheckpointConfig { admin_key, dir: s.checkpoint_dir, restore: s.restore, peer_security, precopy: s.migrate_precopy },
        })
    }
}

/// `--link-bandwidth`: a rate above zero (leave it out for unbounded).
pub fn parse_link_bandwidth(s: &str) -> Result<Option<u64>, String> {
    match rgpu_config::parse_bandwidth(s)? {
        0 => Err(format!("link-bandwidth {s:?} must be more than 0 (leave it out when the link is not known)")),
        n => Ok(Some(n)),
    }
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

/// Parses a positive number of seconds, decimals allowed (`30`, `2.5`).
pub fn parse_seconds(s: &str) -> Result<Duration, String> {
    let err = || format!("invalid duration {s:?}: expected a number of seconds more than 0, e.g. 30 or 2.5");
    let secs: f64 = s.trim().parse().map_err(|_| err())?;
    // NaN is not more than 0 either.
    if secs.is_nan() || secs <= 0.0 {
        return Err(err());
    }
    Duration::try_from_secs_f64(secs).map_err(|_| err())
}

/// As [`parse_seconds`], and 0 too.
pub fn parse_seconds_or_zero(s: &str) -> Result<Duration, String> {
    match s.trim().parse::<f64>() {
        Ok(z) if z == 0.0 => Ok(Duration::ZERO),
        _ => parse_seconds(s),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use rgpu_config::Settings as _;

    use super::*;

    /// Two values per setting that read differently, one not the default.
    const SAMPLES: &[(&str, [&str; 2])] = &[
        ("listen", ["0.0.0.0:1", "127.0.0.1:2"]),
        ("backend", ["sim", "cuda"]),
        ("cuda-movable-memory", ["true", "false"]),
        ("sim-devices", ["3", "4"]),
        ("sim-memory", ["1.5GiB", "4096"]),
        ("sim-compute-capability", ["8.6", "7.5"]),
        ("sim-seed", ["a", "b"]),
        ("sim-kernel-timeout", ["2.5", "60"]),
        ("sim-compiled-tier", ["false", "true"]),
        ("attach-timeout-ms", ["100", "200"]),
        ("max-connections", ["8", "9"]),
        ("max-connections-per-address", ["2", "3"]),
        ("handshake-timeout", ["1.5", "2"]),
        ("control-idle-timeout", ["3", "4.5"]),
        ("max-module-image", ["1MiB", "2MiB"]),
        ("max-module-bytes-per-lease", ["3MiB", "4MiB"]),
        ("max-buffered-input", ["5MiB", "6MiB"]),
        ("reconnect-grace", ["0", "2.5"]),
        ("client-timeout", ["5", "90"]),
        ("transport", ["tcp", "rdma"]),
        ("rdma-zero-copy", ["true", "false"]),
        ("rdma-ring-slots", ["128", "4096"]),
        ("spin-us", ["0", "7"]),
        ("broker", ["b:1", "b:2"]),
        ("broker-key-file", ["/k1", "/k2"]),
        ("require-bound-tokens", ["true", "false"]),
        ("advertise", ["a:1", "a:2"]),
        ("node", ["n1", "n2"]),
        ("leaf", ["l1", "l2"]),
        ("spine", ["s1", "s2"]),
        ("drain-timeout", ["0", "5"]),
        ("link-bandwidth", ["10Gb/s", "25GB/s"]),
        ("partitions", ["a,b", "c"]),
        ("metrics", ["127.0.0.1:9100", "[::1]:9101"]),
        ("tls-cert", ["/c1", "/c2"]),
        ("tls-key", ["/k1", "/k2"]),
        ("tls-ca", ["/ca1", "/ca2"]),
        ("plaintext", ["true", "false"]),
        ("admin-key-file", ["/a1", "/a2"]),
        ("checkpoint-dir", ["/c1", "/c2"]),
        ("restore", ["a,b", "c"]),
        ("migrate-precopy", ["false", "true"]),
    ];

    #[test]
    fn every_flag_is_a_file_key_and_flag_beats_env_beats_file_beats_default() {
        rgpu_config::testing::check_every_setting::<Settings>(SAMPLES);
    }

    /// Scripts, tests and docs use these names: renaming one breaks them.
    #[test]
    fn flag_and_environment_names_are_stable() {
        let keys: Vec<(&str, &str)> = Settings::keys().to_vec();
        let want: Vec<(&str, String)> = SAMPLES
            .iter()
            .map(|(k, _)| {
                let env = match *k {
                    "spin-us" => "RGPU_SPIN_US".to_string(),
                    k => format!("RGPU_SERVER_{}", k.to_ascii_uppercase().replace('-', "_")),
                };
                (*k, env)
            })
            .collect();
        assert_eq!(keys.iter().map(|(k, e)| (*k, e.to_string())).collect::<Vec<_>>(), want);
        assert_eq!(Settings::CONFIG_ENV, "RGPU_SERVER_CONFIG");
    }

    /// As the binary loads its settings, plaintext chosen by the
    /// environment unless `env` says otherwise (the tests below that are
    /// not about TLS).
    fn load(args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<Config> {
        let mut env = env.to_vec();
        if !env.iter().any(|(k, _)| *k == "RGPU_SERVER_PLAINTEXT") {
            env.push(("RGPU_SERVER_PLAINTEXT", "1"));
        }
        load_raw(args, &env)
    }

    fn load_raw(args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<Config> {
        let env: HashMap<String, String> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let argv = std::iter::once("rgpu-server").chain(args.iter().copied());
        Config::from_settings(Settings::load_from(argv, &env)?.settings)
    }

    #[test]
    fn tls_or_plaintext_is_chosen_explicitly() {
        let e = format!("{:#}", load_raw(&[], &[]).unwrap_err());
        assert!(e.contains("--tls-cert") && e.contains("--plaintext"), "{e}");
        assert!(!load_raw(&["--plaintext"], &[]).unwrap().security.is_tls());
        let dir = std::env::temp_dir().join(format!("rgpu-server-tls-cfg-{}", std::process::id()));
        let f = rgpu_tls::pki::write_throwaway(&dir, &["localhost"]).unwrap();
        let (cert, key, ca) = (f.cert.to_str().unwrap(), f.key.to_str().unwrap(), f.ca.to_str().unwrap());
        let c = load_raw(&["--tls-cert", cert, "--tls-key", key], &[]).unwrap();
        assert!(c.security.is_tls());
        let e = format!("{:#}", load_raw(&["--tls-cert", cert, "--tls-key", key, "--plaintext"], &[]).unwrap_err());
        assert!(e.contains("choose one"), "{e}");
        assert!(load_raw(&["--tls-cert", cert], &[]).is_err(), "a certificate without its key");
        assert!(load_raw(&["--tls-cert", key, "--tls-key", key], &[]).is_err(), "a key is no certificate");
        // The broker is checked against a CA under TLS.
        let kf = dir.join("broker.key");
        std::fs::write(&kf, "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\n").unwrap();
        let broker = ["--broker", "b:1", "--broker-key-file", kf.to_str().unwrap(), "--tls-cert", cert, "--tls-key", key];
        let e = format!("{:#}", load_raw(&broker, &[]).unwrap_err());
        assert!(e.contains("--tls-ca"), "{e}");
        let with_ca: Vec<&str> = broker.iter().copied().chain(["--tls-ca", ca]).collect();
        assert!(load_raw(&with_ca, &[]).unwrap().pool.broker_security.is_tls());
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_broker_needs_its_key() {
        let e = load(&["--broker", "b:1"], &[]).unwrap_err();
        assert!(e.to_string().contains("--broker-key-file"), "{e}");
    }

    #[test]
    fn defaults() {
        let c = load(&[], &[]).unwrap();
        assert_eq!((c.listen.as_str(), c.backend), (DEFAULT_LISTEN, BackendKind::Auto));
        assert_eq!((c.sim.devices, c.sim.memory, c.sim.compute_capability, c.sim.seed), (1, DEFAULT_SIM_MEMORY, (9, 0), None));
        assert_eq!(c.sim.kernel_time_limit, DEFAULT_TIME_LIMIT);
        assert_eq!(c.attach_timeout, Duration::from_millis(DEFAULT_ATTACH_TIMEOUT_MS as u64));
        assert_eq!(c.max_connections, DEFAULT_MAX_CONNECTIONS);
        assert_eq!(c.limits, Limits::default());
        assert_eq!(c.transport.mode, Mode::Auto);
        assert_eq!(c.transport.tcp_spin, rgpu_transport::tcp::DEFAULT_SPIN);
        assert_eq!(c.transport.tcp_spin, TransportConfig::default().tcp_spin);
        assert_eq!((c.transport.rdma.zero_copy, c.transport.rdma.recv_slots), (false, RdmaConfig::default().recv_slots));
        assert_eq!((c.pool.labels.leaf.as_str(), c.pool.labels.spine.as_str()), ("leaf0", "spine0"));
        assert!(c.pool.broker.is_none() && c.pool.labels.partitions.is_empty());
        assert_eq!(c.pool.drain_timeout, Duration::from_secs(DEFAULT_DRAIN_TIMEOUT_S));
        assert!(c.metrics.is_none(), "metrics are off by default");
        assert_eq!(c.pool.labels.link_bandwidth, None, "a link is unbounded unless said");
    }

    #[test]
    fn link_bandwidth_takes_bits_or_bytes_per_second() {
        let c = load(&["--link-bandwidth", "100Gb/s"], &[]).unwrap();
        assert_eq!(c.pool.labels.link_bandwidth, Some(12_500_000_000));
        let c = load(&[], &[("RGPU_SERVER_LINK_BANDWIDTH", "2GB/s")]).unwrap();
        assert_eq!(c.pool.labels.link_bandwidth, Some(2_000_000_000));
        for bad in ["0", "0Gb/s", "10Gb", "fast"] {
            assert!(load(&["--link-bandwidth", bad], &[]).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_file_takes_the_transport_and_rdma_knobs() {
        let dir = std::env::temp_dir().join(format!("rgpu-server-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("server.toml");
        std::fs::write(
            &path,
            "transport = \"tcp\"\nrdma-zero-copy = true\nrdma-ring-slots = 128\nsim-kernel-timeout = 0.5\n\
             spin-us = 0\nsim-compute-capability = 8.6\nsim-memory = \"1GiB\"\npartitions = [\"a\", \"b\"]\n",
        )
        .unwrap();
        let c = load(&["--config", path.to_str().unwrap()], &[]).unwrap();
        assert_eq!(c.transport.mode, Mode::Tcp);
        assert_eq!((c.transport.rdma.zero_copy, c.transport.rdma.recv_slots), (true, 128));
        assert_eq!(c.sim.kernel_time_limit, Duration::from_millis(500));
        assert_eq!(c.transport.tcp_spin, Duration::ZERO);
        assert_eq!((c.sim.compute_capability, c.sim.memory), ((8, 6), 1 << 30));
        assert_eq!(c.pool.labels.partitions, ["a", "b"]);
        // The same file named by the environment; a flag still wins.
        let c = load(&["--rdma-zero-copy=false"], &[("RGPU_SERVER_CONFIG", path.to_str().unwrap())]).unwrap();
        assert_eq!((c.transport.mode, c.transport.rdma.zero_copy), (Mode::Tcp, false));
        std::fs::write(&path, "bogus = 1\n").unwrap();
        let e = load(&["--config", path.to_str().unwrap()], &[]).unwrap_err();
        assert!(format!("{e:#}").contains("unknown key `bogus`"), "{e:#}");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn checks_that_need_more_than_a_parser() {
        assert!(load(&["--rdma-ring-slots", "70000"], &[]).is_err(), "wider than u16");
        let e = load(&["--rdma-ring-slots", "2"], &[]).unwrap_err();
        assert!(format!("{e:#}").contains("rdma-ring-slots"), "{e:#}");
        assert!(load(&["--sim-devices", "0"], &[]).is_err());
        assert!(load(&["--max-connections", "0"], &[]).is_err());
        assert!(load(&["--max-connections-per-address", "0"], &[]).is_err());
        assert!(load(&["--handshake-timeout", "0"], &[]).is_err());
        assert!(load(&[], &[("RGPU_SERVER_BROKER_KEY_FILE", "/nonexistent/broker.key")]).is_err());
        let e = load(&[], &[("RGPU_SERVER_SIM_KERNEL_TIMEOUT", "0")]).unwrap_err();
        assert!(format!("{e:#}").contains("RGPU_SERVER_SIM_KERNEL_TIMEOUT"), "{e:#}");
    }

    #[test]
    fn seconds() {
        assert_eq!(parse_seconds("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_seconds(" 2.5 "), Ok(Duration::from_millis(2500)));
        for bad in ["0", "-1", "inf", "NaN", "x", "", "1e300"] {
            assert!(parse_seconds(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn compute_capability() {
        assert_eq!(parse_cc("9.0"), Ok((9, 0)));
        assert_eq!(parse_cc("8.6"), Ok((8, 6)));
        assert!(parse_cc("9").is_err());
        assert!(parse_cc("x.y").is_err());
    }

    #[test]
    fn backends() {
        assert_eq!(BackendKind::from_text("SIM"), Ok(BackendKind::Sim));
        assert!(BackendKind::from_text("gpu").is_err());
    }
}
