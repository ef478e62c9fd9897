//! The trace files: `openb_node_list_*.csv` and `openb_pod_list_*.csv`
//! (format in `shared/traces/README.md`). Malformed lines are errors that
//! name the file and line.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}:{line}: {msg}")]
    Line { path: PathBuf, line: usize, msg: String },
    #[error("{path}: missing column `{column}` in the header")]
    Column { path: PathBuf, column: &'static str },
    #[error("{0}: no pod lists (openb_pod_list_*.csv) found")]
    NoWorkloads(PathBuf),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    pub name: String,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub gpus: u32,
    pub model: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Pod {
    pub name: String,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    /// 0 (CPU only), 1 (whole or a fraction), or more whole GPUs.
    pub num_gpu: u32,
    /// Share of one GPU per GPU: `gpu_milli` for one GPU, 1000 for several.
    pub gpu_milli: u32,
    /// Allowed models; empty: any.
    pub models: Vec<String>,
    pub creation: u64,
    pub deletion: Option<u64>,
    pub scheduled: Option<u64>,
}

impl Pod {
    /// GPU demand in milli-GPUs.
    pub fn gpu_demand(&self) -> u64 {
        if self.num_gpu == 0 {
            0
        } else if self.num_gpu == 1 {
            self.gpu_milli as u64
        } else {
            self.num_gpu as u64 * 1000
        }
    }

    pub fn is_fraction(&self) -> bool {
        self.num_gpu == 1 && self.gpu_milli < 1000
    }
}

struct Csv {
    path: PathBuf,
    header: Vec<String>,
    rows: Vec<(usize, Vec<String>)>,
}

fn read_csv(path: &Path) -> Result<Csv, TraceError> {
    let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io { path: path.into(), source })?;
    let mut lines = text.lines().enumerate();
    let header = match lines.next() {
        Some((_, h)) => h.split(',').map(|s| s.trim().to_string()).collect(),
        None => return Err(TraceError::Line { path: path.into(), line: 1, msg: "empty file".into() }),
    };
    let rows = lines
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| (i + 1, l.split(',').map(|s| s.trim().to_string()).collect()))
        .collect();
    Ok(Csv { path: path.into(), header, rows })
}

impl Csv {
    fn col(&self, name: &'static str) -> Result<usize, TraceError> {
        self.header.iter().position(|h| h == name).ok_or(TraceError::Column { path: self.path.clone(), column: name })
    }

    fn field<'a>(&self, line: usize, row: &'a [String], i: usize) -> Result<&'a str, TraceError> {
        row.get(i).map(|s| s.as_str()).ok_or_else(|| TraceError::Line {
            path: self.path.clone(),
            line,
            msg: format!("{} fields, expected {}", row.len(), self.header.len()),
        })
    }

    fn num(&self, line: usize, row: &[String], i: usize) -> Result<u64, TraceError> {
        let s = self.field(line, row, i)?;
        s.parse::<u64>().map_err(|_| TraceError::Line {
            path: self.path.clone(),
            line,
            msg: format!("`{}` is not a non-negative integer: {s:?}", self.header[i]),
        })
    }

    /// A column some files leave out (`multigpuN` has no spec or times).
    fn opt_col(&self, name: &str) -> Option<usize> {
        self.header.iter().position(|h| h == name)
    }

    fn opt_num_at(&self, line: usize, row: &[String], i: Option<usize>) -> Result<Option<u64>, TraceError> {
        match i {
            Some(i) => self.opt_num(line, row, i),
            None => Ok(None),
        }
    }

    fn opt_num(&self, line: usize, row: &[String], i: usize) -> Result<Option<u64>, TraceError> {
        if self.field(line, row, i)?.is_empty() {
            Ok(None)
        } else {
            self.num(line, row, i).map(Some)
        }
    }

    fn bad(&self, line: usize, msg: String) -> TraceError {
        TraceError::Line { path: self.path.clone(), line, msg }
    }
}

