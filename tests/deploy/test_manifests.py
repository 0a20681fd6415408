"""Validates envoy/istio/ (see validate_manifests.py), and checks that the validator itself
catches the mistakes it is meant to catch."""

import copy
import json
import os
import shutil
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import validate_manifests as vm  # noqa: E402

REPO = vm.REPO
ENVOY = Path(os.environ.get("ENVOY", REPO / ".venv" / "bin" / "envoy"))
WASM = Path(os.environ.get("WASM", REPO / "target" / "wasm32-wasip1" / "release" / "inference_picker.wasm"))


def test_every_manifest_passes_schema_and_consistency_checks():
    dirs = vm.proxy_dirs()
    assert {d.name for d in dirs} >= {"gateway-api", "ingress", "sidecar", "sidecar-singleton", "wasmplugin"}
    report = vm.run(dirs, envoy=None, wasm=None)
    assert report.errors == []
    assert report.checked >= 20


def test_every_proxy_config_passes_envoy_validate():
    """The assembled bootstraps pass `envoy --mode validate` with the real module (built by
    `make wasm`), which also runs on_configure on each manifest's configuration."""
    assert ENVOY.is_file(), f"{ENVOY} missing: make venv (or set ENVOY)"
    assert WASM.is_file(), f"{WASM} missing: make wasm (or set WASM)"
    report = vm.run(vm.proxy_dirs(), envoy=ENVOY, wasm=WASM)
    assert report.errors == [], "\n".join(report.errors)


# ---- the validator catches mistakes ----------------------------------------------------------

@pytest.fixture
def crds():
    return vm.load_crds()


def load(name):
    return vm.load_docs(vm.MANIFESTS / name)


def schema_errors(crds, docs):
    report = vm.Report()
    vm.check_schema(Path("test.yaml"), docs, crds, report)
    return report.errors


def test_schema_rejects_a_typo_bad_enum_and_conflicting_selectors(crds):
    ef = load("gateway-api/envoyfilter.yaml")[0]
    assert schema_errors(crds, [ef]) == []

    typo = copy.deepcopy(ef)
    typo["spec"]["configPatches"][1]["patch"]["operaton"] = "INSERT_BEFORE"
    errs = schema_errors(crds, [typo])
    assert len(errs) == 1 and "'operaton' was unexpected" in errs[0], errs

    bad_enum = copy.deepcopy(ef)
    bad_enum["spec"]["configPatches"][1]["applyTo"] = "HTTP_FILTERS"
    assert any("HTTP_FILTERS" in e for e in schema_errors(crds, [bad_enum]))

    both = copy.deepcopy(ef)
    both["spec"]["workloadSelector"] = {"labels": {"istio": "ingressgateway"}}
    assert any("only one of targetRefs or workloadSelector" in e for e in schema_errors(crds, [both]))

    cross_ns = copy.deepcopy(ef)
    cross_ns["spec"]["targetRefs"][0]["namespace"] = "other"
    assert any("cross namespace" in e for e in schema_errors(crds, [cross_ns]))


def test_schema_leaves_patch_values_free_form_but_checks_wasmplugin_fields(crds):
    ef = load("gateway-api/envoyfilter.yaml")[0]
    free = copy.deepcopy(ef)
    # Istio marks `value` as preserve-unknown-fields: anything goes there (Envoy checks it).
    free["spec"]["configPatches"][2]["patch"]["value"]["no_such_envoy_field"] = 1
    assert schema_errors(crds, [free]) == []

    wp = load("wasmplugin/wasmplugin.yaml")[0]
    assert schema_errors(crds, [wp]) == []
    bad = copy.deepcopy(wp)
    bad["spec"]["failStrategy"] = "FAIL_CLOSED"  # Envoy's spelling, not Istio's
    assert any("FAIL_CLOSED" in e for e in schema_errors(crds, [bad]))
    bad = copy.deepcopy(wp)
    bad["spec"]["vmId"] = "inference-picker"  # the field WasmPlugin does not have
    assert any("'vmId' was unexpected" in e for e in schema_errors(crds, [bad]))
    bad = copy.deepcopy(wp)
    bad["spec"]["url"] = "ftp://registry.example.com/x"
    assert any("url must have schema" in e for e in schema_errors(crds, [bad]))


