//! Router-local in-flight request counts, shared by every Envoy worker through shared data.
//!
//! Polled metrics lag bursts by up to one poll interval; this count reacts at once. Every worker
//! VM increments an endpoint's count when it sends a request there and decrements it when the
//! request finishes or fails (the host calls [`adjust`] from `on_log`, which Envoy runs for every
//! stream, reset or not).
//!
//! Layout: ONE shared-data key, [`INFLIGHT_KEY`], holding `addr=count` entries separated by `;`.
//! Entries at zero are dropped, so the value holds at most one entry per endpoint with requests
//! in flight, and the number of keys is one whatever the traffic. Updates are CAS loops bounded
//! by [`MAX_CAS_ATTEMPTS`]; a read is one host call, which the scorer needs anyway (it reads all
//! candidates' counts).
//!
//! Failure behaviour: a value that does not parse is treated as empty (counts restart at zero,
//! which under-counts for at most the requests in flight at that moment); an update that loses
//! the CAS race `MAX_CAS_ATTEMPTS` times in a row returns the error and the host logs it.

use hashbrown::HashMap;

use crate::ports::{SharedStore, StoreError};

pub const INFLIGHT_KEY: &str = "inference-picker/inflight";
pub const MAX_CAS_ATTEMPTS: usize = 64;

/// In-flight counts by endpoint address. Missing means zero.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InflightCounts {
    counts: HashMap<String, u32>,
}

impl InflightCounts {
    pub fn get(&self, address: &str) -> u32 {
        self.counts.get(address).copied().unwrap_or(0)
    }

    pub fn total(&self) -> u64 {
        self.counts.values().map(|&c| u64::from(c)).sum()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, u32)> {
        self.counts.iter().map(|(k, v)| (k.as_str(), *v))
    }

    /// Parses the stored value; malformed entries are skipped.
    pub fn decode(bytes: &[u8]) -> Self {
        let mut counts = HashMap::new();
        let Ok(text) = std::str::from_utf8(bytes) else {
            return Self { counts };
        };
        for entry in text.split(';') {
            if let Some((addr, n)) = entry.rsplit_once('=') {
                if let Ok(n) = n.parse::<u32>() {
                    if n > 0 && !addr.is_empty() {
                        counts.insert(addr.to_string(), n);
                    }
                }
            }
        }
        Self { counts }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut entries: Vec<(&String, &u32)> = self.counts.iter().filter(|(_, &n)| n > 0).collect();
        // Sorted so equal contents give equal bytes (stable for tests and debugging).
        entries.sort();
        let mut out = String::with_capacity(entries.len() * 24);
        for (i, (addr, n)) in entries.into_iter().enumerate() {
            if i > 0 {
                out.push(';');
            }
            out.push_str(addr);
            out.push('=');
            out.push_str(&n.to_string());
        }
        out.into_bytes()
    }

    /// Applies `delta`, saturating at 0 and u32::MAX; returns the new count.
    fn apply(&mut self, address: &str, delta: i32) -> u32 {
        let cur = self.get(address);
        let next = if delta >= 0 {
            cur.saturating_add(delta as u32)
        } else {
            cur.saturating_sub(delta.unsigned_abs())
        };
        if next == 0 {
            self.counts.remove(address);
        } else {
            self.counts.insert(address.to_string(), next);
        }
        next
    }
}

/// Reads every endpoint's count.
pub fn read(store: &dyn SharedStore) -> Result<InflightCounts, StoreError> {
    Ok(store.get(INFLIGHT_KEY)?.map(|(v, _)| InflightCounts::decode(&v)).unwrap_or_default())
}

