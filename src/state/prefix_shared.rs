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
//! `inference-picker/prefix2/NNNN` (default 256). Each value is a `crate::base::codec` record
//! (tag `PrefixShard`) holding a sequence of 18-byte records
//! `le64(octave hash) ‖ le32(endpoint key) ‖ 3 × le16(step tag)`, oldest first, at most
//! `shared_entries_per_shard` (default 64 → 1,154 bytes, which every read copies) records. A
//! hash names the endpoint that received it last (a worker's local index knows every pod it sent
//! it to). Keeping the last 8 endpoints per hash was measured and rejected: the table does not see evictions, so a pod that received a
//! prefix long ago stayed listed for it, and Mooncake's hit rate and TTFT p90 at 1 × 1 got
//! worse (13.4 % → 13.1 %, 1.18 → 1.21 s); overwriting lets the newest placement age the old
//! one out. Writing a hash that is present replaces its record (its endpoint and tags) and moves
//! it to the end; the oldest records fall off the front.
//! A hash lives in shard `hash mod shards`. The endpoint key is the low 32 bits of
//! `xxh3_64(address)`; it is only ever compared with the keys of the current candidates, so a
//! stale entry for an endpoint that left names nothing (a 32-bit collision among a pool's
//! candidates has odds ~n²/2³³, 1e-4 for 1024 endpoints, and would only misdirect a soft score).
//!
//! **Checkpoints: octaves, in quarter steps.** A record sits at each octave start `b` = 4, 8,
//! 16, … blocks (powers of two from [`FIRST_CHECKPOINT`] up to the request's block count), under
//! the chained hash of the prompt's first `b` blocks; its three step tags are the top 16 bits of
//! the chained hashes at `b × 5/4`, `b × 6/4` and `b × 7/4` (0 past the writer's prompt). A
//! reader whose own hashes give the same tags knows the endpoint holds those longer prefixes
//! too, so the match is resolved to a quarter octave (a lower bound at least 80 % of the truth;
//! whole octaves alone gave 50 %, which let a long shared system prompt look barely cached on
//! its pod to the workers that had not sent it there themselves) for one read and one write per
//! octave, as before. A 16-bit tag matches a foreign prefix with odds 1/65,536, only ever
//! overstating a soft score by less than an octave. A prompt shorter than 4 blocks (1 KiB) is
//! not shared across workers, since so short a prefix is cheap to recompute. A later turn
//! extends an earlier one, so it finds every record the earlier turn wrote.
//!
//! **Reads** walk the octaves in ascending order and stop at the first octave with no record (a
//! chain that misses at 2^j misses beyond it too, unless it was evicted): a fresh prompt costs 1
//! read, a conversation of n blocks about log2(n/4) + 2. The local index gives the exact count
//! when this worker sent the earlier turns itself.
//!
//! **Writes.** After the pick, the primary's key is written at every octave where the lookup did
//! not find it already covering this prompt, grouped by shard: one CAS read-modify-write per
//! shard touched, retried up to [`MAX_CAS_ATTEMPTS`] times. The values read during the lookup are
//! reused for the first attempt, so a conversation continuing on the same endpoint usually costs
//! 1 write (its newest octave) and no extra read. A write that keeps losing races is dropped: the
//! table is a hint, and the next turn writes again.
//!
//! **First writes.** A never-written shard has no CAS token, and a write with cas 0 is blind, so
//! two workers' very first writes to one shard could race and one be lost. A shard read as absent
//! is therefore first created empty with `crate::base::ports::CREATE_CAS` (Envoy accepts any cas on an
//! absent key and rejects a non-matching one on an existing key, so a racing creator's data is
//! never overwritten), then re-read and updated with CAS like any other write
//! (`two_first_writers_of_a_shard_both_land`).
//!
//! **Failure behaviour.** A store error on read counts as a miss; on write the update is
//! skipped. A value that is not a shard record (a wrong header, a length that is not a multiple
//! of 18 after it) is read as empty and replaced on the next write. A shard of a version this
//! build does not read (another build's, during a rolling upgrade) is a miss, and is left alone. Neither can make the scheduler fail a request.

use crate::base::codec::{self, Refusal, Tag, Writer};
use crate::base::ports::{SharedStore, StoreError};

