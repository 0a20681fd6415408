//! The one JSON configuration document, read by both roles (filter and poller).
//!
//! Parsed once in `on_configure` with serde (`deny_unknown_fields` everywhere, an explicit
//! `version`), then validated by [`Config::validate`]. Optional fields have documented defaults,
//! set per field; there is no blanket `#[serde(default)]` on a struct that could hide a typo.

use serde::{Deserialize, Serialize};

pub use crate::scheduler::config::SchedulerConfig;

/// The only configuration version this build understands.
pub const CONFIG_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Must be 1.
    pub version: u32,
    /// The pool's endpoints and the base models each serves.
    pub endpoints: Vec<EndpointConfig>,
    /// The base models the pool serves, with their LoRA adapters.
    pub models: Vec<ModelConfig>,
    #[serde(default = "PollerConfig::default")]
    pub poller: PollerConfig,
    #[serde(default = "FilterConfig::default")]
    pub filter: FilterConfig,
    /// Scorer weights, prefix/session/guard settings and model rewrites (see `crate::scheduler`).
    #[serde(default = "SchedulerConfig::default")]
    pub scheduler: SchedulerConfig,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointConfig {
    /// `ip:port` of the model server (IPv4 or bracketed IPv6).
    pub address: String,
    /// Names of base models (from `models`) this endpoint serves.
    pub models: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The name clients put in the body's `model`.
    pub name: String,
    /// LoRA adapters on this base model; any endpoint of the base can load them.
    #[serde(default)]
    pub adapters: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PollerConfig {
    /// How often each endpoint's /metrics is scraped. Default 200 ms: GIE polls every 50 ms, but
    /// llm-d #1842 showed that polling that fast slows vLLM itself; the router-local in-flight
    /// count covers the gap between polls.
    #[serde(default = "default_interval_ms")]
    pub interval_ms: u64,
    /// Timeout of one scrape. Default 1000 ms. A scrape still outstanding is never started again.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// An endpoint whose last successful scrape is older than this is stale. Default 1000 ms.
    #[serde(default = "default_stale_after_ms")]
    pub stale_after_ms: u64,
    /// The Envoy ORIGINAL_DST cluster (use_http_header) that scrapes go through.
    #[serde(default = "default_metrics_cluster")]
    pub cluster: String,
    /// Path of the metrics endpoint on every model server.
    #[serde(default = "default_metrics_path")]
    pub metrics_path: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FailureMode {
    /// No fresh metrics: route by in-flight count among the endpoints that serve the model.
    FailOpen,
    /// No fresh metrics: answer 503.
    FailClose,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilterConfig {
    /// Largest request body buffered, in bytes; larger gets 413. Default 4 MiB. Envoy's own
    /// per-connection buffer limit must be at least this.
    #[serde(default = "default_max_body_bytes")]
    pub max_body_bytes: usize,
    /// What to do when no endpoint has fresh metrics. Default FailClose (503), as GIE.
    #[serde(default = "default_failure_mode")]
    pub failure_mode: FailureMode,
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
        }
    }
}

impl Default for FilterConfig {
    fn default() -> Self {
        Self { max_body_bytes: default_max_body_bytes(), failure_mode: default_failure_mode() }
    }
}

/// A configuration error: the JSON path of the bad field and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub path: String,
    pub reason: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.reason)
    }
}

impl Config {
    /// Parses and validates a configuration document.
    pub fn from_json(bytes: &[u8]) -> Result<Config, Vec<ConfigError>> {
        let cfg: Config = serde_json::from_slice(bytes).map_err(|e| {
            vec![ConfigError {
                path: format!("line {} column {}", e.line(), e.column()),
                reason: e.to_string(),
            }]
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks what serde cannot: versions, references between fields, ranges, addresses.
    pub fn validate(&self) -> Result<(), Vec<ConfigError>> {
        let mut errs = Vec::new();
        if self.version != CONFIG_VERSION {
            errs.push(ConfigError {
                path: "version".into(),
                reason: format!("unsupported version {}, this build reads {}", self.version, CONFIG_VERSION),
            });
        }
        errs.extend(self.scheduler.validate(&|name| {
            self.models.iter().any(|m| m.name == name || m.adapters.iter().any(|a| a == name))
        }));
        if errs.is_empty() {
            Ok(())
        } else {
            Err(errs)
        }
    }
}
