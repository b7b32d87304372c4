"""The enforcer's CPU for ONE violation on a GPU with many processes: a quiet window against a
window from an offender's crossing of its limit to its SIGKILL, side by side for two gpuguard
source trees (the fast path's listings before and after commit 517af43, docs/soak.md finding 4).

Everything but the GPU is real, as in ``benchmarks/enforcer_cpu.py``: the ``Enforcer`` on the
fast path over ``NvmlGpuSource`` on the C stand-in (``tests/nvml_stub``), its
``ChangeDrivenSampler`` and ``ProcfsProcessResolver`` built by the tree's own ``gpuguard.app``
builders as its ``gpuguard enforce`` builds them (today: the native quiet gate between fast
reads, the ``holds_gpu`` fd check and the process pins; a tree without them gets its own
construction, and each run prints which it got), over real processes in real kubepods cgroups
(v2), ``FilePodDirectory`` over a pods file, ``decide()``,
the ``PidfdKiller`` and the Prometheus collector. Intervals, step, grace period and termination
timeout are the product's defaults (``gpuguard.config``: fast read every 0.05 s, every GPU
listed at least every 1 s, grace 10 s, timeout 10 s) unless given.

One GPU holds ``--procs`` processes: the offender (one process, alone in its pod, that catches
and ignores SIGTERM, so the termination timeout runs out and SIGKILL ends it) and ``--procs`` −
1 pausing children of ``--pods`` bystander pods (limits far above their use). Per run, in a
fresh subprocess that imports gpuguard from ``--gpuguard-src`` only (the two trees never mix):

1. warm-up (``--warmup-seconds``), then (a) a quiet window of grace + timeout seconds;
2. (b) the offender's memory goes from half to twice its limit (a scenario rewrite) and the
   window runs until the offender is dead (its pidfd is readable).

CPU is the worker process's (``CLOCK_PROCESS_CPUTIME_ID``: the event loop's cycles, the fast
reader thread's reads, listings and attributions, the thread pool's signals; the benchmark's own
part is one scenario write and a pidfd wait), also split by thread (the fast reader's
``pthread_getcpuclockid``). CPU-seconds per violation = (b) − (a) × len(b) / len(a). Listings
are the sampler's ``sample``/``sample_devices`` calls, PIDs attributed the resolver's calls,
cycles the publisher's.

Checks (the exit status): the offender got SIGTERM and then SIGKILL from the enforcer and died
of it; every signal the enforcer sent went to the offender only; no bystander caught a signal or
died. Must not signal a process it did not start: everything is started in its own cgroups
(``CgroupTree``) and SIGKILLed by pidfd there at the end. Needs root. Run::

    make nvml-stub
    git -C . archive 4f0cab6 gpuguard | (mkdir -p /tmp/gg-before && tar -x -C /tmp/gg-before)
    .venv/bin/python -m benchmarks.violation_cost --procs 100,1100 --repeat 3 \\
        --gpuguard-src current=. --gpuguard-src before=/tmp/gg-before --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rigs.measure import machine_line
from rigs.nvml_stub import STUB_LIB, stub_device, stub_scenario, stub_uuid
from rigs.processes import ZYGOTE, alive, gpu_device_node, write_atomic
from rigs.provenance import header

REPO = Path(__file__).resolve().parents[1]

GIB = 1 << 30
MIB = 1 << 20
BYSTANDER_BYTES = 8 * MIB
BYSTANDER_LIMIT = "100Gi"
OFFENDER_LIMIT_BYTES = GIB
OFFENDER_LIMIT = "1Gi"
OFFENDER_UNDER_BYTES = OFFENDER_LIMIT_BYTES // 2
OFFENDER_OVER_BYTES = 2 * OFFENDER_LIMIT_BYTES
NODE = "bench"

OFFENDER = r"""
import os, signal, sys
record, device = sys.argv[1], sys.argv[2]
gpu_fd = os.open(device, os.O_PATH)

def on_term(signum, frame):  # caught and ignored: the termination timeout runs out, then KILL
    fd = os.open(record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"signal {os.getpid()} {signal.Signals(signum).name}\n".encode())
    os.close(fd)

signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
while True:
    signal.pause()
"""


# ---------------------------------------------------------------------------------------------
# One run (the worker subprocess): imports gpuguard from --gpuguard-src only


@dataclass(slots=True)
class Counts:
    """What the enforcer did, counted by thin proxies around its real parts."""

    listings: int = 0
    attributions: int = 0
    cycles: int = 0
    signals: list[dict[str, Any]] = field(default_factory=list)
    events: int = 0


class CountingGpu:
    """``NvmlGpuSource`` with its listings counted (the fast read passes straight through)."""

    def __init__(self, source: Any, counts: Counts) -> None:
        self._source = source
        self._counts = counts
        self.read_memory = source.read_memory

    def sample(self) -> Any:
        self._counts.listings += 1
        return self._source.sample()

    def sample_devices(self, keys: Any) -> Any:
        self._counts.listings += 1
        return self._source.sample_devices(keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)


class CountingResolver:
    def __init__(self, resolver: Any, counts: Counts) -> None:
        self._resolver = resolver
        self._counts = counts

    def attribute(self, pid: int) -> Any:
        self._counts.attributions += 1
        return self._resolver.attribute(pid)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._resolver, name)


class CountingPublisher:
    def __init__(self, publisher: Any, counts: Counts) -> None:
        self._publisher = publisher
        self._counts = counts

    def publish(self, decision: Any, **kwargs: Any) -> None:
        self._counts.cycles += 1
        self._publisher.publish(decision, **kwargs)


class RecordingKiller:
    """The real ``PidfdKiller``; each call's signal, pod and delivered PIDs are kept."""

    def __init__(self, killer: Any, counts: Counts) -> None:
        self._killer = killer
        self._counts = counts

    def signal_container(self, target: Any, signal: Any, *, wait_seconds: float = 0.0) -> Any:
        at = time.monotonic()
        report = self._killer.signal_container(target, signal, wait_seconds=wait_seconds)
        self._counts.signals.append(
            {
                "at": at,
                "signal": str(signal.value),
                "pod": target.pod.name,
                "delivered": [p.pid for p in report.delivered],
                "already_gone": list(report.already_gone),
                "refused": [r.pid for r in report.refused],
            }
        )
        return report


class CountingEvents:
    def __init__(self, counts: Counts) -> None:
        self._counts = counts

    def post(self, event: object) -> None:
        self._counts.events += 1


def _thread_cpu(thread: threading.Thread | None) -> float:
    if thread is None or thread.ident is None:
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except OSError:  # the thread ended
        return 0.0


@dataclass(slots=True)
class Mark:
    wall: float
    cpu: float
    main_cpu: float
    reader_cpu: float
    listings: int
    attributions: int
    cycles: int


def _window(a: Mark, b: Mark) -> dict[str, float]:
    return {
        "seconds": b.wall - a.wall,
        "cpu_s": b.cpu - a.cpu,
        "event_loop_cpu_s": b.main_cpu - a.main_cpu,
        "fast_reader_cpu_s": b.reader_cpu - a.reader_cpu,
        "listings": b.listings - a.listings,
        "attributions": b.attributions - a.attributions,
        "cycles": b.cycles - a.cycles,
    }


