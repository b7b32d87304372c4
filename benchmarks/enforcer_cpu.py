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
where it came from are printed, and so is the resolver (its pins). Each cycle is one turn of
the enforcer's loop (``Enforcer.step``: the sampler's read, the listing, the attribution on one
thread hop, then the cycle), poll-only with every device listed at every turn (a listing age
bound of 0: the turns come back to back, not a poll interval apart), as each poll interval's
listing is with ``fast_interval_seconds = 0``; so the native quiet gate, which only acts
between the fast path's reads, is not exercised.

Each configuration is measured twice, side by side on the same processes and pods: without
the kubelet's pod resources (every allocation unknown, as with ``node.pod_resources_socket =
""``) and with them. For the second, a stand-in kubelet (``benchmarks/podresources_kubelet.py``:
``rigs/podresources.py``'s real gRPC server, in a process of its own so its CPU is not
counted) answers ``List`` for every pod of the scenario (each pod its GPU as a time-sliced
replica ``<uuid>::<k>`` of ``nvidia.com/gpu``, and two non-GPU resources; a few pods with no
device besides) and the real ``PodResourcesReader`` reads it through ``AllocationReads`` on its
own thread, built as ``gpuguard enforce`` builds it (``gpuguard.app.build_allocation_reads``),
handed to the second ``Enforcer`` (``allocations=``). The two enforcers run in alternating
blocks of cycles, so a change of the shared machine's load falls on both. The reads run on
their thread every ``READ_INTERVAL_SECONDS``, not once a cycle: their CPU is taken out of the
cycles' (the thread's own CPU clock) and one read's CPU, measured over ``--reads`` reads,
is added back as ``read × poll interval / READ_INTERVAL_SECONDS`` per cycle, so cycles driven
back to back neither hide nor multiply it. ``--control`` runs the second enforcer without the
reads as well: its "cycle with" less the reads' share then shows how far two like enforcers'
cycles differ on this machine, the noise under the with/without ratio.

Needs root (cgroups). Run:

    make -C tests/nvml_stub
    sudo .venv/bin/python -m benchmarks.enforcer_cpu --gpus 1,8 --procs 4,100 [--profile] \
        [--poll-interval SECONDS] [--reads N] [--control]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import resource
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
from prometheus_client import CollectorRegistry

from gpuguard.adapters.clock import SystemClock
from gpuguard.adapters.killer import PidfdKiller
from gpuguard.adapters.metrics import PrometheusRecorder, SnapshotCollector
from gpuguard.adapters.nvml import NvmlGpuSource
from gpuguard.adapters.podfile import FilePodDirectory
from gpuguard.adapters.podresources import PodResourcesReader
from gpuguard.adapters.procfs import ProcfsProcessResolver
from gpuguard.app import build_allocation_reads, build_resolver
from gpuguard.config import EnforcementSettings, load_settings
from gpuguard.core.allocation import (
    UNKNOWN_ALLOCATIONS,
    Allocated,
    NodeAllocations,
    allocation_on,
)
from gpuguard.core.model import EnforcementPolicy, Mode
from gpuguard.core.policy import EnforcerState, decide
from gpuguard.runtime.allocations import READ_INTERVAL_SECONDS, AllocationReads
from gpuguard.runtime.enforcer import Enforcer
from gpuguard.runtime.sampling import ChangeDrivenSampler
from rigs.cgroups import CgroupTree, fake_container_id, node_container
from rigs.measure import machine_line
from rigs.nvml_stub import STUB_LIB, stub_device, stub_scenario, stub_uuid
from rigs.processes import gpu_device_node, terminate

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

KUBELET = [sys.executable, "-m", "benchmarks.podresources_kubelet"]
REPO = Path(__file__).resolve().parents[1]
BLOCK_CYCLES = 25
"""Cycles an enforcer runs before the other runs as many (the two alternate, in turn first)."""
OTHER_PODS = 8
"""Pods the stand-in kubelet lists besides the scenario's, with no device (a node's own)."""


def kubelet_pods(gpu_pods: list[tuple[str, str]]) -> list[dict[str, object]]:
    """The kubelet's answer for the scenario: each pod ``(name, GPU UUID)`` its GPU as the
    time-sliced replica ``<uuid>::<k>`` of ``nvidia.com/gpu`` (k counts the GPU's pods) plus two
    non-GPU resources, and ``OTHER_PODS`` pods of no device (``kube-system``)."""
    pods: list[dict[str, object]] = []
    replicas: dict[str, int] = {}
    for i, (name, gpu_uuid) in enumerate(gpu_pods):
        k = replicas[gpu_uuid] = replicas.get(gpu_uuid, -1) + 1
        devices = [
            ["nvidia.com/gpu", [f"{gpu_uuid}::{k}"]],
            ["rdma/hca_shared_devices_a", [f"hca{i % 4}"]],
            ["intel.com/sriov_netdevice", [f"0000:3b:02.{i % 8}"]],
        ]
        pods.append(
            {"namespace": "bench", "name": name, "containers": [{"name": "c", "devices": devices}]}
        )
    pods += [
        {
            "namespace": "kube-system",
            "name": f"node-pod-{i}",
            "containers": [{"name": "c", "devices": []}],
        }
        for i in range(OTHER_PODS)
    ]
    return pods


