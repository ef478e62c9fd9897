//! For tests of what crosses the network: a loopback TCP relay in front of
//! a daemon that records every byte it carries, both ways.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

/// Relays each connection made to [`Tap::addr`] to `upstream`, keeping a
/// copy of all bytes. Runs until the process ends.
pub struct Tap {
    pub addr: String,
    seen: Arc<Mutex<Vec<u8>>>,
}

impl Tap {
    pub fn start(upstream: &str) -> std::io::Result<Tap> {
        let l = TcpListener::bind("127.0.0.1:0")?;
        let addr = l.local_addr()?.to_string();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (up, rec) = (upstream.to_string(), seen.clone());
        std::thread::spawn(move || {
            for c in l.incoming().flatten() {
                let Ok(s) = TcpStream::connect(&up) else { continue };
                let _ = (c.set_nodelay(true), s.set_nodelay(true));
                for (mut from, mut to) in [(c.try_clone(), s.try_clone()), (s.try_clone(), c.try_clone())]
                    .into_iter()
                    .filter_map(|(a, b)| Some((a.ok()?, b.ok()?)))
                {
                    let rec = rec.clone();
                    std::thread::spawn(move || {
                        let mut buf = vec![0u8; 1 << 16];
                        while let Ok(n) = from.read(&mut buf) {
                            if n == 0 {
                                break;
                            }
                            // Recorded before it is passed on: once a peer
                            // has a byte, the capture holds it.
                            rec.lock().unwrap_or_else(|p| p.into_inner()).extend_from_slice(&buf[..n]);
                            if to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                        let _ = to.shutdown(std::net::Shutdown::Write);
                    });
                }
            }
        });
        Ok(Tap { addr, seen })
    }

    /// Everything relayed so far, both directions interleaved.
    pub fn captured(&self) -> Vec<u8> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Whether `needle` crossed the relay as it is.
    pub fn saw(&self, needle: &[u8]) -> bool {
        !needle.is_empty() && self.captured().windows(needle.len()).any(|w| w == needle)
    }
}

/// Two ends of one TLS connection over loopback, handshakes done with
/// rustls' blocking API under a throwaway CA: (client, server), each its
/// socket and its connection, for tests and benches of what runs over TLS.
///
/// The client offers rgpu's own records ([`crate::DATA_RECORDS_ALPN`]), as
/// the data plane's clients do; [`loopback_pair_with`] chooses.
pub fn loopback_pair() -> ((TcpStream, rustls::Connection), (TcpStream, rustls::Connection)) {
    loopback_pair_with(true)
}

/// [`loopback_pair`], the client offering rgpu's records or not.
pub fn loopback_pair_with(records: bool) -> ((TcpStream, rustls::Connection), (TcpStream, rustls::Connection)) {
    let ca = crate::pki::Authority::new("loopback CA").expect("CA");
    let issued = ca.issue(&["127.0.0.1"]).expect("certificate");
    let crate::ServerSecurity::Tls(server) =
        crate::ServerSecurity::from_pem(issued.cert_pem.as_bytes(), issued.key_pem.as_bytes()).expect("server TLS")
    else {
        unreachable!("a certificate gives TLS")
    };
    let client = crate::TlsClient::from_ca_pem(ca.cert_pem().as_bytes(), None).expect("client TLS");
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("address").to_string();
    let t = std::thread::spawn(move || {
        let (mut s, _) = l.accept().expect("accept");
        let mut conn = rustls::ServerConnection::new(Arc::clone(&server)).expect("server connection");
        while conn.is_handshaking() {
            conn.complete_io(&mut s).expect("server handshake");
        }
        (s, rustls::Connection::from(conn))
    });
    let mut s = TcpStream::connect(&addr).expect("connect");
    let conn = crate::client::handshake_blocking_with(&client, &addr, &mut s, records).expect("client handshake");
    ((s, conn.into()), t.join().expect("server side"))
}
