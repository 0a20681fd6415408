//! Flow control inside the proxy: hold requests while their endpoints are saturated, release
//! them in priority order, fairly across tenants, and coordinate the Envoy workers through
//! shared data.
//!
//! # One queue per worker and group
//! Each Envoy worker is its own VM, so each holds its own paused requests: a [`FlowQueue`] per
//! *group* (normally one per model, so that a saturated model does not hold back another). A
//! held request is a paused HTTP context, known by its context id. Workers see each other only
//! through one shared-data key per group, [`shared_key`], holding a small [`Record`]:
//! - `w`: per live worker, its id, a heartbeat and how many requests it holds at each priority
//!   (the *waiting summary*);
//! - `e`, `l`, `r`: the *release ledger*: the capacity epoch, the release tokens left in it, and
//!   when it was last reset;
//! - `f`, `d`: tenant fairness over all workers (see below and `crate::flow::fairshare`).
//!
//! Every change is a read-modify-write with CAS (retried up to 8 times), so no update is lost.
//!
//! # Admission ([`FlowQueue::admit`], at request time)
//! With the model's [`Capacity`] (from `crate::flow::saturation`) and the shared record:
//! 1. Sheddable (priority < 0) and saturated for its priority ([`Capacity::saturated_for`]: at
//!    the reduced thresholds when it is below `flow_control.reserve.min_priority`): 429 at once
//!    (`request_shed`).
//! 2. Not saturated (for this priority: below `flow_control.reserve.min_priority`, at the
//!    reduced thresholds, [`Capacity::saturated_for`]) and no request of equal or higher priority
//!    waits anywhere: pass. When lower-priority requests wait somewhere, the release ledger is in
//!    use and the pass takes a token; with no token left the request is held (it will be first
//!    out).
//! 3. Otherwise hold it, unless the group already holds `max_queue` requests over all workers:
//!    then, if this worker holds a lower-priority request, that one (the newest of the lowest
//!    priority) is evicted with 429 to make room; if not, this request gets 429 (`queue_full`).
//!
//! # Release ([`FlowQueue::on_tick`], from the root context's tick)
//! 1. Requests held longer than `max_wait_ms` are rejected with 503 (`queue_timeout`).
//! 2. Ledger: the capacity epoch is the snapshot version. The first worker to see a newer epoch
//!    resets the tokens to that epoch's `slots` (the saturation headroom). Each release spends one
//!    token. So each new set of metrics admits at most the headroom it shows, over all workers
//!    together, and workers cannot all release at once into the same free slots.
//! 3. Order: a worker releases a request only if no live worker publishes a waiting request of
//!    higher priority. Within this worker, strict priority order, then round-robin over fairness
//!    ids (tenants) inside one priority level, among the tenants the cross-worker fairness rule
//!    lets go (below). Below `reserve.min_priority`, nothing is released while the reduced
//!    thresholds are reached, and at most the reduced headroom otherwise; the tokens left stay
//!    in the ledger for higher priorities.
//! 4. Sharing tokens at equal priority: when other workers also hold requests at this worker's
//!    top priority, it takes at most `ceil(tokens / (1 + those workers))` per tick, so the first
//!    worker to tick does not drain the budget.
//!
//! # Cross-worker guarantee, and its limits
//! - Tokens are exact: over all workers, releases plus token-taking passes in one epoch never
//!   exceed the epoch's `slots` (CAS; a failed write releases nothing).
//! - Priority across workers holds up to publication lag: a worker sees another's held requests
//!   as of that worker's last write (on every hold, and on its ticks). A request held on worker B
//!   after worker A read the record can lose to A's lower-priority release in that tick, and a
//!   request cancelled on B keeps lower-priority releases elsewhere waiting until B's next tick.
//! - Fairness between tenants holds across workers (`crate::flow::fairshare`): the record also keeps,
//!   per priority, how many releases each waiting tenant got over all workers (`f`), each worker
//!   publishes the tenants it holds (`t` of its entry), and a worker releases a tenant's request
//!   only when that tenant is at most `fairshare::SLACK` releases ahead of the least-served
//!   waiting tenant of the same priority anywhere. Otherwise it leaves the token for the worker
//!   that holds that tenant; a refusal that left tokens unused for `fairshare::GRACE_MS` (`d`)
//!   is waived, so fairness never stalls the queue. Within a worker, tenants that qualify are
//!   served in round-robin order.
//! - A worker that stops ticking (VM gone) is ignored once its heartbeat is older than
//!   `worker_ttl_ms`, so it cannot block others forever. The tick period must be well under a
//!   third of `worker_ttl_ms` (heartbeats are written every `worker_ttl_ms / 3` while holding).
//! - Capacity frees as requests finish, not once per snapshot: the worker whose `on_log` sees a
//!   request finish reads the group's live capacity (`crate::state::load`: the finish lowered the
//!   estimate at once) and, if some worker holds requests and there is room, adds one token to
//!   the ledger ([`credit_finish`], capped at the live headroom), then runs its own release
//!   check at once; other workers spend the token at their next tick (50 ms).
//! - At a new snapshot the tokens are reset to the live headroom, which already counts every
//!   request released or passed since the scrape (they are in the in-flight counts).
//! - An epoch older than `worker_ttl_ms` yields to any different epoch, so a poller that restarts
//!   its version numbers does not stall the ledger; during normal operation a worker with an
//!   older cached snapshot never resets a newer epoch.
//! - When the shared store fails, the queue acts locally: it holds, times out and cancels, but
//!   releases nothing until the store works again (timeouts bound the wait).
//!
//! # First writes
//! Envoy has no create-if-absent: a write with CAS 0 to an absent key is blind, so two workers
//! that both found a group's key absent would both write and the second would erase the first's
//! hold or token spend. A read-modify-write that finds the key absent and
//! has something to write first creates it with an empty value (the neutral record: no workers,
//! no ledger) using `crate::base::ports::CREATE_CAS`, which fails if the key exists, then re-reads and
//! applies its update with CAS on a real token, the first one included. Tested by
//! interleaving two first writers on a store with Envoy's exact semantics
//! (`two_first_writers_of_a_group_key_both_count`).
//!
//! # Keys
//! One key per group, so the number of keys is bounded by the configured models. The value is
//! bounded by workers × (distinct priorities + `fairshare::MAX_PUBLISHED`) (priorities come only
//! from the config).

