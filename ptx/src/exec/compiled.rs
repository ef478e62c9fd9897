//! The compiled tier: at load time each instruction of the common subset (integer and
//! f32/f64 arithmetic, compares, `selp`, `mov`, the exact `cvt`s) is turned into a lane
//! kernel specialised for its operation, width and modifiers, and straight-line runs of
//! instructions between control points are executed as one unit. A run costs one dispatch
//! per warp-instruction (no per-lane calls, no i128 arithmetic), and on hosts with AVX2 and
//! FMA the run executor is compiled for them, so the lane loops are vector code.
//!
//! The interpreter stays the reference: every instruction the tier does not specialise runs
//! through the interpreter's own `exec` inside a run ([`Fast::Interp`]), and control
//! (`bra`, `exit`, barriers, warp-synchronous waits) and polling accesses never enter a run,
//! so divergence, reconvergence, fault reporting, the step counter that checks the time limit
//! and cancellation, and a cooperative warp's turns are the interpreter's, unchanged. Each
//! specialised kernel computes what the interpreter's code for the same op computes (the
//! differential tests run every kernel test both ways and compare memory and faults).

use super::*;

/// One instruction as the tier runs it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Fast {
    /// Not in a run (control, polling): the interpreter's main loop handles it.
    Outside,
    /// In a run, executed by the interpreter's per-op code.
    Interp,
    Mov { mk: u64, d: u32, a: Opd },
    Int { f: IntF, mk: u64, bits: u8, d: u32, a: Opd, b: Opd },
    Mad { f: MadF, mk: u64, bits: u8, d: u32, a: Opd, b: Opd, c: Opd },
    F32 { f: FF, fm: FMod, d: u32, a: Opd, b: Opd },
    Fma32 { fm: FMod, d: u32, a: Opd, b: Opd, c: Opd },
    F64 { f: FF, d: u32, a: Opd, b: Opd },
    Fma64 { d: u32, a: Opd, b: Opd, c: Opd },
    /// neg/abs/not as bit operations (`xor`, `and` with the constant).
    Bits { xor: u64, and: u64, d: u32, a: Opd },
    SetpI { cmp: Cmp, bits: u8, signed: bool, d: u32, d2: u32, a: Opd, b: Opd },
    SetpF { cmp: Cmp, f64: bool, d: u32, d2: u32, a: Opd, b: Opd },
    Selp { d: u32, a: Opd, b: Opd, p: Opd },
    /// cvt.rn (or no rounding) from a 32- or 64-bit integer to f32 (or f64).
    CvtIF { f64: bool, bits: u8, signed: bool, d: u32, a: Opd },
    /// Integer to integer without `.sat`.
    CvtII { to_mk: u64, from_bits: u8, signed: bool, d: u32, a: Opd },
    // The commonest kernels where every operand is a 32-bit register or a constant, chosen
    // at load time so that executing one is a single dispatch: 32-bit integer add, sub,
    // mul.lo, and, or, xor, mad.lo, mov, and f32 add, sub, mul, fma without modifiers.
    AddN { d: u32, a: Opd, b: Opd },
    SubN { d: u32, a: Opd, b: Opd },
    MulN { d: u32, a: Opd, b: Opd },
    AndN { d: u32, a: Opd, b: Opd },
    OrN { d: u32, a: Opd, b: Opd },
    XorN { d: u32, a: Opd, b: Opd },
    MadN { d: u32, a: Opd, b: Opd, c: Opd },
    MovN { d: u32, a: Opd },
    FAddN { d: u32, a: Opd, b: Opd },
    FSubN { d: u32, a: Opd, b: Opd },
    FMulN { d: u32, a: Opd, b: Opd },
    FmaN { d: u32, a: Opd, b: Opd, c: Opd },
    /// `cvt.rn.f32.u32` / `.s32`.
    CvtFUN { d: u32, a: Opd },
    CvtFSN { d: u32, a: Opd },
    /// A 32-bit integer compare.
    SetpN { cmp: Cmp, signed: bool, d: u32, d2: u32, a: Opd, b: Opd },
}

/// The single-dispatch form of `f` where it has one ([`Fast::AddN`] and the others).
fn flatten(f: Fast) -> Fast {
    match f {
        Fast::Int { f: IntF::Add, bits: 32, d, a, b, .. } if narrow(d, &[a, b]) => Fast::AddN { d, a, b },
        Fast::Int { f: IntF::Sub, bits: 32, d, a, b, .. } if narrow(d, &[a, b]) => Fast::SubN { d, a, b },
        Fast::Int { f: IntF::MulLo, bits: 32, d, a, b, .. } if narrow(d, &[a, b]) => Fast::MulN { d, a, b },
        Fast::Int { f: IntF::And, bits: 32, d, a, b, .. } if narrow(d, &[a, b]) => Fast::AndN { d, a, b },
        Fast::Int { f: IntF::Or, bits: 32, d, a, b, .. } if narrow(d, &[a, b]) => Fast::OrN { d, a, b },
        Fast::Int { f: IntF::Xor, bits: 32, d, a, b, .. } if narrow(d, &[a, b]) => Fast::XorN { d, a, b },
        Fast::Mad { f: MadF::Lo, bits: 32, d, a, b, c, .. } if narrow(d, &[a, b, c]) => Fast::MadN { d, a, b, c },
        Fast::Mov { mk: 0xffff_ffff, d, a } if narrow(d, &[a]) => Fast::MovN { d, a },
        Fast::F32 { f, fm, d, a, b } if fm == FMod::default() && narrow(d, &[a, b]) => match f {
            FF::Add => Fast::FAddN { d, a, b },
            FF::Sub => Fast::FSubN { d, a, b },
            FF::Mul => Fast::FMulN { d, a, b },
            FF::Div => Fast::F32 { f, fm, d, a, b },
        },
        Fast::Fma32 { fm, d, a, b, c } if fm == FMod::default() && narrow(d, &[a, b, c]) => Fast::FmaN { d, a, b, c },
        Fast::CvtIF { f64: false, bits: 32, signed, d, a } if narrow(d, &[a]) => {
            if signed {
                Fast::CvtFSN { d, a }
            } else {
                Fast::CvtFUN { d, a }
            }
        }
        Fast::SetpI { cmp, bits: 32, signed, d, d2, a, b } if narrow_preds(d, d2, &[a, b]) => Fast::SetpN { cmp, signed, d, d2, a, b },
        f => f,
    }
}



#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IntF {
    Add,
    Sub,
    MulLo,
    MulWideS,
    MulWideU,
    And,
    Or,
    Xor,
    Shl,
    ShrS,
    ShrU,
    MinS,
    MinU,
    MaxS,
    MaxU,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MadF {
    Lo,
    WideS,
    WideU,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FF {
    Add,
    Sub,
    Mul,
    Div,
}

/// A kernel's source operand: a register's row, or a row of [`Compiled::consts`] holding a
/// constant in every lane (built once at load time, not broadcast at every execution).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Opd {
    R(u32),
    K(u32),
}

/// The constants of a kernel's operands, a [`LANES`]-wide row each, interned: as 64-bit
/// values, and their low halves for the kernels of 32-bit operations.
#[derive(Default)]
struct Consts {
    rows: Vec<u64>,
    rows32: Vec<u32>,
    index: std::collections::HashMap<u64, u32>,
}

