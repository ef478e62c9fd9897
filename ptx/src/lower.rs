//! AST to [`Program`]: one flat instruction array per kernel.
//!
//! Device functions are inlined at each call (their registers, labels and
//! local frames renamed per call site), so the interpreter never keeps a
//! call stack; recursion cannot be inlined and is refused. Symbol addresses
//! are resolved here: module globals through the caller's resolver (device
//! addresses, known once the module's globals are allocated), shared
//! variables to offsets in the block's shared memory, locals and call
//! parameters to offsets in the thread's local memory, kernel parameters to
//! offsets in the parameter buffer.
//!
//! Anything not understood (opcode, modifier, operand form) is an
//! [`PtxError::Unsupported`] naming the instruction and line: refusing is
//! always preferred to running something with a different meaning.

use std::collections::{HashMap, HashSet};

use crate::float::Directed;
use crate::ir::*;
use crate::parse::{self, Ast, Function, Instruction, Operand, Stmt, Var};
use crate::PtxError;

pub(crate) mod tensor;

#[derive(Debug, Clone, Copy)]
enum Sym {
    Global(u64),
    Shared(u64),
    Local(u64),
    KParam(u64),
}

struct Instance {
    /// Register name -> index.
    regs: HashMap<String, u32>,
    /// Declared register names and `<N>` ranges (prefix -> count).
    declared: HashSet<String>,
    ranges: HashMap<String, u32>,
    /// Register names and `<N>` prefixes declared anywhere in the body with a type wider than
    /// 32 bits: they get 64-bit rows ([`WIDE`]), every other register a 32-bit one. A name
    /// declared both ways (inline asm blocks reuse names) is wide: a 64-bit row holds any value.
    wide: HashSet<String>,
    /// Predicate registers declared (names and `<N>` prefixes).
    preds: HashSet<String>,
    scopes: Vec<HashMap<String, Sym>>,
    labels: HashMap<String, u32>,
    /// (instruction index, label) to patch once the body is lowered.
    fixups: Vec<(usize, String)>,
    /// Branches to the end of an inlined body (its `ret`s).
    ret_fixups: Vec<usize>,
    kernel: bool,
    func: String,
}

pub struct Lowerer<'a> {
    ast: &'a Ast,
    funcs: HashMap<&'a str, &'a Function>,
    resolve_global: &'a dyn Fn(&str) -> Option<u64>,
    module_syms: HashMap<String, Sym>,
    /// Function-scope `.shared` variables, by (function, name).
    fn_shared: HashMap<(String, String), u64>,
    insts: Vec<Inst>,
    /// Registers of 32-bit rows allocated (special registers first), and of 64-bit rows.
    nregs: u32,
    nwide: u32,
    local_size: u64,
    stack: Vec<Instance>,
    dyn_shared: u64,
    /// Blocks and inlined calls open now (each is a level of recursion here).
    depth: u32,
    /// Most instructions the kernel may lower to: inlining can grow a small
    /// text exponentially (each function calling the next twice).
    max_insts: usize,
}

/// Deepest recursion of the lowering: nested blocks and inlined calls
/// together, each a few stack frames.
const MAX_DEPTH: u32 = 128;

/// The register names and `<N>` prefixes of `body` (nested blocks included) declared with a
/// type wider than 32 bits, or as vectors.
fn wide_registers(body: &[Stmt]) -> HashSet<String> {
    let mut wide = HashSet::new();
    // Iterative: the nesting is bounded by the parser, but the walk need not rely on it.
    let mut todo = vec![body];
    while let Some(stmts) = todo.pop() {
        for s in stmts {
            match s {
                Stmt::Block(b) => todo.push(b),
                Stmt::Var(v) if v.space == parse::Space::Reg && (v.vec > 1 || !narrow_type(&v.ty)) => {
                    wide.insert(v.name.clone());
                }
                _ => {}
            }
        }
    }
    wide
}

/// Register types whose values fit 32 bits.
fn narrow_type(ty: &str) -> bool {
    matches!(ty, "pred" | "b8" | "u8" | "s8" | "b16" | "u16" | "s16" | "f16" | "bf16" | "b32" | "u32" | "s32" | "f32" | "f16x2" | "bf16x2" | "tf32")
}

fn align_up(v: u64, a: u64) -> u64 {
    v.div_ceil(a.max(1)).saturating_mul(a.max(1))
}

/// Placeholder targets until a body is fully lowered.
const LABEL_TARGET: u32 = u32::MAX - 1;
const RET_TARGET: u32 = u32::MAX;

fn unsupported(line: u32, what: impl Into<String>) -> PtxError {
    PtxError::Unsupported { line, what: what.into() }
}

/// Modifiers that only steer caches, memory ordering or scheduling: the
/// interpreter runs every access sequentially consistent, so they change nothing.
fn harmless(m: &str) -> bool {
    matches!(
        m,
        "ca" | "cg" | "cs" | "lu" | "cv" | "wb" | "wt" | "nc" | "volatile" | "relaxed" | "acquire" | "release"
            | "acq_rel" | "sc" | "weak" | "cta" | "gpu" | "sys" | "cluster" | "uni" | "sync" | "aligned"
            | "mmio" | "L1" | "L2"
    )
}

fn int_ty(t: &str) -> Option<(u8, bool)> {
    Some(match t {
        "u8" | "b8" => (8, false),
        "s8" => (8, true),
        "u16" | "b16" => (16, false),
        "s16" => (16, true),
        "u32" | "b32" => (32, false),
        "s32" => (32, true),
        "u64" | "b64" => (64, false),
        "s64" => (64, true),
        "pred" => (64, false),
        _ => return None,
    })
}

fn float_ty(t: &str) -> Option<FT> {
    Some(match t {
        "f16" => FT::F16,
        "bf16" => FT::BF16,
        "f32" => FT::F32,
        "f64" => FT::F64,
        "f16x2" => FT::F16x2,
        "bf16x2" => FT::BF16x2,
        _ => return None,
    })
}

fn packed_ty(t: &str) -> Option<Packed> {
    Some(match t {
        "f16x2" => Packed::F16x2,
        "bf16x2" => Packed::BF16x2,
        "e4m3x2" => Packed::E4m3x2,
        "e5m2x2" => Packed::E5m2x2,
        _ => return None,
    })
}

fn is_type(t: &str) -> bool {
    parse::type_size(t).is_some()
}

fn cmp_op(m: &str) -> Option<Cmp> {
    Some(match m {
        "eq" => Cmp::Eq,
        "ne" => Cmp::Ne,
        "lt" | "lo" => Cmp::Lt,
        "le" | "ls" => Cmp::Le,
        "gt" | "hi" => Cmp::Gt,
        "ge" | "hs" => Cmp::Ge,
        "equ" => Cmp::Equ,
        "neu" => Cmp::Neu,
        "ltu" => Cmp::Ltu,
        "leu" => Cmp::Leu,
        "gtu" => Cmp::Gtu,
        "geu" => Cmp::Geu,
        "num" => Cmp::Num,
        "nan" => Cmp::Nan,
        _ => return None,
    })
}

/// The generic-address window (shared, local or kernel parameters) an instruction names.
fn window_of(i: &Instruction) -> Option<Space> {
    if i.has("shared") {
        Some(Space::Shared)
    } else if i.has("local") {
        Some(Space::Local)
    } else if i.has("param") {
        Some(Space::KParam)
    } else {
        None
    }
}

/// The directed rounding mode an arithmetic instruction names, if any.
fn directed(i: &Instruction) -> Option<Directed> {
    if i.has("rz") {
        Some(Directed::Zero)
    } else if i.has("rm") {
        Some(Directed::Down)
    } else if i.has("rp") {
        Some(Directed::Up)
    } else {
        None
    }
}

