//! Snapshots copied off or onto this server in one stream
//! (`RGPUSNP1`, [`rgpu_protocol::snapshot_stream`]): what `rgpu checkpoint
//! --save` and `rgpu restore --load` use. One proof admits the request and
//! one MAC covers every byte, so the copy runs at the link's or the disk's
//! rate instead of one control-plane call per piece.
//!
//! A snapshot coming in is written to `.NAME.upload-TAG` (a file of this
//! connection's own), and becomes NAME only when every byte arrived, the
//! operator's MAC over them verifies, and it is synced: a cut, altered or
//! spliced stream leaves nothing behind, and NAME is never overwritten.

use std::fs::File;
use std::io::{self, Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rgpu_protocol::auth::NONCE_LEN;
use rgpu_protocol::snapshot_stream::{
    Opener, Request, SealError, Sealer, Way, RECORD_HEAD, RECORD_MAX, RECORD_TAG, REQUEST_HEAD, SEND_RECORD,
};
use rgpu_tls::server::Accepted;
use rgpu_transport::chunks::answer;
use rgpu_transport::tcp::TcpTransport;
use rgpu_transport::Transport;
use tracing::{info, warn};

use crate::relocate::OpError;
use crate::service::Service;

/// Bounds each read and write once the request is admitted: an operator
/// that stops for this long has abandoned the copy.
const PEER_IO_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("this server has no --admin-key-file: snapshots are not copied off or onto it")]
    NoKey,
    #[error("the request is malformed: {0}")]
    Request(#[from] rgpu_protocol::snapshot_stream::RequestError),
    #[error("the proof is not this server's admin key")]
    BadProof,
    #[error("the snapshot's records: {0}; nothing was kept")]
    Records(#[from] SealError),
    #[error("{got} bytes arrived for a snapshot of {size}")]
    WrongSize { got: u64, size: u64 },
    #[error("the connection: {0}")]
    Io(#[from] io::Error),
    #[error(transparent)]
    Op(#[from] OpError),
}

/// What a copy did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Copied {
    pub way: Way,
    pub name: String,
    pub bytes: u64,
}

/// What the stream needs of the server.
pub struct Place<'a> {
    pub admin_key: Option<&'a [u8]>,
    /// The checkpoint directory, and the path of a snapshot name in it.
    pub path_of: &'a dyn Fn(&str) -> Result<PathBuf, OpError>,
    /// The largest snapshot taken in.
    pub bound: u64,
}

/// Serves one snapshot stream on its own thread (the disk and the link are
/// blocking I/O, and the control plane's task set must not wait on either).
pub fn serve(sock: Accepted, peer: String, service: Arc<Service>, hold: Box<dyn std::any::Any + Send>) {
    let mut t = match crate::listener::blocking(sock) {
        Ok(t) => t,
        Err(e) => return warn!(%peer, "cannot take over a snapshot connection: {e}"),
    };
    let spawned = std::thread::Builder::new().name("rgpu-snapshot-copy".into()).spawn(move || {
        let _hold = hold;
        let _ = t.stream().set_read_timeout(Some(service.limits.handshake_timeout));
        let _ = t.stream().set_write_timeout(Some(PEER_IO_TIMEOUT));
        let path_of = |name: &str| crate::relocate::path_of(&service, name);
        let place = Place {
            admin_key: service.admin_key.as_deref(),
            path_of: &path_of,
            bound: crate::relocate::snapshot_bound(&service),
        };
        let started = Instant::now();
        let mut way = None;
        let admitted = |t: &mut TcpTransport, w: Way| {
            way = Some(w);
            let _ = t.stream().set_read_timeout(Some(PEER_IO_TIMEOUT));
        };
        let served = serve_on(&mut t, &place, admitted);
        let bytes = served.as_ref().ok().map(|c| c.bytes);
        service.metrics.snapshot_copy(way.map(|w| w == Way::Onto), bytes);
        match served {
            Ok(c) => {
                let secs = started.elapsed().as_secs_f64();
                info!(%peer, snapshot = %c.name, bytes = c.bytes, ms = (secs * 1e3) as u64,
                    mib_per_s = (c.bytes as f64 / (1 << 20) as f64 / secs.max(1e-9)) as u64,
                    "snapshot copied {}", if c.way == Way::Off { "off this server" } else { "onto this server" });
            }
            Err(e) => warn!(%peer, "snapshot copy failed: {e}"),
        }
        t.shutdown();
    });
    if let Err(e) = spawned {
        warn!("cannot start a snapshot copy: {e}");
    }
}

/// The stream's server side over any transport: nonce, request, then the
/// bytes one way or the other. Every refusal is answered with its reason.
/// `admitted` runs once the request's proof verified, with its way (the
/// caller lengthens its timeouts there).
pub fn serve_on<T: Transport + ?Sized>(t: &mut T, place: &Place<'_>, admitted: impl FnOnce(&mut T, Way)) -> Result<Copied, CopyError> {
    let refuse = |t: &mut T, e: CopyError| {
        let _ = answer(t, 1, &format!("refused: {e}"), 0, 0);
        Err(e)
    };
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::fill(&mut nonce).map_err(|e| io::Error::other(e.to_string()))?;
    t.send(&[&nonce])?;
    let mut head = [0u8; REQUEST_HEAD];
    t.recv_exact(&mut head)?;
    let rest_len = match Request::rest_len(head) {
        Ok(n) => n,
        Err(e) => return refuse(t, e.into()),
    };
    let mut rest = vec![0u8; rest_len];
    t.recv_exact(&mut rest)?;
    let request = match Request::decode(head, &rest) {
        Ok(r) => r,
        Err(e) => return refuse(t, e.into()),
    };
    // Refused only now, so that every refusal comes where the operator
    // reads an answer.
    let Some(admin_key) = place.admin_key else {
        return refuse(t, CopyError::NoKey);
    };
    if !request.verify(admin_key, &nonce) {
        return refuse(t, CopyError::BadProof);
    }
    let path = match (place.path_of)(&request.name) {
        Ok(p) => p,
        Err(e) => return refuse(t, e.into()),
    };
    admitted(t, request.way);
    let bytes = match request.way {
        Way::Off => {
            let sealer = Sealer::new(admin_key, &nonce, request.way, &request.name, request.size);
            send_off(t, &path, &request.name, sealer, &refuse)?
        }
        Way::Onto => {
            if request.size > place.bound {
                return refuse(t, OpError::TooLarge(place.bound).into());
            }
            if path.exists() {
                return refuse(t, OpError::Exists(request.name.clone()).into());
            }
            let opener = Opener::new(admin_key, &nonce, request.way, &request.name, request.size);
            take_onto(t, &path, &request.name, request.size, opener)?
        }
    };
    Ok(Copied { way: request.way, name: request.name, bytes })
}

fn send_off<T: Transport + ?Sized>(
    t: &mut T,
    path: &Path,
    name: &str,
    mut sealer: Sealer,
    refuse: &dyn Fn(&mut T, CopyError) -> Result<Copied, CopyError>,
) -> Result<u64, CopyError> {
    let mut f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return refuse(t, OpError::NoSnapshot(name.to_string()).into()).map(|_| 0)
        }
        Err(e) => return refuse(t, OpError::File(e).into()).map(|_| 0),
    };
    // A snapshot is never rewritten in place (written aside, then linked),
    // so its size now is its size for the whole copy.
    let size = f.metadata()?.len();
    answer(t, 0, "", size, 0)?;
    let mut buf = vec![0u8; RECORD_MAX];
    let mut left = size;
    while left > 0 {
        let n = left.min(SEND_RECORD as u64) as usize;
        // A file cut meanwhile (deleted files stay readable while open, so
        // only a truncation) ends the stream without its end record: the
        // operator keeps nothing.
        f.read_exact(&mut buf[..n])?;
        let (head, tag) = sealer.seal(&mut buf[..n])?;
        t.send(&[&head, &buf[..n], &tag])?;
        left -= n as u64;
    }
    t.send(&[&sealer.end()])?;
    Ok(size)
}

