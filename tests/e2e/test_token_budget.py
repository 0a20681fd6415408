"""A token budget per tenant with Envoy 1.40's global rate limit filter, fed by the module's token
counts (docs/token-budget.md): envoy/envoy.yaml with the four pieces of
envoy/examples/token-budget.yaml as they are, a real rate limit service (tools/ratelimit-budget)
and a simulated pod.

- Each request's prompt and completion tokens, as the simulator reported them in `usage`, reach
  the service as the `hits_addend` of the stream-done descriptors, streamed and not.
- Once the tenant's budget is spent, Envoy answers the next request 429 itself and no pod sees it;
  another tenant is still served.
- A request without counted usage (a stream without include_usage, an error, a request the module
  refused) charges nothing; nor does a descriptor on x-gateway-inference-fairness-id, which the
  module removes before the stream ends.

To tell the stream-done call of each request apart, the test adds one stream-done descriptor of its
own, the request's `x-test-id`, with `hits_addend: 0` (no budget matches it): every request the
rate limit filter saw then has exactly one stream-done call, whatever else it carries."""
import copy
import json

import pytest
import requests
import yaml

from harness import (LLAMA, POOL_CLUSTER, REPO, Envoy, RateLimitService, Sim, endpoint, first_hcm,
                     picker_config, stop_each, wait_until_shown)

EXAMPLE = REPO / "envoy" / "examples" / "token-budget.yaml"
TENANT_HEADER = "x-tenant-id"
BUDGET = 60
PROMPT_STATE = "%FILTER_STATE(wasm.inference_picker_prompt_tokens:PLAIN)%"
COMPLETION_STATE = "%FILTER_STATE(wasm.inference_picker_completion_tokens:PLAIN)%"

# Test-only stream-done descriptors, after the example's.
MARKER = {"actions": [{"request_headers": {"header_name": "x-test-id", "descriptor_key": "test_id"}}],
          "apply_on_stream_done": True, "hits_addend": {"number": 0}}
ON_FAIRNESS_HEADER = {
    "actions": [{"request_headers": {"header_name": "x-gateway-inference-fairness-id", "descriptor_key": "fairness_id"}}],
    "apply_on_stream_done": True, "hits_addend": {"format": COMPLETION_STATE}}


def with_token_budget(example: dict, rls_port: int):
    """envoy/envoy.yaml with the example's pieces where they say, the cluster pointed at the
    service, and the test-only descriptors."""
    def mutate(doc):
        hcm = first_hcm(doc)
        at = next(i for i, f in enumerate(hcm["http_filters"]) if f["name"] == "inference-picker")
        hcm["http_filters"].insert(at, copy.deepcopy(example["http_filter"]))
        routes = [r for vh in hcm["route_config"]["virtual_hosts"] for r in vh["routes"]
                  if r.get("route", {}).get("cluster") == POOL_CLUSTER]
        assert routes
        for r in routes:
            per_filter = copy.deepcopy(example["route_typed_per_filter_config"])
            per_filter["envoy.filters.http.ratelimit"]["rate_limits"] += [MARKER, ON_FAIRNESS_HEADER]
            r["typed_per_filter_config"].update(per_filter)
        hcm["local_reply_config"]["mappers"].insert(0, copy.deepcopy(example["local_reply_mapper"]))
        cluster = copy.deepcopy(example["cluster"])
        lb = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
        lb["endpoint"]["address"]["socket_address"]["port_value"] = rls_port
        doc["static_resources"]["clusters"].append(cluster)
    return mutate


@pytest.fixture(scope="module")
def gateway():
    rls = sim = envoy = None
    try:
        rls = RateLimitService(budgets=[f"tenant=team-a:{BUDGET}"])
        sim = Sim("budget-0")
        cfg = picker_config([endpoint(sim)], priority={"trust_fairness_header": True})
        envoy = Envoy(cfg, concurrency=2, mutate=with_token_budget(yaml.safe_load(EXAMPLE.read_text()), rls.port))
        envoy.wait_routable()
        yield rls, sim, envoy
    finally:
        stop_each(envoy, sim, rls)


