//! Who may do what on the broker, against a real rgpu-broker on loopback:
//! each test replays one attack that worked when the broker authenticated
//! no one (issue 16, findings 1, 6 and 7) and checks it is refused now.
//! GPU servers are registered by the test itself, over the same API an
//! rgpu-server uses, so that it can also tamper with what they send.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{credential, free_port, login, start, wait_for, Proc};
use rgpu_broker_client::rpc::{self, CONNECT_TIMEOUT};
use rgpu_broker_client::{BrokerClient, ClientError, LeaseSpec, LeaseView, Role};
use rgpu_protocol::auth::register_message;
use rgpu_protocol::broker_capnp::{broker, server_agent};
use rgpu_protocol::token::{parse_key, sign_bytes};

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rgpu-sec-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A broker whose servers stay reachable for the whole test without
/// heartbeating (60 s heartbeats), and tenants hold at most 3 leases
/// unless their policy says otherwise.
fn broker(dir: &Path, addr: &str) -> Proc {
    let cfg = dir.join("broker.toml");
    std::fs::write(&cfg, "[tenants.flood]\nmax-rate = 5\n").unwrap();
    start(
        "rgpu-broker",
        &[
            "--listen", addr,
            "--data-dir", dir.join("data").to_str().unwrap(),
            "--key-file", dir.join("key").to_str().unwrap(),
            "--admin-key-file", dir.join("admin.key").to_str().unwrap(),
            "--create-key",
            "--heartbeat-ms", "60000",
            "--default-max-leases", "3",
            "--config", cfg.to_str().unwrap(),
        ],
    )
}

fn local<T>(f: impl std::future::Future<Output = T>) -> T {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    tokio::task::LocalSet::new().block_on(&rt, f)
}

/// How a registration is made (honestly by default).
#[derive(Clone, Copy, Default)]
struct Tamper {
    /// Claim this many GPUs after the proof was made for the real ones.
    gpus_after_signing: Option<u32>,
    /// Prove over a nonce drawn on another connection.
    foreign_nonce: bool,
}

/// Registers server `id` with `gpus` GPUs over `c`, as rgpu-server does:
/// challenge, then the inventory with a proof under the token `key`.
async fn register(
    c: &broker::Client,
    key: &[u8],
    id: &str,
    gpus: u32,
    tamper: Tamper,
    other: Option<&broker::Client>,
) -> Result<server_agent::Client, capnp::Error> {
    let from = if tamper.foreign_nonce { other.unwrap() } else { c };
    let nonce = from.challenge_request().send().promise.await?.get()?.get_nonce()?.to_vec();
    let mut req = c.register_request();
    let fill = |mut s: rgpu_protocol::broker_capnp::server_info::Builder<'_>, n: u32| {
        s.set_id(id);
        s.set_node(id);
        s.reborrow().init_transports(1).set(0, "tcp");
        let mut gs = s.init_gpus(n);
        for g in 0..n {
            let mut x = gs.reborrow().get(g);
            x.set_uuid(&[id.len() as u8, g as u8, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]);
            x.set_ordinal(g);
            x.set_model("sim");
            x.set_memory(16 << 30);
            x.set_healthy(true);
        }
    };
    fill(req.get().init_server(), gpus);
    let msg = register_message(&nonce, req.get().get_server()?.into_reader())?;
    req.get().set_nonce(&nonce);
    req.get().set_proof(&sign_bytes(key, &msg));
    if let Some(n) = tamper.gpus_after_signing {
        fill(req.get().init_server(), n);
    }
    Ok(req.send().promise.await?.get()?.get_agent()?)
}

/// Registers `id` on a connection of its own and leaves it registered.
fn register_server(addr: &str, dir: &Path, id: &str, gpus: u32) {
    let key = token_key(dir);
    local(async {
        let conn = rpc::connect::<broker::Client>(addr, &rgpu_tls::ClientSecurity::Plaintext, CONNECT_TIMEOUT).await.unwrap();
        register(conn.client(), &key, id, gpus, Tamper::default(), None).await.unwrap();
    });
}

fn token_key(dir: &Path) -> Vec<u8> {
    parse_key(&std::fs::read(dir.join("key")).unwrap()).unwrap()
}

