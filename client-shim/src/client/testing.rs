//! Test support: an in-memory [`Transport`] pair, a fake server end that
//! speaks the data plane with the protocol crate, and a bound on how long a
//! test may take.

use std::collections::VecDeque;
use std::io;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rgpu_protocol::data_capnp::{reply, request};
use rgpu_protocol::frame::{FrameHeader, Kind, HEADER_LEN};
use rgpu_protocol::message::{Encoder, RecvBuf};
use rgpu_transport::Transport;

/// Runs `f` on its own thread and fails the test if it takes longer than
/// `limit`: a protocol bug here usually shows as a hang.
pub fn within<R: Send + 'static>(limit: Duration, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = mpsc::channel();
    let t = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(r) => r,
        Err(mpsc::RecvTimeoutError::Disconnected) => match t.join() {
            Err(p) => std::panic::resume_unwind(p),
            Ok(()) => unreachable!("the test thread ended without a result"),
        },
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("test still running after {limit:?}: something hangs"),
    }
}

struct Pipe {
    state: Mutex<PipeState>,
    cv: Condvar,
}

#[derive(Default)]
struct PipeState {
    data: VecDeque<u8>,
    closed: bool,
}

impl Pipe {
    fn new() -> Arc<Pipe> {
        Arc::new(Pipe { state: Mutex::new(PipeState::default()), cv: Condvar::new() })
    }

    fn close(&self) {
        self.state.lock().unwrap().closed = true;
        self.cv.notify_all();
    }
}

/// One send as the peer would see it on the wire, with where its buffers were.
#[derive(Debug, Clone)]
pub struct SendRecord {
    pub at: Instant,
    pub lens: Vec<usize>,
    pub ptrs: Vec<usize>,
}

/// Every send one end made, in order.
#[derive(Default)]
pub struct SendLog {
    sends: Mutex<Vec<SendRecord>>,
    cv: Condvar,
}

impl SendLog {
    pub fn count(&self) -> usize {
        self.sends.lock().unwrap().len()
    }

    pub fn records(&self) -> Vec<SendRecord> {
        self.sends.lock().unwrap().clone()
    }

    /// Waits until at least `n` sends were made; false after `limit`.
    pub fn wait_for(&self, n: usize, limit: Duration) -> bool {
        let end = Instant::now() + limit;
        let mut g = self.sends.lock().unwrap();
        while g.len() < n {
            let now = Instant::now();
            if now >= end {
                return false;
            }
            g = self.cv.wait_timeout(g, end - now).unwrap().0;
        }
        true
    }
}

/// One end of an in-memory byte stream. Dropping or shutting down either
/// end closes both directions: bytes already sent can still be read, then
/// reads fail with `UnexpectedEof` and sends with `BrokenPipe`.
pub struct MemTransport {
    tx: Arc<Pipe>,
    rx: Arc<Pipe>,
    peer: String,
    log: Arc<SendLog>,
}

/// A connected pair: (client end, server end).
pub fn pair() -> (MemTransport, MemTransport) {
    let (a, b) = (Pipe::new(), Pipe::new());
    let client = MemTransport { tx: a.clone(), rx: b.clone(), peer: "mem-server".into(), log: Arc::default() };
    let server = MemTransport { tx: b, rx: a, peer: "mem-client".into(), log: Arc::default() };
    (client, server)
}

impl MemTransport {
    /// This end's sends, still readable after the end moved into a connection.
    pub fn log(&self) -> Arc<SendLog> {
        self.log.clone()
    }
}

impl Transport for MemTransport {
    fn send(&mut self, bufs: &[&[u8]]) -> io::Result<()> {
        {
            let mut st = self.tx.state.lock().unwrap();
            if st.closed {
                return Err(io::Error::new(io::ErrorKind::BrokenPipe, "peer closed the connection"));
            }
            for b in bufs {
                st.data.extend(b.iter().copied());
            }
        }
        self.tx.cv.notify_all();
        let rec = SendRecord {
            at: Instant::now(),
            lens: bufs.iter().map(|b| b.len()).collect(),
            ptrs: bufs.iter().map(|b| b.as_ptr() as usize).collect(),
        };
        self.log.sends.lock().unwrap().push(rec);
        self.log.cv.notify_all();
        Ok(())
    }

