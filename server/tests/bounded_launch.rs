//! Launches a raw client sends, past the device's limits or past the
//! kernel time limit: a CUDA error, never an abort, an allocation the size
//! of the request, or a launch that runs on.

mod common;

use std::time::{Duration, Instant};

use common::kernels::{params, BUSY_PTX};
use common::TestServer;

const INVALID_VALUE: u32 = 1;
const LAUNCH_OUT_OF_RESOURCES: u32 = 701;
const LAUNCH_TIMEOUT: u32 = 702;

#[test]
fn launches_past_the_device_limits_are_cuda_errors() {
    let srv = TestServer::start();
    let mut c = srv.session();
    assert_eq!(c.load_module(1, BUSY_PTX.as_bytes()).result, 0);
    let out = c.alloc_ok(4);
    let p = params(out, 1);
    let mut call = |grid: [u32; 3], block: [u32; 3], shared: u32, function: u32| {
        c.launch(true, 1, function, grid, block, shared, &p).expect("reply").result
    };
    // What a driver refuses with CUDA_ERROR_INVALID_VALUE.
    for (grid, block, shared) in [
        ([1, 1, 1], [1024, 1024, 64], 0),
        ([1, 1, 1], [2048, 1, 1], 0),
        ([1, 1, 1], [1, 2048, 1], 0),
        ([1, 1, 1], [1, 1, 128], 0),
        ([1, 1, 1], [64, 32, 1], 0),
        ([1, 65536, 1], [32, 1, 1], 0),
        ([1, 1, 65536], [32, 1, 1], 0),
        ([u32::MAX, 1, 1], [32, 1, 1], 0),
        ([1, 1, 1], [32, 1, 1], u32::MAX),
        ([1, 1, 1], [32, 1, 1], 227 * 1024 + 1),
    ] {
        let t = Instant::now();
        assert_eq!(call(grid, block, shared, 0), INVALID_VALUE, "grid {grid:?} block {block:?} shared {shared}");
        assert!(t.elapsed() < Duration::from_secs(1), "refused at once");
    }
    // More threads than the kernel's .maxntid: what a driver says for a block the kernel cannot run.
    assert_eq!(call([1, 1, 1], [256, 1, 1], 0, 1), LAUNCH_OUT_OF_RESOURCES);
    // At the limits, the launches run.
    assert_eq!(call([1, 1, 1], [1024, 1, 1], 0, 0), 0);
    assert_eq!(call([1, 1, 1], [16, 1, 64], 227 * 1024, 0), 0);
    assert_eq!(call([2, 1, 1], [128, 1, 1], 0, 1), 0);
    assert_eq!(c.dtoh(out, 4).bulk, 1u32.to_le_bytes());
    assert_eq!(c.ping().result, 0, "the session goes on");
    assert_eq!(srv.session().ping().result, 0, "and the server");
}

/// A grid of 10M short blocks under a 2 s limit: the limit was checked only
/// inside long warps, so the grid ran 5.7-12.8 s and succeeded.
#[test]
fn a_huge_grid_ends_at_the_time_limit_and_the_error_sticks() {
    let limit = Duration::from_secs(2);
    let srv = TestServer::start_with_kernel_limit(limit);
    let mut c = srv.session();
    assert_eq!(c.load_module(1, BUSY_PTX.as_bytes()).result, 0);
    let out = c.alloc_ok(4);
    let spare = c.alloc_ok(4);
    let t = Instant::now();
    c.launch(false, 1, 0, [10_000_000, 1, 1], [32, 1, 1], 0, &params(out, 1));
    let r = c.sync();
    let took = t.elapsed();
    eprintln!("10M-block grid under a {limit:?} limit: {} after {took:?}", r.result.max(r.deferred));
    assert_eq!(r.deferred, LAUNCH_TIMEOUT, "the launch's error, at the next synchronising call");
    assert!(took <= Duration::from_millis(2500), "ended after {took:?}");
    // Sticky, as a GPU's context after a watchdog timeout: every later call
    // fails with it; releasing objects still works.
    assert_eq!(c.sync().result, LAUNCH_TIMEOUT);
    assert_eq!(c.alloc(4).result, LAUNCH_TIMEOUT);
    assert_eq!(c.dtoh(out, 4).result, LAUNCH_TIMEOUT);
    assert_eq!(c.htod(out, &[1, 2, 3, 4]).result, LAUNCH_TIMEOUT, "its bulk is skipped, the stream stays in sync");
    assert_eq!(c.launch(true, 1, 0, [1, 1, 1], [1, 1, 1], 0, &params(out, 1)).expect("reply").result, LAUNCH_TIMEOUT);
    assert_eq!(c.free(spare).result, 0);
    assert_eq!(c.ping().result, LAUNCH_TIMEOUT);
    // Other sessions are untouched.
    let mut other = srv.session();
    assert_eq!(other.ping().result, 0);
    assert_eq!(other.alloc(4).result, 0);
}

