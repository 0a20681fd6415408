//! Model-server metrics, normalised across engines.
//!
//! The scrape (`poll::scrape`) maps each engine's metric names onto [`EndpointMetrics`], so one
//! scorer works for all.

use serde::{Deserialize, Serialize};

/// Which engine produced the metrics (detected from the metric names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    #[default]
    Unknown,
    Vllm,
    Sglang,
    Trtllm,
}

/// The routing signals of one endpoint. `None` means the engine did not report that signal;
/// scorers treat a missing signal as neutral, never as "idle".
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointMetrics {
    #[serde(rename = "e", default)]
    pub engine: Engine,
    /// Requests waiting in the engine's queue.
    #[serde(rename = "q", default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<f64>,
    /// Requests running (in the batch).
    #[serde(rename = "r", default, skip_serializing_if = "Option::is_none")]
    pub running: Option<f64>,
    /// KV-cache use in [0, 1].
    #[serde(rename = "kv", default, skip_serializing_if = "Option::is_none")]
    pub kv_usage: Option<f64>,
    /// KV block size in tokens (`vllm:cache_config_info{block_size}`, SGLang's page size,
    /// TensorRT-LLM's tokens per block).
    #[serde(rename = "bs", default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// KV blocks on the GPU (`vllm:cache_config_info{num_gpu_blocks}`), summed over the server's
    /// data-parallel engines.
    #[serde(rename = "nb", default, skip_serializing_if = "Option::is_none")]
    pub num_gpu_blocks: Option<u64>,
    /// LoRA slots (`vllm:lora_requests_info{max_lora}`).
    #[serde(rename = "ml", default, skip_serializing_if = "Option::is_none")]
    pub max_lora: Option<u32>,
    /// Adapters with running requests (newest `lora_requests_info` series).
    #[serde(rename = "ra", default, skip_serializing_if = "Vec::is_empty")]
    pub running_adapters: Vec<String>,
    /// Adapters with waiting requests (newest `lora_requests_info` series).
    #[serde(rename = "wa", default, skip_serializing_if = "Vec::is_empty")]
    pub waiting_adapters: Vec<String>,
}