/// Removes an unfinished upload's file however the copy ends.
struct Partial(Option<PathBuf>);

impl Drop for Partial {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn take_onto<T: Transport + ?Sized>(t: &mut T, path: &Path, name: &str, size: u64, mut opener: Opener) -> Result<u64, CopyError> {
    let mut tag = [0u8; 8];
    getrandom::fill(&mut tag).map_err(|e| io::Error::other(e.to_string()))?;
    let partial_path = path.with_file_name(format!(".{name}.upload-{:016x}", u64::from_le_bytes(tag)));
    let mut f = match File::create(&partial_path) {
        Ok(f) => f,
        Err(e) => {
            let e = CopyError::from(OpError::File(e));
            let _ = answer(t, 1, &format!("refused: {e}"), 0, 0);
            return Err(e);
        }
    };
    let mut partial = Partial(Some(partial_path));
    answer(t, 0, "", size, 0)?;
    let received = (|| {
        let mut buf = vec![0u8; RECORD_MAX];
        let mut tag = [0u8; RECORD_TAG];
        loop {
            let mut head = [0u8; RECORD_HEAD];
            t.recv_exact(&mut head)?;
            let n = Opener::record_len(head)?;
            if n == 0 {
                t.recv_exact(&mut tag)?;
                opener.end(&tag)?;
                break;
            }
            if opener.bytes + n as u64 > size {
                return Err(CopyError::WrongSize { got: opener.bytes + n as u64, size });
            }
            t.recv_exact(&mut buf[..n])?;
            t.recv_exact(&mut tag)?;
            opener.open(&mut buf[..n], &tag)?;
            f.write_all(&buf[..n])?;
        }
        Ok(())
    })();
    let received = received.and_then(|()| {
        // `end` consumed the opener; what it counted is what was written.
        let got = f.stream_position()?;
        if got != size {
            return Err(CopyError::WrongSize { got, size });
        }
        f.sync_all()?;
        Ok(())
    });
    drop(f);
    if let Err(e) = received {
        let _ = answer(t, 2, &format!("refused: {e}"), 0, 0);
        return Err(e);
    }
    let Some(at) = partial.0.take() else { unreachable!("the partial file is named above") };
    if let Err(e) = crate::relocate::put_in_place(&at, path, name) {
        let e = CopyError::from(e);
        let _ = answer(t, 2, &format!("refused: {e}"), 0, 0);
        return Err(e);
    }
    answer(t, 0, "", size, 0)?;
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rgpu_protocol::auth::NONCE_LEN;
    use rgpu_transport::chunks::read_answer;
    use std::net::{TcpListener, TcpStream};

