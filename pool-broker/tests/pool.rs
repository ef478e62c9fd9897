//! The pool with real processes on loopback: one rgpu-broker, three
//! rgpu-servers (sim), leases through the client library, sessions through
//! the shim (`rgpu demo` as the workload). Needs the workspace's binaries
//! built (`cargo build`): rgpu-server, rgpu and libcuda.so beside rgpu-broker.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{bin_dir, credential, free_port, login, start, wait_for, Proc};
use rgpu_broker_client::{BrokerClient, ClientError, LeaseSpec, LeaseView, Role, Scope};

fn broker(dir: &Path, addr: &str) -> Proc {
    let cfg = dir.join("broker.toml");
    std::fs::write(&cfg, "[tenants.alice]\npartitions = [\"secret\"]\nmax-gpus = 1\n").unwrap();
    start(
        "rgpu-broker",
        &[
            "--listen", addr,
            "--data-dir", dir.join("data").to_str().unwrap(),
            "--key-file", dir.join("key").to_str().unwrap(),
            "--admin-key-file", dir.join("admin.key").to_str().unwrap(),
            "--create-key",
            "--heartbeat-ms", "200",
            "--config", cfg.to_str().unwrap(),
        ],
    )
}

fn server(dir: &Path, broker: &str, devices: &str, leaf: &str, partitions: &str) -> Proc {
    start(
        "rgpu-server",
        &[
            "--listen", "127.0.0.1:0",
            "--backend", "sim",
            "--sim-devices", devices,
            "--sim-memory", "1GiB",
            "--broker", broker,
            "--broker-key-file", dir.join("key").to_str().unwrap(),
            "--leaf", leaf,
            "--partitions", partitions,
        ],
    )
}

fn spec(tenant: &str, gpus: u32) -> LeaseSpec {
    LeaseSpec { tenant: tenant.into(), gpus, ttl_ms: 30_000, ..LeaseSpec::default() }
}

/// Runs the built-in workload through the shim with `token` on `server`.
fn demo(server: &str, token: &str, size_mib: u32) -> Output {
    let mut c = Command::new(bin_dir().join("rgpu"));
    c.args(["demo", "--server", server, "--size-mib", &size_mib.to_string()])
        .env("RGPU_PLAINTEXT", "1")
        .env("RGPU_SHIM", bin_dir().join("libcuda.so"))
        .env("RGPU_TOKEN", token)
        .stdin(Stdio::null());
    let child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(o) => o.unwrap(),
        Err(_) => {
            unsafe { libc_kill(pid as i32) };
            panic!("rgpu demo hung");
        }
    }
}

unsafe fn libc_kill(pid: i32) {
    signal(pid, 9);
}

unsafe fn signal(pid: i32, sig: i32) {
    extern "C" {
        fn kill(pid: i32, sig: i32) -> i32;
    }
    kill(pid, sig);
}

/// Whether process `pid` is stopped (by SIGSTOP): a signal is delivered, not acted on, when
/// `kill` returns, and a loaded machine may let the process answer one more call first.
fn stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').map(|(_, rest)| rest.trim_start().starts_with('T')))
        .unwrap_or(false)
}

