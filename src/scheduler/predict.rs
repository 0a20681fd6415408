//! Predicted time to first token: the default objective (`scheduler.objective: predicted_ttft`).
//!
//! # Formula
//! For each healthy candidate `e` and this request:
//! ```text
//! uncached(e) = prompt_tokens − cached_tokens(e)                 (≥ 0)
//! ahead(e)    = max(pending_tokens(e) + pending_n(e) × overhead_tokens,
//!                   waiting(e) × (per_request(e) + overhead_tokens))
//! work(e)     = ahead(e) + uncached(e) + overhead_tokens
//! ttft(e)     = rate(e) × work(e) × lora_factor(e)                (ms)
//! ```
//! - `prompt_tokens` = prompt characters ÷ `prefix.chars_per_token`; `cached_tokens(e)` = the
//!   prefix scorer's matched blocks × `prefix.block_chars` ÷ `chars_per_token` (local index and
//!   cross-worker table, as for the prefix score); 0 on an overloaded endpoint (guard).
//! - `pending_tokens(e)`, `pending_n(e)`: the uncached prompt tokens (and the count) of the
//!   requests every worker of this Envoy sent to `e` that have not produced their first response
//!   byte yet: each worker's [`Ledger`] (updated at every pick and first byte, exact for that
//!   worker, like Dynamo's prefill tokens), published with its in-flight record and summed by
//!   readers (`crate::state::inflight::InflightCounts::load_hashed`); this worker's own ledger when
//!   it shows more requests (its latest pick not yet read back). Missing (an older release's
//!   record): this worker's ledger alone.
//! - `waiting(e)`: the live queue estimate of `crate::state::load` (scraped queue + what this gateway
//!   sent since the scrape and has not seen finish): requests of every worker and, at the last
//!   scrape, of every gateway.
//! - `per_request(e)` = `pending_tokens(e) ÷ pending_n(e)` when some are pending there, else
//!   the worker's running mean of the uncached tokens it sends ([`Ledger::mean_tokens`]).
//! - `overhead_tokens` (256): the fixed cost of any request (a scheduler step, the network), so
//!   that a fully cached prompt on an idle endpoint does not predict 0. Every request ahead
//!   costs it too: with tiny prompts a queue of 50 would otherwise weigh less than one request's
//!   overhead, and fall within the rendezvous slack of an idle endpoint.
//! - `rate(e)`: ms per token learned online per endpoint (`crate::state::rates`, shared by the workers).
//! - `lora_factor(e)` = `1 / max(lora_score(e), 0.1)` for an adapter request (the LoRA scorer's
//!   1 running → ×1 · 0.8 free slot → ×1.25 · 0.6 waiting → ×1.67 · 0 every slot held by other
//!   adapters → ×10: the request cannot start until a slot frees), 1 for a base-model request.
//!
//! # Cost: predicted TTFT plus a miss penalty that grows with the pool's queues
//! ```text
//! extra(e) = uncached(e) − min over eligible candidates of uncached        (≥ 0)
//! busy     = mean over eligible candidates of waiting(e)
//! cost(e)  = ttft(e) + miss_weight × (1 + busy) × rate(e) × extra(e)       (ms)
//! ```
//! A request sent where its prefix is not cached also delays every request that queues behind
//! its extra prefill there, and evicts other prefixes: costs its own TTFT does not show. Near
//! saturation, ranking by TTFT alone sends a hot group's request away from its cached pod as
//! soon as that pod has a few requests queued, and the misses eat the capacity the pool needs
//! (`scheduler.predicted.miss_weight`, default 0.5; 0 ranks by `ttft(e)` alone). At low load
//! `busy` ≈ 0 and the penalty is half the extra prefill. `ttft(e)` is still what is reported
//! (`predicted_ms`, debug scores) and what the rates learn from; the penalty only ranks.
//!
//! # KV congestion
//! ```text
//! rank(e) = cost(e) / (1 − min(kv(e), kv_full_at))                          (kv_full_at 0.8)
//! ```
//! `kv(e)` is the pod's KV-cache usage (the share of its cache held by running requests;
//! cached-but-free prefixes count as free). The queue ahead does not show a filling cache until
//! the pod stops admitting: before that, the requests it admits share slower steps, and near
//! full, their decode growth preempts (recomputes) the newest ones and evicts cached prefixes.
//! KV is the resource that gates admission, so the expected delay grows like a queue's,
//! `1 / (1 − utilisation)`.
//!
//! **The cap applies only when cache hits are at stake.** When some eligible pod holds more of
//! the prompt than another, every pod at and past `kv_full_at` counts as full (the factor stops
//! at `1 / (1 − kv_full_at)` = 5): among full pods the cost decides, so past saturation the
//! factor does not trade cache hits for a few points of usage. When nothing distinguishes the
//! pods (no eligible pod holds more of the prompt than another: a unique prompt, or one whose
//! only shared part is a system prompt every pod holds), there is no hit to trade, and, with a
//! single gateway replica (`poller.replicas` 1), for a pod with nothing waiting (`waiting < 1`)
//! the factor runs to [`KV_FULL_AT_MAX`] (0.99): an
//! idle pod at 97 % ranks far behind one at 85 %. Long generations fill every pod's KV past
//! 80 % near saturation; with the cap, those pods looked equal and the choice among them went to
//! the rendezvous, not to the pod with room, and the full pods preempted (in the replay's
//! robustness grid, unique prompts with 1,200-token outputs: 135–177 preemptions per pod against
//! 18–134 for GIE's default with its LoRA scorer). A pod with a queue keeps the cap: its queue
//! already carries a full cache's delay, and lifting the cap there too outweighed the queue in
//! long-context cells at saturation (12 cells of the grid lost). Several replicas keep the cap
//! everywhere: they agree on a new prompt's pod through the rendezvous among pods that rank
//! alike, which an uncapped factor splits (in the replay, 4 replicas exchanging prefix tables
//! lost most of what the exchange gains in hit rate). 0 turns the factor off in
//! every case (`scheduler.predicted.kv_full_at`; [`kv_full_at`], [`kv_congestion`]).
//!
//! # Choice: lowest rank, replicas agree on ties (bounded-load rendezvous)
//! The candidates within `(1 + affinity_slack)` of the lowest `rank` are "as good"; among
//! them the primary is the rendezvous winner `max xxh3(key, seed = xxh3(address))`, where `key`
//! is the session id when one is sent, else the hash of the prompt's first
//! `min(n, rendezvous_blocks)` blocks. Every gateway replica and worker computes the same winner
//! without talking, so a new prefix (a conversation's first turn) goes to the same pod wherever
//! it lands, and its next turns find it there; the slack bounds how much load that affinity may
//! cost. An overloaded candidate (guard) is never the rendezvous winner. A prompt shorter than
//! one block and no session id: lowest rank, seeded random tie-break. Fallbacks: the next lowest
//! ranks.
//!
//! **Rendezvous credit.** When nothing distinguishes the pods for this prompt (no eligible one
//! holds more of its blocks than every other: none holds any, or all hold the same system
//! prompt) and the request names no adapter, the rendezvous winner is where another gateway
//! replica most likely sent this prefix if it saw it before:
//! ```text
//! uncached(winner) × (1 − rendezvous_credit × (1 − 1 / poller.replicas))   (credit 0.5)
//! ```
//! `1 − 1 / replicas` is the share of the traffic other replicas see; a gateway's own workers
//! share the cross-worker prefix table, so with one replica a prefix none of them placed was
//! placed by no one, and there is no credit. With a `peers` section there is none either: the
//! replicas exchange their placements, so a prefix another replica placed is known where it is
//! (up to `peers.interval_ms` late), and the guess only herds the others' new prefixes onto the
//! winner (in the replay at 4 × 4, Mooncake 1.48 s without it against 1.65 s with it). An adapter request gets none: where its adapter is
//! loaded is scraped alike by every replica, and the LoRA factor follows it. With the credit,
//! replicas that share nothing still send a conversation's turns, and a group's requests, to
//! one pod; without it each replica placed them by its own view of the queues, and a hot prefix
//! lived on several pods at once ([`rendezvous_credit_share`], [`nothing_distinguishes`]).
//!
//! # Missing signals
//! - No queue reported: `waiting(e)` = this gateway's in-flight count to `e` (never missing).
//! - No `inflight_at_scrape`: the scraped queue alone (as `crate::state::load`).
//! - No learnt rate: the median of the candidates' learnt rates, else the prior
//!   (`predicted.prior_ms_per_token`, see `crate::state::rates`).
//! - No LoRA info: the LoRA scorer's neutral score.
//! - No KV usage: the KV scorer's neutral fill (`super::kv`: the highest known usage, at least
//!   0.5), so a pod without the metric never looks emptier than one that reports it; none
//!   reported at all: the same factor everywhere, which changes no choice.
//! - Miss penalty: with no eligible candidate, or no prompt blocks, `extra` is 0 everywhere.

