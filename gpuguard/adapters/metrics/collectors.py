"""Prometheus metrics: a custom collector over the last published decision, the enforcer's and
the sharing agent's counters and collectors, and the exposition ``/metrics`` serves.

Owns every metric name (docs/design.md, Metrics). Scrapes never call NVML: they render the last
snapshot, so series of pods that are gone disappear at the next scrape with no ``remove()``
bookkeeping. No PID label anywhere (unbounded churn). The registry is injected; only ``app.py``
picks one. Serving it over HTTP is ``gpuguard.adapters.metrics.server``'s: nothing here opens a
socket.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from gpuguard.core.coverage import coverage
from gpuguard.core.dra_shares import shares_on_device
from gpuguard.core.model import (
    DeviceKey,
    DraShare,
    GpuDevice,
    KillTarget,
    RefusalReason,
    Trigger,
)
from gpuguard.core.policy import Decision, UnallocatedUse
from gpuguard.core.reconcile import ReconcileError, WaitReason

_DRA_LABELS = (
    "dra_claim_name", "dra_claim_namespace", "dra_driver_name", "dra_pool_name", "dra_device_name",
)  # fmt: skip
"""dcgm-exporter's DRA labels, spelled as its ``internal/pkg/transformation/const.go`` does
(NVIDIA/dcgm-exporter 07c8727), filled by its ``PodMapper`` (``kubernetes.go``, 00673ef; behind
``KUBERNETES_ENABLE_DRA``; the Kubernetes docs' ``KubeletPodResourcesDynamicResources`` example
shows them on ``DCGM_FI_*`` series) for a GPU a container got through a ResourceClaim of driver
``gpu.nvidia.com``, from the kubelet's pod-resources API: ``DynamicResource.ClaimName`` and
``ClaimNamespace`` (the claim), ``ClaimResource.DriverName``, ``PoolName`` and ``DeviceName``
(its allocation result), the device mapped to its GPU ``UUID`` through the ResourceSlices. Ours
come from the same objects (``DraShare``: the claim's ``status.allocation.devices.results[]``),
so a series of ours joins its series on them. Where several of the pod's shares are on the
device, dcgm-exporter keeps whichever it met last; ours is the first in
``core.dra_shares.share_order`` (claim namespace, claim name, request), stable from scrape to
scrape. Empty (the same as absent in PromQL) when DRA allocated the pod nothing on the device."""

_POD_LABELS = (
    "namespace", "pod", "pod_uid", "container", "gpu", "UUID", "GPU_I_ID", "hostname",
    *_DRA_LABELS,
)  # fmt: skip
"""dcgm-exporter's label names (≥ 4.6 spells the host ``hostname`` and adds ``pod_uid``), then
its DRA labels: one fixed set for every per-pod family, as Prometheus needs."""

_NO_DRA_SHARE = ("",) * len(_DRA_LABELS)


def _dra_label_values(shares: Sequence[DraShare]) -> tuple[str, ...]:
    """``_DRA_LABELS`` of the first of ``shares`` (already in ``share_order``); empty when
    none."""
    if not shares:
        return _NO_DRA_SHARE
    first = shares[0]
    return (first.claim_name, first.claim_namespace, first.driver, first.pool, first.device)


EVENT_DROP_REASONS = ("rate_limit", "buffer_full", "api_error")
"""``gpuguard_events_dropped_total{reason}`` values, pre-created at 0."""

EXPOSITION_MAX_AGE_SECONDS: Final = 1.0
"""The oldest rendered exposition a scrape is served, for the values no recorder notes a change
of (the asyncio task count, kill series expiring): everything recorded is served exact."""


def _unchanged() -> None:
    return None


class MetricsRegistry(CollectorRegistry):
    """A registry that knows when what it serves last changed, so ``/metrics`` can render once
    per change instead of once per scrape: a flood of scrapes (or many Prometheus replicas) then
    costs the poll next to nothing.

    Every recorder and collector of this module calls ``changed()`` right after each change it
    makes. ``stamp`` counts the changes; an exposition rendered after reading stamp ``s``
    includes every change counted up to ``s``."""

    def __init__(self) -> None:
        super().__init__()
        self._stamp_lock = threading.Lock()
        self.stamp = 0

    def changed(self) -> None:
        with self._stamp_lock:  # monotonic across threads (a lost update would hide a change)
            self.stamp += 1


def change_notifier(registry: CollectorRegistry) -> Callable[[], None]:
    """What a recorder on ``registry`` calls after each change (nothing for a plain registry,
    whose server renders every scrape)."""
    return registry.changed if isinstance(registry, MetricsRegistry) else _unchanged


@dataclass(frozen=True, slots=True)
class _Rendered:
    body: bytes
    stamp: int
    started: float


class Exposition:
    """The ``/metrics`` body. On a ``MetricsRegistry``: a scrape gets the last rendering when no
    change was counted since it started and it is under ``EXPOSITION_MAX_AGE_SECONDS`` old;
    otherwise it renders, one rendering at a time, and scrapes that queued behind it take its
    result when it began after they arrived. On a plain registry: rendered every time."""

    def __init__(
        self, registry: CollectorRegistry, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._registry = registry
        self._versioned = registry if isinstance(registry, MetricsRegistry) else None
        self._clock = clock
        self._lock = threading.Lock()
        self._last: _Rendered | None = None

    def body(self) -> bytes:
        versioned = self._versioned
        if versioned is None:
            return generate_latest(self._registry)
        wanted, arrived = versioned.stamp, self._clock()
        with self._lock:
            last = self._last
            if (
                last is not None
                and last.stamp >= wanted
                and last.started >= arrived - EXPOSITION_MAX_AGE_SECONDS
            ):
                return last.body
            stamp, started = versioned.stamp, self._clock()
            body = generate_latest(versioned)
            self._last = _Rendered(body=body, stamp=stamp, started=started)
            return body


@dataclass(frozen=True, slots=True, kw_only=True)
class _Published:
    decision: Decision
    wall_time: float
    ready: bool
    reason: str


class SnapshotCollector(Collector):
    """Renders the last published decision as gauges. Thread-safe: publish swaps one reference.
    ``changed``: called after each publish (``MetricsRegistry.changed`` of its registry)."""

    def __init__(self, *, hostname: str, changed: Callable[[], None] = _unchanged) -> None:
        self._hostname = hostname
        self._last: _Published | None = None
        self._changed = changed

    def publish(self, decision: Decision, *, wall_time: float, ready: bool, reason: str) -> None:
        self._last = _Published(decision=decision, wall_time=wall_time, ready=ready, reason=reason)
        self._changed()

    @property
    def ready(self) -> tuple[bool, str]:
        last = self._last
        if last is None:
            return False, "no poll finished yet"
        return last.ready, last.reason

    def collect(self) -> Iterable[Metric]:
        last = self._last
        used = GaugeMetricFamily(
            "gpuguard_pod_gpu_memory_used_bytes",
            "GPU memory used by the pod's processes on one GPU or MIG instance.",
            labels=_POD_LABELS,
        )
        limit = GaugeMetricFamily(
            "gpuguard_pod_gpu_memory_limit_bytes",
            "The pod's effective GPU memory limit on one GPU or MIG instance.",
            labels=_POD_LABELS,
        )
        unattributed = GaugeMetricFamily(
            "gpuguard_gpu_memory_unattributed_bytes",
            "GPU memory held by processes no pod owns (host processes, ghosts, reused PIDs).",
            labels=("gpu", "UUID", "GPU_I_ID", "hostname"),
        )
        last_poll = GaugeMetricFamily(
            "gpuguard_last_poll_timestamp_seconds",
            "Unix time when the last enforcement poll finished.",
        )
        listed = GaugeMetricFamily(
            "gpuguard_gpu_last_listing_timestamp_seconds",
            "Unix time of the process listing the GPU's (or MIG instance's) figures come from:"
            " change-driven sampling lists a device again only when its memory moved, or at the"
            " latest every poll interval.",
            labels=("gpu", "UUID", "GPU_I_ID", "hostname"),
        )
        active = GaugeMetricFamily(
            "gpuguard_enforcement_active",
            "1 when the enforcer can act; 0 with the reason it cannot.",
            labels=("reason",),
        )
        if last is not None:
            decision = last.decision
            for usage in decision.usages:
                d = usage.device
                values = (
                    usage.pod.namespace,
                    usage.pod.name,
                    usage.pod.uid,
                    usage.container or "",
                    str(d.index),
                    d.uuid,
                    "" if d.gpu_instance_id is None else str(d.gpu_instance_id),
                    self._hostname,
                    *_dra_label_values(shares_on_device(usage.limit, d)),
                )
                used.add_metric(values, float(usage.used_bytes))
                if usage.limit.limit_bytes is not None:
                    limit.add_metric(values, float(usage.limit.limit_bytes))
            by_key = {d.key: d for d in decision.devices}
            for key, value in decision.unattributed_bytes.items():
                unattributed.add_metric(self._device_labels(key, by_key.get(key)), float(value))
            for key, age in decision.listing_ages.items():
                listed.add_metric(self._device_labels(key, by_key.get(key)), last.wall_time - age)
            last_poll.add_metric((), last.wall_time)
            active.add_metric((last.reason,), 1.0 if last.ready else 0.0)
        else:
            active.add_metric(("starting",), 0.0)
        yield from (used, limit, unattributed, *self._coverage(), listed, last_poll, active)

    def _coverage(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        """Each device's memory by what bounds it, and its pods nothing bounds (``core.coverage``),
        from the last published cycle."""
        bound = GaugeMetricFamily(
            "gpuguard_gpu_memory_bound_bytes",
            "GPU memory of a GPU or MIG instance by what bounds it: the declaration that bound"
            " its pod's limit there, none (a pod nothing bounds: no limit, or exempt), or"
            " unattributed (no pod's). Usage NVML reports as N/A is in none of them.",
            labels=("gpu", "UUID", "GPU_I_ID", "hostname", "bound_by"),
        )
        unbounded = GaugeMetricFamily(
            "gpuguard_pods_unbounded",
            "Pods with memory on a GPU or MIG instance that nothing bounds there (no limit"
            " applies, or the namespace is exempt).",
            labels=("gpu", "UUID", "GPU_I_ID", "hostname"),
        )
        last = self._last
        if last is None:
            return bound, unbounded
        decision = last.decision
        by_key = {d.key: d for d in decision.devices}
        covered = coverage(by_key, decision.usages, decision.unattributed_bytes)
        for key, cover in covered.items():
            labels = self._device_labels(key, by_key.get(key))
            for by, value in cover.bound_bytes.items():
                bound.add_metric((*labels, by.value), float(value))
            unbounded.add_metric(labels, float(cover.pods_unbounded))
        return bound, unbounded

    def _device_labels(self, key: DeviceKey, device: GpuDevice | None) -> tuple[str, ...]:
        """``gpu``, ``UUID``, ``GPU_I_ID``, ``hostname`` of one GPU or MIG instance."""
        return (
            str(device.index) if device else "",
            key.uuid,
            "" if key.gpu_instance_id is None else str(key.gpu_instance_id),
            self._hostname,
        )


class PrometheusHealthRecorder:
    """The process's own health counters (``ports.HealthRecorder``, docs/design.md, Metrics): what
    both the enforcer and the agent serve."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._changed = change_notifier(registry)
        self._events_dropped = Counter(
            "gpuguard_events_dropped",
            "Kubernetes Events not posted, by reason (rate_limit, buffer_full, api_error).",
            labelnames=("reason",),
            registry=registry,
        )
        self._watch_restarts = Counter(
            "gpuguard_watch_restarts",
            "List/watch restarts of an API resource, by resource and reason.",
            labelnames=("resource", "reason"),
            registry=registry,
        )
        self._nvml_errors = Counter(
            "gpuguard_nvml_errors",
            "NVML calls that failed or timed out, by NVML function.",
            labelnames=("call",),
            registry=registry,
        )
        self._kube_write_errors = Counter(
            "gpuguard_kube_write_errors",
            "Writes to the API server that failed (tried again), by resource (nodes/status).",
            labelnames=("resource",),
            registry=registry,
        )
        # Pre-create every reason so alert rules see 0 instead of an absent series.
        for dropped in EVENT_DROP_REASONS:
            self._events_dropped.labels(reason=dropped)
        self._kube_write_errors.labels(resource="nodes/status")

    def count_event_dropped(self, reason: str) -> None:
        self._events_dropped.labels(reason=reason).inc()
        self._changed()

    def count_watch_restart(self, resource: str, reason: str) -> None:
        self._watch_restarts.labels(resource=resource, reason=reason).inc()
        self._changed()

    def count_nvml_error(self, call: str) -> None:
        self._nvml_errors.labels(call=call).inc()
        self._changed()

    def count_kube_write_error(self, resource: str) -> None:
        self._kube_write_errors.labels(resource=resource).inc()
        self._changed()


KILL_SERIES_SECONDS = 900.0
"""How long ``gpuguard_pod_last_kill_timestamp_seconds`` keeps a stopped container's series:
long enough for an alert to fire on it at any scrape interval, short enough to stay bounded."""
MAX_KILL_SERIES = 10_000
"""At most this many kill series at once (the oldest go first): bounded whatever the kill rate."""


class _KillSeries(Collector):
    """``gpuguard_pod_last_kill_timestamp_seconds``: one series per stopped container and device
    (the per-pod labels), its value the Unix time of the stop, dropped ``KILL_SERIES_SECONDS``
    later. ``gpuguard_kills_total`` has no pod label (docs/design.md, Metrics); this series is how
    an alert names the pod of a stop however short the pod was over its limit before it."""

    def __init__(self, *, retention_seconds: float, wall: Callable[[], float]) -> None:
        self._retention = retention_seconds
        self._wall = wall
        self._lock = threading.Lock()
        self._kills: dict[tuple[str, ...], float] = {}

    def record(self, labels: tuple[str, ...], wall_time: float) -> None:
        with self._lock:
            self._kills.pop(labels, None)
            self._kills[labels] = wall_time
            while len(self._kills) > MAX_KILL_SERIES:
                del self._kills[next(iter(self._kills))]

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(
            "gpuguard_pod_last_kill_timestamp_seconds",
            "Unix time the enforcer last stopped this container on this GPU (first signal "
            f"delivered); the series is dropped {KILL_SERIES_SECONDS:.0f} s later.",
            labels=_POD_LABELS,
        )
        horizon = self._wall() - self._retention
        with self._lock:
            self._kills = {k: t for k, t in self._kills.items() if t >= horizon}
            kills = list(self._kills.items())
        for labels, wall_time in kills:
            family.add_metric(labels, wall_time)
        yield family


class PrometheusRecorder(PrometheusHealthRecorder):
    """The enforcer's counters and poll histogram (``ports.MetricsRecorder``), the per-pod kill
    series and the health counters, on an injected registry."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        hostname: str = "",
        kill_series_seconds: float = KILL_SERIES_SECONDS,
        wall: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(registry)
        self._hostname = hostname
        self._kill_series = _KillSeries(retention_seconds=kill_series_seconds, wall=wall)
        registry.register(self._kill_series)
        self._violations = Counter(
            "gpuguard_violations",
            "Confirmed GPU memory limit violations, by what confirmed them: the grace period, or"
            " device memory pressure (grace skipped).",
            labelnames=("trigger",),
            registry=registry,
        )
        self._kills = Counter(
            "gpuguard_kills",
            "Offending containers stopped (first signal delivered).",
            registry=registry,
        )
        self._refusals = Counter(
            "gpuguard_refusals",
            "Decisions not to act, by reason code.",
            labelnames=("reason",),
            registry=registry,
        )
        self._poll = Histogram(
            "gpuguard_poll_duration_seconds",
            "Duration of one enforcement poll (gather, attribute, decide, act).",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=registry,
        )
        self._unallocated = Counter(
            "gpuguard_unallocated_gpu_use",
            "Pods found using a GPU (or MIG instance) that none of their allocations names"
            " (device plugin devices, DRA shares, a listed scheduler's pin), once per pod and"
            " device.",
            labelnames=("gpu", "UUID", "GPU_I_ID", "hostname"),
            registry=registry,
        )
        for reason in RefusalReason:
            self._refusals.labels(reason=reason.value)
        for trigger in Trigger:
            self._violations.labels(trigger=trigger.value)

    def observe_poll(self, seconds: float) -> None:
        self._poll.observe(seconds)
        self._changed()

    def count_violation(self, trigger: Trigger) -> None:
        self._violations.labels(trigger=trigger.value).inc()
        self._changed()

    def count_kill(self, target: KillTarget, *, wall_time: float) -> None:
        self._kills.inc()
        device = target.device
        self._kill_series.record(
            (
                target.pod.namespace,
                target.pod.name,
                target.pod.uid,
                target.container_name or "",
                str(target.gpu_index),
                device.uuid,
                "" if device.gpu_instance_id is None else str(device.gpu_instance_id),
                self._hostname,
                *_dra_label_values(target.dra_shares),
            ),
            wall_time,
        )
        self._changed()

    def count_refusal(self, reason: RefusalReason) -> None:
        self._refusals.labels(reason=reason.value).inc()
        self._changed()

    def count_unallocated(self, use: UnallocatedUse) -> None:
        device = use.device
        gi = "" if device.gpu_instance_id is None else str(device.gpu_instance_id)
        self._unallocated.labels(
            gpu=str(device.index), UUID=device.uuid, GPU_I_ID=gi, hostname=self._hostname
        ).inc()
        self._changed()


class PrometheusGuardRecorder:
    """The allocation guard's metrics (``ports.GuardRecorder``) on an injected registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._active = Gauge(
            "gpuguard_alloc_guard_active",
            "1 while the eBPF allocation guard is attached; 0 with the reason it is not.",
            labelnames=("reason",),
            registry=registry,
        )
        self._thaws = Counter(
            "gpuguard_alloc_guard_thaws",
            "Callers the allocation guard froze and the enforcer resumed, by why.",
            labelnames=("reason",),
            registry=registry,
        )
        self._changed = change_notifier(registry)

    def set_guard_active(self, *, active: bool, reason: str) -> None:
        """Set once, at start: whether the guard attached does not change while it runs."""
        self._active.labels(reason=reason).set(1 if active else 0)
        self._changed()

    def count_thaw(self, reason: str) -> None:
        self._thaws.labels(reason=reason).inc()
        self._changed()


