"""Other schedulers' declarations enforced end to end: pods carrying each scheduler's
fields as that scheduler writes them (KAI's annotation, HAMi's, gpushare's and Volcano's
container limits, through the real kube-apiserver, which rewrites ``3000`` as ``3k``), real
processes in real kubepods cgroups listed by the NVML stand-in, and ``gpuguard enforce`` with
``limits.sources`` listing them: each pod over its declared memory is stopped, each pod within
it is untouched, and the metrics name each limit. A pin a tenant writes itself, naming a GPU it
does not use, escapes nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rigs.controlplane import wait_until
from rigs.node import GIB, GPU_UUIDS, Rig, Worker
from tests.integration.oracle import Oracle, Role

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


def _with_admin_limits(rig: Rig, *, cluster_default: str, namespace_max: str) -> None:
    """Every config the rig writes from here on also carries a cluster default and a maximum
    for the test's namespace (the rig's config has no such knob)."""
    write = rig.config

    def config(**kwargs: Any) -> Path:
        path = write(**kwargs)
        text = path.read_text().replace(
            "\n[metrics]\n", f'\ndefault = "{cluster_default}"\n[metrics]\n', 1
        )
        table = f'[limits.namespaces.{rig.namespace}]\nmax = "{namespace_max}"\n'
        path.write_text(text + table)
        return path

    rig.config = config  # type: ignore[method-assign]


def test_a_self_written_pin_naming_another_gpu_escapes_no_limit(rig: Rig) -> None:
    """An escape through a self-written pin: with a cluster default and a namespace max, pods that
    write HAMi's or gpushare's pin themselves, naming GPU 1, and use 25 GiB on GPU 0 were never
    signalled ("memory on an unassigned device": reported, never stopped). Their schedulers'
    declarations grant them nothing on GPU 0; the cluster default holds them there, and they
    are stopped. Their neighbours on GPU 0 are untouched, and the finding is still reported."""
    _with_admin_limits(rig, cluster_default="8Gi", namespace_max="16Gi")
    oracle = Oracle()
    forged = {
        # name: (container limits, the pin the tenant writes after creation)
        "forged-hami": (
            {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "40000"},
            {"hami.io/vgpu-devices-allocated": f"{GPU_UUIDS[1]},NVIDIA,40000,100:;"},
        ),
        "forged-gpushare": ({"aliyun.com/gpu-mem": "40"}, {"ALIYUN_COM_GPU_MEM_IDX": "1"}),
    }
    offenders: dict[str, Worker] = {}
    infos = {}
    for name, (limits, pin) in forged.items():
        info = infos[name] = rig.add_pod(name, resource_limits=limits)
        # The tenant writes the pin itself: pod metadata it may patch.
        rig.cluster.patch_pod(rig.namespace, name, {"metadata": {"annotations": pin}})
        worker = rig.spawn(info, name, used_bytes=25 * GIB, gpu=0)
        oracle.add(worker, Role.OFFENDER, namespace=rig.namespace, pod=name, expect_stopped=True)
        offenders[name] = worker
    # Neighbours on GPU 0: a HAMi pod truly pinned there, within its declaration, and a pod
    # whose own 30Gi is capped by the namespace max, within it.
    hami_pod = rig.add_pod(
        "hami-gpu0",
        annotations={"hami.io/vgpu-devices-allocated": f"{GPU_UUIDS[0]},NVIDIA,4096,100:;"},
        resource_limits={"nvidia.com/gpu": "1", "nvidia.com/gpumem": "4096"},
    )
    hami_worker = rig.spawn(hami_pod, "hami-gpu0", used_bytes=3 * GIB, gpu=0)
    oracle.add(hami_worker, Role.BYSTANDER, namespace=rig.namespace, pod="hami-gpu0")
    calm_pod = rig.add_pod("calm", limit="30Gi")
    calm = rig.spawn(calm_pod, "calm", used_bytes=12 * GIB, gpu=0)
    oracle.add(calm, Role.BYSTANDER, namespace=rig.namespace, pod="calm")

    enforcer = rig.start_enforcer(sources=("gpuguard", "hami", "gpushare"))
    for name, worker in offenders.items():
        wait_until(lambda w=worker: not w.alive(), timeout=30, what=f"{name} to be stopped")
    signalled = enforcer.settled_events("container_signalled", len(offenders))
    assert {(e["pod"], e["gpu"], e["limit_bytes"]) for e in signalled} == {
        (name, 0, 8 * GIB) for name in offenders
    }, "held on GPU 0 to the cluster default"
    oracle.check(rig.enforcers)
    # Still reported: memory on a GPU its scheduler did not assign it, once per pod and GPU.
    for name in offenders:
        found = enforcer.wait_for("violation_refused", pod=name, reason="unassigned_device")
        assert "held here to 8Gi (from default)" in found["detail"]
    for name, info in infos.items():
        wait_until(
            lambda i=info: "GPUMemoryOnUnassignedDevice" in rig.event_reasons(i),
            timeout=20,
            what=f"the GPUMemoryOnUnassignedDevice Event on {name}",
        )
    # The neighbours: their limits as their declarations and the max say, untouched.
    for pod, limit in (("hami-gpu0", 4096 << 20), ("calm", 16 * GIB)):
        labels = {"namespace": rig.namespace, "pod": pod, "gpu": "0"}
        assert enforcer.metric("gpuguard_pod_gpu_memory_limit_bytes", labels) == float(limit)
    assert hami_worker.alive()
    assert calm.alive()
