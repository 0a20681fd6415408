//! The versioned snapshot the poller publishes and the filter reads.
//!
//! Shared-data layout (bounded: two keys, whatever the pool size):
//! - [`SNAPSHOT_KEY`]: the [`Snapshot`] in the compact binary form of [`encode`] (a value that
//!   starts with `{` is read as the JSON form older builds wrote, so a filter VM and a poller of
//!   different builds still agree during an upgrade);
//! - [`SNAPSHOT_VERSION_KEY`]: the snapshot's version as decimal text, so that a worker can see
//!   cheaply (a few bytes copied) whether its cached, decoded snapshot is still current.

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
    store.set(SNAPSHOT_VERSION_KEY, snapshot.version.to_string().as_bytes(), 0)
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

    /// Re-reads the snapshot if the poller published a new version. A garbled value keeps the
    /// previous snapshot, whose endpoints then age into staleness on their own.
    pub fn refresh(&mut self, store: &dyn SharedStore) -> Result<std::rc::Rc<Snapshot>, StoreError> {
        let version = match store.get(SNAPSHOT_VERSION_KEY)? {
            Some((v, _)) => std::str::from_utf8(&v).ok().and_then(|s| s.parse::<u64>().ok()).unwrap_or(0),
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
// The binary codec.
//
// Every worker decodes each new snapshot version (every `poller.interval_ms`, 200 ms by default)
// and the poller encodes it; at 1,024 endpoints the JSON form cost milliseconds of V8 time per
// version on every worker. This form is read field by field with bounds checks:
//
//   "IPS2" · u64 version · u64 published_ms · u32 endpoint count · endpoints
//   endpoint: str address · u8 role (0 decode, 1 prefill, 2 both) · u32 n · n × str model
//             · u64 scraped_ms · u32 failures · u64 poll_ms · opt u32 inflight_at_scrape · u8 has metrics [· metrics]
//   metrics:  u8 engine · opt f64 queue · opt f64 running · opt f64 kv_usage · opt u32 block_size
//             · opt u64 num_gpu_blocks · opt u32 max_lora · strs running · strs waiting
//   str = u32 length · UTF-8 bytes; opt x = u8 0 | u8 1 · x; integers little-endian; f64 as bits.
//
// Adding a field to `EndpointStatus` or `EndpointMetrics`: the destructuring in `put_endpoint`
// and `put_metrics` stops compiling until the field is encoded here too (and decoded). Any change
// of the layout takes a new `MAGIC` ("IPS3", ...), so a filter VM and a poller of different
// builds (shared data outlives a configuration reload) never read each other's values as their
// own: the reader keeps its last snapshot until one it knows arrives.

const MAGIC: &[u8; 4] = b"IPS2";

/// The snapshot in its shared-data form (see the codec comment above).
pub fn encode(snapshot: &Snapshot) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 + snapshot.endpoints.len() * 96);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&snapshot.version.to_le_bytes());
    out.extend_from_slice(&snapshot.published_ms.to_le_bytes());
    put_len(&mut out, snapshot.endpoints.len());
    for e in &snapshot.endpoints {
        put_endpoint(&mut out, e);
    }
    out
}

/// Reads a stored snapshot: the binary form, or the JSON form of older builds. `None` for
/// anything malformed or truncated. Never panics, allocates at most in proportion to the input.
pub fn decode(bytes: &[u8]) -> Option<Snapshot> {
    if bytes.first() == Some(&b'{') {
        return serde_json::from_slice(bytes).ok();
    }
    let mut r = Reader(bytes);
    if r.take(4)? != MAGIC {
        return None;
    }
    let version = r.u64()?;
    let published_ms = r.u64()?;
    // An endpoint takes at least 27 bytes: a count beyond that is garbage.
    let n = r.count(27)?;
    let mut endpoints = Vec::with_capacity(n);
    for _ in 0..n {
        endpoints.push(r.endpoint()?);
    }
    r.0.is_empty().then_some(Snapshot { version, published_ms, endpoints })
}

fn put_len(out: &mut Vec<u8>, n: usize) {
    out.extend_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes());
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_len(out, s.len());
    out.extend_from_slice(s.as_bytes());
}

fn put_strs(out: &mut Vec<u8>, v: &[String]) {
    put_len(out, v.len());
    for s in v {
        put_str(out, s);
    }
}

fn put_opt<T>(out: &mut Vec<u8>, v: Option<T>, put: impl FnOnce(&mut Vec<u8>, T)) {
    match v {
        Some(x) => {
            out.push(1);
            put(out, x);
        }
        None => out.push(0),
    }
}

