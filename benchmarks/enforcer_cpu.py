"""CPU per enforcement cycle of the real enforcer, phase by phase, on the NVML stand-in.

Everything but the GPU is real: ``NvmlGpuSource`` over the C stand-in, ``ProcfsProcessResolver``
built as ``gpuguard enforce`` builds it (``gpuguard.app.build_resolver(settings,
pin_processes=True)``: the ``holds_gpu`` fd check and the process pins) over real processes
placed in real kubepods cgroups (v2),
``FilePodDirectory`` over a pods file, ``decide()``, the ``PidfdKiller`` (no one is over its limit
here, so nothing is signalled) and the Prometheus collector. Prints CPU ms per cycle for the
whole cycle and for each phase, for a given number of GPUs and processes, and the process's own
footprint through psutil: resident memory after the cycles, and open file descriptors after
the warm-up and after the cycles (a descriptor leaked per cycle shows as growth: pidfds, /proc
directory fds and NVML handles are all descriptors).

The enforcer gets gpuguard's shipped default ``enforcement.poll_interval_seconds`` (read from
``gpuguard.config.EnforcementSettings``) unless ``--poll-interval`` overrides it; the cycles are
driven back to back, so the interval changes no figure per cycle, only the share of a core the
printed "% of a core" column derives from it (one cycle per poll interval). The value used and
where it came from are printed, and so is the resolver (its pins). Without the fast path
(``ChangeDrivenSampler``) every cycle is a full listing, as with ``fast_interval_seconds = 0``;
so the native quiet gate, which only acts between the fast path's reads, is not exercised.

Needs root (cgroups). Run:

    make -C tests/nvml_stub
    sudo .venv/bin/python benchmarks/enforcer_cpu.py --gpus 1,8 --procs 4,100 [--profile] \
        [--poll-interval SECONDS]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import resource
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil
from prometheus_client import CollectorRegistry

from benchmarks.harness import (
    STUB_LIB,
    gpu_device_node,
    machine_line,
    node_container,
    stub_device,
    stub_scenario,
    stub_uuid,
)
from gpuguard.adapters.clock import SystemClock
from gpuguard.adapters.metrics import PrometheusRecorder, SnapshotCollector
from gpuguard.adapters.nvml import NvmlGpuSource
from gpuguard.adapters.podfile import FilePodDirectory
from gpuguard.adapters.procfs import ProcfsProcessResolver
from gpuguard.adapters.signals import PidfdKiller
from gpuguard.app import build_resolver
from gpuguard.config import EnforcementSettings, load_settings
from gpuguard.core.model import EnforcementPolicy, Mode
from gpuguard.core.policy import EnforcerState, decide
from gpuguard.runtime.enforcer import Enforcer
from tests.kernel.cgroups import CgroupTree, fake_container_id

DEFAULT_POLL_INTERVAL_SECONDS = EnforcementSettings().poll_interval_seconds
"""gpuguard's shipped default, from its config defaults (never a copy of the number)."""


class _NoEvents:
    def post(self, event: object) -> None:
        return None


def shipped_resolver() -> ProcfsProcessResolver:
    """The resolver ``gpuguard enforce`` runs (``gpuguard/app.py``): the default settings'
    ``/proc``, the ``holds_gpu`` fd check, the process pins."""
    return build_resolver(load_settings(environ={}, uses_api_server=False), pin_processes=True)


