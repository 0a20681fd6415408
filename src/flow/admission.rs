//! Admission: flow control for one worker's requests, from the request's priority and the
//! snapshot to a decision the host only applies. Pure: the host passes the shared store, the
//! snapshot, the in-flight counts and the time.
//!
//! # What it decides
//! One [`crate::flow::FlowQueue`] per *group*: the base model a request is sent to (after
//! rewrites), whose endpoints it will use. For each request, [`Gate::admit`]:
//! 1. finds the group's endpoints in the snapshot (those that serve the base model, as the
//!    scheduler's filter does) and judges them with `crate::flow::saturation` (queue, KV use, this
//!    proxy's in-flight count; stale is full);
//! 2. **fails open** when no endpoint can be judged: the group has no endpoint, or every one is
//!    stale (no metrics, failed or old scrape). Flow control is skipped and the request goes on
//!    to the scheduler, which answers 503 (`FailClose`) or routes by in-flight count
//!    (`FailOpen`). Holding would only end in a 503 after `max_wait_ms`, and would hold every
//!    request while the poller is down;
//! 3. otherwise asks the group's queue: go on, hold (paused), or reject (429 shed or queue full).
//!
//! With flow control off (the default) only a sheddable request (priority < 0) needs step 1's
//! full report; any other request only needs step 2's answer, found at the first fresh
//! endpoint serving the group (`judgeable`), not by judging every endpoint.
//!
//! [`Gate::tick`] (from the root context's tick) renews each group's capacity and returns what
//! to release or reject; a group that can no longer be judged releases everything it holds
//! (step 2). [`Gate::cancel`] forgets a request whose client went away.
//!
//! # Startup hold
//! Until the proxy has metrics ([`snapshot_ready`]: a snapshot was published and at least one
//! endpoint in it has a scrape result, or it lists no endpoint at all), a request whose body is
//! complete is held ([`Gate::hold_for_snapshot`], at most `health.startup_wait_ms` and
//! [`MAX_STARTUP_HELD`] per worker) in the same pending set and released from the same tick as
//! flow control's. [`Gate::tick_startup`] releases every one as soon as the metrics are ready,
//! and each one whose wait is over; the host then routes it with [`routing_snapshot`]: the real
//! snapshot when ready, else by `filter.failure_mode` (`FailOpen`: the configured endpoints, by
//! in-flight count; `FailClose`: 503 [`metrics_not_ready`] with `retry-after`). A request
//! released from the startup hold skips flow control (there was nothing to judge capacity by
//! when it arrived). The same happens after a hot restart: shared data is per process, so the
//! new process starts without a snapshot.
//!
//! # Metrics
//! [`Gate::take_metrics`] turns the queues' counters into named metric updates (names in
//! `crate::base::telemetry`, each with `;priority=N`): counters per outcome, the total time queued, a
//! gauge of requests held (increments and decrements, so the workers' contributions add up),
//! and one histogram sample per request released or timed out.

use std::collections::BTreeMap;

use hashbrown::HashMap;

use std::rc::Rc;

use crate::base::codec::{decode_u64, encode_u64, Refusal, Tag};
use crate::base::errors::Rejection;
use crate::base::ports::{SharedStore, StoreError};
use crate::base::telemetry;
use crate::flow::priority::PriorityDecision;
use crate::flow::saturation::SaturationConfig;
use crate::flow::saturation::{is_stale, saturated, SaturationParams};
use crate::flow::{self, Admission, Capacity, FlowControlConfig, FlowQueue, ReserveConfig, Ticket};
use crate::scheduler::config::FailureMode;
use crate::scheduler::filter::serves;
use crate::state::catalog::EndpointConfig;
use crate::state::inflight::InflightCounts;
use crate::state::snapshot::{EndpointStatus, Snapshot};

