//! [`BrokerClient`]: a blocking connection to a broker, logged in with a
//! [`Credential`], for callers with no runtime of their own (the CLI,
//! tests). It owns a small single-threaded runtime and drives it on the
//! calling thread for each call.
//!
//! Replicated brokers: the address may list several (`a:7770,b:7770`).
//! The client logs in at the one that leads: a follower refuses with
//! `[not-leader]` and the leader's address, which the client tries next.
//! When the connection drops, the broker answers nothing for
//! [`ANSWER_WAIT`] (frozen, cut off), or it stops leading, a call logs in
//! again wherever the leader now is and is sent again, for up to
//! [`FAILOVER_WAIT`]; every call is safe to send twice (a lease request
//! without an idempotency key is given one). No call waits for ever.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rgpu_protocol::broker_capnp::{broker, session};
use rgpu_tls::ClientSecurity;
use thiserror::Error;

use crate::credential::Credential;
use crate::rpc::{self, Connection, CONNECT_TIMEOUT};
use crate::views::{
    format_lease_id, read_audit, read_lease, read_server, read_status, read_usage_record, text, AuditView, LeaseSpec, LeaseView,
    MovePlanView, ServerView,
    StatusView, UsageRecordView,
};

#[derive(Debug, Error)]
pub enum ClientError {
    #[error("cannot reach the broker at {addr}: {reason}")]
    Unreachable { addr: String, reason: String },
    /// The broker refused; the text starts with the kind in brackets.
    #[error("{0}")]
    Refused(String),
    #[error("broker connection: {0}")]
    Rpc(String),
    /// The connection dropped (the broker stopped or failed over).
    #[error("broker connection lost: {0}")]
    Lost(String),
    /// TLS could not be set up, or one end expects it and the other does
    /// not: not worth retrying.
    #[error("{0}")]
    Tls(String),
}

/// How long a call keeps looking for a leader when brokers fail over
/// (an election takes the leader's etcd lease TTL, 2 s by default).
pub const FAILOVER_WAIT: Duration = Duration::from_secs(10);

/// How long a call or a login waits for the broker's answer before its
/// connection counts as lost: a broker frozen (SIGSTOP, a stalled VM) or
/// cut off without its TCP connection breaking answers nothing, and a
/// client must not wait on it for ever. A lease request that may queue
/// waits its `wait_ms` more.
pub const ANSWER_WAIT: Duration = Duration::from_secs(10);

/// A client's bounds on waiting; see [`FAILOVER_WAIT`] and [`ANSWER_WAIT`].
#[derive(Debug, Clone, Copy)]
pub struct Waits {
    /// For one answer (a call, a login).
    pub answer: Duration,
    /// For a leader, from a call's first failure.
    pub failover: Duration,
}

impl Default for Waits {
    fn default() -> Self {
        Waits { answer: ANSWER_WAIT, failover: FAILOVER_WAIT }
    }
}

/// `fut`, or `Lost` once `bound` has passed without its answer.
async fn answered<T>(addr: &str, bound: Duration, fut: impl std::future::Future<Output = Result<T, ClientError>>) -> Result<T, ClientError> {
    tokio::time::timeout(bound, fut)
        .await
        .unwrap_or_else(|_| Err(ClientError::Lost(format!("the broker at {addr} did not answer within {} ms", bound.as_millis()))))
}

/// Redirects followed within one pass over the addresses.
const MAX_HOPS: usize = 8;

/// The leader a `[not-leader]` refusal names.
pub fn leader_of(e: &ClientError) -> Option<String> {
    match e {
        ClientError::Refused(t) if e.kind() == Some("not-leader") => {
            t.split("the leader is at ").nth(1).and_then(|r| r.split_whitespace().next()).map(String::from)
        }
        _ => None,
    }
}

/// A broker that may serve shortly: it answered that it does not lead
/// (an election), or the connection dropped.
fn transient(e: &ClientError) -> bool {
    matches!(e, ClientError::Lost(_)) || e.kind() == Some("not-leader")
}

