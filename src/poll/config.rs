//! The poller's sections of the configuration: `poller` (the schedule, the scrape, the lease)
//! and `discovery` (Kubernetes pod discovery). `config` reads them from the document and checks
//! them; the poller role reads nothing else but the catalog.

use serde::Serialize;

use crate::base::json::{self, ConfigError};
use crate::base::labels::{is_label_key, is_label_value};
use crate::base::settings::settings;
use crate::state::catalog::Catalog;
use crate::state::catalog::Role;

/// InferencePool allows at most 8 target ports.
pub const MAX_TARGET_PORTS: usize = 8;
/// Shortest allowed `refresh_ms`: listing pods more often than once a second only loads the API
/// server, since readiness probes run every few seconds anyway.
pub const MIN_REFRESH_MS: u64 = 1000;
/// Smallest `poller.interval_ms`: below this the poller itself becomes the load (llm-d#1842 saw
/// vLLM slow down at 50 ms).
pub const MIN_INTERVAL_MS: u64 = 10;

/// Smallest `poller.timeout_ms`. Zero would mean "no timeout" to Envoy, leaving a hung scrape
/// outstanding forever, so it is not allowed.
pub const MIN_TIMEOUT_MS: u64 = 1;

/// Smallest `poller.max_response_bytes` (1 KiB): less cannot hold one engine's routing metrics.
pub const MIN_RESPONSE_BYTES: usize = 1024;

/// Largest `poller.max_response_bytes` (64 MiB).
pub const MAX_RESPONSE_BYTES_LIMIT: usize = 64 * 1024 * 1024;

