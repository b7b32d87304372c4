"""The whole enforcer against real parts, as a library for ``tests/integration/test_*.py``,
``rigs/dra_cluster.py`` and ``scripts/dra_demo.py``:
``gpuguard enforce`` as a subprocess, the real kube-apiserver (RBAC on, gpuguard's
ServiceAccount), the NVML stand-in, real kubepods cgroups and real processes that record every
signal they receive. The fixtures that build it are in ``tests/integration/conftest.py``.

Owns: ``Rig`` (a node: its Node object, Pods created as admin with container statuses set
through the status subresource, worker processes spawned inside the matching container cgroups,
an NVML scenario listing their PIDs, a fake ``/dev/nvidia0`` they hold), ``Worker``,
``PodInfo``, ``EnforcerProcess`` (start, scrape ``/metrics``, read its JSON log, stop by PID)
and the simulated node's constants (``GIB``, ``GPU_UUIDS``...).

Must not: signal any process it did not start (workers die with their ``CgroupTree``, the
enforcer by its own PID), leave cgroups behind, or listen on anything but 127.0.0.1.

Why the workers hold ``/dev/nvidia0``: the resolver charges a PID's GPU memory only to a
process that has an NVIDIA GPU device (char major 195) open (``Attribution.holds_gpu``). A
device node ``c 195 0`` made with ``mknod`` in a temporary directory and opened with
``O_PATH`` (no driver open happens) looks exactly like that through ``/proc/<pid>/fd``.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from gpuguard.adapters.kube.events import EVENT_COMPONENT
from gpuguard.core.model import ContainerCgroup
from rigs.cgroups import CgroupTree
from rigs.controlplane import KubeCluster, free_port, wait_until
from rigs.nvml_stub import SCENARIO_ENV, Scenario

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
GPU_UUID = "GPU-11111111-2222-3333-4444-555555555555"
GPU_UUIDS = (GPU_UUID, "GPU-11111111-2222-3333-4444-666666666666")
"""The simulated node's two GPUs (index 0 and 1); workers sit on GPU 0 unless told otherwise."""
GPU_TOTAL_BYTES = 80 * GIB

GPUGUARD = [sys.executable, "-m", "gpuguard.cli"]
"""The gpuguard CLI as a subprocess argv prefix."""

WORKER = r"""
import os, signal, sys, time
record, term, device, ready = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
ignore_term = term == "1"  # "0": exits on SIGTERM; "none": installs no SIGTERM handler at all
close_on = sys.argv[5]  # "": keep the GPU file open; else close it once this file exists
hidden, fork_file = sys.argv[6] == "hidden", sys.argv[7]
gpu_fd = None if hidden else os.open(device, os.O_PATH)  # /proc/<pid>/fd shows chr 195:0
if hidden:
    # The GPU file in a thread with a file table of its own (unshare(CLONE_FILES)):
    # /proc/<pid>/fd, the leader's table, never shows it; /proc/<pid>/task/<tid>/fd does.
    import ctypes, threading
    opened = threading.Event()

    def hide():
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(0x400) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_FILES)")
        os.open(device, os.O_PATH)
        opened.set()
        threading.Event().wait()

    threading.Thread(target=hide, daemon=True).start()
    opened.wait()

def note(signum, frame):
    fd = os.open(record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, (signal.Signals(signum).name + "\n").encode())
    os.close(fd)
    if signum == signal.SIGTERM and not ignore_term:
        os._exit(143)

for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
          signal.SIGUSR2, signal.SIGALRM, signal.SIGCONT, signal.SIGPIPE):
    if s != signal.SIGTERM or term != "none":
        signal.signal(s, note)
open(ready, "w").close()
while close_on and gpu_fd is not None:
    if os.path.exists(close_on):
        # What an H200 process did to escape: close every GPU file, keep the memory.
        os.close(gpu_fd)
        gpu_fd = None
        open(close_on + ".done", "w").close()
    else:
        time.sleep(0.02)
if fork_file:
    # Wait for the go, fork a child that keeps the "context" (NVML goes on listing this PID
    # while it lives), then exit: this PID becomes a ghost nobody holds.
    while not os.path.exists(fork_file):
        time.sleep(0.02)
    child = os.fork()
    if child == 0:
        while True:
            time.sleep(3600)
    with open(fork_file + ".child.tmp", "w") as f:
        f.write(str(child))
    os.rename(fork_file + ".child.tmp", fork_file + ".child")
    os._exit(0)
while True:
    time.sleep(3600)
"""


