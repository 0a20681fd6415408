//! Tests of `inflight`.

use super::*;
use crate::base::ports::MemStore;
use std::cell::{Cell, RefCell};

const T0: u64 = 1_000_000;

#[test]
fn one_vm_counts_and_releases() {
    let s = MemStore::new();
    let mut a = InflightTable::new(0xA);
    assert_eq!(a.adjust(&s, "10.0.0.1:8000", 1, T0).unwrap(), 1);
    assert_eq!(a.adjust(&s, "10.0.0.1:8000", 1, T0).unwrap(), 2);
    assert_eq!(a.adjust(&s, "10.0.0.2:8000", 1, T0).unwrap(), 1);
    let mut reader = InflightTable::new(0xB);
    let c = reader.read(&s, T0).unwrap();
    assert_eq!((c.get("10.0.0.1:8000"), c.get("10.0.0.2:8000"), c.total()), (2, 1, 3));
    assert_eq!(a.adjust(&s, "10.0.0.1:8000", -1, T0).unwrap(), 1);
    assert_eq!(a.adjust(&s, "10.0.0.1:8000", -1, T0).unwrap(), 0);
    // Releasing below zero saturates instead of wrapping.
    assert_eq!(a.adjust(&s, "10.0.0.1:8000", -1, T0).unwrap(), 0);
    let rec = decode(&s.get(&slot_key(0)).unwrap().unwrap().0).unwrap();
    assert_eq!((rec.owner, rec.heartbeat_ms), (0xA, T0));
    assert_eq!(rec.counts, InflightCounts::from_text(b"10.0.0.2:8000=1"));
    assert_eq!(s.keys(), vec![slot_key(0)]);
}

#[test]
fn the_prefill_part_is_published_with_the_count_and_summed() {
    let s = MemStore::new();
    let mut a = InflightTable::new(0xA);
    let mut b = InflightTable::new(0xB);
    a.adjust_with_prefill(&s, "e", 1, (3000.0, 1), T0).unwrap();
    a.adjust_with_prefill(&s, "e", 1, (5000.0, 2), T0).unwrap();
    b.adjust_with_prefill(&s, "e", 1, (1000.0, 1), T0).unwrap();
    let h = address_hash("e");
    assert_eq!(a.read(&s, T0).unwrap().load_hashed(h, "e").prefill(), (6000.0, 3));
    assert_eq!(b.read(&s, T0).unwrap().load_hashed(h, "e").prefill(), (6000.0, 3));
    // A's first request produced its first byte: its prefill part shrinks, the count stays.
    a.set_prefill(&s, "e", (2000.0, 1), T0).unwrap();
    let c = b.read(&s, T0).unwrap();
    assert_eq!((c.get("e"), c.load_hashed(h, "e").prefill()), (3, (3000.0, 2)));
    // Ends: the prefill part never outlives the count.
    a.adjust_with_prefill(&s, "e", -1, (2000.0, 1), T0).unwrap();
    a.adjust_with_prefill(&s, "e", -1, (0.0, 0), T0).unwrap();
    b.adjust(&s, "e", -1, T0).unwrap();
    assert_eq!(b.read(&s, T0).unwrap().load_hashed(h, "e").prefill(), (0.0, 0));
    // Nothing changed: set_prefill writes nothing (the CAS token is unchanged).
    a.adjust_with_prefill(&s, "f", 1, (10.0, 1), T0).unwrap();
    let before = s.get(&slot_key(a.slot().unwrap())).unwrap().unwrap().1;
    a.set_prefill(&s, "f", (10.0, 1), T0).unwrap();
    assert_eq!(s.get(&slot_key(a.slot().unwrap())).unwrap().unwrap().1, before);
}

#[test]
fn records_with_and_without_a_prefill_part_decode() {
    let c = InflightCounts::from_text(b"a:1=3/2/7000;b:1=1;c:1=2/5/9;d:1=2/1;e:1=0/0/0");
    let pf = |a: &str| c.load_hashed(address_hash(a), a).prefill();
    // The short form (and an older release's record) has no prefill part; a part beyond
    // the count is garbled and dropped, the count kept; a malformed entry is skipped.
    assert_eq!((c.get("a:1"), pf("a:1")), (3, (7000.0, 2)));
    assert_eq!((c.get("b:1"), pf("b:1")), (1, (0.0, 0)));
    assert_eq!((c.get("c:1"), pf("c:1")), (2, (0.0, 0)));
    assert_eq!((c.get("d:1"), c.get("e:1")), (0, 0));
    let rec = SlotRecord { owner: 1, heartbeat_ms: 2, counts: c.clone() };
    assert_eq!(decode(&encode(&rec)).map(|r| r.counts), Some(c.clone()));
    assert_eq!(c, InflightCounts::from_text(b"a:1=3/2/7000;b:1=1;c:1=2"));
    // In the binary form too: a zero count is dropped, a prefill part beyond the count dropped.
    let mut w = Writer::new(Tag::InflightVm, 0);
    w.u64(1).u64(2).u32(3);
    w.str("a").u32(2).u32(5).u64(9);
    w.str("b").u32(0).u32(0).u64(0);
    w.str("").u32(4).u32(0).u64(0);
    let c = decode(&w.finish()).unwrap().counts;
    assert_eq!((c.get("a"), c.load_hashed(address_hash("a"), "a").prefill(), c.total()), (2, (0.0, 0), 2));
}

