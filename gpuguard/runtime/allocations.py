"""The kubelet's pod resources, read off the poll loop: the last answer for every cycle.

Owns when ``AllocationSource.read()`` runs: on a thread of its own, every ``interval`` seconds
(``read_interval()``: 10 s, less under a short staleness bound), and at once when a cycle asks
(``Decision.allocations_due``: a stop of GPU use without an allocation waits for an answer read
since the use was first seen). A cycle never waits for a
read: it decides on the last answer, whose ``read_at`` says how old it is (``core.allocation``
treats one older than the staleness bound as unknown).
"""

from __future__ import annotations

import threading

from gpuguard.core.allocation import UNKNOWN_ALLOCATIONS, NodeAllocations
from gpuguard.ports import AllocationSource

READ_INTERVAL_SECONDS = 10.0
"""How often the kubelet's pod resources are read when nothing asks sooner. A read is a local
gRPC call and the translation of the pods with GPU memory (~1.5 ms of gpuguard's CPU for 100
such pods, docs/performance.md): every 10 s it adds ~3 % to a 1 s poll's cycle at 8 GPUs × 100
processes, where every 5 s added ~7 %. A pod's allocation is fixed for its life, so reading
more often only shortens the wait before a new pod's use without an allocation is reported;
a stop never waits for the interval (``due()``), and 10 s is a third of
``enforcement.staleness_seconds`` (30 s by default), so an answer is replaced well before it
ages past the bound."""


def read_interval(staleness_seconds: float) -> float:
    """How often to read: every ``READ_INTERVAL_SECONDS``, or a third of
    ``enforcement.staleness_seconds`` where that is shorter. An answer must be replaced well
    before it ages past the bound: one read every 5 s under a 4 s bound was unknown for a
    second of every five, and each time ended any stop of GPU use without an allocation in
    progress, so with a grace period over 4 s none was ever stopped."""
    return min(READ_INTERVAL_SECONDS, staleness_seconds / 3)


class AllocationReads:
    """The last pod-resources answer, refreshed by a daemon thread."""

    def __init__(self, source: AllocationSource, *, interval: float = READ_INTERVAL_SECONDS):
        self._source = source
        self._interval = interval
        self._latest = UNKNOWN_ALLOCATIONS
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, name="gpuguard-podresources", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def latest(self) -> NodeAllocations:
        """The last answer (unknown until the first read returns)."""
        return self._latest

    def due(self) -> None:
        """Read now rather than at the next interval (a read in flight counts)."""
        self._wake.set()

    def stop(self) -> None:
        """Stop the thread (a read in flight ends within its own deadline) and close the source."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._interval)
        self._source.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            self._latest = self._source.read()
            self._wake.wait(self._interval)