def start_kubelet(
    work: Path, pods: list[dict[str, object]]
) -> tuple[subprocess.Popen[bytes], Path]:
    """The stand-in kubelet in its own process, serving ``pods`` on ``work/kubelet.sock``."""
    socket = work / "kubelet.sock"
    (work / "kubelet-pods.json").write_text(json.dumps(pods))
    child = subprocess.Popen([*KUBELET, str(socket), str(work / "kubelet-pods.json")], cwd=REPO)
    deadline = time.monotonic() + 30
    while not socket.exists():
        if child.poll() is not None or time.monotonic() > deadline:
            terminate(child)
            raise SystemExit(f"the stand-in kubelet did not serve {socket}")
        time.sleep(0.05)
    return child, socket


def first_answer(reads: AllocationReads) -> NodeAllocations:
    """The reads' first known answer (the thread reads at once when started)."""
    deadline = time.monotonic() + 30
    while (latest := reads.latest()).unknown is not None:
        if time.monotonic() > deadline:
            raise SystemExit(f"the pod-resources reads stay unknown: {latest.unknown}")
        time.sleep(0.02)
    return latest


def thread_cpu(name: str) -> Callable[[], float]:
    """The CPU-time clock of the live thread called ``name`` (seconds), read from any thread."""
    [thread] = [t for t in threading.enumerate() if t.name == name]
    assert thread.ident is not None
    clock = time.pthread_getcpuclockid(thread.ident)
    return lambda: time.clock_gettime(clock)


