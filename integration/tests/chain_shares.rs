//! Compute shares on the cuda backend, end to end and without a GPU: two
//! fractional leases (300 and 700 thousandths) of one GPU of server A
//! (`--backend cuda`, its libcuda rgpu's shim to server B's sim) run the
//! same busy kernels for the same three seconds; A hands their kernels to
//! the GPU in turns weighted by the shares, so the 700 lease completes
//! about 7/3 as many. Needs rgpu-broker built beside rgpu and rgpu-server.

mod pool;

use pool::*;
use rgpu_integration::*;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

fn now_ms() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis()
}

/// The "ok: kernels N" count of a run.
fn kernels(out: &RunOutput) -> u64 {
    out.ok_lines()
        .iter()
        .find_map(|l| l.strip_prefix("kernels "))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no kernel count:\n{}", out.describe(&[])))
}

#[test]
fn fractional_leases_on_the_cuda_backend_get_device_time_by_their_shares() {
    let exe = build("rt_busy", Variant::Cudart13Shared);
    let dir = Dir::scratch("chain-shares");
    let d = &dir.0;
    let b = broker(d);
    let sim = Server::start(ServerOpts { devices: 1, ..ServerOpts::default() });
    let flags: Vec<String> =
        ["--broker".to_string(), b.addr.clone(), "--broker-key-file".to_string(), d.join("key").display().to_string()].into();
    let a = Server::start_chain_with(&sim, &flags);
    let addr = a.addr_string();
    wait_until("server A registered", Duration::from_secs(30), || servers_up(&b, d) == vec![addr.clone()]);
    let lease = |milli: &str| json(&["lease", "--compute", milli, "--bearer-token"], &b, d);
    let (small, large) = (lease("300"), lease("700"));
    assert_eq!(small["gpus"], large["gpus"], "both leases should share the one GPU");

    // Up to three runs, as the sim's own share test: a client the host does
    // not schedule for over 100 ms rejoins at the other's clock, which no
    // scheduler can tell from a lease that stopped. A broken one fails all.
    let mut runs = Vec::new();
    for _ in 0..3 {
        let from = now_ms() + 6000;
        let (f, u) = (from.to_string(), (from + 3000).to_string());
        let args = ["--from-ms", f.as_str(), "--until-ms", u.as_str()];
        let spawn = |l: &serde_json::Value| {
            let env = [("RGPU_TOKEN", l["token"].as_str()), ("RGPU_PLAINTEXT", Some("1")), ("RGPU_TLS_CA", None)];
            spawn_rgpu_with(&addr, &exe, &args, &env)
        };
        let (rs, rl) = (spawn(&small), spawn(&large));
        let (os, ol) = (rs.wait(run_timeout()), rl.wait(run_timeout()));
        os.assert_pass("rt_busy", &[&a, &sim]);
        ol.assert_pass("rt_busy", &[&a, &sim]);
        let late = os.stdout.contains("started") || ol.stdout.contains("started");
        let got = (kernels(&os), kernels(&ol));
        let ratio = got.1 as f64 / got.0.max(1) as f64;
        eprintln!("kernels in 3 s with shares 300 and 700 on the cuda backend: {got:?} (ratio {ratio:.2}; 2.33 expected)");
        runs.push(got);
        if !late && (1.86..3.0).contains(&ratio) {
            return;
        }
    }
    panic!(
        "the 700 lease should run about 2.33 times the kernels of the 300 one (30% of the time, ±5 points): {runs:?}\n{}",
        a.describe()
    );
}

fn free_port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string()
}

/// The value of `series` (name and labels up to the closing brace) in a
/// Prometheus scrape of `addr`.
fn scrape(addr: &str, series: &str) -> f64 {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with([' ', ',', '}']))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {series} in the scrape of {addr}:\n{text}"))
}

/// Server A meters each kernel's device time by events, so its busy time
/// agrees with what server B's sim (which runs the kernels and times each
/// one itself) reports for the same kernels, and it counts every kernel.
#[test]
fn the_cuda_backend_meters_device_time_by_events() {
    let exe = build("rt_busy", Variant::Cudart13Shared);
    let (ma, mb) = (free_port(), free_port());
    let sim = Server::start_on(
        "127.0.0.1:0",
        ServerOpts { devices: 1, ..ServerOpts::default() },
        &format!("rgpu-chain-meter-{}", std::process::id()),
        &["--metrics".to_string(), mb.clone()],
    );
    let a = Server::start_chain_with(&sim, &["--metrics".to_string(), ma.clone()]);
    let out = spawn_rgpu(&a.addr_string(), &exe, &["--until-ms", &(now_ms() + 1500).to_string()]).wait(run_timeout());
    out.assert_pass("rt_busy", &[&a, &sim]);
    // The warm-up kernel and the window's.
    let n = kernels(&out) as f64 + 1.0;
    let launches = r#"rgpu_server_kernel_launches_total{device="0""#;
    let busy = r#"rgpu_server_device_busy_seconds_total{device="0""#;
    // A counts a kernel when its watcher sees it end: soon after the run.
    wait_until("server A saw every kernel end", Duration::from_secs(10), || scrape(&ma, launches) >= n);
    assert_eq!(scrape(&ma, launches), n, "server A's kernel count");
    assert_eq!(scrape(&mb, launches), n, "server B's kernel count");
    let (ta, tb) = (scrape(&ma, busy), scrape(&mb, busy));
    let off = (ta - tb).abs() / tb;
    eprintln!("device time of {n} kernels: server A (events) {:.1} ms, server B (sim) {:.1} ms, off by {:.2}%", ta * 1e3, tb * 1e3, off * 100.0);
    assert!(tb > 0.2, "kernels long enough to compare: {tb} s");
    assert!(off < 0.05, "A metered {ta} s of device time, B ran the kernels for {tb} s");
}
