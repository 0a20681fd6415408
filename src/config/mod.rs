//! The one JSON configuration document, read by both roles (filter and poller).
//!
//! Parsed once in `on_configure` by [`Config::from_json`]: serde_json parses the document into a
//! `Value`, the explicit `version` is checked, and the configuration types read themselves from it
//! ([`read`]: unknown fields are errors everywhere), then [`Config::validate`] reports every
//! problem at once, each with the JSON path of the bad field (`endpoints[2].address`) and a
//! reason. The scheduler then builds its model lookup once (`scheduler::models::ModelTable`) and
//! only reads it per request.
//!
//! The field reference is `filter-config/README.md`; the JSON Schema is `filter-config/schema.json`,
//! generated from these types (feature `schema`) and kept equal to them by a test.
//!
//! # Adding a field
//! 1. Add it to its struct with a `///` doc (it becomes the schema description) and, when it is
//!    optional, a per-field `#[serde(default = "default_x")]` whose value the doc states (the
//!    schema's `default` and required list come from these attributes).
//! 2. Add it to the struct's `json::from_json_struct!` list, with the same default
//!    (`name = default_x()`) or none when it is required. A field missing there is an unknown
//!    field to the reader.
//! 3. Add its checks to that struct's `validate_into`, with a negative test in `config/tests.rs`
//!    that asserts the exact path and a reason substring. Where a bound is simple (a minimum, a
//!    non-empty string), mirror it in the schema with a `schemars(...)` attribute naming the same
//!    constant.
//! 4. Regenerate the schema: `cargo run -q -p config-schema > filter-config/schema.json`.
//! 5. Document it in `filter-config/README.md` (a test fails when a schema field is missing there).

pub mod live;
mod locate;
#[cfg(test)]
mod tests;

use hashbrown::HashMap;
use std::net::SocketAddr;

use serde::Serialize;

pub use crate::base::json::describe_errors;
use crate::base::json::{self, ConfigError};

pub use crate::scheduler::config::SchedulerConfig;

use crate::flow::priority::{Criticality, PriorityConfig};
use crate::flow::saturation::SaturationConfig;
use crate::flow::FlowControlConfig;
use crate::state::health::HealthConfig;

/// The only configuration version this build understands.
pub const CONFIG_VERSION: u32 = 1;
/// Smallest `poller.interval_ms`: below this the poller itself becomes the load (llm-d #1842 saw
/// vLLM slow down at 50 ms).
pub const MIN_INTERVAL_MS: u64 = 10;
/// Smallest `poller.timeout_ms`. Zero would mean "no timeout" to Envoy, leaving a hung scrape
/// outstanding forever, so it is not allowed.
pub const MIN_TIMEOUT_MS: u64 = 1;
/// Largest `filter.max_body_bytes` (64 MiB). The filter buffers the whole body in every worker's
/// VM; more than this is a misconfiguration, not a workload.
pub const MAX_BODY_BYTES_LIMIT: usize = 64 * 1024 * 1024;
/// Smallest `poller.max_response_bytes` (1 KiB): less cannot hold one engine's routing metrics.
pub const MIN_RESPONSE_BYTES: usize = 1024;
/// Largest `poller.max_response_bytes` (64 MiB).
pub const MAX_RESPONSE_BYTES_LIMIT: usize = 64 * 1024 * 1024;