use hashbrown::HashMap;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::base::num;
use crate::base::ports::Rng;
use crate::state::by_address::{address_hash, ByAddress};

/// Fixed per-request cost, in prompt tokens.
pub const OVERHEAD_TOKENS: f64 = 256.0;
/// Ledger entries older than this (ms) are dropped: the host missed the first byte and the end.
pub const LEDGER_TTL_MS: u64 = 120_000;
/// Most requests the ledger tracks; beyond it, new picks are not tracked (logged by no one:
/// only a host that never reports ends could get here, and the TTL empties it).
pub const LEDGER_MAX: usize = 65_536;
/// Weight of a new request in the running mean of sent tokens.
const MEAN_ALPHA: f64 = 1.0 / 64.0;

#[derive(Debug, Clone)]
struct Entry {
    address: String,
    /// [`address_hash`] of `address`.
    hash: u64,
    tokens: f64,
    work: f64,
    sent_ms: u64,
    /// No first byte yet.
    prefilling: bool,
    /// The TTFT predicted at the pick, ms (0: none noted).
    predicted_ms: f64,
}

/// Per endpoint: (prefill tokens pending, requests pending, tokens of the requests still active).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Sums {
    pending: f64,
    pending_n: u32,
    active: f64,
    active_n: u32,
}

/// One observation for the rate learner (`crate::state::rates::observe`).
#[derive(Debug, Clone, PartialEq)]
pub struct Observation {
    pub address: String,
    /// Work predicted at the pick (tokens).
    pub work: f64,
    /// Send → first byte (ms).
    pub ms: u64,
    /// The TTFT predicted at the pick, ms (0: none noted, [`Ledger::note_prediction`]).
    pub predicted_ms: f64,
}

/// This worker's requests sent and still in prefill (no first byte yet), per endpoint.
#[derive(Debug, Clone, Default)]
pub struct Ledger {
    entries: HashMap<u64, Entry>,
    per_endpoint: ByAddress<Sums>,
    mean: Option<f64>,
    next_ticket: u64,
    inserts: u64,
    /// At most the oldest `sent_ms` among `entries` (`None`: nothing was ever tracked), so that
    /// [`Ledger::expire`] scans only when some entry may be past the TTL: a full ledger (a host
    /// that never reports ends) would otherwise be scanned whole at every pick.
    oldest_ms: Option<u64>,
}

