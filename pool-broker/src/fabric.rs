//! The fabric beside the GPUs: each server's link capacity (as it
//! registered it, `--link-bandwidth`), the bandwidth its leases were
//! granted, and the traffic its heartbeats report. Placement asks it two
//! things, through [`placement::Links`]:
//!
//! - *Can a server carry a lease's bandwidth now?* Counted like memory:
//!   the bandwidth granted on a server never exceeds its capacity, and is
//!   given back with the lease. A lease's bandwidth is asked of each
//!   server it lands on (as its memory of each GPU). A server that said
//!   no capacity is unbounded.
//! - *Which of the placements the policy scores the same is freer?* The
//!   one whose leaf, then whose server, has the most headroom: capacity
//!   less what is in use, the larger of what was granted and what the
//!   server last reported carrying. Only ties are decided here, so the
//!   policy's fragmentation score is never made worse for it.
//!
//! Capacities are not stored: a server says its own at each registration,
//! and after a broker restart every server registers again at once. Until
//! a restored server has, its capacity is unknown, and a lease that asks
//! for bandwidth does not land there (it is busy, not refused).

use std::collections::HashMap;

use crate::inventory::Server;
use crate::placement;

/// One server's links.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Link {
    /// Bytes/s each way; None: the server did not say (unbounded).
    pub capacity: Option<u64>,
    /// The server registered with this broker (so `capacity` is its word,
    /// not unknown after a restore).
    pub heard: bool,
    /// Bytes/s granted to its leases, summed.
    pub granted: u64,
    /// Its last heartbeat's traffic, bytes/s; None: none reported.
    pub load: Option<Load>,
}

/// A server's data-plane traffic as it reported it, bytes/s.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Load {
    pub bytes_in: u64,
    pub bytes_out: u64,
}

impl Link {
    /// Bytes/s in use each way: what was granted, or what is carried if
    /// that is more (traffic of leases that asked nothing, or more than
    /// they asked).
    pub fn used(&self) -> u64 {
        let carried = self.load.map_or(0, |l| l.bytes_in.max(l.bytes_out));
        self.granted.max(carried)
    }

    /// Bytes/s still free each way; an unbounded link's is what is left
    /// below `u64::MAX`, so unbounded links rank above bounded ones and by
    /// their use among themselves.
    pub fn headroom(&self) -> u64 {
        match self.capacity {
            Some(c) => c.saturating_sub(self.used()),
            None => u64::MAX - self.used(),
        }
    }

    /// Can `want` more bytes/s be granted here?
    pub fn room_for(&self, want: u64) -> bool {
        if want == 0 {
            return true;
        }
        if !self.heard {
            return false;
        }
        self.capacity.is_none_or(|c| self.granted.checked_add(want).is_some_and(|g| g <= c))
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Leaf {
    /// Sum of its servers' headroom.
    headroom: u128,
    servers: u32,
}

/// Every server's links, by the same index as the state's servers.
#[derive(Debug, Default)]
pub struct Fabric {
    links: Vec<Link>,
    leaf_of: Vec<usize>,
    leaves: Vec<Leaf>,
    leaf_index: HashMap<String, usize>,
}

impl Fabric {
    pub fn link(&self, si: usize) -> Option<&Link> {
        self.links.get(si)
    }

    fn leaf_slot(&mut self, leaf: &str) -> usize {
        if let Some(&i) = self.leaf_index.get(leaf) {
            return i;
        }
        self.leaves.push(Leaf::default());
        self.leaf_index.insert(leaf.to_string(), self.leaves.len() - 1);
        self.leaves.len() - 1
    }

    /// Server `si` (registered now, `heard`, or restored) is under leaf
    /// `leaf` with `capacity` (None: unbounded, or unknown when restored).
    pub fn place_server(&mut self, si: usize, leaf: &str, capacity: Option<u64>, heard: bool) {
        let l = self.leaf_slot(leaf);
        if si >= self.links.len() {
            self.links.resize(si + 1, Link::default());
            self.leaf_of.resize(si + 1, usize::MAX);
        }
        let old = self.leaf_of[si];
        if old != usize::MAX {
            let h = self.links[si].headroom() as u128;
            let o = &mut self.leaves[old];
            o.headroom -= h;
            o.servers -= 1;
        }
        self.leaf_of[si] = l;
        let link = &mut self.links[si];
        link.capacity = capacity;
        link.heard |= heard;
        let h = link.headroom() as u128;
        let n = &mut self.leaves[l];
        n.headroom += h;
        n.servers += 1;
    }

    /// Changes server `si`'s link, keeping its leaf's sum.
    fn update(&mut self, si: usize, f: impl FnOnce(&mut Link)) {
        let Some(link) = self.links.get_mut(si) else { return };
        let before = link.headroom() as u128;
        f(link);
        let after = link.headroom() as u128;
        if let Some(leaf) = self.leaves.get_mut(self.leaf_of[si]) {
            leaf.headroom = leaf.headroom - before + after;
        }
    }

    /// A heartbeat's traffic report from server `si`.
    pub fn report(&mut self, si: usize, load: Load) {
        self.update(si, |l| l.load = Some(load));
    }

    /// A lease holds `bandwidth` on each of `servers` (indices, distinct).
    pub fn occupy(&mut self, servers: &[usize], bandwidth: u64) {
        for &si in servers {
            self.update(si, |l| l.granted = l.granted.saturating_add(bandwidth));
        }
    }

    /// A lease gives back what [`Fabric::occupy`] took.
    pub fn vacate(&mut self, servers: &[usize], bandwidth: u64) {
        for &si in servers {
            self.update(si, |l| l.granted = l.granted.saturating_sub(bandwidth));
        }
    }

    /// Why `want` bytes/s can never be granted on any server `eligible`
    /// allows (every one's capacity is less), if so.
    pub fn never(&self, want: u64, servers: &[Server], eligible: &dyn Fn(&Server) -> bool) -> Option<String> {
        if want == 0 {
            return None;
        }
        let mut largest = 0u64;
        for (si, s) in servers.iter().enumerate() {
            if !eligible(s) {
                continue;
            }
            match self.links.get(si) {
                // Unknown (restored, not registered again yet) or unbounded.
                Some(Link { capacity: Some(c), heard: true, .. }) => largest = largest.max(*c),
                _ => return None,
            }
        }
        if servers.iter().any(eligible) && largest < want {
            Some(format!(
                "{} of bandwidth asked, but the fastest link of the tenant's servers carries {}",
                rgpu_config::format_bandwidth(want),
                rgpu_config::format_bandwidth(largest)
            ))
        } else {
            None
        }
    }

    /// What placement asks of the fabric for a demand of `want` bytes/s.
    pub fn view(&self, want: u64) -> View<'_> {
        View { fabric: self, want }
    }

    fn leaf_mean(&self, si: usize) -> u128 {
        match self.leaf_of.get(si).and_then(|&l| self.leaves.get(l)) {
            Some(l) if l.servers > 0 => l.headroom / l.servers as u128,
            _ => 0,
        }
    }
}

/// [`placement::Links`] for one demand.
pub struct View<'a> {
    fabric: &'a Fabric,
    want: u64,
}