/// Configuration of the inference-picker module: the same document for the HTTP filter and the
/// poller.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
// `endpoints` needs an entry only when there is no `discovery`.
#[cfg_attr(
    feature = "schema",
    schemars(extend(
        "if" = serde_json::json!({"not": {"required": ["discovery"], "properties": {"discovery": {"type": "object"}}}}),
        "then" = serde_json::json!({"properties": {"endpoints": {"minItems": 1}}})
    ))
)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Version of this document's format. Must be 1.
    #[cfg_attr(feature = "schema", schemars(extend("const" = CONFIG_VERSION)))]
    pub version: u32,
    /// The pool's endpoints (model servers) and the base models each serves. At least one, unless
    /// `discovery` is set.
    pub endpoints: Vec<EndpointConfig>,
    /// The base models the pool serves, with their LoRA adapters. At least one.
    #[cfg_attr(feature = "schema", schemars(length(min = 1)))]
    pub models: Vec<ModelConfig>,
    /// How the poller scrapes the endpoints' metrics. Default: every field at its default.
    #[serde(default = "PollerConfig::default")]
    pub poller: PollerConfig,
    /// How the HTTP filter treats requests. Default: every field at its default.
    #[serde(default = "FilterConfig::default")]
    pub filter: FilterConfig,
    /// Scorer weights, prefix/session/guard settings and model rewrites (see `crate::scheduler`).
    #[serde(default = "SchedulerConfig::default")]
    pub scheduler: SchedulerConfig,
    /// Where a request's priority comes from and which priority headers are trusted (see
    /// `crate::flow::priority`). Default: the model's criticality only, no header trusted.
    #[serde(default = "PriorityConfig::default")]
    pub priority: PriorityConfig,
    /// When the endpoints of a model have no room (see `crate::flow::saturation`). Default: GIE's
    /// thresholds.
    #[serde(default = "SaturationConfig::default")]
    pub saturation: SaturationConfig,
    /// Holding requests inside the proxy while their endpoints are saturated (see `crate::flow`).
    /// Default: every field at its default (off: `enabled` is false).
    #[serde(default = "FlowControlConfig::default")]
    pub flow_control: FlowControlConfig,
    /// Passive health from upstream results (ejection with back-off) and the startup hold (see
    /// `crate::state::health`). Default: every field at its default (on).
    #[serde(default = "HealthConfig::default")]
    pub health: HealthConfig,
    /// Where endpoints come from besides `endpoints`. Default: none (only the static list).
    #[serde(default)]
    pub discovery: Option<DiscoveryConfig>,
    /// Learn which models and LoRA adapters each pod serves from the pod itself (its
    /// `/v1/models` and LoRA metrics; see `crate::poll::pod_models`). Default: none (only the
    /// configured models, each pod assumed to serve what `endpoints` or discovery says).
    #[serde(default)]
    pub pod_models: Option<crate::poll::pod_models::PodModelsConfig>,
    /// This instance's pool on a gateway with several pools, and body-based routing between them
    /// (see `crate::request::pools`). Default: none (one unnamed pool; every request reaching the filter
    /// is its own).
    #[serde(default)]
    pub pool: Option<crate::request::pools::PoolConfig>,
    /// Disaggregated prefill/decode, llm-d's protocol (see `crate::request::pd` and `docs/pd.md`).
    /// Default: none (endpoint roles are ignored and no request is split).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pd: Option<crate::request::pd::PdConfig>,
    /// The other replicas of this gateway, with which it exchanges its prefix table (see
    /// `crate::poll::peers`). Default: none (replicas share nothing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peers: Option<crate::poll::peers::PeersConfig>,
}

/// One model server.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct EndpointConfig {
    /// `ip:port` of the model server: an IPv4 address (`10.0.0.7:8000`) or a bracketed IPv6
    /// address (`[fd00::7]:8000`), port 1-65535. No hostnames: the ORIGINAL_DST cluster routes to
    /// the literal address in `x-gateway-destination-endpoint`. Unique across endpoints.
    #[cfg_attr(feature = "schema", schemars(length(min = 1)))]
    pub address: String,
    /// Names of the base models (from `models[].name`, not adapters) this endpoint serves. At
    /// least one.
    #[cfg_attr(feature = "schema", schemars(length(min = 1), inner(length(min = 1))))]
    pub models: Vec<String>,
    /// Its role in a disaggregated prefill/decode pool (see `pd`): `decode`, `prefill` (never a
    /// destination, only named in `x-prefiller-host-port`) or `both`. Read only when `pd` is
    /// set. Default `decode`.
    #[serde(
        default = "crate::request::pd::Role::default",
        skip_serializing_if = "crate::request::pd::Role::is_decode"
    )]
    pub role: crate::request::pd::Role,
}

/// One base model and its LoRA adapters.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The name clients put in the body's `model`, e.g. `meta-llama/Llama-3.1-8B-Instruct`.
    /// Unique across models and adapters.
    #[cfg_attr(feature = "schema", schemars(length(min = 1)))]
    pub name: String,
    /// LoRA adapters on this base model; a request naming one goes to an endpoint of this base.
    /// Unique across all models. Default: none.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(inner(length(min = 1))))]
    pub adapters: Vec<String>,
    /// Default priority of this model's requests, through `priority.criticality`; a trusted
    /// objective or tier header overrides it. Default `Standard`.
    #[serde(default = "Criticality::default")]
    pub criticality: Criticality,
}

