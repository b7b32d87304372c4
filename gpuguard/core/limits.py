"""Limit resolution: a pod's effective GPU memory limit on one device, with its source and reasons.

Owns the precedence (docs/design.md, Limit sources) and the admin-only exemptions and modes. Pure
and standard library only: must not parse annotation text (``kubemodel.quantity`` does that into
``Pod.annotation_limit`` / ``Pod.annotation_error``), do I/O, read a clock or log. Problems come
back as strings in ``ResolvedLimit.errors`` / ``warnings`` for the caller to log, count and
post as Events.

The rule: a tenant's own annotation never raises what a scheduler declared for it.

1. **Declarations cap, the smallest binds.** Every declaration that applies on this device is a
   cap: the pod's valid annotation ``gpuguard.io/gpu-memory-limit`` (``annotation``, when
   ``limits.sources`` lists ``gpuguard``, as it does by default) and each listed scheduler's
   valid declaration (``kai``, ``hami``, ``gpushare``, ``volcano``, and ``dra``: the memory
   shares DRA allocated the pod on this device, summed). The smallest is the limit
   and names the ``source``; the order of ``limits.sources`` only breaks ties. An *invalid*
   value is recorded as an error and is no candidate (the next one, or the admin default,
   applies): it never means "unlimited" when a default exists, and never means "kill".
2. **Pins scope a declaration to its device.** A declaration whose scheduler pinned the pod to
   other devices (gpushare's ``ALIYUN_COM_GPU_MEM_IDX``, HAMi's
   ``hami.io/vgpu-devices-allocated``) grants nothing on this one: it is no candidate here, and
   the pod falls to the next applicable limit. It still caps the pod here, and is the limit when
   nothing else applies: a pin is pod metadata a tenant can write, and a forged one must never
   lift what the pod declared. Without a device (``check-pod``) pins are not checked. A DRA
   allocation is not pod metadata (the scheduler writes it and nobody can change it once set):
   on a device it did not allocate it grants nothing *and* caps nothing, and a share that
   cannot be placed (a claim not read yet, a device no ResourceSlice of the node names) leaves
   the share unknown on every device (an error; never a guess of it).
3. **Defaults only without a declaration**: the namespace default ``[limits.namespaces.<ns>]
   default`` → ``namespace-default``, the cluster default ``[limits] default`` → ``default``,
   the replicas split ``(device total − reserve) // replicas`` → ``replicas`` (when enabled and
   the node's ``nvidia.com/gpu.replicas`` is known and **≥ 2**: one replica means the GPU is not
   time-sliced, there is no neighbour to protect); otherwise no limit (``None``). A pod whose
   only declaration is DRA shares not known yet is held like a pod without one: an unresolved
   pod is never less bounded than a pod that declares nothing. The default may be below the
   shares, so ``ResolvedLimit.awaits_dra`` tells ``core.policy`` to act on it only once the
   pod's claims were read since the violation was due.
4. **The namespace maximum caps all**: ``effective = min(chosen, namespace max)``, annotations
   and declarations included (tenants can only tighten), and pods with no limit at all (then
   the source is ``namespace-default``, the namespace's admin policy, with a warning saying so).

A limit that exceeds the device's memory can never be reached: it is reported as unlimited
(``None``) with a warning. A percentage, or a replicas default, on a device of unknown size
cannot be resolved: ``None`` with an error; among several declarations, one that cannot be
resolved makes the smallest unknown (an error that says so, never a guess).

A container's own declaration (KAI's ``nvidia.com/container.<c>.gpu-memory.*``) is a cap on
that container and on the pod like any other; ``ResolvedLimit.containers`` is each container's
own limit on the device (its smallest declaration, at most the pod's limit).

Size: over 600 lines, on purpose: the one precedence every reader of a limit shares (the
enforcer, ``check-pod``, ``explain``, ``inspect``): every source, the pins, the defaults, the
maximum and each container's own limit are weighed in one reviewable place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from gpuguard.core.model import (
    GPUGUARD_SOURCE,
    LIMIT_ANNOTATION,
    BoundBy,
    ContainerLimit,
    Declaration,
    DeclaredLimit,
    GpuDevice,
    InPodCap,
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
"kill" (docs/design.md, Limit sources). Absolute values below it are invalid where they are parsed;
percentages and replica splits that resolve below it on a device are refused here."""

LARGEST_DEVICE_BYTES = 1 << 40
"""1 TiB, above any GPU made (H200: 141 GB, B300: 288 GB): a percentage that resolves below
``MIN_LIMIT_BYTES`` even on such a device can never be a real limit and is refused in config."""

