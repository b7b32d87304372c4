"""How fast, how safely and at what CPU cost a watcher stops a pod that overflows a nearly full
GPU: gpuguard side by side with what users run instead, in one run on the same workload.

Owns measurement only: it builds its own cgroups (one unique root, ``/gpuguard-reaction-<pid>``
of the cgroup v2 tree), its own pods file, workload registry and processes, and removes or kills
all of them when it ends, also on failure or Ctrl-C. Must not: signal any process it did not
start, touch a cgroup outside its root, or change a GPU setting. Run as root.

Watchers (each runs alone during its trials, in a subprocess, so its CPU is its /proc time):

1. ``gpuguard change-driven + pressure``: ``gpuguard enforce`` with ``fast_interval_seconds =
   0.05``, ``fast_step_bytes = "64Mi"``, ``pressure_free_fraction = 0.05`` and the defaults'
   ``poll_interval_seconds = 1`` (``--fast-poll``).
2. ``gpuguard today``: sampling as before the fast path, ``fast_interval_seconds = 0`` (a full
   listing every ``poll_interval_seconds`` = 0.25, ``--poll``) and ``pressure_free_fraction =
   0`` (no pressure path).
   Both: ``--grace`` (default 2 s) and ``--termination-timeout`` (default 2 s).
3. ``nvidia-smi loop``: every second ``nvidia-smi --query-compute-apps=pid,used_memory
   --format=csv,noheader,nounits``; each PID mapped to its pod through the benchmark's registry;
   the PIDs of a pod over its limit get SIGTERM at once (no grace): the kill loop users write.
4. ``NVML 5 s poll``: the same rule over ``nvmlDeviceGetComputeRunningProcesses`` every 5 s
   (MetaGPU's enforcer interval).

Workload of every trial: a ``filler`` pod (limit far above its use) holds a large allocation so
the device is ``--free-before`` (10 %) free; a ``greedy`` pod (limit ``--limit-gib``, 2 GiB)
takes, in one allocation, enough to leave ``--free-after`` (2.5 %) free: past its limit and
into pressure (free < 5 %). A host process (not in kubepods) holds 1 GiB. Filler and host
process must never be signalled: every signal to anything but a greedy process, from the
workers' own records or a watcher's log, is a wrong kill. Each trial waits a random time within
the watcher's look interval before the crossing, so the crossing falls at a random phase of the
watcher's loop.

Measured per trial, all CLOCK_MONOTONIC: crossing = the greedy worker's time right after its
allocation completed (stub: right after the scenario rename); SIGTERM = its signal handler's
time; freed = the first ~10 ms NVML listing by the benchmark without its PID; time the device
stayed above 95 % full (the same 10 ms samples, ``nvmlDeviceGetMemoryInfo``). p50/p99 are
nearest-rank (p99 of 20 trials is the maximum).

CPU columns, a separate phase: all four watchers run together with 0 (idle), 4, 16 and 64
long-lived GPU processes in pods with high limits; each watcher's CPU ms per second is its
CPU-time clock (all threads; ``/proc/<pid>/stat`` utime+stime where the clock is not given)
plus its waited-for children's cutime+cstime (the ``nvidia-smi`` children) over
``--cpu-seconds`` of wall time. After each level, the per-look cost: CPU of one ``nvidia-smi
--query-compute-apps`` call (the child's rusage) against one ``nvmlDeviceGetMemoryInfo`` read
(mean of 1000): the fast path's premise that one memory read costs "at least 100× less CPU
per look" than one nvidia-smi call.

Wake-up floor rows of the same table, measured beside the watchers at every level, each
exactly like a watcher (``benchmarks/reaction_floor.py``): ``floor: bare Python loop
(time.sleep(<fast interval>))``, a subprocess running only that loop, the floor gpuguard's idle
CPU target is stated against; ``floor: bare C loop (clock_nanosleep)``, the same loop in C, compiled
at run time with gcc into ``<out>/tmp`` (without gcc, or when the build fails, the row says so
and has no numbers). Neither depends on the GPU processes: their spread across levels is the
noise of the measurement. Both are also in ``results.json`` (``references``).

Modes:

``--mode gpu`` (an NVIDIA node, root, cgroup v2, python ≥ 3.11 with torch, nvidia-ml-py and
gpuguard's dependencies): real NVML and ``nvidia-smi``; workers are PyTorch processes
(``benchmarks/reaction_worker.py``); CPU-phase processes are CUDA context holders (as
``benchmarks/poll_cost.py --cuda-procs``). Pods come from a pods file (``enforce
--pods-file``), as ``scripts/gpu_e2e.py`` does. On the H200 test machine::

    mkdir -p /tmp/w && tar -xJf .whl/site.tar.xz -C /tmp/w
    PYTHONPATH=/tmp/w/site python3 -m benchmarks.reaction --mode gpu --trials 20 \\
        --record docs/performance.md

``--mode stub`` (any Linux box, root, cgroup v2, gcc): the NVML stand-in
(``tests/nvml_stub``, built with make) driven through its scenario file; workers are plain
processes holding a ``/dev/nvidia0`` look-alike; an "allocation" is a scenario rewrite; the
``nvidia-smi`` loop spawns ``reaction_worker.py nvidia-smi`` per look (a Python stand-in, same
CSV; labelled so). Also prints gpuguard's steady CPU at ``--stub-gpus`` × ``--stub-procs``
(8 × 100) with the stand-in's own cost apart, all measured over the same seconds: the row
``stand-in alone (the NVML calls gpuguard makes, no gpuguard)``, a subprocess that loads the
stand-in through pynvml and makes the calls gpuguard change-driven makes in steady state at
that size and rate (every ``--fast-interval`` ``nvmlDeviceGetCount_v2`` and one
``nvmlDeviceGetMemoryInfo`` per GPU; every ``--fast-poll`` a listing: ``nvmlDeviceGetCount_v2``
and per GPU ``nvmlDeviceGetMigMode`` and the compute, graphics and MPS-client ``_v3`` process
lists); the row ``gpuguard change-driven minus the stand-in alone``; and the floor rows (the
stand-in alone's own Python loop at the fast interval is in its number, so the difference is
what gpuguard adds beyond the library calls and one wake-up loop)::

    sudo .venv/bin/python -m benchmarks.reaction --mode stub --trials 20

Targets, printed as verdict lines (``meets`` / ``MISSES``): under pressure, crossing →
SIGTERM p99 ≤ 2 × fast interval + 50 ms and ≥ 10× faster than today with the same grace; ≥ 5×
faster than the nvidia-smi loop; one fast read ≥ 100× cheaper than one nvidia-smi call. CPU of
gpuguard change-driven: idle ≤ 2× the bare Python loop's CPU measured in this run;
16 GPU processes ≤ 5 ms/s (judged in gpu mode; printed for information in stub mode); stand-in
8 GPUs × 100 processes steady ≤ 20 ms/s (stub mode; judged on gpuguard's whole CPU, the
stand-in alone and gpuguard minus the stand-in printed beside it). Exit status 0 when every
trial of every watcher ended freed and no wrong kill happened (the CPU verdicts do not change
it).

Every workload process (greedy, filler, host process, CPU-phase holders, the farms and their
children) runs in a session of its own, as do the watchers and the reference rows: a signal
to the benchmark's process group (``timeout``, Ctrl-C) reaches only the benchmark, which then
kills all of them by PID, removes its cgroups and prints what was measured so far.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import os
import random
import resource
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.reaction_floor import Reference, c_floor, python_floor, stand_in_alone
from rigs import measure
from rigs.e2e_node import NODE, Cgroups, PodSpec, pod_cgroup_rel, spawn_in, v2_mount
from rigs.measure import append_record
from rigs.measure import machine as harness_machine
from rigs.nvml_stub import STUB_DIR, STUB_LIB, stub_device, stub_scenario, stub_uuid
from rigs.processes import (
    Gpuguard,
    Logged,
    free_port,
    gpu_device_node,
    gpuguard_argv,
    gpuguard_env,
    pidfd_kill,
    read_jsonl,
    start_ticks,
    write_atomic,
)
from rigs.processes import alive as pid_alive

ROOT = Path(__file__).resolve().parents[1]

WORKER = ROOT / "benchmarks" / "reaction_worker.py"
GIB = 1 << 30
MIB = 1 << 20
H200_TOTAL_BYTES = 150754820096
"""The stand-in device's size: what NVML reports for an H200 (143771 MiB)."""
HIGH_LIMIT_BYTES = 1 << 40
"""Filler's and the CPU phase's pods: a limit no device reaches."""
WATCH_PERIOD = 0.010
PRESSURE_FRACTION = 0.05
NEW_KEYS = ("fast_interval_seconds", "fast_step_bytes", "pressure_free_fraction")


