"""Stopping: which signal each member of an offending container gets, and why.

Owns the signal rule of the escalation's SIGTERM step, member by member: parsing the
``NSpid`` line and the signal masks of a ``/proc/<pid>/status`` text, what a SIGTERM from the
host does to that process (``SigtermFate``), the plan for the container (``plan_stop``) and the
words that say which signal went to which process (``describe_delivery``). Must not do I/O:
``adapters.killer`` reads ``status`` after re-verifying the member through its pidfd, asks
``plan_stop``, and sends.

The kernel rule (``kernel/signal.c``: ``sig_task_ignored``, ``SIGNAL_UNKILLABLE``): a signal
whose action is the default is dropped for the init of a PID namespace (PID 1 inside it, the
container's entrypoint), also when it comes from an ancestor namespace; only SIGKILL and SIGSTOP
from an ancestor namespace reach it. A caught signal reaches it; an ignored one is discarded for
every process; a blocked one stays pending. So ``python train.py`` as a container's PID 1, which
installs no SIGTERM handler, never sees gpuguard's SIGTERM, and before this rule its neighbours
waited the whole termination timeout for the SIGKILL (verified on a real kubelet and containerd;
docs/safety.md, Signals that land).

The rule, at the SIGTERM step (the grace period and two fresh listings already confirmed the
violation; the SIGKILL step is unchanged, SIGKILL to every member):

- A member on which SIGTERM would be lost (``DROPPED_BY_INIT``, ``IGNORED``) gets SIGKILL at once
  **when no member of the container can use the termination timeout** (none catches SIGTERM,
  blocks it, or has an unreadable status): the timeout exists to let a process save state, and
  nothing in the container would. The other members get SIGTERM, which ends them at once.
- Otherwise it gets SIGTERM like the rest (lost, and said so), and the SIGKILL after the timeout.
  A container's PID 1 is its PID namespace's init: the kernel ends every process of the
  namespace when it dies, so a SIGKILL to a shell entrypoint that forwards nothing would also
  kill, without its SIGTERM, the worker it runs that catches it. A process that ignores SIGTERM
  beside one that catches it may be a worker whose supervisor coordinates the shutdown.

Blind spot, by design on the cautious side except one case: a process that takes SIGTERM with
``sigwait(3)``/``sigtimedwait(2)`` shows no handler, and while it waits no block either (the
kernel unblocks the waited set for the wait): as a PID 1 it reads ``DROPPED_BY_INIT``. The init
shims that do this (tini, dumb-init) only forward signals, and gpuguard signals each of their
children itself, so the shim's early SIGKILL changes nothing when no child catches SIGTERM (and
when one does, everyone waits). A PID 1 that does its own shutdown work on a ``sigwait``-ed
SIGTERM, with nothing beside it that catches SIGTERM, is stopped by SIGKILL at the SIGTERM step:
a handler (``SigCgt``) or ``signalfd(2)`` (``SigBlk``) gets it the timeout.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from gpuguard.core.cgroup import kernel_lines
from gpuguard.core.model import MemberStop, SignalReport, SigtermFate, StopSignal

SIGTERM_BIT = 1 << (15 - 1)
"""SIGTERM (15) in a ``/proc/<pid>/status`` signal mask: signal ``n`` is bit ``n - 1``."""

_MASK = re.compile(r"[0-9a-fA-F]{1,16}")
"""A signal mask as the kernel prints it: hex digits only, at most 64 bits (16 digits)."""
_NSPID = re.compile(r"[0-9]{1,10}")

CAN_WAIT = frozenset({SigtermFate.CAUGHT, SigtermFate.BLOCKED, SigtermFate.UNKNOWN})
"""Fates of a member that may use the termination timeout (``UNKNOWN``: the cautious side)."""
LOST = frozenset({SigtermFate.DROPPED_BY_INIT, SigtermFate.IGNORED})
"""Fates of a member on which SIGTERM is lost."""

MAX_PIDS_NAMED = 8
"""PIDs named per group in ``describe_delivery``; the rest are counted (Events hold 1 KiB)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SignalState:
    """The lines of a ``/proc/<pid>/status`` text that decide what SIGTERM does to it."""

    nspid: tuple[int, ...]
    """The PID in each PID namespace from the one the reader's ``/proc`` belongs to down to the
    process's own; the last is the PID it sees for itself (1: its namespace's init)."""
    caught: int
    """``SigCgt``: signals with a handler installed (shared by all threads)."""
    ignored: int
    """``SigIgn``: signals set to ``SIG_IGN`` (shared by all threads)."""
    blocked: int
    """``SigBlk`` of the main thread (per thread: another thread may differ)."""


