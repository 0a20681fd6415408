//! The one binary codec of every shared-data record and every peer message.
//!
//! # Framing
//! Every record is `tag u8 ‖ version u8 ‖ fields`. Fields are fixed-width little-endian integers
//! (`u8`, `u16`, `u32`, `u64`), `f32`/`f64` by their bits, and length-prefixed byte strings
//! (`u32` length, then the bytes; UTF-8 for strings) whose length every reader bounds
//! explicitly. Counts of repeated items are `u32` and are checked against the bytes left before
//! anything is allocated. A reader refuses a record whole: a wrong tag, a truncation, a length
//! or count beyond its bound, a flag byte other than 0/1, a string that is not UTF-8, or bytes
//! left over after the last field ([`Reader::finish`]). [`Reader`] never panics: every take is
//! checked and returns `Option`.
//!
//! An empty value is not a record: shared data has no delete, and every key uses the empty
//! value for "removed" / "never written" as before.
//!
//! # Tags and versions
//! One table, [`Tag`]: two records can never share a tag. Each tag has a current version
//! ([`Tag::current`]); a format change of a record takes the next version of its tag.
//!
//! | tag  | record                                         | key / message                         | version |
//! |------|------------------------------------------------|---------------------------------------|---------|
//! | 0x01 | snapshot (`state::snapshot`)                   | `inference-picker/snapshot`           | 1       |
//! | 0x02 | snapshot version number                        | `inference-picker/snapshot-version`   | 1       |
//! | 0x03 | in-flight record of a VM (`state::inflight`)   | `inference-picker/inflight/<k>`       | 1       |
//! | 0x04 | reserved: peer in-flight record (removed)      | was `inference-picker/inflight-peer/<k>` | 1    |
//! | 0x05 | peer prefix-record batch (`poll::peers`)       | POST body on the peers path           | 1       |
//! | 0x06 | reserved: peer load report (removed)           | POST body on the peers path (answered 204) | 1  |
//! | 0x07 | prefix shard (`state::prefix_shared`)          | `inference-picker/prefix2/<nnnn>`     | 1       |
//! | 0x08 | TTFT rate shard (`state::rates`)               | `inference-picker/rate/<nn>`          | 1       |
//! | 0x09 | poller lease (`poll::lease`)                   | `inference-picker/poller-lease`       | 1       |
//! | 0x0A | passive health (`state::health`)               | `inference-picker/health`             | 1       |
//! | 0x0B | flow-control ledger (`flow::ledger`)           | `inference-picker/flow/<group>`       | 1       |
//! | 0x0C | parsed request (`request::pools`)              | filter state passed between pools     | 1       |
//! | 0x0D | worker-id sequence (`flow::admission`)         | `inference-picker/flow-worker-seq`    | 1       |
//! | 0x0E | this gateway's peer sender nonce (`poll::peers`) | `inference-picker/peers/load-sender` | 1      |
//! | 0x0F | reserved: peer count (removed)                 | was `inference-picker/peers/count`    | 1       |
//! | 0x10 | configuration digest (`config::live`)          | `inference-picker/config-version`     | 1       |
//!
//! The reserved tags belonged to the load exchange between replicas, which was removed: nothing
//! writes them, and they are never given to another record. Older builds still write them
//! during a rolling upgrade: an in-flight peer record or a peer count is read by nothing here,
//! and a load report POSTed by an older replica is answered 204 and counted
//! (`inference_picker_records_skipped_total{reason="peer_load"}`, `poll::peers`).
//!
//! The configuration document itself (`inference-picker/config`) stays the JSON document it is
//! (it is parsed as configuration, with the configuration's own error reporting).
//!
//! # Mixed versions (a rolling upgrade)
//! Two builds share one store when they run on one gateway with the same `vm_id`, and replicas
//! of different builds exchange peer messages. A reader that finds its tag with a version it
//! does not know ([`Refusal::UnknownVersion`]) **skips** the record: it is absent to that
//! reader, it is counted ([`take_skipped`]; the host reports `inference_picker_records_skipped_total`
//! by record), and it is never treated as corrupt where rewriting it would destroy a newer
//! writer's data. Per record:
//! - snapshot: the reader keeps its last snapshot (and re-reads at the next refresh) until the
//!   poller publishes one it reads; an unknown version-number record is "no news";
//! - in-flight VM record: not added to the counts, and the slot stays occupied (never claimed or
//!   rewritten by the older build: it belongs to a live VM of the other build; the older VM takes
//!   another slot);
//! - peer prefix and placement batches: answered 204 and ignored (counted), so that a replica of
//!   the other build sees no error and logs no send failure; a malformed body is still 400;
//! - prefix shard and rate shard: a miss (no records, the prior rate) for the reader, and the
//!   writer leaves the shard alone (no clobbering of the newer build's table);
//! - lease: an unreadable holder, handled as a garbled record already was: observed, and taken
//!   over only when it stays unchanged for the lease ttl (a live holder of the other build
//!   renews it, so it is never taken from it; a dead one is replaced);
//! - health: an empty view (plus this worker's own ejections), and no write (an ejection decided
//!   here is kept locally, as a lost write already was);
//! - flow ledger: the update is not written; the queue handles it like a store error;
//! - parsed request: not reused; the filter parses the body itself;
//! - worker-id sequence: no id from shared data; the VM takes a random one (as on a store error);
//! - sender nonce: the poller does not send placement batches (it would overwrite the other
//!   build's nonce), and the filter treats a batch as possibly its own, so it is not applied;
//! - configuration digest: no hint; the filter reads the document and compares its digest.
//!
//! A build of the *next* release reads both versions. The cargo feature `codec-next` (tests
//! only, never shipped) simulates it: every writer emits the next version, every reader accepts
//! the current and the next.

