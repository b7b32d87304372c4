"""The enforcer's Node condition: ``GPUMemoryEnforced`` on its own Node (docs/design.md, Node
condition).

Owns what the condition says after each cycle: ``True``/``Enforcing`` only while this enforcer
holds the node lock, is ready and acts in enforce mode; else ``False`` with the first reason
that applies, in this order: ``LockHeldElsewhere``, ``NvmlUnavailable``, ``NotReady``,
``AuditMode``. The message carries gpuguard's own reason text (never a pod's or a tenant's),
bounded. Pure: no I/O, clock or logging; the writer (``ports.NodeConditionWriter``) decides when
to send it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gpuguard.core.model import Mode, RefusalReason
from gpuguard.core.policy import Decision, Refusal

CONDITION_TYPE = "GPUMemoryEnforced"
MAX_MESSAGE_CHARS = 256
"""Enough for a reason and its detail; a Node's conditions are read by every ``kubectl
describe node`` and every Node watcher, so each byte is paid for cluster-wide."""


class ConditionReason(enum.StrEnum):
    """The condition's ``reason``: a closed set, which the admission fence checks too."""

    ENFORCING = "Enforcing"
    AUDIT_MODE = "AuditMode"
    NOT_READY = "NotReady"
    NVML_UNAVAILABLE = "NvmlUnavailable"
    LOCK_HELD_ELSEWHERE = "LockHeldElsewhere"


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeCondition:
    """What ``GPUMemoryEnforced`` says: ``status`` True only with ``Enforcing``."""

    status: bool
    reason: ConditionReason
    message: str


def stopped_condition() -> NodeCondition:
    """What an enforcer that stops writes last: it enforces nothing any more."""
    return NodeCondition(status=False, reason=ConditionReason.NOT_READY, message="enforcer stopped")


def node_condition(
    decision: Decision,
    *,
    mode: Mode,
    standby: Refusal | None = None,
    blocked: Refusal | None = None,
) -> NodeCondition:
    """The condition after one cycle.

    Args:
        decision: The cycle's decision: ``enforcement_active``, and ``inactive_reason`` when
            not: ``data_stale`` means no fresh GPU sample (NVML cannot be read, or its reads
            hang, or its handle is lost), which is ``NvmlUnavailable``; any other reason (the
            pod cache unsynced or stale) is ``NotReady``.
        mode: The admin's global mode (``enforcement.mode``).
        standby: Set while another enforcer holds the node lock (its detail names the lock).
        blocked: Set while no signal can be sent at all (outside the host PID namespace, or
            without ``CAP_KILL``).
    """
    if standby is not None:
        return _false(
            ConditionReason.LOCK_HELD_ELSEWHERE, f"another enforcer acts: {standby.detail}"
        )
    inactive_reason = decision.inactive_reason
    active = decision.enforcement_active
    if inactive_reason is RefusalReason.DATA_STALE:
        return _false(
            ConditionReason.NVML_UNAVAILABLE,
            "no fresh GPU sample (NVML cannot be read): enforcing nothing",
        )
    if not active:
        why = str(inactive_reason) if inactive_reason is not None else "not active"
        return _false(ConditionReason.NOT_READY, f"{why}: enforcing nothing")
    if blocked is not None:
        return _false(
            ConditionReason.NOT_READY,
            f"cannot signal ({blocked.reason.value}: {blocked.detail}): enforcing nothing",
        )
    if mode is Mode.AUDIT:
        return _false(
            ConditionReason.AUDIT_MODE, "audit mode: violations are reported, nothing is stopped"
        )
    return NodeCondition(
        status=True,
        reason=ConditionReason.ENFORCING,
        message="enforcing GPU memory limits on this node",
    )


def _false(reason: ConditionReason, message: str) -> NodeCondition:
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 1] + "…"
    return NodeCondition(status=False, reason=reason, message=message)
