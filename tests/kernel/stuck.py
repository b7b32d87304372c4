"""Tenants' processes that make reading them slow or endless, for the kernel and integration tests
of bounded ``/proc`` reads: the scripts they run, and how to get one stuck in ``exec`` on a FUSE
file whose daemon is stopped (``tests/kernel/fuse_stall.py``), where its ``/proc/<pid>/stat``
blocks (Linux 6.18).

Owns: ``HOLD``, ``FAT`` and ``EXEC_AFTER_GO`` (each says ``ready`` once set up), ``blocks`` (does
a call return in time), ``go`` and ``stuck_in_exec``. Must not: start or kill a process (the
tests' fixtures and cgroup trees own them).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.kernel.fuse_stall import FuseMount

HOLD = r"""
import os, stat, sys, threading
for path in sys.argv[1:]:  # in order: the first gets the lowest fd
    chr_node = stat.S_ISCHR(os.stat(path).st_mode)
    os.open(path, os.O_PATH if chr_node else os.O_RDONLY)  # O_PATH: a GPU file, no driver
print("ready", flush=True)
threading.Event().wait()
"""
"""Opens each file given (a char device ``O_PATH``: a GPU file without its driver) and waits."""

FAT = r"""
import os, resource, sys
count = int(sys.argv[1])
want = count + 64
_soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if hard != resource.RLIM_INFINITY and hard < want:
    hard = want  # with CAP_SYS_RESOURCE, up to fs.nr_open
resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
null = os.open("/dev/null", os.O_RDONLY)
for _ in range(count):
    os.dup(null)
print("ready", flush=True)
sys.stdin.read()
"""
"""Holds as many more open files as its argument says, until its stdin closes."""

EXEC_AFTER_GO = r"""
import os, sys
os.open(sys.argv[1], os.O_RDONLY | os.O_CLOEXEC)  # closed by exec: FUSE sends FLUSH and waits
print("ready", flush=True)
sys.stdin.readline()
os.execv("/bin/sleep", ["sleep", "600"])
"""
"""Holds the file given open close-on-exec and, at ``go``, execs: on a FUSE file whose daemon is
stopped, the exec waits for the FLUSH answer, and so do reads of its ``stat`` and ``fd`` links."""

STUCK_WITHIN_SECONDS = 10.0
"""How long ``stuck_in_exec`` waits for a process's ``stat`` to block before failing the test."""


def blocks(call: Callable[[], object], seconds: float = 1.0) -> bool:
    """``call()`` has not returned after ``seconds`` (it is left in a daemon thread, where the
    error it gets once the FUSE daemon is killed is dropped)."""

    def run() -> None:
        with contextlib.suppress(OSError):
            call()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    return worker.is_alive()


def stat_blocks(pid: int) -> bool:
    """A plain read of ``/proc/<pid>/stat`` does not return within 0.2 s."""
    return blocks(lambda: Path(f"/proc/{pid}/stat").read_bytes(), 0.2)


def go(process: subprocess.Popen[Any]) -> None:
    """Tell an ``EXEC_AFTER_GO`` process (its stdin a pipe, text or bytes) to exec."""
    assert process.stdin is not None
    os.write(process.stdin.fileno(), b"go\n")


def stuck_in_exec(fuse: FuseMount, *processes: subprocess.Popen[Any]) -> None:
    """Stop the daemon, let each ``EXEC_AFTER_GO`` process exec (its FUSE file is close-on-exec:
    the kernel sends FLUSH and waits for the answer), and wait until a plain read of each one's
    ``stat`` blocks; fails the test after ``STUCK_WITHIN_SECONDS``."""
    fuse.stop()
    for process in processes:
        go(process)
    deadline = time.monotonic() + STUCK_WITHIN_SECONDS
    for process in processes:
        while not stat_blocks(process.pid):
            if time.monotonic() > deadline:
                pytest.fail(f"PID {process.pid}'s exec never blocked on the stopped daemon")
