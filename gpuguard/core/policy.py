"""The enforcement decision: a pure function of one GPU sample, attributions, pods, state and time.

Owns what to do about each pod's GPU memory: which violations are real, when to warn, when to
send SIGTERM and SIGKILL, and why nothing is done otherwise (a reason code for every refusal).
Must not do I/O, read a clock, log, or signal: the runtime executes the returned actions.

The safety invariants (docs/design.md, Safety invariants) live here and in ``adapters.killer``:
- a signal is only decided for a non-exempt pod of this node, over its limit on one device in at
  least two fresh listings of that device spanning the grace period (or, when the device is
  under memory pressure, two fresh listings alone; or one fresh listing taken after the
  allocation guard froze a caller of the pod at an allocation that listing shows over the
  limit), with every process's usage known;
- nothing is decided on stale or unsynced pod data, stale GPU data, unknown usage, ghosts, host
  processes, or a PID whose occupant changed while NVML kept listing it;
- every confirmed violation ends as an action, a refusal with a reason, or is resolved.

Size: over 600 lines, on purpose: decide() and its steps are one state machine over Track and
EnforcerState; kept together so the safety invariants above are checked in one reviewable file, and
mutations (scripts/mutations.py) name one place.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import cast

from gpuguard.core.allocation import UNKNOWN_ALLOCATIONS, AllocationCheck, NodeAllocations
from gpuguard.core.assess import Assessment, Charge, Charges, assess_all, charge
from gpuguard.core.dra_shares import (
    ShareGroup,
    ShareUse,
    describe_group,
    largest_first,
    share_groups,
    share_uses,
    shares_on_device,
)
from gpuguard.core.limits import effective_mode, in_pod_cap, resolve_limit
from gpuguard.core.model import (
    GPUGUARD_SOURCE,
    LIMIT_ANNOTATION,
    Attribution,
    ContainerId,
    DeviceKey,
    DeviceMemory,
    EnforcementPolicy,
    EventReason,
    GpuDevice,
    GpuSample,
    InPodCap,
    KillTarget,
    LimitSource,
    ListingDue,
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
    SharedBudget,
    StopSignal,
    Trigger,
)
from gpuguard.core.units import format_bytes


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
    """When the first listing that showed the pod over was taken."""
    samples_over: int
    """Distinct listings of the device that showed the pod over."""
    last_seq: int
    """The seq of the last listing counted in ``samples_over``."""
    phase: Phase = Phase.OBSERVING
    phase_at: float | None = None
    refused: frozenset[RefusalReason] = frozenset()
    trigger: Trigger = Trigger.GRACE
    """What confirmed the violation (set when it is confirmed)."""
    sigterm_sent_to: frozenset[ContainerId] = frozenset()
    """Containers sent SIGTERM in this escalation: only they can be sent its SIGKILL. A
    container that appears mid-escalation (a restart: new container ID, new processes, the pod
    still over its limit) starts with a SIGTERM of its own."""
    reread_asked_at: float | None = None
    """When the violation, due to be acted on, asked for the DRA claims behind its limit to be
    read again (``Decision.reread``): it is acted on only on a read sent since."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EnforcerState:
    """What ``decide()`` remembers between cycles. Start with ``EnforcerState()``."""

    tracks: Mapping[tuple[PodUid, DeviceKey], Track] = field(default_factory=dict)
    listed: Mapping[int, ProcessIdentity | None] = field(default_factory=dict)
    """PIDs NVML listed in the last fresh sample, with the identity seen then (None: ghost)."""
    tainted: frozenset[int] = frozenset()
    """PIDs whose occupant changed while NVML kept listing them, or whose occupant started after
    the PID was first listed: never charged until delisted."""
    listed_since: Mapping[int, float] = field(default_factory=dict)
    """When each listed PID was first listed in its current unbroken run of listings (the
    listing's ``taken_at``): how long NVML has kept listing it is how sure its occupant owns
    the memory when it holds no GPU file (``EnforcementPolicy.owner_settle_seconds``)."""
    remembered: Mapping[int, Attribution] = field(default_factory=dict)
    """The last pod attribution of each listed PID (one without a GPU file open too). When the
    process dies but NVML keeps listing its PID (a forked child still holds the memory), the
    memory stays charged to that container, so container-scoped escalation can still reclaim
    it — at once if the process had a GPU file open, else once the PID is settled; dropped
    when the PID is delisted or reused."""
    pods_listed: Mapping[PodUid, tuple[float, float]] = field(default_factory=dict)
    """Per pod, ``(since, last)``: when NVML began listing the pod's processes, in a run of
    listings with no gap longer than ``owner_settle_seconds``, and when it last did. A pod
    listed that long owns what its processes list even when each is short-lived and holds no
    GPU file open (``_track_identities``)."""
    reported_once: frozenset[tuple[str, str]] = frozenset()
    """(kind, key) of what is reported only once (invalid annotation Events, per-PID refusals)."""
    last_seq: int | None = None
    inactive_reason: RefusalReason | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SignalAction:
    """Send ``signal`` to every (re-verified) member of ``target``'s container cgroup."""

    target: KillTarget
    signal: StopSignal
    trigger: Trigger = Trigger.GRACE
    """What confirmed the violation the signal is for."""


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
    allocation: AllocationCheck | None = None
    """Whether what the pod was allocated names the device (``core.allocation``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class UnallocatedUse:
    """A pod's memory on a device that none of its allocations names, reported this cycle
    (once per pod and device): ``gpuguard_unallocated_gpu_use_total``."""

    pod: PodRef
    device: GpuDevice
    containers: tuple[str, ...]
    used_bytes: int
    allocated: str
    """What the pod was allocated (``AllocationCheck.allocated``)."""


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
    violations: tuple[Trigger, ...] = ()
    """Violations confirmed this cycle, one entry each, with what confirmed it."""
    urgent: Mapping[DeviceKey, ListingDue] = field(default_factory=dict)
    """Devices with a violation in progress (waiting for its second listing, its grace period
    or its termination timeout), with when a listing can move it on: change-driven sampling
    lists them at every fast read from then (or while the device is under pressure, for a
    violation pressure can confirm), so the next step lands within a fast interval of being
    due, not a poll interval, and no listing is spent before it (each costs ~11 µs per process
    on the device)."""
    listing_ages: Mapping[DeviceKey, float] = field(default_factory=dict)
    """Seconds since each device's processes were last listed (metrics show the listing's
    age where change-driven sampling skipped listings)."""
    would_signal: tuple[SignalAction, ...] = ()
    """Audit mode: what enforce mode would have sent."""
    reread: Mapping[PodUid, float] = field(default_factory=dict)
    """Pods whose violation is due to be acted on but whose DRA limit rests on claims read
    before that moment, each with the moment: the runtime asks the pod directory to read them
    again (``PodDirectory.reread``), and the violation waits for that read. A claim deleted or
    deallocated in the grace period changes no pod, so no watch announces it: this read does."""
    unallocated: tuple[UnallocatedUse, ...] = ()
    """GPU use without an allocation reported this cycle (each once per pod and device)."""
    allocations_due: bool = False
    """A stop of GPU use without an allocation waits for the kubelet's pod resources read since
    the use was first seen: the runtime reads them now instead of at its next interval."""
    enforcement_active: bool = False
    inactive_reason: RefusalReason | None = None


def decide(
    *,
    sample: GpuSample | None,
    attributions: Mapping[int, Attribution],
    pods: PodSnapshot,
    node: NodeFacts,
    policy: EnforcementPolicy,
    state: EnforcerState,
    now: float,
    blocked: Refusal | None = None,
    standby: Refusal | None = None,
    allocations: NodeAllocations = UNKNOWN_ALLOCATIONS,
    frozen: Mapping[tuple[PodUid, DeviceKey], float] | None = None,
) -> Decision:
    """Decide one enforcement cycle: gate → charge → assess → advance each violation's track.

    Args:
        sample: The latest GPU sample, or ``None`` when NVML could not be read.
        attributions: PID → attribution for every PID in ``sample``, read after the sample.
        pods: The pod directory's view.
        node: Facts about this node (time-slicing replicas).
        policy: The admin's enforcement policy.
        state: What the previous call returned in ``Decision.state``.
        now: Monotonic seconds.
        blocked: Set when no signal can be sent at all (outside the host PID namespace, or
            without CAP_KILL): every violation that would be acted on is refused with this
            reason instead, once, so a signal never sent is never counted as sent.
        standby: Set while another enforcer on this node holds the node lock: the cycle
            pauses with this reason, ahead of every other, like an inactive one: nothing is
            signalled, posted or counted as a violation (the holder does that), and only the
            pause itself is refused, once.
        allocations: The kubelet's pod resources (``core.allocation``); unknown by default.
        frozen: (pod, device) → the monotonic moment the allocation guard's earliest frozen
            caller of the pod on the device was taken in (its allocation already counted in
            ``sample``: ``core.freeze.with_frozen``). A listing of the device taken after it
            that shows the pod over confirms the violation at once (``Trigger.ALLOCATION``).

    Returns:
        The actions to execute, refusals with reasons, usage for metrics, and the next state.
    """
    paused = _pause(sample, pods, policy, state, now=now, standby=standby)
    if paused is not None or sample is None:
        assert paused is not None
        return paused

    pods = _namespaces_judged(pods, policy, now)
    reported = set(state.reported_once)
    owners = _track_identities(sample, attributions, state, policy)
    listed, tainted = owners.listed, owners.tainted
    remembered = _remember(attributions, owners, state)
    charges = charge(
        sample,
        attributions,
        pods,
        tainted=tainted,
        settled=owners.settled,
        remembered=remembered,
    )
    assessments = assess_all(
        charges, pods, {d.key: d for d in sample.devices}, policy, node.replicas,
        allocations=allocations, now=now,
    )  # fmt: skip

    out = _Outcome(refusals=_uncharged_refusals(charges, reported, owners.tainted, policy))
    out.events.extend(_invalid_annotation_events(pods, sample, policy, node, reported))
    step = _Step(sample=sample, now=now, policy=policy, blocked=blocked, frozen=frozen or {})
    tracks = _advance_all(
        step, assessments=assessments, pods=pods, charges=charges, state=state,
        reported=reported, out=out,
    )  # fmt: skip
    tracks.update(_unreadable_device_tracks(sample, state, tracks, reported, out))

    return Decision(
        state=EnforcerState(
            tracks=tracks,
            listed=listed,
            tainted=tainted,
            listed_since=owners.listed_since,
            remembered=remembered,
            pods_listed=owners.pods_listed,
            reported_once=_prune_reported(reported, listed, pods),
            last_seq=sample.seq,
            inactive_reason=None,
        ),
        signals=tuple(out.signals),
        events=tuple(out.events),
        refusals=tuple(out.refusals),
        usages=tuple(out.usages),
        unattributed_bytes=charges.unattributed_bytes,
        devices=sample.devices,
        violations=tuple(out.violations),
        would_signal=tuple(out.would),
        reread=out.reread,
        unallocated=tuple(out.unallocated),
        allocations_due=out.allocations_due,
        enforcement_active=True,
        urgent=_listings_due(tracks, sample, policy),
        listing_ages=_listing_ages(sample, now),
    )


def _pause(
    sample: GpuSample | None,
    pods: PodSnapshot,
    policy: EnforcementPolicy,
    state: EnforcerState,
    *,
    now: float,
    standby: Refusal | None,
) -> Decision | None:
    """The paused decision when this enforcer stands by, or its data cannot be acted on."""
    if standby is not None:
        paused = _paused(sample, state, standby.reason, standby.detail)
        return replace(paused, listing_ages=_listing_ages(sample, now))
    inactive = _inactive_reason(sample, pods, policy, now)
    if inactive is not None or sample is None:
        paused = _paused(sample, state, inactive or RefusalReason.DATA_STALE)
        return replace(paused, listing_ages=_listing_ages(sample, now))
    return None


def _listings_due(
    tracks: Mapping[tuple[PodUid, DeviceKey], Track], sample: GpuSample, policy: EnforcementPolicy
) -> dict[DeviceKey, ListingDue]:
    """When each device with a violation in progress next needs a listing (``Decision.urgent``):
    an observed violation when its grace period runs out, or as soon as its device is under
    pressure; an escalating one when its termination timeout runs out."""
    due: dict[DeviceKey, ListingDue] = {}
    for (_, key), track in tracks.items():
        if track.phase is Phase.OBSERVING:
            memory = sample.memory.get(key)
            pressed_below = (
                policy.pressure_free_fraction * memory.total_bytes if memory is not None else 0.0
            )
            wanted = ListingDue(
                at=track.first_over_at + policy.grace_seconds, free_below_bytes=pressed_below
            )
        elif track.phase in _ESCALATING:
            assert track.phase_at is not None
            wanted = ListingDue(at=track.phase_at + policy.termination_timeout_seconds)
        else:
            continue  # refused or given up: waits for a change, at the usual listings
        due[key] = wanted if key not in due else due[key].merged(wanted)
    return due


def _listing_ages(sample: GpuSample | None, now: float) -> dict[DeviceKey, float]:
    if sample is None:
        return {}
    return {d.key: max(0.0, now - sample.listing(d.key).taken_at) for d in sample.devices}


@dataclass(frozen=True, slots=True, kw_only=True)
class _Step:
    """What every track's advance this cycle shares."""

    sample: GpuSample
    now: float
    policy: EnforcementPolicy
    blocked: Refusal | None
    frozen: Mapping[tuple[PodUid, DeviceKey], float] = field(default_factory=dict)
    """``decide``'s ``frozen``."""