def _pod(name: str, pod_uid: str, cid: str, limit: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "bench",
            "uid": pod_uid,
            "annotations": {"gpuguard.io/gpu-memory-limit": limit},
        },
        "spec": {"nodeName": NODE, "containers": [{"name": "c", "image": "registry.invalid/x"}]},
        "status": {
            "phase": "Running",
            "qosClass": "Burstable",
            "containerStatuses": [{"name": "c", "containerID": f"containerd://{cid}"}],
        },
    }


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One run in this process: set up, measure (a) and (b), check, tear down."""
    src = Path(args.gpuguard_src[-1]).resolve()
    import gpuguard  # from src: the driver starts this process with it first (worker_command)

    where = Path(gpuguard.__file__).resolve()
    if not where.is_relative_to(src):
        raise SystemExit(f"gpuguard imported from {where}, not from {src}")
    from gpuguard import logs
    from gpuguard.config import EnforcementSettings, NvmlSettings
    from rigs.cgroups import CgroupTree, fake_container_id

    logs.configure(level="warning", json=False)
    defaults, nvml_defaults = EnforcementSettings(), NvmlSettings()
    grace = defaults.grace_seconds if args.grace is None else args.grace
    timeout = (
        defaults.termination_timeout_seconds
        if args.termination_timeout is None
        else args.termination_timeout
    )
    poll = defaults.poll_interval_seconds
    fast = defaults.fast_interval_seconds
    work = Path(tempfile.mkdtemp(prefix="gg-violation-"))
    node = gpu_device_node(work / "nvidia0")
    record = work / "signals.log"
    result: dict[str, Any] = {
        "gpuguard": str(where.parent),
        "procs": args.procs,
        "pods": args.pods,
        "grace_seconds": grace,
        "termination_timeout_seconds": timeout,
        "poll_interval_seconds": poll,
        "fast_interval_seconds": fast,
        "fast_step_bytes": defaults.fast_step_bytes,
    }
    with CgroupTree(name=f"gpuguard-violation-{os.getpid()}") as tree:
        pods, bystanders = [], []
        zygotes: list[subprocess.Popen[bytes]] = []
        n_pods = max(1, min(args.pods, args.procs - 1))
        per_pod = [
            (args.procs - 1) // n_pods + (i < (args.procs - 1) % n_pods) for i in range(n_pods)
        ]
        for i, count in enumerate(per_pod):
            pod_uid, cid = str(uuid.uuid4()), fake_container_id(i + 1)
            cg = tree.container(version=2, driver="systemd", qos="burstable", pod_uid=pod_uid,
                                runtime="containerd", container_id=cid)  # fmt: skip
            # Its stdin stays open until the teardown: on EOF it would end with its children.
            z = tree.spawn([sys.executable, "-S", "-c", ZYGOTE, str(record), str(node), str(count)],
                           cgroups=[cg], stdout=subprocess.PIPE, stdin=subprocess.PIPE)  # fmt: skip
            zygotes.append(z)
            assert z.stdout is not None
            line = z.stdout.readline().decode().split()
            if not line or line[0] != "ready":
                raise RuntimeError(f"bystander zygote {z.pid} did not start: {line}")
            bystanders += [int(x) for x in line[1:]]
            pods.append(_pod(f"bystander-{i}", pod_uid, cid, BYSTANDER_LIMIT))
        pod_uid, cid = str(uuid.uuid4()), fake_container_id(0)
        cg = tree.container(version=2, driver="systemd", qos="burstable", pod_uid=pod_uid,
                            runtime="containerd", container_id=cid)  # fmt: skip
        offender = tree.spawn([sys.executable, "-c", OFFENDER, str(record), str(node)],
                              cgroups=[cg], stdout=subprocess.PIPE)  # fmt: skip
        assert offender.stdout is not None
        if offender.stdout.readline().strip() != b"ready":
            raise RuntimeError("the offender did not start")
        pods.append(_pod("offender", pod_uid, cid, OFFENDER_LIMIT))
        (work / "pods.json").write_text(json.dumps({"kind": "List", "items": pods}))

        def scenario(offender_bytes: int | None) -> str:
            procs = [(p, BYSTANDER_BYTES) for p in bystanders]
            if offender_bytes is not None:
                procs.append((offender.pid, offender_bytes))
            return json.dumps(stub_scenario([stub_device(uuid=stub_uuid(0), processes=procs)]))

        scenario_path = work / "scenario.json"

        def write_scenario(text: str) -> None:
            write_atomic(scenario_path, text)  # a new inode: the stand-in re-reads it

        write_scenario(scenario(OFFENDER_UNDER_BYTES))
        os.environ["NVML_STUB_SCENARIO"] = str(scenario_path)
        result["gpu_processes"] = len(bystanders) + 1
        result.update(
            _measure(
                args, work=work, grace=grace, timeout=timeout, poll=poll,
                gpu_timeout=nvml_defaults.call_timeout_seconds,
                pressure=defaults.pressure_free_fraction,
                staleness=defaults.staleness_seconds, offender=offender,
                over=scenario(OFFENDER_OVER_BYTES), gone=scenario(None),
                write_scenario=write_scenario,
            )
        )  # fmt: skip
        # The checks, before the teardown's SIGKILLs.
        wrong = [
            f"{s['signal']} to pod {s['pod']} pids {s['delivered']}"
            for s in result["signals"]
            if s["pod"] != "offender" or set(s["delivered"]) - {offender.pid}
        ]
        lines = record.read_text().splitlines() if record.exists() else []
        offender_lines = [ln for ln in lines if ln.split()[1] == str(offender.pid)]
        wrong += [f"bystander record: {ln}" for ln in lines if ln not in offender_lines]
        wrong += [f"bystander {p} is gone" for p in bystanders if not alive(p)]
        wrong += [f"bystander zygote {z.pid} is gone" for z in zygotes if z.poll() is not None]
        sent = [s["signal"] for s in result["signals"] if offender.pid in s["delivered"]]
        result["offender"] = {
            "pid": offender.pid,
            "returncode": offender.returncode,
            "caught": [ln.split()[2] for ln in offender_lines],
            "signals_sent": sent,
        }
        result["offender_stopped"] = (
            offender.returncode == -9
            and sent[:1] == ["SIGTERM"]
            and sent[-1:] == ["SIGKILL"]
            and "SIGTERM" in result["offender"]["caught"]
        )
        result["wrong_signals"] = wrong
    result["cgroup_root_removed"] = not Path(f"/sys/fs/cgroup/unified/{tree.name}").exists()
    return result


def _shipped_parts(nvml: Any, gpu: Any, clock: Any) -> tuple[Any, Any, dict[str, Any]]:
    """The resolver and the sampler as the tree's own ``gpuguard enforce`` builds them: through
    its ``gpuguard.app`` builders on default settings, with the process pins and the native quiet
    gate where the tree has them (since ``007e37d`` and ``346c141``; ``4f0cab6`` has neither),
    and which of them it got. Must not build them by hand: the figures are the shipped parts'."""
    import inspect

    from gpuguard import app
    from gpuguard.config import load_settings

    settings = load_settings(environ={}, uses_api_server=False)
    pins = "pin_processes" in inspect.signature(app.build_resolver).parameters
    resolver = (
        app.build_resolver(settings, pin_processes=True) if pins else app.build_resolver(settings)
    )
    takes_gate = "gate" in inspect.signature(app.build_sampler).parameters
    gate = nvml.quiet_gate() if takes_gate and hasattr(nvml, "quiet_gate") else None
    sampler = (
        app.build_sampler(settings, gpu, clock, gate)
        if takes_gate
        else app.build_sampler(settings, gpu, clock)
    )
    built = {"pins": pins, "fast_reads": "native quiet gate" if gate is not None else "python"}
    return resolver, sampler, built


