"""The eBPF allocation guard's kernel side on this kernel (gpuguard/adapters/allocguard/): real
processes in real cgroups call the libcuda stand-in (tests/cuda_stub) through the real uprobes.

An allocation past its cgroup's headroom leaves the caller stopped before the call returns, with
an event naming it, and SIGCONT lets the call finish; churn under the headroom never stops (frees
are subtracted); a tenant's own copy of the library (another inode) is not seen; a cgroup with
no headroom entry is never stopped. Phase 1: device 0 only, not wired into the enforcer.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuguard.adapters.allocguard import AllocGuard, EntryPoint, GuardEvent, cgroup_id
from gpuguard.adapters.procfs import read_state
from gpuguard.adapters.readiness import readable
from gpuguard.core.model import ContainerCgroup
from rigs.allocguard import AllocGuardBuild, build
from rigs.cgroups import CgroupTree, cgroup_dir
from rigs.prereq import require

pytestmark = pytest.mark.kernel

KiB = 1024
MiB = 1024 * KiB

# One command a line on stdin, one answer a line on stdout; "calling" is printed just before
# the entry point runs, so a caller stopped by the probe has said it and no more.
CALLER = r"""
import ctypes, sys
libs = {}
def lib(path):
    if path not in libs:
        libs[path] = ctypes.CDLL(path)
    return libs[path]