@dataclass(slots=True)
class _Outcome:
    """What the cycle decided so far (the advance steps append to it)."""

    signals: list[SignalAction] = field(default_factory=list)
    would: list[SignalAction] = field(default_factory=list)
    events: list[PodEvent] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    usages: list[PodUsage] = field(default_factory=list)
    violations: list[Trigger] = field(default_factory=list)
    reread: dict[PodUid, float] = field(default_factory=dict)
    unallocated: list[UnallocatedUse] = field(default_factory=list)
    allocations_due: bool = False


def _advance_all(
    step: _Step,
    *,
    assessments: Mapping[tuple[PodUid, DeviceKey], Assessment],
    pods: PodSnapshot,
    charges: Charges,
    state: EnforcerState,
    reported: set[tuple[str, str]],
    out: _Outcome,
) -> dict[tuple[PodUid, DeviceKey], Track]:
    """Each pod's verdict per device: its usage reported, an unassigned share noted, and the
    violation of one over its limit advanced a step; the tracks of those over their limits
    (one under its limit, or unlimited, has none: any open violation of it is resolved). Then
    those of the pods holding a DRA share together, over it (``_advance_shared``)."""
    tracks: dict[tuple[PodUid, DeviceKey], Track] = {}
    for key, verdict in assessments.items():
        pod = pods.lookup(key[0])
        assert pod is not None
        track = state.tracks.get(key)
        out.usages.append(_usage(verdict, pod, charges.by_pod[key], track))
        if verdict.unassigned:
            _unassigned_finding(verdict, reported, out)
        if verdict.unallocated:
            _unallocated_finding(verdict, pod, charges.by_pod[key], reported, out)
        if not verdict.over:
            continue
        tracks[key] = _advance(
            step, pod=pod, verdict=verdict, charged=charges.by_pod[key], track=track, out=out
        )
    shared = _advance_shared(
        step, assessments=assessments, charges=charges, state=state, tracks=tracks, pods=pods,
        out=out,
    )  # fmt: skip
    return {**tracks, **shared}


