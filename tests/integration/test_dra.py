"""DRA memory shares enforced end to end, on real parts: the real kube-apiserver,
kube-controller-manager (ResourceClaim controller on) and kube-scheduler v1.37.2, kwok as the
kubelet of one GPU node, NVIDIA's DeviceClass and the node's ResourceSlice exactly as the DRA
driver publishes them with ``--consumable-shares=memory``, claim templates asking for memory
shares. The real controller-manager makes each pod's claim, the real scheduler allocates a share
of a GPU (``consumedCapacity.memory``, a ``shareID``), kwok runs the pod; real processes in its
container's real cgroup are listed by the NVML stand-in on the GPU the claim names (by its
``uuid`` attribute), and the real ``gpuguard enforce --mode enforce`` with ``limits.sources =
["gpuguard", "dra"]`` holds each pod to its share, and the pods sharing one claim together to
it. Every test ends with the suite's oracle: no process received a signal it should not have.

Each test gets its own kwok node (with its own slice) and namespace on one control plane per
module (``rigs/dra_cluster.py``); missing binaries skip locally and fail under
``CI=true``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rigs import dra_objects
from rigs.controlplane import wait_until
from rigs.dra_cluster import (
    RESOURCE_API,
    DraCluster,
    DraRig,
    fresh_dra_rig,
)
from rigs.dra_objects import H100_PROFILES, MIB, MigProfile, mig_device_name
from rigs.node import GIB, GPU_UUIDS, EnforcerProcess, PodInfo, Worker
from tests.integration.oracle import Oracle, Role

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel, pytest.mark.nvml_stub]

SOURCES = ("gpuguard", "dra")
LIMIT = "gpuguard_pod_gpu_memory_limit_bytes"
USED = "gpuguard_pod_gpu_memory_used_bytes"


@pytest.fixture
def rig(dra: DraCluster, stub_lib: Path, device_node: Path, tmp_path: Path) -> Iterator[DraRig]:
    """A fresh kwok GPU node with its ResourceSlice, a fresh namespace, the integration rig."""
    with fresh_dra_rig(dra, stub_lib=stub_lib, device_node=device_node, workdir=tmp_path) as r:
        yield r


def dra_pod(
    dra: DraCluster,
    rig: DraRig,
    name: str,
    *,
    template: str | None = None,
    claim: str | None = None,
) -> PodInfo:
    """A pod the scheduler places on the rig's node with its claim ``gpu``, once kwok runs it."""
    dra.add_pod(rig.namespace, name, node=rig.node, template=template, claim=claim)
    return dra.running_pod(rig.namespace, name)


def on_its_share(dra: DraCluster, rig: DraRig, pod: PodInfo, used_bytes: int) -> Worker:
    """A worker in the pod's container, on the GPU the scheduler gave its claim."""
    (share,) = dra.shares(pod.namespace, pod.name)
    return rig.spawn(pod, pod.name, used_bytes=used_bytes, gpu=share.gpu)


def labels(rig: DraRig, pod: str, gpu: int) -> dict[str, str]:
    return {"namespace": rig.namespace, "pod": pod, "gpu": str(gpu)}


def metric_is(
    enforcer: EnforcerProcess, name: str, want: float | None, lbl: dict[str, str]
) -> Callable[[], bool]:
    return lambda: enforcer.metric(name, lbl) == want