fn rnd_of(m: &str) -> Option<Rnd> {
    Some(match m {
        "rn" => Rnd::Rn,
        "rz" => Rnd::Rz,
        "rm" => Rnd::Rm,
        "rp" => Rnd::Rp,
        "rni" => Rnd::Rni,
        "rzi" => Rnd::Rzi,
        "rmi" => Rnd::Rmi,
        "rpi" => Rnd::Rpi,
        "rna" => Rnd::Rna,
        _ => return None,
    })
}

impl<'a> Lowerer<'a> {
    pub fn new(ast: &'a Ast, resolve_global: &'a dyn Fn(&str) -> Option<u64>, max_insts: usize) -> Self {
        // A definition wins over declarations of the same name (in one pass:
        // a module may declare many functions).
        let defined: HashSet<&str> = ast.funcs.iter().filter(|f| f.body.is_some()).map(|f| f.name.as_str()).collect();
        let funcs = ast.funcs.iter().filter(|f| f.body.is_some() || !defined.contains(f.name.as_str())).map(|f| (f.name.as_str(), f)).collect();
        Lowerer {
            ast,
            funcs,
            resolve_global,
            module_syms: HashMap::new(),
            fn_shared: HashMap::new(),
            insts: Vec::new(),
            nregs: special::COUNT,
            nwide: 0,
            local_size: 0,
            stack: Vec::new(),
            dyn_shared: 0,
            depth: 0,
            max_insts,
        }
    }

