"""Real kubepods-like cgroup trees, in cgroup v1 and v2, cleaned up always.

Owns: creating cgroups under a unique per-tree test root in the v1 hierarchies
(``/sys/fs/cgroup/<controller>``, e.g. ``pids`` or ``systemd`` for ``name=systemd``) and in v2
(``/sys/fs/cgroup/unified``), starting real processes inside them, and tearing everything down
(every process it started or that lives in its cgroups is SIGKILLed by pidfd, then the cgroups are
removed deepest first), also when a test fails.

Must not: touch any cgroup outside its own test root, or signal any process that is not in one
of its own cgroups or was not started by it.

Used by the kernel and integration tests, the benchmarks (``node_container``: the one layout
their numbers compare) and the scripts. Typical use (see ``cgroup_tree`` in
``tests/kernel/conftest.py``)::

    cg = tree.container(version=2, driver="systemd", qos="burstable", pod_uid=UID,
                        runtime="containerd", container_id=CID)
    proc = tree.spawn(["sleep", "60"], cgroups=[cg])
    # /proc/<proc.pid>/cgroup now shows cg.path on its 0:: line
    tree.close()  # or let the fixture do it

Paths returned in ``ContainerCgroup.path`` are what ``/proc/<pid>/cgroup`` shows for a reader in
the root cgroup namespace, e.g. ``/gpuguard-test-123-0/kubepods.slice/…/cri-containerd-<id>.scope``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from gpuguard.core.model import ContainerCgroup
from rigs.prereq import require
from rigs.processes import pidfd_kill

__all__ = [
    "CGROUP_MOUNT",
    "V2_ROOT",
    "CgroupTree",
    "cgroup_dir",
    "container_leaf",
    "fake_container_id",
    "hierarchy_dir",
    "kernel_problem",
    "node_container",
    "pod_path",
    "require",
    "require_kernel",
]

CGROUP_MOUNT = Path("/sys/fs/cgroup")
V2_ROOT = CGROUP_MOUNT / "unified"
"""Where this machine mounts cgroup v2 (hybrid layout). On a pure v2 host it would be the mount."""

Driver = Literal["systemd", "cgroupfs"]
Qos = Literal["guaranteed", "burstable", "besteffort"]
RuntimeName = Literal["containerd", "cri-o", "docker"]

_counter = itertools.count()


def hierarchy_dir(version: int, hierarchy: str) -> Path:
    """The mount directory of a hierarchy: v2 → ``/sys/fs/cgroup/unified``; v1 ``pids`` →
    ``/sys/fs/cgroup/pids``; v1 ``name=systemd`` → ``/sys/fs/cgroup/systemd``."""
    if version == 2:
        return V2_ROOT
    name = hierarchy.removeprefix("name=")
    return CGROUP_MOUNT / name


def cgroup_dir(cg: ContainerCgroup) -> Path:
    """The directory of a ``ContainerCgroup`` (absolute path as seen in the root cgroupns)."""
    return hierarchy_dir(cg.version, cg.hierarchy) / cg.path.lstrip("/")


def kernel_problem(hierarchies: Iterable[tuple[int, str]] = ((1, "pids"), (2, ""))) -> str | None:
    """Why kernel cgroup tests cannot run here, or ``None`` when they can."""
    if os.geteuid() != 0:
        return "needs root to create cgroups"
    for version, hierarchy in hierarchies:
        d = hierarchy_dir(version, hierarchy)
        if not (d / "cgroup.procs").is_file():
            return f"cgroup hierarchy not mounted at {d}"
        if not os.access(d, os.W_OK):
            return f"cgroup hierarchy {d} is not writable"
    return None


def require_kernel(hierarchies: Iterable[tuple[int, str]] = ((1, "pids"), (2, ""))) -> None:
    """``require`` that root and the given hierarchies are usable."""
    problem = kernel_problem(hierarchies)
    require(problem is None, problem or "")


# ---------------------------------------------------------------------------------------------
# Kubelet naming: pod and container cgroups of the systemd and cgroupfs drivers


def pod_path(*, driver: Driver, qos: Qos, pod_uid: str, prefix: str = "kubepods") -> str:
    """The pod cgroup relative to its parent of ``kubepods``, as kubelet names it.

    ``prefix`` is the kubepods name; kind uses ``kubelet`` cgroupRoot, i.e. the systemd name
    parts ``("kubelet", "kubepods", ...)``; pass ``prefix="kubelet-kubepods"`` plus the outer
    ``kubelet.slice`` yourself for that layout.
    """
    if driver == "cgroupfs":
        parts = [prefix] + ([] if qos == "guaranteed" else [qos]) + [f"pod{pod_uid}"]
        return "/".join(parts)
    names = [prefix] + ([] if qos == "guaranteed" else [qos]) + ["pod" + pod_uid.replace("-", "_")]
    # systemd: every level is the dash-join of all parts so far, plus ".slice".
    return "/".join("-".join(names[: i + 1]) + ".slice" for i in range(len(names)))


def container_leaf(*, driver: Driver, runtime: RuntimeName, container_id: str) -> str:
    """The container's cgroup name below its pod cgroup."""
    if driver == "systemd":
        prefix = {"containerd": "cri-containerd", "cri-o": "crio", "docker": "docker"}[runtime]
        return f"{prefix}-{container_id}.scope"
    return f"crio-{container_id}" if runtime == "cri-o" else container_id