pub mod admission;
pub mod fairshare;
pub mod priority;
pub mod saturation;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

use self::fairshare::Served;
use crate::base::errors::Rejection;
use crate::base::json::{self, ConfigError};
use crate::base::ports::{SharedStore, StoreError};
use crate::flow::saturation::SaturationReport;

/// Prefix of the per-group shared-data key.
pub const FLOW_KEY_PREFIX: &str = "inference-picker/flow/";
/// CAS attempts per read-modify-write before giving up for this call.
const MAX_CAS_ATTEMPTS: usize = 8;

/// The shared-data key of a group.
pub fn shared_key(group: &str) -> String {
    format!("{FLOW_KEY_PREFIX}{group}")
}

/// Smallest `flow_control.worker_ttl_ms`: heartbeats come from ticks, every `ttl / 3`.
pub const MIN_WORKER_TTL_MS: u64 = 300;

/// Holding requests inside the proxy while their model's endpoints are saturated, and releasing
/// them in priority order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct FlowControlConfig {
    /// Hold requests while saturated. Default false, as GIE: the replay benchmark
    /// (tools/replay-bench/FINDINGS.md) showed holding costs latency and throughput on workloads
    /// where every request has the same priority; turn it on where tiers or criticality differ.
    /// When false nothing is held: while saturated, sheddable requests get 429 and the rest go
    /// straight to the scheduler.
    #[serde(default = "default_enabled")]
    pub enabled: bool,
    /// Longest a request is held before 503, in ms; at least 1. Default 30000.
    #[serde(default = "default_max_wait_ms")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1)))]
    pub max_wait_ms: u64,
    /// Most requests held per model over all workers before 429; at least 1. Default 1024.
    #[serde(default = "default_max_queue")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1)))]
    pub max_queue: u32,
    /// `retry-after` seconds on 429 and 503 from flow control. Default 1.
    #[serde(default = "default_retry_after_s")]
    pub retry_after_s: u32,
    /// A worker whose heartbeat is older than this, in ms, no longer counts; at least 300.
    /// Default 2000. The filter's tick period must be well below a third of it.
    #[serde(default = "default_worker_ttl_ms")]
    #[cfg_attr(feature = "schema", schemars(range(min = MIN_WORKER_TTL_MS)))]
    pub worker_ttl_ms: u64,
    /// Headroom kept for high priorities: requests below `min_priority` are held once every
    /// endpoint is loaded to `1 - fraction` of the saturation thresholds, so that requests at or
    /// above it still find room. Default null (none).
    #[serde(default)]
    pub reserve: Option<ReserveConfig>,
}

/// `flow_control.reserve`: see [`FlowControlConfig::reserve`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ReserveConfig {
    /// Requests of this priority or higher may use the reserved headroom.
    pub min_priority: i32,
    /// Share of each saturation threshold (`queue_threshold`, `kv_threshold`,
    /// `max_inflight_per_endpoint`) kept for them, in (0, 1).
    #[cfg_attr(feature = "schema", schemars(range(min = 0.0, max = 1.0)))]
    pub fraction: f64,
}

impl Eq for ReserveConfig {}

// The readers of this file's configuration types (`crate::base::json`), fields in declaration
// order.
json::from_json_struct!(FlowControlConfig {
    enabled = default_enabled(),
    max_wait_ms = default_max_wait_ms(),
    max_queue = default_max_queue(),
    retry_after_s = default_retry_after_s(),
    worker_ttl_ms = default_worker_ttl_ms(),
    reserve = None,
});
json::from_json_struct!(ReserveConfig { min_priority, fraction });

fn default_enabled() -> bool {
    false
}
fn default_max_wait_ms() -> u64 {
    30_000
}
fn default_max_queue() -> u32 {
    1024
}
fn default_retry_after_s() -> u32 {
    1
}
fn default_worker_ttl_ms() -> u64 {
    2_000
}

impl Default for FlowControlConfig {
    fn default() -> Self {
        Self {
            enabled: default_enabled(),
            max_wait_ms: default_max_wait_ms(),
            max_queue: default_max_queue(),
            retry_after_s: default_retry_after_s(),
            worker_ttl_ms: default_worker_ttl_ms(),
            reserve: None,
        }
    }
}

impl FlowControlConfig {
    /// Appends every problem to `errs`, with paths under `path` (e.g. `flow_control`).
    pub fn validate(&self, path: &str, errs: &mut Vec<ConfigError>) {
        if self.max_wait_ms == 0 {
            errs.push(ConfigError { path: format!("{path}.max_wait_ms"), reason: "must be > 0".into() });
        }
        if self.max_queue == 0 {
            errs.push(ConfigError {
                path: format!("{path}.max_queue"),
                reason: "must be > 0 (set enabled: false to hold nothing)".into(),
            });
        }
        if let Some(r) = &self.reserve {
            if !(r.fraction > 0.0 && r.fraction < 1.0) {
                errs.push(ConfigError {
                    path: format!("{path}.reserve.fraction"),
                    reason: format!("must be > 0 and < 1, got {}", r.fraction),
                });
            }
        }
        if self.worker_ttl_ms < MIN_WORKER_TTL_MS {
            errs.push(ConfigError {
                path: format!("{path}.worker_ttl_ms"),
                reason: format!(
                    "must be at least {MIN_WORKER_TTL_MS}, got {}: heartbeats come from ticks",
                    self.worker_ttl_ms
                ),
            });
        }
    }
}

