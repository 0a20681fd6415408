#!/usr/bin/env python3
"""Validates the Istio deployment manifests in envoy/istio/.

Each directory under envoy/istio/ holds the manifests for one proxy. Three checks:

1. Schema. Every document of an Istio kind (EnvoyFilter, WasmPlugin, Gateway, VirtualService...)
   is validated against its CRD's openAPIV3Schema from Istio's CRD bundle
   (tests/fixtures/schemas/istio-crds.gen.yaml.gz), turned into a JSON Schema:
   - a field not in the schema is an error (kubectl's default `--validate=strict` rejects it too),
     except under `x-kubernetes-preserve-unknown-fields`;
   - `nullable` allows null, `x-kubernetes-int-or-string` allows both;
   - CEL rules (`x-kubernetes-validations`) cannot be run in general; the forms Istio uses for
     "only one of", "cross-namespace reference not supported" and WasmPlugin's URL scheme are
     checked, the others are counted and reported as notes.
   Note: Istio marks an EnvoyFilter patch's `value` as free-form (preserve-unknown-fields), so the
   schema says nothing about the Envoy configuration inside it; check 3 covers that.
   Other kinds (Service, Deployment, HTTPRoute...) get a shape check (apiVersion, kind, name).
2. Consistency. The module's JSON configuration in every filter, singleton and WasmPlugin parses;
   the filter sets allow_on_headers_stop_iteration, vm_id and failure_policy; the clusters the
   configuration names exist; poller.mode agrees with whether a bootstrap singleton is present,
   and the singleton's configuration equals the filter's.
3. Envoy. The Envoy pieces (EXTENSION_CONFIG, HTTP_FILTER, LISTENER, CLUSTER, HTTP_ROUTE patches,
   a WasmPlugin translated the way Istio does, and the bootstrap override) are applied to a
   minimal Envoy bootstrap, the way istiod would apply them to its own, and the result is checked
   with `envoy --mode validate`, which checks every field and loads the .wasm (running
   on_vm_start and on_configure with the manifest's configuration). The module image reference
   and in-pod file paths are replaced by the local .wasm and a test CA file.
   Validate mode does not start bootstrap extensions, so a singleton's configuration is not run
   through the module there; check 2 requires it to equal the filter's, which is.

Usage:
    validate_manifests.py [--envoy .venv/bin/envoy --wasm target/.../inference_picker.wasm]
                          [--keep DIR] [DIR ...]
Without --envoy, check 3 is skipped. Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import yaml

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "envoy" / "istio"
ISTIO_CRDS = REPO / "tests" / "fixtures" / "schemas" / "istio-crds.gen.yaml.gz"
TEST_CA = REPO / "tests" / "fixtures" / "deploy" / "test-ca.crt"

WASM_FILTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
HCM = "envoy.filters.network.http_connection_manager"
ROUTER = "envoy.filters.http.router"
VM_ID = "inference-picker"
IN_POD_CA = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"

# Kinds that are not Istio CRDs but appear in the examples: checked for shape only.
KNOWN_OTHER = {
    ("v1", "Service"), ("v1", "ConfigMap"), ("v1", "Secret"), ("v1", "ServiceAccount"),
    ("apps/v1", "Deployment"), ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("gateway.networking.k8s.io/v1", "Gateway"), ("gateway.networking.k8s.io/v1", "HTTPRoute"),
}
CLUSTER_SCOPED = set()


# ---------------------------------------------------------------- schema conversion

def openapi_to_jsonschema(node):
    """openAPIV3Schema (Kubernetes structural schema) -> JSON Schema (draft 2020-12)."""
    if isinstance(node, list):
        return [openapi_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k in ("description", "x-kubernetes-validations", "x-kubernetes-list-type",
                 "x-kubernetes-list-map-keys", "x-kubernetes-map-type", "format"):
            continue
        if k in ("properties", "patternProperties", "definitions"):
            out[k] = {name: openapi_to_jsonschema(s) for name, s in v.items()}
        elif k in ("items", "additionalProperties", "not"):
            out[k] = openapi_to_jsonschema(v) if isinstance(v, (dict, list)) else v
        elif k in ("allOf", "anyOf", "oneOf"):
            out[k] = [openapi_to_jsonschema(s) for s in v]
        elif k.startswith("x-kubernetes-"):
            continue
        else:
            out[k] = v
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    preserve = node.get("x-kubernetes-preserve-unknown-fields", False)
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out and not preserve:
        out["additionalProperties"] = False
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    out.pop("nullable", None)
    return out


_ONE_OF_RULE = re.compile(r"^\s*(\(has\(self\.(\w+)\) \? 1 : 0\)\s*\+?\s*)+<=\s*1\s*$")


def cel_rules(node, path=""):
    """Yields (json path, rule, message) of every x-kubernetes-validations rule in a schema."""
    if isinstance(node, dict):
        for r in node.get("x-kubernetes-validations", []) or []:
            yield path, r.get("rule", ""), r.get("message", "")
        for k, v in (node.get("properties") or {}).items():
            yield from cel_rules(v, f"{path}.{k}" if path else k)
        if isinstance(node.get("items"), dict):
            yield from cel_rules(node["items"], f"{path}[]")


def _values_at(doc, path):
    """Every value at a schema path like `spec.targetRefs[].namespace` (`[]` = each element)."""
    nodes = [doc]
    for part in [p for p in path.split(".") if p]:
        each = part.endswith("[]")
        key = part[:-2] if each else part
        nxt = []
        for n in nodes:
            if isinstance(n, dict) and key in n:
                v = n[key]
                nxt.extend(v if each and isinstance(v, list) else [] if each else [v])
        nodes = nxt
    return nodes


def check_cel(doc, schema) -> tuple[list[str], int]:
    """Runs the CEL rule forms this script understands on `doc`; returns errors and how many
    rules were skipped. Understood: "only one of" (`(has(self.a) ? 1 : 0) + ... <= 1`), "must be
    empty" (`self.size() == 0`), and WasmPlugin's URL scheme rule."""
    errors, skipped = [], 0
    for path, rule, message in cel_rules(schema):
        if _ONE_OF_RULE.match(rule):
            fields = re.findall(r"has\(self\.(\w+)\)", rule)
            for target in _values_at(doc, path):
                if isinstance(target, dict) and sum(1 for f in fields if f in target) > 1:
                    errors.append(f"{path or '<root>'}: {message}")
        elif rule.strip() == "self.size() == 0":
            for target in _values_at(doc, path):
                if target:
                    errors.append(f"{path}: {message}")
        elif "getScheme() in" in rule and path.endswith("url"):
            for target in _values_at(doc, path):
                scheme = target.split("://", 1)[0] if "://" in str(target) else ""
                if scheme not in ("", "http", "https", "oci", "file"):
                    errors.append(f"{path}: {message}")
        else:
            skipped += 1
    return errors, skipped


