//! ELF64 cubins as ptxas writes them (checked against nvcc 13.5 output for sm_75 and sm_90).
//!
//! - Kernels: FUNC symbols with `STO_CUDA_ENTRY` (0x10) in `st_other`, code in `.text.<name>`.
//! - Per-kernel attributes: section `.nv.info.<name>` (type `SHT_CUDA_INFO` 0x70000000), a list
//!   of records `u8 format, u8 attribute, ...`; formats 1 (no value), 2 (byte), 3 (u16) take 4
//!   bytes, format 4 is followed by a u16 length and that many bytes. Used attributes:
//!   `EIATTR_KPARAM_INFO` (0x17: u32 index, u16 ordinal, u16 offset, u32 flags whose bits 18..31
//!   are the size), `EIATTR_CBANK_PARAM_SIZE` (0x19), `EIATTR_MAX_THREADS` (0x05) and
//!   `EIATTR_REQNTID` (0x10) (three u32).
//! - Module attributes: `.nv.info` holds `EIATTR_REGCOUNT` (0x2f) and `EIATTR_FRAME_SIZE` (0x11)
//!   as (u32 symbol index, u32 value). Older cubins also put the register count in the top
//!   byte of `.text.<name>`'s `sh_info`.
//! - Static shared memory: the size of `.nv.shared.<name>` (for sm_90 ptxas includes 1 KiB of
//!   reserved shared memory there).
//! - Globals: OBJECT symbols in `.nv.global` (zero-initialised), `.nv.global.init` (initial bytes
//!   in the section) and the user constant bank `.nv.constant<N>` (N = 3 for sm_75..sm_90; bank
//!   0 holds kernel parameters and is per kernel). Variables initialised with an address carry a
//!   relocation against their section; they are refused.
//!
//! Parameter alignment is not stored in a cubin; it is inferred as the largest power of two
//! (at most 16) dividing both the offset and the size, which can over-state it (a 2-byte struct
//! of chars reads as align 2). Global alignment is inferred likewise from offset, size and the
//! section's alignment.

use super::{GlobalInfo, GlobalSpace, ImageError, KernelInfo, ParamInfo};

const SHT_SYMTAB: u32 = 2;
const SHT_RELA: u32 = 4;
const SHT_NOBITS: u32 = 8;
const SHT_REL: u32 = 9;
const SHT_CUDA_INFO: u32 = 0x7000_0000;
const STT_OBJECT: u8 = 1;
const STT_FUNC: u8 = 2;
const STO_CUDA_ENTRY: u8 = 0x10;
/// `st_other` of a `__managed__` variable's symbol.
const STO_CUDA_MANAGED: u8 = 0x04;
const EM_CUDA: u16 = 190;

const EIATTR_MAX_THREADS: u8 = 0x05;
const EIATTR_REQNTID: u8 = 0x10;
const EIATTR_FRAME_SIZE: u8 = 0x11;
const EIATTR_KPARAM_INFO: u8 = 0x17;
const EIATTR_CBANK_PARAM_SIZE: u8 = 0x19;
const EIATTR_REGCOUNT: u8 = 0x2f;

/// What the cubin reader found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cubin {
    /// `sm_XY` as XY, from the ELF header flags.
    pub arch: u32,
    pub kernels: Vec<KernelInfo>,
    pub globals: Vec<GlobalInfo>,
}

fn bad(msg: impl Into<String>) -> ImageError {
    ImageError::BadCubin(msg.into())
}

struct Section {
    name: String,
    kind: u32,
    offset: u64,
    size: u64,
    info: u32,
    align: u64,
    link: u32,
    entsize: u64,
}

struct Symbol {
    name: String,
    kind: u8,
    other: u8,
    shndx: u16,
    value: u64,
    size: u64,
}

fn rd<const N: usize>(b: &[u8], off: u64) -> Option<[u8; N]> {
    let off = usize::try_from(off).ok()?;
    let s = b.get(off..off.checked_add(N)?)?;
    let mut a = [0u8; N];
    a.copy_from_slice(s);
    Some(a)
}

fn r16(b: &[u8], off: u64) -> Option<u16> {
    rd::<2>(b, off).map(u16::from_le_bytes)
}
fn r32(b: &[u8], off: u64) -> Option<u32> {
    rd::<4>(b, off).map(u32::from_le_bytes)
}
fn r64(b: &[u8], off: u64) -> Option<u64> {
    rd::<8>(b, off).map(u64::from_le_bytes)
}

