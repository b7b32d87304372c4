"""The sharing agent's decision (docs/design.md, Sharing config): one pure turn of reconciling a
Node's two labels.

Owns what the agent does about its own Node this turn: which of the two sharing labels to patch
(only ``nvidia.com/device-plugin.config`` and ``nvidia.com/mig.config``, only when they differ),
when to cordon, uncordon or evict for a MIG change under ``migChangePolicy``, which Node Events
to post (once per episode, not per turn), what the agent waits for (``gpuguard_sharing_waiting``)
and which errors it reports (``gpuguard_sharing_reconcile_errors_total``). Must not do I/O, read
a clock or log: the runtime executes the returned actions in order (labels, cordon, evictions,
Events) and passes ``now``.

Safety rules encoded here:
- ``nvidia.com/mig.config`` is never patched while ``nvidia.com/mig.config.state`` is
  ``pending`` or ``rebooting``;
- with ``WhenIdle``, ``Cordon`` and ``Drain`` it is never patched while a pod holds a GPU;
  with ``Cordon``/``Drain`` the node must be cordoned (and seen cordoned) first;
- the agent cordons only a schedulable node (never twice) and marks its cordon with the
  annotation ``gpuguard.io/cordoned-by: agent``; it uncordons only a cordon carrying that
  annotation whose ``spec.unschedulable`` gpuguard's field manager alone owns
  (``NodeView.unschedulable_by_gpuguard``), so a cordon set by anyone else is never removed,
  and it drops the annotation as soon as the cordon is not its own (a ``kubectl uncordon``,
  also mid-change), so nobody's later cordon inherits it;
- an uncordon by someone else before the mig label is written: cordoned again (the policy
  needs it) and reported; after it is written: not cordoned again, reported, nothing lifted;
- ``Drain`` evicts for at most ``DRAIN_DEADLINE_SECONDS`` per change, then reports and waits;
  the pods a drain never evicts (a DaemonSet's, mirror pods) are reported by their owners;
- a label another writer keeps reverting is left alone after 3 reverts in 10 minutes;
- a label the agent has changed ``CHANGE_LIMIT`` times within those 10 minutes (written with
  another value than its last write), whatever the values, is not written again until those
  changes age out of the window or a sharing config that differs is adopted: a rule chain
  that validation cannot see (rules over labels another controller derives from the agent's
  own, or another writer with its own rules) would otherwise flip it, and for the mig label
  re-partition the GPUs, every turn. Both holds go through one gate (``_needs_write``) and are
  reported alike (``SharingLabelConflict``);
- a label whose NVIDIA ConfigMap cannot be read (``core.sharing.HeldLabel``) is never written:
  it stays as it is and is reported, while the rule's other label still applies;
- restart-safe: everything that matters is read back from the Node (the annotation says whose
  cordon it is; the mig label already at its desired value with the state ``pending``/
  ``rebooting`` says a change is under way), so a fresh ``AgentState()`` resumes a change instead
  of cordoning again or leaving its cordon behind.

Size: over 600 lines, on purpose: one turn's decision. The label tracks, the MIG change, the
cordon and the Events read and write one ``_Turn`` and one ``AgentState``, and every label write
passes one gate (``_needs_write``: a write in flight, the revert guard, the flip hold); split,
that gate and the episode bookkeeping would be shared across modules by private state.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from gpuguard.core.mig import MIG_PAUSE_STATES
from gpuguard.core.sharing import (
    DEVICE_PLUGIN_CONFIG_LABEL,
    MIG_CONFIG_LABEL,
    SHARING_LABELS,
    HeldLabel,
    MigChangePolicy,
)
from gpuguard.core.sharing import MIG_CONFIG_STATE_LABEL as _MIG_STATE_LABEL

MIG_CONFIG_STATE_LABEL = _MIG_STATE_LABEL
"""mig-manager's progress label: ``pending``, ``rebooting``, ``success`` or ``failed`` (defined
with the other labels mig-manager writes, ``core.sharing.MIG_MANAGER_LABELS``)."""

CORDONED_BY_ANNOTATION = "gpuguard.io/cordoned-by"
"""Set with the agent's cordon: the only proof that a cordon is the agent's to remove."""
CORDONED_BY_AGENT = "agent"

REVERT_LIMIT = 3
"""Reverts of one label by another writer, within ``REVERT_WINDOW_SECONDS``, after which the
agent leaves that label alone (two writers would otherwise flip it, and a MIG GPU, forever)."""
REVERT_WINDOW_SECONDS = 600.0
CHANGE_LIMIT = 4
"""Changes of one label by the agent (writes of another value than its last write), whatever
the values, within ``REVERT_WINDOW_SECONDS``; then it holds the label. Each is a Node update, an
Event and, for ``nvidia.com/mig.config``, a re-partition by mig-manager. A deliberate change of
the config or of the node's pool needs one; a writer reverting the label to the same value is
``REVERT_LIMIT``'s; four values in ten minutes is a label that flips."""
WRITE_SETTLE_SECONDS = 30.0
"""How long a written label (or a cordon) may take to show in the agent's Node view (a watch
lags the write) before it is written again; a rewrite after that counts as a revert."""
MIG_PICKUP_SECONDS = 30.0
DRAIN_DEADLINE_SECONDS = 1800.0
"""How long ``Drain`` keeps evicting for one MIG change: past it the agent stops evicting,
reports it (``MigChangeWaiting``, ``drain_timeout``) and waits, cordoned, for the GPU pods to
finish, as ``Cordon`` does. Pods evicted before keep their own grace period. A PodDisruptionBudget
that never allows the eviction, or a controller that keeps putting a pod back, would otherwise
be retried for ever. A fixed constant like the agent's other timeouts; a restarted agent starts
the deadline afresh."""
"""After the mig label is written, how long a ``success``/``failed`` left from an earlier change
is not taken as the outcome unless ``pending``/``rebooting`` was seen in between (mig-manager
reacts to the label through a watch, seconds later)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeView:
    """What the agent reads of its own Node."""

    name: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    unschedulable: bool = False
    """``spec.unschedulable`` (cordoned)."""
    unschedulable_by_gpuguard: bool = False
    """``spec.unschedulable`` is owned by gpuguard's field manager (``gpuguard``) alone, as the
    Node's ``managedFields`` record it: nobody set it since the agent's cordon. Only this fact
    is read from ``managedFields``. A ``kubectl uncordon`` removes the field, a ``kubectl
    cordon`` after it owns it afresh (manager ``kubectl-cordon``)."""

    @property
    def mig_state(self) -> str | None:
        return self.labels.get(MIG_CONFIG_STATE_LABEL)

    @property
    def mig_busy(self) -> bool:
        """mig-manager is reconfiguring: the mig label must not change."""
        return self.mig_state in MIG_PAUSE_STATES

    @property
    def agent_cordoned(self) -> bool:
        """Cordoned, and the cordon is the agent's own: its marker is there and
        ``spec.unschedulable`` is still gpuguard's alone (the marker survives a ``kubectl
        uncordon``, so an admin's ``kubectl cordon`` after it carries the agent's marker too)."""
        return (
            self.unschedulable
            and self.unschedulable_by_gpuguard
            and self.annotations.get(CORDONED_BY_ANNOTATION) == CORDONED_BY_AGENT
        )


class CordonAction(enum.StrEnum):
    """What to do with ``spec.unschedulable`` and the ``gpuguard.io/cordoned-by`` annotation."""

    CORDON = "cordon"
    """Set ``spec.unschedulable: true`` and the annotation, in one patch."""
    UNCORDON = "uncordon"
    """Set ``spec.unschedulable: false`` and remove the annotation, in one patch."""
    FORGET = "forget"
    """Remove only the annotation: someone else lifted (or took over) the agent's cordon, and a
    stale annotation would make a later cordon of theirs look like the agent's."""


