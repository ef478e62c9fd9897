//! Device-side `printf` (`vprintf(fmt, args)`): C formatting of the
//! argument buffer nvcc builds: each argument at the next multiple of its
//! own size (4 for int and char, 8 for long, pointers and double: float
//! arguments arrive promoted to double).

use crate::fault::Fault;

/// Longest string a `%s` or the format itself is read up to.
const MAX_STR: usize = 64 * 1024;

/// Formats one call. `read(addr, n)` reads `n` bytes at a generic address.
/// Returns the text and the number of arguments consumed (vprintf's
/// return value on the device).
pub fn format(fmt_addr: u64, args: u64, read: &mut dyn FnMut(u64, usize) -> Result<Vec<u8>, Fault>) -> Result<(Vec<u8>, usize), Fault> {
    let fmt = cstr(fmt_addr, read)?;
    let mut out = Vec::new();
    let mut cur = 0u64;
    let mut nargs = 0usize;
    let mut next = |size: u64, read: &mut dyn FnMut(u64, usize) -> Result<Vec<u8>, Fault>| -> Result<u64, Fault> {
        if args == 0 {
            return Ok(0);
        }
        cur = cur.div_ceil(size) * size;
        let b = read(args + cur, size as usize)?;
        cur += size;
        nargs += 1;
        let mut a = [0u8; 8];
        a[..b.len()].copy_from_slice(&b);
        Ok(u64::from_le_bytes(a))
    };
    let mut i = 0;
    while i < fmt.len() {
        let c = fmt[i];
        if c != b'%' {
            out.push(c);
            i += 1;
            continue;
        }
        let start = i;
        i += 1;
        let mut flags = String::new();
        while i < fmt.len() && b"-+ #0".contains(&fmt[i]) {
            flags.push(fmt[i] as char);
            i += 1;
        }
        let mut width: Option<usize> = None;
        if i < fmt.len() && fmt[i] == b'*' {
            let w = next(4, read)? as u32 as i32;
            if w < 0 {
                flags.push('-');
            }
            width = Some(w.unsigned_abs() as usize);
            i += 1;
        } else {
            while i < fmt.len() && fmt[i].is_ascii_digit() {
                width = Some(width.unwrap_or(0) * 10 + (fmt[i] - b'0') as usize);
                i += 1;
            }
        }
        let mut prec: Option<usize> = None;
        if i < fmt.len() && fmt[i] == b'.' {
            i += 1;
            if i < fmt.len() && fmt[i] == b'*' {
                let p = next(4, read)? as u32 as i32;
                prec = (p >= 0).then_some(p as usize);
                i += 1;
            } else {
                let mut p = 0;
                while i < fmt.len() && fmt[i].is_ascii_digit() {
                    p = p * 10 + (fmt[i] - b'0') as usize;
                    i += 1;
                }
                prec = Some(p);
            }
        }
        let mut long = 0;
        let mut short = 0;
        while i < fmt.len() && b"hlLqjzt".contains(&fmt[i]) {
            match fmt[i] {
                b'h' => short += 1,
                _ => long += 1,
            }
            i += 1;
        }
        let Some(&conv) = fmt.get(i) else {
            out.extend_from_slice(&fmt[start..]);
            break;
        };
        i += 1;
        let isz = if long > 0 { 8 } else { 4 };
        let body: String = match conv {
            b'%' => "%".into(),
            b'd' | b'i' => {
                let raw = next(isz, read)?;
                let v: i64 = match (isz, short) {
                    (8, _) => raw as i64,
                    (_, 1) => raw as u16 as i16 as i64,
                    (_, 2) => raw as u8 as i8 as i64,
                    _ => raw as u32 as i32 as i64,
                };
                int_text(v.unsigned_abs() as u128, v < 0, 10, false, &flags, prec)
            }
            b'u' | b'x' | b'X' | b'o' => {
                let raw = next(isz, read)?;
                let v: u64 = match (isz, short) {
                    (8, _) => raw,
                    (_, 1) => raw as u16 as u64,
                    (_, 2) => raw as u8 as u64,
                    _ => raw as u32 as u64,
                };
                let base = match conv {
                    b'o' => 8,
                    b'u' => 10,
                    _ => 16,
                };
                let mut s = int_text(v as u128, false, base, conv == b'X', &flags.replace(['+', ' '], ""), prec);
                if flags.contains('#') && v != 0 {
                    s = match conv {
                        b'x' => format!("0x{s}"),
                        b'X' => format!("0X{s}"),
                        b'o' if !s.starts_with('0') => format!("0{s}"),
                        _ => s,
                    };
                }
                s
            }
            b'c' => (next(4, read)? as u8 as char).to_string(),
            b's' => {
                let p = next(8, read)?;
                let s = if p == 0 { b"(null)".to_vec() } else { cstr(p, read)? };
                let s = String::from_utf8_lossy(&s).into_owned();
                match prec {
                    Some(p) => s.chars().take(p).collect(),
                    None => s,
                }
            }
            b'p' => format!("0x{:x}", next(8, read)?),
            b'f' | b'F' | b'e' | b'E' | b'g' | b'G' | b'a' | b'A' => {
                let v = f64::from_bits(next(8, read)?);
                float_text(v, conv, &flags, prec)
            }
            _ => {
                // Unknown conversion: printed as written, as CUDA does.
                String::from_utf8_lossy(&fmt[start..i]).into_owned()
            }
        };
        pad(&mut out, body, width, &flags, matches!(conv, b'd' | b'i' | b'u' | b'x' | b'X' | b'o' | b'f' | b'F' | b'e' | b'E' | b'g' | b'G') && prec.is_none_or(|_| !matches!(conv, b'd' | b'i' | b'u' | b'x' | b'X' | b'o')));
    }
    Ok((out, nargs))
}

