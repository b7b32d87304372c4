"""Write an OCI image layout directory holding one single-layer image made from a rootfs tar.

scripts/build-image.sh uses it to turn a Debian rootfs (mmdebstrap) into the local Python base
image that BuildKit builds the repo's Dockerfile against (its PYTHON_IMAGE argument), so no
registry and no Docker are needed. Standard library only; deterministic for a given tar and
arguments (gzip without a name or mtime, a fixed created time), so the digest is stable.

    rootfs_to_oci.py ROOTFS.tar LAYOUT_DIR --tag TAG [--env K=V]... [--cmd ARG]... [--created ISO]

Prints the manifest's digest (sha256:...). The layout is written into a scratch directory next
to LAYOUT_DIR and renamed last.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

_CHUNK_BYTES = 1 << 20
_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_CONFIG = "application/vnd.oci.image.config.v1+json"
_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


def _blob(blobs: Path, data: bytes) -> tuple[str, int]:
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return f"sha256:{digest}", len(data)


def _layer(rootfs: Path, blobs: Path) -> tuple[str, int, str]:
    """Gzip the tar into a blob; returns (digest, size, diff_id)."""
    raw = hashlib.sha256()
    scratch = blobs / ".layer"
    with (
        rootfs.open("rb") as src,
        scratch.open("wb") as out,
        gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=6) as gz,
    ):
        while chunk := src.read(_CHUNK_BYTES):
            raw.update(chunk)
            gz.write(chunk)
    packed = hashlib.sha256()
    with scratch.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            packed.update(chunk)
    size = scratch.stat().st_size
    scratch.rename(blobs / packed.hexdigest())
    return f"sha256:{packed.hexdigest()}", size, f"sha256:{raw.hexdigest()}"


def write_layout(
    rootfs: Path, layout: Path, *, tag: str, env: list[str], cmd: list[str], created: str
) -> str:
    layout.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{layout.name}.", dir=layout.parent))
    try:
        blobs = scratch / "blobs" / "sha256"
        blobs.mkdir(parents=True)
        layer_digest, layer_size, diff_id = _layer(rootfs, blobs)
        config = {
            "created": created,
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": env, "Cmd": cmd},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
            "history": [{"created": created, "created_by": f"rootfs_to_oci.py {rootfs.name}"}],
        }
        config_digest, config_size = _blob(blobs, _json(config))
        manifest = {
            "schemaVersion": 2,
            "mediaType": _MANIFEST,
            "config": {"mediaType": _CONFIG, "digest": config_digest, "size": config_size},
            "layers": [{"mediaType": _LAYER, "digest": layer_digest, "size": layer_size}],
        }
        manifest_digest, manifest_size = _blob(blobs, _json(manifest))
        index = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {
                    "mediaType": _MANIFEST,
                    "digest": manifest_digest,
                    "size": manifest_size,
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {"org.opencontainers.image.ref.name": tag},
                }
            ],
        }
        (scratch / "index.json").write_bytes(_json(index))
        (scratch / "oci-layout").write_bytes(_json({"imageLayoutVersion": "1.0.0"}))
        shutil.rmtree(layout, ignore_errors=True)
        scratch.rename(layout)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return manifest_digest


def _json(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("rootfs", type=Path)
    parser.add_argument("layout", type=Path)
    parser.add_argument("--tag", required=True, help="org.opencontainers.image.ref.name")
    parser.add_argument("--env", action="append", default=[], help="K=V, repeatable")
    parser.add_argument("--cmd", action="append", default=[], help="one argv word, repeatable")
    parser.add_argument("--created", default="1970-01-01T00:00:00Z")
    args = parser.parse_args()
    print(
        write_layout(
            args.rootfs, args.layout, tag=args.tag, env=args.env, cmd=args.cmd, created=args.created
        )
    )


if __name__ == "__main__":
    main()
