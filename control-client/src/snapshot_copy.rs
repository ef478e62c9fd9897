//! The operator's side of a snapshot copied off or onto a GPU server in one
//! stream (`RGPUSNP1`, [`rgpu_protocol::snapshot_stream`]): one proof for
//! the request, the bytes in sealed records at the link's rate.
//! A server older than the stream closes it before its nonce
//! ([`CopyError::Unsupported`]); the caller then copies in control-plane
//! calls, one piece each ([`crate::operator`]).

use std::io::{self, Read, Write};
use std::time::{Duration, Instant};

use rgpu_protocol::auth::NONCE_LEN;
use rgpu_protocol::snapshot_stream::{Opener, Request, Sealer, Way, RECORD_HEAD, RECORD_MAX, RECORD_TAG, SEND_RECORD};
use rgpu_protocol::SNAPSHOT_PREAMBLE;
use rgpu_transport::chunks::read_answer;
use rgpu_transport::tcp::{self, TcpTransport};
use rgpu_transport::Transport;

use crate::{ClientSecurity, ControlError};

/// Bounds connecting, the TLS handshake and each read or write: a server
/// that stops answering for this long has failed the copy.
const IO_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    /// The server closed the stream before its nonce: it predates it.
    #[error("the server at {0} does not take snapshot streams")]
    Unsupported(String),
    #[error(transparent)]
    Control(#[from] ControlError),
}

fn lost(addr: &str, e: impl std::fmt::Display) -> ControlError {
    ControlError::Unreachable { addr: addr.into(), reason: e.to_string() }
}

fn local(what: &str, e: io::Error) -> ControlError {
    ControlError::Local { reason: format!("{what}: {e}") }
}

/// Connects (TLS as `security` says), sends the preamble and the request,
/// and returns the transport, the nonce and the server's answer (the size).
fn open(
    addr: &str,
    security: &ClientSecurity,
    admin_key: &[u8],
    way: Way,
    name: &str,
    size: u64,
) -> Result<(TcpTransport, [u8; NONCE_LEN], u64), CopyError> {
    let mut t = tcp::connect(addr, IO_TIMEOUT).map_err(|e| lost(addr, e))?;
    if let ClientSecurity::Tls(tls) = security {
        let mut stream = t.into_stream().map_err(|e| lost(addr, e))?;
        stream.set_read_timeout(Some(IO_TIMEOUT)).map_err(|e| lost(addr, e))?;
        let conn = rgpu_tls::client::handshake_blocking(tls, addr, &mut stream)
            .map_err(|e| ControlError::Tls { addr: addr.into(), reason: format!("TLS with {addr}: {e}") })?;
        t = TcpTransport::with_tls(stream, conn.into()).map_err(|e| lost(addr, e))?;
    }
    t.stream().set_read_timeout(Some(IO_TIMEOUT)).map_err(|e| lost(addr, e))?;
    t.stream().set_write_timeout(Some(IO_TIMEOUT)).map_err(|e| lost(addr, e))?;
    t.send(&[SNAPSHOT_PREAMBLE]).map_err(|e| lost(addr, e))?;
    let mut nonce = [0u8; NONCE_LEN];
    match t.recv_exact(&mut nonce[..8]) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof || e.kind() == io::ErrorKind::ConnectionReset => {
            return Err(CopyError::Unsupported(addr.into()))
        }
        Err(e) => return Err(lost(addr, e).into()),
    }
    if nonce[..8] == rgpu_tls::NEEDS_TLS[..] {
        return Err(ControlError::Tls { addr: addr.into(), reason: format!("{addr} serves TLS: give --tls-ca") }.into());
    }
    t.recv_exact(&mut nonce[8..]).map_err(|e| lost(addr, e))?;
    let request = Request::new(admin_key, &nonce, way, name, size);
    t.send(&[&request.encode()]).map_err(|e| lost(addr, e))?;
    match read_answer(&mut t).map_err(|e| lost(addr, e))? {
        Ok((size, _)) => Ok((t, nonce, size)),
        Err(reason) => Err(ControlError::Refused { addr: addr.into(), reason }.into()),
    }
}

fn check_deadline(addr: &str, started: Instant, limit: Duration) -> Result<(), ControlError> {
    if started.elapsed() > limit {
        return Err(ControlError::Unreachable { addr: addr.into(), reason: format!("the copy took more than {} s", limit.as_secs()) });
    }
    Ok(())
}

