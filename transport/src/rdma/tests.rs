//! The RDMA protocol on the in-process verbs model: every behaviour the
//! transport promises, deterministically, with no hardware.

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use super::conn::{RdmaConfig, RdmaError, RdmaTransport};
use super::model::{Fabric, Fault, ModelConfig, ModelProvider};
use super::poll::PollConfig;
use super::verbs::WcStatus;
use crate::select::{DataTransport, Mode, Selector};
use crate::tcp::TcpTransport;
use crate::Transport;

fn small() -> RdmaConfig {
    RdmaConfig {
        recv_slots: 8,
        slot_size: 512,
        chunks: 4,
        chunk_size: 8192,
        bulk_min: 2048,
        read_chunk: 4096,
        read_depth: 3,
        cache_bytes: 16 << 20,
        poll: PollConfig { min_spins: 2, max_spins: 64 },
        ..RdmaConfig::default()
    }
}

fn pattern(len: usize, seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2654435761) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

/// Two transports connected over `fabric` (no TCP side channel), and the
/// queue pair numbers of each, for fault injection.
fn connect(fabric: &Fabric, a: RdmaConfig, b: RdmaConfig) -> (RdmaTransport, RdmaTransport, u32, u32) {
    let (ea, eb) = (fabric.endpoint(), fabric.endpoint());
    let (qa, qb) = (ea.qpn(), eb.qpn());
    let mut ta = RdmaTransport::prepare(Box::new(ea), a).unwrap();
    let mut tb = RdmaTransport::prepare(Box::new(eb), b).unwrap();
    let (ia, ib) = (ta.local_info(), tb.local_info());
    ta.connect(ib, "b".into()).unwrap();
    tb.connect(ia, "a".into()).unwrap();
    (ta, tb, qa, qb)
}

fn fabric() -> Fabric {
    Fabric::new(ModelConfig::default())
}

/// Runs `f` on a thread and fails the test if it has not finished in 20 s
/// (a protocol deadlock shows up as this failure, not a hung suite).
fn within<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(20)).expect("finished within 20 s")
}

fn frames_of_all_sizes(cfg: RdmaConfig) -> (RdmaTransport, RdmaTransport) {
    let f = fabric();
    let (mut a, mut b, _, _) = connect(&f, cfg, cfg);
    let sizes: Vec<usize> =
        vec![0, 1, 15, 16, 17, 495, 496, 497, 1000, 2047, 2048, 2049, 8191, 8192, 8193, 40_000, 100_000, 1 << 20];
    let s2 = sizes.clone();
    within(move || {
        let sender = thread::spawn(move || {
            for (i, &n) in s2.iter().enumerate() {
                let body = pattern(n, i as u32);
                let len = (n as u32).to_le_bytes();
                // A frame as the data plane sends it: header, message, bulk.
                a.send(&[&len, &body[..n / 3], &body[n / 3..]]).unwrap();
            }
            a
        });
        for (i, &n) in sizes.iter().enumerate() {
            let mut len = [0u8; 4];
            b.recv_exact(&mut len).unwrap();
            assert_eq!(u32::from_le_bytes(len) as usize, n);
            let mut got = vec![0u8; n];
            // Read in uneven pieces, as a frame parser does.
            let cut = n / 7;
            b.recv_exact(&mut got[..cut]).unwrap();
            b.recv_exact(&mut got[cut..]).unwrap();
            assert!(got == pattern(n, i as u32), "frame {i} of {n} bytes intact");
        }
        (sender.join().unwrap(), b)
    })
}

#[test]
fn frames_of_all_sizes_through_staging() {
    let (a, b) = frames_of_all_sizes(small());
    let s = a.stats();
    assert!(s.chunks_written > 0, "bulk went by RDMA WRITE");
    assert_eq!(s.read_requests, 0);
    assert_eq!(b.buffered(), 0);
}

#[test]
fn frames_of_all_sizes_zero_copy() {
    let (a, b) = frames_of_all_sizes(RdmaConfig { zero_copy: true, ..small() });
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!(sa.chunks_written, 0);
    assert!(sa.read_requests > 0 && sb.reads_served > 0, "bulk went by RDMA READ");
}

