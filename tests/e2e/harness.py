"""Starts and stops real processes for the end-to-end tests: model-server simulators and Envoy
with the built .wasm. Everything listens on 127.0.0.1 on free ports; every wait is bounded; every
process started is stopped (fixtures call stop(), and an atexit hook catches the rest)."""
from __future__ import annotations

import atexit
import copy
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
import yaml

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "tools") not in sys.path:
    sys.path.insert(0, str(REPO / "tools"))
# The patches of an Envoy document and the free ports, shared with tools/bench-envoy (the tests
# import them from here too).
from envoy_config import (POOL_CLUSTER, dict_nodes, first_hcm, free_port, set_cluster_hosts,  # noqa: E402,F401
                          set_module, set_ports, socket_address)

WASM = Path(os.environ.get("PICKER_WASM", REPO / "target/wasm32-wasip1/release/inference_picker.wasm"))
SIM = Path(os.environ.get("PICKER_SIM", REPO / "target/tools/model-server-sim"))
RATELIMIT = Path(os.environ.get("PICKER_RATELIMIT", REPO / "target/tools/ratelimit-budget"))
ENVOY = Path(os.environ.get("PICKER_ENVOY", REPO / ".venv/bin/envoy"))
ENVOY_YAML = REPO / "envoy" / "envoy.yaml"

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
QWEN = "Qwen/Qwen2.5-7B-Instruct"

_live: list[subprocess.Popen] = []
# What each Envoy stopped during the current test left behind (its warnings and the picker's
# health and scrape series), for conftest.py to show when the test fails: CI output is all
# there is to diagnose a failure that does not repeat.
STOPPED_REPORTS: list[str] = []
LIVE_ENVOYS: list["Envoy"] = []


@atexit.register
def _kill_leftovers() -> None:
    for p in _live:
        if p.poll() is None:
            p.kill()


def _read_line(proc: subprocess.Popen, deadline: float) -> str | None:
    while time.time() < deadline:
        r, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.time()))
        if r:
            line = proc.stdout.readline()
            if not line:
                return None
            return line.decode(errors="replace").strip()
    return None


