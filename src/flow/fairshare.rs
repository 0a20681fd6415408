//! Fairness between tenants across Envoy workers: a shared count of releases per waiting tenant.
//!
//! # Why
//! Each worker holds its own paused requests and serves its tenants (fairness ids) round-robin
//! (`crate::flow`). Release tokens are shared by *worker*, and a token credited when a request
//! finishes is spent first by the worker that saw the finish. So a heavy tenant whose requests
//! sit on worker A feeds A's releases with its own finishes, and a light tenant held on worker B
//! waits until the heavy one drains (issue #15). Round-robin must hold over all workers.
//!
//! # Formula (deficit round-robin with one shared counter per tenant)
//! Kept in the group's flow record (`crate::flow::Record`, so the token spend and the count
//! change in one CAS write):
//! - `served[p][t]`: releases granted to tenant `t` at priority `p` over all workers since it
//!   started waiting there, minus the smallest such count at `p` (so the values stay small).
//! - A tenant starts waiting at `p` (no live worker publishes it there yet) at the current floor
//!   `min(served[p][*])`, or 0: it gets no credit for the past, and keeps none when it stops
//!   waiting (its entry is dropped).
//! - A worker may release a request of tenant `t` at `p` only if
//!   `served[p][t] <= min(served[p][*]) + SLACK`: the most under-served waiting tenants go first,
//!   on whatever worker they are held. It then adds 1 to `served[p][t]`. Among its tenants that
//!   qualify it keeps its local round-robin order.
//! - A worker whose waiting tenants do not qualify leaves the token in the ledger for the worker
//!   that holds the under-served tenant (it spends it at its next tick, 50 ms).
//!
//! # Inputs, bounds, and what happens when a signal is missing
//! - Tenants are hashed to one of [`BUCKETS`] buckets ([`bucket`], FNV-1a, the same in every
//!   VM); two tenants in one bucket share one count (they are one tenant across workers; each
//!   worker still separates them in its own round-robin).
//! - Each worker publishes at most [`MAX_PUBLISHED`] (priority, bucket) pairs it holds
//!   (`crate::flow::WorkerEntry::t`), highest priority first. An unpublished tenant has no count
//!   and counts as at the floor: it may go, and does not hold others back.
//! - Counts exist only for tenants some live worker publishes ([`Served::retain_waiting`]), so
//!   the table is bounded by workers × [`MAX_PUBLISHED`] and expires with the workers' heartbeats
//!   (`flow_control.worker_ttl_ms`).
//! - Work-conserving: when a fairness refusal left tokens unused for [`GRACE_MS`] (the worker
//!   holding the under-served tenant did not take them: it is slow, gone but not yet expired, or
//!   its summary is stale), the next worker to tick releases in its own order. So fairness can
//!   cost at most [`GRACE_MS`] of idle capacity, never a stall.
//! - No shared store: the flow queue releases nothing anyway (see `crate::flow`).

use std::collections::BTreeSet;

/// Tenant buckets. 1024: a collision between two of 30 active tenants has a chance of ~35 %
/// (birthday bound) for some pair, but only that pair shares a count.
pub const BUCKETS: u32 = 1024;
/// Most (priority, bucket) pairs one worker publishes.
pub const MAX_PUBLISHED: usize = 32;
/// How far a tenant's count may run ahead of the floor and still release.
pub const SLACK: u32 = 1;
/// A fairness refusal that left tokens unused this long is waived (work-conserving).
pub const GRACE_MS: u64 = 200;

/// The bucket of a fairness id: FNV-1a 64 of its bytes, modulo [`BUCKETS`].
pub fn bucket(fairness_id: &str) -> u16 {
    let h = crate::base::hash::fnv1a64(fairness_id.as_bytes());
    // BUCKETS fits in u16, so the remainder does too.
    u16::try_from(h % u64::from(BUCKETS)).unwrap_or(0)
}

/// Releases per waiting (priority, bucket), relative to each priority's floor: a list of
/// `(priority, bucket, count)`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Served(pub Vec<(i32, u16, u32)>);

impl Served {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The smallest count at `priority`, if any tenant there has one.
    pub fn floor(&self, priority: i32) -> Option<u32> {
        self.0.iter().filter(|(p, _, _)| *p == priority).map(|(_, _, c)| *c).min()
    }

    /// The count of (priority, bucket); a tenant without one counts as at the floor.
    pub fn get(&self, priority: i32, b: u16) -> u32 {
        self.0
            .iter()
            .find(|(p, x, _)| *p == priority && *x == b)
            .map(|(_, _, c)| *c)
            .unwrap_or_else(|| self.floor(priority).unwrap_or(0))
    }

    /// A tenant starts waiting at `priority`: it gets the floor if it has no count yet.
    pub fn join(&mut self, priority: i32, b: u16) {
        if !self.0.iter().any(|(p, x, _)| *p == priority && *x == b) {
            let f = self.floor(priority).unwrap_or(0);
            self.0.push((priority, b, f));
        }
    }

