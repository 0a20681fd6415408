//! Router-local in-flight request counts, shared by every Envoy worker through shared data, and
//! never outliving the VM that counted them.
//!
//! Polled metrics lag bursts by up to one poll interval; this count reacts at once. A worker VM
//! counts +1 when it sends a request to an endpoint and -1 when the request ends (`on_log`, which
//! Envoy runs for every stream, reset or not).
//!
//! # One record per VM (single writer)
//! Each VM keeps its own counts locally ([`InflightTable`]) and publishes them in ONE slot key,
//! `inference-picker/inflight/<k>` ([`slot_key`]), that only it writes. The record
//! ([`encode`]/[`decode`]) is a `crate::base::codec` record (tag `InflightVm`: owner nonce,
//! heartbeat ms, the counts by address); an empty value is a free slot. Readers sum the records of the live slots; a record whose heartbeat is
//! older than [`TTL_MS`] is ignored. So the +1 of a VM that dies (panic, reload, config change)
//! mid-request stops counting within `TTL_MS`: a count never survives its VM. The root context's
//! `on_done` writes an empty record at once ([`InflightTable::release`]).
//!
//! # Slots: bounded keys, claimed with ownership
//! - Slots are taken lowest first, so the written ones are `0..n` with `n` the peak number of
//!   VMs alive at once; a slot whose record is empty, garbled or stale is reused. At most
//!   [`MAX_SLOTS`] keys, whatever the churn.
//! - Claiming a never-written slot writes our record with [`CREATE_CAS`] (Envoy accepts any cas on
//!   an absent key and rejects a non-matching one on an existing key, so of two VMs creating the
//!   same slot only the first succeeds; see `crate::base::ports::get_or_create`). Claiming a free or
//!   stale slot is a CAS on the token just read.
//! - Ownership is verified on every write: a sync reads the slot, checks that the record carries
//!   our nonce, and writes with that read's token. If another VM holds the slot (it won a
//!   creation race our CAS could not see, or reused our slot while we were stalled past the
//!   TTL), we move to another slot and write our full state there: the counts live locally, so
//!   nothing is lost. The root's tick verifies the slot (one read) every tick and rewrites the
//!   heartbeat every [`HEARTBEAT_MS`], so a conflict resolves within one tick.
//!
//! # Cost
//! A +1 or -1 is one read and one write of this VM's own small record. A read of all counts is one
//! host read per written slot other than our own (our counts are local); records are decoded
//! again only when their CAS token changed.
//!
//! # Only this Envoy's VMs
//! The counts are this gateway's own: other replicas' requests are seen at the next scrape
//! only (replicas exchange placements, not load: `crate::poll::peers`). An in-flight record of
//! a peer gateway (tag `InflightPeer`, written by older builds) reads as a free slot here.
//!
//! # Failure behaviour
//! A garbled record reads as a free slot (its counts are ignored and its slot reusable). A
//! record of a version this build does not read (a VM of another build during a rolling
//! upgrade, `crate::base::codec`) is skipped: not counted, and its slot is never taken. If the
//! store fails, counts stay local and the next sync publishes them. If all slots are live, the
//! VM keeps counting locally and its counts are invisible to the others (the host logs it).

use crate::base::codec::{self, Reader, Refusal, Tag, Writer, MAX_NAME_BYTES};
use crate::base::ports::{SharedStore, StoreError, CREATE_CAS};
use crate::state::by_address::{address_hash, ByAddress};

