//! The capnp-rpc `Broker`: each method decodes, makes one service call and
//! encodes. Connections are served by a few threads, each with its own
//! single-threaded runtime (capnp-rpc is not `Send`), all sharing one
//! [`Service`].

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use capnp::capability::Rc;
use capnp_rpc::{rpc_twoparty_capnp, twoparty, RpcSystem};
use futures::AsyncReadExt;
use rgpu_protocol::broker_capnp::{broker, lease as lease_p, server_status};
use tokio_util::compat::TokioAsyncReadCompatExt;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::inventory::{GpuSpec, Scope, Server, ServerSpec};
use crate::placement::Demand;
use crate::service::Service;
use crate::state::{BrokerError, Lease, LeaseRequest, LeaseState, State};

struct Broker {
    service: Arc<Service>,
}

fn text(t: capnp::Result<capnp::text::Reader<'_>>) -> String {
    t.ok().and_then(|t| t.to_str().ok()).unwrap_or("").to_string()
}

fn texts(l: capnp::Result<capnp::text_list::Reader<'_>>) -> Vec<String> {
    match l {
        Ok(l) => l.iter().filter_map(|t| t.ok().and_then(|t| t.to_str().ok()).map(String::from)).collect(),
        Err(_) => Vec::new(),
    }
}

/// (issuedMs, proof) of an `AdminAuth`; absent: (0, empty).
fn auth(a: capnp::Result<rgpu_protocol::broker_capnp::admin_auth::Reader<'_>>) -> Result<(u64, Vec<u8>), capnp::Error> {
    if let Ok(a) = a {
        return Ok((a.get_issued_ms(), a.get_proof()?.to_vec()));
    }
    Ok((0, Vec::new()))
}

fn fail(e: BrokerError) -> capnp::Error {
    capnp::Error::failed(e.to_string())
}

pub fn write_lease(mut b: lease_p::Builder<'_>, l: &Lease, token: &[u8]) {
    b.set_id(l.id);
    b.set_tenant(&l.tenant);
    b.set_generation(l.generation);
    b.set_memory_limit(l.memory_limit);
    b.set_compute_milli(l.compute_milli);
    b.set_deadline_ms(l.deadline);
    b.set_granted_ms(l.granted);
    b.set_priority(l.priority);
    b.set_state(match l.state {
        LeaseState::Active => "active",
        LeaseState::Lost => "lost",
    });
    b.set_token(token);
    let mut gs = b.init_gpus(l.gpus.len() as u32);
    for (i, g) in l.gpus.iter().enumerate() {
        let mut x = gs.reborrow().get(i as u32);
        x.set_server(&g.server);
        x.set_uuid(&g.uuid);
        x.set_ordinal(g.ordinal);
        x.set_model(&g.model);
        x.set_memory(g.memory);
    }
}

fn write_server(mut b: server_status::Builder<'_>, st: &State, s: &Server) {
    let (gpus, free, mem, used, leases) = st.server_use(s);
    b.set_id(&s.spec.id);
    b.set_node(&s.spec.node);
    b.set_leaf(&s.spec.leaf);
    b.set_spine(&s.spec.spine);
    b.set_state(if s.reachable { "up" } else { "unreachable" });
    b.set_draining(s.drain.is_some());
    b.set_drain_deadline_ms(s.drain.and_then(|d| d.deadline).unwrap_or(0));
    b.set_gpus(gpus);
    b.set_gpus_free(free);
    b.set_memory(mem);
    b.set_memory_used(used);
    b.set_leases(leases);
    b.set_last_heartbeat_ms(s.last_heartbeat);
    let mut p = b.reborrow().init_partitions(s.spec.partitions.len() as u32);
    for (i, x) in s.spec.partitions.iter().enumerate() {
        p.set(i as u32, x);
    }
    let mut t = b.reborrow().init_transports(s.spec.transports.len() as u32);
    for (i, x) in s.spec.transports.iter().enumerate() {
        t.set(i as u32, x);
    }
    let mut models: Vec<&str> = s.gpus.iter().map(|g| g.spec.model.as_str()).collect();
    models.dedup();
    let mut m = b.init_models(models.len() as u32);
    for (i, x) in models.iter().enumerate() {
        m.set(i as u32, x);
    }
}

