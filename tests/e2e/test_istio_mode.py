"""Issue 6 end-to-end checks: the poller elected by lease among the filter's own roots (no
bootstrap singleton, as on Istio gateways), and InferencePool-like pod discovery from a
(fake) Kubernetes API server."""
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
import requests

from harness import (LLAMA, REPO, Envoy, Sim, endpoint, free_port, picker_config, static_cluster,
                     wait_until, wait_until_shown)

sys.path.insert(0, str(REPO / "tests"))
from fake_k8s_api import FakeK8sApi  # noqa: E402

# The lease holder's log lines (src/host/poller.rs, LeasedPoller).
LEASE_TAKEN = "this root now holds the poller lease"
LEASE_LOST = "poller lease lost"


def scrapes(sims):
    return [s.stats()["metrics_scrapes_total"] for s in sims]


def metrics_cluster_hosts(envoy: Envoy) -> dict[str, dict[str, int]]:
    """Per-pod counters of the poller's ORIGINAL_DST cluster, from Envoy's admin /clusters:
    `{address: {"cx_total": ..., "rq_total": ..., "rq_timeout": ...}}`."""
    text = requests.get(envoy.admin + "/clusters", timeout=5).text
    out: dict[str, dict[str, int]] = {}
    for m in re.finditer(r"^inference_pool_metrics::([\d.]+:\d+)::(\w+)::(\d+)$", text, re.M):
        out.setdefault(m.group(1), {})[m.group(2)] = int(m.group(3))
    return out


def lease_lines(envoy: Envoy, text: str) -> int:
    return sum(1 for line in envoy.log_path.read_text().splitlines() if text in line)


def test_lease_mode_elects_exactly_one_poller_among_worker_roots():
    """Five filter roots (four workers and the main thread) could each poll; exactly one may.
    Which root scrapes is visible in Envoy itself: each root dispatches from its own thread, and
    each thread has its own connection pool, so a pod scraped by k roots has been reached over
    at least k upstream connections of the metrics cluster (one holder reuses one keep-alive
    connection per pod, envoy.yaml). No rate is measured: the check counts connections against
    the roots that took the lease (a legitimate takeover, after a holder missed its renewals
    for lease_ttl_ms on a loaded machine, opens its own connections and logs that it took the
    lease), and scrapes that failed or timed out (which can close a connection)."""
    sims = [Sim(f"lease-{i}") for i in range(3)]
    cfg = picker_config([endpoint(s) for s in sims])
    cfg["poller"].update({"mode": "lease", "lease_ttl_ms": 1000})
    envoy = Envoy(cfg, concurrency=4, singleton=False)
    try:
        envoy.wait_routable()
        # Every pod is scraped many times over (by whoever polls).
        before = scrapes(sims)
        wait_until(lambda: all(a - b >= 15 for a, b in zip(scrapes(sims), before)), 60,
                   "15 more scrapes of every pod")
        hosts = metrics_cluster_hosts(envoy)
        assert set(hosts) == {s.address for s in sims}, hosts

        def one_holder_explains_every_connection():
            taken, lost = lease_lines(envoy, LEASE_TAKEN), lease_lines(envoy, LEASE_LOST)
            # Envoy flushes its log file every few seconds: wait for the lines, do not assume them.
            return taken - lost == 1 and all(
                h["cx_total"] <= taken + h.get("rq_timeout", 0) + h.get("rq_error", 0) for h in hosts.values())
        wait_until_shown(
            one_holder_explains_every_connection, 60,
            "one lease holder, and no more metrics connections per pod than roots that took the lease",
            lambda: f"connections {[h['cx_total'] for h in hosts.values()]}, lease taken "
                    f"{lease_lines(envoy, LEASE_TAKEN)} times, lost {lease_lines(envoy, LEASE_LOST)} times")
        print(f"\nmetrics connections per pod: {[h['cx_total'] for h in hosts.values()]}, scrapes per pod: "
              f"{[h['rq_total'] for h in hosts.values()]}, lease taken {lease_lines(envoy, LEASE_TAKEN)} times")
        # Routing works off the lease holder's snapshots.
        served = {envoy.chat().json()["served_by"] for _ in range(20)}
        assert served <= {s.name for s in sims} and len(served) >= 2
    finally:
        envoy.stop()
        for s in sims:
            s.stop()


