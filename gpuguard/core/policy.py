"""The enforcement decision: a pure function of one GPU sample, attributions, pods, state and time.

Owns what to do about each pod's GPU memory: which violations are real, when to warn, when to
send SIGTERM and SIGKILL, and why nothing is done otherwise (a reason code for every refusal).
Must not do I/O, read a clock, log, or signal: the runtime executes the returned actions.

The safety invariants of DESIGN §4 live here and in ``adapters.signals``:
- a signal is only decided for a non-exempt pod of this node, over its limit on one device in at
  least two fresh samples spanning the grace period, with every process's usage known;
- nothing is decided on stale or unsynced pod data, stale GPU data, unknown usage, ghosts, host
  processes, or a PID whose occupant changed while NVML kept listing it;
- every confirmed violation ends as an action, a refusal with a reason, or is resolved.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from gpuguard.core.limits import effective_mode, is_exempt, resolve_limit
from gpuguard.core.model import (
    LIMIT_ANNOTATION,
    Attribution,
    ContainerCgroup,
    ContainerId,
    DeviceKey,
    EnforcementPolicy,
    EventReason,
    GpuDevice,
    GpuSample,
    KillTarget,
    LimitSource,
    Mode,
    NodeFacts,
    Pod,
    PodEvent,
    PodRef,
    PodSnapshot,
    PodUid,
    ProcessIdentity,
    RefusalReason,
    ResolvedLimit,
    StopSignal,
)


class Phase(enum.StrEnum):
    """Where one (pod, device) violation stands."""

    OBSERVING = "observing"
    """Over the limit, not yet for two fresh samples and the grace period."""
    TERM_SENT = "term_sent"
    KILL_SENT = "kill_sent"
    GAVE_UP = "gave_up"
    """SIGKILL did not bring the pod under its limit: reported once, not retried."""
    REFUSED = "refused"
    """Confirmed, but refused with a reason (audit mode, exempt, MPS, no container, …)."""


class UsageState(enum.StrEnum):
    """What the metrics and ``inspect`` show for one pod on one device."""

    OK = "ok"
    OVER = "over_limit"
    STOPPING = "stopping"
    UNLIMITED = "unlimited"
    EXEMPT = "exempt"
    UNKNOWN = "usage_unknown"


@dataclass(frozen=True, slots=True, kw_only=True)
class Track:
    """Bookkeeping of one (pod, device) that is over its limit."""

    first_over_at: float
    samples_over: int
    last_seq: int
    phase: Phase = Phase.OBSERVING
    phase_at: float | None = None
    refused: frozenset[RefusalReason] = frozenset()


@dataclass(frozen=True, slots=True, kw_only=True)
class EnforcerState:
    """What ``decide()`` remembers between cycles. Start with ``EnforcerState()``."""

    tracks: Mapping[tuple[PodUid, DeviceKey], Track] = field(default_factory=dict)
    listed: Mapping[int, ProcessIdentity | None] = field(default_factory=dict)
    """PIDs NVML listed in the last fresh sample, with the identity seen then (None: ghost)."""
    tainted: frozenset[int] = frozenset()
    """PIDs whose occupant changed while NVML kept listing them: never charged until delisted."""
    remembered: Mapping[int, Attribution] = field(default_factory=dict)
    """The last pod attribution of each listed PID. When the process dies but NVML keeps
    listing its PID (a forked child still holds the memory), the memory stays charged to that
    container, so container-scoped escalation can still reclaim it; dropped when the PID is
    delisted or reused."""
    noted: frozenset[tuple[str, str]] = frozenset()
    """(kind, key) of one-time notes (invalid annotation Events, per-PID refusals)."""
    last_seq: int | None = None
    inactive_reason: RefusalReason | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SignalAction:
    """Send ``signal`` to every (re-verified) member of ``target``'s container cgroup."""

    target: KillTarget
    signal: StopSignal


