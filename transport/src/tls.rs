//! TLS inside [`crate::tcp::TcpTransport`]: the frames a session sends and
//! receives are sealed into TLS records by rustls on the same socket, with
//! the same one-batch-per-send and the same polling reads. Kept inside the
//! TCP transport so that nothing above it (the session, the shim's
//! connection, the RDMA upgrade's side channel) changes with TLS.

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use socket2::SockRef;

use crate::records::{self, Dir, Half, Keys, HEADER, MAX_RECORD, TAG};
use crate::tcp::{eof, libc_msg_nosignal, poll_read};

/// Ciphertext rustls may hold unsent before a send writes it out: the
/// shim's batch size, larger than rustls' 64 KiB default so that a bulk
/// copy leaves in few large writes (1 MiB measured no faster).
const SEND_LIMIT: usize = 256 << 10;

pub(crate) enum Tls {
    /// rustls seals and opens every record: the peer did not negotiate
    /// rgpu's records (an older peer).
    Rustls(RustlsMode),
    /// rgpu's records (`records.rs`), keyed from the handshake.
    Records(Box<RecordsMode>),
}

pub(crate) struct RustlsMode {
    /// Shared with a [`Sealer`] only: the lock is never contended on the
    /// hot path (an uncontended lock per send or read).
    conn: Arc<Mutex<rustls::Connection>>,
    /// Decrypted bytes not yet handed out.
    plain: usize,
}

pub(crate) struct RecordsMode {
    tx: Arc<Mutex<RecordTx>>,
    rx: Half,
    /// Opened plaintext in the transport's read buffer, not yet handed out
    /// (always before the unread ciphertext).
    plain: std::ops::Range<usize>,
    /// A client still sending its opening through rustls (until it has
    /// heard from the server): see [`Tls::new`].
    opening: bool,
    /// A read failed part-way (a record forged, the peer gone, a timeout):
    /// the stream's place in the record sequence is lost, so every later
    /// read fails too.
    failed: bool,
}

struct RecordTx {
    half: Half,
    /// Sealed records waiting for one write.
    out: Vec<u8>,
    /// A client's rustls connection, for the opening it sends before the
    /// server's first answer; `None` once that answer came (or on a server).
    opening: Option<rustls::Connection>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn invalid(peer: &str, e: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("TLS from {peer}: {e}"))
}

/// Sends on a TLS connection from another thread while its owner is not
/// sending: the GPU server's keepalives, written while the session thread
/// runs a long request. Bytes written raw on the socket would break the
/// TLS stream; these are sealed in the connection's record sequence.
#[derive(Clone)]
pub struct Sealer {
    inner: SealerInner,
}

#[derive(Clone)]
enum SealerInner {
    Rustls(Arc<Mutex<rustls::Connection>>),
    Records(Arc<Mutex<RecordTx>>),
}

impl Sealer {
    /// Seals `bytes` and writes them on `stream` (the connection's socket,
    /// or a clone of it). The caller makes sure frames do not interleave
    /// with the owner's.
    pub fn send(&self, stream: &TcpStream, bytes: &[u8]) -> io::Result<()> {
        match &self.inner {
            SealerInner::Rustls(conn) => {
                let mut conn = lock(conn);
                conn.writer().write_all(bytes)?;
                flush(&mut conn, stream)
            }
            SealerInner::Records(tx) => lock(tx).send(stream, &[bytes]),
        }
    }
}

