//! The server's side of the pool broker: registers this server's GPUs with
//! their place in the fabric, heartbeats, and applies each reply to the
//! lease table ([`crate::lease`]), closing sessions of ended leases.
//! Reconnects with backoff when the broker is away; leases keep running
//! until the deadline last heard of. Each registration proves the broker
//! key over the connection's fresh challenge and the inventory it
//! registers; heartbeats and the drain for stopping go through the
//! capability that registration returns, so they speak for this server
//! on this connection only.
//!
//! Replicated brokers: `broker` may list several addresses; the agent
//! registers with the one that leads (a follower refuses with the leader's
//! address, tried next) and, when its connection drops or its broker stops
//! leading, finds the new leader at once, without backoff: a new leader
//! counts every server as heard from at its election, and a server that
//! does not heartbeat it within the usual allowance loses its leases.
//!
//! Moves: a heartbeat reply may order leases moved to another server (a
//! drain with `--migrate`); the agent migrates every session of such a
//! lease there ([`crate::migration::migrate`], which takes a leased session
//! only when its move was ordered) and reports each lease done or failed
//! in a later heartbeat. Preemption's suspend and resume orders come the
//! same way and are reported with their kind ([`crate::preemption`]).
//!
//! Health: registration carries each device's health as the backend
//! observes it ([`crate::health`]), and a heartbeat the devices whose
//! health changed since the broker last heard, so a broker that restarts
//! learns it again when the server registers.
//!
//! When the server is told to stop ([`Stopping::requested`]), the agent
//! asks the broker to drain it (no new grants; what is left at the drain
//! timeout is revoked) and fires [`Stopping::drained`] once a heartbeat
//! lists no lease here.

use std::cell::{Cell, OnceCell, RefCell};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rgpu_broker_client::client::ANSWER_WAIT;
use rgpu_broker_client::now_ms;
use rgpu_broker_client::rpc::{self, CONNECT_TIMEOUT};
use rgpu_protocol::auth::register_message;
use rgpu_protocol::broker_capnp::{broker, server_agent, OrderKind};
use rgpu_protocol::token::sign_bytes;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::config::Labels;
use crate::metering::{LinkRate, Usage};
use crate::service::Service;

pub struct Agent {
    /// One broker address, or several (replicas) comma-separated.
    pub broker: String,
    addrs: Vec<String>,
    /// The address to try next: the leader a follower named, else the
    /// next of `addrs`.
    redirect: RefCell<Option<String>>,
    next: Cell<usize>,
    /// The last session registered (so the next try needs no backoff).
    registered: Cell<bool>,
    /// Our id at the broker: the address clients reach us on.
    pub server_id: String,
    pub labels: Labels,
    pub key: Option<Vec<u8>>,
    pub stopping: Stopping,
    /// Unix ms at which the drain for stopping ends (set when asked).
    drain_deadline: OnceCell<u64>,
    /// TLS to the broker (`--tls-ca`), or plaintext (`--plaintext`).
    security: rgpu_tls::ClientSecurity,
    /// The data plane's bytes/s between heartbeats.
    link_rate: RefCell<LinkRate>,
    /// Leases being moved now, and the outcomes not yet reported.
    moves: Arc<Moves>,
    /// The devices' health as the broker was last told.
    health: RefCell<crate::health::Reported>,
}

/// What the agent did with one order: (lease, its kind, outcome).
type Report = (u64, OrderKind, Result<(), String>);

/// Move orders from the broker, as the agent carries them out.
#[derive(Default)]
struct Moves {
    running: Mutex<HashSet<u64>>,
    /// (lease, the order's kind, outcome), oldest first.
    done: Mutex<Vec<Report>>,
}

