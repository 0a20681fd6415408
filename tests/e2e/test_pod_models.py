"""Models learned from the pods (`pod_models`, issue 13 item 3) in a real Envoy 1.40: a model the
configuration does not list, and an adapter loaded at run time, are routed to the pods that
report them; the configuration's assumption about which pod serves what is replaced by what the
pod reports; the allow-list refuses unlisted names; without `pod_models` nothing changes."""
import json
import os
import sys
import time
from pathlib import Path

import pytest
import requests

from harness import LLAMA, QWEN, REPO, Envoy, Sim, free_port, picker_config, static_cluster, wait_until

sys.path.insert(0, str(REPO / "tests"))
from fake_k8s_api import FakeK8sApi  # noqa: E402

POD_MODELS = {"refresh_ms": 1000, "timeout_ms": 500}


def served_by(r) -> str:
    return r.json()["served_by"]


def answered_by(r) -> str:
    """The simulator that answered, errors included (its `x-sim-server` header)."""
    return r.headers.get("x-sim-server", "")


def learned_line(sim: Sim, bases: list[str]) -> str:
    """The poller's info line for a pod's model list (one per change of the list)."""
    names = ", ".join(f'"{b}"' for b in bases)
    return f"{sim.address} serves base models [{names}]"


def wait_learned(envoy: Envoy, sim: Sim, bases: list[str]) -> None:
    """Waits (bounded) until the poller has logged what `sim`'s /v1/models says (Envoy flushes
    its log file every few seconds)."""
    line = learned_line(sim, bases)
    wait_until(lambda: line in envoy.log_path.read_text(), 30, f"the log line {line!r}", interval=0.5)


def model_ids(envoy: Envoy) -> list[str]:
    r = requests.get(envoy.url + "/v1/models", timeout=5)
    assert r.status_code == 200, r.text
    return [m["id"] for m in r.json()["data"]]


@pytest.fixture(scope="module")
def sims():
    # sim-a: Llama with LoRA enabled; sim-b: Qwen only. The configuration below claims both
    # serve Llama and lists only Llama, as a hand-written config that drifted would.
    a = Sim("sim-a", models=(LLAMA,), loras=("sql-lora",), extra=("--max-lora", "2"))
    b = Sim("sim-b", models=(QWEN,))
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


def config(a: Sim, b: Sim, **pod_models) -> dict:
    endpoints = [{"address": a.address, "models": [LLAMA]}, {"address": b.address, "models": [LLAMA]}]
    cfg = picker_config(endpoints, models=[{"name": LLAMA, "adapters": ["sql-lora"]}])
    cfg["pod_models"] = dict(POD_MODELS, **pod_models)
    return cfg


def wait_model_routes(envoy: Envoy, model: str, timeout: float = 30) -> None:
    wait_until(lambda: envoy.chat(model).status_code == 200, timeout, f"{model} routed\n{envoy.log()}",
               interval=0.2)


@pytest.mark.parametrize("mode", ["singleton", "lease"])
def test_unlisted_models_and_runtime_adapters_route_to_the_pods_that_serve_them(sims, mode):
    a, b = sims
    cfg = config(a, b)
    cfg["poller"]["mode"] = mode
    envoy = Envoy(cfg, singleton=(mode == "singleton"))
    try:
        # Qwen is in no configuration list: it routes once sim-b's /v1/models has been read.
        wait_model_routes(envoy, QWEN)
        for _ in range(10):
            r = envoy.chat(QWEN)
            assert r.status_code == 200, r.text
            assert served_by(r) == "sim-b"
        # The configuration said sim-b serves Llama; sim-b says it does not: Llama goes to sim-a
        # only (with the assumption, about half would reach sim-b and get its 404). Distinct
        # prompts, so that prefix affinity does not keep them all on one pod anyway.
        for i in range(20):
            r = envoy.chat(LLAMA, content=f"llama {i}")
            assert r.status_code == 200, r.text
            assert served_by(r) == "sim-a"
        # An adapter nobody has loaded is unknown to the gateway.
        r = envoy.chat("runtime-lora")
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "model_not_found"
        assert "runtime-lora" not in model_ids(envoy)
        # Loaded at run time on sim-a (vLLM's API): routed to sim-a within a few refreshes.
        requests.post(a.url + "/v1/load_lora_adapter",
                      json={"lora_name": "runtime-lora", "lora_path": "/adapters/x"}, timeout=5).raise_for_status()
        wait_model_routes(envoy, "runtime-lora")
        for _ in range(10):
            r = envoy.chat("runtime-lora")
            assert r.status_code == 200, r.text
            assert served_by(r) == "sim-a"
        # The gateway's model list has the configured names first, then the learned ones.
        ids = model_ids(envoy)
        assert ids[:2] == [LLAMA, "sql-lora"], ids
        assert set(ids[2:]) == {QWEN, "runtime-lora"}, ids
        r = requests.get(envoy.url + "/v1/models/runtime-lora", timeout=5)
        assert r.status_code == 200 and r.json()["id"] == "runtime-lora", r.text
        # Unloaded: the gateway stops routing it after the next refresh.
        requests.post(a.url + "/v1/unload_lora_adapter", json={"lora_name": "runtime-lora"},
                      timeout=5).raise_for_status()
        wait_until(lambda: envoy.chat("runtime-lora").status_code == 404, 30, "runtime-lora forgotten",
                   interval=0.2)
        # One info line per change of a pod's list.
        wait_learned(envoy, b, [QWEN])
    finally:
        envoy.stop()