/// Prefix of the slot keys: `inference-picker/inflight/<k>`, `k` in `0..MAX_SLOTS`.
pub const SLOT_KEY_PREFIX: &str = "inference-picker/inflight/";
/// Most slot keys ever written (bounds the keys whatever the VM churn): more than any Envoy's
/// worker count. A VM that finds every slot live keeps its counts local (logged).
pub const MAX_SLOTS: usize = 256;
/// A record whose heartbeat is older than this, in ms, belongs to a dead (or stalled) VM: readers
/// ignore it and a claimer may reuse its slot.
pub const TTL_MS: u64 = 2_000;
/// How often a live VM rewrites its heartbeat, in ms (a quarter of [`TTL_MS`]; the filter root
/// ticks every 50 ms).
pub const HEARTBEAT_MS: u64 = TTL_MS / 4;
/// CAS attempts for counters elsewhere (the worker-id sequence).
pub const MAX_CAS_ATTEMPTS: usize = 64;
/// Write attempts of one sync (lost CAS races, or moves after losing the slot).
const MAX_SYNC_ATTEMPTS: usize = 8;

/// One endpoint's entry in a VM's record: its in-flight count, and of those the requests still in
/// prefill (sent, no first response byte yet) with their uncached prompt tokens, as the VM's
/// scheduler ledger counts them (`crate::scheduler::predict::Ledger`). The prefill part lets
/// every worker's predicted-TTFT ranking see the prefill the other workers queued on a pod, not
/// only their request count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EndpointLoad {
    pub n: u32,
    pub prefill_n: u32,
    pub prefill_tokens: u64,
}

impl EndpointLoad {
    /// The prefill part as the prediction reads it: `(tokens, count)`.
    pub fn prefill(&self) -> (f64, u32) {
        (self.prefill_tokens as f64, self.prefill_n)
    }

    fn add(&mut self, o: &EndpointLoad) {
        self.n = self.n.saturating_add(o.n);
        self.prefill_n = self.prefill_n.saturating_add(o.prefill_n);
        self.prefill_tokens = self.prefill_tokens.saturating_add(o.prefill_tokens);
    }
}

/// In-flight counts by endpoint address, with their prefill part ([`EndpointLoad`]). Missing
/// means zero. Keyed by the address's hash (`crate::state::by_address`), so the scheduler reads a
/// candidate's count with the hash it computed once for that candidate
/// ([`InflightCounts::get_hashed`]).
#[derive(Debug, Clone, Default)]
pub struct InflightCounts {
    counts: ByAddress<EndpointLoad>,
}

impl PartialEq for InflightCounts {
    fn eq(&self, other: &Self) -> bool {
        self.counts.len() == other.counts.len()
            && self.counts.iter().all(|(a, l)| other.counts.get(address_hash(a), a) == Some(l))
    }
}

impl Eq for InflightCounts {}

impl InflightCounts {
    pub fn get(&self, address: &str) -> u32 {
        self.get_hashed(address_hash(address), address)
    }

    /// [`InflightCounts::get`] for an address whose `address_hash` is `hash`.
    pub fn get_hashed(&self, hash: u64, address: &str) -> u32 {
        self.counts.get(hash, address).map_or(0, |l| l.n)
    }

    /// The whole entry of `address` (whose `address_hash` is `hash`): the count, and the requests
    /// in prefill there with their uncached prompt tokens, summed over the VMs that published them.
    pub fn load_hashed(&self, hash: u64, address: &str) -> EndpointLoad {
        self.counts.get(hash, address).copied().unwrap_or_default()
    }

    pub fn total(&self) -> u64 {
        self.counts.values().map(|l| u64::from(l.n)).sum()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, u32)> {
        self.counts.iter().map(|(k, v)| (k, v.n))
    }

    /// Reads the counts of a record (`crate::base::codec`): `u32 n · n × (str address · u32 n ·
    /// u32 prefill_n · u64 prefill_tokens)`. A structurally malformed list refuses the record
    /// whole; an entry with a zero count is dropped, and a prefill part beyond the count is
    /// garbled (the count alone is kept).
    pub fn read(r: &mut Reader<'_>) -> Option<Self> {
        // An entry takes at least 20 bytes.
        let n = r.count(20, usize::MAX)?;
        let mut counts = ByAddress::default();
        for _ in 0..n {
            let addr = r.str(MAX_NAME_BYTES)?;
            let l = EndpointLoad { n: r.u32()?, prefill_n: r.u32()?, prefill_tokens: r.u64()? };
            if addr.is_empty() || l.n == 0 {
                continue;
            }
            let l = if l.prefill_n > l.n { EndpointLoad { n: l.n, ..Default::default() } } else { l };
            counts.insert(address_hash(addr), addr, l);
        }
        Some(Self { counts })
    }

