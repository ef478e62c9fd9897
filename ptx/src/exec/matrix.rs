//! Warp-wide matrix instructions: `mma.sync` (fragments laid out as the PTX ISA's
//! "Matrix Fragments for mma.m16n8k*" sections say), `wmma` (fragments opaque to the
//! program, so the sim picks a layout of its own: lane `l` holds elements
//! `l*n .. l*n+n` of the matrix in row-major order, `n = rows*cols/32`, repeated where a
//! fragment has room for more, as f16 A and B fragments of m16n16k16 do), `ldmatrix`,
//! `stmatrix` and `movmatrix`.
//!
//! Arithmetic: f16, bf16 and tf32 inputs are converted exactly to f32 (tf32 keeps the 10
//! explicit mantissa bits of its f32 register and ignores the low 13, as the ISA says);
//! each product is added to the f32 accumulator with one rounding (a fused multiply-add),
//! for k = 0, 1, ..., K-1, starting from C. An f16 D is that f32 result rounded to
//! nearest. f64 is the same in f64. Integer products are summed exactly and wrap to 32
//! bits, or clamp with `.satfinite`. A GPU's summation order inside its tensor cores is
//! not specified; this is the sim's.

use super::*;
use crate::lower::tensor::{dims, per_reg};

/// Largest operand of the shapes lowered (32x16, 16x32).
const MAX_ELEMS: usize = 512;

/// (row, col) of element `i` of `lane`'s fragment of operand `of`.
fn pos(shape: [u8; 3], wmma: bool, of: FragOf, ty: MmaTy, lane: usize, i: usize) -> (usize, usize) {
    let (rows, cols) = dims(shape, of);
    if wmma {
        let per = rows * cols / LANES;
        let idx = lane * per + i % per;
        return (idx / cols, idx % cols);
    }
    let (g, t) = (lane >> 2, lane & 3);
    match (of, shape, ty) {
        (FragOf::C, [16, ..], _) => (g + 8 * (i >> 1), 2 * t + (i & 1)),
        (FragOf::C, _, _) => (g, 2 * t + i),
        (FragOf::A, [16, 8, 16], MmaTy::F16 | MmaTy::BF16) => (g + 8 * ((i >> 1) & 1), 2 * t + (i & 1) + 8 * (i >> 2)),
        (FragOf::A, [16, 8, 8], MmaTy::F16 | MmaTy::BF16) => (g + 8 * (i >> 1), 2 * t + (i & 1)),
        (FragOf::A, [16, 8, 8], _) => (g + 8 * (i & 1), t + 4 * (i >> 1)),
        (FragOf::A, [16, 8, 4], _) => (g + 8 * i, t),
        (FragOf::A, [8, 8, 4], _) => (g, t),
        (FragOf::A, [16, 8, 32], _) => (g + 8 * ((i >> 2) & 1), 4 * t + (i & 3) + 16 * (i >> 3)),
        (FragOf::A, [16, 8, 16], _) => (g + 8 * (i >> 2), 4 * t + (i & 3)),
        (FragOf::A, _, _) => (g, 4 * t + i),
        (FragOf::B, [16, 8, 16], MmaTy::F16 | MmaTy::BF16) => (2 * t + (i & 1) + 8 * (i >> 1), g),
        (FragOf::B, [16, 8, 8], MmaTy::F16 | MmaTy::BF16) => (2 * t + i, g),
        (FragOf::B, [16, 8, 8], _) => (t + 4 * i, g),
        (FragOf::B, [16, 8, 4] | [8, 8, 4], _) => (t, g),
        (FragOf::B, [16, 8, 32], _) => (4 * t + (i & 3) + 16 * (i >> 2), g),
        (FragOf::B, _, _) => (4 * t + i, g),
    }
}

/// Element `i` of a fragment whose registers are `vals`.
#[inline]
fn element(vals: &[u64], ty: MmaTy, i: usize) -> u64 {
    let per = per_reg(ty);
    let bits = ty.bits();
    let v = vals[i / per];
    if per == 1 {
        v
    } else {
        (v >> ((i % per) as u32 * bits)) & width_mask(bits as u8)
    }
}

