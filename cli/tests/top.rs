//! `rgpu top` in a real terminal: tmux runs it against a broker and a sim
//! server on loopback; the screen is read with capture-pane, keys are sent
//! with send-keys, and `q` must end it with status 0. Also the plain
//! snapshot when stdout is a pipe. Needs the workspace's binaries built
//! (rgpu-broker, rgpu-server beside rgpu) and tmux (CI installs it;
//! elsewhere the test says so and passes without it, unless CI=true).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn bin(name: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_BIN_EXE_rgpu")).parent().unwrap().join(name);
    assert!(p.exists(), "{} is not built: run `cargo build --release` first", p.display());
    p
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts a daemon and waits for its "listening on ADDR" line.
fn start(name: &str, args: &[&str]) -> (Proc, String) {
    // Plaintext, said explicitly (loopback); TLS has its own tests.
    let plaintext = if name == "rgpu-broker" { "RGPU_BROKER_PLAINTEXT" } else { "RGPU_SERVER_PLAINTEXT" };
    let mut child = Command::new(bin(name))
        .args(args)
        .env(plaintext, "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let err = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut sent = false;
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            if let (false, Some(rest)) = (sent, line.split("listening on ").nth(1)) {
                let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_string());
                sent = true;
            }
        }
    });
    let addr = rx.recv_timeout(Duration::from_secs(20)).expect("daemon did not start listening");
    (Proc(child), addr)
}

fn free_port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string()
}

fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn rgpu(env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_rgpu"));
    c.args(args).stdin(Stdio::null());
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

struct Tmux(String);

impl Tmux {
    fn cmd(&self, args: &[&str]) -> Output {
        Command::new("tmux").args(["-L", &self.0, "-f", "/dev/null"]).args(args).output().unwrap()
    }
    fn screen(&self) -> String {
        String::from_utf8_lossy(&self.cmd(&["capture-pane", "-p", "-t", "top"]).stdout).into_owned()
    }
    /// Waits for the screen to show every one of `want`.
    fn shows(&self, want: &[&str]) -> String {
        let t = Instant::now();
        loop {
            let s = self.screen();
            if want.iter().all(|w| s.contains(w)) {
                return s;
            }
            assert!(t.elapsed() < Duration::from_secs(20), "the screen does not show {want:?}:\n{s}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd(&["kill-server"]);
    }
}

#[test]
fn top_shows_the_pool_sorts_and_quits_in_a_real_terminal() {
    let found = Command::new("tmux").arg("-V").stdout(Stdio::null()).stderr(Stdio::null()).status();
    if !found.is_ok_and(|s| s.success()) {
        assert!(std::env::var("CI").as_deref() != Ok("true"), "CI needs tmux (.ci/run installs it)");
        eprintln!("tmux is not installed: skipping (apt-get install tmux)");
        return;
    }
    let dir = std::env::temp_dir().join(format!("rgpu-top-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (key, admin) = (dir.join("key"), dir.join("admin.key"));
    let baddr = free_port();
    let (_b, _) = start(
        "rgpu-broker",
        &[
            "--listen", &baddr,
            "--data-dir", dir.join("data").to_str().unwrap(),
            "--key-file", key.to_str().unwrap(),
            "--admin-key-file", admin.to_str().unwrap(),
            "--create-key",
            "--heartbeat-ms", "200",
        ],
    );
    let (_s, saddr) = start(
        "rgpu-server",
        &["--listen", "127.0.0.1:0", "--backend", "sim", "--sim-devices", "2", "--broker", &baddr,
          "--broker-key-file", key.to_str().unwrap(), "--link-bandwidth", "10Gb/s"],
    );
    let env = [("RGPU_BROKER", baddr.as_str()), ("RGPU_ADMIN_KEY_FILE", admin.to_str().unwrap()), ("RGPU_PLAINTEXT", "1")];
    wait_until("the server to register", Duration::from_secs(15), || {
        String::from_utf8_lossy(&rgpu(&env, &["servers"]).stdout).contains(&saddr)
    });
    let lease = rgpu(&env, &["lease", "--gpus", "1", "--ttl", "5m", "--bandwidth", "4Gb/s", "--bearer-token"]);
    assert!(lease.status.success(), "{}", String::from_utf8_lossy(&lease.stderr));

    // Not a terminal: one plain snapshot.
    let o = rgpu(&env, &["top", "--interval", "200ms"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(text.starts_with("rgpu top  servers 1/1 up  GPUs 1 free of 2  leases 1"), "{text}");
    assert!(text.contains(&saddr) && text.contains("[######      ]") && text.contains("admin"), "{text}");
    // The link: 4 of its 10 Gb/s granted.
    assert!(text.contains("LINK") && text.contains("[#####       ] 40%"), "{text}");

    // A real terminal.
    let t = Tmux(format!("rgpu-top-test-{}", std::process::id()));
    let line = format!("{} top --interval 300ms; echo rgpu-top-exited-$?; sleep 60", env!("CARGO_BIN_EXE_rgpu"));
    let started = Command::new("tmux")
        .args(["-L", &t.0, "-f", "/dev/null", "new-session", "-d", "-x", "160", "-y", "40", "-s", "top", &line])
        .envs(env)
        .status()
        .unwrap();
    assert!(started.success());
    let screen = t.shows(&["servers (sorted by name)", "leases (sorted by tenant)", &saddr, "admin", "q quit"]);
    assert!(screen.contains("servers 1/1 up  GPUs 1 free of 2"), "{screen}");
    assert!(screen.contains("LINK") && screen.contains("[####      ] 40%"), "{screen}");
    t.cmd(&["send-keys", "-t", "top", "s"]);
    t.shows(&["servers (sorted by busy)"]);
    t.cmd(&["send-keys", "-t", "top", "l"]);
    t.shows(&["leases (sorted by device time)"]);
    t.cmd(&["send-keys", "-t", "top", "q"]);
    t.shows(&["rgpu-top-exited-0"]);
    let _ = std::fs::remove_dir_all(&dir);
}