    /// Writes the counts (see [`InflightCounts::read`]), sorted by address so equal contents
    /// give equal bytes.
    pub fn write(&self, w: &mut Writer) {
        let mut entries: Vec<(&str, &EndpointLoad)> = self.counts.iter().filter(|(_, l)| l.n > 0).collect();
        entries.sort_by(|a, b| a.0.cmp(b.0));
        w.len(entries.len());
        for (addr, l) in entries {
            w.str(addr).u32(l.n).u32(l.prefill_n).u64(l.prefill_tokens);
        }
    }

    /// Counts from `addr=n` / `addr=n/prefill_n/prefill_tokens` entries separated by `;`
    /// (malformed entries skipped): a compact way to write them in tests and fuzz targets.
    pub fn from_text(bytes: &[u8]) -> Self {
        let mut c = Self::default();
        let Ok(text) = std::str::from_utf8(bytes) else { return c };
        for entry in text.split(';') {
            let Some((addr, v)) = entry.rsplit_once('=') else { continue };
            let mut parts = v.split('/').map(|p| p.parse::<u64>().ok());
            let l = match (parts.next(), parts.next(), parts.next(), parts.next()) {
                (Some(Some(n)), None, None, None) => EndpointLoad { n: n as u32, ..Default::default() },
                (Some(Some(n)), Some(Some(pn)), Some(Some(pt)), None) => {
                    EndpointLoad { n: n as u32, prefill_n: pn as u32, prefill_tokens: pt }
                }
                _ => continue,
            };
            if addr.is_empty() || l.n == 0 {
                continue;
            }
            let l = if l.prefill_n > l.n { EndpointLoad { n: l.n, ..Default::default() } } else { l };
            c.counts.insert(address_hash(addr), addr, l);
        }
        c
    }

    /// Adds `other`'s counts to these.
    fn add_all(&mut self, other: &InflightCounts) {
        for (a, l) in other.counts.iter() {
            self.counts.update(address_hash(a), a, |e| e.add(l));
        }
    }

    /// Applies `delta`, saturating at 0 and u32::MAX; returns the new count. The prefill part
    /// never exceeds the count (a request that ended is no longer in prefill).
    fn apply(&mut self, address: &str, delta: i32) -> u32 {
        let hash = address_hash(address);
        let cur = self.counts.get(hash, address).copied().unwrap_or_default();
        let next = if delta >= 0 {
            cur.n.saturating_add(delta as u32)
        } else {
            cur.n.saturating_sub(delta.unsigned_abs())
        };
        if next == 0 {
            self.counts.remove(hash, address);
        } else {
            let mut l = EndpointLoad { n: next, ..cur };
            if l.prefill_n > next {
                l.prefill_n = next;
            }
            self.counts.insert(hash, address, l);
        }
        next
    }

    /// Sets the prefill part of `address` (capped at its count; nothing without a count).
    fn set_prefill(&mut self, address: &str, tokens: f64, n: u32) {
        let hash = address_hash(address);
        if let Some(l) = self.counts.get_mut(hash, address) {
            l.prefill_n = n.min(l.n);
            l.prefill_tokens = if l.prefill_n == 0 || !tokens.is_finite() || tokens <= 0.0 {
                0
            } else {
                // Saturating float-to-int conversion; prompt tokens are far below u64::MAX.
                tokens.round() as u64
            };
        }
    }
}

/// The shared-data key of slot `k`.
pub fn slot_key(k: usize) -> String {
    format!("{SLOT_KEY_PREFIX}{k}")
}

/// One VM's published record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotRecord {
    /// The owning VM's random nonce (never 0).
    pub owner: u64,
    /// When the owner last wrote, in ms.
    pub heartbeat_ms: u64,
    pub counts: InflightCounts,
}