def _measure(
    args: argparse.Namespace,
    *,
    work: Path,
    grace: float,
    timeout: float,
    poll: float,
    gpu_timeout: float,
    pressure: float,
    staleness: float,
    offender: subprocess.Popen[bytes],
    over: str,
    gone: str,
    write_scenario: Callable[[str], None],
) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry

    try:
        from gpuguard.adapters.clock import SystemClock
    except ImportError:  # a tree before a009273, such as the docs' "before" tree 4f0cab6
        from gpuguard.runtime.clock import SystemClock  # type: ignore[no-redef]
    from gpuguard.adapters.killer import PidfdKiller
    from gpuguard.adapters.metrics import PrometheusRecorder, SnapshotCollector
    from gpuguard.adapters.nvml import NvmlGpuSource
    from gpuguard.adapters.podfile import FilePodDirectory
    from gpuguard.core.model import EnforcementPolicy, Mode
    from gpuguard.runtime.enforcer import Enforcer

    counts = Counts()
    clock = SystemClock()
    nvml = NvmlGpuSource(clock=clock.monotonic, library_path=STUB_LIB, deadline_seconds=gpu_timeout)
    nvml.acquire()
    gpu = CountingGpu(nvml, counts)
    directory = FilePodDirectory(work / "pods.json", node_name=NODE, clock=clock)
    directory.start()
    registry = CollectorRegistry()
    collector = SnapshotCollector(hostname=NODE)
    registry.register(collector)
    policy = EnforcementPolicy(
        mode=Mode.ENFORCE,
        grace_seconds=grace,
        termination_timeout_seconds=timeout,
        staleness_seconds=staleness,
        pressure_free_fraction=pressure,
    )
    resolver, sampler, built = _shipped_parts(nvml, gpu, clock)
    # A tree before the one loop also read the GPU source beside its sampler.
    older = {"gpu": gpu} if "gpu" in inspect.signature(Enforcer).parameters else {}
    enforcer = Enforcer(
        **older,  # type: ignore[arg-type]
        resolver=CountingResolver(resolver, counts),
        pods=directory,
        killer=RecordingKiller(
            PidfdKiller(cgroup_root=Path("/sys/fs/cgroup"), proc_root=Path("/proc")), counts
        ),
        events=CountingEvents(counts),
        recorder=PrometheusRecorder(registry),
        publisher=CountingPublisher(collector, counts),
        clock=clock,
        policy=policy,
        poll_interval_seconds=poll,
        gpu_timeout_seconds=gpu_timeout,
        sampler=sampler,
    )

    def mark() -> Mark:
        reader = next((t for t in threading.enumerate() if t.name == "gpuguard-fast-read"), None)
        return Mark(
            wall=time.monotonic(),
            cpu=time.process_time(),
            main_cpu=_thread_cpu(threading.main_thread()),
            reader_cpu=_thread_cpu(reader),
            listings=counts.listings,
            attributions=counts.attributions,
            cycles=counts.cycles,
        )

    async def run() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        task = asyncio.create_task(enforcer.run(stop), name="enforcer")
        pidfd = os.pidfd_open(offender.pid)
        died: asyncio.Future[None] = loop.create_future()

        def exited() -> None:  # once: an exited process's pidfd stays readable
            loop.remove_reader(pidfd)
            died.set_result(None)

        loop.add_reader(pidfd, exited)
        out: dict[str, Any] = {}
        try:
            await asyncio.sleep(args.warmup_seconds)
            quiet_seconds = grace + timeout
            a0 = mark()
            await asyncio.sleep(quiet_seconds)
            a1 = mark()
            out["quiet"] = _window(a0, a1)
            b0 = mark()
            write_scenario(over)  # the crossing: half its limit → twice its limit
            try:
                await asyncio.wait_for(asyncio.shield(died), grace + timeout + args.slack_seconds)
            except TimeoutError:
                out["problem"] = "the offender was not stopped in time"
            b1 = mark()
            out["violation"] = _window(b0, b1)
            if died.done():
                offender.wait()
                write_scenario(gone)  # the driver frees its memory
            await asyncio.sleep(args.after_seconds)  # the enforcer sees it gone
            out["signals"] = [{**s, "at": s["at"] - b0.wall} for s in counts.signals]
            out["built"] = built | {"pinned_at_end": getattr(resolver, "pinned", 0)}
            out["events"] = counts.events
        finally:
            if not died.done():
                loop.remove_reader(pidfd)
            os.close(pidfd)
            stop.set()
            await task
        return out

    try:
        return asyncio.run(run())
    finally:
        directory.stop()
        nvml.close()


