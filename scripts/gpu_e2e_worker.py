"""The GPU workload of the end-to-end run (scripts/gpu_e2e.py): one PyTorch process per role.

Owns: allocating device memory with PyTorch's ordinary allocator (cudaMalloc) in the pattern of
its role, and recording, with the system-wide CLOCK_MONOTONIC, every SIGTERM it receives (and
its steps: ready, go, each allocation just before it is made (``allocating``) and once done
(``alloc``), fork, close) as one JSON line appended to ``--record``; a ``closer`` closes its own
GPU device files; a ``hidden-thread`` worker gives the thread that does its CUDA work a file
table of its own. Must not: touch any process but itself (a
``forked`` or ``hidden-thread`` parent forks one child, which never touches CUDA), use managed
memory, or exit without recording.

Roles (each prints ``ready <pid>`` on stdout once its CUDA context exists, then):

- ``greedy``: waits for a line on stdin, then grows by ``--step-mib`` every ``--interval``
  seconds up to ``--max-mib``, then holds. SIGTERM: record, exit at once (memory freed).
- ``stubborn``: like ``greedy`` but records and *ignores* SIGTERM (only SIGKILL stops it).
- ``hold``: allocates ``--max-mib`` at once and sleeps. SIGTERM: record and keep holding (a
  neighbour or host process must never get one: any record is a wrong kill).
- ``forked``: waits for stdin, grows like ``greedy`` to ``--max-mib``, then forks a child that
  inherits the CUDA file descriptors and sleeps (SIGTERM: record, exit), records the fork, stays
  ``--linger`` seconds and exits with ``os._exit`` (no CUDA teardown): NVML may keep listing the
  dead parent's PID while the child holds its memory.
- ``closer``: waits for stdin, grows like ``greedy`` to ``--max-mib`` and synchronizes, then
  closes every open file descriptor that is a GPU device file (char major 195, minor < 254:
  ``/dev/nvidia0``…; not ``nvidiactl`` 195:255, ``nvidia-modeset`` 195:254 or ``nvidia-uvm``),
  records the fds and minors it closed (``closed``; also printed as ``closed <n>``), keeps its
  tensors referenced (the memory stays allocated) and sleeps without calling CUDA again.
  SIGTERM: record, exit at once. A live process that disowns its memory this way must still be
  charged (docs/gpu-e2e.md, Rerun after the ownership rule).
- ``hidden-thread``: everything CUDA (importing torch, the context, every allocation, the fork)
  happens in one thread that first gave itself a private file table (``unshare(CLONE_FILES)``),
  and in the threads it starts: the GPU device files are in that table, not in the thread group
  leader's, so ``/proc/<pid>/fd`` shows none of them while ``/proc/<pid>/task/<tid>/fd`` does.
  It records what it sees of both tables (``files``), then behaves as ``forked``: the fork
  happens in that thread, whose table the child copies, so the child holds the context and NVML
  keeps listing the dead parent, a PID whose only occupant hid its GPU files.

The ``ready`` record carries ``CUDA_MPS_PIPE_DIRECTORY`` as the process saw it (the MPS trial of
gpu_e2e.py points a client at its tenant's daemon and an ordinary process at a directory where
no daemon listens).

Usage (normally started by gpu_e2e.py inside a container cgroup)::

    python3 scripts/gpu_e2e_worker.py --role greedy --max-mib 8192 --record /tmp/r.jsonl
    python3 scripts/gpu_e2e_worker.py --role closer --max-mib 8192 --record /tmp/r.jsonl
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import signal
import stat
import sys
import threading
import time
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any

MIB = 1 << 20
NVIDIA_MAJOR = 195
"""NVIDIA's char major: minors 0-253 are GPUs, 254 ``nvidia-modeset``, 255 ``nvidiactl``."""
FIRST_NON_GPU_MINOR = 254
CLONE_FILES = 0x00000400
"""unshare(2): give the calling thread a private copy of the file descriptor table."""
FORKING_ROLES = ("forked", "hidden-thread")


def _record(fd: int, **fields: object) -> None:
    """One JSON line, one ``write(2)`` on an O_APPEND fd: safe in a signal handler."""
    os.write(fd, (json.dumps(fields, sort_keys=True) + "\n").encode())


def close_gpu_files() -> tuple[list[int], list[int], list[str]]:
    """Close every open fd of this process that is a GPU device file (char 195, minor < 254).

    Returns (closed fds, their minors, the other char devices left open as ``major:minor``,
    each once).
    ``os.stat`` on ``/proc/self/fd/<n>`` follows the link to the file the fd refers to; the
    fd ``os.listdir`` itself used is gone by then (``stat`` fails, skipped)."""
    closed: list[int] = []
    minors: list[int] = []
    kept: list[str] = []
    for name in sorted(os.listdir("/proc/self/fd"), key=int):
        try:
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if not stat.S_ISCHR(st.st_mode):
            continue
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        if major == NVIDIA_MAJOR and minor < FIRST_NON_GPU_MINOR:
            os.close(int(name))
            closed.append(int(name))
            minors.append(minor)
        else:
            kept.append(f"{major}:{minor}")
    return closed, minors, sorted(set(kept))


