//! Disaggregated prefill/decode (P/D), llm-d's protocol: two picks per request, pure.
//!
//! **Roles.** Every endpoint has a [`Role`]: `decode` (serves requests and prefills them itself
//! unless told otherwise; the role of an endpoint with no role label, as in llm-d), `prefill`
//! (only ever named as a remote prefiller, never a destination), or `both`. Roles come from
//! `endpoints[].role` and, for discovered pods, from a pod label (`llm-d.ai/role` by default,
//! `discovery.kubernetes.roles`). They matter only when the `pd` section is present.
//!
//! **Decode pick.** The scheduler's usual pipeline (`Scheduler::pick`, narrowed by a `PickScope`) among the
//! decode-capable endpoints (`decode`, `both`): filters, passive health, guard, load, KV
//! headroom, session, LoRA, fail open. Prefix affinity weighs `pd.decode_prefix_factor` (default
//! 0.5) times its usual weight: with a prefill pod doing the long prefills, a decode pod's
//! cache saves less, and balancing decode load matters more. The decode pick is the
//! destination (`x-gateway-destination-endpoint`, with its fallbacks).
//!
//! **Split decision** (llm-d's prefix-based decider). With `T = pd.pd_threshold_tokens`:
//! - `T = 0` (llm-d's default): every request with a prefill candidate is split;
//! - else `prompt_tokens = prompt_bytes / chars_per_token`, `cached_tokens = matched_blocks ×
//!   block_chars / chars_per_token` on the chosen decode pod (the prefix scorer's belief; 0 when
//!   the hot-spot guard found the pod overloaded), and the request is split when
//!   `prompt_tokens − cached_tokens ≥ T`;
//! - **prefill-busy guard** (objective `predicted_ttft`; [`prefill_busy`]): a split that rule
//!   allows is not made when `ttft(prefill pod) + uncached × transfer_ms_per_1k_tokens / 1000 >
//!   prefill_busy_factor × ttft(decode pod)`, both as the scheduler predicts them (work ahead and
//!   this prompt at the pod's rate); the decode pod prefills it (`prefill_busy`). Missing
//!   prediction (objective `weighted`) or factor 0: the threshold rule alone.
//!
//! No split, whatever the length: `pd` absent, the decode pick failed open (no fresh decode
//! pod: the pool is degraded, keep the request simple), no prefill-capable endpoint serves the
//! model (a pool without prefill pods never splits), or none of them is healthy and not ejected.
//!
//! **Prefill pick.** The same pipeline among the prefill-capable endpoints (`prefill`, `both`)
//! other than the chosen decode pod and not ejected by passive health (even the last one),
//! with the weights reduced to prefix affinity, queue and
//! in-flight count (the prefill queue: polled, and the router-local count between polls: the
//! filter counts a split request on its prefill pod from the pick until the decode pod's
//! response headers, by which time the remote prefill is over); no
//! session, no fail open (a stale or ejected prefill pod is never named), and the prompt's
//! blocks recorded in this worker's index only (the cross-worker table keeps naming the decode
//! pod). The result is the request header `x-prefiller-host-port: ip:port`, read by llm-d's
//! routing sidecar on the decode pod. A client-sent one is always removed
//! (`request::protocol::CLIENT_ROUTING_HEADERS`).

use crate::base::errors::Rejection;
use crate::request::config::{PdConfig, Settings};
use crate::scheduler::config::Weights;
use crate::scheduler::{Pick, PickInput, PickRequest, PickScope, Scheduler};
use crate::state::snapshot::EndpointStatus;

/// Why a request was or was not split (for metrics and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// No `pd` section.
    Off,
    /// The decode pick failed open.
    FailOpen,
    /// The uncached prompt on the decode pod is shorter than the threshold.
    BelowThreshold,
    /// No prefill-capable endpoint other than the decode pod serves the model.
    NoPrefillPods,
    /// Prefill pods exist but none is healthy and not ejected.
    NoHealthyPrefill,
    /// The prefill path was predicted more than `pd.prefill_busy_factor` times slower than the
    /// decode pod prefilling itself.
    PrefillBusy,
    /// Split: a prefill pod is named.
    Split,
}

impl Decision {
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::Off => "off",
            Decision::FailOpen => "fail_open",
            Decision::BelowThreshold => "below_threshold",
            Decision::NoPrefillPods => "no_prefill_pods",
            Decision::NoHealthyPrefill => "no_healthy_prefill",
            Decision::PrefillBusy => "prefill_busy",
            Decision::Split => "split",
        }
    }
}

/// The decode pick, and the prefill pod when the request is split.
#[derive(Debug, Clone, PartialEq)]
pub struct PdPick {
    pub pick: Pick,
    /// `ip:port` for [`PREFILLER_HEADER`].
    pub prefiller: Option<String>,
    pub decision: Decision,
    /// Estimated prompt tokens the decode pod does not hold (0 when `pd` is off).
    pub uncached_tokens: u64,
}

