//! TLS on the server's port: both planes through the client code the shim
//! uses (rgpu-control-client for the control plane; the data plane's
//! TcpTransport under a rustls client connection, as the shim's attach sets
//! it up), with every byte on the wire recorded by a relay in between.
//! The plaintext runs of the same exchange show the recorder does see the
//! secrets when nothing hides them, so the TLS assertions can fail.

mod common;

use std::path::Path;

use common::{DataClient, TestServer, IO_TIMEOUT};
use rgpu_protocol::{DATA_PREAMBLE, PROTOCOL_VERSION};
use rgpu_tls::pki::Authority;
use rgpu_tls::testing::Tap;
use rgpu_tls::{ClientSecurity, ServerSecurity, TlsClient, NEEDS_TLS};
use rgpu_transport::tcp::{self, TcpTransport};
use rgpu_transport::Transport;

/// A CA and a server certificate for `names` signed by it.
fn pki(names: &[&str]) -> (Authority, ServerSecurity) {
    let ca = Authority::new("rgpu test CA").unwrap();
    let issued = ca.issue(names).unwrap();
    let security = ServerSecurity::from_pem(issued.cert_pem.as_bytes(), issued.key_pem.as_bytes()).unwrap();
    (ca, security)
}

fn trusting(ca: &Authority, name: Option<&str>) -> ClientSecurity {
    let c = TlsClient::from_ca_pem(ca.cert_pem().as_bytes(), name.map(String::from)).unwrap();
    ClientSecurity::Tls(std::sync::Arc::new(c))
}

/// Attaches session (`id`, `key`) on `addr` as the shim does, TLS first
/// when `security` says so; the server's status and the transport.
fn attach(addr: &str, security: &ClientSecurity, id: u64, key: &[u8]) -> Result<(u32, TcpTransport), String> {
    attach_with(addr, security, id, key, true)
}

/// [`attach`], the client offering rgpu's own records after the handshake
/// or not (an older client: rustls' records throughout).
fn attach_with(
    addr: &str,
    security: &ClientSecurity,
    id: u64,
    key: &[u8],
    records: bool,
) -> Result<(u32, TcpTransport), String> {
    let t = tcp::connect(addr, IO_TIMEOUT).map_err(|e| e.to_string())?;
    let mut t = match security {
        ClientSecurity::Plaintext => t,
        ClientSecurity::Tls(tls) => {
            let mut s = t.into_stream().unwrap();
            s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
            let conn =
                rgpu_tls::client::handshake_blocking_with(tls, addr, &mut s, records).map_err(|e| e.to_string())?;
            TcpTransport::with_tls(s, conn.into()).unwrap()
        }
    };
    t.stream().set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    t.send(&[DATA_PREAMBLE, &id.to_le_bytes(), key]).map_err(|e| e.to_string())?;
    let mut st = [0u8; 8];
    t.recv_exact(&mut st).map_err(|e| e.to_string())?;
    if &st == NEEDS_TLS {
        return Err("the server requires TLS".into());
    }
    assert_eq!(u32::from_le_bytes(st[4..].try_into().unwrap()), PROTOCOL_VERSION);
    Ok((u32::from_le_bytes(st[..4].try_into().unwrap()), t))
}

/// A payload no other bytes on the wire will contain by chance.
fn canary() -> Vec<u8> {
    b"rgpu-tls-canary:".iter().copied().cycle().take(256 << 10).collect()
}

/// Opens a session through a recording relay, copies the canary to the
/// device and back; returns the relay and the session key.
/// `records`: the client offers rgpu's own records (the server accepts
/// them), else it keeps rustls' records as an older client does.
fn session_through_a_tap(server: &TestServer, security: &ClientSecurity, records: bool) -> (Tap, Vec<u8>) {
    let tap = Tap::start(&server.addr.to_string()).unwrap();
    let hello = rgpu_control_client::open(&tap.addr, "tls test", security).expect("control plane");
    assert!(!hello.devices.is_empty());
    let (status, t) = attach_with(&tap.addr, security, hello.session_id, &hello.key, records).expect("data plane");
    assert_eq!(status, 0);
    assert_eq!(t.is_tls(), security.is_tls());
    assert_eq!(t.has_own_records(), security.is_tls() && records);
    let mut c = DataClient::over(t, &tap.addr, hello.session_id, &hello.key, security.clone());
    let payload = canary();
    let ptr = c.alloc_ok(payload.len() as u64);
    assert_eq!(c.htod(ptr, &payload).result, 0);
    let back = c.dtoh(ptr, payload.len() as u64);
    assert_eq!(back.result, 0);
    assert!(back.bulk == payload, "the copy came back changed");
    drop(c);
    (tap, hello.key)
}