/// The poller: the one VM that scrapes every endpoint's metrics and publishes the snapshot.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct PollerConfig {
    /// How often each endpoint's metrics are scraped, in ms. At least 10. Default 200: GIE polls
    /// every 50 ms, but llm-d #1842 showed polling that fast slows vLLM itself; the router-local
    /// in-flight count covers the gap between polls.
    #[serde(default = "default_interval_ms")]
    #[cfg_attr(feature = "schema", schemars(range(min = MIN_INTERVAL_MS)))]
    pub interval_ms: u64,
    /// Timeout of one scrape, in ms. At least 1. Default 1000. A scrape still outstanding is
    /// never started again.
    #[serde(default = "default_timeout_ms")]
    #[cfg_attr(feature = "schema", schemars(range(min = MIN_TIMEOUT_MS)))]
    pub timeout_ms: u64,
    /// An endpoint whose last successful scrape is older than this, in ms, is stale. At least
    /// `interval_ms`. Default 1000.
    #[serde(default = "default_stale_after_ms")]
    pub stale_after_ms: u64,
    /// Name of the Envoy ORIGINAL_DST cluster (with `use_http_header`) that scrapes go through.
    /// Default `inference_pool_metrics`.
    #[serde(default = "default_metrics_cluster")]
    #[cfg_attr(feature = "schema", schemars(length(min = 1)))]
    pub cluster: String,
    /// Path of the metrics endpoint on every model server; starts with `/`. Default `/metrics`.
    #[serde(default = "default_metrics_path")]
    #[cfg_attr(feature = "schema", schemars(regex(pattern = r"^/\S*$")))]
    pub metrics_path: String,
    /// Which root context polls. Default `singleton`. See [`PollerMode`].
    #[serde(default = "default_poller_mode")]
    pub mode: PollerMode,
    /// `lease` mode only: how long one renewal of the poller lease is valid. Default 1000 ms. A
    /// poller that stops renewing is replaced within `lease_ttl_ms + 2 × interval_ms`; a shorter
    /// ttl replaces it sooner but a worker stalled for longer than the ttl loses the lease. Must
    /// be at least twice `interval_ms` (the tick that renews it).
    #[serde(default = "default_lease_ttl_ms")]
    pub lease_ttl_ms: u64,
    /// Largest callout response read, in bytes: a `/metrics` answer, and the Kubernetes pod list
    /// when discovery is on. 1024 to 67108864. Default 4194304 (4 MiB). A larger response is not
    /// read at all: the scrape (or pod list) counts as failed, with an error log and
    /// `inference_picker_scrape_failures_total;reason=too_large` (or
    /// `inference_picker_discovery_failures_total;reason=too_large`). It bounds the memory a
    /// misbehaving server can make the poller allocate (in lease mode, inside a worker VM).
    #[serde(default = "default_max_response_bytes")]
    #[cfg_attr(feature = "schema", schemars(range(min = MIN_RESPONSE_BYTES, max = MAX_RESPONSE_BYTES_LIMIT)))]
    pub max_response_bytes: usize,
    /// The slowest an endpoint is scraped, in ms: one that is idle and unchanged (no request of
    /// this gateway in flight there, the same queue, running and KV use as its previous scrape)
    /// is scraped at twice its previous interval, up to this. Any change, a request of this
    /// gateway, or a failure brings it back to `interval_ms`. At least `interval_ms`; equal to
    /// it polls every endpoint every `interval_ms` as before. Default 5000 (an idle 1,024-pod
    /// pool then costs about 200 scrapes/s). Load that other gateway replicas (or clients that
    /// bypass the gateway) send to an idle pod is seen at most this late.
    #[serde(default = "default_idle_interval_ms")]
    pub idle_interval_ms: u64,
    /// Upper bound on scrapes per second from this gateway. When the endpoints' intervals ask for
    /// more, every interval is stretched by the same factor (and readers' staleness limits with
    /// it). At least 1. Default 2000 (about 1,000 busy endpoints at 500 ms).
    #[serde(default = "default_max_scrapes_per_s")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1)))]
    pub max_scrapes_per_s: u32,
    /// How many gateway replicas poll the same pods. Each replica scrapes an endpoint that it does
    /// not send to at `replicas` times the interval (`interval_ms` when its load moves,
    /// `idle_interval_ms` when idle), so the pods see about the scrape rate of one gateway
    /// whatever the number of replicas; an endpoint a replica sends to is still scraped every
    /// `interval_ms` by that replica, and its own in-flight estimate covers the gaps. It also
    /// scales the rendezvous credit (`scheduler.predicted.rendezvous_credit`; none with 1), so
    /// set it to the number of gateway replicas. 1 to 1000.
    /// Default 1. On the whole replay traces (5 seeds) idle back-off ties fixed polling at 4
    /// replicas too, but one LoRA seed in five was slower: where that spread matters, set
    /// `idle_interval_ms` = `interval_ms`.
    #[serde(default = "default_replicas")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = 1000)))]
    pub replicas: u32,
}