    const KEY: &[u8] = b"the admin key of these tests, 32+";

    struct Dir(PathBuf);

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn dir(tag: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("rgpu-snapcopy-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }

    /// Every file in `d`, hidden ones (unfinished uploads) included.
    fn files(d: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    }

    /// Runs the server side on a loopback connection against `client`,
    /// which gets the other end; returns what each side returned.
    fn run<C: FnOnce(&mut TcpTransport) -> R + Send + 'static, R: Send + 'static>(
        d: &Path,
        key: Option<&'static [u8]>,
        bound: u64,
        client: C,
    ) -> (Result<Copied, CopyError>, R) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let c = std::thread::spawn(move || {
            let s = TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            let mut t = TcpTransport::new(s).unwrap();
            let r = client(&mut t);
            t.shutdown();
            r
        });
        let (s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut t = TcpTransport::new(s).unwrap();
        let dir = d.to_path_buf();
        let path_of = move |name: &str| Ok(dir.join(name));
        let place = Place { admin_key: key, path_of: &path_of, bound };
        let served = serve_on(&mut t, &place, |_, _| {});
        t.shutdown();
        (served, c.join().unwrap())
    }

    fn nonce(t: &mut TcpTransport) -> [u8; NONCE_LEN] {
        let mut n = [0u8; NONCE_LEN];
        t.recv_exact(&mut n).unwrap();
        n
    }

    /// An operator sending `data` as snapshot `name` of `size` bytes, in
    /// records of up to 1 MiB, with `alter` applied to the records (each
    /// header, bytes and tag) on the wire.
    fn upload(
        name: &'static str,
        data: Vec<u8>,
        size: u64,
        key: &'static [u8],
        alter: fn(&mut Vec<Vec<u8>>),
    ) -> impl FnOnce(&mut TcpTransport) -> Result<(), String> {
        move |t| {
            let n = nonce(t);
            t.send(&[&Request::new(key, &n, Way::Onto, name, size).encode()]).map_err(|e| e.to_string())?;
            read_answer(t).map_err(|e| e.to_string())??;
            let mut s = Sealer::new(key, &n, Way::Onto, name, size);
            let mut wire = Vec::new();
            for piece in data.chunks(RECORD_MAX) {
                let mut b = piece.to_vec();
                let (head, tag) = s.seal(&mut b).unwrap();
                wire.push([&head[..], &b, &tag].concat());
            }
            wire.push(s.end().to_vec());
            let whole = wire.len();
            alter(&mut wire);
            for r in &wire {
                t.send(&[r]).map_err(|e| e.to_string())?;
            }
            if wire.len() < whole {
                // Cut: the connection ends here.
                t.shutdown();
                return Err("cut".into());
            }
            read_answer(t).map_err(|e| e.to_string())?.map(|_| ())
        }
    }

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 131 % 251) as u8).collect()
    }

