"""``benchmarks/reaction_floor.py``: the C wake-up floor row is never skipped silently. Without
gcc the row exists, says why it has no numbers, and starts nothing; with gcc the loop it
builds runs and sleeps (a bare loop at 20 Hz uses a small fraction of a core)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from benchmarks.reaction_floor import c_floor
from rigs.prereq import require
from rigs.processes import gpuguard_env


def test_without_gcc_the_c_floor_row_says_so_and_starts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    ref = c_floor(0.05, dict(os.environ), tmp_path)
    assert ref.process is None
    assert ref.title == "floor: bare C loop (clock_nanosleep) [not measured: no gcc]"
    ref.launch()  # nothing to start, nothing to stop
    assert ref.alive()
    ref.stop()


def test_the_c_floor_loop_builds_and_sleeps(tmp_path: Path) -> None:
    require(shutil.which("gcc") is not None, "gcc is not installed")
    ref = c_floor(0.05, gpuguard_env(), tmp_path)
    assert ref.process is not None, ref.note
    assert (tmp_path / "tmp" / "floor").is_file()
    ref.launch()
    try:
        c0, w0 = ref.cpu_seconds(), time.monotonic()
        time.sleep(1.0)
        used, wall = ref.cpu_seconds() - c0, time.monotonic() - w0
        assert ref.alive(), ref.tail()
    finally:
        ref.stop()
    assert 0 < used < 0.25 * wall, (used, wall)  # it runs, and it sleeps
