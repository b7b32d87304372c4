"""procfs: reads ``<proc_root>/<pid>/stat`` and ``<proc_root>/<pid>/cgroup`` (and, for the
killer only, ``status``; for the GPU check, the links of every task's ``fd/``); nothing else.

Owns host PID → identity, name and cgroup lines, the ``status`` text the killer reads before a
signal, and ``ProcfsProcessResolver`` (host PID → pod attribution, via ``gpuguard.core.cgroup``;
it reads ``stat`` and ``cgroup`` only, and may keep a pidfd of a process it attributed to tell
whether that process still holds its PID). Must never open ``root``, ``cwd``, ``environ``,
``cmdline``, ``maps`` or anything inside a container's filesystem, never follow a symlink a
container controls, and never signal anything (docs/reliability.md S7).

The optional GPU check reads the process's open files without opening or following any of
them: ``readlink`` of ``fd/N`` (the kernel's ``d_path`` of the open file: no call into the
file's filesystem) in the leader's table and each task's (``task/<tid>/fd``: a thread that
unshared its file table keeps its own), and for a path-named file ``statx`` with
``AT_STATX_DONT_SYNC`` (the attributes its filesystem has cached: a FUSE or NFS file is
answered without asking its server, so a tenant's stopped FUSE daemon cannot make it wait).
A pipe, socket or anonymous inode is never a device and is not looked at further.

Every read of one PID's files runs on a helper thread under a deadline
(``PROBE_DEADLINE_SECONDS``; ``adapters/bounded_reads.py``, which the killer uses too): a tenant
can make them block (its ``exec`` stuck in a FUSE flush blocks ``stat`` and the ``fd`` links of
that process, measured on Linux 6.18), and one such PID must not stall attribution for the node.
Its answer is then unknown and the other PIDs are still read. Past ``BLOCKED_PROBES_LIMIT``
blocked reads, a PID is read only if its pod (from its ``cgroup``, which such an ``exec`` does
not block) has no read left blocked past it: one pod's stuck processes cannot leave every other
pod's new processes unattributed. The GPU check is bounded per PID
(``GPU_CHECK_FD_LIMIT`` entries, ``GPU_CHECK_TASK_LIMIT`` tasks) and overall
(``PROBE_BUDGET_SECONDS``); past a bound the PID's ``holds_gpu`` is unknown (charged like an open
GPU file) and the PID is named in the log.

A ``<proc_root>`` may be a tree someone else wrote (``explain --proc-root``): a symlink at
``<pid>`` or at the file is never followed, a FIFO never waited on, and a file is read whole up
to ``READ_LIMIT_BYTES`` or reported unreadable, never truncated. Each becomes a reason on an
unknown attribution (no identity: nothing is charged or signalled), never an exception. There
the ``fd/N`` entries are ordinary symlinks: one named like a GPU node counts as one.

Size: over 600 lines, on purpose: every ``/proc`` file gpuguard opens on a tenant's process is
opened here, through one set of checks (no symlink followed, regular files only, size-bounded,
under a deadline); what may be read of a hostile process (S7) is reviewed in this one module.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import re
import resource
import select
import stat
import struct
import time
import weakref
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Generic, TypeVar

import structlog

from gpuguard.adapters.bounded_reads import BLOCKED_READS_CAP, Prober, Ran
from gpuguard.core.cgroup import CgroupParse, parse_cgroup
from gpuguard.core.model import Attribution, ProcessIdentity

log = structlog.get_logger(__name__)


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


PROBE_DEADLINE_SECONDS = 0.25
"""The longest :meth:`ProcfsProcessResolver.attribute` waits for one PID's ``/proc`` reads
(``stat``, ``cgroup``, the GPU check). They take ~0.1 ms, a GPU check at its bounds ~20 ms;
longer means a read is blocked in the kernel (an ``exec`` stuck in a FUSE flush blocks ``stat``
and ``readlink`` of that process), and the PID is answered unknown instead. The read is left
on its helper thread; until it returns, the PID is answered unknown at once."""

PROBE_FLOOR_SECONDS = 0.02
"""The wait for one PID's reads once ``PROBE_BUDGET_SECONDS`` is spent: enough for reads that
do not block (no GPU check is made then)."""

BLOCKED_PROBES_LIMIT = 16
"""PIDs whose reads may be blocked at once whatever their pod, each holding a helper thread
until its read returns. Past it (logged ``proc_reads_blocked_limit``) a PID not yet read is
read only if its pod (or, outside a pod, its cgroup) has no read left blocked past it;
otherwise, or when its ``cgroup`` cannot be read, it is answered unknown without a read (a read
made below the limit is charged to no pod: a pod can hold 17 at most). So a pod whose
processes are stuck (an ``exec`` on its stopped FUSE daemon) keeps only its own new processes
unattributed, never another pod's. In all at most ``BLOCKED_READS_CAP`` (128;
logged ``proc_reads_blocked_cap``): 16 + one per pod for 112 pods, more than kubelet's default
``maxPods`` (110). How long a listing waits on reads that block: ``PROBE_BUDGET_SECONDS``."""

GPU_CHECK_FD_LIMIT = 4096
"""The most ``fd`` entries read (and file tables compared) for one PID over all its tasks. A
CUDA process has a few hundred and its GPU file among the first; past the limit the PID's
``holds_gpu`` is unknown (``gpu_fd_check_incomplete``, ``why="fd_limit"``). ~10 ms of reads."""

GPU_CHECK_TASK_LIMIT = 1024
"""The most tasks (threads) looked at for one PID, past its leader; a task sharing a table
already read costs one ``kcmp``. Past it: unknown (``why="task_limit"``)."""

GPU_UNKNOWN_KEPT_SECONDS = 30.0
"""How long a process whose GPU check went past a bound (or whose reads blocked in it) stays
unknown without a new check: a process holding 50 000 files does not cost its bound at every
listing. Unknown is charged like an open GPU file, so this delays no charge."""

PROBE_BUDGET_SECONDS = 0.5
"""Seconds of GPU checks (and of waits on PIDs whose reads blocked) the resolver may spend at
once; it refills at ``PROBE_BUDGET_REFILL_PER_SECOND``. While it is spent, no GPU check is
made (``holds_gpu`` unknown, logged once ``gpu_fd_check_budget_spent``) and each PID's reads
get ``PROBE_FLOOR_SECONDS``: however many processes hold huge or blocking fd tables, one
listing's attribution waits on them for about this long plus a floor per read that newly
blocks in it (a PID already blocked costs nothing): 0.82 s when 16 block at once, 3.06 s in
the extreme of all 128 (``BLOCKED_READS_CAP``), within ``nvml.call_timeout_seconds`` (5 s)
and the staleness bound."""

PROBE_BUDGET_REFILL_PER_SECOND = 0.1
"""Over time the GPU checks take at most a tenth of the attribution thread."""

BLOCKED_REASON = "reading /proc/<pid> did not finish in time (blocked in the kernel)"
"""Reason for a PID whose ``stat`` or ``cgroup`` read did not return within its deadline, or
whose earlier read is still blocked: its identity is unknown, so nothing new is attributed."""


class ProcfsProcessResolver:
    """``ProcessResolver`` over ``<proc_root>``: host PID → pod, container and cgroup.

    Reads ``stat`` before and after ``cgroup`` and requires the same ``starttime``, so the
    cgroup text is known to belong to the identity returned (a PID reused mid-read is retried
    once, then reported). Results are cached by identity ``(pid, starttime)``, never by PID
    alone, so a reused PID always gets a fresh attribution; the cache is bounded (LRU).
    Permission and other OS errors become a reason, never an exception.

    ``check_gpu_fds``: also fill ``Attribution.holds_gpu``: whether one of the process's open
    files is an NVIDIA GPU device node, from ``readlink`` of ``fd/N`` in the leader's table and
    in each task's (``task/<tid>/fd``), leader first, stopping at the first GPU file, and for a
    path-named file not named like one, ``statx(AT_STATX_DONT_SYNC)`` of the link: nothing is
    opened, and no file's filesystem is asked for anything it has not cached. ``True`` is
    remembered per identity; ``False`` is read again on every call (a process can open the GPU
    later); unknown past a bound is remembered for ``GPU_UNKNOWN_KEPT_SECONDS``.

    Each PID's reads run on a helper thread and are waited for at most
    ``PROBE_DEADLINE_SECONDS`` (see the module docstring), so every call returns within that
    however the process behaves, and a PID that blocked or was too big is named in the log.

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
        self._check_gpu_fds = check_gpu_fds
        self._cache: _ByIdentity[Attribution] = _ByIdentity(cache_size)
        self._gpu_known: _ByIdentity[_GpuKnown] = _ByIdentity(cache_size)
        # A pidfd or kcmp names the process of this PID namespace: only where <proc_root>
        # shows it are processes pinned and file tables compared.
        self._own_proc = same_pid_namespace(proc_root)
        pinning = pin_processes and self._own_proc
        self._pins = _Pins(_pin_limit(cache_size) if pinning else 0)
        self._probes = Prober(BLOCKED_PROBES_LIMIT, cap=BLOCKED_READS_CAP)
        self._budget = _Budget(PROBE_BUDGET_SECONDS, PROBE_BUDGET_REFILL_PER_SECOND)
        self._budget_spent = False
        # A resolver dropped without close() (explain, tests) lets its idle helper thread go.
        weakref.finalize(self, self._probes.close)

    @property
    def pinned(self) -> int:
        """How many processes are pinned (a pidfd held open: see :meth:`attribute`)."""
        return len(self._pins)

    def attribute(self, pid: int) -> Attribution:
        """Blocking, for at most ``PROBE_DEADLINE_SECONDS``. Never raises for a missing,
        unreadable or blocked PID: returns a reason instead.

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
        """Close every pin's pidfd and let the helper thread go (idempotent)."""
        self._pins.close()
        self._probes.close()

    def _is_final(self, pid: int, result: Attribution) -> bool:
        """``result`` may be pinned: an identity of ``pid`` and, where the GPU is checked, the
        GPU seen open (``False`` may turn ``True`` later: read again every time)."""
        if result.identity is None or result.identity.pid != pid:
            return False
        return not self._check_gpu_fds or result.holds_gpu is True

    def _attribute_fresh(self, pid: int) -> Attribution:
        now = time.monotonic()
        left = self._budget.left(now)
        known = self._cache.of_pid(pid)
        gpu_known = self._gpu_known.of_pid(pid) if self._check_gpu_fds else None
        if gpu_known is not None and gpu_known[1].until <= now:
            gpu_known = None
        wait = min(PROBE_DEADLINE_SECONDS, max(PROBE_FLOOR_SECONDS, left))
        probe = _Probe(
            self._proc_root,
            pid,
            known=None if known is None else known[1],
            skip_gpu_check=None if gpu_known is None else gpu_known[0],
            check_gpu=self._check_gpu_fds and left > 0,
            own_proc=self._own_proc,
            # The check stops itself a little before the wait ends: only a blocked read leaves
            # its helper behind.
            check_until=now + 0.8 * wait,
        )
        ran = self._probes.run(pid, probe.run, wait, find_owner=probe.owner)
        if ran is Ran.BUSY:
            return Attribution.unknown(pid, GHOST_REASON if probe.gone else BLOCKED_REASON)
        late = ran is Ran.LATE
        identity = probe.identity  # set last, after what it stands for
        result = None if identity is None else self._attribution_of(identity, probe.cgroup, known)
        if late:
            self._budget.spend(wait)
            log.warning(
                "proc_read_blocked",
                pid=pid,
                reading=probe.stage,
                waited_seconds=wait,
                **_whose(result),
            )
        if result is None:
            if late:
                return Attribution.unknown(pid, BLOCKED_REASON)
            assert probe.answer is not None  # a probe that finished has one or the other
            return probe.answer
        if not self._check_gpu_fds:
            return result
        assert identity is not None
        holds = self._holds_gpu(result, identity, probe, gpu_known, late=late)
        return replace(result, holds_gpu=holds)

    def _attribution_of(
        self,
        identity: ProcessIdentity,
        cgroup: bytes | None,
        known: tuple[ProcessIdentity, Attribution] | None,
    ) -> Attribution:
        """The attribution of a read that got ``identity``: the cached one when the probe
        found it cached (``cgroup`` not read), else parsed from ``cgroup`` and cached."""
        if cgroup is None:
            assert known is not None  # the probe found it cached and skipped the read
            assert known[0] == identity
            self._cache.touch(identity)
            return known[1]
        text = cgroup.decode("utf-8", errors="replace")
        result = _attribution(identity, parse_cgroup(text))
        self._cache.put(identity, result)
        return result

    def _holds_gpu(
        self,
        result: Attribution,
        identity: ProcessIdentity,
        probe: _Probe,
        known: tuple[ProcessIdentity, _GpuKnown] | None,
        *,
        late: bool,
    ) -> bool | None:
        """``holds_gpu`` of a read: remembered, checked, or unknown (and why, logged)."""
        if known is not None and known[0] == identity:
            self._gpu_known.touch(identity)
            return known[1].holds
        if late:  # blocked in the GPU check itself: charged as unknown, not read again soon
            self._gpu_known.put(identity, _GpuKnown.unknown_for_now())
            return None
        scan = probe.gpu
        if scan is None:  # the budget was spent: no check
            if not self._budget_spent:
                self._budget_spent = True
                log.warning(
                    "gpu_fd_check_budget_spent",
                    pid=result.pid,
                    budget_seconds=PROBE_BUDGET_SECONDS,
                    refill_per_second=PROBE_BUDGET_REFILL_PER_SECOND,
                )
            return None
        self._budget_spent = False
        self._budget.spend(probe.check_seconds)
        if scan.holds:
            self._gpu_known.put(identity, _HOLDER)
        elif scan.incomplete is not None:
            self._gpu_known.put(identity, _GpuKnown.unknown_for_now())
            log.warning(
                "gpu_fd_check_incomplete",
                pid=result.pid,
                why=scan.incomplete,
                fds_read=scan.fds_read,
                tasks_read=scan.tasks_read,
                seconds=round(probe.check_seconds, 4),
                **_whose(result),
            )
        return scan.holds


