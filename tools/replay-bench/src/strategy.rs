//! The routing strategies compared, each fed only what it would see in its own deployment.
//!
//! | name | what | state | metrics refresh |
//! |---|---|---|---|
//! | `ours` | `inference_picker::scheduler::Scheduler` behind the request core with the **shipped default configuration**: the document holds only the endpoints and the model (exactly what `Config::from_json` gives for it; flow control off) | per worker (+ the replica's shared prefix table and in-flight counts) | 200 ms (`poller.interval_ms` default) |
//! | `ours+flow` | `ours` with `flow_control.enabled: true` and the trace's tier labels trusted as InferenceObjectives premium 10 / standard 0 / sheddable −10 | same | 200 ms |
//! | `ours-tiers` | `ours` with the `priority`, `saturation` and `flow_control` sections of `filter-config/examples/priority-tiers.json` (tier header `x-llm-tier`: premium / standard / free) | same | 200 ms |
//! | `ours-slo` | `ours-tiers` plus the tiers' TTFT targets (`priority.tier.slo`: premium / standard / free), the SLO study's (`crate::slo`); needs the SLO core | same | 200 ms |
//! | `llm-d-slo` | llm-d's predicted-latency profile with its latency-SLO admitter (`crate::slo`, module doc), on ours' predicted TTFT; each request's tier target as `x-slo-ttft-ms` | central | 50 ms |
//! | `gie-default` | GIE's default profile through our Scheduler (below) | **one central EPP** for every replica and worker | 50 ms (GIE's default) |
//! | `gie-default+lora` | `gie-default` plus GIE's `lora-affinity-scorer` (weight 2), LoRA workload only | central | 50 ms |
//! | `gie-1-1-1` | `gie-default` with the earlier weights prefix 1, queue 1, KV 1 (llm-d's published "estimated-scheduling" run) | central | 50 ms |
//! | `load-only` | llm-d's "load-scheduling" profile: queue 1 + KV 1, no prefix | central | 50 ms |
//! | `sglang` | SGLang's current cache-aware policy (`crate::sglang`) on its router-local in-flight counts | per replica (one router process) | none (router-local load) |
//! | `least-request` | Envoy `LEAST_REQUEST`: power of two random choices on the replica's in-flight counts | per replica counts | none |
//! | `round-robin` | Envoy `ROUND_ROBIN` / a Kubernetes Service: each worker cycles from a random start | per worker | none |
//! | `random` | uniform | none | none |
//! | `dynamo` | NVIDIA Dynamo's KV router with KV events (`crate::dynamo`) | per replica (one frontend) | events: instant |
//! | `dynamo-no-kv-events` | the same with `--no-kv-events`: cache predicted from its own routing, 120 s TTL | per replica | none |
//! | `oracle` | the perfect-information picker (`crate::oracle`): each server's exact TTFT for this request, by simulating a copy of it | global | instant |
//! | `ours-perfect-state` | `ours` (same configuration) fed a snapshot scraped from every server at the instant of each decision: the gap's "greedy objective" row | per worker | every request, no delay |
//! | `oracle-stale` | `oracle` on copies of the servers taken at its last poll (every 200 ms, 20 ms delay) with its own decisions since queued on them, evaluated as of the poll: the gap's "staleness" row | global | 200 ms |
//! | `oracle-approx-prefix` | `oracle` with exact queues but this request's cache hit predicted by an approximate index of its own routing (LRU, the server's KV size): the gap's "approximate prefix state" row | global | instant |
//!
//! The refresh interval of every strategy can be changed with `--refresh name=ms` (the
//! `Common::refresh` map).
//!
//! **GIE's default, through our Scheduler** (follows kubernetes-sigs/gateway-api-inference-extension
//! as released before the EPP moved to llm-d, v1.2+: `pkg/epp/scheduling/framework/plugins/multi/prefix`
//! and the default profile in `config/charts/inferencepool`). Default profile: prefix 3, queue 2,
//! KV 2, max-score picker with a random tie-break; our Scheduler reproduces it with `objective:
//! weighted` (ours' default is `predicted_ttft`) and weights prefix
//! 3, queue 2, kv_cache 2 and 0 for in-flight, session and LoRA; the queue (min-max) and KV
//! (1 − usage) scorers are GIE's formulas. Prefix plugin: `blockSizeTokens` 16 × 4 characters per
//! token = `block_chars` 64, `maxPrefixBlocksToMatch` 256, and `autoTune` (≥ 1.2): the per-pod LRU
//! is sized from the pod's `cache_config_info` (num_gpu_blocks × block_size ÷ 16 tokens, which is
//! our `capacity()` with chars_per_token 4 and block_chars 64), 31,250 when a pod does not report
//! it. The EPP is one process per pool (active-passive), so in an R × W topology every request
//! goes through one Scheduler, one snapshot and one index: the topology does not split its state.
//! Metrics refresh every 50 ms. No cross-worker table is needed (shared_shards 0) and there is no
//! hot-spot guard (abs_gap 1e15). Remaining differences: our per-endpoint index is a
//! two-generation approximation of an LRU (holds between half and all of its capacity), where
//! GIE's is an exact LRU; GIE hashes its own JSON serialisation of the messages where we hash
//! `body::ParsedRequest::prompt`: both deterministic functions of the message text.

