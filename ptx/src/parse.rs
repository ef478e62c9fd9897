//! PTX text to an AST: tokens carry line numbers, so every error names the
//! line and the token it stopped at.
//!
//! The grammar covered is what nvcc 12/13 emits for ordinary kernels:
//! module directives, `.entry`/`.func` (declarations and definitions),
//! module- and function-scope variables, `.reg` declarations (with `<N>`
//! ranges), labels, guards, instructions with dotted modifiers and operands
//! (registers, immediates, symbols, `[addr+off]`, `{vectors}`, `d|p` pairs,
//! `!p`, parenthesised call lists). Debug sections and `.loc`/`.file` lines
//! are skipped.

use crate::PtxError;

#[derive(Debug, Clone, PartialEq)]
pub enum Tok {
    /// Identifier, register (`%r1`) or label (`$L__BB0_2`).
    Ident(String),
    /// `.word`: directive, type or modifier (without the dot).
    Dot(String),
    Int(i128),
    /// Float literal: bits of an `0f`/`0d` literal, or a decimal value.
    F32(u32),
    F64(u64),
    Str(String),
    Punct(char),
}

#[derive(Debug, Clone)]
pub struct Token {
    pub tok: Tok,
    pub line: u32,
}

fn show(t: &Tok) -> String {
    match t {
        Tok::Ident(s) => s.clone(),
        Tok::Dot(s) => format!(".{s}"),
        Tok::Int(v) => v.to_string(),
        Tok::F32(b) => format!("0f{b:08X}"),
        Tok::F64(b) => format!("0d{b:016X}"),
        Tok::Str(s) => format!("{s:?}"),
        Tok::Punct(c) => c.to_string(),
    }
}

fn word_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'_' | b'$' | b'%')
}

pub fn tokenize(text: &str) -> Result<Vec<Token>, PtxError> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let (mut i, mut line) = (0usize, 1u32);
    let err = |line, msg: String| PtxError::Parse { line, msg };
    while i < b.len() {
        let c = b[i];
        if c == b'\n' {
            line += 1;
            i += 1;
        } else if c.is_ascii_whitespace() || c == 0 {
            i += 1;
        } else if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            i += 2;
            while i < b.len() && !(b[i] == b'*' && b.get(i + 1) == Some(&b'/')) {
                if b[i] == b'\n' {
                    line += 1;
                }
                i += 1;
            }
            i += 2;
        } else if c == b'"' {
            let s = i + 1;
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                }
                i += 1;
            }
            out.push(Token { tok: Tok::Str(String::from_utf8_lossy(&b[s..i.min(b.len())]).into()), line });
            i += 1;
        } else if c == b'.' && b.get(i + 1).is_some_and(|&n| n.is_ascii_alphabetic() || n == b'_') {
            let s = i + 1;
            i += 1;
            while i < b.len() && word_char(b[i]) {
                i += 1;
            }
            out.push(Token { tok: Tok::Dot(text[s..i].to_string()), line });
        } else if c.is_ascii_digit() {
            let s = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'.') {
                i += 1;
            }
            let w = &text[s..i];
            // After `::` a word may begin with a digit: `.L2::128B`, a modifier's sub-part.
            let after_scope = out.len() >= 2 && out[out.len() - 2..].iter().all(|t: &Token| t.tok == Tok::Punct(':'));
            let tok = match number(w) {
                Some(t) => t,
                None if after_scope && w.bytes().all(|c| c.is_ascii_alphanumeric()) => Tok::Ident(w.to_string()),
                None => return Err(err(line, format!("bad number `{w}`"))),
            };
            out.push(Token { tok, line });
        } else if word_char(c) {
            let s = i;
            while i < b.len() && word_char(b[i]) {
                i += 1;
            }
            out.push(Token { tok: Tok::Ident(text[s..i].to_string()), line });
        } else if b",;:[]{}()+-!|@<>=".contains(&c) {
            out.push(Token { tok: Tok::Punct(c as char), line });
            i += 1;
        } else {
            return Err(err(line, format!("unexpected character {:?}", c as char)));
        }
    }
    Ok(out)
}

