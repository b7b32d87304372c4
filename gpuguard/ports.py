"""Ports: the Protocols the runtime depends on. Adapters implement them; tests fake them.

Owns interfaces only. Must not import adapters or third-party libraries.
Blocking methods are called through ``asyncio.to_thread`` by the runtime.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Protocol

from gpuguard.core.agent import EvictionOutcome, NodePatch, SharingInputs
from gpuguard.core.allocation import NodeAllocations
from gpuguard.core.freeze import FrozenAllocation, GuardStop
from gpuguard.core.model import (
    Attribution,
    ContainerCgroup,
    DeviceKey,
    DeviceMemory,
    GpuSample,
    KillTarget,
    NodeFacts,
    NodeLockState,
    PodEvent,
    PodRef,
    PodSnapshot,
    PodUid,
    RefusalReason,
    SignalRefusal,
    SignalReport,
    StopSignal,
    Trigger,
)
from gpuguard.core.node_condition import NodeCondition
from gpuguard.core.policy import Decision, UnallocatedUse
from gpuguard.core.reconcile import NodeEvent, ReconcileError, WaitReason
from gpuguard.errors import GpuguardError


class Clock(Protocol):
    """Injected time: monotonic for intervals, wall for timestamps."""

    def monotonic(self) -> float: ...

    def wall(self) -> float: ...


class GpuSource(Protocol):
    """Lists GPUs, MIG instances and compute processes (NVML)."""

    def sample(self) -> GpuSample:
        """Blocking. Raises ``GpuSourceError`` when nothing could be read at all."""
        ...


class FastGpuSource(GpuSource, Protocol):
    """A GPU source that reads each device's memory cheaply and lists only some devices again:
    change-driven sampling (docs/design.md, Fast path)."""

    def read_memory(self) -> Mapping[DeviceKey, DeviceMemory]:
        """Blocking. The memory of every device the last sample listed; a device whose read
        failed is absent (so it is listed again). Raises ``GpuSourceError`` when nothing could
        be read at all."""
        ...

    def sample_devices(self, devices: Collection[DeviceKey]) -> GpuSample:
        """Blocking. Lists the GPUs that hold ``devices`` again and carries every other GPU's
        last listing over (``GpuSample.listings`` says which listing each device's processes
        come from); lists everything when it cannot tell (no sample yet, the GPU count
        changed, a device it does not know). Raises like ``sample()``."""
        ...


class QuietGate(Protocol):
    """Waits, between two fast reads, until the next one is worth making: reads memory in
    native code while nothing moves (docs/design.md, Fast path). Decides nothing: what it
    returns leads to the same fast read a sleep would have."""

    def wait(
        self,
        *,
        baseline: Mapping[DeviceKey, int],
        step_bytes: int,
        interval_seconds: float,
        first: float,
        until: float,
    ) -> str | None:
        """Blocking: reads every device's memory each ``interval_seconds`` from ``first``
        (``time.monotonic`` seconds) on, until one moved more than ``step_bytes`` from its
        ``baseline`` (``moved``), a read failed (``failed``), the next read would fall at or
        after ``until`` (``due``) or :meth:`wake`/:meth:`close` was called (``woken``).
        ``None``: it cannot wait now (the caller sleeps instead)."""
        ...

    def wake(self) -> None:
        """From any thread: the wait in progress (or the next, after :meth:`rearm`) returns."""
        ...

    def rearm(self) -> None:
        """From the waiting thread, before it reads what :meth:`wake` announces."""
        ...

    def close(self) -> None:
        """Every wait returns at once, for good."""
        ...

    def call_seconds(self) -> float | None:
        """How long the wait's NVML call in flight has run (``None``: none)."""
        ...


class ProcessResolver(Protocol):
    """Maps a host PID to its pod and container (``/proc/<pid>/cgroup``)."""

    def attribute(self, pid: int) -> Attribution:
        """Blocking. Never raises for a missing or unreadable PID: returns a reason instead."""
        ...