pub fn read_nodes(path: &Path) -> Result<Vec<Node>, TraceError> {
    let c = read_csv(path)?;
    let (sn, cpu, mem, gpu, model) = (c.col("sn")?, c.col("cpu_milli")?, c.col("memory_mib")?, c.col("gpu")?, c.col("model")?);
    let mut out = Vec::with_capacity(c.rows.len());
    for (line, row) in &c.rows {
        let gpus = c.num(*line, row, gpu)?;
        if gpus > 64 {
            return Err(c.bad(*line, format!("{gpus} GPUs on one node (at most 64)")));
        }
        out.push(Node {
            name: c.field(*line, row, sn)?.to_string(),
            cpu_milli: c.num(*line, row, cpu)?,
            memory_mib: c.num(*line, row, mem)?,
            gpus: gpus as u32,
            model: c.field(*line, row, model)?.to_string(),
        });
    }
    Ok(out)
}

pub fn read_pods(path: &Path) -> Result<Vec<Pod>, TraceError> {
    let c = read_csv(path)?;
    let name = c.col("name")?;
    let (cpu, mem, ng, gm) = (c.col("cpu_milli")?, c.col("memory_mib")?, c.col("num_gpu")?, c.col("gpu_milli")?);
    let spec = c.opt_col("gpu_spec");
    let (ct, dt, st) = (c.opt_col("creation_time"), c.opt_col("deletion_time"), c.opt_col("scheduled_time"));
    let mut out = Vec::with_capacity(c.rows.len());
    for (line, row) in &c.rows {
        let num_gpu = c.num(*line, row, ng)?;
        if num_gpu > 64 {
            return Err(c.bad(*line, format!("num_gpu {num_gpu} (at most 64)")));
        }
        let milli = c.opt_num(*line, row, gm)?.unwrap_or(0);
        let gpu_milli = match num_gpu {
            0 => 0,
            1 => {
                if milli == 0 || milli > 1000 {
                    return Err(c.bad(*line, format!("gpu_milli {milli} for a one-GPU pod (1..=1000)")));
                }
                milli as u32
            }
            _ => 1000,
        };
        let models = match spec {
            Some(i) => c.field(*line, row, i)?.split('|').filter(|s| !s.is_empty()).map(str::to_string).collect(),
            None => Vec::new(),
        };
        let creation = c.opt_num_at(*line, row, ct)?.unwrap_or(0);
        let deletion = c.opt_num_at(*line, row, dt)?;
        if deletion.is_some_and(|d| d < creation) {
            return Err(c.bad(*line, "deletion_time before creation_time".into()));
        }
        out.push(Pod {
            name: c.field(*line, row, name)?.to_string(),
            cpu_milli: c.num(*line, row, cpu)?,
            memory_mib: c.num(*line, row, mem)?,
            num_gpu: num_gpu as u32,
            gpu_milli,
            models,
            creation,
            deletion,
            scheduled: c.opt_num_at(*line, row, st)?,
        });
    }
    Ok(out)
}

/// The workloads in a trace folder: (name, path) of each
/// `openb_pod_list_<name>.csv`, sorted with `default` first.
pub fn workloads(dir: &Path) -> Result<Vec<(String, PathBuf)>, TraceError> {
    let rd = std::fs::read_dir(dir).map_err(|source| TraceError::Io { path: dir.into(), source })?;
    let mut out = Vec::new();
    for e in rd {
        let e = e.map_err(|source| TraceError::Io { path: dir.into(), source })?;
        let f = e.file_name().to_string_lossy().to_string();
        if let Some(n) = f.strip_prefix("openb_pod_list_").and_then(|s| s.strip_suffix(".csv")) {
            out.push((n.to_string(), e.path()));
        }
    }
    if out.is_empty() {
        return Err(TraceError::NoWorkloads(dir.into()));
    }
    out.sort_by(|a, b| (a.0 != "default", &a.0).cmp(&(b.0 != "default", &b.0)));
    Ok(out)
}

/// Do the pods carry creation and deletion times (for the dynamic replay)?
pub fn has_times(pods: &[Pod]) -> bool {
    pods.iter().any(|p| p.deletion.is_some())
}
