//! Differential harness of the pick: the same seeded request sequences, run through the filter's
//! own entry points (`request::prepare`, then `request::route`, with the shared in-flight
//! table and a health view), must give the same decisions as the build that recorded
//! `tests/fixtures/pick-golden.txt`.
//!
//! A case is one configuration (every shipped example, and variants of them), one seeded pool of
//! endpoint metrics, in-flight counts and health, and a sequence of requests (models, adapters,
//! unknown names, prompts that share prefixes, sessions, priority headers, oversized bodies),
//! some of which finish (their ticket is released) before the next arrives. Each request's
//! outcome (destination, fallbacks, rewrite, reason, prefiller, or the rejection's status and
//! code) goes into the case's digest; the golden file holds one digest per case.
//!
//! A refactor that must not change decisions leaves every line equal. A change that means to
//! change decisions rewrites the file (`PICK_GOLDEN_WRITE=1 cargo test --test pick_differential`)
//! and says so in its commit. `PICK_DIFF_DUMP=<case> cargo test --test pick_differential -- --nocapture` prints one case's outcomes.

use std::fmt::Write as _;
use std::path::PathBuf;

use inference_picker::base::ports::{MemStore, Rng, SplitMix64};
use inference_picker::config::Config;
use inference_picker::flow::priority::PriorityHeaders;
use inference_picker::request::{self, RequestHead};
use inference_picker::scheduler::{PickState, Scheduler};
use inference_picker::state::health::HealthView;
use inference_picker::state::inflight::InflightTable;
use inference_picker::state::metrics::{EndpointMetrics, Engine};
use inference_picker::state::snapshot::{EndpointStatus, Snapshot};

const CASES_PER_CONFIG: u64 = 24;
const REQUESTS_PER_CASE: usize = 40;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Variants of a document that turn on what the examples leave off.
fn variants(name: &str, doc: &serde_json::Value) -> Vec<(String, serde_json::Value)> {
    let mut out = vec![(name.to_string(), doc.clone())];
    for (tag, objective) in [("weighted", "weighted"), ("predicted", "predicted_ttft")] {
        let mut d = doc.clone();
        if let Some(obj) = d.as_object_mut() {
            let sched = obj.entry("scheduler").or_insert_with(|| serde_json::json!({}));
            if let Some(s) = sched.as_object_mut() {
                s.insert("objective".into(), objective.into());
                s.insert("fallbacks".into(), 2.into());
            }
        }
        out.push((format!("{name}+{tag}"), d));
    }
    out
}

