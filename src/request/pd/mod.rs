//! Disaggregated prefill/decode (P/D), llm-d's protocol: two picks per request, pure.
//!
//! **Roles.** Every endpoint has a [`Role`]: `decode` (serves requests and prefills them itself
//! unless told otherwise; the role of an endpoint with no role label, as in llm-d), `prefill`
//! (only ever named as a remote prefiller, never a destination), or `both`. Roles come from
//! `endpoints[].role` and, for discovered pods, from a pod label (`llm-d.ai/role` by default,
//! `discovery.kubernetes.roles`). They matter only when the `pd` section is present.
//!
//! **Decode pick.** The scheduler's usual pipeline (`Scheduler::pick_scoped`) among the
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
//! (`request::CLIENT_ROUTING_HEADERS`).

use serde::Serialize;

use crate::base::errors::Rejection;
use crate::base::json::{self, ConfigError};
use crate::base::ports::{Rng, SharedStore};
use crate::request::config::Settings;
use crate::request::{BodyInputs, Prepared, RequestHead};
use crate::scheduler::config::Weights;
use crate::scheduler::{ModelRoute, Pick, PickRequest, PickScope, Scheduler};
use crate::state::health::HealthView;
use crate::state::inflight::InflightCounts;
use crate::state::snapshot::{EndpointStatus, Snapshot};

/// The request header naming the prefill pod, read by llm-d's routing sidecar.
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";
/// The prefill header of older llm-d routing sidecars (a URL). The filter never sets it, and
/// removes a client-sent one.
pub const LEGACY_PREFILLER_HEADER: &str = "x-prefiller-url";
/// Largest `pd.pd_threshold_tokens` (a prompt longer than this is beyond any model's context).
pub const MAX_THRESHOLD_TOKENS: u64 = 10_000_000;

/// The `pd` section: disaggregated prefill/decode. Absent: roles are ignored and no request is
/// split.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct PdConfig {
    /// Split a request (name a prefill pod) when the part of its prompt the chosen decode pod
    /// does not hold is at least this many tokens; 0 splits every request that has a prefill
    /// candidate. llm-d's `nonCachedTokens` (`pdThreshold` before): default 0, as there.
    /// At most 10000000.
    #[serde(default = "default_threshold")]
    #[cfg_attr(feature = "schema", schemars(range(max = MAX_THRESHOLD_TOKENS)))]
    pub pd_threshold_tokens: u64,
    /// Factor on the prefix weight for the decode pick, 0 to 1. Default 0.5.
    #[serde(default = "default_decode_prefix_factor")]
    #[cfg_attr(feature = "schema", schemars(range(min = 0.0, max = 1.0)))]
    pub decode_prefix_factor: f64,
    /// Prefill-busy guard (objective `predicted_ttft` only): a split the threshold allows is
    /// not made when the prefill path's predicted TTFT (the prefill pod's work ahead and this
    /// prompt at its rate, plus the KV transfer) exceeds this factor times the decode pod's
    /// predicted TTFT prefilling the prompt itself; the decode pod prefills it (decision
    /// `prefill_busy`). P/D trades some TTFT for steadier decoding, so an idle pool, where both
    /// paths cost about the same, still splits; saturated prefill pods do not make every request
    /// wait behind them.
    /// 0 disables the guard (llm-d's rule alone). 0 or 1 to 1000; default 0 (off): in the P/D
    /// replay it rescued prefill-bound pools (2 prefill + 6 decode) but made a pool whose decode
    /// pods then prefilled long prompts (4 + 4) collapse at some loads (docs/pd.md); enable it,
    /// 2 to 8, where the prefill pods are the bottleneck.
    #[serde(default = "default_prefill_busy_factor")]
    #[cfg_attr(feature = "schema", schemars(range(min = 0.0, max = 1000.0)))]
    pub prefill_busy_factor: f64,
    /// KV transfer time per 1,000 prompt tokens, in ms, added to the prefill path by the
    /// prefill-busy guard. Default 5 (Llama-3-8B fp16, 128 KiB a token, over 25 GB/s); 0 to
    /// 60000.
    #[serde(default = "default_transfer_ms_per_1k_tokens")]
    #[cfg_attr(feature = "schema", schemars(range(min = 0.0, max = 60000.0)))]
    pub transfer_ms_per_1k_tokens: f64,
}

// The readers of this file's configuration types (`crate::base::json`), fields in declaration
// order.
json::from_json_struct!(PdConfig {
    pd_threshold_tokens = default_threshold(),
    decode_prefix_factor = default_decode_prefix_factor(),
    prefill_busy_factor = default_prefill_busy_factor(),
    transfer_ms_per_1k_tokens = default_transfer_ms_per_1k_tokens(),
});

