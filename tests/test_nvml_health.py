"""``gpuguard_nvml_errors_total{call}`` (docs/design.md, Metrics): which NVML calls
``NvmlGpuSource`` counts.

Over the real nvidia-ml-py and the C stand-in, with ``FakeRecorder`` as the injected
``HealthRecorder``. A failed call whose data is given up and a call that returned past the
deadline count once, under the NVML C function's name (the late call: in
``tests/test_nvml_adapter.py``, with the sample it discards); answers (no MIG, an empty MIG slot,
no ``_v3``, a list that grew once) do not.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpuguard.adapters.nvml import NvmlGpuSource
from gpuguard.errors import GpuSourceError, GpuSourceUnavailable
from rigs.nvml_stub import Scenario
from tests.fakes import FakeRecorder
from tests.nvml_stub.fixtures import (
    GiB,
    StepClock,
    gpu,
    make_source_fixture,  # noqa: F401 (a fixture)
    mig_gpu,
    scenario_fixture,  # noqa: F401 (a fixture)
    stub_lib_fixture,  # noqa: F401 (a fixture)
)

pytestmark = pytest.mark.nvml_stub


def test_a_failed_per_device_call_counts_an_nvml_error_named_after_the_function(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    scenario.write(
        {
            "devices": [gpu(0), gpu(1, procs=[{"pid": 7, "used_bytes": 1}]), gpu(2)],
            "errors": [
                {"call": "nvmlDeviceGetMemoryInfo", "device": 0, "code": "NOT_SUPPORTED"},
                {"call": "nvmlDeviceGetComputeRunningProcesses_v3", "device": 1, "code": "UNKNOWN"},
            ],
        }
    )
    health = FakeRecorder()
    sample = make_source(health=health).sample()
    assert [d.index for d in sample.devices] == [2]
    assert [s.index for s in sample.skipped] == [0, 1]
    assert health.nvml_errors == [
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetComputeRunningProcesses_v3",
    ]


def test_a_failed_device_count_counts_an_nvml_error(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    scenario.write(
        {
            "devices": [gpu(0)],
            "errors": [{"call": "nvmlDeviceGetCount_v2", "code": "UNINITIALIZED", "times": 1}],
        }
    )
    health = FakeRecorder()
    src = make_source(health=health)
    with pytest.raises(GpuSourceError):
        src.sample()
    assert health.nvml_errors == ["nvmlDeviceGetCount_v2"]


def test_a_mig_instance_that_cannot_be_read_counts_an_nvml_error(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    scenario.write(
        {
            "devices": [
                mig_gpu(
                    0,
                    [
                        {"slot": 0, "gi": 1, "total_bytes": 70 * GiB},
                        {"slot": 1, "gi": 2, "total_bytes": 70 * GiB},
                    ],
                )
            ],
            "errors": [
                {
                    "call": "nvmlDeviceGetGpuInstanceId",
                    "device": 0,
                    "mig_slot": 1,
                    "code": "UNKNOWN",
                }
            ],
        }
    )
    health = FakeRecorder()
    sample = make_source(health=health).sample()
    assert [d.gpu_instance_id for d in sample.devices] == [1]
    assert [s.reason.split(":")[0] for s in sample.skipped] == ["unknown"]
    assert health.nvml_errors == ["nvmlDeviceGetGpuInstanceId"]


def test_an_init_failure_counts_once_per_nvml_init_not_per_sample(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    scenario.write({"init_error": "DRIVER_NOT_LOADED", "devices": [gpu(0)]})
    health = FakeRecorder()
    clock = StepClock()
    src = make_source(health=health, clock=clock, init_retry_seconds=5.0)
    for _ in range(3):  # inside the backoff: nvmlInit is not called again
        with pytest.raises(GpuSourceUnavailable):
            src.sample()
    assert health.nvml_errors == ["nvmlInitWithFlags"]
    clock.now += 5.0
    with pytest.raises(GpuSourceUnavailable):
        src.sample()
    assert health.nvml_errors == ["nvmlInitWithFlags", "nvmlInitWithFlags"]


def test_answers_that_are_not_failures_count_nothing(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    scenario.write(
        {
            "devices": [
                gpu(0, procs=[{"pid": 60, "used_bytes": 1}]),  # not MIG-capable: NOT_SUPPORTED
                mig_gpu(1, [{"slot": 3, "gi": 5, "total_bytes": 18 * GiB}]),  # 6 empty slots
            ],
            "errors": [
                {"call": "nvmlDeviceGetGraphicsRunningProcesses_v3", "code": "FUNCTION_NOT_FOUND"},
                {
                    "call": "nvmlDeviceGetComputeRunningProcesses_v3",
                    "device": 0,
                    "code": "INSUFFICIENT_SIZE",
                    "after": 1,
                    "times": 1,
                },
                {"call": "nvmlDeviceGetMPSComputeRunningProcesses_v3", "code": "NOT_SUPPORTED"},
            ],
        }
    )
    health = FakeRecorder()
    src = make_source(health=health)
    for _ in range(2):
        sample = src.sample()
        assert [(d.index, d.gpu_instance_id) for d in sample.devices] == [(0, None), (1, 5)]
        assert sample.skipped == ()
    assert [p.pid for p in sample.processes] == [60]
    assert health.nvml_errors == []


def test_without_a_recorder_nothing_is_counted_and_nothing_breaks(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    scenario.write(
        {
            "devices": [gpu(0), gpu(1)],
            "errors": [{"call": "nvmlDeviceGetMemoryInfo", "device": 0, "code": "UNKNOWN"}],
        }
    )
    sample = make_source().sample()
    assert [d.index for d in sample.devices] == [1]
