"""The GPU end-to-end script (``scripts/gpu_e2e.py``) on the NVML stand-in, without a GPU: a
stand-in "driver" that lists CUDA-free workers (``e2e_standin_worker.py``) with the usage each
wrote, and ``run_on_standin``, which runs the script's ``main`` over it. Shared by the DRA and
MPS tests of the script."""

from __future__ import annotations

import contextlib
import ctypes
import threading
from pathlib import Path
from types import ModuleType

import pytest

from rigs.cgroups import kernel_problem
from rigs.node import GPU_TOTAL_BYTES, GPU_UUID
from rigs.nvml_stub import SCENARIO_ENV, Scenario
from rigs.prereq import require

REPO = Path(__file__).resolve().parents[2]


class StandinDriver:
    """The GPU driver for the stand-in: every 10 ms, NVML lists each live process that wrote a
    usage file (tests/integration/e2e_standin_worker.py) with what it wrote; a dead one (a
    SIGKILLed stubborn worker keeps its file) is dropped, as the driver frees its memory."""

    def __init__(self, scenario: Scenario, usage_dir: Path) -> None:
        self.scenario, self.usage_dir = scenario, usage_dir
        self._stop = threading.Event()
        self.write()
        self._thread = threading.Thread(target=self._run, name="standin-driver", daemon=True)
        self._thread.start()

    @staticmethod
    def _alive(pid: int) -> bool:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] != "Z"

    def write(self) -> None:
        processes = []
        for f in self.usage_dir.iterdir():
            if not f.name.isdigit() or not self._alive(int(f.name)):
                continue
            with contextlib.suppress(OSError, ValueError):
                processes.append({"pid": int(f.name), "used_bytes": int(f.read_text())})
        device = {
            "uuid": GPU_UUID, "name": "NVIDIA H200", "total_bytes": GPU_TOTAL_BYTES,
            "processes": processes, "graphics_processes": [], "mps_processes": [],
        }  # fmt: skip
        self.scenario.write({"driver_version": "580.95.05", "devices": [device]})

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.write()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def run_on_standin(
    e2e: ModuleType,
    argv: list[str],
    *,
    stub_lib: Path,
    device_node: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    driver_class: type[StandinDriver] = StandinDriver,
) -> int:
    """``gpu_e2e.main(argv)`` on the NVML stand-in with CUDA-free workers; its exit status.
    ``driver_class``: what lists the workers to NVML (a subclass lists MPS clients apart)."""
    problem = kernel_problem(((2, ""),))
    require(problem is None, problem or "")
    usage_dir = tmp_path / "usage"
    usage_dir.mkdir()
    scenario = Scenario(tmp_path / "scenario.json")
    for name, value in {
        SCENARIO_ENV: scenario.path,
        "LD_LIBRARY_PATH": stub_lib.parent,  # the enforcer's pynvml loads the stand-in
        "GPU_E2E_STANDIN_DIR": usage_dir,
        "GPU_E2E_STANDIN_DEVICE": device_node,
    }.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(e2e, "WORKER", REPO / "tests" / "integration" / "e2e_standin_worker.py")
    ctypes.CDLL(str(stub_lib), mode=ctypes.RTLD_GLOBAL)  # the script's own pynvml
    driver = driver_class(scenario, usage_dir)
    try:
        code: int = e2e.main(argv)
    finally:
        driver.close()
    return code
