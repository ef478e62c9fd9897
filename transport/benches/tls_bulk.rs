//! What TLS costs the TCP transport itself, without the shim or a server
//! around it: one thread sends `MIB` MiB in batches of `BATCH_KIB` KiB over
//! loopback, another receives them, in clear and under TLS in turns,
//! `ROUNDS` times; prints each mode's median rate and its ratio to plaintext. Beside
//! them, how fast one core seals 16 KiB records with AES-128-GCM (ring, as
//! the connections do), and what TLS would reach if sealing were its only
//! cost on the sender's core: the bound no record layer in user space beats.
//!
//! Then the round trip of a 64-byte request and answer in clear and under
//! TLS, and what rustls and rgpu's records spend sealing and opening one
//! such record. TLS runs both ways: with rustls sealing every record (a
//! peer that does not offer rgpu's records) and with rgpu's records after
//! the handshake (`rgpu_transport::records`), as rgpu's ends use.
//!
//! `cargo bench -p rgpu-transport --bench tls_bulk -- [MIB] [BATCH_KIB] [ROUNDS]`
//!
//! Like the rgpu binaries, it first restarts itself with glibc's `rep movsb`
//! off where that copy is slow here (`rgpu_transport::rep_movsb`); with
//! `RGPU_MEMCPY_PROBE=off` it runs with glibc's default instead, for the
//! comparison. Its first line says which.

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

/// A TLS pair opened as the data plane opens one (the client's opening
/// read through rustls by the server, then the server's answer); `records`:
/// rgpu's own records after that, else rustls' throughout.
fn tls_pair(records: bool) -> (TcpTransport, TcpTransport) {
    let ((cs, cc), (mut ss, mut sc)) = rgpu_tls::testing::loopback_pair_with(records);
    let mut c = TcpTransport::with_tls(cs, cc).unwrap();
    c.send(&[b"RGPUBNCH"]).unwrap();
    let mut opening = [0u8; 8];
    let mut done = 0;
    while done < opening.len() {
        use std::io::Read;
        match sc.reader().read(&mut opening[done..]) {
            Ok(n) => done += n,
            Err(_) => {
                sc.read_tls(&mut ss).unwrap();
                sc.process_new_packets().unwrap();
            }
        }
    }
    let mut s = TcpTransport::with_tls(ss, sc).unwrap();
    assert_eq!(s.has_own_records(), records);
    s.send(&[b"k"]).unwrap();
    c.recv_exact(&mut [0u8; 1]).unwrap();
    (c, s)
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

/// Median nanoseconds of a round trip: `n` requests of 64 bytes, each
/// answered by 64 bytes before the next leaves (a synchronising call's shape).
fn round_trip_ns((mut a, mut b): (TcpTransport, TcpTransport), n: usize) -> f64 {
    let echo = std::thread::spawn(move || {
        let mut m = [0u8; 64];
        for _ in 0..n {
            b.recv_exact(&mut m).unwrap();
            b.send(&[&m]).unwrap();
        }
    });
    let mut times = Vec::with_capacity(n);
    let mut m = [7u8; 64];
    for _ in 0..n {
        let t = Instant::now();
        a.send(&[&m]).unwrap();
        a.recv_exact(&mut m).unwrap();
        times.push(t.elapsed().as_nanos() as f64);
    }
    echo.join().unwrap();
    median(times)
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
        let _ = std::hint::black_box(tag);
    }
    (n * (16 << 10)) as f64 / start.elapsed().as_secs_f64()
}

/// Nanoseconds rustls takes to seal a 64-byte record on one connection and
/// open it on the other, in memory: what TLS adds to each direction of a
/// round trip beside the bytes on the wire.
fn record_ns() -> f64 {
    use std::io::{Read, Write};
    let ((_, mut c), (_, mut s)) = rgpu_tls::testing::loopback_pair();
    let n = 100_000;
    let (msg, mut out, mut wire) = ([7u8; 64], [0u8; 64], Vec::with_capacity(4096));
    let start = Instant::now();
    for _ in 0..n {
        c.writer().write_all(&msg).unwrap();
        wire.clear();
        while c.wants_write() {
            c.write_tls(&mut wire).unwrap();
        }
        let mut r = &wire[..];
        while !r.is_empty() {
            s.read_tls(&mut r).unwrap();
        }
        s.process_new_packets().unwrap();
        s.reader().read_exact(&mut out).unwrap();
    }
    assert_eq!(out, msg);
    start.elapsed().as_nanos() as f64 / n as f64
}

