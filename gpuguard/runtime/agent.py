"""The sharing agent's loop (docs/design.md, Sharing config): read, decide (``core.reconcile``),
write, report.

Owns the turn: the sharing config in force (``core.agent.ConfigInForce``: an invalid new config
is rejected whole, reported once with ``SharingConfigInvalid``; a deleted one changes nothing),
the node's desired labels (``core.sharing.match_node``, first matching rule; a label whose
NVIDIA ConfigMap cannot be read is held and reported, the other still applies), one decision,
then its actions in order: one Node patch (labels, cordon, annotation; conditional on the Node's
resourceVersion, at most one per ``min_write_interval_seconds``), evictions (each pod at most
every ``EVICTION_RETRY_SECONDS``, each owner's pods at most ``OWNER_EVICTIONS`` per
``OWNER_EVICTION_WINDOW_SECONDS``, never a DaemonSet's pod or a mirror pod), Node Events,
metrics. A decision whose patch did not land
(409, an API error, the write rate limit) is not committed: the next turn decides again from
the Node as it is then, so nothing is half-done; after an API error only the count of each
label's changes is kept (the write may have landed: the flip hold, ``core.reconcile``, must
not be lifted by failing writes). Each turn tells the decision which config is in force
(``ConfigInForce.generation``): a new one lifts the hold. Blocking calls run in threads.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import structlog

from gpuguard.core.agent import (
    ConfigInForce,
    EvictionOutcome,
    NodePatch,
    PodOwner,
    SharingInputs,
    evictable_pods,
    unevictable_pods,
)
from gpuguard.core.model import PodUid
from gpuguard.core.reconcile import (
    AgentDecision,
    AgentState,
    NodeEvent,
    NodeEventReason,
    ReconcileError,
    reconcile,
)
from gpuguard.core.sharing import (
    MIG_CONFIG_LABEL,
    SHARING_LABELS,
    MigChangePolicy,
    SharingConfig,
    match_node,
)
from gpuguard.core.text import printable
from gpuguard.errors import GpuguardError, WriteConflict
from gpuguard.ports import AgentRecorder, Clock, NodeEventSink, NodeWriter, SharingSource

log = structlog.get_logger(__name__)

WRITE_BACKOFF_MAX_SECONDS = 60.0
"""After a failed Node write (403 from RBAC or the admission fence, a 5xx) the next is tried
after 2, 4, 8 … up to this many seconds, not once a second for ever."""
EVICTION_RETRY_SECONDS = 10.0
"""An eviction a PodDisruptionBudget blocked (or one accepted, while the pod terminates) is not
requested again for this long: the API server is not hammered once a second per pod."""
OWNER_EVICTIONS = 5
OWNER_EVICTION_WINDOW_SECONDS = 60.0
"""At most ``OWNER_EVICTIONS`` evictions of one owner's pods (a pod without a controller is its
own owner) per this many seconds: a controller that puts a new pod (a new UID) back on the
cordoned node at once (it sets ``nodeName`` itself, or tolerates the cordon) would otherwise be
evicted every turn; the drain deadline (``core.reconcile.DRAIN_DEADLINE_SECONDS``) ends it."""
MAX_ERRORS_IN_EVENT = 5
MAX_UNEVICTABLE_NAMED = 5
"""Pods a drain never evicts named in one Event (then ``and N more``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentOptions:
    allow_eviction: bool = False
    keep_cordon_on_failure: bool = False
    interval_seconds: float = 1.0
    min_write_interval_seconds: float = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnReport:
    """What one turn did (for tests and the demo)."""

    synced: bool
    rule: str | None = None
    decision: AgentDecision | None = None
    patched: NodePatch | None = None
    held: str | None = None
    """Why the decision was not carried out this turn (``rate_limit``, ``conflict``,
    ``api_error``), else ``None``."""
    evictions: dict[str, EvictionOutcome] = field(default_factory=dict)


class Agent:
    """One node's sharing agent: ``turn()`` once, or ``run(stop)`` until stopped."""

    def __init__(
        self,
        *,
        source: SharingSource,
        writer: NodeWriter,
        events: NodeEventSink,
        recorder: AgentRecorder,
        clock: Clock,
        options: AgentOptions | None = None,
    ) -> None:
        self._source = source
        self._writer = writer
        self._events = events
        self._recorder = recorder
        self._clock = clock
        self._options = options or AgentOptions()
        self._config = ConfigInForce()
        self._state = AgentState()
        self._last_write: float | None = None
        self._write_wait = 0.0
        """Seconds to wait after the last write: the rate limit, or the backoff after a failure."""
        self._evicted_at: dict[PodUid, float] = {}
        self._blocked: set[PodUid] = set()
        self._owner_evictions: dict[tuple[str, str, str], list[float]] = {}
        """Per owner (namespace, kind, name): when evictions of its pods were accepted, within
        the window (a PodDisruptionBudget's refusals do not count)."""
        self._owners_held: set[tuple[str, str, str]] = set()
        """Owners at their eviction limit, reported once until they fall below it."""
        self._missing_node_logged = False

    def ready(self) -> tuple[bool, str]:
        """``/readyz``: every source read once and none failing."""
        problem = self._source.problem()
        if problem is not None:
            return False, str(problem)
        if not self._source.inputs().synced:
            return False, "waiting for the first read of the Node, pods and ConfigMaps"
        return True, ""

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop``: one turn every ``interval_seconds``."""
        while not stop.is_set():
            await self.turn()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self._options.interval_seconds)

    async def turn(self) -> TurnReport:
        inputs = self._source.inputs()
        if not inputs.synced:
            return TurnReport(synced=False)
        config = self._adopt(inputs)
        node = inputs.node
        if node is None:
            # Deleted (or not registered yet): a Node registered again under this name is new;
            # nothing the agent remembers of the old one (writes in flight, reverts) applies.
            self._state = AgentState()
            if not self._missing_node_logged:
                log.warning("agent_node_missing", detail="the agent's Node does not exist")
                self._missing_node_logged = True
            return TurnReport(synced=True)
        self._missing_node_logged = False
        match = match_node(node.labels, node.name, config) if config else None
        rule = match.rule if match else None
        now = self._clock.monotonic()
        decision = reconcile(
            desired=match.labels if match else {},
            held=match.held if match else None,
            node=node,
            gpu_pods=len(inputs.gpu_pods),
            policy=config.mig_change_policy if config else MigChangePolicy.WHEN_IDLE,
            allow_eviction=self._options.allow_eviction,
            state=self._state,
            now=now,
            keep_cordon_on_failure=self._options.keep_cordon_on_failure,
            unevictable=unevictable_pods(inputs, limit=MAX_UNEVICTABLE_NAMED),
            config_generation=self._config.generation,
        )
        patch = NodePatch(
            resource_version=inputs.resource_version,
            labels=decision.patch_labels,
            cordon=decision.cordon,
        )
        held = await self._idle_check(patch, config)
        if held is None:
            held = await self._write(patch, now, decision.state)
        if held is not None:
            return TurnReport(synced=True, rule=rule, decision=decision, held=held)
        self._state = decision.state
        evictions = await self._evict(inputs, now) if decision.evict_gpu_pods else {}
        self._report(decision, rule, node.labels, patch)
        return TurnReport(
            synced=True,
            rule=rule,
            decision=decision,
            patched=None if patch.empty else patch,
            evictions=evictions,
        )

    # -- steps -----------------------------------------------------------------------------------

    def _adopt(self, inputs: SharingInputs) -> SharingConfig | None:
        turn = self._config.update(inputs.document)
        kept = "the last good config stays in force" if turn.config else "nothing is changed"
        if turn.rejected is not None:
            errors = turn.rejected.errors
            shown = "; ".join(errors[:MAX_ERRORS_IN_EVENT])
            extra = len(errors) - MAX_ERRORS_IN_EVENT
            more = f" (and {extra} more)" if extra > 0 else ""
            log.error("sharing_config_invalid", errors=list(errors), kept=kept)
            self._recorder.count_reconcile_error(ReconcileError.CONFIG_INVALID)
            self._events.post_node(
                NodeEvent(
                    reason=NodeEventReason.CONFIG_INVALID,
                    message=f"sharing config rejected, {kept}: {shown}{more}",
                )
            )
        if turn.deleted:
            log.warning("sharing_config_deleted", kept=kept)
            self._recorder.count_reconcile_error(ReconcileError.CONFIG_MISSING)
            self._events.post_node(
                NodeEvent(
                    reason=NodeEventReason.CONFIG_INVALID,
                    message=f"the sharing ConfigMap was deleted: {kept}",
                )
            )
        if turn.adopted is not None:
            log.info(
                "sharing_config_adopted",
                rules=len(turn.config.rules) if turn.config else 0,
                warnings=list(turn.adopted.warnings),
            )
        return turn.config

    async def _write(self, patch: NodePatch, now: float, decided: AgentState) -> str | None:
        """Send the turn's patch; the reason it was held back, or ``None`` when it landed (or
        there was nothing to write). ``decided``: the state the decision would commit."""
        if patch.empty:
            return None
        last = self._last_write
        if last is not None and now - last < self._write_wait:
            return "rate_limit"
        self._last_write = now
        limit = self._options.min_write_interval_seconds
        try:
            await asyncio.to_thread(self._writer.patch_node, patch)
        except WriteConflict as exc:
            log.info("agent_write_conflict", detail=str(exc))
            self._write_wait = limit
            return "conflict"
        except GpuguardError as exc:
            # The write may have landed with its answer lost: forget what this agent believed
            # and read the change in progress back from the Node (its own cordon, the mig label),
            # as a restarted agent does, rather than act as if nothing was written. The count of
            # each label's writes is kept, this one included: a write that lands with its answer
            # lost still changed the label, and failing writes must not lift the flip hold.
            self._state = AgentState(
                label_writes=decided.label_writes, config_generation=decided.config_generation
            )
            self._write_wait = min(WRITE_BACKOFF_MAX_SECONDS, max(2.0, 2 * self._write_wait))
            log.warning("agent_write_failed", error=str(exc), retry_in_seconds=self._write_wait)
            self._recorder.count_reconcile_error(ReconcileError.API_ERROR)
            return "api_error"
        self._write_wait = limit
        log.info(
            "agent_node_patched",
            labels=dict(patch.labels),
            cordon=patch.cordon.value if patch.cordon else None,
        )
        return None

    async def _idle_check(self, patch: NodePatch, config: SharingConfig | None) -> str | None:
        """Before a MIG change that needs an idle node, the node's GPU pods from the source of
        truth: the pods watch may lag behind a pod bound a moment ago. Held: ``gpu_pods`` (the
        watch will catch up and the turn decides again) or ``api_error``."""
        policy = config.mig_change_policy if config else MigChangePolicy.WHEN_IDLE
        if MIG_CONFIG_LABEL not in patch.labels or policy is MigChangePolicy.FORCE:
            return None
        try:
            pods = await asyncio.to_thread(self._source.gpu_pods_now)
        except GpuguardError as exc:
            log.warning("agent_pods_unreadable", error=str(exc))
            self._recorder.count_reconcile_error(ReconcileError.API_ERROR)
            return "api_error"
        if pods:
            names = [f"{p.namespace}/{p.name}" for p in pods]
            log.info("agent_mig_change_held", reason="gpu pods the watch has not shown", pods=names)
            return "gpu_pods"
        return None

    async def _evict(self, inputs: SharingInputs, now: float) -> dict[str, EvictionOutcome]:
        outcomes: dict[str, EvictionOutcome] = {}
        window = OWNER_EVICTION_WINDOW_SECONDS
        self._owner_evictions = {
            key: kept
            for key, times in self._owner_evictions.items()
            if (kept := [t for t in times if now - t < window])
        }
        self._owners_held &= set(self._owner_evictions)
        for pod in evictable_pods(inputs):
            owner = inputs.owners.get(pod.uid, PodOwner())
            key = (
                (pod.namespace, owner.kind, owner.name)
                if owner.kind
                else (pod.namespace, "Pod", pod.name)
            )
            last = self._evicted_at.get(pod.uid)
            if last is not None and now - last < EVICTION_RETRY_SECONDS:
                continue
            if self._owner_at_limit(key):
                continue
            self._evicted_at[pod.uid] = now
            try:
                outcome = await asyncio.to_thread(self._writer.evict, pod)
            except GpuguardError as exc:
                log.warning(
                    "agent_eviction_failed", pod=f"{pod.namespace}/{pod.name}", error=str(exc)
                )
                self._recorder.count_reconcile_error(ReconcileError.API_ERROR)
                continue
            outcomes[f"{pod.namespace}/{pod.name}"] = outcome
            if outcome is EvictionOutcome.EVICTED:
                self._owner_evictions.setdefault(key, []).append(now)
            log.info("agent_eviction", pod=f"{pod.namespace}/{pod.name}", outcome=outcome.value)
            if outcome is EvictionOutcome.BLOCKED and pod.uid not in self._blocked:
                self._blocked.add(pod.uid)
                self._recorder.count_reconcile_error(ReconcileError.EVICTION_BLOCKED)
                self._events.post_node(
                    NodeEvent(
                        reason=NodeEventReason.MIG_CHANGE_WAITING,
                        message=(
                            f"eviction of {pod.namespace}/{pod.name} refused by a "
                            "PodDisruptionBudget; retrying"
                        ),
                    )
                )
            elif outcome is not EvictionOutcome.BLOCKED:
                self._blocked.discard(pod.uid)
        live = {pod.uid for pod in inputs.gpu_pods}
        self._evicted_at = {uid: t for uid, t in self._evicted_at.items() if uid in live}
        self._blocked &= live
        return outcomes

    def _owner_at_limit(self, key: tuple[str, str, str]) -> bool:
        """``OWNER_EVICTIONS`` of this owner's pods accepted within the window: report it once
        (until it falls below) and hold off."""
        times = self._owner_evictions.get(key, [])
        if len(times) < OWNER_EVICTIONS:
            return False
        if key not in self._owners_held:
            self._owners_held.add(key)
            who = printable(f"{key[1]} {key[0]}/{key[2]}")
            log.warning("agent_owner_eviction_limit", owner=who, evictions=len(times))
            self._events.post_node(
                NodeEvent(
                    reason=NodeEventReason.MIG_CHANGE_WAITING,
                    message=(
                        f"{who}: {len(times)} of its pods evicted within "
                        f"{OWNER_EVICTION_WINDOW_SECONDS:.0f}s, and it keeps putting pods back "
                        f"on this node; evicting at most {OWNER_EVICTIONS} of them per "
                        f"{OWNER_EVICTION_WINDOW_SECONDS:.0f}s"
                    ),
                )
            )
        return True

    def _report(
        self,
        decision: AgentDecision,
        rule: str | None,
        labels: Mapping[str, str],
        patch: NodePatch,
    ) -> None:
        for event in decision.events:
            log.info("agent_event", reason=event.reason.value, message=event.message)
            self._events.post_node(event)
        for error in decision.errors:
            self._recorder.count_reconcile_error(error)
        self._recorder.set_waiting(decision.waiting)
        current = {**labels, **patch.labels}
        dp, mig = (current.get(label) for label in SHARING_LABELS)
        self._recorder.show_labels(rule=rule, device_plugin_config=dp, mig_config=mig)