# ---------------------------------------------------------------------------------------------
# Worker processes


@dataclass(slots=True, kw_only=True)
class Worker:
    """A real process in a real cgroup that appends each signal it catches to ``record``.

    SIGKILL cannot be caught: it shows as ``returncode == -9``.
    """

    name: str
    proc: subprocess.Popen[bytes]
    record: Path
    used_bytes: int
    gpu: int = 0
    close_trigger: Path | None = None
    """The file whose creation makes the worker close its GPU device file."""
    host_pid: int | None = None
    """A worker that is PID 1 of its own PID namespace (``Rig.spawn(..., pid1=True)``): its
    PID on the host; ``proc`` is then its ``unshare`` launcher, which exits when it does."""
    mps: bool = False
    """Listed as an MPS client (NVML's MPS list) instead of as a compute process."""
    fork_trigger: Path | None = None
    """The file whose creation makes the worker fork a child and exit (``forks=True``)."""
    unlisted: bool = False
    """NVML does not list it (yet): ``Rig.spawn(..., listed=False)``, then ``Rig.list()``."""
    mig_slot: int | None = None
    """Listed on that MIG instance of its GPU (``Rig.mig_instances``), not on the GPU."""

    def fork_and_exit(self) -> int:
        """Make the worker fork a child that keeps its listing and exit; the child's PID."""
        assert self.fork_trigger is not None, "spawn(..., forks=True) first"
        self.fork_trigger.touch()
        done = Path(f"{self.fork_trigger}.child")
        wait_until(done.exists, timeout=10, interval=0.02, what=f"{self.name} to fork")
        return int(done.read_text())

    def child(self) -> int | None:
        """The forked child's PID, once it forked."""
        if self.fork_trigger is None:
            return None
        try:
            return int(Path(f"{self.fork_trigger}.child").read_text())
        except FileNotFoundError:
            return None

    def listed(self) -> bool:
        """NVML lists it: while it lives, and after it forked and exited, while its child
        (which holds its "context") lives."""
        if self.unlisted:
            return False
        if self.proc.poll() is None:
            return True
        child = self.child()
        return child is not None and _running(child)

    @property
    def pid(self) -> int:
        return self.host_pid if self.host_pid is not None else self.proc.pid

    def close_gpu_files(self) -> None:
        """Make the worker close its GPU device file (it keeps its NVML listing), and wait."""
        assert self.close_trigger is not None, "spawn(..., closes_gpu_files=True) first"
        self.close_trigger.touch()
        done = Path(f"{self.close_trigger}.done")
        wait_until(done.exists, timeout=10, interval=0.02, what=f"{self.name} to close its files")

    def signals(self) -> list[str]:
        try:
            return self.record.read_text().split()
        except FileNotFoundError:
            return []

    def alive(self) -> bool:
        return self.proc.poll() is None

    def killed(self) -> bool:
        if self.host_pid is not None:
            # util-linux cannot re-raise SIGKILL on the launcher (it exits 1), and a PID 1 that
            # catches SIGTERM exits 143 from its handler: anything else that ended it is the
            # SIGKILL (the kernel drops every other signal it has no handler for).
            return self.proc.poll() not in (None, 143)
        return self.proc.poll() == -signal.SIGKILL

    def received(self) -> list[str]:
        """Every signal this process got, in order, with an uncatchable SIGKILL last."""
        return self.signals() + (["KILL"] if self.killed() else [])


