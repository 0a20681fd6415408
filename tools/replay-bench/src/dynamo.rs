//! Baseline: NVIDIA Dynamo's KV router (`--router-mode kv`), with and without KV events.
//!
//! **Sources, checked against upstream (ai-dynamo/dynamo, Apache-2.0) for issue #16:**
//! - `docs/router/kv_cache_routing.md` (flags and defaults: `--kv-overlap-score-weight` 1,
//!   `--router-temperature` 0, KV events on, `--no-kv-events` → predicted cache with a 120 s TTL,
//!   `--router-replica-sync` off) and `docs/design_docs/router_design.md` (potential active
//!   blocks, potential new prefill blocks = (input tokens − overlap blocks × block size) ÷ block
//!   size; active blocks tracked by the router over each request's life).
//! - The formula followed: `lib/llm/src/kv_router/scheduler.rs`, `DefaultWorkerSelector::
//!   select_worker` and `softmax_sample`, in the releases that have `mark_prefill_completed`
//!   (the 0.4–0.6 line): `logit = overlap_score_weight × potential_prefill_blocks +
//!   potential_decode_blocks`, both "if the request were scheduled there"; at temperature 0 the
//!   minimum logit, a uniformly random one among equal minima.
//! - Current main (`lib/kv-router/src/scheduling/selector/default.rs`, v1.3–1.4):
//!   `prefill_load_scale × max(0, raw_prefill_blocks − overlap_score_credit ×
//!   device_overlap_blocks) + decode_cost_blocks + decode_active_request_weight ×
//!   active_requests`, defaults (`scheduling/config.rs`) `prefill_load_scale` 1,
//!   `overlap_score_credit_decay` 0, `decode_active_request_weight` 0; host/disk cache tiers
//!   (weights 0.75 / 0.25) need KV offloading, which the simulated servers do not have. With
//!   those defaults it is the same cost as below (the `max(0, ·)` never binds: the raw prefill
//!   includes this request's whole prompt, the overlap only part of it).
//! - Not modelled: the router's request queue (`AllWorkersBusy` / busy thresholds are off by
//!   default) and the KV block size: the simulated vLLM uses 16-token blocks, which Dynamo's
//!   `--kv-cache-block-size` follows.
//!
//! **Cost, per worker `w`** (lower is better):
//! `logit(w) = weight × (prefill_tokens(w) + isl − overlap(w)) ÷ block + active_blocks(w ∪ request)`
//! - `overlap(w)`: prompt tokens `w` already caches (whole blocks);
//! - `prefill_tokens(w)`: uncached prompt tokens of the requests the router sent to `w` that have
//!   not produced their first token yet (Dynamo's `mark_prefill_completed`);
//! - `active_blocks(w ∪ request)`: KV blocks of the router's active requests on `w` if this one
//!   were added there, shared prefix blocks counted once (Dynamo's `ActiveSequences` deduplicates
//!   by block hash); a request leaves when its last token is out.
//!
//! Temperature 0 takes the lowest logit; ties are broken at random here (Dynamo's softmax sampler
//! at temperature 0 picks among the minima).
//!
//! **Cache state.** With KV events (the default) the router's indexer mirrors every engine's
//! block-stored / block-removed events, so `overlap(w)` is the server's real cache content at the
//! decision: the replay reads it from the server model (`Server::cached_prefix_tokens`), with no
//! delay (events travel in milliseconds). With `--no-kv-events` (`ApproxKvIndexer`) the router
//! records the blocks of each request it routes on the chosen worker and forgets them 120 s later;
//! the replay hashes at the server's hash unit (16 tokens, or Mooncake's 512-token blocks), so a
//! match is measured in those units.
//!
//! **State.** One router per frontend process: in an R × W topology each replica has one (the
//! replicas do not sync, `--router-replica-sync` being off by default).

use hashbrown::HashMap;
use inference_picker::base::ports::Rng;

/// `kv_overlap_score_weight` default.
pub const OVERLAP_WEIGHT: f64 = 1.0;
/// KV block, tokens (vLLM's default block size, Dynamo's `--kv-cache-block-size` for it).
pub const BLOCK_TOKENS: u64 = 16;
/// `ApproxKvIndexer` TTL.
pub const APPROX_TTL_MS: f64 = 120_000.0;

