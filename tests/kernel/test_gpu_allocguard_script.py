"""``scripts/gpu_allocguard.py``, the allocation guard's run on a real GPU, run here end to end on
the stand-ins: ``pack`` then ``run`` with the libcuda stand-in (tests/cuda_stub) as the driver
and the NVML stand-in as NVML, so what the GPU machine runs is the code tested here.

What it must show: the probe program's comparison of exported and resolved entry points (the
stand-in resolves each base name to its exported function, so every row is the same function);
the guard attached to the file the probe program mapped; a C caller stopped at the call that
would cross its headroom and kept stopped once the script took the stop over (the thawer would
resume it at 200 ms otherwise), its neighbour's allocations done meanwhile; and nothing left:
no cgroup, no process. Needs root (cgroups, BPF); missing tools skip locally and fail in CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rigs.allocguard import build
from rigs.e2e_node import v2_mount
from rigs.nvml_stub import STUB_LIB, build_stub
from rigs.prereq import require

pytestmark = [pytest.mark.kernel]

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30


def test_the_gpu_script_stops_the_crossing_caller_keeps_it_stopped_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    require(os.geteuid() == 0, "BPF and cgroups need root")
    built = build()
    build_stub()
    scenario = tmp_path / "scenario.json"
    scenario.write_text(
        json.dumps(
            {
                "devices": [
                    {
                        "uuid": "GPU-00000000-1111-2222-3333-444444444444",
                        "name": "NVIDIA H100",
                        "total_bytes": 80 * GIB,
                        "processes": [],
                    }
                ]
            }
        )
    )
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{built.stub_library.parent}:{STUB_LIB.parent}"
    env["NVML_STUB_SCENARIO"] = str(scenario)
    packed = tmp_path / "bpfrt"
    out = tmp_path / "out"
    for argv in (
        ["pack", str(packed)],
        ["run", "--bpf", str(packed), "--out", str(out), "--pairs", "300", "--no-torch"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "scripts.gpu_allocguard", *argv],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, f"{argv[0]}: {done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    result = json.loads((out / "result.json").read_text())

    rows = [r for r in result["addrs"] if "symbol" in r]
    assert rows
    assert all(r["same"] for r in rows), rows
    assert all(r["rc"] == 0 for r in rows), rows
    assert result["attach"] == "attached", result["attach"]
    assert Path(result["library"]).resolve() == built.stub_library.resolve()
    assert {"attached_unguarded", "guarded"} <= set(result["overhead"])

    c = result["freeze_c"]
    assert c["stopped"], c
    (event,) = c["events"]
    assert event["size_bytes"] == GIB, event
    assert event["entry"] == "MEM_ALLOC", event
    # 3 GiB counted, the fourth step would cross 3.5 GiB: stopped before it ran.
    assert event["allocated_bytes"] == 3 * GIB
    assert event["headroom_bytes"] == c["headroom_bytes"]
    assert c["state_after_1s"] == "T", "taken over (forget): the thawer must leave it stopped"
    assert c["neighbour_allocated"], c

    assert not any(p.name.startswith("gpuguard-allocguard-") for p in v2_mount().iterdir())
    leftover = subprocess.run(
        ["pgrep", "-f", str(out / "gpu_cuda_probe")], capture_output=True, text=True, check=False
    )
    assert leftover.stdout.strip() == "", leftover.stdout
