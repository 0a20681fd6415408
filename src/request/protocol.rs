//! The HTTP contract of the filter: the paths it routes or answers, the headers it reads, sets
//! and removes (GIE's, Envoy's, llm-d's, the conformance suite's and its own), and the error
//! shape each path's clients read.

use crate::base::errors::ErrorShape;

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

/// Request headers that name a session, as coding agents and routers send them: the default of
/// `filter.session_headers`, tried in this order after `scheduler.session.header`
/// (`x-session-id`, which OpenCode also sends). Dynamo's own header comes first, as a client
/// sets it on purpose; then Claude Code's, OpenCode's, and Codex's current, newer and older
/// forms.
pub const AGENT_SESSION_HEADERS: [&str; 6] = [
    "x-dynamo-session-id",
    "x-claude-code-session-id",
    "x-session-affinity",
    "session-id",
    "thread-id",
    "session_id",
];
/// Most entries of `filter.session_headers`.
pub const MAX_SESSION_HEADERS: usize = 16;
/// Longest usable session id, in bytes (after trimming); a longer value is skipped.
pub const MAX_SESSION_ID_BYTES: usize = 256;

/// Anthropic's Messages API: an inference path whose errors are Anthropic-shaped
/// ([`error_shape`]).
pub const MESSAGES_PATH: &str = "/v1/messages";
/// The inference paths the filter routes (POST only): OpenAI chat completions, completions,
/// responses and embeddings, and Anthropic messages. Matched exactly on the path without its
/// query (a trailing `/` is ignored: [`route_path`]).
pub const INFERENCE_PATHS: [&str; 5] =
    ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", MESSAGES_PATH];
/// Anthropic's token count (`POST /v1/messages/count_tokens`): routed to a pod that serves the
/// model, with a Messages body (`max_tokens` not required), but not a generation: the pod only
/// tokenizes (`crate::request::pipeline::route_token_count`). Not one of [`INFERENCE_PATHS`]: a
/// `filter.passthrough_prefixes` entry may name it (and then wins), as it may not name those.
pub const COUNT_TOKENS_PATH: &str = "/v1/messages/count_tokens";
/// Every path the filter routes to a pod (POST only): the [`INFERENCE_PATHS`], then
/// [`COUNT_TOKENS_PATH`].
pub const ROUTED_PATHS: [&str; 6] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/embeddings",
    MESSAGES_PATH,
    COUNT_TOKENS_PATH,
];
/// Answered locally: the pool's model list, and one model by id (`/v1/models/{id}`).
pub const MODELS_PATH: &str = "/v1/models";
/// Health checks answered locally with 200 `{"status":"ok"}`: the gateway (this filter) is up.
/// They say nothing about the pool's pods (the poller's metrics do).
pub const HEALTH_PATHS: [&str; 4] = ["/health", "/healthz", "/readyz", "/livez"];

/// The path as the filter matches it: without its query or fragment, a trailing `/` ignored
/// (`/` for an empty path).
pub fn route_path(path: &str) -> &str {
    let raw = path.split(['?', '#']).next().unwrap_or("");
    match raw.trim_end_matches('/') {
        "" => "/",
        p => p,
    }
}

/// True on [`COUNT_TOKENS_PATH`] (query and a trailing `/` aside): a token count, not a
/// generation.
pub fn is_count_tokens(path: &str) -> bool {
    route_path(path) == COUNT_TOKENS_PATH
}

/// The shape of the errors the filter answers on `path`: Anthropic's on [`MESSAGES_PATH`] and
/// below it ([`COUNT_TOKENS_PATH`]; `/v1/messages/batches`, not routed, but its clients are
/// Anthropic clients, and read a 404 in that shape), OpenAI's everywhere else. The one place the
/// choice is made; the host renders every rejection of a request with it.
pub fn error_shape(path: &str) -> ErrorShape {
    match route_path(path).strip_prefix(MESSAGES_PATH) {
        Some(rest) if rest.is_empty() || rest.starts_with('/') => ErrorShape::Anthropic,
        _ => ErrorShape::OpenAi,
    }
}

/// True when `prefix` (a `filter.passthrough_prefixes` entry) covers `path`: equal, or followed
/// by a `/` in `path` (whole segments: `/admin` covers `/admin/x`, not `/administrator`). A prefix
/// ending in `/` covers everything below it.
pub fn prefix_matches(prefix: &str, path: &str) -> bool {
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || rest.starts_with('/') || prefix.ends_with('/'),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_anthropic_shaped_on_the_messages_path_and_below_it_only() {
        for p in ["/v1/messages", "/v1/messages/", "/v1/messages?beta=true", "/v1/messages/count_tokens"] {
            assert_eq!(error_shape(p), ErrorShape::Anthropic, "{p}");
        }
        for p in
            ["/v1/chat/completions", "/v1/messagesx", "/v1/message", "/messages", "/x/v1/messages", "", "/"]
        {
            assert_eq!(error_shape(p), ErrorShape::OpenAi, "{p}");
        }
        assert_eq!((route_path("/a/?q#f"), route_path(""), route_path("//")), ("/a", "/", "/"));
    }

    #[test]
    fn routed_paths_are_the_inference_paths_then_the_token_count() {
        let mut want = INFERENCE_PATHS.to_vec();
        want.push(COUNT_TOKENS_PATH);
        assert_eq!(ROUTED_PATHS.to_vec(), want);
        for p in
            ["/v1/messages/count_tokens", "/v1/messages/count_tokens/", "/v1/messages/count_tokens?beta=true"]
        {
            assert!(is_count_tokens(p), "{p}");
        }
        for p in ["/v1/messages", "/v1/messages/count_tokensx", "/v1/messages/batches", "/count_tokens"] {
            assert!(!is_count_tokens(p), "{p}");
        }
    }
}