_NEEDS_SIZE = "needs the device's memory size to be resolved"
_DEFAULTS = (LimitSource.NAMESPACE_DEFAULT, LimitSource.DEFAULT, LimitSource.REPLICAS)


def percent_below_minimum(percent: float) -> bool:
    """Whether ``percent`` of the largest plausible device is still below ``MIN_LIMIT_BYTES``."""
    return LARGEST_DEVICE_BYTES * percent / 100 < MIN_LIMIT_BYTES


def is_exempt(namespace: str, policy: LimitPolicy, labelled: frozenset[str] | None) -> bool | None:
    """Whether gpuguard must never act on pods of ``namespace``, from admin config only: a name
    in ``exempt_namespaces``, or a namespace that carries the admin's exempt label (``labelled``:
    the namespaces known to carry it, ``None`` while not known). ``None``: it cannot be told (a
    label is configured and the labels are unknown), which is never "not exempt"."""
    if namespace in policy.exempt_namespaces:
        return True
    if policy.exempt_label is None:
        return False
    if labelled is None:
        return None
    return namespace in labelled


def exempt_label_text(policy: LimitPolicy) -> str | None:
    """The admin's exempt label as ``key=value``, for messages; ``None`` when none is set."""
    if policy.exempt_label is None:
        return None
    key, value = policy.exempt_label
    return f"{key}={value}"


def effective_mode(namespace: str, policy: LimitPolicy, global_mode: Mode) -> Mode:
    """The namespace's mode override from admin config, else the global mode."""
    namespace_policy = policy.namespaces.get(namespace)
    if namespace_policy is not None and namespace_policy.mode is not None:
        return namespace_policy.mode
    return global_mode


def enforces_anywhere(policy: LimitPolicy, global_mode: Mode) -> bool:
    """Whether some namespace's effective mode is enforce: the global mode, or an override.
    When none is, nothing is ever signalled (audit mode only reports)."""
    return global_mode is Mode.ENFORCE or any(
        n.mode is Mode.ENFORCE for n in policy.namespaces.values()
    )


def resolve_limit(
    *,
    pod: Pod,
    device_total_bytes: int | None,
    policy: LimitPolicy,
    replicas: int | None,
    device: GpuDevice | None = None,
) -> ResolvedLimit:
    """The pod's effective limit on a device of ``device_total_bytes`` (``None``: unknown size).

    ``replicas`` is the node's time-slicing replica count, ``None`` when unknown. ``device`` is
    the GPU the limit is for, which a scheduler's pin names or not; ``None`` (no device, as in
    ``check-pod``): every declaration applies wherever it is pinned.
    """
    errors: list[str] = []
    warnings: list[str] = _annotation_key_warnings(pod)
    namespace_policy = policy.namespaces.get(pod.namespace, NamespacePolicy())

    seen = _declarations(pod, policy, device, device_total_bytes, errors=errors, warnings=warnings)
    here = [d for d in seen if d.assigned]
    # DRA shares not known yet (a claim not read, refused, past the node's claim budget, a
    # device in no slice): alone, they leave the pod held like one that declares nothing, so
    # making its own claims unknowable never gains a tenant more than a pod without any.
    pending = [d for d in here if d.unresolved is not None]
    if here and len(pending) < len(here):
        chosen, source, unresolved = _smallest(here, errors, warnings)
    else:
        errors.extend(
            f"{d.what}: {d.unresolved}; held meanwhile like a pod that declares nothing"
            for d in pending
        )
        chosen, source, unresolved = _defaults(
            pod, namespace_policy, device_total_bytes, policy, replicas=replicas, errors=errors
        )
    stand_in = bool(pending) and chosen is not None and source in _DEFAULTS
    elsewhere = [d for d in seen if not d.assigned]
    if elsewhere and not unresolved:
        capped, source = _pinned_elsewhere(elsewhere, chosen, source, device, warnings)
        stand_in = stand_in and capped == chosen
        chosen = capped

    by_maximum = False
    if namespace_policy.max_limit is not None:
        capped, source = _under_maximum(
            pod.namespace, namespace_policy.max_limit, device_total_bytes, chosen, source,
            unknown=unresolved or bool(pending), errors=errors, warnings=warnings,
        )  # fmt: skip
        by_maximum = capped is not None and capped != chosen
        stand_in = stand_in and capped == chosen  # the maximum bounds the shares too
        chosen = capped

    if chosen is not None and device_total_bytes is not None and chosen > device_total_bytes:
        warnings.append(
            f"limit {format_bytes(chosen)} ({source}) exceeds the device's memory "
            f"{format_bytes(device_total_bytes)}: effectively unlimited"
        )
        chosen, stand_in, by_maximum = None, False, False
    return ResolvedLimit(
        limit_bytes=chosen,
        source=source,
        namespace_max=by_maximum,
        errors=tuple(errors),
        warnings=tuple(warnings),
        declarations=tuple(seen),
        awaits_dra=stand_in,
        containers=_container_limits(seen, chosen, device_total_bytes),
    )


