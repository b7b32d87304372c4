"""The eBPF allocation guard (phase 1: the kernel side and its loader, not wired into the
enforcer): uprobes on one libcuda file's allocation entry points stop, with SIGSTOP, a caller
whose allocation would take its cgroup past the headroom the user side wrote for it.

- ``guard.bpf.c``: the BPF program (CO-RE, compiled by clang ``-target bpf``; the build is
  ``rigs/allocguard.py`` for the tests). Its header says how an allocation's device is read
  (a context, pool or stream the probes did not see created has none: not counted, never
  stopped), how the CUDA arrays' sizes are approximated, and what a process exit gives back.
- ``_loader.c``: the C extension over libbpf that loads it, attaches the uprobes, writes the
  headroom, resets the count and drains the events (its header says why libbpf and not a Python
  library). Built by setup.py only when ``BPF_TOOLS`` names scripts/ensure-bpf.sh's directory.
- this module: typed values over the extension's tuples.

Must not: decide or signal anything. A cgroup without a headroom entry is never stopped; what
the probe stopped is resumed (SIGCONT) or stopped for good by the enforcer, not here.
"""

from __future__ import annotations

import enum
import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class EntryPoint(enum.IntEnum):
    """The allocation entry point a stop happened at (``enum entry_point`` in guard.bpf.c)."""

    MEM_ALLOC = 1
    MEM_CREATE = 2
    MEM_ALLOC_MANAGED = 3
    MEM_ALLOC_PITCH = 4
    MEM_ALLOC_ASYNC = 5
    MEM_ALLOC_FROM_POOL_ASYNC = 6
    ARRAY_CREATE = 7
    ARRAY_3D_CREATE = 8
    MIPMAPPED_ARRAY_CREATE = 9


@dataclass(frozen=True, slots=True, kw_only=True)
class GuardEvent:
    """One allocation that would have crossed its cgroup's headroom; its caller was stopped."""

    pid: int
    tgid: int
    cgroup_id: int
    size_bytes: int
    allocated_bytes: int
    """The cgroup's count (allocated minus freed since the last reset) before this call."""
    headroom_bytes: int
    entry: EntryPoint | None
    """None: a value this module does not know (a newer BPF object)."""
    device: int


class _NativeGuard(Protocol):
    def set_headroom(self, cgroup_id: int, device: int, headroom_bytes: int, /) -> None: ...
    def clear_headroom(self, cgroup_id: int, device: int, /) -> None: ...
    def reset(self, cgroup_id: int, device: int, /) -> None: ...
    def allocated(self, cgroup_id: int, device: int, /) -> int | None: ...
    def poll(self, timeout_ms: int, /) -> list[tuple[int, int, int, int, int, int, int, int]]: ...
    def map_ids(self) -> dict[str, int]: ...
    def close(self) -> None: ...


def loader_built() -> bool:
    """Whether the C extension was built (setup.py with ``BPF_TOOLS``, or rigs/allocguard.py)."""
    try:
        importlib.import_module("gpuguard.adapters.allocguard._loader")
    except ImportError:
        return False
    return True


def cgroup_id(cgroup_v2_dir: Path) -> int:
    """The id ``bpf_get_current_cgroup_id`` returns for tasks in this cgroup v2 directory: its
    inode number (cgroupfs is kernfs; the id is the kernfs node id)."""
    return os.stat(cgroup_v2_dir).st_ino


def _entry(value: int) -> EntryPoint | None:
    try:
        return EntryPoint(value)
    except ValueError:
        return None


class AllocGuard:
    """One loaded guard, attached to one library file (every process that maps that inode).

    Raises ``OSError`` (libbpf's errno) when the object cannot load or a probe cannot attach:
    no BTF, no permission, a library without the symbols.
    """

    def __init__(self, *, object_path: Path, library_path: Path) -> None:
        loader = importlib.import_module("gpuguard.adapters.allocguard._loader")
        self._native: _NativeGuard = loader.Guard(str(object_path), str(library_path))

    def set_headroom(self, *, cgroup_id: int, device: int, headroom_bytes: int) -> None:
        """Guard the cgroup on the device: an allocation past ``headroom_bytes`` (counted since
        the last ``reset``) stops its caller."""
        self._native.set_headroom(cgroup_id, device, headroom_bytes)

    def clear_headroom(self, *, cgroup_id: int, device: int) -> None:
        """Stop guarding it (absent headroom: never stopped)."""
        self._native.clear_headroom(cgroup_id, device)

    def reset(self, *, cgroup_id: int, device: int) -> None:
        """The count back to 0 (the user side just listed the device's usage)."""
        self._native.reset(cgroup_id, device)

    def allocated_bytes(self, *, cgroup_id: int, device: int) -> int | None:
        """Allocated minus freed since the last reset; None when nothing was counted."""
        return self._native.allocated(cgroup_id, device)

    def poll(self, *, timeout_ms: int) -> list[GuardEvent]:
        """The stops since the last poll, waiting up to ``timeout_ms`` for the first one."""
        return [
            GuardEvent(
                pid=pid,
                tgid=tgid,
                cgroup_id=cg,
                size_bytes=size,
                allocated_bytes=allocated,
                headroom_bytes=headroom,
                entry=_entry(entry),
                device=device,
            )
            for pid, tgid, cg, size, allocated, headroom, entry, device in self._native.poll(
                timeout_ms
            )
        ]

    def map_ids(self) -> dict[str, int]:
        """The kernel's id of each map, by name: what ``BPF_MAP_GET_FD_BY_ID`` would take (it
        needs CAP_SYS_ADMIN; the maps are pinned nowhere, so no other way in)."""
        return self._native.map_ids()

    def close(self) -> None:
        """Detach the probes and free the maps."""
        self._native.close()


__all__ = ["AllocGuard", "EntryPoint", "GuardEvent", "cgroup_id", "loader_built"]
