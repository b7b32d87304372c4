"""Where an idle enforcer's CPU goes: one NVML listing and one fast read (CPU per call), then a
real ``gpuguard enforce`` with nothing on the GPU (a pods file with no pods), per thread: CPU
ms/s and wake-ups/s over ``--seconds`` (``/proc/<pid>/task/<tid>/schedstat``), with the native
quiet gate and without it (``nvml.native_gate``).

Owns measurement only: it starts one enforcer at a time in a scratch directory of its own and
stops it (SIGTERM) by PID. Must not touch a GPU setting. Run as root (the enforcer's self-checks
want it; nothing is signalled: no pod). On a GPU node (real NVML)::

    PYTHONPATH=/tmp/site python3 -m benchmarks.idle_cost

On any Linux box, over the NVML stand-in (``make -C tests/nvml_stub``)::

    NVML_STUB_SCENARIO=tests/nvml_stub/scenarios/h200x1.json .venv/bin/python \\
        -m benchmarks.idle_cost --library-path tests/nvml_stub/build/libnvidia-ml.so.1

Read with ``benchmarks/reaction.py``'s floor rows: a thread woken 20 times a second costs the
machine's wake-up floor before it does anything.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpuguard.adapters.nvml import NvmlGpuSource
from rigs.provenance import header_lines


def per_call(library_path: Path | None, calls: int) -> None:
    """CPU and wall µs per full listing (``sample``) and per fast read (``read_memory``)."""
    source = NvmlGpuSource(library_path=library_path)
    source.acquire()
    source.sample()
    for name, fn in (("sample (full listing)", source.sample), ("read_memory", source.read_memory)):
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(calls):
            fn()
        cpu_us = (time.process_time() - cpu) / calls * 1e6
        wall_us = (time.perf_counter() - wall) / calls * 1e6
        print(f"{name}: {cpu_us:.0f} us CPU, {wall_us:.0f} us wall per call")
    source.close()


def _threads(pid: int) -> dict[int, tuple[int, int]]:
    """Per thread: CPU nanoseconds and timeslices so far."""
    got = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "schedstat").read_text().split()
        got[int(task.name)] = (int(fields[0]), int(fields[2]))
    return got


def idle_enforcer(work: Path, library_path: Path | None, *, gate: bool, seconds: float) -> None:
    """Start an idle enforcer, wait for its first cycles, print its threads over ``seconds``."""
    nvml = f'library_path = "{library_path}"\n' if library_path else ""
    config = work / f"gate-{gate}.toml"
    config.write_text(
        f'version = 1\n[enforcement]\nmode = "enforce"\nlock_file = "{work / "lock"}"\n'
        f'[nvml]\n{nvml}native_gate = {str(gate).lower()}\n[logging]\nformat = "json"\n'
    )
    pods = work / "pods.json"
    pods.write_text('{"apiVersion": "v1", "kind": "List", "items": []}')
    log = work / f"gate-{gate}.log"
    argv = [sys.executable, "-m", "gpuguard.cli", "enforce", "--config", str(config)]
    argv += ["--node-name", "idle", "--pods-file", str(pods), "--metrics-address", "127.0.0.1:0"]
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        time.sleep(6)
        before = _threads(proc.pid)
        time.sleep(seconds)
        after = _threads(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    print(f"native_gate={str(gate).lower()}")
    total = 0
    for tid, (cpu, slices) in sorted(after.items()):
        cpu0, slices0 = before.get(tid, (0, 0))
        total += cpu - cpu0
        ms, woken = (cpu - cpu0) / seconds / 1e6, (slices - slices0) / seconds
        print(f"  tid {tid} {ms:.3f} ms/s  wakeups/s {woken:.1f}")  # the main thread: the pid
    print(f"  total {total / seconds / 1e6:.3f} ms/s")
    started = next((ln for ln in log.read_text().splitlines() if '"fast_reads"' in ln), "")
    print(started[started.find('"fast_reads"') :].split(",")[0] if started else "no start line")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--library-path", type=Path, help="libnvidia-ml.so.1 (the stand-in)")
    parser.add_argument("--seconds", type=float, default=20.0, help="per enforcer (default 20)")
    parser.add_argument("--calls", type=int, default=200, help="per-call means (default 200)")
    args = parser.parse_args()
    print("\n".join(header_lines()), flush=True)
    per_call(args.library_path, args.calls)
    with tempfile.TemporaryDirectory(prefix="gpuguard-idle-") as scratch:
        for gate in (True, False):
            idle_enforcer(Path(scratch), args.library_path, gate=gate, seconds=args.seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
