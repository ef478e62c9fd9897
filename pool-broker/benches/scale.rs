//! Scale benchmark: a broker (in this process, over real loopback RPC and
//! its durable store) with 1,000 registered servers of 10 GPUs each,
//! heartbeating every second; many clients lease one GPU and release it,
//! as fast as they can. Reports grants per second and the grant latency
//! (p50, p99).
//!
//!   cargo bench -p rgpu-pool-broker --bench scale [-- SECONDS CONNECTIONS]
//!
//! `RGPU_BROKER_STORE=etcd://HOST:PORT/PREFIX` (with `--features etcd`)
//! runs it on an etcd store, the broker the only replica (it waits to be
//! elected first); `RGPU_BROKER_PLACEMENT` picks the policy.
//! `RGPU_BENCH_GANG=N`: each client asks for N whole GPUs within one leaf
//! switch (8 servers, 80 GPUs), granted together or not at all, instead of
//! one GPU; the latency is then a gang's time to grant.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rgpu_broker_client::rpc::{Connection, CONNECT_TIMEOUT};
use rgpu_broker_client::{Credential, Role};
use rgpu_pool_broker::config::{Config, Placement, Settings};
use rgpu_protocol::auth::register_message;
use rgpu_protocol::broker_capnp::{broker, server_agent};
use rgpu_protocol::token::sign_bytes;
use tokio_util::sync::CancellationToken;

const SERVERS: usize = 1000;
const GPUS: usize = 10;

fn main() {
    let argv: Vec<String> = std::env::args().filter(|a| !a.starts_with("--")).collect();
    let secs: u64 = argv.get(1).and_then(|s| s.parse().ok()).unwrap_or(10);
    let conns: usize = argv.get(2).and_then(|s| s.parse().ok()).unwrap_or(64);
    let gang: u32 = match std::env::var("RGPU_BENCH_GANG") {
        Ok(v) => v.parse().ok().filter(|&n| (1..=80).contains(&n)).expect("RGPU_BENCH_GANG: 1..=80 GPUs"),
        Err(_) => 0,
    };
    let dir = std::env::temp_dir().join(format!("rgpu-broker-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let placement = match std::env::var("RGPU_BROKER_PLACEMENT") {
        Ok(p) => Placement::parse(&p).expect("RGPU_BROKER_PLACEMENT"),
        Err(_) => Settings::default().placement,
    };
    let store = match std::env::var("RGPU_BROKER_STORE") {
        Ok(s) => <rgpu_pool_broker::config::StoreUrl as rgpu_config::FromText>::from_text(&s).expect("RGPU_BROKER_STORE"),
        Err(_) => Settings::default().store,
    };
    let config = Config::from_settings(Settings {
        listen: "127.0.0.1:0".into(),
        data_dir: dir.join("data"),
        key_file: Some(dir.join("key")),
        create_key: true,
        threads: 2,
        placement,
        store,
        // The clients lease and release as fast as they can: no rate limit.
        default_max_rate: u32::MAX / 4,
        // A gang is one tenant's lease of many GPUs: no GPU quota in the way.
        default_max_gpus: 80,
        // Loopback, and the cost measured is the broker's, not TLS's.
        plaintext: true,
        ..Settings::default()
    })
    .expect("config");
    let key = rgpu_pool_broker::config::load_key(&dir.join("key"), true).expect("key");
    let service = rgpu_pool_broker::open_service(&config).expect("service");
    let t = Instant::now();
    while !service.leads() {
        assert!(t.elapsed() < Duration::from_secs(30), "the broker was not elected");
        std::thread::sleep(Duration::from_millis(20));
    }
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let stop = CancellationToken::new();
    let (svc, s2, security) = (service.clone(), stop.clone(), config.security.clone());
    std::thread::spawn(move || rgpu_pool_broker::rpc::serve(listener, svc, 2, security, s2));

    // Register 1,000 servers x 10 GPUs, then keep them heartbeating.
    let t = Instant::now();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (a, k, s3) = (addr.clone(), key.clone(), stop.clone());
    // Agents live on the connection that registered them: one thread
    // registers, then heartbeats through them.
    std::thread::spawn(move || {
        run_local(async move {
            let conn = connect(&a).await;
            let agents = register_all(conn.client(), &k).await;
            let _ = ready_tx.send(());
            heartbeats(agents, s3).await;
        })
    });
    ready_rx.recv().expect("registration");
    eprintln!("registered {SERVERS} servers / {} GPUs in {:.2} s", SERVERS * GPUS, t.elapsed().as_secs_f64());

    // Clients: `conns` connections over 2 threads, each lease+release in a loop.
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut threads = Vec::new();
    for t in 0..2 {
        let (a, k) = (addr.clone(), key.clone());
        let n = conns / 2 + if t == 0 { conns % 2 } else { 0 };
        threads.push(std::thread::spawn(move || run_local(clients(a, k, t * conns, n, deadline, gang))));
    }
    let mut lat: Vec<f64> = Vec::new();
    let mut errors = 0u64;
    for t in threads {
        let (l, e) = t.join().unwrap();
        lat.extend(l);
        errors += e;
    }
    stop.cancel();
    lat.sort_by(|a, b| a.total_cmp(b));
    let pct = |p: f64| lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1))).copied().unwrap_or(0.0);
    let what = if gang > 0 { format!(", gangs of {gang} GPUs within one leaf") } else { String::new() };
    println!(
        "scale: {SERVERS} servers, {} GPUs, {conns} client connections{what}, {secs} s: {} grants ({:.0} grants/s, each also released), p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms, errors {errors}",
        SERVERS * GPUS,
        lat.len(),
        lat.len() as f64 / secs as f64,
        pct(0.50),
        pct(0.99),
        lat.last().copied().unwrap_or(0.0)
    );
    drop(service);
    let _ = std::fs::remove_dir_all(&dir);
}

