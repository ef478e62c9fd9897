//! The replicated store: the broker's state in an etcd cluster that several
//! brokers share (`--store etcd://HOST:PORT,.../PREFIX`).
//!
//! **Election.** A broker leads while it holds the key `PREFIX/leader`,
//! created in a transaction that succeeds only if the key does not exist,
//! with an etcd lease of `--leader-ttl` seconds that the leader keeps alive
//! (every third of the TTL). Its value is the leader's advertised address,
//! which followers give clients. A broker killed stops renewing: etcd
//! deletes the key when the lease lapses, the followers' watches see the
//! deletion, and they campaign again; the winner reads the whole state
//! back (a linearizable read after its election, so it holds every write
//! an earlier leader acknowledged) and serves.
//!
//! **Fencing.** The term of a leadership is the revision of the
//! transaction that created the leader key. Every write is one transaction
//! guarded by `create_revision(PREFIX/leader) == term`: once the key lapsed
//! or another broker created it, a deposed leader's writes fail and it
//! stops serving, whatever its clock or its view of its lease says. A new
//! leader's lease generations start above every stored one and above its
//! term, so they also grow across leaders.
//!
//! **What goes through etcd.** Exactly what the redb store keeps (see the
//! parent module), each change before the client hears of it. Heartbeats,
//! server reachability, the queue and request rates stay in the leader's
//! memory: after a failover every server counts as heard from at the
//! election and must heartbeat the new leader within its usual allowance
//! (it re-registers at once when its connection drops). The audit log
//! stays in each broker's data directory.
//!
//! Layout under PREFIX: `leader`, `generation`, `server/ID`,
//! `lease/ID` (16 hex digits), `revoked/TENANT`, `usage/ID` (an ended
//! lease's accounting record); values are JSON or a decimal number.
//! Accounting records are never pruned here yet: a pool that ends millions
//! of leases needs them moved out before etcd's space quota (2 GiB by
//! default, about 300 bytes a record).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp, WatchOptions};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use tracing::{info, warn};

use super::{Leadership, Loaded, Store, StoreError, Tenure, Term, NOT_LEADING};
use crate::inventory::{Drain, ServerSpec};
use crate::state::Change;

/// etcd refuses transactions of more operations than its `--max-txn-ops`
/// (128 by default): a larger commit is split, in order.
const MAX_OPS: usize = 120;
/// How long one etcd request may take before the write counts as failed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Every write adds a revision to etcd's history, which etcd keeps until
/// it is compacted (and refuses writes once its space quota is full): the
/// leader compacts all but the newest [`HISTORY_KEPT`] revisions every
/// [`COMPACT_EVERY`].
const COMPACT_EVERY: Duration = Duration::from_secs(60);
const HISTORY_KEPT: i64 = 10_000;
/// A full state of 10,000 servers and leases is a few MiB: above tonic's
/// default 4 MiB bound on a reply.
const MAX_REPLY: usize = 256 << 20;

/// Where the pool lives in etcd and how this broker campaigns.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    pub endpoints: Vec<String>,
    pub prefix: String,
    /// The address followers send clients to while this broker leads.
    pub advertise: String,
    pub ttl_s: u64,
}

#[derive(Clone)]
struct Keys {
    prefix: String,
}

impl Keys {
    fn data(&self) -> String {
        format!("{}/", self.prefix)
    }
    fn leader(&self) -> String {
        format!("{}/leader", self.prefix)
    }
    fn generation(&self) -> String {
        format!("{}/generation", self.prefix)
    }
    fn server(&self, id: &str) -> String {
        format!("{}/server/{id}", self.prefix)
    }
    fn lease(&self, id: u64) -> String {
        format!("{}/lease/{id:016x}", self.prefix)
    }
    fn revoked(&self, tenant: &str) -> String {
        format!("{}/revoked/{tenant}", self.prefix)
    }
    fn usage(&self, lease: u64) -> String {
        format!("{}/usage/{lease:016x}", self.prefix)
    }
}

#[derive(Serialize, Deserialize)]
struct StoredServer {
    spec: ServerSpec,
    drain: Option<Drain>,
}