pub(crate) fn cstr(addr: u64, read: &mut dyn FnMut(u64, usize) -> Result<Vec<u8>, Fault>) -> Result<Vec<u8>, Fault> {
    let mut s = Vec::new();
    while s.len() < MAX_STR {
        let b = read(addr + s.len() as u64, 1)?;
        if b[0] == 0 {
            break;
        }
        s.push(b[0]);
    }
    Ok(s)
}

fn int_text(v: u128, neg: bool, base: u32, upper: bool, flags: &str, prec: Option<usize>) -> String {
    let mut digits = match base {
        8 => format!("{v:o}"),
        16 if upper => format!("{v:X}"),
        16 => format!("{v:x}"),
        _ => v.to_string(),
    };
    if let Some(p) = prec {
        if p == 0 && v == 0 {
            digits.clear();
        }
        while digits.len() < p {
            digits.insert(0, '0');
        }
    }
    let sign = if neg {
        "-"
    } else if flags.contains('+') {
        "+"
    } else if flags.contains(' ') {
        " "
    } else {
        ""
    };
    format!("{sign}{digits}")
}

fn exp_text(v: f64, p: usize, upper: bool) -> String {
    let s = format!("{:.*e}", p, v);
    let (m, e) = s.split_once('e').unwrap_or((&s, "0"));
    let e: i32 = e.parse().unwrap_or(0);
    let t = format!("{m}e{}{:02}", if e < 0 { '-' } else { '+' }, e.abs());
    if upper {
        t.to_uppercase()
    } else {
        t
    }
}

