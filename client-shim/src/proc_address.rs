//! `cuGetProcAddress`: maps (name, CUDA version, flags) to one of our exported entry points,
//! using the generated table in `crate::cuda::proc_table`.
//!
//! Behaviour, from cuda.h's documentation of `cuGetProcAddress`:
//! - the entry with the highest `min_cuda_version <= cudaVersion` wins;
//! - with `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM` the `_ptds`/`_ptsz` variant is
//!   returned where one exists, else the plain one;
//! - an unknown name (including `""`) gives `CUDA_SUCCESS`, `*pfn = NULL` and status
//!   `CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND`; a known name whose every version is newer than
//!   `cudaVersion` gives `CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT`;
//! - `symbol` or `pfn` NULL gives `CUDA_ERROR_INVALID_VALUE`; `symbolStatus` is optional.
//!
//! Every function in cuda.h is exported (most as `CUDA_ERROR_NOT_SUPPORTED` stubs), so a name
//! that rgpu does not implement still resolves; calling it gives an honest NOT_SUPPORTED.

use crate::cuda::proc_table::PROC_TABLE;
use crate::cuda::types::{
    cuuint64_t, CUdriverProcAddressQueryResult, CUdriverProcAddress_flags, CuError, CuResult,
};
use std::ffi::{c_char, c_int, c_void, CStr};

/// What a lookup found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lookup {
    /// The exported symbol that serves the request.
    Found(&'static str),
    /// The name is known, but only for newer CUDA versions.
    VersionNotSufficient,
    /// No such name.
    NotFound,
}