use std::cell::Cell;

/// Every record's tag. The discriminants are the wire values; never reuse one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Tag {
    Snapshot = 0x01,
    SnapshotVersion = 0x02,
    InflightVm = 0x03,
    /// Reserved (the removed load exchange): nothing writes or reads it.
    InflightPeer = 0x04,
    PeerPrefixBatch = 0x05,
    /// Reserved (the removed load exchange): nothing writes it; an older replica's report is
    /// answered 204 and counted (`crate::poll::peers::is_retired_load_report`).
    PeerLoadReport = 0x06,
    PrefixShard = 0x07,
    RateShard = 0x08,
    Lease = 0x09,
    Health = 0x0A,
    FlowLedger = 0x0B,
    ParsedRequest = 0x0C,
    WorkerSeq = 0x0D,
    /// This gateway's sender nonce (`crate::poll::peers::SENDER_KEY`).
    LoadSender = 0x0E,
    /// Reserved (the removed load exchange): nothing writes or reads it.
    PeerCount = 0x0F,
    ConfigVersion = 0x10,
    Placement = 0x11,
    PeerPlacementBatch = 0x12,
}

/// Every tag, in wire order.
pub const ALL_TAGS: [Tag; 18] = [
    Tag::Snapshot,
    Tag::SnapshotVersion,
    Tag::InflightVm,
    Tag::InflightPeer,
    Tag::PeerPrefixBatch,
    Tag::PeerLoadReport,
    Tag::PrefixShard,
    Tag::RateShard,
    Tag::Lease,
    Tag::Health,
    Tag::FlowLedger,
    Tag::ParsedRequest,
    Tag::WorkerSeq,
    Tag::LoadSender,
    Tag::PeerCount,
    Tag::ConfigVersion,
    Tag::Placement,
    Tag::PeerPlacementBatch,
];

impl Tag {
    /// The version this release writes and reads.
    pub const fn current(self) -> u8 {
        1
    }

    /// The version writers emit: the current one, or the next with the `codec-next` feature.
    pub const fn write_version(self) -> u8 {
        if cfg!(feature = "codec-next") {
            self.current() + 1
        } else {
            self.current()
        }
    }

    /// Whether this build reads `version` of this tag.
    pub const fn reads(self, version: u8) -> bool {
        version == self.current() || (cfg!(feature = "codec-next") && version == self.current() + 1)
    }

    /// The name in metrics and logs.
    pub const fn name(self) -> &'static str {
        match self {
            Tag::Snapshot => "snapshot",
            Tag::SnapshotVersion => "snapshot_version",
            Tag::InflightVm => "inflight",
            Tag::InflightPeer => "inflight_peer",
            Tag::PeerPrefixBatch => "peer_prefixes",
            Tag::PeerLoadReport => "peer_load",
            Tag::PrefixShard => "prefix_shard",
            Tag::RateShard => "rate_shard",
            Tag::Lease => "lease",
            Tag::Health => "health",
            Tag::FlowLedger => "flow_ledger",
            Tag::ParsedRequest => "parsed_request",
            Tag::WorkerSeq => "worker_seq",
            Tag::LoadSender => "load_sender",
            Tag::PeerCount => "peer_count",
            Tag::ConfigVersion => "config_version",
            Tag::Placement => "placement",
            Tag::PeerPlacementBatch => "peer_placements",
        }
    }

    fn index(self) -> usize {
        usize::from(self as u8).saturating_sub(1)
    }
}