use serde_json::json;

use inference_picker::config::Config;

/// Base model name of the simulated pool.
pub const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Policy {
    Ours,
    OursFlow,
    OursTiers,
    /// The SLO study (`crate::slo`): ours-tiers with the tiers' targets, and the modelled llm-d
    /// SLO admitter and scorer.
    OursSlo,
    LlmDSlo,
    GieDefault,
    GieDefaultLora,
    Gie111,
    LoadOnly,
    Sglang,
    LeastRequest,
    RoundRobin,
    Random,
    Dynamo,
    DynamoNoEvents,
    Oracle,
    /// The gap to the limit (issue #16), each a row at the reference load: ours fed exact,
    /// instant metrics; the oracle on 200 ms-old state; the oracle on an approximate prefix index.
    OursPerfectState,
    OracleStale,
    OracleApproxPrefix,
}

impl Policy {
    pub const ALL: [Policy; 19] = [
        Policy::Ours,
        Policy::OursFlow,
        Policy::OursTiers,
        Policy::OursSlo,
        Policy::LlmDSlo,
        Policy::GieDefault,
        Policy::GieDefaultLora,
        Policy::Gie111,
        Policy::LoadOnly,
        Policy::Sglang,
        Policy::LeastRequest,
        Policy::RoundRobin,
        Policy::Random,
        Policy::Dynamo,
        Policy::DynamoNoEvents,
        Policy::Oracle,
        Policy::OursPerfectState,
        Policy::OracleStale,
        Policy::OracleApproxPrefix,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Policy::Ours => "ours",
            Policy::OursFlow => "ours+flow",
            Policy::OursTiers => "ours-tiers",
            Policy::OursSlo => "ours-slo",
            Policy::LlmDSlo => "llm-d-slo",
            Policy::GieDefault => "gie-default",
            Policy::GieDefaultLora => "gie-default+lora",
            Policy::Gie111 => "gie-1-1-1",
            Policy::LoadOnly => "load-only",
            Policy::Sglang => "sglang",
            Policy::LeastRequest => "least-request",
            Policy::RoundRobin => "round-robin",
            Policy::Random => "random",
            Policy::Dynamo => "dynamo",
            Policy::DynamoNoEvents => "dynamo-no-kv-events",
            Policy::Oracle => "oracle",
            Policy::OursPerfectState => "ours-perfect-state",
            Policy::OracleStale => "oracle-stale",
            Policy::OracleApproxPrefix => "oracle-approx-prefix",
        }
    }

    pub fn parse(s: &str) -> Result<Policy, String> {
        Policy::ALL.into_iter().find(|p| p.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Policy::ALL.iter().map(|p| p.name()).collect();
            format!("unknown strategy {s:?} (known: {})", names.join(", "))
        })
    }

    /// Our filter, in one of its configurations.
    pub fn is_ours(self) -> bool {
        matches!(
            self,
            Policy::Ours | Policy::OursFlow | Policy::OursTiers | Policy::OursSlo | Policy::OursPerfectState
        )
    }

    /// The perfect-information picker or one of its gap variants (`crate::oracle`).
    pub fn is_oracle(self) -> bool {
        matches!(self, Policy::Oracle | Policy::OracleStale | Policy::OracleApproxPrefix)
    }

    /// Runs the real Scheduler (and so parses bodies with the real parser).
    pub fn uses_scheduler(self) -> bool {
        self.is_ours()
            || matches!(
                self,
                Policy::GieDefault
                    | Policy::GieDefaultLora
                    | Policy::Gie111
                    | Policy::LoadOnly
                    | Policy::LlmDSlo
            )
    }

    /// Needs the prompt text (parses the body).
    pub fn needs_prompt(self) -> bool {
        self.uses_scheduler() || self == Policy::Sglang
    }

    /// Goes through our priority and flow-control core, as the host filter does (with
    /// `flow_control.enabled` false it passes everything, but still sheds sheddable requests while
    /// saturated). Only ours: the baselines have no flow control (GIE's is experimental and off
    /// by default).
    pub fn uses_flow_control(self) -> bool {
        self.is_ours()
    }

    /// One central picker for the whole topology (GIE's EPP is one process per pool): every
    /// request goes through the same state whatever the replicas and workers.
    pub fn central(self) -> bool {
        matches!(
            self,
            Policy::GieDefault | Policy::GieDefaultLora | Policy::Gie111 | Policy::LoadOnly | Policy::LlmDSlo
        ) || self.is_oracle()
    }

    /// A shipped baseline of another project or of Envoy (what `best baseline` ranges over). Not
    /// Dynamo with KV events (it reads the engines' exact cache state, which no in-proxy picker
    /// can; it has its own SUMMARY figure) and not the oracle.
    pub fn is_baseline(self) -> bool {
        matches!(
            self,
            Policy::GieDefault
                | Policy::GieDefaultLora
                | Policy::Sglang
                | Policy::LeastRequest
                | Policy::RoundRobin
                | Policy::Random
        )
    }

    /// Metrics refresh interval as the project ships it, ms (see the table above).
    pub fn default_refresh_ms(self) -> u64 {
        match self {
            Policy::GieDefault
            | Policy::GieDefaultLora
            | Policy::Gie111
            | Policy::LoadOnly
            | Policy::LlmDSlo => 50,
            _ => 200,
        }
    }
}

