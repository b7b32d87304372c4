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
- this module: typed values over the extension's tuples, and the thawer's supervision.
- ``thawer.py``: the process that bounds every stop (``freeze_bound_seconds``, 200 ms by
  default) even when the process that loaded the guard crashes or is SIGKILLed. Every stop is
  recorded in the ``frozen`` map before it is made; the thawer resumes a recorded stop once it
  is that old unless the enforcer took it over (``forget``), and every one at once when the
  loading process is gone; then it exits. It is started here with only the ``frozen`` map's fd
  and a pidfd of this process (no probe link: the probes detach when this process dies), and
  restarted here when found dead: each public method checks it first (``waitpid(WNOHANG)``,
  one syscall), so an enforcer that polls every ``P`` ms has a dead thawer back within ``P`` ms
  plus its start (~60 ms); the stops that came due meanwhile are resumed at its first scan.

Must not: decide or signal anything besides the thawer's bound. A cgroup without a headroom
entry is never stopped; what the probe stopped is resumed (SIGCONT) or stopped for good by the
enforcer, or resumed by the thawer at the bound.
"""

from __future__ import annotations

import enum
import errno
import importlib
import os
import select
import subprocess
import sys
import threading
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gpuguard.adapters.cgroup_members import v2_dir, v2_root
from gpuguard.core.freeze import GuardStop
from gpuguard.core.model import ContainerCgroup


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
    def forget(self, tgid: int, /) -> int: ...
    def map_ids(self) -> dict[str, int]: ...
    def close(self) -> None: ...
    @property
    def frozen_fd(self) -> int: ...


FREEZE_BOUND_SECONDS = 0.2
"""The longest a stop made by the guard lasts unless the enforcer takes it over (``forget``):
the thawer resumes it then. Long enough for the enforcer to list the device and decide (one
NVML listing, ~10 ms), short enough that a wrongly stopped process barely notices."""

THAWER_START_SECONDS = 5.0
"""How long the guard waits for a (re)started thawer to say it runs; past it ``OSError``."""

_PACKAGE_ROOT = Path(__file__).resolve().parents[3]
"""The directory ``gpuguard`` is imported from here: the thawer runs the same copy."""


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
    no BTF, no permission, a library without the symbols; or when the thawer does not start
    (then nothing stays loaded: no stop without its bound).
    """

    def __init__(
        self,
        *,
        object_path: Path,
        library_path: Path,
        freeze_bound_seconds: float = FREEZE_BOUND_SECONDS,
        thawer_stderr: int | None = None,
    ) -> None:
        if not 0.01 <= freeze_bound_seconds <= 3600:
            raise ValueError("freeze_bound_seconds must be 0.01..3600")
        self._bound_ns = round(freeze_bound_seconds * 1e9)
        self._thawer_stderr = thawer_stderr
        """Where the thawer's JSON log lines go (an fd); None: this process's stderr."""
        self.thawer_restarts = 0
        """How many times the thawer was found dead and started again."""
        self._thawer_lock = threading.Lock()  # the guard's methods run on worker threads
        loader = importlib.import_module("gpuguard.adapters.allocguard._loader")
        self._native: _NativeGuard = loader.Guard(str(object_path), str(library_path))
        self._thawer: subprocess.Popen[bytes] | None = None
        try:
            self._thawer = self._start_thawer()
        except BaseException:
            self._native.close()
            raise

    @property
    def thawer_pid(self) -> int | None:
        """The thawer's pid (None once closed)."""
        return None if self._thawer is None else self._thawer.pid

    @property
    def frozen_fd(self) -> int:
        """The ``frozen`` map's fd (the thawer's; close-on-exec, owned by this guard)."""
        return self._native.frozen_fd

    def _start_thawer(self) -> subprocess.Popen[bytes]:
        """The thawer, started with the ``frozen`` map's fd and this process's pidfd only (both
        close-on-exec here; ``pass_fds`` makes exactly these two inheritable in the child), once
        it has written its ready byte."""
        frozen_fd = self._native.frozen_fd
        enforcer_pidfd = os.pidfd_open(os.getpid())
        try:
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p
            )
            thawer = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gpuguard.adapters.allocguard.thawer",
                    "--frozen-fd",
                    str(frozen_fd),
                    "--enforcer-pidfd",
                    str(enforcer_pidfd),
                    "--enforcer-pid",
                    str(os.getpid()),
                    "--bound-ns",
                    str(self._bound_ns),
                ],
                pass_fds=(frozen_fd, enforcer_pidfd),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=self._thawer_stderr,
                env=env,
                # Its own session: a terminal's SIGINT or SIGHUP to the enforcer's group does
                # not end it before the stops it bounds.
                start_new_session=True,
            )
        finally:
            os.close(enforcer_pidfd)
        assert thawer.stdout is not None
        try:
            poller = select.poll()
            poller.register(thawer.stdout, select.POLLIN)
            ready = poller.poll(round(THAWER_START_SECONDS * 1000)) and thawer.stdout.read(1)
        finally:
            thawer.stdout.close()
        if ready != b"r":
            thawer.kill()
            thawer.wait()
            raise OSError(errno.ECHILD, "the allocation guard's thawer did not start")
        return thawer

    def _check_thawer(self) -> None:
        """Start the thawer again if it died (it is this process's child: reaped here)."""
        with self._thawer_lock:
            if self._thawer is not None and self._thawer.poll() is not None:
                self._thawer = self._start_thawer()
                self.thawer_restarts += 1

    def forget(self, *, tgid: int) -> None:
        """The enforcer took over the stops recorded for ``tgid`` so far (it resumes them or
        stops the process for good): the thawer leaves them alone while this process lives.
        Stops made after this call are bounded again; if this process dies first, the thawer
        resumes these too (a process the enforcer meant to kill but did not is not left
        stopped)."""
        self._check_thawer()
        self._native.forget(tgid)

    def set_headroom(self, *, cgroup_id: int, device: int, headroom_bytes: int) -> None:
        """Guard the cgroup on the device: an allocation past ``headroom_bytes`` (counted since
        the last ``reset``) stops its caller."""
        self._check_thawer()
        self._native.set_headroom(cgroup_id, device, headroom_bytes)

    def clear_headroom(self, *, cgroup_id: int, device: int) -> None:
        """Stop guarding it (absent headroom: never stopped)."""
        self._check_thawer()
        self._native.clear_headroom(cgroup_id, device)

    def reset(self, *, cgroup_id: int, device: int) -> None:
        """The count back to 0 (the user side just listed the device's usage)."""
        self._check_thawer()
        self._native.reset(cgroup_id, device)

    def allocated_bytes(self, *, cgroup_id: int, device: int) -> int | None:
        """Allocated minus freed since the last reset; None when nothing was counted."""
        self._check_thawer()
        return self._native.allocated(cgroup_id, device)

    def poll(self, *, timeout_ms: int) -> list[GuardEvent]:
        """The stops since the last poll, waiting up to ``timeout_ms`` for the first one."""
        self._check_thawer()
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
        """Detach the probes and free the maps; the thawer resumes every recorded stop (the
        forgotten ones too: close after the kills in flight) and exits."""
        self._native.close()
        with self._thawer_lock:
            thawer, self._thawer = self._thawer, None
        if thawer is not None and thawer.poll() is None:
            thawer.terminate()
            try:
                thawer.wait(THAWER_START_SECONDS)
            except subprocess.TimeoutExpired:
                thawer.kill()
                thawer.wait()


class BpfAllocationGuard:
    """``gpuguard.ports.AllocationGuard`` over one ``AllocGuard``: container cgroups (as read
    from ``/proc/<pid>/cgroup``, v2) resolved to their ids under the v2 mount of
    ``cgroup_root`` (``<cgroup_root>/unified`` on a hybrid host, as the killer resolves them).
    A path this mount cannot resolve (``..``: another cgroup namespace's view) is never given
    headroom: joined as it is, it could name another cgroup, the root's included."""

    def __init__(self, guard: AllocGuard, *, cgroup_root: Path) -> None:
        self._guard = guard
        self._root = v2_root(cgroup_root)
        self._written: dict[tuple[int, int], int] = {}
        """(cgroup id, device) → headroom, as last written."""

    def write(
        self, budgets: Mapping[tuple[ContainerCgroup, int], int], devices: Collection[int]
    ) -> None:
        wanted: dict[tuple[int, int], int] = {}
        for (cgroup, device), headroom in budgets.items():
            if device not in devices or cgroup.version != 2:
                continue
            directory = v2_dir(self._root, cgroup.path)
            if directory is None:
                continue
            try:
                cg = cgroup_id(directory)
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
