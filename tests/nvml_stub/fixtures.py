"""Fixtures and scenario builders shared by the NVML adapter tests (``tests/test_nvml_*.py``).

Owns building and pointing at the stand-in, making sources that are closed after the test, and
the small builders of scenario devices. A test module imports the fixtures it uses
(``from tests.nvml_stub.fixtures import make_source_fixture  # noqa: F401``); each is
registered under its short name (``make_source``).
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuguard.adapters.nvml import NvmlGpuSource
from gpuguard.core.model import DeviceKey, GpuSample, GpuUuid
from rigs.nvml_stub import SCENARIO_ENV, Scenario, build_stub

GiB = 1024**3
H200 = 141 * GiB


@pytest.fixture(name="stub_lib", scope="session")
def stub_lib_fixture() -> Path:
    return build_stub()


@pytest.fixture(name="scenario")
def scenario_fixture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stub_lib: Path) -> Scenario:
    sc = Scenario(tmp_path / "scenario.json")
    sc.write({"devices": []})
    monkeypatch.setenv(SCENARIO_ENV, str(sc.path))
    return sc


@pytest.fixture(name="make_source")
def make_source_fixture(stub_lib: Path) -> Iterator[Callable[..., NvmlGpuSource]]:
    """``NvmlGpuSource(**kwargs)`` over the stand-in, closed after the test."""
    with nvml_sources(stub_lib) as make:
        yield make


@contextlib.contextmanager
def nvml_sources(stub_lib: Path) -> Iterator[Callable[..., NvmlGpuSource]]:
    """``NvmlGpuSource(**kwargs)`` over the stand-in, each closed on leaving (for a fixture
    that makes its sources its own way, e.g. parametrized)."""
    made: list[NvmlGpuSource] = []

    def make(**kwargs: Any) -> NvmlGpuSource:
        kwargs.setdefault("library_path", stub_lib)
        src = NvmlGpuSource(**kwargs)
        made.append(src)
        return src

    yield make
    for src in made:
        # Wait out a call a test left hanging in the stand-in, then balance nvmlInit.
        deadline = time.monotonic() + 10
        while src.in_flight_seconds is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        src.close()


class StepClock:
    """Monotonic seconds that move only when the test moves them."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stub_init_count(lib: Path) -> int:
    """Live nvmlInit calls minus nvmlShutdown calls in the stand-in."""
    fn = ctypes.CDLL(str(lib)).gpuguardStubInitCount
    fn.restype = ctypes.c_int
    return int(fn())


def stub_handle_lost(lib: Path) -> bool:
    """The stand-in's handle is broken now (its scenario's ``handle_lost``, README)."""
    return bool(ctypes.CDLL(str(lib)).gpuguardStubHandleLost())


def gpu(
    n: int, *, procs: list[dict[str, Any]] | None = None, total: int = H200, **extra: Any
) -> dict[str, Any]:
    return {
        "uuid": f"GPU-{n:08d}-0000-0000-0000-000000000000",
        "name": "NVIDIA H200",
        "total_bytes": total,
        "processes": procs or [],
        **extra,
    }


def mig_gpu(n: int, instances: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return gpu(n, mig_mode="enabled", mig_instances=instances, **extra)


def uuid(n: int) -> GpuUuid:
    return GpuUuid(f"GPU-{n:08d}-0000-0000-0000-000000000000")


def by_device(sample: GpuSample) -> dict[DeviceKey, dict[int, int | None]]:
    out: dict[DeviceKey, dict[int, int | None]] = {}
    for p in sample.processes:
        out.setdefault(p.device, {})[p.pid] = p.used_bytes
    return out