#[test]
fn workers_have_their_own_slots_and_readers_sum_them() {
    let s = MemStore::new();
    let mut a = InflightTable::new(0xA);
    let mut b = InflightTable::new(0xB);
    a.adjust(&s, "e", 1, T0).unwrap();
    b.adjust(&s, "e", 1, T0).unwrap();
    b.adjust(&s, "f", 1, T0).unwrap();
    assert_eq!((a.slot(), b.slot()), (Some(0), Some(1)));
    // Each reads the other's slot and its own memory.
    for t in [&mut a, &mut b] {
        let c = t.read(&s, T0).unwrap();
        assert_eq!((c.get("e"), c.get("f")), (2, 1));
    }
}

#[test]
fn a_dead_vms_count_stops_counting_after_the_ttl_and_its_slot_is_reused() {
    let s = MemStore::new();
    let mut dead = InflightTable::new(0xD);
    dead.adjust(&s, "e", 1, T0).unwrap(); // +1, then the VM dies: no -1 ever comes.
    let mut live = InflightTable::new(0xA);
    assert_eq!(live.read(&s, T0 + TTL_MS).unwrap().get("e"), 1);
    assert_eq!(live.read(&s, T0 + TTL_MS + 1).unwrap().get("e"), 0);
    // A new VM reuses the dead slot: keys stay bounded.
    live.adjust(&s, "e", 1, T0 + TTL_MS + 1).unwrap();
    assert_eq!(live.slot(), Some(0));
    assert_eq!(s.key_count(), 1);
}

#[test]
fn heartbeats_keep_an_idle_holder_alive_and_release_frees_at_once() {
    let s = MemStore::new();
    let mut a = InflightTable::new(0xA);
    let mut r = InflightTable::new(0xB);
    a.adjust(&s, "e", 1, T0).unwrap();
    // Ticks every 50 ms for 10 TTLs: the count stays visible.
    let mut now = T0;
    for _ in 0..(10 * TTL_MS / 50) {
        now += 50;
        a.tick(&s, now).unwrap();
        assert_eq!(r.read(&s, now).unwrap().get("e"), 1);
    }
    a.release(&s).unwrap();
    assert_eq!(r.read(&s, now).unwrap().get("e"), 0);
    assert_eq!(s.get(&slot_key(0)).unwrap().unwrap().0, b"");
    // The freed slot is taken again by the next VM at once.
    r.adjust(&s, "e", 1, now).unwrap();
    assert_eq!(r.slot(), Some(0));
}

type Other<'a> = Box<dyn FnOnce(&MemStore) + 'a>;

/// Runs `other` once, right after the next `get` of `key` (another VM interleaving).
struct Interleave<'a> {
    inner: &'a MemStore,
    key: String,
    other: RefCell<Option<Other<'a>>>,
}
impl SharedStore for Interleave<'_> {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        let r = self.inner.get(key);
        if key == self.key {
            if let Some(f) = self.other.borrow_mut().take() {
                f(self.inner);
            }
        }
        r
    }
    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        self.inner.set(key, value, cas)
    }
}

#[test]
fn two_first_creators_of_one_slot_end_in_two_slots_with_all_counts() {
    let s = MemStore::new();
    let b = RefCell::new(InflightTable::new(0xB));
    // A reads slot 0 absent; before A writes, B claims slot 0 (B also saw it absent).
    let racing = Interleave {
        inner: &s,
        key: slot_key(0),
        other: RefCell::new(Some(Box::new(|st: &MemStore| {
            b.borrow_mut().adjust(st, "e", 1, T0).unwrap();
        }))),
    };
    let mut a = InflightTable::new(0xA);
    a.adjust(&racing, "e", 1, T0).unwrap();
    a.adjust(&racing, "e", 1, T0).unwrap();
    assert_eq!(b.borrow().slot(), Some(0));
    assert_eq!(a.slot(), Some(1));
    let mut r = InflightTable::new(0xC);
    assert_eq!(r.read(&s, T0).unwrap().get("e"), 3);
}