#[test]
fn bulk_is_chunked_and_pipelined() {
    let f = fabric();
    let (mut a, mut b, qa, _) = connect(&f, small(), small());
    let data = pattern(100_000, 7);
    let d2 = data.clone();
    let (a, got) = within(move || {
        let t = thread::spawn(move || {
            a.send(&[&d2]).unwrap();
            a
        });
        let mut got = vec![0u8; 100_000];
        b.recv_exact(&mut got).unwrap();
        (t.join().unwrap(), got)
    });
    assert!(got == data);
    // 100 000 bytes in 8 KiB chunks.
    assert_eq!(a.stats().chunks_written, 13);
    assert_eq!(f.stats(qa).writes, 13);
}

#[test]
fn credits_run_out_and_come_back() {
    let f = fabric();
    let (mut a, mut b, _, _) = connect(&f, small(), small());
    let (a, b) = within(move || {
        let t = thread::spawn(move || {
            // Each send is one message; the peer has 8 slots.
            for i in 0..200u32 {
                a.send(&[&i.to_le_bytes()]).unwrap();
            }
            a
        });
        // Let the sender run dry before reading anything.
        thread::sleep(Duration::from_millis(50));
        for i in 0..200u32 {
            let mut v = [0u8; 4];
            b.recv_exact(&mut v).unwrap();
            assert_eq!(u32::from_le_bytes(v), i);
        }
        (t.join().unwrap(), b)
    });
    assert!(a.stats().credit_waits > 0, "the sender had to wait for credits");
    assert!(b.stats().credit_msgs > 0, "the reader returned credits on its own");
    assert_eq!(a.stats().msgs_sent, 200);
}

#[test]
fn chunk_credits_run_out_and_come_back() {
    let f = fabric();
    let (mut a, mut b, _, _) = connect(&f, small(), small());
    within(move || {
        let t = thread::spawn(move || {
            // 4 chunks of 8 KiB at the receiver; 40 chunks' worth.
            let d = pattern(320 << 10, 3);
            a.send(&[&d]).unwrap();
            a
        });
        thread::sleep(Duration::from_millis(20));
        let mut got = vec![0u8; 320 << 10];
        b.recv_exact(&mut got).unwrap();
        assert!(got == pattern(320 << 10, 3));
        let a = t.join().unwrap();
        assert!(a.stats().credit_waits > 0);
    });
}

#[test]
fn both_ends_sending_at_once_do_not_deadlock() {
    for zero_copy in [false, true] {
        let f = fabric();
        let cfg = RdmaConfig { zero_copy, ..small() };
        let (mut a, mut b, _, _) = connect(&f, cfg, cfg);
        within(move || {
            let n = 256 << 10;
            let ta = thread::spawn(move || {
                for i in 0..4 {
                    a.send(&[&pattern(n, i), b"tail"]).unwrap();
                }
                let mut got = vec![0u8; n + 4];
                for i in 0..4 {
                    a.recv_exact(&mut got).unwrap();
                    assert!(got[..n] == pattern(n, 100 + i)[..]);
                }
                a
            });
            for i in 0..4 {
                b.send(&[&pattern(n, 100 + i), b"tail"]).unwrap();
            }
            let mut got = vec![0u8; n + 4];
            for i in 0..4 {
                b.recv_exact(&mut got).unwrap();
                assert!(got[..n] == pattern(n, i)[..]);
                assert_eq!(&got[n..], b"tail");
            }
            let a = ta.join().unwrap();
            assert!(a.stats().absorbed_bytes > 0 || b.stats().absorbed_bytes > 0);
        });
    }
}

#[test]
fn registration_cache_registers_a_buffer_once() {
    let f = fabric();
    let cfg = RdmaConfig { zero_copy: true, ..small() };
    let (mut a, mut b, qa, qb) = connect(&f, cfg, cfg);
    let (a, b) = within(move || {
        let t = thread::spawn(move || {
            let buf = pattern(1 << 20, 9);
            for _ in 0..5 {
                a.send(&[&buf]).unwrap();
            }
            a
        });
        let mut dst = vec![0u8; 1 << 20];
        for _ in 0..5 {
            b.recv_exact(&mut dst).unwrap();
            assert!(dst == pattern(1 << 20, 9));
        }
        (t.join().unwrap(), b)
    });
    let (ca, cb) = (a.stats().cache, b.stats().cache);
    assert_eq!((ca.misses, ca.hits), (1, 4), "sender registered its buffer once");
    assert_eq!((cb.misses, cb.hits), (1, 4), "receiver registered its buffer once");
    // Fixed rings (4 each) plus one cached registration each.
    assert_eq!(f.stats(qa).registrations, 5);
    assert_eq!(f.stats(qb).registrations, 5);
    drop((a, b));
    assert_eq!(f.live_registrations(), 0, "everything deregistered on close");
}

