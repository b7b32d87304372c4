"""cgroup_members: a container's processes, read from its cgroup tree, and cgroup membership.

Owns the walk the killer lists a container's members with (``list_members``: ``cgroup.procs`` of
the container's cgroup and of every cgroup below it) and the reading of a process's cgroup line
(``cgroup_line_path``, ``is_within``), which the killer's re-verification after ``pidfd_open``
compares with the container's path. The walk opens each directory relative to its parent's fd
(``openat``), so a tree nested past ``PATH_MAX`` is walked like any other, and visits at most
``MAX_CGROUPS_WALKED`` cgroups.

Must not: follow a symlink out of the cgroup tree, build a path string that grows with the
tree's depth, walk without bound, or signal anything (``adapters.killer`` does).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

from gpuguard.core.cgroup import kernel_lines
from gpuguard.core.model import ContainerCgroup

MAX_CGROUPS_WALKED = 100_000
"""Bound on the cgroups one container's walk visits: a tenant with cgroup delegation can create
nested cgroups, and the walk must end. Beyond it the container is refused, not half-signalled
silently."""


def v2_root(cgroup_root: Path) -> Path:
    """Where the cgroup v2 tree is mounted: ``cgroup_root`` on a pure v2 host,
    ``<cgroup_root>/unified`` on a hybrid one (v1 controllers beside it)."""
    hybrid = cgroup_root / "unified"
    pure_v2 = (cgroup_root / "cgroup.procs").is_file()
    return hybrid if not pure_v2 and (hybrid / "cgroup.procs").is_file() else cgroup_root


def v2_dir(root: Path, path: str) -> Path | None:
    """The directory of the v2 cgroup ``path`` (as ``/proc/<pid>/cgroup`` shows it) under the
    v2 mount ``root``; None for a path this mount cannot resolve: one with a ``.`` or ``..``
    component (relative to another cgroup namespace: joined here it would name some other
    cgroup, up to the root) or the root itself (no container's)."""
    parts = path.split("/")
    if any(p in ("..", ".") for p in parts):
        return None
    rel = [p for p in parts if p]
    return root.joinpath(*rel) if rel else None


def cgroup_line_path(cgroup_text: str, cgroup: ContainerCgroup) -> str | None:
    """The path on the line of ``cgroup``'s hierarchy in a ``/proc/<pid>/cgroup`` text.

    v2: the ``0::`` line; v1: the line whose controller list equals ``cgroup.hierarchy``
    (``pids``, ``name=systemd``). ``None`` when the process has no such line.
    """
    for line in kernel_lines(cgroup_text):
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy_id, controllers, path = parts
        if cgroup.version == 2:
            if hierarchy_id == "0" and controllers == "":
                return path
        elif hierarchy_id != "0" and controllers == cgroup.hierarchy:
            return path
    return None


def is_within(path: str, container_path: str) -> bool:
    """``path`` is ``container_path`` or a cgroup below it (component-wise, not by prefix)."""
    base = container_path.rstrip("/")
    return path == base or path.startswith(base + "/")


def list_members(directory: Path) -> tuple[int, ...]:
    """PIDs in ``directory``'s ``cgroup.procs`` and in every descendant cgroup's.

    Walks directory file descriptors (``openat`` relative to the parent, never following
    symlinks), so a tree deeper than ``PATH_MAX`` is walked like any other. Cgroups that
    vanish during the walk (the container is exiting) are skipped; any other ``OSError``
    (EMFILE, EACCES, ...) or a tree larger than ``MAX_CGROUPS_WALKED`` raises, for the caller
    to refuse the container with a reason. Each PID once, in walk order.
    """
    seen: dict[int, None] = {}
    for procs in _walk_cgroup_procs(directory):
        for token in procs.split():
            seen.setdefault(int(token), None)
    return tuple(seen)


class _DirFd:
    """A directory fd shared by its pending children; closed when the last one is opened."""

    __slots__ = ("fd", "pending")

    def __init__(self, fd: int, pending: int) -> None:
        self.fd = fd
        self.pending = pending

    def release(self) -> None:
        self.pending -= 1
        if self.pending == 0:
            os.close(self.fd)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


_Pending = tuple[_DirFd | None, str, int | None]
"""A cgroup still to visit: (its parent's shared fd, its name) or (None, "", its open fd)."""


def _walk_cgroup_procs(directory: Path) -> Iterator[str]:
    """The ``cgroup.procs`` text of ``directory`` and of every cgroup below it, parents first.

    Each directory is opened relative to its parent's fd, so no path string ever grows with the
    tree's depth (ENAMETOOLONG past ``PATH_MAX`` let a container nest its processes out of
    reach). A parent's fd stays open only while some child of it is still pending.
    """
    try:
        root = os.open(directory, _DIR_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return
    stack: list[_Pending] = [(None, "", root)]
    visited = 0
    try:
        while stack:
            fd = _open_pending(*stack.pop())
            if fd is None:
                continue  # removed during the walk
            visited += 1
            if visited > MAX_CGROUPS_WALKED:
                os.close(fd)
                raise OSError(
                    errno.E2BIG, f"more than {MAX_CGROUPS_WALKED} cgroups below {directory}"
                )
            yield _visit(fd, stack)
    finally:
        for parent, _name, fd in stack:
            if fd is not None:
                os.close(fd)
            elif parent is not None:
                parent.release()


def _open_pending(parent: _DirFd | None, name: str, fd: int | None) -> int | None:
    """The open fd of a pending cgroup (opened relative to its parent's, which is released);
    ``None`` when it was removed meanwhile."""
    if fd is not None:
        return fd
    assert parent is not None
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent.fd)
    except (FileNotFoundError, NotADirectoryError):
        return None
    finally:
        parent.release()


def _visit(fd: int, stack: list[_Pending]) -> str:
    """Read one open cgroup: its ``cgroup.procs`` text; its children are pushed onto
    ``stack`` sharing ``fd``, which is closed here when it has none (or on an error)."""
    try:
        procs, children = _read_cgroup_dir(fd)
    except BaseException:
        os.close(fd)
        raise
    if children:
        shared = _DirFd(fd, len(children))
        stack.extend((shared, child, None) for child in children)
    else:
        os.close(fd)
    return procs


def _read_cgroup_dir(dir_fd: int) -> tuple[str, list[str]]:
    """``cgroup.procs`` of an open cgroup directory and its child cgroups' names (walk order).
    A cgroup removed meanwhile reads as empty."""
    try:
        fd = os.open("cgroup.procs", os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dir_fd)
        try:
            chunks = []
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
        finally:
            os.close(fd)
        with os.scandir(dir_fd) as entries:
            children = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, ProcessLookupError):
        return "", []
    return b"".join(chunks).decode("ascii"), sorted(children, reverse=True)
