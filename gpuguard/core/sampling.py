"""Change-driven sampling: which devices to list again after a fast read of their memory.

Owns the rule of docs/design.md, Fast path: a device's processes are listed again when its used
memory moved by more than a step since its last listing, when that listing is about to be older
than the poll interval, when its memory could not be read, or when a violation on it can move
on (``ListingDue``: its grace period or termination timeout ran out, or device pressure can
confirm it). Must not do I/O or read a clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpuguard.core.model import DeviceKey, DeviceMemory, GpuSample, ListingDue


@dataclass(frozen=True, slots=True, kw_only=True)
class LastListings:
    """What each fast read is compared with, worked out once per sample (the read runs 20
    times a second; building device keys and listings at every read was most of its cost)."""

    listed_at: Mapping[DeviceKey, float]
    """Per device, when the listing its processes come from was taken."""
    skipped_at: float | None = None
    """When the last sample was taken, if a GPU in it could not be listed."""

    @staticmethod
    def of(sample: GpuSample) -> LastListings:
        return LastListings(
            listed_at={d.key: sample.listing(d.key).taken_at for d in sample.devices},
            skipped_at=sample.taken_at if sample.skipped else None,
        )


def due_for_listing(
    *,
    last: LastListings | None,
    memory: Mapping[DeviceKey, DeviceMemory],
    used_at_listing: Mapping[DeviceKey, int],
    urgent: Mapping[DeviceKey, ListingDue],
    now: float,
    step_bytes: int,
    max_age_seconds: float,
    tick_seconds: float,
) -> frozenset[DeviceKey] | None:
    """The devices to list again now: ``None`` means every device (nothing listed yet, a GPU
    that could not be listed, a device that appeared), an empty set means none.

    Args:
        last: The last sample's listings (``LastListings.of``), ``None`` before the first.
        memory: This fast read; a device of ``last`` missing here could not be read.
        used_at_listing: Each device's used memory as read just before its last listing.
        urgent: Devices with a violation in progress and when a listing can move it on
            (``Decision.urgent``): listed at every fast read from then on.
        now: Monotonic seconds of this fast read.
        step_bytes: A move of more than this since the last listing lists the device again.
        max_age_seconds: No listing gets older than this (the poll interval).
        tick_seconds: Seconds between fast reads: a listing that would pass its maximum age
            before the next read is due now.
    """
    if last is None or any(key not in last.listed_at for key in memory):
        return None
    stale_at = now + tick_seconds / 2
    if last.skipped_at is not None and stale_at - last.skipped_at >= max_age_seconds:
        return None  # a GPU that could not be listed is tried again at the poll interval
    due: set[DeviceKey] = set()
    for key, listed_at in last.listed_at.items():
        read = memory.get(key)
        before = used_at_listing.get(key)
        wanted = urgent.get(key)
        if (
            (wanted is not None and wanted.now_due(now, read))
            or read is None
            or before is None
            or abs(read.used_bytes - before) > step_bytes
            or stale_at - listed_at >= max_age_seconds
        ):
            due.add(key)
    return frozenset(due)