#[test]
fn a_clobbered_slot_is_detected_on_the_next_tick_and_the_loser_moves_with_its_state() {
    // The residual case get_or_create cannot exclude (a token equal to CREATE_CAS), or any blind
    // writer: B overwrites A's slot. A notices on its next tick and moves, keeping its counts.
    let s = MemStore::new();
    let mut a = InflightTable::new(0xA);
    a.adjust(&s, "e", 2, T0).unwrap();
    let mut b = InflightTable::new(0xB);
    b.adjust(&s, "e", 1, T0).unwrap(); // slot 1
    s.set(
        &slot_key(0),
        &encode(&SlotRecord { owner: 0xB, heartbeat_ms: T0, counts: InflightCounts::from_text(b"e=1") }),
        0,
    )
    .unwrap();
    a.tick(&s, T0 + 50).unwrap();
    assert_eq!(a.slot(), Some(2));
    assert_eq!(decode(&s.get(&slot_key(2)).unwrap().unwrap().0).unwrap().counts.get("e"), 2);
}

#[test]
fn a_stalled_vm_whose_slot_was_reused_moves_and_loses_nothing() {
    let s = MemStore::new();
    let mut a = InflightTable::new(0xA);
    a.adjust(&s, "e", 1, T0).unwrap();
    // A stalls past the TTL; B takes slot 0 over.
    let mut b = InflightTable::new(0xB);
    b.adjust(&s, "e", 1, T0 + TTL_MS + 1).unwrap();
    assert_eq!(b.slot(), Some(0));
    // A wakes up and finishes its request: the -1 goes to its own new slot.
    a.adjust(&s, "e", -1, T0 + TTL_MS + 2).unwrap();
    assert_eq!(a.slot(), Some(1));
    let mut r = InflightTable::new(0xC);
    assert_eq!(r.read(&s, T0 + TTL_MS + 2).unwrap().get("e"), 1);
}

#[test]
fn records_round_trip_and_garbage_reads_as_free() {
    let rec =
        SlotRecord { owner: 7, heartbeat_ms: 42, counts: InflightCounts::from_text(b"[fd00::1]:8000=3;a=1") };
    assert_eq!(decode(&encode(&rec)), Some(rec.clone()));
    let good = encode(&rec);
    let mut longer = good.clone();
    longer.push(0);
    let mut junk: Vec<Vec<u8>> = (0..good.len()).map(|n| good[..n].to_vec()).collect();
    junk.extend([longer, b"\xff\xfe".to_vec(), b"i1 0000000000000001 5 a=1".to_vec()]);
    // A zero owner; a count beyond the bytes left; another tag.
    let mut zero = good.clone();
    zero[2..10].copy_from_slice(&[0; 8]);
    junk.push(zero);
    let mut many = good.clone();
    many[18..22].copy_from_slice(&u32::MAX.to_le_bytes());
    junk.push(many);
    let mut other = good.clone();
    other[0] = Tag::Health as u8;
    junk.push(other);
    for j in &junk {
        assert_eq!(decode(j), None, "{j:?}");
    }
    // A garbled slot is reusable, and its counts are never read.
    let s = MemStore::new();
    s.set(&slot_key(0), b"junk a=9", 0).unwrap();
    let mut a = InflightTable::new(0xA);
    assert_eq!(a.read(&s, T0).unwrap().total(), 0);
    a.adjust(&s, "e", 1, T0).unwrap();
    assert_eq!(a.slot(), Some(0));
}

/// Mixed builds: a VM of the next release holds slot 0 with a record this release does not
/// read. It is not counted here, and never claimed or overwritten: this VM takes slot 1. The
/// next release reads this one's records.
#[test]
fn a_record_of_another_release_is_skipped_and_its_slot_kept() {
    let s = MemStore::new();
    let theirs = SlotRecord { owner: 0xC, heartbeat_ms: T0, counts: InflightCounts::from_text(b"e=5") };
    let theirs = codec::as_next(&encode(&theirs), Tag::InflightVm);
    s.set(&slot_key(0), &theirs, 0).unwrap();
    let mut a = InflightTable::new(0xA);
    a.adjust(&s, "e", 1, T0).unwrap();
    let next = cfg!(feature = "codec-next");
    let mut r = InflightTable::new(0xB);
    assert_eq!(r.read(&s, T0).unwrap().get("e"), if next { 6 } else { 1 });
    if !next {
        assert_eq!(a.slot(), Some(1));
        assert_eq!(s.get(&slot_key(0)).unwrap().unwrap().0, theirs, "another build's slot is kept");
        // Even stale, it is not taken (its owner may be a live VM of another build).
        let mut c = InflightTable::new(0xD);
        c.adjust(&s, "e", 1, T0 + 10 * TTL_MS).unwrap();
        assert_ne!(c.slot(), Some(0));
    }
}