fn float_text(v: f64, conv: u8, flags: &str, prec: Option<usize>) -> String {
    let upper = conv.is_ascii_uppercase();
    let sign = if v.is_sign_negative() && !v.is_nan() {
        "-"
    } else if flags.contains('+') {
        "+"
    } else if flags.contains(' ') {
        " "
    } else {
        ""
    };
    let a = v.abs();
    if !a.is_finite() {
        let t = if a.is_nan() { "nan" } else { "inf" };
        return format!("{sign}{}", if upper { t.to_uppercase() } else { t.to_string() });
    }
    let alt = flags.contains('#');
    let body = match conv.to_ascii_lowercase() {
        b'f' => format!("{:.*}", prec.unwrap_or(6), a),
        b'e' => exp_text(a, prec.unwrap_or(6), upper),
        b'a' => format!("{a:e}"),
        _ => {
            let p = match prec {
                Some(0) => 1,
                Some(p) => p,
                None => 6,
            };
            let x = if a == 0.0 {
                0
            } else {
                let e = exp_text(a, p - 1, false);
                e.rsplit_once('e').and_then(|(_, x)| x.parse::<i32>().ok()).unwrap_or(0)
            };
            let mut s = if (x as i64) < p as i64 && x >= -4 {
                format!("{:.*}", (p as i64 - 1 - x as i64).max(0) as usize, a)
            } else {
                exp_text(a, p - 1, upper)
            };
            if !alt {
                let (m, e) = match s.find(['e', 'E']) {
                    Some(k) => (s[..k].to_string(), s[k..].to_string()),
                    None => (s.clone(), String::new()),
                };
                let m = if m.contains('.') { m.trim_end_matches('0').trim_end_matches('.').to_string() } else { m };
                s = format!("{m}{e}");
            }
            s
        }
    };
    format!("{sign}{body}")
}

fn pad(out: &mut Vec<u8>, body: String, width: Option<usize>, flags: &str, zero_ok: bool) {
    let w = width.unwrap_or(0);
    let n = body.chars().count();
    if n >= w {
        out.extend_from_slice(body.as_bytes());
    } else if flags.contains('-') {
        out.extend_from_slice(body.as_bytes());
        out.extend(std::iter::repeat_n(b' ', w - n));
    } else if flags.contains('0') && zero_ok && !body.contains("inf") && !body.contains("nan") {
        let (sign, rest) = match body.chars().next() {
            Some(c @ ('-' | '+' | ' ')) => (c.to_string(), body[1..].to_string()),
            _ => (String::new(), body.clone()),
        };
        let (pre, rest) = if rest.starts_with("0x") || rest.starts_with("0X") { (rest[..2].to_string(), rest[2..].to_string()) } else { (String::new(), rest) };
        out.extend_from_slice(sign.as_bytes());
        out.extend_from_slice(pre.as_bytes());
        out.extend(std::iter::repeat_n(b'0', w - n));
        out.extend_from_slice(rest.as_bytes());
    } else {
        out.extend(std::iter::repeat_n(b' ', w - n));
        out.extend_from_slice(body.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(fmt: &str, args: &[u8]) -> String {
        let mut mem = vec![0u8; 0x1000];
        mem[0x100..0x100 + fmt.len()].copy_from_slice(fmt.as_bytes());
        mem[0x400..0x400 + args.len()].copy_from_slice(args);
        mem[0x800..0x803].copy_from_slice(b"abc");
        let mut rd = |a: u64, n: usize| Ok(mem[a as usize..a as usize + n].to_vec());
        String::from_utf8(format(0x100, 0x400, &mut rd).unwrap().0).unwrap()
    }

    #[test]
    fn formats_like_c() {
        let mut a = Vec::new();
        a.extend_from_slice(&(-42i32).to_le_bytes());
        a.extend_from_slice(&[0; 4]);
        a.extend_from_slice(&1.5f64.to_le_bytes());
        a.extend_from_slice(&0x800u64.to_le_bytes());
        a.extend_from_slice(&255u32.to_le_bytes());
        a.extend_from_slice(&[0; 4]);
        a.extend_from_slice(&123456789i64.to_le_bytes());
        assert_eq!(run("d=%d f=%f s=%s x=%#06x ld=%ld %%\n", &a), "d=-42 f=1.500000 s=abc x=0x00ff ld=123456789 %\n");
        let mut b = Vec::new();
        b.extend_from_slice(&0.0001234f64.to_le_bytes());
        b.extend_from_slice(&1234567.0f64.to_le_bytes());
        b.extend_from_slice(&100.0f64.to_le_bytes());
        assert_eq!(run("%g %g %.3e|%5d|%-4d|", &[b.clone(), 7i32.to_le_bytes().to_vec(), 8i32.to_le_bytes().to_vec()].concat()), "0.0001234 1.23457e+06 1.000e+02|    7|8   |");
    }
}
