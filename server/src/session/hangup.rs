//! Noticing that a session's connection ended while its thread is busy,
//! the reconnect grace, and keepalives while a request runs long.
//!
//! The session thread reads the socket only between requests, so while it
//! runs a long kernel it cannot see the client go away. A watcher thread
//! per session waits in `poll` for the peer's hang-up (`POLLRDHUP`: its
//! FIN; `POLLHUP`/`POLLERR`: a reset, or the server shutting the socket).
//! It waits for nothing else (no `POLLIN`), so it never wakes for data.
//!
//! A hang-up is not the end of the session: the client may come back and
//! resume (see [`super::window`]) within the grace. So the watcher notes
//! when the connection was lost and raises the session's `ended` flag (which
//! stops its running and queued work) only once the grace has passed with
//! no new connection, or at once when the connection's last bytes are the
//! client's orderly Close, or when the grace is zero. While the session
//! is held for a visit (a checkpoint being written) the grace does not run:
//! it starts when the visit ends, however long the visit took.
//!
//! While the session thread runs a request (`busy`), the watcher sends a
//! Keepalive frame every [`KEEPALIVE_EVERY`] on TCP connections, so a
//! client's read timeout measures the server's silence, not a kernel's
//! length. Frames never interleave: the session thread sends only while not
//! busy, and the flag changes under the lock the watcher sends under.

