"""The NVML stand-in (``tests/nvml_stub``: a C ``libnvidia-ml.so.1`` that reads a JSON
scenario): building it once, the scenario documents of the benchmarks' devices, and writing
scenario files atomically (``Scenario``; ``FaultScenario`` adds injected errors, delays and
processes). Used by the tests, the benchmarks and the demo script.

The C source and its Makefile stay in ``tests/nvml_stub`` (``make nvml-stub`` builds it there);
this module finds them by path. Standard library only at import (``build_stub`` imports pytest
through ``rigs.prereq`` when it skips): ``python -m benchmarks.reaction --mode gpu`` runs on a GPU
node with only its dependencies. Must not load the library itself: callers pass ``STUB_LIB`` to
``NvmlGpuSource(library_path=...)`` or put its directory on ``LD_LIBRARY_PATH`` of a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rigs.prereq import require

STUB_DIR = Path(__file__).resolve().parents[1] / "tests" / "nvml_stub"
STUB_LIB = STUB_DIR / "build" / "libnvidia-ml.so.1"
SCENARIO_ENV = "NVML_STUB_SCENARIO"

_build_lock = threading.Lock()


def build_stub() -> Path:
    """``make -C tests/nvml_stub`` (a no-op when up to date); skips, or fails in CI, without a
    compiler or make."""
    require(shutil.which("make") is not None, "make is not installed")
    require(shutil.which(os.environ.get("CC", "gcc")) is not None, "no C compiler (gcc)")
    with _build_lock:
        done = subprocess.run(
            ["make", "-s", "-C", str(STUB_DIR)], capture_output=True, text=True, check=False
        )
    assert done.returncode == 0, f"building the NVML stand-in failed:\n{done.stdout}{done.stderr}"
    return STUB_LIB


STUB_TOTAL_BYTES = 141 << 30
"""The stand-in device's size in the benchmarks' scenarios: an H200's 141 GiB."""


def stub_uuid(index: int) -> str:
    """The UUID of the stand-in's device ``index`` in the benchmarks' scenarios."""
    return f"GPU-{index:08d}-1111-2222-3333-444444444444"


def stub_device(
    *,
    uuid: str,
    processes: Iterable[tuple[int, int]],
    total_bytes: int = STUB_TOTAL_BYTES,
    mig_mode: str | None = "disabled",
    name: str = "NVIDIA H200",
) -> dict[str, Any]:
    """One device of the scenario listing ``processes`` as ``(pid, used bytes)`` compute
    processes; ``mig_mode=None`` leaves the key out (not MIG-capable)."""
    device: dict[str, Any] = {"uuid": uuid, "name": name, "total_bytes": total_bytes}
    if mig_mode is not None:
        device["mig_mode"] = mig_mode
    device["processes"] = [{"pid": pid, "used_bytes": used} for pid, used in processes]
    device["graphics_processes"] = []
    device["mps_processes"] = []
    return device


def stub_scenario(
    devices: Sequence[Mapping[str, Any]], *, driver_version: str = "580.159.04"
) -> dict[str, Any]:
    """The whole scenario document of the stand-in."""
    return {"driver_version": driver_version, "devices": list(devices)}


class Scenario:
    """The scenario file the stand-in reads; each write replaces it (new inode), so the library
    sees the change on its next call."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, data: dict[str, Any]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data), encoding="utf-8")
        os.replace(tmp, self.path)


class FaultScenario(Scenario):
    """A scenario file whose every write also carries faults and processes the writer does not
    manage: the stand-in's ``errors`` and ``delays`` rules (README: per call, per device, after
    N calls, N times or forever) and extra compute processes per device index.

    It replaces a writer's ``Scenario`` at the same path (e.g. ``rig.scenario``), so the writer
    keeps producing documents from its own state and each one reaches the library with the
    injected parts. ``set_faults`` and ``set_extra_processes`` rewrite the last document at
    once. A rewrite resets the library's rule counters (README): a rule meant to fire once
    uses ``after``/``times`` relative to that write.
    """

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._lock = threading.Lock()
        self._errors: list[dict[str, Any]] = []
        self._delays: list[dict[str, Any]] = []
        self._extra: dict[int, list[dict[str, Any]]] = {}
        self._last: dict[str, Any] | None = None

    def set_faults(
        self,
        *,
        errors: list[dict[str, Any]] | None = None,
        delays: list[dict[str, Any]] | None = None,
    ) -> None:
        """Replace the error and delay rules (``None``: keep that list) and rewrite now."""
        with self._lock:
            if errors is not None:
                self._errors = [dict(r) for r in errors]
            if delays is not None:
                self._delays = [dict(r) for r in delays]
        self._rewrite()

    def set_extra_processes(self, by_device: dict[int, list[dict[str, Any]]]) -> None:
        """Processes (``{"pid": …, "used_bytes": …}``) appended to each device's compute list."""
        with self._lock:
            self._extra = {i: [dict(p) for p in procs] for i, procs in by_device.items()}
        self._rewrite()

    def _rewrite(self) -> None:
        last = self._last
        if last is None and self.path.exists():
            last = json.loads(self.path.read_text(encoding="utf-8"))
        if last is not None:
            self.write(last)

    def write(self, data: dict[str, Any]) -> None:
        with self._lock:
            self._last = json.loads(json.dumps(data))  # the writer's own document, a copy
            doc = json.loads(json.dumps(data))
            if self._errors:
                doc["errors"] = [dict(r) for r in self._errors]
            if self._delays:
                doc["delays"] = [dict(r) for r in self._delays]
            for index, device in enumerate(doc.get("devices") or []):
                extra = self._extra.get(index)
                if extra:
                    device["processes"] = list(device.get("processes") or []) + extra
            super().write(doc)
