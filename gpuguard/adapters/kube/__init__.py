"""Kubernetes adapter: this node's pods and Node (list + watch), Events on pods and the Node,
and the sharing agent's reads and writes.

Owns everything that talks to the API server through the ``kubernetes`` client, one job a module:

- ``errors``: the one table from HTTP status / client exception to gpuguard error and decision;
- ``client``: the API client, from a kubeconfig or in-cluster (``load_api_client``);
- ``retry``: the one retry loop of the project (tenacity);
- ``reflector``: a generic list + watch in a thread;
- ``pods``: ``KubePodDirectory`` (``ports.PodDirectory``, ``NodeState``, ``Lifecycle``);
- ``nodes``: this node's Node facts, for the directory;
- ``configmaps``: one ConfigMap by name (list + watch), with its own stop;
- ``reads``: one-shot reads for ``check-sharing --kubeconfig`` (a ConfigMap, every Node's
  labels);
- ``agent``: ``KubeSharingSource`` (``ports.SharingSource``) and ``KubeNodeWriter``
  (``ports.NodeWriter``: the conditional Node merge patch, the Eviction API);
- ``events``: ``KubeEventSink`` (``ports.EventSink``, ``ports.NodeEventSink``, ``Lifecycle``).

What an object means (JSON → ``core.model``, the quantity grammar, DRA claims) is
``gpuguard.kubemodel``'s, pure and shared with the pods file, ``check-pod`` and the simulator;
this package reads the objects and hands them to it. Nothing above this package sees
``ApiException``, ``V1Pod`` or a raw dict. Importing the package does not import the
``kubernetes`` client: the names re-exported from the modules that need it load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuguard.adapters.kube.client import load_api_client
    from gpuguard.adapters.kube.events import KubeEventSink
    from gpuguard.adapters.kube.pods import KubePodDirectory

__all__ = ["KubeEventSink", "KubePodDirectory", "load_api_client"]

_LAZY = {"KubeEventSink": "events", "KubePodDirectory": "pods", "load_api_client": "client"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
