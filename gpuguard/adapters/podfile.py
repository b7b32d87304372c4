"""A pod directory read from a file of Pod manifests, for nodes tested without an API server.

Owns ``FilePodDirectory``: the same ports as the API server's directory (``PodDirectory``,
``NodeState``, ``Lifecycle``), fed from a YAML file (a ``kind: List``, a multi-document stream,
or ``kubectl get pods -o yaml`` output) that a watcher thread re-reads when it changes. Used by
GPU end-to-end runs and offline debugging; never in a cluster. The file is read by
``adapters.manifest`` (bounded, regular files only, bounded YAML) and each Pod translated by
``kubemodel.translate``, so both directories agree. The watcher sleeps until inotify says
the file or a link on the way to it may have changed (``adapters.inotify``), and looks anyway
every ``LOOK_ANYWAY_SECONDS``; where inotify cannot watch it, it looks every ``POLL_SECONDS``.
Another file changing in the same directory (a log) still wakes it, though it does not look.
Workload pod templates in the file are not running pods and are ignored. Must not do I/O in
``snapshot()`` or ``node()``: they return the view in memory.

A file that turns invalid (bad YAML, the wrong shape, binary, gone) never stops the directory:
the last good view is kept, its contact time stops advancing (so the runtime pauses enforcement
once it is stale, as for a lost API server), the error is logged once per change of the file and
is the directory's ``problem()`` until the file is good again.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Mapping
from pathlib import Path

import structlog

from gpuguard.adapters.inotify import FileNotices
from gpuguard.adapters.manifest import (
    MANIFEST_MAX_BYTES,
    InputError,
    OtherObject,
    PodManifest,
    ShapeProblem,
    load_yaml_documents,
    pod_manifests,
    read_bounded,
)
from gpuguard.adapters.readiness import readable
from gpuguard.core.model import NodeFacts, Pod, PodSnapshot, PodUid, index_pods
from gpuguard.errors import ConfigError, GpuguardError
from gpuguard.kubemodel.translate import labelled_namespace, pod_from_json
from gpuguard.ports import Clock

log = structlog.get_logger(__name__)

POLL_SECONDS = 0.5
"""How often the watcher looks at the file (one ``stat``; a read only when it changed) while
inotify cannot watch it."""

LOOK_ANYWAY_SECONDS = 30.0
"""How often the watcher looks at a file inotify watches though no notice came: a change inotify
does not see (a network file system changed by another host) is picked up within this."""

_Version = tuple[int, ...]
"""What identifies one state of the file: device, inode, size, mtime and ctime in ns (an editor
may rewrite a file within one mtime tick), or the errno of a failed ``stat``."""


class FilePodDirectory:
    """A pod directory over a manifest file; every look at a good file counts as contact, and
    so does every moment a good file is watched by inotify (any change would have been noticed).

        ``start()`` reads the file (``ConfigError`` naming it when it is invalid) and starts the
        watcher; ``stop()`` ends it. A pods file has no Node: ``node()`` is always ``seen``, with
        the ``replicas`` given here.
    """

    def __init__(
        self,
        path: Path,
        *,
        node_name: str,
        clock: Clock,
        replicas: int | None = None,
        poll_seconds: float = POLL_SECONDS,
        exempt_label: tuple[str, str] | None = None,
    ) -> None:
        """Does no I/O: ``start()`` reads the file. ``exempt_label``: the admin's namespace
        label that exempts (``limits.exempt_namespace_label``); the file's ``Namespace``
        objects say which namespaces carry it, and a namespace the file has no ``Namespace``
        for carries none: the file is the admin's whole account of the node."""
        self._path = path
        self._node = node_name
        self._clock = clock
        self._replicas = replicas
        self._poll_seconds = poll_seconds
        self._stop = threading.Event()
        self._synced = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards the view below; reads happen outside it
        self._version: _Version | None = None  # of the last read, good or bad (watcher only)
        self._problem: InputError | None = None  # why the last read failed; None when good
        self._pods: Mapping[PodUid, Pod] = {}
        self._exempt_label = exempt_label
        self._labelled: frozenset[str] = frozenset()
        self._last_contact_at: float | None = None
        self._watched = False
        """Inotify watches the file now: a good view is current (contact is now)."""
        self._wake: tuple[int, int] | None = None
        """A pipe, from ``start()`` until ``stop()``: ``stop()`` writes a byte to it, which ends
        the watcher's wait at once."""
        self._polled = False
        """The file is looked at every poll interval, not watched (logged once when it starts)."""

    # -- ports.Lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Blocking (one read): raises ``ConfigError`` naming the file when it is invalid."""
        if self._thread is not None:
            raise RuntimeError("FilePodDirectory already started")
        self._version = self._stat()
        try:
            pods, labelled = self._read()
        except InputError as problem:
            raise ConfigError([str(problem)]) from None
        self._serve(pods, labelled)
        self._wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._watch, name="gpuguard-pods-file", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        wake = self._wake
        if wake is not None:
            with contextlib.suppress(BlockingIOError):  # a byte is already there
                os.write(wake[1], b"x")
        if self._thread is not None:
            self._thread.join(max(1.0, 4 * self._poll_seconds))
            if not self._thread.is_alive() and wake is not None:  # else it may still wait on it
                self._wake = None
                for fd in wake:
                    os.close(fd)
        self._set_watched(False)

    def wait_synced(self, timeout_seconds: float) -> bool:
        """Whether the file was read once (``start()`` does it, or fails)."""
        return self._synced.wait(timeout_seconds)

    def problem(self) -> GpuguardError | None:
        """Why the file is invalid now (the last good view is still served); ``None`` if good."""
        with self._lock:
            return self._problem

    # -- ports.PodDirectory, ports.NodeState ---------------------------------------------------

    def snapshot(self) -> PodSnapshot:
        with self._lock:
            current = self._watched and self._problem is None
            contact = self._clock.monotonic() if current else self._last_contact_at
            return PodSnapshot(
                synced=self._synced.is_set(),
                last_contact_at=contact,
                pods=self._pods,
                labelled_namespaces=None if self._exempt_label is None else self._labelled,
                namespaces_contact_at=None if self._exempt_label is None else contact,
            )

    def reread(self, asked: Mapping[PodUid, float]) -> None:
        """Nothing to read again: the file is watched whole, and carries no DRA claims."""

    def node(self) -> NodeFacts:
        return NodeFacts(name=self._node, replicas=self._replicas)

    # -- the watcher ---------------------------------------------------------------------------

    def _watch(self) -> None:
        assert self._wake is not None  # start() made it
        stopping = self._wake[0]
        notices = self._start_notices()
        try:
            while not self._stop.is_set():
                watching = [stopping] if notices is None else [stopping, notices.fileno()]
                wait = self._poll_seconds if notices is None else LOOK_ANYWAY_SECONDS
                ready = readable(watching, wait)
                if self._stop.is_set():
                    return
                noticed = not ready  # the look-anyway time came
                if notices is not None and notices.fileno() in ready:
                    notices, noticed = self._take_notices(notices)
                if noticed or notices is None:  # not for another file in its directory
                    self._look()
                if notices is None:
                    notices = self._start_notices()
        finally:
            if notices is not None:
                notices.close()

    def _look(self) -> None:
        try:
            self._poll()
        except Exception:  # a bug must not end the watcher silently: try again next time
            log.exception("pods_file_watcher_failed", path=str(self._path))

    def _start_notices(self) -> FileNotices | None:
        """Inotify watches on the file, then a look (a change just before the watches began
        has no notice); ``None`` where inotify cannot watch it (then it is looked at every poll
        interval, and watched as soon as it can be). Logged when either begins."""
        try:
            notices = FileNotices(str(self._path))
        except OSError as exc:
            if not self._polled:
                self._polled = True
                log.info("pods_file_polled", path=str(self._path), error=str(exc))
            return None
        if self._polled:
            self._polled = False
            log.info("pods_file_watched", path=str(self._path))
        self._set_watched(True)
        self._look()
        return notices

    def _take_notices(self, notices: FileNotices) -> tuple[FileNotices | None, bool]:
        """Take the pending notices and, when one may concern the file, watch what decides the
        path now (a changed link may lead elsewhere); the watches (``None`` once they cannot
        follow: the directory is gone) and whether the file may have changed."""
        try:
            noticed = notices.take()
            if noticed:
                notices.rewatch()
        except OSError as exc:
            notices.close()
            self._set_watched(False)
            self._polled = True
            log.info("pods_file_polled", path=str(self._path), error=str(exc))
            return None, True
        return notices, noticed

    def _set_watched(self, watched: bool) -> None:
        """Inotify watches the file, or stops: a good view was current until now."""
        with self._lock:
            if self._watched and self._problem is None:
                self._last_contact_at = self._clock.monotonic()
            self._watched = watched

    def _poll(self) -> None:
        """Read the file if it changed since the last look; a good file is contact."""
        version = self._stat()
        if version == self._version:
            if self._problem is None:
                with self._lock:
                    self._last_contact_at = self._clock.monotonic()
            return
        self._version = version
        try:
            pods, labelled = self._read()
        except InputError as problem:
            with self._lock:
                if self._watched and self._problem is None:  # current until this change
                    self._last_contact_at = self._clock.monotonic()
                self._problem = problem
            log.error("pods_file_invalid", path=str(self._path), error=str(problem))
            return
        if self._problem is not None:
            log.info("pods_file_valid", path=str(self._path), pods=len(pods))
        self._serve(pods, labelled)

    def _serve(self, pods: Mapping[PodUid, Pod], labelled: frozenset[str]) -> None:
        with self._lock:
            self._pods = pods
            self._labelled = labelled
            self._problem = None
            self._last_contact_at = self._clock.monotonic()
        self._synced.set()

    def _stat(self) -> _Version:
        try:
            st = os.stat(self._path)
        except OSError as exc:
            return (exc.errno or -1,)
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def _read(self) -> tuple[Mapping[PodUid, Pod], frozenset[str]]:
        """This node's pods in the file, and the namespaces whose ``Namespace`` in it carries
        the exempt label; raises ``InputError`` naming the file and the place."""
        name = str(self._path)
        text = read_bounded(self._path, max_bytes=MANIFEST_MAX_BYTES, what="pods file")
        pods: list[Pod] = []
        labelled: set[str] = set()
        for number, document in enumerate(load_yaml_documents(text, where=name), start=1):
            for found in pod_manifests(
                document, where=f"{name}: document {number}", templates=False, default_kind="Pod"
            ):
                if isinstance(found, ShapeProblem):
                    raise InputError(found.message)
                if isinstance(found, OtherObject) and found.kind == "Namespace":
                    if self._exempt_label is not None:
                        namespace = labelled_namespace(found.object, *self._exempt_label)
                        labelled.update(() if namespace is None else (namespace,))
                    continue
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
        return index_pods(pods), frozenset(labelled)