/// Which root context scrapes the endpoints and publishes the snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum PollerMode {
    /// A `WasmService` with `singleton: true` (root id `inference-picker-poller`, same `vm_id`)
    /// in Envoy's `bootstrap_extensions` polls; the filter's roots never do. Use it whenever you
    /// control the bootstrap: plain Envoy, or an Istio sidecar or gateway pod whose bootstrap can
    /// be overridden (`sidecar.istio.io/bootstrapOverride`).
    Singleton,
    /// The HTTP filter's own root contexts (main thread and every worker) elect one poller through
    /// a lease in shared data (see `lease.rs`). Use it where no bootstrap singleton can be added:
    /// Istio gateways deployed from Gateway API resources, or ECDS-only deployments.
    Lease,
}

/// What the filter does when no endpoint of the requested model has fresh metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub enum FailureMode {
    /// Route by the router-local in-flight count among the endpoints that serve the model.
    FailOpen,
    /// Answer 503.
    FailClose,
}

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

fn default_interval_ms() -> u64 {
    200
}
fn default_timeout_ms() -> u64 {
    1000
}
fn default_stale_after_ms() -> u64 {
    1000
}
fn default_metrics_cluster() -> String {
    "inference_pool_metrics".to_string()
}
fn default_metrics_path() -> String {
    "/metrics".to_string()
}
fn default_poller_mode() -> PollerMode {
    PollerMode::Singleton
}
fn default_lease_ttl_ms() -> u64 {
    1000
}
fn default_max_response_bytes() -> usize {
    4 * 1024 * 1024
}
fn default_idle_interval_ms() -> u64 {
    5000
}
fn default_max_scrapes_per_s() -> u32 {
    2000
}
fn default_replicas() -> u32 {
    1
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

impl Default for PollerConfig {
    fn default() -> Self {
        Self {
            interval_ms: default_interval_ms(),
            timeout_ms: default_timeout_ms(),
            stale_after_ms: default_stale_after_ms(),
            cluster: default_metrics_cluster(),
            metrics_path: default_metrics_path(),
            mode: default_poller_mode(),
            lease_ttl_ms: default_lease_ttl_ms(),
            max_response_bytes: default_max_response_bytes(),
            idle_interval_ms: default_idle_interval_ms(),
            max_scrapes_per_s: default_max_scrapes_per_s(),
            replicas: default_replicas(),
        }
    }
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

/// Endpoint discovery sources. Exactly one source for now.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct DiscoveryConfig {
    /// List the pool's pods from the Kubernetes API, like an InferencePool does.
    pub kubernetes: KubernetesDiscoveryConfig,
}

/// Pod discovery through the Kubernetes API (`GET /api/v1/namespaces/NS/pods?labelSelector=...`),
/// sent by the poller with `dispatch_http_call` through an Envoy cluster. See `discovery.rs`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct KubernetesDiscoveryConfig {
    /// Namespace of the model-server pods (the InferencePool's namespace).
    pub namespace: String,
    /// Equality label selector (InferencePool `spec.selector.matchLabels`); at least one label.
    pub selector: std::collections::BTreeMap<String, String>,
    /// Ports on each pod (InferencePool `spec.targetPorts`), 1 to 8; each port is its own endpoint.
    #[cfg_attr(feature = "schema", schemars(length(min = 1, max = crate::poll::discovery::MAX_TARGET_PORTS)))]
    pub target_ports: Vec<u16>,
    /// Base models (from `models`) every discovered endpoint serves. Default: all of `models`.
    #[serde(default)]
    pub models: Vec<String>,
    /// The Envoy cluster that reaches the API server (TLS to kubernetes.default.svc:443).
    #[serde(default = "default_api_cluster")]
    pub api_cluster: String,
    /// `:authority` of the API request. Default `kubernetes.default.svc`.
    #[serde(default = "default_api_authority")]
    pub api_authority: String,
    /// Bearer token, inline. Prefer `token_env`. At most one of the two; neither sends no
    /// `authorization` header (for an API proxy that adds it).
    #[serde(default)]
    pub token: Option<String>,
    /// Name of a VM environment variable holding the bearer token (Envoy
    /// `vm_config.environment_variables`, Istio `vmConfig.env`).
    #[serde(default)]
    pub token_env: Option<String>,
    /// How often the pod list is fetched again, in ms. At least 1000. Default 5000.
    #[serde(default = "default_refresh_ms")]
    #[cfg_attr(feature = "schema", schemars(range(min = crate::poll::discovery::MIN_REFRESH_MS)))]
    pub refresh_ms: u64,
    /// Timeout of one list request, in ms: 1 to `refresh_ms`. Default 2000.
    #[serde(default = "default_list_timeout_ms")]
    pub timeout_ms: u64,
    /// How a pod's role (for `pd`) is read from its labels. Default: llm-d's label
    /// `llm-d.ai/role` with the values `prefill`, `decode`, `both` and `prefill-decode`.
    #[serde(
        default = "crate::request::pd::RoleSelectors::default",
        skip_serializing_if = "crate::request::pd::RoleSelectors::is_default"
    )]
    pub roles: crate::request::pd::RoleSelectors,
}

