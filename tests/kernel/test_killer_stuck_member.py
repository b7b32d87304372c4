"""PidfdKiller against a container one of whose members is stuck in ``exec`` on a FUSE file whose
daemon the tenant stopped: its ``/proc/<pid>/stat`` blocks for as long as the daemon is stopped
(Linux 6.18; ``tests/kernel/fuse_stall.py``). Real cgroup, real processes, real ``/proc``.

Before the killer's reads were bounded, ``signal_container`` on such a container never returned:
the enforcer awaited it, so no pod on the node was stopped any more. The oracle: the call
returns within a bound, every other member gets its signal (SIGTERM, then SIGKILL), and the stuck
member is refused with a reason naming its PID, never signalled (its identity cannot be
re-verified).

Also here, with a fake killer (no kernel needed): the enforcer waits for a killer call at most a
bound, and goes on to the next container's stop.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from gpuguard.adapters.killer import PidfdKiller
from gpuguard.adapters.procfs import read_identity
from gpuguard.adapters.readiness import readable
from gpuguard.core.model import (
    KillTarget,
    ProcessIdentity,
    RefusalReason,
    SignalReport,
    StopSignal,
)
from rigs.cgroups import CGROUP_MOUNT, CgroupTree, fake_container_id, node_container
from rigs.kill_targets import POD_A, observed, target_for
from tests.enforcer_world import G0, World
from tests.fakes import GiB, proc
from tests.kernel.fuse_stall import FuseMount, fuse_mount
from tests.kernel.stuck import EXEC_AFTER_GO, stuck_in_exec

BOUND_SECONDS = 3.0
"""How long one ``signal_container`` may take here: a blocked read costs the killer
``PROBE_DEADLINE_SECONDS`` (0.25 s); a killer that waits on it never returns at all."""

CATCHER = r"""
import os, signal, sys
def note(signum, frame):
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, b"SIGTERM\n")
    os.close(fd)
signal.signal(signal.SIGTERM, note)
print("ready", flush=True)
while True:
    signal.pause()
