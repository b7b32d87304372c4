"""GPU end-to-end run of ``gpuguard enforce`` on a real NVIDIA GPU node (run as root).

Owns: building kubepods-like cgroups (systemd driver, containerd, Burstable) under one unique
root ``/gpuguard-e2e-<pid>`` of the cgroup v2 tree, a pods manifest (or real Pods in a real
kube-apiserver with ``--apiserver``), starting the real enforcer against them, running trials
with PyTorch workloads (``scripts/gpu_e2e_worker.py``), timing each with a 10 ms NVML watcher
and CLOCK_MONOTONIC signal receipts, and reporting latencies, wrong kills and CPU per poll.
Must not: signal any process it did not start (cleanup SIGKILLs by pidfd only the processes it
started and the members of its own cgroups), touch cgroups outside its root, change any GPU
setting, or listen on anything but 127.0.0.1.

Pods (namespace ``e2e``, node ``e2e``, annotation ``gpuguard.io/gpu-memory-limit``):

- ``greedy`` (limit ``--limit-gib``): per trial a worker grows +512 MiB every 100 ms to
  limit + 4 GiB and exits on SIGTERM;
- ``stubborn`` (same limit): grows the same way, ignores SIGTERM (SIGKILL path);
- ``forked`` (same limit): grows past the limit, forks a child that inherits the CUDA file
  descriptors and sleeps, and the parent exits (``os._exit``) 0.3 s later: NVML keeps listing
  the dead parent while the child holds the memory; gpuguard must reclaim it container-wide;
- ``forked-zombie`` (``--zombie-trials``, same pod as ``forked``): the same, but the exited
  parent stays an unreaped zombie (the script reaps it only after the trial; in the other
  trials a thread reaps every worker at once, as a container's init would). A zombie's fd
  table is empty; gpuguard once read that as "holds no GPU" and never reclaimed the memory
  (docs/gpu-e2e.md, finding 1, fixed: a zombie's GPU holding is unknown, not false);
- ``neighbour`` (limit 8 GiB, holds 2 GiB, same GPU) and a host process (no pod, cgroup
  ``/gpuguard-e2e-<pid>/system.slice/e2e-host.service``, holds 2 GiB): must never be signalled.

Per trial: crossing = the first 10 ms NVML sample in which the trial pod's processes use more
than the limit; first signal = the worker's SIGTERM handler's CLOCK_MONOTONIC; freed = the first
sample in which the trial's PID is no longer listed. Reported: crossing → SIGTERM and
crossing → freed (p50/p99, nearest rank), wrong kills (signals received by, or deaths of,
neighbour and host process, and enforcer ``container_signalled`` lines for other pods; must be
0), the enforcer's CPU time per poll (its /proc CPU time over the growth of
``gpuguard_poll_duration_seconds_count``), and the target crossing → SIGTERM ≤ poll + grace +
50 ms at p99.

Usage (repository root, Python ≥ 3.11 with torch, nvidia-ml-py and gpuguard's dependencies)::

    python3 scripts/gpu_e2e.py --trials 20 --out /tmp/e2e
    python3 scripts/gpu_e2e.py --trials 5 --apiserver /tmp/kube --out /tmp/e2e-api
        # --apiserver DIR: real etcd + kube-apiserver from $TESTBIN_DIR (or testbin/bin, or
        # ``<name>.xz`` files there), RBAC from manifests/rbac.yaml, the enforcer with a
        # ServiceAccount token; Events read back from the API after the trials.

Writes ``results.json``, ``records.jsonl`` (worker records), ``enforcer.log`` and the pods and
config files to ``--out``; prints a table last. Exit status 0 when every trial was signalled,
freed, and no wrong kill happened, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import lzma
import math
import os
import platform
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "scripts" / "gpu_e2e_worker.py"
NAMESPACE = "e2e"
NODE = "e2e"
GIB = 1 << 30
MIB = 1 << 20
LIMIT_ANNOTATION = "gpuguard.io/gpu-memory-limit"
KAI_MEMORY = "gpu-memory"  # KAI-Scheduler's annotation, MiB (docs/schedulers.md)
HAMI_MEMORY = "nvidia.com/gpumem"  # HAMi's container resource limit, MiB
WATCH_PERIOD = 0.010
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------
# cgroups


def v2_mount() -> Path:
    """The cgroup v2 mount: ``/sys/fs/cgroup`` (pure v2) or ``/sys/fs/cgroup/unified``."""
    for d in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        if (d / "cgroup.controllers").is_file() or (
            d.name == "unified" and (d / "cgroup.procs").is_file()
        ):
            return d
    raise SystemExit("no cgroup v2 mount at /sys/fs/cgroup or /sys/fs/cgroup/unified")


def pidfd_kill(pid: int) -> None:
    """SIGKILL through a pidfd (no PID-reuse race); a process already gone is fine."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    finally:
        os.close(fd)


