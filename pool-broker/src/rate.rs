//! Request rate limits per tenant: a token bucket each, refilled at the
//! tenant's rate and holding twice that, so a burst of a second or two
//! passes and a flood does not. Pure: every call takes `now`.

use std::collections::HashMap;

use crate::inventory::Millis;

#[derive(Debug, Clone, Copy)]
struct Bucket {
    /// Thousandths of a request, so that slow rates refill smoothly.
    milli: u64,
    at: Millis,
}

#[derive(Debug, Default)]
pub struct RateLimits {
    buckets: HashMap<String, Bucket>,
}

/// Buckets kept before full (idle) ones are dropped: the keys may come
/// from the network (peer addresses).
const KEPT: usize = 10_000;

impl RateLimits {
    /// `key`'s bucket, refilled to `now`.
    fn bucket(&mut self, key: &str, rate: u32, now: Millis) -> &mut Bucket {
        let cap = u64::from(rate.max(1)) * 2 * 1000;
        if self.buckets.len() >= KEPT && !self.buckets.contains_key(key) {
            // A full bucket is the same as none.
            self.buckets.retain(|_, b| b.milli.saturating_add(now.saturating_sub(b.at).saturating_mul(u64::from(rate))) < cap);
        }
        let b = self.buckets.entry(key.to_string()).or_insert(Bucket { milli: cap, at: now });
        let refill = now.saturating_sub(b.at).saturating_mul(u64::from(rate));
        b.milli = b.milli.saturating_add(refill).min(cap);
        b.at = b.at.max(now);
        b
    }

    /// Takes one request from `key`'s bucket (`rate` per second, bursts of
    /// twice that); false when it is empty.
    pub fn take(&mut self, key: &str, rate: u32, now: Millis) -> bool {
        let b = self.bucket(key, rate, now);
        if b.milli < 1000 {
            return false;
        }
        b.milli -= 1000;
        true
    }

    /// Whether `key`'s bucket holds a request, without taking it.
    pub fn has(&mut self, key: &str, rate: u32, now: Millis) -> bool {
        self.bucket(key, rate, now).milli >= 1000
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_of_twice_the_rate_then_the_rate() {
        let mut r = RateLimits::default();
        let passed = (0..100).filter(|_| r.take("a", 10, 0)).count();
        assert_eq!(passed, 20, "burst");
        assert!(r.take("b", 10, 0), "tenants have their own buckets");
        assert!(!r.take("a", 10, 50));
        assert!(r.take("a", 10, 100), "one more after 1/10 s");
        assert!(!r.take("a", 10, 100));
        let passed = (0..100).filter(|_| r.take("a", 10, 60_000)).count();
        assert_eq!(passed, 20, "refilled to the cap, not beyond");
        assert!(!r.has("a", 10, 60_000) && !r.take("a", 10, 60_000));
        assert!(r.has("a", 10, 60_100) && r.has("a", 10, 60_100), "has takes nothing");
    }

    #[test]
    fn idle_buckets_are_dropped_when_there_are_many() {
        let mut r = RateLimits::default();
        for i in 0..KEPT {
            r.take(&i.to_string(), 1, 0);
            r.take(&i.to_string(), 1, 0);
        }
        assert!(!r.has("0", 1, 0), "0 is empty");
        assert_eq!(r.buckets.len(), KEPT);
        assert!(r.take("new", 1, 10_000), "all refilled by now");
        assert!(r.buckets.len() <= 2, "{}", r.buckets.len());
    }
}
