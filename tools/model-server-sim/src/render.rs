//! Prometheus text exposition of a [`MetricsSnapshot`], in the metric names of vLLM V1,
//! SGLang or trtllm-serve, shaped like the real dumps (see README "Metrics"):
//!
//! - **vLLM V1**: every series carries `engine="0"` and `model_name`; counters end in `_total`
//!   and each has a `_created` gauge family, as prometheus_client writes them;
//!   `vllm:cache_config_info` is an info gauge (value 1.0) whose labels are stringified
//!   CacheConfig fields; `vllm:lora_requests_info` (only with LoRA enabled) has labels
//!   `max_lora, waiting_lora_adapters, running_lora_adapters` in that order, value = unix time of
//!   the last update, and keeps one series per label combination ever seen (so a reader must
//!   take the newest).
//! - **SGLang**: `sglang:` names with a `model_name` label, no `_created` series.
//! - **trtllm-serve**: `trtllm_` names (from the GIE model-server protocol) with `model_name`
//!   and `engine_type="trtllm"`. No real dump of these was available; HELP texts are ours.
//!
//! Numbers are formatted like Python's prometheus_client (`0.0`, `162.0`, `1.7537953e+09`,
//! `9.75e-06`), because parsers must cope with exactly that.

use std::fmt::Write as _;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::model::MetricsSnapshot;

/// Which engine's metric names to expose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    #[default]
    Vllm,
    Sglang,
    Trtllm,
}

impl Engine {
    pub fn as_str(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
            Engine::Trtllm => "trtllm",
        }
    }
}

impl FromStr for Engine {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "vllm" => Ok(Engine::Vllm),
            "sglang" => Ok(Engine::Sglang),
            "trtllm" => Ok(Engine::Trtllm),
            other => Err(format!("unknown engine {other:?} (expected vllm, sglang or trtllm)")),
        }
    }
}

/// What the text needs besides the snapshot.
#[derive(Debug, Clone, Copy)]
pub struct RenderInfo<'a> {
    /// The `model_name` label (vLLM: the first served model name).
    pub model_name: &'a str,
    /// Unix time of the scrape, seconds (LoRA info value).
    pub unix_now_s: f64,
    /// Unix time the server started, seconds (`_created` series, process start).
    pub created_unix_s: f64,
    /// Earlier `lora_requests_info` label combinations (vLLM never removes them). When None,
    /// only the current combination is written.
    pub lora_history: Option<&'a LoraInfoHistory>,
}

/// The `vllm:lora_requests_info` series seen so far: (running, waiting) label values with the
/// last time each was set. Bounded: the oldest combination is dropped beyond `cap`.
#[derive(Debug, Clone, Default)]
pub struct LoraInfoHistory {
    cap: usize,
    series: Vec<(String, String, f64)>,
}

impl LoraInfoHistory {
    pub fn new(cap: usize) -> Self {
        LoraInfoHistory { cap: cap.max(1), series: Vec::new() }
    }

    /// Set the series for the snapshot's current adapters to `unix_s` (vLLM's
    /// `set_to_current_time` on every stats update).
    pub fn record(&mut self, snap: &MetricsSnapshot, unix_s: f64) {
        let running = snap.running_lora_adapters.join(",");
        let waiting = snap.waiting_lora_adapters.join(",");
        if let Some(pos) = self.series.iter().position(|(r, w, _)| *r == running && *w == waiting) {
            self.series.remove(pos);
        }
        self.series.push((running, waiting, unix_s));
        if self.series.len() > self.cap {
            self.series.remove(0);
        }
    }

    /// (running, waiting, unix time) for each combination, oldest first.
    pub fn series(&self) -> &[(String, String, f64)] {
        &self.series
    }
}

/// Render `snap` as `engine` would expose it.
pub fn render_metrics(engine: Engine, snap: &MetricsSnapshot, info: &RenderInfo<'_>) -> String {
    let mut w = Writer { out: String::with_capacity(4096) };
    match engine {
        Engine::Vllm => render_vllm(&mut w, snap, info),
        Engine::Sglang => render_sglang(&mut w, snap, info),
        Engine::Trtllm => render_trtllm(&mut w, snap, info),
    }
    w.out
}

