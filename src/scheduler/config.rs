//! Scheduler configuration: the `scheduler` section of the configuration document.
//!
//! Same conventions as `crate::config`: `deny_unknown_fields` everywhere, a documented default per
//! field (no blanket `#[serde(default)]` on a struct), and [`SchedulerConfig::validate`] reports
//! the JSON path of every bad field. Defaults are chosen and justified in `docs/scheduler.md`.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::base::json::{self, ConfigError};
use crate::base::settings::settings;
use crate::state::catalog::Catalog;
use crate::state::health::HealthConfig;

settings! {
    #[derive(Debug, Clone, PartialEq)]
    pub struct SchedulerConfig {
        /// Scorer weights for every model. Defaults: see [`Weights`].
        pub weights: Weights = Weights::default(),
        /// Per-model overrides (key: model or adapter name as resolved after rewrites). A field left
        /// out keeps the pool-level value from `weights`. Default: none.
        pub model_weights: BTreeMap<String, WeightOverrides> = BTreeMap::new(),
        /// How many fallback endpoints follow the primary in `x-gateway-destination-endpoint`.
        /// Default 2: with the shipped Envoy configs (override_host and a route retry policy with
        /// num_retries 2) a try that fails before the response starts goes to the next listed pod.
        /// The filter sets `x-envoy-max-retries` to the number of fallbacks it listed, which overrides
        /// the route's `num_retries` for each request.
        #[range(min = 0, max = 16)]
        pub fallbacks: usize = 2,
        /// Totals within this of the best are ties, broken by a seeded random choice. Default 0.001
        /// (the weights sum to about 14, so this only absorbs float noise and truly equal scores).
        #[range(min = 0.0)]
        #[reason = "must be a finite number >= 0"]
        pub tie_epsilon: f64 = 0.001,
        /// Pick at random among the best `top_k` endpoints, with probability proportional to their
        /// total score, so that independent gateways do not herd. Default 1: plain max score (ties
        /// are still broken at random).
        #[range(min = 1, max = 64)]
        pub top_k: usize = 1,
        /// Prefix-cache affinity: how prompts are hashed into blocks and how much each endpoint's
        /// local index and the cross-worker table hold. Defaults: see [`PrefixConfig`].
        pub prefix: PrefixConfig = PrefixConfig::default(),
        /// Session affinity: the session header, and the token that names the endpoint that
        /// served. Defaults: see [`SessionConfig`].
        pub session: SessionConfig = SessionConfig::default(),
        /// The hot-spot guard, which moves a request off an overloaded endpoint. Defaults: see
        /// [`GuardConfig`].
        pub guard: GuardConfig = GuardConfig::default(),
        /// Model-name rewrites and traffic splits (InferenceModelRewrite semantics). Default: none.
        pub rewrites: Vec<RewriteRule> = Vec::new(),
        /// Return per-endpoint score breakdowns for an opt-in debug response header. Default false:
        /// the breakdown reveals pool topology and load.
        pub debug_scores: bool = false,
        /// The queue scorer reads the live queue estimate (the scraped queue plus the requests this
        /// gateway sent there since that scrape and has not seen finish; see docs/scheduler.md)
        /// instead of the scraped queue. Default false: in the replay benchmark it helped most
        /// workloads and loads but not all (Mooncake at load 5, the slow shared-prefix run).
        /// Saturation and flow control always use the estimate.
        pub live_queue: bool = false,
        /// How candidates are ranked. `predicted_ttft` (default): the lowest predicted time to first
        /// token (queued prefill ahead + this prompt's uncached tokens, at each endpoint's learnt
        /// rate), with a bounded-load rendezvous among the near-best so that independent gateways
        /// agree; `weights` are not used. `weighted`: the maximum of `Σ weight × score` (the scorers
        /// and `weights`, as before). See docs/scheduler.md.
        pub objective: Objective = Objective::PredictedTtft,
        /// Settings of the `predicted_ttft` objective. Defaults: see [`PredictedConfig`].
        pub predicted: PredictedConfig = PredictedConfig::default(),
    }
}

/// The ranking objective (`scheduler.objective`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Objective {
    /// Lowest predicted TTFT (default).
    #[default]
    PredictedTtft,
    /// Highest `Σ weight × score`.
    Weighted,
}