use std::io::{self, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rgpu_protocol::frame::{FrameHeader, Kind, HEADER_LEN};
use rgpu_transport::Sealer;
use tracing::debug;

/// How often a busy session tells its client it is alive.
pub const KEEPALIVE_EVERY: Duration = Duration::from_secs(2);
/// The most input looked at, at a hang-up, for the client's Close frame.
const MAX_PEEK: usize = 8 << 20;

/// What the session thread and its watcher share.
pub struct Link {
    state: Mutex<LinkState>,
    changed: Condvar,
    grace: Duration,
    ended: Arc<AtomicBool>,
}

struct LinkState {
    /// The connection being watched; None while the session has none.
    sock: Option<TcpStream>,
    generation: u64,
    /// Keepalives are sent on `sock` (TCP; never on an RDMA side channel).
    keepalive: bool,
    /// Under TLS keepalives go through the connection's sealer: raw bytes
    /// would break its record stream.
    sealer: Option<Sealer>,
    /// When the current connection was seen to end.
    lost_at: Option<Instant>,
    busy: bool,
    /// The session thread is in a visit: no grace runs out meanwhile.
    held: bool,
    /// The session is over: the watcher ends.
    over: bool,
}

impl Link {
    fn lock(&self) -> MutexGuard<'_, LinkState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The session thread starts (true) or finished (false) running a request.
    pub fn set_busy(&self, busy: bool) {
        self.lock().busy = busy;
    }

    /// When the grace of a connection lost now (or when the watcher saw it
    /// go) runs out.
    pub fn grace_deadline(&self) -> Instant {
        self.lock().lost_at.unwrap_or_else(Instant::now) + self.grace
    }

    /// The session thread starts (true) or ended (false) a visit. A
    /// connection lost before or during the visit gets its whole grace from
    /// the visit's end.
    pub fn set_held(&self, held: bool) {
        let mut st = self.lock();
        st.held = held;
        if !held && st.sock.is_none() {
            st.lost_at = Some(Instant::now());
        }
        drop(st);
        self.changed.notify_all();
    }

    /// The session continues on `sock` (a handle on its new connection).
    pub fn attach(&self, sock: TcpStream, keepalive: bool, sealer: Option<Sealer>) {
        let mut st = self.lock();
        if let Some(old) = st.sock.take() {
            let _ = old.shutdown(Shutdown::Both);
        }
        st.sock = Some(sock);
        st.generation += 1;
        st.keepalive = keepalive;
        st.sealer = sealer;
        st.lost_at = None;
        drop(st);
        self.changed.notify_all();
    }
}

/// The watcher of one session; dropping it ends the watch (the session is
/// over by then), shuts the socket and joins the thread.
pub struct Watch {
    link: Arc<Link>,
    thread: Option<JoinHandle<()>>,
}

impl Watch {
    /// Watches `sock` (a handle on the session's connection); raises
    /// `ended` when the connection ended and `grace` passed without another.
    pub fn start(
        sock: TcpStream,
        ended: Arc<AtomicBool>,
        grace: Duration,
        keepalive: bool,
        sealer: Option<Sealer>,
    ) -> io::Result<Watch> {
        let link = Arc::new(Link {
            state: Mutex::new(LinkState {
                sock: Some(sock),
                generation: 0,
                keepalive,
                sealer,
                lost_at: None,
                busy: false,
                held: false,
                over: false,
            }),
            changed: Condvar::new(),
            grace,
            ended,
        });
        let watched = link.clone();
        let thread = std::thread::Builder::new()
            .name("rgpu-hangup".into())
            .stack_size(256 << 10)
            .spawn(move || watch(&watched))?;
        Ok(Watch { link, thread: Some(thread) })
    }

    /// Watches a session that has no connection yet (rebuilt from a
    /// snapshot): `ended` is raised if none comes within `grace` from now.
    pub fn detached(ended: Arc<AtomicBool>, grace: Duration) -> io::Result<Watch> {
        let link = Arc::new(Link {
            state: Mutex::new(LinkState {
                sock: None,
                generation: 0,
                keepalive: true,
                sealer: None,
                lost_at: Some(Instant::now()),
                busy: false,
                held: false,
                over: false,
            }),
            changed: Condvar::new(),
            grace,
            ended,
        });
        let watched = link.clone();
        let thread = std::thread::Builder::new()
            .name("rgpu-hangup".into())
            .stack_size(256 << 10)
            .spawn(move || watch(&watched))?;
        Ok(Watch { link, thread: Some(thread) })
    }

    pub fn link(&self) -> Arc<Link> {
        self.link.clone()
    }
}

fn watch(link: &Link) {
    loop {
        let (sock, generation) = {
            let mut st = link.lock();
            loop {
                if st.over {
                    return;
                }
                if let Some(s) = &st.sock {
                    match s.try_clone() {
                        Ok(c) => break (c, st.generation),
                        Err(e) => {
                            debug!("cannot watch the connection: {e}; treating it as lost");
                            st.sock = None;
                            st.lost_at.get_or_insert_with(Instant::now);
                        }
                    }
                }
                if st.held {
                    st = link.changed.wait(st).unwrap_or_else(|p| p.into_inner());
                    continue;
                }
                // No connection: wait for one until the grace runs out.
                let deadline = *st.lost_at.get_or_insert_with(Instant::now) + link.grace;
                let now = Instant::now();
                if now >= deadline {
                    if !link.ended.swap(true, Ordering::Relaxed) && !link.grace.is_zero() {
                        debug!("no reconnection within the grace of {:?}: the session ends", link.grace);
                    }
                    return;
                }
                st = link.changed.wait_timeout(st, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
            }
        };
        let closed_cleanly = wait_for_hangup(&sock, link, generation);
        let mut st = link.lock();
        if st.generation == generation {
            st.sock = None;
            st.lost_at = Some(Instant::now());
            if closed_cleanly || st.over {
                link.ended.store(true, Ordering::Relaxed);
                return;
            }
        }
    }
}

/// Waits for `sock` to hang up, sending keepalives meanwhile while the
/// session is busy; true if the client's last bytes were its Close frame.
fn wait_for_hangup(sock: &TcpStream, link: &Link, generation: u64) -> bool {
    let mut p = libc::pollfd { fd: sock.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 };
    let keepalive = FrameHeader::bare(Kind::Keepalive).encode();
    loop {
        // SAFETY: one valid pollfd; the fd stays open while `sock` lives.
        let r = unsafe { libc::poll(&mut p, 1, KEEPALIVE_EVERY.as_millis() as i32) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            debug!("cannot watch the connection: {e}; treating it as lost");
            return false;
        }
        if r == 0 {
            let st = link.lock();
            if st.over || st.generation != generation {
                return false;
            }
            if st.busy && st.keepalive && has_room(sock) {
                // Under the lock: the session thread sends nothing while busy.
                let _ = match &st.sealer {
                    Some(sealer) => sealer.send(sock, &keepalive),
                    None => (&*sock).write_all(&keepalive),
                };
            }
            continue;
        }
        if p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
            // Under TLS the input is sealed: a Close cannot be seen in it,
            // and the hang-up counts as one to resume from (the grace
            // decides).
            let sealed = link.lock().sealer.is_some();
            return !sealed && ends_with_close(sock);
        }
    }
}

/// Whether the send buffer has room for a keepalive without blocking: a
/// client that reads nothing for hours must not make the watcher (and
/// with it the session thread, waiting for the lock) block on a full one.
fn has_room(sock: &TcpStream) -> bool {
    let fd = sock.as_raw_fd();
    let mut queued: libc::c_int = 0;
    let mut size: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: TIOCOUTQ writes one int; SO_SNDBUF writes one int of `len`.
    let ok = unsafe {
        libc::ioctl(fd, libc::TIOCOUTQ, &mut queued) == 0
            && libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_SNDBUF, (&mut size as *mut libc::c_int).cast(), &mut len) == 0
    };
    ok && queued < size / 2
}

