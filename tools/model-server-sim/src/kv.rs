//! KV-cache block pool with a prefix cache, after vLLM V1's `BlockPool` / `KVCacheManager`.
//!
//! ## Accounting
//! The GPU holds `total_blocks` blocks of `block_size` tokens. Every block is in exactly one of
//! three states:
//! - **used**: referenced by at least one live request (counted in `used_blocks`);
//! - **cached-free**: holds a finished prefix that no live request references. It still serves
//!   prefix hits, but may be evicted at any time to make room (`cached_free_blocks`);
//! - **free**: empty.
//!
//! KV usage, as vLLM reports it in `vllm:kv_cache_usage_perc`, is `used / total`: cached-free
//! blocks sit in vLLM's free queue and count as free.
//!
//! ## Cache units (why not one entry per block)
//! The prefix cache is keyed by *units*: one caller-supplied hash covers `tokens_per_hash` tokens,
//! which is a whole number `k` of blocks. With `k = 1` this is exactly vLLM's per-block cache.
//! A replay of the Mooncake trace (one hash per 512 tokens, ~12k-token prompts) can keep
//! `block_size = 16` for the KV accounting and pass `tokens_per_hash = 512`; then a prompt costs
//! ~24 hash-map operations instead of ~750, and a unit is cached or evicted as a whole (`k`
//! blocks at a time). The cost: hits are counted in whole units, so a shared prefix that ends
//! inside a unit is not a hit for that unit (vLLM would hit every full 16-token block).
//!
//! ## Eviction
//! Unreferenced units sit in an LRU list (an intrusive doubly linked list over a slab, so
//! "touch", "evict oldest" and "free" are O(1)). A request releases its units tail first, as vLLM
//! does, so that the tail of a prompt is evicted before its (more shareable) head.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use inference_picker::base::ports::SplitMix64;

/// Sentinel for "no unit" in the LRU links.
const NIL: u32 = u32::MAX;

/// A hasher for keys that are already 64-bit hashes, or small integer ids (Mooncake's `hash_ids`
/// are sequential integers). `SplitMix64::mix` spreads the bits so hash tables probe well.
#[derive(Default, Clone, Copy)]
pub(crate) struct U64Hasher(u64);