class Cgroups:
    """Cgroups below one unique root of the v2 tree; ``close()`` kills members and removes them."""

    def __init__(self, mount: Path, name: str) -> None:
        self.mount = mount
        self.name = name
        self._created: list[Path] = []

    def make(self, rel: str) -> tuple[Path, str]:
        """Create ``/<name>/<rel>``: returns (directory, path as /proc/<pid>/cgroup shows it)."""
        path = f"/{self.name}/{rel.strip('/')}"
        d = self.mount
        for part in path.strip("/").split("/"):
            d = d / part
            if not d.exists():
                d.mkdir()
                self._created.append(d)
        return d, path

    @staticmethod
    def members(d: Path) -> list[int]:
        try:
            return [int(x) for x in (d / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def close(self) -> list[str]:
        problems: list[str] = []
        for d in sorted(self._created, key=lambda p: len(p.parts), reverse=True):
            deadline = time.monotonic() + 10
            while pids := self.members(d):
                for pid in pids:
                    pidfd_kill(pid)
                if time.monotonic() > deadline:
                    problems.append(f"{d}: {pids} would not die")
                    break
                time.sleep(0.02)
            for _ in range(200):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)
            else:
                problems.append(f"{d}: not removed")
        return problems


def pod_cgroup_rel(pod_uid: str, container_id: str) -> str:
    """systemd driver, Burstable, containerd (reference nvml-cgroups-k8s.md §2.2, §2.3)."""
    u = pod_uid.replace("-", "_")
    return (
        f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/"
        f"cri-containerd-{container_id}.scope"
    )


def spawn_in(cgroup_dir: Path, argv: Sequence[str], **kw: Any) -> subprocess.Popen[str]:
    """Start argv inside ``cgroup_dir`` before it execs (a sh wrapper joins, then execs)."""
    script = 'echo $$ > "$1" || exit 97; shift; exec "$@"'
    return subprocess.Popen(
        ["sh", "-c", script, "sh", str(cgroup_dir / "cgroup.procs"), *argv], text=True, **kw
    )


# ---------------------------------------------------------------------------------------------
# Pods


@dataclass(slots=True, kw_only=True)
class PodSpec:
    name: str
    limit_bytes: int | None
    uid: str = ""
    container_id: str = field(default_factory=lambda: secrets.token_hex(32))
    cgroup_dir: Path = Path()
    cgroup_path: str = ""

    def declaration(self, source: str) -> tuple[dict[str, str], dict[str, str]]:
        """(annotations, container resource limits) declaring this pod's limit as ``source``
        writes it: gpuguard's annotation, KAI's ``gpu-memory`` annotation (MiB) or HAMi's
        ``nvidia.com/gpumem`` container limit (MiB)."""
        if not self.limit_bytes:
            return {}, {}
        mib = str(self.limit_bytes // MIB)
        if source == "kai":
            return {KAI_MEMORY: mib}, {}
        if source == "hami":
            return {}, {HAMI_MEMORY: mib}
        return {LIMIT_ANNOTATION: f"{mib}Mi"}, {}

    def manifest(self, source: str = "gpuguard") -> dict[str, Any]:
        annotations, limits = self.declaration(source)
        container: dict[str, Any] = {"name": "main", "image": "registry.invalid/cuda:1"}
        if limits:
            container["resources"] = {"limits": limits}
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": self.name,
                "namespace": NAMESPACE,
                "uid": self.uid,
                "annotations": annotations,
            },
            "spec": {
                "nodeName": NODE,
                "containers": [container],
            },
            "status": {
                "phase": "Running",
                "qosClass": "Burstable",
                "containerStatuses": [
                    {"name": "main", "containerID": f"containerd://{self.container_id}"}
                ],
            },
        }


