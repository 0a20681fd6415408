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

/// The tag names the Envoy config must extract.
pub const TAGS: [&str; 4] = ["model", "endpoint", "outcome", "reason"];

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
