//! Per-endpoint TTFT rates, learned online from what the filter observes and shared by every
//! Envoy worker through shared data. Pure: the store and the time are passed in.
//!
//! # Model
//! The scheduler predicts a request's time to first token on endpoint `e` as
//! `ttft(e) = rate(e) × work(e)` where `work` is in prompt tokens: the prefill queued ahead of it
//! plus its own uncached prompt plus a fixed overhead (`crate::scheduler::predict`). One
//! observation is `(work predicted at the pick, measured ms from sending upstream to the first
//! response byte of a streamed response)`; the host skips non-streamed responses, whose first
//! byte comes after the whole generation, and split P/D requests, whose first byte comes after
//! another pod's prefill and the KV transfer (`Scheduler::first_byte_unobserved`). The rate is a ratio of exponentially decayed sums:
//! ```text
//! on observe(work, ms):  W ← (1 − α)·W + work ;  M ← (1 − α)·M + ms      (α = 1/128)
//! rate(e) = clamp(M / W, prior / 100, prior × 100)                       (ms per token)
//! ```
//! A ratio of sums weights long requests more than a mean of ratios would, so a few tiny prompts
//! (whose TTFT is mostly fixed overhead) do not swing it. Because the prediction and the learning
//! use the same `work`, the rate also absorbs a systematic error of the work estimate on that
//! endpoint (e.g. load from other gateways we cannot see): it is a per-endpoint calibration.
//!
//! # Prior (no observation yet)
//! A new record starts with one pseudo-observation of [`PRIOR_WORK`] tokens at the configured
//! prior (`scheduler.predicted.prior_ms_per_token`, default 0.03 ms per token: a Llama-3-8B class
//! model prefilling ~33k tokens/s on one H100, which is what vLLM reaches with chunked prefill).
//! It fades as `(1 − α)^n` after n observations. An endpoint with no record at all takes the
//! median rate of the endpoints that have one, else the prior, so a new pod in a learnt pool is
//! assumed typical, not idle-fast.
//!
//! # Storage: bounded keys, CAS
//! [`SHARDS`] keys `inference-picker/rate/NN` (shard = endpoint key mod [`SHARDS`]), each holding
//! a `crate::base::codec` record (tag `RateShard`) of at most [`ENTRIES_PER_SHARD`] records of 12
//! bytes (`endpoint key u32 ‖ W f32 ‖ M f32`, little endian), most recently updated last; the
//! oldest record is dropped when a shard is full. An
//! observation is one read and one CAS write of one shard, retried [`MAX_CAS_ATTEMPTS`] times
//! on a lost race (then dropped: a lost observation only slows learning). A garbled value reads
//! as empty. A shard of a version this build does not read (another build's, during a rolling
//! upgrade) reads as empty and is not written by this build. Reading for a pick goes through [`RateCache`], which re-reads the shards it needs at
//! most every [`REFRESH_MS`].

use hashbrown::HashMap;

use crate::base::codec::{self, Refusal, Tag, Writer};
use crate::base::ports::{SharedStore, StoreError, CREATE_CAS};

/// Prefix of the shard keys.
pub const KEY_PREFIX: &str = "inference-picker/rate/";
/// Number of shard keys.
pub const SHARDS: u32 = 16;
/// Most records in one shard.
pub const ENTRIES_PER_SHARD: usize = 32;
/// Bytes per record.
const RECORD: usize = 12;
/// Decay per observation.
pub const ALPHA: f64 = 1.0 / 128.0;
/// Work (tokens) of the prior's pseudo-observation.
pub const PRIOR_WORK: f64 = 4096.0;
/// CAS attempts of one observation.
pub const MAX_CAS_ATTEMPTS: usize = 4;
/// A worker re-reads the shared rates at most this often (ms).
pub const REFRESH_MS: u64 = 250;
/// Observations outside these bounds are ignored (a response that took minutes is a stalled
/// stream or a retry, not a prefill rate).
pub const MAX_OBSERVED_MS: u64 = 600_000;

/// The shard key of an endpoint key.
pub fn shard_key(endpoint_key: u32) -> String {
    format!("{KEY_PREFIX}{:02}", endpoint_key % SHARDS)
}

/// A shard value's records, or why there are none.
#[derive(Debug, Clone, PartialEq)]
enum Shard {
    Records(Vec<(u32, f64, f64)>),
    /// A shard of a version this build does not read (another build's): skipped, never
    /// rewritten by this build.
    Other,
}

