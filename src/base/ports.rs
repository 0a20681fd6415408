//! Ports: the only ways the pure core reaches the outside world.
//!
//! - [`SharedStore`]: proxy-wasm shared data (one store per Envoy process and `vm_id`), with CAS.
//! - [`Rng`]: a seeded random source, so decisions are reproducible in tests.
//!
//! Time is never read by the core; every function that needs it takes `now_ms: u64`
//! (milliseconds since the Unix epoch, as the host clock gives it).
//!
//! Each port has an in-memory implementation here for tests and benchmarks; the host
//! implementations live in `crate::host`.

use std::cell::RefCell;
use std::collections::HashMap;

/// Why a shared-data operation failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// The value changed since it was read (the CAS did not match).
    CasMismatch,
    /// Any other host status, kept as text for the log.
    Host(String),
}

/// proxy-wasm shared data. `cas` is the token returned by `get`; 0 means "don't compare".
/// There is no delete: storing an empty value is the convention for "removed".
pub trait SharedStore {
    /// Returns the value and its CAS token, or `None` when the key was never written.
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError>;
    /// Writes the value if `cas` still matches (or unconditionally when `cas == 0`).
    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError>;
}

/// The CAS token used to create a key (see [`get_or_create`]).
///
/// Envoy's shared data (proxy-wasm-cpp-host `SharedData::set`) accepts a write to an ABSENT key
/// whatever its cas, and rejects a write to an EXISTING key whose non-zero cas differs from the
/// key's token. Tokens come from one process-wide counter (1, 2, 3, …, skipping 0). So a write
/// with a fixed non-zero cas creates a key that is absent and fails on a key that exists, unless
/// that key's token happens to be exactly this value: the counter hands `u32::MAX` out once per
/// 2^32 writes process-wide, and it would also have to be the key's latest write at that moment.
/// That residual chance is accepted; every user of [`get_or_create`] also verifies ownership or
/// tolerates a clobber (see each module's doc).
pub const CREATE_CAS: u32 = u32::MAX;

/// Reads `key`, creating it with `initial` first when it was never written, so that the caller
/// always holds a non-zero CAS token and every later write it makes is a true compare-and-set.
///
/// This is the one race-safe first write: a plain `set(key, v, 0)` on an absent key is blind, and
/// two workers that both saw the key absent would both "win", the second silently overwriting the
/// first. Here the second creator's write fails (the key exists and its token is not
/// [`CREATE_CAS`]) and it reads what the first wrote. `initial` must be a neutral value (an empty
/// record) or one the caller verifies after reading back (an ownership nonce).
pub fn get_or_create(
    store: &dyn SharedStore,
    key: &str,
    initial: &[u8],
) -> Result<(Vec<u8>, u32), StoreError> {
    if let Some(found) = store.get(key)? {
        return Ok(found);
    }
    match store.set(key, initial, CREATE_CAS) {
        Ok(()) | Err(StoreError::CasMismatch) => {}
        Err(e) => return Err(e),
    }
    store.get(key)?.ok_or_else(|| StoreError::Host(format!("{key} absent right after its creation")))
}

/// In-memory [`SharedStore`] with exactly Envoy's semantics (proxy-wasm-cpp-host `SharedData`):
/// - a write to an absent key is accepted whatever `cas`;
/// - a write to an existing key with a non-zero `cas` that differs from its token is a
///   [`StoreError::CasMismatch`]; `cas == 0` never compares;
/// - every successful write gives the key the next value of one store-wide counter (starting at
///   1, skipping 0 when it wraps).
#[derive(Debug)]
pub struct MemStore {
    inner: RefCell<HashMap<String, (Vec<u8>, u32)>>,
    next_cas: std::cell::Cell<u32>,
}

impl Default for MemStore {
    fn default() -> Self {
        Self { inner: RefCell::default(), next_cas: std::cell::Cell::new(1) }
    }
}

impl MemStore {
    pub fn new() -> Self {
        Self::default()
    }
    /// A store whose counter hands out `next` first (to test token wrap-around and collisions).
    pub fn with_next_cas(next: u32) -> Self {
        Self { inner: RefCell::default(), next_cas: std::cell::Cell::new(next.max(1)) }
    }
    fn take_cas(&self) -> u32 {
        let t = self.next_cas.get();
        let mut n = t.wrapping_add(1);
        if n == 0 {
            n = 1;
        }
        self.next_cas.set(n);
        t
    }
    /// Number of keys ever written (shared data has no delete).
    pub fn key_count(&self) -> usize {
        self.inner.borrow().len()
    }
    /// Every key, sorted; for tests that check key bounds.
    pub fn keys(&self) -> Vec<String> {
        let mut k: Vec<String> = self.inner.borrow().keys().cloned().collect();
        crate::base::sorting::sort(&mut k);
        k
    }
}

impl SharedStore for MemStore {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        Ok(self.inner.borrow().get(key).cloned())
    }
    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        let mut map = self.inner.borrow_mut();
        if let Some((_, current)) = map.get(key) {
            if cas != 0 && cas != *current {
                return Err(StoreError::CasMismatch);
            }
        }
        let token = self.take_cas();
        map.insert(key.to_string(), (value.to_vec(), token));
        Ok(())
    }
}

