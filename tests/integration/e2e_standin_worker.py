"""scripts/gpu_e2e_worker.py's protocol without CUDA, for gpu_e2e.py on the NVML stand-in.

Owns: speaking the GPU worker's protocol (``ready <pid>`` and ``held`` on stdout, ``go`` on
stdin, JSON records ``ready``/``held``/``go``/``allocating``/``alloc``/``signal`` appended to
``--record`` with CLOCK_MONOTONIC) for the roles ``greedy``, ``stubborn`` and ``hold``, and telling
the test what
NVML should list for it: its usage in bytes in ``$GPU_E2E_STANDIN_DIR/<pid>`` (replaced
atomically; removed when it exits on SIGTERM), while it holds ``$GPU_E2E_STANDIN_DEVICE`` (a
``c 195 0`` node) open as a CUDA process holds ``/dev/nvidia0``. With
``$GPU_E2E_STANDIN_CUDA`` (the libcuda stand-in, tests/cuda_stub) it maps that library, makes a
context on device 0 and makes every allocation through its ``cuMemAlloc_v2`` before writing the
usage, as PyTorch calls the driver: the allocation guard's uprobes see the calls (and freeze the
one that would cross) as they see a real worker's.
Must not: touch any process but itself, or any file but its record and its usage file.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

MIB = 1 << 20
CONTEXT_MIB = 512
"""What a CUDA context shows in NVML before any allocation (about 500 MiB on an H200)."""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["greedy", "stubborn", "hold"], required=True)
    parser.add_argument("--label", default="")
    parser.add_argument("--record", required=True)
    parser.add_argument("--max-mib", type=int, required=True)
    parser.add_argument("--step-mib", type=int, default=512)
    parser.add_argument("--interval", type=float, default=0.1)
    args = parser.parse_args()
    role, label, pid = args.role, args.label, os.getpid()
    usage = Path(os.environ["GPU_E2E_STANDIN_DIR"]) / str(pid)
    gpu_fd = os.open(os.environ["GPU_E2E_STANDIN_DEVICE"], os.O_PATH)
    fd = os.open(args.record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def record(**fields: object) -> None:
        line = {"role": role, "label": label, "pid": pid, "t": time.monotonic(), **fields}
        os.write(fd, (json.dumps(line, sort_keys=True) + "\n").encode())

    def use(mib: int) -> None:
        tmp = usage.with_suffix(".tmp")
        tmp.write_text(str(mib * MIB))
        os.replace(tmp, usage)

    cuda = os.environ.get("GPU_E2E_STANDIN_CUDA")
    cu = None if not cuda else ctypes.CDLL(cuda)
    if cu is not None:
        # A context first: the guard counts an allocation only on a device it saw a context
        # made for, as CUDA code always has one before it allocates.
        ctx = ctypes.c_void_p()
        if cu.cuCtxCreate_v2(ctypes.byref(ctx), ctypes.c_uint(0), ctypes.c_int(0)) != 0:
            raise SystemExit("cuCtxCreate_v2 failed on the libcuda stand-in")

    def allocate(mib: int) -> None:
        """Ask the libcuda stand-in for ``mib`` (the call the guard may freeze), if it is used."""
        if cu is not None:
            out = ctypes.c_ulonglong()
            if cu.cuMemAlloc_v2(ctypes.byref(out), ctypes.c_size_t(mib * MIB)) != 0:
                raise SystemExit("cuMemAlloc_v2 failed on the libcuda stand-in")

    def on_term(signum: int, frame: FrameType | None) -> None:
        record(kind="signal", signal="TERM")
        if role == "greedy":
            usage.unlink(missing_ok=True)  # the driver frees the memory as the process exits
            os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    use(CONTEXT_MIB)
    record(kind="ready", cuda_init_s=0.0)
    print(f"ready {pid}", flush=True)
    if role == "hold":
        allocate(args.max_mib)
        use(CONTEXT_MIB + args.max_mib)
        record(kind="held", mib=args.max_mib)
        print("held", flush=True)
    else:
        sys.stdin.readline()  # "go"
        record(kind="go")
        total = 0
        while total < args.max_mib:
            step = min(args.step_mib, args.max_mib - total)
            record(kind="allocating", mib=total + step)
            allocate(step)
            total += step
            use(CONTEXT_MIB + total)
            record(kind="alloc", mib=total)
            time.sleep(args.interval)
    while gpu_fd >= 0:
        time.sleep(3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