/// What a slot holds.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Slot {
    /// A record this build reads.
    Record(SlotRecord),
    /// Empty, or not a well-formed record: free for the taking.
    Free,
    /// A record of a version this build does not read: a VM of another build owns it. Never
    /// counted, never claimed or rewritten.
    Other,
}

fn read_slot(bytes: &[u8]) -> Slot {
    match codec::open(bytes, Tag::InflightVm) {
        Ok(mut r) => {
            let rec = (|| {
                let owner = r.u64().filter(|&o| o != 0)?;
                let heartbeat_ms = r.u64()?;
                let counts = InflightCounts::read(&mut r)?;
                r.finish()?;
                Some(SlotRecord { owner, heartbeat_ms, counts })
            })();
            rec.map_or(Slot::Free, Slot::Record)
        }
        Err(Refusal::UnknownVersion(_)) => Slot::Other,
        Err(Refusal::Malformed) => Slot::Free,
    }
}

/// Parses a slot record (tag `InflightVm`: `u64 owner · u64 heartbeat_ms · counts`,
/// [`InflightCounts::read`]). `None` for an empty value (a free
/// slot), anything that is not a well-formed record (treated as free), or a record of another
/// build's version (skipped: not counted, and its slot is never taken). Pure; never panics.
pub fn decode(bytes: &[u8]) -> Option<SlotRecord> {
    match read_slot(bytes) {
        Slot::Record(r) => Some(r),
        Slot::Free | Slot::Other => None,
    }
}

/// Serialises a slot record (see [`decode`]).
pub fn encode(rec: &SlotRecord) -> Vec<u8> {
    encode_record(rec.owner, rec.heartbeat_ms, &rec.counts)
}

fn encode_record(owner: u64, heartbeat_ms: u64, counts: &InflightCounts) -> Vec<u8> {
    let mut w = Writer::new(Tag::InflightVm, 20 + counts.counts.len() * 40);
    w.u64(owner).u64(heartbeat_ms);
    counts.write(&mut w);
    w.finish()
}

/// The live VMs of this Envoy: (slot, owner nonce) of every VM record not older than [`TTL_MS`] at `now_ms` (the poller reads their placement rings,
/// `crate::state::feed`). One host read per written slot.
pub fn live_vms(store: &dyn SharedStore, now_ms: u64) -> Result<Vec<(usize, u64)>, StoreError> {
    let mut out = Vec::new();
    for k in 0..MAX_SLOTS {
        let Some((bytes, _)) = store.get(&slot_key(k))? else { break };
        if let Some(rec) = decode(&bytes) {
            if now_ms.saturating_sub(rec.heartbeat_ms) <= TTL_MS {
                out.push((k, rec.owner));
            }
        }
    }
    Ok(out)
}

/// This VM's in-flight counts and its slot in shared data. One per VM, kept for its lifetime.
#[derive(Debug)]
pub struct InflightTable {
    owner: u64,
    local: InflightCounts,
    /// The slot this VM believes it owns (verified on every write).
    slot: Option<usize>,
    last_beat_ms: u64,
    /// Decoded records of the other slots, by CAS token, so unchanged ones are not re-parsed.
    cache: Vec<Option<(u32, Option<SlotRecord>)>>,
}

/// Adds to `total` the live records (not `owner`'s, not older than [`TTL_MS`]) of the VM slots,
/// skipping slot `skip`, until the first never-written one. `cache` keeps each slot's
/// decoded record by CAS token, so an unchanged record is not parsed again.
fn scan(
    store: &dyn SharedStore,
    now_ms: u64,
    owner: u64,
    skip: Option<usize>,
    cache: &mut Vec<Option<(u32, Option<SlotRecord>)>>,
    total: &mut InflightCounts,
) -> Result<(), StoreError> {
    for k in 0..MAX_SLOTS {
        if Some(k) == skip {
            continue;
        }
        let Some((bytes, cas)) = store.get(&slot_key(k))? else {
            break;
        };
        if cache.len() <= k {
            cache.resize(k + 1, None);
        }
        let Some(entry) = cache.get_mut(k) else { continue };
        if !matches!(entry, Some((c, _)) if *c == cas) {
            *entry = Some((cas, decode(&bytes)));
        }
        if let Some((_, Some(rec))) = entry {
            if rec.owner != owner && now_ms.saturating_sub(rec.heartbeat_ms) <= TTL_MS {
                total.add_all(&rec.counts);
            }
        }
    }
    Ok(())
}

