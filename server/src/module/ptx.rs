//! Just enough PTX reading to describe a module: the `.entry` kernels with their parameter
//! layout and launch bounds, the module-scope `.global`/`.const` variables with their initial
//! bytes, and the static `.shared`/`.local` sizes declared in each kernel body.
//!
//! Instruction bodies are skipped (balanced braces); a full PTX parser is a separate piece of
//! work. Errors name the line.

use super::{GlobalInfo, GlobalSpace, ImageError, KernelInfo, ParamInfo};

/// Largest variable for which initial bytes are materialised.
const MAX_INIT_BYTES: u64 = 1 << 30;

/// What the PTX reader found in a module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PtxModule {
    /// `.version` as written, e.g. "9.5".
    pub version: String,
    /// `.target` list, e.g. ["sm_75"].
    pub target: Vec<String>,
    pub kernels: Vec<KernelInfo>,
    pub globals: Vec<GlobalInfo>,
}

#[derive(Debug, Clone, PartialEq)]
enum Tok<'a> {
    /// Identifiers, directives (`.entry`), instructions (`ld.param.u32`), registers (`%r1`).
    Word(&'a str),
    /// Numeric literal as written.
    Num(&'a str),
    Str(&'a str),
    Punct(char),
}

#[derive(Debug, Clone)]
struct Token<'a> {
    tok: Tok<'a>,
    line: u32,
}

fn err(line: u32, msg: impl Into<String>) -> ImageError {
    ImageError::Ptx {
        line,
        msg: msg.into(),
    }
}

fn unsupported(line: u32, msg: impl Into<String>) -> ImageError {
    ImageError::PtxUnsupported {
        line,
        msg: msg.into(),
    }
}

fn is_word_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || matches!(c, b'_' | b'$' | b'%' | b'.')
}

fn is_word_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'_' | b'$' | b'%' | b'.')
}

fn tokenize(text: &str) -> Result<Vec<Token<'_>>, ImageError> {
    let b = text.as_bytes();
    let mut toks = Vec::new();
    let mut i = 0;
    let mut line = 1u32;
    while i < b.len() {
        let c = b[i];
        if c == b'\n' {
            line += 1;
            i += 1;
        } else if c.is_ascii_whitespace() {
            i += 1;
        } else if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let start = line;
            i += 2;
            loop {
                if i + 1 >= b.len() {
                    return Err(err(start, "unterminated /* comment"));
                }
                if b[i] == b'*' && b[i + 1] == b'/' {
                    i += 2;
                    break;
                }
                if b[i] == b'\n' {
                    line += 1;
                }
                i += 1;
            }
        } else if c == b'"' {
            let start = i + 1;
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\n' {
                    return Err(err(line, "unterminated string"));
                }
                if b[i] == b'\\' {
                    i += 1;
                }
                i += 1;
            }
            if i >= b.len() {
                return Err(err(line, "unterminated string"));
            }
            toks.push(Token {
                tok: Tok::Str(&text[start..i]),
                line,
            });
            i += 1;
        } else if c.is_ascii_digit() {
            let start = i;
            let hexish =
                c == b'0' && matches!(b.get(i + 1), Some(b'x' | b'X' | b'f' | b'F' | b'd' | b'D'));
            while i < b.len() {
                let d = b[i];
                let sign_after_exp = !hexish
                    && matches!(d, b'+' | b'-')
                    && i > start
                    && matches!(b[i - 1], b'e' | b'E');
                if d.is_ascii_alphanumeric() || d == b'.' || sign_after_exp {
                    i += 1;
                } else {
                    break;
                }
            }
            toks.push(Token {
                tok: Tok::Num(&text[start..i]),
                line,
            });
        } else if is_word_start(c) {
            let start = i;
            while i < b.len() && is_word_char(b[i]) {
                i += 1;
            }
            toks.push(Token {
                tok: Tok::Word(&text[start..i]),
                line,
            });
        } else if c.is_ascii() {
            toks.push(Token {
                tok: Tok::Punct(c as char),
                line,
            });
            i += 1;
        } else {
            return Err(err(
                line,
                format!("unexpected character {:?}", text[i..].chars().next()),
            ));
        }
    }
    Ok(toks)
}

/// Scalar PTX types: (size in bytes, kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Int,
    Float,
    Bits,
}

fn scalar_type(name: &str) -> Option<(u32, Kind)> {
    Some(match name {
        ".b8" => (1, Kind::Bits),
        ".u8" | ".s8" => (1, Kind::Int),
        ".b16" => (2, Kind::Bits),
        ".u16" | ".s16" => (2, Kind::Int),
        ".f16" | ".bf16" => (2, Kind::Bits),
        ".b32" => (4, Kind::Bits),
        ".u32" | ".s32" => (4, Kind::Int),
        ".f32" => (4, Kind::Float),
        ".f16x2" | ".bf16x2" => (4, Kind::Bits),
        ".b64" => (8, Kind::Bits),
        ".u64" | ".s64" => (8, Kind::Int),
        ".f64" => (8, Kind::Float),
        ".b128" => (16, Kind::Bits),
        _ => return None,
    })
}

