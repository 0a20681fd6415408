"""Issue 4 end-to-end: priority, saturation, in-proxy flow control and shedding, in a real
Envoy 1.40 with 4 workers running the built .wasm.

How the pool is made to saturate, deterministically: one simulator with a batch of 2 and a fixed
50 ms per engine step, and `saturation.max_inflight_per_endpoint: 2`. Two long "blocker"
requests fill both slots; the filter's own in-flight count (shared by all workers, updated the
moment a request is sent) then says "full" at once, whatever the polled metrics lag. Every
request sent while the blockers run is held (or shed), and each release needs a slot that a
finishing request frees. Assertions are on orders that this makes structural, never on
throughput; every wait is bounded.

The blockers do not run while the test needs the pool saturated: the simulator parks them as
they arrive (`Sim.hold`), so they hold their slots for exactly as long as the test takes, however
slow the machine, and `Sim.release` lets them run. Waits are on events the test can see (the
filter's flow counters and gauges, the simulator's parked and arrived requests); no duration is
asserted. Orders are read where they happen: the simulator records the order in which requests
reached the pod (`Sim.arrivals`), which is the order the filter released them.

Trust: the tier header is marked trusted only because an Envoy Lua filter in front of the
picker (a stand-in for jwt_authn / ext_authz) always removes the client's `x-llm-tier` and sets
it from the caller's API key. See docs/priority.md, "Trusting a header".
"""
import concurrent.futures as cf
import json
import socket
import struct
import time

import pytest
import requests

from harness import LLAMA, Envoy, Sim, endpoint, picker_config, wait_until

STEP_MS = 50
# Prefill + 10 decode steps at 50 ms: about 0.55 s per request, batch or not.
SHORT_TOKENS = 10

# The auth layer in front of the picker: maps API keys to tiers. A client's own x-llm-tier is
# always removed first, so the picker may trust the header.
TIER_LUA = """
local tiers = {
  ["Bearer key-premium"] = "premium",
  ["Bearer key-free"] = "free",
  ["Bearer key-batch"] = "batch",
}
function envoy_on_request(handle)
  local headers = handle:headers()
  headers:remove("x-llm-tier")
  local tier = tiers[headers:get("authorization") or ""]
  if tier ~= nil then
    headers:add("x-llm-tier", tier)
  end
end
"""

TIER_FILTER = {
    "name": "envoy.filters.http.lua",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
        "default_source_code": {"inline_string": TIER_LUA},
    },
}

TIERS = {"premium": 10, "free": 0, "batch": -5}


KEYS = {tier: {"authorization": f"Bearer key-{tier}"} for tier in ("premium", "free", "batch")}


def slow_sim(name: str) -> Sim:
    return Sim(name, extra=["--max-batch", "2", "--delay-per-token-ms", str(STEP_MS)])


def post(envoy: Envoy, tag: str, max_tokens: int, headers: dict | None = None, timeout: float = 60):
    """One request on its own connection (so the kernel spreads them over the workers), with
    `tag` as its prompt (what `Sim.arrivals` shows); returns (tag, response, the monotonic time
    its response was read)."""
    body = {"model": LLAMA, "max_tokens": max_tokens, "messages": [{"role": "user", "content": tag}]}
    with requests.Session() as s:
        r = s.post(envoy.url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=timeout)
    return tag, r, time.monotonic()


def inflight(envoy: Envoy, sim: Sim) -> float:
    return envoy.metric("inference_picker_endpoint_inflight", endpoint=sim.address)


def start_blockers(envoy: Envoy, sim: Sim, pool: cf.ThreadPoolExecutor, max_tokens: int = SHORT_TOKENS):
    """Two requests that take both slots and stay there: the pod parks them on arrival until
    the test calls `sim.release()`. Returns their futures once both are parked and counted in
    flight."""
    sim.hold(count=2)
    futs = [pool.submit(post, envoy, f"blocker {i}", max_tokens) for i in range(2)]
    sim.wait_held(2)
    # Bounded generously: on a loaded 2-core CI machine the gauge can take a while to follow.
    wait_until(lambda: inflight(envoy, sim) == 2, 30, "both blockers in flight")
    return futs


