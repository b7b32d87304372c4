"""The DRA shares behind a pod's limit on one device, in one stable order, and the budget of
shares several pods hold together.

Owns which shares a per-pod metric series, ``explain`` and ``inspect`` name for a pod on a
device: those of its ``dra`` declaration there (``DeclaredLimit.shares``) allocated on that very
device, sorted by claim namespace, claim name and request (then driver, pool, device and share
ID, so the order is total). The metrics' ``dra_*`` labels take the first (docs/design.md,
Metrics).

Also owns the groups of pods that hold a share together (a claim reserved for several pods,
which the scheduler counted once: docs/dra.md, A claim shared by several pods): which pods on a
device are one group (``share_groups``), its budget (every distinct share its pods hold there,
summed), and which of them to stop when their sum is over it (``largest_first``). What to do
about a group over its budget over time (two listings, grace, the graduated stop) is
``core.policy``'s, as for one pod.

Pure: it reads resolved limits and charges; it decides no limit and names no share a claim did
not allocate there.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from gpuguard.core.assess import Assessment, Charges
from gpuguard.core.model import (
    ContainerCgroup,
    ContainerId,
    DeviceKey,
    DraShare,
    GpuDevice,
    LimitSource,
    PodRef,
    PodUid,
    RefusalReason,
    ResolvedLimit,
)
from gpuguard.core.units import format_bytes


def shares_on_device(limit: ResolvedLimit, device: GpuDevice | None) -> tuple[DraShare, ...]:
    """The shares of ``limit``'s assigned ``dra`` declaration whose device is ``device`` (a GPU,
    or one MIG instance: ``DraShare.is_on``), in ``share_order``; ``device`` ``None`` (no device
    known, as ``explain`` of a PID NVML does not list): all of them. Empty when DRA allocated
    the pod nothing there, or when ``dra`` is not among the declarations weighed (not in
    ``limits.sources``)."""
    found = [
        share
        for declared in limit.declarations
        if declared.source is LimitSource.DRA and declared.assigned
        for share in declared.shares
        if device is None or share.is_on(device)
    ]
    return tuple(sorted(found, key=share_order))


def share_order(share: DraShare) -> tuple[str, str, str, str, str, str, str]:
    """Claim namespace, claim name, request, then driver, pool, device and share ID."""
    return (
        share.claim_namespace,
        share.claim_name,
        share.request,
        share.driver,
        share.pool,
        share.device,
        share.share_id or "",
    )


# -- shares several pods hold together -------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ShareUse:
    """One pod's memory on one device, as a shared budget weighs it (``share_uses``)."""

    pod: PodRef
    device: GpuDevice
    shares: tuple[DraShare, ...]
    """Every DRA share allocated the pod on the device: its ``dra`` limit there, resolved."""
    used_bytes: int
    """The known usage of its processes on the device."""
    container_bytes: Mapping[ContainerId, int]
    """Of it, per container its processes are charged through."""
    cgroups: Mapping[ContainerId, ContainerCgroup]
    """Those containers' cgroups (``Charge.containers``): what a stop signals."""
    refusal: RefusalReason | None
    """Why a stop of this pod could not be acted on (``Assessment.refusal``)."""
    read_at: float | None
    """When its least recently read claim was read (``Declaration.read_at``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ShareGroup:
    """Pods on one device linked by the DRA shares they hold in common (one claim reserved for
    several pods), with every share any of them holds there: the memory the scheduler
    accounted for all of them together, the budget of their sum."""

    key: str
    """Stable while the shares are: the first shared share, in ``share_order``."""
    device: GpuDevice
    members: tuple[ShareUse, ...]
    """Two pods or more, by namespace, name and UID."""
    shared: tuple[DraShare, ...]
    """The shares two members or more hold, in ``share_order``."""
    budget_bytes: int
    """Every distinct share the members hold on the device, summed."""
    used_bytes: int
    """The members' known usage on the device, summed."""

    @property
    def over(self) -> bool:
        return self.used_bytes > self.budget_bytes

    @property
    def claims(self) -> tuple[str, ...]:
        """``namespace/name`` of the shared claims, sorted."""
        return tuple(sorted({f"{s.claim_namespace}/{s.claim_name}" for s in self.shared}))


