"""What one NVML poll costs: CPU and wall time per ``NvmlGpuSource.sample()``.

Owns measurement only; must not change anything on the machine except the CUDA holder processes
it starts itself (``--cuda-procs``), which it always stops.

Two modes:

``--mode stub`` (default; any Linux box with gcc): the C stand-in ``libnvidia-ml.so.1``
(tests/nvml_stub) with 1 and 8 GPUs × 1, 10, 100, 1000 processes per GPU. Rows: gpuguard's
``sample()``, and the same NVML calls through pynvml's public wrappers (which build a Python
object per process entry), to show why the adapter decodes the arrays itself.

``--mode gpu`` (a real NVIDIA node): the real driver. Rows: ``nvmlInit``; the bare NVML calls a
poll needs (count, then per GPU the three process lists), through pynvml; gpuguard's
``sample()``; and ``nvidia-smi --query-compute-apps=pid,used_memory`` as the baseline a shell
script would use. ``--cuda-procs N`` first starts N processes that each create a CUDA context and
hold ``--cuda-mib`` MiB through the driver API (``libcuda.so.1`` via ctypes: no torch needed),
spread over the GPUs, so the process lists are not empty.

    .venv/bin/python -m benchmarks.poll_cost                         # stub matrix, prints a table
    .venv/bin/python -m benchmarks.poll_cost --record docs/performance.md
    python3 -m benchmarks.poll_cost --mode gpu --cuda-procs 100 --record /tmp/gpu.md

Target: 8 GPUs × 100 processes < 2 ms of CPU per poll.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from gpuguard.adapters.nvml import NvmlGpuSource
from rigs.measure import append_record, machine
from rigs.nvml_stub import STUB_DIR, STUB_LIB, stub_device, stub_scenario, stub_uuid
from rigs.processes import write_atomic

ROOT = Path(__file__).resolve().parents[1]

TARGET_CPU_MS = 2.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    what: str
    gpus: int
    procs_per_gpu: int | None
    iterations: int
    cpu_ms: float
    wall_ms: float
    note: str = ""


def measure(
    fn: Callable[[], object], iterations: int, *, children: bool = False
) -> tuple[float, float]:
    """Mean CPU and wall milliseconds per call. CPU = this process's user+system time
    (``time.process_time``), plus its children's when ``children`` (``nvidia-smi``)."""
    fn()  # warm: handles, caches, page faults
    who = resource.RUSAGE_CHILDREN
    c0 = time.process_time()
    k0 = resource.getrusage(who) if children else None
    w0 = time.perf_counter()
    for _ in range(iterations):
        fn()
    wall = time.perf_counter() - w0
    cpu = time.process_time() - c0
    if k0 is not None:
        k1 = resource.getrusage(who)
        cpu += (k1.ru_utime - k0.ru_utime) + (k1.ru_stime - k0.ru_stime)
    return cpu / iterations * 1e3, wall / iterations * 1e3


def timed(
    what: str,
    fn: Callable[[], object],
    iterations: int,
    *,
    gpus: int,
    procs_per_gpu: int,
    note: str = "",
    children: bool = False,
) -> Row:
    """One table row: ``fn`` measured over ``iterations`` calls (``measure``)."""
    cpu, wall = measure(fn, iterations, children=children)
    return Row(
        what=what,
        gpus=gpus,
        procs_per_gpu=procs_per_gpu,
        iterations=iterations,
        cpu_ms=cpu,
        wall_ms=wall,
        note=note,
    )


