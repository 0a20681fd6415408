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
LOAD = bytes([0x06, 1])  # load report: u64 sender nonce, then the counts (u32 count, entries)


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
        cfg_a = _config(sims, port_b, load_interval_ms=100)
        cfg_a["peers"]["addresses"] = [f"127.0.0.1:{dead}", f"127.0.0.1:{hole.port}", f"127.0.0.1:{port_b}"]
        a = Envoy(cfg_a, port=port_a)
        b = Envoy(_config(sims, port_a), port=port_b)
        _one_replica_placed_the_other_knows(a, b, sims)
        # Both bad peers failed the send of that batch (refused, and timed out after
        # peers.timeout_ms).
        wait_until(lambda: a.metric("inference_picker_peer_send_failures_total") >= 2, 10,
                   "replica A to count its failed sends")
        assert hole.accepted, "the hung peer was never tried"
        # Requests keep flowing through A while its sends fail, and B keeps learning.
        failures = a.metric("inference_picker_peer_send_failures_total")
        applied = b.metric("inference_picker_peer_records_total", outcome="applied")
        for i in range(10):
            r = a.chat(content=f"independent prompt {i} " + "lorem ipsum " * 100)
            assert r.status_code == 200, r.text
        wait_until(lambda: b.metric("inference_picker_peer_records_total", outcome="applied") > applied, 10,
                   "replica B to apply A's newer records while A's other peers fail")
        wait_until(lambda: a.metric("inference_picker_peer_send_failures_total") >= failures + 2, 10,
                   "replica A to count the failed sends of its newer records")
        # With no traffic at all, A's in-flight reports (every 100 ms) keep failing to the two
        # bad peers and keep reaching B.
        failures = a.metric("inference_picker_peer_send_failures_total")
        reports = b.metric("inference_picker_peer_load_reports_total", outcome="applied")
        wait_until(lambda: a.metric("inference_picker_peer_send_failures_total") >= failures + 6, 10,
                   "replica A to count its failed in-flight reports")
        assert b.metric("inference_picker_peer_load_reports_total", outcome="applied") > reports
        for i in range(3):
            assert a.chat(content=f"still routed {i}").status_code == 200
    finally:
        stop_each(a, b, hole, sims)


def _inflight(envoy, sim) -> float:
    return envoy.metric("inference_picker_endpoint_inflight", endpoint=sim.address)


def _counted(envoy, outcome: str) -> float:
    return envoy.metric("inference_picker_peer_load_reports_total", outcome=outcome)


def _ready(envoy) -> None:
    """Waits until the pod is scraped, without routing anything through `envoy`."""
    wait_until(lambda: envoy.metric("inference_picker_ready_endpoints") >= 1, 15, "the pod scraped")


def test_replicas_that_exchange_load_count_each_others_requests():
    # `peers.load_interval_ms`: each replica reports its in-flight counts to the others every
    # 100 ms. A long request through A must show in B's in-flight count for that pod (B sent
    # nothing), and leave it when it ends. A lists itself too: its own report must never
    # double its count, over many exchanges, on either of its workers. B routes nothing while
    # that is checked, so any count at A other than 1 is A counting its one request twice.
    sim = Sim("peer-load", extra=["--delay-per-token-ms", "50"])
    port_a, port_b = free_port(), free_port()
    a = b = None
    try:
        def cfg(peer_ports):
            c = _config([sim], 1, load_interval_ms=100)
            c["peers"]["addresses"] = [f"127.0.0.1:{p}" for p in peer_ports]
            c["filter"]["endpoint_metrics"] = True
            return c
        a = Envoy(cfg([port_a, port_b]), port=port_a)
        b = Envoy(cfg([port_a]), port=port_b)
        a.wait_routable()
        _ready(b)
        wait_until(lambda: _counted(a, "own") > 0 and _counted(a, "applied") > 0, 10, "A to hear both reports")
        with cf.ThreadPoolExecutor(2) as pool:
            # ~200 decode steps of 50 ms: about 10 s in flight, far longer than the checks.
            long = pool.submit(a.chat, content="a long answer please", max_tokens=200)
            wait_until(lambda: _inflight(b, sim) == 1, 10, "replica B to count A's request")
            # Twenty more rounds of A's own report and of B's report applied at A, with A's
            # gauge (re-set from the shared counts every 250 ms by each worker) read all along.
            own0, applied0 = _counted(a, "own"), _counted(a, "applied")
            seen = set()

            def rounds_done():
                seen.add(_inflight(a, sim))
                return _counted(a, "own") >= own0 + 20 and _counted(a, "applied") >= applied0 + 20
            wait_until(rounds_done, 30, "twenty more rounds of the exchange at A", interval=0.02)
            seen.add(_inflight(a, sim))
            assert seen == {1}, f"A counted its one request as {sorted(seen)}"
            assert _inflight(b, sim) == 1
            assert not long.done(), "the long request ended during the checks"
            # B's own request counts at A too, and leaves A's count with B's first report after
            # it ended (a report is a snapshot: until then A still counts it).
            short = b.chat(content="a short one", max_tokens=2)
            assert short.status_code == 200, short.text
            applied = _counted(a, "applied")
            wait_until(lambda: _counted(a, "applied") >= applied + 2, 10, "two reports of B after its request")
            wait_until(lambda: _inflight(a, sim) == 1, 10, "A to stop counting B's finished request")
            r = long.result(timeout=30)
            assert r.status_code == 200, r.text
        wait_until(lambda: _inflight(b, sim) == 0, 10, "replica B to see A's request end")
        assert _inflight(a, sim) == 0
        assert _counted(a, "error") == 0 and _counted(a, "refused_full") == 0
        # A malformed report is refused whole, and counted.
        url = b.url + PATH
        bad = requests.post(url, data=LOAD + bytes(8) + bytes(4), timeout=5,
                            headers={"x-inference-picker-peer-token": TOKEN})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "bad_peer_load", bad.text
        assert _counted(b, "refused") == 1
    finally:
        stop_each(a, b, sim)


