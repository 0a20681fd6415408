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
//! - `session`: a token that parses is exactly the canonical text of its tag; the token minted
//!   for the input (as an address) under the current or the previous key resolves to it;
//! - `discovery`: at most `MAX_DISCOVERED_ENDPOINTS` endpoints, sorted, unique, each a valid
//!   endpoint address on a configured port;
//! - `snapshot`, `inflight`, `health`: decode(encode(x)) == x; an in-flight +1 next to a decoded
//!   slot record reads back exactly one more, and another VM sees it; recording failures on a
//!   decoded health record never ejects a whole pool;
//! - `flow`: driven through `FlowQueue` on a store holding the input as the group's record; every
//!   held request leaves the queue exactly once (released, rejected, evicted or cancelled);
//! - `lease`: driven through `Lease` on a store holding the input as the lease record; a lease
//!   this root holds reads back, from another root, as held by it until the expiry it got;
//! - `prefix_shard`: `upsert` keeps whole records, at most `max`, and every update is found.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::collections::BTreeMap;

use crate::base::ports::{MemStore, SharedStore};
use crate::config::{Config, KubernetesDiscoveryConfig};
use crate::flow::{self, Admission, Capacity, FlowControlConfig, FlowQueue, Ticket};
use crate::poll::discovery::{parse_pod_list, MAX_DISCOVERED_ENDPOINTS};
use crate::poll::lease::{Lease, LeaseState, LEASE_KEY};
use crate::poll::scrape::parse_metrics_with_stats;
use crate::poll::scrape::prom::Samples;
use crate::request::body::{parse_request, rewrite_model};
use crate::scheduler::session::{parse_session_token, scores, SessionKeys};
use crate::scheduler::Candidate;
use crate::state::catalog::parse_endpoint_address;
use crate::state::health::{self, HealthConfig, HealthView, Outcome, Recorder, HEALTH_KEY};
use crate::state::inflight::{self, InflightTable};
use crate::state::prefix_shared::{self, SharedPrefix, RECORD_BYTES};
use crate::state::snapshot::{Snapshot, SnapshotCache, SNAPSHOT_KEY, SNAPSHOT_VERSION_KEY};

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
    ("health", health),
    ("flow", flow),
    ("lease", lease),
    ("prefix_shard", prefix_shard),
    ("peer_batch", peer_batch),
];

/// The entry of target `name`, if it exists.
pub fn target(name: &str) -> Option<Entry> {
    TARGETS.iter().find(|(n, _)| *n == name).map(|(_, f)| *f)
}

const PATHS: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/other",
];

/// Request body parser (`body::parse_request`) on every API path (Anthropic's Messages API and
/// its token count included), and `rewrite_model`.
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

