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