def flow(envoy: Envoy, priority: int, outcome: str) -> float:
    return envoy.metric("inference_picker_flow_requests_total", priority=str(priority), outcome=outcome)


def waiting(envoy: Envoy, priority: int) -> float:
    return envoy.metric("inference_picker_flow_waiting", priority=str(priority))


def queue_ms(resp) -> int:
    return int(resp.headers["x-inference-picker-queue-ms"])


def after_blockers(sim: Sim) -> list:
    """The prompts that reached the pod after the two blockers, in arrival order."""
    arrived = sim.arrivals()
    assert arrived[:2] == ["blocker 0", "blocker 1"] or arrived[:2] == ["blocker 1", "blocker 0"], arrived
    return arrived[2:]


@pytest.fixture
def tiers_pool():
    sim = slow_sim("prio-sim")
    cfg = picker_config(
        [endpoint(sim)],
        priority={"tier": {"header": "x-llm-tier", "trusted": True, "values": TIERS}},
        saturation={"max_inflight_per_endpoint": 2},
        flow_control={"enabled": True, "max_wait_ms": 30000, "max_queue": 64},
        filter={"endpoint_metrics": True},  # the tests read the per-endpoint in-flight gauge
    )
    envoy = Envoy(cfg, concurrency=4, front_filters=[TIER_FILTER])
    try:
        envoy.wait_routable()
        wait_until(lambda: inflight(envoy, sim) == 0, 30, "warm-up request finished")
        yield envoy, sim
    finally:
        envoy.stop()
        sim.stop()


def test_premium_first_sheddable_shed_and_a_forged_tier_gains_nothing(tiers_pool):
    envoy, sim = tiers_pool
    sim.reset_stats()  # arrivals from here on
    with cf.ThreadPoolExecutor(20) as pool:
        blockers = start_blockers(envoy, sim, pool)
        try:
            later = [pool.submit(post, envoy, f"free {i}", SHORT_TOKENS, KEYS["free"]) for i in range(4)]
            # No key, but the client claims the premium tier itself.
            later += [pool.submit(post, envoy, f"forged {i}", SHORT_TOKENS, {"x-llm-tier": "premium"})
                      for i in range(2)]
            # Every free and forged request is held before the premium ones come, so the order
            # below is decided by priority, not by arrival races.
            wait_until(lambda: flow(envoy, 0, "held") == 6, 30, "free and forged requests held at priority 0")
            premium = [pool.submit(post, envoy, f"premium {i}", SHORT_TOKENS, KEYS["premium"]) for i in range(4)]
            wait_until(lambda: flow(envoy, 10, "held") == 4, 30, "premium requests held at priority 10")
            # Sheddable (tier batch = -5) while saturated: 429, answered while nothing can
            # change (the blockers parked, everything else held): shedding waits for nothing.
            batch = [post(envoy, f"batch {i}", SHORT_TOKENS, KEYS["batch"]) for i in range(3)]
            assert sim.held() == 2 and not any(f.done() for f in premium + later)
        finally:
            sim.release()
        premium = [f.result() for f in premium]
        later = [f.result() for f in later]
        for f in blockers:
            assert f.result()[1].status_code == 200

    for _, resp, _ in batch:
        assert resp.status_code == 429, resp.text
        assert resp.json()["error"]["code"] == "request_shed"
        assert resp.headers["retry-after"] == "1"
        assert resp.headers["x-inference-picker-queue-ms"] == "0"
    for tag, resp, _ in premium + later:
        assert resp.status_code == 200, (tag, resp.text)

    # Order: the pod received every premium request before any free or forged one, although all
    # of those were sent (and held) first; the sheddable ones never reached it.
    arrived = after_blockers(sim)
    assert sorted(arrived[:4]) == [f"premium {i}" for i in range(4)], arrived
    assert sorted(arrived[4:]) == sorted(tag for tag, _, _ in later), arrived
    # And the clients saw it so: every premium request finished before any free or forged one.
    assert max(end for *_, end in premium) < min(end for *_, end in later)
    # Queue time, as each request reports it: premium waited less than every free request
    # (which arrived earlier and went later), and every request here was held.
    assert all(queue_ms(r) > 0 for _, r, _ in premium + later)
    assert max(queue_ms(r) for _, r, _ in premium) < min(queue_ms(r) for _, r, _ in later)

    # The forged header gave nothing: exactly the 4 keyed requests were held at priority 10;
    # the forged ones were held with the free ones at 0.
    wait_until(lambda: flow(envoy, 0, "released") == 6, 30, "flow metrics flushed")
    assert flow(envoy, 10, "held") == 4
    assert flow(envoy, 10, "released") == 4
    assert flow(envoy, 0, "held") == 6
    assert flow(envoy, -5, "shed") == 3
    assert flow(envoy, -5, "held") == 0
    assert envoy.metric("inference_picker_flow_queued_ms_total", priority="10") > 0
    assert waiting(envoy, 10) == 0 and waiting(envoy, 0) == 0
    assert envoy.metric("inference_picker_rejections_total", reason="request_shed") == 3

    # The priority headers never reach the model server.
    last = sim.stats()["last_request_headers"]
    assert not {"x-llm-tier", "x-gateway-inference-objective", "x-gateway-inference-fairness-id"} & set(last)


