//! The versioned snapshot the poller publishes and the filter reads.
//!
//! Shared-data layout (bounded: two keys, whatever the pool size):
//! - [`SNAPSHOT_KEY`]: the [`Snapshot`] in the compact binary form of [`encode`] (a record of
//!   `crate::base::codec`, tag `Snapshot`; a snapshot of a version this build does not read, from
//!   a poller of another build, is skipped: the reader keeps its last snapshot);
//! - [`SNAPSHOT_VERSION_KEY`]: the snapshot's version number ([`encode_version`], tag
//!   `SnapshotVersion`), so that a worker can see cheaply (a few bytes copied) whether its
//!   cached, decoded snapshot is still current.

use serde::{Deserialize, Serialize};

use crate::state::metrics::{EndpointMetrics, Engine};

pub const SNAPSHOT_KEY: &str = "inference-picker/snapshot";
pub const SNAPSHOT_VERSION_KEY: &str = "inference-picker/snapshot-version";

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Snapshot {
    /// Increases by one on every publish.
    pub version: u64,
    /// When the poller published it (ms since the epoch).
    pub published_ms: u64,
    pub endpoints: Vec<EndpointStatus>,
}

impl Snapshot {
    /// Endpoints whose last scrape succeeded (metrics read, no failure since): what the poller
    /// reports as `inference_picker_ready_endpoints` when it publishes (readers judge age on
    /// their own, [`EndpointStatus::is_fresh`]).
    pub fn ready_endpoints(&self) -> usize {
        self.endpoints.iter().filter(|e| e.failures == 0 && e.metrics.is_some() && e.scraped_ms > 0).count()
    }
}

/// One endpoint as the poller last saw it.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointStatus {
    /// `ip:port`, exactly as sent in `x-gateway-destination-endpoint`.
    pub address: String,
    /// Base models this endpoint serves (from config or discovery).
    pub models: Vec<String>,
    /// Metrics from the last successful scrape, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<EndpointMetrics>,
    /// When the last successful scrape finished (ms since the epoch); 0 = never.
    pub scraped_ms: u64,
    /// Consecutive failed scrapes since the last success.
    pub failures: u32,
    /// This gateway's in-flight requests to the endpoint (all workers, `crate::state::inflight`) when
    /// the last successful scrape's response arrived; `None` when unknown. The base of the live
    /// load estimate (`crate::state::load`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inflight_at_scrape: Option<u32>,
    /// Its prefill/decode role (`crate::request::pd`), from the configuration or discovery.
    #[serde(default, skip_serializing_if = "crate::state::catalog::Role::is_decode")]
    pub role: crate::state::catalog::Role,
    /// The interval at which the poller scrapes this endpoint now (ms; `crate::poll::poller`): longer
    /// for an idle, unchanged endpoint. 0 = not said (an older poller). It extends the staleness
    /// limit, see [`EndpointStatus::stale_limit_ms`].
    #[serde(default, skip_serializing_if = "is_zero")]
    pub poll_ms: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

use crate::base::ports::{SharedStore, StoreError};

/// Writes a snapshot: the body first, then the version key that readers poll.
pub fn publish(store: &dyn SharedStore, snapshot: &Snapshot) -> Result<(), StoreError> {
    store.set(SNAPSHOT_KEY, &encode(snapshot), 0)?;
    store.set(SNAPSHOT_VERSION_KEY, &encode_version(snapshot.version), 0)
}

/// A worker's decoded copy of the latest snapshot. Refreshing costs one small read when nothing
/// changed, and one full read and decode per new version.
#[derive(Debug, Default)]
pub struct SnapshotCache {
    current: std::rc::Rc<Snapshot>,
    /// Version seen in the version key; 0 = nothing read yet.
    seen_version: u64,
}

impl SnapshotCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// The last decoded snapshot (empty until the poller has published once).
    pub fn current(&self) -> std::rc::Rc<Snapshot> {
        self.current.clone()
    }

    /// Re-reads the snapshot if the poller published a new version. A garbled value, or one of
    /// a version this build does not read, keeps the previous snapshot, whose endpoints then age
    /// into staleness on their own.
    pub fn refresh(&mut self, store: &dyn SharedStore) -> Result<std::rc::Rc<Snapshot>, StoreError> {
        let version = match store.get(SNAPSHOT_VERSION_KEY)? {
            Some((v, _)) => decode_version(&v).unwrap_or(0),
            None => 0,
        };
        if version != 0 && version != self.seen_version {
            if let Some((body, _)) = store.get(SNAPSHOT_KEY)? {
                if let Some(s) = decode(&body) {
                    self.current = std::rc::Rc::new(s);
                    self.seen_version = version;
                }
            }
        }
        Ok(self.current.clone())
    }
}

