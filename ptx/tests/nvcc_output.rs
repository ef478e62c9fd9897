//! Real nvcc 13 output (tests/data/nvcc13_sample.cu compiled with
//! `nvcc -ptx -arch=sm_90`): every kernel lowers, and they compute what
//! the source says.

use std::time::Duration;

use rgpu_ptx::{ExecError, HostMemory, LaunchConfig, LaunchOutput, Module, Program};

/// Every launch here runs on both tiers first and fails where they differ.
fn launch(p: &Program, c: &LaunchConfig, params: &[u8], mem: &HostMemory) -> Result<LaunchOutput, ExecError> {
    rgpu_ptx::testing::check_tiers(p, c, params, mem, &|p, c, params, mem| rgpu_ptx::launch(p, c, params, mem))
}

const PTX: &str = include_str!("data/nvcc13_sample.ptx");
const BASE: u64 = 0x7f00_0000_0000;

fn cfg(grid: u32, block: u32, dyn_shared: u32) -> LaunchConfig {
    LaunchConfig { grid: [grid, 1, 1], block: [block, 1, 1], dyn_shared, workers: 2, time_limit: Duration::from_secs(20), printf_limit: 1 << 20, compiled: true }
}

struct Setup {
    mem: HostMemory,
    globals: Vec<(String, u64)>,
}

fn setup() -> Setup {
    let mut mem = HostMemory::new(BASE, 1 << 22);
    let mut globals = Vec::new();
    for (name, size) in [("coef", 16), ("counter", 4), ("$str", 16), ("$str$1", 2)] {
        globals.push((name.to_string(), mem.alloc(size).unwrap()));
    }
    let g = |n: &str| globals.iter().find(|x| x.0 == n).unwrap().1;
    mem.write(g("$str"), b"hello %d %f %s\n\0");
    mem.write(g("$str$1"), b"x\0");
    mem.write(g("coef"), &2.0f32.to_le_bytes());
    Setup { mem, globals }
}

#[test]
fn all_kernels_lower() {
    let m = Module::parse(PTX).unwrap();
    let s = setup();
    let names = m.kernels();
    assert_eq!(names.len(), 3);
    for k in names {
        m.lower(&k, &|n| s.globals.iter().find(|g| g.0 == n).map(|g| g.1)).unwrap_or_else(|e| panic!("{k}: {e}"));
    }
}

#[test]
fn vadd_reduce_and_misc_compute_the_right_values() {
    let m = Module::parse(PTX).unwrap();
    let mut s = setup();
    let look = |s: &Setup| {
        let g = s.globals.clone();
        move |n: &str| g.iter().find(|x| x.0 == n).map(|x| x.1)
    };
    let n = 1000u32;
    let a = s.mem.alloc(n as u64 * 4).unwrap();
    let b = s.mem.alloc(n as u64 * 4).unwrap();
    let c = s.mem.alloc(n as u64 * 4).unwrap();
    let av: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let bv: Vec<f32> = (0..n).map(|i| (i * 3) as f32 * 0.5).collect();
    s.mem.write(a, &av.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>());
    s.mem.write(b, &bv.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>());
    let vadd = m.lower("_Z4vaddPKfS0_Pfi", &look(&s)).unwrap();
    let mut p = Vec::new();
    for x in [a, b, c] {
        p.extend_from_slice(&x.to_le_bytes());
    }
    p.extend_from_slice(&n.to_le_bytes());
    p.extend_from_slice(&[0; 4]);
    launch(&vadd, &cfg(n.div_ceil(256), 256, 0), &p[..28], &s.mem).unwrap();
    let out = s.mem.read(c, n as usize * 4).unwrap();
    for i in 0..n as usize {
        let v = f32::from_le_bytes(out[i * 4..i * 4 + 4].try_into().unwrap());
        assert_eq!(v, av[i] + bv[i] * 2.0);
    }

    // Warp-shuffle reduction with a shared-memory stage and one atomic per block.
    let red = m.lower("_Z3redPKiPii", &look(&s)).unwrap();
    let ints = s.mem.alloc(n as u64 * 4).unwrap();
    let sum = s.mem.alloc(4).unwrap();
    s.mem.write(ints, &(0..n).flat_map(|i| i.to_le_bytes()).collect::<Vec<_>>());
    let mut p = Vec::new();
    p.extend_from_slice(&ints.to_le_bytes());
    p.extend_from_slice(&sum.to_le_bytes());
    p.extend_from_slice(&n.to_le_bytes());
    launch(&red, &cfg(n.div_ceil(128), 128, 0), &p, &s.mem).unwrap();
    let got = u32::from_le_bytes(s.mem.read(sum, 4).unwrap().try_into().unwrap());
    assert_eq!(got, n * (n - 1) / 2);

    // Dynamic shared memory, ballot, bit ops, libdevice sin/tanh/exp, f64, printf.
    let misc = m.lower("_Z4miscPdPjPf", &look(&s)).unwrap();
    let t = 64u32;
    let d = s.mem.alloc(t as u64 * 8).unwrap();
    let u = s.mem.alloc(t as u64 * 4).unwrap();
    let f = s.mem.alloc(t as u64 * 4).unwrap();
    let fv: Vec<f32> = (0..t).map(|i| i as f32 * 0.25 - 4.0).collect();
    s.mem.write(f, &fv.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>());
    let mut p = Vec::new();
    for x in [d, u, f] {
        p.extend_from_slice(&x.to_le_bytes());
    }
    let out = launch(&misc, &cfg(1, t, t * 4), &p, &s.mem).unwrap();
    assert_eq!(String::from_utf8(out.printf).unwrap(), "hello 0 1.500000 x\n");
    let fo = s.mem.read(f, t as usize * 4).unwrap();
    let dout = s.mem.read(d, t as usize * 8).unwrap();
    let uo = s.mem.read(u, t as usize * 4).unwrap();
    for i in 0..t as usize {
        let x = fv[i];
        let next = fv[(i + 1) % t as usize];
        let expect = next.sqrt() + x.exp() + x.sin() + x.tanh() + x * x;
        let got = f32::from_le_bytes(fo[i * 4..i * 4 + 4].try_into().unwrap());
        if expect.is_nan() {
            assert!(got.is_nan(), "thread {i}: {got}");
        } else {
            assert!((got - expect).abs() <= 1e-4 * expect.abs().max(1.0), "thread {i}: {got} vs {expect}");
        }
        let ti = i as f64;
        let dv = f64::from_le_bytes(dout[i * 8..i * 8 + 8].try_into().unwrap());
        assert_eq!(dv, ti.sqrt() / 3.0 + ti * ti);
        let ui = i as u32;
        let uv = u32::from_le_bytes(uo[i * 4..i * 4 + 4].try_into().unwrap());
        // Thread 0's slot was later hit by atomicCAS(u, 0, 1).
        if i != 0 {
            assert_eq!(uv, 0xaaaa_aaaa_u32.wrapping_add(ui.count_ones()).wrapping_add(ui.leading_zeros()).wrapping_add(ui.reverse_bits()));
        }
    }
    let counter = s.globals.iter().find(|g| g.0 == "counter").unwrap().1;
    assert_eq!(u32::from_le_bytes(s.mem.read(counter, 4).unwrap().try_into().unwrap()), t - 1);
}