impl Consts {
    fn opd(&mut self, s: Src) -> Opd {
        match s {
            Src::R(r) => Opd::R(r),
            Src::C(c) => Opd::K(*self.index.entry(c).or_insert_with(|| {
                let k = (self.rows.len() / LANES) as u32;
                self.rows.extend_from_slice(&[c; LANES]);
                self.rows32.extend_from_slice(&[c as u32; LANES]);
                k
            })),
        }
    }
}

/// No predicate destination.
const NO_REG: u32 = u32::MAX;

/// A kernel's compiled form: per pc, its [`Fast`] form and the end of the run starting there.
#[derive(Debug, Clone, Default)]
pub struct Compiled {
    pub(crate) ops: Vec<Fast>,
    /// Per pc: the instruction's guard, beside its kernel (a run reads no `Inst` but for the
    /// instructions the interpreter's code runs).
    pub(crate) guards: Vec<Option<(u32, bool)>>,
    /// Per pc: the first pc after the run that starts at pc (== pc when pc is outside runs).
    /// A run never contains a join point past its first instruction, so lanes waiting to
    /// meet there are met by the interpreter's main loop.
    pub(crate) run_end: Vec<u32>,
    /// Instructions with a specialised kernel.
    pub specialised: usize,
    /// The rows [`Opd::K`] names, and their low halves.
    pub(crate) consts: Vec<u64>,
    pub(crate) consts32: Vec<u32>,
    /// The host has AVX2, FMA and the bit-manipulation extensions: runs use the executor
    /// compiled for them.
    vector: bool,
}

impl Compiled {
    pub fn build(name: &str, insts: &[Inst], joins: &[bool]) -> Compiled {
        let mut consts = Consts::default();
        let ops: Vec<Fast> = insts.iter().map(|i| flatten(compile(&i.op, &mut consts))).collect();
        let guards = insts.iter().map(|i| i.guard).collect();
        let n = ops.len();
        let mut run_end = vec![0u32; n];
        for pc in (0..n).rev() {
            run_end[pc] = if ops[pc] == Fast::Outside {
                pc as u32
            } else if pc + 1 < n && ops[pc + 1] != Fast::Outside && !joins.get(pc + 1).copied().unwrap_or(true) {
                run_end[pc + 1]
            } else {
                pc as u32 + 1
            };
        }
        let specialised = ops.iter().filter(|o| !matches!(o, Fast::Outside | Fast::Interp)).count();
        let first_interp = insts.iter().zip(&ops).find(|(_, o)| **o == Fast::Interp).map(|(i, _)| (i.line, op_name(&i.op)));
        tracing::debug!(
            kernel = name,
            instructions = n,
            specialised,
            first_unspecialised = ?first_interp,
            "compiled tier: instructions without a specialised kernel run on the interpreter's code"
        );
        Compiled { ops, guards, run_end, specialised, consts: consts.rows, consts32: consts.rows32, vector: vector_host() }
    }

    /// Bytes it holds, for callers that bound what they keep.
    pub fn bytes(&self) -> usize {
        self.ops.len() * (std::mem::size_of::<Fast>() + std::mem::size_of::<Option<(u32, bool)>>() + 4) + self.consts.len() * 12
    }

    /// Replaces pc's kernel: for tests that check a wrong kernel is caught.
    #[cfg(test)]
    pub(crate) fn set(&mut self, pc: usize, f: Fast) {
        self.ops[pc] = f;
    }
}

fn op_name(op: &Op) -> String {
    let s = format!("{op:?}");
    s.split([' ', '{', '(']).next().unwrap_or("").to_string()
}

fn vector_host() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        has!("avx2") && has!("fma") && has!("popcnt") && has!("bmi1") && has!("bmi2") && has!("lzcnt")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn compile(op: &Op, k: &mut Consts) -> Fast {
    match *op {
        Op::Bra { .. } | Op::Exit | Op::Bar { .. } | Op::WarpSync { .. } | Op::MbarWait(_) => Fast::Outside,
        ref o if polls(o) => Fast::Outside,
        Op::Mov { bits, d, a } => Fast::Mov { mk: width_mask(bits), d, a: k.opd(a) },
        Op::I2 { f, bits, signed, d, a, b } => {
            let f = match (f, signed) {
                (I2::Add, _) => IntF::Add,
                (I2::Sub, _) => IntF::Sub,
                (I2::MulLo, _) => IntF::MulLo,
                (I2::MulWide, true) => IntF::MulWideS,
                (I2::MulWide, false) => IntF::MulWideU,
                (I2::And, _) => IntF::And,
                (I2::Or, _) => IntF::Or,
                (I2::Xor, _) => IntF::Xor,
                (I2::Shl, _) => IntF::Shl,
                (I2::Shr, true) => IntF::ShrS,
                (I2::Shr, false) => IntF::ShrU,
                (I2::Min, true) => IntF::MinS,
                (I2::Min, false) => IntF::MinU,
                (I2::Max, true) => IntF::MaxS,
                (I2::Max, false) => IntF::MaxU,
                _ => return Fast::Interp,
            };
            Fast::Int { f, mk: width_mask(bits), bits, d, a: k.opd(a), b: k.opd(b) }
        }
        Op::I3 { f, bits, signed, d, a, b, c } => {
            let f = match (f, signed) {
                (I3::MadLo, _) => MadF::Lo,
                (I3::MadWide, true) => MadF::WideS,
                (I3::MadWide, false) => MadF::WideU,
                _ => return Fast::Interp,
            };
            Fast::Mad { f, mk: width_mask(bits), bits, d, a: k.opd(a), b: k.opd(b), c: k.opd(c) }
        }
        Op::I1 { f: I1::Not, bits, d, a, .. } => Fast::Bits { xor: u64::MAX, and: width_mask(bits), d, a: k.opd(a) },
        Op::F2 { f, t, m, d, a, b } if matches!(t, FT::F32 | FT::F64) && !m.relu => {
            let f = match f {
                F2::Add => FF::Add,
                F2::Sub => FF::Sub,
                F2::Mul => FF::Mul,
                F2::Div => FF::Div,
                _ => return Fast::Interp,
            };
            if t == FT::F32 {
                Fast::F32 { f, fm: m, d, a: k.opd(a), b: k.opd(b) }
            } else {
                Fast::F64 { f, d, a: k.opd(a), b: k.opd(b) }
            }
        }
        Op::Fma { t: FT::F32, m, d, a, b, c } if !m.relu => Fast::Fma32 { fm: m, d, a: k.opd(a), b: k.opd(b), c: k.opd(c) },
        Op::Fma { t: FT::F64, d, a, b, c, .. } => Fast::Fma64 { d, a: k.opd(a), b: k.opd(b), c: k.opd(c) },
        Op::F1 { f: F1::Neg, t: FT::F64, d, a, .. } => Fast::Bits { xor: 1 << 63, and: u64::MAX, d, a: k.opd(a) },
        Op::F1 { f: F1::Abs, t: FT::F64, d, a, .. } => Fast::Bits { xor: 0, and: !(1 << 63), d, a: k.opd(a) },
        Op::F1 { f: F1::Neg, t: FT::F32, m, d, a } if !m.ftz => Fast::Bits { xor: 0x8000_0000, and: 0xffff_ffff, d, a: k.opd(a) },
        Op::F1 { f: F1::Abs, t: FT::F32, m, d, a } if !m.ftz => Fast::Bits { xor: 0, and: 0x7fff_ffff, d, a: k.opd(a) },
        Op::Setp { cmp, t, d, d2, a, b, comb: None } => {
            let (d, d2) = (d.unwrap_or(NO_REG), d2.unwrap_or(NO_REG));
            match t {
                CmpTy::Int { bits, signed } if bits == 32 || bits == 64 => Fast::SetpI { cmp, bits, signed, d, d2, a: k.opd(a), b: k.opd(b) },
                CmpTy::Float(FT::F32) => Fast::SetpF { cmp, f64: false, d, d2, a: k.opd(a), b: k.opd(b) },
                CmpTy::Float(FT::F64) => Fast::SetpF { cmp, f64: true, d, d2, a: k.opd(a), b: k.opd(b) },
                _ => Fast::Interp,
            }
        }
        Op::Selp { d, a, b, p } => Fast::Selp { d, a: k.opd(a), b: k.opd(b), p: k.opd(p) },
        // The interpreter's window arithmetic: global addresses are generic ones.
        Op::Cvta { to_generic, sp, d, a } => match sp {
            Space::Shared | Space::Local | Space::KParam => {
                let win = match sp {
                    Space::Shared => SHARED_WINDOW,
                    Space::Local => LOCAL_WINDOW,
                    _ => KPARAM_WINDOW,
                };
                Fast::Int { f: if to_generic { IntF::Add } else { IntF::Sub }, mk: u64::MAX, bits: 64, d, a: k.opd(a), b: k.opd(Src::C(win)) }
            }
            _ => Fast::Mov { mk: u64::MAX, d, a: k.opd(a) },
        },
        Op::Cvt { to: CvtTy::Float(ft), from: CvtTy::Int { bits, signed }, rnd: Rnd::None | Rnd::Rn, d, a, .. }
            if matches!(ft, FT::F32 | FT::F64) && (bits == 32 || bits == 64) =>
        {
            Fast::CvtIF { f64: ft == FT::F64, bits, signed, d, a: k.opd(a) }
        }
        Op::Cvt { to: CvtTy::Int { bits: tb, .. }, from: CvtTy::Int { bits: fb, signed }, sat: false, d, a, .. } => {
            Fast::CvtII { to_mk: width_mask(tb), from_bits: fb, signed, d, a: k.opd(a) }
        }
        _ => Fast::Interp,
    }
}

