"""Other schedulers' declarations enforced end to end (issue 15): pods carrying each scheduler's
fields as that scheduler writes them (KAI's annotation, HAMi's, gpushare's and Volcano's
container limits, through the real kube-apiserver, which rewrites ``3000`` as ``3k``), real
processes in real kubepods cgroups listed by the NVML stand-in, and ``gpuguard enforce`` with
``limits.sources`` listing them: each pod over its declared memory is stopped, each pod within
it is untouched, and the metrics name each limit.
"""

from __future__ import annotations

import pytest

from tests.apiserver import wait_until
from tests.integration.conftest import GIB, Rig, Worker

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel, pytest.mark.nvml_stub]

MIB = 1 << 20
SOURCES = ("gpuguard", "kai", "hami", "gpushare", "volcano")
DECLARED = {
    # name: (annotations, container limits, declared limit in bytes)
    "kai": ({"gpu-memory": "2048"}, None, 2 * GIB),
    "hami": (None, {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000"}, 3000 * MIB),
    "gpushare": (None, {"aliyun.com/gpu-mem": "2"}, 2 * GIB),
    "volcano": (None, {"volcano.sh/vgpu-memory": "2048"}, 2 * GIB),
}


def test_each_schedulers_declaration_is_enforced_and_pods_within_it_are_untouched(
    rig: Rig,
) -> None:
    over: dict[str, Worker] = {}
    within: dict[str, Worker] = {}
    for name, (pod_annotations, limits, _limit) in DECLARED.items():
        for kind, used in (("over", 4 * GIB), ("within", 1 * GIB)):
            info = rig.add_pod(
                f"{name}-{kind}", annotations=pod_annotations, resource_limits=limits
            )
            worker = rig.spawn(info, f"{name}-{kind}", used_bytes=used)
            (over if kind == "over" else within)[name] = worker
    host = rig.spawn(None, "host", used_bytes=8 * GIB)
    stored = rig.cluster.admin_request("GET", f"/api/v1/namespaces/{rig.namespace}/pods/hami-over")
    # What HAMi's pods look like once stored: the quantity the gpuguard translation must read.
    assert stored["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem"] == "3k"

    enforcer = rig.start_enforcer(sources=SOURCES)
    for name, worker in over.items():
        wait_until(
            lambda w=worker: not w.alive(), timeout=30, what=f"the {name} pod over its limit"
        )
        assert worker.received() == ["SIGTERM"], name
    for name, (_annotations, _limits, limit) in DECLARED.items():
        labels = {"namespace": rig.namespace, "pod": f"{name}-within", "container": "main"}
        assert enforcer.metric("gpuguard_pod_gpu_memory_limit_bytes", labels) == float(limit)
    settled = enforcer.settled_events("container_signalled", len(DECLARED))
    signalled = {e["pod"] for e in settled}
    assert signalled == {f"{name}-over" for name in DECLARED}
    for worker in [*within.values(), host]:
        assert worker.received() == []
        assert worker.alive()


def test_without_the_sources_listed_the_same_pods_are_not_limited(rig: Rig) -> None:
    info = rig.add_pod("kai-over", annotations={"gpu-memory": "2048"})
    worker = rig.spawn(info, "kai-over", used_bytes=4 * GIB)
    enforcer = rig.start_enforcer()  # limits.sources = ["gpuguard"], the default
    labels = {"namespace": rig.namespace, "pod": "kai-over"}
    wait_until(
        lambda: enforcer.metric("gpuguard_pod_gpu_memory_used_bytes", labels) == 4 * GIB,
        timeout=20,
        what="the pod's usage in the metrics",
    )
    assert enforcer.metric("gpuguard_pod_gpu_memory_limit_bytes", labels) is None
    assert worker.received() == []
