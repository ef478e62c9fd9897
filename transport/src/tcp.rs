//! The TCP transport, in clear or under TLS (`tls.rs`: the same socket,
//! the same batching, records sealed by rustls).

use std::io::{self, IoSlice, Read};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

use socket2::{SockRef, TcpKeepalive};

use crate::Transport;

/// How long a connection may go without hearing from a silent peer before
/// it is declared dead. A crashed process is noticed at once (its kernel
/// resets the connection); this bounds the wait for a host that vanished.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(5);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
const KEEPALIVE_RETRIES: u32 = 3;
/// Unacknowledged data older than this fails the connection.
const USER_TIMEOUT: Duration = Duration::from_secs(15);
const READ_BUFFER: usize = 256 << 10;
// A record is opened whole in the read buffer when the reader wants less
// than all of it.
const _: () = assert!(READ_BUFFER >= crate::records::HEADER + crate::records::MAX_RECORD + crate::records::TAG);

pub struct TcpTransport {
    stream: TcpStream,
    peer: String,
    rbuf: Box<[u8]>,
    rpos: usize,
    rend: usize,
    /// How long a read polls before it sleeps in the kernel.
    spin: Duration,
    /// TLS over the socket, its handshake done; `rbuf` then holds
    /// ciphertext.
    tls: Option<crate::tls::Tls>,
}

/// Polling before blocking trades CPU for latency: a thread that sleeps in
/// the kernel can take tens of microseconds to wake (measured here: a 55 µs
/// loopback round trip falls to 11 µs), more than the round trip itself.
/// CUDA's own synchronisation spins by default for the same reason. A read
/// polls this long, then sleeps; [`TcpTransport::set_spin`] changes it, 0
/// turns it off.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

/// `RGPU_SPIN_US`, for programs configured by their environment (the shim,
/// `rgpu bench`); else [`DEFAULT_SPIN`]. The library never calls it itself:
/// a server takes the spin from its own settings.
pub fn spin_from_env() -> Duration {
    std::env::var("RGPU_SPIN_US").ok().and_then(|v| v.parse().ok()).map(Duration::from_micros).unwrap_or(DEFAULT_SPIN)
}

/// Connects to `addr` ("host:port"), trying each address it resolves to.
pub fn connect(addr: &str, timeout: Duration) -> io::Result<TcpTransport> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{addr} resolves to no address"));
    for sa in addr.to_socket_addrs()? {
        match TcpStream::connect_timeout(&sa, timeout) {
            Ok(s) => return TcpTransport::new(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Applies the options every rgpu TCP connection uses, on either side.
pub fn tune(stream: &TcpStream) -> io::Result<()> {
    // Small synchronous calls must not wait for Nagle's timer; batching is
    // done by the sender, one write per batch.
    stream.set_nodelay(true)?;
    let sock = SockRef::from(stream);
    let ka = TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_RETRIES);
    sock.set_tcp_keepalive(&ka)?;
    #[cfg(target_os = "linux")]
    sock.set_tcp_user_timeout(Some(USER_TIMEOUT))?;
    Ok(())
}

impl TcpTransport {
    pub fn new(stream: TcpStream) -> io::Result<Self> {
        tune(&stream)?;
        let peer = stream
            .peer_addr()
            .map(|a: SocketAddr| a.to_string())
            .unwrap_or_else(|_| "?".into());
        Ok(TcpTransport {
            stream,
            peer,
            rbuf: vec![0u8; READ_BUFFER].into_boxed_slice(),
            rpos: 0,
            rend: 0,
            spin: DEFAULT_SPIN,
            tls: None,
        })
    }

    /// A connection whose TLS handshake `conn` has completed over `stream`
    /// (what `conn` has read and not yet handed out stays with it). Where
    /// both ends negotiated rgpu's records, they seal the data from here
    /// on (a client's opening aside: see `tls.rs`).
    pub fn with_tls(stream: TcpStream, conn: rustls::Connection) -> io::Result<Self> {
        let mut t = TcpTransport::new(stream)?;
        t.tls = Some(crate::tls::Tls::new(conn, &t.peer)?);
        Ok(t)
    }

    /// Whether the connection runs rgpu's own records under TLS (both ends
    /// negotiated them), not rustls'.
    pub fn has_own_records(&self) -> bool {
        self.tls.as_ref().is_some_and(|t| t.is_records())
    }

    /// Whether the connection is under TLS.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// Under TLS, what another thread sends through instead of the raw
    /// socket (see [`crate::tls::Sealer`]); `None` in clear.
    pub fn sealer(&self) -> Option<crate::Sealer> {
        self.tls.as_ref().map(|t| t.sealer())
    }

    /// How long each read polls before it sleeps in the kernel; zero turns
    /// polling off.
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
    }

    /// Bytes already received and buffered, not yet consumed.
    pub fn buffered(&self) -> usize {
        match &self.tls {
            // Only what is decrypted: a partial record may not hold a whole
            // header, and a caller that waits for buffered input must not
            // wait on it.
            Some(t) => t.plaintext(),
            None => self.rend - self.rpos,
        }
    }

    pub fn stream(&self) -> &TcpStream {
        &self.stream
    }

    /// The socket, for a transport that takes the connection over (RDMA
    /// keeps it as its side channel; under TLS nothing is sent on it after
    /// this, it is only watched for its end). Fails if received bytes are
    /// still buffered: they would be lost.
    pub fn into_stream(self) -> io::Result<TcpStream> {
        if self.buffered() > 0 || (self.tls.is_some() && self.rend > self.rpos) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} unexpected bytes from {} before the handover", self.buffered(), self.peer),
            ));
        }
        Ok(self.stream)
    }
}