/// A small random source. Implementations must be deterministic for a given seed.
pub trait Rng {
    fn next_u64(&mut self) -> u64;
    /// Uniform in [0, 1).
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
    /// Uniform in [0, n); returns 0 when n == 0.
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        (self.next_u64() % n as u64) as usize
    }
}

/// SplitMix64: tiny, fast, and good enough for tie-breaking and weighted splits.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// The step added to the state before each output (the golden ratio in 64 bits).
    const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The first output of a generator seeded with `z` (`SplitMix64::new(z).next_u64()`), as a
    /// pure function: a cheap bijective mix of 64 bits, for keys that are already integers or
    /// hashes (hash-table keys, salted block hashes).
    #[inline]
    pub fn mix(z: u64) -> u64 {
        let mut z = z.wrapping_add(Self::GAMMA);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

impl Rng for SplitMix64 {
    #[inline]
    fn next_u64(&mut self) -> u64 {
        let out = Self::mix(self.0);
        self.0 = self.0.wrapping_add(Self::GAMMA);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memstore_cas_semantics() {
        let s = MemStore::new();
        assert_eq!(s.get("k").unwrap(), None);
        s.set("k", b"a", 0).unwrap();
        let (v, cas) = s.get("k").unwrap().unwrap();
        assert_eq!(v, b"a");
        s.set("k", b"b", cas).unwrap();
        // The old token no longer matches.
        assert_eq!(s.set("k", b"c", cas), Err(StoreError::CasMismatch));
        assert_eq!(s.get("k").unwrap().unwrap().0, b"b");
    }

    #[test]
    fn memstore_matches_envoy_on_absent_keys_and_token_counter() {
        let s = MemStore::new();
        // Absent key: any cas is accepted (Envoy has no create-if-absent).
        s.set("a", b"1", 77).unwrap();
        assert_eq!(s.get("a").unwrap(), Some((b"1".to_vec(), 1)));
        // Tokens come from one counter for all keys.
        s.set("b", b"2", 0).unwrap();
        assert_eq!(s.get("b").unwrap().unwrap().1, 2);
        // Existing key: a non-zero cas must match; 0 never compares.
        assert_eq!(s.set("a", b"x", 2), Err(StoreError::CasMismatch));
        s.set("a", b"y", 0).unwrap();
        assert_eq!(s.get("a").unwrap(), Some((b"y".to_vec(), 3)));
        // The counter skips 0 when it wraps.
        let w = MemStore::with_next_cas(u32::MAX);
        w.set("k", b"", 0).unwrap();
        w.set("k", b"", 0).unwrap();
        assert_eq!(w.get("k").unwrap().unwrap().1, 1);
    }

    /// A store that lets another writer create the key between our read and our write.
    struct CreatedBehindOurBack {
        inner: MemStore,
        armed: std::cell::Cell<bool>,
    }
    impl SharedStore for CreatedBehindOurBack {
        fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
            let r = self.inner.get(key);
            if self.armed.replace(false) {
                // The other worker creates it, then updates it with CAS.
                let (_, cas) = get_or_create(&self.inner, key, b"")?;
                self.inner.set(key, b"theirs", cas)?;
            }
            r
        }
        fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
            self.inner.set(key, value, cas)
        }
    }

    #[test]
    fn get_or_create_never_overwrites_a_racing_creator() {
        let s = CreatedBehindOurBack { inner: MemStore::new(), armed: std::cell::Cell::new(true) };
        // We saw the key absent; the other creator won and already wrote real data.
        let (v, cas) = get_or_create(&s, "k", b"").unwrap();
        assert_eq!(v, b"theirs");
        assert_ne!(cas, 0);
        // A blind first write (cas 0), the old way, would have destroyed it.
        let t = MemStore::new();
        t.set("k", b"theirs", 0).unwrap();
        t.set("k", b"", 0).unwrap();
        assert_eq!(t.get("k").unwrap().unwrap().0, b"");
    }

    #[test]
    fn splitmix_is_deterministic_and_in_range() {
        let mut a = SplitMix64::new(7);
        let mut b = SplitMix64::new(7);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
            let f = a.next_f64();
            b.next_f64();
            assert!((0.0..1.0).contains(&f));
            assert!(a.below(3) < 3);
            b.below(3);
        }
        assert_eq!(a.below(0), 0);
    }

    #[test]
    fn splitmix64_matches_the_reference_sequence_and_mix_is_its_first_output() {
        // Vigna's splitmix64.c seeded with 0.
        let mut r = SplitMix64::new(0);
        let want =
            [0xe220_a839_7b1d_cdaf, 0x6e78_9e6a_a1b9_65f4, 0x06c4_5d18_8009_454f, 0xf88b_b8a8_724c_81ec];
        assert_eq!([r.next_u64(), r.next_u64(), r.next_u64(), r.next_u64()], want);
        for z in [0, 1, 42, u64::MAX, 0x9E37_79B9_7F4A_7C15] {
            assert_eq!(SplitMix64::mix(z), SplitMix64::new(z).next_u64());
        }
    }
}