@dataclass
class Crd:
    group: str
    kind: str
    namespaced: bool
    versions: dict  # version -> (json schema, raw openapi schema)


def load_crds(path: Path = ISTIO_CRDS) -> dict[tuple[str, str], Crd]:
    """(apiVersion, kind) -> Crd, for every served version."""
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    out = {}
    for d in yaml.safe_load_all(text):
        if not d or d.get("kind") != "CustomResourceDefinition":
            continue
        spec = d["spec"]
        crd = Crd(spec["group"], spec["names"]["kind"], spec.get("scope") == "Namespaced", {})
        for v in spec["versions"]:
            if not v.get("served", True):
                continue
            raw = v["schema"]["openAPIV3Schema"]
            crd.versions[v["name"]] = (openapi_to_jsonschema(raw), raw)
            out[(f"{crd.group}/{v['name']}", crd.kind)] = crd
    return out


# ---------------------------------------------------------------- reports

@dataclass
class Report:
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checked: int = 0

    def error(self, where, msg):
        self.errors.append(f"{where}: {msg}")


def rel(p: Path) -> str:
    try:
        return str(p.relative_to(REPO))
    except ValueError:
        return str(p)


def load_docs(path: Path):
    try:
        return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except yaml.YAMLError as e:
        raise SystemExit(f"{rel(path)}: not YAML: {e}")


