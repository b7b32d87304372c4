"""Parsing ``/proc/<pid>/cgroup`` text into a pod UID, a container ID and its cgroup.

Owns the rules that tie a cgroup path to a kubelet pod and a CRI container (the kubelet's
systemd and cgroupfs naming, cgroup v1 and v2: the layouts ``tests/test_cgroup_parser.py``
lists). Pure: standard library only; must not read files, log, or guess. It returns a reason
instead of a pod whenever the path is not unambiguously a kubelet pod's.

Security rule (docs/reliability.md P9): the pod is read only from the kubelet-owned levels, i.e.
the component right below the *outermost* ``kubepods`` root (and its optional QoS level), and its
name must be consistent with the level above it. Anything below the container's cgroup is the
container's own business (crun's ``container`` subgroup, nested runtimes, or a crafted cgroup
named like another pod) and never changes the attribution. A ``pod…`` name outside a kubepods
hierarchy is not a pod.

Paths relative to the reader's cgroup namespace (``/../../kubepods-besteffort.slice/…``, seen by
an unprivileged gpuguard on cgroup v2) are read as starting at a kubelet-owned level: that holds
because gpuguard itself runs in a kubelet pod, so every ancestor of its namespace root is a
kubepods, QoS or pod cgroup.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpuguard.core.model import ContainerCgroup, ContainerId, PodUid, Runtime

# Stable reason texts (``explain`` prints them; tests and docs quote them).
REASON_EMPTY = "empty cgroup file"
REASON_MALFORMED = "no parsable cgroup line"
REASON_NO_KUBEPODS = "no kubepods cgroup"
REASON_NO_POD = "kubepods cgroup but no pod cgroup"
REASON_NO_CONTAINER = "pod cgroup but no container"
REASON_CONMON = "crio-conmon monitor process, not a workload"
REASON_V1_DISAGREE = "cgroup v1 hierarchies name different pods or containers"
REASON_BAD_PATH = "cgroup path has '..' after a named component"
REASON_DELEGATED = "kubepods cgroup inside a systemd unit (a delegated subtree), not the kubelet's"

_HEX64 = r"[0-9a-f]{64}"
_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_UUID_SYSTEMD = r"[0-9a-f]{8}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{12}"
_HASH32 = r"[0-9a-f]{32}"

_CGROUPFS_POD = re.compile(rf"pod(?P<uid>{_UUID}|{_HASH32})")
_SYSTEMD_UID = re.compile(rf"(?P<uid>{_UUID_SYSTEMD}|{_HASH32})")
_QOS_LEVELS = ("burstable", "besteffort")

# Container leaves below the pod cgroup, most specific first (conmon before crio).
_CONMON = re.compile(r"crio-conmon-(?P<id>[0-9a-f]+)(?:\.scope)?")
_LEAVES: tuple[tuple[re.Pattern[str], Runtime | None], ...] = (
    (re.compile(rf"cri-containerd-(?P<id>{_HEX64})\.scope"), Runtime.CONTAINERD),
    (re.compile(rf"crio-(?P<id>{_HEX64})(?:\.scope)?"), Runtime.CRIO),
    (re.compile(rf"docker-(?P<id>{_HEX64})\.scope"), Runtime.DOCKER),
    # cgroupfs driver with containerd or Docker: the bare ID says nothing about the runtime.
    (re.compile(rf"(?P<id>{_HEX64})"), None),
)

_DELETED = " (deleted)"
"""Suffix the kernel appends to a v2 path whose cgroup was removed (kernel/cgroup/cgroup.c,
``proc_cgroup_show``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CgroupLine:
    """One line of ``/proc/<pid>/cgroup``: ``hierarchy-ID:controller-list:path``."""

    hierarchy_id: int
    controllers: str
    """v1: ``pids``, ``cpu,cpuacct``, ``name=systemd``; v2: ``""``."""
    path: str

    @property
    def version(self) -> int:
        return 2 if self.hierarchy_id == 0 and self.controllers == "" else 1


@dataclass(frozen=True, slots=True, kw_only=True)
class PathParse:
    """What one cgroup path says about pods and containers."""

    pod_uid: PodUid | None
    container_id: ContainerId | None = None
    runtime: Runtime | None = None
    container_path: str | None = None
    """The container's cgroup (its scope), without anything nested below it."""
    in_kubepods: bool = False
    """The path passes through a kubepods hierarchy (or is namespace-relative into one)."""
    reason: str | None = None
    """Why there is no pod, or (with a pod) why there is no container."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CgroupParse:
    """What a whole ``/proc/<pid>/cgroup`` file says: pod, container, cgroup, or why not."""

    lines: tuple[CgroupLine, ...]
    pod_uid: PodUid | None
    container_id: ContainerId | None
    runtime: Runtime | None
    cgroup_version: int | None
    """Version of the line the answer came from; for non-pod processes, 2 on a pure v2 host
    (only a ``0::`` line), else 1; ``None`` when no line parsed."""
    cgroup: ContainerCgroup | None
    """The container's cgroup when ``container_id`` is known."""
    reason: str | None
    """Why this is not a pod process; for a pod process without a container, why not."""

    @property
    def is_pod(self) -> bool:
        return self.pod_uid is not None


def kernel_lines(text: str) -> list[str]:
    """The lines of a kernel text file (``/proc/<pid>/cgroup``, ``status``), split on ``\n`` only.

    ``str.splitlines()`` also splits on ``\r``, ``\v``, ``\f``, ``\x1c``–``\x1e``, U+0085,
    U+2028 and U+2029, and the kernel forbids only ``/`` and ``\n`` in a cgroup name: a tenant
    (or a host process) could forge a whole ``8:pids:/kubepods/pod<uid>/<id>`` line inside one
    cgroup name and have its memory charged to another pod. Never use splitlines on
    kernel text.
    """
    return text.split("\n")


def parse_cgroup_lines(text: str) -> tuple[CgroupLine, ...]:
    """Every well-formed line; others are skipped. The path may itself contain ``:``."""
    out: list[CgroupLine] = []
    for raw in kernel_lines(text):
        parts = raw.split(":", 2)
        if len(parts) != 3 or not _is_ascii_number(parts[0]) or not parts[2].startswith("/"):
            continue
        out.append(CgroupLine(hierarchy_id=int(parts[0]), controllers=parts[1], path=parts[2]))
    return tuple(out)


def _is_ascii_number(text: str) -> bool:
    """``str.isdigit`` is true for ``١`` and ``²`` too; hierarchy IDs are ASCII."""
    return text.isascii() and text.isdigit()


def parse_cgroup_path(path: str) -> PathParse:
    """Pod and container named by one cgroup path (absolute or cgroupns-relative)."""
    path = path.removesuffix(_DELETED)
    comps = [c for c in path.split("/") if c not in ("", ".")]
    ups = 0
    while ups < len(comps) and comps[ups] == "..":
        ups += 1
    if ".." in comps[ups:]:
        return PathParse(pod_uid=None, reason=REASON_BAD_PATH)
    names = comps[ups:]
    found = _from_relative(names) if ups else _from_absolute(names)
    if found is None or found[0] == _DELEGATED:
        return _outside_kubepods(names, delegated=found is not None)
    pod_index, uid = found
    return _below_kubepods(comps[:ups], names, pod_index, uid)


def _outside_kubepods(names: list[str], *, delegated: bool) -> PathParse:
    """A path that is not below the kubelet's kubepods root: conmon, delegated or neither."""
    if names and _CONMON.fullmatch(names[-1]):
        return PathParse(pod_uid=None, reason=REASON_CONMON)
    return PathParse(pod_uid=None, reason=REASON_DELEGATED if delegated else REASON_NO_KUBEPODS)


def _below_kubepods(
    ups: list[str], names: list[str], pod_index: int, uid: PodUid | None
) -> PathParse:
    """A path below a kubepods root: its pod (at ``names[pod_index]``) and container leaf.
    ``ups`` are the leading ``..`` of a cgroupns-relative path, kept in the container's path."""
    if pod_index == _NO_POD or uid is None:
        return PathParse(pod_uid=None, in_kubepods=True, reason=REASON_NO_POD)
    if pod_index + 1 >= len(names):
        return PathParse(pod_uid=uid, in_kubepods=True, reason=REASON_NO_CONTAINER)
    leaf = names[pod_index + 1]
    if _CONMON.fullmatch(leaf):
        return PathParse(pod_uid=None, in_kubepods=True, reason=REASON_CONMON)
    for pattern, runtime in _LEAVES:
        m = pattern.fullmatch(leaf)
        if m:
            return PathParse(
                pod_uid=uid,
                container_id=ContainerId(m["id"]),
                runtime=runtime,
                container_path="/" + "/".join([*ups, *names[: pod_index + 2]]),
                in_kubepods=True,
            )
    return PathParse(pod_uid=uid, in_kubepods=True, reason=REASON_NO_CONTAINER)


def parse_cgroup(text: str) -> CgroupParse:
    """Attribute a ``/proc/<pid>/cgroup`` text.

    Prefers the ``0::`` line when it passes through a kubepods hierarchy; otherwise uses the
    v1 lines, which must all agree (hybrid hosts show v1 lines plus a ``0::`` line). The v1
    hierarchy reported is ``pids`` when it names the container, else ``name=systemd``, else the
    first such line.
    """
    lines = parse_cgroup_lines(text)
    if not text.strip():
        return _not_pod(lines, None, REASON_EMPTY)
    if not lines:
        return _not_pod(lines, None, REASON_MALFORMED)
    v2 = [ln for ln in lines if ln.version == 2]
    v1 = [ln for ln in lines if ln.version == 1]
    host_version = 1 if v1 else 2
    if v2:
        parsed = parse_cgroup_path(v2[0].path)
        if parsed.in_kubepods or not v1:
            return _from_line(lines, v2[0], parsed)
    candidates = [(ln, parse_cgroup_path(ln.path)) for ln in v1]
    kube = [(ln, p) for ln, p in candidates if p.in_kubepods]
    if not kube:
        reasons = {p.reason for _, p in candidates}
        reason = REASON_CONMON if REASON_CONMON in reasons else REASON_NO_KUBEPODS
        return _not_pod(lines, host_version, reason)
    answers = {(p.pod_uid, p.container_id, p.runtime, p.reason) for _, p in kube}
    if len(answers) > 1:
        return _not_pod(lines, 1, REASON_V1_DISAGREE)
    kube.sort(key=lambda lp: _v1_preference(lp[0].controllers))
    line, parsed = kube[0]
    return _from_line(lines, line, parsed)


# ---------------------------------------------------------------------------------------------
# Internals


def _v1_preference(controllers: str) -> int:
    listed = controllers.split(",")
    if "pids" in listed:
        return 0
    if "name=systemd" in listed:
        return 1
    return 2


def _not_pod(lines: tuple[CgroupLine, ...], version: int | None, reason: str) -> CgroupParse:
    return CgroupParse(
        lines=lines,
        pod_uid=None,
        container_id=None,
        runtime=None,
        cgroup_version=version,
        cgroup=None,
        reason=reason,
    )


def _from_line(lines: tuple[CgroupLine, ...], line: CgroupLine, parsed: PathParse) -> CgroupParse:
    cgroup = None
    if parsed.container_path is not None:
        cgroup = ContainerCgroup(
            version=line.version,
            hierarchy="" if line.version == 2 else line.controllers,
            path=parsed.container_path,
        )
    return CgroupParse(
        lines=lines,
        pod_uid=parsed.pod_uid,
        container_id=parsed.container_id,
        runtime=parsed.runtime,
        cgroup_version=line.version,
        cgroup=cgroup,
        reason=parsed.reason,
    )


_NO_POD = -1
_DELEGATED = -2


def _from_absolute(names: list[str]) -> tuple[int, PodUid | None] | None:
    """Find the outermost kubepods root; ``None`` if there is none.

    Returns ``(index of the pod component, uid)``; ``(_NO_POD, None)`` when the kubepods
    hierarchy is there but the next levels do not name a pod consistently; ``(_DELEGATED,
    None)`` when a systemd unit comes before any kubepods root.
    """
    for i, name in enumerate(names):
        if name == "kubepods":
            return _cgroupfs_pod(names, i + 1)
        if name.endswith(".slice"):
            base = name.removesuffix(".slice")
            if _is_kubepods_base(base) and _systemd_chain(names, i):
                return _systemd_pod(names, i + 1, base)
        if name.endswith((".scope", ".service")):
            # Below a unit, cgroups belong to whoever the unit delegates to (a user session,
            # a container): a "kubepods" there is not the kubelet's.
            later = names[i + 1 :]
            if any(n == "kubepods" or _is_kubepods_base(n.removesuffix(".slice")) for n in later):
                return _DELEGATED, None
            return None
    return None


def _from_relative(names: list[str]) -> tuple[int, PodUid | None] | None:
    """A cgroupns-relative path: its first name is a kubelet-owned level (see module doc)."""
    if not names:
        return None
    first = names[0]
    # The reader sits beside the kubepods root (not in a pod): the root itself is visible.
    if first == "kubepods":
        return _cgroupfs_pod(names, 1)
    if first.endswith(".slice") and _is_kubepods_base(first.removesuffix(".slice")):
        return _systemd_pod(names, 1, first.removesuffix(".slice"))
    if first in _QOS_LEVELS or _CGROUPFS_POD.fullmatch(first):
        return _cgroupfs_pod(names, 0)
    if first.endswith(".slice"):
        return _from_relative_slice(names, first.removesuffix(".slice"))
    return None


def _from_relative_slice(names: list[str], base: str) -> tuple[int, PodUid | None] | None:
    """``<…kubepods>-<qos>.slice`` or ``<…kubepods>[-<qos>]-pod<uid>.slice`` first: recover
    the kubepods base from the name."""
    kubepods = _kubepods_of_qos(base)
    if kubepods is not None:
        return _systemd_pod(names, 0, kubepods)
    head, sep, _ = base.rpartition("-pod")
    if not sep:
        return None
    kubepods = _kubepods_of_qos(head)
    if kubepods is not None:
        return _systemd_pod(names, 0, kubepods, at_pod_level=True)
    if _is_kubepods_base(head):
        return _systemd_pod(names, 0, head, at_pod_level=True)
    return None


def _kubepods_of_qos(base: str) -> str | None:
    """``<…kubepods>`` of a ``<…kubepods>-<qos>`` slice base; ``None`` if it is not one."""
    for qos in _QOS_LEVELS:
        suffix = "-" + qos
        if base.endswith(suffix) and _is_kubepods_base(base.removesuffix(suffix)):
            return base.removesuffix(suffix)
    return None


def _is_kubepods_base(base: str) -> bool:
    return base == "kubepods" or base.endswith("-kubepods")


def _systemd_chain(names: list[str], i: int) -> bool:
    """A systemd slice ``a-b-kubepods.slice`` must sit under ``a-b.slice`` under ``a.slice``
    (systemd expands slice names that way), so a look-alike elsewhere is not the kubepods root."""
    base = names[i].removesuffix(".slice")
    parts = base.split("-")
    if len(parts) - 1 > i:
        return False
    return all(
        names[i - k] == "-".join(parts[: len(parts) - k]) + ".slice" for k in range(1, len(parts))
    )


def _cgroupfs_pod(names: list[str], i: int) -> tuple[int, PodUid | None]:
    """``[burstable|besteffort/]pod<uid>`` starting at ``names[i]``."""
    if i < len(names) and names[i] in _QOS_LEVELS:
        i += 1
    if i < len(names):
        m = _CGROUPFS_POD.fullmatch(names[i])
        if m:
            return i, PodUid(m["uid"])
    return _NO_POD, None


def _systemd_pod(
    names: list[str], i: int, kubepods: str, *, at_pod_level: bool = False
) -> tuple[int, PodUid | None]:
    """``[<kubepods>-<qos>.slice/]<parent>-pod<uid_>.slice`` starting at ``names[i]``."""
    parent = kubepods
    if not at_pod_level and i < len(names):
        for qos in _QOS_LEVELS:
            if names[i] == f"{kubepods}-{qos}.slice":
                parent = f"{kubepods}-{qos}"
                i += 1
                break
    elif at_pod_level:
        for qos in _QOS_LEVELS:
            if names[i].startswith(f"{kubepods}-{qos}-pod"):
                parent = f"{kubepods}-{qos}"
                break
    if i < len(names):
        name = names[i]
        prefix = f"{parent}-pod"
        if name.startswith(prefix) and name.endswith(".slice"):
            m = _SYSTEMD_UID.fullmatch(name[len(prefix) : -len(".slice")])
            if m:
                return i, PodUid(m["uid"].replace("_", "-"))
    return _NO_POD, None
