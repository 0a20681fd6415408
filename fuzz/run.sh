#!/usr/bin/env bash
# make fuzz: runs every fuzz target (or FUZZ_TARGETS="body config ...") for FUZZ_SECONDS each
# (default 60), one after the other, and writes target/fuzz-report.md: executions and crashes per
# target. A crash, timeout or out-of-memory input is copied to fuzz/regressions/<target>/, which
# `cargo test` (tests/fuzz_regressions.rs) replays on stable Rust: commit it with the fix.
#
# Needs a nightly toolchain (libFuzzer instrumentation) and cargo-fuzz, installed here if missing.
# Run from the repository root. FUZZ_SANITIZER (default none: the crate has no unsafe code, and
# AddressSanitizer halves the executions) and FUZZ_ARGS (extra libFuzzer flags) are optional.
set -uo pipefail

cd "$(dirname "$0")/.."
SECONDS_PER_TARGET="${FUZZ_SECONDS:-60}"
SANITIZER="${FUZZ_SANITIZER:-none}"
OUT=target/fuzz
REPORT=target/fuzz-report.md

if ! cargo +nightly --version >/dev/null 2>&1; then
  echo "make fuzz: needs a nightly Rust toolchain (libFuzzer instrumentation is nightly-only)." >&2
  echo "  install it with:  rustup toolchain install nightly" >&2
  echo "  (the project itself stays on the pinned stable toolchain; only fuzz/ uses nightly)" >&2
  exit 2
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  echo "make fuzz: cargo-fuzz is missing; installing it (takes a few minutes)"
  cargo +nightly install cargo-fuzz --locked || {
    echo "make fuzz: could not install cargo-fuzz; run 'cargo +nightly install cargo-fuzz' and retry" >&2
    exit 2
  }
fi

ALL_TARGETS=$(cd fuzz && cargo +nightly fuzz list)
TARGETS="${FUZZ_TARGETS:-$ALL_TARGETS}"

# Seeds beyond the small ones committed in fuzz/corpus/<target>/: the repository's fixtures,
# read in place (libFuzzer only writes to the first corpus directory, the working one).
extra_seeds() {
  case "$1" in
    body) echo tests/fixtures/requests ;;
    metrics) echo tests/fixtures/metrics ;;
    config) echo filter-config/examples ;;
    discovery) echo tests/fixtures/k8s ;;
  esac
}

echo "make fuzz: building targets (nightly, sanitizer: $SANITIZER)"
(cd fuzz && cargo +nightly fuzz build -s "$SANITIZER") || exit 1

mkdir -p "$OUT/logs"
{
  echo "# Fuzzing report"
  echo
  echo "$(date -u '+%Y-%m-%d %H:%M UTC'), FUZZ_SECONDS=$SECONDS_PER_TARGET per target, sanitizer $SANITIZER, $(cargo +nightly --version)"
  echo
  echo "| target | executions | crashes | seconds | kept inputs |"
  echo "|---|---|---|---|---|"
} > "$REPORT"

failed=0
for t in $TARGETS; do
  work="$OUT/corpus/$t"
  mkdir -p "$work" "fuzz/corpus/$t"
  log="$OUT/logs/$t.log"
  seeds=("fuzz/corpus/$t")
  for d in $(extra_seeds "$t"); do seeds+=("$d"); done
  echo "make fuzz: $t for ${SECONDS_PER_TARGET}s (log: $log)"
  start=$(date +%s)
  (cd fuzz && cargo +nightly fuzz run -s "$SANITIZER" "$t" "../$work" "${seeds[@]/#/../}" -- \
     -max_total_time="$SECONDS_PER_TARGET" -timeout=10 -print_final_stats=1 ${FUZZ_ARGS:-}) > "$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | tail -1 | grep -o '[0-9]*$')
  if [ -z "$execs" ]; then
    # No final stats (killed hard): the last status line's count.
    execs=$(grep -oE '^#[0-9]+' "$log" | tail -1 | tr -d '#')
  fi
  kept=()
  while read -r unit; do
    [ -n "$unit" ] || continue
    src="fuzz/${unit#./}"
    [ -f "$src" ] || src="$unit"
    [ -f "$src" ] || continue
    mkdir -p "fuzz/regressions/$t"
    cp "$src" "fuzz/regressions/$t/" && kept+=("fuzz/regressions/$t/$(basename "$src")")
  done < <(grep -o 'Test unit written to [^ ]*' "$log" | awk '{print $5}' | grep -E '/(crash|timeout|oom|leak)-')
  crashes=${#kept[@]}
  if [ "$rc" -ne 0 ] && [ "$crashes" -eq 0 ]; then
    crashes="failed (exit $rc, see $log)"
  fi
  line="| $t | ${execs:-?} | $crashes | $secs | ${kept[*]:-} |"
  echo "$line" >> "$REPORT"
  echo "make fuzz: $t: ${execs:-?} executions, crashes: $crashes"
  if [ "$rc" -ne 0 ]; then
    failed=1
    grep -m1 -A3 'panicked at' "$log" || tail -5 "$log"
  fi
done

echo
cat "$REPORT"
if [ "$failed" -ne 0 ]; then
  echo "make fuzz: crashes found; inputs kept in fuzz/regressions/ (replayed by cargo test). Fix, then commit them." >&2
  exit 1
fi
