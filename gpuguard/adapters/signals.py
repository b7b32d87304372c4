"""signals: stops a container's processes through pidfds, each re-verified after opening.

Owns the only code path in gpuguard that sends a signal, and the start-up self-checks that
decide whether signalling is possible at all: the host PID namespace (docs/design.md, Safety
invariants) and the privileges (``CAP_KILL`` in the effective set). The sequence per member is the
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

Size: over 600 lines, on purpose: the safety-critical path from a decision to a signal (re-verify
each member, walk the container's cgroup, signal through pidfds, the PID-1 rule) kept in one
reviewable module.
"""

from __future__ import annotations

import errno
import os
import re
import select
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from signal import SIGKILL, SIGTERM, Signals, pidfd_send_signal
from typing import TypeVar

from gpuguard.adapters.bounded_reads import Prober, Ran
from gpuguard.adapters.procfs import (
    PROBE_DEADLINE_SECONDS,
    PROBE_FLOOR_SECONDS,
    read_cgroup_text,
    read_identity,
    read_state,
    read_status_text,
)
from gpuguard.core.cgroup import kernel_lines
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

MAX_CGROUPS_WALKED = 100_000
"""Bound on the cgroups one container's walk visits: a tenant with cgroup delegation can create
nested cgroups, and the walk must end. Beyond it the container is refused, not half-signalled
silently."""

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

INIT_PID_NAMESPACE_INODE = 0xEFFFFFFC
"""``PROC_PID_INIT_INO`` (include/linux/proc_ns.h): ``/proc/self/ns/pid`` of the initial PID
namespace always reads ``pid:[4026531836]``."""

_CLK_TCK = os.sysconf("SC_CLK_TCK")

_SIGNALS: dict[StopSignal, Signals] = {StopSignal.TERM: SIGTERM, StopSignal.KILL: SIGKILL}


# ---------------------------------------------------------------------------------------------
# Host PID namespace self-check


@dataclass(frozen=True, slots=True, kw_only=True)
class PidNamespaceCheck:
    """Outcome of the host-PID self-check; ``reason`` is a stable metric label value."""

    ok: bool
    reason: str | None
    """``None`` when ok; else ``not_host_pid_namespace`` or ``pid_namespace_unknown``."""
    detail: str
    """What was seen, why it matters and the fix, for logs and the exit message."""


_FIX = (
    "gpuguard's enforcer must run with `hostPID: true` in its pod spec: NVML reports host PIDs, "
    "and pidfd_send_signal(2) only reaches processes in the caller's PID namespace or below it, "
    "so from a child namespace gpuguard would read the wrong processes and could signal none"
)


def check_host_pid_namespace(
    proc_self_status: Path = Path("/proc/self/status"),
    proc_self_ns_pid: Path | None = Path("/proc/self/ns/pid"),
) -> PidNamespaceCheck:
    """Is this process in the host PID namespace? Needs no capability.

    Two facts are combined, because ``NSpid`` alone is not enough: it lists the PID in each
    namespace from *the one that mounted this /proc* down to ours, so inside a child namespace
    with its own /proc (every non-hostPID container, ``unshare --pid --mount-proc``) it has one
    field, exactly as on the host.

    1. ``NSpid`` in ``/proc/self/status`` with more than one field: nested, conclusively.
    2. ``/proc/self/ns/pid`` (``readlink(2)``) must be the initial namespace
       ``pid:[4026531836]``. Pass ``proc_self_ns_pid=None`` to skip this (a node whose "host"
       is itself a container, e.g. a kind node); when the link cannot be read, (1) decides.
    """
    try:
        # Bytes, then decode: text mode's universal newlines would turn a "\r" into a line break.
        status = proc_self_status.read_bytes().decode("utf-8", errors="replace")
    except OSError as exc:
        return PidNamespaceCheck(
            ok=False,
            reason="pid_namespace_unknown",
            detail=f"cannot read {proc_self_status} ({exc.strerror}); {_FIX}",
        )
    nspid: list[str] | None = None
    for line in kernel_lines(status):
        if line.startswith("NSpid:"):
            nspid = line.split(":", 1)[1].split()
            break
    if not nspid:
        return PidNamespaceCheck(
            ok=False,
            reason="pid_namespace_unknown",
            detail=f"{proc_self_status} has no NSpid line (kernel < 4.1?); {_FIX}",
        )
    if len(nspid) > 1:
        return PidNamespaceCheck(
            ok=False,
            reason="not_host_pid_namespace",
            detail=(
                f"NSpid in {proc_self_status} is {' '.join(nspid)!r}: this process is PID "
                f"{nspid[-1]} in a PID namespace nested {len(nspid) - 1} level(s) below the "
                f"host's; {_FIX}"
            ),
        )
    if proc_self_ns_pid is not None:
        try:
            link = os.readlink(proc_self_ns_pid)
        except OSError:
            link = None
        expected = f"pid:[{INIT_PID_NAMESPACE_INODE}]"
        if link is not None and link != expected:
            return PidNamespaceCheck(
                ok=False,
                reason="not_host_pid_namespace",
                detail=(
                    f"{proc_self_ns_pid} is {link!r}, not the initial PID namespace {expected} "
                    f"(NSpid has one field only because /proc was mounted inside that "
                    f"namespace); {_FIX}"
                ),
            )
    return PidNamespaceCheck(ok=True, reason=None, detail="in the host PID namespace")


