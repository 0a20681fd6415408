//! A tiny replay (a few seconds in a debug build) so that the benchmark cannot rot: it runs the
//! real scheduler, the baselines, the poller and the server model end to end and checks what
//! must hold whatever the calibration.

use model_server_sim::ServerConfig;
use replay_bench::replay::{run, RunConfig};
use replay_bench::stats::{hit_rate_bound, RunResult};
use replay_bench::strategy::Policy;
use replay_bench::suite::{self, CORE};
use replay_bench::trace::{self, SharedPrefixShape, Tier, Trace};

fn rc(servers: usize, kv_blocks: u64, load: f64) -> RunConfig {
    RunConfig {
        servers,
        server: ServerConfig { num_gpu_blocks: kv_blocks, ..Default::default() },
        replicas: 1,
        workers: 1,
        poll_ms: 100,
        metrics_delay_ms: 10,
        load,
        seed: 3,
        ours_overrides: None,
        peer_sync_ms: None,
        no_feed: false,
        pod_mix: vec![],
        slo: None,
    }
}

/// 16 groups × 4 users, a 3,000-token system prompt and a 100-token question, 8 tokens out, at
/// 8 requests/s for 40 s (≈ 320 requests). Uncached, one prompt costs 8 + 0.022 × 3,100 ≈ 76 ms
/// of prefill, so 4 servers at 8/s are busy ~15 % of the time without the cache; a cache hit
/// leaves ~10 ms.
fn shared_prefix() -> Trace {
    let shape = SharedPrefixShape {
        groups: 16,
        users: 4,
        system_tokens: 3000,
        question_tokens: 100,
        output_tokens: 8,
        stages: vec![(8.0, 40.0)],
    };
    trace::shared_prefix("tiny-shared-prefix", &shape, 5)
}

fn conserved(r: &RunResult) {
    assert_eq!(r.finished + r.rejected, r.requests, "{} lost requests: {r:?}", r.strategy);
    assert_eq!(r.unfinished, 0, "{}", r.strategy);
    assert_eq!(r.scrape_errors, 0, "{}: the poller could not parse the rendered metrics", r.strategy);
    // Requests accepted by a server either finished or were dropped by it later.
    let dropped = r.rejections.get("server_rejected").copied().unwrap_or(0);
    assert_eq!(r.per_server.iter().sum::<u64>() as usize, r.finished + dropped, "{}", r.strategy);
}

#[test]
fn prefix_aware_beats_random_on_shared_prefixes() {
    let t = shared_prefix();
    let bound = hit_rate_bound(&t);
    // 64 distinct prompts of 3,100 tokens among ~320 requests: most tokens repeat.
    assert!(bound > 0.8, "{bound}");
    // KV 2,000 blocks = 32k tokens per server, about 10 prompts: a server holds the 4 system
    // prompts of the groups routing keeps on it (12k tokens, plus questions), but not all 16
    // (48k) that random routing sends to every server.
    let cfg = rc(4, 2000, 1.0);
    let ours = run(&t, Policy::Ours, &cfg).unwrap();
    let random = run(&t, Policy::Random, &cfg).unwrap();
    let sglang = run(&t, Policy::Sglang, &cfg).unwrap();
    for r in [&ours, &random, &sglang] {
        conserved(r);
        assert_eq!(r.rejected, 0, "{r:?}");
        assert!(r.hit_rate <= bound + 1e-9, "{} hit {} > bound {bound}", r.strategy, r.hit_rate);
    }
    // Random spreads each group over all 4 servers, so a group's system prompt is computed up to
    // 4 times and each server's cache churns; prefix-aware routing computes it about once.
    assert!(ours.hit_rate > random.hit_rate + 0.1, "ours {} random {}", ours.hit_rate, random.hit_rate);
    assert!(sglang.hit_rate > random.hit_rate + 0.1, "sglang {} random {}", sglang.hit_rate, random.hit_rate);
    assert!(ours.ttft_mean_s < random.ttft_mean_s, "ours {} random {}", ours.ttft_mean_s, random.ttft_mean_s);
    assert!(ours.ttft_p90_s < random.ttft_p90_s, "ours {} random {}", ours.ttft_p90_s, random.ttft_p90_s);
}