/// `a:1,b:2` as a list.
pub fn addresses(addr: &str) -> Vec<String> {
    addr.split(',').map(str::trim).filter(|a| !a.is_empty()).map(String::from).collect()
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

/// The broker words each refusal "[kind] why"; anything else is the
/// connection failing.
fn from_capnp(e: capnp::Error) -> ClientError {
    // capnp prefixes remote failures with "remote exception: ".
    let t = e.to_string();
    match t.find('[') {
        Some(i) => ClientError::Refused(t[i..].to_string()),
        None if e.kind == capnp::ErrorKind::Disconnected => ClientError::Lost(t),
        None => ClientError::Rpc(t),
    }
}

/// A random idempotency key (not a secret: keys are per tenant).
fn fresh_key() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.write_u32(std::process::id());
    format!("auto-{:016x}", h.finish())
}

/// A blocking, logged-in connection to a broker.
pub struct BrokerClient {
    // Dropped in this order: the capabilities and the connection's task
    // are dropped before the LocalSet that holds it, and that before the
    // runtime it runs on.
    live: RefCell<Live>,
    local: tokio::task::LocalSet,
    rt: tokio::runtime::Runtime,
    /// Every broker address given, in order.
    pub addrs: Vec<String>,
    /// Who this connection is (a copy, for reconnecting).
    pub credential: Credential,
    /// TLS or plaintext, for reconnecting.
    security: ClientSecurity,
    waits: Waits,
}

/// The logged-in connection to the broker that leads.
struct Live {
    session: session::Client,
    conn: Connection<broker::Client>,
    addr: String,
}

fn runtime(addr: &str) -> Result<(tokio::runtime::Runtime, tokio::task::LocalSet), ClientError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| ClientError::Unreachable { addr: addr.to_string(), reason: e.to_string() })?;
    Ok((rt, tokio::task::LocalSet::new()))
}

async fn dial(addr: &str, security: &ClientSecurity) -> Result<Connection<broker::Client>, ClientError> {
    rpc::connect::<broker::Client>(addr, security, CONNECT_TIMEOUT).await.map_err(|e| match e {
        rpc::ConnectError::Tls(t) => ClientError::Tls(t.to_string()),
        e => ClientError::Unreachable { addr: addr.to_string(), reason: e.to_string() },
    })
}

/// What a failed first call on `conn` means: a plaintext connection the
/// broker turned away for want of TLS says so.
fn refused_for_tls(conn: &Connection<broker::Client>, addr: &str, e: ClientError) -> ClientError {
    if conn.refused_for_tls() {
        ClientError::Tls(rgpu_tls::TlsError::ServerWantsTls { addr: addr.to_string() }.to_string())
    } else {
        e
    }
}