struct Parser<'a> {
    toks: Vec<Token<'a>>,
    pos: usize,
    last_line: u32,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<&Tok<'a>> {
        self.toks.get(self.pos).map(|t| &t.tok)
    }

    fn line(&self) -> u32 {
        self.toks.get(self.pos).map_or(self.last_line, |t| t.line)
    }

    fn next(&mut self) -> Option<Tok<'a>> {
        let t = self.toks.get(self.pos).map(|t| t.tok.clone());
        if t.is_some() {
            self.pos += 1;
        }
        t
    }

    fn next_or(&mut self, what: &str) -> Result<Tok<'a>, ImageError> {
        let line = self.line();
        self.next()
            .ok_or_else(|| err(line, format!("unexpected end of PTX, expected {what}")))
    }

    fn eat_punct(&mut self, c: char) -> bool {
        if self.peek() == Some(&Tok::Punct(c)) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn eat_word(&mut self, w: &str) -> bool {
        if self.peek() == Some(&Tok::Word(w)) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn expect_punct(&mut self, c: char) -> Result<(), ImageError> {
        let line = self.line();
        match self.next() {
            Some(Tok::Punct(p)) if p == c => Ok(()),
            Some(t) => Err(err(line, format!("expected '{c}', found {}", show(&t)))),
            None => Err(err(line, format!("unexpected end of PTX, expected '{c}'"))),
        }
    }

    fn word(&mut self, what: &str) -> Result<&'a str, ImageError> {
        let line = self.line();
        match self.next_or(what)? {
            Tok::Word(w) => Ok(w),
            t => Err(err(line, format!("expected {what}, found {}", show(&t)))),
        }
    }

    fn uint(&mut self, what: &str) -> Result<u64, ImageError> {
        let line = self.line();
        match self.next_or(what)? {
            Tok::Num(n) => parse_uint(n).ok_or_else(|| err(line, format!("bad {what} '{n}'"))),
            t => Err(err(line, format!("expected {what}, found {}", show(&t)))),
        }
    }

    /// Skips to just past the next `;` at bracket depth 0.
    fn skip_statement(&mut self) -> Result<(), ImageError> {
        let line = self.line();
        let mut depth = 0i32;
        while let Some(t) = self.next() {
            match t {
                Tok::Punct('(' | '{' | '[') => depth += 1,
                Tok::Punct(')' | '}' | ']') => depth -= 1,
                Tok::Punct(';') if depth <= 0 => return Ok(()),
                _ => {}
            }
        }
        Err(err(line, "statement not terminated by ';'"))
    }

    /// Skips a balanced `{ ... }` block; the `{` is the next token.
    fn skip_block(&mut self) -> Result<(), ImageError> {
        let line = self.line();
        self.expect_punct('{')?;
        let mut depth = 1u32;
        while let Some(t) = self.next() {
            match t {
                Tok::Punct('{') => depth += 1,
                Tok::Punct('}') => {
                    depth -= 1;
                    if depth == 0 {
                        return Ok(());
                    }
                }
                _ => {}
            }
        }
        Err(err(line, "unbalanced '{'"))
    }
}

fn show(t: &Tok<'_>) -> String {
    match t {
        Tok::Word(w) | Tok::Num(w) => format!("'{w}'"),
        Tok::Str(s) => format!("\"{s}\""),
        Tok::Punct(c) => format!("'{c}'"),
    }
}

fn parse_uint(s: &str) -> Option<u64> {
    let s = s.strip_suffix(['U', 'u']).unwrap_or(s);
    if let Some(h) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        u64::from_str_radix(h, 16).ok()
    } else if let Some(bn) = s.strip_prefix("0b").or_else(|| s.strip_prefix("0B")) {
        u64::from_str_radix(bn, 2).ok()
    } else if s.len() > 1 && s.starts_with('0') {
        u64::from_str_radix(&s[1..], 8).ok()
    } else {
        s.parse().ok()
    }
}

fn align_up(v: u64, a: u64) -> Option<u64> {
    let a = a.max(1);
    v.checked_add(a - 1).map(|x| x / a * a)
}

