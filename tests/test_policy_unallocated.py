"""decide() on GPU use that none of a pod's allocations names (docs/design.md, GPU use without an
allocation): reported once per pod and device in every mode, stopped through the graduated stop
only where ``enforcement.unallocated = "stop"``, never on an unknown allocation, never for an
exempt pod, and only on a kubelet answer read since the use was first seen.
"""

from __future__ import annotations

from dataclasses import replace

from gpuguard.core.allocation import ContainerDevices, NodeAllocations, PodAllocation
from gpuguard.core.model import EventReason, Mode, Pod, RefusalReason, StopSignal, Unallocated
from gpuguard.core.policy import Decision
from tests.fakes import GiB, attr, mig_gpu, pod, proc
from tests.policy_timeline import G0, G1, POLICY, Timeline

STOP = replace(POLICY, unallocated=Unallocated.STOP)


def answer(t: Timeline, *pods: tuple[Pod, tuple[str, ...]], read_at: float | None = None) -> None:
    """The kubelet lists each pod with its nvidia.com/gpu device IDs (none: no GPU)."""
    t.allocations = NodeAllocations(
        pods={
            (p.namespace, p.name): PodAllocation(
                namespace=p.namespace,
                name=p.name,
                containers=("c0",),
                devices=(
                    ContainerDevices(container="c0", resource="nvidia.com/gpu", device_ids=ids),
                )
                if ids
                else (),
            )
            for p, ids in pods
        },
        read_at=t.now if read_at is None else read_at,
        unknown=None,
    )


def unallocated_events(d: Decision) -> list[str]:
    return [e.message for e in d.events if e.reason is EventReason.UNALLOCATED]


def test_a_pod_that_requested_no_gpu_is_reported_once() -> None:
    p = pod(1)
    t = Timeline(devices=[G0], pods=[p], attributions={101: attr(101, pod_n=1)})
    answer(t, (p, ()))
    d = t.step([proc(101, G0, 3 * GiB)])
    (message,) = unallocated_events(d)
    assert "GPU 0" in message
    assert "used by container c0 (3Gi)" in message
    assert "no GPU" in message
    assert [u.pod.name for u in d.unallocated] == ["pod-1"]
    answer(t, (p, ()))
    d = t.step([proc(101, G0, 3 * GiB)])
    assert unallocated_events(d) == []
    assert d.unallocated == ()
    assert t.signals() == []  # report is the default: nothing is stopped


def test_a_pod_allocated_gpu_0_is_reported_on_gpu_1_only() -> None:
    p = pod(1)
    t = Timeline(devices=[G0, G1], pods=[p], attributions={101: attr(101, pod_n=1)})
    answer(t, (p, (f"{G0.uuid}::3",)))
    d = t.step([proc(101, G0, 1 * GiB), proc(101, G1, 2 * GiB)])
    assert [u.device.index for u in d.unallocated] == [1]
    (message,) = unallocated_events(d)
    assert f"nvidia.com/gpu {G0.uuid}::3 (container c0)" in message


def test_a_mig_pod_on_the_wrong_instance_is_reported() -> None:
    mig = "MIG-11111111-1111-1111-1111-111111111111"
    mine = replace(mig_gpu(0, 1), mig_uuid=mig)
    other = replace(mig_gpu(0, 2), mig_uuid="MIG-22222222-2222-2222-2222-222222222222")
    p = pod(1)
    t = Timeline(devices=[mine, other], pods=[p], attributions={101: attr(101, pod_n=1)})
    answer(t, (p, (mig,)))
    d = t.step([proc(101, mine, 1 * GiB), proc(101, other, 1 * GiB)])
    assert [u.device.gpu_instance_id for u in d.unallocated] == [2]


def test_an_unknown_allocation_reports_and_stops_nothing() -> None:
    p = pod(1)
    t = Timeline(devices=[G0], pods=[p], attributions={101: attr(101, pod_n=1)}, policy=STOP)
    for _ in range(6):  # no answer from the kubelet at all
        d = t.step([proc(101, G0, 3 * GiB)])
        assert d.unallocated == ()
        assert not d.allocations_due
    other = pod(2)
    for _ in range(6):  # an answer that does not list the pod
        answer(t, (other, ()))
        t.step([proc(101, G0, 3 * GiB)])
    assert t.signals() == []
    assert all(d.unallocated == () for d in t.decisions)


