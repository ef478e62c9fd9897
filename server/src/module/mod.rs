//! Reading CUDA module images: what a client passed to `cuModuleLoadData`/`cuLibraryLoadData`.
//!
//! An image is a fatbin container (magic 0xBA55ED50), a bare ELF cubin, or NUL-terminated PTX
//! text. [`read_image`] describes it: its kernels with their parameter layout (the offsets a
//! driver uses in the `kernelParams` buffer), its `__device__`/`__constant__` variables with
//! their initial bytes, the PTX to execute (if any) and the SASS architectures it carries.
//!
//! Sources of truth, in order: the PTX of the highest `compute_XY` entry (kernels, parameters,
//! globals), with register counts from the highest-arch SASS entry when that has the kernel
//! (and reads; its errors are then ignored);
//! without PTX, the highest-arch SASS entry alone (`ptx: None`; the sim cannot execute such a
//! module, but it loads and its kernels and globals can be looked up).

pub mod cubin;
pub mod fatbin;
pub mod ptx;

use fatbin::{EntryKind, FATBIN_MAGIC, FATBIN_WRAPPER_MAGIC};

/// A module image, described.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModuleImage {
    pub kernels: Vec<KernelInfo>,
    pub globals: Vec<GlobalInfo>,
    /// The chosen PTX text, if any (without its terminating NUL).
    pub ptx: Option<String>,
    /// SASS architectures present (`sm_XY` as XY), ascending, without repeats.
    pub sass_archs: Vec<u32>,
}

/// One kernel (`.entry`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelInfo {
    /// The mangled name, as `cuModuleGetFunction` takes it.
    pub name: String,
    /// Parameters in order, laid out as in the `kernelParams` buffer.
    pub params: Vec<ParamInfo>,
    /// From `.maxntid`/`.reqntid` (product of the dimensions; the smaller if both).
    pub max_threads_per_block: Option<u32>,
    /// Static `.shared` bytes declared in the kernel.
    pub shared_static_bytes: u64,
    /// Static `.local` bytes (PTX declarations; the stack frame size from a cubin).
    pub local_bytes: u64,
    /// Registers per thread, known only from SASS.
    pub num_regs: Option<u32>,
    /// The PTX body only returns: running it changes nothing, so even a
    /// backend that cannot execute code can honour a launch. False when
    /// unknown (SASS only).
    pub empty_body: bool,
}

impl KernelInfo {
    /// Bytes of the parameter buffer: the end of the last parameter.
    pub fn params_size(&self) -> u32 {
        self.params.last().map_or(0, |p| p.offset + p.size)
    }
}

/// Where one parameter sits in the parameter buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamInfo {
    pub offset: u32,
    pub size: u32,
    pub align: u32,
}

/// Memory space of a module-scope variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GlobalSpace {
    /// `__device__` (`.global`).
    Global,
    /// `__constant__` (`.const`).
    Const,
}

/// One module-scope variable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlobalInfo {
    pub name: String,
    pub size: u64,
    pub align: u32,
    pub space: GlobalSpace,
    /// Initial bytes (little-endian, `size` of them); `None` when all zero.
    pub init: Option<Vec<u8>>,
}

/// Why an image could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("module image is empty")]
    Empty,
    #[error("truncated {what} at offset {offset}: needs {need} bytes, {have} left")]
    Truncated {
        what: &'static str,
        offset: u64,
        need: u64,
        have: u64,
    },
    #[error("bad fatbin magic {found:#010x} (expected 0xba55ed50)")]
    BadMagic { found: u32 },
    #[error(
        "unrecognised module image (starts {head:02x?}): expected a fatbin, an ELF cubin or PTX text"
    )]
    UnknownFormat { head: Vec<u8> },
    #[error(
        "got a fatbin wrapper (magic 0x466243b1); the client must send the fatbin it points to"
    )]
    FatbinWrapper,
    #[error("bad fatbin: {0}")]
    BadFatbin(String),
    #[error("fatbin entry {index}: unsupported compression (flags {flags:#x})")]
    UnsupportedCompression { index: usize, flags: u64 },
    #[error("fatbin entry {index}: {method} payload does not decompress: {reason}")]
    Decompress {
        index: usize,
        method: &'static str,
        reason: String,
    },
    #[error("fatbin entry {index}: uncompressed size {size} exceeds the limit of {limit} bytes")]
    TooLarge { index: usize, size: u64, limit: u64 },
    #[error("fatbin has no PTX or ELF entry")]
    NoEntries,
    #[error("fatbin entry {index} ({kind}): {source}")]
    Entry {
        index: usize,
        kind: String,
        #[source]
        source: Box<ImageError>,
    },
    #[error("bad cubin: {0}")]
    BadCubin(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("PTX is not valid UTF-8 (byte {offset})")]
    PtxNotUtf8 { offset: usize },
    #[error("PTX line {line}: {msg}")]
    Ptx { line: u32, msg: String },
    #[error("PTX line {line}: unsupported: {msg}")]
    PtxUnsupported { line: u32, msg: String },
}