def _running(pid: int) -> bool:
    """``pid`` is a process that has not exited (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat[stat.rfind(b")") + 2 :][:1] not in (b"Z", b"X")


@dataclass(frozen=True, slots=True, kw_only=True)
class PodInfo:
    namespace: str
    name: str
    uid: str
    container_id: str


# ---------------------------------------------------------------------------------------------
# The enforcer subprocess


@dataclass(slots=True, kw_only=True)
class EnforcerProcess:
    """``python -m gpuguard.cli enforce`` started by a test; stopped by its PID."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    metrics_port: int
    started_at: float = field(default_factory=time.monotonic)

    def lines(self) -> list[dict[str, Any]]:
        """The structlog JSON lines written so far (other lines skipped)."""
        out: list[dict[str, Any]] = []
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return out
        for line in text.splitlines():
            with contextlib.suppress(ValueError):
                doc = json.loads(line)
                if isinstance(doc, dict):
                    out.append(doc)
        return out

    def events(self, name: str, **match: object) -> list[dict[str, Any]]:
        return [
            d
            for d in self.lines()
            if d.get("event") == name and all(d.get(k) == v for k, v in match.items())
        ]

    def text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def settled_events(
        self, name: str, count: int, *, timeout: float = 10.0
    ) -> list[dict[str, Any]]:
        """The ``name`` lines once at least ``count`` are logged: a test sees a signalled
        process die before the enforcer writes the line saying it signalled it."""
        deadline = time.monotonic() + timeout
        while len(found := self.events(name)) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        return found

    def wait_for(self, name: str, *, timeout: float = 20.0, **match: object) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.events(name, **match)
            if found:
                return found[0]
            if self.proc.poll() is not None:
                pytest.fail(f"enforcer exited {self.proc.returncode}:\n{self.text()[-6000:]}")
            time.sleep(0.05)
        pytest.fail(f"no {name} {match} log line within {timeout}s:\n{self.text()[-6000:]}")

    def http(self, path: str) -> tuple[int, str]:
        url = f"http://127.0.0.1:{self.metrics_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=3) as r:
                return int(r.status), r.read().decode()
        except urllib.error.HTTPError as e:
            with e:
                return int(e.code), e.read().decode()

    def metric(self, name: str, labels: Mapping[str, str] | None = None) -> float | None:
        """One sample from ``/metrics`` (exposition text), or ``None`` when absent."""
        _code, text = self.http("/metrics")
        want = dict(labels or {})
        for line in text.splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            head, _, value = line.rpartition(" ")
            metric, _, rest = head.partition("{")
            if metric != name:
                continue
            got: dict[str, str] = {}
            for pair in rest.rstrip("}").split(","):
                if "=" in pair:
                    k, _, v = pair.partition("=")
                    got[k] = v.strip('"')
            if all(got.get(k) == v for k, v in want.items()):
                return float(value)
        return None

    def ready(self) -> tuple[bool, str]:
        try:
            code, body = self.http("/readyz")
        except OSError:
            return False, "unreachable"
        return code == 200, body.strip()

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM our enforcer (by PID), SIGKILL after ``timeout``; returns its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


# ---------------------------------------------------------------------------------------------
# The rig


