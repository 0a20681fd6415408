//! The shared record of a group (one shared-data key, written by compare-and-swap): each
//! worker's held requests by priority, the capacity epoch and the slots taken from it.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};

use crate::base::codec::{self, Reader, Refusal, Tag, Writer};
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

/// The shared value of one group (a `crate::base::codec` record, [`Record::read`]: it is copied
/// on every read).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Record {
    /// Capacity epoch of the ledger.
    pub epoch: u64,
    /// When the ledger was last reset (ms).
    pub reset_ms: u64,
    /// Release tokens left in this epoch.
    pub left: u32,
    /// Waiting summaries of the workers that hold requests.
    pub workers: Vec<WorkerEntry>,
    /// Releases per waiting tenant and priority, over all workers (`crate::flow::fairshare`).
    pub served: Served,
    /// When a fairness refusal first left tokens unused (ms); 0 when none did since the last
    /// release. See `crate::flow::fairshare::GRACE_MS`.
    pub declined_ms: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerEntry {
    pub id: u64,
    /// Last write by this worker (ms).
    pub hb: u64,
    /// (priority, held count), highest priority first, counts > 0.
    pub q: Vec<(i32, u32)>,
    /// (priority, tenant bucket) pairs held, highest priority first, at most
    /// `crate::flow::fairshare::MAX_PUBLISHED`.
    pub t: Vec<(i32, u16)>,
}

impl WorkerEntry {
    pub(super) fn max_priority(&self) -> Option<i32> {
        self.q.iter().filter(|(_, c)| *c > 0).map(|(p, _)| *p).max()
    }
}

impl Record {
    /// Reads the stored value; an empty, malformed or truncated value is the neutral record
    /// (reset rather than trusted), and so is one of a version this build does not read.
    #[cfg(test)]
    pub(super) fn decode(bytes: &[u8]) -> Record {
        Record::read(bytes).unwrap_or_default()
    }

    /// [`Record::decode`], but `None` for a value of a version this build does not read
    /// (another build's ledger: never overwritten by this one).
    ///
    /// Layout (`crate::base::codec`, tag `FlowLedger`): `u64 epoch · u64 reset_ms · u32 left ·
    /// u32 n · n × worker · u32 m · m × (i32 priority · u16 bucket · u32 count) · u64
    /// declined_ms`; worker = `u64 id · u64 hb · u32 a · a × (i32 priority · u32 count) · u32 b ·
    /// b × (i32 priority · u16 bucket)`.
    pub(super) fn read(bytes: &[u8]) -> Option<Record> {
        let mut r = match codec::open(bytes, Tag::FlowLedger) {
            Ok(r) => r,
            Err(Refusal::UnknownVersion(_)) => return None,
            Err(Refusal::Malformed) => return Some(Record::default()),
        };
        Some(Self::fields(&mut r).filter(|_| r.finish().is_some()).unwrap_or_default())
    }

    fn fields(r: &mut Reader<'_>) -> Option<Record> {
        let epoch = r.u64()?;
        let reset_ms = r.u64()?;
        let left = r.u32()?;
        let n = r.count(24, usize::MAX)?;
        let mut workers = Vec::with_capacity(n);
        for _ in 0..n {
            let id = r.u64()?;
            let hb = r.u64()?;
            let a = r.count(8, usize::MAX)?;
            let mut q = Vec::with_capacity(a);
            for _ in 0..a {
                q.push((r.i32()?, r.u32()?));
            }
            let b = r.count(6, usize::MAX)?;
            let mut t = Vec::with_capacity(b);
            for _ in 0..b {
                t.push((r.i32()?, r.u16()?));
            }
            workers.push(WorkerEntry { id, hb, q, t });
        }
        let m = r.count(10, usize::MAX)?;
        let mut served = Vec::with_capacity(m);
        for _ in 0..m {
            served.push((r.i32()?, r.u16()?, r.u32()?));
        }
        let declined_ms = r.u64()?;
        Some(Record { epoch, reset_ms, left, workers, served: Served(served), declined_ms })
    }

    pub(super) fn encode(&self) -> Vec<u8> {
        let Record { epoch, reset_ms, left, workers, served, declined_ms } = self;
        let mut w = Writer::new(Tag::FlowLedger, 40 + workers.len() * 48 + served.0.len() * 10);
        w.u64(*epoch).u64(*reset_ms).u32(*left).len(workers.len());
        for WorkerEntry { id, hb, q, t } in workers {
            w.u64(*id).u64(*hb).len(q.len());
            for (p, c) in q {
                w.i32(*p).u32(*c);
            }
            w.len(t.len());
            for (p, b) in t {
                w.i32(*p).u16(*b);
            }
        }
        w.len(served.0.len());
        for (p, b, c) in &served.0 {
            w.i32(*p).u16(*b).u32(*c);
        }
        w.u64(*declined_ms);
        w.finish()
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
        let Some(mut rec) = Record::read(&bytes) else {
            // Another build's ledger (a rolling upgrade): not ours to overwrite. The queue
            // handles it as a store error (local decisions, retried on the next tick).
            return Err(StoreError::Host("the flow ledger is another build's".into()));
        };
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
        match store.set(key, &rec.encode(), cas) {
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