impl Ledger {
    /// Uncached tokens and count pending on `address`.
    pub fn pending(&self, address: &str) -> (f64, u32) {
        self.per_endpoint.get(address_hash(address), address).map_or((0.0, 0), |s| (s.pending, s.pending_n))
    }

    /// Uncached tokens of this worker's requests on `address` that have not ended (in prefill or
    /// decoding): the KV they added there.
    pub fn active(&self, address: &str) -> f64 {
        self.per_endpoint.get(address_hash(address), address).map_or(0.0, |s| s.active)
    }

    /// [`Ledger::pending`] and [`Ledger::active`] of `address` (whose [`address_hash`] is `hash`)
    /// in one lookup.
    pub fn pending_and_active(&self, hash: u64, address: &str) -> ((f64, u32), f64) {
        self.per_endpoint.get(hash, address).map_or(((0.0, 0), 0.0), |s| ((s.pending, s.pending_n), s.active))
    }

    /// Running mean of the uncached tokens this worker sends (`None` before the first pick).
    pub fn mean_tokens(&self) -> Option<f64> {
        self.mean
    }

    /// Requests tracked.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Records a pick; returns its ticket (never 0) for [`Ledger::first_byte`] / [`Ledger::done`].
    pub fn sent(&mut self, address: &str, tokens: f64, work: f64, now_ms: u64) -> u64 {
        let tokens = if tokens.is_finite() { num::max(tokens, 0.0) } else { 0.0 };
        self.mean = Some(match self.mean {
            Some(m) => m + MEAN_ALPHA * (tokens - m),
            None => tokens,
        });
        self.inserts = self.inserts.wrapping_add(1);
        if self.inserts.is_multiple_of(1024) || self.entries.len() >= LEDGER_MAX {
            self.expire(now_ms);
        }
        self.next_ticket = self.next_ticket.wrapping_add(1).max(1);
        let ticket = self.next_ticket;
        if self.entries.len() >= LEDGER_MAX {
            return ticket;
        }
        let hash = address_hash(address);
        self.per_endpoint.update(hash, address, |e| {
            e.pending += tokens;
            e.pending_n = e.pending_n.saturating_add(1);
            e.active += tokens;
            e.active_n = e.active_n.saturating_add(1);
        });
        self.entries.insert(
            ticket,
            Entry {
                address: address.to_string(),
                hash,
                tokens,
                work,
                sent_ms: now_ms,
                prefilling: true,
                predicted_ms: 0.0,
            },
        );
        self.oldest_ms = Some(self.oldest_ms.map_or(now_ms, |o| o.min(now_ms)));
        ticket
    }

    /// Ends the prefill of `ticket` (first byte, or the end); returns its entry when it was still
    /// prefilling.
    fn end_prefill(&mut self, ticket: u64) -> Option<Entry> {
        let e = self.entries.get_mut(&ticket)?;
        if !e.prefilling {
            return None;
        }
        e.prefilling = false;
        let e = e.clone();
        if let Some(p) = self.per_endpoint.get_mut(e.hash, &e.address) {
            p.pending = num::max(p.pending - e.tokens, 0.0);
            p.pending_n = p.pending_n.saturating_sub(1);
            if p.pending_n == 0 {
                p.pending = 0.0;
            }
        }
        Some(e)
    }

    fn remove(&mut self, ticket: u64) {
        self.end_prefill(ticket);
        let Some(e) = self.entries.remove(&ticket) else { return };
        if let Some(p) = self.per_endpoint.get_mut(e.hash, &e.address) {
            p.active = num::max(p.active - e.tokens, 0.0);
            p.active_n = p.active_n.saturating_sub(1);
            if p.active_n == 0 {
                self.per_endpoint.remove(e.hash, &e.address);
            }
        }
    }

    /// The first response byte of `ticket` arrived, but its time says nothing about the pod it
    /// was sent to (a split P/D request: another pod did the prefill): its prefill is done, no
    /// observation.
    pub fn first_byte_unobserved(&mut self, ticket: u64) {
        self.end_prefill(ticket);
    }

    /// The first response byte of `ticket` arrived from `served` at `now_ms`: its prefill is
    /// done. Returns the observation for the rate learner when `served` is the endpoint it was
    /// sent to (after a retry to a fallback the prediction was for another pod).
    pub fn first_byte(&mut self, ticket: u64, served: Option<&str>, now_ms: u64) -> Option<Observation> {
        let e = self.end_prefill(ticket)?;
        if served.is_some_and(|s| s != e.address) {
            return None;
        }
        Some(Observation {
            ms: now_ms.saturating_sub(e.sent_ms),
            work: e.work,
            address: e.address,
            predicted_ms: e.predicted_ms,
        })
    }

    /// Notes the TTFT predicted for `ticket` at its pick (raw, before calibration), for the
    /// prediction's calibration at its first byte.
    pub fn note_prediction(&mut self, ticket: u64, predicted_ms: f64) {
        if let Some(e) = self.entries.get_mut(&ticket) {
            e.predicted_ms = if predicted_ms.is_finite() { num::max(predicted_ms, 0.0) } else { 0.0 };
        }
    }

    /// The request ended (with or without a first byte): forget it.
    pub fn done(&mut self, ticket: u64) {
        self.remove(ticket);
    }