/// Reads the PTX text of one module.
pub fn parse_ptx(text: &str) -> Result<PtxModule, ImageError> {
    let toks = tokenize(text)?;
    let last_line = toks.last().map_or(1, |t| t.line);
    let mut p = Parser {
        toks,
        pos: 0,
        last_line,
    };
    let mut m = PtxModule {
        version: String::new(),
        target: Vec::new(),
        kernels: vec![],
        globals: vec![],
    };

    // Module-scope `.shared` variables: (name, size, align).
    let mut module_shared: Vec<(String, u64, u32)> = Vec::new();

    // `.version` must come first.
    let line = p.line();
    if !p.eat_word(".version") {
        return Err(err(line, "PTX must start with a .version directive"));
    }
    m.version = match p.next_or("a version number")? {
        Tok::Num(n) => n.to_string(),
        t => return Err(err(line, format!("bad .version {}", show(&t)))),
    };

    while let Some(t) = p.peek().cloned() {
        let line = p.line();
        let Tok::Word(w) = t else {
            return Err(err(
                line,
                format!("unexpected {} at module scope", show(&t)),
            ));
        };
        match w {
            ".target" => {
                p.pos += 1;
                m.target.push(p.word("a target")?.to_string());
                while p.eat_punct(',') {
                    m.target.push(p.word("a target")?.to_string());
                }
            }
            ".address_size" => {
                p.pos += 1;
                let n = p.uint("an address size")?;
                if n != 64 && n != 32 {
                    return Err(err(line, format!("bad .address_size {n}")));
                }
            }
            ".file" => {
                p.pos += 1;
                p.uint("a file number")?;
                match p.next_or("a file name")? {
                    Tok::Str(_) => {}
                    t => {
                        return Err(err(
                            line,
                            format!("expected a file name, found {}", show(&t)),
                        ))
                    }
                }
                while p.eat_punct(',') {
                    p.uint("a number")?;
                }
            }
            ".section" => {
                p.pos += 1;
                p.word("a section name")?;
                p.skip_block()?;
            }
            ".pragma" | ".alias" => p.skip_statement()?,
            ".visible" | ".extern" | ".weak" | ".common" => {
                p.pos += 1;
                if w == ".extern" && p.peek() == Some(&Tok::Word(".entry")) {
                    // A declaration of an entry defined elsewhere: nothing to launch here.
                    skip_function(&mut p)?;
                    continue;
                }
            }
            ".entry" => {
                p.pos += 1;
                if let Some(k) = parse_entry(&mut p, &module_shared)? {
                    m.kernels.push(k);
                }
            }
            ".func" => skip_function(&mut p)?,
            ".global" | ".const" => {
                p.pos += 1;
                let space = if w == ".global" {
                    GlobalSpace::Global
                } else {
                    GlobalSpace::Const
                };
                for v in parse_variables(&mut p, true)? {
                    m.globals.push(GlobalInfo {
                        name: v.name,
                        size: v.size,
                        align: v.align,
                        space,
                        init: v.init,
                        managed: v.managed,
                    });
                }
            }
            ".shared" if !after_extern(&p) => {
                // Module-scope static shared memory (numba declares its shared arrays here):
                // counted in the static shared size of each kernel that names it.
                p.pos += 1;
                for v in parse_variables(&mut p, false)? {
                    module_shared.push((v.name, v.size, v.align));
                }
            }
            ".shared" | ".local" | ".tex" | ".texref" | ".surfref" | ".samplerref" => {
                // `.extern .shared` (dynamic shared memory), module-scope local variables and
                // texture references are not described yet.
                p.skip_statement()?
            }
            _ => return Err(err(line, format!("unexpected '{w}' at module scope"))),
        }
    }
    Ok(m)
}

/// Skips a `.func` (or `.extern .entry`) declaration or definition.
fn skip_function(p: &mut Parser<'_>) -> Result<(), ImageError> {
    let line = p.line();
    p.pos += 1; // .func / .entry
    let mut depth = 0i32;
    loop {
        match p.peek() {
            None => return Err(err(line, "function not terminated")),
            Some(Tok::Punct('(')) => depth += 1,
            Some(Tok::Punct(')')) => depth -= 1,
            Some(Tok::Punct(';')) if depth <= 0 => {
                p.pos += 1;
                return Ok(());
            }
            Some(Tok::Punct('{')) if depth <= 0 => return p.skip_block(),
            _ => {}
        }
        p.pos += 1;
    }
}

/// A parsed variable declarator.
struct Var {
    name: String,
    size: u64,
    align: u32,
    init: Option<Vec<u8>>,
    managed: bool,
}

