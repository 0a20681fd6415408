//! Per-run measurements and their summary.
//!
//! Imports run one way: `crate::replay` uses this module, never the reverse (settings come as [`RunLabels`]).
//!
//! - TTFT and end-to-end latency are measured from the request's arrival at the gateway to the
//!   server's first / last token event (virtual time; no network time is modelled).
//! - Output tokens per second: output tokens of finished requests ÷ (last finish − first arrival).
//! - Prefix-cache hit rate: Σ `cached_tokens` (the prefix hit at the request's first admission,
//!   measured inside the server model) ÷ Σ prompt tokens, over finished requests. The vLLM-style
//!   counter ratio (`prefix_cache_hits ÷ prefix_cache_queries`, which also counts the re-admission
//!   of preempted requests) is kept beside it.
//! - Percentiles are nearest-rank: p-th percentile of n sorted values is the value at rank
//!   ceil(p/100 × n).

use std::collections::BTreeMap;

use serde::Serialize;

use model_server_sim::MetricsSnapshot;

use crate::strategy::Policy;
use crate::trace::{Tier, Trace};

/// Nearest-rank percentile of sorted values (0 for none).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct TierStat {
    pub tier: String,
    pub finished: usize,
    pub rejected: usize,
    pub ttft_p90_s: f64,
    /// Every finished request's TTFT, sorted (s): what SLO attainment is counted from
    /// (`crate::slo`). Not written to results.json.
    #[serde(skip)]
    pub ttft_s: Vec<f64>,
}

/// The distribution of predicted ÷ actual TTFT over a run's requests (`Pick::predicted_ms` of
/// the primary against the simulated TTFT from the moment it was routed), after a warm-up: the
/// first [`PREDICTION_WARM_UP`] of the trace's requests are left out (the learnt rates start
/// from nothing). Only for strategies whose pick reports a prediction.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct PredictionStat {
    /// Requests counted (finished, routed with a prediction, after the warm-up).
    pub n: usize,
    pub p10: f64,
    pub median: f64,
    pub p90: f64,
}

/// Share of a trace's requests (by arrival order) left out of [`PredictionStat`].
pub const PREDICTION_WARM_UP: f64 = 0.1;

/// [`PredictionStat`] of `(predicted_ms, actual_ms)` pairs of requests in arrival order, the
/// first `warm_up` share skipped; pairs with an actual of 0 or a missing value are left out.
pub fn prediction_stat(pairs: &[Option<(f64, f64)>], warm_up: f64) -> Option<PredictionStat> {
    let skip = (pairs.len() as f64 * warm_up).ceil() as usize;
    let mut r: Vec<f64> = pairs
        .iter()
        .skip(skip)
        .flatten()
        .filter(|(p, a)| p.is_finite() && a.is_finite() && *a > 0.0)
        .map(|(p, a)| p / a)
        .collect();
    if r.is_empty() {
        return None;
    }
    r.sort_by(f64::total_cmp);
    Some(PredictionStat {
        n: r.len(),
        p10: percentile(&r, 10.0),
        median: percentile(&r, 50.0),
        p90: percentile(&r, 90.0),
    })
}

