//! Fatbin containers as nvcc writes them (checked against nvcc 13.5 output).
//!
//! Container header (16 bytes): `u32 magic 0xBA55ED50; u16 version (1); u16 header size (16);
//! u64 size of the entries that follow`. Several containers may sit back to back (as in an
//! executable's `.nv_fatbin` section); [`parse_fatbin`] reads them all, skipping zero padding
//! between them, and stops at the first bytes that are neither padding nor a container.
//!
//! Entry header (64 bytes for ELF, 80 for PTX), little-endian:
//!
//! | offset | field |
//! |---|---|
//! | 0  | u16 kind: 1 PTX, 2 ELF (SASS) |
//! | 2  | u16 version (0x101) |
//! | 4  | u32 header size |
//! | 8  | u64 payload size (the next entry starts at header size + payload size) |
//! | 16 | u32 compressed size (the meaningful prefix of a compressed payload) |
//! | 20 | u32 options offset (PTX) |
//! | 24 | u16 minor, u16 major (PTX ISA version for PTX, e.g. 9.5; 1.8 for ELF) |
//! | 28 | u32 sm architecture (75 = sm_75 / compute_75) |
//! | 32 | u32 object name offset, u32 object name length |
//! | 40 | u64 flags: 0x1 64-bit, 0x10 Linux, 0x2000 LZ4 (block format), 0x8000 zstd |
//! | 48 | u64 (zero) |
//! | 56 | u64 uncompressed size (0 when not compressed) |

use std::borrow::Cow;
use std::io::Read;

use super::ImageError;

/// Magic number of a fatbin container.
pub const FATBIN_MAGIC: u32 = 0xBA55_ED50;
/// Magic number of a fatbin *wrapper* (`__fatBinC_Wrapper_t`), which only points at a fatbin.
pub const FATBIN_WRAPPER_MAGIC: u32 = 0x466243B1;
/// Largest uncompressed payload accepted (a lying header must not make us allocate more).
pub const MAX_UNCOMPRESSED: u64 = 1 << 30;

/// Size of a container header.
const CONTAINER_HEADER: usize = 16;
/// Smallest entry header holding every field we read.
const MIN_ENTRY_HEADER: u64 = 64;

pub const FLAG_64BIT: u64 = 0x1;
pub const FLAG_LINUX: u64 = 0x10;
pub const FLAG_LZ4: u64 = 0x2000;
pub const FLAG_ZSTD: u64 = 0x8000;

/// What an entry holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    /// PTX text (kind 1).
    Ptx,
    /// An ELF cubin with SASS (kind 2).
    Elf,
    /// Something else (e.g. LTO IR); skipped by the reader.
    Other(u16),
}

/// How an entry's payload is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Lz4,
    Zstd,
}

/// One entry of a fatbin container, borrowing its payload from the input.
#[derive(Debug, Clone)]
pub struct FatbinEntry<'a> {
    /// Position among all entries of all containers, from 0.
    pub index: usize,
    pub kind: EntryKind,
    /// `sm_XY` / `compute_XY` as the number XY.
    pub arch: u32,
    /// (major, minor): PTX ISA version for PTX entries.
    pub version: (u16, u16),
    pub flags: u64,
    /// The whole payload as stored (padding included).
    pub payload: &'a [u8],
    compressed_size: u32,
    uncompressed_size: u64,
}

fn u16_at(b: &[u8], off: usize) -> Option<u16> {
    b.get(off..off.checked_add(2)?)
        .map(|s| u16::from_le_bytes([s[0], s[1]]))
}

