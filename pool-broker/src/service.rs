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
    waiters: Waiters,
    pub started: Millis,
    pub data_dir: String,
}

/// What `register`/`heartbeat` prove: HMAC over this and the server id.
pub const REGISTER_CONTEXT: &str = "rgpu-register:";

impl Service {
    pub fn new(state: State, writer: mpsc::Sender<Job>, key: Option<Vec<u8>>, data_dir: String) -> Arc<Service> {
        Arc::new(Service {
            state: Mutex::new(state),
            writer,
            key,
            waiters: Arc::default(),
            started: now_ms(),
            data_dir,
        })
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
                let msg = format!("{REGISTER_CONTEXT}{server_id}");
                if token::verify_bytes(k, msg.as_bytes(), proof) {
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