/// Parses `[.align N] [.vN] .type name[dims] [= init] {, name...} ;` after the state space.
fn parse_variables(p: &mut Parser<'_>, allow_init: bool) -> Result<Vec<Var>, ImageError> {
    let line = p.line();
    let mut align: Option<u64> = None;
    let mut vec_n = 1u64;
    let mut ty: Option<(u32, Kind)> = None;
    let mut managed = false;
    loop {
        let line = p.line();
        match p.peek() {
            Some(Tok::Word(".align")) => {
                p.pos += 1;
                let a = p.uint("an alignment")?;
                if !a.is_power_of_two() || a > 1 << 16 {
                    return Err(err(line, format!("bad alignment {a}")));
                }
                align = Some(a);
            }
            Some(Tok::Word(v @ (".v2" | ".v4" | ".v8"))) => {
                vec_n = v[2..].parse().unwrap_or(1);
                p.pos += 1;
            }
            Some(Tok::Word(".attribute")) => {
                p.pos += 1;
                p.expect_punct('(')?;
                while !p.eat_punct(')') {
                    match p.next() {
                        None => return Err(err(line, "unterminated .attribute(...)")),
                        Some(Tok::Word(".managed")) => managed = true,
                        Some(_) => {}
                    }
                }
            }
            Some(Tok::Word(w)) if w.starts_with('.') => {
                let w = *w;
                match scalar_type(w) {
                    Some(t) if ty.is_none() => {
                        ty = Some(t);
                        p.pos += 1;
                    }
                    Some(_) => return Err(err(line, format!("second type '{w}' in declaration"))),
                    None if w == ".texref" || w == ".samplerref" || w == ".surfref" => {
                        return Err(unsupported(line, format!("{w} variables")));
                    }
                    None => return Err(err(line, format!("unknown qualifier '{w}'"))),
                }
            }
            _ => break,
        }
    }
    let (esize, kind) = ty.ok_or_else(|| err(line, "variable declaration without a type"))?;
    let elem = esize as u64 * vec_n;
    let align = align.unwrap_or(elem);
    let mut vars = Vec::new();
    loop {
        let line = p.line();
        let name = p.word("a variable name")?.to_string();
        // Dimensions; `[]` (0) takes its length from the initialiser.
        let mut count: Option<u64> = Some(1);
        let mut levels: Vec<u64> = Vec::new();
        let mut unsized_dim = false;
        while p.eat_punct('[') {
            if p.eat_punct(']') {
                if !levels.is_empty() {
                    return Err(err(line, "only the first dimension may be left empty"));
                }
                unsized_dim = true;
                levels.push(0);
                continue;
            }
            let n = p.uint("an array length")?;
            p.expect_punct(']')?;
            count = count.and_then(|c| c.checked_mul(n));
            levels.push(n);
        }
        let elems = count.ok_or_else(|| err(line, "array size overflows"))?;
        let mut init_vals: Option<Vec<InitVal<'_>>> = None;
        if p.eat_punct('=') {
            if !allow_init {
                return Err(err(line, "initialiser not allowed here"));
            }
            if vec_n > 1 {
                levels.push(vec_n);
            }
            init_vals = Some(collect_initialiser(p, &levels)?);
        }
        let mut nelems = elems;
        if unsized_dim {
            let given = init_vals.as_ref().map_or(0, |v| v.len() as u64);
            let per = elems.checked_mul(vec_n).filter(|&x| x > 0).unwrap_or(1);
            nelems = elems.checked_mul(given.div_ceil(per)).unwrap_or(0);
        }
        let size = nelems
            .checked_mul(elem)
            .ok_or_else(|| err(line, format!("size of '{name}' overflows")))?;
        let init = match init_vals {
            None => None,
            Some(vals) => {
                if size > MAX_INIT_BYTES {
                    return Err(err(
                        line,
                        format!("'{name}' is {size} bytes, above the {MAX_INIT_BYTES}-byte limit for initialised variables"),
                    ));
                }
                let slots = nelems * vec_n;
                if vals.len() as u64 > slots {
                    return Err(err(
                        line,
                        format!(
                            "'{name}' has {} initial values for {slots} elements",
                            vals.len()
                        ),
                    ));
                }
                // Only the bytes the values cover: the rest is zero, and a
                // 1-value initialiser of a huge array must not cost its size.
                let mut bytes = vec![0u8; vals.len() * esize as usize];
                for (i, v) in vals.iter().enumerate() {
                    let at = i * esize as usize;
                    encode(&mut bytes[at..at + esize as usize], kind, v, line)?;
                }
                if bytes.iter().all(|&b| b == 0) {
                    None
                } else {
                    Some(bytes)
                }
            }
        };
        vars.push(Var {
            name,
            size,
            align: u32::try_from(align).map_err(|_| err(line, "alignment too large"))?,
            init,
            managed,
        });
        if !p.eat_punct(',') {
            break;
        }
    }
    p.expect_punct(';')?;
    Ok(vars)
}

/// One scalar literal of an initialiser: its text and whether a `-` preceded it.
struct InitVal<'a> {
    text: &'a str,
    neg: bool,
}

/// Collects the scalar literals of an initialiser, flattening nested braces. `levels` are the
/// array dimensions (then the vector width, if any). Flattening is exact only when every inner
/// list is complete, so a short inner list (`{{1}, {2, 3}}`) is refused.
fn collect_initialiser<'a>(
    p: &mut Parser<'a>,
    levels: &[u64],
) -> Result<Vec<InitVal<'a>>, ImageError> {
    let mut out = Vec::new();
    let braced = p.eat_punct('{');
    let mut depth = braced as usize;
    // Number of values collected when each open inner brace began.
    let mut starts: Vec<usize> = Vec::new();
    loop {
        let line = p.line();
        if depth > 0 && p.eat_punct('{') {
            depth += 1;
            if depth - 1 > levels.len() {
                return Err(err(line, "more braces than the variable has dimensions"));
            }
            starts.push(out.len());
            continue;
        }
        let neg = p.eat_punct('-');
        match p.next_or("an initial value")? {
            Tok::Num(text) => out.push(InitVal { text, neg }),
            Tok::Word(w) => {
                return Err(unsupported(
                    line,
                    format!(
                        "initialiser '{w}{}': variables initialised with addresses (generic(sym), sym) are not supported",
                        if p.peek() == Some(&Tok::Punct('(')) { "(...)" } else { "" }
                    ),
                ));
            }
            t => return Err(err(line, format!("unexpected {} in initialiser", show(&t)))),
        }
        if depth == 0 {
            break;
        }
        // After a value: ',' or one or more '}'.
        loop {
            let line = p.line();
            match p.next_or("',' or '}'")? {
                Tok::Punct(',') => break,
                Tok::Punct('}') => {
                    if depth >= 2 {
                        let start = starts.pop().unwrap_or(0);
                        let want: u64 = levels[depth - 1..].iter().product();
                        if (out.len() - start) as u64 != want {
                            return Err(unsupported(
                                line,
                                format!(
                                    "inner initialiser list with {} of {want} values",
                                    out.len() - start
                                ),
                            ));
                        }
                    }
                    depth -= 1;
                    if depth == 0 {
                        return Ok(out);
                    }
                }
                t => {
                    return Err(unsupported(
                        line,
                        format!("initialiser expression ({} after a value)", show(&t)),
                    ))
                }
            }
        }
    }
    Ok(out)
}

