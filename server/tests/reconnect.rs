//! A session outlives a broken data connection for the reconnect grace: the
//! client comes back with its key and the last reply it received, the server
//! says the last request it executed and sends again the replies the client
//! missed, so nothing runs twice and nothing is lost.

mod common;

use std::time::{Duration, Instant};

use common::kernels::{params, BUSY_PTX};
use common::{Body, TestServer};
use rgpu_server::limits::Limits;
use rgpu_transport::Transport;

fn server(grace: Duration) -> TestServer {
    TestServer::start_limited(Limits { reconnect_grace: grace, ..Limits::default() })
}

fn free_now(srv: &TestServer) -> u64 {
    srv.session().mem_info().0
}

#[test]
fn a_reply_lost_with_the_connection_is_sent_again_not_run_again() {
    let srv = server(Duration::from_secs(10));
    let mut c = srv.session();
    let (free0, _) = c.mem_info();
    let before = c.last_reply;
    // The allocation runs, but its reply never reaches the client.
    let seq = c.start_call(0, &[], |r| {
        let mut m = r.init_mem_alloc();
        m.set_device(0);
        m.set_size(1 << 20);
    });
    std::thread::sleep(Duration::from_millis(200));
    let (status, executed) = c.resume_with(before, None);
    assert_eq!(status, 0);
    assert_eq!(executed, seq, "the server ran the allocation");
    let r = c.read_reply().unwrap();
    assert_eq!((r.seq, r.result), (seq, 0), "the missed reply comes again");
    let ptr = r.ptr();
    assert!(ptr != 0);
    let (free1, _) = c.mem_info();
    assert_eq!(free0 - free1, 1 << 20, "allocated once, not twice");
    assert_eq!(c.htod(ptr, &[5; 64]).result, 0);
    assert_eq!(c.dtoh(ptr, 64).bulk, vec![5; 64]);
}

#[test]
fn a_copy_cut_in_its_middle_is_sent_again_whole() {
    let srv = server(Duration::from_secs(10));
    let mut c = srv.session();
    let ptr = c.alloc_ok(4 << 20);
    let data: Vec<u8> = (0..4u32 << 20).map(|i| (i * 31 % 251) as u8).collect();
    let seq = c.start_call(data.len() as u64, &data[..1 << 20], |r| {
        let mut m = r.init_memcpy_hto_d();
        m.set_dst(ptr);
        m.set_stream(0);
    });
    std::thread::sleep(Duration::from_millis(100));
    let (status, executed) = c.resume();
    assert_eq!(status, 0);
    assert_eq!(executed, seq - 1, "a request whose bulk never arrived whole did not run");
    c.set_seq(executed);
    assert_eq!(c.htod(ptr, &data).result, 0);
    assert_eq!(c.dtoh(ptr, data.len() as u64).bulk, data);
}

#[test]
fn a_device_to_host_reply_lost_is_read_again() {
    let srv = server(Duration::from_secs(10));
    let mut c = srv.session();
    let ptr = c.alloc_ok(8 << 20);
    let data: Vec<u8> = (0..8u32 << 20).map(|i| (i % 253) as u8).collect();
    assert_eq!(c.htod(ptr, &data).result, 0);
    let before = c.last_reply;
    let seq = c.start_call(0, &[], |r| {
        let mut m = r.init_memcpy_dto_h();
        m.set_src(ptr);
        m.set_size(8 << 20);
        m.set_stream(0);
    });
    std::thread::sleep(Duration::from_millis(100));
    let (status, executed) = c.resume_with(before, None);
    assert_eq!((status, executed), (0, seq));
    let r = c.read_reply().unwrap();
    assert_eq!((r.seq, r.result), (seq, 0));
    assert!(r.bulk == data, "the replayed reply carries the device's bytes");
}

#[test]
fn asynchronous_work_queued_before_the_cut_keeps_running_and_counts_once() {
    let srv = server(Duration::from_secs(10));
    let mut c = srv.session();
    let ptr = c.alloc_ok(4);
    assert_eq!(c.htod(ptr, &[0; 4]).result, 0);
    // Each asynchronous copy writes a new value: the last one wins.
    for v in 1..=50u32 {
        c.post(&v.to_le_bytes(), |r| {
            let mut m = r.init_memcpy_hto_d();
            m.set_dst(ptr);
            m.set_stream(0);
        });
    }
    let last = c.seq();
    std::thread::sleep(Duration::from_millis(100));
    let (status, executed) = c.resume();
    assert_eq!((status, executed), (0, last), "the 50 posts ran before the resume");
    assert_eq!(c.dtoh(ptr, 4).bulk, 50u32.to_le_bytes());
}

