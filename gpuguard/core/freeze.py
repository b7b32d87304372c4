"""The allocation guard's decisions (docs/design.md, Allocation guard): how much each container
cgroup may allocate before its next call is frozen, what a frozen allocation adds to the sample
``decide()`` judges, and what becomes of a frozen caller after a cycle.

Owns: ``budgets`` (pod usage at a listing → each guarded container cgroup's headroom),
``with_frozen`` (the sample with each frozen allocation added to its process, so ``decide()``
judges the usage the pod would have once the call runs), ``frozen_since`` (what lets
``decide()`` confirm such a pod at once: ``Trigger.ALLOCATION``) and ``fate`` (keep frozen
until a listing taken after the freeze is decided on, or resume with a reason). Must not:
read anything, signal anything, or loosen a rule of ``decide()``: a frozen allocation is
judged by the same rules as memory already taken.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace

from gpuguard.core.limits import effective_mode
from gpuguard.core.model import (
    Attribution,
    ContainerCgroup,
    DeviceKey,
    EnforcementPolicy,
    GpuProcess,
    GpuSample,
    Mode,
    PodUid,
)
from gpuguard.core.policy import PodUsage, UsageState


@dataclass(frozen=True, slots=True, kw_only=True)
class GuardStop:
    """One stop the guard's probe made: an allocation that would take its task's cgroup past
    the headroom written for it; the calling process is stopped (SIGSTOP) before the call ran."""

    tgid: int
    cgroup_id: int
    size_bytes: int
    device_index: int


@dataclass(frozen=True, slots=True, kw_only=True)
class FrozenAllocation:
    """A caller the guard's probe stopped (SIGSTOP) at an allocation entry point, before the call
    ran, with what the enforcer read of it when the stop arrived."""

    tgid: int
    """The process (thread group) stopped; the probe stops the whole group."""
    device_index: int
    """The device the allocation is for (``GpuDevice.index``)."""
    size_bytes: int
    frozen_at: float
    """Monotonic seconds when the enforcer took the stop in."""
    attribution: Attribution
    """The process as read when the stop arrived: its identity (start time), pod and cgroup.
    Only a process still as read here is ever resumed."""


class Fate(enum.StrEnum):
    """What becomes of a frozen caller after a cycle (``gpuguard_alloc_guard_thaws_total``'s
    ``reason``, except ``keep``)."""

    KEEP = "keep"
    """No listing of its device taken after the freeze has been decided on yet: it stays
    frozen (at most ``FREEZE_BOUND_SECONDS``)."""
    NOT_OVER = "not_over"
    """A listing taken after the freeze shows its pod within its limit with the allocation
    counted (the headroom was stale, or a free was missed): resumed at once, the call runs."""
    NOT_GUARDED = "not_guarded"
    """The pod is exempt, unlimited, in audit mode, its usage is unknown, or the process is not
    a pod's: nothing decides against it, so it runs."""
    REFUSED = "refused"
    """Its pod is over with the allocation counted, and ``decide()`` refused to act (a reason
    of its own: a stale pod view, no signal possible, ...): resumed, the call runs, and the
    violation goes on as for memory already taken."""
    SIGNALLED = "signalled"
    """Its container was sent the stop signal: resumed so that a SIGTERM handler can run (a
    process without one was killed by the SIGTERM already, still stopped)."""
    BOUND = "bound"
    """No decision within ``FREEZE_BOUND_SECONDS`` (the listing hung, or its pod is stopping
    already): resumed, the call runs."""


FREEZE_BOUND_SECONDS = 0.2
"""The longest the enforcer keeps a caller frozen once it took the stop over from the thawer
(``AllocationGuard.forget``): one listing of the device and one decision (~10 ms) fit well
within it; a freeze is a pause, not a punishment, so a decision that does not come in time
resumes the caller (``Fate.BOUND``) and the polling loop handles the pod as for memory already
taken."""

_GUARDED = (UsageState.OK,)
"""A pod over its limit (or stopping) is already handled by its violation's track; one
exempt, unlimited or of unknown usage has nothing to guard."""


def budgets(
    usages: Collection[PodUsage],
    sample: GpuSample,
    attributions: Mapping[int, Attribution],
    policy: EnforcementPolicy,
) -> dict[tuple[ContainerCgroup, int], int]:
    """Each guarded container cgroup and device index with the bytes its processes may allocate
    before the next listing (absent: not guarded, never frozen).

    The guard counts per task cgroup (a container's), the limit is per pod: the pod's headroom
    (limit − usage at this listing) is split evenly among its containers holding a process on
    the device, so two containers of a pod together never get more than the pod's headroom. A
    container over its share is frozen and the enforcer decides on the whole pod's usage, so a
    share too small costs a freeze and a listing, never a stop. Not guarded: MIG instances (the
    probe sees the device, not the instance), pods with containers' own limits or DRA shares
    held with other pods (a budget the split would not respect), pods with a process of unknown
    usage, pods in audit mode."""
    out: dict[tuple[ContainerCgroup, int], int] = {}
    for usage in usages:
        limit = usage.limit.limit_bytes
        if (
            usage.state not in _GUARDED
            or limit is None
            or usage.unknown_processes
            or usage.device.gpu_instance_id is not None
            or usage.limit.containers
            or any(s.pods_sharing > 1 for d in usage.limit.declarations for s in d.shares)
            or effective_mode(usage.pod.namespace, policy.limits, policy.mode) is not Mode.ENFORCE
        ):
            continue
        cgroups = _cgroups_on(usage.pod.uid, usage.device.key, sample, attributions)
        if not cgroups:
            continue
        share = max(0, limit - usage.used_bytes) // len(cgroups)
        for cgroup in cgroups:
            out[(cgroup, usage.device.index)] = share
    return out