def _paused(
    sample: GpuSample | None, state: EnforcerState, reason: RefusalReason, detail: str = ""
) -> Decision:
    """Enforcement cannot act this cycle: one refusal per open violation when it pauses, so
    nothing is silently lost. ``detail``: what the pause itself is refused with."""
    refusals: list[Refusal] = []
    if state.inactive_reason != reason:
        refusals.extend(
            Refusal(reason=reason, device=key[1], detail=f"pod {key[0]}") for key in state.tracks
        )
        if not state.tracks:
            why = f"enforcement paused: {detail}" if detail else "enforcement paused"
            refusals.append(Refusal(reason=reason, detail=why))
    return Decision(
        state=replace(state, inactive_reason=reason),
        refusals=tuple(refusals),
        devices=sample.devices if sample is not None else (),
        inactive_reason=reason,
    )


def _unreadable_device_tracks(
    sample: GpuSample,
    state: EnforcerState,
    tracks: Mapping[tuple[PodUid, DeviceKey], Track],
    reported: set[tuple[str, str]],
    out: _Outcome,
) -> dict[tuple[PodUid, DeviceKey], Track]:
    """Open violations on a device NVML could not read this cycle: kept as they are (not
    resolved: nothing was measured) and refused once with ``device_unavailable``."""
    skipped = {s.uuid for s in sample.skipped if s.uuid is not None}
    # A device readable again: its next outage is reported again.
    reported.difference_update(
        n for n in list(reported) if n[0] == "device" and n[1].split(":", 1)[1] not in skipped
    )
    kept: dict[tuple[PodUid, DeviceKey], Track] = {}
    for (uid, key), track in state.tracks.items():
        if (uid, key) in tracks or key.uuid not in skipped:
            continue
        kept[(uid, key)] = track
        note = ("device", f"{uid}:{key.uuid}")
        if note not in reported:
            reported.add(note)
            out.refusals.append(
                Refusal(reason=RefusalReason.DEVICE_UNAVAILABLE, device=key, detail=f"pod {uid}")
            )
    return kept


def _unassigned_finding(verdict: Assessment, reported: set[tuple[str, str]], out: _Outcome) -> None:
    """Memory on a GPU the pod's scheduler did not assign it: reported once per pod and GPU
    (a refusal record, so a log line and the metric ``unassigned_device``, and an Event), with
    the limit that holds it there. Not a refusal to act: the pin, which a tenant can write,
    only keeps its scheduler's declaration from granting memory on this GPU."""
    device = verdict.device
    note = ("unassigned", f"{verdict.pod.uid}:{device.uuid}:{device.gpu_instance_id}")
    if note in reported:
        return
    reported.add(note)
    limit = verdict.limit
    pins = sorted({p for d in limit.declarations if not d.assigned for p in d.pinned})
    names = " and ".join(str(s) for s in verdict.unassigned)
    held = (
        "no limit applies here either"
        if limit.limit_bytes is None
        else f"it is held here to {format_bytes(limit.limit_bytes)} (from {limit.source})"
    )
    detail = (
        f"{format_bytes(verdict.used_bytes)} on GPU {device.index} ({device.uuid}), which "
        f"{names} did not assign the pod (pinned to {', '.join(pins)}): that declaration grants "
        f"no memory here; {held}"
    )
    out.refusals.append(
        Refusal(reason=RefusalReason.UNASSIGNED_DEVICE, pod=verdict.pod, device=device.key,
                detail=detail)
    )  # fmt: skip
    out.events.append(
        PodEvent(pod=verdict.pod, reason=EventReason.UNASSIGNED_DEVICE, message=detail)
    )


def _uncharged_refusals(
    charges: Charges,
    reported: set[tuple[str, str]],
    tainted: frozenset[int],
    policy: EnforcementPolicy,
) -> list[Refusal]:
    """One refusal per process (identity) whose memory no pod can be charged for."""
    refusals = []
    for u in charges.uncharged:
        ident = u.attribution.identity if u.attribution else None
        note = ("pid", f"{u.proc.pid}:{ident.start_ticks if ident else 'ghost'}:{u.reason}")
        if note not in reported:
            reported.add(note)
            detail = ""
            if u.reason is RefusalReason.IDENTITY_CHANGED and u.proc.pid not in tainted:
                detail = (
                    "holds no GPU device file: it may have been handed a dead process's PID; "
                    "its listed memory is charged to it once NVML has kept listing it for "
                    f"{policy.owner_settle_seconds:g} s"
                )
            elif u.reason is RefusalReason.IDENTITY_CHANGED:
                detail = "the PID changed hands, or its process started after it was first listed"
            refusals.append(
                Refusal(reason=u.reason, device=u.proc.device, pid=u.proc.pid, detail=detail)
            )
    return refusals


def _usage(verdict: Assessment, pod: Pod, charged: Charge, track: Track | None) -> PodUsage:
    state = UsageState(verdict.verdict.value)
    if state is UsageState.OVER and track is not None and track.phase in _ESCALATING:
        state = UsageState.STOPPING
    return PodUsage(
        pod=verdict.pod,
        container=_single_container(pod, charged),
        device=verdict.device,
        used_bytes=verdict.used_bytes,
        unknown_processes=verdict.unknown_processes,
        limit=verdict.limit,
        state=state,
        allocation=verdict.allocation,
    )


_ESCALATING = (Phase.TERM_SENT, Phase.KILL_SENT)


def _advance(
    step: _Step,
    *,
    pod: Pod,
    verdict: Assessment,
    charged: Charge,
    track: Track | None,
    out: _Outcome,
) -> Track:
    """One over-limit (pod, device): count the device's listing, and once the violation is
    confirmed (two fresh listings, then the grace period or device pressure) act, escalate, or
    refuse with a reason."""
    listing = step.sample.listing(verdict.device.key)
    if track is None:
        track = Track(first_over_at=listing.taken_at, samples_over=0, last_seq=-1)
    # Acting needs a listing of the device taken since the last decision: a stalled GPU source
    # replaying its last sample, or change-driven sampling carrying an old listing over, must
    # not confirm a violation when the grace period runs out or the device fills up.
    fresh = listing.seq != track.last_seq
    if not fresh:
        return track
    track = replace(track, samples_over=track.samples_over + 1, last_seq=listing.seq)
    trigger = _trigger(step, verdict.device.key, track, verdict.pod.uid)
    if trigger is None:
        return track
    mode = effective_mode(pod.namespace, step.policy.limits, step.policy.mode)
    stopping = track.sigterm_sent_to if track.phase in _ESCALATING else frozenset()
    targets = _targets(pod, verdict, charged, stopping)
    if track.phase is Phase.OBSERVING:
        track = replace(track, trigger=trigger)
        return _confirm(step, verdict=verdict, targets=targets, mode=mode, track=track, out=out)
    if track.phase in _ESCALATING:
        return _escalate(step, verdict, targets, track, out)
    if track.phase is Phase.REFUSED and _refusal(verdict, step, mode) is None:
        # The reason went away (e.g. usage known again, mode switched): start over.
        return Track(first_over_at=listing.taken_at, samples_over=1, last_seq=listing.seq)
    return track