/// Resolves a request against the table (pure; no addresses involved).
pub(crate) fn lookup(name: &[u8], cuda_version: c_int, per_thread: bool) -> Lookup {
    let start = PROC_TABLE.partition_point(|e| e.0.as_bytes() < name);
    let entries = PROC_TABLE[start..]
        .iter()
        .take_while(|e| e.0.as_bytes() == name);
    let mut known = false;
    let mut best: [Option<(u32, &'static str)>; 2] = [None, None]; // [plain, per-thread]
    for &(_, min_version, pt, symbol) in entries {
        known = true;
        if i64::from(min_version) <= i64::from(cuda_version) {
            let slot = &mut best[pt as usize];
            if !matches!(slot, Some((v, _)) if *v >= min_version) {
                *slot = Some((min_version, symbol));
            }
        }
    }
    let chosen = if per_thread { best[1].or(best[0]) } else { best[0] };
    match (chosen, known) {
        (Some((_, symbol)), _) => Lookup::Found(symbol),
        (None, true) => Lookup::VersionNotSufficient,
        (None, false) => Lookup::NotFound,
    }
}

/// `cuGetProcAddress_v2` (CUDA 12.0+): `symbolStatus` is optional.
///
/// # Safety
/// `symbol` must be NULL or a NUL-terminated string; `pfn` and `status` NULL or writable.
pub(crate) unsafe fn get_proc_address_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: cuuint64_t,
    status: *mut CUdriverProcAddressQueryResult,
) -> CuResult<()> {
    if symbol.is_null() || pfn.is_null() {
        return Err(CuError::INVALID_VALUE);
    }
    // SAFETY: non-null, NUL-terminated per the caller's contract.
    let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
    let per_thread = flags
        & u64::from(CUdriverProcAddress_flags::CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM.0)
        != 0;
    let (address, result) = match lookup(name, cuda_version, per_thread) {
        Lookup::Found(sym) => match crate::symbol_address(sym) {
            Some(address) => (address, CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SUCCESS),
            None => {
                // The table and the exports come from the same cuda.h; this is a generator bug.
                tracing::error!(target: "rgpu::cuda", "cuGetProcAddress: table names {sym}, which is not exported");
                (std::ptr::null_mut(), CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND)
            }
        },
        Lookup::VersionNotSufficient => (
            std::ptr::null_mut(),
            CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT,
        ),
        Lookup::NotFound => (
            std::ptr::null_mut(),
            CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND,
        ),
    };
    tracing::trace!(
        target: "rgpu::cuda",
        "cuGetProcAddress({:?}, {cuda_version}, {flags}) -> {:?}",
        String::from_utf8_lossy(name),
        result
    );
    // SAFETY: checked non-null above; writable per the caller's contract.
    unsafe { *pfn = address };
    if !status.is_null() {
        // SAFETY: non-null, writable per the caller's contract.
        unsafe { *status = result };
    }
    Ok(())
}

/// `cuGetProcAddress` (CUDA 11.3-11.8 signature, no status).
///
/// # Safety
/// As for [`get_proc_address_v2`].
pub(crate) unsafe fn get_proc_address(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: cuuint64_t,
) -> CuResult<()> {
    // SAFETY: same contract; no status pointer.
    unsafe { get_proc_address_v2(symbol, pfn, cuda_version, flags, std::ptr::null_mut()) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::types::CUresult;
    use std::ffi::CString;
    use std::path::PathBuf;

    const PER_THREAD: u64 = 2;

    fn query(name: &str, version: c_int, flags: u64) -> (CuResult<()>, *mut c_void, CUdriverProcAddressQueryResult) {
        let name = CString::new(name).unwrap();
        let mut pfn = std::ptr::dangling_mut::<c_void>();
        let mut status = CUdriverProcAddressQueryResult(99);
        let r = unsafe { get_proc_address_v2(name.as_ptr(), &mut pfn, version, flags, &mut status) };
        (r, pfn, status)
    }

    fn address(symbol: &str) -> *mut c_void {
        crate::symbol_address(symbol).unwrap_or_else(|| panic!("{symbol} is not exported"))
    }

    fn assert_resolves_to(name: &str, version: c_int, flags: u64, symbol: &str) {
        let (r, pfn, status) = query(name, version, flags);
        assert_eq!(r, Ok(()));
        assert_eq!(status, CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SUCCESS, "{name}@{version}/{flags}");
        assert_eq!(pfn, address(symbol), "{name}@{version}/{flags} should be {symbol}");
    }

    #[test]
    fn spot_checks() {
        assert_resolves_to("cuMemAlloc", 2000, 0, "cuMemAlloc");
        assert_resolves_to("cuMemAlloc", 3020, 0, "cuMemAlloc_v2");
        assert_resolves_to("cuMemAlloc", 13050, 0, "cuMemAlloc_v2");
        assert_resolves_to("cuMemcpyHtoDAsync", 3020, PER_THREAD, "cuMemcpyHtoDAsync_v2_ptsz");
        assert_resolves_to("cuMemcpyHtoDAsync", 3020, 0, "cuMemcpyHtoDAsync_v2");
        assert_resolves_to("cuMemcpyHtoD", 7000, PER_THREAD, "cuMemcpyHtoD_v2_ptds");
        // No per-thread variant of the CUDA 2.0 symbol: the plain one answers.
        assert_resolves_to("cuMemcpyHtoDAsync", 2000, PER_THREAD, "cuMemcpyHtoDAsync");
        // No per-thread variant at all: the plain one answers.
        assert_resolves_to("cuInit", 2000, PER_THREAD, "cuInit");
        assert_resolves_to("cuGetProcAddress", 11030, 0, "cuGetProcAddress");
        assert_resolves_to("cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2");
        assert_resolves_to("cuCtxCreate", 12050, 0, "cuCtxCreate_v4");
        assert_resolves_to("cuCtxCreate", 11040, 0, "cuCtxCreate_v3");
        assert_resolves_to("cuStreamBeginCapture", 10010, PER_THREAD, "cuStreamBeginCapture_v2_ptsz");
        assert_resolves_to("cuProfilerStart", 4000, 0, "cuProfilerStart");
    }

    #[test]
    fn misses() {
        for name in ["", "cuNoSuchFunction", "cuMemAlloc_v2", "cuMemAllo"] {
            let (r, pfn, status) = query(name, 13050, 0);
            assert_eq!(r, Ok(()));
            assert!(pfn.is_null(), "{name:?}");
            assert_eq!(status, CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND, "{name:?}");
        }
        let (r, pfn, status) = query("cuMemAlloc", 1000, 0);
        assert_eq!(r, Ok(()));
        assert!(pfn.is_null());
        assert_eq!(status, CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
        let (_, _, status) = query("cuGetProcAddress", 11020, PER_THREAD);
        assert_eq!(status, CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
    }

    #[test]
    fn null_arguments() {
        let name = CString::new("cuInit").unwrap();
        let mut pfn = std::ptr::null_mut();
        let mut status = CUdriverProcAddressQueryResult(0);
        unsafe {
            assert_eq!(get_proc_address_v2(std::ptr::null(), &mut pfn, 13000, 0, &mut status), Err(CuError::INVALID_VALUE));
            assert_eq!(get_proc_address_v2(name.as_ptr(), std::ptr::null_mut(), 13000, 0, &mut status), Err(CuError::INVALID_VALUE));
            // The status pointer is optional.
            assert_eq!(get_proc_address_v2(name.as_ptr(), &mut pfn, 13000, 0, std::ptr::null_mut()), Ok(()));
            assert_eq!(pfn, address("cuInit"));
            assert_eq!(get_proc_address(std::ptr::null(), &mut pfn, 13000, 0), Err(CuError::INVALID_VALUE));
        }
    }

    #[test]
    fn v1_variant() {
        let name = CString::new("cuMemAlloc").unwrap();
        let mut pfn = std::ptr::null_mut();
        assert_eq!(unsafe { get_proc_address(name.as_ptr(), &mut pfn, 11030, 0) }, Ok(()));
        assert_eq!(pfn, address("cuMemAlloc_v2"));
    }

    /// Through the exported entry points, as cudart calls them.
    #[test]
    fn through_the_exports() {
        type V2 = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, cuuint64_t, *mut CUdriverProcAddressQueryResult) -> CUresult;
        let name = CString::new("cuGetProcAddress").unwrap();
        let mut pfn = std::ptr::null_mut();
        let mut status = CUdriverProcAddressQueryResult(99);
        let r = unsafe { crate::exports::cuGetProcAddress_v2(name.as_ptr(), &mut pfn, 12000, 0, &mut status) };
        assert_eq!(r, CUresult::CUDA_SUCCESS);
        assert_eq!(pfn, address("cuGetProcAddress_v2"));
        // SAFETY: it is the exported cuGetProcAddress_v2.
        let v2: V2 = unsafe { std::mem::transmute(pfn) };
        let empty = CString::new("").unwrap();
        let r = unsafe { v2(empty.as_ptr(), &mut pfn, 13050, 0, &mut status) };
        assert_eq!(r, CUresult::CUDA_SUCCESS);
        assert!(pfn.is_null());
        assert_eq!(status, CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
    }

    #[test]
    fn table_is_sorted_and_fully_exported() {
        for w in PROC_TABLE.windows(2) {
            assert!((w[0].0, w[0].2, w[0].1) < (w[1].0, w[1].2, w[1].1), "{:?} / {:?}", w[0], w[1]);
        }
        for e in PROC_TABLE {
            assert!(crate::symbol_address(e.3).is_some(), "{e:?}");
        }
    }

    fn notes_dir() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data")
    }

    /// Every request NVIDIA's cudart 13.5 and 12.9 make at start-up resolves to an export.
    #[test]
    fn cudart_request_lists_resolve() {
        for (file, expected) in [
            ("cudart13-getprocaddress-requests.tsv", 457),
            ("cudart12-getprocaddress-requests.tsv", 418),
        ] {
            let path = notes_dir().join(file);
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let mut count = 0;
            let mut failures = vec![];
            for line in text.lines().filter(|l| !l.trim().is_empty()) {
                let cols: Vec<&str> = line.split('\t').collect();
                let (name, version, flags): (&str, c_int, u64) =
                    (cols[1], cols[2].parse().unwrap(), cols[3].parse().unwrap());
                count += 1;
                let (r, pfn, status) = query(name, version, flags);
                if r != Ok(()) || pfn.is_null() || status != CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SUCCESS {
                    failures.push(format!("{name}@{version}/{flags}: {r:?} {status:?}"));
                }
            }
            assert_eq!(count, expected, "{file}");
            assert!(failures.is_empty(), "{file}: {} unresolved:\n{}", failures.len(), failures.join("\n"));
        }
    }
}
