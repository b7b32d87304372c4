"""The enforcement loop: read → list what moved → attribute → decide → act → publish.

One loop (docs/design.md, Fast path): a :class:`ChangeDrivenSampler` reads every device's memory
each tick and lists the devices that need it (their memory moved, their listing reached the poll
interval, or a violation under pressure waits for its second listing); a cycle runs on each
listing, and at least once per poll interval. Poll-only (``enforcement.fast_interval_seconds =
0``) is the same loop whose tick is the poll interval: every device listed at every tick.
:meth:`Enforcer.run` turns it on a reader thread of its own until stopped; :meth:`Enforcer.step`
turns it once, for a caller that paces it (the demo, benchmarks, tests): the same read, the same
hand-over, the same cycle.

Owns the order of one cycle and per-action isolation. Every blocking call (NVML, /proc, signals)
runs off the event loop: the reads on the reader thread under a watchdog (``WatchedRead``: a
late result kept, no second read beside a hung one), because they can hang, and so does each
killer call (one per container at a time: a call past its timeout holds up no other
container's stop, and its report is handled when it ends). Must not import adapters or vendor
libraries: it speaks ports and gpuguard errors only.

Size: over 600 lines, on purpose: one loop: the reads' hand-over, the urgent devices, the lock
and the killer calls, and their interplay is the thing to review; the primitives are apart
(runtime/watched_read.py, runtime/sampling.py, runtime/tasks.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import structlog

from gpuguard.core.allocation import UNKNOWN_ALLOCATIONS
from gpuguard.core.freeze import frozen_since, with_frozen
from gpuguard.core.model import (
    Attribution,
    ContainerId,
    DeviceKey,
    EnforcementPolicy,
    EventReason,
    GpuSample,
    GpuUuid,
    KillTarget,
    ListingDue,
    Mode,
    NodeLockState,
    PodEvent,
    PodUid,
    RefusalReason,
    SampleIssue,
    SignalReport,
    StopSignal,
    Trigger,
)
from gpuguard.core.node_condition import node_condition
from gpuguard.core.policy import (
    Decision,
    EnforcerState,
    Refusal,
    SignalAction,
    Track,
    bypassed_text,
    decide,
)
from gpuguard.core.stopping import describe_delivery
from gpuguard.errors import GpuSourceError, GpuSourceLost, GpuSourceUnavailable
from gpuguard.ports import (
    Clock,
    EventSink,
    Killer,
    MetricsRecorder,
    NodeConditionWriter,
    NodeDirectory,
    NodeLock,
    ProcessResolver,
    Publisher,
)
from gpuguard.runtime.allocations import AllocationReads
from gpuguard.runtime.allocguard import GuardService
from gpuguard.runtime.sampling import ChangeDrivenSampler
from gpuguard.runtime.watched_read import WatchedRead

log = structlog.get_logger(__name__)

_LISTING = "an NVML call"
_ATTRIBUTING = "reading /proc to attribute the listed PIDs"
_SIGNALLING = "signalling a container's processes"

_Listed = tuple[GpuSample, dict[int, Attribution]]
"""A listing with its PIDs' attributions, read after it."""


