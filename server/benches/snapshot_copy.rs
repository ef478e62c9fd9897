//! A snapshot copied off and onto a server in one stream, against the
//! same bytes copied file to socket to file with nothing else in between
//! (no MAC, no framing), over loopback in one process, files in a folder
//! of your choice (`/dev/shm` takes the disk out: the link alone):
//!
//! `cargo bench -p rgpu-server --bench snapshot_copy -- [MIB] [ROUNDS] [DIR]`
//!
//! Prints each round's rates and the median ratio of each copy to the bare
//! one measured in the same round.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rgpu_control_client::snapshot_copy::{copy_off, copy_onto};
use rgpu_control_client::ClientSecurity;
use rgpu_server::snapshot_copy::{serve_on, Place};
use rgpu_transport::tcp::TcpTransport;

const KEY: &[u8] = b"the admin key of this benchmark!";
const BUF: usize = 1 << 20;

/// Serves one snapshot stream on a thread; returns its address.
fn server(dir: PathBuf) -> (String, std::thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let h = std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        let mut t = TcpTransport::new(s).unwrap();
        let mut pre = [0u8; 8];
        rgpu_transport::Transport::recv_exact(&mut t, &mut pre).unwrap();
        let path_of = |name: &str| Ok(dir.join(name));
        let place = Place { admin_key: Some(KEY), path_of: &path_of, bound: u64::MAX };
        serve_on(&mut t, &place, |_, _| {}).unwrap();
    });
    (addr, h)
}

/// File to socket to file, 1 MiB at a time, synced: what a copy cannot beat.
fn bare(from: &Path, to: &Path) -> Duration {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let started = Instant::now();
    let from = from.to_path_buf();
    let h = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        let mut f = File::open(from).unwrap();
        let mut buf = vec![0u8; BUF];
        loop {
            let n = f.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            s.write_all(&buf[..n]).unwrap();
        }
    });
    let (mut s, _) = l.accept().unwrap();
    let mut out = File::create(to).unwrap();
    let mut buf = vec![0u8; BUF];
    loop {
        let n = s.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        out.write_all(&buf[..n]).unwrap();
    }
    out.sync_all().unwrap();
    h.join().unwrap();
    started.elapsed()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let mib: u64 = args.first().and_then(|a| a.parse().ok()).unwrap_or(512);
    let rounds: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(3);
    let base = args.get(2).map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("rgpu-snapshot-copy-bench-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("server")).unwrap();
    let size = mib << 20;
    let source = dir.join("source.snap");
    {
        let mut f = File::create(&source).unwrap();
        let mut buf = vec![0u8; BUF];
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (i * 131 % 251) as u8;
        }
        for _ in 0..mib {
            f.write_all(&buf).unwrap();
        }
        f.sync_all().unwrap();
    }
    println!("{mib} MiB, {rounds} rounds, files in {}", base.display());
    let rate = |d: Duration| size as f64 / (1 << 20) as f64 / d.as_secs_f64();
    let (mut onto_ratio, mut off_ratio) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let bare_t = bare(&source, &dir.join("bare.out"));
        std::fs::remove_file(dir.join("bare.out")).unwrap();

        let (addr, h) = server(dir.join("server"));
        let started = Instant::now();
        let mut input = File::open(&source).unwrap();
        copy_onto(&addr, &ClientSecurity::Plaintext, KEY, "s.snap", &mut input, size, Duration::from_secs(600)).unwrap();
        let onto = started.elapsed();
        h.join().unwrap();

        let (addr, h) = server(dir.join("server"));
        let started = Instant::now();
        let mut out = File::create(dir.join("off.out")).unwrap();
        copy_off(&addr, &ClientSecurity::Plaintext, KEY, "s.snap", &mut out, Duration::from_secs(600)).unwrap();
        out.sync_all().unwrap();
        let off = started.elapsed();
        h.join().unwrap();
        std::fs::remove_file(dir.join("off.out")).unwrap();
        std::fs::remove_file(dir.join("server/s.snap")).unwrap();

        println!(
            "round {round}: bare {:.0} MiB/s, onto {:.0} MiB/s ({:.2}x), off {:.0} MiB/s ({:.2}x)",
            rate(bare_t),
            rate(onto),
            bare_t.as_secs_f64() / onto.as_secs_f64(),
            rate(off),
            bare_t.as_secs_f64() / off.as_secs_f64()
        );
        onto_ratio.push(bare_t.as_secs_f64() / onto.as_secs_f64());
        off_ratio.push(bare_t.as_secs_f64() / off.as_secs_f64());
    }
    println!("median of the bare copy's rate: onto {:.2}x, off {:.2}x", median(onto_ratio), median(off_ratio));
    let _ = std::fs::remove_dir_all(&dir);
}