settings! {
    /// `scheduler.predicted`: the predicted-TTFT objective.
    #[derive(Debug, Clone, PartialEq)]
    pub struct PredictedConfig {
        /// Candidates whose predicted TTFT is within `(1 + affinity_slack)` of the best are equally
        /// good; among them the rendezvous winner of the session id (else of the prompt's leading
        /// blocks) is the primary. 0 disables the rendezvous (ties only). Default 0.2.
        #[range(min = 0.0, max = 10.0)]
        #[reason = "must be a number in {min}..={max}"]
        pub affinity_slack: f64 = 0.2,
        /// Leading prompt blocks (of `prefix.block_chars`) whose hash is the rendezvous key: turns of
        /// one conversation share it when their common prefix is at least this long. 0: only the
        /// session id is a key. Default 32 (8 KiB of prompt).
        #[range(min = 0, max = 4096)]
        pub rendezvous_blocks: usize = 32,
        /// Prefill rate assumed for an endpoint before anything is learnt, in ms per prompt token.
        /// Default 0.03 (~33k tokens/s, an 8B model on one H100). Only ratios between endpoints
        /// matter for the choice, so it matters only while some endpoints are learnt and others not.
        #[range(min = 0.000001, max = 1000.0)]
        #[reason = "must be a number in {min}..={max}"]
        pub prior_ms_per_token: f64 = 0.03,
        /// Weight, in the predicted work, of the uncached tokens of this worker's requests still
        /// running on the endpoint (prefill or decode: the KV they hold and the decode steps they
        /// share), like Dynamo's active-blocks term. Default 0: in the replay benchmark weight 1 (Dynamo's)
        /// doubled ours' TTFT p90 on Mooncake at load 4.5 (it pushes conversations off their cache).
        #[range(min = 0.0, max = 100.0)]
        #[reason = "must be a number in {min}..={max}"]
        pub active_weight: f64 = 0.0,
        /// When nothing distinguishes the pods for a prompt (no eligible one holds more of its
        /// blocks than every other, e.g. only a system prompt all share) and the request names no
        /// adapter, the rendezvous winner's uncached tokens are multiplied by
        /// `1 − rendezvous_credit × (1 − 1 / poller.replicas)`: the chance that another gateway
        /// replica already sent this prefix there (a gateway's own workers share their prefix table,
        /// so with one replica there is no credit). Default 0.5: in the replay benchmark (3 seeds,
        /// 4 replicas × 4 workers, `poller.replicas` 4) it took Mooncake at load 4.5 from 2.57 s to
        /// 1.93 s TTFT p90 and the shared-prefix trace at half speed from 108 s to 26 s; one replica
        /// is unchanged. Set `poller.replicas` to the number of gateway replicas. With a `peers`
        /// section there is no credit: the replicas exchange their placements, so each knows
        /// where the others sent a prefix instead of guessing (in the replay at 4 × 4 with the
        /// exchange, no credit took Mooncake from 1.65 s to 1.48 s and shared-prefix-slow from
        /// 0.43 s to 0.36 s; without the exchange the credit is what keeps them at 1.93 s and
        /// 24 s, against 2.67 s and 110 s).
        #[range(min = 0.0, max = 1.0)]
        #[reason = "must be a number in {min}..={max}"]
        pub rendezvous_credit: f64 = 0.5,
        /// The choice ranks candidates by predicted TTFT plus a miss penalty: `miss_weight × (1 +
        /// mean queue)` × the prefill time of the prompt tokens a candidate lacks beyond the
        /// best-cached candidate (mean queue: the live queue estimate averaged over the eligible
        /// candidates). A cache miss also delays the requests queued behind it and evicts others'
        /// prefixes, which this request's own TTFT does not show, and the busier the pool the more
        /// requests pay. 0: rank by predicted TTFT alone. Default 0.5: in the replay benchmark,
        /// predicted TTFT alone collapsed on the shared-prefix trace at half speed (TTFT p90 67 s
        /// against 0.35 s for GIE: near saturation, every cached pod with a few queued requests
        /// sent its group's next request to a pod without the 6,000-token prefix); 0.5 brought it
        /// to 2–8 s (with `kv_full_at` too, 0.35 s) and improved Mooncake at its knee (1.61 → 1.46 s).
        #[range(min = 0.0, max = 100.0)]
        #[reason = "must be a number in {min}..={max}"]
        pub miss_weight: f64 = 0.5,
        /// KV congestion: each candidate's cost (predicted TTFT plus the miss penalty) is divided by
        /// `1 − min(kv_usage, kv_full_at)`: a pod whose KV cache is filling admits the request into
        /// slower, preemption-prone steps before its queue shows it. Every pod at and past
        /// `kv_full_at` counts as full (factor `1 / (1 − kv_full_at)`), so past saturation the
        /// cost decides; except that when no pod holds more of the prompt than another (no cache
        /// hit to trade) and `poller.replicas` is 1, a pod with nothing waiting is not capped (the
        /// factor runs to 0.99), so the pod with room wins over one whose cache is full. 0 turns it off. Default 0.8: in
        /// the replay benchmark (3 seeds, whole traces) it took the
        /// shared-prefix trace at half speed from 3.01 s to 0.35 s TTFT p90 (GIE 0.35 s) and
        /// Mooncake at load 4.5 from 1.46 s to 1.18 s; see docs/scheduler.md.
        #[range(min = 0.0, max = 0.99)]
        #[reason = "must be a number in {min}..={max}"]
        pub kv_full_at: f64 = 0.8,
    }
}

