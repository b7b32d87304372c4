"""GPU end-to-end run of ``gpuguard enforce`` on a real NVIDIA GPU node (run as root).

Owns: building kubepods-like cgroups (systemd driver, containerd, Burstable) under one unique
root ``/gpuguard-e2e-<pid>`` of the cgroup v2 tree, a pods manifest (or real Pods in a real
kube-apiserver with ``--apiserver``), starting the real enforcer against them, running trials
with PyTorch workloads (``scripts/gpu_e2e_worker.py``), timing each with a 10 ms NVML watcher
and CLOCK_MONOTONIC signal receipts, and reporting latencies, wrong kills and CPU per poll.
Must not: signal any process it did not start (cleanup SIGKILLs by pidfd only the processes it
started and the members of its own cgroups), touch cgroups outside its root, change any GPU
setting, or listen on anything but 127.0.0.1 and, with ``--unallocated-trials``, the unix socket
of its own pod-resources server in a temporary directory of its own.

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
- ``hidden-thread`` (``--hidden-trials``, same limit, its own pod): like ``forked``, but every
  CUDA call (importing torch, the context, the allocation, the fork) happens in one thread that
  first gave itself a private file table (``unshare(CLONE_FILES)``): ``/proc/<pid>/fd`` (the
  leader's table) shows no GPU device file while ``/proc/<pid>/task/<tid>/fd`` does, which the
  script checks from outside once the worker is ready (``leader_gpu_files``,
  ``task_gpu_files``; a leader that shows one fails the trial: nothing hidden was tested). The
  child, forked in that thread, copies its table and keeps the context; the parent exits 0.3 s
  later, well within ``owner_settle_seconds``: NVML lists a ghost PID whose only occupant hid
  its GPU files. gpuguard must stop the pod (the child gets SIGTERM) and the memory be freed;
- ``mps-tenant`` and ``mps-neighbour`` (``--mps-trials``, same limit each; MPS not declared by
  the admin: the config has no ``mps_gpus``): per trial the tenant starts an MPS control daemon
  of its own (``nvidia-cuda-mps-control -d``, started inside the tenant's container cgroup with
  ``CUDA_MPS_PIPE_DIRECTORY`` and ``CUDA_MPS_LOG_DIRECTORY`` in a fresh temporary directory, so
  the server it spawns for the first client lands there too), one MPS client of that pod
  holding ``--mps-client-mib`` (100 MiB), then an ordinary process of the tenant (its
  ``CUDA_MPS_PIPE_DIRECTORY`` a directory where no daemon listens: CUDA then runs without MPS)
  and one of ``mps-neighbour`` grow past their limits together. Both must be stopped; the MPS
  client and server must be charged to the tenant (its ``gpuguard_pod_gpu_memory_used_bytes``
  above 0 on /metrics before its ordinary process starts) and never signalled for another pod.
  The tenant's crossing counts its MPS client and server (as NVML lists them) with its ordinary
  process. The daemon is asked to quit (``echo quit | nvidia-cuda-mps-control``, same
  environment) after every trial, also on failure or SIGTERM, unless the tenant's stop already
  ended it; what stays of it is killed by pidfd. Without ``nvidia-cuda-mps-control`` on the
  machine both rows say ``skipped: no nvidia-cuda-mps-control`` (not a failure); a daemon or
  client that does not come up fails them, with what it printed and its logs kept in
  ``results.json`` (``mps``), and no further MPS trial is tried;
- ``two-containers`` (``--container-trials``, no pod-wide limit: its container ``main``
  declares its own limit, ``--limit-gib``, as KAI-Scheduler declares it per container,
  ``nvidia.com/container.main.gpu-memory.limit``; ``limits.sources`` gets ``kai``): the pod has
  a second container, ``side``, with a cgroup of its own. Per trial a worker of ``side`` holds
  ``--container-side-mib`` (within what the pod's limit leaves it), then a greedy worker of
  ``main`` grows past ``main``'s own limit (the crossing: ``main``'s own memory over it): only
  ``main`` may be stopped. ``side`` receiving a signal, dying, or an enforcer
  ``container_signalled`` line for the pod naming another container than ``main`` is a wrong
  kill (``side_alive`` per trial); the side worker is killed by pidfd after the trial;
- ``guarded`` (``--guarded-trials``, same limit, its own pod): after all other trials the
  script stops its enforcer and starts a second one with ``enforcement.alloc_guard = true`` and
  ``alloc_guard_library`` (``--alloc-guard-library``, else the ``libcuda.so`` file the
  neighbour worker maps); a greedy worker grows past the limit. The guard freezes the crossing
  call before it runs (NVML need never show it): the crossing is the worker's first
  ``allocating`` record whose target, with what NVML listed for it before it grew, is over the
  limit. Judged as greedy; reported besides: whether NVML ever showed it over
  (``crossing_seen_in_nvml``), the enforcer's ``allocation_frozen`` line for its PID and its
  guard lines (``alloc_guard*``, ``allocation_*``), and whether the guard attached;
- ``neighbour`` (limit 8 GiB, holds 2 GiB, same GPU) and a host process (no pod, cgroup
  ``/gpuguard-e2e-<pid>/system.slice/e2e-host.service``, holds 2 GiB): must never be signalled;
- ``dra-greedy`` / ``dra-stubborn`` (``--dra``, needs ``--apiserver``; ``--dra-trials``,
  ``--dra-stubborn-trials``): the limit comes from DRA alone. The script plays NVIDIA's DRA
  driver (DeviceClass ``gpu.nvidia.com``, this node's ResourceSlice naming the GPU by its NVML
  UUID with a consumable ``memory`` capacity: ``rigs/dra_objects.py``) and the scheduler (no
  controller-manager or scheduler runs): per trial a pod ``dra-greedy-<i>`` and a pod
  ``dra-modest-<n>``, no annotation, each naming its own ResourceClaim for a ``--limit-gib``
  memory share, allocated (device, shareID, consumedCapacity) and reserved for the pod as admin
  through the status subresource before the pod is bound to the node. The enforcer runs with
  ``limits.sources`` ending in ``dra``. The greedy (or stubborn) worker starts to grow only once
  the enforcer's /metrics shows the share as its pod's limit, and must be stopped as above; the
  modest pod holds ``--dra-modest-mib`` (within its share) and must never be signalled or die
  (a wrong kill). Both pods and claims are deleted after each trial;
- ``unallocated-<i>`` (``--unallocated-trials``, a pod of its own per trial, no annotation: no
  limit) requests no GPU: the script serves the kubelet's pod-resources API itself (a real gRPC
  ``v1.PodResourcesLister``, ``rigs/podresources.py``, on a unix socket in a temporary
  directory of its own) and lists every pod of the run there, the ``neighbour`` and the limited
  pods with a ``nvidia.com/gpu`` replica of the real GPU (``<UUID>::<k>``), the unallocated ones
  with no device. The enforcer's config then sets ``node.pod_resources_socket`` to it and
  ``enforcement.unallocated = "stop"`` (without these trials the socket is ``""``: no reads, as
  before). Per trial the pod is added to the pods (file or API server) and to the kubelet's
  answer; once the enforcer has read that answer (its periodic read, every 5 s: on a node the
  kubelet lists a pod from its admission, before its containers run), its worker (role
  ``greedy``, one step to ``--unallocated-mib``) holds that memory and must be reported (the
  enforcer's ``gpu_used_without_allocation`` line for the pod, a ``GPUUsedWithoutAllocation``
  Event: a ``pod_event`` line in pods-file mode, read back from the API server with
  ``--apiserver``, and ``gpuguard_unallocated_gpu_use_total`` up by one on /metrics) and
  stopped (SIGTERM). Its crossing is its first listing (a limit of 0 bytes); the stop also
  waits for an answer read after the use began, which the enforcer asks for at once (within
  the grace period: the target is greedy's). Before the enforcer starts, a worker of the pod
  ``unallocated`` (no GPU either) holds the same memory while ``gpuguard inspect`` and
  ``inspect --json`` run with the enforcer's config and pods (``inspect.txt``,
  ``inspect.json``): the row of that pod must say BOUND BY ``none`` and allocation
  ``not_allocated`` (``no GPU``), with the line "e2e/unallocated uses GPU <i> without an
  allocation (allocated: no GPU)" under the table, and the neighbour's ``annotation`` and
  ``allocated``; the worker is then killed by pidfd. A ``gpu_used_without_allocation`` line for
  any other pod is a wrong report (fails the run).

Per trial: crossing = the first 10 ms NVML sample in which the trial pod's processes use more
than the limit; first signal = the worker's SIGTERM handler's CLOCK_MONOTONIC; freed = the first
sample in which the trial's PID is no longer listed. Reported: crossing → SIGTERM and
crossing → freed (p50/p99, nearest rank), wrong kills (signals received by, or deaths of,
neighbour and host process, and enforcer ``container_signalled`` lines for other pods; must be
0; for MPS trials also a ``container_signalled`` line of another pod naming a tenant's MPS
process), the enforcer's CPU time per poll (its /proc CPU time over the growth of
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

    python3 -m scripts.gpu_e2e --trials 20 --out /tmp/e2e
    python3 -m scripts.gpu_e2e --trials 5 --stubborn-trials 1 --forked-trials 1 \\
        --zombie-trials 0 --closer-trials 3 --out /tmp/e2e-closer
    python3 -m scripts.gpu_e2e --trials 4 --stubborn-trials 1 --forked-trials 1 \\
        --closer-trials 1 --hidden-trials 5 --mps-trials 3 --out /tmp/e2e-hidden-mps
        # the hidden-file and tenant-MPS trials beside a few of the others (~3-4 minutes)
    python3 -m scripts.gpu_e2e --trials 3 --stubborn-trials 1 --forked-trials 1 \\
        --closer-trials 1 --unallocated-trials 5 --out /tmp/e2e-unallocated
        # GPU use without an allocation beside a few of the others (~3 minutes)
    python3 -m scripts.gpu_e2e --trials 3 --stubborn-trials 1 --forked-trials 1 \\
        --closer-trials 1 --container-trials 5 --out /tmp/e2e-containers
        # two containers of one pod, one over its own limit: only it is stopped (~2 minutes)
    python3 -m scripts.gpu_e2e --trials 3 --stubborn-trials 0 --forked-trials 0 \\
        --closer-trials 0 --no-closer-before-start --guarded-trials 5 --out /tmp/e2e-guarded
        # the eBPF allocation guard on (a second enforcer): guard.bpf.o must be in
        # gpuguard/adapters/allocguard/ (scripts/gpu_allocguard.py pack) and the loader built
    python3 -m scripts.gpu_e2e --trials 5 --apiserver /tmp/kube --out /tmp/e2e-api
        # --apiserver DIR: real etcd + kube-apiserver from $TESTBIN_DIR (or testbin/bin, or
        # ``<name>.xz`` files there), RBAC from manifests/rbac.yaml, the enforcer with a
        # ServiceAccount token; Events read back from the API after the trials.
    python3 -m scripts.gpu_e2e --trials 0 --stubborn-trials 0 --forked-trials 0 \\
        --closer-trials 0 --no-closer-before-start --apiserver /tmp/kube --dra \\
        --dra-trials 8 --dra-stubborn-trials 2 --out /tmp/e2e-dra
        # --dra: pods limited by DRA memory shares only (rows dra-greedy, dra-stubborn);
        # TESTBIN_DIR may hold etcd.xz and kube-apiserver.xz (scripts/pack-apiserver.sh).

Writes ``results.json`` (the machine, the command and the commit: ``$GPU_E2E_COMMIT`` for a
tree without ``.git``; every trial, the summary, wrong kills, and ``mps``: each MPS trial's
daemon, server and client, NVML's lists, the quit and the MPS logs; ``unallocated``: the
socket, each pod's device IDs in the kubelet's answer, how many ``List`` calls it answered, and
inspect's exit statuses and problems; ``wrong_reports``), ``records.jsonl``
(worker records), ``enforcer.log`` (and, with ``--guarded-trials``, ``enforcer-guarded.log``
and ``config-guarded.toml``; ``alloc_guard`` in ``results.json``), the pods and config files
and, with ``--unallocated-trials``, ``inspect.txt`` and ``inspect.json`` to ``--out``; prints a
table last. Exit status 0 when every trial was signalled and freed (a closer also closed its GPU
files first; the closer-before-start one was stopped within its bound; an
unallocated one was reported in the log, an Event and the counter; inspect showed what it must; a
hidden-thread worker's leader showed no GPU file and it forked its child; an MPS tenant's
daemon, server and client came up, in its cgroup and charged to it) and no wrong kill or wrong
report happened, 1 otherwise; MPS trials skipped for want of ``nvidia-cuda-mps-control`` count
neither way.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime
import importlib
import json
import lzma
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

from rigs.e2e_node import NAMESPACE, NODE, Cgroups, PodSpec, pod_cgroup_rel, spawn_in, v2_mount
from rigs.processes import pidfd_kill  # SIGKILL by pidfd: one helper for all
from rigs.provenance import header, header_lines
from scripts.gpu_allocguard import mapped_libcuda
from scripts.gpu_e2e_worker import gpu_file_links  # torch is imported only by its main

REPO = Path(__file__).resolve().parents[1]

WORKER = REPO / "scripts" / "gpu_e2e_worker.py"
GIB = 1 << 30
MIB = 1 << 20
WATCH_PERIOD = 0.010
CLOSER_STEP_MIB = 1024
"""A closer's growth step: from the crossing to limit + 4 GiB (and the close) in ~0.4 s, well
inside the 1 s grace, so the close comes before gpuguard's SIGTERM."""
CLOSER_BEFORE_START = "closer-before-start"
HIDDEN = "hidden-thread"
"""--hidden-trials: the kind, its pod and its worker's role."""
MPS_TENANT = "mps-tenant"
MPS_NEIGHBOUR = "mps-neighbour"
MPS_CLIENT = "mps-client"
"""--mps-trials: the tenant's MPS client (label ``mps-client-<i>``, role ``hold``), a member of
the tenant's container: a signal to it when the tenant is stopped is no wrong kill."""
MPS_CONTROL = "nvidia-cuda-mps-control"
MPS_CONTROL_DIRS = ("/usr/local/nvidia/bin", "/usr/bin", "/usr/local/bin")
"""Where to look for ``nvidia-cuda-mps-control`` beyond PATH (NVIDIA's container toolkit puts the
driver's utilities in ``/usr/local/nvidia/bin`` or ``/usr/bin``)."""
MPS_SKIPPED = f"skipped: no {MPS_CONTROL}"
GUARDED = "guarded"
"""--guarded-trials: the kind and its pod (the worker's role is ``greedy``)."""
GUARDED_TERM_TARGET = 0.100
"""guarded: crossing → SIGTERM we aim for (a target, not a measured figure): the guard freezes
the crossing call, the enforcer lists the device at once and confirms without the grace
period."""
GUARD_EVENTS = ("alloc_guard", "allocation_")
"""Prefixes of the enforcer's allocation guard log events (``alloc_guard_attached``,
``alloc_guard_unavailable``, ``allocation_frozen``, ``allocation_thawed``, ...)."""
TRIAL_PODS = (
    "greedy", "stubborn", "forked", "closer", CLOSER_BEFORE_START, HIDDEN, MPS_TENANT,
    MPS_NEIGHBOUR, "two-containers", GUARDED,
)  # fmt: skip
"""Pods the enforcer may signal; a ``container_signalled`` line for any other is a wrong kill
(and a DRA trial's own pod, ``dra-greedy-<i>``/``dra-stubborn-<i>``, and an unallocated
trial's, ``unallocated-<i>``: ``may_be_signalled``)."""
TWO_CONTAINERS = "two-containers"
"""--container-trials: the kind and the pod (containers ``main`` and ``side``)."""
UNALLOCATED = "unallocated"
"""--unallocated-trials: the kind and its pods' names (``unallocated-<i>`` per trial; the pod
``unallocated`` itself is inspect's, whose worker is gone before the enforcer starts: never
signalled)."""
GPU_RESOURCE = "nvidia.com/gpu"
"""The device plugin's resource the kubelet's answer names for every pod but the unallocated."""
UNALLOCATED_EVENT = "GPUUsedWithoutAllocation"
DRA_KINDS = {"dra-greedy": "greedy", "dra-stubborn": "stubborn"}
"""--dra trial kinds → their worker's role; each trial's pod is named after its label."""
DRA_MODEST = "dra-modest"
"""--dra: the pod sharing the GPU beside each DRA trial's, within its share: never signalled."""
DELIST_KINDS = (
    "greedy", GUARDED, "stubborn", "closer", CLOSER_BEFORE_START, MPS_TENANT, MPS_NEIGHBOUR,
    UNALLOCATED, *DRA_KINDS,
)  # fmt: skip
"""Kinds whose worker's own PID holds its memory: NVML's delisting after its exit is timed."""
DELIST_BOUND = 10.0
"""Seconds after a worker's reap to keep polling for its PID to leave NVML's list."""
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------
# NVML watcher