fn default_api_cluster() -> String {
    "kubernetes_api".to_string()
}
fn default_api_authority() -> String {
    "kubernetes.default.svc".to_string()
}
fn default_refresh_ms() -> u64 {
    5000
}
fn default_list_timeout_ms() -> u64 {
    2000
}

// The readers of this file's types (`read.rs`): each field with its default, in declaration order.
json::from_json_struct!(Config {
    version,
    endpoints,
    models,
    poller = PollerConfig::default(),
    filter = FilterConfig::default(),
    scheduler = SchedulerConfig::default(),
    priority = PriorityConfig::default(),
    saturation = SaturationConfig::default(),
    flow_control = FlowControlConfig::default(),
    health = HealthConfig::default(),
    discovery = None,
    pod_models = None,
    pool = None,
    pd = None,
    peers = None,
});
json::from_json_struct!(EndpointConfig { address, models, role = crate::request::pd::Role::default() });
json::from_json_struct!(ModelConfig { name, adapters = Vec::new(), criticality = Criticality::default() });
json::from_json_struct!(PollerConfig {
    interval_ms = default_interval_ms(),
    timeout_ms = default_timeout_ms(),
    stale_after_ms = default_stale_after_ms(),
    cluster = default_metrics_cluster(),
    metrics_path = default_metrics_path(),
    mode = default_poller_mode(),
    lease_ttl_ms = default_lease_ttl_ms(),
    max_response_bytes = default_max_response_bytes(),
    idle_interval_ms = default_idle_interval_ms(),
    max_scrapes_per_s = default_max_scrapes_per_s(),
    replicas = default_replicas(),
});
json::from_json_enum!(PollerMode { "singleton" => Singleton, "lease" => Lease });
json::from_json_enum!(FailureMode { "FailOpen" => FailOpen, "FailClose" => FailClose });
json::from_json_struct!(FilterConfig {
    max_body_bytes = default_max_body_bytes(),
    failure_mode = default_failure_mode(),
    passthrough_prefixes = Vec::new(),
    expose_served_endpoint = false,
    endpoint_metrics = default_endpoint_metrics(),
    conformance_mode = false,
});
json::from_json_struct!(DiscoveryConfig { kubernetes });
json::from_json_struct!(KubernetesDiscoveryConfig {
    namespace,
    selector,
    target_ports,
    models = Vec::new(),
    api_cluster = default_api_cluster(),
    api_authority = default_api_authority(),
    token = None,
    token_env = None,
    refresh_ms = default_refresh_ms(),
    timeout_ms = default_list_timeout_ms(),
    roles = crate::request::pd::RoleSelectors::default(),
});

/// `parent.name`, or `name` at the root.
fn field(parent: &str, name: &str) -> String {
    if parent.is_empty() {
        name.to_string()
    } else {
        format!("{parent}.{name}")
    }
}

/// `parent[i]`.
fn index(parent: &str, i: usize) -> String {
    format!("{parent}[{i}]")
}

/// Parses `bytes` as JSON; a syntax error or a key written twice in one object is an error with
/// the path where it is.
fn parse_document(bytes: &[u8]) -> Result<serde_json::Value, ConfigError> {
    let doc = serde_json::from_slice(bytes).map_err(|e| locate::serde_error(bytes, &e))?;
    match locate::duplicate_key(bytes) {
        Some(e) => Err(e),
        None => Ok(doc),
    }
}

/// Reads `doc`, parsed from `bytes`, as a `T`; an error carries its line and column in `bytes`.
fn read_document<T: json::FromJson>(bytes: &[u8], doc: &serde_json::Value) -> Result<T, ConfigError> {
    json::read_value(doc).map_err(|e| locate::with_position(bytes, e))
}

/// Reads one configuration value (a whole [`Config`], or a section of it) from JSON, with the
/// checks of [`Config::from_json`] short of [`Config::validate`]: for tools and tests.
pub fn read_json<T: json::FromJson>(bytes: impl AsRef<[u8]>) -> Result<T, ConfigError> {
    let bytes = bytes.as_ref();
    read_document(bytes, &parse_document(bytes)?)
}

