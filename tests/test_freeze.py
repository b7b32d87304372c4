"""The allocation guard's decisions (``core.freeze``) and the trigger a frozen allocation gives
``decide()`` (``Trigger.ALLOCATION``): tables over pure functions.

A frozen crossing is confirmed by one listing of its device taken after the freeze that shows
the pod over with the allocation counted, without the grace period, under every other rule of
``decide()``; a listing taken before the freeze confirms nothing. ``fate``: keep frozen until
such a listing is decided on, then resume with a reason unless the stop signal went out.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpuguard.core.freeze import (
    Fate,
    FrozenAllocation,
    budgets,
    fate,
    frozen_since,
    with_frozen,
)
from gpuguard.core.model import (
    EnforcementPolicy,
    LimitPolicy,
    LimitSource,
    Mode,
    PodRef,
    ResolvedLimit,
    StopSignal,
    Trigger,
)
from gpuguard.core.policy import PodUsage, UsageState
from tests.fakes import GiB, attr, cid, gpu, pod, proc, sample, uid
from tests.policy_timeline import G0, POLICY, Timeline

G1 = gpu(1)


def frozen(
    pid: int = 101, *, pod_n: int | None = 1, size: int = 3 * GiB, at: float = 100.0
) -> FrozenAllocation:
    return FrozenAllocation(
        tgid=pid,
        device_index=0,
        size_bytes=size,
        frozen_at=at,
        attribution=attr(pid, pod_n=pod_n),
    )


def usage(
    state: UsageState, *, n: int = 1, used: int = 8 * GiB, limit: int | None = 10 * GiB
) -> PodUsage:
    return PodUsage(
        pod=PodRef(uid=uid(n), namespace="team", name=f"pod-{n}"),
        container=None,
        device=G0,
        used_bytes=used,
        unknown_processes=0,
        limit=ResolvedLimit(limit_bytes=limit, source=LimitSource.ANNOTATION),
        state=state,
    )


# -- decide(): the allocation trigger -----------------------------------------------------


def timeline(**policy: object) -> Timeline:
    return Timeline(
        devices=[G0, G1],
        pods=[pod(1, limit=10 * GiB), pod(2, limit=10 * GiB)],
        attributions={101: attr(101, pod_n=1), 201: attr(201, pod_n=2)},
        policy=replace(POLICY, grace_seconds=30.0, **policy),  # type: ignore[arg-type]
    )


def test_a_listing_after_the_freeze_showing_the_pod_over_stops_it_at_once() -> None:
    t = timeline()
    t.step([proc(101, G0, 8 * GiB), proc(201, G0, 1 * GiB)])
    t.frozen = {(uid(1), G0.key): t.now + 0.01}
    # The frozen 3 GiB counted (with_frozen): 11 GiB of a 10 GiB limit.
    d = t.step([proc(101, G0, 11 * GiB), proc(201, G0, 1 * GiB)], dt=0.02)
    assert [(a.target.pod.name, a.signal, a.trigger) for a in d.signals] == [
        ("pod-1", StopSignal.TERM, Trigger.ALLOCATION)
    ]
    assert d.violations == (Trigger.ALLOCATION,)
    (event,) = d.events
    assert "frozen before it ran" in event.message


def test_a_listing_taken_before_the_freeze_confirms_nothing() -> None:
    t = timeline()
    t.step([proc(101, G0, 8 * GiB)])
    # The freeze was taken in after this listing was taken (its usage says nothing of it).
    t.frozen = {(uid(1), G0.key): t.now + 0.5}
    d = t.step([proc(101, G0, 11 * GiB)], dt=0.02, sample_age=0.0)
    assert d.signals == ()
    assert d.violations == ()


def test_a_frozen_pod_within_its_limit_or_on_another_device_is_not_stopped() -> None:
    t = timeline()
    t.step([proc(101, G0, 8 * GiB)])
    t.frozen = {(uid(1), G1.key): t.now}
    d = t.step([proc(101, G0, 11 * GiB)], dt=0.02)
    assert d.signals == ()  # over on GPU 0, frozen on GPU 1: the grace period applies
    t.frozen = {(uid(1), G0.key): t.now}
    d = t.step([proc(101, G0, 9 * GiB)], dt=0.02)
    assert d.signals == ()


@pytest.mark.parametrize(
    "policy",
    [{"mode": Mode.AUDIT}, {"limits": LimitPolicy(exempt_namespaces=frozenset({"team"}))}],
    ids=["audit", "exempt"],
)
def test_every_other_rule_of_decide_still_holds_for_a_frozen_crossing(
    policy: dict[str, object],
) -> None:
    t = timeline(**policy)
    t.step([proc(101, G0, 8 * GiB)])
    t.frozen = {(uid(1), G0.key): t.now}
    d = t.step([proc(101, G0, 11 * GiB)], dt=0.02)
    assert d.signals == ()


def test_unknown_usage_in_the_pod_blocks_a_frozen_crossing_too() -> None:
    t = timeline()
    t.attributions[102] = attr(102, pod_n=1)
    t.step([proc(101, G0, 8 * GiB), proc(102, G0, None)])
    t.frozen = {(uid(1), G0.key): t.now}
    d = t.step([proc(101, G0, 11 * GiB), proc(102, G0, None)], dt=0.02)
    assert d.signals == ()


def test_a_stop_confirmed_by_a_frozen_allocation_escalates_at_the_termination_timeout() -> None:
    t = timeline(termination_timeout_seconds=2.0)
    t.step([proc(101, G0, 8 * GiB)])
    t.frozen = {(uid(1), G0.key): t.now}
    assert t.step([proc(101, G0, 11 * GiB)], dt=0.02).signals  # SIGTERM
    t.frozen = {}  # resumed after the SIGTERM: the call ran, NVML lists it
    t.step([proc(101, G0, 11 * GiB)], dt=1.0)
    d = t.step([proc(101, G0, 11 * GiB)], dt=1.5)
    assert [(a.signal, a.trigger) for a in d.signals] == [(StopSignal.KILL, Trigger.ALLOCATION)]


# -- core.freeze ----------------------------------------------------------------------------


def test_with_frozen_adds_the_allocation_to_its_process_or_lists_it() -> None:
    s = sample(1, 100.0, [G0, G1], [proc(101, G0, 2 * GiB), proc(201, G1, GiB)])
    got, attributions = with_frozen(s, {101: attr(101, pod_n=1)}, [frozen(101), frozen(301)])
    by_pid = {(p.pid, p.device): p.used_bytes for p in got.processes}
    assert by_pid == {
        (101, G0.key): 5 * GiB,
        (201, G1.key): GiB,
        (301, G0.key): 3 * GiB,  # not listed yet: the allocation alone, as read when frozen
    }
    assert attributions[301] == frozen(301).attribution
    assert with_frozen(s, {}, []) == (s, {})


def test_frozen_since_is_the_earliest_freeze_per_pod_and_device() -> None:
    s = sample(1, 100.0, [G0], [])
    got = frozen_since(
        [frozen(101, at=5.0), frozen(102, at=3.0), frozen(301, pod_n=None, at=1.0)], s
    )
    assert got == {(uid(1), G0.key): 3.0}


ENFORCE = EnforcementPolicy(mode=Mode.ENFORCE)


@pytest.mark.parametrize(
    ("usages", "signalled", "listed_at", "expected"),
    [
        ([usage(UsageState.OK)], (), 100.5, Fate.NOT_OVER),
        ([usage(UsageState.OK)], (), 100.0, Fate.KEEP),  # listing not after the freeze
        ([usage(UsageState.OK)], (), None, Fate.KEEP),
        ([usage(UsageState.OVER)], (), 100.5, Fate.REFUSED),
        ([usage(UsageState.OVER)], (cid(10),), 100.5, Fate.SIGNALLED),
        ([usage(UsageState.STOPPING)], (), 100.5, Fate.KEEP),
        ([usage(UsageState.EXEMPT)], (), 100.5, Fate.NOT_GUARDED),
        ([usage(UsageState.UNLIMITED, limit=None)], (), 100.5, Fate.NOT_GUARDED),
        ([usage(UsageState.UNKNOWN)], (), 100.5, Fate.NOT_GUARDED),
        ([usage(UsageState.OVER, n=2)], (), 100.5, Fate.NOT_GUARDED),  # not its pod's usage
        ([], (), 100.5, Fate.NOT_GUARDED),
    ],
)
def test_fate(
    usages: list[PodUsage], signalled: tuple[object, ...], listed_at: float | None, expected: Fate
) -> None:
    assert fate(frozen(), usages, signalled, listed_at=listed_at, policy=ENFORCE) is expected


def test_fate_in_audit_mode_is_not_guarded() -> None:
    audit = EnforcementPolicy(mode=Mode.AUDIT)
    got = fate(frozen(), [usage(UsageState.OVER)], (), listed_at=101.0, policy=audit)
    assert got is Fate.NOT_GUARDED


def test_budgets_split_the_pods_headroom_among_its_containers_on_the_device() -> None:
    a, b = attr(101, pod_n=1), attr(102, pod_n=1, container=1)
    assert a.cgroup is not None
    assert b.cgroup is not None
    assert a.cgroup != b.cgroup  # two containers of pod 1
    s = sample(1, 100.0, [G0], [proc(101, G0, 4 * GiB), proc(102, G0, 2 * GiB)])
    got = budgets([usage(UsageState.OK, used=6 * GiB)], s, {101: a, 102: b}, ENFORCE)
    assert got == {(a.cgroup, 0): 2 * GiB, (b.cgroup, 0): 2 * GiB}
    for state in (UsageState.OVER, UsageState.EXEMPT, UsageState.UNKNOWN):
        assert budgets([usage(state, used=6 * GiB)], s, {101: a, 102: b}, ENFORCE) == {}
    audit = EnforcementPolicy(mode=Mode.AUDIT)
    assert budgets([usage(UsageState.OK, used=6 * GiB)], s, {101: a, 102: b}, audit) == {}
