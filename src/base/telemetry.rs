//! Names of the filter's own Prometheus metrics (pure; the host defines and updates them).
//!
//! proxy-wasm metrics have no labels in the ABI, so labels travel in the name:
//! `inference_picker_requests_total;model=M;endpoint=E;outcome=O`. Envoy's
//! `stats_config.stats_tags` (see envoy/envoy.yaml) extracts each `;key=value` into a tag, and
//! `/stats/prometheus` shows `inference_picker_requests_total{model="M",endpoint="E",outcome="O"}`.
//! Characters that would break that syntax (`;`, `=`) are replaced in values.
//!
//! The set of names is bounded: models come from the configuration, outcomes and reasons are
//! fixed codes. Endpoint addresses are NOT bounded (pods come and go, and Envoy never deletes a
//! stat), so the `endpoint` tag is only added when `filter.endpoint_metrics` is on
//! ([`endpoint_tag`]); by default no metric name carries an address. The host's per-VM cache of
//! metric ids is bounded too ([`MAX_METRIC_NAMES`]).

/// Requests routed, by model (as sent upstream), endpoint and outcome (`scored`,
/// `session_token`, `fail_open`).
pub const REQUESTS: &str = "inference_picker_requests_total";
/// Requests routed with the `pd` section, by split decision (`crate::request::pd::Decision`: `split`,
/// `below_threshold`, `no_prefill_pods`, `no_healthy_prefill`, `prefill_busy`, `fail_open`).
pub const PD_DECISIONS: &str = "inference_picker_pd_decisions_total";
/// Requests answered by the filter itself, by reason (the error `code`).
pub const REJECTIONS: &str = "inference_picker_rejections_total";
/// Age of the snapshot the last decision used, in milliseconds.
pub const SNAPSHOT_AGE: &str = "inference_picker_snapshot_age_ms";
/// Requests in flight per endpoint, across all workers (the shared count).
pub const ENDPOINT_INFLIGHT: &str = "inference_picker_endpoint_inflight";

/// Prompt tokens the model servers reported in their responses (`crate::request::usage`), by
/// model (as sent upstream) and tenant ([`BoundedLabels`]).
pub const PROMPT_TOKENS: &str = "inference_picker_prompt_tokens_total";
/// Completion tokens the model servers reported, by model and tenant.
pub const COMPLETION_TOKENS: &str = "inference_picker_completion_tokens_total";
/// Routed 2xx responses whose usage was read, by `outcome` (`counted`, `missing`, `too_large`,
/// `malformed`, `encoded`: `crate::request::usage::Outcome`).
pub const USAGE_RESPONSES: &str = "inference_picker_usage_responses_total";
/// The `tenant` label of a request without a trusted tenant (GIE's default flow).
pub const NO_TENANT: &str = "default-flow";
/// The `tenant` label of the tenants past [`MAX_TENANT_LABELS`].
pub const OTHER_TENANT: &str = "other";
/// Most distinct tenants one VM names in a label; the later ones share [`OTHER_TENANT`].
pub const MAX_TENANT_LABELS: usize = 64;

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