fn to_f64(ty: MmaTy, v: u64) -> f64 {
    match ty {
        MmaTy::F16 => float::small_to_f64(v as u32 & 0xffff, float::F16),
        MmaTy::BF16 => float::small_to_f64(v as u32 & 0xffff, float::BF16),
        MmaTy::Tf32 => f32::from_bits(v as u32 & 0xffff_e000) as f64,
        MmaTy::F32 => f32::from_bits(v as u32) as f64,
        MmaTy::F64 => f64::from_bits(v),
        MmaTy::S8 => v as u8 as i8 as f64,
        MmaTy::U8 => v as u8 as f64,
        MmaTy::S32 => v as u32 as i32 as f64,
    }
}

fn to_int(ty: MmaTy, v: u64) -> i64 {
    match ty {
        MmaTy::S8 => v as u8 as i8 as i64,
        MmaTy::U8 => v as u8 as i64,
        _ => v as u32 as i32 as i64,
    }
}

/// The matrix operand `of` gathered from every lane's fragment registers.
fn gather<T: Copy + Default>(regs: &Regs, srcs: &[Src], shape: [u8; 3], wmma: bool, of: FragOf, ty: MmaTy, conv: impl Fn(MmaTy, u64) -> T) -> [T; MAX_ELEMS] {
    let (rows, cols) = dims(shape, of);
    let per = rows * cols / LANES;
    let mut out = [T::default(); MAX_ELEMS];
    let mut vals = [0u64; 16];
    for lane in 0..LANES {
        for (k, s) in srcs.iter().enumerate() {
            vals[k] = match *s {
                Src::R(r) => regs.get(r, lane),
                Src::C(c) => c,
            };
        }
        let vals = &vals[..srcs.len()];
        for i in 0..per {
            let (r, c) = pos(shape, wmma, of, ty, lane, i);
            out[r * cols + c] = conv(ty, element(vals, ty, i));
        }
    }
    out
}

/// Writes the M x N result (raw element bits in `bits`) into the D fragment of the lanes in `m`.
fn scatter(regs: &mut Regs, m: u32, d: &[u32], shape: [u8; 3], wmma: bool, ty: MmaTy, bits: &[u64; MAX_ELEMS]) {
    let (rows, cols) = dims(shape, FragOf::C);
    let per = rows * cols / LANES;
    let pr = per_reg(ty);
    let eb = ty.bits();
    for lane in 0..LANES {
        if m >> lane & 1 == 0 {
            continue;
        }
        let mut vals = [0u64; 16];
        for i in 0..d.len() * pr {
            let (r, c) = pos(shape, wmma, FragOf::C, ty, lane, i % per);
            let v = bits[r * cols + c];
            vals[i / pr] |= if pr == 1 { v } else { (v & width_mask(eb as u8)) << ((i % pr) as u32 * eb) };
        }
        for (k, &r) in d.iter().enumerate() {
            regs.set(r, lane, vals[k]);
        }
    }
}

