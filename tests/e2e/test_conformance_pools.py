"""GIE's two multi-pool routing scenarios (docs/conformance.md), in a real Envoy 1.40 with
envoy/multi-pool.yaml's two pools, each its own filter (vm_id, poller, configuration), and the
pool chosen by the route, not by the model: both pools serve the same model, as in the suite.

- HTTPRouteMultipleRulesDifferentPools: one route table, two rules by path prefix, each rule
  enabling only its own pool's filter and sending to its own pool's cluster;
- HTTPRouteMultipleGatewaysDifferentPools: two listeners (two Gateways), each with one route to
  its own pool.

Every request must be served by a pod of the rule's (or the listener's) pool, never the other's."""
import copy

import requests

from harness import Sim, free_port, wait_until
from test_pools import MultiPoolEnvoy, pool_config

MODEL = "conformance-fake-model"
ON = {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "config": {}}
BODY = {"model": MODEL, "prompt": "Write as if you were a critic: San Francisco", "max_tokens": 2}


def pools():
    a = [Sim(f"pool-a-{i}", models=(MODEL,)) for i in range(2)]
    b = [Sim(f"pool-b-{i}", models=(MODEL,)) for i in range(2)]
    configs = {}
    for vm_id, name, sims in (("pool-llama", "a", a), ("pool-qwen", "b", b)):
        cfg = pool_config(name, sims, MODEL)
        # The route chooses the pool: no body-based routing; any POST path is an inference
        # request, as the suite's test paths need.
        cfg["pool"]["route_by_model"] = False
        cfg["models"] = [{"name": MODEL}]
        cfg["filter"] = {"conformance_mode": True}
        configs[vm_id] = cfg
    return a, b, configs


def hcm(listener):
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def route_to(template: dict, prefix: str, filter_name: str) -> dict:
    """A copy of one of multi-pool.yaml's pool routes (its cluster and retry policy), matched on
    a path prefix alone and enabling only `filter_name`."""
    r = copy.deepcopy(template)
    r["name"] = f"{filter_name}{prefix.replace('/', '-')}"
    r["match"] = {"prefix": prefix}
    r["typed_per_filter_config"] = {filter_name: ON}
    return r


def pool_routes(doc):
    vh = hcm(doc["static_resources"]["listeners"][0])["route_config"]["virtual_hosts"][0]
    # No filter enabled for the whole virtual host: each rule enables its own pool's filter.
    vh.pop("typed_per_filter_config", None)
    by_name = {r["name"]: r for r in vh["routes"]}
    return vh, by_name["pool-llama"], by_name["pool-qwen"], by_name["model-not-found"]


def post(url: str, path: str) -> requests.Response:
    with requests.Session() as s:
        return s.post(url + path, json=BODY, timeout=30)


def served(r) -> str:
    """The pod that answered. On the suite's test paths the simulator answers 404 (a path it does
    not serve), but the answer is the pod's own and names it (`x-sim-server`)."""
    name = r.headers.get("x-sim-server")
    assert name, (r.status_code, dict(r.headers), r.text)
    return name


def wait_ready(envoy, url_paths):
    """Each pool routes, and both of its pods have been scraped."""
    for url, path in url_paths:
        wait_until(lambda: post(url, path).headers.get("x-sim-server"), 15, f"{url}{path} routed")
    for pool in ("a", "b"):
        wait_until(lambda: envoy.metric("inference_picker_ready_endpoints", pool=pool) >= 2, 15,
                   f"pool {pool}'s pods scraped")


def stop_all(envoy, sims):
    envoy.stop()
    for s in sims:
        s.stop()


def test_multiple_rules_different_pools():
    a, b, configs = pools()

    def by_path(doc):
        vh, llama, qwen, not_found = pool_routes(doc)
        vh["routes"] = [route_to(llama, "/test-pool-a", "picker-llama"),
                        route_to(qwen, "/test-pool-b", "picker-qwen"), not_found]

    envoy = MultiPoolEnvoy(configs, app_port=free_port(), mutate=by_path)
    try:
        wait_ready(envoy, [(envoy.url, "/test-pool-a"), (envoy.url, "/test-pool-b")])
        names_a, names_b = {s.name for s in a}, {s.name for s in b}
        got_a = [served(post(envoy.url, f"/test-pool-a/{i}")) for i in range(20)]
        got_b = [served(post(envoy.url, f"/test-pool-b/{i}")) for i in range(20)]
        assert set(got_a) <= names_a, got_a
        assert set(got_b) <= names_b, got_b
        # A path neither rule matches reaches no pool (the catch-all's JSON 404, no pod's).
        r = post(envoy.url, "/elsewhere")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        assert "x-sim-server" not in r.headers
    finally:
        stop_all(envoy, a + b)


def test_multiple_gateways_different_pools():
    a, b, configs = pools()
    second_port = free_port()

    def two_listeners(doc):
        vh, llama, qwen, not_found = pool_routes(doc)
        vh["routes"] = [route_to(llama, "/", "picker-llama")]
        first = doc["static_resources"]["listeners"][0]
        second = copy.deepcopy(first)
        second["name"] = "gateway-b"
        second["address"]["socket_address"]["port_value"] = second_port
        rc = hcm(second)["route_config"]
        rc["name"] = "gateway-b"
        hcm(second)["stat_prefix"] = "gateway_b"
        rc["virtual_hosts"][0]["routes"] = [route_to(qwen, "/", "picker-qwen")]
        doc["static_resources"]["listeners"].append(second)

    envoy = MultiPoolEnvoy(configs, app_port=free_port(), mutate=two_listeners)
    url_b = f"http://127.0.0.1:{second_port}"
    try:
        wait_ready(envoy, [(envoy.url, "/v1/completions"), (url_b, "/v1/completions")])
        names_a, names_b = {s.name for s in a}, {s.name for s in b}
        got_a = [served(post(envoy.url, "/v1/completions")) for _ in range(20)]
        got_b = [served(post(url_b, "/v1/completions")) for _ in range(20)]
        assert set(got_a) <= names_a, got_a
        assert set(got_b) <= names_b, got_b
    finally:
        stop_all(envoy, a + b)
