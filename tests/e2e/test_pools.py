"""Issues 13 and 18 in a real Envoy 1.40: scoped insertion (routes that do not point at a pool
never reach the module), several pools on one listener (envoy/multi-pool.yaml), body-based
routing between them (x-gateway-model-name, route re-match, per-pool pick)."""
from __future__ import annotations

import copy
import http.server
import json
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest
import requests
import yaml

from harness import (LLAMA, QWEN, REPO, WASM, ENVOY, ENVOY_YAML, LIVE_ENVOYS, Envoy, Sim, _live, endpoint, free_port,
                     metric_value, picker_config, set_cluster_hosts, set_module, set_ports, wait_until)

MULTI_YAML = REPO / "envoy" / "multi-pool.yaml"
FIXTURES = REPO / "tests" / "fixtures" / "requests"


class EchoApp:
    """An ordinary HTTP application: answers every request with its exact body, and the request
    headers it saw in `x-echo-headers` (JSON)."""

    def __init__(self):
        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self):
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n) if n else b""
                seen.append(body)
                self.send_response(200)
                self.send_header("content-type", "application/octet-stream")
                self.send_header("x-echo-headers", json.dumps({k.lower(): v for k, v in self.headers.items()}))
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = _answer

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def pool_config(pool: str, sims: list[Sim], model: str, mode: str = "singleton") -> dict:
    cfg = picker_config([endpoint(s, model) for s in sims])
    cfg["pool"] = {"name": pool, "route_by_model": True}
    cfg["poller"]["mode"] = mode
    return cfg


