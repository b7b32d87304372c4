"""The GPU workload of the end-to-end run (scripts/gpu_e2e.py): one PyTorch process per role.

Owns: allocating device memory with PyTorch's ordinary allocator (cudaMalloc) in the pattern of
its role, and recording, with the system-wide CLOCK_MONOTONIC, every SIGTERM it receives as one
JSON line appended to ``--record``. Must not: touch any process but itself (a ``forked`` parent
forks one child, which never touches CUDA), use managed memory, or exit without recording.

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

Usage (normally started by gpu_e2e.py inside a container cgroup)::

    python3 scripts/gpu_e2e_worker.py --role greedy --max-mib 8192 --record /tmp/r.jsonl
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import time
import warnings
from types import FrameType
from typing import Any

MIB = 1 << 20


def _record(fd: int, **fields: object) -> None:
    """One JSON line, one ``write(2)`` on an O_APPEND fd: safe in a signal handler."""
    os.write(fd, (json.dumps(fields, sort_keys=True) + "\n").encode())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["greedy", "stubborn", "hold", "forked"], required=True)
    parser.add_argument("--label", default="", help="trial label copied into every record")
    parser.add_argument("--record", required=True, help="JSON-lines file to append to")
    parser.add_argument("--max-mib", type=int, required=True, help="memory to reach, MiB")
    parser.add_argument("--step-mib", type=int, default=512, help="growth step, MiB")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between steps")
    parser.add_argument("--linger", type=float, default=0.3, help="forked: parent's stay")
    args = parser.parse_args(argv)

    fd = os.open(args.record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    role: str = args.role
    label: str = args.label

    def on_term(signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        _record(fd, kind="signal", signal="TERM", role=role, label=label, pid=os.getpid(), t=now)
        if role in ("greedy", "forked-child"):
            os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    torch: Any = importlib.import_module("torch")
    t0 = time.monotonic()
    torch.cuda.init()
    blocks: list[Any] = [torch.empty(MIB, dtype=torch.uint8, device="cuda")]
    torch.cuda.synchronize()
    _record(
        fd,
        kind="ready",
        role=role,
        label=label,
        pid=os.getpid(),
        t=time.monotonic(),
        cuda_init_s=time.monotonic() - t0,
    )
    print(f"ready {os.getpid()}", flush=True)

    if role == "hold":
        blocks.append(torch.empty(args.max_mib * MIB, dtype=torch.uint8, device="cuda"))
        torch.cuda.synchronize()
        _record(
            fd,
            kind="held",
            role=role,
            label=label,
            pid=os.getpid(),
            t=time.monotonic(),
            mib=args.max_mib,
        )
        print("held", flush=True)
        while True:
            time.sleep(3600)

    sys.stdin.readline()  # "go"
    _record(fd, kind="go", role=role, label=label, pid=os.getpid(), t=time.monotonic())
    total = 0
    while total < args.max_mib:
        step = min(args.step_mib, args.max_mib - total)
        blocks.append(torch.empty(step * MIB, dtype=torch.uint8, device="cuda"))
        torch.cuda.synchronize()
        total += step
        _record(
            fd, kind="alloc", role=role, label=label, pid=os.getpid(), t=time.monotonic(), mib=total
        )
        if total < args.max_mib:
            time.sleep(args.interval)

    if role == "forked":
        # The child never touches CUDA; it only keeps the inherited device fds open.
        warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
        child = os.fork()
        if child == 0:
            role = "forked-child"  # the handler reads it: record, then exit
            _record(fd, kind="child", role=role, label=label, pid=os.getpid(), t=time.monotonic())
            while True:
                signal.pause()
        _record(
            fd,
            kind="forked",
            role=role,
            label=label,
            pid=os.getpid(),
            child=child,
            t=time.monotonic(),
        )
        time.sleep(args.linger)
        _record(fd, kind="parent_exit", role=role, label=label, pid=os.getpid(), t=time.monotonic())
        os._exit(0)

    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
