"""Issue 9 (hardening of request input) in a real Envoy 1.40 running the built .wasm: hostile
header bytes, HTTP/2 trailers, the path policy, the session-token key, the served-endpoint header.

Each test names, in a comment, what it caught on the main branch before this work."""
from __future__ import annotations

import copy
import json
import os
import socket
import tempfile
import time
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import pytest
import requests
import yaml

from harness import ENVOY_YAML, LLAMA, Envoy, Sim, dict_nodes, endpoint, picker_config, wait_until

CHAT = "/v1/chat/completions"
BODY = {"model": LLAMA, "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]}
SECRET = "e2e-session-secret-0123456789"
SECRET_ENV = "PICKER_E2E_SESSION_SECRET"


# ---- clients -------------------------------------------------------------------------------

def raw_http1(port: int, request: bytes, timeout: float = 30) -> tuple[int, dict, bytes]:
    """Sends one raw HTTP/1.1 request (it must say `connection: close`) and reads the whole
    response, until Envoy closes the connection: (status, lower-cased headers, body). Bounded by
    `timeout` (a wait for that event, not a speed requirement)."""
    deadline = time.time() + timeout
    closed = False
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        data = b""
        while time.time() < deadline:
            chunk = s.recv(65536)
            if not chunk:
                closed = True
                break
            data += chunk
    assert closed, f"the HTTP/1.1 response did not end within {timeout} s: {data[:200]!r}"
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if not lines or not lines[0].startswith("HTTP/1.1 "):
        raise AssertionError(f"no HTTP response: {data[:200]!r}")
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return int(lines[0].split()[1]), headers, body


def chat_request(extra_header: bytes, body: dict = BODY) -> bytes:
    payload = json.dumps(body).encode()
    return (b"POST " + CHAT.encode() + b" HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(payload)).encode() + b"\r\nconnection: close\r\n"
            + extra_header + b"\r\n\r\n" + payload)


def h2_post_with_trailers(port: int, path: str, body: bytes, timeout: float = 30) -> tuple[int, dict, bytes]:
    """An HTTP/2 (h2c, prior knowledge) POST whose stream ends with trailers, not with the last
    DATA frame: (status, headers, body). Bounded by `timeout` (a wait for the stream's end, not a
    speed requirement)."""
    deadline = time.time() + timeout
    conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    status, headers, data, ended = 0, {}, b"", False
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        conn.initiate_connection()
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, [(":method", "POST"), (":path", path), (":scheme", "http"),
                                (":authority", "gateway"), ("content-type", "application/json")])
        conn.send_data(sid, body)
        conn.send_headers(sid, [("x-client-checksum", "abc")], end_stream=True)
        s.sendall(conn.data_to_send())
        while not ended and time.time() < deadline:
            chunk = s.recv(65536)
            if not chunk:
                break
            for ev in conn.receive_data(chunk):
                if isinstance(ev, h2.events.ResponseReceived) and ev.stream_id == sid:
                    headers = dict(ev.headers)
                    status = int(headers[":status"])
                elif isinstance(ev, h2.events.DataReceived) and ev.stream_id == sid:
                    data += ev.data
                    conn.acknowledge_received_data(ev.flow_controlled_length, sid)
                elif isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset)) and ev.stream_id == sid:
                    ended = True
            s.sendall(conn.data_to_send())
    assert ended, "the HTTP/2 response did not end in time"
    return status, headers, data


# ---- session tokens, as the module makes them (SipHash-2-4; see src/scheduler/session.rs) -------

_M = (1 << 64) - 1


def _rotl(x: int, b: int) -> int:
    return ((x << b) | (x >> (64 - b))) & _M


