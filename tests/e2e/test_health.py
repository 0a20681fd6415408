"""Issue 10 chaos suite, passive health and startup (src/health.rs, the startup hold in
src/admission.rs), in real Envoy with the shipped envoy/envoy.yaml (override_host retries).

- a black-hole pod (idle /metrics, every inference request 500 or reset) costs at most 3
  failed requests of 60, is ejected (metric), and then gets no more tries;
- an ejected pod that heals gets traffic again once its ejection ends;
- a burst sent the moment Envoy reports ready gets no 503: requests are held until the first
  metrics;
- with no metrics at all: FailClose answers an accurate 503 `metrics_not_ready`, FailOpen routes.

Each test prints its figures; run with `-s` to see them."""
import concurrent.futures as cf
import http.server
import json
import threading
import time

import requests

from harness import LLAMA, Envoy, Sim, endpoint, picker_config, wait_until

EJECTIONS = "inference_picker_health_ejections_total"
STARTUP = "inference_picker_startup_requests_total"
# Requests are sent one after another with this gap ("sequential-ish"): a pod that just failed
# counts as loaded for health.failure_load_ms (2 s), so back-to-back requests would avoid it
# rather than try it again, and it would take longer than 60 of them to eject it.
GAP_S = 0.15


def chat(envoy, content, timeout=30):
    body = {"model": LLAMA, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    # A new connection per request: the kernel spreads connections over Envoy's workers.
    with requests.Session() as s:
        return s.post(envoy.url + "/v1/chat/completions", json=body, timeout=timeout)


def ejections(envoy, sim) -> float:
    text = envoy.stats_prometheus()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(EJECTIONS + "{") and f'endpoint="{sim.address}"' in line:
            total += float(line.rpartition(" ")[2])
    return total


def stop_all(envoy, sims):
    envoy.stop()
    for s in sims:
        s.stop()


def run_black_hole(mode):
    sims = [Sim(f"hole-{i}") for i in range(3)]
    bad = sims[0]
    # Ejections by endpoint: the endpoint tag is opt-in (bounded metric names by default).
    envoy = Envoy(picker_config([endpoint(s) for s in sims], filter={"endpoint_metrics": True}), concurrency=2)
    try:
        envoy.wait_routable()
        bad.chaos(**mode)
        statuses, ejected_at, tries_at_ejection = [], None, None
        for i in range(60):
            statuses.append(chat(envoy, f"hole {i}").status_code)
            if ejected_at is None and ejections(envoy, bad) > 0:
                ejected_at, tries_at_ejection = i, bad.chaos_total()
            time.sleep(GAP_S)
        failed = sum(1 for s in statuses if s != 200)
        tries = bad.chaos_total()
        print(f"\n{mode}: {failed} of 60 failed; black hole tried {tries} times, "
              f"ejected after request {ejected_at}")
        assert failed <= 3, statuses
        assert ejected_at is not None, "never ejected"
        # The black hole's own count stops growing once it is ejected (30 s, the default).
        assert tries == tries_at_ejection, (tries, tries_at_ejection)
        assert 1 <= tries <= 3
    finally:
        stop_all(envoy, sims)


def test_black_hole_500_is_ejected_after_at_most_three_tries():
    run_black_hole({"mode": "status", "status": 500})


def test_black_hole_reset_is_ejected_after_at_most_three_tries():
    run_black_hole({"mode": "reset"})


def test_an_ejected_pod_that_heals_gets_traffic_again():
    """Ejected for 1 s (base_ejection_ms); healed meanwhile; back on probation, its first
    success ends probation and it serves like the others."""
    sims = [Sim(f"heal-{i}") for i in range(3)]
    bad = sims[0]
    cfg = picker_config([endpoint(s) for s in sims], health={"base_ejection_ms": 1000},
                        filter={"endpoint_metrics": True})
    envoy = Envoy(cfg, concurrency=2)
    try:
        envoy.wait_routable()
        bad.chaos("reset")
        n = 0
        deadline = time.time() + 20
        while ejections(envoy, bad) == 0:
            assert time.time() < deadline, "never ejected"
            chat(envoy, f"fail {n}")
            n += 1
            time.sleep(GAP_S)
        ejected = time.monotonic()
        bad.chaos("ok")
        served = None
        deadline = time.time() + 20
        while served != bad.name:
            assert time.time() < deadline, "the healed pod never got traffic again"
            r = chat(envoy, f"heal {n}")
            assert r.status_code == 200, r.text
            served = r.json()["served_by"]
            n += 1
            time.sleep(GAP_S)
        print(f"\nhealed pod served again {time.monotonic() - ejected:.1f} s after its ejection "
              f"(base_ejection_ms 1000, failure_load_ms 2000)")
        # Probation ended with that success: no re-ejection.
        assert ejections(envoy, bad) == 1
    finally:
        stop_all(envoy, sims)


def test_startup_burst_gets_no_503():
    """100 requests, 25 at a time, sent the moment Envoy's /ready says 200 (the harness returns
    then): before the first snapshot they are held, then routed. The poller's first round comes
    one interval after start; 500 ms (within the default startup_wait_ms of 1000) makes sure the
    burst arrives before it, so the test exercises the hold."""
    sims = [Sim(f"start-{i}") for i in range(3)]
    cfg = picker_config([endpoint(s) for s in sims],
                        poller={"interval_ms": 500, "timeout_ms": 400, "stale_after_ms": 2000})
    envoy = Envoy(cfg, concurrency=2)
    try:
        with cf.ThreadPoolExecutor(25) as pool:
            results = list(pool.map(lambda i: chat(envoy, f"start {i}"), range(100)))
        codes = [r.status_code for r in results]
        held = envoy.metric(STARTUP, outcome="held")
        print(f"\nstartup burst: {codes.count(503)} of 100 got 503, {codes.count(200)} got 200; "
              f"{held:.0f} were held for the first metrics")
        assert codes.count(503) == 0, [r.text for r in results if r.status_code == 503][:3]
        assert codes == [200] * 100, [r.text for r in results if r.status_code != 200][:3]
        assert held > 0, "the burst came after the first metrics: the hold was not exercised"
    finally:
        stop_all(envoy, sims)


class SilentMetrics:
    """A model server whose /metrics never answers (the poller has no result) but which serves
    chat completions: what the proxy sees when it has no metrics at all."""

    def __init__(self):
        stop = self.stop_event = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                stop.wait(30)

            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length", "0")))
                body = json.dumps({"served_by": "silent", "choices": []}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.stop_event.set()
        self.server.shutdown()
        self.server.server_close()


def no_metrics_config(pod, mode):
    return picker_config([{"address": pod.address, "models": [LLAMA]}],
                         poller={"interval_ms": 200, "timeout_ms": 10000, "stale_after_ms": 1000},
                         filter={"failure_mode": mode}, health={"startup_wait_ms": 300})


def test_no_metrics_fail_close_is_an_accurate_503():
    pod = SilentMetrics()
    envoy = Envoy(no_metrics_config(pod, "FailClose"), concurrency=1)
    try:
        r = chat(envoy, "x")
        print(f"\nno metrics, FailClose: {r.status_code} {r.text}")
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["code"] == "metrics_not_ready"
        assert "metrics" in err["message"] and "No endpoint" not in err["message"]
        assert envoy.metric(STARTUP, outcome="expired") >= 1
    finally:
        envoy.stop()
        pod.stop()


def test_no_metrics_fail_open_routes_to_a_configured_endpoint():
    pod = SilentMetrics()
    envoy = Envoy(no_metrics_config(pod, "FailOpen"), concurrency=1)
    try:
        r = chat(envoy, "x")
        assert r.status_code == 200, r.text
        assert r.json()["served_by"] == "silent"
        assert wait_until(lambda: envoy.metric(STARTUP, outcome="expired") >= 1, 5, "the expiry metric")
    finally:
        envoy.stop()
        pod.stop()
