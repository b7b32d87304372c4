"""Limit resolution: a pod's effective GPU memory limit on one device, with its source and reasons.

Owns the precedence of DESIGN §5.1 and the admin-only exemptions and modes. Pure and standard
library only: must not parse annotation text (``adapters.kube.quantity`` does that into
``Pod.annotation_limit`` / ``Pod.annotation_error``), do I/O, read a clock or log. Problems come
back as strings in ``ResolvedLimit.errors`` / ``warnings`` for the caller to log, count and
post as Events.

Precedence (first that applies wins), then the namespace maximum caps the result:

1. the pod's valid annotation ``gpuguard.io/gpu-memory-limit`` → ``annotation`` (when
   ``limits.sources`` lists ``gpuguard``, as it does by default); an *invalid* one is recorded
   as an error and ignored, so the admin default applies: an invalid annotation never means
   "unlimited" when a default exists, and never means "kill";
1b. the first other scheduler ``limits.sources`` lists (``kai``, ``hami``, ``gpushare``,
   ``volcano``) that declares a valid value → that source's name; an invalid declaration is
   recorded and skipped exactly like an invalid annotation;
2. the namespace default ``[limits.namespaces.<ns>] default`` → ``namespace-default``;
3. the cluster default ``[limits] default`` → ``default``;
4. the replicas-derived default ``(device total − reserve) // replicas`` → ``replicas``, when
   enabled and the node's ``nvidia.com/gpu.replicas`` is known and **≥ 2**. One replica means the
   GPU is not time-sliced: there is no neighbour to protect, and a limit just below the device's
   size would only kill a pod using the GPU it was given whole;
5. otherwise no limit (``None``).

``effective = min(chosen, namespace max)``: the maximum applies to annotations too (tenants can
only tighten) and to pods with no limit at all (then the source is ``namespace-default``, the
namespace's admin policy, with a warning saying so). A limit that exceeds the device's memory can
never be reached: it is reported as unlimited (``None``) with a warning. A percentage, or a
replicas default, on a device of unknown size cannot be resolved: ``None`` with an error.
"""

from __future__ import annotations

from gpuguard.core.model import (
    GPUGUARD_SOURCE,
    LIMIT_ANNOTATION,
    Declaration,
    LimitPolicy,
    LimitSource,
    LimitValue,
    Mode,
    NamespacePolicy,
    Pod,
    ResolvedLimit,
)
from gpuguard.core.units import format_bytes

ANNOTATION_PREFIX = LIMIT_ANNOTATION.split("/", 1)[0] + "/"
"""``gpuguard.io/``: any other key under it is a typo or an attempt at self-service policy."""

MIN_LIMIT_BYTES = 1 << 20
"""The smallest limit gpuguard applies, from any source. Below 1 MiB a limit is a unit slip
(``"16"`` is 16 bytes, not 16 GiB) or a percentage that rounds to nothing, and a CUDA context
alone takes hundreds of MiB: such a limit would stop every GPU process, and ``0`` never means
"kill" (DESIGN §5.1). Absolute values below it are invalid where they are parsed; percentages
and replica splits that resolve below it on a device are refused here."""

LARGEST_DEVICE_BYTES = 1 << 40
"""1 TiB, above any GPU made (H200: 141 GB, B300: 288 GB): a percentage that resolves below
``MIN_LIMIT_BYTES`` even on such a device can never be a real limit and is refused in config."""


def percent_below_minimum(percent: float) -> bool:
    """Whether ``percent`` of the largest plausible device is still below ``MIN_LIMIT_BYTES``."""
    return LARGEST_DEVICE_BYTES * percent / 100 < MIN_LIMIT_BYTES


def is_exempt(namespace: str, policy: LimitPolicy) -> bool:
    """Whether gpuguard must never act on pods of ``namespace`` (admin config only)."""
    return namespace in policy.exempt_namespaces


def effective_mode(namespace: str, policy: LimitPolicy, global_mode: Mode) -> Mode:
    """The namespace's mode override from admin config, else the global mode."""
    namespace_policy = policy.namespaces.get(namespace)
    if namespace_policy is not None and namespace_policy.mode is not None:
        return namespace_policy.mode
    return global_mode


