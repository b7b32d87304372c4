"""``NullGpuSource``: the wrapper that keeps gpuguard running, and saying why, without NVML; and
``app.build_gpu_source`` choosing it from ``nvml.fail_on_init_error``.

Over the real nvidia-ml-py and the C stand-in (``init_error`` in the scenario makes nvmlInit
fail).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from gpuguard.adapters.clock import SystemClock
from gpuguard.adapters.nvml import NullGpuSource, NvmlGpuSource
from gpuguard.adapters.nvml.source import HANDLE_LOST_AFTER
from gpuguard.app import build_gpu_source
from gpuguard.config import load_settings
from gpuguard.errors import GpuSourceError, GpuSourceLost, GpuSourceUnavailable
from rigs.nvml_stub import Scenario
from tests.fakes import FakeRecorder
from tests.nvml_stub.fixtures import (
    StepClock,
    gpu,
    make_source_fixture,  # noqa: F401 (a fixture)
    scenario_fixture,  # noqa: F401 (a fixture)
    stub_lib_fixture,  # noqa: F401 (a fixture)
)

pytestmark = pytest.mark.nvml_stub


def test_init_failure_gives_a_null_source_that_says_why_and_retries_with_backoff(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    scenario.write({"init_error": "NO_PERMISSION", "devices": [gpu(0)]})
    clock = StepClock()
    src = NullGpuSource(make_source(clock=clock, init_retry_seconds=5.0), clock=clock)
    src.acquire()  # does not raise
    first = src.sample()
    assert (first.devices, first.processes) == ((), ())
    (skip,) = first.skipped
    assert skip.reason.startswith("nvml_unavailable: nvmlInit failed: no_permission")
    assert src.reason is not None
    assert "no_permission" in src.reason

    scenario.write({"devices": [gpu(0)]})  # the driver is fixed...
    clock.now += 1.0  # ...but the backoff has not elapsed: no retry yet
    assert src.sample().devices == ()
    clock.now += 5.0
    second = src.sample()
    assert [d.index for d in second.devices] == [0]
    assert second.skipped == ()
    assert second.seq > first.seq
    assert src.reason is None


def test_a_failed_re_init_after_a_driver_reload_is_a_null_sample_not_an_error(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    scenario.write({"devices": [gpu(0)]})
    clock = StepClock()
    src = NullGpuSource(make_source(clock=clock), clock=clock)
    src.acquire()
    seqs = [src.sample().seq]
    scenario.write(
        {
            "init_error": "DRIVER_NOT_LOADED",
            "devices": [gpu(0)],
            "errors": [{"call": "nvmlDeviceGetCount_v2", "code": "DRIVER_NOT_LOADED"}],
        }
    )
    with pytest.raises(GpuSourceError, match="driver_not_loaded"):
        src.sample()  # the count failed: this cycle is lost, NVML is shut down
    lost = src.sample()  # nvmlInit fails now
    assert lost.devices == ()
    assert "driver_not_loaded" in lost.skipped[0].reason
    seqs.append(lost.seq)
    scenario.write({"devices": [gpu(0)]})
    clock.now += 5.0
    back = src.sample()
    assert [d.index for d in back.devices] == [0]
    seqs.append(back.seq)
    assert seqs == sorted(set(seqs))


def test_a_lost_handle_stays_lost_through_the_null_source_even_while_its_re_init_fails(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    """A null sample reads as "no GPU here, nothing to enforce" (ready). A lost NVML handle
    (reliability N13) pauses enforcement instead, also once re-initialising it fails the way an
    init does (a container that lost its device access: nvmlInit answers UNKNOWN)."""
    scenario.write({"devices": [gpu(0)]})
    clock = StepClock()
    src = NullGpuSource(make_source(clock=clock, init_retry_seconds=5.0), clock=clock)
    src.acquire()
    assert [d.index for d in src.sample().devices] == [0]
    scenario.write({"devices": [gpu(0)], "handle_lost": {"after": 0, "reinit_failures": -1}})
    for _ in range(HANDLE_LOST_AFTER - 1):
        with pytest.raises(GpuSourceError):
            src.sample()
    for _ in range(3):  # lost; then nvmlInit fails; then inside its backoff
        with pytest.raises(GpuSourceLost, match="NVML handle lost"):
            src.sample()
        clock.now += 1.0
    with pytest.raises(GpuSourceLost):
        src.read_memory()
    clock.now += 600.0
    with pytest.raises(GpuSourceLost):
        src.acquire()  # the MIG resume's forced nvmlInit fails the same way
    assert src.reason is None


def test_the_null_source_passes_every_other_error_through(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    scenario.write({"devices": [gpu(0)]})
    clock = StepClock()
    src = NullGpuSource(make_source(clock=clock), clock=clock)
    src.release()
    assert _released(src)
    with pytest.raises(GpuSourceError, match="released"):
        src.sample()
    src.acquire()
    assert not _released(src)
    assert [d.index for d in src.sample().devices] == [0]
    assert src.reason is None


def test_the_app_uses_the_null_source_when_nvml_cannot_start_and_fail_on_init_error_is_false(
    scenario: Scenario, stub_lib: Path
) -> None:
    scenario.write({"init_error": "NO_PERMISSION", "devices": [gpu(0)]})
    settings = load_settings(
        environ={},
        overrides={"nvml.library_path": str(stub_lib), "nvml.fail_on_init_error": False},
        uses_api_server=False,
    )
    health = FakeRecorder()
    gpu_source = build_gpu_source(settings, SystemClock(), health=health)
    try:
        assert isinstance(gpu_source, NullGpuSource)
        assert gpu_source.reason is not None
        assert "no_permission" in gpu_source.reason
        (skip,) = gpu_source.sample().skipped
        assert skip.reason.startswith("nvml_unavailable")
        assert health.nvml_errors == ["nvmlInitWithFlags"]
    finally:
        gpu_source.close()


def test_the_app_stops_with_unavailable_when_nvml_cannot_start_and_fail_on_init_error_is_true(
    scenario: Scenario, stub_lib: Path
) -> None:
    scenario.write({"init_error": "NO_PERMISSION", "devices": [gpu(0)]})
    settings = load_settings(
        environ={},
        overrides={"nvml.library_path": str(stub_lib), "nvml.fail_on_init_error": True},
        uses_api_server=False,
    )
    with pytest.raises(GpuSourceUnavailable, match="no_permission"):
        build_gpu_source(settings, SystemClock())


def test_the_app_samples_nvml_through_the_null_source_when_nvml_starts(
    scenario: Scenario, stub_lib: Path
) -> None:
    scenario.write({"devices": [gpu(0)]})
    settings = load_settings(
        environ={},
        overrides={"nvml.library_path": str(stub_lib), "nvml.fail_on_init_error": False},
        uses_api_server=False,
    )
    gpu_source = build_gpu_source(settings, SystemClock())
    try:
        assert isinstance(gpu_source, NullGpuSource)
        assert gpu_source.reason is None
        assert [d.index for d in gpu_source.sample().devices] == [0]
    finally:
        gpu_source.close()


def _released(src: NullGpuSource) -> bool:
    """Read through a call: mypy keeps a property narrowed across ``acquire()``."""
    return src.released
