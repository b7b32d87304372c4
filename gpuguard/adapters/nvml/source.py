"""NVML adapter: GPUs, MIG instances and their compute processes, through nvidia-ml-py (pynvml).

Owns :class:`NvmlGpuSource` (``ports.ReleasableGpuSource``): one sample is the device count,
then per GPU its enforcement units (``devices``, ``mig``) and their processes (``processes``),
every call through the guard (``calls``: one operation at a time, the sample deadline). Translates
NVML's failures into ``core.model`` values and ``gpuguard.errors``: nothing above this package
sees ``NVMLError`` or a ctypes handle. Must not read ``/proc``, decide anything about pods, log,
or signal anything; doubtful values are reported as unknown (``None``) with a
:class:`SampleIssue`, never guessed.

Blocking and synchronous by design: the runtime calls :meth:`NvmlGpuSource.sample` as
``await asyncio.wait_for(asyncio.to_thread(source.sample), timeout)``.

A lost handle (docs/reliability.md N13): when every NVML call on every GPU fails with the same
broken-handle code (``lib.BROKEN_HANDLE_CODES``: NVML_ERROR_UNKNOWN after ``systemctl
daemon-reload`` with the NVIDIA container toolkit) :data:`HANDLE_LOST_AFTER` operations in a row,
NVML is shut down and initialised again with backoff (``session``), and until a device answers
again every sample and fast read raises ``GpuSourceLost``: nothing read through the failing
handle reaches a sample. One GPU failing alone is skipped alone (N2).

Self-health (docs/design.md, Metrics): a call whose data is given up (a device skipped, a MIG slot
skipped, the sample lost, NVML not started) or that returned past the deadline counts
``HealthRecorder.count_nvml_error(<NVML function>)``. Answers are not failures and are not
counted: NOT_SUPPORTED for a GPU without MIG or without such a process list, an empty MIG slot,
a missing ``_v3`` function (``_v2`` is used) and a process list that grew once (a
:class:`SampleIssue`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from gpuguard.adapters.nvml import lib
from gpuguard.adapters.nvml.calls import CallGuard, CallTimings, DeadlineExceeded
from gpuguard.adapters.nvml.devices import GpuCache, PhysicalGpu, Unit
from gpuguard.adapters.nvml.gate import NativeGate, SourceGate
from gpuguard.adapters.nvml.gate import native_gate as make_native_gate
from gpuguard.adapters.nvml.lib import Handle, NvmlCallError
from gpuguard.adapters.nvml.mig import units_of
from gpuguard.adapters.nvml.processes import ProcessReader
from gpuguard.adapters.nvml.session import NvmlSession
from gpuguard.core.model import (
    DeviceKey,
    DeviceMemory,
    DeviceSkip,
    GpuDevice,
    GpuProcess,
    GpuSample,
    GpuUuid,
    Listing,
    SampleIssue,
)
from gpuguard.errors import GpuSourceError, GpuSourceLost, GpuSourceUnavailable
from gpuguard.ports import HealthRecorder, QuietGate, ReleasableGpuSource

SLOW_GPU_RETRY_SECONDS = 30.0
"""A GPU whose NVML calls ran past the deadline twice in a row (no good read of it between) is
left out of samples and fast reads for this long, reported as skipped (its violations are
refused ``device_unavailable``), then tried again: one hanging GPU must not blind enforcement
on the others (docs/reliability.md N9). Each sample or fast read that ran late is still
discarded; one late call alone costs only that sample."""

HANDLE_LOST_AFTER = 3
"""Operations (fast reads, or samples that listed every GPU) in a row in which every NVML call
on the GPUs failed with the same broken-handle code, no device answering between, after which
NVML's handle is judged lost (docs/reliability.md N13). Three, not one: a single failing call on
a one-GPU node is a skipped sample, not a reason to re-initialise; at the fast path's 20 reads a
second three take ~0.1 s, with the fast path off three polls. After a re-initialisation, the
first such operation is enough."""

_HANDLE_LOST_HINT = (
    "on a node with the NVIDIA container toolkit this follows `systemctl daemon-reload`, which "
    "resets the container's GPU device access (NVIDIA/nvidia-container-toolkit#48, #1227): "
    "if re-initialising does not bring NVML back, restart this pod, and prevent it with "
    "`nvidia-ctk system create-dev-char-symlinks --create-all` on the node"
)


class _Uncounted:
    """``HealthRecorder`` that counts nothing (no recorder injected)."""

    def count_event_dropped(self, reason: str) -> None:
        return None

    def count_watch_restart(self, resource: str, reason: str) -> None:
        return None

    def count_nvml_error(self, call: str) -> None:
        return None


@dataclass(slots=True)
class _Gather:
    """What one sample collects, GPU by GPU."""

    devices: list[GpuDevice] = field(default_factory=list)
    processes: list[GpuProcess] = field(default_factory=list)
    skipped: list[DeviceSkip] = field(default_factory=list)
    issues: list[SampleIssue] = field(default_factory=list)
    memory_handles: list[tuple[DeviceKey, Handle]] = field(default_factory=list)
    """Per unit, the handle its memory is read through (the GPU, or a MIG device)."""
    failed: NvmlCallError | None = None
    """The error that skipped the whole GPU (``None``: it answered, or was not tried)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _GpuListing:
    """One GPU's part of the last sample that listed it, carried over by samples that do not."""

    gathered: _Gather
    listing: Listing


