//! Byte quotas: a limit and what is held against it, taken and given back
//! by RAII charges. The server bounds with them what hostile input can make
//! it hold: the input it buffers at once (all connections together) and the
//! module images a lease (or a session without one) keeps loaded.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

#[derive(Debug)]
pub struct ByteQuota {
    limit: u64,
    used: AtomicU64,
}

impl ByteQuota {
    pub fn new(limit: u64) -> Arc<Self> {
        Arc::new(ByteQuota { limit, used: AtomicU64::new(0) })
    }

    /// No limit (tests, and callers that set none).
    pub fn unlimited() -> Arc<Self> {
        Self::new(u64::MAX)
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    /// Takes `bytes`, or nothing when that would pass the limit.
    pub fn charge(self: &Arc<Self>, bytes: u64) -> Option<Charge> {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| u.checked_add(bytes).filter(|&n| n <= self.limit))
            .ok()?;
        Some(Charge { quota: self.clone(), bytes })
    }
}

/// Bytes held against a [`ByteQuota`] until this is dropped.
#[derive(Debug)]
pub struct Charge {
    quota: Arc<ByteQuota>,
    bytes: u64,
}

impl Charge {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Takes `more` bytes into this charge, or nothing when that would pass
    /// the limit.
    pub fn grow(&mut self, more: u64) -> bool {
        match self.quota.charge(more) {
            Some(c) => {
                self.bytes += c.bytes;
                std::mem::forget(c);
                true
            }
            None => false,
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.quota.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_hold_until_dropped() {
        let q = ByteQuota::new(100);
        let a = q.charge(60).unwrap();
        assert!(q.charge(41).is_none(), "60 + 41 > 100");
        let mut b = q.charge(40).unwrap();
        assert!(!b.grow(1));
        assert_eq!(q.used(), 100);
        drop(a);
        assert!(b.grow(60));
        assert_eq!((b.bytes(), q.used()), (100, 100));
        drop(b);
        assert_eq!(q.used(), 0);
        assert!(ByteQuota::unlimited().charge(u64::MAX).is_some());
    }
}
