//! Writes the seed corpus of the `capnp_msg` and `token` targets (and the
//! `module` target's link bundle) from real traffic: a built `rgpu-broker`
//! and `rgpu-server` (sim) on loopback, the real clients (broker-client,
//! control-client) talking to them through a recording proxy. Each capnp
//! message that crossed becomes a seed; the lease token, the key files and
//! the credentials the code issued are the token seeds.
//!
//! Run by `fuzz/regen-corpus.sh` (after `cargo build --release`):
//! `RGPU_FUZZ_CORPUS=fuzz/corpus cargo test --release -p rgpu-fuzz-targets --test regen -- --ignored`

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use rgpu_broker_client::views::LeaseSpec;
use rgpu_broker_client::{BrokerClient, Credential, Role};
use rgpu_protocol::token::{self, Claims};
use rgpu_tls::ClientSecurity;

fn bin(name: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release").join(name);
    assert!(p.exists(), "{} is not built: cargo build --release first", p.display());
    p
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `name args`; returns it and the address its "listening on" line names.
fn start(name: &str, args: &[&str]) -> (Proc, String) {
    let mut child = Command::new(bin(name))
        .args(args)
        .env("RGPU_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let err = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            if let Some(rest) = line.split("listening on ").nth(1) {
                if let Some(tx) = tx.take() {
                    let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_string());
                }
            }
        }
    });
    let addr = rx.recv_timeout(Duration::from_secs(20)).expect("started listening");
    (Proc(child), addr)
}

/// The bytes each connection through a [`proxy`] carried, each way.
type Recorded = Arc<Mutex<Vec<(Arc<Mutex<Vec<u8>>>, Arc<Mutex<Vec<u8>>>)>>>;

/// A proxy on a fresh loopback port to `upstream` that records both ways.
fn proxy(upstream: String) -> (String, Recorded) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let rec: Recorded = Arc::default();
    let r = rec.clone();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(c) = c else { continue };
            let Ok(u) = TcpStream::connect(&upstream) else { continue };
            let (up, down) = (Arc::new(Mutex::new(Vec::new())), Arc::new(Mutex::new(Vec::new())));
            r.lock().unwrap().push((up.clone(), down.clone()));
            pipe(c.try_clone().unwrap(), u.try_clone().unwrap(), up);
            pipe(u, c, down);
        }
    });
    (addr, rec)
}

fn pipe(mut from: TcpStream, mut to: TcpStream, log: Arc<Mutex<Vec<u8>>>) {
    std::thread::spawn(move || {
        let mut buf = [0u8; 16 << 10];
        while let Ok(n) = from.read(&mut buf) {
            if n == 0 || to.write_all(&buf[..n]).is_err() {
                break;
            }
            log.lock().unwrap().extend_from_slice(&buf[..n]);
        }
        let _ = to.shutdown(std::net::Shutdown::Write);
    });
}

/// Splits what was recorded into capnp messages and writes each (at most
/// `max`, each different, none over 32 KiB) as a seed: the plane byte, then
/// the message.
fn write_messages(rec: &Recorded, plane: u8, dir: &Path, prefix: &str, max: usize) -> usize {
    let mut seen = std::collections::HashSet::new();
    for (up, down) in rec.lock().unwrap().iter() {
        for (way, bytes) in [("in", up), ("out", down)] {
            let bytes = bytes.lock().unwrap();
            let mut rest: &[u8] = &bytes;
            if rest.starts_with(b"RGPU") {
                rest = &rest[8..];
            }
            loop {
                let before = rest.len();
                let opts = capnp::message::ReaderOptions::new();
                if capnp::serialize::read_message(&mut rest, opts).is_err() {
                    break;
                }
                let msg = &bytes[bytes.len() - before..bytes.len() - rest.len()];
                if msg.len() <= 32 << 10 && seen.len() < max && seen.insert(msg.to_vec()) {
                    let mut seed = vec![plane];
                    seed.extend_from_slice(msg);
                    std::fs::write(dir.join(format!("{prefix}-{way}-{:03}", seen.len())), seed).unwrap();
                }
            }
        }
    }
    seen.len()
}