#[test]
fn peer_disconnect_mid_transfer_is_an_error() {
    // The receiver goes away while a bulk send waits for chunk credits.
    let f = fabric();
    let (mut a, mut b, _, _) = connect(&f, small(), small());
    let err = within(move || {
        let t = thread::spawn(move || a.send(&[&pattern(1 << 20, 1)]));
        let mut some = vec![0u8; 20_000];
        b.recv_exact(&mut some).unwrap();
        drop(b);
        t.join().unwrap()
    });
    let e = err.expect_err("send to a vanished peer fails");
    assert!(e.to_string().contains("disconnected") || e.to_string().contains("completed with"), "{e}");

    // The sender's process dies while the receiver waits for the rest.
    let f = fabric();
    let (mut a, mut b, qa, _) = connect(&f, small(), small());
    let fab = f.clone();
    let e = within(move || {
        a.send(&[&[1u8; 100]]).unwrap();
        let t = thread::spawn(move || {
            let mut buf = [0u8; 200];
            b.recv_exact(&mut buf)
        });
        thread::sleep(Duration::from_millis(20));
        fab.inject(qa, Fault::Kill);
        let r = t.join().unwrap();
        drop(a);
        r
    })
    .expect_err("receive from a dead peer fails");
    assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "{e}");
}

#[test]
fn clean_close_is_end_of_stream_after_the_data() {
    let f = fabric();
    let (mut a, mut b, _, _) = connect(&f, small(), small());
    a.send(&[b"last words"]).unwrap();
    drop(a);
    let mut got = [0u8; 10];
    b.recv_exact(&mut got).unwrap();
    assert_eq!(&got, b"last words");
    let e = b.recv_exact(&mut got).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    assert!(b.send(&[b"x"]).is_err());
}

#[test]
fn bad_rkey_is_an_error_not_a_crash() {
    // A peer advertising a staging ring we may not write.
    let f = fabric();
    let (ea, eb) = (f.endpoint(), f.endpoint());
    let mut a = RdmaTransport::prepare(Box::new(ea), small()).unwrap();
    let mut b = RdmaTransport::prepare(Box::new(eb), small()).unwrap();
    let (ia, mut ib) = (a.local_info(), b.local_info());
    ib.staging_rkey ^= 0x5555;
    a.connect(ib, "b".into()).unwrap();
    b.connect(ia, "a".into()).unwrap();
    // The refused WRITE surfaces at the next call at the latest (a send
    // returns once its chunks are posted, as a TCP send returns once the
    // kernel has the bytes).
    let first = a.send(&[&pattern(10_000, 1)]);
    let e = first.and_then(|()| a.send(&[b"again"])).unwrap_err();
    assert!(e.to_string().contains("RemoteAccess"), "{e}");
    assert!(a.send(&[b"again"]).is_err(), "the connection stays broken");
    let mut x = [0u8; 1];
    assert!(b.recv_exact(&mut x).is_err(), "the peer's queue pair failed too");

    // A READ the NIC refuses (as it would a stale or forged rkey).
    let f = fabric();
    let cfg = RdmaConfig { zero_copy: true, ..small() };
    let (mut a, mut b, _, qb) = connect(&f, cfg, cfg);
    f.inject(qb, Fault::FailNext(WcStatus::RemoteAccess));
    let (sent, got) = within(move || {
        let t = thread::spawn(move || {
            let mut got = vec![0u8; 10_000];
            b.recv_exact(&mut got)
        });
        let r = a.send(&[&pattern(10_000, 2)]);
        (r, t.join().unwrap())
    });
    let e = got.expect_err("the reader reports the refused READ");
    assert!(e.to_string().contains("RemoteAccess"), "{e}");
    assert!(sent.is_err(), "the sender waiting for READ-DONE learns of it");
}

