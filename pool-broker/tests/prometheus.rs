//! A real Prometheus (Debian's `prometheus` package) scrapes a broker and
//! two rgpu-servers on loopback and answers PromQL about them; then the
//! CPU one scrape costs a server is measured. Needs the workspace's
//! binaries built and `prometheus` on PATH (CI installs it; elsewhere the
//! test says so and passes without it, unless CI=true).

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, login, start, wait_for, Proc};
use rgpu_broker_client::{LeaseSpec, Role};

fn broker(dir: &Path, addr: &str, metrics: &str) -> Proc {
    start(
        "rgpu-broker",
        &[
            "--listen", addr,
            "--data-dir", dir.join("data").to_str().unwrap(),
            "--key-file", dir.join("key").to_str().unwrap(),
            "--admin-key-file", dir.join("admin.key").to_str().unwrap(),
            "--create-key",
            "--heartbeat-ms", "200",
            "--metrics", metrics,
        ],
    )
}

fn server(dir: &Path, broker: &str, metrics: &str) -> Proc {
    start(
        "rgpu-server",
        &[
            "--listen", "127.0.0.1:0",
            "--backend", "sim",
            "--sim-devices", "2",
            "--sim-memory", "1GiB",
            "--broker", broker,
            "--broker-key-file", dir.join("key").to_str().unwrap(),
            "--metrics", metrics,
        ],
    )
}

/// GET `path` from `addr`; the body of a 200 answer.
fn get(addr: &str, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    // HTTP/1.0: the answer is not chunked and ends with the connection.
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let (head, body) = out.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_string()).or_else(|| head.starts_with("HTTP/1.0 200").then(|| body.to_string()))
}

