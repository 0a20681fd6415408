//! Replays the fuzz seed corpora (`fuzz/corpus/<target>/`) and every kept crash input
//! (`fuzz/regressions/<target>/`) through the same entry functions the fuzz targets call
//! (`inference_picker::fuzzing`), natively on stable Rust. Any panic, including a failed
//! invariant, fails the test and names the file.

use std::fs;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use inference_picker::fuzzing::{target, TARGETS};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(dir) else { return Vec::new() };
    let mut out: Vec<PathBuf> =
        entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.is_file()).collect();
    out.sort();
    out
}

/// Runs every file of `<kind>/<target>/` through its target; returns (files run, failures).
fn replay(kind: &str) -> (usize, Vec<String>) {
    let mut run = 0;
    let mut failures = Vec::new();
    for (name, entry) in TARGETS {
        for file in files(&root().join("fuzz").join(kind).join(name)) {
            let data = fs::read(&file).unwrap();
            run += 1;
            if catch_unwind(AssertUnwindSafe(|| entry(&data))).is_err() {
                failures.push(file.display().to_string());
            }
        }
    }
    (run, failures)
}

#[test]
fn seed_corpora_pass() {
    let (run, failures) = replay("corpus");
    assert!(failures.is_empty(), "fuzz seeds that panic: {failures:#?}");
    // Every target has seeds, so this replay is not vacuous.
    for (name, _) in TARGETS {
        assert!(!files(&root().join("fuzz/corpus").join(name)).is_empty(), "no seeds for {name}");
    }
    assert!(run >= TARGETS.len());
}

#[test]
fn kept_crash_inputs_pass() {
    let (_, failures) = replay("regressions");
    assert!(failures.is_empty(), "fuzz regression inputs that panic again: {failures:#?}");
    // A regression directory that names no target would never be replayed.
    for dir in fs::read_dir(root().join("fuzz/regressions")).into_iter().flatten().flatten() {
        let name = dir.file_name().to_string_lossy().into_owned();
        assert!(target(&name).is_some(), "fuzz/regressions/{name} is not a fuzz target");
    }
}

/// The fuzz targets and the entry table name the same set, so nothing goes unreplayed.
#[test]
fn every_fuzz_target_has_an_entry() {
    let mut on_disk: Vec<String> = files(&root().join("fuzz/fuzz_targets"))
        .iter()
        .filter_map(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .collect();
    on_disk.sort();
    let mut table: Vec<String> = TARGETS.iter().map(|(n, _)| n.to_string()).collect();
    table.sort();
    assert_eq!(on_disk, table);
    for name in &on_disk {
        let src = fs::read_to_string(root().join(format!("fuzz/fuzz_targets/{name}.rs"))).unwrap();
        assert!(
            src.contains(&format!("inference_picker::fuzzing::{name}(")),
            "{name}.rs calls another entry"
        );
    }
}

/// The hand-written binary seeds are well-formed records of the codec (`src/base/codec.rs`), so
/// the fuzzer starts from inputs that reach past the header checks.
#[test]
fn binary_seeds_are_well_formed_records() {
    use inference_picker::poll::peers;
    use inference_picker::state::{health::HealthView, inflight, prefix_shared};
    let seed = |p: &str| fs::read(root().join("fuzz/corpus").join(p)).unwrap();
    let rec = inflight::decode(&seed("inflight/slot-record.bin")).unwrap();
    assert_eq!((rec.owner, rec.counts.get("10.0.0.1:8000")), (0xdead_beef, 3));
    // A peer gateway's record of older builds (the removed load exchange): a free slot.
    let peer_record = seed("inflight/peer-record.bin");
    assert_eq!(peer_record[0], 0x04);
    assert!(inflight::decode(&peer_record).is_none());
    assert!(inflight::decode(&seed("inflight/garbled.bin")).is_none());
    assert!(HealthView::decode(&seed("health/two-entries.bin")).entry("10.0.0.2:8000").is_some());
    assert_eq!(prefix_shared::decode(&seed("prefix_shard/four_records.bin")).len(), 4);
    assert!(prefix_shared::decode(&seed("prefix_shard/partial.bin")).is_empty());
    assert_eq!(peers::decode(&seed("peer_batch/one")).unwrap().len(), 1);
    assert_eq!(peers::decode(&seed("peer_batch/overflow_one_shard")).unwrap().len(), 12);
    assert!(peers::decode(&seed("peer_batch/truncated")).is_err());
    // A load report of older builds (the removed load exchange): recognised, and nothing else.
    let load = seed("peer_batch/load-report");
    assert!(peers::is_retired_load_report(&load));
    assert!(peers::decode(&load).is_err() && peers::decode_placements(&load).is_err());
}
