"""Tests of `make bench-envoy` (tools/bench-envoy/bench_envoy.py): its pure helpers, and one smoke
run (BENCH_QUICK) that checks only that the report and the result lines are produced; nothing
here asserts a speed. Run by `make bench-envoy-check` (part of `make test`)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_envoy as be  # noqa: E402
from bench_envoy import first_hcm  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("size", [1024, 32768, 4000])
def test_chat_body_has_the_exact_size_and_one_mark(size):
    body = be.chat_body_template(size)
    assert len(body.encode()) == size
    assert body.count(be.MARK) == 1
    doc = json.loads(body)
    assert doc["model"] == be.LLAMA
    # The mark opens the last message, so a unique value there changes every prefix block.
    assert doc["messages"][-1]["content"].startswith(be.MARK)


def test_chat_body_smaller_than_possible_is_refused():
    with pytest.raises(ValueError):
        be.chat_body_template(50)


def test_wrk_script_sets_the_mode_and_keeps_the_body_whole():
    body = be.chat_body_template(1024)
    hit, new = be.wrk_script(body, False), be.wrk_script(body, True)
    assert "NEW_PROMPT = false" in hit and "NEW_PROMPT = true" in new
    assert "[==[" + body + "]==]" in hit
    # The per-request value that replaces the mark has the mark's width (3 + 13 digits).
    assert len(be.MARK) == 16 and re.fullmatch(r"[A-Za-z]+", be.MARK)
    assert '"%03d%013d"' in new


def test_pod_addresses_are_distinct_loopback_and_avoid_0_1_255():
    addrs = be.pod_addresses(1024)
    assert len(set(addrs)) == 1024
    for a in addrs:
        octets = [int(x) for x in a.split(".")]
        assert octets[0] == 127 and octets[3] not in (0, 1, 255)


def test_stat_cpu_ticks_handles_a_command_name_with_spaces_and_parens():
    # Fields 14 and 15 (utime, stime) are 7 and 5; the name holds ") (" to catch a naive split.
    line = "1234 (envoy (x) y) S 1 2 3 4 5 6 7 8 9 10 7 5 0 0 20 0 9 0 100 200 300"
    assert be.stat_cpu_ticks(line) == 12


def test_parse_wrk_reads_the_result_line():
    out = "Running 1s test\nBENCH_RESULT requests=10 duration_us=1000000 p50_us=5 p99_us=9 errors_status=1\n"
    r = be.parse_wrk(out)
    assert r["requests"] == 10 and r["p99_us"] == 9 and r["errors_status"] == 1 and r["statuses"] == ""
    assert be.parse_wrk(out + "BENCH_STATUSES 503:1\n")["statuses"] == "503:1"
    assert be.merge_statuses(["503:1,429:2", "", "503:4"]) == "429:2,503:5"
    with pytest.raises(RuntimeError):
        be.parse_wrk("no line")


def test_healthy_metrics_zeroes_only_the_waiting_series():
    text = be.METRICS_FIXTURE.read_text()
    out = be.healthy_metrics(text)
    waiting = re.findall(r"^vllm:num_requests_waiting\{[^}]*\} (\S+)$", out, flags=re.M)
    assert waiting and all(v == "0.0" for v in waiting)
    assert re.findall(r"^vllm:num_requests_waiting\{[^}]*\} (\S+)$", text, flags=re.M) != waiting
    # Everything else is unchanged.
    strip = lambda t: [l for l in t.splitlines() if not l.startswith("vllm:num_requests_waiting{")]
    assert strip(out) == strip(text)


def test_front_did_its_job():
    pods = {"127.88.0.2:9000"}
    assert be.front_did_its_job("pass", {"x-bench-body-bytes": "1024"}, 1024, pods)
    assert not be.front_did_its_job("pass", {"x-bench-body-bytes": "512"}, 1024, pods)
    assert be.front_did_its_job("parse", {"x-bench-body-bytes": "1024"}, 1024, pods)
    # The parse floor sets 0 when the body was not JSON: not its job done.
    assert not be.front_did_its_job("parse", {"x-bench-body-bytes": "0"}, 1024, pods)
    assert be.front_did_its_job("module", {"x-bench-destination": "127.88.0.2:9000,127.88.0.3:9000"}, 1024, pods)
    assert not be.front_did_its_job("module", {"x-bench-destination": "10.0.0.1:1"}, 1024, pods)
    for v in be.EXTPROC:  # the EPP's header reached the pod, nothing else was added
        assert be.front_did_its_job(v, {"x-bench-destination": "127.88.0.2:9000"}, 1024, pods)
        assert not be.front_did_its_job(v, {}, 1024, pods)
        assert not be.front_did_its_job(v, {"x-bench-destination": "127.0.0.1:1"}, 1024, pods)
    assert be.front_did_its_job("plain", {}, 1024, pods)
    assert not be.front_did_its_job("plain", {"x-bench-body-bytes": "1024"}, 1024, pods)


def test_front_configs_share_the_listener_and_differ_only_in_filters():
    base = yaml.safe_load((REPO / "envoy/envoy.yaml").read_text())
    addrs = be.pod_addresses(3)
    docs = {v: be.front_config(v, base, addrs, 9000, 8000, 8001, Path("/m.wasm"), Path("/p.wasm"), epp_port=7000)
            for v in be.VARIANTS if v not in be.EXTPROC}
    hcm = {v: d["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
           for v, d in docs.items()}
    names = {v: [f["name"] for f in h["http_filters"]] for v, h in hcm.items()}
    assert names["plain"] == ["envoy.filters.http.router"]
    assert names["pass"] == names["parse"] == ["envoy.filters.http.wasm", "envoy.filters.http.router"]
    wasm_cfg = {v: hcm[v]["http_filters"][0]["typed_config"]["config"] for v in ("pass", "parse")}
    assert "configuration" not in wasm_cfg["pass"]
    assert wasm_cfg["parse"]["configuration"]["value"] == "parse"
    assert names["module"] == ["inference-picker", "envoy.filters.http.router"]
    assert "bootstrap_extensions" not in docs["plain"] and "bootstrap_extensions" in docs["module"]
    # Comparable upstream side: the shipped route (retries) and pool cluster for every front,
    # listing the pods; only plain/pass fall back to round robin, as they name no pod.
    routes = {v: h["route_config"]["virtual_hosts"][0]["routes"][0]["route"] for v, h in hcm.items()}
    assert routes["plain"] == routes["pass"] == routes["parse"] == routes["module"]
    assert "retry_policy" in routes["plain"] and routes["plain"]["cluster"] == "inference_pool"
    pools = {v: next(c for c in d["static_resources"]["clusters"] if c["name"] == "inference_pool")
             for v, d in docs.items()}
    for v, pool in pools.items():
        eps = pool["load_assignment"]["endpoints"][0]["lb_endpoints"]
        assert [e["endpoint"]["address"]["socket_address"]["address"] for e in eps] == addrs, v
    lb = {v: p["load_balancing_policy"]["policies"][0]["typed_extension_config"]["typed_config"]
          for v, p in pools.items()}
    assert lb["plain"] == lb["pass"] and lb["plain"]["override_host_sources"] == lb["module"]["override_host_sources"]
    fallback = lb["plain"]["fallback_policy"]["policies"][0]["typed_extension_config"]["name"]
    assert fallback == "envoy.load_balancing_policies.round_robin"
    assert "NO_FALLBACK" in json.dumps(lb["module"])
    # The module runs with the shipped defaults: only version, endpoints and models are set.
    cfg = json.loads(hcm["module"]["http_filters"][0]["typed_config"]["config"]["configuration"]["value"])
    assert set(cfg) == {"version", "endpoints", "models"}
    assert [e["address"] for e in cfg["endpoints"]] == [f"{a}:9000" for a in addrs]
    boot = docs["module"]["bootstrap_extensions"][0]["typed_config"]["config"]
    assert json.loads(boot["configuration"]["value"]) == cfg
    assert boot["vm_config"]["code"]["local"]["filename"] == "/m.wasm"
    # The shipped access log and tracer are left out of every front alike.
    assert "access_log" in first_hcm(base) and "tracing" in first_hcm(base)
    for v, h in hcm.items():
        assert "access_log" not in h and "tracing" not in h, v
    # The base file is not modified in place.
    assert "127.88." not in json.dumps(base)


def test_observability_keeps_the_shipped_log_and_tracer_in_every_front(monkeypatch):
    base = yaml.safe_load((REPO / "envoy/envoy.yaml").read_text())
    monkeypatch.setattr(be, "OBSERVABILITY", True)
    for v in be.VARIANTS:
        doc = be.front_config(v, base, be.pod_addresses(2), 9000, 8000, 8001, Path("/m.wasm"), Path("/p.wasm"),
                              epp_port=7000)
        h = first_hcm(doc)
        assert h["access_log"][0]["typed_config"]["path"] == "/dev/null", v
        assert h["tracing"] == first_hcm(base)["tracing"], v
    assert first_hcm(base)["access_log"][0]["typed_config"]["path"] == "/dev/stdout"


@pytest.mark.parametrize("variant", sorted(be.EXTPROC))
def test_ext_proc_front_is_plain_plus_the_filter_on_a_grpc_cluster(variant):
    base = yaml.safe_load((REPO / "envoy/envoy.yaml").read_text())
    addrs = be.pod_addresses(3)
    doc = be.front_config(variant, base, addrs, 9000, 8000, 8001, Path("/m.wasm"), Path("/p.wasm"), epp_port=7000)
    plain = be.front_config("plain", base, addrs, 9000, 8000, 8001, Path("/m.wasm"), Path("/p.wasm"))
    assert "bootstrap_extensions" not in doc  # no module, no poller
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    phcm = plain["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert [f["name"] for f in hcm["http_filters"]] == ["envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    assert hcm["route_config"] == phcm["route_config"]  # same route, retry policy included
    ep = hcm["http_filters"][0]["typed_config"]
    assert ep["@type"].endswith("ext_proc.v3.ExternalProcessor")
    assert ep["grpc_service"]["envoy_grpc"]["cluster_name"] == be.EPP_CLUSTER
    assert ep["failure_mode_allow"] is False
    assert ep["processing_mode"] == {"request_header_mode": "SEND", "response_header_mode": "SKIP",
                                     "request_body_mode": "BUFFERED", "response_body_mode": "NONE",
                                     "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"}
    clusters = {c["name"]: c for c in doc["static_resources"]["clusters"]}
    epp = clusters[be.EPP_CLUSTER]
    assert epp["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"] == \
        {"socket_address": {"address": "127.0.0.1", "port_value": 7000}}
    opts = epp["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in opts["explicit_http_config"]
    # The pool cluster is the shipped one (override_host on the EPP's header, NO_FALLBACK: a request
    # the EPP named no pod for gets no host), listing the pods.
    pool = clusters["inference_pool"]
    shipped = next(c for c in base["static_resources"]["clusters"] if c["name"] == "inference_pool")
    assert pool["load_balancing_policy"] == shipped["load_balancing_policy"]
    lb = pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]["typed_config"]
    assert lb["override_host_sources"] == [{"header": "x-gateway-destination-endpoint"}]
    eps = pool["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [e["endpoint"]["address"]["socket_address"]["address"] for e in eps] == addrs
    with pytest.raises(ValueError):
        be.front_config(variant, base, addrs, 9000, 8000, 8001, Path("/m.wasm"), Path("/p.wasm"))


def test_epp_command_names_the_mode_port_pods_and_metrics():
    cmd = be.epp_command(Path("/bin/epp"), "scheduler", 7000, ["127.88.0.2:9000", "127.88.0.3:9000"], Path("/m.prom"))
    assert cmd == ["/bin/epp", "--port", "7000", "--mode", "scheduler", "--endpoints",
                   "127.88.0.2:9000,127.88.0.3:9000", "--metrics", "/m.prom", "--model", be.LLAMA]
    assert set(be.EXTPROC.values()) == {"rr", "scheduler"}


def test_extproc_cost_line_sums_front_and_epp_and_subtracts_plain_latency():
    env = dict(started="s", minutes=1.0, load_start="1 1 1", load_end="2 2 2", quick=False, seconds=8,
               reps=1, idle_seconds=10, connections=8, envoy="1.40.0", wasm_bytes=1, pass_bytes=1,
               metrics_bytes=1, nproc=2)
    nan = float("nan")

    def row(v, p, cpu, epp, p50, p99, worker):
        return dict(endpoints=128, body=32768, variant=v, prompt=p, rps=1.0, p50_ms=p50, p99_ms=p99,
                    cpu_us_per_req=cpu, worker_us_per_req=worker, epp_us_per_req=epp,
                    allin_us_per_req=cpu + (0 if epp != epp else epp), errors=0, statuses="")
    rows = [row("plain", "-", 100, nan, 1.0, 2.0, 90), row("pass", "-", 110, nan, 1.0, 2.0, 100),
            row("parse", "-", 115, nan, 1.0, 2.0, 105),
            row("module", "hit", 150, nan, 1.5, 3.0, 130), row("module", "new", 170, nan, 1.6, 3.5, 140),
            row("extproc-rr", "-", 160, 40, 1.8, 4.0, 120),
            row("extproc-sched", "hit", 165, 90, 2.0, 5.0, 121), row("extproc-sched", "new", 166, 120, 2.25, 6.0, 122)]
    report, lines = be.render_report(rows, [], env)
    ext = [l for l in lines if l.startswith("EXTPROC_COST ")]
    assert len(ext) == 2
    assert ext[0].startswith("EXTPROC_COST endpoints=128 body=32768 floor_allin_us=200.0 sched_allin_us=255.0 "
                             "module_allin_us=150.0 prompt=hit plain_us=100.0 floor_epp_us=40.0 sched_epp_us=90.0 "
                             "floor_worker_us=120.0 sched_worker_us=121.0 module_worker_us=130.0 "
                             "floor_p50_added_ms=0.80 sched_p50_added_ms=1.00 module_p50_added_ms=0.50 "
                             "floor_p99_added_ms=2.00 sched_p99_added_ms=3.00 module_p99_added_ms=1.00"), ext[0]
    assert " sched_allin_us=286.0 module_allin_us=170.0 prompt=new " in ext[1]
    assert " sched_p50_added_ms=1.25 " in ext[1]
    assert "## ext_proc endpoint picker vs the module" in report
    # The per-request table shows the EPP and the all-in columns for the ext_proc fronts.
    assert "| 128 | 32768 | extproc-rr | - |" in report and "| 40.0 | 200.0 |" in report
    # Without ext_proc runs (an older results.json) there is no such section and no line.
    report, lines = be.render_report([r for r in rows if r["variant"] not in be.EXTPROC], [], env)
    assert "## ext_proc" not in report and not any(l.startswith("EXTPROC_COST") for l in lines)


@pytest.mark.parametrize("what", ["headers", "body"])
def test_poll_floor_front_scrapes_the_pods_through_the_shipped_metrics_cluster(what):
    base = yaml.safe_load((REPO / "envoy/envoy.yaml").read_text())
    addrs = be.pod_addresses(3)
    doc = be.front_config(f"floor-{what}", base, addrs, 9000, 8000, 8001, Path("/m.wasm"), Path("/p.wasm"))
    assert "bootstrap_extensions" not in doc  # no module poller beside it
    filters = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    cfg = filters[0]["typed_config"]["config"]
    assert cfg["vm_config"]["code"]["local"]["filename"] == "/p.wasm"
    words = cfg["configuration"]["value"].split()
    assert words[:5] == ["poll", f"{be.FLOOR_RATE[0]:g}", what, be.METRICS_CLUSTER, "/metrics"]
    assert words[5:] == [f"{a}:9000" for a in addrs]
    metrics = next(c for c in doc["static_resources"]["clusters"] if c["name"] == be.METRICS_CLUSTER)
    shipped = next(c for c in base["static_resources"]["clusters"] if c["name"] == be.METRICS_CLUSTER)
    assert metrics == shipped


def test_quick_run_writes_the_report_and_the_lines(tmp_path):
    """BENCH_QUICK smoke run against real Envoys and wrk. Needs what `make bench-envoy-check`
    builds and installs (wrk: `make wrk`, which installs it as root or says what to run); fails
    without it, so a missing piece is seen, never skipped."""
    envoy = Path(os.environ.get("PICKER_ENVOY", REPO / ".venv/bin/envoy"))
    wasm = REPO / "target/wasm32-wasip1/release/inference_picker.wasm"
    passthrough = REPO / "target/wasm32-wasip1/release/passthrough_wasm.wasm"
    epp = Path(os.environ.get("PICKER_EXT_PROC_EPP", REPO / "target/tools/ext-proc-epp"))
    for p in (envoy, wasm, passthrough, epp):
        assert p.is_file(), f"{p} missing: run `make bench-envoy-check`"
    assert shutil.which("wrk"), "wrk missing: run `make wrk` as root, or `sudo apt-get install wrk`"
    out = subprocess.run(
        [sys.executable, str(Path(be.__file__)), "--envoy", str(envoy), "--wasm", str(wasm),
         "--passthrough", str(passthrough), "--ext-proc-epp", str(epp), "--out", str(tmp_path)],
        env={**os.environ, "BENCH_QUICK": "1"}, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    num = r"-?\d+\.\d"
    cost = [l for l in lines if l.startswith("ENVOY_COST ")]
    assert len(cost) == 2, out.stdout[-3000:]
    for l in cost:
        assert re.match(rf"ENVOY_COST endpoints=8 body=1024 module_vs_pass_us={num}+ module_vs_plain_us={num}+ "
                        r"prompt=(hit|new) ", l), l
        assert re.search(rf" worker_parse_vs_pass_us={num}+ worker_module_vs_parse_us={num}+$", l), l
    ext = [l for l in lines if l.startswith("EXTPROC_COST ")]
    assert len(ext) == 2, out.stdout[-3000:]
    for l in ext:  # both ext_proc fronts ran: their all-in figures are numbers
        assert re.match(rf"EXTPROC_COST endpoints=8 body=1024 floor_allin_us={num}+ sched_allin_us={num}+ "
                        rf"module_allin_us={num}+ prompt=(hit|new) ", l), l
        assert re.search(rf" floor_epp_us={num}+ sched_epp_us={num}+ ", l), l
    poller = [l for l in lines if l.startswith("POLLER_COST ")]
    assert len(poller) == 1 and re.match(rf"POLLER_COST endpoints=8 idle_cpu_ms_per_s={num}+ per_scrape_us={num}+ ",
                                         poller[0]), poller
    # The poll floors scraped: their per-scrape figures are numbers, not n/a.
    assert re.search(rf" floor_headers_per_scrape_us={num}+ floor_body_per_scrape_us={num}+$", poller[0]), poller
    report = (tmp_path / "report.md").read_text()
    assert "## Per request" in report and "## The poller at idle" in report
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert {(r["variant"], r["prompt"]) for r in runs} == {
        ("plain", "-"), ("pass", "-"), ("parse", "-"), ("module", "hit"), ("module", "new"),
        ("extproc-rr", "-"), ("extproc-sched", "hit"), ("extproc-sched", "new")}
    # The ext_proc runs answered (every request routed by the EPP's header: the pool has no fallback).
    assert all(r["errors"] == 0 and r["requests"] > 0 for r in runs if r["variant"] in be.EXTPROC), runs
    idle = json.loads((tmp_path / "results.json").read_text())["idle"]
    assert all(i["floor_headers_scrapes_per_s"] > 0 and i["floor_body_scrapes_per_s"] > 0 for i in idle), idle


def test_combine_takes_the_median_over_every_run(tmp_path, capsys):
    env = dict(started="s", minutes=1.0, load_start="1 1 1", load_end="2 2 2", quick=False, seconds=8,
               reps=1, idle_seconds=10, connections=8, envoy="1.40.0", wasm_bytes=1, pass_bytes=1,
               metrics_bytes=1, nproc=2)

    def run(cpu_module: float, path: Path) -> str:
        rows = [dict(endpoints=8, body=1024, variant=v, prompt=p, rps=1.0, p50_ms=1.0, p99_ms=1.0,
                     cpu_us_per_req=c, worker_us_per_req=c, errors=0, statuses="")
                for v, p, c in (("plain", "-", 100.0), ("pass", "-", 120.0), ("parse", "-", 130.0),
                                ("module", "hit", cpu_module), ("module", "new", cpu_module))]
        idle = [dict(endpoints=8, plain_ms_per_s=1.0, module_ms_per_s=5.0, scrapes_per_s=40.0)]
        path.write_text(json.dumps({"env": env, "runs": rows, "idle": idle}))
        return str(path)

    paths = [run(c, tmp_path / f"r{c}.json") for c in (150.0, 160.0, 200.0)]
    assert be.combine(paths, tmp_path / "out") == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith(("ENVOY_COST", "POLLER_COST"))]
    # Module medians 160 -> 160 - 120 = 40 over pass, 60 over plain; poller (5 - 1) / 40 s = 100 us.
    assert "ENVOY_COST endpoints=8 body=1024 module_vs_pass_us=40.0 module_vs_plain_us=60.0 prompt=hit" in lines[0]
    assert lines[0].endswith(" worker_parse_vs_pass_us=10.0 worker_module_vs_parse_us=30.0")
    assert lines[-1].startswith("POLLER_COST endpoints=8 idle_cpu_ms_per_s=5.00 per_scrape_us=100.0 ")
    assert "Medians of 3 interleaved repetitions" in (tmp_path / "out" / "report.md").read_text()