def parse_signal_state(status: str) -> SignalState | None:
    """``NSpid``, ``SigCgt``, ``SigIgn`` and ``SigBlk`` of a ``/proc/<pid>/status`` text;
    ``None`` when one is missing or not what the kernel prints (a status written by hand, a
    kernel before 4.1 without ``NSpid``)."""
    fields: dict[str, str] = {}
    for line in kernel_lines(status):
        key, sep, value = line.partition(":")
        if sep and key in ("NSpid", "SigCgt", "SigIgn", "SigBlk") and key not in fields:
            fields[key] = value.strip()
    masks: dict[str, int] = {}
    for key in ("SigCgt", "SigIgn", "SigBlk"):
        raw = fields.get(key)
        # int(raw, 16) would also take "0x4000", "+4000" and "40_00": not the kernel's form.
        if raw is None or not _MASK.fullmatch(raw):
            return None
        masks[key] = int(raw, 16)
    ids = fields.get("NSpid", "").split()
    if not ids or not all(_NSPID.fullmatch(i) for i in ids):
        return None
    return SignalState(
        nspid=tuple(int(i) for i in ids),
        caught=masks["SigCgt"],
        ignored=masks["SigIgn"],
        blocked=masks["SigBlk"],
    )


def sigterm_fate(state: SignalState | None) -> SigtermFate:
    """What a SIGTERM from the host does to the process whose status is ``state``.

    In the kernel's order: a handler takes it (also on an init); a blocked one stays pending
    (it may be taken by ``signalfd``/``sigwaitinfo``, or lost when unblocked: not knowable, so
    counted as taken); an ignored one is discarded; with the default action an init drops it and
    any other process ends.
    """
    if state is None:
        return SigtermFate.UNKNOWN
    if state.caught & SIGTERM_BIT:
        return SigtermFate.CAUGHT
    if state.blocked & SIGTERM_BIT:
        return SigtermFate.BLOCKED
    if state.ignored & SIGTERM_BIT:
        return SigtermFate.IGNORED
    if state.nspid[-1] == 1:
        return SigtermFate.DROPPED_BY_INIT
    return SigtermFate.TERMINATES


_LOST_WHY = {
    SigtermFate.DROPPED_BY_INIT: (
        "PID 1 of its PID namespace with no SIGTERM handler: SIGTERM would be dropped"
    ),
    SigtermFate.IGNORED: "it ignores SIGTERM: SIGTERM would be discarded",
}

_WAITS_BECAUSE = {
    SigtermFate.CAUGHT: "catches SIGTERM",
    SigtermFate.BLOCKED: "blocks SIGTERM (it may take it with signalfd or sigwait)",
    SigtermFate.UNKNOWN: "has a status that could not be read",
}


def plan_stop(step: StopSignal, fates: Mapping[int, SigtermFate]) -> dict[int, MemberStop]:
    """The signal for each member on which SIGTERM would be lost, at escalation step ``step``
    (members not in the result get ``step``'s signal). ``fates``: every member about to be
    signalled (re-verified), by PID.

    At the SIGKILL step nothing differs. At the SIGTERM step a lost member gets SIGKILL when no
    member may use the termination timeout, else SIGTERM with the reason it waits (see the
    module docstring for why)."""
    if step is not StopSignal.TERM:
        return {}
    waiting = sorted(pid for pid, fate in fates.items() if fate in CAN_WAIT)
    stops: dict[int, MemberStop] = {}
    for pid, fate in sorted(fates.items()):
        if fate not in LOST:
            continue
        if not waiting:
            stops[pid] = MemberStop(
                pid=pid,
                signal=StopSignal.KILL,
                fate=fate,
                detail=(
                    f"{_LOST_WHY[fate]}, and no process of the container catches SIGTERM, so "
                    "none would use the termination timeout"
                ),
            )
            continue
        first = waiting[0]
        namespace = (
            " (a SIGKILL to it would end every process of its PID namespace)"
            if fate is SigtermFate.DROPPED_BY_INIT
            else ""
        )
        stops[pid] = MemberStop(
            pid=pid,
            signal=StopSignal.TERM,
            fate=fate,
            detail=(
                f"{_LOST_WHY[fate]}; SIGKILL follows after the termination timeout, as PID "
                f"{first} {_WAITS_BECAUSE[fates[first]]}{namespace}"
            ),
        )
    return stops


def describe_delivery(report: SignalReport) -> str:
    """Which signal went to which delivered process, and why where it is not simply the step's:
    ``SIGKILL to PID 4242 (PID 1 of its PID namespace …) and SIGTERM to 2 processes (PIDs
    4250, 4251)``. At most ``MAX_PIDS_NAMED`` PIDs per group; the others are counted."""
    details = {s.pid: s.detail for s in report.stops}
    groups: dict[tuple[StopSignal, str], list[int]] = {}
    for identity in report.delivered:
        key = (report.signal_of(identity.pid), details.get(identity.pid, ""))
        groups.setdefault(key, []).append(identity.pid)
    # SIGKILL first (the news, when a step sent it early), else in the order delivered.
    ordered = sorted(groups.items(), key=lambda g: g[0][0] is not StopSignal.KILL)
    parts = [_group(signal, why, pids) for (signal, why), pids in ordered]
    if len(parts) <= 1:
        return "".join(parts)
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def _group(signal: StopSignal, why: str, pids: list[int]) -> str:
    named = ", ".join(str(p) for p in pids[:MAX_PIDS_NAMED])
    more = f" and {len(pids) - MAX_PIDS_NAMED} more" if len(pids) > MAX_PIDS_NAMED else ""
    who = f"PID {named}" if len(pids) == 1 else f"{len(pids)} processes (PIDs {named}{more})"
    return f"{signal.value} to {who}" + (f" ({why})" if why else "")
