#!/usr/bin/env python3
"""Offline checks of an Envoy bootstrap YAML that runs inference-picker: the mistakes the module
cannot see from inside Envoy, where they would only show as Envoy's own replies at run time.

For every wasm plugin whose `configuration` is an inference-picker document (JSON with
`"version"`), it fails when:
- `filter.max_body_bytes` (default 4194304) is above the `per_connection_buffer_limit_bytes` of
  the listener whose HTTP filter chain runs the plugin (Envoy's default: 1048576). Envoy would
  answer a larger body with its own plain-text 413 before the filter sees it;
- an endpoint address (`endpoints[].address`) is Envoy's admin address, or one of Envoy's own
  listeners: requests or scrapes would go to Envoy itself;
- `poller.cluster` (default `inference_pool_metrics`), or `discovery.kubernetes.api_cluster` when
  discovery is set, names no cluster in `static_resources.clusters`: every scrape fails and, with
  no fresh metrics, every request gets 503.

Usage: check_envoy_config.py ENVOY_YAML...   (exit 1 and one line per problem on failure)
Importable: `problems(doc)` returns the problems of a parsed YAML document."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from envoy_config import plugins

ENVOY_DEFAULT_BUFFER_LIMIT = 1024 * 1024
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_POLLER_CLUSTER = "inference_pool_metrics"
WILDCARDS = {"0.0.0.0", "::", "[::]"}


def _picker_config(plugin: dict) -> dict | None:
    """The inference-picker document of a wasm PluginConfig, if it is one."""
    conf = plugin.get("configuration")
    value = conf.get("value") if isinstance(conf, dict) else conf
    if not isinstance(value, str):
        return None
    try:
        doc = json.loads(value)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and "version" in doc and "models" in doc else None


def _socket(addr: dict | None) -> tuple[str, int] | None:
    sa = (addr or {}).get("socket_address")
    if not isinstance(sa, dict) or "port_value" not in sa:
        return None
    return str(sa.get("address", "")), int(sa["port_value"])


def _split(address: str) -> tuple[str, int] | None:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _same_socket(a: tuple[str, int], b: tuple[str, int]) -> bool:
    return a[1] == b[1] and (a[0] == b[0] or a[0] in WILDCARDS or b[0] in WILDCARDS)


def problems(doc: dict) -> list[str]:
    out: list[str] = []
    static = doc.get("static_resources") or {}
    clusters = {c.get("name") for c in static.get("clusters") or []}
    admin = _socket((doc.get("admin") or {}).get("address"))
    listeners = []
    for i, lst in enumerate(static.get("listeners") or []):
        listeners.append((lst.get("name", f"listeners[{i}]"), _socket(lst.get("address")), lst))

    # Which listener runs each plugin (HTTP filters), and which plugins are bootstrap services.
    in_listener = {}
    for name, _, lst in listeners:
        for p in plugins(lst):
            in_listener[id(p)] = (name, lst)

    for plugin in plugins(doc):
        cfg = _picker_config(plugin)
        if cfg is None:
            continue
        where = plugin.get("name") or plugin.get("root_id") or "wasm plugin"
        if id(plugin) in in_listener:
            lname, lst = in_listener[id(plugin)]
            limit = int(lst.get("per_connection_buffer_limit_bytes", ENVOY_DEFAULT_BUFFER_LIMIT))
            body = int((cfg.get("filter") or {}).get("max_body_bytes", DEFAULT_MAX_BODY_BYTES))
            if body > limit:
                out.append(
                    f"{where}: filter.max_body_bytes {body} is above listener {lname}'s "
                    f"per_connection_buffer_limit_bytes {limit}"
                    + ("" if "per_connection_buffer_limit_bytes" in lst else " (Envoy's default)")
                    + ": Envoy answers larger bodies with a plain-text 413 before the filter sees them"
                )
        for i, ep in enumerate(cfg.get("endpoints") or []):
            addr = _split(str(ep.get("address", "")))
            if addr is None:
                continue
            if admin and _same_socket(addr, admin):
                out.append(f"{where}: endpoints[{i}].address {ep['address']} is Envoy's admin address")
            for lname, sock, _ in listeners:
                if sock and _same_socket(addr, sock):
                    out.append(f"{where}: endpoints[{i}].address {ep['address']} is Envoy's own listener {lname}")
        poller_cluster = (cfg.get("poller") or {}).get("cluster", DEFAULT_POLLER_CLUSTER)
        if poller_cluster not in clusters:
            out.append(f"{where}: poller.cluster {poller_cluster!r} is not a cluster of this config "
                       f"(clusters: {', '.join(sorted(c for c in clusters if c))})")
        k8s = (cfg.get("discovery") or {}).get("kubernetes")
        if isinstance(k8s, dict) and "api_cluster" in k8s and k8s["api_cluster"] not in clusters:
            out.append(f"{where}: discovery.kubernetes.api_cluster {k8s['api_cluster']!r} is not a cluster of this config")
    return out


def check_file(path: Path) -> list[str]:
    return [f"{path}: {p}" for p in problems(yaml.safe_load(Path(path).read_text()))]


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: check_envoy_config.py ENVOY_YAML...", file=sys.stderr)
        return 2
    found = [p for a in argv for p in check_file(Path(a))]
    for p in found:
        print(p)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
