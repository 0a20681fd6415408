"""Issue 14: disaggregated prefill/decode with llm-d's protocol (src/pd.rs), in real Envoy.

The pool is simulators with roles: decode pods (`--role decode`, which honour
`x-prefiller-host-port` as llm-d's routing sidecar does: a `max_tokens: 1` call to the prefill
pod, then the local decode with the prompt's KV imported) and prefill pods (`--role prefill`).
The filter is configured with `pd.pd_threshold_tokens: 256`.

- a long prompt: the destination is a decode pod, and the prefill pod named in the header is
  the one that did the prefill (the decode pod answers `x-sim-prefilled-by`, the prefill pod
  counted the call);
- a short prompt, and the same long prompt sent again (its decode pod now holds it): no header;
- a client-sent `x-prefiller-host-port` never reaches a pod;
- a dead prefill pod is never named; with none left, the decode pod prefills itself."""
import uuid

import requests

from harness import LLAMA, Envoy, Sim, picker_config, wait_until_shown

THRESHOLD = 256
PD_DECISIONS = "inference_picker_pd_decisions_total"
PREFILLER = "x-prefiller-host-port"
READY = "inference_picker_ready_endpoints"


def role_endpoint(sim: Sim, role: str) -> dict:
    return {"address": sim.address, "models": [LLAMA], "role": role}


def start(n_decode=2, n_prefill=1):
    decode = [Sim(f"decode-{i}", extra=("--role", "decode")) for i in range(n_decode)]
    prefill = [Sim(f"prefill-{i}", extra=("--role", "prefill")) for i in range(n_prefill)]
    eps = [role_endpoint(s, "decode") for s in decode] + [role_endpoint(s, "prefill") for s in prefill]
    envoy = Envoy(picker_config(eps, pd={"pd_threshold_tokens": THRESHOLD}), concurrency=2)
    envoy.wait_routable()
    return envoy, decode, prefill


def stop(envoy, sims):
    envoy.stop()
    for s in sims:
        s.stop()


def long_prompt(tag: str) -> str:
    # ~6000 bytes ≈ 1500 tokens at 4 bytes a token: far above the threshold.
    words = " ".join(f"{tag}-{i}" for i in range(800))
    return words[:6000]


