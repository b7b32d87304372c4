"""decide() with per-container declarations (KAI's ``nvidia.com/container.<c>.gpu-memory.*``):
a container over its own limit is stopped alone, with the same graduated stop, while its pod's
other containers are never signalled; the pod's limit still binds over the containers'; a
container known by no name (no ``containerStatuses`` entry) has no own limit."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gpuguard.core.model import EventReason, LimitPolicy, Pod, StopSignal
from gpuguard.core.policy import Decision
from gpuguard.kubemodel.declared import declarations
from tests.fakes import GiB, attr, cid, pod, proc
from tests.policy_timeline import G0, G1, POLICY, Timeline

KAI = replace(POLICY, limits=LimitPolicy(sources=("gpuguard", "kai")))


def kai_pod(annotations: dict[str, Any], *, limit: int | None = None) -> Pod:
    """Pod 1 with containers ``c0`` and ``c1`` (IDs ``cid(10)``, ``cid(11)``), declaring
    ``annotations`` (KAI's keys name the containers as the pod spec does)."""
    made = pod(1, containers=2, limit=limit)
    manifest = {
        "metadata": {"annotations": annotations},
        "spec": {"containers": [{"name": "c0"}, {"name": "c1"}]},
    }
    return replace(made, declared=declarations(manifest))


def timeline(p: Pod, **policy: Any) -> Timeline:
    return Timeline(
        devices=[G0, G1],
        pods=[p],
        attributions={101: attr(101, pod_n=1, container=0), 102: attr(102, pod_n=1, container=1)},
        policy=replace(KAI, **policy),
    )


def sent(t: Timeline) -> list[tuple[str | None, StopSignal]]:
    return [(a.target.container_name, a.signal) for d in t.decisions for a in d.signals]


C0_LIMIT = {"nvidia.com/container.c0.gpu-memory.limit": "4Gi"}


def test_a_container_over_its_own_limit_is_stopped_alone_and_its_sibling_survives() -> None:
    t = timeline(kai_pod(C0_LIMIT))
    over = [proc(101, G0, 5 * GiB), proc(102, G0, 1 * GiB)]
    decisions: list[Decision] = [t.step(over) for _ in range(3)]
    assert sent(t) == [("c0", StopSignal.TERM)]
    (event,) = [e for d in decisions for e in d.events if e.reason is EventReason.LIMIT_EXCEEDED]
    assert "container c0 uses 5Gi, over its own limit 4Gi" in event.message
    assert "nvidia.com/container.c0.gpu-memory.limit" in event.message
    (target,) = [a.target for d in decisions for a in d.signals]
    assert (target.used_bytes, target.limit_bytes) == (5 * GiB, 4 * GiB)
    assert target.own_limit is not None
    assert target.own_limit.container == "c0"
    # The same graduated stop: SIGKILL after the termination timeout, to c0 only.
    for _ in range(3):
        t.step(over, dt=1.0)
    assert sent(t) == [("c0", StopSignal.TERM), ("c0", StopSignal.KILL)]
    for _ in range(10):
        t.step(over, dt=1.0)
    assert all(name == "c0" for name, _ in sent(t))


def test_the_pods_limit_still_binds_over_the_containers_limits() -> None:
    # Each container within its own 4Gi; together 6Gi, over the pod's 5Gi annotation.
    t = timeline(
        kai_pod(
            {**C0_LIMIT, "nvidia.com/container.c1.gpu-memory.limit": "4Gi"},
            limit=5 * GiB,
        )
    )
    for _ in range(3):
        t.step([proc(101, G0, 3 * GiB), proc(102, G0, 3 * GiB)])
    assert sorted(sent(t), key=str) == [("c0", StopSignal.TERM), ("c1", StopSignal.TERM)]


def test_a_container_over_its_own_limit_whose_sibling_overflows_the_pod_stops_the_pod() -> None:
    # c0 over its 4Gi, and c1 alone (5Gi) over the pod's limit (4Gi: c0's declaration caps the
    # pod too): stopping c0 alone would not bring the pod under its limit.
    t = timeline(kai_pod(C0_LIMIT))
    for _ in range(3):
        t.step([proc(101, G0, 5 * GiB), proc(102, G0, 5 * GiB)])
    assert sorted(sent(t), key=str) == [("c0", StopSignal.TERM), ("c1", StopSignal.TERM)]


def test_a_sibling_growing_mid_escalation_is_stopped_too_never_with_a_carried_sigkill() -> None:
    t = timeline(kai_pod(C0_LIMIT))
    for _ in range(3):
        t.step([proc(101, G0, 5 * GiB), proc(102, G0, 1 * GiB)])
    assert sent(t) == [("c0", StopSignal.TERM)]
    for _ in range(3):  # c1 grows past what the pod's limit leaves it
        t.step([proc(101, G0, 5 * GiB), proc(102, G0, 6 * GiB)], dt=1.0)
    assert sent(t) == [
        ("c0", StopSignal.TERM),
        ("c0", StopSignal.KILL),
        ("c1", StopSignal.TERM),
    ]


def test_keys_written_for_every_container_never_let_the_pod_use_more() -> None:
    both = {**C0_LIMIT, "nvidia.com/container.c1.gpu-memory.limit": "4Gi"}
    t = timeline(kai_pod(both))
    # 3Gi + 3Gi: each within its own 4Gi, the pod over 4Gi (each key caps the pod).
    for _ in range(3):
        t.step([proc(101, G0, 3 * GiB), proc(102, G0, 3 * GiB)])
    assert sorted(sent(t), key=str) == [("c0", StopSignal.TERM), ("c1", StopSignal.TERM)]


def test_a_key_for_a_container_the_pod_lacks_gains_nothing() -> None:
    ghost = {**C0_LIMIT, "nvidia.com/container.ghost.gpu-memory.limit": "70Gi"}
    t = timeline(kai_pod(ghost))
    for _ in range(3):
        t.step([proc(101, G0, 3 * GiB), proc(102, G0, 3 * GiB)])
    assert sorted(sent(t), key=str) == [("c0", StopSignal.TERM), ("c1", StopSignal.TERM)]
    invalid = [e for d in t.decisions for e in d.events if e.reason is EventReason.INVALID_LIMIT]
    assert any("ghost" in e.message for e in invalid)


def test_a_container_without_a_name_in_the_pods_status_has_no_own_limit() -> None:
    p = kai_pod(C0_LIMIT)
    # The kubelet has not reported c0's ID yet: its processes are the pod's, held to its limit.
    p = replace(p, containers={cid(11): "c1"})
    t = timeline(p)
    for _ in range(3):
        t.step([proc(101, G0, 5 * GiB), proc(102, G0, 1 * GiB)])
    targets = [a.target for d in t.decisions for a in d.signals]
    assert {x.container_id for x in targets} == {cid(10), cid(11)}
    assert all(x.own_limit is None for x in targets)


def test_a_container_pinned_to_another_gpu_is_still_held_to_its_own_limit_there() -> None:
    pinned = {**C0_LIMIT, "nvidia.com/container.c0.gpus.devices": G1.uuid}
    t = timeline(kai_pod(pinned))
    for _ in range(3):
        t.step([proc(101, G0, 5 * GiB), proc(102, G0, 1 * GiB)])
    assert sent(t) == [("c0", StopSignal.TERM)]


def test_in_audit_mode_a_container_over_its_own_limit_is_only_reported() -> None:
    from gpuguard.core.model import Mode, RefusalReason

    t = timeline(kai_pod(C0_LIMIT), mode=Mode.AUDIT)
    decisions = [t.step([proc(101, G0, 5 * GiB), proc(102, G0, 1 * GiB)]) for _ in range(3)]
    assert sent(t) == []
    assert RefusalReason.AUDIT_MODE in t.refusals()
    would = [a.target.container_name for d in decisions for a in d.would_signal]
    assert would == ["c0"]
