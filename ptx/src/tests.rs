//! Instruction-family tests: small kernels run on [`HostMemory`] and
//! compared with results computed here.

use super::*;
use std::time::Duration;

mod cooperative;
mod matrix;

const BASE: u64 = 0x7f00_0000_0000;

fn cfg(grid: u32, block: u32) -> LaunchConfig {
    LaunchConfig { grid: [grid, 1, 1], block: [block, 1, 1], dyn_shared: 0, workers: 2, time_limit: Duration::from_secs(10), printf_limit: 1 << 20, compiled: true }
}

/// Every launch of these tests runs on both tiers first and fails where they differ.
fn launch(p: &Program, c: &LaunchConfig, params: &[u8], mem: &HostMemory) -> Result<LaunchOutput, ExecError> {
    crate::testing::check_tiers(p, c, params, mem, &|p, c, params, mem| crate::launch(p, c, params, mem))
}

/// Wraps `body` in a kernel taking one pointer (`%rd1`, already converted
/// to a global address) and with `%r<64>`, `%rd<64>`, `%f<64>`, `%fd<64>`,
/// `%p<16>`, `%rs<16>` declared; `%r0` is the global thread index.
fn kernel(body: &str) -> String {
    format!(
        ".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry k(.param .u64 k_param_0)\n{{\n\
         .reg .pred %p<16>;\n.reg .b16 %rs<16>;\n.reg .b32 %r<64>;\n.reg .b64 %rd<64>;\n.reg .f32 %f<64>;\n.reg .f64 %fd<64>;\n\
         ld.param.u64 %rd1, [k_param_0];\ncvta.to.global.u64 %rd1, %rd1;\n\
         mov.u32 %r60, %ctaid.x;\nmov.u32 %r61, %ntid.x;\nmov.u32 %r62, %tid.x;\nmad.lo.s32 %r0, %r60, %r61, %r62;\n\
         {body}\nret;\n}}\n"
    )
}

