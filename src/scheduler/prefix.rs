//! Prefix-cache affinity: send a prompt where its leading text was sent before, so the model
//! server finds those tokens in its KV cache instead of recomputing them.
//!
//! **What is hashed.** The canonical prompt text (`body::ParsedRequest::prompt`: tools, then the
//! messages in order), cut into fixed blocks of `block_chars` bytes (default 256 ≈ 64 tokens),
//! at most `max_blocks` (default 256) blocks, so the first 64 KiB are compared. GIE uses 64 × 256
//! = 16 KiB, which truncates long prompts: a Mooncake-size prompt (~12k tokens ≈ 48 KiB) would be
//! compared on its first third only. Bigger blocks cost little precision (a 64-token
//! block spans four 16-token vLLM KV blocks, so at most ~63 reusable tokens are not credited at
//! the boundary, negligible beside a multi-KiB prefix) and make lookups and index memory 4×
//! cheaper per KiB. A trailing partial
//! block is not hashed (as in GIE): it is still being written by the conversation. "Characters"
//! are UTF-8 bytes, like GIE's Go string slicing: block boundaries may split a character, which
//! does not matter for hashing and is identical in every worker.
//!
//! **Chained, stable hashes.** `h_0 = xxh3_64(model ‖ 0 ‖ cache_salt)`,
//! `h_i = xxh3_64(le(h_{i−1}) ‖ le(xxh3_64(block_i)))`. Block `i`'s hash therefore names the
//! whole prefix up to and including block `i`; two requests share `h_i` exactly when they share
//! the first `i` blocks, the model and the salt (vLLM never shares cache across salts). xxh3 is
//! unseeded and fixed, so every worker VM and every gateway replica computes the same hashes.
//! (The two-step form avoids `xxh3_64_with_seed` on >240-byte inputs, which derives a fresh
//! secret per call.)
//!
//! **What is remembered, per worker.** Each endpoint has a bounded index of block hashes recently
//! sent to it ([`EndpointIndex`]); the picked endpoint records all of the request's blocks. The
//! index is two generations of hash sets (insert into `current`; when it reaches cap/2 it becomes
//! `previous` and the old `previous` is dropped), an O(1) approximation of LRU that holds between
//! cap/2 and cap entries and refreshes a block each time it is sent again. Capacity per endpoint:
//! `num_gpu_blocks × block_size × chars_per_token / block_chars` when the endpoint reports
//! `cache_config_info` (the prefix text its KV cache can hold; vLLM evicts LRU as well), else
//! `index_blocks`; and never more than `index_blocks_total / endpoints` so a worker's memory is
//! bounded whatever the pool size. Indexes of endpoints that left the snapshot are dropped.
//!
//! **Across workers.** See `prefix_shared`: a bounded table in shared data maps checkpoint block
//! hashes to the endpoint that last received them. The matched length of an endpoint is the
//! larger of the local index's exact count and the shared table's checkpoint bound. With other
//! live workers, each pick's blocks also reach their local indexes (`crate::state::feed`,
//! `Scheduler::observe`), so every worker's index holds every pod a prefix was sent to, not
//! only the ones it sent it to itself.
//!
//! **Score.** `score(e) = matched(e) / n`, with `n` the request's hashed blocks and
//! `matched(e)` the number of consecutive leading blocks `e` holds. A prompt shorter than one
//! block has `n = 0`: everyone scores 0 (no influence). No history for an endpoint: 0, which is
//! the truth, not a missing signal. An endpoint the hot-spot guard finds overloaded scores 0.
//!
//! Default weight 3.

use std::hash::{BuildHasherDefault, Hasher};

use hashbrown::HashSet;
use xxhash_rust::xxh3::xxh3_64;

use crate::scheduler::config::PrefixConfig;
use crate::state::by_address::{address_hash, ByAddress};
use crate::state::metrics::EndpointMetrics;

/// Block hashes are xxh3 outputs already: hash them by identity.
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

pub type HashSetU64 = HashSet<u64, BuildHasherDefault<IdHasher>>;

