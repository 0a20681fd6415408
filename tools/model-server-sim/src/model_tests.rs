//! Server-model tests. Unless a test says otherwise the cost is a = 10 ms, b = 1 ms per prefill
//! token, c = 0, so step times can be worked out by hand: a step that prefills P tokens takes
//! 10 + P ms, a decode-only step 10 ms.

use super::*;
use Event::*;

fn cfg(max_batch: u32, blocks: u64, block_size: u32) -> ServerConfig {
    ServerConfig {
        max_batch,
        max_batched_tokens: 8192,
        block_size,
        num_gpu_blocks: blocks,
        tokens_per_hash: None,
        enable_lora: false,
        max_lora: 1,
        cost: StepCost { a_ms: 10.0, b_ms_per_prefill_token: 1.0, c_ms_per_context_token: 0.0 },
        speed: 1.0,
        token_events: true,
    }
}

fn req(id: u64, prompt: u32, output: u32, hashes: &[u64], arrival: f64) -> SimRequest {
    SimRequest {
        id,
        prompt_tokens: prompt,
        block_hashes: hashes.to_vec(),
        output_tokens: output,
        adapter: None,
        arrival_ms: arrival,
    }
}

fn lora_req(id: u64, adapter: &str) -> SimRequest {
    SimRequest { adapter: Some(adapter.to_string()), ..req(id, 4, 1, &[], 0.0) }
}

fn events_of(events: &[Event], id: u64) -> Vec<Event> {
    events.iter().filter(|e| e.id() == id).cloned().collect()
}

fn fin(id: u64, t_ms: f64, output_tokens: u32, cached_tokens: u32, preemptions: u32) -> Event {
    Finished { id, t_ms, output_tokens, cached_tokens, preemptions }
}

#[test]
fn batching_limit_queues_the_third_request() {
    // max_batch 2, three 4-token prompts with 2 output tokens, all at t=0.
    // Step 1 [0,18): prefill r1+r2 (8 tokens) → first tokens at 18.
    // Step 2 [18,28): decode r1, r2 → second tokens, both finish at 28.
    // Step 3 [28,42): prefill r3 → first token at 42. Step 4 [42,52): r3 finishes.
    let mut s = Server::new(cfg(2, 100, 4)).unwrap();
    for id in 1..=3 {
        s.submit(req(id, 4, 2, &[], 0.0)).unwrap();
    }
    let early = s.advance_to(5.0);
    assert!(early.is_empty());
    let m = s.metrics_snapshot();
    assert_eq!((m.running, m.waiting), (2, 1));
    let ev = s.advance_to(1000.0);
    assert_eq!(
        ev,
        vec![
            FirstToken { id: 1, t_ms: 18.0 },
            FirstToken { id: 2, t_ms: 18.0 },
            Token { id: 1, t_ms: 28.0, index: 1 },
            fin(1, 28.0, 2, 0, 0),
            Token { id: 2, t_ms: 28.0, index: 1 },
            fin(2, 28.0, 2, 0, 0),
            FirstToken { id: 3, t_ms: 42.0 },
            Token { id: 3, t_ms: 52.0, index: 1 },
            fin(3, 52.0, 2, 0, 0),
        ]
    );
    assert!(s.is_idle());
    assert_eq!(s.next_wakeup(), None);
    let m = s.metrics_snapshot();
    assert_eq!((m.running, m.waiting, m.kv_used_blocks), (0, 0, 0));
    assert_eq!(m.generation_tokens_total, 6);
    assert_eq!(m.prompt_tokens_total, 12);
}