def test_stop_sends_the_graduated_stop_after_the_grace_period() -> None:
    p = pod(1)
    t = Timeline(devices=[G0], pods=[p], attributions={101: attr(101, pod_n=1)}, policy=STOP)
    for _ in range(3):
        answer(t, (p, ()))
        d = t.step([proc(101, G0, 3 * GiB)])
    assert t.signals() == [("pod-1", StopSignal.TERM)]
    (stop,) = d.signals
    assert stop.target.unallocated == "no GPU"
    assert stop.target.limit_bytes == 0
    assert any("stopping the containers" in m for m in unallocated_events(d))
    for _ in range(4):
        answer(t, (p, ()))
        t.step([proc(101, G0, 3 * GiB)])
    assert t.signals() == [("pod-1", StopSignal.TERM), ("pod-1", StopSignal.KILL)]


def test_stop_waits_for_a_kubelet_answer_read_since_the_use_began() -> None:
    """The kubelet names no pod UID: an answer from before the use could be of an earlier pod
    of the same name, so the stop waits for a read since, and asks for one."""
    p = pod(1)
    t = Timeline(devices=[G0], pods=[p], attributions={101: attr(101, pod_n=1)}, policy=STOP)
    answer(t, (p, ()), read_at=t.now)  # read at 100.0; the use is first listed at 101.0
    decisions = [t.step([proc(101, G0, 3 * GiB)]) for _ in range(4)]
    assert t.signals() == []
    assert decisions[-1].allocations_due
    answer(t, (p, ()))
    t.step([proc(101, G0, 3 * GiB)])
    assert t.signals() == [("pod-1", StopSignal.TERM)]


def test_stop_never_touches_an_exempt_pod_nor_an_allocated_one() -> None:
    exempt = pod(1, namespace="kube-system")
    allocated = pod(2)
    t = Timeline(
        devices=[G0],
        pods=[exempt, allocated],
        attributions={101: attr(101, pod_n=1), 201: attr(201, pod_n=2)},
        policy=STOP,
    )
    for _ in range(6):
        answer(t, (exempt, ()), (allocated, (G0.uuid,)))
        d = t.step([proc(101, G0, 3 * GiB), proc(201, G0, 3 * GiB)])
        assert d.unallocated == ()
    assert t.signals() == []


def test_stop_in_audit_mode_is_refused_and_shows_what_it_would_send() -> None:
    p = pod(1)
    policy = replace(STOP, mode=Mode.AUDIT)
    t = Timeline(devices=[G0], pods=[p], attributions={101: attr(101, pod_n=1)}, policy=policy)
    for _ in range(3):
        answer(t, (p, ()))
        d = t.step([proc(101, G0, 3 * GiB)])
    assert t.signals() == []
    assert [a.signal for a in d.would_signal] == [StopSignal.TERM]
    assert RefusalReason.AUDIT_MODE in t.refusals()


def test_an_allocation_turning_unknown_mid_violation_stops_nothing() -> None:
    p = pod(1)
    t = Timeline(devices=[G0], pods=[p], attributions={101: attr(101, pod_n=1)}, policy=STOP)
    answer(t, (p, ()))
    t.step([proc(101, G0, 3 * GiB)])
    t.allocations = NodeAllocations(unknown="the kubelet's socket vanished")
    for _ in range(5):
        t.step([proc(101, G0, 3 * GiB)])
    assert t.signals() == []


def test_a_pod_over_its_own_limit_without_an_allocation_is_stopped_for_its_limit() -> None:
    p = pod(1, limit=1 * GiB)
    t = Timeline(devices=[G0], pods=[p], attributions={101: attr(101, pod_n=1)}, policy=STOP)
    for _ in range(3):
        answer(t, (p, ()))
        d = t.step([proc(101, G0, 3 * GiB)])
    (stop,) = d.signals
    assert stop.target.unallocated is None
    assert stop.target.limit_bytes == 1 * GiB
    assert EventReason.LIMIT_EXCEEDED in [e.reason for e in d.events]
