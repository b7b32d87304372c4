"""The node of the GPU end-to-end runs (``scripts/gpu_e2e.py``) and the reaction benchmark
(``benchmarks/reaction.py``), which runs on the same GPU machines: cgroups below one unique root
of the v2 tree (``Cgroups``, ``v2_mount``), the kubelet's naming of a pod's container cgroup
(``pod_cgroup_rel``), a process started inside a cgroup before it execs (``spawn_in``), and the
pods of node ``NODE`` in namespace ``NAMESPACE`` with the limit each declares (``PodSpec``).

Standard library only (and ``rigs.processes``): the GPU machine has only the scripts'
dependencies. Must not signal a process outside the cgroups it created (``Cgroups.close`` kills
their members by pidfd) or touch a cgroup outside its own root.
"""

from __future__ import annotations

import secrets
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rigs.processes import pidfd_kill

NAMESPACE = "e2e"
NODE = "e2e"
MIB = 1 << 20
LIMIT_ANNOTATION = "gpuguard.io/gpu-memory-limit"
KAI_MEMORY = "gpu-memory"  # KAI-Scheduler's annotation, MiB (docs/schedulers.md)
HAMI_MEMORY = "nvidia.com/gpumem"  # HAMi's container resource limit, MiB
KAI_CONTAINER_LIMIT = "nvidia.com/container.{container}.gpu-memory.limit"
"""KAI-Scheduler's per-container limit (NvFractions), a Kubernetes quantity: read with ``kai`` in
``limits.sources`` (docs/schedulers.md, Per-container declarations)."""


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
    ``rigs/cgroups.py`` builds it)."""
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
    allocated: bool = True
    """Whether the kubelet's pod-resources answer gives the pod the GPU (a ``nvidia.com/gpu``
    replica); ``False``: it requested no GPU (the unallocated pods)."""
    side_container_id: str = ""
    """Set: the pod has a second container, ``side``, with this ID and its own cgroup
    (``side_cgroup_dir``, ``side_cgroup_path``)."""
    side_cgroup_dir: Path = Path()
    side_cgroup_path: str = ""
    own_limit_bytes: int | None = None
    """``main``'s own limit, as KAI declares it per container (``KAI_CONTAINER_LIMIT``),
    whatever ``source`` the pod's limit is written in."""

    def containers(self) -> list[tuple[str, str]]:
        """(name, container ID) of each container: ``main``, and ``side`` where set."""
        found = [("main", self.container_id)]
        if self.side_container_id:
            found.append(("side", self.side_container_id))
        return found

    def declaration(self, source: str) -> tuple[dict[str, str], dict[str, str]]:
        """(annotations, container resource limits) declaring this pod's limit as ``source``
        writes it: gpuguard's annotation, KAI's ``gpu-memory`` annotation (MiB) or HAMi's
        ``nvidia.com/gpumem`` container limit (MiB); and ``main``'s own limit, where set."""
        annotations: dict[str, str] = {}
        if self.own_limit_bytes:
            own = KAI_CONTAINER_LIMIT.format(container="main")
            annotations[own] = f"{self.own_limit_bytes // MIB}Mi"
        if not self.limit_bytes:
            return annotations, {}
        mib = str(self.limit_bytes // MIB)
        if source == "kai":
            return {**annotations, KAI_MEMORY: mib}, {}
        if source == "hami":
            return annotations, {HAMI_MEMORY: mib}
        return {**annotations, LIMIT_ANNOTATION: f"{mib}Mi"}, {}

    def manifest(self, source: str = "gpuguard") -> dict[str, Any]:
        annotations, limits = self.declaration(source)
        containers: list[dict[str, Any]] = []
        for name, _ in self.containers():
            container: dict[str, Any] = {"name": name, "image": "registry.invalid/cuda:1"}
            if limits and name == "main":
                container["resources"] = {"limits": limits}
            containers.append(container)
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
                "containers": containers,
            },
            "status": {
                "phase": "Running",
                "qosClass": "Burstable",
                "containerStatuses": [
                    {"name": name, "containerID": f"containerd://{cid}"}
                    for name, cid in self.containers()
                ],
            },
        }