#[test]
fn every_strategy_conserves_requests_on_real_mooncake_rows() {
    let mut t = trace::load(&suite::data_dir().join("mooncake_conversation_trace.jsonl.gz")).unwrap();
    t.truncate(150);
    trace::assign_tiers(&mut t, 0.3, 0.4, 1);
    // 150 requests of the first ~45 s at 20× load: ~2 s of arrivals on 3 small servers.
    let cfg = rc(3, 12_000, 20.0);
    let bound = hit_rate_bound(&t);
    for p in CORE.into_iter().chain([Policy::OursTiers]).chain(suite::GAP) {
        let r = run(&t, p, &cfg).unwrap();
        conserved(&r);
        assert!(r.hit_rate <= bound + 1e-9, "{}", p.name());
        assert!(r.ttft_p50_s <= r.ttft_p90_s && r.ttft_p90_s <= r.ttft_p99_s, "{r:?}");
        // Tier labels are reported per tier and add up to the finished requests.
        assert_eq!(r.tiers.len(), 3);
        assert_eq!(r.tiers.iter().map(|x| x.finished).sum::<usize>(), r.finished);
        assert_eq!(r.tiers[0].tier, Tier::Premium.as_str());
    }
    // Round-robin spreads exactly: 150 requests over 3 servers.
    let rr = run(&t, Policy::RoundRobin, &cfg).unwrap();
    assert_eq!(rr.per_server, vec![50, 50, 50]);
    // Scale-out: 2 replicas × 2 workers still routes every request.
    let mut c4 = cfg.clone();
    c4.replicas = 2;
    c4.workers = 2;
    for p in [Policy::Ours, Policy::Sglang, Policy::Dynamo] {
        conserved(&run(&t, p, &c4).unwrap());
    }
    // GIE's EPP is one central process: the topology changes nothing in its routing.
    let (g1, g4) = (run(&t, Policy::GieDefault, &cfg).unwrap(), run(&t, Policy::GieDefault, &c4).unwrap());
    assert_eq!(g1.per_server, g4.per_server);
    assert_eq!(g1.ttft_p90_s, g4.ttft_p90_s);
}

/// The `--peer-sync-ms` study: four replicas that replay each other's prefix-table writes find
/// prefixes their peers placed, and hit the cache more than replicas that share nothing.
#[test]
fn replicas_that_exchange_prefix_tables_find_their_peers_placements() {
    let mut t = trace::load(&suite::data_dir().join("mooncake_conversation_trace.jsonl.gz")).unwrap();
    t.truncate(1500);
    let mut cfg = rc(8, 12_000, 4.0);
    cfg.replicas = 4;
    let plain = cfg.clone();
    let alone = run(&t, Policy::Ours, &cfg).unwrap();
    cfg.peer_sync_ms = Some(1000);
    let synced = run(&t, Policy::Ours, &cfg).unwrap();
    for r in [&alone, &synced] {
        conserved(r);
    }
    // With the exchange the rendezvous credit is off (each replica knows where the others
    // placed a prefix); the replicas alone keep it, and still find fewer of their prefixes.
    assert!(synced.hit_rate > alone.hit_rate, "synced {} alone {}", synced.hit_rate, alone.hit_rate);
    // Against replicas alone without the credit either, the exchange is what finds them: first
    // 1,500 rows (0.055 against 0.044; replicas alone with the credit 0.051), a conversation's
    // later turns come after.
    let mut blind = cfg.clone();
    blind.peer_sync_ms = None;
    blind.ours_overrides = Some(serde_json::json!({"scheduler": {"predicted": {"rendezvous_credit": 0.0}}}));
    let blind = run(&t, Policy::Ours, &blind).unwrap();
    assert!(synced.hit_rate > blind.hit_rate * 1.15, "synced {} blind {}", synced.hit_rate, blind.hit_rate);
    // Only replicas of ours exchange: a baseline's run is the same with the study on.
    t.truncate(300);
    let (s0, s1) = (run(&t, Policy::Sglang, &plain).unwrap(), run(&t, Policy::Sglang, &cfg).unwrap());
    assert_eq!(s0.per_server, s1.per_server);
    cfg.peer_sync_ms = Some(0);
    assert!(cfg.validate().is_err());
}

