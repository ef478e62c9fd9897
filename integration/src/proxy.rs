//! A loopback TCP proxy between the shim and a server that can cut every
//! connection it carries at a moment the test chooses, as a network drop
//! would: both ends see their connection end, nothing else changes, and
//! new connections go through again.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

pub struct Proxy {
    pub addr: SocketAddr,
    live: Arc<Mutex<Vec<TcpStream>>>,
    accepted: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `upstream`.
    pub fn start(upstream: SocketAddr) -> Proxy {
        let l = TcpListener::bind("127.0.0.1:0").expect("proxy listens");
        let addr = l.local_addr().unwrap();
        l.set_nonblocking(true).unwrap();
        let live: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let accepted = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (live2, accepted2, stop2) = (live.clone(), accepted.clone(), stop.clone());
        thread::spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                let (down, _) = match l.accept() {
                    Ok(c) => c,
                    Err(_) => {
                        thread::sleep(Duration::from_millis(2));
                        continue;
                    }
                };
                let _ = down.set_nonblocking(false);
                let Ok(up) = TcpStream::connect(upstream) else { continue };
                let _ = (down.set_nodelay(true), up.set_nodelay(true));
                accepted2.fetch_add(1, Ordering::Relaxed);
                {
                    let mut g = live2.lock().unwrap();
                    g.push(down.try_clone().unwrap());
                    g.push(up.try_clone().unwrap());
                }
                pump(down.try_clone().unwrap(), up.try_clone().unwrap());
                pump(up, down);
            }
        });
        Proxy { addr, live, accepted, stop }
    }

    pub fn addr_string(&self) -> String {
        self.addr.to_string()
    }

    /// Cuts every connection open now; returns how many were cut.
    pub fn cut(&self) -> usize {
        let mut g = self.live.lock().unwrap();
        for s in g.iter() {
            let _ = s.shutdown(Shutdown::Both);
        }
        let n = g.len() / 2;
        g.clear();
        n
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::Relaxed)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.cut();
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream) {
    thread::spawn(move || {
        let mut buf = vec![0u8; 256 << 10];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to.shutdown(Shutdown::Both);
        let _ = from.shutdown(Shutdown::Both);
    });
}
