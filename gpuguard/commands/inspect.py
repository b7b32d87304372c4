"""``gpuguard inspect``: a one-shot table (or ``--json``) of every GPU process on this node.

Owns the report: one row per NVML process with its pod, container, GPU (or MIG instance), used
memory, the pod's effective limit on that device (with ``limit_declarations``: every declaration
weighed there, each a cap, and the one that bound), what bounds it (``bound_by``: the words of
``gpuguard_gpu_memory_bound_bytes``) and a verdict. Written against the ports (a
``FastGpuSource``, a ``ProcessResolver``, an optional ``PodDirectory``) and ``core.limits``, so the
same code runs over NVML + ``/proc`` + the API server in the enforcer container and over fakes in
tests. Must not signal, post Events or change anything: it only reads and reports, and it never
guesses (an unknown usage or limit is shown as unknown, not 0). Each process's name comes from an
injected ``ProcessNames`` (``procfs.read_process_name`` in the CLI): a name is chosen by the process
itself, so the table escapes it, as it escapes every cell and line (``core.text.printable``): pod,
namespace and container names are their authors', a device's name and an NVML error the driver's.
The console reads no markup or emoji codes in them (``[red]``, ``:x:``). The JSON is exact.

Verdicts: ``ok``, ``over limit`` (the pod's summed usage on that device exceeds its
limit), ``unknown usage`` (NVML N/A or an untrusted value), ``not a pod``, ``ghost`` (the PID is
not in ``/proc``, or its current occupant does not hold the GPU open: a reused PID), ``pod
unknown`` (a pod UID the directory does not know, or no directory: ``--offline``), ``exempt``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpuguard.commands.dra_reads import wait_for_dra_reads
from gpuguard.commands.exit_codes import EXIT_FAILED, EXIT_OK
from gpuguard.commands.explain import (
    container_limits_json,
    declarations_json,
    dra_share_line,
    dra_shares_json,
)
from gpuguard.core.allocation import UNKNOWN_ALLOCATIONS, Allocated
from gpuguard.core.assess import Assessment, Charges, Verdict, assess_all, charge
from gpuguard.core.limits import bound_by
from gpuguard.core.model import (
    Attribution,
    BoundBy,
    DeviceKey,
    DeviceMemory,
    EnforcementPolicy,
    GpuDevice,
    GpuProcess,
    GpuSample,
    Pod,
    PodSnapshot,
    PodUid,
    ProcessIdentity,
    RefusalReason,
)
from gpuguard.core.policy import memory_pressed
from gpuguard.core.text import printable
from gpuguard.core.units import format_bytes
from gpuguard.errors import GpuSourceError, GpuSourceUnavailable
from gpuguard.ports import AllocationSource, FastGpuSource, NodeDirectory, ProcessResolver
from gpuguard.startup import Startup

OK = "ok"
OVER_LIMIT = "over limit"
UNKNOWN_USAGE = "unknown usage"
NOT_A_POD = "not a pod"
GHOST = "ghost"
POD_UNKNOWN = "pod unknown"
EXEMPT = "exempt"


ProcessNames = Callable[[ProcessIdentity], str | None]
"""The name of a process, if its PID still belongs to that identity (``None``: gone, reused or
unreadable). Display only."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Row:
    proc: GpuProcess
    device: GpuDevice
    attribution: Attribution
    pod: Pod | None
    assessment: Assessment | None
    """The verdict of the pod's memory on this device, when the process is charged to a pod."""
    uncharged: RefusalReason | None
    """Why the process's memory is charged to no pod (ghost, reused PID, host, unknown pod)."""


_EMPTY = PodSnapshot(synced=False, last_contact_at=None, pods={})


