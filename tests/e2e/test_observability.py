"""The decision on the span and in the access log, in a real Envoy 1.40 running envoy/envoy.yaml
as shipped (its access log format and its OpenTelemetry tracer with the decision as custom
tags), with only the access log's path and the collector's port changed: an OTLP/HTTP receiver
(the `opentelemetry-proto` package decodes what Envoy exports) gets each request's span, whose
attributes name the pod the module chose, why, the priority and objective, the prediction, the
queue time and the token usage; the JSON access-log line carries the same; W3C `traceparent`
reaches the pod, in the client's trace when the client sent one."""
import json
import secrets
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import requests
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse)

from harness import LLAMA, Envoy, Sim, endpoint, first_hcm, picker_config, stop_each, wait_until_shown


def read_body(handler) -> bytes:
    """A request body by its content-length, or chunked (what Envoy's exporter sends)."""
    if handler.headers.get("content-length") is not None:
        return handler.rfile.read(int(handler.headers["content-length"]))
    out = b""
    for _ in range(100_000):
        size = int(handler.rfile.readline().split(b";")[0].strip() or b"0", 16)
        if size == 0:
            handler.rfile.readline()
            return out
        out += handler.rfile.read(size)
        handler.rfile.readline()
    raise ValueError("too many chunks")


class OtlpReceiver:
    """An OTLP/HTTP trace receiver on a free loopback port: keeps every span it is sent, with its
    attributes as strings."""

    def __init__(self):
        spans, lock = [], threading.Lock()
        self.spans, self.lock = spans, lock

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = read_body(self)
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                got = []
                for rs in req.resource_spans:
                    service = {a.key: a.value.string_value for a in rs.resource.attributes}.get("service.name")
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            attrs = {a.key: a.value.string_value or str(a.value.int_value) for a in s.attributes}
                            got.append({"trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                                        "parent_span_id": s.parent_span_id.hex(), "name": s.name,
                                        "service": service, "attributes": attrs})
                with lock:
                    spans.extend(got)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def span(self, trace_id: str):
        with self.lock:
            return next((s for s in self.spans if s["trace_id"] == trace_id), None)

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def shipped_with(log: Path, collector_port: int):
    """The shipped envoy.yaml's access log written to `log`, its tracer exporting to the
    receiver, and every span flushed at once (Envoy's runtime keys; the default waits for 5
    spans or 5 s)."""
    def mutate(doc):
        hcm = first_hcm(doc)
        (entry,) = hcm["access_log"]
        entry["typed_config"]["path"] = str(log)
        assert hcm["tracing"]["provider"]["name"] == "envoy.tracers.opentelemetry"
        for c in doc["static_resources"]["clusters"]:
            if c["name"] == "otel_collector":
                sa = c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
                sa["port_value"] = collector_port
        doc["layered_runtime"] = {"layers": [{"name": "test", "static_layer": {
            "tracing.opentelemetry.min_flush_spans": 1, "tracing.opentelemetry.flush_interval_ms": 100}}]}
    return mutate


