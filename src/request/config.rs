//! The request wing's settings: the `filter` section, and the view of the document the request
//! path reads ([`Settings`]), which `config` builds.

use serde::Serialize;

use crate::base::json;
use crate::flow::priority::PriorityConfig;
use crate::scheduler::config::{FailureMode, PrefixConfig};
use crate::state::catalog::Catalog;

/// Largest `filter.max_body_bytes` (64 MiB). The filter buffers the whole body in every worker's
/// VM; more than this is a misconfiguration, not a workload.
pub const MAX_BODY_BYTES_LIMIT: usize = 64 * 1024 * 1024;

/// The HTTP filter.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct FilterConfig {
    /// Largest request body buffered, in bytes; a larger one gets 413. 1 to 67108864 (64 MiB).
    /// Default 4194304 (4 MiB). Envoy's `per_connection_buffer_limit_bytes` must be at least this,
    /// or Envoy answers 413 itself first.
    #[serde(default = "default_max_body_bytes")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = MAX_BODY_BYTES_LIMIT)))]
    pub max_body_bytes: usize,
    /// What to do when no endpoint has fresh metrics. Default `FailClose` (503), as GIE.
    #[serde(default = "default_failure_mode")]
    pub failure_mode: FailureMode,
    /// Path prefixes the filter lets through untouched: no body read, no endpoint picked, no
    /// local answer; the route decides where they go (a route of their own to another cluster,
    /// since the pool's ORIGINAL_DST cluster needs the destination header the filter did not
    /// set). Every other path that is not an inference path, `/v1/models[/{id}]`, a health path
    /// or a preflight gets a JSON 404. A prefix matches whole path segments (`/admin` matches
    /// `/admin` and `/admin/x`, not `/administrator`) and wins over the local answers, so
    /// `/v1/models` or `/healthz` can be sent on instead; it may not cover an inference path.
    /// The client-chosen destination and priority headers are removed on these paths too.
    /// Default: none.
    #[serde(default)]
    pub passthrough_prefixes: Vec<String>,
    /// Add the response header `x-gateway-destination-endpoint-served` (the `ip:port` of the pod
    /// that served). Off by default: it shows every client the pool's addresses (topology).
    /// Default false.
    #[serde(default)]
    pub expose_served_endpoint: bool,
    /// Add the `endpoint` tag to the filter's metrics (`inference_picker_requests_total` by
    /// endpoint, and the per-endpoint `inference_picker_endpoint_inflight` gauge). Default false.
    /// Envoy never deletes a stat, so with this on every pod address ever routed to stays a
    /// metric name for the life of the process: the number of names grows without bound while
    /// pods churn. Turn it on only for a fixed set of endpoints, or for debugging.
    #[serde(default = "default_endpoint_metrics")]
    pub endpoint_metrics: bool,
    /// GIE conformance mode: honour the conformance suite's test header
    /// `test-epp-endpoint-selection` (the request may only go to the listed `ip` or `ip:port`
    /// endpoints; none matching is a 503) and answer `x-conformance-test-served-endpoint` with
    /// the `ip:port` that served. Never turn it on for real traffic: the header lets a client
    /// choose its pod. Off, the header is removed and ignored. Default false. See
    /// `docs/conformance.md`.
    #[serde(default)]
    pub conformance_mode: bool,
}

fn default_endpoint_metrics() -> bool {
    false
}

fn default_max_body_bytes() -> usize {
    4 * 1024 * 1024
}

fn default_failure_mode() -> FailureMode {
    FailureMode::FailClose
}

impl Default for FilterConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: default_max_body_bytes(),
            failure_mode: default_failure_mode(),
            passthrough_prefixes: Vec::new(),
            expose_served_endpoint: false,
            endpoint_metrics: default_endpoint_metrics(),
            conformance_mode: false,
        }
    }
}

// The reader of `FilterConfig` (`crate::base::json`), fields in declaration order.
json::from_json_struct!(FilterConfig {
    max_body_bytes = default_max_body_bytes(),
    failure_mode = default_failure_mode(),
    passthrough_prefixes = Vec::new(),
    expose_served_endpoint = false,
    endpoint_metrics = default_endpoint_metrics(),
    conformance_mode = false,
});

/// What the request path reads of the configuration: the `filter` section, the priority
/// headers, the prefix scorer's hashing limits (a held prompt keeps only what it hashes) and the
/// catalog.
#[derive(Debug, Clone, Copy)]
pub struct Settings<'a> {
    pub filter: &'a FilterConfig,
    pub priority: &'a PriorityConfig,
    /// `scheduler.prefix`.
    pub prefix: &'a PrefixConfig,
    /// `pd`: disaggregated prefill/decode; `None` when off.
    pub pd: Option<&'a crate::request::pd::PdConfig>,
    pub catalog: Catalog<'a>,
}