class Nvml:
    def __init__(self, index: int) -> None:
        import pynvml

        self._n = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)

    def usage(self, *, mps: bool = False) -> dict[int, int]:
        """PID → used bytes (compute processes, and with ``mps`` MPS clients too; unknown usage
        counts as 0 here)."""
        procs = self._n.nvmlDeviceGetComputeRunningProcesses(self.handle)
        used = {p.pid: int(p.usedGpuMemory or 0) for p in procs}
        if mps:
            with contextlib.suppress(self._n.NVMLError):
                for p in self._n.nvmlDeviceGetMPSComputeRunningProcesses(self.handle):
                    used[p.pid] = max(used.get(p.pid, 0), int(p.usedGpuMemory or 0))
        return used

    def listing(self) -> dict[str, Any]:
        """NVML's compute and MPS-client lists as they are (PID → bytes, ``None``: unknown), or
        the error a list gave: the raw facts of an MPS trial."""
        out: dict[str, Any] = {}
        for name, call in (
            ("compute", self._n.nvmlDeviceGetComputeRunningProcesses),
            ("mps", self._n.nvmlDeviceGetMPSComputeRunningProcesses),
        ):
            try:
                out[name] = {str(p.pid): p.usedGpuMemory for p in call(self.handle)}
            except self._n.NVMLError as e:
                out[name] = f"error: {e}"
        return out

    def compute_mode(self) -> str:
        """The GPU's compute mode as NVML names it (read only: the script never changes it)."""
        n = self._n
        try:
            mode = n.nvmlDeviceGetComputeMode(self.handle)
        except n.NVMLError as e:
            return f"unknown ({e})"
        names = {
            n.NVML_COMPUTEMODE_DEFAULT: "default",
            n.NVML_COMPUTEMODE_PROHIBITED: "prohibited",
            n.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: "exclusive_process",
        }
        return names.get(mode, str(mode))

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


