"""``benchmarks/reaction.py`` runs end to end on the NVML stand-in: the four
watchers side by side, every trial's greedy pod stopped by each gpuguard mode, nobody else ever
signalled, the wake-up floor rows and the stand-in's own cost measured beside them, and every
process and cgroup it started gone afterwards; a signal to the benchmark's process group (a
``timeout``) reaches none of its workload processes.

No timing assertions: the numbers are the benchmark's output, not a test's pass mark (only
that each reference row measured some CPU).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.benchmark_run import (
    benchmark_argv,
    require_cgroup_v2_and_stub,
    run_benchmark,
    run_report,
)

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
    require_cgroup_v2_and_stub()
    out = tmp_path / "out"
    done = run_benchmark(
        "reaction", "--mode", "stub", "--trials", "2", "--cpu-seconds", "1", "--out", out,
        timeout=240,
    )  # fmt: skip
    report = run_report(done)
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
    lines = done.stdout.splitlines()
    for floor in ("| floor: bare Python loop (time.sleep(0.05)) |", "| floor: bare C loop ("):
        assert sum(ln.startswith(floor) for ln in lines) == 2, (floor, report)  # CPU, steady
    assert any(ln.startswith("| stand-in alone (the NVML calls") for ln in lines), report
    assert any(ln.startswith("| gpuguard change-driven minus the stand-in") for ln in lines)

    # The reference rows measured CPU at every level and in the steady phase.
    refs = json.loads((out / "results.json").read_text())["references"]
    assert sorted(refs) == ["floor-c", "floor-python", "stand-in-alone"], refs
    for key in ("floor-python", "floor-c"):
        assert sorted(refs[key]["cpu_ms_per_s"]) == ["0", "16", "4", "64"], (key, refs)
        assert all(v > 0 for v in refs[key]["cpu_ms_per_s"].values()), (key, refs)
    for key in refs:
        assert refs[key]["steady_ms_per_s"] > 0, (key, refs)

    # Nothing it started outlives it: its cgroup root is gone (members are killed first).
    root = next(ln for ln in done.stdout.splitlines() if ln.startswith("cgroup root (removed): "))
    assert not Path(root.split(": ", 1)[1]).exists(), report


def test_a_signal_to_the_benchmarks_process_group_reaches_no_workload_process(
    tmp_path: Path,
) -> None:
    """``timeout`` SIGTERMs the whole process group it started: the benchmark stops and kills
    its processes itself, and the filler and host process (in sessions of their own) record no
    signal, so no wrong kill is counted (before, both recorded SIGTERM: two wrong kills)."""
    require_cgroup_v2_and_stub()
    out = tmp_path / "out"
    bench = subprocess.Popen(
        benchmark_argv("reaction", "--mode", "stub", "--trials", "30",
                       "--watchers", "gpuguard-fast", "--cpu-levels", "0", "--cpu-seconds", "1",
                       "--stub-procs", "0", "--out", out),
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its own process group, as under `timeout`; not pytest's
    )  # fmt: skip
    seen: list[str] = []
    try:
        assert bench.stdout is not None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = bench.stdout.readline()
            if not line:
                break
            seen.append(line)
            if line.startswith("gpuguard-fast     1 "):  # mid-run: trials under way
                break
        assert seen, "no output"
        assert seen[-1].startswith("gpuguard-fast     1 "), "".join(seen)
        os.killpg(bench.pid, signal.SIGTERM)
        rest, _ = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    report = "".join(seen) + rest
    assert bench.returncode != 0, report  # interrupted, and says so
    hold = [
        r
        for r in map(json.loads, (out / "records.jsonl").read_text().splitlines())
        if r.get("kind") == "signal" and r.get("role") == "hold"
    ]
    assert hold == [], report
    assert "WRONG KILL" not in rest, report
    root = next(ln for ln in rest.splitlines() if ln.startswith("cgroup root (removed): "))
    assert not Path(root.split(": ", 1)[1]).exists(), report