fn u32_at(b: &[u8], off: usize) -> Option<u32> {
    b.get(off..off.checked_add(4)?)
        .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

fn u64_at(b: &[u8], off: usize) -> Option<u64> {
    b.get(off..off.checked_add(8)?).map(|s| {
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        u64::from_le_bytes(a)
    })
}

fn truncated(what: &'static str, offset: usize, need: u64, have: usize) -> ImageError {
    ImageError::Truncated {
        what,
        offset: offset as u64,
        need,
        have: have as u64,
    }
}

impl<'a> FatbinEntry<'a> {
    /// Bytes [`FatbinEntry::data`] would allocate: the uncompressed size a
    /// compressed entry announces (capped as `data` caps it), 0 for a plain one.
    pub fn unpacked_len(&self) -> u64 {
        match self.compression() {
            Ok(Compression::None) => 0,
            _ => self.uncompressed_size.min(MAX_UNCOMPRESSED),
        }
    }

    /// The compression its flags announce.
    pub fn compression(&self) -> Result<Compression, ImageError> {
        match (self.flags & FLAG_LZ4 != 0, self.flags & FLAG_ZSTD != 0) {
            (false, false) => Ok(Compression::None),
            (true, false) => Ok(Compression::Lz4),
            (false, true) => Ok(Compression::Zstd),
            (true, true) => Err(ImageError::UnsupportedCompression {
                index: self.index,
                flags: self.flags,
            }),
        }
    }

    /// The payload, decompressed if need be. Checks the sizes the header announces.
    pub fn data(&self) -> Result<Cow<'a, [u8]>, ImageError> {
        let method = self.compression()?;
        if method == Compression::None {
            return Ok(Cow::Borrowed(self.payload));
        }
        let bad = |reason: String| ImageError::Decompress {
            index: self.index,
            method: if method == Compression::Lz4 {
                "LZ4"
            } else {
                "zstd"
            },
            reason,
        };
        let csize = self.compressed_size as usize;
        if csize == 0 || csize > self.payload.len() {
            return Err(bad(format!(
                "compressed size {} does not fit the {}-byte payload",
                csize,
                self.payload.len()
            )));
        }
        let size = self.uncompressed_size;
        if size > MAX_UNCOMPRESSED {
            return Err(ImageError::TooLarge {
                index: self.index,
                size,
                limit: MAX_UNCOMPRESSED,
            });
        }
        let input = &self.payload[..csize];
        let out = if method == Compression::Lz4 {
            {
                // An LZ4 block expands at most about 255:1; refuse a header that claims more
                // before allocating the output buffer.
                if size > (csize as u64).saturating_mul(256) + 64 {
                    return Err(bad(format!(
                        "uncompressed size {size} is impossible for {csize} bytes of LZ4"
                    )));
                }
                lz4_flex::block::decompress(input, size as usize).map_err(|e| bad(e.to_string()))?
            }
        } else {
            {
                // Stream so that memory grows with the real output, not with the header's claim.
                let dec = zstd::stream::read::Decoder::with_buffer(input)
                    .map_err(|e| bad(e.to_string()))?;
                let mut out = Vec::new();
                dec.single_frame()
                    .take(size.saturating_add(1))
                    .read_to_end(&mut out)
                    .map_err(|e| bad(e.to_string()))?;
                out
            }
        };
        if out.len() as u64 != size {
            return Err(bad(format!(
                "header says {size} bytes uncompressed, got {}",
                out.len()
            )));
        }
        Ok(Cow::Owned(out))
    }
}