# ---------------------------------------------------------------------------------------------
# The driver: one worker subprocess per run, the table


@dataclass(slots=True, kw_only=True)
class Run:
    procs: int
    variant: str
    rep: int
    result: dict[str, Any]

    @property
    def extra_cpu_s(self) -> float:
        q, v = self.result["quiet"], self.result["violation"]
        return float(v["cpu_s"] - q["cpu_s"] * v["seconds"] / q["seconds"])

    @property
    def quiet_cpu_s(self) -> float:
        q, v = self.result["quiet"], self.result["violation"]
        return float(q["cpu_s"] * v["seconds"] / q["seconds"])


def _variants(specs: Sequence[str]) -> list[tuple[str, Path]]:
    out = []
    for spec in specs or [f"current={REPO}"]:
        label, _, path = spec.rpartition("=")
        src = Path(path).resolve()
        if not (src / "gpuguard" / "__init__.py").is_file():
            raise SystemExit(f"--gpuguard-src {spec}: no gpuguard package in {src}")
        out.append((label or src.name, src))
    return out


def _spread(values: Sequence[float], fmt: str) -> str:
    mid = format(statistics.median(values), fmt)
    if len(values) == 1:
        return mid
    return f"{mid} ({format(min(values), fmt)}–{format(max(values), fmt)})"