struct Elf<'a> {
    bytes: &'a [u8],
    sections: Vec<Section>,
}

impl<'a> Elf<'a> {
    fn parse(bytes: &'a [u8]) -> Result<Self, ImageError> {
        if bytes.len() < 64 {
            return Err(ImageError::Truncated {
                what: "ELF header",
                offset: 0,
                need: 64,
                have: bytes.len() as u64,
            });
        }
        if &bytes[..4] != b"\x7fELF" {
            return Err(bad("no ELF magic"));
        }
        if bytes[4] != 2 || bytes[5] != 1 {
            return Err(bad("only little-endian ELF64 cubins are supported"));
        }
        let machine = r16(bytes, 0x12).unwrap_or(0);
        if machine != EM_CUDA {
            return Err(bad(format!("ELF machine {machine} is not EM_CUDA (190)")));
        }
        // Program headers (what a driver loads) must lie inside the image too.
        let phoff = r64(bytes, 0x20).unwrap_or(0);
        let phentsize = r16(bytes, 0x36).unwrap_or(0) as u64;
        let phnum = r16(bytes, 0x38).unwrap_or(0) as u64;
        let ph_end = (phnum * phentsize).checked_add(phoff);
        if phnum > 0 && !matches!(ph_end, Some(e) if e <= bytes.len() as u64) {
            return Err(ImageError::Truncated {
                what: "ELF program headers",
                offset: phoff,
                need: phnum * phentsize,
                have: (bytes.len() as u64).saturating_sub(phoff),
            });
        }
        let shoff = r64(bytes, 0x28).unwrap_or(0);
        let shentsize = r16(bytes, 0x3a).unwrap_or(0) as u64;
        let shnum = r16(bytes, 0x3c).unwrap_or(0) as u64;
        let shstrndx = r16(bytes, 0x3e).unwrap_or(0) as u64;
        if shnum == 0 {
            return Err(bad("no section headers"));
        }
        if shentsize < 64 {
            return Err(bad(format!("section header size {shentsize} is below 64")));
        }
        let table_end = shnum
            .checked_mul(shentsize)
            .and_then(|n| n.checked_add(shoff))
            .filter(|&e| e <= bytes.len() as u64);
        if table_end.is_none() {
            return Err(ImageError::Truncated {
                what: "ELF section headers",
                offset: shoff,
                need: shnum * shentsize,
                have: (bytes.len() as u64).saturating_sub(shoff),
            });
        }
        let mut raw = Vec::with_capacity(shnum as usize);
        for i in 0..shnum {
            let h = shoff + i * shentsize;
            raw.push((
                r32(bytes, h).unwrap_or(0),
                Section {
                    name: String::new(),
                    kind: r32(bytes, h + 4).unwrap_or(0),
                    offset: r64(bytes, h + 24).unwrap_or(0),
                    size: r64(bytes, h + 32).unwrap_or(0),
                    link: r32(bytes, h + 40).unwrap_or(0),
                    info: r32(bytes, h + 44).unwrap_or(0),
                    align: r64(bytes, h + 48).unwrap_or(0),
                    entsize: r64(bytes, h + 56).unwrap_or(0),
                },
            ));
        }
        let mut elf = Elf {
            bytes,
            sections: Vec::new(),
        };
        let shstr = raw
            .get(shstrndx as usize)
            .map(|(_, s)| (s.offset, s.size, s.kind))
            .ok_or_else(|| bad(format!("section name table index {shstrndx} out of range")))?;
        for (name_off, mut s) in raw {
            s.name = elf.string_at(shstr, name_off, "section name")?;
            elf.sections.push(s);
        }
        Ok(elf)
    }

