"""``AllocationReads``: the kubelet's pod resources read off the poll loop, by the real
``PodResourcesReader`` over a real gRPC server (``rigs/podresources.py``): the first answer
comes at once, ``due()`` reads at once, ``stop()`` ends the thread and closes the reader, and no
caller ever waits for a read (docs/design.md, GPU use without an allocation).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuguard.adapters.podresources import PodResourcesReader
from gpuguard.runtime.allocations import AllocationReads, read_interval
from rigs.controlplane import wait_until
from rigs.podresources import answer, kubelet, pod, socket_path
from tests.fakes import FakeClock

LONG = 60.0
"""An interval no test waits out: whatever is read within a test was read early."""


@pytest.fixture
def sock() -> Iterator[Path]:
    with socket_path() as path:
        yield path


def reads_of(sock: Path, *, timeout: float = 2.0) -> AllocationReads:
    return AllocationReads(
        PodResourcesReader(sock, clock=FakeClock(now=42.0), timeout=timeout), interval=LONG
    )


def read_pods(reads: AllocationReads) -> set[tuple[str, str]]:
    return set(reads.latest().pods)


def test_the_first_answer_arrives_without_waiting_the_interval(sock: Path) -> None:
    with kubelet(sock) as server:
        server.answer = answer(pod("team", "trainer"))
        reads = reads_of(sock)
        assert reads.latest().unknown == "not read yet"
        reads.start()
        try:
            wait_until(lambda: read_pods(reads) == {("team", "trainer")}, timeout=5)
        finally:
            reads.stop()
    assert reads.latest().read_at == 42.0
    assert server.calls == 1


def test_due_reads_again_well_before_the_interval(sock: Path) -> None:
    with kubelet(sock) as server:
        server.answer = answer(pod("team", "before"))
        reads = reads_of(sock)
        reads.start()
        try:
            wait_until(lambda: read_pods(reads) == {("team", "before")}, timeout=5)
            server.answer = answer(pod("team", "after"))
            time.sleep(0.3)
            assert read_pods(reads) == {("team", "before")}, "read again without being asked"
            reads.due()
            wait_until(lambda: read_pods(reads) == {("team", "after")}, timeout=5)
        finally:
            reads.stop()
    assert server.calls == 2


def test_stop_ends_the_thread_and_closes_the_reader(sock: Path) -> None:
    with kubelet(sock) as server:
        reader = PodResourcesReader(sock, clock=FakeClock(now=42.0))
        reads = AllocationReads(reader, interval=LONG)
        reads.start()
        wait_until(lambda: reads.latest().unknown is None, timeout=5)
        started = time.monotonic()
        reads.stop()
        assert time.monotonic() - started < 5.0, "stop() waited out the interval"
        assert "gpuguard-podresources" not in {t.name for t in threading.enumerate()}
        closed = reader.read()
        assert closed.unknown == "the pod-resources reader is closed"
        reads.due()
        time.sleep(0.2)
    assert server.calls == 1


def test_a_hanging_kubelet_never_blocks_the_last_answer(sock: Path) -> None:
    """While a read waits out its 1 s deadline, ``latest()`` and ``due()`` answer at once."""
    with kubelet(sock) as server:
        server.hang = True
        reads = reads_of(sock, timeout=1.0)
        reads.start()
        try:
            wait_until(lambda: server.calls >= 1, timeout=5)
            started = time.monotonic()
            for _ in range(10):
                assert reads.latest().unknown == "not read yet"
                reads.due()
            assert time.monotonic() - started < 0.1
            wait_until(lambda: "did not answer" in (reads.latest().unknown or ""), timeout=5)
        finally:
            reads.stop()


@pytest.mark.parametrize(("staleness", "interval"), [(30.0, 10.0), (15.0, 5.0), (4.0, 4 / 3)])
def test_answers_are_read_well_inside_the_staleness_bound(
    staleness: float, interval: float
) -> None:
    assert read_interval(staleness) == pytest.approx(interval)
