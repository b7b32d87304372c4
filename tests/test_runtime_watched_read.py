"""``WatchedRead``, the enforcer's one primitive for blocking reads, with real threads: one read
at a time, a read that hangs is reported by the watchdog and not waited on, a late result is
kept and delivered, a read's exception reaches the caller, and closing with a read in flight
neither waits for it nor delivers it. The watchdog's clock is a ``FakeClock``; the waits are
real (short) ones.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest

from gpuguard.runtime.watched_read import WatchedRead
from tests.fakes import FakeClock


class Gate:
    """A read that blocks until ``release()``, counting its calls and the calls in flight."""

    def __init__(self, value: int = 7) -> None:
        self.value = value
        self.release_event = threading.Event()
        self.entered = threading.Event()
        self.calls = 0
        self.in_flight = 0
        self.most_in_flight = 0
        self._guard = threading.Lock()

    def __call__(self) -> int:
        with self._guard:
            self.calls += 1
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        self.entered.set()
        try:
            self.release_event.wait(timeout=10)
            return self.value
        finally:
            with self._guard:
                self.in_flight -= 1

    def release(self) -> None:
        self.release_event.set()


async def _until(done: Callable[[], bool], *, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not done():  # a thread sets it: nothing on the loop to wait on
        assert time.monotonic() < deadline, "never happened"
        await asyncio.sleep(0.005)


async def test_a_read_in_time_is_returned_and_kept_before_result_returns() -> None:
    kept: list[int] = []
    reads = WatchedRead[int]("test-read", timeout_seconds=5.0)
    assert reads.start(lambda: 3, what="reading", kept=kept.append)
    assert await reads.result() == 3
    assert kept == [3]  # delivered on the loop before result() returned it


async def test_a_second_start_while_one_is_in_flight_starts_nothing() -> None:
    gate = Gate()
    kept: list[int] = []
    reads = WatchedRead[int]("test-read", timeout_seconds=0.05)
    try:
        assert reads.start(gate, what="reading", kept=kept.append)
        assert await reads.result() is None  # past the watchdog
        assert not reads.start(gate, what="reading", kept=kept.append)
        assert not reads.start(gate, what="reading", kept=kept.append)
        assert gate.calls == 1
    finally:
        gate.release()
    await _until(lambda: kept == [7])
    assert reads.start(gate, what="reading", kept=kept.append)  # ended: the next may start
    assert await reads.result() == 7
    assert (gate.calls, gate.most_in_flight) == (2, 1)


async def test_a_hung_read_is_not_waited_on_and_the_watchdog_names_it_past_its_timeout() -> None:
    clock = FakeClock()
    gate = Gate()
    reads = WatchedRead[int]("test-read", timeout_seconds=0.2, clock=clock.monotonic)
    try:
        assert reads.overdue() is None
        assert reads.start(gate, what="reading /proc", kept=lambda _: None)
        started = time.monotonic()
        assert await reads.result() is None
        waited = time.monotonic() - started
        assert 0.15 <= waited < 2.0, waited  # the timeout, not the read's 10 s
        assert gate.entered.is_set()
        assert reads.overdue() is None  # the watchdog's clock has not moved
        clock.advance(0.19)
        assert reads.overdue() is None  # within the timeout
        clock.advance(0.02)
        assert reads.overdue() == "timed out: reading /proc has run for more than 0.2 s"
        assert reads.late("x") == "timed out: x has run for more than 0.2 s"
    finally:
        gate.release()
    await _until(lambda: reads.overdue() is None)  # ended: nothing in flight


async def test_a_late_result_is_kept_and_delivered_on_the_loop() -> None:
    gate = Gate(value=42)
    kept: list[tuple[int, bool]] = []
    loop_thread = threading.get_ident()
    reads = WatchedRead[int]("test-read", timeout_seconds=0.05)
    assert reads.start(
        gate,
        what="reading",
        kept=lambda v: kept.append((v, threading.get_ident() == loop_thread)),
    )
    assert await reads.result() is None
    assert kept == []
    gate.release()
    await _until(lambda: bool(kept))
    assert kept == [(42, True)]


async def test_a_reads_exception_reaches_the_caller_and_failed_in_time_or_late() -> None:
    failures: list[BaseException] = []
    kept: list[int] = []

    def broken() -> int:
        raise ValueError("bad read")

    reads = WatchedRead[int]("test-read", timeout_seconds=5.0)
    assert reads.start(broken, what="reading", kept=kept.append, failed=failures.append)
    with pytest.raises(ValueError, match="bad read"):
        await reads.result()
    assert [str(e) for e in failures] == ["bad read"]

    gate = Gate()

    def late_break() -> int:
        gate()
        raise OSError("late")

    slow = WatchedRead[int]("test-read", timeout_seconds=0.05)
    assert slow.start(late_break, what="reading", kept=kept.append, failed=failures.append)
    assert await slow.result() is None
    gate.release()
    await _until(lambda: len(failures) == 2)
    assert isinstance(failures[1], OSError)
    assert kept == []


async def test_closing_with_a_read_in_flight_neither_waits_for_it_nor_delivers_it() -> None:
    gate = Gate()
    kept: list[int] = []
    reads = WatchedRead[int]("test-read-closing", timeout_seconds=0.05)
    assert reads.start(gate, what="reading", kept=kept.append)
    assert await reads.result() is None
    started = time.monotonic()
    reads.close(join_seconds=5.0)
    assert time.monotonic() - started < 1.0, "close() waited for the hung read"
    [thread] = [t for t in threading.enumerate() if t.name == "test-read-closing"]
    assert thread.daemon, "a read stuck in the kernel would keep the process from exiting"
    gate.release()
    thread.join(timeout=5)
    await asyncio.sleep(0.05)  # the settle the thread posted to the loop has run
    assert kept == []


def test_a_read_that_outlives_its_event_loop_ends_quietly() -> None:
    gate = Gate()
    kept: list[int] = []
    reads = WatchedRead[int]("test-read-outliving", timeout_seconds=0.05)

    async def main() -> int | None:
        assert reads.start(gate, what="reading", kept=kept.append)
        return await reads.result()

    assert asyncio.run(main()) is None  # returns at the timeout, the loop closes
    [thread] = [t for t in threading.enumerate() if t.name == "test-read-outliving"]
    gate.release()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert kept == []


async def test_repeated_reads_run_one_at_a_time_in_one_thread_and_go_on_after_a_failure() -> None:
    calls: list[str] = []
    kept: list[int] = []
    failures: list[Exception] = []
    lock = threading.Lock()
    in_flight = most = 0

    def read() -> int:
        nonlocal in_flight, most
        with lock:
            in_flight += 1
            most = max(most, in_flight)
        try:
            calls.append(threading.current_thread().name)
            time.sleep(0.002)
            if len(calls) == 2:
                raise RuntimeError("a bug")
            return len(calls)
        finally:
            with lock:
                in_flight -= 1

    reads = WatchedRead[int]("test-repeat", timeout_seconds=1.0)
    reads.repeat(read, every_seconds=0.01, what="reading", kept=kept.append, failed=failures.append)
    try:
        await _until(lambda: len(kept) >= 4)
    finally:
        reads.close(join_seconds=2.0)
    assert not any(t.name == "test-repeat" for t in threading.enumerate()), "not joined"
    assert set(calls) == {"test-repeat"}
    assert most == 1
    assert [str(e) for e in failures] == ["a bug"]
    assert kept[:3] == [1, 3, 4]
    count = len(calls)
    await asyncio.sleep(0.05)
    assert len(calls) == count, "read on after close()"


async def test_a_repeated_read_that_hangs_is_overdue_from_its_start_under_its_latest_name() -> None:
    clock = FakeClock()
    gate = Gate()
    reads = WatchedRead[int]("test-repeat-hang", timeout_seconds=0.5, clock=clock.monotonic)

    def read() -> int:
        clock.advance(0.3)  # the first part of the read took 0.3 s
        reads.doing("reading /proc")
        return gate()

    kept: list[int] = []
    failures: list[Exception] = []
    reads.repeat(
        read, every_seconds=0.01, what="an NVML call", kept=kept.append, failed=failures.append
    )
    try:
        await _until(gate.entered.is_set)
        assert reads.overdue() is None  # 0.3 s into it
        clock.advance(0.3)
        assert reads.overdue() == "timed out: reading /proc has run for more than 0.5 s"
        started = time.monotonic()
        reads.close(join_seconds=0.1)
        assert time.monotonic() - started < 1.0
    finally:
        gate.release()
    assert (kept, failures) == ([], [])  # ended after close(): not delivered
    assert gate.calls == 1
