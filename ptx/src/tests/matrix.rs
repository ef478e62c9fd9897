//! Tensor-core, matrix-load, asynchronous-copy and mbarrier instructions against
//! references computed here, with the per-lane fragment layouts written out as the PTX
//! ISA's fragment figures give them (group = lane / 4, t = lane % 4).

use super::*;

fn f16(x: f64) -> u64 {
    float::f64_to_small(x, float::F16) as u64
}

fn bf16(x: f64) -> u64 {
    float::f64_to_small(x, float::BF16) as u64
}

/// A deterministic small value: an integer in -4..=4 times 1/4, exact in every input format.
fn val(seed: usize) -> f64 {
    let x = (seed.wrapping_mul(2654435761) >> 7) % 9;
    (x as f64 - 4.0) / 4.0
}

/// One warp: lane `l` loads `regs_in[l]` into registers %r10.. (or %rd10.. when `wide`), runs
/// `op` (with `{A}`, `{B}`, `{C}`, `{D}` replaced by the register lists of `counts`), and
/// returns the D registers of every lane.
fn run_frag(op: &str, counts: [usize; 4], wide: bool, regs_in: &[Vec<u64>]) -> Vec<Vec<u64>> {
    let [na, nb, nc, nd] = counts;
    let s = na + nb + nc + nd;
    let (pre, ldt) = if wide { ("%rd", "b64") } else { ("%r", "b32") };
    let list = |from: usize, n: usize| format!("{{{}}}", (from..from + n).map(|k| format!("{pre}{}", 10 + k)).collect::<Vec<_>>().join(", "));
    let mut body = format!("mul.wide.u32 %rd2, %r62, {};\nadd.s64 %rd3, %rd1, %rd2;\n", s * 8);
    for j in 0..na + nb + nc {
        body += &format!("ld.global.{ldt} {pre}{}, [%rd3+{}];\n", 10 + j, j * 8);
    }
    body += &op.replace("{A}", &list(0, na)).replace("{B}", &list(na, nb)).replace("{C}", &list(na + nb, nc)).replace("{D}", &list(na + nb + nc, nd));
    body += "\n";
    for j in 0..nd {
        let k = na + nb + nc + j;
        body += &format!("st.global.{ldt} [%rd3+{}], {pre}{};\n", k * 8, 10 + k);
    }
    let mut init = vec![0u32; 32 * s * 2];
    for (l, regs) in regs_in.iter().enumerate() {
        for (j, v) in regs.iter().enumerate() {
            init[(l * s + j) * 2] = *v as u32;
            init[(l * s + j) * 2 + 1] = (*v >> 32) as u32;
        }
    }
    let out = run_words(&kernel(&body), cfg(1, 32), &init).unwrap_or_else(|e| panic!("{e}\n{op}"));
    (0..32)
        .map(|l| (0..nd).map(|j| { let k = (l * s + na + nb + nc + j) * 2; out[k] as u64 | (out[k + 1] as u64) << 32 }).collect())
        .collect()
}

/// Packs per-lane elements into registers of `per` elements of `bits` each.
fn pack(elems: &[u64], per: usize, bits: u32) -> Vec<u64> {
    let mask = if bits >= 64 { u64::MAX } else { (1u64 << bits) - 1 };
    elems.chunks(per).map(|c| c.iter().enumerate().fold(0, |acc, (i, e)| acc | (e & mask) << (i as u32 * bits))).collect()
}

/// The ISA's C/D layout of the m16n8 shapes: c0,c1 in row `group`, c2,c3 in row `group + 8`;
/// columns `2t`, `2t + 1`.
fn c_m16n8(lane: usize, i: usize) -> (usize, usize) {
    let (g, t) = (lane / 4, lane % 4);
    ([g, g, g + 8, g + 8][i], [2 * t, 2 * t + 1, 2 * t, 2 * t + 1][i])
}

/// m16n8k16 A (f16/bf16): a0,a1 row g; a2,a3 row g+8; a4,a5 row g; a6,a7 row g+8; columns 2t,
/// 2t+1 (a0..a3) and 2t+8, 2t+9 (a4..a7).
fn a_m16n8k16(lane: usize, i: usize) -> (usize, usize) {
    let (g, t) = (lane / 4, lane % 4);
    let row = [g, g, g + 8, g + 8, g, g, g + 8, g + 8][i];
    let col = [2 * t, 2 * t + 1, 2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9, 2 * t + 8, 2 * t + 9][i];
    (row, col)
}

/// m16n8k16 B (f16/bf16): b0,b1 rows 2t, 2t+1; b2,b3 rows 2t+8, 2t+9; column g.
fn b_m16n8k16(lane: usize, i: usize) -> (usize, usize) {
    let (g, t) = (lane / 4, lane % 4);
    ([2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9][i], g)
}

struct Case {
    m: usize,
    n: usize,
    k: usize,
}