fn number(w: &str) -> Option<Tok> {
    let lw = w.to_ascii_lowercase();
    if let Some(h) = lw.strip_prefix("0f") {
        if h.len() == 8 {
            return u32::from_str_radix(h, 16).ok().map(Tok::F32);
        }
    }
    if let Some(h) = lw.strip_prefix("0d") {
        if h.len() == 16 {
            return u64::from_str_radix(h, 16).ok().map(Tok::F64);
        }
    }
    let t = lw.trim_end_matches('u');
    if let Some(h) = t.strip_prefix("0x") {
        return u128::from_str_radix(h, 16).ok().map(|v| Tok::Int(v as i128));
    }
    if let Some(bn) = t.strip_prefix("0b") {
        return u128::from_str_radix(bn, 2).ok().map(|v| Tok::Int(v as i128));
    }
    if t.contains('.') || t.contains('e') {
        return t.parse::<f64>().ok().map(|v| Tok::F64(v.to_bits()));
    }
    if t.len() > 1 && t.starts_with('0') {
        return u128::from_str_radix(&t[1..], 8).ok().map(|v| Tok::Int(v as i128));
    }
    t.parse::<i128>().ok().map(Tok::Int)
}

// ---------------------------------------------------------------------------
// AST
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Space {
    Global,
    Const,
    Shared,
    Local,
    Param,
    Reg,
}

/// A variable declaration (module scope or in a body), or a parameter.
#[derive(Debug, Clone)]
pub struct Var {
    pub space: Space,
    pub name: String,
    pub align: u32,
    /// Element type name (`u32`, `b8`, `f32`...).
    pub ty: String,
    /// `.v2`/`.v4` element count (1 when scalar).
    pub vec: u32,
    /// Array length; `Some(0)` for `[]` (unsized, e.g. `.extern .shared`).
    pub array: Option<u64>,
    /// `<N>` on a register declaration: names `name0..name{N-1}`.
    pub range: Option<u32>,
    pub is_extern: bool,
    pub line: u32,
}

impl Var {
    pub fn elem_size(&self) -> u64 {
        type_size(&self.ty).unwrap_or(1) as u64 * self.vec as u64
    }
    /// Saturates: a size no memory can hold is refused where it is laid out.
    pub fn size(&self) -> u64 {
        self.elem_size().saturating_mul(self.array.unwrap_or(1).max(if self.array.is_some() { 0 } else { 1 }))
    }
    pub fn alignment(&self) -> u64 {
        (self.align as u64).max(self.elem_size()).max(1)
    }
}

pub fn type_size(t: &str) -> Option<u32> {
    Some(match t {
        "b8" | "u8" | "s8" | "pred" => 1,
        "b16" | "u16" | "s16" | "f16" | "bf16" => 2,
        "b32" | "u32" | "s32" | "f32" | "f16x2" | "bf16x2" | "s16x2" | "u16x2" => 4,
        "b64" | "u64" | "s64" | "f64" => 8,
        "b128" => 16,
        _ => return None,
    })
}

#[derive(Debug, Clone, PartialEq)]
pub enum Operand {
    /// Register, special register (`%tid.x` arrives as `%tid.x`), symbol or label.
    Name(String),
    Int(i128),
    F32(u32),
    F64(u64),
    /// `[base+off]`; base is a name or absent (absolute immediate address).
    Addr { base: Option<String>, off: i64 },
    Vector(Vec<Operand>),
    /// `d|p`.
    Pair(String, String),
    /// `!p`.
    Not(String),
    /// `_`.
    Sink,
    /// `( a, b )` in calls.
    List(Vec<Operand>),
}

#[derive(Debug, Clone)]
pub struct Instruction {
    pub line: u32,
    /// `@p` / `@!p`.
    pub guard: Option<(String, bool)>,
    pub opcode: String,
    pub mods: Vec<String>,
    pub operands: Vec<Operand>,
}

impl Instruction {
    pub fn has(&self, m: &str) -> bool {
        self.mods.iter().any(|x| x == m)
    }
    pub fn text(&self) -> String {
        let mut s = self.opcode.clone();
        for m in &self.mods {
            s.push('.');
            s.push_str(m);
        }
        s
    }
}

#[derive(Debug, Clone)]
pub enum Stmt {
    Label(String),
    Inst(Instruction),
    Var(Var),
    Block(Vec<Stmt>),
}

