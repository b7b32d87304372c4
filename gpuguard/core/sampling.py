"""Change-driven sampling: which devices to list again after a fast read of their memory.

Owns the rule of DESIGN §3 "Fast path": a device's processes are listed again when its used
memory moved by more than a step since its last listing, when that listing is about to be older
than the poll interval, when its memory could not be read, or when a violation on it under
memory pressure waits for its second fresh listing. Must not do I/O or read a clock.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuguard.core.model import DeviceKey, DeviceMemory, GpuSample


def due_for_listing(
    *,
    last: GpuSample | None,
    memory: Mapping[DeviceKey, DeviceMemory],
    used_at_listing: Mapping[DeviceKey, int],
    urgent: frozenset[DeviceKey],
    now: float,
    step_bytes: int,
    max_age_seconds: float,
    tick_seconds: float,
) -> frozenset[DeviceKey] | None:
    """The devices to list again now: ``None`` means every device (nothing listed yet, a GPU
    that could not be listed, a device that appeared), an empty set means none.

    Args:
        last: The last sample (its devices, skips and per-device listings).
        memory: This fast read; a device of ``last`` missing here could not be read.
        used_at_listing: Each device's used memory as read just before its last listing.
        urgent: Devices ``decide()`` wants listed at every fast read (``Decision.urgent``).
        now: Monotonic seconds of this fast read.
        step_bytes: A move of more than this since the last listing lists the device again.
        max_age_seconds: No listing gets older than this (the poll interval).
        tick_seconds: Seconds between fast reads: a listing that would pass its maximum age
            before the next read is due now.
    """
    if last is None or set(memory) - {d.key for d in last.devices}:
        return None
    stale_at = now + tick_seconds / 2
    if last.skipped and stale_at - last.taken_at >= max_age_seconds:
        return None  # a GPU that could not be listed is tried again at the poll interval
    due: set[DeviceKey] = set()
    for device in last.devices:
        key = device.key
        read = memory.get(key)
        before = used_at_listing.get(key)
        if (
            key in urgent
            or read is None
            or before is None
            or abs(read.used_bytes - before) > step_bytes
            or stale_at - last.listing(key).taken_at >= max_age_seconds
        ):
            due.add(key)
    return frozenset(due)