def _whose(result: Attribution | None) -> dict[str, str | None]:
    """The pod, container and cgroup of an attribution, for a log line naming a process."""
    if result is None:
        return {"pod_uid": None, "container_id": None, "cgroup": None}
    return {
        "pod_uid": result.pod_uid,
        "container_id": result.container_id,
        "cgroup": None if result.cgroup is None else result.cgroup.path,
    }


_V = TypeVar("_V")


class _ByIdentity(Generic[_V]):
    """Values by process identity, the least recently used dropped past ``size``; also found
    by PID (the identity last stored for it), so a probe can be told what is known already."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[ProcessIdentity, _V] = OrderedDict()
        self._identity_of: dict[int, ProcessIdentity] = {}

    def of_pid(self, pid: int) -> tuple[ProcessIdentity, _V] | None:
        identity = self._identity_of.get(pid)
        if identity is None:
            return None
        return identity, self._items[identity]

    def touch(self, identity: ProcessIdentity) -> None:
        if identity in self._items:
            self._items.move_to_end(identity)

    def put(self, identity: ProcessIdentity, value: _V) -> None:
        self._items[identity] = value
        self._items.move_to_end(identity)
        self._identity_of[identity.pid] = identity
        while len(self._items) > self._size:
            old, _ = self._items.popitem(last=False)
            if self._identity_of.get(old.pid) == old:
                del self._identity_of[old.pid]


@dataclass(frozen=True, slots=True)
class _GpuKnown:
    """A GPU check's answer kept for an identity: ``True`` for its life, unknown for a while."""

    holds: bool | None
    until: float

    @classmethod
    def unknown_for_now(cls) -> _GpuKnown:
        return cls(None, time.monotonic() + GPU_UNKNOWN_KEPT_SECONDS)


