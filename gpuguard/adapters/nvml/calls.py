"""The NVML call guard: one NVML operation at a time, a deadline per sample, call timings, and
the ``gpuguard_nvml_errors_total{call}`` count.

NVML can block forever in the kernel (Xid 45, driver UVM lock bugs), and a thread stuck
in a C call cannot be cancelled; the runtime bounds its wait with ``asyncio.wait_for``. This
guard adds two defences of its own:

- a sample whose NVML calls ran past ``deadline_seconds`` is discarded (:class:`DeadlineExceeded`,
  counted as an error of the call that returned late) even if it eventually completes, so late
  data never reaches ``decide()``;
- while one operation is still in flight (a hung call), the next ``sample()`` fails fast with
  ``GpuSourceError`` instead of piling up threads; :attr:`CallGuard.in_flight_seconds` says how
  long it has been stuck.

Must not call NVML itself or decide what a failure means: the caller counts a failed call
(:meth:`CallGuard.count_failure`) where it gives the call's data up.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

from gpuguard.adapters.nvml.lib import NvmlCallError, NvmlFunction
from gpuguard.errors import GpuSourceError
from gpuguard.ports import HealthRecorder

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class CallTimings:
    """How long the last completed sample's NVML calls took (for a watchdog metric)."""

    sample_seconds: float
    calls: int
    slowest_call: str
    slowest_call_seconds: float


class DeadlineExceeded(Exception):
    """A call returned after the sample's deadline; the sample is discarded."""


class CallGuard:
    """Times and serialises NVML calls, and counts the failed ones into ``health``."""

    def __init__(self, *, deadline_seconds: float | None, health: HealthRecorder) -> None:
        self._deadline_seconds = deadline_seconds
        self._health = health
        self._busy = threading.Lock()
        self._in_flight_since: float | None = None
        self._deadline_at: float | None = None
        self._calls = 0
        self._slowest: tuple[str, float] = ("", 0.0)
        self._last_timings: CallTimings | None = None

    @property
    def in_flight_seconds(self) -> float | None:
        """How long the sample now running has been running (``None`` when idle)."""
        since = self._in_flight_since
        return None if since is None else time.perf_counter() - since

    @property
    def last_timings(self) -> CallTimings | None:
        """Timing of the last sample that completed (kept or discarded)."""
        return self._last_timings

    def _busy_error(self, what: str) -> GpuSourceError:
        """Why ``what`` cannot run now: another NVML call holds the guard (for how long)."""
        running = self.in_flight_seconds
        detail = "" if running is None else f" for {running:.1f} s"
        return GpuSourceError(
            f"cannot {what}: a previous NVML call is still running{detail}"
            " (possibly hung in the driver)"
        )

    @contextlib.contextmanager
    def hold(self, what: str, *, wait: bool) -> Iterator[None]:
        """One NVML operation at a time. ``wait`` false (a sample) fails fast when another is
        running, so a hung call does not pile up threads; true (acquire, release) waits up to
        the deadline. Raises ``GpuSourceError`` when the guard cannot be had."""
        if wait:
            timeout = self._deadline_seconds
            got = self._busy.acquire(timeout=-1 if timeout is None else timeout)
        else:
            got = self._busy.acquire(blocking=False)
        if not got:
            raise self._busy_error(what)
        try:
            yield
        finally:
            self._busy.release()

    @contextlib.contextmanager
    def sample_deadline(self) -> Iterator[None]:
        """The calls made inside form one sample: timed together, and each must return before
        ``deadline_seconds`` from the start (else :class:`DeadlineExceeded`)."""
        start = time.perf_counter()
        self._in_flight_since = start
        limit = self._deadline_seconds
        self._deadline_at = None if limit is None else start + limit
        self._calls = 0
        self._slowest = ("", 0.0)
        try:
            yield
        finally:
            self._last_timings = CallTimings(
                sample_seconds=time.perf_counter() - start,
                calls=self._calls,
                slowest_call=self._slowest[0],
                slowest_call_seconds=self._slowest[1],
            )
            self._in_flight_since = None
            self._deadline_at = None

    def quick(self, what: str, call: str, fn: Callable[[], T]) -> T:
        """One quick operation (the fast memory read): the same exclusion as :meth:`hold`
        (fails fast while another runs) and the same deadline, timed as a whole rather than per
        call: what it saves is the point. ``call`` names the NVML function counted when it
        returns past the deadline. Raises ``GpuSourceError``."""
        if not self._busy.acquire(blocking=False):
            raise self._busy_error(what)
        try:
            start = time.perf_counter()
            self._in_flight_since = start
            result = fn()
            took = time.perf_counter() - start
            if self._deadline_seconds is not None and took > self._deadline_seconds:
                self._health.count_nvml_error(call)
                raise GpuSourceError(
                    f"NVML {what} ran past its {self._deadline_seconds} s deadline "
                    f"({took:.3f} s); discarded"
                )
            return result
        finally:
            self._in_flight_since = None
            self._busy.release()

    def call(self, fn: NvmlFunction[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """One timed NVML call; raises :class:`DeadlineExceeded` (and counts the call) if it
        returned after the deadline: the result may describe a GPU state that is long gone."""
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            t1 = time.perf_counter()
            took = t1 - t0
            self._calls += 1
            if took > self._slowest[1]:
                self._slowest = (fn.name, took)
            deadline = self._deadline_at
            if deadline is not None and t1 > deadline:
                self._health.count_nvml_error(fn.name)
                raise DeadlineExceeded(
                    f"NVML sample ran past its {self._deadline_seconds} s deadline "
                    f"({fn.name} returned after {took:.3f} s); sample discarded"
                )

    def count_failure(self, exc: NvmlCallError) -> None:
        """A call failed and its data is given up (a device skipped, a sample lost, NVML not
        started): ``gpuguard_nvml_errors_total{call}``."""
        self._health.count_nvml_error(exc.call)
