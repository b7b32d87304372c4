"""The real-node world of tests/node/test_real_node.py: the local cluster of ``make cluster``
(rigs/kubelet/cluster.py: a control plane, one real kubelet + containerd + runc node with the GPU
stand-ins), the chart installed with helm, and the tenants' pods. What the steps read from it
is tests/node/reads.py.

Owns: starting and stopping every part of that world, in reverse, also after a failure (the
node's own cleanup removes what the kubelet, containerd and the pods made); keeping the NVML
stand-in's scenario in step with the tenants' real host PIDs (``NvmlFeeder``); the release's
values, so a step can ``helm upgrade`` with some changed (``upgrade_release``). Must not assert
what a step checks.
"""

from __future__ import annotations

import contextlib
import copy
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rigs import controlplane
from rigs.controlplane import (
    AdminRequestError,
    ControlPlane,
    KubeCluster,
    helm_env,
    log_tail,
)
from rigs.kubelet import gpu
from rigs.kubelet.cluster import (
    NODE,
    Binaries,
    LocalCluster,
)
from rigs.kubelet.cluster import start as start_local
from rigs.kubelet.node import CGROUP_PARENT, CGROUP_ROOT_PREFIX, RealNode
from rigs.prereq import require
from tests.chart_release import NAMESPACE, RELEASE

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "gpuguard"
TENANTS = "tenants"
GRACE = 2.0
TERMINATION_TIMEOUT = 8.0
LIMIT_ANNOTATION = "gpuguard.io/gpu-memory-limit"
GiB = 2**30


@dataclass(frozen=True)
class Tenant:
    """A tenant pod of the scenario: what it runs and how much GPU memory NVML says it holds."""

    name: str
    limit: str
    used_bytes: int
    command: tuple[str, ...]
    listed: str = "python3"
    """The processes of the container NVML lists (their comm): the CUDA ones, not a shell."""
    gpus: int = 1
    """``nvidia.com/gpu`` it requests. 0: none, and it runs under the ``nvidia`` RuntimeClass
    with ``NVIDIA_VISIBLE_DEVICES=all`` (an image that sets it, as CUDA's do), so it sees and
    opens the GPU anyway, without an allocation."""


# ---------------------------------------------------------------------------------------------
# The world: a control plane, one real node with a GPU stand-in, the chart installed


