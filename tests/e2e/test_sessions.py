"""Sessions named by coding agents' own headers (`filter.session_headers`), in a real Envoy 1.40
with four worker VMs: a conversation that only sends `x-claude-code-session-id` stays on one pod
over all its turns, whichever worker takes each turn, while different sessions spread over the
pool. The pod is read from `x-gateway-destination-endpoint-served`."""
import requests

from harness import LLAMA, Envoy, Sim, endpoint, picker_config

SERVED = "x-gateway-destination-endpoint-served"


def turn(envoy, messages, headers):
    # A new connection per turn: the kernel spreads connections over Envoy's workers.
    with requests.Session() as s:
        r = s.post(envoy.url + "/v1/chat/completions", timeout=60, headers=headers,
                   json={"model": LLAMA, "max_tokens": 2, "messages": messages})
    assert r.status_code == 200, r.text
    return r


def conversation(envoy, headers, turns, topic):
    """Sends `turns` turns of one growing conversation; returns the pod of each."""
    messages, pods = [], []
    for i in range(turns):
        messages.append({"role": "user", "content": f"{topic}: question {i}"})
        r = turn(envoy, messages, headers)
        pods.append(r.headers[SERVED])
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    return pods


def test_agent_session_header_keeps_a_conversation_on_one_pod_and_sessions_spread():
    sims = [Sim(f"agent-{i}") for i in range(3)]
    by_address = {s.address: s for s in sims}
    envoy = Envoy(picker_config([endpoint(s) for s in sims], filter={"expose_served_endpoint": True}),
                  concurrency=4)
    try:
        envoy.wait_routable()
        # One Claude Code conversation, eight turns, only its own session header.
        claude = {"x-claude-code-session-id": "5b0e2c4a-93d1-4f7e-8a26-1c9f0d3b7e58"}
        pods = conversation(envoy, claude, 8, "refactor the parser")
        assert len(set(pods)) == 1, pods
        home = pods[0]
        assert home in by_address
        # Different sessions (each two turns) stay put and spread over more than one pod.
        homes = set()
        for n in range(12):
            hdr = {"x-claude-code-session-id": f"claude-session-{n:02d}"}
            p = conversation(envoy, hdr, 2, f"task {n}")
            assert len(set(p)) == 1, (n, p)
            homes.add(p[0])
        assert len(homes) >= 2, homes
        # Codex's header names a session the same way.
        codex = conversation(envoy, {"session-id": "codex-thread-1"}, 4, "write the tests")
        assert len(set(codex)) == 1, codex
        # The first header present wins: with `x-session-id` beside it, the agent header is not
        # the key (the pod is the one `x-session-id` alone picks).
        alone = conversation(envoy, {"x-session-id": "user-session-9"}, 3, "explain")
        both = conversation(envoy, {"x-session-id": "user-session-9", **claude}, 3, "explain")
        assert set(alone) == set(both) and len(set(both)) == 1, (alone, both)
        # Every request was routed by the picker: no pod got an unlisted request.
        assert sum(s.requests_total() for s in sims) > 0
    finally:
        envoy.stop()
        for s in sims:
            s.stop()