/// Reads the entries of the fatbin container(s) at the start of `bytes`.
pub fn parse_fatbin(bytes: &[u8]) -> Result<Vec<FatbinEntry<'_>>, ImageError> {
    let mut entries = Vec::new();
    let mut off = 0usize;
    let mut containers = 0usize;
    loop {
        let magic = match u32_at(bytes, off) {
            Some(m) => m,
            None if containers > 0 => break,
            None => return Err(truncated("fatbin header", off, 16, bytes.len())),
        };
        if magic != FATBIN_MAGIC {
            if containers == 0 {
                return Err(ImageError::BadMagic { found: magic });
            }
            // Zero padding between containers is skipped, anything else ends the list.
            if magic == 0 {
                off += 4;
                continue;
            }
            break;
        }
        let (Some(_version), Some(hsize), Some(size)) = (
            u16_at(bytes, off + 4),
            u16_at(bytes, off + 6),
            u64_at(bytes, off + 8),
        ) else {
            return Err(truncated(
                "fatbin header",
                off,
                CONTAINER_HEADER as u64,
                bytes.len() - off,
            ));
        };
        if (hsize as usize) < CONTAINER_HEADER {
            return Err(ImageError::BadFatbin(format!(
                "container at offset {off}: header size {hsize} is below 16"
            )));
        }
        let start = off + hsize as usize;
        let avail = bytes.len().saturating_sub(start) as u64;
        if start > bytes.len() || size > avail {
            return Err(truncated(
                "fatbin container",
                off,
                (hsize as u64).saturating_add(size),
                bytes.len() - off,
            ));
        }
        let end = start + size as usize;
        read_entries(&bytes[..end], start, &mut entries)?;
        containers += 1;
        off = end;
    }
    Ok(entries)
}

fn read_entries<'a>(
    bytes: &'a [u8],
    mut e: usize,
    entries: &mut Vec<FatbinEntry<'a>>,
) -> Result<(), ImageError> {
    let end = bytes.len();
    while e < end {
        let have = end - e;
        if (have as u64) < MIN_ENTRY_HEADER {
            return Err(truncated("fatbin entry header", e, MIN_ENTRY_HEADER, have));
        }
        let h = &bytes[e..];
        let kind = u16_at(h, 0).unwrap_or(0);
        let hsize = u32_at(h, 4).unwrap_or(0) as u64;
        let psize = u64_at(h, 8).unwrap_or(0);
        if hsize < MIN_ENTRY_HEADER {
            return Err(ImageError::BadFatbin(format!(
                "entry at offset {e}: header size {hsize} is below {MIN_ENTRY_HEADER}"
            )));
        }
        let total = hsize
            .checked_add(psize)
            .filter(|&t| t <= have as u64)
            .ok_or_else(|| truncated("fatbin entry", e, hsize.saturating_add(psize), have))?;
        let index = entries.len();
        let minor = u16_at(h, 24).unwrap_or(0);
        let major = u16_at(h, 26).unwrap_or(0);
        entries.push(FatbinEntry {
            index,
            kind: match kind {
                1 => EntryKind::Ptx,
                2 => EntryKind::Elf,
                k => EntryKind::Other(k),
            },
            arch: u32_at(h, 28).unwrap_or(0),
            version: (major, minor),
            flags: u64_at(h, 40).unwrap_or(0),
            payload: &h[hsize as usize..total as usize],
            compressed_size: u32_at(h, 16).unwrap_or(0),
            uncompressed_size: u64_at(h, 56).unwrap_or(0),
        });
        e += total as usize;
    }
    Ok(())
}

