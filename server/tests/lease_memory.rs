//! A lease's memory limit holds across all its sessions on a server: two
//! sessions admitted with the same token share one budget, and what one
//! frees (or leaves behind when it ends) the other may allocate.

mod common;

use std::time::{Duration, Instant};

use common::{control_named, control_with_token, device_processes, device_status, list_devices, DataClient, TestServer};
use rgpu_protocol::token::{sign_bytes, Claims};
use rgpu_server::config::PoolConfig;

const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";
const OUT_OF_MEMORY: u32 = 2;
const MIB: u64 = 1 << 20;

/// A version-1 token for `gpu`, written byte by byte (the layout documented
/// in `rgpu_protocol::token`) and checked against the decoder.
fn token(lease: u64, memory_limit: u64, gpu: [u8; 16]) -> Vec<u8> {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    let mut b = vec![1u8];
    for v in [lease, 1, now + 60_000, memory_limit] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b.extend_from_slice(&1u16.to_le_bytes());
    b.push(b't');
    b.extend_from_slice(&1u16.to_le_bytes());
    b.extend_from_slice(&gpu);
    let sig = sign_bytes(KEY, &b);
    b.extend_from_slice(&sig);
    let c = Claims::verify(&b, KEY, now).expect("test token verifies");
    assert_eq!((c.lease_id, c.memory_limit), (lease, memory_limit));
    b
}

fn session(addr: &str, token: &[u8]) -> DataClient {
    let h = control_with_token(addr, token).expect("token admitted");
    DataClient::attach(addr, h.session_id, &h.key).expect("attach")
}

#[test]
fn sessions_of_one_lease_share_its_memory_limit() {
    let pool = PoolConfig { broker_key: Some(KEY.to_vec()), ..Default::default() };
    let srv = TestServer::start_pool(1, 256 * MIB, Duration::from_secs(30), pool);
    let addr = srv.addr.to_string();
    let gpu: [u8; 16] = list_devices(&addr)[0].uuid.clone().try_into().unwrap();
    let tok = token(11, 16 * MIB, gpu);

    let mut a = session(&addr, &tok);
    let mut b = session(&addr, &tok);
    assert_eq!(a.mem_info(), (16 * MIB, 16 * MIB));
    let pa = a.alloc_ok(10 * MIB);
    // 10 MiB held by the lease: the other session sees 6 left, and cannot
    // take 10 more (alone it could have).
    assert_eq!(b.mem_info(), (6 * MIB, 16 * MIB));
    assert_eq!(b.alloc(10 * MIB).result, OUT_OF_MEMORY, "together the sessions would exceed the lease");
    let pb = b.alloc_ok(6 * MIB);
    assert_eq!(a.alloc(1).result, OUT_OF_MEMORY, "the lease is full");
    assert_eq!(a.mem_info().0, 0);

    // Freeing gives the bytes back to the lease, whichever session frees.
    assert_eq!(b.free(pb).result, 0);
    assert_eq!(a.mem_info(), (6 * MIB, 16 * MIB));

    // Another lease on the same server has its own budget.
    let mut other = session(&addr, &token(12, 16 * MIB, gpu));
    assert_eq!(other.mem_info(), (16 * MIB, 16 * MIB));
    other.alloc_ok(16 * MIB);

    // Session a ends with 10 MiB still allocated: the lease gets them back
    // once the server has torn the session down.
    let _ = pa;
    drop(a);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = b.alloc(16 * MIB);
        if r.result == 0 {
            break;
        }
        assert_eq!(r.result, OUT_OF_MEMORY);
        assert!(Instant::now() < deadline, "the ended session's memory never went back to the lease");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(b.mem_info(), (0, 16 * MIB));

    // A later session of the same lease shares what is left: nothing.
    let mut c = session(&addr, &tok);
    assert_eq!(c.alloc(1).result, OUT_OF_MEMORY);
    srv.stop();
}

#[test]
fn sessions_without_a_token_keep_their_own_view() {
    let srv = TestServer::start_with(1, 64 * MIB, Duration::from_secs(30));
    let mut a = srv.session();
    let mut b = srv.session();
    a.alloc_ok(40 * MIB);
    assert_eq!(b.mem_info().1, 64 * MIB, "no lease: the device's total");
    assert_eq!(b.alloc(40 * MIB).result, OUT_OF_MEMORY, "only the device itself limits");
    b.alloc_ok(16 * MIB);
    srv.stop();
}

