//! Per-endpoint state keyed by address and looked up by the address's hash: the in-flight counts
//! (`crate::inflight`), and this worker's local prefix index and prefill ledger
//! (`crate::scheduler`).
//!
//! The scheduler hashes each candidate's address once per request ([`address_hash`], xxh3):
//! that hash names the endpoint in the cross-worker tables (its low 32 bits,
//! `scheduler::prefix_shared::endpoint_key`), seeds its rendezvous weight
//! (`scheduler::predict::rendezvous_weight`), and finds its state in every table here. A lookup is then one probe and one string comparison on a hit,
//! with no hashing of the address per table. Exact: two addresses with the same hash are two
//! entries (the comparison tells them apart), so a collision costs a probe, never a mix-up.

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

/// A map from address to `V`, probed by [`address_hash`]: entries in a dense vector, found
/// through an open-addressing index (linear probing on the hash, which xxh3 spreads well; at
/// most a quarter full, so most probes end at the first slot; removal by backward shift, so no
/// tombstones).
#[derive(Debug, Clone)]
pub struct ByAddress<V> {
    entries: Vec<Entry<V>>,
    /// `(hash, entry index + 1)`; `(_, 0)` is an empty slot. Empty, or a power of two long.
    slots: Vec<(u64, u32)>,
}

impl<V> Default for ByAddress<V> {
    fn default() -> Self {
        Self { entries: Vec::new(), slots: Vec::new() }
    }
}

impl<V> ByAddress<V> {
    /// The slot holding `address`.
    fn find_slot(&self, hash: u64, address: &str) -> Option<usize> {
        let mask = self.slots.len().wrapping_sub(1);
        let mut pos = hash as usize & mask;
        // At most a quarter full: the probe meets an empty slot before it has seen them all.
        for _ in 0..self.slots.len() {
            let &(h, i) = self.slots.get(pos)?;
            let i = (i as usize).checked_sub(1)?;
            if h == hash && self.entries.get(i).is_some_and(|e| e.address == address) {
                return Some(pos);
            }
            pos = (pos + 1) & mask;
        }
        None
    }

    fn entry_at(&self, slot: usize) -> Option<usize> {
        self.slots.get(slot).and_then(|&(_, i)| (i as usize).checked_sub(1))
    }

    /// The index in `entries` of `address`.
    #[inline]
    fn find(&self, hash: u64, address: &str) -> Option<usize> {
        let mask = self.slots.len().wrapping_sub(1);
        let mut pos = hash as usize & mask;
        for _ in 0..self.slots.len() {
            let &(h, i) = self.slots.get(pos)?;
            let i = (i as usize).checked_sub(1)?;
            if h == hash && self.entries.get(i).is_some_and(|e| e.address == address) {
                return Some(i);
            }
            pos = (pos + 1) & mask;
        }
        None
    }

    /// The value of `address`, whose hash is `hash`.
    #[inline]
    pub fn get(&self, hash: u64, address: &str) -> Option<&V> {
        if self.entries.is_empty() {
            return None;
        }
        self.entries.get(self.find(hash, address)?).map(|e| &e.value)
    }

    pub fn get_mut(&mut self, hash: u64, address: &str) -> Option<&mut V> {
        if self.entries.is_empty() {
            return None;
        }
        let i = self.find(hash, address)?;
        self.entries.get_mut(i).map(|e| &mut e.value)
    }

    /// Applies `f` to the value of `address`, inserted as `V::default()` when absent.
    pub fn update(&mut self, hash: u64, address: &str, f: impl FnOnce(&mut V))
    where
        V: Default,
    {
        let i = match self.find(hash, address) {
            Some(i) => i,
            None => self.push(hash, address, V::default()),
        };
        if let Some(e) = self.entries.get_mut(i) {
            f(&mut e.value);
        }
    }

