//! The routing strategies compared, each fed the same stale snapshots and in-flight counts.
//!
//! | name | what | state |
//! |---|---|---|
//! | `ours` | `inference_picker::scheduler::Scheduler` with the default configuration, behind the priority and flow-control core with `flow_control.enabled: true` (holds requests while saturated, as a deployment with SLA tiers runs it) | per worker (+ the replica's shared prefix table, in-flight counts and flow record) |
//! | `ours-noflow` | `ours` with `flow_control.enabled: false` (nothing held; sheddable requests still get 429 while saturated): the shipped default | same |
//! | `gie-default` | the same Scheduler configured as GIE's default profile (below) | per worker, nothing shared |
//! | `gie-default+lora` | `gie-default` plus GIE's `lora-affinity-scorer` (weight 2), for LoRA workloads | per worker |
//! | `gie-1-1-1` | `gie-default` with GIE's earlier weights prefix 1, queue 1, KV 1: the configuration of llm-d's published "estimated-scheduling" run | per worker |
//! | `load-only` | llm-d's "load-scheduling" profile: queue 1 + KV 1, no prefix | per worker |
//! | `sglang` | SGLang's cache-aware policy (`crate::sglang`) | per replica (one router process) |
//! | `least-request` | Envoy `LEAST_REQUEST`: power of two random choices on the replica's in-flight counts | per replica counts |
//! | `round-robin` | a Kubernetes Service / Envoy `ROUND_ROBIN`: each worker cycles from a random start | per worker |
//! | `random` | uniform | none |
//!
//! **GIE's default, through our Scheduler.** GIE's default scheduling profile is prefix 3,
//! queue 2, KV 2, max-score picker with a random tie-break. Our Scheduler reproduces it with
//! weights prefix 3, queue 2, kv_cache 2 and 0 for in-flight, session and LoRA; the queue
//! (min-max) and KV (1 − usage) scorers are GIE's formulas. GIE's prefix plugin
//! (`hashBlockSize` 64, `maxPrefixBlocksToMatch` 256, `lruCapacityPerServer` 31,250): block_chars
//! 64, max_blocks 256, index_blocks 31,250 per endpoint, and the endpoints' `cache_config_info`
//! is removed from this strategy's snapshot view so that the index is not resized from it (GIE's
//! LRU size is fixed). No cross-worker table (shared_shards 0) and no hot-spot guard (abs_gap
//! 1e15). Remaining differences: our per-endpoint index is a two-generation approximation of an
//! LRU (holds between half and all of its capacity), where GIE's is an exact LRU; GIE hashes its
//! own serialisation of the messages where we hash `body::ParsedRequest::prompt` — both are
//! deterministic functions of the message text, so shared prefixes are found alike.

use serde_json::json;

use inference_picker::config::Config;

/// Base model name of the simulated pool.
pub const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Policy {
    Ours,
    OursNoFlow,
    GieDefault,
    GieDefaultLora,
    Gie111,
    LoadOnly,
    Sglang,
    LeastRequest,
    RoundRobin,
    Random,
}

impl Policy {
    pub const ALL: [Policy; 10] = [
        Policy::Ours,
        Policy::OursNoFlow,
        Policy::GieDefault,
        Policy::GieDefaultLora,
        Policy::Gie111,
        Policy::LoadOnly,
        Policy::Sglang,
        Policy::LeastRequest,
        Policy::RoundRobin,
        Policy::Random,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Policy::Ours => "ours",
            Policy::OursNoFlow => "ours-noflow",
            Policy::GieDefault => "gie-default",
            Policy::GieDefaultLora => "gie-default+lora",
            Policy::Gie111 => "gie-1-1-1",
            Policy::LoadOnly => "load-only",
            Policy::Sglang => "sglang",
            Policy::LeastRequest => "least-request",
            Policy::RoundRobin => "round-robin",
            Policy::Random => "random",
        }
    }

    pub fn parse(s: &str) -> Result<Policy, String> {
        Policy::ALL.into_iter().find(|p| p.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Policy::ALL.iter().map(|p| p.name()).collect();
            format!("unknown strategy {s:?} (known: {})", names.join(", "))
        })
    }

    /// Runs the real Scheduler (and so parses bodies with the real parser).
    pub fn uses_scheduler(self) -> bool {
        matches!(
            self,
            Policy::Ours
                | Policy::OursNoFlow
                | Policy::GieDefault
                | Policy::GieDefaultLora
                | Policy::Gie111
                | Policy::LoadOnly
        )
    }

    /// Needs the prompt text (parses the body).
    pub fn needs_prompt(self) -> bool {
        self.uses_scheduler() || self == Policy::Sglang
    }

    /// Holds requests while saturated (our `flow_control`, on by default) and sheds sheddable
    /// ones. Only ours: the baselines have no flow control (GIE's is experimental and off by
    /// default).
    pub fn uses_flow_control(self) -> bool {
        matches!(self, Policy::Ours | Policy::OursNoFlow)
    }

    /// GIE sizes its prefix LRU by configuration only: hide `cache_config_info`.
    pub fn hides_cache_info(self) -> bool {
        matches!(self, Policy::GieDefault | Policy::GieDefaultLora | Policy::Gie111)
    }
}

/// `10.0.<i / 250>.<i % 250 + 1>:8000`.
pub fn address(i: usize) -> String {
    format!("10.0.{}.{}:8000", i / 250, i % 250 + 1)
}

