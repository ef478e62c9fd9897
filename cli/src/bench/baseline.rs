//! The raw-TCP baseline: a peer thread in this process that does nothing
//! but move bytes. Each exchange is a 16-byte command (bytes that follow,
//! bytes to answer), the upload, and the answer if one is asked for: the
//! least any remoting of the same pattern over the same network can cost.

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub struct RawPeer {
    stream: TcpStream,
    out: Vec<u8>,
    peer: Option<JoinHandle<()>>,
}

/// Both ends of the baseline poll before they block exactly as rgpu's
/// transport does (same RGPU_SPIN_US), so the comparison is of the same
/// technique, not of polling against sleeping.
fn spin() -> Duration {
    rgpu_transport::tcp::spin_from_env()
}

/// `read_exact`, polling first for up to `spin` per read.
fn read_exact_polling(s: &mut TcpStream, mut buf: &mut [u8], spin: Duration) -> io::Result<()> {
    while !buf.is_empty() {
        let n = read_polling(s, buf, spin)?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        buf = &mut buf[n..];
    }
    Ok(())
}

fn read_polling(s: &mut TcpStream, buf: &mut [u8], spin: Duration) -> io::Result<usize> {
    if !spin.is_zero() {
        s.set_nonblocking(true)?;
        let start = Instant::now();
        let r = loop {
            match s.read(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && start.elapsed() < spin => std::hint::spin_loop(),
                other => break other,
            }
        };
        s.set_nonblocking(false)?;
        match r {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            other => return other,
        }
    }
    s.read(buf)
}

/// Uploads larger than this are sent with writev from the caller's buffer.
const INLINE: usize = 64 << 10;

impl RawPeer {
    pub fn start() -> io::Result<RawPeer> {
        let l = TcpListener::bind("127.0.0.1:0")?;
        let addr = l.local_addr()?;
        let peer = std::thread::spawn(move || {
            if let Ok((s, _)) = l.accept() {
                let _ = serve(s);
            }
        });
        let stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        Ok(RawPeer { stream, out: Vec::with_capacity(INLINE * 2), peer: Some(peer) })
    }

    /// Sends `upload`; then, if `answer` is not empty, waits for that many bytes.
    pub fn exchange(&mut self, upload: &[u8], answer: &mut [u8]) -> io::Result<()> {
        self.out.clear();
        self.out.extend_from_slice(&(upload.len() as u64).to_le_bytes());
        self.out.extend_from_slice(&(answer.len() as u64).to_le_bytes());
        if upload.len() <= INLINE {
            self.out.extend_from_slice(upload);
            self.stream.write_all(&self.out)?;
        } else {
            let mut bufs = [IoSlice::new(&self.out), IoSlice::new(upload)];
            let mut bufs = &mut bufs[..];
            while !bufs.is_empty() {
                let n = self.stream.write_vectored(bufs)?;
                IoSlice::advance_slices(&mut bufs, n);
            }
        }
        if !answer.is_empty() {
            read_exact_polling(&mut self.stream, answer, spin())?;
        }
        Ok(())
    }
}

impl Drop for RawPeer {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Both);
        if let Some(p) = self.peer.take() {
            let _ = p.join();
        }
    }
}

/// A socket whose reads poll before blocking, like rgpu's transport.
struct Polling(TcpStream, Duration);

impl Read for Polling {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        read_polling(&mut self.0, buf, self.1)
    }
}

fn serve(s: TcpStream) -> io::Result<()> {
    s.set_nodelay(true)?;
    // Buffered like rgpu's server, so a small exchange costs one read.
    let mut w = s.try_clone()?;
    let mut s = io::BufReader::with_capacity(256 << 10, Polling(s, spin()));
    // Like a GPU server, the peer keeps what it receives: bytes land in a
    // buffer as large as the transfer (grown as needed, then reused), and
    // answers are sent from one as large, rather than from a small buffer
    // that stays in cache.
    let mut sink: Vec<u8> = Vec::new();
    let mut source: Vec<u8> = Vec::new();
    let mut cmd = [0u8; 16];
    loop {
        if s.read_exact(&mut cmd).is_err() {
            return Ok(());
        }
        let up = u64::from_le_bytes(cmd[..8].try_into().unwrap()) as usize;
        let down = u64::from_le_bytes(cmd[8..].try_into().unwrap()) as usize;
        if sink.len() < up {
            sink.resize(up, 0);
        }
        s.read_exact(&mut sink[..up])?;
        if source.len() < down {
            source.resize(down, 7);
        }
        w.write_all(&source[..down])?;
    }
}
