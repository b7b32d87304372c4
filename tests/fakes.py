"""Test doubles above the ports and builders for core values, for unit tests.

Fakes implement the Protocols in ``gpuguard.ports`` in memory and hold whatever state the test
sets (``FakeGpuSource.processes``, ``FakeKiller.refuse``...); builders make model values with
sensible defaults (``gpu()``, ``mig_gpu()``, ``proc()``, ``pod()``, ``attr()``).

The line with ``gpuguard.sim`` (the demo's simulated node and cluster): a fake answers what the
test put in it, a simulation moves by itself (memory curves over time, processes that die when
signalled, mig-manager). Where the two model the same thing they share one implementation: the
Node Events double is ``sim.cluster.SimNodeEventSink``, a container's cgroup is
``sim.node.containerd_cgroup``. Both are checked against the ports: by the type checker (below,
and at the end of ``gpuguard/sim/node.py`` and ``cluster.py``) and by the same behaviour tests
(``tests/test_port_doubles.py``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from gpuguard import ports
from gpuguard.core.model import (
    Attribution,
    ContainerCgroup,
    ContainerId,
    DeviceKey,
    DeviceMemory,
    DeviceSkip,
    GpuDevice,
    GpuProcess,
    GpuSample,
    GpuUuid,
    KillTarget,
    LimitValue,
    NodeFacts,
    NodeLockState,
    Pod,
    PodEvent,
    PodRef,
    PodSnapshot,
    PodUid,
    ProcessIdentity,
    RefusalReason,
    Runtime,
    SampleIssue,
    SignalRefusal,
    SignalReport,
    SigtermFate,
    StopSignal,
    Trigger,
)
from gpuguard.core.node_condition import NodeCondition
from gpuguard.core.policy import UnallocatedUse
from gpuguard.core.stopping import plan_stop
from gpuguard.sim.node import containerd_cgroup

GiB = 1024**3
MiB = 1024**2


def gpu(index: int = 0, *, total: int = 80 * GiB, mps: bool = False) -> GpuDevice:
    return GpuDevice(
        index=index,
        uuid=GpuUuid(f"GPU-{index:08d}-0000-0000-0000-000000000000"),
        name="NVIDIA Test GPU",
        total_bytes=total,
        mps=mps,
    )


def mig_gpu(index: int = 0, gi: int = 1, *, total: int = 10 * GiB) -> GpuDevice:
    """MIG GPU instance ``gi`` of ``gpu(index)``: the same physical UUID."""
    return dataclasses.replace(
        gpu(index, total=total),
        name="NVIDIA Test GPU MIG 1g.10gb",
        gpu_instance_id=gi,
        compute_instance_id=0,
    )


def proc(pid: int, device: GpuDevice, used: int | None, *, mps: bool = False) -> GpuProcess:
    """``mps``: NVML lists it as an MPS client."""
    return GpuProcess(pid=pid, device=device.key, used_bytes=used, mps_client=mps)


def uid(n: int) -> PodUid:
    return PodUid(f"00000000-0000-4000-8000-{n:012d}")


def cid(n: int) -> ContainerId:
    return ContainerId(f"{n:064x}")


def pod(
    n: int,
    *,
    namespace: str = "team",
    limit: int | None = None,
    error: str | None = None,
    containers: int = 1,
) -> Pod:
    return Pod(
        uid=uid(n),
        namespace=namespace,
        name=f"pod-{n}",
        containers={cid(n * 10 + i): f"c{i}" for i in range(containers)},
        annotation_limit=LimitValue(limit_bytes=limit) if limit is not None else None,
        annotation_error=error,
    )


def cgroup_of(pod_uid: PodUid, container: ContainerId) -> ContainerCgroup:
    """A Guaranteed pod's containerd container, as the systemd cgroup driver names it."""
    return containerd_cgroup(pod_uid, container, qos_class=None)


def kill_target(
    n: int, device: GpuDevice, *, used: int = 10 * GiB, limit: int = 8 * GiB
) -> KillTarget:
    """Pod ``n``'s first container on ``device``, over its limit."""
    p = pod(n, limit=limit)
    container = cid(n * 10)
    return KillTarget(
        pod=PodRef(uid=p.uid, namespace=p.namespace, name=p.name),
        container_id=container,
        container_name="c0",
        cgroup=cgroup_of(p.uid, container),
        device=device.key,
        gpu_index=device.index,
        used_bytes=used,
        limit_bytes=limit,
    )


