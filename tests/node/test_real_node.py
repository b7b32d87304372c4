"""One real node: the chart installed with helm on a real kubelet + containerd + runc, and a real
tenant pod's container stopped by the enforcer pod and restarted by the kubelet.

What is real: etcd, kube-apiserver, kube-controller-manager (DaemonSet, node lifecycle,
EndpointSlice, garbage collector, ServiceAccount tokens), kube-scheduler, kubelet v1.37.2,
containerd v2.4.2 with runc v1.3.7 and the CNI bridge (tests/node/harness.py), the gpuguard image
built from the repo's Dockerfile by BuildKit (``make image``) and imported into containerd, the
chart as ``helm install`` renders it (enforce mode, its security context: hostPID, CAP_KILL only,
a read-only cgroup mount, a non-root agent), a device plugin speaking the kubelet's v1beta1 gRPC
API that advertises ``nvidia.com/gpu`` (time-sliced replicas), and the tenants' processes. What
stands in: the GPU. NVML is the C stand-in (tests/nvml_stub), reaching the enforcer's container
the way the real library does, through the ``nvidia`` runtime handler (a runc wrapper, like
NVIDIA's container runtime, tests/node/nvidia-container-runtime); the test writes its scenario
with the real host PIDs of the tenant containers. docs/real-node.md says what this proves and
what it does not.

Needs root, the node binaries (scripts/ensure-node.sh), the control plane (make gobins), helm and
BuildKit (``make image``). Missing, the module skips locally and fails in CI (tests/prereq.py).
``GPUGUARD_NODE_ROUNDS=2`` runs the whole scenario twice in one session (to show a run leaves
nothing behind for the next).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import ssl
import subprocess
import threading
import time
import urllib.request
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import apiserver
from tests.apiserver import (
    AdminRequestError,
    ControlPlane,
    KubeCluster,
    helm_binary,
    helm_env,
    plane_binaries,
    wait_until,
)
from tests.chart_release import (
    AGENT_SELECTOR,
    ENFORCER_SELECTOR,
    NAMESPACE,
    RELEASE,
    release_objects,
)
from tests.kubefixtures import create_nvidia_runtime_class
from tests.node import gpu, images
from tests.node.harness import RealNode, ensure_node_binaries, leftovers
from tests.node.service_ip import ServiceIP
from tests.prereq import require

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel, pytest.mark.node]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "gpuguard"
TENANTS = "tenants"
NODE = "gpu-node-1"
OTHER_NODE = "gpu-node-2"
GPU_UUID = "GPU-5eb3a1a0-0000-4000-8000-000000000000"
GPU_TOTAL = 80 * 2**30
REPLICAS = 4
GRACE = 2.0
TERMINATION_TIMEOUT = 8.0
LIMIT_ANNOTATION = "gpuguard.io/gpu-memory-limit"
FENCE = "ValidatingAdmissionPolicy 'gpuguard-agent-node-fence'"
ROUNDS = int(os.environ.get("GPUGUARD_NODE_ROUNDS", "1"))
ONLY = frozenset(os.environ.get("GPUGUARD_NODE_STEPS", "").split())
"""While developing: run only these steps (and the uninstall); empty: every step."""
GiB = 2**30

HOLD_GPU = "import os, time\nfd = os.open('/dev/nvidia0', os.O_RDWR)\ntime.sleep(10**6)\n"
"""A training process as it is usually written: holds the GPU, installs no SIGTERM handler."""
CATCH_SIGTERM = (
    "import os, signal, sys, time\n"
    "def bye(*_):\n"
    "    print('caught SIGTERM', flush=True)\n"
    "    sys.exit(143)\n"
    "signal.signal(signal.SIGTERM, bye)\n"
    "fd = os.open('/dev/nvidia0', os.O_RDWR)\n"
    "time.sleep(10**6)\n"
)
"""One that saves its state on SIGTERM (a checkpointing trainer)."""


@dataclass(frozen=True)
class Tenant:
    """A tenant pod of the scenario: what it runs and how much GPU memory NVML says it holds."""

    name: str
    limit: str
    used_bytes: int
    command: tuple[str, ...]
    listed: str = "python3"
    """The processes of the container NVML lists (their comm): the CUDA ones, not a shell."""


GREEDY = Tenant("greedy", "1Gi", 3 * GiB, ("python3", "-c", HOLD_GPU))
NEIGHBOUR = Tenant("neighbour", "4Gi", 2 * GiB, ("python3", "-c", HOLD_GPU))
CATCHER = Tenant("catcher", "1Gi", 3 * GiB, ("python3", "-c", CATCH_SIGTERM))
SHELL = Tenant(
    "shell",
    "1Gi",
    3 * GiB,
    # dash forks the worker (a command follows it) and forwards no signal: PID 1 is the shell.
    ("sh", "-c", f'python3 -c "{HOLD_GPU}"; echo worker ended'),
)


# ---------------------------------------------------------------------------------------------
# The world: a control plane, one real node with a GPU stand-in, the chart installed


@dataclass
class World:
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
        return f"{self.node.logs()}\n{self.plane.logs()}"


def container_status(pod: Mapping[str, Any]) -> dict[str, Any]:
    statuses = pod.get("status", {}).get("containerStatuses") or [{}]
    return dict(statuses[0])


def pod_pids(pod: Mapping[str, Any]) -> dict[int, str]:
    """Every process in the pod's cgroups (pause included), read from the tree the kubelet made
    (cgroupfs driver: ``kubepods[/<qos>]/pod<uid>/<container id>``): host PID -> comm."""
    found: dict[int, str] = {}
    for pod_dir in Path("/sys/fs/cgroup/pids/kubepods").rglob(f"pod{pod['metadata']['uid']}"):
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
        scenario = {
            "driver_version": "580.159.04",
            "devices": [
                {
                    "uuid": GPU_UUID,
                    "name": "NVIDIA H200",
                    "total_bytes": GPU_TOTAL,
                    "processes": processes,
                }
            ],
        }
        tmp = self._world.scenario.with_suffix(".tmp")
        tmp.write_text(json.dumps(scenario))
        os.replace(tmp, self._world.scenario)


def chart_values(gpuguard_image: str) -> dict[str, Any]:
    repository, _, tag = gpuguard_image.rpartition(":")
    return {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "enforcement": {"mode": "enforce"},
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


def tenant_pod(tenant: Tenant, image: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": tenant.name,
            "namespace": TENANTS,
            "annotations": {LIMIT_ANNOTATION: tenant.limit},
        },
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "train",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "command": list(tenant.command),
                    "resources": {"limits": {"nvidia.com/gpu": 1}},
                }
            ],
        },
    }


def namespace(world_api: Callable[..., dict[str, Any]], name: str) -> None:
    with contextlib.suppress(AdminRequestError):
        world_api("POST", "/api/v1/namespaces", {"metadata": {"name": name}})


@dataclass(frozen=True)
class Binaries:
    apiserver: dict[str, Path]
    controlplane: dict[str, Path]
    node: Path
    helm: Path
    images: images.Built


@pytest.fixture(scope="module")
def binaries() -> Binaries:
    require(os.geteuid() == 0, "a real node needs root (kubelet, containerd, runc)")
    plane = plane_binaries()
    node_bin, why = ensure_node_binaries()
    require(node_bin is not None, f"node binaries: {why}")
    assert node_bin is not None
    helm = helm_binary()
    built, why = images.build(node_bin)
    require(built is not None, f"make image: {why}")
    assert built is not None
    return Binaries(plane.cluster, plane.plane, node_bin, helm, built)


class NodeControlPlane(ControlPlane):
    """The chart test's control plane plus the EndpointSlice controller: the chart's headless
    metrics Service must resolve to the enforcer pod's IP, as Prometheus sees it."""

    CONTROLLERS = (
        *ControlPlane.CONTROLLERS,
        "endpointslice",
        "serviceaccount",
        "root-ca-cert-publisher",
    )


