#!/usr/bin/env python3
"""A fake Kubernetes API server that serves a pod list, for end-to-end tests of pod discovery.

Standard library only. It answers what the module's poller sends:

    GET /api/v1/namespaces/NS/pods?labelSelector=...&resourceVersion=0
    GET /api/v1/pods?labelSelector=...          (all namespaces)

- The pods come from a JSON file (a PodList, e.g. tests/fixtures/k8s/*.json), read again on every
  request, so a test changes the pool by rewriting the file (write a temporary file and
  os.replace() it, so that a request never sees half a file).
- If the file holds a `Status` object (`{"kind": "Status", "code": 503, ...}`), that object is
  served with its code instead: how a test injects API errors.
- With a token, every API request must carry `Authorization: Bearer TOKEN`; otherwise 401 with a
  Status body, as a real API server answers.
- labelSelector supports the Kubernetes syntax: `k=v`, `k==v`, `k!=v`, `k`, `!k`,
  `k in (a,b)`, `k notin (a,b)`; a malformed selector gets 400.
- `GET /fake/stats` (no auth) returns how many API requests were served and the last path,
  so a test can check the refresh period.

Command line:
    python3 tests/fake_k8s_api.py --pods FILE [--token T] [--host 127.0.0.1] [--port 0]
prints `listening on HOST:PORT` once it is ready. In-process (pytest):
    with FakeK8sApi(pods_file, token="t") as api: ... api.port ...
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

_POD_PATH = re.compile(r"^/api/v1/(?:namespaces/(?P<ns>[a-z0-9]([-a-z0-9]*[a-z0-9])?)/)?pods$")
_KEY = r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?"
_VALUE = r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?"


class SelectorError(ValueError):
    pass


def _split_requirements(selector: str) -> list[str]:
    """Splits on commas outside parentheses: `a in (x,y),b=c` is two requirements."""
    parts, depth, cur = [], 0, []
    for ch in selector:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise SelectorError("unbalanced ')'")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise SelectorError("unbalanced '('")
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def parse_selector(selector: str):
    """Returns a predicate over a labels dict. An empty selector matches everything."""
    if not selector.strip():
        return lambda labels: True
    checks = []
    for req in _split_requirements(selector):
        m = re.fullmatch(rf"({_KEY})\s+(in|notin)\s+\(([^()]*)\)", req)
        if m:
            key, op = m.group(1), m.group(3)
            values = {v.strip() for v in m.group(4).split(",")}
            if not all(re.fullmatch(_VALUE, v) for v in values):
                raise SelectorError(f"bad value in {req!r}")
            if op == "in":
                checks.append(lambda l, k=key, vs=values: l.get(k) in vs)
            else:
                checks.append(lambda l, k=key, vs=values: l.get(k) not in vs)
            continue
        m = re.fullmatch(rf"({_KEY})\s*(==|=|!=)\s*({_VALUE})", req)
        if m:
            key, op, value = m.group(1), m.group(3), m.group(4)
            if op == "!=":
                checks.append(lambda l, k=key, v=value: l.get(k) != v)
            else:
                checks.append(lambda l, k=key, v=value: l.get(k) == v)
            continue
        m = re.fullmatch(rf"(!?)\s*({_KEY})", req)
        if m:
            negate, key = m.group(1) == "!", m.group(2)
            checks.append(lambda l, k=key, n=negate: (k in l) != n)
            continue
        raise SelectorError(f"cannot parse requirement {req!r}")
    return lambda labels: all(c(labels) for c in checks)


def _status(code: int, reason: str, message: str) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet: tests read stdout
        if self.server.verbose:
            super().log_message(fmt, *args)

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 (http.server's naming)
        url = urlsplit(self.path)
        if url.path == "/fake/stats":
            with self.server.lock:
                self._send(200, {"requests": self.server.requests, "last_path": self.server.last_path})
            return
        m = _POD_PATH.match(url.path)
        if not m:
            self._send(404, _status(404, "NotFound", f"the server could not find the requested resource ({url.path})"))
            return
        with self.server.lock:
            self.server.requests += 1
            self.server.last_path = self.path
        if self.server.token is not None:
            if self.headers.get("authorization", "") != f"Bearer {self.server.token}":
                self._send(401, _status(401, "Unauthorized", "Unauthorized"))
                return
        query = parse_qs(url.query)
        try:
            matches = parse_selector(query.get("labelSelector", [""])[0])
        except SelectorError as e:
            self._send(400, _status(400, "BadRequest", f"unable to parse requirement: {e}"))
            return
        try:
            doc = json.loads(Path(self.server.pods_file).read_text())
        except (OSError, ValueError) as e:
            self._send(500, _status(500, "InternalError", f"fake: cannot read pods file: {e}"))
            return
        if doc.get("kind") == "Status":
            self._send(int(doc.get("code", 500)), doc)
            return
        ns = m.group("ns")
        items = [
            pod
            for pod in doc.get("items") or []
            if (ns is None or pod.get("metadata", {}).get("namespace", ns) == ns)
            and matches(pod.get("metadata", {}).get("labels") or {})
        ]
        rv = doc.get("metadata", {}).get("resourceVersion", "1")
        self._send(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": rv}, "items": items})


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr, pods_file, token, verbose):
        super().__init__(addr, _Handler)
        self.pods_file = str(pods_file)
        self.token = token
        self.verbose = verbose
        self.lock = threading.Lock()
        self.requests = 0
        self.last_path = None


class FakeK8sApi:
    """The fake server on a background thread, for use from Python tests."""

    def __init__(self, pods_file, token: str | None = None, host: str = "127.0.0.1", port: int = 0):
        self._server = _Server((host, port), pods_file, token, verbose=False)
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-k8s-api", daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def requests(self) -> int:
        with self._server.lock:
            return self._server.requests

    def __enter__(self) -> "FakeK8sApi":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", required=True, help="PodList (or Status) JSON file, re-read on every request")
    ap.add_argument("--token", default=None, help="required bearer token (default: none required)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 picks a free port")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    server = _Server((args.host, args.port), args.pods, args.token, args.verbose)
    host, port = server.server_address[:2]
    print(f"listening on {host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