/// Per-lane inputs from matrices through layout functions; the reference D through the same.
#[allow(clippy::too_many_arguments)]
fn mma_case(
    c: Case,
    op: &str,
    a_at: &dyn Fn(usize, usize) -> (usize, usize),
    na: usize,
    b_at: &dyn Fn(usize, usize) -> (usize, usize),
    nb: usize,
    c_at: &dyn Fn(usize, usize) -> (usize, usize),
    nc: usize,
    enc_in: &dyn Fn(f64) -> u64,
    enc_c: &dyn Fn(f64) -> u64,
    per_in: usize,
    per_c: usize,
    wide: bool,
    check: &dyn Fn(f64, u64) -> bool,
) {
    let a: Vec<f64> = (0..c.m * c.k).map(|x| val(x + 1)).collect();
    let b: Vec<f64> = (0..c.k * c.n).map(|x| val(x + 1000)).collect();
    let cm: Vec<f64> = (0..c.m * c.n).map(|x| val(x + 77) * 8.0).collect();
    let in_bits = 64 / (per_in as u32 * if wide { 1 } else { 2 });
    let c_bits = 64 / (per_c as u32 * if wide { 1 } else { 2 });
    let regs: Vec<Vec<u64>> = (0..32)
        .map(|l| {
            let ea: Vec<u64> = (0..na * per_in).map(|i| { let (r, k) = a_at(l, i); enc_in(a[r * c.k + k]) }).collect();
            let eb: Vec<u64> = (0..nb * per_in).map(|i| { let (k, n) = b_at(l, i); enc_in(b[k * c.n + n]) }).collect();
            let ec: Vec<u64> = (0..nc * per_c).map(|i| { let (r, n) = c_at(l, i); enc_c(cm[r * c.n + n]) }).collect();
            [pack(&ea, per_in, in_bits), pack(&eb, per_in, in_bits), pack(&ec, per_c, c_bits)].concat()
        })
        .collect();
    let out = run_frag(op, [na, nb, nc, nc], wide, &regs);
    for (l, d) in out.iter().enumerate() {
        for i in 0..nc * per_c {
            let (r, n) = c_at(l, i);
            let want = cm[r * c.n + n] + (0..c.k).map(|k| a[r * c.k + k] * b[k * c.n + n]).sum::<f64>();
            let got = if per_c == 1 { d[i] } else { (d[i / per_c] >> ((i % per_c) as u32 * c_bits)) & ((1u64 << c_bits) - 1) };
            assert!(check(want, got), "{op}: lane {l} element {i} (row {r}, col {n}): want {want}, got {got:#x}");
        }
    }
}

fn is_f32(want: f64, got: u64) -> bool {
    f32::from_bits(got as u32) as f64 == want
}

fn is_f16(want: f64, got: u64) -> bool {
    got == f16(want)
}

#[test]
fn mma_m16n8k16_f16_and_bf16_follow_the_isa_fragment_layout() {
    let c = || Case { m: 16, n: 8, k: 16 };
    let f32b = |x: f64| (x as f32).to_bits() as u64;
    mma_case(c(), "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {D}, {A}, {B}, {C};", &a_m16n8k16, 4, &b_m16n8k16, 2, &c_m16n8, 4, &f16, &f32b, 2, 1, false, &is_f32);
    mma_case(c(), "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {D}, {A}, {B}, {C};", &a_m16n8k16, 4, &b_m16n8k16, 2, &c_m16n8, 4, &bf16, &f32b, 2, 1, false, &is_f32);
    // f16 accumulators: two per register, c0/c1 in the first.
    mma_case(c(), "mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 {D}, {A}, {B}, {C};", &a_m16n8k16, 4, &b_m16n8k16, 2, &c_m16n8, 2, &f16, &f16, 2, 2, false, &is_f16);
}

#[test]
fn mma_m16n8k8_f16_and_tf32_follow_the_isa_fragment_layout() {
    let f32b = |x: f64| (x as f32).to_bits() as u64;
    // f16: a0,a1 row g, a2,a3 row g+8, columns 2t, 2t+1; b0,b1 rows 2t, 2t+1.
    let a = |l: usize, i: usize| (l / 4 + 8 * (i / 2), 2 * (l % 4) + i % 2);
    let b = |l: usize, i: usize| (2 * (l % 4) + i, l / 4);
    mma_case(Case { m: 16, n: 8, k: 8 }, "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {D}, {A}, {B}, {C};", &a, 2, &b, 1, &c_m16n8, 4, &f16, &f32b, 2, 1, false, &is_f32);
    // tf32: a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4); b0 row t, b1 row t+4. The low 13
    // bits of a tf32 register are not part of the value: set them, the result must not change.
    let a = |l: usize, i: usize| (l / 4 + 8 * (i % 2), l % 4 + 4 * (i / 2));
    let b = |l: usize, i: usize| (l % 4 + 4 * i, l / 4);
    let tf = |x: f64| (x as f32).to_bits() as u64 | 0x1fff;
    let c = Case { m: 16, n: 8, k: 8 };
    mma_case(c, "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {D}, {A}, {B}, {C};", &a, 4, &b, 2, &c_m16n8, 4, &tf, &f32b, 1, 1, false, &is_f32);
}

#[test]
fn mma_m8n8k4_f64_follows_the_isa_fragment_layout() {
    let a = |l: usize, _| (l / 4, l % 4);
    let b = |l: usize, _| (l % 4, l / 4);
    let c = |l: usize, i: usize| (l / 4, 2 * (l % 4) + i);
    let enc = |x: f64| x.to_bits();
    let check = |want: f64, got: u64| f64::from_bits(got) == want;
    mma_case(Case { m: 8, n: 8, k: 4 }, "mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {D}, {A}, {B}, {C};", &a, 1, &b, 1, &c, 2, &enc, &enc, 1, 1, true, &check);
}

