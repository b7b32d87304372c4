"""Process lists: the compute, graphics and MPS-client processes of one enforcement unit.

Owns the choice of lists, the ``_v3`` → ``_v2`` fallback, the retry of a list that grew between
NVML's count and fetch, the merge of one PID listed several times, and the values refused as
untrustworthy (reported as :class:`SampleIssue`, never guessed; docs/reliability.md N7). Must not
look at ``/proc``: a PID NVML lists is reported as listed (the runtime tells ghosts from live
processes).
"""

from __future__ import annotations

from gpuguard.adapters.nvml import lib
from gpuguard.adapters.nvml.calls import CallGuard
from gpuguard.adapters.nvml.devices import Unit
from gpuguard.adapters.nvml.lib import Handle, NvmlCallError
from gpuguard.core.model import GpuDevice, SampleIssue


class ProcessReader:
    """NVML: nvmlDeviceGetComputeRunningProcesses_v3, nvmlDeviceGetGraphicsRunningProcesses_v3 and
    nvmlDeviceGetMPSComputeRunningProcesses_v3 per handle (``_v2`` when the driver lacks ``_v3``;
    each a count call plus a fetch when non-empty).

    ``graphics``, ``mps``: also read the graphics and the MPS-client lists. Each costs about as
    much driver CPU as the compute list even when empty (H200, driver 580: ~1.2 ms per list per
    GPU with 100 processes; docs/performance.md). Leaving one out makes graphics-only processes
    (EGL/OpenGL rendering) or MPS clients invisible.
    """

    def __init__(self, calls: CallGuard, *, graphics: bool, mps: bool) -> None:
        self._calls = calls
        self._kinds = tuple(
            kind
            for kind, wanted in (("Compute", True), ("Graphics", graphics), ("MPSCompute", mps))
            if wanted
        )
        self._use_v2: set[str] = set()

    def read(
        self, unit: Unit, issues: list[SampleIssue]
    ) -> tuple[dict[int, int | None], frozenset[int]]:
        """The unit's processes as ``pid -> used bytes`` (``None``: unknown), deduplicated by
        PID; and the PIDs listed as MPS clients. Raises ``NvmlCallError``.

        A PID in several lists is one process: each list reports "all of the memory used by the
        application", so the values are not added; the largest known value is kept (the
        lists overlap). ``usedGpuMemory`` N/A stays ``None``. A value above the unit's memory, or
        known values summing above it, are untrusted (``None``) and reported.
        """
        dev = unit.device
        merged: dict[int, int | None] = {}
        mps: set[int] = set()
        for handle in unit.handles:
            for kind in self._kinds:
                entries = self._list(kind, handle, dev, issues)
                if kind == "MPSCompute":
                    mps.update(pid for pid, _raw in entries if pid > 0)
                for pid, raw in entries:
                    _merge(merged, dev, kind=kind, pid=pid, raw=raw, issues=issues)
        known = sum(u for u in merged.values() if u is not None)
        if known > dev.total_bytes:
            issues.append(
                _issue(
                    dev,
                    pid=None,
                    reason="memory_sum_above_total",
                    detail=f"processes sum to {known} B on a {dev.total_bytes} B device",
                )
            )
            merged = dict.fromkeys(merged)
        return merged, frozenset(mps)

    def _list(
        self, kind: str, handle: Handle, dev: GpuDevice, issues: list[SampleIssue]
    ) -> list[tuple[int, int]]:
        """One process list as ``(pid, raw usedGpuMemory)``: missing ``_v3`` → ``_v2`` (and
        ``_v2`` from then on), a list that grew between count and fetch → retried once."""
        for attempt in (1, 2):
            symbol = f"nvmlDeviceGet{kind}RunningProcesses_{'v2' if kind in self._use_v2 else 'v3'}"
            try:
                return self._calls.call(lib.process_list(symbol), handle)
            except NvmlCallError as exc:
                if exc.code == lib.FUNCTION_NOT_FOUND and kind not in self._use_v2:
                    self._use_v2.add(kind)
                elif exc.code == lib.INSUFFICIENT_SIZE and attempt == 1:
                    detail = f"{symbol}: INSUFFICIENT_SIZE, retried"
                    issues.append(_issue(dev, pid=None, reason="list_grew", detail=detail))
                else:
                    raise
        symbol = f"nvmlDeviceGet{kind}RunningProcesses_v2"
        return self._calls.call(lib.process_list(symbol), handle)


def _merge(
    merged: dict[int, int | None],
    dev: GpuDevice,
    *,
    kind: str,
    pid: int,
    raw: int,
    issues: list[SampleIssue],
) -> None:
    """Adds one list entry: an invalid PID is dropped, a value above the unit's memory becomes
    unknown (both reported); a PID already seen keeps the larger known value."""
    used: int | None = None if raw == lib.NOT_AVAILABLE else raw
    if pid <= 0:
        detail = f"{kind} list entry with pid {pid}"
        issues.append(_issue(dev, pid=None, reason="invalid_pid", detail=detail))
        return
    if used is not None and used > dev.total_bytes:
        detail = f"{used} B reported on a {dev.total_bytes} B device"
        issues.append(_issue(dev, pid=pid, reason="memory_above_total", detail=detail))
        used = None
    if pid in merged:
        best = merged[pid]
        if used is None or (best is not None and best >= used):
            return
    merged[pid] = used


def _issue(dev: GpuDevice, *, pid: int | None, reason: str, detail: str) -> SampleIssue:
    return SampleIssue(
        uuid=dev.uuid,
        gpu_instance_id=dev.gpu_instance_id,
        pid=pid,
        reason=reason,
        detail=detail,
    )
