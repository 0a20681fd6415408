//! Per-endpoint state keyed by address and looked up by the address's hash: the in-flight counts
//! (`crate::state::inflight`), and this worker's local prefix index and prefill ledger
//! (`crate::scheduler`).
//!
//! The scheduler hashes each candidate's address once per request ([`address_hash`], xxh3):
//! that hash names the endpoint in the cross-worker tables (its low 32 bits,
//! `scheduler::prefix_shared::endpoint_key`), seeds its rendezvous weight
//! (`scheduler::predict::rendezvous_weight`), and finds its state in every table here (hashbrown's `HashTable`, given that hash). A lookup is
//! then a probe and one string comparison on a hit, with no hashing of the address per table. Exact: two addresses with the same hash are two
//! entries (the comparison tells them apart), so a collision costs a probe, never a mix-up.

use hashbrown::HashTable;
use xxhash_rust::xxh3::xxh3_64;

/// The hash of an address: `xxh3_64(address)`. Stable across workers and replicas.
pub fn address_hash(address: &str) -> u64 {
    xxh3_64(address.as_bytes())
}

#[derive(Debug, Clone)]
struct Entry<V> {
    hash: u64,
    address: String,
    value: V,
}

/// A map from address to `V`, probed by [`address_hash`]: hashbrown's `HashTable` with the
/// hash the caller already computed (no hasher runs here), equality on the address.
#[derive(Debug, Clone)]
pub struct ByAddress<V> {
    table: HashTable<Entry<V>>,
}

impl<V> Default for ByAddress<V> {
    fn default() -> Self {
        Self { table: HashTable::new() }
    }
}

impl<V> ByAddress<V> {
    /// The value of `address`, whose hash is `hash`.
    #[inline]
    pub fn get(&self, hash: u64, address: &str) -> Option<&V> {
        self.table.find(hash, |e| e.address == address).map(|e| &e.value)
    }

    pub fn get_mut(&mut self, hash: u64, address: &str) -> Option<&mut V> {
        self.table.find_mut(hash, |e| e.address == address).map(|e| &mut e.value)
    }

    /// Applies `f` to the value of `address`, inserted as `V::default()` when absent.
    pub fn update(&mut self, hash: u64, address: &str, f: impl FnOnce(&mut V))
    where
        V: Default,
    {
        let entry = self.table.entry(hash, |e| e.address == address, |e| e.hash).or_insert_with(|| Entry {
            hash,
            address: address.to_string(),
            value: V::default(),
        });
        f(&mut entry.into_mut().value);
    }

    /// Sets the value of `address`.
    pub fn insert(&mut self, hash: u64, address: &str, value: V) {
        match self.get_mut(hash, address) {
            Some(v) => *v = value,
            None => {
                self.table
                    .insert_unique(hash, Entry { hash, address: address.to_string(), value }, |e| e.hash);
            }
        }
    }

    pub fn remove(&mut self, hash: u64, address: &str) -> Option<V> {
        let found = self.table.find_entry(hash, |e| e.address == address).ok()?;
        Some(found.remove().0.value)
    }

    /// Keeps the entries for which `keep(address)` is true.
    pub fn retain(&mut self, mut keep: impl FnMut(&str) -> bool) {
        self.table.retain(|e| keep(&e.address));
    }

    pub fn len(&self) -> usize {
        self.table.len()
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.table.iter().map(|e| &e.value)
    }

    /// The addresses, in no particular order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.table.iter().map(|e| e.address.as_str())
    }

    /// (address, value) pairs, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &V)> {
        self.table.iter().map(|e| (e.address.as_str(), &e.value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn behaves_as_a_map_under_random_operations() {
        use crate::base::ports::{Rng, SplitMix64};
        use std::collections::HashMap;
        // Real hashes, and hashes with 5 values (collisions, long probe runs), low and high.
        for mode in 0..3 {
            let hash = |a: &str| match mode {
                0 => address_hash(a),
                1 => address_hash(a) % 5,
                _ => u64::MAX - address_hash(a) % 5,
            };
            let mut r = SplitMix64::new(3);
            let mut m: ByAddress<u32> = ByAddress::default();
            let mut model: HashMap<String, u32> = HashMap::new();
            for round in 0..20_000 {
                let a = format!("10.0.0.{}:8000", r.below(300));
                let h = hash(&a);
                match r.below(5) {
                    0 => {
                        let v = r.below(1000) as u32;
                        m.insert(h, &a, v);
                        model.insert(a.clone(), v);
                    }
                    1 => {
                        m.update(h, &a, |v| *v += 1);
                        *model.entry(a.clone()).or_default() += 1;
                    }
                    2 => assert_eq!(m.remove(h, &a), model.remove(&a)),
                    3 if round % 997 == 0 => {
                        let cut = format!(".{}:8000", r.below(300));
                        m.retain(|x| !x.ends_with(&cut));
                        model.retain(|x, _| !x.ends_with(&cut));
                    }
                    _ => assert_eq!(m.get(h, &a), model.get(&a)),
                }
                assert_eq!(m.len(), model.len());
                if round % 500 == 0 {
                    for (a, v) in &model {
                        assert_eq!(m.get(hash(a), a), Some(v), "round {round}");
                    }
                }
            }
        }
    }

    #[test]
    fn colliding_hashes_stay_apart() {
        let mut m: ByAddress<u32> = ByAddress::default();
        // Same (forced) hash, two addresses: two entries.
        m.update(7, "a:1", |v| *v += 1);
        m.update(7, "b:1", |v| *v += 2);
        m.update(7, "a:1", |v| *v += 10);
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