#[derive(Debug, Clone)]
struct Active {
    worker: usize,
    /// Uncached prompt tokens still to prefill (0 once the first token is out).
    prefill_tokens: u64,
    units: Vec<u64>,
    tail_blocks: u64,
}

#[derive(Debug, Clone)]
pub struct KvRouter {
    events: bool,
    tokens_per_unit: u64,
    blocks_per_unit: u64,
    prefill_tokens: Vec<u64>,
    unit_refs: Vec<HashMap<u64, u32>>,
    tail_blocks: Vec<u64>,
    active: HashMap<u64, Active>,
    /// `--no-kv-events`: unit hash → expiry (virtual ms), per worker.
    approx: Vec<HashMap<u64, f64>>,
}

/// One request as the router sees it.
pub struct Request<'a> {
    pub id: u64,
    pub prompt_tokens: u32,
    /// The prompt's full hash units (chained), at `tokens_per_unit` tokens each.
    pub units: &'a [u64],
}

impl KvRouter {
    pub fn new(workers: usize, events: bool, tokens_per_unit: u32) -> Self {
        let tpu = u64::from(tokens_per_unit.max(1));
        KvRouter {
            events,
            tokens_per_unit: tpu,
            blocks_per_unit: tpu.div_ceil(BLOCK_TOKENS).max(1),
            prefill_tokens: vec![0; workers],
            unit_refs: vec![HashMap::new(); workers],
            tail_blocks: vec![0; workers],
            active: HashMap::new(),
            approx: vec![HashMap::new(); workers],
        }
    }

    pub fn uses_events(&self) -> bool {
        self.events
    }

    fn split(&self, req: &Request) -> (usize, u64) {
        let isl = u64::from(req.prompt_tokens.max(1));
        let full = ((isl / self.tokens_per_unit) as usize).min(req.units.len());
        let tail = (isl - full as u64 * self.tokens_per_unit).div_ceil(BLOCK_TOKENS);
        (full, tail)
    }

    /// Picks a worker. `cached_tokens[w]` is worker w's cached prefix of this prompt from KV
    /// events (ignored without events).
    pub fn select(&mut self, req: &Request, cached_tokens: &[u64], now_ms: f64, rng: &mut dyn Rng) -> usize {
        let n = self.prefill_tokens.len();
        let isl = u64::from(req.prompt_tokens.max(1));
        let (full, tail) = self.split(req);
        let units = &req.units[..full];
        let mut best: Vec<usize> = Vec::new();
        let mut best_logit = f64::INFINITY;
        for w in 0..n {
            let overlap = if self.events {
                cached_tokens.get(w).copied().unwrap_or(0)
            } else {
                let a = &self.approx[w];
                units.iter().take_while(|u| a.get(*u).is_some_and(|&exp| exp > now_ms)).count() as u64
                    * self.tokens_per_unit
            }
            .min(isl);
            // Whole KV blocks only.
            let overlap_blocks = overlap / BLOCK_TOKENS;
            let new_tokens = isl - overlap_blocks * BLOCK_TOKENS;
            let prefill_blocks = (self.prefill_tokens[w] + new_tokens) as f64 / BLOCK_TOKENS as f64;
            let refs = &self.unit_refs[w];
            let new_units = units.iter().filter(|u| !refs.contains_key(*u)).count() as u64;
            let active_blocks =
                (refs.len() as u64 + new_units) * self.blocks_per_unit + self.tail_blocks[w] + tail;
            let logit = OVERLAP_WEIGHT * prefill_blocks + active_blocks as f64;
            if logit < best_logit {
                best_logit = logit;
                best.clear();
                best.push(w);
            } else if logit == best_logit {
                best.push(w);
            }
        }
        let w = best.get(rng.below(best.len().max(1))).copied().unwrap_or(0);
        self.add(req, w, cached_tokens, now_ms);
        w
    }

