#!/usr/bin/env python3
"""Startup burst: 503s among 100 requests (25 at a time) sent the moment Envoy's /ready says 200,
with the startup hold (health.startup_wait_ms, default 1000) and without it (0: the behaviour
before the hold). Same scenario as test_health.py's startup test. Not part of `make test`: a
measurement, printed.

    .venv/bin/python tests/e2e/bench_startup.py [--runs 3] [--interval-ms 200]
"""
import argparse
import concurrent.futures as cf
import sys
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import LLAMA, Envoy, Sim, endpoint, picker_config  # noqa: E402


def chat(envoy, i):
    body = {"model": LLAMA, "messages": [{"role": "user", "content": f"start {i}"}], "max_tokens": 4}
    with requests.Session() as s:
        return s.post(envoy.url + "/v1/chat/completions", json=body, timeout=30).status_code


def one_run(wait_ms: int, interval_ms: int) -> int:
    sims = [Sim(f"start-{i}") for i in range(3)]
    cfg = picker_config([endpoint(s) for s in sims], health={"startup_wait_ms": wait_ms},
                        poller={"interval_ms": interval_ms, "timeout_ms": 500, "stale_after_ms": 2000})
    envoy = Envoy(cfg, concurrency=2)
    try:
        with cf.ThreadPoolExecutor(25) as pool:
            codes = list(pool.map(lambda i: chat(envoy, i), range(100)))
        return codes.count(503)
    finally:
        envoy.stop()
        for s in sims:
            s.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--interval-ms", type=int, default=200)
    args = ap.parse_args()
    for wait in (1000, 0):
        got = [one_run(wait, args.interval_ms) for _ in range(args.runs)]
        print(f"startup_wait_ms={wait}: 503s of 100 per run: {got}")


if __name__ == "__main__":
    main()