/// Integer mma: exact, wrapping at 32 bits, or clamped with `.satfinite`.
#[test]
fn mma_integer_shapes_follow_the_isa_fragment_layout_and_saturate_only_when_asked() {
    // m16n8k32: a0..a3 (row g), a4..a7 (g+8), a8..a11 (g), a12..a15 (g+8); columns 4t..4t+3,
    // +16 from a8; b0..b3 rows 4t..4t+3, b4..b7 rows 4t+16..; column g.
    let a32 = |l: usize, i: usize| (l / 4 + 8 * ((i / 4) % 2), 4 * (l % 4) + i % 4 + 16 * (i / 8));
    let b32 = |l: usize, i: usize| (4 * (l % 4) + i % 4 + 16 * (i / 4), l / 4);
    // m16n8k16: a0..a3 row g, a4..a7 row g+8, columns 4t..4t+3; b0..b3 rows 4t..4t+3.
    let a16 = |l: usize, i: usize| (l / 4 + 8 * (i / 4), 4 * (l % 4) + i % 4);
    let b16 = |l: usize, i: usize| (4 * (l % 4) + i, l / 4);
    // m8n8k16: a0..a3 row g, columns 4t..4t+3; c0, c1 row g, columns 2t, 2t+1.
    let a8 = |l: usize, i: usize| (l / 4, 4 * (l % 4) + i);
    let c8 = |l: usize, i: usize| (l / 4, 2 * (l % 4) + i);
    for (shape, m, k, a_at, na, b_at, nb) in [
        ("m16n8k32", 16, 32, &a32 as &dyn Fn(usize, usize) -> (usize, usize), 4, &b32 as &dyn Fn(usize, usize) -> (usize, usize), 2),
        ("m16n8k16", 16, 16, &a16, 2, &b16, 1),
        ("m8n8k16", 8, 16, &a8, 1, &b16, 1),
    ] {
        let c_at: &dyn Fn(usize, usize) -> (usize, usize) = if m == 16 { &c_m16n8 } else { &c8 };
        let nc = m * 8 / 32;
        for (aty, bty, sat) in [("s8", "s8", false), ("u8", "s8", false), ("s8", "s8", true)] {
            let a: Vec<i64> = (0..m * k).map(|x| if aty == "u8" { (x * 37 % 256) as i64 } else { (x * 37 % 256) as i64 - 128 }).collect();
            let b: Vec<i64> = (0..k * 8).map(|x| (x * 91 % 256) as i64 - 128).collect();
            // Large accumulators, so that some sums leave the 32-bit range.
            let c: Vec<i64> = (0..m * 8).map(|x| if x % 3 == 0 { i32::MAX as i64 - 100 } else if x % 3 == 1 { i32::MIN as i64 + 100 } else { x as i64 }).collect();
            let regs: Vec<Vec<u64>> = (0..32)
                .map(|l| {
                    let ea: Vec<u64> = (0..na * 4).map(|i| { let (r, kk) = a_at(l, i); a[r * k + kk] as u64 & 0xff }).collect();
                    let eb: Vec<u64> = (0..nb * 4).map(|i| { let (kk, n) = b_at(l, i); b[kk * 8 + n] as u64 & 0xff }).collect();
                    let ec: Vec<u64> = (0..nc).map(|i| { let (r, n) = c_at(l, i); c[r * 8 + n] as u32 as u64 }).collect();
                    [pack(&ea, 4, 8), pack(&eb, 4, 8), ec].concat()
                })
                .collect();
            let op = format!("mma.sync.aligned.{shape}.row.col{}.s32.{aty}.{bty}.s32 {{D}}, {{A}}, {{B}}, {{C}};", if sat { ".satfinite" } else { "" });
            let out = run_frag(&op, [na, nb, nc, nc], false, &regs);
            for (l, d) in out.iter().enumerate() {
                for (i, got) in d.iter().enumerate() {
                    let (r, n) = c_at(l, i);
                    let sum = c[r * 8 + n] + (0..k).map(|kk| a[r * k + kk] * b[kk * 8 + n]).sum::<i64>();
                    let want = if sat { sum.clamp(i32::MIN as i64, i32::MAX as i64) as i32 } else { sum as i32 };
                    assert_eq!(*got as u32 as i32, want, "{op}: lane {l} element {i}");
                }
            }
        }
    }
}

/// The accumulation is a chain of fused multiply-adds in k order: f16 products are exact in f32,
/// and each addition rounds once (documented in exec/matrix.rs).
#[test]
fn mma_rounds_each_accumulation_once_in_k_order() {
    // Row 0 of A all ones, B all ones, C = 2^24: each 2^24 + 1 rounds (to even) back to 2^24,
    // where one rounding of the exact sum would give 2^24 + 16.
    let a_vals = |r: usize, _k: usize| if r == 0 { 1.0 } else { 0.0 };
    let regs: Vec<Vec<u64>> = (0..32)
        .map(|l| {
            let ea: Vec<u64> = (0..8).map(|i| { let (r, k) = a_m16n8k16(l, i); f16(a_vals(r, k)) }).collect();
            let eb: Vec<u64> = (0..4).map(|_| f16(1.0)).collect();
            let ec: Vec<u64> = (0..4).map(|_| 16777216.0f32.to_bits() as u64).collect();
            [pack(&ea, 2, 16), pack(&eb, 2, 16), ec].concat()
        })
        .collect();
    let out = run_frag("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {D}, {A}, {B}, {C};", [4, 2, 4, 4], false, &regs);
    let want = (0..16).fold(16777216.0f32, |acc, _| acc + 1.0);
    assert_eq!(want, 16777216.0);
    assert_eq!(f32::from_bits(out[0][0] as u32), want);
    assert_eq!(f32::from_bits(out[31][3] as u32), 16777216.0, "row 15 has no products");
}

