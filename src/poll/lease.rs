//! Poller election without a bootstrap singleton: a lease kept in shared data, taken with CAS.
//!
//! Why: Istio gateways built from Gateway API resources have no supported way to add a
//! `bootstrap_extensions` singleton, so the filter's own root contexts must pick one poller among
//! themselves. Envoy ticks the HTTP filter's root context on the main thread and on every worker;
//! each of them calls [`Lease::try_acquire_or_renew`] on every tick and polls only when the answer
//! is [`LeaseState::Held`].
//!
//! ## The record
//! One shared-data key, [`LEASE_KEY`], holds a `crate::base::codec` record (tag `Lease`): the
//! holder (`u64`, 0 = free) and its expiry (`u64` ms). A record of a version this build does
//! not read (a root of another build holds the lease) is handled as a garbled one (step 5).
//! Holder 0 means "nobody" (written by [`Lease::release`]); an empty value, the shared-data
//! convention for "removed", means the same. Anything else is *garbled* (a future format, a
//! truncated write): its holder and expiry are unknown.
//!
//! ## The algorithm (one call)
//! 1. Read the record and its CAS token.
//! 2. The key was never written: create it as a *free* record with `crate::base::ports::CREATE_CAS`
//!    (Envoy accepts any cas on an absent key and rejects a non-matching cas on an existing one,
//!    so a root that lost the creation race cannot overwrite the winner's record), re-read it,
//!    and go on with the record found, as in steps 3–5. The take itself is then a CAS like every
//!    other write: of two roots that both found the key absent, exactly one holds.
//! 3. The record names us: renew it (expiry = now + ttl) with CAS. Success is `Held`; a CAS
//!    mismatch means another root wrote in between (a takeover), and we are not the holder.
//! 4. The record is free: take it with CAS.
//! 5. The record names another root, or is garbled: take it over with CAS only when
//!    - the same CAS token was seen on an earlier call too (no write since), and
//!    - either the record's expiry has passed, or this root has seen the same token for at least
//!      `ttl_ms` of its own clock.
//!
//!    Otherwise answer `NotHeld`.
//!
//! ## Why both rules in step 5
//! The expiry written in the record is the fast path: a VM that died (panic, config reload) left
//! an expired record and a fresh root takes over after one confirming tick. Trusting only that
//! number would let a clock that steps forward displace a live holder, and a record whose expiry
//! is far in the future (a clock that stepped back, a garbled or foreign record) would never
//! expire. The local observation rule, as client-go's leader election does it, covers both: a
//! holder that renews changes the token on every tick, so a live holder is never displaced by
//! observation, and a dead one is displaced after `ttl_ms` whatever the record says.
//!
//! ## Bounds
//! Exactly one root gets `Held` for a given record write: every write is CAS-protected, the
//! creation of the key included (it writes a free record, never a holder). A holder that stops renewing at `t` (its last write) is replaced by
//! `t + ttl_ms + tick_ms` when the clock is sane (expiry path), and by `t + ttl_ms + 2 × tick_ms`
//! in any case (observation path), where `tick_ms` is the tick period of the other roots; see
//! [`takeover_bound_ms`]. After a takeover the old holder learns it lost on its next call (its CAS
//! renew fails), so two roots can both be polling for at most one tick, and only when the old
//! holder was alive but missed `ttl_ms` of renewals (a stalled worker) or the clock stepped.
//!
//! Holder ids must be unique per root context across all VMs of the process: use a random u64
//! (0 is reserved for "nobody").

use crate::base::codec::{self, Tag, Writer};
use crate::base::ports::{SharedStore, StoreError};

/// The shared-data key of the lease record (one key, whatever the number of roots).
pub const LEASE_KEY: &str = "inference-picker/poller-lease";

/// What one call of [`Lease::try_acquire_or_renew`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseState {
    /// This root holds the lease until `expires_ms`: poll now.
    Held { expires_ms: u64 },
    /// Another root holds it. `holder` 0 means unknown (a free record that a racing root took
    /// first, or a garbled record); `expires_ms` 0 means unknown.
    NotHeld { holder: u64, expires_ms: u64 },
    /// The store failed; do not poll. The next call tries again.
    Unavailable(StoreError),
}

impl LeaseState {
    /// True only for [`LeaseState::Held`]: the one state in which the root should poll.
    pub fn is_held(&self) -> bool {
        matches!(self, LeaseState::Held { .. })
    }
}