#[test]
fn prefix_hits_reduce_prefill_time() {
    // Block size 4, one hash per block. r1 (16 tokens, hashes 1..4) computes all 16 tokens:
    // 10 + 16 = 26 ms. r2 has the same prompt: at most num_tokens − 1 = 15 tokens can hit, in
    // whole blocks → 3 blocks = 12 tokens; it prefills 4 → 14 ms. r3 shares 2 blocks → 8 tokens
    // cached, 8 computed → 18 ms.
    let mut s = Server::new(cfg(8, 100, 4)).unwrap();
    s.submit(req(1, 16, 1, &[1, 2, 3, 4], 0.0)).unwrap();
    s.submit(req(2, 16, 1, &[1, 2, 3, 4], 100.0)).unwrap();
    s.submit(req(3, 16, 1, &[1, 2, 7, 8], 200.0)).unwrap();
    let ev = s.advance_to(1000.0);
    assert_eq!(events_of(&ev, 1), vec![FirstToken { id: 1, t_ms: 26.0 }, fin(1, 26.0, 1, 0, 0)]);
    assert_eq!(events_of(&ev, 2), vec![FirstToken { id: 2, t_ms: 114.0 }, fin(2, 114.0, 1, 12, 0)]);
    assert_eq!(events_of(&ev, 3), vec![FirstToken { id: 3, t_ms: 218.0 }, fin(3, 218.0, 1, 8, 0)]);
    let m = s.metrics_snapshot();
    // Queries 3 × 16 = 48 tokens; hits 12 + 8 = 20.
    assert_eq!((m.prefix_cache_queries_tokens, m.prefix_cache_hits_tokens), (48, 20));
    // Computed: 16 + 4 + 8 = 28 prompt tokens.
    assert_eq!(m.prefill_tokens_computed, 28);
    // Cached after all finish: keys 1,2,3,4 (r1) + 7,8 (r3) = 6 one-block units, none in use.
    assert_eq!((m.cached_units, m.kv_used_blocks, m.kv_cached_free_blocks), (6, 0, 6));
}

#[test]
fn coarse_hash_units_cover_several_blocks() {
    // tokens_per_hash 8 over block_size 4: one unit = 2 blocks. A 20-token prompt has 2 full
    // units (16 tokens; the third hash is ignored) and a 4-token tail block.
    // r2 repeats r1: max hit = floor(19 / 8) = 2 units = 16 tokens; prefill 4 → 14 ms.
    let mut c = cfg(8, 100, 4);
    c.tokens_per_hash = Some(8);
    let mut s = Server::new(c).unwrap();
    s.submit(req(1, 20, 1, &[1, 2, 3], 0.0)).unwrap();
    s.submit(req(2, 20, 1, &[1, 2, 3], 100.0)).unwrap();
    let ev = s.advance_to(1000.0);
    assert_eq!(events_of(&ev, 1)[0], FirstToken { id: 1, t_ms: 30.0 });
    assert_eq!(events_of(&ev, 2), vec![FirstToken { id: 2, t_ms: 114.0 }, fin(2, 114.0, 1, 16, 0)]);
    let m = s.metrics_snapshot();
    // Two cached units × 2 blocks; tails returned to the pool.
    assert_eq!((m.cached_units, m.kv_cached_free_blocks, m.kv_used_blocks), (2, 4, 0));
}

#[test]
fn adapters_do_not_share_prefix_cache() {
    let mut c = cfg(8, 100, 4);
    c.enable_lora = true;
    c.max_lora = 2;
    let mut s = Server::new(c).unwrap();
    s.submit(req(1, 16, 1, &[1, 2, 3, 4], 0.0)).unwrap();
    s.submit(SimRequest { adapter: Some("a".into()), ..req(2, 16, 1, &[1, 2, 3, 4], 100.0) }).unwrap();
    let ev = s.advance_to(1000.0);
    // Same hashes, different adapter: no hit, full 16-token prefill (26 ms).
    assert_eq!(events_of(&ev, 2), vec![FirstToken { id: 2, t_ms: 126.0 }, fin(2, 126.0, 1, 0, 0)]);
}

