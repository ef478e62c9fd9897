//! The device runtime library (`libcudadevrt.a`) as a linker input: NVIDIA's archive holds
//! SASS only, which rgpu's linker (PTX, on the server) cannot use. Of it, programs that link
//! it for cooperative groups (numba's `this_grid().sync()`) call two functions, which rgpu
//! defines in PTX (`device_runtime.ptx`) and links in the archive's place. A reference to
//! anything else of the archive stays undefined and fails the link or the launch with the
//! name of what is missing.

/// rgpu's PTX for the archive's cooperative-groups entry points (NUL-terminated, as a linker
/// input's PTX is kept).
pub const COOPERATIVE_GROUPS_PTX: &str = concat!(include_str!("device_runtime.ptx"), "\0");

/// Whether `bytes` is NVIDIA's device runtime archive: an `ar` archive whose symbol table
/// (its first member; host symbols only, the device code is in a fatbin) lists the fatbin
/// wrapper of `cuda_device_runtime.cu`, the archive's source.
pub fn is_cudadevrt(bytes: &[u8]) -> bool {
    const MAGIC: &[u8] = b"!<arch>\n";
    const HEADER: usize = 60;
    let Some(rest) = bytes.strip_prefix(MAGIC) else { return false };
    let Some(h) = rest.get(..HEADER) else { return false };
    // The GNU/SysV symbol table member is named "/"; its size is decimal at bytes 48..58.
    if h[0] != b'/' || h[1] != b' ' {
        return false;
    }
    let size: Option<usize> = std::str::from_utf8(&h[48..58]).ok().and_then(|s| s.trim().parse().ok());
    let Some(table) = size.and_then(|n| rest.get(HEADER..HEADER.checked_add(n)?)) else { return false };
    const SOURCE: &[u8] = b"_cuda_device_runtime_cu_";
    table.windows(SOURCE.len()).any(|w| w == SOURCE)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn archive(symbols: &[u8]) -> Vec<u8> {
        let mut a = b"!<arch>\n".to_vec();
        let mut h = format!("{:<16}{:<12}{:<6}{:<6}{:<8}{:<10}`\n", "/", 0, 0, 0, 0, symbols.len()).into_bytes();
        assert_eq!(h.len(), 60);
        a.append(&mut h);
        a.extend_from_slice(symbols);
        a
    }

    #[test]
    fn knows_the_device_runtime_archive_and_nothing_else() {
        assert!(is_cudadevrt(&archive(b"\0\0\0\x02\0\0\0\0\0\0\0\0cudartErrorTable\0__fatbinwrap_0afad4c0_22_cuda_device_runtime_cu_f78b5b52_735892\0")));
        assert!(!is_cudadevrt(&archive(b"\0\0\0\x01\0\0\0\0other\0")));
        assert!(!is_cudadevrt(b"!<arch>\n"));
        assert!(!is_cudadevrt(b"\x7fELF...."));
        let mut cut = archive(b"__fatbinwrap_0afad4c0_22_cuda_device_runtime_cu_f78b5b52\0");
        cut.truncate(cut.len() - 4);
        assert!(!is_cudadevrt(&cut), "a symbol table past the end of the input");
    }
}