# ---------------------------------------------------------------------------------------------
# NVML watcher


class Nvml:
    def __init__(self, index: int) -> None:
        import pynvml

        self._n = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)

    def usage(self) -> dict[int, int]:
        """PID → used bytes (compute processes; unknown usage counts as 0 here)."""
        procs = self._n.nvmlDeviceGetComputeRunningProcesses(self.handle)
        return {p.pid: int(p.usedGpuMemory or 0) for p in procs}

    def facts(self) -> dict[str, Any]:
        n = self._n
        mem = n.nvmlDeviceGetMemoryInfo(self.handle)
        return {
            "gpu": n.nvmlDeviceGetName(self.handle),
            "memory_total_bytes": int(mem.total),
            "driver": n.nvmlSystemGetDriverVersion(),
            "nvml": n.nvmlSystemGetNVMLVersion(),
        }

    def close(self) -> None:
        self._n.nvmlShutdown()


# ---------------------------------------------------------------------------------------------
# The enforcer


def scrape(port: int) -> dict[str, float]:
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("gpuguard_poll_duration_seconds_count") or line.startswith(
            "gpuguard_poll_duration_seconds_sum"
        ):
            name, _, value = line.partition(" ")
            values[name.split("{")[0]] = float(value)
    return values


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def write_config(path: Path, args: argparse.Namespace) -> None:
    fast = "" if args.fast_interval is None else f"fast_interval_seconds = {args.fast_interval}\n"
    path.write_text(
        "version = 1\n"
        "[node]\n"
        'cgroup_root = "/sys/fs/cgroup"\n'
        "[enforcement]\n"
        'mode = "enforce"\n'
        f"poll_interval_seconds = {args.poll}\n"
        f"{fast}"
        f"grace_seconds = {args.grace}\n"
        f"termination_timeout_seconds = {args.termination_timeout}\n"
        "[limits]\n"
        f"sources = {json.dumps(list(dict.fromkeys(['gpuguard', args.limit_source])))}\n"
        "[logging]\n"
        'level = "info"\n'
        'format = "json"\n'
    )


# ---------------------------------------------------------------------------------------------
# Trials


@dataclass(slots=True, kw_only=True)
class Trial:
    kind: str
    label: str
    pid: int = 0
    cuda_init_s: float | None = None
    t_go: float | None = None
    t_cross: float | None = None
    t_term: float | None = None
    t_freed: float | None = None
    t_under: float | None = None
    t_parent_exit: float | None = None
    cross_to_term_s: float | None = None
    cross_to_freed_s: float | None = None
    term_to_freed_s: float | None = None
    peak_bytes: int = 0
    exit_code: int | None = None
    listed_after_parent_exit_s: float | None = None
    """forked: how long NVML kept listing the dead parent's PID (with memory) after it exited."""
    used_after_parent_exit_bytes: int | None = None
    child_pid: int | None = None
    child_listed: bool | None = None
    """forked: whether NVML ever listed the child that holds the memory."""
    ok: bool = False
    problem: str = ""


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


def wait_ready(proc: subprocess.Popen[str], what: str, timeout: float = 180.0) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{what} exited ({proc.poll()}) before it was ready")
        if line.startswith("ready"):
            return
    raise TimeoutError(f"{what} not ready after {timeout}s")