@contextlib.contextmanager
def real_world(tmp: Path, bins: Binaries) -> Iterator[World]:
    """Everything up to a ready release; on exit every part is stopped, in reverse, also after a
    failure (the node's own cleanup removes what kubelet, containerd and the pods made)."""
    with contextlib.ExitStack() as stack:
        cluster = KubeCluster(tmp / "cluster", bins.apiserver, service_accounts=True)
        stack.callback(cluster.close)
        cluster.start()
        service_ip = ServiceIP(cluster.apiserver_port)
        stack.callback(service_ip.close)
        service_ip.start()
        plane = NodeControlPlane(cluster, bins.controlplane)
        stack.callback(plane.close)
        plane.start()

        dev_dir = tmp / "dev"
        gpu.make_device_nodes(dev_dir, 1)
        nvml_dir = tmp / "nvml"
        nvml_dir.mkdir()
        runtime = gpu.install_runtime(
            tmp / "nvidia-runtime",
            runc=bins.node / "runc",
            library=REPO / "tests" / "nvml_stub" / "build" / "libnvidia-ml.so.1",
            scenario_dir=nvml_dir,
            dev_dir=dev_dir,
        )
        node = RealNode(
            cluster,
            tmp / "node",
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
            log=tmp / "deviceplugin.log",
        )
        stack.callback(apiserver.terminate, plugin)

        world = World(
            cluster=cluster,
            plane=plane,
            node=node,
            helm=bins.helm,
            scenario=nvml_dir / "scenario.json",
            base_image=bins.images.base_ref,
            workdir=tmp,
        )
        wait_until(
            lambda: (
                world.api("GET", f"/api/v1/nodes/{NODE}")["status"]["allocatable"].get(
                    "nvidia.com/gpu"
                )
                == str(REPLICAS)
            ),
            timeout=60,
            what=f"the device plugin's {REPLICAS} nvidia.com/gpu replicas on {NODE}",
        )
        # What GPU feature discovery puts on a GPU node (the chart's nodeSelector reads it).
        cluster.label_node(NODE, {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": "1"})
        for archive in (bins.images.gpuguard_archive, bins.images.base_archive):
            node.import_image(archive)

        host = subprocess.Popen(["sleep", "3600"], start_new_session=True)
        world.host_process = host
        stack.callback(apiserver.terminate, host)
        world.feeder = NvmlFeeder(world, [], host.pid)
        world.feeder.start()
        stack.callback(world.feeder.close)

        create_nvidia_runtime_class(world.cluster)
        for ns in ("gpu-operator", TENANTS):
            namespace(world.api, ns)
        world.api("POST", "/api/v1/namespaces/gpu-operator/configmaps", TIME_SLICING_CONFIG)
        values = tmp / "values.yaml"
        values.write_text(yaml.safe_dump(chart_values(bins.images.gpuguard_ref)))
        done = world.helm_run(
            "upgrade", "--install", RELEASE, str(CHART), "-n", NAMESPACE, "--create-namespace",
            "-f", str(values), "--wait", "--timeout", "5m",
        )  # fmt: skip
        assert done.returncode == 0, (
            f"helm install:\n{done.stdout}{done.stderr}\n{world.diagnostics()}"
        )
        yield world


# ---------------------------------------------------------------------------------------------
# The scenario, step by step (each asserts what a user would check)

CAP_KILL = 1 << 5


def status_fields(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def only_pod(world: World, selector: str) -> dict[str, Any]:
    pods = world.pods(NAMESPACE, selector)
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    return pods[0]


def main_process(pod: Mapping[str, Any], comm: str) -> int:
    pids = [pid for pid, c in pod_pids(pod).items() if c == comm]
    assert len(pids) == 1, f"{pod['metadata']['name']}: {pod_pids(pod)}"
    return pids[0]


def step_the_chart_runs_with_its_security_context(world: World) -> None:
    enforcer = only_pod(world, ENFORCER_SELECTOR)
    agent = only_pod(world, AGENT_SELECTOR)
    for pod in (enforcer, agent):
        assert pod["spec"]["nodeName"] == NODE
        assert container_status(pod).get("ready") is True, pod["status"]
    # What the kernel says of the running processes, not what the manifest asks for.
    enforcer_pid = main_process(enforcer, "gpuguard")
    status = status_fields(enforcer_pid)
    assert int(status["CapEff"], 16) == CAP_KILL, status["CapEff"]
    assert int(status["CapBnd"], 16) == CAP_KILL, status["CapBnd"]
    assert status["NSpid"].split() == [str(enforcer_pid)], "hostPID: one PID namespace, the host's"
    assert status["Uid"].split()[0] == "0"
    cgroup_mounts = [
        line.split()
        for line in Path(f"/proc/{enforcer_pid}/mountinfo").read_text().splitlines()
        if line.split()[4].startswith("/host/sys/fs/cgroup")
    ]
    assert cgroup_mounts, "the cgroup hostPath is mounted"
    assert all("ro" in m[5].split(",") for m in cgroup_mounts), cgroup_mounts
    agent_status = status_fields(main_process(agent, "gpuguard"))
    assert agent_status["Uid"].split()[0] == "65534"
    assert int(agent_status["CapEff"], 16) == 0


def wait_running(world: World, tenant: Tenant) -> dict[str, Any]:
    pod: dict[str, Any] = {}

    def running() -> bool:
        nonlocal pod
        pod = world.pod(TENANTS, tenant.name)
        return "running" in container_status(pod).get("state", {})

    wait_until(running, timeout=90, interval=0.5, what=f"{tenant.name} running")
    return pod


def watch_restarts(
    world: World, tenant: Tenant, *, restarts: int, timeout: float
) -> tuple[dict[str, Any], set[str]]:
    """Poll the pod until its container restarted ``restarts`` times; returns the pod and every
    waiting reason seen on the way (CrashLoopBackOff shows between restarts)."""
    reasons: set[str] = set()
    pod: dict[str, Any] = {}

    def restarted() -> bool:
        nonlocal pod
        pod = world.pod(TENANTS, tenant.name)
        status = container_status(pod)
        if reason := status.get("state", {}).get("waiting", {}).get("reason"):
            reasons.add(reason)
        return int(status.get("restartCount", 0)) >= restarts

    wait_until(restarted, timeout=timeout, interval=0.3, what=f"{tenant.name} restarts")
    return pod, reasons


def reasons_and_messages(world: World, pod: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for event in world.events(TENANTS, pod):
        found.setdefault(event["reason"], []).append(event.get("message", ""))
    return found


def last_termination(pod: Mapping[str, Any]) -> dict[str, Any]:
    return dict(container_status(pod).get("lastState", {}).get("terminated") or {})


def lifetime(terminated: Mapping[str, Any]) -> float:
    def at(stamp: str) -> float:
        return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ"))

    return at(terminated["finishedAt"]) - at(terminated["startedAt"])


def step_the_offender_is_stopped_and_restarted_while_its_neighbours_live(world: World) -> None:
    assert world.feeder is not None
    assert world.host_process is not None
    for tenant in (GREEDY, NEIGHBOUR):
        world.api(
            "POST", f"/api/v1/namespaces/{TENANTS}/pods", tenant_pod(tenant, world.base_image)
        )
        world.feeder.add(tenant)
    neighbour = wait_running(world, NEIGHBOUR)
    greedy = wait_running(world, GREEDY)
    neighbour_pids = pod_pids(neighbour)
    pauses = {
        pid for pod in (greedy, neighbour) for pid, c in pod_pids(pod).items() if c == "pause"
    }
    assert len(pauses) == 2, "one pause process per pod sandbox"

    greedy, reasons = watch_restarts(world, GREEDY, restarts=2, timeout=120)
    terminated = last_termination(greedy)
    assert terminated.get("exitCode") == 137, terminated
    events = reasons_and_messages(world, GREEDY.name)
    assert "GPUMemoryLimitExceeded" in events, events
    assert "GPUProcessKilled" in events, events
    assert any("SIGKILL" in m for m in events["GPUProcessKilled"]), events["GPUProcessKilled"]
    wait_until(
        lambda: "CrashLoopBackOff" in watch_restarts(world, GREEDY, restarts=2, timeout=1)[1],
        timeout=60,
        interval=0.5,
        what="greedy in CrashLoopBackOff",
    )
    del reasons

    neighbour_now = world.pod(TENANTS, NEIGHBOUR.name)
    assert container_status(neighbour_now)["restartCount"] == 0
    assert pod_pids(neighbour_now) == neighbour_pids, "the neighbour's processes are the same"
    assert not reasons_and_messages(world, NEIGHBOUR.name).keys() & {
        "GPUMemoryLimitExceeded",
        "GPUProcessKilled",
    }
    for pid in pauses:
        assert Path(f"/proc/{pid}").exists(), f"pause {pid} was stopped"
    assert world.host_process.poll() is None, "the host process outside any pod was signalled"
    assert not world.feeder.errors, world.feeder.errors


def step_signals_land(world: World) -> None:
    """A PID 1 that catches SIGTERM gets it (and the timeout); one that does not, and a shell
    entrypoint that forwards nothing to a plain worker, get SIGKILL at once (no pointless wait
    for a SIGTERM the kernel drops), said in the Event."""
    assert world.feeder is not None
    for tenant in (CATCHER, SHELL):
        world.api(
            "POST", f"/api/v1/namespaces/{TENANTS}/pods", tenant_pod(tenant, world.base_image)
        )
        world.feeder.add(tenant)
    catcher, _ = watch_restarts(world, CATCHER, restarts=1, timeout=90)
    shell, _ = watch_restarts(world, SHELL, restarts=1, timeout=90)

    caught = last_termination(catcher)
    assert caught.get("exitCode") == 143, caught  # its handler ran: sys.exit(143)
    killed = last_termination(shell)
    assert killed.get("exitCode") == 137, killed
    # Listed, over the limit, two samples, the grace: then the stop. Waiting for the
    # termination timeout would put it past GRACE + TERMINATION_TIMEOUT.
    for name, terminated in (("catcher", caught), ("shell", killed)):
        assert lifetime(terminated) < GRACE + TERMINATION_TIMEOUT, (name, terminated)
    catcher_events = reasons_and_messages(world, CATCHER.name)["GPUProcessKilled"]
    assert any(m.count("SIGTERM to PID") == 1 for m in catcher_events), catcher_events
    shell_events = reasons_and_messages(world, SHELL.name)["GPUProcessKilled"]
    assert any("SIGKILL to PID" in m and "SIGTERM to PID" in m for m in shell_events), shell_events


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


def sample(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def step_metrics_are_scraped_from_the_pod_ip_through_the_service(world: World) -> None:
    """As Prometheus finds them: the chart's headless Service's EndpointSlices name the
    enforcer pod's IP (on the CNI bridge) and the metrics port."""
    enforcer = only_pod(world, ENFORCER_SELECTOR)
    url: str | None = None

    def resolved() -> bool:
        nonlocal url
        slices = world.api(
            "GET",
            f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"
            f"?labelSelector=kubernetes.io/service-name={RELEASE}-metrics",
        )["items"]
        for s in slices:
            ports = {p["name"]: p["port"] for p in s.get("ports") or []}
            for endpoint in s.get("endpoints") or []:
                ref = endpoint.get("targetRef", {}).get("name")
                if ref == enforcer["metadata"]["name"] and "enforcer-metrics" in ports:
                    url = f"http://{endpoint['addresses'][0]}:{ports['enforcer-metrics']}/metrics"
        return url is not None

    wait_until(resolved, timeout=60, interval=0.5, what="the metrics Service's endpoints")
    assert url is not None
    assert url.split("//")[1].startswith(enforcer["status"]["podIP"] + ":"), url
    text = scrape(url)
    kills = sample(text, "gpuguard_kills_total")
    assert kills is not None, text
    assert kills >= 2, kills
    used = sample(text, "gpuguard_pod_gpu_memory_used_bytes", namespace=TENANTS, pod="neighbour")
    assert used == NEIGHBOUR.used_bytes, used
    limit = sample(text, "gpuguard_pod_gpu_memory_limit_bytes", namespace=TENANTS, pod="neighbour")
    assert limit == 4 * GiB, limit
    assert sample(text, "gpuguard_enforcement_active") == 1
    unattributed = sample(text, "gpuguard_gpu_memory_unattributed_bytes", UUID=GPU_UUID)
    assert unattributed is not None, text
    assert unattributed >= 10 * GiB, unattributed


def pod_token(world: World, pod: Mapping[str, Any]) -> str:
    """The agent's real token: the one the kubelet projected into its pod, bound to the pod
    (and so to the node)."""
    volumes = world.node.kubelet_root / "pods" / pod["metadata"]["uid"] / "volumes"
    tokens = sorted(volumes.glob("kubernetes.io~projected/kube-api-access-*/token"))
    assert len(tokens) == 1, tokens
    return str(tokens[0].read_text())


def as_token(world: World, token: str, method: str, path: str, body: object) -> tuple[int, str]:
    request = urllib.request.Request(
        f"{world.cluster.server}{path}",
        method=method,
        data=json.dumps(body).encode(),
        headers={
            "Authorization": f"Bearer {token}",
            "Content-Type": "application/strategic-merge-patch+json"
            if method == "PATCH"
            else "application/json",
        },
    )
    # The CA only: with the admin's client certificate the API server would not read the token.
    ca_only = ssl.create_default_context(cafile=str(world.cluster.pki["ca.crt"]))
    try:
        with urllib.request.urlopen(request, context=ca_only, timeout=10) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode()


def step_the_agent_labels_its_node_through_the_fence(world: World) -> None:
    """The agent, with the token the kubelet gave its pod, writes the sharing label on the real
    Node (through the shipped admission fence); the same token may not touch another Node."""
    label = "nvidia.com/device-plugin.config"
    wait_until(
        lambda: (
            world.api("GET", f"/api/v1/nodes/{NODE}")["metadata"]["labels"].get(label) == "slice-4"
        ),
        timeout=60,
        interval=0.5,
        what=f"the agent's {label}=slice-4 on {NODE}",
    )
    token = pod_token(world, only_pod(world, AGENT_SELECTOR))
    code, body = as_token(
        world,
        token,
        "POST",
        "/apis/authentication.k8s.io/v1/selfsubjectreviews",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
    )
    assert code == 201, body
    extra = json.loads(body)["status"]["userInfo"].get("extra", {})
    assert extra.get("authentication.kubernetes.io/node-name") == [NODE], body
    world.plane.create_fake_node(OTHER_NODE)
    code, body = as_token(
        world,
        token,
        "PATCH",
        f"/api/v1/nodes/{OTHER_NODE}",
        {"metadata": {"labels": {label: "slice-4"}}},
    )
    assert code == 403, (code, body)
    assert FENCE in body, body
    # As the agent writes: field manager gpuguard (the fence admits no other manager's entry).
    code, body = as_token(
        world,
        token,
        "PATCH",
        f"/api/v1/nodes/{NODE}?fieldManager=gpuguard",
        {"metadata": {"labels": {label: "slice-4"}}},
    )
    assert code == 200, (code, body)


def exec_in(world: World, pod: Mapping[str, Any], container: str, argv: Sequence[str]) -> str:
    """``kubectl exec``: through the API server to the kubelet's exec endpoint (no kubectl is
    built for the tests; the Python client speaks the same websocket protocol)."""
    from kubernetes import client, config, stream

    kubeconfig = str(world.cluster.admin_kubeconfig)
    api_client = config.new_client_from_config(kubeconfig)  # type: ignore[no-untyped-call]
    # The client's websocket leaves its TLS socket to the garbage collector: collect it here,
    # where its ResourceWarning is expected, not at the end of the session.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            out = stream.stream(
                client.CoreV1Api(api_client).connect_get_namespaced_pod_exec,
                pod["metadata"]["name"],
                pod["metadata"]["namespace"],
                container=container,
                command=list(argv),
                stderr=True,
                stdin=False,
                stdout=True,
                tty=False,
                _preload_content=True,
            )
        finally:
            api_client.close()
            gc.collect()
    return str(out)


def step_explain_inside_the_enforcer_pod_names_the_tenants_container(world: World) -> None:
    """The command docs/install.md and ``gpuguard --help`` give, as written."""
    neighbour = world.pod(TENANTS, NEIGHBOUR.name)
    pid = main_process(neighbour, "python3")
    enforcer = only_pod(world, ENFORCER_SELECTOR)
    out = exec_in(world, enforcer, "enforcer", ["gpuguard", "explain", str(pid), "--json"])
    got = json.loads(out)
    container_id = container_status(neighbour)["containerID"].removeprefix("containerd://")
    assert got["pid"] == pid, got
    assert got["is_pod"] is True, got
    assert got["pod_uid"] == neighbour["metadata"]["uid"], got
    assert got["container_id"] == container_id, got
    # The kubelet's cgroupfs driver names containers by their bare ID (no cri-containerd-
    # prefix, unlike the systemd driver): the cgroup does not say which runtime, and explain
    # says so rather than guess.
    assert got["runtime"] is None, got
    # This hybrid host's cgroup file has the v1 lines and a ``0::`` line naming the same path;
    # gpuguard reads the unified one when it names the container.
    cgroup = Path(f"/proc/{pid}/cgroup").read_text()
    assert got["cgroup_version"] == (2 if "\n0::/kubepods/" in "\n" + cgroup else 1), cgroup
    assert got["pod_found"] is True, got
    assert got["pod_namespace"] == TENANTS, got
    assert got["pod_name"] == NEIGHBOUR.name, got
    assert got["container_name"] == "train", got
    assert got["limit_bytes"] == 4 * GiB, got


def step_helm_uninstall_leaves_no_gpuguard_object(world: World) -> None:
    done = world.helm_run("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "2m")
    assert done.returncode == 0, done.stdout + done.stderr
    wait_until(
        lambda: not release_objects(lambda path: world.api("GET", path)),
        timeout=60,
        interval=0.5,
        what="no release object",
    )


STEPS = (
    step_the_chart_runs_with_its_security_context,
    step_the_offender_is_stopped_and_restarted_while_its_neighbours_live,
    step_signals_land,
    step_metrics_are_scraped_from_the_pod_ip_through_the_service,
    step_the_agent_labels_its_node_through_the_fence,
    step_explain_inside_the_enforcer_pod_names_the_tenants_container,
    step_helm_uninstall_leaves_no_gpuguard_object,
)


@pytest.mark.parametrize("round_", range(1, ROUNDS + 1))
def test_the_chart_on_a_real_node_stops_the_offender_and_leaves_nothing_behind(
    binaries: Binaries, tmp_path: Path, round_: int
) -> None:
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    with real_world(tmp_path, binaries) as world:
        timings["ready"] = time.monotonic() - t0
        for step in STEPS:
            if ONLY and step.__name__ not in ONLY and "uninstall" not in step.__name__:
                continue
            t = time.monotonic()
            try:
                step(world)
            except AssertionError as e:
                raise AssertionError(f"{step.__name__}: {e}\n{world.diagnostics()}") from e
            timings[step.__name__.removeprefix("step_")] = time.monotonic() - t
    left = leftovers([tmp_path])
    assert not left, f"round {round_} left behind: {left}"
    print(f"round {round_}: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()))