def check_schema(path: Path, docs, crds, report: Report):
    for i, doc in enumerate(docs):
        where = f"{rel(path)}#{i} ({doc.get('kind', '?')} {doc.get('metadata', {}).get('name', '?')})"
        report.checked += 1
        api, kind = doc.get("apiVersion"), doc.get("kind")
        md = doc.get("metadata") or {}
        if not api or not kind or not md.get("name"):
            report.error(where, "needs apiVersion, kind and metadata.name")
            continue
        crd = crds.get((api, kind))
        if crd is None:
            if (api, kind) not in KNOWN_OTHER:
                report.error(where, f"unknown apiVersion/kind {api} {kind}")
            if "namespace" not in md:
                report.error(where, "metadata.namespace is missing: say where it goes")
            continue
        if crd.namespaced and "namespace" not in md:
            report.error(where, "metadata.namespace is missing: say where it goes")
        schema, raw = crd.versions[api.split("/", 1)[1]]
        body = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind", "metadata")}
        validator = jsonschema.Draft202012Validator(schema)
        for err in sorted(validator.iter_errors(body), key=lambda e: list(e.absolute_path)):
            loc = ".".join(str(p) for p in err.absolute_path) or "<root>"
            report.error(where, f"{loc}: {err.message}")
        cel_errors, skipped = check_cel(body, raw)
        for e in cel_errors:
            report.error(where, e)
        if skipped:
            report.notes.append(f"{where}: {skipped} CEL rule(s) not evaluated")


# ---------------------------------------------------------------- the proxy model

@dataclass
class Proxy:
    """What one directory's manifests put into one proxy."""
    directory: Path
    extension_configs: dict = field(default_factory=dict)  # name -> TypedExtensionConfig
    patches: list = field(default_factory=list)  # (applyTo, match, patch)
    wasm_plugins: list = field(default_factory=list)
    bootstrap_overrides: list = field(default_factory=list)  # custom_bootstrap.json dicts


def collect(directory: Path) -> Proxy:
    proxy = Proxy(directory)
    for path in sorted(directory.glob("*.yaml")):
        for doc in load_docs(path):
            kind = doc.get("kind")
            if kind == "EnvoyFilter":
                for cp in doc["spec"].get("configPatches", []):
                    apply_to, patch = cp["applyTo"], cp["patch"]
                    if apply_to == "EXTENSION_CONFIG":
                        proxy.extension_configs[patch["value"]["name"]] = patch["value"]
                    else:
                        proxy.patches.append((apply_to, cp.get("match", {}), patch))
            elif kind == "WasmPlugin":
                proxy.wasm_plugins.append(doc)
            elif kind == "ConfigMap" and "custom_bootstrap.json" in (doc.get("data") or {}):
                proxy.bootstrap_overrides.append(json.loads(doc["data"]["custom_bootstrap.json"]))
    return proxy


def wasm_plugin_filter(wp: dict) -> dict:
    """An HTTP filter the way Istio builds one from a WasmPlugin: no vm_id, and none of the
    Envoy-only fields (allow_on_headers_stop_iteration) WasmPlugin has no field for."""
    spec = wp["spec"]
    policy = {"FAIL_CLOSE": "FAIL_CLOSED", "FAIL_OPEN": "FAIL_OPEN", "FAIL_RELOAD": "FAIL_RELOAD"}
    env = spec.get("vmConfig", {}).get("env", [])
    vm = {"runtime": "envoy.wasm.runtime.v8", "code": {"remote": {"http_uri": {"uri": spec["url"]}}}}
    host_keys = [e["name"] for e in env if e.get("valueFrom") == "HOST"]
    inline = {e["name"]: e.get("value", "") for e in env if e.get("valueFrom", "INLINE") == "INLINE"}
    if host_keys or inline:
        vm["environment_variables"] = {k: v for k, v in (("host_env_keys", host_keys), ("key_values", inline)) if v}
    config = {
        "name": f"{wp['metadata']['namespace']}.{wp['metadata']['name']}",
        "root_id": spec.get("pluginName", ""),
        "vm_config": vm,
        "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue",
                          "value": json.dumps(spec.get("pluginConfig", {}))},
        "failure_policy": policy[spec.get("failStrategy", "FAIL_CLOSE")],
    }
    return {"name": config["name"], "typed_config": {"@type": WASM_FILTER_TYPE, "config": config}}


