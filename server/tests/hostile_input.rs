//! The server under hostile input: what one client sends must not take the
//! server, or another client's session, down, nor make the server hold
//! memory or connection slots without bound. Each test measures the thing
//! the limit protects; docs/security.md says what each shows.

mod common;

use common::TestServer;

const INVALID_PTX: u32 = 218;

/// A 10 KB PTX module nesting `{}` blocks (or vector operands) thousands
/// deep: the sim's PTX parser recursed once per level on the session's
/// thread, overflowed its stack and aborted the whole server. Now the load
/// fails with CUDA_ERROR_INVALID_PTX and every session goes on.
#[test]
fn deeply_nested_ptx_is_invalid_ptx_and_the_server_lives() {
    let srv = TestServer::start();
    let mut bystander = srv.session();
    let p = bystander.alloc_ok(4096);
    assert_eq!(bystander.htod(p, &[7u8; 16]).result, 0);

    let head = ".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry k()\n{\n";
    let blocks = format!("{head}{}{}}}\n", "{".repeat(5000), "}".repeat(5000));
    let vectors = format!("{head}mov.b32 {}%r1{};\n}}\n", "{".repeat(5000), "}".repeat(5000));
    for (i, text) in [blocks, vectors].iter().enumerate() {
        assert!(text.len() < 12_000);
        let mut attacker = srv.session();
        assert_eq!(attacker.load_module(1 + i as u64, text.as_bytes()).result, INVALID_PTX);
        assert_eq!(attacker.ping().result, 0, "the sender's own session goes on");
    }
    assert_eq!(bystander.dtoh(p, 16).bulk, [7u8; 16], "another session's memory is intact");
    assert_eq!(srv.session().ping().result, 0, "new sessions are served");
    srv.stop();
}

use std::io::Read;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{control, DataClient};
use rgpu_protocol::frame::FrameHeader;
use rgpu_protocol::{CONTROL_PREAMBLE, DATA_PREAMBLE};
use rgpu_server::limits::Limits;
use rgpu_transport::Transport;

const OUT_OF_MEMORY: u32 = 2;
const MIB: u64 = 1 << 20;

/// A connection to `addr` from the loopback address `from` (127.0.0.2 is
/// another host as far as the server's per-address count goes).
fn connect_from(from: &str, addr: &str) -> TcpStream {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let s = rt.block_on(async {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind(format!("{from}:0").parse().unwrap()).unwrap();
        sock.connect(addr.parse().unwrap()).await.unwrap()
    });
    let s = s.into_std().unwrap();
    s.set_nonblocking(false).unwrap();
    s
}

/// Whether the server has closed `s` (it reads end-of-file or a reset).
fn closed_by_server(s: &mut TcpStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).unwrap();
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => return false,
            Err(_) => return true,
        }
    }
}

/// 300 connections from one address that send a preamble and idle held
/// every connection slot (there was no bound on an idle control
/// connection), and reconnecting kept the server unavailable. Now one
/// address holds at most --max-connections-per-address of them, a
/// connection that does not finish its handshake is closed after
/// --handshake-timeout, and a client from another address gets in at once.
#[test]
fn idle_connections_from_one_address_cannot_shut_others_out() {
    let limits = Limits { max_connections_per_address: 8, handshake_timeout: Duration::from_secs(1), ..Limits::default() };
    let srv = TestServer::start_limited(limits);
    let addr = srv.addr.to_string();
    // The test server allows 64 connections in all.
    let mut idle: Vec<TcpStream> = (0..300)
        .map(|i| {
            let mut s = connect_from("127.0.0.2", &addr);
            let preamble = if i % 2 == 0 { CONTROL_PREAMBLE } else { DATA_PREAMBLE };
            let _ = std::io::Write::write_all(&mut s, preamble);
            s
        })
        .collect();
    let t = Instant::now();
    let h = control(&addr);
    let mut c = DataClient::attach(&addr, h.session_id, &h.key).expect("attach");
    assert_eq!(c.ping().result, 0);
    assert!(t.elapsed() < Duration::from_secs(2), "a client from another address got in after {:?}", t.elapsed());
    // Past the handshake timeout every idle connection has been closed.
    std::thread::sleep(Duration::from_millis(1500));
    let open = idle.iter_mut().map(|s| closed_by_server(s, Duration::from_millis(10))).filter(|closed| !closed).count();
    assert_eq!(open, 0, "connections that never finished their handshake are closed");
    assert_eq!(c.ping().result, 0, "the attached session is not an idle connection");
    srv.stop();
}

