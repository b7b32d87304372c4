"""``core.coverage``: each device's memory by what bounds it (docs/design.md, Metrics, coverage),
from the pods the real ``decide()`` judged, each limit resolved by the real ``core.limits``."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpuguard.core.coverage import DeviceCoverage, coverage
from gpuguard.core.model import (
    BoundBy,
    Declaration,
    DraShare,
    EnforcementPolicy,
    LimitPolicy,
    LimitSource,
    LimitValue,
    NamespacePolicy,
    NodeFacts,
    Pod,
)
from gpuguard.core.policy import Decision, EnforcerState, decide
from tests.fakes import GiB, attr, gpu, pod, proc, sample, snapshot

G0 = gpu(0, total=80 * GiB)


def _decide(
    pods: list[Pod],
    procs: list[tuple[int, int | None, int | None]],
    limits: LimitPolicy,
    *,
    replicas: int | None = None,
) -> Decision:
    """One cycle of the real ``decide()`` on ``G0``: ``procs`` are ``(pid, pod n or None for a
    host process, used bytes)``."""
    return decide(
        sample=sample(1, 100.0, [G0], [proc(pid, G0, used) for pid, _, used in procs]),
        attributions={pid: attr(pid, pod_n=n) for pid, n, _ in procs},
        pods=snapshot(pods, contact=100.0),
        node=NodeFacts(name="node-1", replicas=replicas),
        policy=EnforcementPolicy(limits=limits),
        state=EnforcerState(),
        now=100.0,
    )


def _kai(n: int, mib: int) -> Pod:
    return replace(
        pod(n), declared={LimitSource.KAI: Declaration(amount=mib, where="annotation gpu-memory")}
    )


def _dra(n: int, memory: int) -> Pod:
    share = DraShare(
        claim_namespace="team",
        claim_name="claim",
        request="gpu",
        driver="gpu.nvidia.com",
        pool="node-1",
        device="gpu-0",
        share_id="s1",
        memory_bytes=memory,
        uuid=G0.uuid,
    )
    declared = Declaration(where="resourceClaims", shares=(share,), read_at=0.0)
    return replace(pod(n), declared={LimitSource.DRA: declared})


def _max(maximum: int, default: int | None = None) -> LimitPolicy:
    return LimitPolicy(
        namespaces={
            "team": NamespacePolicy(
                max_limit=LimitValue(limit_bytes=maximum),
                default_limit=None if default is None else LimitValue(limit_bytes=default),
            )
        }
    )


@pytest.mark.parametrize(
    ("the_pod", "limits", "replicas", "expected"),
    [
        pytest.param(pod(1, limit=8 * GiB), LimitPolicy(), None, BoundBy.ANNOTATION,
                     id="annotation"),
        pytest.param(
            pod(1), LimitPolicy(cluster_default=LimitValue(limit_bytes=4 * GiB)), None,
            BoundBy.DEFAULT, id="cluster-default",
        ),
        pytest.param(
            pod(1),
            LimitPolicy(namespaces={"team": NamespacePolicy(default_limit=LimitValue(percent=10))}),
            None, BoundBy.DEFAULT, id="namespace-default",
        ),
        pytest.param(pod(1, limit=20 * GiB), _max(10 * GiB), None, BoundBy.NAMESPACE_MAX,
                     id="namespace-max-caps-the-annotation"),
        pytest.param(pod(1, limit=4 * GiB), _max(10 * GiB), None, BoundBy.ANNOTATION,
                     id="annotation-under-the-max"),
        pytest.param(pod(1), _max(10 * GiB), None, BoundBy.NAMESPACE_MAX,
                     id="namespace-max-is-the-only-limit"),
        pytest.param(pod(1), _max(10 * GiB, default=20 * GiB), None, BoundBy.NAMESPACE_MAX,
                     id="namespace-max-caps-the-namespace-default"),
        pytest.param(_kai(1, 8192), LimitPolicy(sources=("gpuguard", "kai")), None, BoundBy.KAI,
                     id="kai"),
        pytest.param(_kai(1, 8192), LimitPolicy(), None, BoundBy.NONE, id="kai-not-listed"),
        pytest.param(_dra(1, 4 * GiB), LimitPolicy(sources=("gpuguard", "dra")), None,
                     BoundBy.DRA, id="dra"),
        pytest.param(pod(1), LimitPolicy(replicas_default=True), 4, BoundBy.REPLICAS,
                     id="replicas"),
        pytest.param(pod(1), LimitPolicy(replicas_default=True), None, BoundBy.NONE,
                     id="replicas-unknown"),
        pytest.param(pod(1), LimitPolicy(), None, BoundBy.NONE, id="nothing"),
        pytest.param(pod(1, limit=100 * GiB), LimitPolicy(), None, BoundBy.NONE,
                     id="a-limit-above-the-device-bounds-nothing"),
        pytest.param(pod(1, namespace="kube-system", limit=8 * GiB), LimitPolicy(), None,
                     BoundBy.NONE, id="exempt"),
    ],
)  # fmt: skip
def test_a_pods_memory_is_bound_by_what_bound_its_limit_and_the_rest_is_unattributed(
    the_pod: Pod, limits: LimitPolicy, replicas: int | None, expected: BoundBy
) -> None:
    decision = _decide(
        [the_pod],
        # The pod's two processes (one N/A: known usage only), a host process, a ghost.
        [(10, 1, 3 * GiB), (11, 1, None), (20, None, 2 * GiB), (30, 9, 1 * GiB)],
        limits,
        replicas=replicas,
    )
    covered = coverage([G0.key], decision.usages, decision.unattributed_bytes)
    want = dict.fromkeys(BoundBy, 0)
    want[expected] = 3 * GiB
    want[BoundBy.UNATTRIBUTED] = 3 * GiB
    assert covered == {
        G0.key: DeviceCoverage(bound_bytes=want, pods_unbounded=int(expected is BoundBy.NONE))
    }


def test_each_device_sums_to_its_known_usage_and_counts_each_unbounded_pod_once() -> None:
    g1 = gpu(1)
    pods = [pod(1, limit=8 * GiB), pod(2), pod(3), pod(4, namespace="kube-system")]
    procs = [
        proc(10, G0, 1 * GiB),
        proc(11, G0, 2 * GiB),  # pod-1's second process
        proc(20, G0, 4 * GiB),
        proc(21, G0, 1 * GiB),  # pod-2's second: one pod, counted once
        proc(30, G0, None),  # pod-3: usage unknown, nothing bounds it
        proc(40, G0, 5 * GiB),  # exempt
        proc(50, G0, 7 * GiB),  # host process
    ]
    owners = {10: 1, 11: 1, 20: 2, 21: 2, 30: 3, 40: 4, 50: None}
    decision = decide(
        sample=sample(1, 100.0, [G0, g1], procs),
        attributions={pid: attr(pid, pod_n=n) for pid, n in owners.items()},
        pods=snapshot(pods, contact=100.0),
        node=NodeFacts(name="node-1"),
        policy=EnforcementPolicy(),
        state=EnforcerState(),
        now=100.0,
    )
    covered = coverage([G0.key, g1.key], decision.usages, decision.unattributed_bytes)

    on_g0 = covered[G0.key]
    assert sum(on_g0.bound_bytes.values()) == 20 * GiB
    assert (on_g0.bound_bytes[BoundBy.ANNOTATION], on_g0.bound_bytes[BoundBy.NONE]) == (
        3 * GiB,
        10 * GiB,
    )
    assert on_g0.bound_bytes[BoundBy.UNATTRIBUTED] == 7 * GiB
    assert on_g0.pods_unbounded == 3, "pod-2, pod-3 (usage unknown) and the exempt pod-4"
    idle = covered[g1.key]
    assert idle.bound_bytes == dict.fromkeys(BoundBy, 0), "every value is there at 0"
    assert idle.pods_unbounded == 0