def run_trial(
    *,
    kind: str,
    label: str,
    pod: PodSpec,
    nvml: Nvml,
    records: Path,
    limit_bytes: int,
    grow_to_mib: int,
    timeout: float,
) -> Trial:
    trial = Trial(kind=kind, label=label)
    role = "forked" if kind == "forked-zombie" else kind
    argv = [
        sys.executable, str(WORKER), "--role", role, "--label", label, "--record", str(records),
        "--max-mib", str(grow_to_mib),
    ]  # fmt: skip
    if role == "forked":
        # One allocation over the limit, fork, parent gone 0.3 s later: all before the grace
        # period ends, so only container-scoped escalation can reach the memory.
        argv += ["--step-mib", str(grow_to_mib), "--linger", "0.3"]
    proc = spawn_in(pod.cgroup_dir, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    trial.pid = proc.pid
    timeline: list[tuple[float, int, bool]] = []
    seen: set[int] = set()
    try:
        wait_ready(proc, label)
        assert proc.stdin is not None
        if kind != "forked-zombie":
            # Reap the worker the moment it exits, as a container's init or shell would. A
            # forked-zombie trial leaves the exited parent a zombie until the trial ends.
            threading.Thread(target=proc.wait, daemon=True).start()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            t = time.monotonic()
            usage = nvml.usage()
            used = usage.get(proc.pid, 0)
            listed = proc.pid in usage
            seen.update(usage)
            timeline.append((t, used, listed))
            trial.peak_bytes = max(trial.peak_bytes, used)
            if trial.t_cross is None and used > limit_bytes:
                trial.t_cross = t
            if trial.t_cross is not None:
                if trial.t_under is None and used <= limit_bytes:
                    trial.t_under = t
                if not listed:
                    trial.t_freed = t
                    break
            time.sleep(max(0.0, WATCH_PERIOD - (time.monotonic() - t)))
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1)
        if proc.returncode is None:
            pidfd_kill(proc.pid)
            proc.wait()
            trial.problem = "worker still alive after the trial (killed by the script)"
        trial.exit_code = proc.returncode
    mine = [r for r in read_records(records) if r.get("label") == label]
    for r in mine:
        if r["kind"] == "ready" and r.get("pid") == proc.pid:
            trial.cuda_init_s = r.get("cuda_init_s")
        elif r["kind"] == "go":
            trial.t_go = r["t"]
        elif r["kind"] == "signal" and trial.t_term is None:
            trial.t_term = r["t"]
        elif r["kind"] == "parent_exit":
            trial.t_parent_exit = r["t"]
        elif r["kind"] == "child":
            trial.child_pid = r["pid"]
            trial.child_listed = r["pid"] in seen
    if trial.t_parent_exit is not None:
        after = [(t, u) for t, u, listed in timeline if t > trial.t_parent_exit and listed]
        if after:
            trial.listed_after_parent_exit_s = after[-1][0] - trial.t_parent_exit
            trial.used_after_parent_exit_bytes = after[0][1]
    if trial.t_cross is not None:
        if trial.t_term is not None:
            trial.cross_to_term_s = trial.t_term - trial.t_cross
        if trial.t_freed is not None:
            trial.cross_to_freed_s = trial.t_freed - trial.t_cross
    if trial.t_term is not None and trial.t_freed is not None:
        trial.term_to_freed_s = trial.t_freed - trial.t_term
    if not trial.problem:
        if trial.t_cross is None:
            trial.problem = "never crossed the limit"
        elif trial.t_term is None:
            trial.problem = "no SIGTERM received"
        elif trial.t_freed is None:
            trial.problem = "memory not freed within the timeout"
    trial.ok = not trial.problem
    return trial


# ---------------------------------------------------------------------------------------------
# Pod sources


class PodsFile:
    """Pods as a manifest file (``enforce --pods-file``)."""

    def __init__(self, out: Path, source: str) -> None:
        self.path = out / "pods.yaml"
        self.source = source

    def register(self, pods: Sequence[PodSpec]) -> None:
        for p in pods:
            p.uid = str(uuid.uuid4())

    def publish(self, pods: Sequence[PodSpec]) -> None:
        doc = {"apiVersion": "v1", "kind": "List", "items": [p.manifest(self.source) for p in pods]}
        self.path.write_text(json.dumps(doc, indent=1))  # JSON is YAML

    def enforcer_args(self) -> list[str]:
        return ["--pods-file", str(self.path)]

    def events(self) -> list[dict[str, Any]]:
        return []

    def close(self) -> None:
        pass