#[test]
#[ignore = "writes the seed corpus; run by fuzz/regen-corpus.sh"]
fn regenerate_the_capnp_and_token_seeds() {
    let corpus = PathBuf::from(std::env::var("RGPU_FUZZ_CORPUS").expect("RGPU_FUZZ_CORPUS=DIR"));
    let (msgs, tokens, modules) = (corpus.join("capnp_msg"), corpus.join("token"), corpus.join("module"));
    for d in [&msgs, &tokens, &modules] {
        std::fs::create_dir_all(d).unwrap();
    }
    let dir = std::env::temp_dir().join(format!("rgpu-fuzz-regen-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = |n: &str| dir.join(n).to_str().unwrap().to_string();

    let broker_port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let (_broker, broker_addr) = start(
        "rgpu-broker",
        &[
            "--listen", &broker_port, "--data-dir", &p("data"), "--key-file", &p("key"),
            "--admin-key-file", &p("admin.key"), "--create-key", "--heartbeat-ms", "200",
            // Recorded traffic is the corpus: in clear.
            "--plaintext",
        ],
    );
    let (broker_proxy, broker_rec) = proxy(broker_addr);
    let (_server, server_addr) = start(
        "rgpu-server",
        &[
            "--listen", "127.0.0.1:0", "--backend", "sim", "--sim-devices", "2", "--sim-memory", "256MiB",
            "--broker", &broker_proxy, "--broker-key-file", &p("key"), "--plaintext",
        ],
    );
    let (control_proxy, control_rec) = proxy(server_addr);

    let admin_key = token::parse_key(&std::fs::read(p("admin.key")).unwrap()).unwrap();
    let now = rgpu_pool_broker::service::now_ms();
    let cred = Credential::issue(&admin_key, "alice", Role::User, now).unwrap();
    let op = Credential::issue(&admin_key, "ops", Role::Operator, now).unwrap();
    let c = BrokerClient::connect(&broker_proxy, &cred, &ClientSecurity::Plaintext).unwrap();
    let o = BrokerClient::connect(&broker_proxy, &op, &ClientSecurity::Plaintext).unwrap();
    // The server registers and heartbeats through the proxy.
    for _ in 0..100 {
        if !c.servers().unwrap().is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    c.whoami().unwrap();
    c.status().unwrap();
    let lease = c.lease(&LeaseSpec { tenant: "alice".into(), gpus: 1, ttl_ms: 30_000, ..LeaseSpec::default() }).unwrap();
    let id = u64::from_str_radix(&lease.id, 16).unwrap();
    let _ = c.renew(id, 60_000);
    let _ = c.leases("alice");
    let _ = c.usage("alice", 0, 10);
    let _ = o.audit("", 20);
    let _ = o.leases("");
    let server_id = c.servers().unwrap()[0].id.clone();
    let _ = o.drain(&server_id, now + 60_000);
    let _ = o.undrain(&server_id);

    // The control plane, with and without the lease's token.
    let _ = rgpu_control_client::inventory(&control_proxy, "fuzz-seed", &ClientSecurity::Plaintext);
    std::env::set_var("RGPU_TOKEN", &lease.token);
    let _ = rgpu_control_client::open(&control_proxy, "fuzz-seed", &ClientSecurity::Plaintext);
    std::env::remove_var("RGPU_TOKEN");
    let _ = c.release(id);
    std::thread::sleep(Duration::from_millis(500));

    let nb = write_messages(&broker_rec, 1, &msgs, "broker", 60);
    let nc = write_messages(&control_rec, 0, &msgs, "control", 20);
    assert!(nb >= 10 && nc >= 4, "recorded {nb} broker and {nc} control messages");

    // Tokens: the broker's, and the same claims with a partition key and
    // several GPUs, signed with its key; key files; credentials.
    let lease_token = token::from_hex(&lease.token).unwrap();
    std::fs::write(tokens.join("lease-token"), &lease_token).unwrap();
    let key = token::parse_key(&std::fs::read(p("key")).unwrap()).unwrap();
    let mut claims = Claims::decode_unverified(&lease_token).unwrap();
    claims.pkey = Some(0x8001);
    claims.gpus.push([0x42; 16]);
    std::fs::write(tokens.join("token-pkey-2gpus"), claims.sign(&key)).unwrap();
    std::fs::write(tokens.join("token-fuzz-key"), claims.sign(rgpu_fuzz_targets::token::KEY)).unwrap();
    std::fs::write(tokens.join("token-hex"), lease.token.as_bytes()).unwrap();
    // Claims of every shape a lease has: no GPUs, 8 GPUs, a memory limit,
    // expired, a long tenant name; signed with the fuzz key, so the checks
    // past the signature run.
    let base = Claims::decode_unverified(&lease_token).unwrap();
    let shapes = [
        Claims { gpus: vec![], ..base.clone() },
        Claims { gpus: (0..8).map(|i| [i; 16]).collect(), memory_limit: 1 << 30, ..base.clone() },
        Claims { deadline_ms: 1, ..base.clone() },
        Claims { tenant: "t".repeat(64), pkey: Some(0x7fff), ..base.clone() },
        Claims { lease_id: u64::MAX, generation: u64::MAX, deadline_ms: u64::MAX, ..base.clone() },
        Claims { client_key: Some([0x11; 32]), compute_milli: 0, ..base.clone() },
    ];
    for (n, c) in shapes.iter().enumerate() {
        std::fs::write(tokens.join(format!("token-shape-{n}")), c.sign(rgpu_fuzz_targets::token::KEY)).unwrap();
    }
    std::fs::write(tokens.join("key-file"), std::fs::read(p("key")).unwrap()).unwrap();
    std::fs::write(tokens.join("admin-key-file"), std::fs::read(p("admin.key")).unwrap()).unwrap();
    std::fs::write(tokens.join("credential-alice"), cred.to_text()).unwrap();
    std::fs::write(tokens.join("credential-ops"), op.to_text()).unwrap();
    let genuine = Credential::issue(rgpu_fuzz_targets::token::KEY, "fuzz.tenant_1", Role::Admin, 1_700_000_000_000).unwrap();
    std::fs::write(tokens.join("credential-fuzz-key"), genuine.to_text()).unwrap();
    for (n, role) in [Role::User, Role::Operator].into_iter().enumerate() {
        let c = Credential::issue(rgpu_fuzz_targets::token::KEY, &format!("tenant-{n}"), role, 1_000 + n as u64).unwrap();
        std::fs::write(tokens.join(format!("credential-fuzz-key-{n}")), format!("# issued for tests\n{}", c.to_text())).unwrap();
    }

    // A link bundle of two PTX inputs (what the shim's cuLinkComplete sends).
    let a = b".version 8.0\n.target sm_90\n.address_size 64\n.visible .func (.reg .b32 r) f(.reg .b32 x)\n{\n\tadd.s32 r, x, 1;\n\tret;\n}\n\0";
    let b = b".version 8.0\n.target sm_90\n.address_size 64\n.extern .func (.reg .b32 r) f(.reg .b32 x);\n.visible .entry k(.param .u64 p)\n{\n\t.reg .b32 %r<3>;\n\t.reg .b64 %rd<2>;\n\tld.param.u64 %rd1, [p];\n\tld.global.u32 %r1, [%rd1];\n\t{\n\t.param .b32 a;\n\t.param .b32 r;\n\tst.param.b32 [a], %r1;\n\tcall.uni (r), f, (a);\n\tld.param.b32 %r2, [r];\n\t}\n\tst.global.u32 [%rd1], %r2;\n\tret;\n}\n\0";
    let bundle = rgpu_protocol::bundle::encode(&[
        rgpu_protocol::bundle::Input { kind: 1, bytes: a },
        rgpu_protocol::bundle::Input { kind: 1, bytes: b },
    ]);
    std::fs::write(modules.join("link-bundle"), bundle).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Seeds of the `snapshot` target: snapshots of sim sessions as files
/// (first byte 0) and as live-migration streams with a pre-copy (first
/// byte 1), whole and cut short; the last ones hold an instantiated graph
/// (format version 2).
#[test]
#[ignore = "writes the seed corpus; run by fuzz/regen-corpus.sh"]
fn regenerate_the_snapshot_seeds() {
    use rgpu_server::backend::sim::{SimBackend, SimConfig};
    use rgpu_server::backend::{Backend, StreamRef};
    use rgpu_server::checkpoint::{capture, precopy, SessionMeta};
    use rgpu_server::command::event::{EventCreate, EventRecord};
    use rgpu_server::command::stream::StreamCreate;
    use rgpu_server::command::Handler;
    use rgpu_server::session::window::ReplyWindow;
    use rgpu_server::state::{Alloc, Owner, SessionState};
    use std::time::Duration;

    let dir = PathBuf::from(std::env::var("RGPU_FUZZ_CORPUS").expect("RGPU_FUZZ_CORPUS=DIR")).join("snapshot");
    std::fs::create_dir_all(&dir).unwrap();
    let sim = SimBackend::new(&SimConfig {
        devices: 2,
        memory: 64 << 20,
        compute_capability: (9, 0),
        seed: Some("seeds".into()),
        kernel_time_limit: Duration::from_secs(1),
        compiled_tier: true,
    })
    .unwrap();
    let meta = SessionMeta {
        id: 0x5eed,
        key: [3; rgpu_protocol::SESSION_KEY_LEN],
        client_name: "seed".into(),
        executed: 9,
        deferred: None,
        admission: None,
    };
    let mut n = 0;
    // (allocation sizes, with a stream and events, with a kept reply, pre-copied, with a graph)
    for (sizes, objects, kept, migrate, graph) in [
        (&[64u64][..], false, false, false, false),
        (&[4096, 300], true, false, false, false),
        (&[1 << 13, 12, 1 << 12], true, true, false, false),
        (&[1 << 12], false, false, true, false),
        (&[20 << 10, 64], true, true, true, false),
        (&[1 << 10, 1 << 10, 1 << 10], true, false, true, false),
        (&[256, 64, 128], true, true, false, true),
        (&[1 << 12, 64, 1 << 12], true, false, true, true),
    ] {
        let mut s = SessionState::new(sim.open_session(None).unwrap(), 2).with_devices(sim.devices());
        for (i, &size) in sizes.iter().enumerate() {
            let device = (i % 2) as u32;
            let p = s.backend.mem_alloc(device, size).unwrap();
            let fill: Vec<u8> = (0..size).map(|b| (b * 31 + i as u64) as u8).collect();
            let mut at = 0;
            s.backend
                .memcpy_htod(StreamRef::Default { device }, p, size, &mut |b| {
                    b.copy_from_slice(&fill[at..at + b.len()]);
                    at += b.len();
                    Ok(())
                })
                .unwrap();
            s.allocs.insert(p, Alloc { device, size, owner: Owner::Client });
        }
        if objects {
            StreamCreate { handle: 0x51, device: 1, flags: 1, priority: -1 }.apply(&mut s).unwrap();
            EventCreate { handle: 0x61, device: 1, flags: 0 }.apply(&mut s).unwrap();
            EventCreate { handle: 0x62, device: 0, flags: 2 }.apply(&mut s).unwrap();
            EventRecord { event: 0x61, stream: 0x51 }.apply(&mut s).unwrap();
        }
        if graph {
            use rgpu_server::backend::MemsetOp;
            use rgpu_server::command::graph::{check, install, WireOp};
            use rgpu_server::command::memory::Memset;
            // Allocations 0 and 2 are on device 0, with event 0x62.
            let on0: Vec<u64> = {
                let mut v: Vec<(u64, u32)> = s.allocs.iter().map(|(&p, a)| (p, a.device)).filter(|&(_, d)| d == 0).collect();
                v.sort();
                v.into_iter().map(|(p, _)| p).collect()
            };
            let (a, b) = (on0[0], on0[1]);
            let ops = vec![
                WireOp::Memset(Memset { op: MemsetOp { dst: a, value: 0x5a, element_size: 1, count: 64, pitch: 0, rows: 1 }, stream: 0 }),
                WireOp::HtoD { dst: a, size: 16 },
                WireOp::DtoD { dst: b, src: a, size: 32 },
                WireOp::DtoH { src: b, size: 24 },
                WireOp::EventRecord(0x62),
                WireOp::EventWait(0x62),
            ];
            let checked = check(&s, 0, ops).unwrap();
            install(&mut s, 0x71, checked, Vec::new(), None).unwrap();
        }
        let mut window = ReplyWindow::default();
        if kept {
            window.keep(8, b"a kept reply", None);
            window.keep(9, b"another", None);
        }
        let mut bytes = vec![migrate as u8];
        let sent = if migrate {
            let peek = s.backend.memory_peek().unwrap();
            let sent = precopy::send(&*peek, &precopy::client_allocs(&s), None, &mut bytes).unwrap();
            // One allocation changed since, so a delta carries a run.
            if let Some((&p, a)) = s.allocs.iter().next() {
                let (p, device) = (p, a.device);
                s.backend.memcpy_htod(StreamRef::Default { device }, p, 8, &mut |b| Ok(b.fill(0xee))).unwrap();
            }
            precopy::send_stale(&precopy::stale(&sent, &s), &mut bytes).unwrap();
            Some(sent)
        } else {
            None
        };
        capture(&mut s, &meta, &window, Duration::from_secs(5), &mut bytes, sent.as_ref()).unwrap();
        // Whole, and cut in the middle.
        for (suffix, b) in [("whole", &bytes[..]), ("cut", &bytes[..bytes.len() / 2])] {
            if b.len() <= 32 << 10 {
                std::fs::write(dir.join(format!("seed-{n:02}-{suffix}")), b).unwrap();
            }
        }
        n += 1;
    }
}
