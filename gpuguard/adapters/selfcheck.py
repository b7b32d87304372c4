"""selfcheck: the enforcer's start-up self-checks of what signalling and attribution need.

Owns three checks ``app.run_enforce`` makes before anything starts, each read from the kernel,
never assumed: the host PID namespace (``check_host_pid_namespace``: NVML reports host PIDs and a
pidfd reaches only the caller's PID namespace and below; docs/design.md, Safety invariants), the
privileges (``check_privileges``: ``CAP_KILL`` in the effective set, and whether other users'
GPU files can be read) and a readable host ``/proc`` (``check_proc_readable``). Each returns what
it saw, a stable reason and the fix; ``app`` decides what blocks (``refuse_without_privileges``).

Must not: signal, open a pidfd, or read any process's files but this process's own
``/proc/self`` ones and PID 1's ``stat`` and ``cgroup`` under ``proc_root``; decide from the uid
what the capabilities decide.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from gpuguard.adapters.procfs import read_cgroup_text, read_identity
from gpuguard.core.cgroup import kernel_lines

INIT_PID_NAMESPACE_INODE = 0xEFFFFFFC
"""``PROC_PID_INIT_INO`` (include/linux/proc_ns.h): ``/proc/self/ns/pid`` of the initial PID
namespace always reads ``pid:[4026531836]``."""


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
