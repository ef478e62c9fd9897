//! Modules and their functions: images loaded on one device's server session.
//!
//! The server answers a load with every kernel's parameter layout and every global's address,
//! so getting a function or a global, and launching, needs no further round trip.

use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;

use rgpu_cuda_types::*;
use rgpu_protocol::data_capnp::reply;

use super::memory::Alloc;
use super::objects;
use crate::client::connection::Sink;
use crate::client::ClientError;
use crate::runtime::{cu_err, Runtime};

pub struct Module {
    pub ctx: u64,
    pub device: CUdevice,
    /// Function handles, in the server's order.
    pub functions: Vec<u64>,
    pub by_name: HashMap<String, u64>,
    /// name -> (client address, size)
    pub globals: HashMap<String, (u64, u64)>,
    /// The globals that are `__managed__` variables (`objects::managed::adopt_global`).
    pub managed: std::collections::HashSet<String>,
}

pub struct Function {
    pub module: u64,
    pub device: CUdevice,
    pub index: u32,
    pub name: CString,
    /// (offset, size) of each parameter in the kernelParams layout.
    pub params: Vec<(u32, u32)>,
    pub max_threads_per_block: i32,
    pub shared_size_bytes: i32,
    pub const_size_bytes: i32,
    pub local_size_bytes: i32,
    pub num_regs: i32,
    pub ptx_version: i32,
    pub binary_version: i32,
    pub max_dynamic_shared: AtomicI32,
    pub carveout: AtomicI32,
    pub cache_config: AtomicI32,
    /// Why this kernel cannot run on its server, if it cannot.
    pub launch_note: String,
    pub note_logged: AtomicBool,
}

impl Module {
    /// A global by the C name a program passed: (client address, size).
    ///
    /// # Safety
    /// `name` is null or a NUL-terminated string.
    pub unsafe fn global(&self, name: *const c_char) -> CuResult<(u64, u64)> {
        if name.is_null() {
            return Err(CuError::INVALID_VALUE);
        }
        let name = CStr::from_ptr(name).to_str().map_err(|_| CuError::NOT_FOUND)?;
        self.globals.get(name).copied().ok_or(CuError::NOT_FOUND)
    }

    /// Global `name` as the program may use it from host code too: a `__managed__` variable
    /// is made managed memory first (its host copy mapped and filled), others are as
    /// [`Module::global`] answers.
    ///
    /// # Safety
    /// `name` is null or a NUL-terminated string.
    pub unsafe fn global_for_host(&self, rt: &Runtime, name: *const c_char) -> CuResult<(u64, u64)> {
        let (ptr, size) = self.global(name)?;
        if self.managed.contains(CStr::from_ptr(name).to_str().map_err(|_| CuError::NOT_FOUND)?) {
            super::managed::adopt_global(rt, self.device, ptr, size)?;
        }
        Ok((ptr, size))
    }
}

impl Function {
    /// Where parameter `index` sits in the packed buffer, written to whichever of `offset` and
    /// `size` the caller asked for.
    pub fn param_info(&self, index: usize, offset: Option<&mut usize>, size: Option<&mut usize>) -> CuResult<()> {
        let &(o, s) = self.params.get(index).ok_or(CuError::INVALID_VALUE)?;
        if let Some(p) = offset {
            *p = o as usize;
        }
        if let Some(p) = size {
            *p = s as usize;
        }
        Ok(())
    }

    /// Size of the packed parameter buffer.
    pub fn param_bytes(&self) -> usize {
        self.params.iter().map(|&(o, s)| (o + s) as usize).max().unwrap_or(0)
    }
}

/// Default dynamic shared memory a kernel may use without opting in.
const DEFAULT_DYNAMIC_SHARED: i32 = 48 << 10;

const FATBIN_WRAPPER_MAGIC: u32 = 0x466243B1;
const FATBIN_MAGIC: u32 = 0xBA55ED50;
const ELF_MAGIC: u32 = 0x464C457F;
/// Refuse to believe a header that claims a bigger image than this.
const MAX_IMAGE: u64 = 2 << 30;

