"""What the kubelet allocated each pod, and whether a pod's GPU memory on a device is explained.

Owns the pod-resources view (``NodeAllocations``: the device plugin's devices and the DRA
devices the kubelet reports per container) and the one rule ``allocation_on()``: a pod's memory
on a device is *allocated* when the device plugin gave one of its containers that GPU (or MIG
instance), a DRA share of the pod lies on it, or a listed scheduler pinned the pod to it; *not
allocated* when the kubelet's answer is known, fresh and names none of these; *unknown*
otherwise. Unknown is never a reason to act (docs/design.md, GPU use without an allocation).
Must not do I/O: ``adapters.podresources`` reads the kubelet's socket.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuguard.core.model import GpuDevice, LimitPolicy, LimitSource, Pod

MAX_PODS = 4096
"""Pods kept from one pod-resources answer (the kubelet's own limit is 110 by default, 2500 at
most in practice); past it the answer is ``unknown``, never partly read."""
MAX_CONTAINERS = 64
"""Containers kept per pod; a pod with more is ``unknown``."""
MAX_DEVICES = 256
"""Device IDs kept per container; a container with more is ``unknown``."""
MAX_NAME = 253
"""Longest namespace, pod, container or resource name kept (a DNS subdomain)."""


def is_gpu_resource(name: str) -> bool:
    """A device plugin resource that hands out NVIDIA GPUs or MIG instances: ``nvidia.com/gpu``,
    its renamed shared form ``nvidia.com/gpu.shared``, and the MIG resources
    ``nvidia.com/mig-<profile>`` (NVIDIA's device plugin)."""
    return (
        name == "nvidia.com/gpu"
        or name.startswith("nvidia.com/gpu.")
        or name.startswith("nvidia.com/mig-")
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ContainerDevices:
    """The devices of one resource the device plugin gave one container."""

    container: str
    resource: str
    device_ids: tuple[str, ...]
    """As the kubelet reports them: ``GPU-<uuid>``, ``MIG-<uuid>``, ``<uuid>::<k>`` (time-sliced
    replica k), or an index (``0``, ``0:1``) under the plugin's ``index`` ID strategy."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DynamicDevice:
    """One DRA device the kubelet reports for a container (pod-resources ``dynamic_resources``)."""

    container: str
    claim_namespace: str
    claim_name: str
    driver: str
    pool: str
    device: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PodAllocation:
    """What the kubelet allocated one pod's containers."""

    namespace: str
    name: str
    containers: tuple[str, ...] = ()
    devices: tuple[ContainerDevices, ...] = ()
    """Every device plugin resource, GPU or not (``is_gpu_resource`` tells them apart)."""
    dynamic: tuple[DynamicDevice, ...] = ()
    unknown: str | None = None
    """Why this pod's answer cannot be used (past a bound): its allocation is unknown."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeAllocations:
    """One answer of the kubelet's pod-resources ``List`` (or why there is none)."""

    pods: Mapping[tuple[str, str], PodAllocation] = field(default_factory=dict)
    """By (namespace, name): the API names no UID. The kubelet lists every active pod, with
    or without devices."""
    read_at: float | None = None
    """Monotonic seconds when the ``List`` call that answered was sent; ``None``: never answered."""
    unknown: str | None = "not read yet"
    """Why nothing is known now (no socket, a timeout, an old kubelet, an answer past a
    bound); ``None`` when ``pods`` is the kubelet's answer."""


UNKNOWN_ALLOCATIONS = NodeAllocations()
"""No pod-resources reader (a pods file, or the reader turned off): every allocation unknown."""


class Allocated(enum.StrEnum):
    """Whether a pod's memory on a device is explained by what it was allocated."""

    YES = "allocated"
    NO = "not_allocated"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocationCheck:
    """``allocation_on()``'s answer for one pod on one device."""

    state: Allocated
    allocated: str = ""
    """For people: what allocated the device (``nvidia.com/gpu GPU-a::1 (container main)``,
    ``DRA gpu.nvidia.com/node/gpu-0 (claim c)``, ``kai pin GPU-a``), or, when nothing does,
    everything the pod was allocated (``no GPU`` for nothing)."""
    why: str = ""
    """Why ``unknown``, for people."""
    read_at: float | None = None
    """``NodeAllocations.read_at`` of the answer behind a ``not_allocated``."""


NOT_CHECKED = AllocationCheck(state=Allocated.UNKNOWN, why="not checked")
"""An assessment made without the kubelet's answer."""

_INDEX = re.compile(r"\d{1,4}")
_MIG_INDEX = re.compile(r"(\d{1,4}):\d{1,4}")


def _matches(device_id: str, device: GpuDevice) -> bool | None:
    """Whether one device plugin ID names ``device``; ``None`` when its form is not known
    (never guessed either way)."""
    bare = device_id.split("::", 1)[0]
    if bare.startswith("GPU-"):
        # A whole GPU covers every MIG instance on it.
        return bare == device.uuid
    if bare.startswith("MIG-"):
        return device.mig_uuid is not None and bare == device.mig_uuid
    if _INDEX.fullmatch(bare):
        # A whole GPU by its index, like by its UUID: it covers every MIG instance on it (the
        # same allocation must not read differently under the plugin's two ID strategies).
        return int(bare) == device.index
    if (m := _MIG_INDEX.fullmatch(bare)) is not None:
        # ``<gpu>:<mig device index>``: the MIG index is not the GPU instance ID, so any
        # instance on that GPU counts as allocated (the permissive reading).
        return int(m.group(1)) == device.index and device.gpu_instance_id is not None
    return None


def allocation_on(
    pod: Pod,
    device: GpuDevice,
    allocations: NodeAllocations,
    policy: LimitPolicy,
    *,
    now: float,
    max_age: float,
) -> AllocationCheck:
    """Whether ``pod``'s memory on ``device`` is explained by what it was allocated.

    Allocated: a device plugin GPU resource of one of its containers names the device (its GPU
    UUID, its MIG UUID, a replica ``<uuid>::<k>`` of either, or its index), a DRA share of the
    pod lies on it, or a scheduler ``limits.sources`` lists pinned the pod to it. Unknown: the
    kubelet's answer is missing or older than ``max_age``, does not list the pod, or (where
    nothing allocates the device) holds an ID or a DRA device that cannot be placed. Not
    allocated: otherwise."""
    entry = _entry(pod, allocations, now=now, max_age=max_age)
    if isinstance(entry, AllocationCheck):
        return entry
    plugin = _plugin_on(entry, device)
    if plugin is not None and plugin.state is Allocated.YES:
        # The common answer, once per charged pod and device every cycle: the other sources
        # are not looked at (an allocation answers whatever they hold, as below).
        return plugin
    found = [
        check
        for check in (plugin, _dra_on(pod, entry, device, policy), _pins_on(pod, device, policy))
        if check is not None
    ]
    # Any source that allocates the device answers, whatever another could not place: an
    # unknown never hides an allocation (nor depends on the order the kubelet lists IDs in).
    for state in (Allocated.YES, Allocated.UNKNOWN):
        for check in found:
            if check.state is state:
                return check
    held = [
        f"{d.resource} {', '.join(d.device_ids)} (container {d.container})"
        for d in entry.devices
        if is_gpu_resource(d.resource)
    ]
    held.extend(_dra_held(pod))
    return AllocationCheck(
        state=Allocated.NO, allocated="; ".join(held) or "no GPU", read_at=allocations.read_at
    )


def _entry(
    pod: Pod, allocations: NodeAllocations, *, now: float, max_age: float
) -> PodAllocation | AllocationCheck:
    """The kubelet's answer for ``pod``, or why it is unknown."""
    if allocations.unknown is not None or allocations.read_at is None:
        return AllocationCheck(state=Allocated.UNKNOWN, why=allocations.unknown or "not read yet")
    age = now - allocations.read_at
    if age > max_age:
        why = f"the kubelet's pod resources were last read {age:.0f} s ago"
        return AllocationCheck(state=Allocated.UNKNOWN, why=why)
    entry = allocations.pods.get((pod.namespace, pod.name))
    if entry is None:
        return AllocationCheck(state=Allocated.UNKNOWN, why="the kubelet does not list the pod")
    if entry.unknown is not None:
        return AllocationCheck(state=Allocated.UNKNOWN, why=entry.unknown)
    return entry


def _plugin_on(entry: PodAllocation, device: GpuDevice) -> AllocationCheck | None:
    """A device plugin GPU resource of the pod names ``device`` (allocated), else an ID of no
    known form (unknown); ``None``: the device plugin gave the pod nothing there."""
    unknown: AllocationCheck | None = None
    for devices in entry.devices:
        if not is_gpu_resource(devices.resource):
            continue
        for device_id in devices.device_ids:
            named = _matches(device_id, device)
            if named:
                what = f"{devices.resource} {device_id} (container {devices.container})"
                return AllocationCheck(state=Allocated.YES, allocated=what)
            if named is None and unknown is None:
                why = f"device ID {device_id!r} of {devices.resource} has no known form"
                unknown = AllocationCheck(state=Allocated.UNKNOWN, why=why)
    return unknown


def _dra_on(
    pod: Pod, entry: PodAllocation, device: GpuDevice, policy: LimitPolicy
) -> AllocationCheck | None:
    """The pod's DRA shares on ``device`` (allocated), or a DRA device that cannot be placed
    (unknown); ``None`` when DRA says nothing about the device."""
    declared = pod.declared.get(LimitSource.DRA) if LimitSource.DRA in policy.sources else None
    shares = () if declared is None or declared.error else declared.shares
    for share in shares:
        if share.is_on(device):
            what = f"DRA {share.driver}/{share.pool}/{share.device} (claim {share.claim_name})"
            return AllocationCheck(state=Allocated.YES, allocated=what)
    placed = {(s.driver, s.pool, s.device) for s in shares if s.uuid is not None}
    for dyn in entry.dynamic:
        if (dyn.driver, dyn.pool, dyn.device) not in placed:
            return AllocationCheck(
                state=Allocated.UNKNOWN,
                why=(
                    f"DRA device {dyn.driver}/{dyn.pool}/{dyn.device} (claim "
                    f"{dyn.claim_namespace}/{dyn.claim_name}) cannot be placed on a GPU"
                ),
            )
    if declared is not None and declared.unresolved is not None:
        return AllocationCheck(state=Allocated.UNKNOWN, why=declared.unresolved)
    return None


def _dra_held(pod: Pod) -> list[str]:
    declared = pod.declared.get(LimitSource.DRA)
    if declared is None:
        return []
    return [f"DRA {s.driver}/{s.pool}/{s.device} ({s.uuid})" for s in declared.shares]


def _pins_on(pod: Pod, device: GpuDevice, policy: LimitPolicy) -> AllocationCheck | None:
    """A listed scheduler pinned the pod to ``device``: allocated by that scheduler."""
    names = {device.uuid, f"index:{device.index}"}
    if device.mig_uuid is not None:
        names.add(device.mig_uuid)
    for source, declared in pod.declared.items():
        if source is LimitSource.DRA or source.value not in policy.sources or declared.error:
            continue
        if declared.pinned & names:
            what = f"{source.value} pin {', '.join(sorted(declared.pinned & names))}"
            return AllocationCheck(state=Allocated.YES, allocated=what)
    return None