/// What the group can take right now, as seen by this worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    /// Changes when the capacity estimate is renewed: the snapshot version.
    pub epoch: u64,
    /// Release tokens for a new epoch: the saturation headroom.
    pub slots: u32,
    /// Every endpoint of the group is full.
    pub saturated: bool,
    /// The capacity left to priorities below a reserve (`flow_control.reserve`), if configured.
    pub reserve: Option<Reserve>,
}

/// What the group can take from requests below `min_priority`: the saturation report at the
/// reduced thresholds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reserve {
    pub min_priority: i32,
    pub slots: u32,
    pub saturated: bool,
}

impl Capacity {
    pub fn new(snapshot_version: u64, report: &SaturationReport) -> Self {
        Self { epoch: snapshot_version, slots: report.headroom, saturated: report.saturated, reserve: None }
    }

    /// Adds the reserve: `report` is the saturation report at the reduced thresholds.
    pub fn with_reserve(mut self, min_priority: i32, report: &SaturationReport) -> Self {
        self.reserve = Some(Reserve { min_priority, slots: report.headroom, saturated: report.saturated });
        self
    }

    /// Whether a request of `priority` finds every endpoint full (for it).
    pub fn saturated_for(&self, priority: i32) -> bool {
        match self.reserve {
            Some(r) if priority < r.min_priority => self.saturated || r.saturated,
            _ => self.saturated,
        }
    }
}

/// A request asking to go upstream.
#[derive(Debug, Clone, Copy)]
pub struct Ticket<'a> {
    /// The HTTP context id (unique within the VM).
    pub id: u32,
    pub priority: i32,
    pub fairness_id: &'a str,
}

/// The answer to [`FlowQueue::admit`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Go on to the scheduler now.
    Pass,
    /// Paused; a later [`FlowQueue::on_tick`] releases or rejects it. `evicted` is a
    /// lower-priority request of this worker pushed out to make room: answer it with the
    /// rejection now.
    Held { evicted: Option<(u32, Rejection)> },
    /// Answer with this error now.
    Reject(Rejection),
}

/// What the host must do with a held request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Schedule it and resume it.
    Release { id: u32, priority: i32, waited_ms: u64 },
    /// Answer it with the rejection (it stays paused until then).
    Reject { id: u32, priority: i32, waited_ms: u64, rejection: Rejection },
}

/// Counters for one priority level; each counts requests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PriorityStats {
    /// Admitted without waiting.
    pub passed: u64,
    /// Held (paused).
    pub held: u64,
    /// Released after waiting.
    pub released: u64,
    /// Rejected with 503 after `max_wait_ms`.
    pub timed_out: u64,
    /// Rejected with 429 at once: sheddable while saturated.
    pub shed: u64,
    /// Rejected or evicted with 429 because the queue was full.
    pub queue_full: u64,
    /// Left the queue because the client went away.
    pub cancelled: u64,
    /// Total time, in ms, spent held by requests that left the queue (any way).
    pub queued_ms: u64,
}

/// Per-priority counters since the last [`FlowQueue::take_stats`]. Counters of different workers
/// add up (each worker exports its own deltas).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FlowStats {
    pub by_priority: BTreeMap<i32, PriorityStats>,
}

impl FlowStats {
    fn at(&mut self, priority: i32) -> &mut PriorityStats {
        self.by_priority.entry(priority).or_default()
    }
}

// ---- shared record -------------------------------------------------------------------------

/// The shared value of one group (compact JSON keys: it is copied on every read).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// Capacity epoch of the ledger.
    #[serde(rename = "e", default)]
    pub epoch: u64,
    /// When the ledger was last reset (ms).
    #[serde(rename = "r", default)]
    pub reset_ms: u64,
    /// Release tokens left in this epoch.
    #[serde(rename = "l", default)]
    pub left: u32,
    /// Waiting summaries of the workers that hold requests.
    #[serde(rename = "w", default)]
    pub workers: Vec<WorkerEntry>,
    /// Releases per waiting tenant and priority, over all workers (`crate::flow::fairshare`).
    #[serde(rename = "f", default, skip_serializing_if = "Served::is_empty")]
    pub served: Served,
    /// When a fairness refusal first left tokens unused (ms); 0 when none did since the last
    /// release. See `crate::flow::fairshare::GRACE_MS`.
    #[serde(rename = "d", default, skip_serializing_if = "is_zero")]
    pub declined_ms: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerEntry {
    pub id: u64,
    /// Last write by this worker (ms).
    pub hb: u64,
    /// (priority, held count), highest priority first, counts > 0.
    pub q: Vec<(i32, u32)>,
    /// (priority, tenant bucket) pairs held, highest priority first, at most
    /// `crate::flow::fairshare::MAX_PUBLISHED`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub t: Vec<(i32, u16)>,
}

impl WorkerEntry {
    fn max_priority(&self) -> Option<i32> {
        self.q.iter().filter(|(_, c)| *c > 0).map(|(p, _)| *p).max()
    }
}

impl Record {
    fn decode(bytes: &[u8]) -> Record {
        // An empty value is "removed"; a value we cannot read (another build's format) is reset
        // rather than trusted.
        serde_json::from_slice(bytes).unwrap_or_default()
    }

    /// Drops workers whose heartbeat is older than `ttl_ms` (never `me`). True if any went.
    fn prune(&mut self, now_ms: u64, ttl_ms: u64, me: u64) -> bool {
        let before = self.workers.len();
        self.workers.retain(|w| w.id == me || now_ms.saturating_sub(w.hb) < ttl_ms);
        self.workers.len() != before
    }