    fn add(&mut self, req: &Request, w: usize, cached_tokens: &[u64], now_ms: f64) {
        let isl = u64::from(req.prompt_tokens.max(1));
        let (full, tail) = self.split(req);
        let units = req.units[..full].to_vec();
        let overlap = if self.events {
            cached_tokens.get(w).copied().unwrap_or(0)
        } else {
            let a = &self.approx[w];
            units.iter().take_while(|u| a.get(*u).is_some_and(|&exp| exp > now_ms)).count() as u64
                * self.tokens_per_unit
        }
        .min(isl);
        let prefill = isl - (overlap / BLOCK_TOKENS) * BLOCK_TOKENS;
        self.prefill_tokens[w] += prefill;
        for &u in &units {
            *self.unit_refs[w].entry(u).or_insert(0) += 1;
        }
        self.tail_blocks[w] += tail;
        if !self.events {
            let a = &mut self.approx[w];
            // The TTL pruning Dynamo runs in the background, done lazily here.
            if a.len() > 4 * 65_536 {
                a.retain(|_, exp| *exp > now_ms);
            }
            for &u in &units {
                a.insert(u, now_ms + APPROX_TTL_MS);
            }
        }
        self.active.insert(req.id, Active { worker: w, prefill_tokens: prefill, units, tail_blocks: tail });
    }

    /// The request's first token is out: its prefill no longer counts.
    pub fn first_token(&mut self, id: u64) {
        if let Some(a) = self.active.get_mut(&id) {
            let w = a.worker;
            self.prefill_tokens[w] = self.prefill_tokens[w].saturating_sub(a.prefill_tokens);
            a.prefill_tokens = 0;
        }
    }

    /// The request finished or was dropped.
    pub fn finished(&mut self, id: u64) {
        self.first_token(id);
        if let Some(a) = self.active.remove(&id) {
            let refs = &mut self.unit_refs[a.worker];
            for u in &a.units {
                if let Some(c) = refs.get_mut(u) {
                    *c -= 1;
                    if *c == 0 {
                        refs.remove(u);
                    }
                }
            }
            self.tail_blocks[a.worker] = self.tail_blocks[a.worker].saturating_sub(a.tail_blocks);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use inference_picker::base::ports::SplitMix64;

    #[test]
    fn cached_worker_wins_until_its_load_outweighs_the_hit() {
        let mut r = KvRouter::new(2, true, 16);
        let mut rng = SplitMix64::new(1);
        let units: Vec<u64> = (1..=64).collect();
        // 1,024-token prompt, worker 1 caches 960 tokens (60 blocks): logits
        // w0 = 64 + 64 = 128, w1 = 4 + 64 = 68 → worker 1.
        let req = Request { id: 1, prompt_tokens: 1024, units: &units };
        assert_eq!(r.select(&req, &[0, 960], 0.0, &mut rng), 1);
        // A second, unrelated 1,024-token prompt: w1 now carries 64 prefill + 64 active blocks,
        // w0 none: w0 = 64 + 64 = 128, w1 = 128 + 128 = 256 → worker 0.
        let other: Vec<u64> = (100..164).collect();
        let req2 = Request { id: 2, prompt_tokens: 1024, units: &other };
        assert_eq!(r.select(&req2, &[0, 0], 0.0, &mut rng), 0);
        // After both finish, the state is empty again.
        r.finished(1);
        r.finished(2);
        assert_eq!((r.prefill_tokens.as_slice(), r.tail_blocks.as_slice()), (&[0, 0][..], &[0, 0][..]));
        assert!(r.unit_refs.iter().all(|m| m.is_empty()));
    }

    #[test]
    fn without_events_it_predicts_from_its_own_routing_for_120_s() {
        let mut r = KvRouter::new(2, false, 16);
        let mut rng = SplitMix64::new(2);
        let units: Vec<u64> = (1..=64).collect();
        let req = Request { id: 1, prompt_tokens: 1024, units: &units };
        let w = r.select(&req, &[], 0.0, &mut rng);
        r.finished(1);
        // Within the TTL the same prompt goes back to w (overlap 64 blocks against none).
        let again = Request { id: 2, prompt_tokens: 1024, units: &units };
        assert_eq!(r.select(&again, &[], 1_000.0, &mut rng), w);
        r.finished(2);
        // After it (refreshed at 1 s, so expired at 121 s), both workers are equal: either.
        let later = Request { id: 3, prompt_tokens: 1024, units: &units };
        let picks: Vec<usize> = (0..20).map(|_| r.clone().select(&later, &[], 121_001.0, &mut rng)).collect();
        assert!(picks.contains(&0) && picks.contains(&1), "{picks:?}");
    }
}
