"""What bounds each device's memory this cycle (docs/design.md, Metrics, coverage): every known
byte a device's processes hold, by the declaration that bound its pod's limit there, ``none``
(a pod nothing gpuguard enforces bounds) or ``unattributed`` (charged to no pod).

Pure, standard library only. Reads what ``decide()`` already published (``Decision.usages``,
``Decision.unattributed_bytes``): no second resolution of any limit, so what the metrics say
bounds a pod is the limit the enforcer held it to.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpuguard.core.limits import bound_by
from gpuguard.core.model import BoundBy, DeviceKey
from gpuguard.core.policy import PodUsage, UsageState


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceCoverage:
    """One GPU's (or MIG instance's) memory by what bounds it."""

    bound_bytes: Mapping[BoundBy, int]
    """Every ``BoundBy`` value (0 where nothing is), summing to the device's attributed and
    unattributed known usage: memory of processes whose usage NVML reports as N/A is unknown,
    so it is in no value."""
    pods_unbounded: int
    """Pods charged on the device (with known usage or not) that nothing bounds there."""


def usage_bound_by(usage: PodUsage) -> BoundBy:
    """What bounds one pod's memory on one device (``inspect``'s and the metric's words)."""
    return bound_by(usage.limit, exempt=usage.state is UsageState.EXEMPT)


def coverage(
    devices: Iterable[DeviceKey],
    usages: Iterable[PodUsage],
    unattributed_bytes: Mapping[DeviceKey, int],
) -> dict[DeviceKey, DeviceCoverage]:
    """Per device of ``devices`` (and any other one ``usages`` or ``unattributed_bytes``
    name), its memory by what bounds it and its unbounded pods."""
    bound: dict[DeviceKey, dict[BoundBy, int]] = {}
    unbounded: dict[DeviceKey, int] = {}

    def of(key: DeviceKey) -> dict[BoundBy, int]:
        values = bound.get(key)
        if values is None:
            values = bound[key] = dict.fromkeys(BoundBy, 0)
            unbounded[key] = 0
        return values

    for key in devices:
        of(key)
    for usage in usages:
        key = usage.device.key
        by = usage_bound_by(usage)
        of(key)[by] += usage.used_bytes
        if by is BoundBy.NONE:
            unbounded[key] += 1
    for key, value in unattributed_bytes.items():
        of(key)[BoundBy.UNATTRIBUTED] += value
    return {
        key: DeviceCoverage(bound_bytes=values, pods_unbounded=unbounded[key])
        for key, values in bound.items()
    }
