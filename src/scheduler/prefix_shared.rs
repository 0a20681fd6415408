//! The cross-worker prefix table: which endpoint last received a prefix, visible to every Envoy
//! worker (each a separate VM with its own local index) through proxy-wasm shared data.
//!
//! **Why.** Envoy spreads connections over workers, so turn 2 of a conversation often lands on a
//! worker that never saw turn 1. With only per-worker indexes it would be routed by load alone
//! and lose its KV cache. Rendezvous hashing on the leading blocks would agree across workers
//! without state, but it can only hash a prefix every turn shares (the first blocks), so all
//! conversations with a common system prompt would pile on one endpoint, and it ignores where
//! load actually sent a conversation. The table records the real decision.
//!
//! **Layout (bounded whatever the traffic).** `shared_shards` keys
//! `inference-picker/prefix/NNNN` (default 256). Each value is a sequence of 12-byte records
//! `le64(block hash) ‖ le32(endpoint key)`, oldest first, at most `shared_entries_per_shard`
//! (default 64 → 768 bytes, which every read copies) records; writing a hash that is present moves it to the end, and the
//! oldest records fall off the front. A hash lives in shard `hash mod shards`. The endpoint key
//! is the low 32 bits of `xxh3_64(address)`; it is only ever compared with the keys of the
//! current candidates, so a stale entry for an endpoint that left names nothing (a 32-bit
//! collision among a pool's candidates has odds ~n²/2³³, 1e-4 for 1024 endpoints, and would
//! only misdirect a soft score).
//!
//! **Checkpoints.** Only the blocks at positions 4, 8, 16, … (block counts, powers of two from
//! [`FIRST_CHECKPOINT`] up to the request's block count) are stored; a prompt shorter than 4
//! blocks (1 KiB) is not shared across workers, since so short a prefix is cheap to recompute. A later turn extends an earlier one, so it contains
//! every checkpoint the earlier turn wrote. Reads walk the checkpoints in ascending order and
//! stop at the first miss (a chain that misses at 2^j misses beyond it too, unless it was
//! evicted): a fresh prompt costs 1 read, a conversation of n blocks about log2(n/4) + 2. The match
//! length is a lower bound within a factor of 2 of the truth; the local index gives the exact
//! count when this worker sent the earlier turns itself.
//!
//! **Writes.** After the pick, the primary's key is written at every checkpoint not already
//! known to map to it, grouped by shard: one CAS read-modify-write per shard touched, retried up
//! to [`MAX_CAS_ATTEMPTS`] times. The values read during the lookup are reused for the first
//! attempt, so a conversation continuing on the same endpoint usually costs 1 write (its newest
//! checkpoint) and no extra read. A write that keeps losing races is dropped: the table is a
//! hint, and the next turn writes again.
//!
//! **First writes.** A never-written shard has no CAS token, and a write with cas 0 is blind, so
//! two workers' very first writes to one shard could race and one be lost. A shard read as absent
//! is therefore first created empty with `crate::ports::CREATE_CAS` (Envoy accepts any cas on an
//! absent key and rejects a non-matching one on an existing key, so a racing creator's data is
//! never overwritten), then re-read and updated with CAS like any other write
//! (`two_first_writers_of_a_shard_both_land`).
//!
//! **Failure behaviour.** A store error on read counts as a miss; on write the update is
//! skipped. A value whose length is not a multiple of 12 is read as empty and replaced on the
//! next write. Neither can make the scheduler fail a request.

use crate::ports::{SharedStore, StoreError};

pub const KEY_PREFIX: &str = "inference-picker/prefix/";
pub const RECORD_BYTES: usize = 12;
pub const MAX_CAS_ATTEMPTS: usize = 4;

/// The key naming an endpoint in the table: the low 32 bits of `xxh3_64(address)`.
pub fn endpoint_key(address: &str) -> u32 {
    endpoint_key_of_hash(crate::by_address::address_hash(address))
}

/// [`endpoint_key`] from the address's `crate::by_address::address_hash` (`xxh3_64(address)`).
pub fn endpoint_key_of_hash(hash: u64) -> u32 {
    hash as u32
}

/// The first checkpoint, in blocks (1 KiB of text with the default 256-byte blocks). A shorter
/// shared prefix is cheap to recompute and not worth a shared-data write per request.
pub const FIRST_CHECKPOINT: usize = 4;

/// Checkpoint positions (in blocks) for a request of `n` blocks: 4, 8, 16, … ≤ n.
pub fn checkpoints(n: usize) -> impl Iterator<Item = usize> {
    std::iter::successors(Some(FIRST_CHECKPOINT), |p| p.checked_mul(2)).take_while(move |&p| p <= n)
}