@dataclass(frozen=True, slots=True, kw_only=True)
class Refusal:
    """A decision not to act, with its reason code. Reported once per episode."""

    reason: RefusalReason
    pod: PodRef | None = None
    device: DeviceKey | None = None
    pid: int | None = None
    detail: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class PodUsage:
    """One pod's memory on one device this cycle (for metrics and ``inspect``)."""

    pod: PodRef
    container: str | None
    """The container's name when exactly one container of the pod uses the device."""
    device: GpuDevice
    used_bytes: int
    """Sum of the known usage of the pod's processes on the device."""
    unknown_processes: int
    limit: ResolvedLimit
    state: UsageState


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """Everything one cycle decided. The runtime executes ``signals`` and ``events`` in order."""

    state: EnforcerState
    signals: tuple[SignalAction, ...] = ()
    events: tuple[PodEvent, ...] = ()
    refusals: tuple[Refusal, ...] = ()
    usages: tuple[PodUsage, ...] = ()
    unattributed_bytes: Mapping[DeviceKey, int] = field(default_factory=dict)
    devices: tuple[GpuDevice, ...] = ()
    violations: int = 0
    """Violations confirmed this cycle (counted once each)."""
    would_signal: tuple[SignalAction, ...] = ()
    """Audit mode: what enforce mode would have sent."""
    enforcement_active: bool = False
    inactive_reason: RefusalReason | None = None


@dataclass(slots=True)
class _Group:
    """The processes of one pod on one device this sample."""

    used_bytes: int = 0
    unknown: int = 0
    containers: dict[ContainerId, ContainerCgroup] = field(default_factory=dict)
    container_bytes: dict[ContainerId, int] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)


