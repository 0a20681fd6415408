//! A discrete-event replay over several simulated servers, as the replay benchmark drives them,
//! on a synthetic Mooncake-like workload (no data files are read): ~12k requests over an hour,
//! ~12k-token prompts hashed in 512-token units with shared prefixes, round-robin routing.
//!
//! `cargo run --release -p model-server-sim --no-default-features --example replay [servers] [requests]`

use std::time::Instant;

use model_server_sim::{Event, Server, ServerConfig, SimRequest};

fn main() {
    let mut args = std::env::args().skip(1);
    let n_servers: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(8);
    let n_requests: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(12_000);

    let cfg = ServerConfig { tokens_per_hash: Some(512), token_events: false, ..Default::default() };
    let mut servers: Vec<Server> =
        (0..n_servers).map(|_| Server::new(cfg.clone()).expect("valid config")).collect();

    // Seeded LCG workload: 200 shared prefixes ("system prompts + history") of 0..16 units,
    // then a private suffix; prompt ≈ 12k tokens on average, output 1..600.
    let mut x: u64 = 12345;
    let mut rnd = move |m: u64| {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (x >> 33) % m
    };
    let mut t = 0.0;
    let reqs: Vec<SimRequest> = (0..n_requests)
        .map(|id| {
            t += 3_600_000.0 / n_requests as f64 * (rnd(2000) as f64 / 1000.0);
            let prompt = 2_000 + rnd(20_000) as u32;
            let units = u64::from(prompt) / 512;
            let prefix = rnd(200);
            let shared = rnd(17).min(units);
            let hashes = (0..units)
                .map(|i| if i < shared { prefix * 1_000 + i } else { 1_000_000 + id * 1_000 + i })
                .collect();
            SimRequest {
                id,
                prompt_tokens: prompt,
                block_hashes: hashes,
                output_tokens: 1 + rnd(600) as u32,
                adapter: None,
                arrival_ms: t,
            }
        })
        .collect();

    #[allow(clippy::disallowed_methods)] // measuring the replay's own wall time
    let wall = Instant::now();
    let mut events: Vec<Event> = Vec::new();
    let mut ttft_sum = 0.0;
    let mut first = 0u64;
    let mut finished = 0u64;
    let arrival_of = |id: u64| reqs[id as usize].arrival_ms;
    let mut next_req = 0usize;
    loop {
        let next_arrival = reqs.get(next_req).map(|r| r.arrival_ms);
        let next_wake = servers.iter().filter_map(|s| s.next_wakeup()).min_by(f64::total_cmp);
        let t = match (next_arrival, next_wake) {
            (Some(a), Some(w)) => a.min(w),
            (Some(a), None) => a,
            (None, Some(w)) => w,
            (None, None) => break,
        };
        while let Some(r) = reqs.get(next_req).filter(|r| r.arrival_ms <= t) {
            servers[next_req % n_servers].submit(r.clone()).expect("fits");
            next_req += 1;
        }
        for s in &mut servers {
            events.clear();
            s.advance_into(t, &mut events);
            for e in &events {
                match *e {
                    Event::FirstToken { id, t_ms } => {
                        ttft_sum += t_ms - arrival_of(id);
                        first += 1;
                    }
                    Event::Finished { .. } => finished += 1,
                    _ => {}
                }
            }
        }
    }
    let (mut q, mut h, mut steps) = (0u64, 0u64, 0u64);
    for s in &servers {
        let m = s.metrics_snapshot();
        q += m.prefix_cache_queries_tokens;
        h += m.prefix_cache_hits_tokens;
        steps += m.steps;
    }
    println!(
        "servers={n_servers} requests={n_requests} finished={finished} mean_ttft_ms={:.1} hit_rate={:.3} steps={steps} wall_s={:.2}",
        ttft_sum / first.max(1) as f64,
        h as f64 / q.max(1) as f64,
        wall.elapsed().as_secs_f64()
    );
}
