"""procfs: reads ``<proc_root>/<pid>/stat`` and ``<proc_root>/<pid>/cgroup`` (and, for the
killer only, ``status``); nothing else.

Owns host PID → identity, name and cgroup lines, the ``status`` text the killer reads before a
signal, and ``ProcfsProcessResolver`` (host PID → pod attribution, via ``gpuguard.core.cgroup``;
it reads ``stat`` and ``cgroup`` only, and may keep a pidfd of a process it attributed to tell
whether that process still holds its PID). Must never open ``root``, ``cwd``, ``environ``,
``cmdline``, ``maps`` or anything inside a container's filesystem, never follow a symlink a
container controls (the optional GPU check only ``readlink``s ``fd/*``), and never signal
anything (docs/reliability.md S7).

A ``<proc_root>`` may be a tree someone else wrote (``explain --proc-root``): a symlink at
``<pid>`` or at the file is never followed, a FIFO never waited on, and a file is read whole up
to ``READ_LIMIT_BYTES`` or reported unreadable, never truncated. Each becomes a reason on an
unknown attribution (no identity: nothing is charged or signalled), never an exception.
"""

from __future__ import annotations

import errno
import os
import re
import resource
import select
import stat
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path

from gpuguard.core.cgroup import CgroupParse, parse_cgroup
from gpuguard.core.model import Attribution, ProcessIdentity

PID_MAX_LIMIT = 4_194_304
"""The largest PID Linux can hand out (``PID_MAX_LIMIT``, ``include/linux/threads.h``: 2**22 on
64-bit; ``/proc/sys/kernel/pid_max`` is at most this). A larger number is never a process."""

READ_LIMIT_BYTES = 1 << 20
"""The largest ``stat`` or ``cgroup`` file read. Real ones are far smaller (``stat`` < 1 KiB,
``cgroup`` one line per v1 hierarchy); a larger one is reported unreadable (attribution unknown),
never cut short: the pod's line may be the last one, and a prefix could name another cgroup."""

_CHUNK_BYTES = 65536
_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
"""``O_NOFOLLOW``: a symlink in a ``--proc-root`` tree (``cgroup -> /etc/shadow``) is an error,
never followed; ``O_NONBLOCK``: opening a FIFO does not wait for a writer (it is then rejected as
not a regular file). The real ``/proc`` has neither; its files are regular, of size 0."""


def _open_pid_dir(proc_root: Path, pid: int) -> int | None:
    """An ``O_PATH`` descriptor of ``<proc_root>/<pid>`` (nothing is read through it), or
    ``None`` if there is no such directory. A symlink there is an error, never followed."""
    path = f"{proc_root}/{pid}"
    try:
        return os.open(path, _DIR_FLAGS)
    except (FileNotFoundError, ProcessLookupError):
        return None
    except NotADirectoryError:
        # O_PATH | O_NOFOLLOW on a symlink yields ENOTDIR with O_DIRECTORY; tell it apart from
        # a plain file (no process) only on this rare path, so the common one stays one call.
        if os.path.islink(path):
            raise OSError(errno.ELOOP, f"{pid} is a symbolic link (not followed)") from None
        return None