fn records(value: &[u8]) -> impl DoubleEndedIterator<Item = (u64, u32)> + '_ {
    let usable = if value.len().is_multiple_of(RECORD_BYTES) { value } else { &[] };
    usable.chunks_exact(RECORD_BYTES).map(|r| {
        let mut h = [0u8; 8];
        let mut e = [0u8; 4];
        let (a, b) = r.split_at(8);
        h.copy_from_slice(a);
        e.copy_from_slice(b.get(..4).unwrap_or(&[0; 4]));
        (u64::from_le_bytes(h), u32::from_le_bytes(e))
    })
}

/// The endpoint key stored for `h` in a shard value.
pub fn find(value: &[u8], h: u64) -> Option<u32> {
    records(value).rev().find(|&(rh, _)| rh == h).map(|(_, e)| e)
}

/// `value` with `updates` moved/added to the end and the oldest records dropped beyond `max`.
pub fn upsert(value: &[u8], updates: &[(u64, u32)], max: usize) -> Vec<u8> {
    let usable = if value.len().is_multiple_of(RECORD_BYTES) { value } else { &[] };
    let updated = |h: u64| updates.iter().any(|&(u, _)| u == h);
    let kept = records(usable).filter(|&(h, _)| !updated(h)).count();
    let mut skip = (kept + updates.len()).saturating_sub(max);
    let mut out = Vec::with_capacity((kept + updates.len()).min(max) * RECORD_BYTES);
    for (rec, (h, _)) in usable.chunks_exact(RECORD_BYTES).zip(records(usable)) {
        if updated(h) {
            continue;
        }
        if skip > 0 {
            skip -= 1;
            continue;
        }
        out.extend_from_slice(rec);
    }
    for (h, e) in updates {
        if skip > 0 {
            skip -= 1;
            continue;
        }
        out.extend_from_slice(&h.to_le_bytes());
        out.extend_from_slice(&e.to_le_bytes());
    }
    out
}

/// What one request's lookup found, kept for its write.
#[derive(Debug, Default)]
pub struct Lookup {
    /// (checkpoint position in blocks, endpoint key), ascending.
    pub hits: Vec<(usize, u32)>,
    /// Shard values read (shard, value, cas), reused by [`SharedPrefix::record`].
    read: Vec<(usize, Vec<u8>, u32)>,
    pub reads: usize,
}

impl Lookup {
    /// Longest checkpoint that maps to `key`, in blocks (0 if none).
    pub fn matched(&self, key: u32) -> usize {
        self.hits.iter().filter(|(_, k)| *k == key).map(|(p, _)| *p).max().unwrap_or(0)
    }

    /// The hits' keys in one word (bit `key mod 64`), for [`Lookup::matched_filtered`].
    pub fn key_filter(&self) -> u64 {
        self.hits.iter().fold(0, |m, (_, k)| m | (1u64 << (k % 64)))
    }

    /// [`Lookup::matched`], where `filter` is [`Lookup::key_filter`]: a key none of the hits can
    /// name (most candidates) costs one bit test instead of a walk over the hits.
    pub fn matched_filtered(&self, key: u32, filter: u64) -> usize {
        if filter & (1u64 << (key % 64)) == 0 {
            return 0;
        }
        self.matched(key)
    }
}

/// The table's shape (built once from config); the data itself lives in the store.
#[derive(Debug, Clone)]
pub struct SharedPrefix {
    keys: Vec<String>,
    entries: usize,
}

impl SharedPrefix {
    pub fn new(shards: usize, entries: usize) -> Self {
        Self { keys: (0..shards).map(|i| format!("{KEY_PREFIX}{i:04}")).collect(), entries: entries.max(1) }
    }

    pub fn enabled(&self) -> bool {
        !self.keys.is_empty()
    }

    /// Every key the table can ever write.
    pub fn keys(&self) -> &[String] {
        &self.keys
    }

    fn shard(&self, h: u64) -> usize {
        (h % self.keys.len().max(1) as u64) as usize
    }

    fn get(&self, store: &dyn SharedStore, shard: usize) -> Result<(Vec<u8>, u32), StoreError> {
        let key = self.keys.get(shard).ok_or(StoreError::Host("no such shard".into()))?;
        Ok(store.get(key)?.unwrap_or_default())
    }

    /// Looks up the checkpoints of `hashes` in ascending order until the first miss.
    pub fn lookup(&self, store: &dyn SharedStore, hashes: &[u64]) -> Lookup {
        let mut out = Lookup::default();
        if !self.enabled() {
            return out;
        }
        for p in checkpoints(hashes.len()) {
            let Some(&h) = hashes.get(p - 1) else { break };
            let shard = self.shard(h);
            let found = match out.read.iter().find(|(s, _, _)| *s == shard) {
                Some((_, v, _)) => find(v, h),
                None => {
                    out.reads += 1;
                    match self.get(store, shard) {
                        Ok((v, cas)) => {
                            let f = find(&v, h);
                            out.read.push((shard, v, cas));
                            f
                        }
                        Err(_) => None,
                    }
                }
            };
            match found {
                Some(key) => out.hits.push((p, key)),
                None => break,
            }
        }
        out
    }

