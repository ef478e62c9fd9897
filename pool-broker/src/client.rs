//! Client library for the broker: what the `rgpu` CLI (and tests and the
//! benchmark) call. [`BrokerClient`] is blocking: it owns a small
//! single-threaded runtime on the calling thread.

use std::time::Duration;

use capnp_rpc::{rpc_twoparty_capnp, twoparty, RpcSystem};
use futures::AsyncReadExt;
use rgpu_protocol::broker_capnp::{broker, lease as lease_p, server_status, Scope as WireScope};
use rgpu_protocol::token::{self, to_hex};
use serde::Serialize;
use thiserror::Error;

use crate::placement::Scope;

#[derive(Debug, Error)]
pub enum ClientError {
    #[error("cannot reach the broker at {addr}: {reason}")]
    Unreachable { addr: String, reason: String },
    /// The broker refused; the text starts with the kind in brackets.
    #[error("{0}")]
    Refused(String),
    #[error("broker connection: {0}")]
    Rpc(String),
}

impl ClientError {
    /// The bracketed kind of a refusal (`quota`, `not-found`, ...).
    pub fn kind(&self) -> Option<&str> {
        match self {
            ClientError::Refused(t) => t.strip_prefix('[').and_then(|r| r.split(']').next()),
            _ => None,
        }
    }
}

fn from_capnp(e: capnp::Error) -> ClientError {
    // capnp prefixes remote failures with "remote exception: ".
    let t = e.to_string();
    match t.find('[') {
        Some(i) => ClientError::Refused(t[i..].to_string()),
        None => ClientError::Rpc(t),
    }
}

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

pub fn parse_lease_id(s: &str) -> Option<u64> {
    u64::from_str_radix(s.trim().trim_start_matches("0x"), 16).ok()
}

#[derive(Debug, Clone, Serialize)]
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

/// A lease request as the CLI builds it.
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
}

fn text(t: capnp::Result<capnp::text::Reader<'_>>) -> String {
    t.ok().and_then(|t| t.to_str().ok()).unwrap_or("").to_string()
}

fn read_lease(l: lease_p::Reader<'_>) -> Result<LeaseView, ClientError> {
    let mut gpus = Vec::new();
    for g in l.get_gpus().map_err(from_capnp)?.iter() {
        gpus.push(GpuView {
            server: text(g.get_server()),
            uuid: to_hex(g.get_uuid().map_err(from_capnp)?),
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
        token: to_hex(l.get_token().map_err(from_capnp)?),
    })
}

fn read_server(s: server_status::Reader<'_>) -> ServerView {
    let list = |l: capnp::Result<capnp::text_list::Reader<'_>>| -> Vec<String> {
        l.map(|l| l.iter().filter_map(|t| t.ok().and_then(|t| t.to_str().ok()).map(String::from)).collect())
            .unwrap_or_default()
    };
    ServerView {
        id: text(s.get_id()),
        node: text(s.get_node()),
        leaf: text(s.get_leaf()),
        spine: text(s.get_spine()),
        partitions: list(s.get_partitions()),
        models: list(s.get_models()),
        transports: list(s.get_transports()),
        state: text(s.get_state()),
        draining: s.get_draining(),
        drain_deadline_ms: s.get_drain_deadline_ms(),
        gpus: s.get_gpus(),
        gpus_free: s.get_gpus_free(),
        memory: s.get_memory(),
        memory_used: s.get_memory_used(),
        leases: s.get_leases(),
        last_heartbeat_ms: s.get_last_heartbeat_ms(),
    }
}

/// A blocking connection to a broker.
pub struct BrokerClient {
    rt: tokio::runtime::Runtime,
    local: tokio::task::LocalSet,
    client: broker::Client,
    pub addr: String,
    /// Signs drain/undrain (see `AdminAuth` in broker.capnp).
    admin_key: Option<Vec<u8>>,
}

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

