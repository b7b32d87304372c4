"""``scripts/gpu_e2e.py --guarded-trials`` without a GPU: the greedy trials of a second enforcer
with the eBPF allocation guard on.

What is tested: the crossing of a guarded trial is the worker's record of the call that would
take it over its limit (with what it held before it grew), since NVML never shows that call's
memory when the guard froze it; the guarded config is one gpuguard reads as the guard on, on the
library given; the flags' defaults leave existing commands as they were. Then
``gpu_e2e.main --guarded-trials 2`` on the NVML stand-in with CUDA-free workers that allocate
through the libcuda stand-in (tests/cuda_stub) after making a context, the real probes on it,
and the real enforcer: the guard attaches to the library the script found in a worker's maps,
freezes each trial's crossing call (``allocation_frozen`` for its PID), and the worker gets
SIGTERM well within the grace period (the freeze is confirmed by a listing, not waited out) and
its memory is freed. What PyTorch and the real driver do runs only on a GPU (docs/gpu-e2e.md).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from gpuguard.adapters.allocguard import GUARD_OBJECT
from gpuguard.config.loader import load_settings
from rigs.allocguard import AllocGuardBuild, build
from rigs.prereq import require
from tests.integration.e2e_standin import run_on_standin
from tests.scripts_loader import load_script

MIB = 1 << 20
GIB = 1 << 30
GRACE_SECONDS = 10.0
"""The guarded run's grace period: long, so a SIGTERM that waited it out is told apart."""


@pytest.fixture
def e2e() -> Iterator[ModuleType]:
    yield load_script("gpu_e2e")
    sys.modules.pop("gpu_e2e", None)


def test_the_crossing_is_the_first_call_that_would_take_the_worker_over_its_limit(
    e2e: ModuleType,
) -> None:
    limit, base = 4 * GIB, 512 * MIB
    records = [
        {"label": "guarded-0", "kind": "allocating", "mib": 3584, "t": 1.0},
        {"label": "guarded-0", "kind": "alloc", "mib": 3584, "t": 1.1},
        {"label": "guarded-1", "kind": "allocating", "mib": 4096, "t": 1.5},  # another trial
        {"label": "guarded-0", "kind": "allocating", "mib": 4096, "t": 2.0},  # 4608 MiB: over
        {"label": "guarded-0", "kind": "allocating", "mib": 4608, "t": 3.0},
    ]
    assert e2e.crossing_call(records, "guarded-0", limit, base) == 2.0
    # Without what it held before it grew, only the target counts.
    assert e2e.crossing_call(records, "guarded-0", limit, 0) == 3.0
    assert e2e.crossing_call(records[:2], "guarded-0", limit, base) is None


def test_guarded_trials_are_off_unless_asked_for_and_their_config_turns_the_guard_on(
    e2e: ModuleType, tmp_path: Path
) -> None:
    plain = e2e.parse_args([])
    assert plain.guarded_trials == 0
    assert plain.alloc_guard_library is None
    asked = e2e.parse_args(["--guarded-trials", "3", "--alloc-guard-library", "/lib/libcuda.so.1"])
    assert asked.guarded_trials == 3
    config = tmp_path / "config.toml"
    e2e.write_config(config, asked)
    assert load_settings(config_path=config, environ={}).enforcement.alloc_guard is False
    library = tmp_path / "libcuda.so.1"
    e2e.write_config(config, asked, alloc_guard=True, alloc_guard_library=library)
    guarded = load_settings(config_path=config, environ={}).enforcement
    assert guarded.alloc_guard is True
    assert guarded.alloc_guard_library == library


@pytest.fixture
def guard_object() -> AllocGuardBuild:
    """The guard built here, its object where the enforcer loads it (``GUARD_OBJECT``: the rig
    writes it there; the GPU machine's run copies it there too)."""
    require(os.geteuid() == 0, "needs root (bpf, uprobes)")
    require(Path("/sys/bus/event_source/devices/uprobe").exists(), "no uprobe PMU on this kernel")
    built = build()
    assert built.object_path == GUARD_OBJECT
    return built


@pytest.mark.kernel
@pytest.mark.nvml_stub
def test_guarded_trials_on_the_stand_in_freeze_the_crossing_call_and_stop_within_the_grace(
    e2e: ModuleType,
    guard_object: AllocGuardBuild,
    stub_lib: Path,
    device_node: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("GPU_E2E_STANDIN_CUDA", str(guard_object.stub_library))
    out = tmp_path / "out"
    code = run_on_standin(
        e2e,
        ["--trials", "0", "--stubborn-trials", "0", "--forked-trials", "0", "--closer-trials",
         "0", "--no-closer-before-start", "--guarded-trials", "2", "--grace",
         str(GRACE_SECONDS), "--out", str(out)],
        stub_lib=stub_lib, device_node=device_node, tmp_path=tmp_path, monkeypatch=monkeypatch,
    )  # fmt: skip
    printed = capsys.readouterr().out
    result = json.loads((out / "results.json").read_text())
    guard = result["alloc_guard"]
    assert guard["attached"] is True, printed
    # Found in the first worker's maps, as on a GPU node: the library the workers call.
    assert Path(guard["library"]).resolve() == guard_object.stub_library.resolve()
    assert "alloc_guard = true" in (out / "config-guarded.toml").read_text()
    assert "alloc_guard" not in (out / "config.toml").read_text()
    trials = [t for t in result["trials"] if t["kind"] == "guarded"]
    assert [t["label"] for t in trials] == ["guarded-0", "guarded-1"]
    for t in trials:
        assert t["guard_frozen"] is True, printed
        assert "allocation_frozen" in t["guard_events"]
        assert t["cross_to_term_s"] is not None, printed
        assert t["cross_to_term_s"] < GRACE_SECONDS / 5, printed
        assert t["cross_to_freed_s"] is not None, printed
        assert t["ok"], printed
    assert result["summary"]["guarded"]["ok"] == 2
    assert result["wrong_kills"] == []
    assert code == 0, printed
    assert "alloc guard: attached to" in printed
