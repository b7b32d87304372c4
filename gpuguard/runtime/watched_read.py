"""One blocking read at a time, off the event loop, under a watchdog; a late result kept.

Owns the thread plumbing both of the enforcer's schedules share (docs/design.md, Fast path).
NVML calls and ``/proc`` reads can hang in the driver or the kernel, so:

- **Each read runs in a daemon thread**, never the default executor: ``asyncio.run`` waits for
  the executor's threads at exit, so a read stuck there kept a SIGTERMed enforcer alive until
  the kubelet's SIGKILL.
- **One at a time**: no read starts beside one still running (a hung read is not joined by a
  pile of others).
- **Watchdog**: the event loop waits for a read at most ``timeout_seconds``; a read past it is
  reported (:meth:`WatchedRead.overdue`), never killed or joined.
- **A late result is kept**: a read that ends past the watchdog still delivers its result (a
  read that is only slow keeps enforcing), until :meth:`WatchedRead.close`.

Two schedules: :meth:`WatchedRead.start` (the event loop starts each call in a thread of its own
and awaits it through :meth:`WatchedRead.result`; the outcome is delivered on the event loop:
the enforcer's killer calls), and :meth:`WatchedRead.repeat` (one thread reads back to back and
delivers each outcome itself: the enforcer's loop, no event-loop round trip per read, which cost
more than the read; between reads it
sleeps, or waits in a :class:`Pause`, the fast path's native quiet gate, whose NVML calls the
watchdog watches too). Must not know what is read, nor log.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar, cast

T = TypeVar("T")


class Pause(Protocol):
    """What :meth:`WatchedRead.repeat` waits in between two reads instead of a sleep: the fast
    path's quiet gate, which reads memory in native code and ends the wait at the first read
    worth making (``ChangeDrivenSampler.pause``)."""

    what: str
    """What it does while an NVML call of its own runs (the watchdog's words)."""

    def wait(self, seconds: float) -> None:
        """Blocking: at least ``seconds``, possibly longer."""
        ...

    def close(self) -> None:
        """From any thread: the wait in progress ends now, and every later one at once."""
        ...

    def call_seconds(self) -> float | None:
        """How long its NVML call in flight has run (``None``: none)."""
        ...


class WatchedRead(Generic[T]):
    """Blocking reads of one kind (``name`` names their threads), one at a time, each watched
    from the moment it starts; ``clock`` (seconds, monotonic) is the watchdog's."""

    def __init__(
        self,
        name: str,
        *,
        timeout_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_seconds = timeout_seconds
        self._name = name
        self._clock = clock
        self._running: tuple[float, str] | None = None
        """Since when the read in flight runs, and what it does (``None``: none in flight). One
        tuple, replaced whole: the event loop reads it without a lock."""
        self._pending: asyncio.Future[T] | None = None
        """The read :meth:`start` began last, settled on the event loop when it ends."""
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        """:meth:`repeat`'s reader."""
        self._pause: Pause | None = None
        """:meth:`repeat`'s pause between reads."""

    def start(
        self,
        read: Callable[[], T],
        *,
        what: str,
        kept: Callable[[T], None],
        failed: Callable[[BaseException], None] | None = None,
    ) -> bool:
        """Start ``read()`` in a daemon thread of its own, unless the read started last has not
        ended yet (``False``: nothing started). When it ends, in time or late, ``kept`` gets its
        result (or ``failed`` its exception) on the event loop, before :meth:`result` returns
        it; ``what`` says what it does, for :meth:`overdue`."""
        pending = self._pending
        if pending is not None and not pending.done():
            return False
        loop = asyncio.get_running_loop()
        pending = loop.create_future()
        pending.add_done_callback(functools.partial(_deliver, kept=kept, failed=failed))
        self._pending = pending
        threading.Thread(
            target=self._read_once,
            args=(loop, pending, read, what),
            name=self._name,
            daemon=True,
        ).start()
        return True

    async def result(self) -> T | None:
        """The result of the read :meth:`start` began last, or ``None`` when it has not ended
        within ``timeout_seconds`` (it keeps running; ``kept`` gets its result when it ends).
        Raises what the read raised."""
        pending = self._pending
        if pending is None:
            raise RuntimeError("result() before start()")
        try:
            return await asyncio.wait_for(asyncio.shield(pending), timeout=self.timeout_seconds)
        except TimeoutError:
            return None

    def repeat(
        self,
        read: Callable[[], T],
        *,
        every_seconds: float,
        what: str,
        kept: Callable[[T], None],
        failed: Callable[[Exception], None],
        pause: Pause | None = None,
    ) -> None:
        """Until :meth:`close`: ``read()`` back to back in one daemon thread, one every
        ``every_seconds``, each watched like one :meth:`start` began. ``kept`` (its result) or
        ``failed`` (its exception) run in that thread; they must not raise. ``pause``: after a
        read that worked, waits instead of the sleep (at least the rest of ``every_seconds``;
        it may skip reads that would find nothing, see :class:`Pause`)."""
        self._pause = pause

        def loop_body() -> None:
            while not self._closed.is_set():
                started = time.monotonic()
                worked = False
                try:
                    got = self._watched(read, what)
                except Exception as exc:  # noqa: BLE001 (handed to failed: reading goes on)
                    if not self._closed.is_set():
                        failed(exc)
                else:
                    worked = True
                    if not self._closed.is_set():
                        kept(got)
                rest = max(0.0, every_seconds - (time.monotonic() - started))
                if pause is not None and worked and not self._closed.is_set():
                    pause.wait(rest)
                else:
                    # time.sleep, not the closed event's wait: on the Firecracker VMs measured a
                    # timed Event.wait wake-up cost ~190 µs of CPU against ~90 µs for a sleep, 20
                    # times a second; close() waits out at most one read and one sleep.
                    time.sleep(rest)

        self._thread = threading.Thread(target=loop_body, name=self._name, daemon=True)
        self._thread.start()

    def doing(self, what: str) -> None:
        """From the reader's thread: the read in flight now does ``what`` (its watchdog still
        counts from its start)."""
        running = self._running
        if running is not None:
            self._running = (running[0], what)

    def overdue(self) -> str | None:
        """Why the read in flight is late, once it has run more than ``timeout_seconds``
        (``timed out: <what> has run for more than <timeout> s``); else ``None``."""
        running = self._running
        if running is None:
            pausing = self._pause.call_seconds() if self._pause is not None else None
            if pausing is not None and pausing > self.timeout_seconds:
                return self.late(self._pause.what if self._pause is not None else "")
            return None
        if self._clock() - running[0] <= self.timeout_seconds:
            return None
        return self.late(running[1])

    def late(self, what: str) -> str:
        """The watchdog's words for a read doing ``what`` that has run past its timeout."""
        return f"timed out: {what} has run for more than {self.timeout_seconds} s"

    def close(self, *, join_seconds: float = 0.0) -> None:
        """Stop: no read starts and no outcome is delivered any more; :meth:`repeat`'s thread is
        waited for at most ``join_seconds``. A read stuck in the kernel or the driver is left
        behind (a daemon thread: it does not keep the process from exiting)."""
        self._closed.set()
        if self._pause is not None:
            self._pause.close()
        if self._pending is not None:
            self._pending.cancel()
        if self._thread is not None:
            self._thread.join(timeout=join_seconds)

    def _watched(self, read: Callable[[], T], what: str) -> T:
        self._running = (self._clock(), what)
        try:
            return read()
        finally:
            self._running = None

    def _read_once(
        self,
        loop: asyncio.AbstractEventLoop,
        pending: asyncio.Future[T],
        read: Callable[[], T],
        what: str,
    ) -> None:
        """:meth:`start`'s thread: run ``read()`` and settle ``pending`` with it on ``loop``."""
        try:
            got = self._watched(read, what)
        except Exception as exc:  # noqa: BLE001 (handed to the loop's future, handled there)
            settle = functools.partial(_settle, pending, None, exc)
        else:
            settle = functools.partial(_settle, pending, got, None)
        with contextlib.suppress(RuntimeError):  # the loop closed while the read ran
            loop.call_soon_threadsafe(settle)


def _settle(pending: asyncio.Future[T], got: T | None, exc: Exception | None) -> None:
    if pending.done():  # cancelled by close()
        return
    if exc is not None:
        pending.set_exception(exc)
    else:
        pending.set_result(cast("T", got))


def _deliver(
    pending: asyncio.Future[T],
    *,
    kept: Callable[[T], None],
    failed: Callable[[BaseException], None] | None,
) -> None:
    if pending.cancelled():
        return
    exc = pending.exception()
    if exc is None:
        kept(pending.result())
    elif failed is not None:
        failed(exc)
