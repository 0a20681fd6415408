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
//! 1. Sheddable (priority < 0) without a latency target and saturated for its priority
//!    ([`Capacity::saturated_for`]: at the reduced thresholds when it is below
//!    `flow_control.reserve.min_priority`): 429 at once (`request_shed`). A sheddable request
//!    with a target is held instead, and shed (429 `slo_unattainable`) when its deadline passes
//!    while held (`crate::flow::slo`).
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
pub mod capacity;
pub mod config;
pub mod fairshare;
pub mod ledger;
pub mod priority;
pub mod queue;
pub mod saturation;
pub mod slo;

pub use self::capacity::{Capacity, Reserve};
pub use self::config::{FlowControlConfig, ReserveConfig, MIN_WORKER_TTL_MS};
pub use self::ledger::{credit_finish, shared_key, Record, WorkerEntry, FLOW_KEY_PREFIX};
pub use self::queue::{Action, Admission, FlowQueue, FlowStats, PriorityStats, Ticket};

#[cfg(test)]
mod tests;