def resolve_limit(
    *, pod: Pod, device_total_bytes: int | None, policy: LimitPolicy, replicas: int | None
) -> ResolvedLimit:
    """The pod's effective limit on a device of ``device_total_bytes`` (``None``: unknown size).

    ``replicas`` is the node's time-slicing replica count, ``None`` when unknown.
    """
    errors: list[str] = []
    warnings: list[str] = _annotation_key_warnings(pod)
    namespace_policy = policy.namespaces.get(pod.namespace, NamespacePolicy())

    chosen: int | None = None
    source: LimitSource | None = None
    unresolved = False
    annotation = _valid_annotation(pod, errors) if GPUGUARD_SOURCE in policy.sources else None
    candidates: tuple[tuple[LimitValue | None, LimitSource, str], ...] = (
        (annotation, LimitSource.ANNOTATION, f"annotation {LIMIT_ANNOTATION}"),
        *_declared(pod, policy, errors, warnings),
        (
            namespace_policy.default_limit,
            LimitSource.NAMESPACE_DEFAULT,
            f"default of namespace {pod.namespace}",
        ),
        (policy.cluster_default, LimitSource.DEFAULT, "cluster default"),
    )
    for value, candidate_source, what in candidates:
        if value is None:
            continue
        resolved = value.resolve(device_total_bytes)
        if resolved is not None and resolved < MIN_LIMIT_BYTES:
            # Never a limit: fall through to the next source, as for an invalid annotation.
            errors.append(_below_minimum(what, value, resolved))
            continue
        source, chosen = candidate_source, resolved
        if chosen is None:
            unresolved = True
            errors.append(f"{what} {_show(value)} needs the device's memory size to be resolved")
        break
    else:
        if policy.replicas_default and replicas is not None and replicas >= 2:
            source = LimitSource.REPLICAS
            chosen = _replicas_default(device_total_bytes, policy, replicas, errors)
            unresolved = chosen is None

    maximum = namespace_policy.max_limit
    if maximum is not None:
        max_bytes = maximum.resolve(device_total_bytes)
        if max_bytes is not None and max_bytes < MIN_LIMIT_BYTES:
            errors.append(
                _below_minimum(f"maximum of namespace {pod.namespace}", maximum, max_bytes)
            )
        elif max_bytes is None:
            errors.append(
                f"maximum of namespace {pod.namespace} {_show(maximum)} needs the device's memory "
                "size to be resolved"
            )
        elif chosen is not None and chosen > max_bytes:
            warnings.append(
                f"limit {format_bytes(chosen)} ({source}) capped to the maximum of namespace "
                f"{pod.namespace}: {format_bytes(max_bytes)}"
            )
            chosen = max_bytes
        elif chosen is None and not unresolved:
            warnings.append(
                f"no annotation or default applies: the maximum of namespace {pod.namespace} "
                f"({format_bytes(max_bytes)}) is the limit"
            )
            chosen, source = max_bytes, LimitSource.NAMESPACE_DEFAULT

    if chosen is not None and device_total_bytes is not None and chosen > device_total_bytes:
        warnings.append(
            f"limit {format_bytes(chosen)} ({source}) exceeds the device's memory "
            f"{format_bytes(device_total_bytes)}: effectively unlimited"
        )
        chosen = None
    return ResolvedLimit(
        limit_bytes=chosen, source=source, errors=tuple(errors), warnings=tuple(warnings)
    )


def _declared(
    pod: Pod, policy: LimitPolicy, errors: list[str], warnings: list[str]
) -> list[tuple[LimitValue | None, LimitSource, str]]:
    """The listed schedulers' valid declarations, in ``limits.sources`` order, as limit
    candidates; an invalid one is recorded as an error and skipped (never "unlimited")."""
    candidates: list[tuple[LimitValue | None, LimitSource, str]] = []
    for name in policy.sources:
        if name == GPUGUARD_SOURCE:
            continue
        source = LimitSource(name)
        declaration = pod.declared.get(source)
        if declaration is None:
            continue
        warnings.extend(f"{source}: {w}" for w in declaration.warnings)
        if declaration.error is not None:
            errors.append(
                f"invalid {source} declaration ({declaration.where}): {declaration.error}; "
                "ignored (the next source or the admin default applies, if any)"
            )
            continue
        value = _declared_value(declaration, source, policy)
        candidates.append((value, source, f"{source} declaration ({declaration.where})"))
    return candidates


