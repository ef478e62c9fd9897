//! `rgpu run --server ADDR[,ADDR...] -- PROGRAM [ARGS...]`, or with a lease:
//! `rgpu run --gpus N [--memory 20GiB] [--same leaf] -- PROGRAM`.
//! SIGINT, SIGTERM and SIGHUP are passed on to the program, and the program
//! dies with `rgpu run` ([`crate::supervise`]).

use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Result};
use rgpu_broker_client::{BrokerClient, Credential};
use rgpu_tls::ClientSecurity;

use crate::paths;
use crate::pool::{self, BrokerArgs, LeaseArgs};

/// Run a program with rgpu's libcuda.so.1, its CUDA calls going to the
/// servers; with --gpus/--memory/--compute, on GPUs leased from the broker
/// (renewed while it runs, released when it exits or on Ctrl-C).
#[derive(clap::Args)]
pub struct Args {
    /// GPU servers, host:port, comma-separated; each server's devices become
    /// CUDA devices in this order.
    #[arg(long, value_delimiter = ',', env = "RGPU_SERVERS")]
    server: Vec<String>,
    #[command(flatten)]
    broker: BrokerArgs,
    #[command(flatten)]
    lease: LeaseArgs,
    /// The program and its arguments.
    #[arg(trailing_var_arg = true, required = true)]
    program: Vec<String>,
}

const RUN_TTL_MS: u64 = 60_000;

pub fn exec(a: Args) -> Result<i32> {
    let leased = a.lease.gpus.is_some() || a.lease.memory.is_some() || a.lease.compute.is_some();
    if !leased {
        if a.server.is_empty() {
            bail!(
                "no GPUs to run on: give servers with --server HOST:PORT[,HOST:PORT...] (or RGPU_SERVERS), \
                 or lease from the broker with --gpus N or --memory SIZE"
            );
        }
        let mut env = vec![("RGPU_SERVERS".to_string(), Some(a.server.join(",")))];
        env.extend(a.broker.tls.env()?);
        return run_program(&a.program, &env);
    }
    let client = a.broker.connect()?;
    let key = a.lease.client_key()?;
    let spec = a.lease.bound_spec(RUN_TTL_MS, key.as_ref());
    let lease = client.lease(&spec)?;
    let id = lease.id_u64();
    eprintln!(
        "rgpu: lease {} ({} GPU(s) on {}) for {}",
        lease.id,
        lease.gpus.len(),
        lease.servers().join(","),
        a.program[0]
    );
    // Ctrl-C goes to the program (same process group), SIGTERM and SIGHUP
    // are forwarded to it (crate::supervise); we stay to release.
    let done = Arc::new(AtomicBool::new(false));
    let renewer = {
        let (done, addr, ttl) = (done.clone(), a.broker.broker.clone(), spec.ttl_ms.max(3000));
        let (cred, security) = (client.credential.clone(), a.broker.tls.security()?);
        std::thread::spawn(move || renew_loop(&addr, &cred, &security, id, ttl, &done))
    };
    // The program's shim talks to the leased servers as this process talks
    // to the broker: one CA (or plaintext) for the pool.
    let mut env: Vec<(String, Option<String>)> = pool::lease_env(&lease).into_iter().map(|(k, v)| (k, Some(v))).collect();
    env.extend(a.broker.tls.env()?);
    if let Some(k) = &key {
        env.push((rgpu_control_client::client_key::ENV.to_string(), Some(k.path.display().to_string())));
    }
    let result = run_program(&a.program, &env);
    done.store(true, Ordering::Release);
    let _ = renewer.join();
    match client.release(id) {
        Ok(_) => eprintln!("rgpu: lease {} released", lease.id),
        Err(e) => eprintln!("rgpu: could not release lease {}: {e} (it expires by itself)", lease.id),
    }
    result
}

/// Renews every third of the TTL until `done`; says so once if the lease
/// is lost or revoked.
fn renew_loop(addr: &str, cred: &Credential, security: &ClientSecurity, id: u64, ttl_ms: u64, done: &AtomicBool) {
    let every = Duration::from_millis(ttl_ms / 3);
    let mut client: Option<BrokerClient> = None;
    let mut waited = Duration::ZERO;
    while !done.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(100));
        waited += Duration::from_millis(100);
        if waited < every {
            continue;
        }
        waited = Duration::ZERO;
        if client.is_none() {
            client = BrokerClient::connect(addr, cred, security).ok();
        }
        let Some(c) = &client else { continue };
        match c.renew(id, ttl_ms) {
            Ok(_) => {}
            // No leader within the client's failover wait: try again later.
            Err(e) if matches!(e.kind(), Some("not-leader" | "store")) => tracing::warn!("renew failed: {e}; retrying"),
            Err(e) if e.kind().is_some() => {
                eprintln!("rgpu: lease {id:016x} cannot be renewed: {e}");
                return;
            }
            Err(e) => {
                tracing::warn!("renew failed: {e}; retrying");
                client = None;
            }
        }
    }
}

/// Runs `program` with the shim first on its library path and `env` set
/// (a `None` value removes the variable).
fn run_program(program: &[String], env: &[(String, Option<String>)]) -> Result<i32> {
    let dir = paths::driver_dir()?;
    let mut ld = dir.as_os_str().to_owned();
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|o| !o.is_empty()) {
        ld.push(":");
        ld.push(old);
    }
    let mut cmd = Command::new(&program[0]);
    cmd.args(&program[1..]).env("LD_LIBRARY_PATH", ld);
    for (k, v) in env {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    let status = crate::supervise::run(cmd, &program[0])?;
    Ok(status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0)))
}
