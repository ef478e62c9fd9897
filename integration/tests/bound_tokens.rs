//! Lease tokens bound to a client key, end to end (docs/security.md,
//! "Bound tokens"): `rgpu lease` binds the lease to the key file it is
//! given, a real CUDA program runs on the token with that key, and the same
//! token is useless with another key, with no key file, or on a server that
//! requires bound tokens when it was taken as a bearer token.
//! Needs rgpu-broker built beside rgpu and rgpu-server
//! (`cargo build --release -p rgpu-pool-broker`).

mod pool;

use pool::*;
use rgpu_integration::*;
use std::path::Path;
use std::time::Duration;

fn lease(b: &Broker, dir: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["lease", "--gpus", "1"];
    args.extend_from_slice(extra);
    json(&args, b, dir)
}

#[test]
fn a_copied_token_is_useless_without_its_client_key() {
    let exe = build("rt_copy", Variant::Cudart13Shared);
    let dir = Dir::scratch("bound-tokens");
    let d = &dir.0;
    let b = broker(d);
    let flags: Vec<String> = [
        "--broker".to_string(),
        b.addr.clone(),
        "--broker-key-file".to_string(),
        d.join("key").display().to_string(),
        "--require-bound-tokens".to_string(),
    ]
    .into();
    let seed = format!("rgpu-bound-tokens-{}", std::process::id());
    let srv = Server::start_on("127.0.0.1:0", ServerOpts { devices: 2, ..ServerOpts::default() }, &seed, &flags);
    let addr = srv.addr_string();
    wait_until("the server registered", Duration::from_secs(20), || servers_up(&b, d) == vec![addr.clone()]);

    let alice_key = d.join("alice.key");
    let alice = lease(&b, d, &["--client-key", alice_key.to_str().unwrap()]);
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
    let other = lease(&b, d, &["--client-key", mallory_key.to_str().unwrap()]);
    let out = run(mallory_key.to_str().unwrap());
    assert_ne!(out.code(), Some(0), "a program with another key ran:\n{}", out.describe(&[&srv]));
    assert!(out.stderr.contains("bound to client key"), "no reason given:\n{}", out.describe(&[&srv]));

    // No key file at all: refused too.
    let out = run(d.join("nowhere.key").to_str().unwrap());
    assert_ne!(out.code(), Some(0), "a program without the key ran:\n{}", out.describe(&[&srv]));
    assert!(out.stderr.contains("bound to client key"), "no reason given:\n{}", out.describe(&[&srv]));

    // A bearer token is refused by this server (--require-bound-tokens).
    let (ok, _, err) = rgpu(&["release", other["id"].as_str().unwrap()], &b, d);
    assert!(ok, "{err}");
    let bearer = lease(&b, d, &["--bearer-token"]);
    let t = bearer["token"].as_str().unwrap();
    let env = [("RGPU_TOKEN", Some(t)), ("RGPU_PLAINTEXT", Some("1")), ("RGPU_TLS_CA", None)];
    let out = spawn_rgpu_with(&addr, &exe, &[], &env).wait(run_timeout());
    assert_ne!(out.code(), Some(0), "a bearer token ran:\n{}", out.describe(&[&srv]));
    assert!(srv.log().contains("require-bound-tokens"), "the server did not say why:\n{}", srv.log());
}