/// Prompt tokens not held by an endpoint whose prefix score is `prefix_score` over
/// `prefix_blocks` hashed blocks of `block_chars` bytes, with `chars_per_token` bytes a token.
pub fn uncached_tokens(
    prompt_bytes: usize,
    prefix_score: f64,
    prefix_blocks: usize,
    block_chars: usize,
    chars_per_token: usize,
) -> u64 {
    let per_token = chars_per_token.max(1) as f64;
    let prompt = prompt_bytes as f64 / per_token;
    let score = if prefix_score.is_finite() { prefix_score.clamp(0.0, 1.0) } else { 0.0 };
    let matched = (score * prefix_blocks as f64).round();
    let cached = matched * block_chars as f64 / per_token;
    let left = (prompt - cached).max(0.0);
    // A finite, non-negative float below 2^53: the cast saturates anyway.
    left as u64
}

/// The prefill-busy guard: true when the prefill path (the prefill pod's predicted TTFT plus
/// the KV transfer of `uncached` tokens) is predicted more than `pd.prefill_busy_factor` times
/// slower than the decode pod prefilling itself. False when the guard is off or either
/// prediction is missing (objective `weighted`): llm-d's rule alone then.
pub fn prefill_busy(pd: &PdConfig, decode_ms: Option<f64>, prefill_ms: Option<f64>, uncached: u64) -> bool {
    let (Some(d), Some(p)) = (decode_ms, prefill_ms) else { return false };
    if pd.prefill_busy_factor <= 0.0 || !(d.is_finite() && p.is_finite()) {
        return false;
    }
    let transfer = uncached as f64 / 1000.0 * pd.transfer_ms_per_1k_tokens;
    p + transfer > pd.prefill_busy_factor * d
}

/// llm-d's rule: split when the threshold is 0, or the uncached tokens reach it.
pub fn should_split(threshold: u64, uncached: u64) -> bool {
    threshold == 0 || uncached >= threshold
}

/// Decode pick, split decision, prefill pick (see the module doc). With no `pd` section this is
/// exactly [`Scheduler::pick`] of `input`; with one, `input.scope` is replaced by the decode
/// pick's and the prefill pick's.
pub fn pick(
    cfg: &Settings<'_>,
    scheduler: &mut Scheduler,
    input: PickInput<'_>,
) -> Result<PdPick, Rejection> {
    let Some(pd) = cfg.pd else {
        let pick = scheduler.pick(input)?;
        return Ok(PdPick { pick, prefiller: None, decision: Decision::Off, uncached_tokens: 0 });
    };
    let PickInput { route, request: req, state, rng, .. } = input;
    let decodes = |e: &EndpointStatus| e.role.decodes();
    let factor = pd.decode_prefix_factor;
    let decode_weights = move |w: Weights| Weights { prefix: w.prefix * factor, ..w };
    let scope = PickScope { allow: Some(&decodes), weights: Some(&decode_weights), ..Default::default() };
    let pick = scheduler.pick(PickInput { route, request: req, state, scope, rng: &mut *rng })?;
    let pc = cfg.prefix;
    let uncached = uncached_tokens(
        req.prompt.len(),
        pick.prefix_score,
        pick.prefix_blocks,
        pc.block_chars,
        pc.chars_per_token,
    );
    let no =
        |decision| Ok(PdPick { pick: pick.clone(), prefiller: None, decision, uncached_tokens: uncached });
    if pick.fail_open {
        return no(Decision::FailOpen);
    }
    if !should_split(pd.pd_threshold_tokens, uncached) {
        return no(Decision::BelowThreshold);
    }
    let decode_pod = pick.primary.as_str();
    let (health, now_ms) = (state.health, state.now_ms);
    // An ejected prefill pod is left out even when it is the only one (the scheduler's
    // `max_ejection_percent` never empties a pool, but a request without a prefiller still
    // runs: the decode pod prefills it).
    let prefills = |e: &EndpointStatus| {
        e.role.prefills() && e.address != decode_pod && !health.ejected(&e.address, now_ms)
    };
    let any = state
        .snapshot
        .endpoints
        .iter()
        .any(|e| e.role.prefills() && e.address != decode_pod && e.models.contains(&route.base));
    if !any {
        return no(Decision::NoPrefillPods);
    }
    let prefill_weights = |w: Weights| Weights {
        prefix: w.prefix,
        queue: w.queue,
        inflight: w.inflight,
        kv_cache: 0.0,
        session: 0.0,
        lora: 0.0,
    };
    let scope = PickScope {
        allow: Some(&prefills),
        weights: Some(&prefill_weights),
        no_fail_open: true,
        skip_shared_record: true,
    };
    let request = PickRequest { session_id: None, session_token: None, ..req };
    match scheduler.pick(PickInput { route, request, state, scope, rng }) {
        Ok(p) => {
            // The prefill pick's own prefill-ledger entry (`scheduler::predict`) ends here: no
            // first byte of the prefill pod's answer is ever seen by this filter (the decode
            // pod's sidecar reads it), so it would never end. The prefill pod's load between
            // polls is its in-flight count, which the filter holds until the response headers.
            scheduler.request_done(p.ticket);
            if prefill_busy(pd, pick.predicted_ms, p.predicted_ms, uncached) {
                return no(Decision::PrefillBusy);
            }
            Ok(PdPick {
                prefiller: Some(p.primary),
                pick,
                decision: Decision::Split,
                uncached_tokens: uncached,
            })
        }
        Err(_) => no(Decision::NoHealthyPrefill),
    }
}

#[cfg(test)]
mod tests;