/// Why [`open`] refused a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Not a record of this tag (another tag, too short, garbage).
    Malformed,
    /// This tag, in a version this build does not read (another build's record): skip it.
    UnknownVersion(u8),
}

thread_local! {
    static SKIPPED: [Cell<u64>; ALL_TAGS.len()] = const { [const { Cell::new(0) }; ALL_TAGS.len()] };
}

/// Counts one skipped record of `tag` (an unknown version).
fn note_skip(tag: Tag) {
    SKIPPED.with(|s| {
        if let Some(c) = s.get(tag.index()) {
            c.set(c.get().saturating_add(1));
        }
    });
}

/// Records of each tag skipped by this VM (unknown versions) since the last call, the tags with
/// none left out; the counts restart at 0. The host adds them to the
/// `inference_picker_records_skipped_total` counter.
pub fn take_skipped() -> Vec<(Tag, u64)> {
    SKIPPED.with(|s| {
        ALL_TAGS.iter().zip(s.iter()).map(|(t, c)| (*t, c.replace(0))).filter(|(_, n)| *n > 0).collect()
    })
}

/// Opens a record of `tag`: checks its header and returns a reader of its fields. An unknown
/// version is counted as skipped ([`take_skipped`]).
pub fn open(bytes: &[u8], tag: Tag) -> Result<Reader<'_>, Refusal> {
    let (head, rest) = bytes.split_first_chunk::<2>().ok_or(Refusal::Malformed)?;
    if head[0] != tag as u8 {
        return Err(Refusal::Malformed);
    }
    if !tag.reads(head[1]) {
        note_skip(tag);
        return Err(Refusal::UnknownVersion(head[1]));
    }
    Ok(Reader { rest, version: head[1] })
}

/// The tag byte of a value, if it has one (to dispatch a message that may be one of several).
pub fn tag_byte(bytes: &[u8]) -> Option<u8> {
    bytes.first().copied()
}

/// Builds one record.
#[derive(Debug)]
pub struct Writer {
    out: Vec<u8>,
}

impl Writer {
    /// A record of `tag` in this build's write version, with room for `capacity` field bytes.
    pub fn new(tag: Tag, capacity: usize) -> Self {
        Self::with_version(tag, tag.write_version(), capacity)
    }

    /// A record of `tag` in an explicit version (tests: another build's record).
    pub fn with_version(tag: Tag, version: u8, capacity: usize) -> Self {
        let mut out = Vec::with_capacity(capacity.saturating_add(2));
        out.push(tag as u8);
        out.push(version);
        Self { out }
    }

    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.out.push(v);
        self
    }
    pub fn bool(&mut self, v: bool) -> &mut Self {
        self.u8(u8::from(v))
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.out.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.out.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn i32(&mut self, v: i32) -> &mut Self {
        self.out.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.out.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn f32(&mut self, v: f32) -> &mut Self {
        self.u32(v.to_bits())
    }
    pub fn f64(&mut self, v: f64) -> &mut Self {
        self.u64(v.to_bits())
    }
    /// A count or length, as `u32` (saturating; readers bound it far below).
    pub fn len(&mut self, n: usize) -> &mut Self {
        self.u32(u32::try_from(n).unwrap_or(u32::MAX))
    }
    /// Length-prefixed bytes.
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.len(b.len());
        self.out.extend_from_slice(b);
        self
    }
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.bytes(s.as_bytes())
    }
    /// Bytes with no prefix (fixed-size items whose count was written before).
    pub fn raw(&mut self, b: &[u8]) -> &mut Self {
        self.out.extend_from_slice(b);
        self
    }
    /// `0`, or `1` then the value.
    pub fn opt<T>(&mut self, v: Option<T>, put: impl FnOnce(&mut Self, T)) -> &mut Self {
        match v {
            Some(x) => {
                self.u8(1);
                put(self, x);
            }
            None => {
                self.u8(0);
            }
        }
        self
    }
    pub fn finish(self) -> Vec<u8> {
        self.out
    }
}

/// Bounds-checked reads from the front of a record's fields. Never panics.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    rest: &'a [u8],
    version: u8,
}

impl<'a> Reader<'a> {
    /// The record's version (one this build reads).
    pub fn version(&self) -> u8 {
        self.version
    }

