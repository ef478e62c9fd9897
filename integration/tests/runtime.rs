//! Runtime-API programs (integration/cuda/rt_*.cu), each in three builds:
//! `-cudart shared` with cudart 13, static cudart 13, `-cudart shared` with
//! cudart 12. Each test starts its own server (one simulated device of
//! 4 GiB) and runs the program through `rgpu run`.

use rgpu_integration::*;

/// One module per program, one test per build variant.
macro_rules! runtime_tests {
    ($($name:ident => $check:expr;)*) => {$(
        mod $name {
            use super::*;
            const PROGRAM: &str = concat!("rt_", stringify!($name));
            #[test]
            fn cudart13_shared() {
                ($check)(PROGRAM, Variant::Cudart13Shared)
            }
            #[test]
            fn cudart13_static() {
                ($check)(PROGRAM, Variant::Cudart13Static)
            }
            #[test]
            fn cudart12_shared() {
                ($check)(PROGRAM, Variant::Cudart12Shared)
            }
        }
    )*};
}

/// rt_newer_ptx on a 12.0 sim (its PTX runs) and on the default 9.0 one (refused, twice).
fn newer_ptx(program: &str, variant: Variant) {
    let exe = build(program, variant);
    for (cc, arg) in [("12.0", "--expect-runs"), ("9.0", "--expect-refused")] {
        let server = Server::start(ServerOpts { compute_capability: Some(cc), ..ServerOpts::default() });
        run_on(&[&server], &exe, &[arg]).assert_pass(program, &[&server]);
    }
}

fn plain(program: &str, variant: Variant) {
    run_program(program, variant, &[]);
}

/// rt_device, run twice against one server: properties are as configured,
/// the runtime is the one the variant links, and the UUIDs do not change.
fn device(program: &str, variant: Variant) {
    let exe = build(program, variant);
    let server = Server::start_default();
    let mem = DEFAULT_SIM_MEMORY.to_string();
    let args = ["--expect-devices", "1", "--expect-mem", mem.as_str()];
    let first = run_on(&[&server], &exe, &args);
    first.assert_pass(program, &[&server]);
    let second = run_on(&[&server], &exe, &args);
    second.assert_pass(program, &[&server]);

    let major = variant.runtime_major().unwrap();
    let rt_line = first
        .ok_lines()
        .into_iter()
        .find(|l| l.contains("runtime version"))
        .unwrap_or_else(|| panic!("no runtime version line\n{}", first.describe(&[&server])))
        .to_string();
    let version: u32 = rt_line.rsplit(' ').next().unwrap().parse().unwrap();
    assert_eq!(version / 1000, major, "{variant:?} runs cudart {version}, expected {major}.x: {rt_line}");

    let uuids = |o: &RunOutput| -> Vec<String> {
        o.stdout.lines().filter(|l| l.starts_with("uuid ")).map(str::to_string).collect()
    };
    let (u1, u2) = (uuids(&first), uuids(&second));
    assert_eq!(u1.len(), 1, "expected one uuid line\n{}", first.describe(&[&server]));
    assert_eq!(u1, u2, "device UUID changed between two runs against the same server");
}

fn launch(program: &str, variant: Variant) {
    run_program(program, variant, &launch_args());
}

/// rt_kernels, plus its kernel printf: both blocks' two lines, in the
/// client's stdout, before the check that synchronised after the launch.
fn kernels(program: &str, variant: Variant) {
    let out = run_program(program, variant, &[]);
    let lines: Vec<&str> = out.stdout.lines().collect();
    let sync_ok = lines.iter().position(|l| l.contains("kernel printf flushed")).expect("printf check line");
    let hello: Vec<usize> = lines.iter().enumerate().filter(|(_, l)| l.starts_with("hello from thread")).map(|(i, _)| i).collect();
    assert_eq!(hello.len(), 4, "expected 4 kernel printf lines:\n{}", out.stdout);
    assert!(hello.iter().all(|&i| i < sync_ok), "kernel output after the sync's ok line:\n{}", out.stdout);
    for b in 0..2 {
        for t in 0..2 {
            let want = format!("hello from thread {t} of block {b}, tag 42, pi 3.142");
            assert!(lines.contains(&want.as_str()), "missing `{want}`:\n{}", out.stdout);
        }
    }
}

runtime_tests! {
    device => device;
    memory => plain;
    copy => plain;
    memset => plain;
    stream => plain;
    event => plain;
    pinned => plain;
    pageable => plain;
    newer_ptx => newer_ptx;
    host_func => plain;
    mempool => plain;
    managed => plain;
    graph => plain;
    launch_ex => plain;
    globals => plain;
    funcattr => plain;
    launch => launch;
    kernels => kernels;
    errors => plain;
    backpressure => plain;
    async_device => plain;
    tensor_core => plain;
    async_copy => plain;
    cooperative => plain;
    ipc => plain;
    pitched => plain;
    graph_nodes => plain;
    per_thread => plain;
    managed_vars => plain;
    managed_attach => plain;
}
