"""The integration tests' fixtures: ``rig`` (one simulated GPU node, torn down after each
test), the NVML stand-in built once and a ``/dev/nvidia0`` look-alike. Fixtures only: what the
tests import (``Rig``, ``GIB``...) lives in ``rigs/node.py``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rigs.cgroups import kernel_problem
from rigs.controlplane import KubeCluster
from rigs.dra_cluster import DraCluster, start_dra_cluster
from rigs.node import Rig, rig_on_fresh_tree
from rigs.nvml_stub import build_stub
from rigs.prereq import require


@pytest.fixture(scope="session")
def stub_lib() -> Path:
    """The NVML stand-in, built once (skips, or fails in CI, without make or a C compiler)."""
    return build_stub()


@pytest.fixture(scope="session")
def device_node(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``/dev/nvidia0`` look-alike (char 195:0) in a temporary directory (needs root)."""
    require(os.geteuid() == 0, "needs root to mknod a char 195:0 device node")
    path = tmp_path_factory.mktemp("dev") / "nvidia0"
    os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(195, 0))
    return path


@pytest.fixture
def rig(
    cluster: KubeCluster,
    namespace: str,
    node_name: str,
    gpuguard_kubeconfig: Callable[..., Path],
    stub_lib: Path,
    device_node: Path,
    tmp_path: Path,
) -> Iterator[Rig]:
    """A node with nothing on it yet; every process, cgroup and enforcer is gone afterwards."""
    problem = kernel_problem(((2, ""),))
    require(problem is None, problem or "")
    cluster.create_node(node_name)
    with rig_on_fresh_tree(
        lambda tree: Rig(
            cluster=cluster,
            namespace=namespace,
            node=node_name,
            tree=tree,
            workdir=tmp_path,
            stub_lib=stub_lib,
            device_node=device_node,
            kubeconfig=gpuguard_kubeconfig,
        )
    ) as rig:
        yield rig


@pytest.fixture(scope="module")
def dra(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DraCluster]:
    """One DRA control plane per test module (test_dra, test_dra_tools), every process
    stopped by PID at the end."""
    plane = start_dra_cluster(tmp_path_factory.mktemp("dra"))
    try:
        yield plane
    finally:
        plane.close()
