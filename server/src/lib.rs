//! rgpu GPU server. Layers, top down (mini-redis shape):
//!
//! - [`listener`]: accept loop, connection cap, preamble dispatch, shutdown;
//! - [`control`]: the capnp-rpc control plane (hello, devices, sessions);
//! - [`session`]: one data connection per session on its own thread: frames
//!   in, replies out, the session's handle tables;
//! - [`command`]: one file per driver-API group, each command's decode and apply;
//! - [`backend`]: the [`backend::Backend`] trait and the `sim` backend;
//! - [`module`]: reading CUDA module images (fatbin, cubin, PTX).
pub mod module;

pub mod backend;
pub mod broker;
pub mod command;
pub mod config;
pub mod control;
pub mod cuerror;
pub mod lease;
pub mod listener;
pub mod service;
pub mod session;
pub mod transport_select;

use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Builds the backend `config` asks for.
pub fn build_backend(config: &config::Config) -> anyhow::Result<Arc<dyn backend::Backend>> {
    use anyhow::Context;
    use config::BackendKind;
    match config.backend {
        BackendKind::Cuda => {
            let cuda = backend::cuda::CudaBackend::new()
                .context("cannot start the cuda backend (--backend sim needs no GPU)")?;
            return Ok(Arc::new(cuda));
        }
        BackendKind::Auto => match backend::cuda::CudaBackend::new() {
            Ok(cuda) => return Ok(Arc::new(cuda)),
            Err(e) => tracing::warn!("no usable GPU ({e}); --backend auto uses the sim backend"),
        },
        BackendKind::Sim => {}
    }
    let sim = backend::sim::SimBackend::new(&config.sim).context("cannot set up the sim backend")?;
    Ok(Arc::new(sim))
}

/// Serves on `listener` with `backend` until `shutdown` fires, then closes
/// every session and returns. Drive it with `block_on` (it is not `Send`).
pub async fn serve(
    listener: TcpListener,
    backend: Arc<dyn backend::Backend>,
    config: &config::Config,
    shutdown: CancellationToken,
) {
    let mut service = service::Service::new(backend, config.attach_timeout);
    if let Some(key) = &config.pool.broker_key {
        service = service.with_broker_key(key.clone());
    }
    let service = Arc::new(service);
    if let Some(b) = &config.pool.broker {
        let id = config.pool.advertise.clone().unwrap_or_else(|| {
            listener.local_addr().map(|a| a.to_string()).unwrap_or_else(|_| config.listen.clone())
        });
        let mut labels = config.pool.labels.clone();
        if labels.node.is_empty() {
            labels.node = id.clone();
        }
        let agent = broker::Agent { broker: b.clone(), server_id: id, labels, key: config.pool.broker_key.clone() };
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
    listener::run(listener, service, config.max_connections, shutdown).await
}
