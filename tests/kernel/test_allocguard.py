"""The eBPF allocation guard's kernel side on this kernel (gpuguard/adapters/allocguard/): real
processes in real cgroups call the libcuda stand-in (tests/cuda_stub) through the real uprobes.

An allocation past its cgroup's headroom leaves the caller stopped before the call returns, with
an event naming it, and SIGCONT lets the call finish; each allocation counts on its own device
(the current context's, or the one its properties or pool name) and one with no known device is
never counted; every entry point's free gives back what it took, and so does a process exit;
paced churn under the headroom never stops; a tenant's own copy of the library (another inode)
is not seen; a cgroup with no headroom entry is never stopped; an unprivileged user cannot open
the maps. Not wired into the enforcer yet.
"""

from __future__ import annotations

import errno
import os
import platform
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
# the entry point runs, so a caller stopped by the probe has said it and no more. "returned"
# gives the result, the pointer or handle, and what the stand-in holds after the call.
CALLER = r"""
import ctypes, sys, threading, time
libs, pools = {}, {}
def lib(path):
    if path not in libs:
        libs[path] = ctypes.CDLL(path)
    return libs[path]
U64, SZ, U32, VP = ctypes.c_ulonglong, ctypes.c_size_t, ctypes.c_uint, ctypes.c_void_p
class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]
class AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("location", Location),
                ("win32", VP), ("flags", ctypes.c_ubyte * 8)]
class PoolProps(ctypes.Structure):  # CUmemPoolProps
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("location", Location),
                ("win32", VP), ("max_size", SZ), ("usage", ctypes.c_ushort),
                ("reserved", ctypes.c_ubyte * 54)]
class Array(ctypes.Structure):  # CUDA_ARRAY_DESCRIPTOR
    _fields_ = [("w", SZ), ("h", SZ), ("format", U32), ("channels", U32)]
class Array3D(ctypes.Structure):  # CUDA_ARRAY3D_DESCRIPTOR
    _fields_ = [("w", SZ), ("h", SZ), ("d", SZ), ("format", U32), ("channels", U32),
                ("flags", U32)]
def pool(cu, path, device):
    if (path, device) not in pools:
        out = VP()
        assert cu.cuMemPoolCreate(ctypes.byref(out), ctypes.byref(PoolProps(
            type=1, location=Location(1, device)))) == 0
        pools[path, device] = out
    return pools[path, device]
def alloc(cu, path, entry, size, device, out, stream=0):
    if entry == "cuMemAllocPitch_v2":
        pitch = SZ()
        return cu.cuMemAllocPitch_v2(ctypes.byref(out), ctypes.byref(pitch), SZ(size // 4),
                                     SZ(4), U32(4))
    if entry == "cuMemAllocManaged":
        return cu.cuMemAllocManaged(ctypes.byref(out), SZ(size), U32(1))
    if entry == "cuMemAllocAsync":
        return cu.cuMemAllocAsync(ctypes.byref(out), SZ(size), VP(stream))
    if entry == "cuMemAllocAsync_ptsz":
        return cu.cuMemAllocAsync_ptsz(ctypes.byref(out), SZ(size), VP(stream))
    if entry.startswith("cuMemAllocFromPoolAsync"):  # and its _ptsz twin
        p = pool(cu, path, device)
        return getattr(cu, entry)(ctypes.byref(out), SZ(size), p, VP(0))
    if entry == "cuMemCreate":
        prop = AllocationProp(type=1, location=Location(1, device))
        return cu.cuMemCreate(ctypes.byref(out), SZ(size), ctypes.byref(prop), U64(0))
    if entry == "cuArrayCreate_v2":  # FLOAT, 1 channel: 4 bytes an element
        desc = Array(w=size // 16, h=4, format=0x20, channels=1)
        return cu.cuArrayCreate_v2(ctypes.byref(out), ctypes.byref(desc))
    if entry == "cuArray3DCreate_v2":  # UNSIGNED_INT8, 4 channels: 4 bytes an element
        desc = Array3D(w=size // 16, h=2, d=2, format=0x01, channels=4)
        return cu.cuArray3DCreate_v2(ctypes.byref(out), ctypes.byref(desc))
    if entry == "cuMipmappedArrayCreate":  # HALF, 2 channels, one level
        desc = Array3D(w=size // 16, h=4, d=0, format=0x10, channels=2)
        return cu.cuMipmappedArrayCreate(ctypes.byref(out), ctypes.byref(desc), U32(1))
    if entry == "cuMipmappedArrayCreate3":  # the same with three levels: each one halved
        desc = Array3D(w=size // 16, h=4, d=0, format=0x10, channels=2)
        return cu.cuMipmappedArrayCreate(ctypes.byref(out), ctypes.byref(desc), U32(3))
    return cu.cuMemAlloc_v2(ctypes.byref(out), SZ(size))
FREE = {"cuMemCreate": "cuMemRelease", "cuArrayCreate_v2": "cuArrayDestroy",
        "cuArray3DCreate_v2": "cuArrayDestroy", "cuMipmappedArrayCreate": "cuMipmappedArrayDestroy",
        "cuMipmappedArrayCreate3": "cuMipmappedArrayDestroy", "cuMemAllocAsync": "cuMemFreeAsync",
        "cuMemAllocFromPoolAsync": "cuMemFreeAsync", "cuMemAllocAsync_ptsz": "cuMemFreeAsync_ptsz",
        "cuMemAllocFromPoolAsync_ptsz": "cuMemFreeAsync_ptsz"}
def free(cu, entry, handle):
    name = FREE.get(entry, "cuMemFree_v2")
    if name.startswith("cuMemFreeAsync"):
        return getattr(cu, name)(U64(handle), VP(0))
    return getattr(cu, name)(U64(handle))
print("ready", flush=True)
for line in sys.stdin:
    cmd, path, *args = line.split()
    cu, out = lib(path), U64()
    if cmd == "context":  # create DEV (cuCtxCreate_v2, pushed) | primary DEV (the runtime's way)
        how, device, ctx = args[0], int(args[1]), VP()
        if how == "create":
            rc = cu.cuCtxCreate_v2(ctypes.byref(ctx), U32(0), ctypes.c_int(device))
        else:
            rc = cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), ctypes.c_int(device))
            rc = rc or cu.cuCtxSetCurrent(ctx)
        print("context", rc, ctx.value, flush=True)
    elif cmd == "stream":  # cuStreamCreate: on the current context's device
        stream = VP()
        print("stream", cu.cuStreamCreate(ctypes.byref(stream), U32(0)), stream.value, flush=True)
    elif cmd in ("set", "push"):
        fn = cu.cuCtxSetCurrent if cmd == "set" else cu.cuCtxPushCurrent_v2
        print(cmd, fn(VP(int(args[0]))), flush=True)
    elif cmd == "pop":
        ctx = VP()
        print("pop", cu.cuCtxPopCurrent_v2(ctypes.byref(ctx)), flush=True)
    elif cmd == "alloc":
        entry, size = args[0], int(args[1])
        device = int(args[2]) if len(args) > 2 else 0
        stream = int(args[3]) if len(args) > 3 else 0
        print("calling", flush=True)
        rc = alloc(cu, path, entry, size, device, out, stream)
        print("returned", rc, out.value, cu.cuStubAllocatedBytes(), flush=True)
    elif cmd == "free":
        rc = free(cu, args[0], int(args[1]))
        print("freed", rc, cu.cuStubAllocatedBytes(), flush=True)
    elif cmd == "thread":  # a thread that starts and exits
        t = threading.Thread(target=lambda: None)
        t.start()
        t.join()
        print("thread", flush=True)
    elif cmd == "churn":  # pairs a second, seconds: paced alloc/free of size bytes
        rate, seconds, size = int(args[0]), float(args[1]), int(args[2])
        start, done = time.monotonic(), 0
        while (now := time.monotonic()) - start < seconds:
            if done >= rate * (now - start):
                time.sleep(0.0005)
                continue
            assert cu.cuMemAlloc_v2(ctypes.byref(out), SZ(size)) == 0
            assert cu.cuMemFree_v2(out) == 0
            done += 1
        print("churned", done, round(time.monotonic() - start, 3), cu.cuStubAllocatedBytes(),
              flush=True)
"""