def _claims_to_reread(limit: ResolvedLimit, track: Track, now: float) -> float | None:
    """When a DRA limit binds, the moment its claims must have been read since before the
    violation is acted on (``None``: read since, or not a DRA limit). The claims are read when
    the pods naming them change and otherwise only every minute (no watch of claims: docs/
    design.md, DRA memory shares), so a share deleted or deallocated in the grace period would
    still be the limit; one GET per claim of the offending pod, a few milliseconds, settles it.
    A default standing in for shares not known yet (``ResolvedLimit.awaits_dra``) waits the
    same way: the read may show shares larger than the default."""
    if limit.source is not LimitSource.DRA and not limit.awaits_dra:
        return None
    asked = track.reread_asked_at if track.reread_asked_at is not None else now
    reads = [d.read_at for d in limit.declarations if d.source is LimitSource.DRA and d.assigned]
    if reads and all(r is not None and r >= asked for r in reads):
        return None
    return asked


def _allocation_read_since(verdict: Assessment, track: Track) -> bool:
    """GPU use without an allocation is stopped only on a pod-resources answer read since the
    use was first seen: the kubelet names no pod UID, so an answer from before could be of an
    earlier pod of the same name (a StatefulSet's replacement)."""
    read_at = verdict.allocation.read_at
    return read_at is not None and read_at >= track.first_over_at


def _trigger(
    step: _Step, key: DeviceKey, track: Track, uid: PodUid | None = None
) -> Trigger | None:
    """What confirms the violation now, if anything: a fresh listing (the caller counted this
    one) taken after the allocation guard froze a caller of the pod on the device; else two
    fresh listings, then the whole grace period, or the device under memory pressure."""
    frozen_at = step.frozen.get((uid, key)) if uid is not None else None
    if frozen_at is not None and step.sample.listing(key).taken_at > frozen_at:
        return Trigger.ALLOCATION
    if track.trigger is Trigger.ALLOCATION and track.phase in _ESCALATING:
        # Confirmed by a frozen allocation, which is gone once resumed or killed: the stop
        # it started escalates at the termination timeout, not at the end of a grace period.
        return Trigger.ALLOCATION
    if track.samples_over < 2:
        return None
    if step.now - track.first_over_at >= step.policy.grace_seconds:
        return Trigger.GRACE
    if under_pressure(step.sample, key, step.policy):
        return Trigger.PRESSURE
    return None


_ALLOCATION_WHY = (
    "; an allocation that would take it there was frozen before it ran: grace period skipped"
)


def under_pressure(sample: GpuSample, key: DeviceKey, policy: EnforcementPolicy) -> bool:
    """Whether the device's free memory, as last read, is below ``pressure_free_fraction`` of
    its total (never when it was not read or pressure is off)."""
    memory = sample.memory.get(key)
    return memory is not None and memory_pressed(memory, policy.pressure_free_fraction)


def memory_pressed(memory: DeviceMemory, fraction: float) -> bool:
    """Free memory below ``fraction`` of the total (0 turns pressure off)."""
    return (
        fraction > 0
        and memory.total_bytes > 0
        and memory.free_bytes < fraction * memory.total_bytes
    )


def _refusal(verdict: Assessment, step: _Step, mode: Mode) -> RefusalReason | None:
    """Why this confirmed violation is not acted on, in order of precedence."""
    if verdict.refusal is not None:
        return verdict.refusal
    if mode is Mode.AUDIT:
        return RefusalReason.AUDIT_MODE
    if step.blocked is not None:
        return step.blocked.reason
    return None


def _confirm(
    step: _Step,
    *,
    verdict: Assessment,
    targets: list[KillTarget],
    mode: Mode,
    track: Track,
    out: _Outcome,
) -> Track:
    """A newly confirmed violation: SIGTERM, or one refusal with its reason; first, for a DRA
    limit, a read of its claims sent since (``Decision.reread``)."""
    asked = _claims_to_reread(verdict.limit, track, step.now)
    if asked is not None:
        out.reread[verdict.pod.uid] = min(asked, out.reread.get(verdict.pod.uid, asked))
        return replace(track, reread_asked_at=asked)
    if verdict.unallocated_stop and not _allocation_read_since(verdict, track):
        out.allocations_due = True
        return track
    out.violations.append(track.trigger)
    refusal = _refusal(verdict, step, mode)
    key = verdict.device.key
    if refusal is None:
        memory = step.sample.memory.get(key)
        out.events.append(
            _unallocated_stop_event(verdict, track.trigger)
            if verdict.unallocated_stop
            else _exceeded_event(verdict, track.trigger, memory, targets)
        )
        out.signals.extend(
            SignalAction(target=t, signal=StopSignal.TERM, trigger=track.trigger) for t in targets
        )
        sent_to = frozenset(t.container_id for t in targets)
        return replace(track, phase=Phase.TERM_SENT, phase_at=step.now, sigterm_sent_to=sent_to)
    if refusal is RefusalReason.AUDIT_MODE:
        out.would.extend(
            SignalAction(target=t, signal=StopSignal.TERM, trigger=track.trigger) for t in targets
        )
    detail = step.blocked.detail if step.blocked and refusal is step.blocked.reason else ""
    out.refusals.append(Refusal(reason=refusal, pod=verdict.pod, device=key, detail=detail))
    return replace(track, phase=Phase.REFUSED, phase_at=step.now, refused=frozenset({refusal}))


def _escalate(
    step: _Step, verdict: Assessment, targets: list[KillTarget], track: Track, out: _Outcome
) -> Track:
    """SIGTERM (or SIGKILL) was sent: after the termination timeout and a listing of the device
    taken since, SIGKILL to the containers sent SIGTERM, SIGTERM to containers new since (a
    restart), or give up once with ``kill_ineffective``."""
    assert track.phase_at is not None
    waited = step.now - track.phase_at >= step.policy.termination_timeout_seconds
    if not (waited and step.sample.listing(verdict.device.key).taken_at > track.phase_at):
        return track
    key = verdict.device.key
    if verdict.refusal is not None:
        # Became unsafe to act (e.g. usage turned unknown) mid-escalation.
        out.refusals.append(Refusal(reason=verdict.refusal, pod=verdict.pod, device=key))
        return replace(track, phase=Phase.REFUSED, refused=frozenset({verdict.refusal}))
    fresh = [t for t in targets if t.container_id not in track.sigterm_sent_to]
    if track.phase is Phase.TERM_SENT:
        out.signals.extend(
            SignalAction(target=t, signal=StopSignal.KILL, trigger=track.trigger)
            for t in targets
            if t.container_id in track.sigterm_sent_to
        )
    if fresh:
        # Never a SIGKILL carried over to a container this escalation has not sent SIGTERM.
        out.signals.extend(
            SignalAction(target=t, signal=StopSignal.TERM, trigger=track.trigger) for t in fresh
        )
        sent_to = track.sigterm_sent_to | {t.container_id for t in fresh}
        return replace(track, phase=Phase.TERM_SENT, phase_at=step.now, sigterm_sent_to=sent_to)
    if track.phase is Phase.TERM_SENT:
        return replace(track, phase=Phase.KILL_SENT, phase_at=step.now)
    out.refusals.append(
        Refusal(
            reason=RefusalReason.KILL_INEFFECTIVE,
            pod=verdict.pod,
            device=key,
            detail=f"still {format_bytes(verdict.used_bytes)} after SIGKILL",
        )
    )
    return replace(track, phase=Phase.GAVE_UP, phase_at=step.now)


def _inactive_reason(
    sample: GpuSample | None, pods: PodSnapshot, policy: EnforcementPolicy, now: float
) -> RefusalReason | None:
    if sample is None or now - sample.oldest_listing_at > policy.staleness_seconds:
        return RefusalReason.DATA_STALE
    if not sample.devices and any(s.uuid is None for s in sample.skipped):
        # No GPU could even be named (NVML cannot start: the null source's sample): there is
        # no GPU data to enforce on, which is not "no GPU, nothing to do". A known GPU that
        # cannot be read is skipped on its own (device_unavailable), not this.
        return RefusalReason.DATA_STALE
    if not pods.synced:
        return RefusalReason.POD_CACHE_UNSYNCED
    if pods.last_contact_at is None or now - pods.last_contact_at > policy.staleness_seconds:
        return RefusalReason.POD_CACHE_STALE
    return None


