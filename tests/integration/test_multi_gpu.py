"""Two GPUs on one node (the part CPUs can run): limits apply per device, attribution
and signals follow the device, and the per-GPU metrics carry the right ``gpu``/``UUID`` labels.

The real ``gpuguard enforce`` over the NVML stand-in listing two GPUs; real processes in real
kubepods cgroups; pods in the real API server. The GPU run of the same layout needs a 2-GPU
machine (scripts/gpu_e2e.py --gpu 1 beside a pod on GPU 0).
"""

from __future__ import annotations

import json

import pytest

from rigs.controlplane import wait_until
from rigs.node import GIB, GPU_UUIDS, Rig

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel, pytest.mark.nvml_stub]


def test_greedy_pod_on_gpu1_is_stopped_and_nothing_on_gpu0_or_split_across_gpus_is(
    rig: Rig,
) -> None:
    greedy = rig.add_pod("greedy-gpu1", limit="4Gi")
    calm = rig.add_pod("calm-gpu0", limit="4Gi")
    split = rig.add_pod("split", limit="4Gi")  # 6 GiB in all, but 3 GiB per device
    g = rig.spawn(greedy, "greedy", used_bytes=6 * GIB, gpu=1)
    c = rig.spawn(calm, "calm", used_bytes=3 * GIB, gpu=0)
    s0 = rig.spawn(split, "split0", used_bytes=3 * GIB, gpu=0)
    s1 = rig.spawn(split, "split1", used_bytes=3 * GIB, gpu=1)

    enforcer = rig.start_enforcer()
    labels = {"namespace": split.namespace, "pod": "split", "container": "main"}
    wait_until(
        lambda: (
            enforcer.metric(
                "gpuguard_pod_gpu_memory_used_bytes", {**labels, "gpu": "1", "UUID": GPU_UUIDS[1]}
            )
            == 3 * GIB
        ),
        timeout=20,
        what="split's GPU 1 series",
    )
    assert (
        enforcer.metric(
            "gpuguard_pod_gpu_memory_used_bytes", {**labels, "gpu": "0", "UUID": GPU_UUIDS[0]}
        )
        == 3 * GIB
    )
    assert enforcer.metric(
        "gpuguard_pod_gpu_memory_limit_bytes", {**labels, "gpu": "0", "GPU_I_ID": ""}
    ) == float(4 * GIB)

    wait_until(lambda: not g.alive(), timeout=30, what="the greedy process on GPU 1 to stop")
    assert g.received() == ["SIGTERM"]
    signalled = enforcer.settled_events("container_signalled", 1)
    assert [(e["pod"], e["gpu"], e["pids"]) for e in signalled] == [("greedy-gpu1", 1, [g.pid])]
    for bystander in (c, s0, s1):
        assert bystander.received() == []
        assert bystander.alive()
    # The stopped pod's series are gone at the next scrape; the others stay.
    wait_until(
        lambda: (
            enforcer.metric("gpuguard_pod_gpu_memory_used_bytes", {"pod": "greedy-gpu1"}) is None
        ),
        timeout=10,
        what="the stopped pod's series to disappear",
    )
    assert (
        enforcer.metric("gpuguard_pod_gpu_memory_used_bytes", {"pod": "calm-gpu0", "gpu": "0"})
        == 3 * GIB
    )
    assert enforcer.metric("gpuguard_kills_total") == 1.0


def test_a_worker_the_test_reaped_first_still_leaves_the_nvml_listing(rig: Rig) -> None:
    """The rig's "driver" frees an exited worker's memory whoever reaps it: a test that calls
    ``alive()`` before the driver's next pass must not leave the process listed forever (the
    race behind a flaky multi-GPU run, where the enforcer saw "still 6Gi after SIGKILL")."""
    worker = rig.spawn(None, "reaped", used_bytes=1 * GIB, gpu=1)

    def listed() -> set[int]:
        doc = json.loads(rig.scenario.path.read_text(encoding="utf-8"))
        return {p["pid"] for d in doc["devices"] for p in d["processes"]}

    assert worker.pid in listed()
    with rig._lock:  # the driver is held off: the test, not the driver, sees the exit
        worker.proc.kill()
        worker.proc.wait()
    wait_until(
        lambda: worker.pid not in listed(), timeout=5, what="the reaped worker to be unlisted"
    )