def inspect_node(
    gpu_source: FastGpuSource,
    resolver: ProcessResolver,
    pod_lookup: NodeDirectory | None,
    policy: EnforcementPolicy,
    process_names: ProcessNames | None = None,
    *,
    dra_wait_seconds: float = 0.0,
    allocations: AllocationSource | None = None,
) -> dict[str, Any]:
    """One NVML sample, attributed and judged by the same ``core.assess`` as ``enforce``.
    Blocking (NVML, ``/proc``). The pods of the processes listed are judged once the DRA reads
    of their claims answered, or after ``dra_wait_seconds`` (``dra_reads``).

    ``pod_lookup`` ``None`` (offline): pod processes are shown by UID with verdict
    ``pod unknown`` and no limit. Raises ``GpuSourceError`` / ``GpuSourceUnavailable`` when NVML
    cannot be read at all. ``process_names`` ``None``: every ``name`` is ``null``.

    Returns ``{"sample": {...}, "devices": [...], "skipped": [...], "processes": [...]}``; each
    process has ``pid``, ``name`` (``null`` when unknown), ``namespace``, ``pod``, ``pod_uid``,
    ``container``, ``container_id``, ``gpu`` (index), ``uuid``, ``gpu_instance_id``,
    ``mig_uuid``, ``used_bytes``, ``pod_used_bytes`` (the pod's known total on that device),
    ``limit_bytes``, ``limit_source``, ``limit_declarations``, ``container_limits`` (each
    container's own limit on that device, ``explain``'s), ``dra_shares`` (the claims and
    allocation results behind the ``dra`` declaration on that device, ``explain``'s
    ``dra_shares_json``), ``verdict``, ``reason`` and ``bound_by`` (``core.model.BoundBy``:
    what bounds the pod's memory there, ``unattributed`` for a process charged to no pod),
    ``allocation`` (``allocated``, ``not_allocated`` or ``unknown``: whether what the kubelet
    allocated the pod names the device; ``unknown`` without ``allocations``, the kubelet's
    pod-resources reader) and ``allocated`` (what the pod was allocated, or why unknown).
    """
    sample = gpu_source.sample()
    memory = gpu_source.read_memory()
    attributions = {p.pid: resolver.attribute(p.pid) for p in sample.processes}
    if pod_lookup is not None:
        uids = {a.pod_uid for a in attributions.values() if a.pod_uid is not None}
        wait_for_dra_reads(pod_lookup, uids, dra_wait_seconds)
    snapshot = _EMPTY if pod_lookup is None else pod_lookup.snapshot()
    replicas = None if pod_lookup is None else pod_lookup.node().replicas
    devices = {d.key: d for d in sample.devices}
    charges = charge(sample, attributions, snapshot)
    held = UNKNOWN_ALLOCATIONS if allocations is None else allocations.read()
    assessments = assess_all(
        charges, snapshot, devices, policy, replicas, allocations=held, now=held.read_at or 0.0
    )
    rows = _rows(
        sample, attributions, charges, devices=devices, assessments=assessments, snapshot=snapshot
    )
    online = pod_lookup is not None
    processes = [
        _process_json(row, _verdict(row, online, snapshot), process_names)
        for row in sorted(rows, key=_order)
    ]
    unattributed = charges.unattributed_bytes
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
                "mps_declared": policy.mps_declared(d.uuid),
                **_memory_fields(sample, d.key, memory.get(d.key), policy),
            }
            for d in sample.devices
        ],
        "skipped": [{"gpu": s.index, "uuid": s.uuid, "reason": s.reason} for s in sample.skipped],
        "processes": processes,
    }


def _rows(
    sample: GpuSample,
    attributions: Mapping[int, Attribution],
    charges: Charges,
    *,
    devices: Mapping[DeviceKey, GpuDevice],
    assessments: Mapping[tuple[PodUid, DeviceKey], Assessment],
    snapshot: PodSnapshot,
) -> list[_Row]:
    """A row per process on a device the sample has: its pod (when the directory is synced) and,
    when charged to that pod, the pod's assessment on the device; else why it is not."""
    uncharged = {(u.proc.pid, u.proc.device): u.reason for u in charges.uncharged}
    rows: list[_Row] = []
    for proc in sample.processes:
        device = devices.get(proc.device)
        if device is None:
            continue
        attribution = attributions[proc.pid]
        pod_uid = attribution.pod_uid
        pod = None if pod_uid is None else snapshot.lookup(pod_uid)
        why = uncharged.get((proc.pid, proc.device))
        charged = why is None and pod_uid is not None
        assessment = assessments[(pod_uid, device.key)] if charged and pod_uid else None
        rows.append(
            _Row(
                proc=proc,
                device=device,
                attribution=attribution,
                pod=pod if snapshot.synced else None,
                assessment=assessment,
                uncharged=why,
            )
        )
    return rows


