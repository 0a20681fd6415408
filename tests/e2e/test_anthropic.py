"""Anthropic's Messages API (`POST /v1/messages`) through the gateway, with the official `anthropic`
client, in a real Envoy 1.40 running the built .wasm in front of simulated model servers: plain
and streamed messages, the errors the module answers in Anthropic's shape (each as the client's
own exception type), the turns of one conversation landing on the pod that holds its prefix, and
the token count (`POST /v1/messages/count_tokens`), routed to a pod but no generation."""
import json

import anthropic  # in tests/requirements.txt: a missing client is a broken venv, not a skip
import pytest
import requests

from harness import LLAMA, REPO, Envoy, Sim, endpoint, picker_config

SERVED = "x-gateway-destination-endpoint-served"
REJECT = "x-inference-picker-reject"
SCORES = "x-inference-picker-scores"
FIXTURES = REPO / "tests" / "fixtures" / "requests"


@pytest.fixture(scope="module")
def pool():
    sims = [Sim(f"anth-{i}", loras=("sql-lora",)) for i in range(3)]
    envoy = None
    try:
        envoy = Envoy(picker_config([endpoint(s) for s in sims], filter={"expose_served_endpoint": True},
                                    scheduler={"debug_scores": True}))
        envoy.wait_routable()
        yield envoy, sims
    finally:
        if envoy is not None:
            envoy.stop()
        for s in sims:
            s.stop()


def client(envoy) -> anthropic.Anthropic:
    # max_retries=0: the test must see the gateway's answer, not a retry of it. A new client is a
    # new connection: the kernel spreads them over Envoy's workers.
    return anthropic.Anthropic(base_url=envoy.url, api_key="unused", max_retries=0, timeout=30)


def by_address(sims) -> dict:
    return {s.address: s for s in sims}


