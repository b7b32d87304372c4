"""The one verdict: what each pod's GPU memory on one device is, for ``decide()``, ``inspect`` and
``explain`` alike (docs/design.md, Assess).

Owns two steps every reader of a sample shares:

- ``charge()``: which process's memory is charged to which pod on which device, and why the rest
  is charged to nobody (ghost, reused PID, host process, unknown pod). A PID's memory is charged
  only to a live occupant that holds the GPU (or, for a dead process NVML still lists, to the pod
  it was last attributed to, when the caller remembers it).
- ``assess()``: per (pod, device) the known usage, the resolved limit and its source, and the
  verdict (ok, over, unknown, unlimited, exempt) with the reason a confirmed violation could not
  be acted on.

Pure, standard library only: no I/O, clock or logging. What to *do* about a verdict over time
(grace, two fresh samples, escalation) is ``core.policy``'s.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gpuguard.core.allocation import (
    NOT_CHECKED,
    UNKNOWN_ALLOCATIONS,
    Allocated,
    AllocationCheck,
    NodeAllocations,
    allocation_on,
)
from gpuguard.core.limits import is_exempt, resolve_limit
from gpuguard.core.model import (
    Attribution,
    ContainerCgroup,
    ContainerId,
    ContainerLimit,
    DeviceKey,
    EnforcementPolicy,
    GpuDevice,
    GpuProcess,
    GpuSample,
    GpuUuid,
    LimitSource,
    Pod,
    PodRef,
    PodSnapshot,
    PodUid,
    RefusalReason,
    ResolvedLimit,
    Unallocated,
)


class Verdict(enum.StrEnum):
    """What one pod's memory on one device is this sample."""

    OK = "ok"
    OVER = "over_limit"
    UNLIMITED = "unlimited"
    EXEMPT = "exempt"
    UNKNOWN = "usage_unknown"
    """At least one of the pod's processes on the device has usage N/A: never acted on."""


