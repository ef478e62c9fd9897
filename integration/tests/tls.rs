//! A CUDA program through `rgpu run` against a server under TLS: the shim's
//! control plane and data connection both under TLS, checked against the
//! CA in RGPU_TLS_CA, with a relay in between recording the bytes. The
//! program's payload must not cross it in clear (with a plaintext server it
//! does); a shim trusting another CA, or set to plaintext, fails at cuInit
//! with an error that says why.

use rgpu_integration::{build, run_timeout, spawn_rgpu_with, Server, ServerOpts, Variant};
use rgpu_tls::testing::Tap;

const PROGRAM: &str = "rt_tls_canary";

fn tls_server(dir: &std::path::Path) -> (Server, rgpu_tls::pki::Files) {
    let files = rgpu_tls::pki::write_throwaway(dir, &["127.0.0.1"]).unwrap();
    let opts = ServerOpts { tls: Some((files.cert.clone(), files.key.clone())), ..ServerOpts::default() };
    (Server::start(opts), files)
}

fn canary() -> Vec<u8> {
    b"rgpu-tls-canary:".repeat(4)
}

#[test]
fn a_program_runs_over_tls_and_its_data_never_crosses_in_clear() {
    let exe = build(PROGRAM, Variant::Cudart13Shared);
    let dir = std::env::temp_dir().join(format!("rgpu-integration-tls-{}", std::process::id()));
    let (server, files) = tls_server(&dir);
    let tap = Tap::start(&server.addr_string()).unwrap();
    let ca = files.ca.to_str().unwrap();
    let out = spawn_rgpu_with(&tap.addr, &exe, &[], &[("RGPU_TLS_CA", Some(ca)), ("RGPU_PLAINTEXT", None)])
        .wait(run_timeout());
    out.assert_pass(PROGRAM, &[&server]);
    assert!(tap.captured().len() > 2 << 20, "both copies crossed the relay");
    assert!(!tap.saw(&canary()), "the program's data crossed the wire in clear");
    assert!(!tap.saw(b"RGPUDAT1") && !tap.saw(b"RGPUCTL1"));

    // The same program against a plaintext server: the relay sees it all.
    let plain = Server::start_default();
    let tap = Tap::start(&plain.addr_string()).unwrap();
    let out = spawn_rgpu_with(&tap.addr, &exe, &[], &[("RGPU_PLAINTEXT", Some("1")), ("RGPU_TLS_CA", None)])
        .wait(run_timeout());
    out.assert_pass(PROGRAM, &[&plain]);
    assert!(tap.saw(&canary()));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_shim_of_another_ca_or_in_plaintext_is_refused_with_a_reason() {
    let exe = build(PROGRAM, Variant::Cudart13Shared);
    let dir = std::env::temp_dir().join(format!("rgpu-integration-tls-refused-{}", std::process::id()));
    let (server, _files) = tls_server(&dir.join("server"));
    let other = rgpu_tls::pki::write_throwaway(&dir.join("other"), &["127.0.0.1"]).unwrap();
    let addr = server.addr_string();
    let out = spawn_rgpu_with(&addr, &exe, &[], &[("RGPU_TLS_CA", Some(other.ca.to_str().unwrap())), ("RGPU_PLAINTEXT", None)])
        .wait(run_timeout());
    assert!(!out.status.is_some_and(|s| s.success()), "ran against an untrusted server\n{}", out.describe(&[&server]));
    assert!(out.stderr.contains("not trusted") && out.stderr.contains(&addr), "{}", out.describe(&[&server]));

    let out = spawn_rgpu_with(&addr, &exe, &[], &[("RGPU_PLAINTEXT", Some("1")), ("RGPU_TLS_CA", None)]).wait(run_timeout());
    assert!(!out.status.is_some_and(|s| s.success()));
    assert!(out.stderr.contains("requires TLS"), "{}", out.describe(&[&server]));

    let out = spawn_rgpu_with(&addr, &exe, &[], &[("RGPU_PLAINTEXT", None), ("RGPU_TLS_CA", None)]).wait(run_timeout());
    assert!(!out.status.is_some_and(|s| s.success()));
    assert!(out.stderr.contains("RGPU_TLS_CA") && out.stderr.contains("RGPU_PLAINTEXT"), "{}", out.describe(&[&server]));
    let _ = std::fs::remove_dir_all(dir);
}
