//! What `deviceStatus` reports of a sim device's activity and sensors:
//! GPU utilization measured as NVML defines it (the share of the last
//! second during which a kernel ran), temperature and power as the sim's
//! constants, marked simulated, and memory utilization not reported.

mod common;

use std::time::{Duration, Instant};

use common::kernels::{params, BUSY_PTX};
use common::{device_telemetry, TestServer};

const LAUNCH_TIMEOUT: u32 = 702;
const NOT_READY: u32 = 600;

fn gpu_utilization(addr: &str) -> (&'static str, u32) {
    device_telemetry(addr).expect("deviceStatus")[0][0]
}

#[test]
fn utilization_rises_while_a_kernel_runs_and_falls_after() {
    // A grid of 10M blocks ends at the kernel time limit: the device is
    // busy for that long, then idle.
    let limit = Duration::from_secs(3);
    let srv = TestServer::start_with_kernel_limit(limit);
    let addr = srv.addr.to_string();
    let readings = device_telemetry(&addr).unwrap();
    assert_eq!(readings.len(), 1);
    let [gpu, memory, temperature, power, power_limit] = readings[0];
    assert_eq!(gpu, ("measured", 0), "idle since the server started");
    assert_eq!(memory.0, "none", "the sim does not measure memory utilization");
    for r in [temperature, power, power_limit] {
        assert_eq!(r.0, "simulated", "{readings:?}");
        assert!(r.1 > 0, "{readings:?}");
    }
    assert!((20..=95).contains(&temperature.1), "a plausible die temperature: {temperature:?}");
    assert!(power.1 < power_limit.1, "drawing under its limit: {power:?} {power_limit:?}");

    let mut c = srv.session();
    assert_eq!(c.load_module(1, BUSY_PTX.as_bytes()).result, 0);
    let out = c.alloc_ok(4);
    let ev = 5;
    assert_eq!(c.call(&[], |r| {
        let mut e = r.init_event_create();
        e.set_handle(ev);
        e.set_device(0);
        e.set_flags(0);
    }).result, 0);
    let launched = Instant::now();
    c.launch(false, 1, 0, [10_000_000, 1, 1], [32, 1, 1], 0, &params(out, 1));
    assert_eq!(c.call(&[], |r| {
        let mut e = r.init_event_record();
        e.set_event(ev);
        e.set_stream(0);
    }).result, 0);
    std::thread::sleep(Duration::from_millis(1500));
    let busy = gpu_utilization(&addr);
    // Only a reading taken while the kernel still ran says anything.
    let running = c.call(&[], |r| r.init_event_query().set_handle(ev)).result;
    assert_eq!(running, NOT_READY, "the kernel ended before its time limit ({:?} after launch)", launched.elapsed());
    assert_eq!(busy.0, "measured");
    assert!(busy.1 >= 80, "a kernel ran the whole last second, but utilization is {}%", busy.1);

    let r = c.sync();
    assert_eq!(r.deferred, LAUNCH_TIMEOUT, "the kernel ran to the limit");
    let ended = Instant::now();
    // A second after the kernel ended, the last second held no kernel.
    std::thread::sleep(Duration::from_millis(1200));
    let idle = gpu_utilization(&addr);
    assert_eq!(idle, ("measured", 0), "{:?} after the kernel ended", ended.elapsed());
}
