"""A soak run: the real ``gpuguard enforce`` and ``gpuguard agent`` as
subprocesses for ``--minutes`` (default 30) against a real etcd + kube-apiserver and the NVML
stand-in, under churn. Not run in CI; ``tests/test_benchmark_soak.py`` runs it for half a minute.

What is real: etcd and kube-apiserver (``rigs/controlplane.py``, RBAC on, each gpuguard process
authenticated as its own ServiceAccount, the enforcer's and the agent's), kubepods cgroups (v2,
systemd driver, containerd names) with real processes in them, the enforcer's attribution,
pidfd signals and Events, the agent's watches and Node writes. What is simulated: the GPU
(``tests/nvml_stub``, a JSON scenario listing the live PIDs), and the kubelet (pods are created
bound to the node, their container statuses set through the status subresource, as the
integration rig does).

The churn, all at once for the whole run:

- ``--resident-pods`` × ``--procs-per-pod`` (20 × 50) long-lived GPU processes listed by NVML:
  one Python "zygote" per pod, started in the pod's container cgroup, holds a fake
  ``/dev/nvidia0`` (char 195:0, opened ``O_PATH``, as the rig's workers) and forks its
  children, which pause (memory stays low: forked, copy-on-write).
- ``--starts-per-minute`` (100) short-lived processes, forked by the zygotes of running pods,
  each alive ``--short-seconds`` (5–55 s) and listed by NVML only while alive.
- A churn pod created every ``--pod-churn-seconds`` (30), ``--churn-procs`` processes in it,
  deleted after ``--churn-pod-seconds`` (120): its processes stopped first, then the pod
  deleted through the API server and its cgroups removed.
- An offender every ``--offender-seconds`` (180): a pod over its limit (2 × 768 MiB against
  1Gi) that the enforcer must stop; it is deleted once its processes are gone.
- The agent's sharing ConfigMap edited every ``--config-seconds`` (60), alternating between two
  valid configs (``slice-4`` and ``slice-2`` for the node's rule), so its label really changes;
  each flip is timed from the edit to the Node's label.

``--accelerated`` turns the process churn up to fill the enforcer's attribution cache (an LRU of
4096 ``(pid, starttime)`` identities, as its GPU-holder cache and its process pins) in a minute
or two instead of half an hour, on a smaller node: 3000 starts a minute, each alive 1–3 s,
4 resident pods × 25 processes (each of these options, given as well, wins). The summary's
``attribution_cache`` then says when the distinct identities listed passed the cache's size and
how the enforcer's RSS moved after that: where it plateaus.

Every ``--sample-seconds`` (10), per gpuguard process: RSS (``VmRSS``), open fds, threads,
asyncio tasks (``gpuguard_asyncio_tasks`` from its ``/metrics``), CPU seconds; and the
enforcer's poll duration p99 over that window (``gpuguard_poll_duration_seconds``' bucket
deltas, interpolated as PromQL's ``histogram_quantile``). Every process the run starts records
each signal it catches (and its zygote each child's abnormal exit): a signal to anything but an
offender is a wrong signal.

Outputs in ``--out``: ``samples.csv``, ``summary.json`` (per process and quantity a
least-squares slope per hour after ``--warmup-minutes``, with the fitted start and end values),
``soak.png`` (unless ``--no-plot``; needs matplotlib: ``pip install -e '.[bench]'``), and the
two processes' JSON logs. Run as root (cgroups, ``mknod``), after ``make -C tests/nvml_stub``
and ``scripts/ensure-testbin.sh``:

    .venv/bin/python -m benchmarks.soak --minutes 30 --out soak-out

Must not: signal a process it did not start (its processes are stopped by pidfd through
``CgroupTree``; the two gpuguard processes by their PID), leave a cgroup behind, or listen on
anything but 127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import math
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuguard.core.model import ContainerCgroup
from rigs.cgroups import V2_ROOT, CgroupTree, cgroup_dir, kernel_problem, node_container
from rigs.controlplane import KubeCluster, find_binaries, put_config_map
from rigs.kubefixtures import (
    FENCE_MANIFEST,
    RBAC_MANIFEST,
    apply_manifest,
    ensure_namespace,
    pod_bound_token,
)
from rigs.nvml_stub import SCENARIO_ENV, Scenario, build_stub, stub_device, stub_scenario
from rigs.processes import (
    ZYGOTE,
    Gpuguard,
    cpu_seconds,
    free_port,
    gpu_device_node,
    gpuguard_argv,
    gpuguard_env,
    open_fds,
    parse_metrics,
    rss_bytes,
    scrape,
    start_ticks,
    threads,
)
from rigs.provenance import command, header, header_lines

REPO = Path(__file__).resolve().parents[1]

MIB = 2**20
GIB = 2**30
NODE = "soak-node"
NAMESPACE = "soak"
SA_NAMESPACE = "gpuguard"
SA_NAMES = {"enforcer": "gpuguard", "agent": "gpuguard-agent"}  # manifests/rbac.yaml
SHARING_NAME = "gpuguard-sharing"
NV_NS, DP_NAME, MIG_NAME = "gpu-operator", "nvidia-time-slicing-config", "nvidia-mig-config"
DP_LABEL = "nvidia.com/device-plugin.config"
INSTANCE = "node.kubernetes.io/instance-type"
GPU_UUID = "GPU-50a50a50-0000-4000-8000-000000000001"
GPU_TOTAL_BYTES = 141 * GIB
RESIDENT_BYTES = 8 * MIB
SHORT_BYTES = 32 * MIB
OFFENDER_BYTES = 768 * MIB
POD_LIMIT = "4Gi"
OFFENDER_LIMIT = "1Gi"
PROCESSES = ("enforcer", "agent")
QUANTITIES = ("rss_mib", "fds", "threads", "asyncio_tasks", "cpu_percent")
MATPLOTLIB_FIX = (
    "matplotlib is missing: install the bench extra (.venv/bin/pip install -e '.[bench]') "
    "or pass --no-plot"
)


def sharing_document(profile: str) -> dict[str, Any]:
    return {
        "version": "v1",
        "devicePluginConfig": {"namespace": NV_NS, "name": DP_NAME},
        "migConfig": {"namespace": NV_NS, "name": MIG_NAME, "key": "config.yaml"},
        "rules": [
            {
                "name": "soak",
                "nodeSelector": {"matchLabels": {INSTANCE: "soak.large"}},
                "timeSlicing": profile,
            }
        ],
    }


def device_plugin_profiles() -> dict[str, str]:
    return {
        name: json.dumps(
            {
                "version": "v1",
                "sharing": {
                    "timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": n}]}
                },
            }
        )
        for name, n in (("slice-2", 2), ("slice-4", 4))
    }


MIG_PARTED = json.dumps(
    {"version": "v1", "mig-configs": {"all-disabled": [{"devices": "all", "mig-enabled": False}]}}
)


# ---------------------------------------------------------------------------------------------
# /proc and /metrics


def process_figures(pid: int) -> dict[str, float]:
    """RSS (MiB), open fds, threads and CPU seconds of a live process, from ``/proc``."""
    rss, fds, thr, cpu = rss_bytes(pid), open_fds(pid), threads(pid), cpu_seconds(pid)
    if rss is None or fds is None or thr is None or cpu is None:
        raise ProcessLookupError(f"gpuguard process {pid} is gone")
    return {"rss_mib": rss / 2**20, "fds": float(fds), "threads": float(thr), "cpu_seconds": cpu}


def scraped(port: int) -> dict[str, float]:
    """``/metrics`` as ``{'name': value}`` for the unlabelled samples, ``{'name{le}': value}``
    for ``gpuguard_poll_duration_seconds``' buckets."""
    out: dict[str, float] = {}
    for name, labels, value in parse_metrics(scrape(port)):
        if not labels:
            out[name] = value
        elif name == "gpuguard_poll_duration_seconds_bucket":
            out[f"{name}{{{labels['le']}}}"] = value
    return out


