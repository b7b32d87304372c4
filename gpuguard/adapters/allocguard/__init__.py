"""The eBPF allocation guard (phase 1: the kernel side and its loader, not wired into the
enforcer): uprobes on one libcuda file's allocation entry points stop, with SIGSTOP, a caller
whose allocation would take its cgroup past the headroom the user side wrote for it.

- ``guard.bpf.c``: the BPF program (CO-RE, compiled by clang ``-target bpf``; the build is
  ``rigs/allocguard.py`` for the tests). The device is always 0 in phase 1: the CUDA context's
  device is not read.
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
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gpuguard.core.freeze import GuardStop
from gpuguard.core.model import ContainerCgroup


class EntryPoint(enum.IntEnum):
    """The allocation entry point a stop happened at (``enum entry_point`` in guard.bpf.c)."""

    MEM_ALLOC = 1
    MEM_CREATE = 2
    MEM_ALLOC_MANAGED = 3
    MEM_ALLOC_PITCH = 4
    MEM_ALLOC_ASYNC = 5


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
    def forget(self, tgid: int, /) -> None: ...
    def close(self) -> None: ...


GUARD_OBJECT = Path(__file__).resolve().parent / "guard.bpf.o"
"""Where setup.py (with ``BPF_TOOLS``) puts the compiled BPF object, beside its source."""


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

    def forget(self, *, tgid: int) -> None:
        """Drop ``tgid``'s freeze record: the enforcer resolved its freeze."""
        self._native.forget(tgid)

    def close(self) -> None:
        """Detach the probes and free the maps."""
        self._native.close()


class BpfAllocationGuard:
    """``gpuguard.ports.AllocationGuard`` over one ``AllocGuard``: container cgroups (as read
    from ``/proc/<pid>/cgroup``, v2) resolved to their ids under ``cgroup_root``."""

    def __init__(self, guard: AllocGuard, *, cgroup_root: Path) -> None:
        self._guard = guard
        self._root = cgroup_root
        self._written: dict[tuple[int, int], int] = {}
        """(cgroup id, device) → headroom, as last written."""

    def write(
        self, budgets: Mapping[tuple[ContainerCgroup, int], int], devices: Collection[int]
    ) -> None:
        wanted: dict[tuple[int, int], int] = {}
        for (cgroup, device), headroom in budgets.items():
            if device not in devices or cgroup.version != 2:
                continue
            try:
                cg = cgroup_id(self._root / cgroup.path.lstrip("/"))
            except FileNotFoundError:
                continue  # the container ended since the listing
            wanted[(cg, device)] = headroom
        for cg, device in [k for k in self._written if k[1] in devices and k not in wanted]:
            self._guard.clear_headroom(cgroup_id=cg, device=device)
            del self._written[(cg, device)]
        for (cg, device), headroom in wanted.items():
            self._guard.set_headroom(cgroup_id=cg, device=device, headroom_bytes=headroom)
            self._guard.reset(cgroup_id=cg, device=device)
            self._written[(cg, device)] = headroom

    def stops(self, timeout_seconds: float) -> list[GuardStop]:
        return [
            GuardStop(
                tgid=e.tgid, cgroup_id=e.cgroup_id, size_bytes=e.size_bytes, device_index=e.device
            )
            for e in self._guard.poll(timeout_ms=max(0, int(timeout_seconds * 1000)))
        ]

    def forget(self, *, tgid: int) -> None:
        self._guard.forget(tgid=tgid)

    def close(self) -> None:
        self._guard.close()


def attach(*, object_path: Path, library_path: Path, cgroup_root: Path) -> BpfAllocationGuard | str:
    """The guard attached to ``library_path``, or why it cannot be (one line)."""
    if not loader_built():
        return "loader_not_built: this image was built without the BPF loader (BPF_TOOLS)"
    if not Path("/sys/kernel/btf/vmlinux").is_file():
        return "no_btf: the kernel exposes no BTF (/sys/kernel/btf/vmlinux)"
    if not object_path.is_file():
        return f"no_object: {object_path} is missing"
    if not library_path.is_file():
        return f"no_library: {library_path} is missing (check enforcement.alloc_guard_library)"
    try:
        guard = AllocGuard(object_path=object_path, library_path=library_path)
    except OSError as exc:
        return f"attach_failed: {exc.strerror or exc} ({library_path})"
    return BpfAllocationGuard(guard, cgroup_root=cgroup_root)


__all__ = [
    "GUARD_OBJECT",
    "AllocGuard",
    "BpfAllocationGuard",
    "EntryPoint",
    "GuardEvent",
    "attach",
    "cgroup_id",
    "loader_built",
]