// Not inlined into `BlockRunner::exec`: these operand arrays would grow its stack frame and
// slow every other instruction (measured with the bench under cachegrind).
#[inline(never)]
pub(super) fn mma(regs: &mut Regs, m: u32, x: &Mma) {
    let [mm, nn, kk] = x.shape.map(|v| v as usize);
    let mut out = [0u64; MAX_ELEMS];
    match x.a_ty {
        MmaTy::S8 | MmaTy::U8 => {
            let a = gather(regs, &x.a, x.shape, x.wmma, FragOf::A, x.a_ty, to_int);
            let b = gather(regs, &x.b, x.shape, x.wmma, FragOf::B, x.b_ty, to_int);
            let c = gather(regs, &x.c, x.shape, x.wmma, FragOf::C, x.c_ty, to_int);
            for i in 0..mm {
                for j in 0..nn {
                    let mut acc = c[i * nn + j];
                    for k in 0..kk {
                        acc += a[i * kk + k] * b[k * nn + j];
                    }
                    out[i * nn + j] = if x.satfinite { acc.clamp(i32::MIN as i64, i32::MAX as i64) as i32 as u32 as u64 } else { acc as i32 as u32 as u64 };
                }
            }
        }
        MmaTy::F64 => {
            let a = gather(regs, &x.a, x.shape, x.wmma, FragOf::A, x.a_ty, to_f64);
            let b = gather(regs, &x.b, x.shape, x.wmma, FragOf::B, x.b_ty, to_f64);
            let c = gather(regs, &x.c, x.shape, x.wmma, FragOf::C, x.c_ty, to_f64);
            for i in 0..mm {
                for j in 0..nn {
                    let mut acc = c[i * nn + j];
                    for k in 0..kk {
                        acc = a[i * kk + k].mul_add(b[k * nn + j], acc);
                    }
                    out[i * nn + j] = acc.to_bits();
                }
            }
        }
        _ => {
            // Every f16, bf16 and tf32 value is exactly an f32.
            let f = |t, v| to_f64(t, v) as f32;
            let a = gather(regs, &x.a, x.shape, x.wmma, FragOf::A, x.a_ty, f);
            let b = gather(regs, &x.b, x.shape, x.wmma, FragOf::B, x.b_ty, f);
            let c = gather(regs, &x.c, x.shape, x.wmma, FragOf::C, x.c_ty, f);
            for i in 0..mm {
                for j in 0..nn {
                    let mut acc = c[i * nn + j];
                    for k in 0..kk {
                        acc = a[i * kk + k].mul_add(b[k * nn + j], acc);
                    }
                    out[i * nn + j] = match x.d_ty {
                        MmaTy::F16 => float::f64_to_small(acc as f64, float::F16) as u64,
                        _ => acc.to_bits() as u64,
                    };
                }
            }
        }
    }
    scatter(regs, m, &x.d, x.shape, x.wmma, x.d_ty, &out);
}

/// An f32 rounded to tf32 (10 explicit mantissa bits): to nearest with ties away from zero
/// (`rna`), to nearest even (`rn`) or toward zero (`rz`); `.satfinite` turns infinities into
/// the largest finite tf32 and NaN into the canonical NaN, `.relu` negatives into +0.
pub(super) fn tf32(bits: u32, rnd: Rnd, relu: bool, satfinite: bool) -> u32 {
    let x = f32::from_bits(bits);
    if x.is_nan() {
        return 0x7fff_ffff;
    }
    if relu && (x < 0.0 || bits == 0x8000_0000) {
        return 0;
    }
    let add = match rnd {
        Rnd::Rna => 0x1000,
        Rnd::Rn => 0xfff + ((bits >> 13) & 1),
        _ => 0,
    };
    // Sign and magnitude: rounding the magnitude's bits rounds the value; a carry into the
    // exponent is the next binade (or infinity).
    let r = if x.is_infinite() { bits } else { (bits + add) & 0xffff_e000 };
    if satfinite && f32::from_bits(r).is_infinite() {
        return (r & 0x8000_0000) | 0x7f7f_e000;
    }
    r
}

/// `movmatrix.sync.aligned.m8n8.trans.b16`: lane `l` holds row `l/4`, columns `2(l%4)` and
/// `2(l%4)+1` of an 8x8 matrix (low half first); the result is the transpose, held alike.
#[inline(never)]
pub(super) fn movmatrix(regs: &mut Regs, m: u32, d: u32, a: Src) {
    let av = fetch(regs, a);
    let at = |row: usize, col: usize| (av[row * 4 + col / 2] >> (16 * (col % 2) as u32)) & 0xffff;
    let r: [u64; LANES] = std::array::from_fn(|l| {
        let (row, c0) = (l / 4, 2 * (l % 4));
        at(c0, row) | at(c0 + 1, row) << 16
    });
    store(regs, m, d, &r);
}

