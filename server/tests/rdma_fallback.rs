//! A client asking for RDMA from a server that serves TCP only (this host:
//! no device) is refused and carries on over TCP on the same connection.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::TestServer;
use rgpu_protocol::frame::{FrameHeader, Kind, HEADER_LEN};
use rgpu_protocol::message::Encoder;
use rgpu_protocol::PROTOCOL_VERSION;
use rgpu_transport::rdma::model::{Fabric, ModelConfig, ModelProvider};
use rgpu_transport::rdma::RdmaConfig;
use rgpu_transport::select::{DataTransport, Mode, Selector, RDMA_DATA_PREAMBLE};
use rgpu_transport::{tcp, Transport};

#[test]
fn rdma_request_to_a_tcp_server_falls_back_to_tcp() {
    let server = TestServer::start();
    let addr = server.addr.to_string();
    let h = server.open();
    let mut t = tcp::connect(&addr, Duration::from_secs(5)).unwrap();
    t.stream().set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    t.send(&[RDMA_DATA_PREAMBLE, &h.session_id.to_le_bytes(), &h.key]).unwrap();
    let mut st = [0u8; 8];
    t.recv_exact(&mut st).unwrap();
    assert_eq!(u32::from_le_bytes(st[..4].try_into().unwrap()), 0, "attached");
    assert_eq!(u32::from_le_bytes(st[4..].try_into().unwrap()), PROTOCOL_VERSION);

    // The client could do RDMA (an in-process model stands in for a NIC);
    // the server cannot, so both stay on TCP.
    let client = Selector::with_provider(
        Mode::Auto,
        Some(Arc::new(ModelProvider(Fabric::new(ModelConfig::default())))),
        RdmaConfig::default(),
    );
    let mut t = client.client_upgrade(t).expect("auto falls back");
    assert!(matches!(t, DataTransport::Tcp(_)));

    // And the session works over it.
    let mut msg = Vec::new();
    let n = Encoder::default().request(&mut msg, |mut r| r.set_ping(()));
    t.send(&[&FrameHeader::request(1, true, n, 0).encode(), &msg]).unwrap();
    let mut hb = [0u8; HEADER_LEN];
    t.recv_exact(&mut hb).unwrap();
    let rh = FrameHeader::decode(&hb).unwrap();
    assert_eq!((rh.kind, rh.seq), (Kind::Reply, 1));
    drop(t);
    server.stop();
}

#[test]
fn rdma_required_client_is_told_why() {
    let server = TestServer::start();
    let addr = server.addr.to_string();
    let h = server.open();
    let mut t = tcp::connect(&addr, Duration::from_secs(5)).unwrap();
    t.send(&[RDMA_DATA_PREAMBLE, &h.session_id.to_le_bytes(), &h.key]).unwrap();
    let mut st = [0u8; 8];
    t.recv_exact(&mut st).unwrap();
    let client = Selector::with_provider(
        Mode::Rdma,
        Some(Arc::new(ModelProvider(Fabric::new(ModelConfig::default())))),
        RdmaConfig::default(),
    );
    let e = client.client_upgrade(t).err().expect("rdma is required");
    assert!(e.to_string().contains("runs its data plane over TCP"), "{e}");
    server.stop();
}