def attr(
    pid: int,
    *,
    pod_n: int | None,
    container: int = 0,
    start: int = 1000,
    holds_gpu: bool | None = True,
    ghost: bool = False,
) -> Attribution:
    if ghost:
        return Attribution.unknown(pid, "not in /proc")
    identity = ProcessIdentity(pid=pid, start_ticks=start)
    if pod_n is None:
        return Attribution(
            pid=pid,
            identity=identity,
            pod_uid=None,
            container_id=None,
            runtime=None,
            cgroup=None,
            cgroup_version=2,
            reason="no kubepods cgroup",
            holds_gpu=holds_gpu,
        )
    c = cid(pod_n * 10 + container)
    return Attribution(
        pid=pid,
        identity=identity,
        pod_uid=uid(pod_n),
        container_id=c,
        runtime=Runtime.CONTAINERD,
        cgroup=cgroup_of(uid(pod_n), c),
        cgroup_version=2,
        reason=None,
        holds_gpu=holds_gpu,
    )


def sample(seq: int, at: float, devices: list[GpuDevice], procs: list[GpuProcess]) -> GpuSample:
    return GpuSample(seq=seq, taken_at=at, devices=tuple(devices), processes=tuple(procs))


def snapshot(pods: list[Pod], *, synced: bool = True, contact: float | None = 0.0) -> PodSnapshot:
    return PodSnapshot(synced=synced, last_contact_at=contact, pods={p.uid: p for p in pods})


@dataclass
class FakeClock:
    """A clock tests move by hand."""

    now: float = 1000.0
    wall_now: float | None = 1.7e9
    """The wall time is this plus ``now``; ``None``: the real wall time (where an API server
    reads the timestamps, as on Events)."""

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return time.time() if self.wall_now is None else self.wall_now + self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class RealClock(FakeClock):
    """Real monotonic time, for tests where a thread keeps it (the fast path's reader, a read
    that hangs): so does everything else in them."""

    def monotonic(self) -> float:
        return time.monotonic()


@dataclass
class FakeGpuSource:
    """Returns whatever sample the test set; raises ``error`` when set."""

    clock: FakeClock
    devices: list[GpuDevice]
    processes: list[GpuProcess] = field(default_factory=list)
    seq: int = 0
    error: Exception | None = None
    skipped: tuple[DeviceSkip, ...] = ()
    """Devices the sample reports it could not read (as ``NvmlGpuSource`` does per device)."""
    issues: tuple[SampleIssue, ...] = ()
    """Values the sample refused to trust (as ``NvmlGpuSource`` reports them,
    ``tests/test_nvml_adapter.py``)."""
    memory: dict[DeviceKey, DeviceMemory] = field(default_factory=dict)
    """Memory reads that differ from the processes' sum (other tenants, the driver)."""

    def sample(self) -> GpuSample:
        if self.error is not None:
            raise self.error
        self.seq += 1
        got = sample(self.seq, self.clock.monotonic(), self.devices, self.processes)
        return dataclasses.replace(got, skipped=self.skipped, issues=self.issues)

    def sample_devices(self, devices: Collection[DeviceKey]) -> GpuSample:
        """Lists everything again (allowed by the port: "when it cannot tell")."""
        return self.sample()

    def read_memory(self) -> dict[DeviceKey, DeviceMemory]:
        """Each device's memory as the stand-in reports it: used = the known process usage,
        unless ``memory`` sets a device's reading."""
        if self.error is not None:
            raise self.error
        read = {}
        for d in self.devices:
            used = sum(p.used_bytes or 0 for p in self.processes if p.device == d.key)
            read[d.key] = DeviceMemory(
                total_bytes=d.total_bytes, used_bytes=used, free_bytes=max(0, d.total_bytes - used)
            )
        read.update(self.memory)
        return read


@dataclass
class FakeResolver:
    attributions: dict[int, Attribution] = field(default_factory=dict)

    def attribute(self, pid: int) -> Attribution:
        return self.attributions.get(pid) or attr(pid, pod_n=None, ghost=True)


@dataclass
class FakePodDirectory:
    clock: FakeClock
    pods: list[Pod] = field(default_factory=list)
    synced: bool = True
    api_up: bool = True
    last_contact: float | None = None
    rereads: list[dict[PodUid, float]] = field(default_factory=list)
    """Each ``reread`` the enforcer asked for."""
    labelled_namespaces: frozenset[str] | None = None
    """The namespaces carrying the admin's exempt label, as listed now (``None``: never)."""

    def snapshot(self) -> PodSnapshot:
        if self.api_up:
            self.last_contact = self.clock.monotonic()
        return replace(
            snapshot(self.pods, synced=self.synced, contact=self.last_contact),
            labelled_namespaces=self.labelled_namespaces,
            namespaces_contact_at=None if self.labelled_namespaces is None else self.last_contact,
        )

    def reread(self, asked: Mapping[PodUid, float]) -> None:
        self.rereads.append(dict(asked))

    def node(self) -> NodeFacts:
        return NodeFacts(name="node-1")