/// The chain seed for a model and salt.
pub fn seed(model: &str, cache_salt: Option<&str>) -> u64 {
    let mut buf = Vec::with_capacity(model.len() + 1 + cache_salt.map_or(0, str::len));
    buf.extend_from_slice(model.as_bytes());
    if let Some(s) = cache_salt {
        buf.push(0);
        buf.extend_from_slice(s.as_bytes());
    }
    xxh3_64(&buf)
}

/// Chained hashes of the prompt's full blocks (at most `max_blocks`), into `out` (cleared).
pub fn block_hashes(prompt: &str, seed: u64, block_chars: usize, max_blocks: usize, out: &mut Vec<u64>) {
    out.clear();
    if block_chars == 0 {
        return;
    }
    let mut h = seed;
    let mut pair = [0u8; 16];
    for block in prompt.as_bytes().chunks_exact(block_chars).take(max_blocks) {
        let (a, b) = pair.split_at_mut(8);
        a.copy_from_slice(&h.to_le_bytes());
        b.copy_from_slice(&xxh3_64(block).to_le_bytes());
        h = xxh3_64(&pair);
        out.push(h);
    }
}

/// One endpoint's recently sent blocks (two-generation approximate LRU, see module docs).
#[derive(Debug, Clone, Default)]
pub struct EndpointIndex {
    current: HashSetU64,
    previous: HashSetU64,
}

impl EndpointIndex {
    pub fn contains(&self, h: u64) -> bool {
        self.current.contains(&h) || self.previous.contains(&h)
    }

    /// Records `h`, keeping at most `cap` entries in all.
    pub fn insert(&mut self, h: u64, cap: usize) {
        let half = (cap / 2).max(1);
        if self.current.len() >= half {
            // Rotate by swapping and clearing: the old generation's allocation is reused, so a
            // busy endpoint's index stops allocating once it has rotated once.
            std::mem::swap(&mut self.previous, &mut self.current);
            self.current.clear();
        }
        self.current.insert(h);
        // A capacity that shrank (fewer reported GPU blocks, more endpoints) takes effect at
        // once rather than after two rotations.
        if self.previous.len() > cap.saturating_sub(self.current.len()) {
            self.previous.clear();
        }
    }

    pub fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Consecutive leading blocks of `hashes` this endpoint holds.
    pub fn matched(&self, hashes: &[u64]) -> usize {
        hashes.iter().take_while(|&&h| self.contains(h)).count()
    }
}

/// Index capacity (in blocks) for an endpoint, see module docs.
pub fn capacity(cfg: &PrefixConfig, metrics: Option<&EndpointMetrics>, endpoints: usize) -> usize {
    let from_cache = metrics.and_then(|m| {
        let tokens = m.num_gpu_blocks?.checked_mul(u64::from(m.block_size?))?;
        let chars = tokens.checked_mul(cfg.chars_per_token as u64)?;
        usize::try_from(chars / cfg.block_chars.max(1) as u64).ok()
    });
    let share = (cfg.index_blocks_total / endpoints.max(1)).max(1);
    from_cache.filter(|&c| c > 0).unwrap_or(cfg.index_blocks).min(share)
}

/// Every endpoint's local index in this worker.
#[derive(Debug, Clone)]
pub struct LocalIndex {
    by_endpoint: ByAddress<EndpointIndex>,
    snapshot_version: Option<u64>,
    /// Bit `address_hash >> 52` of every endpoint in `by_endpoint`: a candidate whose bit is
    /// clear has no index here, known without probing the table.
    present: Box<[u64; 64]>,
}

impl Default for LocalIndex {
    fn default() -> Self {
        Self { by_endpoint: ByAddress::default(), snapshot_version: None, present: Box::new([0; 64]) }
    }
}

/// The word and bit of `hash` in [`LocalIndex::present`].
fn present_bit(hash: u64) -> (usize, u64) {
    let b = (hash >> 52) as usize;
    (b / 64, 1u64 << (b % 64))
}

