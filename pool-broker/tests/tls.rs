//! The pool under TLS, with real processes on loopback: a broker and a GPU
//! server with certificates from one CA, the server registering with the
//! broker over TLS, a tenant leasing over TLS through a relay that records
//! the bytes (the lease token must not cross it in clear; with a plaintext
//! pool it does), the token opening a session through the shim (`rgpu
//! demo --server`) over TLS; plaintext clients and clients of another CA
//! refused with errors that say why. Needs the workspace's binaries built.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};

use common::{bin_dir, credential, free_port, start, wait_for, Proc};
use rgpu_broker_client::{BrokerClient, ClientError, LeaseSpec, Role};
use rgpu_tls::testing::Tap;
use rgpu_tls::ClientSecurity;

/// A broker and one registered server, TLS with `files` or plaintext.
fn pool(dir: &Path, files: Option<&rgpu_tls::pki::Files>) -> (Proc, Proc) {
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let baddr = free_port();
    let (data, key, admin) = (s(&dir.join("data")), s(&dir.join("key")), s(&dir.join("admin.key")));
    let mut args: Vec<String> = ["--listen", &baddr, "--data-dir", &data, "--key-file", &key, "--admin-key-file", &admin]
        .iter()
        .map(|a| a.to_string())
        .chain(["--create-key".into(), "--heartbeat-ms".into(), "200".into()])
        .collect();
    let mut server: Vec<String> = ["--listen", "127.0.0.1:0", "--backend", "sim", "--sim-memory", "256MiB"]
        .iter()
        .map(|a| a.to_string())
        .chain(["--broker".into(), baddr.clone(), "--broker-key-file".into(), key.clone()])
        .collect();
    if let Some(f) = files {
        let tls = ["--tls-cert".to_string(), s(&f.cert), "--tls-key".into(), s(&f.key)];
        args.extend(tls.clone());
        server.extend(tls);
        server.extend(["--tls-ca".to_string(), s(&f.ca)]);
    }
    let b = start("rgpu-broker", &args.iter().map(String::as_str).collect::<Vec<_>>());
    let srv = start("rgpu-server", &server.iter().map(String::as_str).collect::<Vec<_>>());
    (b, srv)
}

fn lease_through_a_tap(dir: &Path, broker: &Proc, server: &Proc, security: &ClientSecurity) -> (Tap, Vec<u8>, String) {
    let tap = Tap::start(&broker.addr).unwrap();
    let c = BrokerClient::connect(&tap.addr, &credential(dir, "admin.key", "alice", Role::User), security).unwrap();
    wait_for("the server to register", || c.servers().is_ok_and(|s| s.iter().any(|s| s.id == server.addr && s.state == "up")));
    let l = c.lease(&LeaseSpec { gpus: 1, ttl_ms: 60_000, ..LeaseSpec::default() }).unwrap();
    let token = rgpu_protocol::token::from_hex(&l.token).expect("a token");
    (tap, token, l.token)
}

#[test]
fn a_lease_over_tls_opens_a_session_over_tls_and_plaintext_or_strangers_are_refused() {
    let dir = std::env::temp_dir().join(format!("rgpu-pool-tls-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let files = rgpu_tls::pki::write_throwaway(&dir.join("tls"), &["127.0.0.1"]).unwrap();
    let (broker, server) = pool(&dir, Some(&files));
    let tls = ClientSecurity::new(Some(&files.ca), None, false).unwrap();

    // The server registered over TLS, the tenant leases over TLS; the relay
    // sees neither the token nor the tenant's name.
    let (tap, token, hex) = lease_through_a_tap(&dir, &broker, &server, &tls);
    assert!(token.len() > 32);
    assert!(!tap.saw(&token) && !tap.saw(hex.as_bytes()), "the lease token crossed the wire in clear");
    assert!(!tap.saw(b"alice"), "the tenant's name crossed the wire in clear");

    // The token opens a session through the shim, both planes under TLS.
    let out = Command::new(bin_dir().join("rgpu"))
        .args(["demo", "--server", &server.addr, "--size-mib", "4"])
        .env("RGPU_SHIM", bin_dir().join("libcuda.so"))
        .env("RGPU_TOKEN", &hex)
        .env("RGPU_TLS_CA", &files.ca)
        .env_remove("RGPU_PLAINTEXT")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("PASS") && text.contains("tls       on"), "{text}\n{}", String::from_utf8_lossy(&out.stderr));

    // A plaintext client is told the broker requires TLS, at once.
    let cred = credential(&dir, "admin.key", "alice", Role::User);
    let t = std::time::Instant::now();
    match BrokerClient::connect(&broker.addr, &cred, &ClientSecurity::Plaintext) {
        Err(ClientError::Tls(e)) => assert!(e.contains("requires TLS") && e.contains("RGPU_TLS_CA"), "{e}"),
        Err(e) => panic!("expected a TLS refusal, got {e:?}"),
        Ok(_) => panic!("a plaintext client logged in to a TLS broker"),
    }
    assert!(t.elapsed() < std::time::Duration::from_secs(5), "refused without retrying for a leader");
    // A client trusting another CA is refused.
    let other = rgpu_tls::pki::write_throwaway(&dir.join("other"), &["127.0.0.1"]).unwrap();
    let stranger = ClientSecurity::new(Some(&other.ca), None, false).unwrap();
    match BrokerClient::connect(&broker.addr, &cred, &stranger) {
        Err(ClientError::Tls(e)) => assert!(e.contains("not trusted"), "{e}"),
        Err(e) => panic!("expected a certificate refusal, got {e:?}"),
        Ok(_) => panic!("a client of another CA logged in"),
    }
    drop((broker, server));

    // A plaintext pool: the same relay sees the token, so the check above can fail.
    let pdir = dir.join("plain");
    std::fs::create_dir_all(&pdir).unwrap();
    let (broker, server) = pool(&pdir, None);
    let (tap, token, _) = lease_through_a_tap(&pdir, &broker, &server, &ClientSecurity::Plaintext);
    assert!(tap.saw(&token) && tap.saw(b"alice"));
    match BrokerClient::connect(&broker.addr, &cred, &tls) {
        Err(ClientError::Tls(e)) => assert!(e.contains("does not speak TLS"), "{e}"),
        Err(e) => panic!("expected a TLS mismatch, got {e:?}"),
        Ok(_) => panic!("a TLS client logged in to a plaintext broker"),
    }
    drop((broker, server));
    let _ = std::fs::remove_dir_all(&dir);
}