fn kind<T: std::fmt::Debug>(r: Result<T, ClientError>) -> String {
    match r {
        Ok(v) => format!("ok: {v:?}"),
        Err(e) => e.kind().unwrap_or("?").to_string(),
    }
}

fn one_gpu(key: &str) -> LeaseSpec {
    LeaseSpec { gpus: 1, ttl_ms: 60_000, key: key.into(), ..LeaseSpec::default() }
}

/// A TCP proxy in front of `upstream` that records what the client sends:
/// an eavesdropper's copy of a connection, to replay later.
fn recording_proxy(upstream: &str) -> (String, Arc<Mutex<Vec<u8>>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (up, rec) = (upstream.to_string(), seen.clone());
    std::thread::spawn(move || {
        let (mut client, _) = l.accept().unwrap();
        let mut server = TcpStream::connect(&up).unwrap();
        let (mut c2, mut s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut s2, &mut c2);
            let _ = c2.shutdown(std::net::Shutdown::Both);
        });
        let mut buf = [0u8; 8192];
        loop {
            match client.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    rec.lock().unwrap().extend_from_slice(&buf[..n]);
                    if server.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = server.shutdown(std::net::Shutdown::Both);
    });
    (addr, seen)
}

/// Sends `bytes` to `addr` on a fresh connection, as an attacker replaying
/// a recording would, and reads the answers for a while.
fn replay(addr: &str, bytes: &[u8]) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(bytes).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
    let mut sink = [0u8; 8192];
    while let Ok(n) = s.read(&mut sink) {
        if n == 0 {
            break;
        }
    }
}

