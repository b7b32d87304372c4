"""GPU use without an allocation, end to end: the real ``gpuguard enforce`` over the NVML
stand-in, real processes in real kubepods cgroups, the real kube-apiserver for pods and Events,
and a real gRPC ``PodResourcesLister`` (``rigs/podresources.py``) on
``node.pod_resources_socket`` answering what the kubelet allocated each pod
(docs/design.md, GPU use without an allocation): reported once, stopped only with
``enforcement.unallocated = "stop"``, and never reported or stopped while the kubelet's answer
is unknown (hanging, gone mid-violation); a kubelet restart is read again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuguard.adapters.podresources.v1 import api_pb2
from rigs.controlplane import wait_until
from rigs.node import GIB, GPU_UUID, GPU_UUIDS, PodInfo, Rig
from rigs.podresources import answer, container, kubelet, socket_path
from rigs.podresources import pod as listing

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel, pytest.mark.nvml_stub]

REASON = "GPUUsedWithoutAllocation"
COUNTER = "gpuguard_unallocated_gpu_use_total"


@pytest.fixture
def sock() -> Iterator[Path]:
    with socket_path() as path:
        yield path


def listed(pod: PodInfo, *device_ids: str) -> api_pb2.PodResources:
    """The kubelet's entry for ``pod``: its container ``main`` with these ``nvidia.com/gpu``
    device IDs (none: the pod requested no GPU)."""
    devices = [("nvidia.com/gpu", device_ids)] if device_ids else []
    return listing(pod.namespace, pod.name, [container("main", devices)])


def reports(rig: Rig, pod: PodInfo) -> list[str]:
    """The messages of gpuguard's Warning Events ``GPUUsedWithoutAllocation`` on ``pod``."""
    return [
        str(e.get("message"))
        for e in rig.pod_events(pod)
        if e.get("reason") == REASON and e.get("type") == "Warning"
    ]


def first_report(rig: Rig, pod: PodInfo, timeout: float = 30.0) -> str:
    wait_until(lambda: reports(rig, pod), timeout=timeout, what=f"{REASON} on {pod.name}")
    return reports(rig, pod)[0]


def counted(gpu: int) -> dict[str, str]:
    return {"gpu": str(gpu), "UUID": GPU_UUIDS[gpu], "GPU_I_ID": ""}


def test_a_pod_that_requested_no_gpu_is_reported_once_and_not_signalled(
    rig: Rig, sock: Path
) -> None:
    pod = rig.add_pod("cpu-only")
    worker = rig.spawn(pod, "cpu-only", used_bytes=3 * GIB)
    with kubelet(sock) as server:
        server.answer = answer(listed(pod))
        enforcer = rig.start_enforcer(pod_resources_socket=sock)
        message = first_report(rig, pod)
        assert f"GPU 0 ({GPU_UUID})" in message
        assert "used by container main (3Gi)" in message
        assert "the pod was allocated: no GPU" in message
        wait_until(lambda: enforcer.metric(COUNTER, counted(0)) == 1, what="the counter")
        time.sleep(3.0)  # three grace periods, thirty polls: still once, and no signal
    assert enforcer.metric(COUNTER, counted(0)) == 1
    (line,) = enforcer.events("gpu_used_without_allocation")
    assert (line["pod"], line["containers"], line["used_bytes"]) == ("cpu-only", ["main"], 3 * GIB)
    assert reports(rig, pod) == [message]
    assert worker.received() == []
    assert worker.alive()
    assert enforcer.stop() == 0


def test_with_unallocated_stop_the_pod_is_stopped_and_its_allocated_neighbour_lives(
    rig: Rig, sock: Path
) -> None:
    intruder_pod = rig.add_pod("cpu-only")
    owner_pod = rig.add_pod("allocated")
    intruder = rig.spawn(intruder_pod, "intruder", used_bytes=3 * GIB)
    owner = rig.spawn(owner_pod, "owner", used_bytes=20 * GIB)
    with kubelet(sock) as server:
        server.answer = answer(listed(intruder_pod), listed(owner_pod, f"{GPU_UUID}::0"))
        enforcer = rig.start_enforcer(pod_resources_socket=sock, unallocated="stop")
        wait_until(lambda: not intruder.alive(), timeout=30, what="the intruder to be stopped")
    assert intruder.received() == ["SIGTERM"]
    signalled = enforcer.settled_events("container_signalled", 1)
    assert {e["pod"] for e in signalled} == {"cpu-only"}
    assert any("enforcement.unallocated = stop" in m for m in reports(rig, intruder_pod))
    assert reports(rig, owner_pod) == []
    assert owner.received() == []
    assert owner.alive()
    assert enforcer.stop() == 0


def test_a_pod_allocated_gpu_0_is_reported_on_gpu_1_only(rig: Rig, sock: Path) -> None:
    pod = rig.add_pod("one-gpu")
    on0 = rig.spawn(pod, "on0", used_bytes=2 * GIB)
    on1 = rig.spawn(pod, "on1", used_bytes=1 * GIB, gpu=1)
    with kubelet(sock) as server:
        server.answer = answer(listed(pod, f"{GPU_UUID}::0"))
        enforcer = rig.start_enforcer(pod_resources_socket=sock)
        message = first_report(rig, pod)
        wait_until(lambda: enforcer.metric(COUNTER, counted(1)) == 1, what="the counter")
        time.sleep(2.0)  # GPU 0 had as long to be (wrongly) reported
    assert f"GPU 1 ({GPU_UUIDS[1]})" in message
    assert f"the pod was allocated: nvidia.com/gpu {GPU_UUID}::0 (container main)" in message
    assert reports(rig, pod) == [message]
    assert enforcer.metric(COUNTER, counted(0)) is None
    assert [line["gpu"] for line in enforcer.events("gpu_used_without_allocation")] == [1]
    assert on0.received() == on1.received() == []
    assert enforcer.stop() == 0