def module_configs(proxy: Proxy):
    """(where, plugin config dict with vm_config etc., role) for every wasm VM of the module."""
    for name, ext in proxy.extension_configs.items():
        yield f"EXTENSION_CONFIG {name}", ext["typed_config"]["config"], "filter"
    for wp in proxy.wasm_plugins:
        yield f"WasmPlugin {wp['metadata']['name']}", wasm_plugin_filter(wp)["typed_config"]["config"], "wasmplugin"
    for boot in proxy.bootstrap_overrides:
        for ext in boot.get("bootstrap_extensions", []):
            tc = ext.get("typed_config", {})
            if tc.get("@type", "").endswith("WasmService"):
                yield f"bootstrap {ext.get('name')}", tc["config"], "singleton"


FILTER_CONFIG_TYPE = "type.googleapis.com/envoy.config.route.v3.FilterConfig"


def check_scoping(proxy: Proxy, report: Report):
    """Scoped insertion (issue 13): every picker filter the manifests insert is disabled on the
    listener and enabled by at least one HTTP_ROUTE patch, so that routes that do not point at an
    inference pool never reach the module. (A WasmPlugin has no such switch: see its file.)"""
    where = rel(proxy.directory)
    enabled = set()
    for apply_to, _, patch in proxy.patches:
        if apply_to == "HTTP_ROUTE":
            for name, fc in (patch.get("value", {}).get("typed_per_filter_config") or {}).items():
                if fc.get("@type") == FILTER_CONFIG_TYPE and not fc.get("disabled", False):
                    enabled.add(name)
    for apply_to, _, patch in proxy.patches:
        value = patch.get("value", {})
        if apply_to == "HTTP_FILTER" and value.get("name") in proxy.extension_configs:
            name = value["name"]
            if value.get("disabled") is not True:
                report.error(where, f"HTTP_FILTER {name!r} is not disabled on the listener: it would act on "
                                    "every route (scoped insertion: disabled: true, enabled per route)")
            if name not in enabled:
                report.error(where, f"no HTTP_ROUTE patch enables {name!r} (typed_per_filter_config FilterConfig)")


# The tag names the module's metric names carry (`crate::telemetry::TAGS`).
STATS_TAGS = ("pool", "model", "endpoint", "outcome", "reason", "priority", "tenant", "class")


def check_stats_tags(proxy: Proxy, report: Report):
    """Issue 13: the filter's metric labels are extracted on Istio too: a bootstrap override
    (custom_bootstrap.json) adds a stats tag for each, with the regex envoy/envoy.yaml uses."""
    have = {}
    for boot in proxy.bootstrap_overrides:
        for t in (boot.get("stats_config") or {}).get("stats_tags", []):
            have[t.get("tag_name")] = t.get("regex")
    for tag in STATS_TAGS:
        want = f"(;{tag}=([^;]*))"
        if have.get(tag) != want:
            report.error(rel(proxy.directory), f"no stats tag {tag!r} with regex {want!r} in a bootstrap override "
                                               "(custom_bootstrap.json stats_config.stats_tags): the metric label is lost")