#[test]
fn delayed_completions_and_sleeping_waiters() {
    let f = Fabric::new(ModelConfig { delay_polls: 5, ..Default::default() });
    let cfg = RdmaConfig { poll: PollConfig { min_spins: 1, max_spins: 2 }, ..small() };
    let (mut a, mut b, _, _) = connect(&f, cfg, cfg);
    let (a, b) = within(move || {
        let t = thread::spawn(move || {
            thread::sleep(Duration::from_millis(30));
            for i in 0..20 {
                a.send(&[&pattern(3000 + i * 500, i as u32)]).unwrap();
            }
            a
        });
        for i in 0..20 {
            let mut got = vec![0u8; 3000 + i * 500];
            b.recv_exact(&mut got).unwrap();
            assert!(got == pattern(3000 + i * 500, i as u32));
        }
        (t.join().unwrap(), b)
    });
    assert!(b.stats().sleeps > 0, "the idle receiver slept on the completion queue");
    let _ = a;
}

#[test]
fn shutdown_wakes_a_blocked_receive() {
    let f = fabric();
    let (_a, mut b, _, _) = connect(&f, small(), small());
    let h = b.shutdown_handle();
    let e = within(move || {
        let t = thread::spawn(move || {
            let mut x = [0u8; 1];
            b.recv_exact(&mut x)
        });
        thread::sleep(Duration::from_millis(20));
        h.shutdown();
        t.join().unwrap()
    })
    .unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::NotConnected);
}

#[test]
fn unknown_completion_ids_and_garbage_headers_break_the_connection() {
    // A peer that writes a chunk index beyond our ring.
    let f = fabric();
    let (ea, eb) = (f.endpoint(), f.endpoint());
    let mut a = RdmaTransport::prepare(Box::new(ea), small()).unwrap();
    let mut b = RdmaTransport::prepare(Box::new(eb), small()).unwrap();
    let (mut ia, ib) = (a.local_info(), b.local_info());
    // b believes a has 64 chunks of 8 KiB: it will name chunk 4+ eventually,
    // which a's staging does not have; the model refuses the write past the
    // registration, and a's index check would refuse the immediate.
    ia.chunks = 64;
    a.connect(ib, "b".into()).unwrap();
    b.connect(ia, "a".into()).unwrap();
    let r = within(move || {
        let t = thread::spawn(move || {
            let mut got = vec![0u8; 8192 * 6];
            a.recv_exact(&mut got)
        });
        let s = b.send(&[&pattern(8192 * 6, 5)]);
        (s, t.join().unwrap())
    });
    assert!(r.0.is_err() || r.1.is_err(), "an over-long ring is caught");
}

// ---- set-up over TCP -------------------------------------------------

fn tcp_pair() -> (TcpTransport, TcpTransport) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let t = thread::spawn(move || TcpTransport::new(l.accept().unwrap().0).unwrap());
    let c = crate::tcp::connect(&addr, Duration::from_secs(5)).unwrap();
    (c, t.join().unwrap())
}

fn model_selector(mode: Mode, f: &Fabric) -> Selector {
    Selector::with_provider(mode, Some(Arc::new(ModelProvider(f.clone()))), small())
}

fn upgrade(client: Selector, server: Selector) -> (Result<DataTransport, String>, Result<DataTransport, String>) {
    let (c, s) = tcp_pair();
    let st = thread::spawn(move || server.server_upgrade(s, true).map_err(|e| e.to_string()));
    let ct = client.client_upgrade(c).map_err(|e| e.to_string());
    (ct, st.join().unwrap())
}