pub fn adapter_name(i: u16) -> String {
    format!("lora-{i}")
}

/// The configuration document for a Scheduler-based policy over `servers` endpoints. For `ours`
/// and `ours-noflow`, `ours_overrides` (a JSON object of top-level sections, e.g.
/// `{"scheduler": {...}, "saturation": {...}}`) replaces those sections: the way to measure a
/// proposed default (`--ours-scheduler`, `--ours-config`); the report prints it when set.
pub fn config(
    policy: Policy,
    servers: usize,
    adapters: u16,
    poll_ms: u64,
    ours_overrides: Option<&serde_json::Value>,
) -> Result<Config, String> {
    let endpoints: Vec<serde_json::Value> =
        (0..servers).map(|i| json!({"address": address(i), "models": [MODEL]})).collect();
    let adapter_names: Vec<String> = (0..adapters).map(adapter_name).collect();
    let scheduler = match policy {
        Policy::Ours | Policy::OursNoFlow => json!({}),
        Policy::GieDefault | Policy::GieDefaultLora | Policy::Gie111 => json!({
            "weights": if policy == Policy::Gie111 {
                json!({"prefix": 1.0, "queue": 1.0, "kv_cache": 1.0, "inflight": 0.0, "session": 0.0, "lora": 0.0})
            } else {
                json!({
                    "prefix": 3.0, "queue": 2.0, "kv_cache": 2.0, "inflight": 0.0, "session": 0.0,
                    "lora": if policy == Policy::GieDefaultLora { 2.0 } else { 0.0 },
                })
            },
            "prefix": {
                "block_chars": 64,
                "max_blocks": 256,
                "index_blocks": 31_250,
                "index_blocks_total": (31_250 * servers).min(1 << 24),
                "shared_shards": 0,
            },
            "guard": {"abs_gap": 1e15, "ratio": 1.0},
        }),
        Policy::LoadOnly => json!({
            "weights": {"prefix": 0.0, "queue": 1.0, "kv_cache": 1.0, "inflight": 0.0, "session": 0.0, "lora": 0.0},
            "prefix": {"shared_shards": 0},
            "guard": {"abs_gap": 1e15, "ratio": 1.0},
        }),
        _ => return Err(format!("{} does not use the Scheduler", policy.name())),
    };
    // Stale after 5 poll intervals (at least the default 1 s), so that a slow poll interval in
    // a sensitivity run does not make every endpoint stale.
    // SLA tiers arrive as `x-gateway-inference-objective` (set by a trusted filter in front) and
    // name these InferenceObjectives; flow control (`flow_control`, saturation) keeps its
    // defaults. Only `ours` acts on them (`Policy::uses_flow_control`).
    let doc = json!({
        "version": 1,
        "endpoints": endpoints,
        "models": [{"name": MODEL, "adapters": adapter_names}],
        "poller": {"interval_ms": poll_ms, "stale_after_ms": (5 * poll_ms).max(1000)},
        "priority": {
            "objectives": [
                {"name": "premium", "priority": 10},
                {"name": "standard", "priority": 0},
                {"name": "sheddable", "priority": -10},
            ],
            "trust_objective_header": true,
        },
        "scheduler": scheduler,
        "flow_control": {"enabled": policy != Policy::OursNoFlow},
    });
    let mut doc = doc;
    if let (true, Some(serde_json::Value::Object(o)), Some(d)) =
        (matches!(policy, Policy::Ours | Policy::OursNoFlow), ours_overrides, doc.as_object_mut())
    {
        for (k, v) in o {
            if k == "flow_control" && policy == Policy::OursNoFlow {
                // ours-noflow stays without flow control; merge the rest of the section.
                let mut v = v.clone();
                if let Some(m) = v.as_object_mut() {
                    m.insert("enabled".into(), json!(false));
                }
                d.insert(k.clone(), v);
            } else {
                d.insert(k.clone(), v.clone());
            }
        }
    }
    let bytes = serde_json::to_vec(&doc).map_err(|e| e.to_string())?;
    Config::from_json(&bytes).map_err(|errs| inference_picker::config::describe_errors(&errs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_validate_and_gie_matches_its_profile() {
        for p in Policy::ALL.into_iter().filter(|p| p.uses_scheduler()) {
            config(p, 8, 3, 200, None).unwrap_or_else(|e| panic!("{}: {e}", p.name()));
        }
        let g = config(Policy::GieDefault, 8, 0, 200, None).unwrap().scheduler;
        assert_eq!((g.weights.prefix, g.weights.queue, g.weights.kv_cache), (3.0, 2.0, 2.0));
        assert_eq!((g.weights.inflight, g.weights.session, g.weights.lora), (0.0, 0.0, 0.0));
        assert_eq!((g.prefix.block_chars, g.prefix.max_blocks, g.prefix.index_blocks), (64, 256, 31_250));
        assert_eq!((g.prefix.shared_shards, g.prefix.index_blocks_total), (0, 250_000));
        // Ours is the unmodified default.
        let o = config(Policy::Ours, 8, 0, 200, None).unwrap();
        assert_eq!(o.scheduler, inference_picker::config::SchedulerConfig::default());
        assert!(config(Policy::Random, 8, 0, 200, None).is_err());
        assert_eq!(Policy::parse("least-request"), Ok(Policy::LeastRequest));
        assert!(Policy::parse("nope").unwrap_err().contains("round-robin"));
    }
}