_BOUND_BY: Final[Mapping[LimitSource, BoundBy]] = {
    LimitSource.ANNOTATION: BoundBy.ANNOTATION,
    LimitSource.NAMESPACE_DEFAULT: BoundBy.DEFAULT,
    LimitSource.DEFAULT: BoundBy.DEFAULT,
    LimitSource.REPLICAS: BoundBy.REPLICAS,
    LimitSource.KAI: BoundBy.KAI,
    LimitSource.HAMI: BoundBy.HAMI,
    LimitSource.GPUSHARE: BoundBy.GPUSHARE,
    LimitSource.VOLCANO: BoundBy.VOLCANO,
    LimitSource.DRA: BoundBy.DRA,
}


def bound_by(limit: ResolvedLimit, *, exempt: bool) -> BoundBy:
    """What bounds a pod's memory on the device ``limit`` was resolved for: the declaration that
    bound it (the namespace maximum where that capped it), or ``none`` when no limit applies or
    the pod is ``exempt`` (admin-chosen: nothing gpuguard enforces bounds it). A cluster and a
    namespace default are both ``default``."""
    if exempt or limit.limit_bytes is None or limit.source is None:
        return BoundBy.NONE
    if limit.namespace_max:
        return BoundBy.NAMESPACE_MAX
    return _BOUND_BY[limit.source]


def binding(limit: ResolvedLimit) -> DeclaredLimit | None:
    """The declaration that bound ``limit``: the smallest known of its source's (one source
    may declare several times: KAI's pod-wide value and each container's), the first on a tie;
    ``None`` when no declaration bound it (a default, no limit)."""
    mine = [d for d in limit.declarations if d.source is limit.source]
    if not mine:
        return None
    return min(mine, key=lambda d: (d.limit_bytes is None, d.limit_bytes or 0))


_IN_POD: Final[Mapping[LimitSource, InPodCap]] = {LimitSource.HAMI: InPodCap.HAMI_CORE}


def in_pod_cap(limit: ResolvedLimit, own: ContainerLimit | None = None) -> InPodCap | None:
    """The scheduler's in-pod cap that should have held a violation of ``limit`` (of ``own``,
    a container's own limit, where the container is stopped alone), else ``None``:

    - HAMi's declaration binds: HAMi-core holds each container of a HAMi pod to its own
      ``nvidia.com/gpumem``, so a pod over their sum has a container over its own;
    - a container's own KAI declaration binds: KAI's NvFractions runtime caps that container.

    Never where the namespace maximum, a default, gpuguard's annotation or a declaration no
    in-pod cap enforces (KAI's pod-wide ``gpu-memory`` / ``gpu-fraction``, enforced only in
    KAI's ``HamiCore`` mode, which a pod does not show; gpushare; Volcano; DRA) binds: a
    violation of those says nothing about an in-pod cap."""
    if own is not None and own.source is LimitSource.KAI:
        return InPodCap.KAI_NVFRACTIONS
    if own is not None and own.source is not None:
        return _IN_POD.get(own.source)
    if limit.namespace_max:
        return None
    bound = binding(limit)
    if bound is None:
        return None
    if bound.source is LimitSource.KAI:
        return InPodCap.KAI_NVFRACTIONS if bound.container is not None else None
    return _IN_POD.get(bound.source)


