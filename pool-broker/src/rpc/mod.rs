//! The capnp-rpc `Broker` (broker.capnp): each method decodes, makes one
//! service call and encodes. One [`Broker`] object per connection holds the
//! connection's challenge; a login gives the caller a [`session::Session`]
//! bound to its identity, a registration a [`agent::Agent`] bound to its
//! server. Connections are served by a few threads, each with its own
//! single-threaded runtime (capnp-rpc is not `Send`), all sharing one
//! [`Service`].

pub mod agent;
pub mod encode;
pub mod session;

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, TcpListener};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use capnp::capability::Rc;
use capnp_rpc::{rpc_twoparty_capnp, twoparty, RpcSystem};
use futures::AsyncReadExt;
use rgpu_protocol::auth::NONCE_LEN;
use rgpu_protocol::broker_capnp::broker;
use tokio_util::compat::TokioAsyncReadCompatExt;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::audit::Record;
use crate::inventory::{GpuSpec, ServerSpec};
use crate::service::{now_ms, Service, TICK};
use crate::state::BrokerError;

pub(crate) fn text(t: capnp::Result<capnp::text::Reader<'_>>) -> String {
    t.ok().and_then(|t| t.to_str().ok()).unwrap_or("").to_string()
}

fn texts(l: capnp::Result<capnp::text_list::Reader<'_>>) -> Vec<String> {
    match l {
        Ok(l) => l.iter().filter_map(|t| t.ok().and_then(|t| t.to_str().ok()).map(String::from)).collect(),
        Err(_) => Vec::new(),
    }
}

pub(crate) fn fail(e: BrokerError) -> capnp::Error {
    capnp::Error::failed(e.to_string())
}

/// Writes one audit record of `op` on `target` by `actor` from `peer`: ok
/// with `detail`, or the refusal.
pub(crate) fn audit<T>(svc: &Service, actor: &str, peer: &str, op: &str, target: &str, r: &Result<T, BrokerError>, detail: impl FnOnce(&T) -> String) {
    let (ok, detail) = match r {
        Ok(v) => (true, detail(v)),
        Err(e) => (false, e.to_string()),
    };
    svc.audit.record(Record {
        time_ms: now_ms(),
        actor: actor.to_string(),
        peer: peer.to_string(),
        op: op.to_string(),
        target: target.to_string(),
        ok,
        detail,
    });
}

/// What one message to the broker may hold. Anyone may send before proving
/// anything: a message is bounded to 1 MiB (a registration of a server with
/// hundreds of GPUs is a few KiB).
fn receive_options() -> capnp::message::ReaderOptions {
    let mut o = capnp::message::ReaderOptions::new();
    o.traversal_limit_in_words(Some(1 << 17)).nesting_limit(32);
    o
}

/// The bootstrap capability of one connection.
struct Broker {
    service: Arc<Service>,
    peer: String,
    /// The peer's host (its address without the port): failed proofs are
    /// counted per host.
    host: String,
    /// The nonces `challenge` drew on this connection and no login or
    /// registration used yet, oldest first.
    nonces: RefCell<VecDeque<Vec<u8>>>,
    /// Released once a login or registration succeeds.
    slot: Rc<Slot>,
}

/// Unused nonces a connection may hold.
const NONCES_KEPT: usize = 64;

impl Broker {
    /// Uses up `nonce` if this connection's `challenge` drew it.
    fn take_nonce(&self, nonce: &[u8]) -> Result<Vec<u8>, BrokerError> {
        let mut n = self.nonces.borrow_mut();
        match n.iter().position(|x| x == nonce) {
            Some(i) => Ok(n.remove(i).unwrap_or_default()),
            None => Err(BrokerError::Auth(
                "the proof is not over a nonce this connection's challenge drew (or it was used): call challenge first".into(),
            )),
        }
    }
}

fn server_spec(s: rgpu_protocol::broker_capnp::server_info::Reader<'_>) -> Result<ServerSpec, capnp::Error> {
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
            health_reason: crate::evacuation::clip(text(g.get_health_reason()), crate::evacuation::MAX_HEALTH_REASON),
        });
    }
    Ok(ServerSpec {
        id: text(s.get_id()),
        node: text(s.get_node()),
        leaf: text(s.get_leaf()),
        spine: text(s.get_spine()),
        partitions: texts(s.get_partitions()),
        gpus,
        transports: texts(s.get_transports()),
    })
}