@dataclass
class World:
    local: LocalCluster
    cluster: KubeCluster
    plane: ControlPlane
    node: RealNode
    helm: Path
    scenario: Path
    """The NVML stand-in's scenario file on the host (the runtime mounts its directory)."""
    base_image: str
    workdir: Path
    feeder: NvmlFeeder | None = None
    host_process: subprocess.Popen[bytes] | None = None
    values: dict[str, Any] = field(default_factory=dict)
    """The release's values as last installed or upgraded (``install_release``)."""

    def api(
        self, method: str, path: str, body: Mapping[str, object] | None = None
    ) -> dict[str, Any]:
        return self.cluster.admin_request(method, path, body)

    def helm_run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        env = helm_env(
            self.workdir / "helm-home",
            "/usr/bin:/bin",
            KUBECONFIG=str(self.cluster.admin_kubeconfig),
        )
        return subprocess.run(
            [str(self.helm), *args], capture_output=True, text=True, timeout=timeout, env=env
        )

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        return self.api("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        got = self.api("GET", f"/api/v1/namespaces/{namespace}/pods?labelSelector={selector}")
        return list(got["items"])

    def events(self, namespace: str, pod: str) -> list[dict[str, Any]]:
        path = f"/api/v1/namespaces/{namespace}/events?fieldSelector=involvedObject.name={pod}"
        return list(self.api("GET", path)["items"])

    def diagnostics(self) -> str:
        return f"{self.release_logs()}\n{self.node.logs()}\n{self.plane.logs()}"

    def release_logs(self, n: int = 6000) -> str:
        """The tails of the release's containers' logs, as the kubelet wrote them
        (``podLogsDir``: ``<namespace>_<pod>_<uid>/<container>/<restart>.log``)."""
        logs = sorted((self.node.dir / "pod-logs").glob(f"{NAMESPACE}_*/*/*.log"))
        return "\n".join(f"== {log.parent.parent.name}/{log.parent.name}/{log.name}\n"
                         f"{log_tail(log, n)}" for log in logs)  # fmt: skip


def container_status(pod: Mapping[str, Any]) -> dict[str, Any]:
    statuses = pod.get("status", {}).get("containerStatuses") or [{}]
    return dict(statuses[0])


def pod_pids(pod: Mapping[str, Any]) -> dict[int, str]:
    """Every process in the pod's cgroups (pause included), read from the tree the kubelet made
    (cgroupfs driver, below a node's cgroup root: ``<root>/kubepods[/<qos>]/pod<uid>/<container
    id>``; the UID names one pod): host PID -> comm."""
    found: dict[int, str] = {}
    uid = pod["metadata"]["uid"]
    for kubepods in Path("/sys/fs/cgroup/pids").glob(f"{CGROUP_ROOT_PREFIX}*/{CGROUP_PARENT}"):
        for pod_dir in kubepods.rglob(f"pod{uid}"):
            for procs in pod_dir.rglob("cgroup.procs"):
                for word in procs.read_text().split():
                    with contextlib.suppress(OSError):
                        found[int(word)] = Path(f"/proc/{word}/comm").read_text().strip()
    return found


class NvmlFeeder:
    """Keeps the NVML stand-in's scenario in step with the node: every tenant's listed processes
    (their real host PIDs, found in the kubelet's cgroups, restarts included) and one host
    process outside any pod, with the memory each is said to hold."""

    def __init__(self, world: World, tenants: Sequence[Tenant], host_pid: int) -> None:
        self._world = world
        self._tenants = list(tenants)
        self._host_pid = host_pid
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-feeder", daemon=True)
        self.errors: list[str] = []

    def start(self) -> None:
        self._write([])
        self._thread.start()

    def add(self, tenant: Tenant) -> None:
        if tenant not in self._tenants:
            self._tenants.append(tenant)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self._write(self._processes())
            except Exception as e:
                self.errors.append(repr(e))

    def _processes(self) -> list[dict[str, int]]:
        found = [{"pid": self._host_pid, "used_bytes": 10 * GiB}]
        for tenant in list(self._tenants):
            with contextlib.suppress(AdminRequestError):
                pod = self._world.pod(TENANTS, tenant.name)
                for pid, comm in pod_pids(pod).items():
                    if comm == tenant.listed:
                        found.append({"pid": pid, "used_bytes": tenant.used_bytes})
        return found

    def _write(self, processes: list[dict[str, int]]) -> None:
        self._world.local.write_scenario(processes)


def pod_resources_socket(node: RealNode) -> Path:
    """The kubelet's pod-resources socket: ``<root-dir>/pod-resources/kubelet.sock`` (kubelet
    v1.37.2 pkg/kubelet/kubelet_getters.go getPodResourcesDir: it follows ``--root-dir``, unlike
    the device-plugin directory), so under the harness's work directory, not
    /var/lib/kubelet."""
    return node.kubelet_root / "pod-resources" / "kubelet.sock"


def chart_values(gpuguard_image: str, node: RealNode) -> dict[str, Any]:
    repository, _, tag = gpuguard_image.rpartition(":")
    return {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "enforcement": {"mode": "enforce"},
        "kubelet": {"podResourcesDir": str(pod_resources_socket(node).parent)},
        "config": {
            "enforcement": {
                "grace_seconds": GRACE,
                "termination_timeout_seconds": TERMINATION_TIMEOUT,
            },
        },
        "sharing": {
            "version": "v1",
            "rules": [
                {
                    "name": "h200-shared",
                    "nodeSelector": {"matchLabels": {"kubernetes.io/hostname": NODE}},
                    "timeSlicing": "slice-4",
                }
            ],
        },
    }


def tenant_pod(tenant: Tenant, image: str) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "train",
        "image": image,
        "imagePullPolicy": "Never",
        "command": list(tenant.command),
    }
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 1,
        "containers": [container],
        # The real node: a pod asking for no GPU fits a kwok Node too (the fence step makes one).
        "nodeSelector": {"kubernetes.io/hostname": NODE},
    }
    if tenant.gpus:
        container["resources"] = {"limits": {gpu.RESOURCE: tenant.gpus}}
    else:
        container["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
        spec["runtimeClassName"] = gpu.RUNTIME_HANDLER
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": tenant.name,
            "namespace": TENANTS,
            "annotations": {LIMIT_ANNOTATION: tenant.limit},
        },
        "spec": spec,
    }