/// Collects errors so that a validation pass reports all of them, not the first.
#[derive(Default)]
struct Errors(Vec<ConfigError>);

impl Errors {
    fn push(&mut self, path: impl Into<String>, reason: impl Into<String>) {
        self.0.push(ConfigError::new(path, reason));
    }
}

impl Config {
    /// Parses and validates a configuration document. On failure, returns every error found: one
    /// for a document that cannot be read (bad syntax, an unknown field, a value of the wrong
    /// type; its path is that value's), or all that [`Config::validate`] finds.
    pub fn from_json(bytes: &[u8]) -> Result<Config, Vec<ConfigError>> {
        // A JSON string here usually means a double-encoded configuration.
        let found = match bytes.iter().find(|b| !b.is_ascii_whitespace()) {
            Some(b'{') => None,
            None => Some("nothing: the configuration is empty"),
            Some(b'"') => Some("a string (is the configuration JSON-encoded twice?)"),
            Some(b'[') => Some("an array"),
            Some(_) => Some("something else"),
        };
        if let Some(found) = found {
            return Err(vec![ConfigError::new(
                "$",
                format!("expected a JSON object with \"version\": {CONFIG_VERSION}, found {found}"),
            )]);
        }
        let doc = parse_document(bytes).map_err(|e| vec![e])?;
        // The version first, so that a document of another version gets "unsupported version"
        // rather than a confusing unknown-field error.
        match doc.get("version") {
            None => {
                return Err(vec![ConfigError::new(
                    "version",
                    format!("missing; this build reads version {CONFIG_VERSION}"),
                )])
            }
            Some(v) if v.as_u64() != Some(u64::from(CONFIG_VERSION)) => {
                return Err(vec![ConfigError::new(
                    "version",
                    format!("unsupported version {v}; this build reads only version {CONFIG_VERSION}"),
                )])
            }
            Some(_) => {}
        }
        let cfg: Config = read_document(bytes, &doc).map_err(|e| vec![e])?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks what the reader cannot: the version, ranges, address syntax, uniqueness, and references
    /// between fields. Returns every error, in document order within each section.
    pub fn validate(&self) -> Result<(), Vec<ConfigError>> {
        let mut errs = Errors::default();
        if self.version != CONFIG_VERSION {
            errs.push(
                "version",
                format!(
                    "unsupported version {}; this build reads only version {CONFIG_VERSION}",
                    self.version
                ),
            );
        }
        let names = self.validate_models(&mut errs);
        self.validate_endpoints(&names, &mut errs);
        self.poller.validate_into("poller", &mut errs);
        self.filter.validate_into("filter", &mut errs);
        self.priority.validate("priority", &mut errs.0);
        self.saturation.validate("saturation", self.poller.interval_ms, &mut errs.0);
        self.flow_control.validate("flow_control", &mut errs.0);
        self.health.validate("health", &mut errs.0);
        // With `pod_models` (and no allow-list) a rewrite target or weight override may name a model
        // only the pods report (e.g. an adapter loaded at run time).
        let learned_names_allowed = self.pod_models.as_ref().is_some_and(|p| !p.allow_list);
        errs.0.extend(self.scheduler.validate(&|name| {
            learned_names_allowed
                || self.models.iter().any(|m| m.name == name || m.adapters.iter().any(|a| a == name))
        }));
        if let Some(d) = &self.discovery {
            d.kubernetes.validate_into("discovery.kubernetes", &self.models, &mut errs.0);
            d.kubernetes.roles.validate("discovery.kubernetes.roles", &mut errs.0);
        }
        if let Some(pd) = &self.pd {
            pd.validate("pd", &mut errs.0);
        }
        if let Some(p) = &self.pod_models {
            p.validate("pod_models", &mut errs.0);
        }
        if let Some(p) = &self.pool {
            p.validate("pool", &mut errs.0);
        }
        if let Some(p) = &self.peers {
            p.validate("peers", &mut errs.0);
            if self.filter.passthrough_prefixes.iter().any(|x| crate::request::prefix_matches(x, &p.path)) {
                errs.push("peers.path", format!("{:?} is covered by filter.passthrough_prefixes", p.path));
            }
        }
        if errs.0.is_empty() {
            Ok(())
        } else {
            Err(errs.0)
        }
    }

    /// Checks `models` and returns every model and adapter name with what it is, for the checks of
    /// `endpoints[].models`.
    fn validate_models<'a>(&'a self, errs: &mut Errors) -> HashMap<&'a str, NameKind> {
        let mut names: HashMap<&str, NameKind> = HashMap::new();
        if self.models.is_empty() {
            errs.push("models", "at least one model is required");
        }
        // Base names first, so that an adapter named like a later base model is still caught.
        for (i, m) in self.models.iter().enumerate() {
            let path = field(&index("models", i), "name");
            if let Some(reason) = name_problem(&m.name) {
                errs.push(path, reason);
                continue;
            }
            match names.get(m.name.as_str()) {
                Some(NameKind::Base(first)) => errs
                    .push(path, format!("duplicate model name {:?}, first at models[{first}].name", m.name)),
                _ => {
                    names.insert(&m.name, NameKind::Base(i));
                }
            }
        }
        for (i, m) in self.models.iter().enumerate() {
            let model_path = index("models", i);
            for (j, a) in m.adapters.iter().enumerate() {
                let path = index(&field(&model_path, "adapters"), j);
                if let Some(reason) = name_problem(a) {
                    errs.push(path, reason);
                    continue;
                }
                match names.get(a.as_str()) {
                    Some(NameKind::Base(b)) => errs.push(
                        field(&index("models", *b), "name"),
                        format!("model name {a:?} is also an adapter name, at {path}"),
                    ),
                    Some(NameKind::Adapter { model, adapter }) => errs.push(
                        path,
                        format!("duplicate adapter name {a:?}, first at models[{model}].adapters[{adapter}]"),
                    ),
                    None => {
                        names.insert(a, NameKind::Adapter { model: i, adapter: j });
                    }
                }
            }
        }
        names
    }

    fn validate_endpoints(&self, names: &HashMap<&str, NameKind>, errs: &mut Errors) {
        if self.endpoints.is_empty() && self.discovery.is_none() {
            errs.push("endpoints", "at least one endpoint is required (or a `discovery` source)");
        }
        let mut seen: HashMap<SocketAddr, usize> = HashMap::new();
        for (i, ep) in self.endpoints.iter().enumerate() {
            let ep_path = index("endpoints", i);
            let addr_path = field(&ep_path, "address");
            match parse_endpoint_address(&ep.address) {
                Err(reason) => errs.push(addr_path, reason),
                Ok(addr) => {
                    if let Some(first) = seen.get(&addr) {
                        errs.push(
                            addr_path,
                            format!("duplicate address {}, first at endpoints[{first}].address", ep.address),
                        );
                    } else {
                        seen.insert(addr, i);
                    }
                }
            }
            let models_path = field(&ep_path, "models");
            if ep.models.is_empty() {
                errs.push(&models_path, "an endpoint must serve at least one model");
            }
            for (j, name) in ep.models.iter().enumerate() {
                let path = index(&models_path, j);
                if ep.models.iter().take(j).any(|earlier| earlier == name) {
                    errs.push(path, format!("model {name:?} is listed twice"));
                    continue;
                }
                match names.get(name.as_str()) {
                    Some(NameKind::Base(_)) => {}
                    Some(NameKind::Adapter { model, .. }) => {
                        let base = self.models.get(*model).map_or("", |m| m.name.as_str());
                        errs.push(
                            path,
                            format!(
                                "{name:?} is an adapter of {base:?}; list the base model, adapters follow it"
                            ),
                        )
                    }
                    None => errs.push(path, format!("unknown model {name:?}: not a models[].name")),
                }
            }
        }
    }
}

