"""procfs: reads ``<proc_root>/<pid>/stat`` and ``<proc_root>/<pid>/cgroup``; nothing else.

Owns host PID → identity and cgroup lines, and ``ProcfsProcessResolver`` (host PID → pod
attribution, via ``gpuguard.core.cgroup``). Must never open ``root``, ``cwd``, ``environ``,
``cmdline``, ``maps`` or anything inside a container's filesystem, never follow a symlink a
container controls (the optional GPU check only ``readlink``s ``fd/*``), and never signal
anything (reliability matrix S7).
"""

from __future__ import annotations

import os
import re
import stat
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

from gpuguard.core.cgroup import CgroupParse, parse_cgroup
from gpuguard.core.model import Attribution, ProcessIdentity


def _read(path: str) -> bytes | None:
    """A small /proc file's bytes, or ``None`` if the PID is gone. (``str`` paths and one
    ``os.read``: this runs for every GPU process every poll, and pathlib costs more than the
    read itself.)"""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None
    try:
        return os.read(fd, 65536)
    except ProcessLookupError:  # ESRCH: exited between open and read
        return None
    finally:
        os.close(fd)


def _stat_fields(proc_root: Path, pid: int) -> list[bytes] | None:
    """Fields 3… of ``<proc_root>/<pid>/stat``. ``comm`` (field 2) may contain spaces and
    ``)``, so split after the *last* ``)`` (proc(5))."""
    raw = _read(f"{proc_root}/{pid}/stat")
    if raw is None:
        return None
    end = raw.rfind(b")")
    return raw[end + 2 :].split() if end >= 0 else None


def read_start_ticks(proc_root: Path, pid: int) -> int | None:
    """``starttime`` (field 22) of ``<proc_root>/<pid>/stat``; ``None`` if the PID is gone."""
    fields = _stat_fields(proc_root, pid)
    # After ")": field 3 (state) is fields[0], so field 22 (starttime) is fields[19].
    if fields is None or len(fields) < 20:
        return None
    try:
        return int(fields[19])
    except ValueError:
        return None


_EXITED_STATES = frozenset({"Z", "X"})
"""``/proc/<pid>/stat`` states of a process that has exited but is not yet reaped."""


def read_state(proc_root: Path, pid: int) -> str | None:
    """``state`` (field 3) of ``<proc_root>/<pid>/stat``: R S D Z T t X …; ``None`` if gone."""
    fields = _stat_fields(proc_root, pid)
    return fields[0].decode("ascii", "replace") if fields else None


def read_identity(proc_root: Path, pid: int) -> ProcessIdentity | None:
    """The process's ``(pid, starttime)``, or ``None`` if it is not in ``/proc``."""
    start = read_start_ticks(proc_root, pid)
    return None if start is None else ProcessIdentity(pid=pid, start_ticks=start)


def read_cgroup_text(proc_root: Path, pid: int) -> str | None:
    """The text of ``<proc_root>/<pid>/cgroup``, or ``None`` if the PID is gone."""
    raw = _read(f"{proc_root}/{pid}/cgroup")
    return None if raw is None else raw.decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------
# Attribution


GHOST_REASON = "not in /proc"
"""Reason for a PID with no ``/proc`` entry (NVML ghost, or it exited)."""
REUSED_REASON = "PID changed identity while its cgroup was read"


