"""The real clock. Tests inject their own ``ports.Clock``."""

from __future__ import annotations

import time


class SystemClock:
    """``time.monotonic`` for intervals, ``time.time`` for timestamps."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()