/// Most histogram samples kept between two [`Gate::take_metrics`] calls; later ones are dropped
/// (the counters still count them). The host drains every tick, so this only bounds memory if
/// it stops doing so.
pub const MAX_PENDING_SAMPLES: usize = 4096;

/// Shared-data key of the counter that numbers the worker VMs (see [`claim_worker_id`]).
pub const WORKER_SEQ_KEY: &str = "inference-picker/flow-worker-seq";

/// A worker id no other VM of this Envoy process holds: the next value of a shared counter
/// (CAS; shared data is per process, which is all the flow records need). Ids start at 1 and
/// are never reused while the process lives; a restarted VM takes a new one, and its old id
/// ages out of the records after `worker_ttl_ms`.
///
/// The counter is a `WorkerSeq` record (`crate::base::codec`). First write: the counter key is
/// created with `crate::base::ports::get_or_create` (value 0), so
/// every increment, the first one included, is a true CAS. Two VMs starting at once can no
/// longer both take id 1 (a blind first write let the second overwrite the first's `1`).
pub fn claim_worker_id(store: &dyn SharedStore) -> Result<u64, StoreError> {
    for _ in 0..crate::state::inflight::MAX_CAS_ATTEMPTS {
        let (v, cas) =
            crate::base::ports::get_or_create(store, WORKER_SEQ_KEY, &encode_u64(Tag::WorkerSeq, 0))?;
        let current = match decode_u64(&v, Tag::WorkerSeq) {
            Ok(n) => n,
            Err(Refusal::Malformed) => 0,
            // Another build's counter: not ours to reset (its ids would repeat). No id from
            // shared data; the host takes a random one, as on a store error.
            Err(Refusal::UnknownVersion(v)) => {
                return Err(StoreError::Host(format!(
                    "the worker-id sequence is another build's (version {v})"
                )))
            }
        };
        let next = current.wrapping_add(1).max(1);
        match store.set(WORKER_SEQ_KEY, &encode_u64(Tag::WorkerSeq, next), cas) {
            Ok(()) => return Ok(next),
            Err(StoreError::CasMismatch) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(StoreError::CasMismatch)
}

/// Most requests one worker holds while waiting for the first metrics; more are routed (or
/// answered) at once.
pub const MAX_STARTUP_HELD: usize = 4096;

/// Does the snapshot let the scheduler judge endpoints? False before the poller published, and
/// while every endpoint it lists still waits for its first scrape result.
pub fn snapshot_ready(snapshot: &Snapshot) -> bool {
    snapshot.version > 0
        && (snapshot.endpoints.is_empty()
            || snapshot.endpoints.iter().any(|e| e.scraped_ms > 0 || e.failures > 0))
}

/// The 503 for a request that cannot wait any longer for the first metrics (`FailClose`).
pub fn metrics_not_ready() -> Rejection {
    Rejection::new(
        503,
        "service_unavailable",
        "metrics_not_ready",
        "The gateway has no endpoint metrics yet (it has just started); retry in a moment.",
    )
    .with_retry_after(1)
}

/// What the scheduler may use before the metrics are ready: the published endpoints, or the
/// configured ones while nothing is published (each with no scrape yet, so the scheduler fails
/// open over them). Model names resolve against it too.
pub fn startup_snapshot(endpoints: &[EndpointConfig], snapshot: &Snapshot) -> Snapshot {
    if !snapshot.endpoints.is_empty() {
        return snapshot.clone();
    }
    Snapshot {
        version: snapshot.version,
        published_ms: snapshot.published_ms,
        endpoints: endpoints
            .iter()
            .map(|e| EndpointStatus {
                address: e.address.clone(),
                models: e.models.clone(),
                metrics: None,
                scraped_ms: 0,
                failures: 0,
                inflight_at_scrape: None,
                role: e.role,
                poll_ms: 0,
            })
            .collect(),
    }
}

/// The snapshot to route a request with now: `snapshot` itself when ready; before that, with
/// `FailOpen`, [`startup_snapshot`]; with `FailClose`, [`metrics_not_ready`].
pub fn routing_snapshot(
    failure_mode: FailureMode,
    endpoints: &[EndpointConfig],
    snapshot: Rc<Snapshot>,
) -> Result<Rc<Snapshot>, Rejection> {
    if snapshot_ready(&snapshot) {
        return Ok(snapshot);
    }
    match failure_mode {
        FailureMode::FailOpen => Ok(Rc::new(startup_snapshot(endpoints, &snapshot))),
        FailureMode::FailClose => Err(metrics_not_ready()),
    }
}

/// What the gate reads: `flow_control`, `saturation` with the poller's staleness limit, and
/// `health.startup_wait_ms`. `config` builds it (`From<&Config>`).
#[derive(Debug, Clone, Copy)]
pub struct Setup<'a> {
    pub flow: &'a FlowControlConfig,
    pub saturation: &'a SaturationConfig,
    /// `poller.stale_after_ms`.
    pub stale_after_ms: u64,
    /// `health.startup_wait_ms`.
    pub startup_wait_ms: u64,
}

/// The group's capacity now, or `None` when flow control must be skipped: no endpoint serves
/// `group`, or every one that does is stale.
pub fn capacity(
    sat: &SaturationParams,
    snapshot: &Snapshot,
    group: &str,
    inflight: &InflightCounts,
    now_ms: u64,
) -> Option<Capacity> {
    capacity_with(sat, None, snapshot, group, inflight, now_ms)
}

/// [`capacity`] plus, with `flow_control.reserve`, the capacity left to the priorities below it
/// (the same report at the reduced thresholds, [`reserved_params`]).
pub fn capacity_with(
    sat: &SaturationParams,
    reserve: Option<&ReserveConfig>,
    snapshot: &Snapshot,
    group: &str,
    inflight: &InflightCounts,
    now_ms: u64,
) -> Option<Capacity> {
    let endpoints: Vec<&EndpointStatus> = snapshot.endpoints.iter().filter(|e| serves(e, group)).collect();
    if endpoints.is_empty() {
        return None;
    }
    let report = saturated(sat, &endpoints, &|a| inflight.get(a), now_ms);
    if report.stale == report.endpoints {
        return None;
    }
    let cap = Capacity::new(snapshot.version, &report);
    Some(match reserve {
        Some(r) => {
            let low = saturated(&reserved_params(sat, r), &endpoints, &|a| inflight.get(a), now_ms);
            cap.with_reserve(r.min_priority, &low)
        }
        None => cap,
    })
}

/// What [`Gate::admit`] needs of the capacity when flow control is off and the request is not
/// sheddable (priority >= 0): the queue then only counts it as passed, so only whether the
/// group can be judged matters ([`capacity`] is `None` exactly when no endpoint serves `group`
/// or every one that does is stale). Stops at the first fresh serving endpoint, without the
/// saturation report over every endpoint and its in-flight lookups. The capacity returned is
/// not a saturation estimate (never saturated, no slots): only for that case.
fn judgeable(sat: &SaturationParams, snapshot: &Snapshot, group: &str, now_ms: u64) -> Option<Capacity> {
    snapshot.endpoints.iter().any(|e| serves(e, group) && !is_stale(sat, e, now_ms)).then_some(Capacity {
        epoch: snapshot.version,
        slots: 0,
        saturated: false,
        reserve: None,
    })
}

/// The saturation thresholds for priorities below the reserve: each one times `1 - fraction`
/// (an in-flight limit stays at least 1; 0 stays off).
pub fn reserved_params(sat: &SaturationParams, r: &ReserveConfig) -> SaturationParams {
    let keep = (1.0 - r.fraction).clamp(0.0, 1.0);
    SaturationParams {
        queue_threshold: sat.queue_threshold * keep,
        kv_threshold: sat.kv_threshold * keep,
        max_inflight_per_endpoint: if sat.max_inflight_per_endpoint == 0 {
            0
        } else {
            ((f64::from(sat.max_inflight_per_endpoint) * keep).floor() as u32).max(1)
        },
        stale_after_ms: sat.stale_after_ms,
    }
}

/// What to do with a request whose body is complete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Go on now: pick the endpoint and continue.
    Go,
    /// Pause it; a later [`Gate::tick`] releases or rejects it. `evicted` is a request of this
    /// worker pushed out to make room: answer it with the rejection now.
    Held { evicted: Option<(u32, Rejection)> },
    /// Answer with this error now.
    Reject(Rejection),
}

