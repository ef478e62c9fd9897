//! Linking PTX modules into one, as the driver's JIT linker does for PTX inputs: every
//! module's variables, functions and kernels in one module, `.extern` declarations resolved
//! against the other inputs' definitions, `.weak` duplicates folded into one, module-local
//! names that collide renamed, unresolved references refused. The result is PTX text, so both
//! backends load it as they load any PTX (the real driver JIT-compiles it; the sim runs it).
//!
//! The linker works on top-level items of the text (a directive up to its `;`, a function up
//! to its closing brace), not on a parse tree: what it must know of an item is its kind, name
//! and linkage, and the bodies pass through unchanged. Debug sections, `.file` and `.loc` are
//! dropped: their file numbers are per input and would collide.

use std::collections::{HashMap, HashSet};

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LinkError {
    #[error("undefined reference to `{0}`")]
    Undefined(String),
    #[error("multiple definitions of `{0}`")]
    Duplicate(String),
    #[error("input {input}: unterminated {what}")]
    Unterminated { input: usize, what: &'static str },
    #[error("input {input}: no `.version`/`.target` header")]
    NoHeader { input: usize },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Linkage {
    /// No linkage directive: local to its module.
    Internal,
    Visible,
    Weak,
    Extern,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    Version(String),
    Target(String),
    AddressSize,
    Debug,
    /// A function or kernel; `body` when it is a definition.
    Func { name: String, entry: bool, body: bool },
    /// A variable; `.extern` ones are declarations.
    Var { name: String, shared: bool },
    Other,
}

#[derive(Debug, Clone)]
struct Item {
    text: String,
    kind: Kind,
    linkage: Linkage,
}

/// Splits PTX text into top-level items. Comments and strings are skipped over; the scan is
/// iterative, so no nesting depth can exhaust a stack.
fn split(text: &str, input: usize) -> Result<Vec<String>, LinkError> {
    let b = text.as_bytes();
    let mut items = Vec::new();
    let mut i = 0;
    let mut start: Option<usize> = None;
    let mut depth = 0usize;
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
            continue;
        }
        if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let end = text[i + 2..].find("*/").ok_or(LinkError::Unterminated { input, what: "comment" })?;
            i += end + 4;
            continue;
        }
        if start.is_none() {
            if c.is_ascii_whitespace() || c == 0 {
                i += 1;
                continue;
            }
            // Header and `.file` directives end at the end of their line, with no `;`.
            if [".version", ".target", ".address_size", ".file"].iter().any(|d| text[i..].starts_with(d)) {
                let end = text[i..].find('\n').map_or(b.len(), |e| i + e);
                items.push(text[i..end].trim_end().to_string());
                i = end;
                continue;
            }
            start = Some(i);
        }
        match c {
            b'"' => {
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                if i >= b.len() {
                    return Err(LinkError::Unterminated { input, what: "string" });
                }
            }
            b'{' => depth += 1,
            b'}' => {
                depth = depth.checked_sub(1).ok_or(LinkError::Unterminated { input, what: "block" })?;
                if depth == 0 {
                    // A body ends here, an initializer at the `;` after it.
                    let rest = text[i + 1..].trim_start();
                    if !rest.starts_with(';') && !rest.starts_with(',') {
                        items.push(text[start.take().unwrap()..=i].to_string());
                    }
                }
            }
            b';' if depth == 0 => items.push(text[start.take().unwrap()..=i].to_string()),
            _ => {}
        }
        i += 1;
    }
    if depth != 0 {
        return Err(LinkError::Unterminated { input, what: "block" });
    }
    if let Some(s) = start {
        let tail = text[s..].trim_matches(|c: char| c.is_whitespace() || c == '\0');
        if !tail.is_empty() {
            return Err(LinkError::Unterminated { input, what: "directive" });
        }
    }
    Ok(items)
}

fn is_ident_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || c == b'_' || c == b'$'
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_' || c == b'$'
}

/// The identifier starting at or after `from`, skipping whitespace.
fn ident_at(s: &str, from: usize) -> Option<&str> {
    let b = s.as_bytes();
    let mut i = from;
    while i < b.len() && b[i].is_ascii_whitespace() {
        i += 1;
    }
    let st = i;
    if i < b.len() && is_ident_start(b[i]) {
        while i < b.len() && is_ident(b[i]) {
            i += 1;
        }
        return Some(&s[st..i]);
    }
    None
}

/// Position just after the whole word `w` (a directive such as `.func`) in `s`, if present.
fn after_word(s: &str, w: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(p) = s[from..].find(w) {
        let at = from + p;
        let end = at + w.len();
        if s.as_bytes().get(end).is_none_or(|c| !is_ident(*c)) {
            return Some(end);
        }
        from = end;
    }
    None
}