/// wmma's fragments are opaque: load, mma and store must agree with each other, and element-wise
/// access through the registers (what `fragment.x[i]` compiles to) must act on every element.
#[test]
fn wmma_load_mma_store_computes_a_16x16x16_product_in_every_layout() {
    let (m, n, k) = (16usize, 16usize, 16usize);
    let a: Vec<f64> = (0..m * k).map(|x| val(x + 3)).collect();
    let b: Vec<f64> = (0..k * n).map(|x| val(x + 500)).collect();
    let cm: Vec<f64> = (0..m * n).map(|x| val(x + 9)).collect();
    for (al, bl, cl) in [("row", "col", "row"), ("col", "row", "col"), ("row", "row", "col")] {
        // Memory: A at 0 (stride 24 elements), B at 1024 bytes (stride 16), C at 2048 (f32, stride 20),
        // D written at 4096.
        let (sa, sb, sc) = (24usize, 16usize, 20usize);
        let mut mem = vec![0u32; 8192 / 4];
        let put16 = |mem: &mut Vec<u32>, byte: usize, v: u64| {
            let w = &mut mem[byte / 4];
            *w = if byte % 4 == 0 { (*w & 0xffff_0000) | v as u32 } else { (*w & 0xffff) | (v as u32) << 16 };
        };
        for r in 0..m {
            for c in 0..k {
                let idx = if al == "row" { r * sa + c } else { c * sa + r };
                put16(&mut mem, idx * 2, f16(a[r * k + c]));
            }
        }
        for r in 0..k {
            for c in 0..n {
                let idx = if bl == "row" { r * sb + c } else { c * sb + r };
                put16(&mut mem, 1024 + idx * 2, f16(b[r * n + c]));
            }
        }
        for r in 0..m {
            for c in 0..n {
                let idx = if cl == "row" { r * sc + c } else { c * sc + r };
                mem[512 + idx] = (cm[r * n + c] as f32).to_bits();
            }
        }
        let r8 = |from: usize, p: &str| format!("{{{}}}", (from..from + 8).map(|x| format!("{p}{x}")).collect::<Vec<_>>().join(", "));
        let body = format!(
            "wmma.load.a.sync.aligned.{al}.m16n16k16.global.f16 {}, [%rd1], {sa};\n\
             add.s64 %rd4, %rd1, 1024;\nwmma.load.b.sync.aligned.{bl}.m16n16k16.global.f16 {}, [%rd4], {sb};\n\
             add.s64 %rd5, %rd1, 2048;\nwmma.load.c.sync.aligned.{cl}.m16n16k16.global.f32 {}, [%rd5], {sc};\n\
             wmma.mma.sync.aligned.{al}.{bl}.m16n16k16.f32.f32 {}, {}, {}, {};\n{}\
             add.s64 %rd6, %rd1, 4096;\nwmma.store.d.sync.aligned.row.m16n16k16.global.f32 [%rd6], {}, 16;",
            r8(10, "%r"), r8(20, "%r"), r8(30, "%f"), r8(40, "%f"), r8(10, "%r"), r8(20, "%r"), r8(30, "%f"),
            (40..48).map(|x| format!("mul.f32 %f{x}, %f{x}, 0f40000000;\n")).collect::<String>(),
            r8(40, "%f"),
        );
        let out = run_words(&kernel(&body), cfg(1, 32), &mem).unwrap();
        for r in 0..m {
            for c in 0..n {
                let want = 2.0 * (cm[r * n + c] + (0..k).map(|x| a[r * k + x] * b[x * n + c]).sum::<f64>());
                assert_eq!(f32::from_bits(out[1024 + r * 16 + c]) as f64, want, "{al}/{bl}/{cl}: D[{r}][{c}]");
            }
        }
    }
}