    fn recv_exact(&mut self, buf: &mut [u8]) -> io::Result<()> {
        let mut got = 0;
        let mut st = self.rx.state.lock().unwrap();
        loop {
            let k = (buf.len() - got).min(st.data.len());
            for (d, s) in buf[got..got + k].iter_mut().zip(st.data.drain(..k)) {
                *d = s;
            }
            got += k;
            if got == buf.len() {
                return Ok(());
            }
            if st.closed {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the connection"));
            }
            st = self.rx.cv.wait(st).unwrap();
        }
    }

    fn peer(&self) -> &str {
        &self.peer
    }

    fn shutdown(&self) {
        self.tx.close();
        self.rx.close();
    }
}

impl Drop for MemTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// What a request asked for, as far as the tests care.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ask {
    Ping,
    MemAlloc { size: u64 },
    HtoD { dst: u64 },
    DtoH { src: u64, size: u64 },
    Other,
}

#[derive(Debug, Clone)]
pub struct Req {
    pub seq: u64,
    pub wants_reply: bool,
    pub ask: Ask,
    pub bulk: Vec<u8>,
}

/// The server's end, decoding requests and encoding replies with the
/// protocol crate.
pub struct FakeServer {
    pub t: MemTransport,
    enc: Encoder,
    recv: RecvBuf,
}

impl FakeServer {
    pub fn new(t: MemTransport) -> Self {
        FakeServer { t, enc: Encoder::default(), recv: RecvBuf::default() }
    }

    /// The next request; None once the client closed the connection.
    pub fn next(&mut self) -> Option<Req> {
        let mut hb = [0u8; HEADER_LEN];
        self.t.recv_exact(&mut hb).ok()?;
        let h = FrameHeader::decode(&hb).expect("client sent a bad header");
        if h.kind == Kind::Close {
            return None;
        }
        assert_eq!(h.kind, Kind::Request);
        let buf = self.recv.prepare(h.msg_len as usize);
        self.t.recv_exact(buf).ok()?;
        let ask = {
            let msg = self.recv.reader().expect("client sent a bad message");
            let req = msg.get_root::<request::Reader>().unwrap();
            match req.which().unwrap() {
                request::Ping(()) => Ask::Ping,
                request::MemAlloc(m) => Ask::MemAlloc { size: m.unwrap().get_size() },
                request::MemcpyHtoD(m) => Ask::HtoD { dst: m.unwrap().get_dst() },
                request::MemcpyDtoH(m) => {
                    let m = m.unwrap();
                    Ask::DtoH { src: m.get_src(), size: m.get_size() }
                }
                _ => Ask::Other,
            }
        };
        let mut bulk = vec![0u8; h.bulk_len as usize];
        self.t.recv_exact(&mut bulk).ok()?;
        Some(Req { seq: h.seq, wants_reply: h.wants_reply(), ask, bulk })
    }

    /// A whole reply frame in one send.
    pub fn reply(&mut self, seq: u64, result: u32, deferred: u32, bulk: &[u8]) {
        self.reply_with(seq, result, deferred, |_| {}, bulk);
    }

    pub fn reply_with(
        &mut self,
        seq: u64,
        result: u32,
        deferred: u32,
        body: impl FnOnce(reply::Builder<'_>),
        bulk: &[u8],
    ) {
        let f = reply_frame_with(&mut self.enc, seq, result, deferred, body, bulk);
        // The client may have given up already; tests check what it saw.
        let _ = self.t.send(&[&f]);
    }

    pub fn send_raw(&mut self, bytes: &[u8]) {
        let _ = self.t.send(&[bytes]);
    }
}

/// A reply frame's bytes: header, message, bulk.
pub fn reply_frame(seq: u64, result: u32, deferred: u32, bulk: &[u8]) -> Vec<u8> {
    reply_frame_with(&mut Encoder::default(), seq, result, deferred, |_| {}, bulk)
}

pub fn reply_frame_with(
    enc: &mut Encoder,
    seq: u64,
    result: u32,
    deferred: u32,
    body: impl FnOnce(reply::Builder<'_>),
    bulk: &[u8],
) -> Vec<u8> {
    let mut out = vec![0u8; HEADER_LEN];
    let n = enc.reply(&mut out, |mut r| {
        r.set_result(result);
        r.set_deferred_error(deferred);
        body(r);
    });
    let h = FrameHeader::reply(seq, n, bulk.len() as u64).encode();
    out[..HEADER_LEN].copy_from_slice(&h);
    out.extend_from_slice(bulk);
    out
}