fn classify(text: String) -> Item {
    let head_end = text.find(['{', '=']).unwrap_or(text.len());
    let head = &text[..head_end];
    let words: Vec<&str> = head.split(|c: char| c.is_whitespace() || "(),;[]<>".contains(c)).filter(|w| !w.is_empty()).collect();
    let has = |w: &str| words.contains(&w);
    let linkage = if has(".extern") {
        Linkage::Extern
    } else if has(".weak") || has(".common") {
        Linkage::Weak
    } else if has(".visible") {
        Linkage::Visible
    } else {
        Linkage::Internal
    };
    let kind = match words.first().copied() {
        Some(".version") => Kind::Version(words.get(1).unwrap_or(&"").to_string()),
        Some(".target") => Kind::Target(head.trim_start().trim_start_matches(".target").trim().trim_end_matches(';').to_string()),
        Some(".address_size") => Kind::AddressSize,
        Some(".file") | Some(".section") => Kind::Debug,
        _ if has(".entry") => match after_word(head, ".entry").and_then(|p| ident_at(head, p)) {
            Some(n) => Kind::Func { name: n.to_string(), entry: true, body: text.trim_end().ends_with('}') },
            None => Kind::Other,
        },
        _ if has(".func") => {
            // `.func (.param .b32 ret) name(...)`: the name follows the optional return list.
            let mut p = after_word(head, ".func").unwrap_or(head.len());
            let rest = head[p..].trim_start();
            if rest.starts_with('(') {
                p = head.len() - rest.len() + rest.find(')').map_or(rest.len(), |c| c + 1);
            }
            match ident_at(head, p) {
                Some(n) => Kind::Func { name: n.to_string(), entry: false, body: text.trim_end().ends_with('}') },
                None => Kind::Other,
            }
        }
        _ if words.iter().any(|w| matches!(*w, ".global" | ".const" | ".shared" | ".local" | ".tex" | ".surfref" | ".texref" | ".samplerref")) => {
            let name = words.iter().rev().find(|w| w.as_bytes().first().is_some_and(|c| is_ident_start(*c))).map(|w| w.to_string());
            match name {
                Some(name) => Kind::Var { name, shared: has(".shared") },
                None => Kind::Other,
            }
        }
        _ => Kind::Other,
    };
    Item { text, kind, linkage }
}

/// Replaces whole identifiers named in `map` (outside comments and strings).
fn rename(text: &str, map: &HashMap<String, String>) -> String {
    if map.is_empty() {
        return text.to_string();
    }
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if is_ident_start(c) && (i == 0 || !(is_ident(b[i - 1]) || b[i - 1] == b'.' || b[i - 1] == b'%')) {
            let st = i;
            while i < b.len() && is_ident(b[i]) {
                i += 1;
            }
            let w = &text[st..i];
            out.push_str(map.get(w).map_or(w, String::as_str));
            continue;
        }
        if c == b'"' {
            let st = i;
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i = (i + 1).min(b.len());
            out.push_str(&text[st..i]);
            continue;
        }
        // Copy one UTF-8 character.
        let len = text[i..].chars().next().map_or(1, char::len_utf8);
        out.push_str(&text[i..i + len]);
        i += len;
    }
    out
}

fn version_key(v: &str) -> (u32, u32) {
    let mut it = v.split('.').map(|p| p.parse().unwrap_or(0));
    (it.next().unwrap_or(0), it.next().unwrap_or(0))
}

fn target_arch(t: &str) -> u32 {
    t.split(|c: char| c == ',' || c.is_whitespace())
        .find_map(|w| w.strip_prefix("sm_"))
        .map_or(0, |a| a.trim_end_matches(|c: char| c.is_ascii_alphabetic()).parse().unwrap_or(0))
}

/// Functions that a driver provides to every module (system calls of the PTX ABI).
fn is_system_function(name: &str) -> bool {
    matches!(name, "vprintf" | "malloc" | "free" | "__assertfail" | "cudaGetParameterBufferV2" | "cudaLaunchDeviceV2" | "cudaDeviceSynchronize" | "cudaGetLastError")
}

fn without_debug_lines(text: &str) -> String {
    text.lines().filter(|l| !matches!(l.trim_start().split_whitespace().next(), Some(".loc" | ".file"))).collect::<Vec<_>>().join("\n")
}