#[test]
fn setup_over_tcp_then_frames_over_rdma() {
    let f = fabric();
    let (c, s) = upgrade(model_selector(Mode::Auto, &f), model_selector(Mode::Auto, &f));
    let (mut c, mut s) = (c.unwrap(), s.unwrap());
    assert_eq!((c.kind(), s.kind()), ("rdma", "rdma"));
    within(move || {
        let t = thread::spawn(move || {
            c.send(&[b"ping", &pattern(50_000, 1)]).unwrap();
            let mut p = [0u8; 4];
            c.recv_exact(&mut p).unwrap();
            assert_eq!(&p, b"pong");
            // The client goes: the server learns it from the side channel
            // or the flushed queue pair, whichever is first.
        });
        let mut got = vec![0u8; 50_004];
        s.recv_exact(&mut got).unwrap();
        assert_eq!(&got[..4], b"ping");
        assert!(got[4..] == pattern(50_000, 1)[..]);
        s.send(&[b"pong"]).unwrap();
        t.join().unwrap();
        let mut p = [0u8; 4];
        let e = s.recv_exact(&mut p).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "{e}");
    });
}

#[test]
fn server_without_rdma_refuses_and_auto_client_stays_on_tcp() {
    let f = fabric();
    let server = Selector::with_provider(Mode::Tcp, None, small());
    let (c, s) = upgrade(model_selector(Mode::Auto, &f), server);
    let (mut c, mut s) = (c.unwrap(), s.unwrap());
    assert_eq!((c.kind(), s.kind()), ("tcp", "tcp"));
    c.send(&[b"over tcp"]).unwrap();
    let mut got = [0u8; 8];
    s.recv_exact(&mut got).unwrap();
    assert_eq!(&got, b"over tcp");
    assert_eq!(f.live_registrations(), 0, "the unused client endpoint was torn down");
}

#[test]
fn rdma_required_client_fails_when_refused() {
    let f = fabric();
    let server = Selector::with_provider(Mode::Auto, None, small());
    let (c, s) = upgrade(model_selector(Mode::Rdma, &f), server);
    assert!(c.err().unwrap().contains("refused"));
    assert_eq!(s.unwrap().kind(), "tcp");
}

#[test]
fn garbage_setup_request_is_refused_not_fatal() {
    let server = Selector::with_provider(Mode::Auto, Some(Arc::new(ModelProvider(fabric()))), small());
    let (mut c, s) = tcp_pair();
    let st = thread::spawn(move || server.server_upgrade(s, true));
    c.send(&[&[0xAB; super::wire::CONN_INFO_LEN]]).unwrap();
    let mut k = [0u8; 1];
    c.recv_exact(&mut k).unwrap();
    assert_eq!(k[0], super::wire::SETUP_REFUSE);
    assert_eq!(st.join().unwrap().unwrap().kind(), "tcp");
}

#[test]
fn auto_on_a_host_without_rdma_falls_back_to_tcp() {
    // On this host (no plugin built, or no rdma-core, or no device) `auto`
    // succeeds and does not ask for RDMA; `rdma` is an error that says why.
    // On a host with a device, both pick RDMA.
    let auto = Selector::new(Mode::Auto, RdmaConfig::default()).expect("auto never fails");
    match crate::rdma::plugin::discover() {
        Ok(_) => assert!(auto.wants_rdma()),
        Err(why) => {
            eprintln!("RDMA not available here: {why}");
            assert!(!auto.wants_rdma());
            assert_eq!(auto.preamble(b"RGPUDAT1"), b"RGPUDAT1");
            let e = Selector::new(Mode::Rdma, RdmaConfig::default()).err().expect("rdma requires a device");
            assert!(e.to_string().contains(&why.to_string()), "{e}");
        }
    }
    let tcp = Selector::new(Mode::Tcp, RdmaConfig::default()).unwrap();
    assert!(!tcp.wants_rdma());
}

#[test]
fn knobs_set_zero_copy_and_ring_size() {
    let c = RdmaConfig::with_knobs(true, Some(256)).unwrap();
    assert!(c.zero_copy);
    assert_eq!(c.recv_slots, 256);
    assert_eq!(RdmaConfig::with_knobs(false, None).unwrap().recv_slots, RdmaConfig::default().recv_slots);
    assert!(RdmaConfig::with_knobs(false, Some(3)).unwrap_err().contains("4..=4096"));
    assert!(RdmaConfig::with_knobs(false, Some(5000)).is_err());
    // Both ends with the knobs set still talk, in both directions.
    let f = fabric();
    let (mut a, mut b, _, _) = connect(&f, RdmaConfig::with_knobs(true, Some(4)).unwrap(), RdmaConfig::with_knobs(true, Some(512)).unwrap());
    within(move || {
        let t = thread::spawn(move || {
            let mut got = vec![0u8; 3 << 20];
            b.recv_exact(&mut got).unwrap();
            assert!(got == pattern(3 << 20, 9));
            b.send(&[b"ok"]).unwrap();
        });
        a.send(&[&pattern(3 << 20, 9)]).unwrap();
        let mut ok = [0u8; 2];
        a.recv_exact(&mut ok).unwrap();
        assert_eq!(&ok, b"ok");
        assert!(a.stats().read_requests > 0, "zero-copy: the bulk went by READ");
        t.join().unwrap();
    });
}

