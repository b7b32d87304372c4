"""Prometheus metrics: a custom collector over the last published decision, counters, the
sharing agent's metrics, and the HTTP server for ``/metrics``, ``/healthz`` and ``/readyz``.

Owns every metric name (docs/design.md, Metrics). Scrapes never call NVML: they render the last
snapshot, so series of pods that are gone disappear at the next scrape with no ``remove()``
bookkeeping. No PID label anywhere (unbounded churn). The registry is injected; only ``app.py``
picks one.

The server also answers the kubelet's probes, so no client may hold it up: a request head must
arrive within a few seconds, connections (and their threads) are bounded, and a client hanging up
is not an error. It must not parse listen addresses (``config.parse_listen_address`` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import io
import queue
import select
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any, Final

import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from gpuguard.core.model import DeviceKey, GpuDevice, KillTarget, RefusalReason, Trigger
from gpuguard.core.policy import Decision
from gpuguard.core.reconcile import ReconcileError, WaitReason

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

log = structlog.get_logger(__name__)

_POD_LABELS = (
    "namespace", "pod", "pod_uid", "container", "gpu", "UUID", "GPU_I_ID", "hostname",
)  # fmt: skip
"""dcgm-exporter's label names (≥ 4.6 spells the host ``hostname`` and adds ``pod_uid``)."""

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
        yield from (used, limit, unattributed, listed, last_poll, active)

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
        # Pre-create every reason so alert rules see 0 instead of an absent series.
        for dropped in EVENT_DROP_REASONS:
            self._events_dropped.labels(reason=dropped)

    def count_event_dropped(self, reason: str) -> None:
        self._events_dropped.labels(reason=reason).inc()
        self._changed()

    def count_watch_restart(self, resource: str, reason: str) -> None:
        self._watch_restarts.labels(resource=resource, reason=reason).inc()
        self._changed()

    def count_nvml_error(self, call: str) -> None:
        self._nvml_errors.labels(call=call).inc()
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
            ),
            wall_time,
        )
        self._changed()

    def count_refusal(self, reason: RefusalReason) -> None:
        self._refusals.labels(reason=reason.value).inc()
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


# ---------------------------------------------------------------------------------------------
# The HTTP server. It answers the kubelet's liveness and readiness probes (1 s timeout by
# default), so no client may hold it up: ThreadingHTTPServer gave every connection a thread for
# as long as it stayed open, queued 5 at most, and printed a traceback to stderr (outside the
# JSON log) for every client that hung up.

_READ_TIMEOUT_SECONDS: Final = 5.0
"""Seconds a client has to send its whole request head (and then, again, to take the response).
Probes and Prometheus send the head in one packet; one still unfinished after this is stalled or
hostile and is dropped unanswered, whether it sent nothing or a byte at a time."""

_MAX_CONNECTIONS: Final = 32
"""Connections served at once. Past it a new connection displaces the oldest one still sending
its head, so clients that stall cannot starve the probes; when every connection is past its
head, the new one is closed at once. A displaced connection ends within milliseconds."""

_MAX_WORKERS: Final = 2 * _MAX_CONNECTIONS
"""Threads that serve connections, started as needed and kept: every open connection (live or
displaced, at most twice ``_MAX_CONNECTIONS``) has one. Starting a thread per connection made the
accepting thread wait for each new thread's first turn at the GIL, and probes queued behind."""

_LISTEN_BACKLOG: Final = socket.SOMAXCONN
"""Connections the kernel queues for accept (capped by ``net.core.somaxconn``). The stdlib's 5
let 2 of 61 probes time out behind 200 slow clients: a full queue drops the probe's SYN, and the
retry comes 1 s later. Accepting takes about a millisecond, so a long queue costs a probe less."""


_PROBE_WAIT_SECONDS: Final = 0.05
"""When every connection is taken, how long a newcomer may take to send its head before it is
closed unanswered: a probe sends its head with the connection, so it is answered; a client that
sends nothing costs the accepting thread at most this, and only while the server is full."""

_PROBE_HEAD_BYTES: Final = 4096
"""A probe's whole request head must be in this many bytes to be answered on arrival (the
kubelet's is about 150)."""

Reply = tuple[int, bytes, str]
"""An HTTP status, body and content type."""