/// What the writer and the election share: the etcd connection, and the
/// term whose write etcd refused (another broker leads).
struct Shared {
    client: Client,
    keys: Keys,
    rt: Arc<tokio::runtime::Runtime>,
    deposed_term: AtomicU64,
    deposed: Notify,
    /// Set when the broker stops: lead no more, campaign no more.
    resigning: std::sync::atomic::AtomicBool,
    resign: Notify,
    /// Told once a leader that resigned has given its leader key up.
    resigned: std::sync::Mutex<Option<std::sync::mpsc::Sender<()>>>,
    what: String,
}

impl Shared {
    fn err(&self, e: impl std::fmt::Display) -> StoreError {
        StoreError { path: self.what.clone(), reason: e.to_string() }
    }

    async fn load(&self) -> Result<Loaded, StoreError> {
        let mut kv = self.client.kv_client().max_decoding_message_size(MAX_REPLY);
        let data = self.keys.data();
        let r = tokio::time::timeout(REQUEST_TIMEOUT, kv.get(data.as_str(), Some(GetOptions::new().with_prefix())))
            .await
            .map_err(|_| self.err("etcd did not answer the read of the state"))?
            .map_err(|e| self.err(e))?;
        let mut out = Loaded { servers: Vec::new(), leases: Vec::new(), generation: 0, revoked: HashMap::new(), usage: Vec::new() };
        for kv in r.kvs() {
            let key = kv.key_str().map_err(|e| self.err(e))?;
            let Some(rel) = key.strip_prefix(data.as_str()) else { continue };
            let value = kv.value();
            let number = || -> Result<u64, StoreError> {
                std::str::from_utf8(value).ok().and_then(|v| v.trim().parse().ok()).ok_or_else(|| self.err(format!("{key}: not a number")))
            };
            if let Some(_id) = rel.strip_prefix("server/") {
                let s: StoredServer = serde_json::from_slice(value).map_err(|e| self.err(format!("{key}: {e}")))?;
                out.servers.push((s.spec, s.drain));
            } else if rel.starts_with("lease/") {
                out.leases.push(serde_json::from_slice(value).map_err(|e| self.err(format!("{key}: {e}")))?);
            } else if let Some(tenant) = rel.strip_prefix("revoked/") {
                out.revoked.insert(tenant.to_string(), number()?);
            } else if rel.starts_with("usage/") {
                out.usage.push(serde_json::from_slice(value).map_err(|e| self.err(format!("{key}: {e}")))?);
            } else if rel == "generation" {
                out.generation = number()?;
            }
        }
        Ok(out)
    }

    /// One fenced transaction of at most [`MAX_OPS`] operations.
    fn commit(&self, ops: &[(String, Option<Vec<u8>>)], term: Term) -> Result<(), StoreError> {
        let txn = Txn::new()
            .when([Compare::create_revision(self.keys.leader(), CompareOp::Equal, term as i64)])
            .and_then(
                ops.iter()
                    .map(|(k, v)| match v {
                        Some(v) => TxnOp::put(k.as_str(), v.clone(), None),
                        None => TxnOp::delete(k.as_str(), None),
                    })
                    .collect::<Vec<_>>(),
            );
        let mut kv = self.client.kv_client();
        let r = self
            .rt
            // The timer must be made inside the runtime.
            .block_on(async { tokio::time::timeout(REQUEST_TIMEOUT, kv.txn(txn)).await })
            .map_err(|_| self.err(format!("etcd did not answer a write within {} s", REQUEST_TIMEOUT.as_secs())))?
            .map_err(|e| self.err(e))?;
        if !r.succeeded() {
            self.deposed_term.store(term, Ordering::SeqCst);
            self.deposed.notify_one();
            return Err(self.err(format!("{NOT_LEADING} (its leader key lapsed or another broker was elected)")));
        }
        Ok(())
    }