def open_file_limit() -> int:
    """This process's soft ``RLIMIT_NOFILE`` (the resolver pins at most a quarter of it)."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


HOLDER = "import os, sys, time; fd = os.open(sys.argv[1], os.O_PATH); time.sleep(600)"


def run(
    gpus: int, procs: int, cycles: int, profile: bool, poll_interval: float
) -> tuple[dict[str, float], dict[str, float]]:
    """CPU seconds per call by phase, and the process's footprint (``rss MiB``, ``fds`` after
    the warm-up, ``fds grown`` over the measured cycles)."""
    work = Path(tempfile.mkdtemp(prefix="gg-bench-"))
    node = gpu_device_node(work / "nvidia0")
    with CgroupTree() as tree:
        pods: list[dict[str, object]] = []
        scenario_procs: dict[int, list[tuple[int, int]]] = {g: [] for g in range(gpus)}
        for i in range(procs):
            pod_uid, cid = str(uuid.uuid4()), fake_container_id(i)
            cg = node_container(tree, pod_uid=pod_uid, container_id=cid)
            # Holds a /dev/nvidia0 look-alike (char 195:0, O_PATH) as a CUDA process would.
            p = tree.spawn([sys.executable, "-c", HOLDER, str(node)], cgroups=[cg])
            scenario_procs[i % gpus].append((p.pid, 2**30))
            pods.append(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {
                        "name": f"p{i}",
                        "namespace": "bench",
                        "uid": pod_uid,
                        "annotations": {"gpuguard.io/gpu-memory-limit": "8Gi"},
                    },
                    "spec": {"nodeName": "bench"},
                    "status": {
                        "containerStatuses": [{"name": "c", "containerID": f"containerd://{cid}"}]
                    },
                }
            )
        scenario = stub_scenario(
            [stub_device(uuid=stub_uuid(g), processes=scenario_procs[g]) for g in range(gpus)]
        )
        time.sleep(1.0)  # let every holder open its device node before the first cycle
        (work / "scenario.json").write_text(json.dumps(scenario))
        (work / "pods.json").write_text(json.dumps({"kind": "List", "items": pods}))
        os.environ["NVML_STUB_SCENARIO"] = str(work / "scenario.json")
        clock = SystemClock()
        gpu = NvmlGpuSource(clock=clock.monotonic, library_path=STUB_LIB)
        gpu.acquire()
        resolver = shipped_resolver()
        directory = FilePodDirectory(work / "pods.json", node_name="bench", clock=clock)
        # Read the pods file (and watch it) as `gpuguard enforce` does: an unstarted directory
        # is never synced, and decide() refuses every cycle as pod_cache_unsynced.
        directory.start()
        registry = CollectorRegistry()
        collector = SnapshotCollector(hostname="bench")
        registry.register(collector)
        policy = EnforcementPolicy(mode=Mode.ENFORCE, staleness_seconds=30.0)
        enforcer = Enforcer(
            gpu=gpu,
            resolver=resolver,
            pods=directory,
            killer=PidfdKiller(cgroup_root=Path("/sys/fs/cgroup"), proc_root=Path("/proc")),
            events=_NoEvents(),
            recorder=PrometheusRecorder(registry),
            publisher=collector,
            clock=clock,
            policy=policy,
            poll_interval_seconds=poll_interval,
        )

        me = psutil.Process()
        fds_warm = fds_end = 0

        async def cycles_() -> float:
            # Both fd counts inside the loop: its own selector and self-pipe close with it.
            nonlocal fds_warm, fds_end
            for _ in range(5):
                await enforcer.cycle()
            fds_warm = me.num_fds()
            start = time.process_time()
            for _ in range(cycles):
                await enforcer.cycle()
            seconds = time.process_time() - start
            fds_end = me.num_fds()
            return seconds / cycles

        prof = cProfile.Profile() if profile else None
        if prof:
            prof.enable()
        per_cycle = asyncio.run(cycles_())
        rss_mib = me.memory_info().rss / 2**20
        fds_grown = fds_end - fds_warm
        if prof:
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(25)

        # Phases, each timed alone on the same inputs.
        def timed(fn: Callable[[], object]) -> float:
            start = time.process_time()
            for _ in range(cycles):
                fn()
            return (time.process_time() - start) / cycles

        sample = gpu.sample()
        pids = sorted({p.pid for p in sample.processes})
        attributions = {pid: resolver.attribute(pid) for pid in pids}
        snap = directory.snapshot()
        state = EnforcerState()
        result = {
            "cycle": per_cycle,
            "nvml sample": timed(gpu.sample),
            "attribute all": timed(lambda: [resolver.attribute(pid) for pid in pids]),
            "pod snapshot": timed(directory.snapshot),
            "decide": timed(
                lambda: decide(
                    sample=sample,
                    attributions=attributions,
                    pods=snap,
                    node=directory.node(),
                    policy=policy,
                    state=state,
                    now=clock.monotonic(),
                )
            ),
            "scrape /metrics": timed(lambda: list(registry.collect())),
        }
        footprint = {"rss MiB": rss_mib, "fds": float(fds_warm), "fds grown": float(fds_grown)}
        footprint["pinned"] = float(resolver.pinned)
        directory.stop()
        resolver.close()
        gpu.close()
    return result, footprint


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpus", default="1,8")
    parser.add_argument("--procs", default="4,100")
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--profile", action="store_true", help="cProfile the cycles")
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the enforcer's poll interval (default: gpuguard's shipped default, "
        f"{DEFAULT_POLL_INTERVAL_SECONDS:g} s)",
    )
    args = parser.parse_args()
    if args.poll_interval is not None and args.poll_interval <= 0:
        parser.error("--poll-interval must be above 0")
    poll = DEFAULT_POLL_INTERVAL_SECONDS if args.poll_interval is None else args.poll_interval
    source = "gpuguard's default" if args.poll_interval is None else "--poll-interval"
    if os.geteuid() != 0:
        print("needs root (builds cgroups)", file=sys.stderr)
        return 2
    from gpuguard import logs

    logs.configure(level="warning", json=False)
    print(machine_line())
    print(f"# poll interval {poll:g} s ({source}); fast path off (a full listing every cycle)")
    print(
        "# resolver: ProcfsProcessResolver from gpuguard.app.build_resolver(pin_processes=True), "
        f"as gpuguard enforce builds it (RLIMIT_NOFILE soft {open_file_limit()}: up to a quarter "
        "of it, at most 4096, pinned); fast reads: none (no quiet "
        "gate: it acts only between the fast path's reads)"
    )
    print(
        "| GPUs | procs | cycle | nvml sample | attribute all | pod snapshot | decide | scrape "
        "| % of a core | RSS MiB | fds | fds grown |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    pinned: list[str] = []
    for g in (int(x) for x in args.gpus.split(",")):
        for n in (int(x) for x in args.procs.split(",")):
            r, own = run(g, n, args.cycles, args.profile, poll)
            ms = {k: f"{v * 1000:.3f}" for k, v in r.items()}
            print(
                f"| {g} | {n} | {ms['cycle']} | {ms['nvml sample']} | {ms['attribute all']} | "
                f"{ms['pod snapshot']} | {ms['decide']} | {ms['scrape /metrics']} "
                f"| {r['cycle'] / poll * 100:.2f} | {own['rss MiB']:.1f} | {own['fds']:.0f} "
                f"| {own['fds grown']:+.0f} |"
            )
            pinned.append(f"{g}x{n}: {own['pinned']:.0f}")
    print("CPU ms per call (time.process_time), the cycle includes asyncio.to_thread hops.")
    print(f"% of a core: one cycle per poll interval ({poll:g} s), without the scrape.")
    print("RSS and fds of this process (psutil), which runs the enforcer and its adapters.")
    print(f"Processes pinned after the cycles (GPUs x procs): {', '.join(pinned)}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
