"""startup: what a command opens as it starts, closed in reverse when it ends, however it ends.

Owns ``Startup``, the one way ``enforce``, ``agent``, ``explain`` and ``inspect`` hold what they
build (NVML, the metrics server, the node lock, the pod directory and Event sinks, the
pod-resources reads, the killer): each resource's close is registered the moment it is built
(``contextlib.ExitStack``), so a failure part-way through start-up closes exactly what was
opened, in reverse order, and a normal return, an error or a signal ends it the same way. A close
that raises does not keep the others from running (the first error surfaces, chained).

``watch()`` lists, in order, what each ``Startup`` opened and closed while it is entered: how a
test sees that a command holds its resources here, and what it held.

Standard library only. Must not build a resource (``app`` does), log, or decide what a failure
means (each command does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import TracebackType


class Startup:
    """A command's resources, each closed on leaving the ``with`` block, last opened first."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Startup:
        self._stack.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Never suppresses: each close is a callback, and a callback's error is raised.
        self._stack.__exit__(exc_type, exc, tb)

    def opened(self, name: str, close: Callable[[], object]) -> None:
        """``name`` was just built: ``close()`` runs on leaving, before the closes of what was
        opened earlier. ``name``: a stable snake_case word for ``watch()``."""
        _tell("opened", name)
        self._stack.callback(_close, name, close)

    def on_exit(self, callback: Callable[[], object]) -> None:
        """``callback()`` on leaving, in its turn: after what is opened later is closed, before
        what was opened earlier is (a command's last log line)."""
        self._stack.callback(callback)


def _close(name: str, close: Callable[[], object]) -> None:
    try:
        close()
    finally:
        _tell("closed", name)


_watchers: list[list[tuple[str, str]]] = []


def _tell(what: str, name: str) -> None:
    for seen in _watchers:
        seen.append((what, name))


@contextlib.contextmanager
def watch() -> Iterator[list[tuple[str, str]]]:
    """Every ``("opened", name)`` and ``("closed", name)`` of any ``Startup`` while inside, in
    the order they happened."""
    seen: list[tuple[str, str]] = []
    _watchers.append(seen)
    try:
        yield seen
    finally:
        _watchers.remove(seen)
