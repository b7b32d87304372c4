"""The real clock (``ports.Clock``): ``time.monotonic`` for intervals, ``time.time`` for
timestamps. ``app`` wires it; the kube adapters fall back to it when built without an injected
clock; tests inject their own. One definition: it was written twice (the runtime's and the kube
retry module's)."""

from __future__ import annotations

import time


class SystemClock:
    """``time.monotonic`` for intervals, ``time.time`` for timestamps."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()