    /// Functions reachable from `f` by direct calls (f included), found
    /// with a work list: the call graph's depth is the text's to choose.
    fn reachable(&self, f: &'a Function, seen: &mut Vec<&'a Function>) {
        fn walk<'b>(stmts: &'b [Stmt], out: &mut Vec<&'b str>) {
            for s in stmts {
                match s {
                    Stmt::Inst(i) if i.opcode == "call" => {
                        for o in &i.operands {
                            if let Operand::Name(n) = o {
                                out.push(n);
                            }
                        }
                    }
                    // Bounded by the parser's block depth.
                    Stmt::Block(b) => walk(b, out),
                    _ => {}
                }
            }
        }
        let mut names: HashSet<&str> = seen.iter().map(|g| g.name.as_str()).collect();
        let mut work = vec![f];
        while let Some(f) = work.pop() {
            if !names.insert(f.name.as_str()) {
                continue;
            }
            seen.push(f);
            let mut callees = Vec::new();
            if let Some(b) = &f.body {
                walk(b, &mut callees);
            }
            work.extend(callees.into_iter().rev().filter_map(|c| self.funcs.get(c).copied()));
        }
    }

    pub fn lower_kernel(mut self, name: &str) -> Result<Program, PtxError> {
        let kernel = *self.funcs.get(name).filter(|f| f.entry && f.body.is_some()).ok_or_else(|| PtxError::NoKernel(name.to_string()))?;
        // Static shared layout: module-scope variables, then those declared
        // in the kernel and the functions it calls; dynamic shared memory
        // (every `.extern .shared` array) starts after them.
        let mut shared_end = 0u64;
        let mut extern_shared = Vec::new();
        for v in &self.ast.vars {
            let sym = match v.space {
                parse::Space::Shared if v.is_extern || v.array == Some(0) => {
                    extern_shared.push(v.name.clone());
                    continue;
                }
                parse::Space::Shared => {
                    let off = align_up(shared_end, v.alignment());
                    shared_end = off.saturating_add(v.size());
                    Sym::Shared(off)
                }
                parse::Space::Global | parse::Space::Const => match (self.resolve_global)(&v.name) {
                    Some(a) => Sym::Global(a),
                    // Resolved lazily: an unused global without an address is fine.
                    None => continue,
                },
                _ => continue,
            };
            self.module_syms.insert(v.name.clone(), sym);
        }
        let mut reach = Vec::new();
        self.reachable(kernel, &mut reach);
        let mut fn_extern = Vec::new();
        for f in &reach {
            fn collect(stmts: &[Stmt], out: &mut Vec<Var>) {
                for s in stmts {
                    match s {
                        Stmt::Var(v) if v.space == parse::Space::Shared => out.push(v.clone()),
                        Stmt::Block(b) => collect(b, out),
                        _ => {}
                    }
                }
            }
            let mut vs = Vec::new();
            collect(f.body.as_deref().unwrap_or(&[]), &mut vs);
            for v in vs {
                if v.is_extern || v.array == Some(0) {
                    fn_extern.push((f.name.clone(), v.name.clone()));
                    continue;
                }
                let off = align_up(shared_end, v.alignment());
                shared_end = off.saturating_add(v.size());
                self.fn_shared.insert((f.name.clone(), v.name.clone()), off);
            }
        }
        self.dyn_shared = align_up(shared_end, 16);
        for n in extern_shared {
            self.module_syms.insert(n, Sym::Shared(self.dyn_shared));
        }
        for k in fn_extern {
            self.fn_shared.insert(k, self.dyn_shared);
        }

        // Kernel parameters, laid out as in the kernelParams buffer.
        let mut scope = HashMap::new();
        let mut off = 0u64;
        for p in &kernel.params {
            let o = align_up(off, p.alignment());
            scope.insert(p.name.clone(), Sym::KParam(o));
            off = o.saturating_add(p.size());
        }
        let param_size = off;
        self.lower_body(kernel, scope, true)?;
        let reconv = crate::reconverge::points(&self.insts);
        let mut joins = vec![false; self.insts.len()];
        for &r in &reconv {
            if r != crate::reconverge::NONE {
                joins[r as usize] = true;
            }
        }
        let compiled = crate::exec::Compiled::build(name, &self.insts, &joins);
        Ok(Program {
            name: name.to_string(),
            reconv,
            compiled,
            joins,
            insts: self.insts,
            nregs: self.nregs,
            nwide: self.nwide,
            local_size: align_up(self.local_size, 8),
            shared_static: shared_end,
            dyn_shared_offset: self.dyn_shared,
            param_size,
        })
    }

    fn lower_body(&mut self, f: &'a Function, params: HashMap<String, Sym>, kernel: bool) -> Result<(), PtxError> {
        if self.stack.iter().any(|i| i.func == f.name) {
            return Err(unsupported(f.line, format!("recursive call of {}", f.name)));
        }
        if self.stack.len() > 64 || self.depth >= MAX_DEPTH {
            return Err(unsupported(f.line, "calls nested more than 64 deep (or blocks and calls together 128)"));
        }
        let body = f.body.as_deref().unwrap_or(&[]);
        self.stack.push(Instance {
            regs: HashMap::new(),
            declared: HashSet::new(),
            ranges: HashMap::new(),
            wide: wide_registers(body),
            preds: HashSet::new(),
            scopes: vec![params],
            labels: HashMap::new(),
            fixups: Vec::new(),
            ret_fixups: Vec::new(),
            kernel,
            func: f.name.clone(),
        });
        self.depth += 1;
        let r = self.stmts(body);
        self.depth -= 1;
        let inst = self.stack.pop().expect("pushed above");
        r?;
        let end = self.insts.len() as u32;
        for (i, l) in inst.fixups {
            let t = *inst.labels.get(&l).ok_or_else(|| PtxError::Parse { line: self.insts[i].line, msg: format!("unknown label {l}") })?;
            if let Op::Bra { target } = &mut self.insts[i].op {
                *target = t;
            }
        }
        for i in inst.ret_fixups {
            if let Op::Bra { target } = &mut self.insts[i].op {
                *target = end;
            }
        }
        if kernel {
            self.insts.push(Inst { guard: None, op: Op::Exit, line: f.line });
        }
        Ok(())
    }

    fn cur(&mut self) -> &mut Instance {
        self.stack.last_mut().expect("inside a body")
    }

    fn stmts(&mut self, stmts: &'a [Stmt]) -> Result<(), PtxError> {
        for s in stmts {
            match s {
                Stmt::Label(l) => {
                    let pos = self.insts.len() as u32;
                    self.cur().labels.insert(l.clone(), pos);
                }
                Stmt::Block(b) => {
                    if self.depth >= MAX_DEPTH {
                        return Err(unsupported(self.insts.last().map_or(0, |i| i.line), "blocks and calls nested more than 128 deep"));
                    }
                    self.cur().scopes.push(HashMap::new());
                    self.depth += 1;
                    let r = self.stmts(b);
                    self.depth -= 1;
                    self.cur().scopes.pop();
                    r?;
                }
                Stmt::Var(v) => self.declare(v)?,
                Stmt::Inst(i) => self.inst(i)?,
            }
        }
        Ok(())
    }

    fn alloc_local(&mut self, size: u64, align: u64) -> u64 {
        let o = align_up(self.local_size, align);
        self.local_size = o.saturating_add(size.max(1));
        o
    }

    fn declare(&mut self, v: &Var) -> Result<(), PtxError> {
        let sym = match v.space {
            parse::Space::Reg => {
                let c = self.cur();
                if v.ty == "pred" {
                    c.preds.insert(v.name.clone());
                }
                match v.range {
                    Some(n) => {
                        c.ranges.insert(v.name.clone(), n);
                    }
                    None => {
                        c.declared.insert(v.name.clone());
                    }
                }
                return Ok(());
            }
            parse::Space::Local | parse::Space::Param => Sym::Local(self.alloc_local(v.size(), v.alignment())),
            parse::Space::Shared => {
                let f = self.cur().func.clone();
                Sym::Shared(*self.fn_shared.get(&(f, v.name.clone())).unwrap_or(&self.dyn_shared))
            }
            parse::Space::Global | parse::Space::Const => {
                let a = (self.resolve_global)(&v.name).ok_or_else(|| unsupported(v.line, format!("function-scope global {} has no address", v.name)))?;
                Sym::Global(a)
            }
        };
        self.cur().scopes.last_mut().expect("a scope").insert(v.name.clone(), sym);
        Ok(())
    }

    fn lookup(&self, n: &str) -> Option<Sym> {
        let c = self.stack.last()?;
        for s in c.scopes.iter().rev() {
            if let Some(x) = s.get(n) {
                return Some(*x);
            }
        }
        self.module_syms.get(n).copied()
    }

    fn is_reg(&self, n: &str) -> bool {
        let Some(c) = self.stack.last() else { return false };
        if c.declared.contains(n) || c.regs.contains_key(n) {
            return true;
        }
        let digits = n.trim_end_matches(|ch: char| ch.is_ascii_digit());
        if digits.len() < n.len() {
            if let (Some(&cnt), Ok(i)) = (c.ranges.get(digits), n[digits.len()..].parse::<u32>()) {
                return i < cnt;
            }
        }
        false
    }

    fn reg(&mut self, n: &str, line: u32) -> Result<u32, PtxError> {
        if let Some(s) = special::lookup(n) {
            return Ok(s);
        }
        if n.starts_with("%envreg") {
            return Err(unsupported(line, format!("{n} (only %envreg1 and %envreg2, the grid-sync workspace, are provided)")));
        }
        if !self.is_reg(n) {
            return Err(PtxError::Parse { line, msg: format!("`{n}` is not a declared register") });
        }
        if let Some(&r) = self.cur().regs.get(n) {
            return Ok(r);
        }
        let c = self.stack.last().expect("inside a body");
        let wide = c.wide.contains(n) || c.wide.contains(n.trim_end_matches(|ch: char| ch.is_ascii_digit()));
        let r = if wide { self.new_wide() } else { self.new_narrow() };
        self.cur().regs.insert(n.to_string(), r);
        Ok(r)
    }

    fn new_narrow(&mut self) -> u32 {
        let r = self.nregs;
        self.nregs += 1;
        r
    }

    fn new_wide(&mut self) -> u32 {
        let r = WIDE | self.nwide;
        self.nwide += 1;
        r
    }

    fn sym_value(&self, n: &str, line: u32) -> Result<u64, PtxError> {
        match self.lookup(n) {
            Some(Sym::Global(a) | Sym::Shared(a) | Sym::Local(a) | Sym::KParam(a)) => Ok(a),
            None => {
                if let Some(a) = (self.resolve_global)(n) {
                    return Ok(a);
                }
                if self.funcs.contains_key(n) {
                    return Err(unsupported(line, format!("address of function {n} (indirect calls)")));
                }
                Err(PtxError::Parse { line, msg: format!("unknown symbol `{n}`") })
            }
        }
    }

    /// An instruction of a carry chain (`add.cc`, `addc`, `sub.cc`, `subc`, `mad.cc`, `madc`).
    fn carry(&mut self, i: &Instruction, f: CarryOp, bits: u8, signed: bool, cc_in: bool, cc_out: bool) -> Result<Op, PtxError> {
        let o = &i.operands;
        let n = if matches!(f, CarryOp::MadLo | CarryOp::MadHi) { 4 } else { 3 };
        if o.len() != n || !(bits == 32 || bits == 64) {
            return Err(unsupported(i.line, i.text()));
        }
        let d = self.dst(&o[0], i.line)?;
        let a = self.src(&o[1], None, i.line)?;
        let b = self.src(&o[2], None, i.line)?;
        let c = if n == 4 { self.src(&o[3], None, i.line)? } else { Src::C(0) };
        Ok(Op::Carry { f, bits, signed, cc_in, cc_out, d, a, b, c })
    }

    /// A source operand; `ft` converts float literals to the instruction's type.
    fn src(&mut self, o: &Operand, ft: Option<FT>, line: u32) -> Result<Src, PtxError> {
        Ok(match o {
            // The warp size as a constant: what CUDA C's `warpSize` compiles to.
            Operand::Name(n) if n == "WARP_SZ" && !self.is_reg(n) => Src::C(32),
            Operand::Name(n) => {
                if special::lookup(n).is_some() || self.is_reg(n) {
                    Src::R(self.reg(n, line)?)
                } else if n.starts_with('%') {
                    return Err(unsupported(line, format!("register {n}")));
                } else {
                    Src::C(self.sym_value(n, line)?)
                }
            }
            Operand::Addr { base: Some(n), off } if !self.is_reg(n) => Src::C(self.sym_value(n, line)?.wrapping_add(*off as u64)),
            Operand::Int(v) => match ft {
                Some(FT::F32) => Src::C((*v as f32).to_bits() as u64),
                Some(FT::F64) => Src::C((*v as f64).to_bits()),
                _ => Src::C(*v as u64),
            },
            Operand::F32(b) => match ft {
                Some(FT::F64) => Src::C((f32::from_bits(*b) as f64).to_bits()),
                _ => Src::C(*b as u64),
            },
            Operand::F64(b) => match ft {
                Some(FT::F32) => Src::C((f64::from_bits(*b) as f32).to_bits() as u64),
                _ => Src::C(*b),
            },
            _ => return Err(unsupported(line, format!("operand {o:?}"))),
        })
    }

    fn dst(&mut self, o: &Operand, line: u32) -> Result<u32, PtxError> {
        match o {
            Operand::Name(n) => self.reg(n, line),
            _ => Err(unsupported(line, format!("destination {o:?}"))),
        }
    }

    fn dst_opt(&mut self, o: &Operand, line: u32) -> Result<Option<u32>, PtxError> {
        match o {
            Operand::Sink => Ok(None),
            _ => self.dst(o, line).map(Some),
        }
    }

    /// A predicate source that may be negated (`!p`).
    fn pred_src(&mut self, o: &Operand, line: u32) -> Result<(Src, bool), PtxError> {
        match o {
            Operand::Not(n) => Ok((Src::R(self.reg(n, line)?), true)),
            _ => Ok((self.src(o, None, line)?, false)),
        }
    }

    /// `[base+off]` → (base, offset, symbol's space if the base is a symbol).
    fn addr(&mut self, o: &Operand, line: u32) -> Result<(Src, i64, Option<Sym>), PtxError> {
        match o {
            Operand::Addr { base: None, off } => Ok((Src::C(0), *off, None)),
            Operand::Addr { base: Some(n), off } => {
                if self.is_reg(n) || special::lookup(n).is_some() {
                    Ok((Src::R(self.reg(n, line)?), *off, None))
                } else {
                    let s = self.lookup(n);
                    let v = self.sym_value(n, line)?;
                    Ok((Src::C(v), *off, s))
                }
            }
            _ => Err(unsupported(line, format!("address operand {o:?}"))),
        }
    }

    fn push(&mut self, guard: Option<(u32, bool)>, op: Op, line: u32) {
        self.insts.push(Inst { guard, op, line });
    }

    fn inst(&mut self, i: &'a Instruction) -> Result<(), PtxError> {
        let line = i.line;
        if self.insts.len() >= self.max_insts {
            return Err(unsupported(line, format!("kernels inlined to more than {} instructions", self.max_insts)));
        }
        let guard = match &i.guard {
            Some((g, neg)) => Some((self.reg(g, line)?, *neg)),
            None => None,
        };
        if i.opcode == "call" {
            return self.call(i, guard);
        }
        let op = self.op(i)?;
        if let Some(member) = self.sync_member(i, op.as_ref())? {
            self.push(guard, Op::WarpSync { member }, line);
        }
        if let Some(op) = op {
            let is_ret = op == Op::Bra { target: RET_TARGET };
            if op == (Op::Bra { target: LABEL_TARGET }) {
                // A branch to a label: patched when the body is done.
                let lbl = match i.operands.first() {
                    Some(Operand::Name(l)) => l.clone(),
                    _ => return Err(unsupported(line, "branch target")),
                };
                let pos = self.insts.len();
                self.cur().fixups.push((pos, lbl));
            }
            if is_ret {
                let pos = self.insts.len();
                self.cur().ret_fixups.push(pos);
            }
            self.push(guard, op, line);
        }
        Ok(())
    }

    /// The member mask of a `.sync` warp operation, whose lanes must all arrive before it runs
    /// (`bar.warp.sync` is lowered to the convergence point itself).
    fn sync_member(&mut self, i: &Instruction, op: Option<&Op>) -> Result<Option<Src>, PtxError> {
        let at = match (i.opcode.as_str(), op) {
            (_, None | Some(Op::WarpSync { .. })) => return Ok(None),
            ("shfl", _) => 4,
            ("vote" | "match" | "redux", _) => 2,
            ("elect", _) => 1,
            // Warp-wide matrix operations read (or write) the registers of every lane.
            ("mma" | "wmma" | "ldmatrix" | "stmatrix" | "movmatrix", _) => return Ok(i.has("sync").then_some(Src::C(u32::MAX as u64))),
            _ => return Ok(None),
        };
        if !i.has("sync") {
            return Ok(None);
        }
        self.member(i, &i.operands, at, i.line).map(Some)
    }

    /// Operand `at` as a member mask, all lanes when absent (the pre-`.sync` forms).
    fn member(&mut self, i: &Instruction, o: &[Operand], at: usize, line: u32) -> Result<Src, PtxError> {
        match o.get(at) {
            Some(m) if i.has("sync") => self.src(m, None, line),
            _ => Ok(Src::C(u32::MAX as u64)),
        }
    }

    fn call(&mut self, i: &'a Instruction, guard: Option<(u32, bool)>) -> Result<(), PtxError> {
        let line = i.line;
        for m in &i.mods {
            if m != "uni" {
                return Err(unsupported(line, i.text()));
            }
        }
        let mut ops = i.operands.iter();
        let mut rets: &[Operand] = &[];
        let mut first = ops.next();
        if let Some(Operand::List(r)) = first {
            rets = r;
            first = ops.next();
        }
        let fname = match first {
            Some(Operand::Name(n)) => n.clone(),
            _ => return Err(unsupported(line, "call without a function name")),
        };
        let args: &[Operand] = match ops.next() {
            Some(Operand::List(a)) => a,
            None => &[],
            Some(_) => return Err(unsupported(line, "call argument list")),
        };
        if ops.next().is_some() || self.is_reg(&fname) {
            return Err(unsupported(line, format!("indirect call through {fname}")));
        }
        if fname == "vprintf" {
            if args.len() != 2 {
                return Err(unsupported(line, "vprintf with other than 2 arguments"));
            }
            let fmt = self.param_value(&args[0], line, guard)?;
            let argp = self.param_value(&args[1], line, guard)?;
            let ret = match rets.first() {
                Some(Operand::Name(n)) => match self.lookup(n) {
                    Some(Sym::Local(o)) => Some((Space::Local, o)),
                    _ => return Err(unsupported(line, "vprintf result not in a .param variable")),
                },
                _ => None,
            };
            self.push(guard, Op::Printf { fmt, args: argp, ret }, line);
            return Ok(());
        }
        if fname == "__assertfail" {
            // Device assert(): (message, file, line, function, char size).
            if args.len() != 5 {
                return Err(unsupported(line, "__assertfail with other than 5 arguments"));
            }
            let msg = self.param_value(&args[0], line, guard)?;
            let file = self.param_value(&args[1], line, guard)?;
            let at = self.param_value(&args[2], line, guard)?;
            let func = self.param_value(&args[3], line, guard)?;
            self.push(guard, Op::AssertFail { msg, file, line: at, func }, line);
            return Ok(());
        }
        let f = *self.funcs.get(fname.as_str()).ok_or_else(|| PtxError::Parse { line, msg: format!("call of unknown function {fname}") })?;
        if f.body.is_none() {
            return Err(unsupported(line, format!("call of external function {fname}")));
        }
        if guard.is_some() {
            // A guarded call: branch around the inlined body.
            let (g, neg) = guard.expect("checked");
            let pos = self.insts.len();
            self.push(Some((g, !neg)), Op::Bra { target: 0 }, line);
            self.call_inline(f, rets, args, line)?;
            let end = self.insts.len() as u32;
            self.insts[pos].op = Op::Bra { target: end };
            return Ok(());
        }
        self.call_inline(f, rets, args, line)
    }

    /// A .param argument's value (vprintf takes its arguments by value).
    fn param_value(&mut self, o: &Operand, line: u32, guard: Option<(u32, bool)>) -> Result<Src, PtxError> {
        if let Operand::Name(n) = o {
            if let Some(Sym::Local(off)) = self.lookup(n) {
                let r = self.new_wide();
                self.push(guard, Op::Ld { sp: Space::Local, size: 8, sext: false, strong: false, ds: vec![Some(r)], base: Src::C(off), off: 0 }, line);
                return Ok(Src::R(r));
            }
        }
        self.src(o, None, line)
    }

    fn call_inline(&mut self, f: &'a Function, rets: &[Operand], args: &[Operand], line: u32) -> Result<(), PtxError> {
        if args.len() != f.params.len() || rets.len() > f.rets.len() {
            return Err(PtxError::Parse { line, msg: format!("call of {} with the wrong number of arguments", f.name) });
        }
        let mut scope = HashMap::new();
        for (a, p) in args.iter().zip(&f.params) {
            let bound = match a {
                Operand::Name(n) if !self.is_reg(n) => match self.lookup(n) {
                    Some(Sym::Local(o)) => Some(o),
                    _ => None,
                },
                _ => None,
            };
            let slot = match bound {
                Some(o) => o,
                None => {
                    let v = self.src(a, None, line)?;
                    let o = self.alloc_local(p.size().max(8), 8);
                    self.push(None, Op::St { sp: Space::Local, size: 8, vals: vec![v], base: Src::C(o), off: 0 }, line);
                    o
                }
            };
            scope.insert(p.name.clone(), Sym::Local(slot));
        }
        let mut copy_back = Vec::new();
        for (k, p) in f.rets.iter().enumerate() {
            let slot = match rets.get(k) {
                Some(Operand::Name(n)) if !self.is_reg(n) => match self.lookup(n) {
                    Some(Sym::Local(o)) => o,
                    _ => return Err(unsupported(line, format!("return value into {n}"))),
                },
                Some(o) => {
                    let d = self.dst(o, line)?;
                    let s = self.alloc_local(p.size().max(8), 8);
                    copy_back.push((d, s, p.size().min(8) as u8));
                    s
                }
                None => self.alloc_local(p.size().max(8), 8),
            };
            scope.insert(p.name.clone(), Sym::Local(slot));
        }
        self.lower_body(f, scope, false)?;
        for (d, s, size) in copy_back {
            self.push(None, Op::Ld { sp: Space::Local, size, sext: false, strong: false, ds: vec![Some(d)], base: Src::C(s), off: 0 }, line);
        }
        Ok(())
    }

    /// One instruction; `None` for instructions that do nothing here.
    /// Branches come back with target `u32::MAX - 1` (label fixup) and
    /// inlined `ret`s with `u32::MAX` (end-of-body fixup).
    fn op(&mut self, i: &'a Instruction) -> Result<Option<Op>, PtxError> {
        let line = i.line;
        let un = || unsupported(line, i.text());
        let o = &i.operands;
        let need = |n: usize| -> Result<(), PtxError> {
            if o.len() == n {
                Ok(())
            } else {
                Err(PtxError::Parse { line, msg: format!("{} takes {n} operands, got {}", i.text(), o.len()) })
            }
        };
        let types: Vec<&str> = i.mods.iter().map(String::as_str).filter(|m| is_type(m)).collect();
        let ty = types.last().copied().unwrap_or("");
        // Every modifier must be understood by the arm below (or harmless).
        let check = |allowed: &[&str]| -> Result<(), PtxError> {
            for m in &i.mods {
                if !(is_type(m) || harmless(m) || allowed.contains(&m.as_str())) {
                    return Err(unsupported(line, i.text()));
                }
            }
            Ok(())
        };
        let fmod = FMod { ftz: i.has("ftz"), sat: i.has("sat"), relu: i.has("relu") };
        let small = matches!(float_ty(ty), Some(FT::F16 | FT::BF16 | FT::F16x2 | FT::BF16x2));
        if fmod.relu && i.opcode != "cvt" && !(small && matches!(i.opcode.as_str(), "fma" | "min" | "max")) {
            return Err(un());
        }
        let op = match i.opcode.as_str() {
            "mov" => {
                check(&[])?;
                need(2)?;
                let bits = int_ty(ty).map(|t| t.0).or_else(|| parse::type_size(ty).map(|s| (s * 8) as u8)).ok_or_else(un)?;
                match (&o[0], &o[1]) {
                    (Operand::Vector(ds), a) => {
                        let mut v = Vec::new();
                        for d in ds {
                            v.push(self.dst_opt(d, line)?);
                        }
                        let pbits = bits / ds.len() as u8;
                        Op::Unpack { ds: v, a: self.src(a, None, line)?, pbits }
                    }
                    (d, Operand::Vector(ps)) => {
                        let mut v = Vec::new();
                        for p in ps {
                            v.push(self.src(p, None, line)?);
                        }
                        let pbits = bits / ps.len() as u8;
                        Op::Pack { d: self.dst(d, line)?, parts: v, pbits }
                    }
                    (d, Operand::Name(n)) if matches!(n.as_str(), "%clock" | "%clock64" | "%globaltimer" | "%clock_hi" | "%globaltimer_lo" | "%globaltimer_hi") => {
                        let kind = match n.as_str() {
                            "%clock" => ClockKind::Clock,
                            "%clock64" => ClockKind::Clock64,
                            "%globaltimer" => ClockKind::GlobalTimer,
                            _ => return Err(unsupported(line, n.clone())),
                        };
                        Op::Clock { d: self.dst(d, line)?, kind }
                    }
                    (d, a) => {
                        let ft = float_ty(ty);
                        Op::Mov { bits, d: self.dst(d, line)?, a: self.src(a, ft, line)? }
                    }
                }
            }
            "add" | "sub" | "mul" | "div" | "rem" | "min" | "max" | "and" | "or" | "xor" | "shl" | "shr" | "mul24" | "copysign" => {
                need(3)?;
                if let Some(ft) = float_ty(ty) {
                    if let Some(mode) = directed(i) {
                        check(&["rz", "rm", "rp", "ftz", "sat"])?;
                        let f = match (i.opcode.as_str(), ft) {
                            ("add", FT::F32 | FT::F64) => FDir::Add,
                            ("sub", FT::F32 | FT::F64) => FDir::Sub,
                            ("mul", FT::F32 | FT::F64) => FDir::Mul,
                            ("div", FT::F32) => FDir::Div,
                            _ => return Err(un()),
                        };
                        let d = self.dst(&o[0], line)?;
                        let (a, b) = (self.src(&o[1], Some(ft), line)?, self.src(&o[2], Some(ft), line)?);
                        return Ok(Some(Op::FDirected { f, t: ft, mode, m: fmod, d, a, b, c: Src::C(0) }));
                    }
                    check(&["rn", "ftz", "sat", "approx", "full", "NaN", "relu"])?;
                    let f = match (i.opcode.as_str(), i.has("NaN")) {
                        ("add", false) => F2::Add,
                        ("sub", false) => F2::Sub,
                        ("mul", false) => F2::Mul,
                        ("div", false) => F2::Div,
                        ("min", false) => F2::Min,
                        ("max", false) => F2::Max,
                        ("min", true) => F2::MinNaN,
                        ("max", true) => F2::MaxNaN,
                        ("copysign", false) => F2::Copysign,
                        _ => return Err(un()),
                    };
                    let d = self.dst(&o[0], line)?;
                    let (a, b) = (self.src(&o[1], Some(ft), line)?, self.src(&o[2], Some(ft), line)?);
                    Op::F2 { f, t: ft, m: fmod, d, a, b }
                } else if let (Some(signed), "min" | "max") = (match ty { "s16x2" => Some(true), "u16x2" => Some(false), _ => None }, i.opcode.as_str()) {
                    check(&[])?;
                    let f = if i.opcode == "min" { I2::MinX2 } else { I2::MaxX2 };
                    let d = self.dst(&o[0], line)?;
                    let (a, b) = (self.src(&o[1], None, line)?, self.src(&o[2], None, line)?);
                    Op::I2 { f, bits: 32, signed, d, a, b }
                } else {
                    let (bits, signed) = int_ty(ty).ok_or_else(un)?;
                    if i.has("cc") {
                        check(&["cc"])?;
                        let f = match i.opcode.as_str() {
                            "add" => CarryOp::Add,
                            "sub" => CarryOp::Sub,
                            _ => return Err(un()),
                        };
                        return self.carry(i, f, bits, signed, false, true).map(Some);
                    }
                    check(&["lo", "hi", "wide", "sat"])?;
                    let f = match (i.opcode.as_str(), i.has("hi"), i.has("wide"), i.has("sat")) {
                        ("add", false, false, false) => I2::Add,
                        ("add", false, false, true) if bits == 32 && signed => I2::AddSat,
                        ("sub", false, false, false) => I2::Sub,
                        ("sub", false, false, true) if bits == 32 && signed => I2::SubSat,
                        ("mul", false, false, false) => I2::MulLo,
                        ("mul", true, false, false) => I2::MulHi,
                        ("mul", false, true, false) if bits <= 32 => I2::MulWide,
                        ("mul24", false, false, false) if bits == 32 => I2::Mul24Lo,
                        ("div", false, false, false) => I2::Div,
                        ("rem", false, false, false) => I2::Rem,
                        ("min", false, false, false) => I2::Min,
                        ("max", false, false, false) => I2::Max,
                        ("and", false, false, false) => I2::And,
                        ("or", false, false, false) => I2::Or,
                        ("xor", false, false, false) => I2::Xor,
                        ("shl", false, false, false) => I2::Shl,
                        ("shr", false, false, false) => I2::Shr,
                        _ => return Err(un()),
                    };
                    let d = self.dst(&o[0], line)?;
                    let (a, b) = (self.src(&o[1], None, line)?, self.src(&o[2], None, line)?);
                    Op::I2 { f, bits, signed, d, a, b }
                }
            }
            "addc" | "subc" | "madc" => {
                let (bits, signed) = int_ty(ty).ok_or_else(un)?;
                let f = match (i.opcode.as_str(), i.has("hi")) {
                    ("addc", false) => CarryOp::Add,
                    ("subc", false) => CarryOp::Sub,
                    ("madc", false) => CarryOp::MadLo,
                    ("madc", true) => CarryOp::MadHi,
                    _ => return Err(un()),
                };
                check(if f == CarryOp::MadLo || f == CarryOp::MadHi { &["lo", "hi", "cc"] } else { &["cc"] })?;
                self.carry(i, f, bits, signed, true, i.has("cc"))?
            }
            "mad" | "fma" | "mad24" => {
                need(4)?;
                if let Some(ft) = float_ty(ty) {
                    let mode = directed(i);
                    check(&["rn", "rz", "rm", "rp", "ftz", "sat", "relu"])?;
                    let d = self.dst(&o[0], line)?;
                    let (a, b, c) = (self.src(&o[1], Some(ft), line)?, self.src(&o[2], Some(ft), line)?, self.src(&o[3], Some(ft), line)?);
                    match mode {
                        None => Op::Fma { t: ft, m: fmod, d, a, b, c },
                        Some(mode) if ft == FT::F32 => Op::FDirected { f: FDir::Fma, t: ft, mode, m: fmod, d, a, b, c },
                        Some(_) => return Err(un()),
                    }
                } else if i.has("cc") {
                    check(&["lo", "hi", "cc"])?;
                    let (bits, signed) = int_ty(ty).ok_or_else(un)?;
                    let f = if i.has("hi") { CarryOp::MadHi } else { CarryOp::MadLo };
                    if i.opcode != "mad" {
                        return Err(un());
                    }
                    return self.carry(i, f, bits, signed, false, true).map(Some);
                } else {
                    check(&["lo", "hi", "wide"])?;
                    let (bits, signed) = int_ty(ty).ok_or_else(un)?;
                    let f = match (i.opcode.as_str(), i.has("hi"), i.has("wide")) {
                        ("mad", false, false) => I3::MadLo,
                        ("mad", true, false) => I3::MadHi,
                        ("mad", false, true) if bits <= 32 => I3::MadWide,
                        ("mad24", false, false) if bits == 32 => I3::Mad24Lo,
                        _ => return Err(un()),
                    };
                    let d = self.dst(&o[0], line)?;
                    let (a, b, c) = (self.src(&o[1], None, line)?, self.src(&o[2], None, line)?, self.src(&o[3], None, line)?);
                    Op::I3 { f, bits, signed, d, a, b, c }
                }
            }
            "neg" | "abs" | "not" | "cnot" | "popc" | "clz" | "brev" | "bfind" | "sqrt" | "rsqrt" | "rcp" | "ex2" | "lg2" | "sin" | "cos" | "tanh" => {
                need(2)?;
                if let (Some(FT::F32), Some(mode)) = (float_ty(ty), directed(i)) {
                    check(&["rz", "rm", "rp", "ftz"])?;
                    let d = self.dst(&o[0], line)?;
                    let x = self.src(&o[1], Some(FT::F32), line)?;
                    return Ok(Some(match i.opcode.as_str() {
                        "sqrt" => Op::FDirected { f: FDir::Sqrt, t: FT::F32, mode, m: fmod, d, a: x, b: Src::C(0), c: Src::C(0) },
                        "rcp" => Op::FDirected { f: FDir::Div, t: FT::F32, mode, m: fmod, d, a: Src::C(1.0f32.to_bits() as u64), b: x, c: Src::C(0) },
                        _ => return Err(un()),
                    }));
                }
                if let Some(ft) = float_ty(ty) {
                    check(&["rn", "ftz", "approx", "full"])?;
                    let f = match i.opcode.as_str() {
                        "neg" => F1::Neg,
                        "abs" => F1::Abs,
                        "sqrt" => F1::Sqrt,
                        "rsqrt" => F1::Rsqrt,
                        "rcp" => F1::Rcp,
                        "ex2" => F1::Ex2,
                        "lg2" => F1::Lg2,
                        "sin" => F1::Sin,
                        "cos" => F1::Cos,
                        "tanh" => F1::Tanh,
                        _ => return Err(un()),
                    };
                    let d = self.dst(&o[0], line)?;
                    Op::F1 { f, t: ft, m: fmod, d, a: self.src(&o[1], Some(ft), line)? }
                } else {
                    check(&["shiftamt"])?;
                    let (bits, signed) = if ty == "pred" { (1, false) } else { int_ty(ty).ok_or_else(un)? };
                    let f = match (i.opcode.as_str(), ty) {
                        ("not", "pred") | ("cnot", _) => I1::CNot,
                        ("neg", _) => I1::Neg,
                        ("abs", _) => I1::Abs,
                        ("not", _) => I1::Not,
                        ("popc", _) => I1::Popc,
                        ("clz", _) => I1::Clz,
                        ("brev", _) => I1::Brev,
                        ("bfind", _) if i.has("shiftamt") => I1::BfindShift,
                        ("bfind", _) => I1::Bfind,
                        _ => return Err(un()),
                    };
                    let d = self.dst(&o[0], line)?;
                    Op::I1 { f, bits, signed, d, a: self.src(&o[1], None, line)? }
                }
            }
            "bfe" | "prmt" | "sad" => {
                check(&[])?;
                need(4)?;
                let (bits, signed) = int_ty(ty).ok_or_else(un)?;
                let f = match i.opcode.as_str() {
                    "bfe" => I3::Bfe,
                    "prmt" => I3::Prmt,
                    _ => I3::Sad,
                };
                let d = self.dst(&o[0], line)?;
                let (a, b, c) = (self.src(&o[1], None, line)?, self.src(&o[2], None, line)?, self.src(&o[3], None, line)?);
                Op::I3 { f, bits, signed, d, a, b, c }
            }
            "shf" => {
                // Funnel shift of the 64 bits b:a by c (mod 32 with .wrap, at most 32 with .clamp).
                check(&["l", "r", "wrap", "clamp"])?;
                need(4)?;
                let f = match (i.has("l"), i.has("r"), i.has("wrap"), i.has("clamp")) {
                    (true, false, true, false) => I3::ShfLWrap,
                    (true, false, false, true) => I3::ShfLClamp,
                    (false, true, true, false) => I3::ShfRWrap,
                    (false, true, false, true) => I3::ShfRClamp,
                    _ => return Err(un()),
                };
                let d = self.dst(&o[0], line)?;
                let (a, b, c) = (self.src(&o[1], None, line)?, self.src(&o[2], None, line)?, self.src(&o[3], None, line)?);
                Op::I3 { f, bits: 32, signed: false, d, a, b, c }
            }
            "bfi" => {
                check(&[])?;
                need(5)?;
                let (bits, _) = int_ty(ty).ok_or_else(un)?;
                let d = self.dst(&o[0], line)?;
                let (a, b, c, e) = (self.src(&o[1], None, line)?, self.src(&o[2], None, line)?, self.src(&o[3], None, line)?, self.src(&o[4], None, line)?);
                Op::Bfi { bits, d, a, b, c, e }
            }
            "setp" | "set" => {
                let cmp = i.mods.first().and_then(|m| cmp_op(m)).ok_or_else(un)?;
                check(&[i.mods[0].as_str(), "and", "or", "xor", "ftz"])?;
                // `d, a, b`, and `c` with a boolean operation.
                if !(3..=4).contains(&o.len()) {
                    return Err(PtxError::Parse { line, msg: format!("{} takes 3 or 4 operands, got {}", i.text(), o.len()) });
                }
                let sty = ty;
                let t = match float_ty(sty) {
                    Some(f) => CmpTy::Float(f),
                    None => {
                        let (bits, signed) = int_ty(sty).ok_or_else(un)?;
                        CmpTy::Int { bits, signed }
                    }
                };
                let ft = float_ty(sty);
                let bop = if i.has("and") {
                    Some(BoolOp::And)
                } else if i.has("or") {
                    Some(BoolOp::Or)
                } else if i.has("xor") {
                    Some(BoolOp::Xor)
                } else {
                    None
                };
                let comb = match (bop, o.get(3)) {
                    (Some(b), Some(p)) => {
                        let (s, n) = self.pred_src(p, line)?;
                        Some((b, s, n))
                    }
                    (None, None) => None,
                    _ => return Err(un()),
                };
                let a = self.src(&o[1], ft, line)?;
                let b = self.src(&o[2], ft, line)?;
                if i.opcode == "setp" {
                    let (d, d2) = match &o[0] {
                        Operand::Pair(p, q) => (Some(self.reg(p, line)?), Some(self.reg(q, line)?)),
                        other => (self.dst_opt(other, line)?, None),
                    };
                    if matches!(ft, Some(FT::F16x2 | FT::BF16x2)) && d2.is_none() {
                        // The packed forms write one predicate per half: `p|q` is required.
                        return Err(un());
                    }
                    Op::Setp { cmp, t, d, d2, a, b, comb }
                } else {
                    if types.len() != 2 {
                        return Err(un());
                    }
                    let pairs = matches!(ft, Some(FT::F16x2 | FT::BF16x2));
                    let yes = match (types[0], pairs) {
                        ("f32", false) => 1.0f32.to_bits() as u64,
                        ("f16", false) | ("f16x2", true) => 0x3c00,
                        ("bf16", false) | ("bf16x2", true) => 0x3f80,
                        ("u16" | "s16" | "b16", false) | ("u32" | "s32" | "b32", true) => 0xffff,
                        ("u32" | "s32" | "b32", false) => 0xffff_ffff,
                        _ => return Err(un()),
                    };
                    let d = self.dst(&o[0], line)?;
                    Op::Set { cmp, t, yes, d, a, b, comb }
                }
            }
            "selp" => {
                check(&[])?;
                need(4)?;
                let ft = float_ty(ty);
                let d = self.dst(&o[0], line)?;
                let (a, b) = (self.src(&o[1], ft, line)?, self.src(&o[2], ft, line)?);
                Op::Selp { d, a, b, p: self.src(&o[3], None, line)? }
            }
            "cvt" if i.mods.iter().any(|m| packed_ty(m).is_some()) => {
                // cvt.rn{.relu}{.satfinite}.TOx2.f32 d, a, b  and  cvt.rn{.relu}{.satfinite}.TOx2.FROMx2 d, a
                check(&["rn", "relu", "satfinite", "e4m3x2", "e5m2x2"])?;
                if !i.has("rn") || types.len() + i.mods.iter().filter(|m| m.ends_with("m3x2") || m.ends_with("m2x2")).count() != 2 {
                    return Err(un());
                }
                let tys: Vec<&str> = i.mods.iter().map(String::as_str).filter(|m| is_type(m) || packed_ty(m).is_some()).collect();
                let to = packed_ty(tys[0]).ok_or_else(un)?;
                let from = match tys[1] {
                    "f32" => None,
                    t => Some(packed_ty(t).ok_or_else(un)?),
                };
                let fp8 = |p: Packed| matches!(p, Packed::E4m3x2 | Packed::E5m2x2);
                let ok = match from {
                    None => !fp8(to) || i.has("satfinite"),
                    Some(f) if fp8(f) => to == Packed::F16x2,
                    Some(Packed::F16x2) => fp8(to) && i.has("satfinite"),
                    Some(_) => false,
                };
                if !ok {
                    return Err(un());
                }
                let d = self.dst(&o[0], line)?;
                let a = self.src(&o[1], None, line)?;
                let b = match from {
                    None => self.src(o.get(2).ok_or_else(un)?, None, line)?,
                    Some(_) => Src::C(0),
                };
                Op::CvtX2 { to, from, relu: i.has("relu"), satfinite: i.has("satfinite"), d, a, b }
            }
            "cvt" if i.has("tf32") => return self.cvt_tf32(i).map(Some),
            "cvt" => {
                check(&["rn", "rz", "rm", "rp", "rni", "rzi", "rmi", "rpi", "sat", "ftz"])?;
                need(2)?;
                if types.len() != 2 {
                    return Err(un());
                }
                let cv = |t: &str| -> Option<CvtTy> {
                    float_ty(t).map(CvtTy::Float).or_else(|| int_ty(t).filter(|_| t != "pred").map(|(bits, signed)| CvtTy::Int { bits, signed }))
                };
                let (to, from) = (cv(types[0]).ok_or_else(un)?, cv(types[1]).ok_or_else(un)?);
                if matches!(to, CvtTy::Float(FT::F16x2 | FT::BF16x2)) || matches!(from, CvtTy::Float(FT::F16x2 | FT::BF16x2)) {
                    return Err(un());
                }
                let rnd = i.mods.iter().find_map(|m| rnd_of(m)).unwrap_or(Rnd::None);
                let d = self.dst(&o[0], line)?;
                Op::Cvt { to, from, rnd, sat: i.has("sat"), ftz: i.has("ftz"), d, a: self.src(&o[1], None, line)? }
            }
            "isspacep" => {
                // Which window a generic address falls in. `.const` data lives in the sim's
                // global memory, so a generic pointer cannot be told to be constant: refused.
                check(&["global", "shared", "local", "param"])?;
                need(2)?;
                let sp = window_of(i).or(i.has("global").then_some(Space::Global)).ok_or_else(un)?;
                let d = self.dst(&o[0], line)?;
                Op::IsSpace { sp, d, a: self.src(&o[1], None, line)? }
            }
            "cvta" => {
                check(&["to", "global", "shared", "local", "const", "param"])?;
                need(2)?;
                let sp = window_of(i).unwrap_or(Space::Global);
                let d = self.dst(&o[0], line)?;
                Op::Cvta { to_generic: !i.has("to"), sp, d, a: self.src(&o[1], None, line)? }
            }
            "ld" | "ldu" | "st" => {
                check(&["global", "shared", "local", "const", "param", "v2", "v4", "v8"])?;
                need(2)?;
                let size = parse::type_size(ty).ok_or_else(un)? as u8;
                let sext = ty.starts_with('s');
                let is_ld = i.opcode != "st";
                let (ao, vo) = if is_ld { (&o[1], &o[0]) } else { (&o[0], &o[1]) };
                let (base, off, sym) = self.addr(ao, line)?;
                let sp = self.space(i, sym, line)?;
                if is_ld {
                    let ds = match vo {
                        Operand::Vector(v) => {
                            let mut ds = Vec::new();
                            for d in v {
                                ds.push(self.dst_opt(d, line)?);
                            }
                            ds
                        }
                        d => vec![Some(self.dst(d, line)?)],
                    };
                    let strong = ["volatile", "relaxed", "acquire"].iter().any(|m| i.has(m));
                    Op::Ld { sp, size, sext, strong, ds, base, off }
                } else {
                    let ft = float_ty(ty);
                    let vals = match vo {
                        Operand::Vector(v) => {
                            let mut vs = Vec::new();
                            for s in v {
                                vs.push(self.src(s, ft, line)?);
                            }
                            vs
                        }
                        s => vec![self.src(s, ft, line)?],
                    };
                    Op::St { sp, size, vals, base, off }
                }
            }
            "atom" | "red" => {
                check(&["global", "shared", "add", "min", "max", "inc", "dec", "and", "or", "xor", "exch", "cas", "noftz"])?;
                let aop = [("add", AtomOp::Add), ("min", AtomOp::Min), ("max", AtomOp::Max), ("inc", AtomOp::Inc), ("dec", AtomOp::Dec), ("and", AtomOp::And), ("or", AtomOp::Or), ("xor", AtomOp::Xor), ("exch", AtomOp::Exch), ("cas", AtomOp::Cas)]
                    .iter()
                    .find(|(n, _)| i.has(n))
                    .map(|x| x.1)
                    .ok_or_else(un)?;
                let t = match ty {
                    "u32" => AtomTy::U32,
                    "s32" => AtomTy::S32,
                    "u64" => AtomTy::U64,
                    "s64" => AtomTy::S64,
                    "f32" => AtomTy::F32,
                    "f64" => AtomTy::F64,
                    "b32" => AtomTy::B32,
                    "b64" => AtomTy::B64,
                    _ => return Err(un()),
                };
                let is_atom = i.opcode == "atom";
                let n = if is_atom { 3 } else { 2 } + usize::from(aop == AtomOp::Cas);
                need(n)?;
                let mut k = 0;
                let d = if is_atom {
                    k = 1;
                    self.dst_opt(&o[0], line)?
                } else {
                    None
                };
                let (base, off, sym) = self.addr(&o[k], line)?;
                let sp = self.space(i, sym, line)?;
                if !matches!(sp, Space::Global | Space::Shared | Space::Generic) {
                    return Err(un());
                }
                let ft = float_ty(ty);
                let b = self.src(&o[k + 1], ft, line)?;
                let c = if aop == AtomOp::Cas { Some(self.src(&o[k + 2], ft, line)?) } else { None };
                Op::Atom { sp, op: aop, t, d, base, off, b, c }
            }
            "bra" => {
                check(&[])?;
                need(1)?;
                Op::Bra { target: LABEL_TARGET }
            }
            "ret" => {
                check(&[])?;
                if self.cur().kernel {
                    Op::Exit
                } else {
                    Op::Bra { target: RET_TARGET }
                }
            }
            "exit" => Op::Exit,
            "bar" | "barrier" => {
                if i.has("warp") {
                    check(&["warp", "sync"])?;
                    need(1)?;
                    Op::WarpSync { member: self.src(&o[0], None, line)? }
                } else if i.has("arrive") {
                    // Producer/consumer named barriers are not modelled.
                    return Err(un());
                } else {
                    check(&["sync", "red", "popc", "and", "or", "aligned"])?;
                    if i.has("red") {
                        need(3)?;
                        let r = if i.has("popc") {
                            BarRed::Popc
                        } else if i.has("and") {
                            BarRed::And
                        } else {
                            BarRed::Or
                        };
                        let d = self.dst(&o[0], line)?;
                        let (p, n) = self.pred_src(&o[2], line)?;
                        Op::Bar { red: Some((r, d, p, n)) }
                    } else {
                        Op::Bar { red: None }
                    }
                }
            }
            "membar" | "fence" => {
                // `fence.proxy.async`: the sim's asynchronous copies are done when issued, so the
                // generic and async proxies see the same memory; `fence.mbarrier_init` likewise.
                check(&["proxy", "alias", "async", "acq_rel", "sc", "cta", "gl", "sys", "gpu", "shared", "global", "mbarrier_init"])?;
                return Ok(None);
            }
            // Programmatic dependent launch: `wait` holds until the grids this one depends on
            // are done and their memory visible. The sim runs a stream's grids one after another,
            // so they always are; `launch_dependents` only lets the next grid start early.
            "griddepcontrol" => {
                check(&["wait", "launch_dependents"])?;
                return Ok(None);
            }
            "nanosleep" | "prefetch" | "prefetchu" | "pmevent" => return Ok(None),
            "trap" => Op::Trap,
            "shfl" => {
                check(&["up", "down", "bfly", "idx"])?;
                let mode = if i.has("up") {
                    ShflMode::Up
                } else if i.has("down") {
                    ShflMode::Down
                } else if i.has("bfly") {
                    ShflMode::Bfly
                } else if i.has("idx") {
                    ShflMode::Idx
                } else {
                    return Err(un());
                };
                if o.len() < 4 {
                    return Err(un());
                }
                let (d, dp) = match &o[0] {
                    Operand::Pair(p, q) => (self.reg(p, line)?, Some(self.reg(q, line)?)),
                    other => (self.dst(other, line)?, None),
                };
                let (a, b, c) = (self.src(&o[1], None, line)?, self.src(&o[2], None, line)?, self.src(&o[3], None, line)?);
                Op::Shfl { mode, d, dp, a, b, c }
            }
            "vote" => {
                check(&["all", "any", "uni", "ballot"])?;
                let mode = if i.has("all") {
                    VoteMode::All
                } else if i.has("any") {
                    VoteMode::Any
                } else if i.has("uni") {
                    VoteMode::Uni
                } else if i.has("ballot") {
                    VoteMode::Ballot
                } else {
                    return Err(un());
                };
                if o.len() < 2 {
                    return Err(un());
                }
                let d = self.dst(&o[0], line)?;
                let (p, neg) = self.pred_src(&o[1], line)?;
                Op::Vote { mode, d, p, neg, member: self.member(i, o, 2, line)? }
            }
            "match" => {
                check(&["any", "all"])?;
                if o.len() < 2 {
                    return Err(un());
                }
                let bits = int_ty(ty).ok_or_else(un)?.0;
                let (d, dp) = match &o[0] {
                    Operand::Pair(p, q) => (self.reg(p, line)?, Some(self.reg(q, line)?)),
                    other => (self.dst(other, line)?, None),
                };
                Op::Match { all: i.has("all"), bits, d, dp, a: self.src(&o[1], None, line)?, member: self.member(i, o, 2, line)? }
            }
            "redux" => {
                // The integer forms; the f32 min/max of sm_100a are left to the error below.
                check(&["sync", "add", "min", "max", "and", "or", "xor"])?;
                need(3)?;
                let (bits, signed) = int_ty(ty).ok_or_else(un)?;
                if bits != 32 {
                    return Err(un());
                }
                let op = [("add", ReduxOp::Add), ("min", ReduxOp::Min), ("max", ReduxOp::Max), ("and", ReduxOp::And), ("or", ReduxOp::Or), ("xor", ReduxOp::Xor)]
                    .into_iter()
                    .find(|(m, _)| i.has(m))
                    .map(|(_, op)| op)
                    .ok_or_else(un)?;
                Op::Redux { op, signed, d: self.dst(&o[0], line)?, a: self.src(&o[1], None, line)?, member: self.member(i, o, 2, line)? }
            }
            "mma" | "wmma" | "ldmatrix" | "stmatrix" | "movmatrix" => return self.matrix_op(i).map(Some),
            "cp" if i.mods.first().is_some_and(|m| m == "async") => return self.cp_async(i).map(Some),
            "mbarrier" => return self.mbarrier(i).map(Some),
            "elect" => {
                check(&[])?;
                need(2)?;
                let (d, p) = match &o[0] {
                    Operand::Pair(d, p) if d == "_" => (None, self.reg(p, line)?),
                    Operand::Pair(d, p) => (Some(self.reg(d, line)?), self.reg(p, line)?),
                    _ => return Err(un()),
                };
                if !i.has("sync") {
                    return Err(un());
                }
                Op::Elect { d, p, member: self.src(&o[1], None, line)? }
            }
            "activemask" => {
                need(1)?;
                Op::Activemask { d: self.dst(&o[0], line)? }
            }
            _ => return Err(un()),
        };
        Ok(Some(op))
    }

    /// The state space of a load, store or atomic: its modifier, or for a
    /// `.param` access the space its symbol was placed in.
    fn space(&self, i: &Instruction, sym: Option<Sym>, line: u32) -> Result<Space, PtxError> {
        Ok(if i.has("global") || i.has("const") {
            Space::Global
        } else if i.has("shared") {
            Space::Shared
        } else if i.has("local") {
            Space::Local
        } else if i.has("param") {
            match sym {
                Some(Sym::Local(_)) => Space::Local,
                Some(Sym::KParam(_)) | None => Space::KParam,
                Some(_) => return Err(unsupported(line, i.text())),
            }
        } else {
            Space::Generic
        })
    }
}
