//! Benchmarks of the request path: body extraction, prefix hashing, and one full decision
//! (parse, hash, score, pick, record) over 16, 128 and 1024 endpoints.
//!
//! Inputs are the real chat bodies in tests/fixtures/requests (see the README there). The
//! 32 KiB body is their long second-turn chat with the shared-prefix document appended as a
//! further turn, so it is real text with real JSON escapes.
//!
//! Run: `cargo bench -p inference-picker --bench scheduler`.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

use inference_picker::base::ports::{MemStore, SplitMix64};
use inference_picker::request::body::parse_request;
use inference_picker::scheduler::prefix;
use inference_picker::scheduler::{PickRequest, Scheduler};

mod fixture;
use fixture::{body_32k, config, pick, snapshot, FIXTURES, NOW, PATH};

fn bench_parse(c: &mut Criterion) {
    let mut g = c.benchmark_group("body_parse");
    let big = body_32k();
    let mut inputs: Vec<(&str, &[u8])> = FIXTURES.to_vec();
    inputs.push(("chat_32k", &big));
    for (name, body) in inputs {
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_with_input(
            BenchmarkId::from_parameter(format!("{name}/{}B", body.len())),
            body,
            |b, body| b.iter(|| parse_request(PATH, black_box(body)).unwrap()),
        );
    }
    g.finish();
}

fn bench_hash(c: &mut Criterion) {
    let mut g = c.benchmark_group("prefix_hash");
    let big = body_32k();
    let prompt = parse_request(PATH, &big).unwrap().prompt;
    let mut out = Vec::new();
    for (block, max) in [(64usize, 256usize), (256, 256)] {
        let hashed = prompt.len().min(block * max);
        g.throughput(Throughput::Bytes(hashed as u64));
        g.bench_function(format!("{}B_prompt/block{block}x{max}", prompt.len()), |b| {
            b.iter(|| {
                prefix::block_hashes(black_box(&prompt), prefix::seed("m", None), block, max, &mut out);
                out.len()
            })
        });
    }
    g.finish();
}

/// Every case below ends each request as the host does (`Scheduler::request_done`, from
/// `on_log`), inside the timed loop: without it the prefill ledger only grows, the default
/// objective spreads the repeated prompt over every endpoint, and the case drifts to a state no
/// running gateway reaches (every endpoint's index holding the same 32 KiB prompt).
fn bench_decision(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision");
    let big = body_32k();
    for n in [16usize, 128, 1024] {
        let (snap, inflight) = snapshot(n);
        // Repeat: the same conversation again (prefix hits in the local index and the shared
        // table, checkpoints already recorded for the winner: reads only).
        let store = MemStore::new();
        let mut sched = Scheduler::new(&config());
        let mut rng = SplitMix64::new(1);
        g.bench_function(BenchmarkId::new("repeat_32k", n), |b| {
            b.iter(|| {
                let p = parse_request(PATH, black_box(&big)).unwrap();
                let r = PickRequest {
                    model: &p.model,
                    prompt: &p.prompt,
                    cache_salt: None,
                    session_id: None,
                    session_token: None,
                    slo: None,
                };
                let pick = pick(&mut sched, &r, &snap, &inflight, &store, &mut rng);
                sched.request_done(pick.ticket);
                pick
            })
        });
        // Fresh: a prompt never seen (a new cache_salt each time makes every block hash new):
        // one shared read, a write per checkpoint shard, local index inserts.
        let store = MemStore::new();
        let mut sched = Scheduler::new(&config());
        let mut i = 0u64;
        g.bench_function(BenchmarkId::new("fresh_32k", n), |b| {
            b.iter(|| {
                i += 1;
                let salt = i.to_string();
                let p = parse_request(PATH, black_box(&big)).unwrap();
                let r = PickRequest {
                    model: &p.model,
                    prompt: &p.prompt,
                    cache_salt: Some(&salt),
                    session_id: Some(&salt),
                    session_token: None,
                    slo: None,
                };
                let pick = pick(&mut sched, &r, &snap, &inflight, &store, &mut rng);
                sched.request_done(pick.ticket);
                pick
            })
        });
        // Pick only (body parsed once): the scheduler's own cost.
        let p = parse_request(PATH, &big).unwrap();
        let store = MemStore::new();
        let mut sched = Scheduler::new(&config());
        g.bench_function(BenchmarkId::new("pick_only_repeat_32k", n), |b| {
            b.iter(|| {
                let r = PickRequest {
                    model: &p.model,
                    prompt: black_box(&p.prompt),
                    cache_salt: None,
                    session_id: None,
                    session_token: None,
                    slo: None,
                };
                let pick = pick(&mut sched, &r, &snap, &inflight, &store, &mut rng);
                sched.request_done(pick.ticket);
                pick
            })
        });
    }
    g.finish();
}

/// Admission of one request with the shipped defaults (flow control off), a standard priority:
/// what every request pays before the pick.
fn bench_admission(c: &mut Criterion) {
    use inference_picker::flow::admission::Gate;
    use inference_picker::flow::priority::{PriorityDecision, PrioritySource};
    let mut g = c.benchmark_group("admission");
    let cfg = config();
    let prio = PriorityDecision {
        priority: 0,
        source: PrioritySource::Model,
        objective: None,
        tier: None,
        fairness_id: "default-flow".into(),
        targets: Default::default(),
    };
    for n in [128usize, 1024] {
        let (snap, inflight) = snapshot(n);
        let store = MemStore::new();
        let mut gate = Gate::new(&cfg, 1);
        g.bench_function(BenchmarkId::new("admit_flow_off", n), |b| {
            b.iter(|| {
                gate.admit(
                    &store,
                    black_box(&snap),
                    &inflight,
                    1,
                    "meta-llama/Llama-3.1-8B-Instruct",
                    &prio,
                    NOW,
                )
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench_parse, bench_hash, bench_decision, bench_admission);
criterion_main!(benches);