/// The longest time, in ms, between a holder's last renewal and another root taking over, when the
/// other roots call [`Lease::try_acquire_or_renew`] every `tick_ms`.
pub fn takeover_bound_ms(ttl_ms: u64, tick_ms: u64) -> u64 {
    ttl_ms.saturating_add(tick_ms.saturating_mul(2))
}

/// A non-zero holder id for one root context, from host entropy (e.g. the clock's nanoseconds, or
/// better `RandomState`, which reads WASI `random_get`) and the root's context id. Mixing both
/// keeps two roots that read the same clock value apart.
pub fn holder_id(entropy: u64, context_id: u32) -> u64 {
    use crate::base::ports::Rng;
    let mut mix =
        crate::base::ports::SplitMix64::new(entropy ^ (u64::from(context_id) << 32 | u64::from(context_id)));
    mix.next_u64().max(1)
}

/// A parsed lease record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Record {
    Free,
    Taken { holder: u64, expires_ms: u64 },
    Garbled,
}

/// Reads the lease record (`crate::base::codec`, tag `Lease`: `u64 holder · u64 expires_ms`;
/// holder 0 = free). An empty value is free; anything else that is not such a record, or one of
/// a version this build does not read (a root of another build holds it), is `Garbled`: observed,
/// and taken over only when it stays unchanged for the ttl, so a live holder of another build,
/// which renews it, keeps it.
fn parse_record(raw: &[u8]) -> Record {
    if raw.is_empty() {
        return Record::Free;
    }
    let read = || {
        let mut r = codec::open(raw, Tag::Lease).ok()?;
        let fields = (r.u64()?, r.u64()?);
        r.finish().map(|()| fields)
    };
    let Some((holder, expires_ms)) = read() else {
        return Record::Garbled;
    };
    if holder == 0 {
        Record::Free
    } else {
        Record::Taken { holder, expires_ms }
    }
}

fn encode_record(holder: u64, expires_ms: u64) -> Vec<u8> {
    let mut w = Writer::new(Tag::Lease, 16);
    w.u64(holder).u64(expires_ms);
    w.finish()
}

/// A CAS token of someone else's record, and when this root first saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Observed {
    cas: u32,
    since_ms: u64,
}

/// One root context's view of the poller lease. Keep one per root context, for its lifetime.
#[derive(Debug, Clone)]
pub struct Lease {
    holder_id: u64,
    ttl_ms: u64,
    observed: Option<Observed>,
}

impl Lease {
    /// `holder_id` must be non-zero and unique per root context (a random u64); `ttl_ms` is how
    /// long a renewal is valid (`poller.lease_ttl_ms`).
    pub fn new(holder_id: u64, ttl_ms: u64) -> Self {
        Self { holder_id, ttl_ms, observed: None }
    }

    pub fn holder_id(&self) -> u64 {
        self.holder_id
    }

    /// Takes, keeps or observes the lease; call it on every tick and poll only on `Held`.
    pub fn try_acquire_or_renew(&mut self, store: &dyn SharedStore, now_ms: u64) -> LeaseState {
        let expires_ms = now_ms.saturating_add(self.ttl_ms);
        let (raw, cas) = match store.get(LEASE_KEY) {
            Err(e) => return LeaseState::Unavailable(e),
            Ok(None) => {
                self.observed = None;
                match crate::base::ports::get_or_create(store, LEASE_KEY, &encode_record(0, 0)) {
                    Ok(found) => found,
                    Err(e) => return LeaseState::Unavailable(e),
                }
            }
            Ok(Some(found)) => found,
        };
        let record = parse_record(&raw);
        let (holder, record_expiry) = match record {
            Record::Taken { holder, .. } if holder == self.holder_id => {
                self.observed = None;
                return self.write_with_cas(store, cas, now_ms, expires_ms);
            }
            Record::Free => {
                self.observed = None;
                return self.write_with_cas(store, cas, now_ms, expires_ms);
            }
            Record::Taken { holder, expires_ms: exp } => (holder, Some(exp)),
            Record::Garbled => (0, None),
        };

        // Someone else's record, or one we cannot read: observe it.
        let seen_before = match self.observed {
            Some(o) if o.cas == cas => o,
            _ => {
                self.observed = Some(Observed { cas, since_ms: now_ms });
                return LeaseState::NotHeld { holder, expires_ms: record_expiry.unwrap_or(0) };
            }
        };
        let expired_by_record = record_expiry.is_some_and(|exp| now_ms >= exp);
        let unchanged_for_ttl = now_ms.saturating_sub(seen_before.since_ms) >= self.ttl_ms;
        if expired_by_record || unchanged_for_ttl {
            self.observed = None;
            return self.write_with_cas(store, cas, now_ms, expires_ms);
        }
        LeaseState::NotHeld { holder, expires_ms: record_expiry.unwrap_or(0) }
    }