/// Copies snapshot `name` off the server at `addr` into `out`; returns its
/// size. `out` has every byte, and they are the server's, only when this
/// returns Ok: the caller keeps `out` only then.
pub fn copy_off(
    addr: &str,
    security: &ClientSecurity,
    admin_key: &[u8],
    name: &str,
    out: &mut dyn Write,
    limit: Duration,
) -> Result<u64, CopyError> {
    let started = Instant::now();
    let (mut t, nonce, size) = open(addr, security, admin_key, Way::Off, name, 0)?;
    let forged = |e: rgpu_protocol::snapshot_stream::SealError| ControlError::Protocol {
        addr: addr.into(),
        reason: format!("the snapshot's records: {e} (altered on the way, or the server holds another admin key)"),
    };
    let mut opener = Opener::new(admin_key, &nonce, Way::Off, name, 0);
    let mut buf = vec![0u8; RECORD_MAX];
    let mut tag = [0u8; RECORD_TAG];
    loop {
        let mut head = [0u8; RECORD_HEAD];
        t.recv_exact(&mut head).map_err(|e| lost(addr, e))?;
        let n = Opener::record_len(head).map_err(forged)?;
        if n == 0 {
            break;
        }
        if opener.bytes + n as u64 > size {
            return Err(ControlError::Protocol { addr: addr.into(), reason: format!("more than the snapshot's {size} bytes") }.into());
        }
        t.recv_exact(&mut buf[..n]).map_err(|e| lost(addr, e))?;
        t.recv_exact(&mut tag).map_err(|e| lost(addr, e))?;
        opener.open(&mut buf[..n], &tag).map_err(forged)?;
        out.write_all(&buf[..n]).map_err(|e| local("writing the snapshot", e))?;
        check_deadline(addr, started, limit)?;
    }
    t.recv_exact(&mut tag).map_err(|e| lost(addr, e))?;
    let got = opener.end(&tag).map_err(forged)?;
    if got != size {
        return Err(ControlError::Protocol { addr: addr.into(), reason: format!("{got} of the snapshot's {size} bytes came") }.into());
    }
    Ok(size)
}

/// Copies the snapshot read from `input` (`size` bytes) onto the server at
/// `addr` as `name`; Ok once the server has it whole, synced, in place.
pub fn copy_onto(
    addr: &str,
    security: &ClientSecurity,
    admin_key: &[u8],
    name: &str,
    input: &mut dyn Read,
    size: u64,
    limit: Duration,
) -> Result<(), CopyError> {
    let started = Instant::now();
    let (mut t, nonce, _) = open(addr, security, admin_key, Way::Onto, name, size)?;
    let mut sealer = Sealer::new(admin_key, &nonce, Way::Onto, name, size);
    let mut buf = vec![0u8; RECORD_MAX];
    let mut left = size;
    while left > 0 {
        let n = left.min(SEND_RECORD as u64) as usize;
        input
            .read_exact(&mut buf[..n])
            .map_err(|e| local(&format!("reading the snapshot at byte {}", size - left), e))?;
        let (head, tag) = sealer
            .seal(&mut buf[..n])
            .map_err(|e| ControlError::Local { reason: format!("sealing the snapshot: {e}") })?;
        if let Err(e) = t.send(&[&head, &buf[..n], &tag]) {
            return Err(why_cut(&mut t, addr, e).into());
        }
        left -= n as u64;
        check_deadline(addr, started, limit)?;
    }
    if let Err(e) = t.send(&[&sealer.end()]) {
        return Err(why_cut(&mut t, addr, e).into());
    }
    // The sync of a large file can take a while on a slow disk.
    let _ = t.stream().set_read_timeout(Some(IO_TIMEOUT.max(limit.saturating_sub(started.elapsed()))));
    match read_answer(&mut t).map_err(|e| lost(addr, e))? {
        Ok(_) => Ok(()),
        Err(reason) => Err(ControlError::Refused { addr: addr.into(), reason }.into()),
    }
}

