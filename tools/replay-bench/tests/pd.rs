//! The P/D replay end to end on a tiny trace: requests are conserved, the split rule follows the
//! threshold, and prefill pods are never destinations (every split request is decoded on a decode
//! pod, so every request produces exactly one TTFT).

use model_server_sim::ServerConfig;
use replay_bench::pd::{run, PdRun};
use replay_bench::trace::{self, SharedPrefixShape};

fn tiny() -> replay_bench::trace::Trace {
    // 8 groups × 4 users, a 2,000-token system prompt and a 100-token question, 8 tokens out,
    // at 4 requests/s for 20 s (≈ 80 requests).
    let shape = SharedPrefixShape {
        groups: 8,
        users: 4,
        system_tokens: 2000,
        question_tokens: 100,
        output_tokens: 8,
        stages: vec![(4.0, 20.0)],
    };
    trace::shared_prefix("tiny-pd", &shape, 3)
}

fn pd_run(prefill: usize, threshold: u64) -> PdRun {
    PdRun {
        servers: 4,
        prefill,
        threshold,
        decode_prefix_factor: 0.5,
        // llm-d's rule alone; the guard has its own test.
        prefill_busy_factor: 0.0,
        server: ServerConfig { num_gpu_blocks: 4000, ..Default::default() },
        poll_ms: 100,
        load: 1.0,
        seed: 1,
        kv_bytes_per_token: 131_072.0,
        kv_gbps: 25.0,
        prefill_inflight: true,
    }
}

#[test]
fn split_follows_the_threshold_and_every_request_finishes_once() {
    let t = tiny();
    let n = t.requests.len();
    let agg = run(&t, &pd_run(0, 0)).unwrap();
    assert_eq!((agg.finished, agg.rejected, agg.split_pct), (n, 0, 0.0), "{agg:?}");
    // llm-d's default threshold 0: every request goes through a prefill pod.
    let all = run(&t, &pd_run(1, 0)).unwrap();
    assert_eq!((all.finished, all.rejected, all.split_pct), (n, 0, 100.0), "{all:?}");
    // A threshold above every prompt: nothing is split.
    let none = run(&t, &pd_run(1, 1_000_000)).unwrap();
    assert_eq!((none.finished, none.split_pct), (n, 0.0), "{none:?}");
    // 2,100 tokens uncached exceed 1,000; once a decode pod holds a group's system prompt only
    // the question (100 tokens) is uncached: some requests split, not all.
    let some = run(&t, &pd_run(1, 1000)).unwrap();
    assert!(some.split_pct > 0.0 && some.split_pct < 100.0, "{some:?}");
    assert_eq!(some.finished, n);
    // Decoding with the KV imported: the TPOT is measured for every split request too.
    assert!(all.tpot_p50_ms > 0.0 && all.ttft_p50_ms > 0.0);
}

#[test]
fn the_prefill_busy_guard_keeps_requests_off_a_saturated_prefill_pod() {
    // One prefill pod for three decode pods, llm-d's threshold 0, under load: without the guard
    // every request waits for the one prefill pod; with it, the decode pods prefill what the
    // prefill pod cannot take in time.
    let t = tiny();
    let n = t.requests.len();
    let loaded = |factor: f64| PdRun { load: 6.0, prefill_busy_factor: factor, ..pd_run(1, 0) };
    let off = run(&t, &loaded(0.0)).unwrap();
    let on = run(&t, &loaded(2.0)).unwrap();
    assert_eq!((off.finished, on.finished), (n, n));
    assert_eq!(off.split_pct, 100.0, "{off:?}");
    assert!(on.split_pct < 100.0, "the guard kept some requests local: {on:?}");
    assert!(on.ttft_p90_ms < off.ttft_p90_ms, "and the TTFT p90 fell: {on:?} vs {off:?}");
}
