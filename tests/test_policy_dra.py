"""decide() on DRA limits: a violation of a share is acted on only on a read of its claims sent
after it was due (``Decision.reread``), so a claim deleted or deallocated in the grace period,
which changes no pod and so no watch announces, never leads to a signal on the share it no longer
has; a share below 1Mi is never a limit.

The timeline is ``tests.policy_timeline.Timeline`` (one sample per step, the state carried); the
pod's ``dra`` declaration is what ``adapters.kube.dra_claims`` publishes, ``read_at`` included.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from gpuguard.core.dra_shares import ShareUse, largest_first, share_groups
from gpuguard.core.limits import resolve_limit
from gpuguard.core.model import (
    Declaration,
    DraShare,
    EnforcementPolicy,
    EventReason,
    GpuDevice,
    GpuProcess,
    LimitPolicy,
    LimitSource,
    LimitValue,
    Mode,
    NamespacePolicy,
    Pod,
    PodRef,
    RefusalReason,
    StopSignal,
    Trigger,
)
from tests.fakes import GiB, MiB, attr, cgroup_of, pod, proc
from tests.policy_timeline import G0, G1, POLICY, Timeline

DRA_POLICY: EnforcementPolicy = replace(
    POLICY, grace_seconds=2.0, limits=LimitPolicy(sources=("gpuguard", "dra"))
)


def share(memory: int | None, uuid: str | None = G0.uuid, claim: str = "c1") -> DraShare:
    return DraShare(
        claim_namespace="team",
        claim_name=claim,
        request="gpu",
        driver="gpu.nvidia.com",
        pool="node-1",
        device="gpu-0",
        share_id="s1",
        memory_bytes=memory,
        uuid=uuid,  # type: ignore[arg-type]
    )


def dra_pod(*shares: DraShare, read_at: float | None) -> Pod:
    decl = Declaration(where="resourceClaims", shares=shares, read_at=read_at)
    return replace(pod(1), declared={LimitSource.DRA: decl})


def timeline(p: Pod, policy: EnforcementPolicy = DRA_POLICY) -> Timeline:
    return Timeline(
        devices=[G0, G1], pods=[p], attributions={101: attr(101, pod_n=1)}, policy=policy
    )


def read_again(t: Timeline, read_at: float, *shares: DraShare) -> None:
    """The directory's next view after the re-read: the claims as read at ``read_at``."""
    t.pods = [dra_pod(*shares, read_at=read_at)]


def test_a_violation_of_a_share_waits_for_a_read_of_its_claims_sent_after_it_was_due() -> None:
    t = timeline(dra_pod(share(4 * GiB), read_at=50.0))  # read long before (t.now starts at 100)
    decisions = [t.step([proc(101, G0, 6 * GiB)]) for _ in range(4)]
    asked = [d.reread for d in decisions]
    # Due at the third listing (two listings, 2 s of grace): asked for from then, at that moment.
    assert asked[:2] == [{}, {}]
    due = t.now - 1.0
    assert asked[2:] == [{pod(1).uid: due}, {pod(1).uid: due}], "the same moment until read"
    assert t.signals() == [], "never acted on a claim read before the violation was due"
    assert decisions[-1].violations == ()

    read_again(t, due - 0.001, share(4 * GiB))  # a read sent just before the moment: not enough
    assert t.step([proc(101, G0, 6 * GiB)]).reread == {pod(1).uid: due}
    assert t.signals() == []

    read_again(t, due + 0.01, share(4 * GiB))
    d = t.step([proc(101, G0, 6 * GiB)])
    assert d.reread == {}
    assert t.signals() == [("pod-1", StopSignal.TERM)]
    assert d.usages[0].limit.source is LimitSource.DRA
    assert d.usages[0].limit.limit_bytes == 4 * GiB


def test_a_claim_gone_in_the_grace_period_is_seen_by_the_read_and_nothing_is_signalled() -> None:
    # The wrong kill this rule exists for: the claim was deleted while the pod stayed over its
    # 4Gi; the pod watch says nothing, and the share would still be the limit without the read.
    t = timeline(dra_pod(share(4 * GiB), read_at=50.0))
    for _ in range(3):
        t.step([proc(101, G0, 6 * GiB)])
    t.pods = [replace(pod(1), declared={})]  # the read answered 404: the share is forgotten
    for _ in range(5):
        d = t.step([proc(101, G0, 6 * GiB)])
    assert t.signals() == []
    assert d.usages[0].limit.limit_bytes is None, "no share, no default: unlimited"


