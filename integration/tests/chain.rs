//! The cuda backend without a GPU: client -> server A (`--backend cuda`,
//! whose libcuda.so.1 is rgpu's shim) -> server B (`--backend sim`).
//! Every driver call the cuda backend makes goes through the shim to the
//! sim, so the programs exercise the cuda backend end to end.
//!
//! One build per program (cudart 13, shared) keeps the suite short; the
//! other variants differ only on the client side, which the direct tests
//! cover.
//!
//! Launches: server A behaves as a real GPU does and B's sim runs the
//! kernels' PTX, so the launch programs run with `--expect-supported` and
//! must pass. Only with `RGPU_EXPECT_LAUNCH=0` (a sim built without kernel
//! execution) does [`chain_launch`] also accept the one failure such a
//! chain gives: 801 at the synchronisation after the launch.

use rgpu_integration::*;

/// Starts B then A, runs `program` against A and asserts it passes.
fn chain(program: &str, variant: Variant, args: &[&str]) -> RunOutput {
    chain_with(program, variant, args, &[])
}

/// As [`chain`], with `flags` for server A.
fn chain_with(program: &str, variant: Variant, args: &[&str], flags: &[String]) -> RunOutput {
    let exe = build(program, variant);
    let b = Server::start_default();
    let a = Server::start_chain_with(&b, flags);
    assert!(
        a.log().contains("backend cuda"),
        "server A did not start the cuda backend\n{}{}",
        a.describe(),
        b.describe()
    );
    let out = run_on(&[&a], &exe, args);
    out.assert_pass(program, &[&a, &b]);
    // Whatever a program frees is zeroed on the device before it can be
    // anyone else's. A device assert (rt_errors) or a fault (drv_vmm's
    // last kernel, on memory it was given no access to) breaks the
    // context, which then zeroes nothing: said once, and allocations are
    // zeroed instead.
    if !["rt_errors", "drv_vmm"].contains(&program) {
        assert!(!a.log().contains("cannot zero"), "server A could not zero freed memory\n{}{}", a.describe(), b.describe());
    }
    out
}

macro_rules! chain_tests {
    ($($name:ident => $args:expr;)*) => {$(
        #[test]
        fn $name() {
            chain(concat!("rt_", stringify!($name)), Variant::Cudart13Shared, &$args);
        }
    )*};
}

chain_tests! {
    memory => [];
    copy => [];
    memset => [];
    stream => [];
    event => [];
    pinned => [];
    globals => [];
    funcattr => [];
    errors => [];
    managed => [];
    graph => [];
}

/// The same programs with A's client memory placed through the virtual
/// memory API (`--cuda-movable-memory`, what lets its sessions move): every
/// allocation, copy, free, the device's free memory after everything is
/// freed, and the recovery from a device assert (whose releases come back
/// with the assert's error) must behave as with cuMemAlloc.
macro_rules! movable_tests {
    ($($name:ident => $program:expr, $variant:expr;)*) => {$(
        #[test]
        fn $name() {
            chain_with($program, $variant, &[], &["--cuda-movable-memory".to_string()]);
        }
    )*};
}

movable_tests! {
    movable_memory => "rt_memory", Variant::Cudart13Shared;
    movable_copy => "rt_copy", Variant::Cudart13Shared;
    movable_memset => "rt_memset", Variant::Cudart13Shared;
    movable_stream => "rt_stream", Variant::Cudart13Shared;
    movable_event => "rt_event", Variant::Cudart13Shared;
    movable_pinned => "rt_pinned", Variant::Cudart13Shared;
    movable_globals => "rt_globals", Variant::Cudart13Shared;
    movable_managed => "rt_managed", Variant::Cudart13Shared;
    movable_errors => "rt_errors", Variant::Cudart13Shared;
    movable_graph => "rt_graph", Variant::Cudart13Shared;
    movable_mempool => "rt_mempool", Variant::Cudart13Shared;
    movable_drv_api => "drv_api", Variant::Driver;
    movable_drv_vmm => "drv_vmm", Variant::Driver;
    movable_drv_graph => "drv_graph", Variant::Driver;
}

/// Kernels reading and writing movable memory (see [`movable_tests`]).
#[test]
fn movable_launch() {
    chain_launch_with("rt_launch", Variant::Cudart13Shared, &["--cuda-movable-memory".to_string()]);
}