impl broker::Server for Broker {
    async fn version(self: Rc<Self>, _: broker::VersionParams, mut results: broker::VersionResults) -> Result<(), capnp::Error> {
        let mut r = results.get();
        r.set_version(env!("CARGO_PKG_VERSION"));
        r.set_protocol(rgpu_protocol::PROTOCOL_VERSION);
        Ok(())
    }

    async fn challenge(self: Rc<Self>, _: broker::ChallengeParams, mut results: broker::ChallengeResults) -> Result<(), capnp::Error> {
        let mut n = vec![0u8; NONCE_LEN];
        getrandom::fill(&mut n).map_err(|e| fail(BrokerError::Store(format!("no randomness: {e}"))))?;
        results.get().set_nonce(&n);
        let mut kept = self.nonces.borrow_mut();
        if kept.len() == NONCES_KEPT {
            kept.pop_front();
        }
        kept.push_back(n);
        Ok(())
    }

    async fn login(self: Rc<Self>, params: broker::LoginParams, mut results: broker::LoginResults) -> Result<(), capnp::Error> {
        let p = params.get()?;
        let (tenant, role) = (text(p.get_tenant()), text(p.get_role()));
        // A follower sends clients to the leader before they prove anything.
        self.service.serving().map_err(fail)?;
        self.service.may_try(&self.host).map_err(fail)?;
        let r = self.take_nonce(p.get_nonce().unwrap_or_default()).and_then(|n| {
            self.service.credentials.login(&n, &tenant, &role, p.get_serial(), p.get_proof().unwrap_or_default(), now_ms())
        });
        let actor = r.as_ref().map_or_else(|_| "-".to_string(), |id| id.actor());
        audit(&self.service, &actor, &self.peer, "login", &format!("{tenant}/{role}"), &r, |id| format!("serial {}", id.serial));
        if r.is_err() {
            self.service.failed(&self.host);
        }
        let id = r.map_err(fail)?;
        self.slot.release();
        let s = session::Session::new(self.service.clone(), id, self.peer.clone());
        results.get().set_session(capnp_rpc::new_client(s));
        Ok(())
    }

    async fn register(self: Rc<Self>, params: broker::RegisterParams, mut results: broker::RegisterResults) -> Result<(), capnp::Error> {
        let p = params.get()?;
        let s = p.get_server()?;
        self.service.serving().map_err(fail)?;
        self.service.may_try(&self.host).map_err(fail)?;
        let spec = server_spec(s)?;
        let id = spec.id.clone();
        let checked = self.take_nonce(p.get_nonce().unwrap_or_default()).and_then(|n| {
            let msg = rgpu_protocol::auth::register_message(&n, s)
                .map_err(|e| BrokerError::Invalid(format!("server inventory: {e}")))?;
            self.service.check_server_proof(&id, &msg, p.get_proof().unwrap_or_default())
        });
        if checked.is_err() {
            self.service.failed(&self.host);
        }
        let gpus = spec.gpus.len();
        let link = Some(s.get_link_bandwidth()).filter(|&b| b != 0);
        let r = match checked {
            Ok(()) => self.service.register_linked(spec, link).await,
            Err(e) => Err(e),
        };
        audit(&self.service, &format!("server:{id}"), &self.peer, "register", &id, &r, |_| format!("{gpus} GPU(s)"));
        let hb = r.map_err(fail)?;
        self.slot.release();
        let agent = agent::Agent::new(self.service.clone(), id, self.peer.clone());
        let mut out = results.get();
        out.set_heartbeat_ms(hb.min(u64::from(u32::MAX)) as u32);
        out.set_agent(capnp_rpc::new_client(agent));
        Ok(())
    }
}

/// Serves `listener` with `threads` threads until `shutdown` fires; also
/// ticks the state machine every 100 ms. Blocks.
pub fn serve(
    listener: TcpListener,
    service: Arc<Service>,
    threads: usize,
    security: rgpu_tls::ServerSecurity,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    let mut handles = Vec::new();
    let unproven = Arc::new(Unproven::default());
    for i in 0..threads.max(1) {
        let l = listener.try_clone()?;
        let (svc, stop, security, unproven) = (service.clone(), shutdown.clone(), security.clone(), unproven.clone());
        handles.push(std::thread::Builder::new().name(format!("rgpu-broker-rpc-{i}")).spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => return tracing::error!("cannot start a runtime: {e}"),
            };
            let local = tokio::task::LocalSet::new();
            local.block_on(&rt, accept_loop(l, svc, security, stop, unproven));
        })?);
    }
    let (svc, stop) = (service.clone(), shutdown.clone());
    handles.push(std::thread::Builder::new().name("rgpu-broker-tick".into()).spawn(move || {
        while !stop.is_cancelled() {
            std::thread::sleep(TICK);
            svc.tick();
        }
    })?);
    for h in handles {
        let _ = h.join();
    }
    Ok(())
}

