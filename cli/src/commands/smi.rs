//! `rgpu smi [--server ADDR,...] [--json]`

use anyhow::{bail, Result};
use rgpu_cuda_types::CUdevice_attribute as A;
use rgpu_control_client::Reading;
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
    /// Percent of the last second a kernel ran (whole device); null where not reported.
    utilization_gpu: Option<Value>,
    /// Percent of the last second device memory was read or written.
    utilization_memory: Option<Value>,
    /// Degrees Celsius, the GPU die.
    temperature_c: Option<Value>,
    /// Milliwatts the board draws.
    power_mw: Option<Value>,
    /// Milliwatts, the enforced power limit.
    power_limit_mw: Option<Value>,
}

/// A reading and where it came from: "measured", or "simulated" (the sim's constants for
/// sensors it does not have).
#[derive(Serialize)]
struct Value {
    value: u32,
    source: &'static str,
}

fn value(r: Reading) -> Option<Value> {
    match r {
        Reading::NotReported => None,
        Reading::Measured(value) => Some(Value { value, source: "measured" }),
        Reading::Simulated(value) => Some(Value { value, source: "simulated" }),
    }
}

/// Draw and limit in watts, marked once where either is simulated.
fn power_cell(power: &Option<Value>, limit: &Option<Value>) -> String {
    if power.is_none() && limit.is_none() {
        return "N/A".to_string();
    }
    let watts = |v: &Option<Value>| v.as_ref().map_or("N/A".to_string(), |v| format!("{}W", v.value / 1000));
    let sim = [power, limit].iter().any(|v| v.as_ref().is_some_and(|v| v.source == "simulated"));
    format!("{} / {}{}", watts(power), watts(limit), if sim { " (sim)" } else { "" })
}

/// `v` in the table's words: N/A where not reported, marked where simulated.
fn cell(v: &Option<Value>, show: impl Fn(u32) -> String) -> String {
    match v {
        None => "N/A".to_string(),
        Some(Value { value, source: "simulated" }) => format!("{} (sim)", show(*value)),
        Some(Value { value, .. }) => show(*value),
    }
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
            let t = st.map(|s| s.telemetry).unwrap_or_default();
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
                utilization_gpu: value(t.gpu_utilization),
                utilization_memory: value(t.memory_utilization),
                temperature_c: value(t.temperature),
                power_mw: value(t.power_usage),
                power_limit_mw: value(t.power_limit),
            });
        }
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&gpus)?);
        return Ok(0);
    }
    let rows: Vec<[String; 10]> = gpus
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
                cell(&g.utilization_gpu, |v| format!("{v}%")),
                cell(&g.temperature_c, |v| format!("{v}C")),
                power_cell(&g.power_mw, &g.power_limit_mw),
                g.compute_capability.clone(),
                format!("{} ({})", g.server, g.backend),
            ]
        })
        .collect();
    crate::table::print(
        ["GPU", "NAME", "UUID", "BUS-ID", "MEMORY USED / TOTAL", "UTIL", "TEMP", "POWER / LIMIT", "CC", "SERVER"],
        &rows,
    );
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_cells_say_na_and_mark_simulated_readings() {
        let pct = |v: u32| format!("{v}%");
        assert_eq!(cell(&value(Reading::Measured(73)), pct), "73%");
        assert_eq!(cell(&value(Reading::Simulated(40)), |v| format!("{v}C")), "40C (sim)");
        assert_eq!(cell(&value(Reading::NotReported), pct), "N/A");
        let (p, l) = (value(Reading::Measured(250_500)), value(Reading::Measured(400_000)));
        assert_eq!(power_cell(&p, &l), "250W / 400W");
        assert_eq!(power_cell(&p, &None), "250W / N/A");
        assert_eq!(power_cell(&None, &None), "N/A");
        assert_eq!(power_cell(&value(Reading::Simulated(60_000)), &value(Reading::Simulated(400_000))), "60W / 400W (sim)");
    }
}