impl InflightTable {
    /// `owner`: a random non-zero u64 for this VM (host entropy).
    pub fn new(owner: u64) -> Self {
        Self {
            owner: owner.max(1),
            local: InflightCounts::default(),
            slot: None,
            last_beat_ms: 0,
            cache: Vec::new(),
        }
    }

    pub fn owner(&self) -> u64 {
        self.owner
    }

    /// The slot this VM writes, once it has claimed one.
    pub fn slot(&self) -> Option<usize> {
        self.slot
    }

    /// The other live VMs of this Envoy as of the last [`InflightTable::read`]: (slot, owner
    /// nonce) of each record that is not ours and not older than
    /// [`TTL_MS`] at `now_ms` (`crate::state::feed` reads their placements).
    pub fn live_others(&self, now_ms: u64, out: &mut Vec<(usize, u64)>) {
        out.clear();
        for (k, entry) in self.cache.iter().enumerate() {
            if let Some((_, Some(rec))) = entry {
                if Some(k) != self.slot
                    && rec.owner != self.owner
                    && now_ms.saturating_sub(rec.heartbeat_ms) <= TTL_MS
                {
                    out.push((k, rec.owner));
                }
            }
        }
    }

    /// This VM's own counts.
    pub fn local(&self) -> &InflightCounts {
        &self.local
    }

    /// Every live VM's counts summed: ours from memory, the others' from their slots (records
    /// older than [`TTL_MS`] ignored). The scan stops at the first never-written slot.
    pub fn read(&mut self, store: &dyn SharedStore, now_ms: u64) -> Result<InflightCounts, StoreError> {
        let mut total = self.local.clone();
        scan(store, now_ms, self.owner, self.slot, &mut self.cache, &mut total)?;
        Ok(total)
    }

    /// Adds `delta` (+1 on send, -1 on finish) to this VM's count for `address`, then publishes.
    /// Returns this VM's new count. The local count changes even if publishing fails (the next
    /// sync publishes it).
    pub fn adjust(
        &mut self,
        store: &dyn SharedStore,
        address: &str,
        delta: i32,
        now_ms: u64,
    ) -> Result<u32, StoreError> {
        let n = self.local.apply(address, delta);
        self.sync(store, now_ms)?;
        Ok(n)
    }

    /// [`InflightTable::adjust`] that also sets the prefill part of `address` to this VM's
    /// scheduler ledger (`prefill` = (tokens, count) still in prefill there), in the same write.
    pub fn adjust_with_prefill(
        &mut self,
        store: &dyn SharedStore,
        address: &str,
        delta: i32,
        prefill: (f64, u32),
        now_ms: u64,
    ) -> Result<u32, StoreError> {
        let n = self.local.apply(address, delta);
        self.local.set_prefill(address, prefill.0, prefill.1);
        self.sync(store, now_ms)?;
        Ok(n)
    }

    /// A request's prefill on `address` ended (its first response byte): sets the prefill part
    /// to this VM's ledger (`prefill` = (tokens, count)) and publishes it, so that the other
    /// workers stop counting that prefill ahead of theirs. Nothing to publish (the count is
    /// unchanged) when the part was already equal.
    pub fn set_prefill(
        &mut self,
        store: &dyn SharedStore,
        address: &str,
        prefill: (f64, u32),
        now_ms: u64,
    ) -> Result<(), StoreError> {
        let hash = address_hash(address);
        let before = self.local.counts.get(hash, address).copied();
        self.local.set_prefill(address, prefill.0, prefill.1);
        if self.local.counts.get(hash, address).copied() == before {
            return Ok(());
        }
        self.sync(store, now_ms)
    }

