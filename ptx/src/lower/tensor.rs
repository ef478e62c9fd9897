//! Lowering of the tensor-core, matrix-load, asynchronous-copy and mbarrier instructions.
//! Each form is checked against the combinations the PTX ISA defines (and the sim
//! implements); anything else is refused with the instruction named, as elsewhere.

use super::*;

fn mma_ty(m: &str) -> Option<MmaTy> {
    Some(match m {
        "f16" => MmaTy::F16,
        "bf16" => MmaTy::BF16,
        "tf32" => MmaTy::Tf32,
        "f32" => MmaTy::F32,
        "f64" => MmaTy::F64,
        "s8" => MmaTy::S8,
        "u8" => MmaTy::U8,
        "s32" => MmaTy::S32,
        _ => return None,
    })
}

/// `m16n8k16` -> [16, 8, 16].
fn shape_of(i: &Instruction) -> Option<[u8; 3]> {
    i.mods.iter().find_map(|m| {
        let r = m.strip_prefix('m')?;
        let (mm, r) = r.split_once('n')?;
        let (nn, kk) = r.split_once('k')?;
        Some([mm.parse().ok()?, nn.parse().ok()?, kk.parse().ok()?])
    })
}

/// Elements of `ty` one 32-bit (64 for f64) register holds.
pub(crate) fn per_reg(ty: MmaTy) -> usize {
    match ty {
        MmaTy::F64 => 1,
        t => 32 / t.bits() as usize,
    }
}

/// Elements of a fragment of (rows x cols) each lane holds distinctly.
fn per_lane(rows: usize, cols: usize) -> usize {
    rows * cols / 32
}

pub(crate) fn dims(shape: [u8; 3], of: FragOf) -> (usize, usize) {
    let [m, n, k] = shape.map(|x| x as usize);
    match of {
        FragOf::A => (m, k),
        FragOf::B => (k, n),
        FragOf::C => (m, n),
    }
}