fn run_local<T>(f: impl std::future::Future<Output = T>) -> T {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    tokio::task::LocalSet::new().block_on(&rt, f)
}

async fn connect(addr: &str) -> Connection<broker::Client> {
    rgpu_broker_client::rpc::connect(addr, &rgpu_tls::ClientSecurity::Plaintext, CONNECT_TIMEOUT).await.unwrap()
}

fn server_id(i: usize) -> String {
    format!("10.{}.{}.{}:7767", i / 65536, i / 256 % 256, i % 256)
}

/// Registers every server, 64 at a time (a connection holds 64 unused
/// challenges at most); returns their agents.
async fn register_all(c: &broker::Client, key: &[u8]) -> Vec<server_agent::Client> {
    let mut agents = Vec::new();
    for batch in (0..SERVERS).collect::<Vec<_>>().chunks(64) {
        let challenges: Vec<_> = batch.iter().map(|_| c.challenge_request().send().promise).collect();
        let mut pending = Vec::new();
        for (&i, ch) in batch.iter().zip(challenges) {
            let nonce = ch.await.unwrap().get().unwrap().get_nonce().unwrap().to_vec();
            let mut req = c.register_request();
            let id = server_id(i);
            {
                let mut s = req.get().init_server();
                s.set_id(&id);
                s.set_node(&id);
                s.set_leaf(&format!("leaf{}", i / 8));
                s.set_spine(&format!("spine{}", i / 128));
                let mut gs = s.init_gpus(GPUS as u32);
                for g in 0..GPUS {
                    let mut x = gs.reborrow().get(g as u32);
                    let mut uuid = [0u8; 16];
                    uuid[..8].copy_from_slice(&(i as u64).to_le_bytes());
                    uuid[8] = g as u8;
                    x.set_uuid(&uuid);
                    x.set_ordinal(g as u32);
                    x.set_model("H100");
                    x.set_memory(80 << 30);
                    x.set_sms(132);
                    x.set_healthy(true);
                }
            }
            let msg = register_message(&nonce, req.get().get_server().unwrap().into_reader()).unwrap();
            req.get().set_nonce(&nonce);
            req.get().set_proof(&sign_bytes(key, &msg));
            pending.push(req.send().promise);
        }
        for p in pending {
            agents.push(p.await.unwrap().get().unwrap().get_agent().unwrap());
        }
    }
    agents
}

async fn heartbeats(agents: Vec<server_agent::Client>, stop: CancellationToken) {
    while !stop.is_cancelled() {
        let t = Instant::now();
        let pending: Vec<_> = agents.iter().map(|a| a.heartbeat_request().send().promise).collect();
        for p in pending {
            let _ = p.await;
        }
        tokio::time::sleep(Duration::from_secs(1).saturating_sub(t.elapsed())).await;
    }
}

/// `n` clients, tenants `bench{first}`..., each logged in with its own
/// credential (issued with the token key: the bench's broker has no admin key).
async fn clients(addr: String, key: Vec<u8>, first: usize, n: usize, deadline: Instant, gang: u32) -> (Vec<f64>, u64) {
    let mut tasks = Vec::new();
    for i in first..first + n {
        let (addr, key) = (addr.clone(), key.clone());
        tasks.push(tokio::task::spawn_local(async move {
            let conn = connect(&addr).await;
            let cred = Credential::issue(&key, &format!("bench{i}"), Role::User, 1).unwrap();
            let c = cred.login(conn.client()).await.unwrap();
            let mut lat = Vec::new();
            let mut errors = 0u64;
            while Instant::now() < deadline {
                let mut req = c.lease_request();
                {
                    let mut r = req.get().init_request();
                    r.set_gpus(gang.max(1));
                    r.set_ttl_ms(60_000);
                    if gang > 0 {
                        r.set_scope(rgpu_protocol::broker_capnp::Scope::Leaf);
                        r.set_scope_required(true);
                    }
                }
                let t = Instant::now();
                let reply = req.send().promise.await;
                let ms = t.elapsed().as_secs_f64() * 1e3;
                let id = match reply.as_ref().map(|r| r.get().and_then(|r| r.get_lease()).map(|l| l.get_id())) {
                    Ok(Ok(id)) => id,
                    _ => {
                        errors += 1;
                        continue;
                    }
                };
                lat.push(ms);
                let mut rel = c.release_request();
                rel.get().set_lease_id(id);
                if rel.send().promise.await.is_err() {
                    errors += 1;
                }
            }
            (lat, errors)
        }));
    }
    let mut lat = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let (l, e) = t.await.unwrap();
        lat.extend(l);
        errors += e;
    }
    let _ = Arc::new(());
    (lat, errors)
}
