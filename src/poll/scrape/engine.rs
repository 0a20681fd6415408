//! Maps one `/metrics` body onto [`EndpointMetrics`]: detects the engine from the metric names and
//! normalises its routing signals, in one pass over the text.
//!
//! # Mapping per engine
//! | signal | vLLM (V1, V0) | SGLang | trtllm-serve | Triton TRT-LLM backend |
//! |---|---|---|---|---|
//! | `queue` | Σ `vllm:num_requests_waiting` | Σ `sglang:num_queue_reqs` | Σ `trtllm_num_requests_waiting` | Σ `nv_trt_llm_request_metrics{request_type="waiting"}` |
//! | `running` | Σ `vllm:num_requests_running` | Σ `sglang:num_running_reqs` | Σ `trtllm_num_requests_running` | Σ `nv_trt_llm_request_metrics{request_type="scheduled"}` |
//! | `kv_usage` | mean `vllm:kv_cache_usage_perc`, else mean `vllm:gpu_cache_usage_perc` (V0, early V1) | mean `sglang:token_usage`, else Σ`sglang:num_used_tokens` ÷ Σ`sglang:max_total_num_tokens` | mean `trtllm_kv_cache_utilization` | mean `nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"}`, else Σ`used` ÷ Σ`max` |
//! | `block_size` | `vllm:cache_config_info` label `block_size` | `sglang:page_size` | `trtllm_kv_cache_tokens_per_block` | `...{kv_cache_block_type="tokens_per"}` |
//! | `num_gpu_blocks` | Σ `vllm:cache_config_info` label `num_gpu_blocks` | Σ `sglang:num_pages`, else Σ`sglang:max_total_num_tokens` ÷ page size | Σ `trtllm_kv_cache_max_blocks` | Σ `...{kv_cache_block_type="max"}` |
//! | LoRA | `vllm:lora_requests_info{max_lora,running_lora_adapters,waiting_lora_adapters}` | — | — | — |
//!
//! trtllm-serve names are also accepted with the `trtllm:` prefix (Dynamo's spelling). Both
//! TensorRT-LLM front ends report [`Engine::Trtllm`].
//!
//! # Aggregating several series of one metric
//! One server can expose several series of the same metric:
//! - vLLM has one series per data-parallel engine (`engine="0"`, `"1"`, ...) and may split by
//!   `model_name`; SGLang splits by `dp_rank` (and `priority`); Triton by `model`/`version`.
//! - **Counts are summed** (Σ): each series counts distinct requests of the same server, and the
//!   server is what the router picks.
//! - **KV use is averaged** (mean): each data-parallel engine owns an equal-sized cache and the
//!   server balances requests over them, so the mean is the used fraction of the server's whole
//!   cache. Each series is clamped to [0, 1] before averaging so that one bad engine cannot offset
//!   another. `num_gpu_blocks` is summed for the same reason (the server's whole cache);
//!   `block_size` is the same for every engine, so the first series gives it.
//! - **Replicated series are counted once.** SGLang with `--enable-metrics-for-all-schedulers`
//!   exports the same scheduler state once per tensor/pipeline/expert-parallel rank (`tp_rank`,
//!   `pp_rank`, `moe_ep_rank`); summing those would multiply the queue by the TP size, so for
//!   SGLang series that differ only in those labels are one series (the first is kept). For every
//!   engine, a repeated identical label set (invalid exposition) is also counted once.
//! - **LoRA:** the value of `vllm:lora_requests_info` is the time of its last update, and old label
//!   combinations linger, so only the series with the newest (largest finite) value is read; on a
//!   tie the first wins. Adapter lists are comma-separated; empty items are dropped.
//!
//! # Missing signals
//! - A NaN or ±Inf value is missing, never 0: it is left out of a mean, and it makes a sum `None`
//!   (a sum with a missing part would read a busy engine as idle). A negative count is treated the
//!   same way. A label that should hold a number but does not (`num_gpu_blocks="None"` before
//!   vLLM has profiled memory) is missing too.
//! - A signal no series reports is `None`; scorers treat it as neutral.
//! - If the body holds metrics of several engines, the engine with the most of `queue`, `running`
//!   and `kv_usage` present wins (ties: vLLM, SGLang, trtllm-serve, Triton).
//! - If no engine yields any of `queue`, `running` or `kv_usage`, the result is
//!   [`MetricsError::NoKnownMetrics`]: a wrong metrics path, a body that is not a model server's,
//!   a truncated body, or all-NaN values. The poller must then keep the endpoint's last metrics and
//!   let them go stale, rather than read the endpoint as idle.
//!
//! Lines that do not parse are skipped and counted ([`ParseStats`]), see [`super::prom`].

use std::fmt;

use hashbrown::HashSet;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use super::prom::{Labels, LineError, Samples};
use crate::state::metrics::{EndpointMetrics, Engine};

/// Why a metrics body could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricsError {
    /// No known queue, running or KV-use metric with a usable value.
    NoKnownMetrics,
}

impl fmt::Display for MetricsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetricsError::NoKnownMetrics => {
                f.write_str("no known model-server metric (vLLM, SGLang, TensorRT-LLM) with a usable value")
            }
        }
    }
}

impl std::error::Error for MetricsError {}