#[test]
fn dynamo_with_events_and_the_oracle_find_the_cached_prefixes() {
    let t = shared_prefix();
    let cfg = rc(4, 2000, 1.0);
    let random = run(&t, Policy::Random, &cfg).unwrap();
    for p in [
        Policy::Dynamo,
        Policy::DynamoNoEvents,
        Policy::Oracle,
        Policy::OracleStale,
        Policy::OracleApproxPrefix,
    ] {
        let r = run(&t, p, &cfg).unwrap();
        conserved(&r);
        assert_eq!(r.rejected, 0, "{r:?}");
        assert!(r.hit_rate > random.hit_rate + 0.1, "{} {} random {}", p.name(), r.hit_rate, random.hit_rate);
        assert!(
            r.ttft_p90_s < random.ttft_p90_s,
            "{} {} random {}",
            p.name(),
            r.ttft_p90_s,
            random.ttft_p90_s
        );
    }
}

#[test]
fn an_impossible_request_is_rejected_not_lost() {
    // Requests of 3,108 tokens (prompt + output) on servers with 64 blocks (1,024 tokens): the
    // server refuses them at submit; the replay counts them as rejected.
    let mut t = shared_prefix();
    t.truncate(3);
    let cfg = rc(2, 64, 1.0);
    let r = run(&t, Policy::RoundRobin, &cfg).unwrap();
    assert_eq!((r.finished, r.rejected), (0, 3), "{r:?}");
    assert_eq!(r.rejections.get("server_too_large"), Some(&3));
}

#[test]
fn the_report_has_the_summary_line() {
    let t = shared_prefix();
    let mut w = suite::file_workload(
        &suite::data_dir().join("mooncake_conversation_trace.jsonl.gz"),
        2,
        vec![0.5, 1.0],
    )
    .unwrap();
    w.trace = t;
    w.trace.truncate(60);
    w.key = "tiny".into();
    w.strategies = vec![Policy::Ours, Policy::GieDefault, Policy::RoundRobin, Policy::Dynamo, Policy::Oracle];
    let common = suite::Common { seeds: vec![1, 2, 3], ..Default::default() };
    let ws = [w.clone()];
    let mut res = suite::empty_results(&ws);
    suite::execute(&ws, &mut res, &suite::main_tasks(&ws, &common), &common, 2, &|_| {}).unwrap();
    // Without the scale-out runs there is no SUMMARY, and the bench says why instead of printing
    // n/a.
    let err = suite::summary_line(&res[0]).unwrap_err();
    assert!(err.contains("4x4"), "{err}");
    let scale = suite::scale_out_tasks(&res, &ws, &common);
    // 1 × 4 and 4 × 4, 3 seeds each.
    assert_eq!(scale.len(), 6);
    suite::execute(&ws, &mut res, &scale, &common, 2, &|_| {}).unwrap();
    let line = suite::summary_line(&res[0]).unwrap();
    let fields: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(&fields[..3], &["SUMMARY", "tiny", "ref_load=1"], "{line}");
    let names: Vec<&str> = fields[3..].iter().map(|f| f.split('=').next().unwrap()).collect();
    assert_eq!(
        names,
        [
            "ttft_p90_vs_round_robin",
            "ttft_p90_vs_gie_default",
            "ttft_p90_vs_best_baseline",
            "worst_vs_best_baseline",
            "hit_rate_vs_pooled_lru",
            "hit_rate_vs_pooled_opt",
            "rejected_pct",
            "replicas_4x4_vs_1x1",
            "hit_rate_4x4_vs_1x1",
            "workers_1x4_vs_1x1",
            "ttft_p90_vs_dynamo",
            "ttft_p90_vs_oracle",
            "seeds",
        ]
    );
    for f in &fields[3..] {
        let v = f.split('=').nth(1).unwrap();
        assert!(v.parse::<f64>().is_ok_and(f64::is_finite), "{f} in {line}");
    }
    assert!(line.ends_with("seeds=3"), "{line}");
    // Each point has its 3 seeds; the pooled OPT bound is at least the pooled LRU one.
    assert!(res[0].points.iter().all(|p| p.seeds == 3));
    assert!(res[0].hit_rate_bound_pooled_opt >= res[0].hit_rate_bound_pooled - 1e-12);
    let md = replay_bench::report::markdown(&res, &ws, &common, "test", 0.0, 1.0);
    assert!(md.contains("| ours | 1 | 1×1 |"), "{md}");
    assert!(md.contains("| ours | 1 | 4×4 |"), "{md}");
}