def _namespaces_judged(pods: PodSnapshot, policy: EnforcementPolicy, now: float) -> PodSnapshot:
    """``pods`` with its labelled namespaces unknown (``None``) when they were not heard from
    within the staleness bound, as for the pod cache: a label the admin set since would go
    unseen, and its pods would be stopped as not exempt (``exemption_unknown`` instead)."""
    contact = pods.namespaces_contact_at
    if pods.labelled_namespaces is None or (
        contact is not None and now - contact <= policy.staleness_seconds
    ):
        return pods
    return replace(pods, labelled_namespaces=None)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Owners:
    """Who may own what NVML lists under each PID this cycle (``_track_identities``)."""

    listed: dict[int, ProcessIdentity | None]
    """Each listed PID's occupant (None: a ghost)."""
    listed_since: dict[int, float]
    tainted: frozenset[int]
    """PIDs whose occupant cannot own the listed memory: never charged."""
    settled: frozenset[int]
    """PIDs whose occupant owns the memory even when it holds no GPU file open: NVML has listed
    the PID, with that occupant behind it (or, since it died, nobody), for
    ``owner_settle_seconds``; or has listed its pod's processes that long."""
    pods_listed: dict[PodUid, tuple[float, float]]


def _track_identities(
    sample: GpuSample,
    attributions: Mapping[int, Attribution],
    state: EnforcerState,
    policy: EnforcementPolicy,
) -> _Owners:
    """Follow each listed PID's occupant: who cannot own its memory, and who surely does.

    NVML can keep listing a PID after its process died (memory held by a forked child, or a
    driver lag), and the kernel can hand that PID to a new process meanwhile: the new occupant
    must never be charged for the old one's memory (docs/design.md, Attribution and process
    ownership). Tainted, never charged: an occupant that differs from the one seen in an earlier
    listing (or from a ghost), and one that started after the PID was first listed (it cannot own
    what that listing showed, even when this is the first cycle that read it).

    An occupant that holds no GPU file is not thereby innocent: a live process can close its
    device files and keep its memory (measured on an H200). It owns the memory once NVML has
    listed its PID, with it behind it, for longer than the driver keeps a dead process's entry
    (``owner_settle_seconds``) — also right after an enforcer restart, when nothing was seen
    before. Two ways around that clock are closed:

    - a ghost is not a reuse: nobody holds the PID. A process with no GPU file seen (hidden in
      a thread's own file table) that forks a child to keep its context and exits within the
      settle time leaves a ghost; once its PID has been listed for the settle time with no new
      occupant, the ghost is charged to the pod it was last attributed to (``_remember``).
    - the clock also runs per pod: a pod whose processes NVML has kept listing for the settle
      time (gaps shorter than it do not restart the run) owns what each of its untainted
      processes lists at once, so a pod rotating short-lived processes, each gone before its
      own PID would settle, cannot keep its memory nobody's.
    """
    first_at: dict[int, float] = {}
    last_at: dict[int, float] = {}
    for proc in sample.processes:
        at = sample.listing(proc.device).taken_at
        first_at[proc.pid] = min(first_at.get(proc.pid, at), at)
        last_at[proc.pid] = max(last_at.get(proc.pid, at), at)
    settle = policy.owner_settle_seconds
    listed: dict[int, ProcessIdentity | None] = {}
    since: dict[int, float] = {}
    tainted: set[int] = set()
    settled: set[int] = set()
    pod_of: dict[int, PodUid] = {}
    for pid, seen_at in last_at.items():
        attribution = attributions.get(pid)
        identity = attribution.identity if attribution is not None else None
        listed[pid] = identity
        since[pid] = state.listed_since.get(pid, first_at[pid])
        # A live occupant that differs from the one seen before (or from a ghost) is a reuse;
        # a process that merely died (identity → None) is not.
        changed = pid in state.listed and identity is not None and state.listed[pid] != identity
        started = attribution.started_at if attribution is not None else None
        late = identity is not None and started is not None and started > since[pid]
        if pid in state.tainted or changed or late:
            tainted.add(pid)
            continue
        # A ghost's pod is the one its PID was last attributed to (nobody holds it since).
        owner = attribution if identity is not None else state.remembered.get(pid)
        if owner is None or owner.pod_uid is None:
            continue
        pod_of[pid] = owner.pod_uid
        if seen_at - since[pid] >= settle:
            settled.add(pid)
    pods_listed = _pods_listed(pod_of, first_at, last_at, state, settle)
    settled.update(
        pid for pid, uid in pod_of.items() if last_at[pid] - pods_listed[uid][0] >= settle
    )
    return _Owners(
        listed=listed,
        listed_since=since,
        tainted=frozenset(tainted),
        settled=frozenset(settled),
        pods_listed=pods_listed,
    )


def _pods_listed(
    pod_of: Mapping[int, PodUid],
    first_at: Mapping[int, float],
    last_at: Mapping[int, float],
    state: EnforcerState,
    settle: float,
) -> dict[PodUid, tuple[float, float]]:
    """Each pod's run of listings ``(since, last)``: carried over from ``state`` while the gap
    since its last listing is at most ``settle``, else begun at this sample's listing of it.
    A pod not listed in this sample keeps its run until the gap exceeds ``settle``."""
    seen: dict[PodUid, tuple[float, float]] = {}
    for pid, uid in pod_of.items():
        first, last = seen.get(uid, (first_at[pid], last_at[pid]))
        seen[uid] = (min(first, first_at[pid]), max(last, last_at[pid]))
    runs: dict[PodUid, tuple[float, float]] = {}
    for uid, (first, last) in seen.items():
        before = state.pods_listed.get(uid)
        runs[uid] = (before[0], last) if before and first - before[1] <= settle else (first, last)
    newest = max(last_at.values(), default=None)
    for uid, (began, last) in state.pods_listed.items():
        if uid not in runs and newest is not None and newest - last <= settle:
            runs[uid] = (began, last)
    return runs


def _remember(
    attributions: Mapping[int, Attribution], owners: _Owners, state: EnforcerState
) -> dict[int, Attribution]:
    """Pod attributions of listed PIDs, carried over while their process is a ghost. One seen
    without a GPU file open is remembered too: ``charge()`` holds its ghost to the same rule
    as the live process (charged once the PID is settled), so exiting never makes its memory
    nobody's."""
    remembered: dict[int, Attribution] = {}
    for pid, identity in owners.listed.items():
        if pid in owners.tainted:
            continue
        attribution = attributions.get(pid)
        if identity is None:
            if pid in state.remembered:
                remembered[pid] = state.remembered[pid]
        elif attribution is not None and attribution.pod_uid is not None:
            remembered[pid] = attribution
    return remembered


def _targets(
    pod: Pod,
    verdict: Assessment,
    charged: Charge,
    stopping: frozenset[ContainerId] = frozenset(),
) -> list[KillTarget]:
    """One target per container of the pod charged on the device; only the containers over
    their own limit (and those this escalation is already stopping) where what the pod's other
    containers use fits the pod's limit (``_alone``). A stop of GPU use without an allocation
    is held to 0 bytes there and says what the pod was allocated."""
    unallocated = verdict.allocation.allocated if verdict.unallocated_stop else None
    if unallocated is None:
        alone = _alone(pod, verdict, charged, stopping)
        if alone is not None:
            return alone
    limit = 0 if unallocated is not None else verdict.limit.limit_bytes
    assert limit is not None
    return [
        KillTarget(
            pod=verdict.pod,
            container_id=cid,
            container_name=pod.containers.get(cid),
            cgroup=cgroup,
            device=verdict.device.key,
            gpu_index=verdict.device.index,
            used_bytes=verdict.used_bytes,
            limit_bytes=limit,
            dra_shares=()
            if unallocated is not None
            else shares_on_device(verdict.limit, verdict.device),
            unallocated=unallocated,
            bypassed=None if unallocated is not None else in_pod_cap(verdict.limit),
        )
        for cid, cgroup in sorted(charged.containers.items())
    ]