fn put_endpoint(out: &mut Vec<u8>, e: &EndpointStatus) {
    let EndpointStatus { address, models, metrics, scraped_ms, failures, inflight_at_scrape, role, poll_ms } =
        e;
    put_str(out, address);
    out.push(match role {
        crate::state::catalog::Role::Decode => 0,
        crate::state::catalog::Role::Prefill => 1,
        crate::state::catalog::Role::Both => 2,
    });
    put_strs(out, models);
    out.extend_from_slice(&scraped_ms.to_le_bytes());
    out.extend_from_slice(&failures.to_le_bytes());
    out.extend_from_slice(&poll_ms.to_le_bytes());
    put_opt(out, *inflight_at_scrape, |o, x| o.extend_from_slice(&x.to_le_bytes()));
    put_opt(out, metrics.as_ref(), put_metrics);
}

fn put_metrics(out: &mut Vec<u8>, m: &EndpointMetrics) {
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
    out.push(match engine {
        Engine::Unknown => 0,
        Engine::Vllm => 1,
        Engine::Sglang => 2,
        Engine::Trtllm => 3,
    });
    for f in [queue, running, kv_usage] {
        put_opt(out, *f, |o, x| o.extend_from_slice(&x.to_bits().to_le_bytes()));
    }
    put_opt(out, *block_size, |o, x| o.extend_from_slice(&x.to_le_bytes()));
    put_opt(out, *num_gpu_blocks, |o, x| o.extend_from_slice(&x.to_le_bytes()));
    put_opt(out, *max_lora, |o, x| o.extend_from_slice(&x.to_le_bytes()));
    put_strs(out, running_adapters);
    put_strs(out, waiting_adapters);
}

/// Bounds-checked reads from the front of a byte slice.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }

    fn u8(&mut self) -> Option<u8> {
        Some(self.array::<1>()?[0])
    }

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.array()?))
    }

    /// A count of items each at least `min_bytes` long, checked against what is left.
    fn count(&mut self, min_bytes: usize) -> Option<usize> {
        let n = usize::try_from(self.u32()?).ok()?;
        (n <= self.0.len() / min_bytes.max(1)).then_some(n)
    }

    fn opt<T>(&mut self, read: impl FnOnce(&mut Self) -> Option<T>) -> Option<Option<T>> {
        match self.u8()? {
            0 => Some(None),
            1 => read(self).map(Some),
            _ => None,
        }
    }

    fn string(&mut self) -> Option<String> {
        let n = usize::try_from(self.u32()?).ok()?;
        std::str::from_utf8(self.take(n)?).ok().map(str::to_string)
    }

    fn strings(&mut self) -> Option<Vec<String>> {
        let n = self.count(4)?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(self.string()?);
        }
        Some(v)
    }

    fn endpoint(&mut self) -> Option<EndpointStatus> {
        let address = self.string()?;
        let role = match self.u8()? {
            0 => crate::state::catalog::Role::Decode,
            1 => crate::state::catalog::Role::Prefill,
            2 => crate::state::catalog::Role::Both,
            _ => return None,
        };
        let models = self.strings()?;
        let scraped_ms = self.u64()?;
        let failures = self.u32()?;
        let poll_ms = self.u64()?;
        let inflight_at_scrape = self.opt(Self::u32)?;
        let metrics = self.opt(Self::metrics)?;
        Some(EndpointStatus {
            address,
            models,
            metrics,
            scraped_ms,
            failures,
            inflight_at_scrape,
            role,
            poll_ms,
        })
    }

    fn metrics(&mut self) -> Option<EndpointMetrics> {
        let engine = match self.u8()? {
            0 => Engine::Unknown,
            1 => Engine::Vllm,
            2 => Engine::Sglang,
            3 => Engine::Trtllm,
            _ => return None,
        };
        let float = |r: &mut Self| r.u64().map(f64::from_bits);
        let queue = self.opt(float)?;
        let running = self.opt(float)?;
        let kv_usage = self.opt(float)?;
        let block_size = self.opt(Self::u32)?;
        let num_gpu_blocks = self.opt(Self::u64)?;
        let max_lora = self.opt(Self::u32)?;
        let running_adapters = self.strings()?;
        let waiting_adapters = self.strings()?;
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
        store.set(SNAPSHOT_VERSION_KEY, b"3", 0).unwrap();
        assert_eq!(cache.refresh(&store).unwrap().version, 2);
        assert_eq!(store.key_count(), 2);
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
    fn the_json_form_of_older_builds_is_still_read() {
        let s = full();
        let json = serde_json::to_vec(&s).unwrap();
        assert_eq!(decode(&json), Some(s));
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
        let mut huge = b"IPS2".to_vec();
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