    /// Gives the lease up if this root holds it (call from the root context's `on_done`), so that
    /// another root takes over on its next tick instead of after the ttl.
    pub fn release(&mut self, store: &dyn SharedStore) -> Result<(), StoreError> {
        self.observed = None;
        let Some((raw, cas)) = store.get(LEASE_KEY)? else {
            return Ok(());
        };
        match parse_record(&raw) {
            Record::Taken { holder, .. } if holder == self.holder_id => {
                store.set(LEASE_KEY, &encode_record(0, 0), cas)
            }
            _ => Ok(()),
        }
    }

    /// Writes our record if the token still matches; a mismatch means another root won the race.
    fn write_with_cas(
        &mut self,
        store: &dyn SharedStore,
        cas: u32,
        now_ms: u64,
        expires_ms: u64,
    ) -> LeaseState {
        match store.set(LEASE_KEY, &encode_record(self.holder_id, expires_ms), cas) {
            Ok(()) => LeaseState::Held { expires_ms },
            Err(StoreError::CasMismatch) => self.after_lost_race(store, now_ms),
            Err(e) => LeaseState::Unavailable(e),
        }
    }

    /// One re-read, to report who won (no retry loop: the winner's record is valid by design).
    fn after_lost_race(&mut self, store: &dyn SharedStore, now_ms: u64) -> LeaseState {
        match store.get(LEASE_KEY) {
            Ok(Some((raw, cas))) => {
                // The winner's write is the first observation of its token: a later takeover is
                // timed from here.
                self.observed = Some(Observed { cas, since_ms: now_ms });
                match parse_record(&raw) {
                    Record::Taken { holder, expires_ms } => LeaseState::NotHeld { holder, expires_ms },
                    Record::Free | Record::Garbled => LeaseState::NotHeld { holder: 0, expires_ms: 0 },
                }
            }
            Ok(None) => LeaseState::NotHeld { holder: 0, expires_ms: 0 },
            Err(e) => LeaseState::Unavailable(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::ports::{MemStore, Rng, SplitMix64};
    use std::cell::RefCell;

    const TTL: u64 = 1000;
    const TICK: u64 = 200;

    fn record_of(store: &MemStore) -> Record {
        parse_record(&store.get(LEASE_KEY).unwrap().unwrap().0)
    }

    #[test]
    fn holder_ids_are_non_zero_and_differ_by_context() {
        assert_ne!(holder_id(42, 1), holder_id(42, 2));
        assert_ne!(holder_id(42, 1), holder_id(43, 1));
        assert_eq!(holder_id(42, 1), holder_id(42, 1));
        assert!((0..1000).all(|i| holder_id(i, 0) != 0));
    }

    #[test]
    fn record_round_trip_and_garbage() {
        let rec = encode_record(0xab, 42);
        assert_eq!(rec.len(), 18);
        assert_eq!(parse_record(&rec), Record::Taken { holder: 0xab, expires_ms: 42 });
        assert_eq!(parse_record(b""), Record::Free);
        assert_eq!(parse_record(&encode_record(0, 0)), Record::Free);
        let mut longer = rec.clone();
        longer.push(0);
        let mut bad: Vec<Vec<u8>> = (0..rec.len()).map(|cut| rec[..cut].to_vec()).collect();
        bad.extend([
            longer,                                            // trailing byte
            b"1 00000000000000ab 42".to_vec(),                 // the old text form
            codec::as_version(&rec, Tag::Lease.current() + 7), // a future version
            b"\xff\xfe".to_vec(),
        ]);
        for b in bad.iter().filter(|b| !b.is_empty()) {
            assert_eq!(parse_record(b), Record::Garbled, "{b:?}");
        }
    }

    /// Mixed builds: a lease the next release holds (and renews) is never taken by this one;
    /// the next release reads this one's lease as its own format.
    #[test]
    fn a_lease_held_by_another_release_is_observed_not_taken() {
        let store = MemStore::new();
        let mut b = Lease::new(0xB, TTL);
        for i in 0..30u64 {
            let theirs = codec::as_next(&encode_record(0xC, i * TICK + TTL), Tag::Lease);
            store.set(LEASE_KEY, &theirs, 0).unwrap();
            let state = b.try_acquire_or_renew(&store, i * TICK);
            assert!(!state.is_held());
            let holder = if cfg!(feature = "codec-next") { 0xC } else { 0 };
            assert!(matches!(state, LeaseState::NotHeld { holder: h, .. } if h == holder), "{state:?}");
        }
    }

    #[test]
    fn first_root_holds_at_once_and_others_see_it() {
        let store = MemStore::new();
        let mut a = Lease::new(0xA, TTL);
        let mut b = Lease::new(0xB, TTL);
        // The key does not exist: created free, then taken with CAS in the same call.
        assert_eq!(a.try_acquire_or_renew(&store, 0), LeaseState::Held { expires_ms: 1000 });
        assert_eq!(a.try_acquire_or_renew(&store, 200), LeaseState::Held { expires_ms: 1200 });
        assert_eq!(
            b.try_acquire_or_renew(&store, 250),
            LeaseState::NotHeld { holder: 0xA, expires_ms: 1200 }
        );
        assert_eq!(record_of(&store), Record::Taken { holder: 0xA, expires_ms: 1200 });
    }

    #[test]
    fn holder_renews_and_is_never_displaced_while_renewing() {
        let store = MemStore::new();
        let mut a = Lease::new(0xA, TTL);
        let mut b = Lease::new(0xB, TTL);
        a.try_acquire_or_renew(&store, 0);
        // 50 ticks = 10 s, ten times the ttl: B observes a new token every time and never takes over.
        for i in 1..=50u64 {
            let now = i * TICK;
            assert_eq!(a.try_acquire_or_renew(&store, now), LeaseState::Held { expires_ms: now + TTL });
            assert_eq!(
                b.try_acquire_or_renew(&store, now + 1),
                LeaseState::NotHeld { holder: 0xA, expires_ms: now + TTL }
            );
        }
    }

    #[test]
    fn takeover_after_the_holder_stops_within_the_bound() {
        let store = MemStore::new();
        let mut a = Lease::new(0xA, TTL);
        let mut b = Lease::new(0xB, TTL);
        a.try_acquire_or_renew(&store, 0);
        assert!(a.try_acquire_or_renew(&store, 200).is_held());
        // A's last renewal was at 200 (expires 1200), then A stops. B ticks every 200 ms from 300.
        let mut took_over_at = None;
        for i in 0..20u64 {
            let now = 300 + i * TICK;
            if b.try_acquire_or_renew(&store, now).is_held() {
                took_over_at = Some(now);
                break;
            }
        }
        // B observes the token at 300, and at 1300 (the first tick ≥ 1200 with the token seen
        // before) the record has expired: takeover at 1300 = 200 + 1000 + 100.
        assert_eq!(took_over_at, Some(1300));
        assert!(1300 - 200 <= takeover_bound_ms(TTL, TICK));
        assert_eq!(record_of(&store), Record::Taken { holder: 0xB, expires_ms: 2300 });
        // A comes back: its CAS renew sees B's record and it is not the holder any more.
        assert_eq!(
            a.try_acquire_or_renew(&store, 1400),
            LeaseState::NotHeld { holder: 0xB, expires_ms: 2300 }
        );
    }

    type Hook<'a> = Box<dyn FnOnce(&MemStore) + 'a>;

    /// Runs `hook` between the wrapped store's next `get` and `set`, as if another root ran there.
    struct InterleavingStore<'a> {
        inner: &'a MemStore,
        hook: RefCell<Option<Hook<'a>>>,
    }

    impl SharedStore for InterleavingStore<'_> {
        fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
            self.inner.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
            if let Some(hook) = self.hook.borrow_mut().take() {
                hook(self.inner);
            }
            self.inner.set(key, value, cas)
        }
    }

