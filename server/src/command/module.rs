//! Module commands: `moduleLoad` (the image is the bulk; its reply lists the
//! module's functions and globals) and `moduleUnload`.

use rgpu_protocol::data_capnp::{handle, module_load, reply};
use tracing::warn;

use super::{Bulk, BulkHandler, EncodeReply, Fail, Handler};
use crate::backend::LoadedModule;
use crate::state::{Alloc, Module, Owner, SessionState};
use rgpu_cuda_types::CuError;

/// Bytes of image read at a time: the buffer grows with what arrived.
const READ_STEP: usize = 1 << 20;

#[derive(Debug)]
pub struct ModuleLoad {
    pub handle: u64,
    pub device: u32,
}

impl ModuleLoad {
    pub fn decode(r: module_load::Reader<'_>) -> Self {
        ModuleLoad { handle: r.get_handle(), device: r.get_device() }
    }
}

impl BulkHandler for ModuleLoad {
    type Reply = LoadedModule;
    fn apply(self, s: &mut SessionState, bulk: &mut Bulk<'_>) -> Result<LoadedModule, Fail> {
        if self.handle == 0 || s.modules.contains_key(&self.handle) {
            return Err(CuError::INVALID_VALUE.into());
        }
        s.check_device(self.device)?;
        let len = bulk.remaining();
        // Refused images are skipped (the session discards the rest of the
        // bulk), never buffered: one past the per-image limit, one the
        // lease's loaded modules leave no room for, one the server's input
        // budget has no room for now.
        let limit = s.input.max_module_image;
        if len > limit {
            warn!(len, limit, "module image refused: larger than --max-module-image");
            return Err(CuError::OUT_OF_MEMORY.into());
        }
        let Some(held) = s.input.modules.charge(len) else {
            let (used, limit) = (s.input.modules.used(), s.input.modules.limit());
            warn!(len, used, limit, "module image refused: the lease's loaded modules would pass --max-module-bytes-per-lease");
            return Err(CuError::OUT_OF_MEMORY.into());
        };
        // The image's bytes are charged to the server's input budget as they
        // arrive: a header announcing a large image holds nothing.
        let mut buffered = s.input.buffered.charge(0).ok_or(CuError::OUT_OF_MEMORY)?;
        let mut image: Vec<u8> = Vec::new();
        while bulk.remaining() > 0 {
            let at = image.len();
            let n = (bulk.remaining() as usize).min(READ_STEP);
            if !buffered.grow(n as u64) {
                warn!(len, read = at, "module image refused: the server's input budget (--max-buffered-input) is in use");
                return Err(CuError::OUT_OF_MEMORY.into());
            }
            if image.capacity() < at + n {
                // Doubling, but never past the announced length.
                let want = (image.capacity() * 2).max(at + n).min(len as usize);
                image.reserve_exact(want - at);
            }
            image.resize(at + n, 0);
            bulk.read_exact(&mut image[at..])?;
        }
        // Compressed fatbin entries are inflated while the image is read:
        // those bytes are buffered input too.
        let unpacked = crate::module::fatbin::parse_fatbin(&image)
            .map_or(0, |es| es.iter().fold(0u64, |n, e| n.saturating_add(e.unpacked_len())));
        if unpacked > 0 && !buffered.grow(unpacked) {
            warn!(len, unpacked, "module image refused: its compressed entries do not fit the server's input budget");
            return Err(CuError::OUT_OF_MEMORY.into());
        }
        let arch = s.backend.module_arch(self.device);
        // Several linker inputs: link them here, where the device and backend are known.
        let image = if image.starts_with(rgpu_protocol::bundle::MAGIC) {
            match crate::module::link_bundle(&image, arch) {
                Ok(linked) => linked,
                Err(e @ crate::module::ImageError::NothingToLink { .. }) => {
                    warn!(module = self.handle, len, "linked module refused: {e}");
                    return Err(CuError::NOT_SUPPORTED.into());
                }
                Err(e) => {
                    warn!(module = self.handle, len, "linked module refused: {e}");
                    return Err(CuError::INVALID_IMAGE.into());
                }
            }
        } else {
            image
        };
        install(s, self.handle, self.device, image, held, None)
    }
}