/// Finding 1: with no credential one listed every tenant's leases, renewed
/// (and got a fresh token for) another tenant's lease, released it, and got
/// it back by reusing its idempotency key.
#[test]
fn two_tenants_cannot_see_renew_release_or_use_each_others_leases() {
    let dir = temp_dir("tenants");
    let addr = free_port();
    let _b = broker(&dir, &addr);
    register_server(&addr, &dir, "10.0.0.1:7767", 4);

    // Without a credential: the version, and nothing else.
    let (version, protocol) = rgpu_broker_client::client::version(&addr, &rgpu_tls::ClientSecurity::Plaintext).unwrap();
    assert_eq!((version.as_str(), protocol), (env!("CARGO_PKG_VERSION"), rgpu_protocol::PROTOCOL_VERSION));
    let forged = credential(&dir, "key", "alice", Role::Admin);
    // (issued with the token key, not the admin key the broker issues with)
    assert_eq!(kind(BrokerClient::connect(&addr, &forged, &rgpu_tls::ClientSecurity::Plaintext).map(|_| ())), "auth");
    let no_challenge = local(async {
        let conn = rpc::connect::<broker::Client>(&addr, &rgpu_tls::ClientSecurity::Plaintext, CONNECT_TIMEOUT).await.unwrap();
        let mut req = conn.client().login_request();
        req.get().set_tenant("alice");
        req.get().set_role("user");
        req.send().promise.await.map(|_| ()).map_err(|e| e.to_string())
    });
    assert!(no_challenge.unwrap_err().contains("[auth]"));
    // Nor can it hand the broker a huge message to hold.
    let huge = local(async {
        let conn = rpc::connect::<broker::Client>(&addr, &rgpu_tls::ClientSecurity::Plaintext, CONNECT_TIMEOUT).await.unwrap();
        let mut req = conn.client().login_request();
        req.get().set_tenant(&"x".repeat(2 << 20));
        req.send().promise.await.map(|_| ()).map_err(|e| e.to_string())
    });
    let huge = huge.unwrap_err();
    assert!(!huge.contains("[auth]"), "a 2 MiB login was read (and refused only for its tenant): {huge}");

    let alice = login(&addr, &dir, "alice", Role::User);
    let bob = login(&addr, &dir, "bob", Role::User);
    assert_eq!(alice.whoami().unwrap(), ("alice".to_string(), "user".to_string()));
    let a: LeaseView = alice.lease(&one_gpu("job-1")).unwrap();
    assert_eq!(a.tenant, "alice");
    assert!(!a.token.is_empty());

    // Bob sees only his own leases, and may not ask for alice's.
    assert!(bob.leases("").unwrap().is_empty());
    assert_eq!(kind(bob.leases("alice")), "auth");
    // Renewing alice's lease: no such lease, as far as bob can tell; no token.
    assert_eq!(kind(bob.renew(a.id_u64(), 3_600_000)), "not-found");
    assert_eq!(alice.leases("").unwrap()[0].deadline_ms, a.deadline_ms, "alice's lease was not extended");
    // Releasing it: answered as an ended lease; it lives on.
    assert!(!bob.release(a.id_u64()).unwrap());
    assert_eq!(alice.leases("").unwrap().len(), 1);
    // Suspending or resuming it: no such lease either; it runs on.
    assert_eq!(kind(bob.suspend(a.id_u64())), "not-found");
    assert_eq!(kind(bob.resume(a.id_u64())), "not-found");
    assert_eq!(alice.leases("").unwrap()[0].state, "active", "bob suspended alice's lease");
    // Alice's idempotency key gives bob a lease of his own, not hers.
    let b = bob.lease(&one_gpu("job-1")).unwrap();
    assert_ne!(b.id, a.id);
    assert_eq!(b.tenant, "bob");
    // The tenant comes from the credential, not the request.
    let mut as_alice = one_gpu("");
    as_alice.tenant = "alice".into();
    assert_eq!(kind(bob.lease(&as_alice)), "auth");
    // Operators' and admins' calls are not for users.
    assert_eq!(kind(bob.drain("10.0.0.1:7767", 0)), "auth");
    assert_eq!(kind(bob.move_lease(b.id_u64(), "")), "auth", "not even his own");
    assert_eq!(kind(alice.move_lease(a.id_u64(), "")), "auth");
    assert_eq!(kind(bob.audit("", 10)), "auth");
    assert_eq!(kind(bob.revoke("alice", u64::MAX)), "auth");

    // An operator sees both, and the audit log says who did what from where.
    let ops = login(&addr, &dir, "ops", Role::Operator);
    let mut all: Vec<String> = ops.leases("").unwrap().into_iter().map(|l| l.tenant).collect();
    all.sort();
    assert_eq!(all, ["alice", "bob"]);
    let log = ops.audit("", 1000).unwrap();
    let find = |actor: &str, op: &str, ok: bool| log.iter().find(|r| r.actor == actor && r.op == op && r.ok == ok);
    let granted = find("alice/user", "lease", true).expect("alice's lease is in the audit log");
    assert_eq!(granted.target, a.id);
    assert!(granted.peer.starts_with("127.0.0.1:"), "{granted:?}");
    assert_eq!(find("bob/user", "renew", false).map(|r| r.target.as_str()), Some(a.id.as_str()));
    assert_eq!(find("bob/user", "release", true).map(|r| r.detail.as_str()), Some("not live"));
    assert_eq!(find("alice/user", "move", false).map(|r| r.target.as_str()), Some(a.id.as_str()), "a refused move is recorded");
    assert!(find("-", "login", false).is_some(), "the forged login is recorded");
    assert!(find("server:10.0.0.1:7767", "register", true).is_some());
    assert_eq!(ops.audit("bob", 1000).unwrap().iter().filter(|r| r.actor != "bob/user" && r.target != "bob").count(), 0);

    assert!(alice.release(a.id_u64()).unwrap());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Finding 1: one client took 5,250 leases in under 3 s.
#[test]
fn default_quotas_and_the_request_rate_hold() {
    let dir = temp_dir("quota");
    let addr = free_port();
    let _b = broker(&dir, &addr);
    register_server(&addr, &dir, "10.0.0.2:7767", 8);
    let carol = login(&addr, &dir, "carol", Role::User);
    for i in 0..3 {
        carol.lease(&one_gpu(&format!("k{i}"))).unwrap();
    }
    let e = carol.lease(&one_gpu("k3")).unwrap_err();
    assert_eq!(e.kind(), Some("quota"), "{e}");
    assert!(e.to_string().contains("3 leases"), "{e}");
    let mut nine = one_gpu("");
    nine.gpus = 9;
    assert_eq!(kind(login(&addr, &dir, "dave", Role::User).lease(&nine)), "quota", "8 GPUs by default");

    // 5 requests a second (bursts of 10) for tenant flood.
    let flood = login(&addr, &dir, "flood", Role::User);
    let refused = (0..40).filter(|_| flood.whoami().is_err_and(|e| e.kind() == Some("rate"))).count();
    assert!(refused >= 25, "{refused} of 40 refused");
    assert!(carol.whoami().is_ok(), "one tenant's flood does not slow the others");

    // Bad proofs from one host: refused without a look once over 5 a
    // second (bursts of 10), so they cannot fill the audit log; a moment
    // later that host logs in again.
    let forged = credential(&dir, "key", "carol", Role::User);
    let kinds: Vec<String> = (0..30).map(|_| kind(BrokerClient::connect(&addr, &forged, &rgpu_tls::ClientSecurity::Plaintext).map(|_| ()))).collect();
    assert_eq!(kinds.iter().filter(|k| *k == "auth").count(), 10, "{kinds:?}");
    assert_eq!(kinds.iter().filter(|k| *k == "rate").count(), 20, "{kinds:?}");
    let ops = login_when_allowed(&addr, &dir);
    let failed = ops.audit("", 1000).unwrap().iter().filter(|r| r.op == "login" && !r.ok).count();
    assert_eq!(failed, 10, "only the bad proofs looked at are in the log");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Logs in as an operator, waiting (bounded) out the failed-proof limit.
fn login_when_allowed(addr: &str, dir: &Path) -> BrokerClient {
    let cred = credential(dir, "admin.key", "ops", Role::Operator);
    let mut out = None;
    wait_for("the failed-login limit to let a good login through", || {
        out = BrokerClient::connect(addr, &cred, &rgpu_tls::ClientSecurity::Plaintext).ok();
        out.is_some()
    });
    out.unwrap()
}

/// Finding 7: a server's recorded registration and heartbeat bytes,
/// replayed, re-registered it (with 8 fake GPUs once edited).
#[test]
fn replayed_or_tampered_registrations_are_refused() {
    let dir = temp_dir("register");
    let addr = free_port();
    let _b = broker(&dir, &addr);
    let key = token_key(&dir);
    let id = "10.0.0.3:7767";

    // The real server registers (2 GPUs) and heartbeats through a wiretap.
    let (tap, recorded) = recording_proxy(&addr);
    local(async {
        let conn = rpc::connect::<broker::Client>(&tap, &rgpu_tls::ClientSecurity::Plaintext, CONNECT_TIMEOUT).await.unwrap();
        let agent = register(conn.client(), &key, id, 2, Tamper::default(), None).await.unwrap();
        let hb = agent.heartbeat_request().send().promise.await.unwrap();
        assert!(hb.get().unwrap().get_known());
    });
    let ops = login(&addr, &dir, "ops", Role::Operator);
    let gpus = |ops: &BrokerClient| ops.servers().unwrap().iter().find(|s| s.id == id).map(|s| s.gpus);
    assert_eq!(gpus(&ops), Some(2));
    let before = ops.audit("", 1000).unwrap().len();

    // The recording, replayed on a new connection, proves nothing.
    let bytes = recorded.lock().unwrap().clone();
    assert!(bytes.len() > 100, "recorded {} bytes", bytes.len());
    replay(&addr, &bytes);
    wait_for("the replay's registration in the audit log", || {
        ops.audit("", 1000).unwrap()[before..].iter().any(|r| r.op == "register")
    });
    let after = ops.audit("", 1000).unwrap();
    let replayed: Vec<_> = after[before..].iter().filter(|r| r.op == "register").collect();
    assert!(replayed.iter().all(|r| !r.ok), "{replayed:?}");
    assert!(replayed[0].detail.contains("[auth]"), "{replayed:?}");

    // Fresh proofs, but over an inventory edited after signing, or over
    // another connection's nonce, or with the wrong key.
    local(async {
        let conn = rpc::connect::<broker::Client>(&addr, &rgpu_tls::ClientSecurity::Plaintext, CONNECT_TIMEOUT).await.unwrap();
        let other = rpc::connect::<broker::Client>(&addr, &rgpu_tls::ClientSecurity::Plaintext, CONNECT_TIMEOUT).await.unwrap();
        let c = conn.client();
        let more = Tamper { gpus_after_signing: Some(8), ..Tamper::default() };
        let e = register(c, &key, id, 2, more, None).await.err().expect("8 fake GPUs registered");
        assert!(e.to_string().contains("[auth]"), "{e}");
        let foreign = Tamper { foreign_nonce: true, ..Tamper::default() };
        let e = register(c, &key, id, 2, foreign, Some(other.client())).await.err().expect("a foreign nonce");
        assert!(e.to_string().contains("[auth]"), "{e}");
        let e = register(c, b"not the broker's key", id, 8, Tamper::default(), None).await.err().expect("wrong key");
        assert!(e.to_string().contains("[auth]"), "{e}");
    });
    assert_eq!(gpus(&ops), Some(2), "the inventory is what the real server registered");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Finding 6: an operator's drain, recorded, drained again after a broker
/// restart (its proof was remembered only in memory); `forShutdown` was
/// not covered by the proof.
#[test]
fn a_recorded_drain_replayed_before_or_after_a_restart_is_refused() {
    let dir = temp_dir("drain");
    let addr = free_port();
    let mut b = broker(&dir, &addr);
    let (s1, s2) = ("10.0.0.4:7767", "10.0.0.5:7767");
    register_server(&addr, &dir, s1, 1);
    register_server(&addr, &dir, s2, 1);

    let (tap, recorded) = recording_proxy(&addr);
    let ops_cred = credential(&dir, "admin.key", "ops", Role::Operator);
    BrokerClient::connect(&tap, &ops_cred, &rgpu_tls::ClientSecurity::Plaintext).unwrap().drain(s1, 0).unwrap();
    let ops = BrokerClient::connect(&addr, &ops_cred, &rgpu_tls::ClientSecurity::Plaintext).unwrap();
    let draining = |ops: &BrokerClient, id: &str| ops.servers().unwrap().iter().any(|s| s.id == id && s.draining);
    wait_for("the tapped drain", || draining(&ops, s1));
    ops.undrain(s1).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let bytes = recorded.lock().unwrap().clone();

    replay(&addr, &bytes);
    assert!(!draining(&ops, s1), "replayed to the same broker");
    drop(ops);
    b.child.kill().unwrap();
    let _ = b.child.wait();
    let _b = broker(&dir, &addr);
    replay(&addr, &bytes);
    let ops = BrokerClient::connect(&addr, &ops_cred, &rgpu_tls::ClientSecurity::Plaintext).unwrap();
    assert!(!draining(&ops, s1), "replayed to the restarted broker");
    let refused = ops.audit("", 1000).unwrap().into_iter().filter(|r| r.op == "login" && !r.ok).count();
    assert!(refused >= 2, "both replays' logins refused: {refused}");

    // A drain for shutdown comes only from the server itself, for itself.
    local(async {
        let conn = rpc::connect::<broker::Client>(&addr, &rgpu_tls::ClientSecurity::Plaintext, CONNECT_TIMEOUT).await.unwrap();
        let agent = register(conn.client(), &token_key(&dir), s2, 1, Tamper::default(), None).await.unwrap();
        let mut req = agent.drain_for_shutdown_request();
        req.get().set_deadline_ms(0);
        let r = req.send().promise.await.unwrap();
        assert_eq!(r.get().unwrap().get_server().unwrap().get_id().unwrap(), s2);
    });
    assert!(draining(&ops, s2) && !draining(&ops, s1));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Rotation: revoking refuses the tenant's older credentials at once (an
/// open session too) and after a restart; a newer one logs in.
#[test]
fn revoked_credentials_stay_revoked_across_a_restart() {
    let dir = temp_dir("revoke");
    let addr = free_port();
    let mut b = broker(&dir, &addr);
    let old = credential(&dir, "admin.key", "erin", Role::User);
    let erin = BrokerClient::connect(&addr, &old, &rgpu_tls::ClientSecurity::Plaintext).unwrap();
    assert!(erin.whoami().is_ok());
    std::thread::sleep(Duration::from_millis(5));
    let admin = login(&addr, &dir, "root", Role::Admin);
    let before = admin.revoke("erin", rgpu_pool_broker::service::now_ms()).unwrap();
    assert!(before > old.serial);
    assert_eq!(kind(erin.whoami()), "auth", "the open session is refused");
    assert_eq!(kind(BrokerClient::connect(&addr, &old, &rgpu_tls::ClientSecurity::Plaintext).map(|_| ())), "auth");
    drop((erin, admin));
    b.child.kill().unwrap();
    let _ = b.child.wait();
    let _b = broker(&dir, &addr);
    assert_eq!(kind(BrokerClient::connect(&addr, &old, &rgpu_tls::ClientSecurity::Plaintext).map(|_| ())), "auth", "after a restart");
    let new = credential(&dir, "admin.key", "erin", Role::User);
    assert!(BrokerClient::connect(&addr, &new, &rgpu_tls::ClientSecurity::Plaintext).unwrap().whoami().is_ok());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A lease asked with a client key gets tokens bound to it: the first, the
/// renewed one and, after a restart, the one renewed then (the key is
/// stored with the lease).
#[test]
fn a_bound_lease_keeps_its_client_key_through_renewals_and_restarts() {
    let dir = temp_dir("bound");
    let addr = free_port();
    let mut b = broker(&dir, &addr);
    register_server(&addr, &dir, "10.0.0.2:7767", 2);
    let carol = login(&addr, &dir, "carol", Role::User);
    let key = rgpu_protocol::binding::ClientKey::generate().unwrap().public();
    let bound_to = |l: &LeaseView| {
        let t = rgpu_protocol::token::from_hex(&l.token).expect("hex token");
        rgpu_protocol::token::Claims::verify(&t, &token_key(&dir), 0).expect("the broker's token").client_key
    };
    let l = carol.lease(&LeaseSpec { client_key: Some(key), ..one_gpu("") }).unwrap();
    assert_eq!(bound_to(&l), Some(key));
    let renewed = carol.renew(l.id_u64(), 120_000).unwrap();
    assert_eq!(bound_to(&renewed), Some(key), "a renewal keeps the binding");
    let bearer = carol.lease(&one_gpu("")).unwrap();
    assert_eq!(bound_to(&bearer), None);
    drop(carol);

    b.child.kill().unwrap();
    let _ = b.child.wait();
    let _b = broker(&dir, &addr);
    let carol = login(&addr, &dir, "carol", Role::User);
    let again = carol.renew(l.id_u64(), 120_000).expect("the lease survived the restart");
    assert_eq!(bound_to(&again), Some(key), "the binding is stored with the lease");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Finding: a peer that opened connections and sent nothing kept every one of them for as
/// long as it liked; enough of them would hold all the broker's file descriptors, and no
/// server could heartbeat nor tenant log in. Now one host may keep 128 connections that have
/// not logged in or registered, each for 10 s at most; the rest are closed at once, and
/// others log in meanwhile.
#[test]
fn idle_connections_that_never_log_in_are_bounded_and_closed() {
    use rgpu_pool_broker::rpc::{LOGIN_WAIT, UNPROVEN_PER_HOST};
    let dir = temp_dir("idle");
    let addr = free_port();
    let _b = broker(&dir, &addr);
    // From another loopback address, so the per-host bound is its alone.
    let opened: Vec<TcpStream> = local(async {
        let mut v = Vec::new();
        for _ in 0..UNPROVEN_PER_HOST + 36 {
            let s = tokio::net::TcpSocket::new_v4().unwrap();
            s.bind("127.0.0.2:0".parse().unwrap()).unwrap();
            let s = s.connect(addr.parse().unwrap()).await.unwrap().into_std().unwrap();
            s.set_nonblocking(false).unwrap();
            v.push(s);
        }
        v
    });
    // Closed by the broker: end of stream or a reset; open: the read times out.
    let closed = |s: &TcpStream, within: Duration| {
        s.set_read_timeout(Some(within)).unwrap();
        match (&*s).read(&mut [0u8; 1]) {
            Ok(n) => n == 0,
            Err(e) => !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
        }
    };
    std::thread::sleep(Duration::from_millis(300));
    let shut: Vec<bool> = opened.iter().map(|s| closed(s, Duration::from_millis(10))).collect();
    let open = shut.iter().filter(|c| !**c).count();
    assert_eq!(open, UNPROVEN_PER_HOST, "connections left open from one host that sent nothing: {open}");
    // Another host logs in and works meanwhile.
    let c = login(&addr, &dir, "alice", Role::User);
    assert!(c.status().is_ok());
    // Past the wait, the idle ones are closed too; the logged-in one stays.
    std::thread::sleep(LOGIN_WAIT + Duration::from_millis(500));
    let still: usize = opened.iter().filter(|s| !closed(s, Duration::from_millis(10))).count();
    assert_eq!(still, 0, "idle connections still open past {LOGIN_WAIT:?}");
    assert!(c.status().is_ok(), "a connection that logged in is not closed");
    let _ = std::fs::remove_dir_all(&dir);
}
