#!/usr/bin/env python3
"""`make bench-envoy`: what inference-picker costs inside Envoy, side by side with plain Envoy and
a pass-through wasm filter (issue #12 item 1), and what its poller costs at idle (issue #19).

Processes (all on loopback, ports free-picked, every wait bounded, everything stopped at the end):
- fake pods: one Envoy (`direct_response`) listening on N addresses 127.88.x.y:P (one listener with
  `additional_addresses`), answering chat requests with a small completion and `/metrics` with a
  realistic vLLM V1 body;
- three front Envoys with one worker each (`--concurrency 1`), side by side:
  plain (router, round robin over the N pods), pass (the pass-through wasm filter, then the same
  router) and module (envoy/envoy.yaml with the release .wasm and the shipped defaults: only
  `version`, `endpoints` and `models` are set);
- two more fronts, extproc-rr and extproc-sched: the plain front plus Envoy's ext_proc filter
  (request headers SEND, request body BUFFERED, response SKIP/NONE) over gRPC to an endpoint-picker
  process (tools/ext-proc-epp, one per front: round robin, or the crate's Scheduler), which sets
  x-gateway-destination-endpoint for the shipped override_host cluster;
- wrk (one thread, a Lua script that varies the body for "new prompt") against one front at a time.

Per-request CPU is the front Envoy's utime+stime from /proc/<pid>/stat over the run, divided by the
requests wrk completed (and the same for the worker thread alone, /proc/<pid>/task/<tid>/stat);
for an ext_proc front also the EPP process's, and all-in = front + EPP.
Idle CPU is the process's CPU time over a window with no traffic, from the sum of its threads'
/proc/<pid>/task/<tid>/schedstat (nanoseconds; the 10 ms ticks of /proc/<pid>/stat are too coarse
for a few ms per second), module beside plain; per scrape = (module - plain) / scrapes, counting
scrapes at the fake pods.

Writes <out>/report.md and <out>/results.json, prints the report and one line per case:
  ENVOY_COST endpoints=<n> body=<bytes> module_vs_pass_us=<x> module_vs_plain_us=<x> prompt=<hit|new> ...
  EXTPROC_COST endpoints=<n> body=<bytes> floor_allin_us=<x> sched_allin_us=<x> module_allin_us=<x> prompt=<hit|new> ...
  POLLER_COST endpoints=<n> idle_cpu_ms_per_s=<x> per_scrape_us=<x> ...
"""
from __future__ import annotations

import argparse
import atexit
import copy
import datetime as dt
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
if str(REPO / "tools") not in sys.path:
    sys.path.insert(0, str(REPO / "tools"))
# The Envoy-document patches and free ports of the e2e harness (tools/envoy_config.py).
from envoy_config import POOL_CLUSTER, first_hcm, free_port, set_cluster_hosts, set_module, set_ports  # noqa: E402
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
# Constructed vLLM V1 0.33 dump (27 KB, two engines, LoRA): see tests/fixtures/metrics/README.md.
METRICS_CLUSTER = "inference_pool_metrics"  # the poller's cluster in envoy/envoy.yaml
METRICS_FIXTURE = REPO / "tests/fixtures/metrics/vllm_v1_0.33_dp2_lora_constructed.prom"
MARK = "QQQQBENCHMARKQQQ"  # 16 letters: no Lua pattern characters
VARIANTS = ("plain", "pass", "parse", "module", "extproc-rr", "extproc-sched")
# The ext_proc fronts: the `plain` front with Envoy's ext_proc filter talking over gRPC to an
# endpoint-picker process (tools/ext-proc-epp) in this mode: `rr`, the architecture's floor
# (read `model`, round robin), or `scheduler`, inference-picker's own Scheduler as an EPP.
EXTPROC = {"extproc-rr": "rr", "extproc-sched": "scheduler"}
EPP_CLUSTER = "ext_proc_epp"  # the fronts' gRPC cluster to the EPP process
# Fronts whose runs come in two prompts (prefix hit, new prompt): the ones that look at it.
PROMPTED = ("module", "extproc-sched")
# Top-level sections added to the module's configuration (--module-extra), e.g. body-based
# routing: {"pool": {"name": "bench", "route_by_model": true}}.
MODULE_EXTRA: dict = {}
# `--observability`: every front keeps the shipped access log and tracer.
OBSERVABILITY = False
# Scrapes per second of the poll-floor fronts (`--floor-rate`; 0: none).
FLOOR_RATE: list[float] = [200.0]
FLOORS = ("floor-headers", "floor-body")
CHAT_RESPONSE = json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": LLAMA,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
})
# Prose for the prompt filler (any text would do; this keeps the JSON realistic, not one repeated byte).
PROSE = ("The gateway routes each chat request to the model server that can answer it soonest, "
         "weighing its queue, its free KV cache and the prompt prefix it has already computed. ")

_live: list[subprocess.Popen] = []


def _stop_all() -> None:
    for p in reversed(_live):
        stop_process(p)


atexit.register(_stop_all)


