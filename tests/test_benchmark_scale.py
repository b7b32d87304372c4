"""``benchmarks/scale.py`` runs end to end at ten nodes: a real control plane,
kwok nodes, the chart's DaemonSet rolled out onto every node, gpuguard's real watch and agent
code for every node in a simulator process, and a sharing-config change that reaches every
node's label. Its JSON comes out complete and it leaves no process behind.

No timing assertions: the figures are the benchmark's output (``docs/scale.md``), not a test's
pass mark. Missing binaries skip locally and fail in CI (tests/prereq.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import apiserver
from tests.apiserver import ensure_controlplane_binaries, find_binaries
from tests.prereq import require

pytestmark = pytest.mark.apiserver

REPO = Path(__file__).resolve().parents[1]
NODES = 10


def test_the_scale_benchmark_rolls_out_watches_and_relabels_every_node(tmp_path: Path) -> None:
    _, why = find_binaries()
    require(why is None, why or "")
    _, why = ensure_controlplane_binaries()
    require(why is None, why or "")
    helm = apiserver.testbin_dir() / "helm"
    require(helm.exists(), f"missing {helm}: run scripts/ensure-testbin.sh")
    out = tmp_path / "scale.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "scale.py"),
            f"--nodes={NODES}",
            "--window=3",
            "--settle=1",
            "--tail=1",
            "--workers=1",
            f"--json={out}",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=REPO,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-5000:]}"
    assert "config change: p50" in done.stdout
    results = json.loads(out.read_text())
    assert results["rollout"]["ready_seconds"] >= 0
    assert results["watchers_start"]["all_synced_seconds"] > 0
    change = results["config_change"]
    assert change["nodes_changed"] == NODES
    assert change["writes"].get("PATCH nodes", 0) >= NODES
    # Per node: the enforcer's pods and Node, the agent's Node, pods and three ConfigMaps.
    more = results["with_gpuguard"]["watches_open_total"]
    assert more - results["without_gpuguard"]["watches_open_total"] >= 7 * NODES
    assert results["simulator"]["processes"] == 1
    workdir = results["workdir"]
    assert not Path(workdir).exists()
    leftovers = subprocess.run(
        ["pgrep", "-f", workdir], capture_output=True, text=True, check=False
    )
    assert not leftovers.stdout.strip(), f"processes left behind: {leftovers.stdout}"


def test_prebuilt_control_plane_binaries_are_taken_from_controlplane_bin_without_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a machine without Go (the GPU node the 1000-node run was carried to) the benchmark
    takes the binaries from ``CONTROLPLANE_BIN``; a missing or non-executable one is named."""
    for name in apiserver.CONTROLPLANE_NAMES:
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("CONTROLPLANE_BIN", str(tmp_path))
    monkeypatch.setenv("PATH", "/nonexistent")  # the build script, if run, would not find go
    found, why = ensure_controlplane_binaries(timeout=5)
    assert why is None
    assert found == {n: tmp_path / n for n in apiserver.CONTROLPLANE_NAMES}

    (tmp_path / "kwok").chmod(0o644)
    found, why = ensure_controlplane_binaries(timeout=5)
    assert found == {}
    assert why == f"missing {tmp_path / 'kwok'} (CONTROLPLANE_BIN)"