impl Moves {
    fn running(&self) -> std::sync::MutexGuard<'_, HashSet<u64>> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn done(&self) -> std::sync::MutexGuard<'_, Vec<Report>> {
        self.done.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Orders taken from one reply, and outcomes sent in one heartbeat (the
/// broker reads no more).
const MAX_MOVE_ORDERS: usize = 16;
/// Device health changes sent in one heartbeat (the broker reads no more).
const MAX_HEALTH_REPORTS: usize = 256;
/// How long a moved session may take to come to rest between requests.
const MOVE_QUIESCE: Duration = Duration::from_secs(10);
/// Passes over a lease's sessions: one opened while the others moved is
/// moved on the next.
const MOVE_PASSES: usize = 3;

/// The drain a stopping server does first.
#[derive(Clone, Default)]
pub struct Stopping {
    /// Fired when the server is told to stop (SIGTERM).
    pub requested: CancellationToken,
    /// Fired by the agent when the broker lists no lease on this server
    /// after the drain.
    pub drained: CancellationToken,
    pub timeout: Duration,
}

impl Agent {
    pub fn new(broker: String, server_id: String, labels: Labels, key: Option<Vec<u8>>, stopping: Stopping) -> Self {
        let addrs: Vec<String> = broker.split(',').map(str::trim).filter(|a| !a.is_empty()).map(String::from).collect();
        Agent {
            broker,
            addrs,
            redirect: RefCell::new(None),
            next: Cell::new(0),
            registered: Cell::new(false),
            server_id,
            labels,
            key,
            stopping,
            drain_deadline: OnceCell::new(),
            security: rgpu_tls::ClientSecurity::Plaintext,
            link_rate: RefCell::new(LinkRate::default()),
            moves: Arc::default(),
            health: RefCell::default(),
        }
    }

    pub fn with_security(mut self, security: rgpu_tls::ClientSecurity) -> Self {
        self.security = security;
        self
    }

    /// Asks the broker to drain this server for its stop.
    async fn ask_drain(&self, agent: &server_agent::Client) -> Result<(), String> {
        let deadline = *self.drain_deadline.get_or_init(|| now_ms() + self.stopping.timeout.as_millis() as u64);
        let mut req = agent.drain_for_shutdown_request();
        req.get().set_deadline_ms(deadline);
        tokio::time::timeout(ANSWER_WAIT, req.send().promise)
            .await
            .map_err(|_| format!("drain for shutdown: the broker did not answer within {} s", ANSWER_WAIT.as_secs()))?
            .map_err(|e| format!("drain for shutdown: {e}"))?;
        info!(broker = %self.broker, id = %self.server_id, deadline_ms = deadline,
            "stopping: drained at the broker (no new leases here); waiting for the leases here to end");
        Ok(())
    }

    /// Runs until `shutdown`. Must run inside a `LocalSet`.
    pub async fn run(self, service: Arc<Service>, shutdown: CancellationToken) {
        let mut backoff = Duration::from_millis(200);
        loop {
            let r = tokio::select! {
                _ = shutdown.cancelled() => return,
                r = self.session(&service) => r,
            };
            if self.registered.replace(false) {
                backoff = Duration::from_millis(200);
            }
            let mut pause = backoff;
            if let Err(e) = r {
                match leader_named(&e) {
                    Some(l) => {
                        debug!(leader = %l, "the broker follows; going to its leader");
                        *self.redirect.borrow_mut() = Some(l);
                        pause = Duration::from_millis(20);
                    }
                    None => {
                        self.next.set((self.next.get() + 1) % self.addrs.len().max(1));
                        if self.addrs.len() > 1 {
                            pause = Duration::from_millis(50);
                        }
                    }
                }
                warn!(broker = %self.broker, "broker connection: {e}; retrying in {} ms", pause.as_millis());
            }
            // Sessions whose deadline passed while the broker is away.
            close(&service, service.leases.expired(now_ms()));
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(pause) => {}
            }
            if pause == backoff {
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }

    async fn session(&self, service: &Arc<Service>) -> Result<(), String> {
        let addr = match self.redirect.borrow_mut().take() {
            Some(a) => a,
            None => self.addrs.get(self.next.get()).cloned().unwrap_or_default(),
        };
        let conn = rpc::connect::<broker::Client>(&addr, &self.security, CONNECT_TIMEOUT)
            .await
            .map_err(|e| format!("{addr}: {e}"))?;
        // Dropping `conn` on the way out closes the connection.
        self.talk(conn.client(), service).await.map_err(|e| {
            if conn.refused_for_tls() {
                rgpu_tls::TlsError::ServerWantsTls { addr: addr.clone() }.to_string()
            } else {
                e
            }
        })
    }

    /// Registers, or fails once the broker has not answered for
    /// [`ANSWER_WAIT`]: a broker frozen or cut off without its connection
    /// breaking must not keep this server from the others.
    async fn register(&self, client: &broker::Client, service: &Service) -> Result<(server_agent::Client, u64), String> {
        tokio::time::timeout(ANSWER_WAIT, self.register_once(client, service))
            .await
            .map_err(|_| format!("the broker did not answer the registration within {} s", ANSWER_WAIT.as_secs()))?
    }

    async fn register_once(&self, client: &broker::Client, service: &Service) -> Result<(server_agent::Client, u64), String> {
        let Some(key) = &self.key else {
            return Err("registering needs the broker's key (--broker-key-file)".into());
        };
        let devices = service.backend.devices();
        let health = service.backend.health();
        let reply = client.challenge_request().send().promise.await.map_err(|e| e.to_string())?;
        let nonce = reply.get().and_then(|r| r.get_nonce()).map_err(|e| e.to_string())?.to_vec();
        let mut req = client.register_request();
        {
            let mut s = req.get().init_server();
            s.set_id(&self.server_id);
            s.set_node(&self.labels.node);
            s.set_leaf(&self.labels.leaf);
            s.set_spine(&self.labels.spine);
            s.set_link_bandwidth(self.labels.link_bandwidth.unwrap_or(0));
            let mut p = s.reborrow().init_partitions(self.labels.partitions.len() as u32);
            for (i, x) in self.labels.partitions.iter().enumerate() {
                p.set(i as u32, x);
            }
            let transports = service.data_plane.offered();
            let mut t = s.reborrow().init_transports(transports.len() as u32);
            for (i, x) in transports.iter().enumerate() {
                t.set(i as u32, x);
            }
            let mut gs = s.init_gpus(devices.len() as u32);
            for (i, d) in devices.iter().enumerate() {
                let mut g = gs.reborrow().get(i as u32);
                g.set_uuid(&d.uuid);
                g.set_ordinal(d.ordinal);
                g.set_model(&d.name);
                g.set_memory(d.total_mem);
                g.set_sms(d.attributes.iter().find(|a| a.0 == 16).map_or(0, |a| a.1.max(0) as u32));
                let h = health.get(i).cloned().unwrap_or_else(crate::health::DeviceHealth::healthy);
                g.set_healthy(h.healthy);
                g.set_health_reason(&h.reason);
            }
        }
        let msg = register_message(&nonce, req.get().get_server().map_err(|e| e.to_string())?.into_reader())
            .map_err(|e| e.to_string())?;
        req.get().set_nonce(&nonce);
        req.get().set_proof(&sign_bytes(key, &msg));
        let reply = req.send().promise.await.map_err(|e| e.to_string())?;
        let r = reply.get().map_err(|e| e.to_string())?;
        let (hb, agent) = (r.get_heartbeat_ms(), r.get_agent().map_err(|e| e.to_string())?);
        let unhealthy = health.iter().filter(|h| !h.healthy).count();
        info!(broker = %self.broker, id = %self.server_id, gpus = devices.len(), unhealthy, "registered with the broker");
        self.health.borrow_mut().registered(health);
        Ok((agent, u64::from(hb).max(50)))
    }

    async fn talk(&self, client: &broker::Client, service: &Arc<Service>) -> Result<(), String> {
        let (mut agent, hb) = self.register(client, service).await?;
        self.registered.set(true);
        let mut every = Duration::from_millis(hb);
        // Registering ends a drain for shutdown: ask again on each (re)registration.
        let mut drain_asked = false;
        loop {
            if !drain_asked && self.stopping.requested.is_cancelled() {
                self.ask_drain(&agent).await?;
                drain_asked = true;
            }
            let mut req = agent.heartbeat_request();
            report_usage(service, req.get(), &mut self.link_rate.borrow_mut());
            let reported: Vec<Report> = self.moves.done().iter().take(MAX_MOVE_ORDERS).cloned().collect();
            {
                let mut list = req.get().init_moved(reported.len() as u32);
                for (i, (lease, kind, r)) in reported.iter().enumerate() {
                    let mut m = list.reborrow().get(i as u32);
                    m.set_lease(*lease);
                    m.set_kind(*kind);
                    m.set_ok(r.is_ok());
                    if let Err(why) = r {
                        m.set_reason(why);
                    }
                }
            }
            let health = self.health.borrow().changes(&service.backend.health());
            {
                let mut list = req.get().init_health(health.len().min(MAX_HEALTH_REPORTS) as u32);
                for (i, (ordinal, h)) in health.iter().take(MAX_HEALTH_REPORTS).enumerate() {
                    let mut x = list.reborrow().get(i as u32);
                    x.set_ordinal(*ordinal);
                    x.set_healthy(h.healthy);
                    x.set_reason(&h.reason);
                    if h.healthy {
                        info!(gpu = ordinal, "device healthy again: telling the broker");
                    } else {
                        warn!(gpu = ordinal, reason = %h.reason, "device unhealthy: telling the broker (its leases move elsewhere)");
                    }
                }
            }
            let reply = tokio::time::timeout(every * 3, req.send().promise)
                .await
                .map_err(|_| "heartbeat unanswered".to_string())?
                .map_err(|e| e.to_string())?;
            let r = reply.get().map_err(|e| e.to_string())?;
            self.health.borrow_mut().sent(&health[..health.len().min(MAX_HEALTH_REPORTS)]);
            // Reported: the broker has placed those leases where they are.
            self.moves.done().drain(..reported.len());
            for (lease, _, _) in &reported {
                self.moves.running().remove(lease);
                service.leases.end_move(*lease);
            }
            if !r.get_known() {
                let (a, hb) = self.register(client, service).await?;
                (agent, every) = (a, Duration::from_millis(hb));
                drain_asked = false;
                continue;
            }
            let mut live = HashMap::new();
            for l in r.get_leases().map_err(|e| e.to_string())?.iter() {
                live.insert(l.get_id(), (l.get_generation(), l.get_deadline_ms()));
            }
            service.meters.retain_leases(|l| live.contains_key(&l));
            let unparked = service.sessions.unpark_ended(|l| live.contains_key(&l));
            if !unparked.is_empty() {
                info!(sessions = unparked.len(), "checkpointed sessions' leases ended: their clients stop waiting for a restore");
            }
            let n = live.len();
            let closing = service.leases.update(live, r.get_generation_floor(), now_ms());
            debug!(live = n, closing = closing.len(), "heartbeat");
            close(service, closing);
            let ended = service.leases.suspended_unlisted();
            if !ended.is_empty() {
                crate::preemption::forget(service, ended);
            }
            self.take_orders(service, r.get_moves().map_err(|e| e.to_string())?);
            if drain_asked && n == 0 {
                self.stopping.drained.cancel();
            }
            // While draining, look often: the stop waits on it.
            let pause = if drain_asked { every.min(Duration::from_millis(100)) } else { every };
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = self.stopping.requested.cancelled(), if !drain_asked => {}
            }
        }
    }
}

impl Agent {
    /// Starts the moves a heartbeat reply orders (each lease once).
    fn take_orders(&self, service: &Arc<Service>, orders: capnp::struct_list::Reader<'_, rgpu_protocol::broker_capnp::move_order::Owned>) {
        for o in orders.iter().take(MAX_MOVE_ORDERS) {
            let lease = o.get_lease();
            if self.moves.running().contains(&lease) {
                continue;
            }
            let kind = o.get_kind().unwrap_or(OrderKind::Migrate);
            if kind != OrderKind::Migrate {
                self.moves.running().insert(lease);
                let (service, moves) = (service.clone(), self.moves.clone());
                tokio::task::spawn_local(async move {
                    let resume = kind == OrderKind::Resume;
                    let r = if resume {
                        crate::preemption::resume_lease(&service, lease).await
                    } else {
                        info!(lease = format_args!("{lease:#x}"), "the broker preempts a lease: suspending its sessions to disk");
                        crate::preemption::suspend_lease(&service, lease).await
                    };
                    if let Err(e) = &r {
                        let what = if resume { "resumed" } else { "suspended" };
                        warn!(lease = format_args!("{lease:#x}"), "lease not {what}: {e}");
                    }
                    moves.done().push((lease, kind, r.map(|_| ())));
                });
                continue;
            }
            let target = o.get_target().ok().and_then(|t| t.to_str().ok()).unwrap_or("").to_string();
            self.moves.running().insert(lease);
            let refused = if !crate::migration::valid_target(&target) {
                Some(format!("{target:?} is not a server address"))
            } else if target == self.server_id {
                Some("the target is this server".to_string())
            } else if !service.leases.order_move(lease, o.get_generation(), &target) {
                Some("too many moves in flight on this server".to_string())
            } else {
                None
            };
            if let Some(why) = refused {
                warn!(lease = format_args!("{lease:#x}"), %target, "move refused: {why}");
                self.moves.done().push((lease, OrderKind::Migrate, Err(why)));
                continue;
            }
            info!(lease = format_args!("{lease:#x}"), %target, "the broker moves a lease: migrating its sessions");
            let (service, moves) = (service.clone(), self.moves.clone());
            tokio::task::spawn_local(async move {
                let r = move_lease(&service, lease, &target).await;
                match &r {
                    Ok(n) => info!(lease = format_args!("{lease:#x}"), %target, sessions = n, "lease moved"),
                    Err(e) => warn!(lease = format_args!("{lease:#x}"), %target, "lease not moved: {e}"),
                }
                moves.done().push((lease, OrderKind::Migrate, r.map(|_| ())));
            });
        }
    }
}

/// Migrates every session of `lease` here to `target`; how many it handled
/// (moved, or ended meanwhile).
/// A session that failed to move stays here (and the lease with it).
async fn move_lease(service: &Arc<Service>, lease: u64, target: &str) -> Result<usize, String> {
    use crate::migration::MigrateError;
    use crate::relocate::OpError;
    // A session moved (or ended) stays bound here until its thread has
    // ended, shortly after: it is not one to move again.
    let mut done = HashSet::new();
    let left = |done: &HashSet<u64>| -> Vec<u64> {
        service.leases.sessions_of(lease).into_iter().filter(|s| !done.contains(s)).collect()
    };
    // Every session first: one that could never move fails the move before
    // any other has gone (a lease half moved ends the moved half).
    for s in left(&done) {
        match crate::migration::precheck(service, s).await {
            Ok(()) | Err(MigrateError::Op(OpError::NoSession(_) | OpError::Ended(_))) => {}
            Err(e) => return Err(format!("session {s:#x}: {e}; no session of the lease moved")),
        }
    }
    for _ in 0..MOVE_PASSES {
        let sessions = left(&done);
        if sessions.is_empty() {
            break;
        }
        for s in sessions {
            match crate::migration::migrate(service, s, target, MOVE_QUIESCE).await {
                Ok(_) => {}
                // It ended meanwhile: nothing left to move.
                Err(MigrateError::Op(OpError::NoSession(_) | OpError::Ended(_))) => {}
                Err(e) => return Err(format!("session {s:#x}: {e}")),
            }
            done.insert(s);
        }
    }
    match left(&done).len() {
        0 => Ok(done.len()),
        n => Err(format!("{n} session(s) of the lease opened here while it moved")),
    }
}

/// The leader a `[not-leader]` refusal names.
fn leader_named(e: &str) -> Option<String> {
    if !e.contains("[not-leader]") {
        return None;
    }
    e.split("the leader is at ").nth(1).and_then(|r| r.split_whitespace().next()).map(String::from)
}

/// What each lease with sessions here used, and this server in all, into
/// a heartbeat.
fn report_usage(service: &Service, mut hb: server_agent::heartbeat_params::Builder<'_>, rate: &mut LinkRate) {
    let write = |mut w: rgpu_protocol::broker_capnp::usage::Builder<'_>, lease: u64, u: &Usage| {
        w.set_lease(lease);
        w.set_kernels(u.kernels);
        w.set_kernel_timed(u.kernel_ns.is_some());
        w.set_kernel_ns(u.kernel_ns.unwrap_or(0));
        w.set_bytes_in(u.bytes_in);
        w.set_bytes_out(u.bytes_out);
        w.set_memory(u.memory);
        w.set_memory_peak(u.memory_peak);
    };
    let by_lease = service.meters.by_lease();
    let mut list = hb.reborrow().init_usage(by_lease.len() as u32);
    for (i, (lease, u)) in by_lease.iter().enumerate() {
        write(list.reborrow().get(i as u32), *lease, u);
    }
    let total = service.meters.total(service.backend.kernel_times_known());
    write(hb.reborrow().init_total(), 0, &total);
    // The first heartbeat has no interval behind it: no load yet.
    if let Some((bytes_in, bytes_out)) = rate.sample(std::time::Instant::now(), total.bytes_in, total.bytes_out) {
        let mut l = hb.init_load();
        l.set_bytes_in_per_s(bytes_in);
        l.set_bytes_out_per_s(bytes_out);
    }
}

fn close(service: &Service, sessions: Vec<u64>) {
    for s in sessions {
        if service.sessions.close(s) {
            info!(session = format_args!("{s:#x}"), "lease ended: session closed");
        }
    }
}