#[test]
fn chunked_prefill_shares_the_token_budget() {
    // Budget 8 tokens per step. r1 has a 20-token prompt, r2 a 4-token prompt, both at 0.
    // Step 1 [0,18): r1 chunk 8 (budget used up; r2 not admitted).
    // Step 2 [18,36): r1 chunk 8. Step 3 [36,54): r1 last 4 + r2 4 → both first tokens at 54.
    let mut c = cfg(8, 100, 4);
    c.max_batched_tokens = 8;
    let mut s = Server::new(c).unwrap();
    s.submit(req(1, 20, 1, &[], 0.0)).unwrap();
    s.submit(req(2, 4, 1, &[], 0.0)).unwrap();
    assert_eq!(s.advance_to(30.0), vec![]);
    assert_eq!(s.metrics_snapshot().waiting, 1);
    let ev = s.advance_to(1000.0);
    assert_eq!(
        ev,
        vec![
            FirstToken { id: 1, t_ms: 54.0 },
            fin(1, 54.0, 1, 0, 0),
            FirstToken { id: 2, t_ms: 54.0 },
            fin(2, 54.0, 1, 0, 0)
        ]
    );
}

#[test]
fn full_kv_keeps_requests_waiting() {
    // 4 blocks of 4 tokens. r1: 12-token prompt (3 blocks), 4 output tokens. r2: 8 tokens
    // (2 blocks) does not fit next to r1 and waits.
    // [0,22) prefill r1. [22,32) decode; needs a 4th block for token 13 → KV 4/4.
    // Tokens at 32, 42, 52; r1 finishes at 52. [52,70) r2 prefills 8.
    let mut s = Server::new(cfg(8, 4, 4)).unwrap();
    s.submit(req(1, 12, 4, &[], 0.0)).unwrap();
    s.submit(req(2, 8, 1, &[], 0.0)).unwrap();
    let ev = s.advance_to(30.0);
    assert_eq!(ev, vec![FirstToken { id: 1, t_ms: 22.0 }]);
    let m = s.metrics_snapshot();
    assert_eq!((m.running, m.waiting), (1, 1));
    assert_eq!(m.kv_usage, 1.0);
    let ev = s.advance_to(1000.0);
    assert_eq!(events_of(&ev, 1).last(), Some(&fin(1, 52.0, 4, 0, 0)));
    assert_eq!(events_of(&ev, 2), vec![FirstToken { id: 2, t_ms: 70.0 }, fin(2, 70.0, 1, 0, 0)]);
}

#[test]
fn decode_preempts_the_newest_request_when_kv_runs_out() {
    // 4 blocks of 4. r1, r2: 8-token prompts (2 blocks each), 8 output tokens.
    // [0,26) both prefill. At 26 r1's decode needs a 3rd block: none free → preempt r2 (newest).
    // r1 then decodes alone: tokens at 36, 46, ..., 96 (finish, 8 tokens).
    // At 96 r2 is re-admitted with 9 tokens of context (prompt + 1 generated) and recomputes
    // them: 10 + 9 = 19 → its 2nd token at 115, then one per 10 ms → finishes at 175.
    let mut s = Server::new(cfg(8, 4, 4)).unwrap();
    s.submit(req(1, 8, 8, &[], 0.0)).unwrap();
    s.submit(req(2, 8, 8, &[], 0.0)).unwrap();
    let ev = s.advance_to(1000.0);
    let r2 = events_of(&ev, 2);
    assert_eq!(r2[0], FirstToken { id: 2, t_ms: 26.0 });
    assert_eq!(r2[1], Preempted { id: 2, t_ms: 26.0 });
    assert_eq!(r2[2], Token { id: 2, t_ms: 115.0, index: 1 });
    assert_eq!(r2.last(), Some(&fin(2, 175.0, 8, 0, 1)));
    assert_eq!(r2.iter().filter(|e| matches!(e, FirstToken { .. })).count(), 1);
    assert_eq!(events_of(&ev, 1).last(), Some(&fin(1, 96.0, 8, 0, 0)));
    let m = s.metrics_snapshot();
    assert_eq!(m.preemptions, 1);
    // Queries: r1 8 + r2 8 + r2 again 9 = 25.
    assert_eq!(m.prefix_cache_queries_tokens, 25);
    assert_eq!(m.kv_used_blocks, 0);
}