/// Requests with a TTFT target, by `class` (objective, else tier, else `default`) and
/// `outcome`: `met` / `missed` (TTFT measured at the proxy, request sent to the first byte of a
/// streamed response), `shed` (429 `slo_unattainable`), `unmeasured` (a non-streamed response,
/// whose first byte comes after the whole generation, or a split P/D request).
pub const SLO_REQUESTS: &str = "inference_picker_slo_requests_total";
/// Histogram of predicted ÷ actual TTFT in per cent (100: exact), per model, for every streamed
/// response whose pick had a prediction.
pub const TTFT_PREDICTION_RATIO: &str = "inference_picker_ttft_prediction_ratio_pct";
/// Histogram of the TTFT measured at the proxy, in ms, per model (streamed responses).
pub const TTFT_MS: &str = "inference_picker_ttft_ms";

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
/// Gauge: the linear memory of every filter VM of this Envoy, summed, in bytes. Wasm memory
/// only grows, so this is each VM's high-water mark: it shows what the module keeps, apart from
/// Envoy's own buffers.
pub const VM_MEMORY: &str = "inference_picker_vm_memory_bytes";
/// Poller scrapes that failed, by `reason`: `dispatch` (Envoy refused to start the call: the
/// cluster is unknown, BadArgument), `transport` (reset, connect failure, timeout), `status`
/// (not 200), `not_utf8`, `metrics` (no routing metric found), `too_large` (over
/// `poller.max_response_bytes`), `lost` (no callback within the timeout).
pub const SCRAPE_FAILURES: &str = "inference_picker_scrape_failures_total";
/// `peers`: sends of prefix records to another replica that failed (Envoy refused the call,
/// or the peer did not answer 204).
pub const PEER_SEND_FAILURES: &str = "inference_picker_peer_send_failures_total";
/// `peers`: prefix records received from other replicas and applied, by `outcome`: `applied`
/// (records in accepted batches), `refused` (batches refused whole: bad body or over the cap).
pub const PEER_RECORDS: &str = "inference_picker_peer_records_total";
/// Peer placements received (`crate::poll::peers::decode_placements`), by `outcome` (`applied`,
/// `own`, `skipped`: another build's batch, `refused`: malformed, one per batch).
pub const PEER_PLACEMENTS: &str = "inference_picker_peer_placements_total";
/// Gauge set by the poller at each publish: endpoints whose last scrape succeeded (GIE's
/// `inference_pool_ready_pods` to its EPP). Below the pool's size, some pods are unreachable or lying.
/// Shared-data records and peer messages of a version this build does not read (another build's,
/// during a rolling upgrade), skipped by reason = the record (`crate::base::codec`); also the
/// load reports of older replicas (`peer_load`: a message this build no longer reads).
pub const RECORDS_SKIPPED: &str = "inference_picker_records_skipped_total";
pub const READY_ENDPOINTS: &str = "inference_picker_ready_endpoints";
/// Kubernetes pod-list calls that failed, by `reason`: `dispatch`, `status`, `bad_body`,
/// `too_large`.
pub const DISCOVERY_FAILURES: &str = "inference_picker_discovery_failures_total";
/// `pod_models`: pod model-list fetches that failed, by `reason`: `dispatch`, `transport`,
/// `status`, `too_large`, `parse` (see `crate::poll::pod_models::ModelsError`).
pub const MODEL_LIST_FAILURES: &str = "inference_picker_model_list_failures_total";

/// The active configuration of the HTTP filter (gauge): its version, `crate::config::live::digest`
/// of the document, also logged when it becomes active.
pub const CONFIG_VERSION: &str = "inference_picker_config_version";
/// The configuration the singleton poller runs (gauge), same digest: equal to
/// `inference_picker_config_version` once the poller followed a change.
pub const POLLER_CONFIG_VERSION: &str = "inference_picker_poller_config_version";

/// Body-based routing: requests this pool's filter passed on to the next pool's (a model it does
/// not serve).
pub const POOL_PASSED_ON: &str = "inference_picker_pool_passed_on_total";
/// Body-based routing: requests this pool's filter took with the body an earlier pool's filter
/// had parsed (not parsed again).
pub const POOL_PARSE_REUSED: &str = "inference_picker_pool_parse_reused_total";

/// Most distinct metric names one VM defines. Past it, new names are not defined (and not
/// updated): the names already defined keep working, and the host logs once. With
/// `filter.endpoint_metrics` off the names are bounded far below this by the configuration.
pub const MAX_METRIC_NAMES: usize = 4096;

/// How often, at most, one cause of a run-time error is logged, in ms.
pub const ERROR_LOG_EVERY_MS: u64 = 10_000;

/// The `endpoint` tag, or nothing when per-endpoint metrics are off (the default: addresses are
/// unbounded while pods churn).
pub fn endpoint_tag(enabled: bool, address: &str) -> Option<(&'static str, &str)> {
    enabled.then_some(("endpoint", address))
}

/// Rate limit for error logs: at most one line per cause every `every_ms`, with the number of
/// occurrences swallowed since the last line. Bounded: at most [`MAX_LOG_CAUSES`] causes are
/// tracked; beyond that, new causes share one slot.
#[derive(Debug)]
pub struct LogLimiter {
    every_ms: u64,
    causes: Vec<(String, u64, u64)>,
}

/// Most distinct causes a [`LogLimiter`] tracks.
pub const MAX_LOG_CAUSES: usize = 64;

impl LogLimiter {
    pub fn new(every_ms: u64) -> Self {
        Self { every_ms, causes: Vec::new() }
    }