def _cgroups_on(
    uid: PodUid, key: DeviceKey, sample: GpuSample, attributions: Mapping[int, Attribution]
) -> tuple[ContainerCgroup, ...]:
    found: dict[ContainerCgroup, None] = {}
    for process in sample.processes:
        if process.device != key:
            continue
        a = attributions.get(process.pid)
        if a is not None and a.pod_uid == uid and a.cgroup is not None and a.cgroup.version == 2:
            found[a.cgroup] = None
    return tuple(found)


def with_frozen(
    sample: GpuSample,
    attributions: Mapping[int, Attribution],
    frozen: Collection[FrozenAllocation],
) -> tuple[GpuSample, dict[int, Attribution]]:
    """``sample`` with each frozen allocation added to its process's usage on its device (a
    process NVML does not list there yet is added with the allocation alone, attributed as read
    when it was frozen), so ``decide()`` judges the pod as it would be once the call ran: the
    call has not run, and a stop decided on this usage stops it before it does."""
    if not frozen:
        return sample, dict(attributions)
    keys = {d.index: d.key for d in sample.devices if d.gpu_instance_id is None}
    extra: dict[tuple[int, DeviceKey], int] = {}
    for f in frozen:
        key = keys.get(f.device_index)
        if key is not None:
            extra[(f.tgid, key)] = extra.get((f.tgid, key), 0) + f.size_bytes
    processes: list[GpuProcess] = []
    for p in sample.processes:
        add = extra.pop((p.pid, p.device), 0)
        used = p.used_bytes
        processes.append(replace(p, used_bytes=used + add) if add and used is not None else p)
    out = dict(attributions)
    by_tgid = {f.tgid: f for f in frozen}
    for (tgid, key), size in extra.items():
        processes.append(GpuProcess(pid=tgid, device=key, used_bytes=size))
        out.setdefault(tgid, by_tgid[tgid].attribution)
    return replace(sample, processes=tuple(processes)), out


def frozen_since(
    frozen: Collection[FrozenAllocation], sample: GpuSample
) -> dict[tuple[PodUid, DeviceKey], float]:
    """``decide()``'s ``frozen``: each (pod, device) with a frozen caller, with the moment its
    earliest one was taken in (a listing of the device taken after it confirms the pod over)."""
    keys = {d.index: d.key for d in sample.devices if d.gpu_instance_id is None}
    out: dict[tuple[PodUid, DeviceKey], float] = {}
    for f in frozen:
        uid, key = f.attribution.pod_uid, keys.get(f.device_index)
        if uid is None or key is None:
            continue
        held = out.get((uid, key))
        out[(uid, key)] = f.frozen_at if held is None else min(held, f.frozen_at)
    return out


def fate(
    frozen: FrozenAllocation,
    usages: Collection[PodUsage],
    signalled: Collection[object],
    *,
    listed_at: float | None,
    policy: EnforcementPolicy,
) -> Fate:
    """What becomes of ``frozen`` after a cycle decided on a sample with it counted
    (``with_frozen``). ``usages``: that cycle's; ``signalled``: the container ids that cycle
    sent a stop signal to; ``listed_at``: when that sample's listing of the frozen caller's
    device was taken (``None``: not listed)."""
    a = frozen.attribution
    if a.container_id is not None and a.container_id in signalled:
        return Fate.SIGNALLED
    usage = next(
        (
            u
            for u in usages
            if a.pod_uid is not None
            and u.pod.uid == a.pod_uid
            and u.device.index == frozen.device_index
            and u.device.gpu_instance_id is None
        ),
        None,
    )
    if (
        usage is None
        or usage.state in (UsageState.EXEMPT, UsageState.UNLIMITED, UsageState.UNKNOWN)
        or effective_mode(usage.pod.namespace, policy.limits, policy.mode) is not Mode.ENFORCE
    ):
        return Fate.NOT_GUARDED
    if listed_at is None or listed_at <= frozen.frozen_at:
        return Fate.KEEP
    if usage.state is UsageState.OK:
        return Fate.NOT_OVER
    if usage.state is UsageState.STOPPING:
        return Fate.KEEP  # its stop is under way: the bound resumes it if the kill is late
    return Fate.REFUSED
