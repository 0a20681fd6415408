"""Issue 3 end-to-end checks: every routing signal of the scheduler, in a real Envoy 1.40 with
`--concurrency 4` (four worker VMs that share only proxy-wasm shared data)."""
import concurrent.futures as cf
import copy
import json
from pathlib import Path

import requests

from harness import LLAMA, REPO, Envoy, Sim, endpoint, picker_config, wait_until_shown

FIXTURES = REPO / "tests" / "fixtures" / "requests"
READY = "inference_picker_ready_endpoints"
INFLIGHT = "inference_picker_endpoint_inflight"


def post(envoy, body, headers=None, path="/v1/chat/completions", timeout=60):
    # A new connection per request: the kernel spreads connections over Envoy's workers.
    with requests.Session() as s:
        return s.post(envoy.url + path, json=body, headers=headers or {}, timeout=timeout)


def served(r):
    assert r.status_code == 200, r.text
    return r.json()["served_by"]


def test_shared_long_prefix_lands_on_one_endpoint_across_workers():
    sims = [Sim(f"pfx-{i}") for i in range(3)]
    envoy = Envoy(picker_config([endpoint(s) for s in sims]), concurrency=4)
    try:
        envoy.wait_routable()
        first = json.loads((FIXTURES / "chat_shared_prefix_1.request.json").read_text())
        second = json.loads((FIXTURES / "chat_shared_prefix_2.request.json").read_text())
        first["max_tokens"] = second["max_tokens"] = 2
        used = set()
        for case in range(10):
            # Each case is a new conversation: a distinct system prompt starts the prefix.
            a, b = copy.deepcopy(first), copy.deepcopy(second)
            for body in (a, b):
                body["messages"][0]["content"] = f"[case {case}] " + body["messages"][0]["content"]
            where_a = served(post(envoy, a))
            # The two requests share ~18 KB of document and differ only in the question.
            for _ in range(3):
                assert served(post(envoy, b)) == where_a, f"case {case}"
            used.add(where_a)
        # Different conversations still spread (load scorers), so affinity is not "always sim 0".
        assert len(used) >= 2, used
    finally:
        envoy.stop()
        for s in sims:
            s.stop()


def test_session_id_sticks_then_moves_when_overloaded_or_killed():
    sims = [Sim(f"sess-{i}") for i in range(3)]
    by_name = {s.name: s for s in sims}
    envoy = Envoy(picker_config([endpoint(s) for s in sims]), concurrency=4)
    try:
        envoy.wait_routable()
        hdr = {"x-session-id": "user-42-conversation-7"}
        homes = {served(post(envoy, {"model": LLAMA, "max_tokens": 2, "messages": [{"role": "user", "content": f"turn {i}"}]}, hdr)) for i in range(12)}
        assert len(homes) == 1, homes
        home = homes.pop()
        # Overloaded: the hot-spot guard moves the session away.
        by_name[home].fake_load(queue=200, running=200, kv=0.99)
        moved = {served(post(envoy, {"model": LLAMA, "max_tokens": 2, "messages": [{"role": "user", "content": f"again {i}"}]}, hdr)) for i in range(8)}
        assert home not in moved and len(moved) == 1, moved
        # Load gone: it comes back home (rendezvous hashing is stateless).
        by_name[home].fake_load()
        back = {served(post(envoy, {"model": LLAMA, "max_tokens": 2, "messages": [{"role": "user", "content": f"back {i}"}]}, hdr)) for i in range(8)}
        assert back == {home}, back
        # Killed: it moves, and every request still succeeds.
        by_name[home].kill()
        # Until the poller has published its failed scrape (2 of 3 ready), a pick may still
        # choose it (and Envoy retry elsewhere); from then on it is no candidate.
        wait_until_shown(lambda: envoy.metric(READY) == 2, 30, "the killed pod's failed scrape published",
                         lambda: envoy.metric(READY))
        after = {served(post(envoy, {"model": LLAMA, "max_tokens": 2, "messages": [{"role": "user", "content": f"dead {i}"}]}, hdr)) for i in range(8)}
        assert home not in after and len(after) == 1, after
    finally:
        envoy.stop()
        for s in sims:
            s.stop()


