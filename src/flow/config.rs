//! The `flow_control` section.

use crate::base::json::ConfigError;
use crate::base::settings::settings;

/// Smallest `flow_control.worker_ttl_ms`: heartbeats come from ticks, every `ttl / 3`.
pub const MIN_WORKER_TTL_MS: u64 = 300;

settings! {
    /// Holding requests inside the proxy while their model's endpoints are saturated, and releasing
    /// them in priority order.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct FlowControlConfig {
        /// Hold requests while saturated. Default false, as GIE: the replay benchmark
        /// (tools/replay-bench/FINDINGS.md) showed holding costs latency and throughput on workloads
        /// where every request has the same priority; turn it on where tiers or criticality differ.
        /// When false nothing is held: while saturated, sheddable requests get 429 and the rest go
        /// straight to the scheduler.
        pub enabled: bool = false,
        /// Longest a request is held before 503, in ms; at least 1. Default 30000.
        #[range(min = 1)]
        #[reason = "must be > 0"]
        pub max_wait_ms: u64 = 30_000,
        /// Most requests held per model over all workers before 429; at least 1. Default 1024.
        #[range(min = 1)]
        #[reason = "must be > 0 (set enabled: false to hold nothing)"]
        pub max_queue: u32 = 1024,
        /// `retry-after` seconds on 429 and 503 from flow control. Default 1.
        pub retry_after_s: u32 = 1,
        /// A worker whose heartbeat is older than this, in ms, no longer counts; at least 300.
        /// Default 2000. The filter's tick period must be well below a third of it.
        #[range(min = MIN_WORKER_TTL_MS)]
        #[reason = "must be at least {min}, got {v}: heartbeats come from ticks"]
        pub worker_ttl_ms: u64 = 2_000,
        /// Headroom kept for high priorities: requests below `min_priority` are held once every
        /// endpoint is loaded to `1 - fraction` of the saturation thresholds, so that requests at or
        /// above it still find room. Default null (none).
        pub reserve: Option<ReserveConfig> = None,
    }
}

settings! {
    /// `flow_control.reserve`: see [`FlowControlConfig::reserve`].
    #[derive(Debug, Clone, Copy, PartialEq)]
    pub struct ReserveConfig {
        /// Requests of this priority or higher may use the reserved headroom.
        pub min_priority: i32,
        /// Share of each saturation threshold (`queue_threshold`, `kv_threshold`,
        /// `max_inflight_per_endpoint`) kept for them, in (0, 1).
        #[schema(range(min = 0.0, max = 1.0))]
        pub fraction: f64,
    }
}

impl Eq for ReserveConfig {}

impl FlowControlConfig {
    /// Appends every problem to `errs`, with paths under `path` (e.g. `flow_control`).
    pub fn validate(&self, path: &str, errs: &mut Vec<ConfigError>) {
        self.validate_fields(path, errs, |errs| {
            if let Some(r) = &self.reserve {
                if !(r.fraction > 0.0 && r.fraction < 1.0) {
                    errs.push(ConfigError {
                        path: format!("{path}.reserve.fraction"),
                        reason: format!("must be > 0 and < 1, got {}", r.fraction),
                    });
                }
            }
        });
    }
}