/// How long a new connection has for its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a connection may stay open before it logs in or registers (`version` and
/// `challenge` need neither): past it, the broker closes it.
pub const LOGIN_WAIT: Duration = Duration::from_secs(10);

/// Connections that have not logged in or registered yet, from one host and in all. Past
/// either a new connection is closed at once: without them a peer that opens connections and
/// sends nothing would hold the broker's file descriptors until no server could heartbeat
/// and no tenant log in.
pub const UNPROVEN_PER_HOST: usize = 128;
pub const UNPROVEN: usize = 1024;

/// The count of connections not yet proven, per host.
#[derive(Default)]
struct Unproven {
    by_host: Mutex<HashMap<IpAddr, usize>>,
}

impl Unproven {
    /// A slot for a new connection from `host`, or None when it or the broker has too many.
    fn admit(self: &Arc<Self>, host: IpAddr) -> Option<Slot> {
        let mut m = self.by_host.lock().unwrap_or_else(|p| p.into_inner());
        let total: usize = m.values().sum();
        let here = m.entry(host).or_insert(0);
        if *here >= UNPROVEN_PER_HOST || total >= UNPROVEN {
            return None;
        }
        *here += 1;
        Some(Slot { unproven: self.clone(), host, held: Cell::new(true) })
    }
}

/// One unproven connection's place in [`Unproven`], given back when it proves itself or ends.
struct Slot {
    unproven: Arc<Unproven>,
    host: IpAddr,
    held: Cell<bool>,
}

impl Slot {
    fn release(&self) {
        if self.held.replace(false) {
            let mut m = self.unproven.by_host.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(n) = m.get_mut(&self.host) {
                *n -= 1;
                if *n == 0 {
                    m.remove(&self.host);
                }
            }
        }
    }

    fn proven(&self) -> bool {
        !self.held.get()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.release();
    }
}

async fn accept_loop(
    listener: TcpListener,
    service: Arc<Service>,
    security: rgpu_tls::ServerSecurity,
    shutdown: CancellationToken,
    unproven: Arc<Unproven>,
) {
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
        let Some(slot) = unproven.admit(peer.ip()) else {
            debug!(%peer, "closed at once: too many connections that have not logged in");
            drop(sock);
            continue;
        };
        let (svc, stop, security) = (service.clone(), shutdown.clone(), security.clone());
        tokio::task::spawn_local(async move {
            let _ = sock.set_nodelay(true);
            // TLS, or with --plaintext a check that the client did not ask
            // for it: neither end carries on in a mode the other did not choose.
            let sock = tokio::select! {
                r = tokio::time::timeout(HANDSHAKE_TIMEOUT, rgpu_tls::server::accept(&security, sock)) => match r {
                    Ok(Ok(s)) => s,
                    Ok(Err(e @ (rgpu_tls::server::Refused::PlaintextClient | rgpu_tls::server::Refused::TlsClient))) => {
                        return tracing::warn!(%peer, "connection refused: {e}")
                    }
                    Ok(Err(e)) => return debug!(%peer, "connection closed: {e}"),
                    Err(_) => return debug!(%peer, "no TLS handshake within {} s; closing", HANDSHAKE_TIMEOUT.as_secs()),
                },
                _ = stop.cancelled() => return,
            };
            let (reader, writer) = sock.compat().split();
            let network = twoparty::VatNetwork::new(
                futures::io::BufReader::new(reader),
                futures::io::BufWriter::new(writer),
                rpc_twoparty_capnp::Side::Server,
                receive_options(),
            );
            let slot = Rc::new(slot);
            let me = Broker {
                service: svc,
                peer: peer.to_string(),
                host: peer.ip().to_string(),
                nonces: RefCell::default(),
                slot: slot.clone(),
            };
            let client: broker::Client = capnp_rpc::new_client(me);
            let rpc = RpcSystem::new(Box::new(network), Some(client.client));
            let unproven_past_wait = async {
                tokio::time::sleep(LOGIN_WAIT).await;
                if slot.proven() {
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                r = rpc => debug!(%peer, "broker connection ended: {r:?}"),
                _ = unproven_past_wait => debug!(%peer, "no login or registration within {} s; closing", LOGIN_WAIT.as_secs()),
                _ = stop.cancelled() => {}
            }
        });
    }
}
