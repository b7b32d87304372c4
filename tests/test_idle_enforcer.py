"""An idle ``gpuguard enforce`` (the real process over the NVML stand-in, a pods file, nothing on
the GPU) wakes as rarely as its fast-read cadence allows (each wake-up costs CPU): its
fast-read thread at the cadence (20 times a second, in the native quiet gate), the event loop
for the cycle once a second, and nothing else on a timer: no thread-pool hop per cycle, no poll
of the metrics server, the pods file or the MIG state. Counted from the kernel's scheduling
(``/proc/<pid>/task/<tid>/schedstat``), not timed: CPU figures are benchmarks'
(benchmarks/reaction.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rigs.controlplane import wait_until
from rigs.nvml_stub import SCENARIO_ENV, Scenario, build_stub
from tests.nvml_stub.fixtures import gpu

pytestmark = pytest.mark.nvml_stub

MEASURE_SECONDS = 4.0


def _timeslices(pid: int) -> dict[int, int]:
    got: dict[int, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            got[int(task.name)] = int((task / "schedstat").read_text().split()[2])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return got


@pytest.mark.parametrize("fast_reads", ["native", "python"])
def test_an_idle_enforcer_wakes_only_its_fast_reader_and_its_cycle(
    tmp_path: Path, fast_reads: str
) -> None:
    lib = build_stub()
    scenario = Scenario(tmp_path / "scenario.json")
    scenario.write({"devices": [gpu(0)]})
    pods = tmp_path / "pods.json"
    pods.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": []}))
    config = tmp_path / "gpuguard.toml"
    config.write_text(
        "version = 1\n[enforcement]\n"
        f'lock_file = "{tmp_path / "enforcer.lock"}"\n'
        f'[nvml]\nlibrary_path = "{lib}"\nnative_gate = {str(fast_reads == "native").lower()}\n'
        '[logging]\nformat = "json"\n'
    )
    env = {**os.environ, SCENARIO_ENV: str(scenario.path)}
    log = tmp_path / "enforcer.log"
    argv = [sys.executable, "-m", "gpuguard.cli", "enforce", "--config", str(config)]
    argv += ["--node-name", "n", "--pods-file", str(pods), "--metrics-address", "127.0.0.1:0"]
    with log.open("w") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "enforcer_started" in log.read_text(), timeout=30, what="start")
        started = next(
            json.loads(line) for line in log.read_text().splitlines()
            if '"enforcer_started"' in line
        )  # fmt: skip
        assert started["fast_reads"] == fast_reads
        time.sleep(2.0)  # the first listing, cycle and lock take are behind it
        before = _timeslices(proc.pid)
        time.sleep(MEASURE_SECONDS)
        after = _timeslices(proc.pid)
        assert proc.poll() is None, log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    per_second = {tid: (after[tid] - before.get(tid, 0)) / MEASURE_SECONDS for tid in after}
    main = per_second.pop(proc.pid)
    reader = max(per_second, key=lambda tid: per_second[tid])
    fast = per_second.pop(reader)
    assert 10 <= fast <= 25, f"the fast reader ran {fast}/s (cadence 20/s)"
    assert main <= 2.5, f"the event loop ran {main}/s: more than the cycle once a second"
    busy = {tid: n for tid, n in per_second.items() if n > 0.5}
    assert busy == {}, f"other threads woke on a timer: {busy} per second"
