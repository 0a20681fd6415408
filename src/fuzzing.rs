//! Fuzz entry points: one function per fuzz target, each taking the raw input bytes.
//!
//! The cargo-fuzz targets in `fuzz/fuzz_targets/` are one-line calls of these, and
//! `tests/fuzz_regressions.rs` replays the seed corpora and every kept crash input
//! (`fuzz/regressions/<target>/`) through the same functions with stable Rust, so a crash found
//! once stays fixed. Not part of the module's API (hidden from the docs).
//!
//! Each function feeds the input to one parser or shared-data decoder the way the host does
//! (a header value, a body, a stored record), and checks cheap invariants with `assert!`: a
//! failed assertion is reported like any other crash. Invariants checked:
//! - `body`: the model returned is the body's top-level `"model"` string; rewriting it and
//!   parsing again gives the new model and changes nothing else;
//! - `metrics`: every signal is finite and non-negative, KV use within [0, 1];
//! - `config`: a configuration that parses re-serialises to one that parses equal;
//! - `session`: a token that parses is exactly the canonical text of its key; the token minted
//!   for the input (as an address) parses and resolves to that address;
//! - `discovery`: at most `MAX_DISCOVERED_ENDPOINTS` endpoints, sorted, unique, each a valid
//!   endpoint address on a configured port;
//! - `snapshot`, `inflight`: decode(encode(x)) == x; an in-flight +1 on a decoded value reads
//!   back one more;
//! - `flow`: driven through `FlowQueue` on a store holding the input as the group's record; every
//!   held request leaves the queue exactly once (released, rejected, evicted or cancelled);
//! - `lease`: driven through `Lease` on a store holding the input as the lease record; a lease
//!   this root holds reads back, from another root, as held by it until the expiry it got;
//! - `prefix_shard`: `upsert` keeps whole records, at most `max`, and every update is found.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::collections::BTreeMap;

use crate::body::{parse_request, rewrite_model};
use crate::config::{parse_endpoint_address, Config, KubernetesDiscoveryConfig};
use crate::discovery::{parse_pod_list, MAX_DISCOVERED_ENDPOINTS};
use crate::flow::{self, Admission, Capacity, FlowControlConfig, FlowQueue, Ticket};
use crate::inflight::{self, InflightCounts, INFLIGHT_KEY};
use crate::lease::{Lease, LeaseState, LEASE_KEY};
use crate::metrics::parse_metrics_with_stats;
use crate::metrics::prom::Samples;
use crate::ports::{MemStore, SharedStore};
use crate::scheduler::prefix_shared::{self, SharedPrefix, RECORD_BYTES};
use crate::scheduler::session::{parse_session_token, resolve_token, scores, session_token_for};
use crate::scheduler::Candidate;
use crate::snapshot::{Snapshot, SnapshotCache, SNAPSHOT_KEY, SNAPSHOT_VERSION_KEY};

/// A fuzz target's entry: the raw input in, a panic on any defect.
pub type Entry = fn(&[u8]);

/// Every target: (name, entry). The names are the files in `fuzz/fuzz_targets/`.
pub const TARGETS: &[(&str, Entry)] = &[
    ("body", body),
    ("metrics", metrics),
    ("config", config),
    ("session", session),
    ("discovery", discovery),
    ("snapshot", snapshot),
    ("inflight", inflight),
    ("flow", flow),
    ("lease", lease),
    ("prefix_shard", prefix_shard),
];

/// The entry of target `name`, if it exists.
pub fn target(name: &str) -> Option<Entry> {
    TARGETS.iter().find(|(n, _)| *n == name).map(|(_, f)| *f)
}

const PATHS: &[&str] =
    &["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/v1/other"];

/// Request body parser (`body::parse_request`) on every API path, and `rewrite_model`.
pub fn body(data: &[u8]) {
    let top_model = serde_json::from_slice::<serde_json::Value>(data)
        .ok()
        .and_then(|v| v.get("model").and_then(|m| m.as_str().map(str::to_owned)));
    for path in PATHS {
        let Ok(req) = parse_request(path, data) else { continue };
        // serde's derive refuses duplicate fields, so the model is the one top-level value
        // (`Value` keeps the last of duplicates, which cannot differ here).
        if let Some(m) = &top_model {
            assert_eq!(&req.model, m, "model is not the body's top-level \"model\"");
        }
        let rewritten = rewrite_model(data, "fuzz/new-model").expect("rewrite of a parsed body");
        let again = parse_request(path, &rewritten).expect("rewritten body parses");
        assert_eq!(again.model, "fuzz/new-model");
        assert_eq!((again.kind, again.stream), (req.kind, req.stream));
        assert_eq!(again.cache_salt, req.cache_salt);
        assert_eq!(again.prompt, req.prompt);
    }
}