#[derive(Debug, Clone)]
pub struct Function {
    pub name: String,
    pub entry: bool,
    pub params: Vec<Var>,
    pub rets: Vec<Var>,
    pub body: Option<Vec<Stmt>>,
    pub line: u32,
}

#[derive(Debug, Clone, Default)]
pub struct Ast {
    pub vars: Vec<Var>,
    pub funcs: Vec<Function>,
}

// ---------------------------------------------------------------------------
// Parser
// ---------------------------------------------------------------------------

/// Deepest nesting of `{ }` blocks in a function body. nvcc nests a few
/// levels (call sequences, inlined scopes); the parser and the lowering
/// recurse once per level, so hostile text must not choose the depth.
pub const MAX_BLOCK_DEPTH: u32 = 64;
/// Deepest nesting of operands (`{a, b}` vectors, `( )` call lists): PTX
/// never nests them more than two deep.
pub const MAX_OPERAND_DEPTH: u32 = 4;

struct P {
    t: Vec<Token>,
    i: usize,
    /// Blocks and operands now open, for the limits above.
    blocks: u32,
    operands: u32,
}

impl P {
    fn peek(&self) -> Option<&Tok> {
        self.t.get(self.i).map(|t| &t.tok)
    }
    fn line(&self) -> u32 {
        self.t.get(self.i).or(self.t.last()).map_or(0, |t| t.line)
    }
    fn next(&mut self) -> Result<Tok, PtxError> {
        let t = self.t.get(self.i).ok_or_else(|| PtxError::Parse { line: self.line(), msg: "unexpected end of text".into() })?;
        self.i += 1;
        Ok(t.tok.clone())
    }
    fn err<T>(&self, msg: impl Into<String>) -> Result<T, PtxError> {
        let at = self.peek().map_or("end of text".to_string(), show);
        Err(PtxError::Parse { line: self.line(), msg: format!("{} (at `{at}`)", msg.into()) })
    }
    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(&Tok::Punct(c)) {
            self.i += 1;
            true
        } else {
            false
        }
    }
    fn expect(&mut self, c: char) -> Result<(), PtxError> {
        if self.eat(c) {
            Ok(())
        } else {
            self.err(format!("expected `{c}`"))
        }
    }
    fn eat_dot(&mut self, w: &str) -> bool {
        if matches!(self.peek(), Some(Tok::Dot(d)) if d == w) {
            self.i += 1;
            true
        } else {
            false
        }
    }
    fn ident(&mut self) -> Result<String, PtxError> {
        match self.peek() {
            Some(Tok::Ident(s)) => {
                let s = s.clone();
                self.i += 1;
                Ok(s)
            }
            _ => self.err("expected a name"),
        }
    }
    fn int(&mut self) -> Result<i128, PtxError> {
        let neg = self.eat('-');
        match self.peek() {
            Some(Tok::Int(v)) => {
                let v = *v;
                self.i += 1;
                Ok(if neg { v.wrapping_neg() } else { v })
            }
            _ => self.err("expected an integer"),
        }
    }
    /// Skips the rest of the current source line (directives without `;`).
    fn skip_line(&mut self) {
        let l = self.t[self.i - 1].line;
        while self.i < self.t.len() && self.t[self.i].line == l {
            self.i += 1;
        }
    }
    /// Skips to just past the next `;` at brace depth 0.
    fn skip_stmt(&mut self) -> Result<(), PtxError> {
        let mut depth = 0;
        loop {
            match self.next()? {
                Tok::Punct('{') => depth += 1,
                Tok::Punct('}') => depth -= 1,
                Tok::Punct(';') if depth <= 0 => return Ok(()),
                _ => {}
            }
        }
    }
    fn skip_braces(&mut self) -> Result<(), PtxError> {
        self.expect('{')?;
        let mut depth = 1;
        while depth > 0 {
            match self.next()? {
                Tok::Punct('{') => depth += 1,
                Tok::Punct('}') => depth -= 1,
                _ => {}
            }
        }
        Ok(())
    }
}

