"""This node's pods and its Node, from the API server: ``KubePodDirectory``.

Owns the directory the enforcer, ``inspect`` and ``explain`` read (``ports.PodDirectory``,
``ports.NodeState``, ``ports.Lifecycle``): two reflectors (this node's pods, its Node) in daemon
threads (each pod translated as it is read, page by page, into the bounded ``Pod`` the
directory keeps; a pod that has finished is not kept, as if deleted), with an exempt label
configured also the Namespaces that carry it (``namespaces``), with DRA on also this node's
ResourceSlices and its pods' claims (``dra_claims``), an immutable pod view swapped on each
change, the contact time, and the current problem of each watcher. Must not decide anything
about enforcement (staleness is judged by the runtime from ``PodSnapshot.last_contact_at``),
and must never block ``snapshot()`` or ``node()``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import structlog
from kubernetes import client as k8s

from gpuguard.adapters.clock import SystemClock
from gpuguard.adapters.kube.namespaces import NamespaceLabels, exempt_names_thread
from gpuguard.adapters.kube.nodes import NodeView
from gpuguard.adapters.kube.reflector import POD_PAGE_SIZE, Reflector
from gpuguard.core.model import (
    LimitSource,
    NodeFacts,
    Pod,
    PodSnapshot,
    PodUid,
    ambiguous_config_hashes,
    index_pods,
)
from gpuguard.errors import GpuguardError
from gpuguard.kubemodel.translate import (
    node_pod_selector,
    pod_finished,
    pod_from_json,
    pod_uid,
)
from gpuguard.ports import Clock, HealthRecorder

if TYPE_CHECKING:
    from gpuguard.adapters.kube.dra_claims import DraReader
    from gpuguard.kubemodel.dra import Claim, ClaimKey, PodClaims

log = structlog.get_logger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class _Seen:
    """One pod object as read, translated: its uid, the ``Pod`` kept (``None``: it has finished,
    or is no pod) and, with DRA on, the claims it names."""

    uid: PodUid | None
    pod: Pod | None
    claims: PodClaims | None = None


class KubePodDirectory:
    """This node's pods and Node facts, kept by two watcher threads.

    ``start()`` once, ``stop()`` at shutdown; ``wait_synced`` waits for the first pod list and
    the first Node list. ``snapshot()``/``node()``/``problem()`` never block.
    """

    def __init__(
        self,
        api: k8s.ApiClient,
        *,
        node_name: str,
        clock: Clock | None = None,
        health: HealthRecorder | None = None,
        watch_timeout_seconds: float = 20.0,
        connect_timeout_seconds: float = 5.0,
        inactivity_seconds: float = 15.0,
        list_page_size: int = POD_PAGE_SIZE,
        dra: bool = False,
        exempt_label: tuple[str, str] | None = None,
        check_exempt_names: Collection[str] = (),
    ) -> None:
        """``watch_timeout_seconds`` is the server-side watch length: every re-watch is a
        contact, so keep it below the runtime's staleness bound (default 30 s) or
        ``last_contact_at`` of a quiet node would look stale. ``inactivity_seconds``: a watch
        that sends nothing for that long past its timeout is dropped (half-open TCP, F4).
        ``health`` counts the watch restarts (``None``: counted nowhere). ``list_page_size``:
        pods per list page (``POD_PAGE_SIZE``). ``dra``: also read
        this node's ResourceSlices and its pods' ResourceClaims, and give each pod naming a
        claim its ``LimitSource.DRA`` declaration (off: not one request more).
        ``exempt_label``: also watch the Namespaces that carry this label
        (``limits.exempt_namespace_label``; ``None``: not one request more).
        ``check_exempt_names``: at start, log which of these names (``limits.exempt_namespaces``)
        no Namespace has, or a tenant's does (``namespaces.log_exempt_names``)."""
        self.node_name = node_name
        self._clock: Clock = clock or SystemClock()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pods: dict[PodUid, Pod] = {}
        self._ambiguous_hashes: tuple[str, ...] = ()
        self._view: Mapping[PodUid, Pod] = MappingProxyType({})
        self._synced = False
        self._last_contact: float | None = None
        self._problems: dict[str, GpuguardError] = {}
        self._pods_synced = threading.Event()
        self._node = NodeView(node_name)
        self._threads: list[threading.Thread] = []
        core: Any = k8s.CoreV1Api(api)
        common: dict[str, Any] = {
            "stop_event": self._stop,
            "health": health,
            "watch_timeout_seconds": watch_timeout_seconds,
            "connect_timeout_seconds": connect_timeout_seconds,
            "inactivity_seconds": inactivity_seconds,
        }
        self._dra: DraReader | None = None
        if dra:  # imported only here: with DRA off not one DRA module is loaded
            from gpuguard.adapters.kube.dra_claims import DraReader

            self._dra = DraReader(
                api,
                node_name=node_name,
                clock=self._clock,
                on_change=self._republish,
                on_problem=self._set_problem,
                **common,
            )
        self._exempt_label = exempt_label
        self._exempt_names = tuple(check_exempt_names)
        self._core = core
        self._connect_timeout = connect_timeout_seconds
        self._namespaces, namespaces = self._namespace_reflector(core, common)
        self._reflectors: tuple[Reflector[Any], ...] = (
            Reflector(
                name="pods",
                call=core.list_pod_for_all_namespaces,
                field_selector=node_pod_selector(node_name),
                resource="pods",
                scope="cluster scope",
                translate=self._seen,
                on_replace=self._replace_pods,
                on_event=self._pod_event,
                on_contact=self._contact,
                on_problem=lambda p: self._set_problem("pods", p),
                page_size=list_page_size,
                **common,
            ),
            self._node.reflector(
                call=core.list_node, on_problem=lambda p: self._set_problem("node", p), **common
            ),
            *namespaces,
        )

    def _namespace_reflector(
        self, core: Any, common: dict[str, Any]
    ) -> tuple[NamespaceLabels | None, tuple[Reflector[Any], ...]]:
        """With an exempt label: the labelled Namespaces and their reflector; else nothing."""
        if self._exempt_label is None:
            return None, ()
        labels = NamespaceLabels(self._exempt_label, clock=self._clock)
        reflector = labels.reflector(
            call=core.list_namespace,
            on_problem=lambda p: self._set_problem("namespaces", p),
            **common,
        )
        return labels, (reflector,)

    # -- ports.Lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._threads:
            raise RuntimeError("KubePodDirectory already started")
        for reflector in self._reflectors:
            self._threads.append(reflector.thread(f"gpuguard-kube-{reflector.name}"))
        if self._dra is not None:
            self._threads.extend(self._dra.threads())
        if self._exempt_names:
            label = None if self._exempt_label is None else "=".join(self._exempt_label)
            self._threads.append(
                exempt_names_thread(
                    self._core,
                    self._exempt_names,
                    timeout_seconds=self._connect_timeout + 10.0,
                    label=label,
                )
            )
        for t in self._threads:
            t.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop both watchers: interrupts open watches; joins the threads (bounded)."""
        self._stop.set()
        for reflector in self._reflectors:
            reflector.interrupt()
        if self._dra is not None:
            self._dra.interrupt()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def wait_synced(self, timeout_seconds: float) -> bool:
        """Block until the first pod list and the first Node list answered (the labelled
        Namespaces are not waited for: until they are listed, no violation of a pod that may
        be exempt is acted on)."""
        deadline = time.monotonic() + timeout_seconds
        return self._pods_synced.wait(timeout_seconds) and self._node.synced.wait(
            max(0.0, deadline - time.monotonic())
        )

    def problem(self) -> GpuguardError | None:
        """The current persistent problem (e.g. ``KubeForbidden``), cleared by a good list."""
        with self._lock:
            for key in ("pods", "node", "namespaces", "slices", "claims"):
                if key in self._problems:
                    return self._problems[key]
            return None

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    # -- ports.PodDirectory, ports.NodeState -----------------------------------------------------

    def snapshot(self) -> PodSnapshot:
        labelled, contact = (
            self._namespaces.view() if self._namespaces is not None else (None, None)
        )
        with self._lock:
            return PodSnapshot(
                synced=self._synced,
                last_contact_at=self._last_contact,
                pods=self._view,
                labelled_namespaces=labelled,
                namespaces_contact_at=contact,
            )

    def reread(self, asked: Mapping[PodUid, float]) -> None:
        """The claims of these pods read again unless read since each pod's moment (DRA on;
        ``dra_claims.ClaimCache.reread``); pods and Nodes are watched: nothing else to read."""
        if self._dra is not None:
            self._dra.reread(asked)

    def node(self) -> NodeFacts:
        return self._node.node()

    def dra_claims(self) -> Mapping[ClaimKey, Claim | str]:
        """The ResourceClaims read for this node's pods (``dra_claims.ClaimCache.states``);
        empty with DRA off. Never blocks."""
        return self._dra.claims.states() if self._dra is not None else MappingProxyType({})

    # -- callbacks from the watcher threads ----------------------------------------------------

    def _contact(self) -> None:
        now = self._clock.monotonic()
        with self._lock:
            self._last_contact = now

    def _set_problem(self, key: str, problem: GpuguardError | None) -> None:
        with self._lock:
            if problem is None:
                self._problems.pop(key, None)
            else:
                if key not in self._problems:
                    log.error("kube_problem", watcher=key, error=str(problem))
                self._problems[key] = problem

    def _republish(self) -> None:
        with self._lock:
            self._publish_pods()

    def _with_dra(self) -> list[Pod]:  # caller holds the lock
        if self._dra is None:
            return list(self._pods.values())
        declared = self._dra.declarations()
        return [
            pod
            if pod.uid not in declared
            else dataclasses.replace(
                pod, declared={**pod.declared, LimitSource.DRA: declared[pod.uid]}
            )
            for pod in self._pods.values()
        ]

    def _publish_pods(self) -> None:  # caller holds the lock
        self._view = index_pods(self._with_dra())
        ambiguous = ambiguous_config_hashes(self._pods.values())
        if ambiguous != self._ambiguous_hashes:
            self._ambiguous_hashes = ambiguous
            for config_hash in ambiguous:
                log.warning(
                    "static_pod_hash_ambiguous",
                    config_hash=config_hash,
                    pods=sorted(
                        f"{p.namespace}/{p.name}"
                        for p in self._pods.values()
                        if p.config_hash == config_hash
                    ),
                    detail="more than one pod claims this static pod's hash: its processes are "
                    "attributed to none of them",
                )

    def _seen(self, obj: dict[str, Any]) -> _Seen:
        """The translation of one pod object as it is read (the reflector keeps nothing else of
        it). A finished pod is not kept: its containers have all stopped, and a process NVML
        still lists for a moment is then of a pod the directory does not know (``pod_unknown``:
        reported, never signalled), as after the pod is deleted."""
        pod = None if pod_finished(obj) else pod_from_json(obj)
        claims = None
        if self._dra is not None and pod is not None:
            claims = self._dra.claims_of(obj)
        return _Seen(uid=pod_uid(obj), pod=pod, claims=claims)

    def _replace_pods(self, items: list[_Seen]) -> None:
        pods: dict[PodUid, Pod] = {}
        for seen in items:
            if seen.pod is not None:
                pods[seen.pod.uid] = seen.pod
        if self._dra is not None:
            self._dra.pods_replaced(
                {s.pod.uid: s.claims for s in items if s.pod is not None and s.claims is not None}
            )
        with self._lock:
            self._pods = pods
            self._publish_pods()
            first = not self._synced
            self._synced = True
        self._pods_synced.set()
        log.info("kube_pods_listed", node=self.node_name, pods=len(pods), first=first)

    def _pod_event(self, kind: str, seen: _Seen) -> None:
        uid = seen.pod.uid if seen.pod is not None else seen.uid
        if uid is None:
            return
        pod = None if kind == "DELETED" else seen.pod
        if self._dra is not None:
            self._dra.pod_changed(uid, seen.claims if pod is not None else None)
        with self._lock:
            if pod is None and uid not in self._pods:
                return
            pods = dict(self._pods)
            if pod is None:
                pods.pop(uid, None)
            else:
                pods[uid] = pod
            self._pods = pods
            self._publish_pods()
