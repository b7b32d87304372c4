"""The pod-resources stubs (gpuguard/adapters/podresources/v1) are what scripts/gen_podresources.py
makes from the committed ``api.proto``, and that ``api.proto`` is k8s.io/kubelet's of the version
the stubs' header names.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from rigs.prereq import require
from tests.scripts_loader import load_script

REPO = Path(__file__).resolve().parents[1]
GEN = load_script("gen_podresources")
PROTO_SHA256 = {
    "v0.37.2": "b261f07b951c6ae807c90a3137475733a105c085d3fee62ac62199e0d986c823",
}
"""sha256 of ``pkg/apis/podresources/v1/api.proto`` in k8s.io/kubelet, by version: add the new
version's when ``KUBELET_VERSION`` moves."""


def test_the_committed_stubs_match_a_fresh_generation() -> None:
    plugins = Path(sys.executable).parent
    require(
        importlib.util.find_spec("grpc_tools") is not None
        and (plugins / "protoc-gen-mypy").exists(),
        "grpcio-tools and mypy-protobuf (pip install --group codegen)",
    )
    done = subprocess.run(
        [sys.executable, "-m", "scripts.gen_podresources", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def test_the_committed_proto_is_the_kubelet_versions() -> None:
    proto = (REPO / GEN.PROTO).read_bytes()
    assert hashlib.sha256(proto).hexdigest() == PROTO_SHA256[GEN.KUBELET_VERSION]
    for name in GEN.GENERATED:
        assert f"k8s.io/kubelet {GEN.KUBELET_VERSION}" in (REPO / GEN.PACKAGE / name).read_text()
    package_doc = (REPO / GEN.PACKAGE / "__init__.py").read_text()
    assert f"``k8s.io/kubelet`` {GEN.KUBELET_VERSION}" in package_doc


def test_the_committed_proto_equals_the_go_module_caches_copy_where_there_is_one() -> None:
    """Where the Go module cache holds k8s.io/kubelet at that version (scripts/ensure-node.sh
    builds the test device plugin against it), the committed copy is byte for byte its file."""
    cache = os.environ.get("GOMODCACHE") or str(Path.home() / "go" / "pkg" / "mod")
    go = shutil.which("go")
    if go is not None and "GOMODCACHE" not in os.environ:
        cache = (
            subprocess.run(
                [go, "env", "GOMODCACHE"], capture_output=True, text=True, timeout=60, check=True
            ).stdout.strip()
            or cache
        )
    source = Path(cache) / f"k8s.io/kubelet@{GEN.KUBELET_VERSION}" / GEN.MODULE_PROTO
    if source.is_file():  # not a skip: the sha256 above holds the same fact everywhere
        assert (REPO / GEN.PROTO).read_bytes() == source.read_bytes()
    assert (
        hashlib.sha256((REPO / GEN.PROTO).read_bytes()).hexdigest()
        == PROTO_SHA256[GEN.KUBELET_VERSION]
    )