def poll_buckets(metrics: Mapping[str, float]) -> list[tuple[float, float]]:
    """``gpuguard_poll_duration_seconds`` cumulative buckets as ``(le, count)``, ``+Inf`` last."""
    prefix = "gpuguard_poll_duration_seconds_bucket{"
    return sorted(
        (float(key[len(prefix) : -1]), value)
        for key, value in metrics.items()
        if key.startswith(prefix)
    )


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float:
    """PromQL's ``histogram_quantile`` over cumulative ``(le, count)`` buckets; NaN if empty."""
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower_bound
            if count == lower_count:
                return le
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = le, count
    return buckets[-2][0] if len(buckets) > 1 else math.nan


def fit(times_h: Sequence[float], values: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``(slope, intercept)`` of ``values`` over ``times_h``."""
    n = len(times_h)
    if n < 2:
        return math.nan, values[0] if values else math.nan
    mt, mv = sum(times_h) / n, sum(values) / n
    var = sum((t - mt) ** 2 for t in times_h)
    if var == 0:
        return math.nan, mv
    slope = sum((t - mt) * (v - mv) for t, v in zip(times_h, values, strict=True)) / var
    return slope, mv - slope * mt


# ---------------------------------------------------------------------------------------------
# The node: pods, their processes, and the NVML scenario


@dataclass(slots=True, kw_only=True)
class Listed:
    """A process NVML lists while it is alive (same PID, same start time)."""

    pid: int
    start: int
    used_bytes: int
    short: bool


@dataclass(slots=True, kw_only=True)
class Pod:
    kind: str  # resident | churn | offender
    name: str
    uid: str
    container_id: str
    cgroup: ContainerCgroup
    zygote: subprocess.Popen[bytes]
    record: Path
    created: float
    created_wall: float
    residents: list[int] = field(default_factory=list)

    def lines(self) -> list[list[str]]:
        try:
            return [ln.split() for ln in self.record.read_text().splitlines()]
        except FileNotFoundError:
            return []


class Node:
    """The simulated GPU node's processes and the scenario the stand-in reads (rewritten by a
    thread whenever the set of live listed processes changes)."""

    def __init__(self, scenario: Path) -> None:
        self.scenario = Scenario(scenario)
        self.lock = threading.Lock()
        self.listed: dict[int, Listed] = {}
        self.identities = 0
        """Distinct ``(pid, starttime)`` listed so far: what the enforcer's attribution cache
        (an LRU of ``ProcfsProcessResolver``'s ``cache_size``, 4096) fills up with."""
        self._written = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drive, name="soak-nvml", daemon=True)
        self.write()
        self._thread.start()

    def add(self, pid: int, used_bytes: int, *, short: bool) -> None:
        start = start_ticks(pid)
        if start is None:
            return
        with self.lock:
            self.listed[pid] = Listed(pid=pid, start=start, used_bytes=used_bytes, short=short)
            self.identities += 1
        self.write()

    def drop(self, pids: Sequence[int]) -> None:
        with self.lock:
            for pid in pids:
                self.listed.pop(pid, None)
        self.write()

    def count(self) -> int:
        with self.lock:
            return len(self.listed)

    def write(self) -> None:
        with self.lock:
            procs = sorted((p.pid, p.used_bytes) for p in self.listed.values())
            device = stub_device(
                uuid=GPU_UUID, total_bytes=GPU_TOTAL_BYTES, processes=procs, mig_mode=None
            )
            doc = stub_scenario([device], driver_version="580.95.05")
            text = json.dumps(doc, sort_keys=True)
            if text == self._written:
                return
            self.scenario.write(doc)
            self._written = text

    def _drive(self) -> None:
        # The "driver": a process that exited frees its memory at the next listing. Short-lived
        # ones are checked every 0.1 s, the long-lived ones every 2 s (1000 reads of /proc).
        tick = 0
        while not self._stop.wait(0.1):
            tick += 1
            with self.lock:
                check = [p for p in self.listed.values() if p.short or tick % 20 == 0]
            gone = [p.pid for p in check if start_ticks(p.pid) != p.start]
            if gone:
                self.drop(gone)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