/// One (trace, strategy, load, topology) run.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RunResult {
    pub trace: String,
    pub strategy: String,
    pub load: f64,
    pub seed: u64,
    pub servers: usize,
    pub replicas: usize,
    pub workers: usize,
    pub poll_ms: u64,
    pub requests: usize,
    pub finished: usize,
    pub rejected: usize,
    /// Requests still running when the replay ended (a bug if not 0: the replay runs every
    /// server until idle).
    pub unfinished: usize,
    pub rejections: BTreeMap<String, usize>,
    pub ttft_mean_s: f64,
    pub ttft_p50_s: f64,
    pub ttft_p90_s: f64,
    pub ttft_p99_s: f64,
    /// TTFT p90 over every request, a rejected one counting as infinitely late (so rejecting
    /// cannot make a strategy look faster); `f64::INFINITY` when more than 10 % were rejected
    /// (`null` in results.json, which has no infinity).
    pub ttft_p90_strict_s: f64,
    pub e2e_p90_s: f64,
    pub output_tokens_per_s: f64,
    /// Completed requests per second over the replay's span (first arrival to last finish).
    pub goodput_rps: f64,
    pub hit_rate: f64,
    pub hit_rate_vllm_counters: f64,
    pub tiers: Vec<TierStat>,
    /// Predicted ÷ actual TTFT (`PredictionStat`), for strategies that predict.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prediction: Option<PredictionStat>,
    /// Per request (trace order): its TTFT in s when it finished (`crate::slo`'s attainment).
    /// Not written to results.json.
    #[serde(skip)]
    pub ttft_by_request: Vec<Option<f64>>,
    /// Per request: it was rejected. Not written to results.json.
    #[serde(skip)]
    pub rejected_by_request: Vec<bool>,
    pub preemptions: u64,
    /// Requests routed to each server.
    pub per_server: Vec<u64>,
    pub scrape_errors: usize,
    pub wall_s: f64,
}

/// What a run's result records of its settings (the replay's `RunConfig::labels`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RunLabels {
    /// Arrival-rate multiplier.
    pub load: f64,
    pub seed: u64,
    pub servers: usize,
    pub replicas: usize,
    pub workers: usize,
    pub poll_ms: u64,
}

/// Collects a run's measurements as it goes.
pub struct Outcome {
    trace: String,
    strategy: String,
    load: f64,
    seed: u64,
    servers: usize,
    replicas: usize,
    workers: usize,
    poll_ms: u64,
    prompt: Vec<u32>,
    tier: Vec<Tier>,
    ttft: Vec<Option<f64>>,
    e2e: Vec<Option<f64>>,
    cached: u64,
    prompt_finished: u64,
    output_tokens: u64,
    pub first_arrival: f64,
    last_finish: f64,
    rejected: usize,
    rejected_idx: Vec<bool>,
    rejections: BTreeMap<String, usize>,
    /// Per request: the primary's predicted TTFT (ms) and the virtual time it was routed at.
    predicted: Vec<Option<(f64, f64)>>,
    /// Per request: its arrival time (virtual ms), set when it finishes.
    arrival: Vec<f64>,
    per_server: Vec<u64>,
    counter_hits: u64,
    counter_queries: u64,
    pub preemptions: u64,
    pub scrape_errors: Vec<String>,
    pub wall_s: f64,
}

impl Outcome {
    pub fn new(trace: &Trace, policy: Policy, run: RunLabels) -> Self {
        let n = trace.requests.len();
        let RunLabels { load, seed, servers, replicas, workers, poll_ms } = run;
        Outcome {
            trace: trace.name.clone(),
            strategy: policy.name().to_string(),
            load,
            seed,
            servers,
            replicas,
            workers,
            poll_ms,
            prompt: trace.requests.iter().map(|r| r.prompt_tokens).collect(),
            tier: trace.requests.iter().map(|r| r.tier).collect(),
            ttft: vec![None; n],
            e2e: vec![None; n],
            cached: 0,
            prompt_finished: 0,
            output_tokens: 0,
            first_arrival: trace.requests.first().map_or(0.0, |r| r.arrival_ms / load),
            last_finish: 0.0,
            rejected: 0,
            rejected_idx: vec![false; n],
            rejections: BTreeMap::new(),
            predicted: vec![None; n],
            arrival: vec![0.0; n],
            per_server: vec![0; servers],
            counter_hits: 0,
            counter_queries: 0,
            preemptions: 0,
            scrape_errors: Vec::new(),
            wall_s: 0.0,
        }
    }

    pub fn routed(&mut self, _idx: usize, server: usize) {
        if let Some(c) = self.per_server.get_mut(server) {
            *c += 1;
        }
    }

