"""killer: stops a container's processes through pidfds, each re-verified after opening.

Owns the only code path in gpuguard that sends a signal (``PidfdKiller``, the graduated stop's
signalling). Whether signalling is possible at all is checked at start by ``adapters.selfcheck``;
the container's members are listed by ``adapters.cgroup_members``. The sequence per member is the
race-free one (docs/design.md, Graduated stop): read ``(pid, starttime)`` stamped with the clock
tick it was read at → ``pidfd_open(2)`` → re-read starttime *and* ``/proc/<pid>/cgroup`` →
``pidfd_send_signal(2)``. A PID recycled before the open is caught by the re-read (an identity
read within its process's first tick proves nothing, so it is never acted on); a process that
dies after the open makes the send fail with ESRCH instead of hitting whoever gets the number
next.

Signals that land: the kernel drops a SIGTERM to a PID namespace's init that has no
handler for it (a container's PID 1: ``python train.py`` installs none), and discards one that
is ignored. So at the SIGTERM step every member is first opened and re-verified, and its
``/proc/<pid>/status`` read (``NSpid``, ``SigCgt``, ``SigBlk``, ``SigIgn``); ``core.stopping``
decides: a member on which SIGTERM would be lost gets SIGKILL at once when no member of the
container catches SIGTERM (nothing would use the termination timeout), and SIGTERM like the
rest otherwise (a shell PID 1 that forwards nothing must not take its catching worker down
with it). Each member is checked once more right before its send. ``SignalReport.stops`` says
which member got what, and why.

Bounded reads: a tenant can make a member's ``/proc/<pid>/stat`` block in the kernel (an ``exec``
stuck on a FUSE file whose daemon it stopped, Linux 6.18), and the enforcer waits on this call.
So every read of a member's ``/proc`` files runs on a helper thread (``bounded_reads.Prober``)
and is waited for at most ``PROBE_DEADLINE_SECONDS``: a member whose identity cannot be read or
re-verified in time is not signalled and is a refusal naming its PID; the others go on.

Must not: call ``kill(2)`` (``os.kill``) or signal a PID that was not re-verified after its pidfd
was opened; follow symlinks out of the cgroup tree; resolve cgroup paths relative to a private
cgroup namespace (``/..`` paths are refused); open anything under ``/proc/<pid>/`` other than
``stat``, ``cgroup`` and ``status`` (docs/reliability.md S7; ``status`` after the pidfd is open,
read like the others: no symlink followed, regular file, bounded); wait on a member's ``/proc``
read past its deadline; retry or spin on a process that will not die.

Size: over 600 lines, on purpose: the safety-critical path from a decision to a signal (observe
each member, re-verify it through its pidfd, the PID-1 rule, the bounded reads, the send) kept in
one reviewable module; the self-checks and the cgroup walk live beside it.
"""

from __future__ import annotations

import errno
import os
import select
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from signal import SIGCONT, SIGKILL, SIGTERM, Signals, pidfd_send_signal
from typing import TypeVar

from gpuguard.adapters.bounded_reads import Prober, Ran
from gpuguard.adapters.cgroup_members import cgroup_line_path, is_within, list_members
from gpuguard.adapters.cgroup_members import v2_root as cgroup_v2_root
from gpuguard.adapters.procfs import (
    PROBE_DEADLINE_SECONDS,
    PROBE_FLOOR_SECONDS,
    read_cgroup_text,
    read_identity,
    read_state,
    read_status_text,
)
from gpuguard.core.freeze import FrozenAllocation
from gpuguard.core.model import (
    ContainerCgroup,
    KillTarget,
    ProcessIdentity,
    RefusalReason,
    SignalRefusal,
    SignalReport,
    SigtermFate,
    StopSignal,
)
from gpuguard.core.stopping import parse_signal_state, plan_stop, sigterm_fate

CONTAINER_PID = 0
"""``SignalRefusal.pid`` of a refusal that concerns the whole container, not one member."""