fn default_threshold() -> u64 {
    0
}
fn default_decode_prefix_factor() -> f64 {
    0.5
}
fn default_prefill_busy_factor() -> f64 {
    0.0
}
fn default_transfer_ms_per_1k_tokens() -> f64 {
    5.0
}

impl Default for PdConfig {
    fn default() -> Self {
        PdConfig {
            pd_threshold_tokens: default_threshold(),
            decode_prefix_factor: default_decode_prefix_factor(),
            prefill_busy_factor: default_prefill_busy_factor(),
            transfer_ms_per_1k_tokens: default_transfer_ms_per_1k_tokens(),
        }
    }
}

impl PdConfig {
    pub fn validate(&self, path: &str, errs: &mut Vec<ConfigError>) {
        if self.pd_threshold_tokens > MAX_THRESHOLD_TOKENS {
            errs.push(ConfigError::new(
                format!("{path}.pd_threshold_tokens"),
                format!("must be at most {MAX_THRESHOLD_TOKENS}"),
            ));
        }
        if !(0.0..=1.0).contains(&self.decode_prefix_factor) {
            errs.push(ConfigError::new(format!("{path}.decode_prefix_factor"), "must be between 0 and 1"));
        }
        let f = self.prefill_busy_factor;
        if !(f == 0.0 || (1.0..=1000.0).contains(&f)) {
            errs.push(ConfigError::new(
                format!("{path}.prefill_busy_factor"),
                "must be 0 (off) or between 1 and 1000",
            ));
        }
        if !(0.0..=60000.0).contains(&self.transfer_ms_per_1k_tokens) {
            errs.push(ConfigError::new(
                format!("{path}.transfer_ms_per_1k_tokens"),
                "must be between 0 and 60000",
            ));
        }
    }
}

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
/// exactly `Scheduler::pick_for_with`.
#[allow(clippy::too_many_arguments)]
pub fn pick(
    cfg: &Settings<'_>,
    scheduler: &mut Scheduler,
    route: &ModelRoute,
    req: &PickRequest<'_>,
    snapshot: &Snapshot,
    inflight: &InflightCounts,
    health: &HealthView,
    store: &dyn SharedStore,
    rng: &mut dyn Rng,
    now_ms: u64,
) -> Result<PdPick, Rejection> {
    let Some(pd) = cfg.pd else {
        let pick = scheduler.pick_for_with(route, req, snapshot, inflight, health, store, rng, now_ms)?;
        return Ok(PdPick { pick, prefiller: None, decision: Decision::Off, uncached_tokens: 0 });
    };
    let decodes = |e: &EndpointStatus| e.role.decodes();
    let factor = pd.decode_prefix_factor;
    let decode_weights = move |w: Weights| Weights { prefix: w.prefix * factor, ..w };
    let scope = PickScope { allow: Some(&decodes), weights: Some(&decode_weights), ..Default::default() };
    let pick = scheduler.pick_scoped(route, req, snapshot, inflight, health, store, rng, now_ms, &scope)?;
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
    // An ejected prefill pod is left out even when it is the only one (the scheduler's
    // `max_ejection_percent` never empties a pool, but a request without a prefiller still
    // runs: the decode pod prefills it).
    let prefills = |e: &EndpointStatus| {
        e.role.prefills() && e.address != decode_pod && !health.ejected(&e.address, now_ms)
    };
    let any = snapshot
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
    let preq = PickRequest { session_id: None, session_token: None, ..*req };
    match scheduler.pick_scoped(route, &preq, snapshot, inflight, health, store, rng, now_ms, &scope) {
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

/// [`pick`] for a prepared request, with the inputs of the moment it goes on: what the filter
/// calls instead of `request::route_with`.
pub fn route(
    cfg: &Settings<'_>,
    scheduler: &mut Scheduler,
    rng: &mut dyn Rng,
    head: &RequestHead,
    prepared: &Prepared,
    inputs: &BodyInputs<'_>,
    health: &HealthView,
) -> Result<PdPick, Rejection> {
    // Conformance mode: the test's endpoint selection narrows both picks, as in `route_with`.
    let (req, restricted) = crate::request::pick_inputs(head, prepared, inputs.snapshot)?;
    pick(
        cfg,
        scheduler,
        &prepared.route,
        &req,
        restricted.as_ref().unwrap_or(inputs.snapshot),
        inputs.inflight,
        health,
        inputs.store,
        rng,
        inputs.now_ms,
    )
}

#[cfg(test)]
mod tests;
