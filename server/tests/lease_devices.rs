//! A session admitted with a lease token may use only the token's GPUs:
//! the server enforces it, whatever the client's shim does.

mod common;

use std::time::Duration;

use common::{control_with_token, list_devices, DataClient, TestServer};
use rgpu_protocol::token::Claims;
use rgpu_server::config::PoolConfig;

const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";
const INVALID_DEVICE: u32 = 101;

fn claims(gpus: Vec<[u8; 16]>) -> Claims {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    Claims { lease_id: 7, generation: 2, deadline_ms: now + 60_000, memory_limit: 0, tenant: "t".into(), gpus, pkey: None, compute_milli: 0, client_key: None }
}

#[test]
fn leased_session_uses_only_the_tokens_gpus() {
    let pool = PoolConfig { broker_key: Some(KEY.to_vec()), ..Default::default() };
    let srv = TestServer::start_pool(3, 64 << 20, Duration::from_secs(30), pool);
    let addr = srv.addr.to_string();
    let uuids: Vec<[u8; 16]> = list_devices(&addr).into_iter().map(|d| d.uuid.try_into().unwrap()).collect();
    assert_eq!(uuids.len(), 3);
    assert!(control_with_token(&addr, &[]).is_err(), "no token, no session");
    assert!(control_with_token(&addr, &claims(vec![[0xee; 16]]).sign(KEY)).is_err(), "another server's GPU");

    let h = control_with_token(&addr, &claims(vec![uuids[1]]).sign(KEY)).expect("a valid token is admitted");
    let mut c = DataClient::attach(&addr, h.session_id, &h.key).expect("attach");
    // Device 1 is leased: alloc, copy in and out.
    let r = c.alloc_on(1, 4096);
    assert_eq!(r.result, 0);
    let p = r.ptr();
    assert_eq!(c.htod(p, &[5u8; 4096]).result, 0);
    assert_eq!(c.dtoh(p, 4096).bulk, vec![5u8; 4096]);
    // Devices 0 and 2 exist but are not leased: every request naming them
    // is refused.
    for d in [0, 2] {
        assert_eq!(c.alloc_on(d, 4096).result, INVALID_DEVICE, "memAlloc on device {d}");
        assert_eq!(c.call(&[], |r| r.init_mem_get_info().set_device(d)).result, INVALID_DEVICE);
        assert_eq!(c.call(&[], |r| r.init_ctx_synchronize().set_device(d)).result, INVALID_DEVICE);
        let r = c.call(&[], |r| {
            let mut s = r.init_stream_create();
            s.set_handle(40 + u64::from(d));
            s.set_device(d);
        });
        assert_eq!(r.result, INVALID_DEVICE, "streamCreate on device {d}");
        let r = c.call(&[], |r| {
            let mut e = r.init_event_create();
            e.set_handle(50 + u64::from(d));
            e.set_device(d);
        });
        assert_eq!(r.result, INVALID_DEVICE, "eventCreate on device {d}");
    }
    // A token for devices 0 and 2 gets exactly those two.
    let h2 = control_with_token(&addr, &claims(vec![uuids[2], uuids[0]]).sign(KEY)).expect("admitted");
    let mut c2 = DataClient::attach(&addr, h2.session_id, &h2.key).expect("attach");
    assert_eq!(c2.alloc_on(0, 64).result, 0);
    assert_eq!(c2.alloc_on(2, 64).result, 0);
    assert_eq!(c2.alloc_on(1, 64).result, INVALID_DEVICE);
    // The first session still works on its own device.
    assert_eq!(c.call(&[], |r| r.init_ctx_synchronize().set_device(1)).result, 0);
    assert_eq!(c.dtoh(p, 16).bulk, vec![5u8; 16]);
    srv.stop();
}
