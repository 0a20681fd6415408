//! Per-endpoint state of this worker (the local prefix index, the prefill ledger), keyed by
//! address and looked up by the address's hash.
//!
//! The scheduler hashes each candidate's address once per request ([`address_hash`], xxh3):
//! that hash names the endpoint in the cross-worker tables (its low 32 bits,
//! `prefix_shared::endpoint_key`), seeds its rendezvous weight (`predict::rendezvous_weight`),
//! and finds its state here. A lookup is then one probe and one string comparison on a hit,
//! with no hashing of the address per table. Exact: two addresses with the same hash are two
//! entries (the comparison tells them apart), so a collision costs a probe, never a mix-up.

use hashbrown::HashTable;
use xxhash_rust::xxh3::xxh3_64;

/// The hash of an address: `xxh3_64(address)`. Stable across workers and replicas.
pub fn address_hash(address: &str) -> u64 {
    xxh3_64(address.as_bytes())
}

/// A map from address to `V`, probed by [`address_hash`].
#[derive(Debug, Clone)]
pub struct ByAddress<V> {
    /// (address hash, address, value).
    table: HashTable<(u64, String, V)>,
}

impl<V> Default for ByAddress<V> {
    fn default() -> Self {
        Self { table: HashTable::new() }
    }
}

impl<V> ByAddress<V> {
    /// The value of `address`, whose hash is `hash`.
    pub fn get(&self, hash: u64, address: &str) -> Option<&V> {
        if self.table.is_empty() {
            return None;
        }
        self.table.find(hash, |(h, a, _)| *h == hash && a == address).map(|(_, _, v)| v)
    }

    pub fn get_mut(&mut self, hash: u64, address: &str) -> Option<&mut V> {
        self.table.find_mut(hash, |(h, a, _)| *h == hash && a == address).map(|(_, _, v)| v)
    }

    /// The value of `address`, inserted as `V::default()` when absent.
    pub fn get_or_default(&mut self, hash: u64, address: &str) -> &mut V
    where
        V: Default,
    {
        let entry = self.table.entry(hash, |(h, a, _)| *h == hash && a == address, |(h, _, _)| *h);
        &mut entry.or_insert_with(|| (hash, address.to_string(), V::default())).into_mut().2
    }

    pub fn remove(&mut self, hash: u64, address: &str) -> Option<V> {
        match self.table.find_entry(hash, |(h, a, _)| *h == hash && a == address) {
            Ok(e) => Some(e.remove().0 .2),
            Err(_) => None,
        }
    }

    /// Keeps the entries for which `keep(address)` is true.
    pub fn retain(&mut self, mut keep: impl FnMut(&str) -> bool) {
        self.table.retain(|(_, a, _)| keep(a));
    }

    pub fn len(&self) -> usize {
        self.table.len()
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.table.iter().map(|(_, _, v)| v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colliding_hashes_stay_apart() {
        let mut m: ByAddress<u32> = ByAddress::default();
        // Same (forced) hash, two addresses: two entries.
        *m.get_or_default(7, "a:1") += 1;
        *m.get_or_default(7, "b:1") += 2;
        *m.get_or_default(7, "a:1") += 10;
        assert_eq!(
            (m.get(7, "a:1"), m.get(7, "b:1"), m.get(7, "c:1"), m.len()),
            (Some(&11), Some(&2), None, 2)
        );
        assert_eq!(m.remove(7, "a:1"), Some(11));
        assert_eq!((m.get(7, "a:1"), m.get(7, "b:1")), (None, Some(&2)));
        m.retain(|a| a != "b:1");
        assert!(m.is_empty());
        assert_eq!(address_hash("10.0.0.1:8000"), xxh3_64(b"10.0.0.1:8000"));
    }
}