/// A metric change for the host to apply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetricUpdate {
    /// Add to a counter.
    Count { name: String, delta: u64 },
    /// Add to (or subtract from) a gauge.
    GaugeAdd { name: String, delta: i64 },
    /// One histogram sample.
    Sample { name: String, value: u64 },
}

#[derive(Debug, Clone)]
struct HeldBy {
    group: String,
    priority: i32,
}

/// Flow control of one worker VM: a queue per group, and which requests it holds.
#[derive(Debug)]
pub struct Gate {
    flow: FlowControlConfig,
    sat: SaturationParams,
    worker_id: u64,
    queues: BTreeMap<String, FlowQueue>,
    /// Held requests: context id → where.
    held: HashMap<u32, HeldBy>,
    /// Since the last `take_metrics`: requests evicted per priority (they count as `queue_full`
    /// in the queue's stats, but leave the waiting gauge too).
    evicted: BTreeMap<i32, u64>,
    /// Since the last `take_metrics`: requests that skipped flow control, per priority.
    fail_open: BTreeMap<i32, u64>,
    /// Since the last `take_metrics`: (priority, ms held) of released and timed-out requests.
    samples: Vec<(i32, u64)>,
    /// `health.startup_wait_ms`.
    startup_wait_ms: u64,
    /// Requests held until the first metrics: context id → when held.
    startup: BTreeMap<u32, u64>,
}