def table(runs: Sequence[Run]) -> str:
    lines = [
        "| procs | variant | runs | violation CPU-s | quiet CPU-s | listings during the violation "
        "| PIDs attributed | cycles | fast reader CPU-s in the window | window s "
        "| SIGTERM / SIGKILL at s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    keys = list(dict.fromkeys((r.procs, r.variant) for r in runs))
    for procs, variant in keys:
        rs = [
            r for r in runs if (r.procs, r.variant) == (procs, variant) and "violation" in r.result
        ]
        if not rs:
            continue
        v = [r.result["violation"] for r in rs]

        def at(r: Run, sig: str) -> float:
            return min((s["at"] for s in r.result["signals"] if s["signal"] == sig), default=-1)

        lines.append(
            f"| {procs} | {variant} | {len(rs)} | {_spread([r.extra_cpu_s for r in rs], '.2f')} "
            f"| {_spread([r.quiet_cpu_s for r in rs], '.2f')} "
            f"| {_spread([x['listings'] for x in v], '.0f')} "
            f"| {_spread([x['attributions'] for x in v], '.0f')} "
            f"| {_spread([x['cycles'] for x in v], '.0f')} "
            f"| {_spread([x['fast_reader_cpu_s'] for x in v], '.2f')} "
            f"| {_spread([x['seconds'] for x in v], '.1f')} "
            f"| {statistics.median(at(r, 'SIGTERM') for r in rs):.2f} / "
            f"{statistics.median(at(r, 'SIGKILL') for r in rs):.2f} |"
        )
    return "\n".join(lines)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="violation_cost.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--procs", default="100,1100", help="GPU processes on the GPU, comma-separated"
    )
    parser.add_argument("--pods", type=int, default=20, help="bystander pods (default 20)")
    parser.add_argument(
        "--gpuguard-src",
        action="append",
        default=[],
        metavar="[LABEL=]DIR",
        help="a source tree holding gpuguard/ (repeatable; default: current=this checkout)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs per procs and tree")
    parser.add_argument(
        "--grace", type=float, help="grace_seconds (default: gpuguard.config's, 10)"
    )
    parser.add_argument(
        "--termination-timeout",
        type=float,
        help="termination_timeout_seconds (default: gpuguard.config's, 10)",
    )
    parser.add_argument("--warmup-seconds", type=float, default=3.0)
    parser.add_argument(
        "--slack-seconds",
        type=float,
        default=15.0,
        help="how long past grace + timeout the offender may live before the run fails",
    )
    parser.add_argument(
        "--after-seconds", type=float, default=1.0, help="enforcer kept running after the kill"
    )
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def worker_command() -> list[str]:
    """This module as a worker: ``python -P -m benchmarks.violation_cost`` (``-P``: neither the
    working directory nor the script's folder goes first on its path, so ``worker_env`` decides
    where gpuguard comes from)."""
    return [sys.executable, "-P", "-m", "benchmarks.violation_cost"]