    fn expire(&mut self, now_ms: u64) {
        // Every entry was sent at `oldest_ms` or later: none is older than the TTL.
        if self.oldest_ms.is_none_or(|o| now_ms.saturating_sub(o) <= LEDGER_TTL_MS) {
            return;
        }
        self.oldest_ms = self
            .entries
            .values()
            .filter(|e| now_ms.saturating_sub(e.sent_ms) <= LEDGER_TTL_MS)
            .map(|e| e.sent_ms)
            .min();
        let old: Vec<u64> = self
            .entries
            .iter()
            .filter(|(_, e)| now_ms.saturating_sub(e.sent_ms) > LEDGER_TTL_MS)
            .map(|(&k, _)| k)
            .collect();
        for k in old {
            self.remove(k);
        }
    }
}

/// One candidate's inputs to the prediction.
#[derive(Debug, Clone, Copy, Default)]
pub struct Inputs {
    /// This request's uncached prompt tokens there.
    pub uncached: f64,
    /// This worker's pending (tokens, count) there.
    pub pending: (f64, u32),
    /// Live queue estimate (requests), `None` when not reported.
    pub waiting: Option<f64>,
    /// This gateway's in-flight count there.
    pub inflight: u32,
    /// Learnt rate, ms per token.
    pub rate: f64,
    /// LoRA score, `None` for a base-model request.
    pub lora: Option<f64>,
    /// `active_weight × ` this worker's active tokens there ([`Ledger::active`]).
    pub active: f64,
}

/// Work ahead and own work, in tokens (the module doc's `work(e)`).
pub fn work(i: &Inputs, mean_tokens: f64) -> f64 {
    work_given_waiting(i, mean_tokens, waiting(i))
}

/// [`work`] with `waiting(i)` already computed (the scheduler also sums it for the miss
/// penalty's `busy`).
pub fn work_given_waiting(i: &Inputs, mean_tokens: f64, waiting: f64) -> f64 {
    let (p_tokens, p_n) = i.pending;
    let per_request = if p_n > 0 { p_tokens / f64::from(p_n) } else { mean_tokens };
    // Every request ahead costs its fixed overhead too, as this one's does: with tiny prompts a
    // queue of 50 would otherwise weigh less than one request's overhead.
    let ahead =
        num::max(p_tokens + f64::from(p_n) * OVERHEAD_TOKENS, waiting * (per_request + OVERHEAD_TOKENS));
    let active = if i.active.is_finite() { num::max(i.active, 0.0) } else { 0.0 };
    let v = ahead + num::max(i.uncached, 0.0) + active + OVERHEAD_TOKENS;
    if v.is_finite() {
        v
    } else {
        f64::MAX / 4.0
    }
}

/// Predicted TTFT in ms (the module doc's `ttft(e)`).
pub fn ttft_ms(i: &Inputs, mean_tokens: f64) -> f64 {
    ttft_of_work(i, work(i, mean_tokens))
}

/// [`ttft_ms`] from `work(i, mean_tokens)` already computed.
pub fn ttft_of_work(i: &Inputs, work: f64) -> f64 {
    let lora = i.lora.map_or(1.0, |s| 1.0 / s.clamp(0.1, 1.0));
    usable_rate(i.rate) * work * lora
}

/// Requests queued ahead (`waiting(e)` of the module doc): the live queue estimate, else this
/// gateway's in-flight count.
pub fn waiting(i: &Inputs) -> f64 {
    num::max(i.waiting.filter(|w| w.is_finite()).unwrap_or(f64::from(i.inflight)), 0.0)
}

/// The rate as the formulas use it: a finite positive rate, else 0.
pub fn usable_rate(rate: f64) -> f64 {
    if rate.is_finite() && rate > 0.0 {
        rate
    } else {
        0.0
    }
}

/// The fewest uncached tokens among the eligible candidates (`min uncached` of the module
/// doc's cost); infinite when none is eligible.
pub fn least_uncached(uncached: &[f64], eligible: &[bool]) -> f64 {
    least_uncached_of(uncached.iter().copied(), eligible)
}

/// [`least_uncached`] of the candidates' uncached tokens in order.
pub fn least_uncached_of(uncached: impl Iterator<Item = f64>, eligible: &[bool]) -> f64 {
    uncached.zip(eligible).filter(|(_, ok)| **ok).map(|(u, _)| u).fold(f64::INFINITY, num::min)
}

/// The miss penalty of one candidate, in ms (the module doc's cost minus `ttft(e)`):
/// `miss_weight × (1 + busy) × rate × (uncached − least)`; 0 when `least` is not finite.
pub fn miss_penalty(rate: f64, uncached: f64, least: f64, busy: f64, miss_weight: f64) -> f64 {
    MissPenalty::new(least, busy, miss_weight).of(rate, uncached)
}

/// [`miss_penalty`] with the request's terms (`least`, `busy`, `miss_weight`) combined once:
/// `MissPenalty::new(least, busy, w).of(rate, uncached) == miss_penalty(rate, uncached, least,
/// busy, w)`, bit for bit.
#[derive(Debug, Clone, Copy)]
pub struct MissPenalty {
    least: f64,
    /// `miss_weight × (1 + busy)`; `None` when `least` is not finite (no penalty).
    scale: Option<f64>,
}

impl MissPenalty {
    pub fn new(least: f64, busy: f64, miss_weight: f64) -> Self {
        Self { least, scale: least.is_finite().then(|| miss_weight * (1.0 + num::max(busy, 0.0))) }
    }

    pub fn of(&self, rate: f64, uncached: f64) -> f64 {
        self.of_usable_rate(usable_rate(rate), uncached)
    }