MEMBER_READS_BUDGET_SECONDS = 1.0
"""Seconds one ``signal_container`` call waits, in all, on member reads that blocked in the
kernel (each is waited for ``PROBE_DEADLINE_SECONDS``, 0.25 s); past it each further read of that
call gets ``PROBE_FLOOR_SECONDS`` (0.02 s: a read that does not block takes ~0.1 ms). A container
with many members stuck in ``exec`` costs its own call about a second more, not a second each."""

BLOCKED_MEMBER_READS_LIMIT = 64
"""Member reads left blocked at once, each holding a helper thread until it returns. A PID whose
read is still blocked is refused without a new read. Past the limit a container that already has
a blocked read gets no new read (its members not read yet are refused); any other container's
are still read, so one tenant's stuck processes cannot keep a neighbour from being stopped."""

_CLK_TCK = os.sysconf("SC_CLK_TCK")

_SIGNALS: dict[StopSignal, Signals] = {StopSignal.TERM: SIGTERM, StopSignal.KILL: SIGKILL}


def boot_ticks() -> int:
    """Now, on the clock of ``/proc/<pid>/stat`` starttime: ``CLOCK_BOOTTIME`` in clock ticks.

    Taken *before* a member's identity is read, it stamps the observation (``Observation``):
    the read then proves the process was alive at or after this tick.
    """
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME) * _CLK_TCK // 1_000_000_000


@dataclass(frozen=True, slots=True, kw_only=True)
class Observation:
    """A member as read from ``/proc`` before its pidfd is opened.

    ``observed_at_ticks`` is ``boot_ticks()`` taken before ``identity`` was read. starttime has
    clock-tick resolution (10 ms at 100 Hz): a process observed alive at least one tick after it
    started cannot be confused with a successor holding its PID (which starts after it exits);
    one observed within its first tick can, if the successor lands in the same cgroup in the
    same tick, so such an observation is refused as ambiguous, never signalled.
    """

    identity: ProcessIdentity
    observed_at_ticks: int


# ---------------------------------------------------------------------------------------------
# The killer


