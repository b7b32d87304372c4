"""A pod directory read from a file of Pod manifests, for nodes tested without an API server.

Owns ``FilePodDirectory``: the same ``ports.PodDirectory`` as the API server's, fed from a YAML
file (a ``kind: List``, a multi-document stream, or ``kubectl get pods -o yaml`` output) that is
re-read when it changes. Used by GPU end-to-end runs and offline debugging; never in a cluster.
The file is read by ``adapters.manifest`` (bounded, regular files only, bounded YAML) and each
Pod translated by ``adapters.kube.pod_from_json``, so both directories agree. Workload pod
templates in the file are not running pods and are ignored.

A file that turns invalid (bad YAML, the wrong shape, binary, gone) never raises out of
``snapshot()``: the last good view is kept, its contact time stops advancing (so the runtime
pauses enforcement once it is stale, as for a lost API server), and the error is logged once per
change of the file.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path

import structlog

from gpuguard.adapters.kube import pod_from_json
from gpuguard.adapters.manifest import (
    MANIFEST_MAX_BYTES,
    InputError,
    PodManifest,
    ShapeProblem,
    load_yaml_documents,
    pod_manifests,
    read_bounded,
)
from gpuguard.core.model import NodeFacts, Pod, PodSnapshot, PodUid, index_pods
from gpuguard.errors import ConfigError
from gpuguard.ports import Clock

log = structlog.get_logger(__name__)

_Version = tuple[int, ...]
"""What identifies one state of the file: device, inode, size, mtime and ctime in ns (an editor
may rewrite a file within one mtime tick), or the errno of a failed ``stat``."""


class FilePodDirectory:
    """``ports.PodDirectory`` over a manifest file; every successful read counts as contact."""

    def __init__(
        self, path: Path, *, node_name: str, clock: Clock, replicas: int | None = None
    ) -> None:
        """Reads the file once. Raises ``ConfigError`` naming the file when it is invalid."""
        self._path = path
        self._node = node_name
        self._clock = clock
        self._replicas = replicas
        self._lock = threading.Lock()  # one reader at a time; guards everything below
        self._version: _Version | None = None  # of the last read, good or bad
        self._problem: str | None = None  # why the last read failed; None when it was good
        self._pods: Mapping[PodUid, Pod] = {}
        self._last_contact_at: float | None = None
        self.reload()

    def reload(self) -> None:
        """Re-read the file if it changed. Raises ``ConfigError`` naming the file if invalid."""
        with self._lock:
            problem = self._refresh()
        if problem is not None:
            raise ConfigError([problem])

    def snapshot(self) -> PodSnapshot:
        with self._lock:
            was_good = self._version is not None and self._problem is None
            seen = self._version
            problem = self._refresh()
            if problem is None:
                self._last_contact_at = self._clock.monotonic()
                if not was_good:
                    log.info("pods_file_valid", path=str(self._path), pods=len(self._pods))
            elif self._version != seen:  # a new bad state of the file: say so, once
                log.error("pods_file_invalid", path=str(self._path), error=problem)
            return PodSnapshot(synced=True, last_contact_at=self._last_contact_at, pods=self._pods)

    def node(self) -> NodeFacts:
        return NodeFacts(name=self._node, replicas=self._replicas)

    def _refresh(self) -> str | None:
        """Read the file if its version changed; the problem with it, or ``None`` if good.

        A bad file leaves ``_pods`` as it was. Called with ``_lock`` held.
        """
        version = self._stat()
        if version == self._version:
            return self._problem
        problem: str | None = None
        try:
            pods = self._read()
        except InputError as exc:
            problem = str(exc)
        else:
            self._pods = pods
        self._version = version
        self._problem = problem
        return problem

    def _stat(self) -> _Version:
        try:
            st = os.stat(self._path)
        except OSError as exc:
            return (exc.errno or -1,)
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def _read(self) -> Mapping[PodUid, Pod]:
        """This node's pods in the file; raises ``InputError`` naming the file and the place."""
        name = str(self._path)
        text = read_bounded(self._path, max_bytes=MANIFEST_MAX_BYTES, what="pods file")
        pods: list[Pod] = []
        for number, document in enumerate(load_yaml_documents(text, where=name), start=1):
            for found in pod_manifests(
                document, where=f"{name}: document {number}", templates=False, default_kind="Pod"
            ):
                if isinstance(found, ShapeProblem):
                    raise InputError(found.message)
                if not isinstance(found, PodManifest):
                    continue  # a Service, a Deployment: not a running pod
                if found.problems:
                    raise InputError(f"{found.where}: {found.description}: {found.problems[0]}")
                spec = found.pod.get("spec")
                node = spec.get("nodeName") if isinstance(spec, Mapping) else None
                if node not in (None, self._node):
                    continue
                pod = pod_from_json(found.pod)
                if pod is not None:
                    pods.append(pod)
        return index_pods(pods)