class Enforcer:
    """Runs enforcement cycles against the ports it is given."""

    def __init__(
        self,
        *,
        sampler: ChangeDrivenSampler,
        resolver: ProcessResolver,
        pods: NodeDirectory,
        killer: Killer,
        events: EventSink,
        recorder: MetricsRecorder,
        publisher: Publisher,
        clock: Clock,
        policy: EnforcementPolicy,
        poll_interval_seconds: float,
        gpu_timeout_seconds: float = 5.0,
        kill_wait_seconds: float = 1.0,
        blocked: Refusal | None = None,
        lock: NodeLock | None = None,
        allocations: AllocationReads | None = None,
        condition: NodeConditionWriter | None = None,
        guard: GuardService | None = None,
    ) -> None:
        """``blocked``: no signal can be sent at all (a start-up self-check failed: the host PID
        namespace, or ``CAP_KILL``; ``app.run_enforce``): ``decide()`` refuses every violation
        with its reason instead, so nothing is counted as sent.
        ``sampler``: what reads the GPUs (change-driven sampling over the GPU source; its tick
        the fast interval, or the poll interval when poll-only).
        ``lock``: the node lock (reliability R3): while another process holds it, every cycle
        stands by (decided as paused: nothing acted on, posted or counted; not ready); it is
        tried again every poll interval. ``None``: no lock (the demo, in-process tests).
        ``allocations``: the kubelet's pod resources, read off the loop (``None``: every
        allocation unknown, so no GPU use is reported or stopped for want of one).
        ``condition``: where each cycle's Node condition goes (``None``: no API server).
        ``guard``: the attached allocation guard (``None``: off, or it could not attach): its
        stops list their device at once, each cycle decides with the frozen allocations
        counted (``core.freeze.with_frozen``), and writes the headroom after it."""
        self._resolver = resolver
        self._pods = pods
        self._killer = killer
        self._events = events
        self._recorder = recorder
        self._publisher = publisher
        self._clock = clock
        self._policy = policy
        self._poll_interval = poll_interval_seconds
        self._gpu_timeout = gpu_timeout_seconds
        self._kill_wait = kill_wait_seconds
        self._blocked = blocked
        self._state = EnforcerState()
        self._stopped: set[tuple[PodUid, ContainerId, DeviceKey]] = set()
        """Containers counted in ``gpuguard_kills_total`` during their open violation (kept
        while a track stops them: :func:`_still_stopping`)."""
        self._cycle = 0
        self._last_sample: GpuSample | None = None
        self._skipped: dict[tuple[int | None, GpuUuid | None], str] = {}
        """Devices the last sample skipped, with why: logged on change only."""
        self._issues: frozenset[tuple[str, int, int, str]] = frozenset()
        """Values the last sample refused to trust: each logged when it first appears."""
        self._sampler = sampler
        self._urgent: Mapping[DeviceKey, ListingDue] = {}
        self._read_problem: str | None = None
        """Why the fast reads (or the attribution) fail, while they do: logged when it changes,
        not 20 times a second."""
        self._gpu_lost = False
        """The GPU source is lost (``GpuSourceLost``: NVML's handle went bad, reliability N13)
        and no sample has arrived since: nothing is decided on what was read before."""
        self._handover = _FastHandover()
        """What the reads hand the loop: the newest listing not decided on, why reading
        fails, whether the source is lost."""
        self._attributions: dict[int, Attribution] = {}
        """The PIDs of ``_last_sample``, attributed after it was listed: the pair a cycle
        without a new listing decides on again."""
        self._lock = lock
        self._allocations = allocations
        self._condition = condition
        self._guard = guard
        self._lock_state: NodeLockState | None = None
        self._lock_tried_at = 0.0
        self._signal_timeout = gpu_timeout_seconds + kill_wait_seconds
        """How long :meth:`_signal` waits for a killer call: the bound of any other blocking
        call plus the wait for exits the call makes itself at the SIGKILL step."""
        self._signalling: dict[tuple[PodUid, ContainerId], _SignalCall] = {}
        """Containers whose killer call has not ended (past its timeout): no second call for
        one of them starts until it has."""

    async def run(self, stop: asyncio.Event) -> None:
        """Turn the loop until ``stop``: a thread of its own reads memory every tick and lists
        what needs listing (no event-loop round trip per read: the hop cost more than the read);
        a cycle runs on each new listing, and at least every poll interval on the last one, so a
        stuck or failing NVML still turns into stale data that is reported, never acted on.

        Every device is listed at least every poll interval, so a cycle without a new listing
        is forced only after two: forcing one after one made a listing and the forced cycle
        land back to back half the time (6 cycles a second instead of 4, measured)."""
        loop = asyncio.get_running_loop()
        arrived = asyncio.Event()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed while stopping
                loop.call_soon_threadsafe(arrived.set)

        self._handover.wake = wake
        guard = self._guard
        if guard is not None:

            def frozen() -> None:
                self._sampler.wake()  # a pause in the quiet gate ends: the device is listed
                wake()

            guard.start(frozen)
        reads = self._start_reads()
        forced = 2 * self._poll_interval
        try:
            # Counted from the start: the first cycle waits for the first listing (a cycle
            # before it had only "no data" to report, a data_stale warning at every start),
            # or is forced like any other once two poll intervals pass without one.
            last_cycle = self._clock.monotonic()
            while not stop.is_set():
                now = self._clock.monotonic()
                wait = last_cycle + forced - now
                await _first_of(arrived, stop, within=max(0.0, wait))
                if stop.is_set():
                    break
                arrived.clear()
                now = self._clock.monotonic()
                turned = await self._turn(overdue=reads.overdue(), force=now - last_cycle >= forced)
                if turned is not None:
                    last_cycle = now
        finally:
            self._handover.wake = _nothing
            reads.close(join_seconds=self._gpu_timeout)
            if guard is not None:
                guard.close()

    async def step(self) -> Decision:
        """One turn of the loop, paced by the caller instead of the reader thread (the demo,
        benchmarks, tests): the read the reader thread repeats (a fast memory read, a listing of
        the devices that need one, their PIDs' attributions), off the event loop, handed over
        as the reader thread hands it, then the cycle :meth:`run` runs on it (on the last
        listing when nothing needed listing). No watchdog: a read that hangs hangs the step
        (:meth:`run` is what bounds it)."""
        try:
            self._handover.keep(await asyncio.to_thread(self._read))
        except Exception as exc:  # noqa: BLE001 — handed over as the reader thread does
            self._handover.fail(exc)
        decision = await self._turn(overdue=None, force=True)
        assert decision is not None  # forced
        return decision

    async def _turn(self, *, overdue: str | None, force: bool) -> Decision | None:
        """Take what the reads handed over and cycle on it: on a new listing, on a lost
        source (decided on at once: paused, not ready), or when forced (``None``: no
        cycle). ``overdue``: why a read has run past its timeout, if one has."""
        listed, problem, lost = self._handover.take()
        newly_lost = lost and not self._gpu_lost
        self._set_read_problem(overdue or problem, lost=lost)
        if listed is not None:
            self._keep_sample(listed[0])
            self._attributions = listed[1]
        elif not newly_lost and not force:
            return None
        # Without a new listing the last sample is decided on again with the attributions read
        # after it (the pair stays consistent; it ages into staleness, which decide() reports).
        return await self._cycle_on(self._last_sample, self._attributions)

    def _read(self, doing: Callable[[str], None] | None = None) -> _Listed | None:
        """Blocking: one tick of the sampler and, when it listed, the listed PIDs'
        attributions, read after the listing (``None``: nothing needed listing). ``doing``:
        told when the attribution starts (the watchdog then names what hangs: /proc, not
        NVML)."""
        sample = self._sampler.tick(self._due())
        if sample is None:
            return None
        if doing is not None:
            doing(_ATTRIBUTING)
        # Attributed here, after the listing, on the reading thread: the event loop makes no
        # thread hop per cycle (each cost more than reading 16 PIDs' /proc files).
        return sample, self._attribute_all(sample)

    def _due(self) -> Mapping[DeviceKey, ListingDue]:
        """The violations in progress, and the devices of allocations the guard froze since
        the last cycle: listed at this read (any thread)."""
        guard, last = self._guard, self._last_sample
        pending = guard.pending_devices() if guard is not None else frozenset()
        if not pending or last is None:
            return self._urgent
        due = dict(self._urgent)
        for d in last.devices:
            if d.index in pending and d.gpu_instance_id is None:
                due[d.key] = ListingDue(at=0.0)
        return due

    def _with_frozen(
        self, sample: GpuSample | None, attributions: Mapping[int, Attribution]
    ) -> tuple[GpuSample | None, Mapping[int, Attribution], dict[tuple[PodUid, DeviceKey], float]]:
        """The cycle's sample as the pods would be once each frozen call ran (docs/design.md,
        Allocation guard): the calls have not run, and a stop decided on this stops them first;
        with ``decide()``'s ``frozen``."""
        if self._guard is None or sample is None:
            return sample, attributions, {}
        held = self._guard.frozen()
        sample, counted = with_frozen(sample, attributions, held)
        return sample, counted, frozen_since(held, sample)

    def _start_reads(self) -> WatchedRead[_Listed | None]:
        """Start the reader thread: :meth:`_read` every tick, under the watchdog, handed to the
        event loop through ``_handover``."""
        sampler = self._sampler
        reads = WatchedRead[_Listed | None](
            "gpuguard-fast-read", timeout_seconds=self._gpu_timeout, clock=self._clock.monotonic
        )
        reads.repeat(
            functools.partial(self._read, reads.doing),
            every_seconds=sampler.tick_seconds,
            what=_LISTING,
            kept=self._handover.keep,
            failed=self._handover.fail,
            pause=_GatePause(sampler, self._due) if sampler.gated else None,
        )
        return reads

    def _set_read_problem(self, problem: str | None, *, lost: bool = False) -> None:
        """Keep why reading the GPUs (the fast path, or the attribution) fails (``None``: it
        works); log when it starts failing, changes why, or recovers (not 20 times a second).
        ``lost``: the GPU source is lost (``GpuSourceLost``): logged once as
        ``nvml_handle_lost`` however its reason changes, the last sample is dropped
        (enforcement pauses at once, ``data_stale``), and the end is logged by the sample that
        ends it (:meth:`_keep_sample`)."""
        if lost:
            if not self._gpu_lost:
                # The reason says what failed, what gpuguard does about it and the fix.
                log.warning("nvml_handle_lost", error=problem)
            self._gpu_lost = True
            self._last_sample, self._attributions = None, {}
            self._read_problem = problem
            return
        if problem == self._read_problem:
            return
        if problem is None:
            if not self._gpu_lost:  # a loss ends with a sample: nvml_handle_recovered
                log.info("gpu_sample_recovered", error=self._read_problem)
        else:
            log.warning("gpu_sample_failed", error=problem)
        self._read_problem = problem

    async def _cycle_on(
        self, sample: GpuSample | None, attributions: Mapping[int, Attribution]
    ) -> Decision:
        """Decide, act and publish on ``sample`` (``None``: nothing could be read) and the
        attributions of its PIDs, read after it."""
        self._cycle += 1
        started = self._clock.monotonic()
        standby = await self._standby()
        sample, attributions, frozen = self._with_frozen(sample, attributions)
        with structlog.contextvars.bound_contextvars(cycle=self._cycle):
            decision = decide(
                sample=sample,
                attributions=attributions,
                pods=self._pods.snapshot(),
                node=self._pods.node(),
                policy=self._policy,
                state=self._state,
                now=self._clock.monotonic(),
                blocked=self._blocked,
                standby=standby,
                allocations=(
                    self._allocations.latest()
                    if self._allocations is not None
                    else UNKNOWN_ALLOCATIONS
                ),
                frozen=frozen,
            )
            self._state = decision.state
            if decision.allocations_due and self._allocations is not None:
                self._allocations.due()
            self._urgent = decision.urgent
            if decision.urgent:
                self._sampler.wake()  # a pause in the quiet gate ends: listings are due
            if decision.reread:
                self._pods.reread(decision.reread)
            await self._act(decision)
            if self._guard is not None:
                await self._guard.after_cycle(decision, sample, attributions)
            self._stopped = _still_stopping(self._stopped, decision.state.tracks)
            elapsed = self._clock.monotonic() - started
            self._recorder.observe_poll(elapsed)
            active = decision.enforcement_active and self._blocked is None
            if standby is not None:
                reason = f"{standby.reason.value}: {standby.detail}"
            elif self._blocked is not None:
                reason = f"{self._blocked.reason.value}: {self._blocked.detail}"
            else:
                reason = "" if active else str(decision.inactive_reason or "")
            self._publisher.publish(
                decision, wall_time=self._clock.wall(), ready=active, reason=reason
            )
            if self._condition is not None:  # docs/design.md, Node condition
                now = node_condition(
                    decision, mode=self._policy.mode, standby=standby, blocked=self._blocked
                )
                self._condition.set(now, standby=standby is not None)
            log.debug(
                "poll_finished",
                duration_seconds=round(elapsed, 6),
                processes=len(sample.processes) if sample else 0,
                signals=len(decision.signals),
                refusals=len(decision.refusals),
                active=active,
            )
        return decision

    async def _standby(self) -> Refusal | None:
        """``None`` while this enforcer holds the node lock (or has none); else why it stands
        by. The lock is tried (held: re-checked) at most once per poll interval: taking it off
        the loop (it may create a directory and a file); re-checking a held one on the loop
        (an ``fstat`` and an ``lstat`` of a file in the lock's own local directory: microseconds,
        where a thread hop woke the default executor three times and the loop twice a second)."""
        lock = self._lock
        if lock is None:
            return None
        now = self._clock.monotonic()
        state = self._lock_state
        if state is None or now - self._lock_tried_at >= self._poll_interval:
            self._lock_tried_at = now
            if state is not None and state.held:
                state = lock.hold()
            else:
                state = await asyncio.to_thread(lock.hold)
            self._keep_lock_state(state)
        if state.held:
            return None
        return Refusal(reason=RefusalReason.LOCK_HELD, detail=state.detail)

    def _keep_lock_state(self, state: NodeLockState) -> None:
        """Keep ``state``; log when this enforcer takes the lock, or stands by (again, or for
        another holder or problem): once per change, not every poll."""
        last, self._lock_state = self._lock_state, state
        if last is not None and (last.held, last.holder_pid, last.problem) == (
            state.held,
            state.holder_pid,
            state.problem,
        ):
            return
        if state.held:
            log.info(
                "enforcement_lock_acquired",
                lock_file=state.path,
                after_standby=last is not None,
            )
            return
        log.warning(
            "enforcement_standby",
            reason=RefusalReason.LOCK_HELD.value,
            lock_file=state.path,
            holder_pid=state.holder_pid,
            problem=state.problem,
            detail=(
                f"{state.detail}: another gpuguard enforcer on this node acts; this one serves "
                "metrics, is not ready and acts on nothing until the lock is free"
                if state.problem is None
                else f"{state.detail}: cannot take the node lock; acting on nothing until it can"
            ),
        )

    def _keep_sample(self, sample: GpuSample) -> None:
        """Keep ``sample`` as the last one; log devices skipped or recovered since the last,
        and the end of a lost GPU source."""
        if self._gpu_lost:
            log.info("nvml_handle_recovered", error=self._read_problem)
            self._gpu_lost = False
        # Logged when a device's state changes, not every poll: with nvml.fail_on_init_error
        # false a permanently broken GPU logged gpu_skipped four times a second.
        skipped = {(skip.index, skip.uuid): skip.reason for skip in sample.skipped}
        for (index, uuid), reason in skipped.items():
            if self._skipped.get((index, uuid)) != reason:
                log.warning("gpu_skipped", gpu=index, uuid=uuid, reason=reason)
        for index, uuid in self._skipped.keys() - skipped.keys():
            log.info("gpu_recovered", gpu=index, uuid=uuid)
        self._skipped = skipped
        # A refused value stays in the listing it came from (carried over until the GPU is
        # listed again, and usually refused again then), so one that persists is logged once,
        # not once per sample; its detail (the value) may change without a new line.
        issues = {_issue_key(issue): issue for issue in sample.issues}
        for key in sorted(issues.keys() - self._issues):
            issue = issues[key]
            # A list that grew between NVML's count and fetch is retried: churn, not a fault.
            emit = log.info if issue.reason == "list_grew" else log.warning
            emit(
                "gpu_value_refused",
                reason=issue.reason,
                uuid=issue.uuid,
                gpu_instance_id=issue.gpu_instance_id,
                pid=issue.pid,
                detail=issue.detail,
            )
        self._issues = frozenset(issues)
        self._last_sample = sample

    def _attribute_all(self, sample: GpuSample | None) -> dict[int, Attribution]:
        """Blocking (``/proc``): every PID of ``sample``, read after it was taken."""
        if sample is None:
            return {}
        return {
            pid: self._resolver.attribute(pid) for pid in sorted({p.pid for p in sample.processes})
        }

    async def _act(self, decision: Decision) -> None:
        for trigger in decision.violations:
            self._recorder.count_violation(trigger)
        for use in decision.unallocated:
            self._recorder.count_unallocated(use)
            log.warning(
                "gpu_used_without_allocation",
                namespace=use.pod.namespace,
                pod=use.pod.name,
                containers=list(use.containers),
                gpu=use.device.index,
                gpu_instance_id=use.device.gpu_instance_id,
                used_bytes=use.used_bytes,
                allocated=use.allocated,
            )
        for refusal in decision.refusals:
            self._recorder.count_refusal(refusal.reason)
            log.warning(
                "violation_refused" if refusal.pod else "memory_not_enforced",
                reason=refusal.reason.value,
                namespace=refusal.pod.namespace if refusal.pod else None,
                pod=refusal.pod.name if refusal.pod else None,
                gpu_uuid=refusal.device.uuid if refusal.device else None,
                pid=refusal.pid,
                detail=refusal.detail or None,
            )
        for action in decision.would_signal:
            log.warning(
                "would_stop_container",
                mode=Mode.AUDIT.value,
                signal=action.signal.value,
                **_over_limit(action.target),
                trigger=action.trigger.value,
            )
        for event in decision.events:
            self._post(event)
        for action in decision.signals:
            await self._signal(action)

    async def _signal(self, action: SignalAction) -> None:
        """Stop ``action``'s container through the killer, in a daemon thread of its own
        (``WatchedRead``: never the default executor, whose threads ``asyncio.run`` joins at
        exit), waited for at most ``gpu_timeout_seconds`` + ``kill_wait_seconds``. Past that the
        call is refused (counted ``signal_failed``, logged ``signal_timeout``) and the next
        action goes on; the call keeps running, and its report is logged when it ends (its
        Event posted) but not counted: the attempt was counted once, at its timeout (every stop
        attempt ends as exactly one of acted, refused or error). While it runs, a new action for
        the same container is refused (``signal_still_running``) instead of starting a second
        call."""
        t = action.target
        key = (t.pod.uid, t.container_id)
        running = self._signalling.get(key)
        if running is not None:
            self._recorder.count_refusal(RefusalReason.SIGNAL_FAILED)
            log.error(
                "signal_still_running",
                namespace=t.pod.namespace,
                pod=t.pod.name,
                container=t.container_name,
                signal=action.signal.value,
                running_signal=running.action.signal.value,
                detail=(
                    f"the {running.action.signal.value} call for this container has not ended: "
                    "no second call starts beside it; what it did is logged when it ends"
                ),
            )
            return
        wait = self._kill_wait if action.signal is StopSignal.KILL else 0.0
        calls = WatchedRead[SignalReport]("gpuguard-signal", timeout_seconds=self._signal_timeout)
        call = _SignalCall(action=action)
        self._signalling[key] = call
        calls.start(
            functools.partial(self._killer.signal_container, t, action.signal, wait_seconds=wait),
            what=_SIGNALLING,
            kept=functools.partial(self._signalled, call),
            failed=functools.partial(self._signal_failed, call),
        )
        try:
            report = await calls.result()
        except Exception:  # noqa: BLE001 — handled by _signal_failed, on the loop, before this
            return
        # A call that ended just as the watchdog fired was handled (and counted) on the loop
        # already: no timeout to count.
        if report is None and not call.ended:
            call.timed_out = True
            self._recorder.count_refusal(RefusalReason.SIGNAL_FAILED)
            log.error(
                "signal_timeout",
                namespace=t.pod.namespace,
                pod=t.pod.name,
                container=t.container_name,
                signal=action.signal.value,
                timeout_seconds=self._signal_timeout,
                detail=calls.late(_SIGNALLING)
                + "; it goes on in the background, and what it did is logged when it ends",
            )

    def _signal_failed(self, call: _SignalCall, exc: BaseException) -> None:
        """A killer call raised (per-action isolation: log, count, continue); one past its
        timeout was counted then, and is only logged."""
        t = call.action.target
        self._end(call)
        if not call.timed_out:
            self._recorder.count_refusal(RefusalReason.SIGNAL_FAILED)
        log.error(
            "signal_failed",
            namespace=t.pod.namespace,
            pod=t.pod.name,
            container=t.container_name,
            signal=call.action.signal.value,
            error=str(exc),
        )

    def _signalled(self, call: _SignalCall, report: SignalReport) -> None:
        """A killer call ended, in time or late: log its refusals and survivors, and post
        ``GPUProcessKilled`` when something was delivered. Counted (its refusals, and the stop
        once per container per violation) only in time: a call past its timeout was counted
        ``signal_failed`` then, and marks no container stopped, so the container's next step
        that delivers in time counts its stop."""
        action = call.action
        t = action.target
        self._end(call)
        for refusal in report.refused:
            if not call.timed_out:
                self._recorder.count_refusal(refusal.reason)
            log.warning(
                "signal_refused",
                pid=refusal.pid,
                reason=refusal.reason.value,
                detail=refusal.detail,
                namespace=t.pod.namespace,
                pod=t.pod.name,
            )
        if report.survivors:
            log.error(
                "process_survived_sigkill",
                pids=[p.pid for p in report.survivors],
                namespace=t.pod.namespace,
                pod=t.pod.name,
            )
        if report.delivered:
            key = (t.pod.uid, t.container_id, t.device)
            # Once per container per violation, TERM or KILL.
            if not call.timed_out and key not in self._stopped:
                self._stopped.add(key)
                self._recorder.count_kill(t, wall_time=self._clock.wall())
            _log_signalled(action, report)
            self._post(_killed_event(action, report))

    def _end(self, call: _SignalCall) -> None:
        """``call`` ended: a new one for its container may start; one past its timeout says
        so, since what it did is logged after the fact and was counted at the timeout."""
        t = call.action.target
        call.ended = True
        self._signalling.pop((t.pod.uid, t.container_id), None)
        if call.timed_out:
            log.warning(
                "signal_ended_late",
                namespace=t.pod.namespace,
                pod=t.pod.name,
                container=t.container_name,
                signal=call.action.signal.value,
                detail=(
                    "the call counted signal_failed at its timeout has ended: what it did is "
                    "logged (and an Event posted) but not counted again"
                ),
            )

    def _post(self, event: PodEvent) -> None:
        try:
            self._events.post(event)
        except Exception as exc:  # noqa: BLE001 — an Event must never stop enforcement
            log.warning("event_post_failed", reason=event.reason.value, error=str(exc))