def _alone(
    pod: Pod, verdict: Assessment, charged: Charge, stopping: frozenset[ContainerId]
) -> list[KillTarget] | None:
    """The containers over their own limit, stopped alone: ``None`` when none is, or when what
    the pod's other containers use (those stopping counted as gone, and memory charged to no
    container counted) is still over the pod's limit: then the pod's limit binds, and every
    container of the pod on the device is stopped (``_targets``). Those this escalation sent
    SIGTERM stay targets (their SIGKILL), held to the pod's limit where no longer over their
    own."""
    own = dict(verdict.own_over)
    if not own:
        return None
    gone = sorted(set(own) | (stopping & charged.containers.keys()))
    rest = verdict.used_bytes - sum(charged.container_bytes.get(cid, 0) for cid in gone)
    limit = verdict.limit.limit_bytes
    if limit is not None and rest > limit:
        return None
    targets = []
    for cid in gone:
        mine = own.get(cid)
        if mine is None and limit is None:
            continue  # under its own limit, and the pod has none: nothing to hold it to
        targets.append(
            KillTarget(
                pod=verdict.pod,
                container_id=cid,
                container_name=pod.containers.get(cid),
                cgroup=charged.containers[cid],
                device=verdict.device.key,
                gpu_index=verdict.device.index,
                used_bytes=charged.container_bytes.get(cid, 0) if mine else verdict.used_bytes,
                limit_bytes=mine.limit_bytes if mine else cast(int, limit),
                dra_shares=shares_on_device(verdict.limit, verdict.device),
                own_limit=mine,
                bypassed=in_pod_cap(verdict.limit, mine),
            )
        )
    return targets


def _single_container(pod: Pod, charged: Charge) -> str | None:
    if len(charged.containers) != 1:
        return None
    (cid,) = charged.containers
    return pod.containers.get(cid)


def _prune_reported(
    reported: set[tuple[str, str]], listed: Mapping[int, ProcessIdentity | None], pods: PodSnapshot
) -> frozenset[tuple[str, str]]:
    """Forget notes about PIDs no longer listed and pods no longer known (bounded memory)."""
    kept = set()
    for kind, key in reported:
        if kind == "pid":
            if int(key.split(":", 1)[0]) in listed:
                kept.add((kind, key))
        elif pods.lookup(PodUid(key.split(":", 1)[0])) is not None:
            kept.add((kind, key))
    return frozenset(kept)


def _exceeded_event(
    verdict: Assessment,
    trigger: Trigger,
    memory: DeviceMemory | None,
    targets: list[KillTarget],
) -> PodEvent:
    limit = verdict.limit
    device = verdict.device
    where = f"GPU {device.index}" + (
        f" MIG instance {device.gpu_instance_id}" if device.gpu_instance_id is not None else ""
    )
    source = limit.source.value if isinstance(limit.source, LimitSource) else "unknown"
    why = ""
    if trigger is Trigger.PRESSURE and memory is not None:
        why = (
            f"; the device is under memory pressure ({format_bytes(memory.free_bytes)} free of "
            f"{format_bytes(memory.total_bytes)}): grace period skipped"
        )
    elif trigger is Trigger.ALLOCATION:
        why = _ALLOCATION_WHY
    alone = [t for t in targets if t.own_limit is not None]
    if alone and len(alone) == len(targets):
        over = "; ".join(
            f"container {t.container_name} uses {format_bytes(t.used_bytes)}, over its own "
            f"limit {format_bytes(t.limit_bytes)} ({t.own_limit.what})"
            for t in alone
            if t.own_limit is not None
        )
        fits = (
            "the pod has no limit there"
            if limit.limit_bytes is None
            else f"the rest of the pod fits its limit {format_bytes(limit.limit_bytes)} "
            f"(from {source})"
        )
        names = ", ".join(str(t.container_name) for t in alone)
        return PodEvent(
            pod=verdict.pod,
            reason=EventReason.LIMIT_EXCEEDED,
            message=(
                f"GPU memory on {where} ({device.uuid}): {over}; {fits}{why}"
                f"{bypassed_text(alone[0].bypassed)}; stopping container {names} alone"
            ),
        )
    assert limit.limit_bytes is not None
    why += bypassed_text(targets[0].bypassed if targets else in_pod_cap(limit))
    return PodEvent(
        pod=verdict.pod,
        reason=EventReason.LIMIT_EXCEEDED,
        message=(
            f"GPU memory {format_bytes(verdict.used_bytes)} on {where} ({device.uuid}) exceeds "
            f"the limit {format_bytes(limit.limit_bytes)} (from {source}){why}; stopping the "
            "offending containers"
        ),
    )


def bypassed_text(cap: InPodCap | None) -> str:
    """``; enforcement_bypassed: …`` for an Event when ``cap`` should have held the memory
    inside the pod, else nothing."""
    if cap is None:
        return ""
    return (
        f"; enforcement_bypassed: {cap.value} should have held this inside the pod "
        "(it is missing or was bypassed); gpuguard stops it instead"
    )


def _where(device: GpuDevice) -> str:
    mig = f" MIG instance {device.gpu_instance_id}" if device.gpu_instance_id is not None else ""
    return f"GPU {device.index}{mig} ({device.uuid})"


def _unallocated_finding(
    verdict: Assessment,
    pod: Pod,
    charged: Charge,
    reported: set[tuple[str, str]],
    out: _Outcome,
) -> None:
    """GPU use that none of the pod's allocations names: reported once per pod and device (a
    Warning Event ``GPUUsedWithoutAllocation`` and ``Decision.unallocated``), in every mode.
    Whether it is also stopped is ``enforcement.unallocated``'s
    (``Assessment.unallocated_stop``)."""
    device = verdict.device
    note = ("unallocated", f"{verdict.pod.uid}:{device.uuid}:{device.gpu_instance_id}")
    if note in reported:
        return
    reported.add(note)
    names = tuple(pod.containers.get(cid) or cid[:12] for cid in sorted(charged.container_bytes))
    uses = ", ".join(
        f"container {pod.containers.get(cid) or cid[:12]} ({format_bytes(used)})"
        for cid, used in sorted(charged.container_bytes.items())
    )
    allocated = verdict.allocation.allocated
    out.unallocated.append(
        UnallocatedUse(
            pod=verdict.pod, device=device, containers=names, used_bytes=verdict.used_bytes,
            allocated=allocated,
        )
    )  # fmt: skip
    out.events.append(
        PodEvent(
            pod=verdict.pod,
            reason=EventReason.UNALLOCATED,
            message=(
                f"GPU memory {format_bytes(verdict.used_bytes)} on {_where(device)}, used by "
                f"{uses or 'no container'}, which none of the pod's allocations names; "
                f"the pod was allocated: {allocated}"
            ),
        )
    )


def _unallocated_stop_event(verdict: Assessment, trigger: Trigger) -> PodEvent:
    why = {
        Trigger.PRESSURE: "; the device is under memory pressure",
        Trigger.ALLOCATION: _ALLOCATION_WHY,
    }.get(trigger, "")
    return PodEvent(
        pod=verdict.pod,
        reason=EventReason.UNALLOCATED,
        message=(
            f"GPU memory {format_bytes(verdict.used_bytes)} on {_where(verdict.device)}, which "
            f"none of the pod's allocations names (allocated: {verdict.allocation.allocated})"
            f"{why}; stopping the containers using it (enforcement.unallocated = stop)"
        ),
    )