/// `10.0.<i / 250>.<i % 250 + 1>:8000`.
pub fn address(i: usize) -> String {
    format!("10.0.{}.{}:8000", i / 250, i % 250 + 1)
}

pub fn adapter_name(i: u16) -> String {
    format!("lora-{i}")
}

/// The tier example shipped in the repository (its `priority`, `saturation` and `flow_control`
/// sections are `ours-tiers`' configuration).
const TIER_EXAMPLE: &str = include_str!("../../../filter-config/examples/priority-tiers.json");

/// The configuration document for a Scheduler-based policy over `servers` endpoints, polled every
/// `poll_ms`. `ours` is the document with only endpoints and models (plus `poller.interval_ms`
/// when `poll_ms` is not the default 200), so it parses to the shipped defaults. For ours'
/// variants, `ours_overrides` (a JSON object of top-level sections, e.g.
/// `{"scheduler": {...}, "saturation": {...}}`) replaces those sections: the way to measure a
/// proposed default (`--ours-scheduler`, `--ours-config`); the report prints it when set.
pub fn config(
    policy: Policy,
    servers: usize,
    adapters: u16,
    poll_ms: u64,
    ours_overrides: Option<&serde_json::Value>,
) -> Result<Config, String> {
    config_with(policy, servers, adapters, poll_ms, ours_overrides, None)
}

