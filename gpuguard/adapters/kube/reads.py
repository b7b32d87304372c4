"""One-shot reads for ``gpuguard check-sharing --kubeconfig``: the NVIDIA ConfigMaps a sharing
config names, and every Node's name and labels.

Owns ``read_config_map`` (the list the agent's ``ConfigMapWatch`` makes, ``fieldSelector
metadata.name=<name>`` in one namespace, so a reader with the agent's RBAC gets the agent's
answer) and ``list_node_labels`` (paged, bounded). One attempt each, no retry: a command tells
the user at once. Failures leave as gpuguard errors (``KubeForbidden`` for a 403). Must not
interpret ConfigMap data (``adapters.sharing_documents`` does) or decide anything.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from kubernetes import client as k8s

from gpuguard.adapters.kube.configmaps import ConfigMapState
from gpuguard.adapters.kube.errors import translate_error
from gpuguard.core.sharing import NodeLabels
from gpuguard.errors import GpuguardError

NODE_PAGE = 500
"""Nodes per list request (the API server's pagination)."""


def read_config_map(
    api: k8s.ApiClient, *, namespace: str, name: str, timeout_seconds: float = 10.0
) -> ConfigMapState:
    """``namespace/name`` as the API server has it now: its data, or ``data=None`` when it does
    not exist (a namespace that does not exist holds none)."""
    core: Any = k8s.CoreV1Api(api)
    scope = f"namespace {namespace!r}"
    body = _list(
        functools.partial(
            core.list_namespaced_config_map,
            namespace,
            field_selector=f"metadata.name={name}",
            _preload_content=False,
            _request_timeout=timeout_seconds,
        ),
        "configmaps",
        scope,
    )
    items = body.get("items")
    found = items[0] if isinstance(items, list) and items else None
    if not isinstance(found, dict):
        return ConfigMapState(synced=True)
    data = found.get("data")
    meta = found.get("metadata")
    version = meta.get("resourceVersion") if isinstance(meta, dict) else None
    return ConfigMapState(
        synced=True,
        data=dict(data) if isinstance(data, dict) else {},
        version=version if isinstance(version, str) else "",
    )


def list_node_labels(
    api: k8s.ApiClient, *, most: int, timeout_seconds: float = 30.0
) -> list[NodeLabels]:
    """Every Node's name and labels (label values that are not strings dropped). Raises
    ``GpuguardError`` when the cluster has more than ``most`` Nodes."""
    core: Any = k8s.CoreV1Api(api)
    nodes: list[NodeLabels] = []
    token: str | None = None
    while True:
        body = _list(
            functools.partial(
                core.list_node,
                limit=NODE_PAGE,
                _continue=token,
                _preload_content=False,
                _request_timeout=timeout_seconds,
            ),
            "nodes",
            "cluster scope",
        )
        items = body.get("items")
        for item in items if isinstance(items, list) else ():
            meta = item.get("metadata") if isinstance(item, dict) else None
            name = meta.get("name") if isinstance(meta, dict) else None
            if not isinstance(name, str) or not isinstance(meta, dict):
                continue
            raw = meta.get("labels")
            labels = {
                k: v
                for k, v in (raw.items() if isinstance(raw, dict) else ())
                if isinstance(k, str) and isinstance(v, str)
            }
            nodes.append(NodeLabels(name=name, labels=labels))
        if len(nodes) > most:
            raise GpuguardError(f"list nodes: more than {most} Nodes")
        meta = body.get("metadata")
        token = meta.get("continue") if isinstance(meta, dict) else None
        if not token:
            return nodes


def _list(call: Callable[[], Any], resource: str, scope: str) -> dict[str, Any]:
    try:
        resp = call()
        body = json.loads(resp.data)
        resp.release_conn()
    except Exception as exc:
        err = translate_error(exc, verb="list", resource=resource, scope=scope)
        if isinstance(err, GpuguardError):
            raise err from exc
        raise GpuguardError(f"list {resource} ({scope}): {exc!r}") from exc
    return body if isinstance(body, dict) else {}
