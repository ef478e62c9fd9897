//! What the cuda backend observes of its GPUs' health, through NVIDIA's
//! NVML (`libnvidia-ml.so.1`, opened at run time; the server builds and
//! runs without it). Per device, found by its UUID:
//!
//! - uncorrectable ECC errors since the driver loaded (volatile count of
//!   `nvmlDeviceGetTotalEccErrors`): any is unhealthy;
//! - pages pending retirement (`nvmlDeviceGetRetiredPagesPendingStatus`,
//!   GPUs before Ampere) or rows pending remapping or a failed remapping
//!   (`nvmlDeviceGetRemappedRows`, Ampere and later): the GPU needs a
//!   reset before its memory is whole again, so it is unhealthy.
//!
//! A query the GPU does not support (no ECC, consumer parts) tells
//! nothing; a device NVML does not know, or no NVML at all, is reported
//! healthy and logged once as unknown. Xid errors are not read here:
//! NVML delivers them as events to a waiting thread, which this source
//! does not keep (a fatal one fails the sessions' CUDA calls anyway).

use std::ffi::{c_char, c_uint, c_ulonglong, c_void, CString};
use std::sync::Once;

use tracing::{info, warn};

use crate::health::DeviceHealth;

type Ret = c_uint;
const NVML_SUCCESS: Ret = 0;
const NVML_ERROR_NOT_SUPPORTED: Ret = 3;
type Device = *mut c_void;
/// `NVML_MEMORY_ERROR_TYPE_UNCORRECTED`, `NVML_VOLATILE_ECC`.
const UNCORRECTED: c_uint = 1;
const VOLATILE: c_uint = 0;

/// The queries are each optional: an older NVML lacks the newer ones.
struct Api {
    by_uuid: unsafe extern "C" fn(*const c_char, *mut Device) -> Ret,
    total_ecc: Option<unsafe extern "C" fn(Device, c_uint, c_uint, *mut c_ulonglong) -> Ret>,
    pages_pending: Option<unsafe extern "C" fn(Device, *mut c_uint) -> Ret>,
    remapped_rows: Option<unsafe extern "C" fn(Device, *mut c_uint, *mut c_uint, *mut c_uint, *mut c_uint) -> Ret>,
}

/// NVML's view of the backend's devices, or none.
pub struct NvmlHealth {
    // Kept loaded while the function pointers in `api` live.
    _lib: Option<libloading::Library>,
    api: Option<Api>,
    /// NVML's handle of each CUDA device, by ordinal (None: unknown to it).
    devices: Vec<Option<usize>>,
    unknown_logged: Once,
}

// The handles are NVML's opaque device pointers, valid for the process's
// life after nvmlInit and usable from any thread (NVML is thread-safe).
unsafe impl Send for NvmlHealth {}
unsafe impl Sync for NvmlHealth {}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as NVML names a GPU.
pub fn uuid_text(u: &[u8; 16]) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
}

