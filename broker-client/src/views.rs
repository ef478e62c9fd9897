//! What a client sends the broker and reads back, as plain Rust values,
//! with their capnp encoding and decoding. Plain values so the CLI can
//! print them and serialize them (`--json`) without touching capnp.

use rgpu_protocol::broker_capnp::{
    audit_record, broker_status, lease as lease_p, lease_request, server_status, usage, usage_record,
};
use rgpu_protocol::scope::Scope;
use rgpu_protocol::token::to_hex;
use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct GpuView {
    pub server: String,
    pub uuid: String,
    pub ordinal: u32,
    pub model: String,
    pub memory: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct LeaseView {
    pub id: String,
    pub tenant: String,
    pub generation: u64,
    pub gpus: Vec<GpuView>,
    pub memory_limit: u64,
    pub compute_milli: u32,
    pub deadline_ms: u64,
    pub granted_ms: u64,
    pub priority: i32,
    pub state: String,
    /// Hex; empty in listings and when the broker has no key.
    pub token: String,
    /// What its sessions used so far, as its servers last reported.
    pub usage: Option<UsageView>,
    /// Bytes/s granted each way on each of its servers' links; 0: none asked.
    pub bandwidth: u64,
    /// The server a drain moves it to now (empty: none).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub moving_to: String,
    /// Why its last move failed (empty: none did).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub move_error: String,
}

/// What a drain with migrate chose for one lease.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct MovePlanView {
    pub lease: String,
    /// Empty: no server fits (`reason` says why).
    pub target: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub reason: String,
}

/// Metered use (cumulative), as GPU servers report it.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct UsageView {
    pub kernels: u64,
    /// Device time of the kernels, ns; None where the backend cannot time them.
    pub kernel_ns: Option<u64>,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub memory: u64,
    pub memory_peak: u64,
}

/// An ended lease's accounting record, or a live lease's use so far
/// (`why` "live", `ended_ms` 0).
#[derive(Debug, Clone, Serialize)]
pub struct UsageRecordView {
    pub lease: String,
    pub tenant: String,
    pub gpus: u32,
    pub servers: Vec<String>,
    pub memory_limit: u64,
    pub compute_milli: u32,
    pub granted_ms: u64,
    pub ended_ms: u64,
    pub why: String,
    /// None: no server reported use.
    pub usage: Option<UsageView>,
}

impl LeaseView {
    pub fn id_u64(&self) -> u64 {
        parse_lease_id(&self.id).unwrap_or(0)
    }
    /// The distinct servers, in the order of the lease's GPUs.
    pub fn servers(&self) -> Vec<String> {
        let mut v: Vec<String> = Vec::new();
        for g in &self.gpus {
            if !v.contains(&g.server) {
                v.push(g.server.clone());
            }
        }
        v
    }
}

/// Lease ids are shown as 16 hex digits.
pub fn format_lease_id(id: u64) -> String {
    format!("{id:016x}")
}

/// What [`format_lease_id`] writes, with or without `0x`.
pub fn parse_lease_id(s: &str) -> Option<u64> {
    u64::from_str_radix(s.trim().trim_start_matches("0x"), 16).ok()
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ServerView {
    pub id: String,
    pub node: String,
    pub leaf: String,
    pub spine: String,
    pub partitions: Vec<String>,
    pub models: Vec<String>,
    /// Data-plane transports the server offers ("tcp", "rdma").
    pub transports: Vec<String>,
    pub state: String,
    pub draining: bool,
    pub drain_deadline_ms: u64,
    pub gpus: u32,
    pub gpus_free: u32,
    pub memory: u64,
    pub memory_used: u64,
    pub leases: u32,
    pub last_heartbeat_ms: u64,
    /// All its sessions since it started, as its last heartbeat reported.
    pub usage: Option<UsageView>,
    /// Bytes/s its links carry each way, as it registered; None: not said (unbounded).
    pub link_bandwidth: Option<u64>,
    /// Bytes/s granted to its leases, summed.
    pub bandwidth_granted: u64,
    /// Its data-plane traffic at its last heartbeat; None: none reported.
    pub load: Option<LoadView>,
    /// Its GPUs it reports unhealthy (no new lease lands on them; their
    /// leases are moved off).
    pub unhealthy: Vec<GpuHealthView>,
}

/// A GPU its server reports unhealthy, and why.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct GpuHealthView {
    pub ordinal: u32,
    pub reason: String,
}

