//! The `flow_control` section.

use serde::Serialize;

use crate::base::json::{self, ConfigError};

/// Smallest `flow_control.worker_ttl_ms`: heartbeats come from ticks, every `ttl / 3`.
pub const MIN_WORKER_TTL_MS: u64 = 300;

/// Holding requests inside the proxy while their model's endpoints are saturated, and releasing
/// them in priority order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct FlowControlConfig {
    /// Hold requests while saturated. Default false, as GIE: the replay benchmark
    /// (tools/replay-bench/FINDINGS.md) showed holding costs latency and throughput on workloads
    /// where every request has the same priority; turn it on where tiers or criticality differ.
    /// When false nothing is held: while saturated, sheddable requests get 429 and the rest go
    /// straight to the scheduler.
    #[serde(default = "default_enabled")]
    pub enabled: bool,
    /// Longest a request is held before 503, in ms; at least 1. Default 30000.
    #[serde(default = "default_max_wait_ms")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1)))]
    pub max_wait_ms: u64,
    /// Most requests held per model over all workers before 429; at least 1. Default 1024.
    #[serde(default = "default_max_queue")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1)))]
    pub max_queue: u32,
    /// `retry-after` seconds on 429 and 503 from flow control. Default 1.
    #[serde(default = "default_retry_after_s")]
    pub retry_after_s: u32,
    /// A worker whose heartbeat is older than this, in ms, no longer counts; at least 300.
    /// Default 2000. The filter's tick period must be well below a third of it.
    #[serde(default = "default_worker_ttl_ms")]
    #[cfg_attr(feature = "schema", schemars(range(min = MIN_WORKER_TTL_MS)))]
    pub worker_ttl_ms: u64,
    /// Headroom kept for high priorities: requests below `min_priority` are held once every
    /// endpoint is loaded to `1 - fraction` of the saturation thresholds, so that requests at or
    /// above it still find room. Default null (none).
    #[serde(default)]
    pub reserve: Option<ReserveConfig>,
}

/// `flow_control.reserve`: see [`FlowControlConfig::reserve`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ReserveConfig {
    /// Requests of this priority or higher may use the reserved headroom.
    pub min_priority: i32,
    /// Share of each saturation threshold (`queue_threshold`, `kv_threshold`,
    /// `max_inflight_per_endpoint`) kept for them, in (0, 1).
    #[cfg_attr(feature = "schema", schemars(range(min = 0.0, max = 1.0)))]
    pub fraction: f64,
}

impl Eq for ReserveConfig {}

// The readers of this file's configuration types (`crate::base::json`), fields in declaration
// order.
json::from_json_struct!(FlowControlConfig {
    enabled = default_enabled(),
    max_wait_ms = default_max_wait_ms(),
    max_queue = default_max_queue(),
    retry_after_s = default_retry_after_s(),
    worker_ttl_ms = default_worker_ttl_ms(),
    reserve = None,
});
json::from_json_struct!(ReserveConfig { min_priority, fraction });

fn default_enabled() -> bool {
    false
}
fn default_max_wait_ms() -> u64 {
    30_000
}
fn default_max_queue() -> u32 {
    1024
}
fn default_retry_after_s() -> u32 {
    1
}
fn default_worker_ttl_ms() -> u64 {
    2_000
}

impl Default for FlowControlConfig {
    fn default() -> Self {
        Self {
            enabled: default_enabled(),
            max_wait_ms: default_max_wait_ms(),
            max_queue: default_max_queue(),
            retry_after_s: default_retry_after_s(),
            worker_ttl_ms: default_worker_ttl_ms(),
            reserve: None,
        }
    }
}

impl FlowControlConfig {
    /// Appends every problem to `errs`, with paths under `path` (e.g. `flow_control`).
    pub fn validate(&self, path: &str, errs: &mut Vec<ConfigError>) {
        if self.max_wait_ms == 0 {
            errs.push(ConfigError { path: format!("{path}.max_wait_ms"), reason: "must be > 0".into() });
        }
        if self.max_queue == 0 {
            errs.push(ConfigError {
                path: format!("{path}.max_queue"),
                reason: "must be > 0 (set enabled: false to hold nothing)".into(),
            });
        }
        if let Some(r) = &self.reserve {
            if !(r.fraction > 0.0 && r.fraction < 1.0) {
                errs.push(ConfigError {
                    path: format!("{path}.reserve.fraction"),
                    reason: format!("must be > 0 and < 1, got {}", r.fraction),
                });
            }
        }
        if self.worker_ttl_ms < MIN_WORKER_TTL_MS {
            errs.push(ConfigError {
                path: format!("{path}.worker_ttl_ms"),
                reason: format!(
                    "must be at least {MIN_WORKER_TTL_MS}, got {}: heartbeats come from ticks",
                    self.worker_ttl_ms
                ),
            });
        }
    }
}
