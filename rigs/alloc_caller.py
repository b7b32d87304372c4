"""A process in a cgroup that calls the libcuda stand-in (tests/cuda_stub) one command at a time,
and the waits on its ``/proc`` state: for the allocation guard's thawer tests
(tests/kernel/test_allocguard_thawer.py) and its benchmark (benchmarks/allocguard_thaw.py).

Owns: the caller's script and its driver (``AllocCaller``); ``wait_state``. Must not signal
anything (the ``CgroupTree`` that started a caller kills it).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from gpuguard.adapters.procfs import read_state
from gpuguard.adapters.readiness import readable
from gpuguard.core.model import ContainerCgroup
from rigs.cgroups import CgroupTree

# One command a line on stdin, one answer a line on stdout. "calling <CLOCK_BOOTTIME ns>" is
# printed just before the entry point runs (a caller stopped by the probe has said it and no
# more); "trapped" once a SIGTERM handler is installed ("term" when it runs); "held <bytes>":
# what the stand-in holds for this process (cuStubAllocatedBytes); "stopping" just before the
# process stops itself (SIGSTOP from its own code: the tenant's stop), and "continued" once
# something resumed it.
SCRIPT = r"""
import ctypes, os, signal, sys, time
libs = {}
def lib(path):
    if path not in libs:
        libs[path] = ctypes.CDLL(path)
        # A context on device 0 made current, as CUDA code has before it allocates: the guard
        # counts an allocation only on a device it saw the caller's context made for.
        ctx = ctypes.c_void_p()
        libs[path].cuCtxCreate_v2(ctypes.byref(ctx), ctypes.c_uint(0), ctypes.c_int(0))
    return libs[path]
print("ready", flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "alloc":
        out = ctypes.c_ulonglong()
        cu = lib(args[0])
        print("calling", time.clock_gettime_ns(time.CLOCK_BOOTTIME), flush=True)
        rc = cu.cuMemAlloc_v2(ctypes.byref(out), ctypes.c_size_t(int(args[1])))
        print("returned", rc, flush=True)
    elif cmd == "trapterm":
        # A SIGTERM handler, as a framework's clean shutdown has: says so, and keeps running.
        signal.signal(signal.SIGTERM, lambda *_: print("term", flush=True))
        print("trapped", flush=True)
    elif cmd == "held":
        cu = lib(args[0])
        cu.cuStubAllocatedBytes.restype = ctypes.c_ulonglong
        print("held", cu.cuStubAllocatedBytes(), flush=True)
    elif cmd == "stopself":
        print("stopping", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        print("continued", flush=True)
"""


class AllocCaller:
    """The caller, started in ``cg``."""

    def __init__(self, tree: CgroupTree, cg: ContainerCgroup) -> None:
        self.proc = tree.spawn(
            [sys.executable, "-c", SCRIPT],
            cgroups=[cg],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,  # unbuffered: poll() on the pipe sees every line not yet read
        )
        assert self.line() == "ready"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode() + b"\n")
        self.proc.stdin.flush()

    def alloc(self, library: Path, size_bytes: int) -> int:
        """Start a cuMemAlloc_v2 call and wait until it is about to run: the caller's
        ``CLOCK_BOOTTIME`` then, in ns."""
        self.send(f"alloc {library} {size_bytes}")
        word, calling_ns = (self.line() or "").split()
        assert word == "calling"
        return int(calling_ns)

    def held(self, library: Path) -> int:
        """What the stand-in holds for this process now (``cuStubAllocatedBytes``)."""
        self.send(f"held {library}")
        word, held = (self.line() or "").split()
        assert word == "held"
        return int(held)

    def trap_term(self) -> None:
        """Install a SIGTERM handler that prints "term" and keeps the process running."""
        self.send("trapterm")
        assert self.line() == "trapped"

    def line(self, timeout_seconds: float = 30.0) -> str | None:
        """The next line, or None when none came in time."""
        assert self.proc.stdout is not None
        if not readable([self.proc.stdout], timeout_seconds):
            return None
        return self.proc.stdout.readline().decode().strip()

    def state(self) -> str | None:
        return read_state(Path("/proc"), self.proc.pid)

    def stopped(self) -> bool:
        return self.state() == "T"

    def close(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def wait_state(predicate: Callable[[], bool], timeout_seconds: float) -> float | None:
    """``time.monotonic()`` just after ``predicate`` first held (checked every 0.5 ms): no
    earlier than the change it saw. None when it did not hold within ``timeout_seconds``."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        held = predicate()
        now = time.monotonic()
        if held:
            return now
        if now > deadline:
            return None
        time.sleep(0.0005)