    /// The root's tick: verify the slot is still ours (one read) and rewrite the heartbeat when
    /// due. A VM with nothing ever counted has no slot and does nothing.
    pub fn tick(&mut self, store: &dyn SharedStore, now_ms: u64) -> Result<(), StoreError> {
        let Some(k) = self.slot else {
            return Ok(());
        };
        let beat_due = now_ms.saturating_sub(self.last_beat_ms) >= HEARTBEAT_MS;
        match store.get(&slot_key(k))? {
            Some((bytes, _)) if !beat_due && decode(&bytes).is_some_and(|r| r.owner == self.owner) => Ok(()),
            _ => self.sync(store, now_ms),
        }
    }

    /// Frees the slot (an empty record) if this VM still owns it: call from the root's `on_done`.
    pub fn release(&mut self, store: &dyn SharedStore) -> Result<(), StoreError> {
        let Some(k) = self.slot.take() else {
            return Ok(());
        };
        let key = slot_key(k);
        if let Some((bytes, cas)) = store.get(&key)? {
            if decode(&bytes).is_some_and(|r| r.owner == self.owner) {
                return store.set(&key, b"", cas);
            }
        }
        Ok(())
    }

    /// Publishes the local counts in our slot, verifying ownership; claims (or moves to) another
    /// slot when we have none or lost ours.
    fn sync(&mut self, store: &dyn SharedStore, now_ms: u64) -> Result<(), StoreError> {
        let mut last = StoreError::CasMismatch;
        for _ in 0..MAX_SYNC_ATTEMPTS {
            let Some(k) = self.slot else {
                return self.claim(store, now_ms);
            };
            let key = slot_key(k);
            let Some((bytes, cas)) = store.get(&key)? else {
                // Shared data has no delete; treat it as lost and claim again.
                self.slot = None;
                continue;
            };
            if decode(&bytes).is_none_or(|r| r.owner != self.owner) {
                // Another VM owns this slot now: move, with our full state.
                self.slot = None;
                continue;
            }
            match store.set(&key, &encode_record(self.owner, now_ms, &self.local), cas) {
                Ok(()) => {
                    self.last_beat_ms = now_ms;
                    return Ok(());
                }
                Err(StoreError::CasMismatch) => last = StoreError::CasMismatch,
                Err(e) => return Err(e),
            }
        }
        Err(last)
    }

    /// Takes the lowest slot that is never written, free, garbled or stale, and writes our record
    /// there.
    fn claim(&mut self, store: &dyn SharedStore, now_ms: u64) -> Result<(), StoreError> {
        let mine = encode_record(self.owner, now_ms, &self.local);
        for k in 0..MAX_SLOTS {
            let key = slot_key(k);
            let written = match store.get(&key)? {
                None => match store.set(&key, &mine, CREATE_CAS) {
                    Ok(()) => true,
                    Err(StoreError::CasMismatch) => false,
                    Err(e) => return Err(e),
                },
                Some((bytes, cas)) => {
                    let reusable = match read_slot(&bytes) {
                        Slot::Free => true,
                        Slot::Record(r) => {
                            r.owner == self.owner || now_ms.saturating_sub(r.heartbeat_ms) > TTL_MS
                        }
                        // A live VM of another build (its record is unreadable here): never taken.
                        Slot::Other => false,
                    };
                    reusable
                        && match store.set(&key, &mine, cas) {
                            Ok(()) => true,
                            Err(StoreError::CasMismatch) => false,
                            Err(e) => return Err(e),
                        }
                }
            };
            if written {
                self.slot = Some(k);
                self.last_beat_ms = now_ms;
                return Ok(());
            }
        }
        Err(StoreError::Host(format!("all {MAX_SLOTS} in-flight slots are live")))
    }
}

#[cfg(test)]
mod tests;
