"""The fast path's quiet gate: memory reads in C between two of Python's fast reads.

An idle enforcer read every GPU's memory 20 times a second in Python, and each read woke the
interpreter: on the measured VMs that cost several times the machine's wake-up floor while
nothing happened (docs/performance.md, "CPU near the floor"). The native loop (``_gate.c``, built
by setup.py) makes the same reads with the GIL released and returns only when one of them is
worth Python's fast read: a unit's used memory moved by more than the step from its last
listing, a call failed or the GPU count changed, a listing falls due, or it is woken. Python then
makes its own fast read, exactly as after a sleep: the gate decides nothing (docs/design.md,
Fast path).

Owns :class:`NativeGate`: the flags shared with the loop (closed, release requested, woken, the
start of the call in flight for the watchdog) and the one call into it; and :class:`SourceGate`,
``ports.QuietGate`` over a source's ``wait_quiet``. Must not touch NVML
handles itself (``NvmlGpuSource.wait_quiet`` passes them under its call guard) nor log.

Pure Python where the extension is missing (no compiler at install time, a platform without
``clock_nanosleep``) or ``nvml.native_gate = false``: :func:`native_gate` returns ``None`` and
the fast path sleeps between reads as before. ``gpuguard enforce`` logs which one runs
(``enforcer_started``, ``fast_reads``).
"""

from __future__ import annotations

import ctypes
import importlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuguard.core.model import DeviceKey

_CLOSED, _RELEASE, _WOKEN, _CALL_SINCE = range(4)

_WHY = {1: "moved", 2: "failed", 3: "due", 4: "woken"}


def _load() -> ModuleType | None:
    try:
        return importlib.import_module("gpuguard.adapters.nvml._gate")
    except ImportError:
        return None


_NATIVE = _load()


def native_gate_built() -> bool:
    """The extension is installed."""
    return _NATIVE is not None


def native_gate(*, enabled: bool = True) -> NativeGate | None:
    """A gate of its own for one fast path, or ``None`` where the native part is missing or
    not ``enabled`` (``nvml.native_gate``)."""
    if _NATIVE is None or not enabled:
        return None
    return NativeGate(_NATIVE)


class NativeGate:
    """One fast path's gate: :meth:`wait` from its reader thread; :meth:`wake`, :meth:`close`
    and :meth:`request_release` from any thread (each a single store the loop reads before every
    read, so it returns within one fast interval)."""

    def __init__(self, native: ModuleType) -> None:
        self._native = native
        self._flags = (ctypes.c_int64 * native.FLAG_WORDS)()

    def wait(
        self,
        *,
        functions: tuple[int, int],
        handles: Sequence[int],
        count: int,
        baseline: Sequence[int],
        step_bytes: int,
        interval_seconds: float,
        first: float,
        until: float,
    ) -> str:
        """Blocks, GIL released: reads ``handles`` (``functions``: the count and memory calls'
        addresses) every ``interval_seconds`` from ``first`` (``time.monotonic`` seconds) on,
        until one moved more than ``step_bytes`` from ``baseline`` (``moved``), a call failed or
        the GPU count is not ``count`` (``failed``), the next read would fall at or after
        ``until`` (``due``, returned at that instant), or a flag is set (``woken``)."""
        why, _reads = self._native.wait(
            functions[0], functions[1], list(handles), count, list(baseline), step_bytes,
            interval_seconds, max(0.0, first), max(0.0, until), self._flags,
        )  # fmt: skip
        return _WHY[int(why)]

    def wake(self) -> None:
        """The decision changed (listings may be wanted sooner): the wait in progress returns."""
        self._flags[_WOKEN] = 1

    def rearm(self) -> None:
        """Before reading what wakes it: a :meth:`wake` after this returns the next wait."""
        self._flags[_WOKEN] = 0

    def request_release(self, *, releasing: bool) -> None:
        """NVML is about to be shut down (``True``, before its guard is taken) or is back."""
        self._flags[_RELEASE] = int(releasing)

    def close(self) -> None:
        """The fast path stops: every wait returns at once, for good."""
        self._flags[_CLOSED] = 1

    def call_seconds(self) -> float | None:
        """How long the loop's NVML call in flight has run (``None``: none): the watchdog's view
        of a call hung in the driver while Python waits in the gate."""
        since = self._flags[_CALL_SINCE]
        return None if since == 0 else max(0.0, (time.monotonic_ns() - since) / 1e9)


@dataclass(frozen=True)
class SourceGate:
    """``ports.QuietGate``: ``native`` over the units a source reads; ``wait`` is the source's
    ``wait_quiet`` (it passes the handles under its call guard)."""

    wait_quiet: Callable[..., str | None]
    native: NativeGate

    def wait(
        self,
        *,
        baseline: Mapping[DeviceKey, int],
        step_bytes: int,
        interval_seconds: float,
        first: float,
        until: float,
    ) -> str | None:
        return self.wait_quiet(
            self.native, baseline=baseline, step_bytes=step_bytes,
            interval_seconds=interval_seconds, first=first, until=until,
        )  # fmt: skip

    def wake(self) -> None:
        self.native.wake()

    def rearm(self) -> None:
        self.native.rearm()

    def close(self) -> None:
        self.native.close()

    def call_seconds(self) -> float | None:
        return self.native.call_seconds()