def _read_at(dir_fd: int, name: str) -> bytes | None:
    """The whole of the regular file ``name`` in ``dir_fd``; ``None`` if the process is gone.

    Raises ``OSError`` for anything else: a symlink, a FIFO, a device or a directory, or more
    than ``READ_LIMIT_BYTES``. Reads until EOF (``/proc`` files report size 0)."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, f"{name} is a symbolic link (not followed)") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{name} is not a regular file")
        data = os.read(fd, _CHUNK_BYTES)
        if not data:
            return data
        more = os.read(fd, _CHUNK_BYTES)
        if not more:  # the common case: the whole file in one read, EOF on the second
            return data
        chunks, size = [data, more], len(data) + len(more)
        while more:
            if size > READ_LIMIT_BYTES:
                raise OSError(
                    errno.EFBIG, f"{name} is larger than {READ_LIMIT_BYTES} bytes (not read)"
                )
            more = os.read(fd, _CHUNK_BYTES)
            chunks.append(more)
            size += len(more)
        return b"".join(chunks)
    except ProcessLookupError:  # ESRCH: exited between open and read
        return None
    finally:
        os.close(fd)


def _read(proc_root: Path, pid: int, name: str) -> bytes | None:
    """``<proc_root>/<pid>/<name>`` whole, or ``None`` if the PID is gone (see ``_read_at``).

    ``str`` paths and plain ``os`` calls: this runs for every GPU process every poll, and
    pathlib costs more than the read itself."""
    dir_fd = _open_pid_dir(proc_root, pid)
    if dir_fd is None:
        return None
    try:
        return _read_at(dir_fd, name)
    finally:
        os.close(dir_fd)


def _stat_fields(raw: bytes) -> list[bytes] | None:
    """Fields 3… of a ``stat`` text. ``comm`` (field 2) may contain spaces and ``)``, so split
    after the *last* ``)`` (proc(5))."""
    end = raw.rfind(b")")
    return raw[end + 2 :].split() if end >= 0 else None


def _start_ticks(raw: bytes) -> int | None:
    """``starttime`` (field 22) of a ``stat`` text; ``None`` if it cannot be parsed."""
    fields = _stat_fields(raw)
    # After ")": field 3 (state) is fields[0], so field 22 (starttime) is fields[19].
    if fields is None or len(fields) < 20:
        return None
    try:
        return int(fields[19])
    except ValueError:
        return None


def read_start_ticks(proc_root: Path, pid: int) -> int | None:
    """``starttime`` (field 22) of ``<proc_root>/<pid>/stat``; ``None`` if the PID is gone or
    its ``stat`` is unparsable."""
    raw = _read(proc_root, pid, "stat")
    return None if raw is None else _start_ticks(raw)


_EXITED_STATES = frozenset({"Z", "X"})
"""``/proc/<pid>/stat`` states of a process that has exited but is not yet reaped."""


def read_state(proc_root: Path, pid: int) -> str | None:
    """``state`` (field 3) of ``<proc_root>/<pid>/stat``: R S D Z T t X …; ``None`` if gone."""
    raw = _read(proc_root, pid, "stat")
    fields = None if raw is None else _stat_fields(raw)
    return fields[0].decode("ascii", "replace") if fields else None


def read_identity(proc_root: Path, pid: int) -> ProcessIdentity | None:
    """The process's ``(pid, starttime)``, or ``None`` if it is not in ``/proc``."""
    start = read_start_ticks(proc_root, pid)
    return None if start is None else ProcessIdentity(pid=pid, start_ticks=start)


def read_process_name(proc_root: Path, identity: ProcessIdentity) -> str | None:
    """The name (``comm``, field 2 of ``stat``: at most 15 bytes, set by the process itself) of
    the process ``identity``; ``None`` if its PID is gone, now another process's (reused), or
    its ``stat`` cannot be read. For display only: never a basis for attribution or a signal.

    Read from ``stat`` like the identity (never ``cmdline``: its read takes the target's
    memory lock and can hang on a stuck process) and checked against it in the same read, so a
    reused PID never lends its new occupant's name."""
    try:
        raw = _read(proc_root, identity.pid, "stat")
    except OSError:
        return None
    if raw is None or _start_ticks(raw) != identity.start_ticks:
        return None
    # "pid (comm) state …": comm may itself contain spaces and ")", so up to the *last* ")".
    start = raw.find(b"(")
    return None if start < 0 else raw[start + 1 : raw.rfind(b")")].decode("utf-8", "replace")


def read_cgroup_text(proc_root: Path, pid: int) -> str | None:
    """The text of ``<proc_root>/<pid>/cgroup``, or ``None`` if the PID is gone. Raises
    ``OSError`` when it cannot be read whole (see ``_read_at``)."""
    raw = _read(proc_root, pid, "cgroup")
    return None if raw is None else raw.decode("utf-8", errors="replace")