/// A server's data-plane traffic, bytes/s.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct LoadView {
    pub bytes_in: u64,
    pub bytes_out: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct StatusView {
    pub servers: u32,
    pub servers_up: u32,
    pub gpus: u32,
    pub gpus_free: u32,
    pub leases: u32,
    pub queued: u32,
    pub generation: u64,
    pub policy: String,
    pub data_dir: String,
    pub uptime_ms: u64,
}

/// One record of the broker's audit log.
#[derive(Debug, Clone, Serialize)]
pub struct AuditView {
    pub time_ms: u64,
    /// "tenant/role", "server:ID", or "-" (a login that proved nothing).
    pub actor: String,
    pub peer: String,
    pub op: String,
    pub target: String,
    pub ok: bool,
    pub detail: String,
}

/// A lease request as the CLI builds it; `tenant` empty: the credential's.
#[derive(Debug, Clone, Default)]
pub struct LeaseSpec {
    pub tenant: String,
    pub gpus: u32,
    pub memory: u64,
    pub compute_milli: u32,
    pub models: Vec<String>,
    pub scope: Scope,
    pub scope_required: bool,
    pub priority: i32,
    pub ttl_ms: u64,
    pub wait_ms: u64,
    pub key: String,
    /// Bytes/s each way on each server of the lease; 0: none.
    pub bandwidth: u64,
    /// The client's Ed25519 public key to bind the lease's tokens to
    /// (`rgpu_protocol::binding`); None: bearer tokens.
    pub client_key: Option<[u8; 32]>,
}

impl LeaseSpec {
    pub fn write(&self, mut r: lease_request::Builder<'_>) {
        r.set_tenant(&self.tenant);
        r.set_gpus(self.gpus);
        r.set_memory(self.memory);
        r.set_compute_milli(self.compute_milli);
        let mut m = r.reborrow().init_models(self.models.len() as u32);
        for (i, x) in self.models.iter().enumerate() {
            m.set(i as u32, x);
        }
        r.set_scope(self.scope.into());
        r.set_scope_required(self.scope_required);
        r.set_priority(self.priority);
        r.set_ttl_ms(self.ttl_ms);
        r.set_wait_ms(self.wait_ms);
        r.set_key(&self.key);
        r.set_bandwidth(self.bandwidth);
        if let Some(k) = &self.client_key {
            r.set_client_key(k);
        }
    }
}

// Text fields the broker left unset, or filled with invalid UTF-8, read as
// empty: a display value, never a reason to fail a whole listing.
pub fn text(t: capnp::Result<capnp::text::Reader<'_>>) -> String {
    t.ok().and_then(|t| t.to_str().ok()).unwrap_or("").to_string()
}

fn texts(l: capnp::Result<capnp::text_list::Reader<'_>>) -> Vec<String> {
    l.map(|l| l.iter().filter_map(|t| t.ok().and_then(|t| t.to_str().ok()).map(String::from)).collect())
        .unwrap_or_default()
}

pub fn read_lease(l: lease_p::Reader<'_>) -> capnp::Result<LeaseView> {
    let mut gpus = Vec::new();
    for g in l.get_gpus()?.iter() {
        gpus.push(GpuView {
            server: text(g.get_server()),
            uuid: to_hex(g.get_uuid()?),
            ordinal: g.get_ordinal(),
            model: text(g.get_model()),
            memory: g.get_memory(),
        });
    }
    Ok(LeaseView {
        id: format_lease_id(l.get_id()),
        tenant: text(l.get_tenant()),
        generation: l.get_generation(),
        gpus,
        memory_limit: l.get_memory_limit(),
        compute_milli: l.get_compute_milli(),
        deadline_ms: l.get_deadline_ms(),
        granted_ms: l.get_granted_ms(),
        priority: l.get_priority(),
        state: text(l.get_state()),
        token: to_hex(l.get_token()?),
        usage: if l.has_usage() { Some(read_usage(l.get_usage()?)) } else { None },
        bandwidth: l.get_bandwidth(),
        moving_to: text(l.get_moving_to()),
        move_error: text(l.get_move_error()),
    })
}

