//! The pieces of the tiered-SLO study (`crate::slo`) that the replay itself runs: the tiers'
//! targets ([`SloTargets`]) and the model of llm-d's SLO-aware profile. Below `replay`,
//! `strategy` and `suite`, which use them; imports only `trace`.
//!
//! `llm-d-slo`: a model of llm-d-inference-scheduler's predicted-latency profile as its chart
//!   configures it (`config/charts/epplib/templates/_config.yaml` with the latency predictor
//!   enabled), each request carrying its tier's target as `x-slo-ttft-ms` and its tier's
//!   priority (sheddable below 0). Per request, in order ([`llm_d_decide`]):
//!   1. `latency-slo-admitter`: a sheddable request (priority < 0) with a target is rejected
//!      (429) unless some pod's prediction meets it, some pod runs nothing, or some pod's KV
//!      cache is under 2 % ("cold"); other requests always pass.
//!   2. `prefix-cache-affinity-filter` at 0.99 ("strict"): keep the pods whose prefix score is
//!      at least 0.99, when there are any, unless the best of them is predicted more than
//!      5,000 ms slower than the best other pod; skipped 1 % of the time (exploration).
//!   3. `slo-headroom-tier-filter`: positive headroom (target − predicted ≥ 0) and negative
//!      tiers; when both exist, the positive one 99 % of the time, the negative 1 %.
//!   4. `prefix-cache-affinity-filter` at 0.80 ("loose"), as 2.
//!   5. `latency-scorer`, strategy `least`: positive pods scored by how little headroom they
//!      have (bin-packing); all negative: the idle pods (nothing dispatched) only if there are
//!      any, else the pods closest to their target; score `⌊(1 − n) × 100⌋ + 1` over 100 with
//!      `n` the headroom's min–max normalised magnitude (0.5 when all are equal).
//!   6. `weighted-random-picker`: a pod drawn with probability proportional to its score.
//!
//!   What it models with ours: the predictor is ours (`Pick::predicted_ms` for every candidate,
//!   from the scheduler's debug scores, [`parse_debug`]), and the prefix score is our
//!   approximate index of its own routing (llm-d's default prefix scorer is also approximate).
//!   Each request runs one probe pick on a copy of the scheduler (every candidate's prediction,
//!   no trace left in the real one) and then the real pick restricted to the pod llm-d's rules
//!   chose, so the ledger, the prefix index and the learnt rates follow where requests went.
//!   Left out: llm-d's XGBoost sidecars and their p90 quantile training (our prediction is
//!   a mean-like estimate, so the admitter's "meets the target" is looser than a p90's would
//!   be), TPOT (no TPOT target is set, which llm-d's non-streaming mode neutralises), its flow
//!   control and the saturation detector's legacy shedding (off: this models the SLO admitter
//!   and scorer, as asked), and one central EPP refreshing metrics every 50 ms (as GIE).

use inference_picker::base::ports::Rng;
use inference_picker::request::config::Settings;
use inference_picker::request::pipeline::prepare;
use inference_picker::request::RequestHead;
use inference_picker::scheduler::{Pick, PickInput, PickRequest, PickScope, PickState, Scheduler};
use inference_picker::state::snapshot::EndpointStatus;

use crate::trace::Tier;

/// Target ÷ unloaded TTFT p99, premium / standard / sheddable (free).
pub const MULTIPLIERS: [f64; 3] = [1.5, 3.0, 6.0];

/// The tiers' TTFT targets, ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SloTargets {
    pub premium_ms: u32,
    pub standard_ms: u32,
    pub sheddable_ms: u32,
}

impl SloTargets {
    /// [`MULTIPLIERS`] × `unloaded_p99_s`, each rounded up to 100 ms (at least 100 ms).
    pub fn from_unloaded(unloaded_p99_s: f64) -> SloTargets {
        let t = |m: f64| {
            let ms = (m * unloaded_p99_s * 1000.0 / 100.0).ceil() * 100.0;
            if ms.is_finite() {
                ms.clamp(100.0, 3_600_000.0) as u32
            } else {
                3_600_000
            }
        };
        SloTargets {
            premium_ms: t(MULTIPLIERS[0]),
            standard_ms: t(MULTIPLIERS[1]),
            sheddable_ms: t(MULTIPLIERS[2]),
        }
    }

    pub fn of(&self, tier: Tier) -> u32 {
        match tier {
            Tier::Premium => self.premium_ms,
            Tier::Standard => self.standard_ms,
            Tier::Sheddable => self.sheddable_ms,
        }
    }

    /// `priority.tier.slo` for the tier example (whose sheddable value is `free`).
    pub fn tier_slo_json(&self) -> serde_json::Value {
        serde_json::json!({
            "premium": {"ttft_ms": self.premium_ms},
            "standard": {"ttft_ms": self.standard_ms},
            "free": {"ttft_ms": self.sheddable_ms},
        })
    }
}