#[test]
fn rdma_error_maps_to_io_error_kinds() {
    let e: std::io::Error = RdmaError::Disconnected("x".into()).into();
    assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    let e: std::io::Error = RdmaError::Completion { op: "send", status: WcStatus::RetryExceeded }.into();
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset);
}

// ---- partitions (P_Keys per tenant) ------------------------------------

fn partitioned_fabric() -> Fabric {
    let f = fabric();
    // Default partition, tenant A (full member), tenant B (limited member).
    f.set_pkey_table(vec![0xffff, 0x8001, 0x0002]);
    f
}

fn upgrade_in(
    client: Selector,
    cpkey: Option<u16>,
    server: Selector,
    spkey: Option<u16>,
) -> (Result<DataTransport, String>, Result<DataTransport, String>) {
    let (c, s) = tcp_pair();
    let st = thread::spawn(move || server.server_upgrade_in(s, true, spkey).map_err(|e| e.to_string()));
    let ct = client.client_upgrade_in(c, cpkey).map_err(|e| e.to_string());
    (ct, st.join().unwrap())
}

#[test]
fn pkey_index_lookup_prefers_exact_then_partition() {
    use super::verbs::find_pkey_index;
    let table = [0xffff, 0x0001, 0x8001, 0x0002];
    assert_eq!(find_pkey_index(&table, 0x8001), Some(2));
    assert_eq!(find_pkey_index(&table, 0x0001), Some(1));
    assert_eq!(find_pkey_index(&table, 0x8002), Some(3), "same partition, limited membership");
    assert_eq!(find_pkey_index(&table, 0x8003), None);
    assert_eq!(find_pkey_index(&table, 0x8000), None, "invalid key");
    assert_eq!(find_pkey_index(&[], 0xffff), None);
}

#[test]
fn matching_pkeys_connect_in_that_partition() {
    let f = partitioned_fabric();
    let (ea, eb) = (f.endpoint(), f.endpoint());
    let (qa, qb) = (ea.qpn(), eb.qpn());
    let mut a = RdmaTransport::prepare_in(Box::new(ea), small(), Some(0x8001)).unwrap();
    let mut b = RdmaTransport::prepare_in(Box::new(eb), small(), Some(0x8001)).unwrap();
    assert_eq!((f.pkey_of(qa), f.pkey_of(qb)), (Some(0x8001), Some(0x8001)));
    let (ia, ib) = (a.local_info(), b.local_info());
    assert_eq!((ia.pkey, ib.pkey), (0x8001, 0x8001));
    a.connect(ib, "b".into()).unwrap();
    b.connect(ia, "a".into()).unwrap();
    within(move || {
        a.send(&[b"in partition 1", &pattern(20_000, 3)]).unwrap();
        let mut got = vec![0u8; 14 + 20_000];
        b.recv_exact(&mut got).unwrap();
        assert_eq!(&got[..14], b"in partition 1");
        assert!(got[14..] == pattern(20_000, 3)[..]);
    });

    // And over the set-up exchange, with both sessions' leases naming it.
    let (c, s) = upgrade_in(model_selector(Mode::Rdma, &f), Some(0x8001), model_selector(Mode::Auto, &f), Some(0x8001));
    assert_eq!((c.unwrap().kind(), s.unwrap().kind()), ("rdma", "rdma"));
}

