"""``benchmarks/soak.py`` runs end to end for half a minute: the real enforcer
and agent as subprocesses against the real API server and the NVML stand-in, with every kind of
churn; its CSV and JSON come out complete, the offender is stopped, nobody else is signalled,
and every process and cgroup it started is gone afterwards. Without matplotlib it says how to
get it (``--no-plot`` here: ``make test`` does not install the bench extra).

No timing or slope assertions: the figures are the benchmark's output (``docs/soak.md``), not a
test's pass mark; the last test holds the accelerated run's published figures to its kept raw
output.
"""

from __future__ import annotations

import csv
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rigs.controlplane import find_binaries
from rigs.prereq import require
from tests.helpers.benchmark_run import require_cgroup_v2_and_stub, run_benchmark, run_report

REPO = Path(__file__).resolve().parents[1]
SHORT = [
    "--minutes", "0.5", "--warmup-minutes", "0.1", "--sample-seconds", "3",
    "--resident-pods", "2", "--procs-per-pod", "10", "--starts-per-minute", "60",
    "--pod-churn-seconds", "10", "--churn-pod-seconds", "15", "--churn-procs", "3",
    "--offender-seconds", "20", "--config-seconds", "8",
]  # fmt: skip


@pytest.mark.kernel
@pytest.mark.nvml_stub
@pytest.mark.apiserver
def test_a_short_soak_writes_its_samples_and_summary_and_signals_only_the_offender(
    tmp_path: Path,
) -> None:
    _, why = find_binaries()
    require(why is None, why or "")
    require_cgroup_v2_and_stub()
    out = tmp_path / "out"
    done = run_benchmark("soak", *SHORT, "--no-plot", "--out", out, timeout=240)
    report = run_report(done)
    assert done.returncode == 0, report
    assert not (out / "soak.png").exists(), "--no-plot draws nothing"

    with (out / "samples.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) >= 8, report  # 30 s every 3 s
    for row in rows:
        for who in ("enforcer", "agent"):
            assert float(row[f"{who}_rss_mib"]) > 10, (who, row)
            assert float(row[f"{who}_fds"]) >= 3, (who, row)
            assert float(row[f"{who}_threads"]) >= 1, (who, row)
            assert float(row[f"{who}_asyncio_tasks"]) >= 1, (who, row)  # the gauge is served
    assert max(float(r["listed"]) for r in rows) > 20, "short-lived processes were listed too"
    elapsed = [float(r["elapsed_s"]) for r in rows]
    assert elapsed == sorted(elapsed)

    summary = json.loads((out / "summary.json").read_text())
    for who, quantities in (
        ("enforcer", ("rss_mib", "fds", "threads", "asyncio_tasks", "cpu_percent", "poll_p99_ms")),
        ("agent", ("rss_mib", "fds", "threads", "asyncio_tasks", "cpu_percent")),
    ):
        for q in quantities:
            figure = summary["quantities"][who][q]
            for key in ("slope_per_hour", "fit_start", "fit_end", "first", "last"):
                assert math.isfinite(figure[key]), (who, q, key, figure)
    churn = summary["churn"]
    assert churn["process_starts"] >= 15, churn
    assert churn["pods_created"] >= 5, churn  # 2 resident, churn pods, the offender
    assert churn["pods_deleted"] >= 2, churn  # a churn pod past its life, the offender
    assert churn["config_edits"] >= 2, churn
    assert churn["label_flips_seen"] >= 1, churn
    enforcement = summary["enforcement"]
    assert enforcement["offenders"] >= 1, enforcement
    assert enforcement["offenders_stopped"] == enforcement["offenders"], enforcement
    assert enforcement["wrong_signals_in_log"] == 0, enforcement
    assert enforcement["wrong_signals_caught"] == 0, enforcement
    assert summary["exit_codes"] == {"enforcer": 0, "agent": 0}, summary["exit_codes"]

    root = next(ln for ln in done.stdout.splitlines() if ln.startswith("cgroup root (removed): "))
    assert not Path(root.split(": ", 1)[1]).exists(), report


def test_without_matplotlib_the_soak_names_the_fix_before_starting_anything() -> None:
    hide = (
        "import runpy, sys; sys.modules['matplotlib'] = None; "
        "sys.argv = ['benchmarks/soak.py', '--minutes', '0.1']; "
        "runpy.run_module('benchmarks.soak', run_name='__main__', alter_sys=True)"
    )
    done = subprocess.run(
        [sys.executable, "-c", hide],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done
    assert "pip install -e '.[bench]'" in done.stderr, done.stderr
    assert "--no-plot" in done.stderr, done.stderr


def test_the_published_attribution_cache_plateau_is_the_kept_raw_outputs() -> None:
    """docs/soak.md's accelerated run: each figure of its attribution-cache table is the kept
    summary's, as printed (rounded to the table's decimals), and its RSS table's rows are the
    kept printout's lines."""
    doc = (REPO / "docs/soak.md").read_text(encoding="utf-8")
    found = re.search(
        r"<!-- figures: (docs/results/soak-[\w.-]+-accelerated-summary\.json) -->\n+"
        r"\| attribution cache \| value \|\n\|[-|: ]+\|\n((?:\|.*\|\n)+)",
        doc,
    )
    assert found, "docs/soak.md has no attribution-cache table of an accelerated run"
    summary = json.loads((REPO / found.group(1)).read_text())
    cache = summary["attribution_cache"]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in found.group(2).splitlines()]
    assert {name for name, _ in rows} >= {
        "size", "identities_listed", "full_at_s", "rss_mib_at_full", "rss_mib_last",
        "rss_mib_max", "rss_slope_per_hour_after_full",
    }  # fmt: skip
    for name, cell in rows:
        decimals = len(cell.split(".")[1]) if "." in cell else 0
        assert float(cell) == round(float(cache[name]), decimals), (name, cell, cache[name])
    assert cache["full_at_s"] is not None, "the run filled the cache"
    assert "--accelerated" in summary["command"]
    printout = (REPO / found.group(1).replace("-summary.json", ".txt")).read_text()
    table = re.search(
        r"<!-- figures: (docs/results/soak-[\w.-]+-accelerated\.txt) -->\n+((?:\|.*\|\n)+)", doc
    )
    assert table, "docs/soak.md has no RSS table of the accelerated run"
    assert table.group(1) == found.group(1).replace("-summary.json", ".txt"), "the same run"
    for line in table.group(2).splitlines():
        assert line in printout, line