def log_lines(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def log_line(path: Path, request_id: str):
    return next((l for l in log_lines(path) if l.get("request_id") == request_id), None)


def log_by_trace(path: Path, trace_id: str):
    return next((l for l in log_lines(path) if l.get("trace_id") == trace_id), None)


def chat(envoy, content, headers, stream=False):
    body = {"model": LLAMA, "max_tokens": 6, "stream": stream,
            "messages": [{"role": "user", "content": content}]}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return requests.post(envoy.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def test_span_and_access_log_show_the_decision():
    sims = [Sim(f"otel-{i}") for i in range(2)]
    by_address = {s.address: s for s in sims}
    receiver = OtlpReceiver()
    log = Path(tempfile.mkdtemp(prefix="picker-otel-")) / "access.log"
    cfg = picker_config([endpoint(s) for s in sims], priority={
        "objectives": [{"name": "premium", "priority": 10}], "trust_objective_header": True})
    envoy = Envoy(cfg, concurrency=2, mutate=shipped_with(log, receiver.port))
    try:
        envoy.wait_routable()
        # 1. The client's own trace: Envoy's span is a child of the client's, and the pod gets
        # the same trace id in its traceparent.
        trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
        for s in sims:
            s.reset_stats()
        r = chat(envoy, "tell me where I went", {
            "traceparent": f"00-{trace_id}-{parent}-01",
            "x-gateway-inference-objective": "premium"})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        served = [s for s in sims if s.requests_total() == 1]
        assert len(served) == 1, "exactly one pod saw the request"
        pod = served[0]
        seen = pod.stats()["last_request_headers"]
        # Envoy keeps the client's x-request-id, marking its trace decision in one digit.
        rid = seen["x-request-id"]
        tp = seen.get("traceparent", "")
        assert tp.split("-")[1:2] == [trace_id], f"the pod's traceparent {tp!r} is not in trace {trace_id}"
        span = wait_until_shown(lambda: receiver.span(trace_id), 20, "the request's span at the receiver",
                                lambda: f"{len(receiver.spans)} spans so far; envoy log:\n{envoy.log()}")
        print("receiver got span:", json.dumps(span, indent=2))
        a = span["attributes"]
        assert span["parent_span_id"] == parent
        assert span["service"] == "inference-gateway"
        # The pod that served is the one the span and the log name.
        assert a["inference_picker.endpoint"] == pod.address
        other = next(s.address for s in sims if s is not pod)
        assert a["inference_picker.fallbacks"] == other
        assert a["inference_picker.reason"] in ("load", "prefix_hit"), a
        assert a["inference_picker.priority"] == "10"
        assert a["inference_picker.objective"] == "premium"
        assert a["inference_picker.queue_ms"] == "0"
        assert float(a["inference_picker.predicted_ttft_ms"]) >= 0
        assert a["gen_ai.request.model"] == LLAMA
        assert a["gen_ai.usage.input_tokens"] == str(usage["prompt_tokens"])
        assert a["gen_ai.usage.output_tokens"] == str(usage["completion_tokens"])
        # The pod's traceparent names Envoy's span as its parent.
        assert tp.split("-")[2] == span["span_id"]

        line = wait_until_shown(lambda: log_line(log, rid), 20, "the request's access-log line",
                                lambda: log.read_text() if log.exists() else "(no log)")
        print("access log line:", json.dumps(line))
        assert line["endpoint"] == pod.address == line["upstream"]
        assert line["fallbacks"] == other
        assert line["reason"] == a["inference_picker.reason"]
        assert line["status"] == 200 and line["trace_id"] == trace_id
        assert (line["model"], line["priority"], line["objective"]) == (LLAMA, "10", "premium")
        assert line["queue_ms"] == "0" and line["error"] is None
        assert line["prompt_tokens"] == str(usage["prompt_tokens"])
        assert line["completion_tokens"] == str(usage["completion_tokens"])

        # 2. No client trace, streamed: Envoy starts the trace and the pod is in it; the same
        # session keeps its pod and the log says why.
        for s in sims:
            s.reset_stats()
        r = chat(envoy, "a new conversation", {"x-session-id": "s-1"}, stream=True)
        assert r.status_code == 200, r.text
        (pod2,) = [s for s in sims if s.requests_total() == 1]
        seen2 = pod2.stats()["last_request_headers"]
        rid2, tp2 = seen2["x-request-id"], seen2["traceparent"]
        trace2 = tp2.split("-")[1]
        span2 = wait_until_shown(lambda: receiver.span(trace2), 20, "the streamed request's span",
                                 lambda: f"{len(receiver.spans)} spans so far")
        a2 = span2["attributes"]
        assert a2["inference_picker.endpoint"] == pod2.address
        assert a2["inference_picker.reason"] in ("session", "prefix_hit"), a2
        assert "inference_picker.objective" not in a2, "no objective header: no tag"
        assert int(a2["gen_ai.usage.output_tokens"]) > 0
        line2 = wait_until_shown(lambda: log_line(log, rid2), 20, "the streamed request's log line",
                                 lambda: log.read_text())
        assert line2["trace_id"] == trace2 and line2["endpoint"] == pod2.address
        assert line2["objective"] is None
    finally:
        stop_each(envoy, receiver, *sims)


def test_a_request_the_module_answers_is_logged_with_its_error():
    sim = Sim("otel-err")
    receiver = OtlpReceiver()
    log = Path(tempfile.mkdtemp(prefix="picker-otel-")) / "access.log"
    envoy = Envoy(picker_config([endpoint(sim)]), concurrency=1, mutate=shipped_with(log, receiver.port))
    try:
        envoy.wait_routable()
        sim.reset_stats()
        trace_id = secrets.token_hex(16)
        r = requests.post(envoy.url + "/v1/chat/completions", json={"model": "no-such-model", "messages": [
            {"role": "user", "content": "hi"}]}, timeout=30, headers={
                "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
        assert r.status_code == 404, r.text
        code = r.json()["error"]["code"]
        line = wait_until_shown(lambda: log_by_trace(log, trace_id), 20, "the rejected request's log line",
                                lambda: log.read_text() if log.exists() else "(no log)")
        assert (line["status"], line["reason"], line["error"]) == (404, "rejected", code)
        assert line["endpoint"] is None and line["upstream"] is None
        span = wait_until_shown(lambda: receiver.span(trace_id), 20, "the rejected request's span",
                                lambda: f"{len(receiver.spans)} spans so far")
        assert span["attributes"]["inference_picker.reason"] == "rejected"
        assert span["attributes"]["inference_picker.error"] == code
        assert "inference_picker.endpoint" not in span["attributes"]
        assert sim.requests_total() == 0, "nothing reached the pod"
    finally:
        stop_each(envoy, receiver, sim)