fn render_vllm(w: &mut Writer, s: &MetricsSnapshot, info: &RenderInfo<'_>) {
    let base: [(&str, &str); 2] = [("engine", "0"), ("model_name", info.model_name)];
    w.family("python_info", "Python platform information", "gauge");
    w.sample(
        "python_info",
        &[
            ("implementation", "CPython"),
            ("major", "3"),
            ("minor", "12"),
            ("patchlevel", "3"),
            ("version", "3.12.3"),
        ],
        1.0,
    );
    w.family("process_start_time_seconds", "Start time of the process since unix epoch in seconds.", "gauge");
    w.sample("process_start_time_seconds", &[], info.created_unix_s);

    w.gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        &base,
        s.running as f64,
    );
    w.gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        &base,
        s.waiting as f64,
    );
    w.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", &base, s.kv_usage);
    let created = info.created_unix_s;
    w.counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        &base,
        s.prefix_cache_queries_tokens as f64,
        created,
    );
    w.counter(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        &base,
        s.prefix_cache_hits_tokens as f64,
        created,
    );
    w.counter(
        "vllm:num_preemptions",
        "Cumulative number of preemption from the engine.",
        &base,
        s.preemptions as f64,
        created,
    );
    w.counter(
        "vllm:prompt_tokens",
        "Number of prefill tokens processed.",
        &base,
        s.prompt_tokens_total as f64,
        created,
    );
    w.counter(
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        &base,
        s.generation_tokens_total as f64,
        created,
    );
    // One labelled counter: each finished_reason gets its own _total and _created sample.
    let help = "Count of successfully processed requests.";
    w.family("vllm:request_success_total", help, "counter");
    let reasons =
        [("stop", 0.0), ("length", s.requests_finished as f64), ("abort", s.requests_aborted as f64)];
    for (reason, v) in reasons {
        w.sample("vllm:request_success_total", &[base[0], base[1], ("finished_reason", reason)], v);
    }
    w.family("vllm:request_success_created", help, "gauge");
    for (reason, _) in reasons {
        w.sample("vllm:request_success_created", &[base[0], base[1], ("finished_reason", reason)], created);
    }

    let block_size = s.block_size.to_string();
    let num_gpu_blocks = s.num_gpu_blocks.to_string();
    let kv_tokens = (s.num_gpu_blocks * u64::from(s.block_size)).to_string();
    w.family("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", "gauge");
    w.sample(
        "vllm:cache_config_info",
        &[
            ("block_size", &block_size),
            ("cache_dtype", "auto"),
            ("calculate_kv_scales", "False"),
            ("cpu_offload_gb", "0"),
            ("enable_prefix_caching", "True"),
            ("gpu_memory_utilization", "0.9"),
            ("is_attention_free", "False"),
            ("kv_cache_size_tokens", &kv_tokens),
            ("num_cpu_blocks", "None"),
            ("num_gpu_blocks", &num_gpu_blocks),
            ("num_gpu_blocks_override", "None"),
            ("prefix_caching_hash_algo", "sha256"),
            ("sliding_window", "None"),
            ("swap_space", "4"),
            ("engine", "0"),
        ],
        1.0,
    );

    if s.lora_enabled {
        let max_lora = s.max_lora.to_string();
        w.family("vllm:lora_requests_info", "Running stats on lora requests.", "gauge");
        let current = (s.running_lora_adapters.join(","), s.waiting_lora_adapters.join(","));
        let mut wrote_current = false;
        if let Some(h) = info.lora_history {
            for (running, waiting, ts) in h.series() {
                let is_current = *running == current.0 && *waiting == current.1;
                wrote_current |= is_current;
                let ts = if is_current { info.unix_now_s } else { *ts };
                w.sample(
                    "vllm:lora_requests_info",
                    &[
                        ("max_lora", &max_lora),
                        ("waiting_lora_adapters", waiting),
                        ("running_lora_adapters", running),
                    ],
                    ts,
                );
            }
        }
        if !wrote_current {
            w.sample(
                "vllm:lora_requests_info",
                &[
                    ("max_lora", &max_lora),
                    ("waiting_lora_adapters", &current.1),
                    ("running_lora_adapters", &current.0),
                ],
                info.unix_now_s,
            );
        }
    }
}

