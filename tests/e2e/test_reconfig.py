"""Issue 13, live reconfiguration, in a real Envoy 1.40, in both poller modes: the filter's
configuration is replaced through LDS (a file Envoy watches, as a control plane's update would
arrive); the new endpoint set takes effect, the active version is logged and exported as a
metric, and an invalid update is refused while the old configuration keeps serving."""
from __future__ import annotations

import json

import pytest
import requests

from harness import LdsEnvoy, Sim, endpoint, metric_value, picker_config, wait_until


def fnv1a32(data: bytes) -> int:
    """The configuration version (`crate::live_config::digest`)."""
    h = 0x811C9DC5
    for b in data:
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


def served_by(envoy, i: int) -> str:
    # A new connection per request: the kernel spreads connections over Envoy's workers.
    with requests.Session() as s:
        r = s.post(envoy.url + "/v1/chat/completions", timeout=30,
                   json={"model": "meta-llama/Llama-3.1-8B-Instruct", "max_tokens": 2,
                         "messages": [{"role": "user", "content": f"reconfig {i}"}]})
    assert r.status_code == 200, r.text
    return r.json()["served_by"]


def wait_log(envoy, text: str) -> None:
    # Envoy flushes its log file every few seconds.
    wait_until(lambda: text in envoy.log_path.read_text(), 30, f"log line {text!r}", interval=0.5)


def config_for(sims, mode: str) -> dict:
    poller = {"interval_ms": 100, "timeout_ms": 500, "stale_after_ms": 1000, "mode": mode}
    if mode == "lease":
        poller["lease_ttl_ms"] = 500
    return picker_config([endpoint(s) for s in sims], poller=poller)


@pytest.mark.parametrize("mode", ["singleton", "lease"])
def test_endpoint_change_takes_effect_and_an_invalid_update_is_refused(mode):
    a, b, c = Sim("re-a"), Sim("re-b"), Sim("re-c")
    cfg1 = config_for([a, b], mode)
    envoy = LdsEnvoy(cfg1, concurrency=2, pool_hosts=[a.address, b.address, c.address],
                     singleton=(mode == "singleton"))
    try:
        envoy.wait_routable()
        assert {served_by(envoy, i) for i in range(12)} <= {"re-a", "re-b"}
        assert c.stats()["metrics_scrapes_total"] == 0
        v1 = fnv1a32(json.dumps(cfg1).encode())
        assert envoy.metric("inference_picker_config_version") == v1
        wait_log(envoy, f"configuration version {v1:08x} active")

        # (a, b) -> (b, c).
        cfg2 = config_for([b, c], mode)
        v2 = fnv1a32(json.dumps(cfg2).encode())
        accepted = envoy.lds_counter("update_success")
        envoy.set_picker_config(cfg2)
        wait_until(lambda: envoy.lds_counter("update_success") > accepted, 15, "LDS update accepted")
        # Within a few poll intervals (bounded wait, not a timing assertion): c is scraped and
        # routed to, and a is no longer routed to.
        wait_until(lambda: c.stats()["metrics_scrapes_total"] > 0, 15, "the new endpoint scraped")
        state = {"i": 0, "streak": 0}

        def settled():
            state["i"] += 1
            where = served_by(envoy, 1000 + state["i"])
            state["streak"] = state["streak"] + 1 if where in ("re-b", "re-c") else 0
            return state["streak"] >= 10

        wait_until(settled, 20, "requests only on the new endpoint set", interval=0.05)
        a.reset_stats()
        seen = {served_by(envoy, 2000 + i) for i in range(20)}
        assert seen <= {"re-b", "re-c"} and "re-c" in seen, seen
        assert a.requests_total() == 0
        wait_log(envoy, f"configuration version {v2:08x} active")
        wait_until(lambda: envoy.metric("inference_picker_config_version") == v2, 10, "config version metric")
        if mode == "singleton":
            # The bootstrap singleton followed the filter's configuration.
            wait_log(envoy, f"following the filter's configuration version {v2:08x}")
            wait_until(lambda: envoy.metric("inference_picker_poller_config_version") == v2, 10,
                       "poller config version metric")

        # An invalid update is refused by Envoy (the module's on_configure fails); the old
        # configuration keeps serving.
        rejected = envoy.lds_counter("update_rejected")
        bad = config_for([b, c], mode)
        bad["endpoints"][0]["address"] = "not-an-address"
        envoy.set_picker_config(bad)
        wait_until(lambda: envoy.lds_counter("update_rejected") > rejected, 15, "LDS update rejected")
        wait_log(envoy, "invalid configuration: endpoints[0].address")
        seen = {served_by(envoy, 3000 + i) for i in range(12)}
        assert seen <= {"re-b", "re-c"}, seen
        assert metric_value(envoy.stats_prometheus(), "inference_picker_config_version") == v2
    finally:
        envoy.stop()
        for s in (a, b, c):
            s.stop()


def test_a_key_written_twice_in_a_map_is_refused():
    """A model's weight override given twice: the reader refuses the update (a derived
    deserializer kept the last one silently), and the old configuration keeps serving."""
    a = Sim("dup-a")
    cfg = picker_config([endpoint(a)])
    envoy = LdsEnvoy(cfg, concurrency=1, pool_hosts=[a.address])
    try:
        envoy.wait_routable()
        assert served_by(envoy, 0) == "dup-a"
        model = cfg["models"][0]["name"]
        bad = dict(cfg, scheduler={"model_weights": {"__DUP__": {}}})
        text = json.dumps(bad).replace(
            '"__DUP__": {}', f'"{model}": {{"queue": 1}}, "{model}": {{"queue": 2}}')
        assert text.count(f'"{model}": {{"queue"') == 2
        rejected = envoy.lds_counter("update_rejected")
        envoy.set_picker_config(text)
        wait_until(lambda: envoy.lds_counter("update_rejected") > rejected, 15, "LDS update rejected")
        wait_log(envoy, "duplicate field")
        assert "model_weights" in envoy.log_path.read_text()
        assert {served_by(envoy, 1 + i) for i in range(4)} == {"dup-a"}
    finally:
        envoy.stop()
        a.stop()


def test_a_removed_setting_is_refused_with_why():
    """`peers.load_interval_ms` was removed: an update that still sets it is refused by name and
    reason (not silently ignored, which would leave its user believing the exchange runs), and
    the old configuration keeps serving."""
    a = Sim("rm-a")
    cfg = picker_config([endpoint(a)])
    envoy = LdsEnvoy(cfg, concurrency=1, pool_hosts=[a.address])
    try:
        envoy.wait_routable()
        assert served_by(envoy, 0) == "rm-a"
        peers = {"addresses": ["127.0.0.1:9"], "token": "t" * 32, "interval_ms": 2000}
        # The same peers section without the removed setting is accepted (so the refusal below
        # is the removed setting's, not the section's).
        accepted = envoy.lds_counter("update_success")
        envoy.set_picker_config(json.dumps(dict(cfg, peers=peers)))
        wait_until(lambda: envoy.lds_counter("update_success") > accepted, 15, "LDS update accepted")
        rejected = envoy.lds_counter("update_rejected")
        envoy.set_picker_config(json.dumps(dict(cfg, peers=dict(peers, load_interval_ms=200))))
        wait_until(lambda: envoy.lds_counter("update_rejected") > rejected, 15, "LDS update rejected")
        wait_log(envoy, "peers.load_interval_ms")
        assert "was removed" in envoy.log_path.read_text()
        assert {served_by(envoy, 1 + i) for i in range(4)} == {"rm-a"}
    finally:
        envoy.stop()
        a.stop()