    /// Bytes of a section (empty for NOBITS); checked against the buffer.
    fn data(&self, s: &Section) -> Result<&'a [u8], ImageError> {
        if s.kind == SHT_NOBITS {
            return Ok(&[]);
        }
        let end = s
            .offset
            .checked_add(s.size)
            .filter(|&e| e <= self.bytes.len() as u64);
        match end {
            Some(end) => Ok(&self.bytes[s.offset as usize..end as usize]),
            None => Err(ImageError::Truncated {
                what: "ELF section",
                offset: s.offset,
                need: s.size,
                have: (self.bytes.len() as u64).saturating_sub(s.offset),
            }),
        }
    }

    /// NUL-terminated string at `off` within the string table (offset, size, kind).
    fn string_at(&self, tab: (u64, u64, u32), off: u32, what: &str) -> Result<String, ImageError> {
        let (toff, tsize, kind) = tab;
        let fake = Section {
            name: String::new(),
            kind,
            offset: toff,
            size: tsize,
            info: 0,
            align: 0,
            link: 0,
            entsize: 0,
        };
        let data = self.data(&fake)?;
        let tail = data
            .get(off as usize..)
            .ok_or_else(|| bad(format!("{what} offset {off} outside its string table")))?;
        let n = tail
            .iter()
            .position(|&c| c == 0)
            .ok_or_else(|| bad(format!("{what} at {off} not NUL-terminated")))?;
        String::from_utf8(tail[..n].to_vec())
            .map_err(|_| bad(format!("{what} at {off} is not UTF-8")))
    }

    fn symbols(&self) -> Result<Vec<Symbol>, ImageError> {
        let Some(symtab) = self.sections.iter().find(|s| s.kind == SHT_SYMTAB) else {
            return Ok(Vec::new());
        };
        if symtab.entsize != 0 && symtab.entsize != 24 {
            return Err(bad(format!(
                "symbol entry size {} is not 24",
                symtab.entsize
            )));
        }
        let data = self.data(symtab)?;
        let strtab = self
            .sections
            .get(symtab.link as usize)
            .map(|s| (s.offset, s.size, s.kind))
            .ok_or_else(|| bad("symbol table links to no string table"))?;
        let mut out = Vec::with_capacity(data.len() / 24);
        for e in data.chunks_exact(24) {
            let name_off = r32(e, 0).unwrap_or(0);
            out.push(Symbol {
                name: self.string_at(strtab, name_off, "symbol name")?,
                kind: e[4] & 0xf,
                other: e[5],
                shndx: r16(e, 6).unwrap_or(0),
                value: r64(e, 8).unwrap_or(0),
                size: r64(e, 16).unwrap_or(0),
            });
        }
        Ok(out)
    }
}

/// One `.nv.info` record.
struct Attr<'a> {
    attr: u8,
    /// The value bytes: 2 for formats 1..3 (u16 / u8 + pad / pad), the payload for format 4.
    data: &'a [u8],
}

fn attrs<'a>(data: &'a [u8], section: &str) -> Result<Vec<Attr<'a>>, ImageError> {
    let mut out = Vec::new();
    let mut o = 0usize;
    while o < data.len() {
        let (Some(&fmt), Some(&attr)) = (data.get(o), data.get(o + 1)) else {
            return Err(bad(format!("{section}: truncated record at {o}")));
        };
        let val = data
            .get(o + 2..o + 4)
            .ok_or_else(|| bad(format!("{section}: truncated record at {o}")))?;
        match fmt {
            1..=3 => {
                out.push(Attr { attr, data: val });
                o += 4;
            }
            4 => {
                let n = u16::from_le_bytes([val[0], val[1]]) as usize;
                let d = data.get(o + 4..o + 4 + n).ok_or_else(|| {
                    bad(format!(
                        "{section}: record at {o} claims {n} bytes past the end"
                    ))
                })?;
                out.push(Attr { attr, data: d });
                o += 4 + n;
            }
            f => return Err(bad(format!("{section}: unknown record format {f} at {o}"))),
        }
    }
    Ok(out)
}

/// Largest power of two dividing `v`, capped (0 divides by anything).
fn pow2_divisor(v: u64, cap: u64) -> u64 {
    if v == 0 {
        cap
    } else {
        (1u64 << v.trailing_zeros()).min(cap)
    }
}

