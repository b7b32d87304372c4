"""The allocation guard's thawer: the process that bounds every stop the guard makes, the
enforcer crashing or being SIGKILLed included (BPF cannot SIGCONT another task, so the bound
is kept from user space, by a process that outlives the one that loaded the guard).

``python -m gpuguard.adapters.allocguard.thawer --frozen-fd N --enforcer-pidfd M
--enforcer-pid P --bound-ns B``, started by :class:`gpuguard.adapters.allocguard.AllocGuard`
with exactly two fds passed: the ``frozen`` map and a pidfd of the process that loaded the
guard. It holds no probe link (no guard object, no other bpf fd), so the probes detach when
that process dies whatever the thawer does.

Owns: resuming (SIGCONT through a pidfd) a recorded stop once it is ``bound`` old, unless the
enforcer took it over (``AllocGuard.forget``); every recorded stop, taken over or not, once
the enforcer is exiting; then, when it is gone (its pidfd readable) or the guard closes
(SIGTERM), every one left, and it exits. Each resume first opens a pidfd of the tgid, then
reads ``/proc/<tgid>/stat``: only when its starttime is the recorded start of the stopped
process is the signal sent, through that pidfd (a pid reused by another process is never
signalled; the entry is dropped). Entries are removed one exact stop at a time (the key names
the stop's time), so a later stop of the same process is never lost.

The enforcer's pidfd turns readable only when its exit is done, seconds after SIGKILL (its
probes' detach waits for RCU grace periods: 2.6 s for the 13 probes on Linux 6.18); its
``PF_EXITING`` flag in ``/proc/<pid>/stat``, read at every wake-up, says so at once.

Timing: it sleeps until the earliest unowned entry's deadline (stop + bound - lead, lead =
bound / 20) or for ``min(bound / 4, 50 ms)``, whichever is sooner. So a new entry is seen at
most 50 ms after its stop, well before its deadline, and resumed ``lead`` before the bound
plus this process's wake-up latency; the enforcer's exit is noticed within 50 ms. Idle cost:
one bpf syscall, one ``/proc`` read and one poll per 50 ms.

Must not: signal a process without an entry in ``frozen`` (a process the tenant stopped itself),
decide anything, or import more than the standard library and the loader (it starts on every
guard load and restart; start-up time is part of the bound after a restart). It needs the
host's ``/proc`` and time namespace (the pids and times the BPF program records are the
initial namespaces').
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import select
import signal
import sys
import time
from typing import Protocol

Entry = tuple[int, int, int, int, int, int]
"""(tgid, tid, stopped_ns, start_boottime_ns, cgroup_id, owned): one recorded stop."""


class _FrozenMap(Protocol):
    def frozen_entries(self, fd: int, /) -> list[Entry]: ...
    def frozen_delete(self, fd: int, tgid: int, tid: int, stopped_ns: int, /) -> bool: ...


_loader: _FrozenMap = importlib.import_module("gpuguard.adapters.allocguard._loader")
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_NS = 1_000_000_000


def _emit(event: str, **data: object) -> None:
    """One JSON log line on stderr (the guard's process inherits it: the enforcer's log). A log
    that cannot be written (its reader gone) never stops a resume."""
    try:
        sys.stderr.write(json.dumps({"event": event, "logger": "allocguard_thawer", **data}) + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _stat_field(pid: int, field: int) -> int | None:
    """Numeric field ``field`` (proc(5)'s numbering) of ``/proc/<pid>/stat``; None when the pid
    is gone or the field unparsable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    end = raw.rfind(b")")  # comm may hold spaces and ")": split after the last one
    fields = raw[end + 2 :].split() if end >= 0 else []  # fields[0] is field 3
    try:
        return int(fields[field - 3]) if len(fields) > field - 3 else None
    except ValueError:
        return None


def _start_ticks(tgid: int) -> int | None:
    """starttime (field 22): the process's identity with its pid."""
    return _stat_field(tgid, 22)


PERIOD_NS = 50_000_000
"""The longest sleep: new entries are seen, and the enforcer's exit noticed, within it."""

_PF_EXITING = 0x4
"""include/linux/sched.h: set as a task enters do_exit, SIGKILL included."""


def _exiting(pid: int) -> bool:
    """Whether the enforcer has begun to exit. Its pidfd turns readable only once its exit is
    done, and that waits on every probe's detach (seconds: each uprobe's unregistering waits
    for an RCU grace period): the stops it took over are resumed from here instead. A pid
    reused meanwhile can only make this true early (everything resumed sooner)."""
    flags = _stat_field(pid, 9)
    return flags is None or bool(flags & _PF_EXITING)


def _resume(frozen_fd: int, entry: Entry, why: str) -> None:
    """SIGCONT the stopped process of ``entry`` if the pid still names it, then drop the entry.

    Signal first, delete after: dying in between leaves the entry for a restarted thawer (one
    more SIGCONT to the same process), never a stop without its entry."""
    tgid, tid, stopped_ns, start_ns, cgroup_id, _owned = entry
    outcome = "resumed"
    try:
        pidfd = os.pidfd_open(tgid)
    except OSError:
        pidfd, outcome = None, "gone"
    if pidfd is not None:
        try:
            # The pidfd, opened first, names whoever held the pid then; the stat read after it
            # showing the stopped process's start proves that was the stopped process (a pid
            # is not reused while the process holding it is alive or unreaped).
            if _start_ticks(tgid) != start_ns * _CLK_TCK // _NS:
                outcome = "pid_reused"
            else:
                try:
                    signal.pidfd_send_signal(pidfd, signal.SIGCONT)
                except ProcessLookupError:
                    outcome = "gone"
        finally:
            os.close(pidfd)
    _loader.frozen_delete(frozen_fd, tgid, tid, stopped_ns)
    age_ms = (time.clock_gettime_ns(time.CLOCK_BOOTTIME) - stopped_ns) / 1e6
    _emit(
        "freeze_ended",
        outcome=outcome,
        why=why,
        tgid=tgid,
        tid=tid,
        cgroup_id=cgroup_id,
        age_ms=round(age_ms, 3),
    )


def _drop_if_gone(frozen_fd: int, entry: Entry) -> None:
    """An owned entry whose process exited (killed by the enforcer, most often) is dropped."""
    tgid, tid, stopped_ns, start_ns, _cgroup_id, _owned = entry
    if _start_ticks(tgid) != start_ns * _CLK_TCK // _NS:
        _loader.frozen_delete(frozen_fd, tgid, tid, stopped_ns)


def run(*, frozen_fd: int, enforcer_pidfd: int, enforcer_pid: int, bound_ns: int) -> int:
    """Until the enforcer is gone or SIGTERM: resume what is due (everything, the stops it took
    over included, once it is exiting: its probes may still stop callers until its exit is
    done). Then resume all, return 0."""
    period_ns = min(bound_ns // 4, PERIOD_NS)
    lead_ns = bound_ns // 20
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGTERM, lambda _signum, _frame: None)  # seen through wake_r
    poller = select.poll()
    poller.register(enforcer_pidfd, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    sys.stdout.buffer.write(b"r")  # ready: the guard waits for this byte
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the guard closes its end; nothing more goes there
    os.close(devnull)
    why = "enforcer_gone"
    while True:
        now = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
        sleep_ns = period_ns
        exiting = _exiting(enforcer_pid)
        for entry in _loader.frozen_entries(frozen_fd):
            if exiting:
                _resume(frozen_fd, entry, "enforcer_exiting")
                continue
            if entry[5]:
                _drop_if_gone(frozen_fd, entry)
                continue
            left_ns = entry[2] + bound_ns - lead_ns - now
            if left_ns <= 0:
                _resume(frozen_fd, entry, "bound")
            else:
                sleep_ns = min(sleep_ns, left_ns)
        events = poller.poll(max(1, -(-sleep_ns // 1_000_000)))
        if any(fd == wake_r for fd, _ in events):
            why = "guard_closed"
            break
        if events:
            break
    for entry in _loader.frozen_entries(frozen_fd):
        _resume(frozen_fd, entry, why)
    _emit("thawer_exited", why=why)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuguard.adapters.allocguard.thawer")
    parser.add_argument("--frozen-fd", type=int, required=True)
    parser.add_argument("--enforcer-pidfd", type=int, required=True)
    parser.add_argument("--enforcer-pid", type=int, required=True)
    parser.add_argument("--bound-ns", type=int, required=True)
    args = parser.parse_args(argv)
    return run(
        frozen_fd=args.frozen_fd,
        enforcer_pidfd=args.enforcer_pidfd,
        enforcer_pid=args.enforcer_pid,
        bound_ns=args.bound_ns,
    )


if __name__ == "__main__":
    sys.exit(main())