    /// Starts a new epoch when `cap` is newer, or different and the ledger is old. True if reset.
    fn refresh_epoch(&mut self, cap: &Capacity, now_ms: u64, ttl_ms: u64) -> bool {
        let newer = cap.epoch > self.epoch;
        let abandoned = cap.epoch != self.epoch && now_ms.saturating_sub(self.reset_ms) >= ttl_ms;
        if newer || abandoned {
            self.epoch = cap.epoch;
            self.left = cap.slots;
            self.reset_ms = now_ms;
            true
        } else {
            false
        }
    }

    fn remote(&self, me: u64) -> impl Iterator<Item = &WorkerEntry> {
        self.workers.iter().filter(move |w| w.id != me)
    }

    /// Remote waiting counts plus `local`, per priority, highest first.
    fn global_waiting(&self, me: u64, local: &[(i32, u32)]) -> Vec<(i32, u32)> {
        let mut m: BTreeMap<Reverse<i32>, u32> = BTreeMap::new();
        for (p, c) in self.remote(me).flat_map(|w| w.q.iter()).chain(local.iter()) {
            let e = m.entry(Reverse(*p)).or_default();
            *e = e.saturating_add(*c);
        }
        m.into_iter().filter(|(_, c)| *c > 0).map(|(Reverse(p), c)| (p, c)).collect()
    }

    /// Publishes this worker's summary (`q`) and the tenants it holds (`t`). Writes are needed
    /// when they changed, or to renew the heartbeat of a non-empty entry every `ttl_ms / 3`. True
    /// if the record changed.
    fn set_own(&mut self, me: u64, now_ms: u64, q: &[(i32, u32)], t: &[(i32, u16)], ttl_ms: u64) -> bool {
        let pos = self.workers.iter().position(|w| w.id == me);
        match (pos, q.is_empty()) {
            (None, true) => false,
            (Some(i), true) => {
                self.workers.remove(i);
                true
            }
            (None, false) => {
                self.workers.push(WorkerEntry { id: me, hb: now_ms, q: q.to_vec(), t: t.to_vec() });
                true
            }
            (Some(i), false) => match self.workers.get_mut(i) {
                Some(w) if w.q == q && w.t == t && now_ms.saturating_sub(w.hb) < ttl_ms / 3 => false,
                Some(w) => {
                    w.q = q.to_vec();
                    w.t = t.to_vec();
                    w.hb = now_ms;
                    true
                }
                None => false,
            },
        }
    }

    /// Keeps the fairness counts of the tenants live workers publish, and only those.
    fn settle_fairness(&mut self) {
        let waiting: BTreeSet<(i32, u16)> = self.workers.iter().flat_map(|w| w.t.iter().copied()).collect();
        self.served.retain_waiting(&waiting);
        if self.workers.is_empty() {
            self.declined_ms = 0;
        }
    }
}

