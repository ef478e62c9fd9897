//! Orchestration: lock the state, make one state-machine call, hand its
//! changes to the store writer, and answer only once they are durable.

use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rgpu_protocol::token::{self, Claims};
use tokio::sync::oneshot;

use crate::inventory::{Millis, ServerSpec};
use crate::state::{BrokerError, Event, Lease, LeaseRequest, Outcome, State};
use crate::store::{Job, StoreError};

pub fn now_ms() -> Millis {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

type Waiters = Arc<Mutex<HashMap<u64, oneshot::Sender<Result<Lease, BrokerError>>>>>;

pub struct Service {
    state: Mutex<State>,
    writer: mpsc::Sender<Job>,
    key: Option<Vec<u8>>,
    /// The operators' key for drain/undrain (the token key works too).
    admin_key: Option<Vec<u8>>,
    /// Admin proofs already used, with their issue time (pruned after the
    /// window), so that none is replayed.
    seen_admin: Mutex<HashMap<Vec<u8>, Millis>>,
    waiters: Waiters,
    pub started: Millis,
    pub data_dir: String,
}

/// How far an admin request's issue time may be from the broker's clock.
pub const ADMIN_WINDOW_MS: u64 = 5 * 60_000;

impl Service {
    /// `key` signs tokens; `admin_key` (or `key`) proves drain/undrain.
    pub fn new(
        state: State,
        writer: mpsc::Sender<Job>,
        key: Option<Vec<u8>>,
        admin_key: Option<Vec<u8>>,
        data_dir: String,
    ) -> Arc<Service> {
        Arc::new(Service {
            state: Mutex::new(state),
            writer,
            key,
            admin_key,
            seen_admin: Mutex::default(),
            waiters: Arc::default(),
            started: now_ms(),
            data_dir,
        })
    }

    /// Checks an admin request's credential (see `AdminAuth` in
    /// broker.capnp): a proof under the admin key or the token key, issued
    /// within [`ADMIN_WINDOW_MS`] of now, not seen before. Open when the
    /// broker has neither key.
    pub fn check_admin(
        &self,
        op: &str,
        server_id: &str,
        deadline_ms: u64,
        issued_ms: u64,
        proof: &[u8],
        now: Millis,
    ) -> Result<(), BrokerError> {
        let keys: Vec<&Vec<u8>> = self.admin_key.iter().chain(self.key.iter()).collect();
        if keys.is_empty() {
            return Ok(());
        }
        if proof.is_empty() {
            return Err(BrokerError::Auth(format!(
                "{op} needs an admin credential (rgpu {op} --admin-key-file FILE, or RGPU_ADMIN_KEY_FILE)"
            )));
        }
        if issued_ms.abs_diff(now) > ADMIN_WINDOW_MS {
            return Err(BrokerError::Auth(format!(
                "{op} request issued {} s from the broker's clock (at most {} s allowed)",
                issued_ms.abs_diff(now) / 1000,
                ADMIN_WINDOW_MS / 1000
            )));
        }
        let msg = token::admin_message(op, server_id, deadline_ms, issued_ms);
        if !keys.iter().any(|k| token::verify_bytes(k, &msg, proof)) {
            return Err(BrokerError::Auth(format!("{op} refused: the admin credential does not match the broker's keys")));
        }
        let mut seen = self.seen_admin.lock().unwrap_or_else(|p| p.into_inner());
        seen.retain(|_, &mut t| t.abs_diff(now) <= ADMIN_WINDOW_MS);
        if seen.insert(proof.to_vec(), issued_ms).is_some() {
            return Err(BrokerError::Auth(format!("{op} refused: this admin credential was used before")));
        }
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues the state's pending output for the writer (still under the
    /// lock, so the file sees changes in order); the receiver resolves once
    /// they are durable.
    fn commit(&self, st: &mut State) -> oneshot::Receiver<Result<(), StoreError>> {
        let (changes, events) = st.take_output();
        let (tx, rx) = oneshot::channel();
        let waiters = self.waiters.clone();
        let job = Job {
            changes,
            then: Box::new(move |r| {
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
            Ok(Err(e)) => Err(BrokerError::Store(e.to_string())),
            Err(_) => Err(BrokerError::Store("the store writer has stopped".into())),
        }
    }

    pub fn check_server_proof(&self, server_id: &str, proof: &[u8]) -> Result<(), BrokerError> {
        match &self.key {
            None => Ok(()),
            Some(k) => {
                if token::verify_bytes(k, &token::register_message(server_id), proof) {
                    Ok(())
                } else {
                    Err(BrokerError::Auth(format!("server {server_id} did not prove it holds the broker key")))
                }
            }
        }
    }

    pub fn token_for(&self, l: &Lease) -> Vec<u8> {
        match &self.key {
            None => Vec::new(),
            Some(k) => Claims {
                pkey: self.lock().pkey_of(&l.tenant),
                lease_id: l.id,
                generation: l.generation,
                deadline_ms: l.deadline,
                memory_limit: l.memory_limit,
                tenant: l.tenant.clone(),
                gpus: l.gpus.iter().map(|g| g.uuid).collect(),
            }
            .sign(k),
        }
    }

    pub async fn register(&self, spec: ServerSpec, proof: &[u8]) -> Result<u64, BrokerError> {
        self.check_server_proof(&spec.id, proof)?;
        if spec.id.is_empty() {
            return Err(BrokerError::Invalid("a server registers with its address as id".into()));
        }
        let (rx, hb) = {
            let mut st = self.lock();
            st.register(spec, now_ms());
            (self.commit(&mut st), st.limits.heartbeat_ms)
        };
        Self::durable(rx).await?;
        Ok(hb)
    }

    /// The live leases (id, generation, deadline) on a server and the floor.
    pub fn heartbeat(&self, id: &str, proof: &[u8]) -> Result<Option<(Vec<(u64, u64, u64)>, u64)>, BrokerError> {
        self.check_server_proof(id, proof)?;
        let mut st = self.lock();
        let r = st
            .heartbeat(id, now_ms())
            .map(|(live, floor)| (live.iter().map(|l| (l.id, l.generation, l.deadline)).collect(), floor));
        // A returning server may let queued requests through.
        let _ = self.commit(&mut st);
        Ok(r)
    }

    pub async fn lease(&self, req: LeaseRequest) -> Result<Lease, BrokerError> {
        let mut idb = [0u8; 8];
        getrandom::fill(&mut idb).map_err(|e| BrokerError::Store(format!("no randomness: {e}")))?;
        let id = u64::from_le_bytes(idb) | 1;
        let wait = req.wait_ms;
        let (outcome, rx) = {
            let mut st = self.lock();
            let outcome = st.request(req, id, now_ms());
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

    pub async fn renew(&self, id: u64, ttl_ms: u64) -> Result<Lease, BrokerError> {
        let (r, rx) = {
            let mut st = self.lock();
            let r = st.renew(id, ttl_ms, now_ms());
            (r, self.commit(&mut st))
        };
        Self::durable(rx).await?;
        r
    }

    pub async fn release(&self, id: u64) -> Result<bool, BrokerError> {
        let (r, rx) = {
            let mut st = self.lock();
            let r = st.release(id, now_ms());
            (r, self.commit(&mut st))
        };
        Self::durable(rx).await?;
        Ok(r)
    }

    pub async fn drain(&self, id: &str, deadline: Option<Millis>, for_shutdown: bool) -> Result<(), BrokerError> {
        let (r, rx) = {
            let mut st = self.lock();
            let r = st.drain(id, deadline, for_shutdown, now_ms());
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
    pub fn tick(&self) {
        let mut st = self.lock();
        st.tick(now_ms());
        let _ = self.commit(&mut st);
    }

    /// Read-only access for listings.
    pub fn read<T>(&self, f: impl FnOnce(&State) -> T) -> T {
        f(&self.lock())
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
                        Err(e) => Err(BrokerError::Store(e.to_string())),
                    };
                    let _ = tx.send(r);
                }
            }
            Event::Failed { ticket, error } => {
                if let Some(tx) = w.remove(&ticket) {
                    let _ = tx.send(Err(error));
                }
            }
            Event::Ended { id, why } => tracing::info!(lease = format_args!("{id:#x}"), ?why, "lease ended"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::FragmentationAware;
    use crate::state::Limits;

    fn service(key: Option<&[u8]>, admin: Option<&[u8]>) -> Arc<Service> {
        let state = State::new(Limits::default(), HashMap::new(), Box::new(FragmentationAware));
        let (writer, _) = mpsc::channel();
        Service::new(state, writer, key.map(<[u8]>::to_vec), admin.map(<[u8]>::to_vec), String::new())
    }

    fn proof(key: &[u8], op: &str, server: &str, deadline: u64, issued: u64) -> Vec<u8> {
        token::sign_bytes(key, &token::admin_message(op, server, deadline, issued))
    }

    #[test]
    fn admin_requests_need_a_fresh_proof_under_a_broker_key() {
        let (key, admin) = (&[1u8; 32][..], &[2u8; 32][..]);
        let s = service(Some(key), Some(admin));
        let now = 1_000_000;
        let is_auth = |r: Result<(), BrokerError>| matches!(r, Err(BrokerError::Auth(_)));
        assert!(is_auth(s.check_admin("drain", "a:1", 0, now, &[], now)), "no credential");
        assert!(is_auth(s.check_admin("drain", "a:1", 0, now, &proof(&[3; 32], "drain", "a:1", 0, now), now)));
        // Bound to the operation, the server and the deadline.
        let p = proof(admin, "drain", "a:1", 0, now);
        assert!(is_auth(s.check_admin("undrain", "a:1", 0, now, &p, now)));
        assert!(is_auth(s.check_admin("drain", "b:1", 0, now, &p, now)));
        assert!(is_auth(s.check_admin("drain", "a:1", 9, now, &p, now)));
        assert!(s.check_admin("drain", "a:1", 0, now, &p, now).is_ok());
        assert!(is_auth(s.check_admin("drain", "a:1", 0, now, &p, now + 1)), "replayed");
        // The token key (the GPU servers' own drain) works too.
        assert!(s.check_admin("drain", "a:1", 5, now, &proof(key, "drain", "a:1", 5, now), now).is_ok());
        // Issued too long ago, or too far ahead.
        let old = now - ADMIN_WINDOW_MS - 1;
        assert!(is_auth(s.check_admin("undrain", "a:1", 0, old, &proof(admin, "undrain", "a:1", 0, old), now)));
        let ahead = now + ADMIN_WINDOW_MS + 1;
        assert!(is_auth(s.check_admin("undrain", "a:1", 0, ahead, &proof(admin, "undrain", "a:1", 0, ahead), now)));
        // A broker with no key at all is open.
        assert!(service(None, None).check_admin("drain", "a:1", 0, 0, &[], now).is_ok());
    }

    #[test]
    fn lease_tokens_carry_the_tenants_pkey() {
        let key = [1u8; 32];
        let mut tenants = HashMap::new();
        let policy = |pkey| crate::state::TenantPolicy { partitions: vec![], max_gpus: None, max_memory: None, pkey };
        tenants.insert("ib".to_string(), policy(Some(0x8001)));
        tenants.insert("plain".to_string(), policy(None));
        let state = State::new(Limits::default(), tenants, Box::new(FragmentationAware));
        let (writer, _) = mpsc::channel();
        let s = Service::new(state, writer, Some(key.to_vec()), None, String::new());
        let lease = |tenant: &str| Lease {
            id: 1,
            key: String::new(),
            tenant: tenant.into(),
            generation: 1,
            gpus: vec![],
            memory_limit: 0,
            compute_milli: 0,
            priority: 0,
            granted: 0,
            ttl_ms: 1000,
            deadline: 5000,
            state: crate::state::LeaseState::Active,
        };
        let pkey = |tenant: &str| Claims::verify(&s.token_for(&lease(tenant)), &key, 0).map(|c| c.pkey);
        assert_eq!(pkey("ib"), Ok(Some(0x8001)));
        assert_eq!(pkey("plain"), Ok(None));
        assert_eq!(pkey("unknown"), Ok(None));
    }
}
