//! `rgpu smi [--server ADDR,...] [--json]`

use anyhow::{bail, Result};
use rgpu_cuda_types::CUdevice_attribute as A;
use serde::Serialize;

/// List the GPUs a program run here would see, as nvidia-smi does
///
/// The servers' devices in CUDA's order, narrowed to the lease's GPUs (and memory) by
/// RGPU_TOKEN.
#[derive(clap::Args)]
pub struct Args {
    /// GPU servers, host:port, comma-separated, in the order their devices become CUDA devices.
    #[arg(long, value_delimiter = ',', env = "RGPU_SERVERS")]
    server: Vec<String>,
    /// Print JSON on stdout instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    tls: crate::tls::TlsArgs,
}

#[derive(Serialize)]
struct Gpu {
    index: usize,
    name: String,
    uuid: String,
    pci_bus_id: String,
    /// Bytes; the lease's memory limit when a token caps it.
    memory_total: u64,
    /// Bytes allocated now (by the lease's sessions, with a token); None
    /// where the server did not say.
    memory_used: Option<u64>,
    compute_capability: String,
    server: String,
    backend: String,
    /// The client processes holding memory on it (the lease's, with a token).
    processes: Vec<Process>,
}

#[derive(Serialize)]
struct Process {
    /// On its client host.
    pid: u32,
    /// Bytes.
    memory_used: u64,
}

pub fn exec(a: Args) -> Result<i32> {
    if a.server.is_empty() {
        bail!("no GPU servers: give --server HOST:PORT[,HOST:PORT...] (or RGPU_SERVERS)");
    }
    let security = a.tls.security()?;
    let mut gpus = Vec::new();
    for addr in &a.server {
        let inv = rgpu_control_client::inventory(addr, "rgpu smi", &security)?;
        let status = match rgpu_control_client::device_status(addr, "rgpu smi", &security) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("{addr}: no memory use: {e}");
                Vec::new()
            }
        };
        for d in inv.devices {
            let st = status.iter().find(|s| s.ordinal == d.ordinal);
            let memory_used = st.map(|s| s.used_mem);
            let processes = st
                .map(|s| s.processes.iter().map(|&(pid, memory_used)| Process { pid, memory_used }).collect())
                .unwrap_or_default();
            let attr = |x: A| d.attributes.iter().find(|(id, _)| *id == x.0).map_or(0, |&(_, v)| v);
            gpus.push(Gpu {
                index: gpus.len(),
                uuid: rgpu_control_client::uuid_text(&d.uuid),
                pci_bus_id: format!("{:08X}:{:02X}:{:02X}.0", d.pci.0, d.pci.1, d.pci.2),
                memory_total: d.total_mem,
                memory_used,
                compute_capability: format!(
                    "{}.{}",
                    attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                    attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
                ),
                name: d.name,
                server: addr.clone(),
                backend: inv.backend.clone(),
                processes,
            });
        }
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&gpus)?);
        return Ok(0);
    }
    let rows: Vec<[String; 7]> = gpus
        .iter()
        .map(|g| {
            [
                g.index.to_string(),
                g.name.clone(),
                g.uuid.clone(),
                g.pci_bus_id.clone(),
                match g.memory_used {
                    Some(u) => format!("{} / {} MiB", u >> 20, g.memory_total >> 20),
                    None => format!("? / {} MiB", g.memory_total >> 20),
                },
                g.compute_capability.clone(),
                format!("{} ({})", g.server, g.backend),
            ]
        })
        .collect();
    crate::table::print(["GPU", "NAME", "UUID", "BUS-ID", "MEMORY USED / TOTAL", "CC", "SERVER"], &rows);
    let procs: Vec<[String; 3]> = gpus
        .iter()
        .flat_map(|g| g.processes.iter().map(move |p| [g.index.to_string(), p.pid.to_string(), format!("{} MiB", p.memory_used >> 20)]))
        .collect();
    println!();
    if procs.is_empty() {
        println!("No processes hold GPU memory.");
    } else {
        crate::table::print(["GPU", "PID", "MEMORY USED"], &procs);
    }
    Ok(0)
}
