"""Change-driven sampling: a fast memory read of every device, and a process listing only of
the devices that need one (docs/design.md, Fast path).

Owns what is remembered between fast reads (the last sample, each device's used memory at its
listing), the order of one tick: read memory → pick devices (``core.sampling``) → list them →
attach the read to the sample for device pressure, and the pause between two ticks: a sleep, or,
with a quiet gate (``ports.QuietGate``, native), a wait that reads memory without waking Python
and returns at the first tick whose read could list something. Blocking: the enforcer's
fast-path reader thread calls :meth:`tick` and :meth:`pause` (``WatchedRead.repeat``) under its
NVML watchdog. Must not decide anything about pods.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import replace

from gpuguard.core.model import DeviceKey, GpuSample, ListingDue
from gpuguard.core.sampling import LastListings, due_for_listing
from gpuguard.ports import FastGpuSource, QuietGate


class ChangeDrivenSampler:
    """Lists a device's processes only when its memory moved by more than ``step_bytes`` since
    its last listing, when that listing reaches ``max_age_seconds`` (the poll interval), or when
    a violation on it can move on (``Decision.urgent``: its grace period or termination timeout
    ran out, or the device is under pressure while one waits for confirmation).

    With ``tick_seconds`` equal to ``max_age_seconds`` every device is listed at every tick:
    sampling as it was before the fast path, plus the memory read that device pressure needs.

    ``gate``: between ticks, wait in it instead of sleeping while no violation is urgent. A tick
    it skips is one whose read would have listed nothing: the gate returns when a device moved
    past ``step_bytes`` from its read at listing, a read failed, the oldest listing (or a GPU's
    retry) falls due, or :meth:`wake` is called; the tick then runs as after a sleep.
    """

    def __init__(
        self,
        source: FastGpuSource,
        *,
        clock: Callable[[], float],
        step_bytes: int,
        max_age_seconds: float,
        tick_seconds: float,
        gate: QuietGate | None = None,
    ) -> None:
        self._source = source
        self._gate = gate
        self._clock = clock
        self._step = step_bytes
        self._max_age = max_age_seconds
        self._tick = tick_seconds
        self._last: GpuSample | None = None
        self._listings: LastListings | None = None
        self._used_at_listing: dict[DeviceKey, int] = {}

    @classmethod
    def polling(
        cls, source: FastGpuSource, *, clock: Callable[[], float], poll_seconds: float
    ) -> ChangeDrivenSampler:
        """Poll-only (``enforcement.fast_interval_seconds = 0``): a tick every ``poll_seconds``
        that lists every device, plus the memory read device pressure needs. The same sampler
        and loop as the fast path, at a fixed tick."""
        return cls(
            source,
            clock=clock,
            step_bytes=0,
            max_age_seconds=poll_seconds,
            tick_seconds=poll_seconds,
        )

    @property
    def tick_seconds(self) -> float:
        return self._tick

    @property
    def gated(self) -> bool:
        """Ticks are skipped in a quiet gate (native) rather than slept between."""
        return self._gate is not None

    def wake(self) -> None:
        """From any thread: the violations changed, so a pause in the gate ends now (a pause
        that reads ``urgent`` after this sees the change)."""
        if self._gate is not None:
            self._gate.wake()

    def close(self) -> None:
        """The fast path stops: a pause in the gate ends now."""
        if self._gate is not None:
            self._gate.close()

    def call_seconds(self) -> float | None:
        """How long the gate's NVML call in flight has run (``None``: none, or no gate)."""
        return None if self._gate is None else self._gate.call_seconds()

    def pause(self, seconds: float, urgent: Callable[[], Mapping[DeviceKey, ListingDue]]) -> None:
        """Between two ticks: at least ``seconds``; with a gate, while no violation is
        ``urgent()``, until the first tick that could list something (see the class)."""
        first = time.monotonic() + max(0.0, seconds)
        gate = self._gate
        if gate is not None:
            gate.rearm()  # before urgent() is read: a wake() after this ends the wait below
            plan = None if urgent() else self._quiet_plan()
            if plan is not None:
                baseline, due_in = plan
                now = time.monotonic()
                gate.wait(
                    baseline=baseline,
                    step_bytes=self._step,
                    interval_seconds=self._tick,
                    first=first,
                    until=now + due_in,
                )
        left = first - time.monotonic()
        if left > 0:
            time.sleep(left)

    def _quiet_plan(self) -> tuple[Mapping[DeviceKey, int], float] | None:
        """What the gate waits on: each device's read at listing, and in how many seconds (this
        sampler's clock) the first listing falls due (``due_for_listing``'s age rule);
        ``None`` when a device has no read at listing or nothing was listed yet."""
        listings = self._listings
        if listings is None or not listings.listed_at:
            return None
        baseline = self._used_at_listing
        if baseline.keys() != listings.listed_at.keys():
            return None
        oldest = min(listings.listed_at.values())
        if listings.skipped_at is not None:
            oldest = min(oldest, listings.skipped_at)
        due_at = oldest + self._max_age - self._tick / 2
        return dict(baseline), due_at - self._clock()

    def tick(self, urgent: Mapping[DeviceKey, ListingDue] | None = None) -> GpuSample | None:
        """One fast read, and the listings it calls for: the new sample, or ``None`` when no
        device needed listing. Raises ``GpuSourceError`` (and ``GpuSourceUnavailable``) as the
        source does; nothing is remembered from a tick that raised."""
        memory = self._source.read_memory()
        due = due_for_listing(
            last=self._listings,
            memory=memory,
            used_at_listing=self._used_at_listing,
            urgent=urgent or {},
            now=self._clock(),
            step_bytes=self._step,
            max_age_seconds=self._max_age,
            tick_seconds=self._tick,
        )
        if due is not None and not due:
            return None
        sample = self._source.sample() if due is None else self._source.sample_devices(due)
        if due is None or (self._last is not None and set(memory) != self._keys(self._last)):
            # Everything was listed, or the units changed under the read: read again, so each
            # device's "used at listing" is its own and the next tick compares like with like.
            memory = self._source.read_memory()
        for device in sample.devices:
            key = device.key
            if sample.listing(key).seq == sample.seq and key in memory:
                self._used_at_listing[key] = memory[key].used_bytes
        keys = self._keys(sample)
        self._used_at_listing = {k: v for k, v in self._used_at_listing.items() if k in keys}
        sample = replace(sample, memory=memory)
        self._last = sample
        self._listings = LastListings.of(sample)
        return sample

    @staticmethod
    def _keys(sample: GpuSample) -> set[DeviceKey]:
        return {d.key for d in sample.devices}