def _invalid_annotation_events(
    pods: PodSnapshot,
    sample: GpuSample,
    policy: EnforcementPolicy,
    node: NodeFacts,
    reported: set[tuple[str, str]],
) -> list[PodEvent]:
    """One ``InvalidGPUMemoryLimit`` Event per pod and rejected value, GPU user or not: the
    annotation's, and each listed scheduler's invalid declaration (docs/design.md, Limit
    sources)."""
    total = sample.devices[0].total_bytes if sample.devices else None
    events: list[PodEvent] = []
    seen: set[PodUid] = set()
    current: set[tuple[str, str]] = set()
    for pod in pods.pods.values():
        if pod.uid in seen:
            continue
        seen.add(pod.uid)
        rejected = _rejected_values(pod, policy)
        fresh = []
        for source, what, value, reason in rejected:
            # A digest, not the value: a tenant's value may be 256 KiB. One note per pod and
            # source, for the value it carries now: a tenant rewriting its annotation to a new
            # invalid value each time replaces its note instead of adding one (the old value's
            # note is dropped below), so a live pod cannot grow this memory. Each new invalid
            # value is reported once; its Event goes through the sink's per-pod rate limit.
            digest = hashlib.sha256(f"{what}\0{value}".encode()).hexdigest()[:32]
            note = ("invalid", f"{pod.uid}:{source}:{digest}")
            current.add(note)
            if note not in reported:
                reported.add(note)
                fresh.append((what, reason))
        if not fresh:
            continue
        limit = resolve_limit(
            pod=pod, device_total_bytes=total, policy=policy.limits, replicas=node.replicas
        )
        ref = PodRef(uid=pod.uid, namespace=pod.namespace, name=pod.name)
        events.extend(_invalid_event(ref, what, reason, limit) for what, reason in fresh)
    # A value no longer carried (replaced, made valid, its pod gone) is forgotten: notes of this
    # kind are exactly the invalid values the pods carry now.
    reported.difference_update([n for n in reported if n[0] == "invalid" and n not in current])
    return events


def _rejected_values(pod: Pod, policy: EnforcementPolicy) -> list[tuple[str, str, str, str]]:
    """(source, what, the value's identity, why) of each rejected limit the policy would read:
    at most one per source (``limits.sources``), so per pod a bounded number."""
    rejected = []
    if pod.annotation_error is not None and GPUGUARD_SOURCE in policy.limits.sources:
        value = pod.annotations.get(LIMIT_ANNOTATION, "")
        rejected.append((GPUGUARD_SOURCE, LIMIT_ANNOTATION, value, pod.annotation_error))
    for name in policy.limits.sources:
        if name == GPUGUARD_SOURCE:
            continue
        declaration = pod.declared.get(LimitSource(name))
        if declaration is not None and declaration.error is not None:
            what = f"{name} declaration ({declaration.where})"
            rejected.append((name, what, declaration.error, declaration.error))
        bad = [c for c in declaration.containers if c.error] if declaration is not None else []
        if bad:
            # One note for all of them (the pod's containers and a few names it lacks are
            # bounded at translation), so a tenant rewriting keys replaces it, never adds.
            what = f"{name} per-container declarations"
            reason = "; ".join(f"container {c.container} ({c.where}): {c.error}" for c in bad)
            rejected.append((f"{name}-containers", what, reason, reason))
    return rejected


def _invalid_event(ref: PodRef, what: str, reason: str, limit: ResolvedLimit) -> PodEvent:
    fallback = (
        f"the {limit.source.value} limit {format_bytes(limit.limit_bytes)} applies instead"
        if limit.source is not None and limit.limit_bytes is not None
        else "no limit applies"
    )
    return PodEvent(
        pod=ref,
        reason=EventReason.INVALID_LIMIT,
        message=f"{what} rejected: {reason}; {fallback}",
    )


# -- shares several pods hold together -----------------------------------------------------------

SHARED_TRACK_PREFIX = "dra-share:"
"""A group's violation (``_advance_shared``) is tracked under this and the group's key, in place
of a pod UID (a UUID or a 32-hex hash: never the same)."""


def _advance_shared(
    step: _Step,
    *,
    assessments: Mapping[tuple[PodUid, DeviceKey], Assessment],
    charges: Charges,
    state: EnforcerState,
    tracks: Mapping[tuple[PodUid, DeviceKey], Track],
    pods: PodSnapshot,
    out: _Outcome,
) -> dict[tuple[PodUid, DeviceKey], Track]:
    """Pods that hold a DRA share together (one claim reserved for several of them, which the
    scheduler counted once) are held together to it on its device (``core.dra_shares``): a
    group over its budget is a violation of its own, tracked under the group's key, confirmed
    and acted on like a pod's (two fresh listings, the grace period or pressure, a read of
    every member's claims sent since it was due, SIGTERM, the timeout, SIGKILL), on its largest
    users first. Each pod is still held to its own limit too; a container its own violation is
    stopping (``tracks``: this cycle's) counts as gone and is not signalled again."""
    found: dict[tuple[PodUid, DeviceKey], Track] = {}
    for group in share_groups(share_uses(assessments, charges)):
        if not group.over:
            continue
        device = group.device.key
        own = frozenset(
            cid
            for m in group.members
            if (t := tracks.get((m.pod.uid, device))) is not None and t.phase in _ESCALATING
            for cid in t.sigterm_sent_to
        )
        key = (PodUid(SHARED_TRACK_PREFIX + group.key), device)
        found[key] = _advance_group(
            step, group=group, own=own, track=state.tracks.get(key), pods=pods, out=out
        )
    return found


def _advance_group(
    step: _Step,
    *,
    group: ShareGroup,
    own: frozenset[ContainerId],
    track: Track | None,
    pods: PodSnapshot,
    out: _Outcome,
) -> Track:
    """One group over its budget: ``_advance``'s steps for a pod, on the group."""
    listing = step.sample.listing(group.device.key)
    if track is None:
        track = Track(first_over_at=listing.taken_at, samples_over=0, last_seq=-1)
    if listing.seq == track.last_seq:
        return track  # no listing since the last decision: nothing new to count or act on
    track = replace(track, samples_over=track.samples_over + 1, last_seq=listing.seq)
    trigger = _trigger(step, group.device.key, track)
    if trigger is None:
        return track
    if track.phase is Phase.OBSERVING:
        track = replace(track, trigger=trigger)
        return _confirm_group(step, group=group, own=own, track=track, pods=pods, out=out)
    if track.phase in _ESCALATING:
        return _escalate_group(step, group=group, own=own, track=track, pods=pods, out=out)
    if track.phase is Phase.REFUSED and _group_refusal(group, step) is None:
        return Track(first_over_at=listing.taken_at, samples_over=1, last_seq=listing.seq)
    return track


def _member_refusal(group: ShareGroup) -> RefusalReason | None:
    """Why no member of the group can be acted on: an exempt member, a member's usage unknown
    (the sum would be a guess), an MPS device. A member with no container is no such reason:
    only a pod chosen to stop needs one."""
    reasons = {m.refusal for m in group.members} - {None, RefusalReason.NO_CONTAINER}
    for reason in (
        RefusalReason.EXEMPT,
        RefusalReason.EXEMPTION_UNKNOWN,
        RefusalReason.USAGE_UNKNOWN,
    ):
        if reason in reasons:
            return reason
    return min((r for r in reasons if r is not None), default=None)