/// An f32 operand, flushed under `.ftz` (as the interpreter's `float2`).
#[inline(always)]
fn f32_in(x: u64, ftz: bool) -> f32 {
    let v = f32::from_bits(x as u32);
    if ftz {
        ftz32(v)
    } else {
        v
    }
}

#[inline(always)]
fn fcmp<T: PartialOrd + Copy>(cmp: Cmp, x: T, y: T, nan: bool) -> bool {
    match cmp {
        Cmp::Eq => x == y,
        Cmp::Ne => !nan && x != y,
        Cmp::Lt => x < y,
        Cmp::Le => x <= y,
        Cmp::Gt => x > y,
        Cmp::Ge => x >= y,
        Cmp::Equ => nan || x == y,
        Cmp::Neu => nan || x != y,
        Cmp::Ltu => nan || x < y,
        Cmp::Leu => nan || x <= y,
        Cmp::Gtu => nan || x > y,
        Cmp::Geu => nan || x >= y,
        Cmp::Num => !nan,
        Cmp::Nan => nan,
    }
}

#[inline(always)]
fn icmp<T: Ord + Copy>(cmp: Cmp, x: T, y: T) -> bool {
    match cmp {
        Cmp::Eq | Cmp::Equ => x == y,
        Cmp::Ne | Cmp::Neu => x != y,
        Cmp::Lt | Cmp::Ltu => x < y,
        Cmp::Le | Cmp::Leu => x <= y,
        Cmp::Gt | Cmp::Gtu => x > y,
        Cmp::Ge | Cmp::Geu => x >= y,
        Cmp::Num => true,
        Cmp::Nan => false,
    }
}

/// Which of less, equal and greater an integer compare accepts, as [`icmp`] decides.
fn int_cmp_accepts(cmp: Cmp) -> (bool, bool, bool) {
    match cmp {
        Cmp::Eq | Cmp::Equ => (false, true, false),
        Cmp::Ne | Cmp::Neu => (true, false, true),
        Cmp::Lt | Cmp::Ltu => (true, false, false),
        Cmp::Le | Cmp::Leu => (true, true, false),
        Cmp::Gt | Cmp::Gtu => (false, false, true),
        Cmp::Ge | Cmp::Geu => (false, true, true),
        Cmp::Num => (true, true, true),
        Cmp::Nan => (false, false, false),
    }
}

/// Expands `$go!(Cmp::X)` for the compare kind, so that the lane loop has it as a constant.
macro_rules! by_cmp {
    ($cmp:expr, $go:ident) => {
        match $cmp {
            Cmp::Eq => $go!(Cmp::Eq),
            Cmp::Ne => $go!(Cmp::Ne),
            Cmp::Lt => $go!(Cmp::Lt),
            Cmp::Le => $go!(Cmp::Le),
            Cmp::Gt => $go!(Cmp::Gt),
            Cmp::Ge => $go!(Cmp::Ge),
            Cmp::Equ => $go!(Cmp::Equ),
            Cmp::Neu => $go!(Cmp::Neu),
            Cmp::Ltu => $go!(Cmp::Ltu),
            Cmp::Leu => $go!(Cmp::Leu),
            Cmp::Gtu => $go!(Cmp::Gtu),
            Cmp::Geu => $go!(Cmp::Geu),
            Cmp::Num => $go!(Cmp::Num),
            Cmp::Nan => $go!(Cmp::Nan),
        }
    };
}

/// Args of a run: the warp's pc and step counter (as the interpreter's main loop keeps
/// them), the group's lanes and the next other group's pc.
pub(super) struct At<'x> {
    pub pc: &'x mut u32,
    pub steps: &'x mut u32,
    pub mask: u32,
    pub other: u32,
}

/// The lanes whose predicate register `g` is true: with AVX2's compare and move-mask where
/// `V` says the caller is the vector executor (the portable loop compiles to a lane-by-lane
/// extraction).
#[inline(always)]
fn guard_mask<const V: bool>(regs: &Regs, g: u32) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if V && g & WIDE == 0 {
        let at = g as usize * LANES;
        let row = &regs.narrow[at..at + LANES];
        // SAFETY: `V` is only set inside `run_vector`, which runs on hosts with AVX2; the row
        // holds LANES values (sliced above), read as four vectors of eight.
        return unsafe { nonzero_mask_avx2(row.as_ptr()) };
    }
    pred_mask(regs, g)
}

/// Bit `l` set where `row[l] != 0`, for a row of [`LANES`] values.
///
/// # Safety
/// The host has AVX2, and `row` points to [`LANES`] readable values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn nonzero_mask_avx2(row: *const u32) -> u32 {
    use std::arch::x86_64::*;
    let zero = _mm256_setzero_si256();
    let mut zeros = 0u32;
    for k in 0..LANES / 8 {
        let v = _mm256_loadu_si256(row.add(k * 8) as *const __m256i);
        let z = _mm256_castsi256_ps(_mm256_cmpeq_epi32(v, zero));
        zeros |= (_mm256_movemask_ps(z) as u32) << (k * 8);
    }
    !zeros
}

/// Whether the main loop's next step is the one that checks the time limit.
#[inline(always)]
fn check_due(steps: u32) -> bool {
    steps.wrapping_add(1) & (STEPS_PER_TURN - 1) == 0
}

