//! The one JSON configuration document, read by both roles (filter and poller).
//!
//! Parsed once in `on_configure` by [`Config::from_json`]: serde_json parses the document into a
//! `Value`, the explicit `version` is checked, and the configuration types read themselves from it
//! ([`read`]: unknown fields are errors everywhere), then [`Config::validate`] reports every
//! problem at once, each with the JSON path of the bad field (`endpoints[2].address`) and a
//! reason. The scheduler then builds its model lookup once (`scheduler::models::ModelTable`) and
//! only reads it per request.
//!
//! The field reference is `docs/configuration.md` and the JSON Schema is
//! `filter-config/schema.json`, both generated from the `settings!` declarations (feature `schema`,
//! `tools/config-schema`) and kept equal to them by tests.
//!
//! # Adding a field
//! 1. Declare it once, in its section's `settings!` block (`crate::base::settings`), in the
//!    section's own config file: a `///` doc (the schema's description and the reference's text),
//!    `name: Type = default` (no `= default` when it is required), and, for a simple inclusive
//!    bound, `#[range(min = .., max = ..)]` (with `#[reason = ".."]` when the error needs its own
//!    words). That gives the struct field, its `Default`, the reader (a key not declared is an
//!    unknown field), the schema's default, description and bounds, the range check and its row
//!    in the reference. Other schema keywords go in `#[schema(...)]`.
//! 2. Call the section's `validate_ranges` (or `validate_fields`) from its `validate` if it does
//!    not yet, and add the checks a range cannot say (between fields, syntax) there by hand, with
//!    a negative test in `config/tests.rs` that asserts the exact path and a reason substring.
//! 3. Regenerate: `make schema config-docs` (`filter-config/schema.json`, `docs/configuration.md`);
//!    tests fail while either is out of date.

pub mod live;
mod locate;
#[cfg(test)]
mod tests;

use hashbrown::HashMap;
use std::net::SocketAddr;

pub use crate::base::json::describe_errors;
use crate::base::json::{self, ConfigError};
use crate::base::settings::settings;

pub use crate::poll::config::{
    DiscoveryConfig, KubernetesDiscoveryConfig, PollerConfig, PollerMode, MAX_RESPONSE_BYTES_LIMIT,
    MIN_INTERVAL_MS, MIN_RESPONSE_BYTES, MIN_TIMEOUT_MS,
};
pub use crate::request::config::{FilterConfig, MAX_BODY_BYTES_LIMIT};
pub use crate::scheduler::config::{FailureMode, SchedulerConfig};

use crate::flow::priority::PriorityConfig;
use crate::flow::saturation::SaturationConfig;
use crate::flow::FlowControlConfig;
pub use crate::state::catalog::{parse_endpoint_address, Catalog, Criticality, EndpointConfig, ModelConfig};
use crate::state::health::HealthConfig;

/// The only configuration version this build understands.
pub const CONFIG_VERSION: u32 = 1;

settings! {
    /// Configuration of the inference-picker module: the same document for the HTTP filter and the
    /// poller.
    #[derive(Debug, Clone, PartialEq)]
    // `endpoints` needs an entry only when there is no `discovery`.
    #[cfg_attr(
        feature = "schema",
        schemars(extend(
            "if" = serde_json::json!({"not": {"required": ["discovery"], "properties": {"discovery": {"type": "object"}}}}),
            "then" = serde_json::json!({"properties": {"endpoints": {"minItems": 1}}})
        ))
    )]
    pub struct Config {
        /// Version of this document's format. Must be 1.
        #[schema(extend("const" = CONFIG_VERSION))]
        pub version: u32,
        /// The pool's endpoints (model servers) and the base models each serves. At least one, unless
        /// `discovery` is set.
        pub endpoints: Vec<EndpointConfig>,
        /// The base models the pool serves, with their LoRA adapters. At least one.
        #[schema(length(min = 1))]
        pub models: Vec<ModelConfig>,
        /// How the poller scrapes the endpoints' metrics. Default: every field at its default.
        pub poller: PollerConfig = PollerConfig::default(),
        /// How the HTTP filter treats requests. Default: every field at its default.
        pub filter: FilterConfig = FilterConfig::default(),
        /// Scorer weights, prefix/session/guard settings and model rewrites (see `crate::scheduler`).
        pub scheduler: SchedulerConfig = SchedulerConfig::default(),
        /// Where a request's priority comes from and which priority headers are trusted (see
        /// `crate::flow::priority`). Default: the model's criticality only, no header trusted.
        pub priority: PriorityConfig = PriorityConfig::default(),
        /// When the endpoints of a model have no room (see `crate::flow::saturation`). Default: GIE's
        /// thresholds.
        pub saturation: SaturationConfig = SaturationConfig::default(),
        /// Holding requests inside the proxy while their endpoints are saturated (see `crate::flow`).
        /// Default: every field at its default (off: `enabled` is false).
        pub flow_control: FlowControlConfig = FlowControlConfig::default(),
        /// Passive health from upstream results (ejection with back-off) and the startup hold (see
        /// `crate::state::health`). Default: every field at its default (on).
        pub health: HealthConfig = HealthConfig::default(),
        /// Where endpoints come from besides `endpoints`. Default: none (only the static list).
        pub discovery: Option<DiscoveryConfig> = None,
        /// Learn which models and LoRA adapters each pod serves from the pod itself (its
        /// `/v1/models` and LoRA metrics; see `crate::poll::pod_models`). Default: none (only the
        /// configured models, each pod assumed to serve what `endpoints` or discovery says).
        pub pod_models: Option<crate::poll::pod_models::PodModelsConfig> = None,
        /// This instance's pool on a gateway with several pools, and body-based routing between them
        /// (see `crate::request::pools`). Default: none (one unnamed pool; every request reaching the filter
        /// is its own).
        pub pool: Option<crate::request::pools::PoolConfig> = None,
        /// Disaggregated prefill/decode, llm-d's protocol (see `crate::request::pd` and `docs/pd.md`).
        /// Default: none (endpoint roles are ignored and no request is split).
        #[serde(skip_serializing_if = "Option::is_none")]
        pub pd: Option<crate::request::config::PdConfig> = None,
        /// The other replicas of this gateway, with which it exchanges its prefix table (see
        /// `crate::poll::peers`). Default: none (replicas share nothing).
        #[serde(skip_serializing_if = "Option::is_none")]
        pub peers: Option<crate::poll::peers::PeersConfig> = None,
    }
}

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