/// Waits (bounded) for `p` to exit; its wait status, or None if it did not.
fn exited_within(p: &mut Proc, limit: Duration) -> Option<std::process::ExitStatus> {
    let t = Instant::now();
    loop {
        if let Some(st) = p.child.try_wait().unwrap() {
            return Some(st);
        }
        if t.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn sigterm_drains_the_server_first() {
    let dir = std::env::temp_dir().join(format!("rgpu-pool-drain-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let baddr = free_port();
    let b = broker(&dir, &baddr);
    let saddr = free_port();
    let key = dir.join("key");
    let serve = |drain_timeout: &str| {
        start(
            "rgpu-server",
            &[
                "--listen", &saddr,
                "--backend", "sim",
                "--sim-devices", "2",
                "--broker", &baddr,
                "--broker-key-file", key.to_str().unwrap(),
                "--drain-timeout", drain_timeout,
            ],
        )
    };
    let c = login(&baddr, &dir, "bob", Role::User);
    let up = |c: &BrokerClient| {
        c.servers().map(|s| s.len() == 1 && s[0].state == "up" && !s[0].draining).unwrap_or(false)
    };

    // SIGTERM with a lease on the server: drained at once, alive until the
    // lease is released, then exits cleanly.
    let mut s = serve("20");
    wait_for("server registered", || up(&c));
    let l = c.lease(&spec("bob", 1)).unwrap();
    unsafe { signal(s.child.id() as i32, 15) };
    wait_for("server drained", || c.servers().unwrap()[0].draining);
    assert_eq!(kind(c.lease(&spec("bob", 1))), "unavailable", "no new grants on a stopping server");
    assert!(exited_within(&mut s, Duration::from_millis(500)).is_none(), "waits for its lease");
    assert!(c.renew(l.id_u64(), 0).is_ok(), "the lease keeps running");
    c.release(l.id_u64()).unwrap();
    let st = exited_within(&mut s, Duration::from_secs(5)).expect("stops once its leases are gone");
    assert!(st.success(), "{st:?}");

    // Back at the same address: registering ends its own drain.
    let mut s = serve("1");
    wait_for("server back, not draining", || up(&c));
    // The drain timeout: the lease is still held, the server stops anyway
    // and the broker revokes the lease at the deadline.
    let l = c.lease(&spec("bob", 1)).unwrap();
    let t = Instant::now();
    unsafe { signal(s.child.id() as i32, 15) };
    let st = exited_within(&mut s, Duration::from_secs(6)).expect("stops at the drain timeout");
    assert!(st.success(), "{st:?}");
    assert!(t.elapsed() >= Duration::from_millis(900), "waited for the timeout: {:?}", t.elapsed());
    wait_for("revocation", || c.renew(l.id_u64(), 0).is_err());

    // --drain-timeout 0: stops at once, as without a broker.
    let mut s = serve("0");
    wait_for("server back again", || up(&c));
    let _held = c.lease(&spec("bob", 1)).unwrap();
    unsafe { signal(s.child.id() as i32, 15) };
    let st = exited_within(&mut s, Duration::from_secs(2)).expect("stops at once");
    assert!(st.success(), "{st:?}");
    assert!(!c.servers().unwrap()[0].draining, "no drain asked");
    drop((c, b));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Finding: a broker paused past its servers' heartbeat silence (SIGSTOP,
/// a stalled VM) woke, ticked before it read the heartbeats waiting for
/// it, and declared every server unreachable and every lease lost: its own
/// silence, blamed on the servers.
#[test]
fn a_paused_broker_blames_no_server_for_its_own_silence() {
    let dir = std::env::temp_dir().join(format!("rgpu-pool-pause-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let baddr = free_port();
    let b = broker(&dir, &baddr); // heartbeats every 200 ms: silent past 600 ms
    let _s = server(&dir, &baddr, "2", "leaf-a", "default");
    let c = login(&baddr, &dir, "bob", Role::User);
    wait_for("server registered", || c.servers().is_ok_and(|s| s.len() == 1 && s[0].state == "up"));
    let l = c.lease(&spec("bob", 1)).unwrap();
    for round in 0..3 {
        unsafe { signal(b.child.id() as i32, 19) }; // SIGSTOP
        wait_for("the broker to stop", || stopped(b.child.id()));
        std::thread::sleep(Duration::from_millis(1_500));
        unsafe { signal(b.child.id() as i32, 18) }; // SIGCONT
        let r = c.renew(l.id_u64(), 0);
        assert!(r.is_ok(), "round {round}: the lease did not outlive the broker's pause: {:?}", r.err());
        let s = c.servers().unwrap();
        assert_eq!(s[0].state, "up", "round {round}: the server is blamed for the broker's pause");
        let other = c.lease(&spec("bob", 1)).unwrap_or_else(|e| panic!("round {round}: no grant after the pause: {e}"));
        c.release(other.id_u64()).unwrap();
    }
    // The server's own silence still counts: stopped, it is unreachable
    // and its lease lost, as before.
    drop(_s);
    wait_for("the silent server to be unreachable", || c.renew(l.id_u64(), 0).is_err_and(|e| e.kind() == Some("lost")));
    drop((c, b));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Finding: a client's call to a broker that answered nothing (frozen with
/// SIGSTOP; the kernel still accepts its TCP connections) waited for ever,
/// and so did a login. Now each waits a bounded time for the answer, then
/// looks for a leader for a bounded time, and fails; the same client works
/// again once the broker does.
#[test]
fn a_frozen_broker_hangs_no_client() {
    let dir = std::env::temp_dir().join(format!("rgpu-pool-frozen-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let baddr = free_port();
    let b = broker(&dir, &baddr);
    let cred = common::credential(&dir, "admin.key", "bob", Role::User);
    let waits = rgpu_broker_client::Waits { answer: Duration::from_millis(800), failover: Duration::from_millis(1_500) };
    // Bound: one answer, the search (its last login included), and slack.
    let bound = Duration::from_millis(800 + 1_500 + 800 + 2_000);
    // The client lives on a thread of its own (it is not Send), so that a
    // hang fails the test rather than stopping it.
    let (to_client, orders) = mpsc::channel::<()>();
    let (to_test, reports) = mpsc::channel();
    let a = baddr.clone();
    std::thread::spawn(move || {
        let plain = rgpu_tls::ClientSecurity::Plaintext;
        let c = BrokerClient::connect_with(&a, &cred, &plain, waits).unwrap();
        assert!(c.status().is_ok());
        let _ = to_test.send(None);
        let _ = orders.recv(); // frozen now
        let t = Instant::now();
        let called = c.status().map(|_| ()).map_err(|e| e.to_string());
        let called_in = t.elapsed();
        let t = Instant::now();
        let login = BrokerClient::connect_with(&a, &cred, &plain, waits).map(|_| ()).map_err(|e| e.to_string());
        let _ = to_test.send(Some(((called_in, called), (t.elapsed(), login))));
        let _ = orders.recv(); // thawed
        // It answers the same client again (a new connection).
        wait_for("the thawed broker to answer", || c.status().is_ok());
        let _ = to_test.send(None);
    });
    assert!(reports.recv_timeout(Duration::from_secs(15)).unwrap().is_none());
    unsafe { signal(b.child.id() as i32, 19) }; // SIGSTOP
    wait_for("the broker to stop", || stopped(b.child.id()));
    to_client.send(()).unwrap();
    let got = reports.recv_timeout(bound * 2);
    unsafe { signal(b.child.id() as i32, 18) }; // SIGCONT
    let ((called_in, called), (login_in, login)) = got.expect("a client call to a frozen broker hung").unwrap();
    eprintln!("frozen broker: a call failed after {called_in:?} ({called:?}); a login after {login_in:?} ({login:?})");
    assert!(called.as_ref().is_err_and(|e| e.contains("did not answer within 800 ms")), "{called:?}");
    assert!(called_in >= Duration::from_millis(800) && called_in < bound, "{called_in:?}");
    assert!(login.as_ref().is_err_and(|e| e.contains("did not answer")), "{login:?}");
    assert!(login_in < bound, "{login_in:?}");
    to_client.send(()).unwrap();
    assert!(reports.recv_timeout(Duration::from_secs(20)).expect("the thawed broker answers").is_none());
    drop(b);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Finding: a GPU server given several brokers registered with the first
/// and, when that one answered nothing (frozen; the kernel still accepts
/// its connections), waited on it for ever instead of trying the next.
#[test]
fn a_frozen_broker_keeps_no_server_from_the_next() {
    let root = std::env::temp_dir().join(format!("rgpu-pool-frozen-server-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let (da, db) = (root.join("a"), root.join("b"));
    std::fs::create_dir_all(&da).unwrap();
    std::fs::create_dir_all(&db).unwrap();
    let (aa, ab) = (free_port(), free_port());
    let a = broker(&da, &aa);
    // Two brokers of one key (not replicas: each its own pool).
    for f in ["key", "admin.key"] {
        std::fs::copy(da.join(f), db.join(f)).unwrap();
    }
    let b = broker(&db, &ab);
    unsafe { signal(a.child.id() as i32, 19) }; // SIGSTOP
    wait_for("the first broker to stop", || stopped(a.child.id()));
    let t = Instant::now();
    let _s = server(&da, &format!("{aa},{ab}"), "1", "leaf-a", "default");
    let c = login(&ab, &db, "ops", Role::Operator);
    common::wait_for_within("the server to register with the second broker", Duration::from_secs(30), || {
        c.servers().is_ok_and(|s| s.len() == 1 && s[0].state == "up")
    });
    eprintln!("registered with the second broker {:?} after the first froze", t.elapsed());
    unsafe { signal(a.child.id() as i32, 18) }; // SIGCONT
    drop((c, a, b));
    let _ = std::fs::remove_dir_all(&root);
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn kind(r: Result<LeaseView, ClientError>) -> String {
    match r {
        Ok(l) => format!("granted {}", l.id),
        Err(e) => e.kind().unwrap_or("?").to_string(),
    }
}

#[test]
fn pool_with_three_servers() {
    let dir = std::env::temp_dir().join(format!("rgpu-pool-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let baddr = free_port();
    let mut b = broker(&dir, &baddr);
    let s1 = server(&dir, &baddr, "2", "l1", "default");
    let mut s2 = Some(server(&dir, &baddr, "2", "l1", "default"));
    let s3 = server(&dir, &baddr, "1", "l2", "secret");
    let s2addr = s2.as_ref().unwrap().addr.clone();
    let c = login(&baddr, &dir, "bob", Role::User);
    let ops = login(&baddr, &dir, "ops", Role::Operator);
    let alice = login(&baddr, &dir, "alice", Role::User);
    wait_for("3 servers registered", || c.servers().map(|s| s.len() == 3).unwrap_or(false));
    // Each says which data-plane transports it serves (TCP always; RDMA
    // only with the verbs plugin and a device).
    for s in c.servers().unwrap() {
        assert!(s.transports.iter().any(|t| t == "tcp"), "{s:?}");
        assert!(s.transports.iter().all(|t| t == "tcp" || t == "rdma"), "{s:?}");
    }

    // Lease, renew, release; two GPUs within one node.
    let mut two = spec("bob", 2);
    two.scope = Scope::Node;
    two.scope_required = true;
    let l = c.lease(&two).unwrap();
    assert_eq!(l.servers().len(), 1, "{l:?}");
    let r = c.renew(l.id_u64(), 60_000).unwrap();
    assert!(r.deadline_ms > l.deadline_ms);
    assert_eq!(r.generation, l.generation);
    assert!(c.release(l.id_u64()).unwrap());
    assert!(!c.release(l.id_u64()).unwrap(), "release is idempotent");
    assert!(ops.leases("").unwrap().is_empty());

    // Expiry: not before the deadline, soon after.
    let mut short = spec("bob", 1);
    short.ttl_ms = 400;
    let e = c.lease(&short).unwrap();
    assert!(c.leases("").unwrap().iter().any(|x| x.id == e.id));
    wait_for("expiry", || ops.leases("").unwrap().is_empty());
    assert!(c.renew(e.id_u64(), 0).unwrap_err().to_string().contains("expired"));

    // Quota and partitions: alice sees only s3 ("secret"), one GPU at most.
    assert_eq!(kind(alice.lease(&spec("alice", 2))), "quota");
    let a = alice.lease(&spec("alice", 1)).unwrap();
    assert_eq!(a.servers(), vec![s3.addr.clone()]);
    assert_eq!(kind(alice.lease(&spec("alice", 1))), "quota");
    assert_eq!(kind(c.lease(&spec("bob", 5))), "invalid", "bob never sees s3: 4 GPUs");

    // Queueing: bob fills s1+s2; a waiting request is granted on release.
    let all = c.lease(&spec("bob", 4)).unwrap();
    assert_eq!(kind(c.lease(&spec("bob", 1))), "unavailable");
    let bob = c.credential.clone();
    let baddr2 = baddr.clone();
    let waiter = std::thread::spawn(move || {
        let c = BrokerClient::connect(&baddr2, &bob, &rgpu_tls::ClientSecurity::Plaintext).unwrap();
        let mut w = spec("bob", 1);
        w.wait_ms = 10_000;
        c.lease(&w)
    });
    std::thread::sleep(Duration::from_millis(300));
    assert!(ops.status().unwrap().queued == 1);
    c.release(all.id_u64()).unwrap();
    let q = waiter.join().unwrap().unwrap();
    c.release(q.id_u64()).unwrap();

    // Fractions share one GPU; the memory limit is enforced by the server.
    let mut f = spec("bob", 0);
    f.memory = 256 << 20;
    let f1 = c.lease(&f).unwrap();
    let f2 = c.lease(&f).unwrap();
    assert_eq!(f1.gpus[0].uuid, f2.gpus[0].uuid, "two fractions on one GPU");
    let fs = f1.servers()[0].clone();
    let ok = demo(&fs, &f1.token, 16);
    assert!(ok.status.success(), "{}", text(&ok));
    let oom = demo(&fs, &f1.token, 200);
    assert!(!oom.status.success() && text(&oom).contains("OUT_OF_MEMORY"), "{}", text(&oom));

    // A forged token is refused; a token replayed after release too.
    let mut forged = f2.token.clone().into_bytes();
    let i = 40;
    forged[i] = if forged[i] == b'0' { b'1' } else { b'0' };
    let o = demo(&fs, std::str::from_utf8(&forged).unwrap(), 16);
    assert!(text(&o).contains("signature"), "{}", text(&o));
    c.release(f2.id_u64()).unwrap();
    std::thread::sleep(Duration::from_millis(600)); // a heartbeat or two
    let o = demo(&fs, &f2.token, 16);
    assert!(text(&o).contains("has ended"), "{}", text(&o));
    c.release(f1.id_u64()).unwrap();

    // Drain without a deadline: no new grants there, leases keep running.
    let on1 = c.lease(&spec("bob", 2)).unwrap();
    let drained = on1.servers()[0].clone();
    // Drain and undrain need the operator role.
    let refused = c.drain(&drained, 0).unwrap_err();
    assert_eq!(refused.kind(), Some("auth"), "{refused}");
    assert_eq!(c.undrain(&drained).unwrap_err().kind(), Some("auth"));
    std::fs::write(dir.join("wrong.key"), format!("{}\n", "ab".repeat(32))).unwrap();
    let wrong = BrokerClient::connect(&baddr, &credential(&dir, "wrong.key", "ops", Role::Admin), &rgpu_tls::ClientSecurity::Plaintext).err().unwrap();
    assert_eq!(wrong.kind(), Some("auth"), "{wrong}");
    assert!(!c.servers().unwrap().iter().any(|s| s.draining), "nothing drained by the refused requests");
    ops.drain(&drained, 0).unwrap();
    let other = c.lease(&spec("bob", 2)).unwrap();
    assert_ne!(other.servers()[0], drained);
    assert!(c.renew(on1.id_u64(), 0).is_ok(), "drain without deadline keeps leases");
    c.release(other.id_u64()).unwrap();
    // Drain with a deadline: the lease is revoked then.
    let d = c.lease(&spec("bob", 1)).unwrap();
    let target = d.servers()[0].clone();
    assert_ne!(target, drained);
    ops.drain(&target, rgpu_pool_broker::service::now_ms() + 300).unwrap();
    wait_for("revocation", || c.renew(d.id_u64(), 0).is_err());
    assert!(c.renew(d.id_u64(), 0).unwrap_err().to_string().contains("revoked"));
    ops.undrain(&target).unwrap();

    // Broker SIGKILL and restart: leases, registrations, drains survive.
    let before = ops.leases("").unwrap();
    let gen = ops.status().unwrap().generation;
    drop((c, ops, alice));
    b.child.kill().unwrap(); // SIGKILL
    let _ = b.child.wait();
    b = broker(&dir, &baddr);
    let c = login(&baddr, &dir, "bob", Role::User);
    let ops = login(&baddr, &dir, "ops", Role::Operator);
    let after = ops.leases("").unwrap();
    assert_eq!(
        before.iter().map(|l| (&l.id, l.generation, l.deadline_ms)).collect::<Vec<_>>(),
        after.iter().map(|l| (&l.id, l.generation, l.deadline_ms)).collect::<Vec<_>>()
    );
    assert_eq!(ops.status().unwrap().generation, gen);
    let servers = ops.servers().unwrap();
    assert_eq!(servers.len(), 3);
    assert!(servers.iter().all(|s| s.transports.iter().any(|t| t == "tcp")), "transports survive: {servers:?}");
    assert!(servers.iter().any(|s| s.id == drained && s.draining), "drain survives");
    ops.undrain(&drained).unwrap();
    let next = c.lease(&spec("bob", 1)).unwrap();
    assert!(next.generation > gen, "generations never go back");

    // A server SIGKILLed: its leases are lost, clients are told, nothing hangs.
    c.release(next.id_u64()).unwrap();
    c.release(on1.id_u64()).unwrap();
    let mut on2 = spec("bob", 2);
    on2.scope = Scope::Node;
    on2.scope_required = true;
    // Take s1's GPUs first so the next pair lands on s2.
    let hold = c.lease(&on2).unwrap();
    let l2 = c.lease(&on2).unwrap();
    let victim = if l2.servers()[0] == s2addr { l2.clone() } else { hold.clone() };
    assert_eq!(victim.servers()[0], s2addr);
    drop(s2.take()); // kill -9 and reap
    wait_for("server marked unreachable", || {
        c.servers().unwrap().iter().any(|s| s.id == s2addr && s.state == "unreachable")
    });
    let err = c.renew(victim.id_u64(), 0).unwrap_err();
    assert_eq!(err.kind(), Some("lost"), "{err}");
    assert!(c.release(victim.id_u64()).unwrap());
    drop((s1, s3, a));
    drop(b);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `rgpu demo` with no flags: its own broker and server, a lease, the
/// workload with the lease's token; the broker's folder is gone after.
#[test]
fn demo_runs_on_its_own_pool() {
    let mut c = Command::new(bin_dir().join("rgpu"));
    c.args(["demo", "--backend", "sim", "--size-mib", "4"])
        .env("RGPU_SHIM", bin_dir().join("libcuda.so"))
        .env_remove("RGPU_TOKEN")
        .env_remove("RGPU_SERVERS")
        .stdin(Stdio::null());
    let child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let o = match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(o) => o.unwrap(),
        Err(_) => {
            unsafe { libc_kill(pid as i32) };
            panic!("rgpu demo hung");
        }
    };
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    for want in ["  broker    127.0.0.1:", "admits lease tokens only", "  lease     ", "deadline in", "  leased    ", "released", "PASS"] {
        assert!(out.contains(want), "no {want:?} in:\n{out}");
    }
    let dir = out.split("data in ").nth(1).and_then(|r| r.split(')').next()).expect("the broker's folder");
    assert!(!Path::new(dir).exists(), "{dir} left behind");
}