// ---------------------------------------------------------------------------------------------
// The binary form (`crate::base::codec`, tag `Snapshot`).
//
// Every worker decodes each new snapshot version (every `poller.interval_ms`, 200 ms by default)
// and the poller encodes it; this form is read field by field with bounds checks:
//
//   tag 0x01 · version · u64 version · u64 published_ms · u32 endpoint count · endpoints
//   endpoint: str address · u8 role (0 decode, 1 prefill, 2 both) · u32 n · n × str model
//             · u64 scraped_ms · u32 failures · u64 poll_ms · opt u32 inflight_at_scrape · opt metrics
//   metrics:  u8 engine · opt f64 queue · opt f64 running · opt f64 kv_usage · opt u32 block_size
//             · opt u64 num_gpu_blocks · opt u32 max_lora · strs running · strs waiting
//   str = u32 length · UTF-8 bytes; opt x = u8 0 | u8 1 · x; integers little-endian; f64 as bits.
//
// Adding a field to `EndpointStatus` or `EndpointMetrics`: the destructuring in `put_endpoint`
// and `put_metrics` stops compiling until the field is encoded here too (and decoded). Any change
// of the layout takes the tag's next version (`crate::base::codec`), so a filter VM and a poller
// of different builds (shared data outlives a configuration reload) never read each other's
// values as their own: the reader keeps its last snapshot until one it knows arrives.

use crate::base::codec::{self, Reader, Tag, Writer, MAX_NAME_BYTES};

/// The snapshot in its shared-data form (see the codec comment above).
pub fn encode(snapshot: &Snapshot) -> Vec<u8> {
    let mut w = Writer::new(Tag::Snapshot, 32 + snapshot.endpoints.len() * 96);
    w.u64(snapshot.version).u64(snapshot.published_ms).len(snapshot.endpoints.len());
    for e in &snapshot.endpoints {
        put_endpoint(&mut w, e);
    }
    w.finish()
}

/// Reads a stored snapshot. `None` for anything malformed or truncated, or written by a build
/// whose snapshot version this one does not read (counted as skipped). Never panics, allocates
/// at most in proportion to the input.
pub fn decode(bytes: &[u8]) -> Option<Snapshot> {
    let mut r = codec::open(bytes, Tag::Snapshot).ok()?;
    let version = r.u64()?;
    let published_ms = r.u64()?;
    // An endpoint takes at least 27 bytes: a count beyond that is garbage.
    let n = r.count(27, usize::MAX)?;
    let mut endpoints = Vec::with_capacity(n);
    for _ in 0..n {
        endpoints.push(endpoint(&mut r)?);
    }
    r.finish()?;
    Some(Snapshot { version, published_ms, endpoints })
}

/// The snapshot version number as the version key holds it.
pub fn encode_version(version: u64) -> Vec<u8> {
    codec::encode_u64(Tag::SnapshotVersion, version)
}

/// The version key's number; `None` when absent, malformed or of an unknown version (no news).
pub fn decode_version(bytes: &[u8]) -> Option<u64> {
    codec::decode_u64(bytes, Tag::SnapshotVersion).ok()
}

fn put_strs(w: &mut Writer, v: &[String]) {
    w.len(v.len());
    for s in v {
        w.str(s);
    }
}

fn put_endpoint(w: &mut Writer, e: &EndpointStatus) {
    let EndpointStatus { address, models, metrics, scraped_ms, failures, inflight_at_scrape, role, poll_ms } =
        e;
    w.str(address);
    w.u8(match role {
        crate::state::catalog::Role::Decode => 0,
        crate::state::catalog::Role::Prefill => 1,
        crate::state::catalog::Role::Both => 2,
    });
    put_strs(w, models);
    w.u64(*scraped_ms).u32(*failures).u64(*poll_ms);
    w.opt(*inflight_at_scrape, |w, x| {
        w.u32(x);
    });
    w.opt(metrics.as_ref(), put_metrics);
}