settings! {
    /// The poller: the one VM that scrapes every endpoint's metrics and publishes the snapshot.
    #[derive(Debug, Clone, PartialEq)]
    pub struct PollerConfig {
        /// How often each endpoint's metrics are scraped, in ms. At least 10. Default 200: GIE polls
        /// every 50 ms, but llm-d#1842 showed polling that fast slows vLLM itself; the router-local
        /// in-flight count covers the gap between polls.
        #[range(min = MIN_INTERVAL_MS)]
        pub interval_ms: u64 = 200,
        /// Timeout of one scrape, in ms. At least 1. Default 1000. A scrape still outstanding is
        /// never started again.
        #[range(min = MIN_TIMEOUT_MS)]
        #[reason = "must be at least {min} (0 would mean no timeout), got {v}"]
        pub timeout_ms: u64 = 1000,
        /// An endpoint whose last successful scrape is older than this, in ms, is stale. At least
        /// `interval_ms`. Default 1000.
        pub stale_after_ms: u64 = 1000,
        /// Name of the Envoy ORIGINAL_DST cluster (with `use_http_header`) that scrapes go through.
        /// Default `inference_pool_metrics`.
        #[schema(length(min = 1))]
        pub cluster: String = String::from("inference_pool_metrics"),
        /// Path of the metrics endpoint on every model server; starts with `/`. Default `/metrics`.
        #[schema(regex(pattern = r"^/\S*$"))]
        pub metrics_path: String = String::from("/metrics"),
        /// Which root context polls. Default `singleton`. See [`PollerMode`].
        pub mode: PollerMode = PollerMode::Singleton,
        /// `lease` mode only: how long one renewal of the poller lease is valid. Default 1000 ms. A
        /// poller that stops renewing is replaced within `lease_ttl_ms + 2 × interval_ms`; a shorter
        /// ttl replaces it sooner but a worker stalled for longer than the ttl loses the lease. Must
        /// be at least twice `interval_ms` (the tick that renews it).
        pub lease_ttl_ms: u64 = 1000,
        /// Largest callout response read, in bytes: a `/metrics` answer, and the Kubernetes pod list
        /// when discovery is on. 1024 to 67108864. Default 4194304 (4 MiB). A larger response is not
        /// read at all: the scrape (or pod list) counts as failed, with an error log and
        /// `inference_picker_scrape_failures_total;reason=too_large` (or
        /// `inference_picker_discovery_failures_total;reason=too_large`). It bounds the memory a
        /// misbehaving server can make the poller allocate (in lease mode, inside a worker VM).
        #[range(min = MIN_RESPONSE_BYTES, max = MAX_RESPONSE_BYTES_LIMIT)]
        #[reason = "must be in {min}..={max} (1 KiB to 64 MiB), got {v}"]
        pub max_response_bytes: usize = 4 * 1024 * 1024,
        /// The slowest an endpoint is scraped, in ms: one that is idle and unchanged (no request of
        /// this gateway in flight there, the same queue, running and KV use as its previous scrape)
        /// is scraped at twice its previous interval, up to this. Any change, a request of this
        /// gateway, or a failure brings it back to `interval_ms`. At least `interval_ms`; equal to
        /// it polls every endpoint every `interval_ms` as before. Default 5000 (an idle 1,024-pod
        /// pool then costs about 200 scrapes/s). Load that other gateway replicas (or clients that
        /// bypass the gateway) send to an idle pod is seen at most this late.
        pub idle_interval_ms: u64 = 5000,
        /// Upper bound on scrapes per second from this gateway. When the endpoints' intervals ask for
        /// more, every interval is stretched by the same factor (and readers' staleness limits with
        /// it). At least 1. Default 2000 (about 1,000 busy endpoints at 500 ms).
        #[range(min = 1)]
        pub max_scrapes_per_s: u32 = 2000,
        /// How many gateway replicas poll the same pods. Each replica scrapes an endpoint that it does
        /// not send to at `replicas` times the interval (`interval_ms` when its load moves,
        /// `idle_interval_ms` when idle), so the pods see about the scrape rate of one gateway
        /// whatever the number of replicas; an endpoint a replica sends to is still scraped every
        /// `interval_ms` by that replica, and its own in-flight estimate covers the gaps. It also
        /// scales the rendezvous credit (`scheduler.predicted.rendezvous_credit`; none with 1), so
        /// set it to the number of gateway replicas. 1 to 1000.
        /// Default 1. On the whole replay traces (5 seeds) fixed polling beat the idle back-off
        /// at 4 replicas × 4 workers on Mooncake and shared-prefix-slow (docs/benchmark.md): with
        /// several replicas, set `idle_interval_ms` = `interval_ms`.
        #[range(min = 1, max = 1000)]
        pub replicas: u32 = 1,
    }
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

json::from_json_enum!(PollerMode { "singleton" => Singleton, "lease" => Lease });

settings! {
    /// Endpoint discovery sources. Exactly one source for now.
    #[derive(Debug, Clone, PartialEq)]
    pub struct DiscoveryConfig {
        /// List the pool's pods from the Kubernetes API, like an InferencePool does.
        pub kubernetes: KubernetesDiscoveryConfig,
    }
}

settings! {
    /// Pod discovery through the Kubernetes API (`GET /api/v1/namespaces/NS/pods?labelSelector=...`),
    /// sent by the poller with `dispatch_http_call` through an Envoy cluster. See `discovery.rs`.
    #[derive(Debug, Clone, PartialEq)]
    pub struct KubernetesDiscoveryConfig {
        /// Namespace of the model-server pods (the InferencePool's namespace).
        pub namespace: String,
        /// Equality label selector (InferencePool `spec.selector.matchLabels`); at least one label.
        pub selector: std::collections::BTreeMap<String, String>,
        /// Ports on each pod (InferencePool `spec.targetPorts`), 1 to 8; each port is its own endpoint.
        #[schema(length(min = 1, max = MAX_TARGET_PORTS))]
        pub target_ports: Vec<u16>,
        /// Base models (from `models`) every discovered endpoint serves. Default: all of `models`.
        pub models: Vec<String> = Vec::new(),
        /// The Envoy cluster that reaches the API server (TLS to kubernetes.default.svc:443).
        pub api_cluster: String = String::from("kubernetes_api"),
        /// `:authority` of the API request. Default `kubernetes.default.svc`.
        pub api_authority: String = String::from("kubernetes.default.svc"),
        /// Bearer token, inline. Prefer `token_env`. At most one of the two; neither sends no
        /// `authorization` header (for an API proxy that adds it).
        pub token: Option<String> = None,
        /// Name of a VM environment variable holding the bearer token (Envoy
        /// `vm_config.environment_variables`, Istio `vmConfig.env`).
        pub token_env: Option<String> = None,
        /// How often the pod list is fetched again, in ms. At least 1000. Default 5000.
        #[range(min = MIN_REFRESH_MS)]
        #[reason = "{v} is below the minimum {min}"]
        pub refresh_ms: u64 = 5000,
        /// Timeout of one list request, in ms: 1 to `refresh_ms`. Default 2000.
        pub timeout_ms: u64 = 2000,
        /// How a pod's role (for `pd`) is read from its labels. Default: llm-d's label
        /// `llm-d.ai/role` with the values `prefill`, `decode`, `both` and `prefill-decode`.
        #[serde(skip_serializing_if = "RoleSelectors::is_default")]
        pub roles: RoleSelectors = RoleSelectors::default(),
    }
}

/// What the poller role reads: `poller`, Kubernetes discovery when configured, and the catalog.
/// `config` builds it (`From<&Config>`).
#[derive(Debug, Clone, Copy)]
pub struct Setup<'a> {
    pub poller: &'a PollerConfig,
    pub discovery: Option<&'a KubernetesDiscoveryConfig>,
    pub catalog: Catalog<'a>,
}

