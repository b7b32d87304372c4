"""The NVML session: nvmlInit and nvmlShutdown, with a backoff between failed inits.

Owns whether NVML is initialised, whether it ever was, the retry backoff, the driver version
read at init, and whether NVML's handle is lost (:meth:`NvmlSession.lose`). A failed init raises
``NvmlInitError`` (counted); inside the backoff the last failure is raised again without calling
nvmlInit (:class:`ReinitPending` while a lost handle waits). Must not decide what a failure means
for the process (``source`` makes it ``GpuSourceUnavailable``, ``GpuSourceError`` or
``GpuSourceLost``; ``null`` samples nothing instead) or when a handle is lost (``source``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gpuguard.adapters.nvml import lib
from gpuguard.adapters.nvml.calls import CallGuard
from gpuguard.adapters.nvml.lib import NvmlCallError, NvmlInitError


class ReinitPending(NvmlCallError):
    """nvmlInit is not tried yet: the handle was lost and the backoff since the last try runs."""


class NvmlSession:
    """``clock``: monotonic seconds, for the backoff. ``library_path``: an explicit
    ``libnvidia-ml.so.1``, loaded with ``RTLD_GLOBAL`` before ``nvmlInit`` (``None``: the
    dynamic loader's search path). ``retry_seconds`` doubles after each failure up to
    ``retry_max_seconds``."""

    def __init__(
        self,
        *,
        calls: CallGuard,
        clock: Callable[[], float],
        library_path: Path | None,
        retry_seconds: float,
        retry_max_seconds: float,
    ) -> None:
        self._calls = calls
        self._clock = clock
        self._library_path = library_path
        self._retry_seconds = retry_seconds
        self._retry_max_seconds = retry_max_seconds
        self._backoff = retry_seconds
        self._active = False
        self._ever_started = False
        self._failure: NvmlInitError | None = None
        self._next_try_at: float | None = None
        self._driver_version: str | None = None
        self._lost = False

    @property
    def lost(self) -> bool:
        """The handle was lost (:meth:`lose`) and NVML has not answered since (:meth:`answered`)."""
        return self._lost

    @property
    def active(self) -> bool:
        return self._active

    @property
    def ever_started(self) -> bool:
        """nvmlInit succeeded at least once (a later failure is then transient)."""
        return self._ever_started

    @property
    def driver_version(self) -> str | None:
        """NVML: nvmlSystemGetDriverVersion, read at init."""
        return self._driver_version

    def start(self, *, force: bool) -> None:
        """nvmlInit unless already initialised. Without ``force``, inside the backoff of the
        last failure, that failure is raised again without trying. Raises ``NvmlInitError``."""
        if self._active:
            return
        now = self._clock()
        failure, retry_at = self._failure, self._next_try_at
        if not force and retry_at is not None and now < retry_at:
            # A fresh exception each time: re-raising one object grows its traceback.
            if failure is not None:
                raise NvmlInitError(failure.call, failure.code, str(failure))
            raise ReinitPending(
                lib.INIT_CALL, "reinit_pending", f"nvmlInit again in {retry_at - now:.1f} s"
            )
        try:
            lib.init(self._library_path)
        except NvmlInitError as exc:
            self._calls.count_failure(exc)
            self._failure = NvmlInitError(exc.call, exc.code, str(exc))  # without the frames
            self._next_try_at = now + self._backoff
            self._backoff = min(self._backoff * 2, self._retry_max_seconds)
            raise
        self._active = True
        self._ever_started = True
        self._failure = None
        self._next_try_at = None
        if not self._lost:  # a lost handle's backoff ends when NVML answers (answered())
            self._backoff = self._retry_seconds
        try:
            self._driver_version = lib.driver_version()
        except NvmlCallError as exc:
            self._calls.count_failure(exc)
            self._driver_version = None

    def stop(self) -> None:
        """nvmlShutdown if initialised."""
        if self._active:
            self._active = False
            lib.shutdown()

    def lose(self) -> None:
        """NVML's handle is lost (every call fails the same way): nvmlShutdown now. The first
        nvmlInit after it may run at once (a fresh init re-opens the devices); while NVML does
        not answer again (:meth:`answered`), each later one waits out the backoff, doubling
        after every try that did not bring it back, up to ``retry_max_seconds``, as after a
        failed init."""
        now = self._clock()
        if self._lost:
            self._next_try_at = now + self._backoff
            self._backoff = min(self._backoff * 2, self._retry_max_seconds)
        else:
            self._lost = True
            self._next_try_at = None
        self._failure = None
        self.stop()

    def answered(self) -> None:
        """NVML answered a device call: a lost handle is back, the backoff starts over."""
        if self._lost:
            self._lost = False
            self._backoff = self._retry_seconds