@dataclass(slots=True, kw_only=True)
class _SignalCall:
    """One killer call for a container, while it runs and once it has ended."""

    action: SignalAction
    timed_out: bool = False
    """Counted ``signal_failed`` at its timeout: what it reports later is not counted."""
    ended: bool = False
    """Its outcome was delivered on the loop (and counted, unless ``timed_out``)."""


def _still_stopping(
    stopped: set[tuple[PodUid, ContainerId, DeviceKey]],
    tracks: Mapping[tuple[PodUid, DeviceKey], Track],
) -> set[tuple[PodUid, ContainerId, DeviceKey]]:
    """The containers of ``stopped`` whose violation is still open: their pod's own track on the
    device, or any track on the device that sent them SIGTERM. A group of pods holding a DRA
    share together is tracked under the group's key (``policy.SHARED_TRACK_PREFIX``), not under
    a pod it stops: keeping only the pods' own tracks counted such a stop again at SIGKILL."""
    escalating = {
        (container, device)
        for (_, device), track in tracks.items()
        for container in track.sigterm_sent_to
    }
    return {
        (uid, container, device)
        for uid, container, device in stopped
        if (uid, device) in tracks or (container, device) in escalating
    }


class _GatePause:
    """``watched_read.Pause`` over the sampler's quiet gate; ``urgent``: the violations in
    progress, read at each pause (none: the gate may skip ticks)."""

    what = "a fast memory read in the quiet gate"

    def __init__(
        self,
        sampler: ChangeDrivenSampler,
        urgent: Callable[[], Mapping[DeviceKey, ListingDue]],
    ) -> None:
        self._sampler = sampler
        self._urgent = urgent

    def wait(self, seconds: float) -> None:
        self._sampler.pause(seconds, self._urgent)

    def close(self) -> None:
        self._sampler.close()

    def call_seconds(self) -> float | None:
        return self._sampler.call_seconds()