impl Tls {
    /// Over a connection whose handshake is done. Where both ends
    /// negotiated [`records::ALPN`], rgpu's records take over: on a server
    /// at once (its listener has read the client's opening, the preamble
    /// and credentials, through rustls, and nothing else may have come); on
    /// a client after its opening: what it sends before it first hears
    /// from the server still goes through rustls, since the server reads
    /// that before it knows which plane the connection is.
    pub(crate) fn new(mut conn: rustls::Connection, peer: &str) -> io::Result<Tls> {
        // Records read with the handshake (the server's reader may have
        // taken more than the preamble) are decrypted now, so that
        // `plaintext` counts them.
        let plain = conn.process_new_packets().map(|s| s.plaintext_bytes_to_read()).unwrap_or(0);
        if conn.alpn_protocol() != Some(records::ALPN) {
            conn.set_buffer_limit(Some(SEND_LIMIT));
            return Ok(Tls::Rustls(RustlsMode { conn: Arc::new(Mutex::new(conn)), plain }));
        }
        if plain > 0 {
            return Err(invalid(peer, format!("{plain} bytes came ahead of the server's answer")));
        }
        let keys = Keys::from_connection(&conn).map_err(|e| invalid(peer, e))?;
        let client = matches!(conn, rustls::Connection::Client(_));
        let (tx_dir, rx_dir) = if client {
            (Dir::ClientToServer, Dir::ServerToClient)
        } else {
            (Dir::ServerToClient, Dir::ClientToServer)
        };
        let tx = RecordTx {
            half: keys.half(tx_dir).map_err(|e| invalid(peer, e))?,
            out: Vec::new(),
            opening: client.then_some(conn),
        };
        Ok(Tls::Records(Box::new(RecordsMode {
            tx: Arc::new(Mutex::new(tx)),
            rx: keys.half(rx_dir).map_err(|e| invalid(peer, e))?,
            plain: 0..0,
            opening: client,
            failed: false,
        })))
    }

    pub(crate) fn is_records(&self) -> bool {
        matches!(self, Tls::Records(_))
    }

    pub(crate) fn sealer(&self) -> Sealer {
        let inner = match self {
            Tls::Rustls(m) => SealerInner::Rustls(Arc::clone(&m.conn)),
            Tls::Records(m) => SealerInner::Records(Arc::clone(&m.tx)),
        };
        Sealer { inner }
    }

    pub(crate) fn plaintext(&self) -> usize {
        match self {
            Tls::Rustls(m) => m.plain,
            Tls::Records(m) => m.plain.len(),
        }
    }

    pub(crate) fn send(&mut self, stream: &TcpStream, bufs: &[&[u8]]) -> io::Result<()> {
        match self {
            Tls::Rustls(m) => m.send(stream, bufs),
            Tls::Records(m) => lock(&m.tx).send(stream, bufs),
        }
    }

    pub(crate) fn recv_exact(&mut self, raw: &mut Raw<'_>, buf: &mut [u8]) -> io::Result<()> {
        match self {
            Tls::Rustls(m) => m.recv_exact(raw, buf),
            Tls::Records(m) => m.recv_exact(raw, buf),
        }
    }
}

impl RecordTx {
    fn send(&mut self, stream: &TcpStream, bufs: &[&[u8]]) -> io::Result<()> {
        if let Some(conn) = &mut self.opening {
            return rustls_send(conn, stream, bufs);
        }
        self.out.clear();
        let mut pieces = bufs.iter().copied().filter(|b| !b.is_empty());
        let mut cur: &[u8] = pieces.next().unwrap_or(&[]);
        // A record gathers up to MAX_RECORD bytes across the batch's
        // pieces: a small frame and its payload go in one record.
        let mut gather: [&[u8]; 8] = [&[]; 8];
        while !cur.is_empty() {
            let (mut n, mut len) = (0, 0);
            while !cur.is_empty() && len < MAX_RECORD && n < gather.len() {
                let take = cur.len().min(MAX_RECORD - len);
                gather[n] = &cur[..take];
                n += 1;
                len += take;
                cur = &cur[take..];
                if cur.is_empty() {
                    cur = pieces.next().unwrap_or(&[]);
                }
            }
            self.half.seal(&mut self.out, &gather[..n]).map_err(io::Error::other)?;
            if self.out.len() >= SEND_LIMIT {
                write_all(stream, &self.out)?;
                self.out.clear();
            }
        }
        if !self.out.is_empty() {
            write_all(stream, &self.out)?;
        }
        if self.out.capacity() > 2 * SEND_LIMIT {
            self.out = Vec::new();
        }
        Ok(())
    }
}