class Sim:
    """One model-server-sim process."""

    def __init__(self, name: str, models=(LLAMA,), loras=(), engine="vllm", extra=(), host="127.0.0.1", port=0):
        self.name = name
        cmd = [str(SIM), "--host", host, "--port", str(port), "--name", name, "--engine", engine]
        for m in models:
            cmd += ["--model", m]
        for l in loras:
            cmd += ["--lora", l]
        cmd += list(extra)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        _live.append(self.proc)
        deadline = time.time() + 20
        self.port = None
        while time.time() < deadline:
            line = _read_line(self.proc, deadline)
            if line is None:
                break
            if line.startswith("READY "):
                self.port = int(line.split()[1])
                break
        if self.port is None:
            self.stop()
            raise RuntimeError(f"simulator {name} did not start")
        self.address = f"{host}:{self.port}"
        self.url = f"http://{self.address}"

    def stats(self) -> dict:
        return requests.get(self.url + "/sim/stats", timeout=5).json()

    def requests_total(self) -> int:
        return int(self.stats()["requests_total"])

    def fake_load(self, wait: bool = True, **load) -> None:
        """Makes this pod's /metrics report `load` (queue, running, kv, ...; none = its real
        load), and waits (bounded) until the poller has scraped it four more times: the first
        scrape after the change has then been published and read by the workers (each at most
        one poll interval later). A fixed sleep is not enough on a busy 2-core machine.
        `wait=False` only sets it (a test of the poller's own cadence)."""
        before = self.stats()["metrics_scrapes_total"]
        requests.post(self.url + "/sim/fake-load", json=load, timeout=5).raise_for_status()
        if wait:
            self.wait_scraped(since=before)

    def wait_scraped(self, n: int = 4, since: int | None = None, timeout: float = 15) -> None:
        """Waits (bounded) until this pod's /metrics has been scraped `n` more times than
        `since` (default: now): then what it reported at the first of them has been published
        and read by the workers."""
        if since is None:
            since = self.stats()["metrics_scrapes_total"]
        deadline = time.time() + timeout
        while self.stats()["metrics_scrapes_total"] < since + n:
            if time.time() >= deadline:
                raise AssertionError(f"{self.name}: fewer than {n} scrapes in {timeout} s")
            time.sleep(0.05)

    def reset_stats(self) -> None:
        requests.post(self.url + "/sim/reset-stats", timeout=5).raise_for_status()

    def chaos(self, mode: str = "ok", **kw) -> None:
        """Fault injection for inference requests (see the simulator README, "Chaos"):
        `chaos("status", status=500)`, `chaos("reset")`, `chaos("hang")`,
        `chaos("stream_cut", after_chunks=2)`, `chaos("ok")`; `count=N` limits it to the next N
        requests. A pod that refuses connections is `stop()`; one whose /metrics lies is
        `fake_load()`."""
        requests.post(self.url + "/sim/chaos", json={"mode": mode, **kw}, timeout=5).raise_for_status()

    def chaos_total(self) -> int:
        return int(self.stats()["chaos_total"])

    def hold(self, count: int | None = None) -> None:
        """Parks inference requests at this pod as they arrive, before its engine sees them:
        the next `count` ones, or (default) every one until `release()`. A parked request counts
        in `held()`, and in /metrics as the engine would schedule it (running while its batch has
        room, then waiting: a gateway fills the pod as it would a real one; see the simulator
        README, "Hold"). Lets a test decide when a pod serves instead of guessing how long it
        takes."""
        body = {} if count is None else {"count": count}
        requests.post(self.url + "/sim/hold", json=body, timeout=5).raise_for_status()

    def release(self, n: int | None = None) -> list[dict]:
        """Lets the `n` oldest parked requests go, in arrival order (an error when fewer are
        parked), or (default) every one of them, and stops holding. Returns their arrivals
        (`{"seq", "content", "request_id", "held"}`). Requests released together reach the
        engine in no set order: release one at a time when that order matters."""
        body = {} if n is None else {"n": n}
        r = requests.post(self.url + "/sim/release", json=body, timeout=5)
        r.raise_for_status()
        return r.json()["released"]

    def held(self) -> int:
        """Inference requests parked here now (`hold()`)."""
        return int(self.stats()["held"])

    def wait_held(self, n: int, timeout: float = 30) -> None:
        """Waits (bounded) until exactly `n` requests are parked here."""
        wait_until(lambda: self.held() == n, timeout, f"{self.name}: {n} request(s) held")

    def arrivals(self) -> list:
        """The prompt text (a chat request's last message) of the last inference requests that
        reached this pod, oldest first (parked or not; since the last `reset_stats()`)."""
        return [a["content"] for a in self.stats()["arrivals"]]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)

    kill = stop

    def crash(self) -> None:
        """SIGKILL: the pod dies at once, with its requests in flight and its connections open
        (stop() is a graceful SIGTERM that lets running requests finish)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)


class RateLimitService:
    """One tools/ratelimit-budget process: an Envoy rate limit service with a token budget per
    descriptor entry (`budgets`: `"KEY=VALUE:TOKENS"` each). Every ShouldRateLimit call it answers
    is kept, in arrival order, as the JSON record it prints (`calls()`)."""

    def __init__(self, budgets=()):
        cmd = [str(RATELIMIT), "--port", "0"]
        for b in budgets:
            cmd += ["--budget", b]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        _live.append(self.proc)
        line = _read_line(self.proc, time.time() + 20)
        if not line or not line.startswith("READY "):
            self.stop()
            raise RuntimeError(f"ratelimit-budget did not start: {line!r}")
        self.port = int(line.split()[1])
        self._calls: list[dict] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            with self._lock:
                self._calls.append(json.loads(raw))

    def calls(self) -> list[dict]:
        with self._lock:
            return list(self._calls)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def endpoint(sim: Sim, *models: str) -> dict:
    return {"address": sim.address, "models": list(models) or [LLAMA]}


def _served_models(endpoints: list[dict]) -> list[dict]:
    served = {m for e in endpoints for m in e["models"]}
    models = []
    if LLAMA in served:
        models.append({"name": LLAMA, "adapters": ["sql-lora"]})
    if QWEN in served:
        models.append({"name": QWEN})
    return models


def picker_config(endpoints: list[dict], models: list[dict] | None = None, **sections) -> dict:
    cfg = {
        "version": 1,
        "endpoints": endpoints,
        "models": models or _served_models(endpoints),
        # Fixed 200 ms polling (no idle back-off): tests that change a pod's load with
        # fake_load() expect to see it within a few polls. test_poller_cadence.py tests the
        # shipped adaptive cadence.
        "poller": {"interval_ms": 200, "idle_interval_ms": 200, "timeout_ms": 500, "stale_after_ms": 1000},
    }
    for k, v in sections.items():
        cfg[k] = v
    return cfg


class Envoy:
    """Envoy running envoy/envoy.yaml with its ports, .wasm path and plugin configuration
    replaced."""

    def __init__(self, config: dict, concurrency: int = 2, base_yaml: Path = ENVOY_YAML,
                 singleton: bool = True, extra_clusters: list | None = None,
                 front_filters: list[dict] | None = None, pool_hosts: list[str] | None = None,
                 retry_policy: dict | None = None, port: int | None = None,
                 wasm: Path | None = None, mutate=None):
        # `port`: a listener port chosen by the caller (free_port()), e.g. for gateways that
        # must know each other's address before either starts. `wasm`: another build of the
        # module (e.g. the crash-test build). `mutate(doc)`: a last change to the rendered
        # bootstrap (e.g. the listener's connection balancing).
        self.port = port or free_port()
        self.admin_port = free_port()
        self.config = config
        LIVE_ENVOYS.append(self)
        self.tmp = tempfile.TemporaryDirectory(prefix="picker-envoy-")
        doc = yaml.safe_load(base_yaml.read_text())
        doc = render(doc, config, self.port, self.admin_port, front_filters or [], pool_hosts, retry_policy,
                     wasm=wasm)
        if mutate:
            mutate(doc)
        if not singleton:
            # Lease mode: no bootstrap extension; the filter's roots elect the poller.
            doc.pop("bootstrap_extensions", None)
        doc["static_resources"]["clusters"].extend(extra_clusters or [])
        path = Path(self.tmp.name) / "envoy.yaml"
        path.write_text(yaml.safe_dump(doc))
        self.log_path = Path(self.tmp.name) / "envoy.log"
        self.proc = subprocess.Popen(
            [str(ENVOY), "-c", str(path), "--concurrency", str(concurrency), "--use-dynamic-base-id",
             "-l", "info", "--log-path", str(self.log_path), "--disable-hot-restart"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        _live.append(self.proc)
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        deadline = time.time() + 30
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("envoy exited:\n" + self.log())
            try:
                if requests.get(self.admin + "/ready", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.1)
        else:
            self.stop()
            raise RuntimeError("envoy did not become ready:\n" + self.log())

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-5000:]
        except OSError:
            return ""

    def chat(self, model: str = LLAMA, content: str = "Hello", headers: dict | None = None,
             timeout: float = 30, **extra) -> requests.Response:
        body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
        body.update(extra)
        return requests.post(self.url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=timeout)

    def wait_routable(self, model: str = LLAMA, timeout: float = 15, ready: int | None = None) -> None:
        """Waits (bounded) until a request routes and the poller has published a snapshot in
        which `ready` endpoints (default: every configured one) answered their last scrape
        (`inference_picker_ready_endpoints`). One routable pod is not enough for a test that
        compares pods: the others' first scrapes come at random phases. A test with a pod that
        is down on purpose passes the number expected to be up."""
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            last = self.chat(model)
            if last.status_code == 200:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"no route for {model}: {last.status_code if last else None} "
                                 f"{last.text if last else ''}\n{self.log()}")
        if ready is None:
            # Multi-pool configurations label the gauge per pool; they wait per model above.
            # (Subclasses that render their own configuration have no `config`.)
            cfg = getattr(self, "config", None) or {}
            if cfg.get("pool") or "endpoints" not in cfg:
                return
            ready = len(cfg["endpoints"])
        seen = None
        while time.time() < deadline:
            seen = self.metric("inference_picker_ready_endpoints")
            if seen >= ready:
                return
            time.sleep(0.05)
        raise AssertionError(f"{seen} of {ready} endpoints ready after {timeout} s\n{self.log()}")

    def stats_prometheus(self) -> str:
        return requests.get(self.admin + "/stats/prometheus", timeout=5).text

    def metric(self, name: str, **labels) -> float:
        """The value of one Prometheus series (0 when absent), matched on the given labels."""
        return metric_value(self.stats_prometheus(), name, **labels)

    def _report(self) -> str:
        lines = []
        if self.proc.poll() is None:
            try:
                lines += [l for l in self.stats_prometheus().splitlines()
                          if l.startswith(("inference_picker_scrape_failures", "inference_picker_ready",
                                           "inference_picker_health", "inference_picker_rejections",
                                           "inference_picker_flow_requests"))]
            except requests.RequestException as e:
                lines.append(f"(stats unavailable: {e})")
        try:
            log = self.log_path.read_text().splitlines()
        except OSError:
            log = []
        lines += [l for l in log if "][warning]" in l or "][error]" in l or "][critical]" in l][-40:]
        return "\n".join(lines)

    def stop(self) -> None:
        if self in LIVE_ENVOYS:
            LIVE_ENVOYS.remove(self)
            STOPPED_REPORTS.append(self._report())
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.tmp.cleanup()


def stop_each(*things) -> None:
    """Stops every Envoy, Sim or other `.stop()`-able given, in order; None entries (never
    started) are skipped and lists or tuples are walked."""
    for t in things:
        if t is None:
            continue
        if isinstance(t, (list, tuple)):
            stop_each(*t)
        else:
            t.stop()


def metric_value(text: str, name: str, **labels) -> float:
    """Finds `name{...}` in Prometheus text whose labels include `labels`; 0 when absent."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        base, _, rest = series.partition("{")
        if base != name:
            continue
        have = rest.rstrip("}").split(",") if rest else []
        if all(w in have for w in want):
            return float(value)
    return 0.0


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    """Polls `predicate` until it returns a truthy value (returned), or fails after `timeout`."""
    deadline = time.time() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.time() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def wait_until_shown(predicate, timeout: float, what: str, show, interval: float = 0.05):
    """`wait_until`, and on timeout the message also gives `show()`: the state last seen (a
    message built before the wait would only show the state at its start)."""
    try:
        return wait_until(predicate, timeout, what, interval)
    except AssertionError as e:
        raise AssertionError(f"{e}; last seen: {show()}") from None


def render(doc: dict, config: dict, port: int, admin_port: int, front_filters: list[dict] = (),
           pool_hosts: list[str] | None = None, retry_policy: dict | None = None,
           wasm: Path | None = None) -> dict:
    """Applies ports, the absolute .wasm path and the plugin configuration to a parsed
    envoy.yaml (the same structure `make run` uses). `front_filters` are HTTP filters inserted
    before the inference-picker filter (for example one that sets a trusted header).

    The members of the inference cluster (STATIC, override_host) become the module config's
    endpoints, or `pool_hosts` when given (e.g. every pod a headless Service would list, when the
    module discovers pods itself). `retry_policy` entries replace those of the route's retry
    policy (e.g. a short `per_try_idle_timeout` for a hung-pod test)."""
    doc = copy.deepcopy(doc)
    set_ports(doc, port, admin_port)
    hcm = first_hcm(doc)
    if front_filters:
        hcm["http_filters"] = list(front_filters) + hcm["http_filters"]
    hosts = pool_hosts if pool_hosts is not None else [e["address"] for e in config.get("endpoints", [])]
    set_cluster_hosts(doc, POOL_CLUSTER, hosts)
    if retry_policy:
        for vh in hcm["route_config"]["virtual_hosts"]:
            for r in vh["routes"]:
                if r.get("route", {}).get("cluster") == POOL_CLUSTER:
                    r["route"].setdefault("retry_policy", {}).update(retry_policy)
    set_module(doc, wasm or WASM, json.dumps(config))
    return doc


def static_cluster(name: str, host: str, port: int) -> dict:
    """A plain STATIC cluster, e.g. for the fake Kubernetes API."""
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}]}]},
    }


