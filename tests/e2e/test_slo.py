"""Latency targets (SLOs) in a real Envoy 1.40 running the built .wasm: routing to meet a
request's TTFT target, shedding a sheddable request that no pod can serve in time, deadline
order among held requests, and the untrusted target header ignored.

The client stands in for the trusted layer in front of the picker (an auth filter that sets or
removes `x-slo-ttft-ms`): the configurations that read the header say `trust_headers: true`, and
the last test checks that without it the header is never read and never reaches a pod.

Predictions are read where the filter makes them (the opt-in debug scores header), so each
target is chosen from the state of the pool at that moment, not from a guess at how fast this
machine is. One Envoy worker, so that the rates and the held queue a test reads are the ones
that decide (deadline order is kept within a worker; docs/slo.md). Every wait is bounded and
waits on something the test can observe.
"""
import concurrent.futures as cf
import math

import requests

from harness import LLAMA, Envoy, Sim, endpoint, picker_config, wait_until

SELECT = "test-epp-endpoint-selection"
STEP_MS = 50


def scores(r, field="ttft"):
    """{address: value} from the debug scores header (`ttft` ms, `rate` ms per token)."""
    out = {}
    for entry in r.headers.get("x-inference-picker-scores", "").split(", "):
        parts = entry.split()
        for part in parts[1:]:
            if part.startswith(field + "="):
                out[parts[0]] = float(part.split("=", 1)[1].removesuffix("ms"))
    return out


def chat(envoy, content, headers=None, stream=False, max_tokens=2):
    body = {"model": LLAMA, "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": content}]}
    r = requests.post(envoy.url + "/v1/chat/completions", json=body, headers=headers or {},
                      timeout=60, stream=stream)
    if stream:
        for _ in r.iter_content(chunk_size=None):
            pass
    return r


def learn_rates(envoy, sims):
    """Streamed requests to each pod in turn (conformance mode's selection header), so that the
    filter learns every pod's rate from its first bytes; then waits until a pick predicts with
    the learnt rates (each worker re-reads them at most every 250 ms)."""
    for i in range(8):
        for s in sims:
            r = chat(envoy, f"warm-up {i} {s.name} " + "x " * 400, {SELECT: s.address}, stream=True)
            assert r.status_code == 200, r.text
    prior = 0.03

    def learnt():
        rates = scores(chat(envoy, "rate probe " + "y " * 50), "rate")
        return len(rates) == len(sims) and all(abs(v - prior) > 1e-4 for v in rates.values())

    wait_until(learnt, 30, "every pod's rate learnt")


def served(sims, before):
    """The one pod whose request count grew since `before`."""
    grown = [s for s in sims if s.requests_total() > before[s.name]]
    assert len(grown) == 1, [s.name for s in grown]
    return grown[0]


def counts(sims):
    return {s.name: s.requests_total() for s in sims}


def two_pods(**sections):
    a, b = Sim("slo-a"), Sim("slo-b")
    cfg = picker_config([endpoint(a), endpoint(b)], scheduler={"debug_scores": True}, **sections)
    cfg["filter"] = {"conformance_mode": True}
    envoy = Envoy(cfg, concurrency=1)
    return envoy, a, b


def test_a_tight_target_avoids_the_pod_predicted_to_miss_it_where_the_cache_would_have_sent_it():
    envoy, a, b = two_pods(priority={"slo": {"trust_headers": True}})
    try:
        envoy.wait_routable()
        learn_rates(envoy, [a, b])
        # A long conversation whose first turn went to a: a holds its prefix. Raise a's queue
        # until the ranking still prefers a (the cached pod) while its predicted TTFT is above
        # b's: the window in which a target between the two decides. The window's width is the
        # miss penalty, which grows with the prompt; the queue moves in whole requests, so on a
        # busy machine (learnt rates differ run to run) one prompt length may step over it: then
        # a longer conversation is tried.
        found, seen = None, []
        for n, repeat in enumerate((500, 1000, 2000)):
            a.fake_load(queue=0)
            turn1 = f"conversation {n} about caches " + "the quick brown fox jumps over the lazy dog " * repeat
            assert chat(envoy, turn1, {SELECT: a.address}).status_code == 200
            # Each queued request adds about the same to a's prediction: after two probes, jump
            # to the queue that should put a 20 % above b, then step one at a time.
            q, tries = 1, 0
            while q <= 200 and tries < 12:
                tries += 1
                a.fake_load(queue=q)
                before = counts([a, b])
                probe = chat(envoy, turn1 + f" question {q}?")
                assert probe.status_code == 200, probe.text
                t, on = scores(probe), served([a, b], before)
                seen.append((repeat, q, t, on.name))
                if on is b:
                    break  # past the window: the ranking itself moved it
                if t[a.address] > 1.1 * t[b.address]:
                    found = (q, t)
                    break
                if len(seen) >= 2 and seen[-2][0] == repeat and q == seen[-2][1] + 1:
                    slope = t[a.address] - seen[-2][2][a.address]
                    if slope > 0:
                        q += max(1, math.ceil((1.2 * t[b.address] - t[a.address]) / slope))
                        continue
                q += 1
            if found:
                break
        assert found, f"no queue on a where the cache keeps the request there but b is predicted faster: {seen}"
        q, t = found
        # A target between the two predictions, through the margin (0.2): only b meets it.
        target = (t[a.address] + t[b.address]) / 2 / 0.8
        before = counts([a, b])
        control = chat(envoy, turn1 + " and the control question?")
        assert control.status_code == 200
        assert served([a, b], before) is a, "without a target the cached pod serves it"
        # With a target both meet, it stays on the cached pod: not the fastest.
        before = counts([a, b])
        loose = chat(envoy, turn1 + " and the loose question?", {"x-slo-ttft-ms": "600000"})
        assert loose.status_code == 200
        assert served([a, b], before) is a
        # (Last: once b has served it, b holds the prompt too.)
        before = counts([a, b])
        r = chat(envoy, turn1 + " and the premium question?", {"x-slo-ttft-ms": f"{target:.0f}"})
        assert r.status_code == 200, r.text
        assert served([a, b], before) is b, (t, target)
        # The target never reaches the pod.
        assert "x-slo-ttft-ms" not in b.stats()["last_request_headers"]
    finally:
        envoy.stop()
        a.stop()
        b.stop()