/// Reads the group's record, applies `f`, and writes it back with CAS when `f` says so; retries
/// on CAS mismatch. Returns `f`'s result for the attempt that stuck.
fn read_modify_write<R>(
    store: &dyn SharedStore,
    key: &str,
    f: &mut dyn FnMut(&mut Record) -> (R, bool),
) -> Result<(R, Record), StoreError> {
    for _ in 0..MAX_CAS_ATTEMPTS {
        let found = store.get(key)?;
        let absent = found.is_none();
        let (bytes, cas) = found.unwrap_or_default();
        let mut rec = Record::decode(&bytes);
        let (r, write) = f(&mut rec);
        if !write {
            return Ok((r, rec));
        }
        rec.settle_fairness();
        if absent {
            // Never written: create it empty (the neutral record) with the creation CAS, then
            // redo the update as a CAS on a real token. See the module doc, "First writes".
            match store.set(key, b"", crate::base::ports::CREATE_CAS) {
                Ok(()) | Err(StoreError::CasMismatch) => continue,
                Err(e) => return Err(e),
            }
        }
        let bytes = serde_json::to_vec(&rec).map_err(|e| StoreError::Host(e.to_string()))?;
        match store.set(key, &bytes, cas) {
            Ok(()) => return Ok((r, rec)),
            Err(StoreError::CasMismatch) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(StoreError::CasMismatch)
}

/// A request on one of the group's endpoints finished (seen by any worker's `on_log`): give the
/// freed room to the held requests now instead of at the next snapshot. `cap` is the group's
/// capacity read *after* the finish (the live estimate of `crate::state::load` has already dropped).
/// When some live worker holds requests and the group has room, the ledger gains one token,
/// never more than the live headroom (`left = min(left + 1, cap.slots)`); a newer epoch resets
/// it to `cap.slots` as a tick would. Writes nothing (one read) when nobody waits or there is no
/// room. Returns whether a token was added or the epoch renewed.
pub fn credit_finish(
    store: &dyn SharedStore,
    group: &str,
    cap: &Capacity,
    worker_ttl_ms: u64,
    now_ms: u64,
) -> Result<bool, StoreError> {
    if cap.saturated || cap.slots == 0 {
        return Ok(false);
    }
    let mut credit = |rec: &mut Record| -> (bool, bool) {
        let waiting = rec
            .workers
            .iter()
            .any(|w| now_ms.saturating_sub(w.hb) < worker_ttl_ms && w.q.iter().any(|(_, c)| *c > 0));
        if !waiting {
            return (false, false);
        }
        if rec.refresh_epoch(cap, now_ms, worker_ttl_ms) {
            return (true, true);
        }
        let next = rec.left.saturating_add(1).min(cap.slots);
        let changed = next > rec.left;
        rec.left = rec.left.max(next);
        (changed, changed)
    };
    read_modify_write(store, &shared_key(group), &mut credit).map(|(r, _)| r)
}

/// `local` with one more at `add` and, if given, one fewer at `remove`.
fn adjusted(local: &[(i32, u32)], add: i32, remove: Option<i32>) -> Vec<(i32, u32)> {
    let mut m: BTreeMap<Reverse<i32>, u32> = local.iter().map(|(p, c)| (Reverse(*p), *c)).collect();
    *m.entry(Reverse(add)).or_default() += 1;
    if let Some(r) = remove {
        if let Some(c) = m.get_mut(&Reverse(r)) {
            *c = c.saturating_sub(1);
        }
    }
    m.into_iter().filter(|(_, c)| *c > 0).map(|(Reverse(p), c)| (p, c)).collect()
}

// ---- local queue ---------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct Entry {
    priority: i32,
    flow: String,
    enqueued_ms: u64,
    seq: u64,
}

/// One priority level: per-tenant FIFOs served round-robin.
#[derive(Debug, Default)]
struct Level {
    /// Tenants with held requests, in service order.
    rr: VecDeque<String>,
    flows: BTreeMap<String, VecDeque<u32>>,
    len: u32,
}

impl Level {
    fn push(&mut self, flow: &str, id: u32) {
        match self.flows.get_mut(flow) {
            Some(q) => q.push_back(id),
            None => {
                self.flows.insert(flow.to_string(), VecDeque::from([id]));
                self.rr.push_back(flow.to_string());
            }
        }
        self.len += 1;
    }

    /// The next id in round-robin order: the front of the next tenant's FIFO.
    fn pop(&mut self) -> Option<u32> {
        while let Some(flow) = self.rr.pop_front() {
            let Some(q) = self.flows.get_mut(&flow) else { continue };
            let Some(id) = q.pop_front() else {
                self.flows.remove(&flow);
                continue;
            };
            if q.is_empty() {
                self.flows.remove(&flow);
            } else {
                self.rr.push_back(flow);
            }
            self.len = self.len.saturating_sub(1);
            return Some(id);
        }
        None
    }

    /// The front id of `flow`'s FIFO; `flow` then goes to the back of the round-robin (the
    /// same rotation as [`Level::pop`] when it is at the front).
    fn pop_flow(&mut self, flow: &str) -> Option<u32> {
        let pos = self.rr.iter().position(|f| f == flow)?;
        let q = self.flows.get_mut(flow)?;
        let id = q.pop_front()?;
        let empty = q.is_empty();
        if let Some(f) = self.rr.remove(pos) {
            if empty {
                self.flows.remove(&f);
            } else {
                self.rr.push_back(f);
            }
        }
        self.len = self.len.saturating_sub(1);
        Some(id)
    }

    fn remove(&mut self, flow: &str, id: u32) -> bool {
        let Some(q) = self.flows.get_mut(flow) else { return false };
        let before = q.len();
        q.retain(|x| *x != id);
        if q.len() == before {
            return false;
        }
        if q.is_empty() {
            self.flows.remove(flow);
            self.rr.retain(|f| f != flow);
        }
        self.len = self.len.saturating_sub(1);
        true
    }
}

/// A copy of one level's round-robin (tenants in service order, with their fairness bucket and
/// held count), for planning releases inside a CAS attempt without touching the real queue.
#[derive(Debug, Clone)]
struct PlanLevel {
    priority: i32,
    flows: VecDeque<(String, u16, u32)>,
}

/// Takes one request of the first tenant (in round-robin order) of the highest non-empty level
/// that `may` accepts, and rotates that tenant to the back. Returns (priority, tenant, bucket).
fn plan_take(view: &mut [PlanLevel], may: &dyn Fn(i32, u16) -> bool) -> Option<(i32, String, u16)> {
    let level = view.iter_mut().find(|l| !l.flows.is_empty())?;
    let p = level.priority;
    let pos = level.flows.iter().position(|(_, b, _)| may(p, *b))?;
    let (flow, b, c) = level.flows.remove(pos)?;
    if c > 1 {
        level.flows.push_back((flow.clone(), b, c - 1));
    }
    Some((p, flow, b))
}

/// Held counts per priority of a plan view, highest first.
fn plan_summary(view: &[PlanLevel]) -> Vec<(i32, u32)> {
    view.iter()
        .map(|l| (l.priority, l.flows.iter().map(|(_, _, c)| *c).sum::<u32>()))
        .filter(|(_, c)| *c > 0)
        .collect()
}

/// The (priority, bucket) pairs a plan view holds: highest priority first, at most
/// `fairshare::MAX_PUBLISHED`, sorted so that an unchanged set encodes the same.
fn plan_tenants(view: &[PlanLevel]) -> Vec<(i32, u16)> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for l in view {
        for (_, b, c) in &l.flows {
            if *c > 0 && out.len() < fairshare::MAX_PUBLISHED && seen.insert((l.priority, *b)) {
                out.push((l.priority, *b));
            }
        }
    }
    crate::base::sorting::sort_by_key(&mut out, |(p, b)| (Reverse(*p), *b));
    out
}

/// The held requests of one group on this worker. See the module doc.
#[derive(Debug)]
pub struct FlowQueue {
    cfg: FlowControlConfig,
    key: String,
    worker_id: u64,
    entries: BTreeMap<u32, Entry>,
    /// Highest priority first.
    levels: BTreeMap<Reverse<i32>, Level>,
    /// (deadline, id, seq) in hold order; entries gone from `entries` are skipped lazily.
    deadlines: VecDeque<(u64, u32, u64)>,
    seq: u64,
    /// The record holds a non-empty entry for this worker (as far as we know).
    published: bool,
    /// The local state changed without being published.
    dirty: bool,
    /// Waiting per priority over all live workers, as of the last read.
    global: Vec<(i32, u32)>,
    stats: FlowStats,
}

impl FlowQueue {
    /// `group` names the set of endpoints (normally the model); `worker_id` must differ between
    /// workers (a random u64 per VM).
    pub fn new(cfg: &FlowControlConfig, group: &str, worker_id: u64) -> Self {
        Self {
            cfg: cfg.clone(),
            key: shared_key(group),
            worker_id,
            entries: BTreeMap::new(),
            levels: BTreeMap::new(),
            deadlines: VecDeque::new(),
            seq: 0,
            published: false,
            dirty: false,
            global: Vec::new(),
            stats: FlowStats::default(),
        }
    }