settings! {
    /// Weight of each scorer in the total `Σ weight × score`. Each score is in [0, 1].
    #[derive(Debug, Clone, Copy, PartialEq)]
    pub struct Weights {
        /// Prefix-cache affinity. Default 3 (GIE's late-2025 default; 1 diluted affinity).
        pub prefix: f64 = 3.0,
        /// Engine queue length, min-max normalised. Default 0.5 (GIE uses 2; see `weights` below).
        pub queue: f64 = 0.5,
        /// KV-cache headroom, 1 − usage. Default 0.5 (GIE uses 2).
        pub kv_cache: f64 = 0.5,
        /// Router-local in-flight requests (reacts between polls). Default 2: with queue 0.5 and KV 0.5,
        /// the replay benchmark (tools/replay-bench/FINDINGS.md) measured lower TTFT p90 on every workload than GIE's queue 2 / KV 2 / in-flight 1, because polled queue and KV lag bursts by up to one poll while the in-flight count does not.
        pub inflight: f64 = 2.0,
        /// Session affinity by `x-session-id` rendezvous. Default 4: a session stays unless its
        /// endpoint is clearly worse on load (and the hot-spot guard moves it when overloaded).
        pub session: f64 = 4.0,
        /// LoRA adapter affinity (adapter requests only). Default 2.
        pub lora: f64 = 2.0,
    }
}

settings! {
    /// A per-model override of [`Weights`]; `None` keeps the pool-level weight.
    #[derive(Debug, Clone, Copy, PartialEq)]
    pub struct WeightOverrides {
        /// Replaces `weights.prefix` for this model. Default: none (the pool-level weight).
        #[serde(skip_serializing_if = "Option::is_none")]
        pub prefix: Option<f64> = None,
        /// Replaces `weights.queue` for this model. Default: none (the pool-level weight).
        #[serde(skip_serializing_if = "Option::is_none")]
        pub queue: Option<f64> = None,
        /// Replaces `weights.kv_cache` for this model. Default: none (the pool-level weight).
        #[serde(skip_serializing_if = "Option::is_none")]
        pub kv_cache: Option<f64> = None,
        /// Replaces `weights.inflight` for this model. Default: none (the pool-level weight).
        #[serde(skip_serializing_if = "Option::is_none")]
        pub inflight: Option<f64> = None,
        /// Replaces `weights.session` for this model. Default: none (the pool-level weight).
        #[serde(skip_serializing_if = "Option::is_none")]
        pub session: Option<f64> = None,
        /// Replaces `weights.lora` for this model. Default: none (the pool-level weight).
        #[serde(skip_serializing_if = "Option::is_none")]
        pub lora: Option<f64> = None,
    }
}

