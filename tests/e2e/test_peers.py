"""Gateway replicas that exchange their prefix tables (`peers`, crate::peers), in real Envoy.

Two Envoys (two gateway replicas) in front of the same two pods, each listing the other as its
peer. A long prompt routed by replica A must show, after one exchange, as a prefix match on the
same pod in replica B's debug scores, although B never saw it. The exchange path itself must
answer locally, only to a POST with the token, and nothing of it may reach a pod.
"""

import concurrent.futures as cf
import json
import os
import socket
import struct
import sys
import threading
import time

import pytest
import requests

from harness import REPO, Envoy, Sim, endpoint, free_port, picker_config, static_cluster, stop_each, wait_until

sys.path.insert(0, str(REPO / "tests"))
from fake_k8s_api import FakeK8sApi  # noqa: E402

TOKEN = "e2e-peer-token-0123456789"
PATH = "/.inference-picker/v1/prefixes"
SCORES = "x-inference-picker-scores"
# Peer messages (src/base/codec.rs): a tag byte and a version byte, then little-endian fields.
BATCH = bytes([0x05, 1])  # prefix records: u32 count, then 18-byte records
# A load report of older builds (the load exchange between replicas was removed): u64 sender
# nonce, then the counts (u32 count, entries of str address, u32 n, u32 prefill_n, u64 tokens).
LOAD = bytes([0x06, 1])


def _config(sims, peer_port, **peers):
    return picker_config(
        [endpoint(s) for s in sims],
        scheduler={"debug_scores": True},
        filter={"expose_served_endpoint": True},
        peers={"addresses": [f"127.0.0.1:{peer_port}"], "token": TOKEN, "interval_ms": 200,
               "timeout_ms": 200, **peers},
    )


def _prefix_scores(response) -> dict:
    """address → prefix score, from the debug scores header."""
    out = {}
    for part in response.headers[SCORES].split(", "):
        fields = part.split()
        out[fields[0]] = float(next(f for f in fields if f.startswith("p=")).split("=")[1])
    return out


def _one_replica_placed_the_other_knows(a, b, sims):
    """A long prompt through replica A; its next turn through B, which never saw the first."""
    a.wait_routable()
    b.wait_routable()
    system = "You are a careful assistant. " + "Background: " + "the quick brown fox " * 300
    first = a.chat(content=system + "\nQuestion one?")
    assert first.status_code == 200, first.text
    placed = first.headers["x-gateway-destination-endpoint-served"]
    # B learns it from A's next send (every 200 ms).
    wait_until(lambda: b.metric("inference_picker_peer_records_total", outcome="applied") > 0, 10,
               "replica B to apply replica A's prefix records")
    # The conversation's next turn reaches B, which never saw the first: it knows where the
    # prefix lives only from A.
    second = b.chat(content=system + "\nQuestion one?\nAnd a second question?")
    assert second.status_code == 200, second.text
    scores = _prefix_scores(second)
    others = [addr for addr in scores if addr != placed]
    assert scores[placed] > 0.5, scores
    assert all(scores[o] == 0 for o in others), scores
    assert second.headers["x-gateway-destination-endpoint-served"] == placed


def test_a_prefix_one_replica_placed_is_known_to_the_other():
    sims = [Sim("peer-a"), Sim("peer-b")]
    port_a, port_b = free_port(), free_port()
    a = b = None
    try:
        a = Envoy(_config(sims, port_b), port=port_a)
        b = Envoy(_config(sims, port_a), port=port_b)
        _one_replica_placed_the_other_knows(a, b, sims)
    finally:
        stop_each(a, b, sims)