impl NvmlHealth {
    /// Opens NVML and finds each device (by UUID); never fails.
    pub fn open(uuids: &[[u8; 16]]) -> NvmlHealth {
        let none = |why: String| {
            info!("device health: {why}; GPUs are reported healthy (their health is unknown)");
            NvmlHealth { _lib: None, api: None, devices: vec![None; uuids.len()], unknown_logged: Once::new() }
        };
        // SAFETY: loading NVIDIA's NVML runs its constructors, as any
        // program using NVML does.
        let lib = match unsafe { libloading::Library::new("libnvidia-ml.so.1") } {
            Ok(l) => l,
            Err(e) => return none(format!("no NVML ({e})")),
        };
        // SAFETY: the signatures are NVML's (nvml.h, NVML API 11+).
        let api = unsafe {
            let init: Result<libloading::Symbol<unsafe extern "C" fn() -> Ret>, _> = lib.get(b"nvmlInit_v2\0");
            let api = (|| -> Result<Api, String> {
                let api = Api {
                    by_uuid: *lib.get(b"nvmlDeviceGetHandleByUUID\0").map_err(|e| e.to_string())?,
                    total_ecc: lib.get(b"nvmlDeviceGetTotalEccErrors\0").ok().map(|f| *f),
                    pages_pending: lib.get(b"nvmlDeviceGetRetiredPagesPendingStatus\0").ok().map(|f| *f),
                    remapped_rows: lib.get(b"nvmlDeviceGetRemappedRows\0").ok().map(|f| *f),
                };
                if api.total_ecc.is_none() && api.pages_pending.is_none() && api.remapped_rows.is_none() {
                    // Not NVIDIA's NVML (rgpu's own, on a host chained to
                    // another rgpu server): nothing to ask, and no reason
                    // to initialise it.
                    return Err("none of the ECC, retired-page and row-remapping queries".into());
                }
                Ok(api)
            })();
            match (init, api) {
                (Ok(init), Ok(api)) => match init() {
                    NVML_SUCCESS => api,
                    r => return none(format!("nvmlInit_v2 returned {r}")),
                },
                (Err(e), _) => return none(format!("NVML lacks nvmlInit_v2 ({e})")),
                (_, Err(e)) => return none(format!("NVML lacks what health needs ({e})")),
            }
        };
        let devices: Vec<Option<usize>> = uuids
            .iter()
            .map(|u| {
                let name = CString::new(uuid_text(u)).ok()?;
                let mut d: Device = std::ptr::null_mut();
                // SAFETY: a NUL-terminated name and an out-pointer.
                (unsafe { (api.by_uuid)(name.as_ptr(), &mut d) } == NVML_SUCCESS && !d.is_null()).then_some(d as usize)
            })
            .collect();
        let found = devices.iter().filter(|d| d.is_some()).count();
        info!(devices = uuids.len(), found, "device health from NVML (uncorrectable ECC errors, retired pages, row remapping)");
        NvmlHealth { _lib: Some(lib), api: Some(api), devices, unknown_logged: Once::new() }
    }

    /// Every device's health now, by ordinal.
    pub fn health(&self) -> Vec<DeviceHealth> {
        let mut unknown = Vec::new();
        let out = self
            .devices
            .iter()
            .enumerate()
            .map(|(i, d)| match (&self.api, d) {
                (Some(api), Some(d)) => Self::of(api, *d as Device).unwrap_or_else(|| {
                    unknown.push(i);
                    DeviceHealth::healthy()
                }),
                _ => {
                    unknown.push(i);
                    DeviceHealth::healthy()
                }
            })
            .collect();
        if !unknown.is_empty() && self.api.is_some() {
            self.unknown_logged.call_once(|| {
                warn!(devices = ?unknown, "device health unknown (NVML does not know the device or answers none of its queries): reported healthy");
            });
        }
        out
    }

    /// One device's health; None when NVML answered none of the queries.
    fn of(api: &Api, d: Device) -> Option<DeviceHealth> {
        let mut answered = false;
        let mut why = Vec::new();
        let ok = |r: Ret, answered: &mut bool| {
            if r == NVML_SUCCESS {
                *answered = true;
            } else if r != NVML_ERROR_NOT_SUPPORTED {
                tracing::debug!(ret = r, "NVML health query failed");
            }
            r == NVML_SUCCESS
        };
        let mut ecc: c_ulonglong = 0;
        // SAFETY: a handle NVML gave and an out-pointer, as nvml.h declares.
        if api.total_ecc.is_some_and(|f| ok(unsafe { f(d, UNCORRECTED, VOLATILE, &mut ecc) }, &mut answered)) && ecc > 0 {
            why.push(format!("{ecc} uncorrectable ECC error(s) since the driver loaded"));
        }
        let mut pending: c_uint = 0;
        // SAFETY: as above.
        if api.pages_pending.is_some_and(|f| ok(unsafe { f(d, &mut pending) }, &mut answered)) && pending != 0 {
            why.push("retired pages pending (reset the GPU)".to_string());
        }
        let (mut corr, mut unc, mut rows_pending, mut failed): (c_uint, c_uint, c_uint, c_uint) = (0, 0, 0, 0);
        // SAFETY: as above.
        if api.remapped_rows.is_some_and(|f| ok(unsafe { f(d, &mut corr, &mut unc, &mut rows_pending, &mut failed) }, &mut answered)) {
            if failed != 0 {
                why.push("row remapping failed".to_string());
            } else if rows_pending != 0 {
                why.push("row remapping pending (reset the GPU)".to_string());
            }
        }
        if !answered {
            return None;
        }
        Some(if why.is_empty() { DeviceHealth::healthy() } else { DeviceHealth::failing(why.join("; ")) })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn uuids_are_named_as_nvml_names_them() {
        let u = [0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef];
        assert_eq!(super::uuid_text(&u), "GPU-12345678-9abc-def0-0123-456789abcdef");
    }
}