class PodDirectory(Protocol):
    """The pods of this node, as known from the API server (or a pods file)."""

    def snapshot(self) -> PodSnapshot:
        """Non-blocking: the current in-memory view."""
        ...

    def reread(self, asked: Mapping[PodUid, float]) -> None:
        """Non-blocking: read again, after each pod's moment (monotonic seconds), what its view
        rests on that no watch keeps current (its DRA claims; ``Decision.reread``), so a
        violation is acted on only on a fresh read. A source whose view is all watched does
        nothing."""
        ...


class NodeState(Protocol):
    """This node's own facts from its Node object: time-slicing replicas, MIG config state."""

    def node(self) -> NodeFacts:
        """Non-blocking: the current in-memory view."""
        ...


class NodeDirectory(PodDirectory, NodeState, Protocol):
    """The pods of this node and the node's own facts, from one source (the API server's list
    and watch, or a pods file): what the enforcer, ``inspect`` and ``explain`` read."""


class Lifecycle(Protocol):
    """A background source (list + watch threads, a file watcher): start, stop, health."""

    def start(self) -> None:
        """Non-blocking: starts the background work and returns."""
        ...

    def stop(self) -> None:
        """Blocking (briefly): stops the background work; idempotent."""
        ...

    def wait_synced(self, timeout_seconds: float) -> bool:
        """Blocking: whether the first full read (pods and, where there is one, the Node)
        completed within ``timeout_seconds``."""
        ...

    def problem(self) -> GpuguardError | None:
        """Non-blocking: the current problem (``PermanentError`` when e.g. RBAC denies a verb),
        ``None`` when healthy."""
        ...


class LiveNodeDirectory(NodeDirectory, Lifecycle, Protocol):
    """A ``NodeDirectory`` with its background work (the API server's watches, a file
    watcher): what ``app`` builds and starts for every command that reads pods."""


class GpuRelease(Protocol):
    """Letting go of the driver while mig-manager reconfigures MIG (docs/design.md, MIG
    reconfiguration)."""

    @property
    def released(self) -> bool: ...

    def release(self) -> None:
        """Blocking: nvmlShutdown; ``sample()`` raises ``GpuSourceError`` until ``acquire()``."""
        ...

    def acquire(self) -> None:
        """Blocking: nvmlInit again. Raises ``GpuSourceUnavailable`` when it cannot."""
        ...


class ReleasableGpuSource(FastGpuSource, GpuRelease, Protocol):
    """The enforcer's GPU source: fast reads, listings, and letting go for a MIG change."""


class AllocationSource(Protocol):
    """What the kubelet allocated each pod on this node (its pod-resources API)."""

    def read(self) -> NodeAllocations:
        """One bounded read: never raises, never blocks past its timeout; a failure is an
        answer whose ``unknown`` says why (never "nothing allocated")."""
        ...

    def close(self) -> None: ...


class Killer(Protocol):
    """Signals the members of a container's cgroup, each re-verified through a pidfd."""

    def signal_container(
        self, target: KillTarget, signal: StopSignal, *, wait_seconds: float = 0.0
    ) -> SignalReport:
        """Blocking. Never signals a process whose identity or cgroup no longer matches."""
        ...


class AllocationGuard(Protocol):
    """The eBPF allocation guard (docs/design.md, Allocation guard): per container cgroup and
    device, the bytes its processes may allocate before a caller is frozen at the call."""

    def write(
        self, budgets: Mapping[tuple[ContainerCgroup, int], int], devices: Collection[int]
    ) -> None:
        """Blocking. On the device indexes ``devices`` (just listed), guard exactly the
        (container cgroup, device index) entries of ``budgets`` with these headrooms, each count
        back to 0; every other cgroup written before on those devices is no longer guarded
        (never frozen). Other devices are left as they are. Raises ``OSError`` for the whole
        write; a cgroup gone already is skipped."""
        ...

    def stops(self, timeout_seconds: float) -> list[GuardStop]:
        """Blocking: the stops since the last call, waiting up to ``timeout_seconds`` for the
        first one."""
        ...

    def forget(self, *, tgid: int) -> None:
        """Blocking: ``tgid``'s freeze is resolved (resumed, or stopped for good): its record
        is dropped."""
        ...

    def close(self) -> None: ...


