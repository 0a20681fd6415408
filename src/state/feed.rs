//! The placement feed: every pick one Envoy worker makes, replayed into the prefix index of every
//! other worker of the same Envoy, so that each worker knows every pod a prefix was sent to, as
//! one worker alone would.
//!
//! **Why.** Each worker VM keeps its own prefix index (`crate::scheduler::prefix`): exact, and
//! with each pod's LRU modelled from the blocks sent there. The cross-worker prefix table
//! (`crate::state::prefix_shared`) names only the *last* pod a prefix went to, at checkpoint
//! resolution. With several workers, each one knows exactly only its own share of the
//! placements: a hot prefix held by two pods looks held by one, the other holder looks like a
//! miss, and the workers pile its requests on the last holder and move groups off their pods far
//! more often than one worker would. In the replay, shared-prefix-slow at one Envoy with 16
//! workers went from 0.36 s to 4.2 s TTFT p90 (3 seeds); with every placement replayed into
//! every worker's index, 0.31 s.
//!
//! **Layout (bounded).** Each VM writes its placements, in order, into a ring of [`RING`] keys
//! under its in-flight slot number `s` (`crate::state::inflight`: unique among the live VMs):
//! `inference-picker/feed/<s>/<k>`, `k = seq mod RING`. A value is a `crate::base::codec`
//! record (tag `Placement`): `u64 owner nonce ‖ u64 seq ‖ str address ‖ u32 cap ‖ bool foreign ‖
//! u32 count ‖ count × le64 block hash`, at most [`MAX_HASHES`] hashes (`prefix.max_blocks`' limit). `cap`
//! is the writer's index capacity for that pod, so the reader models the same LRU. One VM has
//! one writer: plain writes, no CAS.
//!
//! **Reading.** Before each pick a worker reads, for every other live VM, the ring entries after
//! the last one it took from that VM ([`FeedReader::poll`]), at most `max` per VM (the rest on
//! its next pick): one host read per VM when nothing is new. An entry whose owner is not the
//! VM now in that slot (a VM that died, its slot reused) ends the read; a sequence number
//! behind the cursor means nothing new; one ahead means the reader fell more than [`RING`]
//! behind: it resumes there, the placements in between lost (the shared table still has them).
//!
//! **Failure behaviour.** A store error, a garbled entry or a version this build does not read
//! ends that VM's read for this pick; nothing fails a request. A lost entry only costs the
//! exactness the feed adds: the shared table is still read.

use crate::base::codec::{self, Tag, Writer, MAX_NAME_BYTES};
use crate::base::ports::{SharedStore, StoreError};

/// Prefix of the ring keys: `inference-picker/feed/<slot>/<k>`.
pub const KEY_PREFIX: &str = "inference-picker/feed/";
/// Ring length per VM: placements a reader may fall behind one writer before losing some.
pub const RING: u64 = 64;
/// Most entries a worker takes from one other VM before one pick (the rest before its next).
pub const MAX_PER_PICK: usize = 16;
/// Most block hashes in one placement.
pub const MAX_HASHES: usize = 4096;

/// One pick: `address` received a prompt whose chained block hashes are `hashes`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub address: String,
    /// The writer's index capacity for `address`, in blocks.
    pub cap: u32,
    pub hashes: Vec<u64>,
    /// Received from a peer gateway (`crate::poll::peers`), not picked here: the poller does not
    /// send it on, so placements never echo between gateways.
    pub foreign: bool,
}

/// The key of ring entry `k` of slot `slot`.
pub fn entry_key(slot: usize, k: u64) -> String {
    format!("{KEY_PREFIX}{slot}/{}", k % RING)
}

/// Serialises one ring entry.
pub fn encode(owner: u64, seq: u64, p: &Placement) -> Vec<u8> {
    let n = p.hashes.len().min(MAX_HASHES);
    let mut w = Writer::new(Tag::Placement, 32 + p.address.len() + 8 * n);
    w.u64(owner).u64(seq).str(&p.address).u32(p.cap).bool(p.foreign).len(n);
    for &h in p.hashes.iter().take(n) {
        w.u64(h);
    }
    w.finish()
}

