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
mod tests {
    use super::*;
    use crate::base::ports::MemStore;

    fn cfg() -> FlowControlConfig {
        FlowControlConfig { enabled: true, max_wait_ms: 1000, max_queue: 100, ..FlowControlConfig::default() }
    }
    const SAT: Capacity = Capacity { epoch: 1, slots: 0, saturated: true, reserve: None };
    fn room(epoch: u64, slots: u32) -> Capacity {
        Capacity { epoch, slots, saturated: false, reserve: None }
    }
    fn t(id: u32, priority: i32, flow: &str) -> Ticket<'_> {
        Ticket { id, priority, fairness_id: flow }
    }
    fn held(a: &Admission) -> bool {
        matches!(a, Admission::Held { evicted: None })
    }
    fn released(actions: &[Action]) -> Vec<u32> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Release { id, .. } => Some(*id),
                Action::Reject { .. } => None,
            })
            .collect()
    }
    fn record(store: &MemStore, group: &str) -> Record {
        Record::decode(&store.get(&shared_key(group)).unwrap().unwrap().0)
    }

    #[test]
    fn passes_without_shared_writes_when_nobody_waits() {
        let s = MemStore::new();
        let mut q = FlowQueue::new(&cfg(), "m", 1);
        assert_eq!(q.admit(&s, &t(1, 0, "a"), &room(1, 5), 0), Admission::Pass);
        // A sheddable request also passes while there is room.
        assert_eq!(q.admit(&s, &t(2, -10, "a"), &room(1, 5), 0), Admission::Pass);
        assert_eq!(s.key_count(), 0, "the fast path must not write shared data");
        assert!(!q.needs_tick());
        assert!(q.on_tick(&s, &room(1, 5), 10).is_empty());
        assert_eq!(s.key_count(), 0);
    }

    #[test]
    fn sheddable_rejected_at_once_while_saturated() {
        let s = MemStore::new();
        let mut q = FlowQueue::new(&cfg(), "m", 1);
        let Admission::Reject(r) = q.admit(&s, &t(1, -1, "a"), &SAT, 0) else { panic!("not rejected") };
        assert_eq!((r.status, r.code, r.retry_after_s), (429, "request_shed", Some(1)));
        let body: serde_json::Value = serde_json::from_slice(&r.body()).unwrap();
        assert_eq!(body["error"]["code"], "request_shed");
        // Priority 0 is not sheddable: it is held.
        assert!(held(&q.admit(&s, &t(2, 0, "a"), &SAT, 0)));
        let st = q.take_stats();
        assert_eq!(st.by_priority[&-1].shed, 1);
        assert_eq!(st.by_priority[&0].held, 1);
    }

    #[test]
    fn releases_in_strict_priority_order() {
        let s = MemStore::new();
        let mut q = FlowQueue::new(&cfg(), "m", 1);
        // (No negative priority: a sheddable request is never held.)
        for (id, p) in [(1, 10), (2, 20), (3, 5), (4, 15), (5, 20), (6, 10)] {
            assert!(held(&q.admit(&s, &t(id, p, "a"), &SAT, 0)), "id {id}");
        }
        // Epoch 2 brings 3 tokens: the two 20s (in arrival order) then the 15.
        let a = q.on_tick(&s, &room(2, 3), 10);
        assert_eq!(released(&a), vec![2, 5, 4]);
        // Same epoch again: no tokens left, nothing more.
        assert!(q.on_tick(&s, &room(2, 3), 20).is_empty());
        // Epoch 3 with plenty: the 10s in order, then the 5.
        let a = q.on_tick(&s, &room(3, 10), 30);
        assert_eq!(released(&a), vec![1, 6, 3]);
        assert!(q.is_empty());
        // The worker withdrew its summary.
        assert!(record(&s, "m").workers.is_empty());
        assert!(!q.needs_tick());
    }

    #[test]
    fn round_robin_across_tenants_within_a_priority() {
        let s = MemStore::new();
        let mut q = FlowQueue::new(&cfg(), "m", 1);
        // Tenant a sends 3, then b 1, then c 2, all priority 0; plus one priority 1 from c last.
        for (id, flow) in [(1, "a"), (2, "a"), (3, "a"), (4, "b"), (5, "c"), (6, "c")] {
            assert!(held(&q.admit(&s, &t(id, 0, flow), &SAT, 0)));
        }
        assert!(held(&q.admit(&s, &t(7, 1, "c"), &SAT, 0)));
        // Priority 1 first (7), then one per tenant per round in first-arrival order of the
        // tenants: a1 b4 c5, then a2 c6, then a3.
        let a = q.on_tick(&s, &room(2, 100), 10);
        assert_eq!(released(&a), vec![7, 1, 4, 5, 2, 6, 3]);
    }

    #[test]
    fn round_robin_continues_across_ticks() {
        let s = MemStore::new();
        let mut q = FlowQueue::new(&cfg(), "m", 1);
        for (id, flow) in [(1, "a"), (2, "a"), (3, "b"), (4, "b")] {
            assert!(held(&q.admit(&s, &t(id, 0, flow), &SAT, 0)));
        }
        // One token per epoch: a, b, a, b; a heavy tenant does not get two in a row.
        let mut order = Vec::new();
        for epoch in 2..6 {
            order.extend(released(&q.on_tick(&s, &room(epoch, 1), epoch * 10)));
        }
        assert_eq!(order, vec![1, 3, 2, 4]);
    }

    #[test]
    fn timeouts_reject_with_503_after_max_wait() {
        let s = MemStore::new();
        let mut q = FlowQueue::new(&cfg(), "m", 1);
        assert!(held(&q.admit(&s, &t(1, 0, "a"), &SAT, 0)));
        assert!(held(&q.admit(&s, &t(2, 5, "a"), &SAT, 500)));
        // 999 ms: nobody has waited 1000 ms yet.
        assert!(q.on_tick(&s, &SAT, 999).is_empty());
        // 1000 ms: id 1 (held at 0) times out; priority does not protect from the deadline.
        let a = q.on_tick(&s, &SAT, 1000);
        assert_eq!(a.len(), 1);
        let Action::Reject { id, priority, waited_ms, rejection } = &a[0] else { panic!("{a:?}") };
        assert_eq!((*id, *priority, *waited_ms), (1, 0, 1000));
        assert_eq!(
            (rejection.status, rejection.code, rejection.retry_after_s),
            (503, "queue_timeout", Some(1))
        );
        // id 2 held at 500 times out at 1500.
        assert!(q.on_tick(&s, &SAT, 1499).is_empty());
        let a = q.on_tick(&s, &SAT, 1500);
        assert!(matches!(a.as_slice(), [Action::Reject { id: 2, waited_ms: 1000, .. }]));
        let st = q.take_stats();
        assert_eq!(st.by_priority[&0].timed_out, 1);
        assert_eq!(st.by_priority[&5].timed_out, 1);
        assert_eq!(st.by_priority[&5].queued_ms, 1000);
        assert!(record(&s, "m").workers.is_empty());
    }

    #[test]
    fn queue_limit_rejects_with_429_or_evicts_lower_priority() {
        let s = MemStore::new();
        let mut q = FlowQueue::new(&FlowControlConfig { max_queue: 2, ..cfg() }, "m", 1);
        assert!(held(&q.admit(&s, &t(1, 0, "a"), &SAT, 0)));
        assert!(held(&q.admit(&s, &t(2, 0, "a"), &SAT, 1)));
        // Full, and nothing held is below 0: 429.
        let Admission::Reject(r) = q.admit(&s, &t(3, 0, "a"), &SAT, 2) else { panic!() };
        assert_eq!((r.status, r.code, r.retry_after_s), (429, "queue_full", Some(1)));
        // A priority-5 request pushes out the newest priority-0 one (id 2, held at 1 ms).
        let Admission::Held { evicted: Some((2, r)) } = q.admit(&s, &t(4, 5, "a"), &SAT, 3) else { panic!() };
        assert_eq!(r.code, "queue_full");
        assert_eq!(q.len(), 2);
        let a = q.on_tick(&s, &room(2, 10), 4);
        assert_eq!(released(&a), vec![4, 1]);
        let st = q.take_stats();
        assert_eq!(st.by_priority[&0].queue_full, 2); // id 3 refused, id 2 evicted
        assert_eq!(st.by_priority[&0].queued_ms, 2 + 4); // id 2: 1→3, id 1: 0→4
    }

    #[test]
    fn a_finish_credits_one_token_up_to_the_live_headroom() {
        const NOW: u64 = 1_000;
        let store = MemStore::new();
        let mut q = FlowQueue::new(&cfg(), "m", 1);
        // Nobody waits: no write, no key created.
        assert_eq!(credit_finish(&store, "m", &room(1, 3), 2000, NOW), Ok(false));
        assert_eq!(store.key_count(), 0);
        // Hold two requests while saturated (epoch 1, no tokens).
        assert!(held(&q.admit(&store, &t(1, 0, "a"), &SAT, NOW)));
        assert!(held(&q.admit(&store, &t(2, 0, "a"), &SAT, NOW)));
        assert!(released(&q.on_tick(&store, &SAT, NOW + 10)).is_empty());
        // A finish while the group is still saturated (live estimate still full): nothing.
        assert_eq!(credit_finish(&store, "m", &SAT, 2000, NOW + 20), Ok(false));
        // A finish frees one slot in the same epoch: one token, and the next tick releases one.
        let live = Capacity { epoch: 1, slots: 1, saturated: false, reserve: None };
        assert_eq!(credit_finish(&store, "m", &live, 2000, NOW + 30), Ok(true));
        assert_eq!(record(&store, "m").left, 1);
        // A second credit with still one slot of headroom does not exceed it.
        assert_eq!(credit_finish(&store, "m", &live, 2000, NOW + 31), Ok(false));
        assert_eq!(record(&store, "m").left, 1);
        assert_eq!(released(&q.on_tick(&store, &live, NOW + 40)), vec![1]);
        // Nothing left; the next finish gives the last held request its token.
        assert!(released(&q.on_tick(&store, &live, NOW + 50)).is_empty());
        assert_eq!(credit_finish(&store, "m", &live, 2000, NOW + 60), Ok(true));
        assert_eq!(released(&q.on_tick(&store, &live, NOW + 70)), vec![2]);
    }

    #[test]
    fn cancel_frees_the_place() {
        let s = MemStore::new();
        let mut q = FlowQueue::new(&FlowControlConfig { max_queue: 1, ..cfg() }, "m", 1);
        assert!(held(&q.admit(&s, &t(1, 0, "a"), &SAT, 0)));
        assert!(matches!(q.admit(&s, &t(2, 0, "a"), &SAT, 0), Admission::Reject(_)));
        assert!(q.cancel(1, 40));
        assert!(!q.cancel(1, 40), "a second cancel is a no-op");
        // The next tick withdraws the summary; the timeout of id 1 never fires.
        assert!(q.on_tick(&s, &SAT, 50).is_empty());
        assert!(record(&s, "m").workers.is_empty());
        assert!(held(&q.admit(&s, &t(2, 0, "a"), &SAT, 60)));
        assert!(q.on_tick(&s, &SAT, 1000).is_empty(), "id 1 must not time out");
        let st = q.take_stats();
        assert_eq!((st.by_priority[&0].cancelled, st.by_priority[&0].queued_ms), (1, 40));
        // Cancelling a released request is harmless.
        let a = q.on_tick(&s, &room(2, 1), 1001);
        assert_eq!(released(&a), vec![2]);
        assert!(!q.cancel(2, 1002));
    }

    #[test]
    fn arrivals_queue_behind_waiters_of_equal_or_higher_priority() {
        let s = MemStore::new();
        let mut q = FlowQueue::new(&cfg(), "m", 1);
        assert!(held(&q.admit(&s, &t(1, 5, "a"), &SAT, 0)));
        // Room now, but a priority-5 request waits: a priority-5 arrival waits behind it.
        assert!(held(&q.admit(&s, &t(2, 5, "a"), &room(2, 3), 1)));
        // A priority-9 arrival jumps ahead and takes a token (3 → 2) instead of waiting.
        assert_eq!(q.admit(&s, &t(3, 9, "a"), &room(2, 3), 2), Admission::Pass);
        assert_eq!(record(&s, "m").left, 2);
        let a = q.on_tick(&s, &room(2, 3), 3);
        assert_eq!(released(&a), vec![1, 2]);
        assert_eq!(record(&s, "m").left, 0);
        // Out of tokens in this epoch, and something waits: a high arrival is held, not passed.
        assert!(held(&q.admit(&s, &t(4, 0, "a"), &SAT, 4)));
        assert!(held(&q.admit(&s, &t(5, 9, "a"), &room(2, 3), 5)));
    }

    #[test]
    fn a_sheddable_request_is_never_held() {
        let s = MemStore::new();
        let mut w1 = FlowQueue::new(&cfg(), "m", 1);
        let mut w2 = FlowQueue::new(&cfg(), "m", 2);
        // A standard request waits on worker 2.
        assert!(held(&w2.admit(&s, &t(1, 0, "a"), &SAT, 0)));
        // Room now, but a priority-0 request waits: a sheddable arrival on worker 1 is shed at
        // once (before: held behind it, and served later).
        let Admission::Reject(r) = w1.admit(&s, &t(2, -5, "b"), &room(2, 3), 1) else { panic!("not shed") };
        assert_eq!((r.status, r.code), (429, "request_shed"));
        assert_eq!(w1.take_stats().by_priority[&-5].shed, 1);
        assert!(w1.is_empty());
        // A non-sheddable request in the same spot is held behind it.
        assert!(held(&w1.admit(&s, &t(3, 0, "b"), &room(2, 3), 2)));
        // Once nobody waits (both released), a sheddable request with room goes on.
        assert_eq!(released(&w2.on_tick(&s, &room(3, 5), 10)), vec![1]);
        assert_eq!(released(&w1.on_tick(&s, &room(3, 5), 11)), vec![3]);
        assert_eq!(w1.admit(&s, &t(4, -5, "b"), &room(3, 5), 12), Admission::Pass);
    }

    #[test]
    fn deadline_bookkeeping_stays_bounded() {
        let s = MemStore::new();
        let mut q = FlowQueue::new(&FlowControlConfig { max_wait_ms: 1_000_000, ..cfg() }, "m", 1);
        // One request stays held the whole time (its deadline is at the front); 1000 others are
        // held and cancelled behind it.
        assert!(held(&q.admit(&s, &t(1, 0, "a"), &SAT, 0)));
        for id in 2..1002 {
            assert!(held(&q.admit(&s, &t(id, 0, "a"), &SAT, 1)));
            assert!(q.cancel(id, 2));
        }
        // Compaction runs when more than 2 × 2 + 64 = 68 deadlines exist for 2 live entries.
        assert!(q.deadlines.len() <= 2 * 2 + 64 + 1, "{}", q.deadlines.len());
        // The survivor still times out at its own deadline.
        assert!(matches!(q.on_tick(&s, &SAT, 1_000_000).as_slice(), [Action::Reject { id: 1, .. }]));
    }

    #[test]
    fn disabled_never_holds() {
        let s = MemStore::new();
        let mut q = FlowQueue::new(&FlowControlConfig { enabled: false, ..cfg() }, "m", 1);
        assert_eq!(q.admit(&s, &t(1, 0, "a"), &SAT, 0), Admission::Pass);
        assert!(matches!(q.admit(&s, &t(2, -1, "a"), &SAT, 0), Admission::Reject(_)));
        assert_eq!(s.key_count(), 0);
    }

    // ---- two workers on one store ---------------------------------------------------------

    #[test]
    fn low_priority_worker_waits_for_higher_priority_elsewhere() {
        let s = MemStore::new();
        let mut w1 = FlowQueue::new(&cfg(), "m", 1);
        let mut w2 = FlowQueue::new(&cfg(), "m", 2);
        assert!(held(&w1.admit(&s, &t(1, 0, "a"), &SAT, 0)));
        assert!(held(&w2.admit(&s, &t(1, 10, "a"), &SAT, 0)));
        // W1 ticks first with 5 tokens, but W2 holds a 10: W1 releases nothing.
        assert!(w1.on_tick(&s, &room(2, 5), 10).is_empty());
        assert_eq!(record(&s, "m").left, 5);
        // W2 releases its 10 (5 → 4) and withdraws its summary.
        assert_eq!(released(&w2.on_tick(&s, &room(2, 5), 11)), vec![1]);
        assert_eq!(record(&s, "m").left, 4);
        // Now W1 may go.
        assert_eq!(released(&w1.on_tick(&s, &room(2, 5), 12)), vec![1]);
        assert_eq!(record(&s, "m").left, 3);
    }

    #[test]
    fn tokens_are_shared_not_multiplied_across_workers() {
        let s = MemStore::new();
        let mut w1 = FlowQueue::new(&cfg(), "m", 1);
        let mut w2 = FlowQueue::new(&cfg(), "m", 2);
        for id in 1..=5 {
            assert!(held(&w1.admit(&s, &t(id, 0, "a"), &SAT, 0)));
            assert!(held(&w2.admit(&s, &t(id, 0, "a"), &SAT, 0)));
        }
        // Epoch 2 has 3 slots. W1 ticks: one peer at its top priority → ceil(3/2) = 2.
        assert_eq!(w1.on_tick(&s, &room(2, 3), 10).len(), 2);
        // W2: 1 left, ceil(1/2) = 1.
        assert_eq!(w2.on_tick(&s, &room(2, 3), 11).len(), 1);
        // Both again in the same epoch: 0 left. 3 released in total, not 3 per worker.
        assert!(w1.on_tick(&s, &room(2, 3), 12).is_empty());
        assert!(w2.on_tick(&s, &room(2, 3), 13).is_empty());
        // A worker with an older snapshot (epoch 1) must not refill the ledger.
        assert!(w1.on_tick(&s, &room(1, 50), 14).is_empty());
        // Epoch 3, 4 slots: W2 ticks first this time and takes ceil(4/2) = 2. The share is of
        // what is left, so W1 takes ceil(2/2) = 1 now and the last one at its next tick.
        assert_eq!(w2.on_tick(&s, &room(3, 4), 20).len(), 2);
        assert_eq!(w1.on_tick(&s, &room(3, 4), 21).len(), 1);
        assert_eq!(w1.on_tick(&s, &room(3, 4), 22).len(), 1);
        assert_eq!(record(&s, "m").left, 0);
        // The summaries track what is left: W1 5 - 2 - 1 - 1 = 1, W2 5 - 1 - 2 = 2.
        let mut w: Vec<(u64, Vec<(i32, u32)>)> =
            record(&s, "m").workers.into_iter().map(|w| (w.id, w.q)).collect();
        w.sort();
        assert_eq!(w, vec![(1, vec![(0, 1)]), (2, vec![(0, 2)])]);
        assert_eq!(w1.global_waiting(), &[(0, 3)]);
    }

    #[test]
    fn queue_limit_counts_every_worker() {
        let s = MemStore::new();
        let c = FlowControlConfig { max_queue: 3, ..cfg() };
        let mut w1 = FlowQueue::new(&c, "m", 1);
        let mut w2 = FlowQueue::new(&c, "m", 2);
        assert!(held(&w1.admit(&s, &t(1, 0, "a"), &SAT, 0)));
        assert!(held(&w1.admit(&s, &t(2, 0, "a"), &SAT, 0)));
        assert!(held(&w2.admit(&s, &t(1, 0, "a"), &SAT, 0)));
        // 3 held over both workers: the fourth is refused on W2, which holds nothing lower.
        assert!(matches!(w2.admit(&s, &t(2, 0, "a"), &SAT, 0), Admission::Reject(r) if r.status == 429));
        // A cancel on W1, published at W1's tick, makes room for W2.
        assert!(w1.cancel(2, 5));
        w1.on_tick(&s, &SAT, 6);
        assert!(held(&w2.admit(&s, &t(2, 0, "a"), &SAT, 7)));
        // A different group has its own queue and limit.
        let mut other = FlowQueue::new(&c, "other-model", 1);
        assert!(held(&other.admit(&s, &t(9, 0, "a"), &SAT, 8)));
        assert_eq!(s.keys(), vec![shared_key("m"), shared_key("other-model")]);
    }

    #[test]
    fn a_silent_worker_stops_blocking_after_its_ttl() {
        let s = MemStore::new();
        let long = FlowControlConfig { max_wait_ms: 10_000, ..cfg() };
        let mut w1 = FlowQueue::new(&long, "m", 1);
        let mut w2 = FlowQueue::new(&long, "m", 2);
        assert!(held(&w2.admit(&s, &t(1, 10, "a"), &SAT, 0)));
        assert!(held(&w1.admit(&s, &t(1, 0, "a"), &SAT, 100)));
        // W2's VM is gone: it never ticks again. Until 2000 ms (worker_ttl_ms) after its last
        // write at 0 ms, it still blocks W1's lower-priority request.
        assert!(w1.on_tick(&s, &room(2, 5), 1999).is_empty());
        // At 2000 ms W2 is pruned and W1 releases.
        assert_eq!(released(&w1.on_tick(&s, &room(2, 5), 2000)), vec![1]);
        assert!(record(&s, "m").workers.is_empty(), "dead worker pruned, W1 withdrawn");
    }

    #[test]
    fn heartbeats_keep_a_live_holder_ahead() {
        let s = MemStore::new();
        let long = FlowControlConfig { max_wait_ms: 10_000, ..cfg() };
        let mut w1 = FlowQueue::new(&long, "m", 1);
        let mut w2 = FlowQueue::new(&long, "m", 2);
        assert!(held(&w2.admit(&s, &t(1, 10, "a"), &SAT, 0)));
        assert!(held(&w1.admit(&s, &t(1, 0, "a"), &SAT, 0)));
        let hb = |s: &MemStore| record(s, "m").workers.iter().find(|w| w.id == 2).map(|w| w.hb);
        // W2 keeps ticking (saturated). Its summary does not change, so it writes only to renew
        // its heartbeat, every ttl/3 = 666 ms: not at 600, then at 700.
        assert!(w2.on_tick(&s, &SAT, 600).is_empty());
        assert_eq!(hb(&s), Some(0));
        assert!(w2.on_tick(&s, &SAT, 700).is_empty());
        assert_eq!(hb(&s), Some(700));
        for now in (800..=3000).step_by(100) {
            assert!(w2.on_tick(&s, &SAT, now).is_empty());
            assert!(w1.on_tick(&s, &SAT, now).is_empty());
        }
        // At 3000 ms W2 is alive (last write within 666 ms), so W1 still may not release.
        assert!(w1.on_tick(&s, &room(2, 5), 3000).is_empty());
        assert_eq!(released(&w2.on_tick(&s, &room(2, 5), 3001)), vec![1]);
        assert_eq!(released(&w1.on_tick(&s, &room(2, 5), 3002)), vec![1]);
    }

    #[test]
    fn an_abandoned_epoch_yields_to_a_restarted_poller() {
        let s = MemStore::new();
        let long = FlowControlConfig { max_wait_ms: 60_000, ..cfg() };
        let mut q = FlowQueue::new(&long, "m", 1);
        assert!(held(&q.admit(&s, &t(1, 0, "a"), &SAT, 0)));
        assert!(held(&q.admit(&s, &t(2, 0, "a"), &SAT, 0)));
        assert_eq!(q.on_tick(&s, &room(50, 1), 10).len(), 1);
        // The poller restarts at version 1. Within worker_ttl_ms of the last reset (at 10 ms)
        // the old epoch stands; from 2010 ms on, the new numbering takes over.
        assert!(q.on_tick(&s, &room(1, 1), 2009).is_empty());
        assert_eq!(q.on_tick(&s, &room(1, 1), 2010).len(), 1);
        assert_eq!(record(&s, "m").epoch, 1);
    }

    #[test]
    fn unreadable_record_is_reset_and_store_errors_release_nothing() {
        let s = MemStore::new();
        s.set(&shared_key("m"), b"not json", 0).unwrap();
        let mut q = FlowQueue::new(&cfg(), "m", 1);
        assert!(held(&q.admit(&s, &t(1, 0, "a"), &SAT, 0)));
        assert_eq!(record(&s, "m").workers.len(), 1);

        struct Broken;
        impl SharedStore for Broken {
            fn get(&self, _: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
                Err(StoreError::Host("down".into()))
            }
            fn set(&self, _: &str, _: &[u8], _: u32) -> Result<(), StoreError> {
                Err(StoreError::Host("down".into()))
            }
        }
        let mut q = FlowQueue::new(&cfg(), "m", 1);
        // Without a shared view, a request with room and nobody waiting locally passes...
        assert_eq!(q.admit(&Broken, &t(1, 0, "a"), &room(1, 5), 0), Admission::Pass);
        // ...one that must wait is held locally...
        assert!(held(&q.admit(&Broken, &t(2, 0, "a"), &SAT, 0)));
        // ...and is never released without the ledger, only timed out.
        assert!(q.on_tick(&Broken, &room(2, 5), 10).is_empty());
        assert!(matches!(q.on_tick(&Broken, &room(2, 5), 1000).as_slice(), [Action::Reject { id: 2, .. }]));
    }

    #[test]
    fn cas_conflicts_are_retried_not_lost() {
        // A store that reports a mismatch on the first write of each key, as if another worker
        // wrote in between; the update must still land.
        struct Racy {
            inner: MemStore,
            failed: std::cell::Cell<bool>,
        }
        impl SharedStore for Racy {
            fn get(&self, k: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
                self.inner.get(k)
            }
            fn set(&self, k: &str, v: &[u8], cas: u32) -> Result<(), StoreError> {
                if !self.failed.replace(true) {
                    return Err(StoreError::CasMismatch);
                }
                self.inner.set(k, v, cas)
            }
        }
        let s = Racy { inner: MemStore::new(), failed: std::cell::Cell::new(false) };
        let mut q = FlowQueue::new(&cfg(), "m", 1);
        assert!(held(&q.admit(&s, &t(1, 0, "a"), &SAT, 0)));
        let rec = Record::decode(&s.inner.get(&shared_key("m")).unwrap().unwrap().0);
        assert_eq!(
            rec.workers,
            vec![WorkerEntry { id: 1, hb: 0, q: vec![(0, 1)], t: vec![(0, fairshare::bucket("a"))] }]
        );
    }

    #[test]
    fn two_first_writers_of_a_group_key_both_count() {
        // Worker 1 reads the group key absent; before it writes, worker 2 creates the key and
        // records its own hold. On Envoy's semantics a blind first write by worker 1 would erase
        // worker 2's entry; with create-then-CAS both holds are in the record.
        struct Interleaved<'a> {
            inner: &'a MemStore,
            other: std::cell::RefCell<Option<FlowQueue>>,
        }
        impl SharedStore for Interleaved<'_> {
            fn get(&self, k: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
                let r = self.inner.get(k);
                if let Some(mut w2) = self.other.borrow_mut().take() {
                    assert!(held(&w2.admit(self.inner, &t(7, 0, "b"), &SAT, 0)));
                }
                r
            }
            fn set(&self, k: &str, v: &[u8], cas: u32) -> Result<(), StoreError> {
                self.inner.set(k, v, cas)
            }
        }
        let s = MemStore::new();
        let racing =
            Interleaved { inner: &s, other: std::cell::RefCell::new(Some(FlowQueue::new(&cfg(), "m", 2))) };
        let mut w1 = FlowQueue::new(&cfg(), "m", 1);
        assert!(held(&w1.admit(&racing, &t(1, 0, "a"), &SAT, 0)));
        let mut ids: Vec<u64> = record(&s, "m").workers.iter().map(|w| w.id).collect();
        ids.sort_unstable();
        assert_eq!(ids, vec![1, 2]);
    }

    #[test]
    fn release_all_lets_everything_go_and_withdraws() {
        let s = MemStore::new();
        let mut w1 = FlowQueue::new(&cfg(), "m", 1);
        let mut w2 = FlowQueue::new(&cfg(), "m", 2);
        assert!(held(&w1.admit(&s, &t(1, 0, "a"), &SAT, 0)));
        assert!(held(&w1.admit(&s, &t(2, 7, "b"), &SAT, 5)));
        assert!(held(&w1.admit(&s, &t(3, 0, "b"), &SAT, 6)));
        assert!(held(&w2.admit(&s, &t(9, 0, "a"), &SAT, 0)));
        // Priority order, then round-robin: 2 (p7), then 1 (tenant a), 3 (tenant b).
        let a = w1.release_all(&s, 100);
        assert_eq!(released(&a), vec![2, 1, 3]);
        assert_eq!(a[0], Action::Release { id: 2, priority: 7, waited_ms: 95 });
        assert!(w1.is_empty() && !w1.needs_tick());
        // W1's summary is withdrawn; W2's stays.
        assert_eq!(
            record(&s, "m").workers,
            vec![WorkerEntry { id: 2, hb: 0, q: vec![(0, 1)], t: vec![(0, fairshare::bucket("a"))] }]
        );
        assert_eq!(w1.global_waiting(), &[(0, 1)]);
        // The ledger was not touched, and nothing is left to time out.
        assert_eq!(record(&s, "m").left, 0);
        assert!(w1.on_tick(&s, &SAT, 5000).is_empty());
        let st = w1.take_stats();
        assert_eq!((st.by_priority[&0].released, st.by_priority[&0].queued_ms), (2, 100 + 94));
        assert_eq!(st.by_priority[&7].released, 1);
        // Nothing held and nothing published: no write at all.
        let before = s.get(&shared_key("m")).unwrap();
        assert!(w1.release_all(&s, 200).is_empty());
        assert_eq!(s.get(&shared_key("m")).unwrap(), before);
    }

    #[test]
    fn stats_per_priority() {
        let s = MemStore::new();
        let mut q = FlowQueue::new(&cfg(), "m", 1);
        assert_eq!(q.admit(&s, &t(1, 3, "a"), &room(1, 1), 0), Admission::Pass);
        assert!(held(&q.admit(&s, &t(2, 3, "a"), &SAT, 100)));
        assert!(held(&q.admit(&s, &t(3, 3, "a"), &SAT, 100)));
        assert_eq!(released(&q.on_tick(&s, &room(2, 1), 350)), vec![2]);
        let st = q.take_stats();
        assert_eq!(
            st.by_priority[&3],
            PriorityStats { passed: 1, held: 2, released: 1, queued_ms: 250, ..PriorityStats::default() }
        );
        // take_stats resets: the next call only has what happened since.
        assert_eq!(q.take_stats(), FlowStats::default());
        q.cancel(3, 400);
        assert_eq!(q.take_stats().by_priority[&3].cancelled, 1);
    }

    /// W1 holds six requests of tenant h; W2 holds two of tenant l, held later. Every finish is
    /// seen on W1 (h's requests run there), which credits one token and runs its release check
    /// at once; W2 runs its check at its next tick, 10 ms later. Returns the release order.
    fn heavy_vs_light(w2_ticks: bool) -> Vec<(u8, u32)> {
        let s = MemStore::new();
        let c = FlowControlConfig { max_wait_ms: 60_000, ..cfg() };
        let mut w1 = FlowQueue::new(&c, "m", 1);
        let mut w2 = FlowQueue::new(&c, "m", 2);
        for id in 1..=6 {
            assert!(held(&w1.admit(&s, &t(id, 0, "h"), &SAT, 0)));
        }
        for id in 11..=12 {
            assert!(held(&w2.admit(&s, &t(id, 0, "l"), &SAT, 5)));
        }
        let mut order = Vec::new();
        for round in 1..=12u64 {
            let now = 100 * round;
            credit_finish(&s, "m", &room(1, 1), c.worker_ttl_ms, now).unwrap();
            order.extend(released(&w1.on_tick(&s, &room(1, 1), now)).into_iter().map(|id| (1, id)));
            if w2_ticks {
                order.extend(released(&w2.on_tick(&s, &room(1, 1), now + 10)).into_iter().map(|id| (2, id)));
            }
        }
        order
    }

    #[test]
    fn a_heavy_tenant_on_one_worker_cannot_starve_a_light_one_on_another() {
        // Without the shared counts W1 would spend every token it credits itself (its share of
        // one token is one): h1..h6, then l's two. With them h may run SLACK = 1 release ahead
        // of l, then W1 leaves the token to W2.
        assert_eq!(
            heavy_vs_light(true),
            vec![(1, 1), (1, 2), (2, 11), (1, 3), (2, 12), (1, 4), (1, 5), (1, 6)]
        );
    }

    #[test]
    fn fairness_waits_for_a_silent_worker_only_for_the_grace_period() {
        // W2 never ticks (slow, or its VM is gone but not yet expired). W1 releases h1 and h2,
        // is refused at 300 ms, and the refusal is waived GRACE_MS (200 ms) later: at 500 ms.
        // After each release the grace clock restarts, so h goes every third round (500, 800,
        // 1100 ms) until W2 expires (worker_ttl_ms) or ticks again.
        let order = heavy_vs_light(false);
        assert_eq!(order, vec![(1, 1), (1, 2), (1, 3), (1, 4), (1, 5)]);
        let s = MemStore::new();
        let mut w1 = FlowQueue::new(&cfg(), "m", 1);
        let mut w2 = FlowQueue::new(&cfg(), "m", 2);
        for id in 1..=3 {
            assert!(held(&w1.admit(&s, &t(id, 0, "h"), &SAT, 0)));
        }
        assert!(held(&w2.admit(&s, &t(11, 0, "l"), &SAT, 0)));
        let mut at = Vec::new();
        for now in (100..=700).step_by(50) {
            credit_finish(&s, "m", &room(1, 1), 2000, now).unwrap();
            if !released(&w1.on_tick(&s, &room(1, 1), now)).is_empty() {
                at.push(now);
            }
        }
        assert_eq!(at, vec![100, 150, 400], "h1 and h2 at once, h3 after the 200 ms grace from 200 ms");
        assert_eq!(record(&s, "m").declined_ms, 0, "the grace clock stopped when h3 went");
    }

    #[test]
    fn fairness_counts_are_bounded_and_go_with_the_tenants() {
        let s = MemStore::new();
        let mut w1 = FlowQueue::new(&cfg(), "m", 1);
        for id in 1..=80u32 {
            let flow = format!("tenant-{id}");
            assert!(held(&w1.admit(&s, &t(id, 0, &flow), &SAT, 0)));
        }
        let rec = record(&s, "m");
        assert_eq!(rec.workers[0].t.len(), fairshare::MAX_PUBLISHED);
        assert!(rec.served.0.len() <= fairshare::MAX_PUBLISHED);
        // Everything released: no worker, no counts, no grace clock.
        let mut n = 0;
        for epoch in 2..20 {
            n += w1.on_tick(&s, &room(epoch, 10), 10 * epoch).len();
        }
        assert_eq!(n, 80);
        let rec = record(&s, "m");
        assert!(rec.workers.is_empty() && rec.served.is_empty() && rec.declined_ms == 0, "{rec:?}");
    }

    #[test]
    fn a_reserve_keeps_headroom_for_high_priorities() {
        let s = MemStore::new();
        let mut q = FlowQueue::new(&cfg(), "m", 1);
        // Room for all (2 slots), but below priority 10 the reduced thresholds are reached.
        let low_full =
            Capacity { reserve: Some(Reserve { min_priority: 10, slots: 0, saturated: true }), ..room(1, 2) };
        assert!(held(&q.admit(&s, &t(1, 0, "a"), &low_full, 0)), "standard waits");
        assert_eq!(q.admit(&s, &t(2, 15, "a"), &low_full, 0), Admission::Pass, "premium takes the reserve");
        // A sheddable request below the reserve is shed: every endpoint is full for it.
        assert!(matches!(q.admit(&s, &t(3, -5, "a"), &low_full, 0), Admission::Reject(_)));
        assert!(held(&q.admit(&s, &t(4, 0, "a"), &low_full, 0)));
        // Ticks release nothing below 10 while the reduced thresholds are reached...
        assert!(q.on_tick(&s, &Capacity { epoch: 2, ..low_full }, 10).is_empty());
        // ...and at most the reduced headroom once they are not (3 tokens, 1 low slot).
        let one_low = Capacity {
            epoch: 3,
            reserve: Some(Reserve { min_priority: 10, slots: 1, saturated: false }),
            ..room(3, 3)
        };
        assert_eq!(released(&q.on_tick(&s, &one_low, 20)), vec![1]);
        assert_eq!(record(&s, "m").left, 2, "unused tokens stay for higher priorities");
        // A premium request arriving now passes on one of them (lower ones wait: it takes a token).
        assert_eq!(q.admit(&s, &t(5, 15, "a"), &one_low, 21), Admission::Pass);
        assert_eq!(record(&s, "m").left, 1);
    }

    #[test]
    fn config_defaults_and_validation() {
        let c: FlowControlConfig = crate::config::read_json("{}").unwrap();
        assert_eq!(c, FlowControlConfig::default());
        assert_eq!((c.max_wait_ms, c.max_queue, c.retry_after_s, c.worker_ttl_ms), (30_000, 1024, 1, 2000));
        assert!(crate::config::read_json::<FlowControlConfig>(r#"{"max_wait":1}"#).is_err());
        let bad = FlowControlConfig {
            max_wait_ms: 0,
            max_queue: 0,
            worker_ttl_ms: 100,
            reserve: Some(ReserveConfig { min_priority: 10, fraction: 1.0 }),
            ..c
        };
        let mut errs = Vec::new();
        bad.validate("flow_control", &mut errs);
        let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            vec![
                "flow_control.max_wait_ms",
                "flow_control.max_queue",
                "flow_control.reserve.fraction",
                "flow_control.worker_ttl_ms"
            ]
        );
        assert!(errs[2].reason.contains("must be > 0 and < 1"), "{}", errs[2].reason);
        let r: FlowControlConfig =
            crate::config::read_json(r#"{"reserve":{"min_priority":10,"fraction":0.4}}"#).unwrap();
        assert_eq!(r.reserve, Some(ReserveConfig { min_priority: 10, fraction: 0.4 }));
        assert!(crate::config::read_json::<FlowControlConfig>(r#"{"reserve":{"min_priority":10}}"#).is_err());
        assert!(crate::config::read_json::<FlowControlConfig>(
            r#"{"reserve":{"min_priority":1,"fraction":0.4,"x":1}}"#
        )
        .is_err());
    }
}
