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
- ``closer`` (``--closer-trials``, same limit): grows in 1 GiB steps to limit + 4 GiB, then
  closes every GPU device file it has open (char major 195, minor < 254: ``/dev/nvidia0``…) and
  keeps its memory (docs/gpu-e2e.md, Rerun after the ownership rule). gpuguard charges a process
  with a GPU file open at once and one without after NVML has listed its PID, with the same live
  process behind it, for ``owner_settle_seconds`` (5 s); either way it must stop it. The close comes
  ~0.4 s after the crossing, inside the grace period; a trial signalled before it closed fails
  (nothing tested);
- ``closer-before-start`` (``--closer-before-start``, on by default, one trial, its own pod):
  before the enforcer starts, a closer grows past the limit and closes its files; then the
  enforcer starts and must stop it within ``owner_settle_seconds`` + grace + ``--closer-margin``
  of its start (the enforcer has never seen the files open: the settle rule alone applies);
- ``neighbour`` (limit 8 GiB, holds 2 GiB, same GPU) and a host process (no pod, cgroup
  ``/gpuguard-e2e-<pid>/system.slice/e2e-host.service``, holds 2 GiB): must never be signalled;
- ``dra-greedy`` / ``dra-stubborn`` (``--dra``, needs ``--apiserver``; ``--dra-trials``,
  ``--dra-stubborn-trials``): the limit comes from DRA alone. The script plays NVIDIA's DRA
  driver (DeviceClass ``gpu.nvidia.com``, this node's ResourceSlice naming the GPU by its NVML
  UUID with a consumable ``memory`` capacity: ``tests/dra_objects.py``) and the scheduler (no
  controller-manager or scheduler runs): per trial a pod ``dra-greedy-<i>`` and a pod
  ``dra-modest-<n>``, no annotation, each naming its own ResourceClaim for a ``--limit-gib``
  memory share, allocated (device, shareID, consumedCapacity) and reserved for the pod as admin
  through the status subresource before the pod is bound to the node. The enforcer runs with
  ``limits.sources`` ending in ``dra``. The greedy (or stubborn) worker starts to grow only once
  the enforcer's /metrics shows the share as its pod's limit, and must be stopped as above; the
  modest pod holds ``--dra-modest-mib`` (within its share) and must never be signalled or die
  (a wrong kill). Both pods and claims are deleted after each trial.

Per trial: crossing = the first 10 ms NVML sample in which the trial pod's processes use more
than the limit; first signal = the worker's SIGTERM handler's CLOCK_MONOTONIC; freed = the first
sample in which the trial's PID is no longer listed. Reported: crossing → SIGTERM and
crossing → freed (p50/p99, nearest rank), wrong kills (signals received by, or deaths of,
neighbour and host process, and enforcer ``container_signalled`` lines for other pods; must be
0), the enforcer's CPU time per poll (its /proc CPU time over the growth of
``gpuguard_poll_duration_seconds_count``), and the target crossing → SIGTERM ≤ poll + grace +
50 ms at p99 (``closer``: + ``owner_settle_seconds``, it may be charged only once settled;
``closer-before-start``: enforcer start → SIGTERM ≤ ``owner_settle_seconds`` + grace +
``--closer-margin``, part of the pass/fail). ``closer-before-start`` also reports the time from
the enforcer's first ``memory_not_enforced`` line for the PID (``identity_changed``: not its own
memory yet) to SIGTERM.

How long the driver keeps listing a dead process's PID (what ``owner_settle_seconds`` must
exceed): for every greedy, stubborn and closer trial whose worker exited, the time from its
reap (``waitpid`` returned; the PID is free for reuse from then on) to the first sample without
its PID (``delisted_after_exit_s``, polled every 10 ms for up to 10 s; negative when the driver
dropped it before the reap, i.e. during the exit itself), min/p50/max as the row ``driver drops
a dead PID``; and, for ``forked``, how long the dead parent stays listed while its child holds
the memory (``listed_after_parent_exit_s``).