/// Writes one initial value into `dst` (little-endian, `dst.len()` bytes).
fn encode(dst: &mut [u8], kind: Kind, v: &InitVal<'_>, line: u32) -> Result<(), ImageError> {
    let (text, neg) = (v.text, v.neg);
    let bad = || {
        err(
            line,
            format!("bad number '{}{text}'", if neg { "-" } else { "" }),
        )
    };
    let lower = text.get(..2).map(|s| s.to_ascii_lowercase());
    let raw_hex_float = matches!(lower.as_deref(), Some("0f") | Some("0d"));
    let is_float_lit = raw_hex_float
        || (!text.starts_with("0x") && !text.starts_with("0X") && text.contains(['.', 'e', 'E']));
    let n = dst.len();
    if kind == Kind::Float {
        let value: f64 = if raw_hex_float {
            let bits = u64::from_str_radix(&text[2..], 16).map_err(|_| bad())?;
            if lower.as_deref() == Some("0f") {
                if text.len() != 10 {
                    return Err(bad());
                }
                f32::from_bits(bits as u32) as f64
            } else {
                if text.len() != 18 {
                    return Err(bad());
                }
                f64::from_bits(bits)
            }
        } else if is_float_lit {
            text.parse::<f64>().map_err(|_| bad())?
        } else {
            parse_uint(text).ok_or_else(bad)? as f64
        };
        let value = if neg { -value } else { value };
        match n {
            4 => dst.copy_from_slice(&(value as f32).to_le_bytes()),
            8 => dst.copy_from_slice(&value.to_le_bytes()),
            _ => return Err(err(line, "float of unexpected size")),
        }
        return Ok(());
    }
    let bits: u64 = if raw_hex_float {
        // `.b32 x = 0f3F800000`: the literal's bits.
        let expect = if lower.as_deref() == Some("0f") {
            10
        } else {
            18
        };
        if text.len() != expect {
            return Err(bad());
        }
        let b = u64::from_str_radix(&text[2..], 16).map_err(|_| bad())?;
        if neg {
            return Err(bad());
        }
        b
    } else if is_float_lit {
        return Err(err(
            line,
            format!("float literal '{text}' for an integer variable"),
        ));
    } else {
        let u = parse_uint(text).ok_or_else(bad)?;
        if neg {
            u.wrapping_neg()
        } else {
            u
        }
    };
    let le = bits.to_le_bytes();
    dst.copy_from_slice(&le[..n.min(8)]);
    Ok(())
}

/// Parses `.entry name (params) perf-directives { body }` (the `.entry` already consumed).
/// Returns `None` for a declaration without a body.
fn parse_entry(p: &mut Parser<'_>, module_shared: &[(String, u64, u32)]) -> Result<Option<KernelInfo>, ImageError> {
    let line = p.line();
    let name = p.word("a kernel name")?.to_string();
    let mut params = Vec::new();
    let mut offset = 0u64;
    if p.eat_punct('(') && !p.eat_punct(')') {
        loop {
            let pl = p.line();
            let (size, align) = parse_param(p)?;
            offset = align_up(offset, align as u64)
                .ok_or_else(|| err(pl, "parameter offset overflows"))?;
            let off32 = u32::try_from(offset).map_err(|_| err(pl, "parameter list too large"))?;
            let size32 = u32::try_from(size).map_err(|_| err(pl, "parameter too large"))?;
            params.push(ParamInfo {
                offset: off32,
                size: size32,
                align,
            });
            offset = offset
                .checked_add(size)
                .ok_or_else(|| err(pl, "parameter offset overflows"))?;
            if p.eat_punct(')') {
                break;
            }
            p.expect_punct(',')?;
        }
    }
    let mut max_threads: Option<u32> = None;
    loop {
        let dl = p.line();
        match p.peek() {
            Some(Tok::Word(".maxntid" | ".reqntid")) => {
                p.pos += 1;
                let mut prod = p.uint("a thread count")?;
                let mut dims = 1;
                while p.eat_punct(',') {
                    dims += 1;
                    prod = prod.saturating_mul(p.uint("a thread count")?);
                }
                if dims > 3 {
                    return Err(err(dl, "more than 3 dimensions"));
                }
                let prod = u32::try_from(prod).unwrap_or(u32::MAX);
                max_threads = Some(max_threads.map_or(prod, |m| m.min(prod)));
            }
            Some(Tok::Word(
                ".minnctapersm" | ".maxnctapersm" | ".maxnreg" | ".maxclusterrank"
                | ".reqnctapercluster" | ".noreturn" | ".explicitcluster" | ".blocksareclusters",
            )) => {
                p.pos += 1;
                while matches!(p.peek(), Some(Tok::Num(_)) | Some(Tok::Punct(','))) {
                    p.pos += 1;
                }
            }
            Some(Tok::Word(".pragma")) => p.skip_statement()?,
            Some(Tok::Punct(';')) => {
                p.pos += 1;
                return Ok(None);
            }
            Some(Tok::Punct('{')) => break,
            Some(t) => {
                let t = t.clone();
                return Err(err(
                    dl,
                    format!("unexpected {} in the header of '{name}'", show(&t)),
                ));
            }
            None => return Err(err(line, format!("entry '{name}' has no body"))),
        }
    }
    let (shared, local, works) = scan_body(p, module_shared)?;
    Ok(Some(KernelInfo {
        name,
        params,
        max_threads_per_block: max_threads,
        shared_static_bytes: shared,
        local_bytes: local,
        num_regs: None,
        empty_body: !works,
    }))
}