def test_a_message_and_a_streamed_message_through_the_gateway(pool):
    envoy, sims = pool
    raw = client(envoy).messages.with_raw_response.create(
        model=LLAMA, max_tokens=5, system="Be brief.", messages=[{"role": "user", "content": "Say hi"}])
    msg = raw.parse()
    assert raw.headers[SERVED] in by_address(sims)
    assert (msg.type, msg.role, msg.model, msg.stop_reason) == ("message", "assistant", LLAMA, "max_tokens")
    assert msg.content[0].type == "text" and msg.content[0].text
    assert msg.usage.input_tokens > 0 and msg.usage.output_tokens == 5
    # The pod got the body as sent, on the same path.
    pod = by_address(sims)[raw.headers[SERVED]]
    assert pod.stats()["last_request_model"] == LLAMA

    # Streamed: the raw events in Anthropic's order, and the SDK's own accumulation of them.
    stream = client(envoy).messages.create(model=LLAMA, max_tokens=3, stream=True,
                                           messages=[{"role": "user", "content": [{"type": "text", "text": "Count"}]}])
    types = [e.type for e in stream]
    assert types == ["message_start", "content_block_start"] + ["content_block_delta"] * 3 + [
        "content_block_stop", "message_delta", "message_stop"], types
    with client(envoy).messages.stream(model=LLAMA, max_tokens=4,
                                       messages=[{"role": "user", "content": "Count again"}]) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert len(pieces) == 4 and "".join(pieces) == final.content[0].text
    assert final.usage.output_tokens == 4 and final.stop_reason == "max_tokens"

    # A LoRA adapter is routed as on the OpenAI paths (to a pod serving it, the name kept).
    lora = client(envoy).messages.create(model="sql-lora", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert lora.model == "sql-lora"


def reached(sims) -> list:
    """What reached each pod: its generations and its token counts."""
    return [(st["requests_total"], st["count_tokens_total"]) for st in (s.stats() for s in sims)]


def test_b_errors_are_anthropic_shaped_with_the_clients_exception_types(pool):
    envoy, sims = pool
    before = reached(sims)
    c = client(envoy)
    hi = [{"role": "user", "content": "hi"}]
    cases = [
        # (call, exception, status, Anthropic type, the module's code)
        (lambda: c.messages.create(model="no-such-model", max_tokens=5, messages=hi),
         anthropic.NotFoundError, 404, "not_found_error", "model_not_found"),
        (lambda: c.messages.create(model=anthropic.NOT_GIVEN, max_tokens=5, messages=hi),
         anthropic.BadRequestError, 400, "invalid_request_error", "missing_model"),
        (lambda: c.messages.create(model=LLAMA, max_tokens=anthropic.NOT_GIVEN, messages=hi),
         anthropic.BadRequestError, 400, "invalid_request_error", "missing_max_tokens"),
        (lambda: c.messages.create(model=LLAMA, max_tokens=5,
                                   messages=[{"role": "user", "content": "x" * (5 * 1024 * 1024)}]),
         anthropic.RequestTooLargeError, 413, "request_too_large", "request_too_large"),
        # The token count resolves its model as /v1/messages does, and checks its body alike.
        (lambda: c.messages.count_tokens(model="no-such-model", messages=hi),
         anthropic.NotFoundError, 404, "not_found_error", "model_not_found"),
        (lambda: c.messages.count_tokens(model=LLAMA, messages=anthropic.NOT_GIVEN),
         anthropic.BadRequestError, 400, "invalid_request_error", "missing_messages"),
    ]
    for call, exc, status, kind, code in cases:
        with pytest.raises(exc) as err:
            call()
        e = err.value
        assert e.status_code == status, e
        assert e.response.headers["content-type"] == "application/json"
        assert e.response.headers[REJECT] == code
        assert e.body == {"type": "error", "error": {"type": kind, "message": e.body["error"]["message"]}}, e.body
        assert e.body["error"]["message"]
    # A body that is not JSON, and a wrong method: the same shape (plain HTTP here).
    r = requests.post(envoy.url + "/v1/messages", data=b"{not json", headers={"content-type": "application/json"},
                      timeout=10)
    assert (r.status_code, r.json()["type"], r.json()["error"]["type"]) == (400, "error", "invalid_request_error")
    r = requests.get(envoy.url + "/v1/messages", timeout=10)
    assert (r.status_code, r.headers["allow"], r.json()["error"]["type"]) == (405, "POST, OPTIONS",
                                                                             "invalid_request_error")
    # The OpenAI paths keep OpenAI's shape.
    r = requests.post(envoy.url + "/v1/chat/completions", json={"model": "no-such-model", "messages": hi}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # The paths below /v1/messages that are not routed: a 404 in the shape their clients read.
    r = requests.post(envoy.url + "/v1/messages/batches", json={"requests": []}, timeout=10)
    assert (r.status_code, r.headers[REJECT], r.json()["error"]["type"]) == (404, "not_found", "not_found_error")
    # None of them reached a pod, as a generation or as a token count.
    assert reached(sims) == before


def test_c_the_turns_of_a_conversation_land_on_one_pod(pool):
    envoy, sims = pool
    doc = json.loads((FIXTURES / "chat_shared_prefix_1.request.json").read_text())
    system, document = doc["messages"][0]["content"], doc["messages"][1]["content"]
    homes = set()
    for case in range(10):
        # Each case is a new conversation: a distinct system prompt starts its prefix. The client
        # marks its newest block for Anthropic's prompt cache, as coding agents do; the marker
        # moves from turn to turn and is no part of the prefix.
        sys_blocks = [{"type": "text", "text": f"[case {case}] {system}", "cache_control": {"type": "ephemeral"}}]
        turns = [{"role": "user", "content": [{"type": "text", "text": document + "\nSummarise.",
                                                 "cache_control": {"type": "ephemeral"}}]}]
        served = []
        for turn in range(3):
            raw = client(envoy).messages.with_raw_response.create(model=LLAMA, max_tokens=2, system=sys_blocks,
                                                                  messages=turns)
            served.append(raw.headers[SERVED])
            answer = raw.parse().content[0].text
            for block in turns[-1]["content"]:
                block.pop("cache_control", None)
            turns += [{"role": "assistant", "content": answer},
                      {"role": "user", "content": [{"type": "text", "text": f"And then? ({turn})",
                                                    "cache_control": {"type": "ephemeral"}}]}]
        assert len(set(served)) == 1, f"case {case}: {served}"
        homes.add(served[0])
    # Different conversations still spread over the pool: the affinity is the prefix's, not a
    # preference for one pod.
    assert len(homes) >= 2, homes


def test_d_envoys_own_replies_on_the_messages_path_are_anthropic_shaped():
    """When every pod the module listed resets the request, Envoy itself answers (503, response
    flag UC/URX): envoy/envoy.yaml's local-reply mappers give it Anthropic's shape on
    /v1/messages, the client's OverloadedError-family exception, and OpenAI's shape elsewhere."""
    sim = Sim("anth-reset")
    envoy = None
    try:
        envoy = Envoy(picker_config([endpoint(sim)]), concurrency=1)
        envoy.wait_routable()
        sim.chaos("reset")
        with pytest.raises(anthropic.APIStatusError) as err:
            client(envoy).messages.create(model=LLAMA, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
        e = err.value
        assert e.status_code == 503, e
        assert REJECT not in e.response.headers, "Envoy answered, not the module"
        assert e.body["type"] == "error" and e.body["error"]["type"] == "overloaded_error", e.body
        assert e.body["error"]["message"], e.body
        assert sim.chaos_total() >= 1, "the pod was tried"
        r = requests.post(envoy.url + "/v1/chat/completions", timeout=30, json={
            "model": LLAMA, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable", r.text
    finally:
        if envoy is not None:
            envoy.stop()
        sim.stop()


def prefix_scores(headers) -> dict:
    """Each pod's prefix score in the debug score header (scheduler.debug_scores)."""
    out = {}
    for entry in headers.get(SCORES, "").split(", "):
        fields = entry.split()
        if fields:
            out[fields[0]] = float(next(f for f in fields if f.startswith("p=")).split("=")[1])
    return out


def test_e_a_token_count_is_routed_counts_what_the_message_uses_and_leaves_no_prefix(pool):
    """`messages.count_tokens` goes to a pod serving the model, gets that pod's count, and is no
    generation: the message that follows with the same conversation uses exactly that many input
    tokens and finds no pod holding its prompt (the count recorded no prefix), while the message
    itself is recorded, as the next one shows."""
    envoy, sims = pool
    pods = by_address(sims)
    doc = json.loads((FIXTURES / "chat_shared_prefix_1.request.json").read_text())
    system = "[count tokens] " + doc["messages"][0]["content"]
    messages = [{"role": "user", "content": [{"type": "text", "text": doc["messages"][1]["content"] + "\nHow long?"}]}]
    before = reached(sims)
    counted_before = envoy.metric("inference_picker_requests_total", model=LLAMA, outcome="count_tokens")
    raw = client(envoy).messages.with_raw_response.count_tokens(model=LLAMA, system=system, messages=messages)
    counted = raw.parse()
    assert raw.headers[SERVED] in pods
    assert counted.input_tokens > 1000, counted
    # It reached the pod that served it as a token count, and no pod as a generation.
    after = reached(sims)
    assert [(g - g0, c - c0) for (g, c), (g0, c0) in zip(after, before)] == [
        (0, 1 if s.address == raw.headers[SERVED] else 0) for s in sims], (before, after)
    assert envoy.metric("inference_picker_requests_total", model=LLAMA, outcome="count_tokens") == counted_before + 1

    first = client(envoy).messages.with_raw_response.create(model=LLAMA, max_tokens=1, system=system,
                                                            messages=messages)
    usage = first.parse().usage
    assert usage.cache_read_input_tokens == 0, usage
    assert usage.input_tokens == counted.input_tokens, (usage, counted)
    scores = prefix_scores(first.headers)
    assert sorted(scores) == sorted(pods), scores
    assert all(p == 0 for p in scores.values()), f"the token count left a prefix behind: {scores}"
    second = client(envoy).messages.with_raw_response.create(model=LLAMA, max_tokens=1, system=system,
                                                             messages=messages)
    assert prefix_scores(second.headers)[first.headers[SERVED]] > 0, prefix_scores(second.headers)
    assert second.headers[SERVED] == first.headers[SERVED]


def test_f_token_counts_spread_over_the_pods_without_max_tokens(pool):
    envoy, sims = pool
    served = set()
    for i in range(12):
        raw = client(envoy).messages.with_raw_response.count_tokens(
            model=LLAMA, messages=[{"role": "user", "content": f"count me ({i})"}])
        assert raw.parse().input_tokens > 0
        served.add(raw.headers[SERVED])
    # Idle pods have equal counts in flight: the calls spread, with no prefix to pull them.
    assert len(served) >= 2, served
    assert served <= set(by_address(sims))