# A peer's in-flight record lives this long after it is written (src/state/inflight.rs, TTL_MS).
TTL_S = 2.0


def _exact_balance(doc: dict) -> None:
    """Each new connection to the worker with the fewest: two open connections are on two
    workers."""
    doc["static_resources"]["listeners"][0]["connection_balance_config"] = {"exact_balance": {}}


def test_a_flood_of_sender_ids_cannot_hide_the_workers_counts():
    # A peer holding the token reports under 1,000 invented sender ids. This gateway has one
    # peer, so it keeps one live peer record and refuses the rest (429); the workers' own
    # in-flight records never compete with them, so each worker still sees the other's
    # requests (the gauge, re-set by both workers from the shared counts, shows both).
    sim = Sim("peer-flood")
    envoy = None
    try:
        config = _config([sim], free_port())
        config["filter"]["endpoint_metrics"] = True
        envoy = Envoy(config, concurrency=2, mutate=_exact_balance)
        # Ready without routing anything: no worker has claimed an in-flight slot yet.
        _ready(envoy)
        url = envoy.url + PATH
        # (sent, answered, status) per report, on the monotonic clock. A peer record lives
        # TTL_S after it was written (a peer that stops reporting is gone), so a later sender may
        # take the slot once the first record is that old: on a slow machine the flood outlasts
        # it. The rule checked is the cap itself: between two accepted senders, the earlier one's
        # record had aged out, so more than TTL_S passed from the earlier send to the later answer.
        answers = []
        with requests.Session() as peer:
            for i in range(1000):
                body = LOAD + (0x1000 + i).to_bytes(8, "little") + bytes(4)
                sent = time.monotonic()
                r = peer.post(url, data=body, headers={"x-inference-picker-peer-token": TOKEN}, timeout=5)
                answers.append((sent, time.monotonic(), r.status_code))
        statuses = [s for _, _, s in answers]
        assert set(statuses) <= {204, 429}, sorted(set(statuses))
        assert statuses[0] == 204, statuses[:3]
        accepted = [(sent, done) for sent, done, s in answers if s == 204]
        for (sent_a, _), (_, done_b) in zip(accepted, accepted[1:]):
            assert done_b - sent_a > TTL_S, (
                f"two senders accepted {done_b - sent_a:.2f} s apart, within a record's life: "
                f"{len(accepted)} of 1,000 applied")
        assert _counted(envoy, "applied") == len(accepted)
        assert _counted(envoy, "refused_full") == statuses.count(429)
        # Two requests held at the pod, on two connections, so on the two workers.
        sim.hold()
        with cf.ThreadPoolExecutor(2) as pool:
            held = [pool.submit(envoy.chat, content=f"held {i}", timeout=60) for i in range(2)]
            sim.wait_held(2)
            wait_until(lambda: _inflight(envoy, sim) == 2, 15,
                       "the workers to count each other's request despite the flood")
            sim.release()
            for h in held:
                assert h.result(timeout=30).status_code == 200
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
