//! Prometheus metrics for rgpu's daemons: the HTTP endpoint that serves
//! them ([`http`]) and the few helpers both daemons' metric sets share.
//!
//! The exposition itself is `prometheus-client`'s (OpenMetrics text, which
//! Prometheus asks for first and parses natively); each daemon keeps its own
//! `Registry` and says how to render it, refreshing gauges it reads from
//! its state at scrape time (see `rgpu_server::metrics`,
//! `rgpu_pool_broker::metrics`).

pub mod http;

pub use prometheus_client;

use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};

/// Latency buckets in seconds, 10 µs to about 10 s: a loopback round trip
/// of a small call is tens of microseconds, a large copy or a slow store
/// commit seconds.
pub fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(10e-6, 4.0, 11))
}

/// Renders `registry` as OpenMetrics text.
pub fn encode(registry: &prometheus_client::registry::Registry) -> String {
    let mut out = String::with_capacity(4096);
    // Writing into a String cannot fail; a metric that cannot encode is a
    // bug in its definition, and a scrape with less beats none.
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, registry) {
        tracing::warn!("metrics: encoding failed: {e}");
    }
    out
}
