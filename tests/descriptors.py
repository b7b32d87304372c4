"""Descriptors numbered past ``FD_SETSIZE`` (1024): ``descriptors_past_fd_setsize``.

The enforcer holds a pidfd per pinned GPU process, so on a busy node every socket and inotify
descriptor it opens later is numbered past 1024, where ``select(2)`` cannot go. Tests open
``/dev/null`` until the next descriptor would be past that, so what the code under test opens
next is numbered as it would be there.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

FD_SETSIZE = 1024
"""The size of select(2)'s ``fd_set``: descriptors from here on cannot be selected."""


@contextmanager
def descriptors_past_fd_setsize(margin: int = 16) -> Iterator[int]:
    """While open, the lowest free descriptor is past ``FD_SETSIZE + margin``; yields it."""
    held: list[int] = []
    try:
        while True:
            fd = os.open(os.devnull, os.O_RDONLY)
            if fd > FD_SETSIZE + margin:
                os.close(fd)
                yield fd
                return
            held.append(fd)
    finally:
        for fd in held:
            os.close(fd)