def _group_refusal(group: ShareGroup, step: _Step) -> RefusalReason | None:
    """``_refusal`` for a group: its members' reasons, then audit mode (any member's
    namespace in audit), then a blocked enforcer."""
    reason = _member_refusal(group)
    if reason is not None:
        return reason
    modes = {
        effective_mode(m.pod.namespace, step.policy.limits, step.policy.mode) for m in group.members
    }
    if Mode.AUDIT in modes:
        return RefusalReason.AUDIT_MODE
    return step.blocked.reason if step.blocked is not None else None


def _confirm_group(
    step: _Step,
    *,
    group: ShareGroup,
    own: frozenset[ContainerId],
    track: Track,
    pods: PodSnapshot,
    out: _Outcome,
) -> Track:
    """``_confirm`` for a group: first a read of every member's claims sent since it was due,
    then SIGTERM to the largest users' containers, or one refusal per pod it would stop."""
    asked = track.reread_asked_at if track.reread_asked_at is not None else step.now
    if not all(m.read_at is not None and m.read_at >= asked for m in group.members):
        for m in group.members:
            out.reread[m.pod.uid] = min(asked, out.reread.get(m.pod.uid, asked))
        return replace(track, reread_asked_at=asked)
    chosen = largest_first(group, stopping=own)
    if not chosen:
        return track  # the members' own violations are stopping what is over: left to them
    out.violations.append(track.trigger)
    targets = _group_targets(group, chosen, own, pods)
    key = group.device.key
    refusal = _group_refusal(group, step) or (None if targets else RefusalReason.NO_CONTAINER)
    if refusal is None:
        memory = step.sample.memory.get(key)
        out.events.extend(_share_event(group, m, track.trigger, memory) for m in chosen)
        out.refusals.extend(
            Refusal(reason=RefusalReason.NO_CONTAINER, pod=m.pod, device=key,
                    detail=describe_group(group))
            for m in chosen
            if not m.cgroups
        )  # fmt: skip
        _send(out.signals, targets, StopSignal.TERM, track.trigger)
        sent_to = frozenset(t.container_id for t in targets)
        return replace(track, phase=Phase.TERM_SENT, phase_at=step.now, sigterm_sent_to=sent_to)
    if refusal is RefusalReason.AUDIT_MODE:
        _send(out.would, targets, StopSignal.TERM, track.trigger)
    detail = step.blocked.detail if step.blocked and refusal is step.blocked.reason else ""
    why = "; ".join(
        w
        for w in (describe_group(group), f"would stop {', '.join(m.pod.name for m in chosen)}",
                  detail)
        if w
    )  # fmt: skip
    out.refusals.extend(Refusal(reason=refusal, pod=m.pod, device=key, detail=why) for m in chosen)
    return replace(track, phase=Phase.REFUSED, phase_at=step.now, refused=frozenset({refusal}))


def _escalate_group(
    step: _Step,
    *,
    group: ShareGroup,
    own: frozenset[ContainerId],
    track: Track,
    pods: PodSnapshot,
    out: _Outcome,
) -> Track:
    """``_escalate`` for a group still over its budget after the termination timeout and a
    listing since: SIGKILL to the containers it sent SIGTERM, SIGTERM to the next largest users
    if what is left is still over (the memory of those stopping counts as gone), or give up
    once with ``kill_ineffective``."""
    assert track.phase_at is not None
    key = group.device.key
    waited = step.now - track.phase_at >= step.policy.termination_timeout_seconds
    if not (waited and step.sample.listing(key).taken_at > track.phase_at):
        return track
    refusal = _member_refusal(group)
    if refusal is not None:
        out.refusals.append(
            Refusal(reason=refusal, pod=group.members[0].pod, device=key,
                    detail=describe_group(group))
        )  # fmt: skip
        return replace(track, phase=Phase.REFUSED, refused=frozenset({refusal}))
    sent = track.sigterm_sent_to
    if track.phase is Phase.TERM_SENT:
        everyone = _group_targets(group, group.members, own, pods)
        _send(out.signals, [t for t in everyone if t.container_id in sent], StopSignal.KILL,
              track.trigger)  # fmt: skip
    chosen = largest_first(group, stopping=own | sent)
    fresh = _group_targets(group, chosen, own | sent, pods)
    if fresh:
        memory = step.sample.memory.get(key)
        newly = {t.pod.uid for t in fresh}
        out.events.extend(
            _share_event(group, m, track.trigger, memory) for m in chosen if m.pod.uid in newly
        )
        _send(out.signals, fresh, StopSignal.TERM, track.trigger)
        sent_to = sent | {t.container_id for t in fresh}
        return replace(track, phase=Phase.TERM_SENT, phase_at=step.now, sigterm_sent_to=sent_to)
    if track.phase is Phase.TERM_SENT:
        return replace(track, phase=Phase.KILL_SENT, phase_at=step.now)
    out.refusals.append(
        Refusal(
            reason=RefusalReason.KILL_INEFFECTIVE,
            pod=group.members[0].pod,
            device=key,
            detail=f"still over after SIGKILL: {describe_group(group)}",
        )
    )
    return replace(track, phase=Phase.GAVE_UP, phase_at=step.now)


def _group_targets(
    group: ShareGroup,
    chosen: tuple[ShareUse, ...],
    skip: frozenset[ContainerId],
    pods: PodSnapshot,
) -> list[KillTarget]:
    """The containers of ``chosen`` charged on the group's device, but those in ``skip``; the
    used and limit figures are the group's (``KillTarget.shared``)."""
    ranked = sorted(group.members, key=lambda m: (-m.used_bytes, m.pod.name, m.pod.uid))
    budget = SharedBudget(
        claims=group.claims,
        pods=tuple(m.pod for m in ranked),
        budget_bytes=group.budget_bytes,
        used_bytes=group.used_bytes,
    )
    targets = []
    for member in chosen:
        pod = pods.lookup(member.pod.uid)
        for cid, cgroup in sorted(member.cgroups.items()):
            if cid in skip:
                continue
            targets.append(
                KillTarget(
                    pod=member.pod,
                    container_id=cid,
                    container_name=pod.containers.get(cid) if pod is not None else None,
                    cgroup=cgroup,
                    device=group.device.key,
                    gpu_index=group.device.index,
                    used_bytes=group.used_bytes,
                    limit_bytes=group.budget_bytes,
                    dra_shares=group.shared,
                    shared=budget,
                )
            )
    return targets


def _send(
    actions: list[SignalAction], targets: list[KillTarget], signal: StopSignal, trigger: Trigger
) -> None:
    """``signal`` to each target, but a container on this device that already gets it this
    cycle (its own violation and its group's may both stop it)."""
    sent = {(a.target.container_id, a.target.device) for a in actions if a.signal is signal}
    actions.extend(
        SignalAction(target=t, signal=signal, trigger=trigger)
        for t in targets
        if (t.container_id, t.device) not in sent
    )


def _share_event(
    group: ShareGroup, member: ShareUse, trigger: Trigger, memory: DeviceMemory | None
) -> PodEvent:
    why = ""
    if trigger is Trigger.PRESSURE and memory is not None:
        why = (
            f"; the device is under memory pressure ({format_bytes(memory.free_bytes)} free of "
            f"{format_bytes(memory.total_bytes)}): grace period skipped"
        )
    elif trigger is Trigger.ALLOCATION:
        why = _ALLOCATION_WHY
    return PodEvent(
        pod=member.pod,
        reason=EventReason.SHARE_EXCEEDED,
        message=(
            f"GPU memory over a shared DRA share: {describe_group(group)}{why}; stopping this "
            f"pod's containers ({format_bytes(member.used_bytes)}): the largest users are "
            "stopped first, until what the others use fits"
        ),
    )
