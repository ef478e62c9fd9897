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
pub mod link;
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
    /// The virtual architecture of the chosen PTX (`compute_XY` as XY; from `.target` for bare
    /// PTX text), when known: what `CU_FUNC_ATTRIBUTE_PTX_VERSION` reports.
    pub ptx_arch: Option<u32>,
    /// Set when the image has PTX but all of it is for a newer architecture than the device's
    /// (the lowest such `compute_XY`): a driver never runs it there.
    pub newer_ptx: Option<u32>,
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
    /// Initial bytes (little-endian): the first `init.len()` of `size`, the
    /// rest zero; `None` when all zero.
    pub init: Option<Vec<u8>>,
    /// A `__managed__` variable (PTX `.attribute(.managed)`, a cubin symbol
    /// with `STO_CUDA_MANAGED`): ordinary module storage here, which the client
    /// keeps coherent with a host copy at the same address.
    pub managed: bool,
}

/// Why an image could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("module image is empty")]
    Empty,
    #[error("the image has only PTX for compute_{ptx}, newer than the device (compute capability {}.{})", arch / 10, arch % 10)]
    NoBinaryForGpu { ptx: u32, arch: u32 },
    #[error("no code in the image runs on the device (compute capability {}.{}): SASS for {sass:?}{}", arch / 10, arch % 10, ptx.map(|p| format!(", PTX only for compute_{p}")).unwrap_or_default())]
    NoCompatibleCode { sass: Vec<u32>, ptx: Option<u32>, arch: u32 },
    #[error("the PTX targets sm_{target}, newer than the device (compute capability {}.{})", arch / 10, arch % 10)]
    PtxTargetTooNew { target: u32, arch: u32 },
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
    #[error("{0}")]
    Bundle(#[from] rgpu_protocol::bundle::BundleError),
    #[error("linking: {0}")]
    Link(#[from] link::LinkError),
    #[error("linker input {input} has no PTX for this device (SASS for {sass:?}): rgpu links PTX inputs only")]
    NothingToLink { input: usize, sass: Vec<u32> },
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

/// Describes a module image given as `cuModuleLoadData` would receive it, for any device: the
/// newest PTX is chosen.
pub fn read_image(bytes: &[u8]) -> Result<ModuleImage, ImageError> {
    read_image_for(bytes, u32::MAX)
}

/// Describes a module image for a device of architecture `arch` (compute capability X.Y as
/// XY), choosing as a driver does: the newest PTX not newer than the device. An image whose
/// only code is PTX newer than the device fails with [`ImageError::NoBinaryForGpu`]; one that
/// also has SASS loads with no PTX (and [`ModuleImage::newer_ptx`] says why).
pub fn read_image_for(bytes: &[u8], arch: u32) -> Result<ModuleImage, ImageError> {
    if bytes.is_empty() {
        return Err(ImageError::Empty);
    }
    let magic = bytes
        .get(..4)
        .map(|m| u32::from_le_bytes([m[0], m[1], m[2], m[3]]));
    if magic == Some(FATBIN_MAGIC) {
        return read_fatbin(bytes, arch);
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
            ptx_arch: None,
            newer_ptx: None,
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
    let ptx_arch = m.target.iter().find_map(|t| t.strip_prefix("sm_").and_then(target_arch));
    // What a driver's PTX compiler refuses ("SM version specified by .target is higher").
    if let Some(target) = ptx_arch.filter(|&t| t > arch) {
        return Err(ImageError::PtxTargetTooNew { target, arch });
    }
    Ok(ModuleImage {
        kernels: m.kernels,
        globals: m.globals,
        ptx: Some(text.to_string()),
        sass_archs: Vec::new(),
        ptx_arch,
        newer_ptx: None,
    })
}

/// Links the inputs of a link bundle (what the shim's `cuLinkComplete` returned for several
/// inputs) for a device of architecture `arch`: the PTX each input has for the device (as
/// [`read_image_for`] chooses it), linked into one module. Returns that module's PTX text,
/// NUL-terminated as an image, for the backend to load in place of the bundle.
pub fn link_bundle(bytes: &[u8], arch: u32) -> Result<Vec<u8>, ImageError> {
    let inputs = rgpu_protocol::bundle::decode(bytes)?;
    let mut texts = Vec::with_capacity(inputs.len());
    for (n, input) in inputs.iter().enumerate() {
        let m = read_image_for(input.bytes, arch)?;
        match m.ptx {
            Some(t) => texts.push(t),
            None => return Err(ImageError::NothingToLink { input: n, sass: m.sass_archs }),
        }
    }
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let mut linked = link::link_ptx(&refs)?.into_bytes();
    linked.push(0);
    Ok(linked)
}

/// `90` from `90`, `90a` or `100f` (the architecture-specific suffixes of `.target`).
fn target_arch(t: &str) -> Option<u32> {
    t.trim_end_matches(|c: char| c.is_ascii_alphabetic()).parse().ok()
}

fn read_fatbin(bytes: &[u8], arch: u32) -> Result<ModuleImage, ImageError> {
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
    // PTX newer than the device is never run on it, as a driver never JIT-compiles it there.
    let ptx_entry = entries
        .iter()
        .filter(|e| e.kind == EntryKind::Ptx && e.arch <= arch)
        .fold(None::<&fatbin::FatbinEntry<'_>>, |b, e| match b {
            Some(b) if b.arch >= e.arch => Some(b),
            _ => Some(e),
        });
    let newer_ptx = match ptx_entry {
        Some(_) => None,
        None => entries.iter().filter(|e| e.kind == EntryKind::Ptx).map(|e| e.arch).min(),
    };
    let elf_entry = best(EntryKind::Elf);
    let read_sass = |e: &fatbin::FatbinEntry<'_>| {
        let data = e.data().map_err(|err| entry_err(e, err))?;
        cubin::parse_cubin(&data).map_err(|err| entry_err(e, err))
    };
    let Some(pe) = ptx_entry else {
        // SASS only: the highest-arch cubin describes the module.
        // As a driver does: SASS runs on devices of its major version and a minor not lower.
        let runs_here = |e: &&fatbin::FatbinEntry<'_>| arch == u32::MAX || (e.arch / 10 == arch / 10 && e.arch <= arch);
        if elf_entry.is_some() && !entries.iter().filter(|e| e.kind == EntryKind::Elf).any(|e| runs_here(&e)) {
            return Err(ImageError::NoCompatibleCode { sass: sass_archs, ptx: newer_ptx, arch });
        }
        let c = match (elf_entry, newer_ptx) {
            (Some(e), _) => read_sass(e)?,
            (None, Some(ptx)) => return Err(ImageError::NoBinaryForGpu { ptx, arch }),
            (None, None) => return Err(ImageError::NoEntries),
        };
        return Ok(ModuleImage {
            kernels: c.kernels,
            globals: c.globals,
            ptx: None,
            sass_archs,
            ptx_arch: None,
            newer_ptx,
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
        ptx_arch: Some(pe.arch),
        newer_ptx: None,
    })
}
