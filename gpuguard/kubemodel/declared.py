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
  not both (KAI allows one).
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

from gpuguard.core.model import Declaration, LimitSource
from gpuguard.kubemodel.quantity import InvalidQuantity, parse_count, show

KAI_MEMORY = "gpu-memory"
KAI_FRACTION = "gpu-fraction"
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
    kai = _kai(annotations)
    if kai is not None:
        found[LimitSource.KAI] = kai
    for source, keys in _CONTAINER_KEYS.items():
        declared = _containers(source, keys, spec)
        if declared is not None:
            found[source] = _pin(source, declared, annotations)
    return found


def _kai(annotations: Mapping[str, Any]) -> Declaration | None:
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
