"""The processes of the reaction benchmark (benchmarks/reaction.py), one subcommand each.

Owns: the workload's processes (``worker``: a GPU process of a pod or of the host that records,
with the system-wide CLOCK_MONOTONIC, every signal it receives; ``farm``: many stand-in GPU
processes forked from one parent), the two baseline watchers that users run instead of gpuguard
(``smi-loop``: ``nvidia-smi --query-compute-apps`` every second; ``nvml-poll``: an NVML process
listing every 5 s, MetaGPU's enforcer interval), ``nvidia-smi``, a stand-in for the real CLI
over the NVML stand-in library (same query, same CSV), spawned per look as the real one is, and
``nvml-calls``: the NVML calls gpuguard makes in steady state at its rate, without gpuguard
(the stand-in's own cost).

Must not: signal any process but the ones the benchmark's registry names (the watchers re-check
each PID's start time through a pidfd before signalling it), touch CUDA without ``--backend
cuda``, or import anything heavy at the top (each look of the stand-in ``nvidia-smi`` and each
stub worker is a fresh interpreter).

Usage (normally started by reaction.py)::

    python3 benchmarks/reaction_worker.py worker --backend cuda --role greedy --label t0 \\
        --record /tmp/r.jsonl          # then "go <bytes>" on stdin
    python3 benchmarks/reaction_worker.py smi-loop --registry reg.json --log smi.jsonl \\
        --interval 1 -- nvidia-smi
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

MIB = 1 << 20
SMI_QUERY = ["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
CAUGHT = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGALRM,
)


def record(fd: int, **fields: object) -> None:
    """One JSON line, one ``write(2)`` on an O_APPEND fd: safe in a signal handler."""
    os.write(fd, (json.dumps(fields, sort_keys=True) + "\n").encode())


def start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks since boot), or ``None`` when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text.rsplit(")", 1)[1].split()[19])


# ---------------------------------------------------------------------------------------------
# workload


def _catch(fd: int, role: str, label: list[str], exit_on_term: bool) -> None:
    """Record every catchable signal; ``label[0]`` is read at delivery (a staged worker learns
    its label later)."""

    def on_signal(signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        name = signal.Signals(signum).name.removeprefix("SIG")
        record(fd, kind="signal", signal=name, role=role, label=label[0], pid=os.getpid(), t=now)
        if signum == signal.SIGTERM and exit_on_term:
            os._exit(0)

    for s in CAUGHT:
        signal.signal(s, on_signal)


def worker(args: argparse.Namespace) -> int:
    """A pod's or the host's GPU process. ``greedy`` exits on SIGTERM, ``hold`` keeps holding
    (any signal it receives is a wrong kill). Prints ``ready <pid>``; with ``--backend cuda``
    then reads ``go <bytes>``, allocates that much in one ``torch.empty`` and prints
    ``allocated <t>`` (CLOCK_MONOTONIC after the allocation completed)."""
    fd = os.open(args.record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    label = [args.label]
    _catch(fd, args.role, label, exit_on_term=args.role == "greedy")
    held: list[Any] = []
    if args.backend == "stub":
        # Like a CUDA process: /proc/<pid>/fd shows a char 195:0 device (the resolver's check).
        held.append(os.open(args.device_node, os.O_PATH))
        print(f"ready {os.getpid()}", flush=True)
        while True:
            time.sleep(3600)
    torch: Any = importlib.import_module("torch")
    if args.stage:
        # Imported, not yet a GPU process: the benchmark moves it into its pod's cgroup, then
        # says "init <label>". NVML never listed it before, so no watcher has seen it.
        print("imported", flush=True)
        words = sys.stdin.readline().split()
        if len(words) != 2 or words[0] != "init":
            return 2
        label[0] = words[1]
    torch.cuda.init()
    held.append(torch.empty(MIB, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    print(f"ready {os.getpid()}", flush=True)
    line = sys.stdin.readline().split()
    if len(line) == 2 and line[0] == "go":
        held.append(torch.empty(int(line[1]), dtype=torch.uint8, device="cuda"))
        torch.cuda.synchronize()
        t = time.monotonic()
        record(fd, kind="alloc", role=args.role, label=label[0], pid=os.getpid(), t=t)
        print(f"allocated {t!r}", flush=True)
    while True:
        time.sleep(3600)


def farm(args: argparse.Namespace) -> int:
    """Stand-in GPU processes: one child per line of ``--cgroups`` (a ``cgroup.procs`` path),
    each moved into that cgroup, holding the inherited device fd, recording signals. Prints the
    children's PIDs as one JSON list, then waits (the benchmark kills it and its cgroups)."""
    fd = os.open(args.record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    device = os.open(args.device_node, os.O_PATH)
    children: list[int] = []
    for target in Path(args.cgroups).read_text().split():
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                Path(target).write_text(str(os.getpid()))
                _catch(fd, "hold", [args.label], exit_on_term=False)
                os.write(w, b"k")
            finally:
                os.close(w)
            while True:
                signal.pause()
        os.close(w)
        ok = os.read(r, 1) == b"k"
        os.close(r)
        if not ok:
            sys.stderr.write(f"farm child {pid} could not join {target}\n")
            return 2
        children.append(pid)
    os.close(device)
    print(json.dumps(children), flush=True)
    while True:
        time.sleep(3600)


# ---------------------------------------------------------------------------------------------
# baseline watchers


class Registry:
    """The benchmark's workload registry (``{"pods": {name: limit_bytes}, "pids": {pid:
    {"pod": name, "start": ticks}}}``), re-read when the file changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self.pods: dict[str, int] = {}
        self.pids: dict[int, tuple[str, int]] = {}

    def refresh(self) -> None:
        st = self.path.stat()
        stamp = (st.st_ino, st.st_mtime_ns)
        if stamp == self._stamp:
            return
        doc = json.loads(self.path.read_text())
        self.pods = {k: int(v) for k, v in doc["pods"].items()}
        self.pids = {int(k): (v["pod"], int(v["start"])) for k, v in doc["pids"].items()}
        self._stamp = stamp


def _signal_verified(pid: int, start: int) -> bool:
    """SIGTERM ``pid`` through a pidfd, only if it is still the process the registry named."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        if start_time(pid) != start:
            return False
        signal.pidfd_send_signal(pidfd, signal.SIGTERM)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(pidfd)


class KillRule:
    """A pod whose listed processes use more than its limit: SIGTERM them now (no grace)."""

    def __init__(self, registry: Registry, log: Path) -> None:
        self.registry = registry
        self.log = log.open("a", encoding="utf-8")
        self.signalled: set[tuple[int, int]] = set()
        self.looks = 0

    def apply(self, usage: dict[int, int]) -> None:
        self.looks += 1
        self.registry.refresh()
        per_pod: dict[str, int] = {}
        for pid, used in usage.items():
            known = self.registry.pids.get(pid)
            if known is not None:
                per_pod[known[0]] = per_pod.get(known[0], 0) + used
        for pod, used in per_pod.items():
            limit = self.registry.pods.get(pod)
            if limit is None or used <= limit:
                continue
            for pid in usage:
                known = self.registry.pids.get(pid)
                if known is None or known[0] != pod or (pid, known[1]) in self.signalled:
                    continue
                if _signal_verified(pid, known[1]):
                    self.signalled.add((pid, known[1]))
                    line = {"event": "signalled", "t": time.monotonic(), "pid": pid, "pod": pod}
                    line |= {"used_bytes": used, "limit_bytes": limit, "signal": "TERM"}
                    self.log.write(json.dumps(line) + "\n")
                    self.log.flush()


def _every(interval: float, look: Any) -> int:
    """Call ``look()`` at a fixed rate until killed."""
    next_t = time.monotonic()
    while True:
        look()
        next_t += interval
        time.sleep(max(0.0, next_t - time.monotonic()))


def smi_loop(args: argparse.Namespace) -> int:
    rule = KillRule(Registry(Path(args.registry)), Path(args.log))
    argv = [*args.smi, *SMI_QUERY]

    def look() -> None:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        usage: dict[int, int] = {}
        for line in done.stdout.splitlines():
            pid, _, mib = line.partition(",")
            with contextlib.suppress(ValueError):  # "[N/A]", a warning line
                usage[int(pid)] = usage.get(int(pid), 0) + int(mib.strip()) * MIB
        rule.apply(usage)

    return _every(args.interval, look)


def nvml_poll(args: argparse.Namespace) -> int:
    import pynvml

    pynvml.nvmlInit()
    rule = KillRule(Registry(Path(args.registry)), Path(args.log))
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]

    def look() -> None:
        usage: dict[int, int] = {}
        for h in handles:
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if isinstance(p.usedGpuMemory, int):
                    usage[p.pid] = usage.get(p.pid, 0) + p.usedGpuMemory
        rule.apply(usage)

    return _every(args.interval, look)