/// `prefix2`: the 18-byte records with step tags (a release with the 12-byte records of
/// `prefix/` never reads them, nor they its).
pub const KEY_PREFIX: &str = "inference-picker/prefix2/";
/// Steps per octave: the octave start and `STEPS − 1` tagged positions after it.
pub const STEPS: usize = 4;
/// Bytes of one record: hash, endpoint key, a 16-bit tag per step after the octave start.
pub const RECORD_BYTES: usize = 8 + 4 + 2 * (STEPS - 1);
pub const MAX_CAS_ATTEMPTS: usize = 4;

/// The key naming an endpoint in the table: the low 32 bits of `xxh3_64(address)`.
pub fn endpoint_key(address: &str) -> u32 {
    endpoint_key_of_hash(crate::state::by_address::address_hash(address))
}

/// [`endpoint_key`] from the address's `crate::state::by_address::address_hash` (`xxh3_64(address)`).
pub fn endpoint_key_of_hash(hash: u64) -> u32 {
    hash as u32
}

/// The first checkpoint, in blocks (1 KiB of text with the default 256-byte blocks). A shorter
/// shared prefix is cheap to recompute and not worth a shared-data write per request.
pub const FIRST_CHECKPOINT: usize = 4;

/// Octave starts (in blocks) for a request of `n` blocks: 4, 8, 16, … ≤ n.
pub fn checkpoints(n: usize) -> impl Iterator<Item = usize> {
    std::iter::successors(Some(FIRST_CHECKPOINT), |p| p.checked_mul(2)).take_while(move |&p| p <= n)
}

/// The tagged positions after octave start `b`: `b + q × b / STEPS`, q = 1 … STEPS − 1.
fn step_positions(b: usize) -> impl Iterator<Item = usize> {
    (1..STEPS).map(move |q| b + q * b / STEPS)
}

/// A chained hash's step tag: its top 16 bits, never 0 (0 marks a position past the prompt).
fn tag(h: u64) -> u16 {
    ((h >> 48) as u16).max(1)
}

/// One record: (octave hash, endpoint key, step tags).
pub type Record = (u64, u32, [u16; STEPS - 1]);

/// The step tags of `hashes` after octave start `b` (0 past the prompt).
pub fn step_tags(hashes: &[u64], b: usize) -> [u16; STEPS - 1] {
    let mut t = [0u16; STEPS - 1];
    for (slot, p) in t.iter_mut().zip(step_positions(b)) {
        if let Some(&h) = p.checked_sub(1).and_then(|i| hashes.get(i)) {
            *slot = tag(h);
        }
    }
    t
}

/// How far a record at octave start `b` with tags `stored` covers `hashes`: `b`, or the last
/// step position up to which every tag matches (and lies within the prompt).
fn covered(hashes: &[u64], b: usize, stored: &[u16; STEPS - 1]) -> usize {
    let mut m = b;
    for (p, &s) in step_positions(b).zip(stored) {
        match p.checked_sub(1).and_then(|i| hashes.get(i)) {
            Some(&h) if s != 0 && tag(h) == s => m = p,
            _ => break,
        }
    }
    m
}

/// The furthest this prompt reaches within octave `b`: its last step position (or `b`).
fn reach(n: usize, b: usize) -> usize {
    step_positions(b).filter(|&p| p <= n).last().unwrap_or(b)
}

/// What a shard value holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shard<'a> {
    /// The records (a whole number of [`RECORD_BYTES`]), oldest first; empty for an empty value.
    Records(&'a [u8]),
    /// Not a shard record of this build's format: read as empty, replaced by the next write.
    Garbled,
    /// A shard of a version this build does not read (another build's table): a miss for the
    /// reader, and the writer leaves it alone.
    Other,
}

/// Reads a shard value's header (`crate::base::codec`, tag `PrefixShard`: then the 18-byte
/// records, no count).
pub fn shard(value: &[u8]) -> Shard<'_> {
    if value.is_empty() {
        return Shard::Records(&[]);
    }
    match codec::open(value, Tag::PrefixShard) {
        Ok(r) if r.remaining().len().is_multiple_of(RECORD_BYTES) => Shard::Records(r.remaining()),
        Ok(_) | Err(Refusal::Malformed) => Shard::Garbled,
        Err(Refusal::UnknownVersion(_)) => Shard::Other,
    }
}

