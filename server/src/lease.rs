//! Lease admission on the GPU server, when a broker key is configured:
//! `openSession` needs a token the broker signed, unexpired, for one of
//! this server's GPUs, and not fenced off. The broker's heartbeat replies
//! tell which leases are live and the generation floor; sessions of leases
//! that ended (released, expired, revoked) are closed.
//!
//! Fencing rule: a token for lease L with generation g is admitted if L is
//! in the last live list with generation g; or if L is not listed and g is
//! above the floor (granted since the last heartbeat). A listed lease with
//! another generation, or an unlisted one at or below the floor, is stale.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, Weak};

use rgpu_protocol::token::{Claims, TokenError};
use thiserror::Error;

use crate::backend::MemoryBudget;
use crate::quota::ByteQuota;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum AdmitError {
    #[error("this server only admits sessions with a lease token from the broker (set RGPU_TOKEN, or use `rgpu run --gpus N`)")]
    NoToken,
    #[error(transparent)]
    Token(#[from] TokenError),
    #[error("the token is for GPUs this server does not have")]
    NotOurGpu,
    #[error("stale lease generation {got} for lease {lease:016x} (live generation {live})")]
    StaleGeneration { lease: u64, got: u64, live: u64 },
    #[error("lease {0:016x} has ended (released, expired or revoked); take a new lease")]
    Ended(u64),
    #[error("the token is bound to client key {0}, and this client did not prove it holds that key (run the program where the lease was taken, or point RGPU_CLIENT_KEY at its key file)")]
    Unproven(String),
    #[error("lease {0:016x} is suspended (preempted by a lease of higher priority): its sessions wait on this server's disk, and new ones are refused until the broker resumes it")]
    Suspended(u64),
    #[error("this server admits only tokens bound to a client key (--require-bound-tokens); take the lease with `rgpu lease`, which binds it")]
    Bearer,
}

/// What a client sent to prove it holds the key its token is bound to
/// (`rgpu_protocol::binding`).
#[derive(Debug, Clone, Copy)]
pub struct Possession<'a> {
    pub nonce: &'a [u8],
    /// `nonce` is the one this connection's `challenge` handed out, unused.
    pub fresh: bool,
    /// This connection's TLS exporter value; None in plaintext.
    pub channel: Option<[u8; 32]>,
    pub proof: &'a [u8],
}

/// What an admitted session may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admission {
    pub lease: u64,
    pub generation: u64,
    /// Bytes; None: whole GPUs.
    pub memory_limit: Option<u64>,
    pub deadline_ms: u64,
    /// This server's ordinals of the GPUs the token names, ascending: the
    /// only devices the session may use (decided here, at openSession).
    pub devices: Vec<u32>,
    /// The tenant's InfiniBand P_Key from the token: the session's RDMA
    /// data plane runs in that partition.
    pub pkey: Option<u16>,
    /// The lease's compute share of each GPU, thousandths; 0: whole GPUs.
    pub compute_milli: u16,
}

#[derive(Default)]
struct Inner {
    /// From the last heartbeat reply: lease id -> (generation, deadline).
    live: HashMap<u64, (u64, u64)>,
    floor: u64,
    /// Session id -> its admission.
    sessions: HashMap<u64, Admission>,
    /// Lease id -> the device memory its sessions on this server hold
    /// together; alive while one of its sessions' backends holds it.
    budgets: HashMap<u64, Weak<MemoryBudget>>,
    /// Lease id -> the module image bytes its sessions keep loaded here.
    module_quotas: HashMap<u64, Weak<ByteQuota>>,
    /// Lease id -> (its generation there, target server) for the moves the
    /// broker ordered: only these leases' sessions may be migrated.
    moves: HashMap<u64, (u64, String)>,
    /// Leases suspended here (preempted, their sessions on disk): no new
    /// session is admitted for them.
    suspended: HashSet<u64>,
}

/// Moves ordered at once (the broker sends at most 16 per heartbeat).
const MAX_MOVES: usize = 64;
/// Leases suspended here at once.
const MAX_SUSPENDED: usize = 1024;

pub struct Leases {
    key: Option<Vec<u8>>,
    /// Refuse bearer tokens (`--require-bound-tokens`).
    require_bound: bool,
    /// This server's GPUs: (UUID, ordinal).
    gpus: Vec<([u8; 16], u32)>,
    inner: Mutex<Inner>,
}