    #[test]
    fn a_snapshot_goes_onto_the_server_whole_and_comes_off_it_the_same() {
        let d = dir("roundtrip");
        let data = pattern(3 * RECORD_MAX + 777);
        let size = data.len() as u64;
        let (served, client) = run(&d.0, Some(KEY), 1 << 30, upload("s1", data.clone(), size, KEY, |_| {}));
        assert_eq!(client, Ok(()));
        assert_eq!(served.unwrap(), Copied { way: Way::Onto, name: "s1".into(), bytes: size });
        assert_eq!(std::fs::read(d.0.join("s1")).unwrap(), data);
        assert_eq!(files(&d.0), ["s1"], "no upload file is left");

        let (served, got) = run(&d.0, Some(KEY), 1 << 30, |t| {
            let n = nonce(t);
            t.send(&[&Request::new(KEY, &n, Way::Off, "s1", 0).encode()]).unwrap();
            let (size, _) = read_answer(t).unwrap().unwrap();
            let mut o = Opener::new(KEY, &n, Way::Off, "s1", 0);
            let mut got = Vec::new();
            let mut tag = [0u8; RECORD_TAG];
            loop {
                let mut head = [0u8; RECORD_HEAD];
                t.recv_exact(&mut head).unwrap();
                let len = Opener::record_len(head).unwrap();
                if len == 0 {
                    t.recv_exact(&mut tag).unwrap();
                    break;
                }
                let mut b = vec![0u8; len];
                t.recv_exact(&mut b).unwrap();
                t.recv_exact(&mut tag).unwrap();
                o.open(&mut b, &tag).unwrap();
                got.extend_from_slice(&b);
            }
            (size, got, o.end(&tag).is_ok())
        });
        assert_eq!(served.unwrap().bytes, size);
        assert_eq!(got, (size, data, true));
    }