/// What the pass over the text saw, for logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ParseStats {
    /// Samples of known metrics that were read.
    pub known_samples: usize,
    /// Garbled lines skipped.
    pub skipped_lines: usize,
    /// The first garbled line: its 1-based number and the reason.
    pub first_error: Option<(usize, LineError)>,
}

/// Detects the engine and normalises its signals. See the module doc for the mapping.
pub fn parse_metrics(text: &str) -> Result<EndpointMetrics, MetricsError> {
    parse_metrics_with_stats(text).0
}

/// [`parse_metrics`], plus what the parser saw (for a log line when lines were skipped).
pub fn parse_metrics_with_stats(text: &str) -> (Result<EndpointMetrics, MetricsError>, ParseStats) {
    let mut acc = Acc::default();
    let mut stats = ParseStats::default();
    let mut samples = Samples::with_filter(text, |name: &str| classify(name).is_some());
    for s in samples.by_ref() {
        let Some(known) = classify(s.name) else { continue };
        stats.known_samples += 1;
        acc.add(known, s.labels, s.value);
    }
    stats.skipped_lines = samples.skipped();
    stats.first_error = samples.first_error();
    (acc.finish(), stats)
}

/// The metrics this module reads. Anything else is skipped after its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Known {
    VllmWaiting,
    VllmRunning,
    VllmKv,
    VllmKvV0,
    VllmCacheConfig,
    VllmLora,
    SglQueue,
    SglRunning,
    SglTokenUsage,
    SglUsedTokens,
    SglMaxTotalTokens,
    SglPageSize,
    SglNumPages,
    TrtWaiting,
    TrtRunning,
    TrtKv,
    TrtTokensPerBlock,
    TrtMaxBlocks,
    TritonRequests,
    TritonKvBlocks,
}

fn classify(name: &str) -> Option<Known> {
    use Known::*;
    Some(match name {
        "vllm:num_requests_waiting" => VllmWaiting,
        "vllm:num_requests_running" => VllmRunning,
        "vllm:kv_cache_usage_perc" => VllmKv,
        "vllm:gpu_cache_usage_perc" => VllmKvV0,
        "vllm:cache_config_info" => VllmCacheConfig,
        "vllm:lora_requests_info" => VllmLora,
        "sglang:num_queue_reqs" => SglQueue,
        "sglang:num_running_reqs" => SglRunning,
        "sglang:token_usage" => SglTokenUsage,
        "sglang:num_used_tokens" => SglUsedTokens,
        "sglang:max_total_num_tokens" => SglMaxTotalTokens,
        "sglang:page_size" => SglPageSize,
        "sglang:num_pages" => SglNumPages,
        "nv_trt_llm_request_metrics" => TritonRequests,
        "nv_trt_llm_kv_cache_block_metrics" => TritonKvBlocks,
        _ => {
            let rest = name.strip_prefix("trtllm_").or_else(|| name.strip_prefix("trtllm:"))?;
            match rest {
                "num_requests_waiting" => TrtWaiting,
                "num_requests_running" => TrtRunning,
                "kv_cache_utilization" => TrtKv,
                "kv_cache_tokens_per_block" => TrtTokensPerBlock,
                "kv_cache_max_blocks" => TrtMaxBlocks,
                _ => return None,
            }
        }
    })
}

/// A sum over series that is unknown as soon as one part is unknown.
#[derive(Debug, Default)]
struct Sum {
    total: f64,
    parts: u32,
    missing_part: bool,
}

impl Sum {
    fn add(&mut self, v: f64) {
        if v.is_finite() && v >= 0.0 {
            self.total += v;
            self.parts += 1;
        } else {
            self.missing_part = true;
        }
    }

    fn get(&self) -> Option<f64> {
        // The total of finite parts can still overflow to +Inf.
        (self.parts > 0 && !self.missing_part && self.total.is_finite()).then_some(self.total)
    }
}

/// The mean of the finite series, each clamped to [0, 1].
#[derive(Debug, Default)]
struct Mean {
    total: f64,
    parts: u32,
}

impl Mean {
    fn add(&mut self, v: f64) {
        if v.is_finite() {
            self.total += v.clamp(0.0, 1.0);
            self.parts += 1;
        }
    }

    fn get(&self) -> Option<f64> {
        (self.parts > 0).then(|| (self.total / f64::from(self.parts)).clamp(0.0, 1.0))
    }
}

/// The first usable value of a per-server constant (block size).
fn set_once(slot: &mut Option<u32>, v: Option<u64>) {
    if slot.is_none() {
        *slot = v.and_then(|v| u32::try_from(v).ok()).filter(|v| *v > 0);
    }
}

/// A non-negative whole number from a sample value.
fn count_from_f64(v: f64) -> Option<u64> {
    // 2^64 as f64; anything at or above it does not fit.
    const LIMIT: f64 = 18_446_744_073_709_551_616.0;
    (0.0..LIMIT).contains(&v).then(|| v.round() as u64)
}

/// A non-negative whole number from a label value ("16", "16.0"); `None` for "None", "" etc.
fn count_from_label(s: &str) -> Option<u64> {
    let s = s.trim();
    s.parse::<u64>()
        .ok()
        .or_else(|| s.parse::<f64>().ok().filter(|v| v.fract() == 0.0).and_then(count_from_f64))
}

