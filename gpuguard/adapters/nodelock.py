"""nodelock: the node-local enforcer lock, an ``flock(2)`` on a file in a host directory.

Owns the lock that keeps two enforcers on one node from both acting (docs/reliability.md R3): the
chart mounts the host's ``/run/gpuguard`` into every enforcer, so two releases, a surge pod and
an enforcer started by hand on the node all meet at the same file. An ``flock`` belongs to the
open file description and the kernel drops it when the last descriptor closes: when the holder
exits, even by SIGKILL or the OOM killer, the lock is free at once, with no lease to expire and
no API server to ask. The holder writes its PID into the file so a waiter can say who holds it.

Must not: wait for the lock (``LOCK_NB``: the runtime tries again every poll); do more, while
it holds the lock, than compare the file at the path with the one locked (an ``fstat`` and an
``lstat``, a few microseconds: the runtime may re-check a held lock on its event loop, where a
thread hop each second woke an idle enforcer five times); delete the lock file (a waiter that
opened it before the delete would lock an orphan while a third process locks a new file at the
path); follow a symlink at the lock path.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

import structlog

from gpuguard.core.model import NodeLockState

log = structlog.get_logger(__name__)

_ATTEMPTS = 3
"""Opens per ``hold()`` when the file at the path is replaced between the open and the lock."""


class _Unopenable(Exception):
    """The lock file cannot be created or opened; the message says which step and why."""


class FlockNodeLock:
    """``ports.NodeLock`` over ``flock(LOCK_EX | LOCK_NB)`` on ``path``."""

    def __init__(self, path: Path, *, pid: int | None = None) -> None:
        """``pid``: what the holder writes into the file (default: this process's PID)."""
        self._path = path
        self._pid = os.getpid() if pid is None else pid
        self._fd: int | None = None

    @property
    def path(self) -> Path:
        return self._path

    def hold(self) -> NodeLockState:
        """Take the lock when free; while held, re-check that the file at the path is the one
        locked (someone deleted or replaced it: then another enforcer may lock the new file,
        so this one takes the new file too, or stands by). Never raises. While held and in
        place it only compares (see the module): it does not block."""
        path = str(self._path)
        if self._fd is not None:
            if _is_at(self._fd, self._path):
                return NodeLockState(held=True, path=path)
            log.warning(
                "enforcement_lock_replaced",
                lock_file=path,
                detail="the locked file is no longer at its path (deleted or replaced): "
                "taking the lock on the file there now",
            )
            self.release()
        for _ in range(_ATTEMPTS):
            try:
                fd = self._open()
            except _Unopenable as exc:
                return NodeLockState(held=False, path=path, problem=str(exc))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(fd)
                os.close(fd)
                return NodeLockState(held=False, path=path, holder_pid=holder)
            except OSError as exc:
                os.close(fd)
                return NodeLockState(held=False, path=path, problem=f"flock: {exc.strerror}")
            if not _is_at(fd, self._path):
                os.close(fd)  # replaced between the open and the lock: open the new one
                continue
            self._fd = fd
            with contextlib.suppress(OSError):  # only the holder's PID is lost (a full tmpfs)
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{self._pid}\n".encode(), 0)
            return NodeLockState(held=True, path=path)
        return NodeLockState(
            held=False, path=path, problem="the file kept being replaced while it was locked"
        )

    def release(self) -> None:
        """Close the descriptor: the kernel drops the lock. The file stays (see the module)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def _open(self) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            return os.open(self._path, flags, 0o644)
        except FileNotFoundError:
            pass  # its directory is missing: create it (as the chart's DirectoryOrCreate does)
        except OSError as exc:
            raise _Unopenable(f"cannot open it ({exc.strerror})") from exc
        directory = self._path.parent
        try:
            directory.mkdir(mode=0o755, parents=True, exist_ok=True)
        except OSError as exc:
            raise _Unopenable(f"cannot create {directory} ({exc.strerror})") from exc
        try:
            return os.open(self._path, flags, 0o644)
        except OSError as exc:
            raise _Unopenable(f"cannot open it ({exc.strerror})") from exc


def _is_at(fd: int, path: Path) -> bool:
    """Whether ``fd`` is the file at ``path`` now (same device and inode)."""
    held = os.fstat(fd)
    try:
        there = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino)


def _read_pid(fd: int) -> int | None:
    """The PID the holder wrote, or ``None`` (not written yet, or not a PID)."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", errors="replace").strip()
    except OSError:
        return None
    return int(text) if text.isdecimal() and text.isascii() and 0 < int(text) <= 2**22 else None