async def _first_of(*events: asyncio.Event, within: float) -> None:
    """Wait until one of ``events`` is set or ``within`` seconds pass."""
    if any(e.is_set() for e in events):
        return
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, timeout=within, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


def _log_attribution_failed(exc: BaseException) -> None:
    log.error("attribution_failed", error=f"{type(exc).__name__}: {exc}")


def _log_signalled(action: SignalAction, report: SignalReport) -> None:
    """One line per signal sent: at the SIGTERM step a member on which SIGTERM would be lost
    may get SIGKILL at once; ``step`` is the escalation's step, and ``sigterm_lost`` says, per
    such member, what it got and why."""
    by_signal: dict[StopSignal, list[int]] = {}
    for p in report.delivered:
        by_signal.setdefault(report.signal_of(p.pid), []).append(p.pid)
    for sent, pids in by_signal.items():
        lost = [
            {"pid": s.pid, "fate": s.fate.value, "detail": s.detail}
            for s in report.stops
            if s.signal is sent
        ]
        log.warning(
            "container_signalled",
            signal=sent.value,
            step=action.signal.value,
            **_over_limit(action.target),
            pids=pids,
            sigterm_lost=lost or None,
            trigger=action.trigger.value,
        )


def _killed_event(action: SignalAction, report: SignalReport) -> PodEvent:
    """``GPUProcessKilled``: which signal went to which PID and why, and by how much."""
    t = action.target
    why = {
        Trigger.PRESSURE: "; the GPU is under memory pressure: grace period skipped",
        Trigger.ALLOCATION: "; its allocation past the limit was frozen before it ran: grace "
        "period skipped",
    }.get(action.trigger, "")
    over = (
        f"used without an allocation (the pod was allocated: {t.unallocated})"
        if t.unallocated is not None
        else f"over its own limit {t.limit_bytes} bytes ({t.own_limit.what}); the pod's other "
        "containers were left running"
        if t.own_limit is not None
        else f"over the limit {t.limit_bytes} bytes"
    )
    return PodEvent(
        pod=t.pod,
        reason=EventReason.PROCESS_KILLED,
        message=(
            f"sent {describe_delivery(report)} of container "
            f"{t.container_name or t.container_id[:12]}: GPU memory "
            f"{t.used_bytes} bytes on GPU {t.gpu_index} {over}{why}{bypassed_text(t.bypassed)}"
        ),
    )