    /// Writes `key` at every checkpoint of `hashes` not already known to map to it. Returns the
    /// number of successful shard writes.
    /// Consumes the values the lookup read (they become the first CAS attempt's input).
    pub fn record(&self, store: &dyn SharedStore, hashes: &[u64], key: u32, lookup: &mut Lookup) -> usize {
        if !self.enabled() {
            return 0;
        }
        let mut todo: Vec<(usize, u64)> = checkpoints(hashes.len())
            .filter(|p| !lookup.hits.iter().any(|&(hp, hk)| hp == *p && hk == key))
            .filter_map(|p| hashes.get(p - 1))
            .map(|&h| (self.shard(h), h))
            .collect();
        todo.sort_unstable();
        let mut writes = 0;
        let mut rest = todo.as_slice();
        while let Some(&(shard, _)) = rest.first() {
            let n = rest.iter().take_while(|(s, _)| *s == shard).count();
            let (group, tail) = rest.split_at(n);
            rest = tail;
            let updates: Vec<(u64, u32)> = group.iter().map(|&(_, h)| (h, key)).collect();
            if self.write_shard(store, shard, &updates, lookup) {
                writes += 1;
            }
        }
        writes
    }

    fn write_shard(
        &self,
        store: &dyn SharedStore,
        shard: usize,
        updates: &[(u64, u32)],
        lookup: &Lookup,
    ) -> bool {
        let Some(k) = self.keys.get(shard) else { return false };
        let mut cached = lookup.read.iter().find(|(s, _, _)| *s == shard).map(|(_, v, c)| (v.clone(), *c));
        for _ in 0..MAX_CAS_ATTEMPTS {
            let (value, cas) = match cached.take() {
                Some(vc) => vc,
                None => match self.get(store, shard) {
                    Ok(vc) => vc,
                    Err(_) => return false,
                },
            };
            if cas == 0 {
                // Never written (a real token is never 0): create it empty with the creation CAS,
                // which fails if a racing worker created it first, then update with CAS.
                match store.set(k, b"", crate::ports::CREATE_CAS) {
                    Ok(()) | Err(StoreError::CasMismatch) => continue,
                    Err(_) => return false,
                }
            }
            match store.set(k, &upsert(&value, updates, self.entries), cas) {
                Ok(()) => return true,
                Err(StoreError::CasMismatch) => continue,
                Err(_) => return false,
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ports::MemStore;

    #[test]
    fn the_key_filter_never_hides_a_hit() {
        let l = Lookup { hits: vec![(4, 7), (8, 7), (16, 71), (32, 3)], ..Default::default() };
        let f = l.key_filter();
        for key in 0..300u32 {
            assert_eq!(l.matched_filtered(key, f), l.matched(key), "key {key}");
        }
        assert_eq!((l.matched(7), l.matched(71), l.matched(135)), (8, 16, 0));
        assert_eq!(Lookup::default().key_filter(), 0);
    }

    #[test]
    fn checkpoint_positions() {
        assert_eq!(checkpoints(0).collect::<Vec<_>>(), Vec::<usize>::new());
        assert_eq!(checkpoints(3).collect::<Vec<_>>(), Vec::<usize>::new());
        assert_eq!(checkpoints(4).collect::<Vec<_>>(), vec![4]);
        assert_eq!(checkpoints(17).collect::<Vec<_>>(), vec![4, 8, 16]);
        assert_eq!(checkpoints(256).count(), 7);
    }

    #[test]
    fn upsert_moves_to_end_and_bounds() {
        let v = upsert(&[], &[(1, 10), (2, 20)], 3);
        assert_eq!(v.len(), 24);
        // Re-writing 1 moves it to the end with the new endpoint; 3 is added; max 3 kept.
        let v = upsert(&v, &[(1, 11), (3, 30)], 3);
        assert_eq!(records(&v).collect::<Vec<_>>(), vec![(2, 20), (1, 11), (3, 30)]);
        // One more drops the oldest (2).
        let v = upsert(&v, &[(4, 40)], 3);
        assert_eq!(records(&v).collect::<Vec<_>>(), vec![(1, 11), (3, 30), (4, 40)]);
        assert_eq!((find(&v, 3), find(&v, 2)), (Some(30), None));
        // Garbage length reads as empty.
        assert_eq!(find(&[1, 2, 3], 0), None);
        assert_eq!(upsert(&[1, 2, 3], &[(5, 50)], 3).len(), 12);
    }

    #[test]
    fn second_worker_finds_first_workers_conversation() {
        let store = MemStore::new();
        let t = SharedPrefix::new(8, 64);
        // Turn 1: 10 blocks → checkpoints 4 and 8 written for endpoint 7.
        let turn1: Vec<u64> = (100..110).collect();
        let mut l = t.lookup(&store, &turn1);
        assert_eq!((l.hits.len(), l.reads), (0, 1));
        assert!(t.record(&store, &turn1, 7, &mut l) >= 1);
        // Turn 2 (another worker, same store): extends turn 1 to 20 blocks. Checkpoints 4 and 8
        // hit endpoint 7, 16 misses: matched lower bound 8 of 20 (the truth is 10).
        let mut turn2 = turn1.clone();
        turn2.extend(200..210);
        let mut l = t.lookup(&store, &turn2);
        assert_eq!(l.hits, vec![(4, 7), (8, 7)]);
        assert_eq!((l.matched(7), l.matched(8)), (8, 0));
        // Recording turn 2 on endpoint 7 writes only checkpoint 16 (one shard).
        assert_eq!(t.record(&store, &turn2, 7, &mut l), 1);
        assert_eq!(t.lookup(&store, &turn2).matched(7), 16);
        // A prompt of 3 blocks is never looked up or written.
        let mut l = t.lookup(&store, &[1, 2, 3]);
        assert_eq!((l.reads, t.record(&store, &[1, 2, 3], 7, &mut l)), (0, 0));
    }

    #[test]
    fn keys_stay_bounded() {
        let store = MemStore::new();
        let t = SharedPrefix::new(4, 16);
        for i in 0..500u64 {
            let hs: Vec<u64> = (0..64).map(|j| i.wrapping_mul(1_000_003).wrapping_add(j * 7919)).collect();
            let mut l = t.lookup(&store, &hs);
            t.record(&store, &hs, (i % 5) as u32, &mut l);
        }
        assert_eq!(store.key_count(), 4);
        for k in store.keys() {
            assert!(store.get(&k).unwrap().unwrap().0.len() <= 16 * RECORD_BYTES);
        }
        let off = SharedPrefix::new(0, 16);
        assert!(off.lookup(&store, &[1, 2, 3, 4]).hits.is_empty());
        assert_eq!(off.record(&store, &[1, 2, 3, 4], 1, &mut Lookup::default()), 0);
    }

    /// Every set loses the race once, as if another worker wrote in between.
    struct RacingOnce {
        inner: MemStore,
        raced: std::cell::Cell<bool>,
    }
    impl SharedStore for RacingOnce {
        fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
            self.inner.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
            if !self.raced.replace(true) {
                let other = upsert(&[], &[(999, 9)], 16);
                self.inner.set(key, &other, 0)?;
            }
            self.inner.set(key, value, cas)
        }
    }

    #[test]
    fn two_first_writers_of_a_shard_both_land() {
        // Worker A looked the shard up (absent); worker B then writes it first. A's write must
        // not erase B's record.
        let t = SharedPrefix::new(1, 16);
        let s = MemStore::new();
        let hashes: Vec<u64> = (1..=4).collect();
        let mut a_lookup = t.lookup(&s, &hashes);
        let mut b_lookup = t.lookup(&s, &[10, 20, 30, 40]);
        assert_eq!(t.record(&s, &[10, 20, 30, 40], 0xB, &mut b_lookup), 1);
        assert_eq!(t.record(&s, &hashes, 0xA, &mut a_lookup), 1);
        let (v, _) = s.get(&t.keys()[0]).unwrap().unwrap();
        assert_eq!(find(&v, 40), Some(0xB));
        assert_eq!(find(&v, 4), Some(0xA));
    }

    #[test]
    fn cas_race_retries_and_keeps_the_other_write() {
        let s = RacingOnce { inner: MemStore::new(), raced: std::cell::Cell::new(false) };
        let t = SharedPrefix::new(1, 16);
        // The key exists already: a key never written has no CAS token (0 = "don't compare"),
        // so only the very first write of each shard can overwrite a concurrent first write.
        s.inner.set(&t.keys()[0], b"", 0).unwrap();
        let mut l = t.lookup(&s, &[1, 2, 3, 5]);
        assert_eq!(t.record(&s, &[1, 2, 3, 5], 1, &mut l), 1);
        let (v, _) = s.inner.get(&t.keys()[0]).unwrap().unwrap();
        assert_eq!((find(&v, 5), find(&v, 999)), (Some(1), Some(9)));
    }
}