def gpu_file_links(fd_dir: str) -> list[str]:
    """What the links of one fd directory (``/proc/<pid>/fd``, ``/proc/<pid>/task/<tid>/fd``)
    point to that is an NVIDIA device file: a ``/dev/nvidia*`` path (``nvidia-uvm``'s major
    is dynamic) or any char device of major 195 (a stand-in's ``c 195 0`` node). Sorted; an
    unreadable directory (the process is gone) is none."""
    found: list[str] = []
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return found
    for name in names:
        path = f"{fd_dir}/{name}"
        try:
            target = os.readlink(path)
            st = os.stat(path)
        except OSError:
            continue
        if target.startswith("/dev/nvidia") or (
            stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == NVIDIA_MAJOR
        ):
            found.append(target)
    return sorted(found)


def unshare_file_table() -> None:
    """Give the calling thread a private copy of its process's file table: what it (and every
    thread it starts afterwards: pthread_create shares the creator's table) opens from now on
    is invisible in ``/proc/<pid>/fd`` (the leader's table)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_FILES) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"unshare(CLONE_FILES): {os.strerror(errno)}")


def in_private_file_table(body: Callable[[], None]) -> None:
    """Run ``body`` in a new thread that first unshares its file table; wait for it here. The
    wait is in short joins: Python runs signal handlers in the main thread only, and a handler
    must run while ``body`` works. ``body`` raising is raised here."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            unshare_file_table()
            body()
        except BaseException as e:  # noqa: BLE001 (re-raised in the main thread)
            failed.append(e)

    thread = threading.Thread(target=run, name="private-files")
    thread.start()
    while thread.is_alive():
        thread.join(0.05)
    if failed:
        raise failed[0]


def file_tables(pid: int) -> dict[str, Any]:
    """This thread's view of its process's GPU files: its TID, the leader's table
    (``/proc/<pid>/fd``) and its own (``/proc/thread-self/fd``)."""
    return {
        "tid": threading.get_native_id(),
        "leader": gpu_file_links(f"/proc/{pid}/fd"),
        "thread": gpu_file_links("/proc/thread-self/fd"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--role",
        choices=["greedy", "stubborn", "hold", "forked", "closer", "hidden-thread"],
        required=True,
    )
    parser.add_argument("--label", default="", help="trial label copied into every record")
    parser.add_argument("--record", required=True, help="JSON-lines file to append to")
    parser.add_argument("--max-mib", type=int, required=True, help="memory to reach, MiB")
    parser.add_argument("--step-mib", type=int, default=512, help="growth step, MiB")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between steps")
    parser.add_argument(
        "--linger", type=float, default=0.3, help="forked, hidden-thread: parent's stay"
    )
    args = parser.parse_args(argv)

    fd = os.open(args.record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    role: str = args.role
    label: str = args.label

    def log_step(kind: str, **fields: object) -> None:
        """Record one step with this process's role (read at the call: a forked child's is
        its own), label, PID and the time."""
        _record(
            fd, kind=kind, role=role, label=label, pid=os.getpid(), t=time.monotonic(), **fields
        )

    def on_term(signum: int, frame: FrameType | None) -> None:
        log_step("signal", signal="TERM")
        if role in ("greedy", "forked-child", "closer"):
            os._exit(0)

    signal.signal(signal.SIGTERM, on_term)

    def work() -> None:
        """Every CUDA call of the worker, in the thread that calls it."""
        nonlocal role
        torch: Any = importlib.import_module("torch")
        t0 = time.monotonic()
        torch.cuda.init()
        blocks: list[Any] = [torch.empty(MIB, dtype=torch.uint8, device="cuda")]
        torch.cuda.synchronize()
        log_step(
            "ready",
            cuda_init_s=time.monotonic() - t0,
            mps_pipe_directory=os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
        )
        if role == "hidden-thread":
            log_step("files", **file_tables(os.getpid()))
        print(f"ready {os.getpid()}", flush=True)

        if role == "hold":
            blocks.append(torch.empty(args.max_mib * MIB, dtype=torch.uint8, device="cuda"))
            torch.cuda.synchronize()
            log_step("held", mib=args.max_mib)
            print("held", flush=True)
            while True:
                time.sleep(3600)

        sys.stdin.readline()  # "go"
        log_step("go")
        total = 0
        while total < args.max_mib:
            step = min(args.step_mib, args.max_mib - total)
            # Before the call: with the allocation guard the crossing call is frozen before it
            # runs and NVML never shows it; this record says when it was made.
            log_step("allocating", mib=total + step)
            blocks.append(torch.empty(step * MIB, dtype=torch.uint8, device="cuda"))
            torch.cuda.synchronize()
            total += step
            log_step("alloc", mib=total)
            if total < args.max_mib:
                time.sleep(args.interval)

        if role in FORKING_ROLES:
            # The child never touches CUDA; it only keeps the inherited device fds open. fork()
            # copies the calling thread's file table: for hidden-thread, the private one.
            warnings.filterwarnings(
                "ignore", "This process .* is multi-threaded", DeprecationWarning
            )
            child = os.fork()
            if child == 0:
                role = "forked-child"  # the handler reads it: record, then exit
                log_step("child")
                while True:
                    signal.pause()
            log_step("forked", child=child)
            time.sleep(args.linger)
            log_step("parent_exit")
            os._exit(0)

        if role == "closer":
            # Every allocation has completed before the files go; from here on no CUDA call
            # (the context's device files are closed). ``blocks`` stays referenced: the memory
            # stays.
            torch.cuda.synchronize()
            fds, minors, kept = close_gpu_files()
            log_step("closed", fds=fds, minors=minors, kept=kept, mib=total)
            print(f"closed {len(fds)}", flush=True)

        while True:
            time.sleep(3600)

    if role == "hidden-thread":
        in_private_file_table(work)
    else:
        work()
    return 0


if __name__ == "__main__":
    sys.exit(main())