def chat(envoy, content, headers=None, session=None):
    """One request; a new connection unless `session` keeps one (the same Envoy worker)."""
    body = {"model": LLAMA, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    if session is not None:
        return session.post(envoy.url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=30)
    with requests.Session() as s:
        return s.post(envoy.url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=30)


def by_name(sims):
    return {s.name: s for s in sims}


def wait_ready(envoy, n):
    """Waits (bounded) until the poller has published a snapshot in which exactly `n` endpoints
    answered their last scrape: a pod whose scrape failed is not fresh (a failure is stale at
    once), so from then on no pick names it. The workers read the snapshot at every pick."""
    wait_until_shown(lambda: envoy.metric(READY) == n, 30, f"{n} endpoints ready",
                     lambda: envoy.metric(READY))


def test_long_prompt_is_split_short_and_cached_are_not_and_forged_headers_are_stripped():
    envoy, decode, prefill = start()
    (pre,) = prefill
    decoders = by_name(decode)
    # One connection for the prompt and its repeat: the same Envoy worker, whose own prefix index
    # knows every block sent (another worker sees the cross-worker table's checkpoints only, 16
    # of these 23 blocks, and would split the repeat once more).
    conn = requests.Session()
    try:
        # Long prompt: decode destination, prefill pod named and used.
        before = pre.requests_total()
        text = long_prompt(uuid.uuid4().hex[:8])
        r = chat(envoy, text, session=conn)
        assert r.status_code == 200, r.text
        served = r.headers["x-sim-server"]
        assert served in decoders, served
        assert r.headers.get("x-sim-prefilled-by") == pre.address, dict(r.headers)
        seen = decoders[served].stats()
        assert seen["last_request_headers"].get(PREFILLER) == pre.address
        assert seen["remote_prefills_total"] >= 1
        assert pre.requests_total() == before + 1
        assert envoy.metric(PD_DECISIONS, decision="split") >= 1

        # The same prompt again: its decode pod holds it, the uncached tail is under the
        # threshold, so no prefill pod is named.
        r = chat(envoy, text, session=conn)
        assert r.status_code == 200, r.text
        assert r.headers["x-sim-server"] == served, "prefix affinity keeps the decode pod"
        assert "x-sim-prefilled-by" not in r.headers
        assert PREFILLER not in decoders[served].stats()["last_request_headers"]
        assert pre.requests_total() == before + 1
        assert envoy.metric(PD_DECISIONS, decision="below_threshold") >= 1

        # Short prompt with a forged header (and the older sidecars' URL form): stripped, and not
        # set (below the threshold).
        r = chat(envoy, "Hello there", headers={PREFILLER: "10.9.9.9:1", "x-prefiller-url": "http://10.9.9.9:1"})
        assert r.status_code == 200, r.text
        assert "x-sim-prefilled-by" not in r.headers
        got = decoders[r.headers["x-sim-server"]].stats()
        assert PREFILLER not in got["last_request_headers"], got["last_request_headers"]
        assert "x-prefiller-url" not in got["last_request_headers"], got["last_request_headers"]
        assert got["last_prefiller"] != "10.9.9.9:1"

        # Long prompt with a forged header: the real prefill pod replaces it.
        r = chat(envoy, long_prompt(uuid.uuid4().hex[:8]), headers={PREFILLER: "10.9.9.9:1"})
        assert r.status_code == 200, r.text
        assert r.headers.get("x-sim-prefilled-by") == pre.address
        got = decoders[r.headers["x-sim-server"]].stats()
        assert got["last_request_headers"].get(PREFILLER) == pre.address
        # No pod was ever asked to prefill on the forged address.
        assert all(d.stats()["remote_prefill_failures_total"] == 0 for d in decode)
        # A prefill pod is never a destination.
        assert pre.stats()["last_request_headers"].get(PREFILLER) is None
    finally:
        conn.close()
        stop(envoy, decode + prefill)


def test_a_dead_prefill_pod_is_never_named_and_with_none_left_the_decode_pod_prefills():
    envoy, decode, prefill = start(n_decode=2, n_prefill=2)
    dead, live = prefill
    decoders = by_name(decode)
    try:
        # Both prefill pods are used while both live (distinct prompts, no affinity).
        named = set()
        for i in range(40):
            r = chat(envoy, long_prompt(f"warm{i}-{uuid.uuid4().hex[:6]}"))
            assert r.status_code == 200, r.text
            named.add(r.headers.get("x-sim-prefilled-by"))
            if named == {dead.address, live.address}:
                break
        assert named == {dead.address, live.address}, named

        dead.crash()
        # The poller's next scrape of it fails: 3 of the 4 pods ready.
        wait_ready(envoy, 3)
        for i in range(12):
            r = chat(envoy, long_prompt(f"after{i}-{uuid.uuid4().hex[:6]}"))
            assert r.status_code == 200, r.text
            assert r.headers.get("x-sim-prefilled-by") == live.address, dict(r.headers)
            got = decoders[r.headers["x-sim-server"]].stats()
            assert got["last_request_headers"].get(PREFILLER) == live.address

        live.crash()
        wait_ready(envoy, 2)
        failures_before = sum(d.stats()["remote_prefill_failures_total"] for d in decode)
        for i in range(6):
            r = chat(envoy, long_prompt(f"none{i}-{uuid.uuid4().hex[:6]}"))
            assert r.status_code == 200, r.text
            assert "x-sim-prefilled-by" not in r.headers
            got = decoders[r.headers["x-sim-server"]].stats()
            assert PREFILLER not in got["last_request_headers"]
        assert sum(d.stats()["remote_prefill_failures_total"] for d in decode) == failures_before
        assert envoy.metric(PD_DECISIONS, decision="no_healthy_prefill") >= 6
    finally:
        stop(envoy, decode + prefill)
