//! Device health: what a backend observes of each GPU's health
//! ([`crate::backend::Backend::health`]), the faults an operator injects
//! into the sim's devices (`injectFault` on the control plane), and what
//! the broker agent last reported, so that a heartbeat carries only the
//! changes (docs/migration.md "Evacuation of unhealthy devices").

use std::collections::BTreeMap;
use std::sync::Mutex;

use thiserror::Error;

/// Longest reason sent to the broker (it keeps no more).
pub const MAX_REASON: usize = 256;

/// One device's health. `reason` says why it is unhealthy (empty when it
/// is healthy).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceHealth {
    pub healthy: bool,
    pub reason: String,
}

impl DeviceHealth {
    pub fn healthy() -> Self {
        DeviceHealth { healthy: true, reason: String::new() }
    }

    pub fn failing(reason: impl Into<String>) -> Self {
        let mut reason: String = reason.into();
        if reason.len() > MAX_REASON {
            let mut cut = MAX_REASON;
            while !reason.is_char_boundary(cut) {
                cut -= 1;
            }
            reason.truncate(cut);
        }
        DeviceHealth { healthy: false, reason }
    }
}

/// A fault an operator injects into a sim device, standing for what makes
/// a real GPU unfit to keep leases on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// An uncorrectable (double-bit) ECC error.
    UncorrectableEcc,
    /// An Xid error of this number (NVIDIA's driver's error log).
    Xid(u32),
}

#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum HealthError {
    #[error("unknown fault kind {0:?}: expected \"ecc\" (an uncorrectable ECC error) or \"xid:N\"")]
    Kind(String),
    #[error("no device {0} on this server")]
    NoDevice(u32),
    #[error("the {0} backend reports the health its GPUs report; faults are injected on the sim backend only")]
    NotInjectable(&'static str),
}

impl Fault {
    /// `ecc`, or `xid:N` (N at most 9 digits).
    pub fn parse(kind: &str) -> Result<Fault, HealthError> {
        let k = kind.trim();
        if k.eq_ignore_ascii_case("ecc") {
            return Ok(Fault::UncorrectableEcc);
        }
        let n = k.strip_prefix("xid:").or_else(|| k.strip_prefix("XID:")).filter(|n| !n.is_empty() && n.len() <= 9);
        match n.and_then(|n| n.parse().ok()) {
            Some(n) => Ok(Fault::Xid(n)),
            None => Err(HealthError::Kind(k.chars().take(64).collect())),
        }
    }

    /// The reason the device reports while it has this fault.
    pub fn reason(&self) -> String {
        match self {
            Fault::UncorrectableEcc => "uncorrectable ECC error (injected)".to_string(),
            Fault::Xid(n) => format!("Xid {n} (injected)"),
        }
    }
}

/// The faults injected into a backend's devices: the sim's health source.
#[derive(Debug, Default)]
pub struct Faults {
    by_device: Mutex<BTreeMap<u32, Fault>>,
    devices: u32,
}

impl Faults {
    pub fn new(devices: u32) -> Self {
        Faults { by_device: Mutex::default(), devices }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u32, Fault>> {
        self.by_device.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets (`Some`) or clears (`None`) device `device`'s fault; its health after.
    pub fn set(&self, device: u32, fault: Option<Fault>) -> Result<DeviceHealth, HealthError> {
        if device >= self.devices {
            return Err(HealthError::NoDevice(device));
        }
        let mut f = self.lock();
        match fault {
            Some(x) => f.insert(device, x),
            None => f.remove(&device),
        };
        Ok(f.get(&device).map_or_else(DeviceHealth::healthy, |x| DeviceHealth::failing(x.reason())))
    }

    /// Every device's health, by ordinal.
    pub fn health(&self) -> Vec<DeviceHealth> {
        let f = self.lock();
        (0..self.devices).map(|d| f.get(&d).map_or_else(DeviceHealth::healthy, |x| DeviceHealth::failing(x.reason()))).collect()
    }
}

/// The health the broker was last told (at registration or in a heartbeat
/// it answered).
#[derive(Debug, Default)]
pub struct Reported {
    last: Vec<DeviceHealth>,
}

impl Reported {
    /// Registered with `now`: the broker knows every device's health.
    pub fn registered(&mut self, now: Vec<DeviceHealth>) {
        self.last = now;
    }

    /// The devices (ordinal, health) whose health differs from what the
    /// broker was told.
    pub fn changes(&self, now: &[DeviceHealth]) -> Vec<(u32, DeviceHealth)> {
        now.iter()
            .enumerate()
            .filter(|(i, h)| self.last.get(*i) != Some(*h))
            .map(|(i, h)| (i as u32, h.clone()))
            .collect()
    }

    /// The broker answered a heartbeat that carried `sent`.
    pub fn sent(&mut self, sent: &[(u32, DeviceHealth)]) {
        for (d, h) in sent {
            let d = *d as usize;
            if self.last.len() <= d {
                self.last.resize(d + 1, DeviceHealth::healthy());
            }
            self.last[d] = h.clone();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_kinds_parse_and_others_are_refused() {
        assert_eq!(Fault::parse("ecc"), Ok(Fault::UncorrectableEcc));
        assert_eq!(Fault::parse(" ECC "), Ok(Fault::UncorrectableEcc));
        assert_eq!(Fault::parse("xid:79"), Ok(Fault::Xid(79)));
        for bad in ["", "xid:", "xid:-1", "xid:1234567890", "hot", "xid:7x"] {
            assert!(Fault::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn faults_set_clear_and_bound_the_device() {
        let f = Faults::new(2);
        assert!(f.health().iter().all(|h| h.healthy));
        let h = f.set(1, Some(Fault::Xid(48))).unwrap();
        assert!(!h.healthy && h.reason.contains("Xid 48"));
        assert_eq!(f.health(), vec![DeviceHealth::healthy(), h]);
        assert_eq!(f.set(2, Some(Fault::UncorrectableEcc)), Err(HealthError::NoDevice(2)));
        assert!(f.set(1, None).unwrap().healthy);
        assert!(f.health().iter().all(|h| h.healthy));
    }

    #[test]
    fn only_changes_are_reported_until_the_broker_answers() {
        let mut r = Reported::default();
        let ok = vec![DeviceHealth::healthy(), DeviceHealth::healthy()];
        r.registered(ok.clone());
        assert!(r.changes(&ok).is_empty());
        let bad = vec![DeviceHealth::healthy(), DeviceHealth::failing("ecc")];
        let c = r.changes(&bad);
        assert_eq!(c, vec![(1, DeviceHealth::failing("ecc"))]);
        // Unanswered: sent again.
        assert_eq!(r.changes(&bad), c);
        r.sent(&c);
        assert!(r.changes(&bad).is_empty());
        assert_eq!(r.changes(&ok), vec![(1, DeviceHealth::healthy())]);
        assert!(DeviceHealth::failing("é".repeat(1000)).reason.len() <= MAX_REASON);
    }
}