/// Links PTX texts (each a whole module) into one module's text.
pub fn link_ptx(texts: &[&str]) -> Result<String, LinkError> {
    let mut modules: Vec<Vec<Item>> = Vec::with_capacity(texts.len());
    for (n, t) in texts.iter().enumerate() {
        modules.push(split(t, n)?.into_iter().map(classify).collect());
    }
    // Module-local names defined in more than one input get a per-input suffix.
    let mut defined_in: HashMap<String, HashSet<usize>> = HashMap::new();
    for (n, items) in modules.iter().enumerate() {
        for it in items {
            let name = match &it.kind {
                Kind::Func { name, body: true, .. } => name,
                Kind::Var { name, .. } if it.linkage != Linkage::Extern => name,
                _ => continue,
            };
            defined_in.entry(name.clone()).or_default().insert(n);
        }
    }
    for (n, items) in modules.iter_mut().enumerate() {
        let mut map = HashMap::new();
        for it in items.iter() {
            let name = match &it.kind {
                Kind::Func { name, body: true, .. } | Kind::Var { name, .. } if it.linkage == Linkage::Internal => name,
                _ => continue,
            };
            if defined_in.get(name).is_some_and(|s| s.len() > 1) {
                map.insert(name.clone(), format!("{name}__rgpu_link{n}"));
            }
        }
        if !map.is_empty() {
            let text = rename(texts[n], &map);
            *items = split(&text, n)?.into_iter().map(classify).collect();
        }
    }

    // Header: the newest version, the highest target.
    let (mut version, mut target) = (None::<String>, None::<String>);
    for (n, items) in modules.iter().enumerate() {
        let v = items.iter().find_map(|i| if let Kind::Version(v) = &i.kind { Some(v.clone()) } else { None });
        let t = items.iter().find_map(|i| if let Kind::Target(t) = &i.kind { Some(t.clone()) } else { None });
        let (Some(v), Some(t)) = (v, t) else { return Err(LinkError::NoHeader { input: n }) };
        if version.as_deref().is_none_or(|cur| version_key(&v) > version_key(cur)) {
            version = Some(v);
        }
        if target.as_deref().is_none_or(|cur| target_arch(&t) > target_arch(cur)) {
            target = Some(t);
        }
    }
    let target: String = target.unwrap_or_default().split(',').map(str::trim).filter(|w| *w != "debug").collect::<Vec<_>>().join(", ");

    // One definition per global name: a strong one over weak ones, the first weak otherwise.
    let mut chosen: HashMap<String, (usize, usize)> = HashMap::new();
    let mut func_linkage: HashMap<String, Linkage> = HashMap::new();
    for (n, items) in modules.iter().enumerate() {
        for (k, it) in items.iter().enumerate() {
            let (name, is_func) = match &it.kind {
                Kind::Func { name, body: true, .. } => (name, true),
                Kind::Var { name, .. } if it.linkage != Linkage::Extern => (name, false),
                _ => continue,
            };
            match chosen.get(name) {
                None => {
                    chosen.insert(name.clone(), (n, k));
                }
                Some(&(pn, pk)) => {
                    let prev = modules[pn][pk].linkage;
                    match (prev, it.linkage) {
                        (Linkage::Weak, Linkage::Weak) | (_, Linkage::Weak) => {}
                        (Linkage::Weak, _) => {
                            chosen.insert(name.clone(), (n, k));
                        }
                        _ => return Err(LinkError::Duplicate(name.clone())),
                    }
                }
            }
            if is_func {
                let l = modules[chosen[name].0][chosen[name].1].linkage;
                func_linkage.insert(name.clone(), l);
            }
        }
    }

    let mut out = format!(".version {}\n.target {}\n.address_size 64\n\n", version.unwrap_or_default(), target);
    // Variables first, so that every function sees them declared.
    let mut declared: HashSet<String> = HashSet::new();
    for (n, items) in modules.iter().enumerate() {
        for (k, it) in items.iter().enumerate() {
            let Kind::Var { name, shared } = &it.kind else { continue };
            if it.linkage == Linkage::Extern {
                if chosen.contains_key(name) {
                    continue;
                }
                // `.extern .shared` arrays are the dynamic shared memory, not a link symbol.
                if !*shared {
                    return Err(LinkError::Undefined(name.clone()));
                }
                if declared.insert(name.clone()) {
                    out.push_str(&it.text);
                    out.push('\n');
                }
            } else if chosen.get(name) == Some(&(n, k)) {
                out.push_str(&it.text);
                out.push('\n');
            }
        }
    }
    // Prototypes of every defined function, then the system functions referenced.
    for (n, items) in modules.iter().enumerate() {
        for (k, it) in items.iter().enumerate() {
            if let Kind::Func { name, entry: false, body: true } = &it.kind {
                if chosen.get(name) == Some(&(n, k)) {
                    let head = &it.text[..it.text.find('{').unwrap_or(it.text.len())];
                    out.push_str(head.trim_end());
                    out.push_str(";\n");
                }
            }
        }
    }
    let mut system = HashSet::new();
    for items in &modules {
        for it in items {
            if let Kind::Func { name, body: false, .. } = &it.kind {
                if func_linkage.contains_key(name) {
                    continue;
                }
                if !is_system_function(name) {
                    return Err(LinkError::Undefined(name.clone()));
                }
                if system.insert(name.clone()) {
                    out.push_str(&it.text);
                    out.push('\n');
                }
            }
        }
    }
    out.push('\n');
    for (n, items) in modules.iter().enumerate() {
        for (k, it) in items.iter().enumerate() {
            match &it.kind {
                Kind::Func { name, body: true, .. } if chosen.get(name) == Some(&(n, k)) => {
                    out.push_str(&without_debug_lines(&it.text));
                    out.push_str("\n\n");
                }
                Kind::Other => {
                    out.push_str(&it.text);
                    out.push('\n');
                }
                _ => {}
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAIN: &str = "//\n// Generated\n//\n.version 8.0\n.target sm_80\n.address_size 64\n\n\
        .extern .func (.param .b32 func_retval0) add_one(\n.param .b32 add_one_param_0\n);\n\
        .extern .global .align 4 .u32 counter;\n\
        .extern .func (.param .b32 func_retval0) vprintf(.param .b64 a, .param .b64 b);\n\
        .func helper() { ret; }\n\
        .visible .entry k(.param .u64 p)\n.maxntid 128, 1, 1\n{\n.reg .b32 %r<4>;\n.loc 1 3 0\n\
        { .reg .b32 t; }\n\
        call.uni (%r2), add_one, (%r1);\nret;\n}\n";
    const LIB: &str = ".version 8.4\n.target sm_90\n.address_size 64\n\
        .visible .global .align 4 .u32 counter = 7;\n\
        .global .align 4 .b8 table[8] = {1, 2, 3, 4, 5, 6, 7, 8};\n\
        .func helper() { ret; }\n\
        .weak .func (.param .b32 func_retval0) add_one(\n.param .b32 add_one_param_0\n)\n{\n.reg .b32 %r<3>;\n/* { */ ret;\n}\n";

    #[test]
    fn links_externs_to_definitions_and_keeps_locals_apart() {
        let out = link_ptx(&[MAIN, LIB]).unwrap();
        assert!(out.starts_with(".version 8.4\n.target sm_90\n"), "{out}");
        assert!(!out.contains(".extern .global"), "resolved extern variable kept:\n{out}");
        assert!(out.contains(".visible .global .align 4 .u32 counter = 7;"));
        assert!(out.contains("table[8] = {1, 2, 3, 4, 5, 6, 7, 8};"));
        // Each input's own `helper` survives under its own name.
        assert!(out.contains(".func helper__rgpu_link0()") && out.contains(".func helper__rgpu_link1()"), "{out}");
        // One prototype and one body of add_one; vprintf stays declared; line info dropped.
        assert_eq!(out.matches("add_one(\n.param .b32 add_one_param_0\n);").count(), 1, "{out}");
        assert_eq!(out.matches(".weak .func (.param .b32 func_retval0) add_one(").count(), 2, "{out}");
        assert!(out.contains("vprintf"));
        assert!(!out.contains(".loc"));
        // The linked module is one our PTX reader accepts, with the kernel in it.
        let m = crate::module::ptx::parse_ptx(&out).unwrap();
        assert_eq!(m.kernels.iter().map(|k| k.name.as_str()).collect::<Vec<_>>(), ["k"]);
        rgpu_ptx::Module::parse(&out).unwrap();
    }

    #[test]
    fn refuses_what_a_linker_refuses() {
        assert_eq!(link_ptx(&[MAIN]), Err(LinkError::Undefined("counter".into())));
        let twice = ".version 8.0\n.target sm_80\n.address_size 64\n.visible .global .u32 counter;\n";
        assert_eq!(link_ptx(&[MAIN, LIB, twice]), Err(LinkError::Duplicate("counter".into())));
        assert!(matches!(link_ptx(&[MAIN, ".version 8.0\n.target sm_80\n.visible .entry x() { ret;"]), Err(LinkError::Unterminated { input: 1, .. })));
        assert!(matches!(link_ptx(&[".visible .entry x() { ret; }"]), Err(LinkError::NoHeader { input: 0 })));
        // Deep nesting is scanned, not recursed into.
        let deep = format!(".version 8.0\n.target sm_80\n.address_size 64\n.visible .entry x() {}{}\n", "{".repeat(100_000), "}".repeat(100_000));
        assert!(link_ptx(&[&deep]).is_ok());
    }
}
