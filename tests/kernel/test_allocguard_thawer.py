"""The allocation guard's freezes are bounded (gpuguard/adapters/allocguard/thawer.py), with the
real uprobes on the libcuda stand-in and real processes in real cgroups.

A stop nobody resolves is resumed at the bound and its allocation completes; when the process
that loaded the guard is SIGKILLed its stop is resumed at once, the thawer exits and the probes
are gone; a stop the enforcer took over (``forget``) is left to it while the bound still holds
for every other; an entry whose start time is not the live process's is dropped without a
signal; a process the tenant stopped itself is never resumed, even one the guard had stopped
and the tenant resumed before; a dead thawer is started again by the guard's next call; no
caller is stopped when its stop cannot be recorded (the map is full).
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuguard.adapters.allocguard import AllocGuard, cgroup_id
from gpuguard.core.model import ContainerCgroup
from rigs.alloc_caller import AllocCaller, wait_state
from rigs.allocguard import AllocGuardBuild, build
from rigs.cgroups import CgroupTree, cgroup_dir
from rigs.prereq import require
from rigs.processes import pidfd_kill, start_ticks

pytestmark = pytest.mark.kernel

MiB = 1024 * 1024
BOUND = 0.2
"""The default bound, which these tests keep to (``FREEZE_BOUND_SECONDS``)."""
LEAD = BOUND / 20
"""How early the thawer aims (thawer.py): it resumes at the bound minus this."""
SLACK = 0.1
"""Past the bound, what the thawer's wake-up and this test's 0.5 ms state polling may add on a
loaded two-core machine (measured: a few ms idle; benchmarks/allocguard_thaw.py)."""
CLK_TCK = os.sysconf("SC_CLK_TCK")
FROZEN_CAPACITY = 16384
"""``frozen``'s max_entries in guard.bpf.c."""


@pytest.fixture(scope="module")
def built() -> AllocGuardBuild:
    require(os.geteuid() == 0, "needs root (bpf, uprobes)")
    require(Path("/sys/bus/event_source/devices/uprobe").exists(), "no uprobe PMU on this kernel")
    return build()


@pytest.fixture
def thawer_log(tmp_path: Path) -> Path:
    path = tmp_path / "thawer.jsonl"
    path.touch()
    return path


