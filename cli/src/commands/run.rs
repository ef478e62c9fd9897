//! `rgpu run --server ADDR[,ADDR...] -- PROGRAM [ARGS...]`

use std::os::unix::process::ExitStatusExt;
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::paths;

/// Run a program with rgpu's libcuda.so.1, its CUDA calls going to the servers.
#[derive(clap::Args)]
pub struct Args {
    /// GPU servers, host:port, comma-separated; each server's devices become
    /// CUDA devices in this order. Default: $RGPU_SERVERS.
    #[arg(long, value_delimiter = ',', env = "RGPU_SERVERS")]
    server: Vec<String>,
    /// The program and its arguments.
    #[arg(trailing_var_arg = true, required = true)]
    program: Vec<String>,
}

pub fn exec(a: Args) -> Result<i32> {
    if a.server.is_empty() {
        bail!("no server given: use --server HOST:PORT or set RGPU_SERVERS");
    }
    let dir = paths::driver_dir()?;
    let mut ld = dir.as_os_str().to_owned();
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|o| !o.is_empty()) {
        ld.push(":");
        ld.push(old);
    }
    let status = Command::new(&a.program[0])
        .args(&a.program[1..])
        .env("LD_LIBRARY_PATH", ld)
        .env("RGPU_SERVERS", a.server.join(","))
        .status()
        .with_context(|| format!("cannot run {}", a.program[0]))?;
    Ok(status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0)))
}