class PidfdKiller:
    """``gpuguard.ports.Killer`` over ``pidfd_open(2)`` + ``pidfd_send_signal(2)``.

    ``cgroup_root`` is where the cgroup hierarchies are mounted (``/sys/fs/cgroup``): v1
    targets live in ``<cgroup_root>/<controller>``, v2 targets in ``v2_root``, which defaults
    to ``cgroup_root`` on a pure v2 host and to ``<cgroup_root>/unified`` on a hybrid one.
    ``proc_root`` is the host's /proc (hostPID). With ``use_cgroup_kill`` a SIGKILL of a v2
    container is followed by ``cgroup.kill`` (Linux ≥ 5.14), which also catches processes
    forked during the per-member pass. ``ticks`` is the clock observations are stamped with
    (``boot_ticks``; tests inject one).
    """

    def __init__(
        self,
        *,
        cgroup_root: Path,
        proc_root: Path,
        use_cgroup_kill: bool = False,
        v2_root: Path | None = None,
        ticks: Callable[[], int] = boot_ticks,
    ) -> None:
        self._cgroup_root = cgroup_root
        self._ticks = ticks
        self._v2_root = cgroup_v2_root(cgroup_root) if v2_root is None else v2_root
        self._proc_root = proc_root
        self._use_cgroup_kill = use_cgroup_kill
        self._reads = Prober(BLOCKED_MEMBER_READS_LIMIT, reader="killer-reads")
        # A killer dropped without being closed (tests, benchmarks) lets its idle helper go.
        weakref.finalize(self, self._reads.close)

    def close(self) -> None:
        """Let the idle helper thread of the member reads go (idempotent; a read left blocked
        ends its thread when it returns). The killer stays usable: a later read starts one."""
        self._reads.close()

    # -- where the container lives ------------------------------------------------------------

    def container_dir(self, cgroup: ContainerCgroup) -> Path | SignalRefusal:
        """The directory of the container's cgroup, or a refusal saying why it has none.

        v2: ``v2_root / path``; v1: ``cgroup_root / hierarchy-without-"name=" / path``.
        Refused: paths with ``..``/``.`` components (relative to a private cgroup namespace:
        unresolvable), the hierarchy root itself, unknown versions, odd hierarchy names, and
        a hierarchy directory that does not exist (misconfigured ``cgroup_root``).
        """

        def refuse(detail: str) -> SignalRefusal:
            return SignalRefusal(
                pid=CONTAINER_PID, reason=RefusalReason.NO_CONTAINER, detail=detail
            )

        parts = PurePosixPath(cgroup.path).parts
        rel = [p for p in parts if p != "/"]
        if any(p in ("..", ".") for p in cgroup.path.split("/")):
            return refuse(
                f"cgroup path {cgroup.path!r} is relative to another cgroup namespace "
                "(contains '..'): it cannot be resolved in this mount; run privileged or with "
                "the host cgroup namespace"
            )
        if not rel:
            return refuse(f"cgroup path {cgroup.path!r} is a hierarchy root, not a container")
        if cgroup.version == 2:
            base = self._v2_root
        elif cgroup.version == 1:
            name = cgroup.hierarchy.removeprefix("name=")
            if not name or "/" in name or name in ("..", "."):
                return refuse(f"invalid v1 hierarchy {cgroup.hierarchy!r}")
            base = self._cgroup_root / name
        else:
            return refuse(f"unknown cgroup version {cgroup.version}")
        if not (base / "cgroup.procs").is_file():
            return refuse(f"{base} is not a cgroup hierarchy mount (check cgroup_root)")
        return base.joinpath(*rel)

    def members(self, directory: Path) -> tuple[int, ...]:
        """PIDs in ``directory``'s ``cgroup.procs`` and in every descendant cgroup's, each once,
        in walk order (``cgroup_members.list_members``: raises ``OSError`` for a tree it cannot
        list, for ``signal_container`` to refuse the container with a reason)."""
        return list_members(directory)

    # -- signalling ---------------------------------------------------------------------------

    def signal_container(
        self, target: KillTarget, signal: StopSignal, *, wait_seconds: float = 0.0
    ) -> SignalReport:
        """Send ``signal`` to every member of the target container's cgroup (and below).

        Members are enumerated fresh from ``cgroup.procs`` and signalled by ``signal_members``.
        Never raises for a member; a container-level problem is a refusal with
        ``pid == CONTAINER_PID``.
        """
        directory = self.container_dir(target.cgroup)
        if isinstance(directory, SignalRefusal):
            return SignalReport(signal=signal, refused=(directory,))
        if not directory.is_dir():
            # The container's cgroup is gone: every member has exited already.
            return SignalReport(signal=signal)
        try:
            pids = self.members(directory)
        except (OSError, ValueError) as exc:
            # Every failure to stop a container is a counted refusal, never a bare log line.
            detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            refusal = SignalRefusal(
                pid=CONTAINER_PID,
                reason=RefusalReason.SIGNAL_FAILED,
                detail=f"cannot list the members of {directory}: {detail}",
            )
            return SignalReport(signal=signal, refused=(refusal,))
        return self.signal_members(pids, target, signal, wait_seconds=wait_seconds)

    def signal_members(
        self,
        members: Iterable[int | Observation],
        target: KillTarget,
        signal: StopSignal,
        *,
        wait_seconds: float = 0.0,
    ) -> SignalReport:
        """Signal each member that, after ``pidfd_open(2)``, is still as observed in ``target``.

        A PID is observed when its turn comes (``boot_ticks()``, then ``/proc/<pid>/stat``, read
        again after the tick if it fell in the process's first); an ``Observation`` was taken
        earlier by the caller (``signal_container`` passes PIDs). Two passes:

        1. Per member: refused ``identity_changed`` if observed within its first clock tick
           (``Observation``); then ``pidfd_open(2)`` and the check after opening:
           ``/proc/<pid>/stat`` starttime equals the observed one and the ``/proc/<pid>/cgroup``
           line of the target's hierarchy shows the target's path or a path below it, else
           refused ``identity_changed``, fd closed, nothing sent; a member that has exited (a
           zombie, reaped or not) is ``already_gone``, never refused nor signalled. At the
           SIGTERM step its ``/proc/<pid>/status`` is read too: what a SIGTERM would do to it
           (``core.stopping.sigterm_fate``).
        2. ``core.stopping.plan_stop`` picks each member's signal (SIGKILL at once for a
           member on which SIGTERM would be lost, when no member could use the termination
           timeout; ``SignalReport.stops``); then per member the same check again, through the
           pidfd still open, immediately before ``pidfd_send_signal(2)`` — so the window
           between the last check and the send is what it was with one pass.

        Every ``/proc`` read of a member is bounded (``_MemberReads``): one that blocks in the
        kernel makes that member a ``signal_failed`` refusal naming its PID, never a signal, and
        the call goes on with the next member.

        gpuguard's own process is refused ``exempt``. With ``use_cgroup_kill`` a SIGKILL step
        on a v2 container ends with ``cgroup.kill``. With ``wait_seconds`` > 0 the delivered
        pidfds are ``poll(2)``-ed until readable (the process exited) or the deadline; the rest
        are ``survivors``.
        """
        directory = self.container_dir(target.cgroup)
        if isinstance(directory, SignalRefusal):
            return SignalReport(signal=signal, refused=(directory,))
        reads = _MemberReads(self._reads, owner=target.cgroup)
        opened: list[_Opened] = []
        sent: list[_Opened] = []
        gone: list[int] = []
        refused: list[SignalRefusal] = []
        try:
            for member in members:
                opening = self._open_member(member, target, signal, reads)
                if isinstance(opening, _Opened):
                    opened.append(opening)
                else:
                    _sort(opening, gone, refused)
            stops = plan_stop(signal, {o.identity.pid: o.fate for o in opened})
            # An early SIGKILL goes last: the kernel ends every process of a PID namespace with
            # its init, and the others' own signal (and its report) comes first.
            early = {pid for pid, stop in stops.items() if stop.signal is not signal}
            for o in sorted(opened, key=lambda o: o.identity.pid in early):
                stop = stops.get(o.identity.pid)
                problem = self._verify_and_send(
                    o, target, stop.signal if stop is not None else signal, reads
                )
                if problem is None:
                    sent.append(o)
                else:
                    _sort(problem, gone, refused)
            if self._kills_cgroup(target, signal, refused):
                problem = _cgroup_kill(directory)
                if problem is not None:
                    refused.append(problem)
            survivors = _wait_for_exit(sent, wait_seconds)
        finally:
            for o in opened:
                os.close(o.fd)
        delivered = {o.identity.pid for o in sent}
        return SignalReport(
            signal=signal,
            delivered=tuple(o.identity for o in sent),
            already_gone=tuple(gone),
            refused=tuple(refused),
            survivors=survivors,
            stops=tuple(stop for pid, stop in stops.items() if pid in delivered),
        )

    def resume(self, frozen: FrozenAllocation) -> SignalRefusal | int | None:
        """SIGCONT to a caller the allocation guard froze, through a pidfd, only if after the
        open it is still the process read when its stop arrived (start time), still in its
        container's cgroup, and still stopped (``T``): ``None`` when sent, its PID when it is
        gone or already running (resumed by someone else: nothing to do), else a refusal. A
        process gpuguard did not freeze is never passed here (the guard's events name what it
        froze); one the tenant stopped itself is not resumed by this (a probe stop names it
        only if the probe stopped it)."""
        expected = frozen.attribution.identity
        cgroup = frozen.attribution.cgroup
        pid = frozen.tgid
        if expected is None or cgroup is None or expected.pid != pid:
            return SignalRefusal(
                pid=pid,
                reason=RefusalReason.IDENTITY_CHANGED,
                detail="its identity or cgroup was not read when it was frozen: not resumed",
            )
        reads = _MemberReads(self._reads, owner=cgroup)
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return pid
        except OSError as exc:
            return _os_error_refusal(pid, "pidfd_open", exc)
        try:
            return self._resume_opened(fd, expected, cgroup, reads)
        finally:
            os.close(fd)

    def _resume_opened(
        self, fd: int, expected: ProcessIdentity, cgroup: ContainerCgroup, reads: _MemberReads
    ) -> SignalRefusal | int | None:
        """``resume`` once the pidfd is open: re-read, check, SIGCONT."""
        pid = expected.pid

        def reread() -> tuple[ProcessIdentity | None, str | None, str | None]:
            return (
                read_identity(self._proc_root, pid),
                read_state(self._proc_root, pid),
                read_cgroup_text(self._proc_root, pid),
            )

        try:
            got = reads.run(pid, reread, _REREADING, _UNVERIFIED)
        except OSError as exc:
            return _os_error_refusal(pid, "re-read /proc/<pid>", exc)
        if isinstance(got, SignalRefusal):
            return got
        now, state, cgroup_text = got
        if now is None or cgroup_text is None or state != "T":
            # Gone, exited, or running again (its freeze was bounded elsewhere): nothing to do.
            return pid
        changed = _identity_change(expected, now, cgroup_text, cgroup)
        if changed is not None:
            return changed
        return _send_cont(fd, pid)

    def _kills_cgroup(
        self, target: KillTarget, signal: StopSignal, refused: list[SignalRefusal]
    ) -> bool:
        """``cgroup.kill`` follows: configured, SIGKILL, v2, and gpuguard is not a member."""
        return (
            self._use_cgroup_kill
            and signal is StopSignal.KILL
            and target.cgroup.version == 2
            and not any(r.reason is RefusalReason.EXEMPT for r in refused)
        )

    def _open_member(
        self, member: int | Observation, target: KillTarget, step: StopSignal, reads: _MemberReads
    ) -> _Opened | int | SignalRefusal:
        """Observe (unless observed already), then ``_open_one``; never gpuguard itself."""
        pid = member.identity.pid if isinstance(member, Observation) else member
        if pid == os.getpid():
            return SignalRefusal(
                pid=pid,
                reason=RefusalReason.EXEMPT,
                detail="gpuguard's own process is a member of the target cgroup",
            )
        observed = member if isinstance(member, Observation) else self._observe(pid, reads)
        if not isinstance(observed, Observation):
            return observed
        return self._open_one(observed, target, step, reads)

    def _observe(self, pid: int, reads: _MemberReads) -> Observation | int | SignalRefusal:
        """The member's observation, the PID if it is gone, or a refusal when
        ``/proc/<pid>/stat`` cannot be read (the other members still go on).

        An identity read in the clock tick its process started in is ambiguous (``Observation``):
        it is read again once that tick is over (at most one tick, 10 ms at 100 Hz, and only for
        members younger than that), so a process forked a moment ago is signalled like any other
        member. If the second reading is still ambiguous, ``_open_one`` refuses it.

        The read is bounded (``_MemberReads``): one that blocks in the kernel (an ``exec``
        stuck on a stopped FUSE daemon blocks ``stat``) is a refusal naming the PID.
        """
        observed = self._observe_once(pid, reads)
        if isinstance(observed, Observation) and _in_first_tick(observed):
            _sleep_past_tick(observed.identity.start_ticks)
            observed = self._observe_once(pid, reads)
        return observed

    def _observe_once(self, pid: int, reads: _MemberReads) -> Observation | int | SignalRefusal:
        """Stamp, then read ``(pid, starttime)``."""
        stamp = self._ticks()
        try:
            identity = reads.run(
                pid, lambda: read_identity(self._proc_root, pid), _OBSERVING, _UNREAD
            )
        except OSError as exc:
            return _os_error_refusal(pid, "read /proc/<pid>/stat", exc)
        if isinstance(identity, SignalRefusal):
            return identity
        if identity is None:
            return pid
        return Observation(identity=identity, observed_at_ticks=stamp)

    def _open_one(
        self, observed: Observation, target: KillTarget, step: StopSignal, reads: _MemberReads
    ) -> _Opened | int | SignalRefusal:
        """unambiguous? → open → re-verify (→ read ``status`` at the SIGTERM step) for one PID:
        opened (the caller owns and closes the pidfd), gone (the PID), or refused (the pidfd
        closed here)."""
        ambiguous = _first_tick_refusal(observed)
        if ambiguous is not None:
            return ambiguous
        pid = observed.identity.pid
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return pid
        except OSError as exc:
            return _os_error_refusal(pid, "pidfd_open", exc)
        keep = False
        try:
            now = self._verify(pid, observed.identity, target, reads)
            if not isinstance(now, ProcessIdentity):
                return now
            fate = SigtermFate.UNKNOWN
            if step is StopSignal.TERM:
                fate = self._sigterm_fate(pid, reads)
            keep = True
            return _Opened(identity=now, fd=fd, fate=fate)
        finally:
            if not keep:
                os.close(fd)

    def _verify(
        self, pid: int, expected: ProcessIdentity, target: KillTarget, reads: _MemberReads
    ) -> ProcessIdentity | int | SignalRefusal:
        """Re-read ``/proc/<pid>`` *after* its pidfd was opened: from then on the pidfd pins the
        process that held the number at open time; if ``/proc/<pid>`` still shows ``expected``
        in the target, that is the one. The identity now, the PID if it is gone, or a refusal
        (also when the re-read blocks past its deadline: never signal on an unread identity)."""

        def reread() -> tuple[ProcessIdentity | None, str | None, str | None]:
            return (
                read_identity(self._proc_root, pid),
                read_state(self._proc_root, pid),
                read_cgroup_text(self._proc_root, pid),
            )

        try:
            got = reads.run(pid, reread, _REREADING, _UNVERIFIED)
        except OSError as exc:  # cannot re-verify: never signal on an unread identity
            return _os_error_refusal(pid, "re-read /proc/<pid>", exc)
        if isinstance(got, SignalRefusal):
            return got
        now, state, cgroup_text = got
        if now is None or cgroup_text is None or state in _EXITED_STATES:
            # Reaped between the open and the re-read, or exited and not yet reaped: a zombie
            # has nothing left to stop (its memory is freed), is no longer in its v1 cgroup
            # (so it is not "identity changed") and must not count as signalled (matrix P3).
            return pid
        changed = _identity_change(expected, now, cgroup_text, target.cgroup)
        return changed if changed is not None else now

    def _sigterm_fate(self, pid: int, reads: _MemberReads) -> SigtermFate:
        """What SIGTERM would do to the (just re-verified) member, from its ``status``; an
        unreadable or unparsable one is ``unknown`` (it then gets SIGTERM and the timeout), and
        so is one whose read blocked past its deadline (its check before the send then finds
        its read still blocked, and refuses it)."""
        try:
            text = reads.run(
                pid, lambda: read_status_text(self._proc_root, pid), _READING_STATUS, _UNREAD
            )
        except OSError:
            return SigtermFate.UNKNOWN
        if isinstance(text, SignalRefusal):
            return SigtermFate.UNKNOWN
        return sigterm_fate(None if text is None else parse_signal_state(text))

    def _verify_and_send(
        self, opened: _Opened, target: KillTarget, stop: StopSignal, reads: _MemberReads
    ) -> int | SignalRefusal | None:
        """The check of ``_verify`` again, then the signal through the open pidfd: ``None``
        when sent, else the PID (gone) or a refusal."""
        pid = opened.identity.pid
        now = self._verify(pid, opened.identity, target, reads)
        if not isinstance(now, ProcessIdentity):
            return now
        try:
            pidfd_send_signal(opened.fd, _SIGNALS[stop])
        except ProcessLookupError:
            return pid
        except OSError as exc:
            return _os_error_refusal(pid, "pidfd_send_signal", exc)
        return None


