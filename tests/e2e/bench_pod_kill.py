#!/usr/bin/env python3
"""Pod killed (SIGKILL) under a concurrent burst: failed requests with the shipped envoy.yaml
(STATIC cluster + override_host + retry policy) against the same file with an ORIGINAL_DST
inference_pool and no retry policy (the config before failover). Same scenario as
test_chaos.py's burst test. Not part of `make test`: a measurement, printed.

    .venv/bin/python tests/e2e/bench_pod_kill.py [--runs 3]
"""
import argparse
import concurrent.futures as cf
import sys
import tempfile
import threading
from pathlib import Path

import requests
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ENVOY_YAML, LLAMA, POOL_CLUSTER, Envoy, Sim, endpoint, picker_config  # noqa: E402


def original_dst_variant(path: Path) -> None:
    doc = yaml.safe_load(ENVOY_YAML.read_text())
    for c in doc["static_resources"]["clusters"]:
        if c["name"] == POOL_CLUSTER:
            for k in ("load_assignment", "load_balancing_policy", "type"):
                c.pop(k, None)
            c.update({"type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                      "original_dst_lb_config": {"use_http_header": True,
                                                 "http_header_name": "x-envoy-original-dst-host"}})
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    for vh in hcm["route_config"]["virtual_hosts"]:
        for r in vh["routes"]:
            r["route"].pop("retry_policy", None)
    path.write_text(yaml.safe_dump(doc))


def run(base: Path, total=240, killed_after=60, concurrency=24) -> int:
    sims = [Sim(f"kill-{i}", extra=["--delay-per-token-ms", "10"]) for i in range(3)]
    envoy = Envoy(picker_config([endpoint(s) for s in sims]), concurrency=2, base_yaml=base)
    done, lock = [], threading.Lock()

    def one(i):
        try:
            with requests.Session() as s:
                r = s.post(envoy.url + "/v1/chat/completions", timeout=30,
                           json={"model": LLAMA, "messages": [{"role": "user", "content": f"b{i}"}], "max_tokens": 4})
            code = r.status_code
        except requests.RequestException:
            code = None
        with lock:
            done.append(code)
            if len(done) == killed_after:
                sims[0].crash()
        return code

    try:
        envoy.wait_routable()
        with cf.ThreadPoolExecutor(concurrency) as pool:
            codes = list(pool.map(one, range(total)))
        return sum(c != 200 for c in codes)
    finally:
        envoy.stop()
        for s in sims:
            s.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        odst = Path(tmp) / "envoy-original-dst.yaml"
        original_dst_variant(odst)
        for name, base in (("shipped (override_host + retries)", ENVOY_YAML), ("ORIGINAL_DST, no retries", odst)):
            fails = [run(base) for _ in range(args.runs)]
            print(f"{name}: failed of 240 per run: {fails}", flush=True)


if __name__ == "__main__":
    main()