/// Prometheus text parser with engine normalisation (`metrics::parse_metrics_with_stats`).
pub fn metrics(data: &[u8]) {
    // The poller hands the parser UTF-8 text; try the lossy decode too so that the parser sees
    // replacement characters in names and labels.
    let lossy = String::from_utf8_lossy(data);
    for text in [std::str::from_utf8(data).ok(), Some(lossy.as_ref())].into_iter().flatten() {
        let mut samples = Samples::new(text);
        for s in samples.by_ref() {
            let _ = s.labels.iter().count();
        }
        let _ = samples.first_error();
        let (res, _stats) = parse_metrics_with_stats(text);
        if let Ok(m) = res {
            for (name, v) in [("queue", m.queue), ("running", m.running), ("kv", m.kv_usage)] {
                if let Some(v) = v {
                    assert!(v.is_finite() && v >= 0.0, "{name} = {v}");
                }
            }
            if let Some(kv) = m.kv_usage {
                assert!(kv <= 1.0, "kv = {kv}");
            }
        }
    }
}

/// Configuration (`Config::from_json`); a valid one must survive re-serialisation.
pub fn config(data: &[u8]) {
    let Ok(cfg) = Config::from_json(data) else { return };
    let json = serde_json::to_vec(&cfg).expect("a parsed config serialises");
    match Config::from_json(&json) {
        Ok(again) => assert_eq!(again, cfg, "config changed on re-serialisation"),
        Err(e) => panic!("re-serialised config rejected: {e:?}"),
    }
}

/// Session token parser and the session-id scorer (the header value as the host reads it).
pub fn session(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    if let Some(key) = parse_session_token(&text) {
        assert_eq!(format!("v1.{key:016x}"), text.trim(), "a token parsed that is not canonical");
    }
    let cands = [
        Candidate { address: "10.0.0.1:8000", metrics: None, inflight: 0 },
        Candidate { address: &text, metrics: None, inflight: 0 },
    ];
    let eligible = [true, true];
    let _ = resolve_token(&text, &cands, &eligible);
    let s = scores(Some(&text), &cands, &eligible);
    let winners = s.iter().filter(|&&x| x == 1.0).count();
    assert_eq!(winners, usize::from(!text.is_empty()), "one session winner, none without a session");
    // The input as an address: its token must parse and name it.
    let token = session_token_for(&text);
    assert!(parse_session_token(&token).is_some());
    if text != cands[0].address {
        assert_eq!(resolve_token(&token, &cands, &eligible), Some(1));
    }
}

/// Kubernetes pod-list parser (`discovery::parse_pod_list`).
pub fn discovery(data: &[u8]) {
    let cfg = KubernetesDiscoveryConfig {
        namespace: "inference".into(),
        selector: BTreeMap::from([("app".to_string(), "vllm-llama3-8b-instruct".to_string())]),
        target_ports: vec![8000, 8001],
        models: vec![],
        api_cluster: "kubernetes_api".into(),
        api_authority: "kubernetes.default.svc".into(),
        token: None,
        token_env: None,
        refresh_ms: 5000,
        timeout_ms: 2000,
    };
    let Ok(d) = parse_pod_list(data, &cfg) else { return };
    assert!(d.endpoints.len() <= MAX_DISCOVERED_ENDPOINTS);
    assert!(d.endpoints.windows(2).all(|w| w[0].address < w[1].address), "not sorted and unique");
    for e in &d.endpoints {
        let addr = parse_endpoint_address(&e.address)
            .unwrap_or_else(|err| panic!("discovered address {:?} invalid: {err}", e.address));
        assert!(cfg.target_ports.contains(&addr.port()));
    }
}

/// Snapshot record, as a worker reads it from shared data (`SnapshotCache::refresh`).
pub fn snapshot(data: &[u8]) {
    let store = MemStore::new();
    store.set(SNAPSHOT_VERSION_KEY, b"1", 0).unwrap();
    store.set(SNAPSHOT_KEY, data, 0).unwrap();
    let mut cache = SnapshotCache::new();
    let _ = cache.refresh(&store);
    if let Ok(s) = serde_json::from_slice::<Snapshot>(data) {
        let bytes = serde_json::to_vec(&s).expect("snapshot serialises");
        let again: Snapshot = serde_json::from_slice(&bytes).expect("encoded snapshot decodes");
        assert_eq!(again, s, "decode(encode(snapshot)) differs");
        assert_eq!(*cache.current(), s);
    }
}

/// In-flight counts record (`InflightCounts::decode`, and `inflight::adjust` on top of it).
pub fn inflight(data: &[u8]) {
    let counts = InflightCounts::decode(data);
    let again = InflightCounts::decode(&counts.encode());
    assert_eq!(again, counts, "decode(encode(counts)) differs");
    let store = MemStore::new();
    store.set(INFLIGHT_KEY, data, 0).unwrap();
    let addr = counts.iter().map(|(a, _)| a.to_owned()).next().unwrap_or_else(|| "10.0.0.1:8000".into());
    let before = counts.get(&addr);
    let after = inflight::adjust(&store, &addr, 1).expect("adjust on a MemStore");
    assert_eq!(after, before.saturating_add(1));
    assert_eq!(inflight::read(&store).unwrap().get(&addr), after);
    inflight::adjust(&store, &addr, -1).expect("adjust on a MemStore");
    // +1 saturates at u32::MAX, so -1 then lands one below it.
    assert_eq!(inflight::read(&store).unwrap().get(&addr), after - 1);
}