impl LocalIndex {
    /// Drops endpoints that are not in the snapshot (done once per snapshot version).
    pub fn sync(&mut self, version: u64, addresses: &mut dyn Iterator<Item = &str>) {
        if self.snapshot_version == Some(version) {
            return;
        }
        self.snapshot_version = Some(version);
        let keep: HashSet<&str> = addresses.collect();
        self.by_endpoint.retain(|a| keep.contains(a));
        self.present.fill(0);
        for a in self.by_endpoint.keys() {
            let (w, bit) = present_bit(address_hash(a));
            if let Some(word) = self.present.get_mut(w) {
                *word |= bit;
            }
        }
    }

    pub fn matched(&self, address: &str, hashes: &[u64]) -> usize {
        self.matched_hashed(address_hash(address), address, hashes)
    }

    /// [`LocalIndex::matched`] for an address whose [`address_hash`] is `hash`.
    pub fn matched_hashed(&self, hash: u64, address: &str, hashes: &[u64]) -> usize {
        let (w, bit) = present_bit(hash);
        if self.present.get(w).is_none_or(|word| word & bit == 0) {
            return 0;
        }
        self.by_endpoint.get(hash, address).map_or(0, |ix| ix.matched(hashes))
    }

    pub fn record(&mut self, address: &str, hashes: &[u64], cap: usize) {
        if hashes.is_empty() {
            return;
        }
        let hash = address_hash(address);
        let (w, bit) = present_bit(hash);
        if let Some(word) = self.present.get_mut(w) {
            *word |= bit;
        }
        self.by_endpoint.update(hash, address, |ix| {
            for &h in hashes {
                ix.insert(h, cap);
            }
        });
    }

    pub fn endpoints(&self) -> usize {
        self.by_endpoint.len()
    }

    /// Blocks held across all endpoints.
    pub fn total_blocks(&self) -> usize {
        self.by_endpoint.values().map(EndpointIndex::len).sum()
    }
}