def siphash24(k0: int, k1: int, data: bytes) -> int:
    v0, v1, v2, v3 = k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D, k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573

    def rounds(n, v0, v1, v2, v3):
        for _ in range(n):
            v0 = (v0 + v1) & _M; v1 = _rotl(v1, 13) ^ v0; v0 = _rotl(v0, 32)
            v2 = (v2 + v3) & _M; v3 = _rotl(v3, 16) ^ v2
            v0 = (v0 + v3) & _M; v3 = _rotl(v3, 21) ^ v0
            v2 = (v2 + v1) & _M; v1 = _rotl(v1, 17) ^ v2; v2 = _rotl(v2, 32)
        return v0, v1, v2, v3

    n = len(data)
    full = n - n % 8
    blocks = [data[i:i + 8] for i in range(0, full, 8)] + [data[full:] + bytes(7 - n % 8) + bytes([n & 0xFF])]
    for b in blocks:
        m = int.from_bytes(b, "little")
        v3 ^= m
        v0, v1, v2, v3 = rounds(2, v0, v1, v2, v3)
        v0 ^= m
    v2 ^= 0xFF
    v0, v1, v2, v3 = rounds(4, v0, v1, v2, v3)
    return v0 ^ v1 ^ v2 ^ v3


assert siphash24(0x0706050403020100, 0x0F0E0D0C0B0A0908, bytes(range(15))) == 0xA129CA6149BE45E5
DEFAULT_SECRET = "inference-picker default session key: set scheduler.session.secret_env"


def session_token(secret: str, address: str) -> str:
    dk0, dk1 = 0x696E666572656E63, 0x652D7069636B6572
    k0 = siphash24(dk0, dk1, b"\x00" + secret.encode())
    k1 = siphash24(dk0, dk1, b"\x01" + secret.encode())
    return "v2.%016x" % siphash24(k0, k1, address.encode())


# ---- fixtures --------------------------------------------------------------------------------

def base_yaml_with(tmp: Path, env_keys=(), routes=()) -> Path:
    """envoy/envoy.yaml with `host_env_keys` on every vm_config and extra routes before the
    catch-all, written to `tmp`; the harness then applies ports, .wasm and configuration."""
    doc = yaml.safe_load(ENVOY_YAML.read_text())

    for node in dict_nodes(doc):
        if "vm_config" in node and env_keys:
            node["vm_config"]["environment_variables"] = {"host_env_keys": list(env_keys)}
        if "routes" in node and routes:
            node["routes"] = list(routes) + node["routes"]
    path = tmp / "envoy-base.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def pool():
    sims = [Sim(f"hard-{i}") for i in range(3)]
    cfg = picker_config([endpoint(s) for s in sims],
                        priority={"objectives": [{"name": "batch", "priority": -1}], "trust_objective_header": True})
    envoy = Envoy(cfg, concurrency=1)  # one worker VM: a panic there would take every request with it
    try:
        envoy.wait_routable()
        yield envoy, sims
    finally:
        envoy.stop()
        for s in sims:
            s.stop()


def names(sims) -> set[str]:
    return {s.name for s in sims}


# ---- tests -----------------------------------------------------------------------------------

def test_non_utf8_header_values_are_absent_and_the_vm_survives(pool):
    # Caught on main: the SDK's get_map_value unwrapped String::from_utf8, so the first request
    # below panicked the only worker VM (FAIL_CLOSED): it and every later request got a plain 503.
    envoy, sims = pool
    for header in (b"x-session-id: \xff", b"x-session-token: v1.\xff", b"x-session-token: v2.\xff\xfe",
                   b"x-gateway-inference-objective: b\xe4tch"):
        status, headers, body = raw_http1(envoy.port, chat_request(header))
        # The value reads as absent: the request is served like one without the header.
        assert status == 200, (header, status, body[:300])
        assert json.loads(body)["served_by"] in names(sims)
    for i in range(5):
        r = envoy.chat(content=f"after {i}")
        assert r.status_code == 200, r.text
        assert r.json()["served_by"] in names(sims)