# ---------------------------------------------------------------------------------------------
# Helpers


_EXITED_STATES = ("Z", "X")
"""``stat`` states of a process that has exited (zombie, dead): already gone, not signalled."""

_T = TypeVar("_T")

_OBSERVING = "reading /proc/<pid>/stat"
_REREADING = "re-reading /proc/<pid>/stat and cgroup after its pidfd was opened"
_READING_STATUS = "reading /proc/<pid>/status"
_UNREAD = "its identity cannot be read, so it is not signalled"
_UNVERIFIED = "it cannot be re-verified, so it is not signalled"
_BLOCKED_BY = "blocked in the kernel, as by an exec waiting on a stopped FUSE daemon"


class _MemberReads:
    """One ``signal_members`` call's reads of its members' ``/proc`` files, each run on the
    killer's helper thread (``bounded_reads.Prober``) and waited for at most
    ``PROBE_DEADLINE_SECONDS``, or ``PROBE_FLOOR_SECONDS`` once the call has waited
    ``MEMBER_READS_BUDGET_SECONDS`` on reads that blocked. A read that does not finish in time
    is a refusal naming the PID, and the member is not signalled (its identity is unread or
    unverified); the PID is not read again while that read stays blocked. Blocked reads are
    charged to ``owner`` (the container), see ``BLOCKED_MEMBER_READS_LIMIT``."""

    def __init__(self, prober: Prober, *, owner: ContainerCgroup) -> None:
        self._prober = prober
        self._owner = owner
        self._waited = 0.0

    def run(self, pid: int, read: Callable[[], _T], what: str, so: str) -> _T | SignalRefusal:
        """``read()``'s value, or a refusal saying ``what`` did not finish and ``so``. Raises
        what ``read`` raised (``OSError``: the caller's refusal, as before)."""
        got: list[_T] = []
        wait = (
            PROBE_DEADLINE_SECONDS
            if self._waited < MEMBER_READS_BUDGET_SECONDS
            else PROBE_FLOOR_SECONDS
        )
        ran = self._prober.run(pid, lambda: got.append(read()), wait, owner=self._owner)
        if ran is Ran.DONE:
            return got[0]
        if ran is Ran.LATE:
            self._waited += wait
            detail = f"{what} did not finish within {wait:g} s ({_BLOCKED_BY}): {so}"
        elif self._prober.still_blocked(pid):
            detail = (
                f"an earlier read of its /proc files is still blocked ({_BLOCKED_BY}), so it is "
                f"not read again: {so}"
            )
        else:
            detail = (
                f"not read: {BLOCKED_MEMBER_READS_LIMIT} reads of /proc are blocked on this node "
                f"and one of this container's is among them: {so}"
            )
        return SignalRefusal(
            pid=pid, reason=RefusalReason.SIGNAL_FAILED, detail=f"PID {pid}: {detail}"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class _Opened:
    """A member whose pidfd is open and whose identity was re-verified after the open."""

    identity: ProcessIdentity
    fd: int
    fate: SigtermFate
    """What SIGTERM would do to it (read at the SIGTERM step only; else ``unknown``)."""


def _in_first_tick(observed: Observation) -> bool:
    """Was the identity read in (or, for a PID reused meanwhile, before) its start tick?"""
    return observed.observed_at_ticks <= observed.identity.start_ticks


def _sleep_past_tick(start_ticks: int) -> None:
    """Sleep until the ``CLOCK_BOOTTIME`` tick after ``start_ticks`` has begun; one tick at most."""
    next_tick_ns = -(-(start_ticks + 1) * 1_000_000_000 // _CLK_TCK)
    remaining_ns = next_tick_ns - time.clock_gettime_ns(time.CLOCK_BOOTTIME)
    time.sleep(min(max(remaining_ns, 0), 1_000_000_000 // _CLK_TCK) / 1e9)


def _first_tick_refusal(observed: Observation) -> SignalRefusal | None:
    """Refusal of an identity observed in the clock tick its process started in (see
    ``Observation``); ``None`` when the observation came at least one tick later."""
    if not _in_first_tick(observed):
        return None
    expected = observed.identity
    return SignalRefusal(
        pid=expected.pid,
        reason=RefusalReason.IDENTITY_CHANGED,
        detail=(
            f"identity observed in the clock tick the process started in "
            f"({expected.start_ticks}): a successor with its PID could share its "
            "starttime, so it cannot be proven"
        ),
    )


def _identity_change(
    expected: ProcessIdentity, now: ProcessIdentity, cgroup_text: str, cgroup: ContainerCgroup
) -> SignalRefusal | None:
    """Refusal when the process now behind the PID is not ``expected`` in ``cgroup``: another
    starttime (the PID was reused) or another cgroup (it left the container)."""
    if now.start_ticks != expected.start_ticks:
        return SignalRefusal(
            pid=expected.pid,
            reason=RefusalReason.IDENTITY_CHANGED,
            detail=(
                f"starttime is {now.start_ticks}, expected {expected.start_ticks}: "
                "the PID was reused by another process"
            ),
        )
    line_path = cgroup_line_path(cgroup_text, cgroup)
    if line_path is None or not is_within(line_path, cgroup.path):
        return SignalRefusal(
            pid=expected.pid,
            reason=RefusalReason.IDENTITY_CHANGED,
            detail=(
                f"cgroup is now {line_path!r}, not within {cgroup.path!r}: it left the container"
            ),
        )
    return None


def _sort(outcome: int | SignalRefusal, gone: list[int], refused: list[SignalRefusal]) -> None:
    if isinstance(outcome, SignalRefusal):
        refused.append(outcome)
    else:
        gone.append(outcome)


def _send_cont(fd: int, pid: int) -> SignalRefusal | int | None:
    """SIGCONT through the open pidfd: ``None`` when sent, the PID when gone, else a refusal."""
    try:
        pidfd_send_signal(fd, SIGCONT)
    except ProcessLookupError:
        return pid
    except OSError as exc:
        return _os_error_refusal(pid, "pidfd_send_signal", exc)
    return None


def _os_error_refusal(pid: int, call: str, exc: OSError) -> SignalRefusal:
    """``permission_denied`` for EPERM/EACCES; ``signal_failed`` for any other ``OSError`` from
    ``pidfd_open``/``pidfd_send_signal`` (EINVAL when gpuguard is not in an ancestor PID
    namespace of the target, EMFILE) or from reading ``/proc`` or the cgroup tree."""
    text = f"{call}: {exc.strerror or exc} (errno {exc.errno})"
    if exc.errno in (errno.EPERM, errno.EACCES):
        # No retry: missing CAP_KILL, AppArmor or a user-namespaced pod (matrix P7, A9).
        return SignalRefusal(pid=pid, reason=RefusalReason.PERMISSION_DENIED, detail=text)
    return SignalRefusal(pid=pid, reason=RefusalReason.SIGNAL_FAILED, detail=text)


def _cgroup_kill(directory: Path) -> SignalRefusal | None:
    """Write ``1`` to ``<directory>/cgroup.kill`` (SIGKILL to the cgroup and its descendants).

    ``directory`` was derived from the target by ``container_dir``; it is checked to be a real
    directory (not a symlink) that has a ``cgroup.kill`` file before writing.
    """
    try:
        if directory.is_symlink() or not directory.is_dir():
            return None  # gone (or never a cgroup): nothing left to kill
        kill_file = directory / "cgroup.kill"
        if not kill_file.is_file():
            return SignalRefusal(
                pid=CONTAINER_PID,
                reason=RefusalReason.SIGNAL_FAILED,
                detail=f"{kill_file} does not exist (kernel < 5.14 or not cgroup v2)",
            )
        kill_file.write_text("1", encoding="ascii")
    except FileNotFoundError:
        return None
    except OSError as exc:
        return _os_error_refusal(CONTAINER_PID, f"write {directory}/cgroup.kill", exc)
    return None


def _wait_for_exit(sent: list[_Opened], wait_seconds: float) -> tuple[ProcessIdentity, ...]:
    """Wait (``poll(2)`` on the pidfds, no busy loop) until each process exited or the deadline.

    A pidfd becomes readable when its process terminates (pidfd_open(2)); zombies count as
    exited. Returns the identities still alive at the deadline; with ``wait_seconds`` <= 0 no
    waiting is done and nothing is reported as a survivor.
    """
    if wait_seconds <= 0 or not sent:
        return ()
    by_fd = {s.fd: s.identity for s in sent}
    poller = select.poll()
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    alive = set(by_fd)
    deadline = time.monotonic() + wait_seconds
    while alive:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        for fd, _events in poller.poll(max(1, int(remaining * 1000))):
            alive.discard(fd)
            poller.unregister(fd)
    return tuple(by_fd[fd] for fd in by_fd if fd in alive)