def test_with_the_claim_gone_the_admins_default_holds_the_pod_from_then() -> None:
    policy = replace(
        DRA_POLICY,
        limits=replace(DRA_POLICY.limits, cluster_default=LimitValue(limit_bytes=5 * GiB)),
    )
    t = timeline(dra_pod(share(8 * GiB), read_at=50.0), policy)
    for _ in range(3):
        t.step([proc(101, G0, 6 * GiB)])  # under its 8Gi share
    t.pods = [replace(pod(1), declared={})]
    for _ in range(4):  # a violation of its own: two listings and the grace period
        d = t.step([proc(101, G0, 6 * GiB)])
    assert d.usages[0].limit.source is LimitSource.DEFAULT
    assert d.reread == {}, "the default rests on no claim: nothing to read again"
    assert t.signals() == [("pod-1", StopSignal.TERM)]


def test_a_claim_never_read_again_keeps_the_violation_waiting_however_long() -> None:
    t = timeline(dra_pod(share(4 * GiB), read_at=None))
    for _ in range(30):
        d = t.step([proc(101, G0, 6 * GiB)])
    assert t.signals() == []
    assert d.reread, "still asking"


def test_audit_mode_waits_for_the_read_too() -> None:
    t = timeline(dra_pod(share(4 * GiB), read_at=50.0), replace(DRA_POLICY, mode=Mode.AUDIT))
    would = [t.step([proc(101, G0, 6 * GiB)]).would_signal for _ in range(4)]
    assert all(not w for w in would)
    read_again(t, t.now + 0.5, share(4 * GiB))
    assert t.step([proc(101, G0, 6 * GiB)]).would_signal


def test_a_limit_from_another_source_asks_for_no_read() -> None:
    annotated = replace(dra_pod(share(8 * GiB), read_at=50.0), annotations={})
    t = timeline(replace(pod(1, limit=4 * GiB), declared=annotated.declared))
    decisions = [t.step([proc(101, G0, 6 * GiB)]) for _ in range(3)]
    assert decisions[-1].usages[0].limit.source is LimitSource.ANNOTATION
    assert all(d.reread == {} for d in decisions)
    assert t.signals() == [("pod-1", StopSignal.TERM)]


def test_memory_on_a_gpu_its_claims_did_not_allocate_asks_for_no_read() -> None:
    policy = replace(
        DRA_POLICY,
        limits=replace(DRA_POLICY.limits, cluster_default=LimitValue(limit_bytes=2 * GiB)),
    )
    t = timeline(dra_pod(share(8 * GiB), read_at=50.0), policy)
    decisions = [t.step([proc(101, G1, 3 * GiB)]) for _ in range(3)]
    assert decisions[-1].usages[0].limit.source is LimitSource.DEFAULT
    assert all(d.reread == {} for d in decisions)
    assert t.signals() == [("pod-1", StopSignal.TERM)]


def test_a_share_below_one_mebibyte_is_never_a_limit() -> None:
    p = dra_pod(share(1), read_at=50.0)
    r = resolve_limit(
        pod=p, device_total_bytes=80 * GiB, policy=DRA_POLICY.limits, replicas=None, device=G0
    )
    assert r.limit_bytes != 1
    assert r.limit_bytes is None
    assert any("below the smallest limit of 1Mi" in e for e in r.errors)
    t = timeline(p)
    for _ in range(4):
        t.step([proc(101, G0, 1 * GiB)])
    assert t.signals() == []


def test_an_unresolved_share_is_still_held_to_the_namespace_maximum() -> None:
    # The escape: a tenant whose claims sort past the node's claim cap (or are refused) made its
    # own pods unresolved, and with no limit at all even where the admin set a maximum.
    from gpuguard.core.model import NamespacePolicy

    unresolved = Declaration(where="resourceClaims", unresolved="over the cap: not read")
    p = replace(pod(1), declared={LimitSource.DRA: unresolved})
    limits = replace(
        DRA_POLICY.limits,
        namespaces={p.namespace: NamespacePolicy(max_limit=LimitValue(limit_bytes=10 * GiB))},
    )
    r = resolve_limit(pod=p, device_total_bytes=80 * GiB, policy=limits, replicas=None, device=G0)
    assert (r.limit_bytes, r.source) == (10 * GiB, LimitSource.NAMESPACE_DEFAULT)
    assert any("cannot be known yet" in w for w in r.warnings)
    t = timeline(p, replace(DRA_POLICY, limits=limits))
    for _ in range(4):
        d = t.step([proc(101, G0, 30 * GiB)])
    assert t.signals() == [("pod-1", StopSignal.TERM)], "over the maximum, whatever its share"
    assert d.reread == {}, "the maximum rests on no claim"


