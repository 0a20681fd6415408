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

from harness import LLAMA, Envoy, Sim, endpoint, picker_config, static_cluster, wait_until, wait_until_shown

EJECTIONS = "inference_picker_health_ejections_total"
STARTUP = "inference_picker_startup_requests_total"
# Requests are sent one after another with this gap ("sequential-ish"): pacing only, so that a
# test sends tens of requests rather than thousands while it waits (bounded) for an event. A pod
# that just failed counts as loaded for health.failure_load_ms, so back-to-back requests would
# avoid it rather than try it again until that time has passed. Nothing is asserted about time.
GAP_S = 0.15
# health.failure_load_ms, the default.
FAILURE_LOAD_S = 2.0


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
    # Ejections by endpoint: the endpoint tag is opt-in (bounded metric names by default). The
    # ejection lasts 300 s (the default is 30 s), longer than any run of this test however slow.
    cfg = picker_config([endpoint(s) for s in sims], filter={"endpoint_metrics": True},
                        health={"base_ejection_ms": 300_000, "max_ejection_ms": 300_000})
    envoy = Envoy(cfg, concurrency=2)
    try:
        envoy.wait_routable()
        bad.chaos(**mode)
        statuses = []

        def one() -> None:
            statuses.append(chat(envoy, f"hole {len(statuses)}").status_code)

        # Sequential requests (paced by GAP_S) until the black hole is ejected (the metric).
        def ejected() -> bool:
            one()
            return ejections(envoy, bad) > 0

        wait_until_shown(ejected, 120, "the black hole ejected", lambda: (len(statuses), bad.chaos_total()),
                         interval=GAP_S)
        ejected_at, tries_at_ejection = len(statuses) - 1, bad.chaos_total()
        # Then on, paced the same way, until 30 requests have been sent more than failure_load_ms
        # after the ejection (and 60 in all): by then a failure's phantom load has worn off, so a
        # black hole still picked (an ejection not applied) would be tried again, by one of them
        # at least ((2/3)^30 ≈ 5e-6 that none picks it).
        seen = time.monotonic()
        late = []

        def enough_after() -> bool:
            one()
            if time.monotonic() - seen > FAILURE_LOAD_S:
                late.append(len(statuses))
            return len(late) >= 30 and len(statuses) >= 60

        wait_until(enough_after, 120, "requests after the ejection", interval=GAP_S)
        failed = sum(1 for s in statuses if s != 200)
        tries = bad.chaos_total()
        print(f"\n{mode}: {failed} of {len(statuses)} failed; black hole tried {tries} times, "
              f"ejected after request {ejected_at}")
        assert failed <= 3, statuses
        # The black hole's own count stops growing once it is ejected.
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

        # Sequential requests (paced by GAP_S) until the pod is ejected (the metric).
        def ejected() -> bool:
            nonlocal n
            chat(envoy, f"fail {n}")
            n += 1
            return ejections(envoy, bad) > 0

        wait_until(ejected, 60, "the failing pod ejected", interval=GAP_S)
        ejected_at = time.monotonic()
        bad.chaos("ok")

        # Then until the healed pod serves a request (every request succeeding meanwhile).
        def healed_pod_served() -> bool:
            nonlocal n
            r = chat(envoy, f"heal {n}")
            n += 1
            assert r.status_code == 200, r.text
            return r.json()["served_by"] == bad.name

        wait_until(healed_pod_served, 60, "the healed pod to get traffic again", interval=GAP_S)
        print(f"\nhealed pod served again {time.monotonic() - ejected_at:.1f} s after its ejection "
              f"(base_ejection_ms 1000, failure_load_ms 2000)")
        # Probation ended with that success: no re-ejection.
        assert ejections(envoy, bad) == 1
    finally:
        stop_all(envoy, sims)


class GatedMetrics:
    """The cluster the poller scrapes through (`poller.cluster`, a STATIC cluster to this
    server), which keeps every scrape waiting until `open()`, then passes each to the pod it
    names (`x-envoy-original-dst-host`, which the poller sets for its ORIGINAL_DST cluster): the
    test decides when the first metrics arrive."""

    CLUSTER = "gated_metrics"

    def __init__(self):
        gate = self.gate = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                if gate.wait(60):
                    pod = self.headers["x-envoy-original-dst-host"]
                    r = requests.get(f"http://{pod}{self.path}", timeout=10)
                    status, body = r.status_code, r.content
                else:
                    status, body = 503, b"gate never opened"
                self.send_response(status)
                self.send_header("content-type", "text/plain; version=0.0.4")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def cluster(self) -> dict:
        return static_cluster(self.CLUSTER, "127.0.0.1", self.port)

    def open(self):
        self.gate.set()

    def stop(self):
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()


def test_startup_burst_gets_no_503():
    """100 requests, 25 at a time, sent the moment Envoy's /ready says 200 (the harness returns
    then): before the first snapshot they are held, then routed. The poller's scrapes wait at a
    gate until all 25 first requests are held (the metric), so the burst certainly comes before
    the first metrics; startup_wait_ms is raised (the default is 1000) so that the hold outlasts
    that wait on a slow machine, and the held requests are released by the metrics, not by
    their expiry."""
    sims = [Sim(f"start-{i}") for i in range(3)]
    gate = GatedMetrics()
    cfg = picker_config([endpoint(s) for s in sims],
                        poller={"interval_ms": 500, "timeout_ms": 50_000, "stale_after_ms": 2000,
                                "cluster": GatedMetrics.CLUSTER},
                        health={"startup_wait_ms": 60_000})
    envoy = Envoy(cfg, concurrency=2, extra_clusters=[gate.cluster()])
    try:
        with cf.ThreadPoolExecutor(25) as pool:
            futures = [pool.submit(chat, envoy, f"start {i}") for i in range(100)]
            wait_until_shown(lambda: envoy.metric(STARTUP, outcome="held") >= 25, 60,
                             "the burst's first 25 requests held", lambda: envoy.metric(STARTUP, outcome="held"))
            assert envoy.metric("inference_picker_ready_endpoints") == 0, "metrics came through the gate"
            gate.open()
            results = [f.result() for f in futures]
        codes = [r.status_code for r in results]
        held = envoy.metric(STARTUP, outcome="held")
        released = envoy.metric(STARTUP, outcome="released")
        print(f"\nstartup burst: {codes.count(503)} of 100 got 503, {codes.count(200)} got 200; "
              f"{held:.0f} were held for the first metrics")
        assert codes.count(503) == 0, [r.text for r in results if r.status_code == 503][:3]
        assert codes == [200] * 100, [r.text for r in results if r.status_code != 200][:3]
        # Every held request was released by the first metrics, none by its expiry.
        assert held >= 25 and released == held, (held, released)
        assert envoy.metric(STARTUP, outcome="expired") == 0
    finally:
        stop_all(envoy, sims)
        gate.stop()


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