/// Reads a shard value (`crate::base::codec`, tag `RateShard`: `u32 count · count × (u32
/// endpoint key · f32 W · f32 M)`). Empty, garbled or truncated: no records (the next write
/// replaces it); a record whose W or M is not plausible is left out.
fn read_shard(value: &[u8]) -> Shard {
    let mut r = match codec::open(value, Tag::RateShard) {
        Ok(r) => r,
        Err(Refusal::UnknownVersion(_)) => return Shard::Other,
        Err(Refusal::Malformed) => return Shard::Records(Vec::new()),
    };
    let read = |r: &mut codec::Reader<'_>| -> Option<Vec<(u32, f64, f64)>> {
        let n = r.count(RECORD, ENTRIES_PER_SHARD)?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let k = r.u32()?;
            let w = f64::from(r.f32()?);
            let m = f64::from(r.f32()?);
            if w.is_finite() && m.is_finite() && w > 0.0 && m >= 0.0 {
                out.push((k, w, m));
            }
        }
        Some(out)
    };
    match read(&mut r) {
        Some(v) if r.finish().is_some() => Shard::Records(v),
        _ => Shard::Records(Vec::new()),
    }
}

/// Decodes a shard value into `(endpoint key, W, M)` records; a garbled value, or one of a
/// version this build does not read, reads as empty.
pub fn decode(value: &[u8]) -> Vec<(u32, f64, f64)> {
    match read_shard(value) {
        Shard::Records(v) => v,
        Shard::Other => Vec::new(),
    }
}

fn encode(records: &[(u32, f64, f64)]) -> Vec<u8> {
    let mut w = Writer::new(Tag::RateShard, 4 + records.len() * RECORD);
    w.len(records.len());
    for &(k, wt, m) in records {
        // f32 is plenty for a decayed sum; the values are finite by construction.
        w.u32(k).f32(wt as f32).f32(m as f32);
    }
    w.finish()
}

/// One record's rate, clamped around the prior.
pub fn rate_of(w: f64, m: f64, prior: f64) -> f64 {
    if !(w > 0.0 && m.is_finite()) {
        return prior;
    }
    (m / w).clamp(prior / 100.0, prior * 100.0)
}

/// Applies one observation to a shard value; returns the new value.
pub fn apply(value: &[u8], endpoint_key: u32, work: f64, ms: f64, prior: f64) -> Vec<u8> {
    let mut recs = decode(value);
    let (w0, m0) = match recs.iter().position(|r| r.0 == endpoint_key) {
        Some(i) => {
            let r = recs.remove(i);
            (r.1, r.2)
        }
        None => (PRIOR_WORK, PRIOR_WORK * prior),
    };
    let w = (1.0 - ALPHA) * w0 + work;
    let m = (1.0 - ALPHA) * m0 + ms;
    recs.push((endpoint_key, w, m));
    while recs.len() > ENTRIES_PER_SHARD {
        recs.remove(0);
    }
    encode(&recs)
}

/// Records one observation: `work` tokens predicted at the pick, `ms` from sending upstream to
/// the first response byte. Ignores non-finite, non-positive or implausible inputs.
pub fn observe(
    store: &dyn SharedStore,
    endpoint_key: u32,
    work: f64,
    ms: u64,
    prior: f64,
) -> Result<(), StoreError> {
    if !(work.is_finite() && work >= 1.0) || ms > MAX_OBSERVED_MS || !(prior.is_finite() && prior > 0.0) {
        return Ok(());
    }
    let key = shard_key(endpoint_key);
    let mut last = Ok(());
    for _ in 0..MAX_CAS_ATTEMPTS {
        let (value, cas) = match store.get(&key)? {
            Some(v) => v,
            None => (Vec::new(), CREATE_CAS),
        };
        if read_shard(&value) == Shard::Other {
            // Another build's shard: its learning, not ours to overwrite.
            return Ok(());
        }
        let next = apply(&value, endpoint_key, work, ms as f64, prior);
        match store.set(&key, &next, cas) {
            Ok(()) => return Ok(()),
            Err(StoreError::CasMismatch) => last = Err(StoreError::CasMismatch),
            Err(e) => return Err(e),
        }
    }
    last
}

/// A worker's cached view of the shared rates.
#[derive(Debug, Clone, Default)]
pub struct RateCache {
    read_ms: Option<u64>,
    /// The shards of the last read (bit `s` for shard `s`).
    shards_read: u32,
    /// endpoint key → rate (ms per token) of the endpoints that have a record.
    known: HashMap<u32, f64>,
}

