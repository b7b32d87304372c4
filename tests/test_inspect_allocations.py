"""``gpuguard inspect`` on what the kubelet allocated each pod: the real ``PodResourcesReader``
over a real gRPC server (``rigs/podresources.py``), NVML, ``/proc`` and the pod directory
faked above their ports. Each process shows ``allocation`` and ``allocated``; the table says
under it which pod uses which device without an allocation (docs/design.md, GPU use without an
allocation).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuguard.adapters.podresources import PodResourcesReader
from gpuguard.commands.inspect import render_inspect, run_inspect
from gpuguard.core.model import EnforcementPolicy, Unallocated
from rigs.podresources import KubeletServer, answer, container, kubelet, pod, socket_path
from tests.fakes import (
    FakeClock,
    FakeGpuSource,
    FakePodDirectory,
    FakeResolver,
    GiB,
    attr,
    gpu,
    proc,
)
from tests.fakes import pod as fake_pod

G0, G1 = gpu(0), gpu(1)


@pytest.fixture
def sock() -> Iterator[Path]:
    with socket_path() as path:
        yield path


def inspect(sock: Path, *, as_json: bool, policy: EnforcementPolicy | None = None) -> str:
    """Pod 1 (no GPU) on GPU 0, pod 2 (allocated GPU 0) on GPU 0 and GPU 1, pod 3 (which the
    kubelet does not list) on GPU 1, read through the reader on ``sock``."""
    clock = FakeClock()
    source = FakeGpuSource(
        clock=clock,
        devices=[G0, G1],
        processes=[proc(101, G0, 3 * GiB), proc(201, G0, GiB), proc(202, G1, 2 * GiB),
                   proc(301, G1, GiB)],
    )  # fmt: skip
    resolver = FakeResolver({pid: attr(pid, pod_n=pid // 100) for pid in (101, 201, 202, 301)})
    pods = FakePodDirectory(clock=clock, pods=[fake_pod(1), fake_pod(2), fake_pod(3)])
    reader = PodResourcesReader(sock, clock=clock)
    out, err = io.StringIO(), io.StringIO()
    try:
        code = run_inspect(
            gpu_source=source, resolver=resolver, pod_lookup=pods,
            policy=policy or EnforcementPolicy(), as_json=True, stdout=out, stderr=err,
            allocations=reader,
        )  # fmt: skip
    finally:
        reader.close()
    assert code == 0, err.getvalue()
    if as_json:
        return out.getvalue()
    wide = io.StringIO()  # the JSON again, drawn wide enough that no line wraps
    render_inspect(json.loads(out.getvalue()), wide, width=240)
    return wide.getvalue()


def serve(server: KubeletServer) -> None:
    server.answer = answer(
        pod("team", "pod-1", [container("c0")]),
        pod("team", "pod-2", [container("c0", [("nvidia.com/gpu", [f"{G0.uuid}::0"])])]),
    )


def test_json_shows_each_process_allocation_and_what_its_pod_was_allocated(sock: Path) -> None:
    with kubelet(sock) as server:
        serve(server)
        report = json.loads(inspect(sock, as_json=True))
    rows = {p["pid"]: (p["allocation"], p["allocated"]) for p in report["processes"]}
    assert rows == {
        101: ("not_allocated", "no GPU"),
        201: ("allocated", f"nvidia.com/gpu {G0.uuid}::0 (container c0)"),
        202: ("not_allocated", f"nvidia.com/gpu {G0.uuid}::0 (container c0)"),
        301: ("unknown", "the kubelet does not list the pod"),
    }


def test_the_verdict_says_no_allocation_names_the_gpu_and_whether_it_is_stopped(sock: Path) -> None:
    """Report mode: ok with no limit, and why it is shown; stop mode: over limit, and why."""
    with kubelet(sock) as server:
        serve(server)
        reported = json.loads(inspect(sock, as_json=True))
        stop = EnforcementPolicy(unallocated=Unallocated.STOP)
        stopped = json.loads(inspect(sock, as_json=True, policy=stop))
    mine = {p["pid"]: p for p in reported["processes"]}[101]
    assert (mine["verdict"], mine["reason"]) == ("ok", "no limit; no allocation names this GPU")
    mine = {p["pid"]: p for p in stopped["processes"]}[101]
    assert mine["verdict"] == "over limit"
    assert mine["reason"] == "no allocation names this GPU (enforcement.unallocated = stop)"


def test_the_table_says_which_pod_uses_which_gpu_without_an_allocation(sock: Path) -> None:
    with kubelet(sock) as server:
        serve(server)
        text = inspect(sock, as_json=False)
    lines = [line for line in text.splitlines() if "without an allocation" in line]
    assert lines == [
        "team/pod-1 uses GPU 0 without an allocation (allocated: no GPU)",
        f"team/pod-2 uses GPU 1 without an allocation (allocated: nvidia.com/gpu {G0.uuid}::0 "
        "(container c0))",
    ]


def test_without_an_answer_every_allocation_is_unknown_and_no_line_is_shown(sock: Path) -> None:
    with kubelet(sock) as server:
        serve(server)
        server.hang = True
        report = json.loads(inspect(sock, as_json=True))
        text = inspect(sock, as_json=False)
    assert {p["allocation"] for p in report["processes"]} == {"unknown"}
    assert all("did not answer" in p["allocated"] for p in report["processes"])
    assert "without an allocation" not in text
