//! A suspended lease kept in one file (`rgpu checkpoint LEASE --to FILE`,
//! `rgpu restore FILE`): the snapshots its server wrote for it, each as the
//! server holds it, so each goes back exactly as it came.
//!
//! Layout (integers little-endian): `RGPULSE1`, the lease id (u64), the
//! server it was suspended on (u16 length, UTF-8), the number of snapshots
//! (u32); then per snapshot its name (u16 length, a snapshot name), its
//! size (u64) and its bytes. The snapshots carry their own checks (the
//! server refuses one that is damaged); this layer only finds them.

use std::io::{self, Read, Seek, SeekFrom, Write};

pub const MAGIC: &[u8; 8] = b"RGPULSE1";
/// Most snapshots one file holds (a server lists at most this many).
pub const MAX_SNAPSHOTS: u32 = 4096;
const MAX_SERVER: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub enum LeaseFileError {
    #[error("not an rgpu lease file (it does not start with RGPULSE1)")]
    NotOne,
    #[error("a damaged lease file: {0}")]
    Damaged(String),
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// What a lease file says before its snapshots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub lease: u64,
    pub server: String,
    pub count: u32,
}

/// Writes a lease file into `w`: [`Writer::add`] each snapshot, then
/// [`Writer::finish`].
pub struct Writer<W: Write + Seek> {
    w: W,
    count_at: u64,
    count: u32,
}

impl<W: Write + Seek> Writer<W> {
    pub fn new(mut w: W, lease: u64, server: &str) -> io::Result<Self> {
        if server.len() > MAX_SERVER {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "server address too long"));
        }
        w.write_all(MAGIC)?;
        w.write_all(&lease.to_le_bytes())?;
        w.write_all(&(server.len() as u16).to_le_bytes())?;
        w.write_all(server.as_bytes())?;
        let count_at = w.stream_position()?;
        w.write_all(&0u32.to_le_bytes())?;
        Ok(Writer { w, count_at, count: 0 })
    }

    /// Adds snapshot `name`, its bytes written by `fill` into the file,
    /// which returns how many it wrote.
    pub fn add<E>(&mut self, name: &str, fill: impl FnOnce(&mut W) -> Result<u64, E>) -> Result<u64, E>
    where
        E: From<io::Error>,
    {
        if !rgpu_protocol::auth::valid_snapshot_name(name) || self.count >= MAX_SNAPSHOTS {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{name:?} cannot be kept in a lease file")).into());
        }
        self.w.write_all(&(name.len() as u16).to_le_bytes())?;
        self.w.write_all(name.as_bytes())?;
        let size_at = self.w.stream_position()?;
        self.w.write_all(&0u64.to_le_bytes())?;
        let n = fill(&mut self.w)?;
        let end = self.w.stream_position()?;
        if end - size_at - 8 != n {
            return Err(io::Error::other(format!("{name}: {n} bytes reported, {} written", end - size_at - 8)).into());
        }
        self.w.seek(SeekFrom::Start(size_at))?;
        self.w.write_all(&n.to_le_bytes())?;
        self.w.seek(SeekFrom::Start(end))?;
        self.count += 1;
        Ok(n)
    }

    /// Writes the count; returns the file.
    pub fn finish(mut self) -> io::Result<W> {
        let end = self.w.stream_position()?;
        self.w.seek(SeekFrom::Start(self.count_at))?;
        self.w.write_all(&self.count.to_le_bytes())?;
        self.w.seek(SeekFrom::Start(end))?;
        Ok(self.w)
    }
}

fn read_n<const N: usize>(r: &mut impl Read) -> Result<[u8; N], LeaseFileError> {
    let mut b = [0u8; N];
    r.read_exact(&mut b).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => LeaseFileError::Damaged("it ends early".into()),
        _ => LeaseFileError::Io(e),
    })?;
    Ok(b)
}

fn text(r: &mut impl Read, max: usize, what: &str) -> Result<String, LeaseFileError> {
    let len = u16::from_le_bytes(read_n(r)?) as usize;
    if len > max {
        return Err(LeaseFileError::Damaged(format!("a {what} of {len} bytes")));
    }
    let mut b = vec![0u8; len];
    r.read_exact(&mut b).map_err(|_| LeaseFileError::Damaged("it ends early".into()))?;
    String::from_utf8(b).map_err(|_| LeaseFileError::Damaged(format!("a {what} that is not UTF-8")))
}