/// Runs a launch program with `--expect-supported`: it must pass (or, with
/// `RGPU_EXPECT_LAUNCH=0`, fail only with 801 at the synchronisation after
/// the launch, once everything before the launch passed).
fn chain_launch(program: &str, variant: Variant) {
    chain_launch_with(program, variant, &[]);
}

/// As [`chain_launch`], with `flags` for server A.
fn chain_launch_with(program: &str, variant: Variant, flags: &[String]) {
    let exe = build(program, variant);
    let b = Server::start_default();
    let a = Server::start_chain_with(&b, flags);
    let out = run_on(&[&a], &exe, &["--expect-supported"]);
    if out.code() == Some(0) || launch_args().contains(&"--expect-supported") {
        out.assert_pass(program, &[&a, &b]);
        return;
    }
    let fails: Vec<&str> = out.stderr.lines().filter(|l| l.starts_with("FAIL ")).collect();
    let unsupported = fails.len() == 1 && fails[0].contains("ynchronize() returned 801");
    assert!(
        !out.timed_out && unsupported,
        "{program}: expected a pass, or 801 at the synchronisation after the launch\n{}",
        out.describe(&[&a, &b])
    );
}

#[test]
fn launch() {
    chain_launch("rt_launch", Variant::Cudart13Shared);
}

/// Device properties through the chain are B's, as A's driver (the shim)
/// reports them: count, memory, and a UUID that stays the same.
#[test]
fn device() {
    let mem = DEFAULT_SIM_MEMORY.to_string();
    let args = ["--expect-devices", "1", "--expect-mem", mem.as_str()];
    let exe = build("rt_device", Variant::Cudart13Shared);
    let b = Server::start_default();
    let a = Server::start_chain(&b);
    let first = run_on(&[&a], &exe, &args);
    first.assert_pass("rt_device", &[&a, &b]);
    let second = run_on(&[&a], &exe, &args);
    second.assert_pass("rt_device", &[&a, &b]);
    let uuids = |o: &RunOutput| -> Vec<String> {
        o.stdout.lines().filter(|l| l.starts_with("uuid ")).map(str::to_string).collect()
    };
    assert_eq!(uuids(&first).len(), 1, "{}", first.describe(&[&a, &b]));
    assert_eq!(uuids(&first), uuids(&second));
}

#[test]
fn cudart12_memory() {
    chain("rt_memory", Variant::Cudart12Shared, &[]);
}

#[test]
fn drv_api() {
    chain("drv_api", Variant::Driver, &[]);
}

/// Virtual memory management through the cuda backend's forwarding to the driver (here the
/// shim, over B's sim).
#[test]
fn drv_vmm() {
    chain("drv_vmm", Variant::Driver, &[]);
}

/// A graph built by hand, replayed through the cuda backend.
#[test]
fn drv_graph() {
    chain("drv_graph", Variant::Driver, &[]);
}

/// Module loading, globals, attributes, then a launch (see [`chain_launch`]).
#[test]
fn drv_module() {
    chain_launch("drv_module", Variant::Driver);
}

/// Two devices on B: A exports both, one context per device per session.
#[test]
fn two_devices() {
    let exe = build("rt_two_devices", Variant::Cudart13Shared);
    let b = Server::start(ServerOpts { devices: 2, memory: 2 << 30, ..ServerOpts::default() });
    let a = Server::start_chain(&b);
    run_on(&[&a], &exe, &[]).assert_pass("rt_two_devices", &[&a, &b]);
}

/// One server A, several sessions: a second run finds the module in A's
/// library cache but gets fresh, initialised globals (its own context);
/// two runs at once do not see each other's globals or memory.
#[test]
fn sessions_are_isolated() {
    let exe = build("rt_globals", Variant::Cudart13Shared);
    let b = Server::start_default();
    let a = Server::start_chain(&b);
    run_on(&[&a], &exe, &[]).assert_pass("rt_globals", &[&a, &b]);
    run_on(&[&a], &exe, &[]).assert_pass("rt_globals", &[&a, &b]);
    let addr = a.addr_string();
    let runs: Vec<Running> = (0..2).map(|_| spawn_rgpu(&addr, &exe, &[])).collect();
    for r in runs {
        r.wait(run_timeout()).assert_pass("rt_globals", &[&a, &b]);
    }
}