@dataclass(slots=True)
class Charge:
    """The processes of one pod on one device this sample."""

    used_bytes: int = 0
    """Sum of the known usage."""
    unknown: int = 0
    """Processes whose usage NVML reports as N/A."""
    mps_clients: int = 0
    """Processes NVML lists as MPS clients."""
    containers: dict[ContainerId, ContainerCgroup] = field(default_factory=dict)
    container_bytes: dict[ContainerId, int] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)

    def add(self, proc: GpuProcess, attribution: Attribution) -> None:
        self.pids.append(proc.pid)
        self.mps_clients += proc.mps_client
        if proc.used_bytes is None:
            self.unknown += 1
        else:
            self.used_bytes += proc.used_bytes
        cid = attribution.container_id
        if cid is not None and attribution.cgroup is not None:
            self.containers[cid] = attribution.cgroup
            self.container_bytes[cid] = self.container_bytes.get(cid, 0) + (proc.used_bytes or 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Uncharged:
    """A listed process whose memory no pod can be charged for, and why."""

    proc: GpuProcess
    attribution: Attribution | None
    reason: RefusalReason
    """``ghost``, ``identity_changed``, ``not_a_pod`` or ``pod_unknown``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Charges:
    """``charge()``'s answer for one sample."""

    by_pod: Mapping[tuple[PodUid, DeviceKey], Charge]
    """Keyed by the UID the cgroups carry (a static pod's hash for a static pod)."""
    uncharged: tuple[Uncharged, ...]
    unattributed_bytes: Mapping[DeviceKey, int]
    """Per device, the known memory of ``uncharged`` processes."""
    chargeable: Mapping[int, Attribution]
    """PID → the attribution its memory was charged through (remembered ones included)."""


def charge(
    sample: GpuSample,
    attributions: Mapping[int, Attribution],
    pods: PodSnapshot,
    *,
    tainted: frozenset[int] = frozenset(),
    settled: frozenset[int] = frozenset(),
    remembered: Mapping[int, Attribution] | None = None,
) -> Charges:
    """Charge each listed process's memory to its pod on its device, or to nobody with a reason.

    ``tainted``: PIDs whose occupant cannot own the memory listed for them (never charged).
    ``settled``: PIDs whose occupant owns their memory even without a GPU file open (NVML
    has kept listing them with it behind them for longer than the driver keeps a dead
    process's entry); one-shot readers, with no history, pass nothing.
    ``remembered``: the last pod attribution of PIDs whose process died while NVML still lists
    them (a forked child holds the memory); one-shot readers pass nothing.
    """
    devices = {d.key for d in sample.devices}
    by_pod: dict[tuple[PodUid, DeviceKey], Charge] = {}
    uncharged: list[Uncharged] = []
    unattributed: dict[DeviceKey, int] = dict.fromkeys(devices, 0)
    chargeable: dict[int, Attribution] = {}
    for proc in sample.processes:
        if proc.device not in devices:
            continue
        attribution = attributions.get(proc.pid)
        if (attribution is None or attribution.identity is None) and remembered:
            attribution = remembered.get(proc.pid, attribution)
        why = unchargeable(proc.pid, attribution, tainted, pods, settled=settled)
        if why is not None:
            uncharged.append(Uncharged(proc=proc, attribution=attribution, reason=why))
            if proc.used_bytes is not None:
                unattributed[proc.device] += proc.used_bytes
            continue
        assert attribution is not None
        assert attribution.pod_uid is not None
        chargeable[proc.pid] = attribution
        by_pod.setdefault((attribution.pod_uid, proc.device), Charge()).add(proc, attribution)
    return Charges(
        by_pod=by_pod,
        uncharged=tuple(uncharged),
        unattributed_bytes=unattributed,
        chargeable=chargeable,
    )


def unchargeable(
    pid: int,
    attribution: Attribution | None,
    tainted: frozenset[int],
    pods: PodSnapshot,
    *,
    settled: frozenset[int] = frozenset(),
) -> RefusalReason | None:
    """Why this process's memory cannot be charged to a pod, or ``None`` if it can.

    An occupant with no GPU file open is not charged until its PID is ``settled``: until
    then it may be a new process that was handed a dead one's PID (``identity_changed``)."""
    if attribution is None or attribution.identity is None:
        return RefusalReason.GHOST
    if pid in tainted or (attribution.holds_gpu is False and pid not in settled):
        return RefusalReason.IDENTITY_CHANGED
    if attribution.pod_uid is None:
        return RefusalReason.NOT_A_POD
    if not pods.synced or pods.lookup(attribution.pod_uid) is None:
        return RefusalReason.POD_UNKNOWN
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class Assessment:
    """One pod's memory on one device: usage, limit, verdict."""

    pod: PodRef
    device: GpuDevice
    used_bytes: int
    unknown_processes: int
    limit: ResolvedLimit
    verdict: Verdict
    over: bool
    """The known usage alone exceeds the limit. A violation is tracked from here, even when the
    verdict is ``usage_unknown``: it then ends as a refusal with a reason, never silently."""
    refusal: RefusalReason | None
    """Why a confirmed violation could not be acted on (exempt, usage unknown, MPS, no
    container); ``None`` when it could."""
    unassigned: tuple[LimitSource, ...] = ()
    """The schedulers whose declaration pins the pod to other devices than this one (a
    non-exempt pod's): its memory here is on a GPU they did not assign it, reported once per
    pod and GPU. Not a refusal: the memory is held to the next applicable limit."""
    allocation: AllocationCheck = NOT_CHECKED
    """Whether what the pod was allocated names this device (``core.allocation``)."""
    unallocated_stop: bool = False
    """The pod (not exempt) uses memory here that none of its allocations names, and the admin
    has such use stopped (``enforcement.unallocated = "stop"``): ``over`` is set for it, and the
    violation is one of GPU use without an allocation (limit 0 bytes here) unless the pod is
    over its own limit anyway."""
    own_over: tuple[tuple[ContainerId, ContainerLimit], ...] = ()
    """The pod's containers over their own limit here (``ResolvedLimit.containers``), sorted:
    ``over`` is set for them too, and ``core.policy`` stops them alone where what the pod's
    other containers use fits the pod's limit."""

    @property
    def unallocated(self) -> bool:
        """A non-exempt pod's memory here that none of its allocations names."""
        return (
            self.allocation.state is Allocated.NO
            and self.used_bytes > 0
            and self.verdict is not Verdict.EXEMPT
        )


def assess(
    *,
    pod: Pod,
    charged: Charge,
    device: GpuDevice,
    policy: EnforcementPolicy,
    replicas: int | None,
    labelled: frozenset[str] | None = None,
    allocations: NodeAllocations = UNKNOWN_ALLOCATIONS,
    now: float = 0.0,
) -> Assessment:
    """The verdict for ``pod``'s processes on ``device`` (``charged``, from ``charge()``).
    ``labelled``: the namespaces known to carry the admin's exempt label (``None``: unknown;
    ``PodSnapshot.labelled_namespaces``). ``allocations``: the kubelet's pod resources, read
    at most ``policy.staleness_seconds`` before ``now`` to count."""
    limit = resolve_limit(
        pod=pod,
        device_total_bytes=device.total_bytes,
        policy=policy.limits,
        replicas=replicas,
        device=device,
    )
    exemption = True if pod.uid == policy.self_pod_uid else None
    if exemption is None:
        exemption = is_exempt(pod.namespace, policy.limits, labelled)
    exempt = exemption is True
    own_over = containers_over(pod, limit, charged)
    over = (limit.limit_bytes is not None and charged.used_bytes > limit.limit_bytes) or bool(
        own_over
    )
    allocation = allocation_on(
        pod, device, allocations, policy.limits, now=now, max_age=policy.staleness_seconds
    )
    unallocated_stop = (
        policy.unallocated is Unallocated.STOP
        and allocation.state is Allocated.NO
        and charged.used_bytes > 0
        and exemption is not True
        and not over
    )
    over = over or unallocated_stop
    if exempt:
        verdict = Verdict.EXEMPT
    elif charged.unknown:
        verdict = Verdict.UNKNOWN
    elif unallocated_stop or own_over:
        verdict = Verdict.OVER
    elif limit.limit_bytes is None:
        verdict = Verdict.UNLIMITED
    else:
        verdict = Verdict.OVER if over else Verdict.OK
    return Assessment(
        pod=PodRef(uid=pod.uid, namespace=pod.namespace, name=pod.name),
        device=device,
        used_bytes=charged.used_bytes,
        unknown_processes=charged.unknown,
        limit=limit,
        verdict=verdict,
        over=over,
        refusal=_refusal(
            charged,
            device,
            exempt=exempt,
            exemption_known=exemption is not None,
            mps_declared=policy.mps_declared,
        ),
        unassigned=() if exempt else limit.unassigned,
        allocation=allocation,
        unallocated_stop=unallocated_stop,
        own_over=own_over,
    )


def containers_over(
    pod: Pod, limit: ResolvedLimit, charged: Charge
) -> tuple[tuple[ContainerId, ContainerLimit], ...]:
    """The pod's containers whose own known usage on the device is over their own limit there.
    A container is known by the name ``status.containerStatuses`` gives its ID
    (``Pod.containers``); one without a name there has no own limit."""
    if not limit.containers:
        return ()
    own = {c.container: c for c in limit.containers}
    found = []
    for cid, used in sorted(charged.container_bytes.items()):
        name = pod.containers.get(cid)
        mine = own.get(name) if name is not None else None
        if mine is not None and used > mine.limit_bytes:
            found.append((cid, mine))
    return tuple(found)


def _refusal(
    charged: Charge,
    device: GpuDevice,
    *,
    exempt: bool,
    exemption_known: bool,
    mps_declared: Callable[[GpuUuid], bool],
) -> RefusalReason | None:
    # Memory on a GPU the pod's scheduler did not assign it is no reason here: a pin is pod
    # metadata a tenant can write, so it must never stop enforcement.
    if exempt:
        return RefusalReason.EXEMPT
    # The admin exempts namespaces by a label and the labels are not known now: the pod may
    # be exempt, and a kill on "not exempt" by default of knowing would be a wrong kill.
    if not exemption_known:
        return RefusalReason.EXEMPTION_UNKNOWN
    if charged.unknown:
        return RefusalReason.USAGE_UNKNOWN
    # MPS spares only this pod's own MPS clients, and only on a GPU where the admin runs MPS:
    # a tenant can start an MPS daemon of its own, and clients listed on a GPU say nothing
    # about any other pod's processes there.
    if charged.mps_clients and mps_declared(device.uuid):
        return RefusalReason.MPS
    if not charged.containers:
        return RefusalReason.NO_CONTAINER
    return None


def assess_all(
    charges: Charges,
    pods: PodSnapshot,
    devices: Mapping[DeviceKey, GpuDevice],
    policy: EnforcementPolicy,
    replicas: int | None,
    *,
    allocations: NodeAllocations = UNKNOWN_ALLOCATIONS,
    now: float = 0.0,
) -> dict[tuple[PodUid, DeviceKey], Assessment]:
    """``assess()`` for every charged (pod, device)."""
    out: dict[tuple[PodUid, DeviceKey], Assessment] = {}
    for (uid, key), charged in charges.by_pod.items():
        pod = pods.lookup(uid)
        assert pod is not None  # charge() charges only pods the snapshot knows
        out[(uid, key)] = assess(
            pod=pod,
            charged=charged,
            device=devices[key],
            policy=policy,
            replicas=replicas,
            labelled=pods.labelled_namespaces,
            allocations=allocations,
            now=now,
        )
    return out