    fn encode(&self, c: &Change) -> Result<(String, Option<Vec<u8>>), StoreError> {
        Ok(match c {
            Change::Server { spec, drain } => {
                let v = serde_json::to_vec(&StoredServer { spec: spec.clone(), drain: *drain }).map_err(|e| self.err(e))?;
                (self.keys.server(&spec.id), Some(v))
            }
            Change::Lease(l) => (self.keys.lease(l.id), Some(serde_json::to_vec(l).map_err(|e| self.err(e))?)),
            Change::LeaseGone(id) => (self.keys.lease(*id), None),
            Change::Generation(g) => (self.keys.generation(), Some(g.to_string().into_bytes())),
            Change::Revocation { tenant, before } => (self.keys.revoked(tenant), Some(before.to_string().into_bytes())),
            Change::Usage(r) => (self.keys.usage(r.lease), Some(serde_json::to_vec(r).map_err(|e| self.err(e))?)),
        })
    }
}

/// The writer's side (see [`Store`]); [`Replica`] is the election's.
pub struct EtcdStore {
    shared: Arc<Shared>,
}

impl Store for EtcdStore {
    /// Not from inside a tokio runtime (it blocks on the store's own).
    fn load(&self) -> Result<Loaded, StoreError> {
        self.shared.rt.block_on(self.shared.load())
    }

    /// In order; one transaction per [`MAX_OPS`] keys (a key written twice
    /// in one transaction is written once, with its last value), each
    /// refused unless `term` still leads.
    fn apply(&self, changes: &[Change], term: Term) -> Result<(), StoreError> {
        if term == 0 {
            return Err(self.shared.err(NOT_LEADING));
        }
        let mut ops: Vec<(String, Option<Vec<u8>>)> = Vec::new();
        let mut at: HashMap<String, usize> = HashMap::new();
        for c in changes {
            let (k, v) = self.shared.encode(c)?;
            if let Some(&i) = at.get(&k) {
                ops[i].1 = v;
                continue;
            }
            if ops.len() == MAX_OPS {
                self.shared.commit(&ops, term)?;
                ops.clear();
                at.clear();
            }
            at.insert(k.clone(), ops.len());
            ops.push((k, v));
        }
        if !ops.is_empty() {
            self.shared.commit(&ops, term)?;
        }
        Ok(())
    }
}

/// The election: campaigns, leads, follows; tells the service each change.
pub struct Replica {
    shared: Arc<Shared>,
    config: EtcdConfig,
}

/// Connects to the cluster (within a few seconds, or fails).
pub fn connect(config: EtcdConfig) -> Result<(EtcdStore, Replica), StoreError> {
    let what = format!("etcd://{}{}", config.endpoints.join(","), config.prefix);
    let err = |e: &dyn std::fmt::Display| StoreError { path: what.clone(), reason: e.to_string() };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("rgpu-broker-etcd")
        .enable_all()
        .build()
        .map_err(|e| err(&e))?;
    let options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(2))
        .with_keep_alive(Duration::from_secs(1), Duration::from_secs(2));
    let client = rt
        .block_on(async { tokio::time::timeout(REQUEST_TIMEOUT, Client::connect(&config.endpoints, Some(options))).await })
        .map_err(|_| err(&"no etcd member answered"))?
        .map_err(|e| err(&e))?;
    let shared = Arc::new(Shared {
        client,
        keys: Keys { prefix: config.prefix.clone() },
        rt: Arc::new(rt),
        deposed_term: AtomicU64::new(0),
        deposed: Notify::new(),
        resigning: std::sync::atomic::AtomicBool::new(false),
        resign: Notify::new(),
        resigned: std::sync::Mutex::new(None),
        what,
    });
    Ok((EtcdStore { shared: shared.clone() }, Replica { shared, config }))
}

/// Ends this broker's part in the election (see [`Resign::resign`]).
pub struct Resign {
    shared: Arc<Shared>,
}

impl Resign {
    /// Stops campaigning and, if leading, gives the leader key up (its
    /// lease revoked: the followers campaign at once); waits for that at
    /// most `wait`.
    pub fn resign(&self, wait: Duration) {
        let (tx, rx) = std::sync::mpsc::channel();
        *self.shared.resigned.lock().unwrap_or_else(|p| p.into_inner()) = Some(tx);
        self.shared.resigning.store(true, Ordering::SeqCst);
        self.shared.resign.notify_one();
        let _ = rx.recv_timeout(wait);
    }
}