impl BlockRunner<'_> {
    /// Runs the group from `*at.pc`, the start of a run whose main-loop step is counted, for
    /// as long as the interpreter's main loop would do nothing but execute instructions of
    /// runs and branches the whole group takes (or none of it does): it returns where the
    /// main loop has anything else to do (the other lanes' pc, a join point, control, the
    /// step that checks the time limit), with `*at.pc` at the first instruction not run.
    /// A fault comes back with the pc it happened at.
    pub(super) fn run_compiled(&mut self, w: &mut Warp, at: At, out: &mut Vec<u8>, count: &mut u64) -> Result<(), (u32, usize, Fault)> {
        #[cfg(target_arch = "x86_64")]
        if self.sh.prog.compiled.vector {
            // SAFETY: the host has these extensions (checked when the program was compiled).
            return unsafe { self.run_vector(w, at, out, count) };
        }
        self.run_group::<false>(w, at, out, count)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,popcnt,bmi1,bmi2,lzcnt")]
    unsafe fn run_vector(&mut self, w: &mut Warp, at: At, out: &mut Vec<u8>, count: &mut u64) -> Result<(), (u32, usize, Fault)> {
        self.run_group::<true>(w, at, out, count)
    }

    /// `V`: running in [`Self::run_vector`], where AVX2 may be used directly.
    #[inline(always)]
    fn run_group<const V: bool>(&mut self, w: &mut Warp, at: At, out: &mut Vec<u8>, count: &mut u64) -> Result<(), (u32, usize, Fault)> {
        let prog: &Program = self.sh.prog;
        let c = &prog.compiled;
        let (mask, other) = (at.mask, at.other);
        let joins = |w: &Warp, pc: u32| !w.conv.is_empty() && prog.joins.get(pc as usize).copied().unwrap_or(false);
        let in_run = |pc: u32| c.run_end.get(pc as usize).is_some_and(|&e| e > pc);
        loop {
            let pc = *at.pc;
            // Cut where the interpreter's loop would do more than execute: at the other
            // lanes' pc, and before the step that checks the time limit.
            let room = STEPS_PER_TURN - (*at.steps & (STEPS_PER_TURN - 1));
            let end = c.run_end[pc as usize].min(other).min(pc.saturating_add(room));
            self.run_insts::<V>(w, pc, end, mask, out, count)?;
            *at.steps = at.steps.wrapping_add(end - pc - 1);
            *at.pc = end;
            let pc = end;
            if pc >= other {
                return Ok(());
            }
            let Some(Inst { op: Op::Bra { target }, guard, .. }) = prog.insts.get(pc as usize) else { return Ok(()) };
            if check_due(*at.steps) || joins(w, pc) {
                return Ok(());
            }
            let mut active = mask;
            if let Some((g, neg)) = *guard {
                let p = guard_mask::<V>(&w.regs, g);
                active &= if neg { !p } else { p };
            }
            let next = if active == mask && *target < other {
                *target
            } else if active == 0 && pc + 1 < other {
                pc + 1
            } else {
                // The branch divides the group: the main loop's.
                return Ok(());
            };
            *at.steps = at.steps.wrapping_add(1);
            *count += active.count_ones() as u64;
            *at.pc = next;
            if check_due(*at.steps) || joins(w, next) || !in_run(next) {
                return Ok(());
            }
            *at.steps = at.steps.wrapping_add(1);
        }
    }

    #[inline(always)]
    fn run_insts<const V: bool>(&mut self, w: &mut Warp, pc: u32, end: u32, mask: u32, out: &mut Vec<u8>, count: &mut u64) -> Result<(), (u32, usize, Fault)> {
        let prog: &Program = self.sh.prog;
        // The thread-instructions of the run, added to `count` once, as it ends or faults.
        let mut n = 0u64;
        // Made again after an instruction that the interpreter's code runs (it takes the warp).
        let mut rows = Rows::new(&mut w.regs, &prog.compiled);
        for at in pc..end {
            let mut m = mask;
            if let Some((g, neg)) = prog.compiled.guards[at as usize] {
                let p = guard_mask::<V>(&w.regs, g);
                m &= if neg { !p } else { p };
            }
            n += m.count_ones() as u64;
            if m == 0 {
                continue;
            }
            let regs = &rows;
            match prog.compiled.ops[at as usize] {
                Fast::Outside => unreachable!("runs hold no control instruction"),
                Fast::Interp => {
                    let r = self.exec(w, &prog.insts[at as usize].op, m, out);
                    rows = Rows::new(&mut w.regs, &prog.compiled);
                    if let Err((l, f)) = r {
                        *count += n;
                        return Err((at, l, f));
                    }
                }
                Fast::AddN { d, a, b } => lanes2n(regs, m, d, a, b, |x, y| x.wrapping_add(y)),
                Fast::SubN { d, a, b } => lanes2n(regs, m, d, a, b, |x, y| x.wrapping_sub(y)),
                Fast::MulN { d, a, b } => lanes2n(regs, m, d, a, b, |x, y| x.wrapping_mul(y)),
                Fast::AndN { d, a, b } => lanes2n(regs, m, d, a, b, |x, y| x & y),
                Fast::OrN { d, a, b } => lanes2n(regs, m, d, a, b, |x, y| x | y),
                Fast::XorN { d, a, b } => lanes2n(regs, m, d, a, b, |x, y| x ^ y),
                Fast::MadN { d, a, b, c } => lanes3n(regs, m, d, a, b, c, |x, y, z| x.wrapping_mul(y).wrapping_add(z)),
                Fast::MovN { d, a } => lanes1n(regs, m, d, a, |x| x),
                Fast::FAddN { d, a, b } => lanes2n(regs, m, d, a, b, |x, y| canon32(f32::from_bits(x) + f32::from_bits(y)) as u32),
                Fast::FSubN { d, a, b } => lanes2n(regs, m, d, a, b, |x, y| canon32(f32::from_bits(x) - f32::from_bits(y)) as u32),
                Fast::FMulN { d, a, b } => lanes2n(regs, m, d, a, b, |x, y| canon32(f32::from_bits(x) * f32::from_bits(y)) as u32),
                Fast::FmaN { d, a, b, c } => {
                    lanes3n(regs, m, d, a, b, c, |x, y, z| canon32(f32::from_bits(x).mul_add(f32::from_bits(y), f32::from_bits(z))) as u32)
                }
                Fast::CvtFUN { d, a } => lanes1n(regs, m, d, a, |x| (x as f32).to_bits()),
                Fast::CvtFSN { d, a } => lanes1n(regs, m, d, a, |x| (x as i32 as f32).to_bits()),
                Fast::SetpN { cmp, signed, d, d2, a, b } => {
                    // The compare as which of less, equal and greater it accepts: one kernel per
                    // signedness instead of one per compare kind (the same answers as `icmp`).
                    let (lt, eq, gt) = int_cmp_accepts(cmp);
                    if signed {
                        preds2n(regs, m, d, d2, a, b, |x, y| {
                            let (x, y) = (x as i32, y as i32);
                            ((x < y) & lt) | ((x == y) & eq) | ((x > y) & gt)
                        })
                    } else {
                        preds2n(regs, m, d, d2, a, b, |x, y| ((x < y) & lt) | ((x == y) & eq) | ((x > y) & gt))
                    }
                }
                Fast::Mov { mk, d, a } => lanes1(regs, m, d, a, |x| x & mk),
                Fast::Int { f, mk, bits, d, a, b } => int_lanes(regs, m, f, mk, bits, d, a, b),
                Fast::Mad { f, mk, bits, d, a, b, c } => {
                    let sx = |x: u64| sign_extend(x & mk, bits as u32) as i64;
                    match f {
                        MadF::Lo if bits == 32 && narrow(d, &[a, b, c]) => lanes3n(regs, m, d, a, b, c, |x, y, z| x.wrapping_mul(y).wrapping_add(z)),
                        MadF::Lo => lanes3(regs, m, d, a, b, c, |x, y, z| x.wrapping_mul(y).wrapping_add(z) & mk),
                        MadF::WideS => {
                            lanes3(regs, m, d, a, b, c, |x, y, z| (sx(x).wrapping_mul(sx(y)) as u64).wrapping_add(z) & width_mask(bits * 2))
                        }
                        MadF::WideU => lanes3(regs, m, d, a, b, c, |x, y, z| (x & mk).wrapping_mul(y & mk).wrapping_add(z) & width_mask(bits * 2)),
                    }
                }
                Fast::F32 { f, fm, d, a, b } => {
                    let z = fm.ftz;
                    let n = narrow(d, &[a, b]);
                    let g = |x: u32| f32::from_bits(x);
                    match (fm == FMod::default(), n) {
                        (true, true) => match f {
                            FF::Add => lanes2n(regs, m, d, a, b, |x, y| canon32(g(x) + g(y)) as u32),
                            FF::Sub => lanes2n(regs, m, d, a, b, |x, y| canon32(g(x) - g(y)) as u32),
                            FF::Mul => lanes2n(regs, m, d, a, b, |x, y| canon32(g(x) * g(y)) as u32),
                            FF::Div => lanes2n(regs, m, d, a, b, |x, y| canon32(g(x) / g(y)) as u32),
                        },
                        (true, false) => match f {
                            FF::Add => lanes2(regs, m, d, a, b, |x, y| canon32(f32_in(x, false) + f32_in(y, false))),
                            FF::Sub => lanes2(regs, m, d, a, b, |x, y| canon32(f32_in(x, false) - f32_in(y, false))),
                            FF::Mul => lanes2(regs, m, d, a, b, |x, y| canon32(f32_in(x, false) * f32_in(y, false))),
                            FF::Div => lanes2(regs, m, d, a, b, |x, y| canon32(f32_in(x, false) / f32_in(y, false))),
                        },
                        (false, true) => match f {
                            FF::Add => lanes2n(regs, m, d, a, b, |x, y| fin32(f32_in(x as u64, z) + f32_in(y as u64, z), fm) as u32),
                            FF::Sub => lanes2n(regs, m, d, a, b, |x, y| fin32(f32_in(x as u64, z) - f32_in(y as u64, z), fm) as u32),
                            FF::Mul => lanes2n(regs, m, d, a, b, |x, y| fin32(f32_in(x as u64, z) * f32_in(y as u64, z), fm) as u32),
                            FF::Div => lanes2n(regs, m, d, a, b, |x, y| fin32(f32_in(x as u64, z) / f32_in(y as u64, z), fm) as u32),
                        },
                        (false, false) => match f {
                            FF::Add => lanes2(regs, m, d, a, b, |x, y| fin32(f32_in(x, z) + f32_in(y, z), fm)),
                            FF::Sub => lanes2(regs, m, d, a, b, |x, y| fin32(f32_in(x, z) - f32_in(y, z), fm)),
                            FF::Mul => lanes2(regs, m, d, a, b, |x, y| fin32(f32_in(x, z) * f32_in(y, z), fm)),
                            FF::Div => lanes2(regs, m, d, a, b, |x, y| fin32(f32_in(x, z) / f32_in(y, z), fm)),
                        },
                    }
                }
                Fast::Fma32 { fm, d, a, b, c } => {
                    let n = narrow(d, &[a, b, c]);
                    let z = fm.ftz;
                    // Without modifiers and on 32-bit rows it is `FmaN`.
                    match (fm == FMod::default(), n) {
                        (true, _) => lanes3(regs, m, d, a, b, c, |x, y, v| canon32(f32_in(x, false).mul_add(f32_in(y, false), f32_in(v, false)))),
                        (false, true) => lanes3n(regs, m, d, a, b, c, |x, y, v| {
                            fin32(f32_in(x as u64, z).mul_add(f32_in(y as u64, z), f32_in(v as u64, z)), fm) as u32
                        }),
                        (false, false) => lanes3(regs, m, d, a, b, c, |x, y, v| fin32(f32_in(x, z).mul_add(f32_in(y, z), f32_in(v, z)), fm)),
                    }
                }
                Fast::F64 { f, d, a, b } => {
                    let g = f64::from_bits;
                    match f {
                        FF::Add => lanes2(regs, m, d, a, b, |x, y| canon64(g(x) + g(y))),
                        FF::Sub => lanes2(regs, m, d, a, b, |x, y| canon64(g(x) - g(y))),
                        FF::Mul => lanes2(regs, m, d, a, b, |x, y| canon64(g(x) * g(y))),
                        FF::Div => lanes2(regs, m, d, a, b, |x, y| canon64(g(x) / g(y))),
                    }
                }
                Fast::Fma64 { d, a, b, c } => {
                    lanes3(regs, m, d, a, b, c, |x, y, z| canon64(f64::from_bits(x).mul_add(f64::from_bits(y), f64::from_bits(z))))
                }
                Fast::Bits { xor, and, d, a } => {
                    if and <= u32::MAX as u64 && narrow(d, &[a]) {
                        let (xor, and) = (xor as u32, and as u32);
                        lanes1n(regs, m, d, a, |x| (x ^ xor) & and)
                    } else {
                        lanes1(regs, m, d, a, |x| (x ^ xor) & and)
                    }
                }
                Fast::SetpI { cmp, bits, signed, d, d2, a, b } => {
                    // A 32-bit compare on 32-bit rows is `SetpN`.
                    macro_rules! go {
                        ($c:path) => {
                            match (bits, signed) {
                                (32, true) => preds2(regs, m, d, d2, a, b, |x, y| icmp($c, x as u32 as i32, y as u32 as i32)),
                                (32, false) => preds2(regs, m, d, d2, a, b, |x, y| icmp($c, x as u32, y as u32)),
                                (_, true) => preds2(regs, m, d, d2, a, b, |x, y| icmp($c, x as i64, y as i64)),
                                (_, false) => preds2(regs, m, d, d2, a, b, |x, y| icmp($c, x, y)),
                            }
                        };
                    }
                    by_cmp!(cmp, go)
                }
                Fast::SetpF { cmp, f64, d, d2, a, b } => {
                    let n = !f64 && narrow_preds(d, d2, &[a, b]);
                    macro_rules! go {
                        ($c:path) => {
                            if f64 {
                                preds2(regs, m, d, d2, a, b, |x, y| {
                                    let (x, y) = (f64::from_bits(x), f64::from_bits(y));
                                    fcmp($c, x, y, x.is_nan() || y.is_nan())
                                })
                            } else if n {
                                preds2n(regs, m, d, d2, a, b, |x, y| {
                                    let (x, y) = (f32::from_bits(x), f32::from_bits(y));
                                    fcmp($c, x, y, x.is_nan() || y.is_nan())
                                })
                            } else {
                                preds2(regs, m, d, d2, a, b, |x, y| {
                                    let (x, y) = (f32::from_bits(x as u32), f32::from_bits(y as u32));
                                    fcmp($c, x, y, x.is_nan() || y.is_nan())
                                })
                            }
                        };
                    }
                    by_cmp!(cmp, go)
                }
                Fast::Selp { d, a, b, p } => {
                    if narrow(d, &[a, b, p]) {
                        lanes3n(regs, m, d, a, b, p, |x, y, q| if q != 0 { x } else { y })
                    } else {
                        lanes3(regs, m, d, a, b, p, |x, y, q| if q != 0 { x } else { y })
                    }
                }
                Fast::CvtIF { f64, bits, signed, d, a } => match (f64, bits, signed) {
                    (false, 32, false) => lanes1(regs, m, d, a, |x| (x as u32 as f32).to_bits() as u64),
                    (false, 32, true) => lanes1(regs, m, d, a, |x| (x as u32 as i32 as f32).to_bits() as u64),
                    (false, _, false) => lanes1(regs, m, d, a, |x| (x as f32).to_bits() as u64),
                    (false, _, true) => lanes1(regs, m, d, a, |x| (x as i64 as f32).to_bits() as u64),
                    (true, 32, false) => lanes1(regs, m, d, a, |x| (x as u32 as f64).to_bits()),
                    (true, 32, true) => lanes1(regs, m, d, a, |x| (x as u32 as i32 as f64).to_bits()),
                    (true, _, false) => lanes1(regs, m, d, a, |x| (x as f64).to_bits()),
                    (true, _, true) => lanes1(regs, m, d, a, |x| (x as i64 as f64).to_bits()),
                },
                Fast::CvtII { to_mk, from_bits, signed, d, a } => {
                    let fm = width_mask(from_bits);
                    if signed {
                        lanes1(regs, m, d, a, |x| sign_extend(x & fm, from_bits as u32) & to_mk)
                    } else {
                        lanes1(regs, m, d, a, |x| x & fm & to_mk)
                    }
                }
            }
        }
        *count += n;
        Ok(())
    }
}