    /// Requests held on this worker.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// True while `on_tick` has work: requests held, or a published summary to withdraw.
    pub fn needs_tick(&self) -> bool {
        !self.entries.is_empty() || self.published || self.dirty
    }

    /// Held requests per priority over all live workers, as of the last shared read (a gauge;
    /// every worker sees about the same value).
    pub fn global_waiting(&self) -> &[(i32, u32)] {
        &self.global
    }

    /// The counters since the last call.
    pub fn take_stats(&mut self) -> FlowStats {
        std::mem::take(&mut self.stats)
    }

    /// This worker's levels as a plan view, highest priority first.
    fn plan_view(&self) -> Vec<PlanLevel> {
        self.levels
            .iter()
            .filter(|(_, l)| l.len > 0)
            .map(|(Reverse(p), l)| PlanLevel {
                priority: *p,
                flows: l
                    .rr
                    .iter()
                    .filter_map(|f| {
                        let n = l.flows.get(f).map_or(0, VecDeque::len);
                        let n = u32::try_from(n).unwrap_or(u32::MAX);
                        (n > 0).then(|| (f.clone(), fairshare::bucket(f), n))
                    })
                    .collect(),
            })
            .collect()
    }

    fn local_summary(&self) -> Vec<(i32, u32)> {
        self.levels.iter().filter(|(_, l)| l.len > 0).map(|(Reverse(p), l)| (*p, l.len)).collect()
    }

    fn rejection_shed(&self) -> Rejection {
        Rejection::new(
            429,
            "rate_limit_error",
            "request_shed",
            "the model's servers are saturated and this request is sheddable; retry later",
        )
        .with_retry_after(self.cfg.retry_after_s)
    }

    fn rejection_queue_full(&self) -> Rejection {
        Rejection::new(
            429,
            "rate_limit_error",
            "queue_full",
            "too many requests are waiting for this model's servers; retry later",
        )
        .with_retry_after(self.cfg.retry_after_s)
    }

    fn rejection_timeout(&self) -> Rejection {
        Rejection::new(
            503,
            "server_error",
            "queue_timeout",
            format!("no capacity for this request within {} ms; retry later", self.cfg.max_wait_ms),
        )
        .with_retry_after(self.cfg.retry_after_s)
    }

    /// Decides whether the request goes on now, waits, or is refused. See the module doc.
    pub fn admit(&mut self, store: &dyn SharedStore, t: &Ticket, cap: &Capacity, now_ms: u64) -> Admission {
        if t.priority < 0 && cap.saturated_for(t.priority) {
            self.stats.at(t.priority).shed += 1;
            return Admission::Reject(self.rejection_shed());
        }
        if !self.cfg.enabled {
            self.stats.at(t.priority).passed += 1;
            return Admission::Pass;
        }
        // The same context twice would corrupt the bookkeeping; the newer call wins.
        if let Some(old) = self.detach(t.id) {
            self.stats.at(old.priority).queued_ms += now_ms.saturating_sub(old.enqueued_ms);
        }

        enum Plan {
            Pass,
            Hold { evict: Option<i32> },
            Full,
            Shed,
        }
        let local = self.local_summary();
        let local_lowest = local.last().map(|(p, _)| *p);
        // The tenants this worker publishes once the request is held (an evicted request's
        // tenant may stay listed until the next tick: a count at the floor, harmless).
        let tenants = {
            let mut view = self.plan_view();
            let b = fairshare::bucket(t.fairness_id);
            match view.iter_mut().find(|l| l.priority == t.priority) {
                Some(l) => l.flows.push_back((t.fairness_id.to_string(), b, 1)),
                None => {
                    let at = view.iter().position(|l| l.priority < t.priority).unwrap_or(view.len());
                    view.insert(
                        at,
                        PlanLevel {
                            priority: t.priority,
                            flows: VecDeque::from([(t.fairness_id.to_string(), b, 1)]),
                        },
                    );
                }
            }
            plan_tenants(&view)
        };
        let (me, ttl, max_queue) = (self.worker_id, self.cfg.worker_ttl_ms, self.cfg.max_queue);
        let mut global = Vec::new();
        let mut plan_on = |rec: &mut Record| -> (Plan, bool) {
            rec.prune(now_ms, ttl, me);
            global = rec.global_waiting(me, &local);
            // Saturating: the counts come from other workers' records, which may hold anything.
            let ahead =
                global.iter().filter(|(p, _)| *p >= t.priority).fold(0u32, |a, (_, c)| a.saturating_add(*c));
            let total = global.iter().fold(0u32, |a, (_, c)| a.saturating_add(*c));
            if !cap.saturated_for(t.priority) && ahead == 0 {
                if total == 0 {
                    // Nobody waits: the ledger is not in use, nothing to write.
                    return (Plan::Pass, false);
                }
                rec.refresh_epoch(cap, now_ms, ttl);
                if rec.left > 0 {
                    rec.left -= 1;
                    return (Plan::Pass, true);
                }
            }
            // A sheddable request is never held: it would have to wait behind requests of its
            // priority or higher (the room it sees is promised to them) or for the next
            // capacity epoch, i.e. the pool is saturated for it. Holding it would serve it
            // later, ahead of nothing it should yield to.
            if t.priority < 0 {
                return (Plan::Shed, false);
            }
            let evict = if total < max_queue {
                None
            } else {
                match local_lowest {
                    Some(low) if low < t.priority => Some(low),
                    _ => return (Plan::Full, false),
                }
            };
            let own = adjusted(&local, t.priority, evict);
            rec.set_own(me, now_ms, &own, &tenants, ttl);
            global = rec.global_waiting(me, &own);
            (Plan::Hold { evict }, true)
        };
        let (plan, wrote) = match read_modify_write(store, &self.key, &mut plan_on) {
            Ok((plan, _)) => (plan, true),
            // No shared view: decide from local state alone and publish on the next tick.
            Err(_) => (plan_on(&mut Record::default()).0, false),
        };
        self.global = global;

        match plan {
            Plan::Pass => {
                self.stats.at(t.priority).passed += 1;
                Admission::Pass
            }
            Plan::Full => {
                self.stats.at(t.priority).queue_full += 1;
                Admission::Reject(self.rejection_queue_full())
            }
            Plan::Shed => {
                self.stats.at(t.priority).shed += 1;
                Admission::Reject(self.rejection_shed())
            }
            Plan::Hold { evict } => {
                let evicted = evict.and_then(|low| self.evict_newest(low, now_ms));
                self.hold(t, now_ms);
                if wrote {
                    self.published = true;
                } else {
                    self.dirty = true;
                }
                Admission::Held { evicted }
            }
        }
    }

