//! The request wing's settings: the `filter` section, and the view of the document the request
//! path reads ([`Settings`]), which `config` builds.

use crate::base::json::ConfigError;
use crate::base::settings::settings;
use crate::flow::priority::PriorityConfig;
use crate::request::protocol::AGENT_SESSION_HEADERS;
use crate::scheduler::config::{FailureMode, PrefixConfig};
use crate::state::catalog::Catalog;

/// Largest `filter.max_body_bytes` (64 MiB). The filter buffers the whole body in every worker's
/// VM; more than this is a misconfiguration, not a workload.
pub const MAX_BODY_BYTES_LIMIT: usize = 64 * 1024 * 1024;

settings! {
    /// The HTTP filter.
    #[derive(Debug, Clone, PartialEq)]
    pub struct FilterConfig {
        /// Largest request body buffered, in bytes; a larger one gets 413. 1 to 67108864 (64 MiB).
        /// Default 4194304 (4 MiB). Envoy's `per_connection_buffer_limit_bytes` must be at least this,
        /// or Envoy answers 413 itself first.
        #[range(min = 1, max = MAX_BODY_BYTES_LIMIT)]
        #[reason = "must be in {min}..={max} (64 MiB), got {v}"]
        pub max_body_bytes: usize = 4 * 1024 * 1024,
        /// What to do when no endpoint has fresh metrics. Default `FailClose` (503), as GIE.
        pub failure_mode: FailureMode = FailureMode::FailClose,
        /// Path prefixes the filter lets through untouched: no body read, no endpoint picked, no
        /// local answer; the route decides where they go (a route of their own to another cluster,
        /// since the pool's ORIGINAL_DST cluster needs the destination header the filter did not
        /// set). Every other path that is not an inference path, `/v1/models[/{id}]`, a health path
        /// or a preflight gets a JSON 404. A prefix matches whole path segments (`/admin` matches
        /// `/admin` and `/admin/x`, not `/administrator`) and wins over the local answers, so
        /// `/v1/models` or `/healthz` can be sent on instead; it may not cover an inference path.
        /// The client-chosen destination and priority headers are removed on these paths too.
        /// Default: none.
        pub passthrough_prefixes: Vec<String> = Vec::new(),
        /// Add the response header `x-gateway-destination-endpoint-served` (the `ip:port` of the pod
        /// that served). Off by default: it shows every client the pool's addresses (topology).
        /// Default false.
        pub expose_served_endpoint: bool = false,
        /// Add the `endpoint` tag to the filter's metrics (`inference_picker_requests_total` by
        /// endpoint, and the per-endpoint `inference_picker_endpoint_inflight` gauge). Default false.
        /// Envoy never deletes a stat, so with this on every pod address ever routed to stays a
        /// metric name for the life of the process: the number of names grows without bound while
        /// pods churn. Turn it on only for a fixed set of endpoints, or for debugging.
        pub endpoint_metrics: bool = false,
        /// GIE conformance mode: honour the conformance suite's test header
        /// `test-epp-endpoint-selection` (the request may only go to the listed `ip` or `ip:port`
        /// endpoints; none matching is a 503) and answer `x-conformance-test-served-endpoint` with
        /// the `ip:port` that served. Never turn it on for real traffic: the header lets a client
        /// choose its pod. Off, the header is removed and ignored. Default false. See
        /// `docs/conformance.md`.
        pub conformance_mode: bool = false,
        /// More request headers that name a session, tried in order after
        /// `scheduler.session.header`; the first with a usable value is the session id, used
        /// exactly as that header's (session affinity, the split target of a model rewrite, and
        /// with `priority.trust_session_headers` the fairness id). Usable: 1 to 256 bytes of
        /// printable ASCII once surrounding spaces and tabs are trimmed; any other value is
        /// skipped and the next header tried. At most 16 lower-case names, none twice, none a
        /// header the filter removes or the session-token header. Default: the headers of common
        /// coding agents and routers, `x-dynamo-session-id` (Dynamo), `x-claude-code-session-id`
        /// (Claude Code), `x-session-affinity` (OpenCode), `session-id`, `thread-id` and
        /// `session_id` (Codex). `[]`: only `scheduler.session.header`.
        #[schema(length(max = crate::request::protocol::MAX_SESSION_HEADERS), inner(regex(pattern = r"^[a-z0-9!#$%&'*+.^_`|~-]+$")))]
        pub session_headers: Vec<String> = AGENT_SESSION_HEADERS.iter().map(|h| h.to_string()).collect(),
        /// Read the token usage the model server reports in each routed 2xx response (the body's
        /// `usage`, or a stream's usage events), count it in `inference_picker_prompt_tokens_total`
        /// and `inference_picker_completion_tokens_total`, and set it in the stream's filter state
        /// for access logs. The body passes unchanged; only a usage object of at most 2 KiB is
        /// kept while it is read. Default true. Off, no response body is read (one host call per
        /// body chunk saved).
        pub token_usage: bool = true,
        /// Set the decision of each request in the stream's filter state, for Envoy's access
        /// log and tracer: the chosen pod and its fallbacks, the reason, the model, the
        /// priority, objective and tier, the predicted TTFT and the time held, or the error code
        /// of a request the module answered (keys `wasm.inference_picker_*`, listed in
        /// docs/observability.md). Default true. Off, those host calls (about seven a request)
        /// are saved.
        pub decision_state: bool = true,
    }
}