def rss_kib(pid: int) -> int:
    """Resident set size of a process, from /proc/<pid>/status (VmRSS, in KiB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


class LdsEnvoy(Envoy):
    """Envoy whose listener comes from an LDS file (a path config source) instead of
    static_resources, so that a test can replace the listener, and with it the filter's VM,
    while requests are in flight: `replace_listener(mutate)` applies `mutate` to the listener
    dict and moves the new file into place (Envoy watches the file). The old listener drains for
    `drain_s` seconds (`--drain-time-s`), then Envoy closes its connections."""

    def __init__(self, config: dict, concurrency: int = 1, drain_s: int = 1,
                 pool_hosts: list[str] | None = None, singleton: bool = True):
        self.port = free_port()
        self.admin_port = free_port()
        self.tmp = tempfile.TemporaryDirectory(prefix="picker-envoy-lds-")
        self.lds_path = Path(self.tmp.name) / "lds.yaml"
        self._version = 0
        doc = render(yaml.safe_load(ENVOY_YAML.read_text()), config, self.port, self.admin_port,
                     pool_hosts=pool_hosts)
        if not singleton:
            # Lease mode: no bootstrap extension; the filter's roots elect the poller.
            doc.pop("bootstrap_extensions", None)
        self.listener = doc["static_resources"].pop("listeners")[0]
        doc["dynamic_resources"] = {"lds_config": {"resource_api_version": "V3",
                                                   "path_config_source": {"path": str(self.lds_path)}}}
        doc["node"] = {"id": "picker-test", "cluster": "picker-test"}
        self._write_listener()
        path = Path(self.tmp.name) / "envoy.yaml"
        path.write_text(yaml.safe_dump(doc))
        self.log_path = Path(self.tmp.name) / "envoy.log"
        self.proc = subprocess.Popen(
            [str(ENVOY), "-c", str(path), "--concurrency", str(concurrency), "--use-dynamic-base-id",
             "-l", "info", "--log-path", str(self.log_path), "--disable-hot-restart",
             "--drain-time-s", str(drain_s), "--drain-strategy", "immediate"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        _live.append(self.proc)
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        try:
            wait_until(lambda: self.proc.poll() is not None or self._ready(), 30, "envoy ready")
            if self.proc.poll() is not None:
                raise RuntimeError("envoy exited:\n" + self.log())
        except AssertionError:
            self.stop()
            raise

    def _ready(self) -> bool:
        try:
            return requests.get(self.admin + "/ready", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def _write_listener(self) -> None:
        self._version += 1
        resource = dict(self.listener)
        resource["@type"] = "type.googleapis.com/envoy.config.listener.v3.Listener"
        tmp = self.lds_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump({"version_info": str(self._version), "resources": [resource]}))
        tmp.rename(self.lds_path)

    def replace_listener(self, mutate) -> None:
        mutate(self.listener)
        self._write_listener()

    def set_picker_config(self, config: dict | str) -> None:
        """Replaces the listener with one whose filter has `config` (the module reconfigured
        through LDS, as an ECDS or control-plane update would); a `str` is sent as written (a
        document JSON cannot produce from a dict, e.g. with a key twice)."""
        value = config if isinstance(config, str) else json.dumps(config)

        def mutate(listener):
            hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
            for f in hcm["http_filters"]:
                plugin = f.get("typed_config", {}).get("config", {})
                if "configuration" in plugin:
                    plugin["configuration"]["value"] = value
        self.replace_listener(mutate)

    def lds_counter(self, name: str) -> int:
        """A `listener_manager.lds.*` counter (`update_success`, `update_rejected`)."""
        for line in requests.get(self.admin + "/stats", timeout=5).text.splitlines():
            if line.startswith(f"listener_manager.lds.{name}:"):
                return int(line.split(":")[1])
        return 0

    def lds_updates(self) -> int:
        """Listener updates Envoy accepted (`listener_manager.lds.update_success`)."""
        for line in requests.get(self.admin + "/stats", timeout=5).text.splitlines():
            if line.startswith("listener_manager.lds.update_success:"):
                return int(line.split(":")[1])
        return 0