class PrometheusAgentRecorder(Collector):
    """The sharing agent's metrics (``ports.AgentRecorder``, docs/design.md, Metrics) on an injected
    registry.

    The info and waiting gauges are rendered from the current values at each scrape (each a
    reference swapped whole, so thread-safe without a lock, and no ``remove()`` bookkeeping): a
    changed label set leaves no stale series. The error counter is a plain ``Counter`` with
    every reason pre-created at 0.
    """

    def __init__(self, registry: CollectorRegistry, *, node: str) -> None:
        self._node = node
        self._changed = change_notifier(registry)
        self._labels: tuple[str, str, str] | None = None
        """``(rule, device_plugin_config, mig_config)``; ``None``: no series yet."""
        self._waiting: WaitReason | None = None
        self._errors = Counter(
            "gpuguard_sharing_reconcile_errors",
            "Sharing reconcile errors, by reason (once per episode).",
            labelnames=("reason",),
            registry=registry,
        )
        # Pre-create every reason so alert rules see 0 instead of an absent series.
        for reason in ReconcileError:
            self._errors.labels(reason=reason.value)
        registry.register(self)

    # -- ports.AgentRecorder -------------------------------------------------------------------

    def show_labels(
        self, *, rule: str | None, device_plugin_config: str | None, mig_config: str | None
    ) -> None:
        self._labels = (rule or "", device_plugin_config or "", mig_config or "")
        self._changed()

    def count_reconcile_error(self, reason: ReconcileError) -> None:
        self._errors.labels(reason=reason.value).inc()
        self._changed()

    def set_waiting(self, reason: WaitReason | None) -> None:
        self._waiting = reason
        self._changed()

    # -- prometheus_client.registry.Collector --------------------------------------------------

    def describe(self) -> Iterable[Metric]:
        """The families' names, so the registry refuses a second collector of them."""
        return self.collect()

    def collect(self) -> Iterable[Metric]:
        labels, waiting_for = self._labels, self._waiting
        info = GaugeMetricFamily(
            "gpuguard_sharing_labels_info",
            "The sharing rule that matches this node and the label values it sets "
            "(empty: none or left alone).",
            labels=("node", "rule", "device_plugin_config", "mig_config"),
        )
        if labels is not None:
            info.add_metric((self._node, *labels), 1.0)
        waiting = GaugeMetricFamily(
            "gpuguard_sharing_waiting",
            "1 while a MIG change (or a label whose NVIDIA ConfigMap cannot be read) waits, "
            "for this reason; 0 for every other reason.",
            labels=("reason",),
        )
        for reason in WaitReason:
            waiting.add_metric((reason.value,), 1.0 if reason is waiting_for else 0.0)
        yield from (info, waiting)


class AsyncioTasksCollector(Collector):
    """``gpuguard_asyncio_tasks``: the unfinished asyncio tasks of one event loop, counted when
    ``/metrics`` is rendered (no recorder notes a change of it, so a scrape may get a count up to
    ``EXPOSITION_MAX_AGE_SECONDS`` old), for both the enforcer and the agent: a count that keeps
    growing is a task leak.

    Renderings run on the server's threads: ``asyncio.all_tasks`` copies the task set, retrying
    if the loop changes it meanwhile, so counting off the loop's thread is safe. Once the loop is
    closed the count is 0."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def describe(self) -> Iterable[Metric]:
        """The family's name, so the registry refuses a second collector of it."""
        return self.collect()

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(
            "gpuguard_asyncio_tasks",
            "Unfinished asyncio tasks of the process's event loop.",
            value=float(len(asyncio.all_tasks(self._loop))),
        )