def fake_container_id(n: int) -> str:
    """A deterministic 64-hex container ID distinct per ``n``."""
    return f"{n:08x}" * 8


# ---------------------------------------------------------------------------------------------
# The tree


class CgroupTree:
    """A unique test root in each hierarchy used, its cgroups, and the processes started in them.

    Not thread-safe. Call ``close()`` (the fixture does) to kill and remove everything.
    """

    def __init__(self, name: str | None = None) -> None:
        self.name = name or f"gpuguard-test-{os.getpid()}-{next(_counter)}"
        self._created: list[Path] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._closed = False

    # -- cgroups ------------------------------------------------------------------------------

    def root_path(self) -> str:
        """The test root as ``/proc/<pid>/cgroup`` shows it: ``/<name>``."""
        return "/" + self.name

    def make(self, version: int, rel: str, hierarchy: str = "pids") -> ContainerCgroup:
        """Create ``<test root>/<rel>`` (and parents) in one hierarchy; v2 ignores ``hierarchy``.

        Returns it as a ``ContainerCgroup`` whose ``path`` includes the test root.
        """
        hier = "" if version == 2 else hierarchy
        base = hierarchy_dir(version, hier)
        path = self.root_path() + "/" + rel.strip("/") if rel.strip("/") else self.root_path()
        d = base
        for part in path.strip("/").split("/"):
            d = d / part
            if not d.exists():
                d.mkdir()
                self._created.append(d)
        return ContainerCgroup(version=version, hierarchy=hier, path=path)

    def container(
        self,
        *,
        version: int,
        driver: Driver,
        qos: Qos,
        pod_uid: str,
        runtime: RuntimeName,
        container_id: str,
        hierarchy: str = "pids",
        outer: str = "",
    ) -> ContainerCgroup:
        """Create a kubelet-style container cgroup: ``[outer/]kubepods…/pod…/<leaf>``."""
        rel = "/".join(
            p
            for p in (
                outer.strip("/"),
                pod_path(driver=driver, qos=qos, pod_uid=pod_uid),
                container_leaf(driver=driver, runtime=runtime, container_id=container_id),
            )
            if p
        )
        return self.make(version, rel, hierarchy)

    def child(self, parent: ContainerCgroup, name: str) -> ContainerCgroup:
        """Create a subgroup below ``parent`` (crun's ``container``, nested cgroups)."""
        rel = parent.path.removeprefix(self.root_path()).strip("/") + "/" + name
        return self.make(parent.version, rel, parent.hierarchy or "pids")

    # -- processes ----------------------------------------------------------------------------

    def spawn(
        self,
        argv: Sequence[str],
        *,
        cgroups: Sequence[ContainerCgroup],
        timeout_seconds: float = 5.0,
        **popen_kwargs: object,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside every given cgroup (one per hierarchy) *before* it execs.

        A ``sh`` wrapper writes its own PID into each ``cgroup.procs`` and then ``exec``s argv,
        so anything argv forks starts inside. Returns once the kernel shows the PID as a member
        of every cgroup (or raises ``TimeoutError``). The process is killed by ``close()``.
        """
        popen_args: dict[str, Any] = {"stdin": subprocess.DEVNULL, **popen_kwargs}
        proc: subprocess.Popen[bytes] = subprocess.Popen(
            [*_join_then_exec(cgroups, "$$"), *argv], **popen_args
        )
        self._procs.append(proc)
        deadline = time.monotonic() + timeout_seconds
        while not all(self.is_member(proc.pid, cg) for cg in cgroups):
            if proc.poll() is not None:
                raise RuntimeError(f"{argv!r} exited with {proc.returncode} before joining")
            if time.monotonic() > deadline:
                raise TimeoutError(f"pid {proc.pid} did not join {cgroups!r}")
            time.sleep(0.005)
        return proc

    def spawn_init(
        self,
        argv: Sequence[str],
        *,
        cgroups: Sequence[ContainerCgroup],
        timeout_seconds: float = 5.0,
        **popen_kwargs: object,
    ) -> tuple[subprocess.Popen[bytes], int]:
        """Start ``argv`` as PID 1 of a new PID namespace, alone in the given cgroups, the way a
        container runtime starts a container's entrypoint.

        ``unshare --pid --fork --kill-child`` stays outside the cgroups (like runc and the
        shim); its child, PID 1 inside, joins each cgroup and then ``exec``s argv. Returns the
        launcher (killed by ``close()``, which kills its child with it) and the init's host PID,
        once the kernel shows it as a member of every cgroup and it has exec'd. The launcher's
        exit status is not the init's (util-linux cannot re-raise SIGKILL): watch the host PID
        through a pidfd instead.
        """
        popen_args: dict[str, Any] = {"stdin": subprocess.DEVNULL, **popen_kwargs}
        launcher: subprocess.Popen[bytes] = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--kill-child", *_join_then_exec(cgroups, "0"), *argv],
            **popen_args,
        )
        self._procs.append(launcher)
        exec_name = Path(argv[0]).name[:15]  # comm: the exec'd file's name, at most 15 bytes
        deadline = time.monotonic() + timeout_seconds
        while True:
            if launcher.poll() is not None:
                raise RuntimeError(f"{argv!r} exited with {launcher.returncode} before joining")
            init = _first_child(launcher.pid)
            if (
                init is not None
                and all(self.is_member(init, cg) for cg in cgroups)
                and _comm(init) == exec_name
            ):
                return launcher, init
            if time.monotonic() > deadline:
                raise TimeoutError(f"PID 1 of {argv!r} did not join {cgroups!r}")
            time.sleep(0.005)

    def move(self, pid: int, cg: ContainerCgroup) -> None:
        """Move an existing process (one this test started) into ``cg``."""
        (cgroup_dir(cg) / "cgroup.procs").write_text(f"{pid}\n")

    @staticmethod
    def members(cg: ContainerCgroup) -> list[int]:
        """PIDs in ``cg``'s own ``cgroup.procs`` (not its descendants)."""
        try:
            text = (cgroup_dir(cg) / "cgroup.procs").read_text()
        except FileNotFoundError:
            return []
        return [int(line) for line in text.split()]

    @classmethod
    def is_member(cls, pid: int, cg: ContainerCgroup) -> bool:
        return pid in cls.members(cg)

    # -- teardown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process started here or living in these cgroups, then rmdir deepest first.

        Idempotent. Raises ``RuntimeError`` listing what could not be removed (after trying all).
        """
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            if proc.poll() is None:
                pidfd_kill(proc.pid)
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        problems: list[str] = []
        for d in sorted(self._created, key=lambda p: len(p.parts), reverse=True):
            if not d.exists():
                continue
            # Anything still inside was started by this tree (a forked descendant): kill it.
            deadline = time.monotonic() + 5.0
            while True:
                pids = _procs_of(d)
                if not pids:
                    break
                for pid in pids:
                    pidfd_kill(pid)
                if time.monotonic() > deadline:
                    problems.append(f"{d}: processes {pids} would not die")
                    break
                time.sleep(0.01)
            for attempt in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:  # EBUSY while the kernel finishes exits
                    if attempt == 99:
                        problems.append(f"{d}: {exc}")
                    time.sleep(0.02)
        if problems:
            raise RuntimeError("cgroup teardown incomplete:\n" + "\n".join(problems))

    def __enter__(self) -> CgroupTree:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def node_container(tree: CgroupTree, *, pod_uid: str, container_id: str) -> ContainerCgroup:
    """A containerd container's cgroup on the node the benchmarks model: cgroup v2, the systemd
    driver, a burstable pod. Must not vary per benchmark: their numbers compare one layout."""
    return tree.container(
        version=2,
        driver="systemd",
        qos="burstable",
        pod_uid=pod_uid,
        runtime="containerd",
        container_id=container_id,
    )


def _join_then_exec(cgroups: Sequence[ContainerCgroup], self_pid: str) -> list[str]:
    """The argv prefix of an ``sh`` that writes ``self_pid`` (``$$``, or ``0`` for "the writer"
    where ``$$`` would be a child namespace's number) into each cgroup's ``cgroup.procs``, one
    hierarchy each, exiting 97 if one write fails, and then ``exec``s the argv that follows: so
    the process and anything it forks start inside."""
    procs_files = [str(cgroup_dir(cg) / "cgroup.procs") for cg in cgroups]
    script = (
        f'n=$1; shift; while [ "$n" -gt 0 ]; do echo {self_pid} > "$1" || exit 97; shift; '
        'n=$((n-1)); done; exec "$@"'
    )
    return ["sh", "-c", script, "sh", str(len(procs_files)), *procs_files]


def _first_child(pid: int) -> int | None:
    """The first child of ``pid`` (``/proc/<pid>/task/<pid>/children``), if any yet."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(children[0]) if children else None


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().rstrip("\n")
    except (FileNotFoundError, ProcessLookupError):
        return None


def _procs_of(d: Path) -> list[int]:
    try:
        return [int(x) for x in (d / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []
