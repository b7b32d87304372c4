"""The allocation guard's runtime side (docs/design.md, Allocation guard): a thread takes in
the guard's stops as they come and wakes the enforcer; after each cycle the frozen callers
whose fate is decided are resumed or left to the stop already sent, and the headroom of every
guarded container cgroup on each device listed is written again from that listing.

Owns: the frozen callers the guard reported (only those are ever resumed, each re-verified by
the ``Resumer``), taken over from the thawer as they arrive (``forget``: the thawer's own bound
would resume them mid-decision), their bound (``core.freeze.FREEZE_BOUND_SECONDS``, kept by
the drain thread, so a hung listing or cycle never leaves one stopped), the drain thread, and
the ``gpuguard_alloc_guard_*`` metrics. Must not: decide a stop (``decide()`` does, on the sample
``core.freeze.with_frozen`` gives it), signal anything but SIGCONT through the ``Resumer``, or
stop the enforcer: every failure is logged and counted, and the polling loop stays the guard.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Collection, Mapping

import structlog

from gpuguard.core.freeze import (
    FREEZE_BOUND_SECONDS,
    Fate,
    FrozenAllocation,
    GuardStop,
    budgets,
    fate,
)
from gpuguard.core.model import Attribution, EnforcementPolicy, GpuSample
from gpuguard.core.policy import Decision
from gpuguard.ports import AllocationGuard, Clock, GuardRecorder, ProcessResolver, Resumer

log = structlog.get_logger(__name__)

_DRAIN_TIMEOUT_SECONDS = 0.02
"""How long one wait for stops lasts: how soon the drain thread sees that it should end, and
how late past ``FREEZE_BOUND_SECONDS`` it resumes a caller no cycle decided on."""


class GuardService:
    """One attached allocation guard, as the enforcer uses it."""

    def __init__(
        self,
        *,
        guard: AllocationGuard,
        resolver: ProcessResolver,
        resumer: Resumer,
        recorder: GuardRecorder,
        clock: Clock,
        policy: EnforcementPolicy,
    ) -> None:
        self._guard = guard
        self._resolver = resolver
        self._resumer = resumer
        self._recorder = recorder
        self._clock = clock
        self._policy = policy
        self._lock = threading.Lock()
        self._arrived: list[FrozenAllocation] = []
        """Stops the drain thread took in, not yet taken by the loop."""
        self._frozen: dict[int, FrozenAllocation] = {}
        """Callers frozen, taken by the loop and not resolved yet, by tgid (under ``_lock``:
        the drain thread resumes those past the bound)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._write_problem: str | None = None

    # -- the drain thread ------------------------------------------------------------------

    def start(self, wake: Callable[[], None]) -> None:
        """Start draining stops; ``wake`` (thread-safe) is called after each batch."""
        self._thread = threading.Thread(
            target=self._drain, args=(wake,), name="gpuguard-alloc-guard", daemon=True
        )
        self._thread.start()

    def close(self, join_seconds: float = 1.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(join_seconds)
        self._guard.close()

    def _drain(self, wake: Callable[[], None]) -> None:
        while not self._stop.is_set():
            try:
                stops = self._guard.stops(_DRAIN_TIMEOUT_SECONDS)
            except Exception as exc:  # noqa: BLE001 — logged; the polling loop stays the guard
                log.error("alloc_guard_poll_failed", error=f"{type(exc).__name__}: {exc}")
                self._stop.wait(1.0)
                continue
            if stops:
                self.take_in(stops)
                wake()
            self.expire()

    def expire(self) -> None:
        """Blocking: resume (``bound``) every caller frozen for ``FREEZE_BOUND_SECONDS`` with no
        decision on it (the drain thread's, after each wait)."""
        now = self._clock.monotonic()
        with self._lock:
            due = [
                f
                for f in [*self._frozen.values(), *self._arrived]
                if now - f.frozen_at >= FREEZE_BOUND_SECONDS
            ]
            for f in due:
                self._frozen.pop(f.tgid, None)
            self._arrived = [f for f in self._arrived if f not in due]
        for f in due:
            self._resolve(f, Fate.BOUND)

    def take_in(self, stops: Collection[GuardStop]) -> None:
        """Blocking (``/proc``): read each stopped process as it is now (its identity, pod and
        cgroup: the only process a later SIGCONT may reach) and hand it to the loop."""
        now = self._clock.monotonic()
        frozen = [
            FrozenAllocation(
                tgid=s.tgid,
                device_index=s.device_index,
                size_bytes=s.size_bytes,
                frozen_at=now,
                attribution=self._resolver.attribute(s.tgid),
            )
            for s in stops
        ]
        for f in frozen:
            try:
                self._guard.forget(tgid=f.tgid)
            except Exception as exc:  # noqa: BLE001 — the thawer's bound then resumes it
                log.error(
                    "alloc_guard_forget_failed", pid=f.tgid, error=f"{type(exc).__name__}: {exc}"
                )
            log.info(
                "allocation_frozen",
                pid=f.tgid,
                gpu=f.device_index,
                size_bytes=f.size_bytes,
                pod_uid=f.attribution.pod_uid,
            )
        with self._lock:
            self._arrived.extend(frozen)

    # -- the loop's side -------------------------------------------------------------------

    def frozen(self) -> list[FrozenAllocation]:
        """The callers frozen now, those that just arrived included (the loop's)."""
        with self._lock:
            arrived, self._arrived = self._arrived, []
            self._merge(arrived)
            return list(self._frozen.values())

    def _merge(self, arrived: list[FrozenAllocation]) -> None:
        for f in arrived:
            # A second stop of a process still frozen (another thread of it) adds its size.
            held = self._frozen.get(f.tgid)
            self._frozen[f.tgid] = (
                f
                if held is None or held.device_index != f.device_index
                else FrozenAllocation(
                    tgid=f.tgid,
                    device_index=f.device_index,
                    size_bytes=held.size_bytes + f.size_bytes,
                    frozen_at=held.frozen_at,
                    attribution=held.attribution,
                )
            )

    def pending_devices(self) -> frozenset[int]:
        """Thread-safe: the device indexes of stops not taken by the loop yet (to be listed
        at once)."""
        with self._lock:
            return frozenset(f.device_index for f in self._arrived)

    async def after_cycle(
        self,
        decision: Decision,
        sample: GpuSample | None,
        attributions: Mapping[int, Attribution],
    ) -> None:
        """Resolve the frozen callers the cycle decided on, then write the headroom of every
        device ``sample`` listed (its own listing, not one carried over)."""
        signalled = {a.target.container_id for a in decision.signals}
        listed_at = (
            {d.index: sample.listing(d.key).taken_at for d in sample.devices}
            if sample is not None
            else {}
        )
        decided: list[tuple[FrozenAllocation, Fate]] = []
        with self._lock:
            for f in list(self._frozen.values()):
                what = fate(
                    f,
                    decision.usages,
                    signalled,
                    listed_at=listed_at.get(f.device_index),
                    policy=self._policy,
                )
                if what is not Fate.KEEP:
                    del self._frozen[f.tgid]
                    decided.append((f, what))
        for f, what in decided:
            await asyncio.to_thread(self._resolve, f, what)
        if sample is None:
            return
        listed = {
            d.index
            for d in sample.devices
            if d.gpu_instance_id is None and sample.listing(d.key).seq == sample.seq
        }
        if not listed:
            return
        planned = budgets(decision.usages, sample, attributions, self._policy)
        try:
            await asyncio.to_thread(self._guard.write, planned, listed)
        except Exception as exc:  # noqa: BLE001 — logged once; the polling loop stays the guard
            problem = f"{type(exc).__name__}: {exc}"
            if problem != self._write_problem:
                log.error("alloc_guard_write_failed", error=problem)
            self._write_problem = problem
            return
        if self._write_problem is not None:
            log.info("alloc_guard_write_recovered", error=self._write_problem)
            self._write_problem = None

    def _resolve(self, f: FrozenAllocation, what: Fate) -> None:
        """Blocking: resume ``f`` (re-verified: only a process still as read when its stop
        arrived, and still stopped) and count why. Its freeze record was dropped at
        ``take_in``; a stop of it made since is the thawer's until it is taken in too."""
        outcome = self._resumer.resume(f)
        if outcome is None:
            self._recorder.count_thaw(what.value)
            log.info("allocation_thawed", pid=f.tgid, reason=what.value, gpu=f.device_index)
        elif isinstance(outcome, int):
            log.info("allocation_thaw_not_needed", pid=f.tgid, reason=what.value)
        else:
            log.warning(
                "allocation_thaw_refused",
                pid=f.tgid,
                reason=outcome.reason.value,
                detail=outcome.detail,
            )