def test_http2_request_with_trailers_is_routed_like_any_other(pool):
    # Caught on main: the body callback never saw end_of_stream, the SDK's default trailers
    # callback continued, and the request reached the router unrouted: plain-text 503
    # "no healthy upstream" from the ORIGINAL_DST cluster.
    envoy, sims = pool
    status, headers, body = h2_post_with_trailers(envoy.port, CHAT, json.dumps(BODY).encode())
    assert status == 200, body[:300]
    assert json.loads(body)["served_by"] in names(sims)
    # And it is decided like a body without trailers: no model is a JSON 400, not a 503.
    status, headers, body = h2_post_with_trailers(envoy.port, CHAT, b'{"messages": []}')
    assert status == 400, body[:300]
    assert headers["content-type"] == "application/json"
    assert json.loads(body)["error"]["code"] == "missing_model"
    # A model the pool does not serve: the same 404 as without trailers.
    status, _, body = h2_post_with_trailers(envoy.port, CHAT, json.dumps({**BODY, "model": "nope"}).encode())
    assert (status, json.loads(body)["error"]["code"]) == (404, "model_not_found")


def test_non_inference_paths_never_reach_a_pod(pool):
    # Caught on main: POST /sim/reset-stats with a model in its body was routed to a pod (which
    # reset its stats), like any path; GET /v1/models/{id}, health checks and OPTIONS got 400
    # missing_model.
    envoy, sims = pool
    for i in range(3):
        assert envoy.chat(content=f"warm {i}").status_code == 200
    before = [s.requests_total() for s in sims]
    assert sum(before) >= 3
    for method, path in (("POST", "/sim/reset-stats"), ("POST", "/v1/load_lora_adapter"), ("GET", "/metrics"),
                         ("POST", "/v1/chat/completions/../../sim/reset-stats"), ("DELETE", "/v1/models/x")):
        r = requests.request(method, envoy.url + path, json={**BODY, "lora_name": "x"}, timeout=10)
        assert r.status_code in (404, 405), (method, path, r.status_code, r.text)
        assert r.headers["content-type"] == "application/json"
        assert r.json()["error"]["code"] in ("not_found", "method_not_allowed")
    r = requests.get(envoy.url + CHAT, timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "POST, OPTIONS"
    assert r.json()["error"]["code"] == "method_not_allowed"
    # Nothing reached a pod, and nothing reset a pod's stats.
    assert [s.requests_total() for s in sims] == before

    for path in ("/health", "/healthz", "/readyz", "/livez"):
        r = requests.get(envoy.url + path, timeout=10)
        assert (r.status_code, r.json()) == (200, {"status": "ok"}), path
    r = requests.options(envoy.url + CHAT, headers={"origin": "https://example.com",
                                                    "access-control-request-method": "POST"}, timeout=10)
    assert r.status_code == 204 and "access-control-allow-origin" not in r.headers
    r = requests.get(envoy.url + "/v1/models/" + LLAMA, timeout=10)  # the id has a '/' in it
    assert r.status_code == 200 and r.json()["id"] == LLAMA
    r = requests.get(envoy.url + "/v1/models/" + LLAMA.replace("/", "%2F"), timeout=10)
    assert r.status_code == 200 and r.json()["id"] == LLAMA
    r = requests.get(envoy.url + "/v1/models/no-such-model", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert [s.requests_total() for s in sims] == before


def test_passthrough_prefix_goes_where_the_route_says():
    # Caught on main: the module has no filter.passthrough_prefixes (the configuration is refused).
    sims = [Sim("pass-0"), Sim("pass-1")]
    admin_sim = Sim("pass-admin")
    cfg = picker_config([endpoint(s) for s in sims], filter={"passthrough_prefixes": ["/sim/"]})
    direct = {"name": "sim_direct", "type": "STATIC", "connect_timeout": "2s",
              "load_assignment": {"cluster_name": "sim_direct", "endpoints": [{"lb_endpoints": [{"endpoint": {
                  "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_sim.port}}}}]}]}}
    route = {"match": {"prefix": "/sim/"}, "route": {"cluster": "sim_direct"}}
    with tempfile.TemporaryDirectory() as tmp:
        envoy = Envoy(cfg, concurrency=1, base_yaml=base_yaml_with(Path(tmp), routes=[route]), extra_clusters=[direct])
    try:
        envoy.wait_routable()
        r = requests.get(envoy.url + "/sim/stats", timeout=10)
        # Untouched by the filter: the route's cluster answered (the sim's own stats).
        assert r.status_code == 200, r.text
        assert "requests_total" in r.json()
        # Inference paths are still picked among the pool (never the passthrough cluster).
        assert envoy.chat().json()["served_by"] in names(sims)
        assert admin_sim.requests_total() == 0
        # Other paths still get the JSON 404.
        assert requests.get(envoy.url + "/simulator", timeout=10).status_code == 404
    finally:
        envoy.stop()
        for s in sims + [admin_sim]:
            s.stop()


def test_session_token_needs_the_deployment_secret(monkeypatch):
    # Caught on main: tokens were keyed with a public constant, so anyone could mint one for a
    # known pod; main also has no scheduler.session.secret_env (the configuration is refused).
    sims = [Sim(f"key-{i}") for i in range(3)]
    target = sims[0]
    monkeypatch.setenv(SECRET_ENV, SECRET)
    cfg = picker_config([endpoint(s) for s in sims], scheduler={"session": {"secret_env": SECRET_ENV}})
    with tempfile.TemporaryDirectory() as tmp:
        envoy = Envoy(cfg, concurrency=2, base_yaml=base_yaml_with(Path(tmp), env_keys=[SECRET_ENV]))
    try:
        envoy.wait_routable()
        # The target looks busier (queue 30: lower score, but under the hot-spot guard's gap of
        # 64), so without an honoured token it is never the pick.
        target.fake_load(queue=30)
        scrapes = target.stats()["metrics_scrapes_total"]
        wait_until(lambda: target.stats()["metrics_scrapes_total"] >= scrapes + 3, 10, "scrapes of the busy pod")
        # The secret is not in the admin's config dump: only the variable's name is.
        dump = requests.get(envoy.admin + "/config_dump", timeout=10).text
        assert SECRET not in dump and SECRET_ENV in dump
        body = {**BODY, "messages": [{"role": "user", "content": "t"}]}
        genuine = session_token(SECRET, target.address)
        for token in (session_token(DEFAULT_SECRET, target.address),  # minted with the public key
                      session_token("another-deployment-secret", target.address),
                      "v1." + "0" * 16):
            for _ in range(4):
                r = requests.post(envoy.url + CHAT, json=body, headers={"x-session-token": token}, timeout=30)
                assert r.status_code == 200 and r.json()["served_by"] != target.name, token
        # A token made with the deployment's secret is honoured (the test could fail).
        for _ in range(4):
            r = requests.post(envoy.url + CHAT, json=body, headers={"x-session-token": genuine}, timeout=30)
            assert r.status_code == 200 and r.json()["served_by"] == target.name
            assert r.headers["x-session-token"] == genuine
    finally:
        envoy.stop()
        for s in sims:
            s.stop()


@pytest.mark.parametrize("expose", [False, True])
def test_served_endpoint_header_is_opt_in(expose):
    # Caught on main: x-gateway-destination-endpoint-served (a pod's ip:port) was on every
    # response, showing clients the pool's topology.
    sims = [Sim(f"served-{i}") for i in range(2)]
    # Only the opt-in sets the field, so that the default case runs unchanged on older builds.
    sections = {"filter": {"expose_served_endpoint": True}} if expose else {}
    cfg = picker_config([endpoint(s) for s in sims], **sections)
    envoy = Envoy(cfg, concurrency=1)
    try:
        envoy.wait_routable()
        r = envoy.chat()
        assert r.status_code == 200
        served = r.headers.get("x-gateway-destination-endpoint-served")
        if expose:
            assert served == next(s.address for s in sims if s.name == r.json()["served_by"])
        else:
            assert served is None
            assert not any(s.address in json.dumps(dict(r.headers)) for s in sims)
    finally:
        envoy.stop()
        for s in sims:
            s.stop()
