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

impl RateLimits {
    /// Takes one request from `tenant`'s bucket (`rate` per second); false
    /// when it is empty.
    pub fn take(&mut self, tenant: &str, rate: u32, now: Millis) -> bool {
        let cap = u64::from(rate.max(1)) * 2 * 1000;
        let b = self.buckets.entry(tenant.to_string()).or_insert(Bucket { milli: cap, at: now });
        let refill = now.saturating_sub(b.at).saturating_mul(u64::from(rate));
        b.milli = b.milli.saturating_add(refill).min(cap);
        b.at = b.at.max(now);
        if b.milli < 1000 {
            return false;
        }
        b.milli -= 1000;
        true
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
    }
}