def test_session_token_round_trip_and_forged_tokens():
    sims = [Sim(f"tok-{i}") for i in range(3)]
    rogue = Sim("tok-rogue")
    envoy = Envoy(picker_config([endpoint(s) for s in sims]), concurrency=4)
    try:
        envoy.wait_routable()
        r = post(envoy, {"model": LLAMA, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        first = served(r)
        token = r.headers["x-session-token"]
        assert token and sims[0].address not in token  # opaque, not an address
        for i in range(10):
            r = post(envoy, {"model": LLAMA, "max_tokens": 2, "messages": [{"role": "user", "content": f"n{i}"}]},
                     {"x-session-token": token})
            assert served(r) == first
            assert r.headers["x-session-token"] == token
        # Malformed, forged, or naming an address outside the pool: ignored, request still served.
        for bad in ("garbage", "v1.zzzzzzzzzzzzzzzz", "v1.0000000000000000", rogue.address,
                    "v1." + "f" * 16, "dGVzdA=="):
            r = post(envoy, {"model": LLAMA, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
                     {"x-session-token": bad})
            assert served(r) in {s.name for s in sims}
        assert rogue.requests_total() == 0
    finally:
        envoy.stop()
        for s in sims + [rogue]:
            s.stop()


def test_lora_request_prefers_the_endpoint_running_the_adapter():
    slow = ["--delay-per-token-ms", "20", "--max-lora", "1"]
    sims = [Sim(f"lora-{i}", loras=("sql-lora", "chat-lora"), extra=slow) for i in range(3)]
    by_name = {s.name: s for s in sims}
    cfg = picker_config([endpoint(s) for s in sims],
                        models=[{"name": LLAMA, "adapters": ["sql-lora", "chat-lora"]}],
                        filter={"endpoint_metrics": True})  # the in-flight gauge, read below
    envoy = Envoy(cfg, concurrency=4)
    background = cf.ThreadPoolExecutor(2)
    try:
        envoy.wait_routable()
        # Sent to the simulators directly (not through the gateway): sim 1 runs sql-lora, sim 0
        # runs chat-lora (its only slot is taken), sim 2 has a free slot. 100,000 tokens at 20 ms
        # (over half an hour): the jobs outlast the test, however slow the machine; the pods are
        # killed at the end.
        long = {"max_tokens": 100_000, "messages": [{"role": "user", "content": "long job"}]}
        background.submit(requests.post, sims[1].url + "/v1/chat/completions", json={**long, "model": "sql-lora"}, timeout=3600)
        background.submit(requests.post, sims[0].url + "/v1/chat/completions", json={**long, "model": "chat-lora"}, timeout=3600)
        running = lambda: (sims[1].stats()["model"]["running_lora_adapters"],  # noqa: E731
                           sims[0].stats()["model"]["running_lora_adapters"])
        wait_until_shown(lambda: "sql-lora" in running()[0] and "chat-lora" in running()[1], 30,
                         "both long jobs running", running)
        for s in sims:
            s.wait_scraped()  # the poller sees vllm:lora_requests_info
        for s in sims:
            s.reset_stats()
        # Scores: sim 1 = 1.0 (running), sim 2 = 0.8 (free slot), sim 0 = 0 (slot taken).
        # Each probe waits until the previous one is gone (its in-flight count released, and a
        # scrape after it finished published), so that only LoRA state differs.
        inflight = lambda: [envoy.metric(INFLIGHT, endpoint=s.address) for s in sims]  # noqa: E731
        got = []
        for i in range(8):
            got.append(served(post(envoy, {"model": "sql-lora", "max_tokens": 1,
                                            "messages": [{"role": "user", "content": f"q{i}"}]})))
            wait_until_shown(lambda: inflight() == [0, 0, 0], 30, f"probe {i} released", inflight)
            by_name[got[-1]].wait_scraped()
        assert got == ["lora-1"] * 8, got
    finally:
        background.shutdown(wait=False, cancel_futures=True)
        envoy.stop()
        for s in sims:
            s.crash()  # the long jobs would hold a graceful stop for its full grace period


def test_weighted_split_80_20_and_the_server_sees_the_rewritten_model():
    sims = [Sim(f"split-{i}", loras=("llama-canary",)) for i in range(2)]
    cfg = picker_config(
        [endpoint(s) for s in sims],
        models=[{"name": LLAMA, "adapters": ["llama-canary"]}],
        scheduler={"rewrites": [{
            "matches": [{"model": {"type": "Exact", "value": "chat-default"}}],
            "targets": [{"model_rewrite": LLAMA, "weight": 80}, {"model_rewrite": "llama-canary", "weight": 20}],
        }]},
    )
    envoy = Envoy(cfg, concurrency=4)
    try:
        envoy.wait_routable()
        for s in sims:
            s.reset_stats()
        n = 1000

        def one(i):
            r = requests.post(envoy.url + "/v1/completions", timeout=60,
                              json={"model": "chat-default", "prompt": f"request {i}", "max_tokens": 1})
            assert r.status_code == 200, r.text
            return r.json()["model"]

        with cf.ThreadPoolExecutor(16) as ex:
            models = list(ex.map(one, range(n)))
        canary = sum(1 for m in models if m == "llama-canary")
        assert sum(1 for m in models if m == LLAMA) + canary == n
        # Binomial(1000, 0.2): mean 200, sd 12.6; +-5 sd = [137, 263] fails with p < 1e-6.
        assert 137 <= canary <= 263, canary
        seen = {}
        for s in sims:
            for model, count in s.stats()["requests_by_model"].items():
                seen[model] = seen.get(model, 0) + count
        # The simulators saw only rewritten names, never the client's alias.
        assert "chat-default" not in seen
        assert seen.get("llama-canary") == canary and seen.get(LLAMA) == n - canary
    finally:
        envoy.stop()
        for s in sims:
            s.stop()


def test_mixed_vllm_and_sglang_pool_is_scored_on_both():
    vllm = Sim("mix-vllm", engine="vllm")
    sglang = Sim("mix-sglang", engine="sglang")
    cfg = picker_config([endpoint(vllm), endpoint(sglang)], scheduler={"debug_scores": True})
    envoy = Envoy(cfg, concurrency=4)
    try:
        envoy.wait_routable()
        # The SGLang server reports a long queue through sglang:num_queue_reqs: traffic avoids it.
        sglang.fake_load(queue=60, running=60, kv=0.9)
        got = [served(envoy.chat(content=f"a{i}")) for i in range(10)]
        assert got == ["mix-vllm"] * 10, got
        # And the other way round, through vllm:num_requests_waiting.
        sglang.fake_load()
        vllm.fake_load(queue=60, running=60, kv=0.9)
        r = envoy.chat(content="b")
        assert served(r) == "mix-sglang"
        # The opt-in debug header shows both endpoints scored from their own engine's metrics.
        scores = r.headers["x-inference-picker-scores"]
        assert vllm.address in scores and sglang.address in scores, scores
        got = [served(envoy.chat(content=f"c{i}")) for i in range(10)]
        assert got == ["mix-sglang"] * 10, got
    finally:
        envoy.stop()
        vllm.stop()
        sglang.stop()


def test_debug_scores_header_is_off_by_default():
    sims = [Sim("dbg-0"), Sim("dbg-1")]
    envoy = Envoy(picker_config([endpoint(s) for s in sims]))
    try:
        envoy.wait_routable()
        r = envoy.chat()
        assert r.status_code == 200 and "x-inference-picker-scores" not in r.headers
    finally:
        envoy.stop()
        for s in sims:
            s.stop()


def _predicted(r, field="ttft"):
    """{address: value} from the debug scores header: `ttft` (predicted TTFT, ms), `work`
    (tokens ahead) or `rate` (learnt ms per token)."""
    out = {}
    for entry in r.headers.get("x-inference-picker-scores", "").split(", "):
        for part in entry.split()[1:]:
            if part.startswith(field + "="):
                out[entry.split()[0]] = float(part.split("=", 1)[1].removesuffix("ms"))
    return out


def test_predicted_ttft_learns_each_pods_rate_from_streamed_responses():
    # One pod 10x slower than the other. Before any streamed response both are predicted at the
    # prior rate (equal, idle, same prompt); after streamed requests the workers have learnt,
    # through shared data, that one pod is slower, and predict it so. Each probe is a prompt no
    # pod has seen (its first block differs), so the work ahead is the same on both pods and the
    # prediction differs by the learnt rate alone (a repeated probe would be cached on whichever
    # pod served it, and a cached prompt on the slow pod can predict faster than an uncached one
    # on the fast pod).
    fast, slow = Sim("rate-fast"), Sim("rate-slow", extra=["--speed", "0.1"])
    cfg = picker_config([endpoint(fast), endpoint(slow)], scheduler={"debug_scores": True})
    # Conformance mode lets the test send the learning traffic to each pod in turn (its
    # `test-epp-endpoint-selection` header): a pod learns only from requests it serves, and the
    # scheduler alone would soon stop sending any to the pod it finds slow.
    cfg["filter"] = {"conformance_mode": True}
    envoy = Envoy(cfg, concurrency=2)
    try:
        envoy.wait_routable()
        probe = lambda n: envoy.chat(content=f"probe {n} " + "tell me about rates " * 200)
        r = probe("before")
        before, rates = _predicted(r), _predicted(r, "rate")
        assert set(before) == {fast.address, slow.address}, before
        assert abs(before[fast.address] - before[slow.address]) < 0.01 * before[fast.address], before
        assert rates[fast.address] == rates[slow.address], rates
        fast.reset_stats()
        slow.reset_stats()
        with requests.Session() as s:
            for i in range(40):
                pod = (fast, slow)[i % 2]
                body = {"model": LLAMA, "stream": True, "max_tokens": 2,
                        "messages": [{"role": "user", "content": f"request {i} " + "x " * 600}]}
                r = s.post(envoy.url + "/v1/chat/completions", json=body, timeout=60, stream=True,
                           headers={"test-epp-endpoint-selection": pod.address})
                assert r.status_code == 200, r.text
                for _ in r.iter_content(chunk_size=None):
                    pass
        assert (fast.requests_total(), slow.requests_total()) == (20, 20)

        def check(r):
            after, rates, work = _predicted(r), _predicted(r, "rate"), _predicted(r, "work")
            assert work[slow.address] == work[fast.address], work
            assert rates[slow.address] > 2 * rates[fast.address], (before, after, rates)
            assert after[slow.address] > 2 * after[fast.address], (before, after, rates)

        # Each worker re-reads the shared rates at a pick at most every 250 ms, so one may first
        # answer with what it read before the learning ended. Probe (each on a new connection,
        # which the kernel gives to any worker; Envoy's per-worker connection counters say which)
        # until every worker has answered with the learnt rates. No streamed request follows, so
        # the rates no longer change: from then on any worker must answer so.
        learnt = set()
        n = 0

        def every_worker_learnt():
            nonlocal n
            before_cx = worker_connections(envoy)
            r = probe(f"settle {n}")
            n += 1
            (worker,) = [w for w, c in worker_connections(envoy).items() if c > before_cx.get(w, 0)]
            try:
                check(r)
                learnt.add(worker)
            except AssertionError:
                pass
            return len(learnt) == 2  # concurrency=2

        wait_until_shown(every_worker_learnt, 60, "every worker predicting with the learnt rates",
                         lambda: f"workers {sorted(learnt)} after {n} probes")
        for n in range(4):  # whichever worker answers, it reads the same learnt rates
            check(probe(f"after {n}"))
    finally:
        envoy.stop()
        fast.stop()
        slow.stop()


def test_the_prefill_one_worker_queued_counts_on_every_worker():
    # One pod, four workers. A long streamed request is parked at the pod (hold): to the gateway
    # it is a request in prefill, no first byte yet, for as long as the test needs. Every later
    # pick, whichever worker makes it, must count that prefill in the pod's predicted work (debug
    # scores). A worker that did not send it sees it only through the prefill each worker
    # publishes with its in-flight count: with per-worker ledgers, the ~3 in 4 picks made on the
    # other workers would show a few hundred tokens of work instead of ~10,000.
    sim = Sim("prefill-0")
    envoy = Envoy(picker_config([endpoint(sim)], scheduler={"debug_scores": True}), concurrency=4)
    long_tokens = 10_000
    background = cf.ThreadPoolExecutor(1)
    try:
        envoy.wait_routable()
        sim.wait_scraped()  # the warm-up request, finished, is out of the published load
        body = {"model": LLAMA, "max_tokens": 2, "stream": True,
                "messages": [{"role": "user", "content": "long " + "lorem ipsum " * (long_tokens * 4 // 12)}]}
        sim.hold(count=1)
        # Parked, it gets no response head: the client waits in the background (until the end,
        # when Envoy stops and closes its connection).
        background.submit(requests.post, envoy.url + "/v1/chat/completions", json=body, stream=True, timeout=600)
        sim.wait_held(1)
        # Let a few scrapes show it running (a parked request shows as running while the batch
        # has room), so the live queue estimate does not count it as waiting: only the published
        # prefill can.
        sim.wait_scraped()
        text = requests.get(sim.url + "/metrics", timeout=5).text
        assert f'vllm:num_requests_waiting{{engine="0",model_name="{LLAMA}"}} 0.0' in text, text

        def short(i):
            with requests.Session() as t:
                # Streamed, so the headers (and the scores) come with the first byte.
                r = t.post(envoy.url + "/v1/chat/completions", stream=True, timeout=120,
                           json={"model": LLAMA, "max_tokens": 1, "stream": True,
                                 "messages": [{"role": "user", "content": f"short {i}"}]})
                try:
                    assert r.status_code == 200, r.text
                    scores = r.headers["x-inference-picker-scores"]
                    return int(scores.split(" work=")[1].split()[0])
                finally:
                    r.close()

        # Sent together, each on a new connection (spread over the workers), while the long
        # prompt is still parked: each pick happens as its request arrives.
        with cf.ThreadPoolExecutor(8) as ex:
            works = list(ex.map(short, range(8)))
        assert all(w >= long_tokens for w in works), works
        assert sim.held() == 1, "the long request was no longer parked"
    finally:
        background.shutdown(wait=False, cancel_futures=True)
        envoy.stop()
        sim.stop()


def worker_connections(envoy) -> dict[int, int]:
    """Downstream connections each Envoy worker has accepted on the listener (Envoy's per-worker
    listener counters), by worker id."""
    out = {}
    for line in envoy.stats_prometheus().splitlines():
        if line.startswith("envoy_listener_worker_downstream_cx_total{") and \
                f'envoy_listener_address="127.0.0.1_{envoy.port}"' in line:
            worker = int(line.split('envoy_worker_id="')[1].split('"')[0])
            out[worker] = int(float(line.rsplit(" ", 1)[1]))
    return out
