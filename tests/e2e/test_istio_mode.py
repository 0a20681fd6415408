"""Issue 6 end-to-end checks: the poller elected by lease among the filter's own roots (no
bootstrap singleton, as on Istio gateways), and InferencePool-like pod discovery from a
(fake) Kubernetes API server."""
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests

from harness import LLAMA, REPO, Envoy, Sim, endpoint, free_port, picker_config, static_cluster

POLL_S = 0.2
sys.path.insert(0, str(REPO / "tests"))
from fake_k8s_api import FakeK8sApi  # noqa: E402


def scrapes(sims):
    return [s.stats()["metrics_scrapes_total"] for s in sims]


def test_lease_mode_elects_exactly_one_poller_among_worker_roots():
    sims = [Sim(f"lease-{i}") for i in range(3)]
    cfg = picker_config([endpoint(s) for s in sims])
    cfg["poller"].update({"mode": "lease", "lease_ttl_ms": 1000})
    # Four workers plus the main thread: five filter roots tick, and each could poll.
    envoy = Envoy(cfg, concurrency=4, singleton=False)
    try:
        envoy.wait_routable()
        time.sleep(1.0)
        before = scrapes(sims)
        window = 3.0
        time.sleep(window)
        after = scrapes(sims)
        rounds = [a - b for a, b in zip(after, before)]
        # One poller at 200 ms scrapes each pod ~15 times in 3 s; five pollers would be ~75.
        expected = window / POLL_S
        assert all(0.6 * expected <= r <= 1.3 * expected for r in rounds), rounds
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
            envoy.wait_routable()
            seen = {envoy.chat().json()["served_by"] for _ in range(20)}
            assert seen == {"pod-0", "pod-1"}, seen
            # pod-1 turns NotReady and pod-2 is added: within a refresh and a poll round, traffic follows.
            write_pods(pods_file, [pod("pod-0", ips[0]), pod("pod-1", ips[1], ready=False), pod("pod-2", ips[2])])
            deadline = time.time() + 6
            while time.time() < deadline:
                seen = {envoy.chat().json()["served_by"] for _ in range(12)}
                if seen == {"pod-0", "pod-2"}:
                    break
                time.sleep(0.2)
            assert seen == {"pod-0", "pod-2"}, seen
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
        time.sleep(5 * POLL_S)  # several failed rounds published
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