# ---------------------------------------------------------------------------------------------
# small helpers


def gpuguard_knows(keys: Iterable[str]) -> bool:
    """Whether this checkout's ``[enforcement]`` accepts ``keys`` (unknown keys are errors)."""
    from gpuguard.config import EnforcementSettings

    names = {f.name for f in dataclasses.fields(EnforcementSettings)}
    return all(k in names for k in keys)


# ---------------------------------------------------------------------------------------------
# the node: real NVML + CUDA, or the stand-in


@dataclass(slots=True, kw_only=True)
class Proc:
    """A process the benchmark started (directly, or forked by a farm it started)."""

    pid: int
    pod: str | None
    popen: subprocess.Popen[str] | None = None
    used_bytes: int = 0
    start: int = 0
    """Its start time (``/proc/<pid>/stat`` field 22), for the registry's identity check."""

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return pid_alive(self.pid)


class Node:
    """What differs between a real GPU and the stand-in: processes, allocations, NVML."""

    label = ""
    total_bytes = 0

    def __init__(self, out: Path, records: Path) -> None:
        import pynvml

        self.nvml = pynvml
        self.out = out
        self.records = records
        self.handle: Any = None
        self.spawned: list[Proc] = []
        """Every process this node started, for the final kill."""
        self.staging_dir: Path | None = None
        """A non-kubepods cgroup where the next greedy worker is prepared (gpu mode)."""

    def listing(self) -> dict[int, int]:
        """PID → used bytes on the watched GPU (compute processes; unknown usage as 0)."""
        procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        return {p.pid: p.usedGpuMemory if isinstance(p.usedGpuMemory, int) else 0 for p in procs}

    def free_bytes(self) -> int:
        return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).free)

    def memory_read_cpu_ms(self, n: int = 1000) -> float:
        h, get = self.handle, self.nvml.nvmlDeviceGetMemoryInfo
        get(h)
        c0 = time.process_time()
        for _ in range(n):
            get(h)
        return (time.process_time() - c0) / n * 1e3

    def smi_argv(self) -> list[str]:
        raise NotImplementedError

    def smi_cpu_ms(self, n: int) -> float:
        """CPU of one ``nvidia-smi --query-compute-apps`` look, the child's rusage, mean of n."""
        from benchmarks.reaction_worker import SMI_QUERY

        argv = [*self.smi_argv(), *SMI_QUERY]
        env = self.env()
        who = resource.RUSAGE_CHILDREN
        subprocess.run(argv, capture_output=True, check=True, env=env)
        k0 = resource.getrusage(who)
        for _ in range(n):
            subprocess.run(argv, capture_output=True, check=True, env=env)
        k1 = resource.getrusage(who)
        return ((k1.ru_utime - k0.ru_utime) + (k1.ru_stime - k0.ru_stime)) / n * 1e3

    def env(self) -> dict[str, str]:
        return gpuguard_env()

    def config_extra(self) -> str:
        return ""

    def spawn_worker(self, cgroup_dir: Path, *, role: str, label: str, pod: str | None) -> Proc:
        raise NotImplementedError

    def allocate(self, proc: Proc, size: int) -> float:
        """``proc`` takes ``size`` more bytes at once; returns CLOCK_MONOTONIC once done."""
        raise NotImplementedError

    def exited(self, proc: Proc) -> None:
        """``proc`` is gone (reaped): the stand-in's "driver" frees its memory."""

    def spawn_holders(self, targets: Sequence[tuple[Path, str]]) -> list[Proc]:
        """One long-lived GPU process per (cgroup dir, pod), holding little."""
        raise NotImplementedError

    def facts(self) -> dict[str, str]:
        return {}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.nvml.nvmlShutdown()


class GpuNode(Node):
    label = "real GPU"

    def __init__(self, out: Path, records: Path, *, gpu: int, holder_mib: int) -> None:
        super().__init__(out, records)
        self.gpu = gpu
        self.holder_mib = holder_mib
        self.nvml.nvmlInit()
        self.handle = self.nvml.nvmlDeviceGetHandleByIndex(gpu)
        self.total_bytes = int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).total)
        import shutil

        smi = shutil.which("nvidia-smi")
        if smi is None:
            raise SystemExit("gpu mode needs nvidia-smi on PATH")
        self.smi = smi

    def smi_argv(self) -> list[str]:
        return [self.smi]

    def env(self) -> dict[str, str]:
        return super().env() | {
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": str(self.gpu),
        }

    def _argv(self, role: str, label: str) -> list[str]:
        return [sys.executable, str(WORKER), "worker", "--backend", "cuda", "--role", role,
                "--label", label, "--record", str(self.records)]  # fmt: skip

    def spawn_worker(self, cgroup_dir: Path, *, role: str, label: str, pod: str | None) -> Proc:
        staged, self.staged = self.staged, None
        if role == "greedy" and staged is not None and staged.popen is not None:
            p = staged.popen
            _expect(p, "imported", "staged worker", timeout=180)
            (cgroup_dir / "cgroup.procs").write_text(str(p.pid))
            assert p.stdin is not None
            p.stdin.write(f"init {label}\n")
            p.stdin.flush()
        else:
            p = spawn_in(
                cgroup_dir,
                self._argv(role, label),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=self.env(),
            )
            self.spawned.append(Proc(pid=p.pid, pod=None, popen=p))
        proc = Proc(pid=p.pid, pod=pod, popen=p)
        _expect(p, "ready", f"{label} worker", timeout=180)
        if role == "greedy" and self.staging_dir is not None:
            # The next trial's worker imports torch (seconds) while this trial runs; it stays
            # outside kubepods and off the GPU until it is moved and told to start CUDA.
            argv = [*self._argv(role, "staged"), "--stage"]
            q = spawn_in(
                self.staging_dir, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                env=self.env(),
            )  # fmt: skip
            self.staged = Proc(pid=q.pid, pod=None, popen=q)
            self.spawned.append(self.staged)
        return proc

    staged: Proc | None = None

    def allocate(self, proc: Proc, size: int) -> float:
        p = proc.popen
        assert p is not None
        assert p.stdin is not None
        p.stdin.write(f"go {size}\n")
        p.stdin.flush()
        line = _expect(p, "allocated", f"worker {proc.pid} allocation", timeout=60)
        proc.used_bytes += size
        return float(line.split()[1])

    def spawn_holders(self, targets: Sequence[tuple[Path, str]]) -> list[Proc]:
        from benchmarks.poll_cost import _CUDA_HOLDER

        started = []
        for d, pod in targets:
            argv = [sys.executable, "-c", _CUDA_HOLDER, "0", str(self.holder_mib)]
            p = spawn_in(d, argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=self.env())
            started.append(Proc(pid=p.pid, pod=pod, popen=p))
            self.spawned.append(started[-1])
        for proc in started:
            assert proc.popen is not None
            _expect(proc.popen, "ready", f"CUDA holder {proc.pid}", timeout=180)
        return started

    def facts(self) -> dict[str, str]:
        n = self.nvml
        name = n.nvmlDeviceGetName(self.handle)
        return {
            "gpu": f"{name} ({self.total_bytes // MIB} MiB), NVML index {self.gpu}",
            "driver": str(n.nvmlSystemGetDriverVersion()),
        }


