//! Lease tokens bound to a client key, end to end (docs/security.md,
//! "Bound tokens"): `rgpu lease` binds the lease to the key file it is
//! given, a real CUDA program runs on the token with that key, and the same
//! token is useless with another key, with no key file, or on a server that
//! requires bound tokens when it was taken as a bearer token.
//! Needs rgpu-broker built beside rgpu and rgpu-server
//! (`cargo build --release -p rgpu-pool-broker`).

use rgpu_integration::broker::{wait_until, Broker, Dir};
use rgpu_integration::*;
use std::time::Duration;

fn lease(b: &Broker, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["lease", "--gpus", "1", "--json"];
    args.extend_from_slice(extra);
    let (ok, out, err) = b.rgpu(&args);
    assert!(ok, "rgpu {args:?}: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("rgpu lease --json: {e}: {out}"))
}

#[test]
fn a_copied_token_is_useless_without_its_client_key() {
    let exe = build("rt_copy", Variant::Cudart13Shared);
    let dir = Dir::new("bound-tokens");
    let d = &dir.0;
    let b = Broker::start(d);
    let flags: Vec<String> = [
        "--broker".to_string(),
        b.addr.clone(),
        "--broker-key-file".to_string(),
        b.key_file().display().to_string(),
        "--require-bound-tokens".to_string(),
    ]
    .into();
    let seed = format!("rgpu-bound-tokens-{}", std::process::id());
    let srv = Server::start_on("127.0.0.1:0", ServerOpts { devices: 2, ..ServerOpts::default() }, &seed, &flags);
    let addr = srv.addr_string();
    wait_until("the server registered", Duration::from_secs(20), || {
        b.rgpu(&["servers"]).1.lines().any(|l| l.contains(&addr) && l.contains("up"))
    });

    let alice_key = d.join("alice.key");
    let alice = lease(&b, &["--client-key", alice_key.to_str().unwrap()]);
    let token = alice["token"].as_str().unwrap().to_string();
    // The key file was made, readable by its owner alone.
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&alice_key).unwrap().permissions().mode() & 0o777, 0o600);

    let run = |key: &str| {
        let env = [("RGPU_TOKEN", Some(token.as_str())), ("RGPU_CLIENT_KEY", Some(key)), ("RGPU_PLAINTEXT", Some("1")), ("RGPU_TLS_CA", None)];
        spawn_rgpu_with(&addr, &exe, &[], &env).wait(run_timeout())
    };
    // The holder of the key runs, with every check of the program right.
    run(alice_key.to_str().unwrap()).assert_pass("rt_copy", &[&srv]);

    // Another key on this host: refused, and the program is told why.
    let mallory_key = d.join("mallory.key");
    let other = lease(&b, &["--client-key", mallory_key.to_str().unwrap()]);
    let out = run(mallory_key.to_str().unwrap());
    assert_ne!(out.code(), Some(0), "a program with another key ran:\n{}", out.describe(&[&srv]));
    assert!(out.stderr.contains("bound to client key"), "no reason given:\n{}", out.describe(&[&srv]));

    // No key file at all: refused too.
    let out = run(d.join("nowhere.key").to_str().unwrap());
    assert_ne!(out.code(), Some(0), "a program without the key ran:\n{}", out.describe(&[&srv]));
    assert!(out.stderr.contains("bound to client key"), "no reason given:\n{}", out.describe(&[&srv]));

    // A bearer token is refused by this server (--require-bound-tokens).
    let (ok, _, err) = b.rgpu(&["release", other["id"].as_str().unwrap()]);
    assert!(ok, "{err}");
    let bearer = lease(&b, &["--bearer-token"]);
    let t = bearer["token"].as_str().unwrap();
    let env = [("RGPU_TOKEN", Some(t)), ("RGPU_PLAINTEXT", Some("1")), ("RGPU_TLS_CA", None)];
    let out = spawn_rgpu_with(&addr, &exe, &[], &env).wait(run_timeout());
    assert_ne!(out.code(), Some(0), "a bearer token ran:\n{}", out.describe(&[&srv]));
    assert!(srv.log().contains("require-bound-tokens"), "the server did not say why:\n{}", srv.log());
}