/// The bytes of a module image the program handed us by pointer: a fatbin
/// wrapper (followed to its fatbin), a fatbin, an ELF cubin or PTX text.
/// Only the headers say how long an image is.
///
/// # Safety
/// `image` must point at one of those images, readable for the length its
/// header gives (or up to its NUL for PTX), as the driver API requires.
pub unsafe fn image_bytes<'a>(image: *const c_void) -> CuResult<&'a [u8]> {
    if image.is_null() {
        return Err(CuError::INVALID_VALUE);
    }
    let p = image as *const u8;
    // (The first byte first: a PTX string may be shorter than the magic.)
    if *p == b'R' && std::slice::from_raw_parts(p, 8) == rgpu_protocol::bundle::MAGIC {
        // What our cuLinkComplete returned for several inputs; its header gives its length.
        let head: &[u8; 16] = &*(p as *const [u8; 16]);
        let total = rgpu_protocol::bundle::announced_len(head).filter(|&t| t <= MAX_IMAGE).ok_or(CuError::INVALID_IMAGE)?;
        return Ok(std::slice::from_raw_parts(p, total as usize));
    }
    let magic = (p as *const u32).read_unaligned();
    match magic {
        FATBIN_WRAPPER_MAGIC => {
            let fatbin = (p.add(8) as *const *const c_void).read_unaligned();
            let inner = image_bytes(fatbin)?;
            Ok(inner)
        }
        FATBIN_MAGIC => {
            let header = (p.add(4) as *const u16).add(1).read_unaligned() as u64;
            let size = (p.add(8) as *const u64).read_unaligned();
            let total = header.checked_add(size).filter(|&t| t <= MAX_IMAGE).ok_or(CuError::INVALID_IMAGE)?;
            Ok(std::slice::from_raw_parts(p, total as usize))
        }
        ELF_MAGIC => {
            if *p.add(4) != 2 {
                return Err(CuError::INVALID_IMAGE); // not ELF64
            }
            let shoff = (p.add(0x28) as *const u64).read_unaligned();
            let shentsize = (p.add(0x3A) as *const u16).read_unaligned() as u64;
            let shnum = (p.add(0x3C) as *const u16).read_unaligned() as u64;
            let phoff = (p.add(0x20) as *const u64).read_unaligned();
            let phentsize = (p.add(0x36) as *const u16).read_unaligned() as u64;
            let phnum = (p.add(0x38) as *const u16).read_unaligned() as u64;
            // Saturating: header fields that wrap must not make a short image of a long one.
            let end = shoff.saturating_add(shentsize * shnum).max(phoff.saturating_add(phentsize * phnum)).max(64);
            if end > MAX_IMAGE {
                return Err(CuError::INVALID_IMAGE);
            }
            Ok(std::slice::from_raw_parts(p, end as usize))
        }
        _ => {
            // PTX text.
            let s = CStr::from_ptr(p as *const c_char).to_bytes();
            if s.is_empty() {
                return Err(CuError::INVALID_IMAGE);
            }
            Ok(s)
        }
    }
}

