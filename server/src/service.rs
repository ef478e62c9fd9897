//! What every connection handler shares: the backend, the session registry
//! and the few settings handlers need.

use std::sync::Arc;
use std::time::Duration;

use crate::backend::Backend;
use crate::lease::{Admission, Leases};
use crate::limits::{Limits, PerAddress, SessionInput};
use crate::metering::{Meters, SessionMeter};
use crate::metrics::ServerMetrics;
use crate::quota::ByteQuota;
use crate::session::registry::Registry;
use crate::transport_select::DataPlane;

pub struct Service {
    pub backend: Arc<dyn Backend>,
    pub sessions: Registry,
    /// How long an opened session waits for its data connection.
    pub attach_timeout: Duration,
    /// Reported by `hello`.
    pub server_name: String,
    /// Lease-token admission (open to all without a broker key).
    pub leases: Leases,
    /// How data connections are carried (TCP, or RDMA where set up).
    pub data_plane: DataPlane,
    /// Connection, handshake and input bounds.
    pub limits: Limits,
    /// Connections open now, by source address.
    pub per_address: Arc<PerAddress>,
    /// Input buffered now, all connections together.
    pub buffered: Arc<ByteQuota>,
    /// What each session uses ([`crate::metering`]).
    pub meters: Meters,
    /// Server-wide counters the sessions feed; served with `--metrics`.
    pub metrics: Arc<ServerMetrics>,
    /// TLS on the port (both planes), or plaintext (`--plaintext`).
    pub security: rgpu_tls::ServerSecurity,
    /// The operator key checkpoint and restore prove they hold (off without it).
    pub admin_key: Option<Vec<u8>>,
    /// Where snapshots are written and read ([`crate::relocate`]).
    pub checkpoint_dir: Option<std::path::PathBuf>,
    /// How this server speaks to other GPU servers (a live migration's
    /// target): TLS checked against `--tls-ca`, as the broker is, or
    /// plaintext; None: TLS without a CA to check targets by (migrations
    /// out are refused).
    pub peer_security: Option<rgpu_tls::ClientSecurity>,
    /// Migrations out pre-copy memory while the program runs.
    pub precopy: bool,
    /// Allocations sessions exported to other sessions (CUDA IPC).
    pub ipc: Arc<crate::ipc::Exports>,
}

impl Service {
    pub fn new(backend: Arc<dyn Backend>, attach_timeout: Duration) -> Self {
        let metrics = Arc::new(ServerMetrics::new(backend.devices()));
        Service {
            meters: Meters::default(),
            metrics,
            backend,
            sessions: Registry::default(),
            attach_timeout,
            server_name: format!("rgpu-server {}", env!("CARGO_PKG_VERSION")),
            leases: Leases::new(None, Vec::new()),
            data_plane: DataPlane::tcp_only(),
            per_address: PerAddress::new(Limits::default().max_connections_per_address),
            buffered: ByteQuota::new(Limits::default().max_buffered_input),
            limits: Limits::default(),
            // In-process servers built without settings (tests) are
            // plaintext; the binary always says which (`Config::security`).
            security: rgpu_tls::ServerSecurity::Plaintext,
            admin_key: None,
            checkpoint_dir: None,
            peer_security: Some(rgpu_tls::ClientSecurity::Plaintext),
            precopy: true,
            ipc: Arc::default(),
        }
    }

    pub fn with_security(mut self, security: rgpu_tls::ServerSecurity) -> Self {
        self.security = security;
        self
    }

    /// Allows checkpoint and restore to operators holding `admin_key`, with
    /// snapshots in `dir`.
    pub fn with_checkpoint(mut self, cfg: &crate::config::CheckpointConfig) -> Self {
        self.admin_key = cfg.admin_key.clone();
        self.checkpoint_dir = cfg.dir.clone();
        self.peer_security = cfg.peer_security.clone();
        self.precopy = cfg.precopy;
        self
    }

    /// Applies `limits` (the default ones otherwise).
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.per_address = PerAddress::new(limits.max_connections_per_address);
        self.buffered = ByteQuota::new(limits.max_buffered_input);
        self.limits = limits;
        self
    }

    /// What a session (admitted by `admission`, if a lease token) may make
    /// the server buffer and keep.
    pub fn session_input(&self, admission: Option<&Admission>) -> SessionInput {
        let limit = self.limits.max_module_bytes_per_lease;
        SessionInput {
            buffered: self.buffered.clone(),
            modules: match admission {
                Some(a) => self.leases.module_quota(a, limit),
                None => ByteQuota::new(limit),
            },
            max_module_image: self.limits.max_module_image,
        }
    }

    /// A meter for session `id` (admitted by `lease`, if any), counted
    /// among the live ones until [`Meters::remove`].
    pub fn meter(&self, id: u64, lease: Option<u64>) -> Arc<SessionMeter> {
        let devices = self.backend.devices().len();
        let timed = self.backend.kernel_times_known();
        let m = Arc::new(SessionMeter::new(self.metrics.clone(), devices, lease, timed));
        self.meters.insert(id, m.clone());
        self.metrics.session_attached();
        m
    }

    /// Session `id`'s thread is over (its connection gone past the grace,
    /// closed, or panicked): what the service held for it goes.
    pub fn session_ended(&self, id: u64) {
        self.sessions.detach(id);
        self.leases.unbind(id);
        self.meters.remove(id);
        tracing::info!("session ended; its resources are freed");
    }

    /// Carries data connections as `data_plane` says.
    pub fn with_data_plane(mut self, data_plane: DataPlane) -> Self {
        self.data_plane = data_plane;
        self
    }

    /// Admits sessions by lease tokens signed with `key`.
    pub fn with_broker_key(self, key: Vec<u8>) -> Self {
        self.with_lease_tokens(key, false)
    }

    /// Admits sessions by lease tokens signed with `key`; with
    /// `require_bound`, only tokens bound to a client key.
    pub fn with_lease_tokens(mut self, key: Vec<u8>, require_bound: bool) -> Self {
        let gpus = self.backend.devices().iter().map(|d| (d.uuid, d.ordinal)).collect();
        self.leases = Leases::new(Some(key), gpus).requiring_bound_tokens(require_bound);
        self
    }
}
