//! The GPU pool broker: GPU servers register and heartbeat; users lease
//! whole GPUs or fractions of one and get a signed, fenced token; operators
//! drain servers. Layers (neon storage controller shape):
//!
//! - [`inventory`], [`placement`], [`fabric`], [`state`]: pure; the state
//!   machine and placement take `now` and return decisions, changes and
//!   events ([`fabric`]: link capacities, granted bandwidth and traffic);
//! - [`store`]: durability behind one trait, group-committed by one writer
//!   thread: redb (one broker), or etcd (several, one leading);
//! - [`service`]: orchestration: lock the state, apply, persist, answer;
//! - [`identity`], [`rate`], [`audit`]: who is calling (tenant
//!   credentials, their revocations), how fast, and the record of what
//!   each did;
//! - [`rpc`]: the capnp-rpc `Broker` (decode, one service call, encode),
//!   its per-login `Session` and per-server `ServerAgent`.
//!
//! The client side of the same API (what the `rgpu` CLI and GPU servers
//! call) is the `rgpu-broker-client` crate, which does not link this one.
pub mod audit;
pub mod evacuation;
pub mod fabric;
pub mod identity;
pub mod inventory;
pub mod metrics;
pub mod moves;
pub mod placement;
pub mod policies;
pub mod rate;
pub mod state;
pub mod config;
pub mod rpc;
pub mod service;
pub mod store;
pub mod usage;

use std::sync::Arc;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use crate::state::State;
use crate::store::Store as _;

/// Opens the store, restores the state and builds the service.
pub fn open_service(config: &config::Config) -> anyhow::Result<Arc<service::Service>> {
    let Some(key_file) = &config.key_file else {
        anyhow::bail!(
            "rgpu-broker needs --key-file: it signs lease tokens and proves GPU servers with it \
             (--create-key makes a fresh one, and --admin-key-file's)"
        );
    };
    let key = config::load_key(key_file, config.create_key)?;
    let credential_key = match &config.admin_key_file {
        Some(p) => config::load_key(p, config.create_key)?,
        None => {
            tracing::warn!(
                "no --admin-key-file: tenants' credentials are issued with the token key, which GPU servers hold too"
            );
            key.clone()
        }
    };
    let audit = audit::Audit::open(&config.data_dir)?;
    let fresh = {
        let (limits, tenants, placement) = (config.limits.clone(), config.tenants.clone(), config.placement);
        move || State::new(limits.clone(), tenants.clone(), placement.policy())
    };
    match &config.store {
        config::StoreUrl::Redb => {
            let store = store::redb::RedbStore::open(&config.data_dir)?;
            let loaded = store.load()?;
            let mut state = fresh();
            let (servers, leases) = (loaded.servers.len(), loaded.leases.len());
            state.restore(loaded.servers, loaded.leases, loaded.generation, service::now_ms());
            tracing::info!(servers, leases, generation = loaded.generation, dir = %config.data_dir.display(), placement = ?config.placement, "state restored");
            let credentials = identity::Credentials::new(credential_key, loaded.revoked);
            let writer = store::spawn_writer(Box::new(store)).context("cannot start the store writer")?;
            let service = service::Service::new(state, writer, key, credentials, audit, config.data_dir.display().to_string());
            service.restore_records(loaded.usage);
            Ok(service)
        }
        config::StoreUrl::Etcd { endpoints, prefix } => replicated(config, endpoints, prefix, fresh, key, credential_key, audit),
    }
}

/// A broker over etcd: it serves once elected, from the state read then.
#[cfg(feature = "etcd")]
fn replicated(
    config: &config::Config,
    endpoints: &[String],
    prefix: &str,
    fresh: impl Fn() -> State + Send + Sync + 'static,
    key: Vec<u8>,
    credential_key: Vec<u8>,
    audit: audit::Audit,
) -> anyhow::Result<Arc<service::Service>> {
    let (store, replica) = store::etcd::connect(store::etcd::EtcdConfig {
        endpoints: endpoints.to_vec(),
        prefix: prefix.to_string(),
        advertise: config.advertise.clone(),
        ttl_s: config.leader_ttl_s,
    })?;
    let writer = store::spawn_writer(Box::new(store)).context("cannot start the store writer")?;
    let credentials = identity::Credentials::new(credential_key, Default::default());
    let where_ = format!("{} (state in etcd://{}{prefix})", config.data_dir.display(), endpoints.join(","));
    let svc = service::Service::new(fresh(), writer, key, credentials, audit, where_);
    svc.follow(None);
    let weak = Arc::downgrade(&svc);
    let resign = replica.start(move |role| {
        let Some(svc) = weak.upgrade() else { return };
        match role {
            store::Leadership::Leader { term, loaded, tenure } => {
                let mut state = fresh();
                // Generations grow across leaders: above every stored one and above the term.
                let generation = loaded.generation.max(term);
                state.restore(loaded.servers, loaded.leases, generation, service::now_ms());
                svc.restore_records(loaded.usage);
                svc.lead(state, term, loaded.revoked, tenure);
            }
            store::Leadership::Follower { leader } => svc.follow(leader),
        }
    });
    svc.on_stop(Box::new(move || resign.resign(std::time::Duration::from_secs(1))));
    Ok(svc)
}

#[cfg(not(feature = "etcd"))]
fn replicated(
    _: &config::Config,
    _: &[String],
    _: &str,
    _: impl Fn() -> State,
    _: Vec<u8>,
    _: Vec<u8>,
    _: audit::Audit,
) -> anyhow::Result<Arc<service::Service>> {
    anyhow::bail!(
        "this rgpu-broker was built without etcd support: build it with \
         `cargo build --release -p rgpu-pool-broker --features etcd` (needs protoc: Debian's protobuf-compiler)"
    )
}

/// Runs a broker until SIGINT or SIGTERM.
pub fn run(config: config::Config) -> anyhow::Result<()> {
    let service = open_service(&config)?;
    let listener = std::net::TcpListener::bind(&config.listen)
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let addr = listener.local_addr()?;
    let shutdown = CancellationToken::new();
    if let Some(a) = &config.metrics {
        let l = std::net::TcpListener::bind(a).with_context(|| format!("cannot listen for metrics on {a}"))?;
        l.set_nonblocking(true)?;
        let (render, stop) = (metrics::renderer(service.clone()), shutdown.clone());
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        std::thread::Builder::new().name("rgpu-broker-metrics".into()).spawn(move || {
            rt.block_on(async move {
                match tokio::net::TcpListener::from_std(l) {
                    Ok(l) => rgpu_metrics::http::serve(l, render, stop).await,
                    Err(e) => tracing::error!("cannot serve metrics: {e}"),
                }
            })
        })?;
    }
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
    eprintln!("rgpu-broker listening on {addr} (data {}, store {})", config.data_dir.display(), store_name(&config.store));
    if !config.security.is_tls() {
        tracing::warn!("--plaintext: lease tokens cross the network in clear");
    }
    rpc::serve(listener, service.clone(), config.threads, config.security.clone(), shutdown)?;
    service.stop();
    Ok(())
}

fn store_name(s: &config::StoreUrl) -> String {
    match s {
        config::StoreUrl::Redb => "redb".into(),
        config::StoreUrl::Etcd { endpoints, prefix } => format!("etcd://{}{prefix}", endpoints.join(",")),
    }
}