def test_shape_check_of_other_kinds(crds):
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}}
    assert any("namespace is missing" in e for e in schema_errors(crds, [svc]))
    odd = {"apiVersion": "example.com/v1", "kind": "Thing", "metadata": {"name": "x", "namespace": "y"}}
    assert any("unknown apiVersion/kind" in e for e in schema_errors(crds, [odd]))


def test_openapi_conversion():
    s = vm.openapi_to_jsonschema({
        "type": "object",
        "properties": {
            "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            "port": {"x-kubernetes-int-or-string": True},
            "maybe": {"type": "string", "nullable": True},
            "n": {"type": "integer", "format": "int32", "description": "ignored"},
        },
    })
    jsonschema.validate({"free": {"a": [1]}, "port": "http", "maybe": None, "n": 3}, s)
    jsonschema.validate({"port": 8080}, s)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"other": 1}, s)


def copy_dir(tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(vm.MANIFESTS / name, dst)
    return dst


def edit_yaml(path, index, fn):
    docs = vm.load_docs(path)
    fn(docs[index])
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))


def consistency_errors(directory):
    report = vm.Report()
    vm.check_consistency(vm.collect(directory), report)
    return report.errors


def wasm_config(doc):
    return doc["spec"]["configPatches"][0]["patch"]["value"]["typed_config"]["config"]


def test_consistency_catches_missing_flags_and_vm_id(tmp_path):
    d = copy_dir(tmp_path, "gateway-api")
    assert consistency_errors(d) == []

    def strip(doc):
        cfg = wasm_config(doc)
        del cfg["allow_on_headers_stop_iteration"]
        cfg["vm_config"]["vm_id"] = "other"
    edit_yaml(d / "envoyfilter.yaml", 0, strip)
    errs = consistency_errors(d)
    assert any("allow_on_headers_stop_iteration must be true" in e for e in errs)
    assert any("vm_id must be 'inference-picker'" in e for e in errs)


def test_consistency_catches_poller_mode_and_missing_clusters(tmp_path):
    d = copy_dir(tmp_path, "gateway-api")

    def singleton_without_bootstrap(doc):
        cfg = wasm_config(doc)
        cfg["configuration"]["value"] = cfg["configuration"]["value"].replace('"lease"', '"singleton"')
        doc["spec"]["configPatches"] = [p for p in doc["spec"]["configPatches"]
                                        if p["patch"].get("value", {}).get("name") != "kubernetes_api"]
    edit_yaml(d / "envoyfilter.yaml", 0, singleton_without_bootstrap)
    errs = consistency_errors(d)
    assert any("has no bootstrap singleton: use 'lease'" in e for e in errs)
    assert any("names cluster 'kubernetes_api'" in e for e in errs)


def test_consistency_catches_singleton_and_filter_disagreeing(tmp_path):
    d = copy_dir(tmp_path, "sidecar-singleton")
    assert consistency_errors(d) == []

    def other_port(doc):
        cfg = wasm_config(doc)
        cfg["configuration"]["value"] = cfg["configuration"]["value"].replace("8000", "8001")
    edit_yaml(d / "envoyfilter.yaml", 0, other_port)
    assert any("differs from the filter's" in e for e in consistency_errors(d))


