#!/usr/bin/env python3
"""Validates every Envoy bootstrap config in the repo with the real Envoy (`--mode validate`),
which checks every field and also loads the .wasm and runs on_vm_start/on_configure, and with
tools/check_envoy_config.py, which checks what the module cannot see at run time (body limit vs
the listener's buffer limit, endpoints on Envoy's admin address, unknown callout clusters). The
checker's negative cases run first: each broken variant of envoy/envoy.yaml must be caught.

Envoy configs are the YAML files under envoy/ that have `static_resources` at the top level
(Kubernetes manifests under envoy/istio/ are checked by tests/deploy instead). Run from the repo
root: the configs name the .wasm by a path relative to it."""
import argparse
import copy
import json
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import check_envoy_config  # noqa: E402
from envoy_config import plugins  # noqa: E402


def _with_picker_config(doc: dict, change) -> dict:
    """A copy of `doc` whose inference-picker documents are passed through `change(cfg)`."""
    doc = copy.deepcopy(doc)
    for plugin in plugins(doc):
        cfg = check_envoy_config._picker_config(plugin)
        if cfg is not None:
            change(cfg)
            plugin["configuration"]["value"] = json.dumps(cfg)
    return doc


def negative_cases(doc: dict):
    """(name, broken variant of `doc`, text the checker must report)."""
    def listener(d):
        return d["static_resources"]["listeners"][0]

    no_limit = copy.deepcopy(doc)
    listener(no_limit).pop("per_connection_buffer_limit_bytes", None)
    yield "default 1 MiB buffer limit < default 4 MiB body", no_limit, "(Envoy's default)"
    small = copy.deepcopy(doc)
    listener(small)["per_connection_buffer_limit_bytes"] = 1000
    yield "max_body_bytes above the listener limit", _with_picker_config(
        small, lambda c: c.setdefault("filter", {}).update(max_body_bytes=1001)), "max_body_bytes 1001"
    admin = doc["admin"]["address"]["socket_address"]
    yield "endpoint on the admin address", _with_picker_config(
        doc, lambda c: c["endpoints"].append({"address": f"127.0.0.1:{admin['port_value']}", "models": [c["models"][0]["name"]]})
    ), "is Envoy's admin address"
    yield "endpoint on Envoy's own listener", _with_picker_config(
        doc, lambda c: c["endpoints"].append({"address": f"127.0.0.1:{listener(doc)['address']['socket_address']['port_value']}",
                                              "models": [c["models"][0]["name"]]})
    ), "is Envoy's own listener"
    yield "unknown poller cluster", _with_picker_config(
        doc, lambda c: c.setdefault("poller", {}).update(cluster="no_such_cluster")), "'no_such_cluster' is not a cluster"
    renamed = copy.deepcopy(doc)
    for c in renamed["static_resources"]["clusters"]:
        if c["name"] == "inference_pool_metrics":
            c["name"] = "metrics"
    yield "default poller cluster missing", renamed, "'inference_pool_metrics' is not a cluster"


def check_negative_cases() -> int:
    base = yaml.safe_load((REPO / "envoy" / "envoy.yaml").read_text())
    assert check_envoy_config.problems(base) == [], check_envoy_config.problems(base)
    failed = 0
    for name, doc, want in negative_cases(base):
        found = check_envoy_config.problems(doc)
        ok = any(want in p for p in found)
        failed += not ok
        print(f"{'OK  ' if ok else 'FAIL'} checker catches: {name}" + ("" if ok else f" (found {found})"))
    return failed


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
    failed = check_negative_cases()
    for path in configs:
        found = check_envoy_config.check_file(path)
        failed += bool(found)
        print(f"{'FAIL' if found else 'OK  '} {path.relative_to(REPO)} (offline checks)")
        for p in found:
            print("  " + p, file=sys.stderr)
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
    print(f"{failed} failed" if failed else "all passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
