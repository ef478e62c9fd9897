//! The broker's Prometheus metrics (`--metrics ADDR`; names in
//! docs/metrics.md). Grants, placement, queue waits and store commits are
//! counted by [`crate::service`] as they happen; the pool's shape (servers,
//! GPUs, leases, queue) is read from the state at scrape time, under its
//! lock once, so a scrape sees one consistent cut.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::state::{BrokerError, LeaseState, State};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LeaseLabel {
    state: &'static str,
    tenant: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ServerLabel {
    server: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TrafficLabel {
    server: String,
    direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

pub struct BrokerMetrics {
    registry: Registry,
    requests: Family<OutcomeLabel, Counter>,
    placement: Histogram,
    wait: Histogram,
    commit: Histogram,
    servers: Family<StateLabel, Gauge>,
    gpus: Family<StateLabel, Gauge>,
    unhealthy: Gauge,
    stranded: Gauge,
    leases: Family<LeaseLabel, Gauge>,
    queue: Gauge,
    link_capacity: Family<ServerLabel, Gauge>,
    link_granted: Family<ServerLabel, Gauge>,
    link_traffic: Family<TrafficLabel, Gauge>,
}

impl Default for BrokerMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl BrokerMetrics {
    pub fn new() -> Self {
        let mut r = Registry::with_prefix("rgpu_broker");
        let requests = Family::<OutcomeLabel, Counter>::default();
        r.register(
            "lease_requests",
            "Lease requests by outcome: granted (at once or after a wait), refused (quota, capacity, \
             bad request) or timed_out (waited its --wait out)",
            requests.clone(),
        );
        let placement = rgpu_metrics::latency_histogram();
        r.register_with_unit(
            "placement_duration",
            "Time the state machine took to place one lease request (under the state lock)",
            Unit::Seconds,
            placement.clone(),
        );
        let wait = rgpu_metrics::latency_histogram();
        r.register_with_unit(
            "lease_wait_duration",
            "Time from a lease request to its grant, the durable commit included",
            Unit::Seconds,
            wait.clone(),
        );
        let commit = rgpu_metrics::latency_histogram();
        r.register_with_unit(
            "store_commit_duration",
            "Time from queueing changes for the store to their being durable (group commit, fsync)",
            Unit::Seconds,
            commit.clone(),
        );
        let servers = Family::<StateLabel, Gauge>::default();
        r.register("servers", "Registered servers: up, draining or unreachable", servers.clone());
        let gpus = Family::<StateLabel, Gauge>::default();
        r.register(
            "gpus",
            "GPUs: free (no lease), used (a lease holds it or part of it), draining (on a draining \
             server, not leased), unavailable (unhealthy or unreachable)",
            gpus.clone(),
        );
        let unhealthy = Gauge::default();
        r.register(
            "gpus_unhealthy",
            "GPUs their servers report unhealthy (uncorrectable ECC, Xid, injected fault): no new lease \
             lands on them, and their leases are moved off",
            unhealthy.clone(),
        );
        let stranded = Gauge::default();
        r.register(
            "leases_stranded",
            "Leases on an unhealthy GPU with no move under way (no server can take them yet, or evacuation is off)",
            stranded.clone(),
        );
        let leases = Family::<LeaseLabel, Gauge>::default();
        r.register("leases", "Leases by state and tenant", leases.clone());
        let queue = Gauge::default();
        r.register("queue_depth", "Lease requests waiting for capacity", queue.clone());
        let link_capacity = Family::<ServerLabel, Gauge>::default();
        r.register(
            "link_capacity_bytes_per_second",
            "A server's link capacity each way, as it registered it (--link-bandwidth); no series: unbounded",
            link_capacity.clone(),
        );
        let link_granted = Family::<ServerLabel, Gauge>::default();
        r.register(
            "link_granted_bytes_per_second",
            "Bandwidth each way granted to the leases on a server's link (lease --bandwidth), summed",
            link_granted.clone(),
        );
        let link_traffic = Family::<TrafficLabel, Gauge>::default();
        r.register(
            "link_traffic_bytes_per_second",
            "A server's data-plane traffic as its last heartbeat reported it, by direction (in: to the GPUs)",
            link_traffic.clone(),
        );
        BrokerMetrics {
            registry: r,
            requests,
            placement,
            wait,
            commit,
            servers,
            gpus,
            unhealthy,
            stranded,
            leases,
            queue,
            link_capacity,
            link_granted,
            link_traffic,
        }
    }

    pub fn placed(&self, took: Duration) {
        self.placement.observe(took.as_secs_f64());
    }

    /// A lease request ended with `r`, `took` after it came in.
    pub fn answered<T>(&self, r: &Result<T, BrokerError>, took: Duration) {
        let outcome = match r {
            Ok(_) => {
                self.wait.observe(took.as_secs_f64());
                "granted"
            }
            Err(BrokerError::QueueTimeout(_)) => "timed_out",
            Err(_) => "refused",
        };
        self.requests.get_or_create(&OutcomeLabel { outcome }).inc();
    }

    pub fn committed(&self, took: Duration) {
        self.commit.observe(took.as_secs_f64());
    }

    /// The text of a scrape.
    pub fn render(&self) -> String {
        rgpu_metrics::encode(&self.registry)
    }

    /// Sets the gauges of the pool's shape from `st`.
    pub fn refresh(&self, st: &State) {
        let (mut up, mut draining, mut unreachable) = (0, 0, 0);
        let (mut free, mut used, mut drain_gpus, mut unavailable) = (0, 0, 0, 0);
        for s in &st.servers {
            match (s.reachable, s.drain.is_some()) {
                (false, _) => unreachable += 1,
                (true, true) => draining += 1,
                (true, false) => up += 1,
            }
            for g in &s.gpus {
                if !g.is_free() {
                    used += 1;
                } else if !s.reachable || !g.spec.healthy {
                    unavailable += 1;
                } else if s.drain.is_some() {
                    drain_gpus += 1;
                } else {
                    free += 1;
                }
            }
        }
        let set = |f: &Family<StateLabel, Gauge>, state, v: i64| f.get_or_create(&StateLabel { state }).set(v);
        set(&self.servers, "up", up);
        set(&self.servers, "draining", draining);
        set(&self.servers, "unreachable", unreachable);
        set(&self.gpus, "free", free);
        set(&self.gpus, "used", used);
        set(&self.gpus, "draining", drain_gpus);
        set(&self.gpus, "unavailable", unavailable);
        // Tenants come and go: last scrape's series of a tenant with no
        // lease now must not linger at their old value.
        self.leases.clear();
        for l in st.leases() {
            let state = l.state_name();
            self.leases.get_or_create(&LeaseLabel { state, tenant: l.tenant.clone() }).inc();
        }
        self.queue.set(st.queued() as i64);
        let bad = crate::evacuation::unhealthy_uuids(&st.servers);
        self.unhealthy.set(bad.len() as i64);
        let stranded = st
            .leases()
            .filter(|l| l.state == LeaseState::Active && l.moving.is_none() && l.gpus.iter().any(|g| bad.contains(&g.uuid)))
            .count();
        self.stranded.set(stranded as i64);
        // Servers come and go too.
        self.link_capacity.clear();
        self.link_granted.clear();
        self.link_traffic.clear();
        let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        for s in &st.servers {
            let Some(link) = st.link(&s.spec.id) else { continue };
            let server = s.spec.id.clone();
            if let Some(c) = link.capacity {
                self.link_capacity.get_or_create(&ServerLabel { server: server.clone() }).set(gauge(c));
            }
            self.link_granted.get_or_create(&ServerLabel { server: server.clone() }).set(gauge(link.granted));
            if let Some(load) = link.load {
                for (direction, v) in [("in", load.bytes_in), ("out", load.bytes_out)] {
                    self.link_traffic.get_or_create(&TrafficLabel { server: server.clone(), direction }).set(gauge(v));
                }
            }
        }
    }
}

/// The render function the metrics endpoint calls.
pub fn renderer(service: Arc<crate::service::Service>) -> rgpu_metrics::http::Render {
    Arc::new(move || {
        service.read(|st| service.metrics.refresh(st));
        service.metrics.render()
    })
}
