//! One scrape's text to [`EndpointMetrics`](crate::state::metrics::EndpointMetrics): `prom`
//! parses the Prometheus text exposition; `engine` maps each engine's metric names (vLLM V0/V1,
//! SGLang, trtllm-serve) onto the metrics, so one scorer works for all.

pub mod engine;
pub mod prom;

pub use engine::{parse_metrics, parse_metrics_with_stats, MetricsError, ParseStats};