/// Loads `image` (linked already) as module `handle` on `device`, its bytes
/// held by `held`; with `place`, its globals go at those addresses (a
/// restored session's: [`crate::checkpoint`]).
pub(crate) fn install(
    s: &mut SessionState,
    handle: u64,
    device: u32,
    image: Vec<u8>,
    held: crate::quota::Charge,
    place: Option<&[u64]>,
) -> Result<LoadedModule, Fail> {
    let len = image.len();
    let arch = s.backend.module_arch(device);
    let parsed = match crate::module::read_image_for(&image, arch) {
        Ok(p) => p,
        Err(e @ (crate::module::ImageError::NoBinaryForGpu { .. } | crate::module::ImageError::NoCompatibleCode { .. })) => {
            warn!(module = handle, len, "module image refused: {e}");
            return Err(CuError::NO_BINARY_FOR_GPU.into());
        }
        Err(e @ crate::module::ImageError::PtxTargetTooNew { .. }) => {
            warn!(module = handle, len, "module image refused: {e}");
            return Err(CuError::INVALID_PTX.into());
        }
        Err(e) => {
            warn!(module = handle, len, "module image refused: {e}");
            return Err(CuError::INVALID_IMAGE.into());
        }
    };
    let (token, loaded) = match place {
        Some(at) => s.backend.module_load_at(device, &image, &parsed, at)?,
        None => s.backend.module_load(device, &image, &parsed)?,
    };
    // What the backend keeps for the module (the sim's decoded kernels,
    // which inlining can make far larger than the image) counts too.
    let mut held = held;
    let kept = s.backend.module_host_bytes(token);
    if !held.grow(kept) {
        warn!(len, kept, "module refused: its decoded kernels would pass --max-module-bytes-per-lease");
        let _ = s.backend.module_unload(token);
        return Err(CuError::OUT_OF_MEMORY.into());
    }
    for g in &loaded.globals {
        s.allocs.insert(
            g.ptr,
            Alloc { device, size: g.size, owner: Owner::Module(handle) },
        );
    }
    s.modules.insert(
        handle,
        Module {
            token,
            device,
            param_lens: loaded.functions.iter().map(|f| f.param_buffer_len()).collect(),
            needs: loaded
                .functions
                .iter()
                .map(|f| crate::backend::launch_limits::KernelNeeds {
                    max_threads_per_block: u32::try_from(f.max_threads_per_block).unwrap_or(0),
                    static_shared: u32::try_from(f.shared_size_bytes).unwrap_or(u32::MAX),
                })
                .collect(),
            globals: loaded.globals.iter().map(|g| g.ptr).collect(),
            image: Some(std::sync::Arc::new(held)),
            source: std::sync::Arc::new(image),
        },
    );
    Ok(loaded)
}

#[derive(Debug)]
pub struct ModuleUnload {
    pub handle: u64,
}

impl ModuleUnload {
    pub fn decode(r: handle::Reader<'_>) -> Self {
        ModuleUnload { handle: r.get_handle() }
    }
}

impl Handler for ModuleUnload {
    type Reply = ();
    fn apply(self, s: &mut SessionState) -> Result<(), Fail> {
        let m = s.module(self.handle)?;
        let token = m.token;
        s.backend.module_unload(token)?;
        if let Some(m) = s.modules.remove(&self.handle) {
            for p in m.globals {
                s.allocs.remove(&p);
            }
        }
        Ok(())
    }
}

/// `ModuleLoaded`: what the client needs to launch the module's kernels
/// and find its globals without asking again.
impl EncodeReply for LoadedModule {
    fn encode(&self, r: reply::Builder<'_>) {
        let m = self;
        let mut b = r.init_module_load();
        let mut fs = b.reborrow().init_functions(m.functions.len() as u32);
        for (i, f) in m.functions.iter().enumerate() {
            let mut fb = fs.reborrow().get(i as u32);
            fb.set_name(&f.name);
            let mut ps = fb.reborrow().init_params(f.params.len() as u32);
            for (j, &(offset, size)) in f.params.iter().enumerate() {
                let mut p = ps.reborrow().get(j as u32);
                p.set_offset(offset);
                p.set_size(size);
            }
            fb.set_max_threads_per_block(f.max_threads_per_block);
            fb.set_shared_size_bytes(f.shared_size_bytes);
            fb.set_const_size_bytes(f.const_size_bytes);
            fb.set_local_size_bytes(f.local_size_bytes);
            fb.set_num_regs(f.num_regs);
            fb.set_ptx_version(f.ptx_version);
            fb.set_binary_version(f.binary_version);
            fb.set_launch_note(&f.launch_note);
        }
        let mut gs = b.reborrow().init_globals(m.globals.len() as u32);
        for (i, g) in m.globals.iter().enumerate() {
            let mut gb = gs.reborrow().get(i as u32);
            gb.set_name(&g.name);
            gb.set_ptr(g.ptr);
            gb.set_size(g.size);
            gb.set_managed(g.managed);
        }
        b.set_launch_note(&m.launch_note);
    }
}