def test_an_unresolved_share_beside_a_known_annotation_is_held_to_the_annotation() -> None:
    unresolved = Declaration(where="resourceClaims", unresolved="a claim not read yet")
    p = replace(pod(1, limit=4 * GiB), declared={LimitSource.DRA: unresolved})
    r = resolve_limit(
        pod=p, device_total_bytes=80 * GiB, policy=DRA_POLICY.limits, replicas=None, device=G0
    )
    # The share may be smaller, never larger than the smallest known cap: an upper bound.
    assert (r.limit_bytes, r.source) == (4 * GiB, LimitSource.ANNOTATION)


# -- an unresolved pod is held like one that declares nothing ------------------------------------

UNRESOLVED = Declaration(where="resourceClaims", unresolved="past the node's claim budget")


def unresolved_pod(read_at: float | None = None, **fields: object) -> Pod:
    decl = replace(UNRESOLVED, read_at=read_at)
    return replace(pod(1), declared={LimitSource.DRA: decl}, **fields)  # type: ignore[arg-type]


def with_limits(**limits: object) -> EnforcementPolicy:
    return replace(DRA_POLICY, limits=replace(DRA_POLICY.limits, **limits))  # type: ignore[arg-type]


def ns_policy(
    *, default_limit: LimitValue | None = None, max_limit: LimitValue | None = None
) -> dict[str, NamespacePolicy]:
    return {"team": NamespacePolicy(default_limit=default_limit, max_limit=max_limit)}


@pytest.mark.parametrize(
    ("limits", "waits"),
    [
        pytest.param({}, False, id="nothing set: no limit either way"),
        pytest.param({"cluster_default": LimitValue(limit_bytes=2 * GiB)}, True, id="default"),
        pytest.param(
            {"namespaces": ns_policy(default_limit=LimitValue(limit_bytes=3 * GiB))},
            True,
            id="namespace default",
        ),
        pytest.param(
            {
                "cluster_default": LimitValue(limit_bytes=6 * GiB),
                "namespaces": ns_policy(max_limit=LimitValue(limit_bytes=5 * GiB)),
            },
            False,
            id="default above the maximum: the maximum, which bounds the shares",
        ),
        pytest.param(
            {
                "cluster_default": LimitValue(limit_bytes=2 * GiB),
                "namespaces": ns_policy(max_limit=LimitValue(limit_bytes=5 * GiB)),
            },
            True,
            id="default below the maximum",
        ),
        pytest.param(
            {"namespaces": ns_policy(max_limit=LimitValue(limit_bytes=5 * GiB))},
            False,
            id="maximum alone",
        ),
        pytest.param({"replicas_default": True}, True, id="replicas split"),
        pytest.param({"cluster_default": LimitValue(percent=10.0)}, True, id="percentage"),
    ],
)
def test_an_unresolved_pod_is_never_less_bounded_than_a_pod_that_declares_nothing(
    limits: dict[str, object], waits: bool
) -> None:
    policy = with_limits(**limits).limits
    for device in (G0, G1):
        bare = resolve_limit(
            pod=pod(1), device_total_bytes=80 * GiB, policy=policy, replicas=4, device=device
        )
        unknown = resolve_limit(
            pod=unresolved_pod(), device_total_bytes=80 * GiB, policy=policy, replicas=4,
            device=device,
        )  # fmt: skip
        assert (unknown.limit_bytes, unknown.source) == (bare.limit_bytes, bare.source)
        assert any("past the node's claim budget" in e for e in unknown.errors), unknown.errors
        # Only a default that may be below the shares waits for a read of the claims.
        assert unknown.awaits_dra is waits
        assert bare.awaits_dra is False