/// The records of a shard value (none unless it is one of this build's format).
fn usable(value: &[u8]) -> &[u8] {
    match shard(value) {
        Shard::Records(r) => r,
        Shard::Garbled | Shard::Other => &[],
    }
}

/// Records packed back to back (a whole number of [`RECORD_BYTES`], else none): a shard's body
/// or a peer batch's.
fn raw_records(raw: &[u8]) -> impl DoubleEndedIterator<Item = Record> + '_ {
    let usable = if raw.len().is_multiple_of(RECORD_BYTES) { raw } else { &[] };
    usable.chunks_exact(RECORD_BYTES).map(|r| {
        let mut h = [0u8; 8];
        let mut e = [0u8; 4];
        h.copy_from_slice(r.get(..8).unwrap_or(&[0; 8]));
        e.copy_from_slice(r.get(8..12).unwrap_or(&[0; 4]));
        let mut t = [0u16; STEPS - 1];
        for (q, slot) in t.iter_mut().enumerate() {
            let at = 12 + 2 * q;
            if let (Some(&lo), Some(&hi)) = (r.get(at), r.get(at + 1)) {
                *slot = u16::from_le_bytes([lo, hi]);
            }
        }
        (u64::from_le_bytes(h), u32::from_le_bytes(e), t)
    })
}

fn records(value: &[u8]) -> impl DoubleEndedIterator<Item = Record> + '_ {
    raw_records(usable(value))
}

/// Records packed back to back (see [`decode_raw`]).
pub fn put_raw(w: &mut Writer, (h, e, t): &Record) {
    w.u64(*h).u32(*e);
    for x in t {
        w.u16(*x);
    }
}

/// Records packed back to back, oldest first (none unless a whole number of
/// [`RECORD_BYTES`]): the body of a shard or of a peer batch.
pub fn decode_raw(raw: &[u8]) -> Vec<Record> {
    raw_records(raw).collect()
}

/// A shard value holding `records` (tests and tools).
pub fn encode(records: &[Record]) -> Vec<u8> {
    let mut w = Writer::new(Tag::PrefixShard, records.len() * RECORD_BYTES);
    for r in records {
        put_raw(&mut w, r);
    }
    w.finish()
}

/// The record stored most recently for `h` in a shard value: (endpoint key, step tags).
pub fn find_record(value: &[u8], h: u64) -> Option<(u32, [u16; STEPS - 1])> {
    records(value).rev().find(|r| r.0 == h).map(|r| (r.1, r.2))
}

/// The endpoint key stored most recently for `h` in a shard value.
pub fn find(value: &[u8], h: u64) -> Option<u32> {
    find_record(value, h).map(|(e, _)| e)
}

/// `value` with `updates` put at the end (each replacing the record of the same hash: a hash
/// names the endpoint that received it last) and the oldest records dropped beyond `max`.
pub fn upsert(value: &[u8], updates: &[Record], max: usize) -> Vec<u8> {
    let usable = usable(value);
    let updated = |h: u64| updates.iter().any(|u| u.0 == h);
    let kept = raw_records(usable).filter(|r| !updated(r.0)).count();
    // A hash twice in `updates`: its last record wins.
    let fresh: Vec<&Record> = updates
        .iter()
        .enumerate()
        .filter(|(i, u)| !updates.iter().skip(i + 1).any(|v| v.0 == u.0))
        .map(|(_, u)| u)
        .collect();
    let mut skip = (kept + fresh.len()).saturating_sub(max);
    let mut w = Writer::new(Tag::PrefixShard, (kept + fresh.len()).min(max) * RECORD_BYTES);
    for (rec, r) in usable.chunks_exact(RECORD_BYTES).zip(raw_records(usable)) {
        if updated(r.0) {
            continue;
        }
        if skip > 0 {
            skip -= 1;
            continue;
        }
        w.raw(rec);
    }
    for r in fresh {
        if skip > 0 {
            skip -= 1;
            continue;
        }
        put_raw(&mut w, r);
    }
    w.finish()
}