/// Runs kernel text `src` over a buffer of `words` u32 initialised by
/// `init`, returns the buffer.
fn run_words(src: &str, c: LaunchConfig, init: &[u32]) -> Result<Vec<u32>, ExecError> {
    let m = Module::parse(src).unwrap_or_else(|e| panic!("{e}\n{src}"));
    let p = m.lower("k", &|_| None).unwrap_or_else(|e| panic!("{e}\n{src}"));
    let mut mem = HostMemory::new(BASE, 1 << 20);
    let buf = mem.alloc(init.len() as u64 * 4).unwrap();
    let bytes: Vec<u8> = init.iter().flat_map(|w| w.to_le_bytes()).collect();
    mem.write(buf, &bytes);
    launch(&p, &c, &buf.to_le_bytes(), &mem)?;
    let out = mem.read(buf, init.len() * 4).unwrap();
    Ok(out.chunks(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// Each thread stores `%r1` to word `%r0`.
fn per_thread(body: &str, n: u32) -> Vec<u32> {
    let src = kernel(&format!("{body}\nmul.wide.s32 %rd2, %r0, 4;\nadd.s64 %rd3, %rd1, %rd2;\nst.global.u32 [%rd3], %r1;"));
    run_words(&src, cfg(1, n), &vec![0; n as usize]).unwrap()
}

#[test]
fn integer_arithmetic() {
    let r = per_thread("mul.lo.s32 %r2, %r0, -3;\nadd.s32 %r1, %r2, 7;", 4);
    assert_eq!(r, vec![7, 4, 1, (-2i32) as u32]);
    let r = per_thread("mov.u32 %r2, 100;\ndiv.s32 %r3, %r2, %r0;\nrem.u32 %r4, %r2, 7;\nadd.s32 %r1, %r3, %r4;", 4);
    assert_eq!(r[1], 100 + 2);
    assert_eq!(r[3], 33 + 2);
    let r = per_thread("mul.hi.u32 %r1, %r0, -1;", 4);
    assert_eq!(r, vec![0, 0, 1, 2]);
    let r = per_thread("mul.wide.s32 %rd5, %r0, -2147483648;\nshr.s64 %rd6, %rd5, 32;\ncvt.u32.u64 %r1, %rd6;", 3);
    assert_eq!(r, vec![0, u32::MAX, u32::MAX]);
    let r = per_thread("min.s32 %r2, %r0, 2;\nmax.u32 %r3, %r0, 1;\nabs.s32 %r4, -5;\nadd.s32 %r5, %r2, %r3;\nmad.lo.s32 %r1, %r4, 10, %r5;", 4);
    assert_eq!(r, vec![51, 52, 54, 55]);
    let r = per_thread("add.sat.s32 %r1, %r0, 2147483646;", 3);
    assert_eq!(r, vec![2147483646, 2147483647, 2147483647]);
}

#[test]
fn bit_operations() {
    let r = per_thread("shl.b32 %r2, 1, %r0;\npopc.b32 %r3, %r2;\nclz.b32 %r4, %r2;\nadd.s32 %r1, %r3, %r4;", 3);
    assert_eq!(r, vec![32, 31, 30]);
    let r = per_thread("brev.b32 %r1, %r0;", 2);
    assert_eq!(r, vec![0, 0x8000_0000]);
    let r = per_thread("bfe.u32 %r1, 0xabcd1234, 8, 8;", 1);
    assert_eq!(r, vec![0x12]);
    let r = per_thread("bfe.s32 %r1, 0x0000f000, 12, 4;", 1);
    assert_eq!(r, vec![u32::MAX]);
    let r = per_thread("bfi.b32 %r1, 0xf, 0x12345678, 4, 4;", 1);
    assert_eq!(r, vec![0x123456f8]);
    let r = per_thread("prmt.b32 %r1, 0x33221100, 0x77665544, 0x7531;", 1);
    assert_eq!(r, vec![0x77553311]);
    let r = per_thread("shr.s32 %r1, -64, 40;", 1);
    assert_eq!(r, vec![u32::MAX]);
    let r = per_thread("shr.u32 %r1, -64, 40;", 1);
    assert_eq!(r, vec![0]);
    let r = per_thread("bfind.u32 %r1, 0x00010000;", 1);
    assert_eq!(r, vec![16]);
    let r = per_thread("and.b32 %r2, %r0, 1;\nxor.b32 %r3, %r2, 3;\nor.b32 %r4, %r3, 8;\nnot.b32 %r5, %r4;\ncnot.b32 %r6, %r2;\nadd.s32 %r1, %r5, %r6;", 2);
    assert_eq!(r, vec![!11u32 + 1, !10u32]);
}

#[test]
fn float_arithmetic_and_conversions() {
    let f = |body: &str, n| per_thread(body, n).into_iter().map(f32::from_bits).collect::<Vec<_>>();
    let r = f("cvt.rn.f32.s32 %f1, %r0;\nmul.f32 %f2, %f1, 0f3FC00000;\nadd.f32 %f3, %f2, 0f3F800000;\nfma.rn.f32 %f4, %f3, %f3, %f1;\nmov.b32 %r1, %f4;", 3);
    assert_eq!(r, vec![1.0, 7.25, 18.0]);
    let r = f("cvt.rn.f32.s32 %f1, %r0;\nsqrt.rn.f32 %f2, %f1;\nmov.b32 %r1, %f2;", 3);
    assert_eq!(r[2], 2f32.sqrt());
    let r = f("cvt.rn.f32.s32 %f1, %r0;\ndiv.rn.f32 %f2, 0f3F800000, %f1;\nmov.b32 %r1, %f2;", 2);
    assert_eq!(r, vec![f32::INFINITY, 1.0]);
    let r = f("cvt.rn.f32.s32 %f1, %r0;\nex2.approx.ftz.f32 %f2, %f1;\nlg2.approx.f32 %f3, %f2;\nadd.f32 %f4, %f3, %f2;\nmov.b32 %r1, %f4;", 3);
    assert_eq!(r, vec![1.0, 3.0, 6.0]);
    let r = f("cvt.rn.f32.s32 %f1, %r0;\nsin.approx.f32 %f2, %f1;\ncos.approx.f32 %f3, %f1;\nmul.f32 %f4, %f2, %f2;\nfma.rn.f32 %f5, %f3, %f3, %f4;\nmov.b32 %r1, %f5;", 3);
    for x in r {
        assert!((x - 1.0).abs() < 1e-6);
    }
    let r = f("cvt.rn.f32.s32 %f1, %r0;\nadd.f32 %f2, %f1, 0fBF800000;\nmin.f32 %f3, %f2, 0f00000000;\nmax.f32 %f4, %f3, 0fBF000000;\nabs.f32 %f5, %f4;\nneg.f32 %f6, %f5;\nmov.b32 %r1, %f6;", 3);
    assert_eq!(r, vec![-0.5, -0.0, -0.0]);
    let r = per_thread("cvt.rn.f32.s32 %f1, %r0;\nmul.f32 %f2, %f1, 0f3FC00000;\ncvt.rni.s32.f32 %r1, %f2;", 4);
    assert_eq!(r, vec![0, 2, 3, 4], "round half to even");
    let r = per_thread("cvt.rn.f32.s32 %f1, %r0;\nmul.f32 %f2, %f1, 0fC1200000;\ncvt.rzi.u32.f32 %r1, %f2;", 2);
    assert_eq!(r, vec![0, 0], "negative saturates to 0");
    let r = per_thread("cvt.rn.f64.s32 %fd1, %r0;\nsqrt.rn.f64 %fd2, %fd1;\ndiv.rn.f64 %fd3, %fd2, 0d4008000000000000;\nmul.f64 %fd4, %fd3, 0d408F400000000000;\ncvt.rzi.s32.f64 %r1, %fd4;", 5);
    assert_eq!(r, vec![0, 333, 471, 577, 666]);
    let r = per_thread("cvt.rn.f32.s32 %f1, %r0;\nmul.f32 %f2, %f1, 0f3FC00000;\ncvt.rn.f16.f32 %rs1, %f2;\nadd.f16 %rs2, %rs1, %rs1;\ncvt.f32.f16 %f3, %rs2;\ncvt.rzi.s32.f32 %r1, %f3;", 3);
    assert_eq!(r, vec![0, 3, 6]);
    let r = per_thread("mov.b32 %f1, 0f3F000000;\nsetp.gt.f32 %p1, %f1, 0f7FFFFFFF;\nsetp.gtu.f32 %p2, %f1, 0f7FFFFFFF;\nselp.u32 %r2, 1, 0, %p1;\nselp.u32 %r3, 2, 0, %p2;\nadd.s32 %r1, %r2, %r3;", 1);
    assert_eq!(r, vec![2], "ordered vs unordered comparisons with NaN");
    let r = per_thread("mov.b32 %f1, 0fC0000000;\ncvt.sat.f32.f32 %f2, %f1;\nadd.sat.f32 %f3, %f1, 0f40400000;\nadd.f32 %f4, %f2, %f3;\nmov.b32 %r1, %f4;", 1);
    assert_eq!(f32::from_bits(r[0]), 1.0);
}

#[test]
fn predicates_set_and_selp() {
    let r = per_thread("setp.lt.s32 %p1, %r0, 2;\nsetp.ne.and.s32 %p2, %r0, 0, %p1;\nselp.b32 %r1, 10, 20, %p2;", 4);
    assert_eq!(r, vec![20, 10, 20, 20]);
    let r = per_thread("set.ge.u32.s32 %r1, %r0, 1;", 2);
    assert_eq!(r, vec![0, u32::MAX]);
    let r = per_thread("setp.eq.s32 %p1|%p2, %r0, 1;\nnot.pred %p3, %p2;\nselp.b32 %r1, 5, 6, %p3;", 2);
    assert_eq!(r, vec![6, 5]);
}

#[test]
fn divergent_branches_reconverge() {
    // Odd lanes take a longer path; all lanes then ballot together.
    let body = "and.b32 %r2, %r0, 1;\nsetp.eq.s32 %p1, %r2, 0;\nmov.u32 %r3, 0;\n@%p1 bra $EVEN;\nadd.s32 %r3, %r3, 100;\nbra.uni $JOIN;\n$EVEN:\nadd.s32 %r3, %r3, 1;\n$JOIN:\nsetp.ne.s32 %p2, %r3, 0;\nvote.sync.ballot.b32 %r4, %p2, -1;\nadd.s32 %r1, %r3, %r4;";
    let r = per_thread(body, 32);
    for (i, v) in r.iter().enumerate() {
        let own = if i % 2 == 0 { 1 } else { 100 };
        assert_eq!(*v, own - 1, "lane {i}: own value plus a full ballot (all ones)");
    }
    // A loop whose trip count depends on the lane.
    let body = "mov.u32 %r1, 0;\nmov.u32 %r2, 0;\n$LOOP:\nsetp.ge.u32 %p1, %r2, %r0;\n@%p1 bra $DONE;\nadd.s32 %r1, %r1, %r2;\nadd.s32 %r2, %r2, 1;\nbra.uni $LOOP;\n$DONE:\nactivemask.b32 %r5;\nsetp.ne.s32 %p2, %r5, -1;\n@%p2 mov.u32 %r1, 999999;";
    let r = per_thread(body, 32);
    for (i, v) in r.iter().enumerate() {
        let i = i as u32;
        assert_eq!(*v, i * i.saturating_sub(1) / 2, "lane {i}");
    }
}

#[test]
fn warp_collectives() {
    let r = per_thread("shfl.sync.down.b32 %r1|%p1, %r0, 1, 31, -1;", 32);
    assert_eq!(r[0], 1);
    assert_eq!(r[31], 31, "out of range keeps its own value");
    let r = per_thread("shfl.sync.bfly.b32 %r1, %r0, 3, 31, -1;", 32);
    assert_eq!(r[5], 6);
    let r = per_thread("shfl.sync.idx.b32 %r1, %r0, 7, 31, -1;", 32);
    assert!(r.iter().all(|&v| v == 7));
    let r = per_thread("shfl.sync.up.b32 %r1, %r0, 2, 0, -1;", 32);
    assert_eq!(&r[..4], &[0, 1, 0, 1]);
    // Segmented shuffle: width 8 (c = ((32-8)<<8) | 31 for idx).
    let r = per_thread("shfl.sync.idx.b32 %r1, %r0, 0, 6175, -1;", 32);
    assert_eq!(r[13], 8);
    let r = per_thread("setp.lt.u32 %p1, %r0, 4;\nvote.sync.all.pred %p2, %p1, -1;\nvote.sync.any.pred %p3, %p1, -1;\nselp.u32 %r2, 1, 0, %p2;\nselp.u32 %r3, 2, 0, %p3;\nadd.s32 %r1, %r2, %r3;", 32);
    assert_eq!(r[0], 2);
    let r = per_thread("shr.u32 %r2, %r0, 3;\nmatch.any.sync.b32 %r1, %r2, -1;", 32);
    assert_eq!(r[9], 0xff00);
    let r = per_thread("mov.u32 %r1, %laneid;\nmov.u32 %r2, %lanemask_lt;\npopc.b32 %r3, %r2;\nsub.s32 %r1, %r1, %r3;", 32);
    assert!(r.iter().all(|&v| v == 0));
}

#[test]
fn shared_memory_barriers_and_atomics() {
    // Reverse a block's values through shared memory, with a barrier.
    let src = ".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry k(.param .u64 p)\n{\n.reg .pred %p<2>;\n.reg .b32 %r<16>;\n.reg .b64 %rd<16>;\n.shared .align 4 .b8 s[1024];\n.shared .align 4 .u32 cnt;\n\
        ld.param.u64 %rd1, [p];\nmov.u32 %r1, %tid.x;\nmov.u32 %r2, %ntid.x;\nmov.u32 %r9, %ctaid.x;\nmad.lo.s32 %r10, %r9, %r2, %r1;\nmul.wide.u32 %rd2, %r10, 4;\nadd.s64 %rd3, %rd1, %rd2;\n\
        ld.global.u32 %r3, [%rd3];\nmov.u32 %r4, s;\nshl.b32 %r5, %r1, 2;\nadd.s32 %r6, %r4, %r5;\nst.shared.u32 [%r6], %r3;\nbar.sync 0;\n\
        sub.s32 %r7, %r2, %r1;\nsub.s32 %r7, %r7, 1;\nshl.b32 %r7, %r7, 2;\nadd.s32 %r8, %r4, %r7;\nld.shared.u32 %r11, [%r8];\nst.global.u32 [%rd3], %r11;\n\
        atom.shared.add.u32 %r12, [cnt], 1;\nbar.sync 0;\nld.shared.u32 %r13, [cnt];\nsetp.ne.s32 %p1, %r13, 256;\n@%p1 trap;\nret;\n}\n";
    let init: Vec<u32> = (0..512).collect();
    let r = run_words(src, cfg(2, 256), &init).unwrap();
    for b in 0..2 {
        for t in 0..256 {
            assert_eq!(r[b * 256 + t], (b * 256 + 255 - t) as u32);
        }
    }
    // Global atomics from many blocks in parallel.
    let src = kernel("atom.global.add.u32 %r1, [%rd1], 1;\natom.global.max.s32 %r2, [%rd1+4], %r0;\nred.global.add.u64 [%rd1+8], 2;\natom.global.cas.b32 %r3, [%rd1+16], 0, %r0;\natom.global.inc.u32 %r4, [%rd1+20], 9;\natom.global.exch.b32 %r5, [%rd1+24], 3;\ncvt.rn.f32.s32 %f1, 1;\natom.global.add.f32 %f2, [%rd1+28], %f1;");
    let r = run_words(&src, cfg(64, 128), &[0; 8]).unwrap();
    assert_eq!(r[0], 64 * 128);
    assert_eq!(r[1], 64 * 128 - 1);
    assert_eq!(r[2] as u64 | (r[3] as u64) << 32, 2 * 64 * 128);
    assert_eq!(r[5], (64 * 128) % 10);
    assert_eq!(r[6], 3);
    assert_eq!(f32::from_bits(r[7]), (64 * 128) as f32);
}

/// A lane whose path to a barrier is laid out after the kernel's `ret` (LLVM puts loops out
/// of line: numba's reduction kernels look like this) must get there before the block passes
/// it: `bar.sync` counts threads. The interpreter let the block pass once the lanes with the
/// lower program counter arrived, so thread 0 read the shared sum before lane 5 had added to
/// it (numba's `cuda.reduce` returned sums short by whole warps).
#[test]
fn a_barrier_waits_for_lanes_on_an_out_of_line_path() {
    let src = ".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry k(.param .u64 p)\n{\n.reg .pred %p<4>;\n.reg .b32 %r<8>;\n.reg .b64 %rd<4>;\n.shared .align 4 .u32 acc;\n\
        ld.param.u64 %rd1, [p];\nmov.u32 %r1, %tid.x;\nsetp.eq.s32 %p1, %r1, 5;\n@%p1 bra $L_loop;\n\
        $L_join:\nbar.red.popc.u32 %r5, 0, 1;\nsetp.ne.s32 %p2, %r1, 0;\n@%p2 bra $L_done;\nld.shared.u32 %r3, [acc];\nst.global.u32 [%rd1], %r3;\nst.global.u32 [%rd1+4], %r5;\n\
        $L_done:\nret;\n\
        $L_loop:\nmov.u32 %r2, 0;\n$L_again:\nld.shared.u32 %r3, [acc];\nadd.u32 %r3, %r3, 1;\nst.shared.u32 [acc], %r3;\nadd.u32 %r2, %r2, 1;\nsetp.lt.u32 %p3, %r2, 10;\n@%p3 bra $L_again;\nbra.uni $L_join;\n}\n";
    for block in [32, 64, 40] {
        let r = run_words(src, cfg(1, block), &[0, 0]).unwrap();
        assert_eq!(r[0], 10, "block of {block}: the shared count thread 0 read after the barrier");
        assert_eq!(r[1], block, "block of {block}: threads counted by bar.red");
    }
}

/// Lanes on a path laid out after the join (as compilers place cold code) reach a `.sync` warp
/// operation after the lanes at lower pcs: the operation must wait for every lane its member
/// mask names, or the early lanes see a ballot and shuffled values without the late ones (CuPy's
/// warp-synchronous partition returned a wrong element this way).
#[test]
fn warp_sync_operations_wait_for_member_lanes_on_an_out_of_line_path() {
    let body = "and.b32 %r2, %r0, 31;\nsetp.lt.u32 %p1, %r2, 16;\n@%p1 bra $LATE;\nmul.lo.u32 %r3, %r2, 7;\n\
        $JOIN:\nsetp.ne.u32 %p2, %r2, 0;\nvote.sync.ballot.b32 %r4, %p2, -1;\nshfl.sync.idx.b32 %r5, %r3, 3, 31, -1;\n\
        shr.u32 %r6, %r2, 2;\nmatch.any.sync.b32 %r7, %r6, -1;\nxor.b32 %r1, %r4, %r5;\nxor.b32 %r1, %r1, %r7;\nbra.uni $STORE;\n\
        $LATE:\nmul.lo.u32 %r3, %r2, 7;\nbra.uni $JOIN;\n$STORE:";
    for n in [32u32, 64, 40] {
        let r = per_thread(body, n);
        for (t, v) in r.iter().enumerate() {
            let lanes = (n as usize - t / 32 * 32).min(32);
            let full = if lanes == 32 { u32::MAX } else { (1u32 << lanes) - 1 };
            let ballot = full & !1;
            let quad = (0xfu32 << (t % 32 / 4 * 4)) & full;
            assert_eq!(*v, ballot ^ 21 ^ quad, "block of {n}, thread {t}");
        }
    }
    // A partial member mask waits only for its members; bar.warp.sync is a convergence point too.
    let body = "and.b32 %r2, %r0, 31;\nsetp.ge.u32 %p1, %r2, 8;\n@%p1 bra $LATE;\nmov.u32 %r3, 1;\n\
        $JOIN:\nbar.warp.sync -1;\nshfl.sync.bfly.b32 %r1, %r3, 16, 31, -1;\nbra.uni $STORE;\n\
        $LATE:\nadd.u32 %r3, %r2, 100;\nsetp.lt.u32 %p3, %r2, 16;\n@!%p3 bra $JOIN;\nvote.sync.ballot.b32 %r8, %p3, 0xff00;\nadd.u32 %r3, %r3, %r8;\nbra.uni $JOIN;\n$STORE:";
    let r = per_thread(body, 32);
    for (t, v) in r.iter().enumerate() {
        let src = t ^ 16;
        let want = if src < 8 { 1 } else if src < 16 { src as u32 + 100 + 0xff00 } else { src as u32 + 100 };
        assert_eq!(*v, want, "thread {t}");
    }
}

/// A member mask naming lanes that wait at a block barrier (undefined on a GPU) must not hang the
/// sim: the lanes that came run the operation alone, as they did before warp operations waited.
#[test]
fn a_warp_operation_whose_members_sit_at_a_barrier_does_not_hang() {
    let body = "and.b32 %r2, %r0, 31;\nsetp.lt.u32 %p1, %r2, 16;\n@%p1 bra $LOW;\n\
        setp.ne.u32 %p2, %r2, 0;\nvote.sync.ballot.b32 %r1, %p2, -1;\nbar.sync 0;\nbra.uni $STORE;\n\
        $LOW:\nbar.sync 0;\nmov.u32 %r1, 7;\n$STORE:";
    let r = per_thread(body, 64);
    for (t, v) in r.iter().enumerate() {
        assert_eq!(*v, if t % 32 < 16 { 7 } else { 0xffff_0000 }, "thread {t}");
    }
}

/// A work loop laid out after its outer loop's latch, whose lanes with no work branch back to
/// that latch (a lower pc): they must wait there for the lanes still working, as a GPU
/// reconverges a warp at the branch's post-dominator. Run ahead (lowest pc first), they went
/// round the outer loop reading what the others had not written yet; CuPy's argpartition
/// kernel, warp-synchronous without any `.sync` between its steps, came out unpartitioned so.
#[test]
fn lanes_with_no_work_wait_at_the_latch_for_an_out_of_line_loop() {
    let body = "mov.u32 %r5, 0;\nmov.u32 %r1, 0;\nand.b32 %r2, %r0, 31;\nand.b32 %r8, %r2, 15;\nmul.wide.u32 %rd6, %r8, 4;\nadd.s64 %rd7, %rd1, %rd6;\n\
        $HEAD:\nld.global.u32 %r9, [%rd7+256];\nadd.u32 %r1, %r1, %r9;\nbra.uni $WHEAD;\n\
        $LATCH:\nadd.u32 %r5, %r5, 1;\nsetp.lt.u32 %p1, %r5, 3;\n@%p1 bra $HEAD;\nbra.uni $DONE;\n\
        $WHEAD:\nsetp.ge.u32 %p2, %r2, 16;\n@%p2 bra $LATCH;\nmov.u32 %r6, %r2;\n\
        $INNER:\nmul.wide.u32 %rd4, %r6, 4;\nadd.s64 %rd5, %rd1, %rd4;\nld.global.u32 %r7, [%rd5+256];\nadd.u32 %r7, %r7, 1;\nst.global.u32 [%rd5+256], %r7;\n\
        add.u32 %r6, %r6, 32;\nsetp.lt.u32 %p3, %r6, 16;\n@%p3 bra $INNER;\nbra.uni $LATCH;\n\
        $DONE:\nmul.wide.s32 %rd2, %r0, 4;\nadd.s64 %rd3, %rd1, %rd2;\nst.global.u32 [%rd3], %r1;";
    // One warp: each round reads the count (0, 1, 2) before the working lanes add one.
    let r = run_words(&kernel(body), cfg(1, 32), &[0; 80]).unwrap();
    for t in 0..32 {
        assert_eq!(r[t], 3, "thread {t}");
    }
}

#[test]
fn redux_sync_reduces_the_member_lanes() {
    // Lane values 3t - 40 (signed), over a full warp and over the upper half only.
    let body = "and.b32 %r2, %r0, 31;\nmad.lo.s32 %r3, %r2, 3, -40;\n\
        redux.sync.add.s32 %r4, %r3, -1;\nredux.sync.min.s32 %r5, %r3, -1;\nredux.sync.max.u32 %r6, %r3, -1;\n\
        redux.sync.xor.b32 %r7, %r2, 0xffff0000;\nsetp.lt.u32 %p1, %r2, 16;\n\
        @%p1 mov.u32 %r7, 0;\nxor.b32 %r1, %r4, %r5;\nxor.b32 %r1, %r1, %r6;\nxor.b32 %r1, %r1, %r7;";
    let r = per_thread(body, 64);
    let vals: Vec<i32> = (0..32).map(|t| 3 * t - 40).collect();
    let add = vals.iter().fold(0i32, |a, v| a.wrapping_add(*v)) as u32;
    let min = *vals.iter().min().unwrap() as u32;
    let max = vals.iter().map(|v| *v as u32).max().unwrap();
    let xor_hi = (16..32u32).fold(0, |a, v| a ^ v);
    for (t, v) in r.iter().enumerate() {
        let x = if t % 32 < 16 { 0 } else { xor_hi };
        assert_eq!(*v, add ^ min ^ max ^ x, "thread {t}");
    }
}

/// `set` writes 1.0 in a float destination's own format (f16 and bf16 too) or all ones, and on
/// packed sources compares each half; `setp` on packed sources gives one predicate per half.
#[test]
fn set_and_setp_on_half_precision() {
    // %rs2 = f16(t); %r2 = {lo: f16(t), hi: 2.0}.
    let pre = "cvt.rn.f16.u32 %rs2, %r0;\nmov.b16 %rs3, 0x4000;\ncvt.u32.u16 %r3, %rs2;\nor.b32 %r2, %r3, 0x40000000;\nmov.b32 %r5, 0x42003c00;\n";
    let r = per_thread(&format!("{pre}set.lt.f16.f16 %rs4, %rs2, %rs3;\ncvt.u32.u16 %r1, %rs4;"), 4);
    assert_eq!(r, vec![0x3c00, 0x3c00, 0, 0]);
    let r = per_thread(&format!("{pre}set.nan.u16.f16 %rs4, %rs2, %rs3;\nset.ge.bf16.bf16 %rs5, %rs3, %rs3;\ncvt.u32.u16 %r6, %rs4;\ncvt.u32.u16 %r7, %rs5;\nshl.b32 %r7, %r7, 16;\nor.b32 %r1, %r6, %r7;"), 2);
    assert_eq!(r, vec![0x3f80_0000, 0x3f80_0000]);
    let r = per_thread(&format!("{pre}set.lt.u32.f16x2 %r1, %r2, %r5;"), 3);
    assert_eq!(r, vec![0xffff_ffff, 0xffff_0000, 0xffff_0000]);
    let r = per_thread(&format!("{pre}set.ge.f16x2.f16x2 %r1, %r2, %r5;"), 2);
    assert_eq!(r, vec![0, 0x3c00]);
    let r = per_thread(&format!("{pre}setp.gt.f16x2 %p1|%p2, %r2, %r5;\nselp.u32 %r6, 1, 0, %p1;\nselp.u32 %r7, 2, 0, %p2;\nadd.u32 %r1, %r6, %r7;"), 3);
    assert_eq!(r, vec![0, 0, 1], "low: t > 1.0; high: 2.0 > 3.0 never");
}

#[test]
fn packed_integer_min_max_nan_propagating_min_max_and_relu() {
    // Halves (lo, hi) = (t - 2, 0x8000 + t) against (0, 0x8001): signed, 0x8000 is the most negative.
    let pre = "add.u32 %r2, %r0, -2;\nand.b32 %r2, %r2, 0xffff;\nadd.u32 %r3, %r0, 0x8000;\nshl.b32 %r3, %r3, 16;\nor.b32 %r2, %r2, %r3;\nmov.b32 %r4, 0x80010000;\n";
    let r = per_thread(&format!("{pre}min.s16x2 %r1, %r2, %r4;"), 3);
    assert_eq!(r, vec![0x8000_fffe, 0x8001_ffff, 0x8001_0000]);
    let r = per_thread(&format!("{pre}max.u16x2 %r1, %r2, %r4;"), 3);
    assert_eq!(r, vec![0x8001_fffe, 0x8001_ffff, 0x8002_0000]);
    // max.NaN: a NaN operand wins (canonical NaN); plain max takes the other operand.
    let body = "setp.eq.u32 %p1, %r0, 0;\nmov.b32 %f1, 0f40000000;\n@%p1 mov.b32 %f1, 0f7fc00001;\nmov.b32 %f2, 0f3f800000;\n\
        max.NaN.f32 %f3, %f1, %f2;\nmax.f32 %f4, %f1, %f2;\nmov.b32 %r5, %f3;\nmov.b32 %r6, %f4;\nxor.b32 %r1, %r5, %r6;";
    let r = per_thread(body, 2);
    assert_eq!(r, vec![0x7fff_ffff ^ 0x3f80_0000, 0]);
    let r = per_thread("mov.b16 %rs1, 0x7e00;\nmov.b16 %rs2, 0x3c00;\nmin.NaN.f16 %rs3, %rs1, %rs2;\nmin.f16 %rs4, %rs1, %rs2;\ncvt.u32.u16 %r5, %rs3;\ncvt.u32.u16 %r6, %rs4;\nshl.b32 %r6, %r6, 16;\nor.b32 %r1, %r5, %r6;", 1);
    assert_eq!(r, vec![0x3c00_7fff]);
    // fma.rn.relu.bf16: (t - 2) * 1.0 + 0.5 clamped at zero: -1.5 -> 0, -0.5 -> 0, 0.5, 1.5.
    let body = "add.s32 %r2, %r0, -2;\ncvt.rn.f32.s32 %f1, %r2;\ncvt.rn.bf16.f32 %rs1, %f1;\nmov.b16 %rs2, 0x3f80;\nmov.b16 %rs3, 0x3f00;\n\
        fma.rn.relu.bf16 %rs4, %rs1, %rs2, %rs3;\ncvt.u32.u16 %r1, %rs4;";
    assert_eq!(per_thread(body, 4), vec![0, 0, 0x3f00, 0x3fc0]);
}

/// fp8 against values worked out by hand from the OCP formats: e4m3 (bias 7, no infinities,
/// largest 448) and e5m2 (bias 15, IEEE-like, largest finite 57344).
#[test]
fn fp8_conversions() {
    use crate::float::{f64_to_fp8_satfinite as to8, fp8_to_f64 as from8};
    for (x, e4, e5) in [(1.0, 0x38, 0x3c), (-2.5, 0xc2, 0xc1), (448.0, 0x7e, 0x5f), (1e6, 0x7e, 0x7b), (f64::INFINITY, 0x7e, 0x7b), (2f64.powi(-9), 0x01, 0x18), (2f64.powi(-16), 0x00, 0x01), (2f64.powi(-17), 0x00, 0x00), (0.0, 0, 0), (1.0625, 0x38, 0x3c), (1.1875, 0x3a, 0x3d)] {
        assert_eq!(to8(x, false), e4, "e4m3 of {x}");
        assert_eq!(to8(x, true), e5, "e5m2 of {x}");
    }
    assert_eq!(to8(f64::NAN, false), 0x7f);
    for v in 0..=255u8 {
        for e5 in [false, true] {
            let x = from8(v, e5);
            if x.is_nan() {
                assert!(e5 && v & 0x7c == 0x7c || !e5 && v & 0x7f == 0x7f, "{v:#x} is NaN");
            } else if x.is_finite() {
                assert_eq!(to8(x, e5), v, "round trip of {v:#x} ({x}), e5m2 {e5}");
            }
        }
    }
    // Packing: a goes to the upper half. 1.0 and -2.5 -> e4m3x2 0x38c2; back to f16x2 0x3c00c100.
    let body = "mov.b32 %f1, 0f3f800000;\nmov.b32 %f2, 0fc0200000;\ncvt.rn.satfinite.e4m3x2.f32 %rs1, %f1, %f2;\n\
        cvt.rn.f16x2.e4m3x2 %r2, %rs1;\ncvt.u32.u16 %r3, %rs1;\nsetp.eq.u32 %p1, %r0, 0;\nselp.b32 %r1, %r3, %r2, %p1;";
    assert_eq!(per_thread(body, 2), vec![0x38c2, 0x3c00_c100]);
    // relu and satfinite on f16x2 from f32; e5m2x2 from f16x2.
    let body = "mov.b32 %f1, 0fc0200000;\nmov.b32 %f2, 0f7f800000;\ncvt.rn.relu.satfinite.f16x2.f32 %r2, %f1, %f2;\n\
        cvt.rn.satfinite.e5m2x2.f16x2 %rs1, %r2;\ncvt.u32.u16 %r3, %rs1;\nsetp.eq.u32 %p1, %r0, 0;\nselp.b32 %r1, %r2, %r3, %p1;";
    assert_eq!(per_thread(body, 2), vec![0x0000_7bff, 0x007b]);
}

/// `[%r + off]` in the shared space is 32-bit arithmetic: a negative base plus a larger offset
/// is a small address (it was taken as 4 GiB past the window, an illegal address).
#[test]
fn shared_addresses_wrap_at_32_bits() {
    let src = ".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry k(.param .u64 p)\n{\n.reg .b32 %r<8>;\n.reg .b64 %rd<4>;\n.shared .align 8 .b8 buf[64];\n\
        ld.param.u64 %rd1, [p];\nmov.u32 %r1, buf;\nadd.u32 %r2, %r1, -4096;\nmov.u32 %r3, 77;\nst.shared.u32 [%r2+4104], %r3;\n\
        ld.shared.u32 %r4, [%r1+8];\nst.global.u32 [%rd1], %r4;\nret;\n}\n";
    assert_eq!(run_words(src, cfg(1, 1), &[0]).unwrap(), vec![77]);
}

#[test]
fn griddepcontrol_is_ordered_by_the_stream() {
    let r = per_thread("griddepcontrol.wait;\ngriddepcontrol.launch_dependents;\nadd.u32 %r1, %r0, 5;", 2);
    assert_eq!(r, vec![5, 6]);
}

#[test]
fn bar_red_counts_the_block() {
    let r = per_thread("and.b32 %r2, %r0, 3;\nsetp.eq.s32 %p1, %r2, 0;\nbar.red.popc.u32 %r1, 0, %p1;", 128);
    assert!(r.iter().all(|&v| v == 32));
}

#[test]
fn illegal_address_names_block_and_thread() {
    let src = kernel("setp.eq.s32 %p1, %r0, 37;\n@!%p1 bra $END;\nst.global.u32 [%rd1+4096], %r0;\n$END:");
    let e = run_words(&src, cfg(4, 32), &[0; 4]).unwrap_err();
    assert!(matches!(e.fault, Fault::IllegalAddress { .. }), "{e}");
    assert_eq!(e.block, [1, 0, 0]);
    assert_eq!(e.thread, [5, 0, 0]);
    let src = kernel("ld.global.u32 %r1, [%rd1+2];");
    let e = run_words(&src, cfg(1, 1), &[0; 4]).unwrap_err();
    assert!(matches!(e.fault, Fault::Misaligned { .. }), "{e}");
}

#[test]
fn time_limit_ends_an_endless_kernel() {
    let src = kernel("$L:\nadd.s32 %r1, %r1, 1;\nbra.uni $L;");
    let mut c = cfg(2, 32);
    c.time_limit = Duration::from_millis(200);
    let e = run_words(&src, c, &[0]).unwrap_err();
    assert_eq!(e.fault, Fault::Timeout);
}

/// Carry chains as libdevice's trigonometric range reduction and multi-word integer code use
/// them, checked against u128 arithmetic here.
#[test]
fn carry_chains() {
    // 64-bit sum from 32-bit halves: (2^32 - 1 + t) + (1 + t * 2^32), per thread t.
    let r = per_thread(
        "mov.u32 %r2, -1;\nadd.u32 %r2, %r2, %r0;\nmov.u32 %r3, %r0;\nadd.cc.u32 %r4, %r2, 1;\naddc.u32 %r5, %r3, %r0;\nxor.b32 %r1, %r4, %r5;",
        64,
    );
    for (t, v) in r.iter().enumerate() {
        let t = t as u64;
        let x = t << 32 | (u32::MAX as u64 + t) & 0xffff_ffff;
        let sum = x.wrapping_add(t << 32 | 1);
        assert_eq!(*v, (sum as u32) ^ ((sum >> 32) as u32), "thread {t}");
    }
    // Borrow through subc, and madc.hi with the carry of mad.lo.cc (a 32x32 -> 64 product
    // plus a 64-bit addend, the way libdevice writes it).
    let r = per_thread(
        "mov.u32 %r2, 0;\nsub.cc.u32 %r3, %r2, %r0;\nsubc.u32 %r4, %r2, 0;\n\
         mov.u32 %r6, -7;\nmad.lo.cc.u32 %r7, %r6, %r6, %r6;\nmadc.hi.u32 %r8, %r6, %r6, %r0;\n\
         xor.b32 %r1, %r4, %r8;\nxor.b32 %r1, %r1, %r7;",
        40,
    );
    for (t, v) in r.iter().enumerate() {
        let t = t as u64;
        let hi_borrow = if t > 0 { u32::MAX } else { 0 }; // 0 - t borrows for t > 0
        let a = (u32::MAX - 6) as u64;
        let full = a as u128 * a as u128 + (t << 32 | a) as u128;
        let (lo, hi) = (full as u32, (full >> 32) as u32);
        assert_eq!(*v, hi_borrow ^ hi ^ lo, "thread {t}");
    }
}

/// Funnel shifts (CuPy's integer power and hashing use them), against u64 shifts here.
#[test]
fn funnel_shifts() {
    let body = "mov.u32 %r2, 0x89abcdef;\nmov.u32 %r3, 0x01234567;\nshf.l.wrap.b32 %r4, %r2, %r3, %r0;\nshf.r.clamp.b32 %r5, %r2, %r3, %r0;\nxor.b32 %r1, %r4, %r5;";
    let r = per_thread(body, 40);
    let v: u64 = 0x0123_4567_89ab_cdef;
    for (n, got) in r.iter().enumerate() {
        let l = ((v << (n % 32)) >> 32) as u32;
        let rr = (v >> n.min(32)) as u32;
        assert_eq!(*got, l ^ rr, "shift {n}");
    }
}

/// isspacep tells a generic address's window, as numba's runtime asks of its pointers.
#[test]
fn isspacep_tells_the_window() {
    let r = per_thread(
        ".local .align 4 .b8 buf[16];\n.shared .align 4 .b8 sh[16];\n\
         mov.u64 %rd4, buf;\ncvta.local.u64 %rd5, %rd4;\nmov.u64 %rd6, sh;\ncvta.shared.u64 %rd7, %rd6;\n\
         isspacep.local %p1, %rd5;\nisspacep.shared %p2, %rd7;\nisspacep.global %p3, %rd1;\nisspacep.local %p4, %rd7;\nisspacep.global %p5, %rd5;\n\
         selp.u32 %r2, 1, 0, %p1;\nselp.u32 %r3, 2, 0, %p2;\nselp.u32 %r4, 4, 0, %p3;\nselp.u32 %r5, 8, 0, %p4;\nselp.u32 %r6, 16, 0, %p5;\n\
         or.b32 %r1, %r2, %r3;\nor.b32 %r1, %r1, %r4;\nor.b32 %r1, %r1, %r5;\nor.b32 %r1, %r1, %r6;",
        2,
    );
    assert_eq!(r, [7, 7]);
}

/// A failed device assert ends the launch with the message, file and line it names.
#[test]
fn device_assert_reports_message_file_and_line() {
    let src = ".version 8.0\n.target sm_90\n.address_size 64\n\
        .extern .func __assertfail(.param .b64 a, .param .b64 b, .param .b32 c, .param .b64 d, .param .b64 e);\n\
        .global .align 1 .b8 msg[6] = {120, 32, 62, 32, 48, 0};\n.global .align 1 .b8 file[5] = {97, 46, 99, 117, 0};\n.global .align 1 .b8 fn_[2] = {107, 0};\n\
        .visible .entry k(.param .u64 p)\n{\n.reg .pred %p<2>;\n.reg .b32 %r<4>;\n.reg .b64 %rd<8>;\n\
        mov.u32 %r1, %tid.x;\nsetp.ne.s32 %p1, %r1, 3;\n@%p1 bra $L_ok;\n\
        mov.u64 %rd1, msg;\ncvta.global.u64 %rd2, %rd1;\nmov.u64 %rd3, file;\ncvta.global.u64 %rd4, %rd3;\nmov.u64 %rd5, fn_;\ncvta.global.u64 %rd6, %rd5;\n\
        { .param .b64 a; st.param.b64 [a], %rd2; .param .b64 b; st.param.b64 [b], %rd4; .param .b32 c; st.param.b32 [c], 42; .param .b64 d; st.param.b64 [d], %rd6; .param .b64 e; st.param.b64 [e], 1;\n\
        call.uni __assertfail, (a, b, c, d, e); }\n$L_ok:\nret;\n}\n";
    let m = Module::parse(src).unwrap_or_else(|e| panic!("{e}"));
    let mut mem = HostMemory::new(BASE, 1 << 20);
    let mut globals = std::collections::HashMap::new();
    for (name, bytes) in [("msg", b"x > 0\0".to_vec()), ("file", b"a.cu\0".to_vec()), ("fn_", b"k\0".to_vec())] {
        let a = mem.alloc(bytes.len() as u64).unwrap();
        mem.write(a, &bytes);
        globals.insert(name, a);
    }
    let p = m.lower("k", &|n| globals.get(n).copied()).unwrap_or_else(|e| panic!("{e}"));
    let e = launch(&p, &cfg(1, 32), &[0; 8], &mem).unwrap_err();
    assert_eq!(e.thread, [3, 0, 0]);
    assert_eq!(e.fault, Fault::Assert { message: "x > 0".into(), file: "a.cu".into(), line: 42, function: "k".into() });
}

#[test]
fn directed_rounding_and_the_warp_size_constant() {
    // 1 + 2^-30: towards zero stays at 1.0 (0x3f800000), upwards goes to 0x3f800001.
    let r = per_thread("mov.f32 %f1, 0f3F800000;\nmov.f32 %f2, 0f30800000;\nadd.rz.f32 %f3, %f1, %f2;\nadd.rp.f32 %f4, %f1, %f2;\nmov.b32 %r2, %f3;\nmov.b32 %r3, %f4;\nsub.u32 %r1, %r3, %r2;", 1);
    assert_eq!(r, [1]);
    let r = per_thread("mov.f32 %f1, 0f3F800000;\nmov.f32 %f2, 0f40400000;\ndiv.rm.f32 %f3, %f1, %f2;\nmov.b32 %r1, %f3;", 1);
    assert_eq!(r, [float::next_down_f32(1.0f32 / 3.0).to_bits()]);
    let r = per_thread("mov.f32 %f1, 0f3F800000;\nmov.f32 %f2, 0f33800000;\nfma.rz.f32 %f3, %f2, %f2, %f1;\nmov.b32 %r1, %f3;", 1);
    assert_eq!(r, [1.0f32.to_bits()]);
    let r = per_thread("mov.u32 %r1, WARP_SZ;", 2);
    assert_eq!(r, [32, 32]);
}

#[test]
fn unknown_instructions_are_refused_at_lowering() {
    // Directed rounding of an f64 quotient is not modelled (f32's is).
    let src = kernel("div.rz.f64 %fd1, %fd1, %fd1;");
    let m = Module::parse(&src).unwrap();
    let e = m.lower("k", &|_| None).unwrap_err();
    assert!(matches!(&e, PtxError::Unsupported { what, .. } if what == "div.rz.f64"), "{e}");
    let src = kernel("fma.rm.f64 %fd1, %fd1, %fd1, %fd1;");
    assert!(Module::parse(&src).unwrap().lower("k", &|_| None).is_err());
}

#[test]
fn device_functions_local_memory_and_printf() {
    let src = r#"
.version 8.0
.target sm_90
.address_size 64
.extern .func (.param .b32 func_retval0) vprintf (.param .b64 a, .param .b64 b);
.global .align 1 .b8 $str[12] = {116, 61, 37, 100, 32, 37, 46, 49, 102, 10, 0};
.func (.param .b32 ret) sq(.param .b32 x)
{
  .reg .b32 %r<4>;
  ld.param.u32 %r1, [x];
  mul.lo.s32 %r2, %r1, %r1;
  st.param.b32 [ret], %r2;
  ret;
}
.visible .entry k(.param .u64 p)
{
  .local .align 8 .b8 __local_depot0[16];
  .reg .b64 %SP;
  .reg .b64 %SPL;
  .reg .b32 %r<8>;
  .reg .b64 %rd<8>;
  mov.u64 %SPL, __local_depot0;
  cvta.local.u64 %SP, %SPL;
  ld.param.u64 %rd1, [p];
  mov.u32 %r1, %tid.x;
  {
  .param .b32 param0;
  st.param.b32 [param0], %r1;
  .param .b32 retval0;
  call.uni (retval0), sq, (param0);
  ld.param.b32 %r2, [retval0];
  }
  mul.wide.u32 %rd2, %r1, 4;
  add.s64 %rd3, %rd1, %rd2;
  st.global.u32 [%rd3], %r2;
  st.local.u32 [%SPL], %r2;
  mov.u64 %rd4, 4609434218613702656;
  st.local.u64 [%SPL+8], %rd4;
  mov.u64 %rd5, $str;
  cvta.global.u64 %rd6, %rd5;
  {
  .param .b64 param0;
  st.param.b64 [param0], %rd6;
  .param .b64 param1;
  st.param.b64 [param1], %SP;
  .param .b32 retval0;
  call.uni (retval0), vprintf, (param0, param1);
  }
  ret;
}
"#;
    let m = Module::parse(src).unwrap();
    let mut mem = HostMemory::new(BASE, 1 << 20);
    let s = mem.alloc(12).unwrap();
    mem.write(s, b"t=%d %.1f\n\0");
    let buf = mem.alloc(16).unwrap();
    let p = m.lower("k", &|n| (n == "$str").then_some(s)).unwrap();
    let out = launch(&p, &cfg(1, 4), &buf.to_le_bytes(), &mem).unwrap();
    let r = mem.read(buf, 16).unwrap();
    assert_eq!(r.chunks(4).map(|c| c[0]).collect::<Vec<_>>(), vec![0, 1, 4, 9]);
    assert_eq!(String::from_utf8(out.printf).unwrap(), "t=0 1.5\nt=1 1.5\nt=4 1.5\nt=9 1.5\n");
}

#[test]
fn tagged_pointers_reach_the_same_memory() {
    let src = kernel("or.b64 %rd4, %rd1, 0x0001000000000000;\nst.global.u32 [%rd4], 77;");
    let r = run_words(&src, cfg(1, 1), &[0]).unwrap();
    assert_eq!(r, vec![77]);
}

#[test]
fn multi_dimensional_ids() {
    let src = kernel("mov.u32 %r2, %tid.y;\nmov.u32 %r3, %ctaid.y;\nmov.u32 %r4, %ntid.x;\nmov.u32 %r5, %nctaid.y;\nmov.u32 %r6, %tid.x;\nmad.lo.s32 %r7, %r3, 2, %r2;\nmad.lo.s32 %r8, %r7, %r4, %r6;\nmul.wide.u32 %rd2, %r8, 4;\nadd.s64 %rd3, %rd1, %rd2;\nst.global.u32 [%rd3], %r5;");
    let mut c = cfg(1, 3);
    c.grid = [1, 4, 1];
    c.block = [3, 2, 1];
    let r = run_words(&src, c, &[0; 24]).unwrap();
    assert!(r.iter().all(|&v| v == 4), "{r:?}");
}

#[test]
fn only_a_kernel_that_returns_at_once_does_nothing() {
    let lower = |body: &str| {
        let src = format!(".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry k(.param .u32 n)\n{{\n{body}\n}}\n");
        Module::parse(&src).unwrap().lower("k", &|_| None).unwrap()
    };
    assert!(lower("ret;").does_nothing());
    assert!(lower(".reg .b32 %r<2>;\nret;").does_nothing());
    assert!(!lower(".reg .b32 %r<2>;\nmov.u32 %r1, %tid.x;\nret;").does_nothing());
    // A guarded return is not an unconditional one.
    assert!(!lower(".reg .pred %p<2>;\nsetp.eq.u32 %p1, 1, 1;\n@%p1 ret;\nret;").does_nothing());
}

/// A short text asking for exponentially many inlined instructions (each
/// function calls the next twice) or for a call chain thousands deep is
/// refused quickly, on a session thread's stack.
#[test]
fn inlining_is_bounded_in_size_and_depth() {
    let mut src = String::from(".version 8.0\n.target sm_90\n.address_size 64\n");
    src.push_str(".func f40()\n{\nret;\n}\n");
    for i in (0..40).rev() {
        src.push_str(&format!(".func f{i}()\n{{\ncall f{};\ncall f{};\nret;\n}}\n", i + 1, i + 1));
    }
    src.push_str(".visible .entry k()\n{\ncall f0;\nret;\n}\n");
    let m = Module::parse(&src).unwrap();
    let t = std::time::Instant::now();
    let e = m.lower_within("k", &|_| None, 1 << 16).unwrap_err();
    assert!(e.to_string().contains("more than 65536 instructions"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(5));

    let mut chain = String::from(".version 8.0\n.target sm_90\n.address_size 64\n");
    let n = 20_000;
    chain.push_str(&format!(".func f{n}()\n{{\nret;\n}}\n"));
    for i in (0..n).rev() {
        chain.push_str(&format!(".func f{i}()\n{{\ncall f{};\nret;\n}}\n", i + 1));
    }
    chain.push_str(".visible .entry k()\n{\ncall f0;\nret;\n}\n");
    let e = std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(move || {
            let m = Module::parse(&chain).unwrap();
            m.lower("k", &|_| None).unwrap_err().to_string()
        })
        .unwrap()
        .join()
        .unwrap();
    assert!(e.contains("nested more than 64 deep"), "{e}");
}

/// The differential runs catch a specialised kernel that computes something else than the
/// interpreter: here `add.s32` replaced by a subtraction, `setp.lt` by `setp.le`, and `mov` by
/// one that drops bit 0.
#[test]
fn a_wrong_specialised_kernel_is_caught() {
    use crate::exec::compiled_testing::{wrong, Wrong};
    let src = kernel(
        "add.s32 %r1, %r0, 5;\nsetp.lt.s32 %p1, %r0, 2;\nselp.b32 %r2, 100, 0, %p1;\nadd.s32 %r1, %r1, %r2;\n\
         mul.wide.s32 %rd2, %r0, 4;\nadd.s64 %rd3, %rd1, %rd2;\nst.global.u32 [%rd3], %r1;",
    );
    let m = Module::parse(&src).unwrap();
    let p = m.lower("k", &|_| None).unwrap();
    let mut mem = HostMemory::new(BASE, 1 << 16);
    let buf = mem.alloc(32 * 4).unwrap();
    let zeros = mem.snapshot();
    // From zeroed memory each time (what a kernel leaves unwritten must not be the answer).
    let go = |p: &Program| {
        mem.restore(&zeros);
        crate::testing::compare_tiers(p, &cfg(1, 32), &buf.to_le_bytes(), &mem, &|p, c, params, mem| crate::launch(p, c, params, mem))
    };
    assert_eq!(go(&p), Ok(()), "the correct kernels agree");
    assert!(p.compiled.specialised >= 6, "the test kernel is specialised: {}", p.compiled.specialised);
    for w in [Wrong::AddIsSub, Wrong::LtIsLe, Wrong::MovMask] {
        let mut bad = p.clone();
        assert!(wrong(&mut bad, w), "{w:?} applies to the kernel");
        let e = go(&bad).expect_err("a wrong kernel is caught");
        assert!(e.contains("memory differs"), "{w:?}: {e}");
    }
}

/// Every instruction of a kernel that only computes runs in the compiled tier's runs, and a
/// fault inside a run names the instruction's line and the lane, as the interpreter's does.
#[test]
fn the_compiled_tier_reports_faults_as_the_interpreter() {
    let src = kernel("mul.wide.s32 %rd2, %r0, 4096;\nadd.s64 %rd3, %rd1, %rd2;\nmov.u32 %r1, 3;\nst.global.u32 [%rd3], %r1;");
    let m = Module::parse(&src).unwrap();
    let p = m.lower("k", &|_| None).unwrap();
    let mut mem = HostMemory::new(BASE, 1 << 16);
    let buf = mem.alloc(4096 * 4).unwrap();
    let mut errs = Vec::new();
    for compiled in [false, true] {
        let c = LaunchConfig { compiled, ..cfg(1, 32) };
        errs.push(crate::launch(&p, &c, &buf.to_le_bytes(), &mem).unwrap_err());
    }
    assert!(matches!(errs[0].fault, Fault::IllegalAddress { .. }), "{}", errs[0]);
    assert_eq!(errs[0], errs[1]);
    assert_eq!(errs[1].thread, [4, 0, 0], "lane 4 is the first past the buffer");
}

/// Each specialised kernel against the interpreter on edge values (zero, ones, the signed
/// extremes, NaN, infinities, -0, subnormals, shift counts past the width), each lane its own
/// pair of inputs, under full and partial (guarded, divergent) masks, and with a destination
/// that is also a source.
#[test]
fn specialised_kernels_agree_with_the_interpreter_on_edge_values() {
    let ops32 = [
        "add.s32", "sub.s32", "mul.lo.s32", "and.b32", "or.b32", "xor.b32", "shl.b32", "shr.s32", "shr.u32", "min.s32", "min.u32", "max.s32",
        "max.u32", "add.f32", "sub.f32", "mul.f32", "div.rn.f32", "add.ftz.f32", "mul.sat.f32", "div.rn.ftz.f32",
    ];
    let mut body = String::from(
        "mul.wide.s32 %rd2, %r0, 8;\nadd.s64 %rd3, %rd1, %rd2;\nld.global.u32 %r1, [%rd3];\nld.global.u32 %r2, [%rd3+4];\n\
         mul.wide.s32 %rd4, %r0, 4;\nadd.s64 %rd5, %rd1, %rd4;\nadd.s64 %rd5, %rd5, 256;\nmov.u32 %r9, 0;\n\
         and.b32 %r8, %r0, 1;\nsetp.eq.s32 %p5, %r8, 0;\n",
    );
    let mut slot = 0;
    let mut out = |body: &mut String, reg: &str| {
        body.push_str(&format!("st.global.u32 [%rd5+{}], {reg};\n", slot * 128));
        slot += 1;
    };
    for op in ops32 {
        body.push_str(&format!("{op} %r3, %r1, %r2;\n"));
        out(&mut body, "%r3");
        // Partial mask: even lanes only, into a register that holds a value in the others.
        body.push_str(&format!("mov.u32 %r4, %r1;\n@%p5 {op} %r4, %r4, %r2;\n"));
        out(&mut body, "%r4");
    }
    for (cmp, ty) in [("lt", "s32"), ("le", "u32"), ("ne", "b32"), ("lt", "f32"), ("neu", "f32"), ("ge", "f32"), ("num", "f32"), ("equ", "f32")] {
        body.push_str(&format!("setp.{cmp}.{ty} %p1|%p2, %r1, %r2;\nselp.b32 %r5, 1, 0, %p1;\nselp.b32 %r6, 2, 0, %p2;\nadd.s32 %r5, %r5, %r6;\n"));
        out(&mut body, "%r5");
    }
    body.push_str(
        "fma.rn.f32 %f1, %r1, %r2, %r1;\nmov.b32 %r3, %f1;\nfma.rn.ftz.sat.f32 %f2, %r1, %r2, %r2;\nmov.b32 %r4, %f2;\n\
         cvt.rn.f32.u32 %f3, %r1;\nmov.b32 %r5, %f3;\ncvt.rn.f32.s32 %f4, %r2;\nmov.b32 %r6, %f4;\n\
         neg.f32 %f5, %r1;\nmov.b32 %r7, %f5;\nabs.f32 %f6, %r2;\nmov.b32 %r8, %f6;\nnot.b32 %r10, %r1;\n",
    );
    for r in ["%r3", "%r4", "%r5", "%r6", "%r7", "%r8", "%r10"] {
        out(&mut body, r);
    }
    body.push_str(
        "cvt.s64.s32 %rd6, %r1;\ncvt.u64.u32 %rd7, %r2;\nmul.wide.s32 %rd8, %r1, %r2;\nmul.wide.u32 %rd9, %r1, %r2;\n\
         mad.lo.s32 %r11, %r1, %r2, %r1;\nmad.wide.s32 %rd10, %r1, %r2, %rd6;\nadd.s64 %rd11, %rd6, %rd7;\nshr.s64 %rd12, %rd8, %r2;\n\
         cvt.rn.f64.s64 %fd1, %rd8;\ncvt.rn.f32.u64 %f7, %rd9;\nmov.b32 %r12, %f7;\nadd.f64 %fd2, %fd1, %fd1;\nmul.f64 %fd3, %fd2, %fd1;\n\
         fma.rn.f64 %fd4, %fd3, %fd1, %fd2;\nsetp.gtu.f64 %p3, %fd4, %fd1;\nselp.b32 %r13, 1, 0, %p3;\nmov.b64 %rd13, %fd4;\n\
         xor.b64 %rd14, %rd13, %rd12;\nxor.b64 %rd14, %rd14, %rd11;\nxor.b64 %rd14, %rd14, %rd10;\nxor.b64 %rd14, %rd14, %rd9;\n\
         cvt.u32.u64 %r14, %rd14;\nshr.u64 %rd15, %rd14, 32;\ncvt.u32.u64 %r15, %rd15;\ncvt.u16.u32 %rs1, %r1;\ncvt.s32.s16 %r16, %rs1;\n",
    );
    for r in ["%r11", "%r12", "%r13", "%r14", "%r15", "%r16"] {
        out(&mut body, r);
    }
    let src = kernel(&body);
    let vals: [u32; 16] = [
        0, 1, u32::MAX, 0x8000_0000, 0x7fff_ffff, 31, 32, 33, 0x7fc0_0000, 0x7f80_0000, 0xff80_0000, 0x8000_0000, 1, 0x3f80_0000, 0xc040_0000, 0x4b80_0001,
    ];
    let mut init = vec![0u32; 64 + slot * 32];
    for l in 0..32 {
        init[2 * l] = vals[l % 16];
        init[2 * l + 1] = vals[(l * 7 + 3) % 16];
    }
    let p = Module::parse(&src).unwrap_or_else(|e| panic!("{e}\n{src}")).lower("k", &|_| None).unwrap();
    let unspecialised: Vec<_> = p
        .insts
        .iter()
        .zip(&p.compiled.ops)
        .filter(|(i, o)| **o == crate::exec::compiled_testing::INTERP && !matches!(i.op, crate::ir::Op::Ld { .. } | crate::ir::Op::St { .. }))
        .map(|(i, _)| i.line)
        .collect();
    assert!(unspecialised.is_empty(), "all but the loads and stores are specialised; lines not: {unspecialised:?}");
    // run_words goes through `launch` above, which compares the tiers.
    let r = run_words(&src, cfg(1, 32), &init).unwrap();
    assert_eq!(r[64], vals[0].wrapping_add(vals[3]), "lane 0's add");
}

/// Registers declared with a type of at most 32 bits have 32-bit rows, wider ones 64-bit rows;
/// a name declared both ways in one body (inline asm blocks reuse names) gets a 64-bit row,
/// and a sign-extending load into a 32-bit register keeps what PTX gives it (the low 32 bits
/// of the sign-extended value).
#[test]
fn register_rows_follow_the_declared_width() {
    let src = kernel(
        "{ .reg .b64 %t; mov.b64 %t, 0x1234567800000001; shr.u64 %t, %t, 32; cvt.u32.u64 %r1, %t; }\n\
         { .reg .b32 %t; mov.b32 %t, 5; add.s32 %r1, %r1, %t; }\n\
         ld.global.s8 %r2, [%rd1+40];\n\
         cvt.s64.s32 %rd4, %r2;\n\
         shr.u64 %rd5, %rd4, 32;\n\
         cvt.u32.u64 %r3, %rd5;\n\
         st.global.u32 [%rd1], %r1;\n\
         st.global.u32 [%rd1+4], %r2;\n\
         st.global.u32 [%rd1+8], %r3;",
    );
    let p = Module::parse(&src).unwrap().lower("k", &|_| None).unwrap();
    // Rows are made for the registers used: %rd1, %rd4, %rd5 and the one %t; the special
    // registers, %r0, %r60..%r62 and %r1..%r3.
    assert_eq!(p.nwide, 4, "64-bit rows");
    assert_eq!(p.nregs, crate::ir::special::COUNT + 7, "32-bit rows");
    let mut init = vec![0u32; 11];
    init[10] = 0xff;
    let r = run_words(&src, cfg(1, 1), &init).unwrap();
    assert_eq!(r[0], 0x1234_5678 + 5, "the 64-bit %t kept its high half");
    assert_eq!(r[1], u32::MAX, "ld.s8 of 0xff into a 32-bit register");
    assert_eq!(r[2], u32::MAX, "cvt.s64.s32 sign-extends it");
}

/// A small deterministic generator (xorshift64*), so the sweep is the same on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[self.below(xs.len())]
    }
}

/// Straight-line code drawn at random from what the compiled tier specialises, over 32- and
/// 64-bit integer, f32, f64 and predicate registers (immediates, guards and lanes that
/// diverge included), run on both tiers (`launch` compares memory, faults and counts) and
/// every register stored. Catches a kernel whose operands' row kinds (32- or 64-bit), widths
/// or constants are handled otherwise than the interpreter does.
#[test]
fn random_straight_line_code_agrees_on_both_tiers() {
    let mut rng = Rng(0x5eed_1234_abcd_ef01);
    const R: usize = 8;
    let r = |rng: &mut Rng| format!("%r{}", 1 + rng.below(R));
    let rd = |rng: &mut Rng| format!("%rd{}", 10 + rng.below(R));
    let f = |rng: &mut Rng| format!("%f{}", 1 + rng.below(R));
    let fd = |rng: &mut Rng| format!("%fd{}", 1 + rng.below(R));
    let p = |rng: &mut Rng| format!("%p{}", 1 + rng.below(6));
    let imm32 = ["0", "1", "7", "31", "32", "33", "-1", "0x80000000", "0x7fffffff", "255"];
    let imm64 = ["0", "1", "63", "64", "-1", "0x8000000000000000", "0x100000000", "4294967295"];
    let immf = ["0f00000000", "0f3F800000", "0fBF000000", "0f7F800000", "0f7FC00000", "0f00000001", "0f80000000"];
    let immd = ["0d0000000000000000", "0d3FF0000000000000", "0dC000000000000000", "0d7FF0000000000000", "0d7FF8000000000000"];
    for prog in 0..40 {
        let mut body = String::new();
        // Inputs: each thread's own words, so lanes differ; predicates from the lane index.
        for i in 0..R {
            body += &format!("ld.global.u32 %r{}, [%rd2+{}];\n", 1 + i, 4 * i);
            body += &format!("ld.global.u64 %rd{}, [%rd2+{}];\n", 10 + i, 32 + 8 * i);
            body += &format!("ld.global.u32 %f{}, [%rd2+{}];\n", 1 + i, 96 + 4 * i);
            body += &format!("ld.global.u64 %fd{}, [%rd2+{}];\n", 1 + i, 128 + 8 * i);
        }
        body += "and.b32 %r40, %r62, 5;\nsetp.ne.s32 %p1, %r40, 0;\nsetp.lt.u32 %p2, %r62, 20;\nsetp.eq.s32 %p3, %r40, 4;\nsetp.gt.u32 %p4, %r1, %r2;\nsetp.ne.s32 %p5, %r3, 0;\nsetp.lt.s32 %p6, %r4, 0;\n";
        for _ in 0..60 {
            let guard = match rng.below(6) {
                0 => format!("@{} ", p(&mut rng)),
                1 => format!("@!{} ", p(&mut rng)),
                _ => String::new(),
            };
            let s32 = |rng: &mut Rng| if rng.below(4) == 0 { rng.pick(&imm32).to_string() } else { r(rng) };
            let s64 = |rng: &mut Rng| if rng.below(4) == 0 { rng.pick(&imm64).to_string() } else { rd(rng) };
            let sf = |rng: &mut Rng| if rng.below(5) == 0 { rng.pick(&immf).to_string() } else { f(rng) };
            let sd = |rng: &mut Rng| if rng.below(5) == 0 { rng.pick(&immd).to_string() } else { fd(rng) };
            let inst = match rng.below(22) {
                0 | 1 => {
                    let op = rng.pick(&["add.s32", "sub.s32", "mul.lo.s32", "and.b32", "or.b32", "xor.b32", "shl.b32", "shr.s32", "shr.u32", "min.s32", "min.u32", "max.s32", "max.u32"]);
                    format!("{op} {}, {}, {}", r(&mut rng), s32(&mut rng), s32(&mut rng))
                }
                2 => {
                    let op = rng.pick(&["add.s64", "sub.s64", "mul.lo.s64", "and.b64", "or.b64", "xor.b64", "min.s64", "max.u64"]);
                    format!("{op} {}, {}, {}", rd(&mut rng), s64(&mut rng), s64(&mut rng))
                }
                3 => format!("{} {}, {}, {}", rng.pick(&["shl.b64", "shr.s64", "shr.u64"]), rd(&mut rng), s64(&mut rng), s32(&mut rng)),
                4 => format!("mad.lo.s32 {}, {}, {}, {}", r(&mut rng), s32(&mut rng), s32(&mut rng), s32(&mut rng)),
                5 => format!("{} {}, {}, {}, {}", rng.pick(&["mad.wide.s32", "mad.wide.u32"]), rd(&mut rng), s32(&mut rng), s32(&mut rng), s64(&mut rng)),
                6 => format!("{} {}, {}, {}", rng.pick(&["mul.wide.s32", "mul.wide.u32"]), rd(&mut rng), s32(&mut rng), s32(&mut rng)),
                7 | 8 => {
                    let op = rng.pick(&["add.f32", "sub.f32", "mul.f32", "div.rn.f32", "add.rn.ftz.f32", "mul.sat.f32", "add.rz.f32", "sub.ftz.f32"]);
                    format!("{op} {}, {}, {}", f(&mut rng), sf(&mut rng), sf(&mut rng))
                }
                9 => format!("{} {}, {}, {}, {}", rng.pick(&["fma.rn.f32", "fma.rn.ftz.f32", "fma.rn.sat.f32"]), f(&mut rng), sf(&mut rng), sf(&mut rng), sf(&mut rng)),
                10 => format!("{} {}, {}, {}", rng.pick(&["add.f64", "sub.f64", "mul.f64", "div.rn.f64"]), fd(&mut rng), sd(&mut rng), sd(&mut rng)),
                11 => format!("fma.rn.f64 {}, {}, {}, {}", fd(&mut rng), sd(&mut rng), sd(&mut rng), sd(&mut rng)),
                12 => {
                    let c = rng.pick(&["lt", "le", "gt", "ge", "eq", "ne"]);
                    let t = rng.pick(&["s32", "u32"]);
                    format!("setp.{c}.{t} {}, {}, {}", p(&mut rng), s32(&mut rng), s32(&mut rng))
                }
                13 => {
                    let c = rng.pick(&["lt", "ge", "eq", "ne"]);
                    let t = rng.pick(&["s64", "u64"]);
                    format!("setp.{c}.{t} {}|{}, {}, {}", p(&mut rng), p(&mut rng), s64(&mut rng), s64(&mut rng))
                }
                14 => {
                    let c = rng.pick(&["lt", "le", "gtu", "neu", "equ", "num", "nan", "ge"]);
                    format!("setp.{c}.f32 {}, {}, {}", p(&mut rng), sf(&mut rng), sf(&mut rng))
                }
                15 => match rng.below(3) {
                    0 => format!("selp.b32 {}, {}, {}, {}", r(&mut rng), s32(&mut rng), s32(&mut rng), p(&mut rng)),
                    1 => format!("selp.b64 {}, {}, {}, {}", rd(&mut rng), s64(&mut rng), s64(&mut rng), p(&mut rng)),
                    _ => format!("selp.f32 {}, {}, {}, {}", f(&mut rng), sf(&mut rng), sf(&mut rng), p(&mut rng)),
                },
                16 => match rng.below(4) {
                    0 => format!("cvt.rn.f32.s32 {}, {}", f(&mut rng), r(&mut rng)),
                    1 => format!("cvt.rn.f32.u32 {}, {}", f(&mut rng), r(&mut rng)),
                    2 => format!("cvt.rn.f64.s32 {}, {}", fd(&mut rng), r(&mut rng)),
                    _ => format!("cvt.rn.f32.s64 {}, {}", f(&mut rng), rd(&mut rng)),
                },
                17 => match rng.below(4) {
                    0 => format!("cvt.u64.u32 {}, {}", rd(&mut rng), r(&mut rng)),
                    1 => format!("cvt.s64.s32 {}, {}", rd(&mut rng), r(&mut rng)),
                    2 => format!("cvt.u32.u64 {}, {}", r(&mut rng), rd(&mut rng)),
                    _ => format!("cvt.s32.s16 {}, {}", r(&mut rng), r(&mut rng)),
                },
                18 => match rng.below(4) {
                    0 => format!("mov.b32 {}, {}", r(&mut rng), s32(&mut rng)),
                    1 => format!("mov.b64 {}, {}", rd(&mut rng), s64(&mut rng)),
                    2 => format!("mov.b32 {}, {}", f(&mut rng), r(&mut rng)),
                    _ => format!("mov.b64 {}, {}", fd(&mut rng), rd(&mut rng)),
                },
                19 => match rng.below(4) {
                    0 => format!("neg.f32 {}, {}", f(&mut rng), f(&mut rng)),
                    1 => format!("abs.f32 {}, {}", f(&mut rng), f(&mut rng)),
                    2 => format!("neg.f64 {}, {}", fd(&mut rng), fd(&mut rng)),
                    _ => format!("abs.f64 {}, {}", fd(&mut rng), fd(&mut rng)),
                },
                20 => format!("not.b32 {}, {}", r(&mut rng), r(&mut rng)),
                _ => format!("not.b64 {}, {}", rd(&mut rng), rd(&mut rng)),
            };
            body += &format!("{guard}{inst};\n");
        }
        for i in 0..R {
            body += &format!("st.global.u32 [%rd2+{}], %r{};\n", 4 * i, 1 + i);
            body += &format!("st.global.u64 [%rd2+{}], %rd{};\n", 32 + 8 * i, 10 + i);
            body += &format!("st.global.u32 [%rd2+{}], %f{};\n", 96 + 4 * i, 1 + i);
            body += &format!("st.global.u64 [%rd2+{}], %fd{};\n", 128 + 8 * i, 1 + i);
        }
        for i in 1..7 {
            body += &format!("selp.b32 %r41, 1, 0, %p{i};\nst.global.u32 [%rd2+{}], %r41;\n", 188 + 4 * i);
        }
        // %rd2: this thread's 224-byte record.
        let src = kernel(&format!("mul.wide.u32 %rd3, %r0, 224;\nadd.s64 %rd2, %rd1, %rd3;\n{body}"));
        let threads = 48u32;
        let vals = [0u32, 1, u32::MAX, 0x8000_0000, 0x7fff_ffff, 31, 32, 0x7fc0_0000, 0x7f80_0000, 0xff80_0000, 0x3f80_0000, 0x0000_0001, 0x4b80_0001, 0xbf80_0000];
        let init: Vec<u32> = (0..threads as usize * 56).map(|_| if rng.below(3) == 0 { rng.next() as u32 } else { vals[rng.below(vals.len())] }).collect();
        // `run_words` launches through `launch`, which fails where the tiers differ.
        let out = run_words(&src, cfg(1, threads), &init).unwrap_or_else(|e| panic!("program {prog}: {e}\n{src}"));
        assert_eq!(out.len(), init.len());
    }
}

#[test]
fn managed_variables_are_module_storage() {
    // What nvcc emits for `__managed__ int counter;` and `atomicAdd(&counter, 1)`.
    let src = ".version 8.0\n.target sm_90\n.address_size 64\n\
               .global .attribute(.managed) .align 4 .u32 counter;\n\
               .visible .entry k()\n{\n.reg .b32 %r<2>;\n.reg .b64 %rd<2>;\n\
               mov.u64 %rd1, counter;\natom.global.add.u32 %r1, [%rd1], 1;\nret;\n}\n";
    let m = Module::parse(src).unwrap_or_else(|e| panic!("{e}"));
    let mut mem = HostMemory::new(BASE, 1 << 20);
    let counter = mem.alloc(4).unwrap();
    mem.write(counter, &5u32.to_le_bytes());
    let p = m.lower("k", &|n| (n == "counter").then_some(counter)).unwrap();
    launch(&p, &cfg(2, 32), &[], &mem).unwrap();
    assert_eq!(mem.read(counter, 4).unwrap(), 69u32.to_le_bytes());
    // Any other attribute is refused rather than ignored.
    let other = src.replace(".attribute(.managed)", ".attribute(.unified)");
    assert!(Module::parse(&other).is_err());
}