class ApiServer:
    """Real etcd + kube-apiserver (tests/apiserver.py's KubeCluster), RBAC, Pods, Events."""

    def __init__(self, workdir: Path, source: str) -> None:
        self.source = source
        sys.path.insert(0, str(REPO))
        from tests.apiserver import KubeCluster

        workdir = workdir / f"run-{os.getpid()}"  # fresh etcd data on every run
        workdir.mkdir(parents=True)
        self.cluster = KubeCluster(workdir, self._binaries(workdir))
        t0 = time.monotonic()
        self.cluster.start()
        self.start_seconds = time.monotonic() - t0
        for ns in ("gpuguard", "gpu-operator", NAMESPACE):  # rbac.yaml has a Role in gpu-operator
            self._post("/api/v1/namespaces", {"metadata": {"name": ns}})
        self._apply(REPO / "manifests" / "rbac.yaml")
        self._post("/api/v1/nodes", {"metadata": {"name": NODE}})
        self.kubeconfig = self.cluster.kubeconfig_for_sa("gpuguard", "gpuguard")

    @staticmethod
    def _binaries(workdir: Path) -> dict[str, Path]:
        src = Path(os.environ.get("TESTBIN_DIR") or REPO / "testbin" / "bin")
        found: dict[str, Path] = {}
        for name in ("etcd", "kube-apiserver"):
            plain, packed = src / name, src / f"{name}.xz"
            if os.access(plain, os.X_OK):
                found[name] = plain
            elif packed.is_file():
                target = workdir / "bin" / name
                target.parent.mkdir(exist_ok=True)
                with lzma.open(packed) as fin, target.open("wb") as fout:
                    shutil.copyfileobj(fin, fout)
                target.chmod(0o755)
                found[name] = target
            else:
                raise SystemExit(f"no {plain} or {packed}: run scripts/ensure-testbin.sh")
        return found

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        from tests.apiserver import AdminRequestError

        try:
            return self.cluster.admin_request("POST", path, body)
        except AdminRequestError as e:
            if e.code != 409:
                raise
            return {}

    def _apply(self, manifest: Path) -> None:
        import yaml

        plurals = {
            "ServiceAccount": "serviceaccounts",
            "ClusterRole": "clusterroles",
            "ClusterRoleBinding": "clusterrolebindings",
            "Role": "roles",
            "RoleBinding": "rolebindings",
        }
        for doc in yaml.safe_load_all(manifest.read_text()):
            if not doc:
                continue
            gv, ns = doc["apiVersion"], doc["metadata"].get("namespace")
            base = "/api/v1" if gv == "v1" else f"/apis/{gv}"
            where = f"{base}/namespaces/{ns}" if ns else base
            self._post(f"{where}/{plurals[doc['kind']]}", doc)

    def register(self, pods: Sequence[PodSpec]) -> None:
        for p in pods:
            annotations, limits = p.declaration(self.source)
            created = self.cluster.create_pod(
                NAMESPACE, p.name, node=NODE, annotations=annotations, limits=limits
            )
            p.uid = created["metadata"]["uid"]

    def publish(self, pods: Sequence[PodSpec]) -> None:
        for p in pods:
            self.cluster.set_container_statuses(
                NAMESPACE,
                p.name,
                [{"name": "main", "containerID": f"containerd://{p.container_id}"}],
            )

    def enforcer_args(self) -> list[str]:
        return ["--kubeconfig", str(self.kubeconfig)]

    def events(self) -> list[dict[str, Any]]:
        got = self.cluster.admin_request("GET", f"/api/v1/namespaces/{NAMESPACE}/events")
        return [
            {
                "pod": e["involvedObject"].get("name"),
                "reason": e.get("reason"),
                "type": e.get("type"),
                "count": e.get("count"),
                "source": (e.get("source") or {}).get("component") or e.get("reportingComponent"),
                "message": e.get("message"),
            }
            for e in got.get("items", [])
        ]

    def close(self) -> None:
        self.cluster.close()