impl Hasher for U64Hasher {
    fn finish(&self) -> u64 {
        SplitMix64::mix(self.0)
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only used for u64 keys; this fallback keeps the trait total.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

pub(crate) type U64Map<V> = HashMap<u64, V, BuildHasherDefault<U64Hasher>>;

#[derive(Debug, Clone)]
struct Unit {
    key: u64,
    refcnt: u32,
    prev: u32,
    next: u32,
}

/// Block pool plus prefix cache. All counts are in blocks unless named otherwise.
#[derive(Debug, Clone)]
pub(crate) struct KvCache {
    blocks_per_unit: u64,
    total_blocks: u64,
    used_blocks: u64,
    cached_free_blocks: u64,
    units: Vec<Unit>,
    free_slots: Vec<u32>,
    index: U64Map<u32>,
    lru_head: u32,
    lru_tail: u32,
    evicted_units: u64,
    /// While a what-if runs ([`KvCache::begin_journal`]): how to undo every change since.
    journal: Option<Journal>,
}

/// The undo log of a what-if: the scalars at its start and every structural change since, in
/// order (undone in reverse).
#[derive(Debug, Clone)]
struct Journal {
    used_blocks: u64,
    cached_free_blocks: u64,
    lru_head: u32,
    lru_tail: u32,
    evicted_units: u64,
    units_len: usize,
    ops: Vec<Undo>,
}

#[derive(Debug, Clone)]
enum Undo {
    /// `units[id]` held this before a write.
    Unit(u32, Unit),
    IndexInserted(u64),
    IndexRemoved(u64, u32),
    FreeSlotPushed,
    FreeSlotPopped(u32),
}

impl KvCache {
    pub(crate) fn new(total_blocks: u64, blocks_per_unit: u64) -> Self {
        KvCache {
            blocks_per_unit: blocks_per_unit.max(1),
            total_blocks,
            used_blocks: 0,
            cached_free_blocks: 0,
            units: Vec::new(),
            free_slots: Vec::new(),
            index: U64Map::default(),
            lru_head: NIL,
            lru_tail: NIL,
            evicted_units: 0,
            journal: None,
        }
    }

    /// Start recording every change, so that [`KvCache::rollback`] can restore this state
    /// exactly (a what-if on the real cache instead of on a copy of it: copying a cache of
    /// 25,000 units per candidate was most of the oracle's time). Nested what-ifs are not
    /// supported: a second call restarts the journal.
    pub(crate) fn begin_journal(&mut self) {
        self.journal = Some(Journal {
            used_blocks: self.used_blocks,
            cached_free_blocks: self.cached_free_blocks,
            lru_head: self.lru_head,
            lru_tail: self.lru_tail,
            evicted_units: self.evicted_units,
            units_len: self.units.len(),
            ops: Vec::new(),
        });
    }

    /// Undo every change since [`KvCache::begin_journal`] and stop recording. The state is the
    /// same for every observable purpose (lookups, counts, LRU order, slot reuse); only the hash
    /// table's internal layout may differ, which nothing reads.
    pub(crate) fn rollback(&mut self) {
        let Some(j) = self.journal.take() else { return };
        for op in j.ops.into_iter().rev() {
            match op {
                Undo::Unit(id, u) => {
                    if let Some(slot) = self.units.get_mut(id as usize) {
                        *slot = u;
                    }
                }
                Undo::IndexInserted(key) => {
                    self.index.remove(&key);
                }
                Undo::IndexRemoved(key, id) => {
                    self.index.insert(key, id);
                }
                Undo::FreeSlotPushed => {
                    self.free_slots.pop();
                }
                Undo::FreeSlotPopped(id) => self.free_slots.push(id),
            }
        }
        self.units.truncate(j.units_len);
        self.used_blocks = j.used_blocks;
        self.cached_free_blocks = j.cached_free_blocks;
        self.lru_head = j.lru_head;
        self.lru_tail = j.lru_tail;
        self.evicted_units = j.evicted_units;
    }

    /// `units[id]` for writing; journals its old value during a what-if.
    fn unit_mut(&mut self, id: usize) -> Option<&mut Unit> {
        if let Some(j) = self.journal.as_mut() {
            if let Some(u) = self.units.get(id) {
                j.ops.push(Undo::Unit(id as u32, u.clone()));
            }
        }
        self.units.get_mut(id)
    }

    fn journal(&mut self, op: Undo) {
        if let Some(j) = self.journal.as_mut() {
            j.ops.push(op);
        }
    }

    pub(crate) fn total_blocks(&self) -> u64 {
        self.total_blocks
    }
    pub(crate) fn used_blocks(&self) -> u64 {
        self.used_blocks
    }
    pub(crate) fn cached_free_blocks(&self) -> u64 {
        self.cached_free_blocks
    }
    pub(crate) fn evicted_units(&self) -> u64 {
        self.evicted_units
    }
    /// Blocks a new allocation may take: empty ones plus evictable cached ones.
    pub(crate) fn available_blocks(&self) -> u64 {
        self.total_blocks.saturating_sub(self.used_blocks)
    }
    /// Units currently in the cache index (referenced or evictable).
    pub(crate) fn cached_units(&self) -> usize {
        self.index.len()
    }

    /// How many leading keys are cached, stopping at the first miss (hashes are chained, so a
    /// later key can only be reused if every earlier one was). Does not change any state.
    pub(crate) fn lookup_prefix(&self, keys: &[u64]) -> usize {
        keys.iter().take_while(|k| self.index.contains_key(k)).count()
    }

    /// Whether `acquire(keys[..hits])` followed by `allocate(private)` would succeed.
    /// Acquiring an unreferenced cached unit moves it from evictable to used, so it reduces what
    /// is left for the private allocation.
    pub(crate) fn can_admit(&self, keys: &[u64], private_blocks: u64) -> bool {
        let revived = keys.iter().filter(|k| self.unit_of(**k).is_some_and(|u| u.refcnt == 0)).count() as u64;
        self.available_blocks() >= revived * self.blocks_per_unit + private_blocks
    }

    fn unit_of(&self, key: u64) -> Option<&Unit> {
        self.index.get(&key).and_then(|&i| self.units.get(i as usize))
    }

    /// Take a reference on each cached key (all must be cached: call after `lookup_prefix`).
    /// Returns the unit ids in order; keys that are somehow missing are skipped.
    pub(crate) fn acquire(&mut self, keys: &[u64]) -> Vec<u32> {
        let mut ids = Vec::with_capacity(keys.len());
        for key in keys {
            let Some(&id) = self.index.get(key) else { continue };
            let revive = self.units.get(id as usize).is_some_and(|u| u.refcnt == 0);
            if revive {
                self.lru_unlink(id);
                self.cached_free_blocks -= self.blocks_per_unit;
                self.used_blocks += self.blocks_per_unit;
            }
            if let Some(u) = self.unit_mut(id as usize) {
                u.refcnt += 1;
            }
            ids.push(id);
        }
        ids
    }

    /// Allocate `n` private blocks, evicting least-recently-freed cached units as needed.
    /// Returns false (and changes nothing) if even eviction cannot make room.
    pub(crate) fn allocate(&mut self, n: u64) -> bool {
        if self.available_blocks() < n {
            return false;
        }
        while self.free_blocks() < n {
            if !self.evict_oldest() {
                return false; // unreachable while the counters are consistent
            }
        }
        self.used_blocks += n;
        true
    }

    /// Return `n` private blocks to the free pool.
    pub(crate) fn release_private(&mut self, n: u64) {
        self.used_blocks = self.used_blocks.saturating_sub(n);
    }

    /// Make a private unit's blocks (already counted as used) a cached unit under `key`, held
    /// by the caller with one reference. Returns None if `key` is already cached (another
    /// request computed the same prefix concurrently); the caller then keeps its blocks
    /// private, as vLLM keeps duplicate blocks uncached.
    pub(crate) fn register(&mut self, key: u64) -> Option<u32> {
        if self.index.contains_key(&key) {
            return None;
        }
        let unit = Unit { key, refcnt: 1, prev: NIL, next: NIL };
        let id = match self.free_slots.pop() {
            Some(id) => {
                self.journal(Undo::FreeSlotPopped(id));
                if let Some(slot) = self.unit_mut(id as usize) {
                    *slot = unit;
                }
                id
            }
            None => {
                self.units.push(unit);
                (self.units.len() - 1) as u32
            }
        };
        self.index.insert(key, id);
        self.journal(Undo::IndexInserted(key));
        Some(id)
    }

    /// Drop one reference on each unit, in the order given (callers pass the tail first).
    /// A unit whose last reference goes becomes evictable (most recently used end of the LRU).
    pub(crate) fn release_units(&mut self, ids: impl Iterator<Item = u32>) {
        for id in ids {
            let now_free = match self.unit_mut(id as usize) {
                Some(u) if u.refcnt > 0 => {
                    u.refcnt -= 1;
                    u.refcnt == 0
                }
                _ => false,
            };
            if now_free {
                self.used_blocks = self.used_blocks.saturating_sub(self.blocks_per_unit);
                self.cached_free_blocks += self.blocks_per_unit;
                self.lru_push_back(id);
            }
        }
    }

    /// Make `key` a cached-free unit (most recently freed end of the LRU) if it is not cached
    /// yet, evicting the oldest unreferenced units to make room. False (and nothing changed but
    /// the evictions) when no room can be made. For a what-if copy of a server (the replay's
    /// oracle with an approximate prefix index), never on a real one.
    pub(crate) fn insert_cached(&mut self, key: u64) -> bool {
        if self.index.contains_key(&key) {
            return true;
        }
        while self.free_blocks() < self.blocks_per_unit {
            if !self.evict_oldest() {
                return false;
            }
        }
        let Some(id) = self.register(key) else { return true };
        if let Some(u) = self.unit_mut(id as usize) {
            u.refcnt = 0;
        }
        self.cached_free_blocks += self.blocks_per_unit;
        self.lru_push_back(id);
        true
    }

    fn free_blocks(&self) -> u64 {
        self.total_blocks.saturating_sub(self.used_blocks + self.cached_free_blocks)
    }

    fn evict_oldest(&mut self) -> bool {
        let id = self.lru_head;
        if id == NIL {
            return false;
        }
        self.lru_unlink(id);
        if let Some(key) = self.units.get(id as usize).map(|u| u.key) {
            if let Some(old) = self.index.remove(&key) {
                self.journal(Undo::IndexRemoved(key, old));
            }
        }
        self.free_slots.push(id);
        self.journal(Undo::FreeSlotPushed);
        self.cached_free_blocks -= self.blocks_per_unit;
        self.evicted_units += 1;
        true
    }

    fn lru_push_back(&mut self, id: u32) {
        let tail = self.lru_tail;
        if let Some(u) = self.unit_mut(id as usize) {
            u.prev = tail;
            u.next = NIL;
        }
        if tail == NIL {
            self.lru_head = id;
        } else if let Some(t) = self.unit_mut(tail as usize) {
            t.next = id;
        }
        self.lru_tail = id;
    }

    fn lru_unlink(&mut self, id: u32) {
        let (prev, next) = match self.units.get(id as usize) {
            Some(u) => (u.prev, u.next),
            None => return,
        };
        if prev == NIL {
            self.lru_head = next;
        } else if let Some(p) = self.unit_mut(prev as usize) {
            p.next = next;
        }
        if next == NIL {
            self.lru_tail = prev;
        } else if let Some(n) = self.unit_mut(next as usize) {
            n.prev = prev;
        }
        if let Some(u) = self.unit_mut(id as usize) {
            u.prev = NIL;
            u.next = NIL;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn register_release_then_hit() {
        // 10 blocks, 2 blocks per unit. A request allocates 4 private blocks, registers two
        // units over them, then releases: both units become cached-free (4 blocks), used 0.
        let mut kv = KvCache::new(10, 2);
        assert!(kv.allocate(4));
        let a = kv.register(11).unwrap();
        let b = kv.register(12).unwrap();
        assert_eq!(kv.used_blocks(), 4);
        kv.release_units([b, a].into_iter());
        assert_eq!((kv.used_blocks(), kv.cached_free_blocks()), (0, 4));
        assert_eq!(kv.lookup_prefix(&[11, 12, 13]), 2);
        // Chained: a miss on the first key hides later hits.
        assert_eq!(kv.lookup_prefix(&[99, 12]), 0);
        // Reviving unit 11 moves 2 blocks from cached-free to used.
        let ids = kv.acquire(&[11]);
        assert_eq!(ids, vec![a]);
        assert_eq!((kv.used_blocks(), kv.cached_free_blocks()), (2, 2));
    }

    #[test]
    fn eviction_takes_least_recently_freed_unit_first() {
        // 6 blocks, 2 per unit. Units A, B, C fill the pool; freed in order C, A, B
        // (LRU oldest = C). Allocating 2 private blocks must evict C only.
        let mut kv = KvCache::new(6, 2);
        assert!(kv.allocate(6));
        let a = kv.register(1).unwrap();
        let b = kv.register(2).unwrap();
        let c = kv.register(3).unwrap();
        kv.release_units([c, a, b].into_iter());
        assert!(kv.allocate(2));
        assert_eq!(kv.lookup_prefix(&[3]), 0, "C was oldest and is gone");
        assert_eq!(kv.lookup_prefix(&[1, 2]), 2, "A and B survive");
        assert_eq!(kv.evicted_units(), 1);
        // A touched (acquired and released again) becomes newest, so B goes next.
        let ids = kv.acquire(&[1]);
        kv.release_units(ids.into_iter());
        assert!(kv.allocate(2));
        assert_eq!(kv.lookup_prefix(&[2]), 0);
        assert_eq!(kv.lookup_prefix(&[1]), 1);
    }

    #[test]
    fn allocation_fails_without_side_effects_when_full() {
        let mut kv = KvCache::new(4, 1);
        assert!(kv.allocate(3));
        assert!(!kv.allocate(2), "only 1 block left");
        assert_eq!(kv.used_blocks(), 3);
        assert!(kv.allocate(1));
    }

    #[test]
    fn can_admit_counts_revived_units() {
        // 4 blocks, 1 per unit. Two cached-free units (keys 1, 2), 2 empty blocks.
        // Admitting keys [1,2] plus 2 private needs 2 (revived) + 2 = 4: fits.
        // With 3 private it needs 5 > 4: does not fit, although available_blocks() is 4.
        let mut kv = KvCache::new(4, 1);
        assert!(kv.allocate(2));
        let a = kv.register(1).unwrap();
        let b = kv.register(2).unwrap();
        kv.release_units([b, a].into_iter());
        assert!(kv.can_admit(&[1, 2], 2));
        assert!(!kv.can_admit(&[1, 2], 3));
        assert!(kv.can_admit(&[], 4), "both cached units can be evicted");
    }

    #[test]
    fn insert_cached_adds_an_evictable_unit_and_evicts_to_make_room() {
        // 4 blocks, 2 per unit: two inserts fill the pool as cached-free units; a third evicts
        // the oldest (key 1); nothing is counted as used.
        let mut kv = KvCache::new(4, 2);
        assert!(kv.insert_cached(1) && kv.insert_cached(2));
        assert_eq!((kv.used_blocks(), kv.cached_free_blocks()), (0, 4));
        assert!(kv.insert_cached(2), "already cached: nothing to do");
        assert!(kv.insert_cached(3));
        assert_eq!((kv.lookup_prefix(&[1]), kv.lookup_prefix(&[2, 3])), (0, 2));
        // With every block in use there is no room.
        let mut full = KvCache::new(2, 2);
        assert!(full.allocate(2));
        assert!(!full.insert_cached(9));
        assert_eq!(full.lookup_prefix(&[9]), 0);
    }

    #[test]
    fn rollback_restores_lookups_counts_lru_order_and_slot_reuse() {
        // A cache with history: units 1..=4 (2 blocks each, 10 blocks), 3 and 4 freed (LRU: 3
        // oldest), 1 and 2 held.
        let build = || {
            let mut kv = KvCache::new(10, 2);
            assert!(kv.allocate(8));
            let ids: Vec<u32> = (1..=4).map(|k| kv.register(k).unwrap()).collect();
            kv.release_units([ids[2], ids[3]].into_iter());
            (kv, ids)
        };
        let (mut kv, ids) = build();
        let (mut twin, _) = build();
        kv.begin_journal();
        // A what-if that evicts (3 and 4), registers, revives, inserts and releases.
        assert!(kv.allocate(4));
        let n = kv.register(9).unwrap();
        kv.acquire(&[1]);
        assert!(kv.insert_cached(11), "evicts 4 for room");
        kv.release_units([n, ids[0]].into_iter());
        kv.release_private(2);
        assert_eq!((kv.evicted_units(), kv.lookup_prefix(&[11]), kv.lookup_prefix(&[9])), (2, 1, 1));
        kv.rollback();
        assert_eq!((kv.used_blocks(), kv.cached_free_blocks(), kv.evicted_units()), (4, 4, 0));
        assert_eq!((kv.units.len(), &kv.free_slots), (twin.units.len(), &twin.free_slots));
        assert_eq!(kv.lookup_prefix(&[1, 2, 3, 4]), 4);
        assert_eq!(kv.lookup_prefix(&[9]) + kv.lookup_prefix(&[11]), 0);
        // The same future as the cache that never ran the what-if: 3 is evicted first, then 4,
        // and the freed slots are reused in the same order.
        for c in [&mut kv, &mut twin] {
            assert!(c.allocate(4));
            assert_eq!((c.lookup_prefix(&[3]), c.lookup_prefix(&[4])), (0, 1));
        }
        assert_eq!(kv.register(21), twin.register(21));
        assert_eq!((kv.lru_head, kv.lru_tail), (twin.lru_head, twin.lru_tail));
    }

    #[test]
    fn duplicate_register_is_refused() {
        let mut kv = KvCache::new(4, 1);
        assert!(kv.allocate(2));
        assert!(kv.register(7).is_some());
        assert!(kv.register(7).is_none());
        assert_eq!(kv.cached_units(), 1);
    }
}