impl placement::Links for View<'_> {
    fn fits(&self, si: usize) -> bool {
        self.fabric.links.get(si).is_none_or(|l| l.room_for(self.want))
    }

    /// The members' mean leaf headroom (the leaf's mean per server, so a
    /// large leaf is not freer for its size), then their mean own.
    fn headroom(&self, members: &[usize]) -> u128 {
        if members.is_empty() {
            return 0;
        }
        let n = members.len() as u128;
        let leaf: u128 = members.iter().map(|&si| self.fabric.leaf_mean(si)).sum::<u128>() / n;
        let own: u128 =
            members.iter().map(|&si| self.fabric.links.get(si).map_or(0, |l| l.headroom() as u128)).sum::<u128>() / n;
        // Both are below 2^64.
        (leaf.min(u64::MAX as u128) << 64) | own.min(u64::MAX as u128)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::Links;

    #[test]
    fn headroom_is_capacity_less_the_larger_of_granted_and_carried() {
        let mut l = Link { capacity: Some(100), heard: true, granted: 30, load: None };
        assert_eq!(l.headroom(), 70);
        l.load = Some(Load { bytes_in: 10, bytes_out: 50 });
        assert_eq!(l.headroom(), 50, "carried out-bound traffic is more than granted");
        l.load = Some(Load { bytes_in: 500, bytes_out: 0 });
        assert_eq!(l.headroom(), 0, "over capacity is no headroom, not a wrap");
        assert!(l.room_for(70) && !l.room_for(71), "grants count against capacity, not traffic");
        assert!(!l.room_for(u64::MAX));
        let unbounded = Link { heard: true, ..Link::default() };
        assert!(unbounded.room_for(u64::MAX) && unbounded.headroom() > l.headroom());
        let restored = Link { capacity: None, heard: false, ..Link::default() };
        assert!(!restored.room_for(1) && restored.room_for(0));
    }

    #[test]
    fn leaf_sums_follow_every_change_and_move() {
        let mut f = Fabric::default();
        f.place_server(0, "l1", Some(100), true);
        f.place_server(1, "l1", Some(300), true);
        f.place_server(2, "l2", Some(100), true);
        assert_eq!((f.leaf_mean(0), f.leaf_mean(2)), (200, 100));
        f.report(1, Load { bytes_in: 0, bytes_out: 300 });
        assert_eq!(f.leaf_mean(0), 50);
        // Server 1 re-registers under l2.
        f.place_server(1, "l2", Some(300), true);
        assert_eq!((f.leaf_mean(0), f.leaf_mean(2)), (100, 50));
        let v = f.view(0);
        assert!(v.headroom(&[0]) > v.headroom(&[2]), "leaf l1 is freer");
        assert!(v.headroom(&[2]) > v.headroom(&[1]), "same leaf: the freer server");
    }
}