def worker_env(src: Path) -> dict[str, str]:
    """A worker's environment: ``src`` first on ``PYTHONPATH`` (its gpuguard, the tree being
    measured), then this checkout (the benchmark and its rigs)."""
    return os.environ | {"PYTHONPATH": os.pathsep.join([str(src), str(REPO)])}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if os.geteuid() != 0:
        print("needs root (builds cgroups)", file=sys.stderr)
        return 2
    if args.worker:
        args.procs = int(args.procs)
        out = worker(args)
        args.result.write_text(json.dumps(out, indent=1))
        return 0
    if not STUB_LIB.is_file():
        print(f"{STUB_LIB} is missing: make nvml-stub", file=sys.stderr)
        return 2
    variants = _variants(args.gpuguard_src)
    levels = [int(x) for x in args.procs.split(",") if x.strip()]
    load = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(machine_line())
    runs: list[Run] = []
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gg-violation-runs-") as tmp:
        for rep in range(args.repeat):
            for procs in levels:
                for label, src in variants:  # interleaved, so a load change hits both
                    result_file = Path(tmp) / f"{procs}-{label}-{rep}.json"
                    cmd = [*worker_command(), "--worker",
                           "--gpuguard-src", str(src), "--procs", str(procs),
                           "--pods", str(args.pods), "--result", str(result_file),
                           "--warmup-seconds", str(args.warmup_seconds),
                           "--slack-seconds", str(args.slack_seconds),
                           "--after-seconds", str(args.after_seconds)]  # fmt: skip
                    if args.grace is not None:
                        cmd += ["--grace", str(args.grace)]
                    if args.termination_timeout is not None:
                        cmd += ["--termination-timeout", str(args.termination_timeout)]
                    print(f"[run {rep + 1}/{args.repeat}] {procs} procs, {label} ({src})",
                          flush=True)  # fmt: skip
                    done = subprocess.run(
                        cmd, check=False, cwd=tempfile.gettempdir(), env=worker_env(src)
                    )
                    if done.returncode != 0 or not result_file.exists():
                        problems.append(f"{procs} procs, {label}: worker exit {done.returncode}")
                        continue
                    result = json.loads(result_file.read_text())
                    run = Run(procs=procs, variant=label, rep=rep, result=result)
                    runs.append(run)
                    if result.get("problem"):
                        problems.append(f"{procs} procs, {label}: {result['problem']}")
                    if not result["offender_stopped"]:
                        problems.append(f"{procs} procs, {label}: offender not stopped")
                    problems += [f"{procs} procs, {label}: {w}" for w in result["wrong_signals"]]
                    if "violation" in result:
                        v, built = result["violation"], result.get("built", {})
                        print(
                            f"  violation {run.extra_cpu_s:.2f} CPU-s over quiet, "
                            f"{v['listings']} listings; resolver "
                            f"{'pinned' if built.get('pins') else 'unpinned'} "
                            f"({built.get('pinned_at_end', 0)} pins at the end), fast reads "
                            f"{built.get('fast_reads', '?')}",
                            flush=True,
                        )
    print()
    print(table(runs))
    print(
        "\nviolation CPU-s: the worker's CPU from the crossing to the offender's death minus the "
        "quiet window's, scaled to the same length (quiet CPU-s); medians (min–max)."
    )
    for label, _src in variants:
        built = next((r.result.get("built") for r in runs if r.variant == label), None) or {}
        print(
            f"{label}: resolver {'pinned' if built.get('pins') else 'unpinned'} "
            f"(gpuguard.app.build_resolver), fast reads {built.get('fast_reads', '?')} "
            "(gpuguard.app.build_sampler)"
        )
    end_load = os.getloadavg()
    print(f"load average before {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, "
          f"after {end_load[0]:.2f} {end_load[1]:.2f} {end_load[2]:.2f}")  # fmt: skip
    for p in problems:
        print(f"- PROBLEM {p}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "provenance": header(),
                    "started": started,
                    "load_before": load,
                    "load_after": end_load,
                    "cpus": os.cpu_count(),
                    "variants": {label: str(src) for label, src in variants},
                    "runs": [
                        asdict(r) | {"extra_cpu_s": r.extra_cpu_s, "quiet_cpu_s": r.quiet_cpu_s}
                        for r in runs
                    ],
                    "problems": problems,
                },
                indent=1,
            )
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