class Rig:
    """One simulated GPU node: Node and Pods in the API server, cgroups, processes, NVML."""

    def __init__(
        self,
        *,
        cluster: KubeCluster,
        namespace: str,
        node: str,
        tree: CgroupTree,
        workdir: Path,
        stub_lib: Path,
        device_node: Path,
        kubeconfig: Callable[..., Path],
    ) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.node = node
        self.tree = tree
        self.dir = workdir
        self.stub_lib = stub_lib
        self.device_node = device_node
        self.kubeconfig = kubeconfig
        self.scenario = Scenario(workdir / "scenario.json")
        self.workers: list[Worker] = []
        self.enforcers: list[EnforcerProcess] = []
        self.created_pods: list[tuple[str, str]] = []
        """(namespace, name) of every pod made; those outside the test's namespace (default,
        kube-system) are deleted by ``close()``."""
        self.mig_instances: dict[int, list[dict[str, Any]]] = {}
        """GPU index → its MIG instances, as the stand-in's scenario lists them (``slot``,
        ``gi``, ``uuid``, ``total_bytes``, ``profile_id``, ``placement_start``...): that GPU is
        then in MIG mode, and a worker with ``mig_slot`` is listed on its instance. Set with
        ``set_mig``."""
        self._lock = threading.Lock()
        self._written: str | None = None
        self._stop = threading.Event()
        self.write_scenario()
        # The "driver": a process that exited frees its memory at the next NVML listing.
        self._driver = threading.Thread(target=self._drive, name="test-nvml-driver", daemon=True)
        self._driver.start()

    # -- API objects ---------------------------------------------------------------------------

    def add_pod(
        self,
        name: str,
        *,
        limit: str | None = None,
        namespace: str | None = None,
        annotations: Mapping[str, str] | None = None,
        cgroup_uid: str | None = None,
        resource_limits: Mapping[str, str] | None = None,
    ) -> PodInfo:
        """A pod bound to this node with one container ``main`` running (as kubelet reports).

        ``cgroup_uid``: the UID its cgroups carry when it is not ``metadata.uid`` (a static
        pod's hash, with the mirror pod's annotations in ``annotations``)."""
        ns = namespace or self.namespace
        wanted = dict(annotations or {})
        if limit:
            wanted["gpuguard.io/gpu-memory-limit"] = limit
        created = self.cluster.create_pod(
            ns, name, node=self.node, annotations=wanted, limits=resource_limits
        )
        cid = uuid.uuid4().hex + uuid.uuid4().hex
        self.cluster.set_container_statuses(
            ns, name, [{"name": "main", "containerID": f"containerd://{cid}"}]
        )
        self.created_pods.append((ns, name))
        uid = cgroup_uid or created["metadata"]["uid"]
        return PodInfo(namespace=ns, name=name, uid=uid, container_id=cid)

    def pod_events(self, pod: PodInfo) -> list[dict[str, Any]]:
        """gpuguard's Events on ``pod`` (core/v1 and events.k8s.io/v1), read back as admin.

        Only those gpuguard reported (``reportingComponent``/``source.component``, the
        ``EVENT_COMPONENT`` it writes): where a real scheduler runs (the DRA rig) the pod also
        carries its ``Scheduled`` Event, which says nothing about enforcement.
        """
        found: list[dict[str, Any]] = []
        core = self.cluster.admin_request(
            "GET",
            f"/api/v1/namespaces/{pod.namespace}/events"
            f"?fieldSelector=involvedObject.uid%3D{pod.uid}",
        )
        found.extend(core.get("items") or [])
        new = self.cluster.admin_request(
            "GET", f"/apis/events.k8s.io/v1/namespaces/{pod.namespace}/events"
        )
        seen = {(e.get("metadata") or {}).get("uid") for e in found}
        for e in new.get("items") or []:
            regarding = e.get("regarding") or {}
            if regarding.get("uid") == pod.uid and (e.get("metadata") or {}).get("uid") not in seen:
                found.append(e)
        return [e for e in found if _reported_by_gpuguard(e)]

    def event_reasons(self, pod: PodInfo) -> list[str]:
        return sorted(str(e.get("reason")) for e in self.pod_events(pod))

    # -- processes -----------------------------------------------------------------------------

    def spawn(
        self,
        pod: PodInfo | None,
        name: str,
        *,
        used_bytes: int,
        ignore_term: bool = False,
        gpu: int = 0,
        cgroups: Sequence[ContainerCgroup] = (),
        closes_gpu_files: bool = False,
        sigterm_handler: bool = True,
        pid1: bool = False,
        hidden: bool = False,
        forks: bool = False,
        mps: bool = False,
        listed: bool = True,
        mig_slot: int | None = None,
    ) -> Worker:
        """A worker in ``pod``'s container cgroup (v2, systemd driver, containerd), or, with
        ``pod=None``, in a host cgroup outside kubepods; listed by NVML with ``used_bytes``.
        ``cgroups`` (one per hierarchy) places it there instead. ``closes_gpu_files``: it
        closes its GPU device file when ``Worker.close_gpu_files()`` is called.
        ``sigterm_handler=False``: it installs none (like ``python train.py``); ``pid1``: it
        runs as PID 1 of its own PID namespace, as a container's entrypoint does, so without a
        handler the kernel drops SIGTERM to it. ``hidden``: its GPU file is open only in a
        thread with a file table of its own; ``forks``: ``Worker.fork_and_exit()`` makes it
        fork a child that keeps its listing and exit; ``mps``: NVML lists it as an MPS client;
        ``listed=False``: NVML lists it only from ``Rig.list(worker)`` on; ``mig_slot``: NVML
        lists it on that MIG instance of ``gpu`` (``set_mig``)."""
        if cgroups:
            placed = list(cgroups)
        elif pod is None:
            cg = self.tree.make(2, f"system.slice/host-{name}.service")
        else:
            cg = self.tree.container(
                version=2,
                driver="systemd",
                qos="burstable",
                pod_uid=pod.uid,
                runtime="containerd",
                container_id=pod.container_id,
            )
        if not cgroups:
            placed = [cg]
        record = self.dir / f"{name}.signals"
        ready = self.dir / f"{name}.ready"
        trigger = self.dir / f"{name}.close" if closes_gpu_files else None
        fork_trigger = self.dir / f"{name}.fork" if forks else None
        term = "none" if not sigterm_handler else "1" if ignore_term else "0"
        argv = [
            sys.executable,
            "-c",
            WORKER,
            str(record),
            term,
            str(self.device_node),
            str(ready),
            str(trigger or ""),
            "hidden" if hidden else "",
            str(fork_trigger or ""),
        ]
        host_pid: int | None = None
        if pid1:
            proc, host_pid = self.tree.spawn_init(argv, cgroups=placed)
        else:
            proc = self.tree.spawn(argv, cgroups=placed)
        wait_until(ready.exists, timeout=10, interval=0.02, what=f"worker {name} ready")
        worker = Worker(
            name=name,
            proc=proc,
            record=record,
            used_bytes=used_bytes,
            gpu=gpu,
            close_trigger=trigger,
            host_pid=host_pid,
            mps=mps,
            fork_trigger=fork_trigger,
            unlisted=not listed,
            mig_slot=mig_slot,
        )
        with self._lock:
            self.workers.append(worker)
        self.write_scenario()
        return worker

    def list(self, worker: Worker) -> None:
        """NVML lists ``worker`` from now on (spawned with ``listed=False``)."""
        with self._lock:
            worker.unlisted = False
        self.write_scenario()

    def set_mig(self, gpu: int, instances: Sequence[Mapping[str, Any]]) -> None:
        """GPU ``gpu`` in MIG mode with ``instances`` (the stand-in's ``mig_instances``)."""
        with self._lock:
            self.mig_instances[gpu] = [dict(i) for i in instances]
        self.write_scenario()

    def set_usage(self, worker: Worker, used_bytes: int) -> None:
        with self._lock:
            worker.used_bytes = used_bytes
        self.write_scenario()

    def _listed(self, index: int, slot: int | None, mps: bool) -> builtins.list[dict[str, int]]:
        return [
            {"pid": w.pid, "used_bytes": w.used_bytes}
            for w in self.workers
            if w.listed() and w.gpu == index and w.mig_slot == slot and w.mps == mps
        ]

    def _device(self, index: int, uuid_: str) -> dict[str, Any]:
        device: dict[str, Any] = {
            "uuid": uuid_,
            "name": "NVIDIA H200",
            "total_bytes": GPU_TOTAL_BYTES,
            "processes": self._listed(index, None, False),
            "graphics_processes": [],
            "mps_processes": self._listed(index, None, True),
        }
        instances = self.mig_instances.get(index)
        if instances is not None:
            device["mig_mode"] = "enabled"
            device["mig_instances"] = [
                {
                    **i,
                    "processes": self._listed(index, i["slot"], False),
                    "mps_processes": self._listed(index, i["slot"], True),
                }
                for i in instances
            ]
        return device

    def write_scenario(self) -> None:
        with self._lock:
            doc = {
                "driver_version": "580.95.05",
                "devices": [self._device(index, uuid_) for index, uuid_ in enumerate(GPU_UUIDS)],
            }
            text = json.dumps(doc, sort_keys=True)
            if text == self._written:
                return
            self.scenario.write(doc)
            self._written = text

    def _drive(self) -> None:
        # Whoever reaps a worker first (this thread, or a test calling ``alive()``), the next
        # pass writes the scenario without it: the written text, not who saw the exit, decides.
        while not self._stop.wait(0.02):
            with self._lock:
                for w in self.workers:
                    w.proc.poll()
            self.write_scenario()

    # -- the enforcer --------------------------------------------------------------------------

    def config(
        self,
        *,
        kubeconfig: Path,
        metrics_port: int,
        termination_timeout_seconds: float = 1.0,
        grace_seconds: float = 1.0,
        staleness_seconds: float = 4.0,
        pressure_free_fraction: float = 0.0,
        sources: Sequence[str] = ("gpuguard",),
        mps_gpus: Sequence[str] = (),
        exempt_namespaces: Sequence[str] = ("kube-system",),
        exempt_namespace_label: str = "",
        pod_resources_socket: Path | None = None,
        unallocated: str = "report",
    ) -> Path:
        """The enforcer's config. Device pressure is off unless a test turns it on: the rig's
        workers fill the 80 GiB devices however a test needs, and only the pressure tests mean
        to skip the grace period. Every enforcer of one rig shares one node lock file, in the
        rig's directory (one node: the second one started while the first runs stands by).
        ``pod_resources_socket``: the kubelet's socket to read (a ``rigs/podresources.py``
        one); ``None`` leaves the setting at its default."""
        path = self.dir / f"config-{metrics_port}.toml"
        socket = (
            ""
            if pod_resources_socket is None
            else f'pod_resources_socket = "{pod_resources_socket}"'
        )
        path.write_text(
            f"""version = 1
[node]
name = "{self.node}"
proc_root = "/proc"
cgroup_root = "/sys/fs/cgroup"
{socket}
[enforcement]
mode = "enforce"
unallocated = "{unallocated}"
poll_interval_seconds = 0.1
grace_seconds = {grace_seconds}
termination_timeout_seconds = {termination_timeout_seconds}
staleness_seconds = {staleness_seconds}
pressure_free_fraction = {pressure_free_fraction}
lock_file = "{self.dir / "enforcer.lock"}"
mps_gpus = {json.dumps(list(mps_gpus))}
[limits]
exempt_namespaces = {json.dumps(list(exempt_namespaces))}
exempt_namespace_label = {json.dumps(exempt_namespace_label)}
sources = {json.dumps(list(sources))}
[metrics]
address = "127.0.0.1:{metrics_port}"
[kube]
kubeconfig = "{kubeconfig}"
connect_timeout_seconds = 1.0
request_timeout_seconds = 2.0
watch_timeout_seconds = 2.0
inactivity_seconds = 2.0
[nvml]
library_path = "{self.stub_lib}"
call_timeout_seconds = 1.0
[logging]
level = "info"
format = "json"
"""
        )
        return path

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUGUARD_")}
        env.pop("NODE_NAME", None)
        env.pop("POD_UID", None)
        env[SCENARIO_ENV] = str(self.scenario.path)
        env["PYTHONPATH"] = str(REPO)
        return env

    def start_enforcer(self, *, kubeconfig: Path | None = None, **config: Any) -> EnforcerProcess:
        port = free_port()
        cfg = self.config(kubeconfig=kubeconfig or self.kubeconfig(), metrics_port=port, **config)
        log_path = self.dir / f"enforcer-{port}.log"
        with log_path.open("wb") as out:
            proc = subprocess.Popen(
                [*GPUGUARD, "enforce", "--config", str(cfg)],
                cwd=REPO,
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        enforcer = EnforcerProcess(proc=proc, log_path=log_path, metrics_port=port)
        self.enforcers.append(enforcer)
        return enforcer

    def run_cli(
        self,
        *argv: str,
        kubeconfig: Path | None = None,
        config: Path | None = None,
        timeout: float = 60.0,
        **config_kw: Any,
    ) -> subprocess.CompletedProcess[str]:
        """``python -m gpuguard.cli ARGV --config <config>``, captured: a one-shot command
        (explain, inspect...) with ``config``, or else this node's enforcer config (``kubeconfig``
        and ``config_kw`` as for :meth:`config`)."""
        cfg = config or self.config(
            kubeconfig=kubeconfig or self.kubeconfig(), metrics_port=free_port(), **config_kw
        )
        return subprocess.run(
            [*GPUGUARD, *argv, "--config", str(cfg)],
            cwd=REPO,
            env=self.env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def close(self) -> None:
        for ns, name in self.created_pods:
            if ns != self.namespace:
                with contextlib.suppress(Exception):
                    self.cluster.admin_request("DELETE", f"/api/v1/namespaces/{ns}/pods/{name}")
        self._stop.set()
        for e in self.enforcers:
            code = e.stop()
            # Shown by pytest when the test failed: what the enforcer saw and did.
            print(f"--- enforcer {e.proc.pid} exit {code}, log tail:\n{e.text()[-8000:]}")
        self._driver.join(timeout=5)


RigT = TypeVar("RigT", bound="Rig")


@contextlib.contextmanager
def rig_on_fresh_tree(make: Callable[[CgroupTree], RigT]) -> Iterator[RigT]:
    """The rig ``make`` builds on a fresh cgroup tree; on exit the rig is closed (its enforcers
    stopped, its pods outside the test's namespace deleted), then the tree (its processes
    killed, its cgroups removed), also after a failure."""
    tree = CgroupTree()
    try:
        rig = make(tree)
        try:
            yield rig
        finally:
            rig.close()
    finally:
        tree.close()


def _reported_by_gpuguard(event: Mapping[str, Any]) -> bool:
    source = event.get("source") or {}
    return EVENT_COMPONENT in (
        event.get("reportingComponent"),
        event.get("reportingController"),
        source.get("component"),
    )