impl Gate {
    /// `worker_id` must differ between the VMs that share the store (a random u64 per VM).
    pub fn new<'a>(setup: impl Into<Setup<'a>>, worker_id: u64) -> Self {
        let setup = setup.into();
        Self {
            flow: setup.flow.clone(),
            sat: setup.saturation.params(setup.stale_after_ms),
            worker_id,
            queues: BTreeMap::new(),
            held: HashMap::new(),
            evicted: BTreeMap::new(),
            fail_open: BTreeMap::new(),
            samples: Vec::new(),
            startup_wait_ms: setup.startup_wait_ms,
            startup: BTreeMap::new(),
        }
    }

    /// Holds request `id` until the first metrics (see the module doc). False when it cannot be
    /// held (`startup_wait_ms` 0, or [`MAX_STARTUP_HELD`] already held): route it now.
    pub fn hold_for_snapshot(&mut self, id: u32, now_ms: u64) -> bool {
        if self.startup_wait_ms == 0 || self.startup.len() >= MAX_STARTUP_HELD {
            return false;
        }
        self.startup.insert(id, now_ms);
        true
    }

    /// Requests held until the first metrics.
    pub fn startup_held(&self) -> usize {
        self.startup.len()
    }

    /// The startup-held requests to route now, with the time each waited: all of them once
    /// `ready`, else those that waited `startup_wait_ms`. Oldest first.
    pub fn tick_startup(&mut self, ready: bool, now_ms: u64) -> Vec<(u32, u64)> {
        let wait = self.startup_wait_ms;
        let mut out: Vec<(u64, u32)> = self
            .startup
            .iter()
            .filter(|(_, &at)| ready || now_ms.saturating_sub(at) >= wait)
            .map(|(&id, &at)| (at, id))
            .collect();
        crate::base::sorting::sort(&mut out);
        for (_, id) in &out {
            self.startup.remove(id);
        }
        out.into_iter().map(|(at, id)| (id, now_ms.saturating_sub(at))).collect()
    }

    /// Requests held by this worker.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// True while [`Gate::tick`] has work (something held, or a shared summary to withdraw).
    pub fn needs_tick(&self) -> bool {
        !self.startup.is_empty() || self.queues.values().any(FlowQueue::needs_tick)
    }

    /// Admits the request with context id `id`, sent to the base model `group`.
    #[allow(clippy::too_many_arguments)]
    pub fn admit(
        &mut self,
        store: &dyn SharedStore,
        snapshot: &Snapshot,
        inflight: &InflightCounts,
        id: u32,
        group: &str,
        priority: &PriorityDecision,
        now_ms: u64,
    ) -> Decision {
        let cap = if self.flow.enabled || priority.priority < 0 {
            capacity_with(&self.sat, self.flow.reserve.as_ref(), snapshot, group, inflight, now_ms)
        } else {
            judgeable(&self.sat, snapshot, group, now_ms)
        };
        let Some(cap) = cap else {
            *self.fail_open.entry(priority.priority).or_default() += 1;
            return Decision::Go;
        };
        // Groups are base models of the config or of the snapshot: bounded by the pool.
        let queue = match self.queues.get_mut(group) {
            Some(q) => q,
            None => self
                .queues
                .entry(group.to_string())
                .or_insert_with(|| FlowQueue::new(&self.flow, group, self.worker_id)),
        };
        let ticket = Ticket {
            id,
            priority: priority.priority,
            fairness_id: &priority.fairness_id,
            deadline_ms: crate::flow::slo::deadline_ms(now_ms, priority.targets.ttft_ms),
        };
        match queue.admit(store, &ticket, &cap, now_ms) {
            Admission::Pass => Decision::Go,
            Admission::Reject(r) => Decision::Reject(r),
            Admission::Held { evicted } => {
                if let Some((gone, _)) = &evicted {
                    if let Some(h) = self.held.remove(gone) {
                        *self.evicted.entry(h.priority).or_default() += 1;
                    }
                }
                self.held.insert(id, HeldBy { group: group.to_string(), priority: priority.priority });
                Decision::Held { evicted }
            }
        }
    }

    /// Renews every group's capacity and returns the held requests to release or reject now
    /// (releases in the order they must go).
    pub fn tick(
        &mut self,
        store: &dyn SharedStore,
        snapshot: &Snapshot,
        inflight: &InflightCounts,
        now_ms: u64,
    ) -> Vec<flow::Action> {
        let mut out = Vec::new();
        for (group, queue) in self.queues.iter_mut() {
            if !queue.needs_tick() {
                continue;
            }
            let actions =
                match capacity_with(&self.sat, self.flow.reserve.as_ref(), snapshot, group, inflight, now_ms)
                {
                    Some(cap) => queue.on_tick(store, &cap, now_ms),
                    None => queue.release_all(store, now_ms),
                };
            out.extend(actions);
        }
        for a in &out {
            let (flow::Action::Release { id, priority, waited_ms }
            | flow::Action::Reject { id, priority, waited_ms, .. }) = a;
            self.held.remove(id);
            if self.samples.len() < MAX_PENDING_SAMPLES {
                self.samples.push((*priority, *waited_ms));
            }
        }
        out
    }

    /// A request to `address` finished (this worker's `on_log`, after its in-flight count went
    /// down): for each model the endpoint serves, give the freed room to held requests at once
    /// ([`flow::credit_finish`]). `inflight` is read after the finish. Returns whether any group
    /// gained a token (the host then runs [`Gate::tick`] at once for this worker's own queues).
    /// Nothing when flow control is off; store errors credit nothing (the next snapshot resets
    /// the ledger anyway).
    pub fn on_finish(
        &mut self,
        store: &dyn SharedStore,
        snapshot: &Snapshot,
        inflight: &InflightCounts,
        address: &str,
        now_ms: u64,
    ) -> bool {
        if !self.flow.enabled {
            return false;
        }
        let Some(ep) = snapshot.endpoints.iter().find(|e| e.address == address) else {
            return false;
        };
        let mut credited = false;
        for group in &ep.models {
            if let Some(cap) =
                capacity_with(&self.sat, self.flow.reserve.as_ref(), snapshot, group, inflight, now_ms)
            {
                credited |=
                    flow::credit_finish(store, group, &cap, self.flow.worker_ttl_ms, now_ms).unwrap_or(false);
            }
        }
        credited
    }

    /// The client went away (or the stream ended): forget the request if it is held. Safe for
    /// any id. Returns whether it was held.
    pub fn cancel(&mut self, id: u32, now_ms: u64) -> bool {
        if self.startup.remove(&id).is_some() {
            return true;
        }
        let Some(h) = self.held.remove(&id) else { return false };
        self.queues.get_mut(&h.group).is_some_and(|q| q.cancel(id, now_ms))
    }

    /// The metric changes since the last call (only non-zero ones).
    pub fn take_metrics(&mut self) -> Vec<MetricUpdate> {
        let mut by_priority: BTreeMap<i32, flow::PriorityStats> = BTreeMap::new();
        for q in self.queues.values_mut() {
            for (p, s) in q.take_stats().by_priority {
                let t = by_priority.entry(p).or_default();
                t.passed += s.passed;
                t.held += s.held;
                t.released += s.released;
                t.timed_out += s.timed_out;
                t.shed += s.shed;
                t.queue_full += s.queue_full;
                t.cancelled += s.cancelled;
                t.queued_ms += s.queued_ms;
            }
        }
        let evicted = std::mem::take(&mut self.evicted);
        let fail_open = std::mem::take(&mut self.fail_open);
        for p in evicted.keys().chain(fail_open.keys()) {
            by_priority.entry(*p).or_default();
        }
        let mut out = Vec::new();
        for (p, s) in &by_priority {
            let prio = p.to_string();
            let count = |out: &mut Vec<MetricUpdate>, outcome: &str, delta: u64| {
                if delta > 0 {
                    let name = telemetry::name(
                        telemetry::FLOW_REQUESTS,
                        &[("priority", &prio), ("outcome", outcome)],
                    );
                    out.push(MetricUpdate::Count { name, delta });
                }
            };
            count(&mut out, "passed", s.passed);
            count(&mut out, "held", s.held);
            count(&mut out, "released", s.released);
            count(&mut out, "timed_out", s.timed_out);
            count(&mut out, "shed", s.shed);
            count(&mut out, "queue_full", s.queue_full);
            count(&mut out, "cancelled", s.cancelled);
            count(&mut out, "fail_open", fail_open.get(p).copied().unwrap_or(0));
            if s.queued_ms > 0 {
                let name = telemetry::name(telemetry::FLOW_QUEUED_MS, &[("priority", &prio)]);
                out.push(MetricUpdate::Count { name, delta: s.queued_ms });
            }
            let left = s.released + s.timed_out + s.cancelled + evicted.get(p).copied().unwrap_or(0);
            let delta = i64::try_from(s.held).unwrap_or(i64::MAX) - i64::try_from(left).unwrap_or(i64::MAX);
            if delta != 0 {
                let name = telemetry::name(telemetry::FLOW_WAITING, &[("priority", &prio)]);
                out.push(MetricUpdate::GaugeAdd { name, delta });
            }
        }
        for (p, ms) in std::mem::take(&mut self.samples) {
            let name = telemetry::name(telemetry::FLOW_QUEUE_TIME, &[("priority", &p.to_string())]);
            out.push(MetricUpdate::Sample { name, value: ms });
        }
        out
    }
}

#[cfg(test)]
mod tests;