def check_consistency(proxy: Proxy, report: Report):
    where = rel(proxy.directory)
    cluster_names = {p["value"]["name"] for a, _, p in proxy.patches if a == "CLUSTER" and p["operation"] == "ADD"}
    has_singleton = any(role == "singleton" for _, _, role in module_configs(proxy))
    parsed = {}
    for what, cfg, role in module_configs(proxy):
        try:
            doc = json.loads(cfg["configuration"]["value"])
        except (KeyError, ValueError) as e:
            report.error(f"{where} {what}", f"module configuration is not JSON: {e}")
            continue
        parsed[what] = (doc, role)
        poller = doc.get("poller", {})
        mode = poller.get("mode", "singleton")
        if role == "wasmplugin":
            if mode != "lease":
                report.error(f"{where} {what}", "a WasmPlugin cannot be paired with the singleton (no vm_id): use poller.mode lease")
            continue
        # Several pools: each its own vm_id (its own shared data and poller), named after it.
        pool = doc.get("pool") or {}
        want_vm = f"{VM_ID}-{pool['name']}" if pool.get("name") else VM_ID
        if cfg.get("vm_config", {}).get("vm_id") != want_vm:
            report.error(f"{where} {what}", f"vm_config.vm_id must be {want_vm!r} (shared data is per vm_id)")
        if role == "filter":
            if cfg.get("allow_on_headers_stop_iteration") is not True:
                report.error(f"{where} {what}", "allow_on_headers_stop_iteration must be true (body-based routing)")
            if not cfg.get("failure_policy"):
                report.error(f"{where} {what}", "failure_policy must be set")
            if cfg.get("root_id") != "inference-picker":
                report.error(f"{where} {what}", "root_id must be inference-picker")
        if role == "singleton" and cfg.get("root_id") != "inference-picker-poller":
            report.error(f"{where} {what}", "the singleton's root_id must be inference-picker-poller")
        want_mode = "singleton" if has_singleton else "lease"
        if mode != want_mode:
            report.error(f"{where} {what}", f"poller.mode is {mode!r} but this proxy {'has' if has_singleton else 'has no'} bootstrap singleton: use {want_mode!r}")
        needed = {poller.get("cluster", "inference_pool_metrics")}
        k8s = (doc.get("discovery") or {}).get("kubernetes")
        if k8s:
            needed.add(k8s.get("api_cluster", "kubernetes_api"))
        for c in sorted(needed - cluster_names):
            report.error(f"{where} {what}", f"names cluster {c!r}, which no CLUSTER patch adds")
    filters = [doc for doc, role in parsed.values() if role == "filter"]
    singletons = [doc for doc, role in parsed.values() if role == "singleton"]
    for s in singletons:
        same_pool = [f for f in filters if (f.get("pool") or {}).get("name") == (s.get("pool") or {}).get("name")]
        if any(f != s for f in same_pool):
            report.error(where, "the singleton's configuration differs from the filter's: both roles must read the same document")
    check_scoping(proxy, report)
    check_stats_tags(proxy, report)
    for apply_to, _, patch in proxy.patches:
        if apply_to == "HTTP_FILTER" and "config_discovery" in patch.get("value", {}):
            name = patch["value"]["name"]
            if name not in proxy.extension_configs:
                report.error(where, f"HTTP_FILTER {name!r} discovers a config that no EXTENSION_CONFIG defines")
    # The data clusters: inference_pool, or one inference_pool_<pool> per pool.
    data_clusters = {n for n in cluster_names if n == "inference_pool"
                     or (n.startswith("inference_pool_") and n not in ("inference_pool_metrics",))}
    if not data_clusters:
        report.error(where, "no CLUSTER patch adds the data cluster inference_pool")
    for apply_to, _, patch in proxy.patches:
        value = patch.get("value", {})
        if apply_to == "CLUSTER" and value.get("name") in data_clusters:
            policies = value.get("load_balancing_policy", {}).get("policies", [])
            lb = policies[0].get("typed_extension_config", {}) if policies else {}
            if lb.get("name") != "envoy.load_balancing_policies.override_host":
                report.error(where, "inference_pool must use the override_host policy (fallbacks on retry)")
            else:
                fb = lb["typed_config"].get("fallback_policy", {}).get("policies", [{}])[0]
                if fb.get("typed_extension_config", {}).get("typed_config", {}).get("fallback_policy") != "NO_FALLBACK":
                    report.error(where, "inference_pool's fallback policy must find no host (a NO_FALLBACK subset): "
                                        "never a pod the picker did not list")
        if apply_to == "HTTP_ROUTE" and value.get("route", {}).get("cluster") in data_clusters:
            if "retry_policy" not in value["route"]:
                report.error(where, "the route to inference_pool has no retry_policy: fallbacks are never tried")
    if not any(a == "HTTP_ROUTE" for a, _, _ in proxy.patches):
        report.error(where, "no HTTP_ROUTE patch sends traffic to inference_pool")