fn render_sglang(w: &mut Writer, s: &MetricsSnapshot, info: &RenderInfo<'_>) {
    let l: [(&str, &str); 1] = [("model_name", info.model_name)];
    let capacity_tokens = s.num_gpu_blocks * u64::from(s.block_size);
    let used_tokens = s.kv_used_blocks * u64::from(s.block_size);
    let hit_rate = ratio(s.prefix_cache_hits_tokens, s.prefix_cache_queries_tokens);
    w.counter_plain(
        "sglang:prompt_tokens_total",
        "Number of prefill tokens processed.",
        &l,
        s.prompt_tokens_total as f64,
    );
    w.counter_plain(
        "sglang:generation_tokens_total",
        "Number of generation tokens processed.",
        &l,
        s.generation_tokens_total as f64,
    );
    w.counter_plain(
        "sglang:cached_tokens_total",
        "Number of cached prompt tokens.",
        &l,
        s.prefix_cache_hits_tokens as f64,
    );
    w.counter_plain(
        "sglang:num_requests_total",
        "Number of requests processed.",
        &l,
        s.requests_finished as f64,
    );
    w.gauge("sglang:token_usage", "The token usage", &l, s.kv_usage);
    w.gauge("sglang:cache_hit_rate", "The cache hit rate", &l, hit_rate);
    w.gauge("sglang:num_running_reqs", "The number of running requests", &l, s.running as f64);
    w.gauge("sglang:num_used_tokens", "The number of used tokens", &l, used_tokens as f64);
    w.gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue", &l, s.waiting as f64);
    w.gauge(
        "sglang:max_total_num_tokens",
        "Maximum total number of tokens in the KV cache pool.",
        &l,
        capacity_tokens as f64,
    );
    w.gauge("sglang:page_size", "The page size of the KV cache.", &l, f64::from(s.block_size));
    w.gauge("sglang:num_pages", "The number of pages in the KV cache.", &l, s.num_gpu_blocks as f64);
    if s.lora_enabled {
        let used = s.running_lora_adapters.len() as f64;
        let total = f64::from(s.max_lora);
        w.gauge("sglang:lora_pool_slots_used", "Number of LoRA adapter slots in use.", &l, used);
        w.gauge("sglang:lora_pool_slots_total", "Total number of LoRA adapter slots.", &l, total);
        w.gauge(
            "sglang:lora_pool_utilization",
            "Fraction of LoRA adapter slots in use.",
            &l,
            if total > 0.0 { used / total } else { 0.0 },
        );
    }
}

fn render_trtllm(w: &mut Writer, s: &MetricsSnapshot, info: &RenderInfo<'_>) {
    let l: [(&str, &str); 2] = [("engine_type", "trtllm"), ("model_name", info.model_name)];
    w.gauge(
        "trtllm_num_requests_waiting",
        "Number of requests waiting to be scheduled.",
        &l,
        s.waiting as f64,
    );
    w.gauge("trtllm_num_requests_running", "Number of requests in the running batch.", &l, s.running as f64);
    w.gauge("trtllm_kv_cache_utilization", "Fraction of KV-cache blocks in use.", &l, s.kv_usage);
    w.gauge("trtllm_kv_cache_tokens_per_block", "Tokens per KV-cache block.", &l, f64::from(s.block_size));
    w.gauge("trtllm_kv_cache_max_blocks", "KV-cache blocks on the GPU.", &l, s.num_gpu_blocks as f64);
    w.gauge(
        "trtllm_kv_cache_hit_rate",
        "Fraction of prompt tokens served from the KV cache.",
        &l,
        ratio(s.prefix_cache_hits_tokens, s.prefix_cache_queries_tokens),
    );
    w.counter_plain(
        "trtllm_request_success_total",
        "Count of successfully processed requests.",
        &l,
        s.requests_finished as f64,
    );
}

