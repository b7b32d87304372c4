"""The demo's narration: the lines under each act's live table, as the acts' signals, Events
and agent turns produce them, and the names and sizes those lines are written with."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuguard.core.model import PodRef
from gpuguard.sim.node import GiB


@dataclass(slots=True)
class Feed:
    """What the live view shows besides the table."""

    lines: list[str] = field(default_factory=list)

    def add(self, t: float, text: str) -> None:
        self.lines.append(f"[{t:5.2f}s] {text}")
        del self.lines[:-8]


def who(pod: PodRef) -> str:
    """``namespace/name``: how the demo names a pod everywhere."""
    return f"{pod.namespace}/{pod.name}"


def gib(n: int | None) -> str:
    """Bytes in GiB, to one decimal, right-aligned in 5; ``-`` for unknown."""
    return "-" if n is None else f"{n / GiB:5.1f} GiB"
