"""``benchmarks/scale.py`` runs end to end at ten nodes: a real control plane,
kwok nodes, the chart's DaemonSet rolled out onto every node, gpuguard's real watch and agent
code for every node in a simulator process, and a sharing-config change that reaches every
node's label. Its JSON comes out complete and it leaves no process behind. In DRA mode
(``--dra-pods-per-node``) the real scheduler allocates every pod's claim on its node's
ResourceSlice and the simulated enforcers read those claims by name, never by a list or watch;
the simulators' request counting names requests as the API server's counters do.

No timing assertions: the figures are the benchmark's output (``docs/scale.md``), not a test's
pass mark. Missing binaries skip locally and fail in CI (rigs/prereq.py).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from benchmarks.scale import dra_per_node, request_kind
from rigs import controlplane
from rigs.controlplane import ensure_controlplane_binaries, find_binaries
from rigs.prereq import require
from tests.helpers.benchmark_run import run_benchmark

pytestmark = pytest.mark.apiserver

NODES = 10


def run_scale(out: Path, *options: str, timeout: float) -> tuple[str, dict[str, Any]]:
    """``benchmarks/scale.py`` with a short window, one simulator worker and ``options``,
    once its binaries are here: its standard output and the JSON it wrote to ``out``. A
    non-zero exit fails the test with both outputs."""
    _, why = find_binaries()
    require(why is None, why or "")
    _, why = ensure_controlplane_binaries()
    require(why is None, why or "")
    helm = controlplane.testbin_dir() / "helm"
    require(helm.exists(), f"missing {helm}: run scripts/ensure-testbin.sh")
    done = run_benchmark(
        "scale",
        *options,
        "--window=3",
        "--settle=1",
        "--tail=1",
        "--workers=1",
        f"--json={out}",
        timeout=timeout,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-5000:]}"
    results: dict[str, Any] = json.loads(out.read_text())
    return done.stdout, results


def test_the_scale_benchmark_rolls_out_watches_and_relabels_every_node(tmp_path: Path) -> None:
    stdout, results = run_scale(tmp_path / "scale.json", f"--nodes={NODES}", timeout=240)
    assert "config change: p50" in stdout
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


def test_dra_mode_allocates_every_claim_and_the_enforcers_read_them_by_name(
    tmp_path: Path,
) -> None:
    nodes, pods = 4, 3
    stdout, results = run_scale(
        tmp_path / "scale-dra.json",
        f"--nodes={nodes}",
        f"--dra-pods-per-node={pods}",
        timeout=300,
    )
    assert "LIST or WATCH of resourceclaims by gpuguard (whole run): 0" in stdout
    setup = results["dra_setup"]
    assert setup["pods_running"] == setup["claims_allocated"] == nodes * pods
    sent = results["simulator"]["requests_total"]
    # Each enforcer read its node's claims (the watchers count as synced only then) ...
    assert sent["GET resourceclaims"] >= nodes * pods
    # ... and watched its node's ResourceSlices: one watch a node more than without DRA.
    assert sent["WATCH resourceslices"] >= nodes
    assert "LIST resourceclaims" not in sent
    assert "WATCH resourceclaims" not in sent
    more = results["with_gpuguard"]["watches_open_total"]
    assert more - results["without_gpuguard"]["watches_open_total"] >= 8 * nodes
    assert results["dra"]["resourceclaims_list_or_watch_by_gpuguard"] == 0


@pytest.mark.parametrize(
    ("method", "url", "kind"),
    [
        ("GET", "/apis/resource.k8s.io/v1/namespaces/t/resourceclaims/c-1", "GET resourceclaims"),
        ("GET", "/apis/resource.k8s.io/v1/namespaces/t/resourceclaims", "LIST resourceclaims"),
        ("GET", "/apis/resource.k8s.io/v1/resourceclaims?watch=True", "WATCH resourceclaims"),
        (
            "GET",
            "/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName%3Dn&limit=500",
            "LIST resourceslices",
        ),
        (
            "GET",
            "/apis/resource.k8s.io/v1/resourceslices?fieldSelector=x&watch=true&timeoutSeconds=20",
            "WATCH resourceslices",
        ),
        ("GET", "/api/v1/pods?fieldSelector=spec.nodeName%3Dn&watch=1", "WATCH pods"),
        ("PATCH", "/api/v1/nodes/gpu-00001", "PATCH nodes"),
        ("patch", "/api/v1/nodes/gpu-00001/status", "PATCH nodes/status"),
        ("POST", "/api/v1/namespaces/gpuguard/events", "POST events"),
        ("GET", "/api/v1/namespaces/gpu-operator", "GET namespaces"),
        ("GET", "/api/v1/namespaces/gpu-operator/configmaps?fieldSelector=x", "LIST configmaps"),
    ],
)
def test_client_requests_are_named_as_the_api_server_counts_them(
    method: str, url: str, kind: str
) -> None:
    """The kubernetes client sends ``watch=True``: a watch counted as a LIST would hide the
    resourceclaims watch the DRA run must prove absent."""
    assert request_kind(method, "https://127.0.0.1:6443" + url) == kind


def test_dra_figures_are_per_node_per_minute_and_any_claim_list_or_watch_is_counted() -> None:
    window = {"seconds": 120.0}
    results = {
        "without_gpuguard": {**window, "requests_by_verb_resource": {"WATCH resourceclaims": 2}},
        "with_gpuguard": {
            **window,
            "simulator_requests_by_verb_resource": {"GET resourceclaims": 160},
            "requests_by_verb_resource": {"GET resourceclaims": 160, "WATCH resourceclaims": 4},
        },
        "simulator": {"requests_total": {"GET resourceclaims": 500, "LIST resourceclaims": 1}},
    }
    figures = dra_per_node(results, simulated=10)
    assert figures["client_per_node_per_minute"] == {"GET resourceclaims": 8.0}
    assert figures["apiserver_per_node_per_minute"]["GET resourceclaims"] == 8.0
    assert figures["apiserver_per_node_per_minute"]["WATCH resourceclaims"] == 0.1
    assert figures["resourceclaims_list_or_watch_by_gpuguard"] == 1


def test_prebuilt_control_plane_binaries_are_taken_from_controlplane_bin_without_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a machine without Go (the GPU node the 1000-node run was carried to) the benchmark
    takes the binaries from ``CONTROLPLANE_BIN``; a missing or non-executable one is named."""
    for name in controlplane.CONTROLPLANE_NAMES:
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("CONTROLPLANE_BIN", str(tmp_path))
    monkeypatch.setenv("PATH", "/nonexistent")  # the build script, if run, would not find go
    found, why = ensure_controlplane_binaries(timeout=5)
    assert why is None
    assert found == {n: tmp_path / n for n in controlplane.CONTROLPLANE_NAMES}

    (tmp_path / "kwok").chmod(0o644)
    found, why = ensure_controlplane_binaries(timeout=5)
    assert found == {}
    assert why == f"missing {tmp_path / 'kwok'} (CONTROLPLANE_BIN)"