_HOLDER = _GpuKnown(True, float("inf"))


class _Budget:
    """Seconds that may be spent, ``seconds`` at most, refilled at ``per_second``; spending
    past zero is a debt repaid by the refill."""

    def __init__(self, seconds: float, per_second: float) -> None:
        self._capacity = seconds
        self._rate = per_second
        self._left = seconds
        self._at = time.monotonic()

    def left(self, now: float) -> float:
        self._left = min(self._capacity, self._left + (now - self._at) * self._rate)
        self._at = now
        return self._left

    def spend(self, seconds: float) -> None:
        self._left -= seconds


# ---------------------------------------------------------------------------------------------
# One PID's reads, on a helper thread


class _Probe:
    """One PID's reads: ``stat``, ``cgroup``, ``stat`` again (skipped when ``known`` has the
    identity read), then the GPU check (skipped for ``skip_gpu_check``). Runs on a helper
    thread; the resolver reads the fields once it finished or, past its deadline, for what it
    got so far: each field is set once, ``identity`` after what it stands for.

    Through one directory descriptor: on the real /proc it pins the process that held the
    number when it was opened, so every read (the GPU check's too) comes from that one process
    (a reused PID reads as gone); a retry opens the new one."""

    def __init__(
        self,
        proc_root: Path,
        pid: int,
        *,
        known: Attribution | None,
        skip_gpu_check: ProcessIdentity | None,
        check_gpu: bool,
        own_proc: bool,
        check_until: float,
    ) -> None:
        self._proc_root = proc_root
        self.pid = pid
        self._known = known
        self._skip_gpu_check = skip_gpu_check
        self._check_gpu = check_gpu
        self._own_proc = own_proc
        self._check_until = check_until
        self.stage = "stat"
        """What it is reading (logged when it blocks): ``stat``, ``cgroup`` or ``fd``."""
        self.gone = False
        """:meth:`owner` found no such PID."""
        self.answer: Attribution | None = None
        """The answer when it is known without an identity (gone, unreadable, reused)."""
        self.cgroup: bytes | None = None
        """The ``cgroup`` text read for ``identity`` (``None``: ``known`` was it)."""
        self.identity: ProcessIdentity | None = None
        self.gpu: _GpuScan | None = None
        self.check_seconds = 0.0

    def owner(self) -> Hashable | None:
        """Whom a blocked read of this PID is charged to (asked only once
        ``BLOCKED_PROBES_LIMIT`` reads are blocked): its pod's UID, else its cgroup text;
        ``None`` when that cannot be read. ``cgroup`` is read even while ``stat`` blocks (an
        ``exec`` stuck in a FUSE flush; Linux 6.18). Only whom to charge: never attributes."""
        self.stage = "cgroup"
        try:
            raw = _read(self._proc_root, self.pid, "cgroup")
        except OSError:
            return None
        if raw is None:
            self.gone = True
            return None
        return _owner_of(raw.decode("utf-8", errors="replace"))

    def run(self) -> None:
        self.stage = "stat"
        for _attempt in range(2):
            try:
                if self._read_once():
                    return
            except OSError as exc:
                self.answer = _unreadable(self.pid, exc)
                return
        self.answer = Attribution.unknown(self.pid, REUSED_REASON)

    def _read_once(self) -> bool:
        """``False``: the PID changed identity while its cgroup was read (retry)."""
        pid = self.pid
        dir_fd = _open_pid_dir(self._proc_root, pid)
        if dir_fd is None:
            self.answer = Attribution.unknown(pid, GHOST_REASON)
            return True
        try:
            raw = _read_at(dir_fd, "stat")
            before = None if raw is None else _start_ticks(raw)
            if before is None:
                self.answer = _not_read(pid, raw)
                return True
            identity = ProcessIdentity(pid=pid, start_ticks=before)
            if self._known is None or self._known.identity != identity:
                self.stage = "cgroup"
                cgroup = _read_at(dir_fd, "cgroup")
                self.stage = "stat"
                raw = None if cgroup is None else _read_at(dir_fd, "stat")
                after = None if raw is None else _start_ticks(raw)
                if after is None:
                    self.answer = _not_read(pid, raw)
                    return True
                if after != before:
                    return False
                self.cgroup = cgroup
            self.identity = identity
            if self._check_gpu and identity != self._skip_gpu_check:
                self.stage = "fd"
                started = time.monotonic()
                self.gpu = _check_gpu_files(
                    dir_fd, pid, own_proc=self._own_proc, until=self._check_until
                )
                self.check_seconds = time.monotonic() - started
            return True
        finally:
            os.close(dir_fd)