    /// [`MissPenalty::of`] with `usable_rate(rate)` already computed.
    pub fn of_usable_rate(&self, usable_rate: f64, uncached: f64) -> f64 {
        match self.scale {
            Some(k) => k * usable_rate * num::max(uncached - self.least, 0.0),
            None => 0.0,
        }
    }
}

/// The rendezvous credit applied: `credit × (1 − 1 / gateways)`, in [0, 1]: the chance that a
/// prefix this gateway has not placed was placed by another one. 0 with one gateway (its workers
/// share their prefix table, so a prefix none of them placed was placed by no one).
pub fn rendezvous_credit_share(credit: f64, gateways: u32) -> f64 {
    let credit = if credit.is_nan() { 0.0 } else { credit.clamp(0.0, 1.0) };
    credit * (1.0 - 1.0 / f64::from(gateways.max(1)))
}

/// `true` when no eligible candidate holds more of the prompt's blocks than every other eligible
/// one (none holds any, or all hold the same leading blocks, such as a system prompt every
/// request starts with); `false` with no eligible candidate.
pub fn nothing_distinguishes(matched: &[usize], eligible: &[bool]) -> bool {
    let mut held = matched.iter().zip(eligible).filter(|(_, &ok)| ok).map(|(&m, _)| m);
    match held.next() {
        Some(first) => held.all(|m| m == first),
        None => false,
    }
}

/// The highest KV usage [`kv_congestion`] tells apart: at most [`KV_FULL_AT_MAX`].
pub const KV_FULL_AT_MAX: f64 = 0.99;

/// The cap the KV congestion factor uses for one request: `kv_full_at` when cache hits are at
/// stake (some eligible pod holds more of the prompt than another), else [`KV_FULL_AT_MAX`],
/// since with nothing to trade, the pod with the most free KV is the better one however full the
/// others are. 0 (off) stays off.
pub fn kv_full_at(kv_full_at: f64, hits_at_stake: bool) -> f64 {
    if kv_full_at.is_nan() || kv_full_at <= 0.0 {
        0.0
    } else if hits_at_stake {
        kv_full_at
    } else {
        KV_FULL_AT_MAX
    }
}

/// The KV congestion factor of a candidate: `1 / (1 − min(usage, full_at))`, with `usage`
/// clamped to [0, 1] (NaN counts as 0) and `full_at` to [0, 0.99]. 1 at an empty cache or with
/// `full_at` 0 (off); `1 / (1 − full_at)` (5 at the default 0.8) for every pod at or past
/// `full_at`, so that among full pods the rest of the cost decides.
pub fn kv_congestion(usage: f64, full_at: f64) -> f64 {
    let usage = if usage.is_nan() { 0.0 } else { usage.clamp(0.0, 1.0) };
    let full_at = if full_at.is_nan() { 0.0 } else { full_at.clamp(0.0, KV_FULL_AT_MAX) };
    1.0 / (1.0 - num::min(usage, full_at))
}

/// Rendezvous weight of `address` for `key`.
pub fn rendezvous_weight(key: u64, address: &str) -> u64 {
    rendezvous_weight_hashed(key, address_hash(address))
}

/// [`rendezvous_weight`] of the address whose [`address_hash`] is `hash`.
pub fn rendezvous_weight_hashed(key: u64, hash: u64) -> u64 {
    xxh3_64_with_seed(&key.to_le_bytes(), hash)
}

/// The rendezvous key of a request: the session id's hash, else the chained hash of the prompt's
/// first `min(n, blocks)` blocks (which names that whole prefix), else none.
pub fn rendezvous_key(session_id: Option<&str>, hashes: &[u64], blocks: usize) -> Option<u64> {
    if let Some(s) = session_id {
        return Some(xxh3_64(s.as_bytes()));
    }
    if blocks == 0 {
        return None;
    }
    hashes.get(hashes.len().min(blocks).checked_sub(1)?).copied()
}

/// The rendezvous winner among the eligible candidates (`None` when none is eligible), from
/// their addresses' [`address_hash`]es. On equal weights the last one wins.
pub fn rendezvous_winner(key: u64, hashes: &[u64], eligible: &[bool]) -> Option<usize> {
    (0..hashes.len())
        .filter(|&i| eligible.get(i).copied().unwrap_or(false))
        .max_by_key(|&i| hashes.get(i).map_or(0, |&h| rendezvous_weight_hashed(key, h)))
}

/// The order of candidates: primary first, then fallbacks (at most `1 + fallbacks`). See the
/// module doc. `costs` are predicted TTFTs; `hashes` the candidates' [`address_hash`]es;
/// `eligible[i]` is false for overloaded candidates.
pub fn order(
    costs: &[f64],
    hashes: &[u64],
    eligible: &[bool],
    key: Option<u64>,
    slack: f64,
    fallbacks: usize,
    rng: &mut dyn Rng,
) -> Vec<usize> {
    let n = costs.len();
    if n == 0 {
        return Vec::new();
    }
    let best = costs.iter().copied().fold(f64::INFINITY, num::min);
    let bound = best * (1.0 + num::max(slack, 0.0)) + 1e-9;
    // The rendezvous winner among the eligible candidates within the slack.
    let by_key = key.and_then(|k| {
        (0..n)
            .filter(|&i| {
                costs.get(i).is_some_and(|&c| c <= bound) && eligible.get(i).copied().unwrap_or(false)
            })
            .max_by_key(|&i| hashes.get(i).map_or(0, |&h| rendezvous_weight_hashed(k, h)))
    });
    let primary = match by_key {
        Some(p) => p,
        None => {
            let ties: Vec<usize> =
                (0..n).filter(|&i| costs.get(i).is_some_and(|&c| c <= best + 1e-9)).collect();
            ties.get(rng.below(ties.len().max(1))).copied().unwrap_or(0)
        }
    };
    let mut out = Vec::with_capacity(1 + fallbacks.min(n));
    out.push(primary);
    out.extend(lowest_costs(costs, primary, fallbacks));
    out
}