    /// `Some(suppressed)` when `cause` should be logged now (`suppressed` occurrences were
    /// swallowed since its last line), `None` when it was logged less than `every_ms` ago.
    pub fn allow(&mut self, cause: &str, now_ms: u64) -> Option<u64> {
        let i = match self.causes.iter().position(|(c, _, _)| c == cause) {
            Some(i) => i,
            None if self.causes.len() < MAX_LOG_CAUSES => {
                self.causes.push((cause.to_string(), now_ms, 0));
                return Some(0);
            }
            None => self.causes.len() - 1,
        };
        let entry = self.causes.get_mut(i)?;
        if now_ms.saturating_sub(entry.1) >= self.every_ms {
            let suppressed = entry.2;
            entry.1 = now_ms;
            entry.2 = 0;
            Some(suppressed)
        } else {
            entry.2 = entry.2.saturating_add(1);
            None
        }
    }
}

/// The tag names the Envoy config must extract.
pub const TAGS: [&str; 8] = ["pool", "model", "endpoint", "outcome", "reason", "priority", "tenant", "class"];

/// Values of a label that comes from requests (the tenant), bounded: the first `max` distinct
/// values keep their own label, every later one gets `overflow`. Envoy never deletes a stat, so
/// without the bound every tenant ever seen would stay a metric name.
#[derive(Debug)]
pub struct BoundedLabels {
    max: usize,
    overflow: &'static str,
    seen: Vec<String>,
}

impl BoundedLabels {
    pub fn new(max: usize, overflow: &'static str) -> Self {
        Self { max, overflow, seen: Vec::new() }
    }

    /// The label for `value`: itself while there is room or when already seen, else `overflow`.
    pub fn label<'a>(&mut self, value: &'a str) -> &'a str {
        if self.seen.iter().any(|s| s == value) {
            return value;
        }
        if self.seen.len() < self.max {
            self.seen.push(value.to_string());
            return value;
        }
        self.overflow
    }
}

/// Builds `base;k=v;k=v`.
pub fn name(base: &str, tags: &[(&str, &str)]) -> String {
    let mut out = String::with_capacity(base.len() + tags.len() * 24);
    name_into(&mut out, base, tags);
    out
}

/// [`name`] written into `out` (cleared first), so a caller can reuse one buffer.
pub fn name_into(out: &mut String, base: &str, tags: &[(&str, &str)]) {
    out.clear();
    out.push_str(base);
    for (k, v) in tags {
        out.push(';');
        out.push_str(k);
        out.push('=');
        out.extend(v.chars().map(|c| if c == ';' || c == '=' { '_' } else { c }));
    }
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

    #[test]
    fn endpoint_tag_only_when_enabled() {
        let tags: Vec<_> =
            [Some(("model", "m")), endpoint_tag(false, "10.0.0.1:8000")].into_iter().flatten().collect();
        assert_eq!(name(REQUESTS, &tags), "inference_picker_requests_total;model=m");
        let tags: Vec<_> =
            [Some(("model", "m")), endpoint_tag(true, "10.0.0.1:8000")].into_iter().flatten().collect();
        assert_eq!(name(REQUESTS, &tags), "inference_picker_requests_total;model=m;endpoint=10.0.0.1:8000");
    }

    #[test]
    fn bounded_labels_keep_the_first_values_and_pool_the_rest() {
        let mut l = BoundedLabels::new(2, OTHER_TENANT);
        assert_eq!(l.label("a"), "a");
        assert_eq!(l.label("b"), "b");
        assert_eq!(l.label("c"), "other");
        // Values seen before keep their label; the set stays at its bound.
        assert_eq!((l.label("a"), l.label("b"), l.label("d")), ("a", "b", "other"));
        assert_eq!(l.seen.len(), 2);
    }

    #[test]
    fn log_limiter_logs_once_per_period_per_cause_and_counts_the_rest() {
        let mut l = LogLimiter::new(1000);
        assert_eq!(l.allow("dispatch", 0), Some(0));
        assert_eq!(l.allow("dispatch", 10), None);
        assert_eq!(l.allow("dispatch", 999), None);
        // Another cause is not held back by the first.
        assert_eq!(l.allow("status", 20), Some(0));
        assert_eq!(l.allow("dispatch", 1000), Some(2));
        assert_eq!(l.allow("dispatch", 1001), None);
        // Causes are bounded: the overflow shares the last slot.
        for i in 0..(2 * MAX_LOG_CAUSES) {
            l.allow(&format!("c{i}"), 5000);
        }
        assert_eq!(l.causes.len(), MAX_LOG_CAUSES);
    }
}
