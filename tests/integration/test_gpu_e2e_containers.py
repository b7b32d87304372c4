"""``scripts/gpu_e2e.py --container-trials`` without a GPU: a pod of two containers, ``main``
declaring its own limit as KAI-Scheduler declares it per container, ``side`` holding memory
within what the pod's limit leaves it.

What is tested: the pod the script writes (two containers, their IDs in
``status.containerStatuses``, ``nvidia.com/container.main.gpu-memory.limit`` whatever
``--limit-source``), read through gpuguard's own translation, gives ``main`` its own limit; the
config lists ``kai`` only with container trials; the flags' defaults leave existing commands as
they were. Then ``gpu_e2e.main --container-trials 2`` on the NVML stand-in with CUDA-free
workers and the real enforcer: each trial's ``main`` is stopped, ``side`` never signalled and
alive after it, and every ``container_signalled`` line of the pod names ``main`` — the script
judges all three (exit 0, no wrong kill); and with ``--apiserver`` (the real kube-apiserver, the
enforcer as the chart's ServiceAccount) the Events read back name the container, its own limit,
the annotation and the bypassed in-pod cap. What PyTorch and the real driver do runs only on a
GPU (docs/gpu-e2e.md).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from gpuguard.core.limits import resolve_limit
from gpuguard.core.model import LimitPolicy
from gpuguard.kubemodel.translate import pod_from_json
from rigs.controlplane import find_binaries
from rigs.prereq import require
from tests.integration.e2e_standin import run_on_standin
from tests.scripts_loader import load_script

GIB = 1 << 30


@pytest.fixture
def e2e() -> Iterator[ModuleType]:
    yield load_script("gpu_e2e")
    sys.modules.pop("gpu_e2e", None)


@pytest.mark.parametrize("source", ["gpuguard", "kai", "hami"])
def test_the_two_containers_pod_gives_main_its_own_limit_through_gpuguards_translation(
    e2e: ModuleType, source: str
) -> None:
    spec = e2e.PodSpec(
        name=e2e.TWO_CONTAINERS, limit_bytes=None, own_limit_bytes=4 * GIB,
        uid="00000000-0000-4000-8000-000000000001", side_container_id="b" * 64,
    )  # fmt: skip
    manifest = spec.manifest(source)
    pod = pod_from_json(manifest)
    assert pod is not None
    assert dict(pod.containers) == {spec.container_id: "main", "b" * 64: "side"}
    limit = resolve_limit(
        pod=pod, device_total_bytes=80 * GIB, policy=LimitPolicy(sources=("gpuguard", "kai")),
        replicas=None,
    )  # fmt: skip
    assert limit.limit_bytes == 4 * GIB
    assert [(c.container, c.limit_bytes) for c in limit.containers] == [("main", 4 * GIB)]
    # A pod of one container is written as before.
    plain = e2e.PodSpec(name="greedy", limit_bytes=4 * GIB).manifest(source)
    assert [c["name"] for c in plain["spec"]["containers"]] == ["main"]
    assert not any(k.startswith("nvidia.com/container.") for k in plain["metadata"]["annotations"])


def test_container_trials_are_off_unless_asked_for_and_add_kai_to_the_sources(
    e2e: ModuleType,
) -> None:
    plain = e2e.parse_args([])
    assert plain.container_trials == 0
    assert e2e.limit_sources(plain) == ["gpuguard"]
    asked = e2e.parse_args(["--container-trials", "2", "--limit-source", "hami"])
    assert e2e.limit_sources(asked) == ["gpuguard", "hami", "kai"]
    assert e2e.may_be_signalled(e2e.TWO_CONTAINERS)


@pytest.mark.kernel
@pytest.mark.nvml_stub
def test_two_containers_on_the_stand_in_only_main_is_stopped_and_side_survives(
    e2e: ModuleType,
    stub_lib: Path,
    device_node: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "out"
    code = run_on_standin(
        e2e,
        ["--trials", "1", "--stubborn-trials", "0", "--forked-trials", "0", "--closer-trials",
         "0", "--no-closer-before-start", "--container-trials", "2", "--out", str(out)],
        stub_lib=stub_lib, device_node=device_node, tmp_path=tmp_path, monkeypatch=monkeypatch,
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads((out / "results.json").read_text())
    assert {k: v["ok"] for k, v in result["summary"].items()} == {"greedy": 1, "two-containers": 2}
    assert result["wrong_kills"] == []
    trials = {t["label"]: t for t in result["trials"] if t["kind"] == "two-containers"}
    assert set(trials) == {"two-containers-0", "two-containers-1"}
    for t in trials.values():
        assert t["side_alive"] is True
        assert t["cross_to_term_s"] is not None
    mine = [s for s in result["enforcer_signals"] if s["pod"] == "two-containers"]
    assert mine
    assert {s["container"] for s in mine} == {"main"}
    assert 'sources = ["gpuguard", "kai"]' in (out / "config.toml").read_text()
    main_cg, side_cg = result["cgroups"]["two-containers"], result["cgroups"]["two-containers/side"]
    assert main_cg != side_cg
    assert main_cg.rsplit("/", 1)[0] == side_cg.rsplit("/", 1)[0]  # one pod, two containers
    sides = [
        r for r in map(json.loads, (out / "records.jsonl").read_text().splitlines())
        if str(r.get("label", "")).startswith("two-containers-side-")
    ]  # fmt: skip
    assert {r["label"] for r in sides if r["kind"] == "held"} == {
        "two-containers-side-0",
        "two-containers-side-1",
    }
    assert not [r for r in sides if r["kind"] == "signal"]


@pytest.mark.apiserver
@pytest.mark.kernel
@pytest.mark.nvml_stub
def test_with_an_api_server_the_events_name_the_container_its_own_limit_and_the_bypass(
    e2e: ModuleType,
    stub_lib: Path,
    device_node: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--apiserver --container-trials 1``: the pod of two containers and its per-container key
    are stored by the real kube-apiserver (the container statuses through the status
    subresource), the enforcer reads them through its watch as the chart's ServiceAccount, stops
    ``main`` alone, and the Events read back say which container, its own limit, the annotation
    and ``enforcement_bypassed: kai-nvfractions``."""
    _, why = find_binaries()
    require(why is None, why or "")
    out = tmp_path / "out"
    code = run_on_standin(
        e2e,
        ["--trials", "0", "--stubborn-trials", "0", "--forked-trials", "0", "--closer-trials",
         "0", "--no-closer-before-start", "--container-trials", "1", "--apiserver",
         str(tmp_path / "kube"), "--out", str(out)],
        stub_lib=stub_lib, device_node=device_node, tmp_path=tmp_path, monkeypatch=monkeypatch,
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads((out / "results.json").read_text())
    assert result["mode"] == "ApiServer"
    assert result["wrong_kills"] == []
    (trial,) = result["trials"]
    assert trial["side_alive"] is True
    events = [e for e in result["events"] if e["pod"] == "two-containers"]
    (exceeded,) = [e for e in events if e["reason"] == "GPUMemoryLimitExceeded"]
    assert "container main uses" in exceeded["message"]
    assert "nvidia.com/container.main.gpu-memory.limit" in exceeded["message"]
    assert "stopping container main alone" in exceeded["message"]
    assert "enforcement_bypassed: kai-nvfractions" in exceeded["message"]
    killed = [e for e in events if e["reason"] == "GPUProcessKilled"]
    assert killed
    assert all("of container main:" in e["message"] for e in killed)
