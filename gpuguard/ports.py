"""Ports: the Protocols the runtime depends on. Adapters implement them; tests fake them.

Owns interfaces only. Must not import adapters or third-party libraries.
Blocking methods are called through ``asyncio.to_thread`` by the runtime.
"""

from __future__ import annotations

from typing import Protocol

from gpuguard.core.model import (
    Attribution,
    GpuSample,
    KillTarget,
    NodeFacts,
    PodEvent,
    PodSnapshot,
    RefusalReason,
    SignalReport,
    StopSignal,
)


class Clock(Protocol):
    """Injected time: monotonic for intervals, wall for timestamps."""

    def monotonic(self) -> float: ...

    def wall(self) -> float: ...


class GpuSource(Protocol):
    """Lists GPUs, MIG instances and compute processes (NVML)."""

    def sample(self) -> GpuSample:
        """Blocking. Raises ``GpuSourceError`` when nothing could be read at all."""
        ...


class ProcessResolver(Protocol):
    """Maps a host PID to its pod and container (``/proc/<pid>/cgroup``)."""

    def attribute(self, pid: int) -> Attribution:
        """Blocking. Never raises for a missing or unreadable PID: returns a reason instead."""
        ...


class PodDirectory(Protocol):
    """The pods of this node, as known from the API server."""

    def snapshot(self) -> PodSnapshot:
        """Non-blocking: the current in-memory view."""
        ...

    def node(self) -> NodeFacts:
        """Non-blocking: facts about this node (labels such as replicas)."""
        ...


class Killer(Protocol):
    """Signals the members of a container's cgroup, each re-verified through a pidfd."""

    def signal_container(
        self, target: KillTarget, signal: StopSignal, *, wait_seconds: float = 0.0
    ) -> SignalReport:
        """Blocking. Never signals a process whose identity or cgroup no longer matches."""
        ...


class EventSink(Protocol):
    """Records Kubernetes Events on pods. Must not block: buffers and rate-limits."""

    def post(self, event: PodEvent) -> None: ...


class MetricsRecorder(Protocol):
    """Cumulative metrics (counters, histograms); the snapshot gauges are published separately."""

    def observe_poll(self, seconds: float) -> None: ...

    def count_violation(self) -> None: ...

    def count_kill(self) -> None: ...

    def count_refusal(self, reason: RefusalReason) -> None: ...
