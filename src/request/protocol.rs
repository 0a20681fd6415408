//! The HTTP contract of the filter: the paths it routes or answers, the headers it reads, sets
//! and removes (GIE's, Envoy's, llm-d's, the conformance suite's and its own).

/// The request header naming the prefill pod, read by llm-d's routing sidecar.
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";
/// The prefill header of older llm-d routing sidecars (a URL). The filter never sets it, and
/// removes a client-sent one.
pub const LEGACY_PREFILLER_HEADER: &str = "x-prefiller-url";

/// GIE conformance suite: the request header with the endpoints the test wants (comma-separated
/// `ip` or `ip:port`). Honoured only with `filter.conformance_mode`.
pub const CONFORMANCE_SELECTION_HEADER: &str = "test-epp-endpoint-selection";
/// GIE conformance suite: the response header naming the `ip:port` that served. Set only with
/// `filter.conformance_mode`.
pub const CONFORMANCE_SERVED_HEADER: &str = "x-conformance-test-served-endpoint";
/// Most entries read from the conformance selection header.
pub const MAX_SELECTION_ENTRIES: usize = 64;
/// Request headers a client could use to choose the destination (or, through llm-d's routing
/// sidecar, the prefill pod: `PREFILLER_HEADER`, and `x-prefiller-url`, which older
/// sidecars read) itself. Removed from every request before anything else happens; only the
/// filter sets them. The conformance test header is among them: in conformance mode the host
/// reads it first (see [`conformance_selection`]).
pub const CLIENT_ROUTING_HEADERS: [&str; 5] = [
    "x-gateway-destination-endpoint",
    "x-envoy-original-dst-host",
    CONFORMANCE_SELECTION_HEADER,
    PREFILLER_HEADER,
    LEGACY_PREFILLER_HEADER,
];

/// GIE destination header: primary first, then fallbacks.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// Envoy's router header that sets the number of retries of this request, overriding the
/// route's `num_retries`. The filter sets it to the number of fallbacks it listed: one try per
/// listed pod, never a try with no listed pod left (the `override_host` policy would then find
/// no host and Envoy would answer `503 no healthy upstream` in place of the last pod's own error).
/// Whatever a client sent is overwritten.
pub const MAX_RETRIES_HEADER: &str = "x-envoy-max-retries";
/// The header the ORIGINAL_DST cluster reads (the primary only).
pub const ORIGINAL_DST_HEADER: &str = "x-envoy-original-dst-host";
/// Response header naming the endpoint that served.
pub const SERVED_HEADER: &str = "x-gateway-destination-endpoint-served";
/// Opt-in response header with the per-endpoint scores of the decision
/// (`scheduler.debug_scores`).
pub const DEBUG_SCORES_HEADER: &str = "x-inference-picker-scores";
/// Response header with the time, in whole milliseconds, the request was held by flow control
/// before it went upstream (0 when it was not held). Also on flow-control rejections.
pub const QUEUE_MS_HEADER: &str = "x-inference-picker-queue-ms";

/// The inference paths the filter routes (POST only): OpenAI chat completions, completions,
/// responses and embeddings. Matched exactly on the path without its query (a trailing `/` is
/// ignored).
pub const INFERENCE_PATHS: [&str; 4] =
    ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"];
/// Answered locally: the pool's model list, and one model by id (`/v1/models/{id}`).
pub const MODELS_PATH: &str = "/v1/models";
/// Health checks answered locally with 200 `{"status":"ok"}`: the gateway (this filter) is up.
/// They say nothing about the pool's pods (the poller's metrics do).
pub const HEALTH_PATHS: [&str; 4] = ["/health", "/healthz", "/readyz", "/livez"];

/// True when `prefix` (a `filter.passthrough_prefixes` entry) covers `path`: equal, or followed
/// by a `/` in `path` (whole segments: `/admin` covers `/admin/x`, not `/administrator`). A prefix
/// ending in `/` covers everything below it.
pub fn prefix_matches(prefix: &str, path: &str) -> bool {
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || rest.starts_with('/') || prefix.ends_with('/'),
        None => false,
    }
}