/// The other wmma shapes and types: bf16, tf32, s8 and f64 products through load/mma/store.
#[test]
fn wmma_other_types_and_shapes() {
    // (shape, m, n, k, input type, bytes, encode, accumulator type, mma types)
    type Enc = fn(f64) -> u64;
    let cases: [(&str, usize, usize, usize, &str, usize, Enc, &str, &str); 5] = [
        ("m32n8k16", 32, 8, 16, "bf16", 2, |x| bf16(x), "f32", "f32.bf16.bf16.f32"),
        ("m8n32k16", 8, 32, 16, "f16", 2, |x| f16(x), "f16", "f16.f16"),
        ("m16n16k8", 16, 16, 8, "tf32", 4, |x| (x as f32).to_bits() as u64, "f32", "f32.tf32.tf32.f32"),
        ("m16n16k16", 16, 16, 16, "s8", 1, |x| (x * 4.0) as i64 as u64 & 0xff, "s32", "s32.s8.s8.s32"),
        ("m8n8k4", 8, 8, 4, "f64", 8, |x| x.to_bits(), "f64", "f64.f64.f64.f64"),
    ];
    for (shape, m, n, k, ty, bytes, enc, acc, mty) in cases {
        let a: Vec<f64> = (0..m * k).map(|x| val(x + 5)).collect();
        let b: Vec<f64> = (0..k * n).map(|x| val(x + 55)).collect();
        let scale = if ty == "s8" { 4.0 } else { 1.0 };
        let mut mem = vec![0u8; 16384];
        for (i, v) in a.iter().enumerate() {
            mem[i * bytes..(i + 1) * bytes].copy_from_slice(&enc(*v).to_le_bytes()[..bytes]);
        }
        for (i, v) in b.iter().enumerate() {
            mem[4096 + i * bytes..4096 + (i + 1) * bytes].copy_from_slice(&enc(*v).to_le_bytes()[..bytes]);
        }
        let per_reg = |t: &str, e: usize| if t == "f64" { 1 } else { 4 / e };
        let abytes = bytes;
        let na = (m * k / 32).div_ceil(per_reg(ty, abytes)).max(1);
        let nb = (k * n / 32).div_ceil(per_reg(ty, abytes)).max(1);
        // Registers as nvcc declares them for these fragments (f16 a/b are replicated: twice as many).
        let (na, nb) = if ty == "f16" { (8, 8) } else { (na, nb) };
        let cbytes = match acc { "f16" => 2, "f64" => 8, _ => 4 };
        let nc = (m * n / 32).div_ceil(per_reg(acc, cbytes));
        let p = if ty == "f64" { "%fd" } else { "%r" };
        let list = |from: usize, cnt: usize| format!("{{{}}}", (from..from + cnt).map(|x| format!("{p}{x}")).collect::<Vec<_>>().join(", "));
        let zero = (0..nc).map(|x| format!("mov.b{} {p}{}, 0;\n", if ty == "f64" { 64 } else { 32 }, 40 + x)).collect::<String>();
        let body = format!(
            "wmma.load.a.sync.aligned.row.{shape}.global.{ty} {}, [%rd1], {k};\nadd.s64 %rd4, %rd1, 4096;\n\
             wmma.load.b.sync.aligned.col.{shape}.global.{ty} {}, [%rd4], {k};\n{zero}\
             wmma.mma.sync.aligned.row.col.{shape}.{mty} {}, {}, {}, {};\nadd.s64 %rd6, %rd1, 8192;\n\
             wmma.store.d.sync.aligned.row.{shape}.global.{acc} [%rd6], {}, {n};",
            list(10, na), list(20, nb), list(50, nc), list(10, na), list(20, nb), list(40, nc), list(50, nc)
        );
        // B was written row-major K x N above; the load says col: re-lay it out as N x K.
        let mut mem2 = mem.clone();
        for kk in 0..k {
            for nn in 0..n {
                let from = 4096 + (kk * n + nn) * bytes;
                let to = 4096 + (nn * k + kk) * bytes;
                mem2[to..to + bytes].copy_from_slice(&mem[from..from + bytes]);
            }
        }
        let words: Vec<u32> = mem2.chunks(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        let out = run_words(&kernel(&body), cfg(1, 32), &words).unwrap_or_else(|e| panic!("{shape} {ty}: {e}"));
        let outb: Vec<u8> = out.iter().flat_map(|x| x.to_le_bytes()).collect();
        for r in 0..m {
            for c in 0..n {
                let want = (0..k).map(|x| a[r * k + x] * b[x * n + c]).sum::<f64>() * scale * scale;
                let at = 8192 + (r * n + c) * cbytes;
                let raw = &outb[at..at + cbytes];
                let got = match acc {
                    "f32" => f32::from_le_bytes(raw.try_into().unwrap()) as f64,
                    "f16" => float::small_to_f64(u16::from_le_bytes(raw.try_into().unwrap()) as u32, float::F16),
                    "s32" => i32::from_le_bytes(raw.try_into().unwrap()) as f64,
                    _ => f64::from_le_bytes(raw.try_into().unwrap()),
                };
                assert_eq!(got, want, "{shape} {ty}: D[{r}][{c}]");
            }
        }
    }
}

/// ldmatrix: lane 8j + r addresses row r of matrix j; lane l gets row l/4, columns 2(l%4) and
/// 2(l%4)+1 of each matrix (of its transpose with .trans). stmatrix writes the same back.
#[test]
fn ldmatrix_stmatrix_and_movmatrix_follow_the_isa_layout() {
    // Global: 4 matrices of 8x8 u16, element (j, r, c) = j*64 + r*8 + c. Row (j, r) is placed in
    // shared memory at 16 * perm(8j + r), so the row addresses are not in order.
    let init: Vec<u32> = (0..128).map(|w| { let e = 2 * w as u32; e | (e + 1) << 16 }).chain(std::iter::repeat_n(0, 256)).collect();
    for (shape, trans, nreg) in [("x4", "", 4), ("x4", ".trans", 4), ("x2", "", 2), ("x1", ".trans", 1)] {
        let regs = (0..nreg).map(|j| format!("%r{}", 10 + j)).collect::<Vec<_>>().join(", ");
        let stores: String = (0..nreg).map(|j| format!("st.global.u32 [%rd5+{}], %r{};\n", j * 4, 10 + j)).collect();
        let body = format!(
            ".shared .align 16 .b8 sm[512];\n\
             mul.lo.u32 %r2, %r62, 5;\nadd.u32 %r2, %r2, 3;\nrem.u32 %r2, %r2, 32;\nshl.b32 %r2, %r2, 4;\nmov.u32 %r3, sm;\nadd.u32 %r4, %r3, %r2;\n\
             mul.wide.u32 %rd2, %r62, 16;\nadd.s64 %rd3, %rd1, %rd2;\nld.global.v4.u32 {{%r20, %r21, %r22, %r23}}, [%rd3];\nst.shared.v4.u32 [%r4], {{%r20, %r21, %r22, %r23}};\n\
             bar.sync 0;\nldmatrix.sync.aligned.m8n8.{shape}{trans}.shared.b16 {{{regs}}}, [%r4];\n\
             mul.wide.u32 %rd4, %r62, 16;\nadd.s64 %rd5, %rd1, 512;\nadd.s64 %rd5, %rd5, %rd4;\n{stores}\
             bar.sync 0;\nstmatrix.sync.aligned.m8n8.{shape}{trans}.shared.b16 [%r4], {{{regs}}};\nbar.sync 0;\n\
             ld.shared.v4.u32 {{%r20, %r21, %r22, %r23}}, [%r4];\nadd.s64 %rd6, %rd1, 1024;\nadd.s64 %rd6, %rd6, %rd2;\nst.global.v4.u32 [%rd6], {{%r20, %r21, %r22, %r23}};"
        );
        let out = run_words(&kernel(&body), cfg(1, 32), &init).unwrap_or_else(|e| panic!("{shape}{trans}: {e}"));
        let el = |j: usize, r: usize, c: usize| (j * 64 + r * 8 + c) as u32;
        for l in 0..32 {
            for j in 0..nreg {
                let (row, c0) = (l / 4, 2 * (l % 4));
                let want = if trans.is_empty() { el(j, row, c0) | el(j, row, c0 + 1) << 16 } else { el(j, c0, row) | el(j, c0 + 1, row) << 16 };
                assert_eq!(out[128 + l * 4 + j], want, "ldmatrix {shape}{trans}: lane {l} register {j}");
            }
        }
        // stmatrix of what ldmatrix loaded puts every row back where it came from.
        for l in 0..nreg * 8 {
            for w in 0..4 {
                assert_eq!(out[256 + l * 4 + w], init[l * 4 + w], "stmatrix {shape}{trans}: row of lane {l}");
            }
        }
    }
    // movmatrix transposes a fragment held as ldmatrix leaves one.
    let body = "shl.b32 %r2, %r62, 1;\nadd.u32 %r3, %r2, 1;\nshl.b32 %r3, %r3, 16;\nor.b32 %r4, %r2, %r3;\n\
                movmatrix.sync.aligned.m8n8.trans.b16 %r1, %r4;\nmul.wide.u32 %rd2, %r62, 4;\nadd.s64 %rd3, %rd1, %rd2;\nst.global.u32 [%rd3], %r1;";
    let out = run_words(&kernel(body), cfg(1, 32), &[0; 32]).unwrap();
    for (l, got) in out.iter().enumerate() {
        // Element (r, c) of the source is r*8 + c (lane 4r + c/2 holds it).
        let (row, c0) = (l / 4, 2 * (l % 4));
        let want = (c0 * 8 + row) as u32 | (((c0 + 1) * 8 + row) as u32) << 16;
        assert_eq!(*got, want, "movmatrix lane {l}");
    }
}

/// cp.async copies 4, 8 or 16 bytes, zero-fills past src-size and for ignore-src, and the group
/// operations complete it.
#[test]
fn cp_async_copies_zero_fills_and_completes_by_the_group_wait() {
    let body = ".shared .align 16 .b8 sm[1024];\n.reg .pred %q<2>;\n\
        mov.u32 %r3, sm;\nshl.b32 %r4, %r62, 4;\nadd.u32 %r5, %r3, %r4;\nmul.wide.u32 %rd2, %r62, 16;\nadd.s64 %rd3, %rd1, %rd2;\n\
        and.b32 %r6, %r62, 3;\nsetp.eq.u32 %q1, %r6, 3;\n\
        setp.eq.u32 %p1, %r6, 0;\n@%p1 cp.async.cg.shared.global.L2::128B [%r5], [%rd3], 16;\n\
        setp.eq.u32 %p2, %r6, 1;\n@%p2 cp.async.ca.shared.global [%r5], [%rd3], 16, 5;\n\
        setp.eq.u32 %p3, %r6, 2;\n@%p3 cp.async.ca.shared.global [%r5+8], [%rd3+8], 8;\n\
        @%q1 cp.async.ca.shared.global [%r5+4], [%rd3+4], 4, %q1;\n\
        cp.async.commit_group;\ncp.async.wait_group 0;\ncp.async.wait_all;\nbar.sync 0;\n\
        ld.shared.v4.u32 {%r20, %r21, %r22, %r23}, [%r5];\nadd.s64 %rd4, %rd3, 2048;\nst.global.v4.u32 [%rd4], {%r20, %r21, %r22, %r23};";
    let mut init: Vec<u32> = (0..512).map(|x| 0x0101_0101u32.wrapping_mul(x as u32 + 1)).collect();
    init.extend(std::iter::repeat_n(0xdead_beef, 512));
    let out = run_words(&kernel(body), cfg(1, 64), &init).unwrap();
    for t in 0..64 {
        let src = &init[t * 4..t * 4 + 4];
        let got = &out[512 + t * 4..512 + t * 4 + 4];
        let want: [u32; 4] = match t % 4 {
            0 => [src[0], src[1], src[2], src[3]],
            1 => [src[0], src[1] & 0xff, 0, 0],
            2 => [0, 0, src[2], src[3]],
            _ => [0, 0, 0, 0],
        };
        assert_eq!(got, want, "thread {t}");
    }
    // A misaligned cp.async faults.
    let body = ".shared .align 16 .b8 sm[64];\nmov.u32 %r3, sm;\ncp.async.cg.shared.global [%r3+4], [%rd1], 16;";
    let e = run_words(&kernel(body), cfg(1, 1), &[0; 16]).unwrap_err();
    assert!(matches!(e.fault, Fault::Misaligned { .. }), "{e}");
}

/// mbarrier between warps: warp 0 arrives first and spins in try_wait; the others must get their
/// turn to arrive (on a GPU they run beside it). Two phases (parity 0, then 1), the token form
/// of test_wait, pending_count, and a transaction count completed by cp.async.bulk.
#[test]
fn mbarrier_phases_tokens_and_transaction_counts() {
    let body = ".shared .align 8 .b64 bar;\n.shared .align 8 .b64 bar2;\n.shared .align 16 .b8 sm[512];\n.shared .align 16 .b8 bulk[64];\n.reg .pred %q<4>;\n\
        mov.u32 %r3, bar;\nmov.u32 %r4, sm;\nmov.u32 %r9, bar2;\nmov.u32 %r12, bulk;\n\
        setp.ne.u32 %q1, %r62, 0;\n@%q1 bra $INIT_DONE;\n\
        mbarrier.init.shared::cta.b64 [%r3], %r61;\nmbarrier.init.shared.b64 [%r9], 1;\n\
        $INIT_DONE:\nfence.mbarrier_init.release.cluster;\nbar.sync 0;\n\
        shl.b32 %r5, %r62, 2;\nadd.u32 %r6, %r4, %r5;\nmul.lo.u32 %r7, %r62, 3;\nst.shared.u32 [%r6], %r7;\n\
        mbarrier.arrive.release.cta.shared::cta.b64 %rd5, [%r3];\nmbarrier.pending_count.b64 %r30, %rd5;\n\
        $W0:\nmbarrier.try_wait.parity.acquire.cta.shared::cta.b64 %q2, [%r3], 0;\n@!%q2 bra $W0;\n\
        add.u32 %r8, %r62, 32;\nrem.u32 %r8, %r8, %r61;\nshl.b32 %r8, %r8, 2;\nadd.u32 %r8, %r4, %r8;\nld.shared.u32 %r10, [%r8];\n\
        mbarrier.arrive.shared.b64 %rd6, [%r3];\n\
        $W1:\nmbarrier.test_wait.shared.b64 %q3, [%r3], %rd6;\n@!%q3 bra $W1;\n\
        mbarrier.try_wait.parity.shared.b64 %q3, [%r3], 1;\nselp.u32 %r11, 1, 0, %q3;\n\
        mbarrier.test_wait.parity.shared.b64 %q3, [%r3], 0;\nselp.u32 %r17, 2, 0, %q3;\nor.b32 %r11, %r11, %r17;\n\
        @%q1 bra $BULK_DONE;\n\
        mbarrier.arrive.expect_tx.shared.b64 %rd7, [%r9], 64;\nmbarrier.test_wait.shared.b64 %q2, [%r9], %rd7;\nselp.u32 %r13, 1, 0, %q2;\n\
        cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%r12], [%rd1], 64, [%r9];\n\
        mbarrier.test_wait.shared.b64 %q2, [%r9], %rd7;\nselp.u32 %r14, 1, 0, %q2;\nshl.b32 %r14, %r14, 1;\nor.b32 %r13, %r13, %r14;\n\
        $BULK_DONE:\n\
        $W2:\nmbarrier.try_wait.parity.shared.b64 %q2, [%r9], 0;\n@!%q2 bra $W2;\n\
        and.b32 %r15, %r62, 15;\nshl.b32 %r15, %r15, 2;\nadd.u32 %r15, %r12, %r15;\nld.shared.u32 %r16, [%r15];\n\
        mul.wide.u32 %rd2, %r62, 16;\nadd.s64 %rd3, %rd1, %rd2;\nadd.s64 %rd3, %rd3, 1024;\n\
        st.global.v4.u32 [%rd3], {%r10, %r11, %r16, %r30};\n\
        @%q1 bra $END;\nst.global.u32 [%rd1+1020], %r13;\n$END:";
    let n = 128usize;
    let mut init: Vec<u32> = (0..16).map(|x| x * 11 + 1).collect();
    init.resize(256 + 4 * n, 0);
    let out = run_words(&kernel(body), cfg(1, n as u32), &init).unwrap();
    for t in 0..n {
        let got = &out[256 + t * 4..256 + t * 4 + 4];
        assert_eq!(got[0], ((t + 32) % n * 3) as u32, "thread {t}: value another warp stored before it arrived");
        assert_eq!(got[1], 1, "thread {t}: after two phases, the one of parity 1 is complete and the one of parity 0 (the third) is not");
        assert_eq!(got[2], init[t % 16], "thread {t}: bulk-copied word");
        assert_eq!(got[3], (n - t) as u32, "thread {t}: pending count in its token (arrivals in thread order)");
    }
    assert_eq!(out[255], 0b10, "the expect_tx phase is incomplete before the bulk copy and complete after it");
}

/// What the sim does not model stays refused at lowering, naming the instruction.
#[test]
fn unmodelled_matrix_forms_are_refused() {
    for text in [
        "mma.sp.sync.aligned.m16n8k32.row.col.f32.f16.f16.f32 {%f1,%f2,%f3,%f4}, {%r1,%r2,%r3,%r4}, {%r5,%r6,%r7,%r8}, {%f1,%f2,%f3,%f4}, %r9, 0;",
        "mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32 {%f1,%f2,%f3,%f4,%f5,%f6,%f7,%f8}, {%r1,%r2}, {%r3,%r4}, {%f1,%f2,%f3,%f4,%f5,%f6,%f7,%f8};",
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%f1,%f2,%f3,%f4}, {%r1,%r2,%r3,%r4}, {%r5,%r6}, {%f1,%f2,%f3,%f4};",
        "wmma.load.a.sync.aligned.row.m8n8k32.global.s4 {%r1}, [%rd1], 32;",
        "wmma.mma.sync.aligned.row.col.m8n8k128.s32.b1.b1.s32 {%r1,%r2}, {%r3}, {%r4}, {%r1,%r2};",
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd1, {%r2, %r3}], [%r4];",
        "cp.async.ca.shared.global.L2::cache_hint [%r1], [%rd1], 16, %rd2;",
        "ldmatrix.sync.aligned.m16n16.x1.trans.shared.b8 {%r1, %r2}, [%r3];",
        "mbarrier.arrive.shared::cluster.b64 _, [%r1], 1, %r2;",
    ] {
        let src = kernel(text);
        match Module::parse(&src) {
            Ok(m) => {
                let e = m.lower("k", &|_| None).unwrap_err();
                assert!(matches!(e, PtxError::Unsupported { .. } | PtxError::Parse { .. }), "{text}: {e}");
            }
            Err(e) => assert!(matches!(e, PtxError::Parse { .. }), "{text}: {e}"),
        }
    }
}