def nvml_calls(args: argparse.Namespace) -> int:
    """The NVML calls gpuguard's change-driven mode makes in steady state, at its rate, and
    nothing else: the stand-in library's own cost, for reaction.py's steady table. Every
    ``--fast-interval``: ``nvmlDeviceGetCount_v2`` and ``nvmlDeviceGetMemoryInfo`` of each GPU
    (gpuguard's fast read); every ``--poll``: the listing gpuguard's NVML source makes
    (``nvmlDeviceGetCount_v2``; per GPU ``nvmlDeviceGetMigMode`` and the compute, graphics and
    MPS-client ``_v3`` process lists, each a count call plus a fetch when not empty). Straight
    ctypes calls through pynvml's loaded library, as gpuguard makes them; the entries are not
    decoded (that is gpuguard's work, not the library's). Handles are read once (gpuguard caches
    them)."""
    import ctypes

    import pynvml

    pynvml.nvmlInit()
    lib = pynvml.nvmlLib
    count, memory = ctypes.c_uint(0), pynvml.c_nvmlMemory_t()
    current, pending = ctypes.c_uint(0), ctypes.c_uint(0)
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    lists = [
        getattr(lib, f"nvmlDeviceGet{kind}RunningProcesses_v3")
        for kind in ("Compute", "Graphics", "MPSCompute")
    ]
    entry = ctypes.sizeof(pynvml.c_nvmlProcessInfo_v3_t)

    def fast_read() -> None:
        lib.nvmlDeviceGetCount_v2(ctypes.byref(count))
        for h in handles:
            lib.nvmlDeviceGetMemoryInfo(h, ctypes.byref(memory))

    def listing() -> None:
        lib.nvmlDeviceGetCount_v2(ctypes.byref(count))
        for h in handles:
            lib.nvmlDeviceGetMigMode(h, ctypes.byref(current), ctypes.byref(pending))
            for fn in lists:
                n = ctypes.c_uint(0)
                if fn(h, ctypes.byref(n), None) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
                    n.value = n.value * 2 + 5
                    fn(h, ctypes.byref(n), ctypes.create_string_buffer(n.value * entry))

    next_listing = time.monotonic()

    def look() -> None:
        nonlocal next_listing
        fast_read()
        if time.monotonic() >= next_listing:
            listing()
            next_listing += args.poll

    return _every(args.fast_interval, look)