impl Leases {
    /// Without a key every session is admitted, as before the broker.
    pub fn new(key: Option<Vec<u8>>, gpus: Vec<([u8; 16], u32)>) -> Self {
        Leases { key, gpus, require_bound: false, inner: Mutex::default() }
    }

    /// Admits only tokens bound to a client key, with their proof.
    pub fn requiring_bound_tokens(mut self, require: bool) -> Self {
        self.require_bound = require;
        self
    }

    pub fn enforced(&self) -> bool {
        self.key.is_some()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Checks a token, and for one bound to a client key the client's
    /// `possession` of it; Ok(None) when no key is configured.
    pub fn admit(&self, token: &[u8], now_ms: u64, possession: Option<&Possession<'_>>) -> Result<Option<Admission>, AdmitError> {
        let Some(key) = &self.key else { return Ok(None) };
        if token.is_empty() {
            return Err(AdmitError::NoToken);
        }
        let c = Claims::verify(token, key, now_ms)?;
        match &c.client_key {
            Some(public) => {
                let proven = possession.is_some_and(|p| {
                    p.fresh && rgpu_protocol::binding::verify(public, p.nonce, p.channel.as_ref(), token, p.proof)
                });
                if !proven {
                    return Err(AdmitError::Unproven(rgpu_protocol::binding::fingerprint(public)));
                }
            }
            None if self.require_bound => return Err(AdmitError::Bearer),
            None => {}
        }
        let mut devices: Vec<u32> =
            self.gpus.iter().filter(|(uuid, _)| c.gpus.contains(uuid)).map(|&(_, ordinal)| ordinal).collect();
        if devices.is_empty() {
            return Err(AdmitError::NotOurGpu);
        }
        devices.sort_unstable();
        devices.dedup();
        let inner = self.lock();
        if inner.suspended.contains(&c.lease_id) {
            return Err(AdmitError::Suspended(c.lease_id));
        }
        let mut deadline = c.deadline_ms;
        match inner.live.get(&c.lease_id) {
            Some(&(live, _)) if live != c.generation => {
                return Err(AdmitError::StaleGeneration { lease: c.lease_id, got: c.generation, live })
            }
            Some(&(_, d)) => deadline = deadline.max(d),
            None if c.generation <= inner.floor => return Err(AdmitError::Ended(c.lease_id)),
            None => {}
        }
        Ok(Some(Admission {
            lease: c.lease_id,
            generation: c.generation,
            memory_limit: Some(c.memory_limit).filter(|&m| m > 0),
            deadline_ms: deadline,
            devices,
            pkey: c.pkey,
            compute_milli: c.compute_milli,
        }))
    }

    /// The memory budget of an admitted session's lease, shared by every
    /// session of that lease on this server; None when the lease has no
    /// memory limit. The first session of a lease sets the limit.
    pub fn budget(&self, a: &Admission) -> Option<Arc<MemoryBudget>> {
        self.budget_of(a.lease, a.memory_limit)
    }

    /// As [`Self::budget`], for a lease known by its id and limit only (a
    /// migration's pre-copy, before the snapshot's admission arrives).
    pub fn budget_of(&self, lease: u64, memory_limit: Option<u64>) -> Option<Arc<MemoryBudget>> {
        let limit = memory_limit?;
        let mut inner = self.lock();
        if let Some(b) = inner.budgets.get(&lease).and_then(Weak::upgrade) {
            return Some(b);
        }
        // Leases whose sessions all ended leave dead entries: drop them.
        inner.budgets.retain(|_, w| w.strong_count() > 0);
        let b = Arc::new(MemoryBudget::new(limit));
        inner.budgets.insert(lease, Arc::downgrade(&b));
        Some(b)
    }

    /// The module quota of an admitted session's lease, shared by every
    /// session of that lease on this server (`limit` bytes of loaded images).
    pub fn module_quota(&self, a: &Admission, limit: u64) -> Arc<ByteQuota> {
        let mut inner = self.lock();
        if let Some(q) = inner.module_quotas.get(&a.lease).and_then(Weak::upgrade) {
            return q;
        }
        inner.module_quotas.retain(|_, w| w.strong_count() > 0);
        let q = ByteQuota::new(limit);
        inner.module_quotas.insert(a.lease, Arc::downgrade(&q));
        q
    }

    pub fn bind(&self, session: u64, a: Admission) {
        self.lock().sessions.insert(session, a);
    }

    pub fn admission(&self, session: u64) -> Option<Admission> {
        self.lock().sessions.get(&session).cloned()
    }

    pub fn unbind(&self, session: u64) {
        self.lock().sessions.remove(&session);
    }

    /// The broker orders `lease` moved to `target`, where it runs at
    /// `generation`. False when too many moves are already ordered.
    pub fn order_move(&self, lease: u64, generation: u64, target: &str) -> bool {
        let mut inner = self.lock();
        if inner.moves.len() >= MAX_MOVES && !inner.moves.contains_key(&lease) {
            return false;
        }
        inner.moves.insert(lease, (generation, target.to_string()));
        true
    }

    pub fn end_move(&self, lease: u64) {
        self.lock().moves.remove(&lease);
    }

    /// The generation a session of `lease` carries to `target`, when the
    /// broker ordered that move; None: the lease stays here.
    pub fn ordered_move(&self, lease: u64, target: &str) -> Option<u64> {
        self.lock().moves.get(&lease).filter(|(_, t)| t == target).map(|&(g, _)| g)
    }

    /// Marks `lease` suspended (or being suspended): new sessions of it are
    /// refused. False when too many leases are suspended here already.
    pub fn suspend(&self, lease: u64) -> bool {
        let mut inner = self.lock();
        if inner.suspended.len() >= MAX_SUSPENDED && !inner.suspended.contains(&lease) {
            return false;
        }
        inner.suspended.insert(lease);
        true
    }

    pub fn is_suspended(&self, lease: u64) -> bool {
        self.lock().suspended.contains(&lease)
    }

    /// `lease` runs here again (resumed, or its suspension failed).
    pub fn unsuspend(&self, lease: u64) {
        self.lock().suspended.remove(&lease);
    }

    /// The suspended leases the last heartbeat reply no longer listed
    /// (released, expired or revoked while suspended): forgotten here, for
    /// the caller to drop what they left.
    pub fn suspended_unlisted(&self) -> Vec<u64> {
        let mut inner = self.lock();
        let Inner { live, suspended, .. } = &mut *inner;
        let gone: Vec<u64> = suspended.iter().copied().filter(|l| !live.contains_key(l)).collect();
        for l in &gone {
            suspended.remove(l);
        }
        gone
    }

    /// The sessions bound to `lease` here, ascending.
    pub fn sessions_of(&self, lease: u64) -> Vec<u64> {
        let mut v: Vec<u64> = self.lock().sessions.iter().filter(|(_, a)| a.lease == lease).map(|(&s, _)| s).collect();
        v.sort_unstable();
        v
    }

    /// A heartbeat reply: returns the sessions to close.
    pub fn update(&self, live: HashMap<u64, (u64, u64)>, floor: u64, now_ms: u64) -> Vec<u64> {
        let mut inner = self.lock();
        inner.live = live;
        inner.floor = floor;
        let Inner { live, floor, sessions, .. } = &mut *inner;
        let mut close = Vec::new();
        for (&sid, a) in sessions.iter_mut() {
            match live.get(&a.lease) {
                Some(&(g, d)) if g == a.generation => a.deadline_ms = a.deadline_ms.max(d),
                Some(_) => close.push(sid),
                None if a.generation <= *floor => close.push(sid),
                None => {}
            }
            if a.deadline_ms <= now_ms {
                close.push(sid);
            }
        }
        close.sort_unstable();
        close.dedup();
        for s in &close {
            sessions.remove(s);
        }
        close
    }

    /// Sessions whose last known deadline passed (the broker may be
    /// unreachable; a lease never outlives what the server last heard).
    pub fn expired(&self, now_ms: u64) -> Vec<u64> {
        let mut inner = self.lock();
        let close: Vec<u64> = inner.sessions.iter().filter(|(_, a)| a.deadline_ms <= now_ms).map(|(&s, _)| s).collect();
        for s in &close {
            inner.sessions.remove(s);
        }
        close
    }

    /// Leases the last heartbeat reply listed as live on this server.
    pub fn live_count(&self) -> usize {
        self.lock().live.len()
    }

    /// Closes the sessions of every lease (this server drains for shutdown).
    pub fn sessions(&self) -> usize {
        self.lock().sessions.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";

    fn token(lease: u64, generation: u64, gpu: u8) -> Vec<u8> {
        Claims { lease_id: lease, generation, deadline_ms: 1000, memory_limit: 0, tenant: "t".into(), gpus: vec![[gpu; 16]], pkey: None, compute_milli: 0, client_key: None }
            .sign(KEY)
    }

    #[test]
    fn admission_and_fencing() {
        let l = Leases::new(Some(KEY.to_vec()), vec![([1; 16], 0)]);
        assert_eq!(l.admit(&[], 0, None), Err(AdmitError::NoToken));
        assert_eq!(l.admit(&token(5, 3, 2), 0, None), Err(AdmitError::NotOurGpu));
        let a = l.admit(&token(5, 3, 1), 0, None).unwrap().unwrap();
        assert_eq!(a.memory_limit, None);
        l.bind(77, a);
        // Heartbeat: lease 5 live at generation 3; nothing to close.
        assert!(l.update(HashMap::from([(5, (3, 2000))]), 9, 10).is_empty());
        assert!(matches!(l.admit(&token(5, 2, 1), 0, None), Err(AdmitError::StaleGeneration { .. })));
        assert_eq!(l.admit(&token(6, 8, 1), 0, None), Err(AdmitError::Ended(6)), "released before: replay refused");
        assert!(l.admit(&token(7, 10, 1), 0, None).is_ok(), "granted since the heartbeat");
        // Lease 5 released: its session closes.
        assert_eq!(l.update(HashMap::new(), 10, 20), vec![77]);
        assert!(matches!(l.admit(&token(5, 3, 1), 30, None), Err(AdmitError::Ended(5))));
        assert!(Leases::new(None, vec![]).admit(&[], 0, None).unwrap().is_none());
    }

    #[test]
    fn sessions_of_a_lease_share_its_budget() {
        let l = Leases::new(Some(KEY.to_vec()), vec![([1; 16], 0)]);
        let adm = |lease, memory_limit| Admission { lease, generation: 1, memory_limit, deadline_ms: 1000, devices: vec![0], pkey: None, compute_milli: 0 };
        let a = adm(4, Some(100));
        let (b1, b2) = (l.budget(&a).unwrap(), l.budget(&a).unwrap());
        assert!(Arc::ptr_eq(&b1, &b2), "one budget per lease");
        let other = l.budget(&adm(5, Some(100))).unwrap();
        assert!(!Arc::ptr_eq(&b1, &other), "another lease has its own");
        assert_eq!(b1.limit(), 100);
        drop((b1, b2));
        let again = l.budget(&a).unwrap();
        assert_eq!(again.used(), 0);
        assert_eq!(l.lock().budgets.len(), 2, "the dead entry was replaced, not kept");
        assert!(l.budget(&adm(6, None)).is_none(), "no limit, no budget");
    }

    #[test]
    fn only_an_ordered_move_to_its_target_is_allowed() {
        let l = Leases::new(Some(KEY.to_vec()), vec![([1; 16], 0)]);
        let adm = Admission { lease: 4, generation: 1, memory_limit: None, deadline_ms: 1000, devices: vec![0], pkey: None, compute_milli: 0 };
        l.bind(10, adm.clone());
        l.bind(11, Admission { lease: 5, ..adm.clone() });
        l.bind(12, adm);
        assert_eq!(l.sessions_of(4), vec![10, 12]);
        assert_eq!(l.ordered_move(4, "b:1"), None, "no order: refused");
        assert!(l.order_move(4, 9, "b:1"));
        assert_eq!(l.ordered_move(4, "b:1"), Some(9));
        assert_eq!(l.ordered_move(4, "c:1"), None, "another target than the broker's");
        assert_eq!(l.ordered_move(5, "b:1"), None, "another lease");
        l.end_move(4);
        assert_eq!(l.ordered_move(4, "b:1"), None);
        for i in 0..MAX_MOVES as u64 {
            assert!(l.order_move(100 + i, 1, "b:1"));
        }
        assert!(!l.order_move(1, 1, "b:1"), "bounded");
    }

    #[test]
    fn a_suspended_lease_admits_no_session_and_is_forgotten_once_unlisted() {
        let l = Leases::new(Some(KEY.to_vec()), vec![([1; 16], 0)]);
        assert!(l.update(HashMap::from([(5, (3, 2000)), (6, (1, 2000))]), 9, 10).is_empty());
        assert!(l.suspend(5));
        assert_eq!(l.admit(&token(5, 3, 1), 0, None), Err(AdmitError::Suspended(5)));
        assert!(l.admit(&token(6, 1, 1), 0, None).is_ok(), "another lease is not");
        assert!(l.suspended_unlisted().is_empty(), "still listed");
        l.unsuspend(5);
        assert!(l.admit(&token(5, 3, 1), 0, None).is_ok(), "resumed");
        assert!(l.suspend(5));
        assert!(l.update(HashMap::from([(6, (1, 2000))]), 9, 10).is_empty());
        assert_eq!(l.suspended_unlisted(), vec![5], "released while suspended");
        assert!(l.suspended_unlisted().is_empty());
        for i in 0..MAX_SUSPENDED as u64 {
            assert!(l.suspend(100 + i));
        }
        assert!(!l.suspend(1), "bounded");
    }

    #[test]
    fn a_bound_token_needs_a_fresh_proof_for_this_connection() {
        use rgpu_protocol::binding::ClientKey;
        let holder = ClientKey::generate().unwrap();
        let thief = ClientKey::generate().unwrap();
        let bound = Claims {
            lease_id: 3, generation: 1, deadline_ms: 1000, memory_limit: 0, tenant: "t".into(), gpus: vec![[1; 16]],
            pkey: None, compute_milli: 0, client_key: Some(holder.public()),
        }
        .sign(KEY);
        let l = Leases::new(Some(KEY.to_vec()), vec![([1; 16], 0)]);
        let (nonce, chan) = ([4u8; 32], Some([5u8; 32]));
        let proof = holder.prove(&nonce, chan.as_ref(), &bound);
        let p = Possession { nonce: &nonce, fresh: true, channel: chan, proof: &proof };
        assert!(l.admit(&bound, 0, Some(&p)).unwrap().is_some(), "the holder, on its connection");
        assert!(matches!(l.admit(&bound, 0, None), Err(AdmitError::Unproven(_))), "the token alone");
        let stale = Possession { fresh: false, ..p };
        assert!(matches!(l.admit(&bound, 0, Some(&stale)), Err(AdmitError::Unproven(_))), "a nonce used before");
        let relayed = Possession { channel: Some([6u8; 32]), ..p };
        assert!(matches!(l.admit(&bound, 0, Some(&relayed)), Err(AdmitError::Unproven(_))), "another connection's proof");
        let theirs = thief.prove(&nonce, chan.as_ref(), &bound);
        let stolen = Possession { proof: &theirs, ..p };
        assert!(matches!(l.admit(&bound, 0, Some(&stolen)), Err(AdmitError::Unproven(_))), "another key");
        // Bearer tokens: admitted unless the server requires bound ones.
        assert!(l.admit(&token(8, 1, 1), 0, None).is_ok());
        let strict = Leases::new(Some(KEY.to_vec()), vec![([1; 16], 0)]).requiring_bound_tokens(true);
        assert_eq!(strict.admit(&token(8, 1, 1), 0, None), Err(AdmitError::Bearer));
        assert!(strict.admit(&bound, 0, Some(&p)).unwrap().is_some());
    }

    #[test]
    fn admission_names_only_the_tokens_gpus() {
        let l = Leases::new(Some(KEY.to_vec()), vec![([1; 16], 0), ([2; 16], 1), ([3; 16], 2)]);
        let c = |gpus: Vec<[u8; 16]>| {
            Claims { lease_id: 9, generation: 1, deadline_ms: 1000, memory_limit: 0, tenant: "t".into(), gpus, pkey: None, compute_milli: 0, client_key: None }.sign(KEY)
        };
        assert_eq!(l.admit(&c(vec![[3; 16], [2; 16]]), 0, None).unwrap().unwrap().devices, vec![1, 2]);
        // A GPU of another server in the same token gives nothing here.
        assert_eq!(l.admit(&c(vec![[9; 16], [1; 16]]), 0, None).unwrap().unwrap().devices, vec![0]);
    }
}