# ---------------------------------------------------------------------------------------------
# Privilege self-check

CAP_DAC_OVERRIDE = 1
CAP_DAC_READ_SEARCH = 2
CAP_KILL = 5
CAP_SYS_PTRACE = 19
"""Capability bit numbers (include/uapi/linux/capability.h)."""

_CAP_SET = re.compile(r"[0-9a-fA-F]{1,16}")
"""A capability set: hex digits only, at most 64 bits (``/proc/<pid>/status`` prints 16)."""

SIGNAL_FIX = (
    "give the enforcer container CAP_KILL in its effective set, as the chart's securityContext "
    "does: `runAsUser: 0` with `capabilities: {drop: [ALL], add: [KILL]}` "
    "(helm/gpuguard/templates/daemonset.yaml). A non-root user gets no effective capability "
    "from `add` (kubernetes/kubernetes#56374), so a values override, policy engine or "
    "admission webhook that sets runAsUser/runAsNonRoot or drops KILL is what to look for"
)
"""How to give the enforcer what the privilege self-check asks for (logs, docs)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PrivilegeCheck:
    """Outcome of the privilege self-check: what this process may do to other users' processes,
    from its effective capability set (``CapEff``), never from its uid."""

    can_signal: bool
    """``CAP_KILL`` is effective. The kernel lets a signal through when the sender's uid
    matches the target's or the sender has ``CAP_KILL`` (kill_ok_by_cred): uid 0 without it
    reaches only root's own processes, uid 65534 with it (ambient) reaches every pod's."""
    reason: str | None
    """``None`` when it can signal; else ``cannot_signal`` (a stable metric label value)."""
    detail: str
    """What was seen and what it means, for logs, ``/readyz`` and each refusal."""
    reads_gpu_files: bool
    """``CAP_SYS_PTRACE`` and ``CAP_DAC_READ_SEARCH`` (or ``CAP_DAC_OVERRIDE``) are effective:
    ``/proc/<pid>/fd`` of another user's process is mode 0500 owned by that user (the DAC
    capability lists it), and ``stat``/``readlink`` of its links needs ptrace read access
    (``PTRACE_MODE_READ_FSCREDS``, proc(5)), which also fails for a root process holding
    capabilities the enforcer lacks. Measured on the real kernel (tests/test_selfcheck.py):
    with KILL only, as the chart grants, every other user's GPU files are unreadable, and
    ``Attribution.holds_gpu`` is unknown (charged like an open file, docs/safety.md)."""


def _status_field(status: str, key: str) -> str | None:
    """The value of the ``key:`` line of a ``/proc/<pid>/status`` text, stripped."""
    for line in kernel_lines(status):
        if line.startswith(f"{key}:"):
            return line.split(":", 1)[1].strip()
    return None


def check_privileges(proc_self_status: Path = Path("/proc/self/status")) -> PrivilegeCheck:
    """May this process signal, and see the open GPU files of, other users' processes?

    Decided on ``CapEff`` alone: the kernel checks capabilities, not uid 0. A status file that
    cannot be read, or has no readable ``CapEff``, cannot prove ``CAP_KILL``: refused like
    a set without it (the host-PID check treats an unknown answer the same way)."""
    try:
        # Bytes, then decode, as check_host_pid_namespace does.
        status = proc_self_status.read_bytes().decode("utf-8", errors="replace")
    except OSError as exc:
        return _cannot_signal(f"cannot read {proc_self_status} ({exc.strerror})")
    raw = _status_field(status, "CapEff")
    if raw is None:
        return _cannot_signal(f"{proc_self_status} has no CapEff line")
    if not _CAP_SET.fullmatch(raw):
        # int(raw, 16) would also take "0x20", "+20" and "0_20": none is what the kernel prints.
        return _cannot_signal(f"CapEff in {proc_self_status} is {raw!r}, not a capability set")
    caps = int(raw, 16)
    reads_gpu_files = bool(
        caps & 1 << CAP_SYS_PTRACE and caps & (1 << CAP_DAC_READ_SEARCH | 1 << CAP_DAC_OVERRIDE)
    )
    if caps & 1 << CAP_KILL:
        return PrivilegeCheck(
            can_signal=True,
            reason=None,
            detail="CAP_KILL is effective",
            reads_gpu_files=reads_gpu_files,
        )
    uids = (_status_field(status, "Uid") or "").split()
    uid = uids[1] if len(uids) > 1 else "?"  # real, effective, saved, filesystem
    seen = (
        f"CapEff {caps:016x} (uid {uid}) lacks CAP_KILL (bit 5): the kernel refuses every "
        "signal to another user's process (EPERM)"
    )
    if uid == "0":
        seen += (
            "; this uid 0 is root only in name: signals are checked against capabilities, and "
            "without CAP_KILL only root's own processes can be signalled"
        )
    return _cannot_signal(seen, reads_gpu_files=reads_gpu_files)


def _cannot_signal(detail: str, *, reads_gpu_files: bool = False) -> PrivilegeCheck:
    return PrivilegeCheck(
        can_signal=False, reason="cannot_signal", detail=detail, reads_gpu_files=reads_gpu_files
    )


def check_proc_readable(proc_root: Path) -> str | None:
    """``None`` when ``<proc_root>/1/stat`` and ``cgroup`` can be read, else what went wrong.

    Both files are world-readable (mode 0444, no ptrace check): no capability is needed to
    attribute another user's process. PID 1 is the host's init, another user's process or one
    holding capabilities the enforcer lacks; when it is hidden (``/proc`` mounted with
    ``hidepid``, or ``node.proc_root`` that is no ``/proc`` of the host) every GPU process
    would be too, and all their memory would be reported unattributed."""
    for name, read in (("stat", read_identity), ("cgroup", read_cgroup_text)):
        path = f"{proc_root}/1/{name}"
        try:
            found = read(proc_root, 1)
        except OSError as exc:
            return f"cannot read {path} ({exc.strerror or exc})"
        if found is None:
            return f"{path} is missing (no PID 1: hidepid, or not the host's /proc)"
    return None


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
# Cgroup membership


def cgroup_line_path(cgroup_text: str, cgroup: ContainerCgroup) -> str | None:
    """The path on the line of ``cgroup``'s hierarchy in a ``/proc/<pid>/cgroup`` text.

    v2: the ``0::`` line; v1: the line whose controller list equals ``cgroup.hierarchy``
    (``pids``, ``name=systemd``). ``None`` when the process has no such line.
    """
    for line in kernel_lines(cgroup_text):
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy_id, controllers, path = parts
        if cgroup.version == 2:
            if hierarchy_id == "0" and controllers == "":
                return path
        elif hierarchy_id != "0" and controllers == cgroup.hierarchy:
            return path
    return None


def is_within(path: str, container_path: str) -> bool:
    """``path`` is ``container_path`` or a cgroup below it (component-wise, not by prefix)."""
    base = container_path.rstrip("/")
    return path == base or path.startswith(base + "/")


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
        if v2_root is None:
            # Hybrid hosts mount v2 at <cgroup_root>/unified next to the v1 controllers.
            hybrid = cgroup_root / "unified"
            pure_v2 = (cgroup_root / "cgroup.procs").is_file()
            v2_root = hybrid if not pure_v2 and (hybrid / "cgroup.procs").is_file() else cgroup_root
        self._v2_root = v2_root
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
        """PIDs in ``directory``'s ``cgroup.procs`` and in every descendant cgroup's.

        Walks directory file descriptors (``openat`` relative to the parent, never following
        symlinks), so a tree deeper than ``PATH_MAX`` is walked like any other. Cgroups that
        vanish during the walk (the container is exiting) are skipped; any other ``OSError``
        (EMFILE, EACCES, ...) or a tree larger than ``MAX_CGROUPS_WALKED`` raises, for the caller
        to refuse the container with a reason. Each PID once, in walk order.
        """
        seen: dict[int, None] = {}
        for procs in _walk_cgroup_procs(directory):
            for token in procs.split():
                seen.setdefault(int(token), None)
        return tuple(seen)

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


class _DirFd:
    """A directory fd shared by its pending children; closed when the last one is opened."""

    __slots__ = ("fd", "pending")

    def __init__(self, fd: int, pending: int) -> None:
        self.fd = fd
        self.pending = pending

    def release(self) -> None:
        self.pending -= 1
        if self.pending == 0:
            os.close(self.fd)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


_Pending = tuple[_DirFd | None, str, int | None]
"""A cgroup still to visit: (its parent's shared fd, its name) or (None, "", its open fd)."""


def _walk_cgroup_procs(directory: Path) -> Iterator[str]:
    """The ``cgroup.procs`` text of ``directory`` and of every cgroup below it, parents first.

    Each directory is opened relative to its parent's fd, so no path string ever grows with the
    tree's depth (ENAMETOOLONG past ``PATH_MAX`` let a container nest its processes out of
    reach). A parent's fd stays open only while some child of it is still pending.
    """
    try:
        root = os.open(directory, _DIR_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return
    stack: list[_Pending] = [(None, "", root)]
    visited = 0
    try:
        while stack:
            fd = _open_pending(*stack.pop())
            if fd is None:
                continue  # removed during the walk
            visited += 1
            if visited > MAX_CGROUPS_WALKED:
                os.close(fd)
                raise OSError(
                    errno.E2BIG, f"more than {MAX_CGROUPS_WALKED} cgroups below {directory}"
                )
            yield _visit(fd, stack)
    finally:
        for parent, _name, fd in stack:
            if fd is not None:
                os.close(fd)
            elif parent is not None:
                parent.release()


def _open_pending(parent: _DirFd | None, name: str, fd: int | None) -> int | None:
    """The open fd of a pending cgroup (opened relative to its parent's, which is released);
    ``None`` when it was removed meanwhile."""
    if fd is not None:
        return fd
    assert parent is not None
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent.fd)
    except (FileNotFoundError, NotADirectoryError):
        return None
    finally:
        parent.release()


def _visit(fd: int, stack: list[_Pending]) -> str:
    """Read one open cgroup: its ``cgroup.procs`` text; its children are pushed onto
    ``stack`` sharing ``fd``, which is closed here when it has none (or on an error)."""
    try:
        procs, children = _read_cgroup_dir(fd)
    except BaseException:
        os.close(fd)
        raise
    if children:
        shared = _DirFd(fd, len(children))
        stack.extend((shared, child, None) for child in children)
    else:
        os.close(fd)
    return procs


def _read_cgroup_dir(dir_fd: int) -> tuple[str, list[str]]:
    """``cgroup.procs`` of an open cgroup directory and its child cgroups' names (walk order).
    A cgroup removed meanwhile reads as empty."""
    try:
        fd = os.open("cgroup.procs", os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dir_fd)
        try:
            chunks = []
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
        finally:
            os.close(fd)
        with os.scandir(dir_fd) as entries:
            children = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, ProcessLookupError):
        return "", []
    return b"".join(chunks).decode("ascii"), sorted(children, reverse=True)


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