class WaitReason(enum.StrEnum):
    """What a pending MIG change waits for (``gpuguard_sharing_waiting{reason}``)."""

    MIG_STATE_BUSY = "mig_state_busy"
    """``nvidia.com/mig.config.state`` is ``pending``/``rebooting`` (not from this change)."""
    CORDON = "cordon"
    """The agent's cordon is not yet visible on the Node."""
    GPU_PODS = "gpu_pods"
    """Pods on the node hold a GPU resource."""
    MIG_APPLYING = "mig_applying"
    """The mig label is written: waiting for mig-manager's ``success`` or ``failed``."""
    NVIDIA_CONFIG_MISSING = "nvidia_config_missing"
    """A label the matching rule sets differs on the Node, but the NVIDIA ConfigMap its value
    is checked against cannot be read (absent, or not readable): it is held until it can be.
    Shown only when no MIG change waits for anything else (one reason at a time)."""


class ReconcileError(enum.StrEnum):
    """Reasons of ``gpuguard_sharing_reconcile_errors_total`` the decision reports (once per
    episode). The adapter adds its own (API errors, a PodDisruptionBudget blocking an eviction:
    ``EVICTION_BLOCKED``)."""

    MIG_CHANGE_FAILED = "mig_change_failed"
    LABEL_CONFLICT = "label_conflict"
    LABEL_FLAPPING = "label_flapping"
    """A label the agent wrote ``CHANGE_LIMIT`` times within ``REVERT_WINDOW_SECONDS`` is held
    (reported once per hold)."""
    EVICTION_NOT_ALLOWED = "eviction_not_allowed"
    EVICTION_BLOCKED = "eviction_blocked"
    DRAIN_TIMEOUT = "drain_timeout"
    """``Drain`` evicted for ``DRAIN_DEADLINE_SECONDS`` and GPU pods remain: it stops evicting
    for this change (reported once per change)."""
    CONFIG_INVALID = "config_invalid"
    """A new sharing config (or an NVIDIA config it names) was rejected; the last good one
    stays in force (reported by the runtime, once per rejected content)."""
    CONFIG_MISSING = "config_missing"
    """The sharing ConfigMap was deleted: the last good config stays in force (reported once
    per deletion)."""
    API_ERROR = "api_error"
    """A Node patch or an eviction failed (after retries of 409 conflicts)."""
    NVIDIA_CONFIG_MISSING = "nvidia_config_missing"
    """A label the node's rule sets is held: the NVIDIA ConfigMap its value is checked against
    cannot be read (reported once per label, value and cause)."""