/// Loads an image on `dev` for context `ctx`; returns the module handle.
pub fn load_image(rt: &Runtime, dev: CUdevice, ctx: u64, image: &[u8]) -> CuResult<u64> {
    let h = objects().modules.mint();
    let remote_dev = rt.device(dev)?.remote.ordinal;
    let loaded = rt
        .conn(dev)?
        .call(
            |r| {
                let mut m = r.init_module_load();
                m.set_handle(h);
                m.set_device(remote_dev);
            },
            image,
            Sink::None,
            |reply| match reply.which() {
                Ok(reply::ModuleLoad(Ok(m))) => decode_loaded(m).map_err(|e| ClientError::Protocol {
                    addr: String::new(),
                    reason: e.to_string(),
                }),
                _ => Err(ClientError::Cuda(CuError::UNKNOWN.0.get())),
            },
        )
        .map_err(cu_err)?;
    let (funcs, globals, launch_note) = loaded;
    let mut module = Module {
        ctx,
        device: dev,
        functions: Vec::with_capacity(funcs.len()),
        by_name: HashMap::new(),
        globals: HashMap::new(),
        managed: Default::default(),
    };
    if !launch_note.is_empty() {
        tracing::debug!("module {h:#x} on device {dev}: {launch_note}");
    }
    for (i, f) in funcs.into_iter().enumerate() {
        let name = f.name.clone();
        let (fh, _) = objects().functions.insert(Function {
            module: h,
            device: dev,
            index: i as u32,
            name: CString::new(f.name).unwrap_or_default(),
            params: f.params,
            max_threads_per_block: f.attrs[0],
            shared_size_bytes: f.attrs[1],
            const_size_bytes: f.attrs[2],
            local_size_bytes: f.attrs[3],
            num_regs: f.attrs[4],
            ptx_version: f.attrs[5],
            binary_version: f.attrs[6],
            max_dynamic_shared: AtomicI32::new(DEFAULT_DYNAMIC_SHARED - f.attrs[1]),
            carveout: AtomicI32::new(-1),
            cache_config: AtomicI32::new(0),
            launch_note: f.launch_note,
            note_logged: AtomicBool::new(false),
        });
        module.functions.push(fh);
        module.by_name.insert(name, fh);
    }
    for (name, remote, size, managed) in globals {
        let ptr = rt.to_client(dev, remote);
        objects().memory.record(ptr, Alloc { size, device: dev, ctx: 0, pool: 0, mapped: false, ipc: 0 });
        if managed {
            module.managed.insert(name.clone());
        }
        module.globals.insert(name, (ptr, size));
    }
    // Insert under the handle the server already knows.
    objects().modules.insert_with_handle(h, module);
    Ok(h)
}

struct LoadedFunction {
    name: String,
    params: Vec<(u32, u32)>,
    attrs: [i32; 7],
    launch_note: String,
}

type Loaded = (Vec<LoadedFunction>, Vec<(String, u64, u64, bool)>, String);

fn decode_loaded(m: rgpu_protocol::data_capnp::module_loaded::Reader<'_>) -> capnp::Result<Loaded> {
    let mut funcs = Vec::new();
    for f in m.get_functions()?.iter() {
        let params = f.get_params()?.iter().map(|p| (p.get_offset(), p.get_size())).collect();
        funcs.push(LoadedFunction {
            name: f.get_name()?.to_string()?,
            params,
            attrs: [
                f.get_max_threads_per_block(),
                f.get_shared_size_bytes(),
                f.get_const_size_bytes(),
                f.get_local_size_bytes(),
                f.get_num_regs(),
                f.get_ptx_version(),
                f.get_binary_version(),
            ],
            launch_note: f.get_launch_note()?.to_string()?,
        });
    }
    let mut globals = Vec::new();
    for g in m.get_globals()?.iter() {
        globals.push((g.get_name()?.to_string()?, g.get_ptr(), g.get_size(), g.get_managed()));
    }
    Ok((funcs, globals, m.get_launch_note()?.to_string()?))
}

/// Unloads module `h` on its server and forgets its functions and globals.
pub fn unload(rt: &Runtime, h: u64) -> CuResult<()> {
    let o = objects();
    let m = o.modules.remove(h).ok_or(CuError::INVALID_HANDLE)?;
    for f in &m.functions {
        o.functions.remove(*f);
    }
    {
        let mut allocs = o.memory.allocs.lock().unwrap_or_else(|e| e.into_inner());
        for (ptr, _) in m.globals.values() {
            allocs.remove(ptr);
        }
    }
    for (ptr, _) in m.globals.values() {
        super::managed::release_global(*ptr);
    }
    rt.conn(m.device)?.post(|r| r.init_module_unload().set_handle(h), &[]).map_err(cu_err)
}

pub fn get(h: CUmodule) -> CuResult<Arc<Module>> {
    objects().modules.get(h as usize as u64).ok_or(CuError::INVALID_HANDLE)
}