impl broker::Server for Broker {
    async fn register(
        self: Rc<Self>,
        params: broker::RegisterParams,
        mut results: broker::RegisterResults,
    ) -> Result<(), capnp::Error> {
        let p = params.get()?;
        let s = p.get_server()?;
        let mut gpus = Vec::new();
        for g in s.get_gpus()?.iter() {
            let u = g.get_uuid()?;
            let uuid: [u8; 16] = u.try_into().map_err(|_| capnp::Error::failed("[invalid] GPU uuid is not 16 bytes".into()))?;
            gpus.push(GpuSpec {
                uuid,
                ordinal: g.get_ordinal(),
                model: text(g.get_model()),
                memory: g.get_memory(),
                sms: g.get_sms(),
                healthy: g.get_healthy(),
            });
        }
        let spec = ServerSpec {
            id: text(s.get_id()),
            node: text(s.get_node()),
            leaf: text(s.get_leaf()),
            spine: text(s.get_spine()),
            partitions: texts(s.get_partitions()),
            gpus,
            transports: texts(s.get_transports()),
        };
        let proof = p.get_proof()?.to_vec();
        let hb = self.service.register(spec, &proof).await.map_err(fail)?;
        results.get().set_heartbeat_ms(hb as u32);
        Ok(())
    }

    async fn heartbeat(
        self: Rc<Self>,
        params: broker::HeartbeatParams,
        mut results: broker::HeartbeatResults,
    ) -> Result<(), capnp::Error> {
        let p = params.get()?;
        let id = text(p.get_server_id());
        let r = self.service.heartbeat(&id, p.get_proof()?).map_err(fail)?;
        let mut out = results.get();
        match r {
            None => out.set_known(false),
            Some((live, floor)) => {
                out.set_known(true);
                out.set_generation_floor(floor);
                let mut l = out.init_leases(live.len() as u32);
                for (i, (id, gen, deadline)) in live.iter().enumerate() {
                    let mut x = l.reborrow().get(i as u32);
                    x.set_id(*id);
                    x.set_generation(*gen);
                    x.set_deadline_ms(*deadline);
                }
            }
        }
        Ok(())
    }

    async fn lease(self: Rc<Self>, params: broker::LeaseParams, mut results: broker::LeaseResults) -> Result<(), capnp::Error> {
        let r = params.get()?.get_request()?;
        let scope = Scope::from_wire(r.get_scope());
        let req = LeaseRequest {
            tenant: text(r.get_tenant()),
            demand: Demand {
                gpus: r.get_gpus(),
                memory: r.get_memory(),
                compute_milli: r.get_compute_milli(),
                models: texts(r.get_models()),
                scope,
                scope_required: r.get_scope_required(),
            },
            priority: r.get_priority(),
            ttl_ms: r.get_ttl_ms(),
            wait_ms: r.get_wait_ms(),
            key: text(r.get_key()),
        };
        let l = self.service.lease(req).await.map_err(fail)?;
        let token = self.service.token_for(&l);
        write_lease(results.get().init_lease(), &l, &token);
        Ok(())
    }

    async fn renew(self: Rc<Self>, params: broker::RenewParams, mut results: broker::RenewResults) -> Result<(), capnp::Error> {
        let p = params.get()?;
        let l = self.service.renew(p.get_lease_id(), p.get_ttl_ms()).await.map_err(fail)?;
        let token = self.service.token_for(&l);
        write_lease(results.get().init_lease(), &l, &token);
        Ok(())
    }

    async fn release(
        self: Rc<Self>,
        params: broker::ReleaseParams,
        mut results: broker::ReleaseResults,
    ) -> Result<(), capnp::Error> {
        let released = self.service.release(params.get()?.get_lease_id()).await.map_err(fail)?;
        results.get().set_released(released);
        Ok(())
    }

    async fn list_leases(
        self: Rc<Self>,
        params: broker::ListLeasesParams,
        mut results: broker::ListLeasesResults,
    ) -> Result<(), capnp::Error> {
        let tenant = text(params.get()?.get_tenant());
        let mut leases: Vec<Lease> = self
            .service
            .read(|st| st.leases().filter(|l| tenant.is_empty() || l.tenant == tenant).cloned().collect());
        leases.sort_by_key(|l| (l.granted, l.id));
        let mut out = results.get().init_leases(leases.len() as u32);
        for (i, l) in leases.iter().enumerate() {
            // Listings carry no tokens: a token is for its holder only.
            write_lease(out.reborrow().get(i as u32), l, &[]);
        }
        Ok(())
    }

    async fn list_servers(
        self: Rc<Self>,
        _params: broker::ListServersParams,
        mut results: broker::ListServersResults,
    ) -> Result<(), capnp::Error> {
        let svc = self.service.clone();
        svc.read(|st| {
            let mut out = results.get().init_servers(st.servers.len() as u32);
            for (i, s) in st.servers.iter().enumerate() {
                write_server(out.reborrow().get(i as u32), st, s);
            }
        });
        Ok(())
    }

