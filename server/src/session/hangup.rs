//! Noticing that a session's connection ended while its thread is busy.
//!
//! The session thread reads the socket only between requests, so while it
//! runs a long kernel it cannot see the client go away, and the requests the
//! client queued before dying would still be read and run one by one. A
//! watcher thread per session waits in `poll` for the peer's hang-up
//! (`POLLRDHUP`: its FIN; `POLLHUP`/`POLLERR`: a reset, or the server
//! shutting the socket to end the session) and raises the session's `ended`
//! flag, which the interpreter polls between blocks and within long warps.
//! It waits for nothing else (no `POLLIN`), so it never wakes for data, and
//! it costs one sleeping thread with a small stack.

use std::io;
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use tracing::debug;

/// The watcher of one session's socket; dropping it shuts the socket (the
/// session is over by then) and joins the thread.
pub struct Watch {
    sock: TcpStream,
    thread: Option<JoinHandle<()>>,
}

impl Watch {
    /// Watches `sock` (a handle on the session's connection), raising
    /// `ended` when the connection ends.
    pub fn start(sock: TcpStream, ended: Arc<AtomicBool>) -> io::Result<Watch> {
        let watched = sock.try_clone()?;
        let thread = std::thread::Builder::new()
            .name("rgpu-hangup".into())
            .stack_size(64 << 10)
            .spawn(move || {
                wait_for_hangup(&watched);
                ended.store(true, Ordering::Relaxed);
            })?;
        Ok(Watch { sock, thread: Some(thread) })
    }
}

fn wait_for_hangup(sock: &TcpStream) {
    let mut p = libc::pollfd { fd: sock.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 };
    loop {
        // SAFETY: one valid pollfd; the fd stays open while `sock` lives.
        let r = unsafe { libc::poll(&mut p, 1, -1) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            debug!("cannot watch the connection: {e}; treating it as ended");
            return;
        }
        if p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
            return;
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let _ = self.sock.shutdown(Shutdown::Both);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpListener;
    use std::time::{Duration, Instant};

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
        let _w = Watch::start(server, ended.clone()).unwrap();
        client.write_all(&[0u8; 1000]).unwrap();
        assert!(!raised_within(&ended, Duration::from_millis(100)), "data alone is no hang-up");
        drop(client);
        assert!(raised_within(&ended, Duration::from_millis(100)));
    }

    #[test]
    fn shutting_the_socket_on_this_side_raises_it() {
        let (_client, server) = pair();
        let ended = Arc::new(AtomicBool::new(false));
        let other = server.try_clone().unwrap();
        let _w = Watch::start(server, ended.clone()).unwrap();
        other.shutdown(Shutdown::Both).unwrap();
        assert!(raised_within(&ended, Duration::from_millis(100)));
    }

    #[test]
    fn dropping_the_watch_ends_its_thread() {
        let (_client, server) = pair();
        let ended = Arc::new(AtomicBool::new(false));
        let t = Instant::now();
        drop(Watch::start(server, ended).unwrap());
        assert!(t.elapsed() < Duration::from_secs(1));
    }
}