fn put_metrics(w: &mut Writer, m: &EndpointMetrics) {
    let EndpointMetrics {
        engine,
        queue,
        running,
        kv_usage,
        block_size,
        num_gpu_blocks,
        max_lora,
        running_adapters,
        waiting_adapters,
    } = m;
    w.u8(match engine {
        Engine::Unknown => 0,
        Engine::Vllm => 1,
        Engine::Sglang => 2,
        Engine::Trtllm => 3,
    });
    for f in [queue, running, kv_usage] {
        w.opt(*f, |w, x| {
            w.f64(x);
        });
    }
    w.opt(*block_size, |w, x| {
        w.u32(x);
    });
    w.opt(*num_gpu_blocks, |w, x| {
        w.u64(x);
    });
    w.opt(*max_lora, |w, x| {
        w.u32(x);
    });
    put_strs(w, running_adapters);
    put_strs(w, waiting_adapters);
}

fn strings(r: &mut Reader<'_>) -> Option<Vec<String>> {
    let n = r.count(4, usize::MAX)?;
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(r.string(MAX_NAME_BYTES)?);
    }
    Some(v)
}

fn endpoint(r: &mut Reader<'_>) -> Option<EndpointStatus> {
    let address = r.string(MAX_NAME_BYTES)?;
    let role = match r.u8()? {
        0 => crate::state::catalog::Role::Decode,
        1 => crate::state::catalog::Role::Prefill,
        2 => crate::state::catalog::Role::Both,
        _ => return None,
    };
    let models = strings(r)?;
    let scraped_ms = r.u64()?;
    let failures = r.u32()?;
    let poll_ms = r.u64()?;
    let inflight_at_scrape = r.opt(Reader::u32)?;
    let metrics = r.opt(metrics)?;
    Some(EndpointStatus { address, models, metrics, scraped_ms, failures, inflight_at_scrape, role, poll_ms })
}

fn metrics(r: &mut Reader<'_>) -> Option<EndpointMetrics> {
    let engine = match r.u8()? {
        0 => Engine::Unknown,
        1 => Engine::Vllm,
        2 => Engine::Sglang,
        3 => Engine::Trtllm,
        _ => return None,
    };
    let queue = r.opt(Reader::f64)?;
    let running = r.opt(Reader::f64)?;
    let kv_usage = r.opt(Reader::f64)?;
    let block_size = r.opt(Reader::u32)?;
    let num_gpu_blocks = r.opt(Reader::u64)?;
    let max_lora = r.opt(Reader::u32)?;
    let running_adapters = strings(r)?;
    let waiting_adapters = strings(r)?;
    Some(EndpointMetrics {
        engine,
        queue,
        running,
        kv_usage,
        block_size,
        num_gpu_blocks,
        max_lora,
        running_adapters,
        waiting_adapters,
    })
}

impl EndpointStatus {
    /// How old this endpoint's last successful scrape may be before it is stale:
    /// `max(stale_after_ms, poll_ms + stale_after_ms / 2)`. An endpoint polled every
    /// `interval_ms` keeps the configured limit; one the poller scrapes slowly because it is idle
    /// and unchanged is stale only once its next scheduled scrape is overdue by half the limit.
    /// Every reader of `scraped_ms` (scheduler filter, saturation, live estimate) uses this.
    pub fn stale_limit_ms(&self, stale_after_ms: u64) -> u64 {
        stale_after_ms.max(self.poll_ms.saturating_add(stale_after_ms / 2))
    }

    /// Fresh = the last scrape succeeded and is no older than its staleness limit
    /// ([`EndpointStatus::stale_limit_ms`]).
    pub fn is_fresh(&self, now_ms: u64, stale_after_ms: u64) -> bool {
        self.failures == 0
            && self.metrics.is_some()
            && self.scraped_ms > 0
            && now_ms.saturating_sub(self.scraped_ms) <= self.stale_limit_ms(stale_after_ms)
    }
}

/// Is `name` an adapter that some pod's LoRA metrics list as running or waiting? (Such a name
/// gets the LoRA affinity scorer.)
pub fn is_running_adapter(snapshot: &Snapshot, name: &str) -> bool {
    snapshot
        .endpoints
        .iter()
        .filter_map(|e| e.metrics.as_ref())
        .any(|m| m.running_adapters.iter().chain(&m.waiting_adapters).any(|a| a == name))
}

