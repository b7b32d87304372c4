"""The demo's simulated GPU node: the enforcer's world, in memory, for ``gpuguard demo``.

Owns ``SimNode``, which implements the enforcer's ports as the real adapters do (FastGpuSource,
ProcessResolver, PodDirectory, Killer, EventSink) over one state under one lock (split, the
ports' views of that state could disagree), its processes (``SimProcess``, their usage as a
function of time: ``ramp``, ``steady``), the signals it took (``SignalRecord``) and the builders
of its GPUs and pods (``sim_gpu``, ``sim_pod``, ``sim_manifest``). So the demo runs the real
core, runtime and metrics. Must never touch real processes, /proc, cgroups, NVML or an API
server (no kubernetes import, no adapter: import-linter contracts).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpuguard.core.model import (
    LIMIT_ANNOTATION,
    Attribution,
    ContainerCgroup,
    ContainerId,
    DeviceKey,
    DeviceMemory,
    GpuDevice,
    GpuProcess,
    GpuSample,
    GpuUuid,
    KillTarget,
    NodeFacts,
    Pod,
    PodEvent,
    PodSnapshot,
    PodUid,
    ProcessIdentity,
    Runtime,
    SignalReport,
    StopSignal,
)
from gpuguard.kubemodel.translate import pod_from_json
from gpuguard.ports import Clock

GiB = 1024**3

UsageFn = Callable[[float], int | None]
"""Bytes used as a function of seconds since the simulation started; ``None`` = N/A."""


@dataclass(slots=True, kw_only=True)
class SimProcess:
    """A simulated process holding GPU memory."""

    pid: int
    start_ticks: int
    gpu: int
    usage: UsageFn
    pod_uid: PodUid | None = None
    container_id: ContainerId | None = None
    ignores_term: bool = False
    alive: bool = True
    signals: list[StopSignal] = field(default_factory=list)

    @property
    def cgroup(self) -> ContainerCgroup | None:
        if self.pod_uid is None or self.container_id is None:
            return None
        return containerd_cgroup(self.pod_uid, self.container_id, qos_class="burstable")


def containerd_cgroup(
    pod_uid: PodUid, container_id: ContainerId, *, qos_class: str | None
) -> ContainerCgroup:
    """The cgroup v2 a containerd container gets from the kubelet's systemd driver: under
    ``kubepods-<qos_class>.slice`` (``burstable``, ``besteffort``), or directly under
    ``kubepods.slice`` for a Guaranteed pod (``None``). ``core.cgroup`` reads the pod and the
    container back from it, as from a real ``/proc/<pid>/cgroup``."""
    slice_uid = pod_uid.replace("-", "_")
    qos = f"kubepods-{qos_class}.slice/kubepods-{qos_class}-" if qos_class else "kubepods-"
    return ContainerCgroup(
        version=2,
        hierarchy="",
        path=f"/kubepods.slice/{qos}pod{slice_uid}.slice/cri-containerd-{container_id}.scope",
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class SignalRecord:
    """One signal the simulated killer delivered."""

    at: float
    pid: int
    pod_uid: PodUid | None
    container_id: ContainerId | None
    signal: StopSignal


class SimNode:
    """A node with GPUs, pods and processes whose memory follows scripted curves over time."""

    def __init__(self, *, clock: Clock, node_name: str, gpus: list[GpuDevice]) -> None:
        self._clock = clock
        self._t0 = clock.monotonic()
        self._node = node_name
        self._gpus = gpus
        self._lock = threading.Lock()
        self._processes: dict[int, SimProcess] = {}
        self._pods: dict[PodUid, Pod] = {}
        self._seq = 0
        self.signals: list[SignalRecord] = []
        self.events: list[PodEvent] = []

    # -- scenario building ------------------------------------------------------------------

    def elapsed(self) -> float:
        """Seconds since the simulation started."""
        return self._clock.monotonic() - self._t0

    def add_pod(self, pod: Pod) -> None:
        with self._lock:
            self._pods[pod.uid] = pod

    def add_process(self, process: SimProcess) -> None:
        with self._lock:
            self._processes[process.pid] = process

    def process(self, pid: int) -> SimProcess:
        return self._processes[pid]

    def pods(self) -> list[Pod]:
        return list(self._pods.values())

    # -- GpuSource ----------------------------------------------------------------------------

    def sample(self) -> GpuSample:
        now = self.elapsed()
        with self._lock:
            self._seq += 1
            processes = tuple(
                GpuProcess(pid=p.pid, device=self._gpus[p.gpu].key, used_bytes=p.usage(now))
                for p in self._processes.values()
                if p.alive
            )
            return GpuSample(
                seq=self._seq,
                taken_at=self._clock.monotonic(),
                devices=tuple(self._gpus),
                processes=processes,
            )

    def sample_devices(self, devices: Collection[DeviceKey]) -> GpuSample:
        """Lists every GPU again (allowed by the port: a simulated listing costs nothing)."""
        return self.sample()

    def read_memory(self) -> dict[DeviceKey, DeviceMemory]:
        """Each GPU's memory now: used = its live processes' scripted usage."""
        now = self.elapsed()
        with self._lock:
            used = {gpu.key: 0 for gpu in self._gpus}
            for p in self._processes.values():
                if p.alive:
                    used[self._gpus[p.gpu].key] += p.usage(now) or 0
        return {
            gpu.key: DeviceMemory(
                total_bytes=gpu.total_bytes,
                used_bytes=used[gpu.key],
                free_bytes=max(0, gpu.total_bytes - used[gpu.key]),
            )
            for gpu in self._gpus
        }

    # -- ProcessResolver ----------------------------------------------------------------------

    def attribute(self, pid: int) -> Attribution:
        p = self._processes.get(pid)
        if p is None or not p.alive:
            return Attribution.unknown(pid, "not in /proc")
        return Attribution(
            pid=pid,
            identity=ProcessIdentity(pid=pid, start_ticks=p.start_ticks),
            pod_uid=p.pod_uid,
            container_id=p.container_id,
            runtime=Runtime.CONTAINERD if p.container_id else None,
            cgroup=p.cgroup,
            cgroup_version=2,
            reason=None if p.pod_uid else "no kubepods cgroup (host process)",
            holds_gpu=True,
        )

    # -- PodDirectory -------------------------------------------------------------------------

    def snapshot(self) -> PodSnapshot:
        with self._lock:
            return PodSnapshot(
                synced=True, last_contact_at=self._clock.monotonic(), pods=dict(self._pods)
            )

    def reread(self, asked: Mapping[PodUid, float]) -> None:
        """Nothing to read again: the simulated pods carry no DRA claims."""

    def node(self) -> NodeFacts:
        return NodeFacts(name=self._node)

    # -- Killer -------------------------------------------------------------------------------

    def signal_container(
        self, target: KillTarget, signal: StopSignal, *, wait_seconds: float = 0.0
    ) -> SignalReport:
        """Signal every live process of the target container, as the real killer would."""
        delivered: list[ProcessIdentity] = []
        gone: list[int] = []
        with self._lock:
            for p in self._processes.values():
                if p.pod_uid != target.pod.uid or p.container_id != target.container_id:
                    continue
                if not p.alive:
                    gone.append(p.pid)
                    continue
                p.signals.append(signal)
                delivered.append(ProcessIdentity(pid=p.pid, start_ticks=p.start_ticks))
                self.signals.append(
                    SignalRecord(
                        at=self.elapsed(),
                        pid=p.pid,
                        pod_uid=p.pod_uid,
                        container_id=p.container_id,
                        signal=signal,
                    )
                )
                if signal is StopSignal.KILL or not p.ignores_term:
                    p.alive = False
        return SignalReport(signal=signal, delivered=tuple(delivered), already_gone=tuple(gone))

    # -- EventSink ----------------------------------------------------------------------------

    def post(self, event: PodEvent) -> None:
        self.events.append(event)


def sim_gpu(index: int, *, total_bytes: int = 80 * GiB) -> GpuDevice:
    """A simulated full GPU."""
    return GpuDevice(
        index=index,
        uuid=GpuUuid(f"GPU-5e1f0000-0000-4000-8000-{index:012d}"),
        name="NVIDIA H100 80GB HBM3 (simulated)",
        total_bytes=total_bytes,
    )


def sim_pod(
    uid: str,
    namespace: str,
    name: str,
    *,
    containers: Mapping[str, str],
    limit: str | None = None,
    annotations: Mapping[str, object] | None = None,
    resource_limits: Mapping[str, Mapping[str, object]] | None = None,
) -> Pod:
    """A simulated pod, built as its manifest would be read (``kubemodel.translate``):
    ``containers`` maps container ID → name (running under containerd), ``limit`` becomes the
    limit annotation, ``annotations`` are any others (values of any type, as a manifest's),
    ``resource_limits`` container name → its ``resources.limits`` (another scheduler's)."""
    manifest = sim_manifest(
        uid,
        namespace,
        name,
        containers=containers,
        limit=limit,
        annotations=annotations,
        resource_limits=resource_limits,
    )
    pod = pod_from_json(manifest)
    if pod is None:
        raise ValueError(f"a simulated pod needs a uid, a name and a namespace: {uid!r}")
    return pod


def sim_manifest(
    uid: str,
    namespace: str,
    name: str,
    *,
    containers: Mapping[str, str],
    limit: str | None = None,
    annotations: Mapping[str, object] | None = None,
    resource_limits: Mapping[str, Mapping[str, object]] | None = None,
) -> dict[str, Any]:
    """The Pod JSON of a simulated pod, as the API server would list it."""
    limits = resource_limits or {}
    all_annotations = dict(annotations or {})
    if limit is not None:
        all_annotations[LIMIT_ANNOTATION] = limit
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "uid": uid,
            "namespace": namespace,
            "name": name,
            "annotations": all_annotations,
        },
        "spec": {
            "containers": [
                {
                    "name": cname,
                    **({"resources": {"limits": dict(limits[cname])}} if cname in limits else {}),
                }
                for cname in containers.values()
            ]
        },
        "status": {
            "containerStatuses": [
                {"name": cname, "containerID": f"containerd://{cid}"}
                for cid, cname in containers.items()
            ]
        },
    }


def ramp(start_bytes: int, end_bytes: int, *, from_s: float, to_s: float) -> UsageFn:
    """Memory that grows linearly from ``start_bytes`` to ``end_bytes`` between two times."""

    def usage(t: float) -> int:
        if t <= from_s:
            return start_bytes
        if t >= to_s:
            return end_bytes
        return int(start_bytes + (end_bytes - start_bytes) * (t - from_s) / (to_s - from_s))

    return usage


def steady(n_bytes: int) -> UsageFn:
    """Constant memory."""
    return lambda _t: n_bytes


# Each simulated adapter is checked against its port by the type checker, as ``tests/fakes.py``'s
# fakes are: one that drifts from its port fails `make lint`, not a demo run later.
if TYPE_CHECKING:
    from gpuguard import ports

    def _check_ports(node: SimNode) -> list[object]:
        gpu: ports.GpuSource = node
        resolver: ports.ProcessResolver = node
        directory: ports.NodeDirectory = node
        killer: ports.Killer = node
        events: ports.EventSink = node
        return [gpu, resolver, directory, killer, events]
