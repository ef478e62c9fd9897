//! The snapshot's framing: a header, then records, each a small metadata
//! part and an optional bulk part that is streamed (device memory, module
//! images, kept reply frames), so neither side ever holds a session's
//! memory in one buffer. Sans-I/O apart from `Read`/`Write`.
//!
//! Everything is little-endian. A record is
//! `tag: u8, meta_len: u32, meta, bulk_len: u64, bulk`; `meta_len` is at
//! most [`MAX_META`], and each tag bounds its own bulk (checked by the
//! reader before a byte of it is read).

use std::io::{self, Read, Write};

use super::SnapshotError;

/// The first bytes of every snapshot.
pub const MAGIC: &[u8; 8] = b"RGPUSNAP";
/// The newest format version this server writes and reads. The format
/// changes only by a new version; a reader refuses any it does not know.
/// Version 2 is version 1 with instantiated graphs ([`Tag::Graph`]) and
/// virtual memory management objects ([`Tag::Physical`], [`Tag::Reservation`],
/// [`Tag::Map`]): a snapshot without any is written as version 1, which
/// older servers read.
pub const VERSION: u32 = 2;
/// The oldest version this server reads.
pub const MIN_VERSION: u32 = 1;
/// The first version with graph and VMM records.
pub const GRAPHS_SINCE: u32 = 2;
/// The largest metadata part of one record.
pub const MAX_META: u32 = 1 << 20;
/// The most records one snapshot may hold (allocations, modules, streams,
/// events and kept replies together).
pub const MAX_RECORDS: u64 = 1 << 22;

/// Record tags, in the order a snapshot holds them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Tag {
    /// The session, its lease, the devices it was made on. Exactly one, first.
    Session = 1,
    /// A loaded module: its image is the bulk.
    Module = 2,
    /// A live allocation (the client's, or a module global): its contents are the bulk.
    Alloc = 3,
    Stream = 4,
    Event = 5,
    /// A reply the client may not have received: its frame is the bulk.
    Reply = 6,
    /// A client allocation whose contents a live migration's pre-copy
    /// placed already: only the runs written since are the bulk. In a
    /// migration stream only (`crate::migration`), never in a file.
    AllocDelta = 7,
    /// An instantiated graph (version 2 on): its operations, kernel
    /// parameters and staging memory are the bulk. After the events, before
    /// the kept replies (which may read its staging memory).
    Graph = 8,
    /// A physical allocation (cuMemCreate, version 2 on): its contents are the bulk.
    Physical = 9,
    /// A reserved address range (cuMemAddressReserve, version 2 on).
    Reservation = 10,
    /// A map of part of a physical allocation into a reservation (version 2 on).
    Map = 11,
    /// The record count, last: a snapshot cut short has none.
    End = 0xff,
}

impl Tag {
    /// The stage a record belongs to: records come in stage order.
    pub fn stage(self) -> u8 {
        match self {
            Tag::Session => 1,
            Tag::Module => 2,
            Tag::Alloc | Tag::AllocDelta => 3,
            Tag::Physical => 4,
            Tag::Reservation => 5,
            Tag::Map => 6,
            Tag::Stream => 7,
            Tag::Event => 8,
            Tag::Graph => 9,
            Tag::Reply => 10,
            Tag::End => 0xff,
        }
    }

    fn from_u8(b: u8) -> Option<Tag> {
        Some(match b {
            1 => Tag::Session,
            2 => Tag::Module,
            3 => Tag::Alloc,
            4 => Tag::Stream,
            5 => Tag::Event,
            6 => Tag::Reply,
            7 => Tag::AllocDelta,
            8 => Tag::Graph,
            9 => Tag::Physical,
            10 => Tag::Reservation,
            11 => Tag::Map,
            0xff => Tag::End,
            _ => return None,
        })
    }
}

/// Builds a record's metadata part.
#[derive(Default)]
pub struct Enc(pub Vec<u8>);