/// A control connection that said hello and then makes no call is closed
/// after --control-idle-timeout.
#[test]
fn an_idle_control_connection_is_closed() {
    let limits = Limits { control_idle_timeout: Duration::from_millis(500), ..Limits::default() };
    let srv = TestServer::start_limited(limits);
    let addr = srv.addr.to_string();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async {
        use rgpu_protocol::control_capnp::gpu_server;
        use tokio::io::AsyncWriteExt;
        let mut stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
        stream.write_all(CONTROL_PREAMBLE).await.unwrap();
        let conn = rgpu_broker_client::rpc::bootstrap::<gpu_server::Client, _>(stream);
        let server = conn.client();
        let mut req = server.hello_request();
        req.get().set_client_version(rgpu_protocol::PROTOCOL_VERSION);
        req.get().set_client_name("idle");
        req.send().promise.await.expect("hello");
        // Calls within the timeout keep it open.
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            server.list_devices_request().send().promise.await.expect("still open");
        }
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let r = tokio::time::timeout(Duration::from_secs(5), server.list_devices_request().send().promise).await;
        assert!(matches!(r, Ok(Err(_))), "the idle connection was closed by the server: {:?}", r.map(|r| r.map(|_| ())));
    });
    srv.stop();
}

/// A loaded module's image counts against --max-module-bytes-per-lease
/// until it is unloaded; an image over --max-module-image is refused
/// without being buffered.
#[test]
fn module_images_are_bounded_per_image_and_per_lease() {
    let limits = Limits { max_module_image: 2 * MIB, max_module_bytes_per_lease: 3 * MIB, ..Limits::default() };
    let srv = TestServer::start_limited(limits);
    let mut c = srv.session();
    let image = |bytes: u64| {
        let mut m = b".version 8.0\n.target sm_90\n.address_size 64\n".to_vec();
        m.resize(bytes as usize, b' ');
        m
    };
    assert_eq!(c.load_module(1, &image(3 * MIB)).result, OUT_OF_MEMORY, "over the per-image limit");
    assert_eq!(c.load_module(2, &image(2 * MIB)).result, 0);
    assert_eq!(c.load_module(3, &image(2 * MIB)).result, OUT_OF_MEMORY, "2 + 2 MiB loaded > 3 MiB");
    assert_eq!(c.load_module(4, &image(MIB)).result, 0, "2 + 1 fits");
    assert_eq!(c.unload_module(2).result, 0);
    assert_eq!(c.load_module(5, &image(2 * MIB)).result, 0, "unloading gave the bytes back");
    assert_eq!(c.ping().result, 0, "refused images were skipped, the stream is in sync");
    srv.stop();
}

/// Images being read count against the server-wide --max-buffered-input,
/// as their bytes arrive: while one client trickles a large image in,
/// another's load that does not fit is refused (its bytes skipped, not
/// buffered), and fits again after.
#[test]
fn images_in_flight_share_the_servers_input_budget() {
    let limits = Limits { max_buffered_input: 6 * MIB, ..Limits::default() };
    let srv = TestServer::start_limited(limits);
    let mut slow = srv.session();
    let mut other = srv.session();
    let mut image = b".version 8.0\n.target sm_90\n.address_size 64\n".to_vec();
    image.resize(4 * MIB as usize, b' ');
    // 3 MiB and a bit: the server has taken 4 MiB of the budget for it.
    let sent = 3 * MIB as usize + 4096;
    let seq = slow.start_call(image.len() as u64, &image[..sent], |r| {
        let mut m = r.init_module_load();
        m.set_handle(1);
        m.set_device(0);
    });
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(other.load_module(1, &image).result, OUT_OF_MEMORY, "4 + 4 MiB in flight > 6 MiB");
    slow.t.send(&[&image[sent..]]).unwrap();
    let r = slow.read_reply().unwrap();
    assert_eq!((r.seq, r.result), (seq, 0));
    assert_eq!(other.load_module(2, &image).result, 0, "the budget is free again");
    srv.stop();
}