class Resumer(Protocol):
    """Resumes (SIGCONT) a caller the allocation guard froze, re-verified through a pidfd."""

    def resume(self, frozen: FrozenAllocation) -> SignalRefusal | int | None:
        """Blocking: ``None`` when resumed, the PID when it is gone or running already, else
        a refusal (never resumes a process not as read when it was frozen)."""
        ...


class GuardRecorder(Protocol):
    """The allocation guard's metrics (``gpuguard_alloc_guard_*``)."""

    def set_guard_active(self, *, active: bool, reason: str) -> None:
        """Whether the guard is attached (``reason`` why not, else empty)."""
        ...

    def count_thaw(self, reason: str) -> None:
        """A frozen caller was resumed, with why (``core.freeze.Fate``)."""
        ...


class NodeLock(Protocol):
    """The node-local lock that only one enforcer holds at a time (reliability R3): the kernel
    frees it when its holder exits, however it exits."""

    def hold(self) -> NodeLockState:
        """Blocking (a file operation; never waits for the lock). Take the lock when it is
        free; while held, check it is still the lock at its path (a deleted or replaced file is
        taken again): that check is an ``fstat`` and an ``lstat`` (microseconds), which the
        enforcer makes on its event loop. Never raises: a file that cannot be opened is
        ``problem``."""
        ...

    def release(self) -> None:
        """Give the lock up (idempotent)."""
        ...


class EventSink(Protocol):
    """Records Kubernetes Events on pods. Must not block: buffers and rate-limits."""

    def post(self, event: PodEvent) -> None: ...


class LiveEventSink(EventSink, Lifecycle, Protocol):
    """An ``EventSink`` with its background sender."""


class MetricsRecorder(Protocol):
    """Cumulative metrics (counters, histograms); the snapshot gauges are published separately."""

    def observe_poll(self, seconds: float) -> None: ...

    def count_violation(self, trigger: Trigger) -> None: ...

    def count_kill(self, target: KillTarget, *, wall_time: float) -> None:
        """A container stopped (first signal delivered), once per container per violation;
        ``wall_time``: Unix time, for the per-pod kill series."""
        ...

    def count_refusal(self, reason: RefusalReason) -> None: ...

    def count_unallocated(self, use: UnallocatedUse) -> None:
        """GPU use without an allocation reported (once per pod and device)."""
        ...


class HealthRecorder(Protocol):
    """The agent's own health counters (docs/design.md, Metrics), injected into the adapters that
    count.

    Methods must not block and must never raise (they are called from adapter threads)."""

    def count_event_dropped(self, reason: str) -> None:
        """An Event not posted: ``rate_limit``, ``buffer_full`` or ``api_error``."""
        ...

    def count_watch_restart(self, resource: str, reason: str) -> None:
        """A list/watch of ``resource`` (``pods``, ``nodes``, ``configmaps``) restarted: e.g.
        ``expired`` (410), ``timeout``, ``error``, ``inactivity``."""
        ...

    def count_nvml_error(self, call: str) -> None:
        """An NVML call failed or timed out; ``call`` is the NVML function's name."""
        ...


class KubeWriteRecorder(Protocol):
    """Counts failed writes of the enforcer's Node condition (``PrometheusHealthRecorder``).

    Must not block and must never raise (called from the writer's thread)."""

    def count_kube_write_error(self, resource: str) -> None:
        """A write to the API server failed and will be tried again: ``resource`` is what was
        written (``nodes/status``: the enforcer's Node condition)."""
        ...