pub fn parse(text: &str) -> Result<Ast, PtxError> {
    let mut p = P { t: tokenize(text)?, i: 0, blocks: 0, operands: 0 };
    let mut ast = Ast::default();
    while let Some(t) = p.peek().cloned() {
        let line = p.line();
        match t {
            Tok::Dot(d) => match d.as_str() {
                "version" | "target" | "address_size" | "file" => {
                    p.i += 1;
                    p.skip_line();
                }
                "section" => {
                    p.i += 1;
                    while p.peek() != Some(&Tok::Punct('{')) {
                        p.next()?;
                    }
                    p.skip_braces()?;
                }
                "visible" | "extern" | "weak" | "common" | "entry" | "func" | "global" | "const" | "shared"
                | "local" => {
                    let mut is_extern = false;
                    while let Some(Tok::Dot(d)) = p.peek() {
                        match d.as_str() {
                            "visible" | "weak" | "common" => p.i += 1,
                            "extern" => {
                                is_extern = true;
                                p.i += 1
                            }
                            _ => break,
                        }
                    }
                    if p.eat_dot("entry") {
                        ast.funcs.push(function(&mut p, true, line)?);
                    } else if p.eat_dot("func") {
                        ast.funcs.push(function(&mut p, false, line)?);
                    } else {
                        let mut v = var_decl(&mut p, line)?;
                        v.is_extern = is_extern;
                        // Initialisers are materialised by the server's
                        // module reader; the interpreter only needs the layout.
                        if p.eat('=') {
                            p.skip_stmt()?;
                        } else {
                            p.expect(';')?;
                        }
                        ast.vars.push(v);
                    }
                }
                "alias" | "pragma" => {
                    p.i += 1;
                    p.skip_stmt()?;
                }
                _ => return p.err("unknown module directive"),
            },
            _ => return p.err("expected a directive"),
        }
    }
    Ok(ast)
}

/// `.space [.align N] [.vN] .type name[ [N] | <N> ]` (the space word may
/// already be consumed by the caller only for params).
fn var_decl(p: &mut P, line: u32) -> Result<Var, PtxError> {
    let space = match p.next()? {
        Tok::Dot(d) => match d.as_str() {
            "global" => Space::Global,
            "const" => Space::Const,
            "shared" => Space::Shared,
            "local" => Space::Local,
            "param" => Space::Param,
            "reg" => Space::Reg,
            _ => return p.err(format!("unknown state space .{d}")),
        },
        _ => return p.err("expected a state space"),
    };
    let mut v = Var { space, name: String::new(), align: 0, ty: String::new(), vec: 1, array: None, range: None, is_extern: false, line };
    loop {
        match p.peek().cloned() {
            Some(Tok::Dot(d)) => {
                p.i += 1;
                match d.as_str() {
                    "align" => v.align = p.int()? as u32,
                    "v2" => v.vec = 2,
                    "v4" => v.vec = 4,
                    "v8" => v.vec = 8,
                    "ptr" | "noreturn" => {}
                    // `__managed__` variables: ordinary global storage here; the client keeps
                    // host and device copies coherent.
                    "attribute" if space == Space::Global => {
                        p.expect('(')?;
                        match p.next()? {
                            Tok::Dot(a) if a == "managed" => {}
                            _ => return p.err("unknown variable attribute"),
                        }
                        p.expect(')')?;
                    }
                    // `.ptr.global.align 4` in parameter attributes.
                    "global" | "shared" | "const" | "local" if space == Space::Param => {}
                    t if type_size(t).is_some() => v.ty = t.to_string(),
                    _ => return p.err(format!("unexpected .{d} in a declaration")),
                }
            }
            _ => break,
        }
    }
    if v.ty.is_empty() {
        return p.err("declaration without a type");
    }
    v.name = p.ident()?;
    if p.eat('<') {
        v.range = Some(p.int()? as u32);
        p.expect('>')?;
    }
    while p.eat('[') {
        let n = if p.peek() == Some(&Tok::Punct(']')) { 0 } else { p.int()? as u64 };
        p.expect(']')?;
        v.array = Some(v.array.map_or(n, |m| m.saturating_mul(n.max(1))));
    }
    Ok(v)
}

fn param_list(p: &mut P) -> Result<Vec<Var>, PtxError> {
    let mut out = Vec::new();
    p.expect('(')?;
    if p.eat(')') {
        return Ok(out);
    }
    loop {
        let line = p.line();
        out.push(var_decl(p, line)?);
        if p.eat(')') {
            return Ok(out);
        }
        p.expect(',')?;
    }
}

