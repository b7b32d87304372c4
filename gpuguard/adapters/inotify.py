"""Change notices for one file through Linux inotify (libc via ctypes): ``FileNotices``.

Owns an inotify descriptor that watches the directories whose entries decide what a path is:
the file's own directory, and the directory of every symlink on the way to it (a Kubernetes
ConfigMap volume swaps its ``..data`` link; an editor or ``mv`` renames a new file into place).
It tells its user that the file may have changed, so the user can look (one ``stat``) instead of
looking on a timer. Must not read the file, nor decide whether it changed: a notice may be for a
change that leaves the file as it was. Linux only; anything else (no inotify, out of watches) is
an ``OSError`` the caller falls back from.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct
from collections import defaultdict
from pathlib import PurePosixPath
from typing import Final

_IN_MODIFY: Final = 0x00000002
_IN_ATTRIB: Final = 0x00000004
_IN_CLOSE_WRITE: Final = 0x00000008
_IN_MOVED_FROM: Final = 0x00000040
_IN_MOVED_TO: Final = 0x00000080
_IN_CREATE: Final = 0x00000100
_IN_DELETE: Final = 0x00000200
_IN_DELETE_SELF: Final = 0x00000400
_IN_MOVE_SELF: Final = 0x00000800
_IN_Q_OVERFLOW: Final = 0x00004000
_IN_IGNORED: Final = 0x00008000
_IN_ONLYDIR: Final = 0x01000000

_DIRECTORY_EVENTS: Final = (
    _IN_MODIFY
    | _IN_ATTRIB
    | _IN_CLOSE_WRITE
    | _IN_MOVED_FROM
    | _IN_MOVED_TO
    | _IN_CREATE
    | _IN_DELETE
    | _IN_DELETE_SELF
    | _IN_MOVE_SELF
)
_ALWAYS_NOTICED: Final = _IN_DELETE_SELF | _IN_MOVE_SELF | _IN_Q_OVERFLOW | _IN_IGNORED
"""Events that concern the watch itself (its directory went, or events were lost), whatever the
name: the file may now be something else."""

_EVENT_HEAD: Final = struct.Struct("iIII")  # wd, mask, cookie, len (struct inotify_event)
_READ_BYTES: Final = 64 * 1024
_MAX_LINKS: Final = 40  # as the kernel's ELOOP bound


def _libc() -> ctypes.CDLL:
    name = ctypes.util.find_library("c") or "libc.so.6"
    return ctypes.CDLL(name, use_errno=True)


def watch_points(path: str) -> dict[str, frozenset[str]]:
    """Each directory whose entries decide what ``path`` resolves to, with the names in it that
    do: the final directory with the file's name, and the directory of each symlink followed on
    the way, with the link's name. Reads links only (no ``stat``); a missing part ends the walk
    there, where it is still watched."""
    points: defaultdict[str, set[str]] = defaultdict(set)
    # Not abspath: it would drop "link/.." before the link is followed, as the kernel does not.
    full = PurePosixPath(os.getcwd(), path)
    pending = list(reversed(full.parts[1:]))
    current = "/"
    links = 0
    while pending:
        name = pending.pop()
        if name == "..":
            current = os.path.dirname(current)
            continue
        if name in ("", "."):
            continue
        candidate = os.path.join(current, name)
        try:
            target = os.readlink(candidate)
        except OSError:  # not a link, or not there
            if not pending:
                points[current].add(name)
            current = candidate
            continue
        points[current].add(name)
        links += 1
        if links > _MAX_LINKS:
            break
        if target.startswith("/"):
            current = "/"
        pending.extend(reversed([part for part in target.split("/") if part]))
    return {directory: frozenset(names) for directory, names in points.items()}


class FileNotices:
    """Inotify watches on the directories that decide what one path is (``watch_points``).

    ``fileno()`` turns readable when a notice is pending; :meth:`take` reads them all. Call
    :meth:`rewatch` after a notice: a changed link may lead elsewhere now. Not thread-safe: one
    thread uses it."""

    def __init__(self, path: str) -> None:
        """Raises ``OSError`` when inotify is not to be had or a directory cannot be watched."""
        self._path = path
        self._libc = _libc()
        fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            raise _os_error("inotify_init1")
        self._fd: int | None = fd
        self._watches: dict[int, tuple[str, frozenset[str]]] = {}
        """Watch descriptor: the directory and the names in it that matter."""
        try:
            self.rewatch()
        except OSError:
            self.close()
            raise

    def fileno(self) -> int:
        if self._fd is None:
            raise ValueError("FileNotices is closed")
        return self._fd

    def rewatch(self) -> None:
        """Watch what decides the path now, and nothing else. Raises ``OSError`` when a
        directory cannot be watched (gone, no permission, out of watches)."""
        fd = self.fileno()
        wanted = watch_points(self._path)
        kept: dict[int, tuple[str, frozenset[str]]] = {}
        for directory, names in wanted.items():
            wd = self._libc.inotify_add_watch(
                fd, os.fsencode(directory), _DIRECTORY_EVENTS | _IN_ONLYDIR
            )
            if wd < 0:
                raise _os_error(f"inotify_add_watch {directory}")
            kept[wd] = (directory, names)
        for wd in self._watches.keys() - kept.keys():
            self._libc.inotify_rm_watch(fd, wd)  # EINVAL when already gone: nothing to do
        self._watches = kept

    def take(self) -> bool:
        """Read every pending notice; whether one may concern the path (its name, a watched
        directory gone or moved, notices lost). Never blocks."""
        noticed = False
        while True:
            try:
                data = os.read(self.fileno(), _READ_BYTES)
            except BlockingIOError:
                return noticed
            offset = 0
            while offset + _EVENT_HEAD.size <= len(data):
                wd, mask, _, length = _EVENT_HEAD.unpack_from(data, offset)
                start = offset + _EVENT_HEAD.size
                name = data[start : start + length].split(b"\0", 1)[0]
                offset = start + length
                watched = self._watches.get(wd)
                if mask & _ALWAYS_NOTICED or watched is None or os.fsdecode(name) in watched[1]:
                    noticed = True

    def close(self) -> None:
        """Idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _os_error(what: str) -> OSError:
    code = ctypes.get_errno() or errno.EIO
    return OSError(code, f"{what}: {os.strerror(code)}")
