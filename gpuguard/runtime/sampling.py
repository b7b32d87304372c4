"""Change-driven sampling: a fast memory read of every device, and a process listing only of
the devices that need one (docs/design.md, Fast path).

Owns what is remembered between fast reads (the last sample, each device's used memory at its
listing) and the order of one tick: read memory → pick devices (``core.sampling``) → list them →
attach the read to the sample for device pressure. Blocking: the enforcer's fast-path reader
thread calls :meth:`tick` (``WatchedRead.repeat``) under its NVML watchdog. Must not decide
anything about pods.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from gpuguard.core.model import DeviceKey, GpuSample, ListingDue
from gpuguard.core.sampling import LastListings, due_for_listing
from gpuguard.ports import FastGpuSource


class ChangeDrivenSampler:
    """Lists a device's processes only when its memory moved by more than ``step_bytes`` since
    its last listing, when that listing reaches ``max_age_seconds`` (the poll interval), or when
    a violation on it can move on (``Decision.urgent``: its grace period or termination timeout
    ran out, or the device is under pressure while one waits for confirmation).

    With ``tick_seconds`` equal to ``max_age_seconds`` every device is listed at every tick:
    sampling as it was before the fast path, plus the memory read that device pressure needs.
    """

    def __init__(
        self,
        source: FastGpuSource,
        *,
        clock: Callable[[], float],
        step_bytes: int,
        max_age_seconds: float,
        tick_seconds: float,
    ) -> None:
        self._source = source
        self._clock = clock
        self._step = step_bytes
        self._max_age = max_age_seconds
        self._tick = tick_seconds
        self._last: GpuSample | None = None
        self._listings: LastListings | None = None
        self._used_at_listing: dict[DeviceKey, int] = {}

    @property
    def tick_seconds(self) -> float:
        return self._tick

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