#[test]
fn lora_slots_skip_blocked_adapter_and_evict_idle_one() {
    // max_lora 1. r1 (adapter a), r2 (adapter b), r3 (base), all 4-token prompts at 0;
    // r1 has 2 output tokens, the others 1.
    // Step 1: r1 loads a; r2 cannot (the only slot runs a) and is skipped; r3 needs no
    // adapter and is admitted → [0,18). Step 2 [18,28): r1 decodes, finishes at 28.
    // Step 3: a is idle → evicted, b loaded → r2 prefills [28,42).
    let mut c = cfg(8, 100, 4);
    c.enable_lora = true;
    c.max_lora = 1;
    let mut s = Server::new(c).unwrap();
    s.submit(SimRequest { output_tokens: 2, ..lora_req(1, "a") }).unwrap();
    s.submit(lora_req(2, "b")).unwrap();
    s.submit(req(3, 4, 1, &[], 0.0)).unwrap();
    assert!(s.advance_to(1.0).is_empty());
    let m = s.metrics_snapshot();
    assert_eq!((m.running, m.waiting), (2, 1));
    assert_eq!(m.running_lora_adapters, vec!["a"]);
    assert_eq!(m.waiting_lora_adapters, vec!["b"]);
    let ev = s.advance_to(1000.0);
    assert_eq!(events_of(&ev, 3), vec![FirstToken { id: 3, t_ms: 18.0 }, fin(3, 18.0, 1, 0, 0)]);
    assert_eq!(events_of(&ev, 1).last(), Some(&fin(1, 28.0, 2, 0, 0)));
    assert_eq!(events_of(&ev, 2), vec![FirstToken { id: 2, t_ms: 42.0 }, fin(2, 42.0, 1, 0, 0)]);
    let m = s.metrics_snapshot();
    // b stays loaded but idle, so it is not "running" (vLLM does not list idle adapters).
    assert!(m.running_lora_adapters.is_empty());
    assert!(m.waiting_lora_adapters.is_empty());
    assert_eq!(m.loaded_lora_adapters, vec!["b"]);
    assert_eq!((m.lora_loads, m.lora_evictions), (2, 1));
}

#[test]
fn prefix_cache_evicts_least_recently_freed_blocks() {
    // 6 blocks of 4 tokens; every request has an 8-token prompt (2 hashed blocks), 1 output.
    // r1 [1,2] @0, r2 [11,12] @100, r3 [21,22] @200 fill the cache with finished prefixes.
    // Freed tail first, so the LRU order is 2,1,12,11,22,21.
    // r4 [31,32] @300 needs 2 blocks → evicts 2 and 1.
    // r5 [11,12] @400 still hits block 11 (1 block = 4 tokens: the hit is capped at 7 tokens).
    // r6 [1,2] @500 misses.
    let mut s = Server::new(cfg(8, 6, 4)).unwrap();
    let prefixes: [[u64; 2]; 6] = [[1, 2], [11, 12], [21, 22], [31, 32], [11, 12], [1, 2]];
    for (i, h) in prefixes.iter().enumerate() {
        s.submit(req(i as u64 + 1, 8, 1, h, 100.0 * i as f64)).unwrap();
    }
    let ev = s.advance_to(350.0);
    assert_eq!(ev.len(), 8, "r1..r4 each FirstToken + Finished");
    assert_eq!(s.metrics_snapshot().evicted_units, 2);
    let ev = s.advance_to(1000.0);
    assert_eq!(events_of(&ev, 5), vec![FirstToken { id: 5, t_ms: 414.0 }, fin(5, 414.0, 1, 4, 0)]);
    assert_eq!(events_of(&ev, 6), vec![FirstToken { id: 6, t_ms: 518.0 }, fin(6, 518.0, 1, 0, 0)]);
}