def _owner_of(cgroup: str) -> Hashable:
    """A pod process's pod; any other process's cgroup (an unprivileged container cannot move
    its processes out of its pod's cgroup)."""
    parsed = parse_cgroup(cgroup)
    return ("pod", parsed.pod_uid) if parsed.pod_uid is not None else ("cgroup", cgroup)


def _not_read(pid: int, raw: bytes | None) -> Attribution:
    """A ``stat`` that is gone (``None``) or has no ``starttime``: the PID's answer."""
    if raw is None:
        return Attribution.unknown(pid, GHOST_REASON)
    return Attribution.unknown(pid, STAT_UNPARSABLE_REASON)


# ---------------------------------------------------------------------------------------------
# The GPU check: is one of the process's open files an NVIDIA GPU device node?

_NVIDIA_MAJOR = 195
_NVIDIA_GPU_NAME = re.compile(r"(?:^|/)nvidia[0-9]+\Z")
"""A GPU node's name as ``readlink`` shows it: ``/dev/nvidia0`` on the host, ``/nvidia3`` for
a device bind-mounted into a container's mount namespace."""
_NOT_A_DEVICE_PREFIXES = ("pipe:[", "socket:[", "anon_inode:")
"""Link texts the kernel makes up (``d_dname``) for files with no path: never a device node."""

