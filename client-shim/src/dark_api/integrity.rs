//! cudart's integrity check (export table d4082055.., slot 1): for its
//! version ending in 2, the driver must answer an HMAC-MD2 over the calling
//! process's identity and every device's identity; the other two versions
//! expect constants. Layouts and key were measured; see
//! shared/notes/cuda-driver-contract.md.

use std::ffi::c_void;

use hmac::{KeyInit, Mac, SimpleHmac};

use crate::cuda::types::*;
use crate::runtime::DRIVER_VERSION;

const KEY: [u8; 16] = [0x14, 0x6A, 0xDD, 0xAE, 0x53, 0xA9, 0xA7, 0x52, 0xAA, 0x08, 0x41, 0x36, 0x0B, 0xF5, 0x5A, 0x9F];

pub(super) unsafe extern "C" fn check(version: u32, unix_secs: u64, out: *mut [u64; 2]) -> CUresult {
    crate::entry::call("INTEGRITY_CHECK[1]", &[], || {
        let out = out.as_mut().ok_or(CuError::INVALID_VALUE)?;
        *out = match version % 10 {
            0 => [0x3341181C03CB675C, 0x8ED383AA1F4CD1E8],
            1 => [0x1841181C03CB675C, 0x8ED383AA1F4CD1E8],
            _ => digest(version, unix_secs),
        };
        Ok(())
    })
}

fn digest(version: u32, unix_secs: u64) -> [u64; 2] {
    let pid = std::process::id();
    let tid = unsafe { libc::pthread_self() } as u32;
    let bytes = message(
        version,
        pid,
        tid,
        super::cudart_interface_ptr(),
        super::integrity_table_ptr(),
        check as *const c_void,
        unix_secs,
        &super::device_identities(),
    );
    hmac_md2(&bytes)
}

/// The bytes hashed: two C structs in x86-64 layout, the second once per device.
#[allow(clippy::too_many_arguments)]
fn message(
    version: u32,
    pid: u32,
    tid: u32,
    cudart_table: *const c_void,
    integrity_table: *const c_void,
    check_fn: *const c_void,
    unix_secs: u64,
    devices: &[([u8; 16], i32, i32, i32)],
) -> Vec<u8> {
    let mut m = Vec::with_capacity(48 + 28 * devices.len());
    m.extend_from_slice(&(DRIVER_VERSION as u32).to_ne_bytes());
    m.extend_from_slice(&version.to_ne_bytes());
    m.extend_from_slice(&pid.to_ne_bytes());
    m.extend_from_slice(&tid.to_ne_bytes());
    m.extend_from_slice(&(cudart_table as usize as u64).to_ne_bytes());
    m.extend_from_slice(&(integrity_table as usize as u64).to_ne_bytes());
    m.extend_from_slice(&(check_fn as usize as u64).to_ne_bytes());
    m.extend_from_slice(&unix_secs.to_ne_bytes());
    for (uuid, domain, bus, device) in devices {
        m.extend_from_slice(uuid);
        m.extend_from_slice(&domain.to_ne_bytes());
        m.extend_from_slice(&bus.to_ne_bytes());
        m.extend_from_slice(&device.to_ne_bytes());
    }
    m
}

fn hmac_md2(bytes: &[u8]) -> [u64; 2] {
    let mut mac = <SimpleHmac<md2::Md2> as KeyInit>::new_from_slice(&KEY).expect("HMAC takes any key length");
    mac.update(bytes);
    let d = mac.finalize().into_bytes();
    [u64::from_ne_bytes(d[..8].try_into().unwrap()), u64::from_ne_bytes(d[8..16].try_into().unwrap())]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_layout_matches_the_c_structs() {
        let devs = [([7u8; 16], 0, 0x10, 0), ([9u8; 16], 1, 2, 3)];
        let m = message(13052, 1, 2, 8 as _, 16 as _, 24 as _, 99, &devs);
        assert_eq!(m.len(), 48 + 2 * 28);
        assert_eq!(&m[4..8], &13052u32.to_ne_bytes());
        assert_eq!(&m[40..48], &99u64.to_ne_bytes());
        assert_eq!(&m[48..64], &[7u8; 16]);
        assert_eq!(&m[68..72], &0x10i32.to_ne_bytes());
    }

    #[test]
    fn hmac_md2_matches_rfc_2104_construction() {
        // HMAC(K, m) = MD2((K ^ opad) || MD2((K ^ ipad) || m)), 16-byte blocks.
        use md2::{Digest, Md2};
        let msg = b"rgpu integrity";
        let ipad: Vec<u8> = KEY.iter().map(|b| b ^ 0x36).collect();
        let opad: Vec<u8> = KEY.iter().map(|b| b ^ 0x5c).collect();
        let inner = Md2::new().chain_update(&ipad).chain_update(msg).finalize();
        let outer = Md2::new().chain_update(&opad).chain_update(inner).finalize();
        let want = [u64::from_ne_bytes(outer[..8].try_into().unwrap()), u64::from_ne_bytes(outer[8..].try_into().unwrap())];
        assert_eq!(hmac_md2(msg), want);
    }
}