def decide(
    *,
    sample: GpuSample | None,
    attributions: Mapping[int, Attribution],
    pods: PodSnapshot,
    node: NodeFacts,
    policy: EnforcementPolicy,
    state: EnforcerState,
    now: float,
) -> Decision:
    """Decide one enforcement cycle.

    Args:
        sample: The latest GPU sample, or ``None`` when NVML could not be read.
        attributions: PID → attribution for every PID in ``sample``, read after the sample.
        pods: The pod directory's view.
        node: Facts about this node (time-slicing replicas).
        policy: The admin's enforcement policy.
        state: What the previous call returned in ``Decision.state``.
        now: Monotonic seconds.

    Returns:
        The actions to execute, refusals with reasons, usage for metrics, and the next state.
    """
    refusals: list[Refusal] = []
    inactive = _inactive_reason(sample, pods, policy, now)
    if inactive is not None or sample is None:
        reason = inactive or RefusalReason.DATA_STALE
        if state.inactive_reason != reason:
            # One refusal per open violation when enforcement pauses: nothing silently lost.
            refusals.extend(
                Refusal(reason=reason, device=key[1], detail=f"pod {key[0]}")
                for key in state.tracks
            )
            if not state.tracks:
                refusals.append(Refusal(reason=reason, detail="enforcement paused"))
        return Decision(
            state=replace(state, inactive_reason=reason),
            refusals=tuple(refusals),
            devices=sample.devices if sample is not None else (),
            inactive_reason=reason,
        )

    fresh_sample = sample.seq != state.last_seq
    devices = {d.key: d for d in sample.devices}
    noted = set(state.noted)
    events: list[PodEvent] = []
    unattributed: dict[DeviceKey, int] = {d.key: 0 for d in sample.devices}
    groups: dict[tuple[PodUid, DeviceKey], _Group] = {}

    listed, tainted = _track_identities(sample, attributions, state)
    remembered = _remember(attributions, listed, tainted, state)
    for proc in sample.processes:
        device = devices.get(proc.device)
        if device is None:
            continue
        attribution = attributions.get(proc.pid)
        if attribution is None or attribution.identity is None:
            attribution = remembered.get(proc.pid, attribution)
        why = _unchargeable(proc.pid, attribution, tainted, pods)
        if why is not None:
            if proc.used_bytes is not None:
                unattributed[proc.device] += proc.used_bytes
            ident = attribution.identity if attribution else None
            note = ("pid", f"{proc.pid}:{ident.start_ticks if ident else 'ghost'}:{why}")
            if note not in noted:
                noted.add(note)
                refusals.append(Refusal(reason=why, device=proc.device, pid=proc.pid))
            continue
        assert attribution is not None
        assert attribution.pod_uid is not None
        group = groups.setdefault((attribution.pod_uid, proc.device), _Group())
        group.pids.append(proc.pid)
        if proc.used_bytes is None:
            group.unknown += 1
        else:
            group.used_bytes += proc.used_bytes
        if attribution.container_id is not None and attribution.cgroup is not None:
            group.containers[attribution.container_id] = attribution.cgroup
            group.container_bytes[attribution.container_id] = group.container_bytes.get(
                attribution.container_id, 0
            ) + (proc.used_bytes or 0)

    usages: list[PodUsage] = []
    signals: list[SignalAction] = []
    would: list[SignalAction] = []
    tracks: dict[tuple[PodUid, DeviceKey], Track] = {}
    violations = 0
    events.extend(_invalid_annotation_events(pods, sample, policy, node, noted))
    for (uid, key), group in groups.items():
        pod = pods.lookup(uid)
        assert pod is not None  # _unchargeable filtered unknown pods
        device = devices[key]
        ref = PodRef(uid=pod.uid, namespace=pod.namespace, name=pod.name)
        limit = resolve_limit(
            pod=pod,
            device_total_bytes=device.total_bytes,
            policy=policy.limits,
            replicas=node.replicas,
        )
        exempt = is_exempt(pod.namespace, policy.limits) or pod.uid == policy.self_pod_uid
        over = limit.limit_bytes is not None and group.used_bytes > limit.limit_bytes
        track = state.tracks.get((uid, key))
        usage_state = _usage_state(limit, group, over=over, exempt=exempt, track=track)
        usages.append(
            PodUsage(
                pod=ref,
                container=_single_container(pod, group),
                device=device,
                used_bytes=group.used_bytes,
                unknown_processes=group.unknown,
                limit=limit,
                state=usage_state,
            )
        )
        if not over:
            continue  # Under the limit (or unlimited): any open violation is resolved.
        assert limit.limit_bytes is not None
        if track is None:
            track = Track(first_over_at=sample.taken_at, samples_over=0, last_seq=-1)
        if fresh_sample and track.last_seq != sample.seq:
            track = replace(track, samples_over=track.samples_over + 1, last_seq=sample.seq)
        # Acting needs a sample taken since the last decision: a stalled GPU source replaying its
        # last sample must not confirm a violation when the grace period runs out.
        confirmed = (
            fresh_sample
            and track.samples_over >= 2
            and now - track.first_over_at >= policy.grace_seconds
        )
        if not confirmed:
            tracks[(uid, key)] = track
            continue
        refusal = _refusal_for(pod, group, device, exempt=exempt, policy=policy)
        mode = effective_mode(pod.namespace, policy.limits, policy.mode)
        targets = _targets(ref, pod, group, device, limit.limit_bytes)
        if track.phase is Phase.OBSERVING:
            violations += 1
            if refusal is None and mode is Mode.AUDIT:
                refusal = RefusalReason.AUDIT_MODE
                would.extend(SignalAction(target=t, signal=StopSignal.TERM) for t in targets)
            if refusal is not None:
                refusals.append(Refusal(reason=refusal, pod=ref, device=key))
                track = replace(
                    track, phase=Phase.REFUSED, phase_at=now, refused=frozenset({refusal})
                )
            else:
                events.append(_exceeded_event(ref, device, group.used_bytes, limit))
                signals.extend(SignalAction(target=t, signal=StopSignal.TERM) for t in targets)
                track = replace(track, phase=Phase.TERM_SENT, phase_at=now)
        elif track.phase in (Phase.TERM_SENT, Phase.KILL_SENT):
            assert track.phase_at is not None
            waited = now - track.phase_at >= policy.termination_timeout_seconds
            measured_after = sample.taken_at > track.phase_at
            if waited and measured_after:
                if refusal is not None:
                    # Became unsafe to act (e.g. usage turned unknown) mid-escalation.
                    refusals.append(Refusal(reason=refusal, pod=ref, device=key))
                    track = replace(track, phase=Phase.REFUSED, refused=frozenset({refusal}))
                elif track.phase is Phase.TERM_SENT:
                    signals.extend(SignalAction(target=t, signal=StopSignal.KILL) for t in targets)
                    track = replace(track, phase=Phase.KILL_SENT, phase_at=now)
                else:
                    refusals.append(
                        Refusal(
                            reason=RefusalReason.KILL_INEFFECTIVE,
                            pod=ref,
                            device=key,
                            detail=f"still {group.used_bytes} bytes after SIGKILL",
                        )
                    )
                    track = replace(track, phase=Phase.GAVE_UP, phase_at=now)
        elif track.phase is Phase.REFUSED and refusal is None and mode is Mode.ENFORCE:
            # The reason went away (e.g. usage known again, mode switched): start over.
            track = Track(first_over_at=sample.taken_at, samples_over=1, last_seq=sample.seq)
        tracks[(uid, key)] = track

    return Decision(
        state=EnforcerState(
            tracks=tracks,
            listed=listed,
            tainted=tainted,
            remembered=remembered,
            noted=_prune_noted(noted, listed, pods),
            last_seq=sample.seq,
            inactive_reason=None,
        ),
        signals=tuple(signals),
        events=tuple(events),
        refusals=tuple(refusals),
        usages=tuple(usages),
        unattributed_bytes=unattributed,
        devices=sample.devices,
        violations=violations,
        would_signal=tuple(would),
        enforcement_active=True,
    )


