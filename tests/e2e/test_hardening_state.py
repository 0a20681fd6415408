"""Issue 9 (items 4-7) end-to-end, in a real Envoy 1.40 running the built .wasm: in-flight counts
that never outlive their VM, bounded memory with large bodies, and loud run-time
misconfiguration. Every wait is bounded; every process started is stopped."""
import concurrent.futures as cf
import re

import requests

from harness import LLAMA, Envoy, LdsEnvoy, Sim, endpoint, picker_config, rss_kib, wait_until

STEP_MS = 50
ALIAS = "big-alias"


def slow_sim(name: str, *extra: str) -> Sim:
    return Sim(name, extra=["--max-batch", "2", "--delay-per-token-ms", str(STEP_MS), *extra])


def post(url: str, model: str, content: str, max_tokens: int, timeout: float = 120):
    """One request on its own connection; returns its status code (0 if the connection failed)."""
    body = {"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}]}
    try:
        with requests.Session() as s:
            r = s.post(url + "/v1/chat/completions", json=body, timeout=timeout)
            if r.status_code != 200:
                print("non-200:", r.status_code, r.headers, r.text[:300])
            return r.status_code
    except requests.RequestException:
        return 0


def inflight(envoy: Envoy, sim: Sim) -> float:
    return envoy.metric("inference_picker_endpoint_inflight", endpoint=sim.address)


# ---- a VM that goes away mid-request ----------------------------------------------------------

def test_inflight_counts_return_to_zero_after_a_vm_reload_mid_request():
    """What it exercises: the listener (from an LDS file) is replaced while a request is in flight,
    with a different plugin `vm_config`, so Envoy starts a NEW filter VM (same vm_id, so the same
    shared data) and drains the old listener for 1 s, then closes its connections. The old VM's
    +1 was published; whether its -1 ever comes depends on Envoy tearing that VM down. The new VM
    must see the endpoint's count back at 0: with per-VM records, the old VM's record is freed by
    its root `on_done` or ignored once its heartbeat is older than the TTL (2 s).

    The count the new VM sees is read through the per-endpoint gauge, which each routed request
    sets when it finishes (to the count over all live VMs).

    Limit, measured with Envoy 1.40: Envoy still runs the old VM's `on_log` for the stream it
    closes at the end of the drain, so the old single shared count was decremented too; this
    test guards the per-VM records through a real VM replacement, but a VM that dies without
    `on_log` (a crash) is covered by the unit tests in src/inflight.rs, not here."""
    sim = slow_sim("reload-sim")
    cfg = picker_config([endpoint(sim)], filter={"endpoint_metrics": True})
    envoy = LdsEnvoy(cfg, concurrency=1, drain_s=1)
    pool = cf.ThreadPoolExecutor(max_workers=2)
    try:
        envoy.wait_routable()
        wait_until(lambda: inflight(envoy, sim) == 0, 30, "warm-up request finished")
        # A long request, parked at the pod (hold) until its connection is closed: it outlives
        # the drain whatever the machine's speed.
        sim.hold(count=1)
        long_req = pool.submit(post, envoy.url, LLAMA, "long", 200)
        sim.wait_held(1)
        wait_until(lambda: inflight(envoy, sim) == 1, 30, "the long request in flight")
        updates = envoy.lds_updates()

        def new_vm(listener):
            wasm = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"][0]
            vm = wasm["typed_config"]["config"]["vm_config"]
            # Any change of vm_config makes a new VM; vm_id stays, so shared data is the same.
            vm["environment_variables"] = {"key_values": {"PICKER_TEST_RELOAD": "1"}}
        envoy.replace_listener(new_vm)
        wait_until(lambda: envoy.lds_updates() > updates, 30, "the new listener")
        # The old listener drains (1 s) and its connection, with the long request, is closed.
        assert long_req.result(timeout=30) in (0, 503), "the long request outlived its listener"

        def count_seen_by_new_vm():
            assert post(envoy.url, LLAMA, "probe", 1) == 200
            return inflight(envoy, sim) == 0
        wait_until(count_seen_by_new_vm, 30, "the new VM to see the endpoint's count at 0", interval=0.5)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        envoy.stop()
        sim.stop()


# ---- bounded memory --------------------------------------------------------------------------

BIG = 4 * 1024 * 1024
HELD = 12


def test_rss_stays_bounded_across_rounds_of_large_held_bodies():
    """Each round holds HELD requests of 4 MiB (flow control, the pool full), whose model is
    rewritten, then lets them go. A held request may keep only what the prefix scorer hashes
    (64 KiB) and not the rewritten body, so a round costs the VM about one request's transient
    parse, and a second round reuses the first one's memory. Before the fix each held request
    kept its whole prompt and rewritten body (8 MiB), and wasm memory never shrinks."""
    sim = slow_sim("rss-sim", "--max-model-len", "4000000", "--max-batched-tokens", "4000000",
                   "--num-gpu-blocks", "1000000")
    cfg = picker_config(
        [endpoint(sim)],
        saturation={"max_inflight_per_endpoint": 2},
        flow_control={"enabled": True, "max_wait_ms": 60000, "max_queue": 64},
        filter={"max_body_bytes": BIG + 65536, "endpoint_metrics": True},
        scheduler={"rewrites": [{"matches": [{"model": {"value": ALIAS}}],
                                 "targets": [{"model_rewrite": LLAMA}]}]},
    )
    envoy = Envoy(cfg, concurrency=1)
    pool = cf.ThreadPoolExecutor(max_workers=HELD + 2)
    big = "x" * BIG

    def round_of_held_bodies() -> None:
        # The blockers are parked at the pod (hold) and fill both slots until every large request
        # has arrived and been held by flow control (uploading them takes a few seconds here).
        sim.hold(count=2)
        blockers = [pool.submit(post, envoy.url, LLAMA, f"blocker {i}", 20) for i in range(2)]
        sim.wait_held(2)
        wait_until(lambda: inflight(envoy, sim) == 2, 30, "both blockers in flight")
        held = [pool.submit(post, envoy.url, ALIAS, big, 1) for _ in range(HELD)]
        wait_until(lambda: envoy.metric("inference_picker_flow_waiting", priority="0") >= HELD, 120,
                   "every large request held")
        sim.release()
        statuses = [f.result(timeout=120) for f in blockers + held]
        assert statuses == [200] * (HELD + 2), statuses
        wait_until(lambda: inflight(envoy, sim) == 0, 30, "round finished")

    def memory_flushed() -> None:
        # The memory gauge is flushed on the root's tick, with flow control's counters: once a
        # request admitted now shows in `passed`, a flush after everything before it happened.
        passed = lambda: envoy.metric("inference_picker_flow_requests_total", priority="0",  # noqa: E731
                                      outcome="passed")
        before = passed()
        assert post(envoy.url, LLAMA, "after the round", 1) == 200
        wait_until(lambda: passed() > before, 30, "a metrics flush after the last request")

    try:
        envoy.wait_routable()
        # Warm-up: one large request alone, so the baseline includes one request's transient cost.
        assert post(envoy.url, ALIAS, big, 1) == 200
        # The module's own memory, apart from Envoy's buffers: every filter VM's linear memory
        # (a high-water mark, wasm memory never shrinks), flushed on the root's 50 ms tick.
        vm_mem = lambda: envoy.metric("inference_picker_vm_memory_bytes")  # noqa: E731
        wait_until(vm_mem, 30, "the VM memory gauge")
        memory_flushed()
        base, m0 = rss_kib(envoy.proc.pid), vm_mem()
        round_of_held_bodies()
        memory_flushed()
        r1, m1 = rss_kib(envoy.proc.pid), vm_mem()
        round_of_held_bodies()
        memory_flushed()
        r2, m2 = rss_kib(envoy.proc.pid), vm_mem()
        print(f"VM linear memory bytes: baseline {m0:.0f}, after round 1 {m1:.0f}, after round 2 {m2:.0f}")
        # The module keeps 64 KiB per held request: a round may grow the VMs by a few transient
        # parses, and a second round must reuse the first one's memory. Before the fix each held
        # request kept 8 MiB (HELD x 8 MiB = 96 MiB per round, in the VM).
        assert m1 - m0 <= 4 * BIG, (m0, m1, m2)
        assert m2 - m1 <= BIG, (m0, m1, m2)
        # Measured (KiB): this build 145308 / 163344 / 168584; before the fix (main at 9092174,
        # stale_after_ms raised so that it gets this far) 144520 / 258372 / 328520.
        print(f"VmRSS KiB: baseline {base}, after round 1 {r1}, after round 2 {r2}")
        # Envoy itself buffers each held body (HELD x 4 MiB = 48 MiB while held); the module may add
        # little beyond that. Before the fix the module added HELD x 8 MiB = 96 MiB more.
        assert r1 - base <= HELD * BIG // 1024 + 32 * 1024, (base, r1, r2)
        # Envoy's own allocator (the router buffers each body for retries) may still grow between
        # rounds (measured +14 to +41 MiB here); the module's part is the exact check above.
        assert r2 <= r1 + 64 * 1024, (base, r1, r2)
        # Default metrics carry no endpoint address (bounded names): only the opt-in gauge
        # and requests counter would, and this config opts in, so check the reason-tagged ones.
        text = envoy.stats_prometheus()
        assert not [l for l in text.splitlines()
                    if l.startswith("inference_picker_flow_") and "endpoint=" in l]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        envoy.stop()
        sim.stop()


def test_default_metric_names_carry_no_endpoint_address():
    sim = Sim("names-sim")
    envoy = Envoy(picker_config([endpoint(sim)]), concurrency=1)
    try:
        envoy.wait_routable()
        for _ in range(3):
            assert envoy.chat().status_code == 200
        lines = [l for l in envoy.stats_prometheus().splitlines() if l.startswith("inference_picker_")]
        assert any(l.startswith("inference_picker_requests_total{") for l in lines), lines
        assert not [l for l in lines if "endpoint=" in l or sim.address in l], lines
    finally:
        envoy.stop()
        sim.stop()


# ---- run-time misconfiguration ---------------------------------------------------------------

def test_an_unknown_poller_cluster_gives_an_error_log_and_a_metric():
    sim = Sim("lonely-sim")
    cfg = picker_config([endpoint(sim)])
    cfg["poller"]["cluster"] = "no_such_cluster"
    envoy = Envoy(cfg, concurrency=1)
    try:
        # Every round (200 ms) fails to dispatch; each failure is counted.
        wait_until(lambda: envoy.metric("inference_picker_scrape_failures_total", reason="dispatch") >= 5,
                   15, "scrape failures counted with reason=dispatch")
        def error_lines():
            # Envoy flushes its log file every few seconds.
            return [l for l in envoy.log_path.read_text().splitlines()
                    if "[error]" in l and "no_such_cluster" in l]
        errors = wait_until(error_lines, 20, "an error-level log line naming the cluster", interval=0.5)
        # Rate-limited: one line per cause per 10 s, not one per failed scrape.
        assert len(errors) <= 2, errors
        assert re.search(r"is the cluster defined", errors[0]), errors[0]
        # And the requests it cannot route still get the JSON 503, not silence.
        r = envoy.chat()
        assert r.status_code == 503 and "error" in r.json(), r.text
    finally:
        envoy.stop()
        sim.stop()