/// A 24-byte header announcing a 16 MiB message made the server allocate
/// and zero 16 MiB before any byte came, and keep it for the connection:
/// 250 of them took the server from 5 MB to 4.1 GB. Now memory follows the
/// bytes that arrive. Measured on a spawned server process: its RSS after
/// 64 such headers (each followed by 8 bytes) grows by less than 64 MiB.
/// `RGPU_HOSTILE_HEADERS=250` sends 250 (the bound scales with the count);
/// `RGPU_SERVER_BIN` measures another build of the server.
#[test]
fn headers_announcing_big_messages_cost_nothing_until_bytes_arrive() {
    let bin = std::env::var("RGPU_SERVER_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_rgpu-server").to_string());
    let n: u64 = std::env::var("RGPU_HOSTILE_HEADERS").ok().and_then(|v| v.parse().ok()).unwrap_or(64);
    let mut child = std::process::Command::new(&bin)
        .args(["--backend", "sim", "--listen", "127.0.0.1:0", "--sim-memory", "64MiB"])
        .env("RGPU_SERVER_PLAINTEXT", "1")
        .env("RGPU_SERVER_MAX_CONNECTIONS", "1000")
        .env("RGPU_SERVER_MAX_CONNECTIONS_PER_ADDRESS", "1000")
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let child = Kill(child);
    let mut line = String::new();
    while !line.contains("listening on ") {
        line.clear();
        assert!(std::io::BufRead::read_line(&mut stderr, &mut line).unwrap() > 0, "no listening line");
    }
    let addr = line.split("listening on ").nth(1).expect("listening line").split_whitespace().next().unwrap().to_string();
    // The server's log goes on to the test's stderr (shown when it fails).
    std::thread::spawn(move || {
        for l in std::io::BufRead::lines(stderr).map_while(Result::ok) {
            eprintln!("server: {l}");
        }
    });
    let rss = || -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", child.0.id())).unwrap();
        let kb: u64 = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
        kb << 10
    };
    let before = rss();
    let mut conns = Vec::new();
    for _ in 0..n {
        let h = control(&addr);
        let mut c = DataClient::attach(&addr, h.session_id, &h.key).expect("attach");
        let hdr = FrameHeader::request(1, true, 16 << 20, 0).encode();
        c.t.send(&[&hdr, &[0u8; 8]]).unwrap();
        conns.push(c);
    }
    std::thread::sleep(Duration::from_millis(300));
    let after = rss();
    eprintln!("server RSS {} KiB before, {} KiB after {n} headers announcing 16 MiB", before >> 10, after >> 10);
    assert!(after < before + n * MIB, "RSS grew from {before} to {after} bytes");
    drop(conns);
}

/// A small image whose kernel inlines to many instructions (each function
/// calls the next twice) is charged for what the sim keeps, its decoded
/// kernel, not only for its few bytes of text.
#[test]
fn decoded_kernels_count_against_the_module_quota() {
    let limits = Limits { max_module_bytes_per_lease: MIB, ..Limits::default() };
    let srv = TestServer::start_limited(limits);
    let mut c = srv.session();
    let mut src = String::from(".version 8.0\n.target sm_90\n.address_size 64\n.func f16()\n{\nret;\n}\n");
    for i in (0..16).rev() {
        src.push_str(&format!(".func f{i}()\n{{\ncall f{};\ncall f{};\nret;\n}}\n", i + 1, i + 1));
    }
    src.push_str(".visible .entry k()\n{\ncall f0;\nret;\n}\n");
    assert!(src.len() < 2048);
    assert_eq!(c.load_module(1, src.as_bytes()).result, OUT_OF_MEMORY, "2^16 inlined calls are more than 1 MiB kept");
    let small = ".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry k()\n{\nret;\n}\n";
    assert_eq!(c.load_module(2, small.as_bytes()).result, 0, "the refused module left nothing charged");
    srv.stop();
}