impl RecordsMode {
    fn recv_exact(&mut self, raw: &mut Raw<'_>, dst: &mut [u8]) -> io::Result<()> {
        if self.failed {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, format!("the connection to {} failed earlier", raw.peer)));
        }
        let r = self.recv_records(raw, dst);
        if r.is_err() {
            self.failed = true;
            self.plain = 0..0;
        }
        r
    }

    fn recv_records(&mut self, raw: &mut Raw<'_>, dst: &mut [u8]) -> io::Result<()> {
        let mut done = 0;
        while done < dst.len() {
            if !self.plain.is_empty() {
                let n = self.plain.len().min(dst.len() - done);
                dst[done..done + n].copy_from_slice(&raw.buf[self.plain.start..self.plain.start + n]);
                self.plain.start += n;
                done += n;
                continue;
            }
            raw.fill(HEADER)?;
            let header: [u8; HEADER] = raw.buf[*raw.pos..*raw.pos + HEADER].try_into().unwrap_or_default();
            let len = records::record_len(header).map_err(|e| invalid(raw.peer, e))?;
            if dst.len() - done >= len {
                // The whole record is wanted: its ciphertext goes straight
                // into the destination and is opened there.
                *raw.pos += HEADER;
                let body = &mut dst[done..done + len];
                let have = (*raw.end - *raw.pos).min(len);
                body[..have].copy_from_slice(&raw.buf[*raw.pos..*raw.pos + have]);
                *raw.pos += have;
                raw.read_into(&mut body[have..])?;
                raw.fill(TAG)?;
                let tag: [u8; TAG] = raw.buf[*raw.pos..*raw.pos + TAG].try_into().unwrap_or_default();
                *raw.pos += TAG;
                self.rx.open(header, body, tag).map_err(|e| invalid(raw.peer, e))?;
                done += len;
            } else {
                raw.fill(HEADER + len + TAG)?;
                let start = *raw.pos + HEADER;
                let tag: [u8; TAG] = raw.buf[start + len..start + len + TAG].try_into().unwrap_or_default();
                self.rx.open(header, &mut raw.buf[start..start + len], tag).map_err(|e| invalid(raw.peer, e))?;
                self.plain = start..start + len;
                *raw.pos = start + len + TAG;
            }
        }
        if self.opening && done > 0 {
            // The server has answered: the opening is over.
            lock(&self.tx).opening = None;
            self.opening = false;
        }
        Ok(())
    }
}

impl RustlsMode {
    fn send(&mut self, stream: &TcpStream, bufs: &[&[u8]]) -> io::Result<()> {
        rustls_send(&mut lock(&self.conn), stream, bufs)
    }

    fn recv_exact(&mut self, raw: &mut Raw<'_>, buf: &mut [u8]) -> io::Result<()> {
        let mut conn = lock(&self.conn);
        let mut done = 0;
        while done < buf.len() {
            if self.plain > 0 {
                let n = conn.reader().read(&mut buf[done..])?;
                if n == 0 {
                    return Err(eof(raw.peer));
                }
                self.plain = self.plain.saturating_sub(n);
                done += n;
                continue;
            }
            match conn.read_tls(raw) {
                Ok(0) => return Err(eof(raw.peer)),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            let state = conn.process_new_packets().map_err(|e| invalid(raw.peer, e))?;
            self.plain = state.plaintext_bytes_to_read();
            if self.plain == 0 && state.peer_has_closed() {
                return Err(eof(raw.peer));
            }
            if conn.wants_write() {
                // An alert or a key update to answer.
                flush(&mut conn, raw.stream)?;
            }
        }
        Ok(())
    }
}

fn rustls_send(conn: &mut rustls::Connection, stream: &TcpStream, bufs: &[&[u8]]) -> io::Result<()> {
    let (mut idx, mut off) = (0, 0);
    let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(bufs.len());
    loop {
        while idx < bufs.len() && off >= bufs[idx].len() {
            idx += 1;
            off = 0;
        }
        if idx == bufs.len() {
            break;
        }
        iov.clear();
        iov.push(IoSlice::new(&bufs[idx][off..]));
        iov.extend(bufs[idx + 1..].iter().filter(|b| !b.is_empty()).map(|b| IoSlice::new(b)));
        let mut n = conn.writer().write_vectored(&iov)?;
        if n == 0 {
            // The send buffer is full: write it out, then go on.
            flush(conn, stream)?;
            continue;
        }
        while n > 0 {
            let left = bufs[idx].len() - off;
            if n < left {
                off += n;
                n = 0;
            } else {
                n -= left;
                idx += 1;
                off = 0;
            }
        }
    }
    flush(conn, stream)
}

fn write_all(stream: &TcpStream, mut bytes: &[u8]) -> io::Result<()> {
    let mut sock = Sock(stream);
    while !bytes.is_empty() {
        match sock.write(bytes) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "connection closed while sending")),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn flush(conn: &mut rustls::Connection, stream: &TcpStream) -> io::Result<()> {
    let mut sock = Sock(stream);
    while conn.wants_write() {
        match conn.write_tls(&mut sock) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "connection closed while sending")),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The socket's read side through the transport's buffer: rustls reads
/// 4 KiB at a time, the socket is read up to the buffer's size.
pub(crate) struct Raw<'a> {
    pub(crate) stream: &'a TcpStream,
    pub(crate) buf: &'a mut [u8],
    pub(crate) pos: &'a mut usize,
    pub(crate) end: &'a mut usize,
    pub(crate) spin: Duration,
    pub(crate) peer: &'a str,
}