/// Polls for input into `buf` for up to `spin`; `None` when nothing came
/// (or polling is off), so the caller blocks.
pub(crate) fn poll_read(stream: &TcpStream, buf: &mut [u8], spin: Duration) -> Option<io::Result<usize>> {
    if spin.is_zero() {
        return None;
    }
    let fd = std::os::fd::AsRawFd::as_raw_fd(stream);
    let start = std::time::Instant::now();
    loop {
        // SAFETY: buf is valid for its length; MSG_DONTWAIT never blocks.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if n >= 0 {
            return Some(Ok(n as usize));
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::WouldBlock && e.kind() != io::ErrorKind::Interrupted {
            return Some(Err(e));
        }
        if start.elapsed() >= spin {
            return None;
        }
        std::hint::spin_loop();
    }
}

impl Transport for TcpTransport {
    fn send(&mut self, bufs: &[&[u8]]) -> io::Result<()> {
        if let Some(tls) = &mut self.tls {
            return tls.send(&self.stream, bufs);
        }
        let mut slices: [IoSlice<'_>; 8] = [IoSlice::new(&[]); 8];
        let mut n = 0;
        for b in bufs.iter().filter(|b| !b.is_empty()) {
            if n == slices.len() {
                // More pieces than we gather at once: send what we have.
                write_all_vectored(&mut self.stream, &mut slices[..n])?;
                n = 0;
            }
            slices[n] = IoSlice::new(b);
            n += 1;
        }
        write_all_vectored(&mut self.stream, &mut slices[..n])
    }

    fn recv_exact(&mut self, buf: &mut [u8]) -> io::Result<()> {
        if let Some(tls) = &mut self.tls {
            let mut raw = crate::tls::Raw {
                stream: &self.stream,
                buf: &mut self.rbuf,
                pos: &mut self.rpos,
                end: &mut self.rend,
                spin: self.spin,
                peer: &self.peer,
            };
            return tls.recv_exact(&mut raw, buf);
        }
        let mut done = 0;
        let have = self.rend - self.rpos;
        if have > 0 {
            let n = have.min(buf.len());
            buf[..n].copy_from_slice(&self.rbuf[self.rpos..self.rpos + n]);
            self.rpos += n;
            done = n;
        }
        while done < buf.len() {
            let want = buf.len() - done;
            if want >= self.rbuf.len() {
                // Large bulk: read straight into the destination.
                let polled = poll_read(&self.stream, &mut buf[done..], self.spin);
                match polled.unwrap_or_else(|| self.stream.read(&mut buf[done..])) {
                    Ok(0) => return Err(eof(&self.peer)),
                    Ok(n) => done += n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            } else {
                // Small reads: fill the buffer so later frames of the same
                // batch need no syscall.
                let polled = poll_read(&self.stream, &mut self.rbuf, self.spin);
                match polled.unwrap_or_else(|| self.stream.read(&mut self.rbuf)) {
                    Ok(0) => return Err(eof(&self.peer)),
                    Ok(n) => {
                        let take = n.min(want);
                        buf[done..done + take].copy_from_slice(&self.rbuf[..take]);
                        done += take;
                        self.rpos = take;
                        self.rend = n;
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    }

    fn peer(&self) -> &str {
        &self.peer
    }

    fn shutdown(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

#[cfg(target_os = "linux")]
pub(crate) fn libc_msg_nosignal() -> i32 {
    0x4000 // MSG_NOSIGNAL
}
#[cfg(not(target_os = "linux"))]
pub(crate) fn libc_msg_nosignal() -> i32 {
    0
}

pub(crate) fn eof(peer: &str) -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, format!("connection to {peer} closed"))
}

fn write_all_vectored(stream: &mut TcpStream, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
    // sendmsg with MSG_NOSIGNAL, not writev: inside a user's program a peer
    // that went away must be an error we report, never a SIGPIPE that kills
    // the program.
    let sock = SockRef::from(&*stream);
    while !bufs.is_empty() {
        match sock.send_vectored_with_flags(bufs, libc_msg_nosignal()) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "connection closed while sending")),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn sends_batches_and_receives_exactly() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let t = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut t = TcpTransport::new(s).unwrap();
            let mut small = [0u8; 3];
            t.recv_exact(&mut small).unwrap();
            let mut big = vec![0u8; 1 << 20];
            t.recv_exact(&mut big).unwrap();
            t.send(&[&small, &big[..5]]).unwrap();
            (small, big)
        });
        let mut c = connect(&addr, Duration::from_secs(5)).unwrap();
        let big: Vec<u8> = (0..1u32 << 20).map(|i| (i * 7) as u8).collect();
        c.send(&[b"abc", &big]).unwrap();
        let mut back = [0u8; 8];
        c.recv_exact(&mut back).unwrap();
        let (small, got) = t.join().unwrap();
        assert_eq!(&small, b"abc");
        assert_eq!(got, big);
        assert_eq!(&back[..3], b"abc");
        assert_eq!(&back[3..], &big[..5]);
    }

    #[test]
    fn closed_peer_is_an_error() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let t = std::thread::spawn(move || drop(l.accept().unwrap()));
        let mut c = connect(&addr, Duration::from_secs(5)).unwrap();
        t.join().unwrap();
        let mut b = [0u8; 4];
        assert!(c.recv_exact(&mut b).is_err());
    }
}