/// The warp-wide matrix operations read every lane's registers: lanes that reach one on a path
/// laid out after it must be waited for, as for the other `.sync` warp operations.
#[test]
fn mma_waits_for_lanes_on_an_out_of_line_path() {
    // Lanes 16..31 compute their A registers on a path placed after the mma.
    let body = "and.b32 %r2, %r0, 31;\nsetp.ge.u32 %p1, %r2, 16;\n@%p1 bra $LATE;\nmov.b32 %r10, 0x3c003c00;\nmov.b32 %r11, 0x3c003c00;\n\
        $JOIN:\nmov.b32 %r12, 0x3c003c00;\nmov.b32 %r13, 0x3c003c00;\n\
        mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%f1, %f2, %f3, %f4}, {%r10, %r11}, {%r12}, {%f10, %f11, %f12, %f13};\n\
        mov.b32 %r1, %f1;\nbra.uni $STORE;\n\
        $LATE:\nmov.b32 %r10, 0x40004000;\nmov.b32 %r11, 0x40004000;\nbra.uni $JOIN;\n$STORE:";
    let body = format!("mov.f32 %f10, 0f00000000;\nmov.f32 %f11, 0f00000000;\nmov.f32 %f12, 0f00000000;\nmov.f32 %f13, 0f00000000;\n{body}");
    let r = per_thread(&body, 32);
    // c0 of lane l is row l/4: A row g comes from the lanes 4g..4g+3 (a0, a1): 1.0 for rows 0..3,
    // 2.0 for rows 4..7; with B all ones and K = 8, D = 8 or 16.
    for (l, v) in r.iter().enumerate() {
        let want = if l / 4 < 4 { 8.0f32 } else { 16.0 };
        assert_eq!(f32::from_bits(*v), want, "lane {l}");
    }
}