/// One `.param` of an entry: returns (size, align).
fn parse_param(p: &mut Parser<'_>) -> Result<(u64, u32), ImageError> {
    let line = p.line();
    if !p.eat_word(".param") {
        let t = p.next_or("'.param'")?;
        return Err(err(line, format!("expected '.param', found {}", show(&t))));
    }
    let mut align: Option<u64> = None;
    let mut vec_n = 1u64;
    let mut ty: Option<u32> = None;
    loop {
        let l = p.line();
        match p.peek() {
            Some(Tok::Word(".align")) => {
                p.pos += 1;
                let a = p.uint("an alignment")?;
                if !a.is_power_of_two() || a > 1 << 16 {
                    return Err(err(l, format!("bad alignment {a}")));
                }
                align = Some(a);
            }
            Some(Tok::Word(v @ (".v2" | ".v4"))) => {
                vec_n = v[2..].parse().unwrap_or(1);
                p.pos += 1;
            }
            Some(Tok::Word(".ptr")) => {
                // `.ptr [.space] [.align N]`: the pointee's space and alignment, not the
                // parameter's.
                p.pos += 1;
                if matches!(
                    p.peek(),
                    Some(Tok::Word(".global" | ".const" | ".local" | ".shared"))
                ) {
                    p.pos += 1;
                }
                if p.eat_word(".align") {
                    p.uint("an alignment")?;
                }
            }
            Some(Tok::Word(w)) if w.starts_with('.') => {
                let w = *w;
                match scalar_type(w) {
                    Some((s, _)) if ty.is_none() => {
                        ty = Some(s);
                        p.pos += 1;
                    }
                    _ => return Err(err(l, format!("unexpected '{w}' in a parameter"))),
                }
            }
            _ => break,
        }
    }
    let esize = ty.ok_or_else(|| err(line, "parameter without a type"))? as u64 * vec_n;
    p.word("a parameter name")?;
    let mut count = 1u64;
    while p.eat_punct('[') {
        let n = p.uint("an array length")?;
        p.expect_punct(']')?;
        count = count
            .checked_mul(n)
            .ok_or_else(|| err(line, "parameter size overflows"))?;
    }
    let size = count
        .checked_mul(esize)
        .ok_or_else(|| err(line, "parameter size overflows"))?;
    let align = align.unwrap_or(esize);
    Ok((size, align as u32))
}

/// Whether the token before the current one is `.extern`.
fn after_extern(p: &Parser<'_>) -> bool {
    p.pos > 0 && matches!(p.toks.get(p.pos - 1).map(|t| &t.tok), Some(Tok::Word(".extern")))
}

