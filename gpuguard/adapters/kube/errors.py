"""The one error table of the Kubernetes adapter: HTTP status or client exception → gpuguard error
class → what to do about it.

Owns the classification: every caller (the list, the watch and its ``ERROR`` events, the Event
sink) turns a failure into a gpuguard error through ``translate_error`` / ``status_error`` and
asks ``decision`` what it means; no other module looks at a status code. Must not retry, sleep or
log (that is ``retry``), and lets an exception that is not a Kubernetes failure (a bug, a stop)
pass through untouched.

The policy, for a node agent that must neither crash-loop nor hide a problem:

- ``RETRY``: the next attempt may work (no answer, 401 while a token rotates, 408, 429, 5xx).
- ``REPORT``: the API server will give the same answer again (403 RBAC, 404, 422, any other 4xx):
  it is the source's ``problem()``; a list/watch keeps retrying on a slow ladder (RBAC can be
  fixed while the agent runs), a single request (an Event) is given up and counted as dropped.
- ``RELIST``: 410 Gone, the resourceVersion or continue token is too old: list again.
- ``DONE``: 409 AlreadyExists on a create: an earlier attempt of the same object got through.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass

import urllib3
from kubernetes import client as k8s

from gpuguard.errors import GpuguardError, KubeError, KubeForbidden, PermanentError, TransientError

RBAC_HINT = (
    "installed with the chart: re-run its `helm upgrade --install` (docs/install.md), which "
    "restores gpuguard's RBAC; with plain manifests: apply manifests/rbac.yaml; with your own "
    "kubeconfig: ask for read access to what is named here"
)


class Decision(enum.Enum):
    """What a failure means for the request that got it (see the module docstring)."""

    RETRY = "retry"
    REPORT = "report"
    RELIST = "relist"
    DONE = "done"


class KubeRejected(PermanentError):
    """The API server refused a request and will refuse it again (404, 422, another 4xx)."""


class ResourceExpired(TransientError):
    """``410 Gone``: the resourceVersion (or a list's continue token) is too old; list again."""


class AlreadyExists(GpuguardError):
    """``409`` on a create: the object exists (an earlier attempt whose answer was lost)."""


class KubeSilent(KubeError):
    """The API server sent nothing within the read timeout (a half-open connection, F4)."""


class RetryAfter(KubeError):
    """A retryable answer that named its own wait (429/503 ``Retry-After``)."""

    def __init__(self, message: str, retry_after_seconds: float) -> None:
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds


@dataclass(frozen=True, slots=True, kw_only=True)
class Rule:
    """One row of the table: the gpuguard error, the decision, and the restart reason counted
    by ``HealthRecorder.count_watch_restart`` when a list/watch restarts on it."""

    error: type[GpuguardError]
    decision: Decision
    restart: str
    says: str = ""
    """What the status means, in the error's message (empty: the API server's message only)."""


_UNREACHABLE = Rule(
    error=KubeError, decision=Decision.RETRY, restart="error", says="cannot reach the API server"
)
_TRANSIENT = Rule(error=KubeError, decision=Decision.RETRY, restart="error")
_REJECTED = Rule(error=KubeRejected, decision=Decision.REPORT, restart="error")

STATUS_RULES: Mapping[int, Rule] = {
    0: _UNREACHABLE,  # the client got no HTTP answer (TLS failure, connection refused)
    401: Rule(
        error=KubeError,
        decision=Decision.RETRY,
        restart="error",
        says="unauthorized (token expired or rotated?)",
    ),
    403: Rule(error=KubeForbidden, decision=Decision.REPORT, restart="error"),
    404: _REJECTED,
    408: _TRANSIENT,
    409: Rule(error=AlreadyExists, decision=Decision.DONE, restart="error"),
    410: Rule(error=ResourceExpired, decision=Decision.RELIST, restart="expired"),
    422: _REJECTED,
    429: _TRANSIENT,
}
"""The statuses with a rule of their own. Any other: 5xx → ``_TRANSIENT``, 4xx → ``_REJECTED``."""

EXCEPTION_RULES: tuple[tuple[type[BaseException], Rule], ...] = (
    (
        urllib3.exceptions.ReadTimeoutError,
        Rule(error=KubeSilent, decision=Decision.RETRY, restart="inactivity"),
    ),
    (urllib3.exceptions.HTTPError, _TRANSIENT),  # connection refused or reset, protocol errors
    (OSError, _TRANSIENT),
    (ValueError, _TRANSIENT),  # an answer that is not the JSON it should be
)
"""Client exceptions without an HTTP status, first match wins."""


def rule_for_status(status: int) -> Rule:
    rule = STATUS_RULES.get(status)
    if rule is not None:
        return rule
    if 400 <= status < 500:
        return _REJECTED
    return _TRANSIENT


def _decisions() -> dict[type[BaseException], Rule]:
    by_class: dict[type[BaseException], Rule] = {RetryAfter: _TRANSIENT}
    for rule in (*STATUS_RULES.values(), *(r for _, r in EXCEPTION_RULES), _REJECTED):
        known = by_class.setdefault(rule.error, rule)
        if (known.decision, known.restart) != (rule.decision, rule.restart):
            raise AssertionError(f"{rule.error.__name__} has two decisions in the error table")
    return by_class


_BY_CLASS = _decisions()


def _rule_of(error: BaseException) -> Rule | None:
    for cls in type(error).__mro__:
        rule = _BY_CLASS.get(cls)
        if rule is not None:
            return rule
    return None


def decision(error: BaseException) -> Decision | None:
    """The table's decision for an error ``translate_error`` made; ``None`` for anything else
    (a stop, a bug): the caller lets it propagate."""
    rule = _rule_of(error)
    return None if rule is None else rule.decision


def restart_reason(error: BaseException) -> str:
    """``expired``, ``inactivity`` or ``error``: why a list/watch restarts on ``error``."""
    rule = _rule_of(error)
    return "error" if rule is None else rule.restart


def status_error(
    status: int,
    message: str,
    *,
    verb: str,
    resource: str,
    scope: str,
    retry_after_seconds: float | None = None,
) -> GpuguardError:
    """The gpuguard error for an HTTP status (of a response, or of a watch's ``ERROR`` event)."""
    rule = rule_for_status(status)
    if rule.error is KubeForbidden:
        return KubeForbidden(
            f"RBAC: the credentials in use cannot {verb!r} {resource!r} at {scope}; "
            f"{RBAC_HINT} (API server: {message})"
        )
    what = f"{verb} {resource} ({scope})"
    if status == 0:
        return rule.error(f"{what}: {rule.says}: {message}")
    text = f"{what}: {rule.says}: {message}" if rule.says else f"{what}: HTTP {status}: {message}"
    if retry_after_seconds is not None and rule.decision is Decision.RETRY:
        return RetryAfter(text, retry_after_seconds)
    return rule.error(text)


def translate_error(exc: BaseException, *, verb: str, resource: str, scope: str) -> BaseException:
    """The gpuguard error for a client exception; anything else is returned as it is."""
    if isinstance(exc, GpuguardError):
        return exc  # already translated (raised again through a retried call)
    if isinstance(exc, k8s.ApiException):
        status = int(getattr(exc, "status", 0) or 0)
        return status_error(
            status,
            _status_message(exc),
            verb=verb,
            resource=resource,
            scope=scope,
            retry_after_seconds=_retry_after(exc) if status in (429, 503) else None,
        )
    for kind, rule in EXCEPTION_RULES:
        if isinstance(exc, kind):
            return rule.error(f"{verb} {resource} ({scope}): {type(exc).__name__}: {exc}")
    return exc


def _status_message(exc: k8s.ApiException) -> str:
    body = getattr(exc, "body", None)
    if body:
        try:
            text = body.decode() if isinstance(body, bytes) else str(body)
            message = json.loads(text).get("message")
            if isinstance(message, str) and message:
                return message
        except (ValueError, AttributeError):
            pass
    return str(getattr(exc, "reason", "") or "")


def _retry_after(exc: k8s.ApiException) -> float | None:
    headers = getattr(exc, "headers", None) or {}
    value = headers.get("Retry-After") if hasattr(headers, "get") else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
