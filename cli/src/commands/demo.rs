//! `rgpu demo`: the main job on a fresh machine. Starts a pool on loopback
//! ports: a broker (temporary data folder, fresh keys) and one GPU server (a
//! real GPU when the server finds one, else the simulated one) that admits
//! only lease tokens; issues itself a credential with the broker's admin
//! key, takes a lease, runs a built-in CUDA workload through
//! the shim with the lease's token, checks its results, prints what ran
//! where and how fast, and releases the lease. `--no-broker` (or
//! `--server`) talks to the server directly. Everything the demo starts
//! runs under TLS, with a throwaway CA and certificate made for the run
//! (`--plaintext`: in clear).

use std::ffi::{c_void, CString};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rgpu_broker_client::{BrokerClient, Credential, LeaseSpec, LeaseView, Role};

use crate::driver::{CuResult, Driver, DEMO_PTX};
use rgpu_cuda_types::{CUdevice_attribute as Attr, CuError};
use crate::pool::relative;
use crate::server_process::{BrokerProcess, ServerProcess};
use crate::tls::{Pki, TlsArgs};

/// Try rgpu on this machine: start a broker and a GPU server (a real GPU,
/// else the simulator), take a lease and run a small workload through the
/// shim.
#[derive(clap::Args)]
pub struct Args {
    /// Use this running server instead of starting one (no broker; a
    /// lease token, if the server needs one, comes from RGPU_TOKEN).
    #[arg(long)]
    server: Option<String>,
    /// Backend of the server the demo starts: auto, sim or cuda.
    #[arg(long, default_value = "auto")]
    backend: String,
    /// Start only the server and talk to it directly, without a broker
    /// and a lease.
    #[arg(long)]
    no_broker: bool,
    /// Size of the copy test, in MiB.
    #[arg(long, default_value_t = 64)]
    size_mib: usize,
    /// With --server: how to reach it (its CA, or --plaintext). Without:
    /// --plaintext starts the demo's daemons in clear instead of under TLS.
    #[command(flatten)]
    tls: TlsArgs,
}

/// The demo's own pool: a broker, a server registered with it, a lease.
struct Pool {
    // Dropped in this order: the lease is released first, then the server
    // and the broker stop (and the broker's folder goes).
    lease: LeaseView,
    client: BrokerClient,
    server: ServerProcess,
    broker: BrokerProcess,
    /// The key file the lease's token is bound to, in the broker's folder.
    client_key: std::path::PathBuf,
}