/// cvt to tf32 against the nearest of the two tf32 neighbours, chosen in f64.
#[test]
fn cvt_to_tf32_rounds_as_each_mode_says() {
    let xs: Vec<u32> = vec![
        0x3f80_1000, 0x3f80_3000, 0x3f80_0fff, 0x3f80_1001, 0xbf80_1000, 0xbf80_3000, 0x4049_0fdb, 0x0000_1000, 0x0000_3000,
        0x7f7f_f000, 0xff7f_ffff, 0x7f80_0000, 0xff80_0000, 0x7fc0_0001, 0x8000_0000, 0x0000_0000, 0xc2f6_e979, 0x3dcc_cccd,
    ];
    let want = |x: u32, mode: &str, relu: bool, sat: bool| -> u32 {
        let f = f32::from_bits(x);
        if f.is_nan() {
            return 0x7fff_ffff;
        }
        if relu && f.is_sign_negative() {
            return 0;
        }
        let r = if f.is_infinite() {
            x
        } else {
            let lo = x & 0xffff_e000;
            let hi = lo + 0x2000;
            // Past the largest finite value, the next one up is 2^128 (which rounds to infinity).
            let value = |b: u32| if b & 0x7fff_ffff == 0x7f80_0000 { 2f64.powi(128).copysign(f as f64) } else { f32::from_bits(b) as f64 };
            let (dl, dh) = ((f as f64 - value(lo)).abs(), (value(hi) - f as f64).abs());
            match mode {
                "rz" => lo,
                _ if dl < dh => lo,
                _ if dh < dl => hi,
                "rna" => hi,
                _ => if (lo >> 13) & 1 == 0 { lo } else { hi },
            }
        };
        if sat && f32::from_bits(r).is_infinite() { (r & 0x8000_0000) | 0x7f7f_e000 } else { r }
    };
    for (form, mode, relu, sat) in [("rna", "rna", false, false), ("rna.satfinite", "rna", false, true), ("rn.satfinite", "rn", false, true), ("rz.satfinite", "rz", false, true), ("rn.relu.satfinite", "rn", true, true)] {
        let body = format!("mul.wide.u32 %rd2, %r62, 4;\nadd.s64 %rd3, %rd1, %rd2;\nld.global.f32 %f1, [%rd3];\ncvt.{form}.tf32.f32 %r1, %f1;\nst.global.u32 [%rd3], %r1;");
        let out = run_words(&kernel(&body), cfg(1, xs.len() as u32), &xs).unwrap();
        for (x, got) in xs.iter().zip(&out) {
            assert_eq!(*got, want(*x, mode, relu, sat), "cvt.{form}.tf32.f32 of {x:#010x}");
        }
    }
}