def _under_maximum(
    namespace: str,
    maximum: LimitValue,
    device_total_bytes: int | None,
    chosen: int | None,
    source: LimitSource | None,
    *,
    unknown: bool,
    errors: list[str],
    warnings: list[str],
) -> tuple[int | None, LimitSource | None]:
    """The namespace maximum caps all: annotations and declarations, and a pod with no limit
    at all, also one whose declaration cannot be known yet (``unknown``)."""
    max_bytes = maximum.resolve(device_total_bytes)
    if max_bytes is not None and max_bytes < MIN_LIMIT_BYTES:
        errors.append(_below_minimum(f"maximum of namespace {namespace}", maximum, max_bytes))
    elif max_bytes is None:
        errors.append(f"maximum of namespace {namespace} {_show(maximum)} {_NEEDS_SIZE}")
    elif chosen is not None and chosen > max_bytes:
        warnings.append(
            f"limit {format_bytes(chosen)} ({source}) capped to the maximum of namespace "
            f"{namespace}: {format_bytes(max_bytes)}"
        )
        return max_bytes, source
    elif chosen is None:
        warnings.append(
            f"the limit cannot be known yet: the maximum of namespace {namespace} "
            f"({format_bytes(max_bytes)}) holds the pod meanwhile"
            if unknown
            else f"no annotation or default applies: the maximum of namespace "
            f"{namespace} ({format_bytes(max_bytes)}) is the limit"
        )
        return max_bytes, LimitSource.NAMESPACE_DEFAULT
    return chosen, source


def _declarations(
    pod: Pod,
    policy: LimitPolicy,
    device: GpuDevice | None,
    device_total_bytes: int | None,
    *,
    errors: list[str],
    warnings: list[str],
) -> list[DeclaredLimit]:
    """The valid declarations ``limits.sources`` lists, in its order, resolved on the device;
    an invalid one, or one that resolves below ``MIN_LIMIT_BYTES``, is recorded as an error and
    left out (never "unlimited", never "kill")."""
    seen: list[DeclaredLimit] = []
    pinned: tuple[str, ...]
    for name in policy.sources:
        if name == GPUGUARD_SOURCE:
            value = _valid_annotation(pod, errors)
            if value is None:
                continue
            source, what, pinned = LimitSource.ANNOTATION, f"annotation {LIMIT_ANNOTATION}", ()
        else:
            source = LimitSource(name)
            declaration = pod.declared.get(source)
            if declaration is None:
                continue
            warnings.extend(f"{source}: {w}" for w in declaration.warnings)
            seen.extend(
                _container_declarations(declaration, source, device, device_total_bytes, errors)
            )
            if declaration.error is not None:
                errors.append(
                    f"invalid {source} declaration ({declaration.where}): {declaration.error}; "
                    "ignored (the next source or the admin default applies, if any)"
                )
                continue
            if not declaration.whole_pod:
                continue
            if source is LimitSource.DRA:
                dra = _dra_limit(declaration, device, device_total_bytes)
                if dra is None:
                    continue
                if dra.limit_bytes is not None and dra.limit_bytes < MIN_LIMIT_BYTES:
                    # The scheduler accounted it, but a share this small is an allocation
                    # slip, never a limit that stops every GPU process of the pod.
                    errors.append(
                        f"{dra.what} {dra.value} is below the smallest limit of 1Mi; ignored"
                    )
                    continue
                seen.append(dra)
                continue
            value = _declared_value(declaration, source, policy)
            what = f"{source} declaration ({declaration.where})"
            pinned = tuple(sorted(declaration.pinned))
        resolved = value.resolve(device_total_bytes)
        if resolved is not None and resolved < MIN_LIMIT_BYTES:
            errors.append(_below_minimum(what, value, resolved))
            continue
        seen.append(
            DeclaredLimit(
                source=source,
                what=what,
                value=_show(value),
                limit_bytes=resolved,
                pinned=pinned,
                assigned=_assigned(pinned, device),
            )
        )
    return seen


def _container_declarations(
    declaration: Declaration,
    source: LimitSource,
    device: GpuDevice | None,
    device_total_bytes: int | None,
    errors: list[str],
) -> list[DeclaredLimit]:
    """Each container's own valid declaration, as a cap on the pod too (every declaration is a
    cap, the smallest binds): a container the pod does not have, or a key written for each
    container, never raises what the pod may use. A rejected one is an error, never a limit."""
    found: list[DeclaredLimit] = []
    for declared in declaration.containers:
        what = f"{source} declaration of container {declared.container} ({declared.where})"
        if declared.error is not None:
            errors.append(f"invalid {what}: {declared.error}; ignored")
            continue
        pinned = tuple(sorted(declared.pinned))
        found.append(
            DeclaredLimit(
                source=source,
                what=what,
                value=format_bytes(declared.limit_bytes),
                limit_bytes=declared.limit_bytes,
                pinned=pinned,
                assigned=_assigned(pinned, device),
                container=declared.container,
            )
        )
    return found