def strict_config(sim: Sim, max_wait_ms: int) -> dict:
    """A queue of 2; the tier header is configured but NOT trusted."""
    return picker_config(
        [endpoint(sim)],
        priority={"tier": {"header": "x-llm-tier", "trusted": False, "values": TIERS}},
        saturation={"max_inflight_per_endpoint": 2},
        flow_control={"enabled": True, "max_wait_ms": max_wait_ms, "max_queue": 2, "retry_after_s": 3},
        filter={"endpoint_metrics": True},  # the tests read the per-endpoint in-flight gauge
    )


@pytest.fixture(scope="module")
def strict_pool():
    """A queue of 2 and a long max wait: nothing held times out while a test looks at it (the
    held requests go when the test releases the pod). max_wait_ms itself is tested with its own
    Envoy below."""
    sim = slow_sim("strict-sim")
    envoy = Envoy(strict_config(sim, max_wait_ms=30000), concurrency=4)
    try:
        envoy.wait_routable()
        wait_until(lambda: inflight(envoy, sim) == 0, 30, "warm-up request finished")
        yield envoy, sim
    finally:
        envoy.stop()
        sim.stop()


def test_queue_full_429(strict_pool):
    envoy, sim = strict_pool
    wait_until(lambda: inflight(envoy, sim) == 0 and waiting(envoy, 0) == 0, 30, "idle pool")
    before_sim = sim.requests_total()
    before_full = flow(envoy, 0, "queue_full")
    with cf.ThreadPoolExecutor(8) as pool:
        blockers = start_blockers(envoy, sim, pool)
        try:
            held = [pool.submit(post, envoy, f"held {i}", SHORT_TOKENS) for i in range(2)]
            wait_until(lambda: waiting(envoy, 0) == 2, 30, "two requests held")
            # The queue (2, over all workers) is full: 429, answered while both stay held and
            # the blockers parked. (This client also claims the premium tier, untrusted here;
            # the one-worker eviction test shows it gains nothing.)
            _, full, _ = post(envoy, "one too many", SHORT_TOKENS, {"x-llm-tier": "premium"})
            assert full.status_code == 429, full.text
            assert full.json()["error"]["code"] == "queue_full"
            assert full.headers["retry-after"] == "3"
            assert full.headers.get("x-inference-picker-queue-ms", "0") == "0"
            assert sim.held() == 2 and not any(f.done() for f in held)
        finally:
            sim.release()
        # The two held ones kept their places and are served once the pod runs.
        for f in held:
            _, resp, _ = f.result()
            assert resp.status_code == 200, resp.text
            assert queue_ms(resp) > 0
        for f in blockers:
            assert f.result()[1].status_code == 200
    # The refused request never reached the model server.
    assert sim.requests_total() - before_sim == 4
    assert "one too many" not in sim.arrivals()
    wait_until(lambda: flow(envoy, 0, "queue_full") == before_full + 1, 30, "queue_full counted")
    assert waiting(envoy, 0) == 0


