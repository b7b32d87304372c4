"""The null NVML source: keeps gpuguard running, and saying why, while NVML cannot start.

GPU feature discovery's fallback pattern (``fallbackToNullOnInitError`` around its resource
manager): used instead of the source itself when ``nvml.fail_on_init_error`` is false. While the
wrapped :class:`NvmlGpuSource` cannot be initialised, a sample lists no devices and one
``DeviceSkip`` with ``nvml_unavailable: <reason>``; the wrapped source retries nvmlInit at each
sample (no faster than its backoff) and takes over once it succeeds. Every other error passes
through unchanged, ``GpuSourceLost`` included even when its re-init fails: a lost handle
pauses enforcement (reliability N13), where a null sample would read as "no GPU, nothing to
enforce". Must not call NVML itself.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from gpuguard.adapters.nvml.lib import NvmlInitError
from gpuguard.adapters.nvml.source import NvmlGpuSource
from gpuguard.core.model import DeviceKey, DeviceMemory, DeviceSkip, GpuSample
from gpuguard.errors import GpuguardError, GpuSourceError, GpuSourceLost, GpuSourceUnavailable

if TYPE_CHECKING:
    from gpuguard.ports import QuietGate, ReleasableGpuSource


class NullGpuSource:
    """``ReleasableGpuSource`` that falls back to sampling nothing while NVML cannot start.

    ``clock``: monotonic seconds for ``GpuSample.taken_at`` (the wrapped source's clock).
    Samples are numbered here, so ``seq`` increases across null and real samples alike.
    """

    def __init__(self, source: NvmlGpuSource, *, clock: Callable[[], float]) -> None:
        self._source = source
        self._clock = clock
        self._seq = 0
        self._reason: str | None = None

    @property
    def reason(self) -> str | None:
        """Why the last sample (or acquire) found NVML unavailable; ``None`` once it started."""
        return self._reason

    @property
    def released(self) -> bool:
        return self._source.released

    def acquire(self) -> None:
        """nvmlInit; a failure leaves this a null source instead of raising."""
        try:
            self._source.acquire()
        except (GpuSourceError, GpuSourceUnavailable) as exc:
            reason = _init_failure(exc)
            if reason is None:
                raise
            self._reason = reason
            return
        self._reason = None

    def release(self) -> None:
        self._source.release()

    def close(self) -> None:
        self._source.close()

    def sample(self) -> GpuSample:
        """The wrapped source's sample, or, while NVML cannot be initialised, a sample with no
        devices that says why."""
        return self._sample(self._source.sample)

    def sample_devices(self, devices: Collection[DeviceKey]) -> GpuSample:
        """The wrapped source's partial sample, or the null sample (as :meth:`sample`)."""
        return self._sample(lambda: self._source.sample_devices(devices))

    def quiet_gate(self) -> QuietGate | None:
        """The wrapped source's native gate (it cannot wait while NVML has not started)."""
        return self._source.quiet_gate()

    def read_memory(self) -> Mapping[DeviceKey, DeviceMemory]:
        """The wrapped source's fast read; nothing while NVML cannot be initialised."""
        try:
            return self._source.read_memory()
        except (GpuSourceError, GpuSourceUnavailable) as exc:
            if _init_failure(exc) is None:
                raise
            return {}

    def _sample(self, take: Callable[[], GpuSample]) -> GpuSample:
        try:
            sample = take()
        except (GpuSourceError, GpuSourceUnavailable) as exc:
            reason = _init_failure(exc)
            if reason is None:
                raise
            self._reason = reason
            skip = DeviceSkip(uuid=None, index=None, reason=f"nvml_unavailable: {reason}")
            sample = GpuSample(
                seq=0, taken_at=self._clock(), devices=(), processes=(), skipped=(skip,)
            )
        else:
            self._reason = None
        self._seq += 1
        return replace(sample, seq=self._seq)


def _init_failure(exc: GpuguardError) -> str | None:
    """The reason NVML could not be initialised, when that is what ``exc`` is: the source
    chains the ``NvmlInitError`` as its cause (``errors.py``'s convention). Not while NVML's
    handle is lost: re-initialising it failing is part of that loss."""
    if isinstance(exc, GpuSourceLost):
        return None
    cause = exc.__cause__
    return str(cause) if isinstance(cause, NvmlInitError) else None


if TYPE_CHECKING:  # the port, checked here (as the device plugin's `var _ Manager = (*null)(nil)`)
    _: type[ReleasableGpuSource] = NullGpuSource