Usage (repository root, Python ≥ 3.11 with torch, nvidia-ml-py and gpuguard's dependencies)::

    python3 scripts/gpu_e2e.py --trials 20 --out /tmp/e2e
    python3 scripts/gpu_e2e.py --trials 5 --stubborn-trials 1 --forked-trials 1 \\
        --zombie-trials 0 --closer-trials 3 --out /tmp/e2e-closer
    python3 scripts/gpu_e2e.py --trials 5 --apiserver /tmp/kube --out /tmp/e2e-api
        # --apiserver DIR: real etcd + kube-apiserver from $TESTBIN_DIR (or testbin/bin, or
        # ``<name>.xz`` files there), RBAC from manifests/rbac.yaml, the enforcer with a
        # ServiceAccount token; Events read back from the API after the trials.
    python3 scripts/gpu_e2e.py --trials 0 --stubborn-trials 0 --forked-trials 0 \\
        --closer-trials 0 --no-closer-before-start --apiserver /tmp/kube --dra \\
        --dra-trials 8 --dra-stubborn-trials 2 --out /tmp/e2e-dra
        # --dra: pods limited by DRA memory shares only (rows dra-greedy, dra-stubborn);
        # TESTBIN_DIR may hold etcd.xz and kube-apiserver.xz (scripts/pack-apiserver.sh).

Writes ``results.json``, ``records.jsonl`` (worker records), ``enforcer.log`` and the pods and
config files to ``--out``; prints a table last. Exit status 0 when every trial was signalled
and freed (a closer also closed its GPU files first; the closer-before-start one was stopped
within its bound) and no wrong kill happened, 1 otherwise.
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
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.harness import pidfd_kill  # noqa: E402  (SIGKILL by pidfd: one helper for all)

WORKER = REPO / "scripts" / "gpu_e2e_worker.py"
NAMESPACE = "e2e"
NODE = "e2e"
GIB = 1 << 30
MIB = 1 << 20
LIMIT_ANNOTATION = "gpuguard.io/gpu-memory-limit"
KAI_MEMORY = "gpu-memory"  # KAI-Scheduler's annotation, MiB (docs/schedulers.md)
HAMI_MEMORY = "nvidia.com/gpumem"  # HAMi's container resource limit, MiB
WATCH_PERIOD = 0.010
CLOSER_STEP_MIB = 1024
"""A closer's growth step: from the crossing to limit + 4 GiB (and the close) in ~0.4 s, well
inside the 1 s grace, so the close comes before gpuguard's SIGTERM."""
CLOSER_BEFORE_START = "closer-before-start"
TRIAL_PODS = ("greedy", "stubborn", "forked", "closer", CLOSER_BEFORE_START)
"""Pods the enforcer may signal; a ``container_signalled`` line for any other is a wrong kill
(and a DRA trial's own pod, ``dra-greedy-<i>``/``dra-stubborn-<i>``: ``may_be_signalled``)."""
DRA_KINDS = {"dra-greedy": "greedy", "dra-stubborn": "stubborn"}
"""--dra trial kinds → their worker's role; each trial's pod is named after its label."""
DRA_MODEST = "dra-modest"
"""--dra: the pod sharing the GPU beside each DRA trial's, within its share: never signalled."""
DELIST_KINDS = ("greedy", "stubborn", "closer", CLOSER_BEFORE_START, *DRA_KINDS)
"""Kinds whose worker's own PID holds its memory: NVML's delisting after its exit is timed."""
DELIST_BOUND = 10.0
"""Seconds after a worker's reap to keep polling for its PID to leave NVML's list."""
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
    """systemd driver, Burstable, containerd (the kubelet's cgroup naming, as
    ``tests/kernel/cgroups.py`` builds it)."""
    u = pod_uid.replace("-", "_")
    return (
        f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/"
        f"cri-containerd-{container_id}.scope"
    )


def spawn_in(cgroup_dir: Path, argv: Sequence[str], **kw: Any) -> subprocess.Popen[str]:
    """Start argv inside ``cgroup_dir`` before it execs (a sh wrapper joins, then execs), in a
    session of its own: a ``timeout`` or Ctrl-C sent to this script's process group must not
    reach a worker (a signal to a neighbour would read as a wrong kill). Workers are ended by
    PID (``stop_worker``)."""
    script = 'echo $$ > "$1" || exit 97; shift; exec "$@"'
    kw.setdefault("start_new_session", True)
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

    def uuid(self) -> str:
        """The GPU's UUID as NVML (and so gpuguard and NVIDIA's DRA driver) names it."""
        value = self._n.nvmlDeviceGetUUID(self.handle)
        return value.decode() if isinstance(value, bytes) else str(value)

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


def owner_settle_seconds() -> float:
    """gpuguard's ``owner_settle_seconds`` (EnforcementPolicy's default: the config has no key
    for it, so the enforcer this script starts uses it too)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from gpuguard.core.model import EnforcementPolicy

    return EnforcementPolicy().owner_settle_seconds


def limit_sources(args: argparse.Namespace) -> list[str]:
    """``limits.sources``: gpuguard's annotation, ``--limit-source`` and, with ``--dra``,
    ``dra`` (the enforcer then reads this node's ResourceSlices and its pods' claims)."""
    return list(dict.fromkeys(["gpuguard", args.limit_source, *(["dra"] if args.dra else [])]))


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
        f"sources = {json.dumps(limit_sources(args))}\n"
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
    t_exit: float | None = None
    """When the script reaped the worker (``time.monotonic()`` right after ``waitpid``)."""
    t_delisted: float | None = None
    delisted_after_exit_s: float | None = None
    """greedy, stubborn, closer: from the reap to the first NVML sample without the PID
    (negative: the driver dropped it before the reap, during the exit itself)."""
    still_listed_after_exit: bool = False
    """NVML still listed the PID ``DELIST_BOUND`` seconds after the reap (a reused PID could
    be handed that memory)."""
    listed_after_parent_exit_s: float | None = None
    """forked: how long NVML kept listing the dead parent's PID (with memory) after it exited."""
    used_after_parent_exit_bytes: int | None = None
    child_pid: int | None = None
    child_listed: bool | None = None
    """forked: whether NVML ever listed the child that holds the memory."""
    t_closed: float | None = None
    """closer: when the worker had closed its GPU device files (its ``closed`` record)."""
    closed_fds: int | None = None
    closed_minors: list[int] | None = None
    kept_char_devices: list[str] | None = None
    """closer: the char devices it left open (``major:minor``: nvidiactl, nvidia-uvm, ...)."""
    used_after_close_bytes: int | None = None
    """closer: the most NVML listed under its PID between the close and SIGTERM."""
    cross_to_closed_s: float | None = None
    closed_to_term_s: float | None = None
    t_enforcer_start: float | None = None
    """closer-before-start: when the enforcer process was started (after the close)."""
    enforcer_start_to_term_s: float | None = None
    enforcer_start_to_freed_s: float | None = None
    enforcer_start_to_first_log_s: float | None = None
    first_refusal_event: str | None = None
    first_refusal_reason: str | None = None
    """closer-before-start: the enforcer's first ``memory_not_enforced`` (or
    ``violation_refused``) line naming the PID: its reason (``identity_changed`` expected)."""
    first_refusal_to_term_s: float | None = None
    bound_s: float | None = None
    """closer-before-start: enforcer start → SIGTERM must not exceed this."""
    dra_share_bytes: int | None = None
    """--dra: the pod's memory share (its claim's ``consumedCapacity.memory``), its only limit."""
    dra_limit_seen_s: float | None = None
    """--dra: from the claims' allocation to the enforcer's /metrics showing the share as the
    pod's limit (the worker starts to grow only then)."""
    dra_modest_alive: bool | None = None
    """--dra: the ``dra-modest`` pod's process, within its share on the same GPU, was alive
    when the trial ended (else a wrong kill)."""
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


def worker_argv(role: str, label: str, records: Path, grow_to_mib: int) -> list[str]:
    argv = [
        sys.executable, str(WORKER), "--role", role, "--label", label, "--record", str(records),
        "--max-mib", str(grow_to_mib),
    ]  # fmt: skip
    if role == "forked":
        # One allocation over the limit, fork, parent gone 0.3 s later: all before the grace
        # period ends, so only container-scoped escalation can reach the memory.
        argv += ["--step-mib", str(grow_to_mib), "--linger", "0.3"]
    elif role == "closer":
        argv += ["--step-mib", str(CLOSER_STEP_MIB)]
    return argv


class Reaper:
    """Reaps a worker the moment it exits, as a container's init or shell would, and notes
    when (the PID is free for reuse from then on)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.t_exit: float | None = None
        self._thread = threading.Thread(target=self._reap, daemon=True)
        self._thread.start()

    def _reap(self) -> None:
        self.proc.wait()
        self.t_exit = time.monotonic()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self, timeout: float | None) -> bool:
        """Whether the worker was reaped (and ``t_exit`` set) within ``timeout``."""
        self._thread.join(timeout)
        return self.done()


@dataclass(slots=True, kw_only=True)
class Watch:
    """A trial's NVML samples of its worker's PID: (time, used bytes, listed)."""

    trial: Trial
    nvml: Nvml
    limit_bytes: int
    timeline: list[tuple[float, int, bool]] = field(default_factory=list)
    seen: set[int] = field(default_factory=set)
    """Every PID NVML listed during the trial."""

    def sample(self) -> bool:
        """One sample; True once the PID is no longer listed after the crossing (freed)."""
        trial = self.trial
        t = time.monotonic()
        usage = self.nvml.usage()
        used = usage.get(trial.pid, 0)
        listed = trial.pid in usage
        self.seen.update(usage)
        self.timeline.append((t, used, listed))
        trial.peak_bytes = max(trial.peak_bytes, used)
        if trial.t_cross is None and used > self.limit_bytes:
            trial.t_cross = t
        if trial.t_cross is not None:
            if trial.t_under is None and used <= self.limit_bytes:
                trial.t_under = t
            if not listed:
                trial.t_freed = t
        return trial.t_freed is not None

    def run(self, deadline: float, stop: Callable[[], bool] = lambda: False) -> None:
        """Sample every ``WATCH_PERIOD`` until freed, ``stop()`` or the deadline."""
        while time.monotonic() < deadline:
            t = time.monotonic()
            if self.sample() or stop():
                return
            time.sleep(max(0.0, WATCH_PERIOD - (time.monotonic() - t)))


def stop_worker(proc: subprocess.Popen[str], reaper: Reaper | None, trial: Trial) -> None:
    """Wait a second for the worker to be gone, else SIGKILL it (a problem); note its exit."""
    if reaper is not None:
        reaper.join(1)
    else:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1)
    if proc.returncode is None:
        pidfd_kill(proc.pid)
        if reaper is not None:
            reaper.join(None)
        else:
            proc.wait()
        trial.problem = "worker still alive after the trial (killed by the script)"
    if reaper is not None:
        reaper.join(5)  # returncode is set inside wait(), t_exit just after it
        trial.t_exit = reaper.t_exit
    trial.exit_code = proc.returncode
    close_pipes(proc)


def close_pipes(proc: subprocess.Popen[str]) -> None:
    """Close our ends of a finished worker's stdin/stdout pipes."""
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()


def wait_delisted(nvml: Nvml, pid: int, bound: float) -> float | None:
    """The first 10 ms sample (within ``bound`` seconds) in which NVML no longer lists ``pid``."""
    deadline = time.monotonic() + bound
    while True:
        t = time.monotonic()
        if pid not in nvml.usage():
            return t
        if t > deadline:
            return None
        time.sleep(max(0.0, WATCH_PERIOD - (time.monotonic() - t)))


def note_delisting(watch: Watch) -> None:
    """``delisted_after_exit_s``: the reap → the first sample without the PID after the last
    sample that listed it (polling on when the trial's samples ended with it still listed)."""
    trial = watch.trial
    if trial.kind not in DELIST_KINDS or trial.t_exit is None:
        return
    last_listed = max((t for t, _, listed in watch.timeline if listed), default=None)
    if last_listed is None:
        return  # never listed: nothing to time
    gone = [t for t, _, listed in watch.timeline if not listed and t > last_listed]
    trial.t_delisted = gone[0] if gone else wait_delisted(watch.nvml, trial.pid, DELIST_BOUND)
    if trial.t_delisted is not None:
        trial.delisted_after_exit_s = trial.t_delisted - trial.t_exit
    else:
        trial.still_listed_after_exit = True


def finish_trial(watch: Watch, records: Path) -> Trial:
    """Fill a trial in from its samples and its worker's records, and judge it."""
    trial = watch.trial
    label, timeline = trial.label, watch.timeline
    mine = [r for r in read_records(records) if r.get("label") == label]
    for r in mine:
        if r["kind"] == "ready" and r.get("pid") == trial.pid:
            trial.cuda_init_s = r.get("cuda_init_s")
        elif r["kind"] == "go":
            trial.t_go = r["t"]
        elif r["kind"] == "signal" and trial.t_term is None:
            trial.t_term = r["t"]
        elif r["kind"] == "parent_exit":
            trial.t_parent_exit = r["t"]
        elif r["kind"] == "child":
            trial.child_pid = r["pid"]
            trial.child_listed = r["pid"] in watch.seen
        elif r["kind"] == "closed":
            trial.t_closed = r["t"]
            trial.closed_fds = len(r.get("fds") or [])
            trial.closed_minors = list(r.get("minors") or [])
            trial.kept_char_devices = list(r.get("kept") or [])
    if trial.t_parent_exit is not None:
        after = [(t, u) for t, u, listed in timeline if t > trial.t_parent_exit and listed]
        if after:
            trial.listed_after_parent_exit_s = after[-1][0] - trial.t_parent_exit
            trial.used_after_parent_exit_bytes = after[0][1]
    if trial.t_closed is not None:
        until = math.inf if trial.t_term is None else trial.t_term
        after_close = [u for t, u, listed in timeline if trial.t_closed < t < until and listed]
        trial.used_after_close_bytes = max(after_close, default=None)
        if trial.t_cross is not None:
            trial.cross_to_closed_s = trial.t_closed - trial.t_cross
        if trial.t_term is not None:
            trial.closed_to_term_s = trial.t_term - trial.t_closed
    if trial.t_cross is not None:
        if trial.t_term is not None:
            trial.cross_to_term_s = trial.t_term - trial.t_cross
        if trial.t_freed is not None:
            trial.cross_to_freed_s = trial.t_freed - trial.t_cross
    if trial.t_term is not None and trial.t_freed is not None:
        trial.term_to_freed_s = trial.t_freed - trial.t_term
    note_delisting(watch)
    problems = [trial.problem] if trial.problem else []
    if trial.t_cross is None:
        problems.append("never crossed the limit")
    elif trial.t_term is None:
        problems.append("no SIGTERM received")
    elif trial.t_freed is None:
        problems.append("memory not freed within the timeout")
    if trial.kind in ("closer", CLOSER_BEFORE_START):
        if trial.t_closed is None:
            problems.append(
                "never closed its GPU files (signalled before the close?): the close was not tested"
            )
        elif not trial.closed_fds:
            problems.append("found no GPU device file (char 195, minor < 254) open to close")
    trial.problem = "; ".join(problems)
    trial.ok = not trial.problem
    return trial


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
    before_go: Callable[[Trial], None] | None = None,
) -> Trial:
    """One trial: start the worker in the pod's cgroup, wait for its CUDA context, call
    ``before_go`` (a DRA trial waits there for the enforcer to show the pod's share), let it
    grow, sample until freed or ``timeout``, judge."""
    trial = Trial(kind=kind, label=label)
    role = {"forked-zombie": "forked", **DRA_KINDS}.get(kind, kind)
    argv = worker_argv(role, label, records, grow_to_mib)
    proc = spawn_in(pod.cgroup_dir, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    trial.pid = proc.pid
    watch = Watch(trial=trial, nvml=nvml, limit_bytes=limit_bytes)
    reaper: Reaper | None = None
    try:
        wait_ready(proc, label)
        assert proc.stdin is not None
        if before_go is not None:
            before_go(trial)
        if kind != "forked-zombie":
            # Reap the worker the moment it exits, as a container's init or shell would. A
            # forked-zombie trial leaves the exited parent a zombie until the trial ends.
            reaper = Reaper(proc)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        watch.run(time.monotonic() + timeout)
        if reaper is not None:
            reaper.join(5)
        else:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
    finally:
        stop_worker(proc, reaper, trial)
    return finish_trial(watch, records)


@dataclass(slots=True, kw_only=True)
class EarlyCloser:
    """The ``closer-before-start`` worker: started, over its limit and with its GPU files
    closed before the enforcer starts; finished (``finish_before_start``) after."""

    watch: Watch
    proc: subprocess.Popen[str]
    reaper: Reaper | None = None


def start_before_start(
    *, pod: PodSpec, nvml: Nvml, records: Path, limit_bytes: int, grow_to_mib: int, timeout: float
) -> EarlyCloser:
    """Start a closer, let it grow past the limit and close its GPU files, sampling NVML all
    along; return once it is listed with its memory after the close (no enforcer runs yet)."""
    label = CLOSER_BEFORE_START
    trial = Trial(kind=CLOSER_BEFORE_START, label=label)
    argv = worker_argv("closer", label, records, grow_to_mib)
    proc = spawn_in(pod.cgroup_dir, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    trial.pid = proc.pid
    early = EarlyCloser(watch=Watch(trial=trial, nvml=nvml, limit_bytes=limit_bytes), proc=proc)
    try:
        wait_ready(proc, label)
        assert proc.stdin is not None
        early.reaper = Reaper(proc)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        deadline = time.monotonic() + timeout
        closed: list[dict[str, Any]] = []
        while not closed:
            early.watch.run(time.monotonic() + 0.1)
            if early.reaper.done():
                raise RuntimeError(f"{label} exited ({proc.returncode}) before it closed its files")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{label} did not close its GPU files within {timeout} s")
            closed = [
                r
                for r in read_records(records)
                if r.get("label") == label and r["kind"] == "closed"
            ]
        # A few samples after the close: its memory should still be listed under its PID.
        early.watch.run(time.monotonic() + 0.2)
        after = [u for t, u, listed in early.watch.timeline if t > closed[0]["t"] and listed]
        print(
            f"{label}: pid {proc.pid} closed {len(closed[0].get('fds') or [])} GPU file(s) "
            f"(minors {closed[0].get('minors')}; left open {closed[0].get('kept')}); NVML lists "
            f"{f'{after[-1] // MIB} MiB' if after else 'nothing'} under its PID after the close; "
            "starting the enforcer",
            flush=True,
        )
    except BaseException:
        stop_worker(proc, early.reaper, trial)
        raise
    return early


def log_monotonic(line: Mapping[str, Any], wall_minus_monotonic: float) -> float | None:
    """An enforcer log line's ``timestamp`` (ISO, UTC) on the script's CLOCK_MONOTONIC."""
    stamp = line.get("timestamp")
    if not isinstance(stamp, str):
        return None
    try:
        wall = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
    return wall - wall_minus_monotonic


def finish_before_start(
    early: EarlyCloser,
    *,
    records: Path,
    log: Path,
    t_start: float,
    wall_minus_monotonic: float,
    bound: float,
    timeout: float,
    enforcer: subprocess.Popen[str],
) -> Trial:
    """Watch the early closer from the enforcer's start until its memory is freed (or
    ``timeout``), then judge it: stopped within ``bound`` of the enforcer's start."""
    trial, proc = early.watch.trial, early.proc
    trial.t_enforcer_start, trial.bound_s = t_start, bound
    try:
        early.watch.run(t_start + timeout, stop=lambda: enforcer.poll() is not None)
        if early.reaper is not None:
            early.reaper.join(5)
    finally:
        stop_worker(proc, early.reaper, trial)
    finish_trial(early.watch, records)
    lines = list(enforcer_lines(log)) if log.exists() else []
    if lines and (first := log_monotonic(lines[0], wall_minus_monotonic)) is not None:
        trial.enforcer_start_to_first_log_s = first - t_start
    for line in lines:
        if (
            line.get("event") in ("memory_not_enforced", "violation_refused")
            and line.get("pid") == trial.pid
        ):
            trial.first_refusal_event = line.get("event")
            trial.first_refusal_reason = line.get("reason")
            at = log_monotonic(line, wall_minus_monotonic)
            if at is not None and trial.t_term is not None:
                trial.first_refusal_to_term_s = trial.t_term - at
            break
    if trial.t_freed is not None:
        trial.enforcer_start_to_freed_s = trial.t_freed - t_start
    problems = [trial.problem] if trial.problem else []
    if trial.t_term is not None:
        trial.enforcer_start_to_term_s = trial.t_term - t_start
        if trial.t_term < t_start:
            problems.append("signalled before the enforcer started")
        elif trial.enforcer_start_to_term_s > bound:
            problems.append(
                f"SIGTERM {trial.enforcer_start_to_term_s:.2f} s after the enforcer started, "
                f"over the bound {bound:.2f} s"
            )
    if enforcer.poll() is not None:
        problems.append(f"enforcer exited {enforcer.returncode}")
    if (why := standing_by(log)) is not None:
        problems.append(f"the enforcer stood by: {why}")
    trial.problem = "; ".join(problems)
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
        self.node = self._post("/api/v1/nodes", {"metadata": {"name": NODE}})
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
# DRA (--dra)


class DraDriver:
    """--dra: plays NVIDIA's DRA driver and the scheduler on the real API server, where no
    controller-manager or scheduler runs: the DeviceClass ``gpu.nvidia.com``, this node's
    ResourceSlice naming the GPU by its NVML UUID with a consumable ``memory`` capacity
    (``tests/dra_objects.py``, the shape the driver publishes with
    ``--consumable-shares=memory``), and per pod a ResourceClaim for one memory share whose
    allocation (driver, pool, device, shareID, consumedCapacity) and ``reservedFor`` it writes
    as admin through the status subresource, as the scheduler does.

    Must not: write any object but the DeviceClass, the slice and the pods and claims of
    namespace ``e2e`` it creates (``remove`` deletes them)."""

    def __init__(self, api: ApiServer, nvml: Nvml) -> None:
        from tests import dra_objects

        self.api, self.objects = api, dra_objects
        self.gpu_uuid = nvml.uuid()
        facts = nvml.facts()
        api.cluster.admin_request(
            "POST", f"{dra_objects.RESOURCE_API}/deviceclasses", dra_objects.device_class()
        )
        body = dra_objects.nvidia_slice(
            api.node,
            [self.gpu_uuid],
            dra_objects.memory_quantity(facts["memory_total_bytes"]),
            product=str(facts["gpu"]),
        )
        self.slice = api.cluster.admin_request(
            "POST", f"{dra_objects.RESOURCE_API}/resourceslices", body
        )
        self.device = self.slice["spec"]["devices"][0]["name"]

    def add_pod(self, name: str, share_bytes: int) -> PodSpec:
        """A pod naming its own claim ``<name>-gpu`` for ``share_bytes`` of the GPU (no
        annotation: the share is its only limit), in the scheduler's order: the pod created
        unbound, its claim allocated and reserved for it, then the pod bound to this node (the
        enforcer, which sees only its node's pods, finds the claim allocated at once)."""
        api, objects = self.api.cluster, self.objects
        claim_name, memory = f"{name}-gpu", f"{share_bytes // MIB}Mi"
        container = {
            "name": "main",
            "image": "registry.invalid/cuda:1",
            "resources": {"claims": [{"name": "gpu"}]},
        }
        pod = api.admin_request(
            "POST",
            f"/api/v1/namespaces/{NAMESPACE}/pods",
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": NAMESPACE},
                "spec": {
                    "resourceClaims": [{"name": "gpu", "resourceClaimName": claim_name}],
                    "containers": [container],
                },
            },
        )
        claims = f"{objects.RESOURCE_API}/namespaces/{NAMESPACE}/resourceclaims"
        claim = api.admin_request(
            "POST", claims, objects.resource_claim(NAMESPACE, claim_name, memory)
        )
        api.admin_request(
            "PUT",
            f"{claims}/{claim_name}/status",
            objects.allocated(claim, node=NODE, device=self.device, memory=memory, pod=pod),
        )
        api.admin_request(
            "POST",
            f"/api/v1/namespaces/{NAMESPACE}/pods/{name}/binding",
            {
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {"name": name, "namespace": NAMESPACE},
                "target": {"apiVersion": "v1", "kind": "Node", "name": NODE},
            },
        )
        return PodSpec(name=name, limit_bytes=share_bytes, uid=pod["metadata"]["uid"])

    def remove(self, pod: PodSpec) -> None:
        """Delete the pod and its claim (no controller does it here); gone already is fine."""
        from tests.apiserver import AdminRequestError

        claims = f"{self.objects.RESOURCE_API}/namespaces/{NAMESPACE}/resourceclaims"
        for path in (
            f"/api/v1/namespaces/{NAMESPACE}/pods/{pod.name}?gracePeriodSeconds=0",
            f"{claims}/{pod.name}-gpu",
        ):
            try:
                self.api.cluster.admin_request("DELETE", path)
            except AdminRequestError as e:
                if e.code != 404:
                    raise


def scraped_limit(port: int, pod: str) -> float | None:
    """``gpuguard_pod_gpu_memory_limit_bytes`` of ``pod`` on the enforcer's /metrics (the
    enforcer's effective limit; present once the pod uses the GPU), or ``None``."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith("gpuguard_pod_gpu_memory_limit_bytes{") and f'pod="{pod}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def wait_for_limit(port: int, pod: str, limit_bytes: int, timeout: float) -> bool:
    """Whether the enforcer showed ``limit_bytes`` as the pod's limit within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if scraped_limit(port, pod) == limit_bytes:
                return True
        time.sleep(0.05)
    return False


@dataclass(slots=True, kw_only=True)
class DraTrialSetup:
    """What every DRA trial shares: the driver stand-in, the cgroups, the enforcer's metrics
    port, the records file and the sizes."""

    dra: DraDriver
    cg: Cgroups
    nvml: Nvml
    port: int
    records: Path
    share_bytes: int
    modest_mib: int
    grow_to_mib: int
    timeout: float


def start_modest(setup: DraTrialSetup, pod: PodSpec) -> subprocess.Popen[str]:
    """The modest pod's process: holds ``modest_mib`` (within its share) and must never get a
    signal (role ``hold``: a SIGTERM it records is a wrong kill)."""
    argv = [sys.executable, str(WORKER), "--role", "hold", "--label", pod.name,
            "--record", str(setup.records), "--max-mib", str(setup.modest_mib)]  # fmt: skip
    proc = spawn_in(pod.cgroup_dir, argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    wait_ready(proc, pod.name)
    assert proc.stdout is not None
    proc.stdout.readline()  # "held"
    return proc


def run_dra_trial(setup: DraTrialSetup, *, kind: str, label: str, index: int) -> Trial:
    """Two pods share the GPU by DRA memory shares of ``share_bytes`` each, no annotation:
    ``label`` (its worker grows past its share: must be stopped) and ``dra-modest-<index>``
    (holds ``modest_mib``, within its share: must be untouched). Both are deleted after."""
    dra = setup.dra
    pods = [dra.add_pod(label, setup.share_bytes)]
    modest: subprocess.Popen[str] | None = None
    try:
        pods.append(dra.add_pod(f"{DRA_MODEST}-{index}", setup.share_bytes))
        t_allocated = time.monotonic()
        for p in pods:
            p.cgroup_dir, p.cgroup_path = setup.cg.make(pod_cgroup_rel(p.uid, p.container_id))
        dra.api.publish(pods)
        modest = start_modest(setup, pods[1])

        def limit_seen(trial: Trial) -> None:
            trial.dra_share_bytes = setup.share_bytes
            if wait_for_limit(setup.port, label, setup.share_bytes, 20.0):
                trial.dra_limit_seen_s = time.monotonic() - t_allocated

        trial = run_trial(
            kind=kind, label=label, pod=pods[0], nvml=setup.nvml, records=setup.records,
            limit_bytes=setup.share_bytes, grow_to_mib=setup.grow_to_mib,
            timeout=setup.timeout, before_go=limit_seen,
        )  # fmt: skip
        trial.dra_modest_alive = modest.poll() is None
    finally:
        if modest is not None:
            pidfd_kill(modest.pid)
            modest.wait()
            close_pipes(modest)
        for p in pods:
            dra.remove(p)
    problems = [trial.problem] if trial.problem else []
    if trial.dra_limit_seen_s is None:
        problems.append("the enforcer's /metrics never showed the DRA share as the pod's limit")
    if not trial.dra_modest_alive:
        problems.append(f"{DRA_MODEST}-{index} died during the trial")
    trial.problem = "; ".join(problems)
    trial.ok = not trial.problem
    return trial


def may_be_signalled(pod: object) -> bool:
    """A trial pod: the only pods an enforcer ``container_signalled`` line may name."""
    return pod in TRIAL_PODS or (
        isinstance(pod, str) and pod.startswith(tuple(f"{k}-" for k in DRA_KINDS))
    )


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


def summarise(
    trials: Sequence[Trial], target_s: float, targets: Mapping[str, float] | None = None
) -> dict[str, Any]:
    """Per kind: latencies from the crossing and the target (``targets`` per kind, else
    ``target_s``). closer-before-start's target is on enforcer start → SIGTERM instead."""
    out: dict[str, Any] = {}
    for kind in sorted({t.kind for t in trials}):
        ts = [t for t in trials if t.kind == kind]
        term = [t.cross_to_term_s for t in ts if t.cross_to_term_s is not None]
        freed = [t.cross_to_freed_s for t in ts if t.cross_to_freed_s is not None]
        target = (targets or {}).get(kind, target_s)
        judged = term
        entry: dict[str, Any] = {
            "trials": len(ts),
            "ok": sum(t.ok for t in ts),
            "cross_to_term_p50_s": pct(term, 0.50),
            "cross_to_term_p99_s": pct(term, 0.99),
            "cross_to_term_max_s": max(term, default=None),
            "cross_to_freed_p50_s": pct(freed, 0.50),
            "cross_to_freed_p99_s": pct(freed, 0.99),
        }
        if kind in ("closer", CLOSER_BEFORE_START):
            entry["closed_before_term"] = sum(
                t.t_closed is not None and (t.t_term is None or t.t_closed < t.t_term) for t in ts
            )
        if kind == CLOSER_BEFORE_START:
            # The crossing is when the script let it cross, long before the enforcer existed:
            # this kind is timed (and judged) from the enforcer's start.
            judged = [
                t.enforcer_start_to_term_s for t in ts if t.enforcer_start_to_term_s is not None
            ]
            start_freed = [
                t.enforcer_start_to_freed_s for t in ts if t.enforcer_start_to_freed_s is not None
            ]
            refusal = [
                t.first_refusal_to_term_s for t in ts if t.first_refusal_to_term_s is not None
            ]
            entry |= {
                "enforcer_start_to_term_p50_s": pct(judged, 0.50),
                "enforcer_start_to_term_p99_s": pct(judged, 0.99),
                "enforcer_start_to_term_max_s": max(judged, default=None),
                "enforcer_start_to_freed_p50_s": pct(start_freed, 0.50),
                "enforcer_start_to_freed_p99_s": pct(start_freed, 0.99),
                "first_refusal_to_term_p50_s": pct(refusal, 0.50),
            }
        entry |= {
            "target_s": target,
            "target_from": "enforcer start" if kind == CLOSER_BEFORE_START else "crossing",
            "target_met": bool(judged)
            and len(judged) == len(ts)
            and (pct(judged, 0.99) or 0) <= target,
        }
        out[kind] = entry
    return out


def summarise_delisting(trials: Sequence[Trial]) -> dict[str, Any]:
    """How long NVML kept listing a worker's PID after the worker was reaped, over all trials
    that timed it (greedy, stubborn, closer): what ``owner_settle_seconds`` must exceed."""
    values = [t.delisted_after_exit_s for t in trials if t.delisted_after_exit_s is not None]
    return {
        "trials": len(values),
        "kinds": sorted({t.kind for t in trials if t.delisted_after_exit_s is not None}),
        "min_s": min(values, default=None),
        "p50_s": pct(values, 0.50),
        "max_s": max(values, default=None),
        "not_delisted": [t.label for t in trials if t.still_listed_after_exit],
    }


def print_table(result: dict[str, Any]) -> None:
    print()
    print(
        f"{'kind':19} {'n':>3} {'ok':>3} {'→TERM p50':>10} {'p99':>6} {'→freed p50':>11} "
        f"{'p99':>6} {'target':>7} met"
    )
    for kind, s in result["summary"].items():
        # closer-before-start: every column from the enforcer's start, not the crossing.
        at = "cross" if s["target_from"] == "crossing" else "enforcer_start"
        print(
            f"{kind:19} {s['trials']:>3} {s['ok']:>3} {ms(s[f'{at}_to_term_p50_s']):>10} "
            f"{ms(s[f'{at}_to_term_p99_s']):>6} {ms(s[f'{at}_to_freed_p50_s']):>11} "
            f"{ms(s[f'{at}_to_freed_p99_s']):>6} {ms(s['target_s']):>7} "
            f"{'yes' if s['target_met'] else 'NO'}"
            + (f" (from the {s['target_from']})" if s["target_from"] != "crossing" else "")
        )
    d = result["delisted_after_exit"]
    print(
        f"{'driver drops a dead PID':23} {d['trials']:>3}  min {ms(d['min_s'])} / p50 "
        f"{ms(d['p50_s'])} / max {ms(d['max_s'])} ms after the reap"
        + (
            f"; still listed {DELIST_BOUND:g} s after: {d['not_delisted']}"
            if d["not_delisted"]
            else ""
        )
    )
    print(
        "(milliseconds; crossing = first 10 ms NVML sample over the limit; closer's target adds "
        "owner_settle_seconds; a dead PID's time is from waitpid's return to the first sample "
        "without it, negative when the driver dropped it during the exit)"
    )
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
        if t["kind"] in ("closer", CLOSER_BEFORE_START) and t["t_closed"] is None:
            print(f"closer {t['label']}: did not close its GPU files")
        elif t["kind"] in ("closer", CLOSER_BEFORE_START):
            used = t["used_after_close_bytes"]
            print(
                f"closer {t['label']}: closed {t['closed_fds']} GPU file(s) (minors "
                f"{t['closed_minors']}, left open {t['kept_char_devices']}) "
                f"{ms(t['cross_to_closed_s'])} ms after the crossing, listed with "
                f"{'-' if used is None else used // MIB} MiB after it; SIGTERM "
                f"{ms(t['closed_to_term_s'])} ms after the close"
            )
        if t["kind"] == CLOSER_BEFORE_START:
            print(
                f"closer {t['label']}: enforcer start → SIGTERM {ms(t['enforcer_start_to_term_s'])}"
                f" ms (bound {ms(t['bound_s'])} ms; first log line "
                f"{ms(t['enforcer_start_to_first_log_s'])} ms after the start); first "
                f"{t['first_refusal_event'] or 'refusal line'} "
                f"({t['first_refusal_reason'] or 'none found'}) → SIGTERM "
                f"{ms(t['first_refusal_to_term_s'])} ms"
            )
        if t.get("dra_share_bytes") is not None:
            print(
                f"DRA {t['label']}: share {t['dra_share_bytes'] // MIB} MiB (its only limit), on "
                f"the enforcer's /metrics {ms(t['dra_limit_seen_s'])} ms after the allocation; "
                f"the {DRA_MODEST} pod beside it "
                f"{'untouched' if t['dra_modest_alive'] else 'DIED'}"
            )
        if t["problem"]:
            print(f"PROBLEM {t['label']}: {t['problem']}")
    if result.get("events") is not None:
        print(f"events: {len(result['events'])}")
        for e in result["events"]:
            print(f"  {e['pod']:19} {e['reason']} x{e['count']} ({e['source']})")


def print_trial(t: Trial) -> None:
    print(
        f"{t.label:19} pid {t.pid:>7} →TERM {ms(t.cross_to_term_s):>5} ms  →freed "
        f"{ms(t.cross_to_freed_s):>5} ms  peak {t.peak_bytes // MIB} MiB  exit "
        f"{t.exit_code}  dropped {ms(t.delisted_after_exit_s):>4} ms after reap  init "
        f"{t.cuda_init_s or 0:.2f}s {t.problem}",
        flush=True,
    )


def standing_by(log: Path) -> str | None:
    """Why the enforcer stands by (another enforcer holds the node lock), or ``None``: its
    last ``enforcement_standby``/``enforcement_lock_acquired`` line decides."""
    why: str | None = None
    for line in enforcer_lines(log) if log.exists() else ():
        if line.get("event") == "enforcement_standby":
            why = str(line.get("detail") or line.get("reason"))
        elif line.get("event") == "enforcement_lock_acquired":
            why = None
    return why


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
    parser.add_argument(
        "--closer-trials",
        type=int,
        default=3,
        help="trials whose worker closes its GPU device files after crossing (default 3)",
    )
    parser.add_argument(
        "--closer-before-start",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="before the enforcer starts, a closer crosses its limit and closes its GPU files; "
        "the enforcer must then stop it (default on)",
    )
    parser.add_argument(
        "--closer-margin",
        type=float,
        default=5.0,
        help="closer-before-start: enforcer start → SIGTERM may take owner_settle_seconds + "
        "grace + this (the enforcer's start-up, listings, polls), s (default 5)",
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
    parser.add_argument(
        "--dra",
        action="store_true",
        help="with --apiserver: publish this GPU in a ResourceSlice as NVIDIA's DRA driver does "
        "and run DRA trials (pods whose only limit is a claim's memory share, allocated by the "
        "script as the scheduler would); limits.sources gets dra",
    )
    parser.add_argument(
        "--dra-trials", type=int, default=5, help="--dra: dra-greedy trials (default 5)"
    )
    parser.add_argument(
        "--dra-stubborn-trials",
        type=int,
        default=1,
        help="--dra: dra-stubborn trials, the SIGKILL path (default 1)",
    )
    parser.add_argument(
        "--dra-modest-mib",
        type=int,
        default=2048,
        help="--dra: what the modest pod beside each DRA trial holds, within its share of "
        "--limit-gib (default 2048)",
    )
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
    if args.dra and args.apiserver is None:
        parser.error("--dra needs --apiserver DIR (the claims live in a real API server)")
    if os.geteuid() != 0:
        raise SystemExit("run as root: the script builds cgroups and the enforcer signals")

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    records = out / "records.jsonl"
    records.unlink(missing_ok=True)
    limit = int(args.limit_gib * GIB)
    grow_to_mib = limit // MIB + 4096
    target = args.poll + args.grace + 0.050
    settle = owner_settle_seconds()
    early_bound = settle + args.grace + args.closer_margin
    targets = {"closer": settle + target, CLOSER_BEFORE_START: early_bound}
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
    dra: DraDriver | None = None
    try:
        if args.dra:
            assert isinstance(source, ApiServer)
            dra = DraDriver(source, nvml)
            result["dra"] = {
                "gpu_uuid": dra.gpu_uuid,
                "device": dra.device,
                "slice": dra.slice["metadata"]["name"],
                "share_bytes": limit,
                "modest_mib": args.dra_modest_mib,
            }
        pods = {
            name: PodSpec(name=name, limit_bytes=lim)
            for name, lim in (
                ("greedy", limit),
                ("stubborn", limit),
                ("forked", limit),
                ("closer", limit),
                (CLOSER_BEFORE_START, limit),
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

        early: EarlyCloser | None = None
        if args.closer_before_start:
            # Before the enforcer exists: it never sees this process with a GPU file open.
            early = start_before_start(
                pod=pods[CLOSER_BEFORE_START], nvml=nvml, records=records, limit_bytes=limit,
                grow_to_mib=grow_to_mib, timeout=args.trial_timeout,
            )  # fmt: skip

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
        wall_minus_monotonic = time.time() - time.monotonic()
        t_start = time.monotonic()
        enforcer = subprocess.Popen(
            cmd, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        if early is not None:
            t = finish_before_start(
                early, records=records, log=out / "enforcer.log", t_start=t_start,
                wall_minus_monotonic=wall_minus_monotonic, bound=early_bound,
                timeout=early_bound + args.termination_timeout + 5.0, enforcer=enforcer,
            )  # fmt: skip
            trials.append(t)
            print_trial(t)
        deadline = time.monotonic() + 60
        while True:
            if enforcer.poll() is not None:
                raise RuntimeError(f"enforcer exited {enforcer.returncode}; see enforcer.log")
            with contextlib.suppress(OSError):
                if scrape(port).get("gpuguard_poll_duration_seconds_count", 0) >= 3:
                    break
            if time.monotonic() > deadline:
                why = standing_by(out / "enforcer.log")
                raise TimeoutError(
                    "enforcer /metrics not polling after 60 s"
                    + ("" if why is None else f" (it stands by: {why})")
                )
            time.sleep(0.2)
        if (why := standing_by(out / "enforcer.log")) is not None:
            raise RuntimeError(f"the enforcer acts on nothing: {why}")
        m0, c0 = scrape(port), cpu_seconds(enforcer.pid)

        plan = (
            [("greedy", f"greedy-{i}") for i in range(args.trials)]
            + [("stubborn", f"stubborn-{i}") for i in range(args.stubborn_trials)]
            + [("forked", f"forked-{i}") for i in range(args.forked_trials)]
            + [("forked-zombie", f"zombie-{i}") for i in range(args.zombie_trials)]
            + [("closer", f"closer-{i}") for i in range(args.closer_trials)]
        )
        for kind, label in plan:
            t = run_trial(
                kind=kind, label=label, pod=pods[kind.removesuffix("-zombie")], nvml=nvml,
                records=records,
                limit_bytes=limit, grow_to_mib=grow_to_mib,
                timeout=args.trial_timeout,
            )  # fmt: skip
            trials.append(t)
            print_trial(t)
            if enforcer.poll() is not None:
                raise RuntimeError(f"enforcer exited {enforcer.returncode} during the trials")
        if dra is not None:
            setup = DraTrialSetup(
                dra=dra, cg=cg, nvml=nvml, port=port, records=records, share_bytes=limit,
                modest_mib=args.dra_modest_mib, grow_to_mib=grow_to_mib,
                timeout=args.trial_timeout,
            )  # fmt: skip
            dra_plan = [("dra-greedy", i) for i in range(args.dra_trials)] + [
                ("dra-stubborn", i) for i in range(args.dra_stubborn_trials)
            ]
            for n, (kind, i) in enumerate(dra_plan):
                t = run_dra_trial(setup, kind=kind, label=f"{kind}-{i}", index=n)
                trials.append(t)
                print_trial(t)
                if enforcer.poll() is not None:
                    raise RuntimeError(f"enforcer exited {enforcer.returncode} (DRA trials)")
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
            close_pipes(side_proc)
        source.close()
        nvml.close()

    wrong: list[str] = []
    for who, alive in result["side_processes_alive_at_end"].items():
        if not alive:
            wrong.append(f"{who} died")
    for r in read_records(records):
        if r["kind"] == "signal" and r["role"] == "hold":
            wrong.append(f"{r['label']} received SIGTERM")
    for t in trials:
        if t.dra_modest_alive is False:
            wrong.append(f"the {DRA_MODEST} pod beside {t.label} died")
    signalled: list[dict[str, Any]] = []
    for line in enforcer_lines(out / "enforcer.log"):
        if line.get("event") == "container_signalled":
            signalled.append({k: line.get(k) for k in ("pod", "signal", "pids", "used_bytes")})
            if not may_be_signalled(line.get("pod")):
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
    result["owner_settle_seconds"] = settle
    result["summary"] = summarise(trials, target, targets)
    result["delisted_after_exit"] = summarise_delisting(trials)
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    print_table(result)
    ok = bool(trials) and all(t.ok for t in trials) and not wrong
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