    fn hold(&mut self, t: &Ticket, now_ms: u64) {
        self.seq += 1;
        let flow = t.fairness_id.to_string();
        self.levels.entry(Reverse(t.priority)).or_default().push(&flow, t.id);
        self.entries.insert(t.id, Entry { priority: t.priority, flow, enqueued_ms: now_ms, seq: self.seq });
        self.deadlines.push_back((now_ms.saturating_add(self.cfg.max_wait_ms), t.id, self.seq));
        self.stats.at(t.priority).held += 1;
        // Released and cancelled requests leave their deadline behind until it reaches the
        // front; drop them in bulk when they outnumber the live ones, so memory follows the
        // queue, not the arrival rate.
        if self.deadlines.len() > 2 * self.entries.len() + 64 {
            let entries = &self.entries;
            self.deadlines.retain(|(_, id, seq)| entries.get(id).is_some_and(|e| e.seq == *seq));
        }
    }

    /// Removes a held request from every local structure except `deadlines` (skipped lazily).
    fn detach(&mut self, id: u32) -> Option<Entry> {
        let e = self.entries.remove(&id)?;
        let key = Reverse(e.priority);
        if let Some(level) = self.levels.get_mut(&key) {
            level.remove(&e.flow, id);
            if level.len == 0 {
                self.levels.remove(&key);
            }
        }
        Some(e)
    }

    /// Pushes out the most recently held request at `priority`, with 429.
    fn evict_newest(&mut self, priority: i32, now_ms: u64) -> Option<(u32, Rejection)> {
        let id = self
            .entries
            .iter()
            .filter(|(_, e)| e.priority == priority)
            .max_by_key(|(_, e)| e.seq)
            .map(|(id, _)| *id)?;
        let e = self.detach(id)?;
        let s = self.stats.at(priority);
        s.queue_full += 1;
        s.queued_ms += now_ms.saturating_sub(e.enqueued_ms);
        Some((id, self.rejection_queue_full()))
    }

    /// The client went away (or the request ended some other way): forget it. Safe to call for
    /// any context id; returns whether it was held. The shared summary is updated on the next tick.
    pub fn cancel(&mut self, id: u32, now_ms: u64) -> bool {
        match self.detach(id) {
            Some(e) => {
                let s = self.stats.at(e.priority);
                s.cancelled += 1;
                s.queued_ms += now_ms.saturating_sub(e.enqueued_ms);
                self.dirty = true;
                true
            }
            None => false,
        }
    }

    /// Rejects requests held for `max_wait_ms` or longer.
    fn expire(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        while let Some(&(deadline, id, seq)) = self.deadlines.front() {
            let live = self.entries.get(&id).is_some_and(|e| e.seq == seq);
            if live && now_ms < deadline {
                break;
            }
            self.deadlines.pop_front();
            if !live {
                continue;
            }
            if let Some(e) = self.detach(id) {
                let waited_ms = now_ms.saturating_sub(e.enqueued_ms);
                let s = self.stats.at(e.priority);
                s.timed_out += 1;
                s.queued_ms += waited_ms;
                self.dirty = true;
                out.push(Action::Reject {
                    id,
                    priority: e.priority,
                    waited_ms,
                    rejection: self.rejection_timeout(),
                });
            }
        }
    }

    /// The next request in priority, then round-robin order.
    fn pop_next(&mut self) -> Option<(u32, Entry)> {
        loop {
            let (key, level) = self.levels.iter_mut().next()?;
            let key = *key;
            match level.pop() {
                Some(id) => {
                    if level.len == 0 {
                        self.levels.remove(&key);
                    }
                    if let Some(e) = self.entries.remove(&id) {
                        return Some((id, e));
                    }
                }
                None => {
                    self.levels.remove(&key);
                }
            }
        }
    }

    /// Lets every request held here go at once, in priority then round-robin order, and
    /// withdraws this worker's summary. For when flow control cannot judge the group at all (every
    /// endpoint stale, or none left): the requests go on to the scheduler, which applies
    /// `filter.failure_mode`, instead of waiting for a timeout that no snapshot can prevent. Takes
    /// no ledger tokens. If the summary cannot be written, the queue stays dirty and the next
    /// call (or tick) tries again.
    pub fn release_all(&mut self, store: &dyn SharedStore, now_ms: u64) -> Vec<Action> {
        let mut out = Vec::with_capacity(self.entries.len());
        while let Some((id, e)) = self.pop_next() {
            let waited_ms = now_ms.saturating_sub(e.enqueued_ms);
            let s = self.stats.at(e.priority);
            s.released += 1;
            s.queued_ms += waited_ms;
            out.push(Action::Release { id, priority: e.priority, waited_ms });
        }
        self.deadlines.clear();
        if !self.published && !self.dirty {
            return out;
        }
        let (me, ttl) = (self.worker_id, self.cfg.worker_ttl_ms);
        let mut withdraw = |rec: &mut Record| {
            let mut changed = rec.prune(now_ms, ttl, me);
            changed |= rec.set_own(me, now_ms, &[], &[], ttl);
            ((), changed)
        };
        match read_modify_write(store, &self.key, &mut withdraw) {
            Ok((_, rec)) => {
                self.global = rec.global_waiting(me, &[]);
                self.published = false;
                self.dirty = false;
            }
            Err(_) => self.dirty = true,
        }
        out
    }

