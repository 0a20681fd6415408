"""Tests of tests/fake_k8s_api.py, the fake API server that e2e tests of pod discovery use."""

import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_k8s_api import FakeK8sApi, SelectorError, parse_selector  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "k8s"
SELECTOR = "app%3Dvllm-llama3-8b-instruct"


def get(api, path, token="s3cret"):
    req = urllib.request.Request(f"http://127.0.0.1:{api.port}{path}")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def pods_file(tmp_path):
    p = tmp_path / "pods.json"
    shutil.copy(FIXTURES / "podlist-inference-namespace.json", p)
    return p


def names(doc):
    return sorted(p["metadata"]["name"].rsplit("-", 1)[1] for p in doc["items"])


def test_serves_the_selected_pods_of_the_namespace(pods_file):
    with FakeK8sApi(pods_file, token="s3cret") as api:
        code, doc = get(api, f"/api/v1/namespaces/inference/pods?labelSelector={SELECTOR}&resourceVersion=0")
        assert code == 200
        assert doc["kind"] == "PodList"
        assert doc["metadata"]["resourceVersion"] == "48377"
        # The six llama pods, whatever their state (filtering by readiness is the module's job);
        # the qwen pod is left out by the selector.
        assert names(doc) == ["b4n8q", "h3j7d", "m2c6w", "p8v1s", "r9t5z", "x7k2p"]
        code, doc = get(api, f"/api/v1/namespaces/other/pods?labelSelector={SELECTOR}")
        assert (code, doc["items"]) == (200, [])
        code, doc = get(api, "/api/v1/pods")
        assert len(doc["items"]) == 7
        assert api.requests == 3


def test_token_is_checked(pods_file):
    with FakeK8sApi(pods_file, token="s3cret") as api:
        code, doc = get(api, "/api/v1/namespaces/inference/pods", token=None)
        assert (code, doc["kind"], doc["reason"]) == (401, "Status", "Unauthorized")
        code, _ = get(api, "/api/v1/namespaces/inference/pods", token="wrong")
        assert code == 401
    with FakeK8sApi(pods_file) as api:  # no token configured: none needed
        code, _ = get(api, "/api/v1/namespaces/inference/pods", token=None)
        assert code == 200


def test_pods_file_can_be_swapped_at_runtime(pods_file, tmp_path):
    with FakeK8sApi(pods_file, token="s3cret") as api:
        _, doc = get(api, f"/api/v1/namespaces/inference/pods?labelSelector={SELECTOR}")
        assert len(doc["items"]) == 6
        # Scale down to one pod, written atomically.
        smaller = json.loads(pods_file.read_text())
        smaller["items"] = smaller["items"][:1]
        tmp = tmp_path / "pods.json.tmp"
        tmp.write_text(json.dumps(smaller))
        os.replace(tmp, pods_file)
        _, doc = get(api, f"/api/v1/namespaces/inference/pods?labelSelector={SELECTOR}")
        assert names(doc) == ["x7k2p"]
        # An API error, injected the same way.
        pods_file.write_text(json.dumps({"kind": "Status", "code": 503, "reason": "ServiceUnavailable"}))
        code, doc = get(api, "/api/v1/namespaces/inference/pods")
        assert (code, doc["reason"]) == (503, "ServiceUnavailable")


def test_bad_selector_and_unknown_path(pods_file):
    with FakeK8sApi(pods_file) as api:
        code, doc = get(api, "/api/v1/namespaces/inference/pods?labelSelector=app%3D%3D%3D")
        assert (code, doc["reason"]) == (400, "BadRequest")
        code, _ = get(api, "/api/v1/namespaces/inference/services")
        assert code == 404
        code, stats = get(api, "/fake/stats", token=None)
        assert code == 200 and stats["requests"] == 1  # only the pod list counts


@pytest.mark.parametrize(
    "selector,labels,expected",
    [
        ("app=a", {"app": "a"}, True),
        ("app==a", {"app": "b"}, False),
        ("app!=a", {}, True),
        ("app=a,tier=gold", {"app": "a"}, False),
        ("app=a,tier=gold", {"app": "a", "tier": "gold"}, True),
        ("app.kubernetes.io/name=vllm", {"app.kubernetes.io/name": "vllm"}, True),
        ("tier", {"tier": ""}, True),
        ("!tier", {"tier": ""}, False),
        ("env in (prod, canary),app", {"env": "canary", "app": "x"}, True),
        ("env notin (prod,canary)", {"env": "prod"}, False),
        ("", {}, True),
    ],
)
def test_selector_syntax(selector, labels, expected):
    assert parse_selector(selector)(labels) is expected


@pytest.mark.parametrize("bad", ["app===a", "env in (a,b", "a=b)", "=a", "app=a b"])
def test_selector_errors(bad):
    with pytest.raises(SelectorError):
        parse_selector(bad)


def test_command_line_prints_its_port(pods_file):
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve().parent / "fake_k8s_api.py"), "--pods", str(pods_file)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("listening on 127.0.0.1:")
        port = int(line.rsplit(":", 1)[1])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/pods", timeout=5) as resp:
            assert len(json.loads(resp.read())["items"]) == 7
    finally:
        proc.terminate()
        proc.wait(timeout=5)