    /// The bytes not read yet.
    pub fn remaining(&self) -> &'a [u8] {
        self.rest
    }

    pub fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.rest.len() < n {
            return None;
        }
        let (head, rest) = self.rest.split_at(n);
        self.rest = rest;
        Some(head)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.rest.split_first_chunk::<N>()?;
        self.rest = rest;
        Some(*head)
    }

    pub fn u8(&mut self) -> Option<u8> {
        Some(self.array::<1>()?[0])
    }
    /// `0` or `1`; anything else refuses the record.
    pub fn bool(&mut self) -> Option<bool> {
        match self.u8()? {
            0 => Some(false),
            1 => Some(true),
            _ => None,
        }
    }
    pub fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes(self.array()?))
    }
    pub fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.array()?))
    }
    pub fn i32(&mut self) -> Option<i32> {
        Some(i32::from_le_bytes(self.array()?))
    }
    pub fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.array()?))
    }
    pub fn f32(&mut self) -> Option<f32> {
        self.u32().map(f32::from_bits)
    }
    pub fn f64(&mut self) -> Option<f64> {
        self.u64().map(f64::from_bits)
    }

    /// A count of items each at least `min_bytes` long, at most `max`, checked against what is
    /// left (so nothing is allocated for a count the record cannot hold).
    pub fn count(&mut self, min_bytes: usize, max: usize) -> Option<usize> {
        let n = usize::try_from(self.u32()?).ok()?;
        (n <= max && n <= self.rest.len() / min_bytes.max(1)).then_some(n)
    }

    /// Length-prefixed bytes, at most `max` long.
    pub fn bytes(&mut self, max: usize) -> Option<&'a [u8]> {
        let n = usize::try_from(self.u32()?).ok()?;
        if n > max {
            return None;
        }
        self.take(n)
    }

    /// A length-prefixed UTF-8 string, at most `max` bytes.
    pub fn str(&mut self, max: usize) -> Option<&'a str> {
        std::str::from_utf8(self.bytes(max)?).ok()
    }

    pub fn string(&mut self, max: usize) -> Option<String> {
        self.str(max).map(str::to_string)
    }

    /// `0` → `None`, `1` → the value; any other flag refuses the record.
    pub fn opt<T>(&mut self, read: impl FnOnce(&mut Self) -> Option<T>) -> Option<Option<T>> {
        match self.u8()? {
            0 => Some(None),
            1 => read(self).map(Some),
            _ => None,
        }
    }

    /// The end of the record: `Some` only when every byte was read.
    pub fn finish(self) -> Option<()> {
        self.rest.is_empty().then_some(())
    }
}

/// A record holding one `u64` (counters, nonces, version numbers).
pub fn encode_u64(tag: Tag, v: u64) -> Vec<u8> {
    let mut w = Writer::new(tag, 8);
    w.u64(v);
    w.finish()
}

/// Reads a record written by [`encode_u64`].
pub fn decode_u64(bytes: &[u8], tag: Tag) -> Result<u64, Refusal> {
    let mut r = open(bytes, tag)?;
    let v = r.u64().ok_or(Refusal::Malformed)?;
    r.finish().ok_or(Refusal::Malformed)?;
    Ok(v)
}

/// `bytes` (a record) relabelled as `version` of its tag: another build's record, for tests.
#[cfg(test)]
pub fn as_version(bytes: &[u8], version: u8) -> Vec<u8> {
    let mut b = bytes.to_vec();
    if let Some(v) = b.get_mut(1) {
        *v = version;
    }
    b
}

/// `bytes` as the release after this one writes it (the version after the current one of its
/// tag): a default build skips it, a `codec-next` build reads it.
#[cfg(test)]
pub fn as_next(bytes: &[u8], tag: Tag) -> Vec<u8> {
    as_version(bytes, tag.current() + 1)
}