def start_enforcer(
    config: Path, log_file: IO[str], source_args: Sequence[str], port: int
) -> tuple[subprocess.Popen[str], list[str]]:
    """``gpuguard enforce`` with ``config``, its output to ``log_file``; the process and its
    command."""
    cmd = [
        sys.executable, "-m", "gpuguard.cli", "enforce", "--config", str(config),
        "--mode", "enforce", "--node-name", NODE,
        "--metrics-address", f"127.0.0.1:{port}", *source_args,
    ]  # fmt: skip
    enforcer = subprocess.Popen(
        cmd, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    return enforcer, cmd


def wait_polling(enforcer: subprocess.Popen[str], port: int, log: Path) -> None:
    """Until the enforcer has polled three times (its /metrics); raises when it exited, stands
    by, or does not poll within 60 s."""
    deadline = time.monotonic() + 60
    while True:
        if enforcer.poll() is not None:
            raise RuntimeError(f"enforcer exited {enforcer.returncode}; see {log.name}")
        with contextlib.suppress(OSError):
            if scrape(port).get("gpuguard_poll_duration_seconds_count", 0) >= 3:
                break
        if time.monotonic() > deadline:
            why = standing_by(log)
            raise TimeoutError(
                "enforcer /metrics not polling after 60 s"
                + ("" if why is None else f" (it stands by: {why})")
            )
        time.sleep(0.2)
    if (why := standing_by(log)) is not None:
        raise RuntimeError(f"the enforcer acts on nothing: {why}")


def stop_enforcer(enforcer: subprocess.Popen[str]) -> None:
    """SIGTERM the enforcer the script started, SIGKILL after 15 s."""
    if enforcer.poll() is None:
        enforcer.terminate()
        try:
            enforcer.wait(timeout=15)
        except subprocess.TimeoutExpired:
            enforcer.kill()
            enforcer.wait()


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


def pod_resources_read_seconds() -> float:
    """How often the enforcer reads the kubelet's pod resources when nothing asks sooner
    (``runtime.allocations.READ_INTERVAL_SECONDS``): an unallocated pod added to the answer is
    seen as such within this, then its stop waits for a read sent after its use began."""
    from gpuguard.runtime.allocations import READ_INTERVAL_SECONDS

    return READ_INTERVAL_SECONDS


def owner_settle_seconds() -> float:
    """gpuguard's ``owner_settle_seconds`` (EnforcementPolicy's default: the config has no key
    for it, so the enforcer this script starts uses it too)."""
    from gpuguard.core.model import EnforcementPolicy

    return EnforcementPolicy().owner_settle_seconds


def limit_sources(args: argparse.Namespace) -> list[str]:
    """``limits.sources``: gpuguard's annotation, ``--limit-source``, ``kai`` with
    ``--container-trials`` (the two-containers pod's own limit is KAI's per-container key) and,
    with ``--dra``, ``dra`` (the enforcer then reads this node's ResourceSlices and its pods'
    claims)."""
    kai = ["kai"] if args.container_trials else []
    dra = ["dra"] if args.dra else []
    return list(dict.fromkeys(["gpuguard", args.limit_source, *kai, *dra]))


def write_config(
    path: Path,
    args: argparse.Namespace,
    pod_resources_socket: Path | None = None,
    *,
    alloc_guard: bool = False,
    alloc_guard_library: Path | None = None,
) -> None:
    """The enforcer's (and inspect's) config. ``pod_resources_socket``: the script's own
    pod-resources server (``--unallocated-trials``), read by the enforcer with
    ``enforcement.unallocated = "stop"``; without it ``node.pod_resources_socket`` is ``""``:
    no reads, every allocation unknown, as before the setting existed (gpuguard's default, the
    kubelet's socket, could be a real kubelet's on the machine). ``alloc_guard``: the guarded
    trials' enforcer, with ``enforcement.alloc_guard = true`` and, when known,
    ``alloc_guard_library`` (else gpuguard's default path)."""
    fast = "" if args.fast_interval is None else f"fast_interval_seconds = {args.fast_interval}\n"
    socket = "" if pod_resources_socket is None else str(pod_resources_socket)
    unallocated = "" if pod_resources_socket is None else 'unallocated = "stop"\n'
    guard = "alloc_guard = true\n" if alloc_guard else ""
    if alloc_guard and alloc_guard_library is not None:
        guard += f"alloc_guard_library = {json.dumps(str(alloc_guard_library))}\n"
    path.write_text(
        "version = 1\n"
        "[node]\n"
        'cgroup_root = "/sys/fs/cgroup"\n'
        f"pod_resources_socket = {json.dumps(socket)}\n"
        "[enforcement]\n"
        'mode = "enforce"\n'
        f"poll_interval_seconds = {args.poll}\n"
        f"{fast}"
        f"grace_seconds = {args.grace}\n"
        f"termination_timeout_seconds = {args.termination_timeout}\n"
        f"{unallocated}"
        f"{guard}"
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
    leader_gpu_files: list[str] | None = None
    """hidden-thread: the GPU device files ``/proc/<pid>/fd`` (the leader's table) showed once
    the worker was ready (none, when the hiding worked)."""
    task_gpu_files: dict[int, list[str]] | None = None
    """hidden-thread: per thread whose ``/proc/<pid>/task/<tid>/fd`` showed GPU device files,
    those files (the thread with the private table and the threads CUDA started from it)."""
    worker_file_tables: dict[str, Any] | None = None
    """hidden-thread: the worker's own view from inside that thread (its ``files`` record:
    ``tid``, ``leader``, ``thread``)."""
    mps_index: int | None = None
    """mps-tenant, mps-neighbour: which MPS trial (``results.json``'s ``mps.trials``)."""
    reported_in_log: bool | None = None
    """unallocated: the enforcer logged ``gpu_used_without_allocation`` for the trial's pod."""
    reported_allocated: str | None = None
    """unallocated: what that line says the pod was allocated (``no GPU`` expected)."""
    cross_to_report_s: float | None = None
    """unallocated: from the first listing to that line (its log timestamp)."""
    event_reported: bool | None = None
    """unallocated: a ``GPUUsedWithoutAllocation`` Event for the pod (its ``pod_event`` line with
    a pods file, read back from the API server after the trials with ``--apiserver``)."""
    unallocated_counter_growth: float | None = None
    """unallocated: how much ``gpuguard_unallocated_gpu_use_total`` (all series) grew over the
    trial (1 expected: once per pod and device)."""
    answer_read_after_s: float | None = None
    """unallocated: from adding the pod to the kubelet's answer to the enforcer's next read of
    it (the worker starts then)."""
    side_alive: bool | None = None
    """two-containers: the pod's other container's worker (``side``) was alive when the trial
    ended (else a wrong kill)."""
    base_bytes: int | None = None
    """guarded: what NVML listed for the worker before it was let grow (its context): the
    crossing is the first ``allocating`` record whose target, with this, is over the limit."""
    crossing_seen_in_nvml: bool | None = None
    """guarded: whether any NVML sample ever showed the worker over its limit (the guard
    freezes the crossing call before it runs; a SIGTERM handler resumed after the stop may still
    finish that call: reported, not judged)."""
    t_nvml_over: float | None = None
    """guarded: the first NVML sample over the limit, if any."""
    guard_frozen: bool | None = None
    """guarded: the enforcer logged ``allocation_frozen`` for the worker's PID."""
    cross_to_frozen_s: float | None = None
    """guarded: from the crossing call to that line (its log timestamp)."""
    guard_events: list[str] | None = None
    """guarded: the enforcer's allocation guard lines naming the worker's PID, in order."""
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


def gpu_file_view(pid: int) -> tuple[list[str], dict[int, list[str]]]:
    """What ``/proc`` shows of a process's GPU device files from outside: the leader's table
    (``/proc/<pid>/fd``, what a per-process scan reads) and, per thread that shows any, its
    table (``/proc/<pid>/task/<tid>/fd``: a thread that unshared its table shows its own)."""
    tasks: dict[int, list[str]] = {}
    with contextlib.suppress(OSError):
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            if files := gpu_file_links(f"/proc/{pid}/task/{tid}/fd"):
                tasks[int(tid)] = files
    return gpu_file_links(f"/proc/{pid}/fd"), tasks


def worker_argv(role: str, label: str, records: Path, grow_to_mib: int) -> list[str]:
    argv = [
        sys.executable, str(WORKER), "--role", role, "--label", label, "--record", str(records),
        "--max-mib", str(grow_to_mib),
    ]  # fmt: skip
    if role in ("forked", HIDDEN):
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
    extra_pids: frozenset[int] = frozenset()
    """Other processes of the trial's pod whose memory counts towards the crossing (an MPS
    tenant's client and server)."""
    mps: bool = False
    """Sample NVML's MPS-client list too."""
    crossing: Callable[[], float | None] | None = None
    """guarded: when the crossing call was made (its worker's record), or ``None`` before it:
    then NVML's samples time only the freeing, and whether they ever showed it over."""
    timeline: list[tuple[float, int, bool]] = field(default_factory=list)
    seen: set[int] = field(default_factory=set)
    """Every PID NVML listed during the trial."""

    def sample(self, usage: Mapping[int, int] | None = None) -> bool:
        """One sample (of ``usage`` when given: one listing for several watches); True once the
        PID is no longer listed after the crossing (freed)."""
        trial = self.trial
        t = time.monotonic()
        if usage is None:
            usage = self.nvml.usage(mps=self.mps)
        used = usage.get(trial.pid, 0)
        listed = trial.pid in usage
        self.seen.update(usage)
        self.timeline.append((t, used, listed))
        trial.peak_bytes = max(trial.peak_bytes, used)
        pod_used = used + sum(usage.get(pid, 0) for pid in self.extra_pids)
        if self.crossing is not None:
            if trial.t_nvml_over is None and pod_used > self.limit_bytes:
                trial.t_nvml_over = t
            if trial.t_cross is None:
                trial.t_cross = self.crossing()
        elif trial.t_cross is None and pod_used > self.limit_bytes:
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


def watch_together(watches: Sequence[Watch], deadline: float) -> None:
    """Sample several trials from one listing every ``WATCH_PERIOD`` until each is freed or the
    deadline (a freed one is no longer sampled: its ``t_freed`` stays the first)."""
    nvml, mps = watches[0].nvml, any(w.mps for w in watches)
    while time.monotonic() < deadline:
        t = time.monotonic()
        usage = nvml.usage(mps=mps)
        for w in watches:
            if w.trial.t_freed is None:
                w.sample(usage)
        if all(w.trial.t_freed is not None for w in watches):
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


def crossing_call(
    records: Sequence[Mapping[str, Any]], label: str, limit_bytes: int, base_bytes: int
) -> float | None:
    """guarded: when the worker ``label`` made the call that takes it over ``limit_bytes`` (the
    first ``allocating`` record whose target, with ``base_bytes`` already held, is over), or
    ``None``: NVML never shows that call's memory when the guard froze it."""
    for r in records:
        if (
            r.get("label") == label
            and r.get("kind") == "allocating"
            and base_bytes + int(r["mib"]) * MIB > limit_bytes
        ):
            return float(r["t"])
    return None


def listed_bytes(nvml: Nvml, pid: int, timeout: float) -> int | None:
    """What NVML lists for ``pid`` once it lists it (within ``timeout``), or ``None``."""
    deadline = time.monotonic() + timeout
    while True:
        usage = nvml.usage()
        if pid in usage:
            return usage[pid]
        if time.monotonic() > deadline:
            return None
        time.sleep(WATCH_PERIOD)


def finish_trial(watch: Watch, records: Path) -> Trial:
    """Fill a trial in from its samples and its worker's records, and judge it."""
    trial = watch.trial
    label, timeline = trial.label, watch.timeline
    every = read_records(records)
    mine = [r for r in every if r.get("label") == label]
    if trial.kind == GUARDED:
        base = trial.base_bytes or 0
        trial.t_cross = crossing_call(every, label, watch.limit_bytes, base)
        trial.crossing_seen_in_nvml = trial.t_nvml_over is not None
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
        elif r["kind"] == "files":
            trial.worker_file_tables = {k: r.get(k) for k in ("tid", "leader", "thread")}
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
    if trial.kind == HIDDEN:
        if trial.leader_gpu_files:
            problems.append(
                f"the leader's /proc/<pid>/fd showed {len(trial.leader_gpu_files)} GPU file(s): "
                "nothing was hidden, the hidden case was not tested"
            )
        elif not trial.task_gpu_files:
            problems.append("no thread's fd table showed a GPU file: the hiding was not seen")
        if trial.child_pid is None:
            problems.append("the worker never forked its child")
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
    role = {
        "forked-zombie": "forked", TWO_CONTAINERS: "greedy", GUARDED: "greedy", **DRA_KINDS,
    }.get(kind, kind)  # fmt: skip
    argv = worker_argv(role, label, records, grow_to_mib)
    proc = spawn_in(pod.cgroup_dir, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    trial.pid = proc.pid
    watch = Watch(trial=trial, nvml=nvml, limit_bytes=limit_bytes)
    if kind == GUARDED:
        watch.crossing = lambda: crossing_call(
            read_records(records), label, limit_bytes, trial.base_bytes or 0
        )
    reaper: Reaper | None = None
    try:
        wait_ready(proc, label)
        assert proc.stdin is not None
        if kind == HIDDEN:
            # From outside, as gpuguard reads /proc: the context exists, every GPU file is open.
            trial.leader_gpu_files, trial.task_gpu_files = gpu_file_view(proc.pid)
        if kind == GUARDED:
            # The context's memory before any growth: the crossing call is the one whose
            # target would take the worker past the limit with it.
            trial.base_bytes = listed_bytes(nvml, proc.pid, 2.0)
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
        if role in ("forked", HIDDEN):
            kill_leftovers(pod.cgroup_dir, trial)
    return finish_trial(watch, records)


def run_container_trial(
    *,
    pod: PodSpec,
    index: int,
    nvml: Nvml,
    records: Path,
    limit_bytes: int,
    grow_to_mib: int,
    side_mib: int,
    timeout: float,
) -> Trial:
    """One two-containers trial: ``side`` holds ``side_mib``, then ``main`` grows past its own
    limit (``run_trial``, crossing on ``main``'s memory alone); ``side`` must be alive after it.
    The side worker is then killed by pidfd and its memory waited out (it holds into no other
    trial)."""
    side_label = f"{TWO_CONTAINERS}-side-{index}"
    argv = [sys.executable, str(WORKER), "--role", "hold", "--label", side_label,
            "--record", str(records), "--max-mib", str(side_mib)]  # fmt: skip
    side = spawn_in(pod.side_cgroup_dir, argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        wait_ready(side, side_label)
        assert side.stdout is not None
        side.stdout.readline()  # "held"
        trial = run_trial(
            kind=TWO_CONTAINERS, label=f"{TWO_CONTAINERS}-{index}", pod=pod, nvml=nvml,
            records=records, limit_bytes=limit_bytes, grow_to_mib=grow_to_mib, timeout=timeout,
        )  # fmt: skip
        trial.side_alive = side.poll() is None
        if not trial.side_alive:
            trial.problem = "; ".join(
                p for p in (trial.problem, "the side container died (a wrong kill)") if p
            )
            trial.ok = False
    finally:
        if side.poll() is None:
            pidfd_kill(side.pid)
        side.wait()
        close_pipes(side)
        wait_delisted(nvml, side.pid, DELIST_BOUND)
    return trial


def kill_leftovers(cgroup_dir: Path, trial: Trial) -> None:
    """After a trial whose worker forks: what is still in the pod's cgroup 2 s after it (a child
    never stopped) is killed by pidfd, so that it holds no memory into the next trial, and noted
    as a problem of the trial."""
    deadline = time.monotonic() + 2
    while (left := Cgroups.members(cgroup_dir)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        pidfd_kill(pid)
    deadline = time.monotonic() + 5
    while left and Cgroups.members(cgroup_dir) and time.monotonic() < deadline:
        time.sleep(0.02)
    if left:
        why = f"{left} still in the pod's cgroup after the trial (killed by the script)"
        trial.problem = "; ".join(p for p in (trial.problem, why) if p)


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


def note_guard(trial: Trial, log: Path, wall_minus_monotonic: float) -> None:
    """guarded: the guard's lines of the enforcer's log that name the trial's PID, whether one
    is ``allocation_frozen`` (the stop taken at the call), and when it came after the crossing."""
    lines = [
        ln
        for ln in enforcer_lines(log)
        if str(ln.get("event", "")).startswith(GUARD_EVENTS) and ln.get("pid") == trial.pid
    ]
    trial.guard_events = [str(ln["event"]) for ln in lines]
    frozen = [ln for ln in lines if ln["event"] == "allocation_frozen"]
    trial.guard_frozen = bool(frozen)
    if frozen and trial.t_cross is not None:
        t = log_monotonic(frozen[0], wall_minus_monotonic)
        if t is not None:
            trial.cross_to_frozen_s = t - trial.t_cross


def guard_status(log: Path) -> dict[str, Any]:
    """What the guarded trials' enforcer logged of its allocation guard: attached (and the
    library), or why not, and how many lines of each guard event."""
    facts: dict[str, Any] = {"attached": False, "unavailable": None, "events": {}}
    for ln in enforcer_lines(log):
        event = str(ln.get("event", ""))
        if not event.startswith(GUARD_EVENTS):
            continue
        facts["events"][event] = facts["events"].get(event, 0) + 1
        if event == "alloc_guard_attached":
            facts["attached"], facts["attached_library"] = True, ln.get("library")
        elif event == "alloc_guard_unavailable":
            facts["unavailable"] = ln.get("reason")
    return facts


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
        self._published: dict[str, PodSpec] = {}

    def register(self, pods: Sequence[PodSpec]) -> None:
        for p in pods:
            p.uid = str(uuid.uuid4())

    def publish(self, pods: Sequence[PodSpec]) -> None:
        """Write ``pods`` with every pod published before (a pod added mid-run, as the API
        server's ``publish`` adds it), in one rename: the enforcer's watcher never reads a
        half-written file."""
        self._published.update({p.name: p for p in pods})
        items = [p.manifest(self.source) for p in self._published.values()]
        doc = {"apiVersion": "v1", "kind": "List", "items": items}
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(doc, indent=1))  # JSON is YAML
        os.replace(tmp, self.path)

    def enforcer_args(self) -> list[str]:
        return ["--pods-file", str(self.path)]

    def events(self) -> list[dict[str, Any]]:
        return []

    def close(self) -> None:
        pass


class ApiServer:
    """Real etcd + kube-apiserver (rigs/controlplane.py's KubeCluster), RBAC, Pods, Events."""

    def __init__(self, workdir: Path, source: str) -> None:
        self.source = source
        from rigs.controlplane import KubeCluster

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
        from rigs.controlplane import AdminRequestError

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
                NAMESPACE, p.name, node=NODE, annotations=annotations, limits=limits,
                also=[name for name, _ in p.containers()[1:]],
            )  # fmt: skip
            p.uid = created["metadata"]["uid"]

    def publish(self, pods: Sequence[PodSpec]) -> None:
        for p in pods:
            self.cluster.set_container_statuses(
                NAMESPACE,
                p.name,
                [
                    {"name": name, "containerID": f"containerd://{cid}"}
                    for name, cid in p.containers()
                ],
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
    (``rigs/dra_objects.py``, the shape the driver publishes with
    ``--consumable-shares=memory``), and per pod a ResourceClaim for one memory share whose
    allocation (driver, pool, device, shareID, consumedCapacity) and ``reservedFor`` it writes
    as admin through the status subresource, as the scheduler does.

    Must not: write any object but the DeviceClass, the slice and the pods and claims of
    namespace ``e2e`` it creates (``remove`` deletes them)."""

    def __init__(self, api: ApiServer, nvml: Nvml) -> None:
        from rigs import dra_objects

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
        from rigs.controlplane import AdminRequestError

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


def scraped_pod_value(port: int, metric: str, pod: str) -> float | None:
    """``metric`` of ``pod`` on the enforcer's /metrics (the first GPU's line), or ``None``."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith(f"{metric}{{") and f'pod="{pod}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def scraped_limit(port: int, pod: str) -> float | None:
    """``gpuguard_pod_gpu_memory_limit_bytes`` of ``pod`` on the enforcer's /metrics (the
    enforcer's effective limit; present once the pod uses the GPU), or ``None``."""
    return scraped_pod_value(port, "gpuguard_pod_gpu_memory_limit_bytes", pod)


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


# ---------------------------------------------------------------------------------------------
# A tenant's own MPS (--mps-trials)


def find_mps_control() -> str | None:
    """``nvidia-cuda-mps-control`` on PATH or in the driver's usual directories, or ``None``."""
    found = shutil.which(MPS_CONTROL)
    if found is not None:
        return found
    for d in MPS_CONTROL_DIRS:
        path = Path(d) / MPS_CONTROL
        if os.access(path, os.X_OK):
            return str(path)
    return None


def process_facts(pid: int) -> dict[str, Any]:
    """A process's command line, parent and cgroup v2 path, for the raw output (empty values
    once it is gone)."""
    facts: dict[str, Any] = {"pid": pid, "cmdline": None, "ppid": None, "cgroup": None}
    with contextlib.suppress(OSError):
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        facts["cmdline"] = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    with contextlib.suppress(OSError, IndexError, ValueError):
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        facts["ppid"] = int(stat[1])
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                facts["cgroup"] = line[3:]
    return facts


def children_of(parents: Sequence[int]) -> list[int]:
    """Every live process whose parent is one of ``parents`` (the servers a daemon spawned)."""
    found: list[int] = []
    for name in os.listdir("/proc"):
        if name.isdigit() and process_facts(int(name))["ppid"] in parents:
            found.append(int(name))
    return sorted(found)


def mps_processes_elsewhere() -> list[dict[str, Any]]:
    """MPS daemons and servers on the machine before a trial starts its own: another daemon
    can keep ours from starting a server (one per GPU and user)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        facts = process_facts(int(name))
        if any("nvidia-cuda-mps" in Path(a).name for a in (facts["cmdline"] or [])[:2]):
            found.append(facts)
    return found


class MpsDaemon:
    """A tenant's own MPS control daemon: started inside the tenant pod's container cgroup (the
    server it spawns for its first client is its child: it lands there too), on a pipe
    directory of its own in a fresh temporary directory, so that nothing else on the node talks
    to it and it to nothing else. ``ordinary_env`` points a process at a directory where no
    daemon listens: CUDA then runs without MPS (NVIDIA's MPS manual: a failed connection to
    the control daemon means no MPS).

    Must not: signal anything but its own daemon and the servers that daemon spawned (``stop``
    asks the daemon to quit through its own pipe, and kills by pidfd only what stays of it in
    the tenant's cgroup); run twice (``stop`` is idempotent, also registered with ``atexit``)."""

    quit_wait_seconds = 10.0
    """How long ``stop`` gives the daemon and its servers to leave after ``quit``."""

    def __init__(self, control: str, cgroup_dir: Path) -> None:
        self.control = control
        self.cgroup_dir = cgroup_dir
        self.root = Path(tempfile.mkdtemp(prefix="gpuguard-e2e-mps-"))
        self.pipe_dir, self.log_dir = self.root / "pipe", self.root / "log"
        self.no_daemon_dir = self.root / "no-daemon"
        for d in (self.pipe_dir, self.log_dir, self.no_daemon_dir):
            d.mkdir()
        self.pids: list[int] = []
        """The daemon's PIDs (the members ``-d`` left in the cgroup)."""
        self.servers: list[int] = []
        """The servers it spawned, as ``note_servers`` last found them."""
        self.facts: dict[str, Any] = {
            "control": control,
            "pipe_directory": str(self.pipe_dir),
            "log_directory": str(self.log_dir),
            "no_daemon_directory": str(self.no_daemon_dir),
        }
        self._started = self._stopped = False

    def env(self) -> dict[str, str]:
        """The daemon's and its clients' environment (and ``quit``'s)."""
        return {
            **os.environ,
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
        }

    def ordinary_env(self) -> dict[str, str]:
        """An ordinary (non-MPS) process's environment: a pipe directory with no daemon."""
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(self.no_daemon_dir)}
        env.pop("CUDA_MPS_LOG_DIRECTORY", None)
        return env

    def start(self) -> str | None:
        """``nvidia-cuda-mps-control -d`` inside the cgroup; why it did not start, or ``None``."""
        before = set(Cgroups.members(self.cgroup_dir))
        self._started = True
        atexit.register(self.stop)
        out = self.root / "start.out"
        with out.open("w") as f:
            # Output to a file: the daemon keeps what it inherits, a pipe would never end.
            proc = spawn_in(
                self.cgroup_dir, [self.control, "-d"], env=self.env(),
                stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
            )  # fmt: skip
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pidfd_kill(proc.pid)
                proc.wait()
        printed = out.read_text(errors="replace")[-4000:]
        self.facts["start"] = {"rc": proc.returncode, "output": printed}
        if proc.returncode != 0:
            return f"{MPS_CONTROL} -d exited {proc.returncode}: {printed.strip()[-300:]}"
        deadline = time.monotonic() + 10
        while not self.pids and time.monotonic() < deadline:
            time.sleep(0.05)
            new = [p for p in Cgroups.members(self.cgroup_dir) if p not in before]
            # The daemon, not a server it may already have spawned (its child).
            self.pids = [p for p in new if process_facts(p)["ppid"] not in new]
        time.sleep(0.2)  # its pipes
        self.facts["daemon"] = [process_facts(p) for p in self.pids]
        self.facts["pipe_directory_files"] = sorted(os.listdir(self.pipe_dir))
        if not self.pids:
            return f"no daemon stayed in the tenant's cgroup after {MPS_CONTROL} -d"
        return None

    def note_servers(self) -> list[dict[str, Any]]:
        """The daemon's children (its MPS servers) with their cgroups, remembered for ``stop``."""
        self.servers = children_of(self.pids)
        return [process_facts(p) for p in self.servers]

    def members(self) -> list[int]:
        """What of the daemon and its servers is still in the tenant's cgroup."""
        mine = set(self.pids) | set(self.servers)
        return [p for p in Cgroups.members(self.cgroup_dir) if p in mine]

    def stop(self) -> None:
        """``echo quit | nvidia-cuda-mps-control`` with the daemon's environment (while the
        daemon lives); then kill what of it stays after ``quit_wait_seconds``; keep the logs in
        ``facts``; remove the directory."""
        if not self._started or self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        self.servers = sorted(set(self.servers) | set(children_of(self.pids)))
        alive = set(self.pids) & set(Cgroups.members(self.cgroup_dir))
        if not alive:
            # Stopped with the tenant's container: nobody reads the pipe, and a client that
            # waits for a reader would only run into its timeout.
            self.facts["quit"] = {"rc": None, "output": "not sent: the daemon was gone"}
        else:
            try:
                done = subprocess.run(
                    [self.control], input="quit\n", env=self.env(), capture_output=True,
                    text=True, timeout=10, check=False,
                )  # fmt: skip
                self.facts["quit"] = {
                    "rc": done.returncode,
                    "output": (done.stdout + done.stderr)[-2000:],
                }
            except (OSError, subprocess.TimeoutExpired) as e:
                self.facts["quit"] = {"rc": None, "output": f"{type(e).__name__}: {e}"}
        deadline = time.monotonic() + self.quit_wait_seconds
        while (left := self.members()) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.facts["left_after_quit"] = left
        for pid in left:
            pidfd_kill(pid)
        for name in ("control.log", "server.log"):
            with contextlib.suppress(OSError):
                text = (self.log_dir / name).read_text(errors="replace")
                self.facts[name.replace(".", "_")] = text[-20000:]
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass(slots=True, kw_only=True)
class MpsTrialSetup:
    """What every MPS trial shares: the daemon binary, the two pods, NVML, the enforcer's
    metrics port, the records file and the sizes."""

    control: str
    tenant: PodSpec
    neighbour: PodSpec
    nvml: Nvml
    port: int
    records: Path
    limit_bytes: int
    grow_to_mib: int
    client_mib: int
    timeout: float


def wait_for_pod_used(port: int, pod: str, timeout: float) -> float | None:
    """``gpuguard_pod_gpu_memory_used_bytes`` of ``pod`` once above 0 within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            used = scraped_pod_value(port, "gpuguard_pod_gpu_memory_used_bytes", pod)
            if used:
                return used
        time.sleep(0.05)
    return None


def listing_with(nvml: Nvml, pid: int, timeout: float) -> dict[str, Any]:
    """NVML's lists once either names ``pid`` (or as they are after ``timeout`` seconds): a
    driver may list a process a moment after its allocation returned, and one look too early
    would read as "the client is in neither list"."""
    deadline = time.monotonic() + timeout
    while True:
        listing = nvml.listing()
        named = any(isinstance(v, dict) and str(pid) in v for v in listing.values())
        if named or time.monotonic() >= deadline:
            return listing
        time.sleep(0.05)


def run_mps_trial(setup: MpsTrialSetup, index: int) -> tuple[list[Trial], dict[str, Any]]:
    """One MPS trial: the tenant's daemon and client, then the tenant's ordinary process and the
    neighbour's grow past their limits together; both must be stopped. Returns the two trials
    (``mps-tenant-<i>``, ``mps-neighbour-<i>``) and the MPS facts for ``results.json``."""
    tenant = Trial(kind=MPS_TENANT, label=f"{MPS_TENANT}-{index}", mps_index=index)
    neighbour = Trial(kind=MPS_NEIGHBOUR, label=f"{MPS_NEIGHBOUR}-{index}", mps_index=index)
    daemon = MpsDaemon(setup.control, setup.tenant.cgroup_dir)
    facts: dict[str, Any] = {"index": index}
    problems: list[str] = []
    client: subprocess.Popen[str] | None = None
    workers: dict[str, tuple[subprocess.Popen[str], Trial]] = {}
    reapers: dict[str, Reaper] = {}
    watches: list[Watch] = []
    try:
        facts["mps_processes_elsewhere"] = mps_processes_elsewhere()
        if (why := daemon.start()) is not None:
            raise MpsNotUp(why)
        label = f"{MPS_CLIENT}-{index}"
        client_err = daemon.root / "client.stderr"
        with client_err.open("w") as err:
            argv = [sys.executable, str(WORKER), "--role", "hold", "--label", label,
                    "--record", str(setup.records), "--max-mib", str(setup.client_mib)]  # fmt: skip
            client = spawn_in(
                setup.tenant.cgroup_dir, argv, env=daemon.env(), stdout=subprocess.PIPE,
                stdin=subprocess.DEVNULL, stderr=err,
            )  # fmt: skip
        try:
            wait_ready(client, label, timeout=60)
            assert client.stdout is not None
            if not client.stdout.readline().startswith("held"):
                raise RuntimeError(f"{label} exited ({client.poll()}) before it held its memory")
        except (RuntimeError, TimeoutError) as e:
            facts["client_stderr"] = client_err.read_text(errors="replace")[-4000:]
            raise MpsNotUp(f"the MPS client did not come up: {e}") from e
        facts["client"] = process_facts(client.pid)
        facts["servers"] = daemon.note_servers()
        facts["listing_with_client"] = listing = listing_with(setup.nvml, client.pid, 5.0)
        mps_pids = [*daemon.pids, *daemon.servers, client.pid]
        facts["mps_pids"] = mps_pids
        facts["client_in_mps_list"] = isinstance(listing["mps"], dict) and (
            str(client.pid) in listing["mps"]
        )
        facts["client_in_compute_list"] = isinstance(listing["compute"], dict) and (
            str(client.pid) in listing["compute"]
        )
        if not daemon.servers:
            problems.append("the daemon spawned no server for the client")
        elif any(setup.tenant.cgroup_path != f["cgroup"] for f in facts["servers"]):
            problems.append("an MPS server is not in the tenant's container cgroup")
        if facts["client_in_compute_list"] and not facts["client_in_mps_list"]:
            problems.append("NVML lists the client as an ordinary process: it did not join MPS")
        facts["tenant_charged_bytes"] = charged = wait_for_pod_used(
            setup.port, setup.tenant.name, 5.0
        )
        # A second look a second later (four polls): the first may predate the client's
        # listing; beside it what NVML lists for the tenant's MPS processes.
        time.sleep(1.0)
        with contextlib.suppress(OSError):
            facts["tenant_charged_bytes_1s_later"] = scraped_pod_value(
                setup.port, "gpuguard_pod_gpu_memory_used_bytes", setup.tenant.name
            )
        facts["tenant_mps_nvml_bytes"] = sum(
            setup.nvml.usage(mps=True).get(pid, 0) for pid in mps_pids
        )
        if not charged:
            problems.append(
                "the tenant's MPS client and server were not charged to it (its "
                "gpuguard_pod_gpu_memory_used_bytes stayed 0 or absent for 5 s)"
            )

        for trial, pod in ((tenant, setup.tenant), (neighbour, setup.neighbour)):
            argv = worker_argv("greedy", trial.label, setup.records, setup.grow_to_mib)
            proc = spawn_in(
                pod.cgroup_dir, argv, env=daemon.ordinary_env(), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )  # fmt: skip
            trial.pid = proc.pid
            workers[trial.kind] = (proc, trial)
        for proc, trial in workers.values():
            wait_ready(proc, trial.label)
        facts["listing_before_go"] = before = setup.nvml.listing()
        facts["ordinary_in_mps_list"] = [
            t.label
            for _, t in workers.values()
            if isinstance(before["mps"], dict) and str(t.pid) in before["mps"]
        ]
        if facts["ordinary_in_mps_list"]:
            problems.append(f"ordinary processes joined MPS: {facts['ordinary_in_mps_list']}")
        watches = [
            Watch(
                trial=tenant, nvml=setup.nvml, limit_bytes=setup.limit_bytes,
                extra_pids=frozenset(mps_pids), mps=True,
            ),
            Watch(trial=neighbour, nvml=setup.nvml, limit_bytes=setup.limit_bytes, mps=True),
        ]  # fmt: skip
        for kind, (proc, _) in workers.items():
            reapers[kind] = Reaper(proc)
        for proc, _ in workers.values():
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        watch_together(watches, time.monotonic() + setup.timeout)
        for reaper in reapers.values():
            reaper.join(5)
    except MpsNotUp as e:
        facts["not_up"] = str(e)
    except (RuntimeError, TimeoutError) as e:
        # An ordinary process that would not start beside the tenant's MPS (a compute mode
        # that allows one context, say): what happened is the result.
        facts["error"] = f"{type(e).__name__}: {e}"
    finally:
        for kind, (proc, trial) in workers.items():
            stop_worker(proc, reapers.get(kind), trial)
        if client is not None:
            facts["client_alive_at_end"] = client.poll() is None
            pidfd_kill(client.pid)
            client.wait()
            close_pipes(client)
        daemon.stop()
        facts |= daemon.facts
    if "not_up" in facts or "error" in facts:
        why = (
            f"MPS did not come up, nothing tested: {facts['not_up']}"
            if "not_up" in facts
            else f"the trial stopped early: {facts['error']}"
        )
        for trial in (tenant, neighbour):
            trial.problem = why
        return [tenant, neighbour], facts
    for watch in watches:
        finish_trial(watch, setup.records)
    if problems:
        tenant.problem = "; ".join([p for p in [tenant.problem] if p] + problems)
        tenant.ok = False
    return [tenant, neighbour], facts


class MpsNotUp(Exception):
    """The tenant's MPS daemon or client did not come up: the trial tested nothing."""


# ---------------------------------------------------------------------------------------------
# GPU use without an allocation (--unallocated-trials)

UNALLOCATED_COUNTER = "gpuguard_unallocated_gpu_use_total"


def pod_resources_answer(pods: Sequence[PodSpec], gpu_uuid: str) -> Any:
    """The kubelet's ``List`` answer for ``pods`` (namespace ``e2e``, container ``main``): an
    allocated pod's container holds one ``nvidia.com/gpu`` replica of the GPU, ``<UUID>::<k>``
    (``k`` counting the allocated pods in order, as the device plugin names time-sliced
    replicas), an unallocated pod's container nothing."""
    from rigs import podresources as kubelet

    listed = []
    replica = 0
    for p in pods:
        devices: list[tuple[str, list[str]]] = []
        if p.allocated:
            devices.append((GPU_RESOURCE, [f"{gpu_uuid}::{replica}"]))
            replica += 1
        listed.append(kubelet.pod(NAMESPACE, p.name, [kubelet.container("main", devices)]))
    return kubelet.answer(*listed)


def answered_devices(answer: Any) -> dict[str, list[str]]:
    """Pod name → the device IDs an answer gives its containers (``results.json``)."""
    return {
        pod.name: [i for c in pod.containers for d in c.devices for i in d.device_ids]
        for pod in answer.pod_resources
    }


class PodResourcesSocket:
    """The kubelet's pod-resources socket of this run: a real gRPC ``v1.PodResourcesLister``
    (``rigs/podresources.py``'s ``KubeletServer``) on ``kubelet.sock`` in a temporary
    directory of its own, answering ``List`` with ``pod_resources_answer`` of the pods ``serve``
    was last given.

    Must not: listen anywhere else, or outlive the run (``close`` stops it and removes the
    directory; idempotent, also registered with ``atexit``)."""

    def __init__(self, gpu_uuid: str) -> None:
        from rigs.podresources import KubeletServer

        self.gpu_uuid = gpu_uuid
        self.root = Path(tempfile.mkdtemp(prefix="gpuguard-e2e-podres-"))
        self.path = self.root / "kubelet.sock"
        self.answered: dict[str, list[str]] = {}
        self._server = KubeletServer(self.path).start()
        self._closed = False
        atexit.register(self.close)

    def serve(self, pods: Sequence[PodSpec]) -> None:
        """Answer every ``List`` from now on with these pods."""
        answer = pod_resources_answer(pods, self.gpu_uuid)
        self._server.answer = answer
        self.answered = answered_devices(answer)

    @property
    def calls(self) -> int:
        """How many ``List`` calls it answered (the enforcer's reads and inspect's)."""
        return self._server.calls

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._server.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def scraped_sum(port: int, metric: str) -> float:
    """The sum of every series of ``metric`` on the enforcer's /metrics (0 when it has none)."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((f"{metric}{{", f"{metric} "))
    )


def run_inspect(config: Path, source_args: Sequence[str], *, json_out: bool) -> dict[str, Any]:
    """``gpuguard inspect`` (``--json``) with the enforcer's config and pods, as root here:
    its exit status, stdout and the end of its stderr. ``COLUMNS`` wide enough for the table's
    cells to stay whole (rich's width when stdout is no terminal)."""
    cmd = [
        sys.executable, "-m", "gpuguard.cli", "inspect", "--config", str(config),
        "--node-name", NODE, *source_args, *(["--json"] if json_out else []),
    ]  # fmt: skip
    try:
        done = subprocess.run(
            cmd, cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
            env={**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        return {"command": " ".join(cmd[1:]), "rc": None, "stdout": "", "stderr": f"{e}"}
    return {
        "command": " ".join(cmd[1:]),
        "rc": done.returncode,
        "stdout": done.stdout,
        "stderr": done.stderr[-4000:],
    }


def inspect_problems(
    text: str, document: Mapping[str, Any], *, pid: int, pod: str, neighbour_bound: str
) -> list[str]:
    """What ``inspect`` must show while pod ``pod``'s process ``pid`` uses the GPU with no
    allocation: its row bound by ``none``, ``not_allocated``, allocated ``no GPU``; the
    neighbour's rows bound by ``neighbour_bound`` and ``allocated``; in the human output a row
    of the pod bound by ``none`` and the line "<ns>/<pod> uses GPU <i> without an allocation
    (allocated: no GPU)". Empty when all of it holds."""
    problems: list[str] = []
    processes = list(document.get("processes") or [])
    mine = [p for p in processes if p.get("pid") == pid]
    if not mine:
        return [f"inspect --json lists no process {pid} (pod {pod})"]
    row = mine[0]
    expected = {
        "pod": pod,
        "bound_by": "none",
        "allocation": "not_allocated",
        "allocated": "no GPU",
    }
    for key, want in expected.items():
        if row.get(key) != want:
            problems.append(f"inspect --json: {pod}'s {key} is {row.get(key)!r}, not {want!r}")
    neighbours = [p for p in processes if p.get("pod") == "neighbour"]
    if not neighbours:
        problems.append("inspect --json lists no process of the neighbour")
    for p in neighbours:
        if (p.get("bound_by"), p.get("allocation")) != (neighbour_bound, "allocated"):
            problems.append(
                f"inspect --json: the neighbour is bound by {p.get('bound_by')!r} with "
                f"allocation {p.get('allocation')!r}, not {neighbour_bound!r} and 'allocated'"
            )
    line = f"{NAMESPACE}/{pod} uses GPU {row.get('gpu')} without an allocation (allocated: no GPU)"
    if line not in text:
        problems.append(f"inspect's table lacks the line {line!r}")
    rows = [ln for ln in text.splitlines() if f" {NAMESPACE}/{pod} " in f" {ln} "]
    if not any(" none " in f" {ln} " for ln in rows):
        problems.append(f"inspect's table shows no row of {NAMESPACE}/{pod} bound by none")
    return problems


def capture_inspect(
    *,
    pod: PodSpec,
    config: Path,
    source_args: Sequence[str],
    out: Path,
    nvml: Nvml,
    records: Path,
    hold_mib: int,
    neighbour_bound: str,
) -> dict[str, Any]:
    """Before the enforcer starts: a worker of ``pod`` (no GPU in the kubelet's answer) holds
    ``hold_mib``; ``gpuguard inspect`` and ``inspect --json`` run with the enforcer's config
    and write ``inspect.txt`` and ``inspect.json``; the worker is killed by pidfd and waited off
    NVML's list. Returns what ran, its exit statuses and ``problems`` (``inspect_problems``)."""
    argv = [sys.executable, str(WORKER), "--role", "hold", "--label", pod.name,
            "--record", str(records), "--max-mib", str(hold_mib)]  # fmt: skip
    proc = spawn_in(pod.cgroup_dir, argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    facts: dict[str, Any] = {"pod": pod.name, "pid": proc.pid}
    runs: dict[str, dict[str, Any]] = {}
    try:
        wait_ready(proc, pod.name)
        assert proc.stdout is not None
        proc.stdout.readline()  # "held"
        listing_with(nvml, proc.pid, 5.0)
        for name, json_out in (("inspect.txt", False), ("inspect.json", True)):
            runs[name] = run_inspect(config, source_args, json_out=json_out)
            (out / name).write_text(runs[name].pop("stdout"))
    finally:
        pidfd_kill(proc.pid)
        proc.wait()
        close_pipes(proc)
    facts["delisted"] = wait_delisted(nvml, proc.pid, DELIST_BOUND) is not None
    facts["runs"] = runs
    problems = [f"{n}: exit {r['rc']}: {r['stderr'][-300:]}" for n, r in runs.items() if r["rc"]]
    try:
        document = json.loads((out / "inspect.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        problems.append(f"inspect.json is no JSON document: {e}")
    else:
        text = (out / "inspect.txt").read_text()
        problems += inspect_problems(
            text, document, pid=proc.pid, pod=pod.name, neighbour_bound=neighbour_bound
        )
    if not facts["delisted"]:
        problems.append(f"NVML still lists the killed worker {proc.pid} after {DELIST_BOUND} s")
    facts["problems"] = problems
    return facts


@dataclass(slots=True, kw_only=True)
class UnallocatedSetup:
    """What every unallocated trial shares: where pods are published, the kubelet's socket and
    every pod it lists (each trial adds its own), the cgroups, NVML, the enforcer's metrics
    port and log, the records file, what a worker holds and the timeout."""

    source: PodsFile | ApiServer
    kubelet: PodResourcesSocket
    pods: list[PodSpec]
    cg: Cgroups
    nvml: Nvml
    port: int
    log: Path
    records: Path
    hold_mib: int
    timeout: float


def add_unallocated_pod(setup: UnallocatedSetup, trial: Trial) -> PodSpec:
    """A new pod (named after the trial) with no limit and no GPU in the kubelet's answer:
    registered, its cgroup made, published (pods file or API server) and listed by the kubelet;
    returned once the enforcer has read that answer (``answer_read_after_s``; a problem of the
    trial when it did not within twice its read interval)."""
    pod = PodSpec(name=trial.label, limit_bytes=None, allocated=False)
    setup.source.register([pod])
    pod.cgroup_dir, pod.cgroup_path = setup.cg.make(pod_cgroup_rel(pod.uid, pod.container_id))
    setup.pods.append(pod)
    setup.source.publish([pod])
    calls, t0 = setup.kubelet.calls, time.monotonic()
    setup.kubelet.serve(setup.pods)
    deadline = t0 + 2 * pod_resources_read_seconds()
    while setup.kubelet.calls == calls and time.monotonic() < deadline:
        time.sleep(0.01)
    if setup.kubelet.calls == calls:
        trial.problem = f"the enforcer did not read the kubelet's answer within {deadline - t0} s"
    else:
        trial.answer_read_after_s = time.monotonic() - t0
        time.sleep(0.1)  # the answer on its way into the enforcer's last read
    return pod


class WorkerStart:
    """Waits for a worker's ``ready`` on a thread of its own and says ``go``, while the caller
    samples NVML from the worker's start (its first listing precedes ``ready``)."""

    def __init__(self, proc: subprocess.Popen[str], label: str) -> None:
        self.proc, self.label = proc, label
        self.t_ready: float | None = None
        self.failed: str | None = None
        self._thread = threading.Thread(target=self._start, daemon=True)
        self._thread.start()

    def _start(self) -> None:
        try:
            wait_ready(self.proc, self.label)
            assert self.proc.stdin is not None
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
            self.t_ready = time.monotonic()
        except (RuntimeError, TimeoutError, OSError, ValueError) as e:
            self.failed = f"{type(e).__name__}: {e}"

    def over(self, timeout: float) -> bool:
        """Whether it failed, or was told ``go`` more than ``timeout`` seconds ago."""
        ready = self.t_ready
        return self.failed is not None or (ready is not None and time.monotonic() > ready + timeout)

    def join(self) -> None:
        self._thread.join(10)


def run_unallocated_trial(setup: UnallocatedSetup, index: int) -> Trial:
    """One trial: a new pod ``unallocated-<index>`` (``add_unallocated_pod``) whose worker
    holds ``hold_mib`` (one step), sampled from its start (its crossing is its first listing:
    no allocation, a limit of 0 bytes) until freed, or ``timeout`` after it was told ``go``;
    judged as any trial, then by the enforcer's report of it (``note_unallocated_report``)."""
    label = f"{UNALLOCATED}-{index}"
    trial = Trial(kind=UNALLOCATED, label=label)
    pod = add_unallocated_pod(setup, trial)
    counter_before = scraped_sum(setup.port, UNALLOCATED_COUNTER)
    argv = worker_argv("greedy", label, setup.records, setup.hold_mib)
    argv += ["--step-mib", str(setup.hold_mib)]
    proc = spawn_in(pod.cgroup_dir, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    trial.pid = proc.pid
    watch = Watch(trial=trial, nvml=setup.nvml, limit_bytes=0)
    reaper = Reaper(proc)
    start = WorkerStart(proc, label)
    try:
        watch.run(
            time.monotonic() + 180 + setup.timeout,
            stop=lambda: start.over(setup.timeout) or (reaper.done() and trial.t_cross is None),
        )
        reaper.join(5)
    finally:
        stop_worker(proc, reaper, trial)
        start.join()
    finish_trial(watch, setup.records)
    if start.failed is not None and trial.t_term is None:
        trial.problem = "; ".join(p for p in (trial.problem, start.failed) if p)
    note_unallocated_report(trial, setup, counter_before)
    return trial


def note_unallocated_report(trial: Trial, setup: UnallocatedSetup, counter_before: float) -> None:
    """The enforcer's report of an unallocated trial's pod: its ``gpu_used_without_allocation``
    line (what it says was allocated, when after the first listing), its Event as a
    ``pod_event`` line (pods file; with an API server the Events are read after the trials:
    ``note_unallocated_events``) and the growth of ``gpuguard_unallocated_gpu_use_total``;
    a missing report or a growth other than 1 is a problem of the trial."""
    wall_minus_monotonic = time.time() - time.monotonic()
    lines = list(enforcer_lines(setup.log)) if setup.log.exists() else []
    reports = [
        ln
        for ln in lines
        if ln.get("event") == "gpu_used_without_allocation" and ln.get("pod") == trial.label
    ]
    trial.reported_in_log = bool(reports)
    problems = [trial.problem] if trial.problem else []
    if reports:
        trial.reported_allocated = reports[0].get("allocated")
        at = log_monotonic(reports[0], wall_minus_monotonic)
        if at is not None and trial.t_cross is not None:
            trial.cross_to_report_s = at - trial.t_cross
    else:
        problems.append("no gpu_used_without_allocation line for the pod")
    with contextlib.suppress(OSError):
        trial.unallocated_counter_growth = (
            scraped_sum(setup.port, UNALLOCATED_COUNTER) - counter_before
        )
    if trial.unallocated_counter_growth != 1:
        problems.append(
            f"{UNALLOCATED_COUNTER} grew by {trial.unallocated_counter_growth} over the trial, "
            "not 1"
        )
    trial.problem = "; ".join(problems)
    trial.ok = not trial.problem
    if isinstance(setup.source, PodsFile):
        note_unallocated_events([trial], [ln for ln in lines if ln.get("event") == "pod_event"])


def note_unallocated_events(trials: Sequence[Trial], events: Sequence[Mapping[str, Any]]) -> None:
    """``event_reported`` of each unallocated trial: a ``GPUUsedWithoutAllocation`` Event names
    its pod; none is a problem of the trial."""
    named = {e.get("pod") for e in events if e.get("reason") == UNALLOCATED_EVENT}
    for t in trials:
        if t.kind != UNALLOCATED:
            continue
        t.event_reported = t.label in named
        if not t.event_reported:
            t.problem = "; ".join(p for p in (t.problem, f"no {UNALLOCATED_EVENT} Event") if p)
            t.ok = False


def wrong_reports(log: Path) -> list[str]:
    """Pods the enforcer reported using a GPU without an allocation though the kubelet's answer
    gave them the GPU (or no answer could say): every pod but ``unallocated-<i>``."""
    return [
        f"enforcer reported pod {ln.get('pod')} using GPU {ln.get('gpu')} without an allocation "
        f"(allocated: {ln.get('allocated')})"
        for ln in (enforcer_lines(log) if log.exists() else ())
        if ln.get("event") == "gpu_used_without_allocation"
        and not str(ln.get("pod")).startswith(f"{UNALLOCATED}-")
    ]


def may_be_signalled(pod: object) -> bool:
    """A trial pod: the only pods an enforcer ``container_signalled`` line may name."""
    return pod in TRIAL_PODS or (
        isinstance(pod, str) and pod.startswith(tuple(f"{k}-" for k in (*DRA_KINDS, UNALLOCATED)))
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
            "commit": source_commit(),
        }
    )
    with contextlib.suppress(Exception):
        facts["torch"] = importlib.import_module("torch").__version__
    return facts


def source_commit() -> str | None:
    """The commit of the tree that runs: ``$GPU_E2E_COMMIT`` (a tree unpacked from ``git
    archive`` has no ``.git``: the archive's maker says which commit it is), else ``git
    rev-parse HEAD`` in the repository (``+dirty`` when tracked files differ from it), else
    ``None``."""
    if named := os.environ.get("GPU_E2E_COMMIT", "").strip():
        return named
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
            timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}+dirty" if dirty else head


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
        if kind == GUARDED:
            entry["crossing_seen_in_nvml"] = sum(bool(t.crossing_seen_in_nvml) for t in ts)
            entry["guard_frozen"] = sum(bool(t.guard_frozen) for t in ts)
            frozen = [t.cross_to_frozen_s for t in ts if t.cross_to_frozen_s is not None]
            entry["cross_to_frozen_p50_s"] = pct(frozen, 0.50)
            entry["target_measured"] = False  # GUARDED_TERM_TARGET: what we aim for
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
    if (g := result["summary"].get(GUARDED)) is not None:
        print(
            f"{GUARDED:19} frozen by the guard {g['guard_frozen']}/{g['trials']} (crossing → "
            f"frozen p50 {ms(g['cross_to_frozen_p50_s'])}); NVML ever showed it over its limit "
            f"{g['crossing_seen_in_nvml']}/{g['trials']}; target {ms(g['target_s'])} ms is a "
            "target, not a measured figure"
        )
    if result.get("alloc_guard") is not None:
        print(guard_line(result["alloc_guard"]))
    mps = result.get("mps")
    if mps is not None and mps["skipped"]:
        for kind in (MPS_TENANT, MPS_NEIGHBOUR):
            print(f"{kind:19} {mps['skipped']}")
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
        "owner_settle_seconds; unallocated's crossing is its first listing (no allocation: a "
        "limit of 0 bytes); guarded's crossing is the worker's record of the call that "
        "would take it over (NVML never shows it when the guard froze it); a dead PID's time "
        "is from waitpid's return to the first sample without it, negative when the driver "
        "dropped it during the exit)"
    )
    c = result["enforcer_cpu"]
    print(
        f"enforcer: {c['polls']} polls, {c['cpu_ms_per_poll']:.2f} ms CPU/poll, "
        f"{c['wall_ms_per_poll']:.2f} ms wall/poll (histogram mean)"
    )
    print(f"wrong kills: {len(result['wrong_kills'])} {result['wrong_kills'] or ''}")
    reports = result.get("wrong_reports") or []
    if result.get("unallocated") is not None or reports:
        print(f"wrong reports: {len(reports)} {reports or ''}")
    for t in result["trials"]:
        if t["kind"] == HIDDEN:
            tables = t["worker_file_tables"] or {}
            per_thread = {tid: len(f) for tid, f in (t["task_gpu_files"] or {}).items()}
            print(
                f"hidden-thread {t['label']}: at ready /proc/<pid>/fd showed "
                f"{len(t['leader_gpu_files'] or [])} GPU file(s), threads {per_thread} showed them "
                f"(the worker's thread {tables.get('tid')}: {len(tables.get('thread') or [])}, "
                f"its leader {len(tables.get('leader') or [])}); child {t['child_pid']}"
            )
        if t["kind"].startswith("forked") or t["kind"] == HIDDEN:
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
        if t["kind"] == UNALLOCATED:
            print(
                f"unallocated {t['label']}: started {ms(t['answer_read_after_s'])} ms after "
                f"the pod joined the kubelet's answer (the enforcer's next read); first listing "
                f"→ SIGTERM {ms(t['cross_to_term_s'])} ms, → gpu_used_without_allocation line "
                f"{ms(t['cross_to_report_s'])} ms "
                f"(allocated: {t['reported_allocated']}); {UNALLOCATED_EVENT} Event "
                f"{'yes' if t['event_reported'] else 'NO'}; {UNALLOCATED_COUNTER} "
                f"+{t['unallocated_counter_growth']}"
            )
        if t.get("dra_share_bytes") is not None:
            print(
                f"DRA {t['label']}: share {t['dra_share_bytes'] // MIB} MiB (its only limit), on "
                f"the enforcer's /metrics {ms(t['dra_limit_seen_s'])} ms after the allocation; "
                f"the {DRA_MODEST} pod beside it "
                f"{'untouched' if t['dra_modest_alive'] else 'DIED'}"
            )
        if t["kind"] == GUARDED:
            print(
                f"guarded {t['label']}: frozen by the guard "
                f"{'yes' if t['guard_frozen'] else 'NO'} ({ms(t['cross_to_frozen_s'])} ms after "
                f"the crossing call); NVML ever showed it over its limit "
                f"{'yes' if t['crossing_seen_in_nvml'] else 'no'} (peak "
                f"{t['peak_bytes'] // MIB} MiB, {mib_of(t['base_bytes'])} MiB before it grew); "
                f"guard lines {t['guard_events']}"
            )
        if t["problem"]:
            print(f"PROBLEM {t['label']}: {t['problem']}")
    for facts in (mps or {}).get("trials", []):
        print_mps(facts)
    if mps is not None:
        print(
            f"mps: {MPS_CONTROL} {mps['control'] or 'absent'}, compute mode {mps['compute_mode']}"
            f"; the tenant's stops signalled its MPS PIDs "
            f"{mps.get('tenant_stop_signalled_mps_pids')}"
        )
    if result.get("events") is not None:
        print(f"events: {len(result['events'])}")
        for e in result["events"]:
            print(f"  {e['pod']:19} {e['reason']} x{e['count']} ({e['source']})")


def guard_line(facts: Mapping[str, Any]) -> str:
    """One line: whether the guarded trials' enforcer attached its allocation guard."""
    state = (
        f"attached to {facts.get('attached_library')}"
        if facts.get("attached")
        else f"NOT attached ({facts.get('unavailable') or 'no alloc_guard line in the log'})"
    )
    events = facts.get("events")
    return f"alloc guard: {state}; library from {facts['library_from']}; lines {events}"


def print_inspect(facts: Mapping[str, Any]) -> None:
    """What inspect showed of the unallocated pod (its outputs are inspect.txt, inspect.json)."""
    exits = ", ".join(f"{name} {run['rc']}" for name, run in (facts.get("runs") or {}).items())
    print(
        f"inspect: pod {facts['pod']} pid {facts['pid']}; exit {exits}; problems: "
        f"{'; '.join(facts['problems']) or 'none'}",
        flush=True,
    )


def print_mps(facts: Mapping[str, Any]) -> None:
    """One MPS trial's facts in a few lines (all of them are in results.json)."""
    i = facts["index"]
    if "not_up" in facts:
        print(f"mps {i}: NOT UP: {facts['not_up']}")
    daemon = [d["pid"] for d in facts.get("daemon") or []]
    servers = facts.get("servers") or []
    print(
        f"mps {i}: daemon {daemon} ({MPS_CONTROL} -d rc {(facts.get('start') or {}).get('rc')}), "
        f"servers {[f['pid'] for f in servers]} in cgroups "
        f"{sorted({str(f['cgroup']).rsplit('/', 1)[-1][:30] for f in servers})}; client "
        f"{(facts.get('client') or {}).get('pid')} in NVML's MPS list "
        f"{facts.get('client_in_mps_list')}, compute list {facts.get('client_in_compute_list')}"
        f"; tenant charged {mib_of(facts.get('tenant_charged_bytes'))} MiB, "
        f"{mib_of(facts.get('tenant_charged_bytes_1s_later'))} MiB 1 s later (NVML lists "
        f"{mib_of(facts.get('tenant_mps_nvml_bytes'))} MiB for its MPS processes) before its "
        f"ordinary process; ordinary processes in the MPS list {facts.get('ordinary_in_mps_list')}"
    )
    quit_ = facts.get("quit") or {}
    print(
        f"mps {i}: quit rc {quit_.get('rc')} ({str(quit_.get('output') or '').strip()[:120]!r})"
        f", left after quit {facts.get('left_after_quit')}, other MPS processes on the machine "
        f"{[p['pid'] for p in facts.get('mps_processes_elsewhere') or []]}"
    )


def mib_of(v: float | None) -> str:
    return "-" if v is None else f"{v / MIB:.0f}"


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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (argparse exits 2 on a usage error, ``--dra`` without ``--apiserver``
    included)."""
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
    parser.add_argument(
        "--hidden-trials",
        type=int,
        default=0,
        help="trials whose worker does all its CUDA work in a thread with a private file table "
        "(unshare CLONE_FILES), forks there and exits: a ghost PID whose files /proc/<pid>/fd "
        "never showed (default 0)",
    )
    parser.add_argument(
        "--mps-trials",
        type=int,
        default=0,
        help="trials in which a tenant pod runs an MPS daemon and client of its own (MPS not "
        "declared) while an ordinary process of it and one of a neighbour pod grow past their "
        "limits; needs nvidia-cuda-mps-control, else reported skipped (default 0)",
    )
    parser.add_argument(
        "--mps-client-mib",
        type=int,
        default=100,
        help="--mps-trials: what the tenant's MPS client holds, MiB (default 100)",
    )
    parser.add_argument(
        "--unallocated-trials",
        type=int,
        default=0,
        help="trials in which a pod that requested no GPU (the script's own kubelet "
        "pod-resources socket lists it with no device) holds --unallocated-mib: it must be "
        'reported and stopped (enforcement.unallocated = "stop"); before the enforcer starts, '
        "inspect and inspect --json are saved while such a pod holds its memory (default 0: no "
        'pod-resources socket, node.pod_resources_socket is "")',
    )
    parser.add_argument(
        "--unallocated-mib",
        type=int,
        default=1024,
        help="--unallocated-trials: what the unallocated pod's worker holds, MiB (default 1024)",
    )
    parser.add_argument(
        "--container-trials",
        type=int,
        default=0,
        help="trials of a pod of two containers whose main one declares its own limit "
        "(KAI's nvidia.com/container.main.gpu-memory.limit, --limit-gib) and grows past it "
        "while the other holds --container-side-mib: only main may be stopped (default 0)",
    )
    parser.add_argument(
        "--container-side-mib",
        type=int,
        default=512,
        help="--container-trials: what the side container holds, MiB (default 512)",
    )
    parser.add_argument(
        "--guarded-trials",
        type=int,
        default=0,
        help="greedy trials run after all others by a second enforcer with the eBPF allocation "
        "guard on (enforcement.alloc_guard): the crossing call is frozen before it runs "
        "(default 0)",
    )
    parser.add_argument(
        "--alloc-guard-library",
        type=Path,
        metavar="PATH",
        help="--guarded-trials: the libcuda file the guard attaches to (default: the one the "
        "neighbour worker maps, from its /proc/<pid>/maps)",
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
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("run as root: the script builds cgroups and the enforcer signals")
    if threading.current_thread() is not threading.main_thread():
        return run(args)
    # A SIGTERM (``timeout``) unwinds like Ctrl-C: every ``finally`` runs, so the enforcer is
    # stopped, a tenant's MPS daemon quits and the cgroups go, instead of a silent death.
    previous = signal.signal(signal.SIGTERM, interrupted)
    try:
        return run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupted(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    """The run ``main`` parsed: build, trial, tear down, judge, report; the exit status."""
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    records = out / "records.jsonl"
    records.unlink(missing_ok=True)
    (out / "enforcer-guarded.log").unlink(missing_ok=True)  # an earlier run's
    limit = int(args.limit_gib * GIB)
    grow_to_mib = limit // MIB + 4096
    target = args.poll + args.grace + 0.050
    settle = owner_settle_seconds()
    early_bound = settle + args.grace + args.closer_margin
    targets = {
        "closer": settle + target, CLOSER_BEFORE_START: early_bound, GUARDED: GUARDED_TERM_TARGET,
    }  # fmt: skip
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
    print("\n".join(header_lines()), flush=True)
    result: dict[str, Any] = {"provenance": header(), "machine": machine_facts(nvml)}
    result["mode"] = type(source).__name__
    print(f"commit {result['machine']['commit']}, {result['machine']['command']}", flush=True)
    trials: list[Trial] = []
    dra: DraDriver | None = None
    kubelet: PodResourcesSocket | None = None
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
                (HIDDEN, limit),
                (MPS_TENANT, limit),
                (MPS_NEIGHBOUR, limit),
                ("neighbour", 8 * GIB),
            )
        }
        if args.unallocated_trials:
            pods[UNALLOCATED] = PodSpec(name=UNALLOCATED, limit_bytes=None, allocated=False)
        if args.guarded_trials:
            pods[GUARDED] = PodSpec(name=GUARDED, limit_bytes=limit)
        if args.container_trials:
            pods[TWO_CONTAINERS] = PodSpec(
                name=TWO_CONTAINERS, limit_bytes=None, own_limit_bytes=limit,
                side_container_id=uuid.uuid4().hex + uuid.uuid4().hex,
            )  # fmt: skip
        source.register(list(pods.values()))
        for p in pods.values():
            p.cgroup_dir, p.cgroup_path = cg.make(pod_cgroup_rel(p.uid, p.container_id))
            if p.side_container_id:
                p.side_cgroup_dir, p.side_cgroup_path = cg.make(
                    pod_cgroup_rel(p.uid, p.side_container_id)
                )
        source.publish(list(pods.values()))
        if args.unallocated_trials:
            kubelet = PodResourcesSocket(nvml.uuid())
            kubelet.serve(list(pods.values()))
            result["unallocated"] = {
                "pod_resources_socket": str(kubelet.path),
                "gpu_uuid": kubelet.gpu_uuid,
                "hold_mib": args.unallocated_mib,
            }
        host_dir, host_path = cg.make("system.slice/e2e-host.service")
        result["cgroups"] = (
            {n: p.cgroup_path for n, p in pods.items()}
            | {f"{n}/side": p.side_cgroup_path for n, p in pods.items() if p.side_container_id}
            | {"host": host_path}
        )
        result["cgroup_mount"] = str(cg.mount)

        for who, d in (("neighbour", pods["neighbour"].cgroup_dir), ("host", host_dir)):
            argv = [sys.executable, str(WORKER), "--role", "hold", "--label", who,
                    "--record", str(records), "--max-mib", "2048"]  # fmt: skip
            proc = spawn_in(d, argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
            side[who] = proc
            wait_ready(proc, who)
            assert proc.stdout is not None
            proc.stdout.readline()  # "held"

        guard_library: Path | None = args.alloc_guard_library
        if args.guarded_trials:
            # The driver's file as a CUDA process maps it (the neighbour's: the first worker).
            found = None if guard_library else mapped_libcuda(side["neighbour"].pid)
            guard_library = guard_library or found
            result["alloc_guard"] = {
                "library": None if guard_library is None else str(guard_library),
                "library_from": "--alloc-guard-library" if args.alloc_guard_library
                else "the neighbour worker's /proc/<pid>/maps" if found
                else "none found in the neighbour worker's maps: gpuguard's default",
            }  # fmt: skip
        config = out / "config.toml"
        write_config(config, args, None if kubelet is None else kubelet.path)
        if kubelet is not None:
            # Before the enforcer exists: it would stop this worker within seconds.
            bound = {"gpuguard": "annotation"}.get(args.limit_source, args.limit_source)
            result["unallocated"]["inspect"] = capture_inspect(
                pod=pods[UNALLOCATED], config=config, source_args=source.enforcer_args(),
                out=out, nvml=nvml, records=records, hold_mib=args.unallocated_mib,
                neighbour_bound=bound,
            )  # fmt: skip
            print_inspect(result["unallocated"]["inspect"])

        early: EarlyCloser | None = None
        if args.closer_before_start:
            # Before the enforcer exists: it never sees this process with a GPU file open.
            early = start_before_start(
                pod=pods[CLOSER_BEFORE_START], nvml=nvml, records=records, limit_bytes=limit,
                grow_to_mib=grow_to_mib, timeout=args.trial_timeout,
            )  # fmt: skip

        port = free_port()
        log_file = (out / "enforcer.log").open("w")
        wall_minus_monotonic = time.time() - time.monotonic()
        t_start = time.monotonic()
        enforcer, cmd = start_enforcer(config, log_file, source.enforcer_args(), port)
        result["enforcer_command"] = " ".join(cmd[1:])
        if early is not None:
            t = finish_before_start(
                early, records=records, log=out / "enforcer.log", t_start=t_start,
                wall_minus_monotonic=wall_minus_monotonic, bound=early_bound,
                timeout=early_bound + args.termination_timeout + 5.0, enforcer=enforcer,
            )  # fmt: skip
            trials.append(t)
            print_trial(t)
        wait_polling(enforcer, port, out / "enforcer.log")
        m0, c0 = scrape(port), cpu_seconds(enforcer.pid)

        plan = (
            [("greedy", f"greedy-{i}") for i in range(args.trials)]
            + [("stubborn", f"stubborn-{i}") for i in range(args.stubborn_trials)]
            + [("forked", f"forked-{i}") for i in range(args.forked_trials)]
            + [("forked-zombie", f"zombie-{i}") for i in range(args.zombie_trials)]
            + [("closer", f"closer-{i}") for i in range(args.closer_trials)]
            + [(HIDDEN, f"hidden-{i}") for i in range(args.hidden_trials)]
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
        for i in range(args.container_trials):
            t = run_container_trial(
                pod=pods[TWO_CONTAINERS], index=i, nvml=nvml, records=records,
                limit_bytes=limit, grow_to_mib=grow_to_mib, side_mib=args.container_side_mib,
                timeout=args.trial_timeout,
            )  # fmt: skip
            trials.append(t)
            print_trial(t)
            if enforcer.poll() is not None:
                raise RuntimeError(f"enforcer exited {enforcer.returncode} (two-containers)")
        if args.mps_trials:
            control = find_mps_control()
            result["mps"] = {
                "control": control,
                "compute_mode": nvml.compute_mode(),
                "skipped": None if control else MPS_SKIPPED,
                "looked_in": ["PATH", *MPS_CONTROL_DIRS],
                "trials": [],
            }
            if control is None:
                print(f"mps: {MPS_SKIPPED} (PATH, {', '.join(MPS_CONTROL_DIRS)})", flush=True)
            else:
                mps_setup = MpsTrialSetup(
                    control=control, tenant=pods[MPS_TENANT], neighbour=pods[MPS_NEIGHBOUR],
                    nvml=nvml, port=port, records=records, limit_bytes=limit,
                    grow_to_mib=grow_to_mib, client_mib=args.mps_client_mib,
                    timeout=args.trial_timeout,
                )  # fmt: skip
                for i in range(args.mps_trials):
                    pair, facts = run_mps_trial(mps_setup, i)
                    result["mps"]["trials"].append(facts)
                    for t in pair:
                        trials.append(t)
                        print_trial(t)
                    if enforcer.poll() is not None:
                        raise RuntimeError(f"enforcer exited {enforcer.returncode} (MPS trials)")
                    if "not_up" in facts:
                        # The same machine would refuse it again: say so once, keep the time.
                        print(f"mps: not up ({facts['not_up']}); no further MPS trial", flush=True)
                        break
        if kubelet is not None:
            unallocated = UnallocatedSetup(
                source=source, kubelet=kubelet, pods=list(pods.values()), cg=cg, nvml=nvml,
                port=port, log=out / "enforcer.log", records=records,
                hold_mib=args.unallocated_mib, timeout=args.trial_timeout,
            )  # fmt: skip
            for i in range(args.unallocated_trials):
                t = run_unallocated_trial(unallocated, i)
                trials.append(t)
                print_trial(t)
                if enforcer.poll() is not None:
                    raise RuntimeError(f"enforcer exited {enforcer.returncode} (unallocated)")
            result["cgroups"] |= {p.name: p.cgroup_path for p in unallocated.pods}
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
        if args.guarded_trials:
            # A second enforcer, the guard on, after the others: they ran without it, as before.
            stop_enforcer(enforcer)
            log_file.close()
            guarded_config = out / "config-guarded.toml"
            write_config(
                guarded_config, args, None if kubelet is None else kubelet.path,
                alloc_guard=True, alloc_guard_library=guard_library,
            )  # fmt: skip
            guarded_log = out / "enforcer-guarded.log"
            log_file = guarded_log.open("w")
            port = free_port()
            wall_minus_monotonic = time.time() - time.monotonic()
            enforcer, cmd = start_enforcer(guarded_config, log_file, source.enforcer_args(), port)
            result["guarded_enforcer_command"] = " ".join(cmd[1:])
            wait_polling(enforcer, port, guarded_log)
            result["alloc_guard"] |= guard_status(guarded_log)
            print(guard_line(result["alloc_guard"]), flush=True)
            for i in range(args.guarded_trials):
                t = run_trial(
                    kind=GUARDED, label=f"{GUARDED}-{i}", pod=pods[GUARDED], nvml=nvml,
                    records=records, limit_bytes=limit, grow_to_mib=grow_to_mib,
                    timeout=args.trial_timeout,
                )  # fmt: skip
                note_guard(t, guarded_log, wall_minus_monotonic)
                trials.append(t)
                print_trial(t)
                if enforcer.poll() is not None:
                    raise RuntimeError(f"enforcer exited {enforcer.returncode} (guarded)")
            time.sleep(2 * args.poll + 0.5)  # let the last Events flush
            result["alloc_guard"] |= guard_status(guarded_log)
        result["events"] = source.events() if isinstance(source, ApiServer) else None
    finally:
        if enforcer is not None:
            stop_enforcer(enforcer)
        if log_file is not None:
            log_file.close()
        if kubelet is not None:
            kubelet_facts = {"answered": kubelet.answered, "list_calls": kubelet.calls}
            result.setdefault("unallocated", {}).update(kubelet_facts)
            kubelet.close()
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
        if (
            r["kind"] == "signal"
            and r["role"] == "hold"
            and not str(r["label"]).startswith(f"{MPS_CLIENT}-")  # a member of a stopped tenant
        ):
            wrong.append(f"{r['label']} received SIGTERM")
    for t in trials:
        if t.dra_modest_alive is False:
            wrong.append(f"the {DRA_MODEST} pod beside {t.label} died")
        if t.side_alive is False:
            wrong.append(f"the side container of {t.label} died")
    signalled: list[dict[str, Any]] = []
    mps_pids = {
        pid
        for facts in (result.get("mps") or {}).get("trials", [])
        for pid in facts.get("mps_pids", [])
    }
    logs = [out / "enforcer.log"] + (
        [out / "enforcer-guarded.log"] if (out / "enforcer-guarded.log").exists() else []
    )
    for line in (ln for log in logs for ln in enforcer_lines(log)):
        if line.get("event") == "container_signalled":
            signalled.append(
                {k: line.get(k) for k in ("pod", "container", "signal", "pids", "used_bytes")}
            )
            if not may_be_signalled(line.get("pod")):
                wrong.append(f"enforcer signalled pod {line.get('pod')}")
            elif line.get("pod") == TWO_CONTAINERS and line.get("container") != "main":
                wrong.append(f"enforcer signalled container {line.get('container')} of "
                             f"{TWO_CONTAINERS}")  # fmt: skip
            hit = mps_pids & set(line.get("pids") or [])
            if hit and line.get("pod") != MPS_TENANT:
                wrong.append(f"stopping pod {line.get('pod')} signalled the tenant's MPS {hit}")
    if result.get("mps") is not None:
        result["mps"]["tenant_stop_signalled_mps_pids"] = sorted(
            {
                pid
                for s in signalled
                if s["pod"] == MPS_TENANT
                for pid in (s["pids"] or [])
                if pid in mps_pids
            }
        )
    if isinstance(source, PodsFile):
        result["events"] = [
            {"pod": ln.get("pod"), "reason": ln.get("reason"), "count": 1, "source": "log"}
            for log in logs
            for ln in enforcer_lines(log)
            if ln.get("event") == "pod_event"
        ]
    if isinstance(source, ApiServer) and result.get("events") is not None:
        note_unallocated_events(trials, result["events"])
    result["wrong_reports"] = [w for log in logs for w in wrong_reports(log)]
    inspected = (result.get("unallocated") or {}).get("inspect") or {}
    result["enforcer_signals"] = signalled
    result["wrong_kills"] = wrong
    result["trials"] = [asdict(t) for t in trials]
    result["owner_settle_seconds"] = settle
    result["summary"] = summarise(trials, target, targets)
    result["delisted_after_exit"] = summarise_delisting(trials)
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    print_table(result)
    ok = (
        bool(trials)
        and all(t.ok for t in trials)
        and not wrong
        and not result["wrong_reports"]
        and not inspected.get("problems")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