def test_held_past_max_wait_is_503():
    """A request held for max_wait_ms (1.5 s) gets 503. The blockers stay parked at the pod
    until both held requests have been answered, so no slot can free up: only max_wait_ms can
    end their wait."""
    sim = slow_sim("wait-sim")
    envoy = Envoy(strict_config(sim, max_wait_ms=1500), concurrency=4)
    try:
        envoy.wait_routable()
        wait_until(lambda: inflight(envoy, sim) == 0, 30, "warm-up request finished")
        before_sim = sim.requests_total()
        with cf.ThreadPoolExecutor(8) as pool:
            blockers = start_blockers(envoy, sim, pool)
            try:
                held = [pool.submit(post, envoy, f"held {i}", SHORT_TOKENS) for i in range(2)]
                for f in held:
                    _, resp, _ = f.result()
                    assert resp.status_code == 503, resp.text
                    err = resp.json()["error"]
                    assert err["code"] == "queue_timeout" and "1500 ms" in err["message"]
                    assert resp.headers["retry-after"] == "3"
                    # The filter's own count of the time it held the request.
                    assert queue_ms(resp) >= 1500
                assert sim.held() == 2
            finally:
                sim.release()
            for f in blockers:
                assert f.result()[1].status_code == 200
        # Nothing but the blockers reached the model server.
        assert sim.requests_total() - before_sim == 2
        wait_until(lambda: flow(envoy, 0, "timed_out") == 2, 30, "timeout metrics flushed")
        assert waiting(envoy, 0) == 0
    finally:
        envoy.stop()
        sim.stop()


def disconnecting_request(envoy: Envoy) -> socket.socket:
    """Sends a complete request on a raw socket and returns the socket, unread."""
    body = json.dumps({"model": LLAMA, "max_tokens": SHORT_TOKENS,
                       "messages": [{"role": "user", "content": "I will leave"}]}).encode()
    s = socket.create_connection(("127.0.0.1", envoy.port), timeout=5)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


def test_a_client_that_leaves_frees_its_place(strict_pool):
    envoy, sim = strict_pool
    wait_until(lambda: inflight(envoy, sim) == 0 and waiting(envoy, 0) == 0, 30, "idle pool")
    cancelled_before = flow(envoy, 0, "cancelled")
    before_sim = sim.requests_total()
    with cf.ThreadPoolExecutor(8) as pool:
        blockers = start_blockers(envoy, sim, pool)
        try:
            leaver = disconnecting_request(envoy)
            wait_until(lambda: waiting(envoy, 0) == 1, 30, "the leaver held")
            stayer = pool.submit(post, envoy, "stayer", SHORT_TOKENS)
            wait_until(lambda: waiting(envoy, 0) == 2, 30, "queue full")
            # The leaver resets its connection: its place must be freed.
            leaver.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            leaver.close()
            wait_until(lambda: waiting(envoy, 0) == 1, 30, "the leaver's place freed")
            wait_until(lambda: flow(envoy, 0, "cancelled") == cancelled_before + 1, 30, "the leaver counted as cancelled")
            # A newcomer now fits in the queue (max 2) instead of getting 429.
            newcomer = pool.submit(post, envoy, "newcomer", SHORT_TOKENS)
            wait_until(lambda: newcomer.done() or waiting(envoy, 0) == 2, 30, "the newcomer held")
            assert not newcomer.done(), newcomer.result()[1].text
            assert sim.held() == 2 and not stayer.done()
        finally:
            sim.release()
        for f in (stayer, newcomer):
            _, resp, _ = f.result()
            assert resp.status_code == 200, resp.text
        for f in blockers:
            assert f.result()[1].status_code == 200
    # The leaver never reached the model server; the other four did.
    assert sim.requests_total() - before_sim == 4
    assert "I will leave" not in sim.arrivals()