def share_uses(
    assessments: Mapping[tuple[PodUid, DeviceKey], Assessment], charges: Charges
) -> list[ShareUse]:
    """The pods whose ``dra`` limit on a device is resolved (every claim read, every share
    placed), with the shares behind it. A pod whose shares are not all known joins no group:
    its budget could be larger than the known shares say (it is held to its own limit, or like
    a pod that declares nothing: ``core.limits``)."""
    uses: list[ShareUse] = []
    for key, verdict in assessments.items():
        resolved = [
            d
            for d in verdict.limit.declarations
            if d.source is LimitSource.DRA and d.assigned and d.unresolved is None
        ]
        shares = tuple(s for d in resolved for s in d.shares if s.is_on(verdict.device))
        if not shares:
            continue
        times = [d.read_at for d in resolved]
        uses.append(
            ShareUse(
                pod=verdict.pod,
                device=verdict.device,
                shares=shares,
                used_bytes=verdict.used_bytes,
                container_bytes=dict(charges.by_pod[key].container_bytes),
                cgroups=dict(charges.by_pod[key].containers),
                refusal=verdict.refusal,
                read_at=None if None in times else min(t for t in times if t is not None),
            )
        )
    return uses


def share_groups(uses: Iterable[ShareUse]) -> tuple[ShareGroup, ...]:
    """The pods of ``uses`` that hold a DRA share together on a device, joined through every
    share they hold in common (A and B share one claim, B and C another: one group), each
    group with the budget of all their shares there, in a stable order.

    A pod alone on its shares is no group: its own limit is the same budget. A group holding a
    share of the whole device (no memory accounted) has no budget short of the device, and is
    left out."""
    by_device: dict[DeviceKey, list[ShareUse]] = {}
    for use in uses:
        by_device.setdefault(use.device.key, []).append(use)
    groups: list[ShareGroup] = []
    for members in by_device.values():
        groups.extend(_groups_on_device(members))
    return tuple(sorted(groups, key=lambda g: (g.device.index, g.device.uuid, g.key)))


def _groups_on_device(uses: list[ShareUse]) -> list[ShareGroup]:
    holders: dict[tuple[str, ...], list[int]] = {}
    for i, use in enumerate(uses):
        for share in {share_order(s): s for s in use.shares}:
            holders.setdefault(share, []).append(i)
    parent = list(range(len(uses)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for held in holders.values():
        for other in held[1:]:
            parent[root(other)] = root(held[0])
    components: dict[int, list[ShareUse]] = {}
    for i, use in enumerate(uses):
        components.setdefault(root(i), []).append(use)
    groups = []
    for members in components.values():
        if len(members) < 2:
            continue
        distinct = {share_order(s): s for m in members for s in m.shares}
        if any(s.memory_bytes is None for s in distinct.values()):
            continue  # the whole device: no budget short of it
        shared = sorted((s for k, s in distinct.items() if len(holders[k]) > 1), key=share_order)
        members.sort(key=lambda m: (m.pod.namespace, m.pod.name, m.pod.uid))
        groups.append(
            ShareGroup(
                key="/".join(share_order(shared[0])),
                device=members[0].device,
                members=tuple(members),
                shared=tuple(shared),
                budget_bytes=sum(s.memory_bytes or 0 for s in distinct.values()),
                used_bytes=sum(m.used_bytes for m in members),
            )
        )
    return groups


def largest_first(
    group: ShareGroup, *, stopping: Collection[ContainerId] = ()
) -> tuple[ShareUse, ...]:
    """The members to stop so that the rest fits the group's budget: the largest users first
    (ties by namespace, name and UID), until what the others use fits. Memory of containers
    already being stopped (``stopping``) counts as gone, and their pods count only what their
    other containers use. Empty when the group fits.

    Largest first, not all of them: the pod that stops most of the overrun goes, and a small
    sharer is not stopped for a large one's use."""
    left = {m.pod.uid: m.used_bytes - _stopping_bytes(m, stopping) for m in group.members}
    remainder = sum(left.values())
    chosen: list[ShareUse] = []
    for member in sorted(
        group.members,
        key=lambda m: (-left[m.pod.uid], m.pod.namespace, m.pod.name, m.pod.uid),
    ):
        if remainder <= group.budget_bytes or left[member.pod.uid] <= 0:
            break
        chosen.append(member)
        remainder -= left[member.pod.uid]
    return tuple(chosen)


def _stopping_bytes(use: ShareUse, stopping: Collection[ContainerId]) -> int:
    return sum(n for cid, n in use.container_bytes.items() if cid in stopping)


def describe_group(group: ShareGroup) -> str:
    """The group in words, for Events and refusals."""
    claims = ", ".join(group.claims)
    pods = ", ".join(
        f"{m.pod.name} {format_bytes(m.used_bytes)}"
        for m in sorted(group.members, key=lambda m: (-m.used_bytes, m.pod.name, m.pod.uid))
    )
    noun = "ResourceClaim" if len(group.claims) == 1 else "ResourceClaims"
    return (
        f"the {len(group.members)} pods holding {noun} {claims} on GPU {group.device.index} "
        f"({group.device.uuid}) use {format_bytes(group.used_bytes)} together ({pods}), over "
        f"the {format_bytes(group.budget_bytes)} the scheduler accounted for them there"
    )
