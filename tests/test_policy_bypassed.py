"""``enforcement_bypassed`` (docs/schedulers.md, Where each scheduler enforces by itself): a
violation of a declaration a scheduler's own in-pod cap enforces (HAMi's ``nvidia.com/gpumem``
through HAMi-core; a container's own KAI declaration through KAI's NvFractions runtime) means
that cap is missing or was bypassed. ``decide()`` says so on the stop (``KillTarget.bypassed``)
and in the ``GPUMemoryLimitExceeded`` Event, the enforcer in the ``GPUProcessKilled`` Event and
the ``container_signalled`` log, and the container is stopped as any other; a violation of
anything no in-pod cap enforces (gpuguard's annotation, a default, the namespace maximum, KAI's
pod-wide value, gpushare, Volcano) is never called bypassed."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from gpuguard.core.limits import in_pod_cap, resolve_limit
from gpuguard.core.model import (
    EventReason,
    InPodCap,
    LimitPolicy,
    LimitValue,
    NamespacePolicy,
    Pod,
    ProcessIdentity,
    SignalReport,
    StopSignal,
)
from gpuguard.kubemodel.declared import declarations
from gpuguard.runtime.enforcer import _killed_event, _over_limit
from tests.fakes import GiB, attr, pod, proc
from tests.policy_timeline import G0, POLICY, Timeline

SOURCES = ("gpuguard", "kai", "hami", "gpushare", "volcano")


def declared(
    annotations: dict[str, str] | None = None,
    limits: dict[str, str] | None = None,
    *,
    limit: int | None = None,
) -> Pod:
    """Pod 1 (containers ``c0``, ``c1``) with these annotations and ``c0``'s resource limits."""
    manifest: dict[str, Any] = {
        "metadata": {"annotations": annotations or {}},
        "spec": {
            "containers": [{"name": "c0", "resources": {"limits": limits or {}}}, {"name": "c1"}]
        },
    }
    return replace(pod(1, containers=2, limit=limit), declared=declarations(manifest))


CASES = [
    pytest.param(declared(limits={"nvidia.com/gpumem": "4096"}), InPodCap.HAMI_CORE, id="hami"),
    pytest.param(
        declared({"nvidia.com/container.c0.gpu-memory.limit": "4Gi"}),
        InPodCap.KAI_NVFRACTIONS,
        id="kai per-container",
    ),
    pytest.param(declared({"gpu-memory": "4096"}), None, id="kai pod-wide: HamiCore unknown"),
    pytest.param(declared(limits={"aliyun.com/gpu-mem": "4"}), None, id="gpushare"),
    pytest.param(declared(limit=4 * GiB), None, id="gpuguard's annotation"),
    pytest.param(
        declared(limits={"nvidia.com/gpumem": "8192"}, limit=4 * GiB),
        None,
        id="the tenant's smaller annotation binds, not HAMi's",
    ),
]


@pytest.mark.parametrize(("p", "cap"), CASES)
def test_a_violation_is_called_bypassed_only_where_an_in_pod_cap_binds(
    p: Pod, cap: InPodCap | None
) -> None:
    t = Timeline(
        devices=[G0],
        pods=[p],
        attributions={101: attr(101, pod_n=1, container=0)},
        policy=replace(POLICY, limits=LimitPolicy(sources=SOURCES)),
    )
    decisions = [t.step([proc(101, G0, 5 * GiB)]) for _ in range(3)]
    targets = [a.target for d in decisions for a in d.signals]
    assert [x.container_name for x in targets] == ["c0"]  # stopped either way
    assert targets[0].bypassed is cap
    (event,) = [e for d in decisions for e in d.events if e.reason is EventReason.LIMIT_EXCEEDED]
    assert ("enforcement_bypassed" in event.message) is (cap is not None)
    if cap is not None:
        assert f"enforcement_bypassed: {cap.value}" in event.message


def test_the_namespace_maximum_binding_is_never_called_bypassed() -> None:
    p = declared(limits={"nvidia.com/gpumem": "8192"})
    policy = LimitPolicy(
        sources=SOURCES,
        namespaces={"team": NamespacePolicy(max_limit=LimitValue(limit_bytes=4 * GiB))},
    )
    limit = resolve_limit(pod=p, device_total_bytes=80 * GiB, policy=policy, replicas=None)
    assert (limit.limit_bytes, limit.namespace_max) == (4 * GiB, True)
    assert in_pod_cap(limit) is None


def test_the_killed_event_and_the_log_carry_enforcement_bypassed() -> None:
    t = Timeline(
        devices=[G0],
        pods=[declared({"nvidia.com/container.c0.gpu-memory.limit": "4Gi"})],
        attributions={101: attr(101, pod_n=1, container=0), 102: attr(102, pod_n=1, container=1)},
        policy=replace(POLICY, limits=LimitPolicy(sources=SOURCES)),
    )
    decisions = [t.step([proc(101, G0, 5 * GiB), proc(102, G0, 1 * GiB)]) for _ in range(3)]
    (action,) = [a for d in decisions for a in d.signals]
    assert action.target.own_limit is not None  # stopped alone, for its own limit
    report = SignalReport(
        signal=StopSignal.TERM, delivered=(ProcessIdentity(pid=101, start_ticks=1),)
    )
    message = _killed_event(action, report).message
    assert "enforcement_bypassed: kai-nvfractions" in message
    assert _over_limit(action.target)["enforcement_bypassed"] == "kai-nvfractions"