def stay_untouched(workers: list[Worker], seconds: float) -> None:
    """Nothing reaches ``workers`` for ``seconds`` (longer than the grace period and polls)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for w in workers:
            assert w.received() == [], f"{w.name} received {w.received()}"
            assert w.alive(), f"{w.name} died"
        time.sleep(0.05)


def test_a_pod_over_its_share_is_stopped_and_one_within_its_share_on_the_same_gpu_is_not(
    dra: DraCluster, rig: DraRig
) -> None:
    """(a), (b): two pods share GPU 0 by memory shares the scheduler accounted (4Gi, 8Gi). The
    one over its 4Gi share (6 GiB) is stopped, SIGTERM ends its real process; the one at 7 GiB,
    within its 8Gi share but over the other's, is untouched: each pod is held to its own
    share. A host process with 40 GiB is nobody's."""
    ns = rig.namespace
    dra.add_template(ns, "share-4gi", "4Gi", gpu=0)
    dra.add_template(ns, "share-8gi", "8Gi", gpu=0)
    greedy = dra_pod(dra, rig, "greedy", template="share-4gi")
    modest = dra_pod(dra, rig, "modest", template="share-8gi")
    for pod, memory in ((greedy, "4Gi"), (modest, "8Gi")):
        (share,) = dra.shares(ns, pod.name)
        assert (share.device, share.memory) == ("gpu-0", memory), share
        assert share.share_id, "a multi-allocatable device's result carries a shareID"
    oracle = Oracle()
    over = on_its_share(dra, rig, greedy, 6 * GIB)
    within = on_its_share(dra, rig, modest, 7 * GIB)
    host = rig.spawn(None, "host", used_bytes=40 * GIB)
    oracle.add(over, Role.OFFENDER, namespace=ns, pod="greedy", expect_stopped=True)
    oracle.add(within, Role.BYSTANDER, namespace=ns, pod="modest")
    oracle.add(host, Role.HOST)

    enforcer = rig.start_enforcer(sources=SOURCES)
    wait_until(lambda: not over.alive(), timeout=30, what="the pod over its share to be stopped")
    assert over.received() == ["SIGTERM"]
    assert over.proc.returncode == 143, "its real process ended from its SIGTERM handler"
    (signalled,) = enforcer.settled_events("container_signalled", 1)
    assert (signalled["pod"], signalled["gpu"], signalled["limit_bytes"]) == ("greedy", 0, 4 * GIB)
    assert enforcer.metric(LIMIT, labels(rig, "modest", 0)) == 8 * GIB
    stay_untouched([within, host], 2.0)
    wait_until(
        lambda: "GPUMemoryLimitExceeded" in rig.event_reasons(greedy),
        timeout=15,
        what="the GPUMemoryLimitExceeded Event on the pod over its share",
    )
    assert rig.pod_events(modest) == []
    oracle.check(rig.enforcers)