MAX_STARTS_PER_TURN = 10
"""Short-lived processes started in one turn of the churn loop (50 turns a second at most) when
it is behind: enough for ``--accelerated``'s 50 a second on a loaded machine."""
ATTRIBUTION_CACHE = 4096
"""The enforcer's attribution cache, in identities (``ProcfsProcessResolver``'s ``cache_size``,
which its GPU-holder cache and its process pins share)."""


# ---------------------------------------------------------------------------------------------
# The gpuguard subprocesses


def start_gpuguard(
    name: str, argv: Sequence[str], *, out: Path, env: Mapping[str, str], port: int
) -> Gpuguard:
    """``gpuguard ARGV`` logging to ``OUT/NAME.log``, once it serves ``gpuguard_asyncio_tasks``."""
    log = out / f"{name}.log"
    log.unlink(missing_ok=True)  # an --out reused: only this run's log
    running = Gpuguard(name=f"gpuguard {name}", argv=gpuguard_argv(*argv), env=dict(env),
                       log=log, port=port)  # fmt: skip
    running.launch()
    try:
        running.wait_ready(metric="gpuguard_asyncio_tasks")
    except (RuntimeError, TimeoutError) as e:
        running.stop()
        raise SystemExit(str(e)) from None
    return running


# ---------------------------------------------------------------------------------------------
# The run


@dataclass(slots=True)
class Tally:
    process_starts: int = 0
    pods_created: int = 0
    pods_deleted: int = 0
    config_edits: int = 0
    label_flips: list[float] = field(default_factory=list)
    label_missed: int = 0
    offenders: list[dict[str, Any]] = field(default_factory=list)
    churn_seconds: float = 0.0


