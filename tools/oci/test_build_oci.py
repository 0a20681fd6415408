"""Checks the OCI layout written by build_oci.py: every descriptor's digest and size match its
blob, the layer holds the module byte for byte, and the build is reproducible."""

import gzip
import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_oci  # noqa: E402

# A tiny but valid module header plus some payload, so sizes are not trivial.
WASM = b"\0asm\x01\0\0\0" + bytes(range(256)) * 40


@pytest.fixture
def wasm_file(tmp_path):
    p = tmp_path / "inference_picker.wasm"
    p.write_bytes(WASM)
    return p


def blob(out, desc):
    """Reads a descriptor's blob and checks its digest and size against the descriptor."""
    algo, hexdigest = desc["digest"].split(":")
    assert algo == "sha256"
    data = (out / "blobs" / "sha256" / hexdigest).read_bytes()
    assert hashlib.sha256(data).hexdigest() == hexdigest
    assert len(data) == desc["size"]
    return data


def read_layout(out):
    assert json.loads((out / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads((out / "index.json").read_text())
    assert index["schemaVersion"] == 2
    assert index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    assert len(index["manifests"]) == 1
    mdesc = index["manifests"][0]
    assert mdesc["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    manifest = json.loads(blob(out, mdesc))
    assert manifest["mediaType"] == mdesc["mediaType"]
    return mdesc, manifest


def test_compat_layout(wasm_file, tmp_path):
    out = tmp_path / "oci"
    desc = build_oci.build(wasm_file, out, "0.1.0", "compat")
    mdesc, manifest = read_layout(out)
    assert mdesc == desc
    assert mdesc["annotations"] == {"org.opencontainers.image.ref.name": "0.1.0"}
    # Istio's compat check: exactly one tar+gzip layer, and the variant annotation.
    assert manifest["annotations"] == {"module.wasm.image/variant": "compat"}
    assert [l["mediaType"] for l in manifest["layers"]] == ["application/vnd.oci.image.layer.v1.tar+gzip"]
    tar_bytes = gzip.decompress(blob(out, manifest["layers"][0]))
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        assert tar.getnames() == ["plugin.wasm"]
        assert tar.extractfile("plugin.wasm").read() == WASM
    config = json.loads(blob(out, manifest["config"]))
    assert manifest["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
    # diff_ids are digests of the uncompressed layer.
    assert config["rootfs"] == {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(tar_bytes).hexdigest()]}
    # Nothing in blobs/ that no descriptor names.
    named = {d["digest"].split(":")[1] for d in [mdesc, manifest["config"], *manifest["layers"]]}
    assert {p.name for p in (out / "blobs" / "sha256").iterdir()} == named


def test_oci_artifact_layout(wasm_file, tmp_path):
    out = tmp_path / "oci"
    build_oci.build(wasm_file, out, "v1", "oci")
    _, manifest = read_layout(out)
    # Istio's oci-variant check: exactly two layers, one of them the raw module.
    types = [l["mediaType"] for l in manifest["layers"]]
    assert types == ["application/vnd.module.wasm.config.v1+json", "application/vnd.module.wasm.content.layer.v1+wasm"]
    assert blob(out, manifest["layers"][1]) == WASM
    rc = json.loads(blob(out, manifest["config"]))
    assert manifest["config"]["mediaType"] == "application/vnd.module.wasm.config.v1+json"
    assert rc["type"] == "envoy_proxy"
    assert rc["config"]["root_ids"] == ["inference-picker", "inference-picker-poller"]


def test_reproducible_and_replaces_old_output(wasm_file, tmp_path):
    out = tmp_path / "oci"
    first = build_oci.build(wasm_file, out, "0.1.0")
    (out / "blobs" / "sha256" / "stale").write_bytes(b"x")
    second = build_oci.build(wasm_file, out, "0.1.0")
    assert first == second
    assert not (out / "blobs" / "sha256" / "stale").exists()
    wasm_file.write_bytes(WASM + b"\0")
    assert build_oci.build(wasm_file, out, "0.1.0")["digest"] != first["digest"]


def test_rejects_a_file_that_is_not_wasm(tmp_path):
    p = tmp_path / "x.wasm"
    p.write_bytes(b"ELF...")
    with pytest.raises(ValueError):
        build_oci.build(p, tmp_path / "oci", "t")
    assert build_oci.main(["--wasm", str(tmp_path / "missing.wasm"), "--out", str(tmp_path / "o")]) == 2


def test_command_line(wasm_file, tmp_path, capsys):
    out = tmp_path / "oci"
    assert build_oci.main(["--wasm", str(wasm_file), "--out", str(out), "--tag", "dev"]) == 0
    assert "dev -> sha256:" in capsys.readouterr().out
    read_layout(out)