fn entry_err(e: &fatbin::FatbinEntry<'_>, source: ImageError) -> ImageError {
    let kind = match e.kind {
        EntryKind::Ptx => format!("PTX compute_{}", e.arch),
        EntryKind::Elf => format!("ELF sm_{}", e.arch),
        EntryKind::Other(k) => format!("kind {k}"),
    };
    ImageError::Entry {
        index: e.index,
        kind,
        source: Box::new(source),
    }
}

/// Describes a module image given as `cuModuleLoadData` would receive it.
pub fn read_image(bytes: &[u8]) -> Result<ModuleImage, ImageError> {
    if bytes.is_empty() {
        return Err(ImageError::Empty);
    }
    let magic = bytes
        .get(..4)
        .map(|m| u32::from_le_bytes([m[0], m[1], m[2], m[3]]));
    if magic == Some(FATBIN_MAGIC) {
        return read_fatbin(bytes);
    }
    if magic == Some(FATBIN_WRAPPER_MAGIC) {
        return Err(ImageError::FatbinWrapper);
    }
    if bytes.starts_with(b"\x7fELF") {
        let c = cubin::parse_cubin(bytes)?;
        return Ok(ModuleImage {
            kernels: c.kernels,
            globals: c.globals,
            ptx: None,
            sass_archs: vec![c.arch],
        });
    }
    // PTX text: printable start (whitespace, a directive or a comment).
    let first = bytes.iter().copied().find(|b| !b.is_ascii_whitespace());
    if !matches!(first, Some(b'.') | Some(b'/')) {
        return Err(ImageError::UnknownFormat {
            head: bytes[..bytes.len().min(8)].to_vec(),
        });
    }
    let text = fatbin::ptx_text(bytes)?;
    let m = ptx::parse_ptx(text)?;
    Ok(ModuleImage {
        kernels: m.kernels,
        globals: m.globals,
        ptx: Some(text.to_string()),
        sass_archs: Vec::new(),
    })
}

fn read_fatbin(bytes: &[u8]) -> Result<ModuleImage, ImageError> {
    let entries = fatbin::parse_fatbin(bytes)?;
    let mut sass_archs: Vec<u32> = entries
        .iter()
        .filter(|e| e.kind == EntryKind::Elf)
        .map(|e| e.arch)
        .collect();
    sass_archs.sort_unstable();
    sass_archs.dedup();
    // Highest arch wins; among equals, the first.
    let best = |kind: EntryKind| {
        entries
            .iter()
            .filter(|e| e.kind == kind)
            .fold(None::<&fatbin::FatbinEntry<'_>>, |b, e| match b {
                Some(b) if b.arch >= e.arch => Some(b),
                _ => Some(e),
            })
    };
    let ptx_entry = best(EntryKind::Ptx);
    let elf_entry = best(EntryKind::Elf);
    let read_sass = |e: &fatbin::FatbinEntry<'_>| {
        let data = e.data().map_err(|err| entry_err(e, err))?;
        cubin::parse_cubin(&data).map_err(|err| entry_err(e, err))
    };
    let Some(pe) = ptx_entry else {
        // SASS only: the highest-arch cubin describes the module.
        let c = match elf_entry {
            Some(e) => read_sass(e)?,
            None => return Err(ImageError::NoEntries),
        };
        return Ok(ModuleImage {
            kernels: c.kernels,
            globals: c.globals,
            ptx: None,
            sass_archs,
        });
    };
    let data = pe.data().map_err(|err| entry_err(pe, err))?;
    let text = fatbin::ptx_text(&data).map_err(|err| entry_err(pe, err))?;
    let mut m = ptx::parse_ptx(text).map_err(|err| entry_err(pe, err))?;
    // With PTX, the SASS only contributes register counts; a cubin this reader cannot describe
    // fully (e.g. one with address-initialised globals) leaves them unknown.
    if let Some(Ok(c)) = elf_entry.map(read_sass) {
        for k in &mut m.kernels {
            if let Some(ck) = c.kernels.iter().find(|ck| ck.name == k.name) {
                k.num_regs = ck.num_regs;
            }
        }
    }
    Ok(ModuleImage {
        kernels: m.kernels,
        globals: m.globals,
        ptx: Some(text.to_string()),
        sass_archs,
    })
}
