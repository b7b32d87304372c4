"""Prometheus metrics: a custom collector over the last published decision, counters, and the
HTTP server for ``/metrics``, ``/healthz`` and ``/readyz``.

Owns every metric name (DESIGN §5.4). Scrapes never call NVML: they render the last snapshot, so
series of pods that are gone disappear at the next scrape with no ``remove()`` bookkeeping.
No PID label anywhere (unbounded churn). The registry is injected; only ``app.py`` picks one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from gpuguard.core.model import RefusalReason
from gpuguard.core.policy import Decision

_POD_LABELS = ("namespace", "pod", "container", "gpu", "UUID", "GPU_I_ID", "Hostname")


@dataclass(frozen=True, slots=True, kw_only=True)
class _Published:
    decision: Decision
    wall_time: float
    ready: bool
    reason: str


class SnapshotCollector(Collector):
    """Renders the last published decision as gauges. Thread-safe: publish swaps one reference."""

    def __init__(self, *, hostname: str) -> None:
        self._hostname = hostname
        self._last: _Published | None = None

    def publish(self, decision: Decision, *, wall_time: float, ready: bool, reason: str) -> None:
        self._last = _Published(decision=decision, wall_time=wall_time, ready=ready, reason=reason)

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
            labels=("gpu", "UUID", "GPU_I_ID", "Hostname"),
        )
        last_poll = GaugeMetricFamily(
            "gpuguard_last_poll_timestamp_seconds",
            "Unix time when the last enforcement poll finished.",
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
                device = by_key.get(key)
                unattributed.add_metric(
                    (
                        str(device.index) if device else "",
                        key.uuid,
                        "" if key.gpu_instance_id is None else str(key.gpu_instance_id),
                        self._hostname,
                    ),
                    float(value),
                )
            last_poll.add_metric((), last.wall_time)
            active.add_metric((last.reason,), 1.0 if last.ready else 0.0)
        else:
            active.add_metric(("starting",), 0.0)
        yield from (used, limit, unattributed, last_poll, active)


class PrometheusRecorder:
    """Counters and the poll histogram (``ports.MetricsRecorder``) on an injected registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._violations = Counter(
            "gpuguard_violations", "Confirmed GPU memory limit violations.", registry=registry
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
        # Pre-create every reason so alert rules see 0 instead of an absent series.
        for reason in RefusalReason:
            self._refusals.labels(reason=reason.value)

    def observe_poll(self, seconds: float) -> None:
        self._poll.observe(seconds)

    def count_violation(self) -> None:
        self._violations.inc()

    def count_kill(self) -> None:
        self._kills.inc()

    def count_refusal(self, reason: RefusalReason) -> None:
        self._refusals.labels(reason=reason.value).inc()


class MetricsServer:
    """``/metrics``, ``/healthz`` (the process answers) and ``/readyz`` (enforcement can act)."""

    def __init__(
        self, *, registry: CollectorRegistry, collector: SnapshotCollector, host: str, port: int
    ) -> None:
        registry_ = registry
        collector_ = collector

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, generate_latest(registry_), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    self._send(200, b"ok\n", "text/plain")
                elif path == "/readyz":
                    ready, reason = collector_.ready
                    body = b"ok\n" if ready else f"not ready: {reason}\n".encode()
                    self._send(200 if ready else 503, body, "text/plain")
                else:
                    self._send(404, b"not found\n", "text/plain")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return  # scrapes are not worth a log line each

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="metrics-http", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
