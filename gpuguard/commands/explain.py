"""``gpuguard explain PID``: why a host PID is (not) attributed to a pod, and what was read.

Owns the ``explain`` JSON contract (docs/design.md, CLI outputs) and its human rendering. Reads
only ``<proc_root>/<pid>/stat``, ``cgroup`` and (for ``holds_gpu``) the names of ``fd/*`` links,
through ``ProcfsProcessResolver`` (built by ``gpuguard.app.build_pid_reads``). Must not signal or
change anything. ``explain()`` never contacts the API server or NVML itself: online facts (pod
namespace/name, limit and its source, GPU usage) come from an injected ``pod_lookup`` callable, and
``--offline`` never calls it. The
CLI's lookup, ``OnlineLookup``, is built from ``gpuguard.app``'s builders (the same pod directory
and NVML source ``enforce`` uses), read-only.

Exit codes: 0 whenever an answer was produced, including "not a pod process" and a PID that is
not in ``/proc`` (``is_pod: false``, ``reason: "not in /proc"``): an admin asking about a PID
NVML listed a moment ago wants that answer, not an error, and scripts read ``is_pod``/``reason``.
1 for invalid input (a ``--proc-root`` that is not a directory) or when the online lookup failed
(the ``/proc`` facts are still printed, with ``pod_lookup_error``). 2 for a usage error (a PID
outside 1..``PID_MAX_LIMIT``; the CLI's parser rejects it first) and, through the CLI, for an
invalid configuration: the config (``--config``, ``GPUGUARD_*``) is loaded and checked offline
too, and its ``node.proc_root`` is the default ``--proc-root``.

The human text, and every message on stderr, escapes every non-printable character of what it
shows (``core.text.printable``: ``\\x1b``, ``\\u202e``): cgroup names, and online the pod's,
container's and claims' names, are chosen by others and must not drive the admin's terminal. The
JSON is exact (``json.dumps`` escapes control characters).

Size: over 600 lines, on purpose: the JSON contract, its human rendering and the online lookup
that fills it are one answer; split, the fields and their rendering would drift apart.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from gpuguard.commands.dra_reads import wait_for_dra_reads
from gpuguard.commands.exit_codes import EXIT_INVALID, EXIT_OK, EXIT_USAGE
from gpuguard.core.allocation import UNKNOWN_ALLOCATIONS, Allocated, NodeAllocations
from gpuguard.core.assess import Assessment, Verdict, assess_all, charge
from gpuguard.core.cgroup import kernel_lines, parse_cgroup
from gpuguard.core.dra_shares import shares_on_device
from gpuguard.core.limits import (
    binding,
    effective_mode,
    exempt_label_text,
    is_exempt,
    resolve_limit,
)
from gpuguard.core.model import (
    Attribution,
    EnforcementPolicy,
    GpuDevice,
    GpuSample,
    Mode,
    Pod,
    PodSnapshot,
    ResolvedLimit,
)
from gpuguard.core.pids import PID_MAX_LIMIT
from gpuguard.core.text import printable
from gpuguard.core.units import format_bytes
from gpuguard.errors import GpuguardError, KubeError
from gpuguard.ports import NodeDirectory, ProcessResolver
from gpuguard.startup import Startup

if TYPE_CHECKING:
    from gpuguard.config import Settings


PodLookup = Callable[[Attribution], Mapping[str, Any] | None]
"""Online facts for a pod process: returns a mapping with any of ``ONLINE_KEYS`` (``None``:
the pod is not known on this node). May raise a ``GpuguardError`` (API server unreachable)."""

ONLINE_KEYS = (
    "pod_namespace",
    "pod_name",
    "container_name",
    "limit_bytes",
    "limit_source",
    "limit_declarations",
    "container_limits",
    "dra_shares",
    "gpu_used_bytes",
    "exempt",
    "verdict",
    "allocation",
)
"""Keys ``pod_lookup`` fills; present in the output (``None`` when unknown) only online.
``allocation``: per device NVML lists the PID on, whether what the kubelet allocated the pod
names it (``gpu``, ``gpu_instance_id``, ``allocation``, ``allocated``).
``limit_declarations``: every valid declaration seen on the device judged (``source``,
``what``, ``value``, ``limit_bytes``, ``pinned``, ``assigned``, ``bound``): each caps the limit,
the smallest binds, and ``limit_source`` names it (docs/design.md, Limit sources).
``container_limits``: each container's own limit on that device, where it declared one
(``container_limits_json``): a container over it is stopped alone where the rest of the pod
fits the pod's limit.
``dra_shares``: the DRA shares behind the ``dra`` declaration on that device (``dra_shares_json``;
empty when DRA allocated the pod nothing there)."""


def explain(
    pid: int,
    *,
    proc_root: Path = Path("/proc"),
    offline: bool = True,
    pod_lookup: PodLookup | None = None,
) -> dict[str, Any]:
    """The object (docs/design.md, CLI outputs) for ``pid``. Blocking (reads ``/proc``); never
    raises for a missing or unreadable PID.

    Contract keys: ``pid`` (int), ``is_pod`` (bool), ``pod_uid`` (str|None), ``container_id``
    (str|None, bare), ``runtime`` ("containerd"|"cri-o"|"docker"|None), ``cgroup_version``
    (1|2; for a PID not in ``/proc``, the host's as seen on PID 1, or None if unreadable),
    ``reason`` (why not a pod when ``is_pod`` is false; ``None`` for a pod process with a
    container; a note such as "pod cgroup but no container" otherwise).

    Extras: ``in_proc``, ``start_ticks``, ``cgroup_lines`` (list of str), ``cgroup`` (the
    container's cgroup path or None), ``cgroup_hierarchy`` ("" for v2, the v1 controller list),
    ``holds_gpu`` (a ``/dev/nvidia<N>`` file is open; None if unreadable).
    Online (``offline`` false and a ``pod_lookup`` given) also: ``pod_found`` and
    ``ONLINE_KEYS``; ``pod_lookup_error`` when the lookup raised.
    """
    from gpuguard.app import build_pid_reads

    resolver, read_cgroup = build_pid_reads(proc_root)
    attribution = resolver.attribute(pid)
    text = _read_text(read_cgroup, pid) if attribution.identity is not None else None
    parsed = parse_cgroup(text) if text is not None else None

    reason = attribution.reason
    if attribution.is_pod and parsed is not None and parsed.is_pod:
        reason = parsed.reason  # a pod process: only a note (e.g. no container), else None
    version = attribution.cgroup_version
    if version is None:
        version = _host_cgroup_version(read_cgroup)

    out: dict[str, Any] = {
        "pid": pid,
        "is_pod": attribution.is_pod,
        "pod_uid": attribution.pod_uid,
        "container_id": attribution.container_id,
        "runtime": None if attribution.runtime is None else str(attribution.runtime),
        "cgroup_version": version,
        "reason": reason,
        "in_proc": attribution.identity is not None,
        "start_ticks": None if attribution.identity is None else attribution.identity.start_ticks,
        # kernel_lines, not splitlines: a cgroup name may hold \r or U+2028, never \n.
        "cgroup_lines": [] if text is None else [ln for ln in kernel_lines(text) if ln],
        "cgroup": None if attribution.cgroup is None else attribution.cgroup.path,
        "cgroup_hierarchy": None if attribution.cgroup is None else attribution.cgroup.hierarchy,
        "holds_gpu": attribution.holds_gpu,
    }
    if offline or pod_lookup is None:
        return out
    return out | _online_facts(attribution, pod_lookup)


def _online_facts(attribution: Attribution, pod_lookup: PodLookup) -> dict[str, Any]:
    """``pod_found`` and ``ONLINE_KEYS`` (each ``None`` unless the lookup says otherwise), and
    ``pod_lookup_error`` when the lookup raised. A process that is not a pod's is not looked up."""
    out: dict[str, Any] = dict.fromkeys(ONLINE_KEYS)
    out["pod_found"] = None
    if not attribution.is_pod:
        return out
    try:
        facts = pod_lookup(attribution)
    except GpuguardError as exc:
        out["pod_lookup_error"] = str(exc)
        return out
    out["pod_found"] = facts is not None
    for key, value in (facts or {}).items():
        if key in ONLINE_KEYS:
            out[key] = value
    return out


def render_explain_human(d: Mapping[str, Any]) -> str:
    """Readable text of an ``explain`` object (ends with a newline). Every string shown has its
    non-printable characters escaped (``printable``)."""
    d = {key: _printable_value(value) for key, value in d.items()}
    lines = [f"PID {d['pid']}"]
    if not d.get("in_proc", True):
        lines.append(f"  not a pod process: {d['reason']}")
        return "\n".join(lines) + "\n"
    if d.get("start_ticks") is not None:
        lines[0] += f" (start time {d['start_ticks']} ticks after boot)"
    verdict = _render_attribution(d, lines)
    if d.get("holds_gpu") is not None:
        held = (
            "yes"
            if d["holds_gpu"]
            else "no (its listed memory is charged to it once NVML has kept listing it for "
            f"{EnforcementPolicy().owner_settle_seconds:g} s: docs/safety.md)"
        )
        lines.append(f"  holds a GPU:     {held}")
    if "pod_found" in d:
        verdict = _render_pod_lookup(d, lines) or verdict
    lines.append(f"  verdict:         {verdict}")
    return "\n".join(lines) + "\n"


def _render_attribution(d: Mapping[str, Any], lines: list[str]) -> str:
    """The ``/proc`` facts: cgroup lines, pod and container; returns the offline verdict."""
    lines.append("  /proc/<pid>/cgroup:")
    cgroup_lines = d.get("cgroup_lines") or ["(empty)"]
    lines.extend(f"    {ln}" for ln in cgroup_lines)
    lines.append(f"  cgroup version:  {d['cgroup_version']}")
    if not d["is_pod"]:
        return f"not a pod process: {d['reason']}"
    lines.append(f"  pod UID:         {d['pod_uid']}")
    container = d["container_id"] or "unknown"
    runtime = d["runtime"] or "runtime not named by the cgroup"
    lines.append(f"  container:       {container} ({runtime})")
    if d.get("cgroup"):
        hierarchy = d.get("cgroup_hierarchy") or "unified"
        lines.append(f"  container cgroup: {d['cgroup']} [{hierarchy}]")
    if d.get("reason"):
        lines.append(f"  note:            {d['reason']}")
    return "a pod process"


def _render_pod_lookup(d: Mapping[str, Any], lines: list[str]) -> str | None:
    """The online facts; returns the online verdict when there is one."""
    if d.get("pod_lookup_error"):
        lines.append(f"  pod lookup:      failed: {d['pod_lookup_error']}")
        return None
    if d["pod_found"] is False:
        lines.append("  pod lookup:      no such pod on this node (not enforced)")
        return None
    if not d["pod_found"]:
        return None
    lines.append(f"  pod:             {d.get('pod_namespace')}/{d.get('pod_name')}")
    if d.get("container_name"):
        lines.append(f"  container name:  {d['container_name']}")
    limit = d.get("limit_bytes")
    source = d.get("limit_source")
    lines.append("  limit:           " + ("none" if limit is None else f"{limit} bytes ({source})"))
    lines.extend(f"  declared:        {line}" for line in declaration_lines(d))
    lines.extend(
        f"  container limit: {line}"
        for line in container_limit_lines(d.get("container_limits") or ())
    )
    shares = dra_share_line(d.get("dra_shares") or ())
    if shares is not None:
        lines.append(f"  dra shares:      {shares}")
    if d.get("gpu_used_bytes") is not None:
        lines.append(f"  GPU memory used: {d['gpu_used_bytes']} bytes")
    lines.extend(f"  allocation:      {line}" for line in _allocation_lines(d))
    return str(d["verdict"]) if d.get("verdict") else None


def _allocation_lines(d: Mapping[str, Any]) -> list[str]:
    """Per device the pod uses: whether what the kubelet allocated it names the device."""
    lines = []
    for a in d.get("allocation") or ():
        where = f"GPU {a['gpu']}" + (
            f" MIG {a['gpu_instance_id']}" if a["gpu_instance_id"] is not None else ""
        )
        state = {
            str(Allocated.YES): "allocated",
            str(Allocated.NO): "NOT allocated: GPU use without an allocation",
        }.get(a["allocation"], "unknown")
        detail = f" ({a['allocated']})" if a["allocated"] else ""
        lines.append(f"{where}: {state}{detail}")
    return lines


def run_explain(
    args: argparse.Namespace,
    *,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    pod_lookup: PodLookup | None = None,
) -> int:
    """``gpuguard explain PID [--proc-root DIR] [--offline] [--json]``; returns the exit code.

    Uses ``args.pid``, ``args.proc_root``, ``args.offline`` and ``args.json``.
    """
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    pid = int(args.pid)
    proc_root = Path(args.proc_root or "/proc")
    if not 1 <= pid <= PID_MAX_LIMIT:
        print(f"gpuguard explain: invalid PID {pid}: must be 1 to {PID_MAX_LIMIT}", file=err)
        return EXIT_USAGE
    if not proc_root.is_dir():
        print(printable(f"gpuguard explain: --proc-root {proc_root} is not a directory"), file=err)
        return EXIT_INVALID
    result = explain(pid, proc_root=proc_root, offline=bool(args.offline), pod_lookup=pod_lookup)
    if getattr(args, "json", False):
        json.dump(result, out, indent=2)
        out.write("\n")
    else:
        out.write(render_explain_human(result))
    return EXIT_INVALID if result.get("pod_lookup_error") else EXIT_OK


def run_explain_from_args(args: argparse.Namespace) -> int:
    """``gpuguard explain`` as the CLI runs it. The settings (``--config``, ``GPUGUARD_*``,
    flags) are loaded and checked first, online or not: an invalid config raises
    ``ConfigError`` (the CLI's exit 2), and ``node.proc_root`` is the ``/proc`` read when
    ``--proc-root`` is not given. ``--offline`` then reads ``/proc`` only; otherwise the pod
    directory (API server, or ``--pods-file``) and NVML are built by ``gpuguard.app`` from the
    settings (and ``NODE_NAME``) and handed in as ``pod_lookup``.

    When the directory cannot be built or does not sync within ``kube.request_timeout_seconds``
    the ``/proc`` facts are still printed, with ``pod_lookup_error`` (exit 1). NVML failing is
    not an error: ``gpu_used_bytes`` is then ``null``.
    """
    from gpuguard.app import settings_from_args

    settings = settings_from_args(args)
    args = argparse.Namespace(**{**vars(args), "proc_root": str(settings.node.proc_root)})
    if args.offline:
        return run_explain(args)
    with Startup() as startup:
        return run_explain(args, pod_lookup=OnlineLookup.from_settings(settings, args, startup))


class OnlineLookup:
    """``PodLookup`` over a pod directory, the admin limit policy and one NVML sample."""

    def __init__(
        self,
        *,
        directory: NodeDirectory | None,
        problem: GpuguardError | None,
        policy: EnforcementPolicy,
        sample: GpuSample | None,
        resolver: ProcessResolver,
        dra_wait_seconds: float = 0.0,
        allocations: NodeAllocations = UNKNOWN_ALLOCATIONS,
    ) -> None:
        """``dra_wait_seconds``: how long a lookup waits for the DRA reads of the pod's claims
        (``dra_reads``) before it judges the pod. ``allocations``: the kubelet's pod resources
        (whether what the pod was allocated names each device it uses)."""
        self._directory = directory
        self._dra_wait_seconds = dra_wait_seconds
        self._problem = problem
        self._policy = policy
        self._sample = sample
        self._resolver = resolver
        self._allocations = allocations

    @classmethod
    def from_settings(
        cls, settings: Settings, args: argparse.Namespace, startup: Startup
    ) -> OnlineLookup:
        """Build the directory and read NVML once, as ``gpuguard enforce`` would (blocking);
        what it opens is closed by ``startup``."""
        from gpuguard import logs
        from gpuguard.app import (
            build_allocation_source_for,
            build_clock,
            build_gpu_source,
            build_pod_directory,
            build_resolver,
        )

        logs.configure(level="error", json=False)  # stdout is the answer; stderr stays quiet
        clock = build_clock()
        resolver = build_resolver(settings)
        directory: NodeDirectory | None = None
        problem: GpuguardError | None = None
        try:
            live = build_pod_directory(
                settings, pods_file=getattr(args, "pods_file", None), clock=clock
            )
            directory = live
            startup.opened("pod_directory", live.stop)
            timeout = settings.kube.request_timeout_seconds
            if not live.wait_synced(timeout):
                why = live.problem()
                problem = KubeError(
                    f"the pod list did not sync within {timeout:g}s"
                    + (f": {why}" if why is not None else "")
                )
        except GpuguardError as exc:
            problem = exc
        sample: GpuSample | None = None
        try:
            gpu = build_gpu_source(settings, clock)
        except GpuguardError:
            gpu = None
        if gpu is not None:
            startup.opened("gpu", gpu.close)
            with contextlib.suppress(GpuguardError):
                sample = gpu.sample()

        held = UNKNOWN_ALLOCATIONS
        source = build_allocation_source_for(settings, clock)
        if source is not None:
            startup.opened("pod_resources", source.close)
            held = source.read()
        return cls(
            directory=directory,
            problem=problem,
            policy=settings.enforcement_policy(),
            sample=sample,
            resolver=resolver,
            dra_wait_seconds=settings.kube.request_timeout_seconds,
            allocations=held,
        )

    def __call__(self, attribution: Attribution) -> Mapping[str, Any] | None:
        if self._problem is not None:
            raise self._problem
        if self._directory is None or attribution.pod_uid is None:
            return None
        wait_for_dra_reads(self._directory, (attribution.pod_uid,), self._dra_wait_seconds)
        snapshot = self._directory.snapshot()
        pod = snapshot.lookup(attribution.pod_uid)
        if pod is None:
            return None
        replicas = self._directory.node().replicas
        judged = self._assess(attribution, snapshot, replicas)
        worst = max(judged, key=_severity) if judged else None
        if worst is not None:
            limit = worst.limit
        else:  # not listed by NVML (or NVML unreadable): the limit without a device
            limit = resolve_limit(
                pod=pod, device_total_bytes=None, policy=self._policy.limits, replicas=replicas
            )
        exempt = (
            True
            if pod.uid == self._policy.self_pod_uid
            else is_exempt(pod.namespace, self._policy.limits, snapshot.labelled_namespaces)
        )
        return {
            "pod_namespace": pod.namespace,
            "pod_name": pod.name,
            "container_name": (
                None
                if attribution.container_id is None
                else pod.containers.get(attribution.container_id)
            ),
            "limit_bytes": limit.limit_bytes,
            "limit_source": None if limit.source is None else limit.source.value,
            "limit_declarations": declarations_json(limit),
            "container_limits": container_limits_json(limit),
            "dra_shares": dra_shares_json(limit, None if worst is None else worst.device),
            "gpu_used_bytes": self._own_usage(attribution.pid),
            "exempt": exempt,
            "verdict": self._verdict(pod, worst, limit.limit_bytes, exempt=exempt),
            "allocation": [
                {
                    "gpu": a.device.index,
                    "gpu_instance_id": a.device.gpu_instance_id,
                    "allocation": str(a.allocation.state),
                    "allocated": a.allocation.allocated or a.allocation.why or None,
                }
                for a in sorted(
                    judged, key=lambda a: (a.device.index, a.device.gpu_instance_id or -1)
                )
            ],
        }

    def _assess(
        self, attribution: Attribution, snapshot: PodSnapshot, replicas: int | None
    ) -> list[Assessment]:
        """``core.assess`` for the pod on every device NVML lists this PID on, exactly as
        ``enforce`` judges it (each device's own size for a percentage)."""
        if self._sample is None:
            return []
        sample = self._sample
        attributions = {p.pid: self._resolver.attribute(p.pid) for p in sample.processes}
        attributions[attribution.pid] = attribution
        charges = charge(sample, attributions, snapshot)
        devices = {d.key: d for d in sample.devices}
        held = self._allocations
        judged = assess_all(
            charges, snapshot, devices, self._policy, replicas,
            allocations=held, now=held.read_at or 0.0,
        )  # fmt: skip
        keys = {
            (attribution.pod_uid, p.device) for p in sample.processes if p.pid == attribution.pid
        }
        return [judged[k] for k in keys if k in judged]

    def _own_usage(self, pid: int) -> int | None:
        if self._sample is None:
            return None
        known = [p.used_bytes for p in self._sample.processes if p.pid == pid]
        return None if None in known else sum(p or 0 for p in known)

    def _exempt_verdict(self, pod: Pod, *, exempt: bool | None) -> str:
        if exempt:
            return f"exempt: pods of namespace {pod.namespace} are never acted on"
        label = exempt_label_text(self._policy.limits)
        return (
            f"exemption unknown: which namespaces carry the exempt label {label} is not known "
            "now; never acted on until it is"
        )

    def _verdict(
        self, pod: Pod, worst: Assessment | None, limit_bytes: int | None, *, exempt: bool | None
    ) -> str:
        if exempt is not False:
            return self._exempt_verdict(pod, exempt=exempt)
        if worst is None:
            if limit_bytes is None:
                return "no limit applies: reported, never acted on"
            return "limited; GPU usage unknown (NVML not readable here)"
        if worst.verdict is Verdict.UNLIMITED:
            return "no limit applies: reported, never acted on"
        if worst.verdict is Verdict.UNKNOWN:
            return "limited; the pod's GPU usage is unknown (N/A): never acted on"
        return self._usage_verdict(pod, worst)

    def _usage_verdict(self, pod: Pod, worst: Assessment) -> str:
        """Over or within the limit, with the bytes on the device that decided it."""
        used = f"{worst.used_bytes} bytes on one GPU ({format_bytes(worst.used_bytes)})"
        if worst.verdict is Verdict.OVER:
            mode = effective_mode(pod.namespace, self._policy.limits, self._policy.mode)
            action = "would be stopped" if mode is Mode.ENFORCE else "would be reported (audit)"
            return f"over its limit: the pod uses {used}; {action}"
        return f"within its limit: the pod uses at most {used}"


def declarations_json(limit: ResolvedLimit) -> list[dict[str, Any]]:
    """Each declaration ``core.limits`` weighed, and whether it is the one that bound: the
    ``limit_declarations`` of ``explain`` and ``inspect`` and the ``declarations`` of
    ``check-pod`` (docs/design.md#cli-outputs), one shape for all three. ``container``: the
    container a per-container declaration is about (``null``: the pod's)."""
    bound = binding(limit)
    return [
        {
            "source": d.source.value,
            "what": d.what,
            "value": d.value,
            "limit_bytes": d.limit_bytes,
            "pinned": list(d.pinned),
            "assigned": d.assigned,
            "bound": d is bound,
            "container": d.container,
        }
        for d in limit.declarations
    ]


def container_limits_json(limit: ResolvedLimit) -> list[dict[str, Any]]:
    """Each container's own limit on the device (``ResolvedLimit.containers``): ``container``,
    ``limit_bytes``, ``what`` (the declaration that binds it, or ``the pod's limit``) and
    ``value``: ``container_limits`` of ``check-pod``, ``explain`` and ``inspect``."""
    return [
        {"container": c.container, "limit_bytes": c.limit_bytes, "what": c.what, "value": c.value}
        for c in limit.containers
    ]


def container_limit_lines(limits: Sequence[Mapping[str, Any]]) -> list[str]:
    """``container_limits`` for people (names are the pod author's: escaped)."""
    return [
        printable(
            f"container {c['container']}: {c['value']} = {c['limit_bytes']} bytes ({c['what']})"
        )
        for c in limits
    ]


def declaration_lines(d: Mapping[str, Any]) -> list[str]:
    """``limit_declarations`` for people: each one, where it is pinned, and the one that bound."""
    lines = []
    for seen in d.get("limit_declarations") or ():
        size = "size unknown" if seen["limit_bytes"] is None else f"{seen['limit_bytes']} bytes"
        where = ""
        if seen["pinned"]:
            where = ", pinned to " + ", ".join(seen["pinned"])
            if not seen["assigned"]:
                where += " (not this GPU: it grants nothing here, it only caps)"
        bound = " <- binds" if seen["bound"] else ""
        # ``what`` names containers: chosen by the pod's author, escaped like every name here.
        lines.append(printable(f"{seen['what']} {seen['value']} = {size}{where}{bound}"))
    return lines


def dra_shares_json(limit: ResolvedLimit, device: GpuDevice | None) -> list[dict[str, Any]]:
    """The DRA shares behind ``limit`` on ``device`` (``None``: no device known,
    all of them), in ``core.dra_shares`` order: the claim and the allocation result each is,
    and its ``memory_bytes`` (``None``: the whole device). Empty when DRA allocated the pod
    nothing there. What ``explain`` and ``inspect`` show beside ``limit_declarations``."""
    return [
        {
            "claim": f"{share.claim_namespace}/{share.claim_name}",
            "request": share.request,
            "driver": share.driver,
            "pool": share.pool,
            "device": share.device,
            "share_id": share.share_id,
            "memory_bytes": share.memory_bytes,
        }
        for share in shares_on_device(limit, device)
    ]


def dra_share_line(shares: Sequence[Mapping[str, Any]]) -> str | None:
    """``dra_shares`` for people, ``None`` when empty: ``limit 4Gi from dra: claim team/gpu-abc
    request gpu on gpu.nvidia.com/node-1/gpu-0, share 4Gi`` (several shares: their sum, each
    named, ``;`` between them). Escaped: claim, request, pool and device names are others'."""
    if not shares:
        return None
    whole = any(share["memory_bytes"] is None for share in shares)
    total = "the whole GPU" if whole else format_bytes(sum(s["memory_bytes"] for s in shares))
    named = "; ".join(
        f"claim {share['claim']} request {share['request']} on "
        f"{share['driver']}/{share['pool']}/{share['device']}, share "
        + (
            "the whole GPU"
            if share["memory_bytes"] is None
            else format_bytes(share["memory_bytes"])
        )
        for share in shares
    )
    return printable(f"limit {total} from dra: {named}")


_SEVERITY = {Verdict.OVER: 4, Verdict.UNKNOWN: 3, Verdict.OK: 2, Verdict.UNLIMITED: 1}


def _severity(a: Assessment) -> tuple[int, int]:
    """The device explain reports: over beats unknown beats ok; then the most memory."""
    return (_SEVERITY.get(a.verdict, 0), a.used_bytes)


def _printable_value(value: Any) -> Any:
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, list | tuple):
        return [_printable_value(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _printable_value(v) for k, v in value.items()}
    return value


def _host_cgroup_version(read_cgroup: Callable[[int], str | None]) -> int | None:
    """The cgroup version PID 1 shows: 2 on a pure v2 host, 1 when v1 hierarchies exist."""
    text = _read_text(read_cgroup, 1)
    if text is None:
        return None
    return parse_cgroup(text).cgroup_version


def _read_text(read_cgroup: Callable[[int], str | None], pid: int) -> str | None:
    try:
        return read_cgroup(pid)
    except OSError:  # unreadable: the resolver already put the reason in the answer
        return None