/// Flow-control record of one group, read by `FlowQueue` from shared data.
pub fn flow(data: &[u8]) {
    let cfg = FlowControlConfig { enabled: true, max_queue: 4, ..FlowControlConfig::default() };
    let store = MemStore::new();
    store.set(&flow::shared_key("g"), data, 0).unwrap();
    let mut q = FlowQueue::new(&cfg, "g", 7);
    let full = Capacity { epoch: 1, slots: 0, saturated: true };
    let mut held: Vec<u32> = Vec::new();
    let mut gone: Vec<u32> = Vec::new();
    let mut now = 1_000;
    for (id, priority) in [(1u32, 0i32), (2, 5), (3, 0), (4, -1), (5, i32::MAX), (6, i32::MIN)] {
        let t = Ticket { id, priority, fairness_id: "f" };
        match q.admit(&store, &t, &full, now) {
            Admission::Held { evicted } => {
                held.push(id);
                gone.extend(evicted.map(|(e, _)| e));
            }
            Admission::Pass | Admission::Reject(_) => {}
        }
        now += 10;
    }
    if q.cancel(3, now) {
        gone.push(3);
    }
    let open = Capacity { epoch: 2, slots: 2, saturated: false };
    for action in q.on_tick(&store, &open, now + 1) {
        gone.push(action_id(&action));
    }
    // Another worker's view of the same record.
    let mut other = FlowQueue::new(&cfg, "g", 8);
    let _ = other.admit(&store, &Ticket { id: 1, priority: 1, fairness_id: "f" }, &full, now + 2);
    let _ = other.on_tick(&store, &open, now + 3);
    for action in q.on_tick(&store, &open, now + cfg.max_wait_ms + 10) {
        gone.push(action_id(&action));
    }
    for action in q.release_all(&store, now + cfg.max_wait_ms + 20) {
        gone.push(action_id(&action));
    }
    assert!(q.is_empty());
    held.sort_unstable();
    gone.sort_unstable();
    assert_eq!(held, gone, "every held request leaves exactly once");
}

fn action_id(a: &flow::Action) -> u32 {
    match a {
        flow::Action::Release { id, .. } | flow::Action::Reject { id, .. } => *id,
    }
}

/// Poller lease record, read by `Lease::try_acquire_or_renew` at clock values from 0 to u64::MAX.
pub fn lease(data: &[u8]) {
    const TTL: u64 = 3_000;
    let store = MemStore::new();
    store.set(LEASE_KEY, data, 0).unwrap();
    let mut a = Lease::new(0xa, TTL);
    for now in [0, 10, 2_000, 6_000, 1 << 40, u64::MAX - 1, u64::MAX] {
        if let LeaseState::Held { expires_ms } = a.try_acquire_or_renew(&store, now) {
            // A root that never looked before sees exactly what was written: decode(encode(x)).
            let mut b = Lease::new(0xb, TTL);
            let seen = b.try_acquire_or_renew(&store, now);
            assert_eq!(seen, LeaseState::NotHeld { holder: 0xa, expires_ms }, "at {now}");
        }
    }
    let _ = a.release(&store);
}

/// Prefix-table shard value (`prefix_shared::find`/`upsert`, and a lookup and record on it).
pub fn prefix_shard(data: &[u8]) {
    let whole = data.len().is_multiple_of(RECORD_BYTES);
    let stored: Vec<u64> = if whole {
        data.chunks_exact(RECORD_BYTES).map(|r| u64::from_le_bytes(r[..8].try_into().unwrap())).collect()
    } else {
        Vec::new()
    };
    let mut updates: Vec<(u64, u32)> = vec![(0, 1), (u64::MAX, 2)];
    updates.extend(stored.iter().take(3).map(|&h| (h, 3)));
    updates.sort_unstable();
    updates.dedup_by_key(|u| u.0);
    for max in [1, 2, 4, 64] {
        let out = prefix_shared::upsert(data, &updates, max);
        assert_eq!(out.len() % RECORD_BYTES, 0);
        assert!(out.len() / RECORD_BYTES <= max);
        if max >= updates.len() {
            for &(h, e) in &updates {
                assert_eq!(prefix_shared::find(&out, h), Some(e), "update {h:#x} lost (max {max})");
            }
        }
    }
    // The same value as a stored shard: a lookup over hashes that include what it holds, then
    // the write that follows a pick.
    let table = SharedPrefix::new(1, 8); // one shard of 8 records
    let store = MemStore::new();
    store.set(&table.keys()[0], data, 0).unwrap();
    let mut hashes: Vec<u64> = (0..16u64).collect();
    for (i, h) in stored.iter().take(3).enumerate() {
        hashes[(4 << i) - 1] = *h;
    }
    let mut lookup = table.lookup(&store, &hashes);
    table.record(&store, &hashes, 9, &mut lookup);
    // Reads do not refresh a record, so the write may push out an older checkpoint that was
    // already ours; with room for every checkpoint (3) nothing is pushed out.
    if whole && stored.len() + 3 <= 8 {
        let after = table.lookup(&store, &hashes);
        assert_eq!(after.matched(9), 16, "a recorded chain is found in full");
    }
}