def test_an_unresolved_pod_is_held_to_the_cluster_default_once_its_claims_were_read_again() -> None:
    # The escape the old rule left: crowd one's own claims past the node's budget (or get them
    # refused) and run with no limit where a pod without any declaration has the default.
    policy = with_limits(cluster_default=LimitValue(limit_bytes=2 * GiB))
    t = timeline(unresolved_pod(read_at=50.0), policy)
    decisions = [t.step([proc(101, G0, 6 * GiB)]) for _ in range(4)]
    limit = decisions[-1].usages[0].limit
    assert (limit.limit_bytes, limit.source, limit.awaits_dra) == (
        2 * GiB,
        LimitSource.DEFAULT,
        True,
    )
    assert t.signals() == [], "the shares may be larger than the default: not on a stale read"
    due = t.now - 1.0
    assert decisions[-1].reread == {pod(1).uid: due}
    t.pods = [unresolved_pod(read_at=due + 0.01)]  # read again: still past the budget
    t.step([proc(101, G0, 6 * GiB)])
    assert t.signals() == [("pod-1", StopSignal.TERM)]


def test_an_unresolved_pod_whose_claims_resolve_to_a_larger_share_is_not_stopped() -> None:
    policy = with_limits(cluster_default=LimitValue(limit_bytes=2 * GiB))
    t = timeline(unresolved_pod(read_at=None), policy)  # a claim not read yet (just started)
    for _ in range(4):
        t.step([proc(101, G0, 6 * GiB)])
    assert t.signals() == []
    read_again(t, t.now + 0.5, share(8 * GiB))  # the read: an 8Gi share
    for _ in range(4):
        d = t.step([proc(101, G0, 6 * GiB)])
    assert t.signals() == []
    assert (d.usages[0].limit.limit_bytes, d.usages[0].limit.source) == (8 * GiB, LimitSource.DRA)


def test_an_unresolved_pod_under_a_maximum_below_its_default_is_stopped_without_waiting() -> None:
    policy = with_limits(
        cluster_default=LimitValue(limit_bytes=8 * GiB),
        namespaces={"team": NamespacePolicy(max_limit=LimitValue(limit_bytes=4 * GiB))},
    )
    t = timeline(unresolved_pod(read_at=None), policy)
    for _ in range(3):
        d = t.step([proc(101, G0, 6 * GiB)])
    assert d.usages[0].limit.awaits_dra is False, "the maximum bounds the shares too"
    assert d.reread == {}
    assert t.signals() == [("pod-1", StopSignal.TERM)]


# -- a claim several pods share: a budget for their sum ------------------------------------------

SHARED = share(4 * GiB, claim="shared")


def sharer(n: int, *shares: DraShare, read_at: float | None = 50.0, **fields: object) -> Pod:
    decl = Declaration(where="resourceClaims", shares=shares or (SHARED,), read_at=read_at)
    return replace(pod(n, **fields), declared={LimitSource.DRA: decl})  # type: ignore[arg-type]


def sharing(*pods: Pod, policy: EnforcementPolicy = DRA_POLICY) -> Timeline:
    """Pods 1..n with one process each (PID 100 + n) on G0."""
    return Timeline(
        devices=[G0, G1],
        pods=list(pods),
        attributions={100 + p.uid_n: attr(100 + p.uid_n, pod_n=p.uid_n) for p in map(_n, pods)},
        policy=policy,
    )


@dataclass(frozen=True)
class _N:
    uid_n: int


def _n(p: Pod) -> _N:
    return _N(uid_n=int(p.name.removeprefix("pod-")))


def on_g0(**used: int) -> list[GpuProcess]:
    """``pod_1=3 * GiB`` → PID 101 of pod 1 using 3 GiB on G0."""
    return [proc(100 + int(k.removeprefix("pod_")), G0, v) for k, v in used.items()]


def read_now(t: Timeline) -> None:
    """The directory's view after the members' claims were read again (just now)."""
    t.pods = [
        replace(p, declared={LimitSource.DRA: replace(p.declared[LimitSource.DRA], read_at=t.now)})
        for p in t.pods
    ]