pub fn read_usage(u: usage::Reader<'_>) -> UsageView {
    UsageView {
        kernels: u.get_kernels(),
        kernel_ns: u.get_kernel_timed().then(|| u.get_kernel_ns()),
        bytes_in: u.get_bytes_in(),
        bytes_out: u.get_bytes_out(),
        memory: u.get_memory(),
        memory_peak: u.get_memory_peak(),
    }
}

pub fn read_usage_record(r: usage_record::Reader<'_>) -> capnp::Result<UsageRecordView> {
    Ok(UsageRecordView {
        lease: format_lease_id(r.get_lease()),
        tenant: text(r.get_tenant()),
        gpus: r.get_gpus(),
        servers: texts(r.get_servers()),
        memory_limit: r.get_memory_limit(),
        compute_milli: r.get_compute_milli(),
        granted_ms: r.get_granted_ms(),
        ended_ms: r.get_ended_ms(),
        why: text(r.get_why()),
        usage: if r.get_reported() { Some(read_usage(r.get_usage()?)) } else { None },
    })
}

pub fn read_server(s: server_status::Reader<'_>) -> ServerView {
    ServerView {
        id: text(s.get_id()),
        node: text(s.get_node()),
        leaf: text(s.get_leaf()),
        spine: text(s.get_spine()),
        partitions: texts(s.get_partitions()),
        models: texts(s.get_models()),
        transports: texts(s.get_transports()),
        state: text(s.get_state()),
        draining: s.get_draining(),
        drain_deadline_ms: s.get_drain_deadline_ms(),
        gpus: s.get_gpus(),
        gpus_free: s.get_gpus_free(),
        memory: s.get_memory(),
        memory_used: s.get_memory_used(),
        leases: s.get_leases(),
        last_heartbeat_ms: s.get_last_heartbeat_ms(),
        usage: if s.has_usage() { s.get_usage().ok().map(read_usage) } else { None },
        link_bandwidth: Some(s.get_link_bandwidth()).filter(|&b| b != 0),
        bandwidth_granted: s.get_bandwidth_granted(),
        load: if s.has_load() {
            s.get_load().ok().map(|l| LoadView { bytes_in: l.get_bytes_in_per_s(), bytes_out: l.get_bytes_out_per_s() })
        } else {
            None
        },
        unhealthy: s
            .get_unhealthy()
            .map(|l| l.iter().map(|g| GpuHealthView { ordinal: g.get_ordinal(), reason: text(g.get_reason()) }).collect())
            .unwrap_or_default(),
    }
}

pub fn read_status(s: broker_status::Reader<'_>) -> StatusView {
    StatusView {
        servers: s.get_servers(),
        servers_up: s.get_servers_up(),
        gpus: s.get_gpus(),
        gpus_free: s.get_gpus_free(),
        leases: s.get_leases(),
        queued: s.get_queued(),
        generation: s.get_generation(),
        policy: text(s.get_policy()),
        data_dir: text(s.get_data_dir()),
        uptime_ms: s.get_uptime_ms(),
    }
}

