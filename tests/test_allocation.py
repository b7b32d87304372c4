"""``core.allocation.allocation_on``: whether a pod's memory on a device is explained by what the
kubelet allocated it, for every device ID form NVIDIA's device plugin reports, DRA shares and
scheduler pins; and when the answer is unknown (never a reason to act).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from gpuguard.core.allocation import (
    Allocated,
    AllocationCheck,
    ContainerDevices,
    DynamicDevice,
    NodeAllocations,
    PodAllocation,
    allocation_on,
)
from gpuguard.core.model import (
    GPUGUARD_SOURCE,
    Declaration,
    DraShare,
    GpuDevice,
    GpuUuid,
    LimitPolicy,
    LimitSource,
    Pod,
    PodUid,
)

GPU0 = GpuDevice(index=0, uuid=GpuUuid("GPU-aaaa"), name="A100", total_bytes=80 << 30)
GPU1 = GpuDevice(index=1, uuid=GpuUuid("GPU-bbbb"), name="A100", total_bytes=80 << 30)
MIG0 = GpuDevice(
    index=0,
    uuid=GpuUuid("GPU-aaaa"),
    name="A100 MIG 1g.10gb",
    total_bytes=10 << 30,
    gpu_instance_id=7,
    compute_instance_id=0,
    mig_uuid="MIG-cccc",
)
POD = Pod(uid=PodUid("u-1"), namespace="ml", name="train")
NOW = 100.0
DEFAULT = LimitPolicy()
ALL_SOURCES = LimitPolicy(sources=(GPUGUARD_SOURCE, LimitSource.DRA.value, LimitSource.KAI.value))


def node(
    devices: Sequence[tuple[str, Sequence[str]]] = (),
    dynamic: Sequence[tuple[str, str, str]] = (),
    *,
    read_at: float = NOW - 1,
) -> NodeAllocations:
    """The kubelet's answer listing ``POD`` with ``devices`` (resource, IDs) in container main
    and ``dynamic`` DRA devices (driver, pool, device)."""
    entry = PodAllocation(
        namespace=POD.namespace,
        name=POD.name,
        containers=("main",),
        devices=tuple(
            ContainerDevices(container="main", resource=r, device_ids=tuple(ids))
            for r, ids in devices
        ),
        dynamic=tuple(
            DynamicDevice(
                container="main",
                claim_namespace="ml",
                claim_name="claim",
                driver=d,
                pool=p,
                device=dev,
            )
            for d, p, dev in dynamic
        ),
    )
    return NodeAllocations(pods={("ml", "train"): entry}, read_at=read_at, unknown=None)


def check(
    device: GpuDevice,
    allocations: NodeAllocations,
    *,
    pod: Pod = POD,
    policy: LimitPolicy = DEFAULT,
) -> AllocationCheck:
    return allocation_on(pod, device, allocations, policy, now=NOW, max_age=10.0)


def share(uuid: str | None, device: str = "gpu-0") -> DraShare:
    return DraShare(
        claim_namespace="ml",
        claim_name="claim",
        request="gpu",
        driver="gpu.nvidia.com",
        pool="node-a",
        device=device,
        share_id=None,
        memory_bytes=10 << 30,
        uuid=GpuUuid(uuid) if uuid is not None else None,
    )


def with_declared(source: LimitSource, declaration: Declaration) -> Pod:
    return Pod(uid=POD.uid, namespace=POD.namespace, name=POD.name, declared={source: declaration})


@pytest.mark.parametrize(
    ("resource", "device_id", "device", "state"),
    [
        ("nvidia.com/gpu", "GPU-aaaa", GPU0, Allocated.YES),
        ("nvidia.com/gpu", "GPU-aaaa", GPU1, Allocated.NO),
        ("nvidia.com/gpu", "GPU-aaaa", MIG0, Allocated.YES),  # a whole GPU covers its MIG
        ("nvidia.com/gpu.shared", "GPU-aaaa::3", GPU0, Allocated.YES),  # a replica
        ("nvidia.com/gpu", "GPU-bbbb::0", GPU0, Allocated.NO),
        ("nvidia.com/mig-1g.10gb", "MIG-cccc", MIG0, Allocated.YES),
        ("nvidia.com/mig-1g.10gb", "MIG-cccc::1", MIG0, Allocated.YES),
        ("nvidia.com/mig-1g.10gb", "MIG-dddd", MIG0, Allocated.NO),
        ("nvidia.com/mig-1g.10gb", "MIG-cccc", GPU0, Allocated.NO),
        ("nvidia.com/gpu", "0", GPU0, Allocated.YES),  # index ID strategy
        ("nvidia.com/gpu", "1", GPU0, Allocated.NO),
        ("nvidia.com/gpu", "0", MIG0, Allocated.YES),  # the whole GPU 0, as by its UUID
        ("nvidia.com/gpu", "0:2", MIG0, Allocated.YES),  # a MIG device of GPU 0
        ("nvidia.com/gpu", "1:0", MIG0, Allocated.NO),
        ("nvidia.com/gpu", "0:2", GPU0, Allocated.NO),
        ("nvidia.com/gpu", "gpu-zero", GPU0, Allocated.UNKNOWN),  # a form never guessed
    ],
)
def test_each_device_plugin_id_form(
    resource: str, device_id: str, device: GpuDevice, state: Allocated
) -> None:
    got = check(device, node([(resource, [device_id])]))
    assert got.state is state, got
    if state is Allocated.UNKNOWN:
        assert repr(device_id) in got.why


def test_not_allocated_names_what_the_pod_holds_and_the_read() -> None:
    got = check(GPU0, node([("nvidia.com/gpu", ["GPU-bbbb::1"])], read_at=95.0))
    assert got.state is Allocated.NO
    assert got.allocated == "nvidia.com/gpu GPU-bbbb::1 (container main)"
    assert got.read_at == 95.0


def test_a_non_gpu_resource_alone_is_not_allocated_no_gpu() -> None:
    got = check(GPU0, node([("example.com/nic", ["0"]), ("nvidia.com/gpu-like", ["GPU-aaaa"])]))
    assert got == AllocationCheck(state=Allocated.NO, allocated="no GPU", read_at=NOW - 1)


def test_a_pod_the_kubelet_does_not_list_is_unknown() -> None:
    other = Pod(uid=PodUid("u-2"), namespace="ml", name="other")
    got = check(GPU0, node(), pod=other)
    assert got.state is Allocated.UNKNOWN
    assert got.why == "the kubelet does not list the pod"


def test_a_stale_read_is_unknown_and_a_fresh_one_is_not() -> None:
    assert check(GPU0, node(read_at=NOW - 11)).state is Allocated.UNKNOWN
    assert "last read 11 s ago" in check(GPU0, node(read_at=NOW - 11)).why
    assert check(GPU0, node(read_at=NOW - 10)).state is Allocated.NO


def test_an_unknown_answer_or_pod_is_unknown_with_its_reason() -> None:
    failed = NodeAllocations(unknown="the kubelet did not answer")
    assert check(GPU0, failed) == AllocationCheck(
        state=Allocated.UNKNOWN, why="the kubelet did not answer"
    )
    assert check(GPU0, NodeAllocations(read_at=NOW, unknown=None)).state is Allocated.UNKNOWN
    bounded = PodAllocation(namespace="ml", name="train", unknown="more than 64 containers")
    got = check(GPU0, NodeAllocations(pods={("ml", "train"): bounded}, read_at=NOW, unknown=None))
    assert got == AllocationCheck(state=Allocated.UNKNOWN, why="more than 64 containers")


def test_a_dra_share_on_the_device_is_allocated() -> None:
    pod = with_declared(LimitSource.DRA, Declaration(shares=(share("GPU-aaaa"),)))
    allocations = node(dynamic=[("gpu.nvidia.com", "node-a", "gpu-0")])
    assert check(GPU0, allocations, pod=pod, policy=ALL_SOURCES).state is Allocated.YES
    got = check(GPU1, allocations, pod=pod, policy=ALL_SOURCES)
    assert got.state is Allocated.NO
    assert got.allocated == "DRA gpu.nvidia.com/node-a/gpu-0 (GPU-aaaa)"


def test_a_dra_device_without_a_placed_share_is_unknown() -> None:
    unplaced = with_declared(LimitSource.DRA, Declaration(shares=(share(None),)))
    allocations = node(dynamic=[("gpu.nvidia.com", "node-a", "gpu-0")])
    got = check(GPU0, allocations, pod=unplaced, policy=ALL_SOURCES)
    assert got.state is Allocated.UNKNOWN
    assert "gpu.nvidia.com/node-a/gpu-0" in got.why
    # DRA not among limits.sources: its shares are not read, so no DRA device is placed.
    placed = with_declared(LimitSource.DRA, Declaration(shares=(share("GPU-aaaa"),)))
    assert check(GPU0, allocations, pod=placed, policy=DEFAULT).state is Allocated.UNKNOWN


def test_unresolved_dra_shares_are_unknown() -> None:
    pod = with_declared(LimitSource.DRA, Declaration(unresolved="claim ml/claim not read yet"))
    got = check(GPU0, node(), pod=pod, policy=ALL_SOURCES)
    assert got == AllocationCheck(state=Allocated.UNKNOWN, why="claim ml/claim not read yet")


def test_a_listed_schedulers_pin_is_allocated_and_an_unlisted_ones_is_not() -> None:
    for pinned in ("GPU-aaaa", "index:0"):
        pod = with_declared(LimitSource.KAI, Declaration(amount=1024, pinned=frozenset({pinned})))
        assert check(GPU0, node(), pod=pod, policy=ALL_SOURCES).state is Allocated.YES
        assert check(GPU0, node(), pod=pod, policy=DEFAULT).state is Allocated.NO
        assert check(GPU1, node(), pod=pod, policy=ALL_SOURCES).state is Allocated.NO
    mig_pin = with_declared(LimitSource.KAI, Declaration(amount=1, pinned=frozenset({"MIG-cccc"})))
    assert check(MIG0, node(), pod=mig_pin, policy=ALL_SOURCES).state is Allocated.YES
    rejected = with_declared(
        LimitSource.KAI, Declaration(pinned=frozenset({"GPU-aaaa"}), error="bad fraction")
    )
    assert check(GPU0, node(), pod=rejected, policy=ALL_SOURCES).state is Allocated.NO


def test_an_allocation_of_the_device_wins_over_an_id_of_no_known_form() -> None:
    """Whatever order the kubelet lists them in, and whichever source allocates the device: an
    unreadable ID elsewhere does not hide that the pod was given this device."""
    for ids in (["weird", "GPU-aaaa"], ["GPU-aaaa", "weird"]):
        assert check(GPU0, node([("nvidia.com/gpu", ids)])).state is Allocated.YES
    pinned = with_declared(LimitSource.KAI, Declaration(amount=1, pinned=frozenset({"GPU-aaaa"})))
    allocations = node([("nvidia.com/gpu", ["weird"])])
    assert check(GPU0, allocations, pod=pinned, policy=ALL_SOURCES).state is Allocated.YES
    # Nothing allocates the device: the unreadable ID keeps it unknown.
    assert check(GPU1, allocations, pod=pinned, policy=ALL_SOURCES).state is Allocated.UNKNOWN


def test_allocated_says_what_allocated_the_device() -> None:
    """Read by people in ``inspect`` and ``explain``: the ID that names the device, the DRA
    device, or the scheduler's pin."""
    plugin = check(GPU0, node([("nvidia.com/gpu", ["GPU-bbbb::0", "GPU-aaaa::2"])]))
    assert plugin.allocated == "nvidia.com/gpu GPU-aaaa::2 (container main)"
    dra = with_declared(LimitSource.DRA, Declaration(shares=(share("GPU-aaaa"),)))
    allocations = node(dynamic=[("gpu.nvidia.com", "node-a", "gpu-0")])
    got = check(GPU0, allocations, pod=dra, policy=ALL_SOURCES)
    assert got.allocated == "DRA gpu.nvidia.com/node-a/gpu-0 (claim claim)"
    pinned = with_declared(LimitSource.KAI, Declaration(amount=1, pinned=frozenset({"index:0"})))
    assert check(GPU0, node(), pod=pinned, policy=ALL_SOURCES).allocated == "kai pin index:0"
