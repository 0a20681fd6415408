"""Token usage counted at the proxy (`filter.token_usage`), in a real Envoy 1.40 with two worker
VMs: the module's token counters, scraped from Envoy's `/stats/prometheus`, equal the usage the
simulator reported to the client, for non-streamed and streamed responses of the OpenAI and
Anthropic APIs; the tokens are in the stream's filter state, where an access log reads them."""
import json
import shutil
import tempfile
from pathlib import Path

import requests

from harness import LLAMA, Envoy, Sim, endpoint, first_hcm, picker_config, wait_until_shown

PROMPT = "inference_picker_prompt_tokens_total"
COMPLETION = "inference_picker_completion_tokens_total"
OUTCOMES = "inference_picker_usage_responses_total"
LOG_FORMAT = ("%REQ(X-TEST-ID)% %FILTER_STATE(wasm.inference_picker_prompt_tokens:PLAIN)% "
              "%FILTER_STATE(wasm.inference_picker_completion_tokens:PLAIN)%\n")


def with_access_log(path: Path):
    def mutate(doc):
        first_hcm(doc)["access_log"] = [{
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                "path": str(path),
                "log_format": {"text_format_source": {"inline_string": LOG_FORMAT}},
            },
        }]
    return mutate


def sse_events(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("data:"):
            data = line[5:].strip()
            if data and data != "[DONE]":
                out.append(json.loads(data))
    return out


def openai(envoy, test_id, stream, headers=None, **extra):
    body = {"model": LLAMA, "max_tokens": 7, "stream": stream,
            "messages": [{"role": "user", "content": f"count my tokens, request {test_id}"}], **extra}
    r = requests.post(envoy.url + "/v1/chat/completions", json=body, timeout=30,
                      headers={"x-test-id": test_id, **(headers or {})})
    assert r.status_code == 200, r.text
    if not stream:
        u = r.json()["usage"]
        return u["prompt_tokens"], u["completion_tokens"]
    usages = [e["usage"] for e in sse_events(r.text) if e.get("usage")]
    if not usages:
        return None
    return usages[-1]["prompt_tokens"], usages[-1]["completion_tokens"]


def anthropic(envoy, test_id, stream):
    body = {"model": LLAMA, "max_tokens": 5, "stream": stream,
            "messages": [{"role": "user", "content": f"and mine, request {test_id}"}]}
    r = requests.post(envoy.url + "/v1/messages", json=body, timeout=30, headers={"x-test-id": test_id})
    assert r.status_code == 200, r.text
    if stream:
        events = sse_events(r.text)
        start = next(e for e in events if e["type"] == "message_start")["message"]["usage"]
        u = {**start, **next(e for e in events if e["type"] == "message_delta")["usage"]}
    else:
        u = r.json()["usage"]
    prompt = u["input_tokens"] + u.get("cache_read_input_tokens", 0) + u.get("cache_creation_input_tokens", 0)
    return prompt, u["output_tokens"]


def test_token_counters_match_the_reported_usage_streamed_and_not():
    sims = [Sim(f"usage-{i}") for i in range(2)]
    log = Path(tempfile.mkdtemp(prefix="picker-usage-")) / "access.log"
    cfg = picker_config([endpoint(s) for s in sims], priority={"trust_fairness_header": True})
    envoy = Envoy(cfg, concurrency=2, mutate=with_access_log(log))
    try:
        envoy.wait_routable()
        # wait_routable's own requests were counted too: count from here.
        base = (envoy.metric(PROMPT, model=LLAMA, tenant="default-flow"),
                envoy.metric(COMPLETION, model=LLAMA, tenant="default-flow"))
        counted0 = envoy.metric(OUTCOMES, outcome="counted")
        missing0 = envoy.metric(OUTCOMES, outcome="missing")
        reported = {
            "plain": openai(envoy, "plain", stream=False),
            "streamed": openai(envoy, "streamed", stream=True, stream_options={"include_usage": True}),
            "messages": anthropic(envoy, "messages", stream=False),
            "messages-streamed": anthropic(envoy, "messages-streamed", stream=True),
        }
        # Without include_usage the stream reports nothing: counted as missing, no tokens.
        assert openai(envoy, "no-usage", stream=True) is None
        want_prompt = sum(p for p, _ in reported.values())
        want_completion = sum(c for _, c in reported.values())
        assert want_prompt > 0 and want_completion > 0, reported

        def got():
            return (envoy.metric(PROMPT, model=LLAMA, tenant="default-flow") - base[0],
                    envoy.metric(COMPLETION, model=LLAMA, tenant="default-flow") - base[1])
        wait_until_shown(lambda: got() == (want_prompt, want_completion), 10,
                         "the token counters equal the reported usage", got)
        assert envoy.metric(OUTCOMES, outcome="counted") - counted0 == 4
        assert envoy.metric(OUTCOMES, outcome="missing") - missing0 == 1

        # A trusted tenant gets its own label.
        tenant = openai(envoy, "tenant", stream=False, headers={"x-gateway-inference-fairness-id": "team-a"})
        wait_until_shown(lambda: envoy.metric(PROMPT, model=LLAMA, tenant="team-a") == tenant[0], 10,
                         "the tenant's prompt tokens", lambda: envoy.stats_prometheus().count("team-a"))
        assert envoy.metric(COMPLETION, model=LLAMA, tenant="team-a") == tenant[1]

        # The access log reads each request's tokens from the filter state.
        def lines():
            try:
                return dict(l.split(" ", 1) for l in log.read_text().splitlines() if l)
            except OSError:
                return {}
        expected = {**reported, "tenant": tenant}
        wait_until_shown(lambda: set(expected) | {"no-usage"} <= set(lines()), 10,
                         "an access log line per request", lines)
        logged = lines()
        for test_id, (p, c) in expected.items():
            assert logged[test_id] == f"{p} {c}", (test_id, logged)
        assert logged["no-usage"] == "- -", logged
    finally:
        envoy.stop()
        for s in sims:
            s.stop()
        shutil.rmtree(log.parent, ignore_errors=True)