impl Raw<'_> {
    /// Makes at least `n` unread bytes (at most the buffer's size) sit in
    /// the buffer, moving what is unread to its start if they would not
    /// fit. Only called with no opened plaintext left in the buffer.
    fn fill(&mut self, n: usize) -> io::Result<()> {
        if *self.end - *self.pos >= n {
            return Ok(());
        }
        if *self.pos + n > self.buf.len() {
            self.buf.copy_within(*self.pos..*self.end, 0);
            *self.end -= *self.pos;
            *self.pos = 0;
        }
        while *self.end - *self.pos < n {
            let free = &mut self.buf[*self.end..];
            let got = match poll_read(self.stream, free, self.spin) {
                Some(r) => r,
                None => (&*self.stream).read(free),
            };
            match got {
                Ok(0) => return Err(eof(self.peer)),
                Ok(k) => *self.end += k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Reads exactly `out.len()` bytes from the socket into `out`, past the
    /// buffer (called once the buffer holds nothing unread).
    fn read_into(&mut self, out: &mut [u8]) -> io::Result<()> {
        let mut done = 0;
        while done < out.len() {
            let got = match poll_read(self.stream, &mut out[done..], self.spin) {
                Some(r) => r,
                None => (&*self.stream).read(&mut out[done..]),
            };
            match got {
                Ok(0) => return Err(eof(self.peer)),
                Ok(k) => done += k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

impl Read for Raw<'_> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if *self.pos == *self.end {
            let n = match poll_read(self.stream, self.buf, self.spin) {
                Some(r) => r?,
                None => (&*self.stream).read(self.buf)?,
            };
            *self.pos = 0;
            *self.end = n;
            if n == 0 {
                return Ok(0);
            }
        }
        let n = out.len().min(*self.end - *self.pos);
        out[..n].copy_from_slice(&self.buf[*self.pos..*self.pos + n]);
        *self.pos += n;
        Ok(n)
    }
}

/// Writes with MSG_NOSIGNAL, as the plaintext path does: a peer that went
/// away is an error, never a SIGPIPE in the user's program.
struct Sock<'a>(&'a TcpStream);

impl Write for Sock<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        SockRef::from(self.0).send_vectored_with_flags(bufs, libc_msg_nosignal())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use crate::tcp::TcpTransport;
    use crate::Transport;

    /// A TLS pair over loopback, opened as the data plane opens one: the
    /// client's first bytes go through rustls and the server reads them so
    /// (its listener does, before it knows the plane), then the server
    /// answers. `records`: the client offers rgpu's records.
    pub(crate) fn pair_with(records: bool) -> (TcpTransport, TcpTransport) {
        let ((cs, cc), (mut ss, mut sc)) = rgpu_tls::testing::loopback_pair_with(records);
        let mut c = TcpTransport::with_tls(cs, cc).unwrap();
        c.send(&[b"RGPUTEST", b"+creds"]).unwrap();
        let mut opening = [0u8; 14];
        rustls_read(&mut sc, &mut ss, &mut opening);
        assert_eq!(&opening, b"RGPUTEST+creds");
        let mut s = TcpTransport::with_tls(ss, sc).unwrap();
        // A bug that loses the stream's place must fail a test, not hang it.
        for t in [&c, &s] {
            t.stream().set_read_timeout(Some(std::time::Duration::from_secs(20))).unwrap();
        }
        assert_eq!(c.has_own_records(), records);
        assert_eq!(s.has_own_records(), records);
        s.send(&[b"ok"]).unwrap();
        let mut answer = [0u8; 2];
        c.recv_exact(&mut answer).unwrap();
        assert_eq!(&answer, b"ok");
        (c, s)
    }

    fn pair() -> (TcpTransport, TcpTransport) {
        pair_with(true)
    }

    /// Reads through rustls itself, as the server's listener does.
    fn rustls_read(conn: &mut rustls::Connection, sock: &mut std::net::TcpStream, buf: &mut [u8]) {
        let mut done = 0;
        while done < buf.len() {
            match conn.reader().read(&mut buf[done..]) {
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    conn.read_tls(sock).unwrap();
                    conn.process_new_packets().unwrap();
                }
                Err(e) => panic!("{e}"),
            }
        }
    }

    fn rustls_write(conn: &mut rustls::Connection, sock: &mut std::net::TcpStream, bytes: &[u8]) {
        std::io::Write::write_all(&mut conn.writer(), bytes).unwrap();
        while conn.wants_write() {
            conn.write_tls(sock).unwrap();
        }
    }

    #[test]
    fn the_alpn_names_agree() {
        assert_eq!(crate::records::ALPN, rgpu_tls::DATA_RECORDS_ALPN);
    }

    #[test]
    fn batches_of_every_size_arrive_exactly_under_tls() {
        for records in [true, false] {
            let (mut c, mut s) = pair_with(records);
            assert!(c.is_tls() && s.is_tls());
            let big: Vec<u8> = (0..(3u32 << 20) + 17).map(|i| (i * 7 + (i >> 11)) as u8).collect();
            let t = std::thread::spawn(move || {
                let mut hdr = [0u8; 24];
                s.recv_exact(&mut hdr).unwrap();
                let mut body = vec![0u8; big_len()];
                s.recv_exact(&mut body).unwrap();
                let mut tail = [0u8; 3];
                s.recv_exact(&mut tail).unwrap();
                s.send(&[&hdr, &tail, &body[..100]]).unwrap();
                (hdr, body, tail)
            });
            c.send(&[&[1u8; 24], &big, b"end"]).unwrap();
            let mut back = [0u8; 127];
            c.recv_exact(&mut back).unwrap();
            let (hdr, body, tail) = t.join().unwrap();
            assert_eq!(hdr, [1u8; 24]);
            assert!(body == big, "bulk differs (records: {records})");
            assert_eq!(&tail, b"end");
            assert_eq!(&back[..24], &[1u8; 24]);
            assert_eq!(&back[24..27], b"end");
            assert_eq!(&back[27..], &big[..100]);
        }
    }

    fn big_len() -> usize {
        (3 << 20) + 17
    }

    /// Reads of every size against sends of every size: records split
    /// across reads, reads spanning records, whole records straight into
    /// the destination.
    #[test]
    fn reads_and_records_of_unrelated_sizes_reassemble_exactly() {
        let (mut c, mut s) = pair();
        let data: Vec<u8> = (0..1_500_000u32).map(|i| (i % 251) as u8 ^ (i >> 9) as u8).collect();
        let sends = [1usize, 7, 24, 4096, 65_535, 65_536, 65_537, 200_000, 3, 1 << 20];
        let reads = [5usize, 24, 65_536, 1, 100_000, 65_540, 7, 300_000, 13];
        let total: usize = sends.iter().sum::<usize>().min(data.len());
        let expect = data[..total].to_vec();
        let t = std::thread::spawn(move || {
            let mut got = Vec::with_capacity(total);
            let mut i = 0;
            while got.len() < total {
                let n = reads[i % reads.len()].min(total - got.len());
                let mut buf = vec![0u8; n];
                s.recv_exact(&mut buf).unwrap();
                got.extend_from_slice(&buf);
                i += 1;
            }
            got
        });
        let mut off = 0;
        for n in sends {
            let n = n.min(total - off);
            // Split each send in two pieces so records gather across them.
            let mid = off + n / 3;
            c.send(&[&data[off..mid], &data[mid..off + n]]).unwrap();
            off += n;
        }
        assert!(t.join().unwrap() == expect, "reassembled stream differs");
    }

    /// Random send and read sizes over many seeds (a fixed generator, so a
    /// failure repeats): whatever the cuts, the stream comes out as sent.
    #[test]
    fn random_sends_and_reads_reassemble_exactly() {
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..12 {
            let (mut c, mut s) = pair();
            let total = 1 + (next() % (3 << 20)) as usize;
            let data: Vec<u8> = (0..total).map(|_| next() as u8).collect();
            let mut sizes = |max: u64| {
                let mut v = Vec::new();
                let mut left = total;
                while left > 0 {
                    // Mostly small, sometimes up to `max`.
                    let n = if next() % 4 == 0 { next() % max } else { next() % 300 } as usize + 1;
                    let n = n.min(left);
                    v.push(n);
                    left -= n;
                }
                v
            };
            let (sends, reads) = (sizes(1 << 20), sizes(400_000));
            let expect = data.clone();
            let t = std::thread::spawn(move || {
                let mut got = Vec::with_capacity(total);
                for n in reads {
                    let mut buf = vec![0u8; n];
                    s.recv_exact(&mut buf).unwrap();
                    got.extend_from_slice(&buf);
                }
                got
            });
            let mut off = 0;
            for n in sends {
                let mid = off + n / 2;
                c.send(&[&data[off..mid], &data[mid..off + n]]).unwrap();
                off += n;
            }
            assert!(t.join().unwrap() == expect, "{total} bytes reassembled differently");
        }
    }

    /// A sealer on another thread (the server's keepalives) shares the
    /// sequence: its records and the owner's open in order.
    #[test]
    fn a_sealer_on_another_thread_keeps_the_sequence() {
        let (mut c, s) = pair();
        let sealer = s.sealer().unwrap();
        let sock = s.stream().try_clone().unwrap();
        std::thread::spawn(move || sealer.send(&sock, b"keepalive")).join().unwrap().unwrap();
        let mut s = s;
        s.send(&[b"reply"]).unwrap();
        let mut got = [0u8; 14];
        c.recv_exact(&mut got).unwrap();
        assert_eq!(&got, b"keepalivereply");
    }

    /// A byte changed on the wire ends the connection with an error: the
    /// reader never sees altered data as data.
    #[test]
    fn a_record_altered_on_the_wire_is_an_error_not_data() {
        let (c, mut s) = pair();
        let raw = c.into_stream().unwrap();
        // Hand-made: a well-formed header and garbage body and tag.
        let mut forged = 64u32.to_le_bytes().to_vec();
        forged.extend_from_slice(&[0xAB; 64 + 16]);
        std::io::Write::write_all(&mut &raw, &forged).unwrap();
        let mut buf = [0u8; 64];
        let e = s.recv_exact(&mut buf).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
        assert!(e.to_string().contains("authentication"), "{e}");
        // And it stays failed.
        assert!(s.recv_exact(&mut buf).is_err());
        // A header announcing more than a record may hold.
        let (c, mut s) = pair();
        let raw = c.into_stream().unwrap();
        std::io::Write::write_all(&mut &raw, &u32::MAX.to_le_bytes()).unwrap();
        let e = s.recv_exact(&mut buf).unwrap_err();
        assert!(e.to_string().contains("announces"), "{e}");
    }

    /// An older client (rustls' records throughout) with data ahead of
    /// the server's answer is still served; a client that negotiated rgpu's
    /// records and does the same is refused, not misread.
    #[test]
    fn data_ahead_of_the_answer_is_refused_only_under_own_records() {
        for records in [false, true] {
            let ((mut cs, mut cc), (mut ss, mut sc)) = rgpu_tls::testing::loopback_pair_with(records);
            rustls_write(&mut cc, &mut cs, b"RGPUTEST+more");
            let mut opening = [0u8; 8];
            rustls_read(&mut sc, &mut ss, &mut opening);
            let r = TcpTransport::with_tls(ss, sc);
            if records {
                let e = r.err().expect("refused");
                assert!(e.to_string().contains("ahead of the server's answer"), "{e}");
            } else {
                let mut s = r.unwrap();
                assert_eq!(s.buffered(), 5);
                let mut more = [0u8; 5];
                s.recv_exact(&mut more).unwrap();
                assert_eq!(&more, b"+more");
            }
        }
    }

    #[test]
    fn a_closed_peer_is_an_error_under_tls() {
        for records in [true, false] {
            let (mut c, s) = pair_with(records);
            drop(s);
            let mut b = [0u8; 4];
            assert!(c.recv_exact(&mut b).is_err());
        }
    }
}
