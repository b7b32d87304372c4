"""``benchmarks/reaction.py`` runs end to end on the NVML stand-in: the four
watchers side by side, every trial's greedy pod stopped by each gpuguard mode, nobody else ever
signalled, and every process and cgroup it started gone afterwards.

No timing assertions: the numbers are the benchmark's output, not a test's pass mark.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernel.cgroups import kernel_problem
from tests.nvml_stub.harness import build_stub
from tests.prereq import require

pytestmark = [pytest.mark.kernel, pytest.mark.nvml_stub]

REPO = Path(__file__).resolve().parents[1]
ROWS = {
    "gpuguard-fast": "| gpuguard change-driven + pressure",
    "gpuguard-today": "| gpuguard today",
    "smi-loop": "| nvidia-smi loop (1 s) (stand-in nvidia-smi)",
    "nvml-poll": "| NVML 5 s poll",
}


def _table(stdout: str) -> tuple[list[str], dict[str, list[str]]]:
    """The main table's column names and its watcher rows as cells, keyed like ``ROWS``."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| watcher | trials |"))
    columns = [c.strip() for c in lines[start].strip().strip("|").split("|")]
    found: dict[str, list[str]] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        for key, prefix in ROWS.items():
            if line.startswith(prefix):
                found[key] = [c.strip() for c in line.strip().strip("|").split("|")]
    return columns, found


def test_the_reaction_benchmark_compares_four_watchers_without_a_wrong_kill(
    tmp_path: Path,
) -> None:
    problem = kernel_problem(((2, ""),))
    require(problem is None, problem or "")
    build_stub()
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "benchmarks/reaction.py", "--mode", "stub", "--trials", "2",
         "--cpu-seconds", "1", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    report = f"exit {done.returncode}\n{done.stdout[-6000:]}\n{done.stderr[-4000:]}"
    assert done.returncode == 0, report

    columns, rows = _table(done.stdout)
    assert sorted(rows) == sorted(ROWS), report
    trials, signalled, wrong = (
        columns.index("trials"),
        columns.index("SIGTERM'd"),
        columns.index("wrong kills"),
    )
    for key, cells in rows.items():
        assert cells[trials] == "2", (key, report)
        assert cells[wrong] == "0", (key, report)
    for key in ("gpuguard-fast", "gpuguard-today"):
        assert rows[key][signalled] == "2", (key, report)
    assert "WRONG KILL" not in done.stdout, report
    assert "CLEANUP" not in done.stdout, report
    assert "Steady CPU, stand-in, 8 GPUs × 100 processes" in done.stdout, report
    assert "CPU per look" in done.stdout, report

    # Nothing it started outlives it: its cgroup root is gone (members are killed first).
    root = next(ln for ln in done.stdout.splitlines() if ln.startswith("cgroup root (removed): "))
    assert not Path(root.split(": ", 1)[1]).exists(), report