def test_three_pods_over_their_shared_share_together_lose_the_largest_user_first() -> None:
    # Each is within the whole 4Gi share on its own (the old rule: nothing happens, and the three
    # use 7.5 GiB of memory the scheduler accounted 4Gi for).
    t = sharing(sharer(1), sharer(2), sharer(3))
    usage = on_g0(pod_1=2 * GiB, pod_2=3 * GiB + 512 * MiB, pod_3=2 * GiB)
    decisions = [t.step(usage) for _ in range(3)]
    assert t.signals() == [], "acted on only once every member's claims were read since"
    assert set(decisions[-1].reread) == {pod(n).uid for n in (1, 2, 3)}
    read_now(t)
    d = t.step(usage)
    assert t.signals() == [("pod-2", StopSignal.TERM)], "the largest: 4 GiB left, which fits"
    (action,) = d.signals
    assert action.target.shared is not None
    assert action.target.shared.claims == ("team/shared",)
    assert [p.name for p in action.target.shared.pods] == ["pod-2", "pod-1", "pod-3"]
    assert (action.target.used_bytes, action.target.limit_bytes) == (7.5 * GiB, 4 * GiB)
    assert action.target.dra_shares == (SHARED,)
    assert d.violations == (Trigger.GRACE,)
    assert [(e.pod.name, e.reason) for e in d.events] == [("pod-2", EventReason.SHARE_EXCEEDED)]
    assert "use 7680Mi together" in d.events[0].message
    assert all(u.limit.limit_bytes == 4 * GiB for u in d.usages), "each is held to the share too"

    # pod-2 ignores SIGTERM: SIGKILL after the timeout, to it alone.
    for _ in range(4):
        t.step(usage)
    assert t.signals() == [("pod-2", StopSignal.TERM), ("pod-2", StopSignal.KILL)]
    # pod-2 is gone: the other two fit, and nothing more happens.
    for _ in range(6):
        d = t.step(on_g0(pod_1=2 * GiB, pod_3=2 * GiB))
    assert t.signals() == [("pod-2", StopSignal.TERM), ("pod-2", StopSignal.KILL)]
    assert d.state.tracks == {}


def test_three_pods_that_fit_their_shared_share_together_are_never_signalled() -> None:
    t = sharing(sharer(1, read_at=None), sharer(2, read_at=None), sharer(3, read_at=None))
    for _ in range(10):
        d = t.step(on_g0(pod_1=1 * GiB, pod_2=1 * GiB, pod_3=2 * GiB))
    assert t.signals() == []
    assert d.reread == {}
    assert d.state.tracks == {}


def test_as_many_pods_are_stopped_as_it_takes_for_the_rest_to_fit() -> None:
    t = sharing(*(sharer(n) for n in (1, 2, 3, 4)))
    usage = on_g0(pod_1=3 * GiB, pod_2=3 * GiB, pod_3=3 * GiB, pod_4=1 * GiB)
    for _ in range(3):
        t.step(usage)
    read_now(t)
    t.step(usage)
    # 10 GiB over 4Gi: the ties go by name; pod-1 and pod-2 leave 4 GiB, which fits.
    assert t.signals() == [("pod-1", StopSignal.TERM), ("pod-2", StopSignal.TERM)]


def test_a_usage_that_swaps_between_sharers_every_listing_cannot_keep_the_group_unconfirmed() -> (
    None
):
    # Tracked per group, not per pod: which pod is largest may change at every listing.
    t = sharing(sharer(1, read_at=1e9), sharer(2, read_at=1e9))
    for i in range(4):
        big, small = (3 * GiB, 2 * GiB) if i % 2 else (2 * GiB, 3 * GiB)
        t.step(on_g0(pod_1=big, pod_2=small))
    assert len(t.signals()) == 1
    assert t.signals()[0][1] is StopSignal.TERM


def test_a_sharer_whose_usage_is_unknown_refuses_the_group_with_a_reason() -> None:
    t = sharing(sharer(1, read_at=1e9), sharer(2, read_at=1e9), sharer(3, read_at=1e9))
    for _ in range(4):
        t.step([*on_g0(pod_1=3 * GiB, pod_2=3 * GiB), proc(103, G0, None)])
    assert t.signals() == []
    assert RefusalReason.USAGE_UNKNOWN in t.refusals()


def test_a_group_in_an_exempt_namespace_is_refused_and_audit_mode_only_reports() -> None:
    exempt = [sharer(n, read_at=1e9, namespace="kube-system") for n in (1, 2)]
    t = sharing(*exempt)
    for _ in range(4):
        t.step(on_g0(pod_1=3 * GiB, pod_2=3 * GiB))
    assert t.signals() == []
    assert RefusalReason.EXEMPT in t.refusals()

    t = sharing(
        sharer(1, read_at=1e9), sharer(2, read_at=1e9), policy=replace(DRA_POLICY, mode=Mode.AUDIT)
    )
    would = [t.step(on_g0(pod_1=3 * GiB, pod_2=2 * GiB)).would_signal for _ in range(4)]
    assert t.signals() == []
    assert [(a.target.pod.name, a.signal) for w in would for a in w] == [("pod-1", StopSignal.TERM)]
    assert RefusalReason.AUDIT_MODE in t.refusals()