/// The pod label llm-d puts the role in.
pub const LLMD_ROLE_LABEL: &str = "llm-d.ai/role";

settings! {
    /// Label selectors per role for discovered pods (`discovery.kubernetes.roles`): a pod whose
    /// `label` has a value in `prefill`, `decode` or `both` gets that role; a pod without the label
    /// or with another value is `decode` (llm-d's decode filter also takes unlabelled pods).
    #[derive(Debug, Clone, PartialEq)]
    pub struct RoleSelectors {
        /// The pod label holding the role. Default `llm-d.ai/role`.
        #[schema(length(min = 1))]
        pub label: String = String::from(LLMD_ROLE_LABEL),
        /// Values meaning `prefill`. Default `["prefill"]`.
        pub prefill: Vec<String> = vec!["prefill".into()],
        /// Values meaning `decode`. Default `["decode"]`.
        pub decode: Vec<String> = vec!["decode".into()],
        /// Values meaning `both`. Default `["both", "prefill-decode"]`.
        pub both: Vec<String> = vec!["both".into(), "prefill-decode".into()],
    }
}

impl RoleSelectors {
    pub fn is_default(&self) -> bool {
        *self == RoleSelectors::default()
    }

    /// The role of a pod whose role label has `value` (`None`: no such label).
    pub fn role_of(&self, value: Option<&str>) -> Role {
        let Some(v) = value else { return Role::Decode };
        let has = |list: &[String]| list.iter().any(|x| x == v);
        if has(&self.prefill) {
            Role::Prefill
        } else if has(&self.both) {
            Role::Both
        } else {
            Role::Decode
        }
    }

    pub fn validate(&self, path: &str, errs: &mut Vec<ConfigError>) {
        if !is_label_key(&self.label) {
            errs.push(ConfigError::new(format!("{path}.label"), "not a Kubernetes label key"));
        }
        let lists = [("prefill", &self.prefill), ("decode", &self.decode), ("both", &self.both)];
        for (i, (name, list)) in lists.iter().enumerate() {
            for (j, v) in list.iter().enumerate() {
                let at = format!("{path}.{name}[{j}]");
                if !is_label_value(v) || v.is_empty() {
                    errs.push(ConfigError::new(at.clone(), "not a non-empty Kubernetes label value"));
                }
                if lists.iter().skip(i + 1).any(|(_, other)| other.contains(v))
                    || list.iter().take(j).any(|x| x == v)
                {
                    errs.push(ConfigError::new(at, format!("`{v}` is listed twice")));
                }
            }
        }
    }
}