"""
"""A member that catches SIGTERM (records it) and lives on: only SIGKILL ends it."""


def _within(seconds: float, call: Callable[[], SignalReport], what: str) -> SignalReport:
    """``call()``'s report, or the test fails once ``seconds`` passed (the call is left in a
    daemon thread; killing the FUSE daemon at teardown unblocks it)."""
    result: list[SignalReport] = []
    worker = threading.Thread(target=lambda: result.append(call()), daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        pytest.fail(f"{what} did not return within {seconds} s: blocked")
    assert result, f"{what} raised (see the thread's traceback above)"
    return result[0]


def _ready(process: subprocess.Popen[bytes]) -> None:
    assert process.stdout is not None
    assert process.stdout.readline().strip() == b"ready"


def _exited(pidfd: int, seconds: float) -> bool:
    """The process behind ``pidfd`` ended within ``seconds`` (a pidfd is readable then)."""
    return bool(readable([pidfd], seconds))


class _Container:
    """Pod A's container with a member stuck in exec, one that SIGTERM ends (``plain``) and one
    that catches it and lives on (``catcher``)."""

    def __init__(self, tree: CgroupTree, fuse: FuseMount, record: Path) -> None:
        cg = node_container(tree, pod_uid=POD_A, container_id=fake_container_id(1))
        self.target: KillTarget = target_for(cg, fake_container_id(1))
        self.record = record
        piped = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
        self.stuck = tree.spawn(
            [sys.executable, "-c", EXEC_AFTER_GO, str(fuse.file)], cgroups=[cg], **piped
        )
        _ready(self.stuck)
        self.stuck_identity = read_identity(Path("/proc"), self.stuck.pid)
        self.plain = tree.spawn(["sleep", "600"], cgroups=[cg])
        self.catcher = tree.spawn(
            [sys.executable, "-c", CATCHER, str(record)], cgroups=[cg], stdout=subprocess.PIPE
        )
        _ready(self.catcher)
        self.pidfds = {p.pid: os.pidfd_open(p.pid) for p in (self.plain, self.catcher)}
        stuck_in_exec(fuse, self.stuck)

    def caught(self) -> list[str]:
        """The signals the catcher recorded so far."""
        try:
            return self.record.read_text().split()
        except FileNotFoundError:
            return []

    def close(self) -> None:
        for fd in self.pidfds.values():
            os.close(fd)
        for p in (self.stuck, self.catcher):
            for pipe in (p.stdin, p.stdout):
                if pipe is not None:
                    pipe.close()


@pytest.fixture(name="container")
def container_fixture(cgroup_tree: CgroupTree, tmp_path: Path) -> Iterator[_Container]:
    # The mount is made (and its daemon killed, unblocking every read) inside the tree's
    # lifetime: the tree kills the container's processes only after the daemon is gone.
    with fuse_mount(tmp_path) as fuse:
        scene = _Container(cgroup_tree, fuse, tmp_path / "catcher.signals")
        try:
            yield scene
        finally:
            scene.close()


@pytest.fixture(name="killer")
def killer_fixture() -> Iterator[PidfdKiller]:
    """A killer over the test cgroups, closed after the test (its idle helper thread goes; one
    left blocked on the stuck member ends when the FUSE daemon is killed)."""
    k = PidfdKiller(cgroup_root=CGROUP_MOUNT, proc_root=Path("/proc"))
    yield k
    k.close()


@pytest.mark.kernel
def test_a_member_stuck_in_exec_is_refused_by_pid_and_the_others_get_sigterm_then_sigkill(
    container: _Container, killer: PidfdKiller
) -> None:
    k = killer
    stuck = container.stuck.pid

    started = time.monotonic()
    term = _within(
        10, lambda: k.signal_container(container.target, StopSignal.TERM), "the SIGTERM step"
    )
    term_seconds = time.monotonic() - started

    assert term_seconds < BOUND_SECONDS
    assert {i.pid for i in term.delivered} == {container.plain.pid, container.catcher.pid}
    [refusal] = term.refused
    assert refusal.pid == stuck
    assert refusal.reason is RefusalReason.SIGNAL_FAILED
    assert f"PID {stuck}" in refusal.detail
    assert "/proc/<pid>/stat" in refusal.detail
    assert "not signalled" in refusal.detail
    assert _exited(container.pidfds[container.plain.pid], 5)  # SIGTERM ended it
    deadline = time.monotonic() + 5
    while container.caught() != ["SIGTERM"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert container.caught() == ["SIGTERM"]  # it caught SIGTERM and lives on

    # The SIGKILL step: the catcher is still there, the stuck read is still blocked.
    started = time.monotonic()
    kill = _within(
        10,
        lambda: k.signal_container(container.target, StopSignal.KILL, wait_seconds=2.0),
        "the SIGKILL step",
    )
    kill_seconds = time.monotonic() - started

    assert {i.pid for i in kill.delivered} == {container.catcher.pid}
    assert kill.survivors == ()
    assert container.catcher.wait(timeout=5) == -signal.SIGKILL
    [refusal] = kill.refused
    assert refusal.pid == stuck
    assert refusal.reason is RefusalReason.SIGNAL_FAILED
    assert f"PID {stuck}" in refusal.detail
    assert "still blocked" in refusal.detail  # not read again: no second helper left waiting
    assert kill_seconds < BOUND_SECONDS
    # Never signalled: its exec is still waiting, its state D, no SIGKILL pending from us.
    status = Path(f"/proc/{stuck}/status").read_text()
    [pending] = [line for line in status.splitlines() if line.startswith("ShdPnd:")]
    assert int(pending.split()[1], 16) == 0, status


@pytest.mark.kernel
def test_a_member_that_gets_stuck_after_it_was_observed_is_not_signalled_once_its_pidfd_is_open(
    container: _Container, killer: PidfdKiller
) -> None:
    # Observed (stat read) before its exec got stuck: the pidfd opens, the re-read after the open
    # blocks. An unverified process is never signalled.
    identity = container.stuck_identity
    assert isinstance(identity, ProcessIdentity)

    started = time.monotonic()
    report = _within(
        10,
        lambda: killer.signal_members([observed(identity)], container.target, StopSignal.KILL),
        "signal_members",
    )

    assert time.monotonic() - started < BOUND_SECONDS
    assert report.delivered == ()
    [refusal] = report.refused
    assert refusal.pid == identity.pid
    assert refusal.reason is RefusalReason.SIGNAL_FAILED
    assert f"PID {identity.pid}" in refusal.detail
    assert "re-verified" in refusal.detail
    status = Path(f"/proc/{identity.pid}/status").read_text()
    [pending] = [line for line in status.splitlines() if line.startswith("ShdPnd:")]
    assert int(pending.split()[1], 16) == 0, status


def _killer_helpers_since(before: set[threading.Thread]) -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "gpuguard-killer-reads"} - before


@pytest.mark.kernel
def test_a_closed_or_dropped_killer_leaves_no_helper_thread(cgroup_tree: CgroupTree) -> None:
    # Was: an idle helper kept its last job, whose read (a closure over the killer) kept the
    # killer alive, so the finalizer that closes the helper never ran: each killer dropped
    # without close() left a thread for the rest of the process.
    cg = node_container(cgroup_tree, pod_uid=POD_A, container_id=fake_container_id(1))
    target = target_for(cg, fake_container_id(1))
    members = [cgroup_tree.spawn(["sleep", "600"], cgroups=[cg]) for _ in range(2)]
    time.sleep(0.05)  # past their first clock tick: an identity read in it proves nothing
    helpers: list[threading.Thread] = []
    for member, closes in zip(members, (True, False), strict=True):
        identity = read_identity(Path("/proc"), member.pid)
        assert identity is not None
        before = set(threading.enumerate())
        k = PidfdKiller(cgroup_root=CGROUP_MOUNT, proc_root=Path("/proc"))
        report = k.signal_members([observed(identity)], target, StopSignal.TERM)
        assert [i.pid for i in report.delivered] == [member.pid]
        helpers.extend(_killer_helpers_since(before))
        if closes:
            k.close()
        del k

    assert len(helpers) == 2
    for helper in helpers:
        helper.join(5)
        assert not helper.is_alive()


# ---------------------------------------------------------------------------------------------
# The enforcer: a killer call that does not return holds up no other stop


async def test_the_enforcer_waits_for_a_killer_call_a_bounded_time_and_stops_the_next_container(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The first container's call never returns (until released), as PidfdKiller's did on a
    # container with a member stuck in exec; both pods are over their limits.
    w = World(gpu_timeout_seconds=0.2, kill_wait_seconds=0.0)
    w.gpu.processes = [proc(101, G0, 12 * GiB), proc(201, G0, 12 * GiB)]
    release = threading.Event()
    hung: list[KillTarget] = []
    real = w.killer.signal_container

    def signal_container(
        target: KillTarget, signal: StopSignal, *, wait_seconds: float = 0.0
    ) -> SignalReport:
        if not hung or hung[0].container_id == target.container_id:
            hung.append(target)
            release.wait(30)
        return real(target, signal, wait_seconds=wait_seconds)

    monkeypatch.setattr(w.killer, "signal_container", signal_container)
    try:
        with capture_logs() as logs:
            await asyncio.wait_for(w.run(12), timeout=10)
            other = [c for c in w.killer.calls if c[0].container_id != hung[0].container_id]
            assert [s for _t, s in other] == [StopSignal.TERM, StopSignal.KILL]
            [late] = [e for e in logs if e["event"] == "signal_timeout"]
            assert late["pod"] == hung[0].pod.name
            assert late["signal"] == "SIGTERM"
            # Its SIGKILL step came while the SIGTERM call still ran: refused, not piled up.
            [busy] = [e for e in logs if e["event"] == "signal_still_running"]
            assert busy["pod"] == hung[0].pod.name
            assert len(hung) == 1
            assert w.recorder.refusals.count(RefusalReason.SIGNAL_FAILED) == 2
            release.set()
            # The late call's report is handled when it ends: its delivery logged and counted.
            for _ in range(250):
                if any(
                    e["event"] == "container_signalled" and e["pod"] == hung[0].pod.name
                    for e in logs
                ):
                    break
                await asyncio.sleep(0.02)
            else:
                pytest.fail("the late call's report was never handled")
    finally:
        release.set()
