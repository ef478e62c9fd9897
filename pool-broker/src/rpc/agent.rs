//! A registered GPU server's capability (`ServerAgent` in broker.capnp):
//! it exists only on the connection whose registration proved the broker
//! key over that connection's challenge, and speaks for that server alone.

use std::sync::Arc;

use capnp::capability::Rc;
use rgpu_protocol::broker_capnp::{server_agent, OrderKind};

use super::encode::write_server;
use super::{audit, fail};
use crate::service::Service;
use crate::usage::Usage;

pub struct Agent {
    service: Arc<Service>,
    server_id: String,
    peer: String,
}

impl Agent {
    pub fn new(service: Arc<Service>, server_id: String, peer: String) -> Agent {
        Agent { service, server_id, peer }
    }
}

impl server_agent::Server for Agent {
    async fn heartbeat(self: Rc<Self>, params: server_agent::HeartbeatParams, mut results: server_agent::HeartbeatResults) -> Result<(), capnp::Error> {
        // A deposed leader's picture of the leases is stale: the server
        // must find the leader instead.
        self.service.serving().map_err(fail)?;
        let p = params.get()?;
        // A server that sends no report (an older one) leaves the last one.
        if p.has_total() {
            let leases = p.get_usage()?.iter().take(crate::usage::MAX_REPORTS).map(|u| (u.get_lease(), Usage::read(u))).collect();
            self.service.report_usage(&self.server_id, leases, Usage::read(p.get_total()?));
        }
        if p.has_load() {
            let l = p.get_load()?;
            let load = crate::fabric::Load { bytes_in: l.get_bytes_in_per_s(), bytes_out: l.get_bytes_out_per_s() };
            self.service.report_load(&self.server_id, load);
        }
        // Health first: a GPU reported unhealthy in this heartbeat has its
        // leases' moves ordered in this reply.
        if p.has_health() {
            let reports: Vec<crate::state::HealthChange> = p
                .get_health()?
                .iter()
                .take(crate::evacuation::MAX_GPUS_REPORTED)
                .map(|h| {
                    let why = h.get_reason().ok().and_then(|r| r.to_str().ok()).unwrap_or("").to_string();
                    (h.get_ordinal(), h.get_healthy(), crate::evacuation::clip(why, crate::evacuation::MAX_HEALTH_REASON))
                })
                .collect();
            let id = &self.server_id;
            let actor = format!("server:{id}");
            match self.service.report_health(id, &reports).await {
                Ok((changed, started)) => {
                    for (ordinal, healthy, why) in &changed {
                        if *healthy {
                            tracing::info!(server = %id, gpu = ordinal, "GPU healthy again: placeable");
                        } else {
                            tracing::warn!(server = %id, gpu = ordinal, "GPU unhealthy: {why}; no new leases on it");
                        }
                        let detail = if *healthy { format!("GPU {ordinal} healthy") } else { format!("GPU {ordinal} unhealthy: {why}") };
                        audit(&self.service, &actor, &self.peer, "health", id, &Ok::<_, crate::state::BrokerError>(()), |_| detail);
                    }
                    for (lease, r) in started {
                        audit(&self.service, &actor, &self.peer, "evacuate", &format!("{lease:016x}"), &r.map_err(crate::state::BrokerError::Unavailable), |to| {
                            format!("{id} -> {to}")
                        });
                    }
                }
                Err(e) => return Err(fail(e)),
            }
        }
        // Moves this server finished or gave up, each applied before the
        // reply is built, so it already lists the lease where it now is.
        if p.has_moved() {
            let id = &self.server_id;
            for m in p.get_moved()?.iter().take(crate::moves::MAX_ORDERS) {
                let lease = m.get_lease();
                let result = if m.get_ok() {
                    Ok(())
                } else {
                    let why = m.get_reason().ok().and_then(|r| r.to_str().ok()).unwrap_or("").to_string();
                    Err(why.chars().take(crate::moves::MAX_REASON).collect())
                };
                let failed = result.clone().err();
                let kind = m.get_kind().unwrap_or(OrderKind::Migrate);
                if kind != OrderKind::Migrate {
                    let resumed = kind == OrderKind::Resume;
                    let r = self.service.suspension_reported(id, lease, resumed, result).await;
                    let op = match (resumed, failed.is_none()) {
                        (false, true) => "suspend",
                        (false, false) => "suspend-failed",
                        (true, true) => "resume",
                        (true, false) => "resume-failed",
                    };
                    audit(&self.service, &format!("server:{id}"), &self.peer, op, &format!("{lease:016x}"), &r, |_| match &failed {
                        None => format!("preemption on {id}"),
                        Some(why) => format!("preemption on {id}: {why}"),
                    });
                    if let Err(e) = r {
                        tracing::warn!(server = %id, lease = format_args!("{lease:#x}"), "suspension report refused: {e}");
                    }
                    continue;
                }
                let r = self.service.move_reported(id, lease, result).await;
                let op = if failed.is_none() { "move" } else { "move-failed" };
                audit(&self.service, &format!("server:{id}"), &self.peer, op, &format!("{lease:016x}"), &r, |to| match &failed {
                    None => format!("{id} -> {to}"),
                    Some(why) => format!("{id} -> {to}: {why}; the lease stays on {id}"),
                });
                if let Err(e) = r {
                    tracing::warn!(server = %id, lease = format_args!("{lease:#x}"), "move report refused: {e}");
                }
            }
        }
        let mut out = results.get();
        match self.service.heartbeat(&self.server_id) {
            None => out.set_known(false),
            Some(hb) => {
                out.set_known(true);
                out.set_generation_floor(hb.floor);
                let mut l = out.reborrow().init_leases(hb.live.len() as u32);
                for (i, (id, gen, deadline)) in hb.live.iter().enumerate() {
                    let mut x = l.reborrow().get(i as u32);
                    x.set_id(*id);
                    x.set_generation(*gen);
                    x.set_deadline_ms(*deadline);
                }
                let mut o = out.init_moves(hb.orders.len() as u32);
                for (i, order) in hb.orders.iter().enumerate() {
                    let mut x = o.reborrow().get(i as u32);
                    x.set_lease(order.lease);
                    x.set_generation(order.generation);
                    x.set_target(&order.target);
                    x.set_kind(match order.kind {
                        crate::state::OrderKind::Migrate => OrderKind::Migrate,
                        crate::state::OrderKind::Suspend => OrderKind::Suspend,
                        crate::state::OrderKind::Resume => OrderKind::Resume,
                    });
                }
            }
        }
        Ok(())
    }

    async fn drain_for_shutdown(
        self: Rc<Self>,
        params: server_agent::DrainForShutdownParams,
        mut results: server_agent::DrainForShutdownResults,
    ) -> Result<(), capnp::Error> {
        let deadline = Some(params.get()?.get_deadline_ms()).filter(|&d| d != 0);
        let id = &self.server_id;
        let r = self.service.drain(id, deadline, true).await;
        audit(&self.service, &format!("server:{id}"), &self.peer, "drain-for-shutdown", id, &r, |_| {
            format!("deadline {}", deadline.unwrap_or(0))
        });
        r.map_err(fail)?;
        self.service.read(|st| {
            if let Some(s) = st.server(id) {
                write_server(results.get().init_server(), st, s);
            }
        });
        Ok(())
    }
}