impl BrokerClient {
    pub fn connect(addr: &str) -> Result<BrokerClient, ClientError> {
        let unreachable = |r: String| ClientError::Unreachable { addr: addr.to_string(), reason: r };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| unreachable(e.to_string()))?;
        let local = tokio::task::LocalSet::new();
        let stream = local.block_on(&rt, async {
            tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(addr))
                .await
                .map_err(|_| unreachable("connection timed out".into()))?
                .map_err(|e| unreachable(e.to_string()))
        })?;
        let _ = stream.set_nodelay(true);
        let client = local.block_on(&rt, async move {
            let (reader, writer) = tokio_util::compat::TokioAsyncReadCompatExt::compat(stream).split();
            let network = twoparty::VatNetwork::new(
                futures::io::BufReader::new(reader),
                futures::io::BufWriter::new(writer),
                rpc_twoparty_capnp::Side::Client,
                Default::default(),
            );
            let mut rpc = RpcSystem::new(Box::new(network), None);
            let client: broker::Client = rpc.bootstrap(rpc_twoparty_capnp::Side::Server);
            tokio::task::spawn_local(rpc);
            client
        });
        Ok(BrokerClient { rt, local, client, addr: addr.to_string(), admin_key: None })
    }

    /// Proves drain and undrain with `key` (the broker's admin key, or its
    /// token key).
    pub fn with_admin_key(mut self, key: Vec<u8>) -> Self {
        self.admin_key = Some(key);
        self
    }

    /// (issuedMs, proof) for an admin request; empty without a key.
    fn admin_auth(&self, op: &str, server: &str, deadline_ms: u64) -> (u64, Vec<u8>) {
        let Some(k) = &self.admin_key else { return (0, Vec::new()) };
        let issued = crate::service::now_ms();
        (issued, token::sign_bytes(k, &token::admin_message(op, server, deadline_ms, issued)))
    }

    fn run<T>(&self, f: impl std::future::Future<Output = Result<T, ClientError>>) -> Result<T, ClientError> {
        self.local.block_on(&self.rt, f)
    }

    /// The capnp client, for async callers on this client's thread (the benchmark).
    pub fn raw(&self) -> broker::Client {
        self.client.clone()
    }

    pub fn lease(&self, s: &LeaseSpec) -> Result<LeaseView, ClientError> {
        let mut req = self.client.lease_request();
        {
            let mut r = req.get().init_request();
            r.set_tenant(&s.tenant);
            r.set_gpus(s.gpus);
            r.set_memory(s.memory);
            r.set_compute_milli(s.compute_milli);
            let mut m = r.reborrow().init_models(s.models.len() as u32);
            for (i, x) in s.models.iter().enumerate() {
                m.set(i as u32, x);
            }
            r.set_scope(match s.scope {
                Scope::Any => WireScope::Any,
                Scope::Node => WireScope::Node,
                Scope::Leaf => WireScope::Leaf,
                Scope::Spine => WireScope::Spine,
            });
            r.set_scope_required(s.scope_required);
            r.set_priority(s.priority);
            r.set_ttl_ms(s.ttl_ms);
            r.set_wait_ms(s.wait_ms);
            r.set_key(&s.key);
        }
        self.run(async {
            let reply = req.send().promise.await.map_err(from_capnp)?;
            read_lease(reply.get().and_then(|r| r.get_lease()).map_err(from_capnp)?)
        })
    }

    pub fn renew(&self, id: u64, ttl_ms: u64) -> Result<LeaseView, ClientError> {
        let mut req = self.client.renew_request();
        req.get().set_lease_id(id);
        req.get().set_ttl_ms(ttl_ms);
        self.run(async {
            let reply = req.send().promise.await.map_err(from_capnp)?;
            read_lease(reply.get().and_then(|r| r.get_lease()).map_err(from_capnp)?)
        })
    }

    /// True if the lease was live; releasing an ended lease is not an error.
    pub fn release(&self, id: u64) -> Result<bool, ClientError> {
        let mut req = self.client.release_request();
        req.get().set_lease_id(id);
        self.run(async {
            let reply = req.send().promise.await.map_err(from_capnp)?;
            Ok(reply.get().map_err(from_capnp)?.get_released())
        })
    }

    pub fn leases(&self, tenant: &str) -> Result<Vec<LeaseView>, ClientError> {
        let mut req = self.client.list_leases_request();
        req.get().set_tenant(tenant);
        self.run(async {
            let reply = req.send().promise.await.map_err(from_capnp)?;
            let list = reply.get().and_then(|r| r.get_leases()).map_err(from_capnp)?;
            list.iter().map(read_lease).collect()
        })
    }

    pub fn servers(&self) -> Result<Vec<ServerView>, ClientError> {
        let req = self.client.list_servers_request();
        self.run(async {
            let reply = req.send().promise.await.map_err(from_capnp)?;
            let list = reply.get().and_then(|r| r.get_servers()).map_err(from_capnp)?;
            Ok(list.iter().map(read_server).collect())
        })
    }

    /// `deadline_ms`: unix ms, or 0 for none.
    pub fn drain(&self, server: &str, deadline_ms: u64) -> Result<ServerView, ClientError> {
        let mut req = self.client.drain_request();
        req.get().set_server_id(server);
        req.get().set_deadline_ms(deadline_ms);
        let (issued, proof) = self.admin_auth("drain", server, deadline_ms);
        let mut auth = req.get().init_auth();
        auth.set_issued_ms(issued);
        auth.set_proof(&proof);
        self.run(async {
            let reply = req.send().promise.await.map_err(from_capnp)?;
            Ok(read_server(reply.get().and_then(|r| r.get_server()).map_err(from_capnp)?))
        })
    }

    pub fn undrain(&self, server: &str) -> Result<ServerView, ClientError> {
        let mut req = self.client.undrain_request();
        req.get().set_server_id(server);
        let (issued, proof) = self.admin_auth("undrain", server, 0);
        let mut auth = req.get().init_auth();
        auth.set_issued_ms(issued);
        auth.set_proof(&proof);
        self.run(async {
            let reply = req.send().promise.await.map_err(from_capnp)?;
            Ok(read_server(reply.get().and_then(|r| r.get_server()).map_err(from_capnp)?))
        })
    }

    pub fn status(&self) -> Result<StatusView, ClientError> {
        let req = self.client.status_request();
        self.run(async {
            let reply = req.send().promise.await.map_err(from_capnp)?;
            let s = reply.get().and_then(|r| r.get_status()).map_err(from_capnp)?;
            Ok(StatusView {
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
            })
        })
    }
}
