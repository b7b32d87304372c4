"""The sharing agent's metrics (docs/design.md, Metrics) as Prometheus scrapes them: the exposition
text of a fresh registry, and a real ``MetricsServer`` on loopback answering ``/readyz`` from the
agent's own readiness."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuguard import ports
from gpuguard.adapters.metrics import MetricsServer, PrometheusAgentRecorder, SnapshotCollector
from gpuguard.core.reconcile import ReconcileError, WaitReason
from tests.helpers.http import http_get

Series = dict[tuple[tuple[str, str], ...], float]


def scrape(registry: CollectorRegistry, name: str) -> Series:
    """The samples called ``name`` in the exposition text, by their sorted labels."""
    text = generate_latest(registry).decode()
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


def by_reason(series: Series) -> dict[str, float]:
    return {dict(labels)["reason"]: value for labels, value in series.items()}


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def recorder(registry: CollectorRegistry) -> PrometheusAgentRecorder:
    return PrometheusAgentRecorder(registry, node="gpu-a100-1")


def test_no_labels_info_series_before_the_agent_shows_labels(
    registry: CollectorRegistry, recorder: PrometheusAgentRecorder
) -> None:
    assert scrape(registry, "gpuguard_sharing_labels_info") == {}
    assert "# TYPE gpuguard_sharing_labels_info gauge" in generate_latest(registry).decode()


def test_labels_info_is_one_series_for_the_current_values_with_none_as_empty(
    registry: CollectorRegistry, recorder: PrometheusAgentRecorder
) -> None:
    recorder.show_labels(rule="a100-mig", device_plugin_config="slice-4", mig_config=None)
    assert scrape(registry, "gpuguard_sharing_labels_info") == {
        (
            ("device_plugin_config", "slice-4"),
            ("mig_config", ""),
            ("node", "gpu-a100-1"),
            ("rule", "a100-mig"),
        ): 1.0
    }


def test_a_change_of_labels_replaces_the_previous_series(
    registry: CollectorRegistry, recorder: PrometheusAgentRecorder
) -> None:
    recorder.show_labels(rule="a100-mig", device_plugin_config="slice-4", mig_config="all-1g.10gb")
    recorder.show_labels(rule=None, device_plugin_config=None, mig_config=None)
    assert scrape(registry, "gpuguard_sharing_labels_info") == {
        (("device_plugin_config", ""), ("mig_config", ""), ("node", "gpu-a100-1"), ("rule", "")): 1
    }
    recorder.show_labels(rule="t4", device_plugin_config="slice-2", mig_config=None)
    (labels,) = scrape(registry, "gpuguard_sharing_labels_info")
    assert dict(labels) == {
        "node": "gpu-a100-1",
        "rule": "t4",
        "device_plugin_config": "slice-2",
        "mig_config": "",
    }


def test_every_reconcile_error_reason_is_pre_created_at_zero(
    registry: CollectorRegistry, recorder: PrometheusAgentRecorder
) -> None:
    errors = by_reason(scrape(registry, "gpuguard_sharing_reconcile_errors_total"))
    assert errors == {reason.value: 0.0 for reason in ReconcileError}
    assert len(errors) == 10


def test_a_reconcile_error_counts_only_under_its_reason(
    registry: CollectorRegistry, recorder: PrometheusAgentRecorder
) -> None:
    recorder.count_reconcile_error(ReconcileError.LABEL_CONFLICT)
    recorder.count_reconcile_error(ReconcileError.LABEL_CONFLICT)
    recorder.count_reconcile_error(ReconcileError.API_ERROR)
    errors = by_reason(scrape(registry, "gpuguard_sharing_reconcile_errors_total"))
    assert errors == {
        "mig_change_failed": 0.0,
        "label_conflict": 2.0,
        "label_flapping": 0.0,
        "eviction_not_allowed": 0.0,
        "eviction_blocked": 0.0,
        "drain_timeout": 0.0,
        "config_invalid": 0.0,
        "config_missing": 0.0,
        "api_error": 1.0,
        "nvidia_config_missing": 0.0,
    }


def test_waiting_is_one_for_the_current_reason_and_zero_for_every_other(
    registry: CollectorRegistry, recorder: PrometheusAgentRecorder
) -> None:
    zeros = {reason.value: 0.0 for reason in WaitReason}
    assert by_reason(scrape(registry, "gpuguard_sharing_waiting")) == zeros
    recorder.set_waiting(WaitReason.GPU_PODS)
    assert by_reason(scrape(registry, "gpuguard_sharing_waiting")) == {**zeros, "gpu_pods": 1.0}
    recorder.set_waiting(WaitReason.MIG_APPLYING)
    assert by_reason(scrape(registry, "gpuguard_sharing_waiting")) == {
        **zeros,
        "mig_applying": 1.0,
    }
    recorder.set_waiting(None)
    assert by_reason(scrape(registry, "gpuguard_sharing_waiting")) == zeros
    assert set(zeros) == {
        "mig_state_busy",
        "cordon",
        "gpu_pods",
        "mig_applying",
        "nvidia_config_missing",
    }


def test_waiting_and_labels_are_independent(
    registry: CollectorRegistry, recorder: PrometheusAgentRecorder
) -> None:
    recorder.set_waiting(WaitReason.CORDON)
    recorder.show_labels(rule="r", device_plugin_config=None, mig_config="m")
    assert by_reason(scrape(registry, "gpuguard_sharing_waiting"))["cordon"] == 1.0
    recorder.set_waiting(None)
    assert len(scrape(registry, "gpuguard_sharing_labels_info")) == 1


def test_a_second_agent_recorder_on_one_registry_is_refused(
    registry: CollectorRegistry, recorder: PrometheusAgentRecorder
) -> None:
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        PrometheusAgentRecorder(registry, node="other")


# -- the server, with the agent's readiness ---------------------------------------------------


class Readiness:
    """What the agent would report; tests flip it."""

    def __init__(self) -> None:
        self.state = (False, "sharing config not read yet")

    def __call__(self) -> tuple[bool, str]:
        return self.state


@pytest.fixture
def readiness() -> Readiness:
    return Readiness()


@pytest.fixture
def agent_server(
    registry: CollectorRegistry, recorder: PrometheusAgentRecorder, readiness: Readiness
) -> Iterator[MetricsServer]:
    server = MetricsServer(registry=registry, ready=readiness, host="127.0.0.1", port=0)
    server.start()
    yield server
    server.stop()


def test_readyz_answers_from_the_agents_readiness(
    agent_server: MetricsServer, readiness: Readiness
) -> None:
    assert http_get(agent_server.port, "/readyz") == (
        503,
        "not ready: sharing config not read yet\n",
    )
    readiness.state = (True, "")
    assert http_get(agent_server.port, "/readyz") == (200, "ok\n")
    assert http_get(agent_server.port, "/healthz") == (200, "ok\n")


def test_the_agent_server_serves_the_agent_metrics(
    agent_server: MetricsServer, recorder: PrometheusAgentRecorder
) -> None:
    recorder.show_labels(rule="r1", device_plugin_config="slice-4", mig_config=None)
    recorder.set_waiting(WaitReason.MIG_STATE_BUSY)
    status, text = http_get(agent_server.port, "/metrics")
    assert status == 200
    assert (
        'gpuguard_sharing_labels_info{device_plugin_config="slice-4",mig_config="",'
        'node="gpu-a100-1",rule="r1"} 1.0'
    ) in text
    assert 'gpuguard_sharing_waiting{reason="mig_state_busy"} 1.0' in text
    assert 'gpuguard_sharing_reconcile_errors_total{reason="api_error"} 0.0' in text


def test_the_enforcers_server_still_answers_readyz_from_its_snapshot(
    registry: CollectorRegistry,
) -> None:
    collector = SnapshotCollector(hostname="n")
    server = MetricsServer(registry=registry, collector=collector, host="127.0.0.1", port=0)
    server.start()
    try:
        assert http_get(server.port, "/readyz") == (503, "not ready: no poll finished yet\n")
    finally:
        server.stop()


@pytest.mark.parametrize("both", [True, False])
def test_a_server_takes_exactly_one_source_of_readiness(
    registry: CollectorRegistry, both: bool
) -> None:
    collector = SnapshotCollector(hostname="n") if both else None
    ready = Readiness() if both else None
    with pytest.raises(TypeError, match="exactly one"):
        MetricsServer(registry=registry, collector=collector, ready=ready, host="127.0.0.1", port=0)


# The recorder is checked against its port by the type checker, as the fakes are (tests/fakes.py).
if TYPE_CHECKING:
    _recorder: ports.AgentRecorder = PrometheusAgentRecorder(CollectorRegistry(), node="n")


# -- the enforcer's per-pod kill series ------------------------------------------------------------


def kills(registry: CollectorRegistry) -> dict[str, tuple[dict[str, str], float]]:
    """``gpuguard_pod_last_kill_timestamp_seconds`` by pod: its labels and value."""
    series = scrape(registry, "gpuguard_pod_last_kill_timestamp_seconds")
    return {dict(labels)["pod"]: (dict(labels), value) for labels, value in series.items()}


def test_a_stop_is_a_per_pod_series_with_its_time_until_the_retention_ends() -> None:
    """``gpuguard_kills_total`` has no pod label (docs/design.md, Metrics): the kill alert names the
    pod from this series, whether or not a scrape ever saw the pod over its limit."""
    from gpuguard.adapters.metrics import PrometheusRecorder
    from tests.fakes import gpu, kill_target, mig_gpu

    t0 = 1_700_000_000.0
    now = [t0]
    registry = CollectorRegistry()
    recorder = PrometheusRecorder(
        registry, hostname="gpu-node-1", kill_series_seconds=900, wall=lambda: now[0]
    )
    assert kills(registry) == {}
    recorder.count_kill(kill_target(1, gpu(0)), wall_time=t0)
    recorder.count_kill(kill_target(2, mig_gpu(1, gi=3)), wall_time=t0 + 5)
    found = kills(registry)
    assert {pod: value for pod, (_, value) in found.items()} == {"pod-1": t0, "pod-2": t0 + 5}
    assert found["pod-1"][0] == {
        "namespace": "team",
        "pod": "pod-1",
        "pod_uid": "00000000-0000-4000-8000-000000000001",
        "container": "c0",
        "gpu": "0",
        "UUID": gpu(0).uuid,
        "GPU_I_ID": "",
        "hostname": "gpu-node-1",
        # No DRA share on the device: dcgm-exporter's DRA labels are empty (absent in PromQL).
        "dra_claim_name": "",
        "dra_claim_namespace": "",
        "dra_driver_name": "",
        "dra_pool_name": "",
        "dra_device_name": "",
    }
    assert found["pod-2"][0]["GPU_I_ID"] == "3"
    assert scrape(registry, "gpuguard_kills_total") == {(): 2.0}
    now[0] = t0 + 901  # pod-1's stop is older than the retention; pod-2's is not
    assert set(kills(registry)) == {"pod-2"}
    recorder.count_kill(kill_target(1, gpu(0)), wall_time=now[0])  # stopped again: back, newer
    assert {pod: value for pod, (_, value) in kills(registry).items()} == {
        "pod-1": t0 + 901,
        "pod-2": t0 + 5,
    }


# -- the event loop's task count (enforcer and agent) -------------------------------------------


async def test_asyncio_tasks_counts_the_loops_unfinished_tasks_from_the_servers_thread() -> None:
    """Scrapes run on the server's threads, never on the loop: the count must be right there."""
    import asyncio
    import threading

    from gpuguard.adapters.metrics import AsyncioTasksCollector

    loop = asyncio.get_running_loop()
    registry = CollectorRegistry()
    registry.register(AsyncioTasksCollector(loop))

    def from_another_thread() -> float:
        result: list[float] = []
        thread = threading.Thread(
            target=lambda: result.append(scrape(registry, "gpuguard_asyncio_tasks")[()])
        )
        thread.start()
        thread.join()
        return result[0]

    before = from_another_thread()  # this test's own task, and any the runner keeps
    release = asyncio.Event()
    waiting = [asyncio.create_task(release.wait()) for _ in range(5)]
    await asyncio.sleep(0)
    assert from_another_thread() == before + 5
    release.set()
    await asyncio.gather(*waiting)
    assert from_another_thread() == before
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        registry.register(AsyncioTasksCollector(loop))
