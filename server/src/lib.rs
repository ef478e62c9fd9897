//! rgpu GPU server. Layers, top down (mini-redis shape):
//!
//! - [`listener`]: accept loop, connection cap, preamble dispatch, shutdown;
//! - [`control`]: the capnp-rpc control plane (hello, devices, sessions);
//! - [`session`]: one data connection per session on its own thread: frames
//!   in, replies out, a tracing span per session and per call;
//! - [`command`]: the table of data-plane messages (decode, name, bulk rule,
//!   dispatch, reply) and one handler file per driver-API group;
//! - [`state`]: one session's handle tables, which the handlers check and change;
//!   [`vmm`]: its virtual memory management objects (reservations, maps, allocations);
//!   [`ipc`]: the allocations sessions share (CUDA IPC);
//! - [`backend`]: the [`backend::Backend`] trait, the `sim` and `cuda` backends;
//! - [`module`]: reading CUDA module images (fatbin, cubin, PTX).
pub mod module;

pub mod backend;
pub mod broker;
pub mod checkpoint;
pub mod command;
pub mod config;
pub mod control;
pub mod health;
pub mod ipc;
pub mod lease;
pub mod limits;
pub mod listener;
pub mod metering;
pub mod metrics;
pub mod migration;
pub mod preemption;
pub mod quota;
pub mod relocate;
pub mod service;
pub mod session;
pub mod snapshot_copy;
pub mod state;
pub mod telemetry;
pub mod transport_select;
pub mod vmm;

use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Builds the backend `config` asks for.
pub fn build_backend(config: &config::Config) -> anyhow::Result<Arc<dyn backend::Backend>> {
    use anyhow::Context;
    use config::BackendKind;
    match config.backend {
        BackendKind::Cuda => {
            let cuda = backend::cuda::CudaBackend::new(config.cuda_movable_memory)
                .context("cannot start the cuda backend (--backend sim needs no GPU)")?;
            return Ok(Arc::new(cuda));
        }
        BackendKind::Auto => match backend::cuda::CudaBackend::new(config.cuda_movable_memory) {
            Ok(cuda) => return Ok(Arc::new(cuda)),
            Err(e) => tracing::warn!("no usable GPU ({e}); --backend auto uses the sim backend"),
        },
        BackendKind::Sim => {}
    }
    let sim = backend::sim::SimBackend::new(&config.sim).context("cannot set up the sim backend")?;
    Ok(Arc::new(sim))
}

/// Serves on `listener` with `backend`, carrying data connections as
/// `data_plane` says, until `shutdown` fires, then closes every session and
/// returns. Drive it with `block_on` (it is not `Send`).
pub async fn serve(
    listener: TcpListener,
    backend: Arc<dyn backend::Backend>,
    data_plane: transport_select::DataPlane,
    config: &config::Config,
    shutdown: CancellationToken,
) {
    serve_draining(listener, None, backend, data_plane, config, shutdown.clone(), shutdown).await
}

/// As [`serve`], with a gentler stop: when `stop` fires and a broker is
/// configured, the server first has the broker drain it and waits (up to
/// the pool's drain timeout) for the leases on it to end, then stops as if
/// `shutdown` fired. `shutdown` stops at once. With `metrics` (a listener
/// bound to `--metrics`), Prometheus scrapes are served there too.
pub async fn serve_draining(
    listener: TcpListener,
    metrics: Option<TcpListener>,
    backend: Arc<dyn backend::Backend>,
    data_plane: transport_select::DataPlane,
    config: &config::Config,
    stop: CancellationToken,
    shutdown: CancellationToken,
) {
    let stopping = broker::Stopping {
        requested: CancellationToken::new(),
        drained: CancellationToken::new(),
        timeout: config.pool.drain_timeout,
    };
    let drains = config.pool.broker.is_some() && !stopping.timeout.is_zero();
    {
        let (stopping, shutdown) = (stopping.clone(), shutdown.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = shutdown.cancelled() => return,
            }
            if drains {
                tracing::info!(timeout_s = stopping.timeout.as_secs_f64(), "stopping: draining first");
                stopping.requested.cancel();
                tokio::select! {
                    _ = stopping.drained.cancelled() => tracing::info!("drained: no lease left on this server"),
                    _ = tokio::time::sleep(stopping.timeout) => {
                        tracing::warn!("drain timeout reached: stopping with leases still on this server")
                    }
                    _ = shutdown.cancelled() => {}
                }
            }
            shutdown.cancel();
        });
    }
    let mut service = service::Service::new(backend, config.attach_timeout)
        .with_data_plane(data_plane)
        .with_limits(config.limits.clone())
        .with_security(config.security.clone())
        .with_checkpoint(&config.checkpoint);
    if let Some(key) = &config.pool.broker_key {
        service = service.with_lease_tokens(key.clone(), config.pool.require_bound_tokens);
    }
    let service = Arc::new(service);
    // Before the broker agent's first heartbeat, which drops the suspended
    // leases the broker no longer lists.
    preemption::recover_at_start(&service);
    if let Some(m) = metrics {
        tokio::spawn(rgpu_metrics::http::serve(m, metrics::renderer(service.clone()), shutdown.clone()));
    }
    if let Some(b) = &config.pool.broker {
        let id = config.pool.advertise.clone().unwrap_or_else(|| {
            listener.local_addr().map(|a| a.to_string()).unwrap_or_else(|_| config.listen.clone())
        });
        let mut labels = config.pool.labels.clone();
        if labels.node.is_empty() {
            labels.node = id.clone();
        }
        let agent = broker::Agent::new(b.clone(), id, labels, config.pool.broker_key.clone(), stopping)
            .with_security(config.pool.broker_security.clone());
        let (svc, stop) = (service.clone(), shutdown.clone());
        let spawned = std::thread::Builder::new().name("rgpu-broker-agent".into()).spawn(move || {
            match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => tokio::task::LocalSet::new().block_on(&rt, agent.run(svc, stop)),
                Err(e) => tracing::error!("cannot start the broker agent: {e}"),
            }
        });
        if let Err(e) = spawned {
            tracing::error!("cannot start the broker agent: {e}");
        }
    }
    // Before the first connection is taken: a client resuming one of these
    // sessions must find it here, not be told it is unknown.
    for name in &config.checkpoint.restore {
        match relocate::restore_now(&service, name) {
            Ok(d) => tracing::info!(session = format_args!("{:#x}", d.session), %name, ms = d.took.as_millis() as u64,
                "restored at start"),
            Err(e) => tracing::error!(%name, "cannot restore at start: {e}"),
        }
    }
    listener::run(listener, service, config.max_connections, shutdown).await
}