def pod(name: str, ip: str, ready: bool = True) -> dict:
    return {
        "metadata": {"name": name, "namespace": "llm", "uid": f"uid-{name}",
                     "labels": {"app": "vllm-llama", "pool": "chat"},
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "vllm-llama-7d9c", "uid": "rs", "controller": True}]},
        "spec": {"containers": [{"name": "vllm", "ports": [{"containerPort": 8000, "protocol": "TCP"}]}]},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"},
                                  {"type": "ContainersReady", "status": "True" if ready else "False"}]},
    }


def write_pods(path: Path, pods: list) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"kind": "PodList", "apiVersion": "v1",
                               "metadata": {"resourceVersion": str(time.time_ns())}, "items": pods}))
    os.replace(tmp, path)


def test_pod_discovery_follows_readiness_and_new_pods(tmp_path):
    port = free_port()
    # Three "pods" on distinct loopback addresses, one target port, as an InferencePool sees them.
    ips = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    sims = [Sim(f"pod-{i}", host=ip, port=port) for i, ip in enumerate(ips)]
    pods_file = tmp_path / "pods.json"
    write_pods(pods_file, [pod("pod-0", ips[0]), pod("pod-1", ips[1])])
    with FakeK8sApi(pods_file, token="secret-token") as api:
        cfg = picker_config([])
        cfg["models"] = [{"name": LLAMA}]
        cfg["discovery"] = {"kubernetes": {
            "namespace": "llm", "selector": {"app": "vllm-llama"}, "target_ports": [port],
            "api_cluster": "kubernetes_api", "api_authority": "kubernetes.default.svc",
            "token": "secret-token", "refresh_ms": 1000, "timeout_ms": 1000}}
        # Envoy's cluster holds every pod, as a headless Service's STRICT_DNS cluster (or the
        # Service's EDS cluster on Istio) would; the module's discovery decides which are picked.
        envoy = Envoy(cfg, concurrency=2, extra_clusters=[static_cluster("kubernetes_api", "127.0.0.1", api.port)],
                      pool_hosts=[s.address for s in sims])
        try:
            # Both listed pods discovered and scraped (the configuration lists no endpoint, so
            # the number to wait for is given).
            envoy.wait_routable(ready=2, timeout=30)
            seen = {envoy.chat().json()["served_by"] for _ in range(20)}
            assert seen == {"pod-0", "pod-1"}, seen
            # pod-1 turns NotReady and pod-2 is added: after a refresh and a poll round, traffic
            # follows. Waited for on what the requests show, not for a time.
            write_pods(pods_file, [pod("pod-0", ips[0]), pod("pod-1", ips[1], ready=False), pod("pod-2", ips[2])])
            last = []

            def traffic_follows():
                last[:] = [{envoy.chat().json()["served_by"] for _ in range(12)}]
                return last[0] == {"pod-0", "pod-2"}
            wait_until_shown(traffic_follows, 30, "traffic on pod-0 and pod-2 only", lambda: last)
            stats = requests.get(f"http://127.0.0.1:{api.port}/fake/stats", timeout=5).json()
            assert stats["requests"] >= 2
        finally:
            envoy.stop()
            for s in sims:
                s.stop()


@pytest.mark.parametrize("mode", ["FailOpen", "FailClose"])
def test_stale_snapshot_fail_open_routes_fail_close_answers_503(mode):
    """InferencePool failureMode mapped to filter.failure_mode: every scrape fails (the metrics
    path does not exist), so no endpoint has fresh metrics."""
    sims = [Sim(f"{mode}-{i}") for i in range(2)]
    cfg = picker_config([endpoint(s) for s in sims], filter={"failure_mode": mode})
    cfg["poller"]["metrics_path"] = "/no-such-metrics"
    envoy = Envoy(cfg, concurrency=2)
    try:
        # Several failed rounds (404 from every pod): the first of them has been published and
        # read by the workers (each at most one poll interval later), as Sim.wait_scraped does
        # for successful scrapes.
        wait_until(lambda: envoy.metric("inference_picker_scrape_failures_total", reason="status") >= 4 * len(sims),
                   30, "four failed scrapes per pod")
        results = [envoy.chat(content=f"r{i}") for i in range(6)]
        if mode == "FailOpen":
            assert all(r.status_code == 200 for r in results), [r.text for r in results]
            assert {r.json()["served_by"] for r in results} <= {s.name for s in sims}
        else:
            assert all(r.status_code == 503 for r in results), [r.text for r in results]
            assert all(r.json()["error"]["code"] == "no_healthy_endpoint" for r in results)
            assert all(s.requests_total() == 0 for s in sims)
    finally:
        envoy.stop()
        for s in sims:
            s.stop()