@pytest.fixture
def guard(built: AllocGuardBuild, thawer_log: Path) -> Iterator[AllocGuard]:
    fd = os.open(thawer_log, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
    try:
        g = AllocGuard(
            object_path=built.object_path,
            library_path=built.stub_library,
            freeze_bound_seconds=BOUND,
            thawer_stderr=fd,
        )
    finally:
        os.close(fd)
    try:
        yield g
    finally:
        g.close()


@pytest.fixture
def callers() -> Iterator[list[AllocCaller]]:
    started: list[AllocCaller] = []
    yield started
    for caller in started:
        caller.close()


def guarded(tree: CgroupTree, guard: AllocGuard, name: str) -> ContainerCgroup:
    """A cgroup whose headroom is 1 MiB: a 2 MiB allocation stops its caller."""
    cg = tree.make(2, name)
    guard.set_headroom(cgroup_id=cgroup_id(cgroup_dir(cg)), device=0, headroom_bytes=MiB)
    return cg


def log_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ended(path: Path, tgid: int) -> list[str]:
    """The thawer's outcomes for ``tgid``, in order."""
    return [
        e["outcome"]
        for e in log_lines(path)
        if e.get("event") == "freeze_ended" and e.get("tgid") == tgid
    ]


def frozen_map() -> Any:
    return importlib.import_module("gpuguard.adapters.allocguard._loader")


def frozen_tgids(guard: AllocGuard) -> list[int]:
    entries: list[tuple[int, ...]] = frozen_map().frozen_entries(guard.frozen_fd)
    return [e[0] for e in entries]


def test_a_stop_nobody_resolves_is_resumed_at_the_bound_and_its_allocation_completes(
    guard: AllocGuard,
    cgroup_tree: CgroupTree,
    callers: list[AllocCaller],
    built: AllocGuardBuild,
    thawer_log: Path,
) -> None:
    caller = AllocCaller(cgroup_tree, guarded(cgroup_tree, guard, "unresolved"))
    callers.append(caller)
    durations = []
    for _ in range(3):
        before = time.monotonic()  # before the stop: its length is at most resumed - before
        caller.alloc(built.stub_library, 2 * MiB)
        assert wait_state(caller.stopped, 5.0) is not None, caller.state()
        resumed = wait_state(lambda: not caller.stopped(), 5.0)
        assert resumed is not None, "never resumed"
        durations.append(resumed - before)
        assert caller.line() == "returned 0"  # the allocation went on and completed
    # Not earlier than the thawer aims (no stop was cut short), not later than the bound plus
    # the stated slack.
    assert all(BOUND - LEAD <= d <= BOUND + SLACK for d in durations), durations
    assert ended(thawer_log, caller.pid) == ["resumed"] * 3
    assert frozen_tgids(guard) == []


# An enforcer that takes over every stop (``forget``) and never resolves one.
GUARD_PROCESS = r"""
import sys
from pathlib import Path
from gpuguard.adapters.allocguard import AllocGuard
obj, lib, cgroup = sys.argv[1:4]
g = AllocGuard(object_path=Path(obj), library_path=Path(lib))
g.set_headroom(cgroup_id=int(cgroup), device=0, headroom_bytes=1 << 20)
print("ready", g.thawer_pid, flush=True)
while True:
    for event in g.poll(timeout_ms=100):
        g.forget(tgid=event.tgid)
        print("forgot", event.tgid, flush=True)
"""
PERIOD = 0.05
"""The thawer's longest sleep (thawer.PERIOD_NS): how late it may notice the enforcer exit."""


def test_when_the_loading_process_is_killed_its_stop_is_resumed_and_the_probes_are_gone(
    cgroup_tree: CgroupTree, callers: list[AllocCaller], built: AllocGuardBuild
) -> None:
    cg = cgroup_tree.make(2, "orphaned")
    loading = subprocess.Popen(
        [
            sys.executable,
            "-c",
            GUARD_PROCESS,
            str(built.object_path),
            str(built.stub_library),
            str(cgroup_id(cgroup_dir(cg))),
        ],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
    )
    thawer_pidfd = None
    try:
        assert loading.stdout is not None
        word, thawer_pid = loading.stdout.readline().decode().split()
        assert word == "ready"
        thawer_pidfd = os.pidfd_open(int(thawer_pid))  # watched only, never signalled
        caller = AllocCaller(cgroup_tree, cg)
        callers.append(caller)
        caller.alloc(built.stub_library, 2 * MiB)
        assert wait_state(caller.stopped, 5.0) is not None
        assert loading.stdout.readline().decode().split() == ["forgot", str(caller.pid)]
        time.sleep(5 * BOUND)
        assert caller.stopped()  # taken over: nothing resumes it while the loading process lives

        killed = time.monotonic()
        loading.kill()
        resumed = wait_state(lambda: not caller.stopped(), 5.0)
        assert resumed is not None, "the stop outlived the process that loaded the guard"
        assert resumed - killed <= PERIOD + SLACK, resumed - killed
        assert caller.line() == "returned 0"
        loading.wait()  # its exit done: the probes detached
        exited = select.poll()
        exited.register(thawer_pidfd, select.POLLIN)
        assert exited.poll(5000), "the thawer did not exit"

        # The probes went with the loading process: a far bigger allocation is not stopped.
        caller.alloc(built.stub_library, 64 * MiB)
        assert caller.line(timeout_seconds=5.0) == "returned 0"
        assert not caller.stopped()
    finally:
        if loading.poll() is None:
            loading.kill()
            loading.wait()
        if loading.stdout is not None:
            loading.stdout.close()
        if thawer_pidfd is not None:
            os.close(thawer_pidfd)


def test_a_forgotten_stop_is_left_to_the_enforcer_while_every_other_stays_bounded(
    guard: AllocGuard,
    cgroup_tree: CgroupTree,
    callers: list[AllocCaller],
    built: AllocGuardBuild,
    thawer_log: Path,
) -> None:
    taken = AllocCaller(cgroup_tree, guarded(cgroup_tree, guard, "taken"))
    other = AllocCaller(cgroup_tree, guarded(cgroup_tree, guard, "other"))
    callers.extend([taken, other])
    taken.alloc(built.stub_library, 2 * MiB)
    assert wait_state(taken.stopped, 5.0) is not None
    guard.forget(tgid=taken.pid)  # recorded before SIGSTOP is sent: the stop is in the map
    other.alloc(built.stub_library, 2 * MiB)
    assert wait_state(other.stopped, 5.0) is not None

    assert wait_state(lambda: not other.stopped(), BOUND + SLACK) is not None
    assert other.line() == "returned 0"
    time.sleep(5 * BOUND)
    assert taken.stopped(), "a stop the enforcer took over was resumed"
    assert ended(thawer_log, taken.pid) == []

    taken.proc.send_signal(signal.SIGCONT)  # the enforcer's "not over"
    assert taken.line() == "returned 0"
    # Its entry went with its return; a new stop of the same process is bounded again.
    taken.alloc(built.stub_library, 2 * MiB)
    assert wait_state(taken.stopped, 5.0) is not None
    assert wait_state(lambda: not taken.stopped(), BOUND + SLACK) is not None
    assert taken.line() == "returned 0"
    assert ended(thawer_log, taken.pid) == ["resumed"]


def test_an_entry_whose_start_time_is_not_the_live_processs_is_dropped_without_a_signal(
    guard: AllocGuard,
    cgroup_tree: CgroupTree,
    callers: list[AllocCaller],
    thawer_log: Path,
) -> None:
    # Two processes that stopped themselves; each gets a crafted entry dated past the bound,
    # one with its true start (the control: the thawer is running and resumes it), one with a
    # start one second off (its pid held by a process that started later: a reused pid).
    cg = cgroup_tree.make(2, "reused")
    reused, control = AllocCaller(cgroup_tree, cg), AllocCaller(cgroup_tree, cg)
    callers.extend([reused, control])
    for caller in (reused, control):
        caller.send("stopself")
        assert caller.line() == "stopping"
        assert wait_state(caller.stopped, 5.0) is not None
    past = time.clock_gettime_ns(time.CLOCK_BOOTTIME) - 10 * 1_000_000_000
    for caller, offset_ticks in ((reused, -CLK_TCK), (control, 0)):
        ticks = start_ticks(caller.pid)
        assert ticks is not None
        start_ns = (ticks + offset_ticks) * 1_000_000_000 // CLK_TCK
        frozen_map().frozen_insert(guard.frozen_fd, caller.pid, caller.pid, past, start_ns, 0)

    assert control.line(timeout_seconds=BOUND + SLACK) == "continued"
    assert wait_state(lambda: frozen_tgids(guard) == [], 1.0) is not None
    time.sleep(2 * BOUND)
    assert reused.stopped(), "a process whose start time differs was resumed"
    assert reused.line(timeout_seconds=0) is None
    assert ended(thawer_log, reused.pid) == ["pid_reused"]
    assert ended(thawer_log, control.pid) == ["resumed"]


def test_a_process_the_tenant_stopped_itself_is_never_resumed(
    guard: AllocGuard,
    cgroup_tree: CgroupTree,
    callers: list[AllocCaller],
    built: AllocGuardBuild,
    thawer_log: Path,
) -> None:
    cg = guarded(cgroup_tree, guard, "tenant")
    own, resumed_by_tenant, control = (AllocCaller(cgroup_tree, cg) for _ in range(3))
    callers.extend([own, resumed_by_tenant, control])

    # Stopped by the guard, resumed by the tenant before the bound (another of its processes
    # may SIGCONT it), and then stopped by its own code: its stop is no longer the guard's.
    resumed_by_tenant.alloc(built.stub_library, 2 * MiB)
    assert wait_state(resumed_by_tenant.stopped, 5.0) is not None
    resumed_by_tenant.proc.send_signal(signal.SIGCONT)
    assert resumed_by_tenant.line() == "returned 0"
    resumed_by_tenant.send("stopself")
    own.send("stopself")  # never stopped by the guard at all
    control.alloc(built.stub_library, 2 * MiB)  # stopped by the guard: the thawer runs
    for caller in (resumed_by_tenant, own):
        assert caller.line() == "stopping"
        assert wait_state(caller.stopped, 5.0) is not None

    assert wait_state(control.stopped, 5.0) is not None
    assert control.line(timeout_seconds=BOUND + SLACK) == "returned 0"
    time.sleep(5 * BOUND)  # well past the bound of the guard's earlier stop
    for caller in (resumed_by_tenant, own):
        assert caller.stopped(), "the thawer resumed a stop the tenant made"
        assert caller.line(timeout_seconds=0) is None
        assert ended(thawer_log, caller.pid) == []


def test_a_dead_thawer_is_started_again_by_the_next_guard_call_and_resumes_what_came_due(
    guard: AllocGuard,
    cgroup_tree: CgroupTree,
    callers: list[AllocCaller],
    built: AllocGuardBuild,
) -> None:
    caller = AllocCaller(cgroup_tree, guarded(cgroup_tree, guard, "unwatched"))
    callers.append(caller)
    first = guard.thawer_pid
    assert first is not None
    pidfd_kill(first)  # the guard's own child, started for this test
    time.sleep(0.1)  # dead and a zombie, not yet reaped: no guard call since

    caller.alloc(built.stub_library, 2 * MiB)
    assert wait_state(caller.stopped, 5.0) is not None
    time.sleep(2 * BOUND)
    assert caller.stopped()  # nothing watches until the guard is used again

    guard.poll(timeout_ms=0)  # any guard call: the thawer is found dead and started again
    assert guard.thawer_restarts == 1
    assert guard.thawer_pid not in (None, first)
    # Its first scan resumes what came due meanwhile.
    assert caller.line(timeout_seconds=SLACK) == "returned 0"


def test_the_thawer_holds_the_frozen_map_and_a_pidfd_and_no_probe(guard: AllocGuard) -> None:
    thawer = guard.thawer_pid
    assert thawer is not None
    links = sorted(
        os.readlink(f"/proc/{thawer}/fd/{fd}") for fd in os.listdir(f"/proc/{thawer}/fd")
    )
    bpf = [link for link in links if "bpf" in link]
    assert bpf == ["anon_inode:bpf-map"], links  # no bpf-link, bpf-prog, or other map
    assert "anon_inode:[pidfd]" in links


def test_a_caller_is_not_stopped_when_its_stop_cannot_be_recorded(
    guard: AllocGuard,
    cgroup_tree: CgroupTree,
    callers: list[AllocCaller],
    built: AllocGuardBuild,
) -> None:
    # The frozen map filled with entries no process has (pid 0), due in an hour: the thawer
    # leaves them, and a stop now would have no entry, so no bound.
    loader = frozen_map()
    due_later = time.clock_gettime_ns(time.CLOCK_BOOTTIME) + 3600 * 1_000_000_000
    filler = 0
    try:
        while True:
            try:
                loader.frozen_insert(guard.frozen_fd, 0, filler, due_later, 0, 0)
            except OSError:
                break  # full (E2BIG)
            filler += 1
        assert filler == FROZEN_CAPACITY
        caller = AllocCaller(cgroup_tree, guarded(cgroup_tree, guard, "unrecorded"))
        callers.append(caller)
        caller.alloc(built.stub_library, 2 * MiB)
        assert caller.line(timeout_seconds=5.0) == "returned 0"  # not stopped
        (event,) = [e for e in guard.poll(timeout_ms=1000) if e.tgid == caller.pid]
        assert event.size_bytes == 2 * MiB  # the crossing is still reported
    finally:
        for tid in range(filler):
            loader.frozen_delete(guard.frozen_fd, 0, tid, due_later)