/// Settings that were removed: (section, field, why). A document that still sets one gets this
/// error rather than serde's unknown-field one, so its operator learns the setting is gone.
const REMOVED_SETTINGS: &[(&str, &str, &str)] = &[(
    "peers",
    "load_interval_ms",
    "was removed: replicas no longer exchange in-flight counts (they exchange placements, \
     docs/peers.md); delete this setting",
)];

/// The error for the first removed setting `doc` sets, if any ([`REMOVED_SETTINGS`]).
fn removed_setting(doc: &serde_json::Value) -> Option<ConfigError> {
    REMOVED_SETTINGS.iter().find_map(|(section, field, why)| {
        doc.get(section)?.get(field)?;
        Some(ConfigError::new(format!("{section}.{field}"), *why))
    })
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

impl<'a> From<&'a Config> for crate::poll::config::Setup<'a> {
    fn from(cfg: &'a Config) -> Self {
        crate::poll::config::Setup {
            poller: &cfg.poller,
            discovery: cfg.discovery.as_ref().map(|d| &d.kubernetes),
            catalog: cfg.catalog(),
        }
    }
}

impl<'a> From<&'a Config> for crate::flow::admission::Setup<'a> {
    fn from(cfg: &'a Config) -> Self {
        crate::flow::admission::Setup {
            flow: &cfg.flow_control,
            saturation: &cfg.saturation,
            stale_after_ms: cfg.poller.stale_after_ms,
            startup_wait_ms: cfg.health.startup_wait_ms,
        }
    }
}

impl<'a> From<&'a Config> for crate::scheduler::config::Setup<'a> {
    fn from(cfg: &'a Config) -> Self {
        crate::scheduler::config::Setup {
            scheduler: &cfg.scheduler,
            catalog: cfg.catalog(),
            stale_after_ms: cfg.poller.stale_after_ms,
            replicas: cfg.poller.replicas,
            peers: cfg.peers.is_some(),
            failure_mode: cfg.filter.failure_mode,
            health: &cfg.health,
        }
    }
}

impl Config {
    /// What the request path reads.
    pub fn request(&self) -> crate::request::config::Settings<'_> {
        crate::request::config::Settings {
            filter: &self.filter,
            session_header: &self.scheduler.session.header,
            priority: &self.priority,
            prefix: &self.scheduler.prefix,
            pd: self.pd.as_ref(),
            catalog: self.catalog(),
            retry_after_s: self.flow_control.retry_after_s,
        }
    }

    /// The catalog every wing reads: endpoints, models, and how pods' own model lists count.
    pub fn catalog(&self) -> Catalog<'_> {
        Catalog {
            endpoints: &self.endpoints,
            models: &self.models,
            discovered_models: self.discovery.as_ref().map_or(&[], |d| d.kubernetes.models.as_slice()),
            learn_models: self.pod_models.is_some(),
            allow_listed: self.pod_models.as_ref().is_some_and(|p| p.allow_list),
        }
    }

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
        if let Some(e) = removed_setting(&doc) {
            return Err(vec![locate::with_position(bytes, e)]);
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
        crate::request::session::validate(
            &self.request(),
            &self.scheduler.session.token_header,
            "filter.session_headers",
            &mut errs.0,
        );
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
            if self
                .filter
                .passthrough_prefixes
                .iter()
                .any(|x| crate::request::protocol::prefix_matches(x, &p.path))
            {
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
        self.validate_ranges(at, &mut errs.0);
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
        self.validate_ranges(at, &mut errs.0);
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
            } else if let Some(p) = crate::request::protocol::INFERENCE_PATHS
                .iter()
                .find(|p| crate::request::protocol::prefix_matches(prefix, p))
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