/// The records of a shard value, oldest first (none when it is not a shard record of this
/// build's format, [`shard`]).
pub fn decode(value: &[u8]) -> Vec<Record> {
    records(value).collect()
}

/// The records of `after` that `before` does not hold identically (same hash, endpoint and
/// tags), oldest first: what was written to a shard between two reads of it. Applied to another
/// table with [`upsert`], they replay those writes there (a hash rewritten twice in between
/// gives its latest record once).
pub fn delta(before: &[u8], after: &[u8]) -> Vec<Record> {
    let old = decode(before);
    records(after).filter(|r| !old.contains(r)).collect()
}

/// What one request's lookup found, kept for its write.
#[derive(Debug, Default)]
pub struct Lookup {
    /// (blocks the record covers, endpoint key), by ascending octave.
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

    /// Looks up the octaves of `hashes` in ascending order until the first one with no record.
    pub fn lookup(&self, store: &dyn SharedStore, hashes: &[u64]) -> Lookup {
        let mut out = Lookup::default();
        if !self.enabled() {
            return out;
        }
        for b in checkpoints(hashes.len()) {
            let Some(&h) = hashes.get(b - 1) else { break };
            let shard = self.shard(h);
            let found = match out.read.iter().find(|(s, _, _)| *s == shard) {
                Some((_, v, _)) => find_record(v, h),
                None => {
                    out.reads += 1;
                    match self.get(store, shard) {
                        Ok((v, cas)) => {
                            let f = find_record(&v, h);
                            out.read.push((shard, v, cas));
                            f
                        }
                        Err(_) => None,
                    }
                }
            };
            match found {
                Some((key, tags)) => out.hits.push((covered(hashes, b, &tags), key)),
                None => break,
            }
        }
        out
    }

    /// Writes `key` at every octave of `hashes` where the lookup did not find it covering this
    /// prompt already. Returns the number of successful shard writes.
    /// Consumes the values the lookup read (they become the first CAS attempt's input).
    pub fn record(&self, store: &dyn SharedStore, hashes: &[u64], key: u32, lookup: &mut Lookup) -> usize {
        if !self.enabled() {
            return 0;
        }
        let n = hashes.len();
        let mut todo: Vec<(usize, Record)> = checkpoints(n)
            .filter(|&b| !lookup.hits.iter().any(|&(hp, hk)| hk == key && hp == reach(n, b)))
            .filter_map(|b| hashes.get(b - 1).map(|&h| (self.shard(h), (h, key, step_tags(hashes, b)))))
            .collect();
        todo.sort_unstable_by_key(|(s, r)| (*s, r.0));
        self.write_grouped(store, &todo, lookup)
    }

    /// One CAS write per shard of `todo` (sorted by shard). Returns the writes that landed.
    fn write_grouped(&self, store: &dyn SharedStore, todo: &[(usize, Record)], lookup: &Lookup) -> usize {
        let mut writes = 0;
        let mut rest = todo;
        while let Some(&(shard, _)) = rest.first() {
            let n = rest.iter().take_while(|(s, _)| *s == shard).count();
            let (group, tail) = rest.split_at(n);
            rest = tail;
            let updates: Vec<Record> = group.iter().map(|&(_, r)| r).collect();
            if self.write_shard(store, shard, &updates, lookup) {
                writes += 1;
            }
        }
        writes
    }

    /// Applies records another gateway wrote to its table (`crate::poll::peers`): each goes to its
    /// shard with [`upsert`] (it replaces this table's record of the same hash: the newest write
    /// wins), one CAS read-modify-write per shard touched. Returns the shard writes that landed.
    pub fn apply(&self, store: &dyn SharedStore, records: &[Record]) -> usize {
        if !self.enabled() {
            return 0;
        }
        let mut todo: Vec<(usize, Record)> = records.iter().map(|&r| (self.shard(r.0), r)).collect();
        // Stable: a hash given twice keeps its order, so `upsert` keeps the later record.
        todo.sort_by_key(|(s, _)| *s);
        self.write_grouped(store, &todo, &Lookup::default())
    }

    /// The current value of every shard, in key order (an absent or unreadable shard is empty).
    pub fn read_all(&self, store: &dyn SharedStore) -> Vec<Vec<u8>> {
        (0..self.keys.len()).map(|i| self.get(store, i).map(|(v, _)| v).unwrap_or_default()).collect()
    }