/// Logs in at the broker of `addrs` that leads, following redirects; while
/// brokers answer that none leads yet (or the one named is away), tries
/// again until `deadline`. A broker that refuses the login for another
/// reason, or addresses none of which answers, end the search at once.
async fn find_leader(
    addrs: &[String],
    credential: &Credential,
    security: &ClientSecurity,
    deadline: Instant,
    answer: Duration,
) -> Result<Live, ClientError> {
    loop {
        let mut queue: VecDeque<String> = addrs.iter().cloned().collect();
        let (mut hops, mut last, mut electing) = (0, None, false);
        while let Some(addr) = queue.pop_front() {
            let conn = match dial(&addr, security).await {
                Ok(c) => c,
                Err(e @ ClientError::Tls(_)) => return Err(e),
                Err(e) => {
                    last = Some(e);
                    continue;
                }
            };
            let login = async { credential.login(conn.client()).await.map_err(from_capnp).map_err(|e| refused_for_tls(&conn, &addr, e)) };
            match answered(&addr, answer, login).await {
                Ok(session) => return Ok(Live { session, conn, addr }),
                Err(e) if transient(&e) => {
                    electing = true;
                    if let Some(l) = leader_of(&e).filter(|l| *l != addr && hops < MAX_HOPS) {
                        hops += 1;
                        queue.retain(|a| *a != l);
                        queue.push_front(l);
                    }
                    last = Some(e);
                }
                Err(e) => return Err(e),
            }
        }
        let last = last.unwrap_or_else(|| ClientError::Rpc("no broker address given".into()));
        if !electing || Instant::now() >= deadline {
            return Err(last);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The broker's (version, protocol version): the one call that needs no
/// credential (of the first address).
pub fn version(addr: &str, security: &ClientSecurity) -> Result<(String, u32), ClientError> {
    let addr = addresses(addr).into_iter().next().unwrap_or_default();
    let (rt, local) = runtime(&addr)?;
    let conn = local.block_on(&rt, dial(&addr, security))?;
    let req = conn.client().version_request();
    local.block_on(&rt, answered(&addr, ANSWER_WAIT, async {
        let reply = req.send().promise.await.map_err(from_capnp).map_err(|e| refused_for_tls(&conn, &addr, e))?;
        let r = reply.get().map_err(from_capnp)?;
        Ok((r.get_version().ok().and_then(|v| v.to_str().ok()).unwrap_or("").to_string(), r.get_protocol()))
    }))
}

impl BrokerClient {
    /// Connects and logs in as `credential` at the broker that leads of
    /// `addr` (one address, or several comma-separated), over TLS or
    /// plaintext as `security` says.
    pub fn connect(addr: &str, credential: &Credential, security: &ClientSecurity) -> Result<BrokerClient, ClientError> {
        Self::connect_with(addr, credential, security, Waits::default())
    }

    /// [`BrokerClient::connect`], waiting as `waits` says.
    pub fn connect_with(addr: &str, credential: &Credential, security: &ClientSecurity, waits: Waits) -> Result<BrokerClient, ClientError> {
        let addrs = addresses(addr);
        let (rt, local) = runtime(addr)?;
        let live = local.block_on(&rt, find_leader(&addrs, credential, security, Instant::now() + waits.failover, waits.answer))?;
        Ok(BrokerClient {
            live: RefCell::new(live),
            local,
            rt,
            addrs,
            credential: credential.clone(),
            security: security.clone(),
            waits,
        })
    }

    /// The broker this client is logged in at (the leader, when it was).
    pub fn addr(&self) -> String {
        self.live.borrow().addr.clone()
    }

    /// Sends the call `f` makes on the session; if the connection dropped,
    /// the broker did not answer within [`ANSWER_WAIT`] or stopped
    /// leading, logs in at the leader and sends it again, until
    /// [`FAILOVER_WAIT`] has passed since the first failure. So a call
    /// ends within about twice `ANSWER_WAIT` plus `FAILOVER_WAIT`.
    fn call<T, F>(&self, f: impl Fn(&session::Client) -> F) -> Result<T, ClientError>
    where
        F: std::future::Future<Output = Result<T, ClientError>>,
    {
        self.call_waiting(Duration::ZERO, f)
    }

    /// [`BrokerClient::call`] of a call the broker may hold `extra` before
    /// it answers (a queued lease request).
    fn call_waiting<T, F>(&self, extra: Duration, f: impl Fn(&session::Client) -> F) -> Result<T, ClientError>
    where
        F: std::future::Future<Output = Result<T, ClientError>>,
    {
        let mut deadline: Option<Instant> = None;
        loop {
            let (fut, addr) = {
                let live = self.live.borrow();
                (f(&live.session), live.addr.clone())
            };
            let bound = self.waits.answer.saturating_add(extra);
            match self.local.block_on(&self.rt, answered(&addr, bound, fut)) {
                Err(e) if transient(&e) => {
                    // The search for a leader is timed from the first failure.
                    let deadline = *deadline.get_or_insert_with(|| Instant::now() + self.waits.failover);
                    if Instant::now() >= deadline {
                        return Err(e);
                    }
                    let live = self.local.block_on(
                        &self.rt,
                        find_leader(&self.addrs, &self.credential, &self.security, deadline, self.waits.answer),
                    );
                    match live {
                        Ok(l) => *self.live.borrow_mut() = l,
                        Err(e2) if transient(&e2) || matches!(e2, ClientError::Unreachable { .. }) => {
                            if Instant::now() >= deadline {
                                return Err(e2);
                            }
                            std::thread::sleep(Duration::from_millis(100));
                        }
                        Err(e2) => return Err(e2),
                    }
                }
                r => return r,
            }
        }
    }

    /// True once the broker closed the connection.
    pub fn is_closed(&self) -> bool {
        self.live.borrow().conn.is_closed()
    }

    /// (tenant, role) as the broker sees this connection.
    pub fn whoami(&self) -> Result<(String, String), ClientError> {
        self.call(|c| {
            let req = c.whoami_request();
            async move {
                let reply = req.send().promise.await.map_err(from_capnp)?;
                let r = reply.get().map_err(from_capnp)?;
                let t = |x: capnp::Result<capnp::text::Reader<'_>>| x.ok().and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
                Ok((t(r.get_tenant()), t(r.get_role())))
            }
        })
    }

    /// A request without an idempotency key is given a fresh one, so that
    /// sending it again after a failover returns the lease the first
    /// attempt may have been granted rather than a second one.
    pub fn lease(&self, s: &LeaseSpec) -> Result<LeaseView, ClientError> {
        let mut keyed;
        let s = if s.key.is_empty() {
            keyed = s.clone();
            keyed.key = fresh_key();
            &keyed
        } else {
            s
        };
        self.call_waiting(Duration::from_millis(s.wait_ms), |c| {
            let mut req = c.lease_request();
            s.write(req.get().init_request());
            async move {
                let reply = req.send().promise.await.map_err(from_capnp)?;
                read_lease(reply.get().and_then(|r| r.get_lease()).map_err(from_capnp)?).map_err(from_capnp)
            }
        })
    }

    pub fn renew(&self, id: u64, ttl_ms: u64) -> Result<LeaseView, ClientError> {
        self.call(|c| {
            let mut req = c.renew_request();
            req.get().set_lease_id(id);
            req.get().set_ttl_ms(ttl_ms);
            async move {
                let reply = req.send().promise.await.map_err(from_capnp)?;
                read_lease(reply.get().and_then(|r| r.get_lease()).map_err(from_capnp)?).map_err(from_capnp)
            }
        })
    }

    /// Asks one of this credential's leases suspended to its server's disk,
    /// its GPUs freed, until [`Self::resume`]; it comes back `suspending`.
    pub fn suspend(&self, id: u64) -> Result<LeaseView, ClientError> {
        self.call(|c| {
            let mut req = c.suspend_request();
            req.get().set_lease_id(id);
            async move {
                let reply = req.send().promise.await.map_err(from_capnp)?;
                read_lease(reply.get().and_then(|r| r.get_lease()).map_err(from_capnp)?).map_err(from_capnp)
            }
        })
    }

    /// Lets a lease [`Self::suspend`] suspended take its GPUs back.
    pub fn resume(&self, id: u64) -> Result<LeaseView, ClientError> {
        self.call(|c| {
            let mut req = c.resume_request();
            req.get().set_lease_id(id);
            async move {
                let reply = req.send().promise.await.map_err(from_capnp)?;
                read_lease(reply.get().and_then(|r| r.get_lease()).map_err(from_capnp)?).map_err(from_capnp)
            }
        })
    }

    /// True if the lease was live; releasing an ended lease is not an error.
    pub fn release(&self, id: u64) -> Result<bool, ClientError> {
        self.call(|c| {
            let mut req = c.release_request();
            req.get().set_lease_id(id);
            async move {
                let reply = req.send().promise.await.map_err(from_capnp)?;
                Ok(reply.get().map_err(from_capnp)?.get_released())
            }
        })
    }

    /// The leases this credential may see ("" for all of them; a user sees
    /// its own tenant's only).
    pub fn leases(&self, tenant: &str) -> Result<Vec<LeaseView>, ClientError> {
        self.call(|c| {
            let mut req = c.list_leases_request();
            req.get().set_tenant(tenant);
            async move {
                let reply = req.send().promise.await.map_err(from_capnp)?;
                let list = reply.get().and_then(|r| r.get_leases()).map_err(from_capnp)?;
                list.iter().map(|l| read_lease(l).map_err(from_capnp)).collect()
            }
        })
    }

    pub fn servers(&self) -> Result<Vec<ServerView>, ClientError> {
        self.call(|c| {
            let req = c.list_servers_request();
            async move {
                let reply = req.send().promise.await.map_err(from_capnp)?;
                let list = reply.get().and_then(|r| r.get_servers()).map_err(from_capnp)?;
                Ok(list.iter().map(read_server).collect())
            }
        })
    }

    /// `deadline_ms`: unix ms, or 0 for none. Needs the operator role.
    pub fn drain(&self, server: &str, deadline_ms: u64) -> Result<ServerView, ClientError> {
        self.call(|c| {
            let mut req = c.drain_request();
            req.get().set_server_id(server);
            req.get().set_deadline_ms(deadline_ms);
            async move {
                let reply = req.send().promise.await.map_err(from_capnp)?;
                Ok(read_server(reply.get().and_then(|r| r.get_server()).map_err(from_capnp)?))
            }
        })
    }

    /// A drain that also moves the server's leases elsewhere by live
    /// migration: the server, and per lease the target chosen or why none.
    pub fn drain_migrate(&self, server: &str, deadline_ms: u64) -> Result<(ServerView, Vec<MovePlanView>), ClientError> {
        self.call(|c| {
            let mut req = c.drain_request();
            req.get().set_server_id(server);
            req.get().set_deadline_ms(deadline_ms);
            req.get().set_migrate(true);
            async move {
                let reply = req.send().promise.await.map_err(from_capnp)?;
                let r = reply.get().map_err(from_capnp)?;
                let s = read_server(r.get_server().map_err(from_capnp)?);
                let moves = r
                    .get_moves()
                    .map_err(from_capnp)?
                    .iter()
                    .map(|m| MovePlanView {
                        lease: format_lease_id(m.get_lease()),
                        target: text(m.get_target()),
                        reason: text(m.get_reason()),
                    })
                    .collect();
                Ok((s, moves))
            }
        })
    }

    /// Moves lease `id` by live migration to `server` ("" for any server
    /// that can take it); the lease comes back with `moving_to` set.
    pub fn move_lease(&self, id: u64, server: &str) -> Result<LeaseView, ClientError> {
        self.call(|c| {
            let mut req = c.move_lease_request();
            req.get().set_lease_id(id);
            req.get().set_server_id(server);
            async move {
                let reply = req.send().promise.await.map_err(from_capnp)?;
                read_lease(reply.get().and_then(|r| r.get_lease()).map_err(from_capnp)?).map_err(from_capnp)
            }
        })
    }

    pub fn undrain(&self, server: &str) -> Result<ServerView, ClientError> {
        self.call(|c| {
            let mut req = c.undrain_request();
            req.get().set_server_id(server);
            async move {
                let reply = req.send().promise.await.map_err(from_capnp)?;
                Ok(read_server(reply.get().and_then(|r| r.get_server()).map_err(from_capnp)?))
            }
        })
    }

    pub fn status(&self) -> Result<StatusView, ClientError> {
        self.call(|c| {
            let req = c.status_request();
            async move {
                let reply = req.send().promise.await.map_err(from_capnp)?;
                Ok(read_status(reply.get().and_then(|r| r.get_status()).map_err(from_capnp)?))
            }
        })
    }

    /// The newest `limit` audit records (of `tenant`, "" for all), oldest
    /// first. Needs the operator role.
    pub fn audit(&self, tenant: &str, limit: u32) -> Result<Vec<AuditView>, ClientError> {
        self.call(|c| {
            let mut req = c.audit_request();
            req.get().set_tenant(tenant);
            req.get().set_limit(limit);
            async move {
                let reply = req.send().promise.await.map_err(from_capnp)?;
                let list = reply.get().and_then(|r| r.get_records()).map_err(from_capnp)?;
                Ok(list.iter().map(read_audit).collect())
            }
        })
    }

    /// Accounting: records of leases that ended at or after `since_ms`,
    /// then live leases so far, the newest `limit` (0: the broker's
    /// default). A user sees its own tenant's; an operator `tenant`'s ("" for all).
    pub fn usage(&self, tenant: &str, since_ms: u64, limit: u32) -> Result<Vec<UsageRecordView>, ClientError> {
        self.call(|c| {
            let mut req = c.usage_request();
            req.get().set_tenant(tenant);
            req.get().set_since_ms(since_ms);
            req.get().set_limit(limit);
            async move {
                let reply = req.send().promise.await.map_err(from_capnp)?;
                let list = reply.get().and_then(|r| r.get_records()).map_err(from_capnp)?;
                list.iter().map(|r| read_usage_record(r).map_err(from_capnp)).collect()
            }
        })
    }

    /// Refuses `tenant`'s credentials issued before `before_serial` (unix
    /// ms, at most now); returns the serial now required. Needs the admin role.
    pub fn revoke(&self, tenant: &str, before_serial: u64) -> Result<u64, ClientError> {
        self.call(|c| {
            let mut req = c.revoke_credentials_request();
            req.get().set_tenant(tenant);
            req.get().set_before_serial(before_serial);
            async move {
                let reply = req.send().promise.await.map_err(from_capnp)?;
                Ok(reply.get().map_err(from_capnp)?.get_before_serial())
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use capnp::capability::Rc;
    use capnp_rpc::rpc_twoparty_capnp::Side;
    use capnp_rpc::{twoparty, RpcSystem};
    use futures::AsyncReadExt;
    use rgpu_protocol::auth::Role;
    use std::cell::RefCell;
    use tokio_util::compat::TokioAsyncReadCompatExt;

    const KEY: &[u8] = b"the credential key";

    /// A broker that logs in whoever proves a credential under [`KEY`]
    /// over its challenge.
    struct Fake {
        nonce: RefCell<Vec<u8>>,
    }

    /// The session it gives: one canned lease, renewals refused as the
    /// real broker words refusals.
    struct FakeSession {
        tenant: String,
    }

    impl broker::Server for Fake {
        async fn challenge(self: Rc<Self>, _: broker::ChallengeParams, mut r: broker::ChallengeResults) -> Result<(), capnp::Error> {
            *self.nonce.borrow_mut() = vec![5; 32];
            r.get().set_nonce(&[5; 32]);
            Ok(())
        }

        async fn login(self: Rc<Self>, p: broker::LoginParams, mut r: broker::LoginResults) -> Result<(), capnp::Error> {
            let p = p.get()?;
            let tenant = p.get_tenant()?.to_string()?;
            let c = Credential::issue(KEY, &tenant, Role::parse(p.get_role()?.to_str()?).unwrap(), p.get_serial()).unwrap();
            if p.get_nonce()? != &self.nonce.borrow()[..] || p.get_proof()? != c.proof(&self.nonce.borrow()) {
                return Err(capnp::Error::failed("[auth] login refused".into()));
            }
            r.get().set_session(capnp_rpc::new_client(FakeSession { tenant }));
            Ok(())
        }
    }

    impl session::Server for FakeSession {
        async fn lease(self: Rc<Self>, p: session::LeaseParams, mut r: session::LeaseResults) -> Result<(), capnp::Error> {
            let req = p.get()?.get_request()?;
            let mut l = r.get().init_lease();
            l.set_id(0x2a);
            l.set_tenant(&self.tenant);
            l.set_generation(u64::from(req.get_gpus()));
            let mut g = l.init_gpus(1);
            g.reborrow().get(0).set_server("gpu1:7767");
            g.get(0).set_uuid(&[7; 16]);
            Ok(())
        }

        async fn renew(self: Rc<Self>, _: session::RenewParams, _: session::RenewResults) -> Result<(), capnp::Error> {
            Err(capnp::Error::failed("[not-found] lease 000000000000002a is not live".into()))
        }
    }

    /// Serves `Fake` on a loopback port from its own thread.
    fn start_fake() -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            tokio::task::LocalSet::new().block_on(&rt, async move {
                listener.set_nonblocking(true).unwrap();
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                loop {
                    let (s, _) = listener.accept().await.unwrap();
                    let cap: broker::Client = capnp_rpc::new_client(Fake { nonce: RefCell::new(Vec::new()) });
                    let (reader, writer) = s.compat().split();
                    let net = twoparty::VatNetwork::new(
                        futures::io::BufReader::new(reader),
                        futures::io::BufWriter::new(writer),
                        Side::Server,
                        Default::default(),
                    );
                    tokio::task::spawn_local(RpcSystem::new(Box::new(net), Some(cap.client)));
                }
            });
        });
        addr
    }

    #[test]
    fn refusals_keep_their_kind_and_connection_failures_have_none() {
        let e = from_capnp(capnp::Error::failed("remote exception: [quota] tenant t is at 4 GPUs".into()));
        assert_eq!(e.kind(), Some("quota"));
        assert_eq!(e.to_string(), "[quota] tenant t is at 4 GPUs");
        let e = from_capnp(capnp::Error::disconnected("connection reset".into()));
        assert!(matches!(e, ClientError::Lost(_)), "a dropped connection is worth a new login: {e:?}");
        assert_eq!(e.kind(), None);
        let e = from_capnp(capnp::Error::unimplemented("no such method".into()));
        assert!(matches!(e, ClientError::Rpc(_)), "{e:?}");
    }

    #[test]
    fn a_follower_names_the_leader() {
        let e = ClientError::Refused("[not-leader] this broker follows; the leader is at 10.0.0.2:7770".into());
        assert_eq!(leader_of(&e).as_deref(), Some("10.0.0.2:7770"));
        assert!(transient(&e));
        let e = ClientError::Refused("[not-leader] no broker leads yet (an election is under way); try again".into());
        assert_eq!(leader_of(&e), None);
        assert!(transient(&e), "an election: try again");
        let e = ClientError::Refused("[auth] the leader is at x:1".into());
        assert_eq!(leader_of(&e), None, "only a not-leader refusal redirects");
        assert!(!transient(&e));
        assert_eq!(addresses(" a:1, b:2,,"), ["a:1", "b:2"]);
    }

    #[test]
    fn an_absent_broker_is_unreachable() {
        let addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
        let c = Credential::issue(KEY, "ana", Role::User, 1).unwrap();
        match BrokerClient::connect(&addr, &c, &ClientSecurity::Plaintext) {
            Err(e @ ClientError::Unreachable { .. }) => assert!(e.to_string().contains(&addr), "{e}"),
            Err(e) => panic!("expected Unreachable, got {e:?}"),
            Ok(_) => panic!("connected to a closed port"),
        }
    }

    #[test]
    fn calls_against_a_broker() {
        let addr = start_fake();
        let wrong = Credential::issue(b"another key", "ana", Role::User, 1).unwrap();
        let e = BrokerClient::connect(&addr, &wrong, &ClientSecurity::Plaintext).err().expect("a credential of another key logs in");
        assert_eq!(e.kind(), Some("auth"), "{e}");
        let c = BrokerClient::connect(&addr, &Credential::issue(KEY, "ana", Role::User, 1).unwrap(), &ClientSecurity::Plaintext).unwrap();
        let spec = LeaseSpec { gpus: 3, ..LeaseSpec::default() };
        let l = c.lease(&spec).unwrap();
        assert_eq!((l.id.as_str(), l.tenant.as_str(), l.generation), ("000000000000002a", "ana", 3));
        assert_eq!(l.servers(), ["gpu1:7767"]);
        let e = c.renew(0x2a, 1000).unwrap_err();
        assert_eq!(e.kind(), Some("not-found"), "{e}");
        // A method the broker does not serve is no refusal.
        assert_eq!(c.status().unwrap_err().kind(), None);
    }
}