# ---------------------------------------------------------------- Envoy assembly

def merge(dst, src):
    """Protobuf-style merge of JSON: maps merge, lists append, scalars replace."""
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            merge(dst[k], v)
        elif isinstance(v, list) and isinstance(dst.get(k), list):
            dst[k].extend(copy.deepcopy(v))
        else:
            dst[k] = copy.deepcopy(v)
    return dst


def localize(node, wasm: Path, ca: Path):
    """Points every wasm code source at the local .wasm and in-pod files at local ones."""
    if isinstance(node, dict):
        vm = node.get("vm_config")
        if isinstance(vm, dict) and "code" in vm:
            vm["code"] = {"local": {"filename": str(wasm)}}
        for k, v in node.items():
            if k == "filename" and v == IN_POD_CA:
                node[k] = str(ca)
            else:
                localize(v, wasm, ca)
    elif isinstance(node, list):
        for v in node:
            localize(v, wasm, ca)
    return node


def route_names(proxy: Proxy):
    names = []
    for apply_to, match, _ in proxy.patches:
        if apply_to == "HTTP_ROUTE":
            name = match.get("routeConfiguration", {}).get("vhost", {}).get("route", {}).get("name")
            if name:
                names.append(name)
    return names or ["default"]


def assemble(proxy: Proxy, wasm: Path, ca: Path = TEST_CA) -> dict:
    """A minimal Envoy bootstrap standing in for istiod's output, with the manifests' patches
    applied to it."""
    routes = [{"name": n, "match": {"prefix": f"/{i}/"}, "route": {"cluster": "outbound|8000||placeholder"}}
              for i, n in enumerate(route_names(proxy))]
    filters = [{"name": ROUTER, "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]
    listener = {
        "name": "0.0.0.0_80",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": 10080}},
        "filter_chains": [{"filters": [{"name": HCM, "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "outbound_0.0.0.0_80",
            "route_config": {"name": "http.80", "virtual_hosts": [{"name": "*:80", "domains": ["*"], "routes": routes}]},
            "http_filters": filters}}]}],
    }
    clusters = [
        {"name": "xds-grpc", "type": "STATIC", "connect_timeout": "1s",
         "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
             "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
             "explicit_http_config": {"http2_protocol_options": {}}}},
         "load_assignment": {"cluster_name": "xds-grpc", "endpoints": [{"lb_endpoints": [
             {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 15010}}}}]}]}},
        {"name": "outbound|8000||placeholder", "type": "STATIC", "connect_timeout": "1s",
         "load_assignment": {"cluster_name": "outbound|8000||placeholder", "endpoints": []}},
    ]
    bootstrap = {
        "node": {"id": "validate~127.0.0.1~validate.test~test.svc.cluster.local", "cluster": "validate"},
        "dynamic_resources": {"ads_config": {"api_type": "GRPC", "transport_api_version": "V3",
                                             "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}]}},
        "static_resources": {"listeners": [listener], "clusters": clusters},
    }
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    for apply_to, match, patch in proxy.patches:
        op, value = patch["operation"], copy.deepcopy(patch.get("value", {}))
        if apply_to == "LISTENER" and op == "MERGE":
            merge(listener, value)
        elif apply_to == "CLUSTER" and op == "ADD":
            clusters.append(value)
        elif apply_to == "HTTP_FILTER":
            if "config_discovery" in value:
                # Standing in for ECDS: the discovered config becomes the default, applied at once.
                ext = proxy.extension_configs.get(value["name"])
                if ext is not None:
                    value["config_discovery"]["default_config"] = copy.deepcopy(ext["typed_config"])
                    value["config_discovery"]["apply_default_config_without_warming"] = True
            router_at = next(i for i, f in enumerate(hcm["http_filters"]) if f["name"] == ROUTER)
            if op == "INSERT_BEFORE":
                hcm["http_filters"].insert(router_at, value)
            elif op == "INSERT_FIRST":
                hcm["http_filters"].insert(0, value)
            else:
                raise ValueError(f"HTTP_FILTER operation {op} is not modelled")
        elif apply_to == "NETWORK_FILTER" and op == "MERGE":
            name = match.get("listener", {}).get("filterChain", {}).get("filter", {}).get("name")
            if name != HCM:
                raise ValueError(f"NETWORK_FILTER MERGE on {name!r} is not modelled")
            merge(listener["filter_chains"][0]["filters"][0], value)
        elif apply_to == "HTTP_ROUTE" and op == "MERGE":
            name = match.get("routeConfiguration", {}).get("vhost", {}).get("route", {}).get("name")
            for r in routes:
                if r["name"] == name:
                    # The route action is a protobuf oneof: Istio's MERGE of one member
                    # (direct_response) replaces another (route), as proto.Merge does.
                    actions = ("route", "redirect", "direct_response")
                    if any(a in value for a in actions):
                        for a in actions:
                            if a not in value:
                                r.pop(a, None)
                    merge(r, value)
        else:
            raise ValueError(f"{apply_to} {op} is not modelled by the validator")
    for wp in proxy.wasm_plugins:
        router_at = next(i for i, f in enumerate(hcm["http_filters"]) if f["name"] == ROUTER)
        hcm["http_filters"].insert(router_at, wasm_plugin_filter(wp))
    for boot in proxy.bootstrap_overrides:
        merge(bootstrap, boot)
    return localize(bootstrap, wasm, ca)


def envoy_validate(envoy: Path, bootstrap: dict, keep: Path | None, name: str) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = (keep or Path(tmp)) / f"{name}.yaml"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
        r = subprocess.run(
            [str(envoy), "--mode", "validate", "-c", str(out), "-l", "error",
             "--use-dynamic-base-id", "--disable-hot-restart"],
            capture_output=True, text=True, timeout=180,
        )
    return r.returncode == 0, (r.stdout[-4000:] + r.stderr[-4000:]).strip()


# ---------------------------------------------------------------- main

def proxy_dirs(root: Path = MANIFESTS):
    return sorted(d for d in root.iterdir() if d.is_dir())


def run(dirs, envoy: Path | None, wasm: Path | None, keep: Path | None = None, out=sys.stdout) -> Report:
    crds = load_crds()
    report = Report()
    for d in dirs:
        for path in sorted(d.glob("*.yaml")):
            check_schema(path, load_docs(path), crds, report)
        proxy = collect(d)
        if not (proxy.extension_configs or proxy.wasm_plugins):
            continue
        check_consistency(proxy, report)
        if envoy is None:
            continue
        ok, log = envoy_validate(envoy, assemble(proxy, wasm), keep, d.name)
        print(f"{'OK  ' if ok else 'FAIL'} envoy --mode validate: {rel(d)}", file=out)
        if not ok:
            report.error(rel(d), f"envoy --mode validate failed:\n{log}")
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Validate envoy/istio manifests (schemas, consistency, Envoy).")
    ap.add_argument("dirs", nargs="*", type=Path, help="proxy directories (default: every one under envoy/istio)")
    ap.add_argument("--envoy", type=Path, help="Envoy binary; without it the Envoy check is skipped")
    ap.add_argument("--wasm", type=Path, default=REPO / "target/wasm32-wasip1/release/inference_picker.wasm")
    ap.add_argument("--keep", type=Path, help="write the assembled Envoy bootstraps here")
    args = ap.parse_args(argv)
    if args.envoy and not args.wasm.is_file():
        print(f"error: {args.wasm} not found (cargo build -p inference-picker --target wasm32-wasip1 --release)", file=sys.stderr)
        return 2
    dirs = [d.resolve() for d in args.dirs] or proxy_dirs()
    report = run(dirs, args.envoy, args.wasm.resolve(), args.keep)
    for n in report.notes:
        print(f"note: {n}")
    for e in report.errors:
        print(f"ERROR {e}", file=sys.stderr)
    print(f"{report.checked} documents in {len(dirs)} directories: "
          f"{'OK' if not report.errors else f'{len(report.errors)} error(s)'}")
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