def ensure_tenant(world: World, tenant: Tenant) -> None:
    """Create the tenant's pod unless it exists (a step run alone, GPUGUARD_NODE_STEPS, still
    has it) and have the NVML stand-in list its processes."""
    assert world.feeder is not None
    try:
        world.pod(TENANTS, tenant.name)
    except AdminRequestError as e:
        if e.code != 404:
            raise
        world.api(
            "POST", f"/api/v1/namespaces/{TENANTS}/pods", tenant_pod(tenant, world.base_image)
        )
    world.feeder.add(tenant)


def namespace(world_api: Callable[..., dict[str, Any]], name: str) -> None:
    with contextlib.suppress(AdminRequestError):
        world_api("POST", "/api/v1/namespaces", {"metadata": {"name": name}})


def build_binaries() -> Binaries:
    """Every binary and image the world needs (built once, cached under ~/.cache); a missing
    prerequisite skips locally and fails in CI."""
    bins, why = Binaries.find()
    require(bins is not None, why)
    assert bins is not None
    return bins


@contextlib.contextmanager
def real_world(tmp: Path, bins: Binaries) -> Iterator[World]:
    """Everything up to a ready release; on exit every part is stopped, in reverse, also after a
    failure (the node's own cleanup removes what kubelet, containerd and the pods made)."""
    with contextlib.ExitStack() as stack:
        local = start_local(stack, tmp, bins)
        world = World(
            local=local,
            cluster=local.cluster,
            plane=local.plane,
            node=local.node,
            helm=bins.helm,
            scenario=local.scenario,
            base_image=bins.images.base_ref,
            workdir=tmp,
        )
        host = subprocess.Popen(["sleep", "3600"], start_new_session=True)
        world.host_process = host
        stack.callback(controlplane.terminate, host)
        world.feeder = NvmlFeeder(world, [], host.pid)
        world.feeder.start()
        stack.callback(world.feeder.close)

        namespace(world.api, TENANTS)
        done = install_release(world, chart_values(bins.images.gpuguard_ref, local.node))
        assert done.returncode == 0, (
            f"helm install:\n{done.stdout}{done.stderr}\n{world.diagnostics()}"
        )
        yield world


def install_release(world: World, values: Mapping[str, Any]) -> subprocess.CompletedProcess[str]:
    """``helm upgrade --install … -f <values> --wait``: the release with exactly ``values``
    (kept in ``world.values`` once installed)."""
    path = world.workdir / "values.yaml"
    path.write_text(yaml.safe_dump(dict(values)))
    done = world.helm_run(
        "upgrade", "--install", RELEASE, str(CHART), "-n", NAMESPACE, "--create-namespace",
        "-f", str(path), "--wait", "--timeout", "5m",
    )  # fmt: skip
    if done.returncode == 0:
        world.values = copy.deepcopy(dict(values))
    return done


def merged(base: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``changes`` merged in, map by map (a non-map value replaces)."""
    out = copy.deepcopy(dict(base))
    for key, value in changes.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def upgrade_release(world: World, changes: Mapping[str, Any]) -> subprocess.CompletedProcess[str]:
    """``helm upgrade`` of the release with ``changes`` merged into its current values (e.g.
    ``{"config": {"enforcement": {"unallocated": "stop"}}}``), waiting for the rollout; the
    caller checks the result."""
    return install_release(world, merged(world.values, changes))