// ---------------------------------------------------------------------------------------------
// The llm-d model.

/// One candidate as llm-d's plugins see it.
#[derive(Debug, Clone, PartialEq)]
pub struct LlmDCand {
    pub address: String,
    /// Predicted TTFT, ms (ours).
    pub predicted_ms: f64,
    /// Prefix score in [0, 1].
    pub prefix: f64,
    /// Requests the EPP dispatched there and has not seen finish.
    pub dispatched: u32,
    /// Running requests at the last scrape (`None`: unknown).
    pub running: Option<f64>,
    /// KV-cache usage in [0, 1] at the last scrape.
    pub kv: Option<f64>,
}

/// llm-d's parameters (the chart's and the plugins' defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlmDParams {
    pub strict_affinity: f64,
    pub loose_affinity: f64,
    pub affinity_explore: f64,
    pub max_ttft_penalty_ms: f64,
    pub epsilon_explore_neg: f64,
    pub cold_kv: f64,
}

impl Default for LlmDParams {
    fn default() -> Self {
        LlmDParams {
            strict_affinity: 0.99,
            loose_affinity: 0.80,
            affinity_explore: 0.01,
            max_ttft_penalty_ms: 5000.0,
            epsilon_explore_neg: 0.01,
            cold_kv: 0.02,
        }
    }
}

/// What llm-d does with one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LlmDDecision {
    /// 429 from the latency-SLO admitter.
    Reject,
    /// The index of the chosen candidate.
    Pick(usize),
}

/// llm-d's admitter, filters, scorer and picker over `cands` (see the module doc) for a request
/// with TTFT target `slo_ms` (`None`: no target; the headroom is then `0 − predicted`, as in
/// llm-d) that is sheddable or not. `cands` must not be empty.
pub fn llm_d_decide(
    cands: &[LlmDCand],
    slo_ms: Option<f64>,
    sheddable: bool,
    p: &LlmDParams,
    rng: &mut dyn Rng,
) -> LlmDDecision {
    let slo = slo_ms.unwrap_or(0.0);
    let headroom = |c: &LlmDCand| slo - c.predicted_ms;
    // 1. The admitter: sheddable requests with a target only.
    if sheddable && slo_ms.is_some_and(|s| s > 0.0) {
        let valid = cands.iter().any(|c| c.predicted_ms < slo);
        let idle = cands.iter().any(|c| c.running.is_some_and(|r| r < 0.5));
        let cold = cands.iter().any(|c| c.kv.is_some_and(|k| k < p.cold_kv));
        if !(valid || idle || cold) {
            return LlmDDecision::Reject;
        }
    }
    let mut keep: Vec<usize> = (0..cands.len()).collect();
    // 2. Strict affinity, 3. the headroom tier, 4. loose affinity.
    keep = affinity(cands, keep, p.strict_affinity, p, rng);
    let (pos, neg): (Vec<usize>, Vec<usize>) = keep.iter().partition(|&&i| headroom(&cands[i]) >= 0.0);
    keep = match (pos.is_empty(), neg.is_empty()) {
        (false, false) => {
            if rng.next_f64() < p.epsilon_explore_neg {
                neg
            } else {
                pos
            }
        }
        (false, true) => pos,
        _ => neg,
    };
    keep = affinity(cands, keep, p.loose_affinity, p, rng);
    // 5. The latency scorer.
    let positive: Vec<usize> = keep.iter().copied().filter(|&i| headroom(&cands[i]) >= 0.0).collect();
    let scored: Vec<usize> = if !positive.is_empty() {
        positive
    } else {
        let idle: Vec<usize> = keep.iter().copied().filter(|&i| cands[i].dispatched == 0).collect();
        if idle.is_empty() {
            keep
        } else {
            idle
        }
    };
    let scores = least_scores(&scored.iter().map(|&i| headroom(&cands[i]).abs()).collect::<Vec<_>>());
    // 6. Weighted random.
    let total: f64 = scores.iter().sum();
    let mut x = rng.next_f64() * total;
    for (k, &i) in scored.iter().enumerate() {
        x -= scores[k];
        if x < 0.0 {
            return LlmDDecision::Pick(i);
        }
    }
    LlmDDecision::Pick(scored.last().copied().unwrap_or(0))
}

