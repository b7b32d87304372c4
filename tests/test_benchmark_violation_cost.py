"""``benchmarks/violation_cost.py`` runs one tiny violation end to end (20 GPU processes, grace
and termination timeout 1 s, this checkout only): its JSON comes out complete, the enforcer
stopped the offender with SIGTERM then SIGKILL, signalled nothing else, the run's cgroups
are gone afterwards, and its resolver and sampler were the shipped ones (``gpuguard.app``'s
builders: process pins, the native quiet gate where it is built), as its output says.

No timing or CPU assertions: the figures are the benchmark's output (``docs/performance.md``),
not a test's pass mark.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gpuguard.adapters.nvml.gate import native_gate_built
from tests.helpers.benchmark_run import require_cgroup_v2_and_stub, run_benchmark, run_report

REPO = Path(__file__).resolve().parents[1]
WINDOW_KEYS = (
    "seconds",
    "cpu_s",
    "event_loop_cpu_s",
    "fast_reader_cpu_s",
    "listings",
    "attributions",
    "cycles",
)


@pytest.mark.kernel
@pytest.mark.nvml_stub
def test_a_tiny_violation_is_measured_and_only_the_offender_is_signalled(tmp_path: Path) -> None:
    require_cgroup_v2_and_stub()
    out = tmp_path / "runs.json"
    done = run_benchmark(
        "violation_cost", "--procs", "20", "--pods", "3", "--grace", "1",
        "--termination-timeout", "1", "--warmup-seconds", "2", "--json", out,
        timeout=120,
    )  # fmt: skip
    report = run_report(done)
    assert done.returncode == 0, report
    assert "| 20 | current | 1 |" in done.stdout, report

    summary = json.loads(out.read_text())
    assert summary["problems"] == [], summary["problems"]
    assert summary["variants"] == {"current": str(REPO)}
    (run,) = summary["runs"]
    result = run["result"]
    assert (run["procs"], run["variant"]) == (20, "current")
    assert Path(result["gpuguard"]) == REPO / "gpuguard", "imported from the tree it was given"
    assert result["gpu_processes"] == 20
    assert result["grace_seconds"] == 1.0
    assert result["termination_timeout_seconds"] == 1.0
    for window in ("quiet", "violation"):
        for key in WINDOW_KEYS:
            assert math.isfinite(result[window][key]), (window, key, result[window])
            assert result[window][key] >= 0, (window, key, result[window])
    assert result["violation"]["listings"] >= 1, result["violation"]  # the crossing is listed
    assert result["violation"]["attributions"] >= 20, result["violation"]
    assert math.isfinite(run["extra_cpu_s"]), run
    assert math.isfinite(run["quiet_cpu_s"]), run

    offender = result["offender"]
    assert result["offender_stopped"], offender
    assert offender["returncode"] == -9, offender  # it ignores SIGTERM: the timeout ran out
    assert offender["caught"] == ["SIGTERM"], offender
    assert offender["signals_sent"] == ["SIGTERM", "SIGKILL"], offender
    assert result["wrong_signals"] == [], result["wrong_signals"]
    for sent in result["signals"]:
        assert sent["pod"] == "offender", sent
        assert sent["delivered"] == [offender["pid"]], sent
    assert result["cgroup_root_removed"], result

    # Built as `gpuguard enforce` builds them (gpuguard/app.py): pinned, and the native quiet
    # gate between fast reads where it is built; said in the output.
    fast_reads = "native quiet gate" if native_gate_built() else "python"
    assert result["built"]["pins"] is True, result["built"]
    assert result["built"]["fast_reads"] == fast_reads, result["built"]
    assert result["built"]["pinned_at_end"] >= 19, result["built"]  # the bystanders, alive
    assert f"current: resolver pinned (gpuguard.app.build_resolver), fast reads {fast_reads}" in (
        done.stdout
    ), report