impl PollerConfig {
    fn validate_into(&self, at: &str, errs: &mut Errors) {
        if self.interval_ms < MIN_INTERVAL_MS {
            errs.push(
                field(at, "interval_ms"),
                format!("must be at least {MIN_INTERVAL_MS}, got {}", self.interval_ms),
            );
        }
        if self.timeout_ms < MIN_TIMEOUT_MS {
            errs.push(
                field(at, "timeout_ms"),
                format!(
                    "must be at least {MIN_TIMEOUT_MS} (0 would mean no timeout), got {}",
                    self.timeout_ms
                ),
            );
        }
        if self.stale_after_ms < self.interval_ms {
            errs.push(
                field(at, "stale_after_ms"),
                format!(
                    "must be at least interval_ms ({}), got {}: every endpoint would be stale between polls",
                    self.interval_ms, self.stale_after_ms
                ),
            );
        }
        if self.idle_interval_ms < self.interval_ms {
            errs.push(
                field(at, "idle_interval_ms"),
                format!("must be at least interval_ms ({}), got {}", self.interval_ms, self.idle_interval_ms),
            );
        }
        if self.max_scrapes_per_s == 0 {
            errs.push(field(at, "max_scrapes_per_s"), "must be at least 1, got 0");
        }
        if !(1..=1000).contains(&self.replicas) {
            errs.push(field(at, "replicas"), format!("must be in 1..=1000, got {}", self.replicas));
        }
        if self.cluster.is_empty() {
            errs.push(field(at, "cluster"), "must not be empty");
        }
        if self.mode == PollerMode::Lease && self.lease_ttl_ms < self.interval_ms.saturating_mul(2) {
            errs.push(
                field(at, "lease_ttl_ms"),
                format!(
                    "must be at least twice interval_ms ({}), got {}: the holder renews once per tick",
                    self.interval_ms, self.lease_ttl_ms
                ),
            );
        }
        if !(MIN_RESPONSE_BYTES..=MAX_RESPONSE_BYTES_LIMIT).contains(&self.max_response_bytes) {
            errs.push(
                field(at, "max_response_bytes"),
                format!(
                    "must be in {MIN_RESPONSE_BYTES}..={MAX_RESPONSE_BYTES_LIMIT} (1 KiB to 64 MiB), got {}",
                    self.max_response_bytes
                ),
            );
        }
        if self.metrics_path.is_empty() {
            errs.push(field(at, "metrics_path"), "must not be empty");
        } else if !self.metrics_path.starts_with('/') {
            errs.push(field(at, "metrics_path"), format!("must start with '/', got {:?}", self.metrics_path));
        } else if self.metrics_path.chars().any(|c| c.is_whitespace() || c.is_control()) {
            errs.push(
                field(at, "metrics_path"),
                format!("must not contain whitespace or control characters, got {:?}", self.metrics_path),
            );
        }
    }
}