const NOT_READY: u32 = 600;

fn stream_create(c: &mut common::DataClient, handle: u64, flags: u32) {
    let r = c.call(&[], |r| {
        let mut s = r.init_stream_create();
        s.set_handle(handle);
        s.set_device(0);
        s.set_flags(flags);
    });
    assert_eq!(r.result, 0, "streamCreate");
}

/// The asyncAPI pattern: launch, record an event behind the kernel, poll
/// it. The sim ran the kernel on the session thread, so the first query
/// came after the work and the host counted 0 iterations; two streams'
/// kernels ran one after the other.
#[test]
fn queries_answer_at_once_and_streams_overlap() {
    let srv = TestServer::start();
    let mut c = srv.session();
    assert_eq!(c.load_module(1, BUSY_PTX.as_bytes()).result, 0);
    let out = c.alloc_ok(4);
    let ev = 77;
    assert_eq!(c.call(&[], |r| {
        let mut e = r.init_event_create();
        e.set_handle(ev);
        e.set_device(0);
        e.set_flags(0);
    }).result, 0);
    // One block: the kernel runs on one host thread, ~0.3-1 s here.
    let p = params(out, 400_000);
    let t = Instant::now();
    c.launch(false, 1, 0, [1, 1, 1], [256, 1, 1], 0, &p);
    let rec = |c: &mut common::DataClient, stream: u64| {
        c.call(&[], |r| {
            let mut e = r.init_event_record();
            e.set_event(ev);
            e.set_stream(stream);
        })
        .result
    };
    assert_eq!(rec(&mut c, 0), 0);
    let mut polls = 0u64;
    loop {
        let r = c.call(&[], |r| r.init_event_query().set_handle(ev));
        if r.result == 0 {
            break;
        }
        assert_eq!(r.result, NOT_READY);
        polls += 1;
        assert!(t.elapsed() < Duration::from_secs(60));
    }
    let single = t.elapsed();
    eprintln!("asyncAPI pattern: {polls} host iterations while the kernel ran ({single:?})");
    assert!(polls > 0, "the host got no iteration in while the kernel ran");
    assert_eq!(c.dtoh(out, 4).bulk, 400_000u32.to_le_bytes());

    // Two non-blocking streams: each kernel waits to see the other's flag,
    // which only kernels running at the same time can.
    for s in [1, 2] {
        stream_create(&mut c, s, 1);
    }
    let flags = c.alloc_ok(8);
    for (s, mine, theirs) in [(1u64, flags, flags + 4), (2, flags + 4, flags)] {
        let mut p = mine.to_le_bytes().to_vec();
        p.extend_from_slice(&theirs.to_le_bytes());
        p.extend_from_slice(&20_000_000u32.to_le_bytes());
        let r = c.call(&p, |r| {
            let mut l = r.init_launch_kernel();
            l.set_module(1);
            l.set_function(2);
            l.set_grid_x(1);
            l.set_grid_y(1);
            l.set_grid_z(1);
            l.set_block_x(1);
            l.set_block_y(1);
            l.set_block_z(1);
            l.set_stream(s);
        });
        assert_eq!(r.result, 0);
    }
    let r = c.sync();
    assert_eq!((r.result, r.deferred), (0, 0));
    let got = c.dtoh(flags, 8).bulk;
    assert_eq!(got, [2, 0, 0, 0, 2, 0, 0, 0], "both kernels saw the other's flag: they ran together");
}
