"""The fault suite's one oracle (docs/reliability.md, The oracle): every signal the enforcer
sent, compared with the ground truth of the test's processes.

Owns three records and their comparison:

- the ground truth: each process a test started, with its role (``Role``: an offender over its
  limit, a bystander under it, an exempt or host process, a reused PID, a process whose pod or
  GPU cannot be verified) and whether the test expects the enforcer to stop it;
- what each process received: the signals it caught and wrote down, plus an uncatchable SIGKILL
  read from its exit status (``Recorded.received``), less what the test itself sent it;
- what each enforcer says it sent: its ``container_signalled`` JSON log lines (signal, pod,
  container, pids), one list per enforcer process (an escalation never outlives its process).

``Oracle.violations`` is a pure function of the three (a test can feed it fabricated records and
see it fail); ``Oracle.check`` reads the live records, waits until every signal a process
received is in an enforcer's log (a stopped process dies before the enforcer writes the line
that says so), and fails the test listing every violation.

Must not signal, wait on or reap any process: it only reads records.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import pytest

SIGNAL_EVENT = "container_signalled"
"""The enforcer's log line for each signal it delivered (``gpuguard.runtime.enforcer``)."""

_RECEIVED_NAME = {"SIGTERM": "SIGTERM", "SIGKILL": "KILL"}
"""Enforcer signal name → how a worker records receiving it (SIGKILL: its exit status)."""


class Role(enum.StrEnum):
    """What a process is, as far as the enforcer is allowed to know."""

    OFFENDER = "offender"
    """In a non-exempt pod over its limit on a readable GPU: the only role a signal may reach."""
    BYSTANDER = "bystander"
    """In a pod under its limit (possibly beside an offender on the same GPU)."""
    EXEMPT = "exempt"
    """Over its limit, in a pod or namespace the admin exempted."""
    HOST = "host"
    """Not in any pod's cgroup."""
    REUSED_PID = "reused_pid"
    """Holds a PID that NVML listed for another process."""
    UNVERIFIABLE = "unverifiable"
    """Over its limit, but its pod is gone from the API or its GPU cannot be read."""