    /// Sets the value of `address`.
    pub fn insert(&mut self, hash: u64, address: &str, value: V) {
        match self.get_mut(hash, address) {
            Some(v) => *v = value,
            None => {
                self.push(hash, address, value);
            }
        }
    }

    /// Adds an entry known to be absent; returns its index.
    fn push(&mut self, hash: u64, address: &str, value: V) -> usize {
        let i = self.entries.len();
        self.entries.push(Entry { hash, address: address.to_string(), value });
        if self.entries.len() * 4 > self.slots.len() {
            self.rebuild((self.entries.len() * 4).next_power_of_two().max(16));
        } else {
            self.place(hash, i);
        }
        i
    }

    /// Puts entry `i` in the first empty slot of its probe.
    fn place(&mut self, hash: u64, i: usize) {
        let mask = self.slots.len().wrapping_sub(1);
        let mut pos = hash as usize & mask;
        for _ in 0..self.slots.len() {
            match self.slots.get_mut(pos) {
                Some(slot) if slot.1 == 0 => {
                    *slot = (hash, i as u32 + 1);
                    return;
                }
                Some(_) => pos = (pos + 1) & mask,
                None => return,
            }
        }
    }

    /// A fresh index of `n` slots (a power of two, at least four times the entries).
    fn rebuild(&mut self, n: usize) {
        self.slots.clear();
        self.slots.resize(n, (0, 0));
        for i in 0..self.entries.len() {
            if let Some(h) = self.entries.get(i).map(|e| e.hash) {
                self.place(h, i);
            }
        }
    }

    pub fn remove(&mut self, hash: u64, address: &str) -> Option<V> {
        let slot = self.find_slot(hash, address)?;
        let i = self.entry_at(slot)?;
        // Backward-shift deletion: pull later entries of the probe run into the hole.
        let mask = self.slots.len().wrapping_sub(1);
        let mut hole = slot;
        let mut j = (slot + 1) & mask;
        while let Some(&(h, k)) = self.slots.get(j) {
            if k == 0 {
                break;
            }
            let ideal = h as usize & mask;
            if (j.wrapping_sub(ideal) & mask) >= (j.wrapping_sub(hole) & mask) {
                if let Some(&moved) = self.slots.get(j) {
                    if let Some(s) = self.slots.get_mut(hole) {
                        *s = moved;
                    }
                }
                hole = j;
            }
            j = (j + 1) & mask;
        }
        if let Some(s) = self.slots.get_mut(hole) {
            *s = (0, 0);
        }
        // The last entry moves into `i`: repoint its slot.
        let last = self.entries.len() - 1;
        if i != last {
            if let Some(lh) = self.entries.get(last).map(|e| e.hash) {
                let mut pos = lh as usize & mask;
                for _ in 0..self.slots.len() {
                    match self.slots.get_mut(pos) {
                        Some(s) if s.1 as usize == last + 1 => {
                            s.1 = i as u32 + 1;
                            break;
                        }
                        Some(_) => pos = (pos + 1) & mask,
                        None => break,
                    }
                }
            }
        }
        Some(self.entries.swap_remove(i).value)
    }

    /// Keeps the entries for which `keep(address)` is true.
    pub fn retain(&mut self, mut keep: impl FnMut(&str) -> bool) {
        let before = self.entries.len();
        self.entries.retain(|e| keep(&e.address));
        if self.entries.len() != before {
            let n = self.slots.len();
            self.rebuild(n);
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.entries.iter().map(|e| &e.value)
    }

    /// The addresses, in no particular order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|e| e.address.as_str())
    }

    /// (address, value) pairs, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &V)> {
        self.entries.iter().map(|e| (e.address.as_str(), &e.value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn behaves_as_a_map_under_random_operations() {
        use crate::ports::{Rng, SplitMix64};
        use std::collections::HashMap;
        // Real hashes, and hashes with 5 values (collisions, long probe runs), at the start of
        // the index and at its end (runs that wrap around).
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