settings! {
    #[derive(Debug, Clone, PartialEq)]
    pub struct PrefixConfig {
        /// Bytes of canonical prompt text per hashed block. Default 256 (≈ 64 tokens): with
        /// `max_blocks` 256 this compares the first 64 KiB, which covers a Mooncake-size prompt
        /// (~12k tokens ≈ 48 KiB); GIE's 64 × 256 stops at 16 KiB.
        #[range(min = 16, max = 65_536)]
        pub block_chars: usize = 256,
        /// Most blocks hashed per request. Default 256.
        #[range(min = 1, max = 4096)]
        pub max_blocks: usize = 256,
        /// Per-endpoint local index size (blocks) when the endpoint does not report
        /// `cache_config_info`. Default 8192 (≈ 2 MiB of text ≈ 512k tokens, the KV capacity of one
        /// 8B model on an 80 GB GPU).
        #[range(min = 1, max = 1 << 22)]
        pub index_blocks: usize = 8192,
        /// Cap on the sum of all endpoints' local indexes, per worker VM. Default 262144 blocks
        /// (≈ 8 MiB of memory per worker).
        #[range(min = 1, max = 1 << 24)]
        pub index_blocks_total: usize = 262_144,
        /// Characters per token, to size the index from `num_gpu_blocks × block_size` tokens.
        /// Default 4.
        #[range(min = 1, max = 64)]
        pub chars_per_token: usize = 4,
        /// Shared-data shard keys of the cross-worker prefix table. Default 256. 0 disables the table
        /// (each worker then only knows the prefixes it sent itself).
        #[range(min = 0, max = 4096)]
        pub shared_shards: usize = 256,
        /// Entries (checkpoint hash → endpoint) per shard, oldest dropped first. Default 64
        /// (768 bytes per shard value, which every read copies; 16384 entries in all).
        #[range(min = 1, max = 65_536)]
        pub shared_entries_per_shard: usize = 64,
    }
}

settings! {
    #[derive(Debug, Clone, PartialEq)]
    pub struct SessionConfig {
        /// Request header naming a session. Default `x-session-id`.
        pub header: String = String::from("x-session-id"),
        /// Response header carrying the opaque token of the endpoint that served, and request
        /// header a client sends it back in. Default `x-session-token`.
        pub token_header: String = String::from("x-session-token"),
        /// Name of a VM environment variable holding the secret that keys the session token
        /// (at least 16 bytes; pass it with `vm_config.environment_variables.host_env_keys`, so only
        /// the name shows in `/config_dump`). At most one of `secret_env` and `secret`. Neither:
        /// tokens are keyed with a public built-in key and can be forged (a warning is logged).
        /// Default: none.
        pub secret_env: Option<String> = None,
        /// The token secret inline (at least 16 bytes). Visible to anyone who can read Envoy's
        /// admin `/config_dump`; prefer `secret_env`. Default: none.
        pub secret: Option<String> = None,
        /// Name of a VM environment variable holding the previous secret, during a rotation: tokens
        /// made with it are still accepted, none are issued with it. Default: none.
        pub previous_secret_env: Option<String> = None,
        /// The previous secret inline (visible in `/config_dump`). Default: none.
        pub previous_secret: Option<String> = None,
    }
}

settings! {
    /// Hot-spot guard: an endpoint is overloaded when its load exceeds the least-loaded candidate's
    /// by more than `abs_gap` AND by more than `ratio` times. Defaults are SGLang's (64, 1.5).
    #[derive(Debug, Clone, PartialEq)]
    pub struct GuardConfig {
        /// How much more load (the larger of queue + running and in-flight) than the least-loaded
        /// candidate's makes an endpoint overloaded, together with `ratio`. At least 0. Default 64.
        #[range(min = 0.0)]
        #[reason = "must be a finite number >= 0"]
        pub abs_gap: f64 = 64.0,
        /// How many times the least-loaded candidate's load makes an endpoint overloaded, together
        /// with `abs_gap`. At least 1. Default 1.5.
        #[range(min = 1.0)]
        #[reason = "must be a finite number >= 1"]
        pub ratio: f64 = 1.5,
    }
}