/// Parses one ring entry: `(owner, seq, placement)`, or `None` for anything else (another tag,
/// another build's version, garbage). Never panics.
pub fn decode(bytes: &[u8]) -> Option<(u64, u64, Placement)> {
    let mut r = codec::open(bytes, Tag::Placement).ok()?;
    let owner = r.u64()?;
    let seq = r.u64()?;
    let address = r.string(MAX_NAME_BYTES)?;
    let cap = r.u32()?;
    let foreign = r.bool()?;
    let n = r.count(8, MAX_HASHES)?;
    let mut hashes = Vec::with_capacity(n);
    for _ in 0..n {
        hashes.push(r.u64()?);
    }
    r.finish()?;
    Some((owner, seq, Placement { address, cap, hashes, foreign }))
}

/// This VM's side of the feed: the next sequence number.
#[derive(Debug, Clone, Default)]
pub struct FeedWriter {
    seq: u64,
}

impl FeedWriter {
    /// Writes `p` as this VM's next entry, in `slot`'s ring.
    pub fn publish(
        &mut self,
        store: &dyn SharedStore,
        slot: usize,
        owner: u64,
        p: &Placement,
    ) -> Result<(), StoreError> {
        let seq = self.seq;
        self.seq = self.seq.wrapping_add(1);
        store.set(&entry_key(slot, seq), &encode(owner, seq, p), 0)
    }

    /// Entries written so far.
    pub fn written(&self) -> u64 {
        self.seq
    }
}

/// Where this VM has read each other VM's ring up to.
#[derive(Debug, Clone, Default)]
pub struct FeedReader {
    /// By slot: the owner last read there and the next sequence number to take from it.
    cursors: Vec<Option<(u64, u64)>>,
}

impl FeedReader {
    /// The new entries of the VMs `others` (slot, owner nonce), at most `max` per VM, appended
    /// to `out` in each VM's order. Returns how many ring reads it made.
    pub fn poll(
        &mut self,
        store: &dyn SharedStore,
        others: &[(usize, u64)],
        max: usize,
        out: &mut Vec<Placement>,
    ) -> usize {
        let mut reads = 0;
        for &(slot, owner) in others {
            if self.cursors.len() <= slot {
                self.cursors.resize(slot + 1, None);
            }
            let Some(cursor) = self.cursors.get_mut(slot) else { continue };
            // A VM new in this slot: read its ring from the start (at most RING entries back).
            let mut next = match *cursor {
                Some((o, n)) if o == owner => n,
                _ => 0,
            };
            for _ in 0..max {
                reads += 1;
                let Ok(Some((bytes, _))) = store.get(&entry_key(slot, next)) else { break };
                let Some((o, seq, p)) = decode(&bytes) else { break };
                if o != owner || seq < next {
                    break;
                }
                // seq > next: the ring lapped this reader; resume at what it holds.
                next = seq.wrapping_add(1);
                out.push(p);
            }
            *cursor = Some((owner, next));
        }
        reads
    }
}

/// One VM's whole side of the feed, as the host keeps it: its writer, its cursors, and the
/// buffers of one poll (the other live VMs, the placements read), reused from pick to pick.
#[derive(Debug, Clone, Default)]
pub struct Feed {
    pub writer: FeedWriter,
    pub reader: FeedReader,
    pub others: Vec<(usize, u64)>,
    pub seen: Vec<Placement>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::ports::MemStore;

    fn placement(address: &str, hashes: &[u64]) -> Placement {
        Placement { address: address.into(), cap: 1000, hashes: hashes.to_vec(), foreign: false }
    }

    #[test]
    fn entries_round_trip_and_garbage_is_refused() {
        let p = placement("10.0.0.1:8000", &[1, 2, 3]);
        let bytes = encode(7, 42, &p);
        assert_eq!(decode(&bytes), Some((7, 42, p)));
        assert_eq!(decode(b""), None);
        assert_eq!(decode(&bytes[..bytes.len() - 1]), None, "truncated");
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(decode(&longer), None, "trailing bytes");
        assert_eq!(decode(&codec::as_next(&bytes, Tag::Placement)), None, "another build's version");
        // Never more than MAX_HASHES written.
        let big = placement("a", &vec![9; MAX_HASHES + 10]);
        assert_eq!(decode(&encode(1, 0, &big)).map(|(_, _, p)| p.hashes.len()), Some(MAX_HASHES));
    }

