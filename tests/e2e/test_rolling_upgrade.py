"""A rolling upgrade in real Envoy: two builds of the module whose shared-data records and peer
messages differ in version (src/base/codec.rs), running side by side.

The "next release" is the test-only `codec-next` build (`make wasm-next`, cargo feature
`codec-next`): every writer emits the next version of its record, every reader takes the current
and the next. The current build skips what it cannot read.

- One Envoy, two listeners: one runs the current .wasm, the other the `codec-next` .wasm, with
  the same vm_id, so their VMs share one shared-data store (in-flight slots, health, prefix and
  rate shards, flow records); the poller is the current build's singleton. A stream of requests
  through both listeners, concurrently, while both builds rewrite the records in their own
  version: every request is answered 200 by a pod, and the current build counted records it
  skipped (`inference_picker_records_skipped_total`), so the versions were really mixed.
- Two Envoys exchanging peer messages (`peers`, prefix batches and placement batches), one of
  each build: every request succeeds, the current replica ignores the next one's messages (204,
  counted as skipped), and neither replica sees a failed send.
"""

import concurrent.futures as cf
import copy
import os
from pathlib import Path

import requests

from harness import (REPO, WASM, Envoy, Sim, endpoint, free_port, picker_config, stop_each, wait_until,
                     wait_until_shown)
from envoy_config import plugins  # noqa: E402 (tools/, on the path once harness is imported)

NEXT_WASM = Path(os.environ.get(
    "PICKER_NEXT_WASM", REPO / "target/wasm32-wasip1/codec-next/inference_picker.wasm"))
SKIPPED = "inference_picker_records_skipped_total"
TOKEN = "e2e-upgrade-token-0123456789"


def _skipped(envoy) -> float:
    return sum(v for k, v in _series(envoy, SKIPPED) if k.startswith(SKIPPED + "{"))


def _series(envoy, prefix):
    """(series, value) of every series whose name starts with `prefix`."""
    out = []
    for line in envoy.stats_prometheus().splitlines():
        if line.startswith(prefix) and " " in line:
            out.append((line.rsplit(" ", 1)[0], float(line.rsplit(" ", 1)[1])))
    return out


def _chat(url: str, content: str, timeout: float = 30) -> requests.Response:
    body = {"model": "meta-llama/Llama-3.1-8B-Instruct", "messages": [{"role": "user", "content": content}],
            "max_tokens": 4}
    return requests.post(url + "/v1/chat/completions", json=body, timeout=timeout)


def _two_listeners(doc: dict, port: int, next_port: int) -> None:
    """A second listener, a copy of the first on `next_port`, whose filter runs NEXT_WASM with
    the same vm_id (one shared-data store for both builds)."""
    listeners = doc["static_resources"]["listeners"]
    first = listeners[0]
    second = copy.deepcopy(first)
    second["name"] = "inference-next"
    second["address"]["socket_address"]["port_value"] = next_port
    for node in plugins(second):
        node["vm_config"]["code"]["local"]["filename"] = str(NEXT_WASM)
    listeners.append(second)
    # The listener of the current build keeps `port`.
    assert first["address"]["socket_address"]["port_value"] == port
    vm_ids = {n["vm_config"]["vm_id"] for n in plugins(doc)}
    assert len(vm_ids) == 1, vm_ids