def _container_limits(
    seen: list[DeclaredLimit], chosen: int | None, device_total_bytes: int | None
) -> tuple[ContainerLimit, ...]:
    """Each container's own limit on the device: the smallest of its declarations (wherever
    pinned: a pin never lifts one) and the pod's limit. One above the device's memory can
    never be reached and is left out."""
    own: dict[str, DeclaredLimit] = {}
    for d in seen:
        if d.container is None or d.limit_bytes is None:
            continue
        best = own.get(d.container)
        if best is None or best.limit_bytes is None or d.limit_bytes < best.limit_bytes:
            own[d.container] = d
    limits = []
    for name, d in sorted(own.items()):
        assert d.limit_bytes is not None
        limit = ContainerLimit(
            container=name, limit_bytes=d.limit_bytes, what=d.what, value=d.value, source=d.source
        )
        if chosen is not None and chosen < d.limit_bytes:
            limit = ContainerLimit(
                container=name, limit_bytes=chosen, what="the pod's limit",
                value=format_bytes(chosen),
            )  # fmt: skip
        if device_total_bytes is not None and limit.limit_bytes > device_total_bytes:
            continue
        limits.append(limit)
    return tuple(limits)


def _dra_limit(
    declaration: Declaration, device: GpuDevice | None, device_total_bytes: int | None
) -> DeclaredLimit | None:
    """The DRA shares on ``device`` summed (``None`` device, as in ``check-pod``: all shares).

    A share of unknown size (a device allocated whole) is the whole device. A pod with a claim
    not read yet, or a share on a device no ResourceSlice names, has an unknown limit on every
    device (it may be this one): unresolved, never a guess. Shares only on other devices grant
    nothing here and cap nothing (``assigned`` false): the next applicable limit holds the pod.
    """
    what = f"{LimitSource.DRA} declaration ({declaration.where})"
    placed = tuple(sorted({s.uuid for s in declaration.shares if s.uuid is not None}))
    unplaced = [s for s in declaration.shares if s.uuid is None]
    unresolved = declaration.unresolved
    if unresolved is None and unplaced and device is not None:
        names = ", ".join(sorted({f"{s.pool}/{s.device}" for s in unplaced}))
        unresolved = (
            f"device {names} of {LimitSource.DRA} driver {unplaced[0].driver} is in no "
            "ResourceSlice of this node: its GPU is unknown"
        )
    unsure = [s for s in declaration.shares if device is not None and s.may_be_on(device)]
    if unresolved is None and unsure and device is not None:
        unresolved = (
            f"NVML did not give the profile and placement of MIG instance "
            f"{device.gpu_instance_id} of {device.uuid}: whether the share of MIG device "
            f"{unsure[0].pool}/{unsure[0].device} is on it is unknown"
        )
    if unresolved is not None:
        return DeclaredLimit(
            source=LimitSource.DRA, what=what, value="unresolved", limit_bytes=None,
            pinned=placed, unresolved=unresolved, shares=declaration.shares,
            read_at=declaration.read_at,
        )  # fmt: skip
    here = tuple(s for s in declaration.shares if device is None or s.is_on(device))
    if not here:
        if not declaration.shares:
            return None
        return DeclaredLimit(
            source=LimitSource.DRA, what=what, value=f"allocated on {', '.join(placed)}",
            limit_bytes=None, pinned=placed, assigned=False, shares=declaration.shares,
        )  # fmt: skip
    whole = any(s.memory_bytes is None for s in here)
    value = (
        LimitValue(percent=100.0)
        if whole
        else LimitValue(limit_bytes=sum(s.memory_bytes or 0 for s in here))
    )
    return DeclaredLimit(
        source=LimitSource.DRA,
        what=what,
        value=_show(value) if not whole else "the whole device",
        limit_bytes=value.resolve(device_total_bytes),
        pinned=placed,
        shares=here,
        read_at=declaration.read_at,
    )


def _assigned(pinned: tuple[str, ...], device: GpuDevice | None) -> bool:
    """Whether a declaration pinned to ``pinned`` is about ``device`` (unpinned: any device)."""
    if not pinned or device is None:
        return True
    return device.uuid in pinned or f"index:{device.index}" in pinned