def _process_json(
    row: _Row, verdict_and_reason: tuple[str, str], process_names: ProcessNames | None
) -> dict[str, Any]:
    """One process of ``inspect --json`` (docs/design.md#cli-outputs)."""
    verdict, reason = verdict_and_reason
    attribution = row.attribution
    a = row.assessment
    return {
        "pid": row.proc.pid,
        "name": _name(attribution.identity, process_names),
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
        "pod_used_bytes": None if a is None else a.used_bytes,
        "limit_bytes": None if a is None else a.limit.limit_bytes,
        "limit_source": None if a is None or a.limit.source is None else str(a.limit.source),
        "limit_declarations": [] if a is None else declarations_json(a.limit),
        "container_limits": [] if a is None else container_limits_json(a.limit),
        "dra_shares": [] if a is None else dra_shares_json(a.limit, row.device),
        "verdict": verdict,
        "reason": reason,
        "bound_by": str(
            BoundBy.UNATTRIBUTED
            if a is None
            else bound_by(a.limit, exempt=a.verdict is Verdict.EXEMPT)
        ),
        "allocation": None if a is None else str(a.allocation.state),
        "allocated": None if a is None else (a.allocation.allocated or a.allocation.why or None),
    }


def _memory_fields(
    sample: GpuSample, key: DeviceKey, read: DeviceMemory | None, policy: EnforcementPolicy
) -> dict[str, Any]:
    """The device's own memory read (NVML's used and free, whoever holds it), whether it is
    under pressure (``enforce`` would skip the grace period there), and how old the listing
    the rows come from is (``inspect`` lists now: the enforcer's listing age is the metric
    ``gpuguard_gpu_last_listing_timestamp_seconds``)."""
    return {
        "memory_used_bytes": None if read is None else read.used_bytes,
        "free_bytes": None if read is None else read.free_bytes,
        "under_pressure": read is not None and memory_pressed(read, policy.pressure_free_fraction),
        "listing_age_seconds": round(max(0.0, sample.taken_at - sample.listing(key).taken_at), 3),
    }


