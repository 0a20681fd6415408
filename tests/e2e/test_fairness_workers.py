"""Issue 15, fairness across workers: tenant round-robin holds over Envoy's workers, in a real
Envoy 1.40 with 2 workers (`--concurrency 2`) running the built .wasm.

A heavy tenant's requests are all held on one worker, a light tenant's on the other. Every
request that finishes is seen (`on_log`) by the worker that sent it, which credits the freed room
to the held requests and runs its own release check at once (`flow::credit_finish`). Before the
shared per-tenant counts (`src/fairshare.rs`), that worker spent every token it credited: the
heavy tenant's finishes fed the heavy tenant's releases, and the light tenant waited on the other
worker until the heavy one had drained (finishing ahead of at most the last batch). With them the
heavy worker leaves a token to the light tenant's worker once the heavy tenant is one release
ahead, so the light tenant's requests go out in turn.

Which worker serves a connection is chosen by the kernel (SO_REUSEPORT). The test opens
connections one at a time and reads which worker's listener counter
(`listener.<addr>.worker_N.downstream_cx_total`) went up, then sends each tenant's requests on
connections of its own worker (HTTP/1.1 keep-alive keeps a connection on its worker).

The order of arrival is made certain: the pods park what reaches them (`Sim.hold`, shown on
their /metrics as their engines would schedule it) until every heavy request is accounted for
(parked at a pod or held in the proxy) and the pods are full, then the light requests are sent
and held, and only then do the pods run (`Sim.release`). Every wait is bounded and on an event
(the filter's gauges and counters, the simulators' parked and arrived requests); assertions are
on orders and counts, never on durations.
"""
import concurrent.futures as cf
import http.client
import json
import re
import time

import pytest
import requests

from harness import LLAMA, Envoy, Sim, wait_until
from test_bursts import BATCH, at_pods, flow, parked_full, tiers_config, wait_idle, waiting

HEAVY, LIGHT = 24, 4


def worker_totals(envoy: Envoy) -> dict[str, int]:
    text = requests.get(envoy.admin + "/stats?filter=worker_.*downstream_cx_total", timeout=5).text
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"\.(worker_\d+)\.downstream_cx_total: (\d+)", text)}


def connections_by_worker(envoy: Envoy, want: int, attempts: int = 120) -> dict[str, list]:
    """Opens connections one at a time until both workers have `want` of them (bounded)."""
    out: dict[str, list] = {}
    spare = []
    try:
        for _ in range(attempts):
            before = worker_totals(envoy)
            conn = http.client.HTTPConnection("127.0.0.1", envoy.port, timeout=60)
            conn.connect()
            grew = wait_until(lambda: [w for w, n in worker_totals(envoy).items() if n > before.get(w, 0)],
                              30, "the new connection counted on a worker", interval=0.02)
            assert len(grew) == 1, f"cannot tell the worker of a connection: {grew}"
            lst = out.setdefault(grew[0], [])
            (lst if len(lst) < want else spare).append(conn)
            if len(out) == 2 and all(len(v) >= want for v in out.values()):
                return out
        raise AssertionError(f"connections per worker after {attempts}: { {w: len(v) for w, v in out.items()} }")
    finally:
        for c in spare:
            c.close()


def post_on(conn: http.client.HTTPConnection, tenant: str, tag: str):
    body = json.dumps({"model": LLAMA, "max_tokens": 40, "messages": [{"role": "user", "content": tag}]})
    conn.request("POST", "/v1/chat/completions", body=body, headers={
        "content-type": "application/json",
        "x-llm-tier": "standard",
        "x-gateway-inference-fairness-id": tenant,
    })
    r = conn.getresponse()
    text = r.read()
    return tenant, tag, r.status, text, time.monotonic()


@pytest.fixture
def two_worker_pool():
    """Issue 15's pods (2 requests at a time, 40 tokens ~ 1 s) behind the tier example, with the
    fairness header trusted (the test client sets it, as it sets the tier)."""
    sims = [Sim(f"fair-{i}", extra=["--max-batch", str(BATCH), "--delay-per-token-ms", "25"]) for i in range(2)]
    try:
        cfg = tiers_config(sims)
        cfg["priority"]["trust_fairness_header"] = True
        envoy = Envoy(cfg, concurrency=2)
        try:
            envoy.wait_routable()
            wait_idle(envoy, sims)
            yield envoy, sims
        finally:
            envoy.stop()
    finally:
        for s in sims:
            s.stop()


def test_a_heavy_tenant_on_one_worker_cannot_starve_a_light_one_on_the_other(two_worker_pool):
    envoy, sims = two_worker_pool
    conns = connections_by_worker(envoy, HEAVY)
    (wa, heavy_conns), (wb, light_conns) = sorted(conns.items())
    light_conns = light_conns[:LIGHT]
    for s in sims:
        s.reset_stats()
    # Whatever reaches a pod waits there until released: the heavy tenant's burst cannot drain
    # before the light tenant's requests come, however slow the machine.
    for s in sims:
        s.hold()
    try:
        with cf.ThreadPoolExecutor(HEAVY + LIGHT) as pool:
            try:
                heavy = [pool.submit(post_on, c, "heavy", f"heavy {i}") for i, c in enumerate(heavy_conns)]
                parked_full(envoy, sims, "heavy", HEAVY)
                light = [pool.submit(post_on, c, "light", f"light {i}") for i, c in enumerate(light_conns)]
                wait_until(lambda: at_pods(sims, "heavy") + at_pods(sims, "light") + waiting(envoy, 0) >= HEAVY + LIGHT,
                           30, "every light request arrived")
                # The light tenant queued behind the heavy one: none of its requests is at a pod.
                assert at_pods(sims, "light") == 0, [s.arrivals() for s in sims]
            finally:
                for s in sims:
                    s.release()
            hv = [f.result() for f in heavy]
            lt = [f.result() for f in light]
    finally:
        for c in heavy_conns + light_conns:
            c.close()

    for _, tag, status, text, _ in hv + lt:
        assert status == 200, (tag, status, text)
    heavy_ends = sorted(end for *_, end in hv)
    overtaken = sorted(sum(1 for e in heavy_ends if e > end) for *_, end in lt)
    print(f"heavy on {wa}, light on {wb}: each light request finished ahead of {overtaken} "
          f"of the {HEAVY} heavy requests sent before it")
    # The light tenant was held (it queued behind the heavy one) and still went out in turn:
    # each of its requests finished ahead of at least a quarter of the heavy tenant's. Without
    # fairness across workers they wait for the heavy tenant to drain (ahead of at most the
    # heavy requests of the last batch, 4 on these pods).
    wait_until(lambda: flow(envoy, 0, "held") >= HEAVY / 2, 30, "flow metrics flushed")
    assert min(overtaken) >= HEAVY // 4, overtaken