def read_status_text(proc_root: Path, pid: int) -> str | None:
    """The text of ``<proc_root>/<pid>/status``, or ``None`` if the PID (or, in a tree someone
    wrote, the file) is gone. Raises ``OSError`` when it cannot be read whole (see ``_read_at``).

    Read by the killer only, after a member's pidfd was opened and its identity re-verified:
    its ``NSpid`` line and signal masks say whether a SIGTERM would reach it. Like
    ``stat``, and unlike ``cmdline``, it is rendered without the target's memory lock, and
    every user may read it (no ptrace access is needed)."""
    raw = _read(proc_root, pid, "status")
    return None if raw is None else raw.decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------
# Attribution


GHOST_REASON = "not in /proc"
"""Reason for a PID with no ``/proc`` entry (NVML ghost, or it exited)."""
REUSED_REASON = "PID changed identity while its cgroup was read"
STAT_UNPARSABLE_REASON = "/proc/<pid>/stat is unparsable (no starttime field)"
"""Reason for a PID whose ``stat`` exists but has no readable ``starttime``: its identity is
unknown, so nothing is attributed to it (it is not "not in /proc")."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Reading:
    """One pass over ``<proc_root>/<pid>``: the identity from ``stat``, then ``cgroup`` and
    ``stat`` again (``None``: gone meanwhile)."""

    identity: ProcessIdentity
    cgroup: bytes | None
    stat_after: bytes | None


@dataclass(slots=True, kw_only=True)
class _Pin:
    """A pinned process: its pidfd, its attribution, when it was last asked for (monotonic)."""

    pidfd: int
    attribution: Attribution
    asked: float


PIN_KEPT_SECONDS = 60.0
"""A pin asked for within this long is not closed to make room for a new one: the new process
goes unpinned instead. Closing the least recently asked pin regardless made a node listing more
processes than the pin limit close and reopen a pin at every ask (a scan in the order of the
last one always asks for the pin just closed), costing more than no pins."""


class _Pins:
    """The pinned processes, by PID: at most ``limit``, each pidfd watched by one epoll.

    Owns the pidfds: every ask first takes the pidfds that became readable (their process
    exited) off the epoll and closes them, so a pin answers only for a process that had not
    exited at the ask, and an exited process's pidfd is closed at the next ask, not kept until
    it is the least recently asked."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._by_pid: OrderedDict[int, _Pin] = OrderedDict()
        self._pid_of: dict[int, int] = {}
        self._exits = select.epoll() if limit else None

    def __len__(self) -> int:
        return len(self._by_pid)

    def answer(self, pid: int) -> Attribution | None:
        """The attribution pinned for ``pid`` if its process has not exited, else ``None``."""
        if not self._by_pid:
            return None
        self._close_exited()
        pin = self._by_pid.get(pid)
        if pin is None:
            return None
        pin.asked = time.monotonic()
        self._by_pid.move_to_end(pid)
        return pin.attribution

    def has_room(self) -> bool:
        """A new pin can be kept: fewer than ``limit``, or the least recently asked pin has not
        been asked for in ``PIN_KEPT_SECONDS`` (it is closed to make room)."""
        if not self.limit:
            return False
        if len(self._by_pid) < self.limit:
            return True
        oldest_pid, oldest = next(iter(self._by_pid.items()))
        if time.monotonic() - oldest.asked < PIN_KEPT_SECONDS:
            return False
        self._close(oldest_pid)
        return True

    def keep(self, pid: int, pidfd: int, attribution: Attribution) -> None:
        """Pin ``pidfd`` (opened before ``attribution`` was read) for ``pid``. If the process
        exited before this, the next :meth:`answer` closes the pin before it answers."""
        assert self._exits is not None  # has_room() said so
        if pid in self._by_pid:
            self._close(pid)
        self._exits.register(pidfd, select.EPOLLIN)
        self._by_pid[pid] = _Pin(pidfd=pidfd, attribution=attribution, asked=time.monotonic())
        self._pid_of[pidfd] = pid
        while len(self._by_pid) > self.limit:
            self._close(next(iter(self._by_pid)))

    def close(self) -> None:
        """Close every pidfd and the epoll (idempotent)."""
        for pid in list(self._by_pid):
            self._close(pid)
        if self._exits is not None:
            self._exits.close()
            self._exits = None
            self.limit = 0

    def _close_exited(self) -> None:
        assert self._exits is not None  # pins exist
        for pidfd, _events in self._exits.poll(0, len(self._by_pid)):
            self._close(self._pid_of[pidfd])

    def _close(self, pid: int) -> None:
        pin = self._by_pid.pop(pid)
        del self._pid_of[pin.pidfd]
        os.close(pin.pidfd)  # also takes it off the epoll