/// The PTX text of a (decompressed) PTX payload: up to the first NUL, as UTF-8.
pub fn ptx_text(data: &[u8]) -> Result<&str, ImageError> {
    let text = match data.iter().position(|&b| b == 0) {
        Some(n) => &data[..n],
        None => data,
    };
    std::str::from_utf8(text).map_err(|e| ImageError::PtxNotUtf8 {
        offset: e.valid_up_to(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn container(entries: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&FATBIN_MAGIC.to_le_bytes());
        v.extend_from_slice(&1u16.to_le_bytes());
        v.extend_from_slice(&16u16.to_le_bytes());
        v.extend_from_slice(&(entries.len() as u64).to_le_bytes());
        v.extend_from_slice(entries);
        v
    }

    fn entry(kind: u16, arch: u32, flags: u64, payload: &[u8], csize: u32, usize_: u64) -> Vec<u8> {
        let mut h = vec![0u8; 64];
        h[0..2].copy_from_slice(&kind.to_le_bytes());
        h[2..4].copy_from_slice(&0x101u16.to_le_bytes());
        h[4..8].copy_from_slice(&64u32.to_le_bytes());
        h[8..16].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        h[16..20].copy_from_slice(&csize.to_le_bytes());
        h[28..32].copy_from_slice(&arch.to_le_bytes());
        h[40..48].copy_from_slice(&flags.to_le_bytes());
        h[56..64].copy_from_slice(&usize_.to_le_bytes());
        h.extend_from_slice(payload);
        h
    }

    #[test]
    fn empty_container_has_no_entries() {
        assert!(parse_fatbin(&container(&[])).unwrap().is_empty());
    }

    #[test]
    fn back_to_back_containers_with_padding() {
        let mut v = container(&entry(1, 80, 0x11, b".version 8.0\0\0\0", 0, 0));
        v.extend_from_slice(&[0u8; 8]);
        v.extend_from_slice(&container(&entry(2, 90, 0x11, b"\x7fELF", 0, 0)));
        v.extend_from_slice(b"junk");
        let e = parse_fatbin(&v).unwrap();
        assert_eq!(e.len(), 2);
        assert_eq!((e[0].kind, e[0].arch), (EntryKind::Ptx, 80));
        assert_eq!((e[1].kind, e[1].arch, e[1].index), (EntryKind::Elf, 90, 1));
    }

    #[test]
    fn lying_sizes_are_refused() {
        // Payload size larger than the container.
        let mut ent = entry(1, 80, 0x11, b"abcd", 0, 0);
        ent[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            parse_fatbin(&container(&ent)),
            Err(ImageError::Truncated { .. })
        ));
        // Container size larger than the buffer.
        let mut c = container(&entry(1, 80, 0x11, b"abcd", 0, 0));
        c[8..16].copy_from_slice(&(u64::MAX - 3).to_le_bytes());
        assert!(matches!(
            parse_fatbin(&c),
            Err(ImageError::Truncated { .. })
        ));
        // Huge uncompressed size.
        let c = container(&entry(1, 80, 0x8011, &[0x28, 0xb5, 0x2f, 0xfd], 4, 1 << 40));
        let e = parse_fatbin(&c).unwrap();
        assert!(matches!(e[0].data(), Err(ImageError::TooLarge { .. })));
        // LZ4 claiming an impossible ratio.
        let c = container(&entry(1, 80, 0x2011, &[0x10, b'a'], 2, 100_000));
        let e = parse_fatbin(&c).unwrap();
        assert!(matches!(e[0].data(), Err(ImageError::Decompress { .. })));
        // Both compressions at once.
        let c = container(&entry(1, 80, 0xa011, b"x", 1, 1));
        let e = parse_fatbin(&c).unwrap();
        assert!(matches!(
            e[0].data(),
            Err(ImageError::UnsupportedCompression { .. })
        ));
    }

    #[test]
    fn round_trips_compression() {
        let text = b"//\n.version 9.5\n.target sm_80\n.address_size 64\n\0\0\0\0".repeat(20);
        let z = zstd::bulk::compress(&text, 3).unwrap();
        let mut zp = z.clone();
        zp.extend_from_slice(&[0, 0, 0]); // payload padding after the compressed bytes
        let c = container(&entry(
            1,
            80,
            0x8011,
            &zp,
            z.len() as u32,
            text.len() as u64,
        ));
        assert_eq!(&*parse_fatbin(&c).unwrap()[0].data().unwrap(), &text[..]);
        // Wrong uncompressed size is refused.
        let c = container(&entry(
            1,
            80,
            0x8011,
            &zp,
            z.len() as u32,
            text.len() as u64 - 1,
        ));
        assert!(parse_fatbin(&c).unwrap()[0].data().is_err());

        let l = lz4_flex::block::compress(&text);
        let c = container(&entry(1, 80, 0x2011, &l, l.len() as u32, text.len() as u64));
        assert_eq!(&*parse_fatbin(&c).unwrap()[0].data().unwrap(), &text[..]);
    }
}