U64, SZ = ctypes.c_ulonglong, ctypes.c_size_t
print("ready", flush=True)
for line in sys.stdin:
    cmd, path, *args = line.split()
    cu, out = lib(path), U64()
    if cmd == "alloc":
        entry, size = args[0], int(args[1])
        print("calling", flush=True)
        if entry == "cuMemAllocPitch_v2":
            pitch = SZ()
            rc = cu.cuMemAllocPitch_v2(ctypes.byref(out), ctypes.byref(pitch), SZ(size // 4),
                                       SZ(4), ctypes.c_uint(4))
        elif entry == "cuMemAllocManaged":
            rc = cu.cuMemAllocManaged(ctypes.byref(out), SZ(size), ctypes.c_uint(1))
        elif entry == "cuMemAllocAsync":
            rc = cu.cuMemAllocAsync(ctypes.byref(out), SZ(size), ctypes.c_void_p(0))
        elif entry == "cuMemCreate":
            rc = cu.cuMemCreate(ctypes.byref(out), SZ(size), ctypes.c_void_p(0), U64(0))
        else:
            rc = cu.cuMemAlloc_v2(ctypes.byref(out), SZ(size))
        print("returned", rc, out.value, flush=True)
    elif cmd == "churn":
        count, size = int(args[0]), int(args[1])
        for _ in range(count):
            assert cu.cuMemAlloc_v2(ctypes.byref(out), SZ(size)) == 0
            assert cu.cuMemFree_v2(out) == 0
        print("churned", cu.cuStubAllocatedBytes(), flush=True)
"""

ENTRY_OF = {
    "cuMemAlloc_v2": EntryPoint.MEM_ALLOC,
    "cuMemCreate": EntryPoint.MEM_CREATE,
    "cuMemAllocManaged": EntryPoint.MEM_ALLOC_MANAGED,
    "cuMemAllocPitch_v2": EntryPoint.MEM_ALLOC_PITCH,
    "cuMemAllocAsync": EntryPoint.MEM_ALLOC_ASYNC,
}


@pytest.fixture(scope="module")
def built() -> AllocGuardBuild:
    require(os.geteuid() == 0, "needs root (bpf, uprobes)")
    require(Path("/sys/bus/event_source/devices/uprobe").exists(), "no uprobe PMU on this kernel")
    return build()


@pytest.fixture
def guard(built: AllocGuardBuild) -> Iterator[AllocGuard]:
    # A bound past every test's length: these tests resume (or leave) their stops themselves
    # (test_allocguard_thawer.py tests the bound).
    g = AllocGuard(
        object_path=built.object_path,
        library_path=built.stub_library,
        freeze_bound_seconds=600,
    )
    try:
        yield g
    finally:
        g.close()


class Caller:
    """A process in a cgroup, driven line by line."""

    def __init__(self, tree: CgroupTree, cg: ContainerCgroup, started: list[Caller]) -> None:
        self.proc = tree.spawn(
            [sys.executable, "-c", CALLER],
            cgroups=[cg],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,  # unbuffered: select() on the pipe sees every line not yet read
        )
        started.append(self)
        assert self.line() == "ready"

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode() + b"\n")
        self.proc.stdin.flush()

    def line(self, timeout_seconds: float = 30.0) -> str | None:
        """The next line, or None when none came in time."""
        assert self.proc.stdout is not None
        if not readable([self.proc.stdout], timeout_seconds):
            return None
        return self.proc.stdout.readline().decode().strip()

    def state(self) -> str | None:
        return read_state(Path("/proc"), self.proc.pid)

    def wait_stopped(self, timeout_seconds: float) -> bool:
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if self.state() == "T":
                return True
            time.sleep(0.001)
        return False


@pytest.fixture
def callers(cgroup_tree: CgroupTree) -> Iterator[list[Caller]]:
    """The callers a test starts; their pipes closed after it (the tree kills the processes)."""
    started: list[Caller] = []
    yield started
    for caller in started:
        for pipe in (caller.proc.stdin, caller.proc.stdout):
            if pipe is not None:
                pipe.close()


def events_for(guard: AllocGuard, tgid: int, timeout_ms: int) -> list[GuardEvent]:
    return [e for e in guard.poll(timeout_ms=timeout_ms) if e.tgid == tgid]


@pytest.mark.parametrize("entry", sorted(ENTRY_OF))
def test_an_allocation_past_headroom_stops_its_caller_before_the_call_returns(
    guard: AllocGuard,
    cgroup_tree: CgroupTree,
    callers: list[Caller],
    built: AllocGuardBuild,
    entry: str,
) -> None:
    cg = cgroup_tree.make(2, "tenant")
    cid = cgroup_id(cgroup_dir(cg))
    guard.set_headroom(cgroup_id=cid, device=0, headroom_bytes=1 * MiB)
    caller = Caller(cgroup_tree, cg, callers)
    lib = built.stub_library

    caller.send(f"alloc {lib} {entry} {512 * KiB}")  # under: runs
    assert caller.line() == "calling"
    assert (caller.line() or "").startswith("returned 0 ")
    assert guard.allocated_bytes(cgroup_id=cid, device=0) == 512 * KiB

    caller.send(f"alloc {lib} {entry} {600 * KiB}")  # 1112 KiB > 1 MiB: stopped at the entry
    assert caller.line() == "calling"
    assert caller.wait_stopped(5.0), f"not stopped: state {caller.state()}"
    assert caller.line(timeout_seconds=0.2) is None  # the call has not returned
    (event,) = events_for(guard, caller.proc.pid, timeout_ms=1000)
    assert event.cgroup_id == cid
    assert event.pid == caller.proc.pid  # the calling thread (single-threaded here)
    assert event.size_bytes == 600 * KiB
    assert event.allocated_bytes == 512 * KiB
    assert event.headroom_bytes == 1 * MiB
    assert event.entry is ENTRY_OF[entry]
    assert event.device == 0

    caller.proc.send_signal(signal.SIGCONT)  # the enforcer's "not over": the call finishes
    assert (caller.line() or "").startswith("returned 0 ")
    assert caller.state() != "T"
    assert guard.allocated_bytes(cgroup_id=cid, device=0) == 1112 * KiB


def test_churn_under_headroom_never_stops_because_frees_are_subtracted(
    guard: AllocGuard, cgroup_tree: CgroupTree, callers: list[Caller], built: AllocGuardBuild
) -> None:
    cg = cgroup_tree.make(2, "churner")
    cid = cgroup_id(cgroup_dir(cg))
    # 10,000 x 64 KiB is 625 MiB allocated in all, but never more than 64 KiB at once.
    guard.set_headroom(cgroup_id=cid, device=0, headroom_bytes=1 * MiB)
    caller = Caller(cgroup_tree, cg, callers)
    caller.send(f"churn {built.stub_library} 10000 {64 * KiB}")
    assert caller.line(timeout_seconds=60.0) == "churned 0"
    assert events_for(guard, caller.proc.pid, timeout_ms=100) == []
    assert guard.allocated_bytes(cgroup_id=cid, device=0) == 0
    assert caller.state() != "T"


def test_a_tenants_own_copy_of_the_library_is_not_seen(
    guard: AllocGuard,
    cgroup_tree: CgroupTree,
    callers: list[Caller],
    built: AllocGuardBuild,
    tmp_path: Path,
) -> None:
    cg = cgroup_tree.make(2, "copier")
    cid = cgroup_id(cgroup_dir(cg))
    guard.set_headroom(cgroup_id=cid, device=0, headroom_bytes=0)
    copy = tmp_path / "libcuda.so.1"
    shutil.copyfile(built.stub_library, copy)  # the same bytes, another inode
    assert os.stat(copy).st_ino != os.stat(built.stub_library).st_ino
    caller = Caller(cgroup_tree, cg, callers)

    caller.send(f"alloc {copy} cuMemAlloc_v2 {1 * MiB}")
    assert caller.line() == "calling"
    assert (caller.line(timeout_seconds=5.0) or "").startswith("returned 0 ")
    assert events_for(guard, caller.proc.pid, timeout_ms=100) == []
    assert guard.allocated_bytes(cgroup_id=cid, device=0) is None

    # The same process through the probed file is stopped: the cgroup is guarded, only the
    # file differed (the polling loop is what catches the copy's memory).
    caller.send(f"alloc {built.stub_library} cuMemAlloc_v2 {1 * MiB}")
    assert caller.line() == "calling"
    assert caller.wait_stopped(5.0)
    assert len(events_for(guard, caller.proc.pid, timeout_ms=1000)) == 1


def test_a_cgroup_without_headroom_is_never_stopped(
    guard: AllocGuard, cgroup_tree: CgroupTree, callers: list[Caller], built: AllocGuardBuild
) -> None:
    guarded = cgroup_tree.make(2, "guarded")
    other = cgroup_tree.make(2, "other")
    guard.set_headroom(cgroup_id=cgroup_id(cgroup_dir(guarded)), device=0, headroom_bytes=0)
    caller = Caller(cgroup_tree, other, callers)
    for _ in range(3):
        caller.send(f"alloc {built.stub_library} cuMemAlloc_v2 {64 * 1024 * MiB}")
        assert caller.line() == "calling"
        assert (caller.line(timeout_seconds=5.0) or "").startswith("returned 0 ")
    assert caller.state() != "T"
    assert events_for(guard, caller.proc.pid, timeout_ms=100) == []
    assert guard.allocated_bytes(cgroup_id=cgroup_id(cgroup_dir(other)), device=0) is None

    # A headroom written and then cleared is absent again: never a freeze.
    guard.set_headroom(cgroup_id=cgroup_id(cgroup_dir(other)), device=0, headroom_bytes=0)
    guard.clear_headroom(cgroup_id=cgroup_id(cgroup_dir(other)), device=0)
    caller.send(f"alloc {built.stub_library} cuMemAlloc_v2 {1 * MiB}")
    assert caller.line() == "calling"
    assert (caller.line(timeout_seconds=5.0) or "").startswith("returned 0 ")