def test_allow_list_routes_only_configured_names_to_the_pods_that_serve_them(sims):
    a, b = sims
    envoy = Envoy(config(a, b, allow_list=True))
    try:
        wait_model_routes(envoy, LLAMA)
        # Learned (the poller logs it): sim-b serves Qwen, not Llama. Wait until that is applied
        # (every Llama request then reaches sim-a: a run of distinct prompts, which would spread
        # over both pods under the configuration's assumption), then check a run of them.
        wait_learned(envoy, b, [QWEN])
        n = 0

        def llama_only_on_sim_a() -> bool:
            nonlocal n
            n += 10
            return all(answered_by(envoy.chat(LLAMA, content=f"wait {n + i}")) == "sim-a" for i in range(10))

        wait_until(llama_only_on_sim_a, 30, "Llama only on sim-a", interval=0.2)
        for i in range(20):
            r = envoy.chat(LLAMA, content=f"llama {i}")
            assert r.status_code == 200 and served_by(r) == "sim-a", r.text
        # Qwen is served by sim-b (learned above) but not in the configuration: refused, and
        # not listed.
        for _ in range(3):
            r = envoy.chat(QWEN)
            assert r.status_code == 404, r.text
            assert r.json()["error"]["code"] == "model_not_found"
        assert QWEN not in model_ids(envoy)
    finally:
        envoy.stop()


def test_without_pod_models_the_configuration_alone_decides(sims):
    a, b = sims
    cfg = config(a, b)
    del cfg["pod_models"]
    envoy = Envoy(cfg)
    try:
        envoy.wait_routable(LLAMA)
        # The poller, which would learn the pods' models had pod_models been set, has run for
        # longer than a learner's refresh (POD_MODELS: 1000 ms): 8 scrapes of each pod at 200 ms.
        for s in (a, b):
            s.wait_scraped(n=8)
        r = envoy.chat(QWEN)
        assert r.status_code == 404, r.text
        assert model_ids(envoy) == [LLAMA, "sql-lora"]
        # The configuration says sim-b serves Llama, so some Llama requests reach it (and get
        # its 404): the mismatch pod_models fixes.
        statuses = {envoy.chat(LLAMA, content=f"question {i}").status_code for i in range(30)}
        assert 404 in statuses, statuses
    finally:
        envoy.stop()


def test_a_pod_without_a_model_list_keeps_the_configured_models_and_is_counted(sims):
    a, b = sims
    cfg = config(a, b, path="/no-model-list-here")
    envoy = Envoy(cfg)
    try:
        # Every fetch gets the simulator's 404: counted, and the assumption stays (Qwen unknown).
        wait_until(lambda: envoy.metric("inference_picker_model_list_failures_total", reason="status") >= 2,
                   30, "model-list failures counted with reason=status")
        r = envoy.chat(QWEN)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        assert model_ids(envoy) == [LLAMA, "sql-lora"]
    finally:
        envoy.stop()


