//! The server's Prometheus metrics (`--metrics ADDR`; names in
//! docs/metrics.md). Counters and histograms are fed as sessions serve
//! ([`crate::metering`]); gauges (sessions, memory, leases) are read from
//! the service at scrape time, so an idle server does no work for them.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};
use rgpu_cuda_types::CuError;

use crate::backend::DeviceInfo;
use crate::service::Service;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeviceLabel {
    pub device: String,
    pub uuid: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WireLabel {
    transport: &'static str,
    direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabel {
    call: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabel {
    code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MigrationLabel {
    /// out: sessions this server sent; in: sessions it took.
    direction: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CopyLabel {
    /// off: a snapshot sent to an operator; onto: one taken from an
    /// operator; unproved: a stream refused before its request proved the
    /// admin key.
    way: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WayLabel {
    way: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabel {
    /// precopy: sent while the program ran; held: while it was held still.
    phase: &'static str,
}

pub struct ServerMetrics {
    registry: Registry,
    devices: Vec<DeviceLabel>,
    launches: Family<DeviceLabel, Counter>,
    busy: Family<DeviceLabel, Counter<f64>>,
    wire: Family<WireLabel, Counter>,
    requests: Family<CallLabel, Histogram, fn() -> Histogram>,
    errors: Family<CodeLabel, Counter>,
    sessions_opened: Counter,
    migrations: Family<MigrationLabel, Counter>,
    migration_held: Histogram,
    migration_bytes: Family<PhaseLabel, Counter>,
    snapshot_copies: Family<CopyLabel, Counter>,
    snapshot_copy_bytes: Family<WayLabel, Counter>,
    // Read at scrape time.
    sessions: Family<StateLabel, Gauge>,
    memory_used: Family<DeviceLabel, Gauge>,
    healthy: Family<DeviceLabel, Gauge>,
    leases: Gauge,
}

fn uuid_text(u: &[u8; 16]) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
}

impl ServerMetrics {
    pub fn new(devices: &[DeviceInfo]) -> Self {
        let mut r = Registry::with_prefix("rgpu_server");
        let labels: Vec<DeviceLabel> =
            devices.iter().map(|d| DeviceLabel { device: d.ordinal.to_string(), uuid: uuid_text(&d.uuid) }).collect();
        let launches = Family::<DeviceLabel, Counter>::default();
        r.register("kernel_launches", "Kernel launches that the backend accepted", launches.clone());
        let busy = Family::<DeviceLabel, Counter<f64>>::default();
        r.register_with_unit(
            "device_busy",
            "Time the device ran this server's kernels (on backends that time each kernel: the sim, cuda; \
             rate() of it is the utilisation)",
            Unit::Seconds,
            busy.clone(),
        );
        let wire = Family::<WireLabel, Counter>::default();
        r.register_with_unit(
            "data_plane",
            "Bytes on data connections (frames and bulk), by transport and direction (in: from clients)",
            Unit::Bytes,
            wire.clone(),
        );
        let requests: Family<CallLabel, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(rgpu_metrics::latency_histogram);
        r.register_with_unit(
            "request_duration",
            "Time from a request's arrival to its result, by data-plane message",
            Unit::Seconds,
            requests.clone(),
        );
        let errors = Family::<CodeLabel, Counter>::default();
        r.register("request_errors", "Requests that failed, by the CUDA error they returned", errors.clone());
        let sessions_opened = Counter::default();
        r.register("sessions_attached", "Sessions whose data connection attached", sessions_opened.clone());
        let migrations = Family::<MigrationLabel, Counter>::default();
        r.register("migrations", "Live migrations, by direction (out, in) and result (ok, failed)", migrations.clone());
        let migration_held = rgpu_metrics::latency_histogram();
        r.register_with_unit(
            "migration_held",
            "How long each migration out held its program still (no progress), to the target's rebuilt",
            Unit::Seconds,
            migration_held.clone(),
        );
        let migration_bytes = Family::<PhaseLabel, Counter>::default();
        r.register_with_unit(
            "migration_memory",
            "Device memory sent by migrations out, by phase (precopy: while the program ran; held: while it was held)",
            Unit::Bytes,
            migration_bytes.clone(),
        );
        for (direction, result) in [("out", "ok"), ("out", "failed"), ("in", "ok"), ("in", "failed")] {
            let _ = migrations.get_or_create(&MigrationLabel { direction, result });
        }
        let snapshot_copies = Family::<CopyLabel, Counter>::default();
        r.register(
            "snapshot_copies",
            "Snapshots copied off or onto this server in one stream (rgpu checkpoint --save, rgpu restore --load), by way (off, onto, unproved: refused before its request proved the admin key) and result (ok, failed)",
            snapshot_copies.clone(),
        );
        for (way, result) in [("off", "ok"), ("off", "failed"), ("onto", "ok"), ("onto", "failed"), ("unproved", "failed")] {
            let _ = snapshot_copies.get_or_create(&CopyLabel { way, result });
        }
        let snapshot_copy_bytes = Family::<WayLabel, Counter>::default();
        r.register_with_unit(
            "snapshot_copy",
            "Bytes of the snapshots copied whole off or onto this server, by way",
            Unit::Bytes,
            snapshot_copy_bytes.clone(),
        );
        let sessions = Family::<StateLabel, Gauge>::default();
        r.register("sessions", "Sessions now: pending (opened, no data connection yet), active, or suspended (on disk for a preempted lease)", sessions.clone());
        let memory_used = Family::<DeviceLabel, Gauge>::default();
        r.register_with_unit(
            "device_memory_used",
            "Device memory the sessions' allocations (cuMemAlloc) hold now",
            Unit::Bytes,
            memory_used.clone(),
        );
        let memory_limit = Family::<DeviceLabel, Gauge>::default();
        r.register_with_unit("device_memory_limit", "Device memory in all", Unit::Bytes, memory_limit.clone());
        let healthy = Family::<DeviceLabel, Gauge>::default();
        r.register(
            "device_healthy",
            "1 while the device reports healthy, 0 while unhealthy (sim: an injected fault; cuda: NVML's \
             uncorrectable ECC errors, retired pages, row remapping)",
            healthy.clone(),
        );
        let leases = Gauge::default();
        r.register("leases", "Broker leases with a live grant on this server", leases.clone());
        for (l, d) in labels.iter().zip(devices) {
            // Present from the start, so that rate() has a first sample.
            let _ = launches.get_or_create(l);
            let _ = busy.get_or_create(l);
            memory_limit.get_or_create(l).set(d.total_mem.min(i64::MAX as u64) as i64);
        }
        ServerMetrics {
            registry: r,
            devices: labels,
            launches,
            busy,
            wire,
            requests,
            errors,
            sessions_opened,
            migrations,
            migration_held,
            migration_bytes,
            snapshot_copies,
            snapshot_copy_bytes,
            sessions,
            memory_used,
            healthy,
            leases,
        }
    }

    /// The (in, out) byte counters of data transport `kind`.
    pub fn wire(&self, kind: &'static str) -> (Counter, Counter) {
        let get = |direction| self.wire.get_or_create(&WireLabel { transport: kind, direction }).clone();
        (get("in"), get("out"))
    }

    pub fn request(&self, call: &'static str, took: Duration, code: u32) {
        self.requests.get_or_create(&CallLabel { call }).observe(took.as_secs_f64());
        if code != 0 {
            let code = CuError::from_code(code).map_or("CUDA_SUCCESS", |e| e.name());
            self.errors.get_or_create(&CodeLabel { code }).inc();
        }
    }

    pub fn kernel(&self, device: u32, busy: Option<Duration>) {
        let Some(l) = self.devices.get(device as usize) else { return };
        self.launches.get_or_create(l).inc();
        if let Some(t) = busy {
            self.busy.get_or_create(l).inc_by(t.as_secs_f64());
        }
    }

    pub fn session_attached(&self) {
        self.sessions_opened.inc();
    }

    /// A migration out that moved its session: how long the program was
    /// held, and the device memory sent before and while.
    pub fn migrated_out(&self, held: Duration, precopied: u64, sent_held: u64) {
        self.migrations.get_or_create(&MigrationLabel { direction: "out", result: "ok" }).inc();
        self.migration_held.observe(held.as_secs_f64());
        self.migration_bytes.get_or_create(&PhaseLabel { phase: "precopy" }).inc_by(precopied);
        self.migration_bytes.get_or_create(&PhaseLabel { phase: "held" }).inc_by(sent_held);
    }

    /// A migration that did not complete (`out`: this server's session
    /// stayed here; in: a session sent here was not rebuilt), or one in.
    pub fn migration(&self, out: bool, ok: bool) {
        let direction = if out { "out" } else { "in" };
        self.migrations.get_or_create(&MigrationLabel { direction, result: if ok { "ok" } else { "failed" } }).inc();
    }

    /// A snapshot stream ended: its way (None: refused before its request
    /// proved the admin key; `onto`: a snapshot taken in), and the bytes
    /// of a whole copy (None: it failed).
    pub fn snapshot_copy(&self, onto: Option<bool>, bytes: Option<u64>) {
        let way = match onto {
            None => "unproved",
            Some(true) => "onto",
            Some(false) => "off",
        };
        let result = if bytes.is_some() { "ok" } else { "failed" };
        self.snapshot_copies.get_or_create(&CopyLabel { way, result }).inc();
        if let Some(b) = bytes {
            self.snapshot_copy_bytes.get_or_create(&WayLabel { way }).inc_by(b);
        }
    }

    /// The text of a scrape, gauges read from `service` now.
    pub fn render(&self, service: &Service) -> String {
        let (pending, active) = service.sessions.counts();
        self.sessions.get_or_create(&StateLabel { state: "pending" }).set(pending as i64);
        self.sessions.get_or_create(&StateLabel { state: "active" }).set(active as i64);
        self.sessions.get_or_create(&StateLabel { state: "suspended" }).set(service.sessions.suspended_count() as i64);
        for (i, l) in self.devices.iter().enumerate() {
            let used = service.meters.memory_on(i as u32);
            self.memory_used.get_or_create(l).set(used.min(i64::MAX as u64) as i64);
        }
        for (l, h) in self.devices.iter().zip(service.backend.health()) {
            self.healthy.get_or_create(l).set(h.healthy.into());
        }
        self.leases.set(service.leases.live_count() as i64);
        rgpu_metrics::encode(&self.registry)
    }
}

/// The render function the metrics endpoint calls.
pub fn renderer(service: Arc<Service>) -> rgpu_metrics::http::Render {
    Arc::new(move || service.metrics.render(&service))
}