impl BlockRunner<'_> {
    /// `wmma.load` / `wmma.store`, each lane reaching its own elements through its own
    /// address and stride.
    #[inline(never)]
    pub(super) fn wmma_mem(&mut self, w: &mut Warp, m: u32, x: &WmmaMem) -> Result<(), (usize, Fault)> {
        let (rows, cols) = dims(x.shape, x.of);
        let per = rows * cols / LANES;
        let (pr, eb) = (per_reg(x.ty), x.ty.bits());
        let esize = (eb / 8) as u64;
        let bv = fetch(&w.regs, x.base);
        let sv = x.stride.map(|s| fetch(&w.regs, s));
        for lane in 0..LANES {
            if m >> lane & 1 == 0 {
                continue;
            }
            let stride = sv.map_or(if x.col { rows } else { cols } as u64, |s| s[lane] & 0xffff_ffff);
            let base = bv[lane].wrapping_add(x.off as u64);
            let addr = |i: usize| {
                let (r, c) = pos(x.shape, true, x.of, x.ty, lane, i);
                let (major, minor) = if x.col { (c, r) } else { (r, c) };
                base.wrapping_add((major as u64 * stride + minor as u64).wrapping_mul(esize))
            };
            if x.load {
                let mut vals = [0u64; 16];
                for i in 0..x.regs.len() * pr {
                    let v = self.load(&w.local, lane, x.sp, addr(i % per), esize as u8).map_err(|f| (lane, f))?;
                    vals[i / pr] |= if pr == 1 { v } else { v << ((i % pr) as u32 * eb) };
                }
                for (k, r) in x.regs.iter().enumerate() {
                    if let Src::R(r) = r {
                        w.regs.set(*r, lane, vals[k]);
                    }
                }
            } else {
                let vals: Vec<u64> = x.regs.iter().map(|s| match *s {
                    Src::R(r) => w.regs.get(r, lane),
                    Src::C(c) => c,
                }).collect();
                for i in 0..per {
                    let v = element(&vals, x.ty, i);
                    self.store(&mut w.local, lane, x.sp, addr(i), esize as u8, v).map_err(|f| (lane, f))?;
                }
            }
        }
        Ok(())
    }

    /// `ldmatrix` / `stmatrix`: for matrix `j`, lane `8j + r` gives the address of row `r`
    /// (8 b16 elements, 16 bytes); lane `l`'s register `j` holds row `l/4`, columns `2(l%4)`
    /// and `2(l%4)+1` (with `.trans`, those of the transposed matrix).
    #[inline(never)]
    pub(super) fn matrix_mem(&mut self, w: &mut Warp, m: u32, x: &MatrixMem) -> Result<(), (usize, Fault)> {
        let bv = fetch(&w.regs, x.base);
        let row_addr = |j: usize, r: usize| bv[8 * j + r].wrapping_add(x.off as u64);
        for j in 0..x.regs.len() {
            for r in 0..8 {
                let a = row_addr(j, r);
                if a % 16 != 0 {
                    return Err((8 * j + r, Fault::Misaligned { addr: a }));
                }
            }
        }
        if x.load {
            // The matrices, as 8 rows of 8 elements each.
            let mut mat = [[[0u64; 8]; 8]; 4];
            for (j, mj) in mat.iter_mut().enumerate().take(x.regs.len()) {
                for (r, row) in mj.iter_mut().enumerate() {
                    for (c, e) in row.iter_mut().enumerate() {
                        *e = self.load(&w.local, 8 * j + r, x.sp, row_addr(j, r) + 2 * c as u64, 2).map_err(|f| (8 * j + r, f))?;
                    }
                }
            }
            for (j, d) in x.regs.iter().enumerate() {
                let Src::R(d) = *d else { continue };
                let v: [u64; LANES] = std::array::from_fn(|l| {
                    let (row, c0) = (l / 4, 2 * (l % 4));
                    let mj = &mat[j];
                    if x.trans {
                        mj[c0][row] | mj[c0 + 1][row] << 16
                    } else {
                        mj[row][c0] | mj[row][c0 + 1] << 16
                    }
                });
                store(&mut w.regs, m, d, &v);
            }
        } else {
            for (j, s) in x.regs.iter().enumerate() {
                let v = fetch(&w.regs, *s);
                for l in 0..LANES {
                    let (row, c0) = (l / 4, 2 * (l % 4));
                    for e in 0..2 {
                        let (r, c) = if x.trans { (c0 + e, row) } else { (row, c0 + e) };
                        let h = (v[l] >> (16 * e as u32)) & 0xffff;
                        self.store(&mut w.local, 8 * j + r, x.sp, row_addr(j, r) + 2 * c as u64, 2, h).map_err(|f| (8 * j + r, f))?;
                    }
                }
            }
        }
        Ok(())
    }
}
