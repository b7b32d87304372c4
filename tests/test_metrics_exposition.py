"""The ``/metrics`` exposition (``gpuguard.adapters.metrics.collectors.Exposition``): rendered once
per change, and exact for everything recorded before a scrape began. No sockets: the HTTP server
is tests/test_metrics_server.py's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from gpuguard.adapters.metrics import (
    EXPOSITION_MAX_AGE_SECONDS,
    Exposition,
    MetricsRegistry,
    PrometheusAgentRecorder,
    PrometheusHealthRecorder,
    PrometheusRecorder,
    SnapshotCollector,
)
from gpuguard.core.model import RefusalReason, Trigger
from gpuguard.core.policy import Decision, EnforcerState
from gpuguard.core.reconcile import ReconcileError, WaitReason
from tests import fakes


class _CountingCollector(Collector):
    """Counts how often the registry is rendered (each rendering collects every collector)."""

    def __init__(self) -> None:
        self.renders = 0

    def collect(self) -> Iterable[Metric]:
        self.renders += 1
        yield GaugeMetricFamily("test_renders", "renderings so far", value=float(self.renders))


def _telemetry() -> tuple[MetricsRegistry, SnapshotCollector, PrometheusRecorder]:
    registry = MetricsRegistry()
    collector = SnapshotCollector(hostname="n", changed=registry.changed)
    registry.register(collector)
    return registry, collector, PrometheusRecorder(registry, hostname="n")


def test_scrapes_with_no_change_between_them_share_one_rendering() -> None:
    registry, _, _ = _telemetry()
    counting = _CountingCollector()
    registry.register(counting)
    exposition = Exposition(registry)
    bodies = {exposition.body() for _ in range(200)}
    assert len(bodies) == 1
    assert counting.renders == 1


def test_a_rendering_older_than_the_bound_is_rendered_again_for_values_no_recorder_notes() -> None:
    registry, _, _ = _telemetry()
    counting = _CountingCollector()
    registry.register(counting)
    now = [100.0]
    exposition = Exposition(registry, clock=lambda: now[0])
    exposition.body()
    now[0] += EXPOSITION_MAX_AGE_SECONDS - 0.01
    exposition.body()
    assert counting.renders == 1
    now[0] += 0.02
    assert b"test_renders 2.0" in exposition.body()


def _agent_recorder(registry: MetricsRegistry) -> PrometheusAgentRecorder:
    found = [c for c in registry._collector_to_names if isinstance(c, PrometheusAgentRecorder)]
    return found[0] if found else PrometheusAgentRecorder(registry, node="n")


CHANGES: dict[str, Callable[[MetricsRegistry, SnapshotCollector, PrometheusRecorder], None]] = {
    "observe_poll": lambda r, c, rec: rec.observe_poll(0.003),
    "count_violation": lambda r, c, rec: rec.count_violation(Trigger.GRACE),
    "count_kill": lambda r, c, rec: rec.count_kill(fakes.kill_target(1, fakes.gpu()), wall_time=5),
    "count_refusal": lambda r, c, rec: rec.count_refusal(RefusalReason.EXEMPT),
    "count_event_dropped": lambda r, c, rec: rec.count_event_dropped("rate_limit"),
    "count_watch_restart": lambda r, c, rec: rec.count_watch_restart("pods", "expired"),
    "count_nvml_error": lambda r, c, rec: rec.count_nvml_error("nvmlDeviceGetMemoryInfo"),
    "publish": lambda r, c, rec: c.publish(
        Decision(state=EnforcerState()), wall_time=7.0, ready=True, reason="ok"
    ),
    "show_labels": lambda r, c, rec: _agent_recorder(r).show_labels(
        rule="a", device_plugin_config="b", mig_config=None
    ),
    "count_reconcile_error": lambda r, c, rec: _agent_recorder(r).count_reconcile_error(
        ReconcileError.CONFIG_INVALID
    ),
    "set_waiting": lambda r, c, rec: _agent_recorder(r).set_waiting(WaitReason.GPU_PODS),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_every_recorded_change_is_in_the_very_next_scrape(change: str) -> None:
    """The class of defect: a recorder method that changes a value without noting it would serve
    the rendering from before the change. Every method of every recorder is listed here."""
    registry, collector, recorder = _telemetry()
    _agent_recorder(registry)
    exposition = Exposition(registry)
    before = exposition.body()
    assert exposition.body() == before  # served from the rendering
    CHANGES[change](registry, collector, recorder)
    assert exposition.body() != before


def test_the_changes_table_covers_every_recording_method() -> None:
    recording = {
        name
        for cls in (PrometheusRecorder, PrometheusAgentRecorder, SnapshotCollector)
        for name, value in vars(cls).items()
        if callable(value) and not name.startswith("_") and name not in ("collect", "describe")
    } | {name for name in vars(PrometheusHealthRecorder) if name.startswith("count_")}
    assert recording == set(CHANGES)


def test_concurrent_scrapes_never_see_less_than_was_recorded_before_they_began() -> None:
    registry, _, recorder = _telemetry()
    exposition = Exposition(registry)
    failures: list[str] = []
    done = threading.Event()

    def writer() -> None:
        while not done.is_set():
            recorder.count_refusal(RefusalReason.EXEMPT)

    def reader() -> None:
        for _ in range(300):
            floor = registry.get_sample_value("gpuguard_refusals_total", {"reason": "exempt"})
            seen = next(
                s.value
                for f in text_string_to_metric_families(exposition.body().decode())
                for s in f.samples
                if s.name == "gpuguard_refusals_total" and s.labels == {"reason": "exempt"}
            )
            if floor is None or seen < floor:
                failures.append(f"scrape saw {seen}, {floor} were recorded before it began")

    threads = [threading.Thread(target=writer) for _ in range(2)]
    threads += [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads[2:]:
        t.join()
    done.set()
    for t in threads[:2]:
        t.join()
    assert failures == []


def test_a_plain_registry_is_rendered_at_every_scrape() -> None:
    registry = CollectorRegistry()
    counting = _CountingCollector()
    registry.register(counting)
    exposition = Exposition(registry)
    for _ in range(3):
        exposition.body()
    assert counting.renders == 3
