"""``scripts/gpu_e2e.py --unallocated-trials`` without a GPU: GPU use by a pod that requested no
GPU, on the script's own pod-resources socket.

What is tested: the kubelet answer the script serves (a real gRPC server on a unix socket, read
by gpuguard's own ``PodResourcesReader``) gives the neighbour and the limited pods a replica of
the GPU and the unallocated pods nothing, so ``allocation_on`` reads ``allocated`` for the first
and ``not_allocated`` (``no GPU``) for the others; the config the enforcer gets reads that socket
with ``enforcement.unallocated = "stop"`` only with unallocated trials (else the socket is off,
as before); the flags' defaults leave existing commands as they were; ``inspect_problems``
refuses an inspect that shows the unallocated pod as limited. Then ``gpu_e2e.main
--unallocated-trials 2`` on the NVML stand-in with CUDA-free workers and the real enforcer: each
unallocated pod is reported (log line, ``pod_event``, counter) and stopped, the neighbour and
the host process untouched, no other pod reported, and inspect's two outputs, taken before the
enforcer starts, show the pod bound by ``none`` and not allocated; and with ``--apiserver`` (the
real kube-apiserver, the enforcer as the chart's ServiceAccount) each pod created mid-run gets
its ``GPUUsedWithoutAllocation`` Event. What PyTorch and the real driver do runs only on a GPU
(docs/gpu-e2e.md).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from gpuguard.adapters.podresources import PodResourcesReader
from gpuguard.config.loader import load_settings
from gpuguard.core.allocation import Allocated, allocation_on
from gpuguard.core.model import LimitPolicy, Unallocated
from rigs.controlplane import find_binaries
from rigs.node import GPU_UUID
from rigs.prereq import require
from tests.fakes import FakeClock, gpu, pod
from tests.integration.e2e_standin import run_on_standin
from tests.scripts_loader import load_script

GIB = 1 << 30


@pytest.fixture
def e2e() -> Iterator[ModuleType]:
    yield load_script("gpu_e2e")
    sys.modules.pop("gpu_e2e", None)


def test_the_served_answer_allocates_the_gpu_to_every_pod_but_the_unallocated_ones(
    e2e: ModuleType,
) -> None:
    device = gpu(0)
    specs = [
        e2e.PodSpec(name="greedy", limit_bytes=4 * GIB),
        e2e.PodSpec(name="neighbour", limit_bytes=8 * GIB),
        e2e.PodSpec(name="unallocated", limit_bytes=None, allocated=False),
        e2e.PodSpec(name="unallocated-0", limit_bytes=None, allocated=False),
    ]
    kubelet = e2e.PodResourcesSocket(device.uuid)
    reader = PodResourcesReader(kubelet.path, clock=FakeClock(now=42.0), timeout=2.0)
    try:
        kubelet.serve(specs)
        allocations = reader.read()
        assert kubelet.calls == 1
    finally:
        reader.close()
        kubelet.close()
    kubelet.close()  # a second close (atexit's) does nothing
    assert not kubelet.root.exists()
    assert allocations.unknown is None
    assert kubelet.answered == {
        "greedy": [f"{device.uuid}::0"],
        "neighbour": [f"{device.uuid}::1"],
        "unallocated": [],
        "unallocated-0": [],
    }
    states = {}
    for spec in specs:
        subject = dataclasses.replace(pod(1, namespace=e2e.NAMESPACE), name=spec.name)
        found = allocation_on(subject, device, allocations, LimitPolicy(), now=42.0, max_age=30)
        states[spec.name] = (found.state, found.allocated)
    assert states["greedy"][0] is Allocated.YES
    assert states["neighbour"][0] is Allocated.YES
    assert states["unallocated"] == (Allocated.NO, "no GPU")
    assert states["unallocated-0"] == (Allocated.NO, "no GPU")


def test_the_config_reads_the_socket_and_stops_unallocated_use_only_with_unallocated_trials(
    e2e: ModuleType, tmp_path: Path
) -> None:
    args = e2e.parse_args(["--unallocated-trials", "5", "--out", str(tmp_path)])
    socket = tmp_path / "podres" / "kubelet.sock"
    with_trials, without = tmp_path / "with.toml", tmp_path / "without.toml"
    e2e.write_config(with_trials, args, socket)
    e2e.write_config(without, e2e.parse_args(["--out", str(tmp_path)]))
    on = load_settings(config_path=with_trials, environ={}, uses_api_server=False)
    assert on.node.pod_resources_socket == socket
    assert on.enforcement.unallocated is Unallocated.STOP
    off = load_settings(config_path=without, environ={}, uses_api_server=False)
    assert off.node.pod_resources_socket is None  # "": no reads, every allocation unknown
    assert off.enforcement.unallocated is Unallocated.REPORT
    assert args.unallocated_trials == 5


def test_unallocated_trials_are_off_unless_asked_for(e2e: ModuleType) -> None:
    args = e2e.parse_args([])
    assert (args.unallocated_trials, args.unallocated_mib) == (0, 1024)
    assert e2e.may_be_signalled("unallocated-3")
    assert not e2e.may_be_signalled("unallocated"), "inspect's pod is never a trial's"


def _inspected(bound_by: str) -> tuple[str, dict[str, object]]:
    """inspect's two outputs while pod ``unallocated`` (PID 7) holds memory beside the
    neighbour (PID 8); the unallocated pod's row bound by ``bound_by``."""
    rows = [
        {"pid": 7, "pod": "unallocated", "gpu": 0, "bound_by": bound_by,
         "allocation": "not_allocated", "allocated": "no GPU"},
        {"pid": 8, "pod": "neighbour", "gpu": 0, "bound_by": "annotation",
         "allocation": "allocated", "allocated": "nvidia.com/gpu GPU-a::1 (container main)"},
    ]  # fmt: skip
    text = (
        f"│ 7 │ python3 │ e2e/unallocated │ main │ 0 │ 1.5 GiB │ 1.5 GiB │ - │ {bound_by} │ ok │\n"
        "e2e/unallocated uses GPU 0 without an allocation (allocated: no GPU)\n"
    )
    return text, {"processes": rows}