def stop_process(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


# ---------------------------------------------------------------------------------------------
# Pure helpers (unit-tested in test_bench_envoy.py)


def pod_addresses(n: int) -> list[str]:
    """N distinct loopback addresses 127.88.a.b (b in 2..251: never .0, .1 or .255)."""
    return [f"127.88.{i // 250}.{i % 250 + 2}" for i in range(n)]


def chat_body_template(size: int) -> str:
    """A chat completion request of exactly `size` bytes whose first message starts with MARK."""
    head = json.dumps({"model": LLAMA, "max_tokens": 16, "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": MARK + " "}]})
    # head ends with `..."}]}`; the filler goes inside the last content string.
    prefix, suffix = head[: -len('"}]}')], '"}]}'
    room = size - len(prefix) - len(suffix)
    if room < 0:
        raise ValueError(f"body size {size} is smaller than the smallest chat body ({len(head)})")
    filler = (PROSE * (room // len(PROSE) + 1))[:room]
    body = prefix + filler + suffix
    assert len(body.encode()) == size
    return body


def wrk_script(template: str, new_prompt: bool) -> str:
    """The Lua script wrk runs: globals for this case, then tools/bench-envoy/wrk_chat.lua."""
    lua_long = "[==[" + template + "]==]"
    return (f"BODY_TEMPLATE = {lua_long}\nMARK = \"{MARK}\"\n"
            f"NEW_PROMPT = {'true' if new_prompt else 'false'}\n"
            + (HERE / "wrk_chat.lua").read_text())


def parse_wrk(stdout: str) -> dict:
    """The BENCH_RESULT line the Lua `done` prints, as ints, plus `statuses`: the answers other
    than 200 by status, "503:12,429:3" ("" when there were none)."""
    result, statuses = None, ""
    for line in stdout.splitlines():
        if line.startswith("BENCH_RESULT "):
            result = {k: int(v) for k, v in (kv.split("=", 1) for kv in line.split()[1:])}
        elif line.startswith("BENCH_STATUSES"):
            statuses = line[len("BENCH_STATUSES"):].strip()
    if result is None:
        raise RuntimeError("wrk printed no BENCH_RESULT line:\n" + stdout[-2000:])
    result["statuses"] = statuses
    return result


def merge_statuses(parts: list[str]) -> str:
    """Sums "503:12,429:3"-style counts."""
    total: dict[int, int] = {}
    for part in parts:
        for item in filter(None, part.split(",")):
            status, _, n = item.partition(":")
            total[int(status)] = total.get(int(status), 0) + int(n)
    return ",".join(f"{s}:{n}" for s, n in sorted(total.items()))


def stat_cpu_ticks(stat_text: str) -> int:
    """utime + stime (clock ticks) from a /proc/<pid>/stat or /proc/<pid>/task/<tid>/stat line.
    The command name (field 2) may contain spaces and parentheses, so split after its last ')'."""
    rest = stat_text[stat_text.rindex(")") + 2:].split()
    # rest[0] is field 3 (state); utime and stime are fields 14 and 15.
    return int(rest[11]) + int(rest[12])


def healthy_metrics(text: str) -> str:
    """The fixture with every `vllm:num_requests_waiting` series set to 0: the pods look busy but
    not saturated (KV 0.44), so the module takes its ordinary path on every request."""
    return re.sub(r"^(vllm:num_requests_waiting\{[^}]*\}) \S+$", r"\1 0.0", text, flags=re.M)


def front_did_its_job(variant: str, headers: dict, body_len: int, pod_addrs: set[str]) -> bool:
    """What the pods echoed for one request through a front: the pass-through filter read the
    whole body (and only it sets that header); the module named one of the pods first; plain
    Envoy added neither."""
    seen_len = headers.get("x-bench-body-bytes", "")
    dest = headers.get("x-bench-destination", "")
    if variant in ("pass", "parse"):  # `parse` sets 0 for a body that is not JSON
        return seen_len == str(body_len) and not dest
    if variant == "module" or variant in EXTPROC:
        # The module, and the EPP through ext_proc, named a pod in the destination header.
        return dest.split(",")[0] in pod_addrs and not seen_len
    return not seen_len and not dest


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def fmt(x: float, nd: int = 1) -> str:
    return "n/a" if x != x else f"{x:.{nd}f}"


# ---------------------------------------------------------------------------------------------
# Envoy configurations


def hcm(stat_prefix: str, route_config: dict, http_filters: list[dict]) -> dict:
    return {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": stat_prefix, "route_config": route_config, "http_filters": http_filters,
        },
    }


ROUTER = {"name": "envoy.filters.http.router", "typed_config": {
    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}


def sock(address: str, port: int) -> dict:
    return {"socket_address": {"address": address, "port_value": port}}


def pods_config(addresses: list[str], port: int, admin_port: int, metrics_file: Path) -> dict:
    text_plain = [{"header": {"key": "content-type", "value": "text/plain; version=0.0.4"}}]
    # The pods echo what the fronts added, so the driver can check each front does its job
    # (the pass-through filter read the whole body; the module chose a pod) before measuring.
    json_ct = [{"header": {"key": "content-type", "value": "application/json"}},
               {"header": {"key": "x-bench-body-bytes", "value": "%REQ(x-passthrough-body-bytes)%"}},
               {"header": {"key": "x-bench-destination", "value": "%REQ(x-gateway-destination-endpoint)%"}}]
    route_config = {
        "name": "pods",
        "max_direct_response_body_size_bytes": 1048576,  # the default (4 KiB) is below /metrics
        "virtual_hosts": [{"name": "pods", "domains": ["*"], "routes": [
            {"match": {"path": "/metrics"}, "response_headers_to_add": text_plain,
             "direct_response": {"status": 200, "body": {"filename": str(metrics_file)}}},
            {"match": {"prefix": "/"}, "response_headers_to_add": json_ct,
             "direct_response": {"status": 200, "body": {"inline_string": CHAT_RESPONSE}}},
        ]}],
    }
    return {
        "admin": {"address": sock("127.0.0.1", admin_port)},
        "static_resources": {"listeners": [{
            "name": "pods",
            "address": sock(addresses[0], port),
            "additional_addresses": [{"address": sock(a, port)} for a in addresses[1:]],
            "per_connection_buffer_limit_bytes": 16777216,
            "filter_chains": [{"filters": [hcm("pods", route_config, [ROUTER])]}],
        }]},
    }


def passthrough_filter(name: str, wasm: Path, plugin: str | None = None) -> dict:
    """The pass-through wasm as an HTTP filter (VM `name`), with `plugin` as its configuration
    (`parse`, `poll ...`; none: pass-through only)."""
    config = {
        "name": name, "root_id": "passthrough",
        "vm_config": {"vm_id": name, "runtime": "envoy.wasm.runtime.v8",
                      "code": {"local": {"filename": str(wasm)}}},
        "allow_on_headers_stop_iteration": True,
        "failure_policy": "FAIL_CLOSED",
    }
    if plugin is not None:
        config["configuration"] = {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": plugin}
    return {"name": "envoy.filters.http.wasm", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm", "config": config}}


def ext_proc_filter() -> dict:
    """Envoy's ext_proc filter as the Gateway API Inference Extension configures it for its
    endpoint picker: a gRPC service on an Envoy cluster, the request's headers sent, its body
    buffered and sent whole, nothing of the response. It fails closed (no answer: no request)."""
    return {"name": "envoy.filters.http.ext_proc", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": EPP_CLUSTER}, "timeout": "10s"},
        "failure_mode_allow": False,
        # The default (200 ms) would fail requests on a loaded 2-core machine; errors show anyway.
        "message_timeout": "10s",
        "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SKIP",
                            "request_body_mode": "BUFFERED", "response_body_mode": "NONE",
                            "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"}}}


def epp_cluster(epp_port: int) -> dict:
    """The EPP process on loopback, spoken to over HTTP/2 (gRPC)."""
    return {"name": EPP_CLUSTER, "type": "STATIC", "connect_timeout": "1s",
            "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}},
            "load_assignment": {"cluster_name": EPP_CLUSTER, "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": sock("127.0.0.1", epp_port)}}]}]}}