def test_a_hanging_kubelet_stops_and_reports_nothing_and_is_logged_once(
    rig: Rig, sock: Path
) -> None:
    """Stop mode, a pod that requested no GPU, and a kubelet that never answers: every read is
    unknown after its 2 s deadline, so nothing is reported or stopped; the warning is logged
    once over two reads, and no poll waits for a read."""
    pod = rig.add_pod("cpu-only")
    worker = rig.spawn(pod, "cpu-only", used_bytes=3 * GIB)
    with kubelet(sock) as server:
        server.answer = answer(listed(pod))
        server.hang = True
        enforcer = rig.start_enforcer(pod_resources_socket=sock, unallocated="stop")
        wait_until(lambda: server.calls >= 2, timeout=30, what="a second read")
        time.sleep(2.5)  # the second read's deadline passed: it is unknown too
        (warning,) = enforcer.events("pod_resources_unknown")
        assert "did not answer" in warning["reason"]
        slow = enforcer.metric("gpuguard_poll_duration_seconds_count") or 0
        fast = enforcer.metric("gpuguard_poll_duration_seconds_bucket", {"le": "1.0"})
        assert slow > 0
        assert fast == slow, "a poll waited for the hanging kubelet"
    assert reports(rig, pod) == []
    assert enforcer.events("gpu_used_without_allocation") == []
    assert worker.received() == []
    assert enforcer.stop() == 0


def test_a_socket_that_vanishes_mid_violation_stops_nothing(rig: Rig, sock: Path) -> None:
    """Stop mode, a 12 s grace period and a staleness bound (15 s) that alone would keep the
    last answer: once the use is reported (the violation runs) and an answer was read since
    (as a stop needs), the socket is removed; the next read, within 5 s (a third of the
    bound), is unknown, which ends the violation before its grace period does."""
    pod = rig.add_pod("cpu-only")
    worker = rig.spawn(pod, "cpu-only", used_bytes=3 * GIB)
    with kubelet(sock) as server:
        server.answer = answer(listed(pod))
        enforcer = rig.start_enforcer(
            pod_resources_socket=sock, unallocated="stop", grace_seconds=12.0,
            staleness_seconds=15.0,
        )  # fmt: skip
        first_report(rig, pod)
        seen, calls = time.monotonic(), server.calls
        wait_until(lambda: server.calls > calls, timeout=10, what="a read since the report")
        sock.unlink()
        warning = enforcer.wait_for("pod_resources_unknown", timeout=10)
        assert "does not exist" in warning["reason"]
        time.sleep(max(0.0, seen + 12.0 + 3.0 - time.monotonic()))
    assert worker.received() == []
    assert worker.alive()
    assert enforcer.events("container_signalled") == []
    assert enforcer.stop() == 0


def test_after_a_kubelet_restart_the_new_kubelets_answer_is_reported(rig: Rig, sock: Path) -> None:
    """The kubelet before the restart does not list the pod yet (unknown: nothing reported);
    it stops, a read fails, and a new kubelet serves a new socket file on the same path."""
    pod = rig.add_pod("cpu-only")
    rig.spawn(pod, "cpu-only", used_bytes=3 * GIB)
    with kubelet(sock) as old:
        old.answer = answer()
        enforcer = rig.start_enforcer(pod_resources_socket=sock)
        wait_until(lambda: old.calls >= 1, timeout=30, what="a read of the first kubelet")
    sock.unlink(missing_ok=True)
    enforcer.wait_for("pod_resources_unknown", timeout=10)
    assert reports(rig, pod) == []
    with kubelet(sock) as new:
        new.answer = answer(listed(pod))
        message = first_report(rig, pod, timeout=10)
        enforcer.wait_for("pod_resources_recovered", timeout=5)
    assert "the pod was allocated: no GPU" in message
    assert enforcer.stop() == 0


def test_a_staleness_bound_below_the_read_interval_still_stops_after_a_long_grace(
    rig: Rig, sock: Path
) -> None:
    """``enforcement.staleness_seconds = 4`` (the rig's) and a 6 s grace period: the answers
    must be read often enough to stay fresh all along. Read every 5 s, an answer aged past 4 s
    was unknown for a second of every five, which ended the violation each time: never
    stopped."""
    pod = rig.add_pod("cpu-only")
    worker = rig.spawn(pod, "cpu-only", used_bytes=3 * GIB)
    with kubelet(sock) as server:
        server.answer = answer(listed(pod))
        enforcer = rig.start_enforcer(
            pod_resources_socket=sock, unallocated="stop", grace_seconds=6.0
        )
        first_report(rig, pod)
        wait_until(lambda: not worker.alive(), timeout=20, what="the pod to be stopped")
    assert worker.received() == ["SIGTERM"]
    assert enforcer.stop() == 0
