"""``make image``'s pieces and the build itself. scripts/rootfs_to_oci.py, which turns the Debian
rootfs of ``make python-base`` into the OCI layout BuildKit builds the Dockerfile against and into
the archive ``ctr images import`` reads: run as the real command on a tiny rootfs tar, its output
checked against the OCI image-layout rules (every blob named by its sha256 and sized as
described, the layer the rootfs gzipped, the config's diff_id the rootfs's digest) and for
determinism, byte for byte. scripts/build-image.sh on a chosen base: built for real (BuildKit,
runc; as root) on the archive of scripts/ensure-python-base.sh, once per session with the
real-node test; and refused at once, naming both ways to choose a base, when the base's registry
does not answer or the archive is not one image. scripts/push-image.sh: the tiny archive pushed
with crane to a registry on loopback and pulled back over the registry API."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import re
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rigs.controlplane import script_output
from rigs.kubelet import images
from rigs.prereq import require

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


# ---------------------------------------------------------------------------------------------
# make image on a chosen base, make push-image, and the base refused before anything is built

BUILD_IMAGE = REPO / "scripts" / "build-image.sh"
PUSH_IMAGE = REPO / "scripts" / "push-image.sh"


def archive_index(archive: Path) -> tuple[dict[str, Any], dict[str, bytes]]:
    """An OCI archive's index.json and its blobs by digest."""
    blobs: dict[str, bytes] = {}
    with tarfile.open(archive) as tar:
        index = json.loads(tar.extractfile("index.json").read())  # type: ignore[union-attr]
        for member in tar.getmembers():
            if member.isfile() and member.name.startswith("blobs/sha256/"):
                data = tar.extractfile(member).read()  # type: ignore[union-attr]
                blobs["sha256:" + member.name.rsplit("/", 1)[1]] = data
    return index, blobs


def image_manifest(archive: Path) -> tuple[str, dict[str, Any], dict[str, bytes]]:
    """The one image's manifest digest, the manifest (through a nested index) and the blobs."""
    index, blobs = archive_index(archive)
    [entry] = index["manifests"]
    node = json.loads(blobs[entry["digest"]])
    while "manifests" in node:
        [entry] = [m for m in node["manifests"] if m["platform"]["architecture"] == "amd64"]
        node = json.loads(blobs[entry["digest"]])
    return entry["digest"], node, blobs


def test_make_image_builds_the_dockerfile_on_the_base_archive_it_is_given() -> None:
    """``BASE_ARCHIVE=<the test base> scripts/build-image.sh``, the build the real-node test
    deploys (one per session): the image's first layers are the given archive's, byte for byte,
    and its entry point and name are the Dockerfile's and IMAGE_NAME's. The script itself ran
    the entry point and the quiet gate under runc before it printed the archive."""
    require(os.geteuid() == 0, "make image needs root (a rootful buildkitd)")
    built, why = images.build()
    require(built is not None, f"make image: {why}")
    assert built is not None
    _, base, _ = image_manifest(built.base_archive)
    _, image, blobs = image_manifest(built.gpuguard_archive)
    base_layers = [layer["digest"] for layer in base["layers"]]
    image_layers = [layer["digest"] for layer in image["layers"]]
    assert image_layers[: len(base_layers)] == base_layers
    assert len(image_layers) > len(base_layers)  # the installed package on top
    config = json.loads(blobs[image["config"]["digest"]])["config"]
    assert config["Entrypoint"] == ["gpuguard"]
    index, _ = archive_index(built.gpuguard_archive)
    assert index["manifests"][0]["annotations"]["io.containerd.image.name"] == built.gpuguard_ref