/// Threads in a block of `dims` (a zero counts as one), saturating at
/// `u32::MAX`: three u32 dimensions overflow even a u64 product.
fn block_threads(dims: [u32; 3]) -> u32 {
    let n = dims.iter().fold(1u64, |n, &d| n.saturating_mul(d.max(1) as u64));
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Reads kernels and globals from an ELF cubin.
pub fn parse_cubin(bytes: &[u8]) -> Result<Cubin, ImageError> {
    let elf = Elf::parse(bytes)?;
    let abi_version = bytes[8];
    let flags = r32(bytes, 0x30).unwrap_or(0);
    // From ELF ABI version 8 on, the SM number is in bits 8..15; before it was bits 0..7.
    let arch = if abi_version >= 8 {
        (flags >> 8) & 0xff
    } else {
        flags & 0xff
    };
    let syms = elf.symbols()?;

    // Module-wide .nv.info: per-function register count and frame size, keyed by symbol index.
    let mut regcount = std::collections::HashMap::new();
    let mut frame = std::collections::HashMap::new();
    for s in elf
        .sections
        .iter()
        .filter(|s| s.kind == SHT_CUDA_INFO && s.name == ".nv.info")
    {
        for a in attrs(elf.data(s)?, &s.name)? {
            if a.data.len() == 8 && (a.attr == EIATTR_REGCOUNT || a.attr == EIATTR_FRAME_SIZE) {
                let sym = r32(a.data, 0).unwrap_or(0);
                let v = r32(a.data, 4).unwrap_or(0);
                if a.attr == EIATTR_REGCOUNT {
                    regcount.insert(sym, v);
                } else {
                    frame.insert(sym, v);
                }
            }
        }
    }

    let mut kernels = Vec::new();
    for (si, sym) in syms.iter().enumerate() {
        if sym.kind != STT_FUNC || sym.other & STO_CUDA_ENTRY == 0 {
            continue;
        }
        let name = &sym.name;
        let info_name = format!(".nv.info.{name}");
        let text = elf.sections.get(sym.shndx as usize);
        let mut params: Vec<(u16, u32, u32)> = Vec::new(); // (ordinal, offset, size)
        let mut cbank_size: Option<u32> = None;
        let mut max_threads: Option<u32> = None;
        if let Some(info) = elf
            .sections
            .iter()
            .find(|s| s.kind == SHT_CUDA_INFO && s.name == info_name)
        {
            for a in attrs(elf.data(info)?, &info.name)? {
                match a.attr {
                    EIATTR_KPARAM_INFO if a.data.len() >= 12 => {
                        let ordinal = r16(a.data, 4).unwrap_or(0);
                        let offset = r16(a.data, 6).unwrap_or(0) as u32;
                        let size = (r32(a.data, 8).unwrap_or(0) >> 18) & 0x3fff;
                        params.push((ordinal, offset, size));
                    }
                    EIATTR_CBANK_PARAM_SIZE if a.data.len() >= 2 => {
                        cbank_size = Some(r16(a.data, 0).unwrap_or(0) as u32);
                    }
                    EIATTR_MAX_THREADS | EIATTR_REQNTID if a.data.len() >= 12 => {
                        let dims = [0, 1, 2].map(|i| r32(a.data, i * 4).unwrap_or(1));
                        let n = block_threads(dims);
                        max_threads = Some(max_threads.map_or(n, |m| m.min(n)));
                    }
                    _ => {}
                }
            }
        }
        params.sort_by_key(|p| p.0);
        for (i, p) in params.iter().enumerate() {
            if p.0 as usize != i {
                return Err(bad(format!(
                    "kernel {name}: parameter ordinals are not 0..{}",
                    params.len()
                )));
            }
        }
        let mut layout = Vec::with_capacity(params.len());
        let mut end = 0u32;
        for &(ord, offset, size) in &params {
            if offset < end {
                return Err(bad(format!(
                    "kernel {name}: parameter {ord} overlaps the previous one"
                )));
            }
            end = offset + size;
            let align = pow2_divisor(offset as u64, 16).min(pow2_divisor(size as u64, 16)) as u32;
            layout.push(ParamInfo {
                offset,
                size,
                align,
            });
        }
        if let Some(total) = cbank_size {
            if end > total {
                return Err(bad(format!("kernel {name}: parameters end at {end}, beyond the {total}-byte parameter bank")));
            }
        }
        let shared = elf
            .sections
            .iter()
            .find(|s| s.name == format!(".nv.shared.{name}"))
            .map_or(0, |s| s.size);
        let regs = regcount
            .get(&(si as u32))
            .copied()
            .or_else(|| text.map(|t| t.info >> 24).filter(|&r| r != 0));
        kernels.push(KernelInfo {
            name: name.clone(),
            params: layout,
            max_threads_per_block: max_threads,
            shared_static_bytes: shared,
            local_bytes: frame.get(&(si as u32)).copied().unwrap_or(0) as u64,
            num_regs: regs,
            empty_body: false,
        });
    }

    // Relocated bytes in data sections: (section index, offset).
    let mut relocated: Vec<(u32, u64)> = Vec::new();
    for s in elf
        .sections
        .iter()
        .filter(|s| s.kind == SHT_REL || s.kind == SHT_RELA)
    {
        let target = elf.sections.get(s.info as usize);
        if !matches!(target, Some(t) if is_global_section(&t.name).is_some()) {
            continue;
        }
        let step = if s.kind == SHT_RELA { 24 } else { 16 };
        for r in elf.data(s)?.chunks_exact(step) {
            relocated.push((s.info, r64(r, 0).unwrap_or(0)));
        }
    }

    let mut globals = Vec::new();
    for sym in &syms {
        if sym.kind != STT_OBJECT || sym.shndx == 0 || sym.shndx >= 0xff00 {
            continue;
        }
        let Some(sec) = elf.sections.get(sym.shndx as usize) else {
            return Err(bad(format!(
                "symbol {} refers to section {}",
                sym.name, sym.shndx
            )));
        };
        let Some(space) = is_global_section(&sec.name) else {
            continue;
        };
        let end = sym
            .value
            .checked_add(sym.size)
            .filter(|&e| e <= sec.size)
            .ok_or_else(|| {
                bad(format!(
                    "global {} ({} bytes at {}) lies outside {}",
                    sym.name, sym.size, sym.value, sec.name
                ))
            })?;
        if relocated
            .iter()
            .any(|&(s, o)| s as usize == sym.shndx as usize && o >= sym.value && o < end)
        {
            return Err(ImageError::Unsupported(format!(
                "global {} is initialised with an address (relocation in {})",
                sym.name, sec.name
            )));
        }
        let init = if sec.kind == SHT_NOBITS {
            None
        } else {
            let d = elf.data(sec)?;
            let b = &d[sym.value as usize..end as usize];
            if b.iter().all(|&x| x == 0) {
                None
            } else {
                Some(b.to_vec())
            }
        };
        let sec_align = sec.align.clamp(1, 1 << 16);
        let align = pow2_divisor(sym.value, sec_align).min(pow2_divisor(sym.size, sec_align));
        globals.push(GlobalInfo {
            name: sym.name.clone(),
            size: sym.size,
            align: align as u32,
            space,
            init,
            managed: sym.other & STO_CUDA_MANAGED != 0,
        });
    }
    Ok(Cubin {
        arch,
        kernels,
        globals,
    })
}

/// The space of a section holding user variables: `.nv.global`, `.nv.global.init`,
/// `.nv.constant<N>` (not the per-kernel `.nv.constant0.<kernel>`).
fn is_global_section(name: &str) -> Option<GlobalSpace> {
    if name == ".nv.global" || name == ".nv.global.init" {
        return Some(GlobalSpace::Global);
    }
    let bank = name.strip_prefix(".nv.constant")?;
    (!bank.is_empty() && bank.bytes().all(|c| c.is_ascii_digit())).then_some(GlobalSpace::Const)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the `module` fuzz target: a cubin whose REQNTID/MAX_THREADS
    /// attribute holds three huge dimensions overflowed the u64 product
    /// (a panic with overflow checks, a wrapped wrong limit without).
    #[test]
    fn huge_block_dimensions_saturate_instead_of_overflowing() {
        assert_eq!(block_threads([u32::MAX; 3]), u32::MAX);
        // 2^31 * 2^31 * 4 wraps a u64 to exactly 0: a limit of no threads.
        assert_eq!(block_threads([1 << 31, 1 << 31, 4]), u32::MAX);
        assert_eq!(block_threads([0x0010_0000, 0x0010_0000, 0x0010_0000]), u32::MAX);
        assert_eq!(block_threads([128, 0, 2]), 256, "a zero dimension counts as one");
        assert_eq!(block_threads([1024, 1, 1]), 1024);
    }

    #[test]
    fn global_sections() {
        assert_eq!(is_global_section(".nv.global"), Some(GlobalSpace::Global));
        assert_eq!(
            is_global_section(".nv.global.init"),
            Some(GlobalSpace::Global)
        );
        assert_eq!(is_global_section(".nv.constant3"), Some(GlobalSpace::Const));
        assert_eq!(is_global_section(".nv.constant0.k"), None);
        assert_eq!(is_global_section(".nv.constant"), None);
        assert_eq!(is_global_section(".nv.shared.k"), None);
    }

    #[test]
    fn not_elf() {
        assert!(parse_cubin(b"\x7fELF").is_err());
        let mut h = vec![0u8; 64];
        h[..4].copy_from_slice(b"\x7fELF");
        h[4] = 2;
        h[5] = 1;
        assert!(matches!(parse_cubin(&h), Err(ImageError::BadCubin(_))));
    }

    #[test]
    fn pow2() {
        assert_eq!(pow2_divisor(0, 16), 16);
        assert_eq!(pow2_divisor(24, 16), 8);
        assert_eq!(pow2_divisor(92, 16), 4);
        assert_eq!(pow2_divisor(7, 16), 1);
    }
}