@dataclass
class FakeKiller:
    """Records every call; reports each live member of the target container as delivered,
    with the signal ``core.stopping.plan_stop`` picks from the members' ``fates`` (by PID;
    absent: ``caught``), as the real killer does."""

    members: dict[ContainerId, list[ProcessIdentity]] = field(default_factory=dict)
    calls: list[tuple[KillTarget, StopSignal]] = field(default_factory=list)
    refuse: RefusalReason | None = None
    fates: dict[int, SigtermFate] = field(default_factory=dict)

    def signal_container(
        self, target: KillTarget, signal: StopSignal, *, wait_seconds: float = 0.0
    ) -> SignalReport:
        self.calls.append((target, signal))
        members = tuple(self.members.get(target.container_id, ()))
        if self.refuse is not None:
            return SignalReport(
                signal=signal,
                refused=tuple(SignalRefusal(pid=m.pid, reason=self.refuse) for m in members),
            )
        stops = plan_stop(
            signal, {m.pid: self.fates.get(m.pid, SigtermFate.CAUGHT) for m in members}
        )
        return SignalReport(signal=signal, delivered=members, stops=tuple(stops.values()))


@dataclass
class FakeNodeLock:
    """The node lock, held by this enforcer or by ``holder_pid``; counts the tries."""

    holder_pid: int | None = None
    """Another process that holds it (``None``: free, so the next try takes it)."""
    path: str = "/run/gpuguard/enforcer.lock"
    tries: int = 0
    released: bool = False

    def hold(self) -> NodeLockState:
        self.tries += 1
        if self.holder_pid is not None:
            return NodeLockState(held=False, path=self.path, holder_pid=self.holder_pid)
        return NodeLockState(held=True, path=self.path)

    def release(self) -> None:
        self.released = True


@dataclass
class FakeNodeConditionWriter:
    """Keeps every condition the enforcer hands over (``ports.NodeConditionWriter``)."""

    given: list[tuple[NodeCondition, bool]] = field(default_factory=list)
    stopped: bool = False

    def set(self, condition: NodeCondition, *, standby: bool = False) -> None:
        self.given.append((condition, standby))

    def stop(self) -> None:
        self.stopped = True


@dataclass
class FakeEventSink:
    events: list[PodEvent] = field(default_factory=list)

    def post(self, event: PodEvent) -> None:
        self.events.append(event)


@dataclass
class FakeRecorder:
    polls: list[float] = field(default_factory=list)
    violations: int = 0
    triggers: list[Trigger] = field(default_factory=list)
    kills: int = 0
    killed: list[tuple[KillTarget, float]] = field(default_factory=list)
    refusals: list[RefusalReason] = field(default_factory=list)

    def observe_poll(self, seconds: float) -> None:
        self.polls.append(seconds)

    def count_violation(self, trigger: Trigger) -> None:
        self.violations += 1
        self.triggers.append(trigger)

    def count_kill(self, target: KillTarget, *, wall_time: float) -> None:
        self.kills += 1
        self.killed.append((target, wall_time))

    def count_refusal(self, reason: RefusalReason) -> None:
        self.refusals.append(reason)

    unallocated: list[UnallocatedUse] = field(default_factory=list)

    def count_unallocated(self, use: UnallocatedUse) -> None:
        self.unallocated.append(use)

    events_dropped: list[str] = field(default_factory=list)
    watch_restarts: list[tuple[str, str]] = field(default_factory=list)
    nvml_errors: list[str] = field(default_factory=list)

    def count_event_dropped(self, reason: str) -> None:
        self.events_dropped.append(reason)

    def count_watch_restart(self, resource: str, reason: str) -> None:
        self.watch_restarts.append((resource, reason))

    def count_nvml_error(self, call: str) -> None:
        self.nvml_errors.append(call)


__all__ = ["DeviceKey"]


# Each fake is checked against its port by the type checker (mypy --strict covers tests/), as
# the device plugin's `var _ Manager = (*null)(nil)`: a fake that drifts from its port fails
# `make lint`, not a test run later.
if TYPE_CHECKING:
    _clock: ports.Clock = FakeClock()
    _gpu: ports.FastGpuSource = FakeGpuSource(clock=FakeClock(), devices=[])
    _resolver: ports.ProcessResolver = FakeResolver()
    _directory: ports.NodeDirectory = FakePodDirectory(clock=FakeClock())
    _killer: ports.Killer = FakeKiller()
    _lock: ports.NodeLock = FakeNodeLock()
    _events: ports.EventSink = FakeEventSink()
    _recorder: ports.MetricsRecorder = FakeRecorder()
    _health: ports.HealthRecorder = FakeRecorder()
    _condition: ports.NodeConditionWriter = FakeNodeConditionWriter()
