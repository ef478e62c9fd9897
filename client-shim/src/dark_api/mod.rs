//! The export tables ("dark API") NVIDIA's runtime asks for with
//! cuGetExportTable: undocumented interfaces identified by UUID, each a
//! static array of function pointers. What each must do was measured
//! against libcudart 12.9 and 13.5 (see shared/notes/cuda-driver-contract.md);
//! tables are declared here by UUID and slot.

pub mod cls;
mod integrity;

use std::ffi::c_void;

use crate::cuda::types::*;
use crate::runtime;

/// A table of pointers that can live in a `static`.
#[repr(transparent)]
pub struct Table<const N: usize>(pub [*const c_void; N]);
// SAFETY: the tables are immutable arrays of function pointers and sizes.
unsafe impl<const N: usize> Sync for Table<N> {}

const fn size_of_table(slots: usize) -> *const c_void {
    (slots * std::mem::size_of::<*const c_void>()) as *const c_void
}

macro_rules! slot {
    ($f:expr) => {
        $f as *const c_void
    };
}

/// Runs the body of an export-table function that returns nothing. As in
/// the generated entry points (`entry::call`), no panic unwinds into the C
/// caller: it is logged and the function returns.
fn guarded(name: &'static str, f: impl FnOnce()) {
    let _ = crate::entry::call(name, &[], || {
        f();
        Ok(())
    });
}

/// Slots nobody was seen calling: an honest refusal if ever called.
extern "C" fn not_supported() -> CUresult {
    // Logging can panic at process exit (its thread-locals are gone).
    let r = crate::entry::call("export table slot", &[], || {
        tracing::warn!("an unimplemented export-table slot was called; returning CUDA_ERROR_NOT_SUPPORTED");
        Err(CuError::NOT_SUPPORTED)
    });
    // The answer is NOT_SUPPORTED whether or not the line could be logged.
    if r == CUresult::CUDA_ERROR_UNKNOWN {
        return CuError::NOT_SUPPORTED.into();
    }
    r
}

extern "C" fn success() -> CUresult {
    CUresult::CUDA_SUCCESS
}

// ---- CUDART_INTERFACE {6bd5fb6c-5bf4-e74a-8987-d93912fd9df9} -------------

unsafe extern "C" fn cudart_primary_context(out: *mut CUcontext, dev: CUdevice) -> CUresult {
    crate::entry::call("CUDART_INTERFACE[2]", &[], || {
        let out = out.as_mut().ok_or(CuError::INVALID_VALUE)?;
        *out = crate::objects::context::from_handle(crate::objects::objects().primaries.handle(dev)?);
        Ok(())
    })
}

extern "C" fn cudart_noop(_: usize) {}

static CUDART_INTERFACE: Table<13> = Table([
    size_of_table(13),
    slot!(not_supported),
    slot!(cudart_primary_context),
    slot!(not_supported),
    slot!(not_supported),
    slot!(not_supported),
    slot!(not_supported),
    slot!(cudart_noop),
    slot!(not_supported),
    slot!(not_supported),
    slot!(not_supported),
    slot!(not_supported),
    slot!(success),
]);

// ---- TOOLS_RUNTIME_CALLBACK_HOOKS {a094798c-2e74-2e74-93f2-0800200c0a66} --

/// cudart keeps tool-callback state in buffers the driver owns. Measured:
/// cudart 13 wants the first to be at least 768 bytes, but also reads flags
/// far past what it is told (offset 0x6e0 in cudaGetDeviceProperties), so
/// both buffers are much larger than the size reported, and all zero.
struct HookBuffer<const N: usize>(std::cell::UnsafeCell<[u8; N]>);
// SAFETY: the buffers are handed to cudart, which owns their contents.
unsafe impl<const N: usize> Sync for HookBuffer<N> {}
static HOOK_BUFFER_1: HookBuffer<16384> = HookBuffer(std::cell::UnsafeCell::new([0; 16384]));
static HOOK_BUFFER_2: HookBuffer<4096> = HookBuffer(std::cell::UnsafeCell::new([0; 4096]));

unsafe extern "C" fn hook_buffer_1(buf: *mut *mut c_void, n: *mut usize) {
    guarded("TOOLS_RUNTIME_CALLBACK_HOOKS[2]", || {
        if let (Some(b), Some(n)) = (buf.as_mut(), n.as_mut()) {
            *b = HOOK_BUFFER_1.0.get() as *mut c_void;
            *n = 1024;
        }
    })
}