/// A function handle (not a kernel's; see `library::resolve_function` for both).
pub fn function(f: CUfunction) -> CuResult<Arc<Function>> {
    objects().functions.get(f as usize as u64).ok_or(CuError::INVALID_HANDLE)
}

type A = CUfunction_attribute;

impl Function {
    /// A `CUfunction_attribute`'s value, from what the server said at load time.
    pub fn attribute(&self, attrib: CUfunction_attribute) -> CuResult<i32> {
        Ok(match attrib {
            A::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK => self.max_threads_per_block,
            A::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES => self.shared_size_bytes,
            A::CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES => self.const_size_bytes,
            A::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES => self.local_size_bytes,
            A::CU_FUNC_ATTRIBUTE_NUM_REGS => self.num_regs,
            A::CU_FUNC_ATTRIBUTE_PTX_VERSION => self.ptx_version,
            A::CU_FUNC_ATTRIBUTE_BINARY_VERSION => self.binary_version,
            A::CU_FUNC_ATTRIBUTE_CACHE_MODE_CA => 0,
            A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES => self.max_dynamic_shared.load(Ordering::Relaxed),
            A::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT => self.carveout.load(Ordering::Relaxed),
            A::CU_FUNC_ATTRIBUTE_CLUSTER_SIZE_MUST_BE_SET => 0,
            A::CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH
            | A::CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT
            | A::CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH => 0,
            A::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED => 0,
            A::CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE => 0,
            _ => return Err(CuError::INVALID_VALUE),
        })
    }

    /// Sets one of the attributes a program may set; `optin` gives the device's opt-in limit of
    /// shared memory per block.
    pub fn set_attribute(&self, attrib: CUfunction_attribute, value: i32, optin: impl FnOnce() -> CuResult<i32>) -> CuResult<()> {
        match attrib {
            A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES => {
                if value < 0 || value + self.shared_size_bytes > optin()? {
                    return Err(CuError::INVALID_VALUE);
                }
                self.max_dynamic_shared.store(value, Ordering::Relaxed);
            }
            A::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT => {
                if !(-1..=100).contains(&value) {
                    return Err(CuError::INVALID_VALUE);
                }
                self.carveout.store(value, Ordering::Relaxed);
            }
            _ => return Err(CuError::INVALID_VALUE),
        }
        Ok(())
    }
}

/// Logs once per kernel why it cannot run, and fails the launch.
pub fn check_launchable(f: &Function) -> CuResult<()> {
    if f.launch_note.is_empty() {
        return Ok(());
    }
    if !f.note_logged.swap(true, Ordering::Relaxed) {
        let msg = format!("launch of {} refused: {}", f.name.to_string_lossy(), f.launch_note);
        tracing::warn!("{msg}");
        objects().logs.deliver(CUlogLevel::CU_LOG_LEVEL_ERROR, &format!("rgpu: {msg}"));
    }
    Err(CuError::NOT_SUPPORTED)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elf_headers_whose_table_offsets_wrap_are_invalid_images() {
        let mut elf = [0u8; 64];
        elf[..4].copy_from_slice(&ELF_MAGIC.to_le_bytes());
        elf[4] = 2; // ELF64
        elf[0x28..0x30].copy_from_slice(&(u64::MAX - 10).to_le_bytes()); // section headers' offset
        elf[0x3A..0x3C].copy_from_slice(&64u16.to_le_bytes());
        elf[0x3C..0x3E].copy_from_slice(&1u16.to_le_bytes());
        // SAFETY: a 64-byte buffer; the header claims more, which must be refused before reading.
        let r = unsafe { image_bytes(elf.as_ptr() as *const c_void) };
        assert_eq!(r.err(), Some(CuError::INVALID_IMAGE));
        // The same header with its tables inside the 64 bytes is 64 bytes long.
        elf[0x28..0x30].copy_from_slice(&0u64.to_le_bytes());
        elf[0x3C..0x3E].copy_from_slice(&0u16.to_le_bytes());
        let r = unsafe { image_bytes(elf.as_ptr() as *const c_void) };
        assert_eq!(r.map(|b| b.len()), Ok(64));
    }
}
