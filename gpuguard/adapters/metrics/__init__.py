"""Metrics adapter (docs/design.md, Architecture): prometheus_client and the HTTP endpoint.

- ``collectors``: every metric name, the snapshot collector, the recorders
  (``ports.MetricsRecorder``, ``HealthRecorder``, ``AgentRecorder``), the asyncio task count and
  the ``/metrics`` exposition rendered once per change. No sockets.
- ``server``: ``MetricsServer``, the HTTP server for ``/metrics``, ``/healthz`` and ``/readyz``
  that no client can hold up (head deadline, bounded connections, a kept worker pool, probes
  answered on arrival).
"""

from gpuguard.adapters.metrics.collectors import (
    EVENT_DROP_REASONS,
    EXPOSITION_MAX_AGE_SECONDS,
    KILL_SERIES_SECONDS,
    MAX_KILL_SERIES,
    AsyncioTasksCollector,
    Exposition,
    MetricsRegistry,
    PrometheusAgentRecorder,
    PrometheusGuardRecorder,
    PrometheusHealthRecorder,
    PrometheusRecorder,
    SnapshotCollector,
    change_notifier,
)
from gpuguard.adapters.metrics.server import MetricsServer

__all__ = [
    "EVENT_DROP_REASONS",
    "EXPOSITION_MAX_AGE_SECONDS",
    "KILL_SERIES_SECONDS",
    "MAX_KILL_SERIES",
    "AsyncioTasksCollector",
    "Exposition",
    "MetricsRegistry",
    "MetricsServer",
    "PrometheusAgentRecorder",
    "PrometheusGuardRecorder",
    "PrometheusHealthRecorder",
    "PrometheusRecorder",
    "SnapshotCollector",
    "change_notifier",
]