def test_tenants_take_turns_within_a_priority():
    """Round-robin over fairness ids inside one priority level. The exact order is known only
    within one worker (across workers fairness holds up to one release, see docs/priority.md and
    test_fairness_workers.py), so this runs one worker. One blocker stays parked throughout, so
    there is one slot: each release waits for the previous request to finish, and the pod
    receives the held requests in exactly the order the filter released them."""
    sim = slow_sim("fair-sim")
    lua = TIER_LUA.replace(
        'headers:remove("x-llm-tier")',
        'headers:remove("x-llm-tier")\n  headers:remove("x-gateway-inference-fairness-id")\n'
        '  local tenant = (headers:get("authorization") or ""):match("^Bearer (tenant%-%a+)$")\n'
        '  if tenant ~= nil then headers:add("x-gateway-inference-fairness-id", tenant) end',
    )
    front = {"name": TIER_FILTER["name"], "typed_config": dict(TIER_FILTER["typed_config"],
                                                              default_source_code={"inline_string": lua})}
    cfg = picker_config(
        [endpoint(sim)],
        priority={"trust_fairness_header": True},
        saturation={"max_inflight_per_endpoint": 2},
        flow_control={"enabled": True, "max_wait_ms": 30000},
        filter={"endpoint_metrics": True},  # the tests read the per-endpoint in-flight gauge
    )
    envoy = Envoy(cfg, concurrency=1, front_filters=[front])
    try:
        envoy.wait_routable()
        wait_until(lambda: inflight(envoy, sim) == 0, 30, "warm-up request finished")
        sim.reset_stats()
        with cf.ThreadPoolExecutor(10) as pool:
            blockers = start_blockers(envoy, sim, pool)
            try:
                futs = []
                # Tenant a queues 4 requests first, then tenant b queues 2, each one held before
                # the next is sent.
                for i, tenant in enumerate(["a"] * 4 + ["b"] * 2):
                    headers = {"authorization": f"Bearer tenant-{tenant}"}
                    futs.append(pool.submit(post, envoy, f"{tenant} {i}", SHORT_TOKENS, headers))
                    wait_until(lambda: waiting(envoy, 0) == i + 1, 30, f"{tenant} {i} held")
                # One blocker runs; the other keeps its slot until all six have reached the pod.
                sim.release(n=1)
                wait_until(lambda: len(sim.arrivals()) == 8, 60, "the six held requests at the pod")
            finally:
                sim.release()
            rows = [f.result() for f in futs]
            for f in blockers:
                assert f.result()[1].status_code == 200
        for tag, resp, _ in rows:
            assert resp.status_code == 200, (tag, resp.text)
        order = after_blockers(sim)
        print("released in order", order)
        # One slot, round-robin: a 0, b 4, a 1, b 5, a 2, a 3. Without round-robin, b would
        # wait behind all of a's requests.
        assert max(order.index("b 4"), order.index("b 5")) < min(order.index("a 2"), order.index("a 3")), order
    finally:
        envoy.stop()
        sim.stop()


def test_flow_control_steps_aside_when_every_endpoint_is_stale():
    """The poller cannot read any metrics (wrong path: every scrape fails), so every endpoint
    is stale. Flow control must not hold requests for a saturation it cannot see;
    `filter.failure_mode: FailOpen` then routes by in-flight count."""
    sim = slow_sim("stale-sim")
    cfg = picker_config(
        [endpoint(sim)],
        saturation={"max_inflight_per_endpoint": 2},
        flow_control={"enabled": True, "max_wait_ms": 30000},
        filter={"failure_mode": "FailOpen", "endpoint_metrics": True},
    )
    cfg["poller"]["metrics_path"] = "/no-metrics-here"
    envoy = Envoy(cfg, concurrency=4)
    try:
        envoy.wait_routable(ready=0)
        wait_until(lambda: inflight(envoy, sim) == 0, 30, "warm-up request finished")
        with cf.ThreadPoolExecutor(4) as pool:
            blockers = start_blockers(envoy, sim, pool)
            try:
                # Two in flight = "full" by the in-flight limit, and it stays so (the blockers
                # are parked), but stale is unjudgeable: not held.
                _, resp, _ = post(envoy, "third", SHORT_TOKENS)
                assert resp.status_code == 200, resp.text
                assert queue_ms(resp) == 0
                assert sim.held() == 2
            finally:
                sim.release()
            for f in blockers:
                assert f.result()[1].status_code == 200
        wait_until(lambda: flow(envoy, 0, "fail_open") >= 3, 30, "fail-open metrics flushed")
        assert flow(envoy, 0, "held") == 0
        assert envoy.metric("inference_picker_requests_total", outcome="fail_open") >= 3
    finally:
        envoy.stop()
        sim.stop()