def _over_limit(target: KillTarget) -> dict[str, object]:
    """The log fields naming a container over its limit, and by how much."""
    return {
        "namespace": target.pod.namespace,
        "pod": target.pod.name,
        "container": target.container_name,
        "gpu": target.gpu_index,
        "used_bytes": target.used_bytes,
        "limit_bytes": target.limit_bytes,
        "own_limit": None if target.own_limit is None else target.own_limit.what,
        "enforcement_bypassed": None if target.bypassed is None else target.bypassed.value,
    }


def _issue_key(issue: SampleIssue) -> tuple[str, int, int, str]:
    gi = -1 if issue.gpu_instance_id is None else issue.gpu_instance_id
    return (issue.uuid, gi, -1 if issue.pid is None else issue.pid, issue.reason)


def _nothing() -> None:
    """No loop waits for a hand-over (:meth:`Enforcer.step` takes it itself)."""


class _FastHandover:
    """What the reads hand the event loop: the newest listing not decided on yet (with its
    PIDs' attributions), why reading fails while it does, and whether the GPU source is lost.
    ``wake`` (thread-safe; set by :meth:`Enforcer.run` while its loop waits) is called only when
    there is a listing or the problem changed, not at every read."""

    def __init__(self) -> None:
        self.wake: Callable[[], None] = _nothing
        self._guard = threading.Lock()
        self._newest: _Listed | None = None
        self._problem: str | None = None
        self._lost = False
        """The source raised ``GpuSourceLost`` and no sample has come since."""

    def take(self) -> tuple[_Listed | None, str | None, bool]:
        """The newest listing not taken yet (``None``: none) with its PIDs' attributions, the
        current problem, and whether the source is lost (``GpuSourceLost`` since the last
        sample)."""
        with self._guard:
            newest, self._newest = self._newest, None
            return newest, self._problem, self._lost

    def keep(self, listed: _Listed | None) -> None:
        """A read worked (``None``: no device needed listing)."""
        self._hand_over(listed, None, lost=False)

    def fail(self, exc: Exception) -> None:
        """A read failed: a lost or failing source, or a bug (logged, and reading goes on: a
        bug must not end sampling silently)."""
        if isinstance(exc, GpuSourceError | GpuSourceUnavailable):
            self._hand_over(
                None, str(exc) or type(exc).__name__, lost=isinstance(exc, GpuSourceLost)
            )
            return
        problem = f"{type(exc).__name__}: {exc}"
        if problem != self._problem:
            log.error("gpu_sample_bug", exc_info=exc)
        self._hand_over(None, problem, lost=False)

    def _hand_over(
        self,
        listed: _Listed | None,
        problem: str | None,
        *,
        lost: bool,
    ) -> None:
        with self._guard:
            changed = problem != self._problem or (lost and not self._lost)
            self._problem = problem
            # Sticky until a sample comes: another failure while lost does not end it.
            self._lost = (self._lost or lost) and listed is None
            if lost:
                self._newest = None  # read before the loss: not decided on any more
            if listed is not None:
                self._newest = listed
        if listed is not None or changed:
            self.wake()