def epp_command(binary: Path, mode: str, port: int, pods: list[str], metrics_file: Path) -> list[str]:
    """The EPP process's command line (tools/ext-proc-epp)."""
    return [str(binary), "--port", str(port), "--mode", mode, "--endpoints", ",".join(pods),
            "--metrics", str(metrics_file), "--model", LLAMA]


def front_config(variant: str, base: dict, addresses: list[str], pod_port: int, port: int,
                 admin_port: int, module_wasm: Path, pass_wasm: Path, epp_port: int | None = None) -> dict:
    """`module`: envoy/envoy.yaml as shipped, with ports, the .wasm path and a default-only
    configuration for these pods. `plain` and `pass`: the same listener and HCM, with the router
    on a round-robin STATIC cluster of the pods, and for `pass` the pass-through filter first."""
    doc = copy.deepcopy(base)
    set_ports(doc, port, admin_port)
    hcm_cfg = first_hcm(doc)
    # The shipped access log and tracer are Envoy's own work, the same for every front: left
    # out of all of them, so the fronts differ only in their filters. The module front still
    # sets its decision in filter state (`filter.decision_state`), as shipped.
    # `--observability` keeps both in every front (the access log written to /dev/null, the
    # spans exported to a collector that is not there), to measure what they cost.
    if OBSERVABILITY:
        for entry in hcm_cfg.get("access_log", []):
            entry["typed_config"]["path"] = "/dev/null"
    else:
        hcm_cfg.pop("access_log", None)
        hcm_cfg.pop("tracing", None)
    # Every front uses the shipped route (retry policy included) and the shipped pool cluster
    # (STATIC, override_host), listing these pods: only the filters differ. The shipped cluster
    # routes only to addresses its members list in x-gateway-destination-endpoint; `plain` and
    # `pass` send no such header, so their override_host falls back to round robin over the pods.
    pods = [f"{a}:{pod_port}" for a in addresses]
    set_cluster_hosts(doc, POOL_CLUSTER, pods)
    if variant == "module":
        set_module(doc, module_wasm, json.dumps({
            "version": 1, "endpoints": [{"address": p, "models": [LLAMA]} for p in pods],
            "models": [{"name": LLAMA}], **MODULE_EXTRA}))
        return doc
    if variant in EXTPROC:
        # The `plain` front plus the ext_proc filter. The pool cluster stays as shipped
        # (override_host, NO_FALLBACK): a request the EPP named no pod for finds no host (503),
        # so every 200 was routed by the EPP's header.
        doc.pop("bootstrap_extensions", None)
        if epp_port is None:
            raise ValueError(f"{variant} needs epp_port")
        doc["static_resources"]["clusters"].append(epp_cluster(epp_port))
        hcm_cfg["http_filters"] = [ext_proc_filter(), ROUTER]
        return doc
    for cluster in doc["static_resources"]["clusters"]:
        if cluster["name"] == POOL_CLUSTER and "load_assignment" in cluster:
            policy = cluster["load_balancing_policy"]["policies"][0]["typed_extension_config"]
            policy["typed_config"]["fallback_policy"] = {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.round_robin",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies"
                                          ".round_robin.v3.RoundRobin"}}}]}
    doc.pop("bootstrap_extensions", None)
    filters = [ROUTER]
    if variant.startswith("floor-"):
        # The poll floor (issue #19): the pass-through filter, whose root context scrapes the pods
        # through the shipped metrics cluster at FLOOR_RATE and reads the response's headers only
        # or its body too. Nothing routes through it; only its idle CPU is measured.
        what = variant.removeprefix("floor-")
        plugin = f"poll {FLOOR_RATE[0]:g} {what} {METRICS_CLUSTER} /metrics " + " ".join(
            f"{a}:{pod_port}" for a in addresses)
        filters = [passthrough_filter("floor", pass_wasm, plugin), ROUTER]
    elif variant == "pass":
        filters = [passthrough_filter("passthrough", pass_wasm), ROUTER]
    elif variant == "parse":
        # The same filter also checks the body is JSON (the parse floor of issue #12).
        filters = [passthrough_filter("passthrough", pass_wasm, "parse"), ROUTER]
    hcm_cfg["http_filters"] = filters
    return doc


# ---------------------------------------------------------------------------------------------
# Processes


def port_free_on_all(addresses: list[str], port: int) -> bool:
    for a in addresses:
        with socket.socket() as s:
            try:
                s.bind((a, port))
            except OSError:
                return False
    return True