    fn write_shard(
        &self,
        store: &dyn SharedStore,
        shard: usize,
        updates: &[Record],
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
            if self::shard(&value) == Shard::Other {
                // Another build's shard: left to it (its table, not ours to overwrite).
                return false;
            }
            if cas == 0 {
                // Never written (a real token is never 0): create it empty with the creation CAS,
                // which fails if a racing worker created it first, then update with CAS.
                match store.set(k, b"", crate::base::ports::CREATE_CAS) {
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
    use crate::base::ports::MemStore;

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

    const T: [u16; 3] = [0; 3];

    /// `n` distinct block hashes derived from `seed` (stand-ins for a prompt's chained hashes).
    fn chain(seed: u64, n: u64) -> Vec<u64> {
        (1..=n).map(|i| i.wrapping_mul(seed)).collect()
    }

    #[test]
    fn upsert_moves_to_end_and_bounds() {
        let v = upsert(&[], &[(1, 10, T), (2, 20, T)], 3);
        assert_eq!(v.len(), 2 + 2 * RECORD_BYTES);
        // Re-writing (1, 10) moves it to the end with its new tags; (3, 30) is added; max 3.
        let v = upsert(&v, &[(1, 10, [5, 6, 7]), (3, 30, T)], 3);
        assert_eq!(records(&v).collect::<Vec<_>>(), vec![(2, 20, T), (1, 10, [5, 6, 7]), (3, 30, T)]);
        // One more drops the oldest (2).
        let v = upsert(&v, &[(4, 40, T)], 3);
        assert_eq!(records(&v).collect::<Vec<_>>(), vec![(1, 10, [5, 6, 7]), (3, 30, T), (4, 40, T)]);
        assert_eq!((find(&v, 3), find(&v, 2)), (Some(30), None));
        // Garbage length reads as empty.
        assert_eq!(find(&[1, 2, 3], 0), None);
        assert_eq!(upsert(&[1, 2, 3], &[(5, 50, T)], 3).len(), 2 + RECORD_BYTES);
    }

    /// Mixed builds: a shard of the next release is a miss here and is never overwritten by
    /// this build; the next release reads and updates this one's.
    #[test]
    fn a_shard_of_another_release_is_skipped_and_left_alone() {
        let table = SharedPrefix::new(1, 8);
        let store = MemStore::new();
        let hashes: Vec<u64> = (1..=8).collect();
        let theirs = codec::as_next(&upsert(&[], &[(4, 77, T)], 8), Tag::PrefixShard);
        store.set(&table.keys()[0], &theirs, 0).unwrap();
        let mut lookup = table.lookup(&store, &hashes);
        let next = cfg!(feature = "codec-next");
        assert_eq!(lookup.matched(77) > 0, next);
        let wrote = table.record(&store, &hashes, 9, &mut lookup);
        let stored = store.get(&table.keys()[0]).unwrap().unwrap().0;
        if next {
            assert_eq!(wrote, 1);
            assert_eq!(find(&stored, 4), Some(9));
        } else {
            assert_eq!(wrote, 0);
            assert_eq!(stored, theirs, "another build's shard is not overwritten");
        }
        // This build's shard, both read.
        let ours = codec::as_version(&upsert(&[], &[(4, 77, T)], 8), Tag::PrefixShard.current());
        assert_eq!(find(&ours, 4), Some(77));
    }

    #[test]
    fn a_hash_names_the_endpoint_that_received_it_last() {
        let v = upsert(&[], &[(1, 10, T), (2, 20, T)], 64);
        let v = upsert(&v, &[(1, 11, [1, 2, 3])], 64);
        assert_eq!(find_record(&v, 1), Some((11, [1, 2, 3])));
        assert_eq!(records(&v).collect::<Vec<_>>(), vec![(2, 20, T), (1, 11, [1, 2, 3])]);
        // The same hash twice in one update: the last wins.
        let v = upsert(&v, &[(3, 30, T), (3, 31, T)], 64);
        assert_eq!(find_record(&v, 3), Some((31, T)));
        assert_eq!(v.len(), 2 + 3 * RECORD_BYTES);
    }

    #[test]
    fn step_tags_resolve_the_match_within_an_octave() {
        // A 100-block prompt recorded on endpoint 7; a reader sharing its first 90 blocks (a
        // system prompt, then its own question) matches 80 blocks (octave 64, steps 80, 96, 112:
        // 80 ≤ 90 < 96), not the octave start's 64.
        let store = MemStore::new();
        let t = SharedPrefix::new(8, 64);
        let writer: Vec<u64> = chain(0x9E37_79B9_7F4A_7C15, 100);
        let mut l = t.lookup(&store, &writer);
        assert!(t.record(&store, &writer, 7, &mut l) >= 1);
        let mut reader = writer[..90].to_vec();
        reader.extend(chain(0x1234_5678_9ABC_DEF1, 30));
        assert_eq!(t.lookup(&store, &reader).matched(7), 80);
        // The writer's own next turn finds all of its 100 blocks' last step (96).
        let mut next = writer.clone();
        next.extend(chain(0x0F0F_0F0F_0F0F_0F0F, 50));
        assert_eq!(t.lookup(&store, &next).matched(7), 96);
        // Another endpoint receives the same system prompt: the table now names it.
        let mut other = writer[..90].to_vec();
        other.extend(chain(0x5555_5555_5555_5555, 20));
        let mut l = t.lookup(&store, &other);
        t.record(&store, &other, 8, &mut l);
        assert_eq!(t.lookup(&store, &reader).matched(8), 80);
    }

    #[test]
    fn a_prompt_already_covered_is_not_written_again() {
        let store = MemStore::new();
        let t = SharedPrefix::new(8, 64);
        let p: Vec<u64> = chain(0x9E37_79B9_7F4A_7C15, 40);
        let mut l = t.lookup(&store, &p);
        assert!(t.record(&store, &p, 3, &mut l) >= 1);
        let mut l = t.lookup(&store, &p);
        assert_eq!(l.matched(3), 40);
        assert_eq!(t.record(&store, &p, 3, &mut l), 0);
        // A longer prompt on the same endpoint rewrites only the octave it extends (32 → 48).
        let mut longer = p.clone();
        longer.extend(chain(0x1111_1111_1111_1111, 10));
        let mut l = t.lookup(&store, &longer);
        assert_eq!(l.matched(3), 40);
        assert_eq!(t.record(&store, &longer, 3, &mut l), 1);
        assert_eq!(t.lookup(&store, &longer).matched(3), 48);
    }

    #[test]
    fn a_delta_replayed_elsewhere_carries_exactly_the_new_writes() {
        let t = [0u16; STEPS - 1];
        let before = upsert(&[], &[(1, 10, t), (2, 20, t), (3, 30, t)], 8);
        // Hash 2 moves to endpoint 21, hash 4 is new, hash 1 untouched.
        let after = upsert(&before, &[(2, 21, t), (4, 40, t)], 8);
        assert_eq!(delta(&before, &after), vec![(2, 21, t), (4, 40, t)]);
        assert!(delta(&after, &after).is_empty());
        // Tags count: the same endpoint with a longer reach is a write too.
        let tagged = upsert(&after, &[(1, 10, [7, 0, 0])], 8);
        assert_eq!(delta(&after, &tagged), vec![(1, 10, [7, 0, 0])]);
        // Replayed on another table: its own records stay, the peer's writes land on top.
        let other = upsert(&[], &[(2, 99, t), (5, 50, t)], 8);
        let merged = upsert(&other, &delta(&before, &after), 8);
        assert_eq!(find(&merged, 2), Some(21));
        assert_eq!(find(&merged, 4), Some(40));
        assert_eq!(find(&merged, 5), Some(50));
        assert_eq!(find(&merged, 1), None);
        // A garbled value decodes as empty, so everything in `after` is new.
        assert_eq!(delta(&[1, 2, 3], &after).len(), decode(&after).len());
        assert!(decode(&[1, 2, 3]).is_empty());
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
            assert!(store.get(&k).unwrap().unwrap().0.len() <= 2 + 16 * RECORD_BYTES);
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
                let other = upsert(&[], &[(999, 9, T)], 16);
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