impl FilterConfig {
    fn validate_into(&self, at: &str, errs: &mut Errors) {
        if !(1..=MAX_BODY_BYTES_LIMIT).contains(&self.max_body_bytes) {
            errs.push(
                field(at, "max_body_bytes"),
                format!("must be in 1..={MAX_BODY_BYTES_LIMIT} (64 MiB), got {}", self.max_body_bytes),
            );
        }
        for (i, prefix) in self.passthrough_prefixes.iter().enumerate() {
            let path = format!("{}[{i}]", field(at, "passthrough_prefixes"));
            if !prefix.starts_with('/') {
                errs.push(path, format!("must start with '/', got {prefix:?}"));
            } else if prefix.contains(['?', '#'])
                || prefix.chars().any(|c| c.is_whitespace() || c.is_control())
            {
                errs.push(
                    path,
                    format!("must be a path without query, whitespace or control characters, got {prefix:?}"),
                );
            } else if let Some(p) =
                crate::request::INFERENCE_PATHS.iter().find(|p| crate::request::prefix_matches(prefix, p))
            {
                errs.push(
                    path,
                    format!("{prefix:?} covers the inference path {p}, which the filter must route"),
                );
            }
        }
    }
}

/// What a name in `models` is.
#[derive(Debug, Clone, Copy)]
enum NameKind {
    /// `models[i].name`.
    Base(usize),
    /// `models[model].adapters[adapter]`.
    Adapter { model: usize, adapter: usize },
}

/// Why a model or adapter name is unusable, if it is.
fn name_problem(name: &str) -> Option<String> {
    if name.is_empty() {
        Some("must not be empty".to_string())
    } else if name.trim() != name {
        // The body's `model` is matched exactly; a stray space would make the name unreachable.
        Some(format!("{name:?} has leading or trailing whitespace"))
    } else {
        None
    }
}

/// Parses `ip:port` as the ORIGINAL_DST cluster needs it: a literal IPv4 or bracketed IPv6
/// address, a port in 1-65535, no hostname, no IPv6 zone.
pub fn parse_endpoint_address(s: &str) -> Result<SocketAddr, String> {
    let addr: SocketAddr = s.parse().map_err(|_| {
        format!(
            "{s:?} is not ip:port (IPv4 like 10.0.0.7:8000 or IPv6 like [fd00::7]:8000); hostnames are not \
             allowed because the ORIGINAL_DST cluster routes to the literal address"
        )
    })?;
    if addr.port() == 0 {
        return Err(format!("{s:?}: port must be in 1-65535"));
    }
    if addr.ip().is_unspecified() {
        return Err(format!("{s:?}: the unspecified address cannot be routed to"));
    }
    if let SocketAddr::V6(v6) = addr {
        if v6.scope_id() != 0 {
            return Err(format!("{s:?}: IPv6 zone ids are not supported"));
        }
    }
    Ok(addr)
}