unsafe extern "C" fn hook_buffer_2(buf: *mut *mut c_void, n: *mut usize) {
    guarded("TOOLS_RUNTIME_CALLBACK_HOOKS[6]", || {
        if let (Some(b), Some(n)) = (buf.as_mut(), n.as_mut()) {
            *b = HOOK_BUFFER_2.0.get() as *mut c_void;
            *n = 64;
        }
    })
}

static TOOLS_RUNTIME_CALLBACK_HOOKS: Table<7> = Table([
    size_of_table(7),
    slot!(success),
    slot!(hook_buffer_1),
    slot!(success),
    slot!(success),
    slot!(success),
    slot!(hook_buffer_2),
]);

// ---- TOOLS_TLS {42d85a81-23f6-cb47-8298-f6e78a3aecdc} ---------------------
static TOOLS_TLS: Table<4> = Table([size_of_table(4), slot!(success), slot!(success), slot!(success)]);

// ---- tools context {21318c60-9714-3248-8ca6-41ff7324c8f2}: must exist ----
// Its size word says it has no functions (cudart reads that), but cuBLASLt calls its fifth
// word without looking (`cublasLtSSSMatmulAlgoGetHeuristicForStream`), and jumped into
// whatever followed the table (a CuPy `dot` on the sim crashed the process, now and then):
// the words behind the size are refusals, which cuBLASLt checks and turns into its error.
static TOOLS_CONTEXT: Table<17> = Table([
    size_of_table(0),
    slot!(not_supported),
    slot!(not_supported),
    slot!(not_supported),
    slot!(not_supported),
    slot!(not_supported),
    slot!(not_supported),
    slot!(not_supported),
    slot!(not_supported),
    slot!(not_supported),
    slot!(not_supported),
    slot!(not_supported),
    slot!(not_supported),
    slot!(not_supported),
    slot!(not_supported),
    slot!(not_supported),
    slot!(not_supported),
]);

// ---- CONTEXT_LOCAL_STORAGE {c693336e-1121-df11-a8c3-68f355d89593} --------
static CONTEXT_LOCAL_STORAGE: Table<3> = Table([slot!(cls::put), slot!(cls::delete), slot!(cls::get)]);

// ---- CONTEXT_CHECKS {263e8860-7cd2-6614-b9d0-b3f0a4e2d0ce} ---------------

unsafe extern "C" fn context_check(_ctx: CUcontext, r1: *mut u32, _r2: *mut *mut c_void) -> CUresult {
    crate::entry::call("CONTEXT_CHECKS[2]", &[], || {
        if let Some(r1) = r1.as_mut() {
            *r1 = 0;
        }
        Ok(())
    })
}

static CONTEXT_CHECKS: Table<4> = Table([size_of_table(4), slot!(success), slot!(context_check), slot!(success)]);

// ---- INTEGRITY_CHECK {d4082055-bde6-704b-8d34-ba123c66e1f2} --------------
static INTEGRITY_CHECK: Table<3> = Table([size_of_table(3), slot!(integrity::check), slot!(not_supported)]);

const CUDART_INTERFACE_ID: [u8; 16] = hex("6bd5fb6c5bf4e74a8987d93912fd9df9");
const TOOLS_RUNTIME_CALLBACK_HOOKS_ID: [u8; 16] = hex("a094798c2e742e7493f20800200c0a66");
const TOOLS_TLS_ID: [u8; 16] = hex("42d85a8123f6cb478298f6e78a3aecdc");
const TOOLS_CONTEXT_ID: [u8; 16] = hex("21318c60971432488ca641ff7324c8f2");
const CONTEXT_LOCAL_STORAGE_ID: [u8; 16] = hex("c693336e1121df11a8c368f355d89593");
const CONTEXT_CHECKS_ID: [u8; 16] = hex("263e88607cd2614392f6bbd5006dfa7e");
const INTEGRITY_CHECK_ID: [u8; 16] = hex("d4082055bde6704b8d34ba123c66e1f2");

const fn hex(s: &str) -> [u8; 16] {
    let b = s.as_bytes();
    let mut out = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        out[i] = nibble(b[2 * i]) << 4 | nibble(b[2 * i + 1]);
        i += 1;
    }
    out
}

