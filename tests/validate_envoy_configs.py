#!/usr/bin/env python3
"""Validates every Envoy bootstrap config in the repo with the real Envoy (`--mode validate`),
which checks every field and also loads the .wasm and runs on_vm_start/on_configure.

Envoy configs are the YAML files under envoy/ that have `static_resources` at the top level
(Kubernetes manifests under envoy/istio/ are checked by tests/deploy instead). Run from the repo
root: the configs name the .wasm by a path relative to it."""
import argparse
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def envoy_configs():
    for path in sorted((REPO / "envoy").rglob("*.yaml")):
        try:
            docs = list(yaml.safe_load_all(path.read_text()))
        except yaml.YAMLError as e:
            raise SystemExit(f"{path}: not YAML: {e}")
        if len(docs) == 1 and isinstance(docs[0], dict) and "static_resources" in docs[0]:
            yield path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--envoy", required=True)
    args = ap.parse_args()
    configs = list(envoy_configs())
    if not configs:
        print("no Envoy configs found", file=sys.stderr)
        return 1
    failed = 0
    for path in configs:
        r = subprocess.run(
            [args.envoy, "--mode", "validate", "-c", str(path.relative_to(REPO)), "-l", "error",
             "--use-dynamic-base-id", "--disable-hot-restart"],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )
        ok = r.returncode == 0
        failed += not ok
        print(f"{'OK  ' if ok else 'FAIL'} {path.relative_to(REPO)}")
        if not ok:
            print(r.stdout[-3000:], r.stderr[-3000:], file=sys.stderr)
    print(f"{len(configs) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
