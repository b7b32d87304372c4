"""Other GPU-sharing schedulers' memory declarations on a pod (docs/design.md, Limit sources), read
as they write them: KAI-Scheduler's pod annotations, HAMi's, gpushare's and Volcano's container
limits.

Owns the parsing and the per-source units' validation into ``core.model.Declaration`` (amounts
in the source's unit, percentages, the devices a scheduler pinned the pod to). Whether a source
applies, and the bytes per device, are ``core.limits``' (``limits.sources``). Every value is a
tenant's: bounded in length, any type, never an exception; an invalid value is an error on the
declaration, never "unlimited". Must not log, read files or import the ``kubernetes`` client at
module level.

- ``kai``: annotations ``gpu-memory`` (a whole number of MiB) or ``gpu-fraction`` (0 < f ≤ 1),
  not both (KAI allows one); and per container (KAI's NvFractions mode)
  ``nvidia.com/container.<c>.gpu-memory.limit`` / ``.request`` (Kubernetes quantities: the
  limit binds, the request where no limit is given), the binder's
  ``nvidia.com/container.<c>.gpus.devices`` (the container's GPUs: a pin) and
  ``gpu-fraction-num-devices`` (the same amount on each of that many GPUs: checked, changes no
  per-device value). Keys naming a container the pod does not have are rejected, never counted.
- ``hami``: per app container, limits ``nvidia.com/gpumem`` (MiB) or
  ``nvidia.com/gpumem-percentage`` (0 < p ≤ 100), summed over the pod's containers; the devices
  HAMi allocated, from the annotation ``hami.io/vgpu-devices-allocated``.
- ``gpushare``: per app container, limit ``aliyun.com/gpu-mem`` (a whole number of GiB, or of
  MiB with ``limits.gpushare_unit``), summed; the device index from the annotation
  ``ALIYUN_COM_GPU_MEM_IDX``.
- ``volcano``: per app container, limits ``volcano.sh/vgpu-memory`` (MiB) or
  ``volcano.sh/vgpu-memory-percentage`` (0 < p ≤ 100), summed.

Container limits are Kubernetes quantities (the API server writes ``3000`` back as ``3k``):
parsed as such, and only whole positive numbers are amounts. Values on init containers are not
counted (they do not run beside the app containers), and say so.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from gpuguard.core.limits import MIN_LIMIT_BYTES
from gpuguard.core.model import ContainerDeclaration, Declaration, LimitSource
from gpuguard.kubemodel.quantity import InvalidQuantity, parse_count, parse_quantity_bytes, show

KAI_MEMORY = "gpu-memory"
KAI_FRACTION = "gpu-fraction"
KAI_CONTAINER_PREFIX = "nvidia.com/container."
"""KAI's per-container keys: ``<prefix><container>.<suffix>`` (KAI-Scheduler
docs/gpu-sharing/README.md, "Request GPU memory with NvFractions"; the gpu-sharing operator's
default ``--annotation-prefix``)."""
KAI_LIMIT_SUFFIX = ".gpu-memory.limit"
KAI_REQUEST_SUFFIX = ".gpu-memory.request"
KAI_DEVICES_SUFFIX = ".gpus.devices"
"""Written by KAI's binder after allocation: the container's GPUs, comma-separated UUIDs (or
indices); KAI's admission refuses users who set it, but gpuguard reads it as any pin: a cap on
its device, never a way out elsewhere."""
KAI_NUM_DEVICES = "gpu-fraction-num-devices"
MAX_CONTAINERS = 64
"""Containers of one pod whose per-container keys are read (app and init containers, in spec
order); more are reported, never read."""
MAX_NUM_DEVICES = 64
"""Largest ``gpu-fraction-num-devices`` taken as a count: more GPUs than any node has."""
MAX_PINS = 64
"""Devices read from one ``gpus.devices`` value."""
MAX_UNKNOWN_NAMED = 4
"""Container names a pod does not have that are named in the report (the rest are counted)."""
_CONTAINER_NAME = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?", re.ASCII)
_MIB = 1 << 20
HAMI_MEMORY = "nvidia.com/gpumem"
HAMI_PERCENT = "nvidia.com/gpumem-percentage"
HAMI_ALLOCATED = "hami.io/vgpu-devices-allocated"
GPUSHARE_MEMORY = "aliyun.com/gpu-mem"
GPUSHARE_INDEX = "ALIYUN_COM_GPU_MEM_IDX"
VOLCANO_MEMORY = "volcano.sh/vgpu-memory"
VOLCANO_PERCENT = "volcano.sh/vgpu-memory-percentage"

_CONTAINER_KEYS: Mapping[LimitSource, tuple[str, str | None]] = {
    LimitSource.HAMI: (HAMI_MEMORY, HAMI_PERCENT),
    LimitSource.GPUSHARE: (GPUSHARE_MEMORY, None),
    LimitSource.VOLCANO: (VOLCANO_MEMORY, VOLCANO_PERCENT),
}
MAX_TEXT = 64
"""Longest value read (a tenant's annotation may be 256 KiB)."""
MAX_ALLOCATED_TEXT = 4096
"""Longest ``hami.io/vgpu-devices-allocated`` read (written by HAMi's scheduler)."""
_DECIMAL = re.compile(r"(?:[0-9]{1,12}(?:\.[0-9]{1,12})?|\.[0-9]{1,12})", re.ASCII)
_INDEX = re.compile(r"[0-9]{1,4}", re.ASCII)
_UUID = re.compile(r"GPU-[0-9a-fA-F-]{8,64}", re.ASCII)


def declarations(manifest: Mapping[str, Any]) -> dict[LimitSource, Declaration]:
    """Every other scheduler's declaration found on the pod (a source with no field on the pod
    is absent)."""
    annotations = _mapping(_mapping(manifest.get("metadata")).get("annotations"))
    spec = _mapping(manifest.get("spec"))
    found: dict[LimitSource, Declaration] = {}
    kai = _kai(annotations, spec)
    if kai is not None:
        found[LimitSource.KAI] = kai
    for source, keys in _CONTAINER_KEYS.items():
        declared = _containers(source, keys, spec)
        if declared is not None:
            found[source] = _pin(source, declared, annotations)
    return found


def _kai(annotations: Mapping[str, Any], spec: Mapping[str, Any]) -> Declaration | None:
    """KAI's pod-wide annotations and its per-container keys, in one ``kai`` declaration."""
    pod_wide = _kai_pod_wide(annotations)
    containers, pins, warnings = _kai_containers(annotations, spec)
    if pod_wide is None and not containers:
        return None
    warnings.extend(_num_devices(annotations, pins))
    if pod_wide is None:
        return Declaration(
            where=f"annotations {KAI_CONTAINER_PREFIX}<container>.gpu-memory.*",
            whole_pod=False,
            containers=containers,
            pinned=pins,
            warnings=tuple(warnings),
        )
    # The binder's pins place the fractional container, so the pod-wide value too (KAI admits
    # one fractional container per pod): a pin scopes it to those GPUs, and caps elsewhere.
    return replace(
        pod_wide,
        containers=containers,
        pinned=pod_wide.pinned | pins,
        warnings=pod_wide.warnings + tuple(warnings),
    )


def _kai_containers(
    annotations: Mapping[str, Any], spec: Mapping[str, Any]
) -> tuple[tuple[ContainerDeclaration, ...], frozenset[str], list[str]]:
    """One entry per container of the pod that carries per-container memory keys, one rejected
    entry per name the pod has no container of; every device the binder pinned a container of
    the pod to; and warnings."""
    names, warnings = _container_names(spec)
    found: list[ContainerDeclaration] = []
    pins: set[str] = set()
    for name in names:
        declared, notes = _kai_container(annotations, name)
        warnings.extend(notes)
        if declared is not None:
            found.append(declared)
            pins.update(declared.pinned)
        elif f"{KAI_CONTAINER_PREFIX}{name}{KAI_DEVICES_SUFFIX}" in annotations:
            pinned, notes = _pins(
                annotations[f"{KAI_CONTAINER_PREFIX}{name}{KAI_DEVICES_SUFFIX}"], name
            )
            warnings.extend(notes)
            pins.update(pinned)
    if len(found) > 1:
        warnings.append(
            f"{len(found)} containers declare GPU memory ({', '.join(c.container for c in found)}) "
            "where KAI-Scheduler admits one per pod: each caps its container and the pod, and "
            "the smallest binds the pod"
        )
    unknown = _unknown_containers(annotations, set(names))
    for name in unknown[:MAX_UNKNOWN_NAMED]:
        found.append(
            ContainerDeclaration(
                container=name,
                where=f"annotations {KAI_CONTAINER_PREFIX}{name}.*",
                error=f"the pod has no container {name}: it declares nothing",
            )
        )
    if len(unknown) > MAX_UNKNOWN_NAMED:
        warnings.append(
            f"{len(unknown) - MAX_UNKNOWN_NAMED} more container names in "
            f"{KAI_CONTAINER_PREFIX}<container>.* keys that the pod does not have: ignored"
        )
    return tuple(found), frozenset(pins), warnings


def _container_names(spec: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """The names of the pod's app and init containers (KAI's keys may name either), bounded."""
    names: list[str] = []
    warnings: list[str] = []
    for kind in ("containers", "initContainers"):
        items = spec.get(kind)
        for raw in items if isinstance(items, list) else ():
            name = _mapping(raw).get("name")
            if not isinstance(name, str) or not _CONTAINER_NAME.fullmatch(name):
                continue
            if name in names:
                warnings.append(f"container name {name} appears twice in the pod spec")
                continue
            if len(names) == MAX_CONTAINERS:
                warnings.append(
                    f"more than {MAX_CONTAINERS} containers: per-container keys of the rest "
                    "are not read"
                )
                return names, warnings
            names.append(name)
    return names, warnings


def _kai_container(
    annotations: Mapping[str, Any], name: str
) -> tuple[ContainerDeclaration | None, list[str]]:
    """One container's keys, and warnings: the limit binds; the request where no limit is given
    (KAI and its runtime then enforce the request: the gpu-sharing operator's
    ``ApplyDefaults``)."""
    limit_key = f"{KAI_CONTAINER_PREFIX}{name}{KAI_LIMIT_SUFFIX}"
    request_key = f"{KAI_CONTAINER_PREFIX}{name}{KAI_REQUEST_SUFFIX}"
    # Present with any value (a manifest's ``null`` too) is a value to check, not an absence.
    has_limit, has_request = limit_key in annotations, request_key in annotations
    if not (has_limit or has_request):
        return None, []
    limit, request = annotations.get(limit_key), annotations.get(request_key)
    devices = annotations.get(f"{KAI_CONTAINER_PREFIX}{name}{KAI_DEVICES_SUFFIX}")
    pinned, notes = _pins(devices, name)
    key, raw = (limit_key, limit) if has_limit else (request_key, request)
    where = f"annotation {key}"
    try:
        amount = _memory(raw)
    except InvalidQuantity as exc:
        declared = ContainerDeclaration(container=name, where=where, error=str(exc), pinned=pinned)
        return declared, notes
    if has_limit and has_request:
        try:
            asked = _memory(request)
        except InvalidQuantity as exc:
            notes.append(f"{request_key}: {exc}; the limit binds")
        else:
            if asked > amount:
                notes.append(
                    f"{request_key} is above {limit_key} (KAI requires request ≤ limit): "
                    "the limit binds"
                )
    declared = ContainerDeclaration(container=name, limit_bytes=amount, where=where, pinned=pinned)
    return declared, notes


def _memory(raw: object) -> int:
    """A per-container memory value: a Kubernetes quantity of bytes, at least 1 MiB, rounded
    up to whole MiB as KAI's runtime enforces it (so never below what KAI meant)."""
    if not isinstance(raw, str):
        text = str(raw)[:MAX_TEXT]
        raise InvalidQuantity(text, "syntax", f"{show(text)} is not a string")
    amount = parse_quantity_bytes(raw)
    if amount < MIN_LIMIT_BYTES:
        raise InvalidQuantity(
            raw, "too_small", f"{show(raw)} is {amount} bytes, below KAI's smallest of 1Mi"
        )
    return -(-amount // _MIB) * _MIB


def _pins(raw: object, name: str) -> tuple[frozenset[str], list[str]]:
    """The binder's ``gpus.devices``: comma-separated GPU UUIDs or indices. Anything else in it
    is reported and left out; nothing valid leaves the container unpinned (its declaration then
    applies on every GPU: a pin is never a way out)."""
    if raw is None:
        return frozenset(), []
    key = f"{KAI_CONTAINER_PREFIX}{name}{KAI_DEVICES_SUFFIX}"
    if not isinstance(raw, str) or len(raw) > MAX_ALLOCATED_TEXT:
        return frozenset(), [f"{key} is not a device list: not read (not pinned)"]
    pinned: set[str] = set()
    bad = 0
    entries = [e.strip() for e in raw.split(",")]
    for entry in entries[:MAX_PINS]:
        if _UUID.fullmatch(entry):
            pinned.add(entry)
        elif _INDEX.fullmatch(entry):
            pinned.add(f"index:{int(entry)}")
        else:
            bad += 1
    notes = []
    if bad:
        notes.append(f"{bad} entries of {key} are not a GPU UUID or index: left out")
    if len(entries) > MAX_PINS:
        notes.append(f"{key} lists more than {MAX_PINS} devices: the rest are not read")
    return frozenset(pinned), notes


def _unknown_containers(annotations: Mapping[str, Any], names: set[str]) -> list[str]:
    """Container names of per-container memory keys that the pod has no container of, sorted
    (one that is no DNS label quoted and shortened)."""
    unknown: set[str] = set()
    for key in annotations:
        if not isinstance(key, str) or not key.startswith(KAI_CONTAINER_PREFIX):
            continue
        for suffix in (KAI_LIMIT_SUFFIX, KAI_REQUEST_SUFFIX):
            if key.endswith(suffix):
                name = key[len(KAI_CONTAINER_PREFIX) : -len(suffix)]
                if name not in names:
                    # Shown as written only when it could be a container's name; else quoted
                    # and shortened (a key may carry any character, up to its length limit).
                    unknown.add(name if _CONTAINER_NAME.fullmatch(name) else show(name))
    return sorted(unknown)


def _num_devices(annotations: Mapping[str, Any], pins: frozenset[str]) -> list[str]:
    """``gpu-fraction-num-devices``: the declared amount on each of that many GPUs. Every
    limit is per device already, so the count changes no value; an invalid one, or one the
    binder's pins disagree with, is reported."""
    raw = annotations.get(KAI_NUM_DEVICES)
    if raw is None:
        return []
    if (
        not isinstance(raw, str)
        or not _INDEX.fullmatch(raw)
        or not 1 <= int(raw) <= MAX_NUM_DEVICES
    ):
        text = raw if isinstance(raw, str) else repr(raw)
        return [
            f"{KAI_NUM_DEVICES} {show(text[:MAX_TEXT])} is not a whole number from 1 to "
            f"{MAX_NUM_DEVICES}: ignored (each GPU is held to the declared amount)"
        ]
    if pins and len(pins) != int(raw):
        return [
            f"{KAI_NUM_DEVICES} is {int(raw)} but the binder pinned {len(pins)} devices "
            "(each GPU is held to the declared amount)"
        ]
    return []


def _kai_pod_wide(annotations: Mapping[str, Any]) -> Declaration | None:
    memory, fraction = annotations.get(KAI_MEMORY), annotations.get(KAI_FRACTION)
    if memory is None and fraction is None:
        return None
    if memory is not None and fraction is not None:
        return Declaration(
            where=f"annotations {KAI_MEMORY} and {KAI_FRACTION}",
            error="both are set; KAI-Scheduler takes one or the other",
        )
    if memory is not None:
        where = f"annotation {KAI_MEMORY}"
        try:
            return Declaration(amount=_amount(memory), where=where)
        except InvalidQuantity as exc:
            return Declaration(where=where, error=str(exc))
    where = f"annotation {KAI_FRACTION}"
    try:
        return Declaration(percent=_share(fraction, maximum=1.0) * 100, where=where)
    except InvalidQuantity as exc:
        return Declaration(where=where, error=str(exc))


def _containers(
    source: LimitSource, keys: tuple[str, str | None], spec: Mapping[str, Any]
) -> Declaration | None:
    """The sum over app containers; ``None`` when no container declares anything."""
    memory_key, percent_key = keys
    amount, percent = 0, 0.0
    where: list[str] = []
    errors: list[str] = []
    warnings: list[str] = []
    for kind, counted in (("containers", True), ("initContainers", False)):
        items = spec.get(kind)
        for raw in items if isinstance(items, list) else ():
            container = _mapping(raw)
            name = container.get("name")
            label = f"container {name}" if isinstance(name, str) else "a container without a name"
            limits = _mapping(_mapping(container.get("resources")).get("limits"))
            has_memory = memory_key in limits
            has_percent = percent_key is not None and percent_key in limits
            if not (has_memory or has_percent):
                continue
            if not counted:
                warnings.append(f"{label} is an init container: its declaration is not counted")
                continue
            where.append(label)
            if has_memory and has_percent:
                errors.append(f"{label} sets both {memory_key} and {percent_key}")
                continue
            try:
                if has_memory:
                    amount += _amount(_quantity_text(limits[memory_key]))
                else:
                    assert percent_key is not None
                    percent += _share(_quantity_text(limits[percent_key]), maximum=100.0)
            except InvalidQuantity as exc:
                key = memory_key if has_memory else percent_key
                errors.append(f"{label} {key}: {exc}")
    if not where and not warnings:
        return None
    keys_text = memory_key if percent_key is None else f"{memory_key} / {percent_key}"
    described = f"limits {keys_text} of {', '.join(where) or 'no app container'}"
    if errors:
        return Declaration(where=described, error="; ".join(errors), warnings=tuple(warnings))
    if percent > 100:
        return Declaration(
            where=described,
            error=f"the containers' percentages add up to {percent:g} %, above 100",
            warnings=tuple(warnings),
        )
    if not where:  # declared only on init containers: nothing to count
        return Declaration(where=described, error="no app container declares it",
                           warnings=tuple(warnings))  # fmt: skip
    return Declaration(amount=amount, percent=percent, where=described, warnings=tuple(warnings))


def _pin(source: LimitSource, declared: Declaration, annotations: Mapping[str, Any]) -> Declaration:
    """The devices the scheduler placed the pod on, where it says (gpushare, HAMi)."""
    pinned: set[str] = set()
    if source is LimitSource.GPUSHARE:
        raw = annotations.get(GPUSHARE_INDEX)
        if isinstance(raw, str) and _INDEX.fullmatch(raw):
            pinned.add(f"index:{int(raw)}")
    elif source is LimitSource.HAMI:
        raw = annotations.get(HAMI_ALLOCATED)
        if isinstance(raw, str) and len(raw) <= MAX_ALLOCATED_TEXT:
            # "GPU-<uuid>,NVIDIA,<MiB>,<cores>:" per device, containers separated by ";".
            for entry in re.split(r"[;:]", raw):
                uuid = entry.split(",", 1)[0].strip()
                if _UUID.fullmatch(uuid):
                    pinned.add(uuid)
    if not pinned:
        return declared
    return replace(declared, pinned=frozenset(pinned))


def _quantity_text(raw: object) -> object:
    """A manifest's resource quantity may be a YAML number (``nvidia.com/gpumem: 3000``), as
    the API server accepts; an annotation may not (it must be a string)."""
    if isinstance(raw, int | float) and not isinstance(raw, bool):
        return repr(raw)
    return raw


def _amount(raw: object) -> int:
    """A whole positive number of the source's unit, as text (an annotation) or a quantity."""
    if not isinstance(raw, str):
        raise InvalidQuantity(str(raw)[:MAX_TEXT], "syntax", f"{show(str(raw))} is not a string")
    return parse_count(raw)


def _share(raw: object, *, maximum: float) -> float:
    """A plain decimal > 0 and ≤ ``maximum`` (a fraction, or a percentage without ``%``)."""
    what = f"a number > 0 and ≤ {maximum:g}"
    if not isinstance(raw, str) or len(raw) > MAX_TEXT or not _DECIMAL.fullmatch(raw):
        text = raw if isinstance(raw, str) else repr(raw)
        raise InvalidQuantity(text[:MAX_TEXT], "syntax", f"{show(text)} is not {what}")
    value = float(raw)
    if value <= 0:
        raise InvalidQuantity(raw, "zero", f"{show(raw)} is zero: use {what}")
    if value > maximum:
        raise InvalidQuantity(raw, "too_large", f"{show(raw)} is above {maximum:g}: use {what}")
    return value


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}