/// The `m` lowest costs but `skip`, lowest first (`f64::total_cmp`), equal costs in index order:
/// the first `m` of a stable sort, by an O(n·m) partial selection (`m` is the few fallbacks),
/// or by the sort itself when `m` is large.
fn lowest_costs(costs: &[f64], skip: usize, m: usize) -> Vec<usize> {
    let cost = |i: usize| costs.get(i).copied().unwrap_or(f64::INFINITY);
    if m > 16 {
        let mut rest: Vec<usize> = (0..costs.len()).filter(|&i| i != skip).collect();
        rest.sort_by(|&a, &b| cost(a).total_cmp(&cost(b)));
        rest.truncate(m);
        return rest;
    }
    let mut best: Vec<usize> = Vec::with_capacity(m + 1);
    if m == 0 {
        return best;
    }
    // Once `best` is full, the `total_cmp` key of its last (highest) cost: most candidates are
    // turned away by one integer comparison.
    let mut worst: Option<i64> = None;
    for (i, &c) in costs.iter().enumerate() {
        if i == skip {
            continue;
        }
        if worst.is_some_and(|w| w <= total_order_key(c)) {
            continue;
        }
        // After every entry not above it: equal costs stay in index order.
        let pos = best.iter().position(|&b| cost(b).total_cmp(&c).is_gt()).unwrap_or(best.len());
        best.insert(pos, i);
        best.truncate(m);
        if best.len() == m {
            worst = best.last().map(|&l| total_order_key(cost(l)));
        }
    }
    best
}

