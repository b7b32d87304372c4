"""What names the DRA share behind a limit, on real parts: the real
kube-apiserver, kube-controller-manager and kube-scheduler v1.37.2 allocate memory shares of a
kwok node's GPU (``rigs/dra_cluster.py``, as in ``test_dra.py``); then

* the real ``gpuguard enforce``'s ``/metrics`` labels each pod's series with dcgm-exporter's DRA
  labels naming the claim the controller-manager generated and the result the scheduler wrote
  (``dra_claim_name``, ``dra_claim_namespace``, ``dra_driver_name``, ``dra_pool_name``,
  ``dra_device_name``), the kill series of the pod it stops included;
* the real ``gpuguard explain PID --json`` and ``gpuguard inspect --json``, online against the
  same API server and the NVML stand-in, list the claim and share (``dra_shares``) and say it in
  their human text.

The ``dra`` and ``rig`` fixtures are ``test_dra.py``'s (a test module imports no other): one
control plane per module, a fresh kwok node and namespace per test.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rigs.controlplane import wait_until
from rigs.dra_cluster import DraCluster, DraRig, fresh_dra_rig
from rigs.node import GIB, EnforcerProcess, PodInfo
from tests.integration.oracle import Oracle, Role

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel, pytest.mark.nvml_stub]

SOURCES = ("gpuguard", "dra")
DRA_LABELS = (
    "dra_claim_name", "dra_claim_namespace", "dra_driver_name", "dra_pool_name", "dra_device_name",
)  # fmt: skip


@pytest.fixture
def rig(dra: DraCluster, stub_lib: Path, device_node: Path, tmp_path: Path) -> Iterator[DraRig]:
    """A fresh kwok GPU node with its ResourceSlice, a fresh namespace, the integration rig."""
    with fresh_dra_rig(dra, stub_lib=stub_lib, device_node=device_node, workdir=tmp_path) as r:
        yield r


def share_pod(dra: DraCluster, rig: DraRig, name: str, memory: str) -> tuple[PodInfo, str]:
    """A pod with a claim made from a template asking for ``memory`` of GPU 0, running; and the
    name of the ResourceClaim the controller-manager generated for it."""
    dra.add_template(rig.namespace, f"share-{name}", memory, gpu=0)
    dra.add_pod(rig.namespace, name, node=rig.node, template=f"share-{name}")
    pod = dra.running_pod(rig.namespace, name)
    claim = dra.pod_claim(rig.namespace, name)
    ((result,),) = [claim["status"]["allocation"]["devices"]["results"]]
    assert (result["driver"], result["pool"], result["device"]) == (
        "gpu.nvidia.com",
        rig.node,
        "gpu-0",
    ), result
    return pod, claim["metadata"]["name"]


def series(enforcer: EnforcerProcess, family: str) -> dict[str, dict[str, str]]:
    """``family``'s series on the enforcer's ``/metrics``, by pod: their labels."""
    _code, text = enforcer.http("/metrics")
    return {
        s.labels["pod"]: s.labels
        for parsed in text_string_to_metric_families(text)
        for s in parsed.samples
        if s.name == family
    }


def gpuguard(rig: DraRig, *argv: str) -> subprocess.CompletedProcess[str]:
    """A one-shot ``gpuguard`` command with the enforcer's config (``dra`` among the sources)."""
    return rig.run_cli(*argv, sources=SOURCES)