def _expect(p: subprocess.Popen[str], word: str, what: str, *, timeout: float) -> str:
    """The first stdout line of ``p`` starting with ``word`` (other lines skipped)."""
    assert p.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"{what} exited ({p.poll()}) before '{word}'")
        if line.startswith(word):
            return line
    raise TimeoutError(f"{what}: no '{word}' after {timeout}s")


class StubNode(Node):
    """The NVML stand-in over a scenario this object writes: device 0 lists the live processes
    it was told about; ``devices`` more empty-or-farmed devices for the extra phase."""

    label = "stand-in library"
    total_bytes = H200_TOTAL_BYTES
    CONTEXT_BYTES = 512 * MIB
    """What a stand-in process "uses" before any allocation, as a CUDA context would."""

    def __init__(self, out: Path, records: Path) -> None:
        self.farms: list[subprocess.Popen[str]] = []
        done = subprocess.run(
            ["make", "-s", "-C", str(STUB_DIR)], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise SystemExit(f"building the NVML stand-in failed:\n{done.stdout}{done.stderr}")
        self.scenario = out / "scenario.json"
        self.placed: dict[int, tuple[int, int]] = {}  # pid -> (device, used bytes)
        self.devices = 1
        self.write()
        os.environ["NVML_STUB_SCENARIO"] = str(self.scenario)
        # Loaded by path first: pynvml's CDLL("libnvidia-ml.so.1") then finds it by SONAME.
        ctypes.CDLL(str(STUB_LIB), mode=ctypes.RTLD_GLOBAL)
        super().__init__(out, records)
        self.nvml.nvmlInit()
        self.handle = self.nvml.nvmlDeviceGetHandleByIndex(0)
        self.device_node = gpu_device_node(out / "nvidia0")

    def write(self) -> None:
        doc = stub_scenario(
            [
                stub_device(
                    uuid=stub_uuid(g),
                    total_bytes=self.total_bytes,
                    processes=[
                        (pid, used) for pid, (d, used) in sorted(self.placed.items()) if d == g
                    ],
                )
                for g in range(self.devices)
            ]
        )
        write_atomic(self.scenario, json.dumps(doc))

    def place(self, procs: Iterable[Proc], device: int = 0) -> None:
        for p in procs:
            self.placed[p.pid] = (device, p.used_bytes)
        self.write()

    def smi_argv(self) -> list[str]:
        return [sys.executable, str(WORKER), "nvidia-smi"]

    def env(self) -> dict[str, str]:
        return super().env() | {
            "NVML_STUB_SCENARIO": str(self.scenario),
            "LD_LIBRARY_PATH": str(STUB_LIB.parent),
        }

    def config_extra(self) -> str:
        return f'[nvml]\nlibrary_path = "{STUB_LIB}"\n'

    def spawn_worker(self, cgroup_dir: Path, *, role: str, label: str, pod: str | None) -> Proc:
        argv = [sys.executable, str(WORKER), "worker", "--backend", "stub", "--role", role,
                "--label", label, "--record", str(self.records),
                "--device-node", str(self.device_node)]  # fmt: skip
        p = spawn_in(
            cgroup_dir, argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=self.env()
        )
        proc = Proc(pid=p.pid, pod=pod, popen=p, used_bytes=self.CONTEXT_BYTES)
        self.spawned.append(proc)
        _expect(p, "ready", f"{label} worker", timeout=30)
        self.place([proc])
        return proc

    def allocate(self, proc: Proc, size: int) -> float:
        proc.used_bytes += size
        self.place([proc])
        return time.monotonic()

    def exited(self, proc: Proc) -> None:
        if self.placed.pop(proc.pid, None) is not None:
            self.write()

    def spawn_holders(self, targets: Sequence[tuple[Path, str]]) -> list[Proc]:
        return self.farm(targets, used_bytes=self.CONTEXT_BYTES + 64 * MIB)

    def farm(
        self, targets: Sequence[tuple[Path, str]], *, used_bytes: int, label: str = "farm"
    ) -> list[Proc]:
        """One forked stand-in process per target, each moved into its cgroup (one Python
        start for all of them)."""
        listing = self.out / f"farm-{secrets.token_hex(4)}.txt"
        listing.write_text("".join(f"{d / 'cgroup.procs'}\n" for d, _ in targets))
        argv = [sys.executable, str(WORKER), "farm", "--cgroups", str(listing),
                "--device-node", str(self.device_node), "--record", str(self.records),
                "--label", label]  # fmt: skip
        # A session of its own, as spawn_in gives each worker: its children are the workload.
        p = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
            start_new_session=True,
        )  # fmt: skip
        self.farms.append(p)
        assert p.stdout is not None
        line = p.stdout.readline()
        if not line.startswith("["):
            raise RuntimeError(f"farm exited ({p.poll()}) before listing its children")
        pids = json.loads(line)
        return [
            Proc(pid=pid, pod=pod, used_bytes=used_bytes)
            for pid, (_, pod) in zip(pids, targets, strict=True)
        ]


# ---------------------------------------------------------------------------------------------
# watchers


@dataclass(slots=True, kw_only=True)
class Watcher:
    """One watcher subprocess: started and stopped by the benchmark, its CPU read from /proc."""

    key: str
    label: str
    period_s: float
    """Its look interval: the random phase before each crossing is drawn from [0, period)."""
    settle_s: float
    """Wait after a freed trial before the next: gpuguard must see the pod back under."""
    process: Logged
    """gpuguard (a ``Gpuguard``: started once it answers ``/readyz``) or a baseline loop."""
    note: str = ""

    def start(self) -> None:
        self.launch()
        self.wait_started()

    def launch(self) -> None:
        self.process.launch()

    def wait_started(self) -> None:
        if isinstance(self.process, Gpuguard):
            self.process.wait_ready()
            time.sleep(0.6)  # a few more polls: the first decisions are made
        else:
            time.sleep(0.3)
        self.process.check_running()

    def tail(self) -> str:
        return self.process.tail()

    def cpu_seconds(self) -> float:
        return self.process.cpu_seconds()

    def alive(self) -> bool:
        return self.process.alive()

    def stop(self) -> None:
        self.process.stop()

    def signals(self) -> list[dict[str, Any]]:
        """Every signal this watcher says it sent: ``pod``, ``pids``, ``t`` (when known),
        ``trigger`` (gpuguard, once it logs one)."""
        out = []
        for line in read_jsonl(self.process.log):
            if line.get("event") == "container_signalled":
                out.append(
                    {"pod": line.get("pod"), "pids": list(line.get("pids") or []),
                     "trigger": line.get("trigger"), "signal": line.get("signal")}
                )  # fmt: skip
            elif line.get("event") == "signalled":
                out.append({"pod": line.get("pod"), "pids": [line.get("pid")], "t": line["t"]})
        return out