fn encode(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The instant vector PromQL `q` gives: (labels, value) of each sample.
fn query(prom: &str, q: &str) -> Vec<(serde_json::Value, f64)> {
    let Some(body) = get(prom, &format!("/api/v1/query?query={}", encode(q))) else { return Vec::new() };
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    v["data"]["result"]
        .as_array()
        .map(|r| {
            r.iter()
                .filter_map(|s| Some((s["metric"].clone(), s["value"][1].as_str()?.parse().ok()?)))
                .collect()
        })
        .unwrap_or_default()
}

/// CPU time (user + system) of process `pid`, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which may hold spaces) in parentheses.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

#[test]
fn prometheus_scrapes_the_pool_and_answers_promql() {
    let found = Command::new("prometheus").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status();
    if !found.is_ok_and(|s| s.success()) {
        assert!(std::env::var("CI").as_deref() != Ok("true"), "CI needs Debian's prometheus package (.ci/run installs it)");
        eprintln!("prometheus is not installed: skipping (apt-get install prometheus)");
        return;
    }
    let dir = std::env::temp_dir().join(format!("rgpu-prometheus-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (baddr, bmetrics, m1, m2, prom) = (free_port(), free_port(), free_port(), free_port(), free_port());
    let _b = broker(&dir, &baddr, &bmetrics);
    let s1 = server(&dir, &baddr, &m1);
    let _s2 = server(&dir, &baddr, &m2);
    let bob = login(&baddr, &dir, "bob", Role::User);
    wait_for("2 servers registered", || bob.servers().map(|s| s.len() == 2).unwrap_or(false));
    let lease = bob.lease(&LeaseSpec { tenant: "bob".into(), gpus: 1, ttl_ms: 60_000, ..LeaseSpec::default() }).unwrap();

    std::fs::write(
        dir.join("prometheus.yml"),
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             scrape_configs:\n\
             \x20 - job_name: rgpu-broker\n    static_configs:\n      - targets: ['{bmetrics}']\n\
             \x20 - job_name: rgpu-server\n    static_configs:\n      - targets: ['{m1}', '{m2}']\n"
        ),
    )
    .unwrap();
    let mut p = Command::new("prometheus")
        .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("tsdb").display()))
        .arg(format!("--web.listen-address={prom}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(if std::env::var_os("RGPU_TEST_LOG").is_some() { Stdio::inherit() } else { Stdio::null() })
        .spawn()
        .unwrap();
    let prometheus = scopeguard(move || {
        let _ = p.kill();
        let _ = p.wait();
    });

    // Every target up, then the pool as PromQL sees it.
    let deadline = Instant::now() + Duration::from_secs(60);
    let ask = |q: &str, want: &dyn Fn(&[(serde_json::Value, f64)]) -> bool| loop {
        let r = query(&prom, q);
        if want(&r) {
            return r;
        }
        assert!(Instant::now() < deadline, "Prometheus did not answer {q} as expected: {r:?}");
        std::thread::sleep(Duration::from_millis(250));
    };
    ask("count(up == 1)", &|r| r.first().is_some_and(|s| s.1 == 3.0));
    let limit = ask("sum(rgpu_server_device_memory_limit_bytes)", &|r| !r.is_empty());
    assert_eq!(limit[0].1, (4u64 << 30) as f64, "two servers with two 1 GiB GPUs each");
    ask("rgpu_broker_servers{state=\"up\"}", &|r| r.first().is_some_and(|s| s.1 == 2.0));
    ask("rgpu_broker_gpus{state=\"used\"}", &|r| r.first().is_some_and(|s| s.1 == 1.0));
    ask("rgpu_broker_gpus{state=\"free\"}", &|r| r.first().is_some_and(|s| s.1 == 3.0));
    let by_tenant = ask("sum by (tenant) (rgpu_broker_leases{state=\"active\"})", &|r| !r.is_empty());
    assert_eq!(by_tenant.len(), 1, "{by_tenant:?}");
    assert_eq!((by_tenant[0].0["tenant"].as_str(), by_tenant[0].1), (Some("bob"), 1.0));
    ask("sum(rgpu_server_leases)", &|r| r.first().is_some_and(|s| s.1 == 1.0));
    ask("rgpu_broker_lease_requests_total{outcome=\"granted\"}", &|r| r.first().is_some_and(|s| s.1 == 1.0));
    ask("sum(rgpu_broker_store_commit_duration_seconds_count)", &|r| r.first().is_some_and(|s| s.1 >= 1.0));
    // Every query of the Grafana dashboard in the repo parses and
    // evaluates, and the pool's series it plots are there.
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/grafana/rgpu-pool.json");
    let dash: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let exprs: Vec<String> = dash["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .filter_map(|t| t["expr"].as_str().map(String::from))
        .collect();
    assert!(exprs.len() >= 12, "{exprs:?}");
    for e in &exprs {
        let body = get(&prom, &format!("/api/v1/query?query={}", encode(e))).unwrap_or_default();
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        assert_eq!(v["status"], "success", "dashboard query {e}: {body}");
    }
    ask("rgpu_server_device_memory_used_bytes / rgpu_server_device_memory_limit_bytes", &|r| r.len() == 4);
    drop(prometheus);

    // What one scrape costs a server: many scrapes, the CPU time its
    // process spent meanwhile (clock ticks of 10 ms, so enough scrapes to
    // measure), as a share of a core at a 15 s scrape interval.
    const SCRAPES: u32 = 2000;
    let pid = s1.child.id();
    let (before, t) = (cpu_ticks(pid), Instant::now());
    for _ in 0..SCRAPES {
        assert!(get(&m1, "/metrics").is_some_and(|b| b.contains("rgpu_server_sessions")));
    }
    let ticks = cpu_ticks(pid) - before;
    let per_scrape_s = ticks as f64 / 100.0 / SCRAPES as f64;
    let share = per_scrape_s / 15.0;
    eprintln!(
        "scrape cost: {SCRAPES} scrapes in {:.2} s wall, {ticks} ticks of server CPU: {:.1} us per scrape, \
         {:.5}% of a core at a 15 s interval",
        t.elapsed().as_secs_f64(),
        per_scrape_s * 1e6,
        share * 100.0
    );
    assert!(share < 0.01, "a scrape every 15 s must cost under 1% of a core: {:.3}%", share * 100.0);
    assert!(bob.release(lease.id_u64()).unwrap());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs `f` when dropped (the test's panics still stop Prometheus).
fn scopeguard(f: impl FnOnce()) -> impl Drop {
    struct Guard<F: FnOnce()>(Option<F>);
    impl<F: FnOnce()> Drop for Guard<F> {
        fn drop(&mut self) {
            if let Some(f) = self.0.take() {
                f()
            }
        }
    }
    Guard(Some(f))
}