def test_metrics_name_the_claim_of_each_share_and_of_the_stop(dra: DraCluster, rig: DraRig) -> None:
    """Two pods share GPU 0 by 4Gi and 8Gi shares; the one over its share is stopped. Each
    pod's used and limit series name its own claim; the kill series names the stopped pod's."""
    greedy, greedy_claim = share_pod(dra, rig, "greedy", "4Gi")
    modest, modest_claim = share_pod(dra, rig, "modest", "8Gi")
    oracle = Oracle()
    over = rig.spawn(greedy, "greedy", used_bytes=6 * GIB, gpu=0)
    within = rig.spawn(modest, "modest", used_bytes=2 * GIB, gpu=0)
    oracle.add(over, Role.OFFENDER, namespace=rig.namespace, pod="greedy", expect_stopped=True)
    oracle.add(within, Role.BYSTANDER, namespace=rig.namespace, pod="modest")

    enforcer = rig.start_enforcer(sources=SOURCES)
    wait_until(lambda: not over.alive(), timeout=30, what="the pod over its share to be stopped")
    wait_until(
        lambda: "modest" in series(enforcer, "gpuguard_pod_gpu_memory_limit_bytes"),
        timeout=15,
        what="the limit series of the pod within its share",
    )

    def dra_labels(claim: str) -> dict[str, str]:
        return {
            "dra_claim_name": claim,
            "dra_claim_namespace": rig.namespace,
            "dra_driver_name": "gpu.nvidia.com",
            "dra_pool_name": rig.node,
            "dra_device_name": "gpu-0",
        }

    for family in ("gpuguard_pod_gpu_memory_used_bytes", "gpuguard_pod_gpu_memory_limit_bytes"):
        labels = series(enforcer, family)["modest"]
        assert {k: labels[k] for k in DRA_LABELS} == dra_labels(modest_claim), (family, labels)
    kill = series(enforcer, "gpuguard_pod_last_kill_timestamp_seconds")
    assert set(kill) == {"greedy"}
    assert {k: kill["greedy"][k] for k in DRA_LABELS} == dra_labels(greedy_claim)
    assert greedy_claim != modest_claim
    oracle.check(rig.enforcers)


def test_explain_and_inspect_name_the_claim_and_share_behind_the_limit(
    dra: DraCluster, rig: DraRig
) -> None:
    pod, claim = share_pod(dra, rig, "trainer", "4Gi")
    worker = rig.spawn(pod, "trainer", used_bytes=3 * GIB, gpu=0)
    share: dict[str, Any] = {
        "claim": f"{rig.namespace}/{claim}",
        "request": "gpu",
        "driver": "gpu.nvidia.com",
        "pool": rig.node,
        "device": "gpu-0",
        "memory_bytes": 4 * GIB,
    }

    done = gpuguard(rig, "explain", str(worker.pid), "--json")
    assert done.returncode == 0, done.stderr
    explained = json.loads(done.stdout)
    assert (explained["limit_bytes"], explained["limit_source"]) == (4 * GIB, "dra"), explained
    (named,) = explained["dra_shares"]
    assert named.pop("share_id"), "a result of a multi-allocatable device carries a shareID"
    assert named == share
    human = gpuguard(rig, "explain", str(worker.pid))
    assert (
        f"dra shares:      limit 4Gi from dra: claim {rig.namespace}/{claim} request gpu on "
        f"gpu.nvidia.com/{rig.node}/gpu-0, share 4Gi"
    ) in human.stdout, human.stdout

    done = gpuguard(rig, "inspect", "--json")
    assert done.returncode == 0, done.stderr
    (row,) = [p for p in json.loads(done.stdout)["processes"] if p["pid"] == worker.pid]
    assert (row["limit_bytes"], row["limit_source"], row["verdict"]) == (4 * GIB, "dra", "ok")
    assert [{k: v for k, v in s.items() if k != "share_id"} for s in row["dra_shares"]] == [share]
    table = gpuguard(rig, "inspect")
    words = " ".join(table.stdout.split())  # rich wraps the line at the 80 columns of a pipe
    assert (
        f"{rig.namespace}/trainer on GPU 0: limit 4Gi from dra: claim {rig.namespace}/{claim} "
        f"request gpu on gpu.nvidia.com/{rig.node}/gpu-0, share 4Gi"
    ) in words, table.stdout
    assert worker.received() == []