impl RateCache {
    /// The rate of each endpoint key (in order), re-reading the shards at most every
    /// [`REFRESH_MS`]. Endpoints without a record get the median of those with one, else
    /// `prior`. A store error keeps the previous view. A key whose shard the last read did not
    /// cover (another model's pods, a new pod) makes the read due at once.
    pub fn rates(&mut self, store: &dyn SharedStore, keys: &[u32], prior: f64, now_ms: u64) -> Vec<f64> {
        let needed = keys.iter().fold(0u32, |m, k| m | (1 << (k % SHARDS)));
        let due = self.read_ms.is_none_or(|t| now_ms.saturating_sub(t) >= REFRESH_MS || now_ms < t)
            || needed & !self.shards_read != 0;
        if due {
            let mut shards: Vec<u32> = keys.iter().map(|k| k % SHARDS).collect();
            shards.sort_unstable();
            shards.dedup();
            let mut known = HashMap::new();
            let mut ok = true;
            for s in shards {
                match store.get(&format!("{KEY_PREFIX}{s:02}")) {
                    Ok(Some((v, _))) => {
                        for (k, w, m) in decode(&v) {
                            known.insert(k, rate_of(w, m, prior));
                        }
                    }
                    Ok(None) => {}
                    Err(_) => ok = false,
                }
            }
            if ok {
                self.known = known;
                self.read_ms = Some(now_ms);
                self.shards_read = needed;
            }
        }
        if self.known.is_empty() {
            return vec![prior; keys.len()];
        }
        // One lookup per key.
        let found: Vec<Option<f64>> = keys.iter().map(|k| self.known.get(k).copied()).collect();
        let mut seen: Vec<f64> = found.iter().flatten().copied().collect();
        let median = if seen.is_empty() {
            prior
        } else {
            // The middle of the sorted rates (`total_cmp`), selected without sorting them all.
            let mid = seen.len() / 2;
            seen.select_nth_unstable_by(mid, f64::total_cmp);
            seen.get(mid).copied().unwrap_or(prior)
        };
        found.into_iter().map(|r| r.map_or(median, |r| dead_band(r, median))).collect()
    }
}

/// An endpoint's rate relative to the pool's median, with differences within [`NOISE_RATIO`]
/// read as noise: `median × g(r / median)`, `g(x) = 1` for `1/NOISE_RATIO ≤ x ≤ NOISE_RATIO`,
/// else `x / NOISE_RATIO` (or `x × NOISE_RATIO` below): continuous, and a pod truly 2× slower
/// still predicts 1.33× slower. TTFT / work of identical pods scatters by tens of percent (the
/// work estimate misses what other gateways sent, decode steps, chunk boundaries); ranking
/// identical pods by that noise sends traffic away from pods that were merely unlucky.
pub fn dead_band(rate: f64, median: f64) -> f64 {
    if !(median > 0.0 && rate > 0.0) {
        return median;
    }
    let x = rate / median;
    let g = if x > NOISE_RATIO {
        x / NOISE_RATIO
    } else if x < 1.0 / NOISE_RATIO {
        x * NOISE_RATIO
    } else {
        1.0
    };
    median * g
}

/// Rate differences within this factor of the pool's median are noise ([`dead_band`]).
pub const NOISE_RATIO: f64 = 1.5;

impl RateCache {
    /// Endpoints with a learnt record in the last read (tests, metrics).
    pub fn known(&self) -> usize {
        self.known.len()
    }

