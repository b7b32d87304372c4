"""decide() on DRA limits: a violation of a share is acted on only on a read of its claims sent
after it was due (``Decision.reread``), so a claim deleted or deallocated in the grace period,
which changes no pod and so no watch announces, never leads to a signal on the share it no longer
has; a share below 1Mi is never a limit.

The timeline is ``tests.policy_timeline.Timeline`` (one sample per step, the state carried); the
pod's ``dra`` declaration is what ``adapters.kube.dra_claims`` publishes, ``read_at`` included.
"""

from __future__ import annotations

from dataclasses import replace

from gpuguard.core.limits import resolve_limit
from gpuguard.core.model import (
    Declaration,
    DraShare,
    EnforcementPolicy,
    LimitPolicy,
    LimitSource,
    LimitValue,
    Mode,
    Pod,
    StopSignal,
)
from tests.fakes import GiB, attr, pod, proc
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


def test_an_unresolved_share_alone_with_no_maximum_is_no_limit() -> None:
    unresolved = Declaration(where="resourceClaims", unresolved="a claim not read yet")
    policy = replace(
        DRA_POLICY,
        limits=replace(DRA_POLICY.limits, cluster_default=LimitValue(limit_bytes=2 * GiB)),
    )
    t = timeline(replace(pod(1), declared={LimitSource.DRA: unresolved}), policy)
    for _ in range(4):
        d = t.step([proc(101, G0, 6 * GiB)])
    # The default is for pods that declare nothing: the share may well be larger than 2Gi.
    assert d.usages[0].limit.limit_bytes is None
    assert t.signals() == []