    #[test]
    fn a_reader_takes_each_new_entry_once_in_order() {
        let store = MemStore::new();
        let mut w = FeedWriter::default();
        let mut r = FeedReader::default();
        let mut out = Vec::new();
        assert_eq!(r.poll(&store, &[(3, 7)], 8, &mut out), 1, "one probe when nothing is written");
        assert!(out.is_empty());
        for i in 0..5 {
            w.publish(&store, 3, 7, &placement("a", &[i])).unwrap();
        }
        r.poll(&store, &[(3, 7)], 8, &mut out);
        assert_eq!(out.iter().map(|p| p.hashes[0]).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
        out.clear();
        r.poll(&store, &[(3, 7)], 8, &mut out);
        assert!(out.is_empty(), "nothing twice");
        // At most `max` per poll; the rest on the next.
        for i in 5..15 {
            w.publish(&store, 3, 7, &placement("a", &[i])).unwrap();
        }
        r.poll(&store, &[(3, 7)], 4, &mut out);
        assert_eq!(out.len(), 4);
        r.poll(&store, &[(3, 7)], 100, &mut out);
        assert_eq!(out.iter().map(|p| p.hashes[0]).collect::<Vec<_>>(), (5..15).collect::<Vec<_>>());
        assert_eq!(w.written(), 15);
    }

    #[test]
    fn a_reader_lapped_by_the_ring_resumes_and_a_new_owner_restarts() {
        let store = MemStore::new();
        let mut w = FeedWriter::default();
        let mut r = FeedReader::default();
        let mut out = Vec::new();
        w.publish(&store, 0, 7, &placement("a", &[0])).unwrap();
        r.poll(&store, &[(0, 7)], 8, &mut out);
        out.clear();
        // The writer laps the reader: entries 1..=RING+9 written, the ring holds the last RING.
        for i in 1..=RING + 9 {
            w.publish(&store, 0, 7, &placement("a", &[i])).unwrap();
        }
        r.poll(&store, &[(0, 7)], 1000, &mut out);
        let got: Vec<u64> = out.iter().map(|p| p.hashes[0]).collect();
        assert_eq!(got.first(), Some(&(RING + 1)), "resumes at the oldest entry the ring holds");
        assert_eq!(got.last(), Some(&(RING + 9)));
        assert!(got.windows(2).all(|w| w[1] == w[0] + 1), "then in order, each once");
        // Another VM takes the slot: the old owner's entries are not its own; its own are read
        // from its first.
        out.clear();
        let mut w2 = FeedWriter::default();
        r.poll(&store, &[(0, 99)], 8, &mut out);
        assert!(out.is_empty(), "the previous owner's entries are not the new one's");
        w2.publish(&store, 0, 99, &placement("b", &[1])).unwrap();
        r.poll(&store, &[(0, 99)], 8, &mut out);
        assert_eq!(out, vec![placement("b", &[1])]);
    }

    #[test]
    fn a_garbled_entry_or_a_failing_store_ends_the_read_without_a_panic() {
        let store = MemStore::new();
        store.set(&entry_key(2, 0), b"garbage", 0).unwrap();
        let mut r = FeedReader::default();
        let mut out = Vec::new();
        r.poll(&store, &[(2, 5)], 8, &mut out);
        assert!(out.is_empty());
        struct Failing;
        impl SharedStore for Failing {
            fn get(&self, _: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
                Err(StoreError::Host("down".into()))
            }
            fn set(&self, _: &str, _: &[u8], _: u32) -> Result<(), StoreError> {
                Err(StoreError::Host("down".into()))
            }
        }
        r.poll(&Failing, &[(2, 5), (3, 6)], 8, &mut out);
        assert!(out.is_empty());
        assert!(FeedWriter::default().publish(&Failing, 0, 1, &placement("a", &[1])).is_err());
    }
}
