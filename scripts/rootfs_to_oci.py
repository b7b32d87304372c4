"""Write an OCI image layout directory holding one single-layer image made from a rootfs tar.

scripts/build-image.sh uses it to turn a Debian rootfs (mmdebstrap) into the local Python base
image that BuildKit builds the repo's Dockerfile against (its PYTHON_IMAGE argument), and to pack
that layout into an archive `ctr -n k8s.io images import`, `docker load` and `skopeo copy
oci-archive:` read, so no registry and no Docker are needed. Standard library only; deterministic
for a given tar and arguments (gzip without a name or mtime, a fixed created time, archive members
sorted with zero owners and times), so the digests are stable.

    rootfs_to_oci.py ROOTFS.tar LAYOUT_DIR --name NAME:TAG [--env K=V]... [--cmd ARG]...
                     [--created ISO] [--archive OUT.tar]

NAME:TAG is the full reference (docker.io/library/python-base:test). The index carries it twice,
the way containerd and BuildKit write archives: `io.containerd.image.name` (the full name, what
`ctr images import` names the image) and `org.opencontainers.image.ref.name` (only the tag, as
the OCI spec asks). A Docker `manifest.json` beside index.json lets older `docker load` read it.

Prints the manifest's digest (sha256:...). The layout and the archive are written into scratch
names next to their destinations and renamed last.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import BinaryIO

_CHUNK_BYTES = 1 << 20
_INDEX = "application/vnd.oci.image.index.v1+json"
_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_CONFIG = "application/vnd.oci.image.config.v1+json"
_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
_NAME_ANNOTATION = "io.containerd.image.name"
_REF_ANNOTATION = "org.opencontainers.image.ref.name"


def split_reference(name: str) -> tuple[str, str]:
    """`registry/repo:tag` -> (`registry/repo`, `tag`); a name without a tag is refused."""
    repo, sep, tag = name.rpartition(":")
    if not sep or not repo or not tag or "/" in tag or "@" in name:
        raise ValueError(f"{name!r} is not NAME:TAG (a tagged reference, no digest)")
    return repo, tag


def _blob(blobs: Path, data: bytes) -> tuple[str, int]:
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return f"sha256:{digest}", len(data)


class _HashingWriter:
    """Hashes what gzip writes on its way to the file: the blob digest in the same pass."""

    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        self.sha256 = hashlib.sha256()

    def write(self, data: bytes, /) -> int:
        self.sha256.update(data)
        return self._out.write(data)

    def flush(self) -> None:
        self._out.flush()


def _layer(rootfs: Path, blobs: Path) -> tuple[str, int, str]:
    """Gzip the tar into a blob; returns (digest, size, diff_id)."""
    raw = hashlib.sha256()
    scratch = blobs / ".layer"
    with rootfs.open("rb") as src, scratch.open("wb") as out:
        packed = _HashingWriter(out)
        with gzip.GzipFile(filename="", mode="wb", fileobj=packed, mtime=0, compresslevel=6) as gz:
            while chunk := src.read(_CHUNK_BYTES):
                raw.update(chunk)
                gz.write(chunk)
    digest = packed.sha256.hexdigest()
    size = scratch.stat().st_size
    scratch.rename(blobs / digest)
    return f"sha256:{digest}", size, f"sha256:{raw.hexdigest()}"


def write_layout(
    rootfs: Path, layout: Path, *, name: str, env: list[str], cmd: list[str], created: str
) -> str:
    """Write LAYOUT (replacing it) with one image from ROOTFS; returns the manifest digest."""
    repo, tag = split_reference(name)
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
            "mediaType": _INDEX,
            "manifests": [
                {
                    "mediaType": _MANIFEST,
                    "digest": manifest_digest,
                    "size": manifest_size,
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {_NAME_ANNOTATION: name, _REF_ANNOTATION: tag},
                }
            ],
        }
        docker_manifest = [
            {
                "Config": f"blobs/sha256/{config_digest.removeprefix('sha256:')}",
                "RepoTags": [_familiar(repo) + ":" + tag],
                "Layers": [f"blobs/sha256/{layer_digest.removeprefix('sha256:')}"],
            }
        ]
        (scratch / "index.json").write_bytes(_json(index))
        (scratch / "manifest.json").write_bytes(_json(docker_manifest))
        (scratch / "oci-layout").write_bytes(_json({"imageLayoutVersion": "1.0.0"}))
        scratch.chmod(0o755)  # mkdtemp's 0700 is not what a layout directory should keep
        shutil.rmtree(layout, ignore_errors=True)
        scratch.rename(layout)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return manifest_digest


def write_archive(layout: Path, archive: Path) -> None:
    """Pack LAYOUT into an uncompressed tar at ARCHIVE: sorted members, root owners, time 0."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(prefix=f".{archive.name}.", dir=archive.parent)
    try:
        with (
            os.fdopen(fd, "wb") as out,
            tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar,
        ):
            for path in sorted(layout.rglob("*"), key=lambda p: p.relative_to(layout).parts):
                info = tar.gettarinfo(str(path), arcname=path.relative_to(layout).as_posix())
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mtime = 0
                info.mode = 0o755 if info.isdir() else 0o644
                if info.isfile():
                    with path.open("rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
        os.chmod(scratch, 0o644)
        os.replace(scratch, archive)
    except BaseException:
        Path(scratch).unlink(missing_ok=True)
        raise


def _familiar(repo: str) -> str:
    # Docker's RepoTags use the short form: docker.io/library/x -> x, docker.io/u/x -> u/x.
    for prefix in ("docker.io/library/", "docker.io/"):
        if repo.startswith(prefix):
            return repo.removeprefix(prefix)
    return repo


def _json(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("rootfs", type=Path)
    parser.add_argument("layout", type=Path)
    parser.add_argument("--name", required=True, help="full reference NAME:TAG")
    parser.add_argument("--env", action="append", default=[], help="K=V, repeatable")
    parser.add_argument("--cmd", action="append", default=[], help="one argv word, repeatable")
    parser.add_argument("--created", default="1970-01-01T00:00:00Z")
    parser.add_argument("--archive", type=Path, help="also pack the layout into this tar")
    args = parser.parse_args()
    try:
        split_reference(args.name)
    except ValueError as e:
        parser.error(str(e))
    digest = write_layout(
        args.rootfs, args.layout, name=args.name, env=args.env, cmd=args.cmd, created=args.created
    )
    if args.archive is not None:
        write_archive(args.layout, args.archive)
    print(digest)


if __name__ == "__main__":
    main()