_TABLE_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_AT_STATX_DONT_SYNC = 0x4000
_STATX_TYPE = 0x1
_KCMP_FILES = 2
_SYS_KCMP = {"x86_64": 312, "aarch64": 272}.get(platform.machine())
_STATX_MASK = struct.Struct("=I")  # stx_mask, at 0
_STATX_MODE = struct.Struct("=H")  # stx_mode, at 28
_STATX_RDEV = struct.Struct("=II")  # stx_rdev_major, stx_rdev_minor, at 128
_STATX_BYTES = 256

_libc = ctypes.CDLL(None, use_errno=True)
_statx = getattr(_libc, "statx", None)  # glibc 2.28+; Python 3.11 has no os.statx
if _statx is not None:
    _statx.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p)
    _statx.restype = ctypes.c_int
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


@dataclass(frozen=True, slots=True, kw_only=True)
class _GpuScan:
    """A GPU check's answer: ``holds`` (``None``: unknown), why it stopped short if it did
    (``fd_limit``, ``task_limit``, ``deadline``), and how much it read."""

    holds: bool | None
    incomplete: str | None = None
    fds_read: int
    tasks_read: int


class _Stopped(Exception):
    """A bound was reached: the answer is unknown."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def _check_gpu_files(dir_fd: int, pid: int, *, own_proc: bool, until: float) -> _GpuScan:
    """Whether one of the open files of the process whose ``<proc_root>/<pid>`` is ``dir_fd``
    is an NVIDIA GPU device node: NVIDIA's char major 195, minors 0-253 are GPUs (254
    ``nvidia-modeset``, 255 ``nvidiactl``; open-gpu-kernel-modules ``NV_MAJOR_DEVICE_NUMBER``).

    ``None`` when the answer could be wrong because something was unreadable, when a bound was
    reached (``GPU_CHECK_FD_LIMIT``, ``GPU_CHECK_TASK_LIMIT``, ``until`` on the monotonic
    clock), or for a process that has exited: a zombie's fd table is already empty, yet NVML
    still lists it while a forked child holds its CUDA context (measured on an H200,
    docs/gpu-e2e.md): "holds no GPU" would be a wrong answer that hides the pod's memory."""
    check = _GpuFiles(dir_fd, pid, own_proc=own_proc, until=until)
    try:
        found = check.in_leader() or check.in_tasks()
    except _Stopped as stop:
        return _GpuScan(
            holds=None, incomplete=stop.why, fds_read=check.fds_read, tasks_read=check.tasks_read
        )
    if found:
        holds: bool | None = True
    elif check.unsure or _has_exited(dir_fd):
        holds = None
    else:
        holds = False
    return _GpuScan(holds=holds, fds_read=check.fds_read, tasks_read=check.tasks_read)