#[test]
fn both_planes_under_tls_and_the_wire_shows_neither_key_nor_data() {
    let (ca, security) = pki(&["127.0.0.1"]);
    let server = TestServer::start_secured(security);
    // rgpu's own records after the handshake, and rustls' throughout (an
    // older client on a newer server).
    for records in [true, false] {
        let (tap, key) = session_through_a_tap(&server, &trusting(&ca, None), records);
        let payload = canary();
        assert!(tap.captured().len() > payload.len(), "the copy crossed the relay");
        assert!(!tap.saw(&key), "the session key crossed the wire in clear");
        assert!(!tap.saw(&payload[..64]), "the copied data crossed the wire in clear");
        assert!(!tap.saw(b"RGPUCTL1") && !tap.saw(b"RGPUDAT1"), "the planes' preambles are inside TLS");
    }

    // The same exchange in plaintext: the recorder sees all of it.
    let payload = canary();
    let server = TestServer::start();
    let (tap, key) = session_through_a_tap(&server, &ClientSecurity::Plaintext, false);
    assert!(tap.saw(&key) && tap.saw(&payload[..64]) && tap.saw(b"RGPUDAT1"));
}

#[test]
fn a_client_trusting_another_ca_is_refused_on_both_planes() {
    let (_ca, security) = pki(&["127.0.0.1"]);
    let server = TestServer::start_secured(security);
    let addr = server.addr.to_string();
    let (other, _) = pki(&["127.0.0.1"]);
    let e = rgpu_control_client::open(&addr, "tls test", &trusting(&other, None)).unwrap_err().to_string();
    assert!(e.contains("not trusted") && e.contains(&addr), "{e}");
    let e = attach(&addr, &trusting(&other, None), 1, &[0; 16]).err().expect("refused");
    assert!(e.contains("not trusted"), "{e}");
}

#[test]
fn the_name_checked_is_the_host_dialled_unless_overridden() {
    let (ca, security) = pki(&["gpuhost.example"]);
    let server = TestServer::start_secured(security);
    let addr = server.addr.to_string();
    let e = rgpu_control_client::open(&addr, "tls test", &trusting(&ca, None)).unwrap_err().to_string();
    assert!(e.contains("not trusted"), "127.0.0.1 is not a name the certificate carries: {e}");
    let hello = rgpu_control_client::open(&addr, "tls test", &trusting(&ca, Some("gpuhost.example"))).unwrap();
    let (status, _) = attach(&addr, &trusting(&ca, Some("gpuhost.example")), hello.session_id, &hello.key).unwrap();
    assert_eq!(status, 0);
}

#[test]
fn plaintext_against_tls_and_tls_against_plaintext_are_clear_errors() {
    let (ca, security) = pki(&["127.0.0.1"]);
    let tls_server = TestServer::start_secured(security);
    let addr = tls_server.addr.to_string();
    let e = rgpu_control_client::open(&addr, "tls test", &ClientSecurity::Plaintext).unwrap_err();
    assert!(matches!(e, rgpu_control_client::ControlError::Tls { .. }), "{e:?}");
    assert!(e.to_string().contains("requires TLS") && e.to_string().contains("RGPU_TLS_CA"), "{e}");
    let e = attach(&addr, &ClientSecurity::Plaintext, 1, &[0; 16]).err().expect("refused");
    assert!(e.contains("requires TLS"), "{e}");

    let plain_server = TestServer::start();
    let addr = plain_server.addr.to_string();
    let e = rgpu_control_client::open(&addr, "tls test", &trusting(&ca, None)).unwrap_err().to_string();
    assert!(e.contains("does not speak TLS") && e.contains("--plaintext"), "{e}");
    let e = attach(&addr, &trusting(&ca, None), 1, &[0; 16]).err().expect("refused");
    assert!(e.contains("does not speak TLS"), "{e}");
    // Neither server went down over it.
    assert!(rgpu_control_client::open(&tls_server.addr.to_string(), "t", &trusting(&ca, None)).is_ok());
    assert!(rgpu_control_client::open(&addr, "t", &ClientSecurity::Plaintext).is_ok());
}