def _response(code: int, body: bytes, ctype: str) -> bytes:
    """The whole HTTP/1.0 response, the same on both paths. One request per connection, said
    explicitly: an HTTP/1.1 client (h2load) otherwise sent its next request on the connection
    being closed and counted it as an error."""
    head = (
        f"HTTP/1.0 {code} {HTTPStatus(code).phrase}\r\n"
        f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def _probe_path(head: bytes) -> str | None:
    """The path of a complete ``GET`` request head, else ``None`` (not there yet, or not a
    plain GET: the full handler answers those)."""
    if b"\r\n\r\n" not in head:
        return None
    parts = head.split(b"\r\n", 1)[0].split(b" ")
    if len(parts) != 3 or parts[0] != b"GET" or not parts[2].startswith(b"HTTP/1."):
        return None
    return parts[1].split(b"?", 1)[0].decode("ascii", "replace")


class _DeadlineReader(io.RawIOBase):
    """A connection's bytes until a deadline. Each read waits only for what is left of it: a plain
    socket timeout restarts with every byte, so a client trickling one byte a second would hold
    its thread for ever."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer, /) -> int:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("request head not complete in time")
        self._sock.settimeout(remaining)
        return self._sock.recv_into(buffer)


class _Stage(enum.Enum):
    READING = "reading"  # the request head: may be displaced by a newcomer
    SERVING = "serving"  # the head is in: answered, never displaced
    DISPLACED = "displaced"  # shut down for a newcomer; its thread is ending


class _BoundedHTTPServer(socketserver.TCPServer):
    """A thread per connection, each against a deadline: at most ``_MAX_CONNECTIONS`` served at
    once, and as many again only while displaced ones end."""

    allow_reuse_address = True  # as HTTPServer: a restarted agent rebinds at once
    request_queue_size = _LISTEN_BACKLOG

    def __init__(
        self,
        host: str,
        port: int,
        handler: type[_Handler],
        *,
        probe: Callable[[str], Reply | None] = lambda path: None,
    ) -> None:
        """``probe(path)``: the reply to a probe path (``None``: not a probe), answered on the
        accepting thread; it must not block."""
        # Only an IPv6 address has a colon in it (config.parse_listen_address took the brackets).
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._probe = probe
        self._changed = threading.Condition()
        self._open: dict[socket.socket, _Stage] = {}
        """Every admitted connection, oldest first."""
        self._pending: queue.SimpleQueue[tuple[socket.socket, Any] | None] = queue.SimpleQueue()
        """Admitted connections for the workers; ``None`` tells a worker to end."""
        self._workers: list[threading.Thread] = []
        self._idle = 0
        """Workers waiting for a connection."""
        self._queued = 0
        """Connections put on ``_pending`` and not yet taken."""
        super().__init__((host, port), handler)

    def process_request(
        self, request: socket.socket | tuple[bytes, socket.socket], client_address: Any
    ) -> None:
        assert isinstance(request, socket.socket)  # TCP: always a connected socket
        if self._answer_probe(request):
            return
        if not self._admit(request):
            if not self._answer_probe(request, wait=_PROBE_WAIT_SECONDS):
                log.debug("metrics_connection_refused", open_connections=_MAX_CONNECTIONS)
                self.shutdown_request(request)
            return
        with self._changed:
            self._queued += 1
            grow = self._queued > self._idle and len(self._workers) < _MAX_WORKERS
            if grow:
                thread = threading.Thread(target=self._work, name="metrics-http-conn")
                thread.daemon = True
                self._workers.append(thread)
        self._pending.put((request, client_address))
        if grow:
            try:
                thread.start()
            except RuntimeError:  # no thread to be had (memory, pids limit): handle_error logs it
                with self._changed:
                    self._workers.remove(thread)
                if not self._workers:  # nobody would ever take the connection: drop it
                    self._drop_pending()
                raise

    def _work(self) -> None:
        """A worker: serves queued connections until the server closes."""
        while True:
            with self._changed:
                self._idle += 1
            item = self._pending.get()
            with self._changed:
                self._idle -= 1
                if item is not None:
                    self._queued -= 1
            if item is None:
                return
            self._serve(*item)

    def _drop_pending(self) -> None:
        while True:
            try:
                item = self._pending.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                with self._changed:
                    self._queued -= 1
                self._release(item[0])
                self.shutdown_request(item[0])

    def _answer_probe(self, connection: socket.socket, *, wait: float = 0.0) -> bool:
        """Answers a probe whose whole request head has arrived right here, on the accepting
        thread, ahead of every ``/metrics`` request in flight or queued: under a flood of
        scrapes a probe waited for a connection thread to start and for its turn at the GIL
        (up to 770 ms measured, against the kubelet's 1 s timeout). Anything else, or a head
        still on its way, goes the usual way. ``wait``: seconds to let a head arrive first (only
        for a connection that would otherwise be closed unanswered)."""
        try:
            if wait:
                select.select([connection], [], [], wait)
            head = connection.recv(_PROBE_HEAD_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:  # nothing yet (EAGAIN), or the client already left
            return False
        path = _probe_path(head)
        reply = self._probe(path) if path is not None else None
        if reply is None:
            return False
        try:
            connection.settimeout(_READ_TIMEOUT_SECONDS)
            connection.recv(head.index(b"\r\n\r\n") + 4)  # the head, taken off the socket
            connection.sendall(_response(*reply))  # a few hundred bytes: the socket buffer
        except OSError:
            pass  # the prober hung up: its business
        self.shutdown_request(connection)
        return True

    def head_received(self, connection: socket.socket) -> None:
        """``connection`` sent its whole request head: from now on it is served, not displaced."""
        with self._changed:
            if self._open.get(connection) is _Stage.READING:
                self._open[connection] = _Stage.SERVING

    def handle_error(self, request: Any, client_address: Any) -> None:
        # The stdlib prints a traceback to stderr, outside the JSON log.
        log.exception("metrics_request_failed")

    def server_close(self) -> None:
        super().server_close()
        with self._changed:
            for connection in self._open:
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)
            self._changed.wait_for(lambda: not self._open, timeout=5)
            workers = list(self._workers)
        for _ in workers:
            self._pending.put(None)
        for worker in workers:
            worker.join(timeout=1)

    def _admit(self, connection: socket.socket) -> bool:
        with self._changed:
            live = [c for c, stage in self._open.items() if stage is not _Stage.DISPLACED]
            if len(live) >= _MAX_CONNECTIONS:
                oldest = next((c for c in live if self._open[c] is _Stage.READING), None)
                if oldest is None:
                    return False
                self._open[oldest] = _Stage.DISPLACED
                log.debug("metrics_connection_displaced", open_connections=_MAX_CONNECTIONS)
                with contextlib.suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)  # its blocked read returns at once
            # Waiting for each displaced thread to end made accepting slow under a flood (the
            # backlog fills, probes' SYNs are dropped); wait only when they pile up.
            if not self._changed.wait_for(
                lambda: len(self._open) < 2 * _MAX_CONNECTIONS, timeout=1.0
            ):
                return False
            self._open[connection] = _Stage.READING
            return True

    def _release(self, connection: socket.socket) -> None:
        # Before the socket is closed: _admit and server_close shut down only what is listed,
        # under the lock, so never a closed socket whose descriptor was reused.
        with self._changed:
            del self._open[connection]
            self._changed.notify_all()

    def _serve(self, connection: socket.socket, client_address: Any) -> None:
        try:
            self.finish_request(connection, client_address)
        except (ConnectionError, TimeoutError):
            pass  # the client hung up or stopped reading: its business, not an error of ours
        except Exception:
            log.exception("metrics_request_failed")
        finally:
            self._release(connection)
            self.shutdown_request(connection)


class _Handler(BaseHTTPRequestHandler):
    """One request per connection (HTTP/1.0), its head read against the deadline; the stdlib's
    request-line and header limits (414, 431) hold as before."""

    server: _BoundedHTTPServer
    timeout = _READ_TIMEOUT_SECONDS  # set on the socket: bounds writing the response

    def setup(self) -> None:
        deadline = time.monotonic() + _READ_TIMEOUT_SECONDS
        super().setup()
        self.rfile.close()  # the plain reader, replaced by one that keeps the deadline
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, deadline))

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        self.server.head_received(self.connection)
        self.connection.settimeout(_READ_TIMEOUT_SECONDS)  # the response gets its own seconds
        return parsed

    def log_error(self, format: str, *args: Any) -> None:
        # Timeouts and malformed requests: the client's trouble, worth a line only when debugging.
        log.debug("metrics_request_rejected", detail=format % args)

    def log_message(self, format: str, *args: Any) -> None:
        return  # scrapes are not worth a log line each


def _readiness_of(collector: SnapshotCollector) -> Callable[[], tuple[bool, str]]:
    return lambda: collector.ready


class MetricsServer:
    """``/metrics``, ``/healthz`` (the process answers) and ``/readyz`` (the process can do its
    job: for the enforcer, enforcement can act)."""

    def __init__(
        self,
        *,
        registry: CollectorRegistry,
        collector: SnapshotCollector | None = None,
        ready: Callable[[], tuple[bool, str]] | None = None,
        host: str,
        port: int,
    ) -> None:
        """``host``: an IPv4 address, a host name, or an IPv6 address without brackets (as
        ``config.parse_listen_address`` returns it); "" is every IPv4 interface.

        Readiness comes from exactly one of ``collector`` (the enforcer's last published poll)
        or ``ready``: called for each ``/readyz`` on a server thread, it returns
        ``(ready, reason)`` and must not block or raise."""
        if collector is not None and ready is None:
            ready = _readiness_of(collector)
        elif ready is None or collector is not None:
            raise TypeError("MetricsServer needs exactly one of collector= and ready=")
        exposition = Exposition(registry)
        ready_ = ready

        def probe(path: str) -> Reply | None:
            if path == "/healthz":
                return 200, b"ok\n", "text/plain"
            if path == "/readyz":
                ready, reason = ready_()
                body = b"ok\n" if ready else f"not ready: {reason}\n".encode()
                return 200 if ready else 503, body, "text/plain"
            return None

        class Handler(_Handler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                reply: Reply = (
                    (200, exposition.body(), CONTENT_TYPE_LATEST)
                    if path == "/metrics"
                    else probe(path) or (404, b"not found\n", "text/plain")
                )
                self.log_request(reply[0])
                self.wfile.write(_response(*reply))

        self._server = _BoundedHTTPServer(host, port, Handler, probe=probe)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="metrics-http", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Idempotent; also for a server never started (a failure between bind and start must
        surface as itself, not as this method's error)."""
        started = self._thread.ident is not None
        if self._thread.is_alive():  # shutdown() would wait for ever on a loop never started
            self._server.shutdown()
        self._server.server_close()
        if started:
            self._thread.join(timeout=5)
