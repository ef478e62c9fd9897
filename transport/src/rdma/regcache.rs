//! Registration cache: a buffer is registered once, not per transfer.
//!
//! Registering memory pins its pages and programs the NIC's translation
//! tables, which costs tens of microseconds per call and more per gigabyte;
//! a transport that registered every user buffer per send would spend more
//! time registering than moving data. The cache keeps registrations (rounded
//! out to whole pages) keyed by address, returns a covering one on a hit,
//! and deregisters the least recently used when its byte budget is exceeded.
//!
//! A cached registration pins the pages that were mapped when it was made.
//! If the program unmaps that memory and maps new memory at the same
//! address, the registration still names the old pages. That is why the
//! transport uses the cache for caller memory only in zero-copy mode, which
//! is for callers whose buffers stay mapped (pinned host allocations, the
//! server's staging buffers); [`RegCache::invalidate`] drops registrations
//! overlapping a range a caller knows it released.

use std::collections::BTreeMap;

use super::verbs::{Access, MemoryRegion, Verbs, VerbsError};

const PAGE: u64 = 4096;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
}

struct Entry {
    mr: MemoryRegion,
    access: Access,
    last_use: u64,
}

pub struct RegCache {
    /// By start address.
    entries: BTreeMap<u64, Entry>,
    bytes: usize,
    capacity: usize,
    clock: u64,
    pub stats: CacheStats,
}

impl RegCache {
    pub fn new(capacity: usize) -> RegCache {
        RegCache { entries: BTreeMap::new(), bytes: 0, capacity, clock: 0, stats: CacheStats::default() }
    }

    /// Bytes registered through the cache now.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// A registration covering `[addr, addr+len)` with at least `access`.
    ///
    /// # Safety
    /// As [`Verbs::reg_mr`]: the memory must stay mapped while the cache
    /// holds a registration of it (until [`RegCache::invalidate`] or
    /// [`RegCache::clear`]).
    pub unsafe fn get(
        &mut self,
        verbs: &mut dyn Verbs,
        addr: *const u8,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion, VerbsError> {
        self.clock += 1;
        let a = addr as u64;
        // The only candidates start at or below `a`; the nearest few are
        // enough because entries covering `a` usually start close to it.
        let hit = self
            .entries
            .range(..=a)
            .rev()
            .take(8)
            .find(|(_, e)| e.mr.contains(a, len) && e.access.contains(access))
            .map(|(k, _)| *k);
        if let Some(k) = hit {
            if let Some(e) = self.entries.get_mut(&k) {
                e.last_use = self.clock;
                self.stats.hits += 1;
                return Ok(e.mr);
            }
        }
        self.stats.misses += 1;
        let start = a & !(PAGE - 1);
        let end = (a + len as u64).div_ceil(PAGE) * PAGE;
        let span = (end - start) as usize;
        // Registrations this one will cover are dropped (kept disjoint-ish
        // so the lookup above stays short).
        self.invalidate_inner(verbs, start, end, Some(access));
        while self.bytes + span > self.capacity && !self.entries.is_empty() {
            self.evict_lru(verbs);
        }
        // SAFETY: forwarded to our caller.
        let mr = unsafe { verbs.reg_mr(start as *mut u8, span, access) }?;
        self.bytes += span;
        self.entries.insert(start, Entry { mr, access, last_use: self.clock });
        Ok(mr)
    }

    fn evict_lru(&mut self, verbs: &mut dyn Verbs) {
        if let Some(k) = self.entries.iter().min_by_key(|(_, e)| e.last_use).map(|(k, _)| *k) {
            self.remove(verbs, k);
            self.stats.evictions += 1;
        }
    }

    fn remove(&mut self, verbs: &mut dyn Verbs, k: u64) {
        if let Some(e) = self.entries.remove(&k) {
            self.bytes -= e.mr.len;
            if let Err(e) = verbs.dereg_mr(&e.mr) {
                tracing::debug!("deregistration failed: {e}");
            }
        }
    }

    /// Drops every registration overlapping `[addr, addr+len)`.
    pub fn invalidate(&mut self, verbs: &mut dyn Verbs, addr: *const u8, len: usize) {
        let a = addr as u64;
        self.invalidate_inner(verbs, a, a + len as u64, None);
    }

    /// Drops registrations overlapping `[start, end)`; with `inside_of`,
    /// only those inside it whose rights `inside_of` includes (superseded).
    fn invalidate_inner(&mut self, verbs: &mut dyn Verbs, start: u64, end: u64, inside_of: Option<Access>) {
        let doomed: Vec<u64> = self
            .entries
            .range(..end)
            .filter(|(k, e)| {
                let (s, t) = (**k, **k + e.mr.len as u64);
                match inside_of {
                    None => t > start,
                    Some(acc) => s >= start && t <= end && acc.contains(e.access),
                }
            })
            .map(|(k, _)| *k)
            .collect();
        for k in doomed {
            self.remove(verbs, k);
        }
    }

    /// Deregisters everything.
    pub fn clear(&mut self, verbs: &mut dyn Verbs) {
        let keys: Vec<u64> = self.entries.keys().copied().collect();
        for k in keys {
            self.remove(verbs, k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::model::{Fabric, ModelConfig};

    #[test]
    fn registers_once_and_evicts_least_recently_used() {
        let f = Fabric::new(ModelConfig::default());
        let (mut a, _b) = f.pair();
        let mut c = RegCache::new(64 << 10);
        let buf = vec![0u8; 3 * 16384];
        let p = buf.as_ptr();
        let r = Access::REMOTE_READ;
        let m1 = unsafe { c.get(&mut a, p, 16384, r) }.unwrap();
        let m2 = unsafe { c.get(&mut a, p, 16384, r) }.unwrap();
        let m3 = unsafe { c.get(&mut a, p.wrapping_add(100), 1000, r) }.unwrap();
        assert_eq!((m1, m1), (m2, m3));
        assert_eq!(c.stats, CacheStats { hits: 2, misses: 1, evictions: 0 });
        assert_eq!(f.stats(a.qpn()).registrations, 1);
        // A larger range covering the first replaces it.
        let big = unsafe { c.get(&mut a, p, buf.len(), r) }.unwrap();
        assert!(big.contains(p as u64, buf.len()));
        assert_eq!(c.len(), 1);
        // Going over the budget evicts.
        let other = vec![0u8; 40 << 10];
        unsafe { c.get(&mut a, other.as_ptr(), other.len(), r) }.unwrap();
        assert!(c.stats.evictions >= 1);
        assert!(c.bytes() <= 64 << 10);
        c.invalidate(&mut a, other.as_ptr(), 1);
        assert!(c.is_empty());
        c.clear(&mut a);
        let s = f.stats(a.qpn());
        assert_eq!(s.registrations, s.deregistrations);
    }
}