    #[test]
    fn altered_cut_long_or_unproved_uploads_leave_nothing() {
        let d = dir("hostile");
        let data = pattern(RECORD_MAX + 4096);
        let size = data.len() as u64;
        // A byte flipped on the way.
        let (served, client) = run(&d.0, Some(KEY), 1 << 30, upload("a", data.clone(), size, KEY, |w| w[1][RECORD_HEAD + 7] ^= 0x40));
        assert!(matches!(served, Err(CopyError::Records(SealError::Forged))), "{served:?}");
        assert!(client.unwrap_err().contains("does not open"));
        // Records reordered, or the end record moved up.
        let (served, _) = run(&d.0, Some(KEY), 1 << 30, upload("a", data.clone(), size, KEY, |w| w.swap(0, 1)));
        assert!(matches!(served, Err(CopyError::Records(SealError::Forged))), "{served:?}");
        let (served, _) = run(&d.0, Some(KEY), 1 << 30, upload("a", data.clone(), size, KEY, |w| {
            w.remove(1);
        }));
        assert!(matches!(served, Err(CopyError::Records(SealError::Forged))), "{served:?}");
        // Fewer bytes than the request said, and more.
        let (served, _) = run(&d.0, Some(KEY), 1 << 30, upload("a", data[..100].to_vec(), size, KEY, |_| {}));
        assert!(matches!(served, Err(CopyError::WrongSize { got: 100, .. })), "{served:?}");
        let (served, _) = run(&d.0, Some(KEY), 1 << 30, upload("a", [&data[..], &[0]].concat(), size, KEY, |_| {}));
        assert!(matches!(served, Err(CopyError::WrongSize { .. })), "{served:?}");
        // A record longer than any: refused before it is read.
        let (served, _) = run(&d.0, Some(KEY), 1 << 30, upload("a", data.clone(), size, KEY, |w| {
            w[0][..RECORD_HEAD].copy_from_slice(&u32::MAX.to_le_bytes())
        }));
        assert!(matches!(served, Err(CopyError::Records(SealError::TooLong(_)))), "{served:?}");
        // Another key.
        let (served, client) = run(&d.0, Some(KEY), 1 << 30, upload("a", data.clone(), size, b"not the admin key", |_| {}));
        assert!(matches!(served, Err(CopyError::BadProof)), "{served:?}");
        assert!(client.unwrap_err().starts_with("refused: "));
        // A server without a key takes nothing.
        let (served, _) = run(&d.0, None, 1 << 30, upload("a", data.clone(), size, KEY, |_| {}));
        assert!(matches!(served, Err(CopyError::NoKey)), "{served:?}");
        // More than the devices could hold.
        let (served, _) = run(&d.0, Some(KEY), size - 1, upload("a", data.clone(), size, KEY, |_| {}));
        assert!(matches!(served, Err(CopyError::Op(OpError::TooLarge(_)))), "{served:?}");
        // Cut: the operator goes away mid-stream.
        let (served, _) = run(&d.0, Some(KEY), 1 << 30, upload("a", data.clone(), size, KEY, |w| w.truncate(1)));
        assert!(matches!(served, Err(CopyError::Io(_))), "{served:?}");
        assert!(files(&d.0).is_empty(), "an upload that failed left {:?}", files(&d.0));
        // A name taken is refused whole, and the snapshot there untouched.
        std::fs::write(d.0.join("a"), b"the first").unwrap();
        let (served, _) = run(&d.0, Some(KEY), 1 << 30, upload("a", data.clone(), size, KEY, |_| {}));
        assert!(matches!(served, Err(CopyError::Op(OpError::Exists(_)))), "{served:?}");
        assert_eq!(std::fs::read(d.0.join("a")).unwrap(), b"the first");
        assert_eq!(files(&d.0), ["a"]);
    }

    #[test]
    fn a_snapshot_not_there_or_asked_for_badly_is_refused_with_its_reason() {
        let d = dir("refusals");
        let (served, answer) = run(&d.0, Some(KEY), 1 << 30, |t| {
            let n = nonce(t);
            t.send(&[&Request::new(KEY, &n, Way::Off, "absent", 0).encode()]).unwrap();
            read_answer(t).unwrap()
        });
        assert!(matches!(served, Err(CopyError::Op(OpError::NoSnapshot(_)))), "{served:?}");
        assert!(answer.unwrap_err().contains("no snapshot named"));
        // A path for a name: refused before anything is read past the name.
        let (served, answer) = run(&d.0, Some(KEY), 1 << 30, |t| {
            let n = nonce(t);
            let mut r = Request::new(KEY, &n, Way::Off, "x", 0).encode();
            r[1] = 5;
            r.splice(2..3, *b"../..");
            t.send(&[&r]).unwrap();
            read_answer(t).unwrap()
        });
        assert!(matches!(served, Err(CopyError::Request(_))), "{served:?}");
        assert!(answer.unwrap_err().starts_with("refused: "));
        let (served, _) = run(&d.0, Some(KEY), 1 << 30, |t| {
            nonce(t);
            t.send(&[&[9u8, 1]]).unwrap();
        });
        assert!(matches!(served, Err(CopyError::Request(_))), "{served:?}");
        assert!(files(&d.0).is_empty());
    }
}
