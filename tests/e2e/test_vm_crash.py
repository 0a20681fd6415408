"""A filter VM that dies mid-request, in real Envoy, with the shipped `failure_policy`.

The module is built never to panic on any input (docs/hardening.md); this test uses the
test-only `crash-test` build (`make wasm-crash`, cargo feature `crash-test`), whose filter panics
on a request with the header `x-inference-picker-test-panic`. The Envoy configuration is the
shipped envoy/envoy.yaml, with `failure_policy: FAIL_RELOAD`. The test shows:
- the crashing request gets an answer (Envoy's 503), and later requests are served again by a
  fresh VM;
- the dead VM's in-flight count (a request it had sent and never saw end) ages out of the shared
  table, so the per-endpoint gauge returns to the true count: the one request the new VM holds.
One worker, so that the request held before the crash is the dead VM's.
"""

import concurrent.futures as cf
import os
from pathlib import Path

import yaml

from harness import ENVOY_YAML, REPO, Envoy, Sim, dict_nodes, endpoint, picker_config, stop_each, wait_until

CRASH_WASM = Path(os.environ.get(
    "PICKER_CRASH_WASM", REPO / "target/wasm32-wasip1/crash-test/inference_picker.wasm"))
PANIC = {"x-inference-picker-test-panic": "1"}


def _inflight(envoy, sim) -> float:
    return envoy.metric("inference_picker_endpoint_inflight", endpoint=sim.address)


def test_the_shipped_failure_policy_recovers_and_a_dead_vms_counts_age_out():
    assert CRASH_WASM.exists(), f"{CRASH_WASM} is missing: run `make wasm-crash`"
    shipped = yaml.safe_load(ENVOY_YAML.read_text())
    policies = [n["failure_policy"] for n in dict_nodes(shipped) if "failure_policy" in n]
    assert policies == ["FAIL_RELOAD"], f"the test assumes the shipped policy; envoy.yaml has {policies}"

    sim = Sim("crash")
    envoy = None
    try:
        config = picker_config([endpoint(sim)], filter={"endpoint_metrics": True})
        envoy = Envoy(config, concurrency=1, wasm=CRASH_WASM)
        envoy.wait_routable()
        wait_until(lambda: _inflight(envoy, sim) == 0, 10, "no request in flight")
        with cf.ThreadPoolExecutor(2) as pool:
            # The VM that will die sends a request and never sees it end.
            sim.hold()
            before = pool.submit(envoy.chat, content="sent by the VM that dies", timeout=120)
            sim.wait_held(1)
            wait_until(lambda: _inflight(envoy, sim) == 1, 10, "the held request counted")
            crashed = envoy.chat(content="this one kills the VM", headers=PANIC)
            assert crashed.status_code == 503, (crashed.status_code, crashed.text)
            assert sim.held() == 1, "the crashing request reached the pod"
            # FAIL_RELOAD: a fresh VM serves later requests (the first ones may still get 503
            # while Envoy replaces the VM).
            sim.release()
            answers = []

            def served():
                r = envoy.chat(content=f"after the crash {len(answers)}")
                answers.append(r.status_code)
                return r.status_code == 200
            wait_until(served, 30, "a request served after the crash")
            assert set(answers) <= {200, 503}, answers
            for i in range(5):
                r = envoy.chat(content=f"served again {i}")
                assert r.status_code == 200, r.text
            # The new VM holds one request; the dead VM's count (still 1 in its record, which
            # nobody will ever lower) must age out, leaving the true count.
            sim.hold()
            after = pool.submit(envoy.chat, content="sent by the new VM", timeout=120)
            sim.wait_held(1)
            wait_until(lambda: _inflight(envoy, sim) == 1, 15,
                       "the gauge to show the one request in flight, without the dead VM's")
            wait_until(lambda: envoy.metric("inference_picker_ready_endpoints") >= 1, 10, "the pod still ready")
            sim.release()
            assert after.result(timeout=60).status_code == 200
            before.result(timeout=60)  # whatever Envoy answered it; it must not hang
        wait_until(lambda: _inflight(envoy, sim) == 0, 15, "nothing in flight at the end")
        assert "panicked" in envoy.log() or "crash-test" in envoy.log(), envoy.log()[-2000:]
    finally:
        stop_each(envoy, sim)
