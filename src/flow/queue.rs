//! The worker's local queue of held requests: priority levels, tenant round robin within a level,
//! and the release plan agreed through the shared ledger.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::base::errors::Rejection;
use crate::base::ports::SharedStore;
use crate::flow::capacity::Capacity;
use crate::flow::config::FlowControlConfig;
use crate::flow::fairshare;
use crate::flow::ledger::{adjusted, read_modify_write, shared_key, Record, WorkerEntry};

/// A request asking to go upstream.
#[derive(Debug, Clone, Copy)]
pub struct Ticket<'a> {
    /// The HTTP context id (unique within the VM).
    pub id: u32,
    pub priority: i32,
    pub fairness_id: &'a str,
    /// Arrival + TTFT target (`crate::flow::slo::deadline_ms`): within its priority level, the
    /// earliest deadline goes first. `None`: after every request with one, in arrival order.
    pub deadline_ms: Option<u64>,
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

#[derive(Debug, Clone)]
struct Entry {
    priority: i32,
    flow: String,
    enqueued_ms: u64,
    seq: u64,
    /// The request's deadline, `u64::MAX` without one: its place in its tenant's queue.
    deadline: u64,
}

/// A held request's place in its tenant's queue: earliest deadline first, then arrival.
type Place = (u64, u64, u32);

/// One priority level: per-tenant queues (earliest deadline first; without deadlines, FIFO)
/// served round-robin, except that a tenant whose front request has an earlier deadline goes
/// before the round-robin's next ([`plan_take`]).
#[derive(Debug, Default)]
struct Level {
    /// Tenants with held requests, in service order.
    rr: VecDeque<String>,
    flows: BTreeMap<String, BTreeSet<Place>>,
    len: u32,
}

impl Level {
    fn push(&mut self, flow: &str, place: Place) {
        match self.flows.get_mut(flow) {
            Some(q) => {
                q.insert(place);
            }
            None => {
                self.flows.insert(flow.to_string(), BTreeSet::from([place]));
                self.rr.push_back(flow.to_string());
            }
        }
        self.len += 1;
    }