fn label_count(labels: &Labels<'_>, name: &str) -> Option<u64> {
    labels.get(name).and_then(|v| count_from_label(&v))
}

fn split_adapters(list: &str) -> Vec<String> {
    list.split(',').map(str::trim).filter(|a| !a.is_empty()).map(str::to_owned).collect()
}

#[derive(Debug, Default)]
struct VllmAcc<'a> {
    waiting: Sum,
    running: Sum,
    kv: Mean,
    kv_v0: Mean,
    block_size: Option<u32>,
    gpu_blocks: Sum,
    /// The newest `lora_requests_info` series: (value, labels).
    lora: Option<(f64, Labels<'a>)>,
}

#[derive(Debug, Default)]
struct SglangAcc {
    queue: Sum,
    running: Sum,
    token_usage: Mean,
    used_tokens: Sum,
    max_tokens: Sum,
    page_size: Option<u32>,
    num_pages: Sum,
}

#[derive(Debug, Default)]
struct TrtllmAcc {
    waiting: Sum,
    running: Sum,
    kv: Mean,
    tokens_per_block: Option<u32>,
    max_blocks: Sum,
}

#[derive(Debug, Default)]
struct TritonAcc {
    waiting: Sum,
    scheduled: Sum,
    fraction: Mean,
    used: Sum,
    max: Sum,
    tokens_per: Option<u32>,
}

#[derive(Debug, Default)]
struct Acc<'a> {
    vllm: VllmAcc<'a>,
    sglang: SglangAcc,
    trtllm: TrtllmAcc,
    triton: TritonAcc,
    /// Keys of (metric, label set) already counted; see [`series_key`].
    seen: HashSet<u64>,
}

/// SGLang labels that name a replica of the same scheduler state, not a share of the requests.
const SGLANG_RANK_LABELS: [&str; 3] = ["tp_rank", "pp_rank", "moe_ep_rank"];

/// Identifies a series of one metric by its label set, ignoring label order and `ignore`d labels.
fn series_key(known: Known, labels: &Labels<'_>, ignore: &[&str]) -> u64 {
    let mut key = xxh3_64(&[known as u8]);
    for (name, raw_value) in labels.iter_raw() {
        if ignore.contains(&name) {
            continue;
        }
        // Order-independent: a commutative combination of one hash per pair.
        key = key.wrapping_add(xxh3_64_with_seed(raw_value.as_bytes(), xxh3_64(name.as_bytes())));
    }
    key
}

impl<'a> Acc<'a> {
    /// True the first time this series is seen.
    fn first_time(&mut self, known: Known, labels: &Labels<'_>, ignore: &[&str]) -> bool {
        self.seen.insert(series_key(known, labels, ignore))
    }

    fn add(&mut self, known: Known, labels: Labels<'a>, value: f64) {
        use Known::*;
        if known == VllmLora {
            // Not deduplicated: only the newest series counts anyway.
            if value.is_finite() && self.vllm.lora.is_none_or(|(newest, _)| value > newest) {
                self.vllm.lora = Some((value, labels));
            }
            return;
        }
        let ignore: &[&str] = match known {
            SglQueue | SglRunning | SglTokenUsage | SglUsedTokens | SglMaxTotalTokens | SglPageSize
            | SglNumPages => &SGLANG_RANK_LABELS,
            _ => &[],
        };
        if !self.first_time(known, &labels, ignore) {
            return;
        }
        let v = &mut self.vllm;
        let s = &mut self.sglang;
        let t = &mut self.trtllm;
        let tr = &mut self.triton;
        match known {
            VllmWaiting => v.waiting.add(value),
            VllmRunning => v.running.add(value),
            VllmKv => v.kv.add(value),
            VllmKvV0 => v.kv_v0.add(value),
            VllmCacheConfig => {
                // An info metric: the numbers are in the labels, the value is 1.
                set_once(&mut v.block_size, label_count(&labels, "block_size"));
                v.gpu_blocks.add(label_count(&labels, "num_gpu_blocks").map_or(f64::NAN, |n| n as f64));
            }
            VllmLora => {}
            SglQueue => s.queue.add(value),
            SglRunning => s.running.add(value),
            SglTokenUsage => s.token_usage.add(value),
            SglUsedTokens => s.used_tokens.add(value),
            SglMaxTotalTokens => s.max_tokens.add(value),
            SglPageSize => set_once(&mut s.page_size, count_from_f64(value)),
            SglNumPages => s.num_pages.add(value),
            TrtWaiting => t.waiting.add(value),
            TrtRunning => t.running.add(value),
            TrtKv => t.kv.add(value),
            TrtTokensPerBlock => set_once(&mut t.tokens_per_block, count_from_f64(value)),
            TrtMaxBlocks => t.max_blocks.add(value),
            TritonRequests => match labels.get("request_type").as_deref() {
                Some("waiting") => tr.waiting.add(value),
                Some("scheduled") => tr.scheduled.add(value),
                _ => {}
            },
            TritonKvBlocks => match labels.get("kv_cache_block_type").as_deref() {
                Some("fraction") => tr.fraction.add(value),
                Some("used") => tr.used.add(value),
                Some("max") => tr.max.add(value),
                Some("tokens_per") => set_once(&mut tr.tokens_per, count_from_f64(value)),
                _ => {}
            },
        }
    }