class ProcfsProcessResolver:
    """``ProcessResolver`` over ``<proc_root>``: host PID → pod, container and cgroup.

    Reads ``stat`` before and after ``cgroup`` and requires the same ``starttime``, so the
    cgroup text is known to belong to the identity returned (a PID reused mid-read is retried
    once, then reported). Results are cached by identity ``(pid, starttime)``, never by PID
    alone, so a reused PID always gets a fresh attribution; the cache is bounded (LRU).
    Permission and other OS errors become a reason, never an exception.

    ``check_gpu_fds``: also fill ``Attribution.holds_gpu`` from the *names* of the process's
    open files (``readlink`` of ``<proc_root>/<pid>/fd/*``; nothing is opened or followed). It
    is read on every call, never cached: a process can open the GPU after it was first seen.

    Not thread-safe: the runtime calls it from one worker thread at a time.
    """

    def __init__(
        self,
        proc_root: Path = Path("/proc"),
        *,
        cache_size: int = 4096,
        check_gpu_fds: bool = False,
    ) -> None:
        self._proc_root = proc_root
        self._cache_size = cache_size
        self._check_gpu_fds = check_gpu_fds
        self._cache: OrderedDict[ProcessIdentity, Attribution] = OrderedDict()
        self._gpu_holders: OrderedDict[ProcessIdentity, None] = OrderedDict()

    def attribute(self, pid: int) -> Attribution:
        """Blocking. Never raises for a missing or unreadable PID: returns a reason instead."""
        result = self._attribute_uncached(pid)
        if self._check_gpu_fds and result.identity is not None:
            result = replace(result, holds_gpu=self._holds_gpu_cached(result.identity))
        return result

    def _holds_gpu_cached(self, identity: ProcessIdentity) -> bool | None:
        """``_holds_gpu``, remembering ``True`` per identity: a process that had the GPU open
        is the owner of what NVML lists under its PID for as long as it is that process (a
        CUDA process has hundreds of fds: scanning them every poll cost ~1 ms each on the
        H200). ``False``/``None`` are never remembered: the process may open the GPU later."""
        if identity in self._gpu_holders:
            self._gpu_holders.move_to_end(identity)
            return True
        holds = self._holds_gpu(identity.pid)
        if holds:
            self._gpu_holders[identity] = None
            if len(self._gpu_holders) > self._cache_size:
                self._gpu_holders.popitem(last=False)
        return holds

    def cache_len(self) -> int:
        """Number of cached identities (for tests and metrics)."""
        return len(self._cache)

    def _attribute_uncached(self, pid: int) -> Attribution:
        last_reason = GHOST_REASON
        for _attempt in range(2):
            try:
                before = read_start_ticks(self._proc_root, pid)
                if before is None:
                    return Attribution.unknown(pid, GHOST_REASON)
                identity = ProcessIdentity(pid=pid, start_ticks=before)
                cached = self._cache.get(identity)
                if cached is not None:
                    self._cache.move_to_end(identity)
                    return cached
                text = read_cgroup_text(self._proc_root, pid)
                after = read_start_ticks(self._proc_root, pid)
            except PermissionError as exc:
                return Attribution.unknown(
                    pid, f"permission denied reading /proc/{pid}: {exc.strerror}"
                )
            except OSError as exc:
                return Attribution.unknown(pid, f"cannot read /proc/{pid}: {exc.strerror or exc}")
            if text is None or after is None:
                return Attribution.unknown(pid, GHOST_REASON)
            if after != before:
                last_reason = REUSED_REASON
                continue
            result = _attribution(identity, parse_cgroup(text))
            self._cache[identity] = result
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return result
        return Attribution.unknown(pid, last_reason)

    def _holds_gpu(self, pid: int) -> bool | None:
        """Whether one of the process's open files is an NVIDIA GPU device node.

        ``stat`` of ``fd/N`` (the kernel's magic link to the open file: nothing is opened, and
        it works across mount namespaces, where the link's *text* is the path inside the
        container, e.g. ``/nvidia0``) gives the device number: NVIDIA's char major 195, minors
        0-253 are GPUs (254 ``nvidia-modeset``, 255 ``nvidiactl``; open-gpu-kernel-modules
        ``NV_MAJOR_DEVICE_NUMBER``). When ``stat`` finds nothing (a fixture tree's dangling
        link) the link text is matched instead. ``None`` when the answer could be wrong because
        something was unreadable.
        """
        fd_dir = f"{self._proc_root}/{pid}/fd"
        try:
            names = os.listdir(fd_dir)
        except OSError:  # gone, or EACCES without CAP_SYS_PTRACE
            return None
        unsure = False
        for name in names:
            link = f"{fd_dir}/{name}"
            try:
                st = os.stat(link)
            except FileNotFoundError:  # closed meanwhile, or a dangling fixture link
                pass
            except OSError:
                unsure = True
                continue
            else:
                if stat.S_ISCHR(st.st_mode) and _is_nvidia_gpu(st.st_rdev):
                    return True
                continue
            try:
                target = os.readlink(link)
            except FileNotFoundError:
                continue
            except OSError:
                unsure = True
                continue
            if _NVIDIA_GPU_NAME.search(target):
                return True
        if unsure or read_state(self._proc_root, pid) in _EXITED_STATES:
            # A zombie's fd table is already empty, yet NVML still lists it while a forked
            # child holds its CUDA context (measured on an H200, docs/gpu-e2e.md): "holds no
            # GPU" would be a wrong answer that hides the pod's memory. Unknown is right.
            return None
        return False


_NVIDIA_MAJOR = 195
_NVIDIA_GPU_NAME = re.compile(r"(?:^|/)nvidia[0-9]+\Z")


def _is_nvidia_gpu(rdev: int) -> bool:
    return os.major(rdev) == _NVIDIA_MAJOR and os.minor(rdev) < 254


def _attribution(identity: ProcessIdentity, parsed: CgroupParse) -> Attribution:
    return Attribution(
        pid=identity.pid,
        identity=identity,
        pod_uid=parsed.pod_uid,
        container_id=parsed.container_id,
        runtime=parsed.runtime,
        cgroup=parsed.cgroup,
        cgroup_version=parsed.cgroup_version,
        # model.Attribution.reason is only for non-pod processes.
        reason=None if parsed.is_pod else parsed.reason,
    )