impl Enc {
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn i32(&mut self, v: i32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Length-prefixed (u32) bytes.
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.u32(b.len() as u32);
        self.0.extend_from_slice(b);
        self
    }
    pub fn opt_u64(&mut self, v: Option<u64>) -> &mut Self {
        match v {
            Some(v) => self.u8(1).u64(v),
            None => self.u8(0),
        }
    }
}

/// Reads a record's metadata part; every read is bounds-checked.
pub struct Dec<'a> {
    b: &'a [u8],
    what: &'static str,
}

impl<'a> Dec<'a> {
    pub fn new(b: &'a [u8], what: &'static str) -> Self {
        Dec { b, what }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], SnapshotError> {
        if self.b.len() < n {
            return Err(SnapshotError::Malformed(format!("{} record ends early", self.what)));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    pub fn u8(&mut self) -> Result<u8, SnapshotError> {
        Ok(self.take(1)?[0])
    }
    pub fn u32(&mut self) -> Result<u32, SnapshotError> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }
    pub fn i32(&mut self) -> Result<i32, SnapshotError> {
        Ok(self.u32()? as i32)
    }
    pub fn u64(&mut self) -> Result<u64, SnapshotError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    /// Length-prefixed bytes of at most `max`.
    pub fn bytes(&mut self, max: usize) -> Result<&'a [u8], SnapshotError> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(SnapshotError::TooLarge { what: self.what, len: n as u64, max: max as u64 });
        }
        self.take(n)
    }
    pub fn opt_u64(&mut self) -> Result<Option<u64>, SnapshotError> {
        match self.u8()? {
            0 => Ok(None),
            1 => Ok(Some(self.u64()?)),
            b => Err(SnapshotError::Malformed(format!("{} record: option tag {b}", self.what))),
        }
    }
    /// The record must have been read to its end (no trailing bytes hide in it).
    pub fn finish(self) -> Result<(), SnapshotError> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(SnapshotError::Malformed(format!("{} record has {} bytes too many", self.what, self.b.len())))
        }
    }
}

pub fn write_header(w: &mut dyn Write, version: u32) -> io::Result<()> {
    w.write_all(MAGIC)?;
    w.write_all(&version.to_le_bytes())
}

/// Reads the header; returns the snapshot's version.
pub fn read_header(r: &mut dyn Read) -> Result<u32, SnapshotError> {
    let mut h = [0u8; 12];
    r.read_exact(&mut h).map_err(SnapshotError::read)?;
    if &h[..8] != MAGIC {
        return Err(SnapshotError::BadMagic);
    }
    let v = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
    if !(MIN_VERSION..=VERSION).contains(&v) {
        return Err(SnapshotError::Version(v));
    }
    Ok(v)
}

/// Writes a record's tag, metadata and bulk length; the caller then writes
/// exactly `bulk_len` bytes of bulk.
pub fn write_record(w: &mut dyn Write, tag: Tag, meta: &Enc, bulk_len: u64) -> io::Result<()> {
    let n = u32::try_from(meta.0.len()).ok().filter(|&n| n <= MAX_META).ok_or_else(|| io::Error::other("record metadata too large"))?;
    w.write_all(&[tag as u8])?;
    w.write_all(&n.to_le_bytes())?;
    w.write_all(&meta.0)?;
    w.write_all(&bulk_len.to_le_bytes())
}

/// A record's head, read: its bulk follows in the stream.
pub struct Head {
    pub tag: Tag,
    pub meta: Vec<u8>,
    pub bulk_len: u64,
}