    #[test]
    fn cas_race_on_a_free_record_has_one_winner() {
        let store = MemStore::new();
        store.set(LEASE_KEY, &encode_record(0, 0), 0).unwrap();
        let mut a = Lease::new(0xA, TTL);
        let b_state = RefCell::new(None);
        let racing = InterleavingStore {
            inner: &store,
            hook: RefCell::new(Some(Box::new(|s: &MemStore| {
                // B runs a whole call after A read the free record and before A writes.
                let mut b = Lease::new(0xB, TTL);
                *b_state.borrow_mut() = Some(b.try_acquire_or_renew(s, 500));
            }))),
        };
        let a_state = a.try_acquire_or_renew(&racing, 500);
        assert_eq!(b_state.borrow().clone(), Some(LeaseState::Held { expires_ms: 1500 }));
        // A's CAS fails and the re-read names the winner.
        assert_eq!(a_state, LeaseState::NotHeld { holder: 0xB, expires_ms: 1500 });
        assert_eq!(record_of(&store), Record::Taken { holder: 0xB, expires_ms: 1500 });
    }

    #[test]
    fn cas_race_on_takeover_of_an_expired_record_has_one_winner() {
        let store = MemStore::new();
        store.set(LEASE_KEY, &encode_record(0xD, 1000), 0).unwrap();
        let mut a = Lease::new(0xA, TTL);
        let mut b = Lease::new(0xB, TTL);
        // Both observe the dead holder's token once.
        assert!(!a.try_acquire_or_renew(&store, 1100).is_held());
        assert!(!b.try_acquire_or_renew(&store, 1100).is_held());
        let b_state = RefCell::new(None);
        let racing = InterleavingStore {
            inner: &store,
            hook: RefCell::new(Some(Box::new(|s: &MemStore| {
                *b_state.borrow_mut() = Some(b.try_acquire_or_renew(s, 1300));
            }))),
        };
        let a_state = a.try_acquire_or_renew(&racing, 1300);
        assert_eq!(b_state.borrow().clone(), Some(LeaseState::Held { expires_ms: 2300 }));
        assert_eq!(a_state, LeaseState::NotHeld { holder: 0xB, expires_ms: 2300 });
    }