/// [`config`] with the SLO study's tier targets (`ours-slo` needs them: its
/// `priority.tier.slo`).
pub fn config_with(
    policy: Policy,
    servers: usize,
    adapters: u16,
    poll_ms: u64,
    ours_overrides: Option<&serde_json::Value>,
    slo: Option<&crate::slo_policy::SloTargets>,
) -> Result<Config, String> {
    let endpoints: Vec<serde_json::Value> =
        (0..servers).map(|i| json!({"address": address(i), "models": [MODEL]})).collect();
    let adapter_names: Vec<String> = (0..adapters).map(adapter_name).collect();
    let mut doc = json!({
        "version": 1,
        "endpoints": endpoints,
        "models": [{"name": MODEL, "adapters": adapter_names}],
    });
    let Some(d) = doc.as_object_mut() else { return Err("config document".into()) };
    if poll_ms != 200 {
        // Stale after 5 poll intervals (at least the default 1 s), so that a slow poll interval
        // in a sensitivity run does not make every endpoint stale.
        d.insert("poller".into(), json!({"interval_ms": poll_ms, "stale_after_ms": (5 * poll_ms).max(1000)}));
    }
    let gie = |weights: serde_json::Value| {
        json!({
            "objective": "weighted",
            "weights": weights,
            "prefix": {
                "block_chars": 64,
                "max_blocks": 256,
                "index_blocks": 31_250,
                "chars_per_token": 4,
                "index_blocks_total": (31_250 * servers).min(1 << 24),
                "shared_shards": 0,
            },
            "guard": {"abs_gap": 1e15, "ratio": 1.0},
        })
    };
    match policy {
        Policy::Ours | Policy::OursPerfectState => {}
        Policy::OursFlow => {
            d.insert(
                "priority".into(),
                json!({
                    "objectives": [
                        {"name": "premium", "priority": 10},
                        {"name": "standard", "priority": 0},
                        {"name": "sheddable", "priority": -10},
                    ],
                    "trust_objective_header": true,
                }),
            );
            d.insert("flow_control".into(), json!({"enabled": true}));
        }
        Policy::OursTiers | Policy::OursSlo => {
            let ex: serde_json::Value =
                serde_json::from_str(TIER_EXAMPLE).map_err(|e| format!("tier example: {e}"))?;
            for k in ["priority", "saturation", "flow_control"] {
                if let Some(v) = ex.get(k) {
                    d.insert(k.into(), v.clone());
                }
            }
            if policy == Policy::OursSlo {
                let t = slo.ok_or("ours-slo needs the tiers' targets (the SLO study, --slo)")?;
                let tier = d
                    .get_mut("priority")
                    .and_then(|p| p.get_mut("tier"))
                    .and_then(|t| t.as_object_mut())
                    .ok_or("tier example: no priority.tier")?;
                tier.insert("slo".into(), t.tier_slo_json());
            }
        }
        Policy::LlmDSlo => {
            // Ours' predictor as the latency predictor: the default scheduler with every
            // candidate's prediction in the debug scores (`crate::slo_policy::parse_debug`). One central
            // EPP: no cross-worker table.
            d.insert("scheduler".into(), json!({"debug_scores": true, "prefix": {"shared_shards": 0}}));
        }
        Policy::GieDefault | Policy::GieDefaultLora => {
            let lora = if policy == Policy::GieDefaultLora { 2.0 } else { 0.0 };
            d.insert(
                "scheduler".into(),
                gie(json!({"prefix": 3.0, "queue": 2.0, "kv_cache": 2.0, "inflight": 0.0, "session": 0.0, "lora": lora})),
            );
        }
        Policy::Gie111 => {
            d.insert(
                "scheduler".into(),
                gie(json!({"prefix": 1.0, "queue": 1.0, "kv_cache": 1.0, "inflight": 0.0, "session": 0.0, "lora": 0.0})),
            );
        }
        Policy::LoadOnly => {
            d.insert(
                "scheduler".into(),
                json!({
                    "objective": "weighted",
                    "weights": {"prefix": 0.0, "queue": 1.0, "kv_cache": 1.0, "inflight": 0.0, "session": 0.0, "lora": 0.0},
                    "prefix": {"shared_shards": 0},
                    "guard": {"abs_gap": 1e15, "ratio": 1.0},
                }),
            );
        }
        _ => return Err(format!("{} does not use the Scheduler", policy.name())),
    }
    if let (true, Some(serde_json::Value::Object(o))) = (policy.is_ours(), ours_overrides) {
        for (k, v) in o {
            d.insert(k.clone(), v.clone());
        }
    }
    let bytes = serde_json::to_vec(&doc).map_err(|e| e.to_string())?;
    Config::from_json(&bytes).map_err(|errs| inference_picker::base::json::describe_errors(&errs))
}