class Recorded(Protocol):
    """A process that records the signals it receives (``conftest.Worker`` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def pid(self) -> int: ...

    def received(self) -> list[str]:
        """Caught signals in order (``"SIGTERM"``, ...), then ``"KILL"`` if SIGKILL ended it."""
        ...

    def alive(self) -> bool: ...


class SignalLog(Protocol):
    """An enforcer whose JSON log lines can be read (``conftest.EnforcerProcess`` is one)."""

    def events(self, name: str, **match: object) -> list[dict[str, Any]]: ...


@dataclass(slots=True, kw_only=True)
class Subject:
    """One process of the ground truth."""

    process: Recorded
    role: Role
    namespace: str | None
    pod: str | None
    container: str | None
    expect_stopped: bool
    drops_sigterm: bool = False
    """PID 1 of its PID namespace without a SIGTERM handler (or a process that ignores it): the
    kernel drops SIGTERM, so the enforcer may send it SIGKILL at the SIGTERM step."""
    sent_by_test: list[str] = field(default_factory=list)
    """Signals the test sent it itself (recorded names: ``"SIGTERM"``, ``"KILL"``)."""

    def from_enforcer(self) -> list[str]:
        """What it received, less what the test sent it (first occurrences)."""
        got = list(self.process.received())
        for sig in self.sent_by_test:
            if sig in got:
                got.remove(sig)
        return got


class Oracle:
    """The ground truth of one test and the comparison with what the enforcer did."""

    def __init__(self) -> None:
        self.subjects: list[Subject] = []

    def add(
        self,
        process: Recorded,
        role: Role,
        *,
        namespace: str | None = None,
        pod: str | None = None,
        container: str | None = "main",
        expect_stopped: bool = False,
        drops_sigterm: bool = False,
    ) -> Recorded:
        """Enter ``process`` with its role; ``expect_stopped``: the test fails unless the
        enforcer stopped it (only offenders can be expected to stop); ``drops_sigterm``: SIGTERM
        cannot reach it (``Subject.drops_sigterm``)."""
        assert not expect_stopped or role is Role.OFFENDER, "only an offender may be stopped"
        self.subjects.append(
            Subject(
                process=process,
                role=role,
                namespace=namespace,
                pod=pod,
                container=container if pod is not None else None,
                expect_stopped=expect_stopped,
                drops_sigterm=drops_sigterm,
            )
        )
        return process

    def sent_by_test(self, process: Recorded, received_as: str) -> None:
        """The test itself signals ``process`` (e.g. ``"KILL"`` for a container restart): not
        the enforcer's doing."""
        for s in self.subjects:
            if s.process is process:
                s.sent_by_test.append(received_as)
                return
        raise KeyError(process.name)

    def subject(self, process: Recorded) -> Subject:
        for s in self.subjects:
            if s.process is process:
                return s
        raise KeyError(process.name)

    # -- the comparison -----------------------------------------------------------------------

    def violations(self, logs: Sequence[Sequence[Mapping[str, Any]]]) -> list[str]:
        """Every way the records disagree with the ground truth, as sentences (empty: none).

        ``logs``: per enforcer process, its ``container_signalled`` lines in order.
        """
        problems: list[str] = []
        by_pid: dict[int, list[Subject]] = {}
        for s in self.subjects:
            by_pid.setdefault(s.process.pid, []).append(s)
        offender_containers = {
            (s.namespace, s.pod, s.container) for s in self.subjects if s.role is Role.OFFENDER
        }
        logged: set[tuple[int, str]] = set()
        for n, lines in enumerate(logs):
            termed: set[int] = set()
            for line in lines:
                sig = str(line.get("signal"))
                pids = [int(p) for p in line.get("pids") or []]
                where = (line.get("namespace"), line.get("pod"), line.get("container"))
                if where not in offender_containers:
                    problems.append(
                        f"enforcer #{n} sent {sig} to container {where}, which is no offender's"
                    )
                for pid in pids:
                    logged.add((pid, _RECEIVED_NAME.get(sig, sig)))
                    owners = by_pid.get(pid)
                    if not owners:
                        problems.append(
                            f"enforcer #{n} sent {sig} to PID {pid}, a process the test never "
                            "started"
                        )
                    elif any(o.role is not Role.OFFENDER for o in owners):
                        roles = ", ".join(f"{o.process.name} ({o.role})" for o in owners)
                        problems.append(f"enforcer #{n} sent {sig} to PID {pid}: {roles}")
                    early = line.get("step") == "SIGTERM" and pid in {
                        int(lost.get("pid", 0)) for lost in line.get("sigterm_lost") or []
                    }
                    if sig == "SIGTERM":
                        termed.add(pid)
                    elif sig == "SIGKILL" and early:
                        # SIGKILL at the SIGTERM step, only where SIGTERM is lost.
                        if not any(o.drops_sigterm for o in owners or []):
                            problems.append(
                                f"enforcer #{n} sent SIGKILL at the SIGTERM step to PID {pid}, "
                                "whose SIGTERM would not have been lost"
                            )
                    elif sig == "SIGKILL" and pid not in termed:
                        problems.append(
                            f"enforcer #{n} sent SIGKILL to PID {pid} without a SIGTERM to it "
                            "earlier in the same escalation"
                        )
                    elif sig not in ("SIGTERM", "SIGKILL"):
                        problems.append(f"enforcer #{n} sent an unexpected signal {sig}")
        for s in self.subjects:
            got = s.from_enforcer()
            who = f"{s.process.name} (PID {s.process.pid}, {s.role})"
            if got and s.role is not Role.OFFENDER:
                problems.append(f"wrong signal: {who} received {got}")
            if "KILL" in got and "SIGTERM" not in got[: got.index("KILL")] and not s.drops_sigterm:
                problems.append(f"{who} was SIGKILLed without a SIGTERM first: {got}")
            for sig in dict.fromkeys(got):
                if (s.process.pid, sig) not in logged:
                    problems.append(f"{who} received {sig}, which no enforcer log line records")
            if s.expect_stopped:
                if not got:
                    problems.append(f"{who} was never stopped (received nothing from the enforcer)")
                elif s.process.alive():
                    problems.append(f"{who} is still running after {got}")
        return problems

    def check(self, enforcers: Iterable[SignalLog], *, settle_seconds: float = 10.0) -> None:
        """Fail the test on any violation; first wait up to ``settle_seconds`` for the enforcers'
        lines to record every signal the processes received (a positive read)."""
        enforcers = list(enforcers)
        deadline = time.monotonic() + settle_seconds
        while True:
            logs = [e.events(SIGNAL_EVENT) for e in enforcers]
            found = self.violations(logs)
            unrecorded = [p for p in found if "no enforcer log line records" in p]
            if not unrecorded or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if found:
            pytest.fail("the oracle found wrong or missing signals:\n  " + "\n  ".join(found))

    def summary(self) -> dict[str, list[str]]:
        """``{process name: what it received from the enforcer}`` (for messages and reports)."""
        return {s.process.name: s.from_enforcer() for s in self.subjects}