#[test]
fn mismatched_pkeys_refuse_rdma() {
    let f = partitioned_fabric();
    // auto: both ends carry on over TCP.
    let (c, s) = upgrade_in(model_selector(Mode::Auto, &f), Some(0x0002), model_selector(Mode::Auto, &f), Some(0x8001));
    let (mut c, mut s) = (c.unwrap(), s.unwrap());
    assert_eq!((c.kind(), s.kind()), ("tcp", "tcp"));
    c.send(&[b"over tcp"]).unwrap();
    let mut got = [0u8; 8];
    s.recv_exact(&mut got).unwrap();
    assert_eq!(&got, b"over tcp");
    drop((c, s));
    assert_eq!(f.live_registrations(), 0, "both unused endpoints were torn down");

    // rdma: the client fails, and says why.
    let (c, s) = upgrade_in(model_selector(Mode::Rdma, &f), None, model_selector(Mode::Auto, &f), Some(0x8001));
    let e = c.err().expect("rdma is required");
    assert!(e.contains("partition mismatch"), "{e}");
    assert_eq!(s.unwrap().kind(), "tcp");

    // A client with a key and a server without one: refused as well.
    let (c, s) = upgrade_in(model_selector(Mode::Rdma, &f), Some(0x8001), model_selector(Mode::Auto, &f), None);
    assert!(c.err().expect("refused").contains("partition mismatch"));
    assert_eq!(s.unwrap().kind(), "tcp");

    // Directly: connect refuses a peer of another partition.
    let mut a = RdmaTransport::prepare_in(Box::new(f.endpoint()), small(), Some(0x8001)).unwrap();
    let b = RdmaTransport::prepare(Box::new(f.endpoint()), small()).unwrap();
    match a.connect(b.local_info(), "b".into()) {
        Err(RdmaError::Setup(why)) => assert!(why.contains("partition mismatch"), "{why}"),
        o => panic!("expected a set-up error, got {:?}", o.map(|_| ())),
    }
}

#[test]
fn pkey_absent_from_the_port_table_is_an_error() {
    let f = partitioned_fabric();
    match RdmaTransport::prepare_in(Box::new(f.endpoint()), small(), Some(0x8007)) {
        Err(RdmaError::Verbs(super::verbs::VerbsError::NoPkey { pkey: 0x8007, .. })) => {}
        o => panic!("expected NoPkey, got {:?}", o.map(|_| ())),
    }
    assert_eq!(f.live_registrations(), 0);
    // Through the set-up: the server has no such partition, so it refuses;
    // an auto client stays on TCP, a required one fails with the reason.
    let (c, s) = upgrade_in(model_selector(Mode::Auto, &f), Some(0x8007), model_selector(Mode::Auto, &f), Some(0x8007));
    assert_eq!((c.unwrap().kind(), s.unwrap().kind()), ("tcp", "tcp"));
    let (c, s) = upgrade_in(model_selector(Mode::Rdma, &f), Some(0x8007), model_selector(Mode::Auto, &f), Some(0x8007));
    let e = c.err().expect("rdma is required");
    assert!(e.contains("P_Key 0x8007"), "{e}");
    assert_eq!(s.unwrap().kind(), "tcp");
}

#[test]
fn model_drops_traffic_between_partitions() {
    // Below the set-up check: two queue pairs in different partitions that
    // were connected anyway see their sends time out, as on a fabric.
    use super::verbs::{Access, Verbs, WorkRequest};
    let f = partitioned_fabric();
    let (mut a, mut b) = (f.endpoint(), f.endpoint());
    a.set_pkey_index(1).unwrap();
    b.set_pkey_index(2).unwrap();
    let (ia, ib) = (a.local_info(), b.local_info());
    a.connect(&ib).unwrap();
    b.connect(&ia).unwrap();
    assert!(a.set_pkey_index(0).is_err(), "only before connect");
    let mut buf = vec![0u8; 64];
    let mr = unsafe { a.reg_mr(buf.as_mut_ptr(), buf.len(), Access::LOCAL_WRITE) }.unwrap();
    a.post_send(1, &WorkRequest::Send { local: mr.sge(mr.addr, 64) }).unwrap();
    let mut out = [super::verbs::Completion::EMPTY; 4];
    let mut n = 0;
    for _ in 0..100 {
        n = a.poll_cq(&mut out).unwrap();
        if n > 0 {
            break;
        }
    }
    assert_eq!(n, 1);
    assert_eq!(out[0].status, WcStatus::RetryExceeded);
    a.dereg_mr(&mr).unwrap();
}
