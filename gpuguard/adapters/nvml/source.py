"""NVML adapter: GPUs, MIG instances and their compute processes, through nvidia-ml-py (pynvml).

Owns every call into NVML and the translation of its types and errors into ``core.model`` values
and ``gpuguard.errors``: nothing above this module sees ``NVMLError`` or a ctypes handle. Must not
read ``/proc``, decide anything about pods, log, or signal anything: a PID NVML lists is reported
as listed (the runtime tells ghosts from live processes), and doubtful values are reported as
unknown (``None``) with a :class:`SampleIssue`, never guessed.

Blocking and synchronous by design. The runtime calls :meth:`NvmlGpuSource.sample` as
``await asyncio.wait_for(asyncio.to_thread(source.sample), timeout)``: NVML can block forever in
the kernel (reference §1.5: Xid 45, UVM lock bugs), and a thread stuck in a C call cannot be
cancelled. This class adds two guards of its own for that case:

- a sample whose NVML calls ran past ``deadline_seconds`` is discarded (``GpuSourceError``) even
  if it eventually completes, so late data never reaches ``decide()``;
- while one sample is still in flight (a hung call), the next ``sample()`` fails fast with
  ``GpuSourceError`` instead of piling up threads; :attr:`NvmlGpuSource.in_flight_seconds` lets a
  watchdog see how long it has been stuck.
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pynvml

from gpuguard.core.model import DeviceSkip, GpuDevice, GpuProcess, GpuSample, GpuUuid
from gpuguard.errors import GpuSourceError, GpuSourceUnavailable

_T = TypeVar("_T")

# NVML's "not a MIG process" instance id (nvml.h: 0xFFFFFFFF when MIG is off); pynvml passes it
# through unconverted (reference §1.1).
_NO_INSTANCE = 0xFFFFFFFF

# Errors from nvmlInit that mean "NVML cannot be used here", with a hint for the operator.
_INIT_HINTS: dict[int, str] = {
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: (
        "libnvidia-ml.so.1 not found: run with the NVIDIA container runtime, or mount the driver "
        "and set the NVML library path"
    ),
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: "the NVIDIA kernel driver is not loaded (yet)",
    pynvml.NVML_ERROR_NO_PERMISSION: "no permission to open /dev/nvidiactl",
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: (
        "libnvidia-ml does not match the loaded kernel module (driver upgraded under us)"
    ),
}

# Errors on a global call (count, handles) after which NVML must be shut down and re-initialised.
_REINIT_CODES = frozenset(
    {
        pynvml.NVML_ERROR_UNINITIALIZED,
        pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
    }
)


def nvml_error_code(exc: BaseException) -> str:
    """A stable snake_case name for an NVML error (``gpu_is_lost``), for reasons and metrics."""
    value = getattr(exc, "value", None)
    if isinstance(exc, pynvml.NVMLLibraryMismatchError):
        return "library_mismatch"
    if not isinstance(value, int):
        return "unknown"
    for name in dir(pynvml):
        if name.startswith("NVML_ERROR_") and getattr(pynvml, name) == value:
            return name.removeprefix("NVML_ERROR_").lower()
    return f"error_{value}"


@dataclass(frozen=True, slots=True, kw_only=True)
class SampleIssue:
    """A value NVML returned that gpuguard refused to trust (reliability matrix N7)."""

    uuid: GpuUuid
    gpu_instance_id: int | None
    pid: int | None
    reason: str
    """Stable code: ``memory_above_total``, ``memory_sum_above_total``, ``invalid_pid``,
    ``list_grew`` (the process list changed between NVML's count and fetch; retried once)."""
    detail: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CallTimings:
    """How long the last completed sample's NVML calls took (for a watchdog metric)."""

    sample_seconds: float
    calls: int
    slowest_call: str
    slowest_call_seconds: float


@dataclass(slots=True, kw_only=True)
class _Gpu:
    """What is cached per physical GPU between samples (NVML handles are stable until
    nvmlShutdown, a GPU reset or a MIG reconfiguration; MIG handles are re-read every sample)."""

    handle: Any
    index: int
    uuid: GpuUuid
    name: str
    total_bytes: int
    mig_capable: bool


@dataclass(slots=True, kw_only=True)
class _Unit:
    """One enforcement unit being assembled during a sample."""

    device: GpuDevice
    handles: list[Any] = field(default_factory=list)


class _DeadlineExceeded(Exception):
    """Internal: a call finished after the sample's deadline; the sample is discarded."""


class NvmlGpuSource:
    """``GpuSource`` over NVML: full GPUs, or MIG instances for a GPU in MIG mode.

    NVML calls per sample (N GPUs, M MIG instances): ``nvmlDeviceGetCount_v2``; per GPU
    ``nvmlDeviceGetMigMode`` (MIG-capable GPUs only) and, per full GPU or per MIG instance,
    ``nvmlDeviceGetComputeRunningProcesses_v3``, ``nvmlDeviceGetGraphicsRunningProcesses_v3`` and
    ``nvmlDeviceGetMPSComputeRunningProcesses_v3`` (each a count call plus a fetch when non-empty).
    MIG instances are re-enumerated each sample (``nvmlDeviceGetMaxMigDeviceCount``,
    ``nvmlDeviceGetMigDeviceHandleByIndex``, ``nvmlDeviceGetGpuInstanceId``,
    ``nvmlDeviceGetComputeInstanceId``, ``nvmlDeviceGetUUID``, ``nvmlDeviceGetName``,
    ``nvmlDeviceGetMemoryInfo``), because MIG handles die with their instance (reference §1.2).
    Full-GPU handles, UUIDs, names and memory totals are read once and cached.

    Args:
        clock: monotonic seconds, for ``GpuSample.taken_at`` and the init retry backoff.
        library_path: an explicit ``libnvidia-ml.so.1`` (e.g. ``/host/usr/lib64/...``). It is
            loaded with ``RTLD_GLOBAL`` before ``nvmlInit`` so that pynvml's own
            ``CDLL("libnvidia-ml.so.1")`` finds the already-loaded SONAME. ``None``: the dynamic
            loader's search path (``LD_LIBRARY_PATH``, ldconfig).
        fail_on_init_error: ``True``: the first initialisation failing raises
            ``GpuSourceUnavailable`` (the process should exit with that message). ``False``: the
            source stays up as a null source that samples no devices, says why in
            ``GpuSample.skipped`` and :attr:`unavailable_reason`, and retries with backoff.
        deadline_seconds: a sample whose NVML calls are still running after this long is
            discarded (``GpuSourceError``), even if they return later. ``None`` disables it.
        mps_detector: optional ``uuid -> bool`` saying an MPS control daemon serves that GPU
            (e.g. its pipe directory exists); a device with MPS clients is flagged regardless.
        init_retry_seconds, init_retry_max_seconds: backoff of the null source's re-init tries.
        graphics_processes, mps_processes: also read the graphics and the MPS-client process
            lists. Each costs about as much driver CPU as the compute list even when empty
            (H200, driver 580: ~1.2 ms per list per GPU with 100 processes; docs/performance.md).
            Turning one off makes graphics-only processes (EGL/OpenGL rendering) or MPS clients
            invisible, and MPS is then detected only through ``mps_detector``.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        library_path: Path | None = None,
        fail_on_init_error: bool = True,
        deadline_seconds: float | None = 5.0,
        mps_detector: Callable[[GpuUuid], bool] | None = None,
        init_retry_seconds: float = 5.0,
        init_retry_max_seconds: float = 300.0,
        graphics_processes: bool = True,
        mps_processes: bool = True,
    ) -> None:
        self._clock = clock
        self._library_path = library_path
        self._fail_on_init_error = fail_on_init_error
        self._deadline_seconds = deadline_seconds
        self._mps_detector = mps_detector
        self._init_retry_seconds = init_retry_seconds
        self._init_retry_max_seconds = init_retry_max_seconds
        self._list_kinds = tuple(
            kind
            for kind, wanted in (
                ("Compute", True),
                ("Graphics", graphics_processes),
                ("MPSCompute", mps_processes),
            )
            if wanted
        )

        self._busy = threading.Lock()
        self._initialized = False
        self._ever_initialized = False
        self._released = False
        self._unavailable_reason: str | None = None
        self._next_init_at: float | None = None
        self._init_backoff = init_retry_seconds
        self._gpus: dict[int, _Gpu] = {}
        self._gpu_count: int | None = None
        self._use_v2: set[str] = set()
        self._seq = 0
        self._driver_version: str | None = None

        self._in_flight_since: float | None = None
        self._deadline_at: float | None = None
        self._calls = 0
        self._slowest: tuple[str, float] = ("", 0.0)
        self._last_call_seconds: float | None = None
        self._last_timings: CallTimings | None = None
        self._last_issues: tuple[SampleIssue, ...] = ()
        self._discarded = 0

    # -----------------------------------------------------------------------------------------
    # Observability (read from any thread)

    @property
    def available(self) -> bool:
        """NVML is initialised and not released."""
        return self._initialized and not self._released

    @property
    def unavailable_reason(self) -> str | None:
        """Why the null source samples nothing (init failure), else ``None``."""
        return self._unavailable_reason

    @property
    def released(self) -> bool:
        """NVML was released for a MIG reconfiguration (DESIGN §2) and not re-acquired."""
        return self._released

    @property
    def driver_version(self) -> str | None:
        """NVML: nvmlSystemGetDriverVersion, read at init."""
        return self._driver_version

    @property
    def last_call_seconds(self) -> float | None:
        """Duration of the most recent NVML call that returned."""
        return self._last_call_seconds

    @property
    def last_timings(self) -> CallTimings | None:
        """Timing of the last sample that completed (kept or discarded)."""
        return self._last_timings

    @property
    def in_flight_seconds(self) -> float | None:
        """How long the sample now running has been running (``None`` when idle): a watchdog
        alarms when this exceeds the poll timeout, because the thread may be stuck in NVML."""
        since = self._in_flight_since
        return None if since is None else time.perf_counter() - since

    @property
    def last_issues(self) -> tuple[SampleIssue, ...]:
        """Values the last kept sample refused to trust (reported as unknown instead)."""
        return self._last_issues

    @property
    def discarded_samples(self) -> int:
        """Samples thrown away because their NVML calls ran past the deadline."""
        return self._discarded

    # -----------------------------------------------------------------------------------------
    # Lifecycle

    def acquire(self) -> None:
        """Initialise NVML (``nvmlInit``) if not already; also undoes :meth:`release`.

        Raises ``GpuSourceUnavailable`` if initialisation fails and ``fail_on_init_error`` is set
        and NVML was never initialised before; ``GpuSourceError`` for a later failure (e.g. the
        driver container restarting) when ``fail_on_init_error`` is set. With
        ``fail_on_init_error=False`` it never raises: the source becomes a null source.
        """
        with self._hold("acquire"):
            self._released = False
            self._init(force=True)

    def release(self) -> None:
        """Shut NVML down (``nvmlShutdown``) so mig-manager can reconfigure MIG (DESIGN §2).

        Until :meth:`acquire`, :meth:`sample` raises ``GpuSourceError``. Every cached handle is
        dropped: MIG handles and even GPU handles may change across a reconfiguration.
        """
        with self._hold("release"):
            self._released = True
            self._shutdown()

    def close(self) -> None:
        """Release NVML at process exit (same as :meth:`release`)."""
        self.release()

    # -----------------------------------------------------------------------------------------
    # Sampling

    def sample(self) -> GpuSample:
        """One gather: enforcement units, their processes, and the devices that could not be read.

        Raises ``GpuSourceError`` when nothing could be read (NVML released, a call failed
        globally, the deadline passed, or a previous sample is still stuck in NVML), and
        ``GpuSourceUnavailable`` when NVML cannot be initialised and ``fail_on_init_error``.
        """
        with self._hold("sample"):
            if self._released:
                raise GpuSourceError("NVML is released for a MIG reconfiguration; not sampling")
            if not self._initialized:
                self._init(force=False)
                if not self._initialized:
                    if self._fail_on_init_error:
                        # Still inside the retry backoff of a failure just raised by _init.
                        reason = self._unavailable_reason or "NVML is not initialised"
                        if self._ever_initialized:
                            raise GpuSourceError(reason)
                        raise GpuSourceUnavailable(reason)
                    return self._null_sample()
            start = time.perf_counter()
            self._in_flight_since = start
            self._deadline_at = (
                None if self._deadline_seconds is None else start + self._deadline_seconds
            )
            self._calls = 0
            self._slowest = ("", 0.0)
            try:
                sample, issues = self._gather()
            except _DeadlineExceeded as exc:
                self._discarded += 1
                raise GpuSourceError(str(exc)) from None
            finally:
                elapsed = time.perf_counter() - start
                self._last_timings = CallTimings(
                    sample_seconds=elapsed,
                    calls=self._calls,
                    slowest_call=self._slowest[0],
                    slowest_call_seconds=self._slowest[1],
                )
                self._in_flight_since = None
                self._deadline_at = None
            self._last_issues = issues
            return sample

    # -----------------------------------------------------------------------------------------
    # Internals

    def _hold(self, what: str) -> _Held:
        return _Held(self, what)

    def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """One timed pynvml call (see :meth:`_timed`)."""
        return self._timed(fn.__name__, fn, *args)

    def _timed(self, name: str, fn: Callable[..., _T], *args: Any) -> _T:
        """One timed NVML call; raises ``_DeadlineExceeded`` if it returned after the deadline
        (the result may describe a GPU state that is long gone, so it is not used)."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            t1 = time.perf_counter()
            took = t1 - t0
            self._calls += 1
            self._last_call_seconds = took
            if took > self._slowest[1]:
                self._slowest = (name, took)
            deadline = self._deadline_at
            if deadline is not None and t1 > deadline:
                raise _DeadlineExceeded(
                    f"NVML sample ran past its {self._deadline_seconds} s deadline "
                    f"({name} returned after {took:.3f} s); sample discarded"
                )

    def _init(self, *, force: bool) -> None:
        """nvmlInit (after loading ``library_path``), honouring the null source's backoff."""
        if self._initialized:
            return
        now = self._clock()
        if not force and self._next_init_at is not None and now < self._next_init_at:
            return
        try:
            if self._library_path is not None:
                _preload(self._library_path)
            pynvml.nvmlInit()
        except (pynvml.NVMLError, pynvml.NVMLLibraryMismatchError, OSError) as exc:
            reason = _init_failure(exc, self._library_path)
            self._unavailable_reason = reason
            self._next_init_at = now + self._init_backoff
            self._init_backoff = min(self._init_backoff * 2, self._init_retry_max_seconds)
            if self._fail_on_init_error:
                if self._ever_initialized:
                    raise GpuSourceError(reason) from exc
                raise GpuSourceUnavailable(reason) from exc
            return
        self._initialized = True
        self._ever_initialized = True
        self._unavailable_reason = None
        self._next_init_at = None
        self._init_backoff = self._init_retry_seconds
        try:
            self._driver_version = str(pynvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError:
            self._driver_version = None

    def _shutdown(self) -> None:
        self._gpus.clear()
        self._gpu_count = None
        if not self._initialized:
            return
        self._initialized = False
        # NVMLError here means already uninitialised (driver reloaded): nothing left to release.
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()

    def _null_sample(self) -> GpuSample:
        self._seq += 1
        reason = self._unavailable_reason or "nvml not initialised"
        return GpuSample(
            seq=self._seq,
            taken_at=self._clock(),
            devices=(),
            processes=(),
            skipped=(DeviceSkip(uuid=None, index=None, reason=f"nvml_unavailable: {reason}"),),
        )

    def _gather(self) -> tuple[GpuSample, tuple[SampleIssue, ...]]:
        try:
            count = int(self._call(pynvml.nvmlDeviceGetCount))
        except pynvml.NVMLError as exc:
            if getattr(exc, "value", None) in _REINIT_CODES:
                # Re-initialise next cycle: the driver was reloaded or NVML lost its state.
                self._shutdown()
            raise GpuSourceError(
                f"nvmlDeviceGetCount_v2 failed: {nvml_error_code(exc)} ({exc})"
            ) from exc
        if count != self._gpu_count:
            self._gpus.clear()
            self._gpu_count = count

        devices: list[GpuDevice] = []
        processes: list[GpuProcess] = []
        skipped: list[DeviceSkip] = []
        issues: list[SampleIssue] = []
        for index in range(count):
            gpu = self._gpus.get(index)
            try:
                if gpu is None:
                    gpu = self._describe_gpu(index)
                    self._gpus[index] = gpu
                units = self._units_of(gpu, skipped)
                for unit in units:
                    procs, mps = self._processes_of(unit, issues)
                    if not mps and self._mps_detector is not None:
                        mps = self._mps_detector(gpu.uuid)
                    dev = unit.device if mps == unit.device.mps else _with_mps(unit.device, mps)
                    devices.append(dev)
                    key = dev.key
                    processes.extend(
                        GpuProcess(pid=pid, device=key, used_bytes=used)
                        for pid, used in procs.items()
                    )
            except (pynvml.NVMLError, pynvml.NVMLLibraryMismatchError) as exc:
                code = nvml_error_code(exc)
                if code in {"gpu_is_lost", "reset_required", "invalid_argument", "unknown"}:
                    # The handle may be stale after a reset: look the GPU up again next time.
                    self._gpus.pop(index, None)
                skipped.append(
                    DeviceSkip(
                        uuid=None if gpu is None else gpu.uuid,
                        index=index,
                        reason=f"{code}: {exc}",
                    )
                )
        self._seq += 1
        sample = GpuSample(
            seq=self._seq,
            taken_at=self._clock(),
            devices=tuple(devices),
            processes=tuple(processes),
            skipped=tuple(skipped),
        )
        return sample, tuple(issues)

    def _describe_gpu(self, index: int) -> _Gpu:
        """NVML: nvmlDeviceGetHandleByIndex_v2, nvmlDeviceGetUUID, nvmlDeviceGetName,
        nvmlDeviceGetMemoryInfo, nvmlDeviceGetMigMode (NOT_SUPPORTED = not MIG-capable)."""
        handle = self._call(pynvml.nvmlDeviceGetHandleByIndex, index)
        uuid = GpuUuid(str(self._call(pynvml.nvmlDeviceGetUUID, handle)))
        name = str(self._call(pynvml.nvmlDeviceGetName, handle))
        total = int(self._call(pynvml.nvmlDeviceGetMemoryInfo, handle).total)
        try:
            self._call(pynvml.nvmlDeviceGetMigMode, handle)
            mig_capable = True
        except pynvml.NVMLError_NotSupported:
            mig_capable = False
        return _Gpu(
            handle=handle,
            index=index,
            uuid=uuid,
            name=name,
            total_bytes=total,
            mig_capable=mig_capable,
        )

    def _units_of(self, gpu: _Gpu, skipped: list[DeviceSkip]) -> list[_Unit]:
        """The enforcement units of one GPU: itself, or its MIG GPU instances.

        NVML: nvmlDeviceGetMigMode, nvmlDeviceGetMaxMigDeviceCount,
        nvmlDeviceGetMigDeviceHandleByIndex (NOT_FOUND / INVALID_ARGUMENT = empty slot, as
        go-nvlib and dcgm-exporter treat them), nvmlDeviceGetGpuInstanceId,
        nvmlDeviceGetComputeInstanceId, nvmlDeviceGetUUID, nvmlDeviceGetName,
        nvmlDeviceGetMemoryInfo on the MIG handle (per-instance memory).
        """
        mig_on = False
        if gpu.mig_capable:
            current, _pending = self._call(pynvml.nvmlDeviceGetMigMode, gpu.handle)
            mig_on = int(current) == pynvml.NVML_DEVICE_MIG_ENABLE
        if not mig_on:
            dev = GpuDevice(
                index=gpu.index, uuid=gpu.uuid, name=gpu.name, total_bytes=gpu.total_bytes
            )
            return [_Unit(device=dev, handles=[gpu.handle])]

        by_gi: dict[int, _Unit] = {}
        slots = int(self._call(pynvml.nvmlDeviceGetMaxMigDeviceCount, gpu.handle))
        for slot in range(slots):
            try:
                mig = self._call(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, gpu.handle, slot)
            except (pynvml.NVMLError_NotFound, pynvml.NVMLError_InvalidArgument):
                continue
            try:
                gi = int(self._call(pynvml.nvmlDeviceGetGpuInstanceId, mig))
                ci = int(self._call(pynvml.nvmlDeviceGetComputeInstanceId, mig))
                mig_uuid = str(self._call(pynvml.nvmlDeviceGetUUID, mig))
                name = str(self._call(pynvml.nvmlDeviceGetName, mig))
                total = int(self._call(pynvml.nvmlDeviceGetMemoryInfo, mig).total)
            except pynvml.NVMLError as exc:
                if isinstance(exc, pynvml.NVMLError_GpuIsLost):
                    raise
                skipped.append(
                    DeviceSkip(
                        uuid=gpu.uuid,
                        index=gpu.index,
                        reason=f"{nvml_error_code(exc)}: MIG slot {slot}: {exc}",
                    )
                )
                continue
            unit = by_gi.get(gi)
            if unit is None:
                # Memory belongs to the GPU instance; its compute instances share it. The limit
                # unit is the GI (DeviceKey), so several CIs of one GI merge into one device.
                dev = GpuDevice(
                    index=gpu.index,
                    uuid=gpu.uuid,
                    name=name,
                    total_bytes=total,
                    gpu_instance_id=gi,
                    compute_instance_id=ci,
                    mig_uuid=mig_uuid,
                )
                unit = _Unit(device=dev)
                by_gi[gi] = unit
            elif unit.device.compute_instance_id is not None:
                unit.device = _without_ci(unit.device)
            unit.handles.append(mig)
        return [by_gi[gi] for gi in sorted(by_gi)]

    def _processes_of(
        self, unit: _Unit, issues: list[SampleIssue]
    ) -> tuple[dict[int, int | None], bool]:
        """Compute, graphics and MPS processes of one unit, deduplicated by PID; and whether
        any MPS client was listed.

        NVML: nvmlDeviceGetComputeRunningProcesses_v3, nvmlDeviceGetGraphicsRunningProcesses_v3,
        nvmlDeviceGetMPSComputeRunningProcesses_v3 (``_v2`` when the driver lacks ``_v3``).
        A PID in several lists is one process: each list reports "all of the memory used by the
        application", so the values are not added; the largest known value is kept (reference
        §1.1). ``usedGpuMemory`` N/A stays ``None``. A value above the unit's memory, or known
        values summing above it, are untrusted (``None``) and reported (reliability N7).
        """
        dev = unit.device
        total = dev.total_bytes
        merged: dict[int, int | None] = {}
        mps = False
        for handle in unit.handles:
            for kind in self._list_kinds:
                entries = self._list(kind, handle, dev, issues)
                if entries and kind == "MPSCompute":
                    mps = True
                for pid, raw in entries:
                    used: int | None = None if raw == _NOT_AVAILABLE else raw
                    if pid <= 0 or (used is not None and used > total):
                        issues.append(_entry_issue(dev, kind, pid, used))
                        if pid <= 0:
                            continue
                        used = None
                    if pid in merged:
                        best = merged[pid]
                        if used is None or (best is not None and best >= used):
                            continue
                    merged[pid] = used
        known = sum(u for u in merged.values() if u is not None)
        if known > total:
            issues.append(
                SampleIssue(
                    uuid=dev.uuid,
                    gpu_instance_id=dev.gpu_instance_id,
                    pid=None,
                    reason="memory_sum_above_total",
                    detail=f"processes sum to {known} B on a {total} B device",
                )
            )
            merged = dict.fromkeys(merged)
        return merged, mps

    def _list(
        self, kind: str, handle: Any, dev: GpuDevice, issues: list[SampleIssue]
    ) -> list[tuple[int, int]]:
        """One process list as ``(pid, raw usedGpuMemory)``; NOT_SUPPORTED → empty, missing
        ``_v3`` → ``_v2``, a list that grew between count and fetch → retried once."""
        for attempt in (1, 2):
            version = "v2" if kind in self._use_v2 else "v3"
            symbol = f"nvmlDeviceGet{kind}RunningProcesses_{version}"
            try:
                return self._timed(symbol, _read_process_list, symbol, handle)
            except pynvml.NVMLError_NotSupported:
                return []
            except pynvml.NVMLError_FunctionNotFound:
                if kind in self._use_v2:
                    raise
                self._use_v2.add(kind)
            except pynvml.NVMLError_InsufficientSize:
                if attempt == 2:
                    raise
                issues.append(
                    SampleIssue(
                        uuid=dev.uuid,
                        gpu_instance_id=dev.gpu_instance_id,
                        pid=None,
                        reason="list_grew",
                        detail=f"{symbol}: INSUFFICIENT_SIZE, retried",
                    )
                )
        symbol = f"nvmlDeviceGet{kind}RunningProcesses_v2"
        return self._timed(symbol, _read_process_list, symbol, handle)


class _Held:
    """Context manager: one NVML operation at a time; a second one fails fast (a hung call must
    not pile up threads), except lifecycle calls which wait up to the deadline."""

    __slots__ = ("_owner", "_what")

    def __init__(self, owner: NvmlGpuSource, what: str) -> None:
        self._owner = owner
        self._what = what

    def __enter__(self) -> None:
        owner = self._owner
        if self._what == "sample":
            got = owner._busy.acquire(blocking=False)
        else:
            wait = owner._deadline_seconds
            got = owner._busy.acquire(timeout=-1 if wait is None else wait)
        if not got:
            running = owner.in_flight_seconds
            detail = "" if running is None else f" for {running:.1f} s"
            raise GpuSourceError(
                f"cannot {self._what}: a previous NVML call is still running{detail}"
                " (possibly hung in the driver)"
            )

    def __exit__(self, *exc: object) -> None:
        self._owner._busy.release()


def _with_mps(dev: GpuDevice, mps: bool) -> GpuDevice:
    return GpuDevice(
        index=dev.index,
        uuid=dev.uuid,
        name=dev.name,
        total_bytes=dev.total_bytes,
        gpu_instance_id=dev.gpu_instance_id,
        compute_instance_id=dev.compute_instance_id,
        mig_uuid=dev.mig_uuid,
        mps=mps,
    )


def _without_ci(dev: GpuDevice) -> GpuDevice:
    return GpuDevice(
        index=dev.index,
        uuid=dev.uuid,
        name=dev.name,
        total_bytes=dev.total_bytes,
        gpu_instance_id=dev.gpu_instance_id,
        compute_instance_id=None,
        mig_uuid=dev.mig_uuid,
        mps=dev.mps,
    )


_preloaded: dict[Path, ctypes.CDLL] = {}
_preload_lock = threading.Lock()


def _entry_issue(dev: GpuDevice, kind: str, pid: int, used: int | None) -> SampleIssue:
    if pid <= 0:
        return SampleIssue(
            uuid=dev.uuid,
            gpu_instance_id=dev.gpu_instance_id,
            pid=None,
            reason="invalid_pid",
            detail=f"{kind} list entry with pid {pid}",
        )
    return SampleIssue(
        uuid=dev.uuid,
        gpu_instance_id=dev.gpu_instance_id,
        pid=pid,
        reason="memory_above_total",
        detail=f"{used} B reported on a {dev.total_bytes} B device",
    )


def _preload(path: Path) -> None:
    """Load ``path`` globally so pynvml's ``CDLL("libnvidia-ml.so.1")`` resolves to it: glibc's
    dlopen matches an already-loaded object by its SONAME before searching the disk. Kept
    loaded for the life of the process (pynvml caches its handle)."""
    with _preload_lock:
        if path not in _preloaded:
            _preloaded[path] = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


def _init_failure(exc: BaseException, library_path: Path | None) -> str:
    if isinstance(exc, OSError):
        return f"cannot load NVML library {library_path}: {exc}"
    code = getattr(exc, "value", None)
    hint = _INIT_HINTS.get(code) if isinstance(code, int) else None
    text = f"nvmlInit failed: {nvml_error_code(exc)} ({exc})"
    return text if hint is None else f"{text}: {hint}"


_NOT_AVAILABLE = 0xFFFFFFFFFFFFFFFF
"""NVML_VALUE_NOT_AVAILABLE in the u64 ``usedGpuMemory`` field (nvml.h: ``(-1)``)."""

# nvmlProcessInfo_t as the _v2 and _v3 calls fill it: pid u32, (pad), usedGpuMemory u64,
# gpuInstanceId u32, computeInstanceId u32 = 24 bytes (reference §1.1; the same layout as
# pynvml's c_nvmlProcessInfo_v3_t, checked at import below).
_PROCESS_INFO = struct.Struct("=I4xQII")
if ctypes.sizeof(pynvml.c_nvmlProcessInfo_v3_t) != _PROCESS_INFO.size:  # pragma: no cover
    raise ImportError(
        "nvidia-ml-py's c_nvmlProcessInfo_v3_t is not 24 bytes (nvidia-ml-py 12.535.77?): "
        "process PIDs and memory would be garbled; install another nvidia-ml-py"
    )


def _read_process_list(symbol: str, handle: Any) -> list[tuple[int, int]]:
    """Calls an ``nvmlDevice*RunningProcesses_v2/_v3`` symbol the way pynvml does (a count call,
    then a fetch into ``2n+5`` entries) but decodes the array in one ``struct`` pass instead of
    pynvml's per-entry friendly objects, which cost several µs each (8 GPUs × 100 processes:
    ~7 ms of CPU per poll; see docs/performance.md). Errors are pynvml's ``NVMLError``
    subclasses, as from pynvml's own wrapper.
    """
    lib = pynvml.nvmlLib
    if lib is None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
    try:
        fn = getattr(lib, symbol)
    except AttributeError:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND) from None
    count = ctypes.c_uint(0)
    ret = fn(handle, ctypes.byref(count), None)
    if ret == pynvml.NVML_SUCCESS:
        return []
    if ret != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
        raise pynvml.NVMLError(ret)
    capacity = count.value * 2 + 5
    count.value = capacity
    buf = ctypes.create_string_buffer(capacity * _PROCESS_INFO.size)
    ret = fn(handle, ctypes.byref(count), buf)
    if ret != pynvml.NVML_SUCCESS:
        raise pynvml.NVMLError(ret)
    n = min(count.value, capacity)
    return [
        (pid, used)
        for pid, used, _gi, _ci in _PROCESS_INFO.iter_unpack(buf.raw[: n * _PROCESS_INFO.size])
    ]
