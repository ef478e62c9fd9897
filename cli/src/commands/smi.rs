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
    compute_capability: String,
    server: String,
    backend: String,
}

pub fn exec(a: Args) -> Result<i32> {
    if a.server.is_empty() {
        bail!("no GPU servers: give --server HOST:PORT[,HOST:PORT...] (or RGPU_SERVERS)");
    }
    let security = a.tls.security()?;
    let mut gpus = Vec::new();
    for addr in &a.server {
        let inv = rgpu_control_client::inventory(addr, "rgpu smi", &security)?;
        for d in inv.devices {
            let attr = |x: A| d.attributes.iter().find(|(id, _)| *id == x.0).map_or(0, |&(_, v)| v);
            gpus.push(Gpu {
                index: gpus.len(),
                uuid: rgpu_control_client::uuid_text(&d.uuid),
                pci_bus_id: format!("{:08X}:{:02X}:{:02X}.0", d.pci.0, d.pci.1, d.pci.2),
                memory_total: d.total_mem,
                compute_capability: format!(
                    "{}.{}",
                    attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                    attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
                ),
                name: d.name,
                server: addr.clone(),
                backend: inv.backend.clone(),
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
                format!("{} MiB", g.memory_total >> 20),
                g.compute_capability.clone(),
                format!("{} ({})", g.server, g.backend),
            ]
        })
        .collect();
    let head = ["GPU", "NAME", "UUID", "BUS-ID", "MEMORY", "CC", "SERVER"].map(String::from);
    let mut width = head.clone().map(|h| h.len());
    for r in &rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    for r in std::iter::once(&head).chain(&rows) {
        let line: Vec<String> = r.iter().zip(width).map(|(c, w)| format!("{c:<w$}")).collect();
        println!("{}", line.join("  ").trim_end());
    }
    Ok(0)
}