    #[test]
    fn two_first_writers_on_an_absent_key_have_one_winner() {
        let store = MemStore::new();
        let mut a = Lease::new(0xA, TTL);
        let b = RefCell::new(Lease::new(0xB, TTL));
        let b_first = RefCell::new(None);
        let racing = InterleavingStore {
            inner: &store,
            hook: RefCell::new(Some(Box::new(|s: &MemStore| {
                // B also found the key absent, and runs a whole call before A's first write.
                *b_first.borrow_mut() = Some(b.borrow_mut().try_acquire_or_renew(s, 0));
            }))),
        };
        let a_state = a.try_acquire_or_renew(&racing, 0);
        assert_eq!(b_first.borrow().clone(), Some(LeaseState::Held { expires_ms: 1000 }));
        // A's creation write fails (the key exists now), and it reads B's record.
        assert_eq!(a_state, LeaseState::NotHeld { holder: 0xB, expires_ms: 1000 });
        assert_eq!(record_of(&store), Record::Taken { holder: 0xB, expires_ms: 1000 });
        // B keeps it; A does not take it over.
        assert_eq!(b.borrow_mut().try_acquire_or_renew(&store, 200), LeaseState::Held { expires_ms: 1200 });
        assert!(!a.try_acquire_or_renew(&store, 200).is_held());
    }

    #[test]
    fn garbled_record_is_taken_over_only_after_it_stays_unchanged_for_the_ttl() {
        let store = MemStore::new();
        store.set(LEASE_KEY, b"not a lease", 0).unwrap();
        let mut b = Lease::new(0xB, TTL);
        // First seen at 0; unknown holder and expiry.
        assert_eq!(b.try_acquire_or_renew(&store, 0), LeaseState::NotHeld { holder: 0, expires_ms: 0 });
        assert_eq!(b.try_acquire_or_renew(&store, 999), LeaseState::NotHeld { holder: 0, expires_ms: 0 });
        // 1000 ms unchanged: taken.
        assert_eq!(b.try_acquire_or_renew(&store, 1000), LeaseState::Held { expires_ms: 2000 });
    }

    #[test]
    fn garbled_record_that_keeps_changing_is_left_alone() {
        // A future version of the module holds the lease in a format we cannot read, and renews.
        let store = MemStore::new();
        let mut b = Lease::new(0xB, TTL);
        for i in 0..30u64 {
            store.set(LEASE_KEY, format!("v9 holder={i}").as_bytes(), 0).unwrap();
            assert!(!b.try_acquire_or_renew(&store, i * TICK).is_held());
        }
    }

    #[test]
    fn expiry_far_in_the_future_does_not_pin_a_dead_holder() {
        // The writer's clock was far ahead (or stepped back afterwards): the record claims to be
        // valid for a day, but nobody renews it. Observation takes over after the ttl.
        let store = MemStore::new();
        store.set(LEASE_KEY, &encode_record(0xD, 86_400_000), 0).unwrap();
        let mut b = Lease::new(0xB, TTL);
        assert!(!b.try_acquire_or_renew(&store, 10_000).is_held());
        assert!(!b.try_acquire_or_renew(&store, 10_800).is_held());
        assert_eq!(b.try_acquire_or_renew(&store, 11_000), LeaseState::Held { expires_ms: 12_000 });
    }