/// The integer binary kernels: the interpreter's `int2` formulas for the same ops, on 32-bit
/// rows where every operand is a 32-bit register or a constant and the op is 32-bit (its
/// result depends on the low halves of its operands alone).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn int_lanes(regs: &Rows, m: u32, f: IntF, mk: u64, bits: u8, d: u32, a: Opd, b: Opd) {
    if bits == 32 && narrow(d, &[a, b]) {
        match f {
            IntF::Shl => return lanes2n(regs, m, d, a, b, |x, s| if s >= 32 { 0 } else { x << s }),
            IntF::ShrS => return lanes2n(regs, m, d, a, b, |x, s| ((x as i32) >> s.min(31)) as u32),
            IntF::ShrU => return lanes2n(regs, m, d, a, b, |x, s| if s >= 32 { 0 } else { x >> s }),
            IntF::MinS => return lanes2n(regs, m, d, a, b, |x, y| (x as i32).min(y as i32) as u32),
            IntF::MinU => return lanes2n(regs, m, d, a, b, |x, y| x.min(y)),
            IntF::MaxS => return lanes2n(regs, m, d, a, b, |x, y| (x as i32).max(y as i32) as u32),
            IntF::MaxU => return lanes2n(regs, m, d, a, b, |x, y| x.max(y)),
            // Add, sub, mul.lo and the bit operations are `AddN` and the others (or a test's
            // replacement kernel); a 64-bit result is the general kernels'.
            _ => {}
        }
    }
    let sx = move |x: u64| sign_extend(x & mk, bits as u32) as i64;
    let bu = bits as u64;
    match f {
        IntF::Add => lanes2(regs, m, d, a, b, |x, y| x.wrapping_add(y) & mk),
        IntF::Sub => lanes2(regs, m, d, a, b, |x, y| x.wrapping_sub(y) & mk),
        IntF::MulLo => lanes2(regs, m, d, a, b, |x, y| x.wrapping_mul(y) & mk),
        IntF::MulWideS => lanes2(regs, m, d, a, b, |x, y| (sx(x).wrapping_mul(sx(y)) as u64) & width_mask(bits * 2)),
        IntF::MulWideU => lanes2(regs, m, d, a, b, |x, y| (x & mk).wrapping_mul(y & mk) & width_mask(bits * 2)),
        IntF::And => lanes2(regs, m, d, a, b, |x, y| x & y & mk),
        IntF::Or => lanes2(regs, m, d, a, b, |x, y| (x | y) & mk),
        IntF::Xor => lanes2(regs, m, d, a, b, |x, y| (x ^ y) & mk),
        IntF::Shl => lanes2(regs, m, d, a, b, |x, y| {
            let s = y & 0xffff_ffff;
            if s >= bu {
                0
            } else {
                (x << s) & mk
            }
        }),
        IntF::ShrS => lanes2(regs, m, d, a, b, |x, y| {
            let s = (y & 0xffff_ffff).min(bu - 1);
            ((sx(x) >> s) as u64) & mk
        }),
        IntF::ShrU => lanes2(regs, m, d, a, b, |x, y| {
            let s = y & 0xffff_ffff;
            if s >= bu {
                0
            } else {
                (x & mk) >> s
            }
        }),
        IntF::MinS => lanes2(regs, m, d, a, b, |x, y| (sx(x).min(sx(y)) as u64) & mk),
        IntF::MinU => lanes2(regs, m, d, a, b, |x, y| (x & mk).min(y & mk)),
        IntF::MaxS => lanes2(regs, m, d, a, b, |x, y| (sx(x).max(sx(y)) as u64) & mk),
        IntF::MaxU => lanes2(regs, m, d, a, b, |x, y| (x & mk).max(y & mk)),
    }
}

