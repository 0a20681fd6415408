"""The placement feed between one Envoy's workers (`src/state/feed.rs`), in a real Envoy 1.40
with 2 workers running the built .wasm.

A long prompt sent on a connection of worker A must be known, block for block, to worker B,
which never sent it: B's debug scores give the pod A chose the whole prompt (prefix score 1),
from A's placement replayed into B's own index. Without the feed, B would know it only from
the cross-worker table, whose checkpoints stop at a quarter octave (96 of the prompt's ~100
blocks here: a score below 1).

Which worker serves a connection is the kernel's choice; the test tells them apart by the
listener's per-worker connection counters (as `test_fairness_workers.py` does) and keeps each
request on its worker's keep-alive connection. Every wait is bounded and on an event.
"""
import http.client
import json

from harness import LLAMA, Envoy, Sim, endpoint, picker_config
from test_fairness_workers import connections_by_worker

SCORES = "x-inference-picker-scores"
SERVED = "x-gateway-destination-endpoint-served"


def _post(conn: http.client.HTTPConnection, content: str):
    body = json.dumps({"model": LLAMA, "max_tokens": 4, "messages": [{"role": "user", "content": content}]})
    conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
    r = conn.getresponse()
    r.read()
    return r


def _prefix_scores(response) -> dict:
    """address → prefix score, from the debug scores header."""
    out = {}
    for part in response.getheader(SCORES).split(", "):
        fields = part.split()
        out[fields[0]] = float(next(f for f in fields if f.startswith("p=")).split("=")[1])
    return out


def test_a_prompt_one_worker_placed_is_known_exactly_to_the_other():
    sims = [Sim(f"feed-{i}") for i in range(3)]
    envoy = None
    conns = {}
    try:
        cfg = picker_config([endpoint(s) for s in sims], scheduler={"debug_scores": True},
                            filter={"expose_served_endpoint": True})
        envoy = Envoy(cfg, concurrency=2)
        envoy.wait_routable()
        conns = connections_by_worker(envoy, 1)
        (a,), (b,) = conns.values()
        # Each worker sends once, so each has its in-flight record and sees the other as live.
        for c in (a, b):
            assert _post(c, "warm up").status == 200
        # About 25.6 KiB of text: some 100 blocks of 256 bytes, between the table's checkpoints
        # at 96 and 112 blocks.
        prompt = "Background: " + "the quick brown fox jumps over the lazy dog " * 590
        first = _post(a, prompt)
        assert first.status == 200
        placed = first.getheader(SERVED)
        again = _post(b, prompt)
        assert again.status == 200
        scores = _prefix_scores(again)
        assert scores[placed] == 1.0, scores
        assert all(v == 0 for addr, v in scores.items() if addr != placed), scores
        assert again.getheader(SERVED) == placed
    finally:
        for lst in conns.values():
            for c in lst:
                c.close()
        if envoy:
            envoy.stop()
        for s in sims:
            s.stop()
