"""Waiting for descriptors to become readable: ``readable``.

Owns the one way gpuguard's threads wait on a descriptor: ``poll(2)``, never ``select(2)``,
whose ``fd_set`` holds descriptors below ``FD_SETSIZE`` (1024) only: Python's ``select.select``
raises ``ValueError`` for any other. The enforcer keeps a pidfd open per pinned GPU process
(``ProcfsProcessResolver``), so its sockets and inotify descriptors are numbered past 1024 on a
busy node. Must not read from the descriptors it watches.
"""

from __future__ import annotations

import select
from collections.abc import Sequence
from typing import Protocol


class _HasFileno(Protocol):
    def fileno(self) -> int: ...


def readable(watched: Sequence[int | _HasFileno], seconds: float) -> set[int]:
    """The descriptors of ``watched`` that are readable (or hung up, or in error) within
    ``seconds`` (at least 1 ms when positive; 0: no waiting); empty when none became so."""
    poller = select.poll()
    for each in watched:
        poller.register(each, select.POLLIN)
    timeout_ms = max(1, round(seconds * 1000)) if seconds > 0 else 0
    return {fd for fd, _events in poller.poll(timeout_ms)}
