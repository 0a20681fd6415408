#!/usr/bin/env python3
"""`make run`: three simulated model servers on loopback and Envoy with the module on :8080.

The endpoints match envoy/envoy.yaml: 127.0.0.1:8001-8003 serve Llama-3.1-8B-Instruct (with the
`sql-lora` adapter), and 8003 also serves Qwen2.5-7B-Instruct. Ctrl-C stops everything started.
"""
import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
QWEN = "Qwen/Qwen2.5-7B-Instruct"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--envoy", required=True)
    ap.add_argument("--sim", required=True)
    ap.add_argument("--envoy-config", required=True)
    ap.add_argument("--concurrency", default="2")
    args = ap.parse_args()

    procs = []

    def stop(*_):
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.time() + 5
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
        print("\nstopped Envoy and the simulators")
        sys.exit(0)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)

    for i, port in enumerate((8001, 8002, 8003), start=1):
        cmd = [args.sim, "--port", str(port), "--name", f"sim-{i}", "--model", LLAMA, "--lora", "sql-lora"]
        if port == 8003:
            cmd += ["--model", QWEN]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
    procs.append(
        subprocess.Popen(
            [args.envoy, "-c", args.envoy_config, "--concurrency", args.concurrency, "-l", "info",
             "--log-format", "[%Y-%m-%d %T.%e][%l] %v"],
        )
    )
    # Wait (bounded) for Envoy's admin endpoint before printing the hint.
    for _ in range(100):
        try:
            urllib.request.urlopen("http://127.0.0.1:9901/ready", timeout=0.5)
            break
        except Exception:
            if any(p.poll() is not None for p in procs):
                print("a process exited early; see the log above", file=sys.stderr)
                stop()
            time.sleep(0.1)
    print(
        "\nEnvoy with inference-picker is listening on 127.0.0.1:8080 (admin :9901). Try:\n\n"
        "  curl -s http://127.0.0.1:8080/v1/chat/completions -H 'content-type: application/json' \\\n"
        f"    -d '{{\"model\":\"{LLAMA}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hello\"}}]}}' -i\n\n"
        "The simulator's JSON (\"served_by\") names the pod that answered; Envoy prints one JSON\n"
        "access-log line per request here, with the module's decision (endpoint, reason, ...).\n"
        "Ctrl-C stops everything.\n",
        flush=True,
    )
    while True:
        for p in procs:
            if p.poll() is not None:
                print(f"process {p.args[0]} exited with {p.returncode}", file=sys.stderr)
                stop()
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
