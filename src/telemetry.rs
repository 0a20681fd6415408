//! Names of the filter's own Prometheus metrics (pure; the host defines and updates them).
//!
//! proxy-wasm metrics have no labels in the ABI, so labels travel in the name:
//! `inference_picker_requests_total;model=M;endpoint=E;outcome=O`. Envoy's
//! `stats_config.stats_tags` (see envoy/envoy.yaml) extracts each `;key=value` into a tag, and
//! `/stats/prometheus` shows `inference_picker_requests_total{model="M",endpoint="E",outcome="O"}`.
//! Characters that would break that syntax (`;`, `=`) are replaced in values.
//!
//! The set of names is bounded: models and endpoints come from the configuration and the
//! snapshot, outcomes and reasons are fixed codes.

/// Requests routed, by model (as sent upstream), endpoint and outcome (`scored`,
/// `session_token`, `fail_open`).
pub const REQUESTS: &str = "inference_picker_requests_total";
/// Requests answered by the filter itself, by reason (the error `code`).
pub const REJECTIONS: &str = "inference_picker_rejections_total";
/// Age of the snapshot the last decision used, in milliseconds.
pub const SNAPSHOT_AGE: &str = "inference_picker_snapshot_age_ms";
/// Requests in flight per endpoint, across all workers (the shared count).
pub const ENDPOINT_INFLIGHT: &str = "inference_picker_endpoint_inflight";

/// Flow control, per priority and outcome: `passed` (went on without waiting), `held`,
/// `released` (went on after waiting), `timed_out` (503 after `max_wait_ms`), `shed` (429,
/// sheddable while saturated), `queue_full` (429, refused or evicted), `cancelled` (the client
/// went away while held), `fail_open` (flow control skipped: every endpoint stale).
pub const FLOW_REQUESTS: &str = "inference_picker_flow_requests_total";
/// Total milliseconds held, per priority, summed over the requests that left the queue (any
/// way). With `held`, gives the mean time queued.
pub const FLOW_QUEUED_MS: &str = "inference_picker_flow_queued_ms_total";
/// Requests held right now, per priority, over all workers (each worker adds and subtracts its
/// own; Envoy keeps one gauge per name).
pub const FLOW_WAITING: &str = "inference_picker_flow_waiting";
/// Histogram of the time, in ms, that released and timed-out requests were held, per priority.
pub const FLOW_QUEUE_TIME: &str = "inference_picker_flow_queue_time_ms";

/// Passive health: endpoints ejected from picking, by endpoint and reason
/// (`consecutive_5xx`, `consecutive_gateway_failure`, `failure_rate`, `probation`); counted by
/// the worker that decided the ejection.
pub const HEALTH_EJECTIONS: &str = "inference_picker_health_ejections_total";
/// Upstream results passive health recorded, by outcome (`success`, `failure`,
/// `gateway_failure`, `load`).
pub const HEALTH_RESULTS: &str = "inference_picker_health_results_total";
/// Requests held because the proxy had no metrics yet (just started), by how they left:
/// `held` (on arrival), `released` (metrics arrived), `expired` (the wait ran out).
pub const STARTUP_REQUESTS: &str = "inference_picker_startup_requests_total";

/// The tag names the Envoy config must extract.
pub const TAGS: [&str; 5] = ["model", "endpoint", "outcome", "reason", "priority"];

/// Builds `base;k=v;k=v`.
pub fn name(base: &str, tags: &[(&str, &str)]) -> String {
    let mut out = String::with_capacity(base.len() + tags.len() * 24);
    out.push_str(base);
    for (k, v) in tags {
        out.push(';');
        out.push_str(k);
        out.push('=');
        out.extend(v.chars().map(|c| if c == ';' || c == '=' { '_' } else { c }));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_tags_and_sanitise_values() {
        assert_eq!(
            name(REQUESTS, &[("model", "meta-llama/Llama-3.1-8B"), ("endpoint", "10.0.0.1:8000")]),
            "inference_picker_requests_total;model=meta-llama/Llama-3.1-8B;endpoint=10.0.0.1:8000"
        );
        assert_eq!(
            name(REJECTIONS, &[("reason", "a;b=c")]),
            "inference_picker_rejections_total;reason=a_b_c"
        );
        assert_eq!(name(SNAPSHOT_AGE, &[]), SNAPSHOT_AGE);
    }
}