    fn finish(self) -> Result<EndpointMetrics, MetricsError> {
        let candidates =
            [self.vllm.finish(), self.sglang.finish(), self.trtllm.finish(), self.triton.finish()];
        let mut best: Option<EndpointMetrics> = None;
        let mut best_signals = 0;
        for m in candidates {
            let signals = [m.queue, m.running, m.kv_usage].iter().filter(|s| s.is_some()).count();
            if signals > best_signals {
                best_signals = signals;
                best = Some(m);
            }
        }
        best.ok_or(MetricsError::NoKnownMetrics)
    }
}

/// `used ÷ max` as a fraction in [0, 1], when both are known and `max` is positive.
fn ratio(used: &Sum, max: &Sum) -> Option<f64> {
    let (used, max) = (used.get()?, max.get()?);
    (max > 0.0).then(|| (used / max).clamp(0.0, 1.0))
}

impl VllmAcc<'_> {
    fn finish(self) -> EndpointMetrics {
        let mut m = EndpointMetrics {
            engine: Engine::Vllm,
            queue: self.waiting.get(),
            running: self.running.get(),
            kv_usage: self.kv.get().or(self.kv_v0.get()),
            block_size: self.block_size,
            num_gpu_blocks: self.gpu_blocks.get().and_then(count_from_f64),
            ..EndpointMetrics::default()
        };
        if let Some((_, labels)) = self.lora {
            m.max_lora = label_count(&labels, "max_lora").and_then(|n| u32::try_from(n).ok());
            m.running_adapters =
                labels.get("running_lora_adapters").map_or_else(Vec::new, |a| split_adapters(&a));
            m.waiting_adapters =
                labels.get("waiting_lora_adapters").map_or_else(Vec::new, |a| split_adapters(&a));
        }
        m
    }
}

impl SglangAcc {
    fn finish(self) -> EndpointMetrics {
        let pages_from_tokens = || {
            let page = f64::from(self.page_size?);
            count_from_f64((self.max_tokens.get()? / page).floor())
        };
        EndpointMetrics {
            engine: Engine::Sglang,
            queue: self.queue.get(),
            running: self.running.get(),
            kv_usage: self.token_usage.get().or_else(|| ratio(&self.used_tokens, &self.max_tokens)),
            block_size: self.page_size,
            num_gpu_blocks: self.num_pages.get().and_then(count_from_f64).or_else(pages_from_tokens),
            ..EndpointMetrics::default()
        }
    }
}

impl TrtllmAcc {
    fn finish(self) -> EndpointMetrics {
        EndpointMetrics {
            engine: Engine::Trtllm,
            queue: self.waiting.get(),
            running: self.running.get(),
            kv_usage: self.kv.get(),
            block_size: self.tokens_per_block,
            num_gpu_blocks: self.max_blocks.get().and_then(count_from_f64),
            ..EndpointMetrics::default()
        }
    }
}