/// Whether the input not yet read ends with the client's Close frame: then
/// the client is gone for good and its work can stop at once, even with
/// requests still queued before the Close.
fn ends_with_close(sock: &TcpStream) -> bool {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::FIONREAD, &mut n) } != 0 {
        return false;
    }
    let n = n.max(0) as usize;
    if n < HEADER_LEN || n > MAX_PEEK {
        return false;
    }
    let mut buf = vec![0u8; n];
    // SAFETY: buf is valid for n bytes; MSG_PEEK leaves the input in place.
    let got = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), n, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    got == n as isize && buf[n - HEADER_LEN..] == FrameHeader::bare(Kind::Close).encode()
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut st = self.link.lock();
        st.over = true;
        if let Some(s) = st.sock.take() {
            let _ = s.shutdown(Shutdown::Both);
        }
        drop(st);
        self.link.changed.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        (c, s)
    }

    fn raised_within(flag: &AtomicBool, d: Duration) -> bool {
        let end = Instant::now() + d;
        while Instant::now() < end {
            if flag.load(Ordering::Relaxed) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        false
    }

    #[test]
    fn a_closed_peer_raises_the_flag_even_with_unread_input() {
        let (mut client, server) = pair();
        let ended = Arc::new(AtomicBool::new(false));
        let _w = Watch::start(server, ended.clone(), Duration::ZERO, true, None).unwrap();
        client.write_all(&[0u8; 1000]).unwrap();
        assert!(!raised_within(&ended, Duration::from_millis(100)), "data alone is no hang-up");
        drop(client);
        assert!(raised_within(&ended, Duration::from_millis(100)));
    }

    #[test]
    fn with_a_grace_the_flag_waits_for_it_and_a_new_connection_cancels_it() {
        let grace = Duration::from_millis(300);
        let (client, server) = pair();
        let ended = Arc::new(AtomicBool::new(false));
        let w = Watch::start(server, ended.clone(), grace, true, None).unwrap();
        drop(client);
        assert!(!raised_within(&ended, Duration::from_millis(150)), "raised within the grace");
        let (client2, server2) = pair();
        w.link().attach(server2, true, None);
        assert!(!raised_within(&ended, Duration::from_millis(400)), "raised although the session came back");
        drop(client2);
        assert!(raised_within(&ended, Duration::from_millis(600)), "not raised after the grace");
    }

    #[test]
    fn no_grace_runs_out_while_the_session_is_held_and_it_starts_again_after() {
        let grace = Duration::from_millis(200);
        let (server, client) = pair();
        let ended = Arc::new(AtomicBool::new(false));
        let w = Watch::start(server, ended.clone(), grace, true, None).unwrap();
        w.link().set_held(true);
        drop(client);
        // A checkpoint longer than the grace: the session stays.
        assert!(!raised_within(&ended, grace * 3), "raised while held");
        w.link().set_held(false);
        // The grace starts at the end of the visit, whole.
        assert!(!raised_within(&ended, grace / 2), "raised before the grace after the visit");
        assert!(raised_within(&ended, grace * 2), "not raised after the grace");
    }

    #[test]
    fn an_orderly_close_ends_at_once_despite_the_grace() {
        let (mut client, server) = pair();
        let ended = Arc::new(AtomicBool::new(false));
        let _w = Watch::start(server, ended.clone(), Duration::from_secs(30), true, None).unwrap();
        client.write_all(&[7u8; 512]).unwrap();
        client.write_all(&FrameHeader::bare(Kind::Close).encode()).unwrap();
        drop(client);
        assert!(raised_within(&ended, Duration::from_millis(200)));
    }

    #[test]
    fn a_busy_session_sends_keepalives() {
        let (mut client, server) = pair();
        let ended = Arc::new(AtomicBool::new(false));
        let w = Watch::start(server, ended, Duration::ZERO, true, None).unwrap();
        w.link().set_busy(true);
        client.set_read_timeout(Some(KEEPALIVE_EVERY * 2)).unwrap();
        let mut b = [0u8; HEADER_LEN];
        std::io::Read::read_exact(&mut client, &mut b).unwrap();
        assert_eq!(FrameHeader::decode(&b).unwrap().kind, Kind::Keepalive);
    }

    #[test]
    fn shutting_the_socket_on_this_side_raises_it() {
        let (_client, server) = pair();
        let ended = Arc::new(AtomicBool::new(false));
        let other = server.try_clone().unwrap();
        let _w = Watch::start(server, ended.clone(), Duration::ZERO, true, None).unwrap();
        other.shutdown(Shutdown::Both).unwrap();
        assert!(raised_within(&ended, Duration::from_millis(100)));
    }

    #[test]
    fn dropping_the_watch_ends_its_thread() {
        let (_client, server) = pair();
        let ended = Arc::new(AtomicBool::new(false));
        let t = Instant::now();
        drop(Watch::start(server, ended, Duration::from_secs(30), true, None).unwrap());
        assert!(t.elapsed() < Duration::from_secs(1));
    }
}