impl Replica {
    /// Runs the election on the store's runtime from now on; `on_role` is
    /// called at each change of leadership (first: who leads now).
    pub fn start(self, on_role: impl Fn(Leadership) + Send + Sync + 'static) -> Resign {
        let rt = self.shared.rt.clone();
        let resign = Resign { shared: self.shared.clone() };
        rt.spawn(async move {
            let mut leading = false;
            loop {
                if self.shared.resigning.load(Ordering::SeqCst) {
                    on_role(Leadership::Follower { leader: None });
                    if let Some(tx) = self.shared.resigned.lock().unwrap_or_else(|p| p.into_inner()).take() {
                        let _ = tx.send(());
                    }
                    return;
                }
                if let Err(e) = self.round(&on_role, &mut leading).await {
                    warn!(store = %self.shared.what, "etcd: {e}; trying again");
                    if leading {
                        on_role(Leadership::Follower { leader: None });
                        leading = false;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        });
        resign
    }

    /// Follows until no broker leads, then campaigns; if elected, leads
    /// until the leadership is lost.
    async fn round(&self, on_role: &(impl Fn(Leadership) + Send + Sync), leading: &mut bool) -> Result<(), String> {
        let s = &self.shared;
        let leader_key = s.keys.leader();
        let mut kv = s.client.kv_client();
        let e = |e: etcd_client::Error| e.to_string();
        let r = tokio::time::timeout(REQUEST_TIMEOUT, kv.get(leader_key.as_str(), None)).await.map_err(|_| "timed out")?.map_err(e)?;
        if let Some(cur) = r.kvs().first() {
            let addr = String::from_utf8_lossy(cur.value()).to_string();
            // Our own address: the key of this broker before a restart,
            // waiting for its lease to lapse; nobody serves until then.
            let leader = Some(addr.clone()).filter(|a| *a != self.config.advertise);
            on_role(Leadership::Follower { leader });
            info!(leader = %addr, "following");
            let from = r.header().map_or(0, |h| h.revision()) + 1;
            return tokio::select! {
                r = self.until_deleted(&leader_key, from) => r,
                _ = s.resign.notified() => Ok(()),
            };
        }
        if s.resigning.load(Ordering::SeqCst) {
            return Ok(());
        }
        let mut leases = s.client.lease_client();
        // The lease's TTL runs from when etcd granted it, after this.
        let asked = Instant::now();
        let lease = leases.grant(self.config.ttl_s as i64, None).await.map_err(e)?.id();
        let put = TxnOp::put(leader_key.as_str(), self.config.advertise.as_str(), Some(PutOptions::new().with_lease(lease)));
        let txn = Txn::new().when([Compare::create_revision(leader_key.as_str(), CompareOp::Equal, 0)]).and_then([put]);
        let won = tokio::time::timeout(REQUEST_TIMEOUT, kv.txn(txn)).await.map_err(|_| "timed out".to_string()).and_then(|r| r.map_err(e));
        let r = match won {
            Ok(r) if r.succeeded() => r,
            other => {
                // Another broker was first (the next round follows it).
                let _ = leases.revoke(lease).await;
                return other.map(|_| ());
            }
        };
        let term = r.header().map_or(0, |h| h.revision()) as Term;
        let loaded = match s.load().await {
            Ok(l) => l,
            Err(err) => {
                let _ = leases.revoke(lease).await;
                return Err(err.to_string());
            }
        };
        info!(term, servers = loaded.servers.len(), leases = loaded.leases.len(), "elected: leading");
        let tenure = Tenure::until(asked + Duration::from_secs(self.config.ttl_s));
        on_role(Leadership::Leader { term, loaded, tenure: tenure.clone() });
        *leading = true;
        let why = self.hold(lease, term, &tenure).await;
        on_role(Leadership::Follower { leader: None });
        *leading = false;
        warn!(term, "stopped leading: {why}");
        let _ = tokio::time::timeout(Duration::from_millis(500), leases.revoke(lease)).await;
        Ok(())
    }

    /// Returns once the leader key is deleted at or after revision `from`.
    async fn until_deleted(&self, key: &str, from: i64) -> Result<(), String> {
        let mut w = self.shared.client.watch_client();
        let mut stream = w.watch(key, Some(WatchOptions::new().with_start_revision(from))).await.map_err(|e| e.to_string())?;
        loop {
            match stream.message().await.map_err(|e| e.to_string())? {
                Some(r) if r.canceled() => return Ok(()),
                Some(r) => {
                    if r.events().iter().any(|ev| ev.event_type() == EventType::Delete) {
                        return Ok(());
                    }
                }
                None => return Ok(()),
            }
        }
    }

    /// Drops the history older than [`HISTORY_KEPT`] revisions (a
    /// follower's watch from before that is cancelled and started again).
    async fn compact(&self) {
        let mut kv = self.shared.client.kv_client();
        let now = match tokio::time::timeout(REQUEST_TIMEOUT, kv.get(self.shared.keys.leader(), None)).await {
            Ok(Ok(r)) => r.header().map_or(0, |h| h.revision()),
            _ => return,
        };
        if now > HISTORY_KEPT {
            if let Ok(Err(e)) = tokio::time::timeout(REQUEST_TIMEOUT, kv.compact(now - HISTORY_KEPT, None)).await {
                warn!("etcd compaction to revision {}: {e}", now - HISTORY_KEPT);
            }
        }
    }

    /// Keeps the lease alive while this broker leads; returns why it stopped.
    async fn hold(&self, lease: i64, term: Term, tenure: &Tenure) -> String {
        let s = &self.shared;
        let ttl = Duration::from_secs(self.config.ttl_s);
        let mut leases = s.client.lease_client();
        let (mut keeper, mut replies) = match leases.keep_alive(lease).await {
            Ok(k) => k,
            Err(e) => return format!("cannot keep the leader lease alive: {e}"),
        };
        let mut w = s.client.watch_client();
        let mut changes = match w.watch(s.keys.leader(), Some(WatchOptions::new().with_start_revision(term as i64 + 1))).await {
            Ok(w) => w,
            Err(e) => return format!("cannot watch the leader key: {e}"),
        };
        // The lease lives `ttl` past the renewal etcd last confirmed, which
        // was sent no earlier than this.
        let mut confirmed = Instant::now();
        let mut sent = Instant::now();
        let mut every = tokio::time::interval(ttl / 3);
        let mut compact = tokio::time::interval(COMPACT_EVERY);
        compact.tick().await;
        loop {
            tokio::select! {
                _ = compact.tick() => self.compact().await,
                _ = every.tick() => {
                    if confirmed.elapsed() >= ttl {
                        return format!("etcd confirmed no renewal of the leader lease for {} s", ttl.as_secs());
                    }
                    sent = Instant::now();
                    if let Err(e) = keeper.keep_alive().await {
                        return format!("renewing the leader lease: {e}");
                    }
                }
                m = replies.message() => match m {
                    Ok(Some(r)) if r.ttl() > 0 => {
                        confirmed = sent;
                        tenure.extend(sent + ttl);
                    }
                    Ok(Some(_)) => return "the leader lease expired".into(),
                    Ok(None) => return "the lease renewal stream ended".into(),
                    Err(e) => return format!("renewing the leader lease: {e}"),
                },
                m = changes.message() => match m {
                    Ok(Some(r)) if r.events().is_empty() && !r.canceled() => {}
                    Ok(Some(_)) => return "the leader key changed".into(),
                    Ok(None) => return "the leader key's watch ended".into(),
                    Err(e) => return format!("watching the leader key: {e}"),
                },
                _ = s.resign.notified() => return "the broker is stopping: resigned".into(),
                _ = s.deposed.notified() => {
                    if s.deposed_term.load(Ordering::SeqCst) == term {
                        return "etcd refused a write: another broker leads".into();
                    }
                }
            }
        }
    }
}