# ---------------------------------------------------------------------------------------------
# Report


def pct(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (p99 of 20 values is the maximum)."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))]


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def machine_facts(nvml: Nvml) -> dict[str, Any]:
    facts = nvml.facts()
    facts.update(
        {
            "kernel": " ".join(platform.uname()[2:4]),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        }
    )
    with contextlib.suppress(Exception):
        facts["torch"] = importlib.import_module("torch").__version__
    return facts


def summarise(trials: Sequence[Trial], target_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in sorted({t.kind for t in trials}):
        ts = [t for t in trials if t.kind == kind]
        term = [t.cross_to_term_s for t in ts if t.cross_to_term_s is not None]
        freed = [t.cross_to_freed_s for t in ts if t.cross_to_freed_s is not None]
        out[kind] = {
            "trials": len(ts),
            "ok": sum(t.ok for t in ts),
            "cross_to_term_p50_s": pct(term, 0.50),
            "cross_to_term_p99_s": pct(term, 0.99),
            "cross_to_term_max_s": max(term, default=None),
            "cross_to_freed_p50_s": pct(freed, 0.50),
            "cross_to_freed_p99_s": pct(freed, 0.99),
            "target_s": target_s,
            "target_met": bool(term)
            and len(term) == len(ts)
            and (pct(term, 0.99) or 0) <= target_s,
        }
    return out


def print_table(result: dict[str, Any]) -> None:
    print()
    print(
        f"{'kind':10} {'n':>3} {'ok':>3} {'→TERM p50':>10} {'p99':>6} {'→freed p50':>11} "
        f"{'p99':>6} {'target':>7} met"
    )
    for kind, s in result["summary"].items():
        print(
            f"{kind:10} {s['trials']:>3} {s['ok']:>3} {ms(s['cross_to_term_p50_s']):>10} "
            f"{ms(s['cross_to_term_p99_s']):>6} {ms(s['cross_to_freed_p50_s']):>11} "
            f"{ms(s['cross_to_freed_p99_s']):>6} {ms(s['target_s']):>7} "
            f"{'yes' if s['target_met'] else 'NO'}"
        )
    print("(milliseconds; crossing = first 10 ms NVML sample over the limit)")
    c = result["enforcer_cpu"]
    print(
        f"enforcer: {c['polls']} polls, {c['cpu_ms_per_poll']:.2f} ms CPU/poll, "
        f"{c['wall_ms_per_poll']:.2f} ms wall/poll (histogram mean)"
    )
    print(f"wrong kills: {len(result['wrong_kills'])} {result['wrong_kills'] or ''}")
    for t in result["trials"]:
        if t["kind"].startswith("forked"):
            print(
                f"forked {t['label']}: dead parent listed {ms(t['listed_after_parent_exit_s'])} ms "
                f"after exit with {(t['used_after_parent_exit_bytes'] or 0) // MIB} MiB"
            )
        if t["problem"]:
            print(f"PROBLEM {t['label']}: {t['problem']}")
    if result.get("events") is not None:
        print(f"events: {len(result['events'])}")
        for e in result["events"]:
            print(f"  {e['pod']:10} {e['reason']} x{e['count']} ({e['source']})")


def enforcer_lines(log: Path) -> Iterator[dict[str, Any]]:
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                yield json.loads(line)


# ---------------------------------------------------------------------------------------------
# Main


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="GPU end-to-end run of gpuguard enforce (root, one NVIDIA GPU).",
        epilog="See the module docstring (scripts/gpu_e2e.py) for what is measured.",
    )
    parser.add_argument("--trials", type=int, default=20, help="greedy trials (default 20)")
    parser.add_argument("--stubborn-trials", type=int, default=3, help="SIGKILL-path trials")
    parser.add_argument("--forked-trials", type=int, default=3, help="dead-parent trials")
    parser.add_argument(
        "--zombie-trials",
        type=int,
        default=0,
        help="forked trials whose exited parent stays an unreaped zombie",
    )
    parser.add_argument("--limit-gib", type=float, default=4.0, help="trial pods' limit")
    parser.add_argument(
        "--limit-source",
        choices=("gpuguard", "kai", "hami"),
        default="gpuguard",
        help="how the pods declare their limits: gpuguard's annotation, KAI's gpu-memory "
        "annotation or HAMi's nvidia.com/gpumem container limit (limits.sources follows)",
    )
    parser.add_argument("--out", type=Path, default=Path("gpuguard-e2e-out"), help="results")
    parser.add_argument("--apiserver", type=Path, metavar="DIR", help="real API server workdir")
    parser.add_argument("--gpu", type=int, default=0, help="NVML/CUDA index of the GPU")
    parser.add_argument("--poll", type=float, default=0.25, help="poll interval, s")
    parser.add_argument(
        "--fast-interval",
        type=float,
        help="enforcement.fast_interval_seconds (default: gpuguard's; 0: the fast path off, a "
        "listing every poll interval)",
    )
    parser.add_argument("--grace", type=float, default=1.0, help="grace, s")
    parser.add_argument("--termination-timeout", type=float, default=2.0, help="TERM→KILL, s")
    parser.add_argument("--trial-timeout", type=float, default=20.0, help="s per trial")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("run as root: the script builds cgroups and the enforcer signals")

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    records = out / "records.jsonl"
    records.unlink(missing_ok=True)
    limit = int(args.limit_gib * GIB)
    grow_to_mib = limit // MIB + 4096
    target = args.poll + args.grace + 0.050
    nvml = Nvml(args.gpu)
    cg = Cgroups(v2_mount(), f"gpuguard-e2e-{os.getpid()}")
    source: PodsFile | ApiServer = (
        ApiServer(args.apiserver, args.limit_source)
        if args.apiserver
        else PodsFile(out, args.limit_source)
    )
    enforcer: subprocess.Popen[str] | None = None
    side: dict[str, subprocess.Popen[str]] = {}
    log_file: IO[str] | None = None
    result: dict[str, Any] = {"machine": machine_facts(nvml), "mode": type(source).__name__}
    trials: list[Trial] = []
    try:
        pods = {
            name: PodSpec(name=name, limit_bytes=lim)
            for name, lim in (
                ("greedy", limit),
                ("stubborn", limit),
                ("forked", limit),
                ("neighbour", 8 * GIB),
            )
        }
        source.register(list(pods.values()))
        for p in pods.values():
            p.cgroup_dir, p.cgroup_path = cg.make(pod_cgroup_rel(p.uid, p.container_id))
        source.publish(list(pods.values()))
        host_dir, host_path = cg.make("system.slice/e2e-host.service")
        result["cgroups"] = {n: p.cgroup_path for n, p in pods.items()} | {"host": host_path}
        result["cgroup_mount"] = str(cg.mount)

        for who, d in (("neighbour", pods["neighbour"].cgroup_dir), ("host", host_dir)):
            argv = [sys.executable, str(WORKER), "--role", "hold", "--label", who,
                    "--record", str(records), "--max-mib", "2048"]  # fmt: skip
            proc = spawn_in(d, argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
            side[who] = proc
            wait_ready(proc, who)
            assert proc.stdout is not None
            proc.stdout.readline()  # "held"

        config = out / "config.toml"
        write_config(config, args)
        port = free_port()
        log_file = (out / "enforcer.log").open("w")
        cmd = [
            sys.executable, "-m", "gpuguard.cli", "enforce", "--config", str(config),
            "--mode", "enforce", "--node-name", NODE,
            "--metrics-address", f"127.0.0.1:{port}", *source.enforcer_args(),
        ]  # fmt: skip
        result["enforcer_command"] = " ".join(cmd[1:])
        enforcer = subprocess.Popen(
            cmd, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            if enforcer.poll() is not None:
                raise RuntimeError(f"enforcer exited {enforcer.returncode}; see enforcer.log")
            with contextlib.suppress(OSError):
                if scrape(port).get("gpuguard_poll_duration_seconds_count", 0) >= 3:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError("enforcer /metrics not polling after 60 s")
            time.sleep(0.2)
        m0, c0 = scrape(port), cpu_seconds(enforcer.pid)

        plan = (
            [("greedy", f"greedy-{i}") for i in range(args.trials)]
            + [("stubborn", f"stubborn-{i}") for i in range(args.stubborn_trials)]
            + [("forked", f"forked-{i}") for i in range(args.forked_trials)]
            + [("forked-zombie", f"zombie-{i}") for i in range(args.zombie_trials)]
        )
        for kind, label in plan:
            t = run_trial(
                kind=kind, label=label, pod=pods[kind.removesuffix("-zombie")], nvml=nvml,
                records=records,
                limit_bytes=limit, grow_to_mib=grow_to_mib,
                timeout=args.trial_timeout,
            )  # fmt: skip
            trials.append(t)
            print(
                f"{label:12} pid {t.pid:>7} →TERM {ms(t.cross_to_term_s):>5} ms  →freed "
                f"{ms(t.cross_to_freed_s):>5} ms  peak {t.peak_bytes // MIB} MiB  exit "
                f"{t.exit_code}  init {t.cuda_init_s or 0:.2f}s {t.problem}",
                flush=True,
            )
            if enforcer.poll() is not None:
                raise RuntimeError(f"enforcer exited {enforcer.returncode} during the trials")
        m1, c1 = scrape(port), cpu_seconds(enforcer.pid)
        polls = (
            m1["gpuguard_poll_duration_seconds_count"] - m0["gpuguard_poll_duration_seconds_count"]
        )
        wall = m1["gpuguard_poll_duration_seconds_sum"] - m0["gpuguard_poll_duration_seconds_sum"]
        result["enforcer_cpu"] = {
            "polls": int(polls),
            "cpu_seconds": c1 - c0,
            "cpu_ms_per_poll": (c1 - c0) * 1000 / polls if polls else float("nan"),
            "wall_ms_per_poll": wall * 1000 / polls if polls else float("nan"),
        }
        time.sleep(2 * args.poll + 0.5)  # let the last Events flush
        result["events"] = source.events() if isinstance(source, ApiServer) else None
    finally:
        if enforcer is not None and enforcer.poll() is None:
            enforcer.terminate()
            try:
                enforcer.wait(timeout=15)
            except subprocess.TimeoutExpired:
                enforcer.kill()
                enforcer.wait()
        if log_file is not None:
            log_file.close()
        result["side_processes_alive_at_end"] = {w: p.poll() is None for w, p in side.items()}
        result["cleanup_problems"] = cg.close()
        for side_proc in side.values():
            side_proc.wait()
        source.close()
        nvml.close()

    wrong: list[str] = []
    for who, alive in result["side_processes_alive_at_end"].items():
        if not alive:
            wrong.append(f"{who} died")
    for r in read_records(records):
        if r["kind"] == "signal" and r["role"] == "hold":
            wrong.append(f"{r['label']} received SIGTERM")
    signalled: list[dict[str, Any]] = []
    for line in enforcer_lines(out / "enforcer.log"):
        if line.get("event") == "container_signalled":
            signalled.append({k: line.get(k) for k in ("pod", "signal", "pids", "used_bytes")})
            if line.get("pod") not in ("greedy", "stubborn", "forked"):
                wrong.append(f"enforcer signalled pod {line.get('pod')}")
    if isinstance(source, PodsFile):
        result["events"] = [
            {"pod": ln.get("pod"), "reason": ln.get("reason"), "count": 1, "source": "log"}
            for ln in enforcer_lines(out / "enforcer.log")
            if ln.get("event") == "pod_event"
        ]
    result["enforcer_signals"] = signalled
    result["wrong_kills"] = wrong
    result["trials"] = [asdict(t) for t in trials]
    result["summary"] = summarise(trials, target)
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    print_table(result)
    ok = bool(trials) and all(t.ok for t in trials) and not wrong
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