/// `prefix-cache-affinity-filter` at `threshold` over `keep`.
fn affinity(
    cands: &[LlmDCand],
    keep: Vec<usize>,
    threshold: f64,
    p: &LlmDParams,
    rng: &mut dyn Rng,
) -> Vec<usize> {
    if rng.next_f64() < p.affinity_explore {
        return keep;
    }
    let (sticky, other): (Vec<usize>, Vec<usize>) = keep.iter().partition(|&&i| cands[i].prefix >= threshold);
    if sticky.is_empty() {
        return keep;
    }
    let best = |v: &[usize]| v.iter().map(|&i| cands[i].predicted_ms).fold(f64::INFINITY, f64::min);
    if !other.is_empty()
        && p.max_ttft_penalty_ms > 0.0
        && best(&sticky) > best(&other) + p.max_ttft_penalty_ms
    {
        return keep;
    }
    sticky
}

/// The latency scorer's `least` scores of headroom magnitudes (TTFT only: with no TPOT target
/// every TPOT headroom is 0, so only TTFT's range counts).
pub fn least_scores(magnitudes: &[f64]) -> Vec<f64> {
    let lo = magnitudes.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = magnitudes.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let range = hi - lo;
    magnitudes
        .iter()
        .map(|&m| {
            // With every headroom equal, both dimensions have no range: llm-d keeps its weights
            // (0.8, 0.2) on 0.5 each, so the blend is 0.5.
            let n = if range > 1e-9 { (m - lo) / range } else { 0.5 };
            (((1.0 - n) * 100.0).floor() + 1.0) / 100.0
        })
        .collect()
}

/// (address, prefix score, predicted TTFT ms) of every candidate in a debug-scores string
/// (`addr t=.. p=.. … ttft=12.3ms work=.. rate=..[ overloaded]`, entries separated by `, `).
pub fn parse_debug(s: &str) -> Vec<(String, f64, f64)> {
    let mut out = Vec::new();
    for entry in s.split(", ") {
        let mut it = entry.split_whitespace();
        let Some(addr) = it.next() else { continue };
        let (mut prefix, mut ttft) = (None, None);
        for tok in it {
            if let Some(v) = tok.strip_prefix("p=") {
                prefix = v.parse().ok();
            } else if let Some(v) = tok.strip_prefix("ttft=") {
                ttft = v.trim_end_matches("ms").parse().ok();
            }
        }
        if let (Some(p), Some(t)) = (prefix, ttft) {
            out.push((addr.to_string(), p, t));
        }
    }
    out
}

/// `llm-d-slo`'s routing of one request: a probe pick on a copy of `sched` for every
/// candidate's prediction, [`llm_d_decide`], then the real pick restricted to the chosen pod.
/// `Err` is the rejection's reason (as the replay counts it).
#[allow(clippy::too_many_arguments)]
pub fn llm_d_route(
    cfg: &Settings<'_>,
    sched: &mut Scheduler,
    rng: &mut dyn Rng,
    head: &RequestHead,
    body: &[u8],
    state: PickState<'_>,
    slo_ms: Option<u32>,
    sheddable: bool,
    dispatched: &dyn Fn(&str) -> u32,
) -> Result<Pick, String> {
    let reason = |r: inference_picker::base::errors::Rejection| format!("router_{}_{}", r.status, r.code);
    let prepared = prepare(cfg, sched, rng, head, body, state.snapshot).map_err(reason)?;
    let request = || PickRequest {
        model: &prepared.requested_model,
        prompt: &prepared.prompt,
        cache_salt: prepared.cache_salt.as_deref(),
        session_id: None,
        session_token: None,
        // llm-d's own rules use the target (`llm_d_decide`); ours' SLO routing stays out.
        slo: None,
    };
    let mut probe = sched.clone();
    let seen = probe
        .pick(PickInput {
            route: &prepared.route,
            request: request(),
            state,
            scope: PickScope::default(),
            rng,
        })
        .map_err(reason)?;
    let rows = parse_debug(seen.debug_scores.as_deref().unwrap_or(""));
    let cands: Vec<LlmDCand> = rows
        .into_iter()
        .map(|(address, prefix, predicted_ms)| {
            let m = state
                .snapshot
                .endpoints
                .iter()
                .find(|e| e.address == address)
                .and_then(|e| e.metrics.as_ref());
            LlmDCand {
                dispatched: dispatched(&address),
                running: m.and_then(|m| m.running),
                kv: m.and_then(|m| m.kv_usage),
                address,
                prefix,
                predicted_ms,
            }
        })
        .collect();
    if cands.is_empty() {
        return Ok(seen);
    }
    let chosen = match llm_d_decide(&cands, slo_ms.map(f64::from), sheddable, &LlmDParams::default(), rng) {
        LlmDDecision::Reject => return Err("llm_d_429_slo_unattainable".into()),
        LlmDDecision::Pick(i) => cands[i].address.clone(),
    };
    let allow = |e: &EndpointStatus| e.address == chosen;
    sched
        .pick(PickInput {
            route: &prepared.route,
            request: request(),
            state,
            scope: PickScope { allow: Some(&allow), ..PickScope::default() },
            rng,
        })
        .map_err(reason)
}
