"""bounded_reads: runs one PID's blocking reads on a helper thread and waits at most a deadline.

Owns the helper threads that ``procfs`` (attribution) and ``signals`` (the killer) read
``/proc/<pid>/…`` on. A tenant can make those reads block in the kernel: an ``exec`` stuck in a
FUSE flush on a daemon the tenant stopped blocks ``stat`` of that process (and its ``fd`` links,
``kcmp``, ``wchan``, ``stack``) for as long as the daemon stays stopped (measured on Linux 6.18;
``status``, ``cgroup`` and ``pidfd_open`` do not block). A blocked syscall cannot be taken back,
so a read past its deadline is left running on its helper, which then serves nothing else; the
next read gets a new helper. A PID whose read is still blocked is not read again (no new thread)
until that read returns.

How many reads may be left blocked at once (each holds a thread until it returns):

- ``limit`` of them, whoever they are charged to;
- past ``limit``, a read is still made for an owner with no blocked read charged to it, so one
  tenant's stuck processes use up the limit for its own processes only. The owner is the
  caller's ``owner`` (the killer: the container being stopped) or, when it gives none, what
  ``find_owner`` answers (attribution: the PID's pod, from its ``cgroup``, which does not block
  where ``stat`` does). ``find_owner`` is asked only past ``limit`` (the common path reads
  nothing more, and a read made before is charged to no owner), on a helper under the same
  deadline; no owner, no read;
- never more than ``cap``: past it, nothing new is read for anyone. The hard bound on a
  Prober's threads: ``cap`` blocked plus one idle helper (``BLOCKED_READS_CAP``).

Must not: know what is read, log what it reads, kill or join a thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Hashable
from enum import Enum

import structlog

log = structlog.get_logger(__name__)

BLOCKED_READS_CAP = 128
"""The default ``cap``: the most reads one Prober leaves blocked at once, whoever they are
charged to, so at most 129 threads. Each blocked read holds a parked thread (~16 KiB resident;
its 8 MiB stack is reserved, not touched: 256 parked threads added 4.2 MiB RSS, Python 3.11 on
Linux 6.18), a kernel stack and task (counted in the pod's PID limit), and the descriptors its
read has open (two; four in the GPU check): about 5 MiB and at most 512 descriptors at 128,
within the enforcer's 256 MiB memory limit and the descriptors it keeps free (pins take at most
a quarter of its limit)."""


class Ran(Enum):
    """What became of one :meth:`Prober.run`."""

    DONE = "done"
    LATE = "late"
    """Past its deadline: left running on its helper, which serves nothing else."""
    BUSY = "busy"
    """Not run: the PID's earlier read is still blocked, or too many reads are (see above)."""


class _Job:
    __slots__ = ("abandoned", "error", "latch", "owner", "pid", "ran", "started", "work")

    def __init__(self, work: Callable[[], None], pid: int, owner: Hashable | None) -> None:
        self.work = work
        self.latch = threading.Lock()
        self.latch.acquire()  # released by the helper when the work is done
        self.ran = False
        self.abandoned = False
        self.error: BaseException | None = None
        self.pid = pid
        self.owner = owner
        self.started = time.monotonic()