def _inactive_reason(
    sample: GpuSample | None, pods: PodSnapshot, policy: EnforcementPolicy, now: float
) -> RefusalReason | None:
    if sample is None or now - sample.taken_at > policy.staleness_seconds:
        return RefusalReason.DATA_STALE
    if not pods.synced:
        return RefusalReason.POD_CACHE_UNSYNCED
    if pods.last_contact_at is None or now - pods.last_contact_at > policy.staleness_seconds:
        return RefusalReason.POD_CACHE_STALE
    return None


def _track_identities(
    sample: GpuSample, attributions: Mapping[int, Attribution], state: EnforcerState
) -> tuple[dict[int, ProcessIdentity | None], frozenset[int]]:
    """Follow each listed PID's occupant; taint PIDs whose occupant changed while listed.

    NVML can keep listing a PID after its process died (memory held by a forked child, or a
    driver lag), and the kernel can hand that PID to a new process meanwhile: the new occupant
    must never be charged for the old one's memory (reference §3.3).
    """
    listed: dict[int, ProcessIdentity | None] = {}
    tainted: set[int] = set()
    for pid in {p.pid for p in sample.processes}:
        attribution = attributions.get(pid)
        identity = attribution.identity if attribution is not None else None
        listed[pid] = identity
        # A live occupant that differs from the one seen before (or from a ghost) is a reuse;
        # a process that merely died (identity → None) is not.
        changed = pid in state.listed and identity is not None and state.listed[pid] != identity
        if pid in state.tainted or changed:
            tainted.add(pid)
    return listed, frozenset(tainted)


def _remember(
    attributions: Mapping[int, Attribution],
    listed: Mapping[int, ProcessIdentity | None],
    tainted: frozenset[int],
    state: EnforcerState,
) -> dict[int, Attribution]:
    """Pod attributions of listed PIDs, carried over while their process is a ghost."""
    remembered: dict[int, Attribution] = {}
    for pid, identity in listed.items():
        if pid in tainted:
            continue
        attribution = attributions.get(pid)
        if identity is None:
            if pid in state.remembered:
                remembered[pid] = state.remembered[pid]
        elif (
            attribution is not None
            and attribution.pod_uid is not None
            and attribution.holds_gpu is not False
        ):
            remembered[pid] = attribution
    return remembered


def _unchargeable(
    pid: int, attribution: Attribution | None, tainted: frozenset[int], pods: PodSnapshot
) -> RefusalReason | None:
    """Why this process's memory cannot be charged to a pod, or ``None`` if it can."""
    if attribution is None or attribution.identity is None:
        return RefusalReason.GHOST
    if pid in tainted or attribution.holds_gpu is False:
        return RefusalReason.IDENTITY_CHANGED
    if attribution.pod_uid is None:
        return RefusalReason.NOT_A_POD
    if pods.lookup(attribution.pod_uid) is None:
        return RefusalReason.POD_UNKNOWN
    return None


def _refusal_for(
    pod: Pod, group: _Group, device: GpuDevice, *, exempt: bool, policy: EnforcementPolicy
) -> RefusalReason | None:
    if exempt:
        return RefusalReason.EXEMPT
    if group.unknown:
        return RefusalReason.USAGE_UNKNOWN
    if device.mps:
        return RefusalReason.MPS
    if not group.containers:
        return RefusalReason.NO_CONTAINER
    return None