/// Skips a kernel body, adding up its static `.shared` and `.local` declarations and the
/// module-scope `.shared` variables it names (each once; those reached only through a called
/// `.func` are not seen), and telling whether it does anything but return (declarations and a
/// bare `ret` do nothing; anything else, labels included, counts as work).
fn scan_body(p: &mut Parser<'_>, module_shared: &[(String, u64, u32)]) -> Result<(u64, u64, bool), ImageError> {
    let line = p.line();
    p.expect_punct('{')?;
    let mut depth = 1u32;
    let mut shared = 0u64;
    let mut local = 0u64;
    let mut at_stmt_start = true;
    let mut works = false;
    let mut named = vec![false; module_shared.len()];
    while let Some(t) = p.peek().cloned() {
        let l = p.line();
        if let Tok::Word(w) = &t {
            if let Some(i) = module_shared.iter().position(|(n, _, _)| n == w) {
                named[i] = true;
            }
        }
        match t {
            Tok::Punct('{') => {
                depth += 1;
                p.pos += 1;
                at_stmt_start = true;
            }
            Tok::Punct('}') => {
                p.pos += 1;
                depth -= 1;
                if depth == 0 {
                    for (i, (_, size, align)) in module_shared.iter().enumerate() {
                        if named[i] {
                            shared = align_up(shared, *align as u64)
                                .and_then(|t| t.checked_add(*size))
                                .ok_or_else(|| err(l, "static size overflows"))?;
                        }
                    }
                    return Ok((shared, local, works));
                }
                at_stmt_start = true;
            }
            Tok::Punct(';') => {
                p.pos += 1;
                at_stmt_start = true;
            }
            Tok::Word(w @ (".shared" | ".local")) if at_stmt_start => {
                p.pos += 1;
                let vars = parse_variables(p, false)?;
                let total = if w == ".shared" {
                    &mut shared
                } else {
                    &mut local
                };
                for v in vars {
                    *total = align_up(*total, v.align as u64)
                        .and_then(|t| t.checked_add(v.size))
                        .ok_or_else(|| err(l, "static size overflows"))?;
                }
                at_stmt_start = true;
            }
            Tok::Word(".extern") if at_stmt_start => {
                // `.extern .shared` arrays are dynamic shared memory: not static.
                p.skip_statement()?;
            }
            Tok::Punct(':') => {
                // A label `name:` keeps us at a statement start.
                p.pos += 1;
                at_stmt_start = true;
            }
            _ => {
                if at_stmt_start && !matches!(&t, Tok::Word(w) if *w == "ret" || w.starts_with('.')) {
                    works = true;
                }
                p.pos += 1;
                at_stmt_start = false;
            }
        }
    }
    Err(err(line, "kernel body not closed by '}'"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(k: &KernelInfo) -> Vec<(u32, u32, u32)> {
        k.params
            .iter()
            .map(|p| (p.offset, p.size, p.align))
            .collect()
    }

    #[test]
    fn entries_and_params() {
        let m = parse_ptx(
            r#"
            // comment
            .version 8.0 /* block
            comment */
            .target sm_80, debug
            .address_size 64
            .extern .func (.param .b32 ret) vprintf (.param .b64 a, .param .b64 b);
            .func (.param .b32 r) helper(.param .b32 x) { ret; }
            .entry plain (
                .param .u8 a, .param .u16 b, .param .f32 c, .param .f64 d,
                .param .align 16 .b8 s[20],
                .param .u64 .ptr .global .align 16 p,
                .param .s8 e,
                .param .v2 .u32 v
            ) .maxntid 32, 4 .minnctapersm 2
            {
                .reg .b32 %r<4>;
                .shared .align 8 .b8 buf[100];
                .shared .u32 a1, a2;
                .local .align 4 .b8 stack[12];
                .extern .shared .align 16 .b8 dyn[];
            $L1:
                ld.shared.u32 %r1, [buf];
                { .reg .b32 t; }
                ret;
            }
            .visible .entry empty() .reqntid 64 .maxntid 128 { ret; }
            "#,
        )
        .unwrap();
        assert_eq!(m.version, "8.0");
        assert_eq!(m.target, vec!["sm_80", "debug"]);
        assert_eq!(m.kernels.len(), 2);
        let k = &m.kernels[0];
        assert_eq!(k.name, "plain");
        assert_eq!(
            params(k),
            vec![
                (0, 1, 1),
                (2, 2, 2),
                (4, 4, 4),
                (8, 8, 8),
                (16, 20, 16),
                (40, 8, 8),
                (48, 1, 1),
                (56, 8, 8)
            ]
        );
        assert_eq!(k.max_threads_per_block, Some(128));
        assert_eq!(k.shared_static_bytes, 108);
        assert_eq!(k.local_bytes, 12);
        assert_eq!(m.kernels[1].max_threads_per_block, Some(64));
        assert!(m.kernels[1].params.is_empty());
    }

    #[test]
    fn globals_and_initialisers() {
        let m = parse_ptx(
            ".version 9.5\n.target sm_75\n.address_size 64\n\
             .global .align 4 .u32 a = 42;\n\
             .global .u16 neg = -7;\n\
             .global .f32 f = 0f3F800000;\n\
             .global .f64 d = 0dC002000000000000;\n\
             .global .f32 f2 = 1.5;\n\
             .global .b32 bits = 0f40000000;\n\
             .const .align 8 .u32 arr[2][2] = {{1, 2}, {3, 0}};\n\
             .global .u8 open[] = {1, 2, 3};\n\
             .global .align 8 .b8 z[16];\n\
             .global .s32 zero = 0;\n\
             .global .attribute(.managed) .align 4 .u32 managed;\n\
             .global .v2 .f32 v = {0f3F800000, 0f40000000};\n",
        )
        .unwrap();
        let g: Vec<_> = m
            .globals
            .iter()
            .map(|g| (g.name.as_str(), g.size, g.align, g.space, g.init.clone()))
            .collect();
        use GlobalSpace::*;
        assert_eq!(g[0], ("a", 4, 4, Global, Some(vec![42, 0, 0, 0])));
        assert_eq!(
            g[1],
            ("neg", 2, 2, Global, Some((-7i16).to_le_bytes().to_vec()))
        );
        assert_eq!(
            g[2],
            ("f", 4, 4, Global, Some(1.0f32.to_le_bytes().to_vec()))
        );
        assert_eq!(
            g[3],
            ("d", 8, 8, Global, Some((-2.25f64).to_le_bytes().to_vec()))
        );
        assert_eq!(
            g[4],
            ("f2", 4, 4, Global, Some(1.5f32.to_le_bytes().to_vec()))
        );
        assert_eq!(
            g[5],
            ("bits", 4, 4, Global, Some(2.0f32.to_le_bytes().to_vec()))
        );
        assert_eq!(
            g[6],
            (
                "arr",
                16,
                8,
                Const,
                Some(vec![1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0])
            )
        );
        assert_eq!(g[7], ("open", 3, 1, Global, Some(vec![1, 2, 3])));
        assert_eq!(g[8], ("z", 16, 8, Global, None));
        assert_eq!(g[9], ("zero", 4, 4, Global, None));
        assert_eq!(g[10], ("managed", 4, 4, Global, None));
        let mut v = 1.0f32.to_le_bytes().to_vec();
        v.extend_from_slice(&2.0f32.to_le_bytes());
        assert_eq!(g[11], ("v", 8, 8, Global, Some(v)));
        // Only the variable declared with `.attribute(.managed)` is a `__managed__` one.
        let managed: Vec<&str> = m.globals.iter().filter(|g| g.managed).map(|g| g.name.as_str()).collect();
        assert_eq!(managed, ["managed"]);
    }

    #[test]
    fn errors_name_the_line() {
        let e =
            parse_ptx(".version 9.5\n.target sm_75\n.global .u64 p = generic(x)+8;\n").unwrap_err();
        assert!(
            matches!(e, ImageError::PtxUnsupported { line: 3, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("generic"), "{e}");
        let e = parse_ptx(".version 9.5\n\n.global .u32 a[2] = {1,2,3};").unwrap_err();
        assert!(matches!(e, ImageError::Ptx { line: 3, .. }), "{e}");
        let e = parse_ptx(".version 9.5\n.entry k(.param .u32 a\n{ ret; }").unwrap_err();
        assert!(matches!(e, ImageError::Ptx { line: 3, .. }), "{e}");
        let e = parse_ptx(".target sm_75").unwrap_err();
        assert!(matches!(e, ImageError::Ptx { line: 1, .. }), "{e}");
        let e = parse_ptx(".version 9.5\n.entry k() {\n ret;\n").unwrap_err();
        assert!(matches!(e, ImageError::Ptx { .. }), "{e}");
        let e = parse_ptx(".version 9.5\n/* open").unwrap_err();
        assert!(matches!(e, ImageError::Ptx { line: 2, .. }), "{e}");
        let e = parse_ptx(".version 9.5\n.global .u32 a[2][2] = {{1}, {3, 4}};").unwrap_err();
        assert!(
            matches!(e, ImageError::PtxUnsupported { line: 2, .. }),
            "{e}"
        );
        let e = parse_ptx(".version 9.5\n.global .u32 a[2] = {{{1}}, {3}};").unwrap_err();
        assert!(matches!(e, ImageError::Ptx { line: 2, .. }), "{e}");
        let e = parse_ptx(".version 9.5\n.global .u32 a[2][] = {1};").unwrap_err();
        assert!(matches!(e, ImageError::Ptx { line: 2, .. }), "{e}");
        let m = parse_ptx(".version 9.5\n.global .u8 a[2][2] = {1, 2, 3};").unwrap();
        assert_eq!(m.globals[0].init, Some(vec![1, 2, 3]));
        let e = parse_ptx(".version 9.5\n.global .u32 a = 1.5;").unwrap_err();
        assert!(matches!(e, ImageError::Ptx { line: 2, .. }), "{e}");
        let e =
            parse_ptx(".version 9.5\n.global .b8 big[4294967296][4294967296] = {1};").unwrap_err();
        assert!(matches!(e, ImageError::Ptx { line: 2, .. }), "{e}");
        let e = parse_ptx(".version 9.5\n.global .b8 big[2000000000] = {1};").unwrap_err();
        assert!(matches!(e, ImageError::Ptx { line: 2, .. }), "{e}");
        // Initial bytes cover the values given, not the variable: a
        // one-value initialiser of a 1 GiB array holds one byte.
        let m = parse_ptx(".version 9.5\n.global .b8 big[1073741824] = {1};").unwrap();
        assert_eq!((m.globals[0].size, m.globals[0].init.as_deref()), (1 << 30, Some(&[1u8][..])));
        let e = parse_ptx(".version 9.5\n.global .b8 big[2000000000] = {1};").unwrap_err();
        assert!(matches!(e, ImageError::Ptx { line: 2, .. }), "{e}");
    }

    /// Module-scope `.shared` arrays (numba declares them there) count in the static shared
    /// size of the kernels that name them, once each; `.extern .shared` does not.
    /// Regression: CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES read 0 for such kernels.
    #[test]
    fn module_scope_shared_counts_for_the_kernels_that_use_it() {
        let m = parse_ptx(
            r#"
            .version 8.0
            .target sm_80
            .address_size 64
            .shared .align 4 .b8 tile[400];
            .shared .align 8 .b8 other[64];
            .extern .shared .align 16 .b8 dynamic[];
            .visible .entry uses_tile(.param .u64 p)
            {
                .reg .b32 %r<3>;
                .shared .align 4 .b8 own[8];
                mov.u32 %r1, tile;
                ld.shared.u32 %r2, [tile+4];
                ld.shared.u32 %r2, [dynamic];
                ret;
            }
            .visible .entry uses_none() { ret; }
            .visible .entry uses_both() { .reg .b64 %rd<3>; mov.u64 %rd1, other; mov.u64 %rd2, tile; ret; }
            "#,
        )
        .unwrap();
        let size = |name: &str| m.kernels.iter().find(|k| k.name == name).unwrap().shared_static_bytes;
        assert_eq!(size("uses_tile"), 8 + 400);
        assert_eq!(size("uses_none"), 0);
        assert_eq!(size("uses_both"), 64 + 400);
    }
}