    #[test]
    fn clock_step_forward_does_not_displace_a_live_holder() {
        let store = MemStore::new();
        let mut a = Lease::new(0xA, TTL);
        let mut b = Lease::new(0xB, TTL);
        a.try_acquire_or_renew(&store, 0);
        assert!(a.try_acquire_or_renew(&store, 200).is_held());
        assert!(!b.try_acquire_or_renew(&store, 250).is_held());
        assert!(a.try_acquire_or_renew(&store, 400).is_held());
        // B's clock reads an hour later: the record (expires 1400) looks long expired, but its
        // token changed since B last looked, so B only re-observes.
        assert_eq!(
            b.try_acquire_or_renew(&store, 3_600_000),
            LeaseState::NotHeld { holder: 0xA, expires_ms: 1400 }
        );
        assert!(a.try_acquire_or_renew(&store, 600).is_held());
    }

    #[test]
    fn release_lets_the_next_root_take_over_at_once() {
        let store = MemStore::new();
        let mut a = Lease::new(0xA, TTL);
        let mut b = Lease::new(0xB, TTL);
        a.try_acquire_or_renew(&store, 0);
        assert!(a.try_acquire_or_renew(&store, 200).is_held());
        assert!(!b.try_acquire_or_renew(&store, 300).is_held());
        // B releasing does nothing: it does not hold the lease.
        b.release(&store).unwrap();
        assert_eq!(record_of(&store), Record::Taken { holder: 0xA, expires_ms: 1200 });
        a.release(&store).unwrap();
        assert_eq!(record_of(&store), Record::Free);
        assert_eq!(b.try_acquire_or_renew(&store, 400), LeaseState::Held { expires_ms: 1400 });
    }

    struct FailingStore;
    impl SharedStore for FailingStore {
        fn get(&self, _: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
            Err(StoreError::Host("BadArgument".into()))
        }
        fn set(&self, _: &str, _: &[u8], _: u32) -> Result<(), StoreError> {
            Err(StoreError::Host("BadArgument".into()))
        }
    }

    #[test]
    fn store_failure_means_not_held() {
        let mut a = Lease::new(0xA, TTL);
        assert_eq!(
            a.try_acquire_or_renew(&FailingStore, 0),
            LeaseState::Unavailable(StoreError::Host("BadArgument".into()))
        );
        assert!(a.release(&FailingStore).is_err());
    }

    /// Many roots on one store, called in a shuffled order every tick (as Envoy's workers race),
    /// with roots stalling for a while at random. Checks the two promises: never two `Held` in one
    /// tick, and never a gap longer than the bound while some root keeps ticking.
    #[test]
    fn simulated_roots_elect_exactly_one_poller() {
        let store = MemStore::new();
        let mut rng = SplitMix64::new(20_240_601);
        let mut roots: Vec<Lease> = (1..=5u64).map(|id| Lease::new(id * 0x1111, TTL)).collect();
        let mut stalled_until = [0u64; 5];
        let mut last_held_at = 0u64;
        let mut holders_seen = std::collections::BTreeSet::new();
        for tick in 0..3000u64 {
            let now = tick * TICK;
            let mut order: Vec<usize> = (0..roots.len()).collect();
            for i in (1..order.len()).rev() {
                let j = rng.below(i + 1);
                order.swap(i, j);
            }
            let mut held_this_tick = Vec::new();
            for &i in &order {
                if now < stalled_until[i] {
                    continue;
                }
                // 1 call in 200: the root stalls for 0.2–4 s (a busy worker, a VM restart).
                if rng.below(200) == 0 {
                    stalled_until[i] = now + TICK * (1 + rng.below(20) as u64);
                    continue;
                }
                if roots[i].try_acquire_or_renew(&store, now).is_held() {
                    held_this_tick.push(i);
                }
            }
            assert!(held_this_tick.len() <= 1, "tick {tick}: {held_this_tick:?} all hold the lease");
            if let Some(&i) = held_this_tick.first() {
                holders_seen.insert(i);
                last_held_at = now;
            } else if tick > 1 {
                assert!(
                    now - last_held_at <= takeover_bound_ms(TTL, TICK),
                    "tick {tick}: nobody held the lease since {last_held_at}"
                );
            }
        }
        // Stalls happened, so the lease moved between roots.
        assert!(holders_seen.len() >= 2, "{holders_seen:?}");
    }
}