class Soak:
    def __init__(self, args: argparse.Namespace, out: Path, work: Path) -> None:
        self.args = args
        self.out = out
        self.work = work
        self.rng = random.Random(args.seed)
        self.tally = Tally()
        self.pods: dict[str, Pod] = {}
        self.gone: list[Pod] = []
        self.cluster: KubeCluster | None = None
        self.tree = CgroupTree(f"gpuguard-soak-{os.getpid()}")
        self.node = Node(work / "scenario.json")
        self.device = gpu_device_node(work / "nvidia0")
        self.serial = 0
        self.last_cpu: dict[str, tuple[float, float]] = {}

    # -- cluster objects -----------------------------------------------------------------------

    def put_config_map(self, ns: str, name: str, data: Mapping[str, str]) -> None:
        assert self.cluster is not None
        put_config_map(self.cluster, ns, name, data)

    def put_sharing(self, profile: str) -> None:
        self.put_config_map(
            SA_NAMESPACE, SHARING_NAME, {"sharing.yaml": json.dumps(sharing_document(profile))}
        )

    def node_label(self) -> str | None:
        assert self.cluster is not None
        got = self.cluster.admin_request("GET", f"/api/v1/nodes/{NODE}")
        value = (got["metadata"].get("labels") or {}).get(DP_LABEL)
        return None if value is None else str(value)

    def setup_cluster(self) -> tuple[Path, Path]:
        """The cluster, RBAC, NVIDIA's ConfigMaps, the node and the first sharing config;
        returns the enforcer's and the agent's kubeconfigs (each its own ServiceAccount)."""
        binaries, why = find_binaries()
        if why is not None:
            raise SystemExit(why)
        (self.work / "kube").mkdir()
        self.cluster = KubeCluster(self.work / "kube", binaries)
        self.cluster.start()
        for ns in (SA_NAMESPACE, NV_NS, NAMESPACE):
            ensure_namespace(self.cluster, ns)
        apply_manifest(self.cluster, RBAC_MANIFEST)
        # The agent writes only once its admission fence is in force, and with the token the
        # kubelet projects for its pod (it names the node, which the fence reads).
        apply_manifest(self.cluster, FENCE_MANIFEST)
        self.put_config_map(NV_NS, DP_NAME, device_plugin_profiles())
        self.put_config_map(NV_NS, MIG_NAME, {"config.yaml": MIG_PARTED})
        self.cluster.create_node(NODE, {INSTANCE: "soak.large"})
        self.put_sharing("slice-4")
        seconds = int(self.args.minutes * 60) + 3600
        configs = []
        for who in PROCESSES:
            token = pod_bound_token(
                self.cluster, SA_NAMESPACE, SA_NAMES[who], NODE, seconds=seconds
            )
            configs.append(self.cluster.kubeconfig_for_token(token, name=f"{who}-gpuguard"))
        return configs[0], configs[1]

    # -- pods ------------------------------------------------------------------------------------

    def create_pod(self, kind: str, *, processes: int, limit: str) -> Pod:
        assert self.cluster is not None
        self.serial += 1
        name = f"{kind}-{self.serial:05d}"
        created = self.cluster.create_pod(
            NAMESPACE, name, node=NODE, annotations={"gpuguard.io/gpu-memory-limit": limit}
        )
        uid = created["metadata"]["uid"]
        cid = uuid.uuid4().hex + uuid.uuid4().hex
        self.cluster.set_container_statuses(
            NAMESPACE, name, [{"name": "main", "containerID": f"containerd://{cid}"}]
        )
        cg = node_container(self.tree, pod_uid=uid, container_id=cid)
        record = self.work / f"{name}.record"
        zygote = self.tree.spawn(
            [sys.executable, "-S", "-c", ZYGOTE, str(record), str(self.device), str(processes)],
            cgroups=[cg],
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE,
        )
        assert zygote.stdout is not None
        ready = zygote.stdout.readline().decode().split()
        if not ready or ready[0] != "ready":
            raise RuntimeError(f"pod {name}: its zygote did not start ({ready!r})")
        pod = Pod(
            kind=kind,
            name=name,
            uid=uid,
            container_id=cid,
            cgroup=cg,
            zygote=zygote,
            record=record,
            created=time.monotonic(),
            created_wall=time.time(),
            residents=[int(p) for p in ready[1:]],
        )
        used = OFFENDER_BYTES if kind == "offender" else RESIDENT_BYTES
        for pid in pod.residents:
            self.node.add(pid, used, short=kind == "offender")
        self.pods[name] = pod
        self.tally.pods_created += 1
        return pod

    def spawn_short(self) -> None:
        """One short-lived process in a running (non-offender) pod, listed while alive."""
        running = [p for p in self.pods.values() if p.kind != "offender"]
        if not running:
            return
        pod = self.rng.choice(running)
        stdin, stdout = pod.zygote.stdin, pod.zygote.stdout
        assert stdin is not None
        assert stdout is not None
        low, high = self.args.short_seconds
        stdin.write(f"spawn {self.rng.uniform(low, high):.1f}\n".encode())
        stdin.flush()
        pid = int(stdout.readline())
        self.node.add(pid, SHORT_BYTES, short=True)
        self.tally.process_starts += 1

    def delete_pod(self, pod: Pod) -> None:
        """As the kubelet would: the container's processes stopped, then the pod deleted and
        its cgroups removed."""
        assert self.cluster is not None
        if pod.zygote.poll() is None:
            stdin = pod.zygote.stdin
            assert stdin is not None
            with contextlib.suppress(BrokenPipeError):
                stdin.write(b"quit\n")
                stdin.flush()
        with contextlib.suppress(subprocess.TimeoutExpired):
            pod.zygote.wait(timeout=10)
        for pipe in (pod.zygote.stdin, pod.zygote.stdout):
            if pipe is not None:
                pipe.close()
        directory = cgroup_dir(pod.cgroup)
        deadline = time.monotonic() + 10
        while (directory / "cgroup.procs").read_text().split() and time.monotonic() < deadline:
            time.sleep(0.05)
        with self.node.lock:
            mine = [p for p in self.node.listed if start_ticks(p) is None]
        self.node.drop(mine)
        self.cluster.delete_pod(NAMESPACE, pod.name)
        for d in (directory, directory.parent):  # the container's cgroup, then the pod's
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY while the kernel finishes the exits
                    time.sleep(0.02)
        del self.pods[pod.name]
        self.gone.append(pod)
        self.tally.pods_deleted += 1

    def reap_offenders(self, now: float) -> None:
        """An offender whose processes are all gone was stopped: delete it (and time it)."""
        for pod in [p for p in self.pods.values() if p.kind == "offender"]:
            alive = (cgroup_dir(pod.cgroup) / "cgroup.procs").read_text().split()
            if alive and now - pod.created < self.args.offender_timeout:
                continue
            signals = [ln for ln in pod.lines() if len(ln) >= 4 and ln[1] == "signal"]
            first = min((float(ln[0]) for ln in signals), default=math.nan)
            self.tally.offenders.append(
                {
                    "pod": pod.name,
                    "stopped": not alive,
                    "signals": sorted({ln[3] for ln in signals}),
                    "processes_signalled": len({ln[2] for ln in signals}),
                    "seconds_to_first_signal": round(first - pod.created_wall, 2),
                }
            )
            self.delete_pod(pod)

    # -- the run ---------------------------------------------------------------------------------

    def run(self) -> tuple[list[dict[str, float]], dict[str, Any]]:
        args = self.args
        enforcer_kubeconfig, agent_kubeconfig = self.setup_cluster()
        env = gpuguard_env({SCENARIO_ENV: str(self.node.scenario.path)})
        stub = build_stub()
        for _ in range(args.resident_pods):
            self.create_pod("resident", processes=args.procs_per_pod, limit=POD_LIMIT)
        enforcer_port, agent_port = free_port(), free_port()
        config = self.work / "enforcer.toml"
        config.write_text(
            f"""version = 1
[node]
name = "{NODE}"
proc_root = "/proc"
cgroup_root = "/sys/fs/cgroup"
[enforcement]
mode = "enforce"
lock_file = "{self.work / "enforcer.lock"}"
[metrics]
address = "127.0.0.1:{enforcer_port}"
[kube]
kubeconfig = "{enforcer_kubeconfig}"
[nvml]
library_path = "{stub}"
[logging]
level = "info"
format = "json"
"""
        )
        enforcer = start_gpuguard(
            "enforcer", ["enforce", "--config", str(config)], out=self.out, env=env,
            port=enforcer_port,
        )  # fmt: skip
        procs = {"enforcer": enforcer}
        try:
            procs["agent"] = start_gpuguard(
                "agent",
                ["agent", "--node-name", NODE, "--kubeconfig", str(agent_kubeconfig),
                 "--metrics-address", f"127.0.0.1:{agent_port}", "--log-format", "json"],
                out=self.out, env=env, port=agent_port,
            )  # fmt: skip
            samples = self.churn(procs)
        finally:
            exits = {name: p.stop(20.0) for name, p in procs.items()}
        return samples, self.report(samples, procs, exits)

    def churn(self, procs: Mapping[str, Gpuguard]) -> list[dict[str, float]]:
        args = self.args
        start = time.monotonic()
        end = start + args.minutes * 60
        every = {
            "start": 60 / args.starts_per_minute,
            "sample": args.sample_seconds,
            "config": args.config_seconds,
            "churn": args.pod_churn_seconds,
            "offender": args.offender_seconds,
        }
        due = {
            "start": start,
            "sample": start,
            "config": start + every["config"],
            "churn": start + 1,
            "offender": start + min(30.0, every["offender"] / 2),
        }
        profile = "slice-4"
        pending: tuple[str, float] | None = None
        samples: list[dict[str, float]] = []
        last_buckets: list[tuple[float, float]] = []
        last_label_check = 0.0
        print(
            f"soak: {args.minutes:g} min, {self.node.count()} processes listed, "
            f"{len(self.pods)} pods; samples every {args.sample_seconds:g} s",
            flush=True,
        )
        while (now := time.monotonic()) < end:
            for name, p in procs.items():
                if not p.alive():
                    raise SystemExit(f"gpuguard {name} exited {p.stop()} mid-run")
            if now >= due["sample"]:
                due["sample"] += every["sample"]
                sample, last_buckets = self.sample(procs, now - start, last_buckets)
                samples.append(sample)
                print(
                    f"  t={sample['elapsed_s']:6.0f}s listed={sample['listed']:.0f} "
                    f"enforcer rss={sample['enforcer_rss_mib']:.1f}MiB "
                    f"fds={sample['enforcer_fds']:.0f} thr={sample['enforcer_threads']:.0f} "
                    f"tasks={sample['enforcer_asyncio_tasks']:.0f} "
                    f"p99={sample['enforcer_poll_p99_ms']:.1f}ms | agent "
                    f"rss={sample['agent_rss_mib']:.1f}MiB fds={sample['agent_fds']:.0f} "
                    f"thr={sample['agent_threads']:.0f} "
                    f"tasks={sample['agent_asyncio_tasks']:.0f} | load {sample['load1']:.2f}",
                    flush=True,
                )
            for _ in range(MAX_STARTS_PER_TURN):  # catch up, as the accelerated churn needs
                if now < due["start"]:
                    break
                due["start"] += every["start"]
                self.spawn_short()
            if now >= due["churn"]:
                due["churn"] += every["churn"]
                for pod in [p for p in self.pods.values() if p.kind == "churn"]:
                    if now - pod.created >= args.churn_pod_seconds:
                        self.delete_pod(pod)
                self.create_pod("churn", processes=args.churn_procs, limit=POD_LIMIT)
            if now >= due["offender"]:
                due["offender"] += every["offender"]
                self.create_pod("offender", processes=2, limit=OFFENDER_LIMIT)
            self.reap_offenders(now)
            if now >= due["config"]:
                due["config"] += every["config"]
                if pending is not None:
                    self.tally.label_missed += 1
                profile = "slice-2" if profile == "slice-4" else "slice-4"
                self.put_sharing(profile)
                self.tally.config_edits += 1
                pending = (profile, now)
            if pending is not None and now - last_label_check >= 0.25:
                last_label_check = now
                if self.node_label() == pending[0]:
                    self.tally.label_flips.append(now - pending[1])
                    pending = None
            time.sleep(0.02)
        self.tally.churn_seconds = time.monotonic() - start
        # Offenders still running get their time to be stopped (or are counted as not stopped).
        while any(p.kind == "offender" for p in self.pods.values()):
            self.reap_offenders(time.monotonic())
            time.sleep(0.1)
        return samples

    def sample(
        self,
        procs: Mapping[str, Gpuguard],
        elapsed: float,
        last_buckets: list[tuple[float, float]],
    ) -> tuple[dict[str, float], list[tuple[float, float]]]:
        row: dict[str, float] = {
            "wall": time.time(),
            "elapsed_s": round(elapsed, 1),
            "load1": os.getloadavg()[0],
            "listed": float(self.node.count()),
            "identities_listed": float(self.node.identities),
            "pods": float(len(self.pods)),
        }
        buckets = last_buckets
        for name, p in procs.items():
            figures = process_figures(p.pid)
            try:
                metrics = scraped(p.port)
            except (OSError, ValueError) as exc:  # a load storm on a shared machine: a gap
                print(f"  {name}: /metrics not scraped ({exc})", flush=True)
                metrics = {}
            row[f"{name}_scrape_failed"] = 0.0 if metrics else 1.0
            for key, value in figures.items():
                row[f"{name}_{key}"] = value
            before = self.last_cpu.get(name)
            row[f"{name}_cpu_percent"] = (
                math.nan
                if before is None
                else 100 * (figures["cpu_seconds"] - before[1]) / max(elapsed - before[0], 1e-9)
            )
            self.last_cpu[name] = (elapsed, figures["cpu_seconds"])
            row[f"{name}_asyncio_tasks"] = metrics.get("gpuguard_asyncio_tasks", math.nan)
            if name == "enforcer" and not metrics:
                row["enforcer_poll_p99_ms"] = math.nan  # the next window spans this one too
                row["enforcer_polls"] = math.nan
                row["enforcer_kills_total"] = math.nan
            elif name == "enforcer":
                buckets = poll_buckets(metrics)
                window = [(le, count - dict(last_buckets).get(le, 0.0)) for le, count in buckets]
                row["enforcer_poll_p99_ms"] = histogram_quantile(0.99, window) * 1000
                row["enforcer_polls"] = buckets[-1][1] if buckets else 0.0
                row["enforcer_kills_total"] = metrics.get("gpuguard_kills_total", 0.0)
        return row, buckets

    # -- the report -------------------------------------------------------------------------------

    def report(
        self,
        samples: list[dict[str, float]],
        procs: Mapping[str, Gpuguard],
        exits: Mapping[str, int | None],
    ) -> dict[str, Any]:
        args = self.args
        warmup_s = args.warmup_minutes * 60
        if warmup_s >= args.minutes * 60:
            warmup_s = args.minutes * 60 / 3
        steady = [s for s in samples if s["elapsed_s"] >= warmup_s]
        quantities: dict[str, dict[str, Any]] = {}
        for name in PROCESSES:
            per: dict[str, Any] = {}
            for q in (*QUANTITIES, *(("poll_p99_ms",) if name == "enforcer" else ())):
                key = f"{name}_{q}"
                pts = [(s["elapsed_s"] / 3600, s[key]) for s in steady if not math.isnan(s[key])]
                slope, intercept = fit([t for t, _ in pts], [v for _, v in pts])
                t0, t1 = (pts[0][0], pts[-1][0]) if pts else (math.nan, math.nan)
                values = [s[key] for s in samples if not math.isnan(s[key])]
                per[q] = {
                    "slope_per_hour": slope,
                    "fit_start": slope * t0 + intercept,
                    "fit_end": slope * t1 + intercept,
                    "first": values[0] if values else math.nan,
                    "last": values[-1] if values else math.nan,
                    "mean_after_warmup": sum(v for _, v in pts) / len(pts) if pts else math.nan,
                    "min": min(values, default=math.nan),
                    "max": max(values, default=math.nan),
                }
            quantities[name] = per
        # Who the enforcer signalled, by its own log, and who caught a signal, by the records.
        offender_names = {o["pod"] for o in self.tally.offenders} | {
            p.name for p in self.pods.values() if p.kind == "offender"
        }
        signalled = list(procs["enforcer"].events("container_signalled"))
        wrong_in_log = [e for e in signalled if e.get("pod") not in offender_names]
        everyone = [*self.gone, *self.pods.values()]
        wrong_caught = [
            (p.name, ln)
            for p in everyone
            if p.kind != "offender"
            for ln in p.lines()
            if len(ln) >= 2 and ln[1] in ("signal", "exit")
        ]
        minutes_run = self.tally.churn_seconds / 60
        cache = attribution_cache(samples)
        flips = sorted(self.tally.label_flips)
        summary = {
            "provenance": header(),
            "command": command(),
            "started": datetime.datetime.fromtimestamp(samples[0]["wall"], datetime.UTC).isoformat(
                timespec="seconds"
            )
            if samples
            else None,
            "minutes": round(minutes_run, 2),
            "warmup_minutes": round(warmup_s / 60, 2),
            "samples": len(samples),
            "machine": {
                "nproc": os.cpu_count(),
                "kernel": platform.release(),
                "python": platform.python_version(),
            },
            "load1": {
                "min": min((s["load1"] for s in samples), default=math.nan),
                "mean": sum(s["load1"] for s in samples) / len(samples) if samples else math.nan,
                "max": max((s["load1"] for s in samples), default=math.nan),
            },
            "listed_processes": {
                "min": min((s["listed"] for s in samples), default=math.nan),
                "max": max((s["listed"] for s in samples), default=math.nan),
            },
            "quantities": quantities,
            "attribution_cache": cache,
            "churn": {
                "process_starts": self.tally.process_starts,
                "process_starts_per_minute": round(
                    self.tally.process_starts * 60 / self.tally.churn_seconds, 1
                )
                if self.tally.churn_seconds
                else None,
                "pods_created": self.tally.pods_created,
                "pods_deleted": self.tally.pods_deleted,
                "config_edits": self.tally.config_edits,
                "label_flips_seen": len(flips),
                "label_flips_missed": self.tally.label_missed,
                "label_flip_seconds_p50": flips[len(flips) // 2] if flips else None,
                "label_flip_seconds_max": flips[-1] if flips else None,
            },
            "enforcement": {
                "offenders": len(self.tally.offenders),
                "offenders_stopped": sum(1 for o in self.tally.offenders if o["stopped"]),
                "offender_detail": self.tally.offenders,
                "containers_signalled_in_log": len(signalled),
                "wrong_signals_in_log": len(wrong_in_log),
                "wrong_signals_caught": len(wrong_caught),
                "wrong_detail": [*wrong_in_log[:10], *wrong_caught[:10]],
                "kills_total": samples[-1].get("enforcer_kills_total") if samples else None,
            },
            "scrape_failures": {
                name: sum(1 for s in samples if s.get(f"{name}_scrape_failed"))
                for name in PROCESSES
            },
            "exit_codes": dict(exits),
        }
        return summary

    def close(self) -> None:
        for pod in list(self.pods.values()):
            for pipe in (pod.zygote.stdin, pod.zygote.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
        self.node.close()
        try:
            self.tree.close()  # every process it started, by pidfd; then its cgroups
        finally:
            if self.cluster is not None:
                self.cluster.close()


# ---------------------------------------------------------------------------------------------
# Outputs


def attribution_cache(samples: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    """When the distinct identities listed passed the attribution cache's size, and the
    enforcer's RSS then (at that sample), at the end, its highest, and its least-squares slope
    per hour over the samples from a minute after it (``None`` where the run never filled it or
    too few samples followed)."""
    full = next((s for s in samples if s.get("identities_listed", 0.0) >= ATTRIBUTION_CACHE), None)
    result: dict[str, Any] = {
        "size": ATTRIBUTION_CACHE,
        "identities_listed": samples[-1].get("identities_listed") if samples else None,
        "full_at_s": None,
        "rss_mib_at_full": None,
        "rss_mib_last": samples[-1]["enforcer_rss_mib"] if samples else None,
        "rss_mib_max": max((s["enforcer_rss_mib"] for s in samples), default=None),
        "rss_slope_per_hour_after_full": None,
        "rss_fit_after_full": None,
    }
    if full is None:
        return result
    result["full_at_s"] = full["elapsed_s"]
    result["rss_mib_at_full"] = full["enforcer_rss_mib"]
    after = [
        (s["elapsed_s"] / 3600, s["enforcer_rss_mib"])
        for s in samples
        if s["elapsed_s"] >= full["elapsed_s"] + 60 and not math.isnan(s["enforcer_rss_mib"])
    ]
    if len(after) >= 3:
        slope, intercept = fit([t for t, _ in after], [v for _, v in after])
        result["rss_slope_per_hour_after_full"] = slope
        result["rss_fit_after_full"] = {
            "from_s": after[0][0] * 3600,
            "to_s": after[-1][0] * 3600,
            "start": slope * after[0][0] + intercept,
            "end": slope * after[-1][0] + intercept,
        }
    return result


def write_csv(path: Path, samples: Sequence[Mapping[str, float]]) -> None:
    columns = list(samples[0]) if samples else []
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for s in samples:
            writer.writerow({k: round(v, 4) for k, v in s.items()})


def plot(path: Path, samples: Sequence[Mapping[str, float]], summary: Mapping[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("rss_mib", "RSS (MiB)", PROCESSES),
        ("fds", "open fds", PROCESSES),
        ("threads", "threads", PROCESSES),
        ("asyncio_tasks", "asyncio tasks", PROCESSES),
        ("poll_p99_ms", "poll duration p99 per 10 s (ms)", ("enforcer",)),
        ("cpu_percent", "CPU (% of one core)", PROCESSES),
        ("node", "GPU processes", ()),
    ]
    minutes = [s["elapsed_s"] / 60 for s in samples]
    warmup = summary["warmup_minutes"]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.1 * len(panels)), sharex=True)
    colors = {"enforcer": "tab:blue", "agent": "tab:orange"}
    for ax, (q, title, who) in zip(axes, panels, strict=True):
        if q == "node":  # what the enforcer saw: listed now, distinct so far, the load
            ax.plot(minutes, [s["listed"] for s in samples], color="tab:green", label="listed")
            ax.plot(
                minutes,
                [s.get("identities_listed", math.nan) for s in samples],
                color="tab:purple",
                label="distinct (pid, starttime) so far",
            )
            ax.axhline(
                ATTRIBUTION_CACHE,
                color="tab:purple",
                linestyle=":",
                linewidth=1,
                label="attribution cache",
            )
            load = ax.twinx()
            load.plot(minutes, [s["load1"] for s in samples], color="grey", linewidth=0.8)
            load.set_ylabel("load1 (grey)", fontsize=8)
        for name in who:
            values = [s[f"{name}_{q}"] for s in samples]
            ax.plot(minutes, values, color=colors[name], label=name, linewidth=1)
            fitted = summary["quantities"][name].get(q)
            if fitted and not math.isnan(fitted["slope_per_hour"]):
                ax.plot(
                    [warmup, minutes[-1]],
                    [fitted["fit_start"], fitted["fit_end"]],
                    color=colors[name],
                    linestyle="--",
                    linewidth=1,
                )
        ax.axvline(warmup, color="grey", linestyle=":", linewidth=1)
        ax.set_ylabel(title, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[0].set_title(
        f"gpuguard soak: {summary['minutes']:.1f} min, "
        f"{summary['churn']['process_starts_per_minute']} process starts/min, "
        f"{summary['listed_processes']['max']:.0f} GPU processes listed "
        f"(dotted: end of warm-up; dashed: least-squares fit after it)",
        fontsize=8,
    )
    axes[-1].set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(summary: Mapping[str, Any]) -> None:
    print(
        f"\nsoak {summary['minutes']:.1f} min (fit after {summary['warmup_minutes']:g} min "
        f"warm-up), load1 mean {summary['load1']['mean']:.2f} max {summary['load1']['max']:.2f}"
    )
    print("| process | quantity | first | fit start | fit end | last | slope / hour |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, per in summary["quantities"].items():
        for q, f in per.items():
            print(
                f"| {name} | {q} | {f['first']:.1f} | {f['fit_start']:.1f} | "
                f"{f['fit_end']:.1f} | {f['last']:.1f} | {f['slope_per_hour']:+.2f} |"
            )
    print(json.dumps({"churn": summary["churn"]}, indent=None))
    print(json.dumps({"attribution_cache": summary["attribution_cache"]}, indent=None))
    enf = {k: v for k, v in summary["enforcement"].items() if k != "offender_detail"}
    print(json.dumps({"enforcement": enf}, indent=None, default=str))


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--minutes", type=float, default=30, help="run length (default 30)")
    p.add_argument("--warmup-minutes", type=float, default=5, help="not fitted (default 5)")
    p.add_argument("--out", type=Path, default=Path("soak-out"), help="output directory")
    p.add_argument("--plot", type=Path, help="the PNG (default OUT/soak.png)")
    p.add_argument("--no-plot", action="store_true", help="no PNG (no matplotlib needed)")
    p.add_argument("--resident-pods", type=int, default=20)
    p.add_argument("--procs-per-pod", type=int, default=50)
    p.add_argument("--starts-per-minute", type=float, default=100)
    p.add_argument(
        "--short-seconds",
        type=float,
        nargs=2,
        default=(5.0, 55.0),
        metavar=("MIN", "MAX"),
        help="a short-lived process's life, drawn uniformly (default 5 55)",
    )
    p.add_argument(
        "--accelerated",
        action="store_true",
        help="fill the attribution cache fast: 3000 starts a minute, each alive 1-3 s, on "
        "4 resident pods x 25 processes (any of these options given as well wins)",
    )
    p.add_argument("--pod-churn-seconds", type=float, default=30)
    p.add_argument("--churn-pod-seconds", type=float, default=120)
    p.add_argument("--churn-procs", type=int, default=10)
    p.add_argument("--offender-seconds", type=float, default=180)
    p.add_argument("--offender-timeout", type=float, default=90, help="seconds to be stopped")
    p.add_argument("--config-seconds", type=float, default=60)
    p.add_argument("--sample-seconds", type=float, default=10)
    p.add_argument("--seed", type=int, default=16)
    p.add_argument(
        "--replot", action="store_true", help="only draw OUT's samples.csv and summary.json again"
    )
    args = p.parse_args(argv)
    if args.accelerated:  # its defaults, under whatever was given explicitly
        given = {a.split("=", 1)[0] for a in (argv if argv is not None else sys.argv[1:])}
        for flag, value in ACCELERATED.items():
            if flag not in given:
                setattr(args, flag.lstrip("-").replace("-", "_"), value)
    return args


ACCELERATED: dict[str, Any] = {
    "--starts-per-minute": 3000.0,
    "--short-seconds": (1.0, 3.0),
    "--resident-pods": 4,
    "--procs-per-pod": 25,
}
"""``--accelerated``'s settings: about 50 new processes a second, 100 or so alive at once, so the
distinct identities listed pass the attribution cache's 4096 in under two minutes."""


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if not args.no_plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit(MATPLOTLIB_FIX) from None
    if args.replot:
        with (args.out / "samples.csv").open() as f:
            rows = [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]
        summary = json.loads((args.out / "summary.json").read_text())
        plot(args.plot or args.out / "soak.png", rows, summary)
        return 0
    problem = kernel_problem(((2, ""),))
    if problem is not None:
        raise SystemExit(f"soak: {problem}")
    args.out.mkdir(parents=True, exist_ok=True)
    print("\n".join(header_lines()), flush=True)
    with tempfile.TemporaryDirectory(prefix="gpuguard-soak-") as tmp:
        soak = Soak(args, args.out, Path(tmp))

        def on_term(signum: int, frame: object) -> None:
            raise KeyboardInterrupt  # cleans up like Ctrl-C: every process, cgroup, server

        signal.signal(signal.SIGTERM, on_term)
        try:
            samples, summary = soak.run()
        finally:
            soak.close()
            print(f"cgroup root (removed): {V2_ROOT / soak.tree.name}")
    write_csv(args.out / "samples.csv", samples)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    if not args.no_plot:
        plot(args.plot or args.out / "soak.png", samples, summary)
    print_table(summary)
    enforcement = summary["enforcement"]
    wrong = enforcement["wrong_signals_in_log"] + enforcement["wrong_signals_caught"]
    if wrong:
        print(f"WRONG SIGNALS: {wrong}")
    return 1 if wrong or any(summary["exit_codes"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