#[test]
fn only_the_key_resumes_a_session_and_a_second_connection_replaces_the_first() {
    let srv = server(Duration::from_secs(10));
    let mut c = srv.session();
    let ptr = c.alloc_ok(16);
    assert_eq!(c.resume_with(c.last_reply, Some(&[0u8; 16])).0, 400, "a wrong key is CUDA_ERROR_INVALID_HANDLE");
    let (status, _) = c.resume();
    assert_eq!(status, 0, "the right key still resumes it");
    assert_eq!(c.htod(ptr, &[1; 16]).result, 0);
    // A resume while the session has a working connection replaces it.
    let (status, _) = c.resume();
    assert_eq!(status, 0);
    assert_eq!(c.dtoh(ptr, 16).bulk, vec![1; 16]);
}

#[test]
fn a_session_whose_client_never_comes_back_is_freed_after_the_grace() {
    let grace = Duration::from_millis(800);
    let srv = server(grace);
    let total = free_now(&srv);
    let mut c = srv.session();
    let ptr = c.alloc_ok(64 << 20);
    assert_eq!(c.htod(ptr, &[9; 16]).result, 0);
    let mut c2 = srv.session();
    assert!(c2.mem_info().0 <= total - (64 << 20));
    let t0 = Instant::now();
    let mut gone = c;
    gone.t.shutdown(); // the connection breaks; the client never returns
    std::thread::sleep(grace / 2);
    assert!(c2.mem_info().0 <= total - (64 << 20), "the session was kept within its grace");
    let freed = loop {
        if c2.mem_info().0 == total {
            break t0.elapsed();
        }
        assert!(t0.elapsed() < grace + Duration::from_secs(3), "the session's memory is still held after the grace");
        std::thread::sleep(Duration::from_millis(20));
    };
    eprintln!("freed {freed:?} after the cut (grace {grace:?})");
    assert!(freed >= grace);
    assert_ne!(gone.resume().0, 0, "after the grace the session cannot be resumed");
    gone.cut();
}

#[test]
fn an_orderly_close_frees_at_once_despite_the_grace() {
    let srv = server(Duration::from_secs(30));
    let total = free_now(&srv);
    let mut c = srv.session();
    c.alloc_ok(64 << 20);
    let t0 = Instant::now();
    drop(c); // sends Close
    let mut c2 = srv.session();
    while c2.mem_info().0 != total {
        assert!(t0.elapsed() < Duration::from_secs(2), "an orderly close held the session");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_silent_client_is_cut_after_the_client_timeout_then_freed_after_the_grace() {
    let srv = TestServer::start_limited(Limits {
        reconnect_grace: Duration::from_millis(300),
        client_timeout: Duration::from_millis(700),
        ..Limits::default()
    });
    let total = free_now(&srv);
    let mut c = srv.session();
    c.alloc_ok(64 << 20);
    let t0 = Instant::now();
    // The client stops (its socket stays open, nothing more is sent).
    let mut c2 = srv.session();
    let freed = loop {
        // c2 keeps talking, so only the silent one is cut.
        if c2.mem_info().0 == total {
            break t0.elapsed();
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "a silent client's session is never freed");
        std::thread::sleep(Duration::from_millis(50));
    };
    eprintln!("silent client's session freed after {freed:?}");
    assert!(freed >= Duration::from_millis(900));
    c.cut();
    assert!(matches!(c2.ping().body, Body::None));
}

#[test]
fn a_client_waiting_on_a_long_request_hears_keepalives() {
    let srv = server(Duration::from_secs(10));
    let mut c = srv.session();
    assert_eq!(c.load_module(1, BUSY_PTX.as_bytes()).result, 0);
    let out = c.alloc_ok(4);
    let grid = [64, 1, 1];
    // How long this machine takes per count, to make a kernel of about 5 s.
    let t0 = Instant::now();
    assert_eq!(c.launch(true, 1, 0, grid, [256, 1, 1], 0, &params(out, 2000)).unwrap().result, 0);
    assert_eq!(c.sync().result, 0);
    let per = t0.elapsed().as_secs_f64() / 2000.0;
    let n = ((5.0 / per) as u32).clamp(2000, 50_000_000);
    c.t.stream().set_read_timeout(Some(Duration::from_millis(2500))).unwrap();
    c.launch(false, 1, 0, grid, [256, 1, 1], 0, &params(out, n));
    let t0 = Instant::now();
    // A device-to-host copy waits for the kernel before its first byte.
    let r = c.dtoh(out, 4);
    eprintln!("waited {:?} for the copy behind the kernel, {} keepalive(s)", t0.elapsed(), c.keepalives);
    assert_eq!(r.result, 0);
    assert_eq!(r.bulk, n.to_le_bytes());
    assert!(c.keepalives >= 1, "no keepalive during a {:?} wait", t0.elapsed());
}