#[test]
fn same_arrival_requests_share_a_step_only_if_submitted_before_advancing() {
    // Both submitted, then advance_to(5): one step [5,23) prefills 8 tokens.
    let mut s = Server::new(cfg(8, 100, 4)).unwrap();
    assert_eq!(s.next_wakeup(), None);
    s.submit(req(1, 4, 1, &[], 5.0)).unwrap();
    s.submit(req(2, 4, 1, &[], 5.0)).unwrap();
    assert_eq!(s.next_wakeup(), Some(5.0));
    assert!(s.advance_to(5.0).is_empty());
    assert_eq!(s.next_wakeup(), Some(23.0));
    let ev = s.advance_to(23.0);
    assert_eq!(ev.iter().filter(|e| matches!(e, FirstToken { t_ms, .. } if *t_ms == 23.0)).count(), 2);

    // r1 submitted, advance_to(5) starts [5,19) without r2; r2 joins the next step [19,33).
    let mut s = Server::new(cfg(8, 100, 4)).unwrap();
    s.submit(req(1, 4, 1, &[], 5.0)).unwrap();
    s.advance_to(5.0);
    s.submit(req(2, 4, 1, &[], 5.0)).unwrap();
    let ev = s.advance_to(100.0);
    assert_eq!(events_of(&ev, 1)[0], FirstToken { id: 1, t_ms: 19.0 });
    assert_eq!(events_of(&ev, 2)[0], FirstToken { id: 2, t_ms: 33.0 });
}

#[test]
fn late_arrival_is_moved_up_to_model_time() {
    // The model is at 50; a request stamped 10 cannot run in the past: it starts at 50.
    let mut s = Server::new(cfg(8, 100, 4)).unwrap();
    s.advance_to(50.0);
    s.submit(req(1, 4, 1, &[], 10.0)).unwrap();
    let ev = s.advance_to(1000.0);
    assert_eq!(ev[0], FirstToken { id: 1, t_ms: 64.0 });
}

#[test]
fn infinite_time_drains_and_nan_is_ignored() {
    let mut s = Server::new(cfg(8, 100, 4)).unwrap();
    s.submit(req(1, 4, 1, &[], 0.0)).unwrap();
    assert!(s.advance_to(f64::NAN).is_empty());
    assert_eq!(s.advance_to(f64::INFINITY), vec![FirstToken { id: 1, t_ms: 14.0 }, fin(1, 14.0, 1, 0, 0)]);
    // The model's time is the last event's, not infinity: a later request still runs normally.
    assert_eq!(s.now_ms(), 14.0);
    s.submit(req(2, 4, 1, &[], 20.0)).unwrap();
    assert_eq!(s.advance_to(f64::INFINITY)[0], FirstToken { id: 2, t_ms: 34.0 });
}

#[test]
fn speed_divides_step_time() {
    // (10 + 4) / 2 = 7 ms.
    let mut c = cfg(8, 100, 4);
    c.speed = 2.0;
    let mut s = Server::new(c).unwrap();
    s.submit(req(1, 4, 1, &[], 0.0)).unwrap();
    assert_eq!(s.advance_to(100.0)[0], FirstToken { id: 1, t_ms: 7.0 });
}

#[test]
fn abort_frees_kv_and_lets_the_queue_move() {
    // 4 blocks. r1 (12 tokens, 3 blocks) is prefilling [0,22); r2 (8 tokens) waits for KV.
    // Aborting r1 at t=1 frees its blocks at once; the step in flight still ends at 22 (the
    // GPU was busy), r1 produces nothing, and r2 prefills [22,40).
    let mut s = Server::new(cfg(8, 4, 4)).unwrap();
    s.submit(req(1, 12, 4, &[], 0.0)).unwrap();
    s.submit(req(2, 8, 1, &[], 0.0)).unwrap();
    s.advance_to(1.0);
    assert_eq!(s.metrics_snapshot().kv_used_blocks, 3);
    assert!(s.abort(1));
    assert!(!s.abort(1));
    assert!(!s.abort(99));
    assert_eq!(s.metrics_snapshot().kv_used_blocks, 0);
    let ev = s.advance_to(1000.0);
    assert_eq!(ev, vec![FirstToken { id: 2, t_ms: 40.0 }, fin(2, 40.0, 1, 0, 0)]);
    assert_eq!(s.metrics_snapshot().requests_aborted, 1);
    // Aborting a waiting request removes it from the queue.
    s.submit(req(3, 4, 1, &[], 2000.0)).unwrap();
    assert!(s.abort(3));
    assert!(s.is_idle());
}