# ---------------------------------------------------------------------------------------------
# trials


@dataclass(slots=True, kw_only=True)
class Trial:
    watcher: str
    label: str
    pid: int = 0
    t_cross: float | None = None
    t_term: float | None = None
    t_freed: float | None = None
    full_s: float = 0.0
    pressure_seen: bool = False
    problem: str = ""

    @property
    def to_term_s(self) -> float | None:
        if self.t_cross is None or self.t_term is None:
            return None
        return self.t_term - self.t_cross

    @property
    def to_freed_s(self) -> float | None:
        if self.t_cross is None or self.t_freed is None:
            return None
        return self.t_freed - self.t_cross


@dataclass(slots=True, kw_only=True)
class Row:
    watcher: Watcher
    trials: list[Trial] = field(default_factory=list)
    wrong: set[str] = field(default_factory=set)
    triggers: dict[str, int] = field(default_factory=dict)
    cpu_ms_per_s: dict[int, float] = field(default_factory=dict)


class Bench:
    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args = args
        self.out = out
        self.records = out / "records.jsonl"
        self.registry_path = out / "registry.json"
        self.records.unlink(missing_ok=True)  # an --out reused: only this run's records
        self.rng = random.Random(args.seed)
        self.cg = Cgroups(v2_mount(), f"gpuguard-reaction-{os.getpid()}")
        self.node: Node = (
            StubNode(out, self.records)
            if args.mode == "stub"
            else GpuNode(out, self.records, gpu=args.gpu, holder_mib=args.holder_mib)
        )
        self.procs: list[Proc] = []
        self.registry: dict[int, Proc] = {}
        self.watchers: list[Watcher] = []
        self.windows: list[tuple[str, float, float]] = []
        self.per_look: dict[int, tuple[float, float]] = {}
        self.stub_rows: dict[str, float] = {}
        self.references: dict[str, Reference] = {}
        """The floor rows (CPU phase and steady phase) and the stand-in alone (steady phase)."""
        self.new_keys = gpuguard_knows(NEW_KEYS)
        self.limit_bytes = int(args.limit_gib * GIB)
        cpu_pods = max(args.cpu_levels, default=0)
        pods = [PodSpec(name="greedy", limit_bytes=self.limit_bytes)]
        pods.append(PodSpec(name="filler", limit_bytes=HIGH_LIMIT_BYTES))
        pods += [PodSpec(name=f"cpu-{i}", limit_bytes=HIGH_LIMIT_BYTES) for i in range(cpu_pods)]
        if args.mode == "stub":
            pods += [
                PodSpec(name=f"steady-{g}-{k}", limit_bytes=HIGH_LIMIT_BYTES)
                for g in range(args.stub_gpus)
                for k in range(args.stub_pods_per_gpu)
            ]
        self.pods = {p.name: p for p in pods}
        for p in pods:
            p.uid = str(_uuid())
        doc = {"apiVersion": "v1", "kind": "List", "items": [p.manifest() for p in pods]}
        self.pods_file = out / "pods.json"
        self.pods_file.write_text(json.dumps(doc))
        self.write_registry()

    # -- plumbing -------------------------------------------------------------------------------

    def cgroup(self, pod: str) -> Path:
        p = self.pods[pod]
        if p.cgroup_dir == Path():
            p.cgroup_dir, p.cgroup_path = self.cg.make(pod_cgroup_rel(p.uid, p.container_id))
        return p.cgroup_dir

    def write_registry(self) -> None:
        doc = {
            "pods": {n: p.limit_bytes for n, p in self.pods.items()},
            "pids": {
                str(pid): {"pod": proc.pod, "start": proc.start}
                for pid, proc in self.registry.items()
                if proc.pod is not None
            },
        }
        write_atomic(self.registry_path, json.dumps(doc))

    def register(self, procs: Iterable[Proc]) -> None:
        for p in procs:
            p.start = start_ticks(p.pid) or 0
            self.procs.append(p)
            self.registry[p.pid] = p
        self.write_registry()

    def kill(self, procs: Iterable[Proc]) -> None:
        procs = list(procs)
        for p in procs:
            # A reaped child's PID may be reused: only one not yet reaped (ours, or a farm's
            # child, which the living farm never reaps) is signalled.
            if p.popen is None or p.popen.poll() is None:
                pidfd_kill(p.pid)
        for p in procs:
            if p.popen is not None:
                p.popen.wait()
            self.registry.pop(p.pid, None)
            self.node.exited(p)
        self.write_registry()

    def gpuguard_watcher(self, key: str, *, fast: bool) -> Watcher:
        a = self.args
        port = free_port()
        lines = [
            "version = 1",
            "[node]",
            'proc_root = "/proc"',
            'cgroup_root = "/sys/fs/cgroup"',
            "[enforcement]",
            'mode = "enforce"',
            f"poll_interval_seconds = {a.fast_poll if fast else a.poll}",
            f"grace_seconds = {a.grace}",
            f"termination_timeout_seconds = {a.termination_timeout}",
        ]
        note = ""
        if self.new_keys:
            if fast:
                lines += [
                    f"fast_interval_seconds = {a.fast_interval}",
                    f'fast_step_bytes = "{a.fast_step}"',
                    f"pressure_free_fraction = {PRESSURE_FRACTION}",
                ]
            else:
                lines += ["fast_interval_seconds = 0", "pressure_free_fraction = 0"]
        elif fast:
            note = "this gpuguard has no fast_interval/pressure keys: ran as today"
        if gpuguard_knows(["lock_file"]):
            # Each watcher is a node of its own: under one node lock only one would act (R3).
            lines.append(f'lock_file = "{self.out / key}.lock"')
        lines += [
            "[limits]",
            'exempt_namespaces = ["kube-system"]',
            "[logging]",
            'level = "info"',
            'format = "json"',
        ]
        config = self.out / f"{key}.toml"
        config.write_text("\n".join(lines) + "\n" + self.node.config_extra())
        argv = gpuguard_argv("enforce", "--config", str(config), "--node-name", NODE,
                             "--metrics-address", f"127.0.0.1:{port}",
                             "--pods-file", str(self.pods_file))  # fmt: skip
        label = (
            f"gpuguard change-driven + pressure ({a.fast_interval * 1000:g} ms, {a.fast_step}, "
            f"listing ≥ every {a.fast_poll:g} s, free < {PRESSURE_FRACTION:.0%})"
            if fast
            else f"gpuguard today (full listing every {a.poll * 1000:g} ms)"
        )
        period = a.fast_interval if fast else a.poll
        process = Gpuguard(
            name=label, argv=argv, env=self.node.env(), log=self.out / f"{key}.log", port=port
        )
        return Watcher(
            key=key, label=label, period_s=period, settle_s=2 * a.poll + 0.15, process=process,
            note=note,
        )  # fmt: skip

    def make_watchers(self) -> list[Watcher]:
        for key in ("gpuguard-fast", "gpuguard-today", "smi-loop", "nvml-poll"):
            (self.out / f"{key}.log").unlink(missing_ok=True)
        env = self.node.env()
        smi = self.node.smi_argv()
        smi_label = "nvidia-smi loop (1 s)"
        if isinstance(self.node, StubNode):
            smi_label += " (stand-in nvidia-smi)"
        base = [sys.executable, str(WORKER)]
        reg = ["--registry", str(self.registry_path)]
        return [
            self.gpuguard_watcher("gpuguard-fast", fast=True),
            self.gpuguard_watcher("gpuguard-today", fast=False),
            Watcher(
                key="smi-loop", label=smi_label, period_s=1.0, settle_s=0.05,
                process=Logged(
                    name=smi_label, env=env, log=self.out / "smi-loop.log",
                    argv=[*base, "smi-loop", *reg, "--log", str(self.out / "smi-loop.log"),
                          "--", *smi],
                ),
            ),
            Watcher(
                key="nvml-poll", label="NVML 5 s poll", period_s=5.0, settle_s=0.05,
                process=Logged(
                    name="NVML 5 s poll", env=env, log=self.out / "nvml-poll.log",
                    argv=[*base, "nvml-poll", *reg, "--log", str(self.out / "nvml-poll.log")],
                ),
            ),
        ]  # fmt: skip

    # -- the trial phase ------------------------------------------------------------------------

    def side_processes(self) -> tuple[Proc, Proc]:
        """The host process (1 GiB) and the filler (leaves ``--free-before`` free)."""
        node = self.node
        if isinstance(node, GpuNode):
            node.staging_dir, _ = self.cg.make("system.slice/reaction-staging.service")
        host_dir, _ = self.cg.make("system.slice/reaction-host.service")
        host = node.spawn_worker(host_dir, role="hold", label="host", pod=None)
        self.register([host])
        node.allocate(host, GIB)
        filler = node.spawn_worker(self.cgroup("filler"), role="hold", label="filler", pod="filler")
        self.register([filler])
        fill = node.free_bytes() - int(self.args.free_before * node.total_bytes)
        if fill <= 0:
            raise SystemExit(
                f"the GPU has only {node.free_bytes() // MIB} MiB free: nothing to fill"
            )
        node.allocate(filler, fill)
        return host, filler

    def trial(self, w: Watcher, label: str) -> Trial:
        node, a = self.node, self.args
        t = Trial(watcher=w.key, label=label)
        proc = node.spawn_worker(self.cgroup("greedy"), role="greedy", label=label, pod="greedy")
        t.pid = proc.pid
        self.register([proc])
        try:
            time.sleep(self.rng.uniform(0.0, w.period_s))
            size = node.free_bytes() - int(a.free_after * node.total_bytes)
            if size <= self.limit_bytes:
                t.problem = f"only {size // MIB} MiB to allocate: not past the limit"
                return t
            t.t_cross = node.allocate(proc, size)
            samples: list[tuple[float, bool]] = []
            deadline = t.t_cross + a.trial_timeout
            while time.monotonic() < deadline:
                now = time.monotonic()
                if proc.popen is not None and proc.popen.poll() is not None:
                    node.exited(proc)
                listed = proc.pid in node.listing()
                full = node.free_bytes() < PRESSURE_FRACTION * node.total_bytes
                samples.append((now, full))
                if not listed:
                    t.t_freed = now
                    break
                time.sleep(max(0.0, WATCH_PERIOD - (time.monotonic() - now)))
            t.pressure_seen = any(full for _, full in samples)
            prev = (t.t_cross, samples[0][1] if samples else False)
            for now, full in samples:
                if prev[1]:
                    t.full_s += now - prev[0]
                prev = (now, full)
        finally:
            if proc.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(timeout=1)
            if proc.alive():
                t.problem = (
                    t.problem or "not freed within --trial-timeout (killed by the benchmark)"
                )
            self.kill([proc])
        for r in read_jsonl(self.records):
            if r.get("kind") == "signal" and r.get("pid") == proc.pid and r.get("signal") == "TERM":
                t.t_term = r["t"]
                break
        if not t.problem:
            if t.t_term is None:
                t.problem = "no SIGTERM received"
            elif not t.pressure_seen:
                t.problem = "the device never went above 95 % full"
        return t

    def run_trials(self, rows: list[Row]) -> None:
        a = self.args
        host, filler = self.side_processes()
        for row in rows:
            w = row.watcher
            for side in (host, filler):
                if not side.alive():
                    row.wrong.add(f"{side.pod or 'host'} pid {side.pid} died before the trials")
            w.start()
            t0 = time.monotonic()
            try:
                for i in range(a.trials):
                    t = self.trial(w, f"{w.key}-{i}")
                    row.trials.append(t)
                    print(
                        f"{w.key:15} {i:>3} pid {t.pid:>7} →TERM {_ms(t.to_term_s):>6} ms "
                        f"→freed {_ms(t.to_freed_s):>6} ms  >95 % full {t.full_s * 1000:6.0f} ms "
                        f"{t.problem}",
                        flush=True,
                    )
                    time.sleep(w.settle_s)
                    if not w.alive():
                        raise RuntimeError(f"{w.label} exited during the trials: {w.tail()}")
            finally:
                w.stop()
                self.windows.append((w.key, t0, time.monotonic()))
            for side in (host, filler):
                if not side.alive():
                    row.wrong.add(f"{side.pod or 'host'} pid {side.pid} died")
        self.kill([host, filler])
        if isinstance(self.node, GpuNode) and self.node.staged is not None:
            self.kill([self.node.staged])  # the next trial's worker, never started on the GPU
            self.node.staged = None

    # -- the CPU phase --------------------------------------------------------------------------

    def floors(self) -> list[Reference]:
        """The wake-up floors at the fast interval, made once (the C loop compiled here)."""
        made = {"floor-python": python_floor, "floor-c": c_floor}
        for key, make in made.items():
            if key not in self.references:
                self.references[key] = make(self.args.fast_interval, self.node.env(), self.out)
        return [self.references[k] for k in made]

    def measure_cpu(self, measured: Sequence[Watcher | Reference]) -> dict[str, float]:
        """CPU ms per wall second of each process over ``--cpu-seconds``, all read at the same
        moments; a reference that never started is left out."""
        live = [m for m in measured if not isinstance(m, Reference) or m.process is not None]
        c0 = {m.key: m.cpu_seconds() for m in live}
        w0 = time.monotonic()
        time.sleep(self.args.cpu_seconds)
        c1 = {m.key: m.cpu_seconds() for m in live}
        wall = time.monotonic() - w0
        return {k: (c1[k] - c0[k]) * 1000 / wall for k in c0}

    def run_cpu(self, rows: list[Row]) -> None:
        a = self.args
        watchers = [r.watcher for r in rows]
        floors = self.floors()
        measured: list[Watcher | Reference] = [*watchers, *floors]
        t0 = time.monotonic()
        holders: list[Proc] = []
        try:
            for m in measured:
                m.launch()
            for w in watchers:
                w.wait_started()
            for level in sorted(set(a.cpu_levels)):
                more = [(self.cgroup(f"cpu-{i}"), f"cpu-{i}") for i in range(len(holders), level)]
                if more:
                    new = self.node.spawn_holders(more)
                    holders += new
                    self.register(new)
                    if isinstance(self.node, StubNode):
                        self.node.place(new)
                time.sleep(max(0.5, 3 * a.poll))  # every watcher has listed the new processes
                got = self.measure_cpu(measured)
                for row in rows:
                    row.cpu_ms_per_s[level] = got[row.watcher.key]
                for f in floors:
                    if f.key in got:
                        f.cpu_ms_per_s[level] = got[f.key]
                looks = a.smi_looks or (3 if isinstance(self.node, StubNode) else 10)
                self.per_look[level] = (
                    self.node.smi_cpu_ms(looks),
                    self.node.memory_read_cpu_ms(),
                )
                print(
                    f"CPU at {level:>3} GPU processes: "
                    + ", ".join(f"{k} {v:.2f} ms/s" for k, v in got.items()),
                    flush=True,
                )
                for m in measured:
                    if not m.alive():
                        raise RuntimeError(f"{m.label} exited in the CPU phase: {m.tail()}")
        finally:
            for m in measured:
                m.stop()
            self.windows.append(("cpu", t0, time.monotonic()))
            for h in holders:
                if not h.alive():
                    for row in rows:
                        row.wrong.add(f"CPU-phase holder {h.pid} ({h.pod}) died")
            self.kill(holders)

    def run_stub_steady(self, rows: list[Row]) -> None:
        """gpuguard's steady CPU on ``--stub-gpus`` × ``--stub-procs`` stand-in processes."""
        a, node = self.args, self.node
        assert isinstance(node, StubNode)
        per_pod = max(1, a.stub_procs // a.stub_pods_per_gpu)
        targets: list[tuple[int, tuple[Path, str]]] = []
        for g in range(a.stub_gpus):
            for i in range(a.stub_procs):
                pod = f"steady-{g}-{min(i // per_pod, a.stub_pods_per_gpu - 1)}"
                targets.append((g, (self.cgroup(pod), pod)))
        procs = node.farm([t for _, t in targets], used_bytes=600 * MIB, label="steady")
        self.register(procs)
        node.devices = a.stub_gpus
        for (g, _), p in zip(targets, procs, strict=True):
            node.placed[p.pid] = (g, p.used_bytes)
        node.write()
        t0 = time.monotonic()
        watchers = [r.watcher for r in rows if r.watcher.key.startswith("gpuguard")]
        alone = stand_in_alone(
            fast_interval=a.fast_interval, poll=a.fast_poll, gpus=a.stub_gpus,
            procs=a.stub_procs, env=node.env(), out=self.out,
        )  # fmt: skip
        self.references[alone.key] = alone
        references = [alone, *self.floors()]
        measured: list[Watcher | Reference] = [*watchers, *references]
        try:
            for m in measured:
                m.launch()
            for w in watchers:
                w.wait_started()
            time.sleep(max(1.0, 4 * a.poll))
            got = self.measure_cpu(measured)
            for w in watchers:
                self.stub_rows[w.label] = got[w.key]
            for ref in references:
                ref.steady_ms_per_s = got.get(ref.key)
            for m in measured:
                if not m.alive():
                    raise RuntimeError(f"{m.label} exited in the steady phase: {m.tail()}")
        finally:
            for m in measured:
                m.stop()
            self.windows.append(("steady", t0, time.monotonic()))
            dead = [p for p in procs if not p.alive()]
            for row in rows:
                row.wrong.update(f"steady-phase process {p.pid} died" for p in dead)
            self.kill(procs)
            node.devices = 1
            node.write()

    # -- accounting -----------------------------------------------------------------------------

    def account(self, rows: list[Row]) -> None:
        greedy = {t.pid for r in rows for t in r.trials}
        hold_signals = [
            r
            for r in read_jsonl(self.records)
            if r.get("kind") == "signal" and r.get("role") == "hold"
        ]
        for row in rows:
            w = row.watcher
            for s in w.signals():
                if s.get("trigger"):
                    row.triggers[s["trigger"]] = row.triggers.get(s["trigger"], 0) + 1
                for pid in s["pids"]:
                    if s["pod"] != "greedy" or pid not in greedy:
                        row.wrong.add(f"{w.key} signalled pid {pid} of pod {s['pod']}")
            shared = ("cpu", "steady") if w.key.startswith("gpuguard") else ("cpu",)
            mine = [(k, t0, t1) for k, t0, t1 in self.windows if k == w.key or k in shared]
            for r in hold_signals:
                for k, t0, t1 in mine:
                    if t0 <= r["t"] <= t1:
                        where = "" if k == w.key else f" during the {k} phase"
                        row.wrong.add(f"{r['label']} pid {r['pid']} got SIG{r['signal']}{where}")

    def close(self) -> list[str]:
        stoppable: list[Watcher | Reference] = [*self.watchers, *self.references.values()]
        for m in stoppable:
            m.stop()
        for p in [*self.procs, *self.node.spawned]:
            if p.popen is not None and p.popen.poll() is None:
                pidfd_kill(p.pid)
                p.popen.wait()
        if isinstance(self.node, StubNode):
            for f in self.node.farms:
                if f.poll() is None:
                    pidfd_kill(f.pid)
                f.wait()
        problems = self.cg.close()  # SIGKILLs every member left (farm children), removes all
        self.node.close()
        return problems


def _uuid() -> str:
    import uuid

    return str(uuid.uuid4())


def pct(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile of ``values`` at ``q`` in 0..1 (p99 of 20 values is the maximum);
    ``None`` for no values."""
    return measure.pct(values, q * 100) if values else None


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


# ---------------------------------------------------------------------------------------------
# output


def table(rows: Sequence[Row], levels: Sequence[int], floors: Sequence[Reference]) -> str:
    cpu_heads = " | ".join("CPU ms/s idle" if n == 0 else f"CPU ms/s {n} procs" for n in levels)
    lines = [
        "| watcher | trials | SIGTERM'd | trigger | crossing→SIGTERM p50 / p99 ms "
        "| crossing→freed p50 / p99 ms | >95 % full ms/trial | wrong kills | " + cpu_heads + " |",
        "|---|---:|---:|---|---:|---:|---:|---:|" + "---:|" * len(levels),
    ]
    for r in rows:
        term = [x for t in r.trials if (x := t.to_term_s) is not None]
        freed = [x for t in r.trials if (x := t.to_freed_s) is not None]
        full = [t.full_s for t in r.trials if t.t_cross is not None]
        trig = ", ".join(f"{k} {v}" for k, v in sorted(r.triggers.items())) or "-"
        label = r.watcher.label + (f" [{r.watcher.note}]" if r.watcher.note else "")
        cpu = " | ".join(f"{r.cpu_ms_per_s[n]:.2f}" if n in r.cpu_ms_per_s else "-" for n in levels)
        mean_full = f"{sum(full) / len(full) * 1000:.0f}" if full else "-"
        lines.append(
            f"| {label} | {len(r.trials)} | {len(term)} | {trig} "
            f"| {_ms(pct(term, 0.5))} / {_ms(pct(term, 0.99))} "
            f"| {_ms(pct(freed, 0.5))} / {_ms(pct(freed, 0.99))} | {mean_full} "
            f"| {len(r.wrong)} | {cpu} |"
        )
    for f in floors:
        cpu = " | ".join(f"{f.cpu_ms_per_s[n]:.2f}" if n in f.cpu_ms_per_s else "-" for n in levels)
        lines.append(f"| {f.title} | - | - | - | - | - | - | - | {cpu} |")
    return "\n".join(lines)


def per_look_line(per_look: dict[int, tuple[float, float]], stub: bool) -> str:
    smi = "stand-in nvidia-smi" if stub else "nvidia-smi"
    parts = [
        f"{n} procs: {s:.2f} ms vs {m * 1000:.1f} µs ({s / m:,.0f}×)" if m > 0 else f"{n}: -"
        for n, (s, m) in sorted(per_look.items())
    ]
    return (
        f"CPU per look, one `{smi} --query-compute-apps` call (child rusage) vs one "
        f"`nvmlDeviceGetMemoryInfo` (mean of 1000): " + "; ".join(parts)
    )


STEADY_TARGET_MS_PER_S = 20.0
"""CPU target: gpuguard at stand-in 8 GPUs × 100 processes, steady, on the 2-vCPU VM."""
BUSY_TARGET_MS_PER_S = 5.0
"""CPU target: gpuguard at 16 GPU processes on a real GPU (the H200)."""
IDLE_TARGET_FLOORS = 2.0
"""CPU target: gpuguard idle costs at most this many bare Python loops at the fast interval."""


def verdicts(
    rows: Sequence[Row],
    args: argparse.Namespace,
    per_look: dict[int, tuple[float, float]],
    bench: Bench,
) -> list[str]:
    by = {r.watcher.key: r for r in rows}

    def p(key: str, q: float) -> float | None:
        r = by.get(key)
        if r is None:
            return None
        return pct([x for t in r.trials if (x := t.to_term_s) is not None], q)

    out = []
    fast99, today99, smi50, fast50 = (
        p("gpuguard-fast", 0.99),
        p("gpuguard-today", 0.99),
        p("smi-loop", 0.5),
        p("gpuguard-fast", 0.5),
    )
    if fast99 is not None:
        target = 2 * args.fast_interval + 0.050
        out.append(
            f"pressure: crossing→SIGTERM p99 {fast99 * 1000:.0f} ms "
            f"({'meets' if fast99 <= target else 'MISSES'} ≤ {target * 1000:.0f} ms)"
        )
        if today99:
            ratio = today99 / fast99
            out.append(
                f"vs today (same {args.grace:g} s grace): p99 {ratio:.1f}× faster "
                f"({'meets' if ratio >= 10 else 'MISSES'} ≥ 10×)"
            )
    if fast50 and smi50:
        ratio = smi50 / fast50
        out.append(
            f"vs the nvidia-smi loop: p50 {ratio:.1f}× faster "
            f"({'meets' if ratio >= 5 else 'MISSES'} ≥ 5×)"
        )
    r = by.get("gpuguard-fast")
    if r is not None:
        out += cpu_verdicts(r, args, bench)
        smi = by.get("smi-loop")
        if smi is not None and smi.cpu_ms_per_s:
            levels = sorted(set(r.cpu_ms_per_s) & set(smi.cpu_ms_per_s))
            less = [n for n in levels if r.cpu_ms_per_s[n] < smi.cpu_ms_per_s[n]]
            more = [n for n in levels if n not in less]
            out.append(
                "CPU per second vs the nvidia-smi loop: less at "
                + (", ".join(map(str, less)) or "no level")
                + (f"; MORE at {', '.join(map(str, more))}" if more else "")
                + " GPU processes"
            )
    ratios = [smi_ms / read_ms for smi_ms, read_ms in per_look.values() if read_ms > 0]
    if ratios:
        out.append(
            f"CPU per look, one fast read vs one nvidia-smi call: at least {min(ratios):,.0f}× "
            f"less ({'meets' if min(ratios) >= 100 else 'MISSES'} ≥ 100×)"
        )
    return out


def _meets(ok: bool) -> str:
    return "meets" if ok else "MISSES"


def cpu_verdicts(fast: Row, args: argparse.Namespace, bench: Bench) -> list[str]:
    """The CPU targets for gpuguard change-driven: idle against this run's Python floor,
    16 GPU processes (judged on a real GPU only), stand-in 8 × 100 steady with the stand-in's
    own cost apart."""
    out = []
    refs = bench.references
    idle = fast.cpu_ms_per_s.get(0)
    floor = refs["floor-python"].cpu_ms_per_s.get(0) if "floor-python" in refs else None
    if idle is not None and floor:
        limit = IDLE_TARGET_FLOORS * floor
        c = refs["floor-c"].cpu_ms_per_s.get(0) if "floor-c" in refs else None
        out.append(
            f"CPU idle: {idle:.2f} ms/s, {idle / floor:.1f}× the bare Python loop's "
            f"{floor:.2f} ms/s at {args.fast_interval:g} s ({_meets(idle <= limit)} ≤ "
            f"{IDLE_TARGET_FLOORS:g}× floor = {limit:.2f} ms/s)"
            + ("" if c is None else f"; the bare C loop {c:.2f} ms/s")
        )
    busy = fast.cpu_ms_per_s.get(16)
    if busy is not None:
        target = f"≤ {BUSY_TARGET_MS_PER_S:g} ms/s"
        out.append(
            f"CPU at 16 GPU processes: {busy:.2f} ms/s "
            + (
                f"({_meets(busy <= BUSY_TARGET_MS_PER_S)} {target})"
                if args.mode == "gpu"
                else f"(stand-in, for information: the {target} target is for a real GPU)"
            )
        )
    steady = bench.stub_rows.get(fast.watcher.label)
    if steady is not None:
        alone = refs["stand-in-alone"].steady_ms_per_s if "stand-in-alone" in refs else None
        out.append(
            f"CPU steady, stand-in {args.stub_gpus} GPUs × {args.stub_procs} processes: "
            f"{steady:.2f} ms/s ({_meets(steady <= STEADY_TARGET_MS_PER_S)} ≤ "
            f"{STEADY_TARGET_MS_PER_S:g} ms/s)"
            + (
                ""
                if alone is None
                else f"; the stand-in alone {alone:.2f} ms/s, gpuguard minus the stand-in "
                f"{steady - alone:.2f} ms/s"
            )
        )
    return out


def steady_table(args: argparse.Namespace, rows: Sequence[Row], bench: Bench) -> list[str]:
    """The stub steady phase: gpuguard's rows, gpuguard minus the stand-in alone, the stand-in
    alone and the floors, all measured over the same seconds."""
    lines = [
        "",
        f"Steady CPU, stand-in, {args.stub_gpus} GPUs × {args.stub_procs} processes "
        f"(target ≤ {STEADY_TARGET_MS_PER_S:g} ms/s for gpuguard change-driven; the stand-in's "
        "own cost apart):",
        "",
        "| watcher | CPU ms/s | % of a core |",
        "|---|---:|---:|",
        *(f"| {k} | {v:.2f} | {v / 10:.2f} |" for k, v in bench.stub_rows.items()),
    ]
    alone = bench.references.get("stand-in-alone")
    refs = [alone] if alone is not None else []
    refs += [bench.references[k] for k in ("floor-python", "floor-c") if k in bench.references]
    fast = next((r.watcher.label for r in rows if r.watcher.key == "gpuguard-fast"), None)
    steady = bench.stub_rows.get(fast) if fast is not None else None
    if steady is not None and alone is not None and alone.steady_ms_per_s is not None:
        minus = steady - alone.steady_ms_per_s
        lines.append(
            f"| gpuguard change-driven minus the stand-in alone | {minus:.2f} | {minus / 10:.2f} |"
        )
    for ref in refs:
        v = ref.steady_ms_per_s
        lines.append(
            f"| {ref.title} | - | - |" if v is None else f"| {ref.title} | {v:.2f} | {v / 10:.2f} |"
        )
    return lines


def machine(node: Node) -> dict[str, str]:
    info = harness_machine()  # its load is taken now, before the run: how busy it was
    with contextlib.suppress(Exception):
        import importlib.metadata

        info["nvidia-ml-py"] = importlib.metadata.version("nvidia-ml-py")
    info.update(node.facts())
    return info


# ---------------------------------------------------------------------------------------------
# main


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.reaction",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--mode",
        choices=("stub", "gpu"),
        default="stub",
        help="stub: the NVML stand-in (default); gpu: a real NVIDIA node",
    )
    parser.add_argument("--trials", type=int, default=20, help="trials per watcher (default 20)")
    parser.add_argument(
        "--cpu-seconds",
        type=float,
        default=20.0,
        help="wall seconds each CPU level is measured over (default 20)",
    )
    parser.add_argument(
        "--cpu-levels",
        type=_ints,
        default=[0, 4, 16, 64],
        help="GPU processes in the CPU phase, comma-separated (default 0,4,16,64)",
    )
    parser.add_argument(
        "--grace", type=float, default=2.0, help="gpuguard grace_seconds, both modes (default 2)"
    )
    parser.add_argument(
        "--termination-timeout",
        type=float,
        default=2.0,
        help="gpuguard termination_timeout_seconds (default 2)",
    )
    parser.add_argument(
        "--poll",
        type=float,
        default=0.25,
        help="gpuguard poll_interval_seconds of the 'today' mode (default 0.25, as before the"
        " fast path)",
    )
    parser.add_argument(
        "--fast-poll",
        type=float,
        default=1.0,
        help="gpuguard poll_interval_seconds of the change-driven mode: every device listed at"
        " least this often (default 1.0, the default with the fast path)",
    )
    parser.add_argument(
        "--fast-interval",
        type=float,
        default=0.05,
        help="gpuguard fast_interval_seconds of the change-driven mode (default 0.05)",
    )
    parser.add_argument(
        "--fast-step", default="64Mi", help="gpuguard fast_step_bytes (default 64Mi)"
    )
    parser.add_argument(
        "--limit-gib", type=float, default=2.0, help="the greedy pod's limit (default 2 GiB)"
    )
    parser.add_argument(
        "--free-before",
        type=float,
        default=0.10,
        help="fraction of the device the filler leaves free (default 0.10)",
    )
    parser.add_argument(
        "--free-after",
        type=float,
        default=0.025,
        help="fraction left free once the greedy pod allocated (default 0.025)",
    )
    parser.add_argument(
        "--trial-timeout", type=float, default=15.0, help="seconds from crossing to freed, at most"
    )
    parser.add_argument(
        "--smi-looks",
        type=int,
        default=0,
        help="nvidia-smi calls averaged per CPU level for the per-look line (default 10; 3 in "
        "stub mode, where each is a Python start)",
    )
    parser.add_argument(
        "--stub-gpus", type=int, default=8, help="stub: GPUs of the steady-CPU rows (default 8)"
    )
    parser.add_argument(
        "--stub-procs",
        type=int,
        default=100,
        help="stub: processes per GPU of the steady-CPU rows; 0 skips them (default 100)",
    )
    parser.add_argument(
        "--stub-pods-per-gpu", type=int, default=10, help="stub: pods per GPU there (default 10)"
    )
    parser.add_argument("--gpu", type=int, default=0, help="gpu: NVML index of the GPU (default 0)")
    parser.add_argument(
        "--holder-mib", type=int, default=64, help="gpu: MiB each CPU-phase holder allocates"
    )
    parser.add_argument(
        "--watchers",
        default="gpuguard-fast,gpuguard-today,smi-loop,nvml-poll",
        help="which watchers, comma-separated (default all four)",
    )
    parser.add_argument("--seed", type=int, default=14, help="seed of the random crossing phase")
    parser.add_argument(
        "--out", type=Path, help="keep logs, records, pods file and results.json here"
    )
    parser.add_argument(
        "--record", type=Path, help="append the result (machine, date, command) to this file"
    )
    return parser.parse_args(argv)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if os.geteuid() != 0:
        raise SystemExit("run as root: the benchmark builds cgroups and the watchers signal")
    if not 0 < args.free_after < PRESSURE_FRACTION < args.free_before < 1:
        raise SystemExit("need 0 < --free-after < 0.05 < --free-before < 1")
    # SIGTERM (a timeout, a CI cancel) ends the run like Ctrl-C: everything started is killed,
    # the cgroups removed, and what was measured so far printed.
    signal.signal(signal.SIGTERM, _interrupt)
    out = args.out or Path(tempfile.mkdtemp(prefix="gpuguard-reaction-"))
    out.mkdir(parents=True, exist_ok=True)
    bench = Bench(args, out)
    keys = args.watchers.split(",")
    rows: list[Row] = []
    interrupted: BaseException | None = None
    info: dict[str, str] = {}
    problems: list[str] = []
    try:
        info = machine(bench.node)
        print("\n".join(f"# {k}: {v}" for k, v in info.items()), flush=True)  # the header
        bench.watchers = [w for w in bench.make_watchers() if w.key in keys]
        rows = [Row(watcher=w) for w in bench.watchers]
        t0 = time.monotonic()
        bench.run_trials(rows)
        if args.cpu_levels and args.cpu_seconds > 0:
            print(f"[{time.monotonic() - t0:.0f} s] CPU phase", flush=True)
            bench.run_cpu(rows)
        if args.mode == "stub" and args.stub_procs > 0 and args.cpu_seconds > 0:
            print(f"[{time.monotonic() - t0:.0f} s] steady phase", flush=True)
            bench.run_stub_steady(rows)
        print(f"[{time.monotonic() - t0:.0f} s] done", flush=True)
    except BaseException as e:  # noqa: BLE001 - report what was measured, then re-raise
        interrupted = e
    finally:
        problems = bench.close()
    if interrupted is not None and not rows:
        raise interrupted
    bench.account(rows)
    levels = sorted(set(args.cpu_levels))
    floors = [bench.references[k] for k in ("floor-python", "floor-c") if k in bench.references]
    body = table(rows, levels, floors)
    lines = [body, ""]
    if bench.per_look:
        lines.append(per_look_line(bench.per_look, args.mode == "stub"))
    if bench.stub_rows:
        lines += steady_table(args, rows, bench)
    summary = verdicts(rows, args, bench.per_look, bench)
    if summary:
        lines += ["", *(f"- {s}" for s in summary)]
    wrong = sorted({w for r in rows for w in r.wrong})
    failed = [(r.watcher.key, t) for r in rows for t in r.trials if t.problem]
    for key, t in failed:
        lines.append(f"- PROBLEM {key} {t.label}: {t.problem}")
    for w in wrong:
        lines.append(f"- WRONG KILL: {w}")
    for p in problems:
        lines.append(f"- CLEANUP: {p}")
    text = "\n".join(lines)
    print("\n" + text)
    (out / "results.json").write_text(
        json.dumps(
            {
                "provenance": info,
                "args": {k: str(v) for k, v in vars(args).items()},
                "trials": [dataclasses.asdict(t) for r in rows for t in r.trials],
                "cpu_ms_per_s": {r.watcher.key: r.cpu_ms_per_s for r in rows},
                "per_look_ms": bench.per_look,
                "stub_steady_ms_per_s": bench.stub_rows,
                "references": {
                    k: {
                        "label": ref.title,
                        "cpu_ms_per_s": ref.cpu_ms_per_s,
                        "steady_ms_per_s": ref.steady_ms_per_s,
                    }
                    for k, ref in bench.references.items()
                },
                "wrong_kills": wrong,
            },
            indent=1,
        )
    )
    print(f"\nlogs, records and results.json in {out}")
    print(f"cgroup root (removed): {bench.cg.mount / bench.cg.name}")
    if interrupted is not None:
        raise interrupted
    if args.record is not None:
        title = "stand-in library" if args.mode == "stub" else "real GPU"
        append_record(args.record, f"Reaction, {title} ({info['date']})", info, text)
        print(f"recorded in {args.record}")
    ok = all(t.t_freed is not None for r in rows for t in r.trials) and not wrong
    return 0 if ok and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
