"""A pod directory read from a file of Pod manifests, for nodes tested without an API server.

Owns ``FilePodDirectory``: the same ``ports.PodDirectory`` as the API server's, fed from a YAML
file (a ``kind: List``, a multi-document stream, or ``kubectl get pods -o yaml`` output) that is
re-read when it changes. Used by GPU end-to-end runs and offline debugging; never in a cluster.
Translation of each object is ``adapters.kube.pod_from_json``, so both directories agree.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from gpuguard.adapters.kube import pod_from_json
from gpuguard.core.model import NodeFacts, Pod, PodSnapshot, PodUid
from gpuguard.errors import ConfigError
from gpuguard.ports import Clock


class FilePodDirectory:
    """``ports.PodDirectory`` over a manifest file; every successful read counts as contact."""

    def __init__(
        self, path: Path, *, node_name: str, clock: Clock, replicas: int | None = None
    ) -> None:
        self._path = path
        self._node = node_name
        self._clock = clock
        self._replicas = replicas
        self._lock = threading.Lock()
        self._mtime_ns: int | None = None
        self._pods: Mapping[PodUid, Pod] = {}
        self.reload()

    def reload(self) -> None:
        """Re-read the file if it changed. Raises ``ConfigError`` naming the file on bad YAML."""
        try:
            mtime = self._path.stat().st_mtime_ns
        except OSError as exc:
            raise ConfigError([f"{self._path}: cannot read pods file ({exc.strerror})"]) from exc
        if mtime == self._mtime_ns:
            return
        try:
            documents = list(yaml.safe_load_all(self._path.read_text(encoding="utf-8")))
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError([f"{self._path}: not valid YAML: {exc}"]) from exc
        pods: dict[PodUid, Pod] = {}
        for obj in _objects(documents):
            node = (obj.get("spec") or {}).get("nodeName")
            if node not in (None, self._node):
                continue
            pod = pod_from_json(obj)
            if pod is None:
                continue
            pods[pod.uid] = pod
            if pod.config_hash:
                pods.setdefault(PodUid(pod.config_hash), pod)
        with self._lock:
            self._pods = pods
            self._mtime_ns = mtime

    def snapshot(self) -> PodSnapshot:
        try:
            self.reload()
        except ConfigError:
            pass  # keep the last good view; its contact time stops advancing below
        else:
            with self._lock:
                return PodSnapshot(
                    synced=True, last_contact_at=self._clock.monotonic(), pods=self._pods
                )
        with self._lock:
            return PodSnapshot(synced=True, last_contact_at=None, pods=self._pods)

    def node(self) -> NodeFacts:
        return NodeFacts(name=self._node, replicas=self._replicas)


def _objects(documents: list[Any]) -> Iterator[Mapping[str, Any]]:
    for doc in documents:
        if not isinstance(doc, Mapping):
            continue
        if doc.get("kind") == "List" or "items" in doc:
            for item in doc.get("items") or []:
                if isinstance(item, Mapping):
                    yield item
        elif doc.get("kind", "Pod") == "Pod":
            yield doc