def test_assembly_applies_the_patches(tmp_path):
    proxy = vm.collect(vm.MANIFESTS / "gateway-api")
    boot = vm.assemble(proxy, wasm=tmp_path / "m.wasm", ca=tmp_path / "ca.crt")
    listener = boot["static_resources"]["listeners"][0]
    assert listener["per_connection_buffer_limit_bytes"] == 16777216
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in hcm["http_filters"]]
    assert names == ["inference/inference-picker", "envoy.filters.http.router"]
    cd = hcm["http_filters"][0]["config_discovery"]
    assert cd["default_config"]["config"]["vm_config"]["code"] == {"local": {"filename": str(tmp_path / "m.wasm")}}
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]
    assert (route["name"], route["route"]["cluster"]) == ("inference.llm-route.0", "inference_pool")
    assert route["route"]["retry_policy"]["num_retries"] == 2
    assert [m["filter"]["response_flag_filter"]["flags"][0] for m in hcm["local_reply_config"]["mappers"]][:2] == ["UT", "UH"]
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    assert {"inference_pool", "inference_pool_metrics", "kubernetes_api"} <= set(clusters)
    tls = clusters["kubernetes_api"]["transport_socket"]["typed_config"]["common_tls_context"]
    assert tls["validation_context"]["trusted_ca"]["filename"] == str(tmp_path / "ca.crt")

    singleton = vm.assemble(vm.collect(vm.MANIFESTS / "sidecar-singleton"), wasm=tmp_path / "m.wasm")
    ext = singleton["bootstrap_extensions"][0]["typed_config"]
    assert ext["singleton"] is True
    assert ext["config"]["vm_config"]["code"] == {"local": {"filename": str(tmp_path / "m.wasm")}}


def test_wasmplugin_translation_has_no_vm_id_nor_stop_iteration():
    wp = load("wasmplugin/wasmplugin.yaml")[0]
    cfg = vm.wasm_plugin_filter(wp)["typed_config"]["config"]
    assert "vm_id" not in cfg["vm_config"]
    assert "allow_on_headers_stop_iteration" not in cfg
    assert cfg["failure_policy"] == "FAIL_CLOSED"
    assert cfg["vm_config"]["environment_variables"] == {"host_env_keys": ["K8S_TOKEN"]}


# ---- config-from-crds examples against the Gateway API Inference Extension CRDs ------------------

GIE_SCHEMAS = sorted((REPO / "tests" / "fixtures" / "schemas").glob("gie-*.yaml"))
CRD_EXAMPLES = sorted((REPO / "tools" / "config-from-crds" / "examples").glob("*.yaml"))


@pytest.fixture
def gie_crds():
    crds = {}
    for path in GIE_SCHEMAS:
        crds.update(vm.load_crds(path))
    return crds


def test_config_from_crds_examples_match_the_gie_schemas(gie_crds):
    assert len(GIE_SCHEMAS) == 3 and len(CRD_EXAMPLES) >= 2
    kinds = set()
    for path in CRD_EXAMPLES:
        docs = vm.load_docs(path)
        for d in docs:
            d.setdefault("metadata", {}).setdefault("namespace", "inference")
            kinds.add(d["kind"])
        report = vm.Report()
        vm.check_schema(path, docs, gie_crds, report)
        assert report.errors == [], path
    assert kinds == {"InferencePool", "InferenceObjective", "InferenceModelRewrite"}


def test_gie_schema_catches_bad_pools(gie_crds):
    pool = copy.deepcopy(vm.load_docs(CRD_EXAMPLES[0])[0])
    assert pool["kind"] == "InferencePool"
    pool["spec"]["targetPorts"] = [{"number": 8000 + i} for i in range(9)]  # at most 8
    pool["spec"]["endpointPickerRef"]["failureMode"] = "FailSometimes"
    errs = schema_errors(gie_crds, [pool])
    assert any("targetPorts" in e for e in errs) and any("FailSometimes" in e for e in errs), errs


def test_consistency_catches_a_data_cluster_without_fallbacks(tmp_path):
    d = copy_dir(tmp_path, "gateway-api")

    def original_dst(doc):
        for p in doc["spec"]["configPatches"]:
            if p["applyTo"] == "CLUSTER" and p["patch"]["value"]["name"] == "inference_pool":
                p["patch"]["value"].pop("load_balancing_policy")
            if p["applyTo"] == "HTTP_ROUTE":
                p["patch"]["value"]["route"].pop("retry_policy")
    edit_yaml(d / "envoyfilter.yaml", 0, original_dst)
    errs = consistency_errors(d)
    assert any("override_host" in e for e in errs), errs
    assert any("no retry_policy" in e for e in errs), errs