def same_pid_namespace(proc_root: Path) -> bool:
    """``<proc_root>`` is a ``/proc`` of this process's PID namespace (its ``self`` names this
    process), so a pidfd of PID N is the process ``<proc_root>/N`` shows."""
    try:
        return os.readlink(f"{proc_root}/self") == str(os.getpid())
    except OSError:
        return False


def _pin_limit(cache_size: int) -> int:
    """Pins at most: the cache size, and a quarter of the open-file limit."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return cache_size
    return max(0, min(cache_size, soft // 4))


def _pidfd_open(pid: int) -> int | None:
    """A pidfd of ``pid``, or ``None`` (gone, or pidfds unavailable: nothing is pinned)."""
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


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
        pin_processes: bool = False,
    ) -> None:
        self._proc_root = proc_root
        self._cache_size = cache_size
        self._check_gpu_fds = check_gpu_fds
        self._cache: OrderedDict[ProcessIdentity, Attribution] = OrderedDict()
        self._gpu_holders: OrderedDict[ProcessIdentity, None] = OrderedDict()
        # A pidfd names the process of this PID namespace: pin only where <proc_root> shows it.
        pinning = pin_processes and same_pid_namespace(proc_root)
        self._pins = _Pins(_pin_limit(cache_size) if pinning else 0)

    @property
    def pinned(self) -> int:
        """How many processes are pinned (a pidfd held open: see :meth:`attribute`)."""
        return len(self._pins)

    def attribute(self, pid: int) -> Attribution:
        """Blocking. Never raises for a missing or unreadable PID: returns a reason instead.

        With ``pin_processes`` (only where ``<proc_root>`` is this PID namespace's ``/proc``):
        a process whose attribution is final (an identity and, with ``check_gpu_fds``, the GPU
        open) is pinned: its pidfd, opened before its ``stat`` was read, stays open while its
        process runs. The next ask costs one ``epoll_wait`` over every pin (closing those whose
        process exited, zombies included) instead of three ``/proc`` reads: a pin still open
        means its process has not exited, so it still holds the PID (a PID is reused only after
        its process is gone) and its attribution is the one cached by its identity. At most
        ``min(cache_size, RLIMIT_NOFILE / 4)`` pins; when full, the least recently asked is
        closed to make room only if it was not asked for in ``PIN_KEPT_SECONDS``."""
        pinned = self._pins.answer(pid)
        if pinned is not None:
            return pinned
        if not self._pins.has_room():
            return self._attribute_fresh(pid)
        pidfd = _pidfd_open(pid)
        result = self._attribute_fresh(pid)
        if pidfd is not None:
            if self._is_final(pid, result):
                self._pins.keep(pid, pidfd, result)
            else:
                os.close(pidfd)
        return result

    def close(self) -> None:
        """Close every pin's pidfd (idempotent)."""
        self._pins.close()

    def _is_final(self, pid: int, result: Attribution) -> bool:
        """``result`` may be pinned: an identity of ``pid`` and, where the GPU is checked, the
        GPU seen open (``False`` may turn ``True`` later: read again every time)."""
        if result.identity is None or result.identity.pid != pid:
            return False
        return not self._check_gpu_fds or result.holds_gpu is True

    def _attribute_fresh(self, pid: int) -> Attribution:
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

    def _attribute_uncached(self, pid: int) -> Attribution:
        for _attempt in range(2):
            try:
                reading = self._read_once(pid)
            except OSError as exc:
                return _unreadable(pid, exc)
            if isinstance(reading, Attribution):
                return reading
            result = self._attribute_reading(reading)
            if result is not None:
                return result
        return Attribution.unknown(pid, REUSED_REASON)

    def _read_once(self, pid: int) -> Attribution | _Reading:
        """``stat``, ``cgroup`` and ``stat`` again through one directory descriptor: on the
        real /proc it pins the process that held the number when it was opened, so all three
        come from that one process (a reused PID reads as gone); a retry opens the new one.
        An ``Attribution`` when the answer is known already (gone, unparsable, cached)."""
        dir_fd = _open_pid_dir(self._proc_root, pid)
        if dir_fd is None:
            return Attribution.unknown(pid, GHOST_REASON)
        try:
            raw = _read_at(dir_fd, "stat")
            if raw is None:
                return Attribution.unknown(pid, GHOST_REASON)
            before = _start_ticks(raw)
            if before is None:
                return Attribution.unknown(pid, STAT_UNPARSABLE_REASON)
            identity = ProcessIdentity(pid=pid, start_ticks=before)
            cached = self._cache.get(identity)
            if cached is not None:
                self._cache.move_to_end(identity)
                return cached
            cgroup = _read_at(dir_fd, "cgroup")
            return _Reading(identity=identity, cgroup=cgroup, stat_after=_read_at(dir_fd, "stat"))
        finally:
            os.close(dir_fd)

    def _attribute_reading(self, reading: _Reading) -> Attribution | None:
        """The attribution of one read, cached; ``None`` when the PID changed identity while
        its cgroup was read (retry)."""
        pid = reading.identity.pid
        if reading.cgroup is None or reading.stat_after is None:
            return Attribution.unknown(pid, GHOST_REASON)
        after = _start_ticks(reading.stat_after)
        if after is None:
            return Attribution.unknown(pid, STAT_UNPARSABLE_REASON)
        if after != reading.identity.start_ticks:
            return None
        text = reading.cgroup.decode("utf-8", errors="replace")
        result = _attribution(reading.identity, parse_cgroup(text))
        self._cache[reading.identity] = result
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return result

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
        except OSError:  # gone, or EACCES: another user's (signals.PrivilegeCheck)
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


def _unreadable(pid: int, exc: OSError) -> Attribution:
    """An OS error reading ``/proc/<pid>`` as a reason: attribution unknown, never a guess."""
    if isinstance(exc, PermissionError):
        return Attribution.unknown(pid, f"permission denied reading /proc/{pid}: {exc.strerror}")
    return Attribution.unknown(pid, f"cannot read /proc/{pid}: {exc.strerror or exc}")


_CLOCK_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")
"""``starttime``'s unit (``USER_HZ``, 100 on Linux)."""


def started_at(identity: ProcessIdentity) -> float:
    """When the process ``identity`` started, on ``time.monotonic()``'s clock.

    ``starttime`` counts clock ticks since boot on ``CLOCK_BOOTTIME`` (which, unlike
    ``CLOCK_MONOTONIC``, also runs while the machine is suspended; proc(5)); both are read in
    the reader's time namespace. Truncated to a tick, so never later than the true start."""
    offset = time.clock_gettime(time.CLOCK_BOOTTIME) - time.monotonic()
    return identity.start_ticks / _CLOCK_TICKS_PER_SECOND - offset


def _attribution(identity: ProcessIdentity, parsed: CgroupParse) -> Attribution:
    return Attribution(
        pid=identity.pid,
        identity=identity,
        started_at=started_at(identity),
        pod_uid=parsed.pod_uid,
        container_id=parsed.container_id,
        runtime=parsed.runtime,
        cgroup=parsed.cgroup,
        cgroup_version=parsed.cgroup_version,
        # model.Attribution.reason is only for non-pod processes.
        reason=None if parsed.is_pod else parsed.reason,
    )