def http(method: str, url: str, body: bytes | None = None, timeout: float = 5) -> tuple[int, bytes, dict]:
    """(status, body, lower-cased headers); status 0 when there is no answer."""
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"content-type": "application/json"} if body else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read(), {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, e.read(), {}
    except (urllib.error.URLError, OSError):
        return 0, b"", {}


class Envoy:
    def __init__(self, name: str, envoy: Path, doc: dict, workdir: Path, concurrency: int,
                 admin_port: int, port: int | None = None):
        self.name = name
        self.cfg = workdir / f"{name}.yaml"
        self.cfg.write_text(yaml.safe_dump(doc))
        self.log_path = workdir / f"{name}.log"
        self.admin = f"http://127.0.0.1:{admin_port}"
        self.url = f"http://127.0.0.1:{port}" if port else None
        self.proc = subprocess.Popen(
            [str(envoy), "-c", str(self.cfg), "--concurrency", str(concurrency), "--use-dynamic-base-id",
             "--disable-hot-restart", "-l", "warn", "--log-path", str(self.log_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _live.append(self.proc)
        self.pid = self.proc.pid

    def wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} Envoy exited ({self.proc.returncode}):\n{self.log()}")
            if http("GET", self.admin + "/ready", timeout=1)[0] == 200:
                return
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} Envoy not ready after {timeout} s:\n{self.log()}")

    def wait_routable(self, body: bytes, timeout: float, check) -> None:
        """Until one chat request answers 200 (for the module: the poller has published), then
        `check(headers)` must hold: the front did its job (see `front_did_its_job`)."""
        deadline = time.time() + timeout
        last = (0, b"", {})
        while time.time() < deadline:
            last = http("POST", self.url + "/v1/chat/completions", body, timeout=5)
            if last[0] == 200:
                if not check(last[2]):
                    raise RuntimeError(f"{self.name}: answered 200 but did not do its job: {last[2]}")
                return
            time.sleep(0.2)
        raise RuntimeError(f"{self.name}: no 200 after {timeout} s (last {last[0]} {last[1][:300]!r}):\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-4000:]
        except OSError:
            return ""

    def counter(self, name: str) -> int:
        status, text, _ = http("GET", f"{self.admin}/stats?filter=" + urllib.parse.quote(f"^{re.escape(name)}$"), timeout=5)
        for line in text.decode(errors="replace").splitlines():
            k, _, v = line.partition(": ")
            if k == name:
                return int(v)
        raise RuntimeError(f"{self.name}: no stat {name} (HTTP {status})")

    def cpu_ticks(self) -> int:
        return stat_cpu_ticks(Path(f"/proc/{self.pid}/stat").read_text())

    def worker_tid(self) -> int | None:
        for t in Path(f"/proc/{self.pid}/task").iterdir():
            try:
                if (t / "comm").read_text().strip() == "wrk:worker_0":
                    return int(t.name)
            except OSError:
                continue
        return None

    def thread_ticks(self, tid: int) -> int:
        return stat_cpu_ticks(Path(f"/proc/{self.pid}/task/{tid}/stat").read_text())

    def cpu_ns(self) -> int:
        """Sum over the process's threads of the CPU time in /proc/.../schedstat (ns)."""
        total = 0
        for t in Path(f"/proc/{self.pid}/task").iterdir():
            try:
                total += int((t / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
        return total

    def stop(self) -> None:
        stop_process(self.proc)


class Epp:
    """One ext-proc-epp process (tools/ext-proc-epp) on a free-picked loopback port."""

    def __init__(self, name: str, binary: Path, mode: str, pods: list[str], metrics_file: Path, workdir: Path):
        self.name = name
        self.port = free_port()
        self.log_path = workdir / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(epp_command(binary, mode, self.port, pods, metrics_file),
                                         stdout=subprocess.DEVNULL, stderr=log)
        _live.append(self.proc)
        self.pid = self.proc.pid

    def wait_ready(self, timeout: float) -> None:
        """Until the port accepts a connection (the server binds it before it serves)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"{self.name} not listening after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-4000:]
        except OSError:
            return ""

    def cpu_ticks(self) -> int:
        return stat_cpu_ticks(Path(f"/proc/{self.pid}/stat").read_text())

    def stop(self) -> None:
        stop_process(self.proc)


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# ---------------------------------------------------------------------------------------------
# The benchmark


def run_wrk(wrk: str, url: str, script: Path, seconds: float, connections: int) -> dict:
    cmd = [wrk, "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout", "10s",
           "-s", str(script), url + "/v1/chat/completions"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    if out.returncode != 0:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stderr[-2000:]}")
    return parse_wrk(out.stdout)


def measure(front: Envoy, wrk: str, script: Path, seconds: float, connections: int,
            epp: Epp | None = None) -> dict:
    """One wrk run: the front's CPU per request (process, worker thread) and, for an ext_proc
    front, the EPP process's too (`epp_us_per_req`) and their sum (`allin_us_per_req`)."""
    tid = front.worker_tid()
    e0 = epp.cpu_ticks() if epp else 0
    t0, w0, la0 = front.cpu_ticks(), front.thread_ticks(tid) if tid else 0, loadavg()
    r = run_wrk(wrk, front.url, script, seconds, connections)
    t1, w1 = front.cpu_ticks(), front.thread_ticks(tid) if tid else 0
    e1 = epp.cpu_ticks() if epp else 0
    tick_us = 1e6 / os.sysconf("SC_CLK_TCK")
    n = max(1, r["requests"])
    errors = r["errors_status"] + r["errors_connect"] + r["errors_read"] + r["errors_write"] + r["errors_timeout"]
    cpu = (t1 - t0) * tick_us / n
    epp_us = (e1 - e0) * tick_us / n if epp else 0.0
    return {
        "epp_us_per_req": epp_us if epp else float("nan"), "allin_us_per_req": cpu + epp_us,
        "requests": r["requests"], "rps": r["requests"] / (r["duration_us"] / 1e6),
        "p50_ms": r["p50_us"] / 1000, "p99_ms": r["p99_us"] / 1000,
        "cpu_us_per_req": cpu,
        "worker_us_per_req": (w1 - w0) * tick_us / n if tid else float("nan"),
        "errors": errors, "non_2xx": r["errors_status"], "statuses": r["statuses"], "loadavg": la0,
    }


def main() -> int:
    quick_env = os.environ.get("BENCH_QUICK", "") not in ("", "0")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envoy", default=str(REPO / ".venv/bin/envoy"))
    ap.add_argument("--wasm", default=str(REPO / "target/wasm32-wasip1/release/inference_picker.wasm"))
    ap.add_argument("--passthrough", default=str(REPO / "target/wasm32-wasip1/release/passthrough_wasm.wasm"))
    ap.add_argument("--wrk", default=shutil.which("wrk") or "wrk")
    ap.add_argument("--ext-proc-epp", default=str(REPO / "target/tools/ext-proc-epp"),
                    help="the ext_proc endpoint picker of the extproc-* fronts (tools/ext-proc-epp)")
    ap.add_argument("--out", default=str(REPO / "target/envoy-bench"))
    ap.add_argument("--quick", action="store_true", default=quick_env,
                    help="smoke run: 8 endpoints, 1 KiB, 1 s runs, 1 repetition (also BENCH_QUICK=1)")
    ap.add_argument("--endpoints", help="comma-separated endpoint counts (default 8,128,1024)")
    ap.add_argument("--bodies", help="comma-separated body sizes in bytes (default 1024,32768)")
    ap.add_argument("--seconds", type=float, help="length of one measured run (default 8)")
    ap.add_argument("--reps", type=int, help="repetitions; the median is reported (default 3)")
    ap.add_argument("--idle-seconds", type=float, help="length of one idle window (default 10)")
    ap.add_argument("--settle-seconds", type=float, default=15,
                    help="wait before the idle windows, for the poller's idle cadence (default 15)")
    ap.add_argument("--connections", type=int, default=8, help="wrk connections (default 8)")
    ap.add_argument("--poller-only", action="store_true",
                    help="only the idle part (the poller's cost): no wrk runs, wrk not needed")
    ap.add_argument("--combine", nargs="+", metavar="RESULTS_JSON",
                    help="measure nothing: write one report from the results.json of several runs "
                         "(medians over all their repetitions)")
    ap.add_argument("--module-extra", default="{}",
                    help="JSON object of top-level sections added to the module's configuration "
                         "(e.g. '{\"pool\": {\"name\": \"bench\", \"route_by_model\": true}}')")
    ap.add_argument("--metrics", default=str(METRICS_FIXTURE),
                    help="the pods' /metrics body (default: the 27 KB vLLM V1 fixture; its waiting series "
                         "are set to 0)")
    ap.add_argument("--observability", action="store_true",
                    help="keep envoy.yaml's access log (to /dev/null) and OpenTelemetry tracer in every front")
    ap.add_argument("--keep-logs", action="store_true",
                    help="keep the working directory with every Envoy's log (e.g. a phase-timing build's table)")
    ap.add_argument("--floor-rate", type=float, default=200.0,
                    help="scrapes per second of the poll-floor fronts measured beside the module's poller "
                         "at idle (the pass-through wasm scraping the same pods, reading headers only or "
                         "the body too, parsing nothing); 0 skips them (default 200)")
    args = ap.parse_args()
    MODULE_EXTRA.update(json.loads(args.module_extra))
    global OBSERVABILITY
    OBSERVABILITY = args.observability
    FLOOR_RATE[0] = args.floor_rate
    if args.combine:
        return combine(args.combine, Path(args.out))

    q = args.quick
    endpoints = [int(x) for x in (args.endpoints or ("8" if q else "8,128,1024")).split(",")]
    bodies = [int(x) for x in (args.bodies or ("1024" if q else "1024,32768")).split(",")]
    seconds = args.seconds or (1 if q else 8)
    reps = args.reps or (1 if q else 3)
    idle_seconds = args.idle_seconds or (1 if q else 10)
    warmup = 0 if q else 2
    for path in (args.envoy, args.wasm, args.passthrough, *([] if args.poller_only else [args.ext_proc_epp])):
        if not Path(path).is_file():
            print(f"bench-envoy: missing {path} (run `make wasm passthrough-wasm ext-proc-epp venv`)", file=sys.stderr)
            return 2
    if args.poller_only:
        bodies = []
    if bodies and not shutil.which(args.wrk):
        print("bench-envoy: wrk not found (`make bench-envoy` installs it: apt-get install wrk)", file=sys.stderr)
        return 2

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="envoy-bench-"))
    metrics_file = work / "metrics.prom"
    metrics_file.write_text(healthy_metrics(Path(args.metrics).read_text()))
    base = yaml.safe_load((REPO / "envoy/envoy.yaml").read_text())
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    started = dt.datetime.now(dt.timezone.utc)
    load_start = loadavg()
    results: list[dict] = []
    idle: list[dict] = []
    scripts: dict[tuple[int, bool], Path] = {}
    for b in bodies:
        for new in (False, True):
            p = work / f"chat_{b}_{'new' if new else 'hit'}.lua"
            p.write_text(wrk_script(chat_body_template(b), new))
            scripts[(b, new)] = p
    try:
        for n in endpoints:
            addresses = pod_addresses(n)
            for _ in range(20):
                pod_port = free_port()
                if port_free_on_all(addresses, pod_port):
                    break
            else:
                raise RuntimeError("no port free on every pod address")
            pods = Envoy(f"pods-{n}", Path(args.envoy),
                         pods_config(addresses, pod_port, (pa := free_port()), metrics_file),
                         work, concurrency=1, admin_port=pa)
            pods.wait_ready(60)
            pod_list = [f"{a}:{pod_port}" for a in addresses]
            # The EPP processes of the ext_proc fronts (not for --poller-only: nothing routes).
            epps: dict[str, Epp] = {} if args.poller_only else {
                v: Epp(f"epp-{mode}-{n}", Path(args.ext_proc_epp), mode, pod_list, metrics_file, work)
                for v, mode in EXTPROC.items()}
            for e in epps.values():
                e.wait_ready(30)
            fronts: dict[str, Envoy] = {}
            for v in VARIANTS:
                if v in EXTPROC and v not in epps:
                    continue
                port, admin = free_port(), free_port()
                doc = front_config(v, base, addresses, pod_port, port, admin, Path(args.wasm), Path(args.passthrough),
                                   epp_port=epps[v].port if v in epps else None)
                fronts[v] = Envoy(f"{v}-{n}", Path(args.envoy), doc, work, concurrency=1, admin_port=admin, port=port)
            probe = chat_body_template(1024).replace(MARK, "0" * len(MARK)).encode()
            pod_set = {f"{a}:{pod_port}" for a in addresses}
            for v, f in fronts.items():
                f.wait_ready(60)
                f.wait_routable(probe, 60, lambda h, v=v: front_did_its_job(v, h, len(probe), pod_set))
            print(f"[{n} endpoints] pods and fronts ready (load {loadavg()})", flush=True)

            # Idle: no traffic to any front; the module's poller scrapes the pods.
            # Let the probe settle and the poller reach its idle cadence (an idle, unchanged endpoint
            # backs off 200, 400, 800, 1600, 3200, 5000 ms with the shipped defaults: ~11 s).
            floors: dict[str, Envoy] = {}
            for v in FLOORS if FLOOR_RATE[0] > 0 else ():
                port, admin = free_port(), free_port()
                doc = front_config(v, base, addresses, pod_port, port, admin, Path(args.wasm), Path(args.passthrough))
                floors[v] = Envoy(f"{v}-{n}", Path(args.envoy), doc, work, concurrency=1, admin_port=admin, port=port)
            for f in floors.values():
                f.wait_ready(60)
            time.sleep(1 if q else args.settle_seconds)
            idle_fronts = {"plain": fronts["plain"], "module": fronts["module"], **floors}
            scraping = {v: f for v, f in idle_fronts.items() if v != "plain"}
            rq = f"cluster.{METRICS_CLUSTER}.upstream_rq_total"
            for rep in range(reps):
                cx = f"cluster.{METRICS_CLUSTER}.upstream_cx_total"
                c0 = {v: f.cpu_ns() for v, f in idle_fronts.items()}
                s0 = {v: f.counter(rq) for v, f in scraping.items()}
                x0 = {v: f.counter(cx) for v, f in scraping.items()}
                t0 = time.monotonic()
                time.sleep(idle_seconds)
                # The window ends once every scraping front has scraped at least once more (an idle
                # poller backs off to one round per 5 s, longer than a quick run's window), within a
                # bound: a window with no scrape has no cost per scrape to report.
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and any(f.counter(rq) <= s0[v] for v, f in scraping.items()):
                    time.sleep(0.1)
                c1 = {v: f.cpu_ns() for v, f in idle_fronts.items()}
                s1 = {v: f.counter(rq) for v, f in scraping.items()}
                x1 = {v: f.counter(cx) for v, f in scraping.items()}
                t1 = time.monotonic()
                cx0, cx1 = x0["module"], x1["module"]
                span = t1 - t0
                # Scrapes are counted at each front's own metrics cluster (requests it sent).
                sm = s1["module"] - s0["module"]
                row = {"endpoints": n, "rep": rep, "seconds": span, "loadavg": loadavg(),
                       "plain_ms_per_s": (c1["plain"] - c0["plain"]) / 1e6 / span,
                       "module_ms_per_s": (c1["module"] - c0["module"]) / 1e6 / span,
                       "scrapes_per_s": sm / span,
                       # New connections the poller opened per scrape (keep-alive: ~0).
                       "connections_per_scrape": (cx1 - cx0) / sm if sm > 0 else float("nan")}
                floor_text = ""
                for v in floors:
                    key = v.replace("-", "_")
                    row[f"{key}_ms_per_s"] = (c1[v] - c0[v]) / 1e6 / span
                    row[f"{key}_scrapes_per_s"] = (s1[v] - s0[v]) / span
                    row[f"{key}_connections_per_scrape"] = (x1[v] - x0[v]) / max(1, s1[v] - s0[v])
                    floor_text += (f", {v} {row[f'{key}_ms_per_s']:.1f} ms/s at {row[f'{key}_scrapes_per_s']:.0f}/s "
                                   f"({row[f'{key}_connections_per_scrape']:.3f} new connections per scrape)")
                idle.append(row)
                print(f"  {n:>5} ep idle rep {rep}: module {row['module_ms_per_s']:.1f} ms/s, plain "
                      f"{row['plain_ms_per_s']:.1f} ms/s, {row['scrapes_per_s']:.0f} scrapes/s, "
                      f"{row['connections_per_scrape']:.3f} new connections per scrape{floor_text}", flush=True)
            for f in floors.values():
                f.stop()

            for b in bodies:
                cases = [("plain", False), ("pass", False), ("parse", False), ("module", False), ("module", True),
                         ("extproc-rr", False), ("extproc-sched", False), ("extproc-sched", True)]
                for v, new in cases if warmup else ():  # warm up connections, VMs and caches
                    run_wrk(args.wrk, fronts[v].url, scripts[(b, new)], warmup, args.connections)
                for rep in range(reps):  # interleaved, so drifting load hits every variant alike
                    for v, new in cases:
                        m = measure(fronts[v], args.wrk, scripts[(b, new)], seconds, args.connections, epps.get(v))
                        m.update({"endpoints": n, "body": b, "variant": v,
                                  "prompt": ("new" if new else "hit") if v in PROMPTED else "-", "rep": rep})
                        results.append(m)
                        epp_text = f" epp {m['epp_us_per_req']:6.1f}" if v in EXTPROC else ""
                        print(f"  {n:>5} ep {b:>6} B {v:>13} {m['prompt']:>3} rep {rep}: {m['rps']:8.0f} req/s "
                              f"cpu {m['cpu_us_per_req']:6.1f} us/req worker {m['worker_us_per_req']:6.1f}{epp_text} "
                              f"errors {m['errors']}", flush=True)
            for f in fronts.values():
                f.stop()
            for e in epps.values():
                e.stop()
            pods.stop()
    finally:
        _stop_all()
    finished = dt.datetime.now(dt.timezone.utc)

    env = dict(
        started=started.strftime("%Y-%m-%d %H:%M UTC"), minutes=(finished - started).total_seconds() / 60,
        load_start=load_start, load_end=loadavg(), quick=q, seconds=seconds, reps=reps,
        idle_seconds=idle_seconds, connections=args.connections,
        envoy=subprocess.run([args.envoy, "--version"], capture_output=True, text=True, timeout=30).stdout.strip().split()[-1],
        wasm_bytes=Path(args.wasm).stat().st_size, pass_bytes=Path(args.passthrough).stat().st_size,
        metrics_bytes=metrics_file.stat().st_size, metrics_name=Path(args.metrics).name, nproc=os.cpu_count())
    if args.keep_logs:
        print(f"bench-envoy: Envoy logs kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    write_outputs(out, results, idle, env)
    return 0


def write_outputs(out: Path, results: list[dict], idle: list[dict], env: dict) -> None:
    report, lines = render_report(results, idle, env)
    (out / "report.md").write_text(report + "\n```\n" + "\n".join(lines) + "\n```\n")
    (out / "results.json").write_text(json.dumps({"env": env, "runs": results, "idle": idle}, indent=1))
    print(report)
    for line in lines:
        print(line)


def combine(paths: list[str], out: Path) -> int:
    """One report over several runs' results.json: every repetition of every run counts once."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    results = [dict(r, run=i) for i, d in enumerate(docs) for r in d["runs"]]
    idle = [dict(x, run=i) for i, d in enumerate(docs) for x in d["idle"]]
    envs = [d["env"] for d in docs]
    env = dict(envs[0])
    env.update(
        started=f"{len(docs)} runs from {envs[0]['started']}", minutes=sum(e["minutes"] for e in envs),
        load_start=" / ".join(e["load_start"] for e in envs), load_end=" / ".join(e["load_end"] for e in envs),
        reps=sum(e["reps"] for e in envs), quick=any(e["quick"] for e in envs))
    out.mkdir(parents=True, exist_ok=True)
    write_outputs(out, results, idle, env)
    return 0


def extproc_section(results: list[dict], combos: list[tuple[int, int]], med) -> tuple[list[str], list[str]]:
    """The ext_proc EPP beside the module: all-in CPU per request (front Envoy + EPP process; the
    module's front alone) and wrk's latency added over `plain`, medians. Empty when no ext_proc
    front ran (an older results.json)."""
    if not any(r.get("variant") in EXTPROC for r in results):
        return [], []
    md = ["", "## ext_proc endpoint picker vs the module (medians)", "",
          "The same `plain` front with Envoy's ext_proc filter (request headers SEND, request body "
          "BUFFERED, response SKIP/NONE) and an endpoint-picker process on loopback gRPC "
          "(tools/ext-proc-epp): `floor` = round robin after reading `model` (the least that "
          "architecture costs), `sched` = inference-picker's Scheduler in that process. All-in = front "
          "Envoy process + EPP process CPU per request; the module's all-in is its front Envoy process "
          "(its poller included). Added latency = the front's p50/p99 − plain's, from the same interleaved runs.", "",
          "| endpoints | body | prompt | plain µs | floor all-in µs | sched all-in µs | module all-in µs | "
          "floor EPP µs | sched EPP µs | worker: floor | worker: sched | worker: module | "
          "p50 added ms floor / sched / module | p99 added ms floor / sched / module |",
          "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    lines = []
    for n, b in combos:
        c = dict(endpoints=n, body=b)
        plain = med("cpu_us_per_req", variant="plain", **c)
        p50p, p99p = med("p50_ms", variant="plain", **c), med("p99_ms", variant="plain", **c)
        floor = {k: med(k, variant="extproc-rr", **c) for k in
                 ("allin_us_per_req", "epp_us_per_req", "worker_us_per_req", "p50_ms", "p99_ms")}
        for p in ("hit", "new"):
            sched = {k: med(k, variant="extproc-sched", prompt=p, **c) for k in floor}
            mod = {k: med(k, variant="module", prompt=p, **c) for k in
                   ("cpu_us_per_req", "worker_us_per_req", "p50_ms", "p99_ms")}
            md.append(f"| {n} | {b} | {p} | {fmt(plain)} | {fmt(floor['allin_us_per_req'])} | "
                      f"{fmt(sched['allin_us_per_req'])} | {fmt(mod['cpu_us_per_req'])} | "
                      f"{fmt(floor['epp_us_per_req'])} | {fmt(sched['epp_us_per_req'])} | "
                      f"{fmt(floor['worker_us_per_req'])} | {fmt(sched['worker_us_per_req'])} | "
                      f"{fmt(mod['worker_us_per_req'])} | "
                      f"{fmt(floor['p50_ms'] - p50p, 2)} / {fmt(sched['p50_ms'] - p50p, 2)} / {fmt(mod['p50_ms'] - p50p, 2)} | "
                      f"{fmt(floor['p99_ms'] - p99p, 2)} / {fmt(sched['p99_ms'] - p99p, 2)} / {fmt(mod['p99_ms'] - p99p, 2)} |")
            lines.append(
                f"EXTPROC_COST endpoints={n} body={b} floor_allin_us={fmt(floor['allin_us_per_req'])} "
                f"sched_allin_us={fmt(sched['allin_us_per_req'])} module_allin_us={fmt(mod['cpu_us_per_req'])} "
                f"prompt={p} plain_us={fmt(plain)} "
                f"floor_epp_us={fmt(floor['epp_us_per_req'])} sched_epp_us={fmt(sched['epp_us_per_req'])} "
                f"floor_worker_us={fmt(floor['worker_us_per_req'])} sched_worker_us={fmt(sched['worker_us_per_req'])} "
                f"module_worker_us={fmt(mod['worker_us_per_req'])} "
                f"floor_p50_added_ms={fmt(floor['p50_ms'] - p50p, 2)} sched_p50_added_ms={fmt(sched['p50_ms'] - p50p, 2)} "
                f"module_p50_added_ms={fmt(mod['p50_ms'] - p50p, 2)} "
                f"floor_p99_added_ms={fmt(floor['p99_ms'] - p99p, 2)} sched_p99_added_ms={fmt(sched['p99_ms'] - p99p, 2)} "
                f"module_p99_added_ms={fmt(mod['p99_ms'] - p99p, 2)}")
    return md, lines


def render_report(results: list[dict], idle: list[dict], env: dict) -> tuple[str, list[str]]:
    def med(key: str, **match) -> float:
        return median([r.get(key, float("nan")) for r in results if all(r.get(k) == v for k, v in match.items())])

    lines: list[str] = []
    md = ["# make bench-envoy", "",
          f"{env['started']}, {env['minutes']:.1f} min; Envoy {env['envoy']}, front Envoys `--concurrency 1`; "
          f"{env['nproc']} cores, load average {env['load_start']} at start, {env['load_end']} at end "
          "(1, 5, 15 min; the machine is shared).",
          f"Medians of {env['reps']} interleaved repetitions of {env['seconds']:g} s each (wrk, 1 thread, "
          f"{env['connections']} connections){' - QUICK smoke run, not for quoting' if env['quick'] else ''}.",
          f"inference_picker.wasm {env['wasm_bytes']:,} bytes (release, shipped defaults); "
          f"passthrough_wasm.wasm {env['pass_bytes']:,} bytes; pods' /metrics {env['metrics_bytes']:,} bytes "
          f"({env.get('metrics_name', METRICS_FIXTURE.name)}, waiting set to 0).", "",
          "CPU = front Envoy utime+stime (/proc/<pid>/stat) over the run / requests completed; "
          "worker = the same for its worker thread only (excludes the main thread, where the module's "
          "poller runs). For the ext_proc fronts, EPP = the endpoint-picker process's utime+stime over the "
          "same run / requests, and all-in = front CPU + EPP; for every other front all-in = front CPU.", "",
          "## Per request", "",
          "| endpoints | body | front | prompt | req/s | p50 ms | p99 ms | CPU µs/req | worker µs/req | "
          "EPP µs/req | all-in µs/req | errors (status:count) |",
          "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    combos = sorted({(r["endpoints"], r["body"]) for r in results})
    for n, b in combos:
        for v, p in (("plain", "-"), ("pass", "-"), ("parse", "-"), ("module", "hit"), ("module", "new"),
                     ("extproc-rr", "-"), ("extproc-sched", "hit"), ("extproc-sched", "new")):
            sel = dict(endpoints=n, body=b, variant=v, prompt=p)
            runs = [r for r in results if all(r[k] == x for k, x in sel.items())]
            if not runs:
                continue
            errs = sum(r["errors"] for r in runs)
            by_status = merge_statuses([r.get("statuses", "") for r in runs])
            errs = f"{errs} ({by_status})" if by_status else str(errs)
            md.append(f"| {n} | {b} | {v} | {p} | {fmt(med('rps', **sel), 0)} | {fmt(med('p50_ms', **sel), 2)} | "
                      f"{fmt(med('p99_ms', **sel), 2)} | {fmt(med('cpu_us_per_req', **sel))} | "
                      f"{fmt(med('worker_us_per_req', **sel))} | "
                      f"{fmt(med('epp_us_per_req', **sel)) if v in EXTPROC else '-'} | "
                      f"{fmt(med('allin_us_per_req', **sel)) if v in EXTPROC else fmt(med('cpu_us_per_req', **sel))} "
                      f"| {errs} |")
    md += ["", "## What the module adds (µs of CPU per request, medians)", "",
           "`parse` is the pass-through filter that also checks the body is JSON (serde_json into "
           "`IgnoredAny`, nothing kept): the least any filter routing on the body must do, so "
           "*worker: parse − pass* is a floor under *worker: module − pass*.", "",
           "| endpoints | body | prompt | pass − plain | module − pass | module − plain | worker: parse − pass | "
           "worker: module − pass | worker: module − parse | worker: module − plain |",
           "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for n, b in combos:
        plain = med("cpu_us_per_req", endpoints=n, body=b, variant="plain")
        pas = med("cpu_us_per_req", endpoints=n, body=b, variant="pass")
        wplain = med("worker_us_per_req", endpoints=n, body=b, variant="plain")
        wpass = med("worker_us_per_req", endpoints=n, body=b, variant="pass")
        wparse = med("worker_us_per_req", endpoints=n, body=b, variant="parse")
        for p in ("hit", "new"):
            mod = med("cpu_us_per_req", endpoints=n, body=b, variant="module", prompt=p)
            wmod = med("worker_us_per_req", endpoints=n, body=b, variant="module", prompt=p)
            md.append(f"| {n} | {b} | {p} | {fmt(pas - plain)} | {fmt(mod - pas)} | {fmt(mod - plain)} | "
                      f"{fmt(wparse - wpass)} | {fmt(wmod - wpass)} | {fmt(wmod - wparse)} | {fmt(wmod - wplain)} |")
            lines.append(f"ENVOY_COST endpoints={n} body={b} module_vs_pass_us={fmt(mod - pas)} "
                         f"module_vs_plain_us={fmt(mod - plain)} prompt={p} "
                         f"worker_module_vs_pass_us={fmt(wmod - wpass)} worker_module_vs_plain_us={fmt(wmod - wplain)} "
                         f"worker_parse_vs_pass_us={fmt(wparse - wpass)} worker_module_vs_parse_us={fmt(wmod - wparse)}")
    xmd, xlines = extproc_section(results, combos, med)
    md += xmd
    lines += xlines
    md += ["", "## The poller at idle (no traffic)", "",
           "CPU of the whole front Envoy process (sum of its threads' /proc/<pid>/task/<tid>/schedstat) over "
           f"{env['idle_seconds']:g} s windows, medians; scrapes counted at each front's metrics cluster "
           "(`upstream_rq_total`); per scrape = (front − plain) / its scrapes. The poll floors are the "
           "pass-through wasm scraping the same pods at a fixed rate and reading the response's headers "
           "only, or its body too, parsing nothing: what any proxy-wasm poller pays per scrape in Envoy.", "",
           "| endpoints | plain Envoy ms/s | module Envoy ms/s | scrapes/s | module µs per scrape | "
           "floor, headers only: µs per scrape | floor, body read: µs per scrape | new connections per scrape |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in sorted({i["endpoints"] for i in idle}):
        rows = [i for i in idle if i["endpoints"] == n]
        pl = median([i["plain_ms_per_s"] for i in rows])
        mo = median([i["module_ms_per_s"] for i in rows])
        sc = median([i["scrapes_per_s"] for i in rows])
        per = (mo - pl) * 1000 / sc if sc > 0 else float("nan")
        cx = median([i.get("connections_per_scrape", float("nan")) for i in rows])
        floor = {}
        for key in ("floor_headers", "floor_body"):
            if all(f"{key}_ms_per_s" in i for i in rows):
                fm = median([i[f"{key}_ms_per_s"] for i in rows])
                fs = median([i[f"{key}_scrapes_per_s"] for i in rows])
                floor[key] = (fm - pl) * 1000 / fs if fs > 0 else float("nan")
        md.append(f"| {n} | {fmt(pl, 2)} | {fmt(mo, 2)} | {fmt(sc)} | {fmt(per)} | "
                  f"{fmt(floor.get('floor_headers', float('nan')))} | {fmt(floor.get('floor_body', float('nan')))} | "
                  f"{fmt(cx, 3)} |")
        lines.append(f"POLLER_COST endpoints={n} idle_cpu_ms_per_s={fmt(mo, 2)} per_scrape_us={fmt(per)} "
                     f"plain_idle_cpu_ms_per_s={fmt(pl, 2)} scrapes_per_s={fmt(sc)}"
                     + "".join(f" {k}_per_scrape_us={fmt(v)}" for k, v in floor.items()))
    return "\n".join(md) + "\n", lines


if __name__ == "__main__":
    sys.exit(main())
