//! A launch ends when its time limit passes or its caller cancels it,
//! whatever the kernel does: many short blocks, a block that loops over
//! barriers, a warp that never stops.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use rgpu_ptx::{launch, launch_cancellable, ExecError, Fault, HostMemory, LaunchConfig, Module, Program};

const PTX: &str = ".version 8.0\n.target sm_90\n.address_size 64\n\
.visible .entry short(.param .u32 n)\n{\n\t.reg .b32 %r<4>;\n\tld.param.u32 %r1, [n];\n\tmov.u32 %r2, %tid.x;\n\tadd.u32 %r3, %r1, %r2;\n\tret;\n}\n\
.visible .entry barrier_loop(.param .u32 n)\n{\n$L__loop:\n\tbar.sync 0;\n\tbra.uni $L__loop;\n}\n\
.visible .entry spin(.param .u32 n)\n{\n\t.reg .b32 %r<2>;\n\tmov.u32 %r1, 0;\n$L__spin:\n\tadd.u32 %r1, %r1, 1;\n\tbra.uni $L__spin;\n}\n";

fn program(name: &str) -> Arc<Program> {
    let m = Module::parse(PTX).expect("parse");
    Arc::new(m.lower(name, &|_| None).expect("lower"))
}

fn cfg(grid: u32, block: u32, limit: Duration, workers: usize) -> LaunchConfig {
    LaunchConfig { grid: [grid, 1, 1], block: [block, 1, 1], dyn_shared: 0, workers, time_limit: limit, printf_limit: 1 << 20, compiled: true }
}

/// Runs the launch on its own thread so that a launch that never ends fails
/// the test after `wait` instead of hanging it.
fn run_bounded(
    prog: Arc<Program>,
    c: LaunchConfig,
    cancel: Arc<AtomicBool>,
    wait: Duration,
) -> (Result<(), ExecError>, Duration) {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mem = HostMemory::new(0x7f00_0000_0000, 4096);
        let t = Instant::now();
        let r = launch_cancellable(&prog, &c, &[0u8; 4], &mem, &cancel).map(|_| ());
        let _ = tx.send((r, t.elapsed()));
    });
    rx.recv_timeout(wait).unwrap_or_else(|_| panic!("the launch was still running after {wait:?}"))
}

#[test]
fn many_short_blocks_stop_at_the_time_limit() {
    // Each block is a few instructions, far below the in-warp check interval:
    // only a check between blocks sees the limit pass.
    let limit = Duration::from_millis(300);
    let (r, took) = run_bounded(program("short"), cfg(50_000_000, 32, limit, 2), Arc::new(AtomicBool::new(false)), Duration::from_secs(20));
    let e = r.expect_err("a 50M-block grid cannot finish in 300 ms");
    assert_eq!(e.fault, Fault::Timeout);
    assert!(took < limit + Duration::from_millis(300), "took {took:?} under a {limit:?} limit");
}

#[test]
fn a_block_looping_over_barriers_stops_at_the_time_limit() {
    let limit = Duration::from_millis(200);
    let (r, took) = run_bounded(program("barrier_loop"), cfg(1, 64, limit, 1), Arc::new(AtomicBool::new(false)), Duration::from_secs(10));
    assert_eq!(r.expect_err("never ends by itself").fault, Fault::Timeout);
    assert!(took < limit + Duration::from_millis(300), "took {took:?} under a {limit:?} limit");
}

#[test]
fn cancel_stops_a_running_launch() {
    for name in ["spin", "barrier_loop", "short"] {
        let cancel = Arc::new(AtomicBool::new(false));
        let grid = if name == "short" { 50_000_000 } else { 4 };
        let c = cfg(grid, 64, Duration::from_secs(60), 2);
        let flag = cancel.clone();
        let raiser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            flag.store(true, Ordering::Relaxed);
            Instant::now()
        });
        let (r, _) = run_bounded(program(name), c, cancel, Duration::from_secs(10));
        let stopped = Instant::now();
        let raised = raiser.join().expect("raiser");
        assert_eq!(r.expect_err("cancelled").fault, Fault::Cancelled, "{name}");
        // From the moment the flag was raised (a loaded host may wake the
        // raiser late), to the moment the launch's result arrived.
        let after = stopped.saturating_duration_since(raised);
        assert!(after < Duration::from_millis(250), "{name}: stopped {after:?} after the cancel");
    }
}

#[test]
fn an_uncancelled_launch_runs_to_the_end() {
    let mem = HostMemory::new(0x7f00_0000_0000, 4096);
    let out = launch(&program("short"), &cfg(1000, 64, Duration::from_secs(10), 2), &[0u8; 4], &mem).expect("runs");
    assert_eq!(out.thread_instructions, 1000 * 64 * 4);
}