    async fn drain(self: Rc<Self>, params: broker::DrainParams, mut results: broker::DrainResults) -> Result<(), capnp::Error> {
        let p = params.get()?;
        let id = text(p.get_server_id());
        let (issued, proof) = auth(p.get_auth())?;
        self.service
            .check_admin("drain", &id, p.get_deadline_ms(), issued, &proof, crate::service::now_ms())
            .map_err(fail)?;
        let deadline = Some(p.get_deadline_ms()).filter(|&d| d != 0);
        self.service.drain(&id, deadline, p.get_for_shutdown()).await.map_err(fail)?;
        self.service.read(|st| {
            if let Some(s) = st.server(&id) {
                write_server(results.get().init_server(), st, s);
            }
        });
        Ok(())
    }

    async fn undrain(
        self: Rc<Self>,
        params: broker::UndrainParams,
        mut results: broker::UndrainResults,
    ) -> Result<(), capnp::Error> {
        let p = params.get()?;
        let id = text(p.get_server_id());
        let (issued, proof) = auth(p.get_auth())?;
        self.service.check_admin("undrain", &id, 0, issued, &proof, crate::service::now_ms()).map_err(fail)?;
        self.service.undrain(&id).await.map_err(fail)?;
        self.service.read(|st| {
            if let Some(s) = st.server(&id) {
                write_server(results.get().init_server(), st, s);
            }
        });
        Ok(())
    }

    async fn status(self: Rc<Self>, _params: broker::StatusParams, mut results: broker::StatusResults) -> Result<(), capnp::Error> {
        let svc = self.service.clone();
        let now = crate::service::now_ms();
        svc.read(|st| {
            let mut b = results.get().init_status();
            b.set_servers(st.servers.len() as u32);
            b.set_servers_up(st.servers.iter().filter(|s| s.reachable).count() as u32);
            b.set_gpus(st.servers.iter().map(|s| s.gpus.len() as u32).sum());
            b.set_gpus_free(st.servers.iter().map(|s| s.free_whole).sum());
            b.set_leases(st.leases().count() as u32);
            b.set_queued(st.queued() as u32);
            b.set_generation(st.generation());
            b.set_policy(st.policy_name());
            b.set_data_dir(&svc.data_dir);
            b.set_uptime_ms(now.saturating_sub(svc.started));
        });
        Ok(())
    }
}

/// Serves `listener` with `threads` threads until `shutdown` fires; also
/// ticks the state machine every 100 ms. Blocks.
pub fn serve(listener: TcpListener, service: Arc<Service>, threads: usize, shutdown: CancellationToken) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    let mut handles = Vec::new();
    for i in 0..threads.max(1) {
        let l = listener.try_clone()?;
        let (svc, stop) = (service.clone(), shutdown.clone());
        handles.push(std::thread::Builder::new().name(format!("rgpu-broker-rpc-{i}")).spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => return tracing::error!("cannot start a runtime: {e}"),
            };
            let local = tokio::task::LocalSet::new();
            local.block_on(&rt, accept_loop(l, svc, stop));
        })?);
    }
    let (svc, stop) = (service.clone(), shutdown.clone());
    handles.push(std::thread::Builder::new().name("rgpu-broker-tick".into()).spawn(move || {
        while !stop.is_cancelled() {
            std::thread::sleep(Duration::from_millis(100));
            svc.tick();
        }
    })?);
    for h in handles {
        let _ = h.join();
    }
    Ok(())
}

async fn accept_loop(listener: TcpListener, service: Arc<Service>, shutdown: CancellationToken) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => return tracing::error!("cannot register the listener: {e}"),
    };
    loop {
        let (sock, peer) = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let (svc, stop) = (service.clone(), shutdown.clone());
        tokio::task::spawn_local(async move {
            let _ = sock.set_nodelay(true);
            let (reader, writer) = sock.compat().split();
            let network = twoparty::VatNetwork::new(
                futures::io::BufReader::new(reader),
                futures::io::BufWriter::new(writer),
                rpc_twoparty_capnp::Side::Server,
                Default::default(),
            );
            let client: broker::Client = capnp_rpc::new_client(Broker { service: svc });
            let rpc = RpcSystem::new(Box::new(network), Some(client.client));
            tokio::select! {
                r = rpc => debug!(%peer, "broker connection ended: {r:?}"),
                _ = stop.cancelled() => {}
            }
        });
    }
}
