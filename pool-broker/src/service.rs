//! Orchestration: lock the state, make one state-machine call, hand its
//! changes to the store writer, and answer only once they are durable.
//! With a replicated store only the leader serves: a follower refuses every
//! call past `version` and `challenge` with `[not-leader]` and the leader's
//! address, and its state is replaced by the store's at each election.

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rgpu_protocol::auth::Role;
use rgpu_protocol::token::{self, Claims};
use tokio::sync::oneshot;

use crate::audit::Audit;
use crate::identity::{Credentials, Identity};
use crate::inventory::{Millis, ServerSpec};
use crate::metrics::BrokerMetrics;
use crate::rate::RateLimits;
use crate::state::{BrokerError, Change, Event, Lease, LeaseRequest, Outcome, State};
use crate::store::{Job, StoreError, Tenure, Term};
use crate::usage;

pub fn now_ms() -> Millis {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Failed logins and registrations a host may make per second (bursts of
/// twice that) before it is refused without a look.
pub const FAILURES_PER_S: u32 = 5;

/// How often the broker advances its clock ([`Service::tick`]).
pub const TICK: Duration = Duration::from_millis(100);

/// A gap between ticks past this is the broker's own stall: it is
/// credited (less one period) to every server. Crediting a tick that was
/// only late costs nothing but that lateness in noticing a silent server.
const STALLED: Duration = Duration::from_millis(250);

type Waiters = Arc<Mutex<HashMap<u64, oneshot::Sender<Result<Lease, BrokerError>>>>>;

/// Whether this broker serves.
#[derive(Debug, Clone)]
pub enum Serving {
    Leader(Tenure),
    /// Another broker leads (at this address, when known).
    Follower(Option<String>),
}

impl Serving {
    fn refusal(&self) -> Option<BrokerError> {
        match self {
            Serving::Leader(t) if t.holds() => None,
            Serving::Leader(_) => Some(BrokerError::NotLeader(
                "this broker's leadership lapsed (the store confirmed no renewal in time); try again".into(),
            )),
            Serving::Follower(Some(addr)) => {
                Some(BrokerError::NotLeader(format!("this broker follows; the leader is at {addr}")))
            }
            Serving::Follower(None) => {
                Some(BrokerError::NotLeader("no broker leads yet (an election is under way); try again".into()))
            }
        }
    }
}

pub struct Service {
    state: Mutex<State>,
    writer: mpsc::Sender<Job>,
    /// Signs lease tokens and proves GPU servers' registrations.
    key: Vec<u8>,
    /// Checks tenants' logins (derived from the admin key, else the token key).
    pub credentials: Credentials,
    pub audit: Audit,
    rates: Mutex<RateLimits>,
    /// Failed logins and registrations per peer host.
    failures: Mutex<RateLimits>,
    waiters: Waiters,
    serving: RwLock<Serving>,
    /// The store term the state was loaded under (written with the state
    /// lock held, so each commit reads the term of the state it commits).
    term: AtomicU64,
    pub started: Millis,
    pub data_dir: String,
    /// What stopping must do first (a replicated store: hand leadership on).
    on_stop: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    /// Counted as requests are served; served with `--metrics`.
    pub metrics: Arc<BrokerMetrics>,
    /// The servers' last usage reports.
    usage: Mutex<usage::Book>,
    /// Ended leases' accounting records, oldest first (the last
    /// [`RECORDS_KEPT`] in memory; the store keeps all).
    records: Mutex<VecDeque<usage::Record>>,
    /// When [`Service::tick`] last ran, or the state was made or restored
    /// (whose servers count as heard then).
    last_tick: Mutex<Option<Instant>>,
}

/// Accounting records answered from memory.
pub const RECORDS_KEPT: usize = 100_000;

impl Service {
    /// `key` signs tokens and proves servers; `credential_key` (the admin
    /// key, or `key` without one) issues tenants' credentials.
    pub fn new(
        state: State,
        writer: mpsc::Sender<Job>,
        key: Vec<u8>,
        credentials: Credentials,
        audit: Audit,
        data_dir: String,
    ) -> Arc<Service> {
        Arc::new(Service {
            state: Mutex::new(state),
            writer,
            key,
            credentials,
            audit,
            rates: Mutex::default(),
            failures: Mutex::default(),
            waiters: Arc::default(),
            serving: RwLock::new(Serving::Leader(Tenure::unbounded())),
            term: AtomicU64::new(0),
            started: now_ms(),
            data_dir,
            on_stop: Mutex::new(None),
            metrics: Arc::default(),
            usage: Mutex::default(),
            records: Mutex::default(),
            last_tick: Mutex::new(Some(Instant::now())),
        })
    }

    /// Sets what [`Service::stop`] runs.
    pub fn on_stop(&self, f: Box<dyn FnOnce() + Send>) {
        *self.on_stop.lock().unwrap_or_else(|p| p.into_inner()) = Some(f);
    }

    /// The broker is stopping (SIGTERM): a leader of replicas resigns, so
    /// that another takes over now rather than when its etcd lease lapses.
    pub fn stop(&self) {
        if let Some(f) = self.on_stop.lock().unwrap_or_else(|p| p.into_inner()).take() {
            f();
        }
    }

    /// Refuses unless this broker leads.
    pub fn serving(&self) -> Result<(), BrokerError> {
        match self.serving.read().unwrap_or_else(|p| p.into_inner()).refusal() {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }

    pub fn leads(&self) -> bool {
        self.serving().is_ok()
    }

    /// This broker leads from `term` on, with `state` (restored from the
    /// store after the election) and the store's revocations.
    pub fn lead(&self, state: State, term: Term, revoked: HashMap<String, u64>, tenure: Tenure) {
        let mut st = self.lock();
        *st = state;
        self.term.store(term, Ordering::SeqCst);
        self.credentials.replace(revoked);
        self.fail_waiters();
        *self.last_tick.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        *self.serving.write().unwrap_or_else(|p| p.into_inner()) = Serving::Leader(tenure);
    }

    /// Another broker leads (or none yet): refuse from now on. What this
    /// one had queued fails; its clients find the leader and ask again.
    pub fn follow(&self, leader: Option<String>) {
        let _st = self.lock();
        *self.serving.write().unwrap_or_else(|p| p.into_inner()) = Serving::Follower(leader);
        self.term.store(0, Ordering::SeqCst);
        self.fail_waiters();
    }

    fn fail_waiters(&self) {
        let refusal = BrokerError::NotLeader("this broker stopped leading; try again".into());
        for (_, tx) in self.waiters.lock().unwrap_or_else(|p| p.into_inner()).drain() {
            let _ = tx.send(Err(refusal.clone()));
        }
    }

    /// May `id` do what needs `need`? This broker must lead, its credential
    /// must still be valid, and each call takes one from its tenant's rate.
    pub fn authorize(&self, id: &Identity, need: Role) -> Result<(), BrokerError> {
        self.serving()?;
        self.credentials.check(id)?;
        if id.role < need {
            return Err(BrokerError::Auth(format!("{} may not do this: it needs the {} role", id.actor(), need.name())));
        }
        let rate = self.lock().quota_of(&id.tenant).max_rate;
        if !self.rates.lock().unwrap_or_else(|p| p.into_inner()).take(&id.tenant, rate, now_ms()) {
            return Err(BrokerError::Rate(format!("tenant {} is over its rate of {rate} requests per second", id.tenant)));
        }
        Ok(())
    }

    /// Refuses a login or registration from `host` while it is over
    /// [`FAILURES_PER_S`] failed ones (checked before any work is done on
    /// it, and not audited: a flood of bad proofs must not fill the log).
    pub fn may_try(&self, host: &str) -> Result<(), BrokerError> {
        if self.failures.lock().unwrap_or_else(|p| p.into_inner()).has(host, FAILURES_PER_S, now_ms()) {
            Ok(())
        } else {
            Err(BrokerError::Rate(format!("too many failed logins or registrations from {host}; try again in a second")))
        }
    }

    /// Counts a failed login or registration from `host`.
    pub fn failed(&self, host: &str) {
        self.failures.lock().unwrap_or_else(|p| p.into_inner()).take(host, FAILURES_PER_S, now_ms());
    }

    /// Revokes `tenant`'s credentials issued before `before` (at most now),
    /// durably; returns the serial now required.
    pub async fn revoke(&self, tenant: &str, before: u64) -> Result<u64, BrokerError> {
        if !rgpu_protocol::auth::valid_tenant(tenant) {
            return Err(BrokerError::Invalid(format!("{tenant:?} is not a tenant name")));
        }
        let before = self.credentials.revoke(tenant, before.min(now_ms()));
        let (tx, rx) = oneshot::channel();
        let job = Job {
            changes: vec![Change::Revocation { tenant: tenant.to_string(), before }],
            term: self.term.load(Ordering::SeqCst),
            then: Box::new(move |r| {
                let _ = tx.send(r);
            }),
        };
        if let Err(mpsc::SendError(job)) = self.writer.send(job) {
            (job.then)(Err(StoreError { path: String::new(), reason: "the store writer has stopped".into() }));
        }
        Self::durable(rx).await?;
        Ok(before)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn book(&self) -> MutexGuard<'_, usage::Book> {
        self.usage.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn kept(&self) -> MutexGuard<'_, VecDeque<usage::Record>> {
        self.records.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The accounting records the store loaded.
    pub fn restore_records(&self, mut records: Vec<usage::Record>) {
        records.sort_by_key(|r| (r.ended_ms, r.lease));
        let skip = records.len().saturating_sub(RECORDS_KEPT);
        self.kept().extend(records.into_iter().skip(skip));
    }

    /// A server's heartbeat report: what each lease used there, and it in
    /// all. Only leases the broker placed on that server are kept.
    pub fn report_usage(&self, server: &str, leases: Vec<(u64, usage::Usage)>, total: usage::Usage) {
        let ours: std::collections::HashSet<u64> = self.read(|st| {
            st.leases().filter(|l| l.gpus.iter().any(|g| g.server == server)).map(|l| l.id).collect()
        });
        self.book().report(server, leases, total, |l| ours.contains(&l));
    }

    /// A server's data-plane traffic from its heartbeat (placement's
    /// tie-break reads it: `fabric`).
    pub fn report_load(&self, server: &str, load: crate::fabric::Load) {
        self.lock().report_load(server, load);
    }

    pub fn lease_usage(&self, id: u64) -> Option<usage::Usage> {
        self.book().lease(id)
    }

    pub fn server_usage(&self, id: &str) -> Option<usage::Usage> {
        self.book().server(id)
    }

    /// Accounting for `who`: ended leases' records from `since_ms` on, then
    /// live leases so far; a user's own tenant's only, an operator's
    /// `tenant`'s (empty: all). The newest `limit`.
    pub fn usage(&self, who: &Identity, tenant: &str, since_ms: u64, limit: usize) -> Result<Vec<usage::Record>, BrokerError> {
        if who.role < Role::Operator && !tenant.is_empty() && tenant != who.tenant {
            return Err(BrokerError::Auth(format!("{} may see only its own tenant's usage", who.actor())));
        }
        let tenant = if who.role >= Role::Operator { tenant.to_string() } else { who.tenant.clone() };
        let mine = |t: &str| tenant.is_empty() || t == tenant;
        let mut out: Vec<usage::Record> =
            self.kept().iter().filter(|r| r.ended_ms >= since_ms && mine(&r.tenant)).cloned().collect();
        let live: Vec<Lease> = self.read(|st| st.leases().filter(|l| mine(&l.tenant)).cloned().collect());
        let book = self.book();
        let mut live: Vec<usage::Record> =
            live.iter().map(|l| record(l, 0, "live", book.lease(l.id))).collect();
        drop(book);
        live.sort_by_key(|r| (r.granted_ms, r.lease));
        out.extend(live);
        let skip = out.len().saturating_sub(limit);
        Ok(out.split_off(skip))
    }

    /// Queues the state's pending output for the writer (still under the
    /// lock, so the file sees changes in order); the receiver resolves once
    /// they are durable.
    fn commit(&self, st: &mut State) -> oneshot::Receiver<Result<(), StoreError>> {
        let (mut changes, events) = st.take_output();
        // An ended lease's accounting record goes in the same transaction
        // as its end.
        for e in &events {
            if let Event::Ended { id, why, lease } = e {
                let r = record(lease, now_ms(), why.name(), self.book().take(*id));
                changes.push(Change::Usage(r.clone()));
                let mut kept = self.kept();
                if kept.len() >= RECORDS_KEPT {
                    kept.pop_front();
                }
                kept.push_back(r);
            }
        }
        let (tx, rx) = oneshot::channel();
        let waiters = self.waiters.clone();
        let (metrics, queued) = (self.metrics.clone(), std::time::Instant::now());
        let timed = !changes.is_empty();
        let job = Job {
            changes,
            term: self.term.load(Ordering::SeqCst),
            then: Box::new(move |r| {
                if timed {
                    metrics.committed(queued.elapsed());
                }
                deliver(&waiters, events, &r);
                let _ = tx.send(r);
            }),
        };
        if let Err(mpsc::SendError(job)) = self.writer.send(job) {
            (job.then)(Err(StoreError { path: String::new(), reason: "the store writer has stopped".into() }));
        }
        rx
    }

    async fn durable(rx: oneshot::Receiver<Result<(), StoreError>>) -> Result<(), BrokerError> {
        match rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(store_refusal(&e)),
            Err(_) => Err(BrokerError::Store("the store writer has stopped".into())),
        }
    }

    /// Checks a GPU server's registration proof: `message` is
    /// `auth::register_message` of this connection's nonce and the
    /// inventory it registers.
    pub fn check_server_proof(&self, server_id: &str, message: &[u8], proof: &[u8]) -> Result<(), BrokerError> {
        if token::verify_bytes(&self.key, message, proof) {
            Ok(())
        } else {
            Err(BrokerError::Auth(format!("server {server_id} did not prove it holds the broker key over this connection's challenge")))
        }
    }

    pub fn token_for(&self, l: &Lease) -> Vec<u8> {
        Claims {
            pkey: self.lock().pkey_of(&l.tenant),
            lease_id: l.id,
            generation: l.generation,
            deadline_ms: l.deadline,
            memory_limit: l.memory_limit,
            tenant: l.tenant.clone(),
            gpus: l.gpus.iter().map(|g| g.uuid).collect(),
            compute_milli: l.compute_share(),
            client_key: l.client_key,
        }
        .sign(&self.key)
    }

    /// Registers a server whose proof was checked.
    pub async fn register(&self, spec: ServerSpec) -> Result<u64, BrokerError> {
        self.register_linked(spec, None).await
    }

    /// [`Service::register`] with the server's link capacity (bytes/s each
    /// way; None: unbounded).
    pub async fn register_linked(&self, spec: ServerSpec, link: Option<u64>) -> Result<u64, BrokerError> {
        if spec.id.is_empty() {
            return Err(BrokerError::Invalid("a server registers with its address as id".into()));
        }
        self.serving()?;
        let (rx, hb) = {
            let mut st = self.lock();
            st.register_linked(spec, link, now_ms());
            (self.commit(&mut st), st.limits.heartbeat_ms)
        };
        Self::durable(rx).await?;
        Ok(hb)
    }

    /// The live leases on a registered server, the floor and the moves it
    /// is to make.
    pub fn heartbeat(&self, id: &str) -> Option<crate::state::Heartbeat> {
        let mut st = self.lock();
        if !self.leads() {
            return None;
        }
        let r = st.heartbeat(id, now_ms());
        // A returning server may let queued requests through.
        let _ = self.commit(&mut st);
        r
    }

    /// A lease for `who`'s tenant: the request names no other.
    pub async fn lease(&self, who: &Identity, req: LeaseRequest) -> Result<Lease, BrokerError> {
        let started = std::time::Instant::now();
        let r = self.lease_unmetered(who, req).await;
        self.metrics.answered(&r, started.elapsed());
        r
    }

    async fn lease_unmetered(&self, who: &Identity, mut req: LeaseRequest) -> Result<Lease, BrokerError> {
        if !req.tenant.is_empty() && req.tenant != who.tenant {
            return Err(BrokerError::Auth(format!("{} may not lease for tenant {}", who.actor(), req.tenant)));
        }
        req.tenant = who.tenant.clone();
        let mut idb = [0u8; 8];
        getrandom::fill(&mut idb).map_err(|e| BrokerError::Store(format!("no randomness: {e}")))?;
        let id = u64::from_le_bytes(idb) | 1;
        let wait = req.wait_ms;
        let (outcome, rx) = {
            let mut st = self.lock();
            let placing = std::time::Instant::now();
            let outcome = st.request(req, id, now_ms());
            self.metrics.placed(placing.elapsed());
            if let Ok(Outcome::Queued(t)) = &outcome {
                let (tx, wrx) = oneshot::channel();
                self.waiters.lock().unwrap_or_else(|p| p.into_inner()).insert(*t, tx);
                (Ok(Err((*t, wrx))), self.commit(&mut st))
            } else {
                (outcome.map(|o| Ok(o)), self.commit(&mut st))
            }
        };
        Self::durable(rx).await?;
        match outcome? {
            Ok(Outcome::Granted(l)) => Ok(l),
            Ok(Outcome::Queued(_)) => Err(BrokerError::Store("queued without a waiter".into())),
            Err((ticket, wrx)) => {
                // The state machine times the wait out itself; this bound
                // only guards against a lost wake-up.
                let bound = Duration::from_millis(wait.saturating_add(5_000));
                match tokio::time::timeout(bound, wrx).await {
                    Ok(Ok(r)) => r,
                    _ => {
                        self.lock().withdraw(ticket);
                        Err(BrokerError::QueueTimeout(wait))
                    }
                }
            }
        }
    }

    /// Renews one of `who`'s tenant's leases; another tenant's is answered
    /// as a lease this broker does not know.
    pub async fn renew(&self, who: &Identity, id: u64, ttl_ms: u64) -> Result<Lease, BrokerError> {
        let (r, rx) = {
            let mut st = self.lock();
            let r = match st.lease(id) {
                Some(l) if l.tenant != who.tenant => {
                    Err(BrokerError::NotFound { id, why: "is not known to this broker".into() })
                }
                _ => st.renew(id, ttl_ms, now_ms()),
            };
            (r, self.commit(&mut st))
        };
        Self::durable(rx).await?;
        r
    }

    /// Releases one of `who`'s tenant's leases (an admin: any); another
    /// tenant's is answered as one that already ended.
    pub async fn release(&self, who: &Identity, id: u64) -> Result<bool, BrokerError> {
        let (r, rx) = {
            let mut st = self.lock();
            let r = match st.lease(id) {
                Some(l) if l.tenant != who.tenant && who.role < Role::Admin => false,
                _ => st.release(id, now_ms()),
            };
            (r, self.commit(&mut st))
        };
        Self::durable(rx).await?;
        Ok(r)
    }

    /// Suspends one of `who`'s tenant's leases (an admin: any) until it is
    /// resumed (`State::hold`); another tenant's is answered as a lease
    /// this broker does not know.
    pub async fn suspend(&self, who: &Identity, id: u64) -> Result<Lease, BrokerError> {
        self.owned(who, id, |st, now| st.hold(id, now)).await
    }

    /// Lets a lease [`Self::suspend`] suspended resume (`State::unhold`).
    pub async fn resume(&self, who: &Identity, id: u64) -> Result<Lease, BrokerError> {
        self.owned(who, id, |st, now| st.unhold(id, now)).await
    }

    async fn owned(
        &self,
        who: &Identity,
        id: u64,
        op: impl FnOnce(&mut State, Millis) -> Result<Lease, BrokerError>,
    ) -> Result<Lease, BrokerError> {
        self.serving()?;
        let (r, rx) = {
            let mut st = self.lock();
            let r = match st.lease(id) {
                Some(l) if l.tenant != who.tenant && who.role < Role::Admin => {
                    Err(BrokerError::NotFound { id, why: "is not known to this broker".into() })
                }
                _ => op(&mut st, now_ms()),
            };
            (r, self.commit(&mut st))
        };
        Self::durable(rx).await?;
        r
    }

    pub async fn drain(&self, id: &str, deadline: Option<Millis>, for_shutdown: bool) -> Result<(), BrokerError> {
        self.serving()?;
        let (r, rx) = {
            let mut st = self.lock();
            let r = st.drain(id, deadline, for_shutdown, now_ms());
            (r, self.commit(&mut st))
        };
        Self::durable(rx).await?;
        r
    }

    /// A drain that also moves the server's leases by live migration:
    /// per lease, the target chosen or why none fits.
    pub async fn drain_migrate(&self, id: &str, deadline: Option<Millis>) -> Result<Vec<(u64, Result<String, String>)>, BrokerError> {
        self.serving()?;
        let (r, rx) = {
            let mut st = self.lock();
            let r = st.drain_migrate(id, deadline, now_ms());
            (r, self.commit(&mut st))
        };
        Self::durable(rx).await?;
        r
    }

    /// An operator's move of one lease (see [`State::move_lease`]),
    /// durable before the answer.
    pub async fn move_lease(&self, lease: u64, to: Option<&str>) -> Result<crate::state::Lease, BrokerError> {
        self.serving()?;
        let (r, rx) = {
            let mut st = self.lock();
            let r = st.move_lease(lease, to, now_ms());
            (r, self.commit(&mut st))
        };
        Self::durable(rx).await?;
        r
    }

    /// Server `from`'s report on a move it was asked to make; returns the
    /// move's target.
    /// A server's report of its GPUs' health (see [`State::report_health`]),
    /// durable before the answer: the GPUs whose health changed and the
    /// evacuation moves started.
    pub async fn report_health(
        &self,
        server: &str,
        reports: &[crate::state::HealthChange],
    ) -> Result<(Vec<crate::state::HealthChange>, Vec<(u64, Result<String, String>)>), BrokerError> {
        self.serving()?;
        let (rx, r) = {
            let mut st = self.lock();
            let r = st.report_health(server, reports, now_ms());
            (self.commit(&mut st), r)
        };
        Self::durable(rx).await?;
        Ok(r)
    }

    pub async fn move_reported(&self, from: &str, lease: u64, result: Result<(), String>) -> Result<String, BrokerError> {
        self.serving()?;
        let (r, rx) = {
            let mut st = self.lock();
            let r = st.move_reported(from, lease, result, now_ms());
            (r, self.commit(&mut st))
        };
        Self::durable(rx).await?;
        r
    }

    /// Server `from` reports a suspension (`resumed` false) or a resume of
    /// `lease` (preemption) done or failed.
    pub async fn suspension_reported(&self, from: &str, lease: u64, resumed: bool, result: Result<(), String>) -> Result<(), BrokerError> {
        self.serving()?;
        let (r, rx) = {
            let mut st = self.lock();
            let r = st.suspension_reported(from, lease, resumed, result, now_ms());
            (r, self.commit(&mut st))
        };
        Self::durable(rx).await?;
        r
    }

    pub async fn undrain(&self, id: &str) -> Result<(), BrokerError> {
        let (r, rx) = {
            let mut st = self.lock();
            let r = st.undrain(id, now_ms());
            (r, self.commit(&mut st))
        };
        Self::durable(rx).await?;
        r
    }

    /// Advances time: expiry, heartbeats missed, drain deadlines, queue.
    /// Called every [`TICK`]; a longer gap is time this broker did not run
    /// (paused, starved), in which it heard no server: no server's silence
    /// counts it.
    pub fn tick(&self) {
        self.tick_at(Instant::now());
    }

    fn tick_at(&self, mono: Instant) {
        // Checked under the lock: a broker paused between the check and
        // the tick must not judge the servers by its own silence.
        let mut st = self.lock();
        if !self.leads() {
            return;
        }
        let now = now_ms();
        let last = self.last_tick.lock().unwrap_or_else(|p| p.into_inner()).replace(mono);
        if let Some(gap) = last.map(|l| mono.saturating_duration_since(l)).filter(|g| *g > STALLED) {
            let missed = (gap - TICK).as_millis() as Millis;
            tracing::warn!(ms = missed, "this broker did not run for {missed} ms: no server is blamed for that silence");
            st.stalled(missed, now);
        }
        st.tick(now);
        let _ = self.commit(&mut st);
    }

    /// Read-only access for listings.
    pub fn read<T>(&self, f: impl FnOnce(&State) -> T) -> T {
        f(&self.lock())
    }
}

/// A write the store refused because this broker no longer leads is the
/// leader's to make: the client is sent on (nothing was written).
fn store_refusal(e: &StoreError) -> BrokerError {
    if e.deposed() {
        BrokerError::NotLeader(format!("this broker stopped leading; try again ({e})"))
    } else {
        BrokerError::Store(e.to_string())
    }
}

fn record(l: &Lease, ended_ms: u64, why: &str, usage: Option<usage::Usage>) -> usage::Record {
    let mut servers: Vec<String> = l.gpus.iter().map(|g| g.server.clone()).collect();
    servers.dedup();
    usage::Record {
        lease: l.id,
        tenant: l.tenant.clone(),
        gpus: l.gpus.len() as u32,
        servers,
        memory_limit: l.memory_limit,
        compute_milli: l.compute_milli,
        granted_ms: l.granted,
        ended_ms,
        why: why.to_string(),
        usage,
    }
}

fn deliver(waiters: &Waiters, events: Vec<Event>, result: &Result<(), StoreError>) {
    if events.is_empty() {
        return;
    }
    let mut w = waiters.lock().unwrap_or_else(|p| p.into_inner());
    for e in events {
        match e {
            Event::Granted { ticket, lease } => {
                if let Some(tx) = w.remove(&ticket) {
                    let r = match result {
                        Ok(()) => Ok(lease),
                        Err(e) => Err(store_refusal(e)),
                    };
                    let _ = tx.send(r);
                }
            }
            Event::Failed { ticket, error } => {
                if let Some(tx) = w.remove(&ticket) {
                    let _ = tx.send(Err(error));
                }
            }
            Event::Ended { id, why, .. } => tracing::info!(lease = format_args!("{id:#x}"), ?why, "lease ended"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::FragmentationAware;
    use crate::state::{Limits, TenantPolicy};

    fn service(tenants: HashMap<String, TenantPolicy>, key: &[u8]) -> Arc<Service> {
        let state = State::new(Limits::default(), tenants, Box::new(FragmentationAware));
        let (writer, _) = mpsc::channel();
        let creds = Credentials::new(b"credential key".to_vec(), HashMap::new());
        Service::new(state, writer, key.to_vec(), creds, Audit::in_memory(), String::new())
    }

    fn who(tenant: &str, role: Role) -> Identity {
        Identity { tenant: tenant.into(), role, serial: 1 }
    }

    #[test]
    fn roles_and_the_request_rate() {
        let mut tenants = HashMap::new();
        tenants.insert("slow".to_string(), TenantPolicy { max_rate: Some(2), ..TenantPolicy::default() });
        let s = service(tenants, &[1; 32]);
        let is_auth = |r: Result<(), BrokerError>| matches!(r, Err(BrokerError::Auth(_)));
        assert!(is_auth(s.authorize(&who("a", Role::User), Role::Operator)));
        assert!(s.authorize(&who("a", Role::Operator), Role::Operator).is_ok());
        assert!(s.authorize(&who("a", Role::Admin), Role::Operator).is_ok());
        let slow = who("slow", Role::User);
        let passed = (0..10).filter(|_| s.authorize(&slow, Role::User).is_ok()).count();
        assert_eq!(passed, 4, "a burst of twice the tenant's rate");
        assert!(matches!(s.authorize(&slow, Role::User), Err(BrokerError::Rate(_))));
        assert!(s.authorize(&who("fast", Role::User), Role::User).is_ok(), "others are not slowed");
    }

    #[test]
    fn a_follower_refuses_and_names_the_leader_and_a_leader_commits_under_its_term() {
        let state = || State::new(Limits::default(), HashMap::new(), Box::new(FragmentationAware));
        let (writer, jobs) = mpsc::channel();
        let creds = Credentials::new(b"credential key".to_vec(), HashMap::new());
        let s = Service::new(state(), writer, vec![1; 32], creds, Audit::in_memory(), String::new());
        let alice = who("alice", Role::Admin);
        s.follow(Some("10.0.0.2:7770".into()));
        let e = s.authorize(&alice, Role::User).unwrap_err();
        assert_eq!(e.to_string(), "[not-leader] this broker follows; the leader is at 10.0.0.2:7770");
        assert!(s.heartbeat("x").is_none(), "no heartbeat answered by a follower");
        s.follow(None);
        assert!(matches!(s.authorize(&alice, Role::User), Err(BrokerError::NotLeader(_))));
        // Elected at revision 42, with the store's revocations.
        let mut revoked = HashMap::new();
        revoked.insert("alice".to_string(), 5);
        s.lead(state(), 42, revoked, Tenure::unbounded());
        assert!(s.authorize(&alice, Role::User).is_err(), "alice's serial 1 is revoked in the store");
        assert!(s.authorize(&who("bob", Role::User), Role::User).is_ok());
        let spec = crate::inventory::ServerSpec {
            id: "gpu1:7767".into(),
            node: "n".into(),
            leaf: "l".into(),
            spine: "s".into(),
            partitions: vec![],
            gpus: vec![],
            transports: vec![],
        };
        // Polled once: it commits, then would wait for the store.
        assert!(futures::FutureExt::now_or_never(s.register(spec)).is_none());
        let job = jobs.try_recv().expect("the registration is committed");
        assert_eq!(job.term, 42, "under the term the state was loaded in");
        s.follow(None);
        s.tick();
        assert!(jobs.try_recv().is_err(), "a follower does not tick");
    }

    /// Finding: a leader frozen (SIGSTOP) past its etcd lease woke with its
    /// stale view, ticked, and refused a grant as "no capacity" (a refusal
    /// writes nothing, so fencing did not stop it).
    #[test]
    fn a_leader_past_its_tenure_refuses_and_does_not_tick() {
        let state = || State::new(Limits::default(), HashMap::new(), Box::new(FragmentationAware));
        let (writer, jobs) = mpsc::channel();
        let creds = Credentials::new(b"credential key".to_vec(), HashMap::new());
        let s = Service::new(state(), writer, vec![1; 32], creds, Audit::in_memory(), String::new());
        let alice = who("alice", Role::User);
        let tenure = Tenure::until(Instant::now() + Duration::from_millis(200));
        s.lead(state(), 7, HashMap::new(), tenure.clone());
        assert!(s.authorize(&alice, Role::User).is_ok());
        s.tick();
        assert!(jobs.try_recv().is_ok(), "a leader ticks");
        std::thread::sleep(Duration::from_millis(250));
        let e = s.authorize(&alice, Role::User).unwrap_err();
        assert!(matches!(e, BrokerError::NotLeader(_)), "{e}");
        assert!(e.to_string().contains("lapsed"), "{e}");
        assert!(s.heartbeat("x").is_none());
        s.tick();
        assert!(jobs.try_recv().is_err(), "nor does it tick");
        // The store confirms a renewal: it serves again.
        tenure.extend(Instant::now() + Duration::from_secs(60));
        assert!(s.authorize(&alice, Role::User).is_ok());
    }

    /// The same stall, as the service's clock sees it: the tick after a
    /// gap credits it, so a server heard just before keeps its leases.
    #[test]
    fn a_tick_after_a_stall_blames_no_server() {
        let spec = |id: &str| crate::inventory::ServerSpec {
            id: id.into(),
            node: id.into(),
            leaf: "l".into(),
            spine: "s".into(),
            partitions: vec![],
            gpus: vec![],
            transports: vec![],
        };
        let (writer, _jobs) = mpsc::channel();
        let mut st = State::new(Limits::default(), HashMap::new(), Box::new(FragmentationAware));
        st.register(spec("gpu1:7767"), now_ms());
        let creds = Credentials::new(b"credential key".to_vec(), HashMap::new());
        let s = Service::new(st, writer, vec![1; 32], creds, Audit::in_memory(), String::new());
        let t0 = Instant::now();
        s.tick_at(t0);
        // The wall clock moves 4 s (past 3 heartbeats) while the broker
        // did not run: simulated by heartbeating in the past.
        s.lock().heartbeat("gpu1:7767", now_ms() - 4_000);
        s.tick_at(t0 + Duration::from_secs(4));
        assert!(s.read(|st| st.server("gpu1:7767").unwrap().reachable), "the broker's stall is not the server's silence");
        // Without the gap, the same silence is the server's.
        s.lock().heartbeat("gpu1:7767", now_ms() - 4_000);
        s.tick_at(t0 + Duration::from_millis(4_100));
        assert!(!s.read(|st| st.server("gpu1:7767").unwrap().reachable));
    }

    fn active_lease(tenant: &str, gpus: Vec<crate::state::LeasedGpu>) -> Lease {
        Lease {
            id: 1,
            key: String::new(),
            tenant: tenant.into(),
            generation: 1,
            gpus,
            memory_limit: 0,
            compute_milli: 0,
            priority: 0,
            granted: 0,
            ttl_ms: 1000,
            deadline: 5000,
            state: crate::state::LeaseState::Active,
            bandwidth: 0,
            moving: None,
            move_error: String::new(),
            client_key: None,
            suspension: None,
            unpreemptible_until: 0,
        }
    }

    #[test]
    fn lease_tokens_carry_the_tenants_pkey() {
        let key = [1u8; 32];
        let mut tenants = HashMap::new();
        let policy = |pkey| TenantPolicy { pkey, ..TenantPolicy::default() };
        tenants.insert("ib".to_string(), policy(Some(0x8001)));
        tenants.insert("plain".to_string(), policy(None));
        let s = service(tenants, &key);
        let lease = |tenant: &str| active_lease(tenant, vec![]);
        let pkey = |tenant: &str| Claims::verify(&s.token_for(&lease(tenant)), &key, 0).map(|c| c.pkey);
        assert_eq!(pkey("ib"), Ok(Some(0x8001)));
        assert_eq!(pkey("plain"), Ok(None));
        assert_eq!(pkey("unknown"), Ok(None));
    }

    #[test]
    fn lease_tokens_carry_a_fractions_compute_share() {
        let key = [1u8; 32];
        let s = service(HashMap::new(), &key);
        let gpu = |take_memory, take_milli| crate::state::LeasedGpu {
            server: "a".into(),
            uuid: [3; 16],
            ordinal: 0,
            model: "m".into(),
            memory: 1000,
            take_memory,
            take_milli,
        };
        let lease = |gpus| active_lease("t", gpus);
        let share = |gpus| Claims::verify(&s.token_for(&lease(gpus)), &key, 0).map(|c| c.compute_milli);
        assert_eq!(share(vec![gpu(1000, 1000)]), Ok(0), "a whole GPU competes for nothing");
        assert_eq!(share(vec![gpu(1000, 1000), gpu(1000, 1000)]), Ok(0));
        assert_eq!(share(vec![gpu(0, 300)]), Ok(300), "compute share, no memory share");
        assert_eq!(share(vec![gpu(250, 0)]), Ok(250), "memory share alone: the share placement counts");
        assert_eq!(share(vec![gpu(500, 200)]), Ok(500), "the larger of the two");
    }
}
