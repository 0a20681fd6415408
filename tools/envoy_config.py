"""What every script that runs a local Envoy from envoy/envoy.yaml (or a document shaped like it)
shares: free loopback ports, and the patches that put the ports, the .wasm path, the module's
configuration and the cluster members into the parsed document. Used by the e2e harness
(tests/e2e/harness.py), the Envoy benchmark (tools/bench-envoy/bench_envoy.py) and
tools/check_envoy_config.py. Standard library only, so any Python can import it: a script
elsewhere puts this folder on sys.path (`sys.path.insert(0, str(REPO / "tools"))`)."""
from __future__ import annotations

import os
import random
import socket
import time
from pathlib import Path
from typing import Callable, Iterator

# The inference cluster of envoy/envoy.yaml (STATIC, override_host): the module's endpoints.
POOL_CLUSTER = "inference_pool"


def _port_slice() -> tuple[int, int]:
    """The ports this process hands out: below the kernel's ephemeral range, which every
    connect() and bind(("", 0)) draws from (the simulators, Envoy's upstream connections, the
    clients), and a slice of its own per pytest-xdist worker. A port bound with port 0 and then
    released (the old free_port) could be taken by another process's connection before Envoy
    bound it: under two xdist workers one run in twenty failed so ("Address already in use")."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    lo, hi = 10000, max(12000, ephemeral_low)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    span = (hi - lo) // count
    return lo + (index % count) * span, lo + (index % count + 1) * span


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port nobody listens on, never handed out before by this process (see
    `_port_slice`: no other test process and no connection can take it meanwhile)."""
    lo, hi = _port_slice()
    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(2000):
        port = rng.randrange(lo, hi)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {lo}..{hi}")


def dict_nodes(node) -> Iterator[dict]:
    """Every mapping inside a parsed YAML/JSON document, `node` included, depth first (a node is
    yielded before its children are visited, so the caller may change them)."""
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from dict_nodes(v)
    elif isinstance(node, list):
        for v in node:
            yield from dict_nodes(v)


def plugins(doc) -> list[dict]:
    """Every wasm PluginConfig (a mapping with `vm_config` and `configuration`) in `doc`."""
    return [n for n in dict_nodes(doc) if "vm_config" in n and "configuration" in n]


def socket_address(address: str) -> dict:
    """`ip:port` or `[v6]:port` as an Envoy socket_address."""
    host, _, port = address.rpartition(":")
    return {"address": host.strip("[]"), "port_value": int(port)}


def set_ports(doc: dict, port: int, admin_port: int) -> None:
    """The admin port, and the port of the first listener."""
    doc["admin"]["address"]["socket_address"]["port_value"] = admin_port
    doc["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] = port


def first_hcm(doc: dict) -> dict:
    """The HTTP connection manager's typed_config of the first listener's first filter chain."""
    return doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def set_cluster_hosts(doc: dict, cluster: str, hosts: list[str]) -> None:
    """The members (`ip:port` each) of every static cluster named `cluster`, in one locality."""
    for c in doc["static_resources"]["clusters"]:
        if c["name"] == cluster and "load_assignment" in c:
            c["load_assignment"]["endpoints"] = [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": socket_address(h)}}} for h in hosts]}]


def set_module(doc: dict, wasm: Path | str, configuration: str | Callable[[dict], str]) -> None:
    """Every wasm plugin in `doc` loads `wasm` with `configuration` (its JSON text, or a function
    of the plugin's mapping giving it, e.g. by `vm_config.vm_id`)."""
    for node in plugins(doc):
        node["vm_config"]["code"]["local"]["filename"] = str(wasm)
        node["configuration"]["value"] = configuration(node) if callable(configuration) else configuration