#[test]
fn a_trace_gets_a_sweep_from_light_load_to_past_saturation() {
    // The first 1,500 Mooncake requests (about 7 minutes): same mix, so the same estimate of
    // where 8 servers saturate, at a fraction of the cost of the whole trace in a debug build.
    let mut t = trace::load(&suite::data_dir().join("mooncake_conversation_trace.jsonl.gz")).unwrap();
    t.truncate(1500);
    let server = ServerConfig::default();
    let loads = suite::auto_loads(&t, 8, &server);
    assert_eq!(loads.len(), 5, "{loads:?}");
    assert!(loads.windows(2).all(|x| x[0] < x[1]), "{loads:?}");
    // The fourth load is the estimated saturation: arrival rate × load = estimated capacity.
    let rate = t.requests.len() as f64 / t.span_s();
    let cap = suite::estimated_capacity_rps(&t, 8, &server);
    assert!((loads[3] * rate / cap - 1.0).abs() < 0.06, "{loads:?} rate {rate} cap {cap}");
    // Light load first, past saturation last.
    assert!(loads[0] < 0.35 * loads[3] && loads[4] > 1.2 * loads[3], "{loads:?}");
}

#[test]
fn flow_control_protects_premium_under_overload() {
    // 40 requests/s of 3,100-token prompts for 10 s on one server: its prefill alone needs
    // ~3 s per second of arrivals (40 × 76 ms), so it saturates at once.
    let shape = SharedPrefixShape {
        groups: 40,
        users: 1,
        system_tokens: 3000,
        question_tokens: 100,
        output_tokens: 8,
        stages: vec![(40.0, 10.0)],
    };
    let mut t = trace::shared_prefix("tiny-overload", &shape, 9);
    trace::assign_tiers(&mut t, 0.3, 0.4, 2);
    let cfg = rc(1, 20_000, 1.0);
    let ours = run(&t, Policy::OursFlow, &cfg).unwrap();
    conserved(&ours);
    let tier = |name: &str| ours.tiers.iter().find(|x| x.tier == name).unwrap().clone();
    let (p, sh) = (tier("premium"), tier("sheddable"));
    // Sheddable requests are shed (429) while saturated; premium ones are held and released
    // first, so they finish sooner than the standard ones.
    assert!(ours.rejections.get("flow_429_request_shed").copied().unwrap_or(0) > 0, "{ours:?}");
    assert!(sh.rejected > 0 && p.rejected < sh.rejected, "{ours:?}");
    assert!(p.ttft_p90_s < tier("standard").ttft_p90_s, "{ours:?}");
    // Round-robin has no flow control: nothing is rejected, every tier waits alike.
    let rr = run(&t, Policy::RoundRobin, &cfg).unwrap();
    conserved(&rr);
    assert_eq!(rr.rejected, 0);
}

/// Three hot groups on four pods at 0.3 × speed: each group needs more than one pod.
const GROUP_RATE: f64 = 20.0;
const GROUP_SPEED: f64 = 0.3;

/// The placement feed between one Envoy's workers: with it, eight workers hit the cache as one
/// worker does; without it (the study switch), each knows exactly only its own placements, and
/// the other holders of a group only through the table, and misses more.
#[test]
fn workers_that_share_their_placements_hit_the_cache_as_one_worker_does() {
    let shape = SharedPrefixShape {
        groups: 3,
        users: 16,
        system_tokens: 3000,
        question_tokens: 100,
        output_tokens: 8,
        stages: vec![(GROUP_RATE, 30.0)],
    };
    let t = trace::shared_prefix("tiny-hot-groups", &shape, 5);
    let mut cfg = rc(4, 3000, 1.0);
    cfg.server.speed = GROUP_SPEED;
    let one = run(&t, Policy::Ours, &cfg).unwrap();
    cfg.workers = 8;
    let fed = run(&t, Policy::Ours, &cfg).unwrap();
    cfg.no_feed = true;
    let blind = run(&t, Policy::Ours, &cfg).unwrap();
    for r in [&one, &fed, &blind] {
        conserved(r);
    }
    assert!(fed.hit_rate > blind.hit_rate, "fed {} blind {}", fed.hit_rate, blind.hit_rate);
    assert!(fed.hit_rate >= one.hit_rate * 0.99, "fed {} one {}", fed.hit_rate, one.hit_rate);
}
