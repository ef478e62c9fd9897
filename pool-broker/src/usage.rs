//! What leases and servers used, as GPU servers report it on heartbeats
//! (server/src/metering.rs measures it). Each report is cumulative, so
//! the last one from each server is the truth for that server: a lost
//! heartbeat loses nothing, and a lease on several servers sums its
//! servers' last reports.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// Metered use, cumulative.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub kernels: u64,
    /// Device time of the kernels, ns; None where a backend cannot time them.
    pub kernel_ns: Option<u64>,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub memory: u64,
    pub memory_peak: u64,
}

impl Usage {
    pub fn read(r: rgpu_protocol::broker_capnp::usage::Reader<'_>) -> Usage {
        Usage {
            kernels: r.get_kernels(),
            kernel_ns: r.get_kernel_timed().then(|| r.get_kernel_ns()),
            bytes_in: r.get_bytes_in(),
            bytes_out: r.get_bytes_out(),
            memory: r.get_memory(),
            memory_peak: r.get_memory_peak(),
        }
    }

    pub fn write(&self, mut b: rgpu_protocol::broker_capnp::usage::Builder<'_>) {
        b.set_kernels(self.kernels);
        b.set_kernel_timed(self.kernel_ns.is_some());
        b.set_kernel_ns(self.kernel_ns.unwrap_or(0));
        b.set_bytes_in(self.bytes_in);
        b.set_bytes_out(self.bytes_out);
        b.set_memory(self.memory);
        b.set_memory_peak(self.memory_peak);
    }

    /// Adds another server's report of the same lease. Kernel time stays
    /// known only if both know it; the peak is the sum of peaks (each
    /// server's GPUs are separate memory).
    pub fn add(&mut self, o: &Usage) {
        self.kernels = self.kernels.saturating_add(o.kernels);
        self.kernel_ns = self.kernel_ns.zip(o.kernel_ns).map(|(a, b)| a.saturating_add(b));
        self.bytes_in = self.bytes_in.saturating_add(o.bytes_in);
        self.bytes_out = self.bytes_out.saturating_add(o.bytes_out);
        self.memory = self.memory.saturating_add(o.memory);
        self.memory_peak = self.memory_peak.saturating_add(o.memory_peak);
    }
}

/// The last report of each server, per lease and in all.
#[derive(Default)]
pub struct Book {
    /// Lease -> server -> its last report.
    leases: HashMap<u64, HashMap<String, Usage>>,
    servers: HashMap<String, Usage>,
}

/// Reports kept per heartbeat: a server cannot make the broker hold more
/// (its leases are far fewer; the rest are ignored).
pub const MAX_REPORTS: usize = 4096;

impl Book {
    /// `server`'s heartbeat: its per-lease reports (only leases in `ours`,
    /// those the broker placed there, are kept) and its total.
    pub fn report(&mut self, server: &str, leases: Vec<(u64, Usage)>, total: Usage, ours: impl Fn(u64) -> bool) {
        for (lease, u) in leases.into_iter().take(MAX_REPORTS) {
            if ours(lease) {
                self.leases.entry(lease).or_default().insert(server.to_string(), u);
            }
        }
        self.servers.insert(server.to_string(), total);
    }

    /// A lease's use so far, summed over its servers; None if none reported.
    pub fn lease(&self, lease: u64) -> Option<Usage> {
        let by = self.leases.get(&lease)?;
        let mut it = by.values();
        let mut u = *it.next()?;
        for x in it {
            u.add(x);
        }
        Some(u)
    }

    pub fn server(&self, server: &str) -> Option<Usage> {
        self.servers.get(server).copied()
    }

    /// The lease ended: its last use, forgotten here.
    pub fn take(&mut self, lease: u64) -> Option<Usage> {
        let u = self.lease(lease);
        self.leases.remove(&lease);
        u
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u(kernels: u64, ns: Option<u64>) -> Usage {
        Usage { kernels, kernel_ns: ns, bytes_in: 10, bytes_out: 1, memory: 5, memory_peak: 7 }
    }

    #[test]
    fn the_last_report_of_each_server_counts() {
        let mut b = Book::default();
        b.report("s1", vec![(1, u(2, Some(100)))], u(9, Some(900)), |_| true);
        b.report("s1", vec![(1, u(3, Some(150)))], u(9, Some(900)), |_| true);
        b.report("s2", vec![(1, u(1, Some(50))), (2, u(1, None))], u(1, None), |l| l == 1);
        let l = b.lease(1).unwrap();
        assert_eq!((l.kernels, l.kernel_ns, l.bytes_in, l.memory_peak), (4, Some(200), 20, 14));
        assert_eq!(b.lease(2), None, "a lease the broker did not place there is not kept");
        assert_eq!(b.server("s2").unwrap().kernel_ns, None);
        assert_eq!(b.take(1).unwrap().kernels, 4);
        assert_eq!(b.lease(1), None);
    }
}

/// The accounting record of an ended lease, kept durably by the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub lease: u64,
    pub tenant: String,
    pub gpus: u32,
    pub servers: Vec<String>,
    /// Bytes per GPU of a fractional lease; 0: whole GPUs.
    pub memory_limit: u64,
    pub compute_milli: u32,
    pub granted_ms: u64,
    pub ended_ms: u64,
    /// "released", "expired" or "revoked".
    pub why: String,
    /// What its sessions used; None: no server reported any.
    pub usage: Option<Usage>,
}

impl Record {
    pub fn write(&self, mut b: rgpu_protocol::broker_capnp::usage_record::Builder<'_>) {
        b.set_lease(self.lease);
        b.set_tenant(&self.tenant);
        b.set_gpus(self.gpus);
        let mut s = b.reborrow().init_servers(self.servers.len() as u32);
        for (i, x) in self.servers.iter().enumerate() {
            s.set(i as u32, x);
        }
        b.set_memory_limit(self.memory_limit);
        b.set_compute_milli(self.compute_milli);
        b.set_granted_ms(self.granted_ms);
        b.set_ended_ms(self.ended_ms);
        b.set_why(&self.why);
        b.set_reported(self.usage.is_some());
        self.usage.unwrap_or_default().write(b.init_usage());
    }
}