/// Session token parser, the keyed token under rotation, and the session-id scorer (the header
/// value as the host reads it).
pub fn session(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    if let Some(tag) = parse_session_token(&text) {
        assert_eq!(format!("v2.{tag:016x}"), text.trim(), "a token parsed that is not canonical");
    }
    let old = SessionKeys::from_secrets(Some("the previous deployment secret"), None).expect("valid secret");
    let keys = SessionKeys::from_secrets(
        Some("the current deployment secret!"),
        Some("the previous deployment secret"),
    )
    .expect("valid secrets");
    let cands = [
        Candidate { address: "10.0.0.1:8000", metrics: None, inflight: 0, queue: None },
        Candidate { address: &text, metrics: None, inflight: 0, queue: None },
    ];
    let eligible = [true, true];
    let _ = keys.resolve(&text, &cands, &eligible);
    let s = scores(Some(&text), &cands, &eligible);
    let winners = s.iter().filter(|&&x| x == 1.0).count();
    assert_eq!(winners, usize::from(!text.is_empty()), "one session winner, none without a session");
    // The input as an address: its token (current key, or the previous one during a rotation)
    // must parse and name it; a token of another key must not.
    if text != cands[0].address {
        let token = keys.token_for(&text);
        assert!(parse_session_token(&token).is_some());
        assert_eq!(keys.resolve(&token, &cands, &eligible), Some(1));
        assert_eq!(keys.resolve(&old.token_for(&text), &cands, &eligible), Some(1));
        let other = SessionKeys::from_secrets(Some("some other deployment's key"), None).expect("valid");
        assert_ne!(other.resolve(&other.token_for(&text), &cands[..1], &eligible[..1]), Some(1));
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
        roles: crate::poll::config::RoleSelectors::default(),
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
    store.set(SNAPSHOT_VERSION_KEY, &crate::state::snapshot::encode_version(1), 0).unwrap();
    store.set(SNAPSHOT_KEY, data, 0).unwrap();
    let mut cache = SnapshotCache::new();
    let _ = cache.refresh(&store);
    // Whatever decodes re-encodes to the same bytes (in this build's version), and the cache
    // holds it.
    if let Some(s) = crate::state::snapshot::decode(data) {
        let bytes = crate::state::snapshot::encode(&s);
        let again = crate::state::snapshot::decode(&bytes).expect("encoded snapshot decodes");
        assert_eq!(crate::state::snapshot::encode(&again), bytes, "decode(encode(snapshot)) differs");
        let cached = crate::state::snapshot::encode(&cache.current());
        assert_eq!(cached, bytes, "the cache holds another snapshot than the stored one");
    }
}

/// In-flight slot record (`inflight::decode`), its counts, and an `InflightTable` reading and
/// writing a store whose first slot holds the input.
pub fn inflight(data: &[u8]) {
    if let Some(rec) = inflight::decode(data) {
        let again = inflight::decode(&inflight::encode(&rec)).expect("an encoded record decodes");
        assert_eq!(again, rec, "decode(encode(record)) differs");
    }
    let store = MemStore::new();
    store.set(&inflight::slot_key(0), data, 0).unwrap();
    let now = 1_000_000;
    let mut table = InflightTable::new(0x005e_ed0f_f00d);
    let addr = "10.0.0.1:8000";
    let before = table.read(&store, now).expect("read on a MemStore").get(addr);
    table.adjust(&store, addr, 1, now).expect("adjust on a MemStore");
    let after = table.read(&store, now).expect("read on a MemStore").get(addr);
    assert_eq!(after, before.saturating_add(1), "our +1 is counted once");
    table.tick(&store, now + 1).expect("tick on a MemStore");
    // Another VM sees our count (unless the input's record already saturates it).
    let mut other = InflightTable::new(0xdead_beef);
    assert!(other.read(&store, now + 1).expect("read").get(addr) >= 1);
    table.adjust(&store, addr, -1, now).expect("adjust on a MemStore");
    table.release(&store).expect("release on a MemStore");
}

/// Passive-health record (`HealthView::decode`), and a worker recording results on top of it.
pub fn health(data: &[u8]) {
    let view = HealthView::decode(data);
    assert_eq!(HealthView::decode(&view.encode()), view, "decode(encode(view)) differs");
    let store = MemStore::new();
    store.set(HEALTH_KEY, data, 0).unwrap();
    let cfg = HealthConfig::default();
    let mut rec = Recorder::new();
    let now = 1_000_000;
    let addr = "10.0.0.1:8000";
    for outcome in [Outcome::Failure { gateway: true }, Outcome::Failure { gateway: false }, Outcome::Load] {
        rec.record(&store, &cfg, addr, outcome, now).expect("record on a MemStore");
    }
    let seen = rec.read(&store, now).expect("read on a MemStore");
    // Whatever the stored value said, the max-ejection limit never empties a pool.
    let snapshot = Snapshot {
        version: 1,
        published_ms: now,
        endpoints: ["10.0.0.1:8000", "10.0.0.2:8000"]
            .iter()
            .map(|a| crate::state::snapshot::EndpointStatus {
                address: (*a).into(),
                models: vec!["m".into()],
                metrics: Some(crate::state::metrics::EndpointMetrics::default()),
                scraped_ms: now,
                failures: 0,
                inflight_at_scrape: None,
                role: crate::state::catalog::Role::Decode,
                poll_ms: 0,
            })
            .collect(),
    };
    if let Some(left) = health::without_ejected(&snapshot, &seen, now, &cfg) {
        assert!(!left.endpoints.is_empty(), "passive health emptied the pool");
    }
}

/// Flow-control record of one group, read by `FlowQueue` from shared data.
pub fn flow(data: &[u8]) {
    let cfg = FlowControlConfig { enabled: true, max_queue: 4, ..FlowControlConfig::default() };
    let store = MemStore::new();
    store.set(&flow::shared_key("g"), data, 0).unwrap();
    let mut q = FlowQueue::new(&cfg, "g", 7);
    let full = Capacity { epoch: 1, slots: 0, saturated: true, reserve: None };
    let mut held: Vec<u32> = Vec::new();
    let mut gone: Vec<u32> = Vec::new();
    let mut now = 1_000;
    for (id, priority) in [(1u32, 0i32), (2, 5), (3, 0), (4, -1), (5, i32::MAX), (6, i32::MIN)] {
        // Every other request has a deadline, out of arrival order.
        let t = Ticket {
            id,
            priority,
            fairness_id: "f",
            deadline_ms: (id % 2 == 0).then_some(now + 100 - u64::from(id)),
        };
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
    let open = Capacity { epoch: 2, slots: 2, saturated: false, reserve: None };
    for action in q.on_tick(&store, &open, now + 1) {
        gone.push(action_id(&action));
    }
    // Another worker's view of the same record.
    let mut other = FlowQueue::new(&cfg, "g", 8);
    let _ = other.admit(
        &store,
        &Ticket { id: 1, priority: 1, fairness_id: "f", deadline_ms: None },
        &full,
        now + 2,
    );
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
    let whole = matches!(prefix_shared::shard(data), prefix_shared::Shard::Records(_));
    let stored: Vec<u64> = prefix_shared::decode(data).iter().map(|r| r.0).collect();
    let mut updates: Vec<prefix_shared::Record> = vec![(0, 1, [0; 3]), (u64::MAX, 2, [1, 2, 3])];
    updates.extend(stored.iter().take(3).map(|&h| (h, 3, [7, 0, 0])));
    updates.sort_unstable();
    updates.dedup_by_key(|u| u.0);
    for max in [1, 2, 4, 64] {
        let out = prefix_shared::upsert(data, &updates, max);
        assert_eq!((out.len() - 2) % RECORD_BYTES, 0);
        assert!((out.len() - 2) / RECORD_BYTES <= max);
        if max >= updates.len() {
            for &(h, e, t) in &updates {
                assert_eq!(prefix_shared::find(&out, h), Some(e), "update {h:#x} lost (max {max})");
                assert_eq!(prefix_shared::find_record(&out, h), Some((e, t)), "tags of {h:#x} lost");
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

/// A peer's batch of prefix records (`peers::decode`, `peers::receive`): refused whole or
/// applied whole, and the table stays well-formed and bounded.
pub fn peer_batch(data: &[u8]) {
    let table = SharedPrefix::new(4, 8);
    let store = MemStore::new();
    match crate::poll::peers::decode(data) {
        Ok(records) => {
            assert!(records.len() <= crate::poll::peers::MAX_RECORDS);
            assert_eq!(crate::poll::peers::encode(&records), data, "decode then encode gives the body back");
            assert_eq!(crate::poll::peers::receive(&store, &table, data), Ok(records.len()));
            let shards = table.read_all(&store);
            for v in &shards {
                assert!(v.is_empty() || (v.len() - 2) % RECORD_BYTES == 0);
                assert!(prefix_shared::decode(v).len() <= 8);
            }
            // The last record of each hash is what the table names, unless the shard overflowed.
            for &(h, e, _) in records.iter().rev().take(1) {
                let shard = &shards[(h % 4) as usize];
                let in_shard = records
                    .iter()
                    .filter(|r| r.0 % 4 == h % 4)
                    .map(|r| r.0)
                    .collect::<hashbrown::HashSet<_>>();
                if in_shard.len() <= 8 {
                    assert_eq!(prefix_shared::find(shard, h), Some(e));
                }
            }
        }
        Err(_) => {
            assert!(crate::poll::peers::receive(&store, &table, data).is_err());
            assert!(table.read_all(&store).iter().all(Vec::is_empty), "a refused batch applied something");
        }
    }
    // The same bytes as a load report of an older build (the load exchange was removed): only
    // recognised (the filter answers 204), never read as a batch of either kind.
    if crate::poll::peers::is_retired_load_report(data) {
        assert!(crate::poll::peers::decode(data).is_err());
        assert!(crate::poll::peers::decode_placements(data).is_err());
    }
}