def render_inspect(report: Mapping[str, Any], out: TextIO, *, width: int | None = None) -> None:
    """The human table: one row per GPU process, then devices NVML could not read. Every cell
    and line is escaped (``printable``) and shown as plain text: no markup, no emoji codes."""
    console = Console(
        file=out, width=width, highlight=False, soft_wrap=False, markup=False, emoji=False
    )
    table = Table(title="GPU processes", title_justify="left")
    for header, justify in (
        ("PID", "right"),
        ("NAME", "left"),
        ("POD", "left"),
        ("CONTAINER", "left"),
        ("GPU", "left"),
        ("USED", "right"),
        ("POD TOTAL", "right"),
        ("LIMIT", "right"),
        ("BOUND BY", "left"),
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
        cells = (
            str(p["pid"]),
            "-" if p["name"] is None else p["name"],
            pod,
            p["container"] or "-",
            _device_label(p["gpu"], p["gpu_instance_id"]),
            _bytes(p["used_bytes"]),
            _bytes(p["pod_used_bytes"]) if p["pod"] is not None else "-",
            _limit_cell(p),
            p["bound_by"],
            verdict,
        )
        table.add_row(*(Text(printable(cell)) for cell in cells), style=style)
    if report["processes"]:
        console.print(table)
    else:
        console.print("no GPU processes")
    for line in _dra_share_lines(report["processes"]):
        console.print(Text(line))
    for line in _unallocated_lines(report["processes"]):
        console.print(Text(printable(line), style="yellow"))
    for line in _container_limit_lines(report["processes"]):
        console.print(Text(printable(line)))
    for d in report["devices"]:
        console.print(Text(printable(_device_line(d))))
    for s in report["skipped"]:
        gpu = "-" if s["gpu"] is None else s["gpu"]
        console.print(Text(printable(f"GPU {gpu} not read: {s['reason']}"), style="yellow"))


def _unallocated_lines(processes: list[Mapping[str, Any]]) -> list[str]:
    """One line per pod and device whose memory none of the pod's allocations names."""
    seen: dict[tuple[str, str, int, int | None], str] = {}
    for p in processes:
        if p.get("allocation") == str(Allocated.NO):
            key = (p["namespace"], p["pod"], p["gpu"], p["gpu_instance_id"])
            seen.setdefault(key, p["allocated"] or "")
    return [
        f"{ns}/{pod} uses GPU {_device_label(gpu, gi)} without an allocation (allocated: {what})"
        for (ns, pod, gpu, gi), what in seen.items()
    ]


def _container_limit_lines(processes: Sequence[Mapping[str, Any]]) -> list[str]:
    """Once per pod, device and container with its own limit there (``container_limits``):
    ``<ns>/<pod> container <c> on GPU <i>: own limit <value> (<declaration>)``."""
    seen: dict[tuple[Any, ...], str] = {}
    for p in processes:
        for c in p.get("container_limits") or ():
            key = (p["namespace"], p["pod"], p["gpu"], p["gpu_instance_id"], c["container"])
            seen.setdefault(key, f"own limit {c['value']} ({c['what']})")
    return [
        f"{ns}/{pod} container {name} on GPU {_device_label(gpu, gi)}: {what}"
        for (ns, pod, gpu, gi, name), what in seen.items()
    ]


def _device_line(d: Mapping[str, Any]) -> str:
    """One device of the human output: its memory, whose, and what MPS and pressure mean there."""
    extra = ""
    if d["mps"]:
        extra = (
            " (MPS, declared: pods with an MPS client are not signalled)"
            if d["mps_declared"]
            else " (MPS clients listed, MPS not declared: enforced like any process)"
        )
    if d["free_bytes"] is not None:
        extra += f", {format_bytes(d['free_bytes'])} free"
    if d["under_pressure"]:
        extra += " (under memory pressure: a pod over its limit is stopped without grace)"
    return (
        f"GPU {_device_label(d['gpu'], d['gpu_instance_id'])} {d['name']}: "
        f"{format_bytes(d['used_bytes'])} used by processes of {format_bytes(d['total_bytes'])}"
        f", {format_bytes(d['unattributed_bytes'])} unattributed{extra}"
    )


def run_inspect(
    *,
    gpu_source: FastGpuSource,
    resolver: ProcessResolver,
    pod_lookup: NodeDirectory | None,
    policy: EnforcementPolicy,
    as_json: bool,
    stdout: TextIO,
    stderr: TextIO,
    process_names: ProcessNames | None = None,
    dra_wait_seconds: float = 0.0,
    allocations: AllocationSource | None = None,
) -> int:
    """The CLI entry: inspect, print JSON or the table; exit 1 when NVML cannot be read."""
    try:
        report = inspect_node(
            gpu_source,
            resolver,
            pod_lookup,
            policy,
            process_names,
            dra_wait_seconds=dra_wait_seconds,
            allocations=allocations,
        )
    except (GpuSourceError, GpuSourceUnavailable) as error:
        print(printable(f"gpuguard inspect: cannot read NVML: {error}"), file=stderr)
        return EXIT_FAILED
    if as_json:
        json.dump(report, stdout, indent=2)
        stdout.write("\n")
    else:
        render_inspect(report, stdout)
    return EXIT_OK


# ---------------------------------------------------------------------------------------------


_VERDICTS = {
    Verdict.OK: OK,
    Verdict.UNLIMITED: OK,
    Verdict.OVER: OVER_LIMIT,
    Verdict.UNKNOWN: UNKNOWN_USAGE,
    Verdict.EXEMPT: EXEMPT,
}


def _verdict(row: _Row, online: bool, snapshot: PodSnapshot) -> tuple[str, str]:
    """The table's words for ``core.assess``'s verdict (or for why nobody is charged)."""
    if row.uncharged is not None or row.assessment is None:
        return _uncharged_verdict(row, online, snapshot)
    return _assessed_verdict(row, row.assessment)


def _uncharged_verdict(row: _Row, online: bool, snapshot: PodSnapshot) -> tuple[str, str]:
    if row.uncharged is RefusalReason.GHOST:
        return GHOST, "pid not in /proc"
    if row.uncharged is RefusalReason.IDENTITY_CHANGED:
        return GHOST, "pid reused: its process does not hold the GPU open"
    if row.uncharged is RefusalReason.NOT_A_POD:
        return NOT_A_POD, row.attribution.reason or ""
    if not online:
        return POD_UNKNOWN, "offline: no pod directory"
    if not snapshot.synced:
        return POD_UNKNOWN, "pod directory not synced"
    return POD_UNKNOWN, "pod uid not found on this node"


def _assessed_verdict(row: _Row, a: Assessment) -> tuple[str, str]:
    if a.verdict is Verdict.EXEMPT:
        return EXEMPT, f"namespace {a.pod.namespace} is exempt"
    if a.verdict is Verdict.UNKNOWN:
        return UNKNOWN_USAGE, f"NVML reports N/A for {a.unknown_processes} process(es)"
    note = "MPS client: not signalled" if a.refusal is RefusalReason.MPS else ""
    if a.refusal is RefusalReason.EXEMPTION_UNKNOWN:
        note = "the namespace's exempt label is not known yet: not signalled"
    if a.verdict is Verdict.UNLIMITED:
        return OK, note or (
            "no limit; no allocation names this GPU" if a.unallocated else "no limit"
        )
    if a.unallocated_stop:
        return _VERDICTS[
            a.verdict
        ], note or "no allocation names this GPU (enforcement.unallocated = stop)"
    return _VERDICTS[a.verdict], note


def _name(identity: ProcessIdentity | None, process_names: ProcessNames | None) -> str | None:
    if identity is None or process_names is None:
        return None
    return process_names(identity)


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
    """The limit, and where more than one declaration was weighed, the one that bound."""
    if p["pod"] is None:
        return "-"
    if p["limit_bytes"] is None:
        return "none"
    limit = format_bytes(p["limit_bytes"])
    return f"{limit} ({p['limit_source']})" if len(p["limit_declarations"]) > 1 else limit


def _dra_share_lines(processes: Sequence[Mapping[str, Any]]) -> list[str]:
    """Once per pod and device that DRA allocated shares on: the claims and shares behind its
    limit there (``explain``'s ``dra_share_line``, escaped)."""
    lines: dict[tuple[Any, ...], str] = {}
    for p in processes:
        shares = dra_share_line(p["dra_shares"])
        where = (p["pod_uid"], p["gpu"], p["gpu_instance_id"])
        if shares is not None and where not in lines:
            gpu = _device_label(p["gpu"], p["gpu_instance_id"])
            lines[where] = printable(f"{p['namespace']}/{p['pod']} on GPU {gpu}: ") + shares
    return list(lines.values())


def _bytes(value: int | None) -> str:
    return "n/a" if value is None else format_bytes(value)


def run_inspect_from_args(args: argparse.Namespace) -> int:
    """``gpuguard inspect``: one gather with the enforcer's own adapters; returns the exit code."""
    import sys

    from gpuguard import logs
    from gpuguard.app import (
        build_allocation_source_for,
        build_clock,
        build_gpu_source,
        build_pod_directory,
        build_process_names,
        build_resolver,
        settings_from_args,
    )

    settings = settings_from_args(args)
    logs.configure(level="warning", json=False)
    clock = build_clock()
    directory: NodeDirectory | None = None
    with Startup() as startup:
        if not args.offline:
            live = build_pod_directory(settings, pods_file=args.pods_file, clock=clock)
            startup.opened("pod_directory", live.stop)
            directory = live
            if not live.wait_synced(settings.kube.request_timeout_seconds):
                print(
                    "gpuguard inspect: the pod list did not sync in time; showing pod UIDs only",
                    file=sys.stderr,
                )
        gpu = build_gpu_source(settings, clock)
        startup.opened("gpu", gpu.close)
        allocations = None if args.offline else build_allocation_source_for(settings, clock)
        if allocations is not None:
            startup.opened("pod_resources", allocations.close)
        return run_inspect(
            gpu_source=gpu,
            resolver=build_resolver(settings),
            pod_lookup=directory,
            policy=settings.enforcement_policy(self_pod_uid=None),
            as_json=args.json,
            stdout=sys.stdout,
            stderr=sys.stderr,
            process_names=build_process_names(settings),
            dra_wait_seconds=settings.kube.request_timeout_seconds,
            allocations=allocations,
        )