class _GpuFiles:
    """The reads of one GPU check and their bounds (see ``_check_gpu_files``)."""

    def __init__(self, dir_fd: int, pid: int, *, own_proc: bool, until: float) -> None:
        self._dir_fd = dir_fd
        self._pid = pid
        self._until = until
        self._compare = own_proc and _SYS_KCMP is not None
        self._buf = ctypes.create_string_buffer(_STATX_BYTES)
        self.fds_read = 0
        self.tasks_read = 0
        self.unsure = False

    def in_leader(self) -> bool:
        """The thread-group leader's table (``<pid>/fd``): the process's, unless a thread
        unshared its own (``unshare(CLONE_FILES)``) or the leader exited before its threads."""
        try:
            table = os.open("fd", _TABLE_FLAGS, dir_fd=self._dir_fd)
        except OSError:  # gone, or EACCES: another user's (signals.PrivilegeCheck)
            self.unsure = True
            return False
        return self._in_table(table)

    def in_tasks(self) -> bool:
        """Each other task's table (``task/<tid>/fd``), skipping a table already read
        (``kcmp(KCMP_FILES)``: threads share the leader's, so a normal process costs one
        comparison per thread)."""
        try:
            tasks = os.open("task", _TABLE_FLAGS, dir_fd=self._dir_fd)
        except FileNotFoundError:  # a tree someone wrote (the real /proc always has one)
            return False
        except OSError:
            self.unsure = True
            return False
        read = [self._pid]
        try:
            with os.scandir(tasks) as entries:
                for entry in entries:
                    name = entry.name
                    if not (name.isascii() and name.isdigit()) or int(name) == self._pid:
                        continue
                    self.tasks_read += 1
                    if self.tasks_read > GPU_CHECK_TASK_LIMIT:
                        raise _Stopped("task_limit")
                    if not self.tasks_read % 16 and time.monotonic() > self._until:
                        raise _Stopped("deadline")
                    tid = int(name)
                    if self._read_already(tid, read):
                        continue
                    if self._in_task(tasks, name):
                        return True
                    read.append(tid)
        except OSError:
            self.unsure = True
        finally:
            os.close(tasks)
        return False

    def _in_task(self, tasks: int, name: str) -> bool:
        try:
            task = os.open(name, _DIR_FLAGS, dir_fd=tasks)
        except (FileNotFoundError, ProcessLookupError):  # the thread exited
            return False
        except OSError:  # a symlink in a tree someone wrote: not followed
            self.unsure = True
            return False
        try:
            table = os.open("fd", _TABLE_FLAGS, dir_fd=task)
        except (FileNotFoundError, ProcessLookupError):
            return False
        except OSError:
            self.unsure = True
            return False
        finally:
            os.close(task)
        return self._in_table(table)

    def _read_already(self, tid: int, read: list[int]) -> bool:
        """Task ``tid`` shares the table of a task in ``read`` (each comparison is counted
        like an entry). Only where ``<proc_root>`` is this PID namespace's ``/proc``."""
        if not self._compare:
            return False
        for other in read:
            self._count_entry()
            same = _same_file_table(other, tid)
            if same is None:  # no kcmp here (ENOSYS, EPERM): read every table
                self._compare = False
                return False
            if same:
                return True
        return False

    def _in_table(self, table: int) -> bool:
        """Whether a file of the open table ``table`` (an ``fd`` directory) is a GPU; closes
        it. Entries in order, from fd 0: a CUDA process's GPU files are among its first."""
        try:
            with os.scandir(table) as entries:
                for entry in entries:
                    self._count_entry()
                    if self._is_gpu(table, entry.name):
                        return True
        except OSError:  # the process exited while it was listed, or EACCES
            self.unsure = True
        finally:
            os.close(table)
        return False

    def _count_entry(self) -> None:
        self.fds_read += 1
        if self.fds_read > GPU_CHECK_FD_LIMIT:
            raise _Stopped("fd_limit")
        if not self.fds_read % 64 and time.monotonic() > self._until:
            raise _Stopped("deadline")

    def _is_gpu(self, table: int, name: str) -> bool:
        """Whether ``fd/<name>`` is a GPU device node. ``readlink`` of the magic link is the
        kernel's ``d_path`` of the open file: it calls nothing of the file's filesystem.
        ``statx`` (which does) is asked only what that filesystem has cached."""
        try:
            target = os.readlink(name, dir_fd=table)
        except FileNotFoundError:  # closed meanwhile
            return False
        except OSError:
            self.unsure = True
            return False
        if _NVIDIA_GPU_NAME.search(target):
            return True
        return not target.startswith(_NOT_A_DEVICE_PREFIXES) and self._is_gpu_device(table, name)

    def _is_gpu_device(self, table: int, name: str) -> bool:
        try:
            return _is_gpu_device(table, name, self._buf)
        except FileNotFoundError:  # closed meanwhile, or a fixture tree's dangling link
            return False
        except OSError:
            self.unsure = True
            return False


