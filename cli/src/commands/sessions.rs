//! `rgpu sessions --server ADDR --key-file FILE [--json]`

use std::time::Duration;

use anyhow::Result;


/// List the sessions a GPU server serves now: the ids `rgpu checkpoint` and
/// `rgpu migrate` take, with each one's client, lease and use so far.
#[derive(clap::Args)]
pub struct Args {
    /// The GPU server (host:port).
    #[arg(long)]
    server: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    operator: crate::operator::OperatorArgs,
}

#[derive(serde::Serialize)]
struct Row {
    id: String,
    client: String,
    lease: Option<u64>,
    memory: u64,
    kernels: u64,
    bytes_in: u64,
    bytes_out: u64,
}

pub fn exec(a: Args) -> Result<i32> {
    let (key, security) = a.operator.open()?;
    let sessions = rgpu_control_client::operator::list_sessions(&a.server, &security, &key, Duration::from_secs(30))?;
    let rows: Vec<Row> = sessions
        .into_iter()
        .map(|s| Row {
            id: format!("{:#018x}", s.id),
            client: s.client,
            lease: (s.lease != 0).then_some(s.lease),
            memory: s.memory,
            kernels: s.kernels,
            bytes_in: s.bytes_in,
            bytes_out: s.bytes_out,
        })
        .collect();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(0);
    }
    let mib = |b: u64| format!("{:.1} MiB", b as f64 / (1 << 20) as f64);
    let table: Vec<[String; 6]> = rows
        .iter()
        .map(|r| {
            [
                r.id.clone(),
                r.client.clone(),
                r.lease.map_or("-".into(), |l| l.to_string()),
                mib(r.memory),
                r.kernels.to_string(),
                format!("{} / {}", mib(r.bytes_in), mib(r.bytes_out)),
            ]
        })
        .collect();
    crate::table::print(["SESSION", "CLIENT", "LEASE", "MEMORY", "KERNELS", "IN / OUT"], &table);
    Ok(0)
}