impl Lowerer<'_> {
    fn is_pred(&self, n: &str) -> bool {
        let Some(c) = self.stack.last() else { return false };
        c.preds.contains(n) || c.preds.contains(n.trim_end_matches(|ch: char| ch.is_ascii_digit()))
    }

    /// `{r0, r1, ...}` as sources.
    fn src_vec(&mut self, o: &Operand, line: u32) -> Result<Vec<Src>, PtxError> {
        match o {
            Operand::Vector(v) if v.len() <= 16 => v.iter().map(|x| self.src(x, None, line)).collect(),
            _ => Err(unsupported(line, format!("fragment operand {o:?}"))),
        }
    }

    fn dst_vec(&mut self, o: &Operand, line: u32) -> Result<Vec<u32>, PtxError> {
        match o {
            Operand::Vector(v) if v.len() <= 16 => v.iter().map(|x| self.dst(x, line)).collect(),
            _ => Err(unsupported(line, format!("fragment operand {o:?}"))),
        }
    }

    /// The shared-memory state space of the asynchronous operations: `.shared{::cta}`,
    /// `.shared::cluster` (the sim's clusters are one block), or generic when absent.
    fn shared_or_generic(&self, i: &Instruction) -> Result<Space, PtxError> {
        if i.has("shared") || i.has("shared::cluster") {
            Ok(Space::Shared)
        } else if i.has("global") || i.has("local") || i.has("const") || i.has("param") {
            Err(unsupported(i.line, i.text()))
        } else {
            Ok(Space::Generic)
        }
    }

    pub(super) fn matrix_op(&mut self, i: &Instruction) -> Result<Op, PtxError> {
        let line = i.line;
        let un = || unsupported(line, i.text());
        let o = &i.operands;
        if !i.has("sync") || !i.has("aligned") {
            return Err(un());
        }
        match i.opcode.as_str() {
            "mma" => {
                for m in &i.mods {
                    if !(matches!(m.as_str(), "sync" | "aligned" | "row" | "col" | "satfinite") || mma_ty(m).is_some() || shape_of_one(m)) {
                        return Err(un());
                    }
                }
                let shape = shape_of(i).ok_or_else(un)?;
                let tys: Vec<MmaTy> = i.mods.iter().filter_map(|m| mma_ty(m)).collect();
                let &[d_ty, a_ty, b_ty, c_ty] = tys.as_slice() else { return Err(un()) };
                // Only `.row.col` exists for these shapes.
                let pos = |m: &str| i.mods.iter().position(|x| x == m);
                if !(pos("row").is_some() && pos("col").is_some() && pos("row") < pos("col")) {
                    return Err(un());
                }
                let int = matches!(a_ty, MmaTy::S8 | MmaTy::U8);
                let ok = match (shape, a_ty) {
                    ([16, 8, 16] | [16, 8, 8], MmaTy::F16) => b_ty == a_ty && matches!(c_ty, MmaTy::F16 | MmaTy::F32) && matches!(d_ty, MmaTy::F16 | MmaTy::F32),
                    ([16, 8, 16] | [16, 8, 8], MmaTy::BF16) => b_ty == a_ty && c_ty == MmaTy::F32 && d_ty == MmaTy::F32,
                    ([16, 8, 8] | [16, 8, 4], MmaTy::Tf32) => b_ty == a_ty && c_ty == MmaTy::F32 && d_ty == MmaTy::F32,
                    ([8, 8, 4], MmaTy::F64) => b_ty == a_ty && c_ty == MmaTy::F64 && d_ty == MmaTy::F64,
                    ([16, 8, 32] | [16, 8, 16] | [8, 8, 16], MmaTy::S8 | MmaTy::U8) => {
                        matches!(b_ty, MmaTy::S8 | MmaTy::U8) && c_ty == MmaTy::S32 && d_ty == MmaTy::S32
                    }
                    _ => false,
                };
                if !ok || (i.has("satfinite") && !int) || o.len() != 4 {
                    return Err(un());
                }
                let d = self.dst_vec(&o[0], line)?;
                let (a, b, c) = (self.src_vec(&o[1], line)?, self.src_vec(&o[2], line)?, self.src_vec(&o[3], line)?);
                let count = |of: FragOf, ty: MmaTy| {
                    let (r, c) = dims(shape, of);
                    per_lane(r, c) / per_reg(ty)
                };
                if a.len() != count(FragOf::A, a_ty) || b.len() != count(FragOf::B, b_ty) || c.len() != count(FragOf::C, c_ty) || d.len() != count(FragOf::C, d_ty) {
                    return Err(PtxError::Parse { line, msg: format!("{}: fragment register counts do not match the shape", i.text()) });
                }
                Ok(Op::Mma(Box::new(Mma { shape, wmma: false, a_ty, b_ty, c_ty, d_ty, satfinite: i.has("satfinite"), d, a, b, c })))
            }
            "wmma" => self.wmma(i),
            "ldmatrix" | "stmatrix" => {
                let load = i.opcode == "ldmatrix";
                for m in &i.mods {
                    if !matches!(m.as_str(), "sync" | "aligned" | "m8n8" | "x1" | "x2" | "x4" | "trans" | "shared" | "b16") {
                        return Err(un());
                    }
                }
                let num = [("x1", 1), ("x2", 2), ("x4", 4)].iter().find(|(m, _)| i.has(m)).map(|x| x.1).ok_or_else(un)?;
                if !i.has("m8n8") || !i.has("b16") || o.len() != 2 {
                    return Err(un());
                }
                let (ao, vo) = if load { (&o[1], &o[0]) } else { (&o[0], &o[1]) };
                let (base, off, _) = self.addr(ao, line)?;
                let regs = match vo {
                    Operand::Vector(_) if load => self.dst_vec(vo, line)?.into_iter().map(Src::R).collect(),
                    Operand::Vector(_) => self.src_vec(vo, line)?,
                    r if load => vec![Src::R(self.dst(r, line)?)],
                    r => vec![self.src(r, None, line)?],
                };
                if regs.len() != num {
                    return Err(un());
                }
                let sp = if i.has("shared") { Space::Shared } else { Space::Generic };
                Ok(Op::Matrix(Box::new(MatrixMem { load, trans: i.has("trans"), sp, regs, base, off })))
            }
            _ => {
                // movmatrix
                for m in &i.mods {
                    if !matches!(m.as_str(), "sync" | "aligned" | "m8n8" | "trans" | "b16") {
                        return Err(un());
                    }
                }
                if !i.has("trans") || !i.has("m8n8") || !i.has("b16") || o.len() != 2 {
                    return Err(un());
                }
                Ok(Op::Movmatrix { d: self.dst(&o[0], line)?, a: self.src(&o[1], None, line)? })
            }
        }
    }

    fn wmma(&mut self, i: &Instruction) -> Result<Op, PtxError> {
        let line = i.line;
        let un = || unsupported(line, i.text());
        let o = &i.operands;
        let shape = shape_of(i).ok_or_else(un)?;
        let tys: Vec<MmaTy> = i.mods.iter().filter_map(|m| mma_ty(m)).collect();
        // Which shapes go with which input type (the sub-byte and b1 forms are not modelled).
        let shape_ok = |t: MmaTy| match t {
            MmaTy::F16 | MmaTy::BF16 | MmaTy::S8 | MmaTy::U8 => matches!(shape, [16, 16, 16] | [32, 8, 16] | [8, 32, 16]),
            MmaTy::Tf32 => shape == [16, 16, 8],
            MmaTy::F64 => shape == [8, 8, 4],
            _ => false,
        };
        let verb = i.mods.first().map(String::as_str).unwrap_or("");
        match verb {
            "load" | "store" => {
                let load = verb == "load";
                let of = match (i.mods.get(1).map(String::as_str), load) {
                    (Some("a"), true) => FragOf::A,
                    (Some("b"), true) => FragOf::B,
                    (Some("c"), true) | (Some("d"), false) => FragOf::C,
                    _ => return Err(un()),
                };
                for m in &i.mods[2..] {
                    if !(matches!(m.as_str(), "sync" | "aligned" | "row" | "col" | "global" | "shared") || mma_ty(m).is_some() || shape_of_one(m)) {
                        return Err(un());
                    }
                }
                let &[ty] = tys.as_slice() else { return Err(un()) };
                let ok = match of {
                    FragOf::A | FragOf::B => !matches!(ty, MmaTy::F32 | MmaTy::S32) && shape_ok(ty),
                    FragOf::C => match ty {
                        MmaTy::F16 | MmaTy::F32 => shape_ok(MmaTy::F16) || shape_ok(MmaTy::Tf32),
                        MmaTy::S32 => shape_ok(MmaTy::S8),
                        MmaTy::F64 => shape_ok(MmaTy::F64),
                        _ => false,
                    },
                };
                if !ok || i.has("row") == i.has("col") || !(2..=3).contains(&o.len()) {
                    return Err(un());
                }
                let (ao, vo) = if load { (&o[1], &o[0]) } else { (&o[0], &o[1]) };
                let (base, off, _) = self.addr(ao, line)?;
                let regs: Vec<Src> = if load { self.dst_vec(vo, line)?.into_iter().map(Src::R).collect() } else { self.src_vec(vo, line)? };
                let (r, c) = dims(shape, of);
                let (per, held) = (per_lane(r, c), regs.len() * per_reg(ty));
                if held < per || held % per != 0 {
                    return Err(PtxError::Parse { line, msg: format!("{}: {} registers do not hold a fragment", i.text(), regs.len()) });
                }
                let stride = match o.get(2) {
                    Some(s) => Some(self.src(s, None, line)?),
                    None => None,
                };
                let sp = if i.has("global") {
                    Space::Global
                } else if i.has("shared") {
                    Space::Shared
                } else {
                    Space::Generic
                };
                Ok(Op::WmmaMem(Box::new(WmmaMem { load, of, shape, col: i.has("col"), ty, sp, regs, base, off, stride })))
            }
            "mma" => {
                for m in &i.mods[1..] {
                    if !(matches!(m.as_str(), "sync" | "aligned" | "row" | "col" | "satfinite" | "rn") || mma_ty(m).is_some() || shape_of_one(m)) {
                        return Err(un());
                    }
                }
                // `.dtype.ctype` for f16 inputs, else `.dtype.atype.btype.ctype`.
                let (d_ty, a_ty, b_ty, c_ty) = match tys.as_slice() {
                    [d, c] if matches!(d, MmaTy::F16 | MmaTy::F32) && matches!(c, MmaTy::F16 | MmaTy::F32) => (*d, MmaTy::F16, MmaTy::F16, *c),
                    [d, a, b, c] => (*d, *a, *b, *c),
                    _ => return Err(un()),
                };
                let ok = shape_ok(a_ty)
                    && match a_ty {
                        MmaTy::F16 => b_ty == a_ty && tys.len() == 2,
                        MmaTy::BF16 | MmaTy::Tf32 => b_ty == a_ty && c_ty == MmaTy::F32 && d_ty == MmaTy::F32,
                        MmaTy::F64 => b_ty == a_ty && c_ty == MmaTy::F64 && d_ty == MmaTy::F64,
                        MmaTy::S8 | MmaTy::U8 => b_ty == a_ty && c_ty == MmaTy::S32 && d_ty == MmaTy::S32,
                        _ => false,
                    };
                let int = matches!(a_ty, MmaTy::S8 | MmaTy::U8);
                if !ok || (i.has("satfinite") && !int) || o.len() != 4 {
                    return Err(un());
                }
                let d = self.dst_vec(&o[0], line)?;
                let (a, b, c) = (self.src_vec(&o[1], line)?, self.src_vec(&o[2], line)?, self.src_vec(&o[3], line)?);
                let holds = |n: usize, of: FragOf, ty: MmaTy| {
                    let (r, c) = dims(shape, of);
                    let (per, held) = (per_lane(r, c), n * per_reg(ty));
                    held >= per && held % per == 0
                };
                if !(holds(a.len(), FragOf::A, a_ty) && holds(b.len(), FragOf::B, b_ty) && holds(c.len(), FragOf::C, c_ty) && holds(d.len(), FragOf::C, d_ty)) {
                    return Err(PtxError::Parse { line, msg: format!("{}: fragment register counts do not match the shape", i.text()) });
                }
                Ok(Op::Mma(Box::new(Mma { shape, wmma: true, a_ty, b_ty, c_ty, d_ty, satfinite: i.has("satfinite"), d, a, b, c })))
            }
            _ => Err(un()),
        }
    }

    /// `cp.async{.ca,.cg}.shared.global`, `cp.async.bulk` between global and shared memory,
    /// and the group operations (no-ops: every copy is complete when issued).
    pub(super) fn cp_async(&mut self, i: &Instruction) -> Result<Op, PtxError> {
        let line = i.line;
        let un = || unsupported(line, i.text());
        let o = &i.operands;
        let m: Vec<&str> = i.mods.iter().map(String::as_str).collect();
        let prefetch = |x: &str| matches!(x, "L2::64B" | "L2::128B" | "L2::256B");
        match &m[1..] {
            ["commit_group"] | ["wait_all"] | ["bulk", "commit_group"] if o.is_empty() => return Ok(Op::Nop),
            ["wait_group"] | ["bulk", "wait_group"] | ["bulk", "wait_group", "read"] if o.len() == 1 => return Ok(Op::Nop),
            // A prefetch into L2 changes no value.
            ["bulk", "prefetch", "L2", "global"] if o.len() == 2 => return Ok(Op::Nop),
            ["mbarrier", "arrive", rest @ ..] => {
                let noinc = rest.first() == Some(&"noinc");
                let rest = if noinc { &rest[1..] } else { rest };
                if !matches!(rest, ["shared", "b64"] | ["b64"]) || o.len() != 1 {
                    return Err(un());
                }
                let (base, off, _) = self.addr(&o[0], line)?;
                let sp = self.shared_or_generic(i)?;
                return Ok(Op::Mbar(Box::new(Mbar { op: MbarOp::CpAsyncArrive { noinc }, d: None, sp, base, off, b: Src::C(0) })));
            }
            [level @ ("ca" | "cg"), "shared", "global", rest @ ..] if rest.iter().all(|x| prefetch(x)) && rest.len() <= 1 => {
                if !(3..=4).contains(&o.len()) {
                    return Err(un());
                }
                let size = match &o[2] {
                    Operand::Int(v @ (4 | 8 | 16)) if *level == "ca" || *v == 16 => *v as u64,
                    _ => return Err(un()),
                };
                let (dst, doff, _) = self.addr(&o[0], line)?;
                let (src, soff, _) = self.addr(&o[1], line)?;
                let (mut src_size, mut ignore) = (None, None);
                match o.get(3) {
                    Some(Operand::Name(n)) if self.is_pred(n) => ignore = Some((Src::R(self.reg(n, line)?), false)),
                    Some(Operand::Not(n)) if self.is_pred(n) => ignore = Some((Src::R(self.reg(n, line)?), true)),
                    Some(x) => src_size = Some(self.src(x, None, line)?),
                    None => {}
                }
                return Ok(Op::CpAsync(Box::new(CpAsync { dst_sp: Space::Shared, src_sp: Space::Global, dst, doff, src, soff, size: Src::C(size), src_size, ignore, mbar: None })));
            }
            ["bulk", dsp @ ("shared::cluster" | "shared"), "global", "mbarrier::complete_tx::bytes"] if o.len() == 4 => {
                let _ = dsp;
                let (dst, doff, _) = self.addr(&o[0], line)?;
                let (src, soff, _) = self.addr(&o[1], line)?;
                let size = self.src(&o[2], None, line)?;
                let (mb, moff, _) = self.addr(&o[3], line)?;
                let c = CpAsync { dst_sp: Space::Shared, src_sp: Space::Global, dst, doff, src, soff, size, src_size: None, ignore: None, mbar: Some((mb, moff)) };
                return Ok(Op::CpAsync(Box::new(c)));
            }
            ["bulk", "global", "shared", "bulk_group"] if o.len() == 3 => {
                let (dst, doff, _) = self.addr(&o[0], line)?;
                let (src, soff, _) = self.addr(&o[1], line)?;
                let size = self.src(&o[2], None, line)?;
                let c = CpAsync { dst_sp: Space::Global, src_sp: Space::Shared, dst, doff, src, soff, size, src_size: None, ignore: None, mbar: None };
                return Ok(Op::CpAsync(Box::new(c)));
            }
            _ => {}
        }
        Err(un())
    }

    /// `cvt.rna{.satfinite}.tf32.f32` (what `wmma::__float_to_tf32` compiles to) and sm_90's
    /// `cvt.{rn,rz}.satfinite{.relu}.tf32.f32`.
    pub(super) fn cvt_tf32(&mut self, i: &Instruction) -> Result<Op, PtxError> {
        let line = i.line;
        let un = || unsupported(line, i.text());
        let m: Vec<&str> = i.mods.iter().map(String::as_str).collect();
        let (rnd, rest) = match m.split_first() {
            Some((&"rna", r)) => (Rnd::Rna, r),
            Some((&"rn", r)) => (Rnd::Rn, r),
            Some((&"rz", r)) => (Rnd::Rz, r),
            _ => return Err(un()),
        };
        let (relu, satfinite) = match (rnd, rest) {
            (Rnd::Rna, ["tf32", "f32"]) => (false, false),
            (Rnd::Rna, ["satfinite", "tf32", "f32"]) => (false, true),
            (Rnd::Rn | Rnd::Rz, ["satfinite", "tf32", "f32"]) => (false, true),
            (Rnd::Rn | Rnd::Rz, ["relu", "satfinite", "tf32", "f32"] | ["satfinite", "relu", "tf32", "f32"]) => (true, true),
            _ => return Err(un()),
        };
        if i.operands.len() != 2 {
            return Err(un());
        }
        let d = self.dst(&i.operands[0], line)?;
        let a = self.src(&i.operands[1], Some(FT::F32), line)?;
        Ok(Op::Tf32 { d, a, rnd, relu, satfinite })
    }

    pub(super) fn mbarrier(&mut self, i: &Instruction) -> Result<Op, PtxError> {
        let line = i.line;
        let un = || unsupported(line, i.text());
        let o = &i.operands;
        let verb = i.mods.first().map(String::as_str).ok_or_else(un)?;
        let mut allowed: Vec<&str> = vec!["shared", "shared::cluster", "b64", "release", "acquire", "relaxed", "cta", "cluster"];
        let op = match verb {
            "init" => MbarOp::Init,
            "arrive" | "arrive_drop" => {
                allowed.extend(["expect_tx", "noComplete"]);
                MbarOp::Arrive { drop: verb == "arrive_drop", tx: i.has("expect_tx") }
            }
            "expect_tx" => MbarOp::ExpectTx,
            "complete_tx" => MbarOp::CompleteTx,
            "test_wait" | "try_wait" => {
                allowed.push("parity");
                MbarOp::Wait { parity: i.has("parity") }
            }
            "inval" => MbarOp::Inval,
            "pending_count" => MbarOp::PendingCount,
            _ => return Err(un()),
        };
        for m in &i.mods[1..] {
            if !allowed.contains(&m.as_str()) {
                return Err(un());
            }
        }
        if !i.has("b64") {
            return Err(un());
        }
        let sp = self.shared_or_generic(i)?;
        let mk = |op, d, (base, off): (Src, i64), b| Ok(Op::Mbar(Box::new(Mbar { op, d, sp, base, off, b })));
        let at = |s: &mut Self, k: usize| -> Result<(Src, i64), PtxError> {
            let (b, off, _) = s.addr(o.get(k).ok_or_else(un)?, line)?;
            Ok((b, off))
        };
        match op {
            MbarOp::Init | MbarOp::ExpectTx | MbarOp::CompleteTx if o.len() == 2 => {
                let a = at(self, 0)?;
                let b = self.src(&o[1], None, line)?;
                mk(op, None, a, b)
            }
            MbarOp::Inval if o.len() == 1 => {
                let a = at(self, 0)?;
                mk(op, None, a, Src::C(0))
            }
            MbarOp::Arrive { tx, .. } if (2..=3).contains(&o.len()) && (o.len() == 3 || !tx) && !(i.has("noComplete") && o.len() != 3) => {
                let d = self.dst_opt(&o[0], line)?;
                let a = at(self, 1)?;
                let b = match o.get(2) {
                    Some(x) => self.src(x, None, line)?,
                    None => Src::C(1),
                };
                mk(op, d, a, b)
            }
            MbarOp::Wait { .. } if (3..=4).contains(&o.len()) && !(i.mods[0] == "test_wait" && o.len() == 4) => {
                // try_wait's optional suspend-time hint only bounds how long a GPU may wait.
                let d = self.dst(&o[0], line)?;
                let a = at(self, 1)?;
                let b = self.src(&o[2], None, line)?;
                Ok(Op::MbarWait(Box::new(Mbar { op, d: Some(d), sp, base: a.0, off: a.1, b })))
            }
            MbarOp::PendingCount if o.len() == 2 => {
                let d = self.dst(&o[0], line)?;
                let b = self.src(&o[1], None, line)?;
                mk(op, Some(d), (Src::C(0), 0), b)
            }
            _ => Err(un()),
        }
    }
}

fn shape_of_one(m: &str) -> bool {
    m.len() > 3 && m.starts_with('m') && m.contains('n') && m.contains('k') && m[1..].bytes().all(|c| c.is_ascii_digit() || c == b'n' || c == b'k')
}
