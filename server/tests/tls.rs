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
    let t = tcp::connect(addr, IO_TIMEOUT).map_err(|e| e.to_string())?;
    let mut t = match security {
        ClientSecurity::Plaintext => t,
        ClientSecurity::Tls(tls) => {
            let mut s = t.into_stream().unwrap();
            s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
            let conn = rgpu_tls::client::handshake_blocking(tls, addr, &mut s).map_err(|e| e.to_string())?;
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
fn session_through_a_tap(server: &TestServer, security: &ClientSecurity) -> (Tap, Vec<u8>) {
    let tap = Tap::start(&server.addr.to_string()).unwrap();
    let hello = rgpu_control_client::open(&tap.addr, "tls test", security).expect("control plane");
    assert!(!hello.devices.is_empty());
    let (status, t) = attach(&tap.addr, security, hello.session_id, &hello.key).expect("data plane");
    assert_eq!(status, 0);
    assert_eq!(t.is_tls(), security.is_tls());
    let mut c = DataClient::over(t);
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
    let (tap, key) = session_through_a_tap(&server, &trusting(&ca, None));
    let payload = canary();
    assert!(tap.captured().len() > payload.len(), "the copy crossed the relay");
    assert!(!tap.saw(&key), "the session key crossed the wire in clear");
    assert!(!tap.saw(&payload[..64]), "the copied data crossed the wire in clear");
    assert!(!tap.saw(b"RGPUCTL1") && !tap.saw(b"RGPUDAT1"), "the planes' preambles are inside TLS");

    // The same exchange in plaintext: the recorder sees all of it.
    let server = TestServer::start();
    let (tap, key) = session_through_a_tap(&server, &ClientSecurity::Plaintext);
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