/// `matched / n`, 0 when `n == 0`.
pub fn score(matched: usize, n: usize) -> f64 {
    if n == 0 {
        0.0
    } else {
        (matched.min(n) as f64 / n as f64).clamp(0.0, 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hashes(prompt: &str, model: &str, salt: Option<&str>, bc: usize, max: usize) -> Vec<u64> {
        let mut v = Vec::new();
        block_hashes(prompt, seed(model, salt), bc, max, &mut v);
        v
    }

    #[test]
    fn only_full_blocks_up_to_max() {
        // 10 bytes in blocks of 4: two full blocks ("abcd", "efgh"), "ij" is not hashed.
        assert_eq!(hashes("abcdefghij", "m", None, 4, 256).len(), 2);
        assert_eq!(hashes("abcdefghij", "m", None, 4, 1).len(), 1);
        assert_eq!(hashes("abc", "m", None, 4, 256).len(), 0);
        assert_eq!(hashes("abcd", "m", None, 0, 256).len(), 0);
    }

    #[test]
    fn chained_shared_prefix_shares_hashes_exactly() {
        let a = hashes("AAAABBBBCCCC", "m", None, 4, 256);
        let b = hashes("AAAABBBBDDDDEEEE", "m", None, 4, 256);
        // Same first two blocks → same first two hashes; then they differ.
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        // Same block text at a different position has a different hash (chaining).
        let c = hashes("XXXXBBBB", "m", None, 4, 256);
        assert_ne!(c[1], a[1]);
    }

    #[test]
    fn model_and_salt_separate_hashes() {
        let base = hashes("AAAABBBB", "m", None, 4, 256);
        assert_ne!(base, hashes("AAAABBBB", "n", None, 4, 256));
        assert_ne!(base, hashes("AAAABBBB", "m", Some("tenant-a"), 4, 256));
        assert_ne!(hashes("AAAABBBB", "m", Some("a"), 4, 256), hashes("AAAABBBB", "m", Some("b"), 4, 256));
        // "m" + salt "x" must not equal model "m\0x" without salt... it does by construction,
        // but model names never contain NUL (JSON text from the body), so the separator is safe.
        assert_eq!(seed("m", Some("x")), seed("m\0x", None));
    }

    const PINNED: u64 = 7_753_766_308_136_011_714;

    #[test]
    fn hashes_are_stable_across_builds() {
        // Pinned value: workers, replicas and releases must agree. If this changes, every
        // gateway's history is invalidated at upgrade — change it only on purpose.
        let h = hashes("0123456789abcdef", "llama", None, 16, 256);
        assert_eq!(h, vec![PINNED]);
        assert_eq!(seed("llama", None), xxh3_64(b"llama"));
        let mut pair = [0u8; 16];
        pair[..8].copy_from_slice(&xxh3_64(b"llama").to_le_bytes());
        pair[8..].copy_from_slice(&xxh3_64(b"0123456789abcdef").to_le_bytes());
        assert_eq!(h[0], xxh3_64(&pair));
    }

    #[test]
    fn index_counts_consecutive_leading_blocks() {
        let mut ix = EndpointIndex::default();
        for h in [1, 2, 4] {
            ix.insert(h, 100);
        }
        // 1, 2 held; 3 missing stops the count even though 4 is held.
        assert_eq!(ix.matched(&[1, 2, 3, 4]), 2);
        assert_eq!(ix.matched(&[5, 1]), 0);
        assert_eq!(ix.matched(&[]), 0);
    }

    #[test]
    fn index_is_bounded_and_keeps_recent() {
        let mut ix = EndpointIndex::default();
        for h in 0..1000u64 {
            ix.insert(h, 10);
            assert!(ix.len() <= 10, "len {} after {h}", ix.len());
        }
        // The most recent cap/2 = 5 are always there.
        assert!((995..1000).all(|h| ix.contains(h)));
        assert!(!ix.contains(0));
        // Re-sending an old block refreshes it.
        ix.insert(500, 10);
        for h in 2000..2004 {
            ix.insert(h, 10);
        }
        assert!(ix.contains(500));
        // Shrinking the cap takes effect at once.
        ix.insert(3000, 2);
        assert!(ix.len() <= 2);
    }

    #[test]
    fn capacity_from_cache_info_or_config_and_bounded_by_share() {
        let cfg = PrefixConfig::default(); // block_chars 256, chars/token 4, index 8192, total 262144
        let m = EndpointMetrics { num_gpu_blocks: Some(30_000), block_size: Some(16), ..Default::default() };
        // 30000 × 16 tokens × 4 chars / 256 = 7500 blocks.
        assert_eq!(capacity(&cfg, Some(&m), 8), 7500);
        assert_eq!(capacity(&cfg, None, 8), 8192);
        // 1024 endpoints: share 262144 / 1024 = 256 blocks each.
        assert_eq!(capacity(&cfg, Some(&m), 1024), 256);
        // Half the info is the same as none.
        let half = EndpointMetrics { num_gpu_blocks: Some(30_000), ..Default::default() };
        assert_eq!(capacity(&cfg, Some(&half), 1), 8192);
    }

    #[test]
    fn local_index_sync_drops_departed_endpoints() {
        let mut l = LocalIndex::default();
        l.record("a:1", &[1, 2], 10);
        l.record("b:1", &[1], 10);
        l.sync(1, &mut ["a:1"].into_iter());
        assert_eq!((l.endpoints(), l.matched("a:1", &[1, 2]), l.matched("b:1", &[1])), (1, 2, 0));
        // Same version: no work, nothing dropped.
        l.record("b:1", &[1], 10);
        l.sync(1, &mut std::iter::empty());
        assert_eq!(l.endpoints(), 2);
        assert_eq!(l.total_blocks(), 3);
    }

    #[test]
    fn score_is_fraction() {
        assert_eq!(score(3, 4), 0.75);
        assert_eq!(score(0, 0), 0.0);
        assert_eq!(score(9, 4), 1.0);
    }
}