    /// Request `idx` was routed at virtual time `t_ms` with the primary's predicted TTFT
    /// `predicted_ms` (`Pick::predicted_ms`).
    pub fn predicted(&mut self, idx: usize, predicted_ms: f64, t_ms: f64) {
        if let Some(x) = self.predicted.get_mut(idx) {
            *x = Some((predicted_ms, t_ms));
        }
    }

    /// Request `idx` arrived at virtual time `t_ms` (for the prediction's actual TTFT).
    pub fn arrived(&mut self, idx: usize, t_ms: f64) {
        if let Some(x) = self.arrival.get_mut(idx) {
            *x = t_ms;
        }
    }

    pub fn reject(&mut self, idx: usize, reason: String) {
        self.rejected += 1;
        if let Some(r) = self.rejected_idx.get_mut(idx) {
            *r = true;
        }
        *self.rejections.entry(reason).or_default() += 1;
    }

    pub fn finished(&mut self, idx: usize, ttft_ms: f64, e2e_ms: f64, t_end: f64, out: u32, cached: u32) {
        if let Some(x) = self.ttft.get_mut(idx) {
            *x = Some(ttft_ms / 1000.0);
        }
        if let Some(x) = self.e2e.get_mut(idx) {
            *x = Some(e2e_ms / 1000.0);
        }
        self.cached += u64::from(cached);
        self.prompt_finished += u64::from(self.prompt.get(idx).copied().unwrap_or(0));
        self.output_tokens += u64::from(out);
        self.last_finish = self.last_finish.max(t_end);
    }

    pub fn server_end(&mut self, _server: usize, m: &MetricsSnapshot) {
        self.counter_hits += m.prefix_cache_hits_tokens;
        self.counter_queries += m.prefix_cache_queries_tokens;
    }

    pub fn finish(self, unfinished: usize) -> RunResult {
        let mut ttft: Vec<f64> = self.ttft.iter().flatten().copied().collect();
        ttft.sort_by(f64::total_cmp);
        let mut e2e: Vec<f64> = self.e2e.iter().flatten().copied().collect();
        e2e.sort_by(f64::total_cmp);
        let finished = ttft.len();
        let mean = if finished == 0 { 0.0 } else { ttft.iter().sum::<f64>() / finished as f64 };
        let span_s = (self.last_finish - self.first_arrival) / 1000.0;
        // Actual TTFT from the moment the request was routed (a held request's wait in flow
        // control is not the pod's doing): first token = arrival + TTFT.
        let pairs: Vec<Option<(f64, f64)>> = self
            .predicted
            .iter()
            .zip(&self.ttft)
            .zip(&self.arrival)
            .map(|((p, t), a)| match (p, t) {
                (Some((ms, routed)), Some(ttft_s)) => Some((*ms, a + ttft_s * 1000.0 - routed)),
                _ => None,
            })
            .collect();
        let prediction = prediction_stat(&pairs, PREDICTION_WARM_UP);
        let mut tiers = Vec::new();
        if self.tier.iter().any(|t| *t != Tier::Standard) {
            for tier in Tier::ALL {
                let mut v: Vec<f64> = self
                    .ttft
                    .iter()
                    .zip(&self.tier)
                    .filter(|(_, t)| **t == tier)
                    .filter_map(|(x, _)| *x)
                    .collect();
                v.sort_by(f64::total_cmp);
                let rejected =
                    self.rejected_idx.iter().zip(&self.tier).filter(|(r, t)| **r && **t == tier).count();
                tiers.push(TierStat {
                    tier: tier.as_str().into(),
                    finished: v.len(),
                    rejected,
                    ttft_p90_s: percentile(&v, 90.0),
                    ttft_s: v,
                });
            }
        }
        RunResult {
            trace: self.trace,
            strategy: self.strategy,
            load: self.load,
            seed: self.seed,
            servers: self.servers,
            replicas: self.replicas,
            workers: self.workers,
            poll_ms: self.poll_ms,
            requests: self.prompt.len(),
            finished,
            rejected: self.rejected,
            unfinished,
            rejections: self.rejections,
            ttft_mean_s: mean,
            ttft_p50_s: percentile(&ttft, 50.0),
            ttft_p90_s: percentile(&ttft, 90.0),
            ttft_p99_s: percentile(&ttft, 99.0),
            ttft_p90_strict_s: {
                let mut all = ttft.clone();
                all.resize(self.prompt.len(), f64::INFINITY);
                percentile(&all, 90.0)
            },
            e2e_p90_s: percentile(&e2e, 90.0),
            output_tokens_per_s: if span_s > 0.0 { self.output_tokens as f64 / span_s } else { 0.0 },
            goodput_rps: if span_s > 0.0 { finished as f64 / span_s } else { 0.0 },
            hit_rate: if self.prompt_finished == 0 {
                0.0
            } else {
                self.cached as f64 / self.prompt_finished as f64
            },
            hit_rate_vllm_counters: if self.counter_queries == 0 {
                0.0
            } else {
                self.counter_hits as f64 / self.counter_queries as f64
            },
            tiers,
            prediction,
            ttft_by_request: self.ttft,
            rejected_by_request: self.rejected_idx,
            preemptions: self.preemptions,
            per_server: self.per_server,
            scrape_errors: self.scrape_errors.len(),
            wall_s: self.wall_s,
        }
    }
}

