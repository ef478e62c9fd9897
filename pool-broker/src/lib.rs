//! The GPU pool broker: GPU servers register and heartbeat; users lease
//! whole GPUs or fractions of one and get a signed, fenced token; operators
//! drain servers. Layers (neon storage controller shape):
//!
//! - [`inventory`], [`placement`], [`state`]: pure; the state machine and
//!   placement take `now` and return decisions, changes and events;
//! - [`store`]: durability in redb, group-committed by one writer thread;
//! - [`service`]: orchestration: lock the state, apply, persist, answer;
//! - [`rpc`]: the capnp-rpc `Broker` (decode, one service call, encode).
//!
//! The client side of the same API (what the `rgpu` CLI and GPU servers
//! call) is the `rgpu-broker-client` crate, which does not link this one.
pub mod inventory;
pub mod placement;
pub mod policies;
pub mod state;
pub mod config;
pub mod rpc;
pub mod service;
pub mod store;

use std::sync::Arc;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use crate::state::State;

/// Opens the store, restores the state and builds the service.
pub fn open_service(config: &config::Config) -> anyhow::Result<Arc<service::Service>> {
    let key = match &config.key_file {
        Some(p) => Some(config::load_key(p, config.create_key)?),
        None => {
            tracing::warn!("no --key-file: tokens are not signed and GPU servers admit any client");
            None
        }
    };
    let admin_key = match &config.admin_key_file {
        Some(p) => Some(config::load_key(p, config.create_key)?),
        None => None,
    };
    if key.is_none() && admin_key.is_none() {
        tracing::warn!("no --key-file or --admin-key-file: anyone may drain and undrain servers");
    }
    let store = store::Store::open(&config.data_dir)?;
    let loaded = store.load()?;
    let mut state = State::new(config.limits.clone(), config.tenants.clone(), config.placement.policy());
    let (servers, leases) = (loaded.servers.len(), loaded.leases.len());
    state.restore(loaded.servers, loaded.leases, loaded.generation, service::now_ms());
    tracing::info!(servers, leases, generation = loaded.generation, dir = %config.data_dir.display(), placement = ?config.placement, "state restored");
    let writer = store::spawn_writer(store).context("cannot start the store writer")?;
    Ok(service::Service::new(state, writer, key, admin_key, config.data_dir.display().to_string()))
}

/// Runs a broker until SIGINT or SIGTERM.
pub fn run(config: config::Config) -> anyhow::Result<()> {
    let service = open_service(&config)?;
    let listener = std::net::TcpListener::bind(&config.listen)
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let addr = listener.local_addr()?;
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    std::thread::spawn(move || {
        rt.block_on(async {
            use tokio::signal::unix::{signal, SignalKind};
            let (Ok(mut i), Ok(mut t)) = (signal(SignalKind::interrupt()), signal(SignalKind::terminate())) else {
                return;
            };
            tokio::select! { _ = i.recv() => {}, _ = t.recv() => {} }
            tracing::info!("signal received; shutting down");
            stop.cancel();
        })
    });
    // Give the signal thread a moment to install its handlers before the
    // line scripts wait for.
    std::thread::sleep(std::time::Duration::from_millis(20));
    eprintln!("rgpu-broker listening on {addr} (data {})", config.data_dir.display());
    rpc::serve(listener, service, config.threads, shutdown)?;
    Ok(())
}