impl TritonAcc {
    fn finish(self) -> EndpointMetrics {
        EndpointMetrics {
            engine: Engine::Trtllm,
            queue: self.waiting.get(),
            running: self.scheduled.get(),
            kv_usage: self.fraction.get().or_else(|| ratio(&self.used, &self.max)),
            block_size: self.tokens_per,
            num_gpu_blocks: self.max.get().and_then(count_from_f64),
            ..EndpointMetrics::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    macro_rules! fixture {
        ($name:literal) => {
            include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/metrics/", $name))
        };
    }

    const VLLM_V1_DP2: &str = fixture!("vllm_v1_0.33_dp2_lora_constructed.prom");
    const VLLM_07: &str = fixture!("vllm_v1_excerpt_production-stack_issue318_vllm0.7_Qwen25Coder32B.prom");
    const VLLM_010: &str = fixture!("vllm_v1_excerpt_production-stack_issue617_vllm0.10.0_GLM45.prom");
    const SGLANG_REAL: &str = fixture!("sglang_docs_production_metrics_llama31_8b.prom");
    const SGLANG_DP: &str = fixture!("sglang_0.5.23_dp2_tp4_allschedulers_constructed.prom");
    const TRITON_IFB: &str = fixture!("triton_trtllm_backend_readme_inflight_batcher.prom");
    const TRITON_BASE: &str = fixture!("triton_base_metrics_readme.prom");
    const TRITON_V1: &str = fixture!("triton_trtllm_backend_readme_v1_model.prom");
    const TRTLLM_SERVE: &str = fixture!("trtllm_serve_constructed.prom");

    fn ok(text: &str) -> EndpointMetrics {
        match parse_metrics(text) {
            Ok(m) => m,
            Err(e) => panic!("{e} for:\n{text}"),
        }
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    // ---- fixtures, expected values worked out by hand (see tests/fixtures/metrics/README.md) ----

    #[test]
    fn vllm_v1_two_engines_with_lora() {
        let m = ok(VLLM_V1_DP2);
        assert_eq!(
            m,
            EndpointMetrics {
                engine: Engine::Vllm,
                // waiting: engine 0 = 2, engine 1 = 7 (waiting_by_reason is a different metric)
                queue: Some(9.0),
                // running: 3 + 5
                running: Some(8.0),
                // (0.3125 + 0.5625) / 2, exact in binary
                kv_usage: Some(0.4375),
                block_size: Some(16),
                // 27648 blocks per engine, two engines
                num_gpu_blocks: Some(55_296),
                max_lora: Some(4),
                // the middle series has the newest timestamp, 1.7537953269352946e+09
                running_adapters: strings(&["chat-lora", "sql-lora"]),
                waiting_adapters: strings(&["fin-lora"]),
            }
        );
        let (_, stats) = parse_metrics_with_stats(VLLM_V1_DP2);
        // 2 waiting + 2 running + 2 kv + 2 cache_config + 3 lora
        assert_eq!(stats, ParseStats { known_samples: 11, skipped_lines: 0, first_error: None });
    }

    #[test]
    fn vllm_07_uses_gpu_cache_usage_perc() {
        let m = ok(VLLM_07);
        assert_eq!(m.engine, Engine::Vllm);
        // An idle server: real zeros, not missing values.
        assert_eq!((m.queue, m.running, m.kv_usage), (Some(0.0), Some(0.0), Some(0.0)));
        assert_eq!((m.block_size, m.num_gpu_blocks, m.max_lora), (None, None, None));
    }

    #[test]
    fn vllm_010_excerpt_has_only_kv() {
        let m = ok(VLLM_010);
        assert_eq!(m.engine, Engine::Vllm);
        assert_eq!(m.kv_usage, Some(9.75010481363281e-06));
        assert_eq!((m.queue, m.running), (None, None));
    }

    #[test]
    fn sglang_real_dump() {
        let m = ok(SGLANG_REAL);
        assert_eq!(
            m,
            EndpointMetrics {
                engine: Engine::Sglang,
                queue: Some(2826.0),
                running: Some(162.0),
                kv_usage: Some(0.28),
                ..EndpointMetrics::default()
            }
        );
    }

    #[test]
    fn sglang_dp_attention_with_replicated_tp_ranks() {
        let m = ok(SGLANG_DP);
        assert_eq!(
            m,
            EndpointMetrics {
                engine: Engine::Sglang,
                // tp ranks 0,1 (dp 0) report 12, tp ranks 2,3 (dp 1) report 20: 12 + 20, not 64
                queue: Some(32.0),
                // 48 + 40
                running: Some(88.0),
                // (0.75 + 0.25) / 2
                kv_usage: Some(0.5),
                block_size: Some(64),
                // 6250 pages per DP group
                num_gpu_blocks: Some(12_500),
                ..EndpointMetrics::default()
            }
        );
    }

    #[test]
    fn sglang_fallbacks_for_kv_and_pages() {
        // No token_usage and no num_pages: kv = (300 + 100) / (1000 + 1000) = 0.2; pages =
        // floor(2000 / 16) = 125.
        let text = "\
sglang:num_queue_reqs{dp_rank=\"0\"} 1\n\
sglang:num_queue_reqs{dp_rank=\"1\"} 2\n\
sglang:num_used_tokens{dp_rank=\"0\"} 300\n\
sglang:num_used_tokens{dp_rank=\"1\"} 100\n\
sglang:max_total_num_tokens{dp_rank=\"0\"} 1000\n\
sglang:max_total_num_tokens{dp_rank=\"1\"} 1000\n\
sglang:page_size{dp_rank=\"0\"} 16\n";
        let m = ok(text);
        assert_eq!((m.queue, m.running, m.kv_usage), (Some(3.0), None, Some(0.2)));
        assert_eq!((m.block_size, m.num_gpu_blocks), (Some(16), Some(125)));
        // Without a page size the token capacity cannot be turned into pages.
        let m = ok("sglang:num_queue_reqs 1\nsglang:max_total_num_tokens 1000\n");
        assert_eq!((m.block_size, m.num_gpu_blocks), (None, None));
    }

    #[test]
    fn triton_inflight_batcher_dump() {
        let m = ok(TRITON_IFB);
        assert_eq!(
            m,
            EndpointMetrics {
                engine: Engine::Trtllm,
                queue: Some(1.0),
                running: Some(1.0),
                // "fraction" wins over used/max (1/6239), as GIE reads it
                kv_usage: Some(0.4875),
                block_size: Some(64),
                num_gpu_blocks: Some(6239),
                ..EndpointMetrics::default()
            }
        );
    }

    #[test]
    fn triton_without_fraction_uses_used_over_max() {
        let text = "\
nv_trt_llm_request_metrics{model=\"a\",request_type=\"waiting\",version=\"1\"} 4\n\
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"used\",model=\"a\",version=\"1\"} 250\n\
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"max\",model=\"a\",version=\"1\"} 1000\n";
        let m = ok(text);
        // 250 / 1000
        assert_eq!((m.queue, m.running, m.kv_usage), (Some(4.0), None, Some(0.25)));
        assert_eq!(m.num_gpu_blocks, Some(1000));
    }

    #[test]
    fn triton_dumps_without_trtllm_load_metrics_are_errors() {
        // nv_inference_pending_request_count alone is Triton's own queue, not the engine's.
        assert_eq!(parse_metrics(TRITON_BASE), Err(MetricsError::NoKnownMetrics));
        assert_eq!(parse_metrics(TRITON_V1), Err(MetricsError::NoKnownMetrics));
    }

    #[test]
    fn trtllm_serve_both_prefixes() {
        let want = EndpointMetrics {
            engine: Engine::Trtllm,
            queue: Some(3.0),
            running: Some(17.0),
            kv_usage: Some(0.62),
            block_size: Some(32),
            num_gpu_blocks: Some(8192),
            ..EndpointMetrics::default()
        };
        assert_eq!(ok(TRTLLM_SERVE), want);
        assert_eq!(ok(&TRTLLM_SERVE.replace("trtllm_", "trtllm:")), want);
    }

    // ---- aggregation rules ----

    #[test]
    fn counts_are_summed_across_engines_and_model_names() {
        let text = "\
vllm:num_requests_waiting{engine=\"0\",model_name=\"a\"} 1\n\
vllm:num_requests_waiting{engine=\"0\",model_name=\"b\"} 2\n\
vllm:num_requests_waiting{engine=\"1\",model_name=\"a\"} 4\n\
vllm:num_requests_running{model_name=\"a\",engine=\"0\"} 8\n\
vllm:num_requests_running{model_name=\"a\",engine=\"1\"} 16\n";
        let m = ok(text);
        // 1 + 2 + 4 and 8 + 16
        assert_eq!((m.queue, m.running), (Some(7.0), Some(24.0)));
    }

    #[test]
    fn identical_series_are_counted_once_in_any_label_order() {
        let text = "\
vllm:num_requests_waiting{engine=\"0\",model_name=\"a\"} 5\n\
vllm:num_requests_waiting{model_name=\"a\",engine=\"0\"} 5\n\
vllm:num_requests_waiting{engine=\"1\",model_name=\"a\"} 2\n";
        // The second line repeats the first series: 5 + 2, not 12.
        assert_eq!(ok(text).queue, Some(7.0));
    }

    #[test]
    fn vllm_labels_that_look_like_sglang_ranks_are_not_ignored() {
        // Only SGLang drops tp_rank from the series identity.
        let text = "vllm:num_requests_waiting{tp_rank=\"0\"} 1\nvllm:num_requests_waiting{tp_rank=\"1\"} 1\n";
        assert_eq!(ok(text).queue, Some(2.0));
    }

    #[test]
    fn kv_is_clamped_then_averaged() {
        // Per series: 1.5 -> 1.0, 0.5 stays: (1.0 + 0.5) / 2 = 0.75.
        let text = "vllm:kv_cache_usage_perc{engine=\"0\"} 1.5\nvllm:kv_cache_usage_perc{engine=\"1\"} 0.5\n";
        assert_eq!(ok(text).kv_usage, Some(0.75));
        assert_eq!(ok("vllm:kv_cache_usage_perc -0.2\n").kv_usage, Some(0.0));
        assert_eq!(ok("sglang:token_usage 7\n").kv_usage, Some(1.0));
        assert_eq!(ok("trtllm_kv_cache_utilization 1.0000001\n").kv_usage, Some(1.0));
    }

    #[test]
    fn kv_v1_name_wins_over_v0_name() {
        let text = "vllm:gpu_cache_usage_perc 0.9\nvllm:kv_cache_usage_perc 0.1\n";
        assert_eq!(ok(text).kv_usage, Some(0.1));
        // When every V1 series is NaN, the V0 name is used.
        let text = "vllm:kv_cache_usage_perc NaN\nvllm:gpu_cache_usage_perc 0.9\n";
        assert_eq!(ok(text).kv_usage, Some(0.9));
    }

    // ---- missing signals ----

    #[test]
    fn nan_and_inf_are_missing_never_zero() {
        // One engine's queue is NaN: the total is unknown, not "engine 0 only".
        let text = "\
vllm:num_requests_waiting{engine=\"0\"} 3\n\
vllm:num_requests_waiting{engine=\"1\"} NaN\n\
vllm:num_requests_running{engine=\"0\"} +Inf\n\
vllm:kv_cache_usage_perc{engine=\"0\"} 0.4\n\
vllm:kv_cache_usage_perc{engine=\"1\"} -Inf\n";
        let m = ok(text);
        assert_eq!(m.queue, None);
        assert_eq!(m.running, None);
        // The mean leaves the unknown engine out: 0.4, not (0.4 + 0) / 2.
        assert_eq!(m.kv_usage, Some(0.4));
        assert_eq!(ok("vllm:num_requests_waiting 1\nvllm:kv_cache_usage_perc +Inf\n").kv_usage, None);
    }

    #[test]
    fn negative_counts_are_missing() {
        let m = ok("sglang:num_queue_reqs -1\nsglang:num_running_reqs 2\n");
        assert_eq!((m.queue, m.running), (None, Some(2.0)));
    }

    #[test]
    fn all_values_unusable_is_an_error() {
        let text =
            "vllm:num_requests_waiting NaN\nvllm:num_requests_running -Inf\nvllm:kv_cache_usage_perc NaN\n";
        assert_eq!(parse_metrics(text), Err(MetricsError::NoKnownMetrics));
    }

    #[test]
    fn bodies_without_known_metrics_are_errors() {
        let cases = [
            "",
            "\n\n",
            "# HELP nothing here\n",
            "<html><body><h1>404 Not Found</h1></body></html>",
            "{\"error\": \"not found\"}",
            "process_open_fds 45.0\npython_info{version=\"3.12\"} 1\n",
            // Only histograms and counters of vLLM, no load gauge.
            "vllm:time_to_first_token_seconds_bucket{le=\"+Inf\"} 3\nvllm:prompt_tokens_total 10\n",
            // Only the info metrics.
            "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"100\"} 1\n",
            "vllm:lora_requests_info{max_lora=\"1\",running_lora_adapters=\"a\",waiting_lora_adapters=\"\"} 1e9\n",
            // A known name on a garbled line.
            "vllm:num_requests_waiting{engine=\"0\" 3\n",
            // Near-misses of known names.
            "vllm_num_requests_waiting 3\nsglang_num_queue_reqs 3\ntrtllm:kv_cache_utilisation 0.5\n",
        ];
        for text in cases {
            assert_eq!(parse_metrics(text), Err(MetricsError::NoKnownMetrics), "{text:?}");
        }
    }

    #[test]
    fn garbled_lines_are_counted_and_skipped() {
        let text = "\
vllm:num_requests_waiting{engine=\"0\"} 3\n\
vllm:num_requests_waiting{engine=\"1\" 4\n\
vllm:num_requests_running{engine=\"0\"} 1 garbage here\n\
vllm:num_requests_running{engine=\"1\"} 2\n";
        let (m, stats) = parse_metrics_with_stats(text);
        let m = m.unwrap();
        // Garbled series are unseen, not NaN: 3 and 2 are what the body says.
        assert_eq!((m.queue, m.running), (Some(3.0), Some(2.0)));
        assert_eq!(stats.known_samples, 2);
        assert_eq!(stats.skipped_lines, 2);
        assert_eq!(stats.first_error, Some((2, LineError::BadLabels)));
    }

    #[test]
    fn truncated_body_never_panics() {
        for cut in (0..VLLM_V1_DP2.len()).step_by(37) {
            let prefix = &VLLM_V1_DP2[..cut];
            if let Ok(m) = parse_metrics(prefix) {
                assert!(m.kv_usage.is_none_or(|k| (0.0..=1.0).contains(&k)));
            }
        }
        // Cut before the KV lines: queue and running are there, KV is missing (not 0).
        let cut = VLLM_V1_DP2.find("# HELP vllm:kv_cache_usage_perc").unwrap();
        let m = ok(&VLLM_V1_DP2[..cut]);
        assert_eq!((m.queue, m.running, m.kv_usage), (Some(9.0), Some(8.0), None));
        assert_eq!((m.block_size, m.max_lora), (None, None));
    }

    // ---- info metrics ----

    #[test]
    fn cache_config_info_with_unprofiled_blocks() {
        // num_gpu_blocks is "None" until vLLM has profiled memory; block_size is still known.
        let text = "vllm:num_requests_waiting 0\n\
vllm:cache_config_info{num_gpu_blocks=\"None\",block_size=\"32\",engine=\"0\"} 1.0\n";
        let m = ok(text);
        assert_eq!((m.block_size, m.num_gpu_blocks), (Some(32), None));
        // One engine unknown makes the total unknown.
        let text = "vllm:num_requests_waiting 0\n\
vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"100\"} 1.0\n\
vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"None\"} 1.0\n";
        assert_eq!(ok(text).num_gpu_blocks, None);
    }

    #[test]
    fn lora_newest_series_wins_in_any_order() {
        let a = "vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"old\",waiting_lora_adapters=\"\"} 100\n";
        let b = "vllm:lora_requests_info{waiting_lora_adapters=\" w1 , ,w2 \",running_lora_adapters=\"new\",max_lora=\"3\"} 300\n";
        let c = "vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"mid\",waiting_lora_adapters=\"\"} 200\n";
        let base = "vllm:num_requests_waiting 0\n";
        for order in [[a, b, c], [c, a, b], [b, c, a]] {
            let m = ok(&format!("{base}{}{}{}", order[0], order[1], order[2]));
            assert_eq!(m.max_lora, Some(3));
            assert_eq!(m.running_adapters, strings(&["new"]));
            // Items are trimmed, empty items dropped.
            assert_eq!(m.waiting_adapters, strings(&["w1", "w2"]));
        }
    }

    #[test]
    fn lora_edge_cases() {
        let base = "vllm:num_requests_waiting 0\n";
        // A NaN timestamp is never the newest; ties keep the first series.
        let text = format!(
            "{base}\
vllm:lora_requests_info{{max_lora=\"1\",running_lora_adapters=\"nan\",waiting_lora_adapters=\"\"}} NaN\n\
vllm:lora_requests_info{{max_lora=\"1\",running_lora_adapters=\"first\",waiting_lora_adapters=\"\"}} 5\n\
vllm:lora_requests_info{{max_lora=\"1\",running_lora_adapters=\"second\",waiting_lora_adapters=\"\"}} 5\n"
        );
        assert_eq!(ok(&text).running_adapters, strings(&["first"]));
        // Idle: the newest series has empty lists.
        let text = format!(
            "{base}vllm:lora_requests_info{{max_lora=\"4\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"}} 9\n"
        );
        let m = ok(&text);
        assert_eq!(m.max_lora, Some(4));
        assert!(m.running_adapters.is_empty() && m.waiting_adapters.is_empty());
        // No LoRA metric at all (server without --enable-lora).
        let m = ok(base);
        assert_eq!(m.max_lora, None);
        assert!(m.running_adapters.is_empty());
    }

    // ---- engine detection ----

    #[test]
    fn the_engine_with_most_signals_wins() {
        // vLLM has one signal, SGLang three.
        let text = "vllm:num_requests_waiting 1\nsglang:num_queue_reqs 2\nsglang:num_running_reqs 3\nsglang:token_usage 0.5\n";
        assert_eq!(ok(text).engine, Engine::Sglang);
        // A tie goes to vLLM.
        let text = "sglang:num_queue_reqs 2\nvllm:num_requests_waiting 1\n";
        let m = ok(text);
        assert_eq!((m.engine, m.queue), (Engine::Vllm, Some(1.0)));
    }

    #[test]
    fn serialised_with_short_names() {
        let m = ok(VLLM_V1_DP2);
        let json = serde_json::to_value(&m).unwrap();
        assert_eq!(json["e"], "vllm");
        assert_eq!(json["q"], 9.0);
        assert_eq!(json["kv"], 0.4375);
        assert_eq!(json["ra"][1], "sql-lora");
        let back: EndpointMetrics = serde_json::from_value(json).unwrap();
        assert_eq!(back, m);
    }

    // ---- property tests ----

    fn check_invariants(m: &EndpointMetrics) -> Result<(), TestCaseError> {
        prop_assert!(m.queue.is_none_or(|q| q.is_finite() && q >= 0.0));
        prop_assert!(m.running.is_none_or(|r| r.is_finite() && r >= 0.0));
        prop_assert!(m.kv_usage.is_none_or(|k| (0.0..=1.0).contains(&k)));
        prop_assert!(m.queue.is_some() || m.running.is_some() || m.kv_usage.is_some());
        Ok(())
    }

    /// Lines that mix known names, labels and odd values.
    fn known_line() -> impl Strategy<Value = String> {
        let names = prop::sample::select(vec![
            "vllm:num_requests_waiting",
            "vllm:num_requests_running",
            "vllm:kv_cache_usage_perc",
            "vllm:gpu_cache_usage_perc",
            "vllm:cache_config_info",
            "vllm:lora_requests_info",
            "sglang:num_queue_reqs",
            "sglang:token_usage",
            "sglang:page_size",
            "trtllm_kv_cache_utilization",
            "nv_trt_llm_request_metrics",
            "nv_trt_llm_kv_cache_block_metrics",
        ]);
        let label = prop::sample::select(vec![
            "engine=\"0\"",
            "engine=\"1\"",
            "tp_rank=\"1\"",
            "block_size=\"16\"",
            "num_gpu_blocks=\"None\"",
            "num_gpu_blocks=\"99999999999999999999999\"",
            "max_lora=\"-1\"",
            "running_lora_adapters=\"a,,b\"",
            "request_type=\"waiting\"",
            "kv_cache_block_type=\"max\"",
            "kv_cache_block_type=\"tokens_per\"",
        ]);
        let value = prop_oneof![
            prop::num::f64::ANY.prop_map(|v| format!("{v}")),
            Just("NaN".to_string()),
            Just("+Inf".to_string()),
            Just("-Inf".to_string()),
            Just("1e400".to_string()),
            Just("-1".to_string()),
            "[0-9.e+-]{1,8}",
        ];
        (names, prop::collection::vec(label, 0..4), value)
            .prop_map(|(n, ls, v)| format!("{n}{{{}}} {v}", ls.join(",")))
    }

    proptest! {
        #[test]
        fn arbitrary_text_never_panics(text in any::<String>()) {
            if let Ok(m) = parse_metrics(&text) {
                check_invariants(&m)?;
            }
        }

        #[test]
        fn known_metrics_with_odd_values_keep_the_invariants(
            lines in prop::collection::vec(known_line(), 0..20)
        ) {
            let text = lines.join("\n");
            if let Ok(m) = parse_metrics(&text) {
                check_invariants(&m)?;
            }
        }

        #[test]
        fn label_order_does_not_change_the_result(seed in any::<u64>()) {
            // Reverse or rotate every label set of the vLLM fixture; the result must not change.
            let want = ok(VLLM_V1_DP2);
            let reordered: String = VLLM_V1_DP2
                .lines()
                .map(|line| reorder_labels(line, seed))
                .collect::<Vec<_>>()
                .join("\n");
            prop_assert_eq!(ok(&reordered), want);
        }
    }

    /// Rewrites one sample line with its labels rotated by `seed` (and reversed when it is odd).
    fn reorder_labels(line: &str, seed: u64) -> String {
        let Ok(Some(s)) = crate::poll::scrape::prom::parse_line(line) else { return line.to_string() };
        let mut pairs: Vec<(&str, &str)> = s.labels.iter_raw().collect();
        if pairs.is_empty() {
            return line.to_string();
        }
        if seed % 2 == 1 {
            pairs.reverse();
        }
        let n = pairs.len();
        pairs.rotate_left((seed as usize / 2) % n);
        let set: Vec<String> = pairs.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
        format!("{}{{{}}} {}", s.name, set.join(","), s.value)
    }
}