/// The prefix-cache hit rate of one server with an unlimited cache that has seen every earlier
/// request (in arrival order): for each request, its leading hash units already seen, capped as
/// the server model caps a hit (whole units, at most prompt − 1 tokens), over all prompt tokens.
/// An upper bound for any routing over any number of servers.
pub fn hit_rate_bound(trace: &Trace) -> f64 {
    let tph = trace.tokens_per_hash.max(1);
    let mut seen: hashbrown::HashSet<(u64, Option<u16>)> = hashbrown::HashSet::new();
    let (mut hits, mut total) = (0u64, 0u64);
    for (i, r) in trace.requests.iter().enumerate() {
        let msgs = crate::text::messages(trace, i, r);
        let hashes = crate::text::server_hashes(&msgs, tph);
        let full = (r.prompt_tokens / tph) as usize;
        let cap = ((r.prompt_tokens.max(1) - 1) / tph) as usize;
        let keys = &hashes[..hashes.len().min(full)];
        let m = keys.iter().take_while(|&&h| seen.contains(&(h, r.adapter))).count();
        hits += (m.min(cap) as u64) * u64::from(tph);
        total += u64::from(r.prompt_tokens);
        for &h in keys {
            seen.insert((h, r.adapter));
        }
    }
    if total == 0 {
        0.0
    } else {
        hits as f64 / total as f64
    }
}

/// Like [`hit_rate_bound`], but the one server's cache holds only `capacity_tokens` (least
/// recently used units evicted first): the hit rate the pool's *total* KV capacity allows if
/// routing made the servers act as one cache, ignoring that running requests pin their blocks.
/// Not a strict bound (a real LRU is not optimal), but the yardstick that capacity sets.
pub fn hit_rate_bound_lru(trace: &Trace, capacity_tokens: u64) -> f64 {
    let tph = trace.tokens_per_hash.max(1);
    let cap_units = (capacity_tokens / u64::from(tph)).max(1) as usize;
    let mut stamp_of: hashbrown::HashMap<(u64, Option<u16>), u64> = hashbrown::HashMap::new();
    let mut by_stamp: BTreeMap<u64, (u64, Option<u16>)> = BTreeMap::new();
    let mut clock = 0u64;
    let (mut hits, mut total) = (0u64, 0u64);
    for (i, r) in trace.requests.iter().enumerate() {
        let msgs = crate::text::messages(trace, i, r);
        let hashes = crate::text::server_hashes(&msgs, tph);
        let full = (r.prompt_tokens / tph) as usize;
        let cap = ((r.prompt_tokens.max(1) - 1) / tph) as usize;
        let keys = &hashes[..hashes.len().min(full)];
        let m = keys.iter().take_while(|&&h| stamp_of.contains_key(&(h, r.adapter))).count();
        hits += (m.min(cap) as u64) * u64::from(tph);
        total += u64::from(r.prompt_tokens);
        for &h in keys {
            clock += 1;
            if let Some(old) = stamp_of.insert((h, r.adapter), clock) {
                by_stamp.remove(&old);
            }
            by_stamp.insert(clock, (h, r.adapter));
        }
        while stamp_of.len() > cap_units {
            let Some((_, k)) = by_stamp.pop_first() else { break };
            stamp_of.remove(&k);
        }
    }
    if total == 0 {
        0.0
    } else {
        hits as f64 / total as f64
    }
}