ENTRY_OF = {
    "cuMemAlloc_v2": EntryPoint.MEM_ALLOC,
    "cuMemCreate": EntryPoint.MEM_CREATE,
    "cuMemAllocManaged": EntryPoint.MEM_ALLOC_MANAGED,
    "cuMemAllocPitch_v2": EntryPoint.MEM_ALLOC_PITCH,
    "cuMemAllocAsync": EntryPoint.MEM_ALLOC_ASYNC,
    "cuMemAllocFromPoolAsync": EntryPoint.MEM_ALLOC_FROM_POOL_ASYNC,
    "cuArrayCreate_v2": EntryPoint.ARRAY_CREATE,
    "cuArray3DCreate_v2": EntryPoint.ARRAY_3D_CREATE,
    "cuMipmappedArrayCreate": EntryPoint.MIPMAPPED_ARRAY_CREATE,
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

    def context(self, lib: Path, how: str, device: int) -> int:
        """A context on ``device`` made current on the caller's thread: ``create``
        (cuCtxCreate_v2, pushed) or ``primary`` (cuDevicePrimaryCtxRetain + cuCtxSetCurrent, as
        the runtime API does); its handle."""
        self.send(f"context {lib} {how} {device}")
        word, rc, handle = (self.line() or "").split()
        assert (word, rc) == ("context", "0")
        return int(handle)

    def call(self, text: str) -> list[int]:
        """One command that answers at once (alloc, free, set, push, pop): its numbers."""
        self.send(text)
        if text.startswith("alloc"):
            assert self.line() == "calling"
        answer = (self.line(timeout_seconds=5.0) or "").split()
        assert answer, f"no answer to {text!r}: state {self.state()}"
        return [int(word) for word in answer[1:]]

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
    caller.context(lib, "primary", 0)

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
    caller.context(built.stub_library, "primary", 0)
    # 10,000 pairs a second for 2 s, read from here meanwhile: never more than one in flight.
    caller.send(f"churn {built.stub_library} 10000 2.0 {64 * KiB}")
    seen: list[int] = []
    assert caller.proc.stdout is not None
    deadline = time.monotonic() + 30.0
    while not readable([caller.proc.stdout], 0.01) and time.monotonic() < deadline:
        if caller.state() == "T":
            break
        if (count := guard.allocated_bytes(cgroup_id=cid, device=0)) is not None:
            seen.append(count)
    assert caller.state() != "T", f"stopped while churning; counts seen {seen[-5:]}"
    word, done, seconds, held = (caller.line(timeout_seconds=1.0) or "? ? ? ?").split()
    assert (word, held) == ("churned", "0")
    assert float(seconds) >= 2.0
    assert int(done) >= 15_000, f"only {done} pairs in {seconds} s: the machine was too slow"
    assert len(seen) > 10
    assert all(0 <= n <= 64 * KiB for n in seen), seen
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
    # The current context is made through the probed file: were the copy seen, its calls would
    # have a device. cuMemCreate names its device itself.
    caller.context(built.stub_library, "primary", 0)

    for entry in ("cuMemAlloc_v2", "cuMemCreate"):
        caller.send(f"alloc {copy} {entry} {1 * MiB}")
        assert caller.line() == "calling"
        assert (caller.line(timeout_seconds=5.0) or "").startswith("returned 0 ")
    assert events_for(guard, caller.proc.pid, timeout_ms=100) == []
    assert guard.allocated_bytes(cgroup_id=cid, device=0) is None
    assert caller.state() != "T"

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
    caller.context(built.stub_library, "primary", 0)
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


def test_each_allocation_counts_on_its_contexts_device_and_stops_only_there(
    guard: AllocGuard, cgroup_tree: CgroupTree, callers: list[Caller], built: AllocGuardBuild
) -> None:
    cg = cgroup_tree.make(2, "two-devices")
    cid = cgroup_id(cgroup_dir(cg))
    guard.set_headroom(cgroup_id=cid, device=0, headroom_bytes=1 * MiB)
    guard.set_headroom(cgroup_id=cid, device=1, headroom_bytes=4 * MiB)
    lib = built.stub_library
    caller = Caller(cgroup_tree, cg, callers)

    on_0 = caller.context(lib, "create", 0)  # pushed: current
    caller.call(f"alloc {lib} cuMemAlloc_v2 {768 * KiB}")
    on_1 = caller.context(lib, "create", 1)  # pushed over it: current
    caller.call(f"alloc {lib} cuMemAlloc_v2 {3 * MiB}")
    # 768 KiB + 512 KiB would cross device 0's 1 MiB: counted on device 1, it does not.
    caller.call(f"alloc {lib} cuMemAllocManaged {512 * KiB}")
    assert guard.allocated_bytes(cgroup_id=cid, device=0) == 768 * KiB
    assert guard.allocated_bytes(cgroup_id=cid, device=1) == 3 * MiB + 512 * KiB
    caller.call("pop " + str(lib))  # back to device 0's context
    caller.call(f"alloc {lib} cuMemAllocPitch_v2 {128 * KiB}")
    caller.call(f"push {lib} {on_1}")
    caller.call(f"alloc {lib} cuMemAllocAsync {256 * KiB}")  # NULL stream: the current device
    _, stream_on_1 = caller.call(f"stream {lib}")
    caller.call(f"set {lib} {on_0}")  # replaces the top: device 0 again
    # Each of these names its device itself, not through the current context: cuMemCreate's
    # location, the pool's location at cuMemPoolCreate, the stream's context at its creation.
    caller.call(f"alloc {lib} cuMemCreate {128 * KiB} 1")
    caller.call(f"alloc {lib} cuMemAllocFromPoolAsync {32 * KiB} 1")
    caller.call(f"alloc {lib} cuMemAllocAsync {32 * KiB} 0 {stream_on_1}")
    assert guard.allocated_bytes(cgroup_id=cid, device=0) == 896 * KiB
    assert guard.allocated_bytes(cgroup_id=cid, device=1) == 3 * MiB + 960 * KiB
    assert events_for(guard, caller.proc.pid, timeout_ms=100) == []

    caller.send(f"alloc {lib} cuMemAlloc_v2 {256 * KiB}")  # 1152 KiB > 1 MiB on device 0
    assert caller.line() == "calling"
    assert caller.wait_stopped(5.0), f"not stopped: state {caller.state()}"
    (event,) = events_for(guard, caller.proc.pid, timeout_ms=1000)
    assert (event.device, event.allocated_bytes, event.size_bytes) == (0, 896 * KiB, 256 * KiB)
    assert guard.allocated_bytes(cgroup_id=cid, device=1) == 3 * MiB + 960 * KiB
    caller.proc.send_signal(signal.SIGCONT)
    assert (caller.line() or "").startswith("returned 0 ")


def test_a_thread_with_no_known_context_is_never_counted_or_stopped(
    guard: AllocGuard, cgroup_tree: CgroupTree, callers: list[Caller], built: AllocGuardBuild
) -> None:
    cg = cgroup_tree.make(2, "no-context")
    cid = cgroup_id(cgroup_dir(cg))
    for device in (0, 1):
        guard.set_headroom(cgroup_id=cid, device=device, headroom_bytes=0)
    lib = built.stub_library
    caller = Caller(cgroup_tree, cg, callers)
    caller.call(f"alloc {lib} cuMemAlloc_v2 {1 * MiB}")  # no context made through the probes
    caller.call(f"set {lib} {0x1234_5000}")  # a context no probe saw created
    caller.call(f"alloc {lib} cuMemAlloc_v2 {1 * MiB}")
    assert caller.state() != "T"
    assert events_for(guard, caller.proc.pid, timeout_ms=100) == []
    assert guard.allocated_bytes(cgroup_id=cid, device=0) is None
    assert guard.allocated_bytes(cgroup_id=cid, device=1) is None


@pytest.mark.parametrize(
    "entry",
    [
        *sorted(ENTRY_OF),
        "cuMipmappedArrayCreate3",
        "cuMemAllocAsync_ptsz",
        "cuMemAllocFromPoolAsync_ptsz",
    ],
)
def test_each_entry_point_counts_what_it_took_and_its_free_gives_it_back(
    guard: AllocGuard,
    cgroup_tree: CgroupTree,
    callers: list[Caller],
    built: AllocGuardBuild,
    entry: str,
) -> None:
    cg = cgroup_tree.make(2, "counted")
    cid = cgroup_id(cgroup_dir(cg))
    guard.set_headroom(cgroup_id=cid, device=1, headroom_bytes=64 * MiB)
    lib = built.stub_library
    caller = Caller(cgroup_tree, cg, callers)
    caller.context(lib, "primary", 1)
    rc, first, held_first = caller.call(f"alloc {lib} {entry} {1 * MiB} 1")
    rc2, second, held_both = caller.call(f"alloc {lib} {entry} {2 * MiB} 1")
    assert rc == rc2 == 0
    # What the stand-in took (its own arithmetic: pitch rounding, mip levels) is what counted.
    assert guard.allocated_bytes(cgroup_id=cid, device=1) == held_both
    assert guard.allocated_bytes(cgroup_id=cid, device=0) is None
    assert caller.call(f"free {lib} {entry} {first}") == [0, held_both - held_first]
    assert guard.allocated_bytes(cgroup_id=cid, device=1) == held_both - held_first
    assert caller.call(f"free {lib} {entry} {second}") == [0, 0]
    assert guard.allocated_bytes(cgroup_id=cid, device=1) == 0


def test_a_process_that_exits_without_freeing_gives_its_count_back(
    guard: AllocGuard, cgroup_tree: CgroupTree, callers: list[Caller], built: AllocGuardBuild
) -> None:
    cg = cgroup_tree.make(2, "exiter")
    cid = cgroup_id(cgroup_dir(cg))
    guard.set_headroom(cgroup_id=cid, device=0, headroom_bytes=1 * MiB)
    lib = built.stub_library
    stays = Caller(cgroup_tree, cg, callers)
    stays.context(lib, "primary", 0)
    stays.call(f"alloc {lib} cuMemAlloc_v2 {256 * KiB}")

    leaves = Caller(cgroup_tree, cg, callers)
    leaves.context(lib, "primary", 0)
    leaves.call(f"alloc {lib} cuMemAlloc_v2 {512 * KiB}")
    leaves.call(f"alloc {lib} cuMemCreate {128 * KiB} 0")
    assert guard.allocated_bytes(cgroup_id=cid, device=0) == 896 * KiB
    leaves.proc.kill()  # the test's own process, by PID
    leaves.proc.wait(timeout=10)
    assert guard.allocated_bytes(cgroup_id=cid, device=0) == 256 * KiB

    # Stopped inside an allocation and killed there (what the enforcer does to one over its
    # limit): the reservation its entry made goes too.
    frozen = Caller(cgroup_tree, cg, callers)
    frozen.context(lib, "primary", 0)
    frozen.send(f"alloc {lib} cuMemAlloc_v2 {1 * MiB}")
    assert frozen.line() == "calling"
    assert frozen.wait_stopped(5.0)
    assert guard.allocated_bytes(cgroup_id=cid, device=0) == 256 * KiB + 1 * MiB
    frozen.proc.kill()
    frozen.proc.wait(timeout=10)
    assert guard.allocated_bytes(cgroup_id=cid, device=0) == 256 * KiB

    # A thread that exits is not the process: what the process holds stays counted.
    stays.send(f"thread {lib}")
    assert stays.line() == "thread"
    assert guard.allocated_bytes(cgroup_id=cid, device=0) == 256 * KiB


BPF_MAP_GET_FD_BY_ID = 14
NR_BPF = 321  # x86_64

# Child: drops to nobody (uid/gid 65534, no capabilities left) unless told not to, then asks
# the kernel for an fd of each map id given; prints "id errno" per map (0: it got one).
MAP_OPENER = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if sys.argv[1] == "drop":
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
for map_id in map(int, sys.argv[2:]):
    attr = (ctypes.c_ubyte * 128)()
    ctypes.c_uint32.from_buffer(attr, 0).value = map_id
    fd = libc.syscall(NR_BPF, BPF_MAP_GET_FD_BY_ID, attr, 128)
    print(map_id, 0 if fd >= 0 else ctypes.get_errno(), flush=True)
""".replace("NR_BPF", str(NR_BPF)).replace("BPF_MAP_GET_FD_BY_ID", str(BPF_MAP_GET_FD_BY_ID))


def open_maps_as(how: str, ids: list[int]) -> dict[int, int]:
    done = subprocess.run(
        [sys.executable, "-c", MAP_OPENER, how, *map(str, ids)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return {int(a): int(b) for a, b in (line.split() for line in done.stdout.splitlines())}


def test_an_unprivileged_user_cannot_open_the_guards_maps(guard: AllocGuard) -> None:
    require(platform.machine() == "x86_64", "the bpf syscall number here is x86_64's")
    ids = guard.map_ids()
    assert {"headroom", "allocated", "sizes", "held", "contexts", "handles"} <= set(ids)
    # The probe works: root (CAP_SYS_ADMIN) gets every map by its id.
    assert open_maps_as("keep", list(ids.values())) == dict.fromkeys(ids.values(), 0)
    # Nobody gets none: EPERM, so no read and no write of a headroom or a count.
    assert open_maps_as("drop", list(ids.values())) == dict.fromkeys(ids.values(), errno.EPERM)