class Publisher(Protocol):
    """Receives each cycle's decision for the metrics snapshot and readiness."""

    def publish(
        self, decision: Decision, *, wall_time: float, ready: bool, reason: str
    ) -> None: ...


class NodeConditionWriter(Protocol):
    """Keeps the ``GPUMemoryEnforced`` condition of the enforcer's own Node current
    (docs/design.md, Node condition)."""

    def set(self, condition: NodeCondition, *, standby: bool = False) -> None:
        """Non-blocking: the condition the Node should carry now; written in the background
        when it changed, and again as a heartbeat. ``standby``: another enforcer holds the
        node lock: a ``True`` condition on the Node is the holder's and is left alone."""
        ...

    def stop(self) -> None:
        """Blocking, briefly (bounded): write ``False``/``NotReady`` "enforcer stopped" (best
        effort; a standby enforcer leaves the holder's ``True``) and stop writing."""
        ...


class LiveNodeConditionWriter(NodeConditionWriter, Lifecycle, Protocol):
    """A ``NodeConditionWriter`` with its background writer: what ``app`` builds."""


# -- the sharing agent (docs/design.md, Sharing config) --------------------------------------------


class SharingSource(Lifecycle, Protocol):
    """The agent's reads: its Node, its node's GPU pods, the sharing ConfigMap validated against
    the two NVIDIA ConfigMaps it names (list + watch of each)."""

    def inputs(self) -> SharingInputs:
        """Non-blocking: the current in-memory view."""
        ...

    def gpu_pods_now(self) -> tuple[PodRef, ...]:
        """Blocking: the node's pods holding a GPU, read from the source of truth (not the
        watch, which may lag): checked right before a MIG change that needs an idle node.
        Raises ``GpuguardError`` when it cannot be read."""
        ...


class NodeWriter(Protocol):
    """The agent's writes to its own Node and its node's pods."""

    def patch_node(self, patch: NodePatch) -> str:
        """Blocking: one merge patch (field manager ``gpuguard``) conditional on
        ``patch.resource_version``; returns the Node's new resourceVersion. Raises
        ``errors.WriteConflict`` on 409, ``GpuguardError`` on any other failure."""
        ...

    def evict(self, pod: PodRef) -> EvictionOutcome:
        """Blocking: one Eviction (PodDisruptionBudgets honoured). Raises ``GpuguardError``
        on any failure other than a PodDisruptionBudget (429) or a missing pod (404)."""
        ...


class FenceProbe(Protocol):
    """Whether the agent's admission fence is in force (checked before the agent writes)."""

    def check_fence(self) -> None:
        """Blocking: a dry-run write the fence must refuse. Returns when it was refused by the
        fence; raises ``errors.FenceMissing`` when the API server allowed it, another
        ``GpuguardError`` when the check itself failed."""
        ...


class NodeEventSink(Protocol):
    """Records Kubernetes Events on the agent's Node. Must not block: buffers and rate-limits."""

    def post_node(self, event: NodeEvent) -> None: ...


class LiveSharingSource(SharingSource, Lifecycle, Protocol):
    """A ``SharingSource`` with its watches (what ``app`` builds and starts)."""


class LiveNodeEventSink(NodeEventSink, Lifecycle, Protocol):
    """A ``NodeEventSink`` with its background sender."""


class AgentRecorder(Protocol):
    """The agent's metrics (docs/design.md, Metrics). Must not block or raise."""

    def show_labels(
        self, *, rule: str | None, device_plugin_config: str | None, mig_config: str | None
    ) -> None:
        """``gpuguard_sharing_labels_info{node,rule,device_plugin_config,mig_config}`` 1 for
        these values (empty string for ``None``), the previous series removed."""
        ...

    def count_reconcile_error(self, reason: ReconcileError) -> None:
        """``gpuguard_sharing_reconcile_errors_total{reason}`` += 1."""
        ...

    def set_waiting(self, reason: WaitReason | None) -> None:
        """``gpuguard_sharing_waiting{reason}``: 1 for ``reason``, 0 for every other."""
        ...
