"""Tenants' pods do not decide how much memory the enforcer's pod directory and the agent hold.

On the real kube-apiserver: 300 pods bound to one node by ``spec.nodeName`` (no scheduler; a
finished pod stays until the terminated-pod GC), each carrying 250 KiB of annotations (the API
server allows 256 KiB a pod), half of them in a key gpuguard never reads and half as the value of
``gpuguard.io/gpu-memory-limit`` itself. The production readers run in a process of their own
(``tests/kube/pod_memory.py``) and their peak (``VmHWM``) is held to the chart's memory limits
(``helm/gpuguard/values.yaml``); tracemalloc's figures say what the readers hold while listing
and keep after, against what the tenants wrote. Then: a finished pod (``Succeeded``/``Failed``)
is in neither reader's view, whether it finished before the list or while watched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuguard.adapters.kube import KubePodDirectory, load_api_client
from gpuguard.adapters.kube.agent import KubeSharingSource
from gpuguard.core.model import LIMIT_ANNOTATION, PodUid
from gpuguard.kubemodel.quantity import parse_quantity_bytes
from rigs.controlplane import KubeCluster, wait_until

pytestmark = pytest.mark.apiserver

REPO = Path(__file__).resolve().parents[2]
PODS = 300
VALUE_CHARS = 250 * 1024
"""One annotation value of 250 KiB: under the API server's 256 KiB of annotations per pod."""
GPU = {"nvidia.com/gpu": "1"}


def chart_memory_limit(container: str) -> int:
    values = yaml.safe_load((REPO / "helm/gpuguard/values.yaml").read_text())
    return parse_quantity_bytes(values["resources"][container]["limits"]["memory"])


def measured(kubeconfig: Path, node: str, reader: str, *, trace: bool) -> dict[str, Any]:
    """One run of ``tests.kube.pod_memory`` (a fresh process: its peak is this reader's)."""
    command = [sys.executable, "-m", "tests.kube.pod_memory", "--kubeconfig", str(kubeconfig)]
    command += ["--node", node, "--reader", reader, *(["--trace"] if trace else [])]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def set_phase(cluster: KubeCluster, namespace: str, name: str, phase: str) -> None:
    """What the kubelet writes once every container of the pod has stopped."""
    cluster.admin_request(
        "PATCH",
        f"/api/v1/namespaces/{namespace}/pods/{name}/status",
        {"status": {"phase": phase}},
        content_type="application/merge-patch+json",
    )


@pytest.fixture
def fat_node(cluster: KubeCluster, namespace: str, node_name: str) -> Iterator[str]:
    """``PODS`` pods on ``node_name``, each holding a GPU and 250 KiB of annotations; deleted
    after the test (the API server's session is shared)."""

    def create(i: int) -> None:
        value = f"{i:06d}" + "x" * (VALUE_CHARS - 6)
        key = LIMIT_ANNOTATION if i % 2 else "tenant.example/blob"
        cluster.create_pod(
            namespace, f"fat-{i}", node=node_name, annotations={key: value}, limits=GPU
        )

    def delete(i: int) -> None:
        cluster.delete_pod(namespace, f"fat-{i}")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(create, range(PODS)))
    try:
        yield node_name
    finally:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(delete, range(PODS)))


def test_fat_pods_keep_the_directory_and_the_agent_under_the_charts_memory_limits(
    fat_node: str,
    gpuguard_kubeconfig: Callable[..., Path],
    agent_kubeconfig: Callable[..., Path],
) -> None:
    tenant_bytes = PODS * VALUE_CHARS
    figures: dict[str, dict[str, Any]] = {}
    readers = (
        ("directory", gpuguard_kubeconfig(), "enforcer"),
        ("agent", agent_kubeconfig(), "agent"),
    )
    for reader, kubeconfig, container in readers:
        peak = measured(kubeconfig, fat_node, reader, trace=False)
        traced = measured(kubeconfig, fat_node, reader, trace=True)
        figures[reader] = {
            **peak,
            **{k: v for k, v in traced.items() if k.startswith("traced")},
            "limit_bytes": chart_memory_limit(container),
        }
        print(f"{reader}: {json.dumps(figures[reader])}")  # the before/after figures
    shown = json.dumps(figures, indent=1)
    for reader, _, container in readers:
        got = figures[reader]
        assert got["pods"] == PODS, shown
        # Under the container's limit, with room: the enforcer's other parts live there too.
        assert got["hwm_bytes"] < got["limit_bytes"], f"{reader} over the {container}'s: {shown}"
        # While listing, one page of raw JSON and its parse at most: not the node's pods.
        assert got["traced_peak_bytes"] < tenant_bytes / 4, shown
        # Kept: bounded pods (no 250 KiB value is kept whole), not what the tenants wrote.
        assert got["traced_kept_bytes"] < tenant_bytes / 50, shown
    assert figures["agent"]["pods_now"] == PODS, "the paged quorum read found every GPU pod"


def test_finished_pods_are_in_neither_the_directorys_nor_the_agents_view(
    cluster: KubeCluster,
    namespace: str,
    node_name: str,
    gpuguard_kubeconfig: Callable[..., Path],
    agent_kubeconfig: Callable[..., Path],
) -> None:
    uids = {
        name: PodUid(
            cluster.create_pod(namespace, name, node=node_name, limits=GPU)["metadata"]["uid"]
        )
        for name in ("running", "done-before", "fails-later", "succeeds-later")
    }
    set_phase(cluster, namespace, "running", "Running")
    set_phase(cluster, namespace, "done-before", "Succeeded")
    enforcer_api = load_api_client(str(gpuguard_kubeconfig()))
    agent_api = load_api_client(str(agent_kubeconfig()))
    directory = KubePodDirectory(enforcer_api, node_name=node_name)
    source = KubeSharingSource(
        agent_api,
        node_name=node_name,
        sharing_namespace="gpuguard",
        sharing_name="gpuguard-sharing",
    )
    directory.start()
    source.start()
    try:
        assert directory.wait_synced(20), directory.problem()
        assert source.wait_synced(20), source.problem()

        def directory_has() -> set[PodUid]:
            return {k for k, p in directory.snapshot().pods.items() if k == p.uid}

        def agent_has() -> set[PodUid]:
            return {p.uid for p in source.inputs().gpu_pods}

        listed = {uids["running"], uids["fails-later"], uids["succeeds-later"]}
        assert directory_has() == listed
        assert agent_has() == listed
        assert {p.uid for p in source.gpu_pods_now()} == listed
        set_phase(cluster, namespace, "fails-later", "Failed")
        set_phase(cluster, namespace, "succeeds-later", "Succeeded")
        wait_until(lambda: directory_has() == {uids["running"]}, what="finished pods dropped")
        wait_until(lambda: agent_has() == {uids["running"]}, what="finished pods dropped")
        assert {p.uid for p in source.gpu_pods_now()} == {uids["running"]}
        assert directory.problem() is None
    finally:
        directory.stop()
        source.stop()
        enforcer_api.close()  # type: ignore[no-untyped-call]
        agent_api.close()  # type: ignore[no-untyped-call]