pub fn read_audit(r: audit_record::Reader<'_>) -> AuditView {
    AuditView {
        time_ms: r.get_time_ms(),
        actor: text(r.get_actor()),
        peer: text(r.get_peer()),
        op: text(r.get_op()),
        target: text(r.get_target()),
        ok: r.get_ok(),
        detail: text(r.get_detail()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rgpu_protocol::broker_capnp::Scope as WireScope;

    #[test]
    fn lease_ids_round_trip_as_sixteen_hex_digits() {
        assert_eq!(format_lease_id(0xab), "00000000000000ab");
        assert_eq!(parse_lease_id("00000000000000ab"), Some(0xab));
        assert_eq!(parse_lease_id(" 0xAB "), Some(0xab));
        assert_eq!(parse_lease_id(&format_lease_id(u64::MAX)), Some(u64::MAX));
        assert_eq!(parse_lease_id("lease-1"), None);
    }

    #[test]
    fn a_lease_reads_back_with_hex_ids_and_its_servers_once_each_in_order() {
        let mut m = capnp::message::Builder::new_default();
        {
            let mut l = m.init_root::<lease_p::Builder>();
            l.set_id(0x1f);
            l.set_tenant("ana");
            l.set_generation(3);
            l.set_memory_limit(1 << 30);
            l.set_compute_milli(250);
            l.set_deadline_ms(9000);
            l.set_granted_ms(1000);
            l.set_priority(-2);
            l.set_state("active");
            l.set_token(&[0xde, 0xad]);
            let mut gs = l.init_gpus(3);
            for (i, server) in ["b:1", "a:1", "b:1"].iter().enumerate() {
                let mut g = gs.reborrow().get(i as u32);
                g.set_server(server);
                g.set_uuid(&[i as u8; 16]);
                g.set_ordinal(i as u32);
                g.set_model("H100");
                g.set_memory(80 << 30);
            }
        }
        let v = read_lease(m.get_root_as_reader::<lease_p::Reader>().unwrap()).unwrap();
        assert_eq!(v.id, "000000000000001f");
        assert_eq!(v.id_u64(), 0x1f);
        assert_eq!((v.tenant.as_str(), v.generation, v.priority, v.state.as_str()), ("ana", 3, -2, "active"));
        assert_eq!((v.memory_limit, v.compute_milli, v.deadline_ms, v.granted_ms), (1 << 30, 250, 9000, 1000));
        assert_eq!(v.token, "dead");
        assert_eq!(v.gpus[1].uuid, "01".repeat(16));
        assert_eq!(v.servers(), ["b:1", "a:1"]);
    }

    #[test]
    fn unset_fields_read_as_empty() {
        let mut m = capnp::message::Builder::new_default();
        m.init_root::<server_status::Builder>().set_gpus(4);
        let s = read_server(m.get_root_as_reader::<server_status::Reader>().unwrap());
        assert_eq!((s.id.as_str(), s.gpus, s.partitions.len(), s.transports.len()), ("", 4, 0, 0));
        assert_eq!((s.link_bandwidth, s.bandwidth_granted, s.load), (None, 0, None), "an older broker says nothing of links");
    }

    #[test]
    fn a_lease_spec_is_written_field_for_field() {
        let spec = LeaseSpec {
            tenant: "t".into(),
            gpus: 2,
            memory: 5,
            compute_milli: 6,
            models: vec!["A100".into(), "H100".into()],
            scope: Scope::Leaf,
            scope_required: true,
            priority: 7,
            ttl_ms: 8,
            wait_ms: 9,
            key: "k".into(),
            bandwidth: 10,
            client_key: Some([0x42; 32]),
        };
        let mut m = capnp::message::Builder::new_default();
        spec.write(m.init_root::<lease_request::Builder>());
        let r = m.get_root_as_reader::<lease_request::Reader>().unwrap();
        assert_eq!(r.get_tenant().unwrap(), "t");
        assert_eq!((r.get_gpus(), r.get_memory(), r.get_compute_milli()), (2, 5, 6));
        let models: Vec<_> = r.get_models().unwrap().iter().map(|t| t.unwrap().to_string().unwrap()).collect();
        assert_eq!(models, ["A100", "H100"]);
        assert_eq!(r.get_scope(), Ok(WireScope::Leaf));
        assert!(r.get_scope_required());
        assert_eq!((r.get_priority(), r.get_ttl_ms(), r.get_wait_ms()), (7, 8, 9));
        assert_eq!(r.get_key().unwrap(), "k");
        assert_eq!(r.get_client_key().unwrap(), &[0x42; 32]);
        assert_eq!(r.get_bandwidth(), 10);
    }
}