pub fn read_record(r: &mut dyn Read) -> Result<Head, SnapshotError> {
    let mut t = [0u8; 5];
    r.read_exact(&mut t).map_err(SnapshotError::read)?;
    let tag = Tag::from_u8(t[0]).ok_or_else(|| SnapshotError::Malformed(format!("unknown record tag {}", t[0])))?;
    let n = u32::from_le_bytes([t[1], t[2], t[3], t[4]]);
    if n > MAX_META {
        return Err(SnapshotError::TooLarge { what: "record metadata", len: n as u64, max: MAX_META as u64 });
    }
    let mut meta = vec![0u8; n as usize];
    r.read_exact(&mut meta).map_err(SnapshotError::read)?;
    let mut b = [0u8; 8];
    r.read_exact(&mut b).map_err(SnapshotError::read)?;
    Ok(Head { tag, meta, bulk_len: u64::from_le_bytes(b) })
}

/// Reads exactly `len` bytes of bulk into a new buffer, `len` checked
/// against `max` first.
pub fn read_bulk(r: &mut dyn Read, len: u64, max: u64, what: &'static str) -> Result<Vec<u8>, SnapshotError> {
    if len > max {
        return Err(SnapshotError::TooLarge { what, len, max });
    }
    let mut v = Vec::new();
    r.take(len).read_to_end(&mut v).map_err(SnapshotError::read)?;
    if v.len() as u64 != len {
        return Err(SnapshotError::Truncated);
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decoding_is_bounded_and_exact() {
        let mut e = Enc::default();
        e.u8(7).u32(1).i32(-2).u64(3).bytes(b"abc").opt_u64(Some(9)).opt_u64(None);
        let mut d = Dec::new(&e.0, "test");
        assert_eq!(d.u8().unwrap(), 7);
        assert_eq!(d.u32().unwrap(), 1);
        assert_eq!(d.i32().unwrap(), -2);
        assert_eq!(d.u64().unwrap(), 3);
        assert_eq!(d.bytes(3).unwrap(), b"abc");
        assert_eq!(d.opt_u64().unwrap(), Some(9));
        assert_eq!(d.opt_u64().unwrap(), None);
        d.finish().unwrap();
        // A length past the bound is refused before anything is taken.
        let mut d = Dec::new(&e.0[17..], "test");
        assert!(matches!(d.bytes(2), Err(SnapshotError::TooLarge { .. })));
        // Short input and trailing bytes are both errors.
        assert!(matches!(Dec::new(&[1, 2], "test").u32(), Err(SnapshotError::Malformed(_))));
        assert!(matches!(Dec::new(&[1], "test").finish(), Err(SnapshotError::Malformed(_))));
    }

    #[test]
    fn headers_and_records_refuse_what_they_do_not_know() {
        let mut v = Vec::new();
        write_header(&mut v, 1).unwrap();
        assert_eq!(read_header(&mut &v[..]).unwrap(), 1);
        let mut bad = v.clone();
        bad[0] = b'X';
        assert!(matches!(read_header(&mut &bad[..]), Err(SnapshotError::BadMagic)));
        let mut two = v.clone();
        two[8] = 2;
        assert_eq!(read_header(&mut &two[..]).unwrap(), 2);
        for unknown in [0u8, 3] {
            let mut other = v.clone();
            other[8] = unknown;
            assert!(matches!(read_header(&mut &other[..]), Err(SnapshotError::Version(n)) if n == unknown as u32));
        }
        assert!(matches!(read_header(&mut &v[..5]), Err(SnapshotError::Truncated)));
        // An unknown tag, a metadata length past the bound.
        assert!(matches!(read_record(&mut &[12u8, 0, 0, 0, 0][..]), Err(SnapshotError::Malformed(_))));
        let huge = [1u8, 0xff, 0xff, 0xff, 0xff];
        assert!(matches!(read_record(&mut &huge[..]), Err(SnapshotError::TooLarge { .. })));
        assert!(matches!(read_bulk(&mut &[0u8; 4][..], 8, 100, "x"), Err(SnapshotError::Truncated)));
        assert!(matches!(read_bulk(&mut &[0u8; 4][..], 1 << 40, 100, "x"), Err(SnapshotError::TooLarge { .. })));
    }
}
