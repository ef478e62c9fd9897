//! A link bundle: the image the shim's `cuLinkComplete` returns when several inputs were added.
//! The inputs travel unchanged, and the server links them when the bundle is loaded as a
//! module (`cuModuleLoadData` of the linker's output), where it knows the device and the
//! backend. Programs treat a linker's output as opaque bytes, so they can keep, cache and load
//! it as they would a cubin.
//!
//! Layout, little endian: the magic `RGPULNK1`; the total length in bytes, header included
//! (u64), so that a loader given only a pointer knows the extent; the number of inputs (u32);
//! then per input its `CUjitInputType` (u32), its length (u64) and its bytes.

pub const MAGIC: &[u8; 8] = b"RGPULNK1";
/// More inputs than any linker invocation seen (numba adds a handful).
pub const MAX_INPUTS: usize = 256;
const HEADER: usize = 8 + 8 + 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Input<'a> {
    /// `CUjitInputType` as the program passed it.
    pub kind: u32,
    pub bytes: &'a [u8],
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BundleError {
    #[error("not a link bundle")]
    NotABundle,
    #[error("link bundle truncated at byte {0}")]
    Truncated(usize),
    #[error("link bundle of {0} inputs (at most {MAX_INPUTS}, at least 1)")]
    Count(u64),
    #[error("link bundle says {said} bytes but holds {have}")]
    Length { said: u64, have: usize },
}

pub fn encode(inputs: &[Input<'_>]) -> Vec<u8> {
    let total = HEADER + inputs.iter().map(|i| 12 + i.bytes.len()).sum::<usize>();
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(total as u64).to_le_bytes());
    out.extend_from_slice(&(inputs.len() as u32).to_le_bytes());
    for i in inputs {
        out.extend_from_slice(&i.kind.to_le_bytes());
        out.extend_from_slice(&(i.bytes.len() as u64).to_le_bytes());
        out.extend_from_slice(i.bytes);
    }
    out
}

/// The total length a bundle's first 16 bytes announce.
pub fn announced_len(head: &[u8; 16]) -> Option<u64> {
    head.starts_with(MAGIC).then(|| u64::from_le_bytes(head[8..16].try_into().unwrap()))
}

pub fn decode(bytes: &[u8]) -> Result<Vec<Input<'_>>, BundleError> {
    if !bytes.starts_with(MAGIC) {
        return Err(BundleError::NotABundle);
    }
    let u64_at = |at: usize| bytes.get(at..at + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap())).ok_or(BundleError::Truncated(at));
    let u32_at = |at: usize| bytes.get(at..at + 4).map(|b| u32::from_le_bytes(b.try_into().unwrap())).ok_or(BundleError::Truncated(at));
    let said = u64_at(8)?;
    // A loader may hand over more bytes than the bundle (padding); never fewer.
    if said > bytes.len() as u64 || said < HEADER as u64 {
        return Err(BundleError::Length { said, have: bytes.len() });
    }
    let bytes = &bytes[..said as usize];
    let count = u32_at(16)? as u64;
    if count == 0 || count > MAX_INPUTS as u64 {
        return Err(BundleError::Count(count));
    }
    let mut at = HEADER;
    let mut inputs = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let kind = u32_at(at)?;
        let len = u64_at(at + 4)?;
        let start = at + 12;
        let end = (start as u64).checked_add(len).filter(|&e| e <= bytes.len() as u64).ok_or(BundleError::Truncated(start))? as usize;
        inputs.push(Input { kind, bytes: &bytes[start..end] });
        at = end;
    }
    if at != bytes.len() {
        return Err(BundleError::Length { said, have: at });
    }
    Ok(inputs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_what_does_not_add_up() {
        let a = b".version 8.0\0".as_slice();
        let b = [1u8, 2, 3].as_slice();
        let bytes = encode(&[Input { kind: 1, bytes: a }, Input { kind: 3, bytes: b }]);
        assert_eq!(announced_len(bytes[..16].try_into().unwrap()), Some(bytes.len() as u64));
        let got = decode(&bytes).unwrap();
        assert_eq!(got, vec![Input { kind: 1, bytes: a }, Input { kind: 3, bytes: b }]);
        // Padding after the announced length is ignored.
        let mut padded = bytes.clone();
        padded.extend_from_slice(&[0; 40]);
        assert_eq!(decode(&padded).unwrap().len(), 2);
        // Every truncation is refused, never read past.
        for cut in 0..bytes.len() {
            assert!(decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        // An input claiming more than the bundle holds.
        let mut lying = bytes.clone();
        lying[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(decode(&lying).is_err());
        let mut none = bytes.clone();
        none[16..20].copy_from_slice(&0u32.to_le_bytes());
        assert_eq!(decode(&none), Err(BundleError::Count(0)));
    }
}