/// The tier label of a trace request as the header a policy's configuration reads:
/// (header name, value).
pub fn tier_header(policy: Policy, tier: &str) -> (&'static str, String) {
    match policy {
        Policy::OursTiers | Policy::OursSlo => {
            ("x-llm-tier", if tier == "sheddable" { "free".into() } else { tier.into() })
        }
        _ => (inference_picker::flow::priority::OBJECTIVE_HEADER, tier.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_validate_and_gie_matches_its_profile() {
        // ours-slo needs the SLO core and the study's targets (`ours_slo_carries_the_targets`).
        for p in Policy::ALL.into_iter().filter(|p| p.uses_scheduler() && *p != Policy::OursSlo) {
            config(p, 8, 3, 200, None).unwrap_or_else(|e| panic!("{}: {e}", p.name()));
        }
        let g = config(Policy::GieDefault, 8, 0, 50, None).unwrap();
        let s = &g.scheduler;
        assert_eq!((s.weights.prefix, s.weights.queue, s.weights.kv_cache), (3.0, 2.0, 2.0));
        assert_eq!((s.weights.inflight, s.weights.session, s.weights.lora), (0.0, 0.0, 0.0));
        assert_eq!((s.prefix.block_chars, s.prefix.max_blocks, s.prefix.index_blocks), (64, 256, 31_250));
        assert_eq!((s.prefix.shared_shards, s.prefix.chars_per_token), (0, 4));
        assert_eq!(g.poller.interval_ms, 50);
        // GIE's autoTune: 25,000 blocks × 16 tokens ÷ 16 tokens per hashed block.
        let m = inference_picker::state::metrics::EndpointMetrics {
            num_gpu_blocks: Some(25_000),
            block_size: Some(16),
            ..Default::default()
        };
        assert_eq!(inference_picker::scheduler::prefix::capacity(&s.prefix, Some(&m), 8), 25_000);
        assert_eq!(Policy::GieDefault.default_refresh_ms(), 50);
        assert!(config(Policy::Random, 8, 0, 200, None).is_err());
        assert_eq!(Policy::parse("least-request"), Ok(Policy::LeastRequest));
        assert!(Policy::parse("nope").unwrap_err().contains("round-robin"));
    }

    #[test]
    fn ours_slo_carries_the_targets_and_llm_d_reads_every_prediction() {
        let err = config(Policy::OursSlo, 8, 0, 200, None).unwrap_err();
        assert!(err.contains("targets"), "{err}");
        let t = crate::slo_policy::SloTargets { premium_ms: 500, standard_ms: 2000, sheddable_ms: 4000 };
        // With the SLO core the document parses; without it, the error names the new field.
        match config_with(Policy::OursSlo, 8, 0, 200, None, Some(&t)) {
            Ok(c) => assert!(c.flow_control.enabled),
            Err(e) => assert!(e.contains("slo"), "{e}"),
        }
        assert_eq!(
            crate::slo::core_available().is_ok(),
            config_with(Policy::OursSlo, 8, 0, 200, None, Some(&t)).is_ok()
        );
        let l = config(Policy::LlmDSlo, 8, 0, 50, None).unwrap();
        assert!(l.scheduler.debug_scores);
        assert_eq!(l.scheduler.prefix.shared_shards, 0);
        assert!(!l.flow_control.enabled);
        assert!(Policy::LlmDSlo.central() && !Policy::LlmDSlo.uses_flow_control());
        assert_eq!(tier_header(Policy::OursSlo, "sheddable"), ("x-llm-tier", "free".to_string()));
    }

    #[test]
    fn ours_is_exactly_the_shipped_default() {
        // A document with only endpoints and models, as a user would write it.
        let endpoints: Vec<serde_json::Value> =
            (0..8).map(|i| json!({"address": address(i), "models": [MODEL]})).collect();
        let doc = json!({"version": 1, "endpoints": endpoints, "models": [{"name": MODEL, "adapters": []}]});
        let shipped = Config::from_json(&serde_json::to_vec(&doc).unwrap()).unwrap();
        let ours = config(Policy::Ours, 8, 0, 200, None).unwrap();
        assert_eq!(ours, shipped);
        assert!(!ours.flow_control.enabled, "flow control is off by default");
        assert!(config(Policy::OursFlow, 8, 0, 200, None).unwrap().flow_control.enabled);
        let tiers = config(Policy::OursTiers, 8, 0, 200, None).unwrap();
        assert!(tiers.flow_control.enabled);
        assert_eq!(tier_header(Policy::OursTiers, "sheddable"), ("x-llm-tier", "free".to_string()));
    }
}