def test_a_whole_gpu_on_a_dynamic_mig_node_is_held_to_the_gpus_memory_not_its_largest_profile(
    dra: DraCluster, rig: DraRig
) -> None:
    """With the driver's DynamicMIG feature on, the slice advertises a full GPU's ``memory`` as
    its largest MIG profile's (79Gi of the rig's 80 GiB GPUs). A claim asking for no memory
    gets the whole GPU, and the real scheduler writes that it consumed those 79Gi. The pod was
    given the whole GPU: at 79.5 GiB (over the advertised 79Gi, within the GPU's 80 GiB, so
    under memory pressure too) it is held to the GPU's real memory and never signalled."""
    ns = rig.namespace
    dra.publish_dynamic_mig_slices(rig.node, generation=2)
    dra.add_template(ns, "whole", None, gpu=0)
    pod = dra_pod(dra, rig, "whole", template="whole")
    (share,) = dra.shares(ns, "whole")
    assert (share.device, share.memory) == ("gpu-0", "79Gi"), share
    oracle = Oracle()
    worker = on_its_share(dra, rig, pod, 80 * GIB - GIB // 2)
    oracle.add(worker, Role.BYSTANDER, namespace=ns, pod="whole")

    enforcer = rig.start_enforcer(sources=SOURCES)
    wait_until(
        metric_is(enforcer, USED, 80 * GIB - GIB // 2, labels(rig, "whole", 0)),
        timeout=15,
        what="the pod's usage listed",
    )
    stay_untouched([worker], 3.0)  # three times the grace period
    assert enforcer.events("container_signalled") == []
    assert enforcer.metric(LIMIT, labels(rig, "whole", 0)) == 80 * GIB
    oracle.check(rig.enforcers)


MIG_A = "MIG-a1a1a1a1-0000-4000-8000-000000000001"
MIG_B = "MIG-b2b2b2b2-0000-4000-8000-000000000002"
MIG_C = "MIG-c3c3c3c3-0000-4000-8000-000000000003"
DRIVER = dra_objects.DRIVER
THREE_G = H100_PROFILES[1]  # 3g.40gb: placements 0 and 4
ONE_G = H100_PROFILES[0]  # 1g.10gb


def instance(slot: int, gi: int, uuid: str, profile: MigProfile, start: int) -> dict[str, Any]:
    """A MIG instance of the stand-in's GPU 1, with what nvmlGpuInstanceGetInfo answers."""
    return {
        "slot": slot, "gi": gi, "ci": 0, "uuid": uuid, "total_bytes": profile.memory_mib * MIB,
        "name": f"NVIDIA H200 MIG {profile.name}", "profile_id": profile.profile_id,
        "placement_start": start, "placement_size": dict(profile.placements)[start],
    }  # fmt: skip


def mig_labels(rig: DraRig, pod: str, gi: int) -> dict[str, str]:
    return {**labels(rig, pod, 1), "GPU_I_ID": str(gi)}


def test_a_share_of_a_static_mig_device_holds_the_pod_on_that_instance_alone(
    dra: DraCluster, rig: DraRig
) -> None:
    """Static MIG: GPU 1 is cut into two 3g.40gb instances, published with their own ``uuid``.
    The real scheduler hands out a 4Gi share of instance A (picked by its uuid) and all of
    instance B. The pod over its 4Gi share on A is stopped; the pod holding all of B, at
    38 GiB, is held to B's memory and untouched: A's share caps nothing on B (a share is mapped
    by the MIG device's own uuid, never by its parentUUID)."""
    ns = rig.namespace
    rig.set_mig(1, [instance(0, 1, MIG_A, THREE_G, 0), instance(1, 2, MIG_B, THREE_G, 4)])
    dra.publish_static_mig_slice(rig.node, 2, [(THREE_G, 0, MIG_A), (THREE_G, 4, MIG_B)])
    dra.add_mig_template(ns, "a-4gi", "4Gi", f"device.attributes['{DRIVER}'].uuid == '{MIG_A}'")
    dra.add_mig_template(ns, "all-of-b", None, f"device.attributes['{DRIVER}'].uuid == '{MIG_B}'")
    greedy = dra_pod(dra, rig, "greedy", template="a-4gi")
    whole = dra_pod(dra, rig, "whole", template="all-of-b")
    a_name, b_name = (mig_device_name(1, THREE_G, start) for start in (0, 4))
    assert [(s.device, s.memory) for s in dra.shares(ns, "greedy")] == [(a_name, "4Gi")]
    assert [(s.device, s.memory) for s in dra.shares(ns, "whole")] == [(b_name, "40448Mi")]
    oracle = Oracle()
    over = rig.spawn(greedy, "greedy", used_bytes=6 * GIB, gpu=1, mig_slot=0)
    big = rig.spawn(whole, "whole", used_bytes=38 * GIB, gpu=1, mig_slot=1)
    oracle.add(over, Role.OFFENDER, namespace=ns, pod="greedy", expect_stopped=True)
    oracle.add(big, Role.BYSTANDER, namespace=ns, pod="whole")

    enforcer = rig.start_enforcer(sources=SOURCES)
    wait_until(lambda: not over.alive(), timeout=30, what="the pod over its MIG share stopped")
    assert over.received() == ["SIGTERM"]
    (signalled,) = enforcer.settled_events("container_signalled", 1)
    assert (signalled["pod"], signalled["limit_bytes"]) == ("greedy", 4 * GIB)
    assert enforcer.metric(LIMIT, mig_labels(rig, "whole", 2)) == THREE_G.memory_mib * MIB
    stay_untouched([big], 2.0)
    oracle.check(rig.enforcers)


def test_a_share_of_a_dynamic_mig_device_holds_the_instance_of_its_profile_and_placement(
    dra: DraCluster, rig: DraRig
) -> None:
    """DynamicMIG: the slices list every profile and placement GPU 1 can be cut into, with no
    ``uuid``. The real scheduler gives a 4Gi share of one 1g.10gb device and a 2Gi share of
    another (a MIG device's other capacities carry no request policy, so one share takes the
    whole device from the scheduler). The driver makes those instances when it prepares the
    claims: here the stand-in lists them with their profile and placement, beside a third one.
    The pod over its 4Gi share is stopped on its instance; the pod within 2Gi on the other is
    not, and neither is a host process on the third: each share holds the instance of its own
    profile and placement alone."""
    ns = rig.namespace
    dra.publish_dynamic_mig_slices(rig.node, generation=2)
    one_g = (
        f"device.attributes['{DRIVER}'].profile == '{ONE_G.name}' && "
        f"device.attributes['{DRIVER}'].parentUUID == '{GPU_UUIDS[1]}'"
    )
    dra.add_mig_template(ns, "mig-4gi", "4Gi", one_g)
    greedy = dra_pod(dra, rig, "greedy", template="mig-4gi")
    dra.add_mig_template(ns, "mig-2gi", "2Gi", one_g)
    modest = dra_pod(dra, rig, "modest", template="mig-2gi")
    starts = []
    for pod, memory in ((greedy, "4Gi"), (modest, "2Gi")):
        (share,) = dra.shares(ns, pod.name)
        start = int(share.device.rsplit("-", 1)[1])
        assert (share.device, share.memory) == (mig_device_name(1, ONE_G, start), memory)
        starts.append(start)
    spare = next(s for s, _ in ONE_G.placements if s not in starts)
    rig.set_mig(
        1,
        [
            instance(0, 7, MIG_A, ONE_G, starts[0]),
            instance(1, 8, MIG_B, ONE_G, starts[1]),
            instance(2, 9, MIG_C, ONE_G, spare),
        ],
    )
    oracle = Oracle()
    over = rig.spawn(greedy, "greedy", used_bytes=5 * GIB, gpu=1, mig_slot=0)
    within = rig.spawn(modest, "modest", used_bytes=3 * GIB // 2, gpu=1, mig_slot=1)
    host = rig.spawn(None, "host", used_bytes=9 * GIB, gpu=1, mig_slot=2)
    oracle.add(over, Role.OFFENDER, namespace=ns, pod="greedy", expect_stopped=True)
    oracle.add(within, Role.BYSTANDER, namespace=ns, pod="modest")
    oracle.add(host, Role.HOST)

    enforcer = rig.start_enforcer(sources=SOURCES)
    wait_until(lambda: not over.alive(), timeout=30, what="the pod over its MIG share stopped")
    (signalled,) = enforcer.settled_events("container_signalled", 1)
    assert (signalled["pod"], signalled["limit_bytes"]) == ("greedy", 4 * GIB)
    assert enforcer.metric(LIMIT, mig_labels(rig, "modest", 8)) == 2 * GIB
    stay_untouched([within, host], 2.0)
    oracle.check(rig.enforcers)


def test_a_claim_two_pods_share_still_holds_each_of_them_to_the_whole_share(
    dra: DraCluster, rig: DraRig
) -> None:
    """A claim two pods name (``resourceClaimName``) is one 4Gi share the scheduler counted
    once, reserved for both. Each pod is still held to the whole share on its own: at 1.5 GiB
    each (3 GiB together, within the share) neither is touched; the one that grows to 5 GiB is
    over the share by itself and is stopped for its own limit, the other is not."""
    ns = rig.namespace
    dra.add_claim(ns, "shared", "4Gi", gpu=0)
    first = dra_pod(dra, rig, "first", claim="shared")
    second = dra_pod(dra, rig, "second", claim="shared")
    for pod in (first, second):
        (share,) = dra.shares(ns, pod.name)
        assert (share.device, share.memory) == ("gpu-0", "4Gi"), share
    oracle = Oracle()
    calm = on_its_share(dra, rig, first, 3 * GIB // 2)
    grows = on_its_share(dra, rig, second, 3 * GIB // 2)
    oracle.add(calm, Role.BYSTANDER, namespace=ns, pod="first")
    oracle.add(grows, Role.OFFENDER, namespace=ns, pod="second", expect_stopped=True)

    enforcer = rig.start_enforcer(sources=SOURCES)
    for name in ("first", "second"):
        wait_until(
            metric_is(enforcer, LIMIT, 4 * GIB, labels(rig, name, 0)),
            timeout=15,
            what=f"{name} held to the whole shared 4Gi",
        )
    stay_untouched([calm, grows], 3.0)
    rig.set_usage(grows, 5 * GIB)
    wait_until(lambda: not grows.alive(), timeout=30, what="the pod past the shared share stopped")
    (signalled,) = enforcer.settled_events("container_signalled", 1)
    assert (signalled["pod"], signalled["limit_bytes"]) == ("second", 4 * GIB)
    stay_untouched([calm], 2.0)
    oracle.check(rig.enforcers)


def test_three_pods_sharing_one_claim_are_held_together_to_its_share_largest_first(
    dra: DraCluster, rig: DraRig
) -> None:
    """Three pods name one 6Gi claim (``resourceClaimName``): the scheduler counted the share
    once, so it is what the three may use together on its GPU. Together within it (1.5 + 2 +
    1.5 GiB) nobody is signalled, however long. When one grows to 3.5 GiB (6.5 GiB together,
    each still within the whole share on its own) the group is over: the real enforcer stops the
    largest user, and the two small ones, which fit the share with it gone, are untouched."""
    ns = rig.namespace
    dra.add_claim(ns, "team", "6Gi", gpu=0)
    pods = [dra_pod(dra, rig, name, claim="team") for name in ("ann", "bob", "cid")]
    for pod in pods:
        (share,) = dra.shares(ns, pod.name)
        assert (share.device, share.memory) == ("gpu-0", "6Gi"), share
    reserved = dra.get(f"{RESOURCE_API}/namespaces/{ns}/resourceclaims/team")["status"]
    assert sorted(r["name"] for r in reserved["reservedFor"]) == ["ann", "bob", "cid"]
    oracle = Oracle()
    ann = on_its_share(dra, rig, pods[0], 3 * GIB // 2)
    bob = on_its_share(dra, rig, pods[1], 2 * GIB)
    cid = on_its_share(dra, rig, pods[2], 3 * GIB // 2)
    oracle.add(ann, Role.BYSTANDER, namespace=ns, pod="ann")
    oracle.add(bob, Role.OFFENDER, namespace=ns, pod="bob", expect_stopped=True)
    oracle.add(cid, Role.BYSTANDER, namespace=ns, pod="cid")

    enforcer = rig.start_enforcer(sources=SOURCES, grace_seconds=2.0)
    for name in ("ann", "bob", "cid"):
        wait_until(
            metric_is(enforcer, LIMIT, 6 * GIB, labels(rig, name, 0)),
            timeout=15,
            what=f"{name} held to the whole shared 6Gi",
        )
    stay_untouched([ann, bob, cid], 5.0)  # 5 GiB of 6Gi: more than twice the grace period
    assert enforcer.events("container_signalled") == []

    rig.set_usage(bob, 7 * GIB // 2)
    wait_until(lambda: not bob.alive(), timeout=30, what="the largest sharer stopped")
    assert bob.received() == ["SIGTERM"]
    (signalled,) = enforcer.settled_events("container_signalled", 1)
    assert signalled["pod"] == "bob"
    assert (signalled["used_bytes"], signalled["limit_bytes"]) == (13 * GIB // 2, 6 * GIB)
    wait_until(
        lambda: "GPUMemoryShareExceeded" in rig.event_reasons(pods[1]),
        timeout=15,
        what="the GPUMemoryShareExceeded Event on the pod stopped for the group",
    )
    stay_untouched([ann, cid], 3.0)
    assert rig.pod_events(pods[0]) == []
    assert rig.pod_events(pods[2]) == []
    oracle.check(rig.enforcers)


def test_memory_on_a_gpu_its_claims_did_not_allocate_is_reported_and_held_to_the_default(
    dra: DraCluster, rig: DraRig
) -> None:
    """(c): a pod whose claim holds a 4Gi share of GPU 1 uses 10 GiB of GPU 0. Its share grants
    nothing on GPU 0 and caps nothing there: it is reported (refusal ``unassigned_device``, the
    Event) and held on GPU 0 to the cluster default, 8Gi, so it is stopped. Its neighbour,
    within its own share of GPU 1, is held to that share and untouched."""
    rig.default = "8Gi"
    ns = rig.namespace
    dra.add_template(ns, "gpu1-4gi", "4Gi", gpu=1)
    stray = dra_pod(dra, rig, "stray", template="gpu1-4gi")
    home = dra_pod(dra, rig, "home", template="gpu1-4gi")
    assert [s.device for s in dra.shares(ns, "stray")] == ["gpu-1"]
    oracle = Oracle()
    offender = rig.spawn(stray, "stray", used_bytes=10 * GIB, gpu=0)
    neighbour = on_its_share(dra, rig, home, 3 * GIB)
    oracle.add(offender, Role.OFFENDER, namespace=ns, pod="stray", expect_stopped=True)
    oracle.add(neighbour, Role.BYSTANDER, namespace=ns, pod="home")

    enforcer = rig.start_enforcer(sources=SOURCES)
    wait_until(lambda: not offender.alive(), timeout=30, what="the stray pod to be stopped")
    (signalled,) = enforcer.settled_events("container_signalled", 1)
    assert (signalled["pod"], signalled["gpu"], signalled["limit_bytes"]) == ("stray", 0, 8 * GIB)
    found = enforcer.wait_for("violation_refused", pod="stray", reason="unassigned_device")
    assert "held here to 8Gi (from default)" in found["detail"], found
    wait_until(
        lambda: "GPUMemoryOnUnassignedDevice" in rig.event_reasons(stray),
        timeout=20,
        what="the GPUMemoryOnUnassignedDevice Event",
    )
    refused = enforcer.metric("gpuguard_refusals_total", {"reason": "unassigned_device"})
    assert refused is not None
    assert refused >= 1
    assert enforcer.metric(LIMIT, labels(rig, "home", 1)) == 4 * GIB
    stay_untouched([neighbour], 1.5)
    oracle.check(rig.enforcers)


def test_a_share_deallocated_and_allocated_again_elsewhere_is_read_anew(
    dra: DraCluster, rig: DraRig
) -> None:
    """(d): the tenant's claim ``team`` (6Gi) is allocated on GPU 0 for pod ``first`` (GPU 1
    is nearly full). ``first`` ends: the controller deallocates ``team``. GPU 0 then fills
    and ``second`` gets ``team`` on GPU 1, another share. The enforcer must forget the old
    share: ``second`` at 5 GiB on GPU 1 is within its share there. Held to where ``team``
    used to be, GPU 1 would be an unassigned device, the 2Gi default would hold it, and it
    would be stopped."""
    rig.default = "2Gi"
    ns = rig.namespace
    dra.add_template(ns, "fill-gpu1", "78Gi", gpu=1)
    dra.add_template(ns, "fill-gpu0", "78Gi", gpu=0)
    dra.add_claim(ns, "team", "6Gi")
    dra_pod(dra, rig, "filler-1", template="fill-gpu1")
    first = dra_pod(dra, rig, "first", claim="team")
    (before,) = dra.shares(ns, "first")
    assert before.device == "gpu-0"
    oracle = Oracle()
    w1 = on_its_share(dra, rig, first, 5 * GIB)
    oracle.add(w1, Role.BYSTANDER, namespace=ns, pod="first")

    enforcer = rig.start_enforcer(sources=SOURCES)
    wait_until(
        metric_is(enforcer, LIMIT, 6 * GIB, labels(rig, "first", 0)),
        timeout=30,
        what="first's 6Gi share on GPU 0 in the metrics",
    )
    # first's container ends (the runtime stops it), then the pod goes.
    w1.proc.kill()
    oracle.sent_by_test(w1, "KILL")
    w1.proc.wait()
    dra.cluster.delete_pod(ns, "first")
    claim_path = f"{RESOURCE_API}/namespaces/{ns}/resourceclaims/team"
    wait_until(
        lambda: not dra.get(claim_path).get("status", {}).get("allocation"),
        timeout=30,
        what="the claim controller to deallocate team",
    )
    dra.cluster.delete_pod(ns, "filler-1")
    dra_pod(dra, rig, "filler-0", template="fill-gpu0")
    second = dra_pod(dra, rig, "second", claim="team")
    (after,) = dra.shares(ns, "second")
    assert after.device == "gpu-1", (before, after)
    assert after.share_id != before.share_id
    w2 = on_its_share(dra, rig, second, 5 * GIB)
    oracle.add(w2, Role.BYSTANDER, namespace=ns, pod="second")
    wait_until(
        metric_is(enforcer, LIMIT, 6 * GIB, labels(rig, "second", 1)),
        timeout=30,
        what="second's share on GPU 1 in the metrics",
    )
    stay_untouched([w2], 2.5)
    assert enforcer.events("violation_refused", pod="second") == []
    oracle.check(rig.enforcers)


def test_a_claim_its_owner_deletes_still_holds_its_running_pod(
    dra: DraCluster, rig: DraRig
) -> None:
    """(e), first half: a tenant's DELETE of a running pod's claim only marks it (the
    finalizer keeps it, allocated, until the pod is gone): the share is still the
    scheduler's account, so the pod is still held to it and stopped when it goes over."""
    ns = rig.namespace
    dra.add_template(ns, "share-4gi", "4Gi")
    pod = dra_pod(dra, rig, "leaver", template="share-4gi")
    (share,) = dra.shares(ns, "leaver")
    oracle = Oracle()
    worker = on_its_share(dra, rig, pod, 3 * GIB)
    oracle.add(worker, Role.OFFENDER, namespace=ns, pod="leaver", expect_stopped=True)
    enforcer = rig.start_enforcer(sources=SOURCES)
    wait_until(
        metric_is(enforcer, LIMIT, 4 * GIB, labels(rig, "leaver", share.gpu)),
        timeout=30,
        what="the 4Gi share in the metrics",
    )
    path = f"{RESOURCE_API}/namespaces/{ns}/resourceclaims/{share.claim}"
    dra.cluster.admin_request("DELETE", path)
    claim = dra.get(path)
    assert claim["metadata"].get("deletionTimestamp")
    assert claim["status"].get("allocation")
    rig.set_usage(worker, 6 * GIB)
    wait_until(lambda: not worker.alive(), timeout=30, what="the pod over its share to stop")
    (signalled,) = enforcer.settled_events("container_signalled", 1)
    assert signalled["limit_bytes"] == 4 * GIB
    oracle.check(rig.enforcers)


def over_its_share(
    dra: DraCluster, rig: DraRig, name: str, gpu: int, oracle: Oracle, role: Role
) -> tuple[Worker, EnforcerProcess]:
    """A pod with a 4Gi share of GPU ``gpu`` at 3 GiB, an enforcer (grace 3 s) that holds it to
    the share, then the pod at 6 GiB, seen by the enforcer: a violation in its grace period."""
    dra.add_template(rig.namespace, name, "4Gi", gpu=gpu)
    pod = dra_pod(dra, rig, name, template=name)
    worker = on_its_share(dra, rig, pod, 3 * GIB)
    oracle.add(
        worker, role, namespace=rig.namespace, pod=name, expect_stopped=role is Role.OFFENDER
    )
    enforcer = rig.start_enforcer(sources=SOURCES, grace_seconds=3.0)
    wait_until(
        metric_is(enforcer, LIMIT, 4 * GIB, labels(rig, name, gpu)),
        timeout=30,
        what=f"{name}'s 4Gi share in the metrics",
    )
    rig.set_usage(worker, 6 * GIB)
    wait_until(
        metric_is(enforcer, USED, 6 * GIB, labels(rig, name, gpu)),
        timeout=2,
        interval=0.02,
        what=f"the enforcer to see {name} over its share",
    )
    return worker, enforcer


def test_no_signal_on_a_claim_gone_for_good_mid_violation(dra: DraCluster, rig: DraRig) -> None:
    """(e): ``orphan`` is over its 4Gi share, and within the grace period (3 s) its claim is
    removed for good (DELETE, then its finalizer dropped: 404 while the pod still runs; the
    controller makes no new one). The share is forgotten and, with no default, nothing limits
    the pod: it must not be signalled on the 4Gi it no longer has, however long it stays
    over."""
    oracle = Oracle()
    worker, enforcer = over_its_share(dra, rig, "orphan", 0, oracle, Role.UNVERIFIABLE)
    (share,) = dra.shares(rig.namespace, "orphan")
    path = f"{RESOURCE_API}/namespaces/{rig.namespace}/resourceclaims/{share.claim}"
    dra.cluster.admin_request("DELETE", path)
    dra.cluster.admin_request(
        "PATCH",
        path,
        {"metadata": {"finalizers": None}},
        content_type="application/merge-patch+json",
    )
    wait_until(lambda: dra.gone(path), timeout=2, interval=0.02, what="the claim to be gone")
    stay_untouched([worker], 5.0)
    assert enforcer.events("container_signalled") == []
    assert enforcer.metric(LIMIT, labels(rig, "orphan", 0)) is None
    oracle.check(rig.enforcers)


def test_no_signal_while_the_slice_is_deleted_mid_violation(dra: DraCluster, rig: DraRig) -> None:
    """(e): ``blind`` is over its 4Gi share of GPU 1, and within the grace period (3 s) the
    node's ResourceSlice is deleted (the claim keeps its allocation): the share's GPU is
    unknown, the limit unresolved, and nothing is signalled however long the pod stays over.
    When the driver publishes the slice again, the pod is held to its share and stopped."""
    oracle = Oracle()
    worker, enforcer = over_its_share(dra, rig, "blind", 1, oracle, Role.OFFENDER)
    dra.delete_slices(rig.node)
    wait_until(
        metric_is(enforcer, LIMIT, None, labels(rig, "blind", 1)),
        timeout=2.5,
        interval=0.02,
        what="blind's limit to become unresolved within the grace period",
    )
    assert dra.shares(rig.namespace, "blind")[0].device == "gpu-1", "still allocated"
    stay_untouched([worker], 5.0)
    assert enforcer.events("container_signalled") == []

    dra.publish_slice(dra.get(f"/api/v1/nodes/{rig.node}"), generation=2)
    wait_until(lambda: not worker.alive(), timeout=30, what="blind to be stopped")
    (signalled,) = enforcer.settled_events("container_signalled", 1)
    assert (signalled["pod"], signalled["gpu"], signalled["limit_bytes"]) == ("blind", 1, 4 * GIB)
    oracle.check(rig.enforcers)