// The lane loops work in place on chunks of [`CHUNK`] lanes: each chunk of the sources is
// read into locals before the chunk of the destination is written, so a destination that
// is also a source is safe (registers are whole rows: two operands are the same row or
// disjoint ones). No lane array is built on the stack and copied (zeroing and copying them
// cost more than the arithmetic), and a chunk fits the vector registers, so the loops are
// vector code in the AVX2 executor. They are plain loops (not `array::from_fn`, whose
// closure call is not inlined into the vector executor and so would be compiled for the
// baseline ISA).
//
// Two kinds: `*n` kernels run where every operand is a 32-bit register (or a constant, by
// its low half) on `u32` lanes, eight to a vector; the others read any register as `u64`
// (a 32-bit one zero-extended, as the interpreter's `fetch`) and write the destination as
// the interpreter's `store` does (a 32-bit one keeps the low half).

/// Lanes computed together.
const CHUNK: usize = 8;

/// Whether `d` and every register of `srcs` have 32-bit rows (constants fit either kind).
#[inline(always)]
fn narrow(d: u32, srcs: &[Opd]) -> bool {
    d & WIDE == 0 && srcs.iter().all(|s| !matches!(s, Opd::R(r) if r & WIDE != 0))
}

/// [`narrow`] for a compare's two destinations, either of which may be [`NO_REG`].
#[inline(always)]
fn narrow_preds(d: u32, d2: u32, srcs: &[Opd]) -> bool {
    (d == NO_REG || d & WIDE == 0) && (d2 == NO_REG || d2 & WIDE == 0) && narrow(0, srcs)
}

/// A warp's register rows, as raw pointers from one borrow, so that a destination row may be
/// written while source rows (possibly the same one) are read; and the kernel's constants.
struct Rows<'k> {
    narrow: *mut u32,
    nlen: usize,
    wide: *mut u64,
    wlen: usize,
    consts: &'k [u64],
    consts32: &'k [u32],
}