def chat(envoy, test_id, tenant, stream, include_usage=True, model=LLAMA, extra_headers=None):
    """One chat request; (status, response, the usage the simulator reported or None)."""
    body = {"model": model, "max_tokens": 7, "stream": stream,
            "messages": [{"role": "user", "content": f"spend my tokens, request {test_id}"}]}
    if stream and include_usage:
        body["stream_options"] = {"include_usage": True}
    headers = {"x-test-id": test_id, **({TENANT_HEADER: tenant} if tenant else {}), **(extra_headers or {})}
    r = requests.post(envoy.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
    usage = None
    if r.status_code == 200 and not stream:
        usage = r.json()["usage"]
    elif r.status_code == 200:
        chunks = [json.loads(l[5:]) for l in r.text.splitlines()
                  if l.startswith("data:") and l[5:].strip() not in ("", "[DONE]")]
        usages = [c["usage"] for c in chunks if c.get("usage")]
        usage = usages[-1] if usages else None
    return r.status_code, r, usage


def stream_done_call(rls, test_id) -> dict:
    """The one stream-done call of request `test_id` (waits for it: it is sent after the
    response, fire-and-forget)."""
    def mine():
        return [c for c in rls.calls() if any(["test_id", test_id] in d["entries"] for d in c["descriptors"])]
    found = wait_until_shown(mine, 10, f"the stream-done call of {test_id}", lambda: rls.calls()[-5:])
    assert len(found) == 1, found
    return found[0]


def charges(call: dict, key: str) -> list[int]:
    """The hits_addend of each descriptor of `call` with the entry key `key`, in order."""
    return [d["hits_addend"] for d in call["descriptors"] if any(e[0] == key for e in d["entries"])]


def test_each_response_charges_its_tokens_and_a_spent_budget_is_refused(gateway):
    rls, sim, envoy = gateway
    charged = 0
    served = 0
    for i in range(12):
        test_id = f"spend-{i}"
        stream = i % 2 == 1
        before = sim.requests_total()
        status, r, usage = chat(envoy, test_id, "team-a", stream)
        call = stream_done_call(rls, test_id)
        if charged >= BUDGET:
            # Spent: Envoy answers itself, the module and the pod never see the request.
            assert status == 429, (charged, status, r.text)
            assert r.headers.get("x-envoy-ratelimited") == "true", r.headers
            assert r.json()["error"]["code"] == "token_budget_exhausted", r.text
            assert sim.requests_total() == before
            assert charges(call, "tenant") == [], call
            break
        assert status == 200, (i, charged, r.text)
        assert sim.requests_total() == before + 1
        assert usage and usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0, usage
        # Prompt, then completion: the two stream-done descriptors of the example, in order.
        assert charges(call, "tenant") == [usage["prompt_tokens"], usage["completion_tokens"]], (call, usage)
        assert all(d["entries"] == [["tenant", "team-a"]] for d in call["descriptors"]
                   if any(e[0] == "tenant" for e in d["entries"])), call
        charged += usage["prompt_tokens"] + usage["completion_tokens"]
        served += 1
        # The service agrees on what is spent.
        tenant = [d for d in call["descriptors"] if d["entries"] == [["tenant", "team-a"]]]
        assert tenant[-1]["used"] == charged, (tenant, charged)
    else:
        pytest.fail(f"never refused: {charged} tokens charged of a {BUDGET}-token budget")
    # Streamed and non-streamed responses were both charged before the budget ran out.
    assert served >= 2, served
    # The request-path checks charged nothing: hits_addend 0 on every one.
    checks = [c for c in rls.calls() if not any(e[0] == "test_id" for d in c["descriptors"] for e in d["entries"])]
    assert checks and all(d["hits_addend"] == 0 for c in checks for d in c["descriptors"]), checks[-3:]
    # Another tenant's budget is its own: still served.
    status, r, _ = chat(envoy, "other-tenant", "team-b", stream=False)
    assert status == 200, r.text
    # And team-a stays refused.
    status, _, _ = chat(envoy, "still-spent", "team-a", stream=True)
    assert status == 429


def test_a_response_without_counted_usage_charges_nothing(gateway):
    rls, sim, envoy = gateway
    # A stream without include_usage: served, nothing reported, nothing charged.
    status, _, usage = chat(envoy, "no-usage", "team-c", stream=True, include_usage=False)
    assert status == 200 and usage is None
    assert charges(stream_done_call(rls, "no-usage"), "tenant") == []
    # A request the module answers itself (an unknown model): no usage, nothing charged.
    status, r, _ = chat(envoy, "unknown-model", "team-c", stream=False, model="no-such-model")
    assert status == 404, r.text
    assert charges(stream_done_call(rls, "unknown-model"), "tenant") == []
    # An error from the pod: no usage read from a non-2xx response, nothing charged.
    sim.chaos("status", status=500, count=3)
    try:
        status, r, _ = chat(envoy, "pod-error", "team-c", stream=False)
        assert status >= 500, r.text
        assert charges(stream_done_call(rls, "pod-error"), "tenant") == []
    finally:
        sim.chaos("ok")
    # A served request charges, as a control: the same tenant, the same stream-done call.
    status, _, usage = chat(envoy, "control", "team-c", stream=False,
                            extra_headers={"x-gateway-inference-fairness-id": "team-c"})
    assert status == 200
    call = stream_done_call(rls, "control")
    assert charges(call, "tenant") == [usage["prompt_tokens"], usage["completion_tokens"]], call
    # A descriptor on x-gateway-inference-fairness-id is dropped at stream end: the module removed
    # that header before the request went upstream, and Envoy builds stream-done descriptors from
    # the request headers as they are then.
    assert charges(call, "fairness_id") == [], call