def _smallest(
    here: list[DeclaredLimit], errors: list[str], warnings: list[str]
) -> tuple[int | None, LimitSource | None, bool]:
    """The smallest applicable declaration: (bytes, its source, unresolved). The first in
    ``limits.sources`` order wins a tie; each larger one is capped, with a warning."""
    unknown = [d for d in here if d.limit_bytes is None]
    known = [(d.limit_bytes, d) for d in here if d.limit_bytes is not None]
    errors.extend(
        f"{d.what}: {d.unresolved}; no limit until it is known"
        if d.unresolved is not None
        else f"{d.what} {d.value} {_NEEDS_SIZE}"
        for d in unknown
    )
    if unknown:
        if known:
            # Every declaration caps the limit: the smallest known one is an upper bound of the
            # true limit whatever the unknown ones turn out to be, so holding the pod to it can
            # never stop what the true limit allows (and leaves no escape through a declaration
            # the tenant can make unknowable).
            bound, by = min(known, key=lambda pair: pair[0])
            errors.append(
                "the smallest declaration cannot be known: "
                f"{', '.join(d.what for d in unknown)} may be below the {by.what} {by.value} "
                f"({format_bytes(bound)}); held to {format_bytes(bound)} meanwhile"
            )
            return bound, by.source, True
        return None, (unknown[0].source if len(here) == 1 else None), True
    bound, binding = min(known, key=lambda pair: pair[0])
    for limit_bytes, d in known:
        if limit_bytes > bound:
            why = (
                "a pod's own annotation never raises what a scheduler declared for it"
                if d.source is LimitSource.ANNOTATION
                else "every declaration caps the limit and the smallest binds"
            )
            warnings.append(
                f"{d.what} {d.value} ({format_bytes(limit_bytes)}) capped by the "
                f"{binding.what} {binding.value} ({format_bytes(bound)}): {why}"
            )
    return bound, binding.source, False


def _defaults(
    pod: Pod,
    namespace_policy: NamespacePolicy,
    device_total_bytes: int | None,
    policy: LimitPolicy,
    *,
    replicas: int | None,
    errors: list[str],
) -> tuple[int | None, LimitSource | None, bool]:
    """The admin's default when no declaration applies: (bytes, source, unresolved)."""
    candidates: tuple[tuple[LimitValue | None, LimitSource, str], ...] = (
        (
            namespace_policy.default_limit,
            LimitSource.NAMESPACE_DEFAULT,
            f"default of namespace {pod.namespace}",
        ),
        (policy.cluster_default, LimitSource.DEFAULT, "cluster default"),
    )
    for value, source, what in candidates:
        if value is None:
            continue
        resolved = value.resolve(device_total_bytes)
        if resolved is not None and resolved < MIN_LIMIT_BYTES:
            # Never a limit: fall through to the next source, as for an invalid annotation.
            errors.append(_below_minimum(what, value, resolved))
            continue
        if resolved is None:
            errors.append(f"{what} {_show(value)} {_NEEDS_SIZE}")
            return None, source, True
        return resolved, source, False
    if policy.replicas_default and replicas is not None and replicas >= 2:
        chosen = _replicas_default(device_total_bytes, policy, replicas, errors)
        return chosen, LimitSource.REPLICAS, chosen is None
    return None, None, False


def _pinned_elsewhere(
    elsewhere: list[DeclaredLimit],
    chosen: int | None,
    source: LimitSource | None,
    device: GpuDevice | None,
    warnings: list[str],
) -> tuple[int | None, LimitSource | None]:
    """Declarations pinned to other devices grant nothing here but still cap: a forged pin
    (pod metadata) must never lift what the pod declared, nor leave it unlimited."""
    known = [
        (d.limit_bytes, d)
        for d in elsewhere
        if d.limit_bytes is not None and d.source is not LimitSource.DRA
    ]
    if not known:
        return chosen, source
    cap, by = min(known, key=lambda pair: pair[0])
    where = "this device" if device is None else f"GPU {device.index} ({device.uuid})"
    pins = ", ".join(by.pinned)
    if chosen is None:
        warnings.append(
            f"{where} is not the one {by.source} assigned the pod ({pins}) and no other limit "
            f"applies here: its {by.what} {by.value} holds here too (a pin never lifts a "
            "declaration)"
        )
        return cap, by.source
    if cap < chosen:
        warnings.append(
            f"limit {format_bytes(chosen)} ({source}) on {where} capped by the {by.what} "
            f"{by.value}, pinned to {pins}: a pin never lifts a declaration"
        )
        return cap, by.source
    return chosen, source


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
        # A wiring bug (the pod was built without kubemodel.quantity.parse_limit). Say so rather
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
    only from admin config (docs/design.md, Safety invariants).
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