impl<'k> Rows<'k> {
    #[inline(always)]
    fn new(regs: &mut Regs, c: &'k Compiled) -> Rows<'k> {
        Rows {
            narrow: regs.narrow.as_mut_ptr(),
            nlen: regs.narrow.len(),
            wide: regs.wide.as_mut_ptr(),
            wlen: regs.wide.len(),
            consts: &c.consts,
            consts32: &c.consts32,
        }
    }

    /// Register `r`'s row of 32-bit values, checked in bounds.
    #[inline(always)]
    fn row32(&self, r: u32) -> *mut u32 {
        debug_assert!(r & WIDE == 0);
        let at = r as usize * LANES;
        assert!(at + LANES <= self.nlen, "register {r} is in the file");
        // SAFETY: in bounds (checked above).
        unsafe { self.narrow.add(at) }
    }

    /// Register `r`'s row of 64-bit values (`r` has [`WIDE`]), checked in bounds.
    #[inline(always)]
    fn row64(&self, r: u32) -> *mut u64 {
        let at = (r & !WIDE) as usize * LANES;
        assert!(at + LANES <= self.wlen, "register {r:#x} is in the file");
        // SAFETY: in bounds (checked above).
        unsafe { self.wide.add(at) }
    }

    /// A source of a `*n` kernel: a 32-bit register's row or the constant's low halves.
    #[inline(always)]
    fn src32(&self, s: Opd) -> *const u32 {
        match s {
            Opd::R(r) => self.row32(r),
            Opd::K(k) => {
                let at = k as usize * LANES;
                self.consts32[at..at + LANES].as_ptr()
            }
        }
    }

    /// A source of the general kernels as 64-bit lanes: a 64-bit row or a constant's row in
    /// place, a 32-bit row widened into `buf` (so that the kernels' loops read one kind).
    #[inline(always)]
    fn src64(&self, s: Opd, buf: &mut [u64; LANES]) -> *const u64 {
        match s {
            Opd::R(r) if r & WIDE != 0 => self.row64(r),
            Opd::R(r) => {
                let p = self.row32(r);
                for (l, v) in buf.iter_mut().enumerate() {
                    // SAFETY: a whole row (checked by `row32`).
                    *v = unsafe { *p.add(l) } as u64;
                }
                buf.as_ptr()
            }
            Opd::K(k) => {
                let at = k as usize * LANES;
                self.consts[at..at + LANES].as_ptr()
            }
        }
    }

    /// Writes the general kernels' result: the lanes of `m` get `r` (a 32-bit row their low
    /// halves, as the interpreter's `store`), the others keep theirs.
    #[inline(always)]
    fn store64(&self, d: u32, m: u32, r: &[u64; LANES]) {
        if d & WIDE != 0 {
            let p = self.row64(d);
            for (l, v) in r.iter().enumerate() {
                if m >> l & 1 != 0 {
                    // SAFETY: a whole row (checked by `row64`).
                    unsafe { *p.add(l) = *v };
                }
            }
        } else {
            let p = self.row32(d);
            for (l, v) in r.iter().enumerate() {
                if m >> l & 1 != 0 {
                    // SAFETY: a whole row (checked by `row32`).
                    unsafe { *p.add(l) = *v as u32 };
                }
            }
        }
    }
}

/// Reads chunk `k` of a row.
///
/// # Safety
/// `p` points to a row of [`LANES`] values and `k + CHUNK <= LANES`.
#[inline(always)]
unsafe fn chunk<T: Copy>(p: *const T, k: usize) -> [T; CHUNK] {
    std::ptr::read_unaligned(p.add(k) as *const [T; CHUNK])
}

/// [`put`], where `FULL` says every lane of `m` is on.
///
/// # Safety
/// As [`put`].
#[inline(always)]
unsafe fn put_at<T: Copy, const FULL: bool>(d: *mut T, k: usize, m: u32, r: [T; CHUNK]) {
    if FULL {
        std::ptr::write_unaligned(d.add(k) as *mut [T; CHUNK], r);
    } else {
        put(d, k, m, r)
    }
}

/// Writes chunk `k` of the destination: the lanes of `m` get `r`, the others keep theirs.
///
/// # Safety
/// As [`chunk`], for a row the caller may write.
#[inline(always)]
unsafe fn put<T: Copy>(d: *mut T, k: usize, m: u32, mut r: [T; CHUNK]) {
    if m != u32::MAX {
        let old = chunk(d, k);
        for l in 0..CHUNK {
            if m >> (k + l) & 1 == 0 {
                r[l] = old[l];
            }
        }
    }
    std::ptr::write_unaligned(d.add(k) as *mut [T; CHUNK], r);
}

// The general kernels compute all lanes into a staging array from sources of one kind
// (`Rows::src64`), then store it (`Rows::store64`): the loops that depend on the closure have
// no branch on the rows' kinds, which would be unswitched into a copy per combination.

#[inline(always)]
fn lanes1(rows: &Rows, m: u32, d: u32, a: Opd, f: impl Fn(u64) -> u64) {
    let mut ba = [0u64; LANES];
    let pa = rows.src64(a, &mut ba);
    let mut r = [0u64; LANES];
    for (l, v) in r.iter_mut().enumerate() {
        // SAFETY: a whole row (checked by `Rows`).
        *v = f(unsafe { *pa.add(l) });
    }
    rows.store64(d, m, &r);
}

#[inline(always)]
fn lanes2(rows: &Rows, m: u32, d: u32, a: Opd, b: Opd, f: impl Fn(u64, u64) -> u64) {
    let (mut ba, mut bb) = ([0u64; LANES], [0u64; LANES]);
    let (pa, pb) = (rows.src64(a, &mut ba), rows.src64(b, &mut bb));
    let mut r = [0u64; LANES];
    for (l, v) in r.iter_mut().enumerate() {
        // SAFETY: whole rows (checked by `Rows`).
        *v = unsafe { f(*pa.add(l), *pb.add(l)) };
    }
    rows.store64(d, m, &r);
}

#[inline(always)]
fn lanes3(rows: &Rows, m: u32, d: u32, a: Opd, b: Opd, c: Opd, f: impl Fn(u64, u64, u64) -> u64) {
    let (mut ba, mut bb, mut bc) = ([0u64; LANES], [0u64; LANES], [0u64; LANES]);
    let (pa, pb, pc) = (rows.src64(a, &mut ba), rows.src64(b, &mut bb), rows.src64(c, &mut bc));
    let mut r = [0u64; LANES];
    for (l, v) in r.iter_mut().enumerate() {
        // SAFETY: whole rows (checked by `Rows`).
        *v = unsafe { f(*pa.add(l), *pb.add(l), *pc.add(l)) };
    }
    rows.store64(d, m, &r);
}

/// A compare: `d` gets the result, `d2` its negation (either may be [`NO_REG`]).
#[inline(always)]
fn preds2(rows: &Rows, m: u32, d: u32, d2: u32, a: Opd, b: Opd, f: impl Fn(u64, u64) -> bool) {
    let (mut ba, mut bb) = ([0u64; LANES], [0u64; LANES]);
    let (pa, pb) = (rows.src64(a, &mut ba), rows.src64(b, &mut bb));
    let mut r = [0u64; LANES];
    for (l, v) in r.iter_mut().enumerate() {
        // SAFETY: whole rows (checked by `Rows`).
        *v = unsafe { f(*pa.add(l), *pb.add(l)) } as u64;
    }
    if d != NO_REG {
        rows.store64(d, m, &r);
    }
    if d2 != NO_REG {
        for v in r.iter_mut() {
            *v ^= 1;
        }
        rows.store64(d2, m, &r);
    }
}

/// Runs the kernel with the lane mask's test out of the chunk loop where every lane is on.
#[inline(always)]
fn lanes1n(rows: &Rows, m: u32, d: u32, a: Opd, f: impl Fn(u32) -> u32) {
    if m == u32::MAX {
        lanes1n_at::<true>(rows, m, d, a, f)
    } else {
        lanes1n_at::<false>(rows, m, d, a, f)
    }
}

#[inline(always)]
fn lanes1n_at<const FULL: bool>(rows: &Rows, m: u32, d: u32, a: Opd, f: impl Fn(u32) -> u32) {
    let pa = rows.src32(a);
    let pd = rows.row32(d);
    for k in (0..LANES).step_by(CHUNK) {
        // SAFETY: as in `lanes1`.
        unsafe {
            let x = chunk(pa, k);
            let mut r = [0u32; CHUNK];
            for l in 0..CHUNK {
                r[l] = f(x[l]);
            }
            put_at::<_, FULL>(pd, k, m, r);
        }
    }
}

/// Runs the kernel with the lane mask's test out of the chunk loop where every lane is on.
#[inline(always)]
fn lanes2n(rows: &Rows, m: u32, d: u32, a: Opd, b: Opd, f: impl Fn(u32, u32) -> u32) {
    if m == u32::MAX {
        lanes2n_at::<true>(rows, m, d, a, b, f)
    } else {
        lanes2n_at::<false>(rows, m, d, a, b, f)
    }
}

#[inline(always)]
fn lanes2n_at<const FULL: bool>(rows: &Rows, m: u32, d: u32, a: Opd, b: Opd, f: impl Fn(u32, u32) -> u32) {
    let (pa, pb) = (rows.src32(a), rows.src32(b));
    let pd = rows.row32(d);
    for k in (0..LANES).step_by(CHUNK) {
        // SAFETY: as in `lanes1`.
        unsafe {
            let (x, y) = (chunk(pa, k), chunk(pb, k));
            let mut r = [0u32; CHUNK];
            for l in 0..CHUNK {
                r[l] = f(x[l], y[l]);
            }
            put_at::<_, FULL>(pd, k, m, r);
        }
    }
}

/// Runs the kernel with the lane mask's test out of the chunk loop where every lane is on.
#[inline(always)]
fn lanes3n(rows: &Rows, m: u32, d: u32, a: Opd, b: Opd, c: Opd, f: impl Fn(u32, u32, u32) -> u32) {
    if m == u32::MAX {
        lanes3n_at::<true>(rows, m, d, a, b, c, f)
    } else {
        lanes3n_at::<false>(rows, m, d, a, b, c, f)
    }
}

#[inline(always)]
fn lanes3n_at<const FULL: bool>(rows: &Rows, m: u32, d: u32, a: Opd, b: Opd, c: Opd, f: impl Fn(u32, u32, u32) -> u32) {
    let (pa, pb, pc) = (rows.src32(a), rows.src32(b), rows.src32(c));
    let pd = rows.row32(d);
    for k in (0..LANES).step_by(CHUNK) {
        // SAFETY: as in `lanes1`.
        unsafe {
            let (x, y, z) = (chunk(pa, k), chunk(pb, k), chunk(pc, k));
            let mut r = [0u32; CHUNK];
            for l in 0..CHUNK {
                r[l] = f(x[l], y[l], z[l]);
            }
            put_at::<_, FULL>(pd, k, m, r);
        }
    }
}

/// [`preds2`] where the operands and destinations are 32-bit rows.
#[inline(always)]
fn preds2n(rows: &Rows, m: u32, d: u32, d2: u32, a: Opd, b: Opd, f: impl Fn(u32, u32) -> bool) {
    if m == u32::MAX {
        preds2n_at::<true>(rows, m, d, d2, a, b, f)
    } else {
        preds2n_at::<false>(rows, m, d, d2, a, b, f)
    }
}

#[inline(always)]
fn preds2n_at<const FULL: bool>(rows: &Rows, m: u32, d: u32, d2: u32, a: Opd, b: Opd, f: impl Fn(u32, u32) -> bool) {
    let (pa, pb) = (rows.src32(a), rows.src32(b));
    let pd = (d != NO_REG).then(|| rows.row32(d));
    let pd2 = (d2 != NO_REG).then(|| rows.row32(d2));
    for k in (0..LANES).step_by(CHUNK) {
        // SAFETY: as in `lanes1`.
        unsafe {
            let (x, y) = (chunk(pa, k), chunk(pb, k));
            let mut r = [0u32; CHUNK];
            for l in 0..CHUNK {
                r[l] = f(x[l], y[l]) as u32;
            }
            if let Some(pd) = pd {
                put_at::<_, FULL>(pd, k, m, r);
            }
            if let Some(pd2) = pd2 {
                for v in r.iter_mut() {
                    *v ^= 1;
                }
                put_at::<_, FULL>(pd2, k, m, r);
            }
        }
    }
}

/// Deliberately wrong kernels, for the test that the differential runs catch them.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    pub(crate) const INTERP: Fast = Fast::Interp;

