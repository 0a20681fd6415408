//! The versioned snapshot the poller publishes and the filter reads.
//!
//! Shared-data layout (bounded: two keys, whatever the pool size):
//! - [`SNAPSHOT_KEY`]: the JSON-encoded [`Snapshot`];
//! - [`SNAPSHOT_VERSION_KEY`]: the snapshot's version as decimal text, so that a worker can see
//!   cheaply (a few bytes copied) whether its cached, decoded snapshot is still current.

use serde::{Deserialize, Serialize};

use crate::metrics::EndpointMetrics;

pub const SNAPSHOT_KEY: &str = "inference-picker/snapshot";
pub const SNAPSHOT_VERSION_KEY: &str = "inference-picker/snapshot-version";

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Snapshot {
    /// Increases by one on every publish.
    pub version: u64,
    /// When the poller published it (ms since the epoch).
    pub published_ms: u64,
    pub endpoints: Vec<EndpointStatus>,
}

/// One endpoint as the poller last saw it.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointStatus {
    /// `ip:port`, exactly as sent in `x-gateway-destination-endpoint`.
    pub address: String,
    /// Base models this endpoint serves (from config or discovery).
    pub models: Vec<String>,
    /// Metrics from the last successful scrape, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<EndpointMetrics>,
    /// When the last successful scrape finished (ms since the epoch); 0 = never.
    pub scraped_ms: u64,
    /// Consecutive failed scrapes since the last success.
    pub failures: u32,
}