class BlackHole:
    """A peer that accepts connections and never answers (a hung replica)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted = []
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)  # held open, never read, never answered

    def stop(self):
        self.closed.set()
        for c in self.accepted:
            c.close()
        self.sock.close()


def test_a_dead_and_a_hung_peer_cost_no_request_and_do_not_stop_the_exchange():
    # Replica A lists three peers: a port nobody listens on, one that accepts and never
    # answers, and replica B. Requests through A must all succeed, B must still learn A's
    # placements, and A must count the failed sends.
    sims = [Sim("peer-d0"), Sim("peer-d1")]
    hole = BlackHole()
    dead = free_port()
    port_a, port_b = free_port(), free_port()
    a = b = None
    try:
        cfg_a = _config(sims, port_b)
        cfg_a["peers"]["addresses"] = [f"127.0.0.1:{dead}", f"127.0.0.1:{hole.port}", f"127.0.0.1:{port_b}"]
        a = Envoy(cfg_a, port=port_a)
        b = Envoy(_config(sims, port_a), port=port_b)
        _one_replica_placed_the_other_knows(a, b, sims)
        # Both bad peers failed the send of that batch (refused, and timed out after
        # peers.timeout_ms).
        wait_until(lambda: a.metric("inference_picker_peer_send_failures_total") >= 2, 10,
                   "replica A to count its failed sends")
        assert hole.accepted, "the hung peer was never tried"
        # Requests keep flowing through A while its sends fail, and B keeps learning: A's newer
        # prefix records and its newer placements both reach B, and both bodies fail to both
        # bad peers.
        failures = a.metric("inference_picker_peer_send_failures_total")
        applied = b.metric("inference_picker_peer_records_total", outcome="applied")
        placed = b.metric("inference_picker_peer_placements_total", outcome="applied")
        for i in range(10):
            r = a.chat(content=f"independent prompt {i} " + "lorem ipsum " * 100)
            assert r.status_code == 200, r.text
        wait_until(lambda: b.metric("inference_picker_peer_records_total", outcome="applied") > applied, 10,
                   "replica B to apply A's newer records while A's other peers fail")
        wait_until(lambda: b.metric("inference_picker_peer_placements_total", outcome="applied") > placed, 10,
                   "replica B to apply A's newer placements while A's other peers fail")
        wait_until(lambda: a.metric("inference_picker_peer_send_failures_total") >= failures + 4, 10,
                   "replica A to count the failed sends of its newer records and placements")
        for i in range(3):
            assert a.chat(content=f"still routed {i}").status_code == 200
    finally:
        stop_each(a, b, hole, sims)


def _inflight(envoy, sim) -> float:
    return envoy.metric("inference_picker_endpoint_inflight", endpoint=sim.address)


def _old_load_report(sender: int, address: str, n: int) -> bytes:
    """A load report as older builds sent it: `address` has `n` requests in flight there."""
    a = address.encode()
    return LOAD + struct.pack("<QII", sender, 1, len(a)) + a + struct.pack("<IIQ", n, 0, 0)


def test_an_older_replicas_load_reports_are_answered_204_counted_and_not_applied():
    # During a rolling upgrade a replica of an older build still POSTs its in-flight counts on
    # the exchange path. They are answered 204 (so it logs no send failure), counted in
    # records_skipped_total{reason="peer_load"}, and never added to this gateway's counts:
    # with one request held at the pod, the pod's in-flight count here stays 1 while reports
    # claiming 5 more keep coming, from many senders, malformed ones included.
    sim = Sim("peer-old-load")
    envoy = None
    try:
        config = _config([sim], free_port())
        config["filter"]["endpoint_metrics"] = True
        envoy = Envoy(config)
        envoy.wait_routable()
        url = envoy.url + PATH
        good = {"x-inference-picker-peer-token": TOKEN}
        before = sim.requests_total()
        sim.hold()
        with cf.ThreadPoolExecutor(1) as pool, requests.Session() as peer:
            held = pool.submit(envoy.chat, content="held while old replicas report", timeout=60)
            sim.wait_held(1)
            wait_until(lambda: _inflight(envoy, sim) == 1, 15, "the held request counted")
            seen = set()
            sent = 0
            # 1.5 s of reports: the in-flight gauge is re-set from the shared counts every 250 ms.
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                for body in (_old_load_report(0x1000 + sent, sim.address, 5), LOAD + bytes(3)):
                    r = peer.post(url, data=body, headers=good, timeout=5)
                    assert r.status_code == 204, (r.status_code, r.text)
                    sent += 1
                seen.add(_inflight(envoy, sim))
            seen.add(_inflight(envoy, sim))
            assert seen == {1}, f"the pod's in-flight count was {sorted(seen)} with one request held"
            sim.release()
            assert held.result(timeout=30).status_code == 200
        assert sim.requests_total() == before + 1, "a load report reached the pod"
        wait_until(lambda: envoy.metric("inference_picker_records_skipped_total", reason="peer_load") == sent,
                   10, f"the {sent} old load reports counted as skipped")
        assert envoy.metric("inference_picker_peer_records_total", outcome="refused") == 0
        assert envoy.metric("inference_picker_peer_placements_total", outcome="refused") == 0
    finally:
        stop_each(envoy, sim)


def test_the_exchange_path_answers_locally_and_only_to_the_token():
    sims = [Sim("peer-c")]
    port_a = free_port()
    envoy = None
    try:
        envoy = Envoy(_config(sims, free_port()), port=port_a)
        envoy.wait_routable()
        before = sims[0].requests_total()
        url = envoy.url + PATH
        good = {"x-inference-picker-peer-token": TOKEN}
        # No token, a wrong token (same length), another method, a malformed body, too large.
        assert requests.post(url, data=BATCH, timeout=5).status_code == 403
        wrong = {"x-inference-picker-peer-token": TOKEN[:-1] + "x"}
        assert requests.post(url, data=BATCH, headers=wrong, timeout=5).status_code == 403
        assert requests.get(url, headers=good, timeout=5).status_code == 405
        bad = requests.post(url, data=BATCH + b"\x00" * 17, headers=good, timeout=5)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "bad_peer_records", bad.text
        big = requests.post(url, data=BATCH + b"\x00" * (4 + 18 * 4097), headers=good, timeout=5)
        assert big.status_code == 413, big.text
        # A well-formed batch is applied and answered 204.
        record = (7).to_bytes(8, "little") + (1).to_bytes(4, "little") + b"\x00" * 6
        ok = requests.post(url, data=BATCH + (1).to_bytes(4, "little") + record, headers=good, timeout=5)
        assert ok.status_code == 204, ok.text
        assert envoy.metric("inference_picker_peer_records_total", outcome="applied") == 1
        assert envoy.metric("inference_picker_peer_records_total", outcome="refused") == 1
        # A batch of a format version this build does not read (a replica of another build during
        # a rolling upgrade): 204, ignored, counted.
        other = requests.post(url, data=bytes([0x05, 99]) + (1).to_bytes(4, "little") + record, headers=good,
                              timeout=5)
        assert other.status_code == 204, other.text
        assert envoy.metric("inference_picker_peer_records_total", outcome="skipped") == 1
        assert envoy.metric("inference_picker_peer_records_total", outcome="applied") == 1
        # With a query string it is not the exchange path, and not an inference path either.
        assert requests.post(url + "?x=1", data=BATCH, headers=good, timeout=5).status_code == 404
        # Each answer above came back before this line: one that went upstream would have been
        # answered by the pod, after the pod counted it. So no wait is needed.
        assert sims[0].requests_total() == before, "an exchange request reached a pod"
    finally:
        stop_each(envoy, sims)


def _gateway_pod(name: str) -> dict:
    """A Ready gateway pod as the Kubernetes API lists it (both replicas on 127.0.0.1, told
    apart by the port `peers.kubernetes.target_ports` names)."""
    return {
        "metadata": {"name": name, "namespace": "gw", "uid": f"uid-{name}",
                     "labels": {"app": "inference-gateway"}},
        "spec": {"containers": [{"name": "envoy"}]},
        "status": {"phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}],
                   "conditions": [{"type": "Ready", "status": "True"}]},
    }


def test_replicas_find_each_other_through_the_kubernetes_api(tmp_path):
    # Each replica lists "its" gateway pods from a fake API server: the other replica's pod
    # (the port tells them apart on one host). Nothing but the pod list names the peer.
    sims = [Sim("peer-k0"), Sim("peer-k1")]
    port_a, port_b = free_port(), free_port()
    files = {}
    for name in ("a", "b"):
        f = tmp_path / f"pods-{name}.json"
        f.write_text(json.dumps({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"},
                                 "items": [_gateway_pod(f"gw-{name}")]}))
        files[name] = f
    a = b = None
    with FakeK8sApi(files["a"], token="k8s-token") as api_a, FakeK8sApi(files["b"], token="k8s-token") as api_b:
        try:
            def cfg(other_port):
                c = _config(sims, 1)
                c["peers"] = {"kubernetes": {
                    "namespace": "gw", "selector": {"app": "inference-gateway"}, "target_ports": [other_port],
                    "api_cluster": "kubernetes_api", "token": "k8s-token", "refresh_ms": 1000, "timeout_ms": 1000},
                    "token": TOKEN, "interval_ms": 200, "timeout_ms": 200,
                    # Sent with this Host (the listener's virtual host takes any).
                    "authority": "llm.example.com"}
                return c
            a = Envoy(cfg(port_b), port=port_a,
                      extra_clusters=[static_cluster("kubernetes_api", "127.0.0.1", api_a.port)])
            b = Envoy(cfg(port_a), port=port_b,
                      extra_clusters=[static_cluster("kubernetes_api", "127.0.0.1", api_b.port)])
            _one_replica_placed_the_other_knows(a, b, sims)
            stats = requests.get(f"http://127.0.0.1:{api_a.port}/fake/stats", timeout=5).json()
            assert stats["requests"] >= 1
            # The API fails from now on: A keeps the peers it found, so B keeps learning.
            broken = tmp_path / "status.json"
            broken.write_text(json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                          "code": 503, "reason": "ServiceUnavailable", "message": "down"}))
            os.replace(broken, files["a"])
            failures = a.metric("inference_picker_peer_send_failures_total")
            wait_until(lambda: a.metric("inference_picker_peer_send_failures_total") > failures, 10,
                       "replica A to count the failed pod list")
            applied = b.metric("inference_picker_peer_records_total", outcome="applied")
            for i in range(5):
                r = a.chat(content=f"after the API failed {i} " + "lorem ipsum " * 100)
                assert r.status_code == 200, r.text
            wait_until(lambda: b.metric("inference_picker_peer_records_total", outcome="applied") > applied, 10,
                       "replica B to apply A's records after A's pod list failed")
        finally:
            stop_each(a, b, sims)


PLACEMENTS = bytes([0x12, 1])  # placement batch: u64 sender, u32 count, placements


def _placement_batch(sender: int, address: str, hashes: list[int]) -> bytes:
    a = address.encode()
    body = PLACEMENTS + struct.pack("<QI", sender, 1) + struct.pack("<I", len(a)) + a
    body += struct.pack("<II", 1000, len(hashes)) + b"".join(struct.pack("<Q", h) for h in hashes)
    return body


def test_a_peers_placements_are_applied_and_a_malformed_batch_is_refused_whole():
    sims = [Sim("peer-p")]
    envoy = None
    try:
        envoy = Envoy(_config(sims, free_port()))
        envoy.wait_routable()
        before = sims[0].requests_total()
        url = envoy.url + PATH
        good = {"x-inference-picker-peer-token": TOKEN}
        ok = requests.post(url, data=_placement_batch(7, sims[0].address, [1, 2, 3]), headers=good, timeout=5)
        assert ok.status_code == 204, ok.text
        wait_until(lambda: envoy.metric("inference_picker_peer_placements_total", outcome="applied") >= 1, 10,
                   "the placement counted as applied")
        # A count that promises more than the body holds: refused whole, nothing applied.
        bad = requests.post(url, data=PLACEMENTS + struct.pack("<QI", 7, 3), headers=good, timeout=5)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "bad_peer_placements", bad.text
        wait_until(lambda: envoy.metric("inference_picker_peer_placements_total", outcome="refused") >= 1, 10,
                   "the malformed batch counted as refused")
        assert sims[0].requests_total() == before, "nothing of the exchange reached a pod"
    finally:
        if envoy:
            envoy.stop()
        for s in sims:
            s.stop()