fn ratio(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}

struct Writer {
    out: String,
}

impl Writer {
    fn family(&mut self, name: &str, help: &str, typ: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {typ}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{k}=\"{}\"", escape_label(v));
            }
            self.out.push('}');
        }
        self.out.push(' ');
        self.out.push_str(&go_float(value));
        self.out.push('\n');
    }

    fn gauge(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: f64) {
        self.family(name, help, "gauge");
        self.sample(name, labels, value);
    }

    /// A prometheus_client counter: `<base>_total` plus a `<base>_created` gauge family.
    fn counter(&mut self, base: &str, help: &str, labels: &[(&str, &str)], value: f64, created: f64) {
        let total = format!("{base}_total");
        let created_name = format!("{base}_created");
        self.family(&total, help, "counter");
        self.sample(&total, labels, value);
        self.family(&created_name, help, "gauge");
        self.sample(&created_name, labels, created);
    }

    /// A counter without `_created` (SGLang and trtllm dumps have none).
    fn counter_plain(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: f64) {
        self.family(name, help, "counter");
        self.sample(name, labels, value);
    }
}

fn escape_label(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

/// A float as Python's prometheus_client writes it (`floatToGoString`): Python `repr`
/// (`0.0`, `0.28`, `9.75e-06`), except that positive numbers with more than 6 digits before the
/// point switch to Go's exponent form (`8.128902e+06`, `1.7537953269352946e+09`).
pub fn go_float(v: f64) -> String {
    if v.is_nan() {
        return "NaN".into();
    }
    if v == f64::INFINITY {
        return "+Inf".into();
    }
    if v == f64::NEG_INFINITY {
        return "-Inf".into();
    }
    let s = py_repr(v);
    if v > 0.0 {
        if let Some(dot) = s.find('.') {
            if dot > 6 && !s.contains('e') {
                let (int, frac) = s.split_at(dot);
                let frac = frac.trim_start_matches('.');
                let mut digits = int.to_string();
                digits.push_str(frac);
                let (first, rest) = digits.split_at(1);
                let mut mantissa = format!("{first}.{rest}");
                while mantissa.ends_with('0') || mantissa.ends_with('.') {
                    mantissa.pop();
                }
                return format!("{mantissa}e+0{}", dot - 1);
            }
        }
    }
    s
}

/// Python's `repr(float)`: shortest round-trip digits, decimal notation for 1e-4 <= |v| < 1e16,
/// else exponent with at least two exponent digits and a sign.
fn py_repr(v: f64) -> String {
    // Rust's Debug uses the same shortest-digits algorithm and the same decimal/exponent
    // thresholds; only the exponent spelling differs ("1e-5" vs "1e-05", "1e16" vs "1e+16").
    let s = format!("{v:?}");
    match s.split_once('e') {
        None => s,
        Some((mant, exp)) => {
            let (sign, digits) = match exp.strip_prefix('-') {
                Some(d) => ('-', d),
                None => ('+', exp),
            };
            format!("{mant}e{sign}{digits:0>2}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_match_prometheus_client() {
        // Values taken from the real dumps in the project's shared data.
        assert_eq!(go_float(0.0), "0.0");
        assert_eq!(go_float(162.0), "162.0");
        assert_eq!(go_float(0.28), "0.28");
        assert_eq!(go_float(8128902.0), "8.128902e+06");
        assert_eq!(go_float(1753795326.9352946), "1.7537953269352946e+09");
        assert_eq!(go_float(9.75010481363281e-06), "9.75010481363281e-06");
        assert_eq!(go_float(123859.0), "123859.0");
        assert_eq!(go_float(1048576.0), "1.048576e+06");
        // Python: "2000000.0" → "2.0000000".rstrip("0.") → "2" → "2e+06".
        assert_eq!(go_float(2_000_000.0), "2e+06");
        assert_eq!(go_float(f64::INFINITY), "+Inf");
    }

    #[test]
    fn labels_are_escaped() {
        assert_eq!(escape_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

    #[test]
    fn lora_history_keeps_one_series_per_combination_newest_last() {
        let mut snap = crate::model::Server::new(Default::default()).unwrap().metrics_snapshot();
        let mut h = LoraInfoHistory::new(2);
        snap.running_lora_adapters = vec!["a".into()];
        h.record(&snap, 1.0);
        snap.running_lora_adapters = vec!["a".into(), "b".into()];
        h.record(&snap, 2.0);
        snap.running_lora_adapters = vec!["a".into()];
        h.record(&snap, 3.0);
        let s = h.series();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0], ("a,b".to_string(), String::new(), 2.0));
        assert_eq!(s[1], ("a".to_string(), String::new(), 3.0));
        // A third combination pushes out the oldest (cap 2).
        snap.running_lora_adapters = vec![];
        h.record(&snap, 4.0);
        assert_eq!(h.series()[0].0, "a");
    }

    fn sample_snapshot() -> MetricsSnapshot {
        let mut snap = crate::model::Server::new(crate::model::ServerConfig {
            enable_lora: true,
            max_lora: 2,
            ..Default::default()
        })
        .unwrap()
        .metrics_snapshot();
        snap.waiting = 3;
        snap.running = 5;
        snap.kv_usage = 0.5;
        snap.prefix_cache_queries_tokens = 2_000_000;
        snap.prefix_cache_hits_tokens = 500_000;
        snap.running_lora_adapters = vec!["a".into(), "b".into()];
        snap.waiting_lora_adapters = vec!["c".into()];
        snap
    }

    fn info(history: Option<&LoraInfoHistory>) -> RenderInfo<'_> {
        RenderInfo {
            model_name: "m",
            unix_now_s: 1_700_000_100.5,
            created_unix_s: 1_700_000_000.0,
            lora_history: history,
        }
    }

    #[test]
    fn vllm_text_has_the_awkward_parts_of_real_dumps() {
        let snap = sample_snapshot();
        let mut h = LoraInfoHistory::new(8);
        let mut old = snap.clone();
        old.running_lora_adapters = vec![];
        old.waiting_lora_adapters = vec![];
        h.record(&old, 1_700_000_050.0);
        h.record(&snap, 1_700_000_090.0);
        let text = render_metrics(Engine::Vllm, &snap, &info(Some(&h)));
        for line in [
            "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 3.0",
            "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 5.0",
            "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.5",
            "# TYPE vllm:prefix_cache_queries_total counter",
            "vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 2e+06",
            "vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 500000.0",
            "# TYPE vllm:prefix_cache_hits_created gauge",
            "vllm:prefix_cache_hits_created{engine=\"0\",model_name=\"m\"} 1.7e+09",
            // The older combination keeps its older timestamp; the current one has "now".
            "vllm:lora_requests_info{max_lora=\"2\",waiting_lora_adapters=\"\",running_lora_adapters=\"\"} 1.70000005e+09",
            "vllm:lora_requests_info{max_lora=\"2\",waiting_lora_adapters=\"c\",running_lora_adapters=\"a,b\"} 1.7000001005e+09",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
        assert!(text.contains("block_size=\"16\""));
        assert!(text.contains("num_gpu_blocks=\"25000\""));
    }

    #[test]
    fn every_sample_belongs_to_a_declared_family() {
        let snap = sample_snapshot();
        for engine in [Engine::Vllm, Engine::Sglang, Engine::Trtllm] {
            let text = render_metrics(engine, &snap, &info(None));
            let mut declared = None;
            let mut samples = 0;
            for line in text.lines() {
                if let Some(rest) = line.strip_prefix("# TYPE ") {
                    declared = rest.split(' ').next().map(str::to_string);
                } else if !line.starts_with('#') {
                    let name = line.split(['{', ' ']).next().unwrap();
                    assert_eq!(Some(name), declared.as_deref(), "{engine:?}: {line}");
                    let value = line.rsplit(' ').next().unwrap();
                    assert!(value.parse::<f64>().is_ok(), "{engine:?}: bad value in {line}");
                    samples += 1;
                }
            }
            assert!(samples >= 7, "{engine:?} wrote only {samples} samples");
        }
    }
}