    /// The endpoint (by key) had a learnt record in the last read: its rate comes from its own
    /// first bytes, not from the pool's median or the prior.
    pub fn has(&self, endpoint_key: u32) -> bool {
        self.known.contains_key(&endpoint_key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::ports::MemStore;

    const PRIOR: f64 = 0.03;

    #[test]
    fn learns_the_observed_rate_and_forgets_the_prior() {
        let store = MemStore::new();
        for _ in 0..200 {
            observe(&store, 7, 10_000.0, 1_000, PRIOR).unwrap();
        }
        let (v, _) = store.get(&shard_key(7)).unwrap().unwrap();
        let recs = decode(&v);
        assert_eq!(recs.len(), 1);
        let r = rate_of(recs[0].1, recs[0].2, PRIOR);
        assert!((r - 0.1).abs() < 0.002, "rate {r}");
    }

    #[test]
    fn one_observation_moves_a_new_record_only_partly() {
        let v = apply(&[], 1, 4096.0, 4096.0 * 0.3, PRIOR);
        let r = decode(&v);
        let rate = rate_of(r[0].1, r[0].2, PRIOR);
        assert!(rate > PRIOR && rate < 0.3, "{rate}");
    }

    #[test]
    fn shards_are_bounded_and_keep_the_newest() {
        let mut v = Vec::new();
        for k in 0..(ENTRIES_PER_SHARD as u32 + 10) {
            v = apply(&v, k * SHARDS, 100.0, 10.0, PRIOR);
        }
        let recs = decode(&v);
        assert_eq!(recs.len(), ENTRIES_PER_SHARD);
        assert_eq!(recs.last().map(|r| r.0), Some((ENTRIES_PER_SHARD as u32 + 9) * SHARDS));
        assert!(recs.iter().all(|r| r.0 >= 10 * SHARDS));
    }

    #[test]
    fn garbled_and_implausible_inputs() {
        assert!(decode(&[1, 2, 3]).is_empty());
        let mut bad = encode(&[(1, 5.0, 1.0)]);
        bad[10..14].copy_from_slice(&f32::NAN.to_le_bytes());
        assert!(decode(&bad).is_empty());
        // Truncated or longer: refused whole.
        let good = encode(&[(1, 5.0, 1.0), (2, 5.0, 1.0)]);
        assert_eq!(decode(&good).len(), 2);
        for cut in 0..good.len() {
            assert!(decode(&good[..cut]).is_empty(), "cut at {cut}");
        }
        let mut longer = good.clone();
        longer.push(0);
        assert!(decode(&longer).is_empty());
        let store = MemStore::new();
        observe(&store, 1, f64::NAN, 10, PRIOR).unwrap();
        observe(&store, 1, 0.0, 10, PRIOR).unwrap();
        observe(&store, 1, 100.0, MAX_OBSERVED_MS + 1, PRIOR).unwrap();
        assert_eq!(store.get(&shard_key(1)).unwrap(), None);
        // A rate is clamped within 100× of the prior either way.
        assert_eq!(rate_of(1.0, 1e9, PRIOR), PRIOR * 100.0);
        assert_eq!(rate_of(1e9, 0.0, PRIOR), PRIOR / 100.0);
    }

    /// Mixed builds: a shard of the next release reads as empty here and is not overwritten.
    #[test]
    fn a_shard_of_another_release_is_skipped_and_left_alone() {
        let store = MemStore::new();
        let theirs = codec::as_next(&encode(&[(1, 5.0, 1.0)]), Tag::RateShard);
        store.set(&shard_key(1), &theirs, 0).unwrap();
        observe(&store, 1, 100.0, 10, PRIOR).unwrap();
        let stored = store.get(&shard_key(1)).unwrap().unwrap().0;
        if cfg!(feature = "codec-next") {
            assert_eq!(decode(&stored).len(), 1);
            assert_ne!(stored, theirs);
        } else {
            assert!(decode(&theirs).is_empty());
            assert_eq!(stored, theirs, "another build's shard is not overwritten");
        }
    }

    #[test]
    fn unknown_endpoints_take_the_median_of_the_known_and_the_cache_refreshes() {
        let store = MemStore::new();
        let mut cache = RateCache::default();
        // Nothing learnt: the prior for everyone.
        assert_eq!(cache.rates(&store, &[1, 2, 3], PRIOR, 1_000), vec![PRIOR; 3]);
        for _ in 0..300 {
            observe(&store, 1, 1000.0, 100, PRIOR).unwrap(); // 0.1
            observe(&store, 2, 1000.0, 50, PRIOR).unwrap(); // 0.05
        }
        // Within the refresh interval the old view stands.
        assert_eq!(cache.rates(&store, &[1, 2, 3], PRIOR, 1_100), vec![PRIOR; 3]);
        let r = cache.rates(&store, &[1, 2, 3], PRIOR, 1_000 + REFRESH_MS);
        assert!((r[0] - 0.1).abs() < 0.005, "{r:?}");
        assert_eq!(cache.known(), 2);
        // Median of [0.05, 0.1] picks the upper middle: an unknown pod is assumed typical. The
        // 2× slower... 0.05 is half the median: beyond the noise band, it predicts 0.75 × 0.1.
        assert_eq!(r[2], r[0]);
        assert!((r[1] - 0.075).abs() < 0.005, "{r:?}");
    }

    #[test]
    fn a_key_whose_shard_was_not_read_makes_the_read_due_at_once() {
        let store = MemStore::new();
        observe(&store, 1, 1000.0, 30, PRIOR).unwrap();
        observe(&store, 2, 1000.0, 30, PRIOR).unwrap();
        let mut cache = RateCache::default();
        cache.rates(&store, &[1], PRIOR, 1_000);
        assert!(cache.has(1) && !cache.has(2));
        // Key 2 (another shard) within the refresh interval: read now, not at the next refresh.
        cache.rates(&store, &[1, 2], PRIOR, 1_001);
        assert!(cache.has(1) && cache.has(2));
        assert!(!cache.has(3));
    }

    #[test]
    fn differences_within_the_noise_band_are_ignored() {
        assert_eq!(dead_band(0.12, 0.1), 0.1);
        assert_eq!(dead_band(0.08, 0.1), 0.1);
        assert!((dead_band(0.3, 0.1) - 0.2).abs() < 1e-12);
        assert!((dead_band(0.02, 0.1) - 0.03).abs() < 1e-12);
        assert_eq!(dead_band(f64::NAN, 0.1), 0.1);
    }

    #[test]
    fn workers_learn_together_through_the_store() {
        let store = MemStore::new();
        observe(&store, 5, 1000.0, 500, PRIOR).unwrap();
        let mut other_worker = RateCache::default();
        let r = other_worker.rates(&store, &[5], PRIOR, 0);
        assert!(r[0] > PRIOR, "{r:?}");
    }
}
