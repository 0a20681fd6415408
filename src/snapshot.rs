//! The versioned snapshot the poller publishes and the filter reads.
//!
//! Shared-data layout (bounded: two keys, whatever the pool size):
//! - [`SNAPSHOT_KEY`]: the JSON-encoded [`Snapshot`];
//! - [`SNAPSHOT_VERSION_KEY`]: the snapshot's version as decimal text, so that a worker can see
//!   cheaply (a few bytes copied) whether its cached, decoded snapshot is still current.

use serde::{Deserialize, Serialize};

use crate::metrics::EndpointMetrics;

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
    /// This gateway's in-flight requests to the endpoint (all workers, `crate::inflight`) when
    /// the last successful scrape's response arrived; `None` when unknown. The base of the live
    /// load estimate (`crate::load`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inflight_at_scrape: Option<u32>,
    /// The interval at which the poller scrapes this endpoint now (ms; `crate::poller`): longer
    /// for an idle, unchanged endpoint. 0 = not said (an older poller). It extends the staleness
    /// limit, see [`EndpointStatus::stale_limit_ms`].
    #[serde(default, skip_serializing_if = "is_zero")]
    pub poll_ms: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

use crate::ports::{SharedStore, StoreError};

/// Writes a snapshot: the body first, then the version key that readers poll.
pub fn publish(store: &dyn SharedStore, snapshot: &Snapshot) -> Result<(), StoreError> {
    let body = serde_json::to_vec(snapshot).map_err(|e| StoreError::Host(e.to_string()))?;
    store.set(SNAPSHOT_KEY, &body, 0)?;
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
                if let Ok(s) = serde_json::from_slice::<Snapshot>(&body) {
                    self.current = std::rc::Rc::new(s);
                    self.seen_version = version;
                }
            }
        }
        Ok(self.current.clone())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ports::MemStore;

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
                poll_ms: 0,
            }],
        }
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