def iterations_for(total_procs: int, base: int) -> int:
    return max(20, min(base, 200_000 // max(total_procs, 1)))


# ---------------------------------------------------------------------------------------------
# stub mode


def scenario_of(gpus: int, procs: int) -> dict[str, Any]:
    return stub_scenario(
        [
            stub_device(
                uuid=stub_uuid(g),
                processes=[(100_000 + g * 10_000 + p, (512 + p) * 2**20) for p in range(procs)],
            )
            for g in range(gpus)
        ]
    )


def pynvml_objects_poll() -> int:
    """The same NVML calls as a sample, through pynvml's public per-entry-object wrappers."""
    import pynvml

    n = 0
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        with suppress(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetMigMode(h)
        n += len(pynvml.nvmlDeviceGetComputeRunningProcesses(h))
        n += len(pynvml.nvmlDeviceGetGraphicsRunningProcesses(h))
        n += len(pynvml.nvmlDeviceGetMPSComputeRunningProcesses(h))
    return n


def run_stub(args: argparse.Namespace) -> list[Row]:
    subprocess.run(["make", "-s", "-C", str(STUB_DIR)], check=True)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="gpuguard-bench-") as tmp:
        scenario = Path(tmp) / "scenario.json"
        scenario.write_text("{}", encoding="utf-8")
        os.environ["NVML_STUB_SCENARIO"] = str(scenario)
        source = NvmlGpuSource(library_path=STUB_LIB, deadline_seconds=None)
        source.acquire()
        try:
            for gpus in args.gpus:
                for procs in args.procs:
                    write_atomic(scenario, json.dumps(scenario_of(gpus, procs)))
                    sample = source.sample()
                    assert len(sample.processes) == gpus * procs, len(sample.processes)
                    n = iterations_for(gpus * procs, args.iterations)
                    for what, fn in (
                        ("gpuguard sample()", source.sample),
                        ("pynvml wrappers (objects)", pynvml_objects_poll),
                    ):
                        rows.append(timed(what, fn, n, gpus=gpus, procs_per_gpu=procs))
        finally:
            source.close()
    return rows


# ---------------------------------------------------------------------------------------------
# gpu mode

_CUDA_HOLDER = r"""
import ctypes, sys, time
cuda = ctypes.CDLL("libcuda.so.1")
def ok(ret, what):
    if ret != 0:
        sys.stderr.write(f"{what} failed: CUresult {ret}\n"); sys.exit(2)
ordinal, mib = int(sys.argv[1]), int(sys.argv[2])
ok(cuda.cuInit(0), "cuInit")
dev = ctypes.c_int()
ok(cuda.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
ctx = ctypes.c_void_p()
ok(cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate_v2")
ptr = ctypes.c_uint64()
ok(cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(mib << 20)), "cuMemAlloc_v2")
sys.stdout.write("ready\n"); sys.stdout.flush()
time.sleep(3600)
"""


@contextmanager
def cuda_holders(count: int, gpus: int, mib: int) -> Iterator[list[int]]:
    """``count`` processes holding a CUDA context and ``mib`` MiB each, round-robin over GPUs.
    Always killed (by PID, ours only) on exit."""
    procs: list[subprocess.Popen[str]] = []
    try:
        for i in range(count):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _CUDA_HOLDER, str(i % max(gpus, 1)), str(mib)],
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"CUDA holder {p.pid} did not start (exit {p.poll()})")
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def run_gpu(args: argparse.Namespace) -> list[Row]:
    import pynvml

    t0 = time.perf_counter()
    pynvml.nvmlInit()
    init_ms = (time.perf_counter() - t0) * 1e3
    gpus = pynvml.nvmlDeviceGetCount()
    rows = [
        Row(
            what="nvmlInit",
            gpus=gpus,
            procs_per_gpu=None,
            iterations=1,
            cpu_ms=float("nan"),
            wall_ms=init_ms,
        )
    ]
    smi = shutil.which("nvidia-smi")
    with cuda_holders(args.cuda_procs, gpus, args.cuda_mib) as pids:
        source = NvmlGpuSource(deadline_seconds=None)
        source.acquire()
        try:
            sample = source.sample()
            seen = len(sample.processes)
            ours = {p.pid for p in sample.processes} & set(pids)
            note = f"{seen} processes listed, {len(ours)}/{len(pids)} holders seen"
            known = [p.used_bytes for p in sample.processes if p.pid in ours]
            values = [u for u in known if u is not None]
            if values:
                note += f", holder used {min(values) >> 20}-{max(values) >> 20} MiB"
            if len(values) != len(known):
                note += f", {len(known) - len(values)} N/A"
            per_gpu = round(seen / max(gpus, 1))
            n = args.iterations
            row = partial(timed, gpus=gpus, procs_per_gpu=per_gpu)
            rows.append(row("bare NVML calls (pynvml)", pynvml_objects_poll, n))
            rows.append(row("gpuguard sample()", source.sample, n, note=note))
            if smi is not None:
                argv = [smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader"]
                rows.append(
                    row(
                        "nvidia-smi --query-compute-apps",
                        lambda: subprocess.run(argv, capture_output=True, check=True),
                        args.smi_iterations,
                        note="CPU includes the child",
                        children=True,
                    )
                )
            if args.breakdown:
                rows.extend(breakdown(gpus, per_gpu, n))
            timings = source.last_timings
            if timings is not None:
                rows.append(
                    Row(
                        what="slowest NVML call in last sample",
                        gpus=gpus,
                        procs_per_gpu=per_gpu,
                        iterations=1,
                        cpu_ms=float("nan"),
                        wall_ms=timings.slowest_call_seconds * 1e3,
                        note=f"{timings.slowest_call}, {timings.calls} calls per sample",
                    )
                )
        finally:
            source.close()
    pynvml.nvmlShutdown()
    return rows


def breakdown(gpus: int, per_gpu: int, iterations: int) -> list[Row]:
    """Each C call of a poll on GPU 0 alone, through ctypes on pynvml's loaded library."""
    import ctypes

    import pynvml

    lib = pynvml.nvmlLib
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    rows: list[Row] = []

    def count_only(symbol: str) -> Callable[[], object]:
        fn = getattr(lib, symbol)

        def call() -> object:
            c = ctypes.c_uint(0)
            return fn(h, ctypes.byref(c), None)

        return call

    def fetch(symbol: str) -> Callable[[], object]:
        fn = getattr(lib, symbol)
        buf = ctypes.create_string_buffer(24 * 4096)

        def call() -> object:
            c = ctypes.c_uint(4096)
            return fn(h, ctypes.byref(c), buf)

        return call

    calls: list[tuple[str, Callable[[], object]]] = [
        ("nvmlDeviceGetCount_v2", pynvml.nvmlDeviceGetCount),
        ("nvmlDeviceGetMemoryInfo", lambda: pynvml.nvmlDeviceGetMemoryInfo(h)),
        ("nvmlDeviceGetMigMode", lambda: pynvml.nvmlDeviceGetMigMode(h)),
    ]
    for kind in ("Compute", "Graphics", "MPSCompute"):
        symbol = f"nvmlDeviceGet{kind}RunningProcesses_v3"
        calls.append((f"{symbol} (count only)", count_only(symbol)))
        calls.append((f"{symbol} (fetch)", fetch(symbol)))
    for name, fn in calls:
        rows.append(timed(f"C call: {name}", fn, iterations, gpus=1, procs_per_gpu=per_gpu))
    return rows


# ---------------------------------------------------------------------------------------------
# output


def table(rows: list[Row]) -> str:
    lines = [
        "| what | GPUs | procs/GPU | iterations | CPU ms/poll | wall ms/poll | note |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        cpu = "-" if r.cpu_ms != r.cpu_ms else f"{r.cpu_ms:.3f}"
        procs = "-" if r.procs_per_gpu is None else str(r.procs_per_gpu)
        lines.append(
            f"| {r.what} | {r.gpus} | {procs} | {r.iterations} | {cpu} | "
            f"{r.wall_ms:.3f} | {r.note} |"
        )
    return "\n".join(lines)


def verdict(rows: list[Row]) -> str:
    for r in rows:
        if r.what == "gpuguard sample()" and r.gpus == 8 and r.procs_per_gpu == 100:
            ok = r.cpu_ms < TARGET_CPU_MS
            return (
                f"8 GPUs × 100 processes: {r.cpu_ms:.2f} ms CPU per poll "
                f"({'meets' if ok else 'MISSES'} the < {TARGET_CPU_MS:g} ms target)"
            )
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("stub", "gpu"), default="stub")
    parser.add_argument("--gpus", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    parser.add_argument(
        "--procs", type=lambda s: [int(x) for x in s.split(",")], default=[1, 10, 100, 1000]
    )
    parser.add_argument("--iterations", type=int, default=500)
    parser.add_argument("--smi-iterations", type=int, default=20)
    parser.add_argument("--cuda-procs", type=int, default=0)
    parser.add_argument("--cuda-mib", type=int, default=64)
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="gpu mode: also time each C call of a poll on GPU 0",
    )
    parser.add_argument("--record", type=Path, help="append the result to this markdown file")
    args = parser.parse_args(argv)

    rows = run_stub(args) if args.mode == "stub" else run_gpu(args)
    info = machine()
    print("\n".join(f"# {k}: {v}" for k, v in info.items()), flush=True)  # the header
    body = table(rows)
    summary = verdict(rows)
    print(body)
    if summary:
        print("\n" + summary)
    if args.record is not None:
        title = "stand-in library" if args.mode == "stub" else "real GPU"
        text = f"{body}\n\n{summary}." if summary else body
        append_record(args.record, f"Poll cost, {title} ({info['date']})", info, text)
        print(f"\nrecorded in {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