def test_a_sheddable_request_no_pod_can_serve_in_time_is_shed_with_429_and_the_rest_counted():
    objectives = [{"name": "batch", "priority": -1}, {"name": "chat", "priority": 0}]
    envoy, a, b = two_pods(priority={"slo": {"trust_headers": True}, "objectives": objectives,
                                     "trust_objective_header": True})
    try:
        envoy.wait_routable()
        # Before any rate is learnt the prediction cannot tell: nothing is shed.
        cold = chat(envoy, "cold pool", {"x-gateway-inference-objective": "batch", "x-slo-ttft-ms": "1"})
        assert cold.status_code == 200, cold.text
        learn_rates(envoy, [a, b])
        before = counts([a, b])
        r = chat(envoy, "too tight", {"x-gateway-inference-objective": "batch", "x-slo-ttft-ms": "1"})
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert (err["code"], err["type"]) == ("slo_unattainable", "rate_limit_error")
        assert r.headers["retry-after"] == "1"
        assert counts([a, b]) == before, "nothing reached a pod"
        # Not sheddable: served by the best predicted pod instead.
        r = chat(envoy, "too tight but not sheddable", {"x-gateway-inference-objective": "chat", "x-slo-ttft-ms": "1"})
        assert r.status_code == 200, r.text
        # A trusted target that is not a number of milliseconds: 400 before the body is read.
        r = chat(envoy, "bad", {"x-slo-ttft-ms": "soon"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_slo_header", r.text
        # A streamed request with a target it meets: counted as met in its class, and the
        # prediction error recorded.
        r = chat(envoy, "meets it", {"x-gateway-inference-objective": "chat", "x-slo-ttft-ms": "60000"}, stream=True)
        assert r.status_code == 200
        wait_until(lambda: envoy.metric("inference_picker_slo_requests_total", **{"class": "chat", "outcome": "met"}) == 1,
                   10, "the met request counted")
        assert envoy.metric("inference_picker_slo_requests_total", **{"class": "batch", "outcome": "shed"}) == 1
        # The non-streamed "not sheddable" one is not measured (its first byte is the whole answer).
        assert envoy.metric("inference_picker_slo_requests_total", **{"class": "chat", "outcome": "unmeasured"}) == 1
        text = envoy.stats_prometheus()
        assert "inference_picker_ttft_prediction_ratio_pct_bucket" in text
        # The shipped buckets, fine around 100 %.
        assert f'inference_picker_ttft_prediction_ratio_pct_bucket{{model="{LLAMA}",le="105"}}' in text
    finally:
        envoy.stop()
        a.stop()
        b.stop()


def test_held_requests_of_one_priority_go_earliest_deadline_first():
    # One pod with one slot, taken by a parked blocker: everything after it is held, and each
    # release needs the slot the one before frees, so the pod sees the release order exactly.
    sim = Sim("slo-edf", extra=["--max-batch", "1", "--delay-per-token-ms", str(STEP_MS)])
    cfg = picker_config(
        [endpoint(sim)],
        priority={"slo": {"trust_headers": True}},
        saturation={"max_inflight_per_endpoint": 1},
        flow_control={"enabled": True, "max_wait_ms": 60000, "max_queue": 64},
        filter={"endpoint_metrics": True},
    )
    envoy = Envoy(cfg, concurrency=1)
    try:
        envoy.wait_routable()
        inflight = lambda: envoy.metric("inference_picker_endpoint_inflight", endpoint=sim.address)
        wait_until(lambda: inflight() == 0, 30, "warm-up request finished")
        held = lambda: envoy.metric("inference_picker_flow_requests_total", priority="0", outcome="held")
        with cf.ThreadPoolExecutor(12) as pool:
            sim.reset_stats()
            sim.hold(count=1)
            blocker = pool.submit(chat, envoy, "blocker", None, False, 4)
            sim.wait_held(1)
            wait_until(lambda: inflight() == 1, 30, "the blocker in flight")
            # Arrival order: no target, then loose, then tight targets; all held at priority 0.
            sent = [("none 0", None), ("loose 50000", 50000), ("tight 20000", 20000),
                    ("none 1", None), ("tight 10000", 10000), ("loose 40000", 40000)]
            futs = []
            for n, (tag, ms) in enumerate(sent, start=1):
                h = {} if ms is None else {"x-slo-ttft-ms": str(ms)}
                futs.append(pool.submit(chat, envoy, tag, h, False, 2))
                wait_until(lambda: held() == n, 30, f"{tag} held")
            sim.release()
            for f in [blocker] + futs:
                assert f.result().status_code == 200
        arrived = sim.arrivals()[1:]
        # Earliest deadline (arrival + target) first; those without a target last, in arrival order.
        assert arrived == ["tight 10000", "tight 20000", "loose 40000", "loose 50000", "none 0", "none 1"], arrived
    finally:
        envoy.stop()
        sim.stop()


def test_a_held_sheddable_request_is_shed_when_its_deadline_passes():
    # The one slot is taken by a parked blocker, so everything after it is held. A sheddable
    # request with a target is held too (without a target it would get 429 request_shed at once),
    # and answered 429 slo_unattainable once its deadline passes while it waits; a request of
    # priority 0 held beside it is served when the slot frees.
    sim = Sim("slo-deadline", extra=["--max-batch", "1", "--delay-per-token-ms", str(STEP_MS)])
    objectives = [{"name": "batch", "priority": -1}]
    cfg = picker_config(
        [endpoint(sim)],
        priority={"slo": {"trust_headers": True}, "objectives": objectives, "trust_objective_header": True},
        saturation={"max_inflight_per_endpoint": 1},
        flow_control={"enabled": True, "max_wait_ms": 60000, "max_queue": 64},
        filter={"endpoint_metrics": True},
    )
    envoy = Envoy(cfg, concurrency=1)
    try:
        envoy.wait_routable()
        inflight = lambda: envoy.metric("inference_picker_endpoint_inflight", endpoint=sim.address)
        wait_until(lambda: inflight() == 0, 30, "warm-up request finished")
        with cf.ThreadPoolExecutor(4) as pool:
            sim.reset_stats()
            sim.hold(count=1)
            blocker = pool.submit(chat, envoy, "blocker", None, False, 4)
            sim.wait_held(1)
            wait_until(lambda: inflight() == 1, 30, "the blocker in flight")
            # Without a target: shed at once, as before.
            r = chat(envoy, "sheddable, no target", {"x-gateway-inference-objective": "batch"})
            assert r.status_code == 429 and r.json()["error"]["code"] == "request_shed", r.text
            # With a 300 ms target: held, then shed when the deadline passes (the blocker stays
            # parked until the answer is in, so the deadline, not a release, decides).
            late = pool.submit(chat, envoy, "sheddable, 300 ms",
                               {"x-gateway-inference-objective": "batch", "x-slo-ttft-ms": "300"})
            r = late.result(timeout=60)
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == "slo_unattainable"
            assert r.headers["retry-after"] == "1"
            assert int(r.headers["x-inference-picker-queue-ms"]) >= 300
            wait_until(lambda: envoy.metric("inference_picker_flow_requests_total", priority="-1",
                                            outcome="held") == 1, 10, "the sheddable request counted as held")
            sim.release()
            assert blocker.result().status_code == 200
        assert sim.arrivals() == ["blocker"], sim.arrivals()
        wait_until(lambda: envoy.metric("inference_picker_slo_requests_total",
                                        **{"class": "batch", "outcome": "shed"}) == 1, 10, "the shed counted")
    finally:
        envoy.stop()
        sim.stop()


def test_an_untrusted_target_header_is_ignored_and_never_reaches_the_pod():
    objectives = [{"name": "batch", "priority": -1}]
    envoy, a, b = two_pods(priority={"objectives": objectives, "trust_objective_header": True})
    try:
        envoy.wait_routable()
        learn_rates(envoy, [a, b])
        for value in ("1", "soon"):
            r = chat(envoy, f"untrusted {value}", {"x-gateway-inference-objective": "batch", "x-slo-ttft-ms": value,
                                                   "x-slo-tpot-ms": value})
            # Not read: no target, so neither shed nor refused as invalid.
            assert r.status_code == 200, r.text
            for s in (a, b):
                last = s.stats().get("last_request_headers") or {}
                assert not {"x-slo-ttft-ms", "x-slo-tpot-ms"} & set(last), last
        assert envoy.metric("inference_picker_slo_requests_total", **{"class": "batch", "outcome": "shed"}) == 0
    finally:
        envoy.stop()
        a.stop()
        b.stop()