/// An integer ordered as `f64::total_cmp` orders the floats (its own transformation):
/// `total_order_key(a) <= total_order_key(b)` exactly when `a.total_cmp(&b).is_le()`.
fn total_order_key(x: f64) -> i64 {
    let mut k = x.to_bits() as i64;
    k ^= (((k >> 63) as u64) >> 1) as i64;
    k
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::ports::SplitMix64;

    fn inp(uncached: f64, pending: (f64, u32), waiting: Option<f64>, inflight: u32) -> Inputs {
        Inputs { uncached, pending, waiting, inflight, rate: 0.03, lora: None, active: 0.0 }
    }

    #[test]
    fn miss_penalty_charges_the_tokens_beyond_the_best_cached_eligible_candidate() {
        // Ineligible candidates do not set the baseline: the least is 1000, not 10.
        let least = least_uncached(&[10.0, 1000.0, 5000.0], &[false, true, true]);
        assert_eq!(least, 1000.0);
        // 0.5 × (1 + 2) × 0.03 ms/token × 4000 tokens = 180 ms.
        assert!((miss_penalty(0.03, 5000.0, least, 2.0, 0.5) - 180.0).abs() < 1e-9);
        assert_eq!(miss_penalty(0.03, 1000.0, least, 2.0, 0.5), 0.0);
        assert_eq!(miss_penalty(0.03, 5000.0, least, 2.0, 0.0), 0.0);
        // No eligible candidate, or a rate that is not a rate: no penalty.
        assert_eq!(least_uncached(&[1.0], &[false]), f64::INFINITY);
        assert_eq!(miss_penalty(0.03, 5000.0, f64::INFINITY, 2.0, 0.5), 0.0);
        assert_eq!(miss_penalty(f64::NAN, 5000.0, least, 2.0, 0.5), 0.0);
    }

    #[test]
    fn rendezvous_credit_scales_with_the_traffic_other_gateways_see() {
        assert_eq!(rendezvous_credit_share(0.5, 1), 0.0);
        assert_eq!(rendezvous_credit_share(0.5, 0), 0.0);
        assert!((rendezvous_credit_share(0.5, 4) - 0.375).abs() < 1e-12);
        assert!((rendezvous_credit_share(0.5, 2) - 0.25).abs() < 1e-12);
        assert!((rendezvous_credit_share(2.0, 1000) - 0.999).abs() < 1e-12);
        assert_eq!(rendezvous_credit_share(f64::NAN, 4), 0.0);
        assert_eq!(rendezvous_credit_share(-1.0, 4), 0.0);
    }

    #[test]
    fn nothing_distinguishes_the_pods_when_all_eligible_hold_the_same() {
        assert!(nothing_distinguishes(&[0, 0, 0], &[true; 3]));
        // A system prompt every pod holds.
        assert!(nothing_distinguishes(&[2, 2, 2], &[true; 3]));
        assert!(!nothing_distinguishes(&[2, 5, 2], &[true; 3]));
        // An overloaded pod's match does not count.
        assert!(nothing_distinguishes(&[2, 5, 2], &[true, false, true]));
        assert!(!nothing_distinguishes(&[2, 5], &[false, false]));
        assert!(!nothing_distinguishes(&[], &[]));
    }

    #[test]
    fn kv_congestion_grows_as_the_cache_fills_and_stops_at_full_at() {
        assert_eq!(kv_congestion(0.0, 0.8), 1.0);
        assert!((kv_congestion(0.5, 0.8) - 2.0).abs() < 1e-12);
        assert!((kv_congestion(0.75, 0.8) - 4.0).abs() < 1e-12);
        // Every pod at or past `full_at` counts the same: 1 / (1 − 0.8) = 5.
        assert!((kv_congestion(0.8, 0.8) - 5.0).abs() < 1e-9);
        assert_eq!(kv_congestion(0.97, 0.8), kv_congestion(1.0, 0.8));
        // Off, and inputs that are not usages.
        assert_eq!(kv_congestion(0.97, 0.0), 1.0);
        assert_eq!(kv_congestion(f64::NAN, 0.8), 1.0);
        assert_eq!(kv_congestion(-3.0, 0.8), 1.0);
        assert_eq!(kv_congestion(7.0, 0.8), kv_congestion(1.0, 0.8));
        // `full_at` beyond 0.99 is held there: finite whatever the input.
        assert!((kv_congestion(1.0, 1.0) - 100.0).abs() < 1e-9);
        assert!(kv_congestion(1.0, f64::INFINITY).is_finite());
        assert_eq!(kv_congestion(0.9, f64::NAN), 1.0);
    }

    #[test]
    fn kv_cap_holds_only_when_cache_hits_are_at_stake() {
        assert_eq!(kv_full_at(0.8, true), 0.8);
        assert_eq!(kv_full_at(0.8, false), KV_FULL_AT_MAX);
        // Off stays off, whatever is at stake.
        assert_eq!(kv_full_at(0.0, false), 0.0);
        assert_eq!(kv_full_at(f64::NAN, false), 0.0);
        assert_eq!(kv_full_at(-1.0, true), 0.0);
        // With nothing at stake, a pod at 95 % still ranks behind one at 85 %; with hits at
        // stake both count as full.
        let (a, b) =
            (kv_congestion(0.85, kv_full_at(0.8, false)), kv_congestion(0.95, kv_full_at(0.8, false)));
        assert!(b > a * 2.0);
        assert_eq!(kv_congestion(0.85, kv_full_at(0.8, true)), kv_congestion(0.95, kv_full_at(0.8, true)));
    }

    #[test]
    fn total_order_key_orders_as_total_cmp() {
        let pool =
            [0.0, -0.0, 1.0, -1.0, 2.5, f64::NAN, -f64::NAN, f64::INFINITY, -f64::INFINITY, 1e-300, f64::MAX];
        for a in pool {
            for b in pool {
                assert_eq!(total_order_key(a).cmp(&total_order_key(b)), a.total_cmp(&b), "{a} {b}");
            }
        }
    }

    #[test]
    fn lowest_costs_is_the_head_of_a_stable_sort() {
        let mut rng = SplitMix64::new(7);
        let pool = [0.0, -0.0, 1.0, 1.0, 2.5, f64::NAN, f64::INFINITY, 3.0, 0.5];
        for round in 0..400 {
            let n = 1 + rng.below(40);
            let costs: Vec<f64> = (0..n).map(|_| pool[rng.below(pool.len())]).collect();
            let skip = rng.below(n + 1);
            for m in [0, 1, 2, 3, 5, 17, 50] {
                let mut want: Vec<usize> = (0..n).filter(|&i| i != skip).collect();
                want.sort_by(|&a, &b| costs[a].total_cmp(&costs[b]));
                want.truncate(m);
                assert_eq!(lowest_costs(&costs, skip, m), want, "round {round} m {m} {costs:?}");
            }
        }
    }

    #[test]
    fn work_counts_what_is_queued_ahead_and_the_uncached_prompt() {
        // Idle, 1000 uncached tokens.
        assert_eq!(work(&inp(1000.0, (0.0, 0), Some(0.0), 0), 500.0), 1256.0);
        // 2 waiting at the pod, none of ours pending: 2 × (the mean + the overhead).
        assert_eq!(work(&inp(1000.0, (0.0, 0), Some(2.0), 2), 500.0), 2768.0);
        // Ours pending: 3 requests of 3000 tokens in all; the queue says 4 → 4 × (1000 + 256).
        assert_eq!(work(&inp(0.0, (3000.0, 3), Some(4.0), 4), 500.0), 5280.0);
        // Our pending tokens exceed the (stale) queue view: they count, with their overhead.
        assert_eq!(work(&inp(0.0, (9000.0, 1), Some(0.0), 1), 500.0), 9512.0);
        // Queue missing: the in-flight count stands in.
        assert_eq!(work(&inp(0.0, (0.0, 0), None, 3), 100.0), 1324.0);
        assert_eq!(work(&inp(0.0, (0.0, 0), Some(f64::NAN), 3), 100.0), 1324.0);
        // Tiny prompts: a queue of 50 is far worse than an idle pod (beyond any rendezvous slack).
        let busy = work(&inp(1.0, (0.0, 0), Some(50.0), 0), 1.0);
        let idle = work(&inp(1.0, (0.0, 0), Some(0.0), 0), 1.0);
        assert!(busy > 10.0 * idle, "{busy} vs {idle}");
    }

    #[test]
    fn ttft_scales_with_rate_and_lora() {
        let mut i = inp(1000.0, (0.0, 0), Some(0.0), 0);
        assert!((ttft_ms(&i, 0.0) - 1256.0 * 0.03).abs() < 1e-9);
        i.lora = Some(1.0);
        assert!((ttft_ms(&i, 0.0) - 1256.0 * 0.03).abs() < 1e-9);
        i.lora = Some(0.0);
        assert!((ttft_ms(&i, 0.0) - 10.0 * 1256.0 * 0.03).abs() < 1e-9);
        i.lora = Some(0.8);
        assert!((ttft_ms(&i, 0.0) - 1.25 * 1256.0 * 0.03).abs() < 1e-9);
        i.rate = f64::NAN;
        assert_eq!(ttft_ms(&i, 0.0), 0.0);
    }

    #[test]
    fn ledger_tracks_pending_prefill_and_yields_observations() {
        let mut l = Ledger::default();
        let a = l.sent("a", 1000.0, 1500.0, 10);
        let b = l.sent("a", 3000.0, 4000.0, 20);
        assert_eq!(l.pending("a"), (4000.0, 2));
        let o = l.first_byte(a, Some("a"), 110).unwrap();
        assert_eq!(o, Observation { address: "a".into(), work: 1500.0, ms: 100, predicted_ms: 0.0 });
        assert_eq!(l.pending("a"), (3000.0, 1));
        // Served by a fallback: no observation, but the prefill is no longer pending.
        assert_eq!(l.first_byte(b, Some("b"), 200), None);
        assert_eq!(l.pending("a"), (0.0, 0));
        // Done after first byte, or twice: nothing happens.
        l.done(a);
        assert_eq!(l.active("a"), 3000.0, "b is still decoding");
        l.done(b);
        assert!(l.is_empty());
        assert_eq!(l.active("a"), 0.0);
        // Ended without a first byte.
        let c = l.sent("x", 10.0, 10.0, 0);
        l.done(c);
        assert_eq!(l.pending("x"), (0.0, 0));
        assert!(l.mean_tokens().is_some_and(|m| m > 0.0));
    }

    #[test]
    fn ledger_forgets_requests_the_host_never_reported() {
        let mut l = Ledger::default();
        l.sent("a", 100.0, 100.0, 0);
        for i in 0..1023u64 {
            let t = l.sent("b", 1.0, 1.0, LEDGER_TTL_MS + 1 + i);
            l.done(t);
        }
        assert_eq!(l.pending("a"), (0.0, 0), "expired after the TTL");
    }

    #[test]
    fn a_full_ledger_still_expires_exactly_at_the_ttl() {
        let mut l = Ledger::default();
        // Sent out of order: the oldest is not the first.
        l.sent("b", 1.0, 1.0, 500);
        l.sent("a", 1.0, 1.0, 100);
        for i in 0..(LEDGER_MAX as u64 - 2) {
            l.sent("c", 1.0, 1.0, 1_000 + i % 7);
        }
        assert_eq!(l.len(), LEDGER_MAX);
        // Full: each pick tries to expire; nothing is past the TTL yet, so nothing goes and the
        // pick is not tracked.
        l.sent("d", 1.0, 1.0, 100 + LEDGER_TTL_MS);
        assert_eq!((l.len(), l.pending("a").1, l.pending("d").1), (LEDGER_MAX, 1, 0));
        // 1 ms later "a" is past the TTL: it goes and the new pick is tracked.
        l.sent("d", 1.0, 1.0, 101 + LEDGER_TTL_MS);
        assert_eq!((l.len(), l.pending("a").1, l.pending("b").1, l.pending("d").1), (LEDGER_MAX, 0, 1, 1));
        // Then "b" (sent at 500).
        l.sent("e", 1.0, 1.0, 501 + LEDGER_TTL_MS);
        assert_eq!((l.pending("b").1, l.pending("e").1), (0, 1));
    }

    #[test]
    fn rendezvous_picks_the_same_pod_whatever_the_worker_and_respects_the_slack() {
        let addrs = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"].map(address_hash);
        let costs = [100.0, 100.0, 100.0, 100.0];
        let all = [true; 4];
        let mut agree = 0;
        let mut spread = std::collections::HashSet::new();
        for k in 0..40u64 {
            let mut r1 = SplitMix64::new(k);
            let mut r2 = SplitMix64::new(k + 1000);
            let a = order(&costs, &addrs, &all, Some(k), 0.2, 2, &mut r1);
            let b = order(&costs, &addrs, &all, Some(k), 0.2, 2, &mut r2);
            agree += usize::from(a[0] == b[0]);
            spread.insert(a[0]);
            assert_eq!(a.len(), 3);
        }
        assert_eq!(agree, 40);
        assert_eq!(spread.len(), 4, "different keys spread over the pods");
        // A pod outside the slack never wins by rendezvous.
        for k in 0..40u64 {
            let mut r = SplitMix64::new(k);
            let o = order(&[100.0, 130.0, 130.0, 130.0], &addrs, &all, Some(k), 0.2, 3, &mut r);
            assert_eq!(o[0], 0);
            assert_eq!(o.len(), 4);
        }
        // An overloaded pod is never the rendezvous winner; without a key, the lowest cost.
        let key = (0..1000u64)
            .find(|&k| order(&costs, &addrs, &all, Some(k), 0.2, 0, &mut SplitMix64::new(0))[0] == 3);
        let key = key.unwrap();
        let o = order(&costs, &addrs, &[true, true, true, false], Some(key), 0.2, 0, &mut SplitMix64::new(0));
        assert_ne!(o[0], 3);
        let o = order(&[5.0, 1.0, 3.0], &addrs[..3], &[true; 3], None, 0.2, 2, &mut SplitMix64::new(0));
        assert_eq!(o, vec![1, 2, 0]);
        assert!(order(&[], &[], &[], None, 0.2, 2, &mut SplitMix64::new(0)).is_empty());
    }

    #[test]
    fn rendezvous_key_prefers_the_session_then_the_leading_blocks() {
        let h = [11u64, 22, 33, 44];
        assert_eq!(rendezvous_key(None, &h, 2), Some(22));
        assert_eq!(rendezvous_key(None, &h, 32), Some(44));
        assert_eq!(rendezvous_key(None, &[], 32), None);
        assert_eq!(rendezvous_key(None, &h, 0), None);
        assert_eq!(rendezvous_key(Some("s"), &[], 32), Some(xxh3_64(b"s")));
    }
}