class _Helper:
    """A daemon thread that runs jobs one at a time; it ends after a job it was told to
    abandon (its caller moved on to another helper), or when closed."""

    def __init__(self, thread_name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        threading.Thread(target=self._serve, name=thread_name, daemon=True).start()

    def submit(self, job: _Job) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job.work()
            except BaseException as exc:  # noqa: BLE001 — handed to the caller, raised there
                job.error = exc
            with self.lock:
                job.ran = True
                job.latch.release()
                if job.abandoned:
                    return
            # Idle, it holds nothing of its last job: a job's work may hold the Prober's user
            # (the killer's reads are closures over it), whose finalizer is what closes this
            # helper; held, neither would ever end.
            job = None


class Prober:
    """Runs each PID's reads on a helper thread and waits for them at most a deadline. A read
    past it is left running on that helper (a blocked syscall cannot be taken back); the next
    read gets a new helper. How many may be left so: see the module docstring (``limit``,
    owners, ``cap``). ``reader`` names the user in its threads' names and its log lines.

    Thread-safe: one run at a time (another caller waits for it, at most its deadline)."""

    def __init__(
        self, limit: int, *, cap: int = BLOCKED_READS_CAP, reader: str = "proc-reads"
    ) -> None:
        self._limit = limit
        self._cap = cap
        self._reader = reader
        self._helper: _Helper | None = None
        self._blocked: dict[int, _Job] = {}
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def run(
        self,
        pid: int,
        work: Callable[[], None],
        wait_seconds: float,
        *,
        owner: Hashable | None = None,
        find_owner: Callable[[], Hashable | None] | None = None,
    ) -> Ran:
        """Run ``work`` (``pid``'s reads) and wait for it at most ``wait_seconds`` in all.
        Raises what ``work`` raised when it finished in time. ``find_owner`` (without
        ``owner``): asked past ``limit`` only; an error it raises counts as no owner."""
        with self._lock:
            return self._run(pid, work, wait_seconds, owner, find_owner)

    def still_blocked(self, pid: int) -> bool:
        """``pid`` has a read left past its deadline that had not returned when last looked at
        (why :meth:`run` answers ``BUSY`` for it, rather than for the limit)."""
        with self._lock:
            return pid in self._blocked

    def close(self) -> None:
        """Let the idle helper go (a blocked one ends when its read returns)."""
        with self._lock:
            if self._helper is not None:
                self._helper.close()
                self._helper = None

    def _run(
        self,
        pid: int,
        work: Callable[[], None],
        wait_seconds: float,
        owner: Hashable | None,
        find_owner: Callable[[], Hashable | None] | None,
    ) -> Ran:
        if self._blocked:
            self._forget_returned()
            if pid in self._blocked:
                return Ran.BUSY
            if len(self._blocked) >= self._cap:
                return self._refuse("proc_reads_blocked_cap", cap=self._cap)
            if len(self._blocked) >= self._limit:
                if owner is None and find_owner is not None:
                    started = time.monotonic()
                    found: list[Hashable | None] = []
                    asked = _Job(lambda: found.append(find_owner()), pid, None)
                    if self._submit(asked, wait_seconds) is Ran.LATE:
                        return Ran.LATE
                    owner = found[0] if found else None
                    wait_seconds -= time.monotonic() - started
                if owner is None or wait_seconds <= 0 or self._charged_to(owner):
                    return self._refuse("proc_reads_blocked_limit", limit=self._limit)
        job = _Job(work, pid, owner)
        ran = self._submit(job, wait_seconds)
        if ran is Ran.DONE and job.error is not None:
            raise job.error
        return ran

    def _submit(self, job: _Job, wait_seconds: float) -> Ran:
        helper = self._helper
        if helper is None:
            helper = self._helper = _Helper(f"gpuguard-{self._reader}")
        helper.submit(job)
        if not job.latch.acquire(timeout=wait_seconds):
            with helper.lock:
                if not job.ran:
                    job.abandoned = True
                    self._blocked[job.pid] = job
                    self._helper = None
                    return Ran.LATE
        return Ran.DONE

    def _charged_to(self, owner: Hashable) -> bool:
        return any(job.owner == owner for job in self._blocked.values())

    def _refuse(self, event: str, **bound: int) -> Ran:
        """``BUSY``, logged once each time the bound is reached."""
        if event not in self._logged:
            self._logged.add(event)
            log.error(event, reader=self._reader, blocked_pids=sorted(self._blocked), **bound)
        return Ran.BUSY

    def _forget_returned(self) -> None:
        for pid, job in list(self._blocked.items()):
            if job.ran:
                del self._blocked[pid]
                log.info(
                    "proc_read_unblocked",
                    reader=self._reader,
                    pid=pid,
                    blocked_seconds=round(time.monotonic() - job.started, 3),
                )
        if len(self._blocked) < self._cap:
            self._logged.discard("proc_reads_blocked_cap")
        if len(self._blocked) < self._limit:
            self._logged.discard("proc_reads_blocked_limit")