fn function(p: &mut P, entry: bool, line: u32) -> Result<Function, PtxError> {
    let mut rets = Vec::new();
    if !entry && p.peek() == Some(&Tok::Punct('(')) {
        rets = param_list(p)?;
    }
    let name = p.ident()?;
    let params = if p.peek() == Some(&Tok::Punct('(')) { param_list(p)? } else { Vec::new() };
    // Performance directives (.maxntid 256, 1, 1 / .noreturn / .pragma "...";).
    loop {
        match p.peek() {
            Some(Tok::Punct('{')) => {
                p.i += 1;
                let body = block(p)?;
                return Ok(Function { name, entry, params, rets, body: Some(body), line });
            }
            Some(Tok::Punct(';')) => {
                p.i += 1;
                return Ok(Function { name, entry, params, rets, body: None, line });
            }
            Some(_) => {
                p.next()?;
            }
            None => return p.err("function without a body"),
        }
    }
}

/// Statements up to the matching `}` (the `{` is consumed).
fn block(p: &mut P) -> Result<Vec<Stmt>, PtxError> {
    if p.blocks >= MAX_BLOCK_DEPTH {
        return Err(PtxError::TooComplex {
            line: p.line(),
            msg: format!("blocks nested more than {MAX_BLOCK_DEPTH} deep"),
        });
    }
    p.blocks += 1;
    let r = block_body(p);
    p.blocks -= 1;
    r
}

fn block_body(p: &mut P) -> Result<Vec<Stmt>, PtxError> {
    let mut out = Vec::new();
    loop {
        let line = p.line();
        match p.peek().cloned() {
            None => return p.err("missing `}`"),
            Some(Tok::Punct('}')) => {
                p.i += 1;
                return Ok(out);
            }
            Some(Tok::Punct('{')) => {
                p.i += 1;
                out.push(Stmt::Block(block(p)?));
            }
            Some(Tok::Punct(';')) => p.i += 1,
            Some(Tok::Dot(d)) => match d.as_str() {
                "loc" | "file" => {
                    p.i += 1;
                    p.skip_line();
                }
                "pragma" | "section" => {
                    p.i += 1;
                    p.skip_stmt()?;
                }
                "reg" | "local" | "shared" | "param" | "global" | "const" => {
                    let first = var_decl(p, line)?;
                    let mut names = vec![(first.name.clone(), first.range)];
                    // `.reg .b32 a, b, c;`
                    while p.eat(',') {
                        let n = p.ident()?;
                        let r = if p.eat('<') {
                            let r = p.int()? as u32;
                            p.expect('>')?;
                            Some(r)
                        } else {
                            None
                        };
                        names.push((n, r));
                    }
                    if p.eat('=') {
                        p.skip_stmt()?;
                    } else {
                        p.expect(';')?;
                    }
                    for (n, r) in names {
                        let mut v = first.clone();
                        v.name = n;
                        v.range = r;
                        out.push(Stmt::Var(v));
                    }
                }
                _ => return p.err("unexpected directive in a function body"),
            },
            Some(Tok::Ident(name)) => {
                if p.t.get(p.i + 1).map(|t| &t.tok) == Some(&Tok::Punct(':')) {
                    p.i += 2;
                    out.push(Stmt::Label(name));
                } else {
                    out.push(Stmt::Inst(instruction(p, None, line)?));
                }
            }
            Some(Tok::Punct('@')) => {
                p.i += 1;
                let neg = p.eat('!');
                let g = p.ident()?;
                out.push(Stmt::Inst(instruction(p, Some((g, neg)), line)?));
            }
            Some(_) => return p.err("expected an instruction"),
        }
    }
}

fn instruction(p: &mut P, guard: Option<(String, bool)>, line: u32) -> Result<Instruction, PtxError> {
    let opcode = p.ident()?;
    let mut mods = Vec::new();
    while let Some(Tok::Dot(d)) = p.peek() {
        let mut m = d.clone();
        p.i += 1;
        // `.shared::cta`, `.mbarrier::complete_tx::bytes`: one modifier with its sub-parts.
        while m.len() < 64 && p.peek() == Some(&Tok::Punct(':')) && p.t.get(p.i + 1).map(|t| &t.tok) == Some(&Tok::Punct(':')) {
            match p.t.get(p.i + 2).map(|t| &t.tok) {
                Some(Tok::Ident(x)) => {
                    m.push_str("::");
                    m.push_str(x);
                    p.i += 3;
                }
                _ => break,
            }
        }
        // `.shared::cta` is what `.shared` means.
        if m == "shared::cta" {
            m.truncate(6);
        }
        mods.push(m);
    }
    let mut operands = Vec::new();
    if !p.eat(';') {
        loop {
            operands.push(operand(p)?);
            if p.eat(';') {
                break;
            }
            p.expect(',')?;
        }
    }
    Ok(Instruction { line, guard, opcode, mods, operands })
}