def _is_gpu_device(dir_fd: int, name: str, buf: ctypes.Array[ctypes.c_char]) -> bool:
    """Whether what ``name`` in ``dir_fd`` links to is a GPU device node, from
    ``statx(AT_STATX_DONT_SYNC)``: the attributes the file's filesystem has cached. FUSE
    (``fuse_update_get_attr``) and NFS then send no request: a file on a FUSE mount whose
    daemon is stopped is answered at once (measured on Linux 6.18; a plain ``stat`` waits as
    long as the daemon does). Raises ``OSError``."""
    if _statx is None:
        raise OSError(errno.ENOSYS, "statx is not available in this C library")
    if _statx(dir_fd, name.encode(), _AT_STATX_DONT_SYNC, _STATX_TYPE, buf) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    (mask,) = _STATX_MASK.unpack_from(buf, 0)
    if not mask & _STATX_TYPE:
        raise OSError(errno.ENODATA, "statx returned no file type")
    (mode,) = _STATX_MODE.unpack_from(buf, 28)
    major, minor = _STATX_RDEV.unpack_from(buf, 128)
    return stat.S_ISCHR(mode) and major == _NVIDIA_MAJOR and minor < 254


def _same_file_table(a: int, b: int) -> bool | None:
    """Whether tasks ``a`` and ``b`` share one file table (``kcmp(KCMP_FILES)``); ``False``
    when one has exited (its table, if any, is read); ``None`` when kcmp is not available."""
    assert _SYS_KCMP is not None
    got = _syscall(
        ctypes.c_long(_SYS_KCMP),
        ctypes.c_long(a),
        ctypes.c_long(b),
        ctypes.c_long(_KCMP_FILES),
        ctypes.c_long(0),
        ctypes.c_long(0),
    )
    if got >= 0:
        return bool(got == 0)
    return False if ctypes.get_errno() == errno.ESRCH else None


def _has_exited(dir_fd: int) -> bool:
    """The process has exited (a zombie, or gone), or its ``stat`` cannot be read."""
    try:
        raw = _read_at(dir_fd, "stat")
    except OSError:
        return True
    fields = None if raw is None else _stat_fields(raw)
    return not fields or fields[0].decode("ascii", "replace") in _EXITED_STATES


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