/// The files a daemon is given, read as it reads them.
#[test]
fn certificate_files_are_read_as_the_settings_name_them() {
    let dir = std::env::temp_dir().join(format!("rgpu-server-tls-files-{}", std::process::id()));
    let f = rgpu_tls::pki::write_throwaway(&dir, &["127.0.0.1"]).unwrap();
    let security = ServerSecurity::new(Some(&f.cert), Some(&f.key), false).unwrap();
    let server = TestServer::start_secured(security);
    let client = ClientSecurity::new(Some(Path::new(&f.ca)), None, false).unwrap();
    assert!(rgpu_control_client::open(&server.addr.to_string(), "t", &client).is_ok());
    let _ = std::fs::remove_dir_all(dir);
}

/// A server under TLS that keeps broken sessions for a resume.
fn resumable_tls_server() -> (Authority, TestServer) {
    let (ca, security) = pki(&["127.0.0.1"]);
    let limits = rgpu_server::limits::Limits { reconnect_grace: std::time::Duration::from_secs(10), ..Default::default() };
    (ca, TestServer::start_secured_limited(security, limits))
}

#[test]
fn a_session_resumes_under_tls_and_the_resume_and_its_replay_are_sealed() {
    let (ca, server) = resumable_tls_server();
    let security = trusting(&ca, None);
    let tap = Tap::start(&server.addr.to_string()).unwrap();
    let hello = rgpu_control_client::open(&tap.addr, "tls resume test", &security).expect("control plane");
    let (status, t) = attach(&tap.addr, &security, hello.session_id, &hello.key).expect("data plane");
    assert_eq!(status, 0);
    let mut c = DataClient::over(t, &tap.addr, hello.session_id, &hello.key, security.clone());
    let payload = canary();
    let ptr = c.alloc_ok(payload.len() as u64);
    assert_eq!(c.htod(ptr, &payload).result, 0);

    // A device-to-host copy whose reply (the canary) is lost with the
    // connection: the server sends it again on the resumed one.
    let before = c.last_reply;
    let seq = c.start_call(0, &[], |r| {
        let mut m = r.init_memcpy_dto_h();
        m.set_src(ptr);
        m.set_size(payload.len() as u64);
    });
    std::thread::sleep(std::time::Duration::from_millis(200));
    let (status, executed) = c.resume_with(before, None);
    assert_eq!(status, 0, "the session resumed under TLS");
    assert_eq!(executed, seq);
    let r = c.read_reply().unwrap();
    assert_eq!((r.seq, r.result), (seq, 0));
    assert!(r.bulk == payload, "the replayed copy came back changed");
    assert!(c.t.is_tls(), "the resumed connection is under TLS too");

    // Resumed again, and the session still works both ways.
    let (status, _) = c.resume();
    assert_eq!(status, 0);
    assert_eq!(c.htod(ptr, &[9; 64]).result, 0);
    assert_eq!(c.dtoh(ptr, 64).bulk, vec![9; 64]);

    assert!(!tap.saw(&hello.key), "the session key crossed the wire in clear");
    assert!(!tap.saw(&payload[..64]), "the data (or its replay) crossed the wire in clear");
    assert!(!tap.saw(rgpu_protocol::RESUME_PREAMBLE), "the resume preamble is inside TLS");
}

#[test]
fn a_plaintext_resume_of_a_tls_session_is_refused() {
    let (ca, server) = resumable_tls_server();
    let security = trusting(&ca, None);
    let addr = server.addr.to_string();
    let hello = rgpu_control_client::open(&addr, "tls resume test", &security).expect("control plane");
    let (status, t) = attach(&addr, &security, hello.session_id, &hello.key).expect("data plane");
    assert_eq!(status, 0);
    let mut c = DataClient::over(t, &addr, hello.session_id, &hello.key, ClientSecurity::Plaintext);
    let ptr = c.alloc_ok(64);
    assert_eq!(c.htod(ptr, &[3; 64]).result, 0);
    // The same credentials in clear: the server answers that it needs TLS.
    let mut t = common::dial(&addr, &ClientSecurity::Plaintext);
    t.send(&[rgpu_protocol::RESUME_PREAMBLE, &hello.session_id.to_le_bytes(), &hello.key, &0u64.to_le_bytes()]).unwrap();
    let mut st = [0u8; 8];
    t.recv_exact(&mut st).unwrap();
    assert_eq!(&st, NEEDS_TLS);
}

