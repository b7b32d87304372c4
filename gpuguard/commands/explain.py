"""``gpuguard explain PID``: why a host PID is (not) attributed to a pod, and what was read.

Owns the DESIGN §5.2 ``explain`` JSON contract and its human rendering. Reads only
``<proc_root>/<pid>/stat``, ``cgroup`` and (for ``holds_gpu``) the names of ``fd/*`` links,
through ``ProcfsProcessResolver``. Must not signal, change anything, or contact the API server
itself: online facts (pod namespace/name, limit and its source, GPU usage) come from an injected
``pod_lookup`` callable, and ``--offline`` never calls it.

Exit codes: 0 whenever an answer was produced, including "not a pod process" and a PID that is
not in ``/proc`` (``is_pod: false``, ``reason: "not in /proc"``): an admin asking about a PID
NVML listed a moment ago wants that answer, not an error, and scripts read ``is_pod``/``reason``.
1 for invalid input (PID ≤ 0, a ``--proc-root`` that is not a directory) or when the online
lookup failed (the ``/proc`` facts are still printed, with ``pod_lookup_error``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

from gpuguard.adapters.procfs import ProcfsProcessResolver, read_cgroup_text
from gpuguard.core.cgroup import parse_cgroup
from gpuguard.core.model import Attribution
from gpuguard.errors import GpuguardError

EXIT_OK = 0
EXIT_INVALID = 1

PodLookup = Callable[[Attribution], Mapping[str, Any] | None]
"""Online facts for a pod process: returns a mapping with any of ``ONLINE_KEYS`` (``None``:
the pod is not known on this node). May raise a ``GpuguardError`` (API server unreachable)."""

ONLINE_KEYS = (
    "pod_namespace",
    "pod_name",
    "container_name",
    "limit_bytes",
    "limit_source",
    "gpu_used_bytes",
    "exempt",
    "verdict",
)
"""Keys ``pod_lookup`` fills; present in the output (``None`` when unknown) only online."""


def explain(
    pid: int,
    *,
    proc_root: Path = Path("/proc"),
    offline: bool = True,
    pod_lookup: PodLookup | None = None,
) -> dict[str, Any]:
    """The DESIGN §5.2 object for ``pid``. Blocking (reads ``/proc``); never raises for a
    missing or unreadable PID.

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
    resolver = ProcfsProcessResolver(proc_root, cache_size=1, check_gpu_fds=True)
    attribution = resolver.attribute(pid)
    text = _read_text(proc_root, pid) if attribution.identity is not None else None
    parsed = parse_cgroup(text) if text is not None else None

    reason = attribution.reason
    if attribution.is_pod and parsed is not None and parsed.is_pod:
        reason = parsed.reason  # a pod process: only a note (e.g. no container), else None
    version = attribution.cgroup_version
    if version is None:
        version = _host_cgroup_version(proc_root)

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
        "cgroup_lines": [] if text is None else [ln for ln in text.splitlines() if ln],
        "cgroup": None if attribution.cgroup is None else attribution.cgroup.path,
        "cgroup_hierarchy": None if attribution.cgroup is None else attribution.cgroup.hierarchy,
        "holds_gpu": attribution.holds_gpu,
    }
    if offline or pod_lookup is None:
        return out
    for key in ONLINE_KEYS:
        out[key] = None
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
    """Readable text of an ``explain`` object (ends with a newline)."""
    lines = [f"PID {d['pid']}"]
    if not d.get("in_proc", True):
        lines.append(f"  not a pod process: {d['reason']}")
        return "\n".join(lines) + "\n"
    if d.get("start_ticks") is not None:
        lines[0] += f" (start time {d['start_ticks']} ticks after boot)"
    lines.append("  /proc/<pid>/cgroup:")
    cgroup_lines = d.get("cgroup_lines") or ["(empty)"]
    lines.extend(f"    {ln}" for ln in cgroup_lines)
    lines.append(f"  cgroup version:  {d['cgroup_version']}")
    if d["is_pod"]:
        lines.append(f"  pod UID:         {d['pod_uid']}")
        container = d["container_id"] or "unknown"
        runtime = d["runtime"] or "runtime not named by the cgroup"
        lines.append(f"  container:       {container} ({runtime})")
        if d.get("cgroup"):
            hierarchy = d.get("cgroup_hierarchy") or "unified"
            lines.append(f"  container cgroup: {d['cgroup']} [{hierarchy}]")
        if d.get("reason"):
            lines.append(f"  note:            {d['reason']}")
        verdict = "a pod process"
    else:
        verdict = f"not a pod process: {d['reason']}"
    if d.get("holds_gpu") is not None:
        lines.append(f"  holds a GPU:     {'yes' if d['holds_gpu'] else 'no'}")
    if "pod_found" in d:
        if d.get("pod_lookup_error"):
            lines.append(f"  pod lookup:      failed: {d['pod_lookup_error']}")
        elif d["pod_found"] is False:
            lines.append("  pod lookup:      no such pod on this node (not enforced)")
        elif d["pod_found"]:
            lines.append(f"  pod:             {d.get('pod_namespace')}/{d.get('pod_name')}")
            if d.get("container_name"):
                lines.append(f"  container name:  {d['container_name']}")
            limit = d.get("limit_bytes")
            source = d.get("limit_source")
            lines.append(
                "  limit:           " + ("none" if limit is None else f"{limit} bytes ({source})")
            )
            if d.get("gpu_used_bytes") is not None:
                lines.append(f"  GPU memory used: {d['gpu_used_bytes']} bytes")
            if d.get("verdict"):
                verdict = str(d["verdict"])
    lines.append(f"  verdict:         {verdict}")
    return "\n".join(lines) + "\n"


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
    if pid <= 0:
        print(f"gpuguard explain: invalid PID {pid}: must be a positive host PID", file=err)
        return EXIT_INVALID
    if not proc_root.is_dir():
        print(f"gpuguard explain: --proc-root {proc_root} is not a directory", file=err)
        return EXIT_INVALID
    result = explain(pid, proc_root=proc_root, offline=bool(args.offline), pod_lookup=pod_lookup)
    if getattr(args, "json", False):
        json.dump(result, out, indent=2)
        out.write("\n")
    else:
        out.write(render_explain_human(result))
    return EXIT_INVALID if result.get("pod_lookup_error") else EXIT_OK


def _host_cgroup_version(proc_root: Path) -> int | None:
    """The cgroup version PID 1 shows: 2 on a pure v2 host, 1 when v1 hierarchies exist."""
    text = _read_text(proc_root, 1)
    if text is None:
        return None
    return parse_cgroup(text).cgroup_version


def _read_text(proc_root: Path, pid: int) -> str | None:
    try:
        return read_cgroup_text(proc_root, pid)
    except OSError:  # unreadable: the resolver already put the reason in the answer
        return None