class MultiPoolEnvoy(Envoy):
    """Envoy running envoy/multi-pool.yaml with its ports, .wasm path, the two pools'
    configurations (by vm_id: pool-llama, pool-qwen) and cluster members replaced, and the app
    cluster pointed at `app_port`; `mutate(doc)` may change the rest (routes, listeners) before
    Envoy starts."""

    def __init__(self, configs: dict[str, dict], app_port: int, concurrency: int = 2, singleton: bool = True,
                 mutate=None):
        self.port = free_port()
        self.admin_port = free_port()
        self.tmp = tempfile.TemporaryDirectory(prefix="picker-envoy-pools-")
        doc = yaml.safe_load(MULTI_YAML.read_text())
        set_ports(doc, self.port, self.admin_port)
        set_module(doc, WASM, lambda plugin: json.dumps(configs[plugin["vm_config"]["vm_id"]]))
        if not singleton:
            # Lease mode (as on an Istio gateway): each pool's filter roots elect its poller.
            doc.pop("bootstrap_extensions", None)
        for cluster, vm_id in (("pool_llama", "pool-llama"), ("pool_qwen", "pool-qwen")):
            set_cluster_hosts(doc, cluster, [e["address"] for e in configs[vm_id]["endpoints"]])
        set_cluster_hosts(doc, "app", [f"127.0.0.1:{app_port}"])
        if mutate is not None:
            # A variant of multi-pool.yaml's routes or listeners (the conformance scenarios).
            mutate(doc)
        path = Path(self.tmp.name) / "envoy.yaml"
        path.write_text(yaml.safe_dump(doc))
        self.log_path = Path(self.tmp.name) / "envoy.log"
        self.proc = subprocess.Popen(
            [str(ENVOY), "-c", str(path), "--concurrency", str(concurrency), "--use-dynamic-base-id",
             "-l", "info", "--log-path", str(self.log_path), "--disable-hot-restart"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        _live.append(self.proc)
        LIVE_ENVOYS.append(self)
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin = f"http://127.0.0.1:{self.admin_port}"

        def ready():
            if self.proc.poll() is not None:
                raise RuntimeError("envoy exited:\n" + self.log())
            try:
                return requests.get(self.admin + "/ready", timeout=1).status_code == 200
            except requests.RequestException:
                return False

        try:
            wait_until(ready, 30, "envoy ready")
        except AssertionError:
            self.stop()
            raise


def post(envoy, body, headers=None, path="/v1/chat/completions"):
    # A new connection per request: the kernel spreads connections over Envoy's workers.
    with requests.Session() as s:
        return s.post(envoy.url + path, json=body, headers=headers or {}, timeout=30)


def chat_body(model, content="Hello"):
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2}


def served(r):
    assert r.status_code == 200, r.text
    return r.json()["served_by"]


# A body that is not JSON at all, with bytes no parser would keep: the module would answer it
# 400 (or 404 on this path) if it saw it.
ODD_BODY = b"\x00\xffnot json {\"model\": 1}\r\n" + bytes(range(256)) * 4


def assert_untouched(envoy, app, sims):
    before = [s.requests_total() for s in sims]
    r = requests.post(envoy.url + "/app/upload?x=1", data=ODD_BODY,
                      headers={"x-gateway-model-name": "anything", "x-gateway-destination-endpoint": "1.2.3.4:5"},
                      timeout=10)
    assert r.status_code == 200, r.text
    assert r.content == ODD_BODY
    seen = json.loads(r.headers["x-echo-headers"])
    # Nothing of the module's: the client's own headers arrive as sent, nothing added.
    assert seen["x-gateway-model-name"] == "anything"
    assert seen["x-gateway-destination-endpoint"] == "1.2.3.4:5"
    assert "x-gateway-queue-ms" not in r.headers
    assert app.seen[-1] == ODD_BODY
    # A GET on a path the module would answer 404 reaches the app too.
    g = requests.get(envoy.url + "/app/v1/nothing", timeout=10)
    assert g.status_code == 200 and g.content == b""
    assert [s.requests_total() for s in sims] == before


def test_single_pool_other_virtual_host_is_untouched():
    """envoy/envoy.yaml as shipped enables the filter only on the pool's route: a second
    virtual host on the same listener (an ordinary app) never reaches the module."""
    sims = [Sim("scope-0")]
    app = EchoApp()
    base = yaml.safe_load(ENVOY_YAML.read_text())
    hcm = base["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["route_config"]["virtual_hosts"].insert(0, {
        "name": "app", "domains": ["app.test", "app.test:*"],
        "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "app"}}]})
    app_cluster = {"name": "app", "type": "STATIC", "connect_timeout": "1s", "load_assignment": {
        "cluster_name": "app", "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
            "socket_address": {"address": "127.0.0.1", "port_value": app.port}}}}]}]}}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "base.yaml"
        path.write_text(yaml.safe_dump(base))
        envoy = Envoy(picker_config([endpoint(s) for s in sims]), concurrency=1, base_yaml=path,
                      extra_clusters=[app_cluster])
    try:
        envoy.wait_routable()
        r = requests.post(envoy.url + "/v1/chat/completions", data=ODD_BODY,
                          headers={"host": "app.test"}, timeout=10)
        assert r.status_code == 200 and r.content == ODD_BODY
        # The same body on the inference host is the module's: an OpenAI-style 400.
        r = requests.post(envoy.url + "/v1/chat/completions", data=ODD_BODY, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert sims[0].requests_total() >= 1  # wait_routable's request
    finally:
        envoy.stop()
        app.stop()
        for s in sims:
            s.stop()


@pytest.mark.parametrize("mode", ["singleton", "lease"])
def test_two_pools_body_based_routing_and_a_plain_route(mode):
    llama = [Sim("llama-0", models=(LLAMA,), loras=("sql-lora",)), Sim("llama-1", models=(LLAMA,), loras=("sql-lora",))]
    qwen = [Sim("qwen-0", models=(QWEN,))]
    app = EchoApp()
    configs = {"pool-llama": pool_config("llama", llama, LLAMA, mode),
               "pool-qwen": pool_config("qwen", qwen, QWEN, mode)}
    configs["pool-llama"]["models"] = [{"name": LLAMA, "adapters": ["sql-lora"]}]
    configs["pool-qwen"]["models"] = [{"name": QWEN}]
    envoy = MultiPoolEnvoy(configs, app.port, singleton=(mode == "singleton"))
    llama_names = {s.name for s in llama}
    try:
        envoy.wait_routable(LLAMA)
        envoy.wait_routable(QWEN)
        for s in llama + qwen:
            s.reset_stats()
        # Each model reaches only its own pool's pods.
        for i in range(12):
            assert served(post(envoy, chat_body(LLAMA, f"llama {i}"))) in llama_names
            assert served(post(envoy, chat_body(QWEN, f"qwen {i}"))) == "qwen-0"
        # An adapter routes with its base model (x-gateway-model-name = the base).
        assert served(post(envoy, chat_body("sql-lora", "adapter"))) in llama_names
        assert qwen[0].requests_total() == 12
        assert sum(s.requests_total() for s in llama) == 13
        # A forged x-gateway-model-name changes nothing: the body's model decides.
        for i in range(6):
            r = post(envoy, chat_body(LLAMA, f"forged {i}"), headers={"x-gateway-model-name": QWEN})
            assert served(r) in llama_names
            r = post(envoy, chat_body(QWEN, f"forged {i}"), headers={"x-gateway-model-name": LLAMA})
            assert served(r) == "qwen-0"
        assert qwen[0].requests_total() == 18
        # The body is parsed once: the Llama pool's filter passes a Qwen request on with its
        # parsed body, and the Qwen pool's filter uses it instead of parsing again.
        def counts():
            text = envoy.stats_prometheus()
            return (metric_value(text, "inference_picker_pool_passed_on_total", pool="llama"),
                    metric_value(text, "inference_picker_pool_parse_reused_total", pool="qwen"),
                    metric_value(text, "inference_picker_pool_passed_on_total", pool="qwen"))
        before = counts()
        for i in range(5):
            assert served(post(envoy, chat_body(QWEN, f"once {i}"))) == "qwen-0"
        for i in range(3):
            assert served(post(envoy, chat_body(LLAMA, f"once {i}"))) in llama_names
        after = counts()
        assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (5, 5, 0), (before, after)
        # A model no pool serves: the JSON 404, from the catch-all route; no pod sees it.
        before = [s.requests_total() for s in llama + qwen]
        r = post(envoy, chat_body("no-such-model"), headers={"x-gateway-model-name": LLAMA})
        assert r.status_code == 404, r.text
        assert r.headers["content-type"].startswith("application/json")
        assert r.json()["error"]["code"] == "model_not_found"
        # No model at all: 400 from the first pool, as with one pool.
        r = post(envoy, {"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "missing_model", r.text
        assert [s.requests_total() for s in llama + qwen] == before
        # Each pool's own scoring: a long shared prefix sticks to one pod of the llama pool.
        doc = json.loads((FIXTURES / "chat_shared_prefix_1.request.json").read_text())
        doc["model"], doc["max_tokens"] = LLAMA, 2
        used = set()
        for case in range(4):
            body = copy.deepcopy(doc)
            body["messages"][0]["content"] = f"[case {case}] " + body["messages"][0]["content"]
            first = served(post(envoy, body))
            for _ in range(3):
                assert served(post(envoy, body)) == first, f"case {case}"
            used.add(first)
        assert used <= llama_names
        # Metrics carry the pool.
        text = envoy.stats_prometheus()
        assert metric_value(text, "inference_picker_requests_total", pool="llama") > 0, text[:3000]
        assert metric_value(text, "inference_picker_requests_total", pool="qwen") > 0
        # The plain route on the same listener: the module never touches it.
        assert_untouched(envoy, app, llama + qwen)
    finally:
        envoy.stop()
        app.stop()
        for s in llama + qwen:
            s.stop()
