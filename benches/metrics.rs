//! Metrics parsing: one scrape body of each engine through `metrics::parse_metrics`, the same
//! call the poller makes per endpoint per interval. Inputs are the real and constructed dumps in
//! tests/fixtures/metrics (see its README for sources and licences).
//!
//! `cargo bench -p inference-picker --bench metrics`

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use inference_picker::poll::scrape::parse_metrics;

const FIXTURES: &[(&str, &str)] = &[
    (
        "sglang_production_llama31_8b",
        include_str!("../tests/fixtures/metrics/sglang_docs_production_metrics_llama31_8b.prom"),
    ),
    ("vllm_v1_dp2_lora", include_str!("../tests/fixtures/metrics/vllm_v1_0.33_dp2_lora_constructed.prom")),
    (
        "triton_trtllm_inflight_batcher",
        include_str!("../tests/fixtures/metrics/triton_trtllm_backend_readme_inflight_batcher.prom"),
    ),
    ("trtllm_serve", include_str!("../tests/fixtures/metrics/trtllm_serve_constructed.prom")),
];

fn bench_metrics(c: &mut Criterion) {
    let mut g = c.benchmark_group("metrics_parse");
    for (name, text) in FIXTURES {
        // Every fixture must parse, or the benchmark would time the error path.
        assert!(parse_metrics(text).is_ok(), "{name} does not parse");
        g.throughput(Throughput::Bytes(text.len() as u64));
        g.bench_function(*name, |b| b.iter(|| parse_metrics(black_box(text))));
    }
    // A large vLLM scrape: the dp2 fixture repeated under 64 other model names, as a server with
    // many series (histograms per model) would expose.
    let big: String = (0..64)
        .map(|i| FIXTURES[1].1.replace("model_name=\"", &format!("model_name=\"m{i}-")))
        .collect::<Vec<_>>()
        .join("\n");
    g.throughput(Throughput::Bytes(big.len() as u64));
    g.bench_function("vllm_v1_64_models", |b| b.iter(|| parse_metrics(black_box(&big))));
    g.finish();
}

criterion_group!(benches, bench_metrics);
criterion_main!(benches);