def test_a_higher_priority_arrival_evicts_the_newest_lower_one():
    """A full queue and a more important arrival: the newest lower-priority request held on the
    same worker is pushed out with 429 (the eviction is answered from the arrival's own
    callback, on the evicted request's context). Eviction only looks at the arrival's worker,
    so this runs one worker. max_wait_ms is long: nothing held times out while the test looks,
    and the two requests left are served once the pod runs, the more important one first."""
    sim = slow_sim("evict-sim")
    cfg = picker_config(
        [endpoint(sim)],
        priority={"objectives": [{"name": "urgent", "priority": 10}], "trust_objective_header": True,
                  # Configured, but not trusted: no filter in front sets it.
                  "tier": {"header": "x-llm-tier", "trusted": False, "values": TIERS}},
        saturation={"max_inflight_per_endpoint": 2},
        flow_control={"enabled": True, "max_wait_ms": 30000, "max_queue": 2},
        filter={"endpoint_metrics": True},  # the tests read the per-endpoint in-flight gauge
    )
    envoy = Envoy(cfg, concurrency=1)
    try:
        envoy.wait_routable()
        wait_until(lambda: inflight(envoy, sim) == 0, 30, "warm-up request finished")
        sim.reset_stats()
        with cf.ThreadPoolExecutor(8) as pool:
            blockers = start_blockers(envoy, sim, pool)
            try:
                first = pool.submit(post, envoy, "first", SHORT_TOKENS)
                wait_until(lambda: waiting(envoy, 0) == 1, 30, "first held")
                newest = pool.submit(post, envoy, "newest", SHORT_TOKENS)
                wait_until(lambda: waiting(envoy, 0) == 2, 30, "queue full")
                # A client claiming the premium tier itself: untrusted, so priority 0 like the
                # held ones. It may not push them out: 429 for itself.
                _, forged, _ = post(envoy, "forged", SHORT_TOKENS, {"x-llm-tier": "premium"})
                assert forged.status_code == 429 and forged.json()["error"]["code"] == "queue_full"
                assert waiting(envoy, 0) == 2 and not first.done() and not newest.done()
                urgent = pool.submit(post, envoy, "urgent", SHORT_TOKENS,
                                     {"x-gateway-inference-objective": "urgent"})
                _, pushed, _ = newest.result()
                assert pushed.status_code == 429, pushed.text
                assert pushed.json()["error"]["code"] == "queue_full"
                # Answered when the urgent request arrived: nothing else could have ended its
                # wait (the blockers are parked, max_wait_ms is far), and the other two stay held.
                wait_until(lambda: waiting(envoy, 10) == 1, 30, "urgent held")
                assert waiting(envoy, 0) == 1 and not first.done() and not urgent.done()
                assert sim.held() == 2
                # One blocker runs; the other keeps its slot, so the two held requests go one
                # at a time, in the order the filter picks.
                sim.release(n=1)
                wait_until(lambda: len(sim.arrivals()) == 4, 60, "both held requests at the pod")
            finally:
                sim.release()
            for f in (first, urgent):
                assert f.result()[1].status_code == 200, f.result()[1].text
            for f in blockers:
                assert f.result()[1].status_code == 200
        assert after_blockers(sim) == ["urgent", "first"]
        wait_until(lambda: flow(envoy, 10, "released") == 1, 30, "metrics flushed")
        assert flow(envoy, 0, "queue_full") == 2  # the forged one refused, the newest evicted
        assert flow(envoy, 10, "held") == 1
        assert flow(envoy, 0, "released") == 1
        assert waiting(envoy, 0) == 0 and waiting(envoy, 10) == 0
    finally:
        envoy.stop()
        sim.stop()