def test_a_sharer_over_its_own_limit_is_stopped_once_and_the_rest_left_alone_if_it_fits() -> None:
    # pod-1's own annotation (1Gi) is exceeded: its own violation stops it; with it gone the
    # other two fit the share, so the group stops nobody else and sends pod-1 nothing twice.
    t = sharing(
        sharer(1, read_at=1e9, limit=1 * GiB), sharer(2, read_at=1e9), sharer(3, read_at=1e9)
    )
    usage = on_g0(pod_1=3 * GiB, pod_2=2 * GiB, pod_3=1 * GiB)
    for _ in range(8):
        t.step(usage)
    assert t.signals() == [("pod-1", StopSignal.TERM), ("pod-1", StopSignal.KILL)]


def test_a_pod_whose_shares_are_not_all_known_joins_no_group() -> None:
    unknown = replace(
        sharer(3),
        declared={LimitSource.DRA: Declaration(where="c", shares=(SHARED,), unresolved="a claim")},
    )
    t = sharing(sharer(1, read_at=1e9), sharer(2, read_at=1e9), unknown)
    for _ in range(5):
        t.step(on_g0(pod_1=1 * GiB, pod_2=1 * GiB, pod_3=3 * GiB))
    assert t.signals() == [], "the known two use 2 GiB of the 4Gi: never on a guess of the third"


def test_a_sharer_with_a_share_of_its_own_adds_it_to_the_groups_budget() -> None:
    own = share(4 * GiB, claim="own-1")
    t = sharing(sharer(1, SHARED, own, read_at=1e9), sharer(2, read_at=1e9))
    for _ in range(6):
        t.step(on_g0(pod_1=5 * GiB, pod_2=2 * GiB))  # 7 GiB of the 8Gi accounted for both
    assert t.signals() == []
    for _ in range(4):
        t.step(on_g0(pod_1=5 * GiB, pod_2=3 * GiB + 1))
    assert t.signals() == [("pod-1", StopSignal.TERM)]


def test_shares_of_the_whole_device_make_no_group_budget() -> None:
    whole = share(None, claim="whole")
    t = sharing(sharer(1, whole, read_at=1e9), sharer(2, whole, read_at=1e9))
    for _ in range(5):
        t.step(on_g0(pod_1=30 * GiB, pod_2=30 * GiB))
    assert t.signals() == []


def test_share_groups_join_pods_through_every_share_they_hold_in_common() -> None:
    a, b = share(4 * GiB, claim="a"), share(2 * GiB, claim="b")
    own = share(1 * GiB, claim="own")
    uses = [
        share_use(1, (a,), 1 * GiB),
        share_use(2, (a, b), 2 * GiB),
        share_use(3, (b, own), 4 * GiB),
        share_use(4, (own,), 9 * GiB, device=G1),  # another device: its own use of it
        share_use(5, (share(8 * GiB, claim="alone"),), 9 * GiB),
    ]
    (group,) = share_groups(uses)
    assert [m.pod.name for m in group.members] == ["pod-1", "pod-2", "pod-3"]
    assert group.claims == ("team/a", "team/b")
    assert (group.budget_bytes, group.used_bytes, group.over) == (7 * GiB, 7 * GiB, False)
    assert largest_first(group) == ()
    over = share_groups([*uses[:2], share_use(3, (b, own), 5 * GiB)])[0]
    assert [m.pod.name for m in largest_first(over)] == ["pod-3"]
    stopping = frozenset(over.members[2].cgroups)
    assert largest_first(over, stopping=stopping) == (), "its memory counts as gone"


def share_use(n: int, shares: tuple[DraShare, ...], used: int, device: GpuDevice = G0) -> ShareUse:
    p = pod(n)
    (container,) = p.containers
    return ShareUse(
        pod=PodRef(uid=p.uid, namespace=p.namespace, name=p.name),
        device=device,
        shares=tuple(replace(s, uuid=device.uuid) for s in shares),
        used_bytes=used,
        container_bytes={container: used},
        cgroups={container: cgroup_of(p.uid, container)},
        refusal=None,
        read_at=None,
    )