/// Every model name some endpoint of the snapshot serves and the allow-list lets through,
/// sorted, without the names in `except` (the configured ones, listed first by the caller).
pub fn learned_names(
    snapshot: &Snapshot,
    allow: Option<&hashbrown::HashSet<String>>,
    except: &hashbrown::HashSet<&str>,
) -> Vec<String> {
    let mut out: Vec<String> = snapshot
        .endpoints
        .iter()
        .flat_map(|e| e.models.iter())
        .filter(|n| !except.contains(n.as_str()) && allow.is_none_or(|a| a.contains(n.as_str())))
        .cloned()
        .collect();
    crate::base::sorting::sort(&mut out);
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::ports::MemStore;

    fn snap(version: u64) -> Snapshot {
        Snapshot {
            version,
            published_ms: 1000,
            endpoints: vec![EndpointStatus {
                address: "10.0.0.1:8000".into(),
                models: vec!["m".into()],
                metrics: Some(EndpointMetrics { queue: Some(2.0), ..Default::default() }),
                scraped_ms: 990,
                failures: 0,
                inflight_at_scrape: None,
                role: Default::default(),
                poll_ms: 0,
            }],
        }
    }

    #[test]
    fn ready_endpoints_counts_only_successful_last_scrapes() {
        let mut s = snap(1);
        assert_eq!(s.ready_endpoints(), 1);
        let ok = s.endpoints[0].clone();
        // Never scraped; scraped then failed once; a second good one.
        s.endpoints.push(EndpointStatus { metrics: None, scraped_ms: 0, ..ok.clone() });
        s.endpoints.push(EndpointStatus { failures: 1, ..ok.clone() });
        s.endpoints.push(EndpointStatus { address: "10.0.0.2:8000".into(), ..ok });
        assert_eq!(s.ready_endpoints(), 2);
    }

    #[test]
    fn cache_follows_versions_and_survives_garbage() {
        let store = MemStore::new();
        let mut cache = SnapshotCache::new();
        assert!(cache.refresh(&store).unwrap().endpoints.is_empty());
        publish(&store, &snap(1)).unwrap();
        assert_eq!(cache.refresh(&store).unwrap().version, 1);
        publish(&store, &snap(2)).unwrap();
        assert_eq!(cache.refresh(&store).unwrap().version, 2);
        // A garbled body keeps the last good snapshot.
        store.set(SNAPSHOT_KEY, b"{not json", 0).unwrap();
        store.set(SNAPSHOT_VERSION_KEY, &encode_version(3), 0).unwrap();
        assert_eq!(cache.refresh(&store).unwrap().version, 2);
        assert_eq!(store.key_count(), 2);
    }

    /// Mixed builds: a snapshot of the next release is skipped by this one (the last snapshot
    /// stays) until one it reads arrives; the next release reads this one's.
    #[test]
    fn a_snapshot_of_another_release_is_skipped_until_a_readable_one_comes() {
        let store = MemStore::new();
        let mut cache = SnapshotCache::new();
        publish(&store, &snap(1)).unwrap();
        assert_eq!(cache.refresh(&store).unwrap().version, 1);
        store.set(SNAPSHOT_KEY, &codec::as_next(&encode(&snap(2)), Tag::Snapshot), 0).unwrap();
        store.set(SNAPSHOT_VERSION_KEY, &encode_version(2), 0).unwrap();
        let expect = if cfg!(feature = "codec-next") { 2 } else { 1 };
        assert_eq!(cache.refresh(&store).unwrap().version, expect);
        // A version key of the next release is no news to this one.
        store
            .set(SNAPSHOT_VERSION_KEY, &codec::as_next(&encode_version(3), Tag::SnapshotVersion), 0)
            .unwrap();
        assert_eq!(
            decode_version(&store.get(SNAPSHOT_VERSION_KEY).unwrap().unwrap().0).is_some(),
            cfg!(feature = "codec-next")
        );
        publish(&store, &snap(4)).unwrap();
        assert_eq!(cache.refresh(&store).unwrap().version, 4);
        // What this build writes, both read.
        assert_eq!(decode(&codec::as_version(&encode(&full()), Tag::Snapshot.current())), Some(full()));
    }

    /// Every field set, adapters and an absent metrics block included.
    fn full() -> Snapshot {
        let mut s = snap(7);
        s.endpoints[0].metrics = Some(EndpointMetrics {
            engine: Engine::Sglang,
            queue: Some(2.5),
            running: Some(0.0),
            kv_usage: Some(0.44),
            block_size: Some(16),
            num_gpu_blocks: Some(1 << 40),
            max_lora: Some(4),
            running_adapters: vec!["a1".into(), "é2".into()],
            waiting_adapters: vec!["w".into()],
        });
        s.endpoints[0].inflight_at_scrape = Some(3);
        s.endpoints.push(EndpointStatus {
            address: "[fd00::1]:8000".into(),
            models: vec![],
            metrics: None,
            scraped_ms: 0,
            failures: 4,
            inflight_at_scrape: None,
            role: crate::state::catalog::Role::Prefill,
            poll_ms: 5000,
        });
        s
    }

    #[test]
    fn the_binary_form_round_trips_exactly() {
        for s in [Snapshot::default(), snap(1), full()] {
            let bytes = encode(&s);
            assert_eq!(decode(&bytes), Some(s.clone()));
        }
        // Floats by their bits: a NaN or -0.0 comes back as it went in.
        let mut odd = full();
        if let Some(m) = odd.endpoints[0].metrics.as_mut() {
            m.queue = Some(f64::NAN);
            m.running = Some(-0.0);
        }
        let again = decode(&encode(&odd)).unwrap();
        assert_eq!(encode(&again), encode(&odd));
    }

    #[test]
    fn the_json_form_of_older_builds_is_refused() {
        let s = full();
        let json = serde_json::to_vec(&s).unwrap();
        assert_eq!(decode(&json), None);
    }

    #[test]
    fn malformed_values_are_rejected_without_panicking() {
        let bytes = encode(&full());
        // Every truncation, and one byte more.
        for cut in 0..bytes.len() {
            assert_eq!(decode(&bytes[..cut]), None, "cut at {cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(decode(&longer), None);
        // Every single-byte corruption either fails or decodes to something that re-encodes.
        for i in 0..bytes.len() {
            for v in [0u8, 2, 0x7f, 0xff] {
                let mut b = bytes.clone();
                b[i] = v;
                if let Some(s) = decode(&b) {
                    assert_eq!(decode(&encode(&s)).map(|x| encode(&x)), Some(encode(&s)));
                }
            }
        }
        // A huge count is refused before allocating.
        let mut huge = vec![Tag::Snapshot as u8, Tag::Snapshot.write_version()];
        huge.extend_from_slice(&[0; 16]);
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode(&huge), None);
        assert_eq!(decode(b"garbage"), None);
    }

    #[test]
    fn the_binary_fuzz_seed_is_a_valid_snapshot() {
        // fuzz/corpus/snapshot/binary_two_endpoints was written by hand from the codec comment:
        // the format and its description agree.
        let s = decode(include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/fuzz/corpus/snapshot/binary_two_endpoints"
        )))
        .unwrap();
        assert_eq!((s.version, s.published_ms, s.endpoints.len()), (3, 1000, 2));
        let m = s.endpoints[0].metrics.as_ref().unwrap();
        assert_eq!((m.engine, m.queue, m.running, m.kv_usage), (Engine::Vllm, Some(2.0), None, Some(0.44)));
        assert_eq!(m.running_adapters, ["lora-a"]);
        assert_eq!(s.endpoints[0].inflight_at_scrape, Some(2));
        assert_eq!((s.endpoints[1].models.len(), s.endpoints[1].failures), (2, 3));
        assert!(s.endpoints[1].metrics.is_none());
        assert_eq!(
            (s.endpoints[0].role, s.endpoints[1].role),
            (crate::state::catalog::Role::Decode, crate::state::catalog::Role::Both)
        );
    }

    #[test]
    fn the_binary_form_is_smaller_than_json() {
        let s = full();
        assert!(encode(&s).len() < serde_json::to_vec(&s).unwrap().len());
    }

    #[test]
    fn freshness() {
        let e = &snap(1).endpoints[0];
        assert!(e.is_fresh(1990, 1000));
        assert!(!e.is_fresh(1991, 1000));
        let failed = EndpointStatus { failures: 1, ..e.clone() };
        assert!(!failed.is_fresh(1000, 1000));
        let never = EndpointStatus { metrics: None, scraped_ms: 0, ..e.clone() };
        assert!(!never.is_fresh(0, 1000));
        // Polled every 200 ms: the configured limit. Polled every 2000 ms (idle): fresh until
        // 2000 + 500, stale after; a failure is stale at once whatever the interval.
        let fast = EndpointStatus { poll_ms: 200, ..e.clone() };
        assert_eq!(fast.stale_limit_ms(1000), 1000);
        let slow = EndpointStatus { poll_ms: 2000, ..e.clone() };
        assert!(slow.is_fresh(990 + 2500, 1000));
        assert!(!slow.is_fresh(990 + 2501, 1000));
        assert!(!EndpointStatus { failures: 1, ..slow }.is_fresh(1000, 1000));
    }
}