/// Adds `delta` (+1 on send, -1 on finish) to an endpoint's count with a CAS loop.
pub fn adjust(store: &dyn SharedStore, address: &str, delta: i32) -> Result<u32, StoreError> {
    let mut last = StoreError::CasMismatch;
    for _ in 0..MAX_CAS_ATTEMPTS {
        let (mut counts, cas) = match store.get(INFLIGHT_KEY)? {
            Some((v, cas)) => (InflightCounts::decode(&v), cas),
            None => (InflightCounts::default(), 0),
        };
        let n = counts.apply(address, delta);
        // cas 0 means "don't compare"; for a key never written we still want a race to be
        // detected, which Envoy gives us because a second writer's get then returns cas != 0.
        match store.set(INFLIGHT_KEY, &counts.encode(), cas) {
            Ok(()) => return Ok(n),
            Err(StoreError::CasMismatch) => last = StoreError::CasMismatch,
            Err(e) => return Err(e),
        }
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ports::MemStore;

    #[test]
    fn increments_and_releases() {
        let s = MemStore::new();
        assert_eq!(adjust(&s, "10.0.0.1:8000", 1).unwrap(), 1);
        assert_eq!(adjust(&s, "10.0.0.1:8000", 1).unwrap(), 2);
        assert_eq!(adjust(&s, "10.0.0.2:8000", 1).unwrap(), 1);
        let c = read(&s).unwrap();
        assert_eq!((c.get("10.0.0.1:8000"), c.get("10.0.0.2:8000"), c.total()), (2, 1, 3));
        assert_eq!(adjust(&s, "10.0.0.1:8000", -1).unwrap(), 1);
        assert_eq!(adjust(&s, "10.0.0.1:8000", -1).unwrap(), 0);
        // Zero entries are dropped from the stored value.
        assert_eq!(s.get(INFLIGHT_KEY).unwrap().unwrap().0, b"10.0.0.2:8000=1");
        // Releasing below zero saturates instead of wrapping.
        assert_eq!(adjust(&s, "10.0.0.1:8000", -1).unwrap(), 0);
        assert_eq!(s.key_count(), 1);
    }

    #[test]
    fn ipv6_addresses_round_trip() {
        let s = MemStore::new();
        adjust(&s, "[fd00::1]:8000", 3).unwrap();
        assert_eq!(read(&s).unwrap().get("[fd00::1]:8000"), 3);
    }

    #[test]
    fn garbled_value_reads_as_empty_and_is_repaired() {
        let s = MemStore::new();
        s.set(INFLIGHT_KEY, b"\xff\xfe", 0).unwrap();
        assert_eq!(read(&s).unwrap().total(), 0);
        s.set(INFLIGHT_KEY, b"a=x;b=2;=3;c", 0).unwrap();
        let c = read(&s).unwrap();
        assert_eq!((c.get("a"), c.get("b"), c.total()), (0, 2, 2));
        adjust(&s, "b", 1).unwrap();
        assert_eq!(s.get(INFLIGHT_KEY).unwrap().unwrap().0, b"b=3");
    }

    /// A store whose value changes between every get and set, as if another worker always won.
    struct AlwaysRacing(MemStore);
    impl SharedStore for AlwaysRacing {
        fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
            let r = self.0.get(key);
            self.0.set(key, b"other=1", 0)?;
            r
        }
        fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
            self.0.set(key, value, cas)
        }
    }

    #[test]
    fn lost_races_are_bounded_and_reported() {
        let s = AlwaysRacing(MemStore::new());
        s.0.set(INFLIGHT_KEY, b"", 0).unwrap();
        assert_eq!(adjust(&s, "a", 1), Err(StoreError::CasMismatch));
    }

    #[test]
    fn interleaved_writers_do_not_lose_updates() {
        // Two "workers" read, then both try to write: the loser retries on fresh data.
        let s = MemStore::new();
        adjust(&s, "a", 1).unwrap();
        let (v, cas) = s.get(INFLIGHT_KEY).unwrap().unwrap();
        let mut theirs = InflightCounts::decode(&v);
        theirs.apply("a", 1);
        adjust(&s, "a", 1).unwrap(); // we win first
        assert_eq!(s.set(INFLIGHT_KEY, &theirs.encode(), cas), Err(StoreError::CasMismatch));
        adjust(&s, "a", 1).unwrap(); // their retry via adjust
        assert_eq!(read(&s).unwrap().get("a"), 3);
    }
}