/// elect.sync picks the lowest lane of the member mask, after waiting for the members.
#[test]
fn elect_sync_picks_the_lowest_member_lane() {
    for (mask, leader) in [("0xffffffff", 0u32), ("0xfff0", 4), ("0x80000000", 31)] {
        let body = format!(
            "and.b32 %r2, %r0, 31;\nmov.u32 %r3, 1;\nshl.b32 %r3, %r3, %r2;\nand.b32 %r3, %r3, {mask};\nsetp.eq.u32 %p1, %r3, 0;\nmov.u32 %r1, 99;\n@%p1 bra $OUT;\n\
             elect.sync %r4|%p2, {mask};\nselp.u32 %r5, 1000, 0, %p2;\nadd.u32 %r1, %r4, %r5;\nelect.sync _|%p3, {mask};\n@%p3 add.u32 %r1, %r1, 10000;\n$OUT:"
        );
        let r = per_thread(&body, 64);
        for (t, v) in r.iter().enumerate() {
            let l = t as u32 % 32;
            let member = u32::from_str_radix(mask.trim_start_matches("0x"), 16).unwrap() >> l & 1 != 0;
            let want = if !member { 99 } else if l == leader { leader + 11000 } else { leader };
            assert_eq!(*v, want, "mask {mask}, thread {t}");
        }
    }
}