    #[derive(Debug, Clone, Copy)]
    pub(crate) enum Wrong {
        AddIsSub,
        LtIsLe,
        MovMask,
    }

    /// Breaks the first kernel `w` applies to (every `mov` for [`Wrong::MovMask`]); false if
    /// none is found.
    pub(crate) fn wrong(p: &mut Program, w: Wrong) -> bool {
        let mut hit = false;
        for pc in 0..p.compiled.ops.len() {
            let f = match (w, p.compiled.ops[pc]) {
                (Wrong::AddIsSub, Fast::Int { f: IntF::Add, mk, bits: 32, d, a, b }) => Fast::Int { f: IntF::Sub, mk, bits: 32, d, a, b },
                (Wrong::AddIsSub, Fast::AddN { d, a, b }) => Fast::SubN { d, a, b },
                (Wrong::LtIsLe, Fast::SetpI { cmp: Cmp::Lt, bits, signed, d, d2, a, b }) => Fast::SetpI { cmp: Cmp::Le, bits, signed, d, d2, a, b },
                (Wrong::LtIsLe, Fast::SetpN { cmp: Cmp::Lt, signed, d, d2, a, b }) => Fast::SetpN { cmp: Cmp::Le, signed, d, d2, a, b },
                (Wrong::MovMask, Fast::Mov { mk, d, a }) => {
                    // Every mov loses bit 0 (one mov of an even value would not show it).
                    p.compiled.set(pc, Fast::Mov { mk: mk & !1, d, a });
                    hit = true;
                    continue;
                }
                (Wrong::MovMask, Fast::MovN { d, a }) => {
                    p.compiled.set(pc, Fast::Mov { mk: 0xffff_fffe, d, a });
                    hit = true;
                    continue;
                }
                _ => continue,
            };
            p.compiled.set(pc, f);
            return true;
        }
        hit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The accept-set form of an integer compare answers as `icmp` for every kind.
    #[test]
    fn integer_compares_accept_what_icmp_does() {
        let all = [Cmp::Eq, Cmp::Ne, Cmp::Lt, Cmp::Le, Cmp::Gt, Cmp::Ge, Cmp::Equ, Cmp::Neu, Cmp::Ltu, Cmp::Leu, Cmp::Gtu, Cmp::Geu, Cmp::Num, Cmp::Nan];
        for cmp in all {
            let (lt, eq, gt) = int_cmp_accepts(cmp);
            for (x, y) in [(-2i32, 3i32), (3, 3), (5, -7), (i32::MIN, i32::MAX)] {
                let by_set = ((x < y) & lt) | ((x == y) & eq) | ((x > y) & gt);
                assert_eq!(by_set, icmp(cmp, x, y), "{cmp:?} {x} {y}");
            }
        }
    }
}