    /// May tenant `b` release at `priority` now?
    pub fn allows(&self, priority: i32, b: u16) -> bool {
        let floor = self.floor(priority).unwrap_or(0);
        self.get(priority, b) <= floor.saturating_add(SLACK)
    }

    /// One release granted to tenant `b` at `priority`.
    pub fn charge(&mut self, priority: i32, b: u16) {
        self.join(priority, b);
        if let Some(e) = self.0.iter_mut().find(|(p, x, _)| *p == priority && *x == b) {
            e.2 = e.2.saturating_add(1);
        }
    }

    /// Keeps the counts of tenants in `waiting` only, adds those missing (at the floor), and
    /// moves each priority's floor to 0. Sorted, so equal tables encode equally.
    pub fn retain_waiting(&mut self, waiting: &BTreeSet<(i32, u16)>) {
        self.0.retain(|(p, b, _)| waiting.contains(&(*p, *b)));
        for (p, b) in waiting {
            self.join(*p, *b);
        }
        let floors: Vec<(i32, u32)> = {
            let ps: BTreeSet<i32> = self.0.iter().map(|(p, _, _)| *p).collect();
            ps.into_iter().filter_map(|p| self.floor(p).map(|f| (p, f))).collect()
        };
        for e in &mut self.0 {
            if let Some((_, f)) = floors.iter().find(|(p, _)| *p == e.0) {
                e.2 = e.2.saturating_sub(*f);
            }
        }
        crate::base::sorting::sort(&mut self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_stable_and_in_range() {
        // FNV-1a 64 of "" is the offset basis; of "a" is 0xaf63dc4c8601ec8c (published test
        // vectors), so the buckets are these remainders in every VM.
        assert_eq!(bucket(""), u16::try_from(0xcbf2_9ce4_8422_2325_u64 % 1024).unwrap());
        assert_eq!(bucket("a"), u16::try_from(0xaf63_dc4c_8601_ec8c_u64 % 1024).unwrap());
        assert_ne!(bucket("tenant-heavy"), bucket("tenant-light"));
        for i in 0..2000 {
            assert!(u32::from(bucket(&format!("t{i}"))) < BUCKETS);
        }
    }

    #[test]
    fn the_most_under_served_tenant_goes_first() {
        let mut s = Served::default();
        s.join(0, 1);
        s.join(0, 2);
        // Both at 0: both may go. Tenant 1 takes two releases in a row (slack 1)...
        assert!(s.allows(0, 1) && s.allows(0, 2));
        s.charge(0, 1);
        assert!(s.allows(0, 1));
        s.charge(0, 1);
        // ...then must wait for tenant 2: 2 > 0 + SLACK.
        assert!(!s.allows(0, 1));
        assert!(s.allows(0, 2));
        s.charge(0, 2);
        // Floor 1: tenant 1 (2) may go again.
        assert!(s.allows(0, 1));
        // Another priority has its own counts.
        s.join(5, 1);
        assert!(s.allows(5, 1));
        assert_eq!(s.get(5, 1), 0);
    }

    #[test]
    fn a_new_tenant_starts_at_the_floor_without_credit() {
        let mut s = Served::default();
        s.join(0, 1);
        s.join(0, 2);
        for _ in 0..10 {
            s.charge(0, 1);
            s.charge(0, 2);
        }
        // Tenant 3 arrives: it starts at the floor 10, not 0, so it cannot take 10 in a row.
        s.join(0, 3);
        assert_eq!(s.get(0, 3), 10);
        s.charge(0, 3);
        s.charge(0, 3);
        assert!(!s.allows(0, 3));
        // A tenant without a count (unpublished) counts as at the floor.
        assert_eq!(s.get(0, 99), 10);
        assert!(s.allows(0, 99));
    }

    #[test]
    fn retain_waiting_bounds_and_normalises() {
        let mut s = Served::default();
        for b in 0..5 {
            s.join(0, b);
        }
        s.charge(0, 0);
        s.charge(0, 0);
        s.charge(0, 1);
        // Tenants 1..4 stay (4 joins now); 0 stopped waiting: its count goes, it restarts at the
        // floor next time.
        let waiting: BTreeSet<(i32, u16)> = [(0, 1), (0, 2), (0, 3), (0, 4), (3, 7)].into_iter().collect();
        s.retain_waiting(&waiting);
        assert_eq!(s.0, vec![(0, 1, 1), (0, 2, 0), (0, 3, 0), (0, 4, 0), (3, 7, 0)]);
        // Floors move to 0.
        s.charge(0, 2);
        s.charge(0, 3);
        s.charge(0, 4);
        s.retain_waiting(&waiting);
        assert_eq!(s.0, vec![(0, 1, 0), (0, 2, 0), (0, 3, 0), (0, 4, 0), (3, 7, 0)]);
        s.retain_waiting(&BTreeSet::new());
        assert!(s.is_empty());
    }
}