def run(
    gpus: int,
    procs: int,
    cycles: int,
    profile: bool,
    poll_interval: float,
    reads_n: int,
    control: bool = False,
) -> tuple[dict[str, float], dict[str, float]]:
    """CPU seconds per call by phase (the cycle and decide without the kubelet's pod resources
    and ``... with`` them, one pod-resources ``read``, the ``reads share`` of a cycle), and the
    process's footprint (``rss MiB``, ``fds`` after the warm-up, ``fds grown`` over the
    measured cycles, ``pinned``, ``allocated``: pods whose GPU the answer names)."""
    work = Path(tempfile.mkdtemp(prefix="gg-bench-"))
    node = gpu_device_node(work / "nvidia0")
    with CgroupTree() as tree:
        pods: list[dict[str, object]] = []
        scenario_procs: dict[int, list[tuple[int, int]]] = {g: [] for g in range(gpus)}
        gpu_pods: list[tuple[str, str]] = []
        for i in range(procs):
            pod_uid, cid = str(uuid.uuid4()), fake_container_id(i)
            cg = node_container(tree, pod_uid=pod_uid, container_id=cid)
            # Holds a /dev/nvidia0 look-alike (char 195:0, O_PATH) as a CUDA process would.
            p = tree.spawn([sys.executable, "-c", HOLDER, str(node)], cgroups=[cg])
            scenario_procs[i % gpus].append((p.pid, 2**30))
            gpu_pods.append((f"p{i}", stub_uuid(i % gpus)))
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
        kubelet, socket = start_kubelet(work, kubelet_pods(gpu_pods))
        clock = SystemClock()
        gpu = NvmlGpuSource(clock=clock.monotonic, library_path=STUB_LIB)
        gpu.acquire()
        resolver = shipped_resolver()
        directory = FilePodDirectory(work / "pods.json", node_name="bench", clock=clock)
        # Read the pods file (and watch it) as `gpuguard enforce` does: an unstarted directory
        # is never synced, and decide() refuses every cycle as pod_cache_unsynced.
        directory.start()
        # The reads as `gpuguard enforce` builds them: the reader of node.pod_resources_socket
        # on its own thread, started.
        reads = build_allocation_reads(
            load_settings(
                environ={},
                overrides={"node.pod_resources_socket": str(socket)},
                uses_api_server=False,
            ),
            clock,
        )
        assert reads is not None
        first_answer(reads)
        reader_cpu = thread_cpu("gpuguard-podresources")
        policy = EnforcementPolicy(mode=Mode.ENFORCE, staleness_seconds=30.0)

        def enforcer(allocations: AllocationReads | None) -> tuple[Enforcer, CollectorRegistry]:
            registry = CollectorRegistry()
            collector = SnapshotCollector(hostname="bench")
            registry.register(collector)
            built = Enforcer(
                # Every device listed at every turn (turns come back to back, not a poll
                # interval apart): each cycle measured is a full one.
                sampler=ChangeDrivenSampler.polling(gpu, clock=clock.monotonic, poll_seconds=0.0),
                resolver=resolver,
                pods=directory,
                killer=PidfdKiller(cgroup_root=Path("/sys/fs/cgroup"), proc_root=Path("/proc")),
                events=_NoEvents(),
                recorder=PrometheusRecorder(registry),
                publisher=collector,
                clock=clock,
                policy=policy,
                poll_interval_seconds=poll_interval,
                allocations=allocations,
            )
            return built, registry

        # The control (--control): the second enforcer without the reads too, so "cycle with"
        # less the reads' share is the spread of two like enforcers on this machine.
        (without, registry), (with_, _) = enforcer(None), enforcer(None if control else reads)

        me = psutil.Process()
        fds_warm = fds_end = 0

        async def cycles_() -> tuple[float, float]:
            # Both fd counts inside the loop: its own selector and self-pipe close with it.
            nonlocal fds_warm, fds_end
            for _ in range(5):
                await without.step()
                await with_.step()
            fds_warm = me.num_fds()
            spent = {id(without): 0.0, id(with_): 0.0}
            done = 0
            while done < cycles:
                n = min(BLOCK_CYCLES, cycles - done)
                turn = (without, with_) if done // BLOCK_CYCLES % 2 == 0 else (with_, without)
                for one in turn:
                    # The reader thread's CPU is not the cycles': it is added back per read.
                    start, start_reads = time.process_time(), reader_cpu()
                    for _ in range(n):
                        await one.step()
                    spent[id(one)] += time.process_time() - start - (reader_cpu() - start_reads)
                done += n
            fds_end = me.num_fds()
            return spent[id(without)] / cycles, spent[id(with_)] / cycles

        prof = cProfile.Profile() if profile else None
        if prof:
            prof.enable()
        per_cycle, per_cycle_with = asyncio.run(cycles_())
        rss_mib = me.memory_info().rss / 2**20
        fds_grown = fds_end - fds_warm
        if prof:
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(25)

        # Phases, each timed alone on the same inputs.
        def timed(fn: Callable[[], object], times: int = cycles) -> float:
            start = time.process_time()
            for _ in range(times):
                fn()
            return (time.process_time() - start) / times

        sample = gpu.sample()
        pids = sorted({p.pid for p in sample.processes})
        attributions = {pid: resolver.attribute(pid) for pid in pids}
        snap = directory.snapshot()
        answer = reads.latest()

        state = EnforcerState()

        def decide_(allocations: NodeAllocations) -> object:
            return decide(
                sample=sample,
                attributions=attributions,
                pods=snap,
                node=directory.node(),
                policy=policy,
                state=state,
                now=clock.monotonic(),
                allocations=allocations,
            )

        # One read's CPU, in this thread (the stand-in kubelet's is its own process's), on a
        # reader of its own; the reads' thread is taken out as above.
        # A read's answer translates each pod when it is first looked up (decide() looks up
        # the pods with GPU memory, once per answer): the read is timed with those lookups.
        reader = PodResourcesReader(socket, clock=clock)
        looked_up = [(p.namespace, p.name) for p in snap.pods.values()]

        def read_and_look_up() -> None:
            pods = reader.read().pods
            for key in looked_up:
                pods.get(key)

        start_reads = reader_cpu()
        read = timed(read_and_look_up, reads_n) - (reader_cpu() - start_reads) / reads_n
        reader.close()
        # The answer names each scenario pod's GPU (else "with" would time unknowns only).
        devices = {str(d.uuid): d for d in sample.devices}
        by_name = {p.name: p for p in snap.pods.values()}
        allocated = sum(
            allocation_on(
                by_name[name], devices[gpu_uuid], answer, policy.limits,
                now=clock.monotonic(), max_age=policy.staleness_seconds,
            ).state
            is Allocated.YES
            for name, gpu_uuid in gpu_pods
        )  # fmt: skip
        share = read * poll_interval / READ_INTERVAL_SECONDS
        result = {
            "cycle": per_cycle,
            "nvml sample": timed(gpu.sample),
            "attribute all": timed(lambda: [resolver.attribute(pid) for pid in pids]),
            "pod snapshot": timed(directory.snapshot),
            "decide": timed(lambda: decide_(UNKNOWN_ALLOCATIONS)),
            "scrape /metrics": timed(lambda: list(registry.collect())),
            "cycle with": per_cycle_with + share,
            "decide with": timed(lambda: decide_(answer)),
            "read": read,
            "reads share": share,
        }
        footprint = {"rss MiB": rss_mib, "fds": float(fds_warm), "fds grown": float(fds_grown)}
        footprint["pinned"] = float(resolver.pinned)
        footprint["allocated"] = float(allocated)
        reads.stop()
        terminate(kubelet)
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
    parser.add_argument(
        "--reads",
        type=int,
        default=200,
        metavar="N",
        help="pod-resources reads timed for the CPU of one (default 200)",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="an A/A run: the second enforcer without the pod resources as well (the spread "
        "of two like enforcers; its table's read and decide columns are still measured)",
    )
    args = parser.parse_args()
    if args.poll_interval is not None and args.poll_interval <= 0:
        parser.error("--poll-interval must be above 0")
    if args.reads <= 0:
        parser.error("--reads must be above 0")
    poll = DEFAULT_POLL_INTERVAL_SECONDS if args.poll_interval is None else args.poll_interval
    source = "gpuguard's default" if args.poll_interval is None else "--poll-interval"
    if os.geteuid() != 0:
        print("needs root (builds cgroups)", file=sys.stderr)
        return 2
    from gpuguard import logs

    logs.configure(level="warning", json=False)
    print(machine_line())
    print(f"# poll interval {poll:g} s ({source}); poll-only, every device listed at each turn")
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
    with_rows: list[str] = []
    for g in (int(x) for x in args.gpus.split(",")):
        for n in (int(x) for x in args.procs.split(",")):
            r, own = run(g, n, args.cycles, args.profile, poll, args.reads, args.control)
            ms = {k: f"{v * 1000:.3f}" for k, v in r.items()}
            print(
                f"| {g} | {n} | {ms['cycle']} | {ms['nvml sample']} | {ms['attribute all']} | "
                f"{ms['pod snapshot']} | {ms['decide']} | {ms['scrape /metrics']} "
                f"| {r['cycle'] / poll * 100:.2f} | {own['rss MiB']:.1f} | {own['fds']:.0f} "
                f"| {own['fds grown']:+.0f} |"
            )
            pinned.append(f"{g}x{n}: {own['pinned']:.0f}")
            with_rows.append(
                f"| {g} | {n} | {ms['cycle']} | {ms['cycle with']} "
                f"| {r['cycle with'] / r['cycle']:.3f} | {ms['decide']} | {ms['decide with']} "
                f"| {ms['read']} | {ms['reads share']} | {own['allocated']:.0f}/{n} |"
            )
    print(
        "CPU ms per call (time.process_time); a cycle is one turn of the loop (Enforcer.step), "
        "its read on one asyncio.to_thread hop."
    )
    print(f"% of a core: one cycle per poll interval ({poll:g} s), without the scrape.")
    print(
        "RSS and fds of this process (psutil), which runs the enforcer and its adapters "
        "(two enforcers and the pod-resources reader: its gRPC channel and thread)."
    )
    print(f"Processes pinned after the cycles (GPUs x procs): {', '.join(pinned)}.")
    print()
    if args.control:
        print(
            "# control (--control): the second enforcer ran WITHOUT the pod resources too; "
            "its cycle less the reads' share is the spread of two like enforcers"
        )
    else:
        print("# with the kubelet's pod resources (allocations), beside the cycle above (without)")
    print(
        "| GPUs | procs | cycle without | cycle with | with / without | decide without "
        "| decide with | read | reads' share | allocated |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in with_rows:
        print(row)
    print(
        "Without: no pod-resources reader (every allocation unknown). With: a stand-in kubelet "
        "(rigs/podresources.py's gRPC server, its own process) answers for every pod, "
        "read by PodResourcesReader through AllocationReads (gpuguard.app."
        "build_allocation_reads, as gpuguard enforce builds them); allocated: pods whose GPU "
        "its answer names (allocation_on)."
    )
    print(
        f"The two enforcers ran on the same processes and pods, in alternating blocks of "
        f"{BLOCK_CYCLES} cycles; the reads' thread's own CPU is taken out of both."
    )
    print(
        f"read: CPU ms of one PodResourcesReader.read() in this process and the translation "
        f"of the answer for each pod of the scenario (done on first lookup), over {args.reads} "
        "reads (the stand-in kubelet's CPU is not counted). The reads run on their own "
        f"thread every READ_INTERVAL_SECONDS ({READ_INTERVAL_SECONDS:g} s), not per cycle: "
        f"cycle with = the cycles' CPU + reads' share, read x poll interval ({poll:g} s) / "
        f"{READ_INTERVAL_SECONDS:g} s."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