settings! {
    /// One rewrite rule: if the request's model matches (exactly) one of `matches`, or `matches` is
    /// empty (catch-all), the model is rewritten to one of `targets`, chosen by relative weight.
    #[derive(Debug, Clone, PartialEq)]
    pub struct RewriteRule {
        /// Empty = catch-all. An exact match in any rule beats every catch-all.
        pub matches: Vec<RewriteMatch> = Vec::new(),
        /// The models a matching request is rewritten to; at least one.
        pub targets: Vec<RewriteTarget>,
    }
}

settings! {
    #[derive(Debug, Clone, PartialEq)]
    pub struct RewriteMatch {
        /// The request's model (the body's `model`), as sent by the client.
        pub model: ModelMatch,
    }
}

settings! {
    #[derive(Debug, Clone, PartialEq)]
    pub struct ModelMatch {
        /// Only `Exact` exists (as in the CRD). Default `Exact`.
        pub kind as "type": MatchType = MatchType::Exact,
        /// The model name to match; not empty.
        pub value: String,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub enum MatchType {
    #[default]
    Exact,
}

settings! {
    #[derive(Debug, Clone, PartialEq)]
    pub struct RewriteTarget {
        /// The model (base or adapter) the request is sent as.
        pub model_rewrite: String,
        /// Relative weight, 1..=1000000. Set on all targets of a rule or on none (equal split).
        #[serde(skip_serializing_if = "Option::is_none")]
        pub weight: Option<u32> = None,
    }
}

json::from_json_enum!(Objective { "predicted_ttft" => PredictedTtft, "weighted" => Weighted });
json::from_json_enum!(MatchType { "Exact" => Exact });

impl Weights {
    /// These weights with `o`'s set fields replacing them.
    pub fn overridden(&self, o: &WeightOverrides) -> Weights {
        Weights {
            prefix: o.prefix.unwrap_or(self.prefix),
            queue: o.queue.unwrap_or(self.queue),
            kv_cache: o.kv_cache.unwrap_or(self.kv_cache),
            inflight: o.inflight.unwrap_or(self.inflight),
            session: o.session.unwrap_or(self.session),
            lora: o.lora.unwrap_or(self.lora),
        }
    }

    fn named(&self) -> [(&'static str, f64); 6] {
        [
            ("prefix", self.prefix),
            ("queue", self.queue),
            ("kv_cache", self.kv_cache),
            ("inflight", self.inflight),
            ("session", self.session),
            ("lora", self.lora),
        ]
    }
}

fn err(errs: &mut Vec<ConfigError>, path: String, reason: impl Into<String>) {
    errs.push(ConfigError { path, reason: reason.into() });
}

fn check_weights(errs: &mut Vec<ConfigError>, path: &str, w: &Weights) {
    for (name, v) in w.named() {
        if !v.is_finite() || v < 0.0 {
            err(errs, format!("{path}.{name}"), format!("weight must be a finite number >= 0, got {v}"));
        }
    }
}

fn check_header(errs: &mut Vec<ConfigError>, path: &str, h: &str) {
    let ok = !h.is_empty()
        && h.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    if !ok {
        err(errs, path.to_string(), format!("header name must be non-empty lowercase [a-z0-9_-], got {h:?}"));
    }
}

impl SchedulerConfig {
    /// Checks ranges and that every model named in `model_weights` and `rewrites` is a known
    /// base model or adapter (`known`). Paths are relative to the document root.
    pub fn validate(&self, known: &dyn Fn(&str) -> bool) -> Vec<ConfigError> {
        let mut errs = Vec::new();
        check_weights(&mut errs, "scheduler.weights", &self.weights);
        for (model, o) in &self.model_weights {
            let path = format!("scheduler.model_weights.{model}");
            if !known(model) {
                err(&mut errs, path.clone(), "not a model or adapter declared in models");
            }
            check_weights(&mut errs, &path, &self.weights.overridden(o));
        }
        self.validate_ranges("scheduler", &mut errs);
        self.prefix.validate_ranges("scheduler.prefix", &mut errs);
        check_header(&mut errs, "scheduler.session.header", &self.session.header);
        check_header(&mut errs, "scheduler.session.token_header", &self.session.token_header);
        validate_secrets(&self.session, &mut |path, reason| err(&mut errs, path, reason));
        self.predicted.validate_ranges("scheduler.predicted", &mut errs);
        self.guard.validate_ranges("scheduler.guard", &mut errs);
        let mut catch_alls = 0;
        for (i, rule) in self.rewrites.iter().enumerate() {
            let path = format!("scheduler.rewrites[{i}]");
            if rule.matches.is_empty() {
                catch_alls += 1;
                if catch_alls > 1 {
                    err(
                        &mut errs,
                        format!("{path}.matches"),
                        "only one catch-all rule (empty matches) is allowed",
                    );
                }
            }
            for (j, m) in rule.matches.iter().enumerate() {
                if m.model.value.is_empty() {
                    err(&mut errs, format!("{path}.matches[{j}].model.value"), "must not be empty");
                }
            }
            if rule.targets.is_empty() {
                err(&mut errs, format!("{path}.targets"), "at least one target is required");
            }
            let weighted = rule.targets.iter().filter(|t| t.weight.is_some()).count();
            if weighted != 0 && weighted != rule.targets.len() {
                err(&mut errs, format!("{path}.targets"), "set weight on all targets or on none");
            }
            for (j, t) in rule.targets.iter().enumerate() {
                let tp = format!("{path}.targets[{j}]");
                if !known(&t.model_rewrite) {
                    err(
                        &mut errs,
                        format!("{tp}.model_rewrite"),
                        "not a model or adapter declared in models",
                    );
                }
                if let Some(w) = t.weight {
                    if !(1..=1_000_000).contains(&w) {
                        err(&mut errs, format!("{tp}.weight"), format!("must be in 1..=1000000, got {w}"));
                    }
                }
            }
        }
        errs
    }
}

/// What the filter does when no endpoint of the requested model has fresh metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub enum FailureMode {
    /// Route by the router-local in-flight count among the endpoints that serve the model.
    FailOpen,
    /// Answer 503.
    FailClose,
}
json::from_json_enum!(FailureMode { "FailOpen" => FailOpen, "FailClose" => FailClose });

/// Everything the scheduler reads: its own section and, from the rest of the document, the
/// catalog, the poller's staleness limit and replica count, the failure mode and passive health.
/// `config` builds it (`From<&Config>`).
#[derive(Debug, Clone, Copy)]
pub struct Setup<'a> {
    pub scheduler: &'a SchedulerConfig,
    pub catalog: Catalog<'a>,
    /// `poller.stale_after_ms`.
    pub stale_after_ms: u64,
    /// `poller.replicas`: gateway replicas polling the same pods.
    pub replicas: u32,
    /// A `peers` section is set: the replicas exchange their placements, so none needs to
    /// guess where another sent a prefix (no rendezvous credit; `predict`).
    pub peers: bool,
    /// `filter.failure_mode`.
    pub failure_mode: FailureMode,
    pub health: &'a HealthConfig,
}

/// Shortest secret accepted, in bytes (the key is 128 bits; a shorter secret is guessable).
pub const MIN_SECRET_BYTES: usize = 16;

/// Static checks of the secret fields (the environment is read later, at configure).
pub fn validate_secrets(cfg: &SessionConfig, err: &mut dyn FnMut(String, String)) {
    let at = "scheduler.session";
    for (name, inline, env) in [
        ("secret", &cfg.secret, &cfg.secret_env),
        ("previous_secret", &cfg.previous_secret, &cfg.previous_secret_env),
    ] {
        if inline.is_some() && env.is_some() {
            err(format!("{at}.{name}"), format!("set `{name}` or `{name}_env`, not both"));
        }
        if let Some(s) = inline {
            if s.len() < MIN_SECRET_BYTES {
                err(
                    format!("{at}.{name}"),
                    format!("must be at least {MIN_SECRET_BYTES} bytes, got {}", s.len()),
                );
            }
        }
        if let Some(e) = env {
            if e.is_empty() || e.contains(['=', '\0']) {
                err(format!("{at}.{name}_env"), format!("{e:?} is not an environment variable name"));
            }
        }
    }
    if (cfg.previous_secret.is_some() || cfg.previous_secret_env.is_some())
        && cfg.secret.is_none()
        && cfg.secret_env.is_none()
    {
        err(
            format!("{at}.previous_secret"),
            "a previous secret needs a current one (`secret` or `secret_env`)".into(),
        );
    }
}
