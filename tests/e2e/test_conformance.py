"""Our equivalents of GIE's EPP-facing conformance scenarios (issue 13 item 4), in a real Envoy 1.40
with `filter.conformance_mode` on; docs/conformance.md maps each to the suite's test.

The pods are simulators on distinct loopback addresses (127.0.0.2-4), so that a bare IP in
`test-epp-endpoint-selection` names one pod, as a pod IP does in Kubernetes; the data-parallel pod
is three simulators on one address (127.0.0.5) and three ports, as three DP ranks of one pod."""
import pytest
import requests

from harness import Envoy, Sim, picker_config, wait_until

MODEL = "conformance-fake-model"
SELECT = "test-epp-endpoint-selection"
SERVED = "x-conformance-test-served-endpoint"
# The suite's body (a completion), on one of its own test paths.
BODY = {"model": MODEL, "prompt": "Write as if you were a critic: San Francisco", "max_tokens": 2}


@pytest.fixture(scope="module")
def pods():
    started = []
    try:
        for name, host in (("pod-a", "127.0.0.2"), ("pod-b", "127.0.0.3"), ("pod-c", "127.0.0.4")):
            started.append(Sim(name, models=(MODEL,), host=host))
        for rank in range(3):
            started.append(Sim(f"dp-rank{rank}", models=(MODEL,), host="127.0.0.5"))
        yield started
    finally:
        for s in started:
            s.stop()


def config(pods, **filter_cfg) -> dict:
    cfg = picker_config([{"address": p.address, "models": [MODEL]} for p in pods], models=[{"name": MODEL}])
    cfg["filter"] = {"conformance_mode": True, **filter_cfg}
    return cfg


@pytest.fixture(scope="module")
def gateway(pods):
    envoy = Envoy(config(pods))
    try:
        envoy.wait_routable(MODEL)  # and every pod scraped once
        yield envoy
    finally:
        envoy.stop()


def send(envoy: Envoy, selection: str | None = None, path: str = "/v1/completions") -> requests.Response:
    headers = {SELECT: selection} if selection is not None else {}
    return requests.post(envoy.url + path, json=BODY, headers=headers, timeout=30)


def served(r) -> str:
    assert r.status_code == 200, r.text
    return r.json()["served_by"]


def test_gateway_following_epp_routing(gateway, pods):
    """GatewayFollowingEPPRouting: each pod by its IP, then one, two and all three pods."""
    a, b, c = pods[:3]
    for p in (a, b, c):
        for _ in range(5):
            assert served(send(gateway, p.address.split(":")[0])) == p.name
        # The test header is consumed by the gateway: the pod never sees it.
        assert SELECT not in p.stats()["last_request_headers"]
    for chosen in ([c], [a, b], [a, b, c]):
        value = ",".join(p.address.split(":")[0] for p in chosen)
        seen = {served(send(gateway, value)) for _ in range(30)}
        assert seen <= {p.name for p in chosen}, (value, seen)
    # The suite's own test path is routed too (the simulator answers 404 for a path it does not
    # serve, but the response comes from the selected pod and names it).
    r = send(gateway, a.address.split(":")[0], path="/primary-gateway-test")
    assert r.headers.get("x-sim-server") == "pod-a", (r.status_code, r.headers, r.text)
    assert r.headers.get(SERVED) == a.address


def test_gateway_following_epp_routing_with_data_parallelism(gateway, pods):
    """GatewayFollowingEPPRoutingWithDataParallelism: a bare IP means any rank (port) of that
    pod; ip:port entries pin ranks."""
    a = pods[0]
    ranks = pods[3:]
    ip = ranks[0].address.split(":")[0]
    seen = {served(send(gateway, ip)) for _ in range(40)}
    assert seen <= {r.name for r in ranks}, seen
    # Several ranks are used (the in-flight count and the tie-break spread them); GIE's test
    # only requires the pod's own ranks.
    assert len(seen) >= 2, seen
    pinned = f"{a.address.split(':')[0]},{ranks[2].address}"
    seen = {served(send(gateway, pinned)) for _ in range(30)}
    assert seen <= {a.name, ranks[2].name}, seen
    two_ranks = f"{ranks[0].address},{ranks[1].address}"
    seen = {served(send(gateway, two_ranks)) for _ in range(30)}
    assert seen <= {ranks[0].name, ranks[1].name}, seen


def test_gateway_destination_endpoint_served(gateway, pods):
    """GatewayDestinationEndpointServed: the response names the ip:port that served."""
    by_name = {p.name: p.address for p in pods}
    for p in pods:
        r = send(gateway, p.address)
        assert served(r) == p.name
        assert r.headers[SERVED] == p.address
    # Without a selection the header still names the pod that served.
    for _ in range(10):
        r = send(gateway)
        assert r.headers[SERVED] == by_name[served(r)]


def test_selection_naming_no_pod_is_503_not_another_pod(gateway):
    for value in ("10.9.9.9", "127.0.0.2:1", "not-an-ip"):
        r = send(gateway, value)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "no_endpoint"


def test_headers_are_ignored_outside_conformance_mode(pods):
    """The test header chooses the pod: without conformance mode a client must not be able to."""
    envoy = Envoy(config(pods, conformance_mode=False))
    try:
        envoy.wait_routable(MODEL)  # and every pod scraped once
        # A selection naming nothing in the pool would be a 503 in conformance mode.
        r = send(envoy, "10.9.9.9")
        assert r.status_code == 200, r.text
        assert SERVED not in r.headers
        # Naming one pod does not pin the request to it.
        seen = {served(send(envoy, pods[0].address)) for _ in range(40)}
        assert len(seen) >= 2, seen
        # And it is removed before the request goes upstream.
        for p in pods:
            if p.name in seen:
                assert SELECT not in p.stats()["last_request_headers"]
        # The suite's test paths are not inference paths outside conformance mode.
        r = send(envoy, path="/primary-gateway-test")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
    finally:
        envoy.stop()


@pytest.mark.parametrize("mode,expect", [("FailOpen", 200), ("FailClose", 503)])
def test_picker_without_metrics_fails_open_only_when_configured(pods, mode, expect):
    """EppUnAvailableFailOpen, the in-proxy form: the picker has no usable pod data (every
    scrape fails: a metrics path the pods do not serve). With `failure_mode: FailOpen` requests
    still reach the pool, and a selection is still honoured; with FailClose they get 503."""
    cfg = config(pods[:3], failure_mode=mode)
    cfg["poller"]["metrics_path"] = "/no-metrics-here"
    envoy = Envoy(cfg)
    try:
        wait_until(lambda: send(envoy).status_code == expect, 15, f"{mode} answer {expect}")
        for _ in range(10):
            r = send(envoy)
            assert r.status_code == expect, r.text
        if expect == 200:
            a = pods[0]
            for _ in range(5):
                r = send(envoy, a.address.split(":")[0])
                assert served(r) == a.name
                assert r.headers[SERVED] == a.address
        else:
            assert r.json()["error"]["code"] == "no_healthy_endpoint", r.text
    finally:
        envoy.stop()