class NodeEventReason(enum.StrEnum):
    """Node Event reasons the agent posts (docs/design.md, Sharing config)."""

    LABELS_APPLIED = "SharingLabelsApplied"
    MIG_CHANGE_WAITING = "MigChangeWaiting"
    MIG_CHANGE_FAILED = "MigChangeFailed"
    LABEL_CONFLICT = "SharingLabelConflict"
    CONFIG_INVALID = "SharingConfigInvalid"


_WARNINGS = frozenset(
    {
        NodeEventReason.MIG_CHANGE_FAILED,
        NodeEventReason.LABEL_CONFLICT,
        NodeEventReason.CONFIG_INVALID,
    }
)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeEvent:
    """One Event to post on the agent's Node."""

    reason: NodeEventReason
    message: str

    @property
    def warning(self) -> bool:
        """``Warning`` (else ``Normal``)."""
        return self.reason in _WARNINGS


@dataclass(frozen=True, slots=True, kw_only=True)
class LabelTrack:
    """The agent's writes of one label, for one desired value."""

    value: str
    written_at: float | None = None
    """When the agent last wrote ``value`` and has not yet seen it undone; ``None``: no write
    in flight."""
    seen: bool = False
    """The Node showed ``value`` since that write."""
    reverts: tuple[float, ...] = ()
    """When another writer's reverts were noticed (within the window)."""
    conflict: bool = False
    """Left alone: reverted ``REVERT_LIMIT`` times within the window."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentState:
    """What ``reconcile()`` remembers between turns. ``AgentState()`` is always a safe start
    (a restarted agent): the first turn reads the change in progress back from the Node."""

    started: bool = False
    labels: Mapping[str, LabelTrack] = field(default_factory=dict)
    mig_applied_at: float | None = None
    """When the mig label change now awaited was written (or found, after a restart)."""
    mig_applied_value: str | None = None
    """The value written then: its outcome is awaited even if the desired value changes or the
    rule stops matching meanwhile (mig-manager is re-partitioning the GPUs either way).
    ``None`` after a restart: the desired value is taken as the one written."""
    mig_seen_busy: bool = False
    """``pending``/``rebooting`` seen since ``mig_applied_at``."""
    cordon_sent_at: float | None = None
    """When the agent sent a cordon it has not yet seen on the Node."""
    drain: tuple[str, float] | None = None
    """``Drain`` is evicting for this mig value since this time (``DRAIN_DEADLINE_SECONDS``);
    ``None`` when no drain is going on."""
    reported_episodes: frozenset[tuple[str, ...]] = frozenset()
    """Episodes already reported with an Event (reported again once they end and recur)."""
    label_writes: Mapping[str, tuple[tuple[float, str], ...]] = field(default_factory=dict)
    """Per label, the agent's writes (when, which value) within ``REVERT_WINDOW_SECONDS``,
    whatever the desired value, each to another value than the one before (rewriting the same
    value after a lost write or a revert is ``REVERT_LIMIT``'s business): ``CHANGE_LIMIT`` of
    them hold the label."""
    config_generation: int = 0
    """The sharing config in force when ``label_writes`` were counted: a new config (the admin's
    fix) counts afresh."""

    @classmethod
    def from_node(cls, node: NodeView, *, now: float) -> AgentState:
        """The state of an agent that (re)starts on this Node.

        Its own cordon (the annotation) with the mig state ``pending``/``rebooting``: a change
        is under way, wait for its outcome. Its own cordon otherwise: a change may just have been
        written and not yet picked up by mig-manager, so wait ``MIG_PICKUP_SECONDS`` before
        taking the state as the outcome (uncordoning early would let GPU pods in under a
        re-partition). Any other Node: nothing in progress.
        """
        if not node.agent_cordoned:
            return cls(started=True)
        return cls(started=True, mig_applied_at=now, mig_seen_busy=node.mig_busy)


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentDecision:
    """One turn's actions, in the order the runtime executes them, and the next state."""

    state: AgentState
    patch_labels: Mapping[str, str] = field(default_factory=dict)
    """Labels to set (merge patch, field manager ``gpuguard``): only the two, only changes."""
    cordon: CordonAction | None = None
    evict_gpu_pods: bool = False
    """Request eviction (Eviction API, PodDisruptionBudgets honoured) of the pods on the node
    holding a GPU resource, except a DaemonSet's pods and mirror pods, which a drain never
    evicts (``core.agent.evictable_pods``); a blocked one is retried later (reported by the
    runtime)."""
    events: tuple[NodeEvent, ...] = ()
    waiting: WaitReason | None = None
    errors: tuple[ReconcileError, ...] = ()
    conflicts: tuple[str, ...] = ()
    """Labels left alone because another writer keeps reverting them, or because they flip
    (written ``CHANGE_LIMIT`` times within the window)."""


def _note_writes(
    out: _Turn, mig: AgentState, tracks: dict[str, LabelTrack], node: NodeView, now: float
) -> AgentState:
    """Drop a stale cordon marker; note this turn's label writes in ``tracks`` (in place) and
    its mig write in the state returned."""
    stale_marker = CORDONED_BY_ANNOTATION in node.annotations and not node.agent_cordoned
    if out.cordon is None and stale_marker:
        # The marker without the agent's cordon (a `kubectl uncordon`, or a cordon someone set
        # after it): dropped at once, also mid-change, so that nobody's later cordon inherits it.
        out.cordon = CordonAction.FORGET
    for label, track in tracks.items():
        if label in out.patch:
            tracks[label] = replace(track, written_at=now, seen=False)
    if MIG_CONFIG_LABEL not in out.patch:
        return mig
    return replace(
        mig, mig_applied_at=now, mig_applied_value=out.patch[MIG_CONFIG_LABEL], mig_seen_busy=False
    )


def reconcile(
    *,
    desired: Mapping[str, str | None],
    node: NodeView,
    gpu_pods: int,
    policy: MigChangePolicy,
    allow_eviction: bool,
    state: AgentState,
    now: float,
    keep_cordon_on_failure: bool = False,
    held: Mapping[str, HeldLabel] | None = None,
    unevictable: tuple[str, ...] = (),
    config_generation: int = 0,
) -> AgentDecision:
    """Decide one turn: track writes → time-slicing label → MIG change → cordon → held → Events.

    Args:
        desired: The two labels' wanted values (``desired_labels``); absent or ``None``: leave
            that label alone. Other keys are ignored.
        node: The agent's Node as last seen.
        gpu_pods: Pods on the node holding ``nvidia.com/gpu*`` or ``nvidia.com/mig-*``.
        policy: The sharing config's ``migChangePolicy``.
        allow_eviction: The chart's ``agent.allowEviction`` (``Drain`` evicts only with it).
        state: What the previous turn returned; ``AgentState()`` after a (re)start.
        now: Monotonic seconds.
        keep_cordon_on_failure: Leave the agent's own cordon when mig-manager reports
            ``failed`` (for the admin to inspect); otherwise it is lifted.
        held: Labels the rule sets but whose value cannot be checked (``match_node``): never
            written; where the Node's value differs, reported (``SharingConfigInvalid``, once
            per label, value and cause) and waited for.
        unevictable: The ``gpu_pods`` a drain never evicts, named with owners (bounded and
            escaped by the caller): ``Drain`` reports them as what the change waits for.
        config_generation: The sharing config in force: a new one counts writes afresh.
    """
    if not state.started:
        state = _resume(state, node, now)
    out = _Turn(now=now, writes=_recent_writes(state, config_generation, now))
    tracks = {
        label: _track(state.labels.get(label), value, node.labels.get(label), now)
        for label in SHARING_LABELS
        if (value := desired.get(label)) is not None
    }
    _time_slicing(tracks, node, out)
    mig = _mig(
        _MigInput(
            track=tracks.get(MIG_CONFIG_LABEL),
            node=node,
            gpu_pods=gpu_pods,
            policy=policy,
            allow_eviction=allow_eviction,
            keep_cordon_on_failure=keep_cordon_on_failure,
            unevictable=unevictable,
            drain=state.drain,
        ),
        replace(state, drain=None),
        out,
    )
    mig = _note_writes(out, mig, tracks, node, now)
    _held(held or {}, node, out)
    _count_changes(out)
    if out.patch:
        changes = ", ".join(f"{k}={v}" for k, v in sorted(out.patch.items()))
        out.events.append(NodeEvent(reason=NodeEventReason.LABELS_APPLIED, message=changes))
    events = _episode_events(out, state.reported_episodes)  # also adds the errors of new episodes
    return AgentDecision(
        state=replace(
            mig,
            started=True,
            labels=tracks,
            reported_episodes=frozenset(out.active),
            label_writes=out.writes,
            config_generation=config_generation,
        ),
        patch_labels=dict(out.patch),
        cordon=out.cordon,
        evict_gpu_pods=out.evict,
        events=tuple(events),
        waiting=out.waiting,
        errors=tuple(out.errors),
        conflicts=tuple(
            sorted({label for label, t in tracks.items() if t.conflict} | out.flapping)
        ),
    )


def _resume(state: AgentState, node: NodeView, now: float) -> AgentState:
    """A fresh state reads the change in progress back from the Node, but keeps the count of
    changes it was given (the runtime keeps it over a write whose answer was lost)."""
    return replace(
        AgentState.from_node(node, now=now),
        label_writes=state.label_writes,
        config_generation=state.config_generation,
    )


def _count_changes(out: _Turn) -> None:
    """This turn's writes join each label's count; a retry of the same value is no change."""
    for label, value in out.patch.items():
        prior = out.writes.get(label, ())
        if not prior or prior[-1][1] != value:
            out.writes[label] = (*prior, (out.now, value))


def _recent_writes(
    state: AgentState, config_generation: int, now: float
) -> dict[str, tuple[tuple[float, str], ...]]:
    """Each label's writes still within the window, under the config in force."""
    if state.config_generation != config_generation:
        return {}
    recent = {
        label: tuple(w for w in writes if now - w[0] < REVERT_WINDOW_SECONDS)
        for label, writes in state.label_writes.items()
    }
    return {label: writes for label, writes in recent.items() if writes}


@dataclass(slots=True)
class _Turn:
    """What the turn decided so far (the steps append to it)."""

    now: float
    writes: dict[str, tuple[tuple[float, str], ...]] = field(default_factory=dict)
    """Each label's writes within the window (``AgentState.label_writes``), this turn's added."""
    flapping: set[str] = field(default_factory=set)
    """Labels held this turn: written ``CHANGE_LIMIT`` times within the window."""
    patch: dict[str, str] = field(default_factory=dict)
    cordon: CordonAction | None = None
    evict: bool = False
    waiting: WaitReason | None = None
    errors: list[ReconcileError] = field(default_factory=list)
    events: list[NodeEvent] = field(default_factory=list)
    episodes: list[tuple[tuple[str, ...], NodeEvent, ReconcileError | None]] = field(
        default_factory=list
    )
    active: set[tuple[str, ...]] = field(default_factory=set)

    def episode(
        self, key: tuple[str, ...], event: NodeEvent, error: ReconcileError | None = None
    ) -> None:
        """A condition that holds this turn: reported (Event, error) only when it begins."""
        self.active.add(key)
        self.episodes.append((key, event, error))


def _episode_events(out: _Turn, already: frozenset[tuple[str, ...]]) -> list[NodeEvent]:
    """This turn's Events: every label write, and each episode that was not already going on
    (whose error is counted once, here)."""
    events = list(out.events)
    reported: set[tuple[str, ...]] = set(already)
    for key, event, error in out.episodes:
        if key in reported:
            continue
        reported.add(key)
        events.append(event)
        if error is not None:
            out.errors.append(error)
    return events


def _track(track: LabelTrack | None, value: str, current: str | None, now: float) -> LabelTrack:
    """Follow the agent's writes of one label: seen, in flight, or reverted by another writer."""
    if track is None or track.value != value:
        track = LabelTrack(value=value)
    if current == value:
        return replace(track, seen=True, conflict=False)
    recent = tuple(t for t in track.reverts if now - t < REVERT_WINDOW_SECONDS)
    track = replace(track, reverts=recent)
    if track.written_at is not None and (
        track.seen or now - track.written_at >= WRITE_SETTLE_SECONDS
    ):
        # The agent's write was seen and then undone (or never showed): another writer.
        reverts = (*recent, now)
        track = replace(
            track,
            written_at=None,
            seen=False,
            reverts=reverts,
            conflict=track.conflict or len(reverts) >= REVERT_LIMIT,
        )
    return track


def _needs_write(track: LabelTrack | None, current: str | None, label: str, out: _Turn) -> bool:
    """Whether ``label`` differs and is the agent's to write now (not in flight, no conflict)."""
    if track is None or current == track.value:
        return False
    if track.conflict:
        out.episode(
            ("conflict", label, track.value),
            NodeEvent(
                reason=NodeEventReason.LABEL_CONFLICT,
                message=(
                    f"{label} reverted to {current!r} {REVERT_LIMIT} times within "
                    f"{REVERT_WINDOW_SECONDS:.0f}s by another writer; leaving it alone "
                    f"(wanted {track.value!r})"
                ),
            ),
            ReconcileError.LABEL_CONFLICT,
        )
        return False
    if track.written_at is not None:
        return False
    writes = out.writes.get(label, ())
    if len(writes) >= CHANGE_LIMIT:
        _report_flapping(label, current, track.value, writes, out)
        return False
    return True


def _report_flapping(
    label: str,
    current: str | None,
    wanted: str,
    writes: tuple[tuple[float, str], ...],
    out: _Turn,
) -> None:
    """Held: the label was written ``CHANGE_LIMIT`` times within the window, whatever the
    values (the hold lasts until the oldest of them leaves the window, or a new config)."""
    out.flapping.add(label)
    values = ", ".join(repr(v) for v in sorted({value for _, value in writes}))
    release = min(t for t, _ in writes) + REVERT_WINDOW_SECONDS - out.now
    out.episode(
        ("flapping", label),
        NodeEvent(
            reason=NodeEventReason.LABEL_CONFLICT,
            message=(
                f"{label} was written {len(writes)} times within {REVERT_WINDOW_SECONDS:.0f}s "
                f"(values {values}) and would change again, to {wanted!r}: the node's rule "
                "changes with the labels it sets (a rule selecting on a label that another "
                "controller derives from this one, such as nvidia.com/gpu.product) or another "
                f"writer keeps changing it; leaving it "
                f"{'unset' if current is None else f'at {current!r}'} for {release:.0f}s more, "
                "or until the sharing config changes"
            ),
        ),
        ReconcileError.LABEL_FLAPPING,
    )


def _held(held: Mapping[str, HeldLabel], node: NodeView, out: _Turn) -> None:
    """Labels left as they are because their value cannot be checked: reported where the Node
    differs (a Node already at the rule's value needs nothing)."""
    for label in SHARING_LABELS:
        entry = held.get(label)
        current = node.labels.get(label)
        if entry is None or current == entry.value:
            continue
        out.episode(
            ("held", label, entry.value, entry.reason),
            NodeEvent(
                reason=NodeEventReason.CONFIG_INVALID,
                message=(
                    f"{label} left {'unset' if current is None else f'at {current!r}'}, not "
                    f"set to {entry.value!r}: {entry.reason}; it is set once that ConfigMap "
                    "can be read"
                ),
            ),
            ReconcileError.NVIDIA_CONFIG_MISSING,
        )
        if out.waiting is None:
            out.waiting = WaitReason.NVIDIA_CONFIG_MISSING


def _time_slicing(tracks: Mapping[str, LabelTrack], node: NodeView, out: _Turn) -> None:
    """The device-plugin label is applied as soon as it differs."""
    label = DEVICE_PLUGIN_CONFIG_LABEL
    track = tracks.get(label)
    if _needs_write(track, node.labels.get(label), label, out):
        assert track is not None
        out.patch[label] = track.value


@dataclass(frozen=True, slots=True, kw_only=True)
class _MigInput:
    track: LabelTrack | None
    node: NodeView
    gpu_pods: int
    policy: MigChangePolicy
    allow_eviction: bool
    keep_cordon_on_failure: bool
    unevictable: tuple[str, ...]
    drain: tuple[str, float] | None
    """The drain going on before this turn (``AgentState.drain``)."""


def _mig(m: _MigInput, state: AgentState, out: _Turn) -> AgentState:
    """The MIG label: await a change in progress, else start one under the policy; then settle
    the agent's cordon. Returns the state with the MIG and cordon bookkeeping updated."""
    node = m.node
    if node.mig_busy and state.mig_applied_at is not None:
        state = replace(state, mig_seen_busy=True)
    if node.unschedulable:
        state = replace(state, cordon_sent_at=None)
    label = MIG_CONFIG_LABEL
    current = node.labels.get(label)
    if _awaiting(m, state):
        _cordon_lifted_while_applying(m, out)
        if not _outcome_in(m, state, out):
            return state
        # The awaited change is done: report its failure, then decide afresh (a newer desired
        # value starts its own change under the cordon already there).
        _report_failed(m, out, current)
    state = replace(state, mig_applied_at=None, mig_applied_value=None, mig_seen_busy=False)
    if _needs_write(m.track, current, label, out):
        return _change(m, state, out)
    if m.track is not None and m.track.written_at is not None and current != m.track.value:
        # Our write is in flight (the Node view lags): keep any cordon, write nothing.
        return state
    return _settle_cordon(m, state, out)


def _awaiting(m: _MigInput, state: AgentState) -> bool:
    """A change of the mig label is written (and still on the Node) and its outcome not yet
    in: whatever is desired now, mig-manager may be re-partitioning for it."""
    applied = state.mig_applied_value
    if applied is None and m.track is not None:
        applied = m.track.value
    return (
        state.mig_applied_at is not None
        and applied is not None
        and m.node.labels.get(MIG_CONFIG_LABEL) == applied
    )


def _outcome_in(m: _MigInput, state: AgentState, out: _Turn) -> bool:
    """Whether mig-manager's ``success``/``failed`` for the awaited change is in; else wait."""
    assert state.mig_applied_at is not None
    picked_up = state.mig_seen_busy or out.now - state.mig_applied_at >= MIG_PICKUP_SECONDS
    if m.node.mig_busy or not picked_up:
        _wait(out, m, WaitReason.MIG_APPLYING, value=m.node.labels.get(MIG_CONFIG_LABEL))
        return False
    return True


def _report_failed(m: _MigInput, out: _Turn, value: str | None) -> None:
    """mig-manager reports ``failed`` for ``value``, the mig label the agent wrote."""
    if m.node.mig_state != "failed" or value is None:
        return
    out.episode(
        ("failed", value),
        NodeEvent(
            reason=NodeEventReason.MIG_CHANGE_FAILED,
            message=f"mig-manager reports failed for {MIG_CONFIG_LABEL}={value}",
        ),
        ReconcileError.MIG_CHANGE_FAILED,
    )


def _settle_cordon(m: _MigInput, state: AgentState, out: _Turn) -> AgentState:
    """No MIG change to make or await: report a failed one, and lift the agent's own cordon
    (never anyone else's) once mig-manager is done."""
    node = m.node
    failed = node.mig_state == "failed"
    if m.track is not None and node.labels.get(MIG_CONFIG_LABEL) == m.track.value:
        _report_failed(m, out, m.track.value)
    if node.mig_busy:
        if node.agent_cordoned:
            _wait(out, m, WaitReason.MIG_APPLYING)
        return state
    if node.agent_cordoned and not (failed and m.keep_cordon_on_failure):
        out.cordon = CordonAction.UNCORDON
    return state


def _cordon_lifted_while_applying(m: _MigInput, out: _Turn) -> None:
    """The agent's cordon was lifted (or taken over: someone cordoned after a ``kubectl
    uncordon``) while mig-manager applies the change. Not cordoned again: mig-manager is already
    re-partitioning, and whoever lifted it decided the node serves again; the agent lifts no
    cordon for this change. Reported once."""
    node = m.node
    if node.agent_cordoned or node.annotations.get(CORDONED_BY_ANNOTATION) != CORDONED_BY_AGENT:
        return
    value = node.labels.get(MIG_CONFIG_LABEL) or ""
    how = "replaced by someone else's cordon" if node.unschedulable else "lifted"
    out.episode(
        ("cordon_lifted", value),
        NodeEvent(
            reason=NodeEventReason.MIG_CHANGE_WAITING,
            message=(
                f"the agent's cordon was {how} while mig-manager applies {MIG_CONFIG_LABEL}="
                f"{value}: the agent does not cordon again and will lift no cordon for this "
                "change"
            ),
        ),
    )


def _change(m: _MigInput, state: AgentState, out: _Turn) -> AgentState:
    """The mig label differs: write it once the policy's conditions hold, else say what for."""
    assert m.track is not None
    node = m.node
    if node.mig_busy:
        _wait(out, m, WaitReason.MIG_STATE_BUSY)
        return state
    if m.policy is MigChangePolicy.FORCE:
        out.patch[MIG_CONFIG_LABEL] = m.track.value
        return state
    if m.policy in (MigChangePolicy.CORDON, MigChangePolicy.DRAIN) and not node.unschedulable:
        return _cordon(m, state, out)
    if m.gpu_pods > 0:
        state = _evict(m, state, out)
        _wait(out, m, WaitReason.GPU_PODS)
        return state
    out.patch[MIG_CONFIG_LABEL] = m.track.value
    return state


def _cordon(m: _MigInput, state: AgentState, out: _Turn) -> AgentState:
    """Cordon once; a cordon sent but not yet visible is not sent again until it should be."""
    assert m.track is not None
    sent = state.cordon_sent_at
    if sent is None or out.now - sent >= WRITE_SETTLE_SECONDS:
        out.cordon = CordonAction.CORDON
        state = replace(state, cordon_sent_at=out.now)
    if m.node.annotations.get(CORDONED_BY_ANNOTATION) == CORDONED_BY_AGENT:
        # The agent's marker on a schedulable node: its cordon was lifted (`kubectl uncordon`)
        # before the change was written. The policy applies a MIG change only on a cordoned
        # node, so it cordons again, and says so; changing the sharing config stops it.
        out.episode(
            ("recordon", m.track.value),
            NodeEvent(
                reason=NodeEventReason.MIG_CHANGE_WAITING,
                message=(
                    f"the agent's cordon was lifted before {MIG_CONFIG_LABEL}={m.track.value} "
                    f"was applied; cordoning again (migChangePolicy {m.policy.value} changes MIG "
                    "only on a cordoned node; change the sharing config to call the change off)"
                ),
            ),
        )
    _wait(out, m, WaitReason.CORDON)
    return state


def _evict(m: _MigInput, state: AgentState, out: _Turn) -> AgentState:
    """``Drain``: evict (the runtime skips pods a drain never evicts, which are reported here)
    until ``DRAIN_DEADLINE_SECONDS`` after the first eviction for this value."""
    if m.policy is not MigChangePolicy.DRAIN:
        return state
    assert m.track is not None
    value = m.track.value
    if m.allow_eviction:
        if m.unevictable:
            out.episode(
                ("unevictable", value, *m.unevictable),
                NodeEvent(
                    reason=NodeEventReason.MIG_CHANGE_WAITING,
                    message=(
                        f"{MIG_CONFIG_LABEL}={value} (Drain) waits for pods a drain never "
                        f"evicts (they would only start again): {', '.join(m.unevictable)}; "
                        "keep them off this node or delete them"
                    ),
                ),
            )
        started = m.drain[1] if m.drain is not None and m.drain[0] == value else out.now
        state = replace(state, drain=(value, started))
        if out.now - started < DRAIN_DEADLINE_SECONDS:
            out.evict = True
            return state
        out.episode(
            ("drain_timeout", value),
            NodeEvent(
                reason=NodeEventReason.MIG_CHANGE_WAITING,
                message=(
                    f"{MIG_CONFIG_LABEL}={value} (Drain): {m.gpu_pods} pod(s) still hold a GPU "
                    f"{DRAIN_DEADLINE_SECONDS:.0f}s after the drain began; no more evictions "
                    "for this change, waiting cordoned for them to finish (delete them, or "
                    "change the sharing config)"
                ),
            ),
            ReconcileError.DRAIN_TIMEOUT,
        )
        return state
    out.episode(
        ("no_eviction", m.track.value),
        NodeEvent(
            reason=NodeEventReason.MIG_CHANGE_WAITING,
            message=(
                "migChangePolicy Drain, but agent.allowEviction is false: not evicting; "
                "waiting for the GPU pods to finish"
            ),
        ),
        ReconcileError.EVICTION_NOT_ALLOWED,
    )
    return state


_WAIT_TEXT = {
    WaitReason.MIG_STATE_BUSY: "mig-manager is busy ({state})",
    WaitReason.CORDON: "the node to be cordoned",
    WaitReason.GPU_PODS: "{pods} pod(s) holding a GPU to finish",
    WaitReason.MIG_APPLYING: "mig-manager to report success or failed (now {state})",
}


def _wait(out: _Turn, m: _MigInput, reason: WaitReason, *, value: str | None = None) -> None:
    out.waiting = reason
    if value is None:
        value = m.track.value if m.track is not None else ""
    text = _WAIT_TEXT[reason].format(state=m.node.mig_state, pods=m.gpu_pods)
    out.episode(
        ("waiting", value, reason.value),
        NodeEvent(
            reason=NodeEventReason.MIG_CHANGE_WAITING,
            message=f"{MIG_CONFIG_LABEL}={value} ({m.policy.value}) waits for {text}",
        ),
    )