fn configs() -> Vec<(String, Config)> {
    let mut names: Vec<PathBuf> = std::fs::read_dir(root().join("filter-config/examples"))
        .expect("examples dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    names.sort();
    let mut out = Vec::new();
    for p in names {
        let name = p.file_stem().unwrap().to_string_lossy().to_string();
        let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        for (vname, v) in variants(&name, &doc) {
            let bytes = serde_json::to_vec(&v).unwrap();
            // A variant the configuration refuses is left out, in the recording build and here.
            if let Ok(cfg) = Config::from_json(&bytes) {
                out.push((vname, cfg));
            }
        }
    }
    out
}

fn below(rng: &mut SplitMix64, n: u64) -> u64 {
    if n == 0 {
        0
    } else {
        rng.next_u64() % n
    }
}

fn chance(rng: &mut SplitMix64, percent: u64) -> bool {
    below(rng, 100) < percent
}

/// The endpoints of a case: the configured ones, or (a discovery config) six made up ones that
/// serve every configured model.
fn pool(cfg: &Config, rng: &mut SplitMix64, now_ms: u64) -> Snapshot {
    let mut endpoints: Vec<EndpointStatus> = cfg
        .endpoints
        .iter()
        .map(|e| EndpointStatus {
            address: e.address.clone(),
            models: e.models.clone(),
            role: e.role,
            ..Default::default()
        })
        .collect();
    if endpoints.is_empty() {
        let models: Vec<String> = cfg.models.iter().map(|m| m.name.clone()).collect();
        for i in 0..6 {
            endpoints.push(EndpointStatus {
                address: format!("10.9.0.{}:8000", i + 1),
                models: models.clone(),
                ..Default::default()
            });
        }
    }
    let adapters: Vec<String> = cfg.models.iter().flat_map(|m| m.adapters.clone()).collect();
    for e in &mut endpoints {
        let roll = below(rng, 100);
        e.failures = if roll < 8 { 1 + below(rng, 3) as u32 } else { 0 };
        if roll < 5 {
            // Never scraped.
            continue;
        }
        let engine = [Engine::Vllm, Engine::Sglang, Engine::Trtllm, Engine::Unknown][below(rng, 4) as usize];
        let opt = |rng: &mut SplitMix64, v: f64| if chance(rng, 90) { Some(v) } else { None };
        let q = below(rng, 12) as f64;
        let r = below(rng, 40) as f64;
        let kv = below(rng, 1000) as f64 / 1000.0;
        let mut m = EndpointMetrics {
            engine,
            queue: opt(rng, q),
            running: opt(rng, r),
            kv_usage: opt(rng, kv),
            ..Default::default()
        };
        if chance(rng, 50) {
            m.max_lora = Some(1 + below(rng, 4) as u32);
            for a in &adapters {
                if chance(rng, 40) {
                    m.running_adapters.push(a.clone());
                } else if chance(rng, 15) {
                    m.waiting_adapters.push(a.clone());
                }
            }
        }
        e.metrics = Some(m);
        // Most are fresh; some are a few seconds old (stale under the example's limits).
        e.scraped_ms =
            if chance(rng, 85) { now_ms - below(rng, 300) } else { now_ms - 2_000 - below(rng, 8_000) };
        e.inflight_at_scrape = if chance(rng, 60) { Some(below(rng, 6) as u32) } else { None };
    }
    Snapshot { version: 1, published_ms: now_ms, endpoints }
}

const PREFIXES: [&str; 4] = [
    "You are a helpful assistant. Answer in one short paragraph and cite nothing. ",
    "System: you translate English to French. Keep names as they are. Be literal. ",
    "Context: the following is a long transcript of a support call between a customer and ",
    "",
];

fn prompt(rng: &mut SplitMix64) -> String {
    let p = PREFIXES[below(rng, PREFIXES.len() as u64) as usize];
    let repeat = 1 + below(rng, 12) as usize;
    let mut s = p.repeat(repeat);
    let _ = write!(s, "question {}", below(rng, 20));
    s
}

fn model_names(cfg: &Config) -> Vec<String> {
    let mut names = Vec::new();
    for m in &cfg.models {
        names.push(m.name.clone());
        names.extend(m.adapters.iter().cloned());
    }
    names.push("llama".into());
    names.push("no-such-model".into());
    names
}

fn outcome_of(r: Result<request::pd::PdPick, inference_picker::base::errors::Rejection>) -> (String, u64) {
    match r {
        Ok(p) => {
            let pick = &p.pick;
            (
                format!(
                    "ok {} fb={:?} model={} rw={} reason={} serving={} healthy={} over={} prefix={:.4}/{} pred={:?} fo={} pf={:?} dec={:?} unc={}",
                    pick.primary,
                    pick.fallbacks,
                    pick.target_model,
                    pick.model_rewritten,
                    pick.reason.as_str(),
                    pick.serving,
                    pick.healthy,
                    pick.overloaded,
                    pick.prefix_score,
                    pick.prefix_blocks,
                    pick.predicted_ms.map(|v| (v * 1000.0).round() / 1000.0),
                    pick.fail_open,
                    p.prefiller,
                    p.decision,
                    p.uncached_tokens
                ),
                pick.ticket,
            )
        }
        Err(e) => (format!("err {} {}", e.status, e.code), 0),
    }
}

/// Runs one case; returns its outcome lines.
fn run_case(cfg: &Config, seed: u64) -> Vec<String> {
    let mut rng = SplitMix64::new(seed);
    let mut pick_rng = SplitMix64::new(seed ^ 0x9e37_79b9_7f4a_7c15);
    let mut now_ms: u64 = 1_700_000_000_000;
    let snapshot = pool(cfg, &mut rng, now_ms);
    let store = MemStore::default();
    let mut table = InflightTable::new(1);
    for e in &snapshot.endpoints {
        let n = below(&mut rng, 5) as i32;
        if n > 0 {
            let _ = table.adjust(&store, &e.address, n, now_ms);
        }
    }
    let health = HealthView::default();
    let mut scheduler = Scheduler::new(cfg);
    let names = model_names(cfg);
    let mut open: Vec<(u64, String)> = Vec::new();
    let mut lines = Vec::new();
    for i in 0..REQUESTS_PER_CASE {
        now_ms += below(&mut rng, 50);
        let model = names[below(&mut rng, names.len() as u64) as usize].clone();
        let session = if chance(&mut rng, 30) { Some(format!("s{}", below(&mut rng, 4))) } else { None };
        let objective = if chance(&mut rng, 20) { Some("batch".to_string()) } else { None };
        let tier = if chance(&mut rng, 20) {
            Some(["gold", "silver", "bronze", "x"][below(&mut rng, 4) as usize].to_string())
        } else {
            None
        };
        let get = |h: &str| -> Option<String> {
            if h.contains("objective") {
                objective.clone()
            } else if h.contains("tier") || h.contains("priority") {
                tier.clone()
            } else {
                None
            }
        };
        let head = RequestHead {
            method: "POST".into(),
            path: if chance(&mut rng, 80) { "/v1/chat/completions".into() } else { "/v1/completions".into() },
            content_length: None,
            session_id: session,
            session_token: None,
            priority: PriorityHeaders::read(&cfg.priority, &get),
            test_selection: None,
        };
        let text = prompt(&mut rng);
        let body = if head.path == "/v1/completions" {
            serde_json::json!({"model": model, "prompt": text, "max_tokens": 8})
        } else if chance(&mut rng, 3) {
            serde_json::json!({"model": model})
        } else {
            serde_json::json!({"model": model, "messages": [{"role": "user", "content": text}]})
        };
        let body = serde_json::to_vec(&body).unwrap();
        let inflight = table.read(&store, now_ms).unwrap_or_default();
        let state =
            PickState { snapshot: &snapshot, inflight: &inflight, health: &health, store: &store, now_ms };
        let result = request::prepare(&cfg.request(), &scheduler, &mut pick_rng, &head, &body, &snapshot)
            .and_then(|prepared| {
                request::route(&cfg.request(), &mut scheduler, &mut pick_rng, &head, &prepared, state)
            });
        let (line, ticket) = outcome_of(result);
        if let Some(addr) = line.strip_prefix("ok ").and_then(|l| l.split(' ').next()) {
            let _ = table.adjust(&store, addr, 1, now_ms);
            open.push((ticket, addr.to_string()));
        }
        lines.push(format!("{i}: {line}"));
        // Some open requests see their first byte, some finish.
        if !open.is_empty() && chance(&mut rng, 50) {
            let k = below(&mut rng, open.len() as u64) as usize;
            let (ticket, addr) = open.swap_remove(k);
            if chance(&mut rng, 50) {
                let _ = scheduler.first_byte(ticket, Some(&addr), &store, now_ms + 20 + below(&mut rng, 400));
            }
            scheduler.request_done(ticket);
            let _ = table.adjust(&store, &addr, -1, now_ms);
        }
    }
    lines
}

/// FNV-1a 64 of the lines, each followed by `\n`.
fn fnv(lines: &[String]) -> u64 {
    let mut h = inference_picker::base::hash::Fnv1a::new();
    for l in lines {
        h.write(l.as_bytes());
        h.write(b"\n");
    }
    h.finish()
}

fn summary() -> (String, usize, usize) {
    let mut out = String::new();
    let (mut oks, mut errs) = (0, 0);
    for (name, cfg) in configs() {
        for c in 0..CASES_PER_CONFIG {
            let seed = fnv(std::slice::from_ref(&name)) ^ c;
            let lines = run_case(&cfg, seed);
            oks += lines.iter().filter(|l| l.contains(": ok ")).count();
            errs += lines.iter().filter(|l| l.contains(": err ")).count();
            let key = format!("{name}#{c}");
            if std::env::var("PICK_DIFF_DUMP").is_ok_and(|v| v == key) {
                eprintln!("{}", lines.join("\n"));
            }
            let _ = writeln!(out, "{key} {:016x}", fnv(&lines));
        }
    }
    (out, oks, errs)
}

#[test]
fn decisions_match_the_recorded_build() {
    let golden_path = root().join("tests/fixtures/pick-golden.txt");
    let (now, oks, errs) = summary();
    // The cases exercise both outcomes, enough of each to mean something.
    assert!(oks > 5_000 && errs > 500, "too few decisions of one kind: {oks} picks, {errs} rejections");
    if std::env::var("PICK_GOLDEN_WRITE").is_ok() {
        std::fs::write(&golden_path, &now).unwrap();
        return;
    }
    let golden = std::fs::read_to_string(&golden_path).expect("tests/fixtures/pick-golden.txt");
    let g: Vec<&str> = golden.lines().collect();
    let n: Vec<&str> = now.lines().collect();
    let differ: Vec<String> = g
        .iter()
        .zip(&n)
        .filter(|(a, b)| a != b)
        .map(|(a, _)| a.split(' ').next().unwrap_or("").to_string())
        .collect();
    assert_eq!(g.len(), n.len(), "the set of cases changed (a config example added or refused?)");
    assert!(
        differ.is_empty(),
        "{} of {} cases decide differently: {:?} (PICK_DIFF_DUMP=<case> prints one)",
        differ.len(),
        n.len(),
        &differ[..differ.len().min(20)]
    );
}