impl Pool {
    fn start(backend: &str, pki: Option<&Pki>, tls: &TlsArgs) -> Result<Pool> {
        let broker = BrokerProcess::start(pki).context("cannot start the demo's broker")?;
        let key = broker.key_file();
        let key = key.to_str().context("temporary folder name is not UTF-8")?;
        let server = ServerProcess::start_with(
            backend,
            pki,
            &["--broker", &broker.addr, "--broker-key-file", key, "--drain-timeout", "0", "--require-bound-tokens"],
        )?;
        // The demo is its own operator: it issues itself a credential with
        // its broker's admin key.
        let admin_key = crate::pool::read_key(&broker.admin_key_file())?;
        let cred = Credential::issue(&admin_key, "demo", Role::User, crate::pool::now_ms())?;
        let client =
            BrokerClient::connect(&broker.addr, &cred, &tls.security()?).context("cannot reach the demo's broker")?;
        let t = Instant::now();
        while !client.servers().is_ok_and(|s| s.iter().any(|s| s.id == server.addr && s.state == "up")) {
            if t.elapsed() > Duration::from_secs(10) {
                bail!("the server at {} did not register with the broker within 10 s", server.addr);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // The lease is bound to a key of the demo's own, as `rgpu lease`
        // binds one to the user's: its token opens sessions only with it.
        let client_key = broker.dir.join("client.key");
        let public = rgpu_control_client::client_key::load_or_create(&client_key)?.public();
        let spec = LeaseSpec { gpus: 1, ttl_ms: 10 * 60_000, client_key: Some(public), ..LeaseSpec::default() };
        let lease = client.lease(&spec).context("the demo's broker did not grant a lease")?;
        Ok(Pool { lease, client, server, broker, client_key })
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let _ = self.client.release(self.lease.id_u64());
    }
}

pub fn exec(a: Args) -> Result<i32> {
    let mut pool = None;
    let mut direct = None;
    // What the demo starts runs under TLS unless told otherwise, with a CA
    // made for this run; the shim and the demo's broker client trust it.
    let pki = match (&a.server, a.tls.plaintext) {
        (None, false) => Some(Pki::throwaway()?),
        _ => None,
    };
    let tls = match &pki {
        Some(p) => TlsArgs::trusting(p),
        None => a.tls.clone(),
    };
    let (addr, origin) = match (&a.server, a.no_broker) {
        (Some(s), _) => (s.clone(), "given".to_string()),
        (None, true) => {
            let s = ServerProcess::start(&a.backend, pki.as_ref())?;
            let r = (s.addr.clone(), format!("started by the demo, --backend {} chose {}", a.backend, s.backend));
            direct = Some(s);
            r
        }
        (None, false) => {
            let p = Pool::start(&a.backend, pki.as_ref(), &tls)?;
            let r = (
                p.server.addr.clone(),
                format!("started by the demo, --backend {} chose {}; admits lease tokens only", a.backend, p.server.backend),
            );
            pool = Some(p);
            r
        }
    };
    // The shim reads its servers and token at cuInit, which runs below,
    // before any other thread of ours touches the environment.
    std::env::set_var("RGPU_SERVERS", &addr);
    if let Some(p) = &pool {
        std::env::set_var("RGPU_TOKEN", &p.lease.token);
        std::env::set_var(rgpu_control_client::client_key::ENV, &p.client_key);
    }
    tls.export()?;
    let shim = crate::paths::shim()?;
    let d = Driver::load(&shim)?;
    println!("rgpu demo");
    println!("  shim      {}", shim.display());
    if let Some(p) = &pool {
        println!("  broker    {} (started by the demo, data in {})", p.broker.addr, p.broker.dir.display());
    }
    println!("  server    {addr} ({origin})");
    match (&pki, &tls.tls_ca) {
        (Some(p), _) => println!(
            "  tls       on, both planes and the broker (throwaway CA and certificate for 127.0.0.1 in {})",
            p.dir.display()
        ),
        (None, Some(ca)) => println!("  tls       on, server certificate checked against {}", ca.display()),
        (None, None) => println!("  tls       off (--plaintext): tokens, keys and data cross the network in clear"),
    }
    if let Some(p) = &pool {
        print_lease(&p.lease);
        if let Some(k) = rgpu_protocol::token::from_hex(&p.lease.token)
            .and_then(|t| rgpu_protocol::token::Claims::decode_unverified(&t).ok())
            .and_then(|c| c.client_key)
        {
            println!(
                "  token     bound to client key {} ({}): the server admits it only with that key's proof",
                rgpu_protocol::binding::fingerprint(&k),
                p.client_key.display()
            );
        }
    }
    d.open_device(0)?;
    print_device(&d);
    let failures = workload(&d, a.size_mib)?;
    drop(direct);
    if let Some(p) = pool.take() {
        let id = p.lease.id.clone();
        let released = p.client.release(p.lease.id_u64());
        match released {
            Ok(true) => ok(&format!("lease {id} released")),
            Ok(false) => println!("  [--]  lease {id} had already ended"),
            Err(e) => println!("  [--]  lease {id} not released: {e}"),
        }
    }
    if failures == 0 {
        println!("PASS: every check of the workload ran on the remote device and returned the right data");
        Ok(0)
    } else {
        println!("FAIL: {failures} check(s) failed");
        Ok(1)
    }
}

fn print_lease(l: &LeaseView) {
    let deadline = l.deadline_ms;
    println!(
        "  lease     {} (tenant {}, generation {}), deadline {} ({} ms since the epoch)",
        l.id,
        l.tenant,
        l.generation,
        relative(deadline),
        deadline
    );
    for g in &l.gpus {
        println!("  leased    {} #{} {} uuid {}", g.server, g.ordinal, g.model, g.uuid);
    }
}

fn print_device(d: &Driver) {
    let mut total = 0usize;
    let (mut major, mut minor, mut sms) = (0, 0, 0);
    unsafe {
        (d.cuDeviceTotalMem_v2)(&mut total, 0);
        (d.cuDeviceGetAttribute)(&mut major, Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0);
        (d.cuDeviceGetAttribute)(&mut minor, Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0);
        (d.cuDeviceGetAttribute)(&mut sms, Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0);
    }
    let name = d.device_name(0);
    // The sim names its devices after their compute capability already.
    let cc = if name.contains("compute capability") { String::new() } else { format!("compute capability {major}.{minor}, ") };
    println!("  device 0  {name} ({cc}{sms} SMs, {:.1} GiB)", total as f64 / (1u64 << 30) as f64);
}

fn ok(what: &str) {
    println!("  [ok]  {what}");
}

fn workload(d: &Driver, size_mib: usize) -> Result<u32> {
    let mut failures = 0;
    let n = size_mib << 20;
    let words = n / 4;
    let host: Vec<u32> = (0..words as u32).map(|i| i.wrapping_mul(2654435761)).collect();
    let mut back = vec![0u32; words];
    let (mut a, mut b) = (0u64, 0u64);
    unsafe {
        d.check("cuMemAlloc", (d.cuMemAlloc_v2)(&mut a, n))?;
        d.check("cuMemAlloc", (d.cuMemAlloc_v2)(&mut b, n))?;

        let t = Instant::now();
        d.check("cuMemcpyHtoD", (d.cuMemcpyHtoD_v2)(a, host.as_ptr() as *const c_void, n))?;
        d.check("cuCtxSynchronize", (d.cuCtxSynchronize)())?;
        let h2d = t.elapsed();
        ok(&format!(
            "{size_mib} MiB host->device in {:.1} ms ({:.2} GiB/s, first touch of the memory included; `rgpu bench` measures warm copies)",
            ms(h2d),
            gibs(n, h2d)
        ));

        d.check("cuMemcpyDtoD", (d.cuMemcpyDtoD_v2)(b, a, n))?;
        d.check("cuMemsetD32", (d.cuMemsetD32_v2)(b, 0xC0FFEE, 1024))?;
        let t = Instant::now();
        d.check("cuMemcpyDtoH", (d.cuMemcpyDtoH_v2)(back.as_mut_ptr() as *mut c_void, b, n))?;
        let d2h = t.elapsed();
        let good = back[..1024].iter().all(|&w| w == 0xC0FFEE) && back[1024..] == host[1024..];
        if good {
            ok(&format!(
                "device->device copy and memset checked; {size_mib} MiB device->host in {:.1} ms ({:.2} GiB/s)",
                ms(d2h),
                gibs(n, d2h)
            ));
        } else {
            println!("  [FAIL] data read back differs from what was written");
            failures += 1;
        }

        // Events time work on the device's own clock.
        let (mut e0, mut e1) = (std::ptr::null_mut(), std::ptr::null_mut());
        d.check("cuEventCreate", (d.cuEventCreate)(&mut e0, 0))?;
        d.check("cuEventCreate", (d.cuEventCreate)(&mut e1, 0))?;
        let mut stream = std::ptr::null_mut();
        d.check("cuStreamCreate", (d.cuStreamCreate)(&mut stream, 0))?;
        d.check("cuEventRecord", (d.cuEventRecord)(e0, stream))?;
        for i in 0..10 {
            d.check("cuMemsetD32Async", (d.cuMemsetD32Async)(a, i, words, stream))?;
        }
        d.check("cuEventRecord", (d.cuEventRecord)(e1, stream))?;
        d.check("cuEventSynchronize", (d.cuEventSynchronize)(e1))?;
        let mut elapsed = 0f32;
        d.check("cuEventElapsedTime", (d.cuEventElapsedTime)(&mut elapsed, e0, e1))?;
        ok(&format!("10 asynchronous {size_mib} MiB memsets on a stream: {elapsed:.2} ms of device time (events)"));

        // Sync round trips.
        let mut lat = Vec::with_capacity(1000);
        for _ in 0..1000 {
            let t = Instant::now();
            d.check("cuStreamQuery", (d.cuStreamQuery)(stream))?;
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
        lat.sort_by(|x, y| x.total_cmp(y));
        ok(&format!("synchronising call round trip: median {:.1} us over 1000 cuStreamQuery", lat[500]));

        failures += kernels(d, a, words as u32, &host)?;
        d.check("cuStreamDestroy", (d.cuStreamDestroy_v2)(stream))?;
        d.check("cuMemFree", (d.cuMemFree_v2)(a))?;
        d.check("cuMemFree", (d.cuMemFree_v2)(b))?;
    }
    Ok(failures)
}

unsafe fn kernels(d: &Driver, buf: u64, n: u32, _host: &[u32]) -> Result<u32> {
    let mut m = std::ptr::null_mut();
    d.check("cuModuleLoadData", (d.cuModuleLoadData)(&mut m, DEMO_PTX.as_ptr() as *const c_void))?;
    let (mut empty, mut add_one) = (std::ptr::null_mut(), std::ptr::null_mut());
    let name = CString::new("empty")?;
    d.check("cuModuleGetFunction(empty)", (d.cuModuleGetFunction)(&mut empty, m, name.as_ptr()))?;
    let name = CString::new("add_one")?;
    d.check("cuModuleGetFunction(add_one)", (d.cuModuleGetFunction)(&mut add_one, m, name.as_ptr()))?;
    ok("PTX module loaded on the server; kernels `empty` and `add_one` found with their parameter layouts");

    // Fill with 1.0f, run add_one, expect 2.0f.
    d.check("cuMemsetD32", (d.cuMemsetD32_v2)(buf, 1.0f32.to_bits(), n as usize))?;
    let (mut p0, mut p1) = (buf, n);
    let mut params = [&mut p0 as *mut u64 as *mut c_void, &mut p1 as *mut u32 as *mut c_void];
    let grid = n.div_ceil(256);
    let r = (d.cuLaunchKernel)(add_one, grid, 1, 1, 256, 1, 1, 0, std::ptr::null_mut(), params.as_mut_ptr(), std::ptr::null_mut());
    if r == CuResult::CUDA_ERROR_NOT_SUPPORTED {
        println!(
            "  [--]  add_one launch: {} — this server's backend does not execute this kernel yet",
            crate::driver::error_name(CuError::NOT_SUPPORTED)
        );
        return Ok(0);
    }
    d.check("cuLaunchKernel(add_one)", r)?;
    d.check("cuCtxSynchronize", (d.cuCtxSynchronize)())?;
    let mut out = vec![0f32; n as usize];
    d.check("cuMemcpyDtoH", (d.cuMemcpyDtoH_v2)(out.as_mut_ptr() as *mut c_void, buf, n as usize * 4))?;
    if out.iter().all(|&x| x == 2.0) {
        ok(&format!("add_one over {n} floats computed on the device and checked"));
        Ok(0)
    } else {
        println!("  [FAIL] add_one produced wrong values");
        Ok(1)
    }
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn gibs(bytes: usize, d: std::time::Duration) -> f64 {
    bytes as f64 / (1u64 << 30) as f64 / d.as_secs_f64().max(1e-9)
}