/// The same for rgpu's records: sealing on one end, opening on the other.
fn own_record_ns() -> f64 {
    use rgpu_transport::records::{Dir, Keys, AES_128_GCM, HEADER, TAG};
    let keys = Keys::from_secret(&[5u8; 32], &AES_128_GCM);
    let (mut tx, mut rx) = (keys.half(Dir::ClientToServer).unwrap(), keys.half(Dir::ClientToServer).unwrap());
    let n = 100_000;
    let (msg, mut wire) = ([7u8; 64], Vec::with_capacity(4096));
    let start = Instant::now();
    for _ in 0..n {
        wire.clear();
        tx.seal(&mut wire, &[&msg]).unwrap();
        let header: [u8; HEADER] = wire[..HEADER].try_into().unwrap();
        let tag: [u8; TAG] = wire[HEADER + 64..].try_into().unwrap();
        rx.open(header, &mut wire[HEADER..HEADER + 64], tag).unwrap();
    }
    assert_eq!(&wire[HEADER..HEADER + 64], &msg);
    start.elapsed().as_nanos() as f64 / n as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    rgpu_transport::rep_movsb::reexec_if_slow();
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let mib = args.first().copied().unwrap_or(512);
    let batch = args.get(1).copied().unwrap_or(1024) << 10;
    let rounds = args.get(2).copied().unwrap_or(5);
    let total = (mib << 20) / batch * batch;
    let (mut plain, mut tls, mut own, mut seal) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut plain_rt, mut tls_rt, mut own_rt) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        plain.push(rate(plain_pair(), total, batch));
        tls.push(rate(tls_pair(false), total, batch));
        own.push(rate(tls_pair(true), total, batch));
        seal.push(seal_rate());
        plain_rt.push(round_trip_ns(plain_pair(), 20_000));
        tls_rt.push(round_trip_ns(tls_pair(false), 20_000));
        own_rt.push(round_trip_ns(tls_pair(true), 20_000));
    }
    let (prt, trt, ort) = (median(plain_rt), median(tls_rt), median(own_rt));
    let (p, t, o, s) = (median(plain), median(tls), median(own), median(seal));
    // Sealing adds its time per byte to the sender's plaintext time per byte.
    let bound = 1.0 / (1.0 / p + 1.0 / s);
    let gib = |r: f64| r / (1u64 << 30) as f64;
    println!("{mib} MiB in {} KiB batches, {rounds} rounds, medians:", batch >> 10);
    let (slow, reference) = rgpu_transport::rep_movsb::measure();
    let tunables = std::env::var("GLIBC_TUNABLES").unwrap_or_default();
    println!(
        "  memcpy of 16 KiB at a slow alignment {slow} ns, elsewhere {reference} ns; {}",
        if tunables.contains(rgpu_transport::rep_movsb::TUNABLE) { "rep movsb off (GLIBC_TUNABLES)" } else { "glibc's default" }
    );
    println!("  plaintext {:.2} GiB/s", gib(p));
    println!("  TLS, rustls' records {:.2} GiB/s, {:.2}x of plaintext", gib(t), t / p);
    println!("  TLS, rgpu's records  {:.2} GiB/s, {:.2}x of plaintext", gib(o), o / p);
    println!("  round trip of 64 bytes: plaintext {:.2} us", prt / 1e3);
    println!("    TLS, rustls' records {:.2} us, {:.3}x of plaintext", trt / 1e3, trt / prt);
    println!("    TLS, rgpu's records  {:.2} us, {:.3}x of plaintext", ort / 1e3, ort / prt);
    println!("  sealing and opening one 64-byte record in memory (twice per round trip):");
    println!("    rustls {:.0} ns, rgpu's records {:.0} ns", record_ns(), own_record_ns());
    println!("  AES-128-GCM sealing on one core {:.2} GiB/s", gib(s));
    println!("  TLS with sealing its only cost {:.2} GiB/s, {:.2}x of plaintext", gib(bound), bound / p);
}