#[test]
fn a_long_request_under_tls_hears_sealed_keepalives() {
    use common::kernels::{params, BUSY_PTX};
    let (ca, server) = resumable_tls_server();
    let security = trusting(&ca, None);
    let addr = server.addr.to_string();
    let hello = rgpu_control_client::open(&addr, "tls keepalive test", &security).expect("control plane");
    let (status, t) = attach(&addr, &security, hello.session_id, &hello.key).expect("data plane");
    assert_eq!(status, 0);
    let mut c = DataClient::over(t, &addr, hello.session_id, &hello.key, security);
    assert_eq!(c.load_module(1, BUSY_PTX.as_bytes()).result, 0);
    let out = c.alloc_ok(4);
    let grid = [64, 1, 1];
    let t0 = std::time::Instant::now();
    assert_eq!(c.launch(true, 1, 0, grid, [256, 1, 1], 0, &params(out, 2000)).unwrap().result, 0);
    assert_eq!(c.sync().result, 0);
    let per = t0.elapsed().as_secs_f64() / 2000.0;
    let n = ((5.0 / per) as u32).clamp(2000, 50_000_000);
    c.t.stream().set_read_timeout(Some(std::time::Duration::from_millis(2500))).unwrap();
    c.launch(false, 1, 0, grid, [256, 1, 1], 0, &params(out, n));
    let t0 = std::time::Instant::now();
    // Keepalives written raw on the socket would break the TLS stream here.
    let r = c.dtoh(out, 4);
    eprintln!("waited {:?} behind the kernel, {} keepalive(s)", t0.elapsed(), c.keepalives);
    assert_eq!(r.result, 0);
    assert_eq!(r.bulk, n.to_le_bytes());
    assert!(c.keepalives >= 1, "no keepalive during a {:?} wait", t0.elapsed());
}

/// A snapshot copied onto a server and off it again in one stream each
/// (`rgpu restore --load`, `rgpu checkpoint --save`), through a recording
/// relay: under TLS the relay sees neither the bytes nor the preamble; in
/// plaintext it sees the preamble but still not the bytes, which travel in
/// records sealed under a key derived from the admin key.
#[test]
fn snapshot_copies_arrive_whole_and_hidden_with_and_without_tls() {
    use rgpu_control_client::snapshot_copy::{copy_off, copy_onto};
    let key = b"the admin key of the snapshot copy test".to_vec();
    let bytes: Vec<u8> = canary().iter().copied().cycle().take(3 << 20).collect();
    let (ca, tls) = pki(&["127.0.0.1"]);
    for (name, security, client) in [
        ("tls", tls, trusting(&ca, None)),
        ("plaintext", rgpu_tls::ServerSecurity::Plaintext, ClientSecurity::Plaintext),
    ] {
        let dir = std::env::temp_dir().join(format!("rgpu-tls-snapshot-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let checkpoint = rgpu_server::config::CheckpointConfig {
            admin_key: Some(key.clone()),
            dir: Some(dir.clone()),
            ..Default::default()
        };
        let server = TestServer::start_secured_checkpointing(security, checkpoint);
        let tap = Tap::start(&server.addr.to_string()).unwrap();
        let limit = std::time::Duration::from_secs(30);
        copy_onto(&tap.addr, &client, &key, "job.snap", &mut &bytes[..], bytes.len() as u64, limit).expect("copy onto");
        assert!(std::fs::read(dir.join("job.snap")).unwrap() == bytes, "{name}: the server's copy differs");
        let mut back = Vec::new();
        let n = copy_off(&tap.addr, &client, &key, "job.snap", &mut back, limit).expect("copy off");
        assert!(n == bytes.len() as u64 && back == bytes, "{name}: the copy off differs");
        assert!(tap.captured().len() > 2 * bytes.len(), "{name}: both copies crossed the relay");
        assert!(!tap.saw(&bytes[..64]), "{name}: the snapshot's bytes crossed the wire in clear");
        assert!(!tap.saw(&key), "{name}: the admin key crossed the wire");
        assert_eq!(tap.saw(b"RGPUSNP1"), name == "plaintext", "{name}: the preamble is inside TLS only under TLS");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