    /// Called from the root context's tick (and whenever a new snapshot arrives): times out,
    /// releases what the shared ledger and the priority order allow, and publishes this
    /// worker's summary. `cap` is the group's capacity now.
    pub fn on_tick(&mut self, store: &dyn SharedStore, cap: &Capacity, now_ms: u64) -> Vec<Action> {
        let mut out = Vec::new();
        self.expire(now_ms, &mut out);
        if !self.needs_tick() {
            return out;
        }
        let local = self.local_summary();
        let view = self.plan_view();
        let (me, ttl) = (self.worker_id, self.cfg.worker_ttl_ms);
        let mut global = Vec::new();
        let mut own_after = Vec::new();
        let mut picks: Vec<(i32, String)> = Vec::new();
        let mut plan = |rec: &mut Record| -> ((), bool) {
            let mut changed = rec.prune(now_ms, ttl, me);
            changed |= rec.refresh_epoch(cap, now_ms, ttl);
            // Counts of tenants whose worker was just pruned go before they can hold others back.
            rec.settle_fairness();
            let remote_max = rec.remote(me).filter_map(WorkerEntry::max_priority).max();
            let mut sim = view.clone();
            picks.clear();
            if let Some(&(top, _)) = local.first() {
                // Only requests no other worker outranks may go: none at all when another worker
                // holds something above this worker's top priority.
                let floor = remote_max.unwrap_or(i32::MIN);
                sim.retain(|l| l.priority >= floor);
                // Below the reserve: nothing while the reduced thresholds are reached, else at
                // most the reduced headroom.
                let mut low_left = u32::MAX;
                if let Some(r) = cap.reserve {
                    if r.saturated {
                        sim.retain(|l| l.priority >= r.min_priority);
                    } else {
                        low_left = r.slots;
                    }
                }
                let eligible: u32 =
                    sim.iter().flat_map(|l| l.flows.iter()).fold(0u32, |a, (_, _, c)| a.saturating_add(*c));
                let peers = rec.remote(me).filter(|w| w.max_priority() == Some(top)).count();
                let peers = u32::try_from(peers).unwrap_or(u32::MAX).saturating_add(1);
                let share = rec.left.div_ceil(peers);
                let budget = rec.left.min(share).min(eligible);
                // Tenant fairness over all workers (crate::flow::fairshare), waived once a refusal
                // has left tokens unused for GRACE_MS.
                let waived =
                    rec.declined_ms != 0 && now_ms.saturating_sub(rec.declined_ms) >= fairshare::GRACE_MS;
                let mut declined = false;
                for _ in 0..budget {
                    if low_left == 0 {
                        if let Some(r) = cap.reserve {
                            sim.retain(|l| l.priority >= r.min_priority);
                        }
                    }
                    let served = &rec.served;
                    let may = |p: i32, b: u16| waived || served.allows(p, b);
                    match plan_take(&mut sim, &may) {
                        Some((p, flow, b)) => {
                            if cap.reserve.is_some_and(|r| p < r.min_priority) {
                                low_left = low_left.saturating_sub(1);
                            }
                            rec.served.charge(p, b);
                            picks.push((p, flow));
                        }
                        None => {
                            // A refusal for fairness only when something eligible is left
                            // (not when the reserve emptied the plan).
                            declined = sim.iter().any(|l| !l.flows.is_empty());
                            break;
                        }
                    }
                }
                let k = u32::try_from(picks.len()).unwrap_or(u32::MAX);
                rec.left = rec.left.saturating_sub(k);
                if declined && rec.declined_ms == 0 {
                    rec.declined_ms = now_ms.max(1);
                    changed = true;
                } else if !declined && k > 0 {
                    rec.declined_ms = 0;
                }
                changed |= k > 0;
            }
            // No token left unused: the grace clock stops.
            if rec.left == 0 && rec.declined_ms != 0 {
                rec.declined_ms = 0;
                changed = true;
            }
            // What stays held: the levels this plan could not reach, plus what it left.
            let mut after: Vec<PlanLevel> =
                view.iter().filter(|l| !sim.iter().any(|x| x.priority == l.priority)).cloned().collect();
            after.extend(sim.iter().cloned());
            crate::base::sorting::sort_by_key(&mut after, |l| Reverse(l.priority));
            own_after = plan_summary(&after);
            let tenants_after = plan_tenants(&after);
            global = rec.global_waiting(me, &own_after);
            changed |= rec.set_own(me, now_ms, &own_after, &tenants_after, ttl);
            ((), changed)
        };
        if read_modify_write(store, &self.key, &mut plan).is_err() {
            // Nothing is released without a token; stay dirty and try again next tick.
            self.dirty = true;
            return out;
        }
        self.global = global;
        self.published = !own_after.is_empty();
        self.dirty = false;
        for (p, flow) in picks {
            let Some(level) = self.levels.get_mut(&Reverse(p)) else { continue };
            let Some(id) = level.pop_flow(&flow) else { continue };
            if level.len == 0 {
                self.levels.remove(&Reverse(p));
            }
            let Some(e) = self.entries.remove(&id) else { continue };
            let waited_ms = now_ms.saturating_sub(e.enqueued_ms);
            let s = self.stats.at(e.priority);
            s.released += 1;
            s.queued_ms += waited_ms;
            out.push(Action::Release { id, priority: e.priority, waited_ms });
        }
        out
    }
}

#[cfg(test)]
mod tests;