/// A server that stops a copy coming in (a full disk, a record that did
/// not open) answers why before it closes: that reason, where it came,
/// rather than the broken pipe the send met.
fn why_cut(t: &mut TcpTransport, addr: &str, sent: io::Error) -> ControlError {
    let _ = t.stream().set_read_timeout(Some(Duration::from_secs(5)));
    match read_answer(t) {
        Ok(Err(reason)) => ControlError::Refused { addr: addr.into(), reason },
        _ => lost(addr, sent),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rgpu_transport::chunks::answer;
    use std::net::TcpListener;

    const KEY: &[u8] = b"the admin key of these tests, 32+";

    /// A server on loopback that runs `serve` on its one connection.
    fn fake(serve: impl FnOnce(TcpTransport) + Send + 'static) -> (String, std::thread::JoinHandle<()>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let h = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            serve(TcpTransport::new(s).unwrap());
        });
        (addr, h)
    }

    /// A fake server's side of the opening: the preamble in, `nonce` out,
    /// the request in.
    fn take_request(t: &mut TcpTransport, nonce: &[u8; NONCE_LEN]) -> Request {
        let mut pre = [0u8; 8];
        t.recv_exact(&mut pre).unwrap();
        assert_eq!(&pre, SNAPSHOT_PREAMBLE);
        t.send(&[nonce]).unwrap();
        let mut head = [0u8; 2];
        t.recv_exact(&mut head).unwrap();
        let mut rest = vec![0u8; Request::rest_len(head).unwrap()];
        t.recv_exact(&mut rest).unwrap();
        Request::decode(head, &rest).unwrap()
    }

    /// A server that sends `data` as snapshot "s", sealed as `seal` says,
    /// its records altered by `alter`.
    fn sender(data: Vec<u8>, alter: fn(&mut Vec<Vec<u8>>)) -> impl FnOnce(TcpTransport) {
        move |mut t| {
            let nonce = [3u8; NONCE_LEN];
            let r = take_request(&mut t, &nonce);
            assert!(r.verify(KEY, &nonce));
            answer(&mut t, 0, "", data.len() as u64, 0).unwrap();
            let mut s = Sealer::new(KEY, &nonce, Way::Off, "s", 0);
            let mut wire = Vec::new();
            for piece in data.chunks(RECORD_MAX) {
                let mut b = piece.to_vec();
                let (head, tag) = s.seal(&mut b).unwrap();
                wire.push([&head[..], &b, &tag].concat());
            }
            wire.push(s.end().to_vec());
            alter(&mut wire);
            for r in &wire {
                let _ = t.send(&[r]);
            }
        }
    }

    #[test]
    fn records_that_do_not_open_or_a_stream_cut_short_are_errors() {
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 249) as u8).collect();
        let (addr, h) = fake(sender(data.clone(), |_| {}));
        let mut out = Vec::new();
        let n = copy_off(&addr, &ClientSecurity::Plaintext, KEY, "s", &mut out, Duration::from_secs(20)).unwrap();
        h.join().unwrap();
        assert_eq!((n, &out), (data.len() as u64, &data));

        let cases: [(fn(&mut Vec<Vec<u8>>), &str); 3] = [
            (|w| w[1][RECORD_HEAD + 9] ^= 1, "does not open"),
            (|w| w.swap(0, 1), "does not open"),
            (|w| w.truncate(2), "cannot reach"),
        ];
        for (alter, says) in cases {
            let (addr, h) = fake(sender(data.clone(), alter));
            let e = copy_off(&addr, &ClientSecurity::Plaintext, KEY, "s", &mut Vec::new(), Duration::from_secs(20)).unwrap_err();
            h.join().unwrap();
            assert!(e.to_string().contains(says), "{e}");
        }
    }

    #[test]
    fn a_server_that_stops_a_copy_mid_way_is_heard_saying_why() {
        let (addr, h) = fake(|mut t| {
            take_request(&mut t, &[5u8; NONCE_LEN]);
            answer(&mut t, 0, "", 0, 0).unwrap();
            // One record in, then the disk fills.
            let mut first = vec![0u8; RECORD_HEAD + SEND_RECORD + RECORD_TAG];
            t.recv_exact(&mut first).unwrap();
            answer(&mut t, 2, "refused: the connection: No space left on device (os error 28)", 0, 0).unwrap();
            t.shutdown();
        });
        let big = vec![1u8; 64 << 20];
        let e = copy_onto(&addr, &ClientSecurity::Plaintext, KEY, "s", &mut &big[..], big.len() as u64, Duration::from_secs(20))
            .unwrap_err();
        h.join().unwrap();
        assert!(
            matches!(&e, CopyError::Control(ControlError::Refused { reason, .. }) if reason.contains("No space left")),
            "{e}"
        );
    }

    #[test]
    fn a_server_that_closes_at_the_preamble_predates_the_stream() {
        for _ in 0..2 {
            let (addr, h) = fake(|mut t| {
                let mut pre = [0u8; 8];
                t.recv_exact(&mut pre).unwrap();
                assert_eq!(&pre, SNAPSHOT_PREAMBLE);
                t.shutdown();
            });
            let e = copy_onto(&addr, &ClientSecurity::Plaintext, KEY, "s", &mut &b"abc"[..], 3, Duration::from_secs(20)).unwrap_err();
            h.join().unwrap();
            assert!(matches!(e, CopyError::Unsupported(_)), "{e}");
        }
        // A refusal after the request is no reason to fall back.
        let (addr, h) = fake(|mut t| {
            take_request(&mut t, &[5u8; NONCE_LEN]);
            answer(&mut t, 1, "refused: no room", 0, 0).unwrap();
        });
        let e = copy_onto(&addr, &ClientSecurity::Plaintext, KEY, "s", &mut &b"abc"[..], 3, Duration::from_secs(20)).unwrap_err();
        h.join().unwrap();
        assert!(matches!(&e, CopyError::Control(ControlError::Refused { reason, .. }) if reason.contains("no room")), "{e}");
    }
}