def test_consistency_catches_an_unscoped_filter(tmp_path):
    # Issue 13: a picker inserted on the whole listener acts on every route of a shared gateway.
    d = copy_dir(tmp_path, "ingress")
    assert consistency_errors(d) == []

    def unscoped(doc):
        for p in doc["spec"]["configPatches"]:
            value = p["patch"].get("value", {})
            value.pop("disabled", None)
            value.pop("typed_per_filter_config", None)
    edit_yaml(d / "envoyfilter.yaml", 0, unscoped)
    errs = consistency_errors(d)
    assert any("is not disabled on the listener" in e for e in errs), errs
    assert any("no HTTP_ROUTE patch enables 'istio-system/inference-picker'" in e for e in errs), errs


def test_assembled_gateway_runs_the_picker_only_on_the_inference_route(tmp_path):
    proxy = vm.collect(vm.MANIFESTS / "gateway-api")
    boot = vm.assemble(proxy, wasm=tmp_path / "m.wasm", ca=tmp_path / "ca.crt")
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    picker = next(f for f in hcm["http_filters"] if f["name"] == "inference/inference-picker")
    assert picker["disabled"] is True
    for r in hcm["route_config"]["virtual_hosts"][0]["routes"]:
        per = r.get("typed_per_filter_config", {}).get("inference/inference-picker")
        assert (per is not None) == (r["name"] == "inference.llm-route.0"), r["name"]


def test_consistency_catches_missing_stats_tags(tmp_path):
    # Issue 13: without the stats tags the module's metric labels stay inside the names on Istio.
    d = copy_dir(tmp_path, "gateway-api")
    assert consistency_errors(d) == []
    (d / "stats-bootstrap.yaml").unlink()
    errs = consistency_errors(d)
    assert any("no stats tag 'model'" in e for e in errs), errs
    assert any("no stats tag 'pool'" in e for e in errs), errs


def test_pools_gateway_routes_each_model_to_its_pool_and_the_rest_to_a_json_404(tmp_path):
    proxy = vm.collect(vm.MANIFESTS / "gateway-api-pools")
    boot = vm.assemble(proxy, wasm=tmp_path / "m.wasm", ca=tmp_path / "ca.crt")
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in hcm["http_filters"]]
    assert names == ["inference/picker-llama", "inference/picker-qwen", "envoy.filters.http.router"]
    assert all(f.get("disabled") for f in hcm["http_filters"][:2])
    routes = {r["name"]: r for r in hcm["route_config"]["virtual_hosts"][0]["routes"]}
    assert routes["inference.llm-route.0"]["route"]["cluster"] == "inference_pool_llama"
    assert routes["inference.llm-route.1"]["route"]["cluster"] == "inference_pool_qwen"
    nf = routes["inference.llm-route.2"]
    assert "route" not in nf and nf["direct_response"]["status"] == 404
    assert json.loads(nf["direct_response"]["body"]["inline_string"])["error"]["code"] == "model_not_found"
    for r in routes.values():
        assert set(r["typed_per_filter_config"]) == {"inference/picker-llama", "inference/picker-qwen"}
    # Each pool: its own vm_id and pool name.
    vms = {}
    for f in hcm["http_filters"][:2]:
        cfg = f["config_discovery"]["default_config"]["config"]
        vms[cfg["vm_config"]["vm_id"]] = json.loads(cfg["configuration"]["value"])["pool"]["name"]
    assert vms == {"inference-picker-vllm-llama3-8b-instruct": "vllm-llama3-8b-instruct",
                   "inference-picker-qwen2-5-7b-instruct": "qwen2-5-7b-instruct"}