class NvmlGpuSource:
    """``ReleasableGpuSource`` over NVML: full GPUs, or MIG instances for a GPU in MIG mode.

    NVML calls per sample (N GPUs, M MIG instances): ``nvmlDeviceGetCount_v2``; per GPU
    ``nvmlDeviceGetMigMode`` (MIG-capable GPUs only) and, per full GPU or per MIG instance, its
    process lists (``processes``). MIG instances are re-enumerated each sample (``mig``); full-GPU
    handles, UUIDs, names and memory totals are read once and cached (``devices``).

    Change-driven sampling (``ports.FastGpuSource``): :meth:`read_memory` is
    ``nvmlDeviceGetCount_v2`` and one ``nvmlDeviceGetMemoryInfo`` per unit of the last listing;
    :meth:`sample_devices` lists only some GPUs again and carries the others' last listing over,
    each device with the :class:`Listing` (seq, time) its processes come from.

    NVML that cannot be initialised raises ``GpuSourceUnavailable`` (never initialised) or
    ``GpuSourceError`` (it was, e.g. the driver container is restarting), retried no faster
    than the backoff. To keep running without NVML, wrap the source in ``NullGpuSource``.

    Args:
        clock: monotonic seconds, for ``GpuSample.taken_at`` and the init retry backoff.
        library_path: an explicit ``libnvidia-ml.so.1`` (e.g. ``/host/usr/lib64/...``), loaded
            with ``RTLD_GLOBAL`` before ``nvmlInit`` so that pynvml's own
            ``CDLL("libnvidia-ml.so.1")`` finds the already-loaded SONAME. ``None``: the dynamic
            loader's search path (``LD_LIBRARY_PATH``, ldconfig).
        deadline_seconds: a sample whose NVML calls are still running after this long is
            discarded (``GpuSourceError``), even if they return later. ``None`` disables it.
        mps_detector: optional ``uuid -> bool`` saying an MPS control daemon serves that GPU
            (e.g. its pipe directory exists); a device with MPS clients is flagged regardless.
        init_retry_seconds, init_retry_max_seconds: backoff of the re-init tries.
        graphics_processes, mps_processes: also read the graphics and the MPS-client process
            lists (see ``ProcessReader``); without the MPS list, MPS is detected only through
            ``mps_detector``.
        health: counts failed and timed-out NVML calls; ``None`` counts nothing.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        library_path: Path | None = None,
        deadline_seconds: float | None = 5.0,
        mps_detector: Callable[[GpuUuid], bool] | None = None,
        init_retry_seconds: float = 5.0,
        init_retry_max_seconds: float = 300.0,
        graphics_processes: bool = True,
        mps_processes: bool = True,
        health: HealthRecorder | None = None,
        native_gate: bool = True,
    ) -> None:
        self._clock = clock
        self._mps_detector = mps_detector
        self._calls = CallGuard(
            deadline_seconds=deadline_seconds,
            health=_Uncounted() if health is None else health,
        )
        self._session = NvmlSession(
            calls=self._calls,
            clock=clock,
            library_path=library_path,
            retry_seconds=init_retry_seconds,
            retry_max_seconds=init_retry_max_seconds,
        )
        self._gpus = GpuCache(self._calls)
        self._processes = ProcessReader(self._calls, graphics=graphics_processes, mps=mps_processes)
        self._released = False
        self._seq = 0
        self._listed: dict[int, _GpuListing] = {}
        """Per GPU index, its last listing (dropped with the GPU cache)."""
        self._listed_count: int | None = None
        self._memory_keys: list[DeviceKey] = []
        self._memory_handles: list[Handle] = []
        """The units the fast read reads, and through which handle (from the last sample)."""
        self._memory_gpus: list[int] = []
        """The GPU index of each unit the fast read reads."""
        self._deadline_seconds = deadline_seconds
        self._late: dict[int, int] = {}
        """Per GPU index, its NVML calls that ran past the deadline since its last good read."""
        self._benched: dict[int, tuple[float, GpuUuid | None]] = {}
        """GPUs left out because they keep running late: index -> (until when, monotonic; its
        UUID if known)."""
        self._failing: tuple[str, int] = ("", 0)
        self._gate: NativeGate | None = make_native_gate(enabled=native_gate)
        """The native quiet gate (``None``: pure Python), see :meth:`quiet_gate`."""
        """Operations in a row in which every device call failed with this broken-handle code."""
        self._lost: str | None = None
        """Why NVML's handle is lost, until a device answers again (``GpuSourceLost``'s text)."""

    # -----------------------------------------------------------------------------------------
    # Observability (read from any thread)

    @property
    def released(self) -> bool:
        """NVML was released for a MIG reconfiguration (docs/design.md, MIG reconfiguration) and not
        re-acquired."""
        return self._released

    @property
    def driver_version(self) -> str | None:
        """NVML: nvmlSystemGetDriverVersion, read at init."""
        return self._session.driver_version

    @property
    def last_timings(self) -> CallTimings | None:
        """Timing of the last sample that completed (kept or discarded)."""
        return self._calls.last_timings

    @property
    def in_flight_seconds(self) -> float | None:
        """How long the sample now running has been running (``None`` when idle): longer than
        the poll timeout means the thread may be stuck in NVML."""
        return self._calls.in_flight_seconds

    # -----------------------------------------------------------------------------------------
    # Lifecycle

    def acquire(self) -> None:
        """Initialise NVML (``nvmlInit``) if not already; also undoes :meth:`release`.

        Raises ``GpuSourceUnavailable`` if initialisation fails and NVML was never initialised,
        ``GpuSourceError`` for a later failure (e.g. the driver container restarting).
        """
        with self._calls.hold("acquire", wait=True):
            self._released = False
            if self._gate is not None:
                self._gate.request_release(releasing=False)
            self._start(force=True)

    def release(self) -> None:
        """Shut NVML down (``nvmlShutdown``) so mig-manager can reconfigure MIG (docs/design.md, MIG
        reconfiguration).

        Until :meth:`acquire`, :meth:`sample` raises ``GpuSourceError``. Every cached handle is
        dropped: MIG handles and even GPU handles may change across a reconfiguration.
        """
        if self._gate is not None:  # a wait in the gate holds the guard: it returns first
            self._gate.request_release(releasing=True)
        with self._calls.hold("release", wait=True):
            self._released = True
            self._stop()

    def close(self) -> None:
        """Release NVML at process exit (same as :meth:`release`). While a call is still stuck
        in NVML, nvmlShutdown is skipped: it would wait on that call, and the process is
        exiting anyway."""
        with contextlib.suppress(GpuSourceError):
            self.release()

    # -----------------------------------------------------------------------------------------
    # Sampling

    def sample(self) -> GpuSample:
        """One gather: enforcement units, their processes, and the devices that could not be read.

        Raises ``GpuSourceError`` when nothing could be read (NVML released, a call failed
        globally or on every GPU, the deadline passed, or a previous sample is still stuck in
        NVML), ``GpuSourceLost`` (a ``GpuSourceError``) while NVML's handle is lost, and
        ``GpuSourceUnavailable`` when NVML was never initialised and cannot be.
        """
        return self._sample(None)

    def sample_devices(self, devices: Collection[DeviceKey]) -> GpuSample:
        """A sample that lists again only the GPUs holding ``devices`` (every unit of such a
        GPU: MIG instances are enumerated per GPU) and carries the other GPUs' last listing
        over; everything is listed when a device is unknown or the GPU count changed. Raises
        like :meth:`sample`."""
        index_of = {
            d.key: index for index, got in self._listed.items() for d in got.gathered.devices
        }
        wanted = {index_of.get(key) for key in devices}
        return self._sample(None if None in wanted else {i for i in wanted if i is not None})

    def read_memory(self) -> Mapping[DeviceKey, DeviceMemory]:
        """The fast read: ``nvmlDeviceGetMemoryInfo`` of every unit the last sample listed
        (the GPU, or a MIG device of the instance), ~8 µs each on an H200 whatever runs there.
        A unit whose read fails is absent (its next listing reports the error); nothing is read
        when the GPU count changed (``nvmlDeviceGetCount_v2``, ~1 µs), so everything is listed.
        Raises ``GpuSourceError`` like :meth:`sample`."""
        if self._released:
            raise GpuSourceError("NVML is released for a MIG reconfiguration; not sampling")
        if not self._session.active:
            with self._calls.hold("start NVML", wait=False):
                self._start(force=False)
        return self._calls.quick("read memory", "nvmlDeviceGetMemoryInfo", self._read_memory)

    def quiet_gate(self) -> QuietGate | None:
        """The fast path's native quiet gate over this source (``ports.QuietGate``), or
        ``None`` where it is not built or ``native_gate`` is false (adapters/nvml/gate)."""
        return None if self._gate is None else SourceGate(self.wait_quiet, self._gate)

    def wait_quiet(
        self,
        gate: NativeGate,
        *,
        baseline: Mapping[DeviceKey, int],
        step_bytes: int,
        interval_seconds: float,
        first: float,
        until: float,
    ) -> str | None:
        """:meth:`QuietGate.wait` over the units the fast read reads, under the call guard (the
        whole wait: :meth:`release` wakes it first). ``None`` when it cannot wait: the guard
        is taken, NVML is released, lost or not started, or ``baseline`` is not exactly those
        units."""
        try:
            with self._calls.hold("wait for memory to move", wait=False):
                keys = self._memory_keys
                if (
                    self._released
                    or self._lost is not None
                    or not self._session.active
                    or not keys
                    or self._listed_count is None
                    or len(keys) != len(baseline)
                    or set(keys) != baseline.keys()
                ):
                    return None
                count_fn, memory_fn, handles = lib.fast_memory_addresses(self._memory_handles)
                return gate.wait(
                    functions=(count_fn, memory_fn),
                    handles=handles,
                    count=self._listed_count,
                    baseline=[baseline[key] for key in keys],
                    step_bytes=step_bytes,
                    interval_seconds=interval_seconds,
                    first=first,
                    until=until,
                )
        except (GpuSourceError, NvmlCallError):
            return None

    def _read_memory(self) -> dict[DeviceKey, DeviceMemory]:
        # Local copies: a late GPU is left out below, which rebuilds the instance's lists.
        keys, gpus, seconds = self._memory_keys, self._memory_gpus, list[float]()
        try:
            count, reads = lib.fast_memory(self._memory_handles, seconds=seconds)
        except NvmlCallError as exc:
            self._count_failed(exc)
        failed = [got for got in reads if isinstance(got, NvmlCallError)]
        for error in failed:
            self._calls.count_failure(error)
        self._judge(failed, tried=len(reads))
        limit = self._deadline_seconds
        late = {g for g, t in zip(gpus, seconds, strict=True) if limit and t > limit}
        for index in set(gpus) - late:
            self._late.pop(index, None)
        for index in sorted(late):
            self._ran_late(index)  # the guard discards this whole read
        read: dict[DeviceKey, DeviceMemory] = {}
        if count != self._listed_count:
            return read
        for key, got in zip(keys, reads, strict=True):
            if isinstance(got, NvmlCallError):
                continue
            total, used, free = got
            read[key] = DeviceMemory(total_bytes=total, used_bytes=used, free_bytes=free)
        return read

    def _sample(self, only: set[int] | None) -> GpuSample:
        with self._calls.hold("sample", wait=False):
            if self._released:
                raise GpuSourceError("NVML is released for a MIG reconfiguration; not sampling")
            self._start(force=False)
            try:
                with self._calls.sample_deadline():
                    count, fresh = self._gather(only)
            except DeadlineExceeded as exc:
                raise GpuSourceError(str(exc)) from None
            self._seq += 1
            listing = Listing(seq=self._seq, taken_at=self._clock())
            self._listed = {i: got for i, got in self._listed.items() if i < count}
            for index, gathered in fresh.items():
                self._listed[index] = _GpuListing(gathered=gathered, listing=listing)
            self._listed_count = count
            self._memory_units()
            return self._assemble(listing)

    def _memory_units(self) -> None:
        """What the fast read reads: every unit of the GPUs listed."""
        triples = [
            (k, h, i) for i, got in self._listed.items() for k, h in got.gathered.memory_handles
        ]
        self._memory_keys = [k for k, _, _ in triples]
        self._memory_handles = [h for _, h, _ in triples]
        self._memory_gpus = [i for _, _, i in triples]

    def _ran_late(self, index: int) -> None:
        """An NVML call on GPU ``index`` ran past the deadline; the second time since its last
        good read, the GPU is left out for ``SLOW_GPU_RETRY_SECONDS`` (the count is kept, so a
        GPU still late when it is tried again is left out again at once)."""
        self._late[index] = self._late.get(index, 0) + 1
        if self._late[index] < 2:
            return
        gpu = self._gpus.cached(index)
        self._benched[index] = (
            self._clock() + SLOW_GPU_RETRY_SECONDS,
            None if gpu is None else gpu.uuid,
        )
        self._listed.pop(index, None)
        self._memory_units()

    def _assemble(self, listing: Listing) -> GpuSample:
        """The sample: every GPU's last listing, in index order."""
        whole = _Gather()
        listings: dict[DeviceKey, Listing] = {}
        for _index, got in sorted(self._listed.items()):
            part = got.gathered
            whole.devices.extend(part.devices)
            whole.processes.extend(part.processes)
            whole.skipped.extend(part.skipped)
            whole.issues.extend(part.issues)
            listings.update((d.key, got.listing) for d in part.devices)
        return GpuSample(
            seq=listing.seq,
            taken_at=listing.taken_at,
            devices=tuple(whole.devices),
            processes=tuple(whole.processes),
            skipped=tuple(whole.skipped),
            issues=tuple(whole.issues),
            listings=listings,
        )

    # -----------------------------------------------------------------------------------------
    # Internals

    def _start(self, *, force: bool) -> None:
        """nvmlInit unless initialised. The ``NvmlInitError`` is chained as the raised error's
        ``__cause__``: ``NullGpuSource`` tells an init failure from other errors by it. While
        the handle is lost, ``GpuSourceLost`` (also inside the re-init backoff)."""
        try:
            self._session.start(force=force)
        except NvmlCallError as exc:  # NvmlInitError, or ReinitPending while the handle is lost
            if self._lost is not None:
                raise GpuSourceLost(self._lost) from exc
            if self._session.ever_started:
                raise GpuSourceError(str(exc)) from exc
            raise GpuSourceUnavailable(str(exc)) from exc

    def _forget(self) -> None:
        """Drop every handle and listing (NVML is being shut down)."""
        self._gpus.clear()
        self._listed.clear()
        self._listed_count = None
        self._memory_keys, self._memory_handles, self._memory_gpus = [], [], []

    def _stop(self) -> None:
        self._forget()
        self._session.stop()

    def _count_failed(self, exc: NvmlCallError) -> NoReturn:
        """``nvmlDeviceGetCount_v2`` failed: the whole sample or read is lost
        (``GpuSourceError``; ``GpuSourceLost`` when that makes the handle lost)."""
        self._calls.count_failure(exc)
        if exc.code in lib.REINIT_CODES:
            # Re-initialise next cycle: the driver was reloaded or NVML lost its state.
            self._stop()
        else:
            self._judge([exc], tried=1)
        raise GpuSourceError(f"{exc.call} failed: {exc.code} ({exc})") from exc

    def _judge(self, failed: list[NvmlCallError], *, tried: int) -> None:
        """What one operation's device calls say about NVML's handle: ``tried`` GPUs (or
        units) read, ``failed`` the errors of those that could not be. Every one failed with
        the same broken-handle code: one more operation towards :data:`HANDLE_LOST_AFTER`
        (raises ``GpuSourceLost`` when it is reached). Anything else is an answer (a read, or
        a GPU's own error such as GPU_IS_LOST): the handle works, and a loss is over. Nothing
        tried says nothing."""
        if tried == 0:
            return
        code = failed[0].code if failed else ""
        if (
            len(failed) < tried
            or code not in lib.BROKEN_HANDLE_CODES
            or any(exc.code != code for exc in failed)
        ):
            self._failing = ("", 0)
            if self._lost is not None:
                self._lost = None
                self._session.answered()
            return
        streak = self._failing[1] + 1 if self._failing[0] == code else 1
        self._failing = (code, streak)
        if streak >= HANDLE_LOST_AFTER or self._lost is not None:
            self._lose(failed[0], streak)

    def _lose(self, exc: NvmlCallError, streak: int) -> NoReturn:
        """NVML's handle is lost: shut NVML down (the next operation initialises it again, then
        with backoff while that does not help) and raise ``GpuSourceLost``."""
        if self._lost is None:
            self._lost = (
                f"NVML handle lost: every NVML call on the GPUs failed with {exc.code} {streak}"
                f" times in a row ({exc.call}: {exc}); NVML shut down and re-initialised with"
                f" backoff; {_HANDLE_LOST_HINT}"
            )
        self._failing = ("", 0)
        self._forget()
        self._session.lose()
        raise GpuSourceLost(self._lost) from exc

    def _count_now(self) -> int:
        """``nvmlDeviceGetCount_v2``; a failure loses the whole sample (``GpuSourceError``)."""
        try:
            return self._gpus.count()
        except NvmlCallError as exc:
            self._count_failed(exc)

    def _gather(self, only: set[int] | None) -> tuple[int, dict[int, _Gather]]:
        """The GPU count and, per GPU listed now, what it holds: the GPUs in ``only`` (every
        GPU when ``None``, when the count changed, or for a GPU never listed)."""
        count = self._count_now()
        if count != self._listed_count:
            only = None
        now = self._clock()
        self._benched = {i: b for i, b in self._benched.items() if b[0] > now}
        fresh: dict[int, _Gather] = {}
        tried: list[_Gather] = []
        for index in range(count):
            benched = self._benched.get(index)
            if benched is not None:
                fresh[index] = _Gather()
                reason = (
                    f"NVML calls on this GPU ran past the {self._deadline_seconds} s deadline"
                    f" twice in a row; left out, tried again every {SLOW_GPU_RETRY_SECONDS:g} s"
                )
                fresh[index].skipped.append(DeviceSkip(uuid=benched[1], index=index, reason=reason))
            elif only is None or index in only or index not in self._listed:
                fresh[index] = _Gather()
                tried.append(fresh[index])
                try:
                    self._gather_gpu(index, fresh[index])
                except DeadlineExceeded:
                    self._ran_late(index)  # this sample is lost
                    raise
                self._late.pop(index, None)
        failed = [g.failed for g in tried if g.failed is not None]
        every_gpu = len(fresh) == count  # each GPU tried now, or left out as late (N9)
        if len(failed) < len(tried) or every_gpu:
            # A sample that lists some GPUs only, all of them failing, says nothing about the
            # others: one GPU failing alone is skipped alone (N2).
            self._judge(failed, tried=len(tried))
        if every_gpu and tried and len(failed) == len(tried):
            exc = failed[0]
            if {f.code for f in failed} <= lib.BROKEN_HANDLE_CODES:
                # Nothing was read, and the handle may be going: no sample (an empty one
                # would read as "no GPU here, nothing to enforce").
                raise GpuSourceError(f"every GPU failed: {exc.code} ({exc.call}: {exc})")
        return count, fresh

    def _gather_gpu(self, index: int, gathered: _Gather) -> None:
        """One GPU's units and processes; a failed call skips the GPU (the others are still
        sampled)."""
        gpu: PhysicalGpu | None = None
        try:
            gpu = self._gpus.get(index)
            for unit in units_of(self._calls, gpu, gathered.skipped):
                self._gather_unit(gpu, unit, gathered)
        except NvmlCallError as exc:
            self._calls.count_failure(exc)
            gathered.failed = exc
            if exc.code in lib.STALE_HANDLE_CODES:
                self._gpus.forget(index)
            gathered.skipped.append(
                DeviceSkip(
                    uuid=None if gpu is None else gpu.uuid, index=index, reason=f"{exc.code}: {exc}"
                )
            )

    def _gather_unit(self, gpu: PhysicalGpu, unit: Unit, gathered: _Gather) -> None:
        procs, clients = self._processes.read(unit, gathered.issues)
        mps = bool(clients) or (self._mps_detector is not None and self._mps_detector(gpu.uuid))
        device = unit.device if mps == unit.device.mps else replace(unit.device, mps=mps)
        gathered.devices.append(device)
        key = device.key
        gathered.memory_handles.append((key, unit.handles[0]))
        gathered.processes.extend(
            GpuProcess(pid=pid, device=key, used_bytes=used, mps_client=pid in clients)
            for pid, used in procs.items()
        )


if TYPE_CHECKING:  # the ports, checked here (as the device plugin's `var _ Manager = (*null)(nil)`)
    _: type[ReleasableGpuSource] = NvmlGpuSource
    _health: type[HealthRecorder] = _Uncounted