const fn nibble(c: u8) -> u8 {
    match c {
        b'0'..=b'9' => c - b'0',
        b'a'..=b'f' => c - b'a' + 10,
        _ => panic!("not a hex digit"),
    }
}

pub(crate) fn cudart_interface_ptr() -> *const c_void {
    CUDART_INTERFACE.0.as_ptr() as *const c_void
}

pub(crate) fn integrity_table_ptr() -> *const c_void {
    INTEGRITY_CHECK.0.as_ptr() as *const c_void
}

pub(crate) unsafe fn get_export_table(table: *mut *const c_void, id: *const CUuuid) -> CuResult<()> {
    let (table, id) = (table.as_mut().ok_or(CuError::INVALID_VALUE)?, id.as_ref().ok_or(CuError::INVALID_VALUE)?);
    let uuid: [u8; 16] = id.bytes.map(|b| b as u8);
    let found: Option<*const c_void> = match uuid {
        CUDART_INTERFACE_ID => Some(CUDART_INTERFACE.0.as_ptr() as _),
        TOOLS_RUNTIME_CALLBACK_HOOKS_ID => Some(TOOLS_RUNTIME_CALLBACK_HOOKS.0.as_ptr() as _),
        TOOLS_TLS_ID => Some(TOOLS_TLS.0.as_ptr() as _),
        TOOLS_CONTEXT_ID => Some(TOOLS_CONTEXT.0.as_ptr() as _),
        CONTEXT_LOCAL_STORAGE_ID => Some(CONTEXT_LOCAL_STORAGE.0.as_ptr() as _),
        CONTEXT_CHECKS_ID => Some(CONTEXT_CHECKS.0.as_ptr() as _),
        INTEGRITY_CHECK_ID => Some(INTEGRITY_CHECK.0.as_ptr() as _),
        _ => None,
    };
    match found {
        Some(t) => {
            *table = t;
            Ok(())
        }
        None => {
            tracing::debug!("export table {} refused", uuid.iter().map(|b| format!("{b:02x}")).collect::<String>());
            *table = std::ptr::null();
            Err(CuError::INVALID_VALUE)
        }
    }
}

/// The device identities the integrity check hashes, in ordinal order.
pub(crate) fn device_identities() -> Vec<([u8; 16], i32, i32, i32)> {
    runtime::try_get()
        .map(|rt| rt.devices.iter().map(|d| (d.remote.uuid, d.remote.pci.0, d.remote.pci.1, d.remote.pci.2)).collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_in_an_export_table_function_does_not_unwind_into_the_caller() {
        let mut ran = false;
        guarded("test slot", || {
            ran = true;
            panic!("boom");
        });
        assert!(ran, "the body ran, and its panic stayed inside");
        assert_eq!(not_supported(), CUresult::CUDA_ERROR_NOT_SUPPORTED);
        let mut r1 = 7u32;
        assert_eq!(unsafe { context_check(std::ptr::null_mut(), &mut r1, std::ptr::null_mut()) }, CUresult::CUDA_SUCCESS);
        assert_eq!(r1, 0);
        let (mut b, mut n) = (std::ptr::null_mut(), 0usize);
        unsafe { hook_buffer_1(&mut b, &mut n) };
        assert_eq!((b as *const c_void, n), (HOOK_BUFFER_1.0.get() as *const c_void, 1024));
        unsafe { hook_buffer_2(std::ptr::null_mut(), std::ptr::null_mut()) };
    }

    /// Every word behind the tools-context table's size is a function that refuses: a
    /// caller that ignores the size (cuBLASLt) gets an error, not a jump into other data.
    #[test]
    fn the_tools_context_table_refuses_past_its_size() {
        let mut t: *const c_void = std::ptr::null();
        let id = CUuuid { bytes: TOOLS_CONTEXT_ID.map(|b| b as _) };
        unsafe { get_export_table(&mut t, &id) }.unwrap();
        let words = t as *const *const c_void;
        assert_eq!(unsafe { *words }, size_of_table(0));
        for i in 1..17 {
            let f: extern "C" fn() -> CUresult = unsafe { std::mem::transmute(*words.add(i)) };
            assert_eq!(f(), CUresult::CUDA_ERROR_NOT_SUPPORTED, "word {i}");
        }
    }
}
