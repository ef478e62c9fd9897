//! Control plane and data-connection attach, over real sockets.

mod common;

use std::time::Duration;

use common::{attach_raw, control_with_version, DataClient, TestServer};
use rgpu_protocol::PROTOCOL_VERSION;

#[test]
fn hello_list_devices_open_session() {
    let srv = TestServer::start_with(2, 64 << 20, Duration::from_secs(30));
    let h = srv.open();
    assert_eq!(h.server_version, PROTOCOL_VERSION);
    assert_eq!(h.backend, "sim");
    assert!(h.server_name.contains("rgpu-server"));
    assert_eq!(h.devices.len(), 2);
    for (i, d) in h.devices.iter().enumerate() {
        assert_eq!(d.ordinal, i as u32);
        assert!(d.name.contains("rgpu sim"), "{}", d.name);
        assert_eq!(d.uuid.len(), 16);
        assert_eq!(d.total_mem, 64 << 20);
        // One PCI domain per server (derived from its UUID seed), one bus per device.
        assert_eq!(d.pci, (h.devices[0].pci.0, 0x10 + i as i32, 0));
        let attr = |id: u32| d.attributes.iter().find(|a| a.0 == id).map(|a| a.1);
        assert_eq!(d.attributes.len(), 161);
        assert_eq!(attr(1), Some(1024)); // MAX_THREADS_PER_BLOCK
        assert_eq!(attr(16), Some(132)); // MULTIPROCESSOR_COUNT
        assert_eq!(attr(75), Some(9)); // COMPUTE_CAPABILITY_MAJOR
        assert_eq!(attr(76), Some(0));
        assert_eq!(attr(33), Some(0x10 + i as i32)); // PCI_BUS_ID
    }
    assert_ne!(h.devices[0].uuid, h.devices[1].uuid);
    // UUIDs are stable: a second server on this host reports the same ones.
    let again = TestServer::start_with(1, 64 << 20, Duration::from_secs(30)).open();
    assert_eq!(again.devices[0].uuid, h.devices[0].uuid);
    assert_ne!(h.session_id, 0);
    assert_eq!(h.key.len(), 16);
    assert_eq!(h.attach_timeout_ms, 30_000);
    // Every openSession gets its own id and key.
    let h2 = srv.open();
    assert_ne!(h2.session_id, h.session_id);
    assert_ne!(h2.key, h.key);
}

#[test]
fn other_protocol_version_gets_no_session() {
    let srv = TestServer::start();
    let err = control_with_version(&srv.addr.to_string(), PROTOCOL_VERSION + 1).unwrap_err();
    assert!(err.to_string().contains("protocol version mismatch"), "{err}");
}

#[test]
fn attach_with_wrong_key_or_twice_is_refused() {
    let srv = TestServer::start();
    let addr = srv.addr.to_string();
    let h = srv.open();
    let mut bad = h.key.clone();
    bad[0] ^= 1;
    assert_eq!(DataClient::attach(&addr, h.session_id, &bad).err(), Some(400));
    assert_eq!(DataClient::attach(&addr, h.session_id ^ 1, &h.key).err(), Some(400));
    // A refused attempt does not burn the session: the right key still works.
    let mut c = DataClient::attach(&addr, h.session_id, &h.key).expect("attach");
    assert_eq!(c.ping().result, 0);
    // Exactly one data connection per session.
    let (mut t, status, _) = attach_raw(&addr, h.session_id, &h.key);
    assert_eq!(status, 400);
    let mut b = [0u8; 1];
    assert!(rgpu_transport::Transport::recv_exact(&mut t, &mut b).is_err(), "refused connection is closed");
    assert_eq!(c.ping().result, 0);
}

#[test]
fn session_not_attached_in_time_is_dropped() {
    let srv = TestServer::start_with(1, 64 << 20, Duration::from_millis(200));
    let h = srv.open();
    assert_eq!(h.attach_timeout_ms, 200);
    std::thread::sleep(Duration::from_millis(700));
    assert_eq!(DataClient::attach(&srv.addr.to_string(), h.session_id, &h.key).err(), Some(400));
    // A prompt one is fine.
    let h = srv.open();
    assert!(DataClient::attach(&srv.addr.to_string(), h.session_id, &h.key).is_ok());
}

#[test]
fn unknown_preamble_is_closed() {
    use std::io::{Read, Write};
    let srv = TestServer::start();
    let mut s = std::net::TcpStream::connect(srv.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"HTTP/1.1").unwrap();
    let mut b = [0u8; 1];
    assert_eq!(s.read(&mut b).unwrap_or(0), 0);
    // The server is still there.
    assert_eq!(srv.session().ping().result, 0);
}

#[test]
fn shutdown_closes_sessions() {
    let srv = TestServer::start();
    let mut c = srv.session();
    assert_eq!(c.ping().result, 0);
    srv.stop();
    let mut b = [0u8; 1];
    assert!(rgpu_transport::Transport::recv_exact(&mut c.t, &mut b).is_err());
}
