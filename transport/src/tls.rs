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

use crate::tcp::{eof, libc_msg_nosignal, poll_read};

/// Ciphertext rustls may hold unsent before a send writes it out: the
/// shim's batch size, larger than rustls' 64 KiB default so that a bulk
/// copy leaves in few large writes (1 MiB measured no faster).
const SEND_LIMIT: usize = 256 << 10;

pub(crate) struct Tls {
    /// Shared with a [`Sealer`] only: the lock is never contended on the
    /// hot path (an uncontended lock per send or read).
    conn: Arc<Mutex<rustls::Connection>>,
    /// Decrypted bytes not yet handed out.
    plain: usize,
}

fn lock(conn: &Mutex<rustls::Connection>) -> MutexGuard<'_, rustls::Connection> {
    conn.lock().unwrap_or_else(|p| p.into_inner())
}

/// Sends on a TLS connection from another thread while its owner is not
/// sending: the GPU server's keepalives, written while the session thread
/// runs a long request. Bytes written raw on the socket would break the
/// TLS stream; these are sealed in the connection's record sequence.
#[derive(Clone)]
pub struct Sealer {
    conn: Arc<Mutex<rustls::Connection>>,
}

impl Sealer {
    /// Seals `bytes` and writes them on `stream` (the connection's socket,
    /// or a clone of it). The caller makes sure frames do not interleave
    /// with the owner's.
    pub fn send(&self, stream: &TcpStream, bytes: &[u8]) -> io::Result<()> {
        let mut conn = lock(&self.conn);
        conn.writer().write_all(bytes)?;
        flush(&mut conn, stream)
    }
}

impl Tls {
    pub(crate) fn new(mut conn: rustls::Connection) -> Tls {
        conn.set_buffer_limit(Some(SEND_LIMIT));
        // Records read with the handshake (the server's reader may have
        // taken more than the preamble) are decrypted now, so that
        // `plaintext` counts them.
        let plain = conn.process_new_packets().map(|s| s.plaintext_bytes_to_read()).unwrap_or(0);
        Tls { conn: Arc::new(Mutex::new(conn)), plain }
    }

    pub(crate) fn sealer(&self) -> Sealer {
        Sealer { conn: Arc::clone(&self.conn) }
    }

    pub(crate) fn plaintext(&self) -> usize {
        self.plain
    }

    pub(crate) fn send(&mut self, stream: &TcpStream, bufs: &[&[u8]]) -> io::Result<()> {
        let mut conn = lock(&self.conn);
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
                flush(&mut conn, stream)?;
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
        flush(&mut conn, stream)
    }

    pub(crate) fn recv_exact(&mut self, raw: &mut Raw<'_>, buf: &mut [u8]) -> io::Result<()> {
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
            let state = conn
                .process_new_packets()
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("TLS from {}: {e}", raw.peer)))?;
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
    use crate::tcp::TcpTransport;
    use crate::Transport;

    /// A TLS pair over loopback.
    fn pair() -> (TcpTransport, TcpTransport) {
        let ((cs, cc), (ss, sc)) = rgpu_tls::testing::loopback_pair();
        (TcpTransport::with_tls(cs, cc).unwrap(), TcpTransport::with_tls(ss, sc).unwrap())
    }

    #[test]
    fn batches_of_every_size_arrive_exactly_under_tls() {
        let (mut c, mut s) = pair();
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
        assert!(body == big, "bulk differs");
        assert_eq!(&tail, b"end");
        assert_eq!(&back[..24], &[1u8; 24]);
        assert_eq!(&back[24..27], b"end");
        assert_eq!(&back[27..], &big[..100]);
    }

    fn big_len() -> usize {
        (3 << 20) + 17
    }

    #[test]
    fn a_closed_peer_is_an_error_under_tls() {
        let (mut c, s) = pair();
        drop(s);
        let mut b = [0u8; 4];
        assert!(c.recv_exact(&mut b).is_err());
    }
}