def _declared_value(
    declaration: Declaration, source: LimitSource, policy: LimitPolicy
) -> LimitValue:
    """Bytes, a share of the device, or (containers that declared each) both, summed."""
    unit = policy.gpushare_unit_bytes if source is LimitSource.GPUSHARE else 1 << 20
    absolute = declaration.amount * unit if declaration.amount else None
    return LimitValue(limit_bytes=absolute, percent=declaration.percent or None)


def _valid_annotation(pod: Pod, errors: list[str]) -> LimitValue | None:
    """The parsed annotation, or ``None`` (recording why when one was present but unusable)."""
    if pod.annotation_error is not None:
        errors.append(
            f"invalid annotation {LIMIT_ANNOTATION}: {pod.annotation_error}; ignored (the admin "
            "default applies, if any)"
        )
        return None
    if pod.annotation_limit is None and LIMIT_ANNOTATION in pod.annotations:
        # A wiring bug (the pod was built without adapters.kube.quantity.parse_limit). Say so rather
        # than silently treating a tenant's limit as absent.
        errors.append(f"annotation {LIMIT_ANNOTATION} was not parsed; ignored")
    return pod.annotation_limit


def _replicas_default(
    device_total_bytes: int | None, policy: LimitPolicy, replicas: int, errors: list[str]
) -> int | None:
    if device_total_bytes is None:
        errors.append(
            f"replicas default ({replicas} replicas) needs the device's memory size to be resolved"
        )
        return None
    shareable = device_total_bytes - policy.replicas_reserve_bytes
    if shareable <= 0:
        errors.append(
            f"replicas default: reserve {format_bytes(policy.replicas_reserve_bytes)} leaves "
            f"nothing of the device's {format_bytes(device_total_bytes)} to share; no limit"
        )
        return None
    share = shareable // replicas
    if share < MIN_LIMIT_BYTES:
        errors.append(
            f"replicas default: {format_bytes(shareable)} shared by {replicas} replicas is "
            f"{format_bytes(share)} each, below the smallest limit of 1Mi; no limit"
        )
        return None
    return share


def _below_minimum(what: str, value: LimitValue, resolved: int) -> str:
    return (
        f"{what} {_show(value)} resolves to {format_bytes(resolved)} on this device, below the "
        "smallest limit of 1Mi; ignored"
    )


def _annotation_key_warnings(pod: Pod) -> list[str]:
    """Keys under ``gpuguard.io/`` other than the limit: never applied, always reported.

    Covers typos (``gpu-memory-limt``), case variants (``GPU-Memory-Limit``), per-container
    attempts and self-exemption attempts (``gpuguard.io/exempt``): exemptions and maximums come
    only from admin config (DESIGN §4).
    """
    warnings = []
    for key in sorted(pod.annotations):
        if key == LIMIT_ANNOTATION or not key.lower().startswith(ANNOTATION_PREFIX):
            continue
        if key.lower() == LIMIT_ANNOTATION:
            hint = f"keys are case-sensitive, use {LIMIT_ANNOTATION}"
        elif key.lower().startswith(LIMIT_ANNOTATION):
            hint = f"per-container limits are not supported, use {LIMIT_ANNOTATION} (per pod)"
        else:
            hint = (
                f"the only gpuguard annotation is {LIMIT_ANNOTATION}; exemptions and maximums "
                "come from the admin's config"
            )
        warnings.append(f"unknown annotation {key} ignored: {hint}")
    return warnings


def _show(value: LimitValue) -> str:
    if value.percent is not None and value.limit_bytes is not None:
        return f"{format_bytes(value.limit_bytes)} + {value.percent:g}%"
    if value.percent is not None:
        return f"{value.percent:g}%"
    return "no value" if value.limit_bytes is None else format_bytes(value.limit_bytes)
