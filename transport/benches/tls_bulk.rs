//! What TLS costs the TCP transport itself, without the shim or a server
//! around it: one thread sends `MIB` MiB in batches of `BATCH_KIB` KiB over
//! loopback, another receives them, in clear and under TLS in turns,
//! `ROUNDS` times; prints each mode's median rate and TLS/plaintext. Beside
//! them, how fast one core seals 16 KiB records with AES-128-GCM (ring, as
//! the connections do), and what TLS would reach if sealing were its only
//! cost on the sender's core: the bound no record layer in user space beats.
//!
//! `cargo bench -p rgpu-transport --bench tls_bulk -- [MIB] [BATCH_KIB] [ROUNDS]`

use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use rgpu_transport::tcp::TcpTransport;
use rgpu_transport::Transport;

fn plain_pair() -> (TcpTransport, TcpTransport) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = std::thread::spawn(move || TcpTransport::new(l.accept().unwrap().0).unwrap());
    let c = TcpTransport::new(TcpStream::connect(addr).unwrap()).unwrap();
    (c, t.join().unwrap())
}

fn tls_pair() -> (TcpTransport, TcpTransport) {
    let ((cs, cc), (ss, sc)) = rgpu_tls::testing::loopback_pair();
    (TcpTransport::with_tls(cs, cc).unwrap(), TcpTransport::with_tls(ss, sc).unwrap())
}

/// Bytes per second moving `total` bytes from `a` to `b` in `batch`-byte sends,
/// each answered by one byte once received (as a copy's reply would).
fn rate((mut a, mut b): (TcpTransport, TcpTransport), total: usize, batch: usize) -> f64 {
    let data: Vec<u8> = (0..batch).map(|i| (i * 31 + 7) as u8).collect();
    let rx = std::thread::spawn(move || {
        let mut buf = vec![0u8; batch];
        let mut got = 0;
        while got < total {
            b.recv_exact(&mut buf).unwrap();
            got += batch;
        }
        assert_eq!(buf[batch - 1], data_last(batch), "bytes arrived changed");
        b.send(&[&[1]]).unwrap();
    });
    let start = Instant::now();
    let mut sent = 0;
    while sent < total {
        a.send(&[&data]).unwrap();
        sent += batch;
    }
    let mut ack = [0u8; 1];
    a.recv_exact(&mut ack).unwrap();
    let took = start.elapsed().as_secs_f64();
    rx.join().unwrap();
    total as f64 / took
}

fn data_last(batch: usize) -> u8 {
    ((batch - 1) * 31 + 7) as u8
}

/// Bytes per second one core seals in 16 KiB TLS 1.3 records with AES-128-GCM.
fn seal_rate() -> f64 {
    use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_128_GCM};
    let key = LessSafeKey::new(UnboundKey::new(&AES_128_GCM, &[7u8; 16]).unwrap());
    let mut record = vec![1u8; 16 << 10];
    let n = 20_000u64;
    let start = Instant::now();
    for seq in 0..n {
        let mut nonce = [0u8; 12];
        nonce[4..].copy_from_slice(&seq.to_be_bytes());
        let aad = Aad::from([23u8, 3, 3, 0x40, 0x11]);
        let tag = key.seal_in_place_separate_tag(Nonce::assume_unique_for_key(nonce), aad, &mut record).unwrap();
        std::hint::black_box(tag);
    }
    (n * (16 << 10)) as f64 / start.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let mib = args.first().copied().unwrap_or(512);
    let batch = args.get(1).copied().unwrap_or(1024) << 10;
    let rounds = args.get(2).copied().unwrap_or(5);
    let total = (mib << 20) / batch * batch;
    let (mut plain, mut tls, mut seal) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        plain.push(rate(plain_pair(), total, batch));
        tls.push(rate(tls_pair(), total, batch));
        seal.push(seal_rate());
    }
    let (p, t, s) = (median(plain), median(tls), median(seal));
    // Sealing adds its time per byte to the sender's plaintext time per byte.
    let bound = 1.0 / (1.0 / p + 1.0 / s);
    let gib = |r: f64| r / (1u64 << 30) as f64;
    println!("{mib} MiB in {} KiB batches, {rounds} rounds, medians:", batch >> 10);
    println!("  plaintext {:.2} GiB/s", gib(p));
    println!("  TLS       {:.2} GiB/s", gib(t));
    println!("  TLS/plaintext {:.2}x", t / p);
    println!("  AES-128-GCM sealing on one core {:.2} GiB/s", gib(s));
    println!("  TLS with sealing its only cost {:.2} GiB/s, {:.2}x of plaintext", gib(bound), bound / p);
}