def refused_port() -> socket.socket:
    """A loopback port bound but never listening: a connection to it is refused at once."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def run_build(script: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("BASE_IMAGE", "BASE_ARCHIVE")}
    return subprocess.run(
        ["bash", str(script)],
        env={**clean, **env, "IMAGE_OUT": "/nonexistent/never-written"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def assert_refused_naming_both_options(done: subprocess.CompletedProcess[str], why: str) -> None:
    assert done.returncode == 2, done.stderr
    assert why in done.stderr
    assert "BASE_IMAGE=REF" in done.stderr
    assert "BASE_ARCHIVE=PATH" in done.stderr
    assert "make python-base" in done.stderr
    assert "BuildKit and runc" not in done.stderr  # refused before building anything
    assert done.stdout == ""


def test_an_unreachable_base_registry_is_refused_at_once_naming_both_options() -> None:
    with refused_port() as sock:
        ref = f"127.0.0.1:{sock.getsockname()[1]}/python:3.11.11-slim-bookworm"
        started = time.monotonic()
        done = run_build(BUILD_IMAGE, BASE_IMAGE=ref)
    assert time.monotonic() - started < 20
    assert_refused_naming_both_options(done, f"BASE_IMAGE={ref}: its registry 127.0.0.1:")
    assert "Connection refused" in done.stderr


def test_the_dockerfiles_default_base_is_checked_when_no_base_is_chosen(tmp_path: Path) -> None:
    """Neither option: the Dockerfile's ``ARG PYTHON_IMAGE`` default is the base, and its
    registry is checked (a copy of the script next to a Dockerfile whose default is a refused
    loopback port, so the test needs no network and no Docker Hub)."""
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "build-image.sh"
    script.write_text(BUILD_IMAGE.read_text())
    dockerfile = (REPO / "Dockerfile").read_text()
    default = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", dockerfile, re.MULTILINE)
    assert default is not None
    with refused_port() as sock:
        ref = f"127.0.0.1:{sock.getsockname()[1]}/{default[1]}"
        (tmp_path / "Dockerfile").write_text(dockerfile.replace(default[1], ref))
        done = run_build(script)
    assert_refused_naming_both_options(done, f"the Dockerfile's default base {ref}: its registry")


def test_a_base_archive_that_is_not_one_image_is_refused_naming_both_options(
    tmp_path: Path,
) -> None:
    not_an_archive = tmp_path / "base.oci.tar"
    not_an_archive.write_text("not a tar\n")
    done = run_build(BUILD_IMAGE, BASE_ARCHIVE=str(not_an_archive))
    assert_refused_naming_both_options(done, "not an OCI image archive or layout")
    _, _, archive = build(tmp_path, "out")
    both = run_build(BUILD_IMAGE, BASE_ARCHIVE=str(archive), BASE_IMAGE="python:3.11")
    assert_refused_naming_both_options(both, "both set: one base only")


@contextlib.contextmanager
def loopback_registry(crane: Path) -> Iterator[str]:
    """``crane registry serve`` on a loopback port, stopped by its PID on exit."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    proc = subprocess.Popen(
        [str(crane), "registry", "serve", "--address", address],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                urllib.request.urlopen(f"http://{address}/v2/", timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("crane registry serve did not come up") from None
                time.sleep(0.05)
        yield address
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_make_push_image_pushes_the_archive_so_that_it_pulls_with_the_same_digest(
    tmp_path: Path,
) -> None:
    """scripts/push-image.sh with crane to a registry on loopback; pulled back over the
    registry API (not crane), the manifest's digest is the archive's and every blob is there."""
    lines, why = script_output("scripts/ensure-crane.sh", timeout=600)
    require(lines is not None, f"crane: {why}")
    assert lines is not None
    digest, manifest, blobs = image_manifest(build(tmp_path, "out")[2])
    with loopback_registry(Path(lines[-1]) / "crane") as address:
        env = {
            **os.environ,
            "IMAGE_ARCHIVE": str(tmp_path / "out" / "base.oci.tar"),
            "IMAGE_REPOSITORY": f"{address}/team/gpuguard",
            "IMAGE_TAG": "1.2.3",
        }
        done = subprocess.run(
            ["bash", str(PUSH_IMAGE)], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[-1] == f"{address}/team/gpuguard:1.2.3@{digest}"
        assert f"--set image.repository={address}/team/gpuguard --set image.tag=1.2.3" in (
            done.stderr
        )
        base = f"http://{address}/v2/team/gpuguard"
        request = urllib.request.Request(
            f"{base}/manifests/1.2.3", headers={"Accept": manifest["mediaType"]}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            pulled = response.read()
        assert "sha256:" + hashlib.sha256(pulled).hexdigest() == digest
        for descriptor in [manifest["config"], *manifest["layers"]]:
            with urllib.request.urlopen(f"{base}/blobs/{descriptor['digest']}") as response:
                assert response.read() == blobs[descriptor["digest"]]