def fake_smi(args: argparse.Namespace) -> int:
    """``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`` over
    whatever ``libnvidia-ml.so.1`` the loader finds (the stand-in, in stub mode)."""
    import pynvml

    if args.query != "pid,used_memory" or args.format != "csv,noheader,nounits":
        sys.stderr.write("stand-in nvidia-smi: only the benchmark's query is implemented\n")
        return 2
    pynvml.nvmlInit()
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                used = p.usedGpuMemory
                out.append(f"{p.pid}, {used // MIB if isinstance(used, int) else '[N/A]'}")
        sys.stdout.write("".join(line + "\n" for line in out))
    finally:
        pynvml.nvmlShutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker", help="one GPU process of a pod or of the host")
    w.add_argument("--backend", choices=["cuda", "stub"], required=True)
    w.add_argument("--role", choices=["greedy", "hold"], required=True)
    w.add_argument("--label", default="")
    w.add_argument("--record", required=True, help="JSON-lines file to append signals to")
    w.add_argument("--device-node", help="stub: the char 195:0 look-alike to hold open")
    w.add_argument(
        "--stage",
        action="store_true",
        help='cuda: import torch, print "imported", wait for "init <label>" before CUDA init',
    )
    f = sub.add_parser("farm", help="stand-in GPU processes forked into given cgroups")
    f.add_argument("--cgroups", required=True, help="file: one cgroup.procs path per child")
    f.add_argument("--device-node", required=True)
    f.add_argument("--record", required=True)
    f.add_argument("--label", default="farm")
    for name, interval in (("smi-loop", 1.0), ("nvml-poll", 5.0)):
        p = sub.add_parser(name, help=f"baseline watcher, a look every {interval:g} s")
        p.add_argument("--registry", required=True, help="the benchmark's workload registry")
        p.add_argument("--log", required=True, help="JSON lines: one per signal sent")
        p.add_argument("--interval", type=float, default=interval)
        if name == "smi-loop":
            p.add_argument("smi", nargs="+", help="argv of nvidia-smi (after --)")
    c = sub.add_parser("nvml-calls", help="gpuguard's steady NVML calls, without gpuguard")
    c.add_argument("--fast-interval", type=float, default=0.05, help="fast read period (s)")
    c.add_argument("--poll", type=float, default=1.0, help="listing period (s)")
    s = sub.add_parser("nvidia-smi", help="stand-in for nvidia-smi over the NVML stand-in")
    s.add_argument("--query-compute-apps", dest="query", required=True)
    s.add_argument("--format", required=True)
    args = parser.parse_args(argv)
    run = {
        "worker": worker,
        "farm": farm,
        "smi-loop": smi_loop,
        "nvml-poll": nvml_poll,
        "nvml-calls": nvml_calls,
        "nvidia-smi": fake_smi,
    }[args.command]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