/// A module's `.global` data is device memory like any allocation: it
/// counts against the lease, a module whose globals do not fit is refused
/// with CUDA_ERROR_OUT_OF_MEMORY, and unloading gives the bytes back.
#[test]
fn module_globals_count_against_the_lease() {
    let pool = PoolConfig { broker_key: Some(KEY.to_vec()), ..Default::default() };
    let srv = TestServer::start_pool(1, 2048 * MIB, Duration::from_secs(30), pool);
    let addr = srv.addr.to_string();
    let gpu: [u8; 16] = list_devices(&addr)[0].uuid.clone().try_into().unwrap();
    let mut a = session(&addr, &token(21, 256 * MIB, gpu));
    let module = |bytes: u64| {
        format!(".version 8.0\n.target sm_90\n.address_size 64\n.global .align 8 .b8 big[{bytes}];\n").into_bytes()
    };
    assert_eq!(a.load_module(1, &module(1536 * MIB)).result, OUT_OF_MEMORY, "1.5 GiB of globals in a 256 MiB lease");
    assert_eq!(a.mem_info(), (256 * MIB, 256 * MIB), "a refused module holds nothing");
    assert_eq!(a.load_module(2, &module(200 * MIB)).result, 0);
    assert_eq!(a.mem_info(), (56 * MIB, 256 * MIB), "cuMemGetInfo counts the module's globals");
    assert_eq!(a.alloc(100 * MIB).result, OUT_OF_MEMORY, "globals and allocations share the lease");
    assert_eq!(a.load_module(3, &module(100 * MIB)).result, OUT_OF_MEMORY);
    // Another session of the lease sees the same.
    let mut b = session(&addr, &token(21, 256 * MIB, gpu));
    assert_eq!(b.mem_info().0, 56 * MIB);
    assert_eq!(a.unload_module(2).result, 0);
    assert_eq!(b.mem_info(), (256 * MIB, 256 * MIB), "unloading gives the globals back");
    // A session that ends with a module loaded gives its globals back too.
    assert_eq!(b.load_module(4, &module(200 * MIB)).result, 0);
    drop(b);
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.mem_info().0 != 256 * MIB {
        assert!(Instant::now() < deadline, "the ended session's globals never went back to the lease");
        std::thread::sleep(Duration::from_millis(20));
    }
    srv.stop();
}

/// What NVML's memory info shows a lease: its limit as the total and its
/// own sessions' allocations as used, never another tenant's; without a
/// token a pooled server shows nothing.
#[test]
fn device_status_shows_a_lease_its_own_memory_only() {
    let pool = PoolConfig { broker_key: Some(KEY.to_vec()), ..Default::default() };
    let srv = TestServer::start_pool(1, 256 * MIB, Duration::from_secs(30), pool);
    let addr = srv.addr.to_string();
    let gpu: [u8; 16] = list_devices(&addr)[0].uuid.clone().try_into().unwrap();
    let (mine, theirs) = (token(21, 64 * MIB, gpu), token(22, 0, gpu));
    let mut a = session(&addr, &mine);
    let mut b = session(&addr, &mine);
    let mut other = session(&addr, &theirs);
    assert_eq!(device_status(&addr, &mine).unwrap(), vec![(0, 64 * MIB, 0)]);
    a.alloc_ok(8 * MIB);
    b.alloc_ok(4 * MIB);
    other.alloc_ok(100 * MIB);
    assert_eq!(device_status(&addr, &mine).unwrap(), vec![(0, 64 * MIB, 12 * MIB)], "both sessions of the lease, not the other's");
    // A whole-GPU lease: the device's memory as the total, its own use.
    assert_eq!(device_status(&addr, &theirs).unwrap(), vec![(0, 256 * MIB, 100 * MIB)]);
    let e = device_status(&addr, &[]).expect_err("no token on a pooled server");
    assert!(e.to_string().contains("refused"), "{e}");
    let mut forged = mine.clone();
    *forged.last_mut().unwrap() ^= 1;
    assert!(device_status(&addr, &forged).is_err(), "a forged token sees nothing");
}

/// A lease sees its own client processes on a device, by the pid each named, with what each
/// holds; another lease's processes on the same GPU, and sessions whose client gave no pid,
/// are not shown.
#[test]
fn device_status_lists_a_lease_its_own_processes() {
    let pool = PoolConfig { broker_key: Some(KEY.to_vec()), ..Default::default() };
    let srv = TestServer::start_pool(1, 256 * MIB, Duration::from_secs(30), pool);
    let addr = srv.addr.to_string();
    let gpu: [u8; 16] = list_devices(&addr)[0].uuid.clone().try_into().unwrap();
    let (mine, theirs) = (token(31, 64 * MIB, gpu), token(32, 0, gpu));
    let named = |tok: &[u8], name: &str| {
        let h = control_named(&addr, tok, name).expect("token admitted");
        DataClient::attach(&addr, h.session_id, &h.key).expect("attach")
    };
    let mut a = named(&mine, "python3 (pid 4242)");
    let mut b = named(&mine, "train (pid 17)");
    let _idle = named(&mine, "idle (pid 5)");
    let mut anonymous = session(&addr, &mine);
    let mut other = named(&theirs, "secret (pid 999)");
    assert_eq!(device_processes(&addr, &mine).unwrap(), vec![(0, vec![])]);
    a.alloc_ok(8 * MIB);
    b.alloc_ok(4 * MIB);
    anonymous.alloc_ok(MIB);
    other.alloc_ok(16 * MIB);
    let mut shown = device_processes(&addr, &mine).unwrap();
    shown[0].1.sort();
    assert_eq!(shown, vec![(0, vec![(17, 4 * MIB), (4242, 8 * MIB)])], "the lease's processes holding memory");
    assert_eq!(device_processes(&addr, &theirs).unwrap(), vec![(0, vec![(999, 16 * MIB)])]);
}

/// A server that admits sessions without tokens shows whole devices.
#[test]
fn device_status_without_a_pool_shows_whole_devices() {
    let srv = TestServer::start_with(2, 128 * MIB, Duration::from_secs(30));
    let addr = srv.addr.to_string();
    let mut s = srv.session();
    s.alloc_on(1, 16 * MIB);
    assert_eq!(device_status(&addr, &[]).unwrap(), vec![(0, 128 * MIB, 0), (1, 128 * MIB, 16 * MIB)]);
}
