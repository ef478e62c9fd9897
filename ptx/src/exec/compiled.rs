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

/// The constants of a kernel's operands, a [`LANES`]-wide row each, interned.
#[derive(Default)]
struct Consts {
    rows: Vec<u64>,
    index: std::collections::HashMap<u64, u32>,
}

impl Consts {
    fn opd(&mut self, s: Src) -> Opd {
        match s {
            Src::R(r) => Opd::R(r),
            Src::C(c) => Opd::K(*self.index.entry(c).or_insert_with(|| {
                let k = (self.rows.len() / LANES) as u32;
                self.rows.extend_from_slice(&[c; LANES]);
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
    /// Per pc: the first pc after the run that starts at pc (== pc when pc is outside runs).
    /// A run never contains a join point past its first instruction, so lanes waiting to
    /// meet there are met by the interpreter's main loop.
    pub(crate) run_end: Vec<u32>,
    /// Instructions with a specialised kernel.
    pub specialised: usize,
    /// The rows [`Opd::K`] names.
    pub(crate) consts: Vec<u64>,
    /// The host has AVX2, FMA and the bit-manipulation extensions: runs use the executor
    /// compiled for them.
    vector: bool,
}

impl Compiled {
    pub fn build(name: &str, insts: &[Inst], joins: &[bool]) -> Compiled {
        let mut consts = Consts::default();
        let ops: Vec<Fast> = insts.iter().map(|i| compile(&i.op, &mut consts)).collect();
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
        Compiled { ops, run_end, specialised, consts: consts.rows, vector: vector_host() }
    }

    /// Bytes it holds, for callers that bound what they keep.
    pub fn bytes(&self) -> usize {
        self.ops.len() * (std::mem::size_of::<Fast>() + 4) + self.consts.len() * 8
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
        self.run_group(w, at, out, count)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,popcnt,bmi1,bmi2,lzcnt")]
    unsafe fn run_vector(&mut self, w: &mut Warp, at: At, out: &mut Vec<u8>, count: &mut u64) -> Result<(), (u32, usize, Fault)> {
        self.run_group(w, at, out, count)
    }

    #[inline(always)]
    fn run_group(&mut self, w: &mut Warp, at: At, out: &mut Vec<u8>, count: &mut u64) -> Result<(), (u32, usize, Fault)> {
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
            self.run_insts(w, pc, end, mask, out, count)?;
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
                let p = pred_mask(&w.regs, g);
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
    fn run_insts(&mut self, w: &mut Warp, pc: u32, end: u32, mask: u32, out: &mut Vec<u8>, count: &mut u64) -> Result<(), (u32, usize, Fault)> {
        let prog: &Program = self.sh.prog;
        for at in pc..end {
            let inst = &prog.insts[at as usize];
            let mut m = mask;
            if let Some((g, neg)) = inst.guard {
                let p = pred_mask(&w.regs, g);
                m &= if neg { !p } else { p };
            }
            *count += m.count_ones() as u64;
            if m == 0 {
                continue;
            }
            let regs = &Rows::new(&mut w.regs, &prog.compiled.consts);
            match prog.compiled.ops[at as usize] {
                Fast::Outside => unreachable!("runs hold no control instruction"),
                Fast::Interp => self.exec(w, &inst.op, m, out).map_err(|(l, f)| (at, l, f))?,
                Fast::Mov { mk, d, a } => lanes1(regs, m, d, a, |x| x & mk),
                Fast::Int { f, mk, bits, d, a, b } => int_lanes(regs, m, f, mk, bits, d, a, b),
                Fast::Mad { f, mk, bits, d, a, b, c } => {
                    let sx = |x: u64| sign_extend(x & mk, bits as u32) as i64;
                    match f {
                        MadF::Lo => lanes3(regs, m, d, a, b, c, |x, y, z| x.wrapping_mul(y).wrapping_add(z) & mk),
                        MadF::WideS => {
                            lanes3(regs, m, d, a, b, c, |x, y, z| (sx(x).wrapping_mul(sx(y)) as u64).wrapping_add(z) & width_mask(bits * 2))
                        }
                        MadF::WideU => lanes3(regs, m, d, a, b, c, |x, y, z| (x & mk).wrapping_mul(y & mk).wrapping_add(z) & width_mask(bits * 2)),
                    }
                }
                Fast::F32 { f, fm, d, a, b } => {
                    let z = fm.ftz;
                    if fm == FMod::default() {
                        match f {
                            FF::Add => lanes2(regs, m, d, a, b, |x, y| canon32(f32_in(x, false) + f32_in(y, false))),
                            FF::Sub => lanes2(regs, m, d, a, b, |x, y| canon32(f32_in(x, false) - f32_in(y, false))),
                            FF::Mul => lanes2(regs, m, d, a, b, |x, y| canon32(f32_in(x, false) * f32_in(y, false))),
                            FF::Div => lanes2(regs, m, d, a, b, |x, y| canon32(f32_in(x, false) / f32_in(y, false))),
                        }
                    } else {
                        match f {
                            FF::Add => lanes2(regs, m, d, a, b, |x, y| fin32(f32_in(x, z) + f32_in(y, z), fm)),
                            FF::Sub => lanes2(regs, m, d, a, b, |x, y| fin32(f32_in(x, z) - f32_in(y, z), fm)),
                            FF::Mul => lanes2(regs, m, d, a, b, |x, y| fin32(f32_in(x, z) * f32_in(y, z), fm)),
                            FF::Div => lanes2(regs, m, d, a, b, |x, y| fin32(f32_in(x, z) / f32_in(y, z), fm)),
                        }
                    }
                }
                Fast::Fma32 { fm, d, a, b, c } => {
                    if fm == FMod::default() {
                        lanes3(regs, m, d, a, b, c, |x, y, v| canon32(f32_in(x, false).mul_add(f32_in(y, false), f32_in(v, false))))
                    } else {
                        let z = fm.ftz;
                        lanes3(regs, m, d, a, b, c, |x, y, v| fin32(f32_in(x, z).mul_add(f32_in(y, z), f32_in(v, z)), fm))
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
                Fast::Bits { xor, and, d, a } => lanes1(regs, m, d, a, |x| (x ^ xor) & and),
                Fast::SetpI { cmp, bits, signed, d, d2, a, b } => {
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
                    macro_rules! go {
                        ($c:path) => {
                            if f64 {
                                preds2(regs, m, d, d2, a, b, |x, y| {
                                    let (x, y) = (f64::from_bits(x), f64::from_bits(y));
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
                Fast::Selp { d, a, b, p } => select(regs, m, d, a, b, p),
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
        Ok(())
    }
}

/// The integer binary kernels: the interpreter's `int2` formulas for the same ops.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn int_lanes(regs: &Rows, m: u32, f: IntF, mk: u64, bits: u8, d: u32, a: Opd, b: Opd) {
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
// is also a source is safe (registers are whole 32-lane rows: two operands are the same row
// or disjoint ones). No lane array is built on the stack and copied (zeroing and copying
// them cost more than the arithmetic), and the chunk fits the vector registers, so the
// loops are vector code in the AVX2 executor. They are plain loops (not `array::from_fn`,
// whose closure call is not inlined into the vector executor and so would be compiled for
// the baseline ISA).

/// Lanes computed together.
const CHUNK: usize = 8;

/// A register file's rows, as raw pointers from one borrow, so that a destination row may be
/// written while source rows (possibly the same one) are read.
struct Rows<'k> {
    base: *mut u64,
    len: usize,
    consts: &'k [u64],
}

impl<'k> Rows<'k> {
    #[inline(always)]
    fn new(regs: &mut [u64], consts: &'k [u64]) -> Rows<'k> {
        Rows { base: regs.as_mut_ptr(), len: regs.len(), consts }
    }

    /// Register `r`'s row, checked in bounds.
    #[inline(always)]
    fn row(&self, r: u32) -> *mut u64 {
        let at = r as usize * LANES;
        assert!(at + LANES <= self.len, "register {r} is in the file");
        // SAFETY: in bounds (checked above).
        unsafe { self.base.add(at) }
    }

    /// A source's lane values: the register's row or the constant's.
    #[inline(always)]
    fn src(&self, s: Opd) -> *const u64 {
        match s {
            Opd::R(r) => self.row(r),
            Opd::K(k) => {
                let at = k as usize * LANES;
                self.consts[at..at + LANES].as_ptr()
            }
        }
    }
}

/// Reads chunk `k` of a row.
///
/// # Safety
/// `p` points to a row of [`LANES`] values and `k + CHUNK <= LANES`.
#[inline(always)]
unsafe fn chunk(p: *const u64, k: usize) -> [u64; CHUNK] {
    std::ptr::read_unaligned(p.add(k) as *const [u64; CHUNK])
}

/// Writes chunk `k` of the destination: the lanes of `m` get `r`, the others keep theirs.
///
/// # Safety
/// As [`chunk`], for a row the caller may write.
#[inline(always)]
unsafe fn put(d: *mut u64, k: usize, m: u32, mut r: [u64; CHUNK]) {
    if m != u32::MAX {
        let old = chunk(d, k);
        for l in 0..CHUNK {
            if m >> (k + l) & 1 == 0 {
                r[l] = old[l];
            }
        }
    }
    std::ptr::write_unaligned(d.add(k) as *mut [u64; CHUNK], r);
}

#[inline(always)]
fn lanes1(rows: &Rows, m: u32, d: u32, a: Opd, f: impl Fn(u64) -> u64) {
    let pa = rows.src(a);
    let pd = rows.row(d);
    for k in (0..LANES).step_by(CHUNK) {
        // SAFETY: each pointer is a whole row (checked by `Rows`) and k + CHUNK <= LANES.
        unsafe {
            let x = chunk(pa, k);
            let mut r = [0u64; CHUNK];
            for l in 0..CHUNK {
                r[l] = f(x[l]);
            }
            put(pd, k, m, r);
        }
    }
}

#[inline(always)]
fn lanes2(rows: &Rows, m: u32, d: u32, a: Opd, b: Opd, f: impl Fn(u64, u64) -> u64) {
    let (pa, pb) = (rows.src(a), rows.src(b));
    let pd = rows.row(d);
    for k in (0..LANES).step_by(CHUNK) {
        // SAFETY: as in `lanes1`.
        unsafe {
            let (x, y) = (chunk(pa, k), chunk(pb, k));
            let mut r = [0u64; CHUNK];
            for l in 0..CHUNK {
                r[l] = f(x[l], y[l]);
            }
            put(pd, k, m, r);
        }
    }
}

#[inline(always)]
fn lanes3(rows: &Rows, m: u32, d: u32, a: Opd, b: Opd, c: Opd, f: impl Fn(u64, u64, u64) -> u64) {
    let (pa, pb, pc) = (rows.src(a), rows.src(b), rows.src(c));
    let pd = rows.row(d);
    for k in (0..LANES).step_by(CHUNK) {
        // SAFETY: as in `lanes1`.
        unsafe {
            let (x, y, z) = (chunk(pa, k), chunk(pb, k), chunk(pc, k));
            let mut r = [0u64; CHUNK];
            for l in 0..CHUNK {
                r[l] = f(x[l], y[l], z[l]);
            }
            put(pd, k, m, r);
        }
    }
}

/// A compare: `d` gets the result, `d2` its negation (either may be [`NO_REG`]).
#[inline(always)]
fn preds2(rows: &Rows, m: u32, d: u32, d2: u32, a: Opd, b: Opd, f: impl Fn(u64, u64) -> bool) {
    let (pa, pb) = (rows.src(a), rows.src(b));
    // Both destinations are checked before any is written; a destination that is also a
    // source is read (chunk by chunk) before it is written, as in `lanes2`.
    let pd = (d != NO_REG).then(|| rows.row(d));
    let pd2 = (d2 != NO_REG).then(|| rows.row(d2));
    for k in (0..LANES).step_by(CHUNK) {
        // SAFETY: as in `lanes1`.
        unsafe {
            let (x, y) = (chunk(pa, k), chunk(pb, k));
            let mut r = [0u64; CHUNK];
            for l in 0..CHUNK {
                r[l] = f(x[l], y[l]) as u64;
            }
            if let Some(pd) = pd {
                put(pd, k, m, r);
            }
            if let Some(pd2) = pd2 {
                for v in r.iter_mut() {
                    *v ^= 1;
                }
                put(pd2, k, m, r);
            }
        }
    }
}

#[inline(always)]
fn select(rows: &Rows, m: u32, d: u32, a: Opd, b: Opd, p: Opd) {
    lanes3(rows, m, d, a, b, p, |x, y, q| if q != 0 { x } else { y })
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
                (Wrong::LtIsLe, Fast::SetpI { cmp: Cmp::Lt, bits, signed, d, d2, a, b }) => Fast::SetpI { cmp: Cmp::Le, bits, signed, d, d2, a, b },
                (Wrong::MovMask, Fast::Mov { mk, d, a }) => {
                    // Every mov loses bit 0 (one mov of an even value would not show it).
                    p.compiled.set(pc, Fast::Mov { mk: mk & !1, d, a });
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
