"""A pod that asks for ``nvidia.com/gpu: 0`` on the real node: the kubelet runs it on a node the
agent cordoned, the device plugin allocates it nothing, and the agent's pod source does not count
it as holding a GPU (so WhenIdle/Cordon do not wait for it and Drain does not evict it).

What is real: etcd, kube-apiserver, kube-controller-manager (its node lifecycle controller taints
the cordoned node), kubelet v1.37.2 with containerd v2.4.2 and runc (rigs/kubelet/node.py), the
test device plugin advertising ``nvidia.com/gpu`` over the kubelet's v1beta1 gRPC API
(rigs/kubelet/gpu.py), the agent's ``KubeNodeWriter`` (the cordon patch) and ``KubeSharingSource``
(its list + watch and its quorum read). The pods run the pause image the node already holds.

Needs root, the control plane (scripts/ensure-controlplane.sh) and the node binaries
(scripts/ensure-node.sh); missing, the module skips locally and fails in CI (rigs/prereq.py).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from gpuguard.adapters.kube import load_api_client
from gpuguard.adapters.kube.agent import KubeNodeWriter, KubeSharingSource
from gpuguard.core.agent import NodePatch
from gpuguard.core.reconcile import CordonAction
from rigs import controlplane
from rigs.controlplane import KubeCluster, control_plane, plane_binaries, wait_until
from rigs.kubelet import gpu
from rigs.kubelet.node import PAUSE_REF, RealNode, ensure_node_binaries
from rigs.prereq import require

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel, pytest.mark.node]

NODE = "gpu-node-1"
NAMESPACE = "default"
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"


def bound_pod(name: str, gpus: str) -> dict[str, Any]:
    """The pause container asking ``nvidia.com/gpu: <gpus>`` (requests and limits), bound to the
    node by ``spec.nodeName`` (no scheduler: as a Job controller's or a user's pod that names its
    node, which a cordon does not keep out)."""
    amount = {gpu.RESOURCE: gpus}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeName": NODE,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": PAUSE_REF,
                    "imagePullPolicy": "Never",
                    "resources": {"requests": amount, "limits": amount},
                }
            ],
        },
    }


def get(cluster: KubeCluster, path: str) -> dict[str, Any]:
    return cluster.admin_request("GET", path)


def running(cluster: KubeCluster, name: str) -> bool:
    pod = get(cluster, f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
    statuses = pod.get("status", {}).get("containerStatuses") or []
    return bool(statuses and "running" in statuses[0]["state"])


def environ(node: RealNode, pod: dict[str, Any]) -> dict[str, str]:
    """The container's PID 1 environment, read from the host (the kubelet's cgroup tree)."""
    cid = pod["status"]["containerStatuses"][0]["containerID"]
    pids = node.container_host_pids(pod["metadata"]["uid"], cid)
    assert len(pids) == 1, (pids, node.logs())
    raw = Path(f"/proc/{pids[0]}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in raw if b"=" in e)


def test_a_pod_asking_for_zero_gpus_runs_on_a_cordoned_node_and_holds_no_gpu(
    tmp_path: Path,
) -> None:
    require(os.geteuid() == 0, "a real node needs root (kubelet, containerd, runc)")
    binaries = plane_binaries()
    node_bin, why = ensure_node_binaries()
    require(node_bin is not None, why or "")
    assert node_bin is not None
    t0 = time.monotonic()
    with control_plane(tmp_path / "cluster", binaries, node_egress=True) as plane:
        cluster = plane.cluster
        node = RealNode(cluster, tmp_path / "node", node_bin, name=NODE)
        api = load_api_client(str(cluster.admin_kubeconfig))
        plugin = None
        source = None
        try:
            node.start()
            dev_dir = tmp_path / "dev"
            gpu.make_device_nodes(dev_dir, 1)
            plugin = gpu.start_device_plugin(
                node_bin / gpu.PLUGIN_BINARY,
                dev_dir=dev_dir,
                gpus=1,
                replicas=2,
                log=tmp_path / "deviceplugin.log",
            )
            wait_until(
                lambda: (
                    get(cluster, f"/api/v1/nodes/{NODE}")["status"]["allocatable"].get(gpu.RESOURCE)
                    == "2"
                ),
                timeout=60,
                what=f"the device plugin's {gpu.RESOURCE} on {NODE}",
            )

            # The agent's Cordon policy: its own writer, its own patch.
            version = get(cluster, f"/api/v1/nodes/{NODE}")["metadata"]["resourceVersion"]
            KubeNodeWriter(api, node_name=NODE).patch_node(
                NodePatch(resource_version=version, cordon=CordonAction.CORDON)
            )
            wait_until(
                lambda: any(
                    t.get("key") == UNSCHEDULABLE_TAINT
                    for t in get(cluster, f"/api/v1/nodes/{NODE}")["spec"].get("taints") or []
                ),
                timeout=60,
                interval=0.5,
                what=f"the node lifecycle controller's {UNSCHEDULABLE_TAINT} taint",
            )
            assert get(cluster, f"/api/v1/nodes/{NODE}")["spec"]["unschedulable"] is True

            for name, gpus in (("zero-gpus", "0"), ("one-gpu", "1")):
                cluster.admin_request(
                    "POST", f"/api/v1/namespaces/{NAMESPACE}/pods", bound_pod(name, gpus)
                )
            wait_until(
                lambda: running(cluster, "zero-gpus") and running(cluster, "one-gpu"),
                timeout=120,
                interval=0.5,
                what=f"zero-gpus and one-gpu Running on the cordoned {NODE}",
            )
            zero = get(cluster, f"/api/v1/namespaces/{NAMESPACE}/pods/zero-gpus")
            one = get(cluster, f"/api/v1/namespaces/{NAMESPACE}/pods/one-gpu")
            assert zero["status"]["phase"] == "Running", zero["status"]
            # The device plugin was asked for one device for one-gpu and none for zero-gpus.
            assert environ(node, one).get("NVIDIA_VISIBLE_DEVICES", "").startswith("GPU-")
            assert "NVIDIA_VISIBLE_DEVICES" not in environ(node, zero)

            source = KubeSharingSource(
                api,
                node_name=NODE,
                sharing_namespace="gpuguard",
                sharing_name="gpuguard-sharing",
            )
            source.start()
            assert source.wait_synced(30), source.problem()
            watched = {p.name for p in source.inputs().gpu_pods}
            quorum = {p.name for p in source.gpu_pods_now()}
            assert watched == {"one-gpu"}, watched
            assert quorum == {"one-gpu"}, quorum
            assert source.problem() is None
        except BaseException:
            print(node.logs())
            raise
        finally:
            if source is not None:
                source.stop()
            api.close()  # type: ignore[no-untyped-call]
            if plugin is not None:
                controlplane.terminate(plugin)
            node.close()
    assert node.leftovers() == []
    print(f"zero-gpu on the real node: {time.monotonic() - t0:.1f}s")