/// Like [`hit_rate_bound_lru`], but the one cache evicts optimally (Belady: the unit whose next
/// use is furthest in the future, or never): the most any eviction policy could keep of the
/// trace's reuse in the pool's total capacity. Eviction is decided per hash unit, while a hit
/// needs every earlier unit of the prompt too, so this is Belady's algorithm on units rather than
/// a proven optimum of the prefix hit rate; it is what "capacity, not LRU" allows.
pub fn hit_rate_bound_opt(trace: &Trace, capacity_tokens: u64) -> f64 {
    type Key = (u64, Option<u16>);
    let tph = trace.tokens_per_hash.max(1);
    let cap_units = (capacity_tokens / u64::from(tph)).max(1) as usize;
    // Every request's keys, in order, then each access's next use (position in the access list).
    let mut reqs: Vec<(Vec<Key>, usize, u32)> = Vec::with_capacity(trace.requests.len());
    for (i, r) in trace.requests.iter().enumerate() {
        let msgs = crate::text::messages(trace, i, r);
        let hashes = crate::text::server_hashes(&msgs, tph);
        let full = (r.prompt_tokens / tph) as usize;
        let cap = ((r.prompt_tokens.max(1) - 1) / tph) as usize;
        let keys: Vec<Key> = hashes[..hashes.len().min(full)].iter().map(|&h| (h, r.adapter)).collect();
        reqs.push((keys, cap, r.prompt_tokens));
    }
    let total_accesses: usize = reqs.iter().map(|r| r.0.len()).sum();
    let mut next_use = vec![usize::MAX; total_accesses];
    let mut last_seen: hashbrown::HashMap<Key, usize> = hashbrown::HashMap::new();
    let mut pos = total_accesses;
    for (keys, _, _) in reqs.iter().rev() {
        for k in keys.iter().rev() {
            pos -= 1;
            if let Some(&n) = last_seen.get(k) {
                next_use[pos] = n;
            }
            last_seen.insert(*k, pos);
        }
    }
    drop(last_seen);
    // The cache: key → its next use; a max-heap of (next use, key) with lazy deletion.
    let mut cache: hashbrown::HashMap<Key, usize> = hashbrown::HashMap::new();
    let mut heap: std::collections::BinaryHeap<(usize, Key)> = std::collections::BinaryHeap::new();
    let (mut hits, mut total) = (0u64, 0u64);
    let mut pos = 0usize;
    for (keys, cap, prompt) in &reqs {
        let m = keys.iter().take_while(|k| cache.contains_key(*k)).count();
        hits += (m.min(*cap) as u64) * u64::from(tph);
        total += u64::from(*prompt);
        for k in keys {
            let nu = next_use[pos];
            pos += 1;
            cache.insert(*k, nu);
            heap.push((nu, *k));
        }
        while cache.len() > cap_units {
            let Some((nu, k)) = heap.pop() else { break };
            if cache.get(&k) == Some(&nu) {
                cache.remove(&k);
            }
        }
        if heap.len() > 4 * cache.len() + 1024 {
            heap = cache.iter().map(|(k, nu)| (*nu, *k)).collect();
        }
    }
    if total == 0 {
        0.0
    } else {
        hits as f64 / total as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{Content, Request};

    #[test]
    fn prediction_ratios_skip_the_warm_up_and_unusable_pairs() {
        // Ten requests: the first (10 %) is skipped however wrong; one has no prediction, one
        // an actual of 0. Ratios left: 0.5, 1, 1, 1, 2, 2, 4, 8.
        let pairs = vec![
            Some((1000.0, 1.0)),
            Some((50.0, 100.0)),
            Some((100.0, 100.0)),
            None,
            Some((100.0, 100.0)),
            Some((100.0, 100.0)),
            Some((200.0, 100.0)),
            Some((200.0, 0.0)),
            Some((200.0, 100.0)),
            Some((400.0, 100.0)),
        ];
        let mut p = pairs.clone();
        p.push(Some((800.0, 100.0)));
        let s = prediction_stat(&p, 0.1).unwrap();
        // 11 pairs: ceil(1.1) = 2 skipped, so 50/100 goes too: 1, 1, 1, 2, 2, 4, 8.
        assert_eq!((s.n, s.p10, s.median, s.p90), (7, 1.0, 2.0, 8.0));
        let s = prediction_stat(&pairs, 0.1).unwrap();
        assert_eq!((s.n, s.p10, s.median), (7, 0.5, 1.0));
        assert_eq!(prediction_stat(&[Some((1.0, 1.0)), None], 0.5), None);
    }

    #[test]
    fn nearest_rank() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        // p50 of 10: rank ceil(5) = 5 → 5; p90: rank 9 → 9; p99: rank ceil(9.9) = 10 → 10.
        assert_eq!((percentile(&v, 50.0), percentile(&v, 90.0), percentile(&v, 99.0)), (5.0, 9.0, 10.0));
        assert_eq!(percentile(&[], 90.0), 0.0);
        assert_eq!(percentile(&[3.0], 1.0), 3.0);
    }

    #[test]
    fn bound_counts_repeated_leading_units() {
        // Three requests of 1100 tokens (2 full 512-token units, cap (1099)/512 = 2):
        // ids [1,2,3], [1,2,4], [7,2,3]. Request 2 hits 2 units (1024 tokens), the others 0:
        // 1024 / 3300 = 0.3103.
        let reqs = [vec![1, 2, 3], vec![1, 2, 4], vec![7, 2, 3]]
            .into_iter()
            .map(|ids| Request {
                arrival_ms: 0.0,
                prompt_tokens: 1100,
                output_tokens: 1,
                content: Content::Blocks(ids),
                adapter: None,
                tier: Tier::Standard,
            })
            .collect();
        let t =
            Trace { name: "t".into(), requests: reqs, tokens_per_hash: 512, shared_shape: None, adapters: 0 };
        assert!((hit_rate_bound(&t) - 1024.0 / 3300.0).abs() < 1e-12);
        // An LRU of 4 units (2048 tokens) still holds request 1's 2 units for request 2.
        assert!((hit_rate_bound_lru(&t, 2048) - 1024.0 / 3300.0).abs() < 1e-12);
        // One unit: request 1's first unit is evicted by its second, so request 2 hits nothing.
        assert_eq!(hit_rate_bound_lru(&t, 512), 0.0);
        // Belady with one unit keeps unit 1 (used again next) and drops 2 and 3: request 2 hits
        // its first unit (512 tokens), where LRU hit nothing.
        assert!((hit_rate_bound_opt(&t, 512) - 512.0 / 3300.0).abs() < 1e-12);
        assert!((hit_rate_bound_opt(&t, 2048) - 1024.0 / 3300.0).abs() < 1e-12);
    }
}
