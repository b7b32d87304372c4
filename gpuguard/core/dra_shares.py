"""The DRA shares behind a pod's limit on one device, in one stable order.

Owns which shares a per-pod metric series, ``explain`` and ``inspect`` name for a pod on a
device: those of its ``dra`` declaration there (``DeclaredLimit.shares``) allocated on that very
device, sorted by claim namespace, claim name and request (then driver, pool, device and share
ID, so the order is total). The metrics' ``dra_*`` labels take the first (docs/design.md,
Metrics). Pure: it reads a ``ResolvedLimit``; it decides no limit and names no share a claim
did not allocate there.
"""

from __future__ import annotations

from gpuguard.core.model import DraShare, LimitSource, ResolvedLimit


def shares_on_device(limit: ResolvedLimit, device: str | None) -> tuple[DraShare, ...]:
    """The shares of ``limit``'s assigned ``dra`` declaration whose device is ``device`` (its
    GPU UUID), in ``share_order``; ``device`` ``None`` (no device known, as ``explain`` of a PID
    NVML does not list): all of them. Empty when DRA allocated the pod nothing there, or when
    ``dra`` is not among the declarations weighed (not in ``limits.sources``)."""
    found = [
        share
        for declared in limit.declarations
        if declared.source is LimitSource.DRA and declared.assigned
        for share in declared.shares
        if device is None or share.uuid == device
    ]
    return tuple(sorted(found, key=share_order))


def share_order(share: DraShare) -> tuple[str, str, str, str, str, str, str]:
    """Claim namespace, claim name, request, then driver, pool, device and share ID."""
    return (
        share.claim_namespace,
        share.claim_name,
        share.request,
        share.driver,
        share.pool,
        share.device,
        share.share_id or "",
    )