/// A name, with a special register's `.x` component glued on.
fn name(p: &mut P) -> Result<String, PtxError> {
    let mut n = p.ident()?;
    if n.starts_with('%') {
        if let Some(Tok::Dot(c)) = p.peek() {
            if matches!(c.as_str(), "x" | "y" | "z" | "w") {
                n.push('.');
                n.push_str(c);
                p.i += 1;
            }
        }
    }
    Ok(n)
}

fn operand(p: &mut P) -> Result<Operand, PtxError> {
    if p.operands >= MAX_OPERAND_DEPTH {
        return Err(PtxError::TooComplex {
            line: p.line(),
            msg: format!("operands nested more than {MAX_OPERAND_DEPTH} deep"),
        });
    }
    p.operands += 1;
    let r = operand_inner(p);
    p.operands -= 1;
    r
}

fn operand_inner(p: &mut P) -> Result<Operand, PtxError> {
    match p.peek().cloned() {
        Some(Tok::Punct('[')) => {
            p.i += 1;
            let mut base = None;
            let mut off: i64 = 0;
            match p.peek() {
                Some(Tok::Ident(_)) => base = Some(name(p)?),
                _ => off = p.int()? as i64,
            }
            loop {
                if p.eat('+') {
                    off = off.wrapping_add(p.int()? as i64);
                } else if p.peek() == Some(&Tok::Punct('-')) {
                    off = off.wrapping_add(p.int()? as i64);
                } else {
                    break;
                }
            }
            p.expect(']')?;
            Ok(Operand::Addr { base, off })
        }
        Some(Tok::Punct('{')) => {
            p.i += 1;
            let mut v = Vec::new();
            loop {
                v.push(operand(p)?);
                if p.eat('}') {
                    return Ok(Operand::Vector(v));
                }
                p.expect(',')?;
            }
        }
        Some(Tok::Punct('(')) => {
            p.i += 1;
            let mut v = Vec::new();
            if p.eat(')') {
                return Ok(Operand::List(v));
            }
            loop {
                v.push(operand(p)?);
                if p.eat(')') {
                    return Ok(Operand::List(v));
                }
                p.expect(',')?;
            }
        }
        Some(Tok::Punct('!')) => {
            p.i += 1;
            Ok(Operand::Not(name(p)?))
        }
        Some(Tok::Punct('-')) => {
            p.i += 1;
            match p.next()? {
                Tok::Int(v) => Ok(Operand::Int(v.wrapping_neg())),
                Tok::F32(b) => Ok(Operand::F32(b ^ 0x8000_0000)),
                Tok::F64(b) => Ok(Operand::F64(b ^ (1 << 63))),
                _ => {
                    p.i -= 1;
                    p.err("expected a number after `-`")
                }
            }
        }
        Some(Tok::Int(v)) => {
            p.i += 1;
            Ok(Operand::Int(v))
        }
        Some(Tok::F32(b)) => {
            p.i += 1;
            Ok(Operand::F32(b))
        }
        Some(Tok::F64(b)) => {
            p.i += 1;
            Ok(Operand::F64(b))
        }
        Some(Tok::Ident(s)) if s == "_" => {
            p.i += 1;
            // `_|p`: a pair whose first destination is discarded (`elect.sync _|p, mask`).
            if p.eat('|') {
                let q = name(p)?;
                return Ok(Operand::Pair(s, q));
            }
            Ok(Operand::Sink)
        }
        Some(Tok::Ident(_)) => {
            let n = name(p)?;
            if p.eat('|') {
                let q = name(p)?;
                return Ok(Operand::Pair(n, q));
            }
            // `sym+4` as an immediate operand (mov.u64 %rd, sym+4).
            if p.peek() == Some(&Tok::Punct('+')) {
                p.i += 1;
                let off = p.int()? as i64;
                return Ok(Operand::Addr { base: Some(n), off });
            }
            Ok(Operand::Name(n))
        }
        _ => p.err("expected an operand"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_kernel() {
        let src = r#"
.version 8.0
.target sm_90
.address_size 64
.extern .func (.param .b32 func_retval0) vprintf ( .param .b64 a, .param .b64 b ) ;
.global .align 4 .b8 tab[8] = {1, 2, 3, 4, 5, 6, 7, 8};
.visible .entry k( .param .u64 k_param_0 )
.maxntid 128, 1, 1
{
  .reg .pred %p<2>;
  .reg .b32 %r<4>;
  mov.u32 %r1, %tid.x;
  setp.lt.u32 %p1, %r1, 0f3F800000;
  @!%p1 bra $L__BB0_2;
  ld.global.v2.u32 {%r2, %r3}, [%rd1+-8];
  shfl.sync.down.b32 %r2|%p1, %r1, 1, 31, -1;
$L__BB0_2:
  ret;
}
"#;
        let ast = parse(src).unwrap();
        assert_eq!(ast.vars.len(), 1);
        assert_eq!(ast.funcs.len(), 2);
        let k = &ast.funcs[1];
        assert!(k.entry);
        let body = k.body.as_ref().unwrap();
        let insts: Vec<&Instruction> = body.iter().filter_map(|s| if let Stmt::Inst(i) = s { Some(i) } else { None }).collect();
        assert_eq!(insts[0].operands[1], Operand::Name("%tid.x".into()));
        assert_eq!(insts[2].guard, Some(("%p1".into(), true)));
        assert_eq!(insts[3].operands[1], Operand::Addr { base: Some("%rd1".into()), off: -8 });
        assert_eq!(insts[4].operands[0], Operand::Pair("%r2".into(), "%p1".into()));
        assert_eq!(insts[4].operands[4], Operand::Int(-1));
    }

    #[test]
    fn errors_name_the_line_and_token() {
        let e = parse(".version 8.0\n.entry k()\n{\n  mov.u32 %r1, ?;\n}\n").unwrap_err();
        let s = e.to_string();
        assert!(s.contains("line 4"), "{s}");
    }

    /// Runs `f` on a thread with the stack a server session thread has.
    fn on_session_stack<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        std::thread::Builder::new().stack_size(2 << 20).spawn(f).unwrap().join().unwrap()
    }

    fn too_complex(r: Result<Ast, PtxError>) -> String {
        match r {
            Err(e @ PtxError::TooComplex { .. }) => e.to_string(),
            other => panic!("expected TooComplex, got {other:?}"),
        }
    }

    /// Hostile nesting is an error, not a stack overflow that takes the
    /// whole server with it.
    #[test]
    fn deep_nesting_is_refused_not_a_stack_overflow() {
        let head = ".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry k()\n{\n";
        let blocks = format!("{head}{}{}}}\n", "{".repeat(200_000), "}".repeat(200_000));
        let e = on_session_stack(move || too_complex(parse(&blocks)));
        assert!(e.contains("blocks nested more than 64 deep"), "{e}");
        let vectors = format!("{head}mov.b32 {}%r1{};\n}}\n", "{".repeat(200_000), "}".repeat(200_000));
        let e = on_session_stack(move || too_complex(parse(&vectors)));
        assert!(e.contains("operands nested more than 4 deep"), "{e}");
        let lists = format!("{head}call f, {}%r1{};\n}}\n", "(".repeat(200_000), ")".repeat(200_000));
        on_session_stack(move || too_complex(parse(&lists)));
        // What nvcc writes stays well inside the limits.
        let ok = format!("{head}{}mov.b32 %r1, 1;\n{}ret;\n}}\n", "{\n".repeat(60), "}\n".repeat(60));
        assert!(parse(&ok).is_ok());
    }

    #[test]
    fn huge_sizes_saturate_instead_of_overflowing() {
        let src = ".version 8.0\n.target sm_90\n.global .b64 g[18446744073709551615][18446744073709551615];\n";
        let ast = parse(src).unwrap();
        assert_eq!(ast.vars[0].size(), u64::MAX);
    }
}
