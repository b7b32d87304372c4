"""How fast the eBPF allocation guard stops a caller and how exactly its thawer resumes it at
the bound (gpuguard/adapters/allocguard/), on this machine's kernel with the libcuda stand-in.

``sudo .venv/bin/python -m benchmarks.allocguard_thaw [--trials N]`` prints, after the
provenance header, one JSON document: per trial, from the caller's clock read just before its
crossing call (``CLOCK_BOOTTIME``, the clock the BPF program stamps stops with), the stop's
time as recorded in the ``frozen`` map, the first ``/proc`` read that showed it stopped and
the first that showed it running again; the thawer's own account of each resume; its CPU while
idle; how long a dead thawer takes to be started again by the next guard call; and how long
the guard's close takes (the probes' detach, which the loading process's exit also waits on).
State reads are 0.5 ms apart, so the observed times are late by up to that much.

Must not: signal anything but its own processes (the callers in its cgroup tree, and the
guard's thawer, its grandchild, to measure a restart); needs root, BTF and uprobes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from gpuguard.adapters.allocguard import FREEZE_BOUND_SECONDS, AllocGuard, cgroup_id
from rigs.alloc_caller import AllocCaller, wait_state
from rigs.allocguard import build
from rigs.cgroups import CgroupTree, cgroup_dir
from rigs.processes import cpu_seconds, pidfd_kill
from rigs.provenance import header, header_lines

MiB = 1024 * 1024


def _boot_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME)


def _wait_boot_ns(predicate: Any) -> int:
    assert wait_state(predicate, 5.0) is not None, "timed out"
    return _boot_ns()


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "min": round(ordered[0], 3),
        "median": round(statistics.median(ordered), 3),
        "p95": round(ordered[max(0, round(0.95 * len(ordered)) - 1)], 3),
        "max": round(ordered[-1], 3),
    }


def trials(guard: AllocGuard, caller: AllocCaller, library: Path, n: int) -> dict[str, Any]:
    loader: Any = importlib.import_module("gpuguard.adapters.allocguard._loader")
    to_probe, to_stopped, length = [], [], []
    for _ in range(n):
        calling_ns = caller.alloc(library, 2 * MiB)
        stopped_seen_ns = _wait_boot_ns(caller.stopped)
        entries = [e for e in loader.frozen_entries(guard.frozen_fd) if e[0] == caller.pid]
        assert len(entries) == 1, entries
        stopped_ns = entries[0][2]
        resumed_seen_ns = _wait_boot_ns(lambda: not caller.stopped())
        assert caller.line() == "returned 0"
        to_probe.append((stopped_ns - calling_ns) / 1e6)
        to_stopped.append((stopped_seen_ns - stopped_ns) / 1e6)
        length.append((resumed_seen_ns - stopped_ns) / 1e6)
    return {
        "call_to_probe_ms": _summary(to_probe),
        "probe_to_stopped_seen_ms": _summary(to_stopped),
        "stop_to_running_seen_ms": _summary(length),
        "over_bound": sum(1 for x in length if x > FREEZE_BOUND_SECONDS * 1000),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    args = parser.parse_args()
    built = build()
    result: dict[str, Any] = {"bound_ms": FREEZE_BOUND_SECONDS * 1000, "trials": args.trials}
    with tempfile.TemporaryDirectory() as tmp, CgroupTree() as tree:
        log = Path(tmp) / "thawer.jsonl"
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC)
        started = time.monotonic()
        guard = AllocGuard(
            object_path=built.object_path, library_path=built.stub_library, thawer_stderr=fd
        )
        result["load_and_thawer_start_ms"] = round((time.monotonic() - started) * 1000, 1)
        os.close(fd)
        try:
            cg = tree.make(2, "bench")
            guard.set_headroom(cgroup_id=cgroup_id(cgroup_dir(cg)), device=0, headroom_bytes=MiB)
            caller = AllocCaller(tree, cg)
            try:
                result.update(trials(guard, caller, built.stub_library, args.trials))
            finally:
                caller.close()
            thawer = guard.thawer_pid
            assert thawer is not None
            before = cpu_seconds(thawer)
            time.sleep(args.idle_seconds)
            after = cpu_seconds(thawer)
            assert before is not None
            assert after is not None
            result["thawer_idle_cpu_ms_per_s"] = round(
                (after - before) * 1000 / args.idle_seconds, 3
            )
            restarts = []
            for _ in range(5):
                dead = guard.thawer_pid
                assert dead is not None
                pidfd_kill(dead)
                time.sleep(0.05)
                started = time.monotonic()
                guard.poll(timeout_ms=0)
                restarts.append((time.monotonic() - started) * 1000)
            result["thawer_restart_ms"] = _summary(restarts)
        finally:
            started = time.monotonic()
            guard.close()
            result["close_ms"] = round((time.monotonic() - started) * 1000, 1)
        resumed = [
            e["age_ms"]
            for e in (json.loads(line) for line in log.read_text().splitlines())
            if e.get("event") == "freeze_ended" and e.get("why") == "bound"
        ]
        result["thawer_sigcont_at_ms"] = _summary(resumed)
    print("\n".join(header_lines()))
    print(json.dumps({"provenance": header(), "result": result}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
