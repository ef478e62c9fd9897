//! Encoding the broker's answers: leases, servers, status, audit records.

use rgpu_protocol::broker_capnp::{audit_record, broker_status, lease as lease_p, server_status};

use crate::audit::Record;
use crate::inventory::Server;
use crate::service::Service;
use crate::state::{Lease, State};

pub fn write_lease(mut b: lease_p::Builder<'_>, l: &Lease, token: &[u8]) {
    b.set_id(l.id);
    b.set_tenant(&l.tenant);
    b.set_generation(l.generation);
    b.set_memory_limit(l.memory_limit);
    b.set_compute_milli(l.compute_milli);
    b.set_deadline_ms(l.deadline);
    b.set_granted_ms(l.granted);
    b.set_priority(l.priority);
    b.set_bandwidth(l.bandwidth);
    b.set_state(l.state_name());
    b.set_token(token);
    if let Some(m) = &l.moving {
        b.set_moving_to(&m.to);
    }
    b.set_move_error(&l.move_error);
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

pub fn write_server(mut b: server_status::Builder<'_>, st: &State, s: &Server) {
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
    if let Some(link) = st.link(&s.spec.id) {
        b.set_link_bandwidth(link.capacity.unwrap_or(0));
        b.set_bandwidth_granted(link.granted);
        if let Some(load) = link.load {
            let mut w = b.reborrow().init_load();
            w.set_bytes_in_per_s(load.bytes_in);
            w.set_bytes_out_per_s(load.bytes_out);
        }
    }
    let mut p = b.reborrow().init_partitions(s.spec.partitions.len() as u32);
    for (i, x) in s.spec.partitions.iter().enumerate() {
        p.set(i as u32, x);
    }
    let mut t = b.reborrow().init_transports(s.spec.transports.len() as u32);
    for (i, x) in s.spec.transports.iter().enumerate() {
        t.set(i as u32, x);
    }
    let unhealthy: Vec<_> = s.gpus.iter().filter(|g| !g.spec.healthy).collect();
    let mut h = b.reborrow().init_unhealthy(unhealthy.len() as u32);
    for (i, g) in unhealthy.iter().enumerate() {
        let mut x = h.reborrow().get(i as u32);
        x.set_ordinal(g.spec.ordinal);
        x.set_healthy(false);
        x.set_reason(&g.spec.health_reason);
    }
    let mut models: Vec<&str> = s.gpus.iter().map(|g| g.spec.model.as_str()).collect();
    models.dedup();
    let mut m = b.init_models(models.len() as u32);
    for (i, x) in models.iter().enumerate() {
        m.set(i as u32, x);
    }
}

pub fn write_status(mut b: broker_status::Builder<'_>, st: &State, svc: &Service, now: u64) {
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
}

pub fn write_audit(mut b: audit_record::Builder<'_>, r: &Record) {
    b.set_time_ms(r.time_ms);
    b.set_actor(&r.actor);
    b.set_peer(&r.peer);
    b.set_op(&r.op);
    b.set_target(&r.target);
    b.set_ok(r.ok);
    b.set_detail(&r.detail);
}