def test_two_builds_on_one_gateway_share_records_and_serve_every_request():
    assert NEXT_WASM.exists(), f"{NEXT_WASM} is missing: run `make wasm-next`"
    assert NEXT_WASM.resolve() != Path(WASM).resolve()
    sims = [Sim("upgrade-a"), Sim("upgrade-b")]
    envoy = None
    try:
        port, next_port = free_port(), free_port()
        config = picker_config([endpoint(s) for s in sims])
        envoy = Envoy(config, concurrency=2, port=port,
                      mutate=lambda doc: _two_listeners(doc, port, next_port))
        next_url = f"http://127.0.0.1:{next_port}"
        envoy.wait_routable()
        wait_until(lambda: _chat(next_url, "warm up").status_code == 200, 15, "the next build's listener routes")
        before = sum(s.requests_total() for s in sims)
        urls = [envoy.url, next_url]
        n = 120
        with cf.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: _chat(urls[i % 2], f"request {i} " + "x" * (i % 7) * 300), range(n)))
        bad = [(r.status_code, r.text[:200]) for r in answers if r.status_code != 200]
        assert not bad, bad
        # Every request reached a pod (the sims count what they served).
        wait_until_shown(lambda: sum(s.requests_total() for s in sims) - before >= n, 10,
                         f"the pods to have served the {n} requests",
                         lambda: sum(s.requests_total() for s in sims) - before)
        # The versions were really mixed: the current build skipped the next one's records
        # (reported on its next tick).
        wait_until_shown(lambda: _skipped(envoy) > 0, 10, "the current build to skip records of the next",
                         lambda: _series(envoy, SKIPPED))
        # Nothing refused as corrupt, and no request was answered by the module itself.
        assert envoy.metric("inference_picker_rejections_total") == 0
    finally:
        stop_each(envoy, *sims)


def _peers_config(sims, peer_port):
    return picker_config(
        [endpoint(s) for s in sims],
        peers={"addresses": [f"127.0.0.1:{peer_port}"], "token": TOKEN, "interval_ms": 200,
               "timeout_ms": 200},
    )


def test_replicas_of_two_builds_exchange_peer_messages_without_errors():
    assert NEXT_WASM.exists(), f"{NEXT_WASM} is missing: run `make wasm-next`"
    sims = [Sim("upgrade-peer-a"), Sim("upgrade-peer-b")]
    port_a, port_b = free_port(), free_port()
    a = b = None
    try:
        a = Envoy(_peers_config(sims, port_b), port=port_a)
        b = Envoy(_peers_config(sims, port_a), port=port_b, wasm=NEXT_WASM)
        a.wait_routable()
        b.wait_routable()

        def exchanged():
            """Messages each replica took from the other so far: A skips B's, B applies A's
            (prefix batches, counted per record or batch; placement batches, per placement or
            batch)."""
            return (a.metric("inference_picker_peer_records_total", outcome="skipped")
                    + a.metric("inference_picker_peer_placements_total", outcome="skipped"),
                    b.metric("inference_picker_peer_records_total", outcome="applied")
                    + b.metric("inference_picker_peer_placements_total", outcome="applied"))

        def failures():
            return [gw.metric("inference_picker_peer_send_failures_total") for gw in (a, b)]

        # Messages go out only after picks: one request through each replica, then a message
        # each way. Sends before the other replica listened failed (as with one build); from
        # the first message each way on, none may fail.
        for gw in (a, b):
            r = gw.chat(content="warm up " + "the quick brown fox " * 80)
            assert r.status_code == 200, r.text
        wait_until_shown(lambda: all(x > 0 for x in exchanged()), 15, "a message each way",
                         lambda: (_series(a, "inference_picker_peer"), _series(b, "inference_picker_peer")))
        failed_before = failures()
        seen = exchanged()
        for i in range(40):
            gw = a if i % 2 else b
            r = gw.chat(content=f"turn {i} " + "the quick brown fox " * 80)
            assert r.status_code == 200, r.text
        # The current replica ignores the next one's prefix and placement batches (204,
        # counted), and the next one applies the current one's (it reads both versions): both
        # go on.
        wait_until_shown(
            lambda: a.metric("inference_picker_peer_records_total", outcome="skipped") > 0
            and a.metric("inference_picker_peer_placements_total", outcome="skipped") > 0
            and all(x > y for x, y in zip(exchanged(), seen)),
            15, "replica A to skip replica B's messages and B to apply A's",
            lambda: (_series(a, "inference_picker_peer"), _series(b, "inference_picker_peer")))
        wait_until(lambda: b.metric("inference_picker_peer_placements_total", outcome="applied") > 0, 15,
                   "replica B to apply replica A's placements")
        assert _skipped(a) > 0
        assert failures() == failed_before, (failed_before, _series(a, "inference_picker_peer"),
                                             _series(b, "inference_picker_peer"))
        for gw in (a, b):
            assert gw.metric("inference_picker_peer_records_total", outcome="refused") == 0
            assert gw.metric("inference_picker_peer_placements_total", outcome="refused") == 0
    finally:
        stop_each(a, b, *sims)