def test_a_weighted_split_can_target_an_adapter_loaded_at_run_time():
    """Rewrites and splits still apply, and with pod_models their target may be a name only the
    pods report: a canary adapter gets its share once it is loaded, and is a 404 before."""
    sim = Sim("canary-host", models=(LLAMA,), loras=("sql-lora",), extra=("--max-lora", "2"))
    cfg = picker_config([{"address": sim.address, "models": [LLAMA]}],
                        models=[{"name": LLAMA, "adapters": ["sql-lora"]}],
                        scheduler={"rewrites": [{
                            "matches": [{"model": {"value": LLAMA}}],
                            "targets": [{"model_rewrite": LLAMA, "weight": 50},
                                        {"model_rewrite": "canary-lora", "weight": 50}]}]})
    cfg["pod_models"] = POD_MODELS
    envoy = Envoy(cfg)
    try:
        wait_until(lambda: envoy.chat(LLAMA).status_code == 200, 30, "the base share routed", interval=0.2)
        # Not loaded: the canary share is refused by the gateway (the pod never sees it).
        codes = [envoy.chat(LLAMA, content=f"before {i}").status_code for i in range(30)]
        assert set(codes) == {200, 404}, codes
        assert "canary-lora" not in sim.stats()["requests_by_model"]
        requests.post(sim.url + "/v1/load_lora_adapter", json={"lora_name": "canary-lora", "lora_path": "/a"},
                      timeout=5).raise_for_status()
        wait_until(lambda: envoy.chat("canary-lora").status_code == 200, 30, "canary learned", interval=0.2)
        sim.reset_stats()
        for i in range(40):
            r = envoy.chat(LLAMA, content=f"after {i}")
            assert r.status_code == 200, r.text
        # The pod saw both models under the client's one name (the body was rewritten).
        by_model = sim.stats()["requests_by_model"]
        assert set(by_model) == {LLAMA, "canary-lora"}, by_model
        assert sum(by_model.values()) == 40, by_model
    finally:
        envoy.stop()
        sim.stop()


def k8s_pod(name: str, ip: str) -> dict:
    """A Ready pod as the Kubernetes API lists it (the fields discovery reads)."""
    return {
        "metadata": {"name": name, "namespace": "llm", "uid": f"uid-{name}", "labels": {"app": "vllm"}},
        "spec": {"containers": [{"name": "vllm", "ports": [{"containerPort": 8000, "protocol": "TCP"}]}]},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                   "conditions": [{"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"}]},
    }


def write_pod_list(path: Path, pods: list) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"kind": "PodList", "apiVersion": "v1",
                               "metadata": {"resourceVersion": str(time.time_ns())}, "items": pods}))
    os.replace(tmp, path)


def test_discovered_pods_serve_what_they_report_not_every_configured_model(tmp_path):
    """Issue 13: with Kubernetes discovery every pod was assumed to serve every configured model.
    With pod_models each discovered pod serves what it reports, and a pod discovered later is
    asked at once."""
    port = free_port()
    ips = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    sims = [Sim("k8s-llama", models=(LLAMA,), host=ips[0], port=port),
            Sim("k8s-qwen-1", models=(QWEN,), host=ips[1], port=port),
            Sim("k8s-qwen-2", models=(QWEN,), host=ips[2], port=port)]
    pods_file = tmp_path / "pods.json"
    write_pod_list(pods_file, [k8s_pod("p0", ips[0]), k8s_pod("p1", ips[1])])
    try:
        with FakeK8sApi(pods_file) as api:
            cfg = picker_config([], models=[{"name": LLAMA}])
            cfg["discovery"] = {"kubernetes": {
                "namespace": "llm", "selector": {"app": "vllm"}, "target_ports": [port],
                "api_cluster": "kubernetes_api", "refresh_ms": 1000, "timeout_ms": 1000}}
            cfg["pod_models"] = POD_MODELS
            envoy = Envoy(cfg, extra_clusters=[static_cluster("kubernetes_api", "127.0.0.1", api.port)],
                          pool_hosts=[s.address for s in sims])
            try:
                # Both pods learnt and scraped (Qwen's routing says nothing about the Llama pod's
                # first scrape, which comes at its own random phase).
                wait_model_routes(envoy, QWEN, timeout=15)
                wait_model_routes(envoy, LLAMA, timeout=15)
                for i in range(20):
                    assert served_by(envoy.chat(LLAMA, content=f"l{i}")) == "k8s-llama"
                    assert served_by(envoy.chat(QWEN, content=f"q{i}")) == "k8s-qwen-1"
                # A third pod appears: asked at once, and Qwen spreads over both Qwen pods.
                write_pod_list(pods_file, [k8s_pod("p0", ips[0]), k8s_pod("p1", ips[1]), k8s_pod("p2", ips[2])])
                wait_until(lambda: "k8s-qwen-2" in {served_by(envoy.chat(QWEN, content=f"n{i}")) for i in range(8)},
                           30, "the new Qwen pod routed", interval=0.2)
                for i in range(20):
                    assert served_by(envoy.chat(LLAMA, content=f"m{i}")) == "k8s-llama"
            finally:
                envoy.stop()
    finally:
        for s in sims:
            s.stop()