    /// The next id in round-robin order: the front of the next tenant's queue.
    fn pop(&mut self) -> Option<u32> {
        while let Some(flow) = self.rr.pop_front() {
            let Some(q) = self.flows.get_mut(&flow) else { continue };
            let Some((_, _, id)) = q.pop_first() else {
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

    /// The next id of `flow`'s queue at `now_ms` ([`urgency`]: the same choice as
    /// [`plan_take`]); `flow` then goes to the back of the round-robin (the same rotation as
    /// [`Level::pop`] when it is at the front).
    fn pop_flow(&mut self, flow: &str, now_ms: u64) -> Option<u32> {
        let pos = self.rr.iter().position(|f| f == flow)?;
        let q = self.flows.get_mut(flow)?;
        // Still on time (deadline > now), else without a deadline (u64::MAX sorts after every
        // finite one), else the earliest past its deadline.
        let next = q.range((now_ms.saturating_add(1), 0, 0)..).next().or_else(|| q.first()).copied()?;
        q.remove(&next);
        let (_, _, id) = next;
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

    fn remove(&mut self, flow: &str, place: Place) -> bool {
        let Some(q) = self.flows.get_mut(flow) else { return false };
        if !q.remove(&place) {
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
/// the deadlines of their held requests, earliest first), for planning releases inside a CAS
/// attempt without touching the real queue.
#[derive(Debug, Clone)]
struct PlanLevel {
    priority: i32,
    flows: VecDeque<(String, u16, VecDeque<u64>)>,
}

/// The order of held requests within a tenant's queue at `now_ms`: those still before their
/// deadline, earliest first; then those without one, in arrival order; then those already past
/// their deadline, earliest first (they will miss it whatever happens; serving them first would
/// make the ones still on time miss theirs too). Lower goes first.
fn urgency(deadline: u64, now_ms: u64) -> (u8, u64) {
    if deadline == u64::MAX {
        (1, 0)
    } else if deadline > now_ms {
        (0, deadline)
    } else {
        (2, deadline)
    }
}

/// The index of the request a tenant's (sorted) deadlines release next at `now_ms` ([`urgency`]).
fn next_of(ds: &VecDeque<u64>, now_ms: u64) -> Option<usize> {
    ds.iter().enumerate().min_by_key(|(i, d)| (urgency(**d, now_ms), *i)).map(|(i, _)| i)
}

/// Takes one request of the highest non-empty level: among the tenants `may` accepts, the one
/// whose next request ([`urgency`]) is the most urgent, the first in round-robin order on a tie
/// (so without deadlines, plain round robin); that tenant rotates to the back. Returns (priority,
/// tenant, bucket).
fn plan_take(
    view: &mut [PlanLevel],
    may: &dyn Fn(i32, u16) -> bool,
    now_ms: u64,
) -> Option<(i32, String, u16)> {
    let level = view.iter_mut().find(|l| !l.flows.is_empty())?;
    let p = level.priority;
    let mut best: Option<(usize, (u8, u64))> = None;
    for (i, (_, b, ds)) in level.flows.iter().enumerate() {
        let u = next_of(ds, now_ms).and_then(|j| ds.get(j)).map_or((1, 0), |d| urgency(*d, now_ms));
        if may(p, *b) && best.is_none_or(|(_, bu)| u < bu) {
            best = Some((i, u));
        }
    }
    let (pos, _) = best?;
    let (flow, b, mut ds) = level.flows.remove(pos)?;
    if let Some(j) = next_of(&ds, now_ms) {
        ds.remove(j);
    }
    if !ds.is_empty() {
        level.flows.push_back((flow.clone(), b, ds));
    }
    Some((p, flow, b))
}

/// Held counts per priority of a plan view, highest first.
fn plan_summary(view: &[PlanLevel]) -> Vec<(i32, u32)> {
    view.iter()
        .map(|l| {
            (
                l.priority,
                l.flows.iter().map(|(_, _, d)| u32::try_from(d.len()).unwrap_or(u32::MAX)).sum::<u32>(),
            )
        })
        .filter(|(_, c)| *c > 0)
        .collect()
}

/// The (priority, bucket) pairs a plan view holds: highest priority first, at most
/// `fairshare::MAX_PUBLISHED`, sorted so that an unchanged set encodes the same.
fn plan_tenants(view: &[PlanLevel]) -> Vec<(i32, u16)> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for l in view {
        for (_, b, d) in &l.flows {
            if !d.is_empty() && out.len() < fairshare::MAX_PUBLISHED && seen.insert((l.priority, *b)) {
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
    pub(super) deadlines: VecDeque<(u64, u32, u64)>,
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
                        let ds: VecDeque<u64> = l
                            .flows
                            .get(f)
                            .map(|q| q.iter().map(|(d, _, _)| *d).collect())
                            .unwrap_or_default();
                        (!ds.is_empty()).then(|| (f.clone(), fairshare::bucket(f), ds))
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
        // A sheddable request with a latency target is not shed for saturation: it is held, and
        // shed when its deadline passes while held (`expire_deadlines`) or when, at its release,
        // no pod is predicted to meet its target (`crate::scheduler::slo`).
        if t.priority < 0 && cap.saturated_for(t.priority) && t.deadline_ms.is_none() {
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
            let d = VecDeque::from([t.deadline_ms.unwrap_or(u64::MAX)]);
            match view.iter_mut().find(|l| l.priority == t.priority) {
                Some(l) => l.flows.push_back((t.fairness_id.to_string(), b, d)),
                None => {
                    let at = view.iter().position(|l| l.priority < t.priority).unwrap_or(view.len());
                    view.insert(
                        at,
                        PlanLevel {
                            priority: t.priority,
                            flows: VecDeque::from([(t.fairness_id.to_string(), b, d)]),
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
            // (With a target it is held: until its release, where the scheduler judges its
            // target, or its deadline, `expire_deadlines`.)
            if t.priority < 0 && t.deadline_ms.is_none() {
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
        let deadline = t.deadline_ms.unwrap_or(u64::MAX);
        self.levels.entry(Reverse(t.priority)).or_default().push(&flow, (deadline, self.seq, t.id));
        let e = Entry { priority: t.priority, flow, enqueued_ms: now_ms, seq: self.seq, deadline };
        self.entries.insert(t.id, e);
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
            level.remove(&e.flow, (e.deadline, e.seq, id));
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

    /// Sheds (429 `slo_unattainable`) the sheddable requests whose deadline passed while held:
    /// their target can no longer be met, and they yield to everything else. One pass over the
    /// held requests, only while some sheddable one is held (the lowest level is below 0).
    fn expire_deadlines(&mut self, now_ms: u64, out: &mut Vec<Action>) {
        // Levels are highest priority first: the last is the lowest.
        if self.levels.keys().next_back().is_none_or(|Reverse(p)| *p >= 0) {
            return;
        }
        let late: Vec<u32> = self
            .entries
            .iter()
            .filter(|(_, e)| e.priority < 0 && e.deadline <= now_ms)
            .map(|(id, _)| *id)
            .collect();
        for id in late {
            if let Some(e) = self.detach(id) {
                let waited_ms = now_ms.saturating_sub(e.enqueued_ms);
                let s = self.stats.at(e.priority);
                s.shed += 1;
                s.queued_ms += waited_ms;
                self.dirty = true;
                let rejection = crate::scheduler::slo::unattainable(self.cfg.retry_after_s);
                out.push(Action::Reject { id, priority: e.priority, waited_ms, rejection });
            }
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
        self.expire_deadlines(now_ms, &mut out);
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
                let eligible: u32 = sim
                    .iter()
                    .flat_map(|l| l.flows.iter())
                    .fold(0u32, |a, (_, _, d)| a.saturating_add(u32::try_from(d.len()).unwrap_or(u32::MAX)));
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
                    match plan_take(&mut sim, &may, now_ms) {
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
            let Some(id) = level.pop_flow(&flow, now_ms) else { continue };
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