def _targets(
    ref: PodRef, pod: Pod, group: _Group, device: GpuDevice, limit_bytes: int
) -> list[KillTarget]:
    return [
        KillTarget(
            pod=ref,
            container_id=cid,
            container_name=pod.containers.get(cid),
            cgroup=cgroup,
            device=device.key,
            gpu_index=device.index,
            used_bytes=group.used_bytes,
            limit_bytes=limit_bytes,
        )
        for cid, cgroup in sorted(group.containers.items())
    ]


def _usage_state(
    limit: ResolvedLimit, group: _Group, *, over: bool, exempt: bool, track: Track | None
) -> UsageState:
    if exempt:
        return UsageState.EXEMPT
    if group.unknown:
        return UsageState.UNKNOWN
    if limit.limit_bytes is None:
        return UsageState.UNLIMITED
    if not over:
        return UsageState.OK
    if track is not None and track.phase in (Phase.TERM_SENT, Phase.KILL_SENT):
        return UsageState.STOPPING
    return UsageState.OVER


def _single_container(pod: Pod, group: _Group) -> str | None:
    if len(group.containers) != 1:
        return None
    (cid,) = group.containers
    return pod.containers.get(cid)


def _prune_noted(
    noted: set[tuple[str, str]], listed: Mapping[int, ProcessIdentity | None], pods: PodSnapshot
) -> frozenset[tuple[str, str]]:
    """Forget notes about PIDs no longer listed and pods no longer known (bounded memory)."""
    kept = set()
    for kind, key in noted:
        if kind == "pid":
            if int(key.split(":", 1)[0]) in listed:
                kept.add((kind, key))
        elif pods.lookup(PodUid(key.split(":", 1)[0])) is not None:
            kept.add((kind, key))
    return frozenset(kept)


def _fmt_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f}{unit}" if unit != "B" else f"{n}B"
        value /= 1024
    return f"{n}B"


def _exceeded_event(
    ref: PodRef, device: GpuDevice, used_bytes: int, limit: ResolvedLimit
) -> PodEvent:
    assert limit.limit_bytes is not None
    where = f"GPU {device.index}" + (
        f" MIG instance {device.gpu_instance_id}" if device.gpu_instance_id is not None else ""
    )
    source = limit.source.value if isinstance(limit.source, LimitSource) else "unknown"
    return PodEvent(
        pod=ref,
        reason=EventReason.LIMIT_EXCEEDED,
        message=(
            f"GPU memory {_fmt_bytes(used_bytes)} on {where} ({device.uuid}) exceeds the limit "
            f"{_fmt_bytes(limit.limit_bytes)} (from {source}); stopping the offending containers"
        ),
    )


def _invalid_annotation_events(
    pods: PodSnapshot,
    sample: GpuSample,
    policy: EnforcementPolicy,
    node: NodeFacts,
    noted: set[tuple[str, str]],
) -> list[PodEvent]:
    """One ``InvalidGPUMemoryLimit`` Event per pod and rejected value, GPU user or not."""
    total = sample.devices[0].total_bytes if sample.devices else None
    events = []
    seen: set[PodUid] = set()
    for pod in pods.pods.values():
        if pod.annotation_error is None or pod.uid in seen:
            continue
        seen.add(pod.uid)
        # A digest, not the value: a tenant's value may be 256 KiB, kept here for the process's
        # life.
        value = pod.annotations.get(LIMIT_ANNOTATION, "")
        note = ("invalid", f"{pod.uid}:{hashlib.sha256(value.encode()).hexdigest()[:32]}")
        if note in noted:
            continue
        noted.add(note)
        limit = resolve_limit(
            pod=pod, device_total_bytes=total, policy=policy.limits, replicas=node.replicas
        )
        ref = PodRef(uid=pod.uid, namespace=pod.namespace, name=pod.name)
        events.append(_invalid_event(ref, pod, limit))
    return events


def _invalid_event(ref: PodRef, pod: Pod, limit: ResolvedLimit) -> PodEvent:
    fallback = (
        f"the {limit.source.value} limit {_fmt_bytes(limit.limit_bytes)} applies instead"
        if limit.source is not None and limit.limit_bytes is not None
        else "no limit applies"
    )
    return PodEvent(
        pod=ref,
        reason=EventReason.INVALID_LIMIT,
        message=f"gpuguard.io/gpu-memory-limit rejected: {pod.annotation_error}; {fallback}",
    )
