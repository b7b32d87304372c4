"""``benchmarks/idle_cost.py`` over the NVML stand-in: it prints the per-call lines and, for an
idle enforcer with the quiet gate and without it, each thread and the total, and the enforcer it
started says which fast reads ran, all under the provenance header. No CPU assertions: the
figures are the benchmark's output."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from rigs.nvml_stub import SCENARIO_ENV, Scenario, build_stub
from tests.helpers.benchmark_run import run_benchmark
from tests.nvml_stub.fixtures import gpu


@pytest.mark.nvml_stub
def test_the_idle_cost_of_both_fast_reads_is_printed_per_thread(tmp_path: Path) -> None:
    lib = build_stub()
    scenario = Scenario(tmp_path / "scenario.json")
    scenario.write({"devices": [gpu(0)]})
    done = run_benchmark(
        "idle_cost", "--library-path", lib, "--seconds", "1", "--calls", "5",
        env={**os.environ, SCENARIO_ENV: str(scenario.path)},
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = done.stdout
    header = [line.split(":", 1)[0] for line in out.splitlines()[:6]]
    assert header == ["# commit", "# dirty", "# machine", "# gpu driver", "# command", "# utc"]
    assert re.search(r"^sample \(full listing\): \d+ us CPU", out, re.MULTILINE)
    assert re.search(r"^read_memory: \d+ us CPU", out, re.MULTILINE)
    for gate, reads in (("true", "native"), ("false", "python")):
        block = out.split(f"native_gate={gate}\n", 1)[1]
        assert re.match(r"(  tid \d+ \d+\.\d{3} ms/s  wakeups/s \d+\.\d\n)+  total ", block)
        assert block.split("\n  total ", 1)[1].splitlines()[1] == f'"fast_reads": "{reads}"'
