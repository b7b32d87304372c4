"""bounded_reads: runs one PID's blocking reads on a helper thread and waits at most a deadline.

Owns the helper threads that ``procfs`` (attribution) and ``signals`` (the killer) read
``/proc/<pid>/…`` on. A tenant can make those reads block in the kernel: an ``exec`` stuck in a
FUSE flush on a daemon the tenant stopped blocks ``stat`` of that process (and its ``fd`` links,
``kcmp``, ``wchan``, ``stack``) for as long as the daemon stays stopped (measured on Linux 6.18;
``status``, ``cgroup`` and ``pidfd_open`` do not block). A blocked syscall cannot be taken back,
so a read past its deadline is left running on its helper, which then serves nothing else; the
next read gets a new helper. A PID whose read is still blocked is not read again (no new thread)
until that read returns, and at most ``limit`` reads are left blocked at once: threads do not
pile up.

``owner`` (optional): what a blocked read is charged to (the killer: the container being
stopped). Past ``limit``, a caller with an owner is still served unless that owner already has a
blocked read, so one tenant's stuck processes use up the limit for its own container only;
without one (attribution), nothing new is read past ``limit``.

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


class Ran(Enum):
    """What became of one :meth:`Prober.run`."""

    DONE = "done"
    LATE = "late"
    """Past its deadline: left running on its helper, which serves nothing else."""
    BUSY = "busy"
    """Not run: the PID's earlier read is still blocked, or ``limit`` reads are."""


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
    read gets a new helper. At most ``limit`` such reads at once (see the module docstring for
    ``owner``). ``reader`` names the user in its threads' names and its log lines.

    Thread-safe: one run at a time (another caller waits for it, at most its deadline)."""

    def __init__(self, limit: int, *, reader: str = "proc-reads") -> None:
        self._limit = limit
        self._reader = reader
        self._helper: _Helper | None = None
        self._blocked: dict[int, _Job] = {}
        self._full = False
        self._lock = threading.Lock()

    def run(
        self,
        pid: int,
        work: Callable[[], None],
        wait_seconds: float,
        *,
        owner: Hashable | None = None,
    ) -> Ran:
        """Run ``work`` (``pid``'s reads) and wait for it at most ``wait_seconds``. Raises what
        ``work`` raised when it finished in time."""
        with self._lock:
            return self._run(pid, work, wait_seconds, owner)

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
        self, pid: int, work: Callable[[], None], wait_seconds: float, owner: Hashable | None
    ) -> Ran:
        if self._blocked:
            self._forget_returned()
            if pid in self._blocked:
                return Ran.BUSY
            if len(self._blocked) >= self._limit and (
                owner is None or any(job.owner == owner for job in self._blocked.values())
            ):
                if not self._full:
                    self._full = True
                    log.error(
                        "proc_reads_blocked_limit",
                        reader=self._reader,
                        limit=self._limit,
                        blocked_pids=sorted(self._blocked),
                    )
                return Ran.BUSY
        self._full = False
        helper = self._helper
        if helper is None:
            helper = self._helper = _Helper(f"gpuguard-{self._reader}")
        job = _Job(work, pid, owner)
        helper.submit(job)
        if not job.latch.acquire(timeout=wait_seconds):
            with helper.lock:
                if not job.ran:
                    job.abandoned = True
                    self._blocked[pid] = job
                    self._helper = None
                    return Ran.LATE
        if job.error is not None:
            raise job.error
        return Ran.DONE

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
