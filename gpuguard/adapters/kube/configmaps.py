"""One ConfigMap, by namespace and name, kept by a reflector: its data and resourceVersion.

Owns ``ConfigMapWatch``: a list + watch of ``metadata.name=<name>`` in one namespace (what RBAC
with ``resourceNames`` allows), in a daemon thread with its own stop, so the agent can follow
the ConfigMaps its sharing config names and drop one when the config stops naming it. Must not
interpret the data (``adapters.sharing_documents`` does), and never blocks ``current()``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from gpuguard.adapters.kube.reflector import Reflector, raw
from gpuguard.errors import GpuguardError
from gpuguard.ports import HealthRecorder


@dataclass(frozen=True, slots=True, kw_only=True)
class ConfigMapState:
    """What is known of one ConfigMap."""

    synced: bool = False
    """The first list answered (with the ConfigMap or without it)."""
    data: Mapping[str, Any] | None = None
    """Its ``data``; ``None`` when it does not exist."""
    version: str = ""
    """Its ``metadata.resourceVersion`` (``""`` when it does not exist)."""
    problem: GpuguardError | None = field(default=None, compare=False)


class ConfigMapWatch:
    """``namespace/name`` from the API server; ``on_change`` is called after every change."""

    def __init__(
        self,
        core: Any,
        *,
        namespace: str,
        name: str,
        on_change: Callable[[], None],
        health: HealthRecorder | None,
        **timeouts: Any,
    ) -> None:
        self.namespace = namespace
        self.name = name
        self._on_change = on_change
        self._lock = threading.Lock()
        self._state = ConfigMapState()
        self._stop = threading.Event()
        self._reflector = Reflector(
            name=f"configmap {namespace}/{name}",
            call=functools.partial(core.list_namespaced_config_map, namespace),
            field_selector=f"metadata.name={name}",
            resource="configmaps",
            scope=f"namespace {namespace!r}",
            translate=raw,
            on_replace=self._replace,
            on_event=self._event,
            on_contact=lambda: None,
            on_problem=self._problem,
            stop_event=self._stop,
            health=health,
            **timeouts,
        )
        self._thread = self._reflector.thread(f"gpuguard-kube-cm-{namespace}/{name}")

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._reflector.interrupt()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def current(self) -> ConfigMapState:
        with self._lock:
            return self._state

    def _set(self, obj: Mapping[str, Any] | None) -> None:
        data: Mapping[str, Any] | None = None
        version = ""
        if obj is not None:
            raw = obj.get("data")
            data = MappingProxyType(dict(raw) if isinstance(raw, Mapping) else {})
            meta = obj.get("metadata")
            rv = meta.get("resourceVersion") if isinstance(meta, Mapping) else None
            version = rv if isinstance(rv, str) else ""
        with self._lock:
            self._state = ConfigMapState(
                synced=True, data=data, version=version, problem=self._state.problem
            )
        self._on_change()

    def _replace(self, items: list[dict[str, Any]]) -> None:
        self._set(items[0] if items else None)

    def _event(self, kind: str, obj: dict[str, Any]) -> None:
        self._set(None if kind == "DELETED" else obj)

    def _problem(self, problem: GpuguardError | None) -> None:
        with self._lock:
            self._state = ConfigMapState(
                synced=self._state.synced,
                data=self._state.data,
                version=self._state.version,
                problem=problem,
            )
