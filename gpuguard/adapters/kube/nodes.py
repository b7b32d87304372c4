"""This node's own Node object, kept by a reflector: the facts gpuguard reads from its labels.

Owns ``NodeView`` (``ports.NodeState``: time-slicing replicas, the MIG config state, whether the
Node was read yet) and the reflector that feeds it. The labels mean what
``kubemodel.translate`` says.
Must not decide anything (the MIG pause is the runtime's), and never blocks ``node()``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from gpuguard.adapters.kube.reflector import Reflector, raw
from gpuguard.core.model import NodeFacts
from gpuguard.errors import GpuguardError
from gpuguard.kubemodel.translate import node_facts_from_json
from gpuguard.ports import HealthRecorder


class NodeView:
    """``ports.NodeState`` over the Node list + watch of one node.

    ``node().seen`` turns true once the Node list answered (with the Node, or without it: then
    it has no labels); before that every fact is unknown.
    """

    def __init__(self, node_name: str) -> None:
        self.node_name = node_name
        self._lock = threading.Lock()
        self._facts = NodeFacts(name=node_name, seen=False)
        self.synced = threading.Event()
        """Set when the first Node list answered."""

    def node(self) -> NodeFacts:
        with self._lock:
            return self._facts

    def replace(self, items: list[dict[str, Any]]) -> None:
        facts = node_facts_from_json(items[0] if items else None, name=self.node_name)
        with self._lock:
            self._facts = facts
        self.synced.set()

    def apply(self, kind: str, obj: dict[str, Any]) -> None:
        facts = node_facts_from_json(None if kind == "DELETED" else obj, name=self.node_name)
        with self._lock:
            self._facts = facts

    def reflector(
        self,
        *,
        call: Callable[..., Any],
        on_problem: Callable[[GpuguardError | None], None],
        stop_event: threading.Event,
        health: HealthRecorder | None,
        **timeouts: Any,
    ) -> Reflector[dict[str, Any]]:
        """The list + watch of this Node (``call``: ``CoreV1Api.list_node``). Freshness is about
        pods only, so a Node answer is no contact."""
        return Reflector(
            name="node",
            call=call,
            field_selector=f"metadata.name={self.node_name}",
            resource="nodes",
            scope="cluster scope",
            translate=raw,
            on_replace=self.replace,
            on_event=self.apply,
            on_contact=lambda: None,
            on_problem=on_problem,
            stop_event=stop_event,
            health=health,
            **timeouts,
        )
