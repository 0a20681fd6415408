//! The placement feed between this Envoy's workers (`crate::state::feed`), at the pick: first
//! the other live workers' new placements into this worker's prefix index, then this pick's
//! placement for them (and, with `peers`, for the poller to send to the other gateways,
//! `crate::poll::peers`). With no other live worker and no `peers`, neither costs a host call,
//! and the pick keeps no placement.

use log::warn;

use super::super::io;
use super::Worker;
use crate::state::feed::MAX_PER_PICK;

/// Before a pick, after the in-flight counts were read (they name the live workers).
pub(super) fn before_pick(worker: &Worker, now_ms: u64) {
    let mut guard = worker.feed.borrow_mut();
    let feed = &mut *guard;
    worker.inflight.borrow().live_others(now_ms, &mut feed.others);
    let mut scheduler = worker.scheduler.borrow_mut();
    scheduler.set_feed(!feed.others.is_empty() || worker.cfg.peers.is_some());
    if feed.others.is_empty() {
        return;
    }
    feed.seen.clear();
    feed.reader.poll(&io::HostStore, &feed.others, MAX_PER_PICK, &mut feed.seen);
    for p in &feed.seen {
        scheduler.observe(p);
    }
}

/// After a pick: its placement, when it kept one, into this worker's ring.
pub(super) fn after_pick(worker: &Worker) {
    let Some(p) = worker.scheduler.borrow_mut().take_placement() else { return };
    publish(worker, &p);
}

/// `p` into this worker's ring (it needs its in-flight slot: a worker that never counted a
/// request has none yet, and its placements reach no one).
pub(super) fn publish(worker: &Worker, p: &crate::state::feed::Placement) {
    let table = worker.inflight.borrow();
    let Some(slot) = table.slot() else { return };
    if let Err(e) = worker.feed.borrow_mut().writer.publish(&io::HostStore, slot, table.owner(), p) {
        warn!("inference-picker: publishing a placement to the other workers failed: {e:?}");
    }
}