/// Most bytes of an endpoint address, a model or adapter name in a record.
pub const MAX_NAME_BYTES: usize = 4096;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_are_unique_and_in_order() {
        for (i, t) in ALL_TAGS.iter().enumerate() {
            assert_eq!(*t as u8 as usize, i + 1, "{t:?}");
            assert_eq!(t.index(), i);
        }
        let mut names: Vec<&str> = ALL_TAGS.iter().map(|t| t.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ALL_TAGS.len());
    }

    #[test]
    fn fields_round_trip() {
        let mut w = Writer::new(Tag::Health, 0);
        w.u8(7).bool(true).u16(0xBEEF).u32(5).i32(-3).u64(u64::MAX).f32(1.5).f64(-0.0).str("é").bytes(b"xy");
        w.opt(Some(9u32), |w, v| {
            w.u32(v);
        });
        w.opt(None::<u32>, |w, v| {
            w.u32(v);
        });
        let b = w.finish();
        assert_eq!(&b[..2], &[Tag::Health as u8, Tag::Health.write_version()]);
        let mut r = open(&b, Tag::Health).unwrap();
        assert_eq!(r.u8(), Some(7));
        assert_eq!(r.bool(), Some(true));
        assert_eq!(r.u16(), Some(0xBEEF));
        assert_eq!(r.u32(), Some(5));
        assert_eq!(r.i32(), Some(-3));
        assert_eq!(r.u64(), Some(u64::MAX));
        assert_eq!(r.f32(), Some(1.5));
        assert_eq!(r.f64().map(f64::to_bits), Some((-0.0f64).to_bits()));
        assert_eq!(r.str(8), Some("é"));
        assert_eq!(r.bytes(8), Some(&b"xy"[..]));
        assert_eq!(r.opt(Reader::u32), Some(Some(9)));
        assert_eq!(r.opt(Reader::u32), Some(None));
        assert_eq!(r.finish(), Some(()));
    }

    #[test]
    fn every_read_is_checked() {
        let b = encode_u64(Tag::WorkerSeq, 42);
        assert_eq!(decode_u64(&b, Tag::WorkerSeq), Ok(42));
        for cut in 0..b.len() {
            assert!(decode_u64(&b[..cut], Tag::WorkerSeq).is_err(), "cut at {cut}");
        }
        let mut longer = b.clone();
        longer.push(0);
        assert_eq!(decode_u64(&longer, Tag::WorkerSeq), Err(Refusal::Malformed));
        // Another tag is not this record.
        assert_eq!(decode_u64(&b, Tag::PeerCount), Err(Refusal::Malformed));
        // Bounds: a length over its maximum, a count beyond the bytes left, a bad flag.
        let mut w = Writer::new(Tag::Health, 0);
        w.str("abcdef");
        let b = w.finish();
        assert_eq!(open(&b, Tag::Health).unwrap().str(5), None);
        assert_eq!(open(&b, Tag::Health).unwrap().count(2, usize::MAX), None);
        let mut w = Writer::new(Tag::Health, 0);
        w.u32(3).raw(&[0; 5]);
        let b = w.finish();
        assert_eq!(open(&b, Tag::Health).unwrap().count(2, usize::MAX), None);
        assert_eq!(open(&b, Tag::Health).unwrap().count(1, 2), None);
        assert_eq!(open(&b, Tag::Health).unwrap().count(1, 5), Some(3));
        let mut w = Writer::new(Tag::Health, 0);
        w.u8(2);
        assert_eq!(open(&w.finish(), Tag::Health).unwrap().opt(Reader::u8), None);
        // Invalid UTF-8.
        let mut w = Writer::new(Tag::Health, 0);
        w.bytes(&[0xff, 0xfe]);
        assert_eq!(open(&w.finish(), Tag::Health).unwrap().str(8), None);
    }

    #[test]
    fn unknown_versions_are_skipped_and_counted() {
        take_skipped();
        let v = Tag::Lease.current() + 5;
        let b = Writer::with_version(Tag::Lease, v, 0).finish();
        assert_eq!(open(&b, Tag::Lease).err(), Some(Refusal::UnknownVersion(v)));
        assert_eq!(open(&b, Tag::Lease).err(), Some(Refusal::UnknownVersion(v)));
        assert_eq!(take_skipped(), vec![(Tag::Lease, 2)]);
        assert_eq!(take_skipped(), vec![]);
        // The current version is read by every build.
        let cur = Writer::with_version(Tag::Lease, Tag::Lease.current(), 0).finish();
        assert!(open(&cur, Tag::Lease).is_ok());
    }

    /// A default build skips what a `codec-next` build writes; a `codec-next` build reads both.
    #[test]
    fn the_next_release_and_this_one() {
        for t in ALL_TAGS {
            let next = Writer::with_version(t, t.current() + 1, 0).finish();
            let cur = Writer::with_version(t, t.current(), 0).finish();
            assert!(open(&cur, t).is_ok(), "{t:?}");
            if cfg!(feature = "codec-next") {
                assert!(open(&next, t).is_ok(), "{t:?}");
                assert_eq!(t.write_version(), t.current() + 1);
            } else {
                assert_eq!(open(&next, t).err(), Some(Refusal::UnknownVersion(t.current() + 1)));
                assert_eq!(t.write_version(), t.current());
            }
        }
    }
}
