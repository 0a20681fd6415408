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

/// In-memory [`SharedStore`] with the same CAS semantics as Envoy's: every successful write bumps
/// the key's CAS token.
#[derive(Debug, Default)]
pub struct MemStore {
    inner: RefCell<HashMap<String, (Vec<u8>, u32)>>,
}

impl MemStore {
    pub fn new() -> Self {
        Self::default()
    }
    /// Number of keys ever written (shared data has no delete).
    pub fn key_count(&self) -> usize {
        self.inner.borrow().len()
    }
    /// Every key, sorted; for tests that check key bounds.
    pub fn keys(&self) -> Vec<String> {
        let mut k: Vec<String> = self.inner.borrow().keys().cloned().collect();
        k.sort();
        k
    }
}

impl SharedStore for MemStore {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        Ok(self.inner.borrow().get(key).cloned())
    }
    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        let mut map = self.inner.borrow_mut();
        let current = map.get(key).map(|(_, c)| *c).unwrap_or(0);
        if cas != 0 && cas != current {
            return Err(StoreError::CasMismatch);
        }
        map.insert(key.to_string(), (value.to_vec(), current.wrapping_add(1).max(1)));
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
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
}

impl Rng for SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
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
}