#[test]
fn counts_parse_tolerates_garbage() {
    let c = InflightCounts::from_text(b"a=x;b=2;=3;c");
    assert_eq!((c.get("a"), c.get("b"), c.total()), (0, 2, 2));
    assert_eq!(InflightCounts::from_text(b"\xff").total(), 0);
}

#[test]
fn reads_reuse_decoded_records_while_the_token_is_unchanged() {
    let s = MemStore::new();
    let mut a = InflightTable::new(0xA);
    a.adjust(&s, "e", 1, T0).unwrap();
    let gets = Cell::new(0);
    struct Counting<'a>(&'a MemStore, &'a Cell<usize>);
    impl SharedStore for Counting<'_> {
        fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
            self.1.set(self.1.get() + 1);
            self.0.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
            self.0.set(key, value, cas)
        }
    }
    let mut r = InflightTable::new(0xB);
    r.adjust(&s, "f", 1, T0).unwrap(); // r owns slot 1: its own slot is not read.
    let c = Counting(&s, &gets);
    assert_eq!(r.read(&c, T0).unwrap().total(), 2);
    // One read for slot 0, one for the absent slot 2 that ends the scan.
    assert_eq!(gets.get(), 2);
    assert!(matches!(r.cache.first(), Some(Some((_, Some(_))))));
}

#[test]
fn a_full_table_keeps_counting_locally() {
    let s = MemStore::new();
    for k in 0..MAX_SLOTS {
        s.set(
            &slot_key(k),
            &encode(&SlotRecord {
                owner: 1000 + k as u64,
                heartbeat_ms: T0,
                counts: InflightCounts::default(),
            }),
            0,
        )
        .unwrap();
    }
    let mut a = InflightTable::new(0xA);
    assert!(a.adjust(&s, "e", 1, T0).is_err());
    assert_eq!(a.local().get("e"), 1);
    assert_eq!(s.key_count(), MAX_SLOTS);
}

/// A peer gateway's in-flight record as older builds wrote it (tag `InflightPeer`, from the
/// removed load exchange), in a VM slot or in their peer key space: never counted, and the VM
/// slot it sits in is free for the taking.
#[test]
fn an_older_builds_peer_record_is_not_counted_and_its_slot_is_free() {
    let mut w = Writer::new(Tag::InflightPeer, 64);
    w.u64(0xF00).u64(T0);
    InflightCounts::from_text(b"p=3/2/9000").write(&mut w);
    let old = w.finish();
    assert_eq!(decode(&old), None);
    let s = MemStore::new();
    s.set(&slot_key(0), &old, 0).unwrap();
    s.set("inference-picker/inflight-peer/0", &old, 0).unwrap();
    let mut a = InflightTable::new(0xA);
    a.adjust(&s, "p", 1, T0).unwrap();
    assert_eq!(a.slot(), Some(0), "an old peer record's VM slot is free");
    let mut b = InflightTable::new(0xB);
    assert_eq!(b.read(&s, T0).unwrap().get("p"), 1);
    assert!(live_vms(&s, T0).unwrap().iter().all(|&(_, owner)| owner != 0xF00));
}

#[test]
fn live_others_names_the_other_live_vms_by_slot_and_owner() {
    let s = MemStore::new();
    let (mut a, mut b, mut c) = (InflightTable::new(0xA), InflightTable::new(0xB), InflightTable::new(0xC));
    a.adjust(&s, "10.0.0.1:8000", 1, T0).unwrap();
    b.adjust(&s, "10.0.0.1:8000", 1, T0).unwrap();
    c.adjust(&s, "10.0.0.1:8000", 1, T0).unwrap();
    let mut out = Vec::new();
    b.read(&s, T0).unwrap();
    b.live_others(T0, &mut out);
    out.sort_unstable();
    let slot = |t: &InflightTable| t.slot().unwrap();
    assert_eq!(out, vec![(slot(&a), 0xA), (slot(&c), 0xC)], "not itself");
    // A VM silent past the TTL is not live.
    b.live_others(T0 + TTL_MS + 1, &mut out);
    assert!(out.is_empty());
}
