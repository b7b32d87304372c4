"""The namespaces that exempt their pods by the admin's label, and the start check of the names
the admin exempts.

Owns ``NamespaceLabels``: a reflector of the Namespaces that carry the admin's exempt label
(``limits.exempt_namespace_label``, a ``labelSelector`` ``key=value``, so only those travel), kept
as their names alone (never the objects), with the time of the last answer; and
``check_exempt_names``: at start, one list per name of ``limits.exempt_namespaces`` (by
``fieldSelector metadata.name``), logging the names that do not exist (anyone who may create
namespaces could create one and be exempt) and those whose Namespace says a tenant made it.
Must not decide what an exemption is (``core.limits.is_exempt``) or when labels are too old
(``core.policy``), and never blocks ``view()``.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable, Collection, Mapping
from typing import Any

import structlog

from gpuguard.adapters.kube.errors import translate_error
from gpuguard.adapters.kube.reflector import Reflector, raw
from gpuguard.core.text import printable
from gpuguard.errors import GpuguardError
from gpuguard.kubemodel.translate import labelled_namespace
from gpuguard.ports import Clock, HealthRecorder

log = structlog.get_logger(__name__)

TENANT_MARKS: tuple[tuple[str, str], ...] = (
    ("annotations", "openshift.io/requester"),
    ("labels", "capsule.clastix.io/tenant"),
    ("annotations", "hnc.x-k8s.io/subnamespace-of"),
)
"""Where a Namespace says a tenant made it: OpenShift sets ``openshift.io/requester`` on a
project a user requested (``oc new-project``), Capsule labels its tenants' namespaces with
their tenant, HNC annotates a self-service subnamespace with its parent."""


class NamespaceLabels:
    """The names of the Namespaces that carry ``label`` (``key``, ``value``), from a list +
    watch by label selector. ``view()`` is ``(None, None)`` until the first list answered."""

    def __init__(self, label: tuple[str, str], *, clock: Clock) -> None:
        self._key, self._value = label
        self._clock = clock
        self._lock = threading.Lock()
        self._names: frozenset[str] | None = None
        self._contact: float | None = None

    @property
    def selector(self) -> str:
        return f"{self._key}={self._value}"

    def view(self) -> tuple[frozenset[str] | None, float | None]:
        """The labelled names (``None``: not listed yet) and when the API server last answered
        this watch (monotonic seconds)."""
        with self._lock:
            return self._names, self._contact

    def replace(self, items: list[dict[str, Any]]) -> None:
        names = frozenset(
            name
            for obj in items
            if (name := labelled_namespace(obj, self._key, self._value)) is not None
        )
        with self._lock:
            first = self._names is None
            self._names = names
        log.info("kube_exempt_namespaces_listed", label=self.selector, namespaces=sorted(names),
                 first=first)  # fmt: skip

    def apply(self, kind: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata")
        name = meta.get("name") if isinstance(meta, Mapping) else None
        if not isinstance(name, str):
            return
        # The label removed shows as DELETED on a watch by label selector; checked again here
        # all the same, so a namespace is exempt only while it carries the label.
        keep = kind != "DELETED" and labelled_namespace(obj, self._key, self._value) is not None
        with self._lock:
            names = set(self._names or ())
            changed = (name in names) != keep
            if keep:
                names.add(name)
            else:
                names.discard(name)
            self._names = frozenset(names)
        if changed:
            log.info("namespace_exemption_changed", namespace=name, exempt=keep,
                     label=self.selector)  # fmt: skip

    def contact(self) -> None:
        now = self._clock.monotonic()
        with self._lock:
            self._contact = now

    def reflector(
        self,
        *,
        call: Callable[..., Any],
        on_problem: Callable[[GpuguardError | None], None],
        stop_event: threading.Event,
        health: HealthRecorder | None,
        **timeouts: Any,
    ) -> Reflector[dict[str, Any]]:
        """The list + watch of the labelled Namespaces (``call``: ``CoreV1Api.list_namespace``).
        Its answers are its own contact: a pod watch that works says nothing about this one."""
        return Reflector(
            name="namespaces",
            call=call,
            field_selector=None,
            label_selector=self.selector,
            resource="namespaces",
            scope="cluster scope",
            translate=raw,
            on_replace=self.replace,
            on_event=self.apply,
            on_contact=self.contact,
            on_problem=on_problem,
            stop_event=stop_event,
            health=health,
            **timeouts,
        )


def check_exempt_names(
    core: Any, names: Collection[str], *, timeout_seconds: float
) -> tuple[list[str], dict[str, str]]:
    """The names of ``names`` with no Namespace, and those whose Namespace carries a tenant's
    mark (name → the mark). One list by ``metadata.name`` each; raises ``GpuguardError`` when
    one cannot be read."""
    missing: list[str] = []
    marked: dict[str, str] = {}
    for name in sorted(names):
        try:
            resp = core.list_namespace(
                field_selector=f"metadata.name={name}",
                _preload_content=False,
                _request_timeout=timeout_seconds,
            )
            body = json.loads(resp.data)
            resp.release_conn()
        except Exception as exc:
            err = translate_error(exc, verb="list", resource="namespaces", scope="cluster scope")
            if isinstance(err, GpuguardError):
                raise err from exc
            raise GpuguardError(f"list namespaces (cluster scope): {exc!r}") from exc
        items = body.get("items") if isinstance(body, dict) else None
        found = items[0] if isinstance(items, list) and items else None
        if not isinstance(found, Mapping):
            missing.append(name)
            continue
        mark = _tenant_mark(found)
        if mark is not None:
            marked[name] = mark
    return missing, marked


def _tenant_mark(obj: Mapping[str, Any]) -> str | None:
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping):
        return None
    for where, key in TENANT_MARKS:
        table = meta.get(where)
        value = table.get(key) if isinstance(table, Mapping) else None
        if isinstance(value, str):
            return f"{where[:-1]} {key}={printable(value[:64])}"
    return None


def log_exempt_names(
    core: Any, names: Collection[str], *, timeout_seconds: float, label: str | None
) -> None:
    """``check_exempt_names``, logged: ``exempt_namespaces_missing`` and
    ``exempt_namespaces_tenant_made`` (warnings), or ``exempt_namespaces_unchecked`` when the
    API server could not tell. Never raises: the check informs, it decides nothing."""
    instead = (
        f"label the namespaces to exempt {label} instead"
        if label is not None
        else "exempt NVIDIA's namespaces by an admin-set label instead "
        "(limits.exempt_namespace_label)"
    )
    try:
        missing, marked = check_exempt_names(core, names, timeout_seconds=timeout_seconds)
    except GpuguardError as exc:
        log.warning("exempt_namespaces_unchecked", names=sorted(names), error=str(exc))
        return
    if missing:
        log.warning(
            "exempt_namespaces_missing",
            names=missing,
            detail="limits.exempt_namespaces lists namespaces that do not exist: whoever may "
            "create namespaces (oc new-project, Capsule, Rancher, HNC) can create one of these "
            f"names and have its pods never stopped; remove them, or {instead}",
        )
    if marked:
        log.warning(
            "exempt_namespaces_tenant_made",
            names=sorted(marked),
            marks=marked,
            detail="limits.exempt_namespaces lists namespaces a tenant made (their Namespace "
            f"carries a tenant's mark): their pods are never stopped; remove them, or {instead}",
        )


def exempt_names_thread(
    core: Any, names: Collection[str], *, timeout_seconds: float, label: str | None
) -> threading.Thread:
    """A daemon thread (not started) running ``log_exempt_names`` once."""
    return threading.Thread(
        target=functools.partial(
            log_exempt_names, core, names, timeout_seconds=timeout_seconds, label=label
        ),
        name="gpuguard-kube-exempt-names",
        daemon=True,
    )
