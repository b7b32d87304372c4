"""A local cluster with one real GPU node, as the real-node tests and ``make cluster`` start it:
etcd, kube-apiserver, kube-controller-manager and kube-scheduler on loopback; one kubelet +
containerd + runc node (rigs/kubelet/node.py) in a network namespace of its own, with the GPU
stand-ins (rigs/kubelet/gpu.py): device nodes, the ``nvidia`` runtime handler bringing the NVML
stand-in into containers, the device plugin advertising ``nvidia.com/gpu`` replicas; the
``nvidia`` RuntimeClass, the labels GPU feature discovery puts on a GPU node, NVIDIA's
time-slicing ConfigMap, and the gpuguard image and its Python base imported into containerd.

Owns: starting those parts in order and registering each one's stop on the caller's
``ExitStack`` (so a failure part-way, or the end of the stack, stops what was started, in
reverse; the node's own close removes what the kubelet, containerd and the pods made). The
kubelet keeps its own Node Lease (``kube-node-lease``), so the node stays Ready for as long as
it runs. What the NVML stand-in lists is the caller's: the tests write a scenario from their
tenants' PIDs, ``make cluster`` runs ``StandinGpu`` (what the pods' processes say they hold).

Must not: signal a process it did not start; skip a prerequisite silently (``Binaries.find``
says what is missing and which command builds it).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gpuguard.kubemodel.quantity import InvalidQuantity, parse_quantity_bytes
from rigs import controlplane
from rigs.controlplane import (
    AdminRequestError,
    ControlPlane,
    KubeCluster,
    ensure_controlplane_binaries,
    find_binaries,
    testbin_dir,
    wait_until,
)
from rigs.kubefixtures import create_nvidia_runtime_class
from rigs.kubelet import gpu, images
from rigs.kubelet.node import (
    CGROUP_PARENT,
    RealNode,
    archive_names,
    ensure_node_binaries,
)

REPO = Path(__file__).resolve().parents[2]
NODE = "gpu-node-1"
GPU_UUID = "GPU-5eb3a1a0-0000-4000-8000-000000000000"
GPU_NAME = "NVIDIA H200"
GPU_TOTAL = 80 * 2**30
REPLICAS = 4
"""``nvidia.com/gpu`` replicas of the one GPU (time-slicing, as NVIDIA's plugin advertises)."""
DRIVER_VERSION = "580.159.04"
DEMO_IMAGE = "localhost/gpuguard-demo/python3:local"
"""The Python base image under a fixed name, for the demo pods (examples/greedy-demo)."""
DEMO_MEMORY_ENV = "GPUGUARD_DEMO_GPU_MEMORY"
"""On the local cluster only: a process that has a GPU device open and this variable in its
environment (a Kubernetes quantity, e.g. ``3Gi``) is listed by the NVML stand-in as holding that
much GPU memory (``StandinGpu``); the GPU is a stand-in, so the pod says what it "allocates"."""
MAX_ENVIRON = 64 * 1024
"""Bytes of a process's environment read at most."""
_GPU_DEVICE = re.compile(r"/dev/nvidia[0-9]+")

TIME_SLICING_CONFIG = {
    "apiVersion": "v1",
    "kind": "ConfigMap",
    "metadata": {"name": "nvidia-time-slicing-config", "namespace": "gpu-operator"},
    "data": {
        "slice-4": yaml.safe_dump(
            {
                "version": "v1",
                "sharing": {
                    "timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}
                },
            }
        )
    },
}
"""NVIDIA's time-slicing ConfigMap as the GPU operator keeps it (the agent reads it)."""


@dataclass(frozen=True)
class Binaries:
    apiserver: dict[str, Path]
    controlplane: dict[str, Path]
    node: Path
    helm: Path
    images: images.Built

    @staticmethod
    def find(
        progress: Callable[[str], None] = lambda _line: None,
        *,
        image_archive: Path | None = None,
    ) -> tuple[Binaries | None, str]:
        """Every binary and image the cluster needs, built once and cached under ~/.cache
        (the first run takes minutes); ``(Binaries, "")`` or ``(None, what is missing and
        which command builds it)``. ``image_archive``: the gpuguard image already built (an OCI
        archive, e.g. ``make image``'s), used instead of building one."""
        if os.geteuid() != 0:
            return None, "a real node needs root (kubelet, containerd, runc): run as root"
        apiserver, why = find_binaries()
        if why is not None:
            return None, why
        helm = testbin_dir() / "helm"
        if not os.access(helm, os.X_OK):
            return None, f"missing {helm}: run scripts/ensure-testbin.sh (make testbin)"
        progress("the control plane (scripts/ensure-controlplane.sh)")
        plane, why = ensure_controlplane_binaries()
        if why is not None:
            return None, why
        progress("the node: kubelet, containerd, runc, CNI (scripts/ensure-node.sh)")
        node_bin, why = ensure_node_binaries()
        if node_bin is None:
            return None, f"node binaries: {why}"
        if image_archive is None:
            progress("the gpuguard image and its base (make python-base, make image)")
            built, why = images.build(node_bin)
            if built is None:
                return None, f"make image: {why}"
            return Binaries(apiserver, plane, node_bin, helm, built), ""
        names = archive_names(image_archive)
        if not names:
            return None, f"{image_archive}: an OCI archive with no image name (make image's has)"
        progress("the Python base image of the demo pods (make python-base)")
        base, why = images.python_base()
        if base is None:
            return None, f"make python-base: {why}"
        built = images.Built(image_archive, names[0], *base)
        return Binaries(apiserver, plane, node_bin, helm, built), ""


class NodeControlPlane(ControlPlane):
    """The control plane plus what a real node's pods need: the EndpointSlice controller (the
    chart's headless metrics Service resolves to the enforcer pod's IP, as Prometheus sees it),
    ServiceAccount tokens and the root CA ConfigMap."""

    CONTROLLERS = (
        *ControlPlane.CONTROLLERS,
        "endpointslice",
        "serviceaccount",
        "root-ca-cert-publisher",
    )


@dataclass
class LocalCluster:
    cluster: KubeCluster
    plane: ControlPlane
    node: RealNode
    scenario: Path
    """The NVML stand-in's scenario file on the host (the runtime mounts its directory)."""
    binaries: Binaries
    workdir: Path

    def api(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        return self.cluster.admin_request(method, path, body)

    def write_scenario(self, processes: list[dict[str, int]]) -> None:
        """The NVML stand-in's one GPU with ``processes`` (``pid``, ``used_bytes``), written
        atomically (the stand-in rereads it on each call)."""
        scenario = {
            "driver_version": DRIVER_VERSION,
            "devices": [
                {
                    "uuid": GPU_UUID,
                    "name": GPU_NAME,
                    "total_bytes": GPU_TOTAL,
                    "processes": processes,
                }
            ],
        }
        tmp = self.scenario.with_suffix(".tmp")
        tmp.write_text(json.dumps(scenario))
        os.replace(tmp, self.scenario)


def _gpu_node(
    stack: contextlib.ExitStack, workdir: Path, bins: Binaries, cluster: KubeCluster
) -> tuple[RealNode, Path]:
    dev_dir = workdir / "dev"
    gpu.make_device_nodes(dev_dir, 1)
    nvml_dir = workdir / "nvml"
    nvml_dir.mkdir(exist_ok=True)
    runtime = gpu.install_runtime(
        workdir / "nvidia-runtime",
        runc=bins.node / "runc",
        library=REPO / "tests" / "nvml_stub" / "build" / "libnvidia-ml.so.1",
        scenario_dir=nvml_dir,
        dev_dir=dev_dir,
    )
    node = RealNode(
        cluster,
        workdir / "node",
        bins.node,
        name=NODE,
        extra_runtimes_toml=gpu.containerd_runtime_toml(runtime),
    )
    stack.callback(node.close)
    node.start()
    plugin = gpu.start_device_plugin(
        bins.node / gpu.PLUGIN_BINARY,
        dev_dir=dev_dir,
        gpus=1,
        replicas=REPLICAS,
        uuid=GPU_UUID,
        log=workdir / "deviceplugin.log",
    )
    stack.callback(controlplane.terminate, plugin)
    return node, nvml_dir / "scenario.json"


def start(
    stack: contextlib.ExitStack,
    workdir: Path,
    bins: Binaries,
    progress: Callable[[str], None] = lambda _line: None,
) -> LocalCluster:
    """Start the cluster, each part's stop on ``stack``; return once the node is Ready with its
    GPU replicas allocatable, its labels set and the images imported."""
    workdir.mkdir(parents=True, exist_ok=True)
    progress("etcd and kube-apiserver")
    cluster = KubeCluster(
        workdir / "cluster", bins.apiserver, service_accounts=True, node_egress=True
    )
    stack.callback(cluster.close)
    cluster.start()
    progress("kube-controller-manager and kube-scheduler")
    plane = NodeControlPlane(cluster, bins.controlplane)
    stack.callback(plane.close)
    plane.start()
    progress(f"node {NODE}: containerd, kubelet, the device plugin")
    node, scenario = _gpu_node(stack, workdir, bins, cluster)
    local = LocalCluster(cluster, plane, node, scenario, bins, workdir)
    local.write_scenario([])
    wait_until(
        lambda: (
            local.api("GET", f"/api/v1/nodes/{NODE}")["status"]["allocatable"].get(gpu.RESOURCE)
            == str(REPLICAS)
        ),
        timeout=60,
        what=f"the device plugin's {REPLICAS} nvidia.com/gpu replicas on {NODE}",
    )
    # What GPU feature discovery puts on a GPU node (the chart's nodeSelector reads it).
    cluster.label_node(NODE, {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": "1"})
    progress("the images, imported into containerd")
    for archive in (bins.images.gpuguard_archive, bins.images.base_archive):
        node.import_image(archive)
    tagged = node.ctr("images", "tag", "--force", bins.images.base_ref, DEMO_IMAGE)
    if tagged.returncode != 0:
        raise RuntimeError(f"ctr images tag {DEMO_IMAGE}: {tagged.stdout}{tagged.stderr}")
    create_nvidia_runtime_class(cluster)
    with contextlib.suppress(AdminRequestError):
        local.api("POST", "/api/v1/namespaces", {"metadata": {"name": "gpu-operator"}})
    local.api("POST", "/api/v1/namespaces/gpu-operator/configmaps", TIME_SLICING_CONFIG)
    return local


# ---------------------------------------------------------------------------------------------
# What the NVML stand-in lists on the local cluster


def node_pod_pids(node: RealNode) -> Iterator[int]:
    """Every process in the node's pods (``<cgroup root>/kubepods`` of the pids hierarchy)."""
    kubepods = Path("/sys/fs/cgroup/pids") / node.cgroup_root / CGROUP_PARENT
    for procs in kubepods.rglob("cgroup.procs"):
        with contextlib.suppress(OSError):
            for word in procs.read_text().split():
                yield int(word)


def _holds_gpu(pid: int) -> bool:
    with contextlib.suppress(OSError):
        for fd in os.scandir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if _GPU_DEVICE.fullmatch(os.readlink(fd.path)):
                    return True
    return False


def declared_memory(pid: int) -> int | None:
    """The bytes ``DEMO_MEMORY_ENV`` in the process's environment says, or None (absent,
    unreadable or not a quantity)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read(MAX_ENVIRON)
    except OSError:
        return None
    prefix = DEMO_MEMORY_ENV.encode() + b"="
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            try:
                return parse_quantity_bytes(entry[len(prefix) :].decode("ascii", "replace"))
            except InvalidQuantity:
                return None
    return None


class StandinGpu:
    """Keeps the NVML stand-in's listing in step with the local cluster's pods: every process in
    the node's pods that has a GPU device open and ``DEMO_MEMORY_ENV`` in its environment is
    listed as holding that much (a pod on a real GPU would allocate it)."""

    def __init__(self, local: LocalCluster, period: float = 0.2) -> None:
        self._local = local
        self._period = period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="standin-gpu", daemon=True)
        self.errors: list[str] = []

    def listed(self) -> list[dict[str, int]]:
        found = []
        for pid in node_pod_pids(self._local.node):
            used = declared_memory(pid)
            if used is not None and _holds_gpu(pid):
                found.append({"pid": pid, "used_bytes": used})
        return found

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self._local.write_scenario(self.listed())
            except Exception as e:  # keep listing; the errors are the caller's to show
                self.errors.append(repr(e))
                del self.errors[:-20]