def test_inspect_that_shows_the_unallocated_pod_unbound_and_unallocated_passes(
    e2e: ModuleType,
) -> None:
    text, document = _inspected("none")
    found = e2e.inspect_problems(
        text, document, pid=7, pod="unallocated", neighbour_bound="annotation"
    )
    assert found == []


def test_inspect_that_shows_the_unallocated_pod_bound_by_a_limit_fails(e2e: ModuleType) -> None:
    text, document = _inspected("annotation")
    found = e2e.inspect_problems(
        text, document, pid=7, pod="unallocated", neighbour_bound="annotation"
    )
    assert found == [
        "inspect --json: unallocated's bound_by is 'annotation', not 'none'",
        "inspect's table shows no row of e2e/unallocated bound by none",
    ]
    text, document = _inspected("none")
    table_only = text.splitlines()[0]
    found = e2e.inspect_problems(
        table_only, document, pid=7, pod="unallocated", neighbour_bound="annotation"
    )
    assert found == [
        "inspect's table lacks the line 'e2e/unallocated uses GPU 0 without an allocation "
        "(allocated: no GPU)'"
    ]


@pytest.mark.kernel
@pytest.mark.nvml_stub
def test_unallocated_pods_on_the_stand_in_are_reported_and_stopped_and_nobody_else(
    e2e: ModuleType,
    stub_lib: Path,
    device_node: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``gpu_e2e.main --unallocated-trials 2`` beside one greedy trial, judged by the script
    (exit 0: every report, Event and counter step found, inspect as it must be) and read back
    from its results.json and inspect's outputs."""
    out = tmp_path / "out"
    code = run_on_standin(
        e2e,
        ["--trials", "1", "--stubborn-trials", "0", "--forked-trials", "0", "--closer-trials",
         "0", "--no-closer-before-start", "--unallocated-trials", "2", "--out", str(out)],
        stub_lib=stub_lib, device_node=device_node, tmp_path=tmp_path, monkeypatch=monkeypatch,
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads((out / "results.json").read_text())
    assert {k: v["ok"] for k, v in result["summary"].items()} == {"greedy": 1, "unallocated": 2}
    assert result["summary"]["unallocated"]["target_s"] == pytest.approx(0.25 + 1 + 0.05)
    assert result["wrong_kills"] == []
    assert result["wrong_reports"] == []
    facts = result["unallocated"]
    assert facts["inspect"]["problems"] == []
    assert facts["answered"]["greedy"] == [f"{GPU_UUID}::0"]
    assert facts["answered"]["neighbour"] == [f"{GPU_UUID}::8"]  # the ninth allocated pod
    assert facts["answered"]["unallocated"] == facts["answered"]["unallocated-1"] == []
    trials = {t["label"]: t for t in result["trials"] if t["kind"] == "unallocated"}
    assert set(trials) == {"unallocated-0", "unallocated-1"}
    for t in trials.values():
        assert (t["reported_in_log"], t["event_reported"]) == (True, True)
        assert t["reported_allocated"] == "no GPU"
        assert t["unallocated_counter_growth"] == 1
        assert t["cross_to_term_s"] is not None
        assert t["answer_read_after_s"] is not None
    assert {s["pod"] for s in result["enforcer_signals"]} == {"greedy", *trials}
    config = (out / "config.toml").read_text()
    assert f'pod_resources_socket = "{facts["pod_resources_socket"]}"' in config
    assert 'unallocated = "stop"' in config
    inspected = json.loads((out / "inspect.json").read_text())
    (row,) = [p for p in inspected["processes"] if p["pod"] == "unallocated"]
    assert (row["bound_by"], row["allocation"], row["allocated"]) == (
        "none",
        "not_allocated",
        "no GPU",
    )
    assert (
        "e2e/unallocated uses GPU 0 without an allocation (allocated: no GPU)"
        in (out / "inspect.txt").read_text()
    )
    assert [ln.split()[0] for ln in printed.splitlines() if ln.startswith("unallocated ")] == [
        "unallocated",  # the table's row
        "unallocated",  # a line per trial
        "unallocated",
    ]


@pytest.mark.apiserver
@pytest.mark.kernel
@pytest.mark.nvml_stub
def test_with_an_api_server_each_unallocated_pod_gets_its_event(
    e2e: ModuleType,
    stub_lib: Path,
    device_node: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--apiserver --unallocated-trials 1``: the pod is created in the API server mid-run, the
    enforcer sees it through its watch, and the Event read back names it."""
    _, why = find_binaries()
    require(why is None, why or "")
    out = tmp_path / "out"
    code = run_on_standin(
        e2e,
        ["--trials", "0", "--stubborn-trials", "0", "--forked-trials", "0", "--closer-trials",
         "0", "--no-closer-before-start", "--unallocated-trials", "1", "--apiserver",
         str(tmp_path / "kube"), "--out", str(out)],
        stub_lib=stub_lib, device_node=device_node, tmp_path=tmp_path, monkeypatch=monkeypatch,
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads((out / "results.json").read_text())
    assert result["mode"] == "ApiServer"
    assert {k: v["ok"] for k, v in result["summary"].items()} == {"unallocated": 1}
    (trial,) = result["trials"]
    assert (trial["reported_in_log"], trial["event_reported"]) == (True, True)
    reasons = {e["reason"] for e in result["events"] if e["pod"] == "unallocated-0"}
    assert "GPUUsedWithoutAllocation" in reasons
    assert result["unallocated"]["inspect"]["problems"] == []
    assert result["wrong_kills"] == result["wrong_reports"] == []