/// Largest `pd.pd_threshold_tokens` (a prompt longer than this is beyond any model's context).
pub const MAX_THRESHOLD_TOKENS: u64 = 10_000_000;

settings! {
    /// The `pd` section: disaggregated prefill/decode. Absent: roles are ignored and no request is
    /// split.
    #[derive(Debug, Clone, PartialEq)]
    pub struct PdConfig {
        /// Split a request (name a prefill pod) when the part of its prompt the chosen decode pod
        /// does not hold is at least this many tokens; 0 splits every request that has a prefill
        /// candidate. llm-d's `nonCachedTokens` (`pdThreshold` before): default 0, as there.
        /// At most 10000000.
        #[range(max = MAX_THRESHOLD_TOKENS)]
        #[reason = "must be at most {max}"]
        pub pd_threshold_tokens: u64 = 0,
        /// Factor on the prefix weight for the decode pick, 0 to 1. Default 0.5.
        #[range(min = 0.0, max = 1.0)]
        #[reason = "must be between {min} and {max}"]
        pub decode_prefix_factor: f64 = 0.5,
        /// Prefill-busy guard (objective `predicted_ttft` only): a split the threshold allows is
        /// not made when the prefill path's predicted TTFT (the prefill pod's work ahead and this
        /// prompt at its rate, plus the KV transfer) exceeds this factor times the decode pod's
        /// predicted TTFT prefilling the prompt itself; the decode pod prefills it (decision
        /// `prefill_busy`). P/D trades some TTFT for steadier decoding, so an idle pool, where both
        /// paths cost about the same, still splits; saturated prefill pods do not make every request
        /// wait behind them.
        /// 0 disables the guard (llm-d's rule alone). 0 or 1 to 1000; default 0 (off): in the P/D
        /// replay it rescued prefill-bound pools (2 prefill + 6 decode) and raised TPOT wherever
        /// requests stopped being split (docs/pd.md); enable it (2) where the prefill pods are the
        /// bottleneck and TTFT matters more than TPOT.
        #[schema(range(min = 0.0, max = 1000.0))]
        pub prefill_busy_factor: f64 = 0.0,
        /// KV transfer time per 1,000 prompt tokens, in ms, added to the prefill path by the
        /// prefill-busy guard. Default 5 (Llama-3-8B fp16, 128 KiB a token, over 25 GB/s); 0 to
        /// 60000.
        #[range(min = 0.0, max = 60000.0)]
        #[reason = "must be between {min} and {max}"]
        pub transfer_ms_per_1k_tokens: f64 = 5.0,
    }
}

impl PdConfig {
    pub fn validate(&self, path: &str, errs: &mut Vec<ConfigError>) {
        self.validate_fields(path, errs, |errs| {
            let f = self.prefill_busy_factor;
            if !(f == 0.0 || (1.0..=1000.0).contains(&f)) {
                errs.push(ConfigError::new(
                    format!("{path}.prefill_busy_factor"),
                    "must be 0 (off) or between 1 and 1000",
                ));
            }
        });
    }
}

/// What the request path reads of the configuration: the `filter` section, the priority
/// headers, the prefix scorer's hashing limits (a held prompt keeps only what it hashes) and the
/// catalog.
#[derive(Debug, Clone, Copy)]
pub struct Settings<'a> {
    pub filter: &'a FilterConfig,
    /// `scheduler.session.header`: the first header that names a session.
    pub session_header: &'a str,
    pub priority: &'a PriorityConfig,
    /// `scheduler.prefix`.
    pub prefix: &'a PrefixConfig,
    /// `pd`: disaggregated prefill/decode; `None` when off.
    pub pd: Option<&'a PdConfig>,
    pub catalog: Catalog<'a>,
    /// `flow_control.retry_after_s`: the Retry-After of a 429 for a latency target no pod can
    /// meet.
    pub retry_after_s: u32,
}