#[test]
fn submit_refuses_impossible_requests() {
    let mut s = Server::new(cfg(8, 4, 4)).unwrap();
    s.submit(req(1, 4, 1, &[], 0.0)).unwrap();
    assert_eq!(s.submit(req(1, 4, 1, &[], 0.0)), Err(SubmitError::DuplicateId(1)));
    // 16 + 2 − 1 = 17 tokens of KV = 5 blocks > 4.
    assert_eq!(
        s.submit(req(2, 16, 2, &[], 0.0)),
        Err(SubmitError::TooLarge { needed_blocks: 5, num_gpu_blocks: 4 })
    );
    // 16 + 1 − 1 = 16 tokens = 4 blocks: fits exactly.
    assert!(s.submit(req(3, 16, 1, &[], 0.0)).is_ok());
    assert_eq!(s.submit(lora_req(4, "a")), Err(SubmitError::LoraDisabled));
    // A finished id can be reused.
    s.advance_to(1000.0);
    assert!(s.submit(req(1, 4, 1, &[], 1000.0)).is_ok());
}

#[test]
fn config_errors_name_the_field() {
    let mut c = ServerConfig { block_size: 4, tokens_per_hash: Some(6), ..Default::default() };
    assert_eq!(Server::new(c.clone()).unwrap_err().path, "$.tokens_per_hash");
    c.tokens_per_hash = None;
    c.speed = 0.0;
    assert_eq!(c.validate().unwrap_err().path, "$.speed");
    c.speed = 1.0;
    c.cost.b_ms_per_prefill_token = f64::NAN;
    assert_eq!(c.validate().unwrap_err().path, "$.cost.b_ms_per_prefill_token");
    let parsed: Result<ServerConfig, _> = serde_json::from_str(r#"{"max_bacth": 3}"#);
    assert!(parsed.is_err(), "unknown fields are rejected");
    let parsed: ServerConfig = serde_json::from_str(r#"{"max_batch": 3}"#).unwrap();
    assert_eq!(parsed, ServerConfig { max_batch: 3, ..Default::default() });
}

#[test]
fn default_calibration_step_times() {
    let c = StepCost::LLAMA3_8B_H100;
    // One full 8192-token chunk: 8 + 0.022 × 8192 = 188.224 ms.
    assert!((c.step_ms(8192, 0, 1.0) - 188.224).abs() < 1e-9);
    // Decode of 100 requests at 2,000 tokens of context: 8 + 3.91e-5 × 200,000 = 15.82 ms.
    assert!((c.step_ms(0, 200_000, 1.0) - 15.82).abs() < 1e-9);
    assert_eq!(StepCost::fixed(5.0).step_ms(10_000, 10_000, 2.0), 2.5);
}

/// A seeded pseudo-random workload (64-bit LCG) with shared prefixes, adapters and KV pressure.
fn random_workload(seed: u64, n: u64) -> Vec<SimRequest> {
    let mut x = seed;
    let mut next = move || {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        x >> 33
    };
    let adapters = [None, Some("a"), Some("b"), Some("c")];
    let mut t = 0.0;
    (0..n)
        .map(|id| {
            t += (next() % 20) as f64;
            let prefix = next() % 5;
            let prompt = 1 + (next() % 120) as u32;
            let hashes: Vec<u64> = (0..u64::from(prompt) / 4).map(|i| prefix * 1000 + i).collect();
            SimRequest {
                id,
                prompt_tokens: prompt,
                block_hashes: hashes,
                output_tokens: 1 + (next() % 30) as u32,
                adapter: adapters[(next() % 4) as usize].map(str::to_string),
                arrival_ms: t,
            }
        })
        .collect()
}

fn run_workload(reqs: &[SimRequest]) -> (Vec<Event>, MetricsSnapshot) {
    let mut c = cfg(8, 120, 4);
    c.enable_lora = true;
    c.max_lora = 2;
    c.max_batched_tokens = 64;
    c.cost.c_ms_per_context_token = 0.01;
    let mut s = Server::new(c).unwrap();
    let mut events = Vec::new();
    let mut pending = reqs.iter().peekable();
    // The discrete-event loop from the module doc.
    loop {
        let next_arrival = pending.peek().map(|r| r.arrival_ms);
        let t = match (next_arrival, s.next_wakeup()) {
            (Some(a), Some(w)) => a.min(w),
            (Some(a), None) => a,
            (None, Some(w)) => w,
            (None, None) => break,
        };
        while let Some(r) = pending.next_if(|r| r.arrival_ms <= t) {
            s.submit(r.clone()).unwrap();
        }
        s.advance_into(t, &mut events);
    }
    (events, s.metrics_snapshot())
}

#[test]
fn same_input_gives_identical_output_and_everything_finishes() {
    let reqs = random_workload(42, 300);
    let (e1, m1) = run_workload(&reqs);
    let (e2, m2) = run_workload(&reqs);
    assert_eq!(e1, e2);
    assert_eq!(m1, m2);
    // Every request got exactly one first token and one Finished with its output length.
    for r in &reqs {
        let mine = events_of(&e1, r.id);
        assert_eq!(mine.iter().filter(|e| matches!(e, FirstToken { .. })).count(), 1, "req {}", r.id);
        let fins: Vec<_> = mine.iter().filter(|e| matches!(e, Finished { .. })).collect();
        assert_eq!(fins.len(), 1);
        assert!(matches!(fins[0], Finished { output_tokens, .. } if *output_tokens == r.output_tokens));
        assert!(mine.iter().all(|e| e.t_ms() >= r.arrival_ms));
    }
    // Events come out in time order.
    assert!(e1.windows(2).all(|w| w[0].t_ms() <= w[1].t_ms()));
    assert_eq!((m1.running, m1.waiting, m1.kv_used_blocks), (0, 0, 0));
    assert_eq!(m1.requests_finished, 300);
    assert!(m1.prefix_cache_hits_tokens > 0, "shared prefixes must hit");
    assert!(m1.preemptions > 0, "the workload is meant to hit KV pressure");
    assert!(m1.lora_evictions > 0, "four adapters over two slots must evict");
    // A different seed gives a different run (the test is not vacuous).
    let (e3, _) = run_workload(&random_workload(7, 300));
    assert_ne!(e1, e3);
}

#[test]
fn invariants_hold_across_seeds_configs_and_aborts() {
    // Twenty seeded workloads on small, varied servers, aborting every 17th request 5 ms after
    // it arrives. Whatever happens, the model must not panic or stall, KV must never exceed the
    // GPU, every request must end exactly once, and the pool must be empty at the end.
    for seed in 0..20u64 {
        let reqs = random_workload(seed, 150);
        let mut c = cfg(1 + (seed % 8) as u32, 40 + seed * 8, 4);
        c.tokens_per_hash = Some(if seed % 2 == 0 { 4 } else { 8 });
        c.max_batched_tokens = 16 + (seed as u32 % 4) * 16;
        c.enable_lora = true;
        c.max_lora = 1 + (seed % 3) as u32;
        c.cost.c_ms_per_context_token = 0.01;
        let total_blocks = c.num_gpu_blocks;
        let mut s = Server::new(c).unwrap();
        let mut events = Vec::new();
        let mut aborts: Vec<(f64, u64)> =
            reqs.iter().filter(|r| r.id % 17 == 0).map(|r| (r.arrival_ms + 5.0, r.id)).collect();
        aborts.reverse(); // pop() yields the earliest
        let mut pending = reqs.iter().peekable();
        let mut aborted = Vec::new();
        let mut guard = 0;
        loop {
            guard += 1;
            assert!(guard < 1_000_000, "seed {seed}: the event loop does not make progress");
            let candidates =
                [pending.peek().map(|r| r.arrival_ms), s.next_wakeup(), aborts.last().map(|a| a.0)];
            let Some(t) = candidates.into_iter().flatten().min_by(f64::total_cmp) else { break };
            while let Some(r) = pending.next_if(|r| r.arrival_ms <= t) {
                s.submit(r.clone()).unwrap();
            }
            s.advance_into(t, &mut events);
            while aborts.last().is_some_and(|a| a.0 <= t) {
                let (_, id) = aborts.pop().unwrap();
                if s.abort(id) {
                    aborted.push(id);
                }
            }
            let m = s.metrics_snapshot();
            assert!(m.kv_used_blocks + m.kv_cached_free_blocks <= total_blocks, "seed {seed}");
        }
        let m = s.metrics_snapshot();
        assert_eq!((m.running, m.waiting, m.kv_used_blocks), (0, 0, 0), "seed {seed}");
        assert!(m.prefix_cache_hits_tokens <= m.prefix_cache_queries_tokens);
        assert!(events.windows(2).all(|w| w[0].t_ms() <= w[1].t_ms()), "seed {seed}");
        for r in &reqs {
            let ends = events_of(&events, r.id).iter().filter(|e| matches!(e, Finished { .. })).count();
            let was_aborted = aborted.contains(&r.id);
            assert_eq!(ends + usize::from(was_aborted), 1, "seed {seed} req {}", r.id);
        }
        assert_eq!(m.requests_finished + m.requests_aborted, 150, "seed {seed}");
        assert_eq!(m.requests_rejected, 0, "seed {seed}");
        assert!(!aborted.is_empty(), "seed {seed}: the abort path was not exercised");
    }
}

#[test]
fn an_imported_prefix_is_served_from_the_cache() {
    // Block size 4, one hash per block. Importing the 16-token prompt's 4 units (a remote
    // prefill's KV) leaves them cached and evictable; the request then computes only what
    // vLLM always computes (num_tokens − 1 caps the hit at 3 blocks = 12 tokens): 10 + 4 ms.
    let mut s = Server::new(cfg(8, 100, 4)).unwrap();
    assert_eq!(s.import_prefix(&[1, 2, 3, 4], 16, None), 16);
    let m = s.metrics_snapshot();
    assert_eq!((m.cached_units, m.kv_used_blocks, m.kv_cached_free_blocks), (4, 0, 4));
    // Importing again changes nothing.
    assert_eq!(s.import_prefix(&[1, 2, 3, 4], 16, None), 16);
    assert_eq!(s.metrics_snapshot().cached_units, 4);
    s.submit(req(1, 16, 1, &[1, 2, 3, 4], 0.0)).unwrap();
    let ev = s.advance_to(1000.0);
    assert_eq!(events_of(&ev, 1), vec![FirstToken { id: 1, t_ms: 14.0 }, fin(1, 14.0, 1, 12, 0)]);
    // Room for one unit only (3 blocks, 2 held by a request mid-prefill): the first unit is
    // imported, the import stops at the second.
    let mut s = Server::new(cfg(8, 3, 4)).unwrap();
    s.submit(req(2, 8, 1, &[], 0.0)).unwrap();
    s.advance_to(5.0);
    assert_eq!(s.metrics_snapshot().kv_used_blocks, 2);
    assert_eq!(s.import_prefix(&[5, 6], 8, None), 4);
}