/// Reads the header; `len` is the whole file's, to check sizes against.
pub fn read_header(r: &mut impl Read) -> Result<Header, LeaseFileError> {
    if &read_n::<8>(r)? != MAGIC {
        return Err(LeaseFileError::NotOne);
    }
    let lease = u64::from_le_bytes(read_n(r)?);
    let server = text(r, MAX_SERVER, "server address")?;
    let count = u32::from_le_bytes(read_n(r)?);
    if count > MAX_SNAPSHOTS {
        return Err(LeaseFileError::Damaged(format!("{count} snapshots, more than {MAX_SNAPSHOTS}")));
    }
    Ok(Header { lease, server, count })
}

/// The next snapshot's name and size; its bytes follow in `r`. `left`: the
/// bytes the file has after this point, so a size past its end is refused
/// before anything is sent.
pub fn read_entry(r: &mut impl Read, left: u64) -> Result<(String, u64), LeaseFileError> {
    let name = text(r, 255, "snapshot name")?;
    if !rgpu_protocol::auth::valid_snapshot_name(&name) {
        return Err(LeaseFileError::Damaged(format!("{name:?} is not a snapshot name")));
    }
    let size = u64::from_le_bytes(read_n(r)?);
    let used = 2 + name.len() as u64 + 8;
    if size > left.saturating_sub(used) {
        return Err(LeaseFileError::Damaged(format!("{name} says {size} bytes, more than the file holds")));
    }
    Ok((name, size))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn file(snaps: &[(&str, &[u8])]) -> Vec<u8> {
        let mut w = Writer::new(Cursor::new(Vec::new()), 0x1234, "127.0.0.1:7767").unwrap();
        for (name, bytes) in snaps {
            let n = w
                .add(name, |f| -> io::Result<u64> {
                    f.write_all(bytes)?;
                    Ok(bytes.len() as u64)
                })
                .unwrap();
            assert_eq!(n, bytes.len() as u64);
        }
        w.finish().unwrap().into_inner()
    }

    fn read_all(b: &[u8]) -> Result<(Header, Vec<(String, Vec<u8>)>), LeaseFileError> {
        let mut r = Cursor::new(b);
        let h = read_header(&mut r)?;
        let mut out = Vec::new();
        for _ in 0..h.count {
            let left = b.len() as u64 - r.position();
            let (name, size) = read_entry(&mut r, left)?;
            let mut bytes = vec![0u8; size as usize];
            r.read_exact(&mut bytes)?;
            out.push((name, bytes));
        }
        Ok((h, out))
    }

    #[test]
    fn snapshots_come_back_as_they_went_in() {
        let b = file(&[("preempt-a-1", b"first"), ("preempt-a-2", b""), ("preempt-a-3", &[7u8; 70_000])]);
        let (h, snaps) = read_all(&b).unwrap();
        assert_eq!(h, Header { lease: 0x1234, server: "127.0.0.1:7767".into(), count: 3 });
        assert_eq!(snaps[0], ("preempt-a-1".to_string(), b"first".to_vec()));
        assert_eq!(snaps[1].1.len(), 0);
        assert_eq!(snaps[2].1, vec![7u8; 70_000]);
    }

    #[test]
    fn damaged_files_are_refused_never_read_past() {
        let b = file(&[("preempt-a-1", b"first"), ("preempt-a-2", b"second")]);
        assert!(matches!(read_all(b"RGPUSNP1........"), Err(LeaseFileError::NotOne)));
        // Cut anywhere: an error, never a panic or a short snapshot taken whole.
        for cut in 0..b.len() {
            assert!(read_all(&b[..cut]).is_err(), "cut at {cut}");
        }
        // A size past the end, a count past the bound, a path for a name.
        let size_at = 8 + 8 + 2 + 14 + 4 + 2 + 11;
        let mut big = b.clone();
        big[size_at..size_at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(read_all(&big), Err(LeaseFileError::Damaged(m)) if m.contains("more than the file holds")));
        let mut many = b.clone();
        many[32..36].copy_from_slice(&(MAX_SNAPSHOTS + 1).to_le_bytes());
        assert!(matches!(read_all(&many), Err(LeaseFileError::Damaged(_))));
        let mut path = b.clone();
        path[38..49].copy_from_slice(b"../admin.ke");
        assert!(matches!(read_all(&path), Err(LeaseFileError::Damaged(m)) if m.contains("not a snapshot name")));
    }

    #[test]
    fn a_name_that_is_a_path_is_never_written() {
        let mut w = Writer::new(Cursor::new(Vec::new()), 1, "s").unwrap();
        let r = w.add("../x", |_| -> io::Result<u64> { Ok(0) });
        assert!(r.is_err());
    }
}
