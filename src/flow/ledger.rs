//! The shared record of a group (one shared-data key, written by compare-and-swap): each
//! worker's held requests by priority, the capacity epoch and the slots taken from it.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::base::ports::{SharedStore, StoreError};
use crate::flow::capacity::Capacity;
use crate::flow::fairshare::Served;

/// Prefix of the per-group shared-data key.
pub const FLOW_KEY_PREFIX: &str = "inference-picker/flow/";
/// CAS attempts per read-modify-write before giving up for this call.
const MAX_CAS_ATTEMPTS: usize = 8;

/// The shared-data key of a group.
pub fn shared_key(group: &str) -> String {
    format!("{FLOW_KEY_PREFIX}{group}")
}

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

pub(super) fn is_zero(v: &u64) -> bool {
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
    pub(super) fn max_priority(&self) -> Option<i32> {
        self.q.iter().filter(|(_, c)| *c > 0).map(|(p, _)| *p).max()
    }
}

impl Record {
    pub(super) fn decode(bytes: &[u8]) -> Record {
        // An empty value is "removed"; a value we cannot read (another build's format) is reset
        // rather than trusted.
        serde_json::from_slice(bytes).unwrap_or_default()
    }

    /// Drops workers whose heartbeat is older than `ttl_ms` (never `me`). True if any went.
    pub(super) fn prune(&mut self, now_ms: u64, ttl_ms: u64, me: u64) -> bool {
        let before = self.workers.len();
        self.workers.retain(|w| w.id == me || now_ms.saturating_sub(w.hb) < ttl_ms);
        self.workers.len() != before
    }

    /// Starts a new epoch when `cap` is newer, or different and the ledger is old. True if reset.
    pub(super) fn refresh_epoch(&mut self, cap: &Capacity, now_ms: u64, ttl_ms: u64) -> bool {
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

    pub(super) fn remote(&self, me: u64) -> impl Iterator<Item = &WorkerEntry> {
        self.workers.iter().filter(move |w| w.id != me)
    }

    /// Remote waiting counts plus `local`, per priority, highest first.
    pub(super) fn global_waiting(&self, me: u64, local: &[(i32, u32)]) -> Vec<(i32, u32)> {
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
    pub(super) fn set_own(
        &mut self,
        me: u64,
        now_ms: u64,
        q: &[(i32, u32)],
        t: &[(i32, u16)],
        ttl_ms: u64,
    ) -> bool {
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
    pub(super) fn settle_fairness(&mut self) {
        let waiting: BTreeSet<(i32, u16)> = self.workers.iter().flat_map(|w| w.t.iter().copied()).collect();
        self.served.retain_waiting(&waiting);
        if self.workers.is_empty() {
            self.declined_ms = 0;
        }
    }
}

/// Reads the group's record, applies `f`, and writes it back with CAS when `f` says so; retries
/// on CAS mismatch. Returns `f`'s result for the attempt that stuck.
pub(super) fn read_modify_write<R>(
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
pub(super) fn adjusted(local: &[(i32, u32)], add: i32, remove: Option<i32>) -> Vec<(i32, u32)> {
    let mut m: BTreeMap<Reverse<i32>, u32> = local.iter().map(|(p, c)| (Reverse(*p), *c)).collect();
    *m.entry(Reverse(add)).or_default() += 1;
    if let Some(r) = remove {
        if let Some(c) = m.get_mut(&Reverse(r)) {
            *c = c.saturating_sub(1);
        }
    }
    m.into_iter().filter(|(_, c)| *c > 0).map(|(Reverse(p), c)| (p, c)).collect()
}
