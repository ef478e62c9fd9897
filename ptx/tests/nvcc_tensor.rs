//! Real nvcc 13 output for tensor cores and asynchronous copies (tests/data/nvcc13_tensor.cu
//! compiled with `nvcc -ptx -arch=sm_90`): the WMMA API, inline `ldmatrix` + `mma.sync`,
//! `__pipeline_memcpy_async` and `cuda::barrier` with `cuda::memcpy_async`, each against a
//! reference computed here.

use std::time::Duration;

use rgpu_ptx::{ExecError, HostMemory, LaunchConfig, LaunchOutput, Module, Program, float};

/// Every launch here runs on both tiers first and fails where they differ.
fn launch(p: &Program, c: &LaunchConfig, params: &[u8], mem: &HostMemory) -> Result<LaunchOutput, ExecError> {
    rgpu_ptx::testing::check_tiers(p, c, params, mem, &|p, c, params, mem| rgpu_ptx::launch(p, c, params, mem))
}

const PTX: &str = include_str!("data/nvcc13_tensor.ptx");
const BASE: u64 = 0x7f00_0000_0000;

fn cfg(grid: [u32; 2], block: u32) -> LaunchConfig {
    LaunchConfig { grid: [grid[0], grid[1], 1], block: [block, 1, 1], dyn_shared: 0, workers: 2, time_limit: Duration::from_secs(20), printf_limit: 0, compiled: true }
}

fn half(x: f64) -> u16 {
    float::f64_to_small(x, float::F16) as u16
}

fn bytes16(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn params(ptrs: &[u64], tail: &[u8]) -> Vec<u8> {
    let mut p: Vec<u8> = ptrs.iter().flat_map(|x| x.to_le_bytes()).collect();
    p.extend_from_slice(tail);
    p
}

fn val(i: usize) -> f64 {
    ((i * 37 + 11) % 17) as f64 / 8.0 - 1.0
}

#[test]
fn every_kernel_lowers() {
    let m = Module::parse(PTX).unwrap();
    for k in m.kernels() {
        m.lower(&k, &|_| None).unwrap_or_else(|e| panic!("{k}: {e}"));
    }
}

#[test]
fn the_wmma_api_multiplies_64x64x64_halves_into_floats() {
    let n = 64usize;
    let m = Module::parse(PTX).unwrap();
    let p = m.lower("wmma_gemm", &|_| None).unwrap();
    let mut mem = HostMemory::new(BASE, 1 << 20);
    let a: Vec<f64> = (0..n * n).map(val).collect();
    let b: Vec<f64> = (0..n * n).map(|i| val(i + 5)).collect();
    let (da, db, dc) = (mem.alloc((n * n * 2) as u64).unwrap(), mem.alloc((n * n * 2) as u64).unwrap(), mem.alloc((n * n * 4) as u64).unwrap());
    mem.write(da, &bytes16(&a.iter().map(|x| half(*x)).collect::<Vec<_>>()));
    // B column-major: element (k, j) at j * n + k.
    let mut bc = vec![0u16; n * n];
    for k in 0..n {
        for j in 0..n {
            bc[j * n + k] = half(b[k * n + j]);
        }
    }
    mem.write(db, &bytes16(&bc));
    launch(&p, &cfg([4, 4], 32), &params(&[da, db, dc], &(n as u32).to_le_bytes()), &mem).unwrap();
    let c = f32s(&mem.read(dc, n * n * 4).unwrap());
    for i in 0..n {
        for j in 0..n {
            // Every product is a multiple of 1/64 below 1 and the sums stay exact in f32.
            let want = 2.0 * (0..n).map(|k| a[i * n + k] * b[k * n + j]).sum::<f64>();
            assert_eq!(c[i * n + j] as f64, want, "C[{i}][{j}]");
        }
    }
}

#[test]
fn ldmatrix_feeds_mma_sync_as_cutlass_style_code_expects() {
    let m = Module::parse(PTX).unwrap();
    let p = m.lower("mma_ldmatrix", &|_| None).unwrap();
    let mut mem = HostMemory::new(BASE, 1 << 20);
    let a: Vec<f64> = (0..256).map(val).collect();
    let b: Vec<f64> = (0..128).map(|i| val(i + 3)).collect();
    let (da, db, dd) = (mem.alloc(512).unwrap(), mem.alloc(256).unwrap(), mem.alloc(512).unwrap());
    mem.write(da, &bytes16(&a.iter().map(|x| half(*x)).collect::<Vec<_>>()));
    mem.write(db, &bytes16(&b.iter().map(|x| half(*x)).collect::<Vec<_>>()));
    launch(&p, &cfg([1, 1], 32), &params(&[da, db, dd], &[]), &mem).unwrap();
    let d = f32s(&mem.read(dd, 512).unwrap());
    for i in 0..16 {
        for j in 0..8 {
            let want = (0..16).map(|k| a[i * 16 + k] * b[k * 8 + j]).sum::<f64>();
            assert_eq!(d[i * 8 + j] as f64, want, "D[{i}][{j}]");
        }
    }
}

#[test]
fn pipeline_memcpy_async_stages_through_shared_memory() {
    let m = Module::parse(PTX).unwrap();
    let p = m.lower("pipeline_reverse", &|_| None).unwrap();
    let mut mem = HostMemory::new(BASE, 1 << 20);
    let (blocks, threads) = (3usize, 256usize);
    let words: Vec<u32> = (0..blocks * threads * 4).map(|i| i as u32 * 7 + 1).collect();
    let (din, dout) = (mem.alloc((words.len() * 4) as u64).unwrap(), mem.alloc((words.len() * 4) as u64).unwrap());
    mem.write(din, &words.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>());
    launch(&p, &cfg([blocks as u32, 1], threads as u32), &params(&[din, dout], &[]), &mem).unwrap();
    let out = mem.read(dout, words.len() * 4).unwrap();
    let out: Vec<u32> = out.chunks(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    for blk in 0..blocks {
        for t in 0..threads {
            let from = blk * threads + threads - 1 - t;
            assert_eq!(&out[(blk * threads + t) * 4..][..4], &words[from * 4..][..4], "block {blk} thread {t}");
        }
    }
}

#[test]
fn cuda_barrier_completes_memcpy_async_and_its_later_phases() {
    let m = Module::parse(PTX).unwrap();
    let p = m.lower("barrier_copy", &|_| None).unwrap();
    for threads in [256usize, 96, 32] {
        let mut mem = HostMemory::new(BASE, 1 << 20);
        let input: Vec<u32> = (0..threads).map(|i| i as u32 * 3 + 2).collect();
        let (din, dout) = (mem.alloc((threads * 4) as u64).unwrap(), mem.alloc((threads * 4) as u64).unwrap());
        mem.write(din, &input.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>());
        launch(&p, &cfg([1, 1], threads as u32), &params(&[din, dout], &[]), &mem).unwrap_or_else(|e| panic!("{threads} threads: {e}"));
        let out = mem.read(dout, threads * 4).unwrap();
        for t in 0..threads {
            let got = u32::from_le_bytes(out[t * 4..t * 4 + 4].try_into().unwrap());
            // out[t] = s[n-1-t] = in[(n-1-t+32) % n] + 1.
            let want = input[(threads - 1 - t + 32) % threads] + 1;
            assert_eq!(got, want, "{threads} threads: out[{t}]");
        }
    }
}
