"""``gpuguard inspect``: a one-shot table (or ``--json``) of every GPU process on this node.

Owns the report: one row per NVML process with its pod, container, GPU (or MIG instance), used
memory, the pod's effective limit on that device and a verdict. Written against the ports (a
``GpuSource``, a ``ProcessResolver``, an optional ``PodDirectory``) and ``core.limits``, so the
same code runs over NVML + ``/proc`` + the API server in the enforcer container and over fakes in
tests. Must not signal, post Events or change anything: it only reads and reports, and it never
guesses (an unknown usage or limit is shown as unknown, not 0).

Verdicts (``VERDICTS``): ``ok``, ``over limit`` (the pod's summed usage on that device exceeds its
limit), ``unknown usage`` (NVML N/A or an untrusted value), ``not a pod``, ``ghost`` (the PID is
not in ``/proc``, or its current occupant does not hold the GPU open: a reused PID), ``pod
unknown`` (a pod UID the directory does not know, or no directory: ``--offline``), ``exempt``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table

from gpuguard.adapters.quantity import format_bytes
from gpuguard.core.limits import is_exempt, resolve_limit
from gpuguard.core.model import (
    Attribution,
    DeviceKey,
    GpuDevice,
    GpuProcess,
    LimitPolicy,
    Pod,
    PodSnapshot,
    ResolvedLimit,
)
from gpuguard.errors import GpuSourceError, GpuSourceUnavailable
from gpuguard.ports import GpuSource, NodeDirectory, ProcessResolver

OK = "ok"
OVER_LIMIT = "over limit"
UNKNOWN_USAGE = "unknown usage"
NOT_A_POD = "not a pod"
GHOST = "ghost"
POD_UNKNOWN = "pod unknown"
EXEMPT = "exempt"
VERDICTS = (OK, OVER_LIMIT, UNKNOWN_USAGE, NOT_A_POD, GHOST, POD_UNKNOWN, EXEMPT)

EXIT_OK = 0
EXIT_FAILED = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class _Row:
    proc: GpuProcess
    device: GpuDevice
    attribution: Attribution
    pod: Pod | None


def inspect_node(
    gpu_source: GpuSource,
    resolver: ProcessResolver,
    pod_lookup: NodeDirectory | None,
    policy: LimitPolicy,
) -> dict[str, Any]:
    """One NVML sample, attributed and judged. Blocking (NVML, ``/proc``).

    ``pod_lookup`` ``None`` (offline): pod processes are shown by UID with verdict
    ``pod unknown`` and no limit. Raises ``GpuSourceError`` / ``GpuSourceUnavailable`` when NVML
    cannot be read at all.

    Returns ``{"sample": {...}, "devices": [...], "skipped": [...], "processes": [...]}``; each
    process has ``pid``, ``namespace``, ``pod``, ``pod_uid``, ``container``, ``container_id``,
    ``gpu`` (index), ``uuid``, ``gpu_instance_id``, ``mig_uuid``, ``used_bytes``,
    ``pod_used_bytes`` (the pod's known total on that device), ``limit_bytes``,
    ``limit_source``, ``verdict`` and ``reason``.
    """
    sample = gpu_source.sample()
    snapshot: PodSnapshot | None = None
    replicas: int | None = None
    if pod_lookup is not None:
        snapshot = pod_lookup.snapshot()
        replicas = pod_lookup.node().replicas
    devices = {d.key: d for d in sample.devices}

    rows: list[_Row] = []
    for proc in sample.processes:
        device = devices.get(proc.device)
        if device is None:
            continue
        attribution = resolver.attribute(proc.pid)
        pod: Pod | None = None
        if attribution.pod_uid is not None and snapshot is not None and snapshot.synced:
            pod = snapshot.lookup(attribution.pod_uid)
        rows.append(_Row(proc=proc, device=device, attribution=attribution, pod=pod))

    # The limit is per pod per device: sum the pod's known usage there (DESIGN §3).
    pod_used: dict[tuple[str, DeviceKey], int] = {}
    for row in rows:
        if row.pod is not None and _live(row.attribution) and row.proc.used_bytes is not None:
            key = (str(row.pod.uid), row.device.key)
            pod_used[key] = pod_used.get(key, 0) + row.proc.used_bytes

    processes: list[dict[str, Any]] = []
    unattributed: dict[DeviceKey, int] = {}
    for row in sorted(rows, key=_order):
        limit: ResolvedLimit | None = None
        total_for_pod: int | None = None
        if row.pod is not None:
            limit = resolve_limit(
                pod=row.pod,
                device_total_bytes=row.device.total_bytes,
                policy=policy,
                replicas=replicas,
            )
            total_for_pod = pod_used.get((str(row.pod.uid), row.device.key))
        verdict, reason = _verdict(row, limit, total_for_pod, snapshot, policy)
        if verdict in (NOT_A_POD, GHOST) and row.proc.used_bytes is not None:
            unattributed[row.device.key] = unattributed.get(row.device.key, 0) + row.proc.used_bytes
        attribution = row.attribution
        processes.append(
            {
                "pid": row.proc.pid,
                "namespace": None if row.pod is None else row.pod.namespace,
                "pod": None if row.pod is None else row.pod.name,
                "pod_uid": attribution.pod_uid,
                "container": _container_name(row),
                "container_id": attribution.container_id,
                "gpu": row.device.index,
                "uuid": row.device.uuid,
                "gpu_instance_id": row.device.gpu_instance_id,
                "mig_uuid": row.device.mig_uuid,
                "used_bytes": row.proc.used_bytes,
                "pod_used_bytes": total_for_pod,
                "limit_bytes": None if limit is None else limit.limit_bytes,
                "limit_source": None
                if limit is None or limit.source is None
                else str(limit.source),
                "verdict": verdict,
                "reason": reason,
            }
        )

    used_by_device: dict[DeviceKey, int] = {}
    for proc in sample.processes:
        if proc.used_bytes is not None:
            used_by_device[proc.device] = used_by_device.get(proc.device, 0) + proc.used_bytes
    return {
        "sample": {"seq": sample.seq, "taken_at": sample.taken_at},
        "devices": [
            {
                "gpu": d.index,
                "uuid": d.uuid,
                "name": d.name,
                "gpu_instance_id": d.gpu_instance_id,
                "mig_uuid": d.mig_uuid,
                "total_bytes": d.total_bytes,
                "used_bytes": used_by_device.get(d.key, 0),
                "unattributed_bytes": unattributed.get(d.key, 0),
                "mps": d.mps,
            }
            for d in sample.devices
        ],
        "skipped": [{"gpu": s.index, "uuid": s.uuid, "reason": s.reason} for s in sample.skipped],
        "processes": processes,
    }


def render_inspect(report: Mapping[str, Any], out: TextIO, *, width: int | None = None) -> None:
    """The human table: one row per GPU process, then devices NVML could not read."""
    console = Console(file=out, width=width, highlight=False, soft_wrap=False)
    table = Table(title="GPU processes", title_justify="left")
    for header, justify in (
        ("PID", "right"),
        ("POD", "left"),
        ("CONTAINER", "left"),
        ("GPU", "left"),
        ("USED", "right"),
        ("POD TOTAL", "right"),
        ("LIMIT", "right"),
        ("VERDICT", "left"),
    ):
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    for p in report["processes"]:
        pod = "-" if p["pod"] is None else f"{p['namespace']}/{p['pod']}"
        if p["pod"] is None and p["pod_uid"] is not None:
            pod = f"uid {p['pod_uid']}"
        verdict = p["verdict"] if not p["reason"] else f"{p['verdict']} ({p['reason']})"
        style = {OVER_LIMIT: "bold red", UNKNOWN_USAGE: "yellow", GHOST: "yellow"}.get(
            p["verdict"], ""
        )
        table.add_row(
            str(p["pid"]),
            pod,
            p["container"] or "-",
            _device_label(p["gpu"], p["gpu_instance_id"]),
            _bytes(p["used_bytes"]),
            _bytes(p["pod_used_bytes"]) if p["pod"] is not None else "-",
            _limit_cell(p),
            verdict,
            style=style,
        )
    if report["processes"]:
        console.print(table)
    else:
        console.print("no GPU processes")
    for d in report["devices"]:
        extra = " (MPS: not enforced)" if d["mps"] else ""
        console.print(
            f"GPU {_device_label(d['gpu'], d['gpu_instance_id'])} {d['name']}: "
            f"{format_bytes(d['used_bytes'])} used by processes of {format_bytes(d['total_bytes'])}"
            f", {format_bytes(d['unattributed_bytes'])} unattributed{extra}"
        )
    for s in report["skipped"]:
        gpu = "-" if s["gpu"] is None else s["gpu"]
        console.print(f"GPU {gpu} not read: {s['reason']}", style="yellow")


def run_inspect(
    *,
    gpu_source: GpuSource,
    resolver: ProcessResolver,
    pod_lookup: NodeDirectory | None,
    policy: LimitPolicy,
    as_json: bool,
    stdout: TextIO,
    stderr: TextIO,
) -> int:
    """The CLI entry: inspect, print JSON or the table; exit 1 when NVML cannot be read."""
    try:
        report = inspect_node(gpu_source, resolver, pod_lookup, policy)
    except (GpuSourceError, GpuSourceUnavailable) as error:
        print(f"gpuguard inspect: cannot read NVML: {error}", file=stderr)
        return EXIT_FAILED
    if as_json:
        json.dump(report, stdout, indent=2)
        stdout.write("\n")
    else:
        render_inspect(report, stdout)
    return EXIT_OK


# ---------------------------------------------------------------------------------------------


def _live(attribution: Attribution) -> bool:
    return attribution.identity is not None and attribution.holds_gpu is not False


def _verdict(
    row: _Row,
    limit: ResolvedLimit | None,
    pod_total: int | None,
    snapshot: PodSnapshot | None,
    policy: LimitPolicy,
) -> tuple[str, str]:
    attribution = row.attribution
    if attribution.identity is None:
        return GHOST, "pid not in /proc"
    if attribution.holds_gpu is False:
        return GHOST, "pid reused: its process does not hold the GPU open"
    if attribution.pod_uid is None:
        return NOT_A_POD, attribution.reason or ""
    if row.pod is None:
        if snapshot is None:
            return POD_UNKNOWN, "offline: no pod directory"
        if not snapshot.synced:
            return POD_UNKNOWN, "pod directory not synced"
        return POD_UNKNOWN, "pod uid not found on this node"
    if is_exempt(row.pod.namespace, policy):
        return EXEMPT, f"namespace {row.pod.namespace} is exempt"
    if row.proc.used_bytes is None:
        return UNKNOWN_USAGE, "NVML reports N/A"
    limit_bytes = None if limit is None else limit.limit_bytes
    note = "MPS: not enforced" if row.device.mps else ""
    if limit_bytes is not None and pod_total is not None and pod_total > limit_bytes:
        return OVER_LIMIT, note
    return OK, note if limit_bytes is not None else (note or "no limit")


def _container_name(row: _Row) -> str | None:
    cid = row.attribution.container_id
    if cid is None or row.pod is None:
        return None
    return row.pod.containers.get(cid)


def _order(row: _Row) -> tuple[int, int, int]:
    gi = row.device.gpu_instance_id
    return (row.device.index, -1 if gi is None else gi, row.proc.pid)


def _device_label(index: int | None, gpu_instance_id: int | None) -> str:
    label = "-" if index is None else str(index)
    return label if gpu_instance_id is None else f"{label} gi{gpu_instance_id}"


def _limit_cell(p: Mapping[str, Any]) -> str:
    if p["pod"] is None:
        return "-"
    return "none" if p["limit_bytes"] is None else format_bytes(p["limit_bytes"])


def _bytes(value: int | None) -> str:
    return "n/a" if value is None else format_bytes(value)


def run_inspect_from_args(args: argparse.Namespace) -> int:
    """``gpuguard inspect``: one gather with the enforcer's own adapters; returns the exit code."""
    import sys

    from gpuguard import logs
    from gpuguard.app import (
        build_gpu_source,
        build_pod_directory,
        build_resolver,
        settings_from_args,
    )
    from gpuguard.runtime.clock import SystemClock

    settings = settings_from_args(args)
    logs.configure(level="warning", json=False)
    clock = SystemClock()
    directory: NodeDirectory | None = None
    stop: Callable[[], None] = _nothing
    if not args.offline:
        directory, _events, stop, _problem = build_pod_directory(
            settings, pods_file=args.pods_file, clock=clock
        )
        wait = getattr(directory, "wait_synced", None)
        if wait is not None and not wait(settings.kube.request_timeout_seconds):
            print(
                "gpuguard inspect: the pod list did not sync in time; showing pod UIDs only",
                file=sys.stderr,
            )
    gpu = build_gpu_source(settings, clock)
    try:
        return run_inspect(
            gpu_source=gpu,
            resolver=build_resolver(settings),
            pod_lookup=directory,
            policy=settings.limit_policy(),
            as_json=args.json,
            stdout=sys.stdout,
            stderr=sys.stderr,
        )
    finally:
        gpu.close()
        stop()


def _nothing() -> None:
    return None
