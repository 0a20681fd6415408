#!/usr/bin/env python3
"""Packs the module's .wasm into an OCI image layout directory that Istio can pull.

Standard library only. Writes DIR/oci-layout, DIR/index.json and DIR/blobs/sha256/<digest>.

Two layouts of the Wasm image specification (solo-io/wasm `spec/`) exist; Istio's agent
(`pkg/wasm/imagefetcher.go`) accepts both, and tries them in this order:

- `compat` (default): an ordinary OCI image with exactly one layer,
  `application/vnd.oci.image.layer.v1.tar+gzip`, a tar holding `plugin.wasm`; the manifest carries
  the annotation `module.wasm.image/variant: compat`. Any registry and any image tool handles it.
- `oci`: an OCI artifact whose manifest has exactly two layers: the runtime config
  (`application/vnd.module.wasm.config.v1+json`) and the raw module
  (`application/vnd.module.wasm.content.layer.v1+wasm`). Istio rejects an artifact with only the
  module layer ("number of layers must be 2"). Some registries refuse custom media types.

The output is reproducible: fixed timestamps, owners and modes, gzip without a name or mtime, so
the same .wasm always gives the same manifest digest (which is what `WasmPlugin.sha256` or an
`@sha256:` reference pins).

Push the layout with a standard tool, for example:
    oras cp --from-oci-layout target/oci:0.1.0 registry.example.com/team/inference-picker:0.1.0
    skopeo copy oci:target/oci:0.1.0 docker://registry.example.com/team/inference-picker:0.1.0
    crane push target/oci registry.example.com/team/inference-picker:0.1.0
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import shutil
import sys
import tarfile
from pathlib import Path

MANIFEST_MT = "application/vnd.oci.image.manifest.v1+json"
INDEX_MT = "application/vnd.oci.image.index.v1+json"
IMAGE_CONFIG_MT = "application/vnd.oci.image.config.v1+json"
TAR_GZIP_LAYER_MT = "application/vnd.oci.image.layer.v1.tar+gzip"
WASM_CONFIG_MT = "application/vnd.module.wasm.config.v1+json"
WASM_LAYER_MT = "application/vnd.module.wasm.content.layer.v1+wasm"
VARIANT_ANNOTATION = "module.wasm.image/variant"
REF_NAME = "org.opencontainers.image.ref.name"
TITLE = "org.opencontainers.image.title"

# The root ids this module registers: the HTTP filter and the poller singleton.
ROOT_IDS = ["inference-picker", "inference-picker-poller"]
# The proxy-wasm ABI the Rust SDK (proxy-wasm 0.2) exports.
ABI_VERSIONS = ["proxy_abi_version_0_2_1"]

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_WASM = REPO_ROOT / "target" / "wasm32-wasip1" / "release" / "inference_picker.wasm"
DEFAULT_OUT = REPO_ROOT / "target" / "oci"


def _canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


class Layout:
    """Writes content-addressed blobs and returns their descriptors."""

    def __init__(self, out: Path):
        self.out = out
        self.blobs = out / "blobs" / "sha256"

    def put(self, data: bytes, media_type: str, annotations: dict | None = None) -> dict:
        digest = hashlib.sha256(data).hexdigest()
        (self.blobs / digest).write_bytes(data)
        desc = {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}
        if annotations:
            desc["annotations"] = annotations
        return desc


def plugin_tar(wasm: bytes) -> bytes:
    """An uncompressed tar with `plugin.wasm` only, with fixed metadata."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("plugin.wasm")
        info.size = len(wasm)
        info.mode = 0o644
        info.mtime = 0
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        tar.addfile(info, io.BytesIO(wasm))
    return buf.getvalue()


def gzip_fixed(data: bytes) -> bytes:
    """gzip with mtime 0 and no file name, so the bytes depend on the input only."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        gz.write(data)
    return buf.getvalue()


def runtime_config() -> bytes:
    return _canonical_json({"type": "envoy_proxy", "abiVersions": ABI_VERSIONS, "config": {"root_ids": ROOT_IDS}})


def build(wasm_path: Path, out: Path, tag: str, variant: str = "compat") -> dict:
    """Writes the layout into `out` (replacing it) and returns the manifest descriptor."""
    wasm = wasm_path.read_bytes()
    if wasm[:4] != b"\0asm":
        raise ValueError(f"{wasm_path} is not a WebAssembly module (no \\0asm magic)")
    if out.exists():
        shutil.rmtree(out)
    layout = Layout(out)
    layout.blobs.mkdir(parents=True)

    if variant == "compat":
        tar = plugin_tar(wasm)
        layer = layout.put(gzip_fixed(tar), TAR_GZIP_LAYER_MT)
        image_config = {
            # Docker's convention for WASI modules; Istio ignores the platform.
            "architecture": "wasm",
            "os": "wasip1",
            "config": {},
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(tar).hexdigest()}"]},
        }
        config = layout.put(_canonical_json(image_config), IMAGE_CONFIG_MT)
        manifest = {
            "schemaVersion": 2,
            "mediaType": MANIFEST_MT,
            "config": config,
            "layers": [layer],
            "annotations": {VARIANT_ANNOTATION: "compat"},
        }
    elif variant == "oci":
        rc = runtime_config()
        config = layout.put(rc, WASM_CONFIG_MT)
        manifest = {
            "schemaVersion": 2,
            "mediaType": MANIFEST_MT,
            "config": config,
            "layers": [
                layout.put(rc, WASM_CONFIG_MT, {TITLE: "runtime-config.json"}),
                layout.put(wasm, WASM_LAYER_MT, {TITLE: "plugin.wasm"}),
            ],
        }
    else:
        raise ValueError(f"unknown variant {variant!r} (compat or oci)")

    manifest_desc = layout.put(_canonical_json(manifest), MANIFEST_MT, {REF_NAME: tag})
    index = {"schemaVersion": 2, "mediaType": INDEX_MT, "manifests": [manifest_desc]}
    (out / "index.json").write_bytes(_canonical_json(index))
    (out / "oci-layout").write_bytes(_canonical_json({"imageLayoutVersion": "1.0.0"}))
    return manifest_desc


def crate_version() -> str:
    for line in (REPO_ROOT / "Cargo.toml").read_text().splitlines():
        if line.startswith("version"):
            return line.split("=", 1)[1].strip().strip('"')
    return "latest"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Pack the .wasm as an OCI image layout for Istio.")
    ap.add_argument("--wasm", type=Path, default=DEFAULT_WASM, help=f"default {DEFAULT_WASM.relative_to(REPO_ROOT)}")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (replaced); default target/oci")
    ap.add_argument("--tag", default=None, help="tag recorded in index.json (default: the crate version)")
    ap.add_argument("--variant", choices=["compat", "oci"], default="compat")
    args = ap.parse_args(argv)
    if not args.wasm.is_file():
        print(f"error: {args.wasm} not found; build it with "
              "`cargo build -p inference-picker --target wasm32-wasip1 --release`", file=sys.stderr)
        return 2
    tag = args.tag or crate_version()
    desc = build(args.wasm, args.out, tag, args.variant)
    print(f"wrote {args.out} ({args.variant}): {tag} -> {desc['digest']}")
    print(f"push: oras cp --from-oci-layout {args.out}:{tag} REGISTRY/REPO:{tag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
