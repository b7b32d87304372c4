"""scripts/rootfs_to_oci.py, which turns the Debian rootfs of ``make image`` into the OCI layout
BuildKit builds the Dockerfile against and into the archive ``ctr images import`` reads: run as
the real command on a tiny rootfs tar, its output checked against the OCI image-layout rules
(every blob named by its sha256 and sized as described, the layer the rootfs gzipped, the config's
diff_id the rootfs's digest) and for determinism, byte for byte. The full ``make image``
(mmdebstrap, BuildKit) runs in the real-node test."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "rootfs_to_oci.py"
NAME = "docker.io/library/python-base:test"


def tiny_rootfs(path: Path) -> Path:
    """A rootfs tar with a directory, an executable, a symlink and a config file."""

    def add(
        tar: tarfile.TarFile,
        name: str,
        *,
        data: bytes = b"",
        kind: bytes = tarfile.REGTYPE,
        mode: int = 0o644,
        link: str = "",
    ) -> None:
        info = tarfile.TarInfo(name)
        info.type, info.mode, info.linkname, info.size = kind, mode, link, len(data)
        tar.addfile(info, io.BytesIO(data) if data else None)

    with tarfile.open(path, "w") as tar:
        add(tar, "./", kind=tarfile.DIRTYPE, mode=0o755)
        add(tar, "./usr/bin/", kind=tarfile.DIRTYPE, mode=0o755)
        add(tar, "./usr/bin/python3", data=b"#!/bin/sh\necho 3.11\n", mode=0o755)
        add(tar, "./bin", kind=tarfile.SYMTYPE, link="usr/bin")
        add(tar, "./etc/pip.conf", data=b"[global]\ncert = /etc/ssl/certs/host.crt\n")
    return path


def convert(rootfs: Path, layout: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(rootfs), str(layout), *extra],
        capture_output=True,
        text=True,
        check=False,
    )


def build(tmp_path: Path, sub: str) -> tuple[str, Path, Path]:
    rootfs = tiny_rootfs(tmp_path / "rootfs.tar")
    layout, archive = tmp_path / sub / "layout", tmp_path / sub / "base.oci.tar"
    done = convert(
        rootfs, layout, "--name", NAME, "--env", "PATH=/usr/local/bin:/usr/bin",
        "--env", "LANG=C.UTF-8", "--cmd", "python3", "--archive", str(archive),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip(), layout, archive


def blob(layout: Path, digest: str) -> bytes:
    algorithm, _, hexdigest = digest.partition(":")
    assert algorithm == "sha256"
    return (layout / "blobs" / "sha256" / hexdigest).read_bytes()


def described(layout: Path, descriptor: dict[str, Any]) -> bytes:
    """The blob a descriptor points at, checked against the descriptor's digest and size."""
    data = blob(layout, descriptor["digest"])
    assert "sha256:" + hashlib.sha256(data).hexdigest() == descriptor["digest"]
    assert len(data) == descriptor["size"]
    return data


def test_the_same_rootfs_gives_the_same_digest_layout_and_archive(tmp_path: Path) -> None:
    first, layout_a, archive_a = build(tmp_path, "a")
    second, layout_b, archive_b = build(tmp_path, "b")
    assert first == second
    assert first.startswith("sha256:")
    files_a = sorted(p.relative_to(layout_a) for p in layout_a.rglob("*"))
    assert files_a == sorted(p.relative_to(layout_b) for p in layout_b.rglob("*"))
    for rel in files_a:
        if (layout_a / rel).is_file():
            assert (layout_a / rel).read_bytes() == (layout_b / rel).read_bytes(), rel
    assert archive_a.read_bytes() == archive_b.read_bytes()


def test_the_layout_is_an_oci_image_whose_layer_is_the_rootfs(tmp_path: Path) -> None:
    digest, layout, _ = build(tmp_path, "out")
    rootfs = (tmp_path / "rootfs.tar").read_bytes()
    assert json.loads((layout / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads((layout / "index.json").read_text())
    assert index["schemaVersion"] == 2
    assert index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    [entry] = index["manifests"]
    assert entry["digest"] == digest
    assert entry["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert entry["platform"] == {"architecture": "amd64", "os": "linux"}
    # ctr images import names the image from the first, the OCI spec wants only the tag in the
    # second (what BuildKit's own oci exporter writes).
    assert entry["annotations"] == {
        "io.containerd.image.name": NAME,
        "org.opencontainers.image.ref.name": "test",
    }
    manifest = json.loads(described(layout, entry))
    assert manifest["schemaVersion"] == 2
    assert manifest["mediaType"] == entry["mediaType"]
    assert manifest["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
    config = json.loads(described(layout, manifest["config"]))
    [layer] = manifest["layers"]
    assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
    assert gzip.decompress(described(layout, layer)) == rootfs
    assert config["rootfs"] == {
        "type": "layers",
        "diff_ids": ["sha256:" + hashlib.sha256(rootfs).hexdigest()],
    }
    assert (config["architecture"], config["os"]) == ("amd64", "linux")
    assert config["config"] == {
        "Env": ["PATH=/usr/local/bin:/usr/bin", "LANG=C.UTF-8"],
        "Cmd": ["python3"],
    }
    # Nothing but the three blobs (no scratch file left behind).
    assert {p.name for p in (layout / "blobs" / "sha256").iterdir()} == {
        d.removeprefix("sha256:") for d in (digest, manifest["config"]["digest"], layer["digest"])
    }
    # The Docker manifest older `docker load` reads points at the same config and layer.
    assert json.loads((layout / "manifest.json").read_text()) == [
        {
            "Config": "blobs/sha256/" + manifest["config"]["digest"].removeprefix("sha256:"),
            "RepoTags": ["python-base:test"],
            "Layers": ["blobs/sha256/" + layer["digest"].removeprefix("sha256:")],
        }
    ]


def test_the_archive_holds_the_layout_sorted_with_root_owners_and_time_zero(
    tmp_path: Path,
) -> None:
    _, layout, archive = build(tmp_path, "out")
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        names = [m.name for m in members]
        assert names == sorted(names, key=lambda n: n.split("/"))
        assert set(names) == {p.relative_to(layout).as_posix() for p in layout.rglob("*")}
        assert {(m.uid, m.gid, m.mtime) for m in members} == {(0, 0, 0)}
        for m in members:
            if m.isfile():
                extracted = tar.extractfile(m)
                assert extracted is not None
                assert extracted.read() == (layout / m.name).read_bytes()
            else:
                assert m.isdir()
                assert (layout / m.name).is_dir()


def test_a_name_without_a_tag_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    rootfs = tiny_rootfs(tmp_path / "rootfs.tar")
    for name in ("docker.io/library/python-base", "localhost:5000/base", "base@sha256:00"):
        done = convert(rootfs, tmp_path / "layout", "--name", name)
        assert done.returncode == 2
        assert "is not NAME:TAG" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rootfs.tar"]